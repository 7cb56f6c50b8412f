"""A frame moved off the manifold by anything but the library's update is reported at the next training forward
pass (geoopt_stiefel_attention._guard): with a torch optimizer, the HF Trainer's default optimizer, on the
library's own modules and on converted models; never on frames the library's optimizers updated (float64, float32,
bfloat16 with master weights, the capturable path, geoopt's RiemannianAdam)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from geoopt_stiefel_attention import StiefelAdam, StiefelMultiheadAttention, _guard, param_groups, stiefelize
from geoopt_stiefel_attention._guard import FRAME_CHECK_TOLERANCE, FrameOffManifoldError, check_frames


def _encoder(dtype=torch.float32):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    stiefelize(model)
    return model.to(dtype)


def _steps(model, opt, n, dtype=torch.float32):
    x, target = torch.randn(4, 6, 32, dtype=dtype), torch.randn(4, 6, 32)
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        (model(x).float() - target).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("lr", [5e-5, 1e-3])
def test_a_torch_optimizer_over_a_converted_model_is_reported_at_the_next_training_forward(lr):
    model = _encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    _steps(model, opt, 1)  # the first forward sees frames on the manifold
    with pytest.raises(FrameOffManifoldError) as err:
        _steps(model, opt, 1)
    message = str(err.value)
    assert message.startswith("layers.0.self_attn.in_proj_weight: frame 'q_frames'")  # names the parameter
    assert "does not know the constraint" in message and "StiefelAdam(param_groups(model)" in message
    assert "optimizer_cls_and_kwargs" in message  # and the Trainer's fix


def test_the_check_runs_with_gradients_only_and_check_frames_runs_it_on_demand():
    model = _encoder()
    with torch.no_grad():
        model.layers[0].self_attn.parametrizations.in_proj_weight[0].k_frames.mul_(1.01)
    with torch.no_grad(), pytest.warns(UserWarning, match="'k_frames' is off the Stiefel manifold at an evaluation"):
        model.train()(torch.randn(2, 3, 32))  # a forward without gradients warns (tests/test_averaging.py)
    with pytest.raises(FrameOffManifoldError, match="k_frames"):
        check_frames(model)
    with pytest.raises(FrameOffManifoldError, match="k_frames"):
        model.eval()(torch.randn(2, 3, 32))  # one with gradients is, in eval mode too (training without dropout)


def test_the_librarys_own_module_is_checked_too():
    torch.manual_seed(0)
    attn = StiefelMultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    opt = torch.optim.SGD(attn.parameters(), lr=1e-2)
    attn(x, x, x)[0].square().sum().backward()
    opt.step()
    with pytest.raises(FrameOffManifoldError, match="StiefelMultiheadAttention: frame 'w_q'"):
        attn(x, x, x)
    with torch.no_grad():  # the fix the message names
        attn.w_q.proj_()
        attn.w_k.proj_()
    attn(x, x, x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("capturable", [False, True])
def test_frames_the_library_updates_never_trip_the_check(dtype, capturable):
    model = _encoder(dtype)
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=3e-2, capturable=capturable)
    _steps(model, opt, 40, dtype)  # a large lr: each step turns the frames a lot
    check_frames(model)
    # companion: the same model, one plain SGD step further, is refused
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    _steps(model, sgd, 1, dtype)
    with pytest.raises(FrameOffManifoldError):
        check_frames(model)


def test_bfloat16_frames_with_master_weights_do_not_trip_the_check():
    model = _encoder(torch.bfloat16)
    opt = StiefelAdam(param_groups(model), lr=3e-2, master_weights=True)
    _steps(model, opt, 20, torch.bfloat16)
    check_frames(model)


def test_geoopts_riemannian_adam_keeps_frames_within_the_check():
    import geoopt

    model = _encoder()
    opt = geoopt.optim.RiemannianAdam(model.parameters(), lr=1e-2)
    _steps(model, opt, 20)
    check_frames(model)


def test_the_tolerance_table_separates_rounding_from_a_foreign_step():
    # every dtype a frame can have is in the table, and the float32 threshold lies between the library's worst
    # measured rounding (2.5e-6) and one AdamW step at lr 1e-5 (6e-5)
    assert set(FRAME_CHECK_TOLERANCE) == {torch.float64, torch.float32, torch.bfloat16, torch.float16}
    assert 2.5e-6 < FRAME_CHECK_TOLERANCE[torch.float32] < 6e-5


def test_the_hf_trainers_default_optimizer_is_reported():
    transformers = pytest.importorskip("transformers")

    class Repeats(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            x = torch.tensor([1 + i % 5, 2, 3, 4] * 4)
            return {"input_ids": x, "labels": x}

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    stiefelize(model, logit_gain="learn")
    args = transformers.TrainingArguments("/tmp/unused-gsa-guard", max_steps=3, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Repeats())  # no optimizers=
    with pytest.raises(FrameOffManifoldError, match="transformer.h.0.attn.c_attn.weight: .*optimizers=\\(opt, None\\)"):
        trainer.train()


def test_a_non_finite_frame_is_reported_and_mixed_dtypes_are_each_held_to_their_own_tolerance():
    from geoopt_stiefel_attention._guard import check_frame_tensors
    from geoopt_stiefel_attention.manifolds import PolarStiefel

    w64 = PolarStiefel().random(3, 8, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = w64.float()
    check_frame_tensors("m", [("a", w), ("b", w64)])  # on the manifold in both dtypes
    bad = w.clone()
    bad[1, 0, 0] = float("nan")
    with pytest.raises(FrameOffManifoldError, match="frame 'b'.*nan"):
        check_frame_tensors("m", [("a", w), ("b", bad)])
    off64 = w64 * (1 + 1e-7)  # within float32's tolerance, not float64's
    with pytest.raises(FrameOffManifoldError, match="frame 'b'.*float64"):
        check_frame_tensors("m", [("a", w), ("b", off64)])
    check_frame_tensors("m", [("a", w), ("b", off64.float())])  # companion: as float32 it passes


def _refuse_host_reads(monkeypatch):
    """``Tensor.item``, ``bool(t)`` and ``float(t)`` raise from now on, as a host read does inside a CUDA graph's
    capture."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")
    for name in ("item", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def _capturing_models():
    torch.manual_seed(0)
    return {"converted": _encoder(), "own": StiefelMultiheadAttention(32, 4, batch_first=True)}


def _training_forward(kind, model):
    x = torch.randn(2, 5, 32)
    return model(x) if kind == "converted" else model(x, x, x)[0]


def _push_off(kind, model):
    with torch.no_grad():
        frame = (model.layers[0].self_attn.parametrizations.in_proj_weight[0].k_frames if kind == "converted"
                 else model.w_k)
        frame.mul_(1.01)


@pytest.mark.parametrize("kind", ["converted", "own"])
def test_a_training_forward_captured_in_a_cuda_graph_checks_the_frames_without_a_host_read(monkeypatch, kind):
    """While a CUDA graph is captured (``torch.cuda.graph``, ``make_graphed_callables``) no tensor may be read on the
    host: the check is recorded as an assertion instead (``torch._assert_async``, which the CPU runs at once). Here
    the capture is simulated on the CPU and host reads refused: frames on the manifold pass without one, and a frame
    off it stops the forward with the check's message."""
    models = _capturing_models()
    monkeypatch.setattr(_guard, "capturing", lambda: True)
    model = models[kind]
    with monkeypatch.context() as refused:
        _refuse_host_reads(refused)
        _training_forward(kind, model)
    _push_off(kind, model)
    with monkeypatch.context() as refused:
        _refuse_host_reads(refused)
        with pytest.raises(RuntimeError, match="'k_frames'|'w_k'") as err:
            _training_forward(kind, model)
    assert "is off the Stiefel manifold at a training forward pass captured in a CUDA graph" in str(err.value)


@pytest.mark.parametrize("kind", ["converted", "own"])
def test_companion_outside_a_capture_the_training_forward_check_reads_the_host(monkeypatch, kind):
    """The refusal above can fail: outside a capture the check reads each frame's distance on the host (to put the
    measured distance in its message)."""
    model = _capturing_models()[kind]
    with monkeypatch.context() as refused:
        _refuse_host_reads(refused)
        with pytest.raises(AssertionError, match="read on the host"):
            _training_forward(kind, model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures a training CUDA graph)")
def test_cuda_graph_capture_of_a_whole_training_step_matches_eager_steps():
    """torch's whole-network capture recipe (warm-up on a side stream, then forward, backward and
    ``StiefelAdam(capturable=True).step()`` captured in one ``torch.cuda.graph``) on a converted model: the capture
    reads nothing on the host (the frame check is an assertion there), and five replays give the frames of five eager
    steps from the same state."""
    import copy

    model = _encoder().cuda()
    opt = StiefelAdam(param_groups(model), lr=1e-3, capturable=True)
    x, target = torch.randn(4, 6, 32, device="cuda"), torch.randn(4, 6, 32, device="cuda")

    def step(net, optimizer):
        loss = (net(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    twin = copy.deepcopy(model)
    twin_opt = StiefelAdam(param_groups(twin), lr=1e-3, capturable=True)
    twin_opt.load_state_dict(opt.state_dict())
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(model, opt)
    for _ in range(5):
        graph.replay()
        twin_opt.zero_grad(set_to_none=True)
        step(twin, twin_opt)
    torch.cuda.synchronize()
    for ours, eager in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_make_graphed_callables_refuses_the_converted_model_itself_as_documented():
    """``torch.cuda.make_graphed_callables`` refuses a module with forward hooks before anything else (no GPU needed
    to see it), and ``stiefelize`` puts two on the model it converts: ``docs/converting.rst`` says to pass the layers,
    which carry none (checked here), or capture the whole step with ``torch.cuda.graph``."""
    model = _encoder()
    with pytest.raises(AssertionError, match="must not have hooks"):
        torch.cuda.make_graphed_callables(model, (torch.randn(2, 3, 32),))
    layer = model.layers[0]
    assert not (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks)


def test_frame_error_is_the_largest_entry_of_wtw_minus_identity():
    """``_guard.frame_error`` (both training-forward checks use it) against a written-out numpy reference: a float64
    stack, a single 2-D frame, and bf16 frames (computed in float32); NaN propagates. Companion: an orthonormal
    stack gives rounding only, far below the error of the perturbed one."""
    import numpy as np

    from geoopt_stiefel_attention import PolarStiefel
    from geoopt_stiefel_attention._guard import frame_error

    gen = torch.Generator().manual_seed(3)
    w = PolarStiefel().random(3, 9, 4, dtype=torch.float64, generator=gen)
    bent = w + 0.05 * torch.randn(w.shape, dtype=torch.float64, generator=gen)

    def reference(a):
        a = np.asarray(a, dtype=np.float64)
        return max(np.abs(f.T @ f - np.eye(a.shape[-1])).max() for f in a.reshape(-1, *a.shape[-2:]))

    assert float(frame_error(bent)) == pytest.approx(reference(bent.numpy()), rel=1e-12)
    assert float(frame_error(bent[1])) == pytest.approx(reference(bent[1].numpy()), rel=1e-12)  # one 2-D frame
    half = bent.to(torch.bfloat16)
    assert float(frame_error(half)) == pytest.approx(reference(half.float().numpy()), rel=1e-5)
    assert float(frame_error(w)) < 1e-14 < 1e-3 < reference(bent.numpy())  # companion
    bent[2, 0, 0] = float("nan")
    assert math.isnan(float(frame_error(bent)))
