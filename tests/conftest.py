"""Shared pytest fixtures and helpers."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)
