r"""The manifold-Muon rule: the spectral-norm steepest direction on :math:`T_W\mathrm{St}(d, r)`, written twice.

The problem, for a frame :math:`W` and a momentum :math:`M` (both ``d x r``), is

.. math::

    A^\star = \operatorname*{argmax}_{A} \ \langle M, A\rangle \quad\text{s.t.}\quad
    W^\top A + A^\top W = 0, \ \ \|A\|_2 \le 1 .

**Its solution in closed form.** Let :math:`X = M W^\top - W M^\top` (``d x d``, skew). Then

.. math::

    A^\star = \operatorname{msign}(X)\, W, \qquad
    \max \langle M, A\rangle = \tfrac12 \|X\|_* = \tfrac12 \|M W^\top - W M^\top\|_* .

*Proof.* With :math:`[W, W_\perp]` orthogonal, a tangent :math:`A = W B + W_\perp C` has :math:`B` skew. By Parrott's
completion theorem the block matrix :math:`\Omega_0 = \left[\begin{smallmatrix} B & -C^\top \\ C & E
\end{smallmatrix}\right]` has, for some :math:`E`, spectral norm :math:`\max(\|[B; C]\|_2, \|[B, -C^\top]\|_2) =
\|A\|_2` (the two blocks are transposes up to sign); averaging :math:`E` with :math:`-E^\top` keeps the norm
(convexity) and makes :math:`\Omega_0` skew. So every feasible :math:`A` is :math:`\Omega W` for a skew
:math:`\Omega = [W, W_\perp]\Omega_0[W, W_\perp]^\top` with :math:`\|\Omega\|_2 \le 1`, and (weak duality)

.. math::

    \langle M, \Omega W\rangle = \langle M W^\top, \Omega\rangle = \tfrac12\langle X, \Omega\rangle
    \le \tfrac12 \|X\|_*\,\|\Omega\|_2 \le \tfrac12 \|X\|_* .

:math:`\Omega = \operatorname{msign}(X)` is skew with norm 1 and attains the bound, and :math:`\operatorname{msign}(X)
W` is tangent (:math:`W^\top \Omega W` is skew). :math:`X` does not change when :math:`M` is replaced by its
tangent part. Square frames (:math:`r = d`) give :math:`A^\star = W \operatorname{msign}(\operatorname{skew}(W^\top
M))`; a skew matrix of odd order has a zero singular value, which msign maps to zero. This is the problem whose dual
:math:`\min_{\Lambda = \Lambda^\top}\|M - 2W\Lambda\|_*` the earlier solver descended (Modula docs): both duals have
the same value, but that one is nonsmooth and degenerate at its minimum when :math:`r` is close to :math:`d`
(issue 56), while :math:`\tfrac12\|X\|_*` needs no search.

**A certificate for any computed direction.** For a skew :math:`\Omega` with :math:`\|\Omega\|_2 \le 1`, the direction
:math:`A = \Omega W` is feasible, and any upper bound :math:`U \ge \tfrac12\|X\|_*` gives the duality gap
:math:`U - \langle M, A\rangle \ge \mathrm{OPT} - \langle M, A\rangle \ge 0`. Both functions below return that gap.

- :func:`muon_direction_reference` is the readable specification: msign of the ``d x d`` matrix :math:`X` by a
  full SVD (float64 recommended), :math:`U = \tfrac12\|X\|_*` from its singular values.
- :func:`muon_direction` is the fast batched path (matrix products only, no SVD, eigendecomposition or solve),
  stopped per frame on the certificate; see its notes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _linalg

__all__ = ["muon_direction", "muon_direction_reference", "muon_lr_scale", "stiefel_muon_update",
           "MUON_ADJUST_LR_FNS", "DEFAULT_DIRECTION_TOL", "DirectionSolve", "default_direction_tol",
           "direction_round_length", "certified_direction_steps"]

#: The ``adjust_lr_fn`` values, with torch's ``Muon`` meanings (see :func:`muon_lr_scale`).
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")

#: Relative duality-gap tolerance of the direction per compute dtype (``direction_tol=None``): the solver stops a
#: frame once :math:`(U - \langle M, A\rangle) / U \le` this. Typical certified gaps are far below (float64 about
#: 1e-14, float32 about 1e-6 on Gaussian and :math:`1/i`-spectrum momenta); the tolerances leave room for what the
#: dtype cannot resolve in the whitening of :math:`d > 2r` frames (:func:`muon_direction`'s notes): up to 2e-8 in
#: float64 (a flat rest of singular values near :math:`10^{-10}` to :math:`10^{-13}` of the largest), and in
#: float32 about :math:`r\sqrt d\,\epsilon` for rank-deficient momenta (2e-4 at 768 x 64) and 3e-4 for a rest near
#: :math:`10^{-5}`. bfloat16/float16 frames are computed in float32.
DEFAULT_DIRECTION_TOL = {torch.float64: 1e-7, torch.float32: 1e-3}

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


def default_direction_tol(dtype: torch.dtype) -> float:
    """:data:`DEFAULT_DIRECTION_TOL` of the compute dtype of ``dtype`` (float32 for bfloat16/float16)."""
    return DEFAULT_DIRECTION_TOL[_linalg.compute_dtype(dtype)]


# ------------------------------------------------------------------------------------------- the iteration
def _cubic(z: float) -> float:
    return 1.5 * z - 0.5 * z ** 3


#: Lower end of the singular-value interval one round of the iteration is designed for (relative to the scale).
ROUND_FLOOR = 1e-4
_SAFE_FLOOR, _SAFE_MARGIN = 0.05, 1e-3


def _round_alphas(floor: float, eps_end: float) -> tuple[float, ...]:
    r"""The scalings :math:`\alpha_1, \dots, \alpha_K` of one round: the step :math:`x \mapsto \varphi(\alpha x)`,
    :math:`\varphi(z) = (3z - z^3)/2`, maps every singular value of :math:`[0, 1]` into :math:`[0, 1]` (the maximum
    of :math:`\varphi` is :math:`\varphi(1) = 1`), and each :math:`\alpha_k` is the largest (greedy) that keeps the
    image of the interval :math:`[\ell_k, 1]` known so far as high as possible, :math:`\ell_{k+1} = \min(\varphi(
    \alpha_k \ell_k), \varphi(\alpha_k))`, until :math:`1 - \ell_K \le` ``eps_end`` (the cubic counterpart of the
    Polar Express schedule). :math:`\alpha` is capped where :math:`\varphi(\alpha (1 + 10^{-3})) = 0.05`, so that
    a singular value rounded slightly above 1 is not sent to (or through) zero."""
    lo, hi = 1.0, math.sqrt(3.0)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _cubic(mid * (1 + _SAFE_MARGIN)) >= _SAFE_FLOOR else (lo, mid)
    alpha_max, alphas, low = lo, [], floor
    while 1.0 - low > eps_end:
        if _cubic(alpha_max * low) <= _cubic(alpha_max):
            alpha = alpha_max
        else:
            lo, hi = 1.0, alpha_max
            for _ in range(100):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if _cubic(mid * low) < _cubic(mid) else (lo, mid)
            alpha = lo
        low = min(_cubic(alpha * low), _cubic(alpha))
        alphas.append(alpha)
    return tuple(alphas)


_ROUND = {dtype: _round_alphas(ROUND_FLOOR, 4 * torch.finfo(dtype).eps) for dtype in (torch.float64, torch.float32)}


def direction_round_length(dtype: torch.dtype) -> int:
    """Iterations in one round of :func:`muon_direction`'s msign iteration (14 in float64, 13 in float32): the
    certificate is checked after each round."""
    return len(_ROUND[_linalg.compute_dtype(dtype)])


def certified_direction_steps(tol: float, dtype: torch.dtype, size: int) -> int:
    r"""The iteration count that suffices, for every input, for the certificate of an msign iteration on a
    ``size x size`` skew matrix to meet ``tol`` (exact arithmetic): whole rounds, at most 8.

    After :math:`j` rounds every singular value :math:`\sigma \ge s\,\ell^j` (:math:`s \ge \sigma_{\max}` the scale,
    :math:`\ell` = :data:`ROUND_FLOOR`) has :math:`g = \sigma_{\text{iterate}} \ge 1 - \varepsilon` (one round maps
    :math:`[\ell, 1]` into :math:`[1 - \varepsilon, 1]`, and each step is concave and increasing below
    :math:`1/\alpha`, so values below :math:`\ell` grow by at least :math:`(1 - \varepsilon)/\ell` per round). With
    :math:`k` = ``size`` and :math:`T = \|C\|_*`, the bound of :func:`muon_direction` is then at most
    :math:`T[(8/3)\varepsilon + 0.52\,k\,\ell^j + 1.54\sqrt{(k + 2\varepsilon k)(k\ell^{2j} + 4\varepsilon^2)}]
    \le T[(2.7 + 3.1\sqrt k)\,\varepsilon + 2.1\,k\,\ell^j]` (unresolved values: :math:`g(1 - g^2) \le 0.385`,
    :math:`1 - g^2 \le 1`, at most :math:`k` of them, each :math:`\le s\ell^j \le T\ell^j`), and the count is the
    smallest :math:`j` that makes this at most ``tol / 2`` (the other half is left to rounding and, for
    :math:`d > 2r`, the whitening residual). ``tests/test_muon.py`` checks it on spectra with values at every
    scale down to zero.
    """
    ct = _linalg.compute_dtype(dtype)
    eps = 4 * torch.finfo(ct).eps
    room = 0.5 * tol - (2.7 + 3.1 * math.sqrt(size)) * eps
    rounds = 1
    while rounds < 8 and (room <= 0 or 2.1 * size * ROUND_FLOOR ** rounds > room):
        rounds += 1
    return rounds * len(_ROUND[ct])


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(dim=(-2, -1), keepdim=True)


def _trace(a: torch.Tensor) -> torch.Tensor:
    return a.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]


def _msign_gap_bound(c: torch.Tensor, x: torch.Tensor, s: torch.Tensor, xs: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(<C, X>, bound)`` with :math:`\|C\|_* - \langle C, X\rangle \le` ``bound``, for an iterate :math:`X` of the
    msign iteration of :math:`C` (same singular vectors, values :math:`g_i \in [0, 1]`), :math:`S = X^\top X`,
    ``xs`` :math:`= XS`. Writing :math:`\sigma_i` for the singular values of :math:`C`:

    - where :math:`g \ge 1/2`: :math:`\sigma(1 - g) \le \tfrac43 \sigma g (1 - g^2)`, and :math:`\sum \sigma g(1 - g^2)
      = \langle C, X\rangle - \langle C, XS\rangle`;
    - where :math:`g < 1/2`: at most :math:`n = \tfrac43 \sum (1 - g^2) = \tfrac43(k - \operatorname{tr} S)` values,
      with :math:`\sum \sigma^2 \le \tfrac{16}9 \sum \sigma^2 (1 - g^2)^2 = \tfrac{16}9 \|C(I - S)\|_F^2`, so their
      :math:`\sum \sigma(1 - g) \le \sqrt{n \sum \sigma^2}` (Cauchy–Schwarz).

    A zero singular value (skew matrices of odd order, rank-deficient momenta) adds nothing to the second sum: it
    costs nothing however long it stays unresolved.
    """
    k = c.shape[-1]
    t1 = _dot(c, x)
    resolved = (t1 - _dot(c, xs)).clamp_min(0.0)
    unresolved = (k - _trace(s)).clamp_min(0.0)
    residual = (c - torch.bmm(c, s)).square().sum(dim=(-2, -1), keepdim=True)
    return t1, (4.0 / 3.0) * resolved + torch.sqrt((64.0 / 27.0) * unresolved * residual)


def _msign_skew(c: torch.Tensor, *, tol: float, extra: torch.Tensor | None, max_steps: int, synchronize: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    r"""msign of a stack of skew matrices ``c`` ``(n, k, k)`` by rounds of the scaled cubic iteration
    :math:`X \leftarrow \tfrac32\alpha X - \tfrac12\alpha^3 X X^\top X` from :math:`X_0 = C/s`,
    :math:`s = \|C^\top C\|_F^{1/2} \ge \sigma_{\max}`, stopping each frame once
    ``bound + extra <= tol * (<C, X> + bound + extra)`` (checked after each round and at ``max_steps``; a frame
    that meets it stops changing). Returns the skew part of the iterate, ``<C, X>``, the bound, the mask of
    frames that met it and the number of iterations run."""
    alphas = _ROUND[c.dtype]
    gram = torch.bmm(c.mT, c)
    scale2 = torch.linalg.matrix_norm(gram).clamp_min(torch.finfo(c.dtype).tiny)[:, None, None]
    x, s = c / scale2.sqrt(), gram / scale2
    extra = torch.zeros_like(scale2) if extra is None else extra
    done = torch.zeros_like(scale2, dtype=torch.bool)
    steps = 0
    while True:
        for alpha in alphas[: max_steps - steps]:
            stepped = (1.5 * alpha) * x - (0.5 * alpha ** 3) * torch.bmm(x, s)
            x = torch.where(done, x, stepped)
            s = torch.where(done, s, torch.bmm(x.mT, x))
            steps += 1
        t1, bound = _msign_gap_bound(c, x, s, torch.bmm(x, s))
        done = done | (bound + extra <= tol * (t1 + bound + extra))
        if steps >= max_steps or (synchronize and bool(done.all())):
            return 0.5 * (x - x.mT), t1, bound, done, steps


def _whiten(n: torch.Tensor, *, shift: float, rounds: int) -> torch.Tensor:
    r""":math:`H \approx (N + \delta I)^{-1/2}` of a stack of PSD ``r x r`` matrices, :math:`\delta` = ``shift``
    :math:`\cdot\|N\|_F`, by the coupled form of the same scaled cubic iteration (:math:`Z \to (N/c)^{-1/2}`,
    :math:`Y = (N/c) Z`, :math:`T = \alpha(3I - \alpha^2 Z Y)/2`, :math:`Y \leftarrow YT`, :math:`Z \leftarrow TZ`),
    ``rounds`` rounds: every eigenvalue of :math:`N + \delta I` is at least :math:`\delta`, so they suffice to
    resolve all of them. The shift keeps rounding of the Gram matrix (negative eigenvalues, which the iteration
    would amplify) out of the result; the caller polishes what it leaves."""
    r = n.shape[-1]
    eye = torch.eye(r, dtype=n.dtype, device=n.device)
    norm = torch.linalg.matrix_norm(n).clamp_min(torch.finfo(n.dtype).tiny)[:, None, None]
    c = norm * (1.0 + shift)
    y = (n + (shift * norm) * eye) / c
    z = eye.expand_as(n)
    for _ in range(rounds):
        for alpha in _ROUND[n.dtype]:
            t = torch.baddbmm(eye, z, y, beta=1.5 * alpha, alpha=-0.5 * alpha ** 3)
            y, z = torch.bmm(y, t), torch.bmm(t, z)
    return _linalg.sym(z) / c.sqrt()


class DirectionSolve(NamedTuple):
    """What :func:`muon_direction` returns (each tensor per frame, ``(n, 1, 1)`` unless stated).

    Attributes
    ----------
    direction : torch.Tensor
        :math:`A`, ``(n, d, r)``: tangent, :math:`\\|A\\|_2 \\le 1` (to rounding).
    gap : torch.Tensor
        The certified duality gap :math:`U - \\langle M, A\\rangle \\ge \\mathrm{OPT} - \\langle M, A\\rangle`.
    bound : torch.Tensor
        :math:`U`, an upper bound on :math:`\\mathrm{OPT} = \\max\\langle M, A\\rangle`.
    certified : torch.Tensor
        Boolean: ``gap <= tol * bound``.
    steps : int
        Iterations of the msign iteration run (the most any frame of the batch needed, or the cap).
    """

    direction: torch.Tensor
    gap: torch.Tensor
    bound: torch.Tensor
    certified: torch.Tensor
    steps: int


#: Relative shift of the first whitening pass's Gram matrix, per column, in units of the dtype's machine epsilon.
_WHITEN_SHIFT = 4.0


def muon_direction(m: torch.Tensor, w: torch.Tensor, *, tol: float | None = None, max_steps: int | None = None,
                   synchronize: bool = True) -> DirectionSolve:
    r"""The steepest tangent direction under the spectral norm, fast: :math:`A = \operatorname{msign}(X) W` by
    matrix products only, batched over frames, stopped per frame on a certified duality gap.

    With :math:`P = W^\top M`, :math:`K = P - P^\top` and :math:`M_\perp = M - W P` (the normal part), the skew
    matrix :math:`X = MW^\top - WM^\top = W K W^\top + M_\perp W^\top - W M_\perp^\top` lives in the span of
    :math:`[W, M_\perp]`, so its msign is taken on a ``k x k`` skew matrix :math:`C`:

    - :math:`d \le 2r` (square and near-square frames): :math:`C = X` itself (``k = d``), :math:`A = \Omega W`;
    - :math:`d > 2r`: :math:`M_\perp` is whitened, :math:`Q \approx M_\perp (M_\perp^\top M_\perp)^{-1/2}`, in two
      passes of an ``r x r`` Newton–Schulz on a Gram matrix (:math:`M_\perp^\top M_\perp + \delta_1 I`, then
      :math:`Q^\top Q + \delta_2 I` of the result, which recovers what the first pass's rounding and shift
      :math:`\delta_1 = 4r\epsilon\|M_\perp^\top M_\perp\|_F` cut off; :math:`\delta_2 = \sqrt\epsilon\,\|Q^\top
      Q\|_F`), :math:`Q` made orthogonal to :math:`W`, then one direct step :math:`Q \leftarrow Q(3I - Q^\top Q)/2`
      on the ``d x r`` matrix itself, which maps every singular value of :math:`[0, \sqrt3]` into :math:`[0, 1]`
      whatever rounding did to the Gram matrices; :math:`R = Q^\top M_\perp`,
      :math:`C = \left[\begin{smallmatrix} K & -R^\top \\ R & 0\end{smallmatrix}\right]` (``k = 2r``) and
      :math:`A = W\Omega_{11} + Q\Omega_{21}` (that is :math:`V\Omega V^\top W`, :math:`V = [W, Q]`,
      :math:`\|V\|_2 \le 1`, so :math:`A` is feasible).

    :math:`\Omega \approx \operatorname{msign}(C)` comes from rounds of the scaled cubic iteration (each step maps
    singular values of :math:`[0, 1]` into :math:`[0, 1]`, so :math:`\|\Omega\|_2 \le 1` and :math:`\Omega` stays
    skew). After each round the certificate is checked per frame: with :math:`E = M_\perp - QR` (zero for
    :math:`d \le 2r`), :math:`X = VCV^\top + EW^\top - WE^\top` gives

    .. math::

        \mathrm{OPT} = \tfrac12\|X\|_* \le U = \tfrac12\big(\langle C, \Omega\rangle + b\big) + \sqrt r\,\|E\|_F,

    where :math:`b \ge \|C\|_* - \langle C, \Omega\rangle` is computed from :math:`\Omega` (Cauchy–Schwarz on the
    unresolved singular values; exact zeros cost nothing), and the frame stops once
    :math:`(U - \langle M, A\rangle) \le` ``tol`` :math:`\cdot U`. One round is
    :func:`direction_round_length` iterations of two ``k x k`` products; a frame whose singular values span less
    than four decades needs one round.

    Parameters
    ----------
    m, w : torch.Tensor
        Momenta and frames ``(n, d, r)`` (a 3-d stack), one dtype (float32 or float64), :math:`W^\top W = I`.
    tol : float, optional
        Relative duality-gap tolerance; default :data:`DEFAULT_DIRECTION_TOL` of the dtype.
    max_steps : int, optional
        Cap on the iterations; default :func:`certified_direction_steps` (enough for every input in exact
        arithmetic). Frames not certified within it come back with ``certified`` False.
    synchronize : bool, default True
        Stop early once every frame is certified (one host read per round). ``False`` (CUDA graphs,
        ``torch.compile``): always run ``max_steps`` iterations, no host read.

    Returns
    -------
    DirectionSolve
        ``(direction, gap, bound, certified, steps)``.

    Raises
    ------
    ValueError
        For stacks that are not 3-d, of different shapes or dtypes, or not float32/float64.

    Notes
    -----
    What a dtype cannot resolve (:math:`d > 2r`): the whitening works on Gram matrices, so singular values of
    :math:`M_\perp` around :math:`\epsilon^{1/2}` to :math:`\epsilon^{1/4}` of the largest are not fully
    whitened, and the rounding of :math:`M_\perp = M - WP` itself leaves singular values near
    :math:`\sqrt d\,\epsilon\,\sigma_{\max}` in the directions a rank-deficient momentum does not span; both stay in
    :math:`E` and show in the certificate, not in the direction's feasibility. Measured worst certified relative
    gaps, float32: 4e-7 Gaussian, 1e-6 :math:`1/i` spectra, 4e-5 rank one (128 x 32; about
    :math:`r\sqrt d\,\epsilon` in general), 2e-5 one singular value above a flat rest at :math:`10^{-3}` of it,
    3e-4 with the rest at :math:`10^{-5}`; float64: below 2e-8 for all of these. The frames must be orthonormal
    (:math:`W^\top W = I` to the dtype's rounding): the optimizer makes its float32 copy of a bfloat16 frame so
    before the solve.
    """
    if m.dtype not in DEFAULT_DIRECTION_TOL or w.dtype != m.dtype or m.dim() != 3 or m.shape != w.shape:
        raise ValueError(f"muon_direction: m and w must be (n, d, r) stacks of one shape and dtype, float32 or float64 "
                         f"(got {tuple(m.shape)} {m.dtype} and {tuple(w.shape)} {w.dtype}); cast bfloat16/float16 "
                         f"stacks to float32, as StiefelMuon does.")
    n, d, r = m.shape
    ct = m.dtype
    tol = DEFAULT_DIRECTION_TOL[ct] if tol is None else tol
    k = d if d <= 2 * r else 2 * r
    cap = certified_direction_steps(tol, ct, k) if max_steps is None else max_steps
    if d <= 2 * r:
        x = torch.bmm(m, w.mT)
        omega, t1, bound, _, steps = _msign_skew(x - x.mT, tol=tol, extra=None, max_steps=cap,
                                                 synchronize=synchronize)
        direction = torch.bmm(omega, w)
        upper = 0.5 * (t1 + bound)
    else:
        eps = torch.finfo(ct).eps
        wtm = torch.bmm(w.mT, m)
        normal = m - torch.bmm(w, wtm)
        q = normal
        for shift in (_WHITEN_SHIFT * r * eps, math.sqrt(eps)):  # the Gram matrix of M_perp, then that of Q
            rounds = math.ceil(0.5 * math.log(1.0 / shift) / math.log(1.0 / ROUND_FLOOR))
            q = torch.bmm(q, _whiten(_linalg.sym(torch.bmm(q.mT, q)), shift=shift, rounds=rounds))
        q = q - torch.bmm(w, torch.bmm(w.mT, q))
        q = 1.5 * q - 0.5 * torch.bmm(q, torch.bmm(q.mT, q))
        rt = torch.bmm(q.mT, normal)
        residual = math.sqrt(r) * torch.linalg.matrix_norm(normal - torch.bmm(q, rt))[:, None, None]
        c = torch.cat([torch.cat([wtm - wtm.mT, -rt.mT], -1), torch.cat([rt, torch.zeros_like(rt)], -1)], -2)
        omega, t1, bound, _, steps = _msign_skew(c, tol=tol, extra=2.0 * residual, max_steps=cap,
                                                 synchronize=synchronize)
        direction = torch.bmm(w, omega[:, :r, :r]) + torch.bmm(q, omega[:, r:, :r])
        upper = 0.5 * (t1 + bound) + residual
    gap = (upper - _dot(m, direction)).clamp_min(0.0)
    return DirectionSolve(direction, gap, upper, gap <= tol * upper, steps)


def _msign_svd(z: torch.Tensor) -> torch.Tensor:
    """msign by the full SVD, with singular values at most ``size * eps`` times the largest treated as zero (a
    skew matrix of odd order has an exact zero, which rounding turns into a tiny one)."""
    u, s, vh = torch.linalg.svd(z)
    keep = (s > s[..., :1] * (z.shape[-1] * torch.finfo(z.dtype).eps)).to(z.dtype)
    return (u * keep.unsqueeze(-2)) @ vh


def muon_direction_reference(m: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The steepest tangent direction under the spectral norm, readable: :math:`A^\star = \operatorname{msign}(X) W`
    with :math:`X = M W^\top - W M^\top`, msign by the SVD of the ``d x d`` matrix (see the module notes for why this
    is the optimum).

    Parameters
    ----------
    m, w : torch.Tensor
        Momenta and frames, ``(..., d, r)``, one dtype (float64 for checks).

    Returns
    -------
    direction, optimum : torch.Tensor
        :math:`A^\star`, ``(..., d, r)``, and :math:`\max\langle M, A\rangle = \tfrac12\|X\|_*`, ``(..., 1, 1)``.
    """
    x = m @ w.transpose(-1, -2)
    x = x - x.transpose(-1, -2)
    optimum = 0.5 * torch.linalg.svdvals(x).sum(-1)[..., None, None]
    return _msign_svd(x) @ w, optimum


def stiefel_muon_update(
    w: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    momentum: float,
    nesterov: bool,
    adjust_lr_fn: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""One StiefelMuon update of a stack of frames, readable (the specification); pure.

    For each frame :math:`W` with Euclidean gradient :math:`G` (with ``adjust_lr_fn=None``, ``lr`` already
    multiplied by :func:`muon_lr_scale`):

    1. :math:`\xi = G - W\operatorname{sym}(W^\top G)`
    2. :math:`B \leftarrow \mu B + (1 - \mu)\xi` (torch's ``Muon``: ``buf.lerp_(grad, 1 - momentum)``)
    3. :math:`U = (1 - \mu)\xi + \mu B` with ``nesterov`` (``grad.lerp(buf, momentum)``), else :math:`U = B`
    4. :math:`A = \operatorname{msign}(UW^\top - WU^\top)\,W` (:func:`muon_direction_reference`, the exact optimum)
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
    adjust_lr_fn : {"original", "match_rms_adamw"} or None, default None
        A group's rule, as in :class:`StiefelMuon`: ``lr`` is then read by it (:math:`\eta = \mathrm{lr}\cdot
        s(d, r)`), so a group's own ``lr`` and ``adjust_lr_fn`` give the optimizer's step.

    Raises
    ------
    ValueError
        For a value :class:`StiefelMuon` refuses (``momentum``, ``nesterov``, ``adjust_lr_fn``), in its words.

    Returns
    -------
    w_new, buffer_new, finite : torch.Tensor
        The new frames and momentum (unchanged where the frame did not move), and the mask of frames whose
        gradient is finite, of shape ``(..., 1, 1)``.
    """
    _check_reference_options(momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    if adjust_lr_fn is not None:
        lr = lr * muon_lr_scale(adjust_lr_fn, *w.shape[-2:])
    xi = _linalg.proju(w, grad)
    finite = _linalg.frame_sq_norm(xi) < math.inf
    xi = torch.where(finite, xi, torch.zeros((), dtype=xi.dtype, device=xi.device))
    buf = torch.where(finite, momentum * momentum_buffer + (1.0 - momentum) * xi, momentum_buffer)
    u = (1.0 - momentum) * xi + momentum * buf if nesterov else buf
    direction, _ = muon_direction_reference(u, w)
    moving = finite & (lr * _linalg.frame_norm(direction) > 0)
    w_new = _linalg.polar_svd(w - lr * direction)
    buf_new = _linalg.proju(w_new, buf)
    return torch.where(moving, w_new, w), torch.where(moving, buf_new, buf), finite


def _check_reference_options(*, momentum: float, nesterov: bool, adjust_lr_fn: str | None) -> None:
    """Refuse what :class:`StiefelMuon` refuses, with its checks."""
    from . import _validation

    table = {option.name: option for option in _validation.SHARED_OPTIONS + _validation.MUON_OPTIONS}
    options = (table["momentum"], table["nesterov"], table["adjust_lr_fn"])
    given = {"momentum": momentum, "nesterov": nesterov}
    if adjust_lr_fn is not None:
        given["adjust_lr_fn"] = adjust_lr_fn
    _validation.check_group(given, "stiefel_muon_update", options)
