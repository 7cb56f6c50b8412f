"""Batch sources for the shared training loop: tensors held once on the device, no per-example Python.

A batch source has one method, ``batches(epoch) -> iterable of (inputs, targets)``. The batches of an epoch
are a pure function of ``(seed, epoch)``: two arms with the same seed see the same data in the same order,
and a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

__all__ = ["BatchSource", "FullBatch", "MiniBatches", "derived_generator", "epoch_generator"]

#: First key of the random streams derived from a run's seed (keeps the streams of different uses apart).
STREAM_BATCH_ORDER = 0
STREAM_SPLIT = 1


class BatchSource(Protocol):
    """Anything with ``batches(epoch)`` yielding ``(inputs, targets)`` tensor pairs."""

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


def derived_generator(*keys: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from the non-negative ints ``keys`` only, through
    :class:`numpy.random.SeedSequence` (well-mixed, so nearby keys give unrelated streams)."""
    import numpy as np

    if not keys or any(not isinstance(k, int) or k < 0 for k in keys):
        raise ValueError(f"derived_generator: keys={keys!r} must be one or more non-negative ints.")
    state = int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(state)


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of one epoch's batch order and augmentation, a function of ``(seed, epoch)`` only."""
    return derived_generator(STREAM_BATCH_ORDER, int(seed), int(epoch))


class FullBatch:
    """The whole data set as one batch, every epoch (full-batch gradient descent).

    Parameters
    ----------
    inputs, targets : torch.Tensor
        Same leading dimension; kept as given (move them to the device first).
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"FullBatch: inputs ({inputs.shape[0]}) and targets ({targets.shape[0]}) must have "
                             f"the same number of examples.")
        if inputs.shape[0] == 0:
            raise ValueError("FullBatch: the data set is empty; check the split (e.g. train_fraction).")
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return 1

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield self.inputs, self.targets


class MiniBatches:
    """Minibatches of tensors held in memory, reshuffled every epoch from ``(seed, epoch)``.

    Parameters
    ----------
    inputs, targets : torch.Tensor
        Same leading dimension ``n``.
    batch_size : int
        Examples per batch.
    shuffle : bool, default True
        Draw a fresh permutation each epoch from :func:`epoch_generator` ``(seed, epoch)``; ``False`` keeps
        the stored order (evaluation).
    seed : int, default 0
        Fixes every epoch's order (use the run's seed: paired arms then see the same order).
    drop_last : bool, default False
        Drop the last, smaller batch.
    transform : callable, optional
        ``transform(inputs, generator) -> inputs`` applied to each training batch (data augmentation); it
        must draw its randomness from ``generator`` (seeded from ``(seed, epoch)``) to stay reproducible.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False,
                 transform: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"MiniBatches: inputs ({inputs.shape[0]}) and targets ({targets.shape[0]}) must have "
                             f"the same number of examples.")
        if not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"MiniBatches: batch_size={batch_size!r} must be a positive int.")
        if drop_last and inputs.shape[0] < batch_size:
            raise ValueError(f"MiniBatches: drop_last=True with {inputs.shape[0]} examples < batch_size="
                             f"{batch_size} leaves no batch; lower batch_size or set drop_last=False.")
        self.inputs, self.targets = inputs, targets
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.transform = transform

    def __len__(self) -> int:
        n = self.inputs.shape[0]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = self.inputs.shape[0]
        gen = epoch_generator(self.seed, epoch)
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        order = order.to(self.inputs.device)
        for k in range(len(self)):
            idx = order[k * self.batch_size:(k + 1) * self.batch_size]
            x = self.inputs.index_select(0, idx)
            if self.transform is not None:
                x = self.transform(x, gen)
            yield x, self.targets.index_select(0, idx)
