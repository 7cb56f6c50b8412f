r"""The update rule written as readable maths: :func:`stiefel_adam_update`, the specification.

This is one of the two places the rule is written (the other is the fast in-place kernel,
:func:`geoopt_stiefel_attention.optim._kernel._frame_update_`, tested equal to this one in float64 by
``tests/test_optim_contract.py``). The ablation variants (other second moments, no second moment, the
unconstrained frame-scalar step of the ``framescalar-euclidean`` arm) are options of this function.
"""

from __future__ import annotations

import math

import torch

from .. import _linalg
from . import _validation
from ._validation import SECOND_MOMENTS

__all__ = ["stiefel_adam_update", "SECOND_MOMENTS"]

#: The optimizer's own checks of the options the reference takes: the same answers and words, named for the function.
_REFERENCE_OPTIONS = tuple(option for option in _validation.SHARED_OPTIONS + _validation.ADAM_OPTIONS
                           if option.name in ("trust_region", "second_moment", "adjust_lr_fn"))


def stiefel_adam_update(
    w: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor | None,
    *,
    step: int,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    trust_region: float | str | None,
    second_moment: str | None = "frame",
    series_order: int | None = None,
    constrained: bool = True,
    weight_decay: float = 0.0,
    capturable: bool = False,
    adjust_lr_fn: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""One StiefelAdam update of a stack of frames; pure (returns new tensors, changes none of its inputs).

    For each frame :math:`W \in \mathrm{St}(d, r)` of the stack with Euclidean gradient :math:`G`:

    1. :math:`\xi = G - W \operatorname{sym}(W^\top G)`
    2. :math:`m \leftarrow \beta_1 m + (1 - \beta_1)\xi`
    3. :math:`v \leftarrow \beta_2 v + (1 - \beta_2)\|\xi\|_F^2` (``second_moment="frame"``; ``"column"``
       sums :math:`\xi^2` over rows, ``"element"`` keeps :math:`\xi^2`; ``None`` keeps no :math:`v`)
    4. :math:`s = \mathrm{lr}\,\hat m / (\sqrt{\hat v} + \epsilon)` with
       :math:`\hat m = m/(1-\beta_1^t)`, :math:`\hat v = v/(1-\beta_2^t)`; ``None``: :math:`s = \mathrm{lr}\,\hat m`.
       For ``"column"`` and ``"element"``, :math:`s \leftarrow P_W(s)` (their scaling leaves the tangent space).
    5. :math:`s \leftarrow s \min(1, \Delta/\|s\|_F)` (``trust_region=None`` skips it)
    6. :math:`W \leftarrow (W - s)\big((W - s)^\top (W - s)\big)^{-1/2}`
    7. :math:`m \leftarrow m - W \operatorname{sym}(W^\top m)`

    With ``constrained=False`` (the ``framescalar-euclidean`` ablation arm) :math:`W` is an unconstrained
    matrix :math:`W \in \mathbb R^{d \times r}`: step 1 is :math:`\xi = G` (no projector), step 6 is
    :math:`W \leftarrow (1 - \mathrm{lr}\,\lambda) W - s` with decoupled weight decay :math:`\lambda`
    (``weight_decay``; no retraction) and step 7 is skipped (no transport). With ``second_moment="frame"``
    this step is still scale-free (:math:`G \to cG`, :math:`c > 0`, leaves :math:`s` unchanged up to
    :math:`\epsilon`) and O(d)-equivariant (:math:`G \to QG` maps :math:`s \to Qs`).

    A frame whose gradient has a non-finite entry (or whose :math:`\|\xi\|_F^2` overflows) is skipped: its
    ``W``, ``m`` and ``v`` come back unchanged, and the returned mask is ``False`` there. A frame whose step
    :math:`s` is exactly zero (``lr = 0``; or ``eps = 0`` and a zero second moment, see below) keeps its ``W``
    bit for bit (its moments are updated). With ``eps = 0``, entries whose :math:`\sqrt{\hat v}` is zero take
    a zero step instead of :math:`0/0`.

    Parameters
    ----------
    w, grad, exp_avg : torch.Tensor
        Shape ``(..., d, r)``, one dtype (the compute dtype).
    exp_avg_sq : torch.Tensor or None
        ``(..., 1, 1)`` for ``"frame"``, ``(..., 1, r)`` for ``"column"``, ``(..., d, r)`` for
        ``"element"``, ``None`` for ``second_moment=None``.
    step : int
        The step count ``t >= 1`` after this update (for the bias corrections).
    lr : float or torch.Tensor
        The step size: with ``adjust_lr_fn=None`` the frame's own (:math:`c\,\mathrm{lr}` of
        :class:`StiefelAdam`, what its kernel receives), else a group's ``lr``, multiplied here by
        :math:`c` = :func:`frame_step_scale` ``(adjust_lr_fn, d, r)`` as the optimizer does.
    beta1, beta2, eps : float
        Hyper-parameters as in :class:`StiefelAdam`.
    trust_region : float, "auto" or None
        The radius :math:`\Delta` in the frame's own units, or ``None`` for no cap; ``"auto"`` (every group's
        default) is resolved as the optimizer resolves it (:func:`trust_radius`: 0.1 under ``"original"``, 1 under
        ``"match_rms_adamw"``), so it needs ``adjust_lr_fn``; without one it is refused, naming the fix.
    second_moment : {"frame", "column", "element", None}
        Which second moment scales the step.
    series_order : int or None
        ``None`` retracts exactly (:func:`_linalg.polar`: an ``r x r`` eigendecomposition on the CPU, checked
        Newton–Schulz on accelerators); an integer uses the Taylor series of that order, valid only when it was
        chosen by :func:`_linalg.series_order` for ``trust_region**2``.
    constrained : bool, default True
        ``False``: no projector, retraction or transport (see above); the result is not a frame.
    weight_decay : float, default 0
        Decoupled decay :math:`\lambda` of an unconstrained matrix; only with ``constrained=False`` (on
        :math:`\mathrm{St}(d, r)` weight decay has zero Riemannian gradient, so a frame has none).
    capturable : bool, default False
        ``True`` (the optimizer's capturable step): the retraction reads nothing on the host, so off the CPU it
        keeps the eigendecomposition instead of checked Newton–Schulz (``polar(..., synchronize=False)``).
    adjust_lr_fn : {"original", "match_rms_adamw"} or None, default None
        A group's rule, as in :class:`StiefelAdam`: ``lr`` is read by it (multiplied by :math:`c`) and
        ``trust_region="auto"`` resolved by it, so a group's own ``lr``, ``trust_region`` and ``adjust_lr_fn`` give
        the optimizer's step. ``None``: ``lr`` is the frame's step size as given and ``trust_region`` a number or
        ``None``.

    Raises
    ------
    ValueError
        For a value :class:`StiefelAdam` refuses (``trust_region``, ``second_moment``, ``adjust_lr_fn``, in its
        words), for ``trust_region="auto"`` without ``adjust_lr_fn``, and for ``weight_decay`` on frames.

    Returns
    -------
    w_new, exp_avg_new, exp_avg_sq_new, finite : torch.Tensor
        The updated frames and moments, and a boolean ``(..., 1, 1)`` mask of the frames that were updated.
    """
    given = {"trust_region": trust_region, "second_moment": second_moment}
    if adjust_lr_fn is not None:
        given["adjust_lr_fn"] = adjust_lr_fn
    _validation.check_group(given, "stiefel_adam_update", _REFERENCE_OPTIONS)
    if adjust_lr_fn is not None:
        lr = lr * _linalg.frame_step_scale(adjust_lr_fn, *w.shape[-2:])
        trust_region = _linalg.trust_radius(trust_region, adjust_lr_fn)
    elif trust_region == "auto":
        raise ValueError(
            f"stiefel_adam_update: trust_region='auto' is the radius of a step rule, and no adjust_lr_fn was given: "
            f"pass the group's adjust_lr_fn ('auto' is {_linalg.AUTO_TRUST_REGION['original']} under 'original', "
            f"{_linalg.AUTO_TRUST_REGION['match_rms_adamw']} under 'match_rms_adamw'; lr is then the group's lr, "
            f"as the optimizer reads it), or the radius itself, trust_radius(trust_region, adjust_lr_fn).")
    if weight_decay and constrained:
        raise ValueError(f"stiefel_adam_update: weight_decay={weight_decay!r} applies to unconstrained matrices "
                         f"only (constrained=False); on St(d, r) weight decay has zero Riemannian gradient.")
    xi = grad - w @ _linalg.sym(w.transpose(-1, -2) @ grad) if constrained else grad
    xi_sq = _linalg.frame_sq_norm(xi)
    finite = xi_sq < math.inf  # False for inf and NaN
    xi = torch.where(finite, xi, torch.zeros((), dtype=xi.dtype, device=xi.device))

    m = torch.where(finite, beta1 * exp_avg + (1.0 - beta1) * xi, exp_avg)
    bias1 = 1.0 - beta1**step
    if second_moment is None:
        v = None
        s = (lr / bias1) * m
    else:
        if second_moment == "frame":
            sq = xi_sq
        elif second_moment == "column":
            sq = xi.square().sum(dim=-2, keepdim=True)
        elif second_moment == "element":
            sq = xi.square()
        else:  # pragma: no cover - refused above
            raise ValueError(f"second_moment={second_moment!r} is unknown; use one of {SECOND_MOMENTS}.")
        v = torch.where(finite, beta2 * exp_avg_sq + (1.0 - beta2) * sq, exp_avg_sq)
        bias2 = 1.0 - beta2**step
        denom = (v / bias2).sqrt() + eps
        s = (lr / bias1) * m / denom
        if eps == 0:
            s = torch.where(denom == 0, torch.zeros((), dtype=s.dtype, device=s.device), s)
        if second_moment != "frame" and constrained:
            s = _linalg.proju(w, s)
    s = _linalg.cap_step(s, trust_region) * finite  # a zero step keeps NaNs out of the retraction
    if not constrained:
        w_new = w * (1.0 - lr * weight_decay) - s if weight_decay else w - s
        return torch.where(finite, w_new, w), m, v, finite  # decay applies to a zero step too
    moving = finite & (s != 0).any(dim=-1, keepdim=True).any(dim=-2, keepdim=True)
    w_new = _linalg.polar(w - s, order=series_order, synchronize=not capturable)
    m_new = _linalg.proju(w_new, m)
    # skipped frames and frames without a step come back bit-identical (a zero-step retraction would round them)
    return torch.where(moving, w_new, w), torch.where(moving, m_new, m), v, finite
