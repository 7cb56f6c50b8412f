"""The optimizers' shared contract, run for every frame optimizer of the library (issue 41).

As torch's ``optim_db`` lists its optimizers with their constructor inputs and runs one suite over them, this
module lists the library's frame optimizers in :data:`OPTIMIZERS` and runs the contract of the shared base over
each: the refusal of frames replaced by a wrapper (DeepSpeed ZeRO), validation before any change whatever form
the parameters arrive in, deepcopy and pickle, closures and hooks, ``zero_grad``, resume from a state dict,
non-finite skips, bf16 frames with float32 master copies, the capturable path and its trace by dynamo. The
rule-specific contracts (each rule against its readable reference) live in ``test_optim_contract.py``
(StiefelAdam) and ``test_muon.py`` (StiefelMuon).
"""

import contextlib
import copy
import inspect
import math
import pickle
import warnings

import geoopt
import pytest
import torch
import torch.optim.adamw as _torch_adamw
from conftest import ORTHO_TOL_F32, ORTHO_TOL_F64, NoHostReads, dtensor_frame

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam, StiefelMuon, param_groups, stiefel_adam_update
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.optim import stiefel_muon_update
from geoopt_stiefel_attention.optim._validation import SHARED_OPTIONS

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
@pytest.mark.parametrize("name", NAMES)
def test_a_frame_sharded_by_heads_is_updated_like_a_plain_frame_and_resumes(one_rank_group, name):
    from torch.distributed.tensor import Shard, distribute_tensor

    p, frames = dtensor_frame(Shard(0))
    frames = frames.as_subclass(torch.Tensor)
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

    p, _ = dtensor_frame(Shard(1))
    # (the message is distributed.check_parameter's, which names StiefelAdam whichever optimizer asks)
    with pytest.raises(NotImplementedError, match="splits every frame.*fully_shard_by_heads"):
        _make(name, [p])


# ----------------------------------------------------------------------------- nothing moves before a refusal
def _everything(opt, params):
    """What a refusal must leave as it was: a deep copy of the state dict's state (moments, step counts, skip
    counters) and of the parameters (the group options are what the test wrote into them)."""
    return copy.deepcopy(opt.state_dict()["state"]), [p.detach().clone() for p in params]


def _same(a, b):
    """Recursive bit-equality of nested containers of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _frame_and_bias(seed=0):
    w = _frame((2, 10, 4), seed=seed)
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7)))
    return w, b


def _stepped(name, **options):
    """An optimizer over a frame and a bias after one step, with the gradients of a second in place."""
    w, b = _frame_and_bias()
    opt = _make(name, [w, b], **options)
    for g_w, g_b in zip(_grads(w.shape, 2), _grads(b.shape, 2, seed=3), strict=True):
        w.grad, b.grad = g_w, g_b
        if opt.state:
            break
        opt.step()
    return opt, [w, b]


def test_same_helper_detects_a_changed_step_count():
    """Companion of every 'nothing changed' check below: one step count moved by one is seen."""
    opt, params = _stepped("StiefelMuon")
    before = _everything(opt, params)
    opt.state[params[1]]["step"] += 1
    assert not _same(before, _everything(opt, params))


#: A value written into ``param_groups[0]`` after a first step, the options the optimizer was built with, and the
#: refusal's words. Each would be refused by torch's functional AdamW inside the step, after the frames had moved
#: (a tensor lr in a foreach group: StiefelAdam moved its frames by 2.1e-2 before torch raised), or is an option
#: the shared table refuses.
WRITTEN_LATER = {
    "tensor lr, foreach": ({"foreach": True}, {"lr": torch.tensor(0.05)},
                           r"lr is a tensor and foreach=True, with capturable=None: torch's AdamW"),
    "tensor lr, foreach, capturable on the CPU": ({"foreach": True, "capturable": True}, {"lr": torch.tensor(0.05)},
                                                  r"parameter group 0 has a tensor lr and foreach=True.*on cpu, where torch's "
                                                  r"AdamW has no capturable step"),
    "tensor betas": ({}, {"betas": (torch.tensor(0.9), torch.tensor(0.999))}, r"betas=\(tensor"),
    "fused": ({}, {"fused": True}, r"fused=True is not supported"),
    "differentiable": ({}, {"differentiable": True}, r"differentiable=True is not supported"),
    "L2 penalty": ({}, {"decoupled_weight_decay": False}, r"decoupled_weight_decay=False is not supported"),
    "bool weight decay": ({}, {"weight_decay": True}, r"weight_decay=True is invalid"),
    "amsgrad switched on": ({}, {"amsgrad": True}, r"a parameter that is not a frame \(shape \(4,\), group 0\) has "
                                                  r"optimizer state without \['max_exp_avg_sq'\]"),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", list(WRITTEN_LATER))
def test_an_option_written_after_construction_is_refused_before_anything_moves(name, case):
    """Frames, bias, moments, step counts and skip counters are bit for bit as before the refused step (the frame
    update runs first, so a refusal from inside torch's AdamW came after the frames had moved); a retry refuses
    again, and with the option restored the same optimizer steps (and moves: the check has teeth)."""
    options, written, words = WRITTEN_LATER[case]
    opt, params = _stepped(name, **options)
    before = _everything(opt, params)
    saved = {key: opt.param_groups[0].get(key) for key in written}
    opt.param_groups[0].update(written)
    for _ in range(2):
        with pytest.raises(ValueError, match=f"{name}: {words}"):
            opt.step()
        assert _same(before, _everything(opt, params))
    opt.param_groups[0].update(saved)
    opt.step()
    assert not torch.equal(params[0].detach(), before[1][0]) and not torch.equal(params[1].detach(), before[1][1])


def test_a_tensor_lr_with_foreach_is_refused_at_construction_by_both_in_the_same_words_as_by_torch():
    """``StiefelMuon([frames, bias], lr=torch.tensor(1e-2), foreach=True)`` was accepted and its first step moved
    the frames before torch's AdamW raised for the bias; now both optimizers refuse it at construction, as
    ``torch.optim.AdamW`` does (and StiefelAdam did, in torch's words), with one message. With capturable=True
    the parameters decide: a bias on the CPU, where torch's AdamW has no capturable step, is refused too."""
    messages = {}
    for name in NAMES:
        for options in ({"foreach": True}, {"foreach": True, "capturable": True}):
            with pytest.raises(ValueError, match=f"{name}: ") as info:
                _make(name, [*_frame_and_bias()], lr=torch.tensor(1e-2), **options)
            messages.setdefault(str(options), set()).add(str(info.value).replace(name, "<optimizer>"))
    assert all(len(words) == 1 for words in messages.values()), messages
    with pytest.raises(ValueError, match="lr as a Tensor is not supported for capturable=False and foreach=True"):
        torch.optim.AdamW([_frame_and_bias()[1]], lr=torch.tensor(1e-2), foreach=True)


@pytest.mark.parametrize("name", NAMES)
def test_companion_a_tensor_lr_is_accepted_where_torchs_step_takes_it(name):
    """A tensor lr with foreach left to torch (it takes the single-tensor step), and with foreach=True and
    capturable=True for frames alone (no AdamW part), steps and moves."""
    w, b = _frame_and_bias()
    w0, b0 = w.detach().clone(), b.detach().clone()
    opt = _make(name, [w, b], lr=torch.tensor(0.05))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    assert not torch.equal(w.detach(), w0) and not torch.equal(b.detach(), b0)
    w = _frame()
    w0 = w.detach().clone()
    opt = _make(name, [w], lr=torch.tensor(0.05), foreach=True, capturable=True)
    w.grad = torch.ones_like(w)
    opt.step()
    assert not torch.equal(w.detach(), w0)


def test_a_step_count_off_its_parameters_device_on_torchs_capturable_path_is_refused(monkeypatch):
    """torch's capturable AdamW asserts each step count on its parameter's device (one left on the CPU when
    capturable was switched on after the first step): refused before anything moves, naming the fix. Run on the
    CPU by declaring it a device with a capturable AdamW; the CUDA test below does it for real."""
    from geoopt_stiefel_attention.optim import _state, _validation

    monkeypatch.setattr(_state, "TORCH_CAPTURABLE_DEVICES", ("cpu",))
    b = torch.nn.Parameter(torch.ones(3))
    group = {"params": [b], "lr": 0.1, "capturable": True}

    def state(device):
        return {b: {"step": torch.zeros((), device=device), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}

    with pytest.raises(ValueError, match=r"StiefelMuon: a parameter that is not a frame.*step count on meta.*"
                                         r"optimizer.load_state_dict\(optimizer.state_dict\(\)\)"):
        _validation.check_euclidean_step(group, 0, [b], "StiefelMuon", state("meta"))
    _validation.check_euclidean_step(group, 0, [b], "StiefelMuon", state("cpu"))  # companion
    _validation.check_euclidean_step({**group, "capturable": False}, 0, [b], "StiefelMuon", state("meta"))  # no check


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's capturable AdamW)")
@pytest.mark.parametrize("name", NAMES)
def test_capturable_switched_on_after_the_first_step_is_refused_before_anything_moves_on_cuda(name):
    w, b = _frame_and_bias()
    w, b = (type(t)(t.detach().cuda(), **({"manifold": t.manifold} if t is w else {})) for t in (w, b))
    opt = _make(name, [w, b], capturable=False)
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    opt.param_groups[0]["capturable"] = True
    before = _everything(opt, [w, b])
    with pytest.raises(ValueError, match="step count on cpu"):
        opt.step()
    assert _same(before, _everything(opt, [w, b]))
    opt.load_state_dict(opt.state_dict())  # the fix the message names
    opt.step()
    assert not torch.equal(w.detach(), before[1][0])


# ----------------------------------------------------------------------------- one check per option
#: Values each shared option must refuse, and values it must accept (the test's own, not the table's).
BAD_SHARED = {
    "fused": [True], "differentiable": [True], "decoupled_weight_decay": [False],
    "lr": [-1.0, float("nan"), float("inf"), True, "1e-3", None, torch.tensor(-1.0), torch.tensor([1e-3, 1e-3])],
    "betas": [(0.9,), 0.9, (1.0, 0.999), (0.9, float("nan")), (True, 0.999), (torch.tensor(0.9), torch.tensor(0.99))],
    "eps": [-1e-8, float("inf"), True, None],
    "weight_decay": [True, False, -0.1, float("nan"), "0.1", None],
    "adjust_lr_fn": ["rms", None, "Original"],
    "master_weights": [1, "yes", None],
    "capturable": ["yes", 1],
    "foreach": [1, "yes"],
    "amsgrad": [1, None],
    "maximize": [0, "no"],
}
GOOD_SHARED = {
    "fused": [None, False], "differentiable": [False], "decoupled_weight_decay": [True],
    "lr": [0.0, 0.05, 1, torch.tensor(0.05)], "betas": [(0.0, 0.5), [0.9, 0.99]], "eps": [0.0, 1e-6],
    "weight_decay": [0.0, 0.1, 1], "adjust_lr_fn": ["original", "match_rms_adamw"],
    "master_weights": [True, False], "capturable": [None, False, True], "foreach": [None, False, True],
    "amsgrad": [True, False], "maximize": [True, False],
}


def test_the_option_table_is_the_options_both_optimizers_have_and_the_test_covers_each():
    shared = {option.name for option in SHARED_OPTIONS}
    assert len(shared) == len(SHARED_OPTIONS)  # each option declared once
    assert set(BAD_SHARED) == set(GOOD_SHARED) == shared
    w, b = _frame_and_bias()
    for name in NAMES:
        assert shared <= set(_make(name, [w, b]).param_groups[0]), name


def _refusal(name, construct):
    with pytest.raises((ValueError, TypeError)) as info:
        construct()
    return info.type, str(info.value).replace(name, "<optimizer>")


@pytest.mark.parametrize(("option", "value"), [(k, v) for k, values in BAD_SHARED.items() for v in values],
                         ids=lambda x: repr(x)[:24])
def test_both_optimizers_refuse_a_bad_shared_option_in_the_same_words(option, value):
    """Same input, same answer, same words modulo the optimizer's name: given as a constructor argument (where both
    constructors take it), in a group dict, or written into param_groups after a step (refused at the step, before
    anything moves). ``StiefelAdam(weight_decay=True)`` was accepted while StiefelMuon refused it."""
    answers = set()
    for name in NAMES:
        cls = OPTIMIZERS[name][0]
        ways = [lambda name=name: _make(name, [{"params": [*_frame_and_bias()], option: value}])]
        if all(option in inspect.signature(c).parameters for c, _ in OPTIMIZERS.values()):
            ways.append(lambda name=name: _make(name, [*_frame_and_bias()], **{option: value}))
        for way in ways:
            exc, words = _refusal(name, way)
            answers.add((exc, words))
        opt, params = _stepped(name)
        before = _everything(opt, params)
        opt.param_groups[0][option] = value
        answers.add(_refusal(name, opt.step))
        assert _same(before, _everything(opt, params)), cls
    assert len(answers) == 1, answers
    ((_, words),) = answers
    assert words.startswith("<optimizer>: ") and (f"{option}=" in words or "lr is a tensor" in words), words


@pytest.mark.parametrize(("option", "value"), [(k, v) for k, values in GOOD_SHARED.items() for v in values],
                         ids=lambda x: repr(x)[:24])
def test_companion_both_optimizers_accept_a_good_shared_option(option, value):
    for name in NAMES:
        w, b = _frame_and_bias()
        opt = _make(name, [{"params": [w, b], option: value}])
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        opt.step()
        assert opt.state[w] and opt.state[b]


# ----------------------------------------------------------------------------- non-finite gradients, one policy
BAD_ENTRIES = [float("nan"), float("inf"), -float("inf")]


@contextlib.contextmanager
def _no_host_reads_but_in_torchs_cpu_adamw():
    """No tensor read on the host during the step, except inside torch's AdamW, which on the CPU has no capturable
    step and reads its step counts (on an accelerator it reads nothing)."""
    mode, real = NoHostReads(), _torch_adamw.adamw

    def adamw(*args, **kwargs):
        with mode.allowing():
            return real(*args, **kwargs)

    _torch_adamw.adamw = adamw
    try:
        with mode:
            yield
    finally:
        _torch_adamw.adamw = real


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
def test_companion_the_host_read_check_catches_the_default_cpu_step():
    """The default CPU step reads its skip flags on the host (free there): the check above sees it."""
    _, b = _frame_and_bias()
    opt = _make("StiefelAdam", [b])
    b.grad = torch.ones_like(b)
    opt.step()
    with pytest.raises(AssertionError, match="host read"), _no_host_reads_but_in_torchs_cpu_adamw():
        opt.step()


def _policy_run(name, skip, path, amsgrad, bad=float("nan")):
    """Four steps of a frame, a bias and a weight; at the second, the bias's gradient has one bad entry (``skip``)
    or the bias has no gradient at all (the reference: a parameter without a gradient takes no step). ``path``:
    "default", "capturable" (on the CPU, whose AdamW reads its step counts: the flags are read there too) or
    "device" (capturable off the CPU, run on the CPU by lifting its exemption: no host read at all)."""
    w, b = _frame_and_bias()
    c = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
    opt = _make(name, [w, b, c], capturable=path != "default", amsgrad=amsgrad, weight_decay=0.1)
    gens = [_grads(t.shape, 4, seed=s) for t, s in ((w, 11), (b, 12), (c, 13))]
    at_skip = None
    for t in range(4):
        for p, gs in zip((w, b, c), gens, strict=True):
            p.grad = gs[t].clone()
        if t == 1:
            if skip:
                b.grad[2] = bad
            else:
                b.grad = None
            at_skip = _everything(opt, [w, b, c])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with _no_host_reads_but_in_torchs_cpu_adamw() if path == "device" else contextlib.nullcontext():
                    opt.step()
            after = _everything(opt, [w, b, c])
        else:
            opt.step()
    return opt, (w, b, c), at_skip, after, [x for x in caught if "skipped the update" in str(x.message)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("path", ["default", "capturable", "device"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("bad", BAD_ENTRIES)
def test_a_non_finite_gradient_skips_a_parameter_that_is_not_a_frame_whole_and_counts_it(monkeypatch, name, path,
                                                                                           amsgrad, bad):
    """The frames' policy for every parameter: a bias whose gradient has a NaN or Inf entry keeps its value, its
    moments (amsgrad's maximum too) and its step count, bit for bit, and the skip is counted in its
    ``state["skipped_frames"]``; the run then continues exactly like one in which the bias had no gradient at that
    step, while the others train. Off the CPU in capturable mode the skip is made on the device: no host read.
    The default step says it once; the capturable one counts only, as for frames."""
    if path == "device":
        from geoopt_stiefel_attention import _linalg

        monkeypatch.setattr(_linalg, "HOST_READ_DEVICES", frozenset())
    opt, params, at_skip, after, said = _policy_run(name, True, path, amsgrad, bad)
    ref_opt, ref_params, _, _, _ = _policy_run(name, False, path, amsgrad)
    b_key = 1  # the bias's number in the state dict
    assert _same(at_skip[0][b_key] | {"skipped_frames": None}, after[0][b_key] | {"skipped_frames": None})
    assert torch.equal(after[1][1], at_skip[1][1]) and not torch.equal(after[1][2], at_skip[1][2])
    assert [int(opt.state[p]["skipped_frames"]) for p in params] == [0, 1, 0]
    assert [int(ref_opt.state[p]["skipped_frames"]) for p in ref_params] == [0, 0, 0]
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p.detach(), q.detach())
        assert _same({k: v for k, v in opt.state[p].items() if k != "skipped_frames"},
                     {k: v for k, v in ref_opt.state[q].items() if k != "skipped_frames"})
    assert len(said) == (1 if path == "default" else 0)


def test_companion_torchs_adamw_turns_the_same_bias_into_nan():
    """What the parameters that are not frames did before (torch's AdamW, which does not skip): the property above
    fails for it."""
    _, b = _frame_and_bias()
    b.grad = torch.randn_like(b)
    b.grad[2] = float("nan")
    torch.optim.AdamW([b], lr=0.05).step()
    assert not torch.isfinite(b).all()


@pytest.mark.parametrize("name", NAMES)
def test_a_skipped_parameter_is_named_once_in_one_warning(name):
    """The first skip of each parameter, frame or not, gives one UserWarning naming it (its name when the groups
    carry names); later skips of it are counted without a word; a finite step says nothing. The capturable path
    counts without reading the host, so it does not warn."""
    w, b = _frame_and_bias()
    c = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = _make(name, [("attn.w_q", w), ("head.bias", b), ("head.scale", c)])

    def step(bad_w=False, bad_b=False):
        w.grad, b.grad, c.grad = torch.randn_like(w), torch.randn_like(b), torch.randn_like(c)
        if bad_w:
            w.grad[1, 0, 0] = float("inf")
        if bad_b:
            b.grad[0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        return [str(x.message) for x in caught if "skipped the update" in str(x.message)]

    assert step() == []
    (said,) = step(bad_b=True)
    assert said.startswith(f"{name}.step(): a NaN or Inf gradient skipped the update of 1 parameter(s): parameter "
                           f"'head.bias' (group 0, position 1, shape (4,))") and "attn.w_q" not in said
    assert step(bad_b=True) == [] and int(opt.state[b]["skipped_frames"]) == 2
    (said,) = step(bad_w=True, bad_b=True)
    assert "frame 'attn.w_q' (group 0, position 0, shape (2, 10, 4))" in said and "head.bias" not in said
    assert [int(opt.state[p]["skipped_frames"]) for p in (w, b, c)] == [1, 3, 0]
    w2, b2 = _frame_and_bias()
    opt = _make(name, [w2, b2], capturable=True)
    w2.grad, b2.grad = torch.randn_like(w2), torch.randn_like(b2)
    b2.grad[0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert int(opt.state[b2]["skipped_frames"]) == 1


# ----------------------------------------------------------------------------- the references take the optimizers' values
#: float64: one optimizer step vs its readable reference (measured 0 for StiefelAdam's kernel on these frames; the
#: certified Muon solver against the SVD reference on 10 x 4 frames, float64, well below it).
REFERENCE_TOL = 1e-9


@pytest.mark.parametrize("fn", ["original", "match_rms_adamw"])
def test_stiefel_adam_update_resolves_auto_as_the_optimizer_does(fn):
    """``trust_region="auto"``, the value every group holds by default, failed inside the reference with a
    TypeError; given the group's rule it is the rule's radius (written out here: 0.1 or 1), with lr read by the
    rule (c = 1 or sqrt(dr)), and the reference then equals the optimizer's step. The radius bites at this lr
    (companion: without it the step differs)."""
    w0 = _frame((2, 10, 4), seed=3).detach()
    g = _grads(w0.shape, 1, seed=8)[0]
    m0, v0 = torch.zeros_like(w0), torch.zeros(2, 1, 1, dtype=torch.float64)
    hyper = dict(step=1, beta1=0.9, beta2=0.999, eps=1e-8)
    auto = stiefel_adam_update(w0, g, m0, v0, lr=0.5, trust_region="auto", adjust_lr_fn=fn, **hyper)
    radius, c = {"original": (0.1, 1.0), "match_rms_adamw": (1.0, math.sqrt(10 * 4))}[fn]
    number = stiefel_adam_update(w0, g, m0, v0, lr=0.5 * c, trust_region=radius, **hyper)
    for x, y in zip(auto, number, strict=True):
        assert torch.equal(x, y)
    tensor_lr = stiefel_adam_update(w0, g, m0, v0, lr=torch.tensor(0.5, dtype=torch.float64), trust_region="auto",
                                    adjust_lr_fn=fn, **hyper)
    assert float((tensor_lr[0] - auto[0]).abs().max()) < REFERENCE_TOL
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelAdam([w], lr=0.5, adjust_lr_fn=fn)
    assert opt.param_groups[0]["trust_region"] == "auto"
    w.grad = g.clone()
    opt.step()
    assert float((w.detach() - auto[0]).abs().max()) < REFERENCE_TOL
    assert float((opt.state[w]["exp_avg"] - auto[1]).abs().max()) < REFERENCE_TOL
    uncapped = stiefel_adam_update(w0, g, m0, v0, lr=0.5, trust_region=None, adjust_lr_fn=fn, **hyper)
    assert float((uncapped[0] - auto[0]).abs().max()) > 1e3 * REFERENCE_TOL


@pytest.mark.parametrize(("options", "words"), [
    ({"trust_region": "auto"}, r"trust_region='auto' is the radius of a step rule, and no adjust_lr_fn was given"),
    ({"trust_region": "automatic", "adjust_lr_fn": "original"}, r"trust_region='automatic' is invalid"),
    ({"trust_region": -0.1}, r"trust_region=-0.1 is invalid"),
    ({"trust_region": True}, r"trust_region=True is invalid"),
    ({"trust_region": 0.1, "adjust_lr_fn": "rms"}, r"adjust_lr_fn='rms' is unknown"),
    ({"trust_region": 0.1, "second_moment": "row"}, r"second_moment='row' is unknown"),
])
def test_stiefel_adam_update_refuses_a_bad_value_by_name_in_the_optimizers_words(options, words):
    w0 = _frame((2, 10, 4)).detach()
    args = (w0, torch.randn_like(w0), torch.zeros_like(w0), torch.zeros(2, 1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=f"stiefel_adam_update: {words}") as info:
        stiefel_adam_update(*args, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, **options)
    if "adjust_lr_fn" in options or options["trust_region"] != "auto":  # the optimizer's own words
        _, b = _frame_and_bias()
        with pytest.raises(ValueError) as optimizer_info:
            StiefelAdam([b], **options)
        assert str(optimizer_info.value).replace("StiefelAdam", "stiefel_adam_update") == str(info.value)


@pytest.mark.parametrize("fn", ["original", "match_rms_adamw"])
def test_stiefel_muon_update_reads_lr_by_the_rule_as_the_optimizer_does(fn):
    """The Muon reference takes a group's lr and adjust_lr_fn as the optimizer does (eta = lr * s(d, r), written
    out here: sqrt(d / r) or 0.2 sqrt(d)), and equals the optimizer's step."""
    w0 = _frame((2, 10, 4), seed=3).detach()
    g = _grads(w0.shape, 1, seed=8)[0]
    kw = dict(momentum=0.95, nesterov=True)
    by_rule = stiefel_muon_update(w0, g, torch.zeros_like(w0), lr=0.05, adjust_lr_fn=fn, **kw)
    scale = {"original": math.sqrt(10 / 4), "match_rms_adamw": 0.2 * math.sqrt(10)}[fn]
    scaled = stiefel_muon_update(w0, g, torch.zeros_like(w0), lr=0.05 * scale, **kw)
    for x, y in zip(by_rule, scaled, strict=True):
        assert torch.equal(x, y)
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.05, adjust_lr_fn=fn)
    w.grad = g.clone()
    opt.step()
    assert float((w.detach() - by_rule[0]).abs().max()) < REFERENCE_TOL
    assert float((w.detach() - w0).abs().max()) > 1e3 * REFERENCE_TOL  # the step moved the frames


@pytest.mark.parametrize(("option", "value"), [("momentum", 1.0), ("nesterov", 1), ("adjust_lr_fn", "spectral")])
def test_stiefel_muon_update_refuses_a_bad_value_by_name(option, value):
    w0 = _frame((2, 10, 4)).detach()
    kw = dict(lr=0.05, momentum=0.95, nesterov=True) | {option: value}
    with pytest.raises(ValueError, match=f"stiefel_muon_update: {option}={value!r} is "):
        stiefel_muon_update(w0, torch.randn_like(w0), torch.zeros_like(w0), **kw)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("path", ["default", "device"])
def test_a_sharded_parameter_that_is_not_a_frame_is_skipped_whole_like_a_plain_one(monkeypatch, one_rank_group, name,
                                                                                   path):
    """A sharded (DTensor) bias with a NaN in its gradient takes the decision of the whole parameter (its squared
    norm summed over the mesh: one collective, so that every rank of a real mesh agrees) and is skipped like its
    plain twin, on the default path and on the device path; the run then goes on like the twin's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from geoopt_stiefel_attention import _linalg
    from geoopt_stiefel_attention.distributed import declare_sharded_euclidean

    if path == "device":
        monkeypatch.setattr(_linalg, "HOST_READ_DEVICES", frozenset())
    mesh = init_device_mesh("cpu", (1,))
    value = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sharded = torch.nn.Parameter(distribute_tensor(value.clone(), mesh, [Shard(0)]))
    declare_sharded_euclidean([sharded])
    plain = torch.nn.Parameter(value.clone())
    w_s, w_p = _frame(), _frame()
    opts = [_make(name, [w, b], capturable=path == "device") for w, b in ((w_s, sharded), (w_p, plain))]
    grads = _grads((6,), 3, seed=5)
    grads[1][4] = float("nan")
    for t, g in enumerate(grads):
        g_w = _grads(w_s.shape, 1, seed=20 + t)[0]
        sharded.grad, plain.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]), g.clone()
        w_s.grad, w_p.grad = g_w.clone(), g_w.clone()
        for opt in opts:
            opt.step()
        if t == 1:
            assert torch.equal(sharded.full_tensor(), plain.detach()) and int(opts[0].state[sharded]["step"]) == 1
    assert torch.equal(sharded.full_tensor(), plain.detach()) and not torch.equal(plain.detach(), value)
    assert int(opts[0].state[sharded]["skipped_frames"]) == int(opts[1].state[plain]["skipped_frames"]) == 1
