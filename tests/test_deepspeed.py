"""DeepSpeed on the CPU: ZeRO stage 0 trains the frames on the manifold; stages 1-3, which hand the optimizer
flattened fp32 partitions (so no parameter it sees is a frame any more), are refused at the first step, in one
sentence naming the cause and the fix, before anything changes.

DeepSpeed initialises ``torch.distributed`` in the process that calls it, so the scenario runs in a subprocess
(one rank, gloo on 127.0.0.1), one fresh model per stage, and reports what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("deepspeed")

_SCRIPT = textwrap.dedent(r'''
    import json, os, socket, sys
    import torch
    from torch import nn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from geoopt_stiefel_attention import StiefelAdam, frame_parameters, param_groups, stiefelize
    from geoopt_stiefel_attention._linalg import orthonormality_error

    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        stiefelize(model)
        opt = StiefelAdam(param_groups(model), lr=1e-2)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        x, target = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
        start = [p.detach().clone() for p in frame_parameters(model)]
        result = {"error": None, "steps": 0}
        try:
            for _ in range(3):
                engine.backward((engine(x) - target).square().mean())
                before = [p.detach().clone() for p in model.parameters()]
                engine.step()
                result["steps"] += 1
        except RuntimeError as e:
            result["error"] = str(e)
            result["unchanged"] = all(a.shape == p.shape and torch.equal(a, p.detach())
                                      for a, p in zip(before, model.parameters()))
        frames = frame_parameters(model)
        if stage < 3:  # ZeRO-3 leaves the module's parameters as empty placeholders between forward passes
            result["off"] = max(float(orthonormality_error(p)) for p in frames)
            result["moved"] = max(float((p.detach() - s).abs().max()) for p, s in zip(frames, start))
        out[stage] = result
    print("RESULT" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=tmp_path_factory.mktemp("ds"),
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(k): v for k, v in json.loads(lines[-1][len("RESULT"):]).items()}


def test_zero_stage_0_trains_the_frames_on_the_manifold(deepspeed_runs):
    run = deepspeed_runs[0]
    assert run["error"] is None and run["steps"] == 3
    assert run["moved"] > 1e-3  # the frames were trained ...
    assert run["off"] < 1e-5  # ... and stayed orthonormal


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_that_flatten_parameters_are_refused_before_anything_changes(deepspeed_runs, stage):
    run = deepspeed_runs[stage]
    assert run["steps"] == 0 and run["error"] is not None  # companion of stage 0, which does step
    assert "DeepSpeed ZeRO" in run["error"] and "ZeRO stage 0, DDP, or FSDP2" in run["error"]
    assert "fully_shard_by_heads" in run["error"]
    if stage < 3:  # (ZeRO-3's module parameters are placeholders: nothing to compare there)
        assert run["unchanged"] and run["moved"] == 0.0 and run["off"] < 1e-5
