"""Shared pytest fixtures and helpers."""

import geoopt
import pytest
import torch

from geoopt_stiefel_attention import PolarStiefel

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


# ---------------------------------------------------------------------------------------------- checkpoints
#: logits of two float32 models that should compute the same function (a converted model against the stock
#: class loaded from its checkpoint, or a restored converted model): float32 rounding (measured 0 to 8e-8)
F32_LOGIT_TOL = 1e-5
#: a frame or log-gain brought back from the stock form, whose blocks are gamma_h * U_h rounded to float32
#: (measured 2.4e-7)
F32_ROUNDTRIP_TOL = 1e-6
#: max |W^T W - I| of a float32 frame after a step
F32_ORTHO_TOL = 1e-5
#: a change of the function (relative) must exceed this in a companion case
CHANGED_MIN = 1e-4
