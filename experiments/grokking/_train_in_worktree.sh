# Sourced by the grokking run scripts: train one (arm, seed) in a worktree of a clean commit and copy the finished
# run's records (metrics.jsonl, config.json, environment.json) to a destination folder.
# Needs: wt (worktree folder), out (its scratch output folder), flags (the study's flags without --arms).
# Works for commits before and after the layout change of issue 39 (python -m geoopt_stiefel_attention grokking,
# then python -m experiments grokking).
train_in_worktree() {  # ARM SEED DEST
  local arm=$1 seed=$2 dest=$3 module=experiments
  [ -f "$wt/experiments/__main__.py" ] || module=geoopt_stiefel_attention
  # shellcheck disable=SC2086
  (cd "$wt" && PYTHONPATH=$wt python -m "$module" grokking $flags --arms "$arm" --seeds "$seed" \
      --out "$out" --workers 1 --threads 1 --quiet --skip-report 2>&1 | grep -v -i warn || true)
  local run=$out/runs/$arm/seed$seed
  if [ -f "$run/metrics.jsonl" ] && tail -n 1 "$run/metrics.jsonl" | grep -q '"epoch": 6000,'; then
    mkdir -p "$dest/$arm/seed$seed"
    cp "$run"/{metrics.jsonl,config.json,environment.json} "$dest/$arm/seed$seed/"
    echo "finished $arm seed $seed -> $dest/$arm/seed$seed at $(date -u +%FT%TZ)"
  fi
}
# the study's flags at the worktree's commit (the arms.args of either layout), without --arms
study_flags() { grep -v '^#' "$(git -C "$wt" ls-files --full-name -- '*grokking/configs/arms.args' | sed "s|^|$wt/|" | head -n 1)" | grep -v '^--arms'; }
# train the queued runs JOBS at a time (one core each), skipping those whose records DEST already holds
run_queue() {  # JOBS "ARM SEED DEST"...
  local jobs=$1 item arm seed dest
  shift
  for item in "$@"; do
    read -r arm seed dest <<<"$item"
    [ -f "$dest/$arm/seed$seed/metrics.jsonl" ] && continue
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    echo "=== $arm seed $seed at $(date -u +%FT%TZ) on $(git -C "$wt" rev-parse --short HEAD)"
    train_in_worktree "$arm" "$seed" "$dest" &
  done
  wait
}
