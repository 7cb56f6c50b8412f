r"""Proposition 4: the update is exactly O(d)-equivariant (left) and O(r)-equivariant (right).

If :math:`W_0 \mapsto QW_0R` and every gradient :math:`G_t \mapsto QG_tR` (:math:`Q \in O(d)`,
:math:`R \in O(r)`), then :math:`\xi \mapsto Q\xi R`, :math:`m \mapsto QmR`, and the frame scalar
:math:`\|\xi\|_F^2`, the trust-region norm and the polar factor are all invariant or equivariant
(:math:`\operatorname{polar}(QYR) = Q\operatorname{polar}(Y)R`), so :math:`W_t \mapsto QW_tR` exactly.
A per-column second moment :math:`\sum_i \xi_{ij}^2` is invariant under :math:`Q` but mixed by
:math:`R`; an element-wise one is changed by both. Equivariance therefore does not single out the
per-frame scalar (a per-column scalar is left-equivariant too); steepest descent in the embedded
metric does (Proposition 1).
"""

from __future__ import annotations

import torch

from .._docfrag import fill
from ._numerics import QuadraticLoss, random_frames, random_orthogonal
from ._result import Certificate, require_steps
from .optimizers import OptimizerColumn

__all__ = ["EQUIVARIANCE_TOL", "certify_equivariance"]

#: Max-abs deviation allowed between the transformed trajectory and Q W_t R (float64, 50 steps).
EQUIVARIANCE_TOL = 1e-12

_D, _R, _HEADS = 16, 4, 4


@fill
def certify_equivariance(column: OptimizerColumn, side: str, *, seed: int = 0, steps: int = 50,
                         lr: float = 0.05) -> Certificate:
    r"""4a/4b. Trajectories from :math:`(QW_0R, QG_tR)` equal :math:`QW_tR` (float64).

    ``side="left"`` uses a random :math:`Q \in O(d)` and :math:`R = I`; ``side="right"`` uses :math:`Q = I`
    and a random :math:`R \in O(r)`. The loss is :math:`\sum_h \tfrac12\|A_hW_h - B_h\|^2` on 4 frames of
    St(16, 4); the transformed run minimises :math:`f(Q^\top W R^\top)`, whose gradient at :math:`QWR` is
    :math:`Q\nabla f(W)R`. ``lr = 0.05`` with trust region 0.1, so the cap is active on some steps.
    Measured: :math:`\max_t \max|\tilde W_t - QW_tR|`.

    Parameters
    ----------
    {{column}}
    side : {"left", "right"}
        :math:`O(d)` acting on the left (4a) or :math:`O(r)` on the right (4b).
    {{seed_random}}
    {{steps_each}}
    {{lr_plain}}

    {{returns_certificate}}
    """
    if side not in ("left", "right"):
        raise ValueError(f"certify_equivariance: side={side!r} is unknown; use 'left' or 'right'.")
    require_steps("certify_equivariance", steps)
    name = "4a left O(d)-equivariance" if side == "left" else "4b right O(r)-equivariance"
    group = "Q in O(d), R = I" if side == "left" else "Q = I, R in O(r)"
    statement = f"trajectories from (Q W0 R, Q G_t R) equal Q W_t R ({group}), float64, {steps} steps"
    gen = torch.Generator().manual_seed(seed)
    loss = QuadraticLoss.random(_HEADS, _D, _R, generator=gen)
    w0 = random_frames(_HEADS, _D, _R, generator=gen)
    q = random_orthogonal(_D, generator=gen) if side == "left" else torch.eye(_D, dtype=torch.float64)
    r = random_orthogonal(_R, generator=gen) if side == "right" else torch.eye(_R, dtype=torch.float64)
    moved = loss.transformed(q if side == "left" else None, r if side == "right" else None)

    def trajectory(start, f):
        p = column.make_parameter(start)
        opt = column.make_optimizer([p], lr=lr)
        out = [start.clone()]
        for _ in range(steps):
            p.grad = f.grad(p.detach())
            opt.step()
            out.append(p.detach().clone())
        return torch.stack(out)

    base = trajectory(w0, loss)
    other = trajectory(q @ w0 @ r, moved)
    measured = float((other - q @ base @ r).abs().max())
    details = {"steps": steps, "lr": lr, "shape": [_HEADS, _D, _R],
               "path_length": float((base[1:] - base[:-1]).norm(dim=(-2, -1)).sum())}
    return Certificate.check(name, statement, measured, EQUIVARIANCE_TOL, optimizer=column.name, details=details)
