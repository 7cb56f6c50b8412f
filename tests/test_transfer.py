"""The frame-step transfer report (experiments.transfer): optimum location, bracketing, grid distance."""

from __future__ import annotations

import json
import math

import pytest

from experiments.cli import main
from experiments.lm.transfer import collect_shapes, summarize_transfer, transfer_report

LR = 1e-3
MULTIPLIERS = (1 / 9, 1 / 3, 1.0, 3.0, 9.0)


def _run(folder, arm, seed, width, heads, frame_lr, final_bpb, epochs=2):
    run = folder / "runs" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    config = {"width": width, "heads": heads, "depth": 2, "steps_per_epoch": 10,
              "train": {"epochs": epochs, "eval_every": 1},
              "optim": {"lr": LR, "frame_lr": frame_lr, "adjust_lr_fn": "match_rms_adamw"}}
    (run / "config.json").write_text(json.dumps({"config": config}))
    lines = [{"arm": arm, "seed": seed, "epoch": e, "val_bpb": final_bpb + (epochs - e)} for e in range(epochs + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _shape(root, name, width, heads, curve, seeds=(0, 1), adamw=3.0):
    """A shape whose stiefel final bpb is curve(multiplier) + 0.01 * seed."""
    folder = root / name
    for seed in seeds:
        _run(folder, "adamw", seed, width, heads, None, adamw + 0.01 * seed)
        _run(folder, "stiefel", seed, width, heads, None, curve(1.0) + 0.01 * seed)
        for m in MULTIPLIERS:
            if m != 1.0:
                _run(folder / f"frame-lr-{m * LR:g}", "stiefel", seed, width, heads, m * LR, curve(m) + 0.01 * seed)


def test_optimum_bracketing_and_distance_of_the_default(tmp_path):
    _shape(tmp_path, "w64", 64, 2, lambda m: 2.0 + (math.log(m / 3.0)) ** 2)      # optimum at 3: one point away
    _shape(tmp_path, "w128", 128, 4, lambda m: 2.0 + (math.log(m)) ** 2)           # optimum at 1
    _shape(tmp_path, "w256", 256, 8, lambda m: 2.0 - math.log(m), seeds=(0,))       # at the edge: not bracketed
    summary = summarize_transfer(collect_shapes(tmp_path))
    by = {s["name"]: s for s in summary["shapes"]}
    assert [s["name"] for s in summary["shapes"]] == ["w64", "w128", "w256"]
    assert by["w64"]["best_multiplier"] == pytest.approx(3.0) and by["w64"]["bracketed"]
    assert by["w64"]["default_grid_distance"] == pytest.approx(1.0)
    assert by["w64"]["default_loss_bpb"] == pytest.approx(math.log(3.0) ** 2)
    assert by["w128"]["best_multiplier"] == pytest.approx(1.0) and by["w128"]["default_grid_distance"] == 0
    assert by["w128"]["best_minus_adamw"] == pytest.approx(-1.0)  # means over seeds 0 and 1 on both sides
    # companion: an optimum at the largest multiplier is reported as not bracketed
    assert by["w256"]["best_multiplier"] == pytest.approx(9.0) and by["w256"]["bracketed"] is False
    assert by["w256"]["seeds"] == ["0"] and by["w128"]["head_size"] == 32


def test_a_shape_with_fewer_than_three_multipliers_is_not_called_bracketed_or_at_an_edge(tmp_path):
    folder = tmp_path / "w64"
    _run(folder, "adamw", 0, 64, 2, None, 3.0)
    _run(folder, "stiefel", 0, 64, 2, None, 2.5)
    _run(folder / "frame-lr-0.003", "stiefel", 0, 64, 2, 3 * LR, 2.4)
    s = summarize_transfer(collect_shapes(tmp_path))["shapes"][0]
    assert s["best_multiplier"] == pytest.approx(3.0) and s["bracketed"] is None
    assert s["default_grid_distance"] is None and s["best_minus_adamw"] is None
    # companion: a third multiplier on the low side leaves the best at the top edge, which is then said
    _run(folder / "frame-lr-0.0003", "stiefel", 0, 64, 2, 0.3 * LR, 2.6)
    s = summarize_transfer(collect_shapes(tmp_path))["shapes"][0]
    assert s["bracketed"] is False


def test_only_seeds_present_at_every_multiplier_are_averaged(tmp_path):
    _shape(tmp_path, "w64", 64, 2, lambda m: 2.0 + (math.log(m)) ** 2, seeds=(0,))
    _run(tmp_path / "w64", "stiefel", 1, 64, 2, None, 0.0)  # seed 1 ran only at multiplier 1, far better
    s = summarize_transfer(collect_shapes(tmp_path))["shapes"][0]
    assert s["seeds"] == ["0"] and s["best_multiplier"] == pytest.approx(1.0)
    assert min(r["mean"] for r in s["rows"]) == pytest.approx(2.0)  # seed 1's 0.0 left out


def test_transfer_report_writes_and_rebuilds_byte_for_byte_and_the_cli_names_a_bad_folder(tmp_path, capsys):
    _shape(tmp_path, "w64", 64, 2, lambda m: 2.0 + (math.log(m)) ** 2)
    assert main(["lm", "--transfer-report", "--out", str(tmp_path)]) == 0
    first = {f: (tmp_path / f).read_bytes() for f in ("report.md", "summary.json", "transfer.png")}
    assert b"| w64 (width 64, 2 heads of 32) | 0, 1 |" in first["report.md"]
    transfer_report(tmp_path)
    assert all((tmp_path / f).read_bytes() == b for f, b in first.items())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["lm", "--transfer-report", "--out", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "run_frame_step.sh" in err[0]


# ------------------------------------------------------------------------------------ checks on other models
def _check_run(folder, arm, seed, experiment, frame_lr, curve, epochs=40, adjust_lr_fn="match_rms_adamw"):
    """A grokking or vision run (width 128, 4 heads) whose records follow curve(epoch) (val_acc, or test_acc)."""
    run = folder / "runs" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    config = {"experiment": experiment, "train": {"epochs": epochs, "eval_every": 10}, "width": 128, "heads": 4,
              "optim": {"lr": LR, "frame_lr": frame_lr, "adjust_lr_fn": adjust_lr_fn}}
    (run / "config.json").write_text(json.dumps({"config": config, "arm": arm, "seed": seed}))
    key = "val_acc" if experiment == "grokking" else "test_acc"
    lines = [{"arm": arm, "seed": seed, "epoch": e, key: curve(e)} for e in range(0, epochs + 1, 10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _grokking_check(root, groks_at, seeds=(0,)):
    """mu-<m>/ folders whose stiefel runs reach 95% at epoch groks_at[m] (None: never) and an adamw reference."""
    for m, epoch in groks_at.items():
        for seed in seeds:
            _check_run(root / "check" / f"mu-{m:g}", "stiefel", seed, "grokking", m * LR,
                       lambda e, g=epoch: 1.0 if g is not None and e >= g else 0.5)
    for seed in seeds:
        _check_run(root / "reference", "adamw", seed, "grokking", None, lambda e: 1.0 if e >= 30 else 0.5)
        _check_run(root / "reference", "stiefel", seed, "grokking", None, lambda e: 1.0 if e >= 10 else 0.5,
                   adjust_lr_fn="original")  # the paper's step at the model's lr


def test_a_grokking_check_ranks_earlier_grokking_better_and_never_reaching_last(tmp_path):
    _grokking_check(tmp_path, {1 / 9: 30, 1 / 3: 10, 1.0: 20, 3.0: None, 9.0: None})
    from experiments.lm.transfer import collect_check, summarize_check

    c = summarize_check(collect_check(tmp_path / "check", name="g", reference=tmp_path / "reference"))
    assert c["better"] == "lower" and c["best_multiplier"] == pytest.approx(1 / 3) and c["bracketed"]
    assert [r["mean"] for r in c["rows"]] == [30.0, 10.0, 20.0, None, None]
    assert c["default_grid_distance"] == pytest.approx(1.0) and c["default_minus_best"] == pytest.approx(10.0)
    assert c["adamw_mean"] == pytest.approx(30.0)
    # the paper's step is the reference's stiefel run, not a multiplier of the rule: μ = 1/sqrt(128 * 32) = 1/64
    assert c["papers_step_mean"] == pytest.approx(10.0) and c["papers_step_multiplier"] == pytest.approx(1 / 64)
    assert all(r["multiplier"] != pytest.approx(1.0) or r["mean"] == 20.0 for r in c["rows"])
    # companion: when the earliest grokking is at the smallest multiplier, it is said to be at an edge
    _grokking_check(tmp_path / "edge", {1 / 3: 10, 1.0: 20, 3.0: 30})
    e = summarize_check(collect_check(tmp_path / "edge" / "check", name="g"))
    assert e["best_multiplier"] == pytest.approx(1 / 3) and e["bracketed"] is False and e["adamw_mean"] is None


def test_a_vision_check_ranks_higher_accuracy_better_and_reads_its_own_adamw_folder(tmp_path):
    from experiments.lm.transfer import collect_check, summarize_check

    for seed in (0, 1):
        _check_run(tmp_path / "adamw", "adamw", seed, "vision", None, lambda e: 0.80)
        for m, acc in {1 / 3: 0.80, 1.0: 0.84, 3.0: 0.83}.items():
            _check_run(tmp_path / f"mu-{m:g}", "stiefel", seed, "vision", m * LR,
                       lambda e, a=acc, s=seed: a + s / 100)
    c = summarize_check(collect_check(tmp_path, name="v"))
    assert c["better"] == "higher" and c["best_multiplier"] == pytest.approx(1.0) and c["bracketed"]
    assert c["seeds"] == ["0", "1"] and c["rows"][1]["mean"] == pytest.approx(84.5)
    assert c["adamw_mean"] == pytest.approx(80.0) and c["default_grid_distance"] == 0


def test_a_check_refuses_runs_that_differ_in_more_than_the_frame_lr(tmp_path):
    from experiments.lm.transfer import collect_check

    _grokking_check(tmp_path, {1.0: 20, 3.0: 10})
    _check_run(tmp_path / "long", "adamw", 0, "grokking", None, lambda e: 1.0, epochs=50)
    with pytest.raises(ValueError, match="check 'g'.*adamw/seed0.*50 epochs"):
        collect_check(tmp_path / "check", name="g", reference=tmp_path / "long")
    with pytest.raises(ValueError, match="check 'g'.*no finished stiefel run"):
        collect_check(tmp_path / "reference", name="g")
    # companion: the matching reference is accepted
    assert collect_check(tmp_path / "check", name="g", reference=tmp_path / "reference")["adamw"] == {"0": 30.0}


def test_the_transfer_report_has_a_checks_section_from_checks_json(tmp_path):
    lm = tmp_path / "lm"
    _shape(lm, "w64", 64, 2, lambda m: 2.0 + (math.log(m)) ** 2)
    _grokking_check(tmp_path, {1 / 3: 30, 1.0: 20, 3.0: 40})
    (lm / "checks.json").write_text(json.dumps({"checks": [
        {"name": "grokking", "path": "../check", "reference": "../reference"}]}))
    summary = transfer_report(lm)
    assert summary["checks"][0]["best_multiplier"] == pytest.approx(1.0)
    report = (lm / "report.md").read_text()
    assert "## Checks on other models" in report and "| 30 | **20** | 40 | 10 | 30 | 1 | yes | 0 | +0 |" in report
    assert "paper's step (μ = 1/64)" in report
    # companion: without checks.json there is no such section
    (lm / "checks.json").unlink()
    transfer_report(lm)
    assert "Checks on other models" not in (lm / "report.md").read_text()
    (lm / "checks.json").write_text(json.dumps({"checks": [{"path": "../check"}]}))
    with pytest.raises(ValueError, match="checks.json.*'name' and 'path'"):
        transfer_report(lm)


def test_the_papers_step_of_a_shape_is_reported_beside_the_rule_and_must_be_the_papers_step(tmp_path):
    from experiments.lm.transfer import default_table

    _shape(tmp_path, "w64", 64, 2, lambda m: 2.0 + (math.log(m)) ** 2)
    for seed in (0, 1):
        _run(tmp_path / "w64" / "papers-step", "stiefel", seed, 64, 2, None, 3.5 + 0.01 * seed)
        spec = tmp_path / "w64" / "papers-step" / "runs" / "stiefel" / f"seed{seed}" / "config.json"
        meta = json.loads(spec.read_text())
        meta["config"]["optim"]["adjust_lr_fn"] = "original"
        spec.write_text(json.dumps(meta))
    summary = summarize_transfer(collect_shapes(tmp_path))
    shape = summary["shapes"][0]
    assert shape["papers_step_mean"] == pytest.approx(3.505)
    assert shape["best_multiplier"] == pytest.approx(1.0)  # papers-step/ is not a grid point
    row = default_table(summary)[2]
    assert row.startswith("| language model w64 (width 64, heads of 32) |") and "| 3.5050 | 3.0050 |" in row
    # companion: a run there that is not the paper's step is refused, naming the folder
    meta["config"]["optim"]["adjust_lr_fn"] = "match_rms_adamw"
    spec.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="papers-step/ must be the stiefel arm with adjust_lr_fn='original'"):
        collect_shapes(tmp_path)


def test_transfer_report_refuses_a_flag_it_would_ignore(tmp_path, capsys):
    """``--transfer-report`` reads only ``--out``: another flag (``--lr 5``, ``--seeds 0``) was silently ignored; now
    one error line names it, exit status 2, and nothing is written. Companion: with ``--out`` alone it writes."""
    _shape(tmp_path, "w64", 64, 2, lambda m: 2.0 + (math.log(m)) ** 2)
    assert main(["lm", "--transfer-report", "--lr", "5", "--seeds", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--transfer-report reads only --out" in err[0] and "drop --lr --seeds" in err[0]
    assert not (tmp_path / "report.md").exists()
    assert main(["lm", "--transfer-report", "--quiet", "--out", str(tmp_path)]) == 0  # companion
    assert (tmp_path / "report.md").exists()
