#!/usr/bin/env bash
# The scale point (issue 57, item 8): adamw-qknorm, the frames arm, muon and stiefelmuon-muon at the controls
# study's recipes on a model 30x its parameters, the same corpus and the same tokens for every arm, on one GPU in
# about 8 minutes; then summary.json and report.md. Flags, recipes and the frames arm:
# experiments/lm/configs/scale.args; the plan, the checks and the report: experiments/lm/scale.py.
#
# Usage: experiments/lm/run_scale.sh [OUT]   (default experiments/lm/records/scale)
#   Refused in one line (exit 2), before anything is written, when torch sees no GPU, when the corpus is not the
#   reference study's (by SHA-256) or when the args file's recipes are not the reference's selection.
#   Resumable: rerun it and it continues from the runs' checkpoints (finished runs are kept as they are). Ctrl-C or
#   `timeout -s INT SECONDS` stops the runs at their next evaluation, checkpointed, and still writes the report.
# SCALE_ARGS=FILE reads the flags and recipes from FILE instead (the test suite's tiny config).
# SCALE_DEVICE=cpu trains on the CPU (the smoke test; the full config would take many hours there); default cuda.
# SCALE_CORPUS_ROOT=DIR reads the corpus from DIR (`python -m experiments.lm.scale pack-corpus DIR` on a machine
#   with the reference's Python makes it; a GPU machine with another Python needs it).
# JOBS=N trains N arms side by side (default 4: all at once on the one GPU, where a launch-bound step leaves it
#   idle most of the time); each gets nproc/N torch threads. PYTHON (default python3) runs the Python steps.
# DRY_RUN=1 prints the plan (parameters, tokens, recipes) and trains nothing.
set -euo pipefail
usage() { echo "run_scale.sh: $1 (usage: run_scale.sh [OUT])" >&2; exit 2; }
[[ $# -le 1 ]] || usage "expected at most one argument, OUT"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
out=${1:-experiments/lm/records/scale}
args=${SCALE_ARGS:-experiments/lm/configs/scale.args}
device=${SCALE_DEVICE:-cuda}
jobs=${JOBS:-4}
py=${PYTHON:-python3}
[[ -f $args ]] || usage "SCALE_ARGS $args: no such file"
[[ $jobs =~ ^[1-9][0-9]*$ ]] || usage "JOBS $jobs: must be a positive int"
[[ $device =~ ^(cpu|cuda(:[0-9]+)?)$ ]] || usage "SCALE_DEVICE $device: must be cpu, cuda or cuda:N"
if [[ ${DRY_RUN:-0} == 1 ]]; then
  exec "$py" -m experiments.lm.scale plan "$args"
fi
corpus=()
[[ -z ${SCALE_CORPUS_ROOT:-} ]] || corpus=(--corpus-root "$SCALE_CORPUS_ROOT")
# the checks (device, corpus, recipes) and one line "<arm> <lm flags>" per arm; a refusal is its one line, exit 2
calls=$("$py" -m experiments.lm.scale calls "$out" "$args" --device "$device" "${corpus[@]}") || exit 2
flags=$(grep -v '^#' "$args")
threads=$(( $(nproc) / jobs )); (( threads >= 1 )) || threads=1
mkdir -p "$out"
echo "=== scale point: $(wc -l <<< "$calls") arms, $jobs at a time, on $device, from $args at $(date -u +%FT%TZ)" \
  | tee -a "$out/log.txt"
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
train() {  # train ARM FLAGS...: one lm call, its output in OUT/log-ARM.txt
  local arm=$1; shift
  trap 'true' INT TERM  # (in this background subshell) outlive Ctrl-C: wait for the run to checkpoint and stop
  echo "=== $arm started at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  # shellcheck disable=SC2086
  if "$py" -m experiments lm $flags --workers 1 --threads "$threads" --quiet --skip-report "$@" \
      > "$out/log-$arm.txt" 2>&1 < /dev/null; then
    echo "=== $arm done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
  else
    echo "=== $arm FAILED at $(date -u +%FT%TZ): see $out/log-$arm.txt" | tee -a "$out/log.txt"
    echo "$arm" >> "$failures"
  fi
}
# Ctrl-C (or `timeout -s INT`, which signals the whole process group) stops every run at its next evaluation with a
# checkpoint (the study's own handling); this script then starts no more arms, waits for the runs to stop and
# writes the report of what is on record, so a time limit still leaves complete records and a report
interrupted=0
trap 'interrupted=1' INT TERM
while read -r arm call; do
  while (( $(jobs -rp | wc -l) >= jobs )); do wait -n || true; done
  (( ! interrupted )) || break
  # shellcheck disable=SC2086
  train "$arm" $call &
done <<< "$calls"
while (( $(jobs -rp | wc -l) > 0 )); do wait || true; done
"$py" -m experiments.lm.scale report "$out" "$args" | tee -a "$out/log.txt"
echo "=== done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
if (( interrupted )); then
  echo "run_scale.sh: interrupted; the runs stopped at a checkpoint: rerun the same command to resume" >&2
  exit 130
fi
if [[ -s $failures ]]; then
  echo "run_scale.sh: $(paste -sd, "$failures" | sed 's/,/, /g') failed (see $out/log-<arm>.txt); rerun to resume" >&2
  exit 1
fi
