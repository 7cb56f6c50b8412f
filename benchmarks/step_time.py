"""Optimizer-step time of StiefelAdam against AdamW and stock geoopt RiemannianAdam on Q/K frames.

A thin wrapper around :func:`geoopt_stiefel_attention.bench.step_time_benchmark`; the same as
``stiefel-attention bench step``. Example (the README's table)::

    python benchmarks/step_time.py --threads 1 --clock cpu --rounds 9
    python benchmarks/step_time.py --widths 128 256 --json > step_time.json
"""

import sys

from geoopt_stiefel_attention.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "step", *sys.argv[1:]]))
