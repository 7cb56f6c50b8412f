#!/usr/bin/env bash
# Advance every (arm, seed) run of a grokking study in lockstep rounds, rebuilding report.md, summary.json and
# the plots after each round, until every run is complete or the time budget is spent. Rerunning the same
# command resumes exactly where it stopped (each run folder holds its checkpoint).
#
# Usage: experiments/grokking/run_lockstep.sh OUT MAX_MINUTES ROUND_EPOCHS [grokking flags...]
# e.g.   experiments/grokking/run_lockstep.sh experiments/grokking/records/p97_add 60 500 --seeds 0 1 2
set -euo pipefail
out=${1:?output folder}; max_minutes=${2:?time budget in minutes}; round=${3:?epochs per run per round}
shift 3
mkdir -p "$out"
deadline=$((SECONDS + 60 * max_minutes))
while :; do
  echo "=== round at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  python -m experiments grokking --out "$out" --workers 1 --threads 1 --quiet \
      --stop-after-epochs "$round" "$@" 2>&1 | grep -v -i "warn" | tee -a "$out/log.txt" | tee "$out/.last_round"
  if ! grep -q "stopped before the end" "$out/.last_round"; then
    echo "=== all runs complete" | tee -a "$out/log.txt"; break
  fi
  if (( SECONDS >= deadline )); then
    echo "=== time budget of $max_minutes min spent; rerun the same command to continue" | tee -a "$out/log.txt"; break
  fi
done
