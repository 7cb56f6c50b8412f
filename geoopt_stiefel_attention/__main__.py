"""``python -m geoopt_stiefel_attention`` runs the ``stiefel-attention`` command."""

import sys

from .cli import main

sys.exit(main())
