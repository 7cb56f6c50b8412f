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
    params = dict(converted.named_parameters())
    ref = {}
    for name, p in params.items():
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
