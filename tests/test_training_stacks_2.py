"""A converted model under more of the machinery people train it with: activation checkpointing (HuggingFace
``gradient_checkpointing_enable`` with and without reentry, ``torch.utils.checkpoint`` around converted torch
layers), PEFT adapters (LoRA) and ``torch.amp.GradScaler``. Each is checked in float64 against a reference computed
here: the stock (unconverted) model holding the weights the converted one reads, whose weight gradients are mapped
onto the frames, gains and rest by the chain rule written out below (tiny configs, random weights, no downloads)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from geoopt_stiefel_attention import StiefelAdam, StiefelMuon, frame_parameters, param_groups, stiefelize
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.convert import GAIN_RATE
from geoopt_stiefel_attention.convert.parametrization import _QKWeight

TOL = 1e-12  # float64


# ------------------------------------------------------------------ the reference: stock gradients, chain rule
def _where_qk(name: str, w: torch.Tensor) -> tuple[int, list[tuple[str, int, int]]]:
    """How the stock weight ``name`` holds its query/key heads (written out per architecture, not read from the
    library): the axis and the ``(role, start, length)`` ranges along it."""
    if name.endswith("c_attn.weight"):  # GPT-2 Conv1D (d, 3d): q | k | v columns
        e = w.shape[0]
        return 1, [("q", 0, e), ("k", e, e), ("rest", 2 * e, e)]
    if name.endswith("in_proj_weight"):  # torch MHA (3d, d): q | k | v rows
        e = w.shape[1]
        return 0, [("q", 0, e), ("k", e, e), ("rest", 2 * e, e)]
    if name.endswith("q_proj.weight"):
        return 0, [("q", 0, w.shape[0])]
    if name.endswith("k_proj.weight"):
        return 0, [("k", 0, w.shape[0])]
    raise AssertionError(name)


def _heads(w: torch.Tensor, dim: int, start: int, length: int, r: int) -> torch.Tensor:
    """``(heads, d, r)``: head ``h`` is rows (dim 0, transposed) or columns (dim 1) ``start + h r ...``."""
    if dim == 0:
        return torch.stack([w[start + h * r:start + (h + 1) * r].T for h in range(length // r)])
    return torch.stack([w[:, start + h * r:start + (h + 1) * r] for h in range(length // r)])


def _reference_grads(converted: nn.Module, stock_grads: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """The gradient of every parameter of ``converted`` from the stock model's gradients: a query head block is
    ``g_h U_h`` with ``g_h = exp(rate theta_h)``, so ``dL/dU_h = g_h dW_h`` and ``dL/dtheta_h = rate g_h <dW_h, U_h>``;
    a key head block is ``U_h`` (``dL/dU_h = dW_h``); the rest is the value slices, in order."""
    ref = {}
    for name, _ in converted.named_parameters():
        m = re.fullmatch(r"(.*)\.parametrizations\.(\w+)\.(?:0\.)?(q_frames|k_frames|q_log_gain|original)", name)
        if m is None:
            ref[name] = stock_grads[name]
            continue
        stock_name = f"{m.group(1)}.{m.group(2)}"
        dw = stock_grads[stock_name]
        dim, ranges = _where_qk(stock_name, dw)
        owner = converted.get_submodule(m.group(1)).parametrizations[m.group(2)][0]
        gain = torch.exp(GAIN_RATE * owner.q_log_gain.detach()) if hasattr(owner, "q_log_gain") else None
        role = m.group(3)
        if role == "original":
            ref[name] = torch.cat([dw.narrow(dim, s, n) for rl, s, n in ranges if rl == "rest"], dim=dim)
            continue
        (s, n), = [(s, n) for rl, s, n in ranges if rl == role[0]]
        blocks = _heads(dw, dim, s, n, r)
        if role == "k_frames":
            ref[name] = blocks
        elif role == "q_frames":
            ref[name] = blocks * (gain.view(-1, 1, 1) if gain is not None else 1)
        else:
            ref[name] = GAIN_RATE * gain * (blocks * owner.q_frames.detach()).sum((1, 2))
    return ref


def _assert_grads(model: nn.Module, ref: dict[str, torch.Tensor], tol: float = TOL) -> None:
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == set(ref)
    for name, g in got.items():
        assert g is not None, name
        err = float((g - ref[name]).abs().max())
        assert err <= tol, (name, err)


def _scramble_gains(model: nn.Module) -> None:
    """Gains away from 1 (so the gain's factor in the chain rule is tested)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.modules():
            if isinstance(p, _QKWeight) and hasattr(p, "q_log_gain"):
                p.q_log_gain.copy_(0.05 * torch.randn(p.q_log_gain.shape, generator=gen, dtype=p.q_log_gain.dtype))


def _counting_builds(monkeypatch) -> list[int]:
    builds = []
    real = _QKWeight._build
    monkeypatch.setattr(_QKWeight, "_build", lambda self, rest: builds.append(1) or real(self, rest))
    return builds


# ------------------------------------------------------------------ activation checkpointing: torch MHA layers
class _Encoder(nn.Module):
    """Two torch encoder layers, each optionally under ``torch.utils.checkpoint``; ``shared`` runs layer 0 a
    second time outside any checkpoint (a weight read both inside and outside a checkpointed region)."""

    def __init__(self, reentrant: bool | None = None, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True,
                                                               dtype=torch.float64) for _ in range(2))
        self.head = nn.Linear(16, 3, dtype=torch.float64)
        self.reentrant, self.shared = reentrant, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared:
            x = self.layers[0](x)
        for layer in self.layers:
            x = layer(x) if self.reentrant is None else checkpoint(layer, x, use_reentrant=self.reentrant)
        return self.head(x).square().mean()


def _x() -> torch.Tensor:
    # requires_grad: reentrant checkpointing gives no parameter gradients when no input requires one (torch warns)
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()


def _encoder_reference(shared: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], nn.Module]:
    """The converted encoder's loss and the reference gradients from its stock twin (no checkpointing)."""
    converted = _Encoder(shared=shared)
    stiefelize(converted, logit_gain="learn")
    _scramble_gains(converted)
    stock = _Encoder(shared=shared)
    stock.load_state_dict(converted.state_dict())
    loss = stock(_x())
    loss.backward()
    grads = {n: p.grad for n, p in stock.named_parameters()}
    return loss.detach(), _reference_grads(converted, grads, r=4), converted


@pytest.mark.parametrize("shared", [False, True], ids=["layers", "shared-layer"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_mha_layers_give_the_stock_models_loss_and_gradients(monkeypatch, reentrant, shared):
    """``torch.utils.checkpoint`` around converted ``nn.TransformerEncoderLayer`` s (learned gains away from 1):
    the loss and every gradient (frames, gains, value rows, biases, the rest) are the stock model's, mapped by the
    chain rule, to 1e-12 in float64. Without reentry the forward used to build an MHA weight once and reuse it for
    the module's three reads, while the recomputation in backward (outside the model's forward) built it at each read,
    so the tensors saved by the two passes no longer matched position by position: ``CheckpointError`` here, and
    where the shapes agree, gradients of the wrong tensors."""
    loss_ref, ref, _ = _encoder_reference(shared)
    model = _Encoder(reentrant, shared)
    stiefelize(model, logit_gain="learn")
    _scramble_gains(model)
    builds = _counting_builds(monkeypatch)
    loss = model(_x())
    forward_builds = len(builds)
    loss.backward()
    assert len(builds) > forward_builds  # the backward recomputed the layers (checkpointing is on)
    assert abs(float(loss.detach() - loss_ref)) <= TOL
    _assert_grads(model, ref)


def test_companion_uncheckpointed_mha_layers_build_each_weight_once_per_forward(monkeypatch):
    """Outside saved-tensor hooks the weight is still built once per model forward (the reuse that the checkpointed
    forward gives up), with the same reference gradients."""
    loss_ref, ref, model = _encoder_reference(False)
    builds = _counting_builds(monkeypatch)
    loss = model(_x())
    loss.backward()
    assert len(builds) == 2
    assert abs(float(loss.detach() - loss_ref)) <= TOL
    _assert_grads(model, ref)
    builds.clear()  # under save_on_cpu (saved-tensor hooks too) every read builds, with the same gradients
    model.zero_grad()
    with torch.autograd.graph.save_on_cpu():
        model(_x()).backward()
    assert len(builds) == 6
    _assert_grads(model, ref)


# ------------------------------------------------------------------ activation checkpointing: HF models
transformers = pytest.importorskip("transformers")


def _hf(kind: str, gain: str | None, convert: bool = True) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    model = model.double().train()
    if convert:
        stiefelize(model, logit_gain=gain)
        _scramble_gains(model)
    return model


IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [3, 1, 4, 1, 5, 9, 2, 6]])


@pytest.mark.parametrize("gain", [None, "learn"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_gradient_checkpointing_gives_the_stock_models_loss_and_gradients(monkeypatch, kind, reentrant, gain):
    """``gradient_checkpointing_enable`` on converted GPT-2 (fused ``c_attn`` Conv1D) and Llama (``q_proj``/
    ``k_proj``, grouped-query attention): the loss and every parameter gradient equal those of the stock model
    holding the weights the converted one reads, mapped onto frames, gains and value rows (1e-12, float64)."""
    model = _hf(kind, gain)
    stock = _hf(kind, None, convert=False)
    stock.load_state_dict(model.state_dict())
    ref_loss = stock(input_ids=IDS, labels=IDS).loss
    ref_loss.backward()
    ref = _reference_grads(model, {n: p.grad for n, p in stock.named_parameters()}, r=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames the method
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    builds = _counting_builds(monkeypatch)
    loss = model(input_ids=IDS, labels=IDS).loss
    forward_builds = len(builds)
    loss.backward()
    assert len(builds) == 2 * forward_builds  # every converted weight rebuilt by the recomputation
    assert abs(float(loss.detach() - ref_loss.detach())) <= TOL
    _assert_grads(model, ref)


def test_a_stiefeladam_step_under_checkpointing_is_the_uncheckpointed_step_and_stays_orthonormal():
    """Two StiefelAdam steps on a checkpointed converted Llama equal those without checkpointing (to float64
    rounding) and keep every frame orthonormal."""
    runs = []
    for ckpt in (False, True):
        model = _hf("llama", "learn")
        if ckpt:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = StiefelAdam(param_groups(model), lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            model(input_ids=IDS, labels=IDS).loss.backward()
            opt.step()
        assert max(float(orthonormality_error(f.detach())) for f in frame_parameters(model)) < 1e-12
        runs.append([p.detach().clone() for p in model.parameters()])
    assert max(float((a - b).abs().max()) for a, b in zip(*runs, strict=True)) < 1e-12


# ------------------------------------------------------------------ PEFT adapters (LoRA)
LORA_QK = "adapter layer (lora.Linear"


def _peft():
    return pytest.importorskip("peft")


def _lora(model: nn.Module, targets: list[str], **kwargs) -> nn.Module:
    peft = _peft()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False, **kwargs)
    with warnings.catch_warnings():  # peft's note on GPT-2's Conv1D, and a transformers deprecation peft calls
        warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.* is deprecated", FutureWarning)
        return peft.get_peft_model(model, config)


def _llama_lora_reference(model, ids):
    """Loss and gradients of a converted Llama with LoRA on ``v_proj``/``o_proj`` from a stock Llama whose adapted
    weights are ``W + (alpha/r) B A`` (written here): ``dL/dB = s dW A^T``, ``dL/dA = s B^T dW``; the frames' and
    the other weights' gradients mapped as above."""
    stock = _hf("llama", None, convert=False)
    inner = model.get_base_model()
    weights = {k: v for k, v in inner.state_dict().items() if "lora_" not in k}
    stock_sd = {}
    for key, value in weights.items():
        stock_sd[key.replace(".base_layer.", ".")] = value.detach().clone()
    scale = 4 / 2
    for name, module in inner.named_modules():
        if hasattr(module, "lora_A"):
            a, b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
            stock_sd[f"{name}.weight"] = stock_sd[f"{name}.weight"] + scale * b @ a
    stock.load_state_dict(stock_sd)
    loss = stock(input_ids=ids, labels=ids).loss
    loss.backward()
    dw = {n: p.grad for n, p in stock.named_parameters()}
    ref = {}
    for name, module in inner.named_modules():
        if hasattr(module, "lora_A"):
            a, b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
            ref[f"base_model.model.{name}.lora_A.default.weight"] = scale * b.T @ dw[f"{name}.weight"]
            ref[f"base_model.model.{name}.lora_B.default.weight"] = scale * dw[f"{name}.weight"] @ a.T
    return loss.detach(), ref, stock


def test_stiefelize_refuses_a_peft_model_with_lora_on_the_query_key_projections_naming_the_adapter():
    """LoRA on ``q_proj``/``k_proj`` (Llama) or on GPT-2's fused ``c_attn``: the effective query weight is
    ``W + (alpha/r) B A``, which frames on ``W`` alone do not make orthonormal. Refused, naming the adapter layers
    and the fix, with nothing changed; a user layout naming ``q_proj.base_layer.weight`` is refused the same way.
    Before: a "matches no layout" refusal whose hint asked for exactly that layout, which then converted."""
    from geoopt_stiefel_attention import LAYOUTS, Block, Layout

    for kind, targets, where in (("llama", ["q_proj", "k_proj"], "'q_proj', 'k_proj'"),
                                 ("gpt2", ["c_attn"], "'c_attn'")):
        model = _lora(_hf(kind, None, convert=False), targets)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=rf"wrapped by an {re.escape(LORA_QK)} at {where}\).*merge_and_unload"):
            stiefelize(model)
        assert not frame_parameters(model)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    layout = Layout("base layers", q=Block("q_proj.base_layer.weight"), k=Block("k_proj.base_layer.weight"),
                    head_dim=8)
    model = _lora(_hf("llama", None, convert=False), ["q_proj", "k_proj"])
    with pytest.raises(ValueError, match=re.escape(LORA_QK)) as err:
        stiefelize(model, targets=(*LAYOUTS, layout))
    assert "Pass targets= with a Layout" not in str(err.value)  # the adapter's line carries its own fix
    assert not frame_parameters(model)


def test_companion_stiefelize_converts_a_peft_model_with_lora_on_value_and_output_only():
    """LoRA on ``v_proj``/``o_proj`` leaves the query/key weights alone: converted (frames frozen with the rest of
    the base model, as PEFT froze it), and the loss and the adapters' gradients are those of the stock model with
    ``W + (alpha/r) B A`` written in (1e-12, float64); merging leaves the function and the frames as they are."""
    model = _lora(_hf("llama", None, convert=False), ["v_proj", "o_proj"])
    stiefelize(model)
    frames = frame_parameters(model)
    assert len(frames) == 4 and not any(f.requires_grad for f in frames)
    loss_ref, ref, _ = _llama_lora_reference(model, IDS)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert abs(float(loss.detach() - loss_ref)) <= TOL
    _assert_grads(model, ref)
    with torch.no_grad():
        before = model(input_ids=IDS).logits
        merged = model.merge_and_unload()
        assert float((merged(input_ids=IDS).logits - before).abs().max()) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(frames, frame_parameters(merged), strict=True))


def test_get_peft_model_with_lora_on_converted_query_key_projections_is_refused_naming_the_weight(tmp_path):
    """``get_peft_model`` (and ``PeftModel.from_pretrained``) with ``q_proj``/``k_proj`` in ``target_modules`` on a
    converted model: refused at the first read of the wrapped weight (PEFT reads it while injecting), naming the
    weight, the adapter and the fix. Before: accepted, trained ``U + (alpha/r) B A`` (no longer orthonormal) without
    a word, and ``merge_and_unload`` lost the adapter (logits 0.097 away from the unmerged model's)."""
    peft = _peft()
    model = _hf("llama", None)
    with pytest.raises(RuntimeError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight: .*wrapped by an "
                                           r"adapter layer \(lora\.Linear.*unstiefelize\(model\)"):
        _lora(model, ["q_proj", "k_proj"])
    with pytest.raises(RuntimeError, match=re.escape(LORA_QK)):  # a copy of a converted model knows its modules too
        _lora(copy.deepcopy(_hf("llama", None)), ["q_proj", "k_proj"])
    # an adapter trained on the stock model, loaded onto the converted one (then merged: the delta would be lost)
    stock = _lora(_hf("llama", None, convert=False), ["q_proj", "k_proj"])
    stock.save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(RuntimeError, match=re.escape(LORA_QK)):
        peft.PeftModel.from_pretrained(_hf("llama", None), str(tmp_path / "adapter"))
    # companion: after unstiefelize the stock weights take the adapter, and merging keeps the function
    from geoopt_stiefel_attention import unstiefelize

    converted = _hf("llama", None)
    with pytest.warns(UserWarning, match="unstiefelize"):
        unstiefelize(converted)
    adapted = _lora(converted, ["q_proj", "k_proj"])
    with torch.no_grad():
        before = adapted(input_ids=IDS).logits
        assert float((adapted.merge_and_unload()(input_ids=IDS).logits - before).abs().max()) < 1e-12


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft calls transformers
def test_companion_lora_on_value_and_output_of_a_converted_model_trains_saves_and_loads_consistently(tmp_path):
    """``get_peft_model`` on a converted Llama with LoRA on ``v_proj``/``o_proj``: the frames stay frozen (PEFT
    freezes the base) and orthonormal, the adapters' gradients are the stock reference's, a step with StiefelAdam
    trains the adapters only, and the saved adapter loaded onto a freshly converted model gives the same logits."""
    peft = _peft()
    model = _lora(_hf("llama", None), ["v_proj", "o_proj"])
    assert not any(f.requires_grad for f in frame_parameters(model))
    loss_ref, ref, _ = _llama_lora_reference(model, IDS)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert abs(float(loss.detach() - loss_ref)) <= TOL
    _assert_grads(model, ref)
    frames = [f.detach().clone() for f in frame_parameters(model)]
    opt = StiefelAdam(param_groups(model, expect_frames=False), lr=1e-2)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(frames, frame_parameters(model), strict=True))
    model.save_pretrained(str(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(_hf("llama", None), str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits)


# ------------------------------------------------------------------ torch.amp.GradScaler
def _scaled_run(opt_cls, *, scaler: bool, steps: int = 3, clip: float | None = None):
    model = _Encoder()
    stiefelize(model, logit_gain="learn")
    _scramble_gains(model)
    opt = opt_cls(param_groups(model), lr=1e-2)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if scaler else None
    x = _x().detach()
    for k in range(steps):
        opt.zero_grad()
        loss = model(x * (1 + k / 10))
        if amp is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            amp.scale(loss).backward()
            if clip is not None:
                amp.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            amp.step(opt)
            amp.update()
    return model, opt, amp


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
             for k, s in opt.state_dict()["state"].items()})


def _same(a, b) -> bool:
    params_a, state_a = a
    params_b, state_b = b
    return (all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True)) and state_a.keys() == state_b.keys()
            and all(torch.equal(state_a[k][n], state_b[k][n]) if torch.is_tensor(state_a[k][n])
                    else state_a[k][n] == state_b[k][n] for k in state_a for n in state_a[k]))


@pytest.mark.parametrize("opt_cls", [StiefelAdam, StiefelMuon])
def test_gradscaler_steps_are_the_unscaled_steps_and_an_inf_step_is_skipped_bit_for_bit(opt_cls):
    """``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``: the optimizer does not take the scale
    itself (no ``_step_supports_amp_scaling``), so the scaler divides every gradient, the frames' Euclidean ones
    included, by the power-of-two scale before the step: three steps equal those of the unscaled loss bit for bit
    (float64), with ``unscale_`` + ``clip_grad_norm_`` too. A step whose gradients hold an inf (in a frame, or only
    in a Euclidean parameter) is skipped: every parameter, frames included, and the optimizer's state unchanged bit
    for bit, and the scale halved."""
    ref, ref_opt, _ = _scaled_run(opt_cls, scaler=False)
    model, opt, amp = _scaled_run(opt_cls, scaler=True)
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    assert _same(_snapshot(ref, ref_opt), _snapshot(model, opt))
    clipped_ref, clipped_ref_opt, _ = _scaled_run(opt_cls, scaler=False, clip=0.05)
    clipped, clipped_opt, _ = _scaled_run(opt_cls, scaler=True, clip=0.05)
    assert _same(_snapshot(clipped_ref, clipped_ref_opt), _snapshot(clipped, clipped_opt))
    assert not _same(_snapshot(ref, ref_opt), _snapshot(clipped, clipped_opt))  # the clip acted
    frame = frame_parameters(model)[0]
    euclidean = model.head.weight
    for poisoned in (frame, euclidean):
        before, scale = _snapshot(model, opt), amp.get_scale()
        opt.zero_grad()
        amp.scale(model(_x().detach())).backward()
        with torch.no_grad():
            poisoned.grad[0, 0] = float("inf")
        amp.step(opt)
        amp.update()
        assert _same(before, _snapshot(model, opt))
        assert amp.get_scale() == scale / 2
    assert max(float(orthonormality_error(f.detach())) for f in frame_parameters(model)) < 1e-12


@pytest.mark.parametrize("opt_cls", [StiefelAdam, StiefelMuon])
def test_gradscaler_with_float16_autocast_on_the_cpu_trains_orthonormal_frames(opt_cls):
    """The real thing in float32: ``torch.autocast("cpu", torch.float16)`` with a GradScaler; the loss falls, the
    scale stays finite and the frames stay orthonormal to float32 rounding."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except RuntimeError as err:  # pragma: no cover - a torch without float16 autocast on the CPU
        pytest.skip(f"no float16 autocast on the CPU: {err}")
    model = _Encoder().float()
    stiefelize(model)
    opt = opt_cls(param_groups(model), lr=1e-2)
    amp = torch.amp.GradScaler("cpu")
    x = _x().detach().float()
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x)
        amp.scale(loss).backward()
        amp.step(opt)
        amp.update()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] and amp.get_scale() > 1
    assert max(float(orthonormality_error(f.detach())) for f in frame_parameters(model)) < 1e-5


# ------------------------------------------------------------------ torch.nn.utils.parametrize.cached()
@pytest.mark.parametrize("copied", [False, True], ids=["converted", "deepcopy"])
@pytest.mark.parametrize("optimizer", [StiefelAdam, StiefelMuon])
def test_a_step_inside_parametrize_cached_is_warned_and_would_leave_the_weights_stale(optimizer, copied):
    """Inside the block each parametrized weight is built once: after a step there, the next forward still reads the
    weight of the old frames (measured 0.31 apart at lr 0.1), without a word before. Companion: the same step outside
    the block says nothing, and the next forward reads the new weight."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    stiefelize(model)
    if copied:  # a copy's frames are not the ones stiefelize made
        model = copy.deepcopy(model)
    opt = optimizer(param_groups(model), lr=1e-1)
    x = torch.randn(2, 5, 16)
    attention = model[0].self_attn
    with parametrize.cached():
        model(x).sum().backward()
        with pytest.warns(UserWarning, match=rf"{optimizer.__name__}\.step\(\) inside torch\.nn\.utils\.parametrize"
                                             r"\.cached\(\): .*step outside the block"):
            opt.step()
        stale = attention.in_proj_weight.detach().clone()
    assert float((attention.in_proj_weight.detach() - stale).abs().max()) > 1e-2  # what the warning is about
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
        before = attention.in_proj_weight.detach().clone()
        opt.step()
    assert float((attention.in_proj_weight.detach() - before).abs().max()) > 1e-2


def test_companion_an_optimizer_without_converted_frames_is_not_warned_inside_parametrize_cached():
    from torch.nn.utils import parametrize

    from geoopt_stiefel_attention import TinyTransformer

    model = TinyTransformer(11, 6, width=16, depth=1, heads=2, mlp=32, attention="stiefel", seed=0)
    opt = StiefelAdam(param_groups(model), lr=1e-2)  # its own frames: no parametrization to cache
    x = torch.randint(0, 11, (2, 6))
    with parametrize.cached(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
        opt.step()
