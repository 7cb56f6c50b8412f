"""StiefelAdam keeps torch.optim's contract (issue 13).

Modelled on what torch's own optimizer tests check (``torch/testing/_internal/common_optimizers.py`` and
``test/optim``): parameter groups in every form torch accepts, the same validation whatever the form, state
dicts across dtypes and from geoopt, load/state-dict/step hooks, deepcopy and pickle, closures, ``zero_grad``,
LR schedulers (``OneCycleLR`` cycling ``betas`` included), ``lr=0``/``eps=0``, the ``foreach``/``fused``/
``differentiable`` flags; and, as torch tests its foreach and fused kernels against ``_single_tensor_adam``, the
fused in-place frame kernel against the readable :func:`stiefel_adam_update` over many steps.
"""

import copy
import pickle
import warnings

import geoopt
import pytest
import torch
from conftest import ORTHO_TOL_F64, NoHostReads, tiny_transformer

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam, StiefelMuon, param_groups, stiefel_adam_update
from geoopt_stiefel_attention import _linalg as _linalg_module
from geoopt_stiefel_attention._linalg import orthonormality_error

KERNEL_TOL = 1e-11  # float64: fused kernel vs stiefel_adam_update after 120 steps (frames, moments)
SCHEDULE_TOL = 1e-12  # float64: optimizer under OneCycleLR vs the update written with the scheduled lr, beta1
DTYPE_RESUME_TOL = 1e-5  # float32 continuation of a float64 run vs the float64 continuation (4 steps)
GEOOPT_TOL = 1e-7  # StiefelAdam resumed from a geoopt checkpoint vs geoopt (QR vs polar, trust region off)


# ----------------------------------------------------------------------------- helpers
def _frames(shape, seed=0, dtype=torch.float64):
    return PolarStiefel().random(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _frame_param(shape=(2, 10, 4), seed=0, dtype=torch.float64, manifold=None):
    return geoopt.ManifoldParameter(_frames(shape, seed, dtype).as_subclass(torch.Tensor),
                                    manifold=manifold or PolarStiefel())


class _Net(torch.nn.Module):
    """A frame and a bias in ``base``, a Linear ``head``: the per-layer example of torch's docs."""

    def __init__(self, seed=0, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.base = torch.nn.Module()
        self.base.w = _frame_param((2, 10, 4), seed, dtype)
        self.base.b = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        self.head = torch.nn.Linear(4, 3, dtype=dtype)

    def forward(self, x):  # x: (n, 10)
        h = torch.einsum("nd,hdr->nr", x, self.base.w) + self.base.b
        return self.head(torch.tanh(h))


def _inputs(n=3, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 10, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype))
            for _ in range(n)]


def _train(net, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        (net(x) - y).square().mean().backward()
        opt.step()


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _same_tensors(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _state_snapshot(opt):
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
            for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys()
        and all(torch.equal(a[i][k], b[i][k]) if torch.is_tensor(a[i][k]) else a[i][k] == b[i][k] for k in a[i])
        for i in a)


# ----------------------------------------------------------------------------- parameter groups
def test_group_dicts_holding_generators_train_every_parameter():
    """The per-layer example of torch's docs: before the fix both groups came out empty and nothing trained."""
    net = _Net()
    before = _params(net)
    opt = StiefelAdam([{"params": net.base.parameters()}, {"params": net.head.parameters(), "lr": 1e-3}], lr=1e-2)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]
    _train(net, opt, _inputs(1))
    assert all(not torch.equal(p, q) for p, q in zip(before, _params(net), strict=True))


def test_add_param_group_reads_a_generator_once():
    net = _Net()
    opt = StiefelAdam(net.base.parameters(), lr=1e-2)
    opt.add_param_group({"params": net.head.parameters(), "lr": 1e-3})
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert opt.param_groups[1]["params"][0] is net.head.weight


def _grouped(net, form):
    base, head = list(net.base.named_parameters()), list(net.head.named_parameters())
    if form == "list":
        return [p for _, p in base + head]
    if form == "tuple":
        return tuple(p for _, p in base + head)
    if form == "generator":
        return net.parameters()
    if form == "named":
        return net.named_parameters()
    if form == "group_generators":
        return [{"params": net.base.parameters()}, {"params": net.head.parameters()}]
    if form == "named_groups":
        return [{"params": net.base.named_parameters()}, {"params": iter(head)}]
    raise AssertionError(form)


FORMS = ["list", "tuple", "generator", "named", "group_generators", "named_groups"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_params_gives_the_same_training(form):
    reference_net = _Net()
    _train(reference_net, StiefelAdam(list(reference_net.parameters()), lr=1e-2), _inputs())
    net = _Net()
    opt = StiefelAdam(_grouped(net, form), lr=1e-2)
    _train(net, opt, _inputs())
    assert _same_tensors(_params(net), _params(reference_net))
    if form.startswith("named"):  # torch >= 2.4: names are kept and saved
        names = [n for g in opt.state_dict()["param_groups"] for n in g["param_names"]]
        expected = {"named": ["base.w", "base.b", "head.weight", "head.bias"],
                    "named_groups": ["w", "b", "weight", "bias"]}[form]
        assert names == expected


def _offer(p, form):
    """Give ``p`` (beside a plain parameter) to a new optimizer, or to add_param_group, in the given form."""
    plain = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    if form == "list":
        return StiefelAdam([plain, p])
    if form == "generator":
        return StiefelAdam(x for x in (plain, p))
    if form == "named":
        return StiefelAdam([("plain", plain), ("w", p)])
    if form == "group_generator":
        return StiefelAdam([{"params": [plain]}, {"params": (x for x in [p])}])
    if form == "named_group":
        return StiefelAdam([{"params": [("plain", plain), ("w", p)]}])
    opt = StiefelAdam([("plain", plain)] if form == "add_named" else [plain])
    return opt.add_param_group({"params": iter([("w", p)] if form == "add_named" else [p])})


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
@pytest.mark.parametrize("kind", ["canonical", "sphere", "complex"])
@pytest.mark.parametrize("form", ["list", "generator", "named", "group_generator", "named_group", "add_generator",
                                  "add_named"])
def test_validation_is_the_same_whatever_form_the_params_arrive_in(kind, form, bad_frame):
    """Before the fix a ("w", p) pair skipped validation: a canonical Stiefel or Sphere parameter was trained as a
    plain matrix by AdamW and left its manifold."""
    p, exc, message = bad_frame(kind)
    with pytest.raises(exc, match=message):
        _offer(p, form)


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
def test_a_good_frame_is_accepted_in_every_form():
    """Companion of the validation test: the same forms accept a PolarStiefel frame."""
    for form in ["list", "generator", "named", "group_generator", "named_group", "add_generator", "add_named"]:
        p = _frame_param((9, 3))
        _offer(p, form)


def test_empty_parameters_raise_like_torch():
    with pytest.raises(ValueError, match="empty parameter list"):
        StiefelAdam([])
    with pytest.raises(ValueError, match="empty parameter list"):
        StiefelAdam(iter([]))
    with pytest.raises(ValueError, match="all 2 parameter groups are empty"), pytest.warns(UserWarning):
        StiefelAdam([{"params": []}, {"params": iter([])}])
    with pytest.raises(TypeError, match="not a set"):
        StiefelAdam([{"params": {torch.nn.Parameter(torch.ones(2))}}])
    with pytest.raises(TypeError, match="iterable"):
        StiefelAdam(torch.nn.Parameter(torch.ones(2)))
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="more than one parameter group"):
        StiefelAdam([{"params": [p]}, {"params": [p]}])


def test_an_empty_group_from_a_consumed_generator_warns():
    net = _Net()
    params = net.parameters()
    list(params)  # consumed, e.g. by an earlier optimizer
    with pytest.warns(UserWarning, match="group 1 is empty"):
        StiefelAdam([{"params": [net.base.w]}, {"params": params}])
    opt = StiefelAdam([net.base.w])
    with pytest.warns(UserWarning, match="group 1 is empty"):
        opt.add_param_group({"params": []})


def test_an_explicit_empty_list_beside_other_groups_is_accepted_silently():
    """Companion: param_groups() of a model without frames has an empty "frames" list; torch accepts it."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = StiefelAdam(param_groups(model, weight_decay=0.1, expect_frames=False))  # param_groups would warn
    assert [len(g["params"]) for g in opt.param_groups] == [0, 1, 3]


# ----------------------------------------------------------------------------- lr = 0, eps = 0
def test_lr_zero_leaves_frames_bit_identical_and_updates_the_moments():
    net = _Net()
    before = _params(net)
    opt = StiefelAdam(net.parameters(), lr=0.0, weight_decay=0.1)
    _train(net, opt, _inputs(3))
    assert _same_tensors(_params(net), before)
    state = opt.state[net.base.w]
    assert float(state["step"]) == 3 and state["exp_avg"].abs().max() > 0 and state["exp_avg_sq"].min() > 0


def test_warm_up_from_lr_zero_then_moves():
    """LambdaLR starting at 0 (a linear warm-up): the first step moves nothing, the next ones move the frame."""
    net = _Net()
    w0 = net.base.w.detach().clone()
    opt = StiefelAdam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, t / 3))
    x, y = _inputs(1)[0]
    moved = []
    for _ in range(3):
        opt.zero_grad()
        (net(x) - y).square().mean().backward()
        opt.step()
        sched.step()
        moved.append(float((net.base.w.detach() - w0).abs().max()))
    assert moved[0] == 0.0 and moved[1] > 1e-4 and moved[2] > moved[1]
    assert float(orthonormality_error(net.base.w)) < ORTHO_TOL_F64


@pytest.mark.parametrize("second_moment", ["frame", "column", "element"])
def test_eps_zero_with_a_zero_gradient_takes_no_step_and_gives_no_nan(second_moment):
    """A frame whose second moment is zero (only zero Riemannian gradients so far) takes no step with eps=0
    instead of 0/0; the other frames of the stack move normally."""
    w = _frame_param((3, 10, 4))
    w0 = w.detach().clone()
    opt = StiefelAdam([w], lr=1e-2, eps=0.0, second_moment=second_moment)
    for _ in range(3):
        g = torch.randn_like(w)
        g[1] = 0.0  # frame 1: zero gradient
        w.grad = g
        opt.step()
    assert torch.isfinite(w).all() and all(torch.isfinite(v).all() for v in opt.state[w].values())
    assert torch.equal(w[1], w0[1])
    assert (w[0] - w0[0]).abs().max() > 1e-3 and (w[2] - w0[2]).abs().max() > 1e-3
    assert float(orthonormality_error(w)) < ORTHO_TOL_F64


def test_eps_zero_in_the_pure_update_gives_no_nan():
    w = _frames((2, 10, 4))
    grad = torch.randn_like(w)
    grad[0] = 0.0
    w_new, m, v, finite = stiefel_adam_update(w, grad, torch.zeros_like(w), torch.zeros(2, 1, 1, dtype=w.dtype),
                                              step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=0.0, trust_region=0.1)
    assert bool(finite.all()) and torch.isfinite(w_new).all()
    assert torch.equal(w_new[0], w[0]) and not torch.equal(w_new[1], w[1])


# ----------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize(("saved", "loaded"), [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_state_dict_loads_after_the_model_changed_dtype(saved, loaded):
    """torch casts floating state to the parameter's dtype (``step`` excepted); before the fix frame state kept the
    saved dtype and every later step crashed."""
    net = _Net(dtype=saved)
    opt = StiefelAdam(net.parameters(), lr=1e-2)
    batches = _inputs(6, dtype=saved)
    _train(net, opt, batches[:2])
    sd = copy.deepcopy(opt.state_dict())
    moved = copy.deepcopy(net).to(loaded)
    opt2 = StiefelAdam(moved.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    for p in moved.parameters():
        state = opt2.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == loaded
        assert state["step"].dtype == torch.float32 and float(state["step"]) == 2
    assert opt2.state[moved.base.w]["skipped_frames"].dtype == torch.int64
    _train(moved, opt2, [(x.to(loaded), y.to(loaded)) for x, y in batches[2:]])
    _train(net, opt, batches[2:])
    diff = max(float((p.detach().double() - q.detach().double()).abs().max()) for p, q in zip(net.parameters(), moved.parameters(),
                                                                             strict=True))
    assert diff < DTYPE_RESUME_TOL
    assert float(orthonormality_error(moved.base.w)) < (1e-5 if loaded == torch.float32 else ORTHO_TOL_F64)


def test_load_state_dict_pre_hook_that_rewrites_frame_state_is_honoured():
    """Before the fix the frame state was re-read from the dict passed in, ignoring what the hook returned."""
    net = _Net()
    opt = StiefelAdam(net.parameters(), lr=1e-2)
    _train(net, opt, _inputs(2))
    sd = opt.state_dict()

    def rewrite(optimizer, state_dict):
        new = copy.deepcopy(state_dict)
        new["state"][0]["exp_avg"] = 2 * new["state"][0]["exp_avg"]  # index 0 is base.w, the frame
        return new

    seen = []
    opt2 = StiefelAdam(net.parameters(), lr=1e-2)
    opt2.register_load_state_dict_pre_hook(rewrite)
    opt2.register_load_state_dict_post_hook(lambda o: seen.append(o.state[net.base.w]["exp_avg"].clone()))
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state[net.base.w]["exp_avg"], 2 * sd["state"][0]["exp_avg"])
    assert len(seen) == 1 and torch.equal(seen[0], opt2.state[net.base.w]["exp_avg"])


def test_state_dict_hooks_run():
    net = _Net()
    opt = StiefelAdam(net.parameters(), lr=1e-2)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

    def post(optimizer, state_dict):
        calls.append("post")
        state_dict["note"] = "kept"
        return state_dict

    opt.register_state_dict_post_hook(post)
    assert opt.state_dict()["note"] == "kept" and calls == ["pre", "post"]


def _geoopt_run(steps=4, amsgrad=False):
    """Frames on EuclideanStiefel and a plain bias trained by geoopt's RiemannianAdam (no weight decay)."""
    w = _frame_param((3, 10, 4), seed=2, manifold=geoopt.EuclideanStiefel())
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(3, 10, 4, generator=gen, dtype=torch.float64),
              torch.randn(4, generator=gen, dtype=torch.float64)) for _ in range(2 * steps)]
    opt = geoopt.optim.RiemannianAdam([w, b], lr=1e-3, amsgrad=amsgrad)
    for gw, gb in grads[:steps]:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    return w, b, opt, grads[steps:]


def test_geoopt_checkpoint_is_converted_and_continues_like_geoopt():
    w, b, opt_geoopt, rest = _geoopt_run()
    sd = copy.deepcopy(opt_geoopt.state_dict())
    assert sd["state"][0]["exp_avg_sq"].shape == (3, 10, 4) and sd["state"][0]["step"] == 4  # full size, int
    w2 = geoopt.ManifoldParameter(w.detach().clone(), manifold=PolarStiefel())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt = StiefelAdam([w2, b2], lr=1e-3, trust_region=None, adjust_lr_fn="original")  # geoopt's rule
    opt.load_state_dict(sd)
    state = opt.state[w2]
    assert state["exp_avg_sq"].shape == (3, 1, 1) and torch.equal(state["exp_avg_sq"], sd["state"][0]["exp_avg_sq"][..., :1, :1])
    assert torch.is_tensor(state["step"]) and float(state["step"]) == 4
    at_load = w2.detach().clone()
    for gw, gb in rest:
        w.grad, b.grad, w2.grad, b2.grad = gw.clone(), gb.clone(), gw.clone(), gb.clone()
        opt_geoopt.step()
        opt.step()
    assert float((w2 - w).detach().abs().max()) < GEOOPT_TOL and float((b2 - b).detach().abs().max()) < GEOOPT_TOL
    assert float((w2.detach() - at_load).abs().max()) > 1e3 * GEOOPT_TOL  # the comparison has teeth: the frames moved


def test_geoopt_checkpoint_that_is_not_per_frame_is_refused_and_changes_nothing():
    """Before the fix the load succeeded and the next step() failed with a bare shape error after advancing the
    step count."""
    w, b, opt_geoopt, rest = _geoopt_run()
    sd = copy.deepcopy(opt_geoopt.state_dict())
    sd["state"][0]["exp_avg_sq"][0, 0, 0] += 1.0  # no longer one scalar per frame
    w2 = geoopt.ManifoldParameter(w.detach().clone(), manifold=PolarStiefel())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt = StiefelAdam([w2, b2], lr=1e-3)
    w2.grad, b2.grad = rest[0][0].clone(), rest[0][1].clone()
    opt.step()
    before, groups_before = _state_snapshot(opt), copy.deepcopy(opt.state_dict()["param_groups"])
    with pytest.raises(ValueError, match=r"exp_avg_sq .*not constant on each frame"):
        opt.load_state_dict(sd)
    assert _same_state(before, _state_snapshot(opt)) and opt.state_dict()["param_groups"] == groups_before


def test_geoopt_amsgrad_buffer_of_a_frame_is_dropped_with_a_warning():
    w, b, opt_geoopt, _ = _geoopt_run(amsgrad=True)
    opt = StiefelAdam([geoopt.ManifoldParameter(w.detach().clone(), manifold=PolarStiefel()),
                       torch.nn.Parameter(b.detach().clone())], lr=1e-3, adjust_lr_fn="original")
    with pytest.warns(UserWarning, match="max_exp_avg_sq"):
        opt.load_state_dict(opt_geoopt.state_dict())
    frame_state, bias_state = (opt.state[p] for p in opt.param_groups[0]["params"])
    assert "max_exp_avg_sq" not in frame_state and "max_exp_avg_sq" in bias_state


def test_state_of_the_wrong_shape_is_refused_at_load_naming_the_parameter():
    net = _Net()
    opt = StiefelAdam(net.named_parameters(), lr=1e-2)
    _train(net, opt, _inputs(1))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"'head.weight'.*'exp_avg' has shape \(5,\), expected \(3, 4\)"):
        StiefelAdam(net.named_parameters(), lr=1e-2).load_state_dict(sd)


# ----------------------------------------------------------------------------- copies, hooks, closures
def test_deepcopy_and_pickle_give_a_working_optimizer():
    """Before the fix add_param_group raised AttributeError after a copy (geoopt's _stabilize was lost)."""
    net = _Net()
    opt = StiefelAdam(net.parameters(), lr=1e-2, stabilize=5)
    _train(net, opt, _inputs(1))
    copied = copy.deepcopy({"net": net, "opt": opt})
    net2, opt2 = copied["net"], copied["opt"]
    _train(net, opt, _inputs(2, seed=7))
    _train(net2, opt2, _inputs(2, seed=7))
    assert _same_tensors(_params(net), _params(net2))
    extra = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt2.add_param_group({"params": [extra]})
    assert opt2.param_groups[-1]["stabilize"] == 5 and opt2.param_groups[-1]["trust_region"] == "auto"
    unpickled = pickle.loads(pickle.dumps(opt))
    unpickled.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.5})
    assert unpickled.param_groups[-1]["lr"] == 0.5 and unpickled.param_groups[-1]["second_moment"] == "frame"


def test_step_hooks_and_closure():
    net = _Net()
    opt = StiefelAdam(net.parameters(), lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", float(o.state[net.base.w].get("step", 0)))))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", float(o.state[net.base.w]["step"]))))
    x, y = _inputs(1)[0]

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = (net(x) - y).square().mean()
        loss.backward()
        calls.append(("closure",))
        return loss

    loss = opt.step(closure)
    assert calls == [("pre", 0.0), ("closure",), ("post", 1.0)]
    assert torch.is_tensor(loss) and loss.requires_grad


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    net = _Net()
    opt = StiefelAdam(net.parameters())
    x, y = _inputs(1)[0]
    (net(x) - y).square().mean().backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in net.parameters():
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
@pytest.mark.parametrize("foreach", [False, True])
def test_foreach_flag_gives_torch_adamw_on_euclidean_parameters(foreach):
    def run(make):
        torch.manual_seed(0)
        lin = torch.nn.Linear(5, 3, dtype=torch.float64)
        opt = make(lin.parameters())
        for _ in range(3):
            opt.zero_grad()
            lin(torch.ones(2, 5, dtype=torch.float64)).square().sum().backward()
            opt.step()
        return [p.detach() for p in lin.parameters()]

    ours = run(lambda p: StiefelAdam(p, lr=0.1, weight_decay=0.1, foreach=foreach))
    torchs = run(lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=foreach))
    assert _same_tensors(ours, torchs)


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
@pytest.mark.parametrize("flag", ["differentiable", "fused"])
def test_unsupported_torch_flags_are_refused_clearly(flag):
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=rf"{flag}=True is not supported.*Pass {flag}="):
        StiefelAdam([p], **{flag: True})
    StiefelAdam([p], **{flag: False})  # the default value is accepted


#: torch's Adam flags a group dict may carry that torch honours and the frame optimizers do not implement
#: (torch's AdamW on ``{"decoupled_weight_decay": False}`` adds an L2 penalty: 0.06 away after two steps below)
GROUP_FLAGS = [("fused", True), ("differentiable", True), ("decoupled_weight_decay", False)]


@pytest.mark.parametrize("cls", [StiefelAdam, StiefelMuon])
@pytest.mark.parametrize(("flag", "value"), GROUP_FLAGS)
def test_unsupported_torch_flags_in_a_group_are_refused_before_anything_changes(cls, flag, value):
    """Given in a group dict, or written into param_groups later, such a flag was silently ignored (the step of
    the Euclidean parameters differed from torch's AdamW on the same group); now refused, naming the flag."""
    net = _Net()
    with pytest.raises(ValueError, match=rf"{cls.__name__}: {flag}={value}.*not supported"):
        cls([{"params": list(net.parameters()), flag: value}], lr=0.1, weight_decay=0.5)
    opt = cls(net.parameters(), lr=0.1, weight_decay=0.5)
    opt.param_groups[0][flag] = value
    before = _params(net)
    (net(torch.ones(2, 10, dtype=torch.float64)).sum()).backward()
    with pytest.raises(ValueError, match=rf"{cls.__name__}: {flag}={value}.*not supported"):
        opt.step()
    assert _same_tensors(_params(net), before) and not opt.state


@pytest.mark.parametrize("cls", [StiefelAdam, StiefelMuon])
@pytest.mark.parametrize(("flag", "value"), [("fused", None), ("fused", False), ("differentiable", False),
                                             ("decoupled_weight_decay", True)])
def test_companion_torch_flags_at_their_supported_value_train_the_euclidean_part_as_torch_adamw(cls, flag, value):
    def run(make):
        torch.manual_seed(0)
        b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        opt = make([{"params": [b], flag: value}])
        for t in range(2):
            b.grad = torch.full_like(b, 1.0 + t)
            opt.step()
        return [b.detach().clone()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no frame at all
        ours = run(lambda g: cls(g, lr=0.1, weight_decay=0.5))
    assert _same_tensors(ours, run(lambda g: torch.optim.AdamW(g, lr=0.1, weight_decay=0.5)))
    # what the refused value would have given: torch's coupled L2 penalty moves the parameter elsewhere
    assert not torch.allclose(ours[0], run(lambda g: torch.optim.AdamW(
        [{**g[0], "decoupled_weight_decay": False}], lr=0.1, weight_decay=0.5))[0], atol=1e-3)


# ----------------------------------------------------------------------------- LR schedulers
def test_one_cycle_lr_cycles_lr_and_beta1_of_the_frame_update():
    """OneCycleLR with cycle_momentum writes (beta1, beta2) into the groups; the frame update must use the
    scheduled lr and beta1 at every step (compared with the pure update fed the same values)."""
    w = _frame_param((2, 10, 4), seed=4)
    w_ref, m_ref, v_ref = w.detach().clone(), torch.zeros_like(w), torch.zeros(2, 1, 1, dtype=torch.float64)
    opt = StiefelAdam([w], lr=1e-2, betas=(0.9, 0.99), adjust_lr_fn="original")  # the update's own lr
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12, base_momentum=0.8,
                                                max_momentum=0.95)
    gen = torch.Generator().manual_seed(5)
    used = []
    for t in range(1, 13):
        g = torch.randn(2, 10, 4, generator=gen, dtype=torch.float64)
        lr, (beta1, beta2) = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
        used.append((lr, beta1))
        w.grad = g.clone()
        opt.step()
        sched.step()
        w_ref, m_ref, v_ref, _ = stiefel_adam_update(w_ref, g, m_ref, v_ref, step=t, lr=lr, beta1=beta1,
                                                     beta2=beta2, eps=1e-8, trust_region=0.1)
    assert len({b for _, b in used}) > 5 and len({lr for lr, _ in used}) > 5  # both really cycled
    assert float((w.detach() - w_ref).abs().max()) < SCHEDULE_TOL
    assert float((opt.state[w]["exp_avg"] - m_ref).abs().max()) < SCHEDULE_TOL


# ----------------------------------------------------------------------------- fused kernel vs readable update
KERNEL_SHAPES = [(2, 12, 4), (2, 12, 4), (2, 12, 4), (1, 16, 5), (1, 260, 128), (3, 9, 9)]
COLUMN_MAJOR = 3  # index of a parameter stored column-major (what torch.linalg.qr(...).Q returns)
NON_FINITE = {7: (0, 1, float("nan")), 19: (4, 0, float("inf")), 33: (2, 1, float("-inf")), 34: (3, 0, float("nan"))}


def _kernel_params():
    params = []
    for k, shape in enumerate(KERNEL_SHAPES):
        w = _frames(shape, seed=30 + k)
        if k == COLUMN_MAJOR:
            w = w.mT.contiguous().mT
        params.append(geoopt.ManifoldParameter(w, manifold=PolarStiefel()))
    assert not params[COLUMN_MAJOR].is_contiguous()
    return params


def _kernel_grads(params, t, targets, gen):
    """Gradient of 1/2 ||W - C||^2 plus noise, scaled over four decades so the trust region binds on some steps
    and not on others; a few steps carry a non-finite entry in one frame."""
    scale = 10.0 ** (((t * 7) % 5) - 3)
    grads = [scale * ((p.detach() - c) + torch.randn(p.shape, generator=gen, dtype=torch.float64))
             for p, c in zip(params, targets, strict=True)]
    if t in NON_FINITE:
        k, frame, value = NON_FINITE[t]
        grads[k][frame, 0, 0] = value
    return grads


@pytest.mark.parametrize(("lr", "trust_region", "second_moment", "maximize"), [
    (0.05, 0.02, "frame", False),  # trust region binding on most steps
    (1e-3, 0.1, "frame", False),  # trust region never binding
    (0.01, None, "frame", True),  # no trust region (exact eigendecomposition), maximize
    (0.02, 0.05, None, False),  # no second moment: fixed-step Riemannian SGD with momentum
])
def test_fused_kernel_matches_the_readable_update_for_120_steps(lr, trust_region, second_moment, maximize):
    steps, beta1, beta2, eps = 120, 0.9, 0.99, 1e-8
    params = _kernel_params()
    gen = torch.Generator().manual_seed(8)
    targets = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    opt = StiefelAdam(params, lr=lr, betas=(beta1, beta2), eps=eps, trust_region=trust_region,
                      second_moment=second_moment, maximize=maximize, adjust_lr_fn="original")
    ref = [(p.detach().clone(), torch.zeros_like(p),
            None if second_moment is None else torch.zeros(p.shape[:-2] + (1, 1), dtype=torch.float64),
            torch.zeros((), dtype=torch.int64)) for p in params]
    start = [p.detach().clone() for p in params]
    binding = 0
    for t in range(1, steps + 1):
        grads = _kernel_grads([r[0] for r in ref], t, targets, gen)
        new_ref = []
        for (w, m, v, skipped), g in zip(ref, grads, strict=True):
            w_new, m_new, v_new, finite = stiefel_adam_update(
                w, -g if maximize else g, m, v, step=t, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                trust_region=trust_region, second_moment=second_moment)
            if trust_region is not None:
                binding += int(((w_new - w).flatten(-2).norm(dim=-1) > 0.9 * trust_region).sum())
            new_ref.append((w_new, m_new, v_new, skipped + int((~finite).sum())))
        ref = new_ref
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    for p, (w, m, v, skipped), w0 in zip(params, ref, start, strict=True):
        state = opt.state[p]
        assert float((p.detach() - w).abs().max()) < KERNEL_TOL
        assert float((state["exp_avg"] - m).abs().max()) < KERNEL_TOL
        if v is not None:
            assert float(((state["exp_avg_sq"] - v).abs() / v.clamp_min(1e-300)).max()) < KERNEL_TOL
        assert int(state["skipped_frames"]) == int(skipped)
        assert float((p.detach() - w0).abs().max()) > 100 * KERNEL_TOL  # every parameter really moved
        assert float(orthonormality_error(p)) < ORTHO_TOL_F64
    assert sum(int(opt.state[p]["skipped_frames"]) for p in params) == len(NON_FINITE)
    if trust_region == 0.02:
        assert binding > steps  # the cap was active on many frame-steps
    if trust_region == 0.1:
        assert binding == 0


def test_kernel_comparison_detects_a_different_update():
    """Companion: the same comparison separates runs whose beta2 differs by 0.01."""
    params = _kernel_params()[:1]
    w, m, v = params[0].detach().clone(), torch.zeros_like(params[0]), torch.zeros(2, 1, 1, dtype=torch.float64)
    opt = StiefelAdam(params, lr=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(8)
    for t in range(1, 31):
        g = torch.randn(w.shape, generator=gen, dtype=torch.float64)
        w, m, v, _ = stiefel_adam_update(w, g, m, v, step=t, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8,
                                         trust_region=0.1)
        params[0].grad = g
        opt.step()
    assert float((params[0].detach() - w).abs().max()) > 1e4 * KERNEL_TOL


# ----------------------------------------------------------------------------- capturable (issue 18)
CAPTURABLE_TOL = 1e-12  # float64: capturable path vs default path after 40 steps (bias corrections as tensors)
COMPILE_STEP_TOL = 1e-5  # float32: compiled opt.step vs eager after 100 steps (measured: aot_eager 0, inductor 3.8e-6)
COMPILED_TRAIN_TOL = 1e-5  # float32: compiled forward + backward + opt.step vs eager after 5 steps


def _capturable_setup(second_moment="frame", dtype=torch.float64, master_weights=False):
    """Same-shaped frame parameters (stacked), one of another shape, one column-major; with gradient streams."""
    shapes = [(2, 12, 4), (2, 12, 4), (1, 16, 5), (3, 9, 3)]
    params = []
    for k, shape in enumerate(shapes):
        w = _frames(shape, seed=50 + k).to(dtype)
        if k == 3:
            w = w.mT.contiguous().mT
        params.append(geoopt.ManifoldParameter(w, manifold=PolarStiefel()))
    gen = torch.Generator().manual_seed(9)
    grads = []
    for t in range(1, 121):
        gs = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype) for p in params]
        if t in (5, 6, 40):
            gs[t % 3][0, 1, 1] = float("nan") if t != 6 else float("inf")
        grads.append(gs)
    return params, grads


def _run_frames(params, grads, steps, step_fn=None, **options):
    opt = StiefelAdam(params, lr=2e-2, betas=(0.9, 0.99), **options)
    step = step_fn(opt) if step_fn else opt.step
    for gs in grads[:steps]:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        step()
    return opt


def _frame_results(params, opt):
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if k != "step"}) for p in params]


def _max_result_diff(a, b):
    diff = 0.0
    for (wa, sa), (wb, sb) in zip(a, b, strict=True):
        assert sa.keys() == sb.keys()
        diff = max(diff, float((wa.double() - wb.double()).abs().max()))
        for key in sa:
            if key == "skipped_frames":
                assert torch.equal(sa[key], sb[key]), key
            else:
                diff = max(diff, float((sa[key].double() - sb[key].double()).abs().max()))
    return diff


@pytest.mark.parametrize("second_moment", ["frame", None, "element"])
def test_capturable_path_matches_the_default_path(second_moment):
    params, grads = _capturable_setup(second_moment)
    default = _run_frames(params, grads, 40, second_moment=second_moment, capturable=False)
    expected = _frame_results(params, default)
    params2, _ = _capturable_setup(second_moment)
    cap = _run_frames(params2, grads, 40, second_moment=second_moment, capturable=True)
    assert _max_result_diff(expected, _frame_results(params2, cap)) < CAPTURABLE_TOL
    assert sum(int(cap.state[p]["skipped_frames"]) for p in params2) == 3
    for p in params2:
        step = cap.state[p]["step"]
        assert step.dtype == torch.float32 and step.device == p.device and float(step) == 40


@pytest.mark.parametrize("radius", [0.1, 1.0])
def test_the_capturable_retraction_is_planned_from_the_radius_and_matches_the_default_path(monkeypatch, radius):
    """The capturable step reads nothing on the host, so it sizes its retraction for the trust radius: a series
    within the series' reach (Delta = 0.1 in float64), Newton-Schulz beyond it (Delta = 1), on the CPU as on an
    accelerator (no eigh). In float64 it must give the default path's frames and moments over 40 steps, and the
    Newton-Schulz branch must have been taken exactly when the radius is beyond the series."""
    from geoopt_stiefel_attention import _linalg

    calls, eighs = [], []
    real, real_eigh = _linalg.inv_sqrt_newton, _linalg.inv_sqrt_spd
    params, grads = _capturable_setup()
    default = _run_frames(params, grads, 40, capturable=False, adjust_lr_fn="match_rms_adamw", trust_region=radius)
    expected = _frame_results(params, default)
    monkeypatch.setattr(_linalg, "inv_sqrt_newton", lambda *a: calls.append(a[2]) or real(*a))
    monkeypatch.setattr(_linalg, "inv_sqrt_spd", lambda a: eighs.append(a.shape) or real_eigh(a))
    params2, _ = _capturable_setup()
    cap = _run_frames(params2, grads, 40, capturable=True, adjust_lr_fn="match_rms_adamw", trust_region=radius)
    assert _max_result_diff(expected, _frame_results(params2, cap)) < CAPTURABLE_TOL
    assert (len(calls) > 0) == (radius == 1.0), calls
    assert not eighs
    # companion: without a trust region the capturable step has no bound and takes the eigendecomposition
    params3, _ = _capturable_setup()
    _run_frames(params3, grads, 3, capturable=True, adjust_lr_fn="match_rms_adamw", trust_region=None)
    assert eighs


def test_the_accelerator_retraction_without_a_trust_region_takes_checked_newton_schulz(monkeypatch):
    """On an accelerator, outside capturable mode, a step without trust region (no bound for the series or for
    inv_sqrt_newton) takes inv_sqrt_checked, not eigh; run here by lifting the CPU's exemption, 40 steps must give
    the eigendecomposition's frames and moments in float64. Companion: with the exemption in place, the CPU takes
    eigh and never inv_sqrt_checked."""
    from geoopt_stiefel_attention import _linalg

    calls = []
    real = _linalg.inv_sqrt_checked
    monkeypatch.setattr(_linalg, "inv_sqrt_checked", lambda a: calls.append(a.shape) or real(a))
    options = {"capturable": False, "adjust_lr_fn": "match_rms_adamw", "trust_region": None}
    params, grads = _capturable_setup()
    expected = _frame_results(params, _run_frames(params, grads, 40, **options))
    assert not calls
    monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset())
    monkeypatch.setattr(_linalg, "HOST_READ_DEVICES", frozenset())  # an accelerator: no free host read
    params2, _ = _capturable_setup()
    checked = _frame_results(params2, _run_frames(params2, grads, 40, **options))
    assert _max_result_diff(expected, checked) < CAPTURABLE_TOL
    assert len(calls) >= 40, len(calls)


CUDA_VS_CPU_TOL = 1e-10  # float64: CUDA's kernels round differently from the CPU's; 40 steps of well-conditioned frames


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the accelerator's own retraction)")
@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw", "original"])
def test_the_default_step_on_cuda_matches_the_cpu_default_path(adjust_lr_fn):
    """On CUDA the default is the capturable path, with Newton-Schulz under the default rule: in float64 it
    gives the CPU's default path's frames and moments over 40 steps, skipped frames included."""
    params, grads = _capturable_setup()
    cpu = _run_frames(params, grads, 40, adjust_lr_fn=adjust_lr_fn, trust_region=0.1)
    expected = _frame_results(params, cpu)
    params2, _ = _capturable_setup()
    params2 = [geoopt.ManifoldParameter(p.detach().cuda(), manifold=PolarStiefel()) for p in params2]
    gpu = _run_frames(params2, [[g.cuda() for g in gs] for gs in grads], 40, adjust_lr_fn=adjust_lr_fn,
                      trust_region=0.1)
    from geoopt_stiefel_attention.optim._state import _capturable

    assert all(_capturable(group, params2[0].device) for group in gpu.param_groups)
    assert gpu.state[params2[0]]["step"].device.type == "cuda"  # the capturable path's step count
    assert _max_result_diff(expected, [(w.cpu(), {k: v.cpu() for k, v in st.items()})
                                       for w, st in _frame_results(params2, gpu)]) < CUDA_VS_CPU_TOL


def test_capturable_step_reads_no_tensor_on_the_host():
    params, grads = _capturable_setup()
    opt = _run_frames(params, grads, 1, capturable=True)  # state created (its one-time orthonormality check)
    for gs in grads[1:4]:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        with NoHostReads():
            opt.step()
    # companion: the default CPU path does read (the skip test, the series order, the step count), and is caught
    params, grads = _capturable_setup()
    opt = _run_frames(params, grads, 1, capturable=False)
    for p, g in zip(params, grads[1], strict=True):
        p.grad = g.clone()
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        opt.step()


@pytest.mark.parametrize("second_moment", ["frame", "column", "element", None])
@pytest.mark.parametrize("trust_region", [0.1, None])
def test_capturable_step_off_the_eigh_devices_reads_nothing_for_every_second_moment(monkeypatch, second_moment,
                                                                                     trust_region):
    """Off the EIGH_DEVICES (an accelerator, run here by lifting the CPU's exemption) the capturable step must not
    take the checked retraction, which reads its residual on the host: neither the fused kernel nor the ablation
    variants' reference update. Companion: outside capturable mode, with no trust region, it does read (and is
    caught)."""
    from geoopt_stiefel_attention import _linalg

    monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset())
    options = dict(second_moment=second_moment, adjust_lr_fn="match_rms_adamw", trust_region=trust_region)
    params, grads = _capturable_setup(second_moment=second_moment)
    opt = _run_frames(params, grads, 1, capturable=True, **options)
    for gs in grads[1:3]:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        with NoHostReads():
            opt.step()
    if trust_region is None:
        params, grads = _capturable_setup(second_moment=second_moment)
        opt = _run_frames(params, grads, 1, capturable=False, **options)
        for p, g in zip(params, grads[1], strict=True):
            p.grad = g.clone()
        with pytest.raises(AssertionError, match="host read"), NoHostReads():
            opt.step()


def test_capturable_bf16_frames_with_float32_master_copies_match_the_default_path():
    params, grads = _capturable_setup(dtype=torch.bfloat16)
    default = _run_frames(params, grads, 20, master_weights=True, capturable=False)
    expected = _frame_results(params, default)
    params2, _ = _capturable_setup(dtype=torch.bfloat16)
    cap = _run_frames(params2, grads, 20, master_weights=True, capturable=True)
    results = _frame_results(params2, cap)
    assert all(s["master"].dtype == torch.float32 for _, s in results)
    assert _max_result_diff(expected, results) < 1e-5  # float32 compute, bf16 parameters rounded from the master


@pytest.mark.parametrize(("source", "target"), [(True, False), (False, True)])
def test_state_dicts_load_across_capturable_and_not(source, target):
    """As in torch, the saved group options (``capturable`` included) replace the current ones and the step counts
    are placed for the loaded mode; switching the mode afterwards continues the same trajectory."""
    params, grads = _capturable_setup()
    ref = _run_frames(params, grads, 10, capturable=source)
    sd = copy.deepcopy(ref.state_dict())
    for gs in grads[10:15]:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        ref.step()
    expected = _frame_results(params, ref)
    params2, _ = _capturable_setup()
    opt = _run_frames(params2, grads, 3, capturable=target)  # its own state, replaced by the load
    with torch.no_grad():
        for p, q in zip(params2, _sd_params(params, grads, source), strict=True):
            p.copy_(q)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["capturable"] is source
    opt.param_groups[0]["capturable"] = target
    for gs in grads[10:15]:
        for p, g in zip(params2, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    assert _max_result_diff(expected, _frame_results(params2, opt)) < CAPTURABLE_TOL
    assert all(float(opt.state[p]["step"]) == 15 for p in params2)


def _sd_params(params, grads, capturable):
    """The frames after the first 10 steps of ``_run_frames`` (what the checkpoint's model would hold)."""
    fresh, _ = _capturable_setup()
    _run_frames(fresh, grads, 10, capturable=capturable)
    return [p.detach() for p in fresh]


def test_capturable_option_is_validated_and_resolved_per_device():
    from geoopt_stiefel_attention.optim._state import _capturable

    assert _capturable({"capturable": None}, torch.device("cuda")) is True
    assert _capturable({"capturable": None}, torch.device("cpu")) is False
    assert _capturable({"capturable": True}, torch.device("cpu")) is True
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="capturable='yes'"):
        StiefelAdam([p], capturable="yes")
    with pytest.raises(ValueError, match="stabilize=5 cannot be combined with capturable=True"):
        StiefelAdam([p], capturable=True, stabilize=5)


def _model_and_groups(capturable):

    model = tiny_transformer()
    return model, StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2, capturable=capturable)


@pytest.mark.parametrize("capturable", [True, False])
def test_dynamo_sees_no_graph_break_in_the_step(capturable):
    """torch._dynamo.explain(opt.step): 0 graph breaks, fresh state included, as for torch's Adam(capturable=True).
    Dynamo traces every optimizer with its groups' ``capturable`` set to True, so with ``capturable=False`` too it
    traces the capturable path (the eager default path reads the CPU tensors it may read, see above)."""
    params, grads = _capturable_setup(dtype=torch.float32)
    bias = torch.nn.Parameter(torch.zeros(5))
    opt = StiefelAdam([{"params": params}, {"params": [bias], "weight_decay": 0.1}], lr=1e-2, capturable=capturable)
    for p, g in zip(params, grads[4], strict=True):  # a NaN in one frame: the skip path is traced too
        p.grad = g
    bias.grad = torch.ones(5)
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(opt.step)()
        assert explanation.graph_break_count == 0 and not explanation.break_reasons, explanation.break_reasons
        # the frame update (one operator, _kernel.frame_update_) and the AdamW update are in the graph
        code = explanation.graphs[0].code
        assert "geoopt_stiefel_attention.frame_update_" in code and explanation.op_count > 40, code
        # companion: a host read in the traced function is reported as a break
        explanation = torch._dynamo.explain(lambda: (opt.step(), int(opt.state[params[0]]["skipped_frames"])))()
        assert len(explanation.break_reasons) > 0
    finally:
        torch._dynamo.reset()


def _compiled_vs_eager(backend, steps=100):
    params, grads = _capturable_setup(dtype=torch.float32)
    eager = _run_frames(params, grads, steps, capturable=True)
    expected = _frame_results(params, eager)
    params2, _ = _capturable_setup(dtype=torch.float32)
    torch._dynamo.reset()
    try:
        compiled = _run_frames(params2, grads, steps, capturable=True,
                               step_fn=lambda opt: torch.compile(opt.step, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()
    results = _frame_results(params2, compiled)
    assert [int(s["skipped_frames"].sum()) for _, s in results] == [int(s["skipped_frames"].sum()) for _, s in expected]
    assert sum(int(compiled.state[p]["skipped_frames"]) for p in params2) == 3  # the non-finite steps
    return _max_result_diff(expected, results)


def test_compiled_capturable_step_matches_eager_for_100_steps_aot_eager():
    """fullgraph=True: the whole step is one graph. aot_eager traces like inductor without generating code."""
    assert _compiled_vs_eager("aot_eager") < COMPILE_STEP_TOL


@pytest.mark.slow
def test_compiled_capturable_step_matches_eager_for_100_steps_inductor():
    assert _compiled_vs_eager("inductor") < COMPILE_STEP_TOL


_PLANNED = _linalg_module.inv_sqrt_planned  # the real one, whatever a test has patched since


def _planned_bounds(monkeypatch, compiled, capturable):
    """The squared bounds the retraction was planned for in two steps of frames at lr 2e-2 (trust radius 1 under
    the default rule: a radius of a frame's own size)."""
    bounds = []

    def spy(gram, radius_sq, plan):
        bounds.append(radius_sq)
        return _PLANNED(gram, radius_sq, plan)

    monkeypatch.setattr(_linalg_module, "inv_sqrt_planned", spy)
    params, grads = _capturable_setup(dtype=torch.float32)
    torch._dynamo.reset()
    try:
        step_fn = (lambda opt: torch.compile(opt.step, backend="aot_eager", fullgraph=True)) if compiled else None
        _run_frames(params, grads[:2], 2, step_fn=step_fn, capturable=capturable)
    finally:
        torch._dynamo.reset()
    return bounds


def test_the_compiled_step_on_the_cpu_plans_its_retraction_for_the_step_taken(monkeypatch):
    """Issue 40: Dynamo traces the optimizer as capturable, but the frame update is one operator that runs eagerly
    inside the compiled graph; on the CPU it reads the step it took and plans the retraction for it, as the default
    eager step does (a bound far below the trust radius's 1**2), so the compiled step costs what eager does.
    Companion: eager with capturable=True plans for the radius."""
    radius_sq = 1.0**2
    compiled = _planned_bounds(monkeypatch, compiled=True, capturable=None)
    eager = _planned_bounds(monkeypatch, compiled=False, capturable=None)
    assert compiled and len(compiled) == len(eager)
    assert max(compiled) < radius_sq / 4
    assert compiled == pytest.approx(eager, rel=1e-3)  # the same steps up to float32 bias corrections
    assert all(b >= radius_sq for b in _planned_bounds(monkeypatch, compiled=False, capturable=True))


def _train_steps(compile_backend, steps=5):
    model, opt = _model_and_groups(capturable=True)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 11, (8, 4), generator=gen), torch.randint(0, 11, (8, 4), generator=gen))
               for _ in range(steps)]

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    step = train_step if compile_backend is None else torch.compile(train_step, backend=compile_backend)
    losses = torch.stack([step(x, y) for x, y in batches])
    return model, losses


def _compiled_training_matches_eager(backend):
    torch._dynamo.reset()
    try:
        (model_c, losses_c), (model_e, losses_e) = _train_steps(backend), _train_steps(None)
    finally:
        torch._dynamo.reset()
    assert float((losses_c - losses_e).abs().max()) < COMPILED_TRAIN_TOL
    diffs = [float((p - q).detach().abs().max()) for p, q in zip(model_c.parameters(), model_e.parameters(),
                                                                 strict=True)]
    assert max(diffs) < COMPILED_TRAIN_TOL
    start, _ = _model_and_groups(capturable=True)
    assert max(float((p - q).detach().abs().max()) for p, q in zip(model_e.parameters(), start.parameters(),
                                                                  strict=True)) > 1e3 * COMPILED_TRAIN_TOL


@pytest.mark.slow
def test_compiled_training_step_with_the_optimizer_matches_eager_aot_eager():
    """Issue 18: forward, backward and opt.step of a model with Stiefel attention in one compiled function (about
    15 s; the default run compiles the model in tests/test_compile.py and the step above)."""
    _compiled_training_matches_eager("aot_eager")


@pytest.mark.slow
def test_compiled_training_step_with_the_optimizer_matches_eager_inductor():
    _compiled_training_matches_eager("inductor")


@pytest.mark.parametrize("option, value, name", [
    ("lr", -1.0, "lr"), ("lr", float("nan"), "lr"), ("trust_region", 0.0, "trust_region"),
    ("betas", (0.9, 1.0), "betas"), ("eps", -1e-8, "eps"), ("weight_decay", -0.1, "weight_decay"),
    ("stabilize", True, "stabilize"),  # equal to the valid 1 the group held, but a bool: still refused
])
def test_options_rewritten_in_param_groups_are_checked_at_step(option, value, name):
    """Schedulers and users write ``param_groups`` directly; a value the constructor would refuse is refused at
    ``step`` too, before anything changes (trust_region=0 would otherwise freeze every frame without a word)."""
    w = _frame_param()
    bias = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = StiefelAdam([w, bias], lr=1e-2, stabilize=1)
    w.grad, bias.grad = torch.randn_like(w), torch.randn_like(bias)
    opt.step()
    before = (w.detach().clone(), bias.detach().clone(), copy.deepcopy(opt.state_dict()["state"]))
    opt.param_groups[0][option] = value
    with pytest.raises(ValueError, match=name):
        opt.step()
    assert torch.equal(w, before[0]) and torch.equal(bias, before[1])
    after = opt.state_dict()["state"]
    for k in before[2]:
        for key, t in before[2][k].items():
            assert torch.equal(after[k][key], t), (k, key)


def test_a_tensor_lr_changed_in_place_is_checked_at_every_step():
    """A tensor ``lr`` is read at each step, never taken as unchanged: set negative in place after a step that
    accepted it, the next step refuses it before anything changes."""
    w = _frame_param()
    lr = torch.tensor(1e-2, dtype=torch.float64)
    opt = StiefelAdam([w], lr=lr)
    w.grad = torch.randn_like(w)
    opt.step()
    lr.fill_(-1.0)
    start = w.detach().clone()
    with pytest.raises(ValueError, match="lr=tensor"):
        opt.step()
    assert torch.equal(w, start)


def test_lr_zero_written_by_a_scheduler_is_accepted_and_moves_nothing():
    """Companion: the check at ``step`` refuses only invalid values (warm-up schedulers start at lr=0)."""
    w = _frame_param()
    opt = StiefelAdam([w], lr=1e-2)
    opt.param_groups[0]["lr"] = 0.0
    w.grad = torch.randn_like(w)
    start = w.detach().clone()
    opt.step()
    assert torch.equal(w, start)


# ----------------------------------------------------------------------------- a model with no frame
_NO_FRAME = "StiefelAdam was constructed with no Stiefel frame"


def test_no_frame_at_all_warns_once_naming_the_fix():
    """``StiefelAdam(model.parameters())`` on an unconverted model is plain AdamW: say so, once, with the fix."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = StiefelAdam(model.parameters(), lr=1e-3)
    (w,) = [c for c in caught if _NO_FRAME in str(c.message)]
    assert w.category is UserWarning and w.filename == __file__  # points at the caller's line
    for fix in ("stiefelize(model)", "attention='stiefel'", "torch.optim.AdamW"):
        assert fix in str(w.message), fix
    with warnings.catch_warnings():  # the optimizer still works (it is AdamW), and stepping says nothing more
        warnings.simplefilter("error")
        model(torch.ones(1, 4)).sum().backward()
        opt.step()


def test_no_warning_with_a_frame_or_through_param_groups():
    """Companions: any frame (even one among Euclidean parameters) silences it; so do the groups of
    ``param_groups``, which warns itself unless ``expect_frames=False`` marks a Euclidean baseline."""
    plain = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StiefelAdam([*plain.parameters(), _frame_param()], lr=1e-3)
        StiefelAdam([{"params": list(plain.parameters())}, {"params": [_frame_param()], "lr": 1e-2}], lr=1e-3)
        StiefelAdam(param_groups(plain, expect_frames=False), lr=1e-3)
    with pytest.warns(UserWarning, match="param_groups: Linear has no Stiefel frame") as record:
        StiefelAdam(param_groups(plain), lr=1e-3)
    assert not [r for r in record if _NO_FRAME in str(r.message)]  # one warning, not two


def test_a_checkpoint_without_a_rule_loads_with_the_papers_rule_and_says_so_when_it_changes_the_rule():
    """A geoopt (or older) checkpoint has no 'adjust_lr_fn': its groups load with 'original', the step they were
    trained with. Into an optimizer built with the default 'match_rms_adamw' that changes the frames' step size by
    √(dr), so it warns, naming the group (companion: an optimizer built with 'original' loads it without a word)."""
    import warnings

    w, b, opt_geoopt, _ = _geoopt_run()
    sd = opt_geoopt.state_dict()

    def fresh(**kw):
        return StiefelAdam([geoopt.ManifoldParameter(w.detach().clone(), manifold=PolarStiefel()),
                            torch.nn.Parameter(b.detach().clone())], lr=1e-3, **kw)

    opt = fresh()
    with pytest.warns(UserWarning, match=r"group\(s\) 0 .*no 'adjust_lr_fn'.*adjust_lr_fn='original'.*'match_rms_adamw'"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["adjust_lr_fn"] == "original"
    opt = fresh(adjust_lr_fn="original")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(copy.deepcopy(sd))
    own = opt.state_dict()  # a checkpoint that names its rule loads silently into either optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh().load_state_dict(own)


@pytest.mark.parametrize("cls", [StiefelAdam, StiefelMuon])
def test_a_tensor_lr_is_checked_at_each_step_like_a_float_one(cls):
    """A scheduler may write a tensor lr; a negative or NaN one would climb the loss (or fail midway) and a
    two-element one fail inside the update: each is refused before anything changes, naming lr (companion: a
    valid tensor lr steps)."""
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(st.random(2, 16, 4, dtype=torch.float64), manifold=st)
    opt = cls([w], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    before, w0 = _state_snapshot(opt), w.detach().clone()
    for bad, match in ((torch.tensor(-0.01), r"lr=tensor\(-0.01"), (torch.tensor(float("nan")), r"lr=tensor\(nan"),
                       (torch.tensor([1e-3, 1e-3]), r"lr is a tensor of shape \(2,\)")):
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match=f"{cls.__name__}: {match}"):
            opt.step()
        assert _same_state(before, _state_snapshot(opt)) and torch.equal(w.detach(), w0)
    opt.param_groups[0]["lr"] = torch.tensor(1e-2)
    opt.step()
    assert not torch.equal(w.detach(), w0)


def test_changing_second_moment_after_the_first_step_is_refused_before_anything_changes():
    """The state was made for one second moment; the update cannot read it as another (it failed midway, after the
    step count had moved). Refused naming the option and both fixes; each fix then steps."""
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(st.random(2, 16, 4, dtype=torch.float64), manifold=st)
    opt = StiefelAdam([w], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    before = _state_snapshot(opt)
    opt.param_groups[0]["second_moment"] = "column"
    with pytest.raises(ValueError, match=r"second moment of shape \(2, 1, 1\).*second_moment='column'.*\(2, 1, 4\)"):
        opt.step()
    assert _same_state(before, _state_snapshot(opt))
    opt.state[w].clear()  # the second fix: restart the frame's moments under the new option
    opt.step()
    assert opt.state[w]["exp_avg_sq"].shape == (2, 1, 4)
    opt.param_groups[0]["second_moment"] = None  # companion: SGD with momentum reads no second moment
    opt.step()


def test_a_checkpoint_without_a_radius_loads_auto_so_the_radius_follows_a_later_rule():
    """geoopt's groups have neither adjust_lr_fn nor trust_region: they load as 'original' and 'auto' (the paper's
    0.1); setting the default rule afterwards then gives that rule's radius, 1, not a stale 0.1 that would cap a
    128 x 32 frame's step at a sixth of its size."""
    from geoopt_stiefel_attention._linalg import trust_radius

    w, b, opt_geoopt, _ = _geoopt_run()
    opt = StiefelAdam([geoopt.ManifoldParameter(w.detach().clone(), manifold=PolarStiefel()),
                       torch.nn.Parameter(b.detach().clone())], lr=1e-3, adjust_lr_fn="original")
    opt.load_state_dict(opt_geoopt.state_dict())
    group = opt.param_groups[0]
    assert group["trust_region"] == "auto" and trust_radius(group["trust_region"], group["adjust_lr_fn"]) == 0.1
    group["adjust_lr_fn"] = "match_rms_adamw"
    assert trust_radius(group["trust_region"], group["adjust_lr_fn"]) == 1.0
