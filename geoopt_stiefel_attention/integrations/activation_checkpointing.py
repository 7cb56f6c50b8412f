r"""Activation checkpointing (``torch.utils.checkpoint`` without reentry, HuggingFace ``gradient_checkpointing_enable``)
and other saved-tensor hooks (``torch.autograd.graph.save_on_cpu``) around a converted model.

**What goes wrong silently without it.** A converted weight that its module's forward reads several times
(``nn.MultiheadAttention`` reads ``in_proj_weight`` three times) is built once per forward of the converted model and
the same tensor returned to every read. Checkpointing without reentry recomputes a region in backward, outside the
model's forward, where each read builds its own weight, and matches the tensors saved then to those saved in the
forward by position: a forward that reused a weight saves fewer tensors, which shifts every later one, so backward
fails on a metadata mismatch, or, where the shapes agree, gives other tensors' gradients.

**How it is detected.** :func:`saved_tensor_hooks_active` asks torch whether default saved-tensor hooks are set
(``torch._C._autograd._top_saved_tensors_default_hooks``, a private function; ``tests/test_integrations_pins.py``
fails, naming this module, when a torch release drops it). Where torch cannot tell, hooks are assumed active.

**What the user is shown.** Nothing: under such hooks, with gradients enabled, every read builds its own weight, so
a checkpointed model gives the stock model's loss and gradients (one build per read instead of one per forward).

Tests: ``tests/test_training_stacks_2.py`` (``-k checkpoint``).
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def saved_tensor_hooks_active() -> bool:
    """Whether default saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``: activation
    checkpointing without reentry, in its forward and its recomputation, ``save_on_cpu``); ``True`` where torch
    cannot tell (then a weight is not reused while gradients are recorded)."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks
    except AttributeError:  # pragma: no cover - every supported torch has it
        return True
    try:
        return top(False) is not None
    except TypeError:  # pragma: no cover - a torch whose function takes no argument
        return top() is not None
