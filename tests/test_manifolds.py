"""PolarStiefel: geoopt's manifold contract (as geoopt's own test_manifold_basic checks it), in float64."""

import copy
import pickle
import re
import warnings

import geoopt
import numpy as np
import pytest
import torch

from geoopt_stiefel_attention import PolarStiefel, is_frame

TOL = 1e-10  # float64 contract checks
OPTIMUM_TOL = 1e-8  # a converged SGD run, float64
ADAM_OPTIMUM_TOL = 1e-4  # Adam at a fixed lr, float64
SHAPES = [(10, 3), (6, 6), (4, 12, 5), (2, 3, 8, 2)]


@pytest.fixture
def st():
    return PolarStiefel()


def _point_and_tangents(st, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = st.random(*shape, dtype=torch.float64, generator=g)
    u = st.proju(x, torch.randn(shape, dtype=torch.float64, generator=g))
    v = st.proju(x, torch.randn(shape, dtype=torch.float64, generator=g))
    return x, u, v


@pytest.mark.parametrize("shape", SHAPES)
def test_random_point_is_on_manifold(st, shape):
    x, _, _ = _point_and_tangents(st, shape)
    assert isinstance(x, geoopt.ManifoldTensor) and x.manifold is st
    st.assert_check_point_on_manifold(x, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_projection_idempotent_and_tangent(st, shape):
    x, u, _ = _point_and_tangents(st, shape)
    st.assert_check_vector_on_tangent(x, u, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(st.proju(x, u).numpy(), u.numpy(), atol=TOL)
    np.testing.assert_allclose(st.egrad2rgrad(x, u).numpy(), u.numpy(), atol=TOL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("path", ["eigh", "accelerator"])
def test_retraction_is_polar_factor_and_on_manifold(st, shape, path, monkeypatch):
    """Both retraction paths: the CPU's eigendecomposition, and the accelerators' checked Newton-Schulz (run here
    by lifting the CPU's exemption)."""
    from geoopt_stiefel_attention import _linalg

    if path == "accelerator":
        monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset())
    x, u, _ = _point_and_tangents(st, shape)
    y = st.retr(x, u)
    st.assert_check_point_on_manifold(y, atol=TOL, rtol=TOL)
    a, _, bh = np.linalg.svd((x + u).numpy(), full_matrices=False)  # independent reference: U V^T
    np.testing.assert_allclose(y.numpy(), a @ bh, atol=TOL)


def test_retraction_first_order_agreement(st):
    x, u, _ = _point_and_tangents(st, (12, 4))
    errs = [float((st.retr(x, t * u) - (x + t * u)).abs().max()) for t in (1e-1, 1e-2, 1e-3)]
    # second-order error: shrinking t by 10 shrinks the error by ~100
    assert errs[0] / errs[1] > 50 and errs[1] / errs[2] > 50


@pytest.mark.parametrize("shape", SHAPES)
def test_transp_and_retr_transp_consistent(st, shape):
    x, u, v = _point_and_tangents(st, shape)
    y, v_new = st.retr_transp(x, u, v)
    np.testing.assert_allclose(y.numpy(), st.retr(x, u).numpy(), atol=TOL)
    np.testing.assert_allclose(v_new.numpy(), st.transp(x, y, v).numpy(), atol=TOL)
    st.assert_check_vector_on_tangent(y, v_new, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_expmap_and_inner(st, shape):
    x, u, v = _point_and_tangents(st, shape)
    st.assert_check_point_on_manifold(st.expmap(x, u), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(st.inner(x, u, v).numpy(), (u * v).sum(dim=(-2, -1)).numpy(), atol=TOL)
    assert (st.inner(x, u) > 0).all()


def test_projx_is_closest_frame(st):
    a = torch.randn(3, 9, 4, dtype=torch.float64)
    p = st.projx(a)
    st.assert_check_point_on_manifold(p, atol=TOL, rtol=TOL)
    uu, _, vh = np.linalg.svd(a.numpy(), full_matrices=False)
    np.testing.assert_allclose(p.numpy(), uu @ vh, atol=TOL)


def test_origin(st):
    o = st.origin(2, 5, 3, dtype=torch.float64)
    st.assert_check_point_on_manifold(o)


def test_check_point_detects_off_manifold(st):
    x, u, _ = _point_and_tangents(st, (8, 3))
    ok, reason = st.check_point_on_manifold(x + 0.1 * u, explain=True)
    assert not ok and "X^T X" in reason
    assert not st.check_vector_on_tangent(x, x)  # the point itself is normal, not tangent


def test_rejects_r_greater_than_d_at_parameter_creation(st):
    with pytest.raises(ValueError, match="shape"):
        geoopt.ManifoldParameter(torch.randn(3, 5), manifold=st)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_retraction_computes_in_float32(st, dtype):
    x = st.random(4, 32, 8, dtype=torch.float32)
    u = st.proju(x, 0.05 * torch.randn_like(x))
    y = st.retr(x.to(dtype), u.to(dtype))
    assert y.dtype == dtype
    y32 = y.float()
    err = (y32.transpose(-1, -2) @ y32 - torch.eye(8)).abs().max()
    assert err < 3e-2  # a bf16-rounded orthonormal frame is ~1e-3..1e-2 off
    exact = st.retr(x, u)
    assert (y32 - exact).abs().max() < 2e-2


def test_retraction_corrects_previous_drift(st):
    """Forming the Gram of the actual W + Z removes rounding drift; assuming I + Z^T Z would not."""
    x, u, _ = _point_and_tangents(st, (16, 4))
    drifted = x * (1 + 1e-4)  # a point 2e-4 off the manifold
    y = st.retr(drifted, 0.01 * u)
    assert float((y.transpose(-1, -2) @ y - torch.eye(4, dtype=torch.float64)).abs().max()) < TOL
    # companion: the shortcut Gram I + Z^T Z keeps the drift
    z = 0.01 * u
    gram = torch.eye(4, dtype=torch.float64) + z.transpose(-1, -2) @ z
    evals, evecs = torch.linalg.eigh(gram)
    shortcut = (drifted + z) @ (evecs * evals.rsqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)
    assert float((shortcut.transpose(-1, -2) @ shortcut - torch.eye(4, dtype=torch.float64)).abs().max()) > 1e-4


def _rank_deficient_steps(x):
    """Non-tangent steps that make x + u rank-deficient: one column cancelled, every column cancelled (u = -x),
    and two columns mixed into one dimension (rank r - 1 with no column zero)."""
    one = torch.zeros_like(x)
    one[..., :, 0] = -x[..., :, 0]
    mixed = torch.zeros_like(x)
    mixed[..., :, 1] = x[..., :, 0] - x[..., :, 1]  # columns 0 and 1 of x + u are then equal
    return {"one column": one, "all columns": -x, "two columns equal": mixed}


@pytest.mark.parametrize("path", ["eigh", "accelerator"])
@pytest.mark.parametrize("case", ["one column", "all columns", "two columns equal"])
def test_retraction_of_a_rank_deficient_moved_point_is_a_frame(st, path, case, monkeypatch):
    """A step that is not tangent can make W + U rank-deficient, where the Gram route has no inverse square root;
    retr still returns a frame (the SVD's U V^T, a polar factor: U V^T maps to a symmetric PSD Q^T (W + U)), as
    geoopt's QR retraction does. Only the deficient frame of a stack takes the SVD; the others are untouched."""
    from geoopt_stiefel_attention import _linalg

    if path == "accelerator":
        monkeypatch.setattr(_linalg, "EIGH_DEVICES", frozenset())
    x, u, _ = _point_and_tangents(st, (3, 8, 4))
    x, u = x.as_subclass(torch.Tensor), 0.1 * u
    u[1] = _rank_deficient_steps(x[1])[case]  # frame 1 deficient, frames 0 and 2 a tangent step
    assert torch.linalg.matrix_rank(x[1] + u[1]) < 4
    svd_calls = []
    real_svd = _linalg.polar_svd
    monkeypatch.setattr(_linalg, "polar_svd", lambda a: svd_calls.append(a.shape) or real_svd(a))
    y = st.retr(x, u)
    st.assert_check_point_on_manifold(y, atol=TOL, rtol=TOL)
    h = y[1].mT @ (x[1] + u[1])  # polar decomposition W + U = Q H: H symmetric positive semi-definite
    assert float((h - h.mT).abs().max()) < TOL and float(torch.linalg.eigvalsh(h).min()) > -TOL
    assert svd_calls == [(1, 8, 4)]  # the deficient frame only
    fast = _linalg.polar(x + u)
    assert torch.equal(y[0], fast[0]) and torch.equal(y[2], fast[2])
    # companion: the Gram route alone returns no frame for the deficient one
    assert not st.check_point_on_manifold(fast[1], atol=1e-3, rtol=1e-3)
    # companion: a tangent step never takes the SVD (the check is all the normal case pays)
    svd_calls.clear()
    st.retr(x, 0.1 * st.proju(x, torch.randn_like(x)))
    assert svd_calls == []


def test_retraction_of_a_rank_deficient_point_under_vmap_is_a_frame(st):
    """Under torch.vmap the check cannot be read on the host: the SVD of every frame is selected where it fails."""
    x, u, _ = _point_and_tangents(st, (3, 8, 4))
    x, u = x.as_subclass(torch.Tensor), 0.1 * u
    u[1] = -x[1]
    y = torch.vmap(st.retr)(x, u)
    st.assert_check_point_on_manifold(y, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(y[0].numpy(), st.retr(x[0], u[0]).numpy(), atol=TOL)
    # companion: the Gram route under vmap leaves the deficient frame off the manifold
    from geoopt_stiefel_attention import _linalg

    assert not st.check_point_on_manifold(torch.vmap(_linalg.polar)(x + u)[1], atol=1e-3, rtol=1e-3)


def test_is_frame():
    st = PolarStiefel()
    assert is_frame(geoopt.ManifoldParameter(st.random(5, 2), manifold=st))
    plain = geoopt.EuclideanStiefel()
    assert is_frame(geoopt.ManifoldParameter(plain.random(5, 2), manifold=plain))
    assert not is_frame(torch.nn.Parameter(torch.randn(5, 2)))
    assert not is_frame(geoopt.ManifoldParameter(torch.randn(5, 2)))


# ------------------------------------------------------------------ gradients through retr and projx (issue 41)
def test_gradcheck_through_retr_at_a_zero_step_and_projx_on_the_manifold(st):
    """The polar factor is smooth at every full-rank point; autograd through an eigh/SVD is not where eigenvalues
    repeat (a zero step, a point on the manifold). gradcheck compares with finite differences in float64."""
    x = st.random(2, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).as_subclass(torch.Tensor)
    u = torch.zeros_like(x)
    assert torch.autograd.gradcheck(lambda a, b: st.retr(a, b), (x.clone().requires_grad_(),
                                                              u.clone().requires_grad_()))
    assert torch.autograd.gradcheck(st.projx, (x.clone().requires_grad_(),))
    # and off those points too (a step, a matrix off the manifold)
    z = st.proju(x, torch.randn_like(x))
    assert torch.autograd.gradcheck(lambda a, b: st.retr(a, b), (x.clone().requires_grad_(),
                                                              (0.3 * z).requires_grad_()))
    assert torch.autograd.gradcheck(st.projx, ((x + 0.2 * torch.randn_like(x)).requires_grad_(),))


def test_companion_autograd_through_the_eigendecomposition_is_wrong_there(st):
    """What the analytic derivative replaces: plain autograd through polar/polar_svd at those points divides by
    eigenvalue differences of rounding size, giving non-finite or enormous gradients (the gradcheck above would
    fail on them); the library's retr and projx give the checked gradient."""
    from geoopt_stiefel_attention import _linalg

    x = st.random(2, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).as_subclass(torch.Tensor)
    g = torch.randn_like(x)
    y = x.clone().requires_grad_()
    (st.projx(y) * g).sum().backward()
    checked = y.grad
    assert torch.isfinite(checked).all()
    for fn in (_linalg.polar, _linalg.polar_svd):
        y = x.clone().requires_grad_()
        (fn(y) * g).sum().backward()
        assert not torch.isfinite(y.grad).all() or (y.grad - checked).abs().max() > 1e-3


def test_two_instances_in_one_module_are_both_listed_by_children():
    holder = torch.nn.Module()
    holder.a, holder.b = PolarStiefel(), PolarStiefel()
    assert len(list(holder.children())) == 2 and len(list(holder.modules())) == 3
    assert hash(holder.a) != hash(holder.b)
    # companion: the same instance twice is listed once (torch's dedup by identity still applies)
    holder.b = holder.a
    assert len(list(holder.children())) == 1


def test_instances_compare_equal_so_geoopt_accepts_a_point_of_another_instance():
    """Why they compare equal: geoopt's ManifoldParameter refuses a ManifoldTensor whose manifold != the given
    one; a different manifold type is still refused (the companion)."""
    a, b = PolarStiefel(), PolarStiefel()
    assert a == b and not (a != b)
    p = geoopt.ManifoldParameter(a.random(5, 2, dtype=torch.float64), manifold=b)
    assert p.manifold == b and isinstance(p.manifold, PolarStiefel)  # geoopt keeps the tensor's own instance
    with pytest.raises(ValueError, match="Manifolds do not match"):
        geoopt.ManifoldParameter(a.random(5, 2, dtype=torch.float64), manifold=geoopt.EuclideanStiefel())


# ------------------------------------------------------------------ bad input refused (silent in EuclideanStiefel)
def _methods_with_a_vector(st, x, u):
    """Every method taking a point and vectors, called with one vector ``u`` (the others tangent at ``x``)."""
    t = st.proju(x, torch.randn_like(x))
    return {
        "proju": lambda: st.proju(x, u),
        "egrad2rgrad": lambda: st.egrad2rgrad(x, u),
        "retr": lambda: st.retr(x, u),
        "expmap": lambda: st.expmap(x, u),
        "transp": lambda: st.transp(x, x, u),
        "retr_transp": lambda: st.retr_transp(x, t, u),
        "inner": lambda: st.inner(x, t, u),
        "norm": lambda: st.norm(x, u),
    }


@pytest.mark.parametrize("bad_shape", [(8, 1), (3,), (3, 8)])
@pytest.mark.parametrize("method", ["proju", "egrad2rgrad", "retr", "expmap", "transp", "retr_transp", "inner",
                                    "norm"])
def test_a_vector_of_another_frame_shape_is_refused(st, method, bad_shape):
    """A (d, 1) column or an (r,) row broadcast against an (d, r) point gave a full-shape result of the wrong vector
    (geoopt's EuclideanStiefel broadcasts); the last two dimensions must be the point's."""
    x, _, _ = _point_and_tangents(st, (8, 3))
    u = torch.randn(bad_shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"PolarStiefel\.\w+: \w+ has shape {re.escape(str(bad_shape))}"):
        _methods_with_a_vector(st, x, u)[method]()


def test_companion_leading_dimensions_still_broadcast_and_proju_matches_the_formula(st):
    """Only the frame dimensions must match: a stack of vectors at one point is accepted, and proju is the
    written-out U - W sym(W^T U)."""
    x, _, _ = _point_and_tangents(st, (8, 3))
    g = torch.randn(5, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    wtu = x.mT @ g
    reference = g - x @ (0.5 * (wtu + wtu.mT))
    np.testing.assert_allclose(st.proju(x, g).numpy(), reference.numpy(), atol=TOL)
    np.testing.assert_allclose(st.egrad2rgrad(x, g).numpy(), reference.numpy(), atol=TOL)
    xs = x.expand(5, 8, 3)  # geoopt's expmap concatenates x and u, so it needs x at every leading index
    for name, call in _methods_with_a_vector(st, xs, st.proju(x, g)).items():
        assert torch.isfinite(call() if name != "retr_transp" else call()[1]).all(), name


METHODS_WITH_A_VECTOR = ["proju", "egrad2rgrad", "retr", "expmap", "transp", "retr_transp", "inner", "norm"]
MIXED_DTYPES = [(torch.float32, torch.float64), (torch.float64, torch.float32), (torch.bfloat16, torch.float32),
                (torch.float32, torch.bfloat16)]
FLOAT32_TOL = 1e-5  # a float32 result against its float64 reference (d = 8, r = 3: a few units of roundoff)


@pytest.mark.parametrize(("point_dtype", "vector_dtype"), MIXED_DTYPES)
@pytest.mark.parametrize("method", METHODS_WITH_A_VECTOR)
def test_a_vector_of_another_dtype_than_the_point_is_refused(st, method, point_dtype, vector_dtype):
    """retr rounded a float64 step to a float32 point's dtype without a word (geoopt's EuclideanStiefel.retr
    promotes the result to float64 instead), and proju, transp, expmap stopped in a matrix product with torch's
    "expected scalar type Float but found Double"; every method now refuses mixed dtypes in one sentence naming
    both and the cast."""
    x64, _, _ = _point_and_tangents(st, (8, 3))
    x = x64.to(point_dtype)
    u = st.proju(x64, torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    u = u.to(vector_dtype)
    with pytest.raises(TypeError, match=rf"^PolarStiefel\.\w+: \w+ is {re.escape(str(vector_dtype))} but the point "
                                        rf"[xy] is {re.escape(str(point_dtype))}; .*e\.g\. \w+\.to\([xy]\.dtype\)\.$"):
        _methods_with_a_vector(st, x, u)[method]()


@pytest.mark.parametrize("method", METHODS_WITH_A_VECTOR)
def test_companion_a_vector_cast_to_the_points_dtype_gives_the_points_dtype_and_the_reference(st, method):
    """The fix the refusal names: with ``u`` cast to the float32 point's dtype every method runs, returns float32, and
    agrees with a float64 reference written out here (retr: the polar factor by SVD; transport and projection:
    U - Y sym(Y^T U); inner: the trace)."""
    x64, _, _ = _point_and_tangents(st, (8, 3))
    u64 = 0.1 * st.proju(x64, torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    x, u = x64.float(), u64.float()
    t = st.proju(x, torch.randn_like(x))  # the methods' other vector (retr_transp's step, inner's first vector)
    t64 = t.double()

    def project(y, v):
        yv = y.mT @ v
        return v - y @ (0.5 * (yv + yv.mT))

    def polar(y):
        left, _, right = torch.linalg.svd(y, full_matrices=False)
        return left @ right

    step64 = x64 + t64
    reference = {"proju": lambda: project(x64, u64), "egrad2rgrad": lambda: project(x64, u64),
                 "retr": lambda: polar(x64 + u64), "expmap": lambda: None, "transp": lambda: project(x64, u64),
                 "retr_transp": lambda: project(polar(step64), u64), "inner": lambda: (t64 * u64).sum(),
                 "norm": lambda: u64.square().sum().sqrt()}[method]()
    out = {"proju": lambda: st.proju(x, u), "egrad2rgrad": lambda: st.egrad2rgrad(x, u),
           "retr": lambda: st.retr(x, u), "expmap": lambda: st.expmap(x, u), "transp": lambda: st.transp(x, x, u),
           "retr_transp": lambda: st.retr_transp(x, t, u)[1], "inner": lambda: st.inner(x, t, u),
           "norm": lambda: st.norm(x, u)}[method]()
    assert out.dtype == torch.float32
    if method == "expmap":  # the exponential map: on the manifold, and first-order equal to the retraction
        out = out.double()
        assert float((out.mT @ out - torch.eye(3, dtype=torch.float64)).abs().max()) < FLOAT32_TOL
        reference = polar(x64 + u64)
        assert float((out - reference).abs().max()) < float(u64.norm()) ** 2
        return
    assert float((out.double() - reference).abs().max()) < FLOAT32_TOL


@pytest.mark.parametrize("method", ["retr", "proju", "projx", "expmap"])
def test_r_greater_than_d_is_refused_by_every_method(st, method):
    """A (3, 8) tensor has no orthonormal columns; retr/projx returned orthonormal rows, proju a (3, 8) matrix."""
    a = torch.randn(3, 8, dtype=torch.float64)
    call = {"retr": lambda: st.retr(a, a), "proju": lambda: st.proju(a, a), "projx": lambda: st.projx(a),
            "expmap": lambda: st.expmap(a, a)}[method]
    with pytest.raises(ValueError, match=r"r=8 columns but only d=3 rows"):
        call()
    # companion: the transposed (8, 3) tensor is a frame shape
    b = a.mT.contiguous()
    {"retr": lambda: st.retr(st.projx(b), 0 * b), "proju": lambda: st.proju(st.projx(b), b),
     "projx": lambda: st.projx(b), "expmap": lambda: st.expmap(st.projx(b), 0 * b)}[method]()


@pytest.mark.parametrize("call", ["projx", "retr", "random", "parameter"])
def test_complex_tensors_are_refused(st, call):
    """A complex tensor was projected to a unitary U V^H that the manifold's own W^T W check then rejects."""
    c = torch.randn(8, 3, dtype=torch.complex128)
    x, _, _ = _point_and_tangents(st, (8, 3))
    fn = {"projx": lambda: st.projx(c), "retr": lambda: st.retr(x.to(torch.complex128), c),
          "random": lambda: st.random(8, 3, dtype=torch.complex128),
          "parameter": lambda: geoopt.ManifoldParameter(c, manifold=st)}[call]
    with pytest.raises(TypeError, match="complex.*real Stiefel manifold"):
        fn()
    # companion: the same calls in float64 give points of the manifold
    real = {"projx": lambda: st.projx(c.real), "retr": lambda: st.retr(x, st.proju(x, c.real)),
            "random": lambda: st.random(8, 3, dtype=torch.float64),
            "parameter": lambda: geoopt.ManifoldParameter(st.projx(c.real), manifold=st)}[call]()
    st.assert_check_point_on_manifold(real, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_input_of_projx_and_retr_is_refused(st, value):
    """projx of a matrix holding an inf returned the origin-like frame [I; 0] (its SVD's arbitrary answer), a NaN
    failed inside the SVD or eigh with LinAlgError; both now raise naming the frame."""
    x, u, _ = _point_and_tangents(st, (3, 8, 3))
    bad = x.as_subclass(torch.Tensor).clone()
    bad[2, 0, 0] = value
    with pytest.raises(ValueError, match=r"PolarStiefel\.projx: x has non-finite entries .* frame\(s\) \[2\]"):
        st.projx(bad)
    with pytest.raises(ValueError, match=r"PolarStiefel\.retr: x \+ u has non-finite entries .* frame\(s\) \[2\]"):
        st.retr(x, bad - x)
    # companion: finite input gives the SVD reference
    a, _, bh = np.linalg.svd((x + u).numpy(), full_matrices=False)
    np.testing.assert_allclose(st.projx(x + u).numpy(), a @ bh, atol=TOL)
    np.testing.assert_allclose(st.retr(x, u).numpy(), a @ bh, atol=TOL)


@pytest.mark.parametrize("case", ["zeros", "two columns equal"])
def test_projx_of_a_rank_deficient_matrix_warns_that_its_frame_is_arbitrary(st, case):
    """A rank-deficient matrix has a continuum of closest frames; the SVD returns one set by rounding, which
    projx returned silently. The warning names the deficient frame of the stack."""
    x, _, _ = _point_and_tangents(st, (3, 8, 3))
    a = x.as_subclass(torch.Tensor).clone()
    if case == "zeros":
        a[1] = 0.0
    else:
        a[1, :, 2] = a[1, :, 1]
    assert int(torch.linalg.matrix_rank(a[1])) < 3
    with pytest.warns(UserWarning, match=r"frame\(s\) \[1\] .* rank < r=3 .* arbitrary"):
        p = st.projx(a)
    st.assert_check_point_on_manifold(p, atol=TOL, rtol=TOL)  # still a frame
    # companion: a full-rank stack (even badly scaled) is projected silently, to the SVD reference
    full = x.as_subclass(torch.Tensor) * torch.tensor([1.0, 1e-6, 1e3], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = st.projx(full)
    uu, _, vh = np.linalg.svd(full.numpy(), full_matrices=False)
    np.testing.assert_allclose(q.numpy(), uu @ vh, atol=TOL)


@pytest.mark.parametrize("opt_cls", [geoopt.optim.RiemannianAdam, geoopt.optim.RiemannianSGD])
def test_geoopt_optimizers_step_a_polar_stiefel_parameter(st, opt_cls):
    """geoopt's own optimizers (retr_transp, egrad2rgrad, projx when stabilizing) keep the parameter and its
    momentum on the manifold and its tangent space; SGD's minimiser of ||W - T||^2 is the polar factor of T."""
    w = geoopt.ManifoldParameter(st.random(2, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
                                 manifold=st)
    target = torch.randn(2, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    kw = dict(lr=0.05, stabilize=5) if opt_cls is geoopt.optim.RiemannianAdam else dict(lr=0.1, momentum=0.5,
                                                                                       stabilize=5)
    opt = opt_cls([w], **kw)
    for _ in range(300):
        opt.zero_grad()
        (w - target).square().sum().backward()
        opt.step()
    w = w.detach().as_subclass(torch.Tensor)
    st.assert_check_point_on_manifold(w, atol=TOL, rtol=TOL)
    buf = opt.state[next(iter(opt.state))]["exp_avg" if opt_cls is geoopt.optim.RiemannianAdam else "momentum_buffer"]
    st.assert_check_vector_on_tangent(w, buf, atol=TOL, rtol=TOL)
    a, _, bh = np.linalg.svd(target.numpy(), full_matrices=False)
    # Adam's steps at a fixed lr keep a jitter of about lr * eps-scale around the optimum; SGD converges
    tol = ADAM_OPTIMUM_TOL if opt_cls is geoopt.optim.RiemannianAdam else OPTIMUM_TOL
    np.testing.assert_allclose(w.numpy(), a @ bh, atol=tol)


def test_asking_polar_stiefel_for_the_canonical_metric_is_refused():
    """geoopt's ``Stiefel(canonical=True)`` is the canonical metric; a subclass of ``EuclideanStiefel`` got the
    Euclidean one whatever was asked for. ``PolarStiefel(canonical=True)`` is refused, naming the fix; companion:
    ``canonical=False``, no argument, a pickle and a deep copy give the manifold."""
    with pytest.raises(ValueError, match=r"canonical=True .* geoopt\.Stiefel\(canonical=True\)"):
        PolarStiefel(canonical=True)
    assert type(geoopt.Stiefel(canonical=True)) is geoopt.CanonicalStiefel  # what the user asked geoopt for
    for m in (PolarStiefel(), PolarStiefel(canonical=False), pickle.loads(pickle.dumps(PolarStiefel())),
              copy.deepcopy(PolarStiefel())):
        assert type(m) is PolarStiefel and isinstance(m, geoopt.EuclideanStiefel)
