r"""The manifold-Muon rule: the spectral-norm steepest direction on :math:`T_W\mathrm{St}(d, r)`, written twice.

The problem, for a frame :math:`W` and a momentum :math:`M` (both ``d x r``), is

.. math::

    A^\star = \operatorname*{argmax}_{A} \ \langle M, A\rangle \quad\text{s.t.}\quad
    W^\top A + A^\top W = 0, \ \ \|A\|_2 \le 1 .

With a symmetric multiplier :math:`\Lambda` for the tangency constraint the Lagrangian is
:math:`\langle M - 2W\Lambda, A\rangle`, and the dual function is the nuclear norm
:math:`g(\Lambda) = \|M - 2W\Lambda\|_*` (the dual of the spectral norm), attained at
:math:`A = \operatorname{msign}(M - 2W\Lambda)`. Strong duality holds (Slater: :math:`A = 0` is strictly
feasible), so :math:`\max \langle M, A\rangle = \min_{\Lambda = \Lambda^\top} g(\Lambda)` and for any feasible
:math:`A` and any symmetric :math:`\Lambda` the duality gap :math:`g(\Lambda) - \langle M, A\rangle \ge 0` bounds how
far :math:`A` is from optimal.

Both functions below minimise :math:`g` by gradient descent on :math:`\Lambda` (the gradient of :math:`g` at a
full-rank :math:`Z = M - 2W\Lambda` is :math:`-2\operatorname{sym}(W^\top \operatorname{msign}(Z))`, the dual ascent of
the Modula docs) with one step size per frame, adapted without host reads: a trial step is kept where it lowers
:math:`g` (and the step grows by 3/2), refused where it does not (and the step halves). The start is
:math:`\Lambda_0 = \operatorname{sym}(W^\top M)/2`, where :math:`M - 2W\Lambda_0 = P_W(M)`: zero iterations give the
cheap approximate direction :math:`\operatorname{msign}(P_W M)` made tangent.

- :func:`muon_direction_reference` is the readable specification: each iteration forms :math:`Z` and takes its
  msign from a thin SVD (float64 recommended).
- :func:`muon_direction` is the fast batched path. Since :math:`W^\top W = I`, everything the iteration needs is
  ``r x r``: :math:`Z^\top Z = M^\top M - 2 (W^\top M)^\top \Lambda - 2 \Lambda W^\top M + 4\Lambda^2`,
  :math:`\operatorname{msign}(Z) = Z (Z^\top Z)^{-1/2}`, :math:`W^\top \operatorname{msign}(Z) = (W^\top M - 2\Lambda)(Z^\top Z)^{-1/2}`,
  :math:`\|Z\|_* = \operatorname{tr}(Z^\top Z)^{1/2}`, with the ``r x r`` inverse square root by the coupled
  Newton–Schulz iteration (matrix products only, no SVD or eigendecomposition). The ``d x r`` work is two products before the
  iteration (:math:`M^\top M`, :math:`W^\top M`) and two after it (the direction), whatever the iteration count.

The returned direction is :math:`P_W(\operatorname{msign}(Z_K))`: tangent to rounding, spectral norm
:math:`1 + O(\text{residual})` (the analysis module's certificates measure both, and the optimality gap).
"""

from __future__ import annotations

import math

import torch

from .. import _linalg

__all__ = ["muon_direction", "muon_direction_reference", "muon_lr_scale", "stiefel_muon_update",
           "MUON_ADJUST_LR_FNS", "DIRECTION_STEP", "DIRECTION_GROWTH", "DIRECTION_SHRINK"]

#: The ``adjust_lr_fn`` values, with torch's ``Muon`` meanings (see :func:`muon_lr_scale`).
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")

#: First dual step, in units of :math:`\|P_W M\|_F / \sqrt r` (a typical singular value of the tangent part).
DIRECTION_STEP = 0.3
#: Factor by which a frame's dual step grows after an accepted step and shrinks after a refused one.
DIRECTION_GROWTH, DIRECTION_SHRINK = 1.5, 0.5


def muon_lr_scale(adjust_lr_fn: str | None, d: int, r: int) -> float:
    r"""The factor torch's ``Muon`` multiplies ``lr`` by for a ``d x r`` matrix, read the same way for a frame.

    torch (``torch/optim/_muon.py``, ``_adjust_lr``) takes ``A, B = param.shape[:2]`` (rows, columns; for a frame
    :math:`A = d`, :math:`B = r`) and uses

    - ``"original"`` (and ``None``; Keller Jordan's rule): :math:`\sqrt{\max(1, A/B)} = \sqrt{d/r}`;
    - ``"match_rms_adamw"`` (Moonshot's rule): :math:`0.2\sqrt{\max(A, B)} = 0.2\sqrt d`, so that the update's
      RMS matches AdamW's (an orthogonal ``d x r`` matrix has RMS :math:`1/\sqrt d`), and one lr and weight decay
      tuned for AdamW serve the whole model.

    The step actually taken is :math:`W \leftarrow \operatorname{polar}(W - \eta A^\star)` with
    :math:`\eta = \mathrm{lr}\cdot` this factor, and :math:`\|\eta A^\star\|_2 = \eta`.

    Parameters
    ----------
    adjust_lr_fn : {"original", "match_rms_adamw"} or None
        torch's rule, as above (``None`` is ``"original"``).
    d, r : int
        Shape of the frame, :math:`W \in \mathrm{St}(d, r)`.

    Returns
    -------
    float
        :math:`\sqrt{\max(1, d/r)}` or :math:`0.2\sqrt{\max(d, r)}`.

    Raises
    ------
    ValueError
        For another ``adjust_lr_fn``.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, d / r))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(d, r))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} is unknown; use one of {MUON_ADJUST_LR_FNS}.")


def _msign_svd(z: torch.Tensor) -> torch.Tensor:
    """msign by the thin SVD, with singular values below ``1e-12`` of the largest treated as zero (the minimal
    subgradient of the nuclear norm at a rank-deficient matrix)."""
    u, s, vh = torch.linalg.svd(z, full_matrices=False)
    keep = (s > s[..., :1] * 1e-12).to(z.dtype)
    return (u * keep.unsqueeze(-2)) @ vh


def muon_direction_reference(m: torch.Tensor, w: torch.Tensor, *, iterations: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The steepest tangent direction under the spectral norm, readable: dual descent with SVD msign.

    Parameters
    ----------
    m, w : torch.Tensor
        Momenta and frames, ``(..., d, r)``, one dtype (float64 for checks).
    iterations : int
        Trial steps of the dual descent (``0``: the projected msign :math:`P_W \operatorname{msign}(P_W M)`).

    Returns
    -------
    direction, dual_value, multiplier : torch.Tensor
        :math:`P_W(\operatorname{msign}(Z))` at the best :math:`\Lambda` found, ``(..., d, r)``; that
        :math:`g(\Lambda) = \|M - 2W\Lambda\|_*` ``(..., 1, 1)`` (an upper bound on the optimum); :math:`\Lambda`.
    """
    wt = w.transpose(-1, -2)
    pm = m - w @ _linalg.sym(wt @ m)
    scale = _linalg.frame_norm(pm) / math.sqrt(m.shape[-1])
    lam = 0.5 * _linalg.sym(wt @ m)
    z = m - 2.0 * w @ lam
    a = _msign_svd(z)
    g = torch.linalg.svdvals(z).sum(-1)[..., None, None]
    step = torch.full_like(g, DIRECTION_STEP)
    for _ in range(iterations):
        trial = lam + step * scale * _linalg.sym(wt @ a)
        z_t = m - 2.0 * w @ trial
        a_t = _msign_svd(z_t)
        g_t = torch.linalg.svdvals(z_t).sum(-1)[..., None, None]
        ok = g_t <= g
        lam, a, g = torch.where(ok, trial, lam), torch.where(ok, a_t, a), torch.where(ok, g_t, g)
        step = torch.where(ok, step * DIRECTION_GROWTH, step * DIRECTION_SHRINK)
    direction = a - w @ _linalg.sym(wt @ a)
    return direction, g, lam


def _inv_sqrt_and_sqrt_trace(gram: torch.Tensor, ns_steps: int, method: str = "newton"
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(G^{+1/2}, tr G^{1/2})`` of a stack of PSD ``r x r`` matrices, where :math:`G^{+1/2}` is the inverse
    square root on the range of :math:`G` (the pseudo-inverse square root; eigenvalues at most
    :math:`r\,\epsilon\,\lambda_{\max}` count as zero).

    ``method="newton"`` (the default, on every device: matrix products only) runs ``ns_steps`` coupled
    Newton–Schulz iterations on :math:`G/c`,
    :math:`c = \|G\|_F \ge \lambda_{\max}` (orthogonally invariant); eigenvalues the iterations do not
    resolve come out between 0 and their true inverse square root, so the msign they give keeps spectral norm at
    most 1. ``"eigh"`` takes the eigendecomposition (for checks; LAPACK's batched ``r x r`` eigh measured 13x
    slower than a matrix product of the same batch on one CPU core, 1.6 ms against 0.12 ms for 16 frames of
    32 columns, so Newton–Schulz is the faster path on the CPU too).
    """
    r = gram.shape[-1]
    flat = gram.reshape(-1, r, r)
    if method == "eigh":
        evals, evecs = torch.linalg.eigh(flat)
        evals = evals.clamp_min(0.0)
        cut = evals[:, -1:] * (r * torch.finfo(gram.dtype).eps)
        inv = torch.where(evals > cut, evals.clamp_min(torch.finfo(gram.dtype).tiny).rsqrt(), 0.0)
        inv_root = (evecs * inv.unsqueeze(-2)) @ evecs.transpose(-1, -2)
        trace_root = evals.sqrt().sum(-1)[:, None, None]
    elif method == "newton":
        # the Frobenius norm, not Gershgorin's row sums: it is invariant under G -> R^T G R, so the direction
        # stays O(r)-equivariant even where the iteration has not converged
        c = torch.linalg.matrix_norm(flat).clamp_min(torch.finfo(gram.dtype).tiny)[:, None, None]
        y, z = _linalg._coupled_newton_schulz(flat / c, ns_steps)
        inv_root = _linalg.sym(z) / c.sqrt()
        trace_root = y.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None] * c.sqrt()
    else:
        raise ValueError(f"method={method!r} is unknown; use 'newton' (the default) or 'eigh'.")
    return inv_root.reshape(gram.shape), trace_root.reshape(*gram.shape[:-2], 1, 1)


def muon_direction(m: torch.Tensor, w: torch.Tensor, *, iterations: int, ns_steps: int,
                   method: str = "newton") -> tuple[torch.Tensor, torch.Tensor]:
    r"""The direction of :func:`muon_direction_reference`, fast: the dual descent on ``r x r`` matrices only.

    Parameters
    ----------
    m, w : torch.Tensor
        Momenta and frames ``(n, d, r)`` (a 3-d stack), one dtype.
    iterations : int
        Trial steps of the dual descent, as in the reference.
    ns_steps : int
        Newton–Schulz iterations per inverse square root (with ``method="newton"``).
    method : {"newton", "eigh"}
        How each ``r x r`` inverse square root is taken: coupled Newton–Schulz (matrix products only, the
        default) or the eigendecomposition (for checks); see ``_inv_sqrt_and_sqrt_trace``.

    Returns
    -------
    direction, dual_gap : torch.Tensor
        :math:`A = P_W(\operatorname{msign}(Z_K))` ``(n, d, r)`` and the gap
        :math:`\|Z_K\|_* - \langle M, A\rangle` ``(n, 1, 1)`` of the kept iterate (zero at the optimum; it ignores
        that :math:`\|A\|_2` may exceed 1 by the residual, which the analysis module's certificate accounts for).
        Both terms come from the Newton–Schulz estimates: where ``ns_steps`` does not resolve the small
        eigenvalues of :math:`Z^\top Z` (a momentum whose singular values span more than about two decades at
        ``ns_steps=8``) both are underestimated, the gap is not an upper bound and can be negative, and the
        direction can be far from optimal (10 % on a :math:`1/i` spectrum; ``tests/test_muon.py``).
    """
    wt = w.transpose(-1, -2)
    mtm = torch.bmm(m.transpose(-1, -2), m)
    wtm = torch.bmm(wt, m)
    sym_wtm = _linalg.sym(wtm)
    pm_sq = (mtm.diagonal(dim1=-2, dim2=-1).sum(-1) - sym_wtm.square().sum(dim=(-2, -1)))[:, None, None]
    scale = pm_sq.clamp_min(0.0).sqrt() / math.sqrt(m.shape[-1])

    def evaluate(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wtz = wtm - 2.0 * lam  # W^T Z
        cross = torch.bmm(wtm.transpose(-1, -2), lam)
        gram = mtm - 2.0 * (cross + cross.transpose(-1, -2)) + 4.0 * torch.bmm(lam, lam)
        inv_root, nuclear = _inv_sqrt_and_sqrt_trace(_linalg.sym(gram), ns_steps, method)
        return inv_root, nuclear, _linalg.sym(torch.bmm(wtz, inv_root))

    lam = 0.5 * sym_wtm
    inv_root, g, grad = evaluate(lam)
    step = torch.full_like(g, DIRECTION_STEP)
    for _ in range(iterations):
        trial = lam + (step * scale) * grad
        inv_t, g_t, grad_t = evaluate(trial)
        ok = g_t <= g
        lam, inv_root = torch.where(ok, trial, lam), torch.where(ok, inv_t, inv_root)
        g, grad = torch.where(ok, g_t, g), torch.where(ok, grad_t, grad)
        step = torch.where(ok, step * DIRECTION_GROWTH, step * DIRECTION_SHRINK)
    # A = Z X with X = (Z^T Z)^{-1/2}; its tangent part A - W sym(W^T A) = M X - W (2 Lam X + sym(W^T Z X))
    objective = ((mtm - 2.0 * torch.bmm(wtm.transpose(-1, -2), lam)) * inv_root).sum(dim=(-2, -1), keepdim=True)
    objective = objective - (sym_wtm * grad).sum(dim=(-2, -1), keepdim=True)  # <M, W sym(W^T A)> removed
    direction = torch.bmm(m, inv_root)
    direction.baddbmm_(w, 2.0 * torch.bmm(lam, inv_root) + grad, alpha=-1.0)
    return direction, g - objective


def stiefel_muon_update(
    w: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    momentum: float,
    nesterov: bool,
    iterations: int,
    adjust_lr_fn: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""One StiefelMuon update of a stack of frames, readable (the specification); pure.

    For each frame :math:`W` with Euclidean gradient :math:`G` (with ``adjust_lr_fn=None``, ``lr`` already
    multiplied by :func:`muon_lr_scale`):

    1. :math:`\xi = G - W\operatorname{sym}(W^\top G)`
    2. :math:`B \leftarrow \mu B + (1 - \mu)\xi` (torch's ``Muon``: ``buf.lerp_(grad, 1 - momentum)``)
    3. :math:`U = (1 - \mu)\xi + \mu B` with ``nesterov`` (``grad.lerp(buf, momentum)``), else :math:`U = B`
    4. :math:`A = ` :func:`muon_direction_reference` of :math:`U` at :math:`W`
    5. :math:`W \leftarrow \operatorname{polar}(W - \eta A)` (exact, :func:`~.._linalg.polar_svd`)
    6. :math:`B \leftarrow B - W\operatorname{sym}(W^\top B)` (transport by projection)

    A frame whose gradient has a non-finite entry comes back unchanged (``W`` and ``B``); the returned mask is
    ``False`` there.

    Parameters
    ----------
    w : torch.Tensor
        Frames :math:`W`, shape ``(..., d, r)``.
    grad : torch.Tensor
        Euclidean gradient :math:`G`, of ``w``'s shape.
    momentum_buffer : torch.Tensor
        Momentum :math:`B` (tangent at ``w``), of ``w``'s shape.
    lr : float or torch.Tensor
        Step size :math:`\eta`, already multiplied by :func:`muon_lr_scale`; with ``adjust_lr_fn``, a group's
        ``lr``, multiplied here as the optimizer does.
    momentum : float
        :math:`\mu \in [0, 1)`.
    nesterov : bool
        Nesterov momentum (step 3).
    iterations : int
        Iterations of the direction's solver in :func:`muon_direction_reference` (a group's ``dual_steps``).
    adjust_lr_fn : {"original", "match_rms_adamw"} or None, default None
        A group's rule, as in :class:`StiefelMuon`: ``lr`` is then read by it (:math:`\eta = \mathrm{lr}\cdot
        s(d, r)`), so a group's own ``lr`` and ``adjust_lr_fn`` give the optimizer's step.

    Raises
    ------
    ValueError
        For a value :class:`StiefelMuon` refuses (``momentum``, ``nesterov``, ``iterations`` as its ``dual_steps``,
        ``adjust_lr_fn``), in its words.

    Returns
    -------
    w_new, buffer_new, finite : torch.Tensor
        The new frames and momentum (unchanged where the frame did not move), and the mask of frames whose
        gradient is finite, of shape ``(..., 1, 1)``.
    """
    _check_reference_options(momentum=momentum, nesterov=nesterov, iterations=iterations, adjust_lr_fn=adjust_lr_fn)
    if adjust_lr_fn is not None:
        lr = lr * muon_lr_scale(adjust_lr_fn, *w.shape[-2:])
    xi = _linalg.proju(w, grad)
    finite = _linalg.frame_sq_norm(xi) < math.inf
    xi = torch.where(finite, xi, torch.zeros((), dtype=xi.dtype, device=xi.device))
    buf = torch.where(finite, momentum * momentum_buffer + (1.0 - momentum) * xi, momentum_buffer)
    u = (1.0 - momentum) * xi + momentum * buf if nesterov else buf
    direction, _, _ = muon_direction_reference(u, w, iterations=iterations)
    moving = finite & (lr * _linalg.frame_norm(direction) > 0)
    w_new = _linalg.polar_svd(w - lr * direction)
    buf_new = _linalg.proju(w_new, buf)
    return torch.where(moving, w_new, w), torch.where(moving, buf_new, buf), finite


def _check_reference_options(*, momentum: float, nesterov: bool, iterations: int, adjust_lr_fn: str | None) -> None:
    """Refuse what :class:`StiefelMuon` refuses, with its checks (``iterations`` is its ``dual_steps``)."""
    import dataclasses

    from . import _validation
    from .muon import MUON_OPTIONS  # the optimizer's module imports this one

    table = {option.name: option for option in _validation.SHARED_OPTIONS + MUON_OPTIONS}
    options = (table["momentum"], table["nesterov"], dataclasses.replace(table["dual_steps"], name="iterations"),
               table["adjust_lr_fn"])
    given = {"momentum": momentum, "nesterov": nesterov, "iterations": iterations}
    if adjust_lr_fn is not None:
        given["adjust_lr_fn"] = adjust_lr_fn
    _validation.check_group(given, "stiefel_muon_update", options)
