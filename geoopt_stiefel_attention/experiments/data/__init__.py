"""Data modules of the experiments: batch sources shared by every study, and each study's data set."""

from .batches import BatchSource, FullBatch, MiniBatches, epoch_generator
from .modular import OPERATIONS, ModularSplit, modular_split

__all__ = ["BatchSource", "FullBatch", "MiniBatches", "epoch_generator", "OPERATIONS", "ModularSplit",
           "modular_split"]
