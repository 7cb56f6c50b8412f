"""DDP and FSDP with Stiefel frames: 2 gloo processes on CPU against one process on the whole batch.

One ``torch.multiprocessing.spawn`` (2 ranks, gloo, a free port on 127.0.0.1) runs both the DDP and the FSDP2
(``fully_shard_except_frames``) scenarios and saves what each rank ends with; the tests compare that with a
single-process run on the concatenated batch. The error paths (FSDP2 without the helper) run in-process on a
one-rank gloo group.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from geoopt_stiefel_attention import StiefelAdam, TinyTransformer, frame_parameters, is_frame, param_groups
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.distributed import fully_shard_except_frames, is_sharded

PARALLEL_TOL = 1e-6  # 2 ranks vs one process on the concatenated batch (float64; measured ~1e-15)
MANIFOLD_TOL_F64 = 1e-12  # max |W^T W - I| of every frame on every rank
STEPS = 5
WORLD = 2
VOCAB, SEQ = 11, 4


def _model():
    return TinyTransformer(VOCAB, SEQ, width=16, heads=2, mlp=32, attention="stiefel", seed=3, dtype=torch.float64)


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (8, SEQ), generator=g), torch.randint(0, VOCAB, (8, SEQ), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _train(model, forward, x, y):
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=3e-2)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(forward, x, y).backward()
        opt.step()


def _full_state(model):
    return {k: (v.full_tensor() if is_sharded(v) else v).detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        x, y = _batch()
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        ddp_model = _model()
        _train(ddp_model, torch.nn.parallel.DistributedDataParallel(ddp_model), x, y)
        fsdp_model = _model()
        if rank == 1:  # different frames on rank 1 (still orthonormal): the helper broadcasts rank 0's
            with torch.no_grad():
                for p in frame_parameters(fsdp_model):
                    p.copy_(p.flip(-1))
        fully_shard_except_frames(fsdp_model, submodules=list(fsdp_model.blocks))
        kinds = {name: (type(p).__name__, is_frame(p), is_sharded(p)) for name, p in fsdp_model.named_parameters()}
        _train(fsdp_model, fsdp_model, x, y)
        torch.save({"ddp": _full_state(ddp_model), "fsdp": _full_state(fsdp_model), "fsdp_kinds": kinds},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process_run():
    model = _model()
    _train(model, model, *_batch())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, _model().state_dict()


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_on_the_concatenated_batch(parallel_runs, single_process_run, mode):
    reference, initial = single_process_run
    frame_keys = [k for k in reference if k.endswith(("w_q", "w_k"))]
    assert len(frame_keys) == 2
    for rank, run in enumerate(parallel_runs):
        state = run[mode]
        assert _max_diff(state, reference) < PARALLEL_TOL, (mode, rank)
        for k in frame_keys:
            assert float(orthonormality_error(state[k])) < MANIFOLD_TOL_F64, (mode, rank, k)
    # the comparison has teeth: training moved every frame far more than the tolerance
    assert min(float((reference[k] - initial[k]).abs().max()) for k in frame_keys) > 1e-2


def test_fsdp_helper_keeps_frames_whole_and_shards_the_rest(parallel_runs):
    kinds = parallel_runs[0]["fsdp_kinds"]
    frames = {n for n, (_, frame, _) in kinds.items() if frame}
    assert frames == {"blocks.0.attn.w_q", "blocks.0.attn.w_k"}
    assert all(cls == "ManifoldParameter" and not sharded for n, (cls, _, sharded) in kinds.items() if n in frames)
    assert all(sharded for n, (_, _, sharded) in kinds.items() if n not in frames)


# ----------------------------------------------------------------------------- FSDP error path, one rank
@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_plain_fully_shard_is_refused_with_the_fix(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    n_frames = len(frame_parameters(model))
    fully_shard(model)
    # FSDP2 drops the manifold: without the check the frames would silently get AdamW
    assert len(frame_parameters(model)) == 0 and n_frames == 2
    with pytest.raises(NotImplementedError, match="fully_shard_except_frames"):
        StiefelAdam(model.parameters())


def test_sharded_frame_is_refused(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    from geoopt_stiefel_attention import PolarStiefel

    model = _model()
    fully_shard(model)
    w_q = model.blocks[0].attn.w_q
    w_q.manifold = PolarStiefel()  # a DTensor frame that kept its manifold
    with pytest.raises(NotImplementedError, match="whole frames"):
        StiefelAdam([w_q])


def test_helper_sharded_model_is_accepted_and_trains(one_rank_group):
    model = _model()
    fully_shard_except_frames(model)
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2)
    _loss(model, *_batch()).backward()
    opt.step()
    assert all(float(orthonormality_error(p)) < MANIFOLD_TOL_F64 for p in frame_parameters(model))


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
ZOO_KEPT = ZOO_FRAMES | {"sphere"}


def test_frame_predicate_is_the_same_everywhere():
    zoo = _ManifoldZoo()
    named = dict(zoo.named_parameters())
    assert {n for n, p in named.items() if is_frame(p)} == ZOO_FRAMES
    assert {id(p) for p in frame_parameters(zoo)} == {id(named[n]) for n in ZOO_FRAMES}
    assert {id(p) for p in param_groups(zoo)[0]["params"]} == {id(named[n]) for n in ZOO_FRAMES}
    StiefelAdam([named["polar"], named["euclidean_stiefel"], named["flat"], named["linear.weight"]])
    for name, message in [("canonical", "PolarStiefel"), ("sphere", "RiemannianAdam")]:
        with pytest.raises(ValueError, match=message):
            StiefelAdam([named[name]])


def test_fsdp_helper_keeps_every_manifold_parameter_out_of_the_sharding(one_rank_group):
    """Before the fix a canonical Stiefel() frame (and a Sphere parameter) was sharded: it lost its manifold and
    a Euclidean optimizer trained it silently."""
    zoo = _ManifoldZoo()
    fully_shard_except_frames(zoo)
    named = dict(zoo.named_parameters())
    for name in ZOO_KEPT:
        assert not is_sharded(named[name]) and hasattr(named[name], "manifold"), name
    assert {n for n, p in named.items() if is_sharded(p)} == {"flat", "linear.weight", "linear.bias"}
    assert {n for n, p in named.items() if is_frame(p)} == ZOO_FRAMES
    with pytest.raises(ValueError, match="PolarStiefel"):  # still a canonical frame: refused, not AdamW-trained
        StiefelAdam(zoo.parameters())
