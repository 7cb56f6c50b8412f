r"""Averaged models: ``torch.optim.swa_utils.AveragedModel`` (SWA, EMA of the parameters) and the model-EMA classes
that average ``state_dict()`` values in place (timm's ``ModelEma``/``ModelEmaV2``/``ModelEmaV3``, the YOLO and
ultralytics ``ModelEMA``).

**What goes wrong silently without it.** An average of orthonormal frames is not orthonormal, and it is evaluated,
not trained, so the frame check of a training forward (:mod:`geoopt_stiefel_attention._guard`) never sees it: the
averaged model would be evaluated with frames off the manifold. Worse, a model-EMA class that averages by writing
into ``state_dict()`` values (``ema_v.lerp_(model_v, 1 - decay)``, ``ema_v.copy_(...)``) cannot reach a converted
weight at all: that entry is a tensor rebuilt from the frames, so every update is lost and the average's queries and
keys stay where the copy began.

**How it is detected.**

- *At an evaluation forward* (gradients off): :func:`check_at_evaluation` runs the frame check when the frames
  changed since its last check (their identities and version counters, :func:`changed_since_evaluation`); an
  evaluation loop over unchanged frames pays one tuple of version counters per forward.
- *Updates written into state-dict values.* The averaged model is a deep copy of the model (every one of those
  classes starts from ``copy.deepcopy(model)``): copying a converted weight marks the copy (:func:`mark_copy`, called
  by its ``__deepcopy__``), and the stock entries its ``state_dict()`` hands out are kept with their version counters
  (:func:`hand_out`) until the copy's next ``state_dict()`` or forward, where a moved counter means they were written
  in place (:func:`check_written`). The writer is named when the copy is a child module of another module (timm's
  ``ModelEmaV2``/``ModelEmaV3``, ``AveragedModel``: ``self.module = deepcopy(model)``), seen by torch's global
  module-registration hook (``torch.nn.modules.module.register_module_module_registration_hook``, installed at the
  first copy) at the first registration after the copy.
  No walk of the Python stack is made.

**Limits** (what is not detected). The caller's class is not known when the copy is held as a plain attribute
(timm's ``ModelEma``, the YOLO ``ModelEMA``: ``self.ema = deepcopy(model)``): the warning then says "Something
holding a deep copy". An update is seen at the copy's next ``state_dict()`` or forward, not at the write itself, so
the first update of an EMA is reported at its second (or at the first evaluation of the average). An average that
is not a deep copy of the converted model (built anew and filled by ``load_state_dict``), and writes through
``.data`` (which move no version counter), are not seen. A copy whose state dict was read keeps those entries (one
rebuilt tensor per converted weight) until its next ``state_dict()`` or forward.

**What the user is shown.** At evaluation, a ``UserWarning`` from the frame check naming the frame, plus
:data:`_AT_EVALUATION`: project the average after each update with
:func:`~geoopt_stiefel_attention.project_frames_`. For a state-dict EMA, a ``UserWarning`` once per averaged copy:
average the parameters (``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))``, timm's
``ModelEmaV3(model, exclude_buffers=True)``), then ``project_frames_``.

Tests: ``tests/test_averaging.py``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from .. import _guard

__all__: list[str] = []

# --------------------------------------------------------------------------------- the check of an evaluation
#: What the warning of an evaluation forward adds to the check's message: the other common cause there.
_AT_EVALUATION = ("At an evaluation forward (no gradients) this is a warning, given once each time the frames change. "
                  "An average of frames (torch.optim.swa_utils.AveragedModel, an EMA of the parameters) is not "
                  "orthonormal either: project the average after each update with "
                  "geoopt_stiefel_attention.project_frames_(averaged_model).")


#: holder module -> the identities and version counters of its frames at its last evaluation check (weakly: a copy
#: or an unpickled module starts without one, whatever ids it reuses)
_EVALUATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _evaluation_key(frames: list[tuple[str, Tensor]]) -> tuple | None:
    """The identities and version counters of ``frames``; ``None`` for inference tensors, which keep no counter."""
    try:
        return tuple((id(w), w._version) for _, w in frames)
    except RuntimeError:
        return None


def evaluation_check_skipped() -> bool:
    """Whether a forward without gradients skips its check now: under ``torch.compile``, tracing or scripting, and
    while a CUDA graph is captured (no host read is allowed there, and replays run no Python)."""
    return (torch.jit.is_tracing() or torch.jit.is_scripting() or torch.compiler.is_compiling()
            or _guard.capturing())


def changed_since_evaluation(frames: list[tuple[str, Tensor]], holder: nn.Module) -> bool:
    """Whether the frames of ``holder`` changed since its last evaluation check (inference tensors: always)."""
    key = _evaluation_key(frames)
    return key is None or _EVALUATED.get(holder) != key


def mark_evaluated(frames: list[tuple[str, Tensor]], holder: nn.Module) -> None:
    """Record the frames of ``holder`` as checked at evaluation (found on the manifold by a check of them all)."""
    _EVALUATED[holder] = _evaluation_key(frames)


def check_at_evaluation(owner: str, frames: list[tuple[str, Tensor]], holder: nn.Module) -> None:
    """The frame check of a forward pass without gradients: run :func:`~.._guard.check_frame_tensors` when the frames
    of ``holder`` changed since its last such check (their identities and version counters), and warn, not raise,
    when one is off the manifold. Frames changed in place (an optimizer step, an average taken into them) are checked
    at the next forward. Writes through ``.data`` move no version counter, and FSDP2 keeps the unsharded parameters'
    counters as they were on purpose, so frames sharded by it are checked at their first evaluation only. Skipped
    under ``torch.compile``, tracing, scripting and while a CUDA graph is captured
    (:func:`evaluation_check_skipped`)."""
    if evaluation_check_skipped() or not changed_since_evaluation(frames, holder):
        return
    mark_evaluated(frames, holder)
    try:
        _guard.check_frame_tensors(owner, frames, where="an evaluation forward pass")
    except _guard.FrameOffManifoldError as err:
        warnings.warn(f"{err} {_AT_EVALUATION}", UserWarning, stacklevel=4)


# ------------------------------------------------------------------------ updates written into state-dict values
#: The subject of the warning when the object holding the averaged copy is not a module (see the limits above).
UNNAMED_HOLDER = "Something holding a deep copy (a model EMA: timm's ModelEma, a YOLO ModelEMA?)"


class _Copy:
    """One ``copy.deepcopy`` of a converted model: shared by the copies of its converted weights. ``holder`` is the
    class name of the module that took the copy as a child (``None`` until one does); ``warned`` is set by the first
    warning about it."""

    __slots__ = ("holder", "warned", "__weakref__")

    def __init__(self) -> None:
        self.holder: str | None = None
        self.warned = False


#: The memo key of the current copy's :class:`_Copy` inside one ``copy.deepcopy`` call: the id of a live object, so it
#: is never the id of an object being copied.
_MEMO_KEY_OWNER = object()
_MEMO_KEY = id(_MEMO_KEY_OWNER)
#: A weak reference to the latest copy's :class:`_Copy`, until the next module registration (which names its holder
#: when it is that copy's: ``self.module = deepcopy(model)`` registers the copy right after making it).
_LATEST: list[weakref.ref] = []
_REGISTRATION_HOOK: list[Any] = []


def mark_copy(replica: nn.Module, memo: dict[int, Any]) -> None:
    """Mark ``replica``, the copy of a converted weight made by ``copy.deepcopy`` with ``memo``, as part of an averaged
    copy: every weight of one ``deepcopy`` call shares one :class:`_Copy`. Installs the module-registration hook
    that names the holder (once per process)."""
    token = memo.get(_MEMO_KEY)
    if token is None:
        token = memo[_MEMO_KEY] = _Copy()
        _LATEST[:] = [weakref.ref(token)]
        if not _REGISTRATION_HOOK:
            _REGISTRATION_HOOK.append(
                torch.nn.modules.module.register_module_module_registration_hook(_note_holder))
    replica.__dict__["_averaged_copy"] = token


def _note_holder(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Global module-registration hook: when the first module registered after a copy was made is that copy
    (``self.module = deepcopy(model)``), remember the class name of the module taking it on its :class:`_Copy`. One
    walk of the registered module per copy made; nothing at other registrations."""
    if not _LATEST:
        return
    token = _LATEST.pop()()
    if token is None or not isinstance(submodule, nn.Module):
        return
    if any(vars(m).get("_averaged_copy") is token for m in submodule.modules()):
        token.holder = type(module).__name__


def hand_out(weight: nn.Module, key: str, entry: Tensor) -> None:
    """Keep ``entry``, the stock state-dict entry ``key`` that a marked copy's converted weight (``weight``) hands
    out, with its version counter, for :func:`check_written`. Nothing for a weight that is not such a copy."""
    if "_averaged_copy" in weight.__dict__:
        weight.__dict__["_handed_out"] = (key, entry, entry._version)


def check_written(weight: nn.Module) -> None:
    """Warn, once per averaged copy, when the state-dict entry that ``weight`` last handed out was written in place
    (its version counter moved): an update of a model EMA that never reaches the frames. The entry is let go."""
    handed = weight.__dict__.pop("_handed_out", None)
    if handed is None:
        return
    key, entry, version = handed
    token = weight.__dict__.get("_averaged_copy")
    if entry._version == version or token is None or token.warned:
        return
    token.warned = True
    who = token.holder or UNNAMED_HOLDER
    warnings.warn(f"{who} reads state_dict() of a model converted by stiefelize ({key}, ...) and updates its values "
                  f"in place; a converted weight's entry there is a copy rebuilt from its frames, so the update never "
                  f"reaches the frames and the average's queries and keys stay where it began. Average the parameters "
                  f"instead, then project the frames: ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn="
                  f"get_ema_multi_avg_fn(decay)) and after each ema.update_parameters(model), "
                  f"geoopt_stiefel_attention.project_frames_(ema) (timm: ModelEmaV3(model, exclude_buffers=True), "
                  f"then project_frames_(ema.module); its set(model) copies through state_dict() too: use "
                  f"ema.module.load_state_dict(model.state_dict())).", UserWarning, stacklevel=3)
