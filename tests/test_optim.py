"""StiefelAdam: float64 step-by-step reference, AdamW equivalence, convergence, state, errors."""

import io
from collections import defaultdict

import geoopt
import numpy as np
import pytest
import torch
from conftest import reloaded, shares_one_buffer, tiny_transformer

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam, optim
from geoopt_stiefel_attention.optim._batching import _stacked_view

REFERENCE_TOL = 1e-10  # float64 agreement with the written-out reference over >= 50 steps
CONVERGENCE_TOL = 1e-5  # distance to the target frame
DRIFT_TOL_F32 = 1e-6  # max |W^T W - I| after 10,000 float32 steps without stabilize
ADAMW_TOL_F32 = 1e-6  # same trajectory as torch.optim.AdamW (float32 rounding)


# ----------------------------------------------------------------------------- independent reference
def _ref_sym(a):
    return 0.5 * (a + a.T)


def _ref_polar(y):
    u, _, vh = np.linalg.svd(y, full_matrices=False)
    return u @ vh


def _ref_stiefel_adam(w0, grad_fn, steps, *, lr, b1, b2, eps, delta, mode):
    """Steps 1-7 of the update written out frame by frame in numpy (DESIGN.md, 'The update')."""
    w = [f.copy() for f in w0]
    m = [np.zeros_like(f) for f in w0]
    v = [np.zeros((1, 1)) if mode == "frame" else np.zeros((1, f.shape[1])) if mode == "column"
         else np.zeros_like(f) for f in w0]
    trajectory = []
    for t in range(1, steps + 1):
        grads = grad_fn(np.stack(w), t)
        for k in range(len(w)):
            wk, g = w[k], grads[k]
            xi = g - wk @ _ref_sym(wk.T @ g)  # 1
            m[k] = b1 * m[k] + (1 - b1) * xi  # 2
            if mode == "frame":
                v[k] = b2 * v[k] + (1 - b2) * np.sum(xi * xi)  # 3
            elif mode == "column":
                v[k] = b2 * v[k] + (1 - b2) * np.sum(xi * xi, axis=0, keepdims=True)
            elif mode == "element":
                v[k] = b2 * v[k] + (1 - b2) * xi * xi
            mhat = m[k] / (1 - b1**t)
            if mode is None:
                s = lr * mhat
            else:
                s = lr * mhat / (np.sqrt(v[k] / (1 - b2**t)) + eps)  # 4
                if mode != "frame":
                    s = s - wk @ _ref_sym(wk.T @ s)
            norm = np.sqrt(np.sum(s * s))
            if delta is not None and norm > delta:  # 5
                s = s * delta / norm
            w[k] = _ref_polar(wk - s)  # 6
            m[k] = m[k] - w[k] @ _ref_sym(w[k].T @ m[k])  # 7
        trajectory.append(np.stack(w))
    return trajectory


def _frames(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return PolarStiefel().random(*shape, dtype=dtype, generator=gen)


def _grad_fn_factory(shape, seed):
    """Gradient of f(W) = 1/2 ||W - C||^2 + <N_t, W>: depends on W and varies with t."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(shape)
    noise = rng.standard_normal((60,) + shape)

    def grad_fn(w, t):
        return (w - c) + noise[t - 1]

    return grad_fn


def _run_torch(w0, grad_fn, steps, **opt_kwargs):
    # the written-out reference is the paper's step (c = 1); the default rule is the same update at c * lr with
    # the same radius Delta (frame units under both rules), tested on its own
    # (test_match_rms_adamw_is_the_reference_with_lr_times_sqrt_dr)
    opt_kwargs.setdefault("adjust_lr_fn", "original")
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(w0.clone(), manifold=st)
    opt = StiefelAdam([w], **opt_kwargs)
    trajectory = []
    for t in range(1, steps + 1):
        w.grad = torch.from_numpy(grad_fn(w.detach().numpy(), t))
        opt.step()
        trajectory.append(w.detach().clone().numpy())
    return trajectory, opt, w


@pytest.mark.parametrize(
    ("lr", "delta", "mode"),
    [
        (0.05, 0.1, "frame"),  # trust region binds on some steps, not all
        (0.5, 0.1, "frame"),  # trust region binds on every step
        (0.02, None, "frame"),  # no trust region: exact eigendecomposition path
        (0.03, 0.1, "column"),
        (0.03, 0.1, "element"),
        (0.03, 0.1, None),
    ],
)
def test_matches_written_out_reference_for_50_steps(lr, delta, mode):
    shape = (3, 12, 4)
    w0 = _frames(shape, seed=1)
    grad_fn = _grad_fn_factory(shape, seed=2)
    kw = dict(lr=lr, b1=0.9, b2=0.99, eps=1e-8, delta=delta, mode=mode)
    reference = _ref_stiefel_adam(list(w0.numpy()), grad_fn, 55, **kw)
    ours, opt, w = _run_torch(w0, grad_fn, 55, lr=lr, betas=(0.9, 0.99), eps=1e-8, trust_region=delta,
                              second_moment=mode)
    worst = max(np.abs(a - b).max() for a, b in zip(ours, reference, strict=True))
    assert worst < REFERENCE_TOL
    # the reference really moves the frames (a check that cannot pass vacuously)
    assert np.abs(reference[-1] - w0.numpy()).max() > 0.05


def test_reference_check_detects_a_wrong_update():
    """Companion: the same comparison fails for an update without the trust region."""
    shape = (3, 12, 4)
    w0 = _frames(shape, seed=1)
    grad_fn = _grad_fn_factory(shape, seed=2)
    reference = _ref_stiefel_adam(list(w0.numpy()), grad_fn, 55, lr=0.5, b1=0.9, b2=0.99, eps=1e-8,
                                  delta=0.1, mode="frame")
    ours, _, _ = _run_torch(w0, grad_fn, 55, lr=0.5, betas=(0.9, 0.99), eps=1e-8, trust_region=None)
    assert max(np.abs(a - b).max() for a, b in zip(ours, reference, strict=True)) > 1e-3


def test_state_shapes_per_second_moment():
    w0 = _frames((3, 12, 4), seed=0)
    expected = {"frame": (3, 1, 1), "column": (3, 1, 4), "element": (3, 12, 4)}
    for mode, shape in expected.items():
        _, opt, w = _run_torch(w0, _grad_fn_factory((3, 12, 4), 0), 2, second_moment=mode)
        assert opt.state[w]["exp_avg_sq"].shape == shape
        assert opt.state[w]["exp_avg"].shape == w.shape
    _, opt, w = _run_torch(w0, _grad_fn_factory((3, 12, 4), 0), 2, second_moment=None)
    assert "exp_avg_sq" not in opt.state[w]


def test_frame_state_is_first_moment_plus_one_scalar():
    _, opt, w = _run_torch(_frames((8, 64, 16), 0), _grad_fn_factory((8, 64, 16), 0), 1)
    state_numel = opt.state[w]["exp_avg"].numel() + opt.state[w]["exp_avg_sq"].numel()
    assert state_numel == w.numel() + 8
    assert state_numel <= 1.01 * w.numel()


# ----------------------------------------------------------------------------- weight decay
def test_weight_decay_leaves_frames_untouched_but_decays_euclidean():
    shape = (2, 10, 3)
    w0 = _frames(shape, seed=3)
    grad_fn = _grad_fn_factory(shape, seed=4)
    runs = {}
    for wd in (0.0, 1.0):
        st = PolarStiefel()
        w = geoopt.ManifoldParameter(w0.clone(), manifold=st)
        e = torch.nn.Parameter(torch.ones(5, 5, dtype=torch.float64))
        opt = StiefelAdam([w, e], lr=0.05, weight_decay=wd)
        for t in range(1, 21):
            w.grad = torch.from_numpy(grad_fn(w.detach().numpy(), t))
            e.grad = torch.zeros_like(e)
            opt.step()
        runs[wd] = (w.detach().clone(), e.detach().clone())
    assert torch.equal(runs[0.0][0], runs[1.0][0])  # frames bit-identical
    assert not torch.allclose(runs[0.0][1], runs[1.0][1])  # Euclidean matrix decayed
    assert float(runs[1.0][1].abs().max()) < 0.5


# ----------------------------------------------------------------------------- AdamW equivalence
def _train_linear_pair(ours_wd, ref_wd):
    torch.manual_seed(0)
    a = torch.nn.Linear(7, 5)
    b = torch.nn.Linear(7, 5)
    b.load_state_dict(a.state_dict())
    frame = geoopt.ManifoldParameter(_frames((6, 2), 0, torch.float32), manifold=PolarStiefel())
    ours = StiefelAdam([{"params": list(a.parameters()) + [frame]}], lr=1e-2, betas=(0.8, 0.95),
                       weight_decay=ours_wd, eps=1e-6)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=ref_wd, eps=1e-6)
    x = torch.randn(16, 7)
    for _ in range(30):
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            loss = model(x).square().mean() + (frame.sum() if opt is ours else 0.0)
            loss.backward()
            opt.step()
    return max(float((pa.detach() - pb.detach()).abs().max()) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_euclidean_parameters_follow_torch_adamw():
    assert _train_linear_pair(0.3, 0.3) <= ADAMW_TOL_F32
    # companion: the comparison separates trajectories that differ only in weight decay
    assert _train_linear_pair(0.3, 0.0) > 1e-4


# ----------------------------------------------------------------------------- convergence and drift
def test_converges_to_target_frame_float64():
    """geoopt's test_adam_stiefel problem: min ||W - W*||^2 over St(20, 10)."""
    st = PolarStiefel()
    target = _frames((20, 10), seed=5)
    w = geoopt.ManifoldParameter(_frames((20, 10), seed=6), manifold=st)
    opt = StiefelAdam([w], lr=1e-2)
    for _ in range(3000):
        opt.zero_grad()
        (w - target).square().sum().backward()
        opt.step()
    assert float((w.detach() - target).abs().max()) < CONVERGENCE_TOL


def test_float32_frames_stay_on_manifold_for_10000_steps_without_stabilize():
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(_frames((4, 32, 8), 7, torch.float32), manifold=st)
    opt = StiefelAdam([w], lr=1e-2)
    gen = torch.Generator().manual_seed(8)
    grads = torch.randn(64, 4, 32, 8, generator=gen)
    for k in range(10_000):
        w.grad = grads[k % 64]
        opt.step()
    w64 = w.detach().double()
    err = float((w64.transpose(-1, -2) @ w64 - torch.eye(8, dtype=torch.float64)).abs().max())
    assert err < DRIFT_TOL_F32
    assert float((w.detach() - _frames((4, 32, 8), 7, torch.float32)).abs().max()) > 0.1  # it moved


# ----------------------------------------------------------------------------- state, groups, API
def _toy_model(seed=0):
    torch.manual_seed(seed)
    st = PolarStiefel()
    model = torch.nn.Module()
    model.frames = geoopt.ManifoldParameter(_frames((3, 10, 4), seed, torch.float64), manifold=st)
    model.lin = torch.nn.Linear(4, 2).double()
    return model


def _toy_loss(model, x):
    return model.lin(torch.einsum("bd,hdr->bhr", x, model.frames)).square().mean()


def test_state_dict_round_trip_continues_bit_identically():
    x = torch.randn(8, 10, dtype=torch.float64)
    model = _toy_model()
    opt = StiefelAdam(model.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(10):
        opt.zero_grad()
        _toy_loss(model, x).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for _ in range(10):
        opt.zero_grad()
        _toy_loss(model, x).backward()
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed = _toy_model(seed=99)
    resumed.load_state_dict(saved["model"])
    opt2 = StiefelAdam(resumed.parameters(), lr=0.05, weight_decay=0.1)
    opt2.load_state_dict(saved["opt"])
    for _ in range(10):
        opt2.zero_grad()
        _toy_loss(resumed, x).backward()
        opt2.step()
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_closure_zero_grad_and_parameters_without_grad():
    model = _toy_model()
    unused = torch.nn.Parameter(torch.ones(3))
    opt = StiefelAdam(list(model.parameters()) + [unused], lr=0.01)
    x = torch.randn(8, 10, dtype=torch.float64)

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = _toy_loss(model, x)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss)
    assert unused.grad is None and len(opt.state[unused]) == 0
    assert torch.equal(unused, torch.ones(3))
    opt.zero_grad(set_to_none=True)
    assert model.frames.grad is None


def test_param_groups_with_different_lr_and_trust_region():
    st = PolarStiefel()
    a = geoopt.ManifoldParameter(_frames((2, 16, 4), 1), manifold=st)
    b = geoopt.ManifoldParameter(_frames((2, 16, 4), 2), manifold=st)
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt = StiefelAdam([{"params": [a], "trust_region": 0.01}, {"params": [b], "lr": 1.0, "trust_region": 0.2}],
                      lr=1.0, adjust_lr_fn="original")  # radii as Frobenius norms (the paper's step)
    g = torch.randn(2, 16, 4, dtype=torch.float64)
    a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    move_a = (a.detach() - a0).square().sum(dim=(-2, -1)).sqrt()
    move_b = (b.detach() - b0).square().sum(dim=(-2, -1)).sqrt()
    # the polar retraction moves a point by ||s|| (1 + O(||s||^2)); the caps bind in both groups
    assert torch.allclose(move_a, torch.full_like(move_a, 0.01), rtol=1e-3)
    assert torch.allclose(move_b, torch.full_like(move_b, 0.2), rtol=3e-2)
    assert opt.param_groups[0]["lr"] == 1.0 and opt.param_groups[1]["trust_region"] == 0.2


def test_lr_scheduler_changes_the_frame_step():
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(_frames((1, 16, 4), 3), manifold=st)
    opt = StiefelAdam([w], lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    g = torch.randn(1, 16, 4, dtype=torch.float64)
    moves = []
    for _ in range(2):
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        sched.step()
        moves.append(float((w.detach() - before).norm()))
    assert moves[1] < 0.2 * moves[0]


def test_bf16_frames_train_in_float32_and_stay_near_manifold():
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(_frames((4, 32, 8), 4, torch.float32).to(torch.bfloat16), manifold=st)
    opt = StiefelAdam([w], lr=1e-2)
    for _ in range(50):
        w.grad = torch.randn_like(w)
        opt.step()
    assert w.dtype == torch.bfloat16
    assert opt.state[w]["exp_avg"].dtype == torch.float32
    w32 = w.detach().float()
    assert float((w32.transpose(-1, -2) @ w32 - torch.eye(8)).abs().max()) < 3e-2


def test_non_finite_gradient_skips_only_that_frame():
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(_frames((3, 12, 4), 5), manifold=st)
    opt = StiefelAdam([w], lr=0.05)
    w.grad = torch.randn(3, 12, 4, dtype=torch.float64)
    opt.step()
    before = w.detach().clone()
    m_before = opt.state[w]["exp_avg"].clone()
    g = torch.randn(3, 12, 4, dtype=torch.float64)
    g[1, 2, 0] = float("nan")
    g[2, 0, 0] = float("inf")
    w.grad = g
    opt.step()
    assert torch.equal(w.detach()[1:], before[1:]) and torch.equal(opt.state[w]["exp_avg"][1:], m_before[1:])
    assert not torch.equal(w.detach()[0], before[0])
    assert int(opt.state[w]["skipped_frames"]) == 2
    assert torch.isfinite(opt.state[w]["exp_avg_sq"]).all()
    w.grad = torch.randn(3, 12, 4, dtype=torch.float64)
    opt.step()
    assert not torch.equal(w.detach()[1], before[1])
    assert st.check_point_on_manifold(w, atol=1e-10)


# ----------------------------------------------------------------------------- errors
def test_canonical_stiefel_is_rejected_with_the_fix():
    canonical = geoopt.Stiefel()
    w = geoopt.ManifoldParameter(canonical.random(8, 3), manifold=canonical)
    with pytest.raises(ValueError, match="PolarStiefel"):
        StiefelAdam([w])


def test_other_manifolds_are_rejected():
    sphere = geoopt.Sphere()
    w = geoopt.ManifoldParameter(sphere.random(8), manifold=sphere)
    with pytest.raises(ValueError, match="RiemannianAdam"):
        StiefelAdam([w])


def test_off_manifold_frame_raises_at_first_step_and_changes_nothing():
    st = PolarStiefel()
    w = geoopt.ManifoldParameter(1.01 * _frames((2, 9, 3), 0), manifold=st)
    e = torch.nn.Parameter(torch.ones(3))
    opt = StiefelAdam([e, w], lr=0.1)
    w.grad, e.grad = torch.randn_like(w), torch.ones(3)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"\(2, 9, 3\).*proj_\(\)"):
        opt.step()
    assert torch.equal(w.detach(), before) and torch.equal(e.detach(), torch.ones(3))
    assert len(opt.state) == 0
    with torch.no_grad():
        w.proj_()
    opt.step()  # the suggested fix works


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
def test_sparse_gradient_is_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = StiefelAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


@pytest.mark.filterwarnings("ignore:StiefelAdam was constructed with no Stiefel frame:UserWarning")
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -1e-3}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"eps": -1e-8}, "eps"),
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"trust_region": 0.0}, "trust_region"),
        ({"trust_region": float("inf")}, "trust_region"),
        ({"second_moment": "row"}, "second_moment"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"stabilize": 0}, "stabilize"),
    ],
)
def test_invalid_hyperparameters_name_the_option(kwargs, name):
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=name):
        StiefelAdam([p], **kwargs)
    opt = StiefelAdam([p])
    with pytest.raises(ValueError, match=name):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **kwargs})
    assert len(opt.param_groups) == 1


def test_old_checkpoint_without_new_group_options_loads():
    model = _toy_model()
    opt = StiefelAdam(model.parameters(), lr=0.01)
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        del group["trust_region"], group["second_moment"]
    opt2 = StiefelAdam(model.parameters(), lr=0.01)
    opt2.load_state_dict(sd)
    # the radius loads as 'auto', which is the paper's 0.1 under the rule such a group carries (here its own,
    # match_rms_adamw: 1)
    from geoopt_stiefel_attention._linalg import trust_radius

    g = opt2.param_groups[0]
    assert g["trust_region"] == "auto" and g["second_moment"] == "frame"
    assert trust_radius(g["trust_region"], g["adjust_lr_fn"]) == 1.0
    assert trust_radius(g["trust_region"], "original") == 0.1


@pytest.mark.parametrize(("mode", "batching"), [("frame", "cpu"), (None, "cpu"), ("element", "cpu"),
                                               ("frame", "accelerator"), ("frame", "capturable-accelerator")])
def test_several_parameters_in_one_group_match_the_reference(mode, batching):
    """Same-shaped small frame parameters are stacked into one batch, a larger one is updated on its own;
    every parameter must still follow the written-out reference (the stacked path of the fused kernel).
    ``accelerator``: the batch limit an accelerator uses, which puts every same-shaped frame of the group in one
    batch, run on the CPU (also with ``capturable=True``, the path a GPU takes)."""
    shapes = [(2, 10, 3), (2, 10, 3), (2, 10, 3), (1, 16, 5)]
    starts = [_frames(s, seed=10 + k) for k, s in enumerate(shapes)]
    grad_fns = [_grad_fn_factory(s, seed=20 + k) for k, s in enumerate(shapes)]
    kw = dict(lr=0.05, b1=0.9, b2=0.99, eps=1e-8, delta=0.1, mode=mode)
    references = [_ref_stiefel_adam(list(w0.numpy()), fn, 50, **kw)[-1] for w0, fn in zip(starts, grad_fns, strict=True)]
    st = PolarStiefel()
    params = [geoopt.ManifoldParameter(w0.clone(), manifold=st) for w0 in starts]
    opt = StiefelAdam(params, lr=0.05, betas=(0.9, 0.99), eps=1e-8, trust_region=0.1, second_moment=mode,
                      capturable=batching.startswith("capturable"), adjust_lr_fn="original")
    if batching.endswith("accelerator"):
        opt._stack_numel = optim.ACCELERATOR_STACK_NUMEL
    for t in range(1, 51):
        for p, fn in zip(params, grad_fns, strict=True):
            p.grad = torch.from_numpy(fn(p.detach().numpy(), t))
        opt.step()
    for p, ref in zip(params, references, strict=True):
        assert np.abs(p.detach().numpy() - ref).max() < REFERENCE_TOL
    # the parameters really differ from each other (a mix-up of stacked slots would be caught)
    assert np.abs(references[0] - references[1]).max() > 0.1


def test_stacked_view_only_for_consecutive_slices_of_one_buffer():
    buf = torch.arange(24.0).view(4, 2, 3)
    stacked = _stacked_view(list(buf[1:4].unbind(0)))
    assert stacked is not None and stacked.data_ptr() == buf[1].data_ptr() and torch.equal(stacked, buf[1:4])
    stacked[0, 0, 0] = -1.0  # a view: writes reach the buffer
    assert buf[1, 0, 0] == -1.0
    # companions: each way of not being one stack gives None
    assert _stacked_view([buf[2], buf[1]]) is None  # wrong order
    assert _stacked_view([buf[0], buf[2]]) is None  # a gap
    assert _stacked_view([buf[0], buf[1].clone()]) is None  # another storage
    assert _stacked_view([buf[0].mT, buf[1].mT]) is None  # not row-major
    assert _stacked_view([buf[0], buf[1].view(3, 2)]) is None  # another shape


def _stacked_run(steps, *, edit=None, stack_numel=None, resume_at=None, idle=None, capturable=None):
    """Three same-shaped frame parameters and a lone larger one trained ``steps`` steps; ``edit(opt, params)``
    runs after step 3, ``resume_at`` reloads the optimizer from a saved state dict after that step, and the
    parameters numbered ``idle(t)`` get no gradient at step ``t``."""
    shapes = [(2, 10, 3)] * 3 + [(1, 16, 5)]
    params = [geoopt.ManifoldParameter(_frames(s, seed=30 + k), manifold=PolarStiefel())
              for k, s in enumerate(shapes)]
    grad_fns = [_grad_fn_factory(s, seed=40 + k) for k, s in enumerate(shapes)]

    def build():
        opt = StiefelAdam(params, lr=0.05, betas=(0.9, 0.99), trust_region=0.1, capturable=capturable)
        if stack_numel is not None:
            opt._stack_numel = stack_numel
        return opt

    opt = build()
    for t in range(1, steps + 1):
        for k, (p, fn) in enumerate(zip(params, grad_fns, strict=True)):
            p.grad = None if idle is not None and k in idle(t) else torch.from_numpy(fn(p.detach().numpy(), t))
        opt.step()
        if t == 3 and edit is not None:
            edit(opt, params)
        if t == resume_at:
            opt = reloaded(opt, build)
    return params, opt


def test_moments_of_a_batch_are_kept_stacked_and_behave_as_separate_tensors():
    params, opt = _stacked_run(6)
    batch = params[:3]
    for key in ("exp_avg", "exp_avg_sq"):
        assert shares_one_buffer([opt.state[p][key] for p in batch])
        # companion: the lone parameter is its own batch, in place, and its moment is its own tensor
        assert not shares_one_buffer([opt.state[p][key] for p in params[2:]])
    # one update call per parameter (nothing stacked) gives the same frames and moments to rounding
    separate, opt_sep = _stacked_run(6, stack_numel=1)
    assert not shares_one_buffer([opt_sep.state[p]["exp_avg"] for p in separate[:3]])
    for p, q in zip(params, separate, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-13)
        torch.testing.assert_close(opt.state[p]["exp_avg"], opt_sep.state[q]["exp_avg"], rtol=0, atol=1e-13)


def test_stacked_moments_resume_from_a_state_dict_bit_identically():
    params, _ = _stacked_run(8)
    resumed, opt = _stacked_run(8, resume_at=4)  # loaded as separate tensors, stacked again at the next step
    assert shares_one_buffer([opt.state[p]["exp_avg"] for p in resumed[:3]])
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p.detach(), q.detach())


def test_a_moment_replaced_by_the_user_is_the_one_the_next_step_uses():
    def reset(opt, params):  # a new tensor in place of a stacked slice, as a user or a tool may assign
        opt.state[params[1]]["exp_avg"] = torch.zeros_like(opt.state[params[1]]["exp_avg"])

    edited, opt = _stacked_run(5, edit=reset)
    reference, _ = _stacked_run(5, edit=reset, stack_numel=1)
    untouched, _ = _stacked_run(5)
    assert shares_one_buffer([opt.state[p]["exp_avg"] for p in edited[:3]])  # stacked again
    for p, q in zip(edited, reference, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-13)
    # companion: the reset does change the trajectory of that parameter (and only that one)
    assert (edited[1].detach() - untouched[1].detach()).abs().max() > 1e-6
    assert torch.equal(edited[0].detach(), untouched[0].detach())


def _dead_state_bytes(opt):
    """Bytes held by the storages of the optimizer's state tensors that no state tensor covers (a buffer kept
    alive by a slice left in it), written out from storage pointers and sizes."""
    used = defaultdict(set)
    held = {}
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.numel():
                storage = t.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
                start = t.data_ptr() - storage.data_ptr()
                used[storage.data_ptr()].update(range(start, start + t.numel() * t.element_size()))
    return sum(held[ptr] - len(used[ptr]) for ptr in held)


def test_dead_state_bytes_sees_a_buffer_kept_alive_by_a_slice():
    """Companion of the tests below: the measure is not blind (a state slice of a larger buffer is counted)."""
    params, opt = _stacked_run(2)
    assert _dead_state_bytes(opt) == 0
    m = opt.state[params[0]]["exp_avg"]
    opt.state[params[0]]["exp_avg"] = torch.zeros((2, *m.shape), dtype=m.dtype)[0]
    # dead: the second half of the new buffer, and the slot the replaced slice held in the batch's buffer
    assert _dead_state_bytes(opt) == 2 * m.numel() * m.element_size()


@pytest.mark.parametrize("capturable", [False, True])
def test_a_batch_whose_members_change_keeps_no_old_buffer_alive(capturable):
    """Parameter 1 gets no gradient at some steps: the batch's members change (on the default path its step
    count also falls behind, which splits the batch for good; on the capturable path the members alternate).
    Moments re-stacked for the new members must not leave the old buffer alive through the slice of the
    parameter left out, and every parameter must follow one-call-per-parameter updates."""
    def idle(t):
        return {1} if (t == 4 if not capturable else t % 2 == 0) else set()

    params, opt = _stacked_run(9, idle=idle, capturable=capturable)
    separate, _ = _stacked_run(9, idle=idle, capturable=capturable, stack_numel=1)
    assert _dead_state_bytes(opt) == 0
    for p, q in zip(params, separate, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-13)
    if not capturable:  # parameters 0 and 2 share a step count and a buffer; parameter 1 has its own
        assert shares_one_buffer([opt.state[params[k]]["exp_avg"] for k in (0, 2)])
        m1 = opt.state[params[1]]["exp_avg"]
        assert m1.untyped_storage().nbytes() == m1.numel() * m1.element_size()
    # companion: parameter 1 really sat out (its trajectory differs from a run where it always had a gradient)
    always, _ = _stacked_run(9, capturable=capturable)
    assert (params[1].detach() - always[1].detach()).abs().max() > 1e-6


@pytest.mark.parametrize("capturable", [False, True])
def test_bf16_frames_with_master_copies_update_the_stacked_masters(capturable):
    """bf16 frames with float32 master copies: the batch's masters are kept stacked and are the frames the
    update reads and writes; the bf16 parameters are their rounding, as with one call per parameter."""
    def run(stack_numel):
        params = [geoopt.ManifoldParameter(_frames((2, 12, 4), seed=50 + k).to(torch.bfloat16),
                                           manifold=PolarStiefel()) for k in range(3)]
        opt = StiefelAdam(params, lr=0.02, master_weights=True, capturable=capturable)
        opt._stack_numel = stack_numel
        gen = torch.Generator().manual_seed(0)
        for _ in range(10):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            opt.step()
        return params, opt

    stacked, opt = run(None)
    separate, opt_sep = run(1)
    masters = [opt.state[p]["master"] for p in stacked]
    assert masters[0].dtype == torch.float32 and shares_one_buffer(masters)
    assert not shares_one_buffer([opt_sep.state[p]["master"] for p in separate])  # companion
    for p, q in zip(stacked, separate, strict=True):
        torch.testing.assert_close(opt.state[p]["master"], opt_sep.state[q]["master"], rtol=0, atol=1e-6)
        assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))
    # the masters moved (a no-op update would pass the comparisons above)
    start = _frames((2, 12, 4), seed=50).to(torch.bfloat16).float()
    assert (masters[0] - start).abs().max() > 1e-3


# ----------------------------------------------------------------------------- adjust_lr_fn (the frame-step rule)
@pytest.mark.parametrize(("shape", "mode", "capturable"), [((3, 12, 4), "frame", False), ((2, 20, 5), "frame", True),
                                                           ((3, 12, 4), "column", False), ((3, 12, 4), None, False)])
def test_match_rms_adamw_is_the_reference_with_lr_times_sqrt_dr(shape, mode, capturable):
    """``match_rms_adamw`` = the written-out update with lr multiplied by sqrt(d r) and the radius Delta as it is
    (a cap on ||s||_F in the frame's own units), on every path."""
    _, d, r = shape
    c = np.sqrt(d * r)  # written out here, not taken from the code under test
    w0 = _frames(shape, seed=3)
    grad_fn = _grad_fn_factory(shape, seed=4)
    lr, delta = 0.004, 0.02  # the radius binds on some steps: c * lr ~ 0.03 against delta = 0.02
    reference = _ref_stiefel_adam(list(w0.numpy()), grad_fn, 55, lr=c * lr, b1=0.9, b2=0.99, eps=1e-8,
                                  delta=delta, mode=mode)
    ours, opt, _ = _run_torch(w0, grad_fn, 55, lr=lr, betas=(0.9, 0.99), eps=1e-8, trust_region=delta,
                              second_moment=mode, adjust_lr_fn="match_rms_adamw", capturable=capturable)
    assert max(np.abs(a - b).max() for a, b in zip(ours, reference, strict=True)) < REFERENCE_TOL
    assert opt.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    # companions: the radius scaled with the lr (the rule before issue 40) is a different trajectory, and so is
    # the paper's step at the same lr (c times smaller steps) wherever the radius does not bind on every step
    scaled = _ref_stiefel_adam(list(w0.numpy()), grad_fn, 55, lr=c * lr, b1=0.9, b2=0.99, eps=1e-8,
                               delta=c * delta, mode=mode)
    assert max(np.abs(a - b).max() for a, b in zip(ours, scaled, strict=True)) > 1e-3
    if mode is not None:  # without a second moment the radius binds on every step, under either rule
        original, _, _ = _run_torch(w0, grad_fn, 55, lr=lr, betas=(0.9, 0.99), eps=1e-8, trust_region=delta,
                                    second_moment=mode, capturable=capturable)
        assert max(np.abs(a - b).max() for a, b in zip(original, reference, strict=True)) > 1e-2


def test_match_rms_adamw_moves_a_frame_as_adamw_moves_the_same_block():
    """First step: AdamW moves each entry by lr (sign step), a frame's step has Frobenius norm lr sqrt(d r)
    under the rule, for every shape; the paper's step has norm lr whatever the shape."""
    lr = 1e-3
    for d, r in ((16, 4), (64, 16), (128, 32)):
        g = torch.randn(1, d, r, dtype=torch.float64)
        block = torch.nn.Parameter(torch.randn(d, r, dtype=torch.float64))
        start = block.detach().clone()
        block.grad = g[0].clone()
        torch.optim.AdamW([block], lr=lr, weight_decay=0.0).step()
        adamw_move = float((block.detach() - start).norm())
        moves = {}
        for fn in ("original", "match_rms_adamw"):
            w = geoopt.ManifoldParameter(_frames((1, d, r), seed=d), manifold=PolarStiefel())
            w0 = w.detach().clone()
            w.grad = g.clone()
            StiefelAdam([w], lr=lr, adjust_lr_fn=fn).step()
            # the polar retraction shortens a tangent step s to first order only: ||polar(W - s) - W|| ~ ||s||
            moves[fn] = float((w.detach() - w0).norm())
        assert moves["match_rms_adamw"] == pytest.approx(adamw_move, rel=1e-3)
        assert moves["original"] == pytest.approx(lr, rel=1e-3)  # companion: shape-blind, sqrt(d r) times less
        assert adamw_move / moves["original"] == pytest.approx(np.sqrt(d * r), rel=1e-3)


def test_match_rms_adamw_keeps_the_step_scale_free():
    """Certificate 2a under the rule: gradient times 1e4 gives the same step (eps = 0)."""
    w0 = _frames((2, 24, 6), seed=5)
    g = torch.randn(2, 24, 6, dtype=torch.float64)
    out = []
    for scale in (1.0, 1e4):
        w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
        w.grad = scale * g
        StiefelAdam([w], lr=1e-3, eps=0.0, adjust_lr_fn="match_rms_adamw").step()
        out.append(w.detach())
    assert float((out[0] - out[1]).abs().max()) < REFERENCE_TOL
    # companion: a different gradient direction does change the step
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    w.grad = g + torch.randn_like(g)
    StiefelAdam([w], lr=1e-3, eps=0.0, adjust_lr_fn="match_rms_adamw").step()
    assert float((out[0] - w.detach()).abs().max()) > 1e-4


def test_adjust_lr_fn_is_validated_and_old_checkpoints_load_with_the_papers_step():
    model = _toy_model()
    with pytest.raises(ValueError, match="adjust_lr_fn='rms'.*match_rms_adamw"):
        StiefelAdam(model.parameters(), adjust_lr_fn="rms")
    opt = StiefelAdam(model.parameters(), lr=0.01, adjust_lr_fn="match_rms_adamw")
    with pytest.raises(ValueError, match="adjust_lr_fn="):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "adjust_lr_fn": None})
    sd = StiefelAdam(model.parameters(), lr=0.01).state_dict()
    for group in sd["param_groups"]:
        del group["adjust_lr_fn"]  # a checkpoint saved before the option existed
    with pytest.warns(UserWarning, match="no 'adjust_lr_fn'"):  # it changes this optimizer's rule: said
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["adjust_lr_fn"] == "original"
    assert optim.frame_step_scale("match_rms_adamw", 128, 32) == 64.0
    assert optim.frame_step_scale("original", 128, 32) == 1.0


def test_param_groups_carries_the_rule_to_the_frames_group_only():
    from geoopt_stiefel_attention import param_groups

    model = tiny_transformer()
    groups = param_groups(model, adjust_lr_fn="match_rms_adamw")
    assert groups[0]["name"] == "frames" and groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert all("adjust_lr_fn" not in g for g in groups[1:])
    opt = StiefelAdam(groups, lr=1e-3, adjust_lr_fn="original")
    assert [g["adjust_lr_fn"] for g in opt.param_groups] == ["match_rms_adamw", "original", "original"]
    # not given anywhere, the optimizer's default rule applies to every group
    opt = StiefelAdam(param_groups(model), lr=1e-3)
    assert {g["adjust_lr_fn"] for g in opt.param_groups} == {"match_rms_adamw"}
    assert "adjust_lr_fn" not in param_groups(model)[0]  # companion: not given, the optimizer decides
    with pytest.raises(ValueError, match="param_groups: adjust_lr_fn='x'"):
        param_groups(model, adjust_lr_fn="x")


def test_the_default_rule_is_match_rms_adamw_and_the_papers_step_stays_available_by_name():
    """A user who changes nothing gets the rule (frame steps sized as AdamW's, issue 25's evidence); the paper's
    step is ``adjust_lr_fn="original"``."""
    g = torch.from_numpy(_grad_fn_factory((2, 16, 4), seed=5)(_frames((2, 16, 4), seed=6).numpy(), 1))
    ends = {}
    for fn in (None, "match_rms_adamw", "original"):
        w = geoopt.ManifoldParameter(_frames((2, 16, 4), seed=6), manifold=PolarStiefel())
        opt = StiefelAdam([w], lr=1e-3) if fn is None else StiefelAdam([w], lr=1e-3, adjust_lr_fn=fn)
        w.grad = g.clone()
        opt.step()
        ends[fn] = (w.detach().clone(), opt.param_groups[0]["adjust_lr_fn"])
    assert ends[None][1] == "match_rms_adamw"
    assert torch.equal(ends[None][0], ends["match_rms_adamw"][0])
    # companion: the paper's step is another (sqrt(16 * 4) = 8 times shorter) step
    start = _frames((2, 16, 4), seed=6)
    ratio = (ends[None][0] - start).norm() / (ends["original"][0] - start).norm()
    assert abs(float(ratio) - 8.0) < 0.05


# ------------------------------------------------------------------ frames of one shape, different head counts
def _gqa_run(steps, *, capturable=None, stack_numel=None, nan_at=None, optimizer="adam", dtype=torch.float64,
             **options):
    """Query and key frames of grouped-query attention: 4, 2 and 3 heads of 10 x 3 (one frame shape), beside a
    parameter of 16 x 5 frames; at step ``nan_at`` the last frame of parameters 1 and 2 has a NaN gradient."""
    shapes = [(4, 10, 3), (2, 10, 3), (3, 10, 3), (2, 16, 5)]
    params = [geoopt.ManifoldParameter(_frames(s, seed=70 + k).to(dtype), manifold=PolarStiefel())
              for k, s in enumerate(shapes)]
    grad_fns = [_grad_fn_factory(s, seed=80 + k) for k, s in enumerate(shapes)]
    if optimizer == "adam":
        opt = StiefelAdam(params, lr=0.05, betas=(0.9, 0.99), trust_region=0.1, capturable=capturable, **options)
    else:
        opt = optim.StiefelMuon(params, lr=0.05, capturable=capturable, **options)
    if stack_numel is not None:
        opt._stack_numel = stack_numel
    for t in range(1, steps + 1):
        for k, (p, fn) in enumerate(zip(params, grad_fns, strict=True)):
            g = torch.from_numpy(fn(p.detach().double().numpy(), t)).to(dtype)
            if t == nan_at and k in (1, 2):  # the last frame of each: positions 5 and 8 of the stack
                g[k, 0, 0] = float("nan")
            p.grad = g
        opt.step()
    return params, opt


def test_frame_batches_join_parameters_of_one_frame_shape_whatever_their_head_counts():
    from geoopt_stiefel_attention.optim._batching import _frame_batches

    params, _ = _gqa_run(0)
    batches = _frame_batches(params, [1] * 4)
    assert [[tuple(p.shape) for p in b] for _, b in batches] == [[(4, 10, 3), (2, 10, 3), (3, 10, 3)], [(2, 16, 5)]]
    # companions: another step count, or a limit below two parameters' size, splits the batch
    assert len(_frame_batches(params, [1, 2, 1, 1])) == 3
    assert [len(b) for _, b in _frame_batches(params, [1] * 4, stack_numel=8 * 30)] == [2, 1, 1]
    # a parameter of more than half the limit is a batch of its own
    assert [len(b) for _, b in _frame_batches(params, [1] * 4, stack_numel=100)] == [1, 1, 1, 1]


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_grouped_query_frames_stacked_follow_one_call_per_parameter(capturable, optimizer):
    """4, 2 and 3 heads of one frame shape are updated as one stack (their moments kept as consecutive slices of
    one buffer): frames, moments and the skipped-frame counts (one frame of parameters 1 and 2 has a NaN gradient
    at step 3) are those of one update call per parameter, to rounding."""
    params, opt = _gqa_run(6, capturable=capturable, nan_at=3, optimizer=optimizer)
    separate, opt_sep = _gqa_run(6, capturable=capturable, nan_at=3, optimizer=optimizer, stack_numel=1)
    key = "exp_avg" if optimizer == "adam" else "momentum_buffer"
    if optimizer == "adam":
        assert shares_one_buffer([opt.state[p][key] for p in params[:3]])
        assert shares_one_buffer([opt.state[p]["exp_avg_sq"] for p in params[:3]])
    # companion: one call per parameter keeps them apart
    assert not shares_one_buffer([opt_sep.state[p][key] for p in separate[:3]])
    for p, q in zip(params, separate, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-13)
        torch.testing.assert_close(opt.state[p][key], opt_sep.state[q][key], rtol=0, atol=1e-13)
    assert [int(opt.state[p]["skipped_frames"]) for p in params] == [0, 1, 1, 0]
    assert [int(opt_sep.state[p]["skipped_frames"]) for p in separate] == [0, 1, 1, 0]
    # the frames moved, and stayed on the manifold
    start = _frames((2, 10, 3), seed=71)
    assert (params[1].detach() - start).abs().max() > 1e-2
    for p in params:
        assert float((p.detach().mT @ p.detach() - torch.eye(p.shape[-1], dtype=p.dtype)).abs().max()) < 1e-12


@pytest.mark.parametrize("options", [{"second_moment": "column"}, {"second_moment": "element"},
                                     {"second_moment": None}, {"stabilize": 2},
                                     {"master_weights": True, "dtype": torch.bfloat16}], ids=str)
def test_grouped_query_frames_stacked_with_other_state_shapes_follow_one_call_per_parameter(options):
    """The readable update's second moments (one per column, one per entry), none, re-projection every 2 steps, and
    bf16 frames with float32 master copies, on the mixed batch: frames and state equal one call per parameter (to
    float64 rounding, float32's for the masters)."""
    params, opt = _gqa_run(5, **options)
    separate, opt_sep = _gqa_run(5, stack_numel=1, **options)
    tol = 1e-13 if "dtype" not in options else 1e-6
    for p, q in zip(params, separate, strict=True):
        for key, value in opt_sep.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=0, atol=tol)
        if "dtype" in options:  # a bf16 frame is its master copy's rounding
            assert opt.state[p]["master"].dtype == torch.float32
            assert torch.equal(p.detach(), opt.state[p]["master"].to(options["dtype"]))
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=tol)
    start = _frames((2, 10, 3), seed=71).to(options.get("dtype", torch.float64))
    assert (params[1].detach().double() - start.double()).abs().max() > 1e-2  # the frames moved
    if options.get("second_moment", "frame") is not None:  # the second moments have the per-parameter shapes
        assert [tuple(opt.state[p]["exp_avg_sq"].shape) for p in params] == [
            tuple(opt_sep.state[q]["exp_avg_sq"].shape) for q in separate]


def test_grouped_query_moments_resume_from_a_state_dict():
    """Moments of a mixed-head-count batch saved and loaded (as separate tensors) are stacked again at the next
    step, and the run continues bit for bit."""
    params, opt = _gqa_run(4)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = StiefelAdam(params, lr=0.05, betas=(0.9, 0.99), trust_region=0.1)
    fresh.load_state_dict(torch.load(buffer))
    assert not shares_one_buffer([fresh.state[p]["exp_avg"] for p in params[:3]])
    for p, fn in zip(params, [_grad_fn_factory(s, seed=80 + k) for k, s in enumerate(
            [(4, 10, 3), (2, 10, 3), (3, 10, 3), (2, 16, 5)])], strict=True):
        p.grad = torch.from_numpy(fn(p.detach().numpy(), 5))
    before = [p.detach().clone() for p in params]
    fresh.step()
    assert shares_one_buffer([fresh.state[p]["exp_avg"] for p in params[:3]])
    again, _ = _gqa_run(5)
    for p, q, b in zip(params, again, before, strict=True):
        assert torch.equal(p.detach(), q.detach())
        assert not torch.equal(p.detach(), b)


def test_stacked_view_of_slices_with_different_leading_sizes():
    buf = torch.arange(36.0).view(6, 2, 3)
    parts = [buf[0:3], buf[3:4], buf[4:6]]
    stacked = _stacked_view(parts)
    assert stacked is not None and stacked.shape == (6, 2, 3) and torch.equal(stacked, buf)
    assert _stacked_view([buf[0:3], buf[4:6]]) is None  # companion: a gap
    assert _stacked_view([buf[3:4], buf[0:3]]) is None  # companion: out of order
