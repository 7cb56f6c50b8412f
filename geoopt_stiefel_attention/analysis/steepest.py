r"""Proposition 1: the update is steepest descent in the embedded metric.

For :math:`W \in \mathrm{St}(d, r)` and Euclidean gradient :math:`G`, the Riemannian gradient in the
embedded metric is the orthogonal projection :math:`\xi = G - W\operatorname{sym}(W^\top G)` onto
:math:`T_W = \{\eta : W^\top\eta + \eta^\top W = 0\}`; its complement :math:`G - \xi = W S` (``S``
symmetric) spans the normal space. For a unit tangent :math:`\eta`,
:math:`\langle G, \eta\rangle = \langle \xi, \eta\rangle \ge -\|\xi\|` with equality only at
:math:`\eta = -\xi/\|\xi\|` (Cauchy-Schwarz). With bias correction at :math:`t = 1`,
:math:`\hat m = \xi` and :math:`\hat v = \|\xi\|^2`, so the first StiefelAdam step is
:math:`\operatorname{polar}(W - \mathrm{lr}\,\xi/(\|\xi\| + \epsilon))`.
"""

from __future__ import annotations

import math

import torch

from .._docfrag import fill
from ._numerics import (
    embedded_projection,
    polar_step,
    random_frames,
    recover_polar_step,
    skew,
    sym,
    tangent_basis,
)
from ._result import Certificate, worst_figure
from .optimizers import OptimizerColumn

__all__ = [
    "PROJECTION_TOL",
    "DIRECTION_TOL",
    "FIRST_STEP_TOL",
    "RETRACTION_MIN_ORDER",
    "certify_projection",
    "certify_step_direction",
    "certify_first_step",
    "certify_retraction_order",
]

#: Relative float64 error allowed in the projection identities and the exact minimality check.
PROJECTION_TOL = 1e-12
#: Allowed ``(<G, eta> + ||xi||)/||xi||`` for the optimizer's first-step direction ``eta`` (0 = steepest).
DIRECTION_TOL = 1e-9
#: Allowed max-abs difference between the first step and the written-out normalised steepest step.
FIRST_STEP_TOL = 1e-12
#: Smallest acceptable fitted order ``p`` in ``||retr(W, t eta) - (W + t eta)|| ~ t^p`` (first order: p >= 2).
RETRACTION_MIN_ORDER = 1.9

_SHAPES = ((16, 4), (9, 3), (6, 6))


def _polar_like(column: OptimizerColumn) -> bool:
    from ..manifolds import PolarStiefel

    return isinstance(column.manifold(), PolarStiefel)


@fill
def certify_projection(column: OptimizerColumn, *, seed: int = 0, n_random: int = 4000) -> Certificate:
    r"""1a. The column's Riemannian gradient is the embedded-metric steepest-descent direction.

    At random frames (shapes St(16,4), St(9,3), St(6,6)) and Gaussian :math:`G`, with
    :math:`\xi` = the column's ``egrad2rgrad(W, G)``, the measured figure is the largest of (all relative
    to :math:`\|G\|`):

    * tangency, :math:`\|\operatorname{sym}(W^\top\xi)\|`;
    * normality of :math:`N = G - \xi`: :math:`\|(I - WW^\top)N\| + \|\operatorname{skew}(W^\top N)\|`;
    * exact minimality: :math:`\langle G, -\xi/\|\xi\|\rangle + \|c\|` where :math:`c` are the coordinates
      of :math:`G` in an orthonormal basis of :math:`T_W` built from the definition (null space of
      :math:`\eta \mapsto W^\top\eta + \eta^\top W`), so :math:`-\|c\|` is the true minimum of
      :math:`\langle G, \eta\rangle` over unit tangents;
    * the largest amount by which one of ``n_random`` random unit tangents beats :math:`-\xi/\|\xi\|`.

    Parameters
    ----------
    {{column_seed}}
    n_random : int, default 4000
        Random unit tangents compared with :math:`-\xi/\|\xi\|`.

    {{returns_certificate}}
    """
    name = "1a steepest descent: projection"
    statement = ("xi = rgrad(W, G) is tangent, G - xi = W S with S symmetric, and -xi/||xi|| minimises <G, eta> "
                 "over unit tangents (exactly, and against random unit tangents)")
    if not column.on_manifold:
        return Certificate.not_applicable(name, statement, "unconstrained matrix: no tangent space, the "
                                          "'gradient' is G itself", optimizer=column.name)
    gen = torch.Generator().manual_seed(seed)
    worst = {"tangency": 0.0, "normality": 0.0, "exact_gap": 0.0, "random_violation": 0.0}
    for d, r in _SHAPES:
        w = random_frames(d, r, generator=gen)
        g = torch.randn(d, r, dtype=torch.float64, generator=gen)
        gn = float(g.norm())
        xi = column.rgrad(w, g.clone())
        n = g - xi
        worst["tangency"] = worst_figure([worst["tangency"], float(sym(w.T @ xi).norm()) / gn])
        normal = float((n - w @ (w.T @ n)).norm() + skew(w.T @ n).norm()) / gn
        worst["normality"] = worst_figure([worst["normality"], normal])
        basis = tangent_basis(w)
        coords = (basis * g).sum(dim=(-2, -1))
        best = -float(coords.norm())
        xi_hat = xi / xi.norm()
        along = -float((g * xi_hat).sum())
        worst["exact_gap"] = worst_figure([worst["exact_gap"], abs(along - best) / gn])
        mix = torch.randn(n_random, basis.shape[0], dtype=torch.float64, generator=gen)
        mix = mix / mix.norm(dim=1, keepdim=True)
        rand_vals = mix @ coords
        violation = worst_figure([0.0, along - float(rand_vals.min())]) / gn
        worst["random_violation"] = worst_figure([worst["random_violation"], violation])
    measured = worst_figure(worst.values())
    details = {k: v for k, v in worst.items()}
    details.update(shapes=[list(s) for s in _SHAPES], n_random=n_random)
    return Certificate.check(name, statement, measured, PROJECTION_TOL, optimizer=column.name, details=details)


def _first_step(column, seed: int, **opt_kwargs):
    """One step of ``column``'s optimizer from a fresh state at a random float64 stack of frames (3, 16, 4)
    with a random gradient; returns ``(W0, G, W1)``."""
    gen = torch.Generator().manual_seed(seed)
    w0 = random_frames(3, 16, 4, generator=gen)
    g = torch.randn(3, 16, 4, dtype=torch.float64, generator=gen)
    p = column.make_parameter(w0)
    opt = column.make_optimizer([p], **opt_kwargs)
    p.grad = g.clone()
    opt.step()
    return w0, g, p.detach().clone()


@fill
def certify_step_direction(column: OptimizerColumn, *, seed: int = 0, lr: float = 1e-6) -> Certificate:
    r"""1b. The optimizer's first step from a fresh state moves along :math:`-\xi/\|\xi\|`.

    One step with a small ``lr`` on a stack of 3 frames St(16, 4); the direction of motion is read off the
    iterates as the polar-equivalent tangent step :math:`s` (:func:`recover_polar_step`), so
    :math:`\eta = -s/\|s\|`. Measured: :math:`\max_\text{frames} (\langle G, \eta\rangle + \|\xi\|)/\|\xi\|`,
    which is :math:`\ge 0` for every unit tangent and :math:`0` only for steepest descent. For an
    unconstrained matrix the direction :math:`W_1 - W_0` is compared with :math:`-G/\|G\|` instead (the
    steepest direction of the ambient space).

    Parameters
    ----------
    {{column_seed}}
    lr : float, default 1e-6
        Learning rate of the step (small, so the step is read to first order).

    {{returns_certificate}}
    """
    name = "1b steepest descent: step direction"
    statement = "the optimizer's first step from a fresh state moves along -xi/||xi|| (embedded-metric steepest descent)"
    w0, g, w1 = _first_step(column, seed, lr=lr)
    if column.on_manifold:
        s, _ = recover_polar_step(w0, w1)
        eta = -embedded_projection(w0, s)  # drop the rounding-level normal part; <G, eta> >= -||xi|| then holds exactly
        ref = embedded_projection(w0, g)
        reference = "-xi/||xi||, xi = G - W sym(W^T G)"
    else:
        eta = w1 - w0
        ref = g
        reference = "-G/||G|| (unconstrained: steepest descent of the ambient Frobenius norm)"
    eta = eta / eta.norm(dim=(-2, -1), keepdim=True)
    ref_norm = ref.norm(dim=(-2, -1))
    gaps = ((g * eta).sum(dim=(-2, -1)) + ref_norm).abs() / ref_norm
    cosine = -(ref * eta).sum(dim=(-2, -1)) / ref_norm
    details = {"reference": reference, "lr": lr, "min_cosine_with_reference": float(cosine.min())}
    return Certificate.check(name, statement, float(gaps.max()), DIRECTION_TOL, optimizer=column.name,
                             details=details)


@fill
def certify_first_step(column: OptimizerColumn, *, seed: int = 0, lr: float = 1e-2, eps: float = 1e-8) -> Certificate:
    r"""1c. The first step from a fresh state is exactly :math:`R_W(-\mathrm{lr}\,\xi/(\|\xi\| + \epsilon))`.

    With bias correction at :math:`t = 1`, :math:`\hat m = \xi` and :math:`\hat v = \|\xi\|^2` (per frame),
    so an Adam-type method with one second moment per frame steps by
    :math:`s = \mathrm{lr}\,\xi/(\|\xi\| + \epsilon)`. The reference retraction :math:`R` is the
    written-out polar formula :math:`(W - s)(I + s^\top s)^{-1/2}` for a ``PolarStiefel`` column, the
    column's own ``retr`` otherwise, and :math:`W - \mathrm{lr}\,G/(\|G\| + \epsilon)` for an unconstrained
    matrix. Measured: max-abs difference of the optimizer's first iterate from the reference (``lr`` below
    the trust region, so the cap is inactive).

    Parameters
    ----------
    {{column_seed}}
    lr : float, default 1e-2
        Learning rate of the step.
    eps : float, default 1e-8
        The optimizer's :math:`\epsilon`, used in the reference step too.

    {{returns_certificate}}
    """
    name = "1c first step = retr(W, -lr xi/||xi||)"
    statement = "the first step from a fresh state is exactly retr(W, -lr xi/(||xi|| + eps)) (frame-normalised steepest step)"
    w0, g, w1 = _first_step(column, seed, lr=lr, eps=eps)
    details = {"lr": lr, "eps": eps}
    if column.on_manifold:
        xi = embedded_projection(w0, g)
        s = lr * xi / (xi.norm(dim=(-2, -1), keepdim=True) + eps)
        if _polar_like(column):
            ref = polar_step(w0, s)
            details["reference"] = "(W - s)(I + s^T s)^(-1/2), s = lr xi/(||xi|| + eps) (written out)"
        else:
            ref = column.retr(w0, -s)
            details["reference"] = "column manifold's retr(W, -lr xi/(||xi|| + eps))"
    else:
        ref = w0 - lr * g / (g.norm(dim=(-2, -1), keepdim=True) + eps)
        details["reference"] = "W - lr G/(||G|| + eps) (unconstrained)"
    measured = float((w1 - ref).abs().max())
    details["relative_to_step"] = measured / lr
    return Certificate.check(name, statement, measured, FIRST_STEP_TOL, optimizer=column.name, details=details)


@fill
def certify_retraction_order(column: OptimizerColumn, *, seed: int = 0,
                             ts: tuple[float, ...] = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
                             retr=None) -> Certificate:
    r"""1d. The retraction agrees with :math:`W + t\eta` to first order: :math:`\|R_W(t\eta) - W - t\eta\| = O(t^2)`.

    For a random unit tangent :math:`\eta` at a random frame of St(16, 4), the errors over ``ts`` are fitted
    by :math:`\log e = p \log t + c`; measured is the order :math:`p` (2 for a retraction, 1 when the
    first-order term is wrong). ``retr`` overrides the column's retraction (used by the tests).

    Parameters
    ----------
    {{column_seed}}
    ts : tuple of float
        Step lengths :math:`t` of the fit (default :math:`10^{-5}` to :math:`10^{-1}`, two per decade).
    retr : callable, optional
        ``retr(w, u)`` in place of the column's retraction.

    {{returns_certificate}}
    """
    name = "1d retraction is first order"
    statement = "||retr(W, t eta) - (W + t eta)|| = O(t^2): the fitted order p over t in [1e-5, 1e-1] is >= 1.9"
    if not column.on_manifold and retr is None:
        return Certificate.not_applicable(name, statement, "unconstrained matrix: no retraction (W + t eta itself)",
                                          optimizer=column.name)
    retr = retr or column.retr
    gen = torch.Generator().manual_seed(seed)
    w = random_frames(16, 4, generator=gen)
    eta = embedded_projection(w, torch.randn(16, 4, dtype=torch.float64, generator=gen))
    eta = eta / eta.norm()
    errs = []
    for t in ts:
        errs.append(float((retr(w, t * eta) - (w + t * eta)).norm()))
    logs_t = torch.tensor([math.log(t) for t in ts], dtype=torch.float64)
    logs_e = torch.tensor([math.log(max(e, 1e-300)) for e in errs], dtype=torch.float64)
    design = torch.stack([logs_t, torch.ones_like(logs_t)], dim=1)
    slope = float(torch.linalg.lstsq(design, logs_e.unsqueeze(1)).solution[0, 0])
    ratios = [e / t**2 for e, t in zip(errs, ts, strict=True)]
    details = {"ts": list(ts), "errors": errs, "min_err_over_t2": min(ratios), "max_err_over_t2": max(ratios)}
    return Certificate.check(name, statement, slope, RETRACTION_MIN_ORDER, optimizer=column.name, details=details,
                             comparison=">=")
