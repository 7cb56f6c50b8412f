r"""``torch.nn.utils.parametrize.cached()`` around an optimizer step of a converted model.

**What goes wrong silently without it.** Inside the block each parametrized weight is built once, at its first
read, and kept: the weights :func:`~geoopt_stiefel_attention.stiefelize` rebuilds from the frames would, after a step
taken inside the block, still be built from the frames as they were, so the forwards after that step use stale query
and key weights (measured 0.31 apart at lr 0.1).

**How it is detected.** At each step outside ``torch.compile``, a frame optimizer reads torch's module-level flags of
the block (``torch.nn.utils.parametrize._cache_enabled``, and ``_cache``, which holds a weight once one was read) and
whether it holds frames. Both are private to torch; ``tests/test_integrations_pins.py`` fails, naming this module,
when a torch release drops them.

**What the user is shown.** A ``UserWarning`` naming the optimizer's step: step outside the block (it is meant for
inference, or for weights that do not change). An optimizer without frames, or a step inside the block before any
parametrized weight was read, is not warned.

**Where the code is.** In the frame optimizers' base, ``FrameOptimizer.step`` and ``FrameOptimizer._warn_cached``
(``geoopt_stiefel_attention/optim/_base.py``): the base is being rebuilt (issue 58, item 3), so the check was not moved
here in this round; the base can take it from this module.

Tests: ``tests/test_training_stacks_2.py`` (``-k parametrize_cached``).
"""

from __future__ import annotations

__all__: list[str] = []
