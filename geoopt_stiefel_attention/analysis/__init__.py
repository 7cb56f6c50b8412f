"""Numerical certificates of the method's propositions, run against stock optimizers.

Each certificate is a function returning a frozen :class:`Certificate` (``name, statement, measured,
tolerance, passed, details``); :func:`run_certificates` runs them all for every optimizer column of
:func:`default_columns`, and :mod:`~geoopt_stiefel_attention.analysis.table` renders the certificate table. Nothing
here prints. The command ``stiefel-attention certify`` prints the table.

1. steepest descent in the embedded metric (:mod:`.steepest`);
2. independence of the gradient scale (:mod:`.scale`);
3. conditioning of the polar step and absence of drift (:mod:`.conditioning`);
4. left O(d)- and right O(r)-equivariance (:mod:`.equivariance`);
5. weight decay has zero Riemannian gradient on St(d, r) (:mod:`.weight_decay`);
6. the gauge negative result (:mod:`.gauge`).
"""

from ._result import Certificate
from .conditioning import certify_conditioning, certify_drift, run_drift
from .equivariance import certify_equivariance
from .gauge import (
    AttentionProblem,
    certify_gauge,
    certify_gauge_gradient,
    certify_gauge_moves,
    loss_from_module,
    multihead_attention,
)
from .muon import MUON_ROWS, MuonColumn, muon_columns, run_muon_certificates
from .optimizers import OptimizerColumn, column_by_name, default_columns, stiefel_adam_column
from .scale import certify_scale_invariance, certify_scale_with_eps
from .steepest import certify_first_step, certify_projection, certify_retraction_order, certify_step_direction
from .suite import ROWS, run_certificates
from .table import format_markdown, format_text, stiefel_adam_failures, to_json, to_records
from .weight_decay import (
    certify_coupled_decay,
    certify_decay_gradient,
    certify_decay_in_retraction,
    certify_decay_training,
    certify_point_decay,
)

__all__ = [
    "MUON_ROWS",
    "MuonColumn",
    "muon_columns",
    "run_muon_certificates",
    "Certificate",
    "OptimizerColumn",
    "default_columns",
    "column_by_name",
    "stiefel_adam_column",
    "run_certificates",
    "ROWS",
    "certify_projection",
    "certify_step_direction",
    "certify_first_step",
    "certify_retraction_order",
    "certify_scale_invariance",
    "certify_scale_with_eps",
    "run_drift",
    "certify_conditioning",
    "certify_drift",
    "certify_equivariance",
    "certify_decay_gradient",
    "certify_coupled_decay",
    "certify_point_decay",
    "certify_decay_in_retraction",
    "certify_decay_training",
    "certify_gauge",
    "certify_gauge_gradient",
    "certify_gauge_moves",
    "loss_from_module",
    "multihead_attention",
    "AttentionProblem",
    "format_text",
    "format_markdown",
    "to_records",
    "to_json",
    "stiefel_adam_failures",
]
