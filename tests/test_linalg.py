"""Tests of the small linear-algebra helpers, in float64 against numpy/written-out references."""

import numpy as np
import pytest
import torch

from geoopt_stiefel_attention import _linalg

EXACT_TOL = 1e-12  # float64 agreement of two exact formulas
F32_TOL = 1e-6


def _frames(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*shape, dtype=dtype, generator=g))
    return q


def test_sym_is_symmetric_part():
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    s = _linalg.sym(a)
    assert torch.equal(s, s.transpose(-1, -2))
    np.testing.assert_allclose((s + (a - s)).numpy(), a.numpy(), atol=EXACT_TOL)
    skew = a - s
    assert torch.allclose(skew, -skew.transpose(-1, -2))


def test_proju_tangent_and_idempotent():
    w = _frames(4, 9, 3)
    u = torch.randn_like(w)
    xi = _linalg.proju(w, u)
    wt_xi = w.transpose(-1, -2) @ xi
    assert (wt_xi + wt_xi.transpose(-1, -2)).abs().max() < EXACT_TOL
    assert (xi - _linalg.proju(w, xi)).abs().max() < EXACT_TOL
    # the normal component is W times a symmetric matrix
    s = w.transpose(-1, -2) @ (u - xi)
    assert (s - s.transpose(-1, -2)).abs().max() < EXACT_TOL
    assert (w @ s - (u - xi)).abs().max() < EXACT_TOL


def test_proju_of_point_is_zero_and_fails_off_manifold():
    w = _frames(2, 8, 4)
    assert _linalg.proju(w, w).abs().max() < EXACT_TOL
    # companion: for a non-orthonormal matrix the 'decay direction' is not in the normal space
    a = 1.5 * w
    assert _linalg.proju(a, a).abs().max() > 0.1


@pytest.mark.parametrize(
    ("dtype", "radius"),
    [(torch.float32, 0.01), (torch.float32, 0.1), (torch.float32, 0.3),
     (torch.float64, 0.01), (torch.float64, 0.1), (torch.float64, 0.2)],
)
def test_series_inverse_sqrt_is_exact_within_its_bound(dtype, radius):
    order = _linalg.series_order(radius**2, dtype)
    assert order is not None
    # Gram matrices I + s^T s with ||s||_F = radius (the worst case the trust region allows)
    s = torch.randn(16, 20, 6, dtype=torch.float64)
    s = s * radius / s.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    gram = torch.eye(6, dtype=torch.float64) + s.transpose(-1, -2) @ s
    evals, evecs = np.linalg.eigh(gram.numpy())
    reference = (evecs * evals[..., None, :] ** -0.5) @ np.swapaxes(evecs, -1, -2)
    approx = _linalg.inv_sqrt_series(gram.to(dtype), order).double().numpy()
    tol = 8 * torch.finfo(dtype).eps
    assert np.abs(approx - reference).max() < tol


def test_series_of_too_low_order_is_not_exact():
    # companion: order 1 at radius 0.3 leaves an error far above rounding
    s = torch.randn(4, 20, 6, dtype=torch.float64)
    s = s * 0.3 / s.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    gram = torch.eye(6, dtype=torch.float64) + s.transpose(-1, -2) @ s
    exact = _linalg.inv_sqrt_spd(gram)
    assert (_linalg.inv_sqrt_series(gram, 1) - exact).abs().max() > 1e-4


def test_series_order_bounds():
    assert _linalg.series_order(0.01, torch.float32) == 3
    assert _linalg.series_order(0.6, torch.float32) is None
    assert _linalg.series_order(0.09, torch.float64) is None  # > 12 terms: callers fall back to eigh
    assert _linalg.series_order(0.01, torch.float64) > _linalg.series_order(0.01, torch.float32)


def _worst_case_grams(radius: float, r: int = 6, n: int = 8) -> torch.Tensor:
    """Gram matrices I + s^T s of a step with ||s||_2 = radius whose other singular values spread down to 0: the
    eigenvalue 1 (a column the step does not touch) is the slowest for Newton-Schulz, 1 + radius^2 the largest."""
    q = torch.linalg.qr(torch.randn(n, r, r, dtype=torch.float64)).Q
    sv = torch.linspace(0.0, radius, r, dtype=torch.float64).expand(n, r)
    return (q * (1.0 + sv.square()).unsqueeze(-2)) @ q.transpose(-1, -2)


def _reference_inv_sqrt(gram: torch.Tensor) -> np.ndarray:
    evals, evecs = np.linalg.eigh(gram.numpy())
    return (evecs * evals[..., None, :] ** -0.5) @ np.swapaxes(evecs, -1, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("radius", [0.0, 0.1, 1.0, 22.2])  # 22.2: 0.1 * sqrt(768 * 64), the default rule's radius
def test_newton_schulz_inverse_sqrt_is_exact_within_its_bound(dtype, radius):
    bound = radius**2 + 64 * torch.finfo(dtype).eps
    iterations = _linalg.newton_iterations(bound, dtype)
    assert iterations is not None
    gram = _worst_case_grams(radius)
    approx = _linalg.inv_sqrt_newton(gram.to(dtype), bound, iterations).double().numpy()
    reference = _reference_inv_sqrt(gram)
    assert np.abs(approx - reference).max() < 16 * torch.finfo(dtype).eps * (1.0 + radius**2) ** 0.5
    assert np.abs(approx - np.swapaxes(approx, -1, -2)).max() == 0.0  # symmetric, as the retraction assumes


#: Largest entrywise error accepted of a retraction against the float64 SVD polar factor, in units of roundoff.
RETRACTION_ROUNDOFF_UNITS = 16


def _worst_case_step(delta: float, d: int = 40, r: int = 6, n: int = 8, seed: int = 0):
    """Frames W (n, d, r) and tangent steps s with ||s||_2 = ||s||_F = delta (rank one, normal to W's columns): the
    steps the Frobenius cap allows whose Gram spectrum [1, 1 + delta^2] is widest, and an untouched eigenvalue 1."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, d, r + 1, dtype=torch.float64, generator=gen)).Q
    w, u = q[..., :r], q[..., r:]
    v = torch.nn.functional.normalize(torch.randn(n, 1, r, dtype=torch.float64, generator=gen), dim=-1)
    return w, delta * u @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_default_radius_retraction_is_exact_at_its_worst_case_and_not_with_one_iteration_fewer(dtype):
    """Issue 40: under the default rule the trust radius is Delta = 1 (frame units), so the capturable step plans
    its retraction for ||s||_2 <= 1 with matrix products only. At the worst step that radius allows, the planned
    polar factor of W - s equals the SVD's to rounding, in float32 and float64; one Newton-Schulz iteration fewer
    does not (the count is the fewest that reach rounding)."""
    delta = _linalg.AUTO_TRUST_REGION["match_rms_adamw"]
    bound = delta**2 + 64 * torch.finfo(dtype).eps
    plan = _linalg.retraction_plan(bound, dtype)
    assert plan is not None and plan[0] == "newton"
    w, s = _worst_case_step(delta)
    assert float(torch.linalg.matrix_norm(s, ord=2).max()) == pytest.approx(delta, rel=1e-12)
    reference = _linalg.polar_svd(w - s).numpy()  # float64 SVD, an independent route to the polar factor
    y = (w - s).to(dtype)
    gram = y.mT @ y
    tol = RETRACTION_ROUNDOFF_UNITS * torch.finfo(dtype).eps
    exact = (y @ _linalg.inv_sqrt_planned(gram, bound, plan)).double().numpy()
    assert np.abs(exact - reference).max() < tol
    short = (y @ _linalg.inv_sqrt_newton(gram, bound, plan[1] - 1)).double().numpy()
    assert np.abs(short - reference).max() > tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_retraction_plan_takes_the_cheaper_exact_method(dtype):
    """Small radii take the series (order - 1 products), larger ones Newton-Schulz (3K - 1 products), each the
    cheaper of the two; an unbounded step has no plan (callers take eigh)."""
    eps = 64 * torch.finfo(dtype).eps
    small = _linalg.retraction_plan(0.01**2 + eps, dtype)
    large = _linalg.retraction_plan(1.0 + eps, dtype)
    assert small[0] == "series" and large[0] == "newton"
    for radius_sq in (0.01**2 + eps, 0.3**2 + eps, 1.0 + eps):
        method, count = _linalg.retraction_plan(radius_sq, dtype)
        order, iterations = _linalg.series_order(radius_sq, dtype), _linalg.newton_iterations(radius_sq, dtype)
        cost = count - 1 if method == "series" else 3 * count - 1
        assert cost <= min(c for c in ((order or 99) - 1, 3 * iterations - 1))
    assert _linalg.retraction_plan(float("inf"), dtype) is None  # companion: no bound, no plan
    with pytest.raises(ValueError, match="plan="):
        _linalg.inv_sqrt_planned(torch.eye(2, dtype=dtype), 0.0, ("eigh", 1))


def test_newton_schulz_with_fewer_iterations_than_its_count_is_not_exact():
    # companion: three iterations short of the count at the default rule's radius leave an error far above rounding
    bound = 22.2**2 + 64 * torch.finfo(torch.float64).eps
    iterations = _linalg.newton_iterations(bound, torch.float64)
    gram = _worst_case_grams(22.2)
    short = _linalg.inv_sqrt_newton(gram, bound, iterations - 3).numpy()
    assert np.abs(short - _reference_inv_sqrt(gram)).max() > 1e-6
    with pytest.raises(ValueError, match="iterations=0"):
        _linalg.inv_sqrt_newton(gram, bound, 0)


def test_newton_iterations_bounds():
    assert _linalg.newton_iterations(0.0, torch.float32) == 1
    assert _linalg.newton_iterations(491.0, torch.float32) < _linalg.newton_iterations(491.0, torch.float64) <= 16
    assert _linalg.newton_iterations(float("inf"), torch.float32) is None
    assert _linalg.newton_iterations(float("nan"), torch.float32) is None
    assert _linalg.newton_iterations(1e14, torch.float64) is None  # > 40 iterations: callers fall back to eigh


CHECKED_SCALES = [0.0, 0.1, 1.0, 22.2, 99.0]  # ||s||_2 of the step; 99: the reach CHECKED_NEWTON_CONDITION names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("radius", CHECKED_SCALES)
def test_checked_newton_schulz_is_exact_without_a_bound_and_needs_no_eigendecomposition(monkeypatch, dtype, radius):
    eigh_calls = []
    real = _linalg.inv_sqrt_spd
    monkeypatch.setattr(_linalg, "inv_sqrt_spd", lambda a: eigh_calls.append(a.shape) or real(a))
    gram = _worst_case_grams(radius, r=16)
    approx = _linalg.inv_sqrt_checked(gram.to(dtype)).double().numpy()
    # both this and the eigh reference are accurate to a few eps * sqrt(condition) entrywise (entries are <= 1)
    assert np.abs(approx - _reference_inv_sqrt(gram)).max() < 32 * torch.finfo(dtype).eps * (1.0 + radius**2) ** 0.5
    assert np.abs(approx - np.swapaxes(approx, -1, -2)).max() == 0.0
    assert not eigh_calls


def test_checked_newton_schulz_hands_what_it_has_not_resolved_to_the_eigendecomposition(monkeypatch):
    # companion: a stack with a Gram matrix beyond the iteration's reach (condition 1e12) and a singular one among
    # well-conditioned ones: Newton-Schulz alone is far off on the first, and exactly those two go to eigh
    eigh_calls = []
    real = _linalg.inv_sqrt_spd
    monkeypatch.setattr(_linalg, "inv_sqrt_spd", lambda a: eigh_calls.append(a.clone()) or real(a))
    gram = _worst_case_grams(1.0, r=6, n=6)
    q = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64)).Q
    gram[1] = (q * torch.logspace(0, 12, 6, dtype=torch.float64)) @ q.T
    gram[3] = torch.zeros(6, 6, dtype=torch.float64)
    iterations = _linalg.newton_iterations(_linalg.CHECKED_NEWTON_CONDITION - 1.0, torch.float64)
    scale = float(torch.linalg.matrix_norm(gram[1]))
    newton_only = _linalg.inv_sqrt_newton(gram[1:2], scale - 1.0, iterations)[0].numpy()
    reference = _reference_inv_sqrt(gram[1:2])[0]
    assert np.abs(newton_only - reference).max() > 1e-3 * np.abs(reference).max()
    checked = _linalg.inv_sqrt_checked(gram)
    assert len(eigh_calls) == 1
    sent = eigh_calls[0]
    assert sent.shape == (2, 6, 6) and torch.equal(sent[0], gram[1]) and torch.equal(sent[1], gram[3])
    # the eigendecomposition's answers (the clamped one for the singular matrix), as on the CPU
    for k in (1, 3):
        torch.testing.assert_close(checked[k], real(gram[k:k + 1])[0], rtol=EXACT_TOL, atol=0.0)
    keep = [0, 2, 4, 5]
    assert np.abs(checked[keep].numpy() - _reference_inv_sqrt(gram[keep])).max() < 16 * torch.finfo(torch.float64).eps * 2**0.5
    # a non-finite matrix is not resolved either: it reaches eigh, which refuses it as it does on the CPU
    gram[4, 0, 0] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError):
        _linalg.inv_sqrt_checked(gram)
    assert torch.isnan(eigh_calls[-1]).any() and eigh_calls[-1].shape == (3, 6, 6)


def test_checked_newton_schulz_edge_cases(monkeypatch):
    # bfloat16 computes in float32 (in bf16 the residual check 8 r u would be >= 1 at r >= 32 and accept anything)
    gram = _worst_case_grams(1.0, r=64, n=2)
    gram[1] = 0.0  # singular: must be sent to eigh, as in float32
    approx = _linalg.inv_sqrt_checked(gram.to(torch.bfloat16))
    assert approx.dtype == torch.bfloat16
    expected = _linalg.inv_sqrt_spd(gram.float())
    assert torch.equal(approx[1], expected[1].to(torch.bfloat16))
    assert (approx[0].double() - torch.from_numpy(_reference_inv_sqrt(gram[:1]))[0]).abs().max() < 2e-2
    # empty stacks and zero-width frames keep their shapes
    for shape in [(0, 5, 5), (3, 0, 0), (2, 0, 4, 4)]:
        assert _linalg.inv_sqrt_checked(torch.zeros(shape)).shape == shape
    # meta tensors (shapes only) take eigh: the checked path would read values
    monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset())
    y = torch.empty(2, 7, 3, device="meta")
    assert _linalg.polar(y).shape == (2, 7, 3) and _linalg.takes_eigh(y)
    assert not _linalg.takes_eigh(torch.empty(1))  # companion: the CPU without its exemption does not


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polar_off_the_eigh_devices_takes_checked_newton_schulz_and_matches_the_svd(monkeypatch, dtype):
    """Run here by lifting the CPU's exemption: the polar factor of a moved frame (a step of norm 5, beyond any
    series) must be the SVD's, through inv_sqrt_checked; with the exemption back, the CPU keeps eigh."""
    calls = []
    real = _linalg.inv_sqrt_checked
    monkeypatch.setattr(_linalg, "inv_sqrt_checked", lambda a: calls.append(a.shape) or real(a))
    w = _frames(3, 40, 8)
    y = w - _linalg.proju(w, 5.0 * torch.randn_like(w) / 40**0.5)
    u, _, vh = np.linalg.svd(y.numpy(), full_matrices=False)
    monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset())
    polar = _linalg.polar(y.to(dtype)).double().numpy()
    assert calls == [(3, 8, 8)]
    assert np.abs(polar - u @ vh).max() < 64 * torch.finfo(dtype).eps
    _linalg.polar(y.to(dtype), synchronize=False)  # a capturable caller: eigh, no host read
    assert len(calls) == 1
    monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset({"cpu"}))
    _linalg.polar(y.to(dtype))
    assert len(calls) == 1


@pytest.mark.parametrize("order", [None, 8])
def test_polar_matches_svd_polar_factor(order):
    w = _frames(3, 12, 5)
    s = _linalg.proju(w, 0.02 * torch.randn_like(w))
    y = w - s
    u, _, vh = np.linalg.svd(y.numpy(), full_matrices=False)
    reference = u @ vh
    assert np.abs(_linalg.polar(y, order=order).numpy() - reference).max() < EXACT_TOL
    assert np.abs(_linalg.polar_svd(y).numpy() - reference).max() < EXACT_TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the accelerators' retraction)")
def test_polar_on_cuda_takes_checked_newton_schulz_and_matches_the_svd(monkeypatch):
    calls = []
    real = _linalg.inv_sqrt_checked
    monkeypatch.setattr(_linalg, "inv_sqrt_checked", lambda a: calls.append(a.device.type) or real(a))
    w = _frames(6, 64, 16)
    y = w - _linalg.proju(w, 5.0 * torch.randn_like(w) / 8.0)
    u, _, vh = np.linalg.svd(y.numpy(), full_matrices=False)
    polar = _linalg.polar(y.cuda()).cpu().numpy()
    assert calls == ["cuda"] and np.abs(polar - u @ vh).max() < 64 * torch.finfo(torch.float64).eps


def test_cap_step_caps_each_frame_independently():
    s = torch.randn(5, 7, 3, dtype=torch.float64)
    s[0] *= 1e-3
    s[1] = 0.0
    capped = _linalg.cap_step(s, 0.1)
    norms = capped.square().sum(dim=(-2, -1)).sqrt()
    original = s.square().sum(dim=(-2, -1)).sqrt()
    for k in range(5):
        expected = min(float(original[k]), 0.1)
        assert abs(float(norms[k]) - expected) < EXACT_TOL
    # direction preserved
    assert torch.allclose(capped[2] / norms[2], s[2] / original[2], atol=EXACT_TOL)
    assert torch.equal(_linalg.cap_step(s, None), s)


def test_orthonormality_error():
    w = _frames(2, 6, 3)
    assert float(_linalg.orthonormality_error(w)) < EXACT_TOL
    assert abs(float(_linalg.orthonormality_error(1.1 * w)) - 0.21) < 1e-12
