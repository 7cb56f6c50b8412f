#!/usr/bin/env bash
# The prepared accelerator check of issue #18, meant to finish in a few minutes on one GPU. First the library
# (`stiefel-attention bench gpu`): the StiefelAdam step against AdamW(fused=True) and geoopt-radam at the
# largest step-benchmark configuration in float32 and bfloat16; the default and compiled step against the
# product floor on the bench shape; a bf16-autocast training step (stiefel vs adamw arm). Then the studies'
# figure (`python -m experiments.grokking.speed`): grokking epochs per second, added to the same
# JSON file (default benchmarks/results/gpu_check_<UTC time>.json).
#
#   benchmarks/gpu.sh                         # on cuda
#   benchmarks/gpu.sh --out /tmp/check.json   # any option of `stiefel-attention bench` is passed on;
#   benchmarks/gpu.sh --device cpu --scale tiny --compile-backend aot_eager   # the smoke test the suite runs
set -euo pipefail
cd "$(dirname "$0")/.."
out="benchmarks/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ).json"
python -m geoopt_stiefel_attention bench gpu --device cuda --out "$out" "$@"
python -m experiments.grokking.speed --device cuda --out "$out" "$@"
