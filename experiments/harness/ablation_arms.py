r"""Arms that take one ingredient of the Stiefel update away at a time, and frozen frames.

Registered in :data:`~experiments.harness.arms.ARMS` on import (the vision study imports
this module):

=========================  ===========  =======================================================================
arm                        attention    W_Q, W_K trained by (every other parameter: AdamW, same settings)
=========================  ===========  =======================================================================
``stiefel-frozen``         stiefel      nothing: the frames stay at their initialisation (no gradient)
``stiefel-sgd``            stiefel      :class:`~geoopt_stiefel_attention.StiefelAdam` with
                                        ``second_moment=None``: fixed-step Riemannian SGD with momentum,
                                        :math:`s = \mathrm{lr}\,\hat m` (projector and retraction kept; the step
                                        is of degree one in the gradient, not scale-free)
``stiefel-element``        stiefel      StiefelAdam with ``second_moment="element"``: a second moment per
                                        entry (scale-free per coordinate, not O(d)-equivariant)
``framescalar-euclidean``  euclidean    :class:`FrameScalarAdam` on the unconstrained matrices: the per-frame
                                        scalar Adam step (scale-free and O(d)-equivariant) with neither
                                        projector nor retraction
``adamw-orthostart``       euclidean    AdamW, unconstrained and decayed like the ``adamw`` arm, but starting
                                        from exactly the orthonormal frames the ``stiefel`` arm starts from
                                        (:func:`orthonormal_start`): the start without the constraint
``adamw-frozen``           euclidean    nothing: W_Q, W_K stay at the ``adamw`` arm's random, not orthonormal,
                                        start (:func:`freeze_query_key`); the control of ``stiefel-frozen``
                                        that tells frozen attention from frozen *orthonormal* attention
``adamw-qk-nodecay``       euclidean    AdamW exactly as in the ``adamw`` arm (same lr, same start) but with
                                        weight decay 0 on W_Q, W_K only: trained and not decayed, the arm that
                                        tells "not trained" (``adamw-frozen``) from "not decayed"
=========================  ===========  =======================================================================

Except in ``adamw-orthostart``, ``adamw-frozen`` and ``adamw-qk-nodecay`` (which differ from ``adamw`` in the
start only, in freezing W_Q and W_K only, or in not decaying W_Q and W_K only), W_Q and W_K get no weight decay in every arm here, like the frames of the ``stiefel``
arm, and their learning rate is ``OptimConfig.effective_frame_lr``; the trust region :math:`\Delta` applies where the method has one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from geoopt_stiefel_attention.manifolds import is_frame
from geoopt_stiefel_attention.optim import stiefel_adam_update, trust_radius

from .arms import ARMS, Arm, OptimizerGroup, _adamw, _require_frames, build_adamw, register_arm, split_frame_groups
from .config import OptimConfig

__all__ = ["FrameScalarAdam", "freeze_frames", "orthonormal_start", "freeze_query_key",
           "build_frozen", "build_adamw_frozen", "build_adamw_qk_nodecay", "build_stiefel_sgd",
           "build_stiefel_element", "build_framescalar_euclidean", "ABLATION_ARMS"]


class FrameScalarAdam(torch.optim.Optimizer):
    r"""The per-frame-scalar Adam step on plain matrices ``(..., d, r)``: :func:`~geoopt_stiefel_attention.
    stiefel_adam_update` with ``constrained=False`` (no projector, retraction or transport).

    Every parameter is read as a stack of ``d x r`` matrices (its last two dimensions) with one second moment
    each, e.g. a Euclidean ``w_q`` of shape ``(heads, d, head_dim)`` gets one scalar per head.

    Parameters
    ----------
    params : iterable
        Tensors with ``ndim >= 2``, or parameter-group dicts.
    lr, betas, eps : float
        As in Adam.
    trust_region : float or None, default 0.1
        Per-matrix cap :math:`\Delta` on :math:`\|s\|_F`.
    weight_decay : float, default 0
        Decoupled decay :math:`W \leftarrow (1 - \mathrm{lr}\,\lambda) W`.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, *, trust_region: float | None = 0.1, weight_decay: float = 0.0) -> None:
        if not (lr > 0 and eps > 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"FrameScalarAdam: lr={lr!r}, eps={eps!r} must be > 0, weight_decay={weight_decay!r} "
                             f">= 0 and betas={betas!r} in [0, 1).")
        if trust_region is not None and not trust_region > 0:
            raise ValueError(f"FrameScalarAdam: trust_region={trust_region!r} must be > 0 or None.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, trust_region=trust_region,
                                      weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"FrameScalarAdam: parameter of shape {tuple(p.shape)} is not a stack of "
                                     f"matrices (ndim >= 2); train vectors with Adam/AdamW.")

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros(p.shape[:-2] + (1, 1), dtype=p.dtype, device=p.device)
                state["step"] += 1
                w, m, v, _ = stiefel_adam_update(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"]), lr=float(group["lr"]),
                    beta1=beta1, beta2=beta2, eps=group["eps"], trust_region=group["trust_region"],
                    constrained=False, weight_decay=group["weight_decay"])
                p.copy_(w)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
        return loss


# ---------------------------------------------------------------------------------------------- builders
def freeze_frames(model: torch.nn.Module) -> None:
    """Stop the gradient of every Stiefel frame of ``model`` (``requires_grad_(False)``), in place."""
    frames = [p for p in model.parameters() if is_frame(p)]
    if not frames:
        raise ValueError("arm 'stiefel-frozen': the model has no Stiefel frames to freeze; build it with "
                         "attention='stiefel'.")
    for p in frames:
        p.requires_grad_(False)


def orthonormal_start(model: torch.nn.Module) -> None:
    r"""Replace every W_Q, W_K block of the library's Euclidean attention modules by its polar factor, in place.

    Each head's block :math:`A \in \mathbb R^{d\times r}` becomes :math:`U = A (A^\top A)^{-1/2}`, computed by
    the same :meth:`PolarStiefel.projx <geoopt_stiefel_attention.PolarStiefel.projx>` call with which
    :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention` makes its frames, so a model built from the same
    seed starts from bit-identical W_Q, W_K in both arms (and the same logit scale: both modules scale the
    logits by :math:`1/\sqrt{r}`). The matrices stay ordinary parameters: nothing holds them on the manifold.
    """
    from geoopt_stiefel_attention.manifolds import PolarStiefel
    from geoopt_stiefel_attention.nn import EuclideanMultiheadAttention

    modules = [m for m in model.modules() if isinstance(m, EuclideanMultiheadAttention)]
    if not modules:
        raise ValueError("arm 'adamw-orthostart': the model has no EuclideanMultiheadAttention whose W_Q, W_K "
                         "could start orthonormal; build it with attention='euclidean'.")
    manifold = PolarStiefel()
    with torch.no_grad():
        for m in modules:
            for w in (m.w_q, m.w_k):
                w.copy_(manifold.projx(w))


def freeze_query_key(model: torch.nn.Module) -> None:
    """Stop the gradient of W_Q and W_K of every :class:`~geoopt_stiefel_attention.nn.EuclideanMultiheadAttention`
    of ``model`` (``requires_grad_(False)``), in place: they keep their random initial values."""
    from geoopt_stiefel_attention.nn import EuclideanMultiheadAttention

    modules = [m for m in model.modules() if isinstance(m, EuclideanMultiheadAttention)]
    if not modules:
        raise ValueError("arm 'adamw-frozen': the model has no EuclideanMultiheadAttention whose W_Q, W_K could "
                         "be frozen; build it with attention='euclidean'.")
    for m in modules:
        m.w_q.requires_grad_(False)
        m.w_k.requires_grad_(False)


def build_adamw_frozen(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW on every trainable parameter; W_Q and W_K, frozen by :func:`freeze_query_key`, are left out."""
    from geoopt_stiefel_attention.nn import query_key_projections

    qk = [w for _, wq, wk in query_key_projections(model) for w in (wq, wk)]
    if not qk or any(w.requires_grad for w in qk):  # else the arm would silently be the adamw arm
        raise ValueError("arm 'adamw-frozen': expected a Euclidean model whose W_Q, W_K are frozen "
                         "(Arm.prepare=freeze_query_key runs before the optimizer is built).")
    return build_adamw(model, groups, optim)


def build_adamw_qk_nodecay(model: torch.nn.Module, groups: list[dict[str, Any]],
                           optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW as in the ``adamw`` arm, except that W_Q and W_K (every
    :func:`~geoopt_stiefel_attention.nn.query_key_projections` tensor) move to a group of their own with
    ``weight_decay = 0``; every other key of their group (the lr above all) is kept."""
    from geoopt_stiefel_attention.nn import query_key_projections

    qk = {id(w) for _, wq, wk in query_key_projections(model) for w in (wq, wk) if w.requires_grad}
    frame_groups, others = split_frame_groups(groups, optim)
    _require_frames("adamw-qk-nodecay", frame_groups, present=False)
    if not qk:
        raise ValueError("arm 'adamw-qk-nodecay': the model has no trainable W_Q, W_K of this library's attention "
                         "modules (query_key_projections found none); build it with attention='euclidean'.")
    split: list[dict[str, Any]] = []
    moved = 0
    for group in others:
        mine = [p for p in group["params"] if id(p) in qk]
        theirs = [p for p in group["params"] if id(p) not in qk]
        moved += len(mine)
        if theirs:
            split.append({**group, "params": theirs})
        if mine:
            split.append({**group, "params": mine, "weight_decay": 0.0})
    if moved != len(qk):  # else part of W_Q, W_K would silently go untrained
        raise ValueError(f"arm 'adamw-qk-nodecay': {len(qk) - moved} of the model's {len(qk)} W_Q, W_K tensors are "
                         f"in no parameter group; pass every parameter of the model.")
    return _adamw(split, optim)


def build_frozen(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW on every trainable parameter; the frames, frozen by :func:`freeze_frames`, are left out."""
    frame_groups, others = split_frame_groups(groups, optim)
    if frame_groups or not any(is_frame(p) and not p.requires_grad for p in model.parameters()):
        raise ValueError("arm 'stiefel-frozen': expected a Stiefel model whose frames are frozen "
                         "(Arm.prepare=freeze_frames runs before the optimizer is built).")
    return _adamw(others, optim)


def _stiefel_variant(name: str, second_moment: str | None):
    def build(model: torch.nn.Module, groups: list[dict[str, Any]], optim: OptimConfig):
        from geoopt_stiefel_attention.optim import StiefelAdam

        frame_groups, others = split_frame_groups(groups, optim)
        if not frame_groups:
            raise ValueError(f"arm {name!r}: the model has no trainable Stiefel frames; build it with "
                             f"attention='stiefel'.")
        return StiefelAdam(frame_groups + others, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                           weight_decay=optim.weight_decay, trust_region=optim.trust_region,
                           second_moment=second_moment, adjust_lr_fn=optim.adjust_lr_fn)

    build.__name__ = build.__qualname__ = f"build_{name.replace('-', '_')}"
    build.__doc__ = (f"StiefelAdam with ``second_moment={second_moment!r}`` on the frames (lr ``frame_lr``), its "
                     f"AdamW branch on the rest.")
    return build


build_stiefel_sgd = _stiefel_variant("stiefel-sgd", None)
build_stiefel_element = _stiefel_variant("stiefel-element", "element")


def build_framescalar_euclidean(model: torch.nn.Module, groups: list[dict[str, Any]],
                                optim: OptimConfig) -> OptimizerGroup:
    """:class:`FrameScalarAdam` (lr ``frame_lr``, no weight decay) on the unconstrained W_Q, W_K of every
    attention module (:func:`~geoopt_stiefel_attention.nn.query_key_projections`), AdamW on the rest."""
    from geoopt_stiefel_attention.nn import query_key_projections

    qk = {id(w) for _, wq, wk in query_key_projections(model) for w in (wq, wk)}
    if not qk:
        raise ValueError("arm 'framescalar-euclidean': the model has no attention module of this library "
                         "(query_key_projections found none).")
    frame_groups, others = split_frame_groups(groups, optim)
    if frame_groups:
        raise ValueError("arm 'framescalar-euclidean': the model has Stiefel frames; build it with "
                         "attention='euclidean'.")
    qk_params, rest = [], []
    for group in others:
        mine = [p for p in group["params"] if id(p) in qk]
        theirs = [p for p in group["params"] if id(p) not in qk]
        qk_params += mine
        if theirs:
            rest.append({**group, "params": theirs})
    fs = FrameScalarAdam(qk_params, lr=optim.effective_frame_lr, betas=optim.betas, eps=optim.eps,
                         trust_region=trust_radius(optim.trust_region, optim.adjust_lr_fn), weight_decay=0.0)
    return OptimizerGroup(fs, _adamw(rest, optim)) if rest else OptimizerGroup(fs)


ABLATION_ARMS = (
    Arm("stiefel-frozen", "stiefel", build_frozen,
        "W_Q, W_K frozen at their initial frames (no gradient); AdamW on the rest", prepare=freeze_frames),
    Arm("stiefel-sgd", "stiefel", build_stiefel_sgd,
        "W_Q, W_K on PolarStiefel trained by fixed-step Riemannian SGD with momentum (StiefelAdam, "
        "second_moment=None): projector + retraction, step of degree one in the gradient; AdamW on the rest"),
    Arm("stiefel-element", "stiefel", build_stiefel_element,
        "W_Q, W_K on PolarStiefel trained by StiefelAdam with an element-wise second moment (scale-free per "
        "coordinate, not O(d)-equivariant); AdamW on the rest"),
    Arm("framescalar-euclidean", "euclidean", build_framescalar_euclidean,
        "unconstrained W_Q, W_K trained by the per-frame-scalar Adam step (scale-free, equivariant; no "
        "projector, no retraction, no weight decay); AdamW on the rest", rules=("original",)),
    Arm("adamw-orthostart", "euclidean", build_adamw,
        "AdamW on every parameter, W_Q, W_K unconstrained but starting from the stiefel arm's orthonormal frames",
        prepare=orthonormal_start),
    Arm("adamw-frozen", "euclidean", build_adamw_frozen,
        "W_Q, W_K frozen at the adamw arm's random start (no gradient, not orthonormal); AdamW on the rest",
        prepare=freeze_query_key),
    Arm("adamw-qk-nodecay", "euclidean", build_adamw_qk_nodecay,
        "AdamW on every parameter as in the adamw arm, but W_Q, W_K get no weight decay (trained, not decayed)"),
)

for _arm in ABLATION_ARMS:
    if _arm.name not in ARMS:
        register_arm(_arm)
