r"""Proposition 5: weight decay has identically zero Riemannian gradient on St(d, r).

The Euclidean gradient of :math:`\tfrac{\lambda}{2}\|W\|_F^2` is :math:`\lambda W = W(\lambda I_r)`, a point
of the normal space :math:`\{WS : S = S^\top\}`, so
:math:`P_W(\lambda W) = \lambda(W - W\operatorname{sym}(W^\top W)) = 0` on the manifold. The three ways a
user can apply decay differ:

(a) *coupled* (:math:`G \leftarrow G + \lambda W` before the projection): no effect at all;
(b) *decoupled on the retracted point*, :math:`W \leftarrow \operatorname{polar}((1-\eta\lambda)W)`: no effect,
    since the polar factor is invariant under positive scaling;
(c) *decoupled inside the retraction*, :math:`\operatorname{polar}((1-\eta\lambda)W - s)
    = \operatorname{polar}(W - s/(1-\eta\lambda))`: the step is silently enlarged by
    :math:`1/(1-\eta\lambda)`. ``StiefelAdam`` never does this: its ``weight_decay`` leaves frames alone.
"""

from __future__ import annotations

import torch

from .._docfrag import fill
from ._numerics import QuadraticLoss, polar_factor, random_frames, recover_polar_step, run_trajectory
from ._result import Certificate, require_steps, worst_figure
from .gauge import AttentionProblem, multihead_attention
from .optimizers import OptimizerColumn

__all__ = [
    "DECAY_GRADIENT_TOL",
    "DECAY_TRAJECTORY_TOL",
    "certify_decay_gradient",
    "certify_coupled_decay",
    "certify_point_decay",
    "certify_decay_in_retraction",
    "certify_decay_training",
]

#: Largest ||P_W(W)||_F / ||W||_F accepted (float64).
DECAY_GRADIENT_TOL = 1e-13
#: Largest max-abs difference between frames trained with and without decay (float64).
DECAY_TRAJECTORY_TOL = 1e-12

_DECAY_SHAPES = ((1, 1), (4, 1), (4, 4), (8, 3), (16, 4), (32, 8), (64, 16), (128, 32), (256, 64))


@fill
def certify_decay_gradient(column: OptimizerColumn, *, seed: int = 0, stack: int = 3) -> Certificate:
    r"""5. :math:`\mathrm{rgrad}(W, W) = 0` to rounding for random frames of many shapes.

    Measured: :math:`\max \|\mathrm{rgrad}(W, W)\|_F/\|W\|_F` over ``stack`` frames of each shape from
    St(1, 1) to St(256, 64), with the column's ``egrad2rgrad``.

    Parameters
    ----------
    {{column_seed}}
    stack : int, default 3
        Frames drawn per shape.

    {{returns_certificate}}
    """
    name = "5  rgrad of decay = 0"
    statement = "the Riemannian gradient of (lambda/2)||W||^2, rgrad(W, lambda W), is 0 to rounding on St(d, r)"
    if not column.on_manifold:
        return Certificate.not_applicable(name, statement, "unconstrained matrix: the decay gradient is lambda W",
                                          optimizer=column.name)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for d, r in _DECAY_SHAPES:
        w = random_frames(stack, d, r, generator=gen)
        rg = column.rgrad(w, w.clone())
        worst = worst_figure([worst, float((rg.norm(dim=(-2, -1)) / w.norm(dim=(-2, -1))).max())])
    return Certificate.check(name, statement, worst, DECAY_GRADIENT_TOL, optimizer=column.name,
                             details={"shapes": [list(s) for s in _DECAY_SHAPES], "stack": stack})


def _setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return QuadraticLoss.random(4, 16, 4, generator=gen), random_frames(4, 16, 4, generator=gen)


@fill
def certify_coupled_decay(column: OptimizerColumn, *, seed: int = 0, steps: int = 50, lr: float = 0.05,
                          decay: float = 1.0) -> Certificate:
    r"""5a. Coupled decay, :math:`G_t + \lambda W_t` as the gradient, leaves the trajectory unchanged.

    Measured: :math:`\max_t\max|W^{(\lambda)}_t - W^{(0)}_t|` over ``steps`` steps (:math:`\lambda = 1`).
    For an unconstrained matrix, coupled decay is an ordinary L2 penalty and changes the trajectory.

    Parameters
    ----------
    {{decay_run}}

    {{returns_certificate}}
    """
    name = "5a coupled decay: no effect"
    statement = "coupled weight decay (lambda W added to G before projection, lambda = 1) leaves the trajectory unchanged"
    require_steps("certify_coupled_decay", steps)
    loss, w0 = _setup(seed)
    base = run_trajectory(column, w0, lambda w, t: loss.grad(w), steps, lr=lr)
    coupled = run_trajectory(column, w0, lambda w, t: loss.grad(w) + decay * w, steps, lr=lr)
    measured = float((coupled - base).abs().max())
    return Certificate.check(name, statement, measured, DECAY_TRAJECTORY_TOL, optimizer=column.name,
                             details={"steps": steps, "lr": lr, "lambda": decay})


@fill
def certify_point_decay(column: OptimizerColumn, *, seed: int = 0, steps: int = 50, lr: float = 0.05,
                        decay: float = 1.0, project=polar_factor) -> Certificate:
    r"""5b. Decoupled decay of the retracted point, :math:`W \leftarrow \operatorname{polar}((1-\eta\lambda)W)`, has no effect.

    After every optimizer step the frame is replaced by the SVD polar factor of :math:`(1-\eta\lambda)W`
    (``project`` replaces the polar factor; the tests pass the identity to show the certificate can fail);
    measured: max-abs difference from the run without it.

    Parameters
    ----------
    {{decay_run}}
    project : callable, default polar_factor
        Maps the decayed point back to the manifold.

    {{returns_certificate}}
    """
    name = "5b decay of retracted point: no effect"
    statement = "decoupled decay on the retracted point, W <- polar((1 - lr lambda) W) after each step, changes nothing"
    require_steps("certify_point_decay", steps)
    if not column.on_manifold:
        return Certificate.not_applicable(name, statement, "unconstrained matrix: there is no retracted point; "
                                          "AdamW's own decoupled decay shrinks W (see 5d)", optimizer=column.name)
    loss, w0 = _setup(seed)
    factor = 1.0 - lr * decay

    def decay_point(p, t):
        p.copy_(project(factor * p.detach()).to(p.dtype))

    base = run_trajectory(column, w0, lambda w, t: loss.grad(w), steps, lr=lr)
    decayed = run_trajectory(column, w0, lambda w, t: loss.grad(w), steps, lr=lr, after_step=decay_point)
    measured = float((decayed - base).abs().max())
    return Certificate.check(name, statement, measured, DECAY_TRAJECTORY_TOL, optimizer=column.name,
                             details={"steps": steps, "lr": lr, "lambda": decay, "factor": factor})


@fill
def certify_decay_in_retraction(column: OptimizerColumn, *, seed: int = 0, lr: float = 0.05,
                                decay: float = 1.0) -> Certificate:
    r"""5c. The optimizer's ``weight_decay`` does not enlarge the frame step (no decay inside the retraction).

    First, the identity :math:`\operatorname{polar}(cW - s) = \operatorname{polar}(W - s/c)`,
    :math:`c = 1 - \eta\lambda`, is measured at a random frame and tangent step (details:
    ``identity_residual``, and the enlargement ``1/c`` it implies). Then one step of the column's optimizer
    from a fresh state with ``weight_decay = lambda`` and one with ``weight_decay = 0`` are compared through
    their recovered tangent steps: measured :math:`|\,\|s^{(\lambda)}\|/\|s^{(0)}\| - 1|` (0 when decay does
    not touch the frame step, :math:`\eta\lambda/(1-\eta\lambda)` when it is applied inside the retraction).

    Parameters
    ----------
    {{column_seed}}
    {{lr_eta}}
    {{decay_lambda}}

    {{returns_certificate}}
    """
    name = "5c decay never enlarges the step"
    statement = ("polar((1 - lr lambda) W - s) = polar(W - s/(1 - lr lambda)) enlarges the step by 1/(1 - lr lambda); "
                 "the optimizer's weight_decay option leaves the frame step unchanged")
    if not column.on_manifold:
        return Certificate.not_applicable(name, statement, "unconstrained matrix: no retraction; AdamW's "
                                          "decoupled decay shrinks W itself (see 5d)", optimizer=column.name)
    gen = torch.Generator().manual_seed(seed)
    w0 = random_frames(3, 16, 4, generator=gen)
    g = torch.randn(3, 16, 4, dtype=torch.float64, generator=gen)
    c = 1.0 - lr * decay
    # the identity, on an explicit tangent step
    s = lr * (g - w0 @ (0.5 * (w0.transpose(-1, -2) @ g + g.transpose(-1, -2) @ w0)))
    lhs, rhs = polar_factor(c * w0 - s), polar_factor(w0 - s / c)
    residual = float((lhs - rhs).abs().max())
    enlarged, _ = recover_polar_step(w0, lhs)
    plain, _ = recover_polar_step(w0, polar_factor(w0 - s))
    implied = float(enlarged.norm() / plain.norm())

    def first_step(wd):
        p = column.make_parameter(w0)
        opt = column.make_optimizer([p], lr=lr, weight_decay=wd)
        p.grad = g.clone()
        opt.step()
        return recover_polar_step(w0, p.detach())[0]

    ratio = float(first_step(decay).norm() / first_step(0.0).norm())
    details = {"lr": lr, "lambda": decay, "identity_residual": residual,
               "enlargement_if_decayed_inside_retraction": implied, "expected_enlargement": 1.0 / c,
               "step_ratio_with_weight_decay": ratio}
    return Certificate.check(name, statement, abs(ratio - 1.0), DECAY_TRAJECTORY_TOL, optimizer=column.name,
                             details=details)


@fill
def certify_decay_training(column: OptimizerColumn, *, seed: int = 0, steps: int = 100, lr: float = 0.01,
                           decay: float = 1.0) -> Certificate:
    r"""5d. In a training run, ``weight_decay = 1`` on the query/key group leaves the frames as with 0.

    Model: float64 multi-head attention (:func:`~.gauge.multihead_attention`, 2 heads, embed 8, head width
    4) regressing a random teacher's output; ``w_q``, ``w_k`` are frames on the column's manifold (plain
    matrices for an unconstrained column) in a group with ``weight_decay = lambda``; ``w_v``, ``w_o`` are
    Euclidean in a group with ``weight_decay = 0`` in both runs. Measured: max-abs difference of
    ``w_q``, ``w_k`` between the runs with :math:`\lambda = 1` and :math:`\lambda = 0`, over every step.
    The details give :math:`\|W_Q\|_F` at the start and the end of both runs (an unconstrained ``W_Q``
    under AdamW shrinks).

    Parameters
    ----------
    {{column_seed}}
    steps : int, default 100
        Steps of each run.
    lr : float, default 0.01
        Learning rate.
    {{decay_lambda}}

    {{returns_certificate}}
    """
    name = "5d training: frames ignore decay"
    statement = ("a training run with weight_decay = 1 on W_Q, W_K leaves them identical to the run with 0 "
                 "(a Euclidean W_Q under AdamW shrinks instead)")
    require_steps("certify_decay_training", steps)
    prob = AttentionProblem(seed=seed, frames=True)

    def train(wd):
        w_q, w_k = column.make_parameter(prob.w_q), column.make_parameter(prob.w_k)
        w_v = torch.nn.Parameter(prob.w_v.clone())
        w_o = torch.nn.Parameter(prob.w_o.clone() * 0.5)
        opt = column.make_optimizer([{"params": [w_q, w_k], "weight_decay": wd},
                                     {"params": [w_v, w_o], "weight_decay": 0.0}], lr=lr)
        history = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = (multihead_attention(prob.x, w_q, w_k, w_v, w_o) - prob.target).square().mean()
            loss.backward()
            opt.step()
            history.append(torch.cat([w_q.detach().reshape(-1), w_k.detach().reshape(-1)]).clone())
        return torch.stack(history), float(loss.detach()), float(w_q.detach().norm())

    with_decay, loss_decay, norm_decay = train(decay)
    without, loss_plain, norm_plain = train(0.0)
    measured = float((with_decay - without).abs().max())
    details = {"steps": steps, "lr": lr, "lambda": decay, "W_Q_norm_start": float(prob.w_q.norm()),
               "W_Q_norm_end_with_decay": norm_decay, "W_Q_norm_end_without_decay": norm_plain,
               "final_loss_with_decay": loss_decay, "final_loss_without_decay": loss_plain}
    return Certificate.check(name, statement, measured, DECAY_TRAJECTORY_TOL, optimizer=column.name, details=details)
