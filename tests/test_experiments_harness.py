"""Tests of the experiment harness: configs, arms, batch sources, metric hooks, the training loop (resume
and parallel runs reproduce an uninterrupted serial run exactly), records, plots and reports.

The model is a small stand-in defined here (a bank of query/key frames feeding a linear read-out), so the
harness is tested independently of the study models. Numerical references are written out independently
(scipy's ``subspace_angles``, scipy's paired t-test, hand-computed movement).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import geoopt
import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch
from conftest import F64, ORTHO_TOL_F32

from experiments.harness import (
    ARMS,
    Arm,
    OptimConfig,
    OptimizerGroup,
    QKGeometry,
    RunSpec,
    Task,
    TrainConfig,
    WeightNorms,
    get_arm,
    principal_angles,
    register_arm,
    run_jobs,
    train_run,
)
from experiments.harness.arms import build_stiefel, split_frame_groups
from experiments.harness.batches import FullBatch, MiniBatches
from experiments.harness.records import read_records, summarize
from experiments.harness.report import PaperReference, render_report
from experiments.harness.study import finalize_study
from geoopt_stiefel_attention import PolarStiefel

#: float64 agreement of principal angles with scipy's (radians)
ANGLE_TOL = 1e-10
#: float64 agreement of hand-computed movement / norms
NORM_TOL = 1e-12
#: float64 agreement of summary statistics with their written-out values
STAT_TOL = 1e-12



# ------------------------------------------------------------------------------------------ stand-in study
@dataclass(frozen=True)
class ToyConfig:
    experiment: str = "toy"
    n: int = 48
    d: int = 6
    heads: int = 2
    r: int = 2
    classes: int = 3
    batch_size: int | None = 16
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=12, eval_every=4))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-2, weight_decay=0.1))


class ToyModel(torch.nn.Module):
    """Per head h: features (x W_q^h) * (x W_k^h), summed over r, then a linear read-out. Both attentions draw
    the same Gaussian W_q, W_k from the seed; the Stiefel one keeps their polar factors."""

    def __init__(self, cfg: ToyConfig, attention: str, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        wq = torch.randn(cfg.heads, cfg.d, cfg.r, generator=g)
        wk = torch.randn(cfg.heads, cfg.d, cfg.r, generator=g)
        self.readout = torch.nn.Linear(cfg.heads * cfg.r + cfg.d, cfg.classes)
        with torch.no_grad():
            self.readout.weight.copy_(0.3 * torch.randn(self.readout.weight.shape, generator=g))
            self.readout.bias.zero_()
        if attention == "stiefel":
            st = PolarStiefel()
            self.w_q = geoopt.ManifoldParameter(st.projx(wq), manifold=st)
            self.w_k = geoopt.ManifoldParameter(st.projx(wk), manifold=st)
        else:
            self.w_q = torch.nn.Parameter(wq / math.sqrt(cfg.d))
            self.w_k = torch.nn.Parameter(wk / math.sqrt(cfg.d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.einsum("bd,hdr->bhr", x, self.w_q)
        k = torch.einsum("bd,hdr->bhr", x, self.w_k)
        return self.readout(torch.cat([(q * k).flatten(1), x], dim=1))


def toy_qk(model: ToyModel):
    return [("toy", model.w_q, model.w_k)]


def toy_build_task(spec: RunSpec, arm: Arm, device: torch.device) -> Task:
    cfg: ToyConfig = spec.config
    g = torch.Generator().manual_seed(1000 + spec.seed)
    x = torch.randn(cfg.n, cfg.d, generator=g)
    y = (x @ torch.randn(cfg.d, cfg.classes, generator=g)).argmax(dim=1)
    xv = torch.randn(cfg.n // 2, cfg.d, generator=g)
    yv = (xv @ torch.randn(cfg.d, cfg.classes, generator=g)).argmax(dim=1)
    train = (FullBatch(x, y) if cfg.batch_size is None
             else MiniBatches(x, y, cfg.batch_size, seed=spec.seed))
    return Task(model=ToyModel(cfg, arm.attention, spec.seed), train_data=train,
                eval_data={"train": FullBatch(x, y), "val": MiniBatches(xv, yv, 10, shuffle=False)},
                hooks=(WeightNorms(), QKGeometry(toy_qk)))


# ------------------------------------------------------------------------------------------ configs
def test_configs_validate_and_name_the_field():
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0)
    with pytest.raises(ValueError, match="eval_every"):
        TrainConfig(eval_every=-1)
    with pytest.raises(ValueError, match="betas"):
        OptimConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="frame_lr"):
        OptimConfig(frame_lr=0.0)
    with pytest.raises(ValueError, match="dataclass"):
        RunSpec(object(), "adamw", 0)
    with pytest.raises(ValueError, match="needs a field 'experiment'"):
        RunSpec(OptimConfig(), "adamw", 0)
    with pytest.raises(ValueError, match="seed"):
        RunSpec(ToyConfig(), "adamw", -1)
    assert OptimConfig(betas=[0.9, 0.98]).betas == (0.9, 0.98)
    assert OptimConfig(lr=1e-3).effective_frame_lr == 1e-3
    assert OptimConfig(lr=1e-3, frame_lr=5e-4).effective_frame_lr == 5e-4


def test_eval_epochs_include_zero_multiples_and_the_last():
    assert TrainConfig(epochs=10, eval_every=4).eval_epochs() == [0, 4, 8, 10]
    assert TrainConfig(epochs=8, eval_every=4).eval_epochs() == [0, 4, 8]


# ------------------------------------------------------------------------------------------ arms
def test_arm_registry_is_open_and_rejects_unknown_and_duplicate_names():
    assert {"adamw", "stiefel", "geoopt-radam", "geoopt-rsgd"} <= set(ARMS)
    with pytest.raises(ValueError, match="registered arms"):
        get_arm("no-such-arm")
    with pytest.raises(ValueError, match="exists already"):
        register_arm(Arm("adamw", "euclidean", ARMS["adamw"].build))

    def freeze(model):
        for p in model.parameters():
            if isinstance(getattr(p, "manifold", None), geoopt.manifolds.EuclideanStiefel):
                p.requires_grad_(False)

    arm = register_arm(Arm("test-frozen-frames", "stiefel", build_stiefel, "frames frozen", prepare=freeze))
    try:
        model = ToyModel(ToyConfig(), "stiefel", 0)
        arm.prepare(model)
        with pytest.raises(ValueError, match="no trainable Stiefel frames"):
            arm.build(model, [{"params": list(model.parameters()), "weight_decay": 0.0}], OptimConfig())
    finally:
        del ARMS["test-frozen-frames"]


def test_arms_check_the_attention_they_need():
    cfg = OptimConfig()
    eu, st = ToyModel(ToyConfig(), "euclidean", 0), ToyModel(ToyConfig(), "stiefel", 0)
    with pytest.raises(ValueError, match="attention='euclidean'"):
        get_arm("adamw").build(st, [{"params": list(st.parameters())}], cfg)
    for name in ("stiefel", "geoopt-radam", "geoopt-rsgd"):
        with pytest.raises(ValueError, match="attention='stiefel'"):
            get_arm(name).build(eu, [{"params": list(eu.parameters())}], cfg)


def test_split_frame_groups_gives_frames_their_lr_and_no_decay():
    model = ToyModel(ToyConfig(), "stiefel", 0)
    groups = [{"params": list(model.parameters()), "weight_decay": 0.5, "name": "all"}]
    frames, others = split_frame_groups(groups, OptimConfig(lr=1e-3, frame_lr=2e-3))
    assert [len(g["params"]) for g in frames] == [2] and frames[0]["lr"] == 2e-3 and frames[0]["weight_decay"] == 0
    assert [len(g["params"]) for g in others] == [2] and others[0]["weight_decay"] == 0.5
    assert "lr" not in others[0] and others[0]["name"] == "all"


def test_stock_geoopt_arms_use_stock_manifold_and_two_optimizers():
    model = ToyModel(ToyConfig(), "stiefel", 0)
    arm = get_arm("geoopt-radam")
    arm.prepare(model)
    assert type(model.w_q.manifold) is geoopt.manifolds.EuclideanStiefel
    opt = arm.build(model, [{"params": list(model.parameters()), "weight_decay": 0.1}], OptimConfig())
    assert isinstance(opt, OptimizerGroup)
    assert [type(o).__name__ for o in opt.optimizers] == ["RiemannianAdam", "AdamW"]
    assert len(opt.param_groups) == 2


# ------------------------------------------------------------------------------------------ batch sources
def test_minibatch_order_depends_on_seed_and_epoch_only_and_covers_each_example_once():
    x = torch.arange(23, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(23)
    a, b = MiniBatches(x, y, 5, seed=3), MiniBatches(x.clone(), y.clone(), 5, seed=3)
    ea = [yy for _, yy in a.batches(7)]
    assert all(torch.equal(u, v) for u, v in zip(ea, [yy for _, yy in b.batches(7)], strict=True))
    assert sorted(torch.cat(ea).tolist()) == list(range(23)) and len(ea) == len(a) == 5
    assert not torch.equal(torch.cat(ea), torch.cat([yy for _, yy in a.batches(8)]))
    assert not torch.equal(torch.cat(ea), torch.cat([yy for _, yy in MiniBatches(x, y, 5, seed=4).batches(7)]))
    assert [int(t.shape[0]) for _, t in MiniBatches(x, y, 5, drop_last=True).batches(0)] == [5] * 4
    with pytest.raises(ValueError, match="batch_size"):
        MiniBatches(x, y, 0)


# ------------------------------------------------------------------------------------------ metric hooks
def test_principal_angles_match_scipy():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 9, 4, generator=g, dtype=F64)
    b = a + 0.3 * torch.randn(3, 9, 4, generator=g, dtype=F64)
    ours = principal_angles(a, b)
    for h in range(3):
        ref = np.sort(scipy.linalg.subspace_angles(a[h].numpy(), b[h].numpy()))
        np.testing.assert_allclose(ours[h].numpy(), ref, atol=ANGLE_TOL, rtol=0)


def test_principal_angles_see_the_subspace_not_the_basis():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 3, generator=g, dtype=F64)
    mix = torch.randn(3, 3, generator=g, dtype=F64)  # invertible: same column space
    assert float(principal_angles(a, a @ mix).max()) < ANGLE_TOL
    # companion: a rotation of the ambient space moves the subspace, so the angles must not vanish
    rot = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=F64)).Q
    assert float(principal_angles(a, rot @ a).max()) > 0.1
    # and orthogonal subspaces are at 90 degrees
    e = torch.eye(8, dtype=F64)
    np.testing.assert_allclose(principal_angles(e[:, :3], e[:, 3:6]).numpy(), [math.pi / 2] * 3, atol=ANGLE_TOL)


def test_qk_geometry_movement_and_angles_written_out():
    model = ToyModel(ToyConfig(), "euclidean", 0)
    hook = QKGeometry(toy_qk)
    hook.on_start(model)
    w0 = model.w_q.detach().to(F64).clone()
    rest = hook.metrics(model)
    assert rest["move_total/q"] == 0 and rest["move_step/q"] is None and rest["angle_max_deg/q"] < 1e-6
    with torch.no_grad():
        model.w_q.mul_(2.0)  # same column spaces, moved by ||W0||
    hook.before_last_step(model)
    prev = model.w_q.detach().to(F64).clone()
    with torch.no_grad():
        model.w_q.add_(0.01)
    out = hook.metrics(model)
    w = model.w_q.detach().to(F64)
    assert abs(out["move_total/q"] - float((w - w0).square().sum().sqrt())) < NORM_TOL
    assert abs(out["move_step/q"] - float((w - prev).square().sum().sqrt())) < NORM_TOL
    assert abs(out["move_step/q"] - 0.01 * math.sqrt(w.numel())) < 1e-6  # float32 rounding of the +0.01
    assert abs(out["move_total_rel/q"] - float((w - w0).square().sum().sqrt() / w0.square().sum().sqrt())) < NORM_TOL
    assert out["move_total/k"] == 0 and out["angle_max_deg/k"] < 1e-6
    assert out["angle_max_deg/q"] > 0.01  # the added constant tilts the subspaces


def test_weight_norms_written_out():
    model = ToyModel(ToyConfig(), "stiefel", 0)
    out = WeightNorms().metrics(model)
    assert abs(out["norm/w_q"] - math.sqrt(2 * 2)) < 1e-6  # heads * r orthonormal columns
    assert abs(out["norm/euclidean"] - float(model.readout.weight.detach().double().norm())) < NORM_TOL
    assert "norm/readout.bias" not in out


# ------------------------------------------------------------------------------------------ training loop
#: every arm that trains the toy model; muon and stiefel-muon step through OptimizerGroup (two optimizers, one
#: checkpoint), whose resume once turned StiefelAdam's tensor step counters into ints (a test of geoopt's module
#: name matched geoopt_stiefel_attention) and crashed
ARM_NAMES = ("adamw", "stiefel", "geoopt-radam", "geoopt-rsgd", "muon", "stiefel-muon")


@pytest.mark.parametrize("arm", ARM_NAMES)
def test_resume_reproduces_an_uninterrupted_run_exactly(tmp_path, arm):
    spec = RunSpec(ToyConfig(), arm, seed=2)
    full = train_run(spec, toy_build_task, tmp_path / "full", device="cpu", quiet=True)
    assert full.completed and full.epoch == 12
    part = train_run(spec, toy_build_task, tmp_path / "cut", device="cpu", quiet=True, stop_after_epochs=5)
    assert not part.completed and part.epoch == 5
    part = train_run(spec, toy_build_task, tmp_path / "cut", device="cpu", quiet=True, stop_after_epochs=2)
    assert not part.completed and part.epoch == 7
    rest = train_run(spec, toy_build_task, tmp_path / "cut", device="cpu", quiet=True)
    assert rest.completed and rest.start_epoch == 7
    a, b = read_records(tmp_path / "full" / "metrics.jsonl"), read_records(tmp_path / "cut" / "metrics.jsonl")
    assert [r["epoch"] for r in a] == [0, 4, 8, 12]
    assert a == b
    # companion: a different seed gives different records, so the comparison above can fail
    other = train_run(RunSpec(ToyConfig(), arm, seed=3), toy_build_task, tmp_path / "other", device="cpu", quiet=True)
    assert read_records(tmp_path / "other" / "metrics.jsonl") != a and other.completed
    # a finished run is not trained again, and its records (environment.json included) stay as they were
    env = (tmp_path / "full" / "environment.json").read_text()
    again = train_run(spec, toy_build_task, tmp_path / "full", device="cpu", quiet=True)
    assert again.completed and again.start_epoch == 12 and read_records(tmp_path / "full" / "metrics.jsonl") == a
    assert (tmp_path / "full" / "environment.json").read_text() == env
    assert again.final_record == a[-1] and again.epochs_per_second is None
    # companion: a call that does train logs itself (the comparison above can fail)
    assert len(json.loads(env)) == 1 and len(json.loads((tmp_path / "cut" / "environment.json").read_text())) == 3


def test_finished_records_without_a_checkpoint_are_kept_and_cannot_be_extended(tmp_path):
    """Committed studies keep records, not checkpoints: rerunning the study over them must leave them as they are
    (not retrain and overwrite them), and extending such a run to more epochs must be refused, not restarted."""
    import dataclasses

    spec = RunSpec(ToyConfig(), "adamw", seed=0)
    train_run(spec, toy_build_task, tmp_path, device="cpu", quiet=True)
    (tmp_path / "checkpoint.pt").unlink()
    files = {f: (tmp_path / f).read_bytes() for f in ("metrics.jsonl", "environment.json", "config.json")}
    again = train_run(spec, toy_build_task, tmp_path, device="cpu", quiet=True)
    assert again.completed and again.start_epoch == 12 and again.final_record == read_records(
        tmp_path / "metrics.jsonl")[-1]
    assert all((tmp_path / f).read_bytes() == b for f, b in files.items())
    assert not (tmp_path / "checkpoint.pt").exists()  # no checkpoint of an untrained model is written
    longer = RunSpec(dataclasses.replace(ToyConfig(), train=TrainConfig(epochs=16, eval_every=4)), "adamw", seed=0)
    with pytest.raises(ValueError, match="no checkpoint.pt to continue from.*another --out folder"):
        train_run(longer, toy_build_task, tmp_path, device="cpu", quiet=True)
    assert all((tmp_path / f).read_bytes() == b for f, b in files.items())  # the refused call changed nothing
    # companion: records that stop short of the end, with no checkpoint, cannot be continued: trained again
    recs = read_records(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))
    redo = train_run(spec, toy_build_task, tmp_path, device="cpu", quiet=True)
    assert redo.start_epoch == 0 and read_records(tmp_path / "metrics.jsonl") == recs


def test_run_directory_contents_and_frames_stay_on_the_manifold(tmp_path):
    spec = RunSpec(ToyConfig(batch_size=None), "stiefel", seed=0)
    res = train_run(spec, toy_build_task, tmp_path, device="cpu", quiet=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["arm"] == "stiefel" and config["config"]["train"]["epochs"] == 12
    env = json.loads((tmp_path / "environment.json").read_text())
    assert env[-1]["torch"] == torch.__version__ and env[-1]["device"] == "cpu" and "git_sha" in env[-1]
    assert "cpu_model" in env[-1] and isinstance(env[-1]["git_dirty"], (bool, type(None)))
    assert env[-1]["end_epoch"] == 12 and env[-1]["epochs_per_second"] > 0
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    w = state["model"]["w_q"]
    assert float((w.transpose(-1, -2) @ w - torch.eye(2)).abs().max()) < ORTHO_TOL_F32
    rec = res.final_record
    assert {"train_loss", "train_acc", "val_loss", "val_acc", "move_step/q", "angle_max_deg/k", "norm/euclidean"} <= set(rec)
    assert rec["move_total/q"] > 0
    with pytest.raises(ValueError, match="other settings .--n is 48 there, 50 now"):
        train_run(RunSpec(ToyConfig(batch_size=None, n=50), "stiefel", 0), toy_build_task, tmp_path, quiet=True)


def test_a_run_folder_is_trained_by_one_process_at_a_time(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    spec = RunSpec(ToyConfig(), "adamw", seed=0)
    (tmp_path / ".lock").write_text("pid 12345 on elsewhere\n")
    with open(tmp_path / ".lock", "a+") as held:  # another holder of the lock (a second open file description)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RuntimeError, match="another process .pid 12345"):
            train_run(spec, toy_build_task, tmp_path, device="cpu", quiet=True)
        assert not (tmp_path / "metrics.jsonl").exists()
    # companion: once the holder lets go, the same call trains
    assert train_run(spec, toy_build_task, tmp_path, device="cpu", quiet=True).completed


def test_paired_arms_share_data_and_non_attention_weights(tmp_path):
    results = [train_run(RunSpec(ToyConfig(), arm, seed=5), toy_build_task, tmp_path / arm, device="cpu", quiet=True,
                         stop_after_epochs=1) for arm in ("adamw", "stiefel")]
    first = [read_records(tmp_path / a / "metrics.jsonl")[0] for a in ("adamw", "stiefel")]
    assert first[0]["norm/readout.weight"] == first[1]["norm/readout.weight"]
    assert all(not r.completed for r in results)


@pytest.mark.slow  # two spawned processes each import torch: ~10 s of CPU, far more wall time on a busy machine
def test_parallel_workers_give_the_serial_records(tmp_path):
    specs = [RunSpec(ToyConfig(), arm, seed=1) for arm in ("adamw", "stiefel")]
    serial = run_jobs(specs, toy_build_task, tmp_path / "serial", workers=1, device="cpu", threads=1, quiet=True)
    parallel = run_jobs(specs, toy_build_task, tmp_path / "parallel", workers=2, device="cpu", threads=1, quiet=True)
    assert [r.name for r in parallel] == [s.name for s in specs] and all(r.completed for r in parallel + serial)
    for s in specs:
        assert (read_records(tmp_path / "serial" / "runs" / s.name / "metrics.jsonl")
                == read_records(tmp_path / "parallel" / "runs" / s.name / "metrics.jsonl"))
    with pytest.raises(ValueError, match="duplicate"):
        run_jobs(specs + specs[:1], toy_build_task, tmp_path / "dup", quiet=True)


def test_a_study_of_several_cells_hands_all_its_runs_to_one_pool(tmp_path, monkeypatch):
    """run_cells gives every (cell, arm, seed) to one run_placed_jobs call, so --workers keeps its processes busy
    across cells (a grid of one arm and one seed per lr was trained one run at a time before)."""
    from experiments.harness import study
    from experiments.harness.study import Cell, run_cells

    calls = []
    monkeypatch.setattr(study, "run_placed_jobs", lambda placed, build, options: calls.append(
        (list(placed), options.workers)) or [])
    cells = [Cell(ToyConfig(), subdir=f"lr-{i}") for i in range(3)]
    run_cells(cells, toy_build_task, tmp_path, arms=["adamw"], seeds=[0], workers=2, quiet=True)
    assert len(calls) == 1 and calls[0][1] == 2
    assert [d for _, d in calls[0][0]] == [tmp_path / f"lr-{i}" / "runs" / "adamw" / "seed0" for i in range(3)]


def test_runs_placed_in_one_folder_are_refused_before_any_training(tmp_path):
    from experiments.harness.jobs import run_placed_jobs

    spec = RunSpec(ToyConfig(), "adamw", seed=0)
    with pytest.raises(ValueError, match="share a folder"):
        run_placed_jobs([(spec, tmp_path / "a"), (RunSpec(ToyConfig(), "stiefel", 0), tmp_path / "a")],
                        toy_build_task)
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------------ records, plots, report
def _synthetic_records():
    recs = []
    curves = {("a", 0): [0.1, 0.5, 0.96, 0.97, 0.99], ("a", 1): [0.1, 0.2, 0.3, 0.96, 0.90],
              ("b", 0): [0.1, 0.96, 0.97, 0.98, 0.99], ("b", 1): [0.1, 0.4, 0.95, 0.96, 0.97]}
    for (arm, seed), accs in curves.items():
        for i, acc in enumerate(accs):
            recs.append({"experiment": "t", "arm": arm, "seed": seed, "epoch": 10 * i, "step": 10 * i,
                         "train_acc": 1.0, "val_acc": acc, "train_loss": 1 - acc, "val_loss": 1 - acc,
                         "move_total/q": 0.1 * i, "move_step/q": None if i == 0 else 0.01 * i,
                         "angle_max_deg/q": float(i), "angle_mean_deg/q": i / 2, "angle_max_deg/k": float(i),
                         "angle_mean_deg/k": i / 2, "norm/w": 1.0 + i, "norm/euclidean": 1.0 + i})
    return recs


def test_summary_statistics_written_out():
    s = summarize(_synthetic_records(), threshold=0.95, last_fraction=0.1)
    a, b = s["arms"]["a"], s["arms"]["b"]
    assert a["final"]["per_seed"] == {"0": 0.99, "1": 0.90}
    assert abs(a["final"]["mean"] - 0.945) < STAT_TOL
    assert abs(a["final"]["std"] - math.sqrt(((0.99 - 0.945) ** 2 + (0.90 - 0.945) ** 2) / 1)) < STAT_TOL
    assert a["first_epoch_reaching"]["per_seed"] == {"0": 20, "1": 30}
    assert b["first_epoch_reaching"]["per_seed"] == {"0": 10, "1": 20}
    # last 10% of 40 epochs = the evaluation at epoch 40 only (>= 36)
    assert a["stays_above"]["per_seed"] == {"0": True, "1": False} and a["stays_above"]["fraction"] == 0.5
    assert b["stays_above"]["fraction"] == 1.0
    assert a["tail_mean"]["per_seed"] == {"0": 0.99, "1": 0.90}
    assert a["tail_share_above"]["per_seed"] == {"0": 1.0, "1": 0.0}
    assert a["dips_after_reaching"]["per_seed"] == {"0": 0, "1": 1}
    s_wide = summarize(_synthetic_records(), threshold=0.95, last_fraction=0.5)  # epochs >= 20
    assert s_wide["arms"]["a"]["tail_share_above"]["per_seed"] == {"0": 1.0, "1": 1 / 3}
    assert abs(s_wide["arms"]["a"]["tail_mean"]["per_seed"]["1"] - (0.3 + 0.96 + 0.90) / 3) < STAT_TOL
    assert abs(a["mean_move_step/q"]["per_seed"]["0"] - (0.01 + 0.02 + 0.03 + 0.04) / 4) < STAT_TOL
    paired = s["paired"]["b - a"]
    ref = scipy.stats.ttest_rel([0.99, 0.97], [0.99, 0.90])
    assert abs(paired["t"] - ref.statistic) < 1e-9 and paired["n"] == 2 and paired["n_positive"] == 1


def _write_metrics(run_dir, records) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_study_records_come_from_seed_digit_folders_only(tmp_path):
    """``runs/<arm>/seed<digits>/`` only: a copy ``seed0-old`` or ``seed0.bak`` (its records name seed 0) is not read,
    so it cannot merge into seed 0's run; companion: ``seed12`` is a run (and the same copy under a seed name is
    refused as a duplicate, not merged)."""
    from experiments.harness.records import group_runs, load_study_records, run_paths, seed_of

    run = [{"arm": "a", "seed": 0, "epoch": e, "val_acc": 0.5 + e / 10} for e in range(3)]
    _write_metrics(tmp_path / "runs/a/seed0", run)
    for name in ("seed0-old", "seed0.bak", "seedx", "seed"):
        _write_metrics(tmp_path / "runs/a" / name, [{**r, "val_acc": 0.0} for r in run])
    assert load_study_records(tmp_path) == run
    assert group_runs(load_study_records(tmp_path)) == {"a": {0: run}}
    assert [p.parent.name for p in run_paths(tmp_path, "metrics.jsonl")] == ["seed0"]
    assert [seed_of(n) for n in ("seed0", "seed12", "seed0-old", "seed0.bak", "seed", "seedx", "xseed1")] == [
        0, 12, None, None, None, None, None]
    other = [{"arm": "a", "seed": 12, "epoch": e, "val_acc": 0.1} for e in range(3)]
    _write_metrics(tmp_path / "runs/a/seed12", other)  # companion: a seed folder is read
    assert group_runs(load_study_records(tmp_path)) == {"a": {0: run, 12: other}}
    assert [p.parent.name for p in run_paths(tmp_path, "metrics.jsonl", parent="*/a")] == ["seed0", "seed12"]


def test_group_runs_refuses_two_records_of_one_run_at_one_epoch():
    """Records of the same (arm, seed, epoch) twice are refused, naming them, not merged; companion: distinct
    epochs (in any order) group and sort."""
    from experiments.harness.records import InconsistentRecordsError, group_runs

    recs = [{"arm": "a", "seed": 1, "epoch": e} for e in (20, 0, 10)]
    assert [r["epoch"] for r in group_runs(recs)["a"][1]] == [0, 10, 20]  # companion
    with pytest.raises(InconsistentRecordsError, match=r"arm a seed 1 has more than one record at epoch 0, 20"):
        group_runs([*recs, {"arm": "a", "seed": 1, "epoch": 20}, {"arm": "a", "seed": 1, "epoch": 0},
                    {"arm": "b", "seed": 1, "epoch": 0}])
    assert set(group_runs([*recs, {"arm": "b", "seed": 1, "epoch": 20}, {"arm": "a", "seed": 2, "epoch": 20}])) == {
        "a", "b"}  # the same epoch in another arm or seed is no duplicate


def test_report_puts_measured_next_to_published_only_under_the_papers_protocol():
    paper = PaperReference("someone", 40, {"a": 0.123, "b": 0.456}, "one run", protocol={"p": 97, "train.epochs": 40})
    matching = {"p": 97, "train": {"epochs": 40, "eval_every": 10}}
    text = render_report(title="T", summary=summarize(_synthetic_records()), paper=paper, config=matching,
                         figures={"acc": "accuracy.png"}, notes=["careful"])
    assert "| a |" in text and "| b |" in text and "12.3%" in text and "45.6%" in text
    assert "94.5% ± 6.4%" in text  # arm a: mean and sd of 0.99 and 0.90
    assert "![acc](accuracy.png)" in text and "- careful" in text
    assert "does not follow" not in text
    # companion: another modulus, or runs that stopped before the paper's epoch, hide the published numbers
    other = render_report(title="T", summary=summarize(_synthetic_records()), paper=paper,
                          config={"p": 13, "train": {"epochs": 40}})
    assert "12.3%" not in other and "45.6%" not in other and "--p 13 here, 97 in the paper" in other
    early = PaperReference("someone", 20000, {"a": 0.123}, protocol={"p": 97})
    text = render_report(title="T", summary=summarize(_synthetic_records()), paper=early, config=matching)
    assert "12.3%" not in text and "Not every run has reached epoch 20000 yet** (last epochs: 40)" in text


def test_finalize_writes_summary_plots_and_report_from_run_folders(tmp_path):
    run_jobs([RunSpec(ToyConfig(), arm, 0) for arm in ("adamw", "stiefel")], toy_build_task, tmp_path,
             quiet=True, device="cpu")
    paper = PaperReference("someone", 12, {"stiefel": 0.97, "adamw": 0.611}, "one run", protocol={"n": 48})
    out = finalize_study(tmp_path, title="toy", config=ToyConfig(), arms=["adamw", "stiefel"], paper=paper)
    assert set(out.summary["summary"]["arms"]) == {"adamw", "stiefel"}
    assert set(out.figures) == {"accuracy", "overview", "weight_norms", "principal_angles", "movement"}
    assert all(p.stat().st_size > 5000 for p in out.figures.values())
    assert out.report_path.exists() and json.loads((tmp_path / "summary.json").read_text())["title"] == "toy"
    assert set(out.summary["speed"]) == {"adamw/seed0", "stiefel/seed0"}
    assert "97.0%" in out.report_path.read_text()


def test_a_field_added_later_is_recorded_only_when_it_differs_from_what_old_records_mean():
    from experiments.harness.config import OptimConfig, to_dict

    assert "adjust_lr_fn" not in to_dict(OptimConfig())  # old records were written without it
    rule = OptimConfig(adjust_lr_fn="match_rms_adamw")
    recorded = to_dict(rule)
    assert recorded["adjust_lr_fn"] == "match_rms_adamw"  # companion: a non-default value is recorded
    assert OptimConfig(**{**recorded, "betas": tuple(recorded["betas"])}) == rule
    assert OptimConfig(**{k: v for k, v in recorded.items() if k != "adjust_lr_fn"}).adjust_lr_fn == "original"
    with pytest.raises(ValueError, match="--adjust-lr-fn 'rms'"):
        OptimConfig(adjust_lr_fn="rms")


def test_dip_count_counts_separate_dips_and_the_evaluations_they_span():
    from experiments.harness.records import dip_count

    assert dip_count([0.5, 0.96, 0.9, 0.8, 0.97, 0.9], 0.95) == (2, 3)
    assert dip_count([0.5, 0.96, 0.97], 0.95) == (0, 0)
    assert dip_count([0.5, 0.6], 0.95) == (0, 0)  # never reached: nothing after it
    assert dip_count([0.96, 0.5, 0.96, 0.5, 0.96, 0.5], 0.95) == (3, 3)  # companion: alternating, every one a dip


def test_tail_records_include_both_ends_of_the_last_fraction():
    from experiments.harness.records import tail_records

    recs = [{"epoch": e} for e in range(0, 20001, 100)]
    tail = tail_records(recs, 0.1)
    assert (tail[0]["epoch"], tail[-1]["epoch"], len(tail)) == (18000, 20000, 21)
    assert tail_records([], 0.1) == []


def test_holm_adjustment_against_a_written_out_case():
    from experiments.harness.stats import holm, with_holm

    # sorted 0.01, 0.02, 0.04 -> 3*0.01, max(0.03, 2*0.02), max(0.04, 1*0.04)
    out = holm([0.04, 0.01, None, 0.02])
    assert out[2] is None and out[0] == pytest.approx(0.04) and out[1] == pytest.approx(0.03)
    assert out[3] == pytest.approx(0.04)
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    comps = with_holm({"a": {"p_value": 0.01, "sign_test_p": 0.5}, "b": {"p_value": 0.04, "sign_test_p": None}})
    assert comps["a"]["p_holm"] == pytest.approx(0.02) and comps["b"]["p_holm"] == pytest.approx(0.04)
    assert comps["b"]["sign_test_p_holm"] is None
    # companion: a single test is not adjusted
    assert holm([0.03]) == pytest.approx([0.03])


def test_each_studys_setup_text_names_the_frame_step_rule_when_it_is_not_the_papers():
    """A frame lr means a frame's step norm under adjust_lr_fn='original' (the studies' default) and a per-entry
    step under 'match_rms_adamw', √(dr) times larger: each study's report says which, so that one is not read as
    the other (companion: under the default rule the text is as before, with no rule named)."""
    from experiments.grokking.study import GrokkingConfig, _intro
    from experiments.harness.report import frame_rule_text
    from experiments.lm.study import LMConfig, _setup_paragraph
    from experiments.vision.study import VisionConfig
    from experiments.vision.study import _setup_paragraph as vision_setup

    texts = {
        "grokking": lambda o: _intro(GrokkingConfig(optim=o)),
        "lm": lambda o: _setup_paragraph(LMConfig(optim=o), ["stiefel"]),
        "vision": lambda o: vision_setup(VisionConfig(optim=o)),
    }
    for study, text in texts.items():
        paper, per_entry = text(OptimConfig()), text(OptimConfig(adjust_lr_fn="match_rms_adamw"))
        assert "adjust_lr_fn='match_rms_adamw'" in per_entry and "√(dr)" in per_entry, study
        assert "adjust_lr_fn" not in paper, study
    assert frame_rule_text(OptimConfig()) == ""
