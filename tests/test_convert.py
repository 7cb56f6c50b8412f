"""Tests of the converter (stiefelize, export_state_dict, unstiefelize) on every built-in layout.

Each adapter is exercised on a tiny random-config model (no downloads): torch ``nn.MultiheadAttention`` in
both ``batch_first`` layouts, inside ``nn.TransformerEncoder``, ``nn.Transformer`` and torchvision's
``VisionTransformer``, with separate ``kdim``/``vdim``; HuggingFace Llama (grouped-query attention and
rotary embeddings), BERT (``query``/``key``), GPT-2 (``c_attn`` Conv1D and cross-attention); timm's ViT
(fused ``qkv``). Numerics in float64 against an independent reference: the query/key head blocks are located
by hand below (not through the converter's table) and made orthonormal with a QR factorisation.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import geoopt
import pytest
import torch
from conftest import F64, ORTHO_TOL_F64, move_every_parameter_, polar64, rel
from torch import nn

import geoopt_stiefel_attention.convert as convert_module
from geoopt_stiefel_attention import (
    LAYOUTS,
    Block,
    EuclideanMultiheadAttention,
    Layout,
    StiefelAdam,
    export_state_dict,
    frame_parameters,
    is_frame,
    param_groups,
    query_key_projections,
    stiefelize,
    unstiefelize,
)
from geoopt_stiefel_attention._guard import FrameOffManifoldError
from geoopt_stiefel_attention.convert import converted_query_key_frames

#: agreement of two float64 forward passes that compute the same function in different orders
SAME_TOL = 1e-10
#: a change of the function must exceed this (relative)
DIFFER_MIN = 1e-4
#: a float32 forward pass reproduced after conversion of orthonormal blocks (float32 rounding)
F32_TOL = 1e-5
STEPS = 20



class _Optional:
    """A library imported at its first use: a test that needs it and lacks it is skipped there, alone, while
    the torch-only tests of this file run without transformers, timm or torchvision."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's collection probes module attributes for private markers
            raise AttributeError(attr)
        return getattr(pytest.importorskip(self._name), attr)


transformers = _Optional("transformers")
timm = _Optional("timm")
torchvision = _Optional("torchvision")


# ------------------------------------------------------------------------------------------ cases
@dataclass
class Case:
    """A tiny model: how to build it, run it, and where its query/key head blocks live (written by hand).

    ``blocks(model)`` yields ``(tensor, dim, start, length, r)``: rows (dim 0) or columns (dim 1)
    ``start:start+length`` of ``tensor`` are heads of size ``r``, query first, then key, per layer.
    """

    build: Callable[[], nn.Module]
    run: Callable[[nn.Module], torch.Tensor]
    heads: list[tuple[int, int]]
    blocks: Callable[[nn.Module], list[tuple[torch.Tensor, int, int, int, int]]]


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ids(seed=1):
    return torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(seed))


def _encoder(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first, dtype=F64)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _mha_blocks(paths, e, r):
    def blocks(model):
        out = []
        for p in paths:
            w = model.get_submodule(p).in_proj_weight
            out += [(w, 0, 0, e, r), (w, 0, e, e, r)]
        return out
    return blocks


def _seq_first_transformer():
    torch.manual_seed(0)
    with warnings.catch_warnings():  # torch notes that seq-first layouts have no nested-tensor fast path
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        return nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, dtype=F64)


class KdimAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, kdim=12, vdim=10, batch_first=True, dtype=F64)

    def forward(self, q, k, v):
        return self.attn(q, k, v, need_weights=False)[0]


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(F64).eval()


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(F64).eval()
    with torch.no_grad():  # Qwen2 has query/key biases (zero at init): make them matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_()
            layer.self_attn.k_proj.bias.normal_()
    return model


def _bert():
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertModel(cfg, add_pooling_layer=False).to(F64).eval()


def _gpt2_config(**kw):
    kw = dict(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0) | kw
    return transformers.GPT2Config(**kw)


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(_gpt2_config(add_cross_attention=True)).to(F64).eval()


def _timm_vit(**kw):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=16,
                             depth=2, num_heads=2, num_classes=3, **kw).to(F64).eval()


def _tv_vit():
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=16, mlp_dim=32, num_classes=3).to(F64).eval()
    nn.init.normal_(model.heads.head.weight)  # torchvision starts the head at zero
    return model


class FusedQKVAttention(nn.Module):
    """A fused ``qkv`` Linear (the built-in "fused qkv Linear" layout) under grouped-query attention: its rows
    are ``heads * head_dim`` query rows, then ``kv_heads * head_dim`` key rows and as many value rows, as the
    module declares (``num_heads``, ``num_key_value_heads``, ``head_dim``)."""

    def __init__(self, d=16, heads=4, kv_heads=1, head_dim=4):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * head_dim, dtype=F64)
        with torch.no_grad():
            self.qkv.bias.normal_()

    def forward(self, x):
        b, t, _ = x.shape
        h, kv, r = self.num_heads, self.num_key_value_heads, self.head_dim
        q, k, v = self.qkv(x).split([h * r, kv * r, kv * r], dim=-1)
        q = q.view(b, t, h, r).transpose(1, 2)
        k, v = (z.view(b, t, kv, r).transpose(1, 2).repeat_interleave(h // kv, dim=1) for z in (k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h * r)


def _fused_qkv_gqa(**kw):
    torch.manual_seed(0)
    return nn.Sequential(FusedQKVAttention(**kw), FusedQKVAttention(**kw))


def _exaone_vision(kv_heads=1):
    """HF EXAONE 4.5's vision tower: a fused ``qkv`` Linear with 4 query heads and ``kv_heads`` key/value heads."""
    cfg = transformers.Exaone4_5_VisionConfig(depth=2, hidden_size=32, intermediate_size=32, num_heads=4,
                                              num_key_value_heads=kv_heads, patch_size=2, temporal_patch_size=1,
                                              spatial_merge_size=1, window_size=4, out_hidden_size=32,
                                              fullatt_block_indexes=[1])
    torch.manual_seed(0)
    return transformers.Exaone4_5_VisionModel(cfg).to(F64).eval()


def _exaone_run(model):
    return model(_x(16, 12), torch.tensor([[1, 4, 4]])).last_hidden_state


def _rows(get, q_rows, k_rows, r):
    """Blocks of separate q/k weights: ``get(model)`` yields ``(w_q, w_k)`` per layer."""
    def blocks(model):
        out = []
        for wq, wk in get(model):
            out += [(wq, 0, 0, q_rows, r), (wk, 0, 0, k_rows, r)]
        return out
    return blocks


CASES = {
    "torch_mha_batch_first": Case(lambda: _encoder(True), lambda m: m(_x(2, 5, 16)), [(4, 4)] * 2,
                                  _mha_blocks(["layers.0.self_attn", "layers.1.self_attn"], 16, 4)),
    "torch_mha_seq_first": Case(lambda: _encoder(False), lambda m: m(_x(5, 2, 16)), [(4, 4)] * 2,
                                _mha_blocks(["layers.0.self_attn", "layers.1.self_attn"], 16, 4)),
    "torch_transformer": Case(
        lambda: _seq_first_transformer(),
        lambda m: m(_x(6, 2, 16), _x(4, 2, 16, seed=2)), [(2, 2)] * 3,
        _mha_blocks(["encoder.layers.0.self_attn", "decoder.layers.0.self_attn",
                     "decoder.layers.0.multihead_attn"], 16, 8)),
    "torch_mha_kdim": Case(
        lambda: (torch.manual_seed(0), KdimAttention())[1],
        lambda m: m(_x(2, 5, 16), _x(2, 3, 12, seed=2), _x(2, 3, 10, seed=3)), [(2, 2)],
        _rows(lambda m: [(m.attn.q_proj_weight, m.attn.k_proj_weight)], 16, 16, 8)),
    "torchvision_vit": Case(_tv_vit, lambda m: m(_x(2, 3, 16, 16)), [(2, 2)] * 2,
                            _mha_blocks([f"encoder.layers.encoder_layer_{i}.self_attention" for i in range(2)],
                                        16, 8)),
    "llama_gqa_rotary": Case(_llama, lambda m: m(input_ids=_ids()).logits, [(4, 2)] * 2,
                             _rows(lambda m: [(a.self_attn.q_proj.weight, a.self_attn.k_proj.weight)
                                              for a in m.model.layers], 16, 8, 4)),
    "qwen2_gqa_qk_bias": Case(_qwen2, lambda m: m(input_ids=_ids()).logits, [(4, 2)] * 2,
                              _rows(lambda m: [(a.self_attn.q_proj.weight, a.self_attn.k_proj.weight)
                                               for a in m.model.layers], 16, 8, 4)),
    "bert_query_key": Case(_bert, lambda m: m(input_ids=_ids()).last_hidden_state, [(2, 2)] * 2,
                           _rows(lambda m: [(lay.attention.self.query.weight, lay.attention.self.key.weight)
                                            for lay in m.encoder.layer], 16, 16, 8)),
    "gpt2_c_attn_and_cross": Case(
        _gpt2, lambda m: m(input_ids=_ids(), encoder_hidden_states=_x(2, 3, 16)).logits, [(2, 2)] * 4,
        lambda m: [blk for h in m.transformer.h for blk in (
            (h.attn.c_attn.weight, 1, 0, 16, 8), (h.attn.c_attn.weight, 1, 16, 16, 8),
            (h.crossattention.q_attn.weight, 1, 0, 16, 8), (h.crossattention.c_attn.weight, 1, 0, 16, 8))]),
    "timm_fused_qkv": Case(_timm_vit, lambda m: m(_x(2, 3, 16, 16)), [(2, 2)] * 2,
                           lambda m: [blk for b in m.blocks for blk in (
                               (b.attn.qkv.weight, 0, 0, 16, 8), (b.attn.qkv.weight, 0, 16, 16, 8))]),
    "fused_qkv_gqa": Case(_fused_qkv_gqa, lambda m: m(_x(2, 5, 16)), [(4, 1)] * 2,
                          lambda m: [blk for a in m for blk in ((a.qkv.weight, 0, 0, 16, 4),
                                                                 (a.qkv.weight, 0, 16, 4, 4))]),
    "exaone_vision_fused_qkv_gqa": Case(_exaone_vision, _exaone_run, [(4, 1)] * 2,
                                        lambda m: [blk for b in m.blocks for blk in (
                                            (b.attn.qkv.weight, 0, 0, 32, 8), (b.attn.qkv.weight, 0, 32, 8, 8))]),
}


def head_blocks(blk) -> list[torch.Tensor]:
    """The (d, r) head blocks of one projection, as views into the weight."""
    w, dim, start, length, r = blk
    if dim == 0:
        return [w[start + h * r:start + (h + 1) * r].t() for h in range(length // r)]
    return [w[:, start + h * r:start + (h + 1) * r] for h in range(length // r)]


def set_blocks(model, case, scales=None):
    """Make every query/key head block orthonormal (QR of a Gaussian), times ``scales[i]`` if given."""
    g = torch.Generator().manual_seed(5)
    i = 0
    with torch.no_grad():
        for blk in case.blocks(model):
            for view in head_blocks(blk):
                q, _ = torch.linalg.qr(torch.randn(view.shape, generator=g, dtype=F64))
                view.copy_(q * (1.0 if scales is None else scales[i]))
                i += 1


def max_ortho_error(p) -> float:
    w = p.detach()
    eye = torch.eye(w.shape[-1], dtype=w.dtype)
    return float((w.transpose(-1, -2) @ w - eye).abs().max())


# ------------------------------------------------------------------------------------------ per adapter
@pytest.mark.parametrize("name", CASES)
def test_frames_equal_heads_and_report(name):
    case = CASES[name]
    model = case.build()
    report = stiefelize(model)
    assert [(c.q_heads, c.k_heads) for c in report] == case.heads
    frames = frame_parameters(model)
    assert len(frames) == 2 * len(case.heads)
    assert sorted(f.shape[0] for f in frames) == sorted(h for pair in case.heads for h in pair)
    assert all(isinstance(f, geoopt.ManifoldParameter) and is_frame(f) for f in frames)
    assert all(p.is_contiguous() for p in model.parameters())
    assert report.num_frames == sum(q + k for q, k in case.heads)
    text = str(report)
    assert text.startswith(f"stiefelize: {len(case.heads)} attention module(s) converted")
    assert all(c.path in text for c in report)
    # query_key_projections lists the converted frames, q then k, per module
    listed = query_key_projections(model)
    assert [p for p, _, _ in listed] == [c.path for c in report]
    assert [(wq.shape[0], wk.shape[0]) for _, wq, wk in listed] == case.heads


@pytest.mark.parametrize("name", CASES)
def test_trains_on_the_manifold_and_loss_goes_down(name):
    case = CASES[name]
    model = case.build()
    stiefelize(model, logit_gain="learn")
    start = [f.detach().clone() for f in frame_parameters(model)]
    target = torch.randn_like(case.run(model).detach())
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = (case.run(model) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
    frames = frame_parameters(model)
    assert all(max_ortho_error(f) < ORTHO_TOL_F64 for f in frames)
    assert all(float((f.detach() - f0).abs().max()) > DIFFER_MIN for f, f0 in zip(frames, start, strict=True))
    # companion: AdamW on the same frames leaves the manifold
    plain = case.build()
    stiefelize(plain)
    adamw = torch.optim.AdamW(param_groups(plain), lr=1e-2)
    with pytest.raises(FrameOffManifoldError, match="does not know the constraint"):  # reported, not silent
        for _ in range(3):
            adamw.zero_grad(set_to_none=True)
            (case.run(plain) - target).square().mean().backward()
            adamw.step()
    assert max(max_ortho_error(f) for f in frame_parameters(plain)) > 1e-3


@pytest.mark.parametrize("name", CASES)
def test_export_loads_into_stock_model_and_unstiefelize_restores(name):
    case = CASES[name]
    model = case.build()
    stock_keys = list(model.state_dict())
    stiefelize(model, logit_gain="fit")
    move_every_parameter_(model, euclidean=0.01)  # so the export is not the initial state
    expected = case.run(model).detach()
    state = export_state_dict(model)
    assert sorted(state) == sorted(stock_keys)
    assert all(type(t) is torch.Tensor and t.is_contiguous() for t in state.values())
    stock = case.build()
    stock.load_state_dict(state, strict=True)
    torch.testing.assert_close(case.run(stock), expected, rtol=0, atol=SAME_TOL)
    # unstiefelize: plain modules in place, same function, stock keys
    classes = [type(m) for m in case.build().modules()]
    with pytest.warns(UserWarning, match="unstiefelize: .*Build the optimizer again"):
        assert unstiefelize(model) is model
    assert [type(m) for m in model.modules()] == classes  # the host classes themselves, not parametrized subclasses
    assert not frame_parameters(model) and sorted(model.state_dict()) == sorted(stock_keys)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(case.run(model), expected, rtol=0, atol=SAME_TOL)
    with pytest.raises(ValueError, match="nothing to undo"):
        unstiefelize(model)
    with pytest.raises(ValueError, match="no weight converted"):
        export_state_dict(model)


@pytest.mark.parametrize("name", CASES)
def test_orthonormal_blocks_convert_exactly_and_others_change(name):
    case = CASES[name]
    model = case.build()
    set_blocks(model, case)
    before = case.run(model).detach()
    report = stiefelize(model, probe=None)
    torch.testing.assert_close(case.run(model), before, rtol=0, atol=SAME_TOL)
    assert report.output_change is None
    # companion: the default (std 0.02 / Xavier) blocks are not orthonormal, so conversion changes the output
    fresh = case.build()
    probe_out = case.run(fresh).detach()
    changed = case.build()
    stiefelize(changed)
    assert rel(case.run(changed), probe_out) > DIFFER_MIN


def test_orthonormal_blocks_in_float32_reproduce_to_rounding():
    case = CASES["llama_gqa_rotary"]
    model = case.build()
    set_blocks(model, case)
    model.float()
    ids = _ids()
    before = model(input_ids=ids).logits.detach()
    stiefelize(model)
    after = model(input_ids=ids).logits.detach()
    assert rel(after, before) < F32_TOL


class _Halve(nn.Module):
    """Some other parametrization a user may have put on a weight."""

    def forward(self, w):
        return 0.5 * w


@pytest.mark.parametrize("name", CASES)
def test_weight_parametrized_by_something_else_is_refused_atomically(name):
    from torch.nn.utils import parametrize

    case = CASES[name]
    model = case.build()
    target = case.blocks(model)[-1][0]  # the key weight of the last layer
    owner_path, attr = next(n for n, p in model.named_parameters() if p is target).rsplit(".", 1)
    parametrize.register_parametrization(model.get_submodule(owner_path), attr, _Halve())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"{attr} is already parametrized \(_Halve\)"):
        stiefelize(model)
    after = dict(model.named_parameters())
    assert sorted(after) == sorted(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert not frame_parameters(model)


# ------------------------------------------------------------------------------------------ logit gain
def test_fit_gain_preserves_scaled_orthonormal_heads_under_gqa_and_rotary():
    case = CASES["llama_gqa_rotary"]
    n = sum(length // r for _, _, _, length, r in case.blocks(case.build()))
    scales = torch.linspace(0.2, 3.0, n).tolist()
    model = case.build()
    set_blocks(model, case, scales)
    before = case.run(model).detach()
    report = stiefelize(model, logit_gain="fit", probe={"input_ids": _ids()})
    torch.testing.assert_close(case.run(model), before, rtol=0, atol=SAME_TOL)
    assert report.output_change < SAME_TOL
    # the fitted gain of query head h is scale(q_h) * scale(k_{h // 2}) (two query heads per key head)
    q_scales, k_scales = scales[0:4], scales[4:6]
    gains = model.model.layers[0].self_attn.q_proj.parametrizations.weight[0]
    fitted = torch.exp(gains.gain_rate * gains.q_log_gain.detach())
    torch.testing.assert_close(fitted, torch.tensor([q_scales[h] * k_scales[h // 2] for h in range(4)],
                                                    dtype=F64), rtol=1e-12, atol=0)
    # companion: without the gain the scaled heads lose their logit scale
    plain = case.build()
    set_blocks(plain, case, scales)
    report = stiefelize(plain, probe={"input_ids": _ids()})
    assert report.output_change > DIFFER_MIN


def test_learned_gain_starts_at_one_and_moves_fast():
    case = CASES["gpt2_c_attn_and_cross"]
    a, b = case.build(), case.build()
    stiefelize(a)
    stiefelize(b, logit_gain="learn", gain_rate=10.0)
    torch.testing.assert_close(case.run(b), case.run(a), rtol=0, atol=0)
    log_gains = [p for n, p in b.named_parameters() if n.endswith("q_log_gain")]
    assert len(log_gains) == 4 and all(p.shape == (2,) for p in log_gains)
    no_decay = {g["name"]: g for g in param_groups(b)}["no_decay"]["params"]
    assert {id(p) for p in log_gains} <= {id(p) for p in no_decay}
    # theta moves by ~lr per Adam step, so the gain moves by a factor exp(rate * lr) per step
    opt = torch.optim.Adam(log_gains, lr=1e-2)
    for _ in range(25):
        opt.zero_grad()
        (-case.run(b).logsumexp(-1).mean()).backward()  # any loss; the log-gains get gradients
        opt.step()
    assert max(float(p.detach().abs().max()) * 10.0 for p in log_gains) > 1.0  # some gain moved by > e
    with pytest.raises(ValueError, match="gain_rate"):
        stiefelize(case.build(), logit_gain="learn", gain_rate=0.0)
    with pytest.warns(UserWarning, match=r"gain_rate=5.0 has no effect with logit_gain=None"):
        stiefelize(case.build(), gain_rate=5.0)  # nothing for the rate to scale: said, not ignored
    with warnings.catch_warnings():  # companion: the default rate, or a rate with gains, is silent
        warnings.simplefilter("error")
        stiefelize(case.build())
        stiefelize(case.build(), logit_gain="learn", gain_rate=5.0)
    with pytest.raises(ValueError, match="logit_gain='yes' is unknown"):
        stiefelize(case.build(), logit_gain="yes")


def test_former_options_are_gone():
    """The options of the former module-replacing converter were removed before any release (CHANGELOG): a bool
    ``logit_gain`` is an unknown mode, ``frames=``/``drop_qk_bias=`` unknown keywords; nothing is converted.
    Companion: the current spellings convert."""
    case = CASES["torch_mha_batch_first"]
    model = case.build()
    with pytest.raises(ValueError, match="logit_gain=True is unknown"):
        stiefelize(model, logit_gain=True)
    for old in ({"frames": "head"}, {"drop_qk_bias": True}):
        with pytest.raises(TypeError, match=next(iter(old))):
            stiefelize(model, **old)
    assert not frame_parameters(model)
    result = stiefelize(model, logit_gain="learn", qk_bias="drop")
    assert all(c.logit_gain.startswith("learn") for c in result)


# ------------------------------------------------------------------------------------------ refusals
def test_nothing_to_convert_raises_naming_the_search_and_non_strict_warns():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"no attention module of Sequential.*q_proj/k_proj Linear"):
        stiefelize(mlp)
    with pytest.warns(UserWarning, match="no attention module"):
        report = stiefelize(mlp, strict=False)
    assert len(report) == 0 and not frame_parameters(mlp)


def test_head_size_larger_than_width_is_refused_atomically():
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"St\(16, 32\) cannot exist"):
        stiefelize(model)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())  # unchanged


def test_already_converted_is_refused():
    model = _encoder(True)
    stiefelize(model)
    with pytest.raises(ValueError, match="already parametrized.*unstiefelize"):
        stiefelize(model)


class MyAttention(nn.Module):
    """Separate projections with unforeseen names and no head attribute."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        b, t, e = x.shape
        h = self.heads
        split = [p(x).view(b, t, h, e // h).transpose(1, 2) for p in (self.wq, self.wk, self.wv)]
        return nn.functional.scaled_dot_product_attention(*split).transpose(1, 2).reshape(b, t, e)


def test_unforeseen_attention_is_refused_then_converted_by_an_explicit_layout():
    model = nn.Sequential(MyAttention(), nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"'0': MyAttention looks like attention but matches no layout"):
        stiefelize(model)
    mine = Layout("wq/wk", Block("wq.weight"), Block("wk.weight"), head_dim=lambda m: m.wq.out_features // m.heads)
    report = stiefelize(model, targets=(*LAYOUTS, mine))
    assert [(c.path, c.layout, c.q_heads, c.r) for c in report] == [("0", "wq/wk", 2, 8)]
    # a layout that matches but cannot tell the head size says what to pass
    no_heads = nn.Sequential(MyAttention())
    with pytest.raises(ValueError, match="cannot tell its head size.*head_dim="):
        stiefelize(no_heads, targets=[Layout("wq/wk", Block("wq.weight"), Block("wk.weight"))])


def test_probe_of_a_zero_output_says_why_the_relative_change_is_undefined():
    """torchvision's ViT starts its head at zero: no relative change exists, and the report says so (not nan)."""
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                                 hidden_dim=16, mlp_dim=32, num_classes=3).to(F64).eval()
    probe = torch.randn(2, 3, 16, 16, dtype=F64)
    report = stiefelize(model, probe=probe)
    assert report.output_change is None and report.output_norm_before == 0 and report.output_change_abs == 0
    text = str(report)
    assert "relative output change on the probe batch undefined: the output before conversion is zero; " \
           "absolute change 0" in text and "nan" not in text
    # companion: a non-zero head gives the relative change, printed as a number
    changed = _tv_vit()
    report = stiefelize(changed, probe=torch.randn(2, 3, 16, 16, dtype=F64))
    assert report.output_change > DIFFER_MIN and report.output_norm_before > 0
    assert report.output_change == pytest.approx(report.output_change_abs / report.output_norm_before, rel=1e-12)
    assert f"relative output change on the probe batch: {report.output_change:.3g}" in str(report)
    # and without a probe nothing is said about the output
    assert "output change" not in str(stiefelize(_tv_vit()))


class ToQK(nn.Module):
    """A custom attention block whose class name does not say "attention": ``to_q``/``to_k``/``to_v`` and
    ``num_heads`` (diffusers' and lucidrains' spelling)."""

    def __init__(self, width=16, num_heads=2):
        super().__init__()
        self.num_heads = num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        b, t, e = x.shape
        h = self.num_heads
        split = [p(x).view(b, t, h, e // h).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v)]
        return nn.functional.scaled_dot_product_attention(*split).transpose(1, 2).reshape(b, t, e)


def test_custom_attention_named_by_its_qk_children_is_refused_by_path_with_the_layout_to_write():
    model = nn.ModuleDict({"blocks": nn.ModuleList([nn.ModuleDict({"mix": ToQK(), "mlp": nn.Linear(16, 16)})
                                                    for _ in range(4)])})
    with pytest.raises(ValueError) as err:
        stiefelize(model)
    msg = str(err.value)
    assert "'blocks.0.mix', 'blocks.1.mix', 'blocks.2.mix', ... (4 modules): ToQK looks like attention" in msg
    assert "query/key Linears 'to_q'/'to_k', heads from its num_heads=2" in msg
    snippet = "Layout('to_q/to_k', q=Block('to_q.weight'), k=Block('to_k.weight'))"
    assert snippet in msg and msg.count(snippet) == 1  # once for the four identical modules
    # the layout table by name only, not described: the message is short beside the names, whatever the table holds
    assert len(msg) - sum(len(lay.name) + 2 for lay in LAYOUTS) < 600 and "q = in_proj_weight" not in msg
    assert not frame_parameters(model)
    # the layout the message shows converts them
    report = stiefelize(model, targets=(*LAYOUTS, eval(snippet)))  # noqa: S307 - the message's own code
    assert [(c.path, c.q_heads, c.r) for c in report] == [(f"blocks.{i}.mix", 2, 8) for i in range(4)]
    # without a head count the snippet asks for head_dim
    plain = ToQK()
    del plain.num_heads
    with pytest.raises(ValueError, match=r"no head count found.*k=Block\('to_k.weight'\), head_dim=<int>\)"):
        stiefelize(nn.Sequential(plain))
    # companion: a model with nothing attention-like says so, instead of naming a module
    with pytest.raises(ValueError, match=r"no attention module of Sequential was converted.*no module looked like"):
        stiefelize(nn.Sequential(nn.Linear(4, 4)))
    # strict=False with nothing converted names the modules it left, in the warning
    with pytest.warns(UserWarning, match=r"no attention module.*left unconverted: 'blocks.0.mix'"):
        stiefelize(nn.ModuleDict({"blocks": nn.ModuleList([nn.ModuleDict({"mix": ToQK()})])}), strict=False)


class FusedGQA(nn.Module):
    """A fused (q | k | v) projection under grouped-query attention: 4 query heads, 2 key/value heads of 4."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(16, 16 + 8 + 8, dtype=F64)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split([16, 8, 8], dim=-1)
        q = q.view(b, t, 4, 4).transpose(1, 2)
        k, v = (z.view(b, t, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for z in (k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 16)


def test_explicit_spans_convert_a_fused_gqa_projection():
    torch.manual_seed(0)
    model = FusedGQA()
    with torch.no_grad():
        model.wqkv.bias.normal_()
    layout = Layout("fused GQA", Block("wqkv.weight", span=(0, 16)), Block("wqkv.weight", span=(16, 24)),
                    head_dim=4)
    report = stiefelize(model, targets=[layout], qk_bias="drop")
    assert [(c.q_heads, c.k_heads, c.r) for c in report] == [(4, 2, 4)]
    assert "wqkv.weight (rows 0:16)" in layout.describe()
    w, bias = model.wqkv.weight.detach(), model.wqkv.bias.detach()
    for rows in ([0, 4], [4, 8], [8, 12], [12, 16], [16, 20], [20, 24]):  # each head block is orthonormal
        block = w[rows[0]:rows[1]]
        assert float((block @ block.t() - torch.eye(4, dtype=F64)).abs().max()) < ORTHO_TOL_F64
    assert bool((bias[:24] == 0).all()) and bool((bias[24:] != 0).all())  # value bias kept
    x = _x(2, 5, 16)
    target = torch.randn(2, 5, 16, dtype=F64)
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        (model(x) - target).square().mean().backward()
        opt.step()
    assert all(max_ortho_error(f) < ORTHO_TOL_F64 for f in frame_parameters(model))
    # companions: a span outside the weight is refused, and so is an invalid span
    with pytest.raises(ValueError, match=r"fewer than span=\(16, 40\)"):
        stiefelize(FusedGQA(), targets=[Layout("bad", Block("wqkv.weight", span=(0, 16)),
                                               Block("wqkv.weight", span=(16, 40)), head_dim=4)])
    with pytest.raises(ValueError, match="span"):
        Block("wqkv.weight", span=(8, 4))
    # a span given with part/parts would silently win over them: refused, naming both
    with pytest.raises(ValueError, match=r"either span .* or part/parts"):
        Block("wqkv.weight", part=1, parts=3, span=(16, 24))
    assert Block("wqkv.weight", span=(16, 24)).locate(40) == (16, 8)  # companion: span alone is fine


def _hand_frames(model, case, scales):
    """The frames of each converted module located by hand: head block / its scale, as ``(q, k)`` stacks."""
    blocks = case.blocks(model)
    out, i = [], 0
    for blk in blocks:
        views = head_blocks(blk)
        out.append(torch.stack([v.detach() / scales[i + h] for h, v in enumerate(views)]))
        i += len(views)
    return list(zip(out[0::2], out[1::2], strict=True))


@pytest.mark.parametrize("kv_heads", [1, 4])
@pytest.mark.parametrize("name", ["fused_qkv_gqa", "exaone_vision_fused_qkv_gqa"])
def test_fused_qkv_is_split_by_the_declared_heads(name, kv_heads):
    """A fused q|k|v weight under grouped-query attention (4 query heads, 1 key/value head) is not three equal
    thirds: the query frames are its first 4 head blocks and the key frame the fifth. Scaled orthonormal blocks
    with fitted gains keep the function exactly only where every block lands on its own frame (equal thirds
    would make query heads 2 and 3 the "keys"). Companion (kv_heads=4): plain multi-head attention still splits
    into equal thirds and matches."""
    build, r = (_fused_qkv_gqa, 4) if name == "fused_qkv_gqa" else (_exaone_vision, 8)

    def blocks(m):
        weights = [a.qkv.weight for a in m] if name == "fused_qkv_gqa" else [b.attn.qkv.weight for b in m.blocks]
        return [blk for w in weights for blk in ((w, 0, 0, 4 * r, r), (w, 0, 4 * r, kv_heads * r, r))]

    case = Case(lambda: build(kv_heads=kv_heads), CASES[name].run, [(4, kv_heads)] * 2, blocks)
    model = case.build()
    n = sum(length // r for _, _, _, length, r in case.blocks(model))
    scales = torch.linspace(0.5, 2.0, n).tolist()
    set_blocks(model, case, scales)
    with torch.no_grad():  # a query/key bias would be scaled differently by the fitted gain: zero here
        for w, _, start, length, _ in case.blocks(model):
            next(m for m in model.modules() if getattr(m, "weight", None) is w).bias[start:start + length] = 0
    expected = _hand_frames(model, case, scales)
    before = case.run(model).detach()
    report = stiefelize(model, logit_gain="fit")
    assert [(c.q_heads, c.k_heads) for c in report] == case.heads
    split = f"grouped-query split: q rows 0:{4 * r}, k rows {4 * r}:{(4 + kv_heads) * r}"
    assert all((split in c.layout) == (kv_heads < 4) for c in report), [c.layout for c in report]
    for (_, qf, kf), (q_hand, k_hand) in zip(converted_query_key_frames(model), expected, strict=True):
        torch.testing.assert_close(qf.detach(), q_hand, rtol=0, atol=SAME_TOL)
        torch.testing.assert_close(kf.detach(), k_hand, rtol=0, atol=SAME_TOL)
    if name == "fused_qkv_gqa":
        torch.testing.assert_close(case.run(model).detach(), before, rtol=0, atol=SAME_TOL)
    else:  # EXAONE's vision rotary embedding runs in float32 whatever the model's dtype
        assert rel(case.run(model), before) < F32_TOL


def test_fused_qkv_gqa_bias_drop_takes_the_split_rows():
    model = _fused_qkv_gqa()
    value_bias = [a.qkv.bias.detach()[20:].clone() for a in model]
    stiefelize(model, qk_bias="drop")
    for a, kept in zip(model, value_bias, strict=True):
        assert bool((a.qkv.bias[:20] == 0).all()) and torch.equal(a.qkv.bias[20:], kept)


def _untouched(model, state):
    assert not frame_parameters(model) and model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("declared", ["kv_heads", "heads"])
def test_fused_qkv_whose_width_contradicts_the_declared_heads_is_refused(declared, strict):
    """Rows that are neither (H + 2 H_kv) r for a grouped-query module nor 3 H r for a multi-head one cannot be
    told apart: refused, naming the module and the explicit spans to pass, with the model unchanged."""
    model = _fused_qkv_gqa() if declared == "kv_heads" else _fused_qkv_gqa(kv_heads=4)
    for a in model:
        if declared == "kv_heads":
            a.num_key_value_heads = 2  # 24 rows, but (4 + 2*2) * 4 = 32
        else:
            a.num_heads = a.num_key_value_heads = 2  # 48 rows, but 3 * 2 * 4 = 24
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pattern = (r"'0', '1': FusedQKVAttention matches layout 'fused qkv Linear' but qkv.weight has 24 rows, which is "
               r"not q\|k\|v for the num_heads=4 query and num_key_value_heads=2 key/value heads of size 4"
               if declared == "kv_heads" else
               r"'0', '1': FusedQKVAttention matches layout 'fused qkv Linear' but qkv.weight has 48 rows, not 3 "
               r"equal parts of num_heads=2 heads of size 4 \(24\)")
    fix = r".*pass targets=\[Layout\('fused qkv Linear', q=Block\('qkv.weight', span=\(start, stop\)\)"
    if strict:
        with pytest.raises(ValueError, match=pattern + fix):
            stiefelize(model)
    else:
        with pytest.warns(UserWarning, match=pattern + fix):
            stiefelize(model, strict=False)
    _untouched(model, state)


def _phi3(kv_heads):
    cfg = transformers.Phi3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(cfg).to(F64).eval()


def test_a_layout_of_equal_thirds_is_split_by_heads_on_phi3_gqa():
    """A Layout written with part/parts for Phi-3's ``qkv_proj`` (4 query heads, 1 key/value head: 24 rows) used
    to take rows 0:8 as queries and 8:16 as keys; the declared heads now split it (q 0:16, k 16:20), and a layout
    that is not q|k|v order under grouped-query attention is refused."""
    layout = Layout("phi3 qkv_proj", Block("qkv_proj.weight", 0, 0, 3), Block("qkv_proj.weight", 0, 1, 3))
    case = Case(lambda: _phi3(1), lambda m: m(input_ids=_ids()).logits, [(4, 1)] * 2,
                lambda m: [blk for lay in m.model.layers for blk in (
                    (lay.self_attn.qkv_proj.weight, 0, 0, 16, 4), (lay.self_attn.qkv_proj.weight, 0, 16, 4, 4))])
    model = case.build()
    scales = torch.linspace(0.5, 2.0, 10).tolist()
    set_blocks(model, case, scales)
    expected = _hand_frames(model, case, scales)
    before = case.run(model).detach()
    report = stiefelize(model, targets=[layout], logit_gain="fit")
    assert [(c.q_heads, c.k_heads) for c in report] == case.heads
    for (_, qf, kf), (q_hand, k_hand) in zip(converted_query_key_frames(model), expected, strict=True):
        torch.testing.assert_close(qf.detach(), q_hand, rtol=0, atol=SAME_TOL)
        torch.testing.assert_close(kf.detach(), k_hand, rtol=0, atol=SAME_TOL)
    torch.testing.assert_close(case.run(model).detach(), before, rtol=0, atol=SAME_TOL)
    # companion: keys before queries cannot be mapped onto declared heads: refused, nothing changed
    swapped = Layout("k|q|v", Block("qkv_proj.weight", 0, 1, 3), Block("qkv_proj.weight", 0, 0, 3))
    model = _phi3(1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"declares num_key_value_heads=1 key/value heads for "
                                         r"config.num_attention_heads=4 query heads, so qkv_proj.weight is not 3 "
                                         r"equal parts as the layout says; pass targets="):
        stiefelize(model, targets=[swapped])
    _untouched(model, state)


def test_callable_targets_choose_modules():
    case = CASES["bert_query_key"]
    model = case.build()
    report = stiefelize(model, targets=lambda path, m: path.endswith("layer.1.attention.self"))
    assert [c.path for c in report] == ["encoder.layer.1.attention.self"]
    with pytest.raises(ValueError, match="no built-in layout matches"):
        stiefelize(case.build(), targets=lambda path, m: path == "encoder")
    with pytest.raises(ValueError, match="returned 'yes'"):
        stiefelize(case.build(), targets=lambda path, m: "yes")
    with pytest.raises(ValueError, match="targets='all' is unknown"):
        stiefelize(case.build(), targets="all")


def test_attention_that_no_layout_of_the_table_matches_is_refused_unless_not_strict():
    """timm's attention pool (AttentionPoolLatent: q + kv Linears) against a table without the "q + kv Linear" layout:
    refused, then left Euclidean with strict=False. The built-in table converts it (test_convert_vision_models.py)."""
    model = _timm_vit(global_pool="map")
    table = [lay for lay in LAYOUTS if lay.name != "q + kv Linear"]
    with pytest.raises(ValueError, match="AttentionPoolLatent looks like attention"):
        stiefelize(model, targets=table)
    assert not frame_parameters(model)
    with pytest.warns(UserWarning, match="left unconverted"):
        report = stiefelize(model, targets=table, strict=False)
    assert len(report) == 2 and [p for p, _ in report.skipped] == ["attn_pool"]
    assert [row.path for row in stiefelize(_timm_vit(global_pool="map"))][-1] == "attn_pool"


def test_library_euclidean_module_points_to_from_euclidean():
    model = nn.Sequential(EuclideanMultiheadAttention(16, 2))
    with pytest.raises(ValueError, match="from_euclidean"):
        stiefelize(model)


def test_bad_options_raise_before_anything_changes():
    model = _encoder(True)
    for kw, match in (({"qk_bias": "zero"}, "qk_bias"), ({"strict": 1}, "strict"),
                      ({"targets": [LAYOUTS[0], "x"]}, "targets")):
        with pytest.raises(ValueError, match=match):
            stiefelize(model, **kw)
    assert not frame_parameters(model)


# ------------------------------------------------------------------------------------------ biases
def test_qk_bias_keep_and_drop():
    case = CASES["timm_fused_qkv"]
    model = case.build()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.qkv.bias.normal_()
    v_bias = model.blocks[0].attn.qkv.bias[32:].detach().clone()
    kept = copy.deepcopy(model)
    stiefelize(kept)
    assert bool((kept.blocks[0].attn.qkv.bias[:32] != 0).all())  # free and untouched
    stiefelize(model, qk_bias="drop")
    bias = model.blocks[0].attn.qkv.bias
    assert bool((bias[:32] == 0).all()) and torch.equal(bias[32:], v_bias)
    state = export_state_dict(model)
    assert bool((state["blocks.0.attn.qkv.bias"][:32] == 0).all())
    # torch kdim layout: the q/k biases live in in_proj_bias, not next to q_proj_weight
    mha = KdimAttention()
    with torch.no_grad():
        mha.attn.in_proj_bias.normal_()
    stiefelize(mha, qk_bias="drop")
    assert bool((mha.attn.in_proj_bias[:32] == 0).all()) and bool((mha.attn.in_proj_bias[32:] != 0).all())


# ------------------------------------------------------------------------------------------ torch specifics
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_encoder_fast_path_in_eval_sees_the_rebuilt_weight(monkeypatch):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    stiefelize(model, logit_gain="learn")
    calls = []
    fused = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: calls.append(1) or fused(*a))
    with torch.no_grad():
        for p in frame_parameters(model):  # move the frames away from their start
            p.copy_(p.manifold.retr(p, 0.3 * p.manifold.proju(p, torch.randn_like(p))))
        fast = model(x, src_key_padding_mask=pad)  # eval + no_grad: torch's fused path
    assert len(calls) == 2  # the fused kernel ran, once per layer, on the rebuilt weights
    fast = fast.to_padded_tensor(0.0) if fast.is_nested else fast
    slow = model(x, src_key_padding_mask=pad)  # grad enabled: the Python path
    keep = ~pad
    torch.testing.assert_close(fast[keep], slow[keep].detach(), rtol=0, atol=F32_TOL)
    stock = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0,
                                                             batch_first=True), 2).eval()
    stock.load_state_dict(export_state_dict(model))
    with torch.no_grad():
        torch.testing.assert_close(stock(x, src_key_padding_mask=pad)[keep], fast[keep], rtol=0, atol=F32_TOL)


def test_deepcopy_is_independent_and_state_dict_roundtrips():
    model = _encoder(True)
    stiefelize(model)
    clone = copy.deepcopy(model)
    x = _x(2, 5, 16)
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    with torch.no_grad():
        frame_parameters(clone)[0].mul_(-1)
    assert rel(clone(x), model(x)) > DIFFER_MIN
    assert not any(a is b for a, b in zip(frame_parameters(clone), frame_parameters(model), strict=True))
    # the converted state dict (frames, gains, rest) loads into a freshly converted model: checkpoints resume
    other = _encoder(True)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    stiefelize(other)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
    assert all(isinstance(p, geoopt.ManifoldParameter) for p in frame_parameters(other))


def test_assigning_a_weight_sets_frames_to_its_polar_factors():
    case = CASES["torch_mha_batch_first"]
    model = case.build()
    stiefelize(model)
    attn = model.layers[0].self_attn
    new = torch.randn(48, 16, dtype=F64, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match="reads back up to"):  # not frames: said (see the test below)
        attn.in_proj_weight = new
    rebuilt = attn.in_proj_weight.detach()
    assert torch.equal(rebuilt[32:], new[32:])  # value rows: as assigned
    for h in range(4):  # query head h: the polar factor U of its block A (U orthonormal, U^T A symmetric PD)
        a, u = new[4 * h:4 * h + 4].t(), rebuilt[4 * h:4 * h + 4].t()
        assert float((u.t() @ u - torch.eye(4, dtype=F64)).abs().max()) < ORTHO_TOL_F64
        sym = u.t() @ a
        assert float((sym - sym.t()).abs().max()) < 1e-12 and bool((torch.linalg.eigvalsh(sym) > 0).all())
    assert not torch.allclose(rebuilt[:16], new[:16])  # companion: the query rows are not copied as given


def test_shared_attention_module_is_converted_once():
    attn = nn.MultiheadAttention(16, 2, batch_first=True)
    model = nn.ModuleDict({"a": attn, "b": nn.ModuleList([attn])})
    report = stiefelize(model)
    assert len(report) == 1 and len(frame_parameters(model)) == 2


# ------------------------------------------------------------------------------------------ saving
def test_safetensors_and_save_pretrained_roundtrip(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    vit = CASES["timm_fused_qkv"]
    model = vit.build()
    stiefelize(model)
    expected = vit.run(model).detach()
    safetensors_torch.save_file(export_state_dict(model), tmp_path / "vit.safetensors")
    stock = vit.build()
    stock.load_state_dict(safetensors_torch.load_file(tmp_path / "vit.safetensors"), strict=True)
    torch.testing.assert_close(vit.run(stock), expected, rtol=0, atol=SAME_TOL)
    # HF: save_pretrained with the exported state dict, from_pretrained into the stock class
    case = CASES["gpt2_c_attn_and_cross"]
    model = case.build()
    stiefelize(model, logit_gain="learn")
    expected = case.run(model).detach()
    model.save_pretrained(tmp_path / "hf", state_dict=export_state_dict(model))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(case.run(loaded), expected, rtol=0, atol=SAME_TOL)
    assert not frame_parameters(loaded)


@pytest.mark.parametrize("form", ["stock", "parametrized"])
def test_a_float32_state_dict_loads_into_an_encoder_moved_to_float64_without_a_warning(form):
    """A converted ``nn.TransformerEncoder`` moved to float64 and given the float32 state dict of a converted
    one (either form): no warning, float64 frames (re-projected, as by ``.double()``) within float32's tolerance
    of the saved ones, the saved function, and a training forward that accepts the frames. Companion: the same
    state dict with its query/key blocks off by 1e-2, far above float32's tolerance, still warns (stock form) or
    is refused by the training forward (parametrized form)."""
    from geoopt_stiefel_attention import parametrized_state_dict
    from geoopt_stiefel_attention._guard import FRAME_CHECK_TOLERANCE
    from geoopt_stiefel_attention._linalg import ORTHONORMALITY_TOLERANCE

    def encoder(seed):
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        stiefelize(model)
        return model

    saved = encoder(0)
    with torch.no_grad():  # frames away from their start
        for f in frame_parameters(saved):
            f.copy_(f.manifold.retr(f, 0.3 * f.manifold.proju(f, torch.randn_like(f))))
    state = saved.state_dict() if form == "stock" else parametrized_state_dict(saved)
    model = encoder(1).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.load_state_dict(state, strict=True)
    for f, g in zip(frame_parameters(model), frame_parameters(saved), strict=True):
        w = f.detach()
        assert w.dtype == F64
        assert float((w.mT @ w - torch.eye(4, dtype=F64)).abs().max()) <= FRAME_CHECK_TOLERANCE[F64]
        assert float((w - g.detach().double()).abs().max()) <= ORTHONORMALITY_TOLERANCE[torch.float32]
    x = _x(2, 5, 16)
    with torch.no_grad():
        expected = saved.eval()(x.float()).double()
    assert float((model.eval()(x).detach() - expected).abs().max()) <= F32_TOL
    model.train()(x).sum().backward()  # the training forward checks the frames in float64
    # companion: off by far more than float32's rounding
    g = torch.Generator().manual_seed(5)
    keys = [k for k in state if k.endswith("in_proj_weight" if form == "stock" else "_frames")]
    bad = {k: v + 1e-2 * torch.randn(v.shape, generator=g) if k in keys else v for k, v in state.items()}
    model = encoder(1).double()
    if form == "stock":
        with pytest.warns(UserWarning, match="not orthonormal"):
            model.load_state_dict(bad, strict=True)
        return
    model.load_state_dict(bad, strict=True)
    with pytest.raises(FrameOffManifoldError, match="off the Stiefel manifold"):
        model.train()(x)


# ------------------------------------------------------------------------------------------ HF Trainer
class _Repeats(torch.utils.data.Dataset):
    """Sequences that repeat a random 4-token motif: learnable in a few steps."""

    def __init__(self, n=32, length=16, vocab=40):
        g = torch.Generator().manual_seed(0)
        motifs = torch.randint(1, vocab, (n, 4), generator=g)
        self.x = motifs.repeat(1, length // 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer_run(out_dir, max_steps, resume=None, logit_gain="learn"):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config(n_embd=32, n_head=4))
    stiefelize(model, logit_gain=logit_gain)
    opt = StiefelAdam(param_groups(model, weight_decay=0.01), lr=1e-2)
    args = transformers.TrainingArguments(
        str(out_dir), max_steps=max_steps, per_device_train_batch_size=8, save_steps=3, logging_steps=1,
        report_to=[], seed=0, use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Repeats(), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


#: a Trainer run resumed from its checkpoint against the uninterrupted run, with a learned logit gain: the
#: checkpoint is the stock model's, from which U_h and theta_h come back to float32 rounding only (measured: logits
#: 3e-7, losses 2e-7; the parameters themselves differ by up to 2e-4, in the key bias, whose gradient is zero in
#: exact arithmetic (softmax invariance) so that Adam's normalised step turns rounding noise into steps of size lr)
TRAINER_RESUME_TOL = 1e-5


def _max_logit_diff(a, b):
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    a.eval()
    b.eval()
    with torch.no_grad():
        return float((a(ids).logits - b(ids).logits).abs().max())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("gain", [None, "learn"])
def test_hf_trainer_checkpoints_resume_and_generate_uses_the_cache(tmp_path, gain):
    full, losses = _trainer_run(tmp_path / "full", 6, logit_gain=gain)
    assert losses[-1] < losses[0]
    assert all(max_ortho_error(f) < 1e-5 for f in frame_parameters(full))
    checkpoint = tmp_path / "full" / "checkpoint-3"
    saved = pytest.importorskip("safetensors.torch").load_file(checkpoint / "model.safetensors")
    assert not [k for k in saved if "parametrizations" in k]  # the stock checkpoint
    resumed, resumed_losses = _trainer_run(tmp_path / "resumed", 6, resume=str(checkpoint), logit_gain=gain)
    if gain is None:  # the frames are stored as they are: resume is bit-identical
        for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
            assert torch.equal(a, b), name
        assert resumed_losses == losses
    else:  # gamma_h * U_h is rounded in the checkpoint: the same run to float32 rounding
        assert _max_logit_diff(full, resumed) <= TRAINER_RESUME_TOL
        torch.testing.assert_close(resumed_losses, losses, rtol=TRAINER_RESUME_TOL, atol=0)
        assert all(max_ortho_error(f) < 1e-5 for f in frame_parameters(resumed))
    full.eval()
    prompt = torch.tensor([[3, 5, 7, 9]])
    cached = full.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = full.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape == (1, 10) and torch.equal(cached, uncached)
    # companion: without the optimizer's state (moments, step counts) the resumed run differs, beyond the tolerance
    partial = tmp_path / "partial"
    shutil.copytree(checkpoint, partial)
    (partial / "optimizer.pt").unlink()
    other, _ = _trainer_run(tmp_path / "other", 6, resume=str(partial), logit_gain=gain)
    assert _max_logit_diff(full, other) > TRAINER_RESUME_TOL


def test_torch_compile_of_a_converted_model_matches_eager():
    model = _encoder(True)
    stiefelize(model, logit_gain="learn")
    x = _x(2, 5, 16)
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=SAME_TOL)
    compiled(x).square().sum().backward()
    assert all(f.grad is not None and bool(f.grad.abs().sum() > 0) for f in frame_parameters(model))


def test_fitted_gain_of_a_zero_block_is_refused_before_anything_changes():
    """A zero query block would give log-gain -inf: a head whose logits stay zero for all of training."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, dtype=torch.float64)
    with torch.no_grad():
        m.in_proj_weight[16:24].zero_()  # the first key head's block
    model = nn.Sequential(m)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"logit_gain='fit'.*head\(s\) \[0\]"):
        stiefelize(model, logit_gain="fit")
    assert not torch.nn.utils.parametrize.is_parametrized(m)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # companion: the same module with every block non-zero gets finite, positive fitted gains
    with torch.no_grad():
        m.in_proj_weight[16:24].normal_()
    stiefelize(model, logit_gain="fit")
    gain = m.parametrizations.in_proj_weight[0].q_log_gain
    assert torch.isfinite(gain).all()


class _QKVWithKeyBias(nn.Module):
    """Attention with a bias-free fused ``qkv`` Linear and its key bias as a parameter beside it, where no built-in
    layout looks (2 heads of 8)."""

    def __init__(self):
        super().__init__()
        self.num_heads = 2
        self.qkv = nn.Linear(16, 48, bias=False)
        self.k_bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).unbind(-3)
        k = k + self.k_bias.view(2, 8)
        att = torch.softmax(torch.einsum("bqhr,bkhr->bhqk", q, k) / 8 ** 0.5, -1)
        return torch.einsum("bhqk,bkhr->bqhr", att, v).flatten(-2)


def test_dropping_a_bias_the_layout_cannot_see_is_refused():
    """A key bias kept beside a bias-free fused qkv, where the layout does not look: 'drop' must not leave it active."""
    torch.manual_seed(0)
    attn = _QKVWithKeyBias()
    model = nn.Sequential(attn)
    with pytest.raises(ValueError, match="k_bias"):
        stiefelize(model, qk_bias="drop")
    assert not torch.nn.utils.parametrize.is_parametrized(attn.qkv)
    # companion: keeping the biases (the default) converts it, and the bias stays what it was
    k_bias = attn.k_bias.detach().clone()
    stiefelize(model)
    assert torch.equal(attn.k_bias, k_bias)


def test_the_query_bias_beside_a_bias_free_qkv_is_dropped():
    """timm's BEiT attention keeps q_bias beside a bias-free fused qkv (its own layout): 'drop' holds it at zero and
    the converted model computes the stock model with that bias zeroed and the polar factors as frames."""
    BeitAttention = pytest.importorskip("timm.models.beit").Attention
    torch.manual_seed(0)
    attn = BeitAttention(32, num_heads=4, qkv_bias=True).double()
    with torch.no_grad():
        attn.q_bias.normal_()
        attn.v_bias.normal_()
    q_bias = attn.q_bias.detach().clone()
    x = torch.randn(2, 5, 32, dtype=F64)
    reference = copy.deepcopy(attn)
    with torch.no_grad():
        reference.q_bias.zero_()
        w = reference.qkv.weight.view(3, 4, 8, 32)
        for part in (0, 1):
            for h in range(4):
                w[part, h] = polar64(w[part, h].T).T
    model = nn.Sequential(attn)
    (row,) = stiefelize(model, qk_bias="drop")
    assert row.layout == "fused qkv Linear + q_bias"
    assert torch.equal(attn.q_bias, torch.zeros(32, dtype=F64))
    assert rel(attn(x), reference(x)) < FIT_TOL
    # companion: with its query bias as it was, the reference is another function
    with torch.no_grad():
        reference.q_bias.copy_(q_bias)
    assert rel(attn(x), reference(x)) > 1e-3


def test_dropping_biases_that_do_not_exist_says_so():
    model = nn.Sequential(nn.MultiheadAttention(16, 2, bias=False))
    with pytest.warns(UserWarning, match="nothing to drop"):
        stiefelize(model, qk_bias="drop")
    # companion: a module with query/key biases has them dropped without that warning
    with_bias = nn.Sequential(nn.MultiheadAttention(16, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stiefelize(with_bias, qk_bias="drop")
    assert torch.equal(with_bias[0].in_proj_bias[:32], torch.zeros(32))


# ------------------------------------------------------------------------ the rebuild's cost (issue 40, item 4)
def test_one_cat_rebuild_equals_the_row_by_row_rebuild_on_every_layout():
    """The weight is built by one ``torch.cat`` of head-block views; values and gradients are those of the
    segment-by-segment build (dim 0 and 1, with and without a rest, with a learned gain)."""
    from geoopt_stiefel_attention.convert.parametrization import _QKWeight

    for model in (_gpt2(), _llama(), _timm_vit(), _encoder(True)):
        stiefelize(model, logit_gain="learn")
        weights = [m for m in model.modules() if isinstance(m, _QKWeight)]
        assert weights and all(p._head_width() for p in weights)
        for p in weights:
            with torch.no_grad():
                if hasattr(p, "q_log_gain"):
                    p.q_log_gain.normal_(0, 0.05)
            rest = next(plist.original for m in model.modules() for plist in
                        getattr(m, "parametrizations", {}).values() if plist[0] is p)
            grads = []
            for build in (p._build, p._build_by_rows):
                params = [t for t in p.parameters()]
                w = build(rest)
                seed = torch.randn(w.shape, generator=torch.Generator().manual_seed(0), dtype=w.dtype)
                grads.append((w.detach(), torch.autograd.grad((w * seed).sum(), params)))
            assert torch.equal(grads[0][0], grads[1][0]) and grads[0][0].is_contiguous()
            for a, b in zip(grads[0][1], grads[1][1], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_mha_weight_is_built_and_checked_once_per_model_forward_with_unchanged_gradients(monkeypatch):
    from geoopt_stiefel_attention import _guard
    from geoopt_stiefel_attention.convert.parametrization import _QKWeight

    model = _encoder(True)
    stiefelize(model)
    uncached = copy.deepcopy(model)  # the same model with every read building its own weight
    for p in uncached.modules():
        if isinstance(p, _QKWeight):
            del p.__dict__["_reread"]
    builds, checks = [], []
    real_build = _QKWeight._build
    monkeypatch.setattr(_QKWeight, "_build", lambda self, rest: builds.append(1) or real_build(self, rest))
    real_check = _guard.check_frame_tensors
    monkeypatch.setattr(_guard, "check_frame_tensors", lambda *a: checks.append(1) or real_check(*a))
    x = _x(2, 5, 16)
    model(x).square().sum().backward()
    assert len(builds) == 2 and not checks  # two layers: one build each (MHA reads it 3 times), one model check
    builds.clear()
    uncached(x).square().sum().backward()
    assert len(builds) == 6
    for (name, a), b in zip(model.named_parameters(), uncached.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    # the next forward builds again (no tensor outlives a forward), and two forwards then two backwards work
    builds.clear()
    y1, y2 = model(x).sum(), model(x).sum()
    y1.backward()
    y2.backward()
    assert len(builds) == 4
    # a converted submodule called on its own checks its own frames (the model's check does not cover it), at
    # each of the three reads, as every converted weight did before the model's check
    checks.clear()
    model.layers[0](x).sum().backward()
    assert len(checks) == 3


def test_the_models_check_finds_a_frame_off_the_manifold_and_names_it():
    model = _encoder(True)
    stiefelize(model)
    with torch.no_grad():
        model.layers[1].self_attn.parametrizations.in_proj_weight[0].k_frames.data.mul_(1.01)  # .data: no version
    with pytest.raises(FrameOffManifoldError, match="^layers.1.self_attn.in_proj_weight: frame 'k_frames'"):
        model(_x(2, 5, 16))
    with torch.no_grad(), pytest.warns(UserWarning, match="'k_frames' is off the Stiefel manifold at an evaluation"):
        model(_x(2, 5, 16))  # companion: without gradients it warns instead (an evaluation, tests/test_averaging.py) ...
    with pytest.warns(UserWarning, match="unstiefelize: .*Build the optimizer again"):
        unstiefelize(model)  # ... and unstiefelize removes the model's hooks
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_assigning_a_weight_that_is_not_scaled_frames_warns_and_frozen_weights_get_frozen_gains():
    """``module.weight = w`` sets the frames to the polar factors of w's head blocks: when the weight then reads
    back differently, it says so (companion: assigning the weight it reads, gains included, is silent and exact).
    A frozen model converted with logit gains keeps everything frozen."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4)
    stiefelize(nn.Sequential(mha), logit_gain="fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = mha.in_proj_weight.detach().clone()
        mha.in_proj_weight = same
    assert torch.allclose(mha.in_proj_weight, same, atol=1e-6)
    with pytest.warns(UserWarning, match=r"in_proj_weight: the assigned weight's query/key head blocks are not"):
        mha.in_proj_weight = torch.randn(96, 32)
    frozen = nn.Sequential(nn.MultiheadAttention(32, 4))
    frozen.requires_grad_(False)
    stiefelize(frozen, logit_gain="fit")
    assert [n for n, p in frozen.named_parameters() if p.requires_grad] == []
    thawed = nn.Sequential(nn.MultiheadAttention(32, 4))
    stiefelize(thawed, logit_gain="fit")  # companion: a trainable weight gets a trainable gain
    assert any(n.endswith("q_log_gain") and p.requires_grad for n, p in thawed.named_parameters())


def test_the_probe_restores_every_modules_own_mode():
    """``probe=`` runs the model in eval mode and then restores each module's mode as it was, a submodule kept in
    eval on purpose included (companion: the model's own mode is restored too)."""
    model = nn.Sequential(nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1), nn.Linear(32, 8))
    model.train()
    model[1].eval()
    stiefelize(model, probe=torch.randn(5, 2, 32))
    assert model.training and model[0].training and not model[1].training


class _QKAttn(nn.Module):
    """A Llama-like attention (q_proj/k_proj/v_proj/o_proj Linears)."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.num_heads, self.head_dim = h, d // h
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


def _tied_model(tie):
    torch.manual_seed(0)
    model = nn.Sequential(_QKAttn(), _QKAttn())
    if tie == "across_layers":  # cross-layer sharing of the query/key projections
        model[1].q_proj.weight = model[0].q_proj.weight
        model[1].k_proj.weight = model[0].k_proj.weight
    elif tie == "query_is_key":
        model[1].k_proj.weight = model[1].q_proj.weight
    return model


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("tie", ["across_layers", "query_is_key"])
def test_tied_query_key_weights_are_refused_before_anything_changes(tie, strict):
    """A Parameter shared by two modules cannot be parametrized in one of them: stiefelize used to fail halfway
    (``start (0) + length (16) exceeds dimension size (0)``) with the shared weight resized to nothing."""
    model = _tied_model(tie)
    params = list(model.named_parameters(remove_duplicate=False))
    values = [p.detach().clone() for _, p in params]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 3, 16)
    out = model(x).detach()
    pattern = (r"'1.q_proj.weight' and '1.k_proj.weight'" if tie == "query_is_key"
               else r"'0.q_proj.weight' and '1.q_proj.weight'; '0.k_proj.weight' and '1.k_proj.weight'")
    if strict:
        with pytest.raises(ValueError, match=rf"nothing was changed\.\n.*{pattern}: tied weights.*untie them first") as err:
            stiefelize(model)
        # one message: the tie and its fix, once each, with no closing advice about layouts (untying is the fix)
        text = str(err.value)
        assert text.count("tied weights") == 1 and text.count(pattern.split(";")[0].replace("\\", "")) == 1
        assert "Layouts searched" not in text and "Pass targets=" not in text and "strict=False" not in text
        assert text.endswith("under each name but one)")
    else:
        with pytest.warns(UserWarning, match=rf"{pattern}: tied weights.*untie them first"):
            report = stiefelize(model, strict=False)
        assert len(report) == (0 if tie == "across_layers" else 1)  # the untied layer of query_is_key converts
    if strict or tie == "across_layers":
        after = list(model.named_parameters(remove_duplicate=False))
        assert [n for n, _ in after] == [n for n, _ in params]
        assert all(p is q and torch.equal(p, v) for (_, p), (_, q), v in zip(after, params, values, strict=True))
        assert model.state_dict().keys() == state.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert torch.equal(model(x).detach(), out) and not frame_parameters(model)


def test_tied_weights_beside_a_module_no_layout_fits_keep_the_layout_advice_for_that_module():
    """Companion of the one-message tie refusal: where another module matches no layout, the closing advice
    (layouts searched, targets=, strict=False) is still given, for the modules that are not tied."""
    model = nn.Sequential(_tied_model("query_is_key")[1], ToQK())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot convert 2 module\(s\)") as err:
        stiefelize(model)
    text = str(err.value)
    assert "tied weights" in text and "'1': ToQK looks like attention but matches no layout" in text
    assert text.endswith("Pass targets= with a Layout for the modules not tied, or strict=False to leave them "
                         "Euclidean.")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items()) and not frame_parameters(model)


def test_companion_the_untied_model_converts():
    model = _tied_model("none")
    report = stiefelize(model)
    assert len(report) == 2 and len(frame_parameters(model)) == 4
    assert model(torch.randn(1, 3, 16)).shape == (1, 3, 16)


def _train_steps(model, opt, x, steps):
    for _ in range(steps):
        opt.zero_grad()
        out = model(x, x, x)[0] if isinstance(model, nn.MultiheadAttention) else model(x)
        out.square().mean().backward()
        opt.step()


@pytest.mark.parametrize("make_opt", ["AdamW", "StiefelAdam"])
def test_unstiefelize_warns_that_optimizers_of_the_converted_model_must_be_rebuilt(make_opt):
    """The frames were other parameters: a pure q_proj/k_proj weight comes back as a new Parameter that an optimizer
    built on the converted model does not hold (it would silently stop training it), so every call warns."""
    from geoopt_stiefel_attention import StiefelAdam, param_groups

    torch.manual_seed(0)
    model = _QKAttn()
    stiefelize(model)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if make_opt == "AdamW"
           else StiefelAdam(param_groups(model), lr=1e-2))
    x = torch.randn(2, 5, 16)
    _train_steps(model, opt, x, 1)
    with pytest.warns(UserWarning, match=r"unstiefelize: 2 converted weight\(s\) are plain Parameters again.*"
                                         r"would silently stop training 'q_proj.weight', 'k_proj.weight' \(new "
                                         r"Parameters it does not hold\)\. Build the optimizer again") as record:
        unstiefelize(model)
    assert "would fail on" not in str(record[0].message)
    # what the warning says is so: the old optimizer leaves the query weight where it is, the value weight moves
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.q_proj.weight) not in held and id(model.v_proj.weight) in held
    q0, v0 = model.q_proj.weight.detach().clone(), model.v_proj.weight.detach().clone()
    _train_steps(model, opt, x, 2)
    assert torch.equal(model.q_proj.weight.detach(), q0) and not torch.equal(model.v_proj.weight.detach(), v0)
    # companion: the optimizer built again, as the warning says, trains it
    _train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, 2)
    assert not torch.equal(model.q_proj.weight.detach(), q0)


def test_unstiefelize_of_a_fused_projection_warns_and_the_old_optimizer_fails_loudly():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(16, 2, batch_first=True)
    stiefelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 5, 16)
    _train_steps(model, opt, x, 1)
    kept = model.parametrizations.in_proj_weight.original
    with pytest.warns(UserWarning, match=r"unstiefelize: 1 converted weight\(s\).*so it would fail on "
                                         r"'in_proj_weight' \(its state no longer fits"):
        unstiefelize(model)
    assert model.in_proj_weight is kept and kept.shape == (48, 16)  # torch's rule: the Parameter is kept, resized
    with pytest.raises(RuntimeError, match="must match the size"):
        _train_steps(model, opt, x, 1)
    _train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, 1)  # companion: rebuilt, it steps


# ------------------------------------------------------------------------------------------ fit and biases
#: relative output change of a float64 model whose function a conversion keeps (rounding of a few products)
FIT_TOL = 1e-12


def _scaled_frames_(weight: torch.Tensor, blocks: list[slice], generator: torch.Generator) -> None:
    """Set each row block ``weight[s]`` (``(r, d)``) to a scaled orthonormal frame ``rho U^T`` (rho 0.5, 1.5, ...)."""
    with torch.no_grad():
        for i, rows in enumerate(blocks):
            r, d = weight[rows].shape
            u, _ = torch.linalg.qr(torch.randn(d, r, dtype=weight.dtype, generator=generator))
            weight[rows] = (u * (0.5 + i)).T


class _SelfAttention(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.attn = mha

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def _fit_change(bias: bool, frames: bool = True, logit_gain: str = "fit") -> float:
    """Output change of converting a float64 ``nn.MultiheadAttention`` (2 heads of 8) whose query and key head blocks
    are scaled orthonormal frames (scales 0.5, 1.5, 2.5, 3.5; with ``frames=False`` Gaussian blocks), with biases of
    std 0.5 or none."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = _SelfAttention(nn.MultiheadAttention(16, 2, bias=bias, batch_first=True).double())
    if frames:
        _scaled_frames_(net.attn.in_proj_weight, [slice(s, s + 8) for s in range(0, 32, 8)], g)
    if bias:
        with torch.no_grad():
            net.attn.in_proj_bias.normal_(0, 0.5, generator=g)
    probe = (torch.randn(2, 5, 16, dtype=F64, generator=g),)
    return stiefelize(net, logit_gain=logit_gain, probe=probe).output_change


def test_fit_keeps_the_function_of_scaled_orthonormal_heads_with_and_without_biases():
    """``logit_gain="fit"`` rescales the query/key biases with the gains (docs/converting.rst), so a head whose blocks
    are scaled orthonormal frames keeps its logits, biases or not."""
    assert _fit_change(bias=False) <= FIT_TOL
    assert _fit_change(bias=True) <= FIT_TOL
    # companions: blocks that are not scaled frames, or a gain that starts at 1, change the function
    assert _fit_change(bias=True, frames=False) > 1e-2
    assert _fit_change(bias=True, logit_gain="learn") > 1e-2


def test_fit_rescales_each_heads_biases_by_its_key_blocks_rms_singular_value():
    """b_Q,h <- rho_K,h b_Q,h and b_K,h <- b_K,h / rho_K,h, with rho the RMS singular value of the stock key block
    (written out with ``svdvals``); the value bias is left as it is."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.normal_()
        mha.in_proj_bias.normal_()
    w, b = mha.in_proj_weight.detach().clone(), mha.in_proj_bias.detach().clone()
    rho_k = torch.stack([torch.linalg.svdvals(w[16 + 8 * h:24 + 8 * h]).square().mean().sqrt() for h in range(2)])
    expected = torch.cat([b[:8] * rho_k[0], b[8:16] * rho_k[1], b[16:24] / rho_k[0], b[24:32] / rho_k[1], b[32:]])
    stiefelize(_SelfAttention(mha), logit_gain="fit")
    assert rel(mha.in_proj_bias, expected) < FIT_TOL
    # companion: the other modes leave the biases as they were
    other = nn.MultiheadAttention(16, 2, batch_first=True).double()
    other.load_state_dict({"in_proj_weight": w, "in_proj_bias": b}, strict=False)
    stiefelize(_SelfAttention(other), logit_gain="learn")
    assert torch.equal(other.in_proj_bias, b) and rel(other.in_proj_bias, expected) > 1e-2


def _hf_change(model: nn.Module, q_rows: list[slice], k_rows: list[slice], weights, rescale: bool, monkeypatch) -> float:
    """Output change of ``logit_gain="fit"`` on an HF model (float64, query/key blocks set to scaled frames, biases of
    std 0.5); with ``rescale=False`` the conversion's bias rescaling is switched off (the companion)."""
    if not rescale:
        monkeypatch.setattr(convert_module, "_rescale_biases", lambda site: None)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=g)
    for wq, wk in weights:
        _scaled_frames_(wq, q_rows, g)
        _scaled_frames_(wk, k_rows, g)
    ids = torch.randint(0, 64, (2, 7), generator=g)
    return stiefelize(model, logit_gain="fit", probe=(ids,)).output_change


@pytest.mark.parametrize("rescale", [True, False])
def test_fit_keeps_a_grouped_query_models_function_with_biases(rescale, monkeypatch):
    """HF Qwen2 (query, key and value biases; 4 query heads share 2 key heads): each query head's bias is scaled by
    its own key head's rho. Companion: the same conversion without the bias rescaling changes the function."""
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.Qwen2Model(cfg).double().eval()
    attn = model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
    change = _hf_change(model, [slice(8 * h, 8 * h + 8) for h in range(4)], [slice(8 * h, 8 * h + 8) for h in range(2)],
                        [(attn.q_proj.weight, attn.k_proj.weight)], rescale, monkeypatch)
    assert change <= FIT_TOL if rescale else change > 1e-3


@pytest.mark.parametrize("rescale", [True, False])
def test_fit_keeps_an_interleaved_models_function_with_biases(rescale, monkeypatch):
    """HF GPT-NeoX: rows [q_h | k_h | v_h] per head in one fused weight with one fused bias (interleaved spans).
    Companion: the same conversion without the bias rescaling changes the function."""
    cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=16, rotary_pct=0.5)
    torch.manual_seed(0)
    model = transformers.GPTNeoXModel(cfg).double().eval()
    w = model.layers[0].attention.query_key_value.weight  # head h: rows 48h..48h+16 q, +16..+32 k, +32..+48 v
    assert model.layers[0].attention.query_key_value.bias is not None
    change = _hf_change(model, [slice(48 * h, 48 * h + 16) for h in range(2)],
                        [slice(48 * h + 16, 48 * h + 32) for h in range(2)], [(w, w)], rescale, monkeypatch)
    assert change <= FIT_TOL if rescale else change > 1e-3


class _ProjWithQueryBias(nn.Module):
    """Attention with bias-free q_proj/k_proj/v_proj Linears and its query bias as a parameter beside them, where no
    built-in layout looks (2 heads of 8)."""

    def __init__(self, query_bias: bool = True):
        super().__init__()
        self.num_heads = 2
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16, bias=False) for _ in range(3))
        if query_bias:
            self.q_bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        q = self.q_proj(x) + getattr(self, "q_bias", 0.0)
        q, k, v = (t.unflatten(-1, (2, 8)) for t in (q, self.k_proj(x), self.v_proj(x)))
        att = torch.softmax(torch.einsum("bqhr,bkhr->bhqk", q, k) / 8 ** 0.5, -1)
        return torch.einsum("bhqk,bkhr->bqhr", att, v).flatten(-2)


def _with_scaled_frames(attn: _ProjWithQueryBias) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    _scaled_frames_(attn.q_proj.weight, [slice(0, 8), slice(8, 16)], g)
    _scaled_frames_(attn.k_proj.weight, [slice(0, 8), slice(8, 16)], g)
    return nn.Sequential(attn)


def test_fit_says_which_bias_it_cannot_rescale():
    """A query bias where the layout does not look is kept as it is, with a warning naming it; the heads' attention
    then changes. Companion: without that bias, no warning and the function is kept."""
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 16, dtype=F64),)
    with pytest.warns(UserWarning, match=r"cannot in .*query bias is not at 'q_proj.bias'.*\['q_bias'\]"):
        result = stiefelize(_with_scaled_frames(_ProjWithQueryBias().double()), logit_gain="fit", probe=x)
    assert result.output_change > 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = stiefelize(_with_scaled_frames(_ProjWithQueryBias(query_bias=False).double()), logit_gain="fit",
                            probe=x)
    assert result.output_change <= FIT_TOL


# ------------------------------------------------------------------------------- optimizers built before converting
class _MHAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0]).square().mean()


def _frames_of(model: nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if n.endswith("_frames")]


def _train(model: nn.Module, optimizers, steps: int, x: torch.Tensor, every=None) -> None:
    """``steps`` training steps; optimizer ``i`` steps where ``every[i]`` (a step -> bool) says so (default: always)."""
    for k in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        model(x).backward()
        for i, opt in enumerate(optimizers):
            if every is None or every[i](k):
                opt.step()


def test_an_optimizer_built_before_converting_raises_instead_of_never_training_the_frames():
    """``opt = AdamW(model.parameters()); stiefelize(model)``: the optimizer holds the converted weight (torch MHA:
    its Parameter lives on as the rest) but not the frames, so the queries and keys would never train. After
    STALLED_STEPS steps with the frames unchanged its next step raises, taking nothing. Companion: the optimizer
    built after the conversion trains the frames, never raising."""
    from geoopt_stiefel_attention.integrations.optimizers import STALLED_STEPS

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    model = _MHAModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stiefelize(model)
    frames = [f.detach().clone() for f in _frames_of(model)]
    _train(model, [opt], STALLED_STEPS, x)
    assert all(torch.equal(f, g) for f, g in zip(_frames_of(model), frames, strict=True))  # never trained
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"AdamW holds 'attn\.in_proj_weight', converted by stiefelize, but not "
                                           r"the Stiefel frames .* built before the conversion, .* not taken"):
        _train(model, [opt], 1, x)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the failing step took nothing
    fresh = _MHAModel()
    stiefelize(fresh)
    start = [f.detach().clone() for f in _frames_of(fresh)]
    _train(fresh, [StiefelAdam(param_groups(fresh), lr=1e-2)], 2 * STALLED_STEPS + 2, x)
    assert all(not torch.equal(f, g) for f, g in zip(_frames_of(fresh), start, strict=True))
    docs = Path(__file__).resolve().parents[1] / "docs" / "converting.rst"
    assert STALLED_STEPS == 4 and "in its last four steps" in " ".join(docs.read_text().split())


def test_an_optimizer_built_before_converting_a_pure_q_proj_raises_too():
    """q_proj/k_proj Linears: their Parameters are left out of the model (emptied), held only by the old optimizer."""
    from geoopt_stiefel_attention.integrations.optimizers import STALLED_STEPS

    torch.manual_seed(0)
    attn = _ProjWithQueryBias(query_bias=False)
    model = nn.Sequential(attn)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    stiefelize(model)
    x = torch.randn(2, 5, 16)

    def loss_model(x):
        return model(x).square().mean()
    with pytest.raises(RuntimeError, match=r"SGD holds '0\.q_proj\.weight', '0\.k_proj\.weight'"):
        for _ in range(STALLED_STEPS + 2):
            opt.zero_grad()
            loss_model(x).backward()
            opt.step()


def test_an_optimizer_for_the_rest_beside_one_for_the_frames_is_no_false_alarm():
    """Two optimizers: one holding the converted weight's rest (built before or after converting), one the frames,
    stepped in either order, the frame optimizer skipping steps as a GradScaler does on inf gradients (every third
    step), or the frames frozen: none raises. Companion: a frame optimizer that starts only after the other's
    first STALLED_STEPS steps is too late: that optimizer's next step raises."""
    from geoopt_stiefel_attention.integrations.optimizers import STALLED_STEPS

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    for before in (True, False):
        for frames_first in (True, False):
            model = _MHAModel()
            rest = torch.optim.AdamW(model.parameters(), lr=1e-2) if before else None
            stiefelize(model)
            if rest is None:
                rest = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.endswith("_frames")])
            frame_opt = StiefelAdam(_frames_of(model), lr=1e-2)
            opts = [frame_opt, rest] if frames_first else [rest, frame_opt]
            _train(model, opts, 3 * STALLED_STEPS, x)
    model = _MHAModel()
    rest = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stiefelize(model)
    frame_opt = StiefelAdam(_frames_of(model), lr=1e-2)
    _train(model, [rest, frame_opt], 4 * STALLED_STEPS, x, every=[lambda k: True, lambda k: k % 3 == 0])
    frozen = _MHAModel()
    stale = torch.optim.AdamW(frozen.parameters(), lr=1e-2)
    stiefelize(frozen)
    for f in _frames_of(frozen):
        f.requires_grad_(False)
    _train(frozen, [stale], 3 * STALLED_STEPS, x)
    model = _MHAModel()
    rest = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stiefelize(model)
    frame_opt = StiefelAdam(_frames_of(model), lr=1e-2)
    with pytest.raises(RuntimeError, match="built before the conversion"):
        _train(model, [rest, frame_opt], 4 * STALLED_STEPS, x, every=[lambda k: True, lambda k: k > STALLED_STEPS])


def test_a_model_built_under_inference_mode_is_refused_before_anything_changes():
    """Its weights are inference tensors: torch's parametrize failed half-way ("Inplace update to inference tensor
    outside InferenceMode is not allowed"). Companion: the same model built under no_grad converts."""
    with torch.inference_mode():
        model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    with pytest.raises(TypeError, match=r"'0\.self_attn' holds inference tensors \(in_proj_weight, .*torch\."
                                        r"inference_mode\(\)\), .*build or load the model outside inference mode"):
        stiefelize(model)
    assert not any(hasattr(m, "parametrizations") for m in model.modules())
    with torch.no_grad():
        model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    stiefelize(model)
    assert hasattr(model[0].self_attn, "parametrizations")


@pytest.mark.parametrize("optimizer", ["StiefelAdam", "StiefelMuon"])
def test_an_optimizer_kept_across_unstiefelize_is_refused_naming_the_resized_weight(optimizer):
    """unstiefelize turns a fused weight's rest (16 x 16, the value rows) back into the whole (48, 16) weight, the
    same Parameter: the kept optimizer's AdamW state no longer fits it, and its step failed inside torch ("The size of
    tensor a (16) must match the size of tensor b (48)"). Now one sentence, before anything changes. Companion: an
    optimizer built after unstiefelize steps."""
    import warnings

    import geoopt_stiefel_attention as gsa

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    stiefelize(model)
    make = getattr(gsa, optimizer)
    opt = make(gsa.param_groups(model), lr=1e-2)
    x = torch.randn(2, 5, 16)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unstiefelize's own warning about optimizers built before it
        gsa.unstiefelize(model)
    model(x).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{optimizer}: parameter of shape \(48, 16\) has optimizer state of shape "
                                         r"\(16, 16\): it was resized .*build a new optimizer"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()  # the companion: a new optimizer for the stock model
