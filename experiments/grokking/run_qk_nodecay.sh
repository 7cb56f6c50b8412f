#!/usr/bin/env bash
# Issue 38: the arm adamw-qk-nodecay joins the five-arm grokking study (runs/p97_add_arms10), trained on ONE clean
# commit in a worktree of it. First the two reproduction runs (adamw seeds 0 and 1, retrained on that commit and
# compared with their committed records to TRAJECTORY_RTOL of tests/conftest.py), then the new arm's ten seeds,
# JOBS at a time (one core each). Finished records of the new arm are copied to the study's folder; the reproduction
# runs go to the study's repro/ folder (they never replace the committed records).
#
# Usage: experiments/grokking/run_qk_nodecay.sh COMMIT WORKTREE [JOBS]   (e.g. abc1234 /tmp/grok38 2)
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
commit=${1:?commit to train on}; wt=${2:?worktree folder}; jobs=${3:-2}
records=$repo/experiments/grokking/records/p97_add_arms10
[ -d "$wt" ] || git -C "$repo" worktree add --detach "$wt" "$commit"
[ -z "$(git -C "$wt" status --porcelain)" ] || { echo "worktree $wt is not clean" >&2; exit 2; }
out=$wt/experiments/grokking/records/p97_add_arms10_train
flags=$(grep -v '^#' "$wt/experiments/grokking/configs/arms.args" | grep -v '^--arms')
train() {  # ARM SEED DEST: train in the worktree, then copy the finished run's records to DEST
  local arm=$1 seed=$2 dest=$3
  # shellcheck disable=SC2086
  (cd "$wt" && PYTHONPATH=$wt python -m geoopt_stiefel_attention grokking $flags --arms "$arm" --seeds "$seed" \
      --out "$out" --workers 1 --threads 1 --quiet --skip-report 2>&1 | grep -v -i warn || true)
  local run=$out/runs/$arm/seed$seed
  if [ -f "$run/metrics.jsonl" ] && tail -n 1 "$run/metrics.jsonl" | grep -q '"epoch": 6000,'; then
    mkdir -p "$dest/$arm/seed$seed"
    cp "$run"/{metrics.jsonl,config.json,environment.json} "$dest/$arm/seed$seed/"
    echo "finished $arm seed $seed -> $dest/$arm/seed$seed at $(date -u +%FT%TZ)"
  fi
}
queue=("adamw 0 $records/repro" "adamw 1 $records/repro")
for seed in $(seq 0 9); do queue+=("adamw-qk-nodecay $seed $records/runs"); done
for item in "${queue[@]}"; do
  read -r arm seed dest <<<"$item"
  [ -f "$dest/$arm/seed$seed/metrics.jsonl" ] && continue
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  echo "=== $arm seed $seed at $(date -u +%FT%TZ) on $(git -C "$wt" rev-parse --short HEAD)"
  train "$arm" "$seed" "$dest" &
done
wait
echo "=== done at $(date -u +%FT%TZ)"
