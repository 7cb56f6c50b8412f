#!/usr/bin/env bash
# Train a grokking study seed by seed (every arm of one seed, then the next seed), so that paired seeds finish
# together and their records can be committed as they come. Rerunning resumes from the runs' checkpoints.
#
# Usage: experiments/grokking/run_seeds.sh OUT ARGS_FILE FIRST_SEED LAST_SEED [more grokking flags...]
# e.g.   experiments/grokking/run_seeds.sh experiments/grokking/records/p97_add_arms10 \
#            experiments/grokking/configs/arms.args 0 9
set -euo pipefail
out=${1:?output folder}; args_file=${2:?flags file}; first=${3:?first seed}; last=${4:?last seed}
shift 4
mkdir -p "$out"
# shellcheck disable=SC2046
for seed in $(seq "$first" "$last"); do
  echo "=== seed $seed at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  python -m experiments grokking $(grep -v '^#' "$args_file") --seeds "$seed" --out "$out" \
      --workers 1 --threads 1 --quiet --skip-report "$@" 2>&1 | grep -v -i "warn" | tee -a "$out/log.txt"
done
echo "=== seeds $first-$last done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
