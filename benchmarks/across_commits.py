"""Time ``stiefel-attention bench`` on several commits in one run, interleaved, to show a change did not slow the step.

Each commit is checked out in its own ``git worktree`` (under ``--trees``, reused when present) and benchmarked in its
own process (``python -m geoopt_stiefel_attention bench ...`` with the worktree first on ``PYTHONPATH``); the commits
take turns, round after round, the order rotating, so that the machine's slow drift hits every commit alike. Within
one process the bench interleaves the frame optimizer with AdamW and stock geoopt as always, so each run's ratios
against them are measured on the same load as its times.

Printed per commit and configuration: the StiefelAdam step's minimum over the runs of its median (ms) and the median
over the runs of its ratio against every competitor the bench timed. Nothing is decided here.

Usage::

    python benchmarks/across_commits.py --commits c4e6a00 HEAD --runs 3 -- step --widths 512 --threads 1 --clock cpu

Everything after ``--`` is passed to ``stiefel-attention bench`` (``--json`` is added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def summarize(runs: Mapping[str, Sequence[Mapping]], frame_optimizer: str = "stiefel") -> list[str]:
    """Lines of the table: per commit and configuration, min of the frame optimizer's medians and median ratios.

    ``runs`` maps a commit label to the bench JSON documents of its runs (``{"results": [{"timings": ..., "ratios":
    ...}]}``, one result per configuration, in the same order for every run).

    A competitor that a run could not time (the bench drops it from that run's ratios, with a note) is summarized over
    the runs that timed it, and the line says over how many (``/geoopt-radam 0.55 (2 of 3 runs)``); runs whose
    configurations differ are refused (``ValueError``), not merged.
    """
    lines = []
    width = max(map(len, runs), default=0)
    for label, docs in runs.items():
        if not docs:
            raise ValueError(f"commit {label}: no runs to summarize")
        keys = ("width", "heads", "head_dim", "model")
        configs = [[{key: r[key] for key in keys if key in r} for r in doc["results"]] for doc in docs]
        for n, config in enumerate(configs[1:], 2):
            if config != configs[0]:
                raise ValueError(f"commit {label}: run {n} timed the configurations {config}, run 1 {configs[0]}; "
                                 f"a line would mix them")
        for k, first in enumerate(docs[0]["results"]):
            config = ", ".join(f"{key} {first[key]}" for key in keys if key in first)
            medians = [doc["results"][k]["timings"][frame_optimizer]["median_ms"] for doc in docs]
            names = dict.fromkeys(name for doc in docs for name in doc["results"][k].get("ratios", {}))
            texts = []
            for name in names:
                values = [doc["results"][k]["ratios"][name] for doc in docs if name in doc["results"][k]["ratios"]]
                some = "" if len(values) == len(docs) else f" ({len(values)} of {len(docs)} runs)"
                texts.append(f"/{name} {statistics.median(values):.2f}{some}")
            ratio_text = "  ".join(texts)
            lines.append(f"{label:>{width}} | {config} | {frame_optimizer} {min(medians):.2f} ms (min of {len(docs)}) | "
                         f"{ratio_text}")
    return lines


def labelled(runs: Mapping[str, Sequence[Mapping]]) -> dict[str, Sequence[Mapping]]:
    """``runs`` (commit as given -> its documents, each with the ``"commit"`` SHA it ran) keyed by the label the
    table prints: the revision as given, followed by its short SHA when it is not one (``HEAD 514f6cb``)."""
    out = {}
    for commit, docs in runs.items():
        sha = docs[0]["commit"] if docs else ""
        out[commit if sha.startswith(commit) else f"{commit} {sha[:7]}"] = docs
    return out


def _sha(commit: str) -> str | None:
    """The full SHA of ``commit`` in this checkout, ``None`` when it names no commit."""
    res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                         capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def _tree(sha: str, trees: Path) -> Path:
    tree = trees / sha[:12]
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    return tree


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", nargs="+", required=True, help="commits to compare (any git revision)")
    parser.add_argument("--runs", type=int, default=3, help="bench processes per commit, interleaved (default 3)")
    parser.add_argument("--trees", type=Path, default=Path("/tmp/gsa-bench-trees"), help="where the worktrees go")
    parser.add_argument("--out", type=Path, help="also write every run's JSON here (one file)")
    a = parser.parse_args(own)
    if a.runs < 1:
        parser.error(f"--runs {a.runs}: must be at least 1")
    if not bench_args:
        parser.error("give the bench arguments after '--', e.g. -- step --widths 512 --threads 1 --clock cpu")
    shas = {commit: _sha(commit) for commit in a.commits}
    missing = [c for c, sha in shas.items() if sha is None]
    if missing:
        parser.error(f"--commits {' '.join(missing)}: no such commit in {REPO}")
    changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.split("\n")
    head = _sha("HEAD")
    for commit, sha in shas.items():
        if sha == head and any(changed):
            print(f"across_commits: {commit} is measured as committed ({sha[:12]}); the uncommitted changes to "
                  f"{len([c for c in changed if c])} tracked file(s) in {REPO} are not measured (commit them to "
                  f"time them)", file=sys.stderr)
    a.trees.mkdir(parents=True, exist_ok=True)
    trees = {commit: (sha, _tree(sha, a.trees)) for commit, sha in shas.items()}
    runs: dict[str, list[dict]] = {commit: [] for commit in a.commits}
    for r in range(a.runs):
        order = a.commits[r % len(a.commits):] + a.commits[:r % len(a.commits)]
        for commit in order:
            sha, tree = trees[commit]
            env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            res = subprocess.run([sys.executable, "-m", "geoopt_stiefel_attention", "bench", *bench_args, "--json"],
                                 cwd=tree, env=env, capture_output=True, text=True)
            if res.returncode:
                print(res.stderr, file=sys.stderr)
                raise SystemExit(f"across_commits: bench failed on {commit} ({sha[:12]}), exit {res.returncode}")
            doc = json.loads(res.stdout[res.stdout.index("{"):])
            doc["commit"] = sha
            runs[commit].append(doc)
            print(f"run {r + 1}/{a.runs}: {commit} ({sha[:12]}) done", file=sys.stderr)
    if a.out:  # before the summary, which may refuse the runs: what was measured is kept
        a.out.write_text(json.dumps(runs, indent=1))
    try:
        lines = summarize(labelled(runs))
    except ValueError as exc:
        raise SystemExit(f"across_commits: {exc}") from None
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
