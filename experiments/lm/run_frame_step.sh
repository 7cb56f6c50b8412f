#!/usr/bin/env bash
# The frame-step transfer sweep (issue 25): the stiefel arm with adjust_lr_fn="match_rms_adamw" and its frame lr
# at 1/9, 1/3, 1, 3 and 9 times the model's lr (1e-3), next to AdamW, at widths 64, 128 and 256 with head size
# 32, and at width 128 with head size 64. Runs go seed by seed so that every width has seed 0 first; rerunning
# resumes from the checkpoints.
#
# Usage: experiments/lm/run_frame_step.sh OUT   (e.g. experiments/lm/records/frame-step)
set -euo pipefail
out=${1:?output folder}
flags=$(grep -v '^#' experiments/lm/configs/frame-step.args)
run() {  # run NAME SEED WIDTH HEADS
  echo "=== $1 seed $2 at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  # shellcheck disable=SC2086
  python -m experiments lm $flags --width "$3" --heads "$4" --seeds "$2" --out "$out/$1" \
      --workers 1 --threads 1 --quiet --skip-report 2>&1 | grep -v -i "warn" | tee -a "$out/log.txt"
}
mkdir -p "$out"
run w64 0 64 2
run w128 0 128 4
run w256 0 256 8
run w128-h64 0 128 2
run w64 1 64 2
run w128 1 128 4
echo "=== done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
