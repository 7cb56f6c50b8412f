"""``python -m experiments <study> [flags]``: run a study from a checkout (see :mod:`experiments.cli`)."""

import sys

from experiments.cli import main

sys.exit(main())
