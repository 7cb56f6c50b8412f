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
[ -z "$(git -C "$wt" status --porcelain --untracked-files=no)" ] || { echo "worktree $wt is not clean" >&2; exit 2; }
# shellcheck source=experiments/grokking/_train_in_worktree.sh
source "$repo/experiments/grokking/_train_in_worktree.sh"
out=$wt/p97_add_arms10_train
flags=$(study_flags)
queue=("adamw 0 $records/repro" "adamw 1 $records/repro")
for seed in $(seq 0 9); do queue+=("adamw-qk-nodecay $seed $records/runs"); done
run_queue "$jobs" "${queue[@]}"
echo "=== done at $(date -u +%FT%TZ)"
