#!/usr/bin/env bash
# Tuned against tuned (issue 26): each arm's lr grid (2 seeds per point), then the final cell (each arm at the lr
# its grid selects on validation, 5 paired seeds, read once on test), then the timing pass for the
# equal-wall-clock readout, then the report. Flags and grids: experiments/lm/configs/tuned.args. Every step is
# resumable: rerun the script and it continues where it stopped (finished runs are skipped). Run it on ONE clean
# commit (the report names the commits and marks uncommitted changes).
#
# Usage: experiments/lm/run_tuned.sh OUT [grid|final|timing|report|all]   (e.g. experiments/lm/records/tuned)
# TUNED_ARGS=FILE reads the flags and grids from FILE instead (a smoke test on a tiny model).
# WORKERS=N trains N runs side by side (one process and one torch thread each; default 1). Two on a 2-core machine
# halve the wall time. Never start two copies of this script on one folder: they would collide on the same runs.
# If the final step says an arm's optimum is at a grid edge, add the value it names to that arm's "# grid" line
# in tuned.args and rerun (the grid step trains only the new point).
set -euo pipefail
out=${1:?output folder}
step=${2:-all}
args=${TUNED_ARGS:-experiments/lm/configs/tuned.args}
flags=$(grep -v '^#' "$args")
arms=$(grep '^# grid ' "$args" | awk '{print $3}' | tr '\n' ' ')
lm() {
  echo "=== lm $* at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  # shellcheck disable=SC2086
  python -m experiments lm $flags --out "$out" --workers "${WORKERS:-1}" --threads 1 --quiet "$@" 2>&1 \
      | tee -a "$out/log.txt"
}
mkdir -p "$out"
if [[ $step == grid || $step == all ]]; then
  # Seed by seed, so that every grid point has seed 0 before any has seed 1; arms with the same grid in one call,
  # so that WORKERS runs stay busy across its lrs and arms.
  for seed in 0 1; do
    grep '^# grid ' "$args" | cut -d' ' -f4- | sort -u | while IFS= read -r grid; do
      group=$(grep '^# grid ' "$args" | awk -v g="$grid" '{v=$4; for (i = 5; i <= NF; i++) v = v " " $i} v == g {print $3}')
      # shellcheck disable=SC2086
      lm --arms $group --lrs $grid --seeds "$seed" --skip-report
    done
  done
fi
if [[ $step == final || $step == all ]]; then
  # seeds disjoint from the grid's: the runs that select an lr never report it. One call, so that WORKERS runs stay
  # busy across arms and seeds (a call per seed left a worker idle whenever an arm was already done).
  # shellcheck disable=SC2086
  lm --arms $arms --seeds 0 1 --final-seeds 2 3 4 5 6 --skip-report
fi
if [[ $step == timing || $step == all ]]; then
  # shellcheck disable=SC2086
  [[ -f "$out/timing.json" ]] || lm --arms $arms --seeds 0 1 --time-steps 20 --skip-report
fi
if [[ $step == report || $step == all ]]; then
  python -m experiments lm --report-only --out "$out"
fi
echo "=== done ($step) at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
