#!/usr/bin/env bash
# The grokking check of the frame-step rule (issue 25): the stiefel arm with adjust_lr_fn="match_rms_adamw" and
# its frame lr at 1/9, 1/3, 1, 3 and 9 times the model's lr (1e-3), seed 0, the paper's protocol at 6,000 epochs
# evaluated every 10 (as the four-arm study in runs/p97_add_arms10, whose adamw seed 0 is the reference). One
# folder per multiplier; rerunning resumes.
#
# Usage: experiments/grokking/run_frame_step.sh OUT   (e.g. experiments/grokking/records/frame-step)
set -euo pipefail
out=${1:?output folder}
flags=$(grep -v '^#' experiments/grokking/configs/arms.args | grep -v '^--arms')
mkdir -p "$out"
for mu in 1 9 3 0.33333 0.11111; do
  lr=$(python -c "print(f'{$mu * 1e-3:.6g}')")
  echo "=== mu $mu (frame lr $lr) at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  # shellcheck disable=SC2086
  python -m experiments grokking $flags --arms stiefel --adjust-lr-fn match_rms_adamw \
      --frame-lr "$lr" --seeds 0 --out "$out/mu-$mu" --workers 1 --threads 1 --quiet --skip-report 2>&1 \
      | grep -v -i "warn" | tee -a "$out/log.txt"
done
echo "=== done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
