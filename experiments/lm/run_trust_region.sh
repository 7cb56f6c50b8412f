#!/usr/bin/env bash
# Issue 40, item 1: is training no worse with the trust region in the frame's own units? The stiefel arm of the
# frame-step study's language models (experiments/lm/configs/frame-step.args, frame lr = the model's 1e-3) at
# width 128 (4 heads) and 256 (8 heads), head size 32, seeds 0 and 1, trained twice on one commit and one CPU:
# with the default radius (--trust-region auto: 1 under match_rms_adamw) and with the radius the same flag meant
# before (0.1 sqrt(d r) in frame units: 6.4 at 128 x 32, 9.05 at 256 x 32). Runs go to OUT/<width>-<radius>/.
#
# Usage: experiments/lm/run_trust_region.sh COMMIT WORKTREE OUT
#   (e.g. HEAD /work/wt40 experiments/lm/records/trust-region); resumes from checkpoints when rerun.
set -euo pipefail
usage() { echo "run_trust_region.sh: $1 (usage: run_trust_region.sh COMMIT WORKTREE OUT)" >&2; exit 2; }
[[ $# -eq 3 ]] || usage "expected COMMIT WORKTREE OUT"
repo=$(git rev-parse --show-toplevel)
sha=$(git -C "$repo" rev-parse --verify --quiet "$1^{commit}") || usage "COMMIT $1: no such commit"
tree=$2 out=$(realpath -m "$3")
[[ -e $tree ]] || git -C "$repo" worktree add --detach "$tree" "$sha" >&2
[[ $(git -C "$tree" rev-parse HEAD) == "$sha" ]] || usage "WORKTREE $tree: is not a checkout of $1"
[[ -z $(git -C "$tree" status --porcelain --untracked-files=no) ]] || usage "WORKTREE $tree: has uncommitted changes"
cd "$tree"
flags=$(grep -v -e '^#' -e '^--frame-lrs' -e '^--arms' experiments/lm/configs/frame-step.args)
mkdir -p "$out"
run() {  # run WIDTH HEADS SEED NAME RADIUS
  echo "=== w$1-$4 seed $3 (trust region $5) at $(date -u +%FT%TZ) on ${sha:0:12}" | tee -a "$out/log.txt"
  # shellcheck disable=SC2086
  python -m experiments lm $flags --arms stiefel --width "$1" --heads "$2" --seeds "$3" --trust-region "$5" \
      --out "$out/w$1-$4" --workers 1 --threads 1 --quiet 2>&1 | grep -v -i "warn" | tee -a "$out/log.txt"
}
for seed in 0 1; do
  run 128 4 "$seed" auto auto
  run 128 4 "$seed" old 6.4
  run 256 8 "$seed" auto auto
  run 256 8 "$seed" old 9.0510
done
echo "=== done at $(date -u +%FT%TZ)" | tee -a "$out/log.txt"
