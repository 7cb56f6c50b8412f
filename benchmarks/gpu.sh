#!/usr/bin/env bash
# The prepared accelerator check of issue #18, meant to finish in a few minutes on one GPU. First the library
# (`stiefel-attention bench gpu`): the StiefelAdam step against AdamW(fused=True) and geoopt-radam at the
# largest step-benchmark configuration in float32 and bfloat16; the default and compiled step against the
# product floor on the bench shape; a bf16-autocast training step (stiefel vs adamw arm); on the bench shape the
# capturable StiefelAdam step eager and replayed from a CUDA graph, StiefelMuon and torch's Muon on the same
# frames (issue #40; off CUDA the graph entry is reported as skipped). Then the studies'
# figure (`python -m experiments.grokking.speed`): grokking epochs per second, added to the same
# JSON file (default benchmarks/results/gpu_check_<UTC time>.json). Last, `stiefel-attention bench muon` at width
# 768 (StiefelMuon, StiefelAdam, torch Muon, AdamW), written beside it as gpu_check_<UTC time>_muon.json.
#
#   benchmarks/gpu.sh                         # on cuda
#   benchmarks/gpu.sh --out /tmp/check.json   # any option of `stiefel-attention bench gpu` is passed on;
#   benchmarks/gpu.sh --device cpu --scale tiny --compile-backend aot_eager   # the smoke test the suite runs
set -euo pipefail
cd "$(dirname "$0")/.."
out="benchmarks/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ).json"
python -m geoopt_stiefel_attention bench gpu --device cuda --out "$out" "$@"
python -m experiments.grokking.speed --device cuda --out "$out" "$@"
# StiefelMuon beside StiefelAdam, torch's Muon on the same frames and AdamW at the widest configuration (issue #41).
# `bench muon` refuses the flags it does not read, so of the caller's options it gets only --device, --threads,
# --scale and --json; --scale tiny (the smoke test: width 128, one round) replaces --widths 768 --rounds 5.
muon_out="${out%.json}_muon.json"
muon_args=()
size=(--widths 768 --rounds 5)
prev=""
for arg in "$@"; do
  case "$prev" in
    --out) muon_out="${arg%.json}_muon.json" ;;  # an --out given by the caller: the muon table goes beside it
    --device|--threads) muon_args+=("$prev" "$arg") ;;
    --scale) if [ "$arg" = tiny ]; then size=(--scale tiny); else size+=(--scale "$arg"); fi ;;
  esac
  case "$arg" in
    --out=*) muon_out="${arg#--out=}"; muon_out="${muon_out%.json}_muon.json" ;;
    --device=*|--threads=*|--json) muon_args+=("$arg") ;;
    --scale=tiny) size=(--scale tiny) ;;
    --scale=*) size+=("$arg") ;;
  esac
  prev="$arg"
done
python -m geoopt_stiefel_attention bench muon --device cuda "${size[@]}" ${muon_args[@]+"${muon_args[@]}"} \
  --out "$muon_out"
