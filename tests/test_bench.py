"""Smoke tests of the benchmark code (tiny sizes; no timing assertions)."""

import json
import math

import geoopt
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam, bench
from geoopt_stiefel_attention.cli import main

TINY = {64: (1, 2)}  # width 64, 1 layer, 2 heads of 32: two (2, 64, 32) frame stacks
STATE_RATIO_MAX = 1.01  # StiefelAdam's state over parameter bytes (issue #7)


def _tiny_step_results(arms=bench.STEP_ARMS):
    return bench.step_time_benchmark((64,), arms=arms, rounds=2, steps_per_round=1, warmup=1, configs=TINY,
                                     clock="cpu", threads=1)


def test_step_time_benchmark_reports_every_arm_and_memory():
    (res,) = _tiny_step_results()
    assert (res.width, res.depth, res.heads, res.head_dim, res.frames) == (64, 1, 2, 32, 4)
    assert res.param_bytes == 2 * 2 * 64 * 32 * 4
    for arm in bench.STEP_ARMS:
        t = res.timings[arm]
        if t.note:  # fused AdamW where torch lacks it, or a competitor that raised
            assert math.isnan(t.median_ms) and arm not in res.ratios
            continue
        assert t.median_ms > 0 and t.steps >= 2 and t.q1_ms <= t.median_ms <= t.q3_ms
        if arm != "stiefel":
            assert res.ratios[arm] > 0
    # state: first moment + one scalar per frame (+ step and skip counters) vs AdamW's two full buffers
    assert res.state_ratio["stiefel"] <= STATE_RATIO_MAX
    assert res.state_ratio["adamw_foreach"] > 1.99  # companion: the measure does see a 2x state
    # one reusable buffer: the two small stacks are staged together (frames, gradients, moments) plus scratch
    assert res.timings["stiefel"].workspace_bytes == 4 * res.param_bytes
    table = bench.format_step_table([res])
    assert table.count("\n") == 2 and "| 64 (1 x 2 x 32) |" in table


def test_step_time_benchmark_validates_arguments():
    with pytest.raises(ValueError, match="stiefel"):
        bench.step_time_benchmark((64,), arms=("adamw_foreach",), configs=TINY)
    with pytest.raises(ValueError, match="width"):
        bench.step_time_benchmark((100,), configs=TINY)
    with pytest.raises(ValueError, match="clock"):
        bench.step_time_benchmark((64,), arms=("stiefel",), configs=TINY, clock="sundial", rounds=1)


def test_a_failing_competitor_is_reported_not_fatal():
    calls = []

    def broken():
        raise RuntimeError("lu_solve: pivots must be >= 1\nsecond line")

    samples, failed = bench._interleave({"stiefel": lambda: calls.append(1), "geoopt-radam-canonical": broken},
                                        rounds=2, steps_per_round=2, warmup=1, clock="wall", device="cpu",
                                        required=("stiefel",))
    assert set(samples) == {"stiefel"} and [len(r) for r in samples["stiefel"]] == [2, 2] and len(calls) == 5
    assert failed == {"geoopt-radam-canonical": "failed: RuntimeError: lu_solve: pivots must be >= 1"}
    # companion: a failure of the arm under test is not swallowed
    with pytest.raises(RuntimeError, match="pivots"):
        bench._interleave({"stiefel": broken}, rounds=1, steps_per_round=1, warmup=1, clock="wall",
                          device="cpu", required=("stiefel",))


class _CountProducts(TorchDispatchMode):
    """Counts batched products whose operands include a ``d x r`` matrix (the expensive ones)."""

    def __init__(self, d):
        super().__init__()
        self.d, self.count = d, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.bmm.out, torch.ops.aten.baddbmm.default,
                    torch.ops.aten.baddbmm.out, torch.ops.aten.baddbmm_.default):
            if any(isinstance(a, torch.Tensor) and self.d in a.shape[-2:] for a in args):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _products_of_one_step(**opt_kwargs):
    st = PolarStiefel()
    gen = torch.Generator().manual_seed(0)
    params = [geoopt.ManifoldParameter(st.random(2, 64, 32, generator=gen), manifold=st) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = StiefelAdam(params, lr=1e-3, **opt_kwargs)
    opt.step()  # first step: orthonormality check, state
    with _CountProducts(64) as counter:
        opt.step()
    floor = bench._matmul_floor(params, [2] * len(params))
    with _CountProducts(64) as floor_counter:
        floor()
    return counter.count, floor_counter.count


def test_matmul_floor_runs_the_products_a_step_performs():
    step, floor = _products_of_one_step()
    assert step == floor == 6  # three small stacks batched into one call per product
    # companion: the per-column variant projects its step as well, two products the floor does not have
    step, floor = _products_of_one_step(second_moment="column")
    assert step > floor


def test_train_step_benchmark_tiny_models():
    results = bench.train_step_benchmark(rounds=1, steps_per_round=1, warmup=1, scale="tiny", clock="cpu",
                                         threads=1)
    assert [r.model for r in results] == list(bench.TRAIN_MODELS)
    for r in results:
        assert set(r.full_step) == set(r.optimizer_step) == {"adamw", "stiefel"}
        assert r.ratio > 0 and all(t.median_ms > 0 for t in r.full_step.values())
    assert "| tiny_transformer" in bench.format_train_table(results)
    with pytest.raises(ValueError, match="scale"):
        bench.train_step_benchmark(scale="huge")


def test_cli_bench_json(capsys):
    assert main(["bench", "step", "--widths", "128", "--arms", "stiefel", "adamw_foreach", "matmul_floor",
                 "--rounds", "1", "--steps", "1", "--threads", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["benchmark"] == "step" and doc["machine"]["torch"] == torch.__version__
    (row,) = doc["results"]
    assert row["width"] == 128 and set(row["ratios"]) == {"adamw_foreach", "matmul_floor"}
    assert main(["bench", "step", "--widths", "128", "--arms", "stiefel", "--rounds", "1", "--steps", "1"]) == 0
    assert "| 128 (2 x 4 x 32) |" in capsys.readouterr().out


def test_cli_hf_gpt2_without_transformers_is_a_usage_error(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["bench", "train", "--models", "hf_gpt2", "--rounds", "1", "--steps", "1"])
    assert exc.value.code == 2
    assert "--models hf_gpt2 needs HuggingFace transformers" in capsys.readouterr().err.strip().splitlines()[-1]


def test_train_step_benchmark_converted_hf_gpt2():
    pytest.importorskip("transformers")
    (res,) = bench.train_step_benchmark(("hf_gpt2",), rounds=1, steps_per_round=1, warmup=1, scale="tiny",
                                        clock="cpu")
    assert res.model == "hf_gpt2" and set(res.full_step) == {"adamw", "stiefel"}
    assert res.ratio > 0 and all(t.median_ms > 0 for t in res.full_step.values())
    with pytest.raises(ValueError, match="unknown"):
        bench.train_step_benchmark(("gpt3",), rounds=1, steps_per_round=1, scale="tiny")


# ------------------------------------------------------------------------------------- CLI user errors
BAD_COMMANDS = {
    "demo --lr -1": "argument --lr: must be a finite number > 0, got -1",
    "demo --lr nan": "argument --lr: must be a finite number > 0, got nan",
    "demo --steps -3": "argument --steps: must be an integer >= 1, got -3",
    "demo --heads 0": "argument --heads: must be an integer >= 1, got 0",
    "demo --r 65": "--r 65 exceeds --d 64",
    "bench --widths 0": "argument --widths: must be an integer >= 1, got 0",
    "bench --widths 100": "argument --widths: invalid choice: 100",
    "bench --rounds 0": "argument --rounds: must be an integer >= 1, got 0",
    "bench --steps x": "argument --steps: expected an integer, got 'x'",
    "bench --lr 0": "argument --lr: must be a finite number > 0, got 0",
    "bench --threads 0": "argument --threads: must be an integer >= 1, got 0",
    "bench --device nonsense": "--device 'nonsense' is not a torch device",
    "bench --device meta": "--device 'meta' is not available",
    "bench --arms adamw_foreach": "--arms must include 'stiefel'",
    "certify --steps 0": "argument --steps: must be an integer >= 1, got 0",
    "certify --optimizers nobody": "--optimizers: No optimizer column named 'nobody'",
}


@pytest.mark.parametrize("command", list(BAD_COMMANDS))
def test_cli_user_errors_are_one_line_exit_2(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(command.split())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stiefel-attention {command.split()[0]}: error: ") and BAD_COMMANDS[command] in last
    assert "Traceback" not in err


def test_cli_user_error_in_a_real_process_has_no_traceback():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "geoopt_stiefel_attention", "demo", "--steps", "-3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and "argument --steps" in proc.stderr.strip().splitlines()[-1]


def test_demo_accepts_valid_arguments(capsys):
    assert main(["demo", "--heads", "2", "--d", "6", "--r", "6", "--steps", "3", "--lr", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "StiefelAdam" in out and "geoopt RiemannianAdam" in out
