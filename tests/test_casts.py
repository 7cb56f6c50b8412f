"""Casting or moving a model whose attention holds Stiefel frames (issue 23): ``.double()``, ``.half()``,
``.to(torch.bfloat16)``, ``.to(dtype)``, ``.to(device)``.

Both owners of frames, the parametrization of ``stiefelize`` and ``StiefelMultiheadAttention``, re-project their
frames after a cast to a more precise dtype (``integrations.casts.reproject_after_cast_``): a float32 frame is
orthonormal to float32 rounding only, which StiefelAdam's float64 first-step check refuses. A cast to a coarser dtype rounds
the frames, which is the best that dtype holds.
"""

import geoopt
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import geoopt_stiefel_attention.integrations.casts as casts_module  # where the frame owners' _apply reads its helpers
import geoopt_stiefel_attention.nn as nn_module
from geoopt_stiefel_attention import StiefelAdam, TinyTransformer, frame_parameters, param_groups, stiefelize
from geoopt_stiefel_attention._guard import FrameOffManifoldError
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.integrations.casts import reproject_after_cast_
from geoopt_stiefel_attention.optim import ORTHONORMALITY_TOLERANCE

#: Largest max|W^T W - I| of a frame after a cast from float32, and after a few steps in the new dtype: the
#: rounding of that dtype (measured after the cast: float64 2.4e-15, float16 2.6e-4, bfloat16 2.4e-3; float32
#: after half -> float 2.4e-7). Each is below StiefelAdam's first-step tolerance for the dtype, and the float64
#: one is far below float32 rounding (about 1e-6), which the companion checks it can see.
CAST_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}

#: Adam's eps for float16 parameters: 1e-8 rounds to 0 in float16, and torch's AdamW (the non-frame parameters)
#: then divides 0 by 0 wherever a gradient entry underflows (torch.optim.AdamW alone does the same).
EPS = {torch.float16: 1e-4}

STEPS = 3


def _converted():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    stiefelize(model)
    return model


def _library():
    return TinyTransformer(11, 4, width=16, heads=2, mlp=32, attention="stiefel", seed=0)


#: kind -> (builder, loss(model, dtype, step))
MODELS = {
    "stiefelize": (_converted, lambda m, dt, i: m(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i))
                                                   .to(dt)).float().square().mean()),
    "StiefelMultiheadAttention": (_library, lambda m, dt, i: F.cross_entropy(
        m(torch.randint(0, 11, (4, 4), generator=torch.Generator().manual_seed(i))).float().reshape(-1, 11),
        torch.randint(0, 11, (16,), generator=torch.Generator().manual_seed(100 + i)))),
}

#: name -> (cast, dtype after it)
CASTS = {
    "double": (lambda m: m.double(), torch.float64),
    "to(float64)": (lambda m: m.to(torch.float64), torch.float64),
    "to(cpu, float64)": (lambda m: m.to("cpu", torch.float64), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "half then float": (lambda m: m.half().float(), torch.float32),
    "to(cpu)": (lambda m: m.to("cpu"), torch.float32),
}


def _frame_norm(a):
    """Largest Frobenius norm over the frames of a stack, in float64."""
    return float(torch.linalg.matrix_norm(a.detach().double()).amax())


def _gram_offset(w):
    """Largest ||W^T W - I||_F over the frames of a stack, in float64."""
    w = w.detach().double()
    return _frame_norm(w.mT @ w - torch.eye(w.shape[-1], dtype=torch.float64))


def _train(model, loss_of, dtype, opt):
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, dtype, i)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_cast_model_trains_with_frames_orthonormal_to_its_new_precision(kind, cast):
    build, loss_of = MODELS[kind]
    apply, dtype = CASTS[cast]
    model = build()
    frames = frame_parameters(model)
    before = [p.detach().clone() for p in frames]
    # built before the cast: the optimizer holds the parameter objects, which the cast must keep
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2, eps=EPS.get(dtype, 1e-8))
    assert apply(model) is model
    assert len(frames) == 2
    assert all(p is q for p, q in zip(frame_parameters(model), frames, strict=True))
    for p, b in zip(frames, before, strict=True):
        assert isinstance(p, geoopt.ManifoldParameter) and p.dtype == dtype
        assert float(orthonormality_error(p)) <= CAST_TOL[dtype] <= ORTHONORMALITY_TOLERANCE[dtype]
        if cast == "to(cpu)":
            assert torch.equal(p, b)  # no cast, nothing moved
        elif torch.finfo(dtype).eps < torch.finfo(b.dtype).eps:
            # re-projected: moved by at most the rounding offset, ||W - polar(W)||_F <= ||W^T W - I||_F
            assert 0 < _frame_norm(p.double() - b.double()) <= _gram_offset(b) + CAST_TOL[dtype]
        elif cast != "half then float":
            assert torch.equal(p, b.to(dtype))  # a coarser dtype: rounded, not re-projected
    start = [p.detach().clone() for p in frames]
    losses = _train(model, loss_of, dtype, opt)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(p, s) for p, s in zip(frames, start, strict=True))  # the frames trained
    for p in frames:
        assert float(orthonormality_error(p)) <= CAST_TOL[dtype]


def test_a_converted_gpt2_trains_after_double():
    """The order of calls in the issue: ``stiefelize(m); m.double()``, then StiefelAdam."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    stiefelize(model)
    model.double()
    frames = frame_parameters(model)
    assert len(frames) == 4
    assert all(p.dtype == torch.float64 and float(orthonormality_error(p)) <= CAST_TOL[torch.float64] for p in frames)
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    x = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert all(float(orthonormality_error(p)) <= CAST_TOL[torch.float64] for p in frames)


def _assert_reported_at_forward_then_at_step(model, loss_of, step_match: str) -> None:
    """A float64 training forward pass of ``model`` reports its frame off the manifold; without one,
    StiefelAdam's first step does, with a message matching ``step_match``."""
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    with pytest.raises(FrameOffManifoldError, match="off the Stiefel manifold at a training forward pass"):
        loss_of(model, torch.float64, 0)  # a training forward pass reports it first ...
    for p in model.parameters():  # ... and without one, the optimizer's first step does
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=step_match):
        opt.step()


@pytest.mark.parametrize("kind", list(MODELS))
def test_companion_without_the_reprojection_a_double_model_is_refused(monkeypatch, kind):
    """The float64 tolerances see float32 rounding: with the re-projection switched off, the frames of a
    ``.double()`` model exceed them and StiefelAdam's first step raises, as it did before issue 23."""
    monkeypatch.setattr(casts_module, "reproject_after_cast_", lambda module, before: ())
    build, loss_of = MODELS[kind]
    model = build().double()
    assert all(float(orthonormality_error(p)) > ORTHONORMALITY_TOLERANCE[torch.float64] > CAST_TOL[torch.float64]
               for p in frame_parameters(model))
    _assert_reported_at_forward_then_at_step(model, loss_of, r"off the Stiefel manifold at its first step.*proj_\(\)")


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_frame_off_the_manifold_before_the_cast_is_left_for_the_optimizer_to_report(kind):
    """Only rounding is corrected: a frame moved off the manifold by hand (here scaled by 1.01, far beyond
    float32's tolerance) keeps its values through ``.double()``, and StiefelAdam names the problem and the fix."""
    build, loss_of = MODELS[kind]
    model = build()
    bad, good = frame_parameters(model)
    with torch.no_grad():
        bad.mul_(1.01)
    off = bad.detach().clone()
    model.double()
    assert torch.equal(bad, off.double())  # left as it is
    assert float(orthonormality_error(good)) <= CAST_TOL[torch.float64]  # its neighbour was re-projected
    _assert_reported_at_forward_then_at_step(model, loss_of, r"\(torch.float64\) is off the Stiefel manifold.*proj_\(\)")


@pytest.mark.parametrize("dtype", list(CAST_TOL))
def test_companion_the_cast_tolerances_see_a_frame_off_by_more_than_rounding(dtype):
    """Each tolerance can fail: a frame of the dtype scaled by 1 + 2 tol (so max|W^T W - I| is about 4 tol)
    exceeds it."""
    frames = _library().to(dtype)
    w = frame_parameters(frames)[0].detach()
    assert float(orthonormality_error((1 + 2 * CAST_TOL[dtype]) * w.double())) > CAST_TOL[dtype]


def test_reproject_after_cast_names_what_it_reprojected_and_leaves_sharded_meta_and_coarser_frames():
    model = _library()
    attention = next(m for m in model.modules() if isinstance(m, nn_module.StiefelMultiheadAttention))
    with torch.no_grad():  # the frames as a cast to float64 leaves them (the module's _apply not involved)
        attention.w_q.data = attention.w_q.data.double()
        attention.w_k.data = attention.w_k.data.half()
    done = reproject_after_cast_(attention, {"w_q": torch.float32, "w_k": torch.float32})
    assert done == ("w_q",)  # w_k went to a coarser dtype
    assert float(orthonormality_error(attention.w_q)) <= CAST_TOL[torch.float64]
    meta = _library().to("meta", torch.float64)  # no values to re-project: left, no error
    assert all(p.device.type == "meta" and p.dtype == torch.float64 for p in frame_parameters(meta))


# ------------------------------------------------------------------ the meta device and to_empty()
def _meta_models():
    with torch.device("meta"):
        encoder = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
        own = nn_module.StiefelMultiheadAttention(16, 2, batch_first=True)
    stiefelize(encoder)
    return encoder, own


def test_to_empty_from_the_meta_device_keeps_the_frames_frames():
    """torch's ``_apply`` installs a plain ``Parameter`` where it cannot swap the data in (meta to a device): the
    frames lost their class and manifold, so ``param_groups`` put them with the Euclidean parameters. Now they keep
    both, in the converted weights and in the library's own module."""
    for model in _meta_models():
        model.to_empty(device="cpu")
        frames = frame_parameters(model)
        assert len(frames) == 2
        assert all(isinstance(f, geoopt.ManifoldParameter) and f.device.type == "cpu" for f in frames)
        assert all(type(f.manifold).__name__ == "PolarStiefel" for f in frames)
        assert {id(f) for f in param_groups(model)[0]["params"]} == {id(f) for f in frames}


@pytest.mark.parametrize("kind", ["converted", "own"])
def test_companion_without_the_rewrap_to_empty_leaves_plain_parameters(monkeypatch, kind):
    monkeypatch.setattr(casts_module, "_rewrap_frames_", lambda *args: None)
    encoder, own = _meta_models()
    model = encoder if kind == "converted" else own
    model.to_empty(device="cpu")
    assert frame_parameters(model) == []


def test_a_model_converted_on_the_meta_device_is_filled_by_loading_a_stock_state_dict():
    """The loading hook read the converted weight with gradients on, so its frame check raised on the frames of
    to_empty() (uninitialised memory) before the load could fill them. Now the load makes them the polar factors of
    the stock blocks: the model equals the stock model converted after loading (exactly), and trains."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    reference = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    reference.load_state_dict(stock.state_dict())
    stiefelize(reference)
    model, _ = _meta_models()
    model.to_empty(device="cpu")
    with pytest.warns(UserWarning, match="replaced by their polar factors"):  # random stock blocks: said so
        model.load_state_dict(stock.state_dict())
    x = torch.randn(2, 5, 16)
    assert torch.equal(model(x), reference(x))
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    model(x).sum().backward()
    opt.step()
    assert max(float(orthonormality_error(f.detach())) for f in frame_parameters(model)) < 1e-5


def test_companion_uninitialised_frames_are_named_as_such_at_the_first_training_forward():
    model, _ = _meta_models()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for f in frame_parameters(model):
            f.zero_()  # what fresh memory often holds; garbage is as far off, or NaN
    with pytest.raises(FrameOffManifoldError, match=r"= 1 > 1e-05 .*most likely uninitialised memory .*to_empty\(\): "
                                                    r"load a state dict into it"):
        model(torch.randn(2, 5, 16))
    near = _meta_models()[0].to_empty(device="cpu")
    with torch.no_grad():
        for f in frame_parameters(near):
            f.copy_(torch.linalg.qr(torch.randn(f.shape))[0] * 1.01)  # a drift, not garbage
    with pytest.raises(FrameOffManifoldError, match="; most likely an optimizer that does not know the constraint"):
        near(torch.randn(2, 5, 16))


def test_overwriting_casts_keep_the_frames_and_their_gradients(monkeypatch):
    """With ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` every cast installs new plain
    Parameters: the frames are wrapped again (as after ``to_empty``) with the gradient torch carried over."""
    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    encoder, _ = _meta_models()
    encoder.to_empty(device="cpu")
    with torch.no_grad():
        for f in frame_parameters(encoder):
            f.copy_(torch.linalg.qr(torch.randn(f.shape))[0])
    encoder(torch.randn(2, 5, 16)).sum().backward()
    frames = frame_parameters(encoder)
    encoder.double()
    doubled = frame_parameters(encoder)
    assert len(doubled) == 2 and all(f.dtype == torch.float64 and f is not g for f, g in zip(doubled, frames, strict=True))
    assert all(f.grad is not None and f.grad.dtype == torch.float64 for f in doubled)
