#!/usr/bin/env bash
# The controls study (issue 42): six arms (adamw, adamw-qknorm, muon, stiefel, stiefeladam-muon, stiefelmuon-muon),
# each tuned on validation (coarse grid, extension to a bracketed optimum, refinement at x sqrt(3), warm-up 400 for
# adamw and adamw-qknorm), then the final cell of 10 paired seeds read once on test, the timing pass, the report.
# The stages and their order: experiments/lm/controls.py; grids and flags: experiments/lm/configs/controls.args.
#
# Usage: [STUDY=level] experiments/lm/run_controls.sh COMMIT WORKTREE [JOBS]
#   STUDY (default controls) picks the args file experiments/lm/configs/$STUDY.args and the records folder
#   experiments/lm/records/$STUDY/: "level" is the level-ground study of issue 57 (its successor; the planner
#   refuses controls.args now, whose warm-up variant left out four arms).
#   Trains on COMMIT (must be clean) checked out in WORKTREE (created with `git worktree add` when missing), JOBS
#   runs side by side (one call per run, one torch thread each; default 1); records go to experiments/lm/records/controls/ of this
#   checkout. Resumable: rerun it and it skips the runs already recorded and continues. The plan (which runs are
#   missing) and the report are made by this checkout's code, which reads records and trains nothing, so a fix to
#   the planner or the report applies without a new training commit; every run records the commit that trained it.
#   Before each plan, `python -m experiments.lm.carry final` copies the final runs of another study that may join this
#   one's (the args file's '# carry-final <study>' line; experiments/lm/carry.py says when they may).
# DRY_RUN=1 lists the stages and the runs each would train now (stages that wait on results say so); trains nothing.
# Never start two copies on one folder.
set -euo pipefail
usage() { echo "run_controls.sh: $1 (usage: run_controls.sh COMMIT WORKTREE [JOBS])" >&2; exit 2; }
[[ $# -ge 2 && $# -le 3 ]] || usage "expected COMMIT WORKTREE [JOBS]"
commit=$1 tree=$2 jobs=${3:-1}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || usage "JOBS $jobs: must be a positive int"
repo=$(git rev-parse --show-toplevel)
sha=$(git -C "$repo" rev-parse --verify --quiet "$commit^{commit}") || usage "COMMIT $commit: no such commit"
study=${STUDY:-controls}
[[ $study =~ ^[a-z][a-z0-9-]*$ && -f $repo/experiments/lm/configs/$study.args ]] \
  || usage "STUDY $study: no experiments/lm/configs/$study.args"
out=$repo/experiments/lm/records/$study
if [[ ${DRY_RUN:-0} == 1 ]]; then
  cd "$repo"
  exec python -m experiments.lm.controls plan "$out" "experiments/lm/configs/$study.args"
fi
if [[ ! -e $tree ]]; then
  git -C "$repo" worktree add --detach "$tree" "$sha" >&2
fi
[[ $(git -C "$tree" rev-parse HEAD 2>/dev/null) == "$sha" ]] || usage "WORKTREE $tree: is not a checkout of $commit"
[[ -z $(git -C "$tree" status --porcelain --untracked-files=no) ]] || usage "WORKTREE $tree: has uncommitted changes"
cd "$tree"
args=experiments/lm/configs/$study.args
flags=$(grep -v '^#' "$args")
mkdir -p "$out"
lm() {
  echo "=== lm $* at $(date -u +%FT%TZ) on ${sha:0:12}" | tee -a "$out/log.txt"
  # shellcheck disable=SC2086
  python -m experiments lm $flags --workers 1 --threads 1 --quiet "$@" 2>&1 | tee -a "$out/log.txt"
}
# until the call just started has appended its command line (as the harness records it) to its folder's study.json
# (at most 2 minutes), so that no two calls read and rewrite that file at once
recorded() {
  local folder=${1#--out } want
  folder=${folder%% *}
  # shellcheck disable=SC2086
  want="python -m experiments lm $(echo $flags) --workers 1 --threads 1 --quiet $1"
  for _ in $(seq 600); do
    grep -qF -- "\"$want\"" "$folder/study.json" 2>/dev/null && return 0
    sleep 0.2
  done
}
last=
# before each plan: the final runs of another study that may join this one's final cell (a '# carry-final' line in
# this checkout's args file; experiments/lm/carry.py), copied once the plan reaches the final cell
carry() { (cd "$repo" && python -m experiments.lm.carry final "$out" "experiments/lm/configs/$study.args") | tee -a "$out/log.txt"; }
while true; do
  carry || { echo "run_controls.sh: the carry step failed (above); nothing more is trained" >&2; exit 1; }
  calls=$(cd "$repo" && python -m experiments.lm.controls next --per-run "$out" "$tree/$args") \
    || { echo "run_controls.sh: the planner failed (above); nothing more is trained" >&2; exit 1; }
  [[ -n $calls ]] || break
  if [[ $calls == "$last" ]]; then
    echo "run_controls.sh: the same calls again after training them; see $out/log.txt" >&2
    exit 1
  fi
  # one call per run, JOBS of them at once: a stage whose calls hold different numbers of runs leaves no worker idle
  failed=$(mktemp)
  rm -f "$failed"
  while IFS= read -r call; do
    while (( $(jobs -rp | wc -l) >= jobs )); do wait -n || true; done
    # shellcheck disable=SC2086
    { lm $call || touch "$failed"; } &
    recorded "$call"
  done <<< "$calls"
  wait
  [[ ! -e $failed ]] || { rm -f "$failed"; echo "run_controls.sh: a training call failed; see $out/log.txt" >&2; exit 1; }
  last=$calls
done
(cd "$repo" && python -m experiments lm --report-only --out "$out")
echo "=== done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
