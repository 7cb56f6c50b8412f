"""torch.compile: a training step of a model with Stiefel attention, compiled, equals eager.

The model (forward and backward) is compiled; ``StiefelAdam.step`` runs eager here (its compiled, capturable
path is tested in tests/test_optim_contract.py). The default
run uses ``backend="aot_eager"`` (traces through Dynamo and AOTAutograd like inductor, without generating C++;
a few seconds). Inductor itself and a compiled ``opt.step`` take a minute or more on 2 CPU cores and are marked
slow: ``python -m pytest tests/test_compile.py -m slow``.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import ORTHO_TOL_F32, tiny_transformer

from geoopt_stiefel_attention import StiefelAdam, frame_parameters, param_groups
from geoopt_stiefel_attention._linalg import orthonormality_error

COMPILE_TOL_AOT = 1e-6  # float32, aot_eager vs eager after 3 steps (measured: 0, bit-identical)
COMPILE_TOL_INDUCTOR = 1e-5  # float32, inductor vs eager after 3 steps (measured: 1.3e-7)
COMPILED_STEP_TOL = 1e-5  # float32, compiled opt.step vs eager after 4 steps (measured: 4.8e-7)
VOCAB, SEQ, STEPS = 11, 4, 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (one intra-op thread: conftest's autouse fixture)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (8, SEQ), generator=g), torch.randint(0, VOCAB, (8, SEQ), generator=g))
            for _ in range(n)]


def _run(*, model_backend=None, step_backend=None, steps=STEPS):
    model = tiny_transformer(VOCAB, SEQ)
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2)
    forward = model if model_backend is None else torch.compile(model, backend=model_backend)

    def opt_step():
        opt.step()

    step = opt_step if step_backend is None else torch.compile(opt_step, backend=step_backend)
    losses = []
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = F.cross_entropy(forward(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        step()
        losses.append(loss.detach())
    return model, torch.stack(losses)


def _max_diff(a, b):
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _check(compiled, eager, tol):
    (model_c, losses_c), (model_e, losses_e) = compiled, eager
    assert float((losses_c - losses_e).abs().max()) <= tol
    assert _max_diff(model_c, model_e) <= tol
    for p in frame_parameters(model_c):
        assert float(orthonormality_error(p)) < ORTHO_TOL_F32
    # the comparison has teeth: the steps moved the parameters by much more than the tolerance
    start = tiny_transformer(VOCAB, SEQ)
    assert _max_diff(model_e, start) > 100 * tol


def test_compiled_training_step_matches_eager_aot_eager():
    _check(_run(model_backend="aot_eager"), _run(), COMPILE_TOL_AOT)


@pytest.mark.slow
def test_compiled_training_step_matches_eager_inductor():
    """About 80 s on a loaded 2-core machine (C++ code generation)."""
    _check(_run(model_backend="inductor"), _run(), COMPILE_TOL_INDUCTOR)


@pytest.mark.slow
def test_compiled_optimizer_step_matches_eager_without_graph_breaks():
    """``torch.compile`` of a function calling ``opt.step()`` gives the eager result in one graph: Dynamo traces an
    optimizer with its groups' ``capturable`` set to True, and StiefelAdam's capturable path reads no tensor on the
    host (issue 18; more in tests/test_optim_contract.py)."""
    eager = _run(steps=4)
    _check(_run(step_backend="aot_eager", steps=4), eager, COMPILED_STEP_TOL)
    model = tiny_transformer(VOCAB, SEQ)
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2)
    x, y = _batches(1)[0]
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    explanation = torch._dynamo.explain(opt.step)()
    assert explanation.graph_break_count == 0
