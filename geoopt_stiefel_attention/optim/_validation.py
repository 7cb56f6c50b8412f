"""Argument checks of :class:`~geoopt_stiefel_attention.StiefelAdam`: group options, parameters and, before
each step, gradients and fresh frames. Each failure raises before anything changes, naming the fix."""

from __future__ import annotations

import math
from typing import Any

import torch
from geoopt.manifolds import EuclideanStiefel

from .. import _linalg
from .. import distributed as _distributed
from .._linalg import ADJUST_LR_FNS
from ..manifolds import has_manifold as _has_manifold
from ..manifolds import is_frame as _is_frame
from ._reference import SECOND_MOMENTS
from ._state import _capturable

_local = _distributed.local_tensor

#: Largest ``max |W^T W - I|`` accepted for a frame at its first step, per parameter dtype (defined in
#: ``_linalg``, where the re-projection of frames after a cast reads it too).
ORTHONORMALITY_TOLERANCE = _linalg.ORTHONORMALITY_TOLERANCE

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


def check_torch_flags(group: dict[str, Any], name: str) -> None:
    """Refuse torch's Adam flags that a group may carry (a group dict, or written into ``param_groups`` later) but
    that the frame optimizers do not implement: torch would honour them, so ignoring them would change the update
    (``decoupled_weight_decay=False``: an L2 penalty instead of decoupled decay) or drop what they promise
    (``differentiable=True``: a graph through the step; ``fused=True``: torch's fused kernel) without a word."""
    fused = group.get("fused")
    _require(not fused,
             f"{name}: fused={fused!r} is not supported: frames always use their own fused in-place kernel and other "
             f"parameters torch's AdamW implementation selected by `foreach`. Pass fused=None (the default), or "
             f"leave 'fused' out of the parameter group.")
    diff = group.get("differentiable", False)
    _require(not diff,
             f"{name}: differentiable={diff!r} is not supported: the frame update runs in place under "
             f"torch.no_grad(), so no graph through the step exists. Pass differentiable=False (the default), or "
             f"leave 'differentiable' out of the parameter group.")
    decoupled = group.get("decoupled_weight_decay", True)
    _require(bool(decoupled),
             f"{name}: decoupled_weight_decay={decoupled!r} (torch.optim.Adam's L2 penalty, added to the gradient) "
             f"is not supported: {name} applies decoupled (AdamW) weight decay to Euclidean parameters. Leave "
             f"'decoupled_weight_decay' out of the parameter group (or set it to True), or train those parameters "
             f"with torch.optim.Adam.")


def _validate_hyperparameters(group: dict[str, Any]) -> None:
    """Raise a ``ValueError`` that names the option and the fix when a group option is out of range."""
    check_torch_flags(group, "StiefelAdam")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        check_tensor_lr(lr, "StiefelAdam")
    else:
        _require(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0 and math.isfinite(lr),
                 f"StiefelAdam: lr={lr!r} is invalid; pass a finite float >= 0 (e.g. lr=1e-3; lr=0 moves "
                 f"nothing, as at the start of a warm-up).")
    eps = group["eps"]
    _require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0 and math.isfinite(eps),
             f"StiefelAdam: eps={eps!r} is invalid; pass a finite float >= 0 (e.g. eps=1e-8).")
    betas = group["betas"]
    _require(isinstance(betas, (tuple, list)) and len(betas) == 2
             and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas),
             f"StiefelAdam: betas={betas!r} is invalid; pass two floats in [0, 1), e.g. betas=(0.9, 0.999).")
    wd = group["weight_decay"]
    _require(isinstance(wd, (int, float)) and wd >= 0 and math.isfinite(wd),
             f"StiefelAdam: weight_decay={wd!r} is invalid; pass a finite float >= 0.")
    tr = group["trust_region"]
    _require(tr is None or tr == "auto"
             or (isinstance(tr, (int, float)) and not isinstance(tr, bool) and tr > 0 and math.isfinite(tr)),
             f"StiefelAdam: trust_region={tr!r} is invalid; pass a finite float > 0 (a cap on each frame's "
             f"||s||_F), 'auto' (the default: {_linalg.AUTO_TRUST_REGION['original']} under "
             f"adjust_lr_fn='original', {_linalg.AUTO_TRUST_REGION['match_rms_adamw']} under 'match_rms_adamw') "
             f"or None to disable the cap.")
    sm = group["second_moment"]
    _require(sm in SECOND_MOMENTS,
             f"StiefelAdam: second_moment={sm!r} is unknown; use one of 'frame' (default), 'column', "
             f"'element', or None (fixed-step Riemannian SGD with momentum).")
    fn = group.get("adjust_lr_fn", "original")
    _require(fn in ADJUST_LR_FNS,
             f"StiefelAdam: adjust_lr_fn={fn!r} is unknown; use 'original' (lr is a frame's step norm, the "
             f"paper's step) or 'match_rms_adamw' (lr is a per-entry step, as for AdamW).")
    st = group["stabilize"]
    _require(st is None or (isinstance(st, int) and not isinstance(st, bool) and st > 0),
             f"StiefelAdam: stabilize={st!r} is invalid; pass a positive int (re-project every that many "
             f"steps) or None.")
    cap = group.get("capturable")
    _require(cap is None or isinstance(cap, bool),
             f"StiefelAdam: capturable={cap!r} is invalid; pass True, False or None (True on accelerators).")
    _require(not (cap and st is not None),
             f"StiefelAdam: stabilize={st!r} cannot be combined with capturable=True (re-projecting every k "
             f"steps reads the step count on the host); pass stabilize=None or capturable=False.")
    mw = group.get("master_weights", False)
    _require(isinstance(mw, bool),
             f"StiefelAdam: master_weights={mw!r} is invalid; pass True (keep a float32 master copy of bf16/fp16 "
             f"frames) or False.")


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


def validate_step(param_groups: list[dict[str, Any]], state: dict[torch.Tensor, Any], name: str = "StiefelAdam",
                  validate_group: Any = None,
                  check_frame_state: Any = None) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Check every group's options (a scheduler or a user may have rewritten ``param_groups`` since the
    constructor checked them), every gradient, every fresh frame and (``check_frame_state(p, group, state)``)
    the state of every frame that has one against its group's options, before anything is changed.

    Returns, per group, its parameters with a gradient split into frames and the rest (the step's two updates),
    found on the way."""
    for group in param_groups:
        (validate_group or _validate_hyperparameters)(group)
    split = []
    for group in param_groups:
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
    return split
