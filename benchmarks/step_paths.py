"""The StiefelAdam step's paths (default eager, capturable, compiled; row- and column-major frames) against
the six batched d x r x r products alone (the matmul floor).

A thin wrapper around :func:`geoopt_stiefel_attention.bench.step_path_benchmark`; the same as
``stiefel-attention bench paths``. Examples (the README's tables)::

    python benchmarks/step_paths.py --threads 1 --clock cpu --rounds 9
    python benchmarks/step_paths.py --grid full --paths eager capturable eager-colmajor matmul_floor \
        --threads 1 --clock cpu --rounds 5 --steps 3
"""

import sys

from geoopt_stiefel_attention.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "paths", *sys.argv[1:]]))
