"""StiefelMuon: the direction against an independent convex solver (cvxpy with Clarabel) over drawn shapes
including square and near-square frames, the certificate that stops the solver, the fast path against the
readable one, torch's Muon conventions, feasibility, and the optimizer's own behaviour (issues 41 and 56). Float64
with named tolerances; every property test has a companion case where the property must fail."""

import math
import warnings

import geoopt
import numpy as np
import pytest
import torch
from conftest import ORTHO_TOL_F32, ORTHO_TOL_F64, fixed_count_direction

from geoopt_stiefel_attention import PolarStiefel
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.analysis.muon import inverse_polar_retraction
from geoopt_stiefel_attention.optim import (
    DEFAULT_DIRECTION_TOL,
    StiefelMuon,
    muon_direction,
    muon_direction_reference,
    muon_lr_scale,
    stiefel_muon_update,
)
from geoopt_stiefel_attention.optim._muon import (
    ROUND_FLOOR,
    _msign_skew,
    certified_direction_steps,
    direction_round_length,
)

#: relative: cvxpy/Clarabel's dual optimum, re-evaluated with numpy's SVD at its multiplier (an upper bound by weak
#: duality), above the closed-form optimum (measured 1e-10 to 2e-9 on these sizes)
CVXPY_RTOL = 1e-7
#: relative: the optimizer's first-step direction (float64, direction_tol 1e-7) below the cvxpy optimum
FIRST_STEP_RTOL = 2e-7
#: the fixed-count rule of 38fe98e (dual_steps=10, ns_steps=8) on 10 x 9 and 12 x 11 frames: the issue measured
#: 4-12 % short; the companion requires at least this much on some frame
FIXED_COUNT_SHORTFALL_MIN = 1e-2
#: float64: the fast direction vs the SVD reference (measured 2e-14)
DIRECTION_TOL = 1e-9
#: float64: optimizer (fast) vs stiefel_muon_update (SVD) after 20 steps (measured 3e-14)
MUON_STEP_TOL = 1e-9
#: tangency |W^T A + A^T W| and ||A||_2 - 1 of the fast direction (float64 / float32; measured 7e-16 / 2e-7)
FEASIBLE_TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
#: the certified gap may undercut the true shortfall by rounding only (relative; float64 / float32)
ROUNDING = {torch.float64: 1e-12, torch.float32: 1e-6}


def _frames(n, d, r, seed=0, dtype=torch.float64):
    return PolarStiefel().random(n, d, r, dtype=dtype, generator=torch.Generator().manual_seed(seed)).as_subclass(
        torch.Tensor)


def _tangent(w, seed=1):
    g = torch.randn(w.shape, dtype=w.dtype, generator=torch.Generator().manual_seed(seed))
    return g - w @ (0.5 * (w.mT @ g + g.mT @ w))


def _momentum(w, kind, seed=1):
    """Tangent momenta of four kinds: Gaussian, singular values falling off as 1/i, rank one, zero."""
    n, d, r = w.shape
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        g = torch.randn(n, d, r, dtype=w.dtype, generator=gen)
    elif kind == "1/i":
        u = torch.linalg.qr(torch.randn(n, d, r, dtype=w.dtype, generator=gen)).Q
        v = torch.linalg.qr(torch.randn(n, r, r, dtype=w.dtype, generator=gen)).Q
        g = (u / torch.arange(1, r + 1, dtype=w.dtype)) @ v.mT
    elif kind == "rank one":
        g = torch.randn(n, d, 1, dtype=w.dtype, generator=gen) @ torch.randn(n, 1, r, dtype=w.dtype, generator=gen)
    else:
        g = torch.zeros(n, d, r, dtype=w.dtype)
    return g - w @ (0.5 * (w.mT @ g + g.mT @ w))


def _value(m, a):
    """<M, A> / max(1, ||A||_2): the objective of A made feasible by scaling (A tangent)."""
    return (m * a).sum((-2, -1)) / torch.linalg.matrix_norm(a, ord=2).clamp_min(1.0)


# ------------------------------------------------------------------------------- an independent solver
def _cvxpy_optimum(m: np.ndarray, w: np.ndarray) -> float:
    """max <M, A> over tangent A with ||A||_2 <= 1, solved independently of the library: the Lagrange dual
    min over symmetric L of ||M - 2 W L||_* by cvxpy with the Clarabel interior-point solver, its value re-evaluated
    with numpy's SVD at the multiplier it returns (an upper bound on the optimum by weak duality)."""
    cp = pytest.importorskip("cvxpy", reason="the independent solver of these tests (pip install -e .[dev])")
    r = m.shape[1]
    lam = cp.Variable((r, r), symmetric=True)
    cp.Problem(cp.Minimize(cp.normNuc(m - 2 * w @ lam))).solve(solver="CLARABEL")
    return float(np.linalg.svd(m - 2 * w @ lam.value, compute_uv=False).sum())


def _drawn_shapes():
    """(d, r) for the cvxpy tests: for three drawn d <= 12, a square, a near-square (r = d - 1) and a drawn r."""
    rng = np.random.default_rng(56)
    shapes = []
    for d in rng.integers(3, 13, size=3):
        shapes += [(int(d), int(d)), (int(d), int(d) - 1), (int(d), int(rng.integers(1, d - 1)))]
    return shapes + [(12, 12), (10, 9), (12, 4)]


@pytest.mark.parametrize(("d", "r"), _drawn_shapes())
def test_the_closed_form_optimum_is_the_convex_solvers(d, r):
    """muon_direction_reference's 1/2 ||M W^T - W M^T||_* equals cvxpy's optimum, and its direction attains it
    feasibly."""
    w = _frames(2, d, r, seed=d * r)
    m = _tangent(w, seed=d + r)
    a, opt = muon_direction_reference(m, w)
    for k in range(2):
        upper = _cvxpy_optimum(m[k].numpy(), w[k].numpy())
        assert float(opt[k]) <= upper * (1 + 1e-12)
        assert float(opt[k]) >= upper * (1 - CVXPY_RTOL)
    assert (w.mT @ a + a.mT @ w).abs().max() < FEASIBLE_TOL[torch.float64]
    assert (torch.linalg.matrix_norm(a, ord=2) - 1).max() < FEASIBLE_TOL[torch.float64]
    assert torch.allclose(_value(m, a), opt.flatten(), rtol=1e-12, atol=0)


@pytest.mark.parametrize(("d", "r"), _drawn_shapes())
def test_the_optimizers_first_step_direction_reaches_the_convex_solvers_optimum(d, r):
    """StiefelMuon at its defaults (float64): the direction of its first step, recovered from the iterates by
    inverting the polar retraction, is within FIRST_STEP_RTOL of cvxpy's optimum and above no upper bound."""
    w0 = _frames(2, d, r, seed=d * r)
    g = torch.randn(2, d, r, dtype=torch.float64, generator=torch.Generator().manual_seed(d + r))
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=1e-3, adjust_lr_fn="original")
    w.grad = g.clone()
    opt.step()
    a = -inverse_polar_retraction(w0, w.detach()) / (1e-3 * muon_lr_scale("original", d, r))
    xi = g - w0 @ (0.5 * (w0.mT @ g + g.mT @ w0))
    value = _value(xi, a - w0 @ (0.5 * (w0.mT @ a + a.mT @ w0)))
    for k in range(2):
        upper = _cvxpy_optimum(xi[k].numpy(), w0[k].numpy())
        assert float(value[k]) <= upper * (1 + 1e-9)
        assert float(value[k]) >= upper * (1 - FIRST_STEP_RTOL), (d, r, 1 - float(value[k]) / upper)
    assert int(opt.state[w]["uncertified_frames"]) == 0


@pytest.mark.parametrize(("d", "r"), [(10, 9), (12, 11)])
def test_companion_the_fixed_count_rule_falls_short_of_the_convex_solvers_optimum_on_near_square_frames(d, r):
    """The stopping rule StiefelMuon had before issue 56 (fixed counts: dual_steps=10, ns_steps=8; written out in
    conftest) fails the comparison above on near-square frames, and more steps do not rescue it: its dual descent
    stalls where the optimal Z = M - 2WL is rank-deficient."""
    w = _frames(3, d, r, seed=d * r)
    m = _tangent(w, seed=d + r)
    uppers = [_cvxpy_optimum(m[k].numpy(), w[k].numpy()) for k in range(3)]
    for counts in ((10, 8), (50, 30)):
        value = _value(m, fixed_count_direction(m, w, *counts))
        assert max(1 - float(value[k]) / uppers[k] for k in range(3)) > FIXED_COUNT_SHORTFALL_MIN, counts


# ------------------------------------------------------------------------------- the certificate
CASES = [(d, r, kind) for d, r in [(9, 9), (12, 12), (10, 9), (12, 11), (16, 4), (64, 16), (25, 12)]
         for kind in ("gaussian", "1/i", "rank one")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("d", "r", "kind"), CASES)
def test_the_fast_direction_is_certified_and_its_gap_bounds_the_true_shortfall(dtype, d, r, kind):
    """Square, near-square and r << d frames; Gaussian, 1/i and rank-one momenta: every frame is certified at the
    dtype's default tolerance within the default cap, the reported gap is at least the true one (against the SVD
    reference in float64), and the direction is feasible."""
    w = _frames(4, d, r, seed=d + r)
    m = _momentum(w, kind, seed=d * r)
    _, opt = muon_direction_reference(m, w)
    solve = muon_direction(m.to(dtype), w.to(dtype))
    a = solve.direction.double()
    true_gap = opt.flatten() - _value(m, a)
    assert bool(solve.certified.all())
    assert (solve.gap.flatten().double() / solve.bound.flatten().double()).max() <= DEFAULT_DIRECTION_TOL[dtype]
    assert (true_gap / opt.flatten()).max() <= (solve.gap.flatten().double() / opt.flatten()).max() + ROUNDING[dtype]
    assert (w.mT @ a + a.mT @ w).abs().max() < FEASIBLE_TOL[dtype]
    assert (torch.linalg.matrix_norm(a, ord=2) - 1).max() < FEASIBLE_TOL[dtype]


@pytest.mark.parametrize(("d", "r"), [(10, 9), (64, 16)])
def test_companion_an_unconverged_solve_is_not_certified_and_its_gap_still_bounds_the_shortfall(d, r):
    """Capped at 3 iterations the solve is far from optimal: no frame is certified, and the gap it reports is
    still an upper bound on the true shortfall (the bound does not assume convergence)."""
    w = _frames(4, d, r, seed=d + r)
    m = _momentum(w, "1/i", seed=d * r)
    _, opt = muon_direction_reference(m, w)
    solve = muon_direction(m, w, max_steps=3)
    true_gap = opt.flatten() - _value(m, solve.direction)
    assert solve.steps == 3 and not bool(solve.certified.any())
    assert (true_gap / opt.flatten()).min() > 1e-3  # genuinely short
    assert bool((solve.gap.flatten() >= true_gap - ROUNDING[torch.float64] * opt.flatten()).all())


@pytest.mark.parametrize(("d", "r"), [(8, 3), (32, 8), (9, 9), (10, 9), (12, 11)])
def test_fast_direction_equals_the_svd_reference(d, r):
    w = _frames(4, d, r, seed=2)
    m = torch.randn(4, d, r, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # not tangent
    ref, _ = muon_direction_reference(m, w)
    assert (muon_direction(m, w).direction - ref).abs().max() < DIRECTION_TOL


def test_companion_a_capped_fast_direction_differs_from_the_reference():
    w = _frames(4, 32, 8, seed=2)
    m = _tangent(w, seed=3)
    ref, _ = muon_direction_reference(m, w)
    assert (muon_direction(m, w, max_steps=4).direction - ref).abs().max() > 1e3 * DIRECTION_TOL


@pytest.mark.parametrize(("d", "r"), [(10, 4), (9, 9)])
def test_direction_at_zero_momentum_is_zero_certified_and_finite(d, r):
    w = _frames(2, d, r)
    solve = muon_direction(torch.zeros_like(w), w)
    assert solve.direction.abs().max() == 0 and torch.isfinite(solve.gap).all() and bool(solve.certified.all())


def _skew_with_singular_values(values, seed=0, dtype=torch.float64):
    """A skew matrix of order 2 len(values) with the given singular values (each twice), randomly rotated."""
    k = 2 * len(values)
    q = torch.linalg.qr(torch.randn(k, k, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))).Q
    block = torch.zeros(k, k, dtype=torch.float64)
    for i, s in enumerate(values):
        block[2 * i, 2 * i + 1], block[2 * i + 1, 2 * i] = -s, s
    return (q @ block @ q.T).to(dtype)[None]


def _spectra(half):
    """Spectra with values at every scale: down to 1e-20 of the largest (across the rounds' floors), exact zeros,
    a cluster just below one round's floor."""
    return [np.logspace(0, -20, half), np.r_[1.0, np.zeros(half - 1)], np.r_[1.0, np.full(half - 1, 0.5e-4)],
            np.r_[1.0, np.full(half - 1, 0.5 * ROUND_FLOOR ** 2)],
            np.r_[np.ones(half // 2), np.zeros(half - half // 2)]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("half", [4, 12, 64])
def test_the_bound_derived_count_certifies_every_spectrum_without_reading_the_host(dtype, half, monkeypatch):
    """The capturable path (synchronize=False) runs certified_direction_steps iterations, reads nothing on the
    host (a tensor read raises here), and certifies every spectrum, however its values are spread."""
    tol = DEFAULT_DIRECTION_TOL[dtype]
    count = certified_direction_steps(tol, dtype, 2 * half)
    assert count % direction_round_length(dtype) == 0
    cs = [_skew_with_singular_values(values, seed=j, dtype=dtype) for j, values in enumerate(_spectra(half))]

    def refuse(*args):
        raise AssertionError("a host read in the capturable solve")

    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    results = [_msign_skew(c, tol=tol, extra=None, max_steps=count, synchronize=False) for c in cs]
    monkeypatch.undo()
    for omega, t1, bound, done, steps in results:
        assert steps == count and bool(done.all())
        assert float(bound.squeeze()) <= tol * float((t1 + bound).squeeze())
        assert float(torch.linalg.matrix_norm(omega.double(), ord=2).max()) <= 1 + FEASIBLE_TOL[dtype]


def test_companion_one_round_fewer_leaves_a_spectrum_uncertified_and_the_eager_path_reads_the_host(monkeypatch):
    """float32: 63 of 64 singular values at 3e-5 of the largest are below one round's floor; one round fewer
    than the bound-derived count leaves them unresolved and the frame uncertified. And the eager path
    (synchronize=True) does read the host: the check above can fail."""
    tol, dtype = DEFAULT_DIRECTION_TOL[torch.float32], torch.float32
    c = _skew_with_singular_values(np.r_[1.0, np.full(63, 3e-5)], dtype=dtype)
    count = certified_direction_steps(tol, dtype, 128)
    _, _, _, done, _ = _msign_skew(c, tol=tol, extra=None, max_steps=count - direction_round_length(dtype),
                                   synchronize=False)
    assert not bool(done.all())
    _, _, _, done, _ = _msign_skew(c, tol=tol, extra=None, max_steps=count, synchronize=False)
    assert bool(done.all())

    def refuse(*args):
        raise AssertionError("a host read")

    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    with pytest.raises(AssertionError, match="a host read"):
        _msign_skew(c, tol=tol, extra=None, max_steps=count, synchronize=True)


# ------------------------------------------------------------------------------- the cap is reported
def test_a_cap_set_too_low_is_counted_and_warned_once_per_parameter():
    """direction_steps=2 cannot certify: each step counts the parameter's frames in state['uncertified_frames'],
    and the eager step warns once per parameter, naming it and the gap reached."""
    wa = geoopt.ManifoldParameter(_frames(3, 12, 4), manifold=PolarStiefel())
    wb = geoopt.ManifoldParameter(_frames(2, 10, 9, seed=1), manifold=PolarStiefel())
    opt = StiefelMuon([("attn.q", wa), ("attn.k", wb)], lr=0.01, direction_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(2):
            for p in (wa, wb):
                p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(seed))
            opt.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert "'attn.q'" in messages[0] and "3 of 3 frames" in messages[0] and "direction_steps=2" in messages[0]
    assert "'attn.k'" in messages[1] and "relative duality gap" in messages[1] and "direction_tol=1e-07" in messages[1]
    assert int(opt.state[wa]["uncertified_frames"]) == 6 and int(opt.state[wb]["uncertified_frames"]) == 4


def test_companion_at_the_default_cap_nothing_is_counted_or_warned():
    wa = geoopt.ManifoldParameter(_frames(3, 12, 4), manifold=PolarStiefel())
    wb = geoopt.ManifoldParameter(_frames(2, 10, 9, seed=1), manifold=PolarStiefel())
    opt = StiefelMuon([("attn.q", wa), ("attn.k", wb)], lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for seed in range(2):
            for p in (wa, wb):
                p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(seed))
            opt.step()
    assert int(opt.state[wa]["uncertified_frames"]) == 0 and int(opt.state[wb]["uncertified_frames"]) == 0


def test_the_capturable_step_counts_uncertified_frames_on_the_device_without_a_warning():
    w = geoopt.ManifoldParameter(_frames(3, 12, 4), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.01, direction_steps=2, capturable=True)
    w.grad = torch.randn(w.shape, dtype=w.dtype, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt.step()
    assert int(opt.state[w]["uncertified_frames"]) == 3


def test_the_options_of_the_earlier_solver_are_refused_and_an_old_checkpoint_loads_with_a_warning():
    """dual_steps / ns_steps were removed (issue 56; no alias before the first release): the constructor and
    add_param_group refuse them before anything changes, naming direction_tol and direction_steps; a state dict
    saved before issue 56 loads with a warning that they are dropped. Companion: without them nothing is said."""
    w0 = _frames(2, 12, 4)
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    with pytest.raises(ValueError, match=r"StiefelMuon: dual_steps=10, ns_steps=8: .* use direction_tol"):
        StiefelMuon([w], lr=0.05, dual_steps=10, ns_steps=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = StiefelMuon([w], lr=0.05)  # companion: no warning
    w.grad = torch.randn(2, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0].update(dual_steps=10, ns_steps=8)
    saved["param_groups"][0].pop("direction_tol")
    fresh = StiefelMuon([geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())], lr=0.05)
    with pytest.warns(UserWarning, match=r"StiefelMuon.load_state_dict: dual_steps=10, ns_steps=8: .* dropped"):
        fresh.load_state_dict(saved)
    group = fresh.param_groups[0]
    assert "dual_steps" not in group and group["direction_tol"] is None and group["direction_steps"] is None
    before = len(fresh.param_groups)
    with pytest.raises(ValueError, match="StiefelMuon.add_param_group: dual_steps=0: .* direction_steps"):
        fresh.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))],
                               "dual_steps": 0})
    assert len(fresh.param_groups) == before  # nothing added


def test_companion_lr_adjustment_depends_on_the_orientation():
    """torch reads (rows, columns): a frame (d, r) is not a (r, d) matrix under "original"."""
    from torch.optim._muon import _adjust_lr

    assert muon_lr_scale("original", 64, 16) != pytest.approx(_adjust_lr(1.0, "original", torch.Size((16, 64))))


# ------------------------------------------------------------------------------- the optimizer
def _run(nesterov=True, steps=20, lr=0.05, fn="match_rms_adamw"):
    w0 = _frames(3, 12, 4)
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=lr, nesterov=nesterov, adjust_lr_fn=fn)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(3, 12, 4, dtype=torch.float64, generator=gen) for _ in range(steps)]
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w0, w, opt, grads


def _run_reference(w0, grads, nesterov=True, lr=0.05, fn="match_rms_adamw"):
    w, buf = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        w, buf, _ = stiefel_muon_update(w, g, buf, lr=lr * muon_lr_scale(fn, 12, 4), momentum=0.95,
                                        nesterov=nesterov)
    return w, buf


@pytest.mark.parametrize("fn", ["match_rms_adamw", "original"])
def test_optimizer_follows_the_readable_update_for_20_steps(fn):
    w0, w, opt, grads = _run(fn=fn)
    ref_w, ref_buf = _run_reference(w0, grads, fn=fn)
    assert (w - ref_w).abs().max() < MUON_STEP_TOL
    assert (opt.state[w]["momentum_buffer"] - ref_buf).abs().max() < MUON_STEP_TOL
    assert (w - w0).abs().max() > 0.1  # it moved
    assert orthonormality_error(w) < ORTHO_TOL_F64


def test_companion_without_nesterov_the_trajectory_differs():
    w0, w, _, grads = _run(nesterov=True)
    ref_w, _ = _run_reference(w0, grads, nesterov=False)
    assert (w - ref_w).abs().max() > 1e3 * MUON_STEP_TOL


def test_step_has_the_spectral_size_of_the_adjusted_lr():
    """One step from zero momentum: W+ = polar(W - eta A) with ||A||_2 = 1, so ||W+ - W||_2 is eta to first
    order; the companion: under the other adjust_lr_fn it is not."""
    w0 = _frames(1, 64, 16)
    for fn, other in (("match_rms_adamw", "original"), ("original", "match_rms_adamw")):
        w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
        opt = StiefelMuon([w], lr=1e-4, adjust_lr_fn=fn)
        w.grad = torch.randn(1, 64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        opt.step()
        moved = float(torch.linalg.matrix_norm(w.detach() - w0, ord=2))
        assert moved == pytest.approx(1e-4 * muon_lr_scale(fn, 64, 16), rel=1e-3)
        assert moved != pytest.approx(1e-4 * muon_lr_scale(other, 64, 16), rel=1e-2)


def test_float32_frames_stay_on_the_manifold_for_200_steps():
    w = geoopt.ManifoldParameter(_frames(4, 32, 8, dtype=torch.float32), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.02)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        w.grad = torch.randn(w.shape, generator=gen)
        opt.step()
    assert orthonormality_error(w) < ORTHO_TOL_F32
    assert torch.isfinite(opt.state[w]["dual_gap"]).all()


def test_weight_decay_changes_no_frame_and_decays_euclidean_parameters():
    w0 = _frames(2, 10, 4)
    results = {}
    for wd in (0.0, 0.5):
        w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
        b = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        opt = StiefelMuon([w, b], lr=0.1, weight_decay=wd)
        w.grad = torch.ones_like(w)
        b.grad = torch.zeros_like(b)
        opt.step()
        results[wd] = (w.detach().clone(), b.detach().clone())
    assert torch.equal(results[0.0][0], results[0.5][0])
    assert not torch.equal(results[0.0][1], results[0.5][1])  # companion: decay does act on the bias


def test_non_finite_gradient_skips_that_frame_only():
    w0 = _frames(3, 10, 4)
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.1)
    g = torch.randn(3, 10, 4, dtype=torch.float64)
    g[1, 0, 0] = math.nan
    w.grad = g
    opt.step()
    assert torch.equal(w[1], w0[1]) and not torch.equal(w[0], w0[0])
    assert int(opt.state[w]["skipped_frames"]) == 1
    assert torch.isfinite(opt.state[w]["momentum_buffer"]).all()


def test_lr_zero_leaves_frames_bit_identical():
    w0 = _frames(2, 10, 4)
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.0)
    w.grad = torch.randn_like(w)
    opt.step()
    assert torch.equal(w.detach(), w0)
    assert opt.state[w]["momentum_buffer"].abs().max() > 0  # companion: the momentum did update


@pytest.mark.parametrize(("option", "value"), [("momentum", 1.0), ("nesterov", 1), ("direction_tol", 0.0),
                                               ("direction_tol", 1.0), ("direction_steps", 0),
                                               ("direction_steps", 2.5), ("adjust_lr_fn", "spectral"), ("lr", -1.0)])
def test_bad_options_are_refused_naming_the_option(option, value):
    w = geoopt.ManifoldParameter(_frames(1, 6, 2), manifold=PolarStiefel())
    with pytest.raises(ValueError, match=f"StiefelMuon: {option}="):
        StiefelMuon([w], **{option: value})
    opt = StiefelMuon([w], lr=0.1)
    opt.param_groups[0][option] = value  # rewritten later (e.g. by a scheduler): refused at the step
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=f"StiefelMuon: {option}="):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state[w]


def test_state_dict_resume_continues_the_same_trajectory():
    w0 = _frames(2, 12, 4)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(2, 12, 4, dtype=torch.float64, generator=gen) for _ in range(6)]
    w = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.05)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    w2 = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt2 = StiefelMuon([w2], lr=0.05)
    for g in grads[:3]:
        w2.grad = g.clone()
        opt2.step()
    saved = opt2.state_dict()
    w3 = geoopt.ManifoldParameter(w2.detach().clone(), manifold=PolarStiefel())
    opt3 = StiefelMuon([w3], lr=0.05)
    opt3.load_state_dict(saved)
    for g in grads[3:]:
        w3.grad = g.clone()
        opt3.step()
    assert torch.equal(w3.detach(), w.detach())
    # companion: resuming without the momentum gives another trajectory
    w4 = geoopt.ManifoldParameter(w2.detach().clone(), manifold=PolarStiefel())
    opt4 = StiefelMuon([w4], lr=0.05)
    for g in grads[3:]:
        w4.grad = g.clone()
        opt4.step()
    assert not torch.allclose(w4.detach(), w.detach(), atol=1e-6)


def test_state_of_the_wrong_shape_is_refused_at_load():
    w = geoopt.ManifoldParameter(_frames(2, 12, 4), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.05)
    w.grad = torch.ones_like(w)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["momentum_buffer"] = torch.zeros(2, 4, 12, dtype=torch.float64)
    before = opt.state[w]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="StiefelMuon.load_state_dict: .*momentum_buffer"):
        opt.load_state_dict(saved)
    assert torch.equal(opt.state[w]["momentum_buffer"], before)


def test_a_scheduler_cycling_momentum_is_refused_since_it_would_cycle_betas_not_the_frames_momentum():
    """OneCycleLR/CyclicLR with cycle_momentum=True cycle betas[0] of an optimizer whose defaults have 'betas';
    torch's Muon gets its momentum cycled, StiefelMuon's frames kept theirs at 0.95 without a word. Refused at the
    step, before anything changes; a group of Euclidean parameters only (whose AdamW reads betas[0]) steps."""
    w = geoopt.ManifoldParameter(_frames(2, 12, 4), manifold=PolarStiefel())
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    for make in (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10),
                 lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-3, 1e-2, step_size_up=2)):
        opt = StiefelMuon([{"params": [w]}, {"params": [b]}], lr=0.01)
        make(opt)
        w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
        before = w.detach().clone(), b.detach().clone()
        with pytest.raises(ValueError, match="StiefelMuon: parameter group 0 holds Stiefel frames.*cycle_momentum"
                                             "=False"):
            opt.step()
        assert torch.equal(w.detach(), before[0]) and torch.equal(b.detach(), before[1]) and not opt.state
        w.grad = None  # companion: the Euclidean group alone steps under the same scheduler
        opt.step()
        assert not torch.equal(b.detach(), before[1])
        b.grad = None


def test_companion_a_scheduler_without_cycle_momentum_steps_the_frames_with_their_momentum():
    w = geoopt.ManifoldParameter(_frames(2, 12, 4), manifold=PolarStiefel())
    opt = StiefelMuon([w], lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=False)
    before = w.detach().clone()
    for _ in range(3):
        w.grad = torch.ones_like(w)
        opt.step()
        sched.step()
    assert (w.detach() - before).abs().max() > 1e-3 and opt.param_groups[0]["momentum"] == 0.95


def test_a_torch_muon_state_dict_is_refused_at_load_naming_the_missing_options():
    """torch.optim.Muon's groups have no betas/amsgrad/maximize/foreach (the load stopped with a bare KeyError
    'betas'); its eps and ns_steps mean something else here. Refused before anything changes."""
    w = geoopt.ManifoldParameter(_frames(1, 12, 4)[0], manifold=PolarStiefel())  # torch's Muon takes 2-D only
    same = torch.nn.Parameter(w.detach().clone())
    theirs = torch.optim.Muon([same], lr=0.01)
    same.grad = torch.ones_like(same)
    theirs.step()
    w.grad = torch.ones_like(w)
    opt = StiefelMuon([w], lr=0.05)
    with pytest.raises(ValueError, match=r"StiefelMuon.load_state_dict: parameter group 0 of the state dict lacks "
                                         r"the options \['amsgrad', 'betas', 'foreach', 'maximize'\]"), \
            warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # its ns_steps is torch's, not the retired option
        opt.load_state_dict(theirs.state_dict())
    assert opt.param_groups[0]["lr"] == 0.05 and not opt.state
    # companion: StiefelMuon's own state dict, and one saved before the options StiefelMuon adds existed, load
    opt.step()
    saved = opt.state_dict()
    for key in ("direction_tol", "direction_steps", "master_weights", "stabilize"):
        del saved["param_groups"][0][key]
    StiefelMuon([w], lr=0.05).load_state_dict(saved)


# ------------------------------------------------------------------------- momenta with a decaying spectrum
#: Relative shortfall target on a 1/i spectrum (the default float32 tolerance)
SHORTFALL_TARGET = 1e-4
#: The fixed-count rule of 38fe98e on these spectra: measured 4-7 % short at 128 x 32 (float64)
FIXED_COUNT_DECAY_SHORTFALL_MIN = 1e-2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_default_solver_reaches_the_optimum_on_a_decaying_spectrum(dtype):
    """Singular values falling off as 1/i at 128 x 32 (the LM study's frames): the default solve is certified and
    within the target of the SVD reference, in float64 and float32."""
    w = _frames(3, 128, 32, seed=5)
    m = _momentum(w, "1/i", seed=6)
    _, opt = muon_direction_reference(m, w)
    solve = muon_direction(m.to(dtype), w.to(dtype))
    assert bool(solve.certified.all())
    assert (1 - _value(m, solve.direction.double()) / opt.flatten()).max() < SHORTFALL_TARGET


def test_companion_the_fixed_count_rule_falls_short_on_a_decaying_spectrum():
    """The rule of 38fe98e (dual_steps=10, ns_steps=8) is percents short there: the check above can fail."""
    w = _frames(3, 128, 32, seed=5)
    m = _momentum(w, "1/i", seed=6)
    _, opt = muon_direction_reference(m, w)
    assert (1 - _value(m, fixed_count_direction(m, w)) / opt.flatten()).max() > FIXED_COUNT_DECAY_SHORTFALL_MIN


def test_muon_direction_refuses_a_low_precision_or_mismatched_stack_naming_the_fix():
    w = _frames(2, 12, 4, dtype=torch.float32)
    m = _tangent(w)
    with pytest.raises(ValueError, match="muon_direction: .*cast bfloat16/float16 stacks to float32"):
        muon_direction(m.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="one shape and dtype"):
        muon_direction(m, w.double())
    assert bool(muon_direction(m, w).certified.all())  # companion: the float32 stack itself is solved
