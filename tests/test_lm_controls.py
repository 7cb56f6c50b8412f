"""Tests of the language-model controls of issue 42: the ``adamw-qknorm`` arm, the every-step records
(``steps.jsonl``), the three-way split in each run's config, and the plan of ``experiments/lm/run_controls.sh``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import lm_cli

pytest.importorskip("transformers")

from experiments.harness.arms import get_arm  # noqa: E402
from experiments.harness.config import RunSpec  # noqa: E402
from experiments.harness.records import read_records  # noqa: E402
from experiments.lm.study import LMConfig, attention_step_stats, build_task, lm_param_groups  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: RMSNorm's eps (1e-6) moves a unit RMS by about eps / (2 mean square); q and k have mean squares above 1e-3 here
RMS_TOL = 1e-3
#: float32 logits against a float64 reference
F32_TOL = 1e-4

CONFIG = LMConfig(depth=2, width=32, heads=4, context=16, batch_size=4, steps_per_epoch=3, eval_windows=4,
                  train_eval_windows=4, eval_batch=4, probe_windows=2, val_fraction=0.2, test_fraction=0.2,
                  max_file_share=0.5)




# ---------------------------------------------------------------------------------------------- qk-norm
def _qk_fed_to_attention(arm: str, root: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The q and k that the model's attention multiplies, per layer, captured at torch's attention kernel (so the
    test does not rely on the arm's own code to say what it normalised)."""
    config = LMConfig(**{**CONFIG.__dict__, "corpus_root": root})
    task = build_task(RunSpec(config, arm, 0), get_arm(arm, "lm"), torch.device("cpu"))
    seen = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.detach(), k.detach()))
        return kernel(q, k, v, *args, **kwargs)

    x, _ = next(iter(task.train_data.batches(0)))
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        task.model(input_ids=x, use_cache=False)
    finally:
        torch.nn.functional.scaled_dot_product_attention = kernel
    assert len(seen) == config.depth
    return seen


def _per_head_rms(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().mean(dim=-1).sqrt()  # (B, H, T): RMS of each head's vector


def test_qknorm_arm_feeds_unit_rms_queries_and_keys_to_the_attention(varied_root):
    for q, k in _qk_fed_to_attention("adamw-qknorm", varied_root):
        for x in (q, k):
            assert torch.allclose(_per_head_rms(x), torch.ones((), dtype=torch.float64), atol=RMS_TOL)  # scale starts at 1: RMS 1


def test_plain_adamw_arm_does_not_normalise_queries_and_keys(varied_root):
    for q, k in _qk_fed_to_attention("adamw", varied_root):  # companion: GPT-2's init gives q, k RMS far from 1
        for x in (q, k):
            assert (_per_head_rms(x) - 1).abs().min() > 0.1


def test_qknorm_scales_are_learned_without_decay_and_the_other_weights_are_the_seeds(varied_root):
    config = LMConfig(**{**CONFIG.__dict__, "corpus_root": varied_root})
    plain = build_task(RunSpec(config, "adamw", 0), get_arm("adamw"), torch.device("cpu")).model
    normed = build_task(RunSpec(config, "adamw-qknorm", 0), get_arm("adamw-qknorm"), torch.device("cpu")).model
    extra = dict(normed.named_parameters())
    base = dict(plain.named_parameters())
    scales = sorted(set(extra) - set(base))
    assert scales == sorted(f"transformer.h.{i}.attn.qk_norm.{x}_norm.weight" for i in range(2) for x in "qk")
    assert all(torch.equal(extra[n], p) for n, p in base.items())  # paired with adamw by seed
    assert all(torch.equal(extra[n], torch.ones(8)) for n in scales)
    undecayed = {id(p) for g in lm_param_groups(normed, 0.1) if g["weight_decay"] == 0 for p in g["params"]}
    assert all(id(extra[n]) in undecayed for n in scales)


def test_the_probe_sees_the_normalised_logits(varied_root):
    from experiments.lm.study import AttentionProbe

    config = LMConfig(**{**CONFIG.__dict__, "corpus_root": varied_root})
    probe = torch.randint(0, 256, (2, 16))
    rms = {arm: AttentionProbe(probe).metrics(build_task(RunSpec(config, arm, 0), get_arm(arm),
                                                         torch.device("cpu")).model)["logit_rms/mean"]
           for arm in ("adamw", "adamw-qknorm")}
    # unit-RMS q, k of dimension r = 8 give logits q.k / sqrt(r) of RMS about 1 for random directions; GPT-2's init
    # gives far smaller ones
    assert 0.3 < rms["adamw-qknorm"] < 3 and rms["adamw"] < 0.3


# ---------------------------------------------------------------------------------------------- step records
def _reference_stats(qkv: torch.Tensor, heads: int, scaling: float) -> tuple[float, float]:
    """Loop-by-loop reference of the largest causal logit and the smallest head's mean entropy, in float64."""
    b, t, d3 = qkv.shape
    d, r = d3 // 3, d3 // 3 // heads
    x = qkv.double()
    largest, entropies = -math.inf, []
    for h in range(heads):
        total = 0.0
        for n in range(b):
            q = x[n, :, h * r:(h + 1) * r]
            k = x[n, :, d + h * r:d + (h + 1) * r]
            for i in range(t):
                s = scaling * (k[:i + 1] @ q[i])
                largest = max(largest, float(s.max()))
                p = torch.softmax(s, dim=0)
                total += float(-(p * p.log()).sum())
        entropies.append(total / (b * t))
    return largest, min(entropies)


def test_attention_step_stats_match_a_written_out_reference():
    torch.manual_seed(0)
    qkv = 3 * torch.randn(2, 6, 3 * 8)
    qkv[0, 5, 0] = 40.0  # one large query entry: a large logit in head 0 and a peaked head
    got = attention_step_stats(qkv, heads=2, scaling=0.5)
    want = _reference_stats(qkv, heads=2, scaling=0.5)
    assert got == pytest.approx(want, rel=F32_TOL, abs=F32_TOL)
    # companion: the maximum is over the causal logits only (a future key's larger logit is not counted)
    qkv2 = qkv.clone()
    qkv2[0, 0, 8:12] = 0.0
    qkv2[0, 5, 8:12] = 100.0  # key at the last position: only query 5 sees it
    qkv2[0, :5, 0:4] = 0.0
    qkv2[0, 5, 0:4] = 0.0
    assert attention_step_stats(qkv2, heads=2, scaling=0.5)[0] == pytest.approx(
        _reference_stats(qkv2, heads=2, scaling=0.5)[0], rel=F32_TOL)


def test_every_step_is_on_record_and_resuming_rewrites_no_step(varied_root, tmp_path):
    out = tmp_path / "s"
    assert lm_cli(varied_root, out, "--arms", "adamw", "adamw-qknorm", "--seeds", "0", "--epochs", "3",
                "--stop-after-epochs", "1", "--checkpoint-interval", "0", "--skip-report") == 0
    assert lm_cli(varied_root, out, "--arms", "adamw", "adamw-qknorm", "--seeds", "0", "--epochs", "3",
                "--skip-report") == 0
    whole = tmp_path / "w"
    assert lm_cli(varied_root, whole, "--arms", "adamw", "adamw-qknorm", "--seeds", "0", "--epochs", "3",
                "--skip-report") == 0
    for arm in ("adamw", "adamw-qknorm"):
        steps = read_records(out / "runs" / arm / "seed0" / "steps.jsonl")
        assert [s["step"] for s in steps] == list(range(9))  # 3 epochs of 3 steps, each once
        assert all(len(s["logit_max"]) == len(s["entropy_min"]) == 2 for s in steps)
        assert all(s["grad_norm"] > 0 and s["loss"] > 0 for s in steps)
        assert steps == read_records(whole / "runs" / arm / "seed0" / "steps.jsonl")  # resumed = uninterrupted
    # the records read the training forward: with q, k normalised the logits stay within c r max|g_q g_k| ...
    bound = 8 / math.sqrt(8) * 1.5
    assert max(max(s["logit_max"]) for s in read_records(whole / "runs/adamw-qknorm/seed0/steps.jsonl")) < bound


def test_step_records_hold_the_loss_and_the_gradient_norm_before_clipping(varied_root, tmp_path):
    out = tmp_path / "clip"
    assert lm_cli(varied_root, out, "--arms", "adamw", "--seeds", "0", "--epochs", "1", "--grad-clip", "1e-6",
                "--skip-report") == 0
    steps = read_records(out / "runs/adamw/seed0/steps.jsonl")
    assert all(s["grad_norm"] > 1e-3 for s in steps)  # the norm before clipping, not the clipped 1e-6
    assert steps[0]["loss"] == pytest.approx(math.log(256), rel=0.05)  # an untrained byte model: about ln 256
    # companion: without clipping the norm is still recorded, and the first step's (same weights, same batch) agrees
    free = tmp_path / "free"
    assert lm_cli(varied_root, free, "--arms", "adamw", "--seeds", "0", "--epochs", "1", "--grad-clip", "none",
                "--skip-report") == 0
    first = read_records(free / "runs/adamw/seed0/steps.jsonl")[0]
    assert first["grad_norm"] == pytest.approx(steps[0]["grad_norm"], rel=1e-5)
    assert first["loss"] == steps[0]["loss"]


# ---------------------------------------------------------------------------------------------- the split
def test_config_records_the_three_way_split_the_run_used(varied_root, tmp_path):
    from experiments.lm.heldout import split_of

    out = tmp_path / "split"
    assert lm_cli(varied_root, out, "--arms", "adamw", "--seeds", "0", "--epochs", "1", "--skip-report") == 0
    identity = json.loads((out / "runs/adamw/seed0/config.json").read_text())["config"]["corpus_identity"]
    files = [p.name for p in Path(varied_root).glob("*.py")]
    counts = {part: sum(split_of(f, 0.2, 0.2) == part for f in files) for part in ("train", "val", "test")}
    assert (identity["train_files"], identity["val_files"], identity["test_files"]) == (
        counts["train"], counts["val"], counts["test"])
    assert "three ways" in identity["split"] and "val_bytes" not in identity
    # companion: without a test split the config keeps the two-way split (validation files join training)
    plain = tmp_path / "plain"
    assert lm_cli(varied_root, plain, "--arms", "adamw", "--seeds", "0", "--epochs", "1", "--test-fraction", "0",
                  "--max-file-share", "0.03", "--skip-report") == 0  # the held-out filter back at its default
    two = json.loads((plain / "runs/adamw/seed0/config.json").read_text())["config"]["corpus_identity"]
    assert "test_files" not in two and two["train_files"] > counts["train"]


# ---------------------------------------------------------------------------------------------- the plan
def _plan(monkeypatch, tmp_path, grids: dict[str, dict[str, dict[float, dict[int, float]]]], confirm=None):
    """The stages of a two-arm protocol over synthetic grids (folder name -> arm -> lr -> seed -> val bpb)."""
    from experiments.lm import controls

    monkeypatch.setattr(controls, "read_grid", lambda folder: {"finals": grids.get(Path(folder).name, {}),
                                                               "unfinished": []})
    protocol = controls.Protocol({"adamw": (1e-3, 1e-2, 1e-1), "muon": (1e-3, 1e-2, 1e-1)},
                                 {400: ("adamw", "muon")}, 2000, confirm)
    return {st.name: st for st in controls.stages(tmp_path / "study", protocol)}


def _call_arms_lrs(call):
    return call[call.index("--arms") + 1:call.index("--lrs")], [float(v) for v in
                                                                call[call.index("--lrs") + 1:call.index("--seeds")]]


def _bowl(lrs, best, seeds=(0, 1)):
    return {lr: {s: 2 + abs(math.log10(lr / best)) for s in seeds} for lr in lrs}


def test_plan_trains_every_arms_coarse_grid_seed_by_seed_before_anything_else(monkeypatch, tmp_path):
    plan = _plan(monkeypatch, tmp_path, {})
    assert list(plan) == ["coarse, seed 0", "extend, refine, warm-up, final, timing"]
    (call,) = plan["coarse, seed 0"].calls  # both arms share their grid: one call keeps the workers busy
    assert call[-7:] == ("--lrs", "0.001", "0.01", "0.1", "--seeds", "0", "--skip-report")
    assert len(plan["coarse, seed 0"].runs) == 6


def test_plan_extends_an_edge_then_refines_at_root_three_then_warms_up_around_the_optimum(monkeypatch, tmp_path):
    coarse = {"adamw": _bowl((1e-3, 1e-2, 1e-1), 1e-2), "muon": _bowl((1e-3, 1e-2, 1e-1), 1e-1)}
    plan = _plan(monkeypatch, tmp_path, {"study": coarse})
    assert [c[c.index("--arms") + 1:c.index("--lrs")] + c[c.index("--lrs") + 1:c.index("--seeds")]
            for c in plan["extend"].calls] == [("muon", "1")]  # muon's best is at the top edge
    coarse["muon"].update(_bowl((1.0,), 1e-1))
    plan = _plan(monkeypatch, tmp_path, {"study": coarse})
    assert not plan["extend"].calls
    lrs = {r.split(" lr ")[1].split()[0] for r in plan["refine"].runs if "adamw" in r}
    assert lrs == {f"{1e-2 / math.sqrt(3):g}", f"{1e-2 * math.sqrt(3):g}"}
    for arm, best in (("adamw", 1e-2), ("muon", 1e-1)):
        coarse[arm].update(_bowl((best / math.sqrt(3), best * math.sqrt(3)), best))
    plan = _plan(monkeypatch, tmp_path, {"study": coarse})
    calls = plan["warm-up 400 steps"].calls
    assert all(call[call.index("--warmup-fraction") + 1] == "0.2" and call[1].endswith("warmup-400") for call in calls)
    planned = dict(_call_arms_lrs(call) for call in calls)  # every arm, each at the three lrs around its optimum
    assert planned[("adamw",)] == pytest.approx([1e-2 / math.sqrt(3), 1e-2, 1e-2 * math.sqrt(3)], rel=1e-5)
    assert planned[("muon",)] == pytest.approx([1e-1 / math.sqrt(3), 1e-1, 1e-1 * math.sqrt(3)], rel=1e-5)
    assert list(plan)[-1] == "final, timing"
    # the warm-up grid of one arm alone does not reach the final cell: the other arm is tuned as finely
    warm = {"adamw": _bowl((1e-2 / math.sqrt(3), 1e-2, 1e-2 * math.sqrt(3)), 1e-2)}
    plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})
    assert [_call_arms_lrs(c)[0] for c in plan["warm-up 400 steps"].calls] == [("muon",)]
    assert "final" not in plan
    # companion: with both warm-up grids on record the plan reaches the final cell, on ten seeds disjoint from the
    # grid's
    warm["muon"] = _bowl((1e-1 / math.sqrt(3), 1e-1, 1e-1 * math.sqrt(3)), 1e-1)
    plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})
    calls = plan["final"].calls
    seeds = [call[call.index("--final-seeds") + 1:call.index("--skip-report")] for call in calls]
    assert seeds == [(str(s), str(s + 1)) for s in range(1, 11, 2)]  # two seeds a call, in order, none of the grid's
    assert all(call[call.index("--arms") + 1:call.index("--seeds")] == ("adamw", "muon") for call in calls)


def test_plan_trains_the_final_cell_seed_by_seed_so_a_stopped_cell_holds_whole_pairs(monkeypatch, tmp_path):
    """With adamw seeds 1-10 and muon seeds 1-2 and 4 on record, the calls train muon's seeds 3 and 5 (4 is on
    record), then 6 and 7, ...: whole pairs early, not all of one arm's seeds first; seeds that miss different arms
    do not share a call. Companion: a finished cell has no final call and plans the timing pass."""
    from experiments.lm import controls

    coarse = {"adamw": _bowl((1e-3, 1e-2, 1e-1, 1e-2 / math.sqrt(3), 1e-2 * math.sqrt(3)), 1e-2),
              "muon": _bowl((1e-3, 1e-2, 1e-1, 1e-2 / math.sqrt(3), 1e-2 * math.sqrt(3)), 1e-2)}
    warm = {a: _bowl((1e-2 / math.sqrt(3), 1e-2, 1e-2 * math.sqrt(3)), 1e-2) for a in ("adamw", "muon")}
    done = {"adamw": {s: 2.0 for s in range(1, 11)}, "muon": {1: 2.0, 2: 2.0, 4: 2.0}}
    monkeypatch.setattr(controls, "_finished", lambda folder: (done, []))
    calls = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})["final"].calls
    assert [(c[c.index("--arms") + 1:c.index("--seeds")], c[c.index("--final-seeds") + 1:-1]) for c in calls] == [
        (("muon",), ("3", "5")), (("muon",), ("6", "7")), (("muon",), ("8", "9")), (("muon",), ("10",))]
    done["adamw"].pop(5)  # seed 5 misses both arms, seed 6 only muon: they do not share a call
    calls = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})["final"].calls
    assert [(c[c.index("--arms") + 1:c.index("--seeds")], c[c.index("--final-seeds") + 1:-1]) for c in calls][1:3] == [
        (("adamw", "muon"), ("5",)), (("muon",), ("6", "7"))]
    done["adamw"][5] = 2.0
    done["muon"].update({s: 2.0 for s in (3, *range(5, 11))})
    plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})
    assert not plan["final"].calls and plan["timing"].calls


def test_plan_takes_a_refined_point_recorded_at_six_digits_as_on_record(monkeypatch, tmp_path):
    # lrs travel as %g text: a refined best recorded as 0.0173205 plans best / sqrt(3) = 0.0099999955 and
    # best * sqrt(3) = 0.0300000..., which are the recorded grid points 0.01 and 0.03, not new runs
    recorded = lambda v: float(f"{v:g}")  # noqa: E731
    refined = recorded(1e-2 * math.sqrt(3))
    coarse = {"adamw": _bowl((1e-3, 1e-2, 1e-1, 3e-2), refined), "muon": _bowl((1e-3, 1e-2, 1e-1), 1e-2)}
    coarse["adamw"].update(_bowl((recorded(1e-2 / math.sqrt(3)), refined), refined))
    coarse["muon"].update(_bowl((recorded(1e-2 / math.sqrt(3)), refined), 1e-2))
    plan = _plan(monkeypatch, tmp_path, {"study": coarse})
    assert not plan["refine"].calls, plan["refine"].runs
    planned = dict(_call_arms_lrs(call) for call in plan["warm-up 400 steps"].calls)
    assert planned[("adamw",)] == [1e-2, refined, 3e-2]
    # companion: a point that was not trained (0.1 / sqrt(3) between 1e-2 and 1e-1 for a best at 0.1) is planned
    coarse["adamw"] = _bowl((1e-3, 1e-2, 1e-1, 1.0), 1e-1)
    plan = _plan(monkeypatch, tmp_path, {"study": coarse})
    assert {r.split(" lr ")[1].split()[0] for r in plan["refine"].runs if "adamw" in r} == {"0.057735", "0.173205"}


def test_the_committed_level_grid_plans_no_run_it_holds():
    from experiments.lm import controls

    out = ROOT / "experiments/lm/records/level"
    if not (out / "lr-0.0173205").is_dir():
        pytest.skip("the level study's grid records are not in this checkout")
    plan = controls.stages(out, controls.read_protocol(ROOT / "experiments/lm/configs/level.args"))
    grids = {out.name: controls.read_grid(out)["finals"]}
    for folder in out.glob("warmup-*"):
        grids[folder.name] = controls.read_grid(folder)["finals"]
    planned = 0
    for stage in plan:
        for run in stage.runs:
            folder, what = run.split(": ")
            arm, lr, seed = what.split()[::2]
            planned += 1
            assert not any(math.isclose(float(lr), x, rel_tol=1e-5) and int(seed) in per
                           for x, per in grids.get(folder, {}).get(arm, {}).items()), (stage.name, run)
    assert planned or plan[-1].waiting  # the study is either still planning runs or waits on a stage


def test_protocol_refuses_a_knob_tuned_for_some_arms_only(tmp_path):
    """Tune symmetrically (issue 57): the committed controls study offered warm-up 400 to adamw and adamw-qknorm
    only, and its args file is refused now, naming the arms left out; the level study's, which names every arm,
    is read (companion)."""
    from experiments.lm import controls

    with pytest.raises(ValueError, match=r"but not of muon, stiefel, stiefeladam-muon, stiefelmuon-muon: a knob tuned"):
        controls.read_protocol(ROOT / "experiments/lm/configs/controls.args")
    with pytest.raises(ValueError, match="but not of muon"):
        controls.Protocol({"adamw": (1e-2,), "muon": (1e-2,)}, {400: ("adamw",)}, 2000)
    level = controls.read_protocol(ROOT / "experiments/lm/configs/level.args")
    assert all(set(arms) == set(level.grids) for arms in level.warmups.values())
    assert "stiefel-gain" in level.grids and level.confirm == (11, 3)
    res = subprocess.run([sys.executable, "-m", "experiments.lm.controls", "plan", str(tmp_path),
                          str(ROOT / "experiments/lm/configs/controls.args")], capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "a knob tuned" in res.stderr


def test_protocol_refuses_a_second_seed_that_is_a_grid_or_final_seed():
    from experiments.lm import controls

    for seed in (0, 1, 10):
        with pytest.raises(ValueError, match="second selection seed"):
            controls.Protocol({"adamw": (1e-2,)}, {}, 2000, (seed, 3))
    assert controls.Protocol({"adamw": (1e-2,)}, {}, 2000, (11, 3)).confirm == (11, 3)  # companion


def test_plan_confirms_each_arms_three_best_points_over_lr_and_warm_up_on_a_second_seed(monkeypatch, tmp_path):
    """After the warm-up grids, seed 11 at each arm's three best points (ranked on seed 0 over the study's own grid
    and the warm-up grid together), in the folder of each point; then the final cell, selecting on both seeds
    (``--confirm 11 3``). Companion: without '# confirm' the same records go straight to the final cell, without
    the flag."""
    r3 = math.sqrt(3)
    lrs = (1e-3, 1e-2 / r3, 1e-2, 1e-2 * r3, 1e-1)
    coarse = {a: _bowl(lrs, 1e-2, seeds=(0,)) for a in ("adamw", "muon")}
    coarse["muon"][1e-2 * r3][0] = math.nan  # a diverged point ranks last (it would be second otherwise)
    warm = {"adamw": {1e-2 / r3: {0: 1.5}, 1e-2: {0: 1.0}, 1e-2 * r3: {0: 1.5}},  # adamw: warm-up 400 wins
            "muon": {1e-2 / r3: {0: 9.5}, 1e-2: {0: 9.0}, 1e-2 * r3: {0: 9.5}}}  # muon: its own warm-up wins
    with pytest.warns(UserWarning, match="diverged"):
        plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm}, confirm=(11, 3))
    assert "final" not in plan and list(plan)[-1] == "final, timing"
    got = {}
    for name, stage in plan.items():
        if name.startswith("second seed"):
            for call in stage.calls:
                assert call[call.index("--seeds") + 1:call.index("--skip-report")] == ("11",)
                assert ("--warmup-fraction" in call) == Path(call[1]).name.startswith("warmup-")
                arms, values = _call_arms_lrs(call)
                for arm in arms:
                    got.setdefault((Path(call[1]).name, arm), []).extend(values)
    assert sorted(got) == [("study", "muon"), ("warmup-400", "adamw")]
    assert got[("warmup-400", "adamw")] == pytest.approx([1e-2 / r3, 1e-2, 1e-2 * r3])
    assert got[("study", "muon")] == pytest.approx([1e-3, 1e-2 / r3, 1e-2])  # not the diverged 1e-2 r3
    # with seed 11 on record at those points the plan stops, waiting on the two-seed selection
    for (folder, arm), values in got.items():
        grid = coarse if folder == "study" else warm
        for v in values:
            grid[arm][min(grid[arm], key=lambda x: abs(math.log(x / v)))][11] = 2.0
    with pytest.warns(UserWarning, match="diverged"):
        plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm}, confirm=(11, 3))
    assert not any(st.calls for name, st in plan.items() if name.startswith("second seed"))
    calls = plan["final"].calls  # the final cell selects on both seeds
    assert calls and all(c[c.index("--confirm") + 1:c.index("--confirm") + 3] == ("11", "3") for c in calls)
    # companion: no second seed in the protocol, and the same records reach the final cell
    with pytest.warns(UserWarning, match="diverged"):
        calls = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})["final"].calls
    assert calls and not any("--confirm" in c for c in calls)


def test_plan_extends_a_warm_up_grid_whose_best_lr_is_at_its_edge(monkeypatch, tmp_path):
    r3 = math.sqrt(3)
    coarse = {"adamw": _bowl((1e-3, 1e-2 / r3, 1e-2, 1e-2 * r3, 1e-1), 1e-2),
              "muon": _bowl((1e-3, 1e-2 / r3, 1e-2, 1e-2 * r3, 1e-1), 1e-2)}
    # with 400 warm-up steps adamw's best is the lowest of its three points: the next lower lr of its own grid
    warm = {"adamw": _bowl((1e-2 / r3, 1e-2, 1e-2 * r3), 1e-3), "muon": _bowl((1e-2 / r3, 1e-2, 1e-2 * r3), 1e-2)}
    plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})
    (call,) = plan["warm-up 400 steps"].calls
    assert call[call.index("--arms") + 1:call.index("--seeds")] == ("adamw", "--lrs", "0.001")
    assert list(plan)[-1] == "final, timing"
    # beyond the arm's grid (best at 1e-3, its lowest lr): the edge / sqrt(3)
    warm["adamw"][1e-3] = {0: 1.0, 1: 1.0}
    plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})
    (call,) = plan["warm-up 400 steps"].calls
    assert float(call[call.index("--lrs") + 1]) == pytest.approx(1e-3 / r3, rel=1e-5)
    # companion: an optimum inside the warm-up grid needs no more points, and the plan reaches the final cell
    warm["adamw"] = _bowl((1e-2 / r3, 1e-2, 1e-2 * r3), 1e-2)
    plan = _plan(monkeypatch, tmp_path, {"study": coarse, "warmup-400": warm})
    assert not plan["warm-up 400 steps"].calls and plan["final"].calls


def test_recipe_takes_a_warm_up_point_only_when_its_validation_mean_is_lower():
    from experiments.lm.tuned import select_recipes

    selection = {"arms": {"adamw": {"best_lr": 1e-2, "best_mean": 2.0, "seeds": [0, 1]}}}
    warm = {400: {"warmup_fraction": 0.2, "grid": {"finals": {"adamw": {3e-3: {0: 1.9, 1: 1.95}}}}}}
    assert select_recipes(selection, warm)["adamw"] == {"lr": 3e-3, "warmup_steps": 400, "warmup_fraction": 0.2,
                                                        "mean": pytest.approx(1.925)}
    warm[400]["grid"]["finals"]["adamw"][3e-3] = {0: 1.9}  # companion: a point missing a seed is no candidate
    assert select_recipes(selection, warm)["adamw"]["warmup_steps"] is None


def test_run_controls_usage_errors_are_one_line_exit_2():
    script = ROOT / "experiments/lm/run_controls.sh"
    for args in ([], ["no-such-commit", "/tmp/x"], ["HEAD", "/tmp/x", "0"]):
        res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)


def test_run_trust_region_usage_errors_are_one_line_exit_2(tmp_path):
    """experiments/lm/run_trust_region.sh (issue 40's language-model check): a wrong call names what is wrong in one
    line, exits 2 and creates nothing; companion: the script parses (bash -n)."""
    script = ROOT / "experiments/lm/run_trust_region.sh"
    for args in ([], ["no-such-commit", str(tmp_path / "wt"), str(tmp_path / "out")], ["HEAD", str(tmp_path / "wt")]):
        res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
    assert not any(tmp_path.iterdir())
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def _args_config(name):
    import argparse

    from experiments.lm.study import STUDY, config_from_args

    text = (Path(__file__).resolve().parents[1] / "experiments/lm/configs" / name).read_text()
    flags = [w for ln in text.splitlines() if not ln.startswith("#") for w in ln.split()]
    parser = argparse.ArgumentParser()
    STUDY.add_arguments(parser)
    return config_from_args(parser.parse_args(flags))


def test_controls_args_run_the_library_default_trust_radius_and_tuned_args_the_radius_its_runs_had():
    """The controls study's frame arms step with StiefelAdam's own default radius (auto: 1 in frame units under
    match_rms_adamw); tuned.args gives the radius its runs had before issue 40 (0.1 sqrt(d r) for 128 x 32 frames),
    not the 0.1 that today caps every step (the companion: that number parsed as it now reads)."""
    import inspect

    from geoopt_stiefel_attention import StiefelAdam
    from geoopt_stiefel_attention._linalg import trust_radius

    controls = _args_config("controls.args").optim
    default = inspect.signature(StiefelAdam).parameters["trust_region"].default
    assert controls.adjust_lr_fn == "match_rms_adamw"
    assert controls.trust_region == trust_radius(default, controls.adjust_lr_fn) == 1.0
    tuned = _args_config("tuned.args")
    d, r = tuned.width, tuned.width // tuned.heads
    assert tuned.optim.trust_region == math.sqrt(d * r) * 0.1 == 6.4
    # a frame step is about lr sqrt(d r): at the controls grid's smallest lr it is 0.19, so a radius of 0.1 binds
    assert math.sqrt(d * r) * 3e-3 > 0.1 and math.sqrt(d * r) * 3e-3 < controls.trust_region


# ---------------------------------------------------------------------------------------------- blind to test
def _perturbed_grid_copy(tmp_path: Path, key: str) -> Path:
    """A copy of the committed controls grid (metrics only) with every grid run's ``key`` at its last evaluation
    moved, ranked the other way round from the recorded values (the best becomes the worst)."""
    from experiments.lm.tuned import read_grid

    src = ROOT / "experiments/lm/records/controls"
    out = tmp_path / "controls"
    finished = []
    for metrics in sorted(src.glob("lr-*/runs/*/seed*/metrics.jsonl")):
        run = out / metrics.parent.relative_to(src)
        run.mkdir(parents=True)
        (run / "config.json").write_bytes((metrics.parent / "config.json").read_bytes())
        finished.append(run / "metrics.jsonl")
        (run / "metrics.jsonl").write_bytes(metrics.read_bytes())
    grid = read_grid(out)
    assert sum(len(v) for lrs in grid["finals"].values() for v in lrs.values()) >= 4, "too few grid runs to test"
    for path in finished:
        recs = read_records(path)
        if recs and recs[-1].get(key) is not None:
            recs[-1][key] = 10.0 - recs[-1][key]
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out


@pytest.mark.filterwarnings("ignore:lr selection on an incomplete grid")  # the grid is still training
def test_the_selection_never_reads_the_grid_test_numbers(tmp_path):
    """The grid runs evaluate the test split too (the runner evaluates every held-out set); the selection must not
    see it: with every grid run's final test bpb ranked the other way round, each arm's selected lr is the same."""
    from experiments.lm.tuned import read_grid, select_lrs

    recorded = select_lrs(read_grid(ROOT / "experiments/lm/records/controls"))
    assert select_lrs(read_grid(_perturbed_grid_copy(tmp_path, "test_bpb"))) == recorded


@pytest.mark.filterwarnings("ignore:lr selection on an incomplete grid")
def test_companion_the_selection_follows_the_grid_validation_numbers(tmp_path):
    """Ranked the other way round, the validation numbers move the selection of every arm with two or more lrs."""
    from experiments.lm.tuned import read_grid, select_lrs

    grid = read_grid(ROOT / "experiments/lm/records/controls")
    recorded = select_lrs(grid)["arms"]
    flipped = select_lrs(read_grid(_perturbed_grid_copy(tmp_path, "val_bpb")))["arms"]
    several = [a for a, lrs in grid["finals"].items() if a in recorded and sum(1 for s in lrs.values() if s) > 1]
    assert several and all(flipped[a]["best_lr"] != recorded[a]["best_lr"] for a in several)


def test_two_seed_recipe_is_the_lowest_two_seed_mean_among_the_first_seeds_best_points():
    """confirm_recipes: the three best points on seed 0 (own grid and warm-up grid together), then the lowest mean
    over seeds 0 and 11; a point outside the three is never chosen, however good its seed-11 number. Companions: a
    candidate missing seed 11 is refused by name; the one-seed rule (select_recipes) would pick another point."""
    from experiments.lm.tuned import IncompleteSelectionError, confirm_recipes, select_lrs, select_recipes

    grid = {"finals": {"adamw": {1e-3: {0: 2.30, 11: 1.00}, 3e-3: {0: 2.10, 11: 2.40}, 1e-2: {0: 2.20, 11: 2.20},
                                 3e-2: {0: 2.50}}}, "unfinished": []}
    warm = {400: {"warmup_fraction": 0.2, "grid": {"finals": {"adamw": {3e-3: {0: 2.15, 11: 2.16}}}}}}
    got = confirm_recipes(grid, warm, arms=["adamw"], seeds=(0, 11), points=3)["adamw"]
    assert (got["lr"], got["warmup_steps"]) == (3e-3, 400)  # mean 2.155 against 2.20 (1e-2) and 2.25 (own 3e-3)
    assert got["mean"] == pytest.approx(2.155) and got["per_seed"] == {"0": 2.15, "11": 2.16}
    assert [(p["lr"], p["warmup_steps"]) for p in got["points"]] == [(3e-3, None), (3e-3, 400), (1e-2, None)]
    assert all(p["lr"] != 1e-3 for p in got["points"])  # fourth on seed 0: not a candidate
    one_seed = select_recipes(select_lrs(grid, arms=["adamw"], seeds=[0]), warm)["adamw"]
    assert (one_seed["lr"], one_seed["warmup_steps"]) == (3e-3, None)  # companion: seed 0 alone picks another point
    del grid["finals"]["adamw"][1e-2][11]
    with pytest.raises(IncompleteSelectionError, match=r"adamw at lr 0.01 seed 11"):
        confirm_recipes(grid, warm, arms=["adamw"], seeds=(0, 11), points=3)


def test_lm_confirm_flag_usage_errors_are_one_line_exit_2():
    for extra, words in ((["--confirm", "11", "3"], "pass --final-seeds or --time-steps"),
                         (["--confirm", "1", "3", "--final-seeds", "1", "2"], "SEED must be neither"),
                         (["--confirm", "11", "0", "--final-seeds", "1", "2"], "POINTS >= 1")):
        res = subprocess.run([sys.executable, "-m", "experiments", "lm", "--out", "/tmp/nowhere-confirm", "--seeds",
                              "0", *extra], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 2, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr and "--confirm" in res.stderr


def test_planner_splits_a_call_into_one_call_per_run_in_training_order():
    """``next --per-run``: a grid call becomes one call per seed, arm and lr, a final call one per final seed and arm
    (seed by seed: whole pairs first), every other flag in place; the timing pass stays one call. Companion: the
    split calls train exactly the runs of the call (the cross product), none twice."""
    from experiments.lm import controls

    grid = ("--out", "/s/warmup-400", "--warmup-fraction", "0.2", "--arms", "a", "b", "--lrs", "0.01", "0.03",
            "--seeds", "0", "--skip-report")
    calls = controls.per_run(grid)
    assert calls[0] == ("--out", "/s/warmup-400", "--warmup-fraction", "0.2", "--arms", "a", "--lrs", "0.01",
                        "--seeds", "0", "--skip-report")
    assert [(c[5], c[7]) for c in calls] == [("a", "0.01"), ("a", "0.03"), ("b", "0.01"), ("b", "0.03")]
    final = ("--out", "/s", "--arms", "a", "b", "--seeds", "0", "--confirm", "11", "3", "--final-seeds", "1", "2",
             "--skip-report")
    calls = controls.per_run(final)
    assert [(c[3], c[c.index("--final-seeds") + 1]) for c in calls] == [("a", "1"), ("b", "1"), ("a", "2"), ("b", "2")]
    assert all(c[c.index("--confirm"):c.index("--confirm") + 3] == ("--confirm", "11", "3") and len(c) == 12
               for c in calls)
    timing = ("--out", "/s", "--arms", "a", "b", "--seeds", "0", "--time-steps", "20", "--skip-report")
    assert controls.per_run(timing) == [timing]


def _stub_python(bin_dir: Path, fail_arm: str = "") -> Path:
    """A ``python`` for run_controls.sh: the planner hands out three single-run calls once, each ``lm`` call logs its
    start and end (and appends itself to its folder's study.json, as the harness does), ``fail_arm`` fails."""
    log = bin_dir / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
case "$2" in
  experiments.lm.carry) exit 0 ;;
  experiments.lm.controls)
    out=$5
    [[ -e $out/.planned ]] && exit 0
    touch "$out/.planned"
    for arm in a b c; do echo "--out $out/g --arms $arm --lrs 0.01 --seeds 0 --skip-report"; done
    exit 0 ;;
esac
[[ " $* " == *" --report-only "* ]] && exit 0
args="$*"; folder=${{args#*--out }}; folder=${{folder%% *}}; arm=${{args#*--arms }}; arm=${{arm%% *}}
mkdir -p "$folder"; echo "\\"python -m experiments lm ${{*:4}}\\"," >> "$folder/study.json"
echo "start $arm $*" >> {log}
sleep 3
echo "end $arm" >> {log}
[[ $arm != "{fail_arm}" ]]
""")
    (bin_dir / "python").chmod(0o755)
    return log


def _run_controls_in_a_scratch_repo(tmp_path: Path, jobs: str, fail_arm: str = ""):
    repo = tmp_path / "repo"
    (repo / "experiments/lm/configs").mkdir(parents=True)
    shutil.copy(ROOT / "experiments/lm/run_controls.sh", repo / "experiments/lm/run_controls.sh")
    (repo / "experiments/lm/configs/t.args").write_text("# grid a 0.01\n--epochs 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q", str(repo)], check=True)
    subprocess.run(git + ["-C", str(repo), "add", "."], check=True)
    subprocess.run(git + ["-C", str(repo), "commit", "-qm", "t"], check=True)
    log = _stub_python(tmp_path / "bin", fail_arm)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "STUDY": "t"}
    res = subprocess.run(["bash", "experiments/lm/run_controls.sh", "HEAD", str(tmp_path / "wt"), jobs], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=120)
    events = log.read_text().splitlines() if log.exists() else []
    return res, events


def _most_at_once(events: list[str]) -> int:
    running = most = 0
    for e in events:
        running += 1 if e.startswith("start") else -1
        most = max(most, running)
    return most


def test_run_controls_keeps_jobs_single_run_calls_running_at_once(tmp_path):
    """Three single-run calls with JOBS 2: two run at once, never three, each with one worker, each recorded once in
    study.json; companion: with JOBS 1 they run one after the other."""
    res, events = _run_controls_in_a_scratch_repo(tmp_path / "two", "2")
    assert res.returncode == 0, res.stderr
    starts = [e for e in events if e.startswith("start")]
    assert len(starts) == 3 and all("--workers 1 " in e for e in starts)
    assert _most_at_once(events) == 2
    study = (tmp_path / "two/repo/experiments/lm/records/t/g/study.json").read_text().splitlines()
    assert len(study) == 3 and len(set(study)) == 3
    res, events = _run_controls_in_a_scratch_repo(tmp_path / "one", "1")
    assert res.returncode == 0 and len(events) == 6 and _most_at_once(events) == 1


def test_run_controls_stops_when_a_training_call_fails(tmp_path):
    """A failed call does not stop the calls already running, but the script then exits 1, naming the log, and
    writes no report."""
    res, events = _run_controls_in_a_scratch_repo(tmp_path, "2", fail_arm="b")
    assert res.returncode == 1 and "a training call failed" in res.stderr
    assert sum(e.startswith("end") for e in events) == 3  # every started call ran to its end
    assert "=== done" not in (tmp_path / "repo/experiments/lm/records/t/log.txt").read_text()
