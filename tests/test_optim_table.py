"""The optimizers' shared contract, run for every frame optimizer of the library (issue 41).

As torch's ``optim_db`` lists its optimizers with their constructor inputs and runs one suite over them, this
module lists the library's frame optimizers in :data:`OPTIMIZERS` and runs the contract of the shared base over
each: the refusal of frames replaced by a wrapper (DeepSpeed ZeRO), validation before any change whatever form
the parameters arrive in, deepcopy and pickle, closures and hooks, ``zero_grad``, resume from a state dict,
non-finite skips, bf16 frames with float32 master copies, the capturable path and its trace by dynamo. The
rule-specific contracts (each rule against its readable reference) live in ``test_optim_contract.py``
(StiefelAdam) and ``test_muon.py`` (StiefelMuon).
"""

import copy
import pickle
import warnings

import geoopt
import pytest
import torch
from conftest import ORTHO_TOL_F32, ORTHO_TOL_F64

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam, StiefelMuon, param_groups
from geoopt_stiefel_attention._linalg import orthonormality_error

#: name -> (class, keyword arguments of a typical construction)
OPTIMIZERS = {
    "StiefelAdam": (StiefelAdam, {"lr": 0.05}),
    "StiefelMuon": (StiefelMuon, {"lr": 0.05}),
}
NAMES = list(OPTIMIZERS)
#: float32 capturable vs default path after 5 steps (both float32; the retraction differs: eigh vs series)
CAPTURABLE_TOL = 1e-5
#: bf16 frames with float32 master copies vs float32 frames, 5 steps (bf16 rounding of the frames, 4e-3)
MASTER_TOL = 2e-2


def _make(name, params, **overrides):
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **{**kwargs, **overrides})


def _frame(shape=(2, 10, 4), seed=0, dtype=torch.float64):
    st = PolarStiefel()
    w = st.random(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed)).as_subclass(torch.Tensor)
    return geoopt.ManifoldParameter(w, manifold=st)


def _grads(shape, n, seed=1, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(n)]


# ----------------------------------------------------------------------------- frames replaced by a wrapper
@pytest.mark.parametrize("name", NAMES)
def test_frames_replaced_by_a_flat_partition_are_refused_and_nothing_changes(name):
    """What DeepSpeed ZeRO stages 1-3 do: param_groups[i]["params"] becomes a flat fp32 partition."""
    w, b = _frame(), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = _make(name, [w, b])
    flat = torch.nn.Parameter(torch.cat([w.detach().reshape(-1), b.detach()]).float())
    flat.grad = torch.ones_like(flat)
    opt.param_groups[0]["params"] = [flat]
    before = flat.detach().clone()
    with pytest.raises(RuntimeError, match=rf"{name}: its parameter groups no longer hold 1 of the 1 Stiefel "
                                           r"frames .*DeepSpeed ZeRO stages 1-3.*fully_shard_by_heads") as info:
        opt.step()
    assert torch.equal(flat.detach(), before) and not opt.state
    # DeepSpeed's fp16/bf16 wrappers replace the parameters at ZeRO stage 0 too: the message must not send a bf16
    # user to stage 0 alone, and names the way that keeps the frames (fp32 parameters, torch autocast)
    message = str(info.value)
    assert all(part in message for part in ('"fp16"/"bf16" modes, at ZeRO stage 0 too', "FP16_UnfusedOptimizer",
                                            "BF16_Optimizer", "with fp32 parameters", '"torch_autocast" section'))


@pytest.mark.parametrize("name", NAMES)
def test_companion_groups_that_still_hold_their_frames_step(name):
    """The same optimizer with its groups intact (reordered, a group added later) steps normally."""
    w, b = _frame(), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = _make(name, [w])
    opt.add_param_group({"params": [b]})
    opt.param_groups[0]["params"] = list(reversed(opt.param_groups[0]["params"]))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    assert orthonormality_error(w) < ORTHO_TOL_F64 and opt.state[w]


@pytest.mark.parametrize("name", NAMES)
def test_a_frame_added_later_is_guarded_too(name):
    w, w2 = _frame(seed=0), _frame(seed=1)
    opt = _make(name, [w])
    opt.add_param_group({"params": [w2]})
    opt.param_groups[1]["params"] = [torch.nn.Parameter(w2.detach().reshape(-1).clone())]
    with pytest.raises(RuntimeError, match="no longer hold 1 of the 2 Stiefel frames"):
        opt.step()


def _reload(opt, how):
    """The optimizer after what a ZeRO resume or a copy does to it."""
    if how == "load_state_dict":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        return opt
    return copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
def test_the_refusal_of_replaced_frames_survives_load_state_dict_deepcopy_and_pickle(name, how):
    """A ZeRO resume calls load_state_dict on the wrapped optimizer; its flat partition must not be trained as
    AdamW afterwards (the record of the frames it was given is kept, not rebuilt from the replaced groups)."""
    w, w2 = _frame(seed=0), _frame(seed=1)
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = _make(name, [{"params": [w, w2]}, {"params": [b]}])
    flat = [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in g["params"]]).float())
            for g in opt.param_groups]
    for group, fl in zip(opt.param_groups, flat, strict=True):
        group["params"] = [fl]
    opt = _reload(opt, how)
    for p in (p for g in opt.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    with pytest.raises(RuntimeError, match=rf"{name}: its parameter groups no longer hold 2 of the 2 Stiefel "
                                           r"frames .*DeepSpeed ZeRO stages 1-3.*fully_shard_by_heads"):
        opt.step()
    after = [p.detach() for g in opt.param_groups for p in g["params"]]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)) and not opt.state


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
def test_companion_intact_groups_step_after_load_state_dict_deepcopy_and_pickle_and_are_still_guarded(name, how):
    """The same operations on an optimizer whose groups hold their frames: it steps, and still refuses when a
    frame is replaced afterwards (so the kept record is the copy's own frames, not the originals')."""
    w, b = _frame(), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = _make(name, [{"params": [w]}, {"params": [b]}])
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    opt = _reload(opt, how)
    frame = opt.param_groups[0]["params"][0]
    frame.grad = torch.ones_like(frame)
    opt.param_groups[1]["params"][0].grad = torch.ones_like(b)
    before = frame.detach().clone()
    opt.step()
    assert not torch.equal(frame.detach(), before) and orthonormality_error(frame) < ORTHO_TOL_F64
    opt.param_groups[0]["params"] = [torch.nn.Parameter(frame.detach().reshape(-1).clone())]
    with pytest.raises(RuntimeError, match="no longer hold 1 of the 1 Stiefel frames"):
        opt.step()


@pytest.mark.parametrize("name", NAMES)
def test_an_optimizer_pickled_without_a_record_rebuilds_it_from_its_groups(name):
    """A pickle made before the record was saved (torch's own three keys) guards the frames its groups hold."""
    w = _frame()
    opt = _make(name, [w])
    state = {key: value for key, value in opt.__getstate__().items() if not key.startswith("_frames")}
    restored = type(opt).__new__(type(opt))
    restored.__setstate__(copy.deepcopy(state))
    restored.param_groups[0]["params"] = [torch.nn.Parameter(w.detach().reshape(-1).clone())]
    with pytest.raises(RuntimeError, match="no longer hold 1 of the 1 Stiefel frames"):
        restored.step()


# ----------------------------------------------------------------------------- validation
@pytest.mark.filterwarnings("ignore:Stiefel.* was constructed with no Stiefel frame:UserWarning")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["canonical", "sphere", "complex", "r_greater_than_d"])
@pytest.mark.parametrize("form", ["list", "generator", "named", "add_param_group"])
def test_bad_parameters_are_refused_in_every_form_naming_the_optimizer(name, kind, form, bad_frame):
    p, exc, pattern = bad_frame(kind)
    good = _frame()
    with pytest.raises(exc, match=pattern) as info:
        if form == "list":
            _make(name, [good, p])
        elif form == "generator":
            _make(name, (q for q in [good, p]))
        elif form == "named":
            _make(name, [("good", good), ("bad", p)])
        else:
            _make(name, [good]).add_param_group({"params": [p]})
    assert str(info.value).startswith(f"{name}")


@pytest.mark.parametrize("name", NAMES)
def test_a_frame_off_the_manifold_is_refused_at_its_first_step_and_nothing_changes(name, bad_frame):
    p, exc, pattern = bad_frame("off_manifold")
    opt = _make(name, [p])
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(exc, match=pattern):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state[p]


@pytest.mark.parametrize("name", NAMES)
def test_empty_parameters_and_a_lone_tensor_are_refused(name):
    with pytest.raises(ValueError, match=f"{name}: got an empty parameter list"):
        _make(name, [])
    with pytest.raises(TypeError, match=f"{name}: params must be an iterable"):
        _make(name, _frame())


@pytest.mark.parametrize("name", NAMES)
def test_no_frame_at_all_warns_once_naming_the_optimizer(name):
    with pytest.warns(UserWarning, match=f"{name} was constructed with no Stiefel frame"):
        _make(name, [torch.nn.Parameter(torch.zeros(3))])
    with warnings.catch_warnings():  # companion: groups from param_groups() do not warn
        warnings.simplefilter("error")
        from conftest import tiny_transformer

        _make(name, param_groups(tiny_transformer()))


# ----------------------------------------------------------------------------- torch.optim's contract
def _train(opt, params, grads_per_param, closure=None):
    for step_grads in zip(*grads_per_param, strict=True):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step(closure)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_deepcopy_and_pickle_give_an_optimizer_that_continues_identically(name, how):
    w, b = _frame(), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = _make(name, [w, b])
    gw, gb = _grads(w.shape, 6), _grads(b.shape, 6, seed=2)
    _train(opt, [w, b], [gw[:3], gb[:3]])
    bundle = (opt, w, b)
    opt2, w2, b2 = copy.deepcopy(bundle) if how == "deepcopy" else pickle.loads(pickle.dumps(bundle))
    _train(opt, [w, b], [gw[3:], gb[3:]])
    _train(opt2, [w2, b2], [gw[3:], gb[3:]])
    assert torch.equal(w.detach(), w2.detach()) and torch.equal(b.detach(), b2.detach())
    # the copy still guards its own frames
    opt2.param_groups[0]["params"] = [b2]
    with pytest.raises(RuntimeError, match="no longer hold"):
        opt2.step()


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_a_state_dict_continues_the_same_trajectory(name):
    w = _frame()
    grads = _grads(w.shape, 6)
    opt = _make(name, [w])
    _train(opt, [w], [grads])
    w2 = _frame()
    opt2 = _make(name, [w2])
    _train(opt2, [w2], [grads[:2]])
    w3 = geoopt.ManifoldParameter(w2.detach().clone(), manifold=PolarStiefel())
    opt3 = _make(name, [w3])
    opt3.load_state_dict(copy.deepcopy(opt2.state_dict()))
    _train(opt3, [w3], [grads[2:]])
    assert torch.equal(w3.detach(), w.detach())
    # companion: a fresh optimizer from the same point does not
    w4 = geoopt.ManifoldParameter(w2.detach().clone(), manifold=PolarStiefel())
    _train(_make(name, [w4]), [w4], [grads[2:]])
    assert not torch.allclose(w4.detach(), w.detach(), atol=1e-8)


@pytest.mark.parametrize("name", NAMES)
def test_closure_hooks_and_zero_grad(name):
    w = _frame()
    opt = _make(name, [w])
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = (w * torch.arange(w.numel(), dtype=w.dtype).view_as(w)).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == ["pre", "post"] and torch.is_tensor(loss)
    opt.zero_grad()
    assert w.grad is None
    assert orthonormality_error(w) < ORTHO_TOL_F64


@pytest.mark.parametrize("name", NAMES)
def test_a_non_finite_gradient_skips_that_frame_and_counts_it(name):
    w = _frame((3, 10, 4))
    w0 = w.detach().clone()
    opt = _make(name, [w])
    g = torch.randn(3, 10, 4, dtype=torch.float64)
    g[2, 1, 1] = float("inf")
    w.grad = g
    opt.step()
    assert torch.equal(w[2].detach(), w0[2]) and not torch.equal(w[0].detach(), w0[0])
    assert int(opt.state[w]["skipped_frames"]) == 1


@pytest.mark.parametrize("name", NAMES)
def test_capturable_path_matches_the_default_path(name):
    results = []
    for capturable in (False, True):
        w = _frame(dtype=torch.float32)
        opt = _make(name, [w], capturable=capturable)
        _train(opt, [w], [_grads(w.shape, 5, dtype=torch.float32)])
        results.append(w.detach().clone())
    assert (results[0] - results[1]).abs().max() < CAPTURABLE_TOL


@pytest.mark.parametrize("name", NAMES)
def test_bf16_frames_with_master_weights_follow_float32_frames(name):
    out = {}
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        w = _frame((2, 16, 4), dtype=torch.float32)
        w.data = w.data.to(dtype)
        opt = _make(name, [w], master_weights=master, lr=0.02)
        _train(opt, [w], [_grads(w.shape, 5, dtype=dtype)])
        out[dtype] = (w.detach().float(), opt)
    assert (out[torch.float32][0] - out[torch.bfloat16][0]).abs().max() < MASTER_TOL
    master = out[torch.bfloat16][1].state[next(iter(out[torch.bfloat16][1].state))]["master"]
    assert master.dtype == torch.float32 and orthonormality_error(master) < ORTHO_TOL_F32


@pytest.mark.parametrize("name", NAMES)
def test_dynamo_traces_the_capturable_step_without_a_graph_break(name):
    w = _frame(dtype=torch.float32)
    b = torch.nn.Parameter(torch.zeros(5))
    opt = _make(name, [{"params": [w]}, {"params": [b], "weight_decay": 0.1}], capturable=True)
    w.grad, b.grad = torch.randn_like(w), torch.ones(5)
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(opt.step)()
        assert explanation.graph_break_count == 0, explanation.break_reasons
        # companion: a host read is reported as a break
        explanation = torch._dynamo.explain(lambda: (opt.step(), int(opt.state[w]["skipped_frames"])))()
        assert len(explanation.break_reasons) > 0
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- FSDP2 by heads (one rank)
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _dtensor_frame(placement):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    frames = PolarStiefel().random(4, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    p = torch.nn.Parameter(distribute_tensor(frames.detach().clone(), mesh, [placement]))
    p.manifold = PolarStiefel()
    return p, frames.as_subclass(torch.Tensor)


@pytest.mark.parametrize("name", NAMES)
def test_a_frame_sharded_by_heads_is_updated_like_a_plain_frame_and_resumes(one_rank_group, name):
    from torch.distributed.tensor import Shard, distribute_tensor

    p, frames = _dtensor_frame(Shard(0))
    plain = geoopt.ManifoldParameter(frames.clone(), manifold=PolarStiefel())
    grads = _grads((4, 8, 3), 5, seed=2)
    opt_sharded, opt_plain = _make(name, [p]), _make(name, [plain])
    for g in grads[:3]:
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        plain.grad = g.clone()
        opt_sharded.step()
        opt_plain.step()
    assert torch.equal(p.full_tensor(), plain.detach()) and not torch.equal(plain.detach(), frames)
    resumed = _make(name, [p])
    resumed.load_state_dict(opt_sharded.state_dict())
    for g in grads[3:]:
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        plain.grad = g.clone()
        resumed.step()
        opt_plain.step()
    assert torch.equal(p.full_tensor(), plain.detach())


@pytest.mark.parametrize("name", NAMES)
def test_companion_a_frame_sharded_along_d_is_refused_naming_the_fix(one_rank_group, name):
    from torch.distributed.tensor import Shard

    p, _ = _dtensor_frame(Shard(1))
    # (the message is distributed.check_parameter's, which names StiefelAdam whichever optimizer asks)
    with pytest.raises(NotImplementedError, match="splits every frame.*fully_shard_by_heads"):
        _make(name, [p])
