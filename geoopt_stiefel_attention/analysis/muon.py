r"""Certificates of manifold Muon (:class:`~geoopt_stiefel_attention.StiefelMuon`), beside torch's ``Muon`` on the
unconstrained matrix, StiefelAdam and geoopt's Riemannian Adam.

Every certificate treats an optimizer as a black box, a :class:`MuonColumn`: frames ``W0`` (a ``(k, d, r)`` stack)
and a list of gradients go in, the iterates come out. The direction an optimizer took in its first step is
recovered exactly from the iterates by inverting the polar retraction: if :math:`W_1 = \operatorname{polar}(W_0 + Z)`
with :math:`Z` tangent at :math:`W_0`, then :math:`W_1 S = W_0 + Z` with :math:`S = (I + Z^\top Z)^{1/2}`
symmetric, and :math:`W_0^\top Z` skew gives the Lyapunov equation
:math:`(W_0^\top W_1) S + S (W_0^\top W_1)^\top = 2I`, solved here as an :math:`r^2 \times r^2` linear system
(float64). The rows:

- ``M1 direction optimal``: the first step's direction :math:`A` (scaled by :math:`1/\eta`) attains the optimum
  of :math:`\max \langle \xi, A\rangle` over tangent :math:`A` with :math:`\|A\|_2 \le 1`, computed
  independently of the library's solver: :math:`\mathrm{OPT} = \tfrac12\|\xi W^\top - W\xi^\top\|_*` from
  numpy's SVD (an upper bound on every feasible direction's value by weak duality, attained; the proof is in
  :mod:`geoopt_stiefel_attention.optim._muon`, and ``tests/test_muon.py`` checks the value against cvxpy's
  Clarabel on drawn shapes). Measured: the relative shortfall
  :math:`1 - \langle \xi, P_W A\rangle / (\max(1, \|P_W A\|_2)\,\mathrm{OPT})`, the worst over the frames
  of :data:`DIRECTION_SHAPES` (square, near-square and :math:`r \ll d`). The direction rows M1-M3 draw these
  frames; rows M4-M8 draw ``shape``.
- ``M2 direction tangent``: :math:`\max |W^\top A + A^\top W|` of the direction the optimizer computes before
  its retraction. The step recovered from on-manifold iterates is tangent by construction (the Lyapunov equation
  above is the tangency condition), so for such a column the row reads the column's :attr:`MuonColumn.direction`
  (the library's solver on :math:`(W_0, \xi)`); a column that keeps frames on the manifold without one gets
  "not applicable" (a non-tangent direction would be absorbed by the retraction and show in M1). For a column
  off the manifold (torch's ``Muon``) it reads :math:`A = -(W_1 - W_0)/\eta`.
- ``M3 direction spectral norm <= 1``: :math:`\|A\|_2 - 1`.
- ``M4 no drift, float64`` / ``M5 no drift, float32``: :math:`\max|W^\top W - I|` after a long run; a run whose
  iterates come back in another dtype fails the row (its figure says nothing of the dtype certified).
- ``M6 O(d)xO(r)-equivariant``: started from :math:`Q W_0 R` with gradients :math:`Q G R` (random orthogonal
  :math:`Q, R`), the iterates are :math:`Q W_t R`.
- ``M7 scale-free``: gradients :math:`cG` (:math:`c = 10^{3}` and :math:`10^{-3}`) give the same iterates.
- ``M8 decay-immune``: ``weight_decay=0.5`` gives the same frames as ``0``.

Nothing here prints; :func:`run_muon_certificates` returns the :class:`~._result.Certificate` objects, which
:mod:`.table` renders like the main table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._result import Certificate, worst_figure

__all__ = ["MuonColumn", "MUON_ROWS", "MUON_OURS", "DEFAULT_MUON_STEPS", "FULL_MUON_STEPS", "DIRECTION_SHAPES",
           "muon_columns", "muon_column_by_name", "select_muon_rows", "run_muon_certificates", "inverse_polar_retraction",
           "independent_direction_optimum", "OPTIMALITY_TOL", "FEASIBILITY_TOL", "DRIFT_TOL_F64", "DRIFT_TOL_F32",
           "EQUIVARIANCE_TOL", "SCALE_TOL", "DECAY_TOL", "BASELINE_DIRECTION_TOL"]

MUON_ROWS = (
    "M1 direction optimal (independent solver)",
    "M2 direction tangent",
    "M3 direction spectral norm <= 1",
    "M4 no drift, float64",
    "M5 no drift, float32",
    "M6 O(d)xO(r)-equivariant",
    "M7 scale-free",
    "M8 decay-immune",
)

#: The columns of the library's own optimizer: ``stiefel-attention certify`` fails (exit 1) if one of their
#: cells fails.
MUON_OURS = ("StiefelMuon",)
#: Steps of the long drift runs (rows M4, M5) of ``stiefel-attention certify`` (``--muon-steps``). A step that
#: leaves the manifold fails M4 and M5 from its first step on (torch's Muon: 1.0 after 50 steps, 5.1 after 300;
#: tests/test_muon_certificates.py runs the table at this length).
DEFAULT_MUON_STEPS = 50
#: ``certify --full``: the drift runs of the full Muon table.
FULL_MUON_STEPS = 300
#: The drift runs report their progress (``run_muon_certificates``' ``detail``) every this many steps.
_DETAIL_EVERY = 25

#: Relative shortfall of StiefelMuon's direction below the independent optimum (float64: its certified gap is at
#: most ``direction_tol`` = 1e-7; measured below 1e-13 on these frames; the projected msign is 2-8 % short).
OPTIMALITY_TOL = 1e-7
#: Rows M1 and M3 for the comparison columns (the projected msign, torch's Muon): the gap the cheap direction
#: was once documented to stay below.
BASELINE_DIRECTION_TOL = 1e-3
#: ``(k, d, r)`` stacks of frames the direction rows M1-M3 draw: :math:`r \ll d`, square (even and odd order: a
#: skew matrix of odd order has a zero singular value) and near-square (:math:`r = d - 1`, :math:`d - 2`), where
#: the earlier fixed-count solver fell 4-12 % short (issue 56).
DIRECTION_SHAPES = ((3, 12, 4), (2, 12, 12), (2, 9, 9), (2, 10, 9), (2, 12, 11), (2, 12, 10))
#: ``max |W^T A + A^T W|`` and ``||A||_2 - 1`` of the recovered direction (float64).
FEASIBILITY_TOL = 1e-6
#: ``max |W^T W - I|`` after the long runs.
DRIFT_TOL_F64, DRIFT_TOL_F32 = 1e-12, 1e-5
#: Largest entry difference of the equivariance and scale comparisons (float64; a frame's solve may stop a round
#: earlier or later when its certificate sits at the tolerance, which rounding decides differently in the last bits).
EQUIVARIANCE_TOL = SCALE_TOL = 1e-8
#: Frames trained with and without weight decay (rounding of a decay gradient projected to zero may remain).
DECAY_TOL = 1e-12


@dataclass(frozen=True)
class MuonColumn:
    r"""One optimizer as a black box: ``run(w0, grads, *, weight_decay) -> iterates`` (each ``(k, d, r)``), the
    spectral size ``eta(d, r)`` of its first step (``None``: not a spectral-norm step), whether it keeps frames
    on the manifold, the tolerance of rows M1 and M3 (the accuracy its direction solver states), a short
    label for the table's header (the name when empty) and, optionally, ``direction(w, xi) -> A``: the direction
    its solver computes before the retraction, for row M2 (see the module docstring).

    Attributes
    ----------
    name : str
        Full name (the ``optimizer`` of its certificates).
    run : callable
        ``run(w0, grads, *, weight_decay) -> iterates``: from frames ``w0`` of shape ``(k, d, r)``, one step per
        gradient, the iterate after each step.
    lr : float
        The learning rate its ``run`` steps with.
    eta : callable or None
        ``eta(d, r)``, the spectral norm :math:`\eta` of its first step; ``None`` for an optimizer whose step is
        not a spectral-norm step (rows M1-M3 then do not apply).
    on_manifold : bool
        Whether its iterates are frames (the step is then read through the inverse of the polar retraction).
    description : str
        One line on what the column is.
    direction_tol : float, default 1e-5
        Tolerance of rows M1 and M3.
    label : str, default ""
        Short header for the table (the name when empty).
    direction : callable or None, default None
        ``direction(w, xi) -> A``, the direction its solver computes, for row M2.
    """

    name: str
    run: Callable[..., list[torch.Tensor]]
    lr: float
    eta: Callable[[int, int], float] | None
    on_manifold: bool
    description: str
    direction_tol: float = 1e-5
    label: str = ""
    direction: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def short(self) -> str:
        """The table header: :attr:`label`, or :attr:`name` when no label is set."""
        return self.label or self.name


def _stiefel_run(make: Callable[..., torch.optim.Optimizer]) -> Callable[..., list[torch.Tensor]]:
    def run(w0: torch.Tensor, grads: list[torch.Tensor], *, weight_decay: float = 0.0) -> list[torch.Tensor]:
        import geoopt

        from ..manifolds import PolarStiefel

        w = geoopt.ManifoldParameter(w0.detach().clone(), manifold=PolarStiefel())
        bias = torch.nn.Parameter(torch.zeros(1, dtype=w0.dtype))  # a Euclidean parameter, so decay has a target
        opt = make([w, bias], weight_decay=weight_decay)
        out = []
        for g in grads:
            w.grad, bias.grad = g.clone(), torch.ones_like(bias)
            opt.step()
            out.append(w.detach().clone())
        return out

    return run


def _torch_muon_run(lr: float) -> Callable[..., list[torch.Tensor]]:
    def run(w0: torch.Tensor, grads: list[torch.Tensor], *, weight_decay: float = 0.0) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(f.detach().clone()) for f in w0]
        opt = torch.optim.Muon(params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="original")
        out = []
        for g in grads:
            for p, gk in zip(params, g, strict=True):
                p.grad = gk.clone()
            opt.step()
            out.append(torch.stack([p.detach().clone() for p in params]))
        return out

    return run


def muon_columns(lr: float = 1e-2) -> list[MuonColumn]:
    """The columns: StiefelMuon (at its defaults), the projected msign (a baseline), torch's ``Muon`` on the
    unconstrained matrices, StiefelAdam and geoopt's RiemannianAdam.

    Parameters
    ----------
    lr : float, default 1e-2
        Learning rate of every column.

    Returns
    -------
    list of MuonColumn
        The columns, in table order.
    """
    import math

    import geoopt

    from ..optim import StiefelAdam, StiefelMuon
    from ..optim._muon import muon_direction, muon_lr_scale

    def original(d: int, r: int) -> float:
        return lr * muon_lr_scale("original", d, r)

    return [
        MuonColumn("StiefelMuon", _stiefel_run(lambda params, weight_decay: StiefelMuon(
            params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="original")), lr, original, True,
            "manifold Muon at its defaults: the direction certified to direction_tol (1e-7 in float64)",
            OPTIMALITY_TOL, direction=lambda w, xi: muon_direction(xi, w).direction),
        MuonColumn("StiefelMuon (projected msign)", _projected_msign_run(lr), lr, original, True,
                   "P_W msign(P_W G), the cheap approximate direction, polar retraction, no momentum (a baseline)",
                   BASELINE_DIRECTION_TOL, "SM msign", lambda w, xi: _projected_msign(w, xi)),
        MuonColumn("torch Muon", _torch_muon_run(lr), lr, lambda d, r: lr * math.sqrt(max(1.0, d / r)), False,
                   "torch.optim.Muon on each d x r matrix (bf16 Newton-Schulz; unconstrained)"),
        MuonColumn("StiefelAdam", _stiefel_run(lambda params, weight_decay: StiefelAdam(
            params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="original")), lr, None, True,
            "StiefelAdam (its step direction is not a spectral-norm problem: rows M1-M3 do not apply)"),
        MuonColumn("geoopt RiemannianAdam", _stiefel_run(lambda params, weight_decay: geoopt.optim.RiemannianAdam(
            params, lr=lr, weight_decay=weight_decay)), lr, None, True,
            "geoopt.optim.RiemannianAdam on PolarStiefel (rows M1-M3 do not apply)", label="geoopt-radam-polar"),
    ]


def _projected_msign(w: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    r""":math:`P_W \operatorname{msign}(P_W \xi)` by the SVD: the cheap direction that is not the optimum."""
    from .. import _linalg

    u, _, vh = torch.linalg.svd(_linalg.proju(w, xi), full_matrices=False)
    return _linalg.proju(w, u @ vh)


def _projected_msign_run(lr: float) -> Callable[..., list[torch.Tensor]]:
    r"""Steps :math:`W \leftarrow \operatorname{polar}(W - \eta P_W\operatorname{msign}(P_W G))` with
    :math:`\eta = \mathrm{lr}\sqrt{d/r}` (a baseline for row M1; weight decay ignored, frames have none)."""
    def run(w0: torch.Tensor, grads: list[torch.Tensor], *, weight_decay: float = 0.0) -> list[torch.Tensor]:
        from .. import _linalg
        from ..optim._muon import muon_lr_scale

        d, r = w0.shape[-2:]
        w, out = w0.clone(), []
        for g in grads:
            w = _linalg.polar_svd(w - lr * muon_lr_scale("original", d, r) * _projected_msign(w, g))
            out.append(w.clone())
        return out

    return run


def muon_column_by_name(name: str) -> MuonColumn:
    """The column of :func:`muon_columns` called ``name`` (full name or short label).

    Raises
    ------
    KeyError
        For a name that is neither (the message lists the names).
    """
    for column in muon_columns():
        if name in (column.name, column.short):
            return column
    raise KeyError(f"No Muon-table column named {name!r}; choose one of {[c.name for c in muon_columns()]}.")


def select_muon_rows(tokens: Sequence[str]) -> tuple[str, ...]:
    """The rows of :data:`MUON_ROWS` that ``tokens`` name, in table order: ``"M"`` (every row) or a row's label
    (``"M4"``); other tokens are ignored (they name rows of the main table)."""
    labels = {row.split()[0]: row for row in MUON_ROWS}
    chosen = {row for token in tokens for label, row in labels.items() if token in ("M", label)}
    return tuple(row for row in MUON_ROWS if row in chosen)


# ---------------------------------------------------------------------------------------------- the maths
def inverse_polar_retraction(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    r"""The tangent :math:`Z` at :math:`W_0` with :math:`\operatorname{polar}(W_0 + Z) = W_1` (float64, per frame):
    :math:`Z = W_1 S - W_0` with :math:`S` symmetric solving :math:`B S + S B^\top = 2I`, :math:`B = W_0^\top W_1`."""
    w0, w1 = w0.double(), w1.double()
    r = w0.shape[-1]
    eye = torch.eye(r, dtype=torch.float64)
    out = []
    for a, b in zip(w0.reshape(-1, *w0.shape[-2:]), w1.reshape(-1, *w1.shape[-2:]), strict=True):
        bb = a.T @ b
        # vec(B S) = (I kron B) vec(S), vec(S B^T) = (B kron I) vec(S) (column-major vec)
        system = torch.kron(eye, bb) + torch.kron(bb, eye)
        s = torch.linalg.solve(system, (2 * eye).T.reshape(-1)).reshape(r, r).T
        out.append(b @ s - a)
    return torch.stack(out).reshape(w0.shape)


def independent_direction_optimum(m: np.ndarray, w: np.ndarray) -> float:
    r"""max :math:`\langle M, A\rangle` over tangent :math:`A` with :math:`\|A\|_2 \le 1` at one frame,
    independently of the library's solver: :math:`\tfrac12\|MW^\top - WM^\top\|_*` from numpy's SVD (LAPACK,
    float64). It bounds every feasible direction's value from above (a feasible :math:`A` is :math:`\Omega W`
    with :math:`\Omega` skew, :math:`\|\Omega\|_2 \le 1`, and :math:`\langle M, \Omega W\rangle =
    \tfrac12\langle MW^\top - WM^\top, \Omega\rangle`) and is attained (see :mod:`~..optim._muon`).
    An earlier version minimised the dual :math:`\min_S\|M - 2WS\|_*` with scipy's Powell method, which stalls
    5e-4 above the optimum on 10 x 9 frames (nonsmooth at its minimum there)."""
    x = m @ w.T - w @ m.T
    return float(0.5 * np.linalg.svd(x, compute_uv=False).sum())


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    return q * torch.sign(torch.diagonal(r))


# ---------------------------------------------------------------------------------------------- the suite
def run_muon_certificates(columns: Sequence[MuonColumn] | None = None, *, seed: int = 0, shape=(3, 12, 4),
                          drift_steps: int = DEFAULT_MUON_STEPS,
                          progress: Callable[[str], None] | None = None,
                          rows: Sequence[str] | None = None, threads: int | None = 1,
                          detail: Callable[[str], None] | None = None) -> list[Certificate]:
    r"""Every row of :data:`MUON_ROWS` (or only ``rows``) for every column, row-major, with ``threads`` intra-op
    threads (default 1: the matrices are tiny; ``None`` keeps the caller's count, which comes back afterwards).
    ``progress`` is called with each column's name before it is certified.

    Parameters
    ----------
    columns : sequence of MuonColumn, optional
        Default :func:`muon_columns`.
    seed : int, default 0
        Seed of the frames and gradients.
    shape : tuple of int, default (3, 12, 4)
        ``(k, d, r)``: ``k`` frames of :math:`\mathrm{St}(d, r)`, for rows M4-M8 and the first frames of rows
        M1-M3 (which add those of :data:`DIRECTION_SHAPES`).
    drift_steps : int, default DEFAULT_MUON_STEPS
        Steps of the drift runs (rows M4, M5), at least 1.
    progress : callable, optional
        Called with each column's name.
    rows : sequence of str, optional
        Only these rows of :data:`MUON_ROWS`; default every row.
    threads : int or None, default 1
        Intra-op threads during the run, as above.
    detail : callable, optional
        Called within a column's drift runs (rows M4, M5), every 25 steps and after the last, with a line saying
        how far the run is (e.g. ``"StiefelMuon: drift run (float64), 25/50 steps"``), as the column's ``run``
        takes the gradients; the CLI prints some of them as progress.

    Returns
    -------
    list of Certificate
        One per (row, column), ordered by row, then column.

    Raises
    ------
    ValueError
        For ``drift_steps < 1``, or rows that are not in :data:`MUON_ROWS` (or none).
    """
    columns = list(muon_columns() if columns is None else columns)
    if drift_steps < 1:
        raise ValueError(f"run_muon_certificates: drift_steps={drift_steps} must be >= 1.")
    unknown = [] if rows is None else [row for row in rows if row not in MUON_ROWS]
    if unknown or (rows is not None and not rows):
        raise ValueError(f"run_muon_certificates: rows {unknown or '(none)'} are not rows of MUON_ROWS.")
    wanted = MUON_ROWS if rows is None else tuple(rows)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        cells = []
        for column in columns:
            if progress is not None:
                progress(column.name)
            cells += _certify(column, seed=seed, shape=shape, drift_steps=drift_steps, rows=wanted, detail=detail)
    finally:
        torch.set_num_threads(previous)
    return sorted((c for c in cells if c.name in wanted), key=lambda c: MUON_ROWS.index(c.name))


class _Reporting(list):
    """A list of gradients that calls ``report(done, total)`` while a column's ``run`` iterates over it: every
    ``every`` items and after the last (after the step on that item, when the run asks for the next one)."""

    def __init__(self, items, report: Callable[[int, int], None], every: int = _DETAIL_EVERY):
        super().__init__(items)
        self._report, self._every = report, every

    def __iter__(self):
        total = len(self)
        for done, item in enumerate(super().__iter__(), 1):
            yield item
            if done % self._every == 0 or done == total:
                self._report(done, total)


def _direction_problems(w0: torch.Tensor, g0: torch.Tensor, seed: int):
    """``(shape, W0, G)`` for the direction rows: the table's own frames first, then those of
    :data:`DIRECTION_SHAPES` of another shape than ``w0``'s, each from a generator seeded by ``seed`` and its
    position."""
    from ..manifolds import PolarStiefel

    yield tuple(w0.shape), w0, g0
    for i, (k, d, r) in enumerate(DIRECTION_SHAPES):
        if (k, d, r) == tuple(w0.shape):
            continue
        gen = torch.Generator().manual_seed(1000 * (seed + 1) + i)
        w = PolarStiefel().random(k, d, r, dtype=torch.float64, generator=gen).as_subclass(torch.Tensor)
        yield (k, d, r), w, torch.randn(k, d, r, dtype=torch.float64, generator=gen)


def _certify_direction(column: MuonColumn, w0: torch.Tensor, g0: torch.Tensor, seed: int) -> list[Certificate]:
    """Rows M1-M3 of ``column``: the worst figure over the frames of :func:`_direction_problems`."""
    from .. import _linalg

    shortfalls, tangencies, excesses, optima = [], [], [], {}
    for shape, w, g in _direction_problems(w0, g0, seed):
        k, d, r = shape
        xi = _linalg.proju(w, g)
        w1 = column.run(w, [g])[0]
        step = inverse_polar_retraction(w, w1) if column.on_manifold else w1 - w
        a = -step / column.eta(d, r)
        tangent = _linalg.proju(w, a)
        values = (xi * tangent).sum((-2, -1)) / torch.linalg.matrix_norm(tangent, ord=2).clamp_min(1.0)
        best = [independent_direction_optimum(xi[j].numpy(), w[j].numpy()) for j in range(k)]
        optima[f"{d}x{r}"] = best
        shortfalls += [1.0 - float(values[j]) / best[j] for j in range(k)]
        if column.direction is not None or not column.on_manifold:
            used = a if column.direction is None else column.direction(w, xi)
            tangencies.append(float((w.mT @ used + used.mT @ w).abs().max()))
        excesses.append(float((torch.linalg.matrix_norm(a, ord=2) - 1.0).max()))
    shapes = ", ".join(optima)
    name, certs = column.name, []
    certs.append(Certificate.check(MUON_ROWS[0], f"the first step's direction attains the optimum of max <xi, A> over "
                                   f"tangent A with ||A||_2 <= 1 (independent: numpy SVD of xi W^T - W xi^T), on "
                                   f"frames {shapes}", worst_figure(shortfalls), column.direction_tol,
                                   optimizer=name, details={"optima": optima}))
    if tangencies:
        certs.append(Certificate.check(MUON_ROWS[1], "the direction is tangent: max |W^T A + A^T W|",
                                       worst_figure(tangencies), FEASIBILITY_TOL, optimizer=name))
    else:
        certs.append(Certificate.not_applicable(
            MUON_ROWS[1], MUON_ROWS[1], "a step recovered from iterates on the manifold is tangent by "
            "construction, and the column exposes no direction of its own", optimizer=name))
    certs.append(Certificate.check(MUON_ROWS[2], "the direction has spectral norm at most 1: ||A||_2 - 1",
                                   worst_figure(excesses), column.direction_tol, optimizer=name))
    return certs


def _certify(column: MuonColumn, *, seed: int, shape, drift_steps: int,
             rows: Sequence[str] = MUON_ROWS, detail: Callable[[str], None] | None = None) -> list[Certificate]:
    from .. import _linalg
    from ..manifolds import PolarStiefel

    k, d, r = shape
    gen = torch.Generator().manual_seed(seed)
    w0 = PolarStiefel().random(k, d, r, dtype=torch.float64, generator=gen).as_subclass(torch.Tensor)
    grads = [torch.randn(k, d, r, dtype=torch.float64, generator=gen) for _ in range(6)]
    name, certs = column.name, []

    # M1-M3: the first step's direction, on the frames of DIRECTION_SHAPES (the first draws of `gen` stay those
    # of `shape`, so rows M4-M8 see the same draws as before; the other shapes have generators of their own)
    if column.eta is None:
        for row in MUON_ROWS[:3]:
            certs.append(Certificate.not_applicable(row, row, "no spectral-norm step direction (an Adam step)",
                                                    optimizer=name))
    elif any(row in rows for row in MUON_ROWS[:3]):
        certs += _certify_direction(column, w0, grads[0], seed)
    # M4-M5: drift over a long run (the gradients are drawn whether or not the rows are wanted, so that the rows
    # after them see the same random draws in every selection)
    long_grads = [torch.randn(k, d, r, dtype=torch.float64, generator=gen) for _ in range(drift_steps)]
    for row, dtype, tol in ((MUON_ROWS[3], torch.float64, DRIFT_TOL_F64), (MUON_ROWS[4], torch.float32, DRIFT_TOL_F32)):
        if row not in rows:
            continue
        given = [g.to(dtype) for g in long_grads]
        if detail is not None:
            dname = str(dtype).replace("torch.", "")
            given = _Reporting(given, lambda done, total, dname=dname: detail(
                f"{name}: drift run ({dname}), {done}/{total} steps"))
        last = column.run(w0.to(dtype), given)[-1]
        statement = f"max |W^T W - I| after {drift_steps} steps ({dtype})"
        details = {"steps": drift_steps, "dtype_of_iterates": str(last.dtype).replace("torch.", "")}
        cert = Certificate.check(row, statement, float(_linalg.orthonormality_error(last)), tol, optimizer=name,
                                 details=details)
        if last.dtype != dtype:  # the run was not in the dtype the row certifies: its figure says nothing of it
            cert = Certificate(row, statement, cert.measured, tol, False,
                               {**details, "failure": f"the iterates came back in {last.dtype}, not {dtype}"}, name)
        certs.append(cert)

    # M6: equivariance
    q, rr = _orthogonal(d, gen), _orthogonal(r, gen)
    plain = column.run(w0, grads)
    moved = column.run(q @ w0 @ rr, [q @ g @ rr for g in grads])
    diff = worst_figure(float((q @ a @ rr - b).abs().max()) for a, b in zip(plain, moved, strict=True))
    certs.append(Certificate.check(MUON_ROWS[5], "iterates from (Q W0 R, Q G R) are Q W_t R", diff, EQUIVARIANCE_TOL,
                                   optimizer=name))
    # M7: scale
    diff = worst_figure(float((a - b).abs().max()) for c in (1e3, 1e-3)
                        for a, b in zip(plain, column.run(w0, [c * g for g in grads]), strict=True))
    certs.append(Certificate.check(MUON_ROWS[6], "gradients c G (c = 1e3, 1e-3) give the same iterates", diff,
                                   SCALE_TOL, optimizer=name))
    # M8: decay
    decayed = column.run(w0, grads, weight_decay=0.5)
    diff = worst_figure(float((a - b).abs().max()) for a, b in zip(plain, decayed, strict=True))
    certs.append(Certificate.check(MUON_ROWS[7], "weight_decay=0.5 leaves the frames as weight_decay=0", diff,
                                   DECAY_TOL, optimizer=name))
    return certs
