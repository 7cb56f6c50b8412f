#!/usr/bin/env bash
# Issue 38, strict pairing: the arm adamw-qk-nodecay was trained on an AMD EPYC (AVX2) at commit 4b22ec5, the
# committed adamw and adamw-frozen runs on an Intel Xeon (AVX-512), and the two CPUs' trajectories part after about
# 20 epochs (repro/). This script retrains adamw and adamw-frozen on the commit and CPU kind of the new arm, so that
# its two contrasts pair runs of one machine kind. adamw seeds 0 and 1 already exist from that commit and CPU
# (repro/adamw) and are reused; the others go to same_cpu/<arm>/seed<k>, JOBS at a time (one core each).
#
# Usage: experiments/grokking/run_same_cpu.sh WORKTREE [JOBS]   (a worktree of 4b22ec5; created if missing)
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
commit=4b22ec503e46fd472cc6c23c3535561179a3be0d
wt=${1:?worktree folder}; jobs=${2:-1}
records=$repo/experiments/grokking/records/p97_add_arms10
[ -d "$wt" ] || git -C "$repo" worktree add --detach "$wt" "$commit"
[ "$(git -C "$wt" rev-parse HEAD)" = "$commit" ] || { echo "worktree $wt is not at $commit" >&2; exit 2; }
[ -z "$(git -C "$wt" status --porcelain --untracked-files=no)" ] || { echo "worktree $wt is not clean" >&2; exit 2; }
grep -q "AMD EPYC" /proc/cpuinfo || { echo "this machine is not an AMD EPYC: the pairing needs the new arm's CPU" >&2; exit 2; }
# shellcheck source=experiments/grokking/_train_in_worktree.sh
source "$repo/experiments/grokking/_train_in_worktree.sh"
out=$wt/same_cpu_train
flags=$(study_flags)
queue=("adamw-frozen 0 $records/same_cpu" "adamw-frozen 1 $records/same_cpu")
for seed in $(seq 2 9); do queue+=("adamw $seed $records/same_cpu" "adamw-frozen $seed $records/same_cpu"); done
run_queue "$jobs" "${queue[@]}"
echo "=== done at $(date -u +%FT%TZ)"
