"""Stiefel-constrained attention for PyTorch, built on geoopt.

Query/key projections live on the Stiefel manifold :math:`\\mathrm{St}(d, r)` and are trained by
:class:`StiefelAdam`: Riemannian Adam with one second moment per frame, a per-frame trust region and the
polar retraction, with AdamW for every other parameter.
"""

import warnings as _warnings

# geoopt 0.5.1 calls torch.jit.script at import time, which torch >= 2.9 flags as deprecated. The warning is
# about geoopt's internals, so it is silenced for that one import only (no global filter is installed).
with _warnings.catch_warnings():
    _warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
    import geoopt as _geoopt  # noqa: F401

from .convert import (
    LAYOUTS,
    Block,
    ConversionReport,
    ConvertedAttention,
    Layout,
    export_state_dict,
    unstiefelize,
)
from .manifolds import PolarStiefel, is_frame
from .models import PatchViT, TinyTransformer
from .nn import (
    EuclideanMultiheadAttention,
    StiefelMultiheadAttention,
    frame_parameters,
    param_groups,
    query_key_projections,
    stiefelize,
)
from .optim import StiefelAdam, stiefel_adam_update

__version__ = "0.1.0"

__all__ = ["PolarStiefel", "StiefelAdam", "is_frame", "stiefel_adam_update", "__version__",
           "StiefelMultiheadAttention", "EuclideanMultiheadAttention", "stiefelize", "param_groups",
           "frame_parameters", "query_key_projections", "TinyTransformer", "PatchViT", "unstiefelize",
           "export_state_dict", "Layout", "Block", "LAYOUTS", "ConversionReport", "ConvertedAttention"]
