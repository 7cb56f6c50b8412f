r"""The update rule written fast: :func:`_frame_update_`, the fused in-place kernel.

The second of the two places the rule is written; :func:`~geoopt_stiefel_attention.optim.stiefel_adam_update`
is its specification, and ``tests/test_optim_contract.py`` checks in float64 that both agree step for step.
"""

from __future__ import annotations

import math

import torch

from .. import _linalg

#: Second-moment modes with the fused in-place kernel; the ablation variants use :func:`stiefel_adam_update`.
_FAST_MODES = ("frame", None)


def _rounding_margin(dtype: torch.dtype) -> float:
    """Slack added to ``||s||^2`` in the bound on ``||(W - s)^T (W - s) - I||_2``: the rounding drift of ``W^T W``
    from the identity and of ``s`` from the tangent space (both a few units of roundoff)."""
    return 64 * torch.finfo(dtype).eps


def _frame_update_(
    w: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor | None,
    scratch: torch.Tensor,
    *,
    step: int | torch.Tensor,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    trust_region: float | None,
    maximize: bool = False,
    capturable: bool = False,
) -> torch.Tensor:
    r"""The update of :func:`stiefel_adam_update` for ``second_moment`` in ``("frame", None)``, in place.

    ``w`` and ``exp_avg`` (shape ``(n, d, r)``, compute dtype, both row-major or both column-major, i.e.
    ``x.mT`` contiguous) and ``exp_avg_sq`` (``(n, 1, 1)``) are overwritten; ``grad`` is only read;
    ``scratch`` (``(n, d, r)``, laid out like ``w``) holds first :math:`\xi`, then :math:`W - s`. ``step`` is an int or
    a tensor of step counts broadcastable to ``(n, 1, 1)`` (the capturable path). Six ``d x r x r`` products per step: :math:`W^\top G`, :math:`W S`, the Gram matrix of the
    actual :math:`W - s`, :math:`(W - s) X`, :math:`W_+^\top m` and :math:`W_+ S'`, the last four written
    into their destinations (``baddbmm``/``out=``) so that no ``d x r`` temporary is allocated.

    Skipped frames (non-finite :math:`\|\xi\|_F^2`) come back unchanged: the non-finite entries of their
    :math:`\xi` are zeroed and it is averaged in with weight 0 (:math:`m + 0\,(\xi - m) = m`; a ``-0.0`` entry of
    :math:`m` may come back as ``+0.0``, equal to it), their step is zero and their
    retraction and transport multiply by the identity and subtract zero. Frames whose step size is zero
    (``lr = 0``, or ``eps = 0`` with a zero second moment, whose :math:`1/\sqrt{\hat v}` is taken as 0) keep
    ``W`` bit-identical the same way; their moments are updated. On CPU the masking runs only when a
    frame is actually skipped. The retraction's inverse square root is planned for a bound on the step
    (:func:`~.._linalg.retraction_plan`: a Taylor series for small steps, Newton-Schulz with the fewest iterations
    exact at the bound for larger ones, matrix products only): on the CPU outside capturable mode the bound is the
    largest step actually taken (reading a CPU tensor costs no synchronisation); elsewhere, and with
    ``capturable=True`` on any device, it is the trust radius :math:`\Delta`, which caps :math:`\|s\|_F` in the
    frame's own units (:func:`~.._linalg.trust_radius`; 1 under the default rule, so 4 Newton-Schulz iterations in
    float32). A step with no such bound (no trust region, off the host) takes the eigendecomposition on the
    :data:`~.._linalg.EIGH_DEVICES` and with ``capturable=True``, and elsewhere
    :func:`~.._linalg.inv_sqrt_checked` (Newton-Schulz with a residual check: one synchronisation, the only host
    read of a step off the CPU outside capturable mode). With ``capturable=True`` the step reads no tensor on the
    host.

    Returns the boolean ``(n, 1, 1)`` mask of updated frames.
    """
    on_host = w.device.type in _linalg.HOST_READ_DEVICES and not capturable  # may values be read on the host?
    if on_host and isinstance(step, torch.Tensor) and step.numel() == 1:  # compiled on the CPU (frame_update_)
        step = int(step)  # bias corrections in Python floats, as the default eager step computes them
    row_major = w.is_contiguous()

    def stored(t: torch.Tensor) -> torch.Tensor:
        """``t`` in storage order: itself, or for column-major frames its (contiguous) transpose. Every
        ``out=`` below writes through it, so no output is strided (which torch.compile refuses)."""
        return t if row_major else t.mT

    sign = -1.0 if maximize else 1.0
    # 1. xi = sign * (G - W sym(W^T G)), into scratch
    a = torch.bmm(w.mT, grad)
    a = a + a.mT  # 2 sym(W^T G), exactly symmetric: (W A)^T = A W^T
    factors = (w, a) if row_major else (a, w.mT)
    torch.baddbmm(stored(grad), *factors, beta=sign, alpha=-0.5 * sign, out=stored(scratch))
    xi = scratch
    xi_sq = torch.linalg.vector_norm(xi, dim=(-2, -1), keepdim=True).square_()
    finite = xi_sq < math.inf  # False for inf and NaN
    masked = not (on_host and bool(finite.all()))
    weight = 1.0 - beta1
    if masked:  # skipped frames: finite junk in xi, averaged in with weight 0 (m + 0 (xi - m) = m)
        xi.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        weight = finite.to(xi.dtype).mul_(weight)
    # 2. m <- beta1 m + (1 - beta1) xi
    exp_avg.lerp_(xi, weight)
    # 3.-4. v <- beta2 v + (1 - beta2) ||xi||^2; per-frame step size alpha, s = alpha m
    bias1 = 1.0 - beta1**step
    if exp_avg_sq is None:
        alpha = torch.zeros_like(xi_sq).add_(lr / bias1)
    else:
        if masked:
            xi_sq = torch.where(finite, xi_sq, exp_avg_sq)
        exp_avg_sq.lerp_(xi_sq, 1.0 - beta2)
        alpha = exp_avg_sq.div(1.0 - beta2**step).sqrt_().add_(eps).reciprocal_().mul_(lr / bias1)
        if eps == 0:  # v = 0 (then m = 0 too): no step instead of 1/0 (and 0 * inf when lr = 0)
            alpha.nan_to_num_(nan=0.0, posinf=0.0)
    moving = finite
    if (not isinstance(lr, torch.Tensor) and lr == 0) or eps == 0:  # only then can a step size be exactly 0
        moving = finite & (alpha != 0)
        masked = masked or not (on_host and bool(moving.all()))
    # 5. trust region: ||s|| = alpha ||m|| <= Delta; the retraction is planned for the largest step possible
    bound = plan = None
    if trust_region is not None or on_host:
        m_norm = torch.linalg.vector_norm(exp_avg, dim=(-2, -1), keepdim=True)
        if trust_region is not None:
            alpha = torch.minimum(alpha, trust_region / m_norm)  # Delta / 0 = inf leaves alpha as is
        radius = float((alpha * m_norm).amax()) if on_host else trust_region  # the actual step, or its cap
        if math.isfinite(radius):
            bound = radius**2 + _rounding_margin(w.dtype)
            plan = _linalg.retraction_plan(bound, w.dtype)
    if masked:
        alpha = alpha * moving
    # 6. W <- (W - s) X with X = ((W - s)^T (W - s))^{-1/2}
    torch.addcmul(stored(w), stored(exp_avg), alpha, value=-1.0, out=stored(scratch))
    y = scratch
    gram = torch.bmm(y.mT, y)
    if plan is not None:  # matrix products only: a series or Newton-Schulz sized to the bound
        x = _linalg.inv_sqrt_planned(gram, bound, plan)
    else:  # no bound: eigh, or on an accelerator allowed to synchronise checked Newton-Schulz
        x = _linalg.inv_sqrt(gram, synchronize=not capturable)
    if masked:
        x = torch.where(moving, x, torch.eye(x.shape[-1], dtype=x.dtype, device=x.device))
    if row_major:
        torch.bmm(y, x, out=w)
    else:  # column-major W: write W_+^T = X^T (W - s)^T into its contiguous transpose, no copy
        torch.bmm(x.mT, y.mT, out=w.mT)
    # 7. m <- m - W sym(W^T m)
    b = torch.bmm(w.mT, exp_avg)
    b = b + b.mT  # exactly symmetric
    if masked:
        b = b * moving
    if row_major:
        exp_avg.baddbmm_(w, b, alpha=-0.5)
    else:
        exp_avg.mT.baddbmm_(b, w.mT, alpha=-0.5)  # (W S)^T = S W^T for the symmetric S
    return finite


@torch.library.custom_op("geoopt_stiefel_attention::frame_update_",
                         mutates_args=("w", "exp_avg", "exp_avg_sq", "scratch"))
def _frame_update_op(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor | None,
                     scratch: torch.Tensor, step: torch.Tensor | None, step_int: int, lr: torch.Tensor | None,
                     lr_float: float, beta1: float, beta2: float, eps: float, trust_region: float | None,
                     maximize: bool, capturable: bool) -> torch.Tensor:
    """:func:`_frame_update_` as one operator that ``torch.compile`` calls without tracing into it (a tensor or a
    Python number for ``step`` and ``lr``, as the operator schema has no unions)."""
    return _frame_update_(w, grad, exp_avg, exp_avg_sq, scratch, step=step_int if step is None else step,
                          lr=lr_float if lr is None else lr, beta1=beta1, beta2=beta2, eps=eps,
                          trust_region=trust_region, maximize=maximize, capturable=capturable)


@_frame_update_op.register_fake
def _(w, grad, exp_avg, exp_avg_sq, scratch, step, step_int, lr, lr_float, beta1, beta2, eps, trust_region, maximize,
      capturable):
    return w.new_empty((w.shape[0], 1, 1), dtype=torch.bool)


def frame_update_(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor | None,
                  scratch: torch.Tensor, *, step: int | torch.Tensor, lr: float | torch.Tensor, **hyper) -> torch.Tensor:
    r""":func:`_frame_update_`, called directly in eager mode and as one opaque operator while ``torch.compile``
    traces the step.

    Compiled, the operator runs the eager kernel inside the compiled graph: its six products and in-place moment
    updates as written here, instead of inductor's regeneration of them (on the CPU its generated elementwise loops
    and the copies it inserts around ``baddbmm`` made the compiled step 1.25-1.5x slower than the eager one, issue
    40). Dynamo traces every optimizer as capturable; the operator, not traced, plans the retraction as the eager
    kernel would with ``capturable=False`` on a device in :data:`~.._linalg.HOST_READ_DEVICES` (the CPU: it reads the
    largest step it took, no synchronisation and no graph to capture) and as with ``capturable=True`` elsewhere, so a
    compiled CPU step costs what the default eager step costs (there a batch with one step count also takes its
    bias corrections in Python floats, as eager does). Results are those of the eager kernel on the same step
    counts, bit for bit."""
    if not torch.compiler.is_compiling():
        return _frame_update_(w, grad, exp_avg, exp_avg_sq, scratch, step=step, lr=lr, **hyper)
    step_t = step if isinstance(step, torch.Tensor) else None
    lr_t = lr if isinstance(lr, torch.Tensor) else None
    # Dynamo traces every optimizer as capturable (step counts as tensors, no host read in the traced code). The
    # operator is not traced: it runs eagerly inside the compiled graph, so on a device whose tensors the host reads
    # without a synchronisation (the CPU, where there is no graph to capture) it reads the step it took and plans
    # the retraction for it, as the default eager step does, instead of for the trust radius.
    capturable = hyper.get("capturable", False) and w.device.type not in _linalg.HOST_READ_DEVICES
    return _frame_update_op(w, grad, exp_avg, exp_avg_sq, scratch, step_t, 0 if step_t is not None else int(step),
                            lr_t, 0.0 if lr_t is not None else float(lr), hyper["beta1"], hyper["beta2"],
                            hyper["eps"], hyper["trust_region"], hyper.get("maximize", False), capturable)
