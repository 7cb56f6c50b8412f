#!/usr/bin/env bash
# Resume the five-arm grokking study of issue 27 (runs/p97_add_arms10) where its committed records stop, on the
# commit it trains on: d12c680 (724a9cb, where its first runs were trained, plus the adamw-frozen arm). Trains
# only the (arm, seed) runs that have no committed records, JOBS at a time (one core each), in a worktree of
# that commit, and copies each finished run's records (metrics.jsonl, config.json, environment.json) back here.
# Commit them as they come; rebuild the report with
#   python -m experiments grokking --report-only --out experiments/grokking/records/p97_add_arms10
#
# Usage: experiments/grokking/resume_arms10.sh WORKTREE [JOBS]   (e.g. /tmp/grok27 2)
#        DRY_RUN=1 experiments/grokking/resume_arms10.sh WORKTREE   lists the runs it would train, and trains nothing
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
wt=${1:?worktree folder for commit d12c680}
jobs=${2:-2}
records=$repo/experiments/grokking/records/p97_add_arms10
[ -d "$wt" ] || [ "${DRY_RUN:-0}" = 1 ] || git -C "$repo" worktree add --detach "$wt" d12c680
out=$wt/experiments/grokking/runs/p97_add_arms10
flags=$(git -C "$repo" show d12c680:experiments/grokking/configs/arms.args | grep -v '^#' | grep -v '^--arms')
# shellcheck source=experiments/grokking/_train_in_worktree.sh
source "$repo/experiments/grokking/_train_in_worktree.sh"
train() { train_in_worktree "$1" "$2" "$records/runs"; }  # ARM SEED: train in the worktree, copy the records back
for seed in $(seq 0 9); do
  for arm in adamw stiefel stiefel-frozen adamw-orthostart adamw-frozen; do
    [ -f "$records/runs/$arm/seed$seed/metrics.jsonl" ] && continue
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "would train $arm seed $seed"; continue; fi
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    echo "=== $arm seed $seed at $(date -u +%FT%TZ)"
    train "$arm" "$seed" &
  done
done
wait
[ "${DRY_RUN:-0}" = 1 ] && exit 0
# the commands the worktree's study.json recorded join the committed ones (for the report's "Run" section)
python3 - "$out/study.json" "$records/study.json" <<'PY'
import json, sys
new, old = (json.load(open(p)) if __import__("os").path.exists(p) else {"commands": []} for p in sys.argv[1:])
old["commands"] += [c for c in new["commands"] if c not in old["commands"]]
open(sys.argv[2], "w").write(json.dumps(old, indent=2) + "\n")
PY
echo "=== done at $(date -u +%FT%TZ)"
