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


@pytest.mark.parametrize("order", [None, 8])
def test_polar_matches_svd_polar_factor(order):
    w = _frames(3, 12, 5)
    s = _linalg.proju(w, 0.02 * torch.randn_like(w))
    y = w - s
    u, _, vh = np.linalg.svd(y.numpy(), full_matrices=False)
    reference = u @ vh
    assert np.abs(_linalg.polar(y, order=order).numpy() - reference).max() < EXACT_TOL
    assert np.abs(_linalg.polar_svd(y).numpy() - reference).max() < EXACT_TOL


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
