r"""Arms: how a run's model is prepared and which optimizer trains it.

An :class:`Arm` names the attention variant the study's model builder must build (``"euclidean"`` or
``"stiefel"``), an optional in-place preparation of the built model, and a builder
``build(model, groups, optim) -> optimizer`` that receives the study's parameter groups (already carrying
their weight decay) and the run's :class:`~experiments.harness.config.OptimConfig`.
The registry :data:`ARMS` is open: ``register_arm(Arm(...))`` adds a variant (an ablation, frozen frames, a
different second moment) without touching the training loop.

The built-in arms:

========================  ===========  ==========================================================================
arm                       attention    optimizer
========================  ===========  ==========================================================================
``adamw``                 euclidean    :class:`torch.optim.AdamW` on everything (the baseline)
``stiefel``               stiefel      :class:`~geoopt_stiefel_attention.StiefelAdam`: frames by the frame-scalar
                                       Riemannian Adam (lr ``frame_lr``), the rest by its AdamW branch
``geoopt-radam``          stiefel      stock geoopt: frames moved to :class:`geoopt.manifolds.EuclideanStiefel`
                                       (QR retraction) and trained by :class:`geoopt.optim.RiemannianAdam`
                                       (one second moment per frame, ``component_inner`` = ‖ξ‖²_F, kept in a
                                       full-size buffer), the rest by :class:`torch.optim.AdamW`
``geoopt-rsgd``           stiefel      stock geoopt: frames on ``EuclideanStiefel`` trained by
                                       :class:`geoopt.optim.RiemannianSGD` with momentum, the rest by AdamW
``muon``                  euclidean    :class:`torch.optim.Muon` (``adjust_lr_fn="match_rms_adamw"``, so it shares
                                       AdamW's lr) on the hidden matrices (:func:`hidden_matrices`, W_Q and W_K
                                       included), AdamW on embeddings, the output layer, norms and biases, as
                                       Muon's documentation recommends
``stiefeladam-muon``      stiefel      frames as in ``stiefel`` (StiefelAdam), Muon on the other hidden matrices,
                                       AdamW on the rest
``stiefel-muon``          stiefel      the same arm as ``stiefeladam-muon``, under the name the tuned
                                       language-model study (``experiments/lm/records/tuned``) trained and recorded it
                                       with; kept registered so that its committed records, its grid and
                                       ``--report-only`` keep working. New studies use ``stiefeladam-muon``.
``stiefelmuon-muon``      stiefel      frames by :class:`~geoopt_stiefel_attention.StiefelMuon` (manifold Muon,
                                       ``adjust_lr_fn="match_rms_adamw"``, the run's lr and momentum 0.95, as
                                       torch's Muon here), Muon on the other hidden matrices, AdamW on the rest
========================  ===========  ==========================================================================

Frames never get weight decay (on :math:`\mathrm{St}(d, r)` its Riemannian gradient
:math:`P_W(\lambda W)` is zero). The two stock-geoopt arms step two optimizers together through
:class:`OptimizerGroup`; geoopt's own ``weight_decay`` is an L2 term added to the gradient, which is why
the Euclidean parameters go to a separate, decoupled AdamW.

On the second moment of ``geoopt-radam``: :class:`geoopt.optim.RiemannianAdam` accumulates
``manifold.component_inner(W, ξ)``, which on ``EuclideanStiefel`` is the frame's :math:`\|\xi\|_F^2` (the
embedded inner product summed over the frame's last two dimensions, ``keepdim=True``) broadcast into a buffer
created with ``torch.zeros_like(W)``. So it keeps one second moment per frame, like
:class:`~geoopt_stiefel_attention.StiefelAdam`, but stores it at the frame's full size ``(..., d, r)`` (every
entry of a frame holds the same value), where StiefelAdam stores ``(..., 1, 1)``. What differs from the
``stiefel`` arm is the retraction (QR instead of polar) and the missing trust region.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from geoopt_stiefel_attention.manifolds import is_frame
from geoopt_stiefel_attention.nn import param_groups

from .config import OptimConfig

__all__ = ["Arm", "ARMS", "register_arm", "get_arm", "check_arm", "ArmRuleError", "available_arms", "OptimizerGroup", "split_frame_groups",
           "default_param_groups", "hidden_matrices", "OUTPUT_LAYER_NAMES", "build_muon", "build_stiefel_muon",
           "build_stiefelmuon_muon"]

ATTENTIONS = ("euclidean", "stiefel")


@dataclass(frozen=True)
class Arm:
    """One arm of a comparison.

    Parameters
    ----------
    name : str
        Registry key, used on the command line and in the records.
    attention : {"euclidean", "stiefel"}
        Which attention the study's model builder builds for this arm (same seed, same other weights).
    build : callable
        ``build(model, groups, optim) -> optimizer``; ``groups`` is the study's list of parameter-group dicts
        (``params``, ``weight_decay``), ``optim`` the run's :class:`OptimConfig`. The returned object needs
        ``zero_grad``, ``step``, ``state_dict``, ``load_state_dict`` and ``param_groups``.
    description : str
        One line for reports and ``--help``.
    prepare : callable, optional
        ``prepare(model)`` changes the built model in place before the optimizer is built (e.g. moves frames to
        another manifold, or freezes them).
    studies : tuple of str, default ()
        The studies (``config.experiment``) whose model builder gives this arm its meaning, when that meaning
        lives in the builder rather than in ``build``/``prepare`` (e.g. the language-model study's learned
        logit gain). Empty: the arm works in every study. Any other study refuses the arm instead of silently
        running it as another.
    rules : tuple of str, default ()
        The frame-step rules (``OptimConfig.adjust_lr_fn``) the arm's frame optimizer follows, when it does not
        follow the run's (stock geoopt steps by the paper's rule, torch's and this library's Muon arms by
        ``match_rms_adamw``). Empty: the arm steps by the run's rule. A run under another rule is refused
        (:func:`check_arm`) instead of recording a rule it did not use.
    """

    name: str
    attention: str
    build: Callable[[torch.nn.Module, list[dict[str, Any]], OptimConfig], Any]
    description: str = ""
    prepare: Callable[[torch.nn.Module], None] | None = None
    studies: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"Arm: name={self.name!r} must be a non-empty str.")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"Arm {self.name!r}: attention={self.attention!r} must be one of {ATTENTIONS}.")
        if not callable(self.build):
            raise ValueError(f"Arm {self.name!r}: build must be callable (model, groups, optim) -> optimizer.")


#: The arm registry: name -> :class:`Arm`. Extend it with :func:`register_arm`.
ARMS: dict[str, Arm] = {}


def register_arm(arm: Arm, *, replace: bool = False) -> Arm:
    """Add ``arm`` to :data:`ARMS` (``replace=True`` to overwrite an existing name); returns it."""
    if arm.name in ARMS and not replace:
        raise ValueError(f"register_arm: an arm named {arm.name!r} exists already; pick another name or pass "
                         f"replace=True.")
    ARMS[arm.name] = arm
    return arm


def get_arm(name: str, study: str | None = None) -> Arm:
    """The registered arm called ``name``; the error lists the known arms. With ``study`` (a config's
    ``experiment``), an arm restricted to other studies (:attr:`Arm.studies`) is refused."""
    try:
        arm = ARMS[name]
    except KeyError:
        raise ValueError(f"unknown arm {name!r}; registered arms: {', '.join(sorted(ARMS))}.") from None
    if study is not None and arm.studies and study not in arm.studies:
        raise ValueError(f"arm {name!r} exists only in the {' / '.join(arm.studies)} study (its model builder "
                         f"gives it its meaning), not in {study!r}; arms for {study!r}: "
                         f"{', '.join(available_arms(study))}.")
    return arm


class ArmRuleError(ValueError):
    """A run whose frame-step rule its arm does not follow (:func:`check_arm`); the CLI prints it as a usage
    error."""


def check_arm(name: str, study: str | None, optim: OptimConfig | None) -> Arm:
    """:func:`get_arm`, and the refusal of a run whose frame-step rule ``optim.adjust_lr_fn`` the arm does not
    follow (:attr:`Arm.rules`): such a run would record one rule and step by another."""
    arm = get_arm(name, study)
    if arm.rules and optim is not None and optim.adjust_lr_fn not in arm.rules:
        raise ArmRuleError(f"--arms {name}: the arm steps its frames by adjust_lr_fn={' or '.join(map(repr, arm.rules))} "
                         f"whatever the run says, so --adjust-lr-fn {optim.adjust_lr_fn} would be recorded but not "
                         f"used; run it with --adjust-lr-fn {arm.rules[0]} (a separate --out), or use another arm.")
    return arm


def available_arms(study: str | None = None) -> list[str]:
    """Names of the registered arms usable in ``study`` (all of them for ``None``), sorted."""
    return sorted(n for n, a in ARMS.items() if study is None or not a.studies or study in a.studies)


# ---------------------------------------------------------------------------------------------- groups
def default_param_groups(model: torch.nn.Module, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """The studies' grouping: :func:`~geoopt_stiefel_attention.param_groups` with its default rule (frames
    without decay, other matrices (``ndim >= 2``) with ``weight_decay``, vectors without), no warning for
    Euclidean arms, empty groups dropped."""
    return param_groups(model, weight_decay, expect_frames=False, drop_empty=True)


def split_frame_groups(groups: Iterable[dict[str, Any]], optim: OptimConfig
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split every group into its Stiefel frames and the rest.

    Frame groups get ``lr = optim.effective_frame_lr`` and ``weight_decay = 0``; other keys of a group are
    kept. Parameters that do not require a gradient are left out, and empty groups are dropped.

    Returns
    -------
    frame_groups, other_groups : list of dict
    """
    frame_groups, other_groups = [], []
    for group in groups:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        params = [p for p in params if p.requires_grad]
        rest = {k: v for k, v in group.items() if k != "params"}
        frames = [p for p in params if is_frame(p)]
        others = [p for p in params if not is_frame(p)]
        if frames:
            frame_groups.append({**rest, "params": frames, "lr": optim.effective_frame_lr, "weight_decay": 0.0})
        if others:
            other_groups.append({**rest, "params": others})
    return frame_groups, other_groups


def _restore_int_steps(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Give back the Python-int step counters of ``saved`` (the state dict ``opt`` just loaded) as ints.

    Stock geoopt optimizers keep ``state["step"]`` as a Python int. ``geoopt.optim.RiemannianAdam`` subclasses
    ``torch.optim.Adam``, whose ``__setstate__`` (run by ``load_state_dict``) turns every ``state["step"]`` into a
    float32 tensor; geoopt then computes its bias corrections ``beta ** step`` in float32 instead of float64, so
    a resumed run would drift from an uninterrupted one in the last bits. Restoring the saved type keeps resumed
    runs bit-identical; optimizers that save tensor counters (torch's, StiefelAdam) keep their tensors.
    """
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in zip(ids, params, strict=True):
        step = saved["state"].get(i, {}).get("step")
        if isinstance(step, int) and isinstance(opt.state[p].get("step"), torch.Tensor):
            opt.state[p]["step"] = step


class OptimizerGroup:
    """Several optimizers stepped together as one (each owns a disjoint set of parameters).

    ``param_groups`` is the concatenation of the members' groups (the same dicts, so setting ``lr`` there
    acts on the member); ``state_dict`` holds the members' state dicts in order.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers:
            raise ValueError("OptimizerGroup: pass at least one optimizer.")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        members = state.get("optimizers")
        if not isinstance(members, list) or len(members) != len(self.optimizers):
            raise ValueError(f"OptimizerGroup.load_state_dict: expected {len(self.optimizers)} member state dicts, "
                             f"got {None if members is None else len(members)}; was it saved by another arm?")
        for opt, sd in zip(self.optimizers, members, strict=True):
            opt.load_state_dict(sd)
            _restore_int_steps(opt, sd)

    def __repr__(self) -> str:
        return "OptimizerGroup(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"


# ---------------------------------------------------------------------------------------------- builders
def _require_frames(name: str, frame_groups: list, present: bool) -> None:
    if present and not frame_groups:
        raise ValueError(f"arm {name!r}: the model has no trainable Stiefel frames; build it with "
                         f"attention='stiefel' (the arm's `attention` field says which model it needs).")
    if not present and frame_groups:
        raise ValueError(f"arm {name!r}: the model has Stiefel frames, but this arm trains a Euclidean model; "
                         f"build it with attention='euclidean'.")


def _adamw(groups: list[dict[str, Any]], optim: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)


def build_adamw(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW on every parameter (the model must have no frames)."""
    frame_groups, others = split_frame_groups(groups, optim)
    _require_frames("adamw", frame_groups, present=False)
    return _adamw(others, optim)


def build_stiefel(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig):
    """:class:`~geoopt_stiefel_attention.StiefelAdam` on frames (lr ``frame_lr``) and AdamW on the rest."""
    from geoopt_stiefel_attention.optim import StiefelAdam

    frame_groups, others = split_frame_groups(groups, optim)
    _require_frames("stiefel", frame_groups, present=True)
    return StiefelAdam(frame_groups + others, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                       weight_decay=optim.weight_decay, trust_region=optim.trust_region,
                       adjust_lr_fn=optim.adjust_lr_fn)


def use_stock_euclidean_stiefel(model: torch.nn.Module) -> None:
    """Move every frame of ``model`` to stock :class:`geoopt.manifolds.EuclideanStiefel` (QR retraction), in
    place; the values and the parameter objects are unchanged."""
    import geoopt

    for p in model.parameters():
        if is_frame(p):
            p.manifold = geoopt.manifolds.EuclideanStiefel()


def build_geoopt_radam(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> OptimizerGroup:
    """Stock :class:`geoopt.optim.RiemannianAdam` on the frames, :class:`torch.optim.AdamW` on the rest."""
    import geoopt

    frame_groups, others = split_frame_groups(groups, optim)
    _require_frames("geoopt-radam", frame_groups, present=True)
    radam = geoopt.optim.RiemannianAdam(frame_groups, lr=optim.effective_frame_lr, betas=optim.betas,
                                        eps=optim.eps, weight_decay=0.0)
    return OptimizerGroup(radam, _adamw(others, optim)) if others else OptimizerGroup(radam)


def build_geoopt_rsgd(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> OptimizerGroup:
    """Stock :class:`geoopt.optim.RiemannianSGD` (momentum ``optim.momentum``) on the frames, AdamW on the rest."""
    import geoopt

    frame_groups, others = split_frame_groups(groups, optim)
    _require_frames("geoopt-rsgd", frame_groups, present=True)
    rsgd = geoopt.optim.RiemannianSGD(frame_groups, lr=optim.effective_frame_lr, momentum=optim.momentum,
                                      weight_decay=0.0)
    return OptimizerGroup(rsgd, _adamw(others, optim)) if others else OptimizerGroup(rsgd)


#: Leaf names of output layers, which Muon's documentation leaves to AdamW (with the embeddings).
OUTPUT_LAYER_NAMES = ("lm_head", "unembed", "head", "classifier", "fc_out")


def hidden_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The hidden 2-D weight matrices of ``model``, in ``named_modules()`` order: the weights of ``nn.Linear``
    and HuggingFace ``Conv1D`` modules (for a weight converted by
    :func:`~geoopt_stiefel_attention.stiefelize`, its non-frame rest ``parametrizations.weight.original``),
    without the output layer (a module whose leaf name is in :data:`OUTPUT_LAYER_NAMES`), without a weight shared
    with an ``nn.Embedding`` (a tied unembedding) and without frames. Embeddings, norms and biases are not
    matrices of a hidden layer and are left out."""
    from torch.nn.utils import parametrize

    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    found, seen = [], set()
    for path, m in model.named_modules():
        if not (isinstance(m, torch.nn.Linear) or any(c.__name__ == "Conv1D" for c in type(m).__mro__)):
            continue
        if path.rpartition(".")[2] in OUTPUT_LAYER_NAMES:
            continue
        w = m.parametrizations.weight.original if parametrize.is_parametrized(m, "weight") else m.weight
        if (isinstance(w, torch.nn.Parameter) and w.ndim == 2 and w.numel() and id(w) not in embedded
                and id(w) not in seen and not is_frame(w)):
            seen.add(id(w))
            found.append(w)
    return found


def _split_hidden(model: torch.nn.Module, groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                                                 list[dict[str, Any]]]:
    """Split (non-frame) groups into their hidden matrices and the rest, each keeping the group's options."""
    hidden = {id(p) for p in hidden_matrices(model)}
    muon, rest = [], []
    for group in groups:
        opts = {k: v for k, v in group.items() if k != "params"}
        mine = [p for p in group["params"] if id(p) in hidden]
        theirs = [p for p in group["params"] if id(p) not in hidden]
        if mine:
            muon.append({**opts, "params": mine})
        if theirs:
            rest.append({**opts, "params": theirs})
    return muon, rest


def _muon(groups: list[dict[str, Any]], optim: OptimConfig) -> torch.optim.Optimizer:
    groups = [{k: v for k, v in g.items() if k != "name"} for g in groups]  # Muon keeps only its own options
    return torch.optim.Muon(groups, lr=optim.lr, weight_decay=optim.weight_decay, momentum=0.95,
                            adjust_lr_fn="match_rms_adamw")


def build_muon(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> OptimizerGroup:
    """torch's :class:`~torch.optim.Muon` on :func:`hidden_matrices` (W_Q, W_K included; momentum 0.95, Nesterov,
    ``adjust_lr_fn="match_rms_adamw"`` so that ``optim.lr`` means what it means for AdamW, decoupled decay
    ``optim.weight_decay`` where the study's group decays), AdamW on everything else."""
    frame_groups, others = split_frame_groups(groups, optim)
    _require_frames("muon", frame_groups, present=False)
    muon_groups, rest = _split_hidden(model, others)
    if not muon_groups:
        raise ValueError("arm 'muon': the model has no hidden Linear/Conv1D matrix for Muon to train.")
    return OptimizerGroup(_muon(muon_groups, optim), _adamw(rest, optim)) if rest else OptimizerGroup(
        _muon(muon_groups, optim))


def _frames_beside_muon(arm: str, frame_optimizer: Callable[[list[dict[str, Any]], OptimConfig], Any]
                        ) -> Callable[[torch.nn.Module, list[dict[str, Any]], OptimConfig], OptimizerGroup]:
    """The builder of an arm that trains the frames with ``frame_optimizer(frame_groups, optim)``, torch's Muon
    on the other hidden matrices (as in ``muon``) and AdamW on the rest; ``arm`` names it in messages."""

    def build(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> OptimizerGroup:
        frame_groups, others = split_frame_groups(groups, optim)
        _require_frames(arm, frame_groups, present=True)
        muon_groups, rest = _split_hidden(model, others)
        if not muon_groups:  # without Muon this arm would silently be the stiefel arm
            raise ValueError(f"arm {arm!r}: the model has no hidden Linear/Conv1D matrix besides the frames for "
                             f"Muon to train; use the stiefel arm.")
        return OptimizerGroup(frame_optimizer(frame_groups, optim), _muon(muon_groups, optim),
                              *([_adamw(rest, optim)] if rest else []))

    return build


def _stiefel_adam_frames(frame_groups: list[dict[str, Any]], optim: OptimConfig) -> Any:
    from geoopt_stiefel_attention.optim import StiefelAdam

    return StiefelAdam(frame_groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=0.0,
                       trust_region=optim.trust_region, adjust_lr_fn=optim.adjust_lr_fn)


def _stiefel_muon_frames(frame_groups: list[dict[str, Any]], optim: OptimConfig) -> Any:
    from geoopt_stiefel_attention.optim import StiefelMuon

    return StiefelMuon(frame_groups, lr=optim.lr, momentum=0.95, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")


def build_stiefel_muon(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> OptimizerGroup:
    """Frames by :class:`~geoopt_stiefel_attention.StiefelAdam` (as in ``stiefel``: lr ``frame_lr``, the run's
    ``adjust_lr_fn``), torch's Muon on the other hidden matrices (as in ``muon``), AdamW on the rest: the arms
    ``stiefeladam-muon`` and (the tuned study's name for it) ``stiefel-muon``."""
    return _frames_beside_muon("stiefel-muon", _stiefel_adam_frames)(model, groups, optim)


def build_stiefelmuon_muon(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig
                           ) -> OptimizerGroup:
    """Frames by :class:`~geoopt_stiefel_attention.StiefelMuon` (lr ``frame_lr``, ``match_rms_adamw`` as for
    torch's Muon, momentum 0.95, Nesterov), torch's Muon on the other hidden matrices, AdamW on the rest."""
    return _frames_beside_muon("stiefelmuon-muon", _stiefel_muon_frames)(model, groups, optim)


register_arm(Arm("adamw", "euclidean", build_adamw, "AdamW on every parameter (Euclidean W_Q, W_K)"))
register_arm(Arm("stiefel", "stiefel", build_stiefel,
                 "W_Q, W_K on PolarStiefel trained by StiefelAdam (frame-scalar Riemannian Adam); AdamW on the rest"))
register_arm(Arm("geoopt-radam", "stiefel", build_geoopt_radam,
                 "W_Q, W_K on stock geoopt EuclideanStiefel trained by geoopt RiemannianAdam; AdamW on the rest",
                 prepare=use_stock_euclidean_stiefel, rules=("original",)))
register_arm(Arm("geoopt-rsgd", "stiefel", build_geoopt_rsgd,
                 "W_Q, W_K on stock geoopt EuclideanStiefel trained by geoopt RiemannianSGD with momentum; "
                 "AdamW on the rest", prepare=use_stock_euclidean_stiefel, rules=("original",)))
register_arm(Arm("muon", "euclidean", build_muon,
                 "torch Muon (match_rms_adamw) on the hidden matrices, W_Q and W_K included; AdamW on embeddings, "
                 "output layer, norms and biases"))
register_arm(Arm("stiefeladam-muon", "stiefel", _frames_beside_muon("stiefeladam-muon", _stiefel_adam_frames),
                 "W_Q, W_K on PolarStiefel trained by StiefelAdam; torch Muon on the other hidden matrices; AdamW on "
                 "the rest"))
register_arm(Arm("stiefel-muon", "stiefel", build_stiefel_muon,
                 "the tuned study's name for stiefeladam-muon (its committed records carry it): W_Q, W_K on "
                 "PolarStiefel trained by StiefelAdam; torch Muon on the other hidden matrices; AdamW on the rest"))
register_arm(Arm("stiefelmuon-muon", "stiefel", build_stiefelmuon_muon,
                 "W_Q, W_K on PolarStiefel trained by StiefelMuon (manifold Muon); torch Muon on the other hidden "
                 "matrices; AdamW on the rest", rules=("match_rms_adamw",)))
