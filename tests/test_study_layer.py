"""The study layer shared by every study: one paired-statistics implementation (checked against scipy), sweep
cells, the paper's protocol, figures that stay readable for one-epoch runs, and the arms' documented state.

References are independent: scipy's ``ttest_rel`` and Student-t quantiles, the written-out sum over a
frame's entries for geoopt's second moment.
"""

from __future__ import annotations

import math

import geoopt
import numpy as np
import pytest
import scipy.stats
import torch
from conftest import F64

from experiments.grokking.study import PAPER as GROKKING_PAPER
from experiments.grokking.study import GrokkingConfig
from experiments.harness import OptimConfig, TrainConfig, get_arm, plotting
from experiments.harness.config import flag_of
from experiments.harness.records import summarize
from experiments.harness.report import protocol_differences
from experiments.harness.stats import compare_arms
from experiments.harness.study import Cell
from experiments.vision.study import PAPER as VISION_PAPER
from experiments.vision.study import VisionConfig

#: float64 agreement with scipy's t statistic and interval
SCIPY_TOL = 1e-12


# ------------------------------------------------------------------------------------------ paired statistics
def test_compare_arms_is_the_paired_t_test_on_seeds_both_arms_ran():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2, 3, 4, 5]
    base = dict(zip(seeds, rng.normal(0.8, 0.05, 6), strict=True))
    other = {s: base[s] + rng.normal(0.01, 0.005) for s in seeds[:5]}  # seed 5 missing in this arm
    frozen = {s: other[s] - 0.002 * (s + 1) for s in seeds[:5]}
    out = compare_arms({"adamw": base, "stiefel": other, "stiefel-frozen": frozen},
                       ["adamw", "stiefel", "stiefel-frozen"])
    assert list(out) == ["stiefel - adamw", "stiefel-frozen - adamw", "stiefel - stiefel-frozen"]
    c = out["stiefel - adamw"]
    a, b = [other[s] for s in seeds[:5]], [base[s] for s in seeds[:5]]
    ref = scipy.stats.ttest_rel(a, b)
    d = np.array(a) - np.array(b)
    half = scipy.stats.t.ppf(0.975, df=4) * d.std(ddof=1) / math.sqrt(5)
    assert c["n"] == 5 and c["labels"] == ["0", "1", "2", "3", "4"]
    assert c["t"] == pytest.approx(float(ref.statistic), rel=SCIPY_TOL)
    assert c["p_value"] == pytest.approx(float(ref.pvalue), rel=1e-9)
    assert c["ci_low"] == pytest.approx(d.mean() - half, rel=SCIPY_TOL)
    assert c["ci_high"] == pytest.approx(d.mean() + half, rel=SCIPY_TOL)
    # companion: pairing by seed matters; the same values paired in another order give another statistic
    shuffled = dict(zip(seeds[:5], reversed(a), strict=True))
    assert compare_arms({"adamw": base, "stiefel": shuffled}, ["adamw", "stiefel"])["stiefel - adamw"]["t"] != c["t"]


def test_summarize_uses_the_same_paired_statistics():
    records = []
    finals = {"adamw": [0.61, 0.70, 0.55], "stiefel": [0.97, 0.80, 0.60]}
    for arm, vals in finals.items():
        for seed, v in enumerate(vals):
            records += [{"arm": arm, "seed": seed, "epoch": 0, "val_acc": 0.0},
                        {"arm": arm, "seed": seed, "epoch": 10, "val_acc": v}]
    s = summarize(records)
    ref = scipy.stats.ttest_rel(finals["stiefel"], finals["adamw"])
    p = s["paired"]["stiefel - adamw"]
    assert p["t"] == pytest.approx(float(ref.statistic), rel=SCIPY_TOL) and p["n_positive"] == 3
    plain = compare_arms({a: dict(enumerate(v)) for a, v in finals.items()}, ["adamw", "stiefel"])["stiefel - adamw"]
    assert {k: v for k, v in p.items() if not k.endswith("_holm")} == plain
    assert p["p_holm"] == plain["p_value"]  # one comparison: Holm leaves its p-value as it is


# ------------------------------------------------------------------------------------------ cells, protocol
def test_cells_name_their_folder_and_label(tmp_path):
    cfg = GrokkingConfig(p=7)
    assert Cell(cfg).folder(tmp_path) == tmp_path and Cell(cfg).label == "all"
    swept = Cell(cfg, "wd-0.5", "weight_decay", 0.5)
    assert swept.folder(tmp_path) == tmp_path / "wd-0.5" and swept.label == "weight_decay=0.5"


def test_flags_of_config_fields():
    assert flag_of("config.train.epochs") == "--epochs" and flag_of("config.optim.weight_decay") == "--weight-decay"
    assert flag_of("seed") == "--seeds" and flag_of("config.fast_forward") == "--no-fast-forward"


def test_protocol_of_the_paper():
    paper_cfg = GrokkingConfig(p=97, operation="+", train_fraction=0.3, train=TrainConfig(epochs=20000))
    assert protocol_differences(GROKKING_PAPER, paper_cfg) == []
    small = GrokkingConfig(p=13, train=TrainConfig(epochs=100), optim=OptimConfig(lr=3e-3))
    assert protocol_differences(GROKKING_PAPER, small) == [("--p", 97, 13), ("--epochs", 20000, 100)]
    assert protocol_differences(VISION_PAPER, VisionConfig(dataset="cifar10")) == []
    assert protocol_differences(VISION_PAPER, VisionConfig(dataset="fashion-mnist", patch_size=7)) == [
        ("--dataset", "cifar10", "fashion-mnist")]


# ------------------------------------------------------------------------------------------ one-epoch figures
def _one_epoch_records(epochs=(0, 1)):
    recs = []
    for arm, scale in (("adamw", 1.0), ("stiefel", 0.03)):
        for seed in (0, 1):
            for e in epochs:
                recs.append({"experiment": "vision", "arm": arm, "seed": seed, "epoch": e, "step": 10 * e,
                             "train_acc": 0.5, "test_acc": 0.5 + 0.01 * seed,
                             "move_step_rms/q": None if e == 0 else scale * (1 + seed),
                             "move_total_rel/q": 0.01 * e, "angle_max_deg/q": float(e)})
    return recs


@pytest.fixture
def captured(monkeypatch, tmp_path):
    figures = []

    def save(fig, path):
        figures.append(fig)
        return tmp_path / "unused.png"

    monkeypatch.setattr(plotting, "_save", save)
    return figures


def _markers(fig):
    return [line.get_marker() for ax in fig.axes for line in ax.lines if len(line.get_xdata()) > 0]


def test_a_one_epoch_run_draws_markers(captured):
    recs = _one_epoch_records()
    assert plotting.plot_movement_ratio(recs, ["adamw", "stiefel"], "m.png", title="t") is not None
    markers = _markers(captured[-1])
    assert markers and all(m == "o" for m in markers)  # every series has one point: all drawn as markers
    plotting.plot_accuracy([r for r in recs if r["epoch"] == 1], "a.png", sets=("train", "test"), threshold=None)
    assert _markers(captured[-1]) and all(m == "o" for m in _markers(captured[-1]))
    # companion: with several evaluations the series are lines without markers
    plotting.plot_movement_ratio(_one_epoch_records(epochs=(0, 1, 2, 3)), ["adamw", "stiefel"], "m.png", title="t")
    assert all(m in ("None", None, "") for m in _markers(captured[-1]))


def test_per_seed_figure_draws_each_seed_and_arm_as_recorded(captured):
    """One panel per seed; on it one line per arm whose points are that run's own records (not a mean)."""
    recs = [{"arm": arm, "seed": seed, "epoch": e, "val_acc": (0.1 * seed + e / 10 + (arm == "stiefel")) / 3}
            for arm in ("adamw", "stiefel") for seed in (0, 1, 2) for e in range(4)]
    assert plotting.plot_per_seed(recs, "p.png") is not None
    axes = [ax for ax in captured[-1].axes if ax.get_visible() and ax.get_title().startswith("seed")]
    assert [ax.get_title() for ax in axes] == ["seed 0", "seed 1", "seed 2"]
    for seed, ax in enumerate(axes):
        curves = sorted(tuple(np.round(line.get_ydata(), 12)) for line in ax.lines if len(line.get_xdata()) == 4)
        expected = sorted(tuple(round((0.1 * seed + e / 10 + s) / 3, 12) for e in range(4)) for s in (0, 1))
        assert curves == expected
    # companions: one seed, or records without the key, draw nothing (the per-arm figure covers one seed)
    assert plotting.plot_per_seed([r for r in recs if r["seed"] == 0], "p.png") is None
    assert plotting.plot_per_seed([{k: v for k, v in r.items() if k != "val_acc"} for r in recs], "p.png") is None
    # more seeds than panels: nothing drawn, and it says so
    with pytest.warns(UserWarning, match="max_seeds=2"):
        assert plotting.plot_per_seed(recs, "p.png", max_seeds=2) is None


def test_overview_keeps_accuracy_bands_inside_zero_one(captured):
    """A ±1 sd band around accuracies near 1 would reach above 1: the accuracy panel is limited to [0, 1]."""
    recs = [{"arm": "adamw", "seed": seed, "epoch": e, "val_acc": 1.0 - 0.6 * seed * (e == 2),
             "norm/euclidean": 10.0 + seed + e} for seed in (0, 1) for e in range(4)]
    plotting.plot_overview(recs, "o.png")
    acc_ax, norm_ax = captured[-1].axes[:2]
    assert acc_ax.get_ylim() == pytest.approx((-0.02, 1.02))
    # companion: the weight-norm panel keeps its own scale
    assert norm_ax.get_ylim()[1] > 10.0


# ------------------------------------------------------------------------------------------ arms
def test_geoopt_radam_keeps_a_per_frame_second_moment_at_full_size():
    """What arms.py says: geoopt's RiemannianAdam on EuclideanStiefel accumulates ‖ξ‖²_F per frame, broadcast
    into a buffer of the frame's full shape."""
    torch.manual_seed(0)
    st = geoopt.EuclideanStiefel()
    w = geoopt.ManifoldParameter(st.random(3, 6, 2, dtype=F64), manifold=st)
    opt = geoopt.optim.RiemannianAdam([w], lr=1e-3, betas=(0.9, 0.999))
    g = torch.randn(3, 6, 2, dtype=F64)
    w.grad = g.clone()
    xi = g - w.detach() @ (0.5 * (w.detach().transpose(-1, -2) @ g + g.transpose(-1, -2) @ w.detach()))
    opt.step()
    v = opt.state[w]["exp_avg_sq"]
    assert v.shape == (3, 6, 2)  # full size
    expected = 0.001 * (xi ** 2).sum(dim=(-1, -2))  # (1 - beta2) * ‖ξ‖²_F per frame
    for h in range(3):
        assert torch.allclose(v[h], expected[h].expand(6, 2), rtol=1e-12, atol=0)
    # companion: the element-wise second moment of plain Adam is not constant over a frame
    assert not torch.allclose(xi[0] ** 2, (xi[0] ** 2).mean().expand(6, 2))
    assert get_arm("geoopt-radam").attention == "stiefel"


def test_finished_runs_leaves_runs_in_progress_out_and_names_them():
    """A study still training must not average a run's current value with other runs' endpoints."""
    from experiments.harness.study import finished_runs

    def run(arm, seed, last):
        return [{"arm": arm, "seed": seed, "epoch": e, "val_acc": e / 100} for e in range(0, last + 1, 50)]

    records = run("adamw", 0, 100) + run("stiefel", 0, 100) + run("adamw", 1, 50)
    kept, note = finished_runs(records, 100)
    assert {(r["arm"], r["seed"]) for r in kept} == {("adamw", 0), ("stiefel", 0)}
    assert len(kept) == 6
    assert "adamw seed 1 (at epoch 50 of 100)" in note and "left out" in note
    # companion: when every run is finished nothing is dropped and nothing is said
    done = run("adamw", 0, 100) + run("adamw", 1, 100)
    assert finished_runs(done, 100) == (done, "")
    # when no run has finished, every record is kept and the note says the figures are not endpoints
    early = run("adamw", 0, 50) + run("stiefel", 0, 50)
    kept, note = finished_runs(early, 100)
    assert kept == early and "No run has reached epoch 100" in note
    assert finished_runs(records, None) == (records, "")


def _write_environment(run_dir, calls):
    import json

    run_dir.mkdir(parents=True)
    (run_dir / "environment.json").write_text(json.dumps(calls))


def test_run_lines_name_every_commit_and_setup_the_runs_were_trained_under(tmp_path):
    """A study trained over several sessions names each commit (marked when the tree had uncommitted changes)
    and each device setup, not only those of the first run found."""
    from experiments.harness.study import run_info_from_records, speed_from_environment

    cpu = {"device": "cpu", "torch_threads": 1, "torch": "2.14.1"}
    _write_environment(tmp_path / "runs" / "adamw" / "seed0", [
        {**cpu, "start_epoch": 0, "end_epoch": 50, "seconds": 5.0, "git_sha": "a" * 40, "git_dirty": False},
        {**cpu, "start_epoch": 50, "end_epoch": 100, "seconds": 5.0, "git_sha": "b" * 40, "git_dirty": True,
         "cpu_model": "Intel(R) Xeon(R)"}])
    _write_environment(tmp_path / "runs" / "stiefel" / "seed0", [
        {**cpu, "start_epoch": 0, "end_epoch": 100, "seconds": 20.0, "git_sha": "a" * 40, "git_dirty": False}])
    speed = speed_from_environment(tmp_path)
    assert speed["adamw/seed0"]["epochs_per_second"] == 10.0 and speed["stiefel/seed0"]["epochs_per_second"] == 5.0
    info = run_info_from_records(tmp_path, speed)
    assert info["git commits (2; * = with uncommitted changes)"] == "aaaaaaaaaaaa, bbbbbbbbbbbb*"
    assert info["devices"] == ("cpu, 1 torch thread(s), torch 2.14.1; "
                               "cpu (Intel(R) Xeon(R)), 1 torch thread(s), torch 2.14.1")
    assert info["training"].startswith("2 runs, 0.5 min of training in total, 7.5 epochs/s")
    # companion: one commit and one setup are named as such, without a mark
    clean = tmp_path / "clean"
    _write_environment(clean / "runs" / "adamw" / "seed0", [
        {**cpu, "start_epoch": 0, "end_epoch": 10, "seconds": 1.0, "git_sha": "c" * 40, "git_dirty": False}])
    info = run_info_from_records(clean, speed_from_environment(clean))
    assert info["git commit"] == "cccccccccccc" and info["device"] == "cpu, 1 torch thread(s), torch 2.14.1"
