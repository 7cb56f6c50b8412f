r"""Optimizers that do not know the constraint, and optimizers built before
:func:`~geoopt_stiefel_attention.stiefelize` converted the weights they hold.

**What goes wrong silently without it.** An optimizer that does not know the constraint (torch's ``AdamW`` over
``model.parameters()``, the HuggingFace ``Trainer``'s default) moves a frame's entries freely: the frames leave the
Stiefel manifold and the model trains as an unconstrained one (one AdamW step at lr 1e-5 already leaves
:math:`\max|W^\top W - I| = 6\cdot 10^{-5}`). An optimizer built on a stock model and kept after its conversion holds
tensors, not names: it holds the weights stiefelize parametrized (a fused ``in_proj_weight``'s Parameter lives on as
the parametrization's ``original``, the rest of the weight; a pure ``q_proj.weight`` is left out of the model,
emptied) but not the frames that now carry the query and key rows, so it steps what it holds and the queries and keys
never train.

**How it is detected.**

- *Frames moved off the manifold*: the frame check of every training forward
  (:mod:`geoopt_stiefel_attention._guard`, one Gram product per frame), which cannot see the last step of a run;
  that one is seen when the model is saved (:func:`warn_if_saved_off_manifold`, from the state-dict post hooks of the
  converted owners and of :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention`).
- *Optimizers built before the conversion*: stiefelize registers each weight it converts with that weight's
  trainable frames and gains (:func:`watch`). One global ``torch.optim`` step pre-hook (:func:`_check`, torch's
  public ``register_optimizer_step_pre_hook``) then looks at every optimizer that steps: one that holds a converted
  weight but not all of its frames is a suspect; the frames' version counters are read at its first step and, if no
  optimizer has changed the frames by its step :data:`STALLED_STEPS` + 1 while they hold gradients (so a backward
  reached them), that step raises before anything changes. Two optimizers, one for the frames and one for the rest,
  are a legitimate setup: the frames' versions move between the other's steps, and the suspicion is dropped. A step
  of an optimizer that holds no converted weight costs one comparison of its parameter count.

**What the user is shown.** At a training forward, :class:`~geoopt_stiefel_attention.FrameOffManifoldError` naming
the frame and the measured distance, with the fix: train frames with the library's optimizer
(``StiefelAdam(param_groups(model), ...)``; with a HuggingFace Trainer ``optimizers=(opt, None)``), or re-project
(``w.proj_()``) after a change made on purpose. At ``state_dict()``, the same words as a ``UserWarning``. At the step
of an optimizer built before the conversion, a ``RuntimeError`` (the step not taken): build the optimizer after
converting, or add the frames to an optimizer that trains them.

Tests: ``tests/test_guard.py``, ``tests/test_convert.py`` (``-k "built_before or beside_one"``),
``tests/test_training_stacks.py`` (``-k saving``: the last step, seen at save).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _guard

__all__: list[str] = []

#: id(a converted weight as it was) -> (weak reference to it, weak references to its trainable frames and gains, its
#: path in the model)
_WATCHED: dict[int, tuple[weakref.ref, list[weakref.ref], str]] = {}
_REVISION = [0]  # bumped by every watch(): an optimizer's cached verdict is then computed again
#: optimizer -> {"key": (revision, groups, parameters), "suspects": {id: (label, frame refs)}, "versions": {id: ...}}
_SEEN: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []  # the global step pre-hook's handle, registered once
#: Steps a suspect optimizer takes with the frames unchanged (and holding gradients from its second on) before its next
#: step raises: a few, so that a frame optimizer skipping some steps (GradScaler on inf/NaN gradients) is no false alarm
STALLED_STEPS = 4


def watch(weight: Tensor, new: list[Tensor], label: str) -> None:
    """Register ``weight`` (a weight stiefelize converts, as it was) and ``new`` (its frames and gains) for
    :func:`_check`; registers the global step pre-hook at the first call."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check))
    key = id(weight)
    _WATCHED[key] = (weakref.ref(weight, lambda _ref, key=key: _WATCHED.pop(key, None)),
                     [weakref.ref(t) for t in new], label)
    _REVISION[0] += 1


def _suspects(optimizer: Any) -> dict[int, tuple[str, list[weakref.ref]]]:
    """The watched weights ``optimizer`` holds without all of their trainable frames."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = {}
    for key, (ref, frames, label) in list(_WATCHED.items()):
        if key not in held or ref() is None:
            continue
        trainable = [r for r in frames if (t := r()) is not None and t.requires_grad]
        if trainable and not all(id(r()) in held for r in trainable):
            found[key] = (label, trainable)
    return found


def _check(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: raise before a step of an optimizer that holds a converted weight but not its frames,
    when no optimizer has changed those frames in its :data:`STALLED_STEPS` steps before and they hold gradients."""
    if torch.compiler.is_compiling():  # first: Dynamo folds it, so a traced step reads none of the state below
        return
    if not _WATCHED:
        return
    groups = optimizer.param_groups
    key = (_REVISION[0], len(groups), sum(len(g["params"]) for g in groups))
    seen = _SEEN.get(optimizer)
    if seen is None or seen["key"] != key:
        seen = {"key": key, "suspects": _suspects(optimizer), "versions": {}}
        _SEEN[optimizer] = seen
    suspects = seen["suspects"]
    if not suspects:
        return
    stalled = []
    for wid, (label, refs) in list(suspects.items()):
        frames = [t for r in refs if (t := r()) is not None]
        versions = tuple(t._version for t in frames)
        if wid not in seen["versions"]:  # its first step as a suspect: read the frames' versions
            seen["versions"][wid] = [versions, 0]
        elif versions != seen["versions"][wid][0]:  # something else trains the frames (a second optimizer)
            del suspects[wid]
        elif any(t.grad is not None for t in frames):
            seen["versions"][wid][1] += 1
            if seen["versions"][wid][1] >= STALLED_STEPS:
                stalled.append(label)
    if stalled:
        names = ", ".join(repr(n) for n in stalled[:4]) + (f", ... ({len(stalled)} weights)" if len(stalled) > 4
                                                            else "")
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {names}, converted by stiefelize, but not the Stiefel frames (and "
            f"gains) that now carry their query/key rows, and no optimizer has stepped those frames in its last "
            f"{STALLED_STEPS} steps, though they have gradients: it was built before the conversion, so the queries "
            f"and keys would never train. This step was not taken; build the optimizer after converting (e.g. "
            f"StiefelAdam(param_groups(model))), or add the frames to an optimizer that trains them.")


def warn_if_saved_off_manifold(owner: str, frames: Iterable[tuple[str, Tensor]], *, where: str, consequence: str,
                               stacklevel: int = 2) -> None:
    """Warn when a frame of ``owner`` is off the manifold as its state dict is written.

    The frame check of training forward passes (:mod:`.._guard`) cannot see the last step of an optimizer that does
    not know the constraint (earlier steps are reported by the next forward): without this warning a run with a
    single such step (a HuggingFace ``Trainer`` with its own AdamW and ``max_steps=1``) is saved off the manifold
    without a word. ``where`` names the place in the message, ``consequence`` is added after it; ``stacklevel`` is
    the caller's, as for :func:`warnings.warn`."""
    try:
        _guard.check_frame_tensors(owner, frames, where=where)
    except _guard.FrameOffManifoldError as err:
        warnings.warn(f"{err} {consequence}", UserWarning, stacklevel=stacklevel + 1)
