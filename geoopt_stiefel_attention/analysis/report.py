"""Deprecated: the certificate table moved to :mod:`geoopt_stiefel_attention.analysis.table`.

In this project a *report* is a study's report (:mod:`geoopt_stiefel_attention.experiments.report`); the
certificates' rendering is a table. Importing this module warns and gives the same functions.
"""

import warnings

from .table import *  # noqa: F403
from .table import OUR_COLUMN, __all__  # noqa: F401

warnings.warn("geoopt_stiefel_attention.analysis.report is deprecated; import "
              "geoopt_stiefel_attention.analysis.table (the certificate table)", DeprecationWarning, stacklevel=2)
