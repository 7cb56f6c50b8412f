"""The frame optimizers on one base: ``StiefelAdam`` (Riemannian Adam with one second moment per frame, a trust
region and polar retraction) and ``StiefelMuon`` (manifold Muon: the spectral-norm steepest tangent direction).

One job per file:

- :mod:`._reference`: :func:`stiefel_adam_update`, the update as readable maths (the specification, with the
  ablation variants as options);
- :mod:`._kernel`: ``_frame_update_``, the same update fast and in place (tested equal to the reference);
- :mod:`._batching`: same-shaped frames grouped into batches, stacked state, workspace, the batch driver;
- :mod:`._state`: state shapes and creation, master copies, checkpoint loading;
- :mod:`._validation`: argument, parameter and per-step checks;
- :mod:`._base`: :class:`FrameOptimizer`, the bookkeeping both optimizers share;
- :mod:`.adam`: the :class:`StiefelAdam` class;
- :mod:`._muon`: the manifold-Muon direction and update, readable and fast; :mod:`.muon`: :class:`StiefelMuon`.

Every name below was importable from the former single-file ``optim`` module and still is (the private ones
for tests, benchmarks and the distributed helpers).
"""

# ruff: noqa: F401

from .._linalg import ADJUST_LR_FNS, frame_step_scale
from . import _reference, _validation
from ._base import _TORCH_CAPTURABLE_DEVICES, FrameOptimizer
from ._batching import (
    ACCELERATOR_STACK_NUMEL,
    STACK_NUMEL,
    _frame_batches,
    _frame_lr,
    _stacked_state,
    _stacked_view,
)
from ._kernel import _FAST_MODES, _frame_update_, _rounding_margin
from ._muon import MUON_ADJUST_LR_FNS, muon_direction, muon_direction_reference, muon_lr_scale, stiefel_muon_update
from ._reference import stiefel_adam_update
from ._state import _capturable, _frame_state_shapes, _loaded_state, _zeros_like_layout
from ._validation import (
    _DEFAULT_TRUST_REGION,
    _GROUP_DEFAULTS,
    _can_read_host,
    _check_manifold,
    _check_parameter,
    _validate_hyperparameters,
)
from .adam import StiefelAdam
from .muon import DEFAULT_DUAL_STEPS, DEFAULT_NS_STEPS, StiefelMuon

__all__ = ["StiefelAdam", "StiefelMuon", "FrameOptimizer", "stiefel_adam_update", "stiefel_muon_update",
           "muon_direction", "muon_direction_reference", "muon_lr_scale", "frame_step_scale", "SECOND_MOMENTS", "ADJUST_LR_FNS",
           "ORTHONORMALITY_TOLERANCE"]

#: The accepted values of the ``second_moment`` option (defined in ``_reference``, documented here).
SECOND_MOMENTS = _reference.SECOND_MOMENTS

#: Largest ``max |W^T W - I|`` accepted for a frame at its first step, per parameter dtype (defined in
#: ``_validation``). A bf16-rounded orthonormal frame is already about 1e-3 off, so the low-precision
#: tolerances are loose.
ORTHONORMALITY_TOLERANCE = _validation.ORTHONORMALITY_TOLERANCE
