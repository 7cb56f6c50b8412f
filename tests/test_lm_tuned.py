"""Tests of the tuned study (``python -m experiments lm --lrs / --final-seeds / --time-steps``, experiments/tuned.py):
the grid cells, the selection and its bracketing, the final cell at each arm's lr on paired seeds, the report
(byte for byte from the records; paired statistics against scipy; the equal-wall-clock readout), the CLI errors,
the README's generated table and the proposed configuration."""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import lm_cli

pytest.importorskip("transformers")

from experiments.cli import main as cli_main  # noqa: E402
from experiments.harness.config import OptimConfig, RunSpec, TrainConfig, to_dict  # noqa: E402
from experiments.harness.records import read_records  # noqa: E402
from experiments.lm import tuned  # noqa: E402
from experiments.lm.study import LMConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: statistics recomputed by scipy agree to rounding of float64 sums
STAT_TOL = 1e-12





def _exit_code(call) -> int:
    try:
        return call()
    except SystemExit as err:
        return err.code


@pytest.fixture(scope="module")
def study(varied_root, tmp_path_factory):
    """A tiny tuned study: adamw and stiefel on a two-point grid (seeds 0 1), then the final cell (seeds 2 3 4,
    unbracketed allowed: a two-point grid has its best at an edge) and the timing pass."""
    out = tmp_path_factory.mktemp("tuned") / "study"
    assert lm_cli(varied_root, out, "--arms", "adamw", "stiefel", "--lrs", "1e-3", "3e-2", "--skip-report") == 0
    return out


# ---------------------------------------------------------------------------------------------- grid and final
def test_grid_cells_hold_every_arm_at_every_lr_on_the_grid_seeds(study):
    for lr, name in ((1e-3, "lr-0.001"), (3e-2, "lr-0.03")):
        for arm in ("adamw", "stiefel"):
            seeds = sorted(p.name for p in (study / name / "runs" / arm).iterdir())
            assert seeds == ["seed0", "seed1"]  # the default grid seeds
            cfg = json.loads((study / name / "runs" / arm / "seed0" / "config.json").read_text())["config"]
            assert cfg["optim"]["lr"] == lr and cfg["optim"]["frame_lr"] is None  # frames follow the lr
            assert cfg["optim"]["adjust_lr_fn"] == "match_rms_adamw"
            assert "PSF" not in cfg["corpus_identity"]["licence"]  # a custom root: no licence stated
    assert not (study / "runs").exists() and not (study / "final").exists()  # no main cell, no final yet


def test_final_cell_refuses_an_unbracketed_grid_then_runs_each_arm_at_its_own_lr(study, varied_root, capsys):
    grid = tuned.read_grid(study)
    selection = tuned.select_lrs(grid, strict=True)
    assert all(not s["bracketed"] for s in selection["arms"].values())  # two points: the best is at an edge
    capsys.readouterr()
    code = _exit_code(lambda: lm_cli(varied_root, study, "--arms", "adamw", "stiefel", "--final-seeds", "2", "3", "4"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--final-seeds" in err[0] and "add" in err[0] and "adamw" in err[0]
    assert not (study / "final").exists()
    # final seeds that selected the lr on the grid are refused, naming them and seeds that would do
    code = _exit_code(lambda: lm_cli(varied_root, study, "--arms", "adamw", "stiefel", "--final-seeds", "1", "2", "3",
                                   "--allow-unbracketed"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "seed(s) 1 selected" in err[0] and "--final-seeds 2 3 4" in err[0]
    assert not (study / "final").exists()
    # companion: allowed explicitly, on seeds of its own, it runs, each arm at the lr its grid selected
    assert lm_cli(varied_root, study, "--arms", "adamw", "stiefel", "--final-seeds", "2", "3", "4",
                "--allow-unbracketed", "--time-steps", "2") == 0
    for arm, s in selection["arms"].items():
        for seed in (2, 3, 4):
            run = study / "final" / "runs" / arm / f"seed{seed}"
            assert json.loads((run / "config.json").read_text())["config"]["optim"]["lr"] == s["best_lr"]
            assert {r["seed"] for r in read_records(run / "metrics.jsonl")} == {seed}
    # paired seeds: the same seed sees the same training windows in both arms and starts from the same
    # non-frame weights (checked for the task in test_lm.py); here the evaluation windows agree too
    a = read_records(study / "final/runs/adamw/seed2/metrics.jsonl")[0]
    b = read_records(study / "final/runs/stiefel/seed2/metrics.jsonl")[0]
    assert {k for k in a if k.endswith("_bpb")} == {k for k in b if k.endswith("_bpb")}
    timing = json.loads((study / tuned.TIMING_FILE).read_text())
    assert set(timing["arms"]) == {"adamw", "stiefel"} and all(
        len(v["rounds"]) == 3 and v["seconds_per_step"] > 0 for v in timing["arms"].values())


def test_report_rebuilds_byte_for_byte_and_names_what_it_must(study, tmp_path):
    if not (study / "final").exists():
        pytest.skip("needs the final cell of the previous test")
    copy = tmp_path / "copy"
    shutil.copytree(study, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    for f in ("report.md", "summary.json"):
        (copy / f).unlink()
    assert cli_main(["lm", "--report-only", "--out", str(copy), "--quiet"]) == 0
    for f in ("report.md", "summary.json"):
        assert (copy / f).read_bytes() == (study / f).read_bytes(), f
    report = (study / "report.md").read_text()
    assert "## 3. At equal wall-clock" in report and "timing pass" in report and "lr_grid.png" in report
    assert "not bracketed" not in report and "no: adamw: best lr" in report  # the edge is said, per arm
    assert "*" in report.split("## Run")[1] or "one clean commit" in report  # commits named, dirt marked
    assert "suggest" in report  # three seeds: no claims


# ---------------------------------------------------------------------------------------------- selection
def _grid(values: dict[str, dict[float, dict[int, float]]], unfinished=()):
    return {"finals": values, "unfinished": list(unfinished)}


def test_selection_brackets_an_inner_optimum():
    sel = tuned.select_lrs(_grid({"adamw": {1e-3: {0: 2.0, 1: 2.2}, 3e-3: {0: 1.8, 1: 1.9}, 1e-2: {0: 1.9, 1: 2.1}}}),
                           strict=True)["arms"]["adamw"]
    assert sel["best_lr"] == 3e-3 and sel["bracketed"] and sel["edge"] is None and sel["next_lr"] is None
    assert sel["best_mean"] == pytest.approx(1.85, abs=STAT_TOL)


def test_selection_ranks_a_diverged_point_below_every_finite_one_and_says_so():
    nan, inf = float("nan"), float("inf")
    values = {"muon": {1e-3: {0: nan, 1: 2.0}, 3e-3: {0: 1.8, 1: 1.9}, 1e-2: {0: 1.9, 1: 2.0}, 3e-2: {0: inf, 1: nan}}}
    with pytest.warns(UserWarning, match=r"muon diverged at lr 0.001, 0.03"):
        sel = tuned.select_lrs(_grid(values), strict=True)["arms"]["muon"]
    # a NaN at the first grid point would be kept by a plain min() (NaN never compares smaller)
    assert sel["best_lr"] == 3e-3 and sel["bracketed"] and sel["diverged"] == [1e-3, 3e-2]
    # companion: a finite grid has no diverged point and warns nothing; an all-diverged arm cannot be selected
    values["muon"][1e-3][0], values["muon"][3e-2] = 2.1, {0: 2.2, 1: 2.3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.select_lrs(_grid(values), strict=True)["arms"]["muon"]["diverged"] == []
    with pytest.raises(tuned.IncompleteSelectionError, match="muon: every grid point diverged"):
        tuned.select_lrs(_grid({"muon": {1e-3: {0: nan}, 3e-3: {0: inf}}}), strict=True)


@pytest.mark.parametrize("values, edge, next_lr", [
    ({1e-3: {0: 2.0}, 3e-3: {0: 1.9}, 9e-3: {0: 1.8}}, "high", 2.7e-2),
    ({1e-3: {0: 1.7}, 3e-3: {0: 1.9}, 9e-3: {0: 1.8}}, "low", 3.33e-4),
    ({3e-3: {0: 1.7}}, "only", 9e-3),
])
def test_selection_at_an_edge_is_not_bracketed_and_names_the_next_value(values, edge, next_lr):
    sel = tuned.select_lrs(_grid({"muon": values}), strict=True)["arms"]["muon"]
    assert not sel["bracketed"] and sel["edge"] == edge and sel["next_lr"] == pytest.approx(next_lr, rel=1e-12)
    assert f"add {next_lr:g}" in tuned._unbracketed_text("muon", sel)


def test_selection_names_a_missing_seed_arm_or_unfinished_run():
    values = {"adamw": {1e-3: {0: 2.0, 1: 2.1}, 3e-3: {0: 1.8}, 1e-2: {0: 1.9, 1: 2.0}}}
    with pytest.raises(tuned.IncompleteSelectionError, match="adamw at lr 0.003 seed 1"):
        tuned.select_lrs(_grid(values), strict=True)
    with pytest.raises(tuned.IncompleteSelectionError, match="stiefel: no grid runs"):
        tuned.select_lrs(_grid(values), arms=["adamw", "stiefel"], strict=True)
    with pytest.raises(tuned.IncompleteSelectionError, match=r"seed 1 \(at epoch 3 of 20\)"):
        tuned.select_lrs(_grid(values, [("adamw", 3e-3, 1, 3, 20)]), strict=True)
    with pytest.warns(UserWarning, match="seed 1"):  # not strict: warns, and selects on the common seeds
        sel = tuned.select_lrs(_grid(values))
    assert sel["arms"]["adamw"]["seeds"] == [0] and sel["missing"]
    # companion: a complete grid raises and warns nothing
    values["adamw"][3e-3][1] = 1.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not tuned.select_lrs(_grid(values), strict=True)["missing"]


def test_grid_cells_refuse_bad_values():
    cfg = LMConfig()
    cells = tuned.grid_cells(cfg, [3e-3, 1e-3])
    assert [c.subdir for c in cells] == ["lr-0.001", "lr-0.003"] and cells[1].config.optim.lr == 3e-3
    for bad in ([-1e-3], [math.inf], [1e-3, 1.0000001e-3]):
        with pytest.raises(ValueError, match="--lrs"):
            tuned.grid_cells(cfg, bad)


# ---------------------------------------------------------------------------------------------- synthetic report
def _write_run(folder: Path, config: LMConfig, arm: str, seed: int, records: list[dict], *, sha: str = "a" * 40,
               dirty: bool = False) -> None:
    run = folder / "runs" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(RunSpec(config, arm, seed)), indent=2, sort_keys=True))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"arm": arm, "seed": seed, **r}) + "\n" for r in records))
    (run / "environment.json").write_text(json.dumps([{"git_sha": sha, "git_dirty": dirty, "device": "cpu",
                                                       "cpu_model": "test CPU", "torch_threads": 1, "torch": "x",
                                                       "start_epoch": 0, "end_epoch": 2, "seconds": 10.0}]))


#: synthetic final test bpb per arm and seed: (test, test_code, test_prose, test_data)
FINAL = {"adamw": [(2.00, 1.9, 2.3, 1.5), (2.03, 1.95, 2.31, 1.52), (1.98, 1.91, 2.2, 1.49), (2.01, 1.96, 2.29, 1.5),
                   (2.02, 1.92, 2.33, 1.51)],
         "muon": [(1.95, 1.85, 2.25, 1.49), (1.99, 1.9, 2.3, 1.5), (1.96, 1.86, 2.21, 1.45), (1.97, 1.88, 2.24, 1.5),
                  (1.94, 1.87, 2.26, 1.47)],
         "stiefel": [(1.97, 1.84, 2.28, 1.48), (1.96, 1.88, 2.25, 1.53), (1.97, 1.9, 2.24, 1.46),
                     (1.99, 1.89, 2.27, 1.49), (1.93, 1.83, 2.22, 1.44)]}


@pytest.fixture()
def synthetic(tmp_path):
    """A tuned study written by hand: a 3-point grid per arm (2 seeds), a final cell of 5 seeds with per-category
    test bpb at every epoch, and a timing file (muon twice as slow as adamw)."""
    out = tmp_path / "synthetic"
    base = LMConfig(corpus_root="/nowhere", test_fraction=0.1, steps_per_epoch=10, train=TrainConfig(epochs=2),
                    optim=OptimConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                    corpus_identity={"source": "fake", "sha256": "0" * 64, "licence": "PSF License Agreement"})
    best = {"adamw": 3e-3, "muon": 1e-2, "stiefel": 3e-3}
    for lr in (1e-3, 3e-3, 1e-2):
        for arm in best:
            for seed in (0, 1):
                score = 2.0 + abs(math.log(lr / best[arm])) / 10 + 0.01 * seed
                _write_run(out / f"lr-{lr:g}", tuned.with_lr(base, lr), arm, seed,
                           [{"epoch": 0, "val_bpb": 8.0}, {"epoch": 2, "val_bpb": score}])
    for arm, rows in FINAL.items():
        for seed, (t, c, p, d) in enumerate(rows):
            recs = [{"epoch": e, "val_bpb": 3.0, "test_bpb": t + (2 - e) * 0.1 + 0.001 * seed, "test_code_bpb": c,
                     "test_prose_bpb": p, "test_data_bpb": d} for e in range(3)]
            _write_run(out / "final", tuned.with_lr(base, best[arm]), arm, seed, recs)
    (out / tuned.TIMING_FILE).write_text(json.dumps({"steps_per_round": 5, "rounds": 3, "arms": {
        "adamw": {"lr": 3e-3, "seconds_per_step": 0.5, "rounds": [0.5] * 3},
        "muon": {"lr": 1e-2, "seconds_per_step": 1.0, "rounds": [1.0] * 3},
        "stiefel": {"lr": 3e-3, "seconds_per_step": 0.6, "rounds": [0.9, 0.6, 0.55]}},
        "environment": {"device": "cpu", "cpu_model": "test CPU", "torch_threads": 1, "git_sha": "a" * 40}}))
    return out, best


def test_synthetic_report_selects_compares_against_scipy_and_rebuilds(synthetic):
    from scipy import stats

    out, best = synthetic
    summary = tuned.finalize_tuned(out, LMConfig).summary
    sel = summary["selection"]["arms"]
    assert {a: s["best_lr"] for a, s in sel.items()} == best
    assert sel["adamw"]["bracketed"] and not sel["muon"]["bracketed"] and sel["muon"]["next_lr"] == pytest.approx(0.0333)  # one grid ratio (10/3) beyond
    comps = summary["final"]["comparisons"]
    for k, name in enumerate(tuned.CATEGORY_SETS):
        for arm, base in (("muon", "adamw"), ("stiefel", "adamw"), ("stiefel", "muon")):
            a = [r[k] for r in FINAL[arm]]
            b = [r[k] for r in FINAL[base]]
            if name == "test":
                a = [v + 0.001 * s for s, v in enumerate(a)]
                b = [v + 0.001 * s for s, v in enumerate(b)]
            c = comps[f"{name}: {arm} - {base}"]
            ref = stats.ttest_rel(a, b)
            diffs = [x - y for x, y in zip(a, b, strict=True)]
            assert c["t"] == pytest.approx(ref.statistic, rel=1e-9)
            assert c["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)
            pos = sum(d > 0 for d in diffs)
            nz = sum(d != 0 for d in diffs)
            assert c["sign_test_p"] == pytest.approx(stats.binomtest(pos, nz, 0.5).pvalue, rel=1e-12)
    # Holm over the whole family (12 comparisons): the smallest p is multiplied by 12
    ps = sorted(c["p_value"] for c in comps.values())
    smallest = min(comps.values(), key=lambda c: c["p_value"])
    assert len(comps) == 12 and smallest["p_holm"] == pytest.approx(min(1.0, 12 * ps[0]), rel=1e-12)
    report = (out / "report.md").read_text()
    assert "licence: PSF License Agreement" in report and "test_data bpb" in report
    assert "aaaaaaaaaaaa (one clean commit)" in report
    before = {f: (out / f).read_bytes() for f in ("report.md", "summary.json")}
    tuned.finalize_tuned(out, LMConfig)
    assert {f: (out / f).read_bytes() for f in before} == before
    # companion: a final run trained on a dirty tree is marked
    env = out / "final/runs/muon/seed0/environment.json"
    env.write_text(env.read_text().replace('"git_dirty": false', '"git_dirty": true'))
    tuned.finalize_tuned(out, LMConfig)
    assert "**not one clean commit**" in (out / "report.md").read_text()


def test_equal_wallclock_reads_each_arm_at_the_steps_that_fit_the_budget(synthetic):
    out, _ = synthetic
    wall = tuned.finalize_tuned(out, LMConfig).summary["equal_wallclock"]
    # 20 steps; fastest adamw 0.5 s/step -> budget 10 s; muon (1.0 s/step) fits 10 steps = epoch 1; stiefel
    # (0.6 s/step) fits 16 steps -> its last evaluation within them is epoch 1 (step 10)
    assert wall["budget_seconds"] == pytest.approx(10.0)
    assert wall["arms"]["adamw"]["steps_fit"] == 20 and wall["arms"]["adamw"]["epoch_read"] == [2]
    assert wall["arms"]["muon"]["steps_fit"] == 10 and wall["arms"]["muon"]["epoch_read"] == [1]
    assert wall["arms"]["stiefel"]["steps_fit"] == 16 and wall["arms"]["stiefel"]["epoch_read"] == [1]
    assert wall["arms"]["muon"]["test_bpb"]["0"] == pytest.approx(FINAL["muon"][0][0] + 0.1, abs=STAT_TOL)
    # per category too, read at the same epoch (the synthetic categories hold one value at every epoch)
    assert wall["keys"] == [f"{s}_bpb" for s in tuned.CATEGORY_SETS]
    for k, name in enumerate(tuned.CATEGORY_SETS[1:], start=1):
        assert wall["arms"]["muon"][f"{name}_bpb"] == pytest.approx(
            {str(seed): row[k] for seed, row in enumerate(FINAL["muon"])}, abs=STAT_TOL)
    from scipy import stats

    code = wall["comparisons"]["test_code: stiefel - adamw"]
    a, b = ([row[1] for row in FINAL[arm]] for arm in ("stiefel", "adamw"))
    assert code["mean"] == pytest.approx(sum(x - y for x, y in zip(a, b, strict=True)) / len(a), abs=STAT_TOL)
    assert code["p_value"] == pytest.approx(stats.ttest_rel(a, b).pvalue, abs=STAT_TOL)
    report = (out / tuned.REPORT_FILE).read_text()
    assert ("| arm | ms per step | rounds (ms) | steps that fit | step read | test bpb [95% CI] | test_code bpb [95% CI]"
            in report)
    # each arm's row shows the range of its rounds (the machine's noise), from timing.json
    assert "| muon | 1000.0 | 1000.0–1000.0 | 10 | " in report and "| stiefel | 600.0 | 550.0–900.0 | 16 | " in report
    # companion: equal step times read every arm at its last epoch
    same = tuned.equal_wallclock({"a": 1.0, "b": 1.0}, total_steps=20, steps_per_epoch=10,
                                 records={"a": {0: [{"epoch": 1, "test_bpb": 3.0}, {"epoch": 2, "test_bpb": 2.0}]},
                                          "b": {0: [{"epoch": 1, "test_bpb": 3.5}, {"epoch": 2, "test_bpb": 2.5}]}})
    assert same["arms"]["b"]["epoch_read"] == [2] and same["arms"]["b"]["test_bpb"] == {"0": 2.5}
    # one key may be given as a plain string (not read as a sequence of one-letter keys)
    one = tuned.equal_wallclock({"a": 1.0, "b": 1.0}, total_steps=20, steps_per_epoch=10, keys="test_bpb",
                                records={"a": {0: [{"epoch": 2, "test_bpb": 2.0}]}, "b": {0: [{"epoch": 2, "test_bpb": 2.5}]}})
    assert one["keys"] == ["test_bpb"] and one["arms"]["b"]["test_bpb"] == {"0": 2.5}


def test_equal_wallclock_reads_a_pair_at_the_same_step_when_its_step_times_are_within_the_noise(synthetic):
    """Issue 57, item 5: stiefel (median 0.6 s, rounds 0.55-0.9) against adamw (0.5 s, rounds all 0.5) differ by
    0.1 s, less than the timing noise (0.35 s, the larger range of rounds): both are read at the same step, the
    last evaluation within the smaller of their steps that fit (16 -> step 10), where the budget rule read adamw at
    step 20; companion: muon (1.0 s) against adamw differ by more than the noise (0), each read at its own steps."""
    out, _ = synthetic
    wall = tuned.finalize_tuned(out, LMConfig).summary["equal_wallclock"]
    same = wall["comparisons"]["test: stiefel - adamw"]
    assert same["read"]["rule"] == "same step" and same["read"]["steps"] == {"stiefel": [10], "adamw": [10]}
    assert same["read"]["noise_seconds"] == pytest.approx(0.35, abs=STAT_TOL)
    assert same["read"]["difference_seconds"] == pytest.approx(0.1, abs=STAT_TOL)
    # at epoch 1 both arms' test bpb carry the same +0.1 of the synthetic schedule: it cancels in the pair
    a, b = ([row[0] for row in FINAL[arm]] for arm in ("stiefel", "adamw"))
    assert same["mean"] == pytest.approx(sum(x - y for x, y in zip(a, b, strict=True)) / len(a), abs=STAT_TOL)
    budget = wall["comparisons"]["test: muon - adamw"]
    assert budget["read"]["rule"] == "budget" and budget["read"]["steps"] == {"muon": [10], "adamw": [20]}
    a, b = ([row[0] for row in FINAL[arm]] for arm in ("muon", "adamw"))
    assert budget["mean"] == pytest.approx(sum(x - y for x, y in zip(a, b, strict=True)) / len(a) + 0.1,
                                           abs=STAT_TOL)
    # the budget rule alone would have read stiefel - adamw 0.1 higher (adamw at step 20)
    per_arm = wall["arms"]
    old = sum(per_arm["stiefel"]["test_bpb"][k] - per_arm["adamw"]["test_bpb"][k] for k in per_arm["adamw"]["test_bpb"])
    assert old / 5 == pytest.approx(same["mean"] + 0.1, abs=STAT_TOL)
    # the report names the rule of every row, and each sentence says how its pair was read
    report = (out / tuned.REPORT_FILE).read_text()
    assert "| stiefel - adamw | 600.0 / 500.0 | 100.0 | 350.0 | same step: both at the smaller of their steps that fit | " \
        "10 / 10 |" in report
    assert "| muon - adamw | 1000.0 / 500.0 | 500.0 | 0.0 | budget: each at its own steps that fit | 10 / 20 |" in report
    assert "Both read at step 10, their median step times differing by less than the timing noise" in report
    assert "each read within the budget, `muon` at step 10 and `adamw` at step 20" in report.replace("Each", "each")
    # the rule on its own: equal times with no spread are not "within" a noise of 0
    rule = tuned.wallclock_rule({"seconds_per_step": 0.5, "rounds": [0.5]}, {"seconds_per_step": 0.5, "rounds": [0.5]})
    assert rule["rule"] == "budget" and rule["noise_seconds"] == 0.0


def _rewrite_grid_records(out: Path, change: Callable[[dict], dict]) -> None:
    for metrics in out.glob(f"{tuned.GRID_PREFIX}*/runs/*/seed*/metrics.jsonl"):
        rows = [change(json.loads(line)) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_grids_test_numbers_are_never_read(synthetic):
    """The grid's runs hold test numbers (one training loop evaluates every split): they must change neither the
    selection nor a byte of the report; companion: the same kind of change to validation moves the selection."""
    out, best = synthetic
    tuned.finalize_tuned(out, LMConfig)
    before = {f: (out / f).read_bytes() for f in ("report.md", "summary.json")}
    # test bpb that ranks every arm's lrs backwards (the worst validation point best), in every set and epoch
    _rewrite_grid_records(out, lambda r: {**r, **{f"{s}_bpb": -r["val_bpb"] for s in tuned.CATEGORY_SETS}})
    tuned.finalize_tuned(out, LMConfig)
    assert {f: (out / f).read_bytes() for f in before} == before
    # companion: validation numbers are what the selection reads
    _rewrite_grid_records(out, lambda r: {**r, "val_bpb": -r["val_bpb"]})
    moved = tuned.finalize_tuned(out, LMConfig).summary["selection"]["arms"]
    assert {a: s["best_lr"] for a, s in moved.items()} != best


def test_report_states_an_incomplete_grid(synthetic):
    out, _ = synthetic
    shutil.rmtree(out / "lr-0.01/runs/stiefel/seed1")
    summary = tuned.finalize_tuned(out, LMConfig).summary
    assert summary["selection"]["missing"] == ["stiefel at lr 0.01 seed 1"]
    assert "**The grid is incomplete**: missing stiefel at lr 0.01 seed 1" in (out / "report.md").read_text()


def test_final_seeds_that_decided_the_selection_are_refused_even_beyond_the_seeds_passed(synthetic):
    """An arm selects on every seed it has at all its grid points, not only on --seeds: a seed 2 present everywhere
    in the grid decides the selection too, so final seed 2 is refused, naming free seeds; nothing is trained."""
    from experiments.harness.config import config_from_dict

    out, best = synthetic
    config = config_from_dict(LMConfig, tuned.find_config(out))
    for lr in (1e-3, 3e-3, 1e-2):
        for arm in best:
            _write_run(out / f"lr-{lr:g}", tuned.with_lr(config, lr), arm, 2,
                       [{"epoch": 0, "val_bpb": 8.0}, {"epoch": 2, "val_bpb": 2.5}])
    shutil.rmtree(out / "final")

    def build_task(*_):
        raise AssertionError("nothing may be trained")

    with pytest.raises(ValueError, match=r"seed\(s\) 2 selected the lrs .* --final-seeds 3 4"):
        tuned.run_tuned(config, out, build_task, arms=list(best), seeds=[0, 1], final_seeds=[2, 3],
                        allow_unbracketed=True, skip_report=True)
    assert not (out / "final").exists()
    # companion: seeds that no grid run has pass the check (and reach the training, stubbed here)
    with pytest.raises(AssertionError, match="nothing may be trained"):
        tuned.run_tuned(config, out, build_task, arms=list(best), seeds=[0, 1], final_seeds=[3, 4],
                        allow_unbracketed=True, skip_report=True)


def test_report_names_a_diverged_grid_point(synthetic):
    out, best = synthetic
    run = out / "lr-0.01/runs/adamw/seed1/metrics.jsonl"
    recs = read_records(run)
    recs[-1]["val_bpb"] = float("nan")  # how a diverged run's records read
    run.write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = tuned.finalize_tuned(out, LMConfig).summary  # the report states it (its warnings are silenced)
    assert summary["selection"]["arms"]["adamw"]["best_lr"] == best["adamw"]
    assert "**Diverged** (non-finite validation bpb on a seed; ranked below every finite point): adamw at lr 0.01." in (
        out / "report.md").read_text()


def _set_config(run: Path, change: Callable[[dict], None]) -> None:
    meta = json.loads((run / "config.json").read_text())
    change(meta["config"])
    (run / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))


def _set_lr(run: Path, lr: float) -> None:
    _set_config(run, lambda c: c["optim"].__setitem__("lr", lr))


def _set_epochs(run: Path, epochs: int) -> None:
    _set_config(run, lambda c: c["train"].__setitem__("epochs", epochs))


def test_final_runs_of_one_arm_at_different_lrs_are_refused_naming_the_folder_and_the_lrs(synthetic):
    """The final cell's lr of an arm is read from every one of its runs: seeds at different lrs are refused (one
    lr cannot stand for them), not reported at whichever seed's lr was read last; companion: one lr per arm."""
    from experiments.harness.records import InconsistentRecordsError

    out, best = synthetic
    assert tuned.finalize_tuned(out, LMConfig).summary["final"]["lr"] == best  # companion
    for seed in (0, 4):  # the first and the last seed read: neither may stand for the arm
        _set_lr(out / "final/runs/muon" / f"seed{seed}", 0.03)
        with pytest.raises(InconsistentRecordsError, match=r"final/runs/muon: the final runs of muon were trained at "
                           r"different learning rates \(lr 0\.01: .*; lr 0\.03: muon seed" + str(seed)):
            tuned.finalize_tuned(out, LMConfig)
        _set_lr(out / "final/runs/muon" / f"seed{seed}", 0.01)
    tuned.finalize_tuned(out, LMConfig)


def test_grid_cell_runs_at_different_lrs_are_refused_naming_the_cell_and_the_lrs(synthetic):
    """A grid cell's lr is read from every run's config, not from the first one: runs at different lrs in one cell
    are refused (the CLI says it in one line, exit 2); companion: the same change to every run of the cell moves
    the cell's lr and is accepted."""
    from experiments.harness.records import InconsistentRecordsError

    out, _ = synthetic
    cell = out / "lr-0.01"
    _set_lr(cell / "runs/stiefel/seed1", 0.02)
    with pytest.raises(InconsistentRecordsError, match=r"lr-0\.01: the runs of this grid cell were trained at "
                       r"different learning rates \(lr 0\.01: adamw seed0, .*; lr 0\.02: stiefel seed1\)"):
        tuned.read_grid(out)
    # companion: every run of the cell at 0.02 is one lr, read from the configs (not the folder's name)
    for run in cell.glob("runs/*/seed*"):
        _set_lr(run, 0.02)
    assert set(tuned.read_grid(out)["finals"]["stiefel"]) == {1e-3, 3e-3, 0.02}


def test_a_report_on_inconsistent_records_is_one_line_and_exit_2(synthetic, capsys):
    out, _ = synthetic
    _set_lr(out / "lr-0.01/runs/stiefel/seed1", 0.02)
    code = _exit_code(lambda: cli_main(["lm", "--out", str(out), "--report-only"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lr-0.01: the runs of this grid cell" in err[0]
    _set_lr(out / "lr-0.01/runs/stiefel/seed1", 0.01)  # companion: consistent records give a report
    assert _exit_code(lambda: cli_main(["lm", "--out", str(out), "--report-only"])) == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_grid_run_is_finished_at_its_own_epochs(synthetic, seed):
    """A grid run configured for more epochs than the other seed of its arm (e.g. extended) is unfinished at the
    other's count, and the other is finished at its own: whichever seed's config is read last."""
    out, _ = synthetic
    _set_epochs(out / "lr-0.01/runs/stiefel" / f"seed{seed}", 4)
    grid = tuned.read_grid(out)
    assert grid["unfinished"] == [("stiefel", 0.01, seed, 2, 4)]
    assert set(grid["finals"]["stiefel"][0.01]) == {1 - seed}  # the other seed finished at its own 2 epochs


@pytest.mark.parametrize("seed", [0, 4])
def test_a_final_run_is_finished_at_its_own_epochs(synthetic, seed):
    """In the final cell too: one seed configured for 3 epochs (records to 2) is in progress, the others are
    finished at their 2; companion: every seed at 2 leaves none in progress."""
    out, _ = synthetic
    assert tuned.finalize_tuned(out, LMConfig).summary["final"]["in_progress"] == []  # companion
    _set_epochs(out / "final/runs/muon" / f"seed{seed}", 3)
    final = tuned.finalize_tuned(out, LMConfig).summary["final"]
    assert final["in_progress"] == [f"muon seed {seed} (epoch 2 of 3)"]
    assert final["seeds"]["muon"] == [s for s in range(5) if s != seed]


def test_finished_runs_of_different_lengths_are_not_compared(synthetic):
    """A final seed configured for (and finished at) 1 epoch is not paired with the others' 2-epoch runs, and a
    grid arm's points at different lengths are not ranked: both are refused, naming the runs of each length."""
    from experiments.harness.records import InconsistentRecordsError

    out, _ = synthetic
    run = out / "final/runs/muon/seed4"
    _set_epochs(run, 1)
    recs = read_records(run / "metrics.jsonl")[:2]  # epochs 0 and 1: finished at its 1 epoch
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(InconsistentRecordsError, match=r"different numbers of epochs \(1 epochs: muon seed4; "
                       r"2 epochs: adamw seed0"):
        tuned.finalize_tuned(out, LMConfig)
    shutil.rmtree(run)
    tuned.finalize_tuned(out, LMConfig)  # companion: the runs left are of one length
    run = out / "lr-0.01/runs/adamw/seed1"
    _set_epochs(run, 1)
    recs = read_records(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "epoch": min(r["epoch"], 1)}) + "\n" for r in recs))
    with pytest.raises(InconsistentRecordsError, match=r"adamw: 1 epochs \(lr-0\.01 seed1\), 2 epochs"):
        tuned.read_grid(out)


def test_a_copy_of_a_run_folder_is_not_read_as_that_run(synthetic):
    """``seed0-old`` or ``seed0.bak`` beside ``seed0`` is not a run of seed 0: the report is the same byte for byte
    (its records are neither merged into seed 0's nor counted); companion: the same copy named ``seed7`` is a run."""
    out, _ = synthetic
    tuned.finalize_tuned(out, LMConfig)
    before = {f: (out / f).read_bytes() for f in (tuned.REPORT_FILE, tuned.SUMMARY_FILE)}
    for name in ("seed0-old", "seed0.bak"):
        copy = out / "final/runs/muon" / name
        shutil.copytree(out / "final/runs/muon/seed0", copy)
        _rewrite = [{**r, "test_bpb": 9.0} for r in read_records(copy / "metrics.jsonl")]  # an older, other run
        (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rewrite))
        _set_lr(copy, 0.5)
        shutil.copytree(out / "lr-0.01/runs/adamw/seed0", out / "lr-0.01/runs/adamw" / name)
    tuned.finalize_tuned(out, LMConfig)
    assert {f: (out / f).read_bytes() for f in before} == before
    assert tuned.is_tuned_folder(out) and not tuned.is_tuned_folder(out / "final/runs")
    # companion: the copy renamed to a seed folder is read (and its records name seed 0: refused, not merged)
    from experiments.harness.records import InconsistentRecordsError

    (out / "final/runs/muon/seed0.bak").rename(out / "final/runs/muon/seed7")
    with pytest.raises(InconsistentRecordsError):
        tuned.finalize_tuned(out, LMConfig)


def test_a_diverged_final_run_is_listed_and_left_out_not_a_traceback(synthetic):
    """A final run whose test bpb is NaN (diverged) is listed in the summary, the report and the README table, and
    left out of the means and pairs (in the final cell and at equal wall-clock); companion: without it, nothing is
    said to have diverged."""
    out, _ = synthetic
    summary = tuned.finalize_tuned(out, LMConfig).summary
    assert "diverged" not in summary["final"] and "Diverged" not in (out / tuned.REPORT_FILE).read_text()  # companion
    run = out / "final/runs/muon/seed1/metrics.jsonl"
    recs = read_records(run)
    for r in recs[1:]:  # from epoch 1 on, every set
        r.update({f"{s}_bpb": float("nan") for s in tuned.CATEGORY_SETS})
    run.write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = tuned.finalize_tuned(out, LMConfig).summary
    final = summary["final"]
    assert final["diverged"] == {"muon": [1]} and final["seeds"]["muon"] == [0, 1, 2, 3, 4]
    kept = [row[0] + 0.001 * s for s, row in enumerate(FINAL["muon"]) if s != 1]
    assert final["test"]["muon"]["test"]["n"] == 4
    assert final["test"]["muon"]["test"]["mean"] == pytest.approx(sum(kept) / 4, abs=STAT_TOL)
    assert final["comparisons"]["test: muon - adamw"]["n"] == 4 and final["comparisons"]["test: stiefel - adamw"]["n"] == 5
    assert summary["equal_wallclock"]["diverged"] == {"muon": [1]}
    assert summary["equal_wallclock"]["comparisons"]["test: muon - adamw"]["n"] == 4
    report = (out / tuned.REPORT_FILE).read_text()
    assert report.count("**Diverged, left out of the means and the paired differences** (a ") == 2
    assert "): muon seed 1." in report
    table = "\n".join(tuned.readme_table(summary))
    assert "| `muon` | 0.01 | no | 5 (1 diverged, left out) |" in table and "muon seed 1" in table
    json.loads((out / tuned.SUMMARY_FILE).read_text())  # the summary is still JSON (no NaN written)
    assert "NaN" not in (out / tuned.SUMMARY_FILE).read_text()


def test_a_zero_difference_reads_equal_not_higher():
    c = {"mean": 0.0, "n": 5, "p_holm": 1.0, "p_value": 1.0, "ci_low": -1e-3, "ci_high": 1e-3}
    text = tuned._sentence("test: a - b", c)
    assert "equal" in text and "higher" not in text and "lower" not in text and "not resolved" in text
    # companions: a positive difference whose unadjusted interval excludes 0 is (suggested) higher, a negative one
    # lower; one whose interval includes 0 has no direction
    assert "is higher than" in tuned._sentence("test: a - b", {**c, "mean": 1e-9, "ci_low": 1e-10})
    assert "is lower than" in tuned._sentence("test: a - b", {**c, "mean": -1e-9, "ci_high": -1e-10})
    assert "than" not in tuned._sentence("test: a - b", {**c, "mean": -1e-9})


def _comparison(mean: float, lo: float, hi: float, p_holm: float, n: int = 10, **more) -> dict:
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "p_value": p_holm / 10, "p_holm": p_holm, "n": n,
            "std": 0.023, "n_positive": 8, "n_negative": 2, **more}


def test_reading_says_what_the_data_can_say():
    """Issue 57, item 5, on the issue's two figures: an interval that includes 0 is "not resolved" with the smallest
    difference the pairs could detect (never sameness); an unadjusted interval that excludes 0 is "suggested";
    only a Holm-adjusted p below ALPHA with enough pairs is "is"."""
    from experiments.harness.stats import with_detectable

    family = with_detectable({  # the Holm-adjusted p as the controls study's family gave them
        "test: stiefel - adamw-qknorm": {**_comparison(-0.0044, -0.0208, 0.0119, 1.0), "p_value": 0.55,
                                         "sign_test_p": 1.0, "std": 0.022816},
        "test: stiefeladam-muon - muon": {**_comparison(0.0058, 0.0017, 0.0099, 0.12), "p_value": 0.011,
                                          "sign_test_p": 0.11, "std": 0.0057},
        **{f"test: x{k} - y": {**_comparison(-0.3, -0.31, -0.29, 0.0), "p_value": 1e-12, "sign_test_p": 0.002}
           for k in range(46)}})  # 48 comparisons, as in the controls study
    null = family["test: stiefel - adamw-qknorm"]
    assert tuned.reading(null) == "not resolved"
    text = tuned._sentence("test: stiefel - adamw-qknorm", null)
    assert ("not resolved: mean difference -0.0044 (95% CI -0.0208 to +0.0119" in text
            and "smallest difference detectable at 80% power is 0.023 bpb at α = 0.05 and 0.042 at the Holm level "
            "α/48 (noncentral t)" in text)
    assert "lower than" not in text and "equal" not in text and "neither" not in text
    cost = family["test: stiefeladam-muon - muon"]
    assert tuned.reading(cost) == "suggested"
    text = tuned._sentence("test: stiefeladam-muon - muon", cost)
    assert text.startswith("- test: stiefeladam-muon - muon: suggested, not resolved: `stiefeladam-muon`'s test bpb "
                           "is higher than `muon`'s by 0.0058 (unadjusted 95% CI +0.0017 to +0.0099, paired-t p "
                           "0.011; higher on 8 of 10 pairs; Holm-adjusted paired-t p 0.12)")
    # companions: resolved only with a Holm p below ALPHA and enough pairs
    assert tuned.reading({**cost, "p_holm": 0.01}) == "resolved"
    assert tuned.reading({**cost, "p_holm": 0.01, "n": tuned.MIN_SEEDS_FOR_CLAIM - 1}) == "suggested"
    assert tuned.reading({**null, "p_holm": 0.01}) == "resolved"  # (an interval and a p that disagree: p rules)
    assert tuned.reading({"mean": None, "n": 0}) == "none"


# ---------------------------------------------------------------------------------------------- CLI errors
@pytest.mark.parametrize("flags, fragment", [
    (["--lrs", "-1"], "--lrs"),
    (["--lrs", "1e-3", "--frame-lrs", "1e-2"], "--frame-lrs"),
    (["--final-seeds", "-1"], "--final-seeds"),
    (["--final-seeds", "0", "0"], "--final-seeds"),
    (["--allow-unbracketed"], "--allow-unbracketed"),
    (["--time-steps", "0"], "--time-steps"),
    (["--arms", "adamw", "--final-seeds", "0"], "--final-seeds"),  # no grid on disk: names the missing arm
    (["--lrs", "1e-3", "0.001"], "--lrs: 0.001 0.001 names a learning rate twice"),  # was one grid cell, silently
    (["--final-seeds", str(2**64)], f"--final-seeds: {2**64} is above 2**64 - 1"),  # was torch's traceback
])
def test_cli_errors_are_one_line_exit_2_and_write_nothing(varied_root, tmp_path, capsys, flags, fragment):
    out = tmp_path / "never"
    assert _exit_code(lambda: lm_cli(varied_root, out, *flags)) == 2
    msg = capsys.readouterr().err.strip().splitlines()
    assert fragment in msg[-1] and "Traceback" not in "\n".join(msg)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- README, configs
def test_numbers_not_in_summary_finds_a_misquoted_number():
    summary = {"a": {"mean": 1.81734, "diff": -0.03412}, "lr": 0.003}
    assert tuned.numbers_not_in_summary("bpb 1.817, better by 0.034 (−0.0341), lr 3e-3", summary) == []
    assert tuned.numbers_not_in_summary("bpb 1.818, lr 1e-3", summary) == ["1.818", "1e-3"]  # companion


def _readme_block() -> str:
    text = (ROOT / "experiments/lm/README.md").read_text()
    assert tuned.README_BEGIN in text and tuned.README_END in text
    return text.split(tuned.README_BEGIN, 1)[1].split(tuned.README_END, 1)[0].strip()


def test_readme_results_block_is_generated_from_the_committed_summary():
    block = _readme_block()
    path = ROOT / "experiments/lm/records/tuned/summary.json"
    if not path.exists():  # the study has not run: the block claims nothing
        assert block == tuned.README_PLACEHOLDER and not re.search(r"\d", block)
        return
    summary = json.loads(path.read_text())
    assert "\n".join(tuned.readme_table(summary)) in block
    assert tuned.numbers_not_in_summary(block, summary) == []


def test_readme_table_of_the_synthetic_study_quotes_only_its_summary(synthetic):
    out, _ = synthetic
    summary = tuned.finalize_tuned(out, LMConfig).summary
    table = "\n".join(tuned.readme_table(summary))
    assert "| `muon` | 0.01 | no | 5 |" in table
    # the overall comparisons in words, final cell and equal wall-clock, each the report's own sentence
    report = (out / tuned.REPORT_FILE).read_text()
    words = [ln for ln in table.splitlines() if ln.startswith("- test: ")]
    assert len(words) == 2 * 3 and all(w in report for w in words)
    assert "- test: stiefel - adamw: suggested, not resolved: `stiefel`'s test bpb is" in table
    assert tuned.numbers_not_in_summary(table, summary) == []
    good = f"{summary['final']['test']['adamw']['test']['mean']:.4f}"
    bad = f"{float(good) + 0.0071:.4f}"  # companion: a misquoted mean is found
    assert good in table and tuned.numbers_not_in_summary(table.replace(good, bad), summary) == [bad]


def test_readme_table_quotes_the_final_cell_only_once_it_is_complete(synthetic):
    out, _ = synthetic
    with_final = tuned.readme_table(tuned.finalize_tuned(out, LMConfig).summary)
    assert tuned.README_IN_PROGRESS not in with_final and with_final[2 + 3] == ""  # companion: a row per arm
    assert "final cell is incomplete" not in (out / tuned.REPORT_FILE).read_text()  # companion of the next check
    shutil.rmtree(out / tuned.FINAL_DIR / "runs" / "muon" / "seed4")  # one arm a seed short
    assert tuned.readme_table(tuned.finalize_tuned(out, LMConfig).summary) == [tuned.README_IN_PROGRESS]
    shutil.rmtree(out / tuned.FINAL_DIR / "runs" / "stiefel")  # an arm without final runs: the report says so
    assert tuned.readme_table(tuned.finalize_tuned(out, LMConfig).summary) == [tuned.README_IN_PROGRESS]
    assert "**The final cell is incomplete**: no finished final run yet for stiefel." in (
        out / tuned.REPORT_FILE).read_text()
    shutil.rmtree(out / tuned.FINAL_DIR)  # the grid alone
    summary = tuned.finalize_tuned(out, LMConfig).summary
    assert summary["selection"]["arms"] and not summary["final"]["arms"]
    assert tuned.readme_table(summary) == [tuned.README_IN_PROGRESS]
    assert not re.search(r"\d", tuned.README_IN_PROGRESS)


def _grids() -> dict[str, list[float]]:
    lines = (ROOT / "experiments/lm/configs/tuned.args").read_text().splitlines()
    return {ln.split()[2]: [float(v) for v in ln.split()[3:]] for ln in lines if ln.startswith("# grid ")}


def test_tuned_args_parse_and_every_grid_has_at_least_five_values_about_three_apart():
    import argparse

    from experiments.lm.study import STUDY, config_from_args

    text = (ROOT / "experiments/lm/configs/tuned.args").read_text()
    flags = [w for ln in text.splitlines() if not ln.startswith("#") for w in ln.split()]
    parser = argparse.ArgumentParser()
    STUDY.add_arguments(parser)
    cfg = config_from_args(parser.parse_args(flags))
    assert (cfg.width, cfg.depth, cfg.heads, cfg.context, cfg.batch_size) == (128, 4, 4, 128, 32)
    assert cfg.test_fraction == 0.1 and cfg.max_file_share == 0.03 and cfg.optim.adjust_lr_fn == "match_rms_adamw"
    grids = _grids()
    assert set(grids) == {"adamw", "muon", "stiefel", "stiefel-muon"}
    for arm, values in grids.items():
        ratios = [b / a for a, b in zip(values, values[1:], strict=False)]
        # the five common points, then at most the extensions the selection asked for (one ratio beyond an edge)
        assert values[:5] == [3e-4, 1e-3, 3e-3, 1e-2, 3e-2] and all(2.9 < r < 3.4 for r in ratios), (arm, values)
    assert grids["muon"][5:] == [9e-2] and all(len(v) == 5 for a, v in grids.items() if a != "muon")
    script = (ROOT / "experiments/lm/run_tuned.sh").read_text()
    assert "--final-seeds" in script and "--time-steps" in script and "tuned.args" in script
    # the final cell: at least 5 paired seeds (issue 26), disjoint from the grid's (run_tuned refuses an overlap)
    final = re.search(r"--seeds ([\d ]+) --final-seeds ([\d ]+)", script)
    grid_seeds, final_seeds = ({int(v) for v in final.group(k).split()} for k in (1, 2))
    assert len(final_seeds) >= 5 and not grid_seeds & final_seeds and grid_seeds == {0, 1}
