"""Shared pytest fixtures, helpers and tolerances.

Test modules import the named tolerances and helpers from here (``from conftest import F64, ORTHO_TOL_F64``);
a tolerance used by one file only stays in that file, next to the measurement that sets it.
"""

import geoopt
import pytest
import torch

from geoopt_stiefel_attention import PolarStiefel, TinyTransformer

#: The dtype of numerical checks.
F64 = torch.float64
#: max |W^T W - I| of a float64 frame (after construction, conversion or training)
ORTHO_TOL_F64 = 1e-12
#: max |W^T W - I| of a float32 frame after training
ORTHO_TOL_F32 = 1e-5

# The tests use small tensors, for which intra-op threading only adds overhead; on a loaded 2-core machine
# two threads made a 16x10 optimizer step 10-70x slower. One thread also makes timings reproducible.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one intra-op thread, whatever an earlier test (a CLI run with ``--threads``) set."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _make_bad_frame(kind):
    """A parameter the optimizer must refuse, the exception it raises and a pattern of its message."""
    st = PolarStiefel()
    frames = st.random(2, 9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if kind == "off_manifold":
        return geoopt.ManifoldParameter(1.01 * frames, manifold=st), ValueError, r"proj_\(\)"
    if kind == "r_greater_than_d":
        p = geoopt.ManifoldParameter(frames, manifold=st)
        p.data = torch.randn(2, 3, 9, dtype=torch.float64)  # e.g. a transposed frame assigned later
        return p, ValueError, r"r <= d.*transpose"
    if kind == "canonical":
        canonical = geoopt.Stiefel()
        return geoopt.ManifoldParameter(canonical.random(9, 3, dtype=torch.float64), manifold=canonical), \
            ValueError, "PolarStiefel"
    if kind == "sphere":
        sphere = geoopt.Sphere()
        return geoopt.ManifoldParameter(sphere.random(9, dtype=torch.float64), manifold=sphere), ValueError, \
            "RiemannianAdam"
    if kind == "complex":
        w = torch.linalg.qr(torch.randn(9, 3, dtype=torch.complex128)).Q
        return geoopt.ManifoldParameter(w, manifold=st, requires_grad=True), TypeError, "real"
    raise AssertionError(kind)


@pytest.fixture()
def bad_frame():
    """``bad_frame(kind) -> (parameter, exception, message pattern)`` for the kinds of parameter the optimizer
    refuses: off_manifold, r_greater_than_d, canonical, sphere, complex."""
    return _make_bad_frame


def tiny_transformer(vocab: int = 11, seq: int = 4, **overrides) -> TinyTransformer:
    """The tests' tiny Stiefel model: a one-layer TinyTransformer of width 16 with two heads, seed 0;
    ``overrides`` replace any of its keyword arguments (``attention``, ``seed``, ``dtype``, ...)."""
    kwargs = dict(width=16, heads=2, mlp=32, attention="stiefel", seed=0)
    return TinyTransformer(vocab, seq, **{**kwargs, **overrides})


@pytest.fixture()
def tiny_model():
    """``tiny_model(**overrides)``: :func:`tiny_transformer` as a fixture."""
    return tiny_transformer
