"""The frame optimizers on one base: ``StiefelAdam`` (Riemannian Adam with one second moment per frame, a trust
region and polar retraction) and ``StiefelMuon`` (manifold Muon: the spectral-norm steepest tangent direction).

One job per file:

- :mod:`._reference`: :func:`stiefel_adam_update`, the update as readable maths (the specification, with the
  ablation variants as options);
- :mod:`._kernel`: ``_frame_update_``, the same update fast and in place (tested equal to the reference);
- :mod:`._batching`: frames of one shape grouped into batches, stacked state, workspace, the batch driver;
- :mod:`._state`: state shapes and creation, master copies, checkpoint loading;
- :mod:`._validation`: argument, parameter and per-step checks;
- :mod:`._base`: :class:`FrameOptimizer`, the bookkeeping both optimizers share;
- :mod:`.adam`: the :class:`StiefelAdam` class;
- :mod:`._muon`: the manifold-Muon direction and update, readable and fast; :mod:`.muon`: :class:`StiefelMuon`.

Only the public names are exported here; a private helper is imported from the module that defines it (e.g.
``from geoopt_stiefel_attention.optim._batching import _stacked_view``).
"""

# Public names beyond __all__ (constants of the batching and of StiefelMuon) are imported here on purpose.
# ruff: noqa: F401

from .._linalg import ADJUST_LR_FNS, AUTO_TRUST_REGION, frame_step_scale, trust_radius
from . import _reference, _validation
from ._base import FrameOptimizer
from ._batching import ACCELERATOR_STACK_NUMEL, STACK_NUMEL
from ._muon import (
    DEFAULT_DIRECTION_TOL,
    MUON_ADJUST_LR_FNS,
    DirectionSolve,
    muon_direction,
    muon_direction_reference,
    muon_lr_scale,
    stiefel_muon_update,
)
from ._reference import stiefel_adam_update
from .adam import StiefelAdam
from .muon import StiefelMuon

__all__ = ["StiefelAdam", "StiefelMuon", "FrameOptimizer", "stiefel_adam_update", "stiefel_muon_update",
           "muon_direction", "muon_direction_reference", "muon_lr_scale", "frame_step_scale", "trust_radius",
           "SECOND_MOMENTS", "ADJUST_LR_FNS", "AUTO_TRUST_REGION", "ORTHONORMALITY_TOLERANCE"]

#: The accepted values of the ``second_moment`` option (defined in ``_reference``, documented here).
SECOND_MOMENTS = _reference.SECOND_MOMENTS

#: Largest ``max |W^T W - I|`` accepted for a frame at its first step, per parameter dtype (defined in
#: ``_validation``). A bf16-rounded orthonormal frame is already about 1e-3 off, so the low-precision
#: tolerances are loose.
ORTHONORMALITY_TOLERANCE = _validation.ORTHONORMALITY_TOLERANCE
