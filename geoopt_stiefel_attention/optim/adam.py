"""The :class:`StiefelAdam` optimizer: arguments, groups, checkpoints and the step loop.

The step reads like geoopt's ``RiemannianAdam``: per group, frames and Euclidean parameters are split; the
frames take the Stiefel update batch by batch (:mod:`._batching`, with the maths in :mod:`._reference` and
:mod:`._kernel`), the rest torch's AdamW. State creation and checkpoint loading live in :mod:`._state`,
argument checks in :mod:`._validation`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import geoopt
import torch

from . import _batching, _state
from ._base import FrameOptimizer
from ._validation import _DEFAULT_TRUST_REGION, _GROUP_DEFAULTS, ADAM_OPTIONS, ADAM_RULES, SHARED_OPTIONS

__all__ = ["StiefelAdam"]


class StiefelAdam(FrameOptimizer, geoopt.optim.RiemannianAdam):
    r"""Riemannian Adam for Stiefel frames with one second moment per frame, a trust region and the
    polar retraction; AdamW for every other parameter.

    A parameter that is a :class:`geoopt.ManifoldParameter` on :class:`~geoopt_stiefel_attention.PolarStiefel`
    (or any :class:`geoopt.manifolds.EuclideanStiefel`) is a stack of frames ``(..., d, r)``. With step
    count :math:`t`, each frame :math:`W \in \mathrm{St}(d, r)` with Euclidean gradient :math:`G` is updated by

    .. math::

        \xi &= G - W \operatorname{sym}(W^\top G) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1)\,\xi \\
        v &\leftarrow \beta_2 v + (1 - \beta_2)\,\|\xi\|_F^2 \qquad \text{(one scalar per frame)} \\
        s &= c\,\mathrm{lr}\cdot \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon} \\
        s &\leftarrow s \cdot \min\!\big(1, \Delta / \|s\|_F\big) \qquad \text{(trust region)} \\
        W &\leftarrow \operatorname{polar}(W - s) = (W - s)\big((W - s)^\top (W - s)\big)^{-1/2} \\
        m &\leftarrow m - W \operatorname{sym}(W^\top m) \qquad \text{(transport by projection)}

    where :math:`\operatorname{sym}(A) = (A + A^\top)/2` and :math:`c` is set by ``adjust_lr_fn``
    (:func:`frame_step_scale`): :math:`c = 1` for ``"original"`` (the paper's step), :math:`c = \sqrt{d r}` for
    ``"match_rms_adamw"``. The second moment ``v`` is stored at its true shape ``(..., 1, 1)``. Every other
    parameter is updated exactly as by :class:`torch.optim.AdamW` with the group's ``lr``, ``betas``, ``eps``
    and ``weight_decay``. The update is :func:`stiefel_adam_update` (the specification) run by a fused in-place
    kernel; the options are explained at length in the documentation's "StiefelAdam in detail" page.

    Parameters
    ----------
    params : iterable
        Parameters, ``(name, parameter)`` pairs or parameter-group dicts; frames and Euclidean parameters may
        be mixed.
    lr : float, default 1e-3
        Learning rate, ``>= 0``; a frame's step has :math:`\|s\|_F \approx c\,\mathrm{lr}`
        (:math:`\sqrt{d r}\,\mathrm{lr}` under the default ``adjust_lr_fn``).
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to :math:`\sqrt{\hat v}`, ``>= 0``.
    weight_decay : float, default 0
        Decoupled (AdamW) decay of Euclidean parameters; none on frames, whose Riemannian gradient of
        :math:`\tfrac{\lambda}{2}\|W\|_F^2` is :math:`\lambda (W - W \operatorname{sym}(W^\top W)) = 0`.
    trust_region : float, "auto" or None, default "auto"
        Per-frame cap :math:`\Delta` on :math:`\|s\|_F`, in the frame's own units (its columns have unit norm)
        under every ``adjust_lr_fn``; ``None`` disables it. Since :math:`(W - s)^\top (W - s) = I + s^\top s`
        for a tangent step, it certifies :math:`\operatorname{cond}\big((W - s)^\top (W - s)\big) \le 1 +
        \Delta^2`, turns no frame's column space by more than :math:`\arctan\Delta`, and sizes the retraction
        of the capturable path. ``"auto"`` is the paper's 0.1 under ``adjust_lr_fn="original"`` and 1 under
        ``"match_rms_adamw"`` (condition at most 2, at most 45° per step; a typical step at lr 1e-2 on a
        128 x 32 frame has norm about 0.64).
    second_moment : {"frame", "column", "element", None}, default "frame"
        ``"frame"`` is the method; the others exist for the ablations (``None``: Riemannian SGD with momentum).
    stabilize : int or None, default None
        Re-project frames (exact SVD) and first moments every ``stabilize`` steps.
    master_weights : bool, default False
        Keep and update a float32 master copy of bf16/fp16 frames in ``state["master"]``.
    adjust_lr_fn : {"original", "match_rms_adamw"}, default "match_rms_adamw"
        What ``lr`` measures for a ``d x r`` frame (:func:`frame_step_scale`). The default
        reads them per entry, as AdamW does (:math:`c = \sqrt{d r}`), so the model's AdamW learning rate moves a
        frame about as much per step as AdamW would move the same block; ``"original"`` is the paper's step
        (:math:`c = 1`, a frame's step has Frobenius norm about ``lr``), and what geoopt's ``RiemannianAdam``
        takes. Groups of a state dict saved without the option (older checkpoints, geoopt's) load as
        ``"original"``, with a ``UserWarning`` when that changes the rule the optimizer was built with.
    amsgrad, maximize, foreach : bool
        As in :class:`torch.optim.AdamW`; ``amsgrad`` and ``foreach`` concern Euclidean parameters only.
    differentiable, fused : bool
        Accepted for torch's signature; only ``False``/``None`` is supported.
    capturable : bool or None, default None
        As in :class:`torch.optim.Adam` (no host reads; CUDA graphs, ``torch.compile``); ``None`` means
        ``True`` on accelerators. Not combinable with ``stabilize``.

    Scope and warnings
    ------------------
    - Frames must be on the manifold at their first step (within :data:`ORTHONORMALITY_TOLERANCE`), or a
      ``ValueError`` suggests ``.proj_()``; ``CanonicalStiefel`` and other manifolds, sparse gradients and
      complex frames are refused. Validation happens before anything changes.
    - A frame whose gradient has a NaN or Inf entry is skipped for that step and counted in
      ``state["skipped_frames"]``; so is, as a whole, any other parameter whose gradient has one (its value,
      moments and step count unchanged, where torch's AdamW alone would turn it into NaN). The default step warns
      once per parameter, naming it; the capturable step counts on the device without a warning.
    - Options are checked before anything moves: at construction, when a group is added, and before a step
      whose group options were written since (by a scheduler or by hand: a new value, an item of ``betas``
      replaced, a tensor ``lr`` every time), with the checks :class:`StiefelMuon` uses for the options both have;
      what torch's AdamW would refuse inside its step (a tensor ``lr`` with ``foreach=True`` without a capturable
      AdamW) is refused before the frames move.
    - bf16/fp16 frames compute and keep moments in float32; small steps are partly lost to rounding unless
      ``master_weights=True``.
    - Sharded (FSDP2/``DTensor``) frames are supported when sharded along a leading (head) dimension;
      a sharding that splits a frame is refused (see :mod:`geoopt_stiefel_attention.distributed`).
    - Cost: six batched ``d x r x r`` products per frame and step, no ``d x d`` work, no SVD or QR; one
      reusable scratch buffer per dtype and device. ``stiefel-attention bench`` measures it.
    - Given no frame at all, it is plain AdamW and says so once, at construction (a ``UserWarning`` naming
      :func:`~geoopt_stiefel_attention.stiefelize`), unless the groups come from
      :func:`~geoopt_stiefel_attention.param_groups`, which warns itself (or not, with ``expect_frames=False``).

    Examples
    --------
    >>> import torch, geoopt
    >>> from geoopt_stiefel_attention import PolarStiefel, StiefelAdam
    >>> st = PolarStiefel()
    >>> w = geoopt.ManifoldParameter(st.random(4, 32, 8), manifold=st)
    >>> b = torch.nn.Parameter(torch.zeros(8))
    >>> opt = StiefelAdam([w, b], lr=1e-2, weight_decay=0.1)
    >>> ((w.sum(dim=1) + b) ** 2).sum().backward()
    >>> opt.step()
    >>> st.check_point_on_manifold(w)
    True
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        trust_region: float | None = _DEFAULT_TRUST_REGION,
        second_moment: str | None = "frame",
        stabilize: int | None = None,
        master_weights: bool = False,
        adjust_lr_fn: str = "match_rms_adamw",
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        capturable: bool | None = None,
    ) -> None:
        params = self._check_params_argument(params)
        # every option checked by the shared table (torch's Adam's own checks would answer some, e.g. a tensor lr
        # with foreach=True, in other words than StiefelMuon's); the keys in torch's Adam's order, then the frames'
        self._construct(params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True, trust_region=trust_region,
            second_moment=second_moment, stabilize=stabilize, master_weights=master_weights,
            adjust_lr_fn=adjust_lr_fn))

    # ------------------------------------------------------------------ the rule: options, state, update
    _NAME = "StiefelAdam"
    _OPTIONS = SHARED_OPTIONS + ADAM_OPTIONS
    _RULES = ADAM_RULES
    _GROUP_DEFAULTS = _GROUP_DEFAULTS
    _MOMENT_KEY = "exp_avg"
    _STEP_ON_HOST = True  # bias corrections and stabilize read the step count as a number outside capturable mode
    # torch's Adam fills these when a state dict of an older torch version lacks them
    _FILLED_ON_LOAD = FrameOptimizer._FILLED_ON_LOAD | {"amsgrad", "maximize", "foreach"}
    # checkpoints of geoopt's RiemannianAdam: integer steps (converted for every rule), AMSGrad buffers of frames and
    # full-size per-frame second moments
    _CONVERT_LOADED = staticmethod(_state.convert_geoopt_frame_state)

    def _frame_spec(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[list[str], dict[str, tuple]]:
        sm = group.get("second_moment")
        return ["step", "exp_avg"] + (["exp_avg_sq"] if sm is not None else []), _state._frame_state_shapes(p, sm)

    def _init_frame_state(self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return _state.init_frame_state(state, p, group)

    def _update_batch(self, group: dict[str, Any], params: list[torch.Tensor], step: int | None) -> None:
        _batching.update_batch(self, group, params, step)

    def _check_frame_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """The second moment a frame keeps must be the one its group's ``second_moment`` asks for: changed after
        the first step, the update would fail midway (or broadcast the wrong shape), so it is refused here."""
        mode = group["second_moment"]
        if mode is None:
            return  # Riemannian SGD with momentum reads no second moment
        v = state.get("exp_avg_sq")
        want = _state._frame_state_shapes(p, mode)["exp_avg_sq"]
        if v is None or tuple(v.shape) != want:
            have = "no second moment" if v is None else f"a second moment of shape {tuple(v.shape)}"
            raise ValueError(f"StiefelAdam: a frame parameter of shape {tuple(p.shape)} has {have}, but its group "
                             f"has second_moment={mode!r}, which keeps one of shape {want}: the option was changed "
                             f"after the frame's first step. Restore it, or restart the frame's moments with "
                             f"optimizer.state[p].clear().")
