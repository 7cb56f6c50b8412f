"""The frame-optimizer base (issue 58, item 3): one construction (no side channel), options checked when a group is
added or its options change (not again at every step), and StiefelMuon staged as StiefelAdam is (the momentum
buffers and gaps of same-shaped frames kept stacked in one buffer, frames and gradients in the workspace).
Float64; every property has a companion case where it must fail."""

import math

import geoopt
import numpy as np
import pytest
import torch
from conftest import reloaded, shares_one_buffer

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam, StiefelMuon
from geoopt_stiefel_attention._linalg import frame_sq_norm, polar_svd, proju
from geoopt_stiefel_attention.optim import _validation
from geoopt_stiefel_attention.optim._base import FrameOptimizer
from geoopt_stiefel_attention.optim._batching import stage

#: float64: a stacked batch against one update call per parameter (the same arithmetic on other batch sizes; the
#: products may be blocked differently)
STACKED_VS_SEPARATE_TOL = 1e-12

OPTIMIZERS = {"StiefelAdam": StiefelAdam, "StiefelMuon": StiefelMuon}


def _frame(shape, seed):
    w = PolarStiefel().random(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return geoopt.ManifoldParameter(w, manifold=PolarStiefel())


def _grad(p, t, k):
    return torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(1000 * k + t))


def _step(opt, params, t):
    for k, p in enumerate(params):
        p.grad = _grad(p, t, k)
    opt.step()


class _CountingChecks:
    """Counts the calls of ``_validation.check_group`` (the one check of a group's options)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = _validation.check_group

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(_validation, "check_group", counted)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_options_are_checked_when_they_change_not_at_every_step(name, monkeypatch):
    params = [_frame((2, 8, 3), 0), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    opt = OPTIMIZERS[name](params, lr=1e-2)
    checks = _CountingChecks(monkeypatch)
    _step(opt, params, 1)  # the first step checks the group once (nothing was recorded yet)
    first = checks.calls
    for t in range(2, 6):
        _step(opt, params, t)
    assert first == 1 and checks.calls == first  # four more steps, options unchanged: no further check
    opt.param_groups[0]["lr"] = 5e-3  # a scheduler's write: checked once at the next step
    _step(opt, params, 6)
    _step(opt, params, 7)
    assert checks.calls == first + 1
    # companion: a tensor lr (its value can change in place) is checked at every step
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    _step(opt, params, 8)
    _step(opt, params, 9)
    assert checks.calls == first + 3


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_invalid_value_written_later_is_refused_before_anything_moves(name):
    """The snapshot keeps the type: weight_decay=1 is valid, True (equal to 1 in Python) is refused, and a negative
    tensor lr written in place is caught at the next step."""
    params = [_frame((2, 8, 3), 0), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=1)
    _step(opt, params, 1)
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["weight_decay"] = True
    with pytest.raises(ValueError, match="weight_decay=True"):
        _step(opt, params, 2)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.param_groups[0]["weight_decay"] = 1
    opt.param_groups[0]["betas"] = [0.9, 0.99]
    _step(opt, params, 2)
    opt.param_groups[0]["betas"][1] = 1.5  # changed in place: the same list object
    with pytest.raises(ValueError, match="betas="):
        _step(opt, params, 3)
    opt.param_groups[0]["betas"][1] = 0.99
    lr = torch.tensor(1e-2)
    opt.param_groups[0]["lr"] = lr
    _step(opt, params, 3)
    lr.fill_(-1.0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"lr=tensor\(-1\) is invalid"):
        _step(opt, params, 4)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_option_snapshots_tell_types_tensors_and_in_place_changes_apart():
    names = tuple(option.name for option in _validation.SHARED_OPTIONS)
    betas = [0.9, 0.999]
    group = {"lr": 1e-3, "weight_decay": 1, "betas": betas}
    snap = _validation.option_snapshot(group, names)
    assert _validation.options_unchanged(snap, group, names)
    assert _validation.options_unchanged(snap, dict(group), names)  # the same objects in another dict
    # companions: every kind of change is seen
    assert not _validation.options_unchanged(snap, {**group, "weight_decay": True}, names)  # True == 1 in Python
    assert not _validation.options_unchanged(snap, {**group, "lr": 2e-3}, names)
    assert not _validation.options_unchanged(snap, {k: v for k, v in group.items() if k != "lr"}, names)
    assert not _validation.options_unchanged(snap, {**group, "eps": 1e-8}, names)  # an option added
    betas[1] = 1.5  # changed in place
    assert not _validation.options_unchanged(snap, group, names)
    tensor = {**group, "lr": torch.tensor(1e-3)}
    assert not _validation.options_unchanged(_validation.option_snapshot(tensor, names), tensor, names)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_construction_leaves_no_side_channel_and_checks_the_defaults_once(name, monkeypatch):
    checks = _CountingChecks(monkeypatch)
    opt = OPTIMIZERS[name]([_frame((2, 8, 3), 0)], lr=1e-2)
    assert checks.calls == 2  # the constructor's options, then the one group (merged with them)
    assert not {"_pending_defaults", "_constructing"} & set(vars(opt))
    # companion: a bad default is refused even when every group overrides it (torch's optimizers do the same)
    with pytest.raises(ValueError, match="lr=-1"):
        OPTIMIZERS[name]([{"params": [_frame((2, 8, 3), 0)], "lr": 1e-2}], lr=-1)


def _muon_run(steps, stack_numel=None, resume_at=None):
    params = [_frame((2, 10, 3), 30 + k) for k in range(3)] + [_frame((1, 16, 5), 33)]

    def build():
        opt = StiefelMuon(params, lr=0.02)
        if stack_numel is not None:
            opt._stack_numel = stack_numel
        return opt

    opt = build()
    for t in range(1, steps + 1):
        _step(opt, params, t)
        if t == resume_at:
            opt = reloaded(opt, build)
    return params, opt


def test_stiefel_muon_keeps_a_batchs_state_stacked_like_stiefel_adam_and_resumes_it():
    params, opt = _muon_run(5)
    for key in ("momentum_buffer", "dual_gap"):
        assert shares_one_buffer([opt.state[p][key] for p in params[:3]])
        # companion: the lone larger parameter is its own batch, updated in place with its own tensors
        assert not shares_one_buffer([opt.state[p][key] for p in params[2:]])
    separate, opt_sep = _muon_run(5, stack_numel=1)  # one update call per parameter: nothing stacked
    assert not shares_one_buffer([opt_sep.state[p]["momentum_buffer"] for p in separate[:3]])
    for p, q in zip(params, separate, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=STACKED_VS_SEPARATE_TOL)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], opt_sep.state[q]["momentum_buffer"], rtol=0,
                                   atol=STACKED_VS_SEPARATE_TOL)
    # the parameters really differ (a mix-up of stacked slots would be caught)
    assert (params[0].detach() - params[1].detach()).abs().max() > 0.1
    # a resumed run (its state loaded as separate tensors, stacked again at the next step) is bit-identical
    resumed, opt_res = _muon_run(5, resume_at=3)
    assert shares_one_buffer([opt_res.state[p]["momentum_buffer"] for p in resumed[:3]])
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, resumed, strict=True))


def test_a_muon_state_saved_without_the_uncertified_counter_loads_with_one_at_zero():
    params, opt = _muon_run(2)
    opt.state[params[0]]["uncertified_frames"].fill_(3)
    saved = opt.state_dict()
    old = {**saved, "state": {k: {key: v for key, v in s.items() if key != "uncertified_frames"}
                              for k, s in saved["state"].items()}}
    fresh = StiefelMuon(params, lr=0.02)
    fresh.load_state_dict(old)
    assert all(int(fresh.state[p]["uncertified_frames"]) == 0 for p in params)
    # companion: a state dict that has the counter keeps its count
    fresh.load_state_dict(saved)
    assert int(fresh.state[params[0]]["uncertified_frames"]) == 3


# ----------------------------------------------------------------------------- a third rule on the base
#: float64: the rule on the base against its written-out reference after 20 steps (measured about 1e-15)
THIRD_RULE_TOL = 1e-12


class FrameSGD(FrameOptimizer, geoopt.optim.mixin.OptimMixin, torch.optim.Optimizer):
    """Riemannian SGD with momentum on frames (polar retraction, transport by projection), written only as a rule:
    its options, its state and its update of one staged batch; the base does everything else."""

    _NAME = "FrameSGD"
    _OPTIONS = _validation.SHARED_OPTIONS + (
        _validation.Option("momentum", lambda v: isinstance(v, float) and 0.0 <= v < 1.0, "pass a float in [0, 1)."),
        _validation.Option("stabilize", lambda v: v is None, "pass None."))
    _GROUP_DEFAULTS = {"momentum": 0.9, "adjust_lr_fn": "original", "master_weights": False, "stabilize": None}
    _MOMENT_KEY = "momentum_buffer"

    def __init__(self, params, lr=1e-2, momentum=0.9):
        self._construct(self._check_params_argument(params), dict(
            lr=lr, momentum=momentum, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adjust_lr_fn="original",
            master_weights=False, amsgrad=False, maximize=False, foreach=None, capturable=False, stabilize=None,
            differentiable=False, fused=None, decoupled_weight_decay=True))

    def _frame_spec(self, p, group):
        return ["step", "momentum_buffer"], {"momentum_buffer": tuple(p.shape)}

    def _init_frame_state(self, state, p, group):
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["momentum_buffer"] = torch.zeros_like(p.detach())
        state["skipped_frames"] = torch.zeros((), dtype=torch.int64)
        return state

    def _update_batch(self, group, params, step):
        batch = stage(self, group, params, ["momentum_buffer"], None, capturable=False, scratch=False)
        w, m = batch.w, batch.state["momentum_buffer"]
        xi = proju(w, batch.g)
        finite = frame_sq_norm(xi) < math.inf
        m.copy_(torch.where(finite, group["momentum"] * m + xi, m))
        w.copy_(torch.where(finite, polar_svd(w - group["lr"] * m), w))
        m.copy_(proju(w, m))
        batch.write_back()
        self._count_skipped(group, params, finite)


def _sgd_reference(w0, grads, lr, momentum):
    """The same rule written out frame by frame with numpy's SVD (float64)."""
    w, m = w0.numpy().copy(), np.zeros_like(w0.numpy())
    for g in grads:
        for i in range(w.shape[0]):
            wi, gi = w[i], g[i].numpy()
            xi = gi - wi @ (0.5 * (wi.T @ gi + gi.T @ wi))
            m[i] = momentum * m[i] + xi
            u, _, vt = np.linalg.svd(wi - lr * m[i], full_matrices=False)
            w[i] = u @ vt
            m[i] = m[i] - w[i] @ (0.5 * (w[i].T @ m[i] + m[i].T @ w[i]))
    return w


def test_a_third_rule_is_its_options_state_and_update_alone():
    """A rule declared on the base (FrameSGD above) follows its written-out reference, keeps its state stacked,
    is refused bad options in the base's words, skips and counts a NaN frame, and resumes bit for bit."""
    params = [_frame((2, 10, 3), 50 + k) for k in range(3)]
    starts = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * k + t))
              for t in range(20)] for k, p in enumerate(params)]
    opt = FrameSGD(params, lr=0.05, momentum=0.8)
    for t in range(20):
        for p, g in zip(params, grads, strict=True):
            p.grad = g[t].clone()
        opt.step()
    for p, w0, g in zip(params, starts, grads, strict=True):
        assert np.abs(p.detach().numpy() - _sgd_reference(w0, g, 0.05, 0.8)).max() < THIRD_RULE_TOL
        # companion: a reference one percent off in lr is far outside the tolerance
        assert np.abs(p.detach().numpy() - _sgd_reference(w0, g, 0.0505, 0.8)).max() > 1e3 * THIRD_RULE_TOL
    assert shares_one_buffer([opt.state[p]["momentum_buffer"] for p in params])
    with pytest.raises(ValueError, match=r"FrameSGD: momentum=1.5 is invalid; pass a float in \[0, 1\)"):
        FrameSGD([_frame((2, 10, 3), 0)], momentum=1.5)
    before = params[1].detach().clone()
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[0, 0, 0] = float("nan")
    with pytest.warns(UserWarning, match="FrameSGD.step"):
        opt.step()
    assert torch.equal(params[1].detach()[0], before[0]) and not torch.equal(params[1].detach()[1], before[1])
    assert [int(opt.state[p]["skipped_frames"]) for p in params] == [0, 1, 0]
    resumed = reloaded(opt, lambda: FrameSGD(params, lr=0.05, momentum=0.8))
    copies = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    after = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, c in zip(params, copies, strict=True):
            p.copy_(c)
    resumed.step()
    assert all(torch.equal(p.detach(), a) for p, a in zip(params, after, strict=True))
