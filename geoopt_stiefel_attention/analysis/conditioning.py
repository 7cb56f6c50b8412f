r"""Proposition 3: the polar step is well conditioned and the iterates do not drift off the manifold.

For a tangent step :math:`s` the polar retraction inverts (the square root of)
:math:`(W - s)^\top(W - s) = I + s^\top s`, whose eigenvalues are :math:`1 + \sigma_i(s)^2`, so

.. math:: \kappa(I + s^\top s) = \frac{1 + \sigma_{\max}(s)^2}{1 + \sigma_{\min}(s)^2} \le 1 + \|s\|_2^2 \le 1 + \|s\|_F^2 \le 1 + \Delta^2

once the trust region caps :math:`\|s\|_F \le \Delta`. Because the retraction forms the Gram matrix of
the actual iterate, every step also removes the rounding drift of the previous one, so
:math:`\max|W^\top W - I|` stays at rounding level without any re-projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._docfrag import fill
from ._numerics import random_frames, recover_polar_step, step_condition
from ._result import Certificate, require_steps, worst_figure
from .optimizers import OptimizerColumn

__all__ = ["CONDITION_SLACK", "DRIFT_TOL", "DriftRun", "run_drift", "certify_conditioning", "certify_drift"]

#: Relative slack on the bound 1 + Delta^2 for rounding in the recovered step (float32 iterates).
CONDITION_SLACK = {torch.float64: 1e-9, torch.float32: 1e-4}
#: "Rounding level" of max|W^T W - I| for St(16, 4): 16 r u (u = unit roundoff of the dtype). A retraction
#: that re-orthonormalises leaves an error of a few u whatever the number of steps; one that does not
#: (a Cayley rotation of the current iterate) accumulates an error growing like sqrt(steps) u.
DRIFT_TOL = {torch.float64: 16 * 4 * torch.finfo(torch.float64).eps / 2,
             torch.float32: 16 * 4 * torch.finfo(torch.float32).eps / 2}

_SHAPE = (8, 16, 4)
_CHUNK = 500


@dataclass(frozen=True)
class DriftRun:
    """Statistics of one long run on random gradients."""

    optimizer: str
    dtype: str
    steps: int
    lr: float
    trust_region: float | None
    max_condition: float  # over every step and frame of kappa(I + s^T s), s the (polar-equivalent) step
    steps_without_polar_step: int  # steps with no polar-equivalent tangent step (kappa = inf)
    max_orthonormality_error: float  # over every iterate
    final_orthonormality_error: float
    max_step_norm: float


@fill
def run_drift(column: OptimizerColumn, *, steps: int = 10_000, dtype: torch.dtype = torch.float64, seed: int = 0,
              lr: float = 1.0, trust_region: float | None = 0.1,
              progress: Callable[[int, int], None] | None = None) -> DriftRun:
    r"""Run ``column`` for ``steps`` steps on i.i.d. Gaussian gradients, 8 frames of St(16, 4), in ``dtype``.

    ``lr = 1`` is far above the trust radius 0.1, so a trust region is active on (nearly) every step: the
    hardest case for drift and conditioning. After each chunk of steps the tangent step :math:`s_t` of
    every step is recovered from :math:`(W_t, W_{t+1})` (:func:`recover_polar_step`; for a QR or Cayley
    retraction, the polar-equivalent step) and :math:`\kappa(I + s_t^\top s_t)` computed; the
    orthonormality error of every iterate is measured in float64. No re-projection is ever applied.

    Parameters
    ----------
    {{column}}
    steps : int, default 10000
        Steps of the run.
    dtype : torch.dtype, default torch.float64
        Of the frames and gradients.
    seed : int, default 0
        Seed of the start and the gradients.
    lr : float, default 1.0
        Learning rate.
    trust_region : float or None, default 0.1
        Trust radius :math:`\Delta` of the optimizer (ignored by columns without one).
    progress : callable, optional
        ``progress(done, steps)``, called after each chunk of 500 steps (and after the last step) with the steps
        done so far.

    Returns
    -------
    DriftRun
        The run's statistics.
    """
    require_steps("run_drift", steps)
    gen = torch.Generator().manual_seed(seed)
    w0 = random_frames(*_SHAPE, generator=gen).to(dtype)
    p = column.make_parameter(w0)
    opt = column.make_optimizer([p], lr=lr, trust_region=trust_region)
    eye = torch.eye(_SHAPE[-1], dtype=torch.float64)
    max_cond, no_step, max_err, max_step = 1.0, 0, 0.0, 0.0
    prev = w0.to(torch.float64)
    done = 0
    while done < steps:
        n = min(_CHUNK, steps - done)
        grads = torch.randn(n, *_SHAPE, dtype=torch.float64, generator=gen).to(dtype)
        iterates = []
        for i in range(n):
            p.grad = grads[i].clone()
            opt.step()
            iterates.append(p.detach().to(torch.float64).clone())
        traj = torch.stack(iterates)
        gram = traj.transpose(-1, -2) @ traj
        max_err = max(max_err, float((gram - eye).abs().amax()))
        if not torch.isfinite(traj).all():
            max_err = float("inf")
        if column.on_manifold:
            before = torch.cat([prev.unsqueeze(0), traj[:-1]])
            s, pmat = recover_polar_step(before, traj)
            cond = step_condition(pmat)
            no_step += int((~torch.isfinite(cond)).any(dim=-1).sum())
            finite = cond[torch.isfinite(cond)]
            if finite.numel():
                max_cond = max(max_cond, float(finite.max()))
            max_step = worst_figure([max_step, float(s.norm(dim=(-2, -1)).max())])
        prev = traj[-1]
        done += n
        if progress is not None:
            progress(done, steps)
    final = float((prev.transpose(-1, -2) @ prev - eye).abs().amax())
    return DriftRun(column.name, str(dtype).replace("torch.", ""), steps, lr, trust_region, max_cond, no_step,
                    max_err, final, max_step)


def _check_runs(who: str, runs: list[DriftRun]) -> None:
    """:class:`ValueError` for no run, or a run of no step: its figures are the start's, and would pass."""
    if not runs:
        raise ValueError(f"{who}: no drift run given (an empty list checks nothing); pass run_drift's results.")
    for run in runs:
        require_steps(f"{who}: the run of {run.optimizer} in {run.dtype}", run.steps, name="steps")


@fill
def certify_conditioning(column: OptimizerColumn, runs: list[DriftRun], *, trust_region: float = 0.1) -> Certificate:
    r"""3a. :math:`\kappa(I + s^\top s) \le 1 + \Delta^2` on every step of the runs (``runs`` from :func:`run_drift`).

    Parameters
    ----------
    {{column}}
    runs : list of DriftRun
        Runs of ``column`` (:func:`run_drift`).
    trust_region : float, default 0.1
        The radius :math:`\Delta` of the bound, the one the runs stepped with.

    {{returns_certificate}}
    """
    name = "3a polar step cond <= 1 + D^2"
    statement = (f"the matrix inverted by the polar retraction, I + s^T s, has condition number <= 1 + Delta^2 "
                 f"(Delta = {trust_region:g}) on every step (lr = 1, random gradients)")
    if not column.on_manifold:
        return Certificate.not_applicable(name, statement, "unconstrained matrix: no retraction, nothing inverted",
                                          optimizer=column.name)
    _check_runs("certify_conditioning", runs)
    bound = 1.0 + trust_region**2
    worst = 0.0
    details: dict = {}
    for run in runs:
        slack = CONDITION_SLACK.get(getattr(torch, run.dtype), 1e-4)
        cond = float("inf") if run.steps_without_polar_step else run.max_condition
        worst = worst_figure([worst, (cond - 1.0) / (bound * (1.0 + slack) - 1.0)])
        details[f"max_condition_{run.dtype}"] = cond
        details[f"max_step_norm_{run.dtype}"] = run.max_step_norm
        details[f"steps_{run.dtype}"] = run.steps
        if run.steps_without_polar_step:
            details[f"steps_without_polar_step_{run.dtype}"] = run.steps_without_polar_step
    measured = worst_figure(details[f"max_condition_{run.dtype}"] for run in runs)
    details["bound"] = bound
    if not column.has_trust_region:
        details["note"] = "no trust region: the step is not capped, kappa grows like 1 + ||s||^2"
    passed = worst <= 1.0
    return Certificate(name, statement, measured, bound, passed, details, column.name)


@fill
def certify_drift(column: OptimizerColumn, run: DriftRun) -> Certificate:
    """3b/3c. :math:`\\max_t |W_t^\\top W_t - I|` stays at rounding level (``DRIFT_TOL``) over the run.

    Parameters
    ----------
    {{column}}
    run : DriftRun
        A run of ``column`` (:func:`run_drift`): float64 for 3b, float32 for 3c.

    {{returns_certificate}}
    """
    _check_runs("certify_drift", [run])
    dtype = getattr(torch, run.dtype)
    label = "3b" if dtype == torch.float64 else "3c"
    name = f"{label} no drift, {run.dtype}"
    statement = (f"max |W_t^T W_t - I| over a long run in {run.dtype} (lr = 1, random gradients, no re-projection; "
                 f"the run's length in details: steps) stays at rounding level, <= 16 r u")
    details = {"steps": run.steps, "final": run.final_orthonormality_error, "lr": run.lr}
    if not column.on_manifold:
        details["note"] = "unconstrained matrix: the iterates leave St(d, r) (off-manifold drift)"
    return Certificate.check(name, statement, run.max_orthonormality_error, DRIFT_TOL[dtype], optimizer=column.name,
                             details=details)
