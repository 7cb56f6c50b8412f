"""benchmarks/across_commits.py: the summary it prints from bench JSON documents, and its usage errors (one line
naming the flag, exit 2, nothing benchmarked). The timing itself is not tested (machines are noisy)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "across_commits.py"


@pytest.fixture(scope="module")
def across():
    spec = importlib.util.spec_from_file_location("across_commits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc(ms, ratios):
    return {"results": [{"width": 512, "heads": 8, "head_dim": 64,
                         "timings": {"stiefel": {"median_ms": ms}}, "ratios": ratios}]}


def test_summary_takes_the_minimum_time_and_the_median_ratio_per_commit(across):
    runs = {"old": [_doc(70.0, {"adamw_foreach": 3.5}), _doc(72.0, {"adamw_foreach": 3.1}),
                    _doc(75.0, {"adamw_foreach": 3.3})],
            "new": [_doc(64.0, {"adamw_foreach": 3.0})]}
    lines = across.summarize(runs)
    assert lines == ["old | width 512, heads 8, head_dim 64 | stiefel 70.00 ms (min of 3) | /adamw_foreach 3.30",
                     "new | width 512, heads 8, head_dim 64 | stiefel 64.00 ms (min of 1) | /adamw_foreach 3.00"]
    # companion: a commit without runs is an error, not an empty row
    with pytest.raises(ValueError, match="commit new: no runs"):
        across.summarize({"old": runs["old"], "new": []})


@pytest.mark.parametrize(("args", "flag"), [
    (["--commits", "HEAD", "--runs", "0", "--", "step"], "--runs 0"),
    (["--commits", "HEAD"], "after '--'"),
    (["--commits", "no-such-revision-xyz", "--", "step"], "--commits no-such-revision-xyz: no such commit"),
])
def test_usage_errors_name_the_flag_and_exit_2(tmp_path, args, flag):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--trees", str(tmp_path / "trees"), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "trees").exists()  # nothing checked out


def test_the_committed_issue_39_table_is_the_summary_of_its_records(across):
    """benchmarks/README.md quotes the table of results/step_across_commits_issue39.json as the script prints it."""
    import json

    root = SCRIPT.parents[1]
    runs = json.loads((root / "benchmarks" / "results" / "step_across_commits_issue39.json").read_text())
    lines = across.summarize(across.labelled(runs))
    readme = (root / "benchmarks" / "README.md").read_text()
    assert len(lines) == 4 and all(line in readme for line in lines)
    assert across.labelled({"HEAD": [{"commit": "514f6cb274e6"}], "c4e6a00": [{"commit": "c4e6a005a55d"}]}).keys() \
        == {"HEAD 514f6cb", "c4e6a00"}


def test_a_competitor_missing_from_some_runs_is_summarized_over_the_others_and_said(across):
    """A competitor the bench could not time in one run (dropped from that run's ratios, with a note) was dropped
    from the line without a word when the first run lacked it, and raised KeyError when a later run did. Now its
    ratio is the median over the runs that timed it, and the line says over how many. Companion: a competitor every
    run timed reads as before."""
    full, short = {"adamw_foreach": 3.0, "geoopt-radam": 0.5}, {"adamw_foreach": 3.2}
    for docs in ([_doc(70.0, short), _doc(72.0, full), _doc(71.0, full)],
                 [_doc(70.0, full), _doc(72.0, full), _doc(71.0, short)]):
        (line,) = across.summarize({"c": docs})
        assert line.endswith("| /adamw_foreach 3.00  /geoopt-radam 0.50 (2 of 3 runs)"), line
    (line,) = across.summarize({"c": [_doc(70.0, full), _doc(72.0, full)]})
    assert line.endswith("| /adamw_foreach 3.00  /geoopt-radam 0.50") and "of 2 runs" not in line


def test_runs_of_different_configurations_are_refused_not_merged(across):
    """Runs whose results are other configurations were merged by position (width 256's times and ratios counted
    as width 512's); now a ValueError names the commit and the run. Companion: the same configurations summarize."""
    other = _doc(9.0, {"adamw_foreach": 2.0})
    other["results"][0]["width"] = 256
    with pytest.raises(ValueError, match="commit c: run 2 timed the configurations"):
        across.summarize({"c": [_doc(70.0, {"adamw_foreach": 3.0}), other]})
    assert len(across.summarize({"c": [_doc(70.0, {"adamw_foreach": 3.0}), _doc(9.0, {"adamw_foreach": 2.0})]})) == 1


@pytest.mark.parametrize("dirty", [True, False])
def test_a_dirty_head_is_said_to_be_measured_as_committed(tmp_path, dirty):
    """'--commits HEAD' times HEAD's committed tree in a worktree: uncommitted changes to tracked files (the change
    one usually means to time) were left out without a word. Now one line on stderr says so; companion: a clean
    tree gets no such line. (The bench itself is made to fail at once on an unknown flag: nothing is timed.)"""
    import shutil

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "benchmarks" / "across_commits.py")
    (repo / "tracked.txt").write_text("a\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "benchmarks", "tracked.txt"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    (repo / "untracked.txt").write_text("not a change to a tracked file\n")
    if dirty:
        (repo / "tracked.txt").write_text("b\n")
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "across_commits.py"), "--commits", "HEAD",
                           "--runs", "1", "--trees", str(tmp_path / "trees"), "--", "step", "--no-such-flag"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "bench failed on HEAD" in proc.stderr, proc.stderr
    said = "uncommitted changes to 1 tracked file(s)" in proc.stderr
    assert said == dirty, proc.stderr
    subprocess.run([*git, "worktree", "prune"], capture_output=True)
