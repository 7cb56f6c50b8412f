"""Stiefel-constrained attention for PyTorch, built on geoopt.

Query/key projections live on the Stiefel manifold :math:`\\mathrm{St}(d, r)` and are trained by
:class:`StiefelAdam`: Riemannian Adam with one second moment per frame, a per-frame trust region and the
polar retraction, with AdamW for every other parameter; or by :class:`StiefelMuon`: manifold Muon, the
spectral-norm steepest tangent direction with the polar retraction (both on one shared base).
"""

from . import _geoopt_import  # noqa: F401  (before any geoopt import: imports geoopt quietly)
from ._guard import FrameOffManifoldError, check_frames
from .convert import (
    LAYOUTS,
    Block,
    ConversionResult,
    ConvertedAttention,
    Layout,
    export_state_dict,
    parametrized_state_dict,
    unstiefelize,
)
from .manifolds import PolarStiefel, is_frame
from .models import PatchViT, TinyTransformer
from .nn import (
    EuclideanMultiheadAttention,
    StiefelMultiheadAttention,
    frame_parameters,
    param_groups,
    project_frames_,
    query_key_projections,
    stiefelize,
)
from .optim import StiefelAdam, StiefelMuon, frame_step_scale, stiefel_adam_update

__version__ = "0.1.0"

__all__ = ["PolarStiefel", "StiefelAdam", "StiefelMuon", "is_frame", "stiefel_adam_update", "frame_step_scale", "__version__",
           "StiefelMultiheadAttention", "EuclideanMultiheadAttention", "stiefelize", "param_groups",
           "frame_parameters", "project_frames_", "query_key_projections", "TinyTransformer", "PatchViT", "unstiefelize",
           "export_state_dict", "parametrized_state_dict", "Layout", "Block", "LAYOUTS", "ConversionResult", "ConvertedAttention",
           "check_frames", "FrameOffManifoldError"]

