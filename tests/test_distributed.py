"""DDP and FSDP2 with Stiefel frames: 2 gloo processes on CPU against one process on the whole batch.

One ``torch.multiprocessing.spawn`` (2 ranks, gloo, a file rendezvous) trains every model case, with
each frame optimizer of :data:`OPTIMIZERS` (StiefelAdam, StiefelMuon), under DDP and under FSDP2 with frames sharded by whole heads (:func:`fully_shard_by_heads`), checkpoints the FSDP2
run with ``torch.distributed.checkpoint`` half-way and resumes it in a fresh model and optimizer, and saves
what each rank ends with; the tests compare that with a single-process run on the concatenated batch. The
refusals (a frame split along ``d``, a plain ``fully_shard``) run in-process on a one-rank gloo group.
"""

import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import ORTHO_TOL_F64, dtensor_frame
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from geoopt_stiefel_attention import (
    StiefelAdam,
    StiefelMuon,
    TinyTransformer,
    frame_parameters,
    is_frame,
    param_groups,
    parametrized_state_dict,
)
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.distributed import (
    fully_shard_by_heads,
    is_sharded,
    local_frame_bytes,
    local_tensor,
)

PARALLEL_TOL = 1e-6  # 2 ranks vs one process on the whole batch (float64; measured 1e-15, GPT-2 4e-11)
RESUME_TOL = 1e-12  # a resumed run vs the uninterrupted one (the same arithmetic: measured 0)
MOVED_AT_LEAST = 1e-2  # training must move every frame far more than PARALLEL_TOL
STEPS = 10
RESUME_AT = 5
WORLD = 2
VOCAB, SEQ, BATCH = 11, 4, 8

# name -> TinyTransformer options, or "gpt2": a tiny HF GPT-2 converted with stiefelize (frames (2, 16, 8) in
# c_attn's parametrization); "uneven": 3 heads on 2 ranks (rank 0 holds 2 heads, rank 1 one); "one_frame": one
# (1, 16, 16) frame per projection (frames="layer"), so rank 1 holds no frame at all
CASES = {
    "tiny": dict(width=16, heads=2, depth=2),
    "uneven": dict(width=18, heads=3, depth=1),
    "one_frame": dict(width=16, heads=2, depth=1, frames="layer"),
    "gpt2": "gpt2",
}
N_FRAME_PARAMS = {"tiny": 4, "uneven": 2, "one_frame": 2, "gpt2": 4}
#: the library's frame optimizers, as the DDP/FSDP2 runs build them: name -> (class, keyword arguments)
OPTIMIZERS = {
    "StiefelAdam": (StiefelAdam, {"lr": 3e-2}),
    "StiefelMuon": (StiefelMuon, {"lr": 3e-2}),
}
NAMES = list(OPTIMIZERS)


def _gpt2():
    import transformers

    from geoopt_stiefel_attention import stiefelize

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(config).to(torch.float64)
    stiefelize(model)
    return model


def _model(case):
    if CASES[case] == "gpt2":
        return _gpt2()
    return TinyTransformer(VOCAB, SEQ, mlp=32, attention="stiefel", seed=3, dtype=torch.float64, **CASES[case])


def _blocks(model):
    return list(model.blocks) if isinstance(model, TinyTransformer) else list(model.transformer.h)


def _logits(forward, x):
    out = forward(x)
    return out.logits if hasattr(out, "logits") else out


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _optimizer(model, name):
    cls, kwargs = OPTIMIZERS[name]
    return cls(param_groups(model, weight_decay=0.1), **kwargs)


def _train(forward, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(_logits(forward, x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()


def _full_state(model):
    # the parametrized form (frames as stored): the tests read the frames by parameter name; under FSDP2 the
    # state dict of sharded frames is in this form anyway
    state = parametrized_state_dict(model)
    return {k: (v.full_tensor() if is_sharded(v) else v).detach().clone() for k, v in state.items()}


def _outputs(forward):
    with torch.no_grad():
        return _logits(forward, _batch()[0]).detach().clone()


#: per optimizer, its per-frame state: (the (H, d, r) buffer, the (H, 1, 1) per-frame scalar)
FRAME_STATE = {"StiefelAdam": ("exp_avg", "exp_avg_sq"), "StiefelMuon": ("momentum_buffer", "dual_gap")}


def _local_layout(model, opt):
    """Per frame: (local shape, DTensor?, local shape of the (H, d, r) state, local shape of the per-frame
    scalar state, state DTensors?)."""
    buffer, scalar = FRAME_STATE[type(opt).__name__]
    out = {}
    for name, p in model.named_parameters():
        if is_frame(p):
            st = opt.state[p]
            out[name] = (tuple(local_tensor(p).shape), is_sharded(p), tuple(local_tensor(st[buffer]).shape),
                         tuple(local_tensor(st[scalar]).shape), is_sharded(st[buffer]) and is_sharded(st[scalar]))
    return out


def _sharded(case, name):
    model = _model(case)
    fully_shard_by_heads(model, submodules=_blocks(model))
    return model, _optimizer(model, name)


def _dcp(model, opt, path, save):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if save:
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _worker(rank, init_method, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        x, y = (t.chunk(WORLD)[rank] for t in _batch())
        results = {}
        for name in NAMES:
            for case in CASES:
                model = _model(case)
                ddp = torch.nn.parallel.DistributedDataParallel(model)
                opt = _optimizer(model, name)
                _train(ddp, opt, x, y, STEPS)
                results[name, case, "ddp"] = {"state": _full_state(model), "out": _outputs(model),
                                              "bytes": local_frame_bytes(model, opt)}

                model, opt = _sharded(case, name)
                checkpoint = os.path.join(out_dir, f"dcp-{name}-{case}")
                _train(model, opt, x, y, RESUME_AT)
                _dcp(model, opt, checkpoint, save=True)
                _train(model, opt, x, y, STEPS - RESUME_AT)
                results[name, case, "fsdp"] = {"state": _full_state(model), "out": _outputs(model),
                                               "bytes": local_frame_bytes(model, opt),
                                               "layout": _local_layout(model, opt)}

                model, opt = _sharded(case, name)  # a fresh run that resumes from the checkpoint
                _dcp(model, opt, checkpoint, save=False)
                _train(model, opt, x, y, STEPS - RESUME_AT)
                results[name, case, "resumed"] = {"state": _full_state(model), "out": _outputs(model)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _rendezvous(folder):
    """A file rendezvous in ``folder`` (new for every spawn): no port to pick, so no other process on the machine can
    take it between picking and binding (a free port found by binding port 0 can be taken before rank 0 binds it)."""
    return f"file://{folder / 'rendezvous'}"


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(_rendezvous(out), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process_runs():
    runs = {}
    for name in NAMES:
        for case in CASES:
            model = _model(case)
            _train(model, _optimizer(model, name), *_batch(), STEPS)
            runs[name, case] = {"state": _full_state(model), "out": _outputs(model),
                                "initial": parametrized_state_dict(_model(case))}
    return runs


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _frame_keys(case):
    return [name for name, p in _model(case).named_parameters() if is_frame(p)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "resumed"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_process_on_the_concatenated_batch(parallel_runs, single_process_runs, name, case, mode):
    reference = single_process_runs[name, case]
    frame_keys = _frame_keys(case)
    assert len(frame_keys) == N_FRAME_PARAMS[case]
    for rank, run in enumerate(parallel_runs):
        got = run[name, case, mode]
        assert _max_diff(got["state"], reference["state"]) < PARALLEL_TOL, (case, mode, rank)
        assert float((got["out"] - reference["out"]).abs().max()) < PARALLEL_TOL, (case, mode, rank)
        for k in frame_keys:
            assert float(orthonormality_error(got["state"][k])) < ORTHO_TOL_F64, (case, mode, rank, k)
    # the comparison has teeth: training moved every frame far more than the tolerance
    moved = min(float((reference["state"][k] - reference["initial"][k]).abs().max()) for k in frame_keys)
    assert moved > MOVED_AT_LEAST


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_dcp_resume_continues_the_same_trajectory(parallel_runs, name, case):
    for run in parallel_runs:
        assert _max_diff(run[name, case, "resumed"]["state"], run[name, case, "fsdp"]["state"]) < RESUME_TOL
        assert float((run[name, case, "resumed"]["out"] - run[name, case, "fsdp"]["out"]).abs().max()) < RESUME_TOL


@pytest.mark.parametrize("case", ["tiny", "gpt2"])
@pytest.mark.parametrize("name", NAMES)
def test_frames_and_their_state_are_sharded_by_whole_heads(parallel_runs, name, case):
    for run in parallel_runs:
        layout = run[name, case, "fsdp"]["layout"]
        assert set(layout) == set(_frame_keys(case))
        for shape, sharded, m_shape, v_shape, state_sharded in layout.values():
            assert sharded and state_sharded
            assert shape == m_shape == (1, 16, 8) and v_shape == (1, 1, 1)  # one of the 2 heads (16 x 8) per rank


@pytest.mark.parametrize("name", NAMES)
def test_uneven_heads_are_split_like_torch_chunk(parallel_runs, name):
    # uneven: torch.chunk's split of 3 heads over 2 ranks is 2 + 1
    head_counts = [next(iter(run[name, "uneven", "fsdp"]["layout"].values()))[0][0] for run in parallel_runs]
    assert head_counts == [2, 1]
    one_frame = [next(iter(run[name, "one_frame", "fsdp"]["layout"].values()))[0][0] for run in parallel_runs]
    assert one_frame == [1, 0]


@pytest.mark.parametrize("name", NAMES)
def test_head_sharding_halves_the_frame_memory_per_rank(parallel_runs, name):
    for run in parallel_runs:
        replicated, sharded = run[name, "tiny", "ddp"]["bytes"], run[name, "tiny", "fsdp"]["bytes"]
        for key in ("params", "grads"):
            assert sharded[key] * WORLD == replicated[key]
        # the state's scalar step counters (one per parameter) are not sharded; the moments are
        assert sharded["state"] < replicated["state"] / WORLD + 64


# ----------------------------------------------------------------------------- refusals, one rank
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dim, axis", [(1, "d"), (2, "r"), (-1, "r")])
def test_frame_sharded_along_d_or_r_is_refused_with_the_fix(one_rank_group, dim, axis, name):
    """The refusal names the optimizer that refuses (not StiefelAdam for every one)."""
    p, _ = dtensor_frame(Shard(dim))
    with pytest.raises(NotImplementedError, match=rf"^{name}: frame parameter .*the {axis} .*fully_shard_by_heads"):
        OPTIMIZERS[name][0]([p])


OPTION_CASES = {  # case -> (optimizer, options, frame dtype): the fused kernel, the readable path, re-projection,
    # and bf16 frames with a float32 master copy (the state's "master" is then sharded too), for each optimizer
    "default": ("StiefelAdam", {}, torch.float64),
    "column": ("StiefelAdam", {"second_moment": "column"}, torch.float64),
    "stabilize": ("StiefelAdam", {"stabilize": 2}, torch.float64),
    "bf16-master": ("StiefelAdam", {"master_weights": True}, torch.bfloat16),
    "muon": ("StiefelMuon", {}, torch.float64),
    "muon-bf16-master": ("StiefelMuon", {"master_weights": True}, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_frames_of_different_head_counts_share_a_batch_and_update_like_plain_frames(one_rank_group, name):
    """Query and key frames of grouped-query attention sharded by heads (4 and 2 heads of one 8 x 3 shape, with a
    NaN gradient in the key's second head at step 2): staged as one batch of 6 frames, they update exactly as the
    same plain frames do, and the skipped frame is counted for the key frames only."""
    import geoopt
    from torch.distributed.device_mesh import init_device_mesh

    from geoopt_stiefel_attention import PolarStiefel
    from geoopt_stiefel_attention.optim._batching import _frame_batches

    cls = OPTIMIZERS[name][0]
    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(5)
    whole = [PolarStiefel().random(h, 8, 3, dtype=torch.float64, generator=gen) for h in (4, 2)]
    sharded, plain = [], []
    for w in whole:
        p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        p.manifold = PolarStiefel()
        sharded.append(p)
        plain.append(geoopt.ManifoldParameter(w.clone(), manifold=PolarStiefel()))
    assert [len(b) for _, b in _frame_batches(sharded, [1, 1])] == [2]  # one batch of both parameters
    grads = [[torch.randn(w.shape, dtype=torch.float64, generator=gen) for w in whole] for _ in range(3)]
    grads[1][1][1, 0, 0] = float("nan")
    opt_sharded, opt_plain = cls(sharded, lr=5e-2), cls(plain, lr=5e-2)
    for step in grads:
        for p, q, g in zip(sharded, plain, step, strict=True):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            q.grad = g.clone()
        opt_sharded.step()
        opt_plain.step()
    for p, q, w in zip(sharded, plain, whole, strict=True):
        assert torch.equal(p.full_tensor(), q.detach())
        assert float((q.detach() - w).abs().max()) > MOVED_AT_LEAST
    assert [int(opt_sharded.state[p]["skipped_frames"]) for p in sharded] == [0, 1]


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=str)
def test_frame_sharded_by_heads_or_replicated_is_updated_like_a_plain_frame(one_rank_group, placement, case):
    """The companion of the refusal: the update of a DTensor frame equals that of the same plain frame, and
    so does the continuation after a state-dict round trip (DTensor state into a sharded optimizer, and the
    plain optimizer's full state into a sharded one)."""
    import geoopt

    name, options, dtype = OPTION_CASES[case]
    cls = OPTIMIZERS[name][0]
    buffer, scalar = FRAME_STATE[name]
    p, frames = dtensor_frame(placement)
    p = torch.nn.Parameter(p.detach().to(dtype))
    p.manifold = frames.manifold
    plain = geoopt.ManifoldParameter(frames.detach().to(dtype, copy=True), manifold=p.manifold)
    g = torch.randn(4, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(dtype)

    def steps(pairs, n):
        for _ in range(n):
            for q, opt in pairs:
                q.grad = distribute_tensor(g, q.device_mesh, q.placements) if is_sharded(q) else g.clone()
                opt.step()

    opt_sharded, opt_plain = cls([p], lr=5e-2, **options), cls([plain], lr=5e-2, **options)
    steps([(p, opt_sharded), (plain, opt_plain)], 3)
    assert torch.equal(p.full_tensor(), plain.detach())
    assert float((plain.detach().double() - frames).abs().max()) > MOVED_AT_LEAST
    state = opt_sharded.state[p]
    assert all(is_sharded(state[k]) and state[k].placements == p.placements
               for k in (buffer, scalar) + (("master",) if "master_weights" in options else ()))
    assert tuple(state[scalar].shape) == {"column": (4, 1, 3)}.get(case, (4, 1, 1))
    p2 = torch.nn.Parameter(p.detach().clone())
    p2.manifold = p.manifold
    resumed = cls([p], lr=5e-2, **options)
    resumed.load_state_dict(opt_sharded.state_dict())  # DTensor state
    from_full = cls([p2], lr=5e-2, **options)
    from_full.load_state_dict(opt_plain.state_dict())  # plain tensors holding the whole state
    assert is_sharded(from_full.state[p2][buffer])
    steps([(p, resumed), (p2, from_full), (plain, opt_plain)], 2)
    assert torch.equal(p.full_tensor(), plain.detach()) and torch.equal(p2.full_tensor(), plain.detach())


@pytest.mark.parametrize("name", NAMES)
def test_plain_fully_shard_is_refused_with_the_fix(one_rank_group, name):
    from torch.distributed.fsdp import fully_shard

    model = _model("tiny")
    n_frames = len(frame_parameters(model))
    fully_shard(model)
    # FSDP2 drops the manifold: without the check the frames would silently get AdamW
    assert len(frame_parameters(model)) == 0 and n_frames == 4
    with pytest.raises(NotImplementedError, match=rf"^{name}: parameter of shape .*fully_shard_by_heads"):
        OPTIMIZERS[name][0](model.parameters())


# ----------------------------------------------------------------------------- one meaning of "frame"
class _ManifoldZoo(torch.nn.Module):
    """One parameter on each kind of geoopt manifold, beside plain weights FSDP should shard."""

    def __init__(self):
        super().__init__()
        import geoopt

        from geoopt_stiefel_attention import PolarStiefel

        def on(manifold, data):
            return geoopt.ManifoldParameter(manifold.projx(data), manifold=manifold)

        g = torch.Generator().manual_seed(0)
        self.polar = on(PolarStiefel(), torch.randn(2, 8, 3, generator=g, dtype=torch.float64))
        self.euclidean_stiefel = on(geoopt.EuclideanStiefel(), torch.randn(8, 3, generator=g, dtype=torch.float64))
        self.canonical = on(geoopt.Stiefel(), torch.randn(8, 3, generator=g, dtype=torch.float64))
        self.sphere = on(geoopt.Sphere(), torch.randn(4, 8, generator=g, dtype=torch.float64))
        self.flat = geoopt.ManifoldParameter(torch.randn(4, 8, generator=g, dtype=torch.float64))  # Euclidean
        self.linear = torch.nn.Linear(8, 8, dtype=torch.float64)


ZOO_FRAMES = {"polar", "euclidean_stiefel", "canonical"}
ZOO_KEPT = {"euclidean_stiefel", "canonical", "sphere"}  # single (d, r) frames and other manifolds: replicated


def test_frame_predicate_is_the_same_everywhere():
    zoo = _ManifoldZoo()
    named = dict(zoo.named_parameters())
    assert {n for n, p in named.items() if is_frame(p)} == ZOO_FRAMES
    assert {id(p) for p in frame_parameters(zoo)} == {id(named[n]) for n in ZOO_FRAMES}
    with pytest.warns(UserWarning, match="'sphere' .on Sphere manifold"):  # grouped as Euclidean, said so
        groups = param_groups(zoo)
    assert {id(p) for p in groups[0]["params"]} == {id(named[n]) for n in ZOO_FRAMES}
    StiefelAdam([named["polar"], named["euclidean_stiefel"], named["flat"], named["linear.weight"]])
    for name, message in [("canonical", "PolarStiefel"), ("sphere", "RiemannianAdam")]:
        with pytest.raises(ValueError, match=message):
            StiefelAdam([named[name]])


def test_helper_shards_frame_stacks_keeps_other_manifold_parameters_whole(one_rank_group):
    """A (d, r) frame has no head dimension and a Sphere parameter no known sharding: both stay replicated
    geoopt parameters; the (2, 8, 3) stack is sharded and keeps its manifold; the rest is sharded."""
    zoo = _ManifoldZoo()
    fully_shard_by_heads(zoo)
    named = dict(zoo.named_parameters())
    for name in ZOO_KEPT:
        assert not is_sharded(named[name]) and hasattr(named[name], "manifold"), name
    assert {n for n, p in named.items() if is_sharded(p)} == {"polar", "flat", "linear.weight", "linear.bias"}
    assert {n for n, p in named.items() if is_frame(p)} == ZOO_FRAMES
    with pytest.raises(ValueError, match="PolarStiefel"):  # still a canonical frame: refused, not AdamW-trained
        StiefelAdam(zoo.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StiefelAdam([p for n, p in named.items() if n != "canonical" and n != "sphere"])


# ----------------------------------------------------------------------------- frozen replicated frames, 2 ranks
REPLICA_TOL = 1e-12  # a replicated frame across ranks, its gradient averaged (the same arithmetic: measured 0)
DRIFT_AT_LEAST = 1e-2  # ranks training a frame on their own gradients must drift far more than REPLICA_TOL
FREEZE_STEPS = 3
# run -> (frame frozen at sharding time, sharded by fully_shard_by_heads); "unsynchronized" is the companion
# without any averaging, where the replicas must drift apart
FREEZE_RUNS = {"never_frozen": (False, True), "frozen_then_unfrozen": (True, True),
               "unsynchronized": (True, False)}


class _SingleFrame(torch.nn.Module):
    """One single (d, r) frame (no head dimension: kept replicated) before a Linear (sharded)."""

    def __init__(self):
        super().__init__()
        import geoopt

        from geoopt_stiefel_attention import PolarStiefel

        g = torch.Generator().manual_seed(0)
        self.frame = geoopt.ManifoldParameter(
            PolarStiefel().projx(torch.randn(8, 4, generator=g, dtype=torch.float64)), manifold=PolarStiefel())
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x @ self.frame)


def _freeze_worker(rank, init_method, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        results = {}
        for run, (frozen, shard) in FREEZE_RUNS.items():
            torch.manual_seed(0)
            model = _SingleFrame()
            model.frame.requires_grad_(not frozen)
            if shard:
                fully_shard_by_heads(model)
            still_frozen = not model.frame.requires_grad  # fully_shard_by_heads must leave it as it was
            model.frame.requires_grad_(True)  # unfreeze (phase 2 of a staged fine-tuning)
            opt = StiefelAdam(model.parameters(), lr=1e-1)
            x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
            for _ in range(FREEZE_STEPS):  # different data on each rank
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            frame = model.frame.detach().clone()
            frames = [torch.zeros_like(frame) for _ in range(WORLD)]
            dist.all_gather(frames, frame)
            results[run] = {"frames": frames, "still_frozen": still_frozen,
                            "moved": float((frame - _SingleFrame().frame.detach()).abs().max())}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def freeze_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("freeze")
    mp.spawn(_freeze_worker, args=(_rendezvous(out), str(out)), nprocs=WORLD, join=True)
    return torch.load(out / "rank0.pt", weights_only=False)


@pytest.mark.parametrize("run", ["never_frozen", "frozen_then_unfrozen"])
def test_replicated_frame_frozen_at_sharding_is_averaged_once_unfrozen(freeze_runs, run):
    """A single (d, r) frame frozen when fully_shard_by_heads runs and unfrozen later has its gradient
    averaged like one that was never frozen: the replicas stay identical, and equal to the never-frozen run."""
    result, reference = freeze_runs[run], freeze_runs["never_frozen"]
    frames = result["frames"]
    assert result["still_frozen"] == (run == "frozen_then_unfrozen")
    assert result["moved"] > DRIFT_AT_LEAST
    assert float((frames[0] - frames[1]).abs().max()) <= REPLICA_TOL
    assert float((frames[0] - reference["frames"][0]).abs().max()) <= REPLICA_TOL
    assert float(orthonormality_error(frames[0])) <= ORTHO_TOL_F64


def test_replicated_frame_without_averaging_drifts_apart(freeze_runs):
    """The companion: the same training with no averaging (each rank on its own data) must fail the check."""
    frames = freeze_runs["unsynchronized"]["frames"]
    assert float((frames[0] - frames[1]).abs().max()) > DRIFT_AT_LEAST


# ----------------------------------------------------------------------------- already sharded blocks, one rank
def _snapshot(model):
    return {name: (type(p), is_sharded(p), local_tensor(p).detach().clone(), getattr(p, "manifold", None))
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", NAMES)
def test_blocks_sharded_by_plain_fully_shard_are_refused_before_anything_changes(one_rank_group, name):
    """torchtitan's pattern, a plain fully_shard(block) per block, then fully_shard_by_heads(model): the
    blocks' frames lost their manifold; they must be refused up front, not declared Euclidean and trained with
    AdamW until the next forward finds them off the manifold."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = _model("tiny")
    for block in _blocks(model):
        fully_shard(block)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"^fully_shard_by_heads: parameter 'blocks\.0\.attn\.w_q' .*"
                                         r"already sharded .*fully_shard_by_heads on the unsharded model "
                                         r"instead of fully_shard"):
        fully_shard_by_heads(model, submodules=_blocks(model))
    after = _snapshot(model)
    assert before.keys() == after.keys() and not isinstance(model, FSDPModule)
    for key, (kind, sharded, value, manifold) in before.items():
        assert after[key][:2] == (kind, sharded) and torch.equal(after[key][2], value), key
        assert after[key][3] is manifold, key
    assert not is_sharded(model.token_embedding.weight)  # the root was not sharded
    # nothing was declared Euclidean: the optimizer still refuses the frames that lost their manifold
    with pytest.raises(NotImplementedError, match=rf"^{name}: parameter of shape .*fully_shard_by_heads"):
        OPTIMIZERS[name][0](model.parameters())


@pytest.mark.parametrize("how", ["submodules", "nested", "declared"])
@pytest.mark.parametrize("name", NAMES)
def test_blocks_sharded_by_fully_shard_by_heads_or_declared_are_accepted(one_rank_group, name, how):
    """The companion: blocks sharded by fully_shard_by_heads itself (through submodules=, or an earlier call
    per block), or sharded by a plain fully_shard and declared Euclidean by hand (no frames in them), pass the
    check; every frame keeps its manifold and the optimizer trains them on it."""
    from torch.distributed.fsdp import fully_shard

    from geoopt_stiefel_attention.distributed import declare_sharded_euclidean

    model = _model("tiny")
    if how == "submodules":
        fully_shard_by_heads(model, submodules=_blocks(model))
    elif how == "nested":
        for block in _blocks(model):
            fully_shard_by_heads(block)
        fully_shard_by_heads(model)
    else:
        norm = model.final_norm  # no frames in it
        assert not any(is_frame(p) for p in norm.parameters())
        fully_shard(norm)
        declare_sharded_euclidean(norm.parameters())
        fully_shard_by_heads(model, submodules=_blocks(model))
    assert len(frame_parameters(model)) == N_FRAME_PARAMS["tiny"]
    assert all(is_sharded(p) for p in model.parameters())
    opt = _optimizer(model, name)
    _train(model, opt, *_batch(), 2)
    for p in frame_parameters(model):
        assert float(orthonormality_error(local_tensor(p).detach())) <= ORTHO_TOL_F64


# ----------------------------------------------------------------------------- the docs' torchrun example
def _torchrun_example():
    """The literal block after "(``-m slow``)::" in docs/distributed.rst, dedented."""
    import textwrap
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[1] / "docs" / "distributed.rst").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("(``-m slow``)::")) + 1
    body = []
    for line in lines[start:]:
        if line.strip() and not line.startswith("    "):
            break
        body.append(line)
    return textwrap.dedent("\n".join(body)).strip() + "\n"


@pytest.mark.slow
def test_torchrun_example_of_the_docs_trains_saves_and_resumes(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train_fsdp.py"
    script.write_text(_torchrun_example())
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, CKPT=str(tmp_path / "ckpt"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    losses = []
    for _ in range(2):  # the second run resumes from the checkpoint of the first
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        # the two ranks share the pipe, so their lines may interleave mid-line: find the records, not lines
        losses.append(sorted(re.findall(r"rank (\d): loss ([0-9.]+)", done.stdout)))
        assert [rank for rank, _ in losses[-1]] == ["0", "1"], done.stdout
    assert (tmp_path / "ckpt").is_dir()
    # the same batches: a second run that did not resume from the checkpoint would print the same losses
    assert losses[0] != losses[1]


def _stock_encoder():
    """A stock one-layer ``nn.TransformerEncoderLayer`` model (seed 0), for the wrapping-order refusals."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))


def test_a_model_sharded_before_its_conversion_is_refused_before_anything_changes(one_rank_group):
    """``fully_shard(model)`` then ``stiefelize(model)`` failed inside torch ("Creating a new Tensor subclass
    ManifoldTensor but the raw Tensor object is already associated to ... DTensor"): now one sentence naming the
    module, its sharded parameters and the order to use, with the model unchanged. Companion: converted first, then
    sharded by heads, the same model trains a step with orthonormal frames."""
    from torch.distributed.fsdp import fully_shard

    from geoopt_stiefel_attention import stiefelize

    model = _stock_encoder()
    fully_shard(model)
    before = {k: local_tensor(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"'0\.self_attn' holds sharded parameters \(in_proj_weight, .*convert the "
                                        r"model first, then shard it with .*fully_shard_by_heads"):
        stiefelize(model)
    assert not frame_parameters(model)
    assert all(torch.equal(local_tensor(v), before[k]) for k, v in model.state_dict().items())

    model = _stock_encoder()
    stiefelize(model)
    fully_shard_by_heads(model)
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    start = [local_tensor(f).detach().clone() for f in frame_parameters(model)]
    model(torch.randn(2, 5, 16)).sum().backward()
    opt.step()
    frames = [local_tensor(f).detach() for f in frame_parameters(model)]
    assert min(float((f - s).abs().max()) for f, s in zip(frames, start, strict=True)) > 1e-4  # they moved
    assert max(float(orthonormality_error(f)) for f in frames) < 1e-5


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")  # torch's, at one rank
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_is_refused_before_and_after_the_conversion(one_rank_group, use_orig_params):
    """FSDP1 (``FullyShardedDataParallel``, on the CPU with ``device_id=cpu``) flattens a unit's parameters and shards
    them by element count, which would split frames across ranks. Wrapped before the conversion: ``stiefelize``
    refuses, the model unchanged. Converted, then wrapped: ``param_groups`` and the frame optimizers refuse the frame
    views (``use_orig_params=True``) or the flat parameter holding them (``False``; before, ``param_groups`` saw no
    frame and the first forward after an AdamW-like step blamed "an optimizer that does not know the constraint").
    Companion: FSDP1 over a model without frames is grouped and trained as usual."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from geoopt_stiefel_attention import stiefelize

    cpu = torch.device("cpu")
    wrapped = FullyShardedDataParallel(_stock_encoder(), use_orig_params=use_orig_params, device_id=cpu)
    with pytest.raises(TypeError, match=r"model is a FullyShardedDataParallel: .*splits frames across ranks.*"
                                        r"fully_shard_by_heads\(model\)"):
        stiefelize(wrapped)
    assert not frame_parameters(wrapped)

    model = _stock_encoder()
    stiefelize(model)
    wrapped = FullyShardedDataParallel(model, use_orig_params=use_orig_params, device_id=cpu)
    named = "q_frames' \\(2, 16, 8\\)" if use_orig_params else "_flat_param' \\(2224,\\)"
    with pytest.raises(NotImplementedError, match=rf"param_groups: '.*{named} holds frames: FullyShardedDataParallel"):
        param_groups(wrapped)
    for optimizer in (StiefelAdam, StiefelMuon):
        with pytest.raises(NotImplementedError, match=rf"{optimizer.__name__}: (frame|flat) parameter.* \(FSDP1\)"):
            optimizer(wrapped.parameters(), lr=1e-2)

    plain = FullyShardedDataParallel(torch.nn.Linear(4, 4), use_orig_params=use_orig_params, device_id=cpu)
    opt = StiefelAdam(param_groups(plain, expect_frames=False), lr=1e-2)
    plain(torch.randn(2, 4)).sum().backward()
    opt.step()
