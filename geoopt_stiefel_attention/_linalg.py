"""Small pure helpers for frames ``W`` of shape ``(..., d, r)`` with orthonormal columns.

Every function here is pure (no in-place update of its inputs), works on stacks of frames, and does
only ``d x r x r`` and ``r x r x r`` work: no ``d x d`` matrix is ever formed and no SVD of a ``d x r``
matrix is taken except in :func:`polar_svd`, the exact polar factor used by ``projx`` and by
:func:`polar_any_rank` for a matrix whose Gram route gives no frame (a rank-deficient one).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "sym",
    "proju",
    "frame_sq_norm",
    "frame_norm",
    "orthonormality_error",
    "inv_sqrt_spd",
    "inv_sqrt_series",
    "series_order",
    "newton_iterations",
    "inv_sqrt_newton",
    "inv_sqrt_checked",
    "inv_sqrt",
    "takes_eigh",
    "EIGH_DEVICES",
    "CHECKED_NEWTON_CONDITION",
    "polar",
    "polar_any_rank",
    "polar_svd",
    "cap_step",
    "compute_dtype",
    "ADJUST_LR_FNS",
    "frame_step_scale",
    "ORTHONORMALITY_TOLERANCE",
]

#: Largest ``max |W^T W - I|`` accepted for a frame at its first step, per parameter dtype. A bf16-rounded
#: orthonormal frame is already about 1e-3 off, so the low-precision tolerances are loose. Shared by
#: ``StiefelAdam``'s first-step check and the re-projection of frames after a cast (``manifolds``).
ORTHONORMALITY_TOLERANCE = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}

#: Devices whose batched ``torch.linalg.eigh`` is fast (LAPACK, matrix by matrix in cache): inverse square roots
#: with no series bound take the eigendecomposition there. Elsewhere (CUDA runs eigh of r > 32 matrices one launch
#: sequence at a time) they take Newton-Schulz (:func:`inv_sqrt_newton` in the optimizer's kernel,
#: :func:`inv_sqrt_checked` in :func:`polar`). Measured at the bench shape (24 x 8 x 512 x 64, float32, the
#: default rule): on one CPU core the capturable step took 146 ms with eigh and 161 ms with Newton-Schulz (medians
#: of 7 interleaved rounds, process time); on one H200 the step at width 768 took 168 ms with eigh and 2.9 ms with
#: Newton-Schulz (benchmarks/README.md).
EIGH_DEVICES = frozenset({"cpu"})

#: Device types whose tensors the host reads without a synchronisation: there the eager step reads its largest
#: actual step size and plans the retraction for it (:func:`retraction_plan`); elsewhere it plans for the trust
#: radius.
HOST_READ_DEVICES = frozenset({"cpu"})


def traced(t: torch.Tensor) -> bool:
    """Whether ``t``'s values cannot be read on the host: inside ``torch.compile`` tracing or ``torch.vmap``."""
    return torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t)

#: Condition number of a Gram matrix (scaled by a bound on its largest eigenvalue) up to which
#: :func:`inv_sqrt_checked`'s fixed Newton-Schulz iteration count reaches rounding; matrices beyond it fail the
#: residual check and take eigh. A retraction ``W + Z`` with tangent ``Z`` has condition ``1 + ||Z||_2^2``: 1e4
#: covers every step up to ``||Z||_2 = 99`` (the scaling by a bound rather than by the largest eigenvalue itself
#: costs up to a factor ``sqrt(r)`` of that reach).
CHECKED_NEWTON_CONDITION = 1e4


def takes_eigh(t: torch.Tensor) -> bool:
    """Whether an inverse square root without a series bound takes the eigendecomposition on ``t``'s device: on the
    :data:`EIGH_DEVICES`, and on ``meta`` tensors (shapes only: the checked path would read values)."""
    return t.device.type in EIGH_DEVICES or t.device.type == "meta"


def sym(a: torch.Tensor) -> torch.Tensor:
    r"""Symmetric part :math:`\operatorname{sym}(A) = (A + A^\top)/2` of a stack of square matrices."""
    return 0.5 * (a + a.transpose(-1, -2))


def proju(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""Orthogonal projection onto :math:`T_W\mathrm{St}(d, r)` in the embedded metric.

    .. math:: P_W(U) = U - W\,\operatorname{sym}(W^\top U)
    """
    return u - w @ sym(w.transpose(-1, -2) @ u)


def frame_sq_norm(u: torch.Tensor) -> torch.Tensor:
    r"""Squared Frobenius norm of each frame, :math:`\|U\|_F^2`, kept at shape ``(..., 1, 1)``."""
    return u.square().sum(dim=(-2, -1), keepdim=True)


def frame_norm(u: torch.Tensor) -> torch.Tensor:
    r"""Frobenius norm of each frame, :math:`\|U\|_F`, kept at shape ``(..., 1, 1)``."""
    return frame_sq_norm(u).sqrt()


def orthonormality_error(w: torch.Tensor) -> torch.Tensor:
    r"""Largest entry of :math:`|W^\top W - I_r|` over the whole stack (a 0-d tensor, computed in float64)."""
    w64 = w.detach().to(torch.float64)
    eye = torch.eye(w.shape[-1], dtype=torch.float64, device=w.device)
    return (w64.transpose(-1, -2) @ w64 - eye).abs().amax()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the frame arithmetic runs in: float32 for bf16/fp16 parameters, else the dtype itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def inv_sqrt_spd(gram: torch.Tensor) -> torch.Tensor:
    r"""Exact inverse square root :math:`A^{-1/2}` of a stack of symmetric positive definite matrices.

    Uses the symmetric eigendecomposition :math:`A = V \Lambda V^\top`, so
    :math:`A^{-1/2} = V \Lambda^{-1/2} V^\top`. Eigenvalues are clamped at the dtype's tiny value so that
    a rank-deficient input gives large but finite entries instead of ``inf``.
    """
    evals, evecs = torch.linalg.eigh(gram)
    inv_root = evals.clamp_min(torch.finfo(evals.dtype).tiny).rsqrt()
    return (evecs * inv_root.unsqueeze(-2)) @ evecs.transpose(-1, -2)


def _series_coefficients(order: int) -> list[float]:
    r"""Taylor coefficients :math:`c_k = \binom{-1/2}{k} = (-1)^k \binom{2k}{k} / 4^k` of :math:`(1+x)^{-1/2}`."""
    return [(-1) ** k * math.comb(2 * k, k) / 4**k for k in range(order + 1)]


def series_order(radius_sq: float, dtype: torch.dtype, max_order: int = 12) -> int | None:
    r"""Smallest Taylor order that makes :func:`inv_sqrt_series` exact to rounding.

    For :math:`A = I + E` with spectral norm :math:`\|E\|_2 \le \rho`, truncating the series of
    :math:`(I+E)^{-1/2}` after order :math:`K` leaves an error of at most
    :math:`\sum_{k > K} |c_k| \rho^k \le \rho^{K+1} / (1 - \rho)` (every :math:`|c_k| \le 1`). The order
    returned is the smallest one for which that bound is below a quarter of the unit roundoff of
    ``dtype``; ``None`` when ``rho >= 0.5`` or more than ``max_order`` terms would be needed (callers then
    use the exact :func:`inv_sqrt_spd`).
    """
    if not 0.0 <= radius_sq < 0.5:
        return None
    unit = torch.finfo(dtype).eps / 2
    if radius_sq == 0.0:
        return 1
    for order in range(1, max_order + 1):
        if radius_sq ** (order + 1) / (1.0 - radius_sq) <= unit / 4:
            return order
    return None


def inv_sqrt_series(gram: torch.Tensor, order: int) -> torch.Tensor:
    r"""Inverse square root of :math:`A = I + E` by its Taylor series, truncated after ``order`` terms.

    .. math:: (I + E)^{-1/2} \approx \sum_{k=0}^{K} \binom{-1/2}{k} E^k
              = I - \tfrac12 E + \tfrac38 E^2 - \tfrac{5}{16} E^3 + \dots

    evaluated by Horner's rule, :math:`X \leftarrow c_k I + E X`, one fused ``baddbmm`` per term
    (``order - 1`` products of ``r x r`` matrices; ``order=1`` needs none). Valid when
    :math:`\|E\|_2 < 1`; see :func:`series_order` for the truncation bound.
    """
    if order < 1:
        raise ValueError(f"inv_sqrt_series: order={order!r} is invalid; pass an int >= 1 (see series_order).")
    r = gram.shape[-1]
    eye = torch.eye(r, dtype=gram.dtype, device=gram.device)
    e = (gram - eye).reshape(-1, r, r)  # a 3-d stack, for the batched products
    coeffs = _series_coefficients(order)
    x = torch.add(coeffs[order - 1] * eye, e, alpha=coeffs[order])
    for c in reversed(coeffs[: order - 1]):
        x = torch.baddbmm(eye, e, x, beta=c)  # c I + E X
    return x.reshape(gram.shape)


#: Stopping rule of :func:`newton_iterations`: the slowest eigenvalue's residual :math:`1 - x_K` in machine epsilons.
NEWTON_RESIDUAL_UNITS = 16


def newton_iterations(radius_sq: float, dtype: torch.dtype, max_iterations: int = 40) -> int | None:
    r"""Number of iterations after which :func:`inv_sqrt_newton` is exact to rounding: the fewest that reach it.

    For a symmetric positive definite :math:`A` with spectrum in :math:`[1 - \epsilon, 1 + \rho^2]` (a Gram matrix
    :math:`(W - s)^\top (W - s) = I + s^\top s` of a frame ``W`` and a tangent step with
    :math:`\|s\|_2^2 \le \rho^2`, up to a rounding drift :math:`\epsilon` of 64 units of roundoff), each
    eigenvalue :math:`\lambda` of the scaled :math:`A / c`, :math:`c = 1 + \rho^2`, follows the scalar recurrence
    :math:`x_{k+1} = x_k (3 - x_k)^2 / 4` from :math:`x_0 = \lambda / c`, which increases monotonically to 1 on
    :math:`(0, 1]`, quadratically near it (:math:`1 - x_{k+1} \approx \tfrac34 (1 - x_k)^2`). The relative error
    of the computed :math:`A^{-1/2}` in that eigendirection is about :math:`(1 - x_K)/2`. The count returned is the
    smallest :math:`K` with :math:`1 - x_K \le` :data:`NEWTON_RESIDUAL_UNITS` machine epsilons of ``dtype`` (a
    truncation error of at most 8 epsilons, the size of the iteration's own rounding) for the slowest start, the
    smallest eigenvalue :math:`x_0 = (1 - \epsilon)/c`; ``None`` for a bound that is not finite or needs more than
    ``max_iterations``. One iteration fewer leaves that eigenvalue far from 1 (the convergence is quadratic: at
    the default trust radius, about 9,000 epsilons in float32 and 3,000 in float64), which
    ``tests/test_linalg.py`` checks against the SVD at the worst case.
    """
    if not (math.isfinite(radius_sq) and radius_sq >= 0.0):
        return None
    eps = torch.finfo(dtype).eps
    x = (1.0 - 64 * eps) / (1.0 + radius_sq)
    for k in range(max_iterations + 1):
        if 1.0 - x <= NEWTON_RESIDUAL_UNITS * eps:
            return max(k, 1)
        x = x * (3.0 - x) ** 2 / 4.0
    return None


def retraction_plan(radius_sq: float, dtype: torch.dtype) -> tuple[str, int] | None:
    r"""The cheapest retraction that is exact to rounding for Gram matrices with spectrum in
    :math:`[1 - \epsilon, 1 + \rho^2]` (``radius_sq`` is :math:`\rho^2`, including the rounding margin): matrix
    products only, no eigendecomposition and no host synchronisation.

    Returns ``("series", K)`` (:func:`inv_sqrt_series` of order :func:`series_order`, :math:`K - 1` products of
    ``r x r`` matrices) or ``("newton", K)`` (:func:`inv_sqrt_newton` with :func:`newton_iterations`,
    :math:`3K - 1` products), whichever costs fewer products; ``None`` when neither reaches rounding (no finite bound,
    or one beyond :func:`newton_iterations`' reach), where callers take the exact :func:`inv_sqrt`.
    """
    order = series_order(radius_sq, dtype)
    iterations = newton_iterations(radius_sq, dtype)
    plans = []
    if order is not None:
        plans.append((order - 1, ("series", order)))
    if iterations is not None:
        plans.append((3 * iterations - 1, ("newton", iterations)))
    return min(plans)[1] if plans else None


def inv_sqrt_planned(gram: torch.Tensor, radius_sq: float, plan: tuple[str, int]) -> torch.Tensor:
    """:math:`A^{-1/2}` of a stack of SPD matrices by the ``plan`` of :func:`retraction_plan` for ``radius_sq``."""
    method, count = plan
    if method == "series":
        return inv_sqrt_series(gram, count)
    if method == "newton":
        return inv_sqrt_newton(gram, radius_sq, count)
    raise ValueError(f"inv_sqrt_planned: plan={plan!r} is unknown; pass one of retraction_plan's.")


def inv_sqrt_newton(gram: torch.Tensor, radius_sq: float, iterations: int) -> torch.Tensor:
    r"""Inverse square root of a stack of SPD matrices by the coupled Newton–Schulz iteration: matrix products
    only, no eigendecomposition and no host synchronisation (for accelerators and captured graphs).

    With :math:`c = 1 + \rho^2` (``radius_sq`` is :math:`\rho^2`, a bound on :math:`\lambda_{\max}(A) - 1`),
    :math:`Y_0 = A / c`, :math:`Z_0 = I` and

    .. math:: T_k = \tfrac12 (3I - Z_k Y_k), \qquad Y_{k+1} = Y_k T_k, \qquad Z_{k+1} = T_k Z_k,

    :math:`Z_k \to (A/c)^{-1/2}` quadratically once :math:`\|I - Z_k Y_k\|` is small (Higham, *Functions of
    Matrices*, 2008, §6.7; every iterate is a polynomial in :math:`A`, so each eigenvalue follows the scalar
    recurrence of :func:`newton_iterations`, which gives the ``iterations`` that make the result exact to
    rounding). Returns :math:`\operatorname{sym}(Z_K) / \sqrt{c}`.
    """
    if iterations < 1:
        raise ValueError(f"inv_sqrt_newton: iterations={iterations!r} is invalid; pass an int >= 1 "
                         f"(see newton_iterations).")
    r = gram.shape[-1]
    c = 1.0 + float(radius_sq)
    _, z = _coupled_newton_schulz((gram / c).reshape(-1, r, r), iterations, need_y=False)
    return (sym(z) / math.sqrt(c)).reshape(gram.shape)


def _coupled_newton_schulz(y: torch.Tensor, iterations: int, *,
                           need_y: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(Y_K, Z_K)`` of the coupled iteration of :func:`inv_sqrt_newton` from ``Y_0 = y`` (a 3-d stack of SPD
    matrices with spectrum in ``(0, 1]``) and ``Z_0 = I``: ``Z_K -> y^{-1/2}``, ``Y_K -> y^{1/2}``. With
    ``need_y=False`` the last ``Y`` update is skipped (one product fewer) and ``None`` returned in its place."""
    eye = torch.eye(y.shape[-1], dtype=y.dtype, device=y.device)
    z = eye.expand_as(y)
    for k in range(iterations):
        t = torch.baddbmm(eye, z, y, beta=1.5, alpha=-0.5)  # (3I - Z Y) / 2
        z = torch.bmm(t, z)
        y = torch.bmm(y, t) if need_y or k + 1 < iterations else None
    return y, z


def inv_sqrt_checked(gram: torch.Tensor) -> torch.Tensor:
    r"""Exact inverse square root of a stack of SPD matrices with no bound on their spectrum known in advance, by
    Newton–Schulz with a residual check: matrix products and one host synchronisation, for accelerators.

    Each matrix :math:`A` is scaled by a bound on its largest eigenvalue, the smaller of its Frobenius norm and
    its largest absolute row sum (Gershgorin), :math:`c = \min(\|A\|_F, \|A\|_\infty) \ge \lambda_{\max}(A)`
    (both at most :math:`\sqrt r\,\lambda_{\max}`),
    and :math:`A / c` is run through the coupled iteration of :func:`inv_sqrt_newton` for the
    :func:`newton_iterations` that reach rounding from condition :data:`CHECKED_NEWTON_CONDITION`. Every iterate
    is a polynomial in :math:`A`, so :math:`Y_K = (A/c) Z_K` and the residual :math:`E = Z_K Y_K - I` gives
    :math:`Z_K = (A/c)^{-1/2} (I + E)^{1/2}`: the relative error of the result is about :math:`\|E\|/2`. A matrix
    whose residual exceeds a few units of roundoff per inner product, :math:`\max_{ij} |E_{ij}| > 8 r u`
    (condition beyond the iteration's reach, rank deficiency, or a non-finite entry), is recomputed by
    :func:`inv_sqrt_spd`, so the result is that of the eigendecomposition wherever Newton–Schulz has not
    converged. Returns :math:`\operatorname{sym}(Z_K) / \sqrt{c}`. bfloat16 and float16 matrices are computed in
    float32 (:func:`compute_dtype`; their own roundoff would make the check empty) and rounded back.
    """
    if gram.numel() == 0:
        return gram.clone()
    r = gram.shape[-1]
    a = gram.reshape(-1, r, r).to(compute_dtype(gram.dtype))
    tiny = torch.finfo(a.dtype).tiny
    bound = torch.minimum(torch.linalg.matrix_norm(a), a.abs().sum(dim=-1).amax(dim=-1))
    c = bound.clamp_min(tiny)[:, None, None]
    iterations = newton_iterations(CHECKED_NEWTON_CONDITION - 1.0, a.dtype) + 1  # + 1: c may exceed lambda_max
    y, z = _coupled_newton_schulz(a / c, iterations)
    eye = torch.eye(r, dtype=a.dtype, device=a.device)
    residual = (torch.bmm(z, y) - eye).abs().amax(dim=(-2, -1))
    x = sym(z) / c.sqrt()
    unresolved = ~(residual <= 8 * r * torch.finfo(a.dtype).eps / 2)  # NaN counts as unresolved
    if bool(unresolved.any()):
        index = unresolved.nonzero().squeeze(-1)
        x = x.index_put((index,), inv_sqrt_spd(a[index]))
    return x.reshape(gram.shape).to(gram.dtype)


def inv_sqrt(gram: torch.Tensor, *, synchronize: bool = True) -> torch.Tensor:
    """Exact inverse square root of a stack of SPD matrices with no bound known in advance, by the device's method:
    :func:`inv_sqrt_spd` on the :data:`EIGH_DEVICES` (and meta tensors, see :func:`takes_eigh`) or when the caller
    may not ``synchronize`` (a capturable step reads nothing on the host); :func:`inv_sqrt_checked` elsewhere."""
    if takes_eigh(gram) or not synchronize:
        return inv_sqrt_spd(gram)
    return inv_sqrt_checked(gram)


def polar(y: torch.Tensor, *, order: int | None = None, synchronize: bool = True) -> torch.Tensor:
    r"""Orthonormal polar factor :math:`Y (Y^\top Y)^{-1/2}` of a stack of full-rank ``d x r`` matrices.

    The Gram matrix :math:`Y^\top Y` is formed from the actual ``Y`` (not from the identity
    :math:`I + s^\top s` that holds in exact arithmetic for ``Y = W - s`` with tangent ``s``): this way
    each retraction also removes the rounding drift left by the previous one.

    Parameters
    ----------
    y : torch.Tensor
        Shape ``(..., d, r)`` with ``r <= d`` and full column rank.
    order : int or None
        ``None`` computes :math:`(Y^\top Y)^{-1/2}` exactly: by an ``r x r`` eigendecomposition on the
        :data:`EIGH_DEVICES`, by :func:`inv_sqrt_checked` elsewhere (Newton–Schulz, with the eigendecomposition
        for any matrix it has not resolved; see ``synchronize``); an
        integer uses :func:`inv_sqrt_series` of that order, which callers may choose only when they know
        a bound on :math:`\|Y^\top Y - I\|_2` (see :func:`series_order`).
    synchronize : bool, default True
        Whether the checked path may read its residual on the host (one synchronisation). ``False`` (a capturable
        optimizer step, which must read nothing on the host) keeps the eigendecomposition everywhere.
    """
    gram = y.transpose(-1, -2) @ y
    x = inv_sqrt(gram, synchronize=synchronize) if order is None else inv_sqrt_series(gram, order)
    return y @ x


def polar_any_rank(y: torch.Tensor) -> torch.Tensor:
    r"""A frame for every ``d x r`` matrix ``y``: :func:`polar` (the Gram route), with :func:`polar_svd` for each
    matrix whose Gram-route result is not a frame. ``PolarStiefel.retr`` retracts with it.

    :func:`polar` inverts :math:`(Y^\top Y)^{1/2}`, which a rank-deficient ``Y`` does not have (``W + U`` with a
    step ``U`` that is not tangent, e.g. ``U = -W``): the eigenvalue clamp of :func:`inv_sqrt_spd` then gives a zero
    or an enormous column, not a point of the manifold. Each result is checked for that at :math:`O(d r)` cost
    (no Gram matrix of the result, which would cost as much as the retraction's products): its entries are finite,
    and every squared column norm, as well as the squared norm of the sum of the columns (the sum of every entry of
    :math:`Q^\top Q`, which an off-diagonal error moves), is within :data:`ORTHONORMALITY_TOLERANCE` of the dtype
    (times ``r`` for the sum) of its value for a frame. A matrix that fails is recomputed from its thin SVD,
    :math:`U V^\top`, a frame for any ``Y`` (for a rank-deficient ``Y`` one of its closest frames, which is not
    unique there). Inside ``torch.compile`` and ``torch.vmap``, where the check cannot be read on the host, every
    matrix's SVD is computed and selected where the check fails: the same result, at the SVD's cost.
    """
    q = polar(y)
    if q.numel() == 0 or q.device.type == "meta":  # nothing to check (meta tensors hold shapes only)
        return q
    tol = ORTHONORMALITY_TOLERANCE.get(q.dtype, ORTHONORMALITY_TOLERANCE[torch.float32])
    r = q.shape[-1]
    columns = (q.square().sum(dim=-2) - 1.0).abs().amax(dim=-1)
    total = (q.sum(dim=-1).square().sum(dim=-1) - r).abs()
    good = (columns <= tol) & (total <= tol * r)  # NaN and inf fail both comparisons
    if traced(q):
        return torch.where(good[..., None, None], q, polar_svd(y))
    if bool(good.all()):
        return q
    flat_q, flat_y = q.reshape(-1, *q.shape[-2:]), y.reshape(-1, *y.shape[-2:])
    index = (~good).reshape(-1).nonzero().squeeze(-1)
    return flat_q.index_put((index,), polar_svd(flat_y[index])).reshape(q.shape)


def polar_svd(x: torch.Tensor) -> torch.Tensor:
    r"""Closest frame to ``x`` in Frobenius norm, :math:`U V^\top` from the thin SVD :math:`x = U \Sigma V^\top`."""
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def cap_step(s: torch.Tensor, radius: float | None) -> torch.Tensor:
    r"""Trust-region cap applied per frame: :math:`s \leftarrow s \cdot \min(1, \Delta / \|s\|_F)`.

    ``radius=None`` returns ``s`` unchanged. A zero step stays zero (no division by zero).
    """
    if radius is None:
        return s
    norm = frame_norm(s)
    scale = (radius / norm.clamp_min(torch.finfo(norm.dtype).tiny)).clamp(max=1.0)
    return s * scale


#: The accepted values of the ``adjust_lr_fn`` option (the names torch's ``Muon`` uses for the same job).
ADJUST_LR_FNS = ("original", "match_rms_adamw")


#: The trust radius :math:`\Delta` that ``trust_region="auto"`` (the default) stands for, per ``adjust_lr_fn``.
#: :math:`\Delta` always caps a frame's step in the frame's own units, :math:`\|s\|_F \le \Delta` (columns of unit
#: norm), whatever the rule: ``"original"`` keeps the paper's 0.1; ``"match_rms_adamw"``, whose steps are
#: :math:`\sqrt{d r}` times larger, takes 1, so that every step's polar retraction is certified at
#: :math:`\operatorname{cond}\big((W - s)^\top (W - s)\big) \le 1 + \Delta^2 = 2` and no step turns a frame's
#: column space by more than :math:`\arctan \Delta = 45°`.
AUTO_TRUST_REGION = {"original": 0.1, "match_rms_adamw": 1.0}


def trust_radius(trust_region: float | str | None, adjust_lr_fn: str) -> float | None:
    r"""The trust radius :math:`\Delta` a group steps with: ``trust_region`` itself, or for ``"auto"`` the value
    :data:`AUTO_TRUST_REGION` gives ``adjust_lr_fn``; ``None`` (no cap) stays ``None``.

    :math:`\Delta` caps :math:`\|s\|_F` of each frame's step :math:`s` under every ``adjust_lr_fn`` (it is not
    scaled with the learning rate). For a tangent step, :math:`(W - s)^\top (W - s) = I + s^\top s`, so
    :math:`\|s\|_2 \le \|s\|_F \le \Delta` bounds the Gram matrix's spectrum to :math:`[1, 1 + \Delta^2]`, the
    retraction's cost (:func:`retraction_plan`) and the largest principal angle between the column spaces of
    :math:`W` and :math:`\operatorname{polar}(W - s)` by :math:`\arctan \Delta`.

    Parameters
    ----------
    trust_region : float or {"auto"} or None
        The group's ``trust_region`` option: a radius :math:`\Delta > 0`, ``"auto"``, or ``None`` for no cap.
    adjust_lr_fn : {"original", "match_rms_adamw"}
        The group's ``adjust_lr_fn``; read for ``"auto"`` only.

    Returns
    -------
    float or None
        :math:`\Delta`, or ``None`` for no cap.

    Raises
    ------
    ValueError
        For a string other than ``"auto"``.
    """
    if isinstance(trust_region, str):
        if trust_region != "auto":
            raise ValueError(f"trust_region={trust_region!r} is unknown; pass a float > 0, 'auto' or None.")
        return AUTO_TRUST_REGION[adjust_lr_fn]
    return trust_region


def frame_step_scale(adjust_lr_fn: str, d: int, r: int) -> float:
    r"""The factor :math:`c` by which a ``d x r`` frame's ``lr`` is multiplied (the trust radius is not: see
    :func:`trust_radius`).

    With one second moment per frame the normalised direction :math:`\hat m / \sqrt{\hat v}` has Frobenius
    norm about 1, so a frame's step has :math:`\|s\|_F \approx c\,\mathrm{lr}`:

    - ``"original"`` (the paper's fixed step): :math:`c = 1`. ``lr`` is the Frobenius norm of a whole frame's
      step, whatever its shape.
    - ``"match_rms_adamw"``: :math:`c = \sqrt{d r}`. ``lr`` is a per-entry (RMS) size, as for AdamW, which moves
      each of the :math:`d r` entries of a block by about ``lr``, i.e. the block by about
      :math:`\mathrm{lr}\sqrt{d r}`. One learning rate then serves the frames and the Euclidean parameters (as
      ``adjust_lr_fn="match_rms_adamw"`` does for torch's ``Muon``).

    Either way the step stays scale-free in the gradient and O(d)-equivariant: :math:`c` depends on the shape
    only.

    Parameters
    ----------
    adjust_lr_fn : {"original", "match_rms_adamw"}
        How ``lr`` is read, as above.
    d, r : int
        Shape of the frame, :math:`W \in \mathrm{St}(d, r)`.

    Returns
    -------
    float
        :math:`c`: ``1.0`` or :math:`\sqrt{d r}`.

    Raises
    ------
    ValueError
        For another ``adjust_lr_fn``.
    """
    if adjust_lr_fn == "original":
        return 1.0
    if adjust_lr_fn == "match_rms_adamw":
        return math.sqrt(d * r)
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} is unknown; use one of {ADJUST_LR_FNS}.")

