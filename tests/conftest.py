"""Shared pytest fixtures and helpers."""

import pytest
import torch

# The tests use small tensors, for which intra-op threading only adds overhead; on a loaded 2-core machine
# two threads made a 16x10 optimizer step 10-70x slower. One thread also makes timings reproducible.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)
