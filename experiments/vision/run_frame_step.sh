#!/usr/bin/env bash
# The vision check of the frame-step rule (issue 25): the stiefel arm with adjust_lr_fn="match_rms_adamw" and its
# frame lr at 1/9, 1/3, 1, 3 and 9 times the model's lr, seeds 0-2 (or those given), next to AdamW, on the model
# and data of the committed Fashion-MNIST paired study (width 64, depth 2, 4 heads, patch 7, 10,000 training images, 8 epochs).
# Needs Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist) and a DATA_DIR the loader can link
# its files into. One folder per multiplier; rerunning resumes.
#
# Usage: experiments/vision/run_frame_step.sh OUT DATA_DIR [SEED...]
#   e.g. experiments/vision/run_frame_step.sh experiments/vision/records/frame-step /tmp/vis_data 0 1 2
set -euo pipefail
out=${1:?output folder}; data=${2:?data folder}; shift 2
seeds=("$@"); [ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
common=(--dataset fashion-mnist --data-dir "$data" --train-size 10000 --patch-size 7 --width 64 --depth 2
        --heads 4 --mlp 128 --epochs 8 --eval-every 2 --eval-train-size 1000 --seeds "${seeds[@]}" --threads 1
        --workers 1 --quiet --skip-report)
mkdir -p "$out"
echo "=== adamw at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
python -m experiments vision "${common[@]}" --arms adamw --out "$out/adamw" 2>&1 | tee -a "$out/log.txt"
for mu in 1 9 3 0.33333 0.11111; do
  lr=$(python -c "from experiments.vision.study import VisionConfig; print(f'{$mu * VisionConfig().optim.lr:.6g}')")
  echo "=== mu $mu (frame lr $lr) at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  python -m experiments vision "${common[@]}" --arms stiefel --adjust-lr-fn match_rms_adamw \
      --frame-lr "$lr" --out "$out/mu-$mu" 2>&1 | tee -a "$out/log.txt"
done
echo "=== done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
