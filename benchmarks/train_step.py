"""Full training-step time (forward, backward, optimizer) of the stiefel arm against the adamw arm for
TinyTransformer and PatchViT.

A thin wrapper around :func:`geoopt_stiefel_attention.bench.train_step_benchmark`; the same as
``stiefel-attention bench train``. Example::

    python benchmarks/train_step.py --threads 1 --clock cpu --rounds 9
"""

import sys

from geoopt_stiefel_attention.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
