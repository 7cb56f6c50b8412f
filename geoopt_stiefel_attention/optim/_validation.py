"""Argument checks of the frame optimizers: group options (one table, :data:`SHARED_OPTIONS`, for the options
both optimizers have, and each optimizer's own), parameters and, before each step, gradients, fresh frames and
what torch's AdamW would refuse inside its step. Each failure raises before anything changes, naming the fix."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from geoopt.manifolds import EuclideanStiefel

from .. import _linalg
from .. import distributed as _distributed
from .._linalg import ADJUST_LR_FNS
from ..manifolds import has_manifold as _has_manifold
from ..manifolds import is_frame as _is_frame
from ._state import _capturable, _torch_capturable

_local = _distributed.local_tensor

#: Largest ``max |W^T W - I|`` accepted for a frame at its first step, per parameter dtype (defined in
#: ``_linalg``, where the re-projection of frames after a cast reads it too).
ORTHONORMALITY_TOLERANCE = _linalg.ORTHONORMALITY_TOLERANCE

#: The accepted values of the ``second_moment`` option (re-exported by ``_reference``, whose ablations they name).
SECOND_MOMENTS = ("frame", "column", "element", None)

#: The constructor's default: the radius :data:`~.._linalg.AUTO_TRUST_REGION` gives the group's ``adjust_lr_fn``.
_DEFAULT_TRUST_REGION = "auto"

#: The group options StiefelAdam adds to torch's Adam options, with the defaults a state dict saved before an
#: option existed (or by geoopt's RiemannianAdam) loads with. The radius loads as ``"auto"`` (the paper's 0.1
#: under the rule such a state dict loads with), so that it follows a rule set on the group afterwards.
_GROUP_DEFAULTS = {"trust_region": _DEFAULT_TRUST_REGION, "second_moment": "frame", "stabilize": None,
                   "master_weights": False, "adjust_lr_fn": "original"}


def _require(ok: bool, message: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(message)


def check_tensor_lr(lr: torch.Tensor, name: str) -> None:
    """A tensor ``lr`` (torch's capturable/compiled schedules): one floating-point element, and, where its value
    can be read without a device synchronisation or a graph break (a CPU tensor outside torch.compile), finite and
    ``>= 0`` like a float ``lr``; a negative one would climb the loss without a word."""
    _require(lr.numel() == 1 and lr.is_floating_point(),
             f"{name}: lr is a tensor of shape {tuple(lr.shape)} and dtype {lr.dtype}; a tensor lr must hold one "
             f"floating-point value (e.g. torch.tensor(1e-3)).")
    if lr.device.type == "cpu" and not torch.compiler.is_compiling():
        value = float(lr)
        _require(math.isfinite(value) and value >= 0,
                 f"{name}: lr=tensor({value:g}) is invalid; pass a finite value >= 0 (e.g. torch.tensor(1e-3)).")


# ----------------------------------------------------------------------------- the option table
def _real(x: Any) -> bool:
    """A real number given as a Python int or float: a bool is not a number (``True`` is not a rate)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite_at_least(x: Any, low: float) -> bool:
    return _real(x) and math.isfinite(x) and x >= low


def _in_unit_interval(x: Any) -> bool:
    """In ``[0, 1)``, as torch's ``betas`` and ``momentum``."""
    return _real(x) and 0.0 <= x < 1.0


@dataclass(frozen=True)
class Option:
    """A group option and its one check, shared by every optimizer that has the option.

    ``valid(value)`` decides; a refusal raises ``exc`` with ``"{owner}: {name}={value!r} {verdict} {fix}"``, in which
    ``{owner}`` in ``fix`` is the optimizer's name too, so the same value gets the same answer and the same words
    in :class:`~geoopt_stiefel_attention.StiefelAdam` and :class:`~geoopt_stiefel_attention.StiefelMuon`.
    ``refine(value, owner)``, when given, checks further a value ``valid`` let through (a tensor ``lr``).
    """

    name: str
    valid: Callable[[Any], bool]
    fix: str
    verdict: str = "is invalid;"
    exc: type[Exception] = ValueError
    refine: Callable[[Any, str], None] | None = None

    def check(self, group: dict[str, Any], owner: str) -> None:
        """Refuse ``group[name]`` (an option a group lacks is not checked: torch fills it on load)."""
        if self.name not in group:
            return
        value = group[self.name]
        if not self.valid(value):
            raise self.exc(f"{owner}: {self.name}={value!r} {self.verdict} {self.fix.format(owner=owner)}")
        if self.refine is not None:
            self.refine(value, owner)


def _refine_lr(lr: Any, owner: str) -> None:
    if isinstance(lr, torch.Tensor):
        check_tensor_lr(lr, owner)


#: The options both frame optimizers have, each declared once with its check: torch's Adam options (the AdamW
#: step of the parameters that are not frames reads them) and the frame options the two rules share.
#: ``StiefelAdam(weight_decay=True)`` and ``StiefelMuon(weight_decay=True)`` get one answer: refused, as a bool is
#: not a number (torch's AdamW accepts it as 1.0).
SHARED_OPTIONS: tuple[Option, ...] = (
    Option("fused", lambda v: not v,
           "frames always use their own fused in-place kernel and other parameters torch's AdamW implementation "
           "selected by `foreach`. Pass fused=None (the default), or leave 'fused' out of the parameter group.",
           verdict="is not supported:"),
    Option("differentiable", lambda v: not v,
           "the frame update runs in place under torch.no_grad(), so no graph through the step exists. Pass "
           "differentiable=False (the default), or leave 'differentiable' out of the parameter group.",
           verdict="is not supported:"),
    Option("decoupled_weight_decay", bool,
           "(torch.optim.Adam's L2 penalty, added to the gradient): {owner} applies decoupled (AdamW) weight decay to "
           "Euclidean parameters. Leave 'decoupled_weight_decay' out of the parameter group (or set it to True), or "
           "train those parameters with torch.optim.Adam.", verdict="is not supported"),
    Option("lr", lambda v: isinstance(v, torch.Tensor) or _finite_at_least(v, 0.0),
           "pass a finite float >= 0 (e.g. lr=1e-3; lr=0 moves nothing, as at the start of a warm-up) or a "
           "one-element tensor.", refine=_refine_lr),
    Option("betas", lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(map(_in_unit_interval, v)),
           "pass two floats in [0, 1), e.g. betas=(0.9, 0.999)."),
    Option("eps", lambda v: _finite_at_least(v, 0.0), "pass a finite float >= 0 (e.g. eps=1e-8)."),
    Option("weight_decay", lambda v: _finite_at_least(v, 0.0),
           "pass the decay rate as a finite float >= 0 (e.g. weight_decay=0.1; a bool is not a rate)."),
    Option("adjust_lr_fn", lambda v: v in ADJUST_LR_FNS,
           "use 'match_rms_adamw' (one lr for the frames and the AdamW parameters) or 'original' (the rule's own "
           "scale: see the optimizer's adjust_lr_fn).", verdict="is unknown;"),
    Option("master_weights", lambda v: isinstance(v, bool),
           "pass True (keep a float32 master copy of bf16/fp16 frames) or False."),
    Option("capturable", lambda v: v is None or isinstance(v, bool),
           "pass True, False or None (True on accelerators)."),
    Option("foreach", lambda v: v is None or isinstance(v, bool),
           "pass True, False or None (torch's choice), as to torch.optim.AdamW."),
    Option("amsgrad", lambda v: isinstance(v, bool), "pass True or False, as to torch.optim.AdamW."),
    Option("maximize", lambda v: isinstance(v, bool), "pass True or False, as to torch.optim.AdamW."),
)


def _check_tensor_lr_with_foreach(group: dict[str, Any], owner: str) -> None:
    """torch's AdamW takes a tensor ``lr`` with ``foreach=True`` only with ``capturable=True`` (its constructor
    refuses the rest, and its foreach step raises for them): refused here whatever the parameters, in the same
    words in both optimizers, before anything changes (StiefelMuon accepted it and moved its frames before torch
    raised for the Euclidean part)."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and group.get("foreach") and group.get("capturable") is not True:
        raise ValueError(
            f"{owner}: lr is a tensor and foreach=True, with capturable={group.get('capturable')!r}: torch's AdamW "
            f"(the step of the parameters that are not frames) supports a tensor lr in its foreach step only with "
            f"capturable=True on an accelerator, and torch.optim.AdamW refuses this combination too. Pass "
            f"foreach=None (or False), a float lr, or capturable=True with the parameters on an accelerator.")


#: Checks of combinations of options that both optimizers share.
SHARED_RULES: tuple[Callable[[dict[str, Any], str], None], ...] = (_check_tensor_lr_with_foreach,)


def check_group(group: dict[str, Any], owner: str, options: tuple[Option, ...],
                rules: tuple[Callable[[dict[str, Any], str], None], ...] = ()) -> None:
    """Check every option of ``group`` that ``options`` declares, then the combinations ``rules`` check; raise
    naming the option (and ``owner``, the optimizer) and the fix."""
    for option in options:
        option.check(group, owner)
    for rule in rules:
        rule(group, owner)


# ----------------------------------------------------------------------------- StiefelAdam's own options
#: The options only StiefelAdam has.
ADAM_OPTIONS: tuple[Option, ...] = (
    Option("trust_region", lambda v: v is None or v == "auto" or (_real(v) and math.isfinite(v) and v > 0),
           f"pass a finite float > 0 (a cap on each frame's ||s||_F), 'auto' (the default: "
           f"{_linalg.AUTO_TRUST_REGION['original']} under adjust_lr_fn='original', "
           f"{_linalg.AUTO_TRUST_REGION['match_rms_adamw']} under 'match_rms_adamw') or None to disable the cap."),
    Option("second_moment", lambda v: v in SECOND_MOMENTS,
           "use one of 'frame' (default), 'column', 'element', or None (fixed-step Riemannian SGD with momentum).",
           verdict="is unknown;"),
    Option("stabilize", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
           "pass a positive int (re-project every that many steps) or None."),
)


def _check_stabilize_with_capturable(group: dict[str, Any], owner: str) -> None:
    st = group.get("stabilize")
    _require(not (group.get("capturable") and st is not None),
             f"{owner}: stabilize={st!r} cannot be combined with capturable=True (re-projecting every k steps reads "
             f"the step count on the host); pass stabilize=None or capturable=False.")


#: The checks of combinations of StiefelAdam's options.
ADAM_RULES: tuple[Callable[[dict[str, Any], str], None], ...] = SHARED_RULES + (_check_stabilize_with_capturable,)


_ABSENT = object()  # an option a group lacks


def option_snapshot(group: dict[str, Any], names: tuple[str, ...]) -> tuple:
    """The values of the options ``names`` in ``group``, as :func:`options_unchanged` compares them later (a list,
    e.g. ``betas``, copied into a tuple of its items, since it can be changed in place)."""
    return tuple(tuple(value) if isinstance(value, list) else value
                 for value in (group.get(name, _ABSENT) for name in names))


def options_unchanged(snapshot: tuple, group: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether every option ``names`` of ``group`` is the very object :func:`option_snapshot` held (the items
    of a list, each the same object): an option written since (a scheduler's new float, ``True`` for ``1``, an item
    of ``betas`` replaced) makes it ``False``, and so does a tensor (a scheduled ``lr``: its value can change in
    place), which is therefore checked at every step. Identity, not equality: ``1 == True`` in Python, not as an
    option."""
    for name, was in zip(names, snapshot, strict=True):
        now = group.get(name, _ABSENT)
        if now is was and not isinstance(now, (torch.Tensor, list)):
            continue
        if not (isinstance(now, list) and isinstance(was, tuple) and len(now) == len(was)
                and all(a is b for a, b in zip(now, was, strict=True))):
            return False
    return True


def check_euclidean_step(group: dict[str, Any], k: int, params: list[torch.Tensor], owner: str,
                         state: dict[torch.Tensor, Any] | None = None) -> None:
    """Refuse, before anything changes, what torch's AdamW would refuse or fail on inside its step for group
    ``k``'s parameters that are not frames (``params``): a tensor ``lr`` with ``foreach=True`` for a parameter on a
    device where torch's AdamW has no capturable step (the CPU: its foreach step refuses the tensor), state without
    an entry it reads (``max_exp_avg_sq`` when ``amsgrad`` was switched on after the first step), and a step count
    on another device than its parameter where torch's AdamW runs capturable (it asserts both on one device)."""
    lr = group.get("lr")
    tensor_lr_foreach = isinstance(lr, torch.Tensor) and group.get("foreach")
    needed = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    for p in params:
        if tensor_lr_foreach and not _torch_capturable(group, p.device):
            raise ValueError(
                f"{owner}: parameter group {k} has a tensor lr and foreach=True, and holds a parameter that is not a "
                f"frame (shape {tuple(p.shape)}) on {p.device.type}, where torch's AdamW has no capturable step, so "
                f"its foreach step would refuse the tensor lr. Pass foreach=None (or False) or a float lr.")
        st = state.get(p) if state is not None else None
        if not st:
            continue
        missing = [key for key in needed if not isinstance(st.get(key), torch.Tensor)]
        if missing:
            raise ValueError(
                f"{owner}: a parameter that is not a frame (shape {tuple(p.shape)}, group {k}) has optimizer "
                f"state without {missing}, which torch's AdamW reads (amsgrad switched on after its first "
                f"step?). Restore the option, or restart its moments with optimizer.state[p].clear().")
        step = st["step"]
        if step.device != p.device and _torch_capturable(group, p.device):
            raise ValueError(
                f"{owner}: a parameter that is not a frame (shape {tuple(p.shape)}, on {p.device}) has its step count "
                f"on {step.device} while its group (group {k}) is capturable, where torch's AdamW needs both on one "
                f"device (capturable was switched on after its first step?). Set capturable back, or reload the "
                f"state, which places step counts for the group's capturable: "
                f"optimizer.load_state_dict(optimizer.state_dict()).")


def _check_manifold(p: torch.Tensor, name: str = "StiefelAdam") -> None:
    """Reject a parameter on a manifold the optimizer does not implement, naming the fix."""
    if not _has_manifold(p):
        return
    manifold = p.manifold
    if _is_frame(p) and not isinstance(manifold, EuclideanStiefel):
        raise ValueError(
            f"{name}: parameter of shape {tuple(p.shape)} is on geoopt's CanonicalStiefel (the default "
            f"of geoopt.Stiefel()), whose canonical metric this optimizer does not implement. Create it on "
            f"geoopt_stiefel_attention.PolarStiefel() (or geoopt.EuclideanStiefel()) instead, or train it "
            f"with geoopt.optim.RiemannianAdam."
        )
    if not _is_frame(p):
        raise ValueError(
            f"{name}: parameter of shape {tuple(p.shape)} is on {manifold!r}; {name} trains "
            f"Stiefel frames (PolarStiefel / EuclideanStiefel) and Euclidean parameters only. Use "
            f"geoopt.optim.RiemannianAdam for other manifolds."
        )


def _check_parameter(p: torch.Tensor, name: str = "StiefelAdam") -> None:
    """Reject parameters the optimizer cannot train, naming the fix."""
    _distributed.check_parameter(p)  # sharded (FSDP/DTensor) parameters: NotImplementedError
    _check_manifold(p, name)
    if _distributed.flattened_by_fsdp1(p):
        what = "frame parameter" if _is_frame(p) else "flat parameter holding frames,"
        raise NotImplementedError(f"{name}: {what} {tuple(p.shape)}: {_distributed.FSDP1_REFUSAL}.")
    if not _is_frame(p):
        return
    if p.is_complex():
        raise TypeError(f"{name}: frame parameter of shape {tuple(p.shape)} is complex; Stiefel frames "
                        f"must be real (float64, float32, bfloat16 or float16).")
    if p.dim() < 2 or p.shape[-1] > p.shape[-2]:
        raise ValueError(f"{name}: frame parameter of shape {tuple(p.shape)} is not a stack of d x r frames "
                         f"with r <= d (orthonormal columns cannot outnumber rows). Store frames as (..., d, r), "
                         f"e.g. transpose a (r, d) matrix, or use fewer columns.")


def _can_read_host() -> bool:
    """False while torch.compile traces or a CUDA graph is captured (a host read would break or fail them)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def validate_step(param_groups: list[dict[str, Any]], state: dict[torch.Tensor, Any], name: str,
                  check_options: Callable[[int, dict[str, Any]], None],
                  check_frame_state: Any = None) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Check every group's options with ``check_options(k, group)`` (a scheduler or a user may have rewritten
    ``param_groups`` since they were checked), every gradient, every fresh frame and
    (``check_frame_state(p, group, state)``) the state of every frame that has one against its group's options,
    before anything is changed.

    Returns, per group, its parameters with a gradient split into frames and the rest (the step's two updates),
    found on the way."""
    for k, group in enumerate(param_groups):
        check_options(k, group)
    split = []
    for k, group in enumerate(param_groups):
        frames, euclidean = [], []
        split.append((frames, euclidean))
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            st = state.get(p)  # one lookup per parameter (a tensor key hashes in Python)
            if grad.is_sparse:
                raise ValueError(f"{name}: parameter of shape {tuple(p.shape)} has a sparse gradient, "
                                 f"which is not supported; use a dense gradient (e.g. nn.Embedding("
                                 f"sparse=False)) or geoopt.optim.SparseRiemannianAdam.")
            if not _is_frame(p):
                if _has_manifold(p):  # a manifold assigned after the parameter was added
                    _check_manifold(p, name)
                moment = st.get("exp_avg") if st is not None else None
                if moment is not None and moment.shape != p.shape:
                    raise ValueError(
                        f"{name}: parameter of shape {tuple(p.shape)} has optimizer state of shape "
                        f"{tuple(moment.shape)}: it was resized after the optimizer's last step (unstiefelize turns a "
                        f"converted weight's rest back into the whole stock weight); build a new optimizer for the "
                        f"model as it is now. Nothing was changed.")
                euclidean.append(p)
                continue
            frames.append(p)
            if not isinstance(p.manifold, EuclideanStiefel):
                _check_manifold(p, name)
            if grad.is_complex():
                raise TypeError(f"{name}: frame parameter of shape {tuple(p.shape)} has a complex "
                                f"gradient; frames and their gradients must be real.")
            local = _local(p)  # a sharded frame: each rank checks its own whole frames
            if st and check_frame_state is not None:
                check_frame_state(p, group, st)
            if not st and local.numel() and (not _capturable(group, p.device) or _can_read_host()):
                err = float(_linalg.orthonormality_error(local))
                tol = ORTHONORMALITY_TOLERANCE.get(p.dtype, 1e-4)
                if not err <= tol:
                    raise ValueError(
                        f"{name}: frame parameter of shape {tuple(p.shape)} ({p.dtype}) is off the "
                        f"Stiefel manifold at its first step: max|W^T W - I| = {err:.3g} > {tol:g}. "
                        f"Project it first with `param.proj_()` (inside torch.no_grad())."
                    )
        check_euclidean_step(group, k, euclidean, name, state)
    return split


#: The options only StiefelMuon has (those both optimizers have are :data:`~._validation.SHARED_OPTIONS`).
MUON_OPTIONS: tuple[Option, ...] = (
    Option("momentum", _in_unit_interval, "pass a float in [0, 1) (torch's Muon uses 0.95)."),
    Option("nesterov", lambda v: isinstance(v, bool), "pass True or False."),
    Option("direction_tol", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    and 0.0 < v < 1.0),
           "pass a float in (0, 1), the relative duality gap at which the direction solver stops, or None (1e-7 in "
           "float64, 1e-3 in float32)."),
    Option("direction_steps", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                                      and 1 <= v <= 1000),
           "pass an int in [1, 1000], the cap on the direction solver's iterations, or None (the count that "
           "suffices for every input)."),
    Option("stabilize", lambda v: v is None,
           "(the polar retraction keeps frames on the manifold); pass stabilize=None.", verdict="is not supported"),
)
