"""``stiefel-attention bench muon``, and the issue-41 choice of the earlier solver's setting (committed table)."""

import json

import torch

from geoopt_stiefel_attention.bench.muon import SolverRow, cheapest_setting, format_solver_table
from geoopt_stiefel_attention.optim import DEFAULT_DIRECTION_TOL


def _row(width, dual, ns, gap, ms):
    return SolverRow(width, width, width // 4, dual, ns, gap, gap / 2, ms)


def test_cheapest_setting_meets_the_target_at_every_width():
    rows = [_row(128, 4, 8, 2e-3, 10.0), _row(512, 4, 8, 5e-4, 40.0),  # fails at 128
            _row(128, 8, 8, 8e-4, 14.0), _row(512, 8, 8, 4e-4, 60.0),
            _row(128, 12, 8, 5e-4, 18.0), _row(512, 12, 8, 3e-4, 80.0)]
    assert cheapest_setting(rows) == (8, 8)
    assert "**(default)**" in format_solver_table(rows).splitlines()[4]
    # companion: with a target no setting meets everywhere there is no default to choose
    assert cheapest_setting(rows, target=4e-4) is None


def test_bench_muon_cli_writes_times_and_ratios(tmp_path, cli_status):
    out = tmp_path / "muon.json"
    assert cli_status(["bench", "muon", "--scale", "tiny", "--out", str(out), "--json"]) == 0
    doc = json.loads(out.read_text())
    (res,) = doc["results"]
    assert set(res["times_ms"]) == {"stiefel-muon", "stiefel-adam", "torch-muon", "adamw"}
    assert all(t > 0 for t in res["times_ms"].values())
    assert res["ratios"]["torch-muon"] == res["times_ms"]["stiefel-muon"] / res["times_ms"]["torch-muon"]
    assert res["direction_tol"] == DEFAULT_DIRECTION_TOL[torch.float32]
    assert (res["dual_steps"], res["ns_steps"]) == (None, None)  # the fields of results committed before issue 56


def test_the_muon_tables_in_the_benchmarks_readme_are_the_committed_results():
    """benchmarks/README.md's solver table and StiefelMuon step table are format_solver_table of
    results/muon_solver_table_cpu.json and format_muon_table of results/muon_step_cpu.json, line for line; the
    default setting the file names is the one cheapest_setting picks from its rows."""
    import json
    from pathlib import Path

    from geoopt_stiefel_attention.bench.muon import (
        MuonStepResult,
        SolverRow,
        cheapest_setting,
        format_muon_table,
        format_solver_table,
    )

    root = Path(__file__).resolve().parents[1]
    results = root / "benchmarks" / "results"
    lines = (root / "benchmarks" / "README.md").read_text().splitlines()
    solver = json.loads((results / "muon_solver_table_cpu.json").read_text())
    rows = [SolverRow(**r) for r in solver["rows"]]
    assert list(cheapest_setting(rows)) == list(solver["cheapest"])
    step = json.loads((results / "muon_step_cpu.json").read_text())
    step = step["results"] if isinstance(step, dict) else step
    for table in (format_solver_table(rows), format_muon_table([MuonStepResult(**r) for r in step])):
        assert len(table.splitlines()) > 2 and all(line in lines for line in table.splitlines())
