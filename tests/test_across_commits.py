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
