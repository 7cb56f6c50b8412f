"""``python -m experiments <study> [flags]``: run a study from a checkout (see :mod:`experiments.cli`)."""

import sys

from experiments.cli import main

if __name__ == "__main__":  # importing the module (autosummary, documentation tools) runs nothing
    sys.exit(main())
