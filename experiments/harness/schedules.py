r"""Learning-rate schedules shared by the studies, as factors of the base learning rate per optimizer step
(the runner's ``Task.lr_factor``)."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, *, total: int, warmup: int) -> float:
    r"""Learning-rate factor: :math:`(t+1)/w` for :math:`t < w`, then
    :math:`\tfrac12\big(1 + \cos(\pi (t - w)/(T - w))\big)` (``total`` :math:`= T` steps, ``warmup`` :math:`= w`)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
