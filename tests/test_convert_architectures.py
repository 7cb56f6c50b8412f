"""``stiefelize`` across HuggingFace architectures, each against a reference written from its modeling code.

For every architecture below, the rows of which weight hold head ``h``'s query and key are written out by hand
(``*_rows`` and the ``Case`` specs, read off each model's forward in ``transformers/models/<name>/modeling_<name>.py``,
not through the converter's table), the polar factor of each head block is computed by an SVD in float64, and the
converted model is compared with it: the frames, the weight its forward reads (query/key rows replaced, every other
row as it was), every other parameter untouched, the heads and head size it reports. Orthonormal head blocks at the
reference rows convert exactly (the function is unchanged), and with scaled orthonormal blocks ``logit_gain="fit"``
keeps the function, which ties each query head to its key head. Companions: the readings that used to be taken (or
that a user layout of equal thirds takes) are other rows, and are refused.

The fused layouts: GPTBigCode's ``c_attn`` (an ``nn.Linear``: ``[q_h, k_h, v_h]`` per head, or ``[q | k | v]`` with
one key/value head under ``multi_query``), CodeGen's ``qkv_proj`` (``mp_num`` = 4 groups of ``[q | v | k]``), and
``Wqkv`` (MPT, ModernBERT: equal thirds; DBRX: split by its key/value heads). Query/key normalization after the
projection (Qwen3, OLMo2, Cohere) and MPT's ``clip_qkv`` make a logit gain something other than each head's logit
factor: warned. Tiny random-config models in float64, no download.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import (
    F64,
    ORTHO_TOL_F64,
    move_every_parameter_,
    polar64,
    seeded_f64,
    state_snapshot,
    unconverted_and_unchanged,
)
from torch import nn

import geoopt_stiefel_attention.convert as convert_module
from geoopt_stiefel_attention import (
    Block,
    Layout,
    StiefelAdam,
    export_state_dict,
    frame_parameters,
    param_groups,
    stiefelize,
)
from geoopt_stiefel_attention.convert import converted_query_key_frames

transformers = pytest.importorskip("transformers")
T = transformers

#: two float64 computations of one polar factor (an SVD here, the manifold's projection in the converter)
POLAR_TOL = 1e-10
#: two float64 forward passes of the same function in different orders
SAME_TOL = 1e-10
#: a change of the function (relative), a gap between head blocks, or a gradient that is not zero, must exceed this
DIFFER_MIN = 1e-4
#: the same, for a model whose forward computes attention in float32 whatever its dtype (GPT-Neo casts q and k,
#: ModernBERT's softmax): weights that differ by float64 rounding give outputs 4e-9 apart (measured)
F32_ATTENTION_TOL = 1e-7
#: the gradient of a gain that a per-head norm divides out: only the norm's eps lets it through (measured 5e-8)
DEAD_GRAD_MAX = 1e-6

D, H, R, V = 32, 4, 8, 64  # width, query heads, head size (D / H), vocabulary


# ------------------------------------------------------------------------------------------ the reference
def contiguous_rows(heads: int, r: int, base: int = 0) -> list[torch.Tensor]:
    """Head ``h`` is rows ``base + h r : base + (h + 1) r`` (``view(..., H, r)`` of a projection's output)."""
    return [torch.arange(base + h * r, base + (h + 1) * r) for h in range(heads)]


def per_head_qkv_rows(heads: int, r: int, slot: int) -> list[torch.Tensor]:
    """GPTBigCode without ``multi_query``: ``c_attn(x).view(..., H, 3 r)`` then ``split(3 * [r])``: rows of head
    ``h`` are ``[q_h, k_h, v_h]`` from ``3 h r``; ``slot`` 0 is the query, 1 the key."""
    return [torch.arange(3 * h * r + slot * r, 3 * h * r + (slot + 1) * r) for h in range(heads)]


def codegen_rows(width: int, heads: int, which: str, mp_num: int = 4) -> list[torch.Tensor]:
    """CodeGen: ``qkv_proj(x).view(..., mp_num, 3 L)`` (``L = width / mp_num``), ``split(L)`` into query, *value*,
    key; each is then ``reshape(..., H, r)`` of its ``(mp_num, L)`` features, so query feature ``j`` is row
    ``(j // L) 3 L + j % L`` (key: ``+ 2 L``) and head ``h`` is features ``h r : (h + 1) r``."""
    local, r = width // mp_num, width // heads
    feature = torch.arange(width)
    rows = (feature // local) * 3 * local + {"q": 0, "v": 1, "k": 2}[which] * local + feature % local
    return [rows[h * r:(h + 1) * r] for h in range(heads)]


# ------------------------------------------------------------------------------------------ cases
Spec = tuple[str, list[torch.Tensor], str, list[torch.Tensor]]  # q param, q head rows, k param, k head rows


@dataclass
class Case:
    """A tiny model: how to build it, the class of its attention modules, where their query/key head rows are
    (``spec(module)``, written by hand), the layout the result names, and the inputs of one forward."""

    build: Callable[[], nn.Module]
    cls: str
    spec: Callable[[nn.Module], Spec]
    layout: str
    inputs: Callable[[], dict]
    qk_norm: bool = False  # normalizes q/k after the projection: a gain is not a logit factor
    same_tol: float = 1e-10  # two forwards of one function whose weights differ by rounding (SAME_TOL)
    gain_warns: str | None = None  # what a logit gain is warned about on this model (clip_qkv)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return seeded_f64(make, biases=lambda name, p: name.endswith("bias") and p.dim() == 1, std=0.1)


def _ids(shape=(2, 7)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(1))


def _lm():
    return {"input_ids": _ids()}


def _seq2seq():
    return {"input_ids": _ids(), "decoder_input_ids": _ids((2, 5))}


def _pixels(size=16):
    return {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=F64)}


def _sep(q: str, k: str, heads: int, kv_heads: int, r: int) -> Callable[[nn.Module], Spec]:
    return lambda m: (q, contiguous_rows(heads, r), k, contiguous_rows(kv_heads, r))


def _declared(q: str, k: str, heads_attr: str, r_attr: str) -> Callable[[nn.Module], Spec]:
    """Separate q/k weights of a model whose heads differ by layer (CLIP's towers, Swin's stages): the counts its
    forward uses (``view(..., -1, head_dim)``), read from the module."""
    def spec(m):
        r = getattr(m, r_attr)
        return (q, contiguous_rows(getattr(m, heads_attr), r), k, contiguous_rows(getattr(m, heads_attr), r))
    return spec


def _dbrx_config():
    """DBRX as transformers 5.25 builds it: its attention reads ``attn_config.rope_theta``, which the config class
    does not define, and clamps with ``clip_qkv``, which must be set (100: nothing here comes near it)."""
    config = T.DbrxConfig(d_model=D, n_heads=H, n_layers=1, vocab_size=V, max_seq_len=32,
                          attn_config={"kv_n_heads": 2, "clip_qkv": 100.0},
                          ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1})
    config.attn_config.rope_theta = 10000.0
    return config


class _CLIPLogits(nn.Module):
    """CLIP with both towers, returning ``logits_per_image`` (what ``probe=`` measures)."""

    def __init__(self, config):
        super().__init__()
        self.clip = T.CLIPModel(config)

    def forward(self, **inputs):
        return self.clip(**inputs).logits_per_image


def _llama_like(config_cls, model_cls, **kw):
    return _seeded(lambda: model_cls(config_cls(hidden_size=D, num_attention_heads=H, num_hidden_layers=2,
                                                intermediate_size=64, vocab_size=V, pad_token_id=0, bos_token_id=0,
                                                eos_token_id=0, **kw)))


CASES = {
    # --- fused layouts (new in the built-in table)
    "gpt_bigcode": Case(
        _seeded(lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_embd=D, n_head=H, n_layer=2, vocab_size=V,
                                                                  multi_query=False))),
        "GPTBigCodeAttention", lambda m: ("c_attn.weight", per_head_qkv_rows(H, R, 0),
                                          "c_attn.weight", per_head_qkv_rows(H, R, 1)),
        "GPTBigCode c_attn Linear (q|k|v per head)", _lm),
    "gpt_bigcode_multi_query": Case(  # split((D, r, r)): [q of every head | k | v]
        _seeded(lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_embd=D, n_head=H, n_layer=2, vocab_size=V,
                                                                  multi_query=True))),
        "GPTBigCodeAttention", lambda m: ("c_attn.weight", contiguous_rows(H, R),
                                          "c_attn.weight", contiguous_rows(1, R, H * R)),
        "GPTBigCode c_attn Linear (one group: q of 4 heads | k | v)", _lm),
    "deberta_v1": Case(  # in_proj(x).view(..., H, 3 r).chunk(3, dim=-1): [q_h, k_h, v_h] per head
        _seeded(lambda: T.DebertaModel(T.DebertaConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=2,
                                                       intermediate_size=2 * D, vocab_size=V))),
        "DisentangledSelfAttention", lambda m: ("in_proj.weight", per_head_qkv_rows(H, R, 0),
                                                "in_proj.weight", per_head_qkv_rows(H, R, 1)),
        "DeBERTa in_proj Linear (q|k|v per head)", _lm),
    "codegen": Case(  # one head per group
        _seeded(lambda: T.CodeGenForCausalLM(T.CodeGenConfig(n_embd=D, n_head=H, n_layer=2, vocab_size=V,
                                                             rotary_dim=4, n_ctx=32, n_positions=32))),
        "CodeGenAttention", lambda m: ("qkv_proj.weight", codegen_rows(D, H, "q"),
                                       "qkv_proj.weight", codegen_rows(D, H, "k")),
        "CodeGen qkv_proj (4 groups of 3 slices: q slice 0, k slice 2 of each)", _lm),
    "codegen_8_heads": Case(  # two heads per group
        _seeded(lambda: T.CodeGenForCausalLM(T.CodeGenConfig(n_embd=2 * D, n_head=2 * H, n_layer=1, vocab_size=V,
                                                             rotary_dim=4, n_ctx=32, n_positions=32))),
        "CodeGenAttention", lambda m: ("qkv_proj.weight", codegen_rows(2 * D, 2 * H, "q"),
                                       "qkv_proj.weight", codegen_rows(2 * D, 2 * H, "k")),
        "CodeGen qkv_proj (4 groups of 3 slices: q slice 0, k slice 2 of each)", _lm),
    "mpt": Case(  # Wqkv(x).chunk(3): equal thirds, heads contiguous in each
        _seeded(lambda: T.MptForCausalLM(T.MptConfig(d_model=D, n_heads=H, n_layers=2, vocab_size=V,
                                                     expansion_ratio=2))),
        "MptAttention", lambda m: ("Wqkv.weight", contiguous_rows(H, R), "Wqkv.weight", contiguous_rows(H, R, D)),
        "fused Wqkv Linear", _lm),
    "dbrx": Case(  # Wqkv(x).split([D, H_kv r, H_kv r])
        _seeded(lambda: T.DbrxForCausalLM(_dbrx_config())),
        "DbrxAttention", lambda m: ("Wqkv.weight", contiguous_rows(H, R), "Wqkv.weight", contiguous_rows(2, R, D)),
        "fused Wqkv Linear (grouped-query split: q rows 0:32, k rows 32:48)", _lm, gain_warns="clip_qkv"),
    "modernbert": Case(  # Wqkv(x).view(..., 3, H, r)
        _seeded(lambda: T.ModernBertModel(T.ModernBertConfig(
            hidden_size=D, num_attention_heads=H, num_hidden_layers=2, intermediate_size=64, vocab_size=V,
            pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0))),
        "ModernBertAttention", lambda m: ("Wqkv.weight", contiguous_rows(H, R), "Wqkv.weight",
                                          contiguous_rows(H, R, D)),
        "fused Wqkv Linear", _lm, same_tol=F32_ATTENTION_TOL),  # softmax in float32
    # --- separate projections under names new in the built-in table
    "t5": Case(  # q/k/v/o, heads of key_value_proj_dim (6, not D / H), no 1/sqrt(r), relative position bias
        _seeded(lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=D, d_kv=6, num_heads=H, num_layers=1,
                                                                num_decoder_layers=1, d_ff=64, vocab_size=V,
                                                                decoder_start_token_id=0))),
        "T5Attention", _sep("q.weight", "k.weight", H, H, 6), "q/k Linear", _seq2seq),
    "distilbert": Case(
        _seeded(lambda: T.DistilBertModel(T.DistilBertConfig(dim=D, n_heads=H, n_layers=2, hidden_dim=64,
                                                              vocab_size=V, pad_token_id=0))),
        "DistilBertSelfAttention", _sep("q_lin.weight", "k_lin.weight", H, H, R), "q_lin/k_lin Linear", _lm),
    "deberta_v2": Case(  # disentangled attention: the content query/key projections (shared with the position terms)
        _seeded(lambda: T.DebertaV2Model(T.DebertaV2Config(
            hidden_size=D, num_attention_heads=H, num_hidden_layers=2, intermediate_size=64, vocab_size=V,
            relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=True, max_relative_positions=16,
            position_buckets=8, pad_token_id=0))),
        "DisentangledSelfAttention", _sep("query_proj.weight", "key_proj.weight", H, H, R),
        "query_proj/key_proj Linear", _lm),
    # --- layouts the table already had, on architectures with no test before
    "gptj": Case(_seeded(lambda: T.GPTJForCausalLM(T.GPTJConfig(n_embd=D, n_head=H, n_layer=2, vocab_size=V,
                                                                rotary_dim=4, n_positions=32))),
                 "GPTJAttention", _sep("q_proj.weight", "k_proj.weight", H, H, R), "q_proj/k_proj Linear", _lm),
    "gpt_neo": Case(_seeded(lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(  # no 1/sqrt(r); q, k cast to float32
        hidden_size=D, num_heads=H, num_layers=2, vocab_size=V, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=32, window_size=4))),
        "GPTNeoSelfAttention", _sep("q_proj.weight", "k_proj.weight", H, H, R), "q_proj/k_proj Linear", _lm,
        same_tol=F32_ATTENTION_TOL),
    "opt": Case(_seeded(lambda: T.OPTForCausalLM(T.OPTConfig(
        hidden_size=D, num_attention_heads=H, num_hidden_layers=2, ffn_dim=64, vocab_size=V, word_embed_proj_dim=D,
        max_position_embeddings=32, pad_token_id=0))),
        "OPTAttention", _sep("q_proj.weight", "k_proj.weight", H, H, R), "q_proj/k_proj Linear", _lm),
    "mistral": Case(_llama_like(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=2),
                    "MistralAttention", _sep("q_proj.weight", "k_proj.weight", H, 2, R), "q_proj/k_proj Linear", _lm),
    "gemma": Case(_llama_like(T.GemmaConfig, T.GemmaForCausalLM, num_key_value_heads=1, head_dim=16),
                  "GemmaAttention", _sep("q_proj.weight", "k_proj.weight", H, 1, 16), "q_proj/k_proj Linear", _lm),
    "gemma2": Case(_llama_like(T.Gemma2Config, T.Gemma2ForCausalLM, num_key_value_heads=2, head_dim=16,
                               query_pre_attn_scalar=16),
                   "Gemma2Attention", _sep("q_proj.weight", "k_proj.weight", H, 2, 16), "q_proj/k_proj Linear", _lm),
    "starcoder2": Case(_llama_like(T.Starcoder2Config, T.Starcoder2ForCausalLM, num_key_value_heads=2),
                       "Starcoder2Attention", _sep("q_proj.weight", "k_proj.weight", H, 2, R),
                       "q_proj/k_proj Linear", _lm),
    "qwen3": Case(_llama_like(T.Qwen3Config, T.Qwen3ForCausalLM, num_key_value_heads=2, head_dim=R),
                  "Qwen3Attention", _sep("q_proj.weight", "k_proj.weight", H, 2, R), "q_proj/k_proj Linear", _lm,
                  qk_norm=True),
    "olmo2": Case(_llama_like(T.Olmo2Config, T.Olmo2ForCausalLM, num_key_value_heads=2),
                  "Olmo2Attention", _sep("q_proj.weight", "k_proj.weight", H, 2, R), "q_proj/k_proj Linear", _lm,
                  qk_norm=True),
    "cohere": Case(_llama_like(T.CohereConfig, T.CohereForCausalLM, num_key_value_heads=2, use_qk_norm=True),
                   "CohereAttention", _sep("q_proj.weight", "k_proj.weight", H, 2, R), "q_proj/k_proj Linear", _lm,
                   qk_norm=True),
    "bart": Case(_seeded(lambda: T.BartForConditionalGeneration(T.BartConfig(
        d_model=D, encoder_attention_heads=H, decoder_attention_heads=H, encoder_layers=1, decoder_layers=1,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V, max_position_embeddings=32, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, forced_eos_token_id=None))),
        "BartAttention", _sep("q_proj.weight", "k_proj.weight", H, H, R), "q_proj/k_proj Linear", _seq2seq),
    "whisper": Case(_seeded(lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        d_model=D, encoder_attention_heads=H, decoder_attention_heads=H, encoder_layers=1, decoder_layers=1,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0))),
        "WhisperAttention", _sep("q_proj.weight", "k_proj.weight", H, H, R), "q_proj/k_proj Linear",
        lambda: {"input_features": torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1), dtype=F64),
                 "decoder_input_ids": _ids((2, 5))}),
    "clip": Case(_seeded(lambda: _CLIPLogits(T.CLIPConfig(
        text_config={"hidden_size": D, "num_attention_heads": H, "num_hidden_layers": 1, "intermediate_size": 64,
                     "vocab_size": V, "max_position_embeddings": 16, "pad_token_id": 0, "bos_token_id": 0,
                     "eos_token_id": 1},
        vision_config={"hidden_size": D, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64,
                       "image_size": 16, "patch_size": 8},
        projection_dim=16))),
        "CLIPAttention", _declared("q_proj.weight", "k_proj.weight", "num_heads", "head_dim"), "q_proj/k_proj Linear",
        lambda: {"input_ids": _ids(), **_pixels()}),
    "roberta": Case(_seeded(lambda: T.RobertaModel(T.RobertaConfig(
        hidden_size=D, num_attention_heads=H, num_hidden_layers=2, intermediate_size=64, vocab_size=V,
        max_position_embeddings=32, pad_token_id=0))),
        "RobertaSelfAttention", _sep("query.weight", "key.weight", H, H, R), "query/key Linear", _lm),
    "albert": Case(_seeded(lambda: T.AlbertModel(T.AlbertConfig(  # one attention module shared by both layers
        hidden_size=D, embedding_size=16, num_attention_heads=H, num_hidden_layers=2, intermediate_size=64,
        vocab_size=V, pad_token_id=0))),
        "AlbertAttention", _sep("query.weight", "key.weight", H, H, R), "query/key Linear", _lm),
    "swin": Case(_seeded(lambda: T.SwinModel(T.SwinConfig(  # 2 heads of 8 in stage 1, 4 of 8 in stage 2
        image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4))),
        "SwinAttention", _declared("q_proj.weight", "k_proj.weight", "num_attention_heads", "head_dim"),
        "q_proj/k_proj Linear", _pixels),
}
#: the architectures whose fused weight a user layout of equal thirds reads wrongly (refused), with that layout
THIRDS = {"gpt_bigcode": "c_attn.weight", "codegen": "qkv_proj.weight", "codegen_8_heads": "qkv_proj.weight",
          "deberta_v1": "in_proj.weight"}


def _get(module: nn.Module, name: str):
    for part in name.split("."):
        module = getattr(module, part)
    return module


def attns(case: Case, model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if type(m).__name__ == case.cls]


def run(case: Case, model: nn.Module) -> torch.Tensor:
    out = model(**case.inputs())
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    raise AssertionError(type(out))


def set_heads(case: Case, model: nn.Module, rows_of=None, scaled: bool = False, biases: bool = False) -> int:
    """Make every query/key head block at the reference rows (or ``rows_of(module)``) orthonormal (QR of a
    Gaussian); ``scaled``: times ``0.3 ... 2.5`` evenly over a module's blocks (query heads, then key heads), with the
    query/key biases at those rows zeroed, or with ``biases`` drawn with std 0.5. Returns how many bias entries
    were drawn."""
    g = torch.Generator().manual_seed(5)
    drawn = 0

    def set_bias(b: torch.Tensor) -> int:
        b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.5 if biases else torch.zeros_like(b))
        return b.numel() if biases else 0

    with torch.no_grad():
        for _, attn in attns(case, model):
            q_param, q_rows, k_param, k_rows = (rows_of or case.spec)(attn)
            scales = torch.linspace(0.3, 2.5, len(q_rows) + len(k_rows)).tolist() if scaled else None
            for i, (param, rows) in enumerate([(q_param, s) for s in q_rows] + [(k_param, s) for s in k_rows]):
                w = _get(attn, param)
                u, _ = torch.linalg.qr(torch.randn(w.shape[1], len(rows), generator=g, dtype=F64))
                w[rows] = (u * (1.0 if scales is None else scales[i])).T
                bias = _get(attn, param.rsplit(".", 1)[0]).bias if "." in param else None
                if bias is not None and scales is not None:
                    drawn += set_bias(bias[rows])
            for name in ("q_bias", "k_bias"):  # biases kept beside a bias-free projection (DeBERTa v1)
                if scaled and isinstance(getattr(attn, name, None), nn.Parameter):
                    drawn += set_bias(getattr(attn, name))
    return drawn


# ------------------------------------------------------------------------------------------ the frames
@pytest.mark.parametrize("name", CASES)
def test_frames_are_the_polar_factors_of_the_head_rows_the_forward_reads(name):
    case = CASES[name]
    model = case.build()
    found = attns(case, model)
    assert found, f"no {case.cls} in the model"
    specs = [case.spec(m) for _, m in found]
    stock = [{p: _get(m, p).detach().clone() for p in (s[0], s[2])} for (_, m), s in zip(found, specs, strict=True)]
    before = state_snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converted without a word of doubt
        report = stiefelize(model)
    assert [(c.path, c.layout, c.q_heads, c.k_heads, c.r) for c in report] == [
        (p, case.layout, len(s[1]), len(s[3]), len(s[1][0])) for (p, _), s in zip(found, specs, strict=True)]
    frames = converted_query_key_frames(model)
    assert [p for p, _, _ in frames] == [p for p, _ in found]
    touched = set()
    for (path, attn), (q_param, q_rows, k_param, k_rows), w0, (_, qf, kf) in zip(found, specs, stock, frames,
                                                                                strict=True):
        expected = {p: w.clone() for p, w in w0.items()}
        for param, rows, got in ((q_param, q_rows, qf), (k_param, k_rows, kf)):
            assert got.shape == (len(rows), w0[param].shape[1], len(rows[0]))
            for h, s in enumerate(rows):
                truth = polar64(w0[param][s].T)
                torch.testing.assert_close(got[h].detach(), truth, rtol=0, atol=POLAR_TOL)
                expected[param][s] = truth.T
        for param in w0:  # the weight the forward reads: polar factors at the head rows, every other row as it was
            torch.testing.assert_close(_get(attn, param).detach(), expected[param], rtol=0, atol=POLAR_TOL)
            others = torch.ones(w0[param].shape[0], dtype=torch.bool)
            for s in (q_rows if param == q_param else []) + (k_rows if param == k_param else []):
                others[s] = False
            assert torch.equal(_get(attn, param).detach()[others], w0[param][others])
            touched.add(f"{path}.{param}")
    after = model.state_dict()  # every other parameter (values, outputs, biases, norms) as it was
    assert all(torch.equal(after[n], t) for n, t in before.items() if n not in touched)


@pytest.mark.parametrize("name", THIRDS)
def test_companion_equal_thirds_are_other_rows(name):
    """What a layout of equal thirds (what the refusal's hint used to lead to) reads differs from the reference."""
    case = CASES[name]
    model = case.build()
    attn = attns(case, model)[0][1]
    q_param, q_rows, _, k_rows = case.spec(attn)
    w = _get(attn, q_param).detach()
    r, third = len(q_rows[0]), w.shape[0] // 3
    naive = contiguous_rows(len(q_rows), r) + contiguous_rows(len(k_rows), r, third)
    gap = max(float((polar64(w[a].T) - polar64(w[b].T)).abs().max())
              for a, b in zip(naive, q_rows + k_rows, strict=True))
    assert gap > DIFFER_MIN


# ------------------------------------------------------------------------------------------ the function
@pytest.mark.parametrize("name", CASES)
def test_orthonormal_head_blocks_convert_exactly_and_others_change(name):
    case = CASES[name]
    model = case.build()
    set_heads(case, model)
    before = run(case, model).detach()
    report = stiefelize(model, probe=case.inputs())
    torch.testing.assert_close(run(case, model), before, rtol=0, atol=SAME_TOL)
    assert report.output_change < SAME_TOL
    # companion: the initialised blocks are not orthonormal, so conversion changes the output
    fresh = case.build()
    assert stiefelize(fresh, probe=case.inputs()).output_change > DIFFER_MIN


@pytest.mark.parametrize("name", THIRDS)
def test_companion_orthonormal_blocks_at_the_equal_thirds_do_not_convert_exactly(name):
    case = CASES[name]
    model = case.build()

    def thirds(m):
        q_param, q_rows, k_param, k_rows = case.spec(m)
        r, third = len(q_rows[0]), _get(m, q_param).shape[0] // 3
        return q_param, contiguous_rows(len(q_rows), r), k_param, contiguous_rows(len(k_rows), r, third)
    set_heads(case, model, rows_of=thirds)
    assert stiefelize(model, probe=case.inputs()).output_change > DIFFER_MIN


#: a per-head norm after the projection divides each head's scale out (OLMo2's norm over all heads does not, but then
#: no per-head gain restores it): the fit gain is checked where a gain is a logit factor
@pytest.mark.parametrize("name", [n for n in CASES if not CASES[n].qk_norm])
def test_fit_gain_keeps_scaled_orthonormal_heads_paired_as_the_forward_pairs_them(name, monkeypatch):
    """Head ``h``'s fitted gain is scale(q_h) * scale(k of its group), and its query/key biases are rescaled with the
    key scale: the function is kept only where the converter pairs each query head with the key head the forward
    pairs it with, and finds its biases."""
    case = CASES[name]
    model = case.build()
    drawn = set_heads(case, model, scaled=True, biases=True)
    before = run(case, model).detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stiefelize(model, logit_gain="fit")
    said = [str(w.message) for w in caught]
    assert said == [] if case.gain_warns is None else (len(said) == 1 and case.gain_warns in said[0])
    torch.testing.assert_close(run(case, model), before, rtol=0, atol=case.same_tol)
    # companions: without the gain the scaled heads lose their logit scale; without the rescaled biases, their logits
    plain = case.build()
    set_heads(case, plain, scaled=True)
    assert stiefelize(plain, probe=case.inputs()).output_change > DIFFER_MIN
    if drawn:
        unscaled = case.build()
        set_heads(case, unscaled, scaled=True, biases=True)
        monkeypatch.setattr(convert_module, "_rescale_biases", lambda site: None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the caveats of the cases that warn, tested above
            assert stiefelize(unscaled, logit_gain="fit", probe=case.inputs()).output_change > DIFFER_MIN


# ------------------------------------------------------------------------------------------ user layouts
def _thirds(param: str) -> Layout:
    return Layout("equal thirds", Block(param, 0, 0, 3), Block(param, 0, 1, 3))


@pytest.mark.parametrize("name", THIRDS)
def test_a_layout_of_equal_thirds_is_refused_naming_the_module_and_the_fix(name):
    """Following the old refusal's hint with equal thirds converted these modules silently wrong: refused now,
    naming the module, the built-in layout and the Block that reads its rows; nothing changed."""
    case = CASES[name]
    model = case.build()
    before = state_snapshot(model)
    path = attns(case, model)[0][0]
    fix = (r"interleaved=True\) with part 0 for the query and 1 for the key" if name in ("gpt_bigcode", "deberta_v1")
           else r"groups='mp_num'\) with part 0 for the query and 2 for the key")
    with pytest.raises(ValueError, match=rf"(?s)cannot convert .*{path.replace('.', chr(92) + '.')}.*"
                                         rf"silently wrong.*{fix}"):
        stiefelize(model, targets=[_thirds(THIRDS[name])])
    assert unconverted_and_unchanged(model, before)
    with pytest.warns(UserWarning, match="silently wrong"):  # strict=False: skipped, named, unchanged
        result = stiefelize(model, targets=[_thirds(THIRDS[name])], strict=False)
    assert len(result) == 0 and len(result.skipped) == len(attns(case, model)) and unconverted_and_unchanged(model, before)


@pytest.mark.parametrize(("name", "layout"), [
    ("gpt_bigcode_multi_query", _thirds("c_attn.weight")),  # one group: [q | k | v], split by the declared heads
    ("gpt_bigcode", Layout("mine", Block("c_attn.weight", 0, 0, 3, interleaved=True),
                           Block("c_attn.weight", 0, 1, 3, interleaved=True))),
    ("codegen", Layout("mine", Block("qkv_proj.weight", 0, 0, 3, groups=4), Block("qkv_proj.weight", 0, 2, 3,
                                                                                  groups=4))),
    ("codegen_8_heads", Layout("mine", Block("qkv_proj.weight", 0, 0, 3, groups="mp_num"),
                               Block("qkv_proj.weight", 0, 2, 3, groups="mp_num")))])
def test_companion_a_user_layout_of_the_actual_rows_converts_as_the_built_in_table(name, layout):
    case = CASES[name]
    a, b = case.build(), case.build()
    stiefelize(a)
    assert len(stiefelize(b, targets=[layout])) == len(attns(case, b))
    for (_, qa, ka), (_, qb, kb) in zip(converted_query_key_frames(a), converted_query_key_frames(b), strict=True):
        assert torch.equal(qa, qb) and torch.equal(ka, kb)


@pytest.mark.parametrize("layout", [
    Layout("interleaved", Block("qkv_proj.weight", 0, 0, 3, interleaved=True),
           Block("qkv_proj.weight", 0, 1, 3, interleaved=True)),
    Layout("two groups", Block("qkv_proj.weight", 0, 0, 3, groups=2), Block("qkv_proj.weight", 0, 2, 3, groups=2))])
def test_a_layout_of_other_groups_on_codegen_is_refused(layout):
    case = CASES["codegen"]
    model = case.build()
    before = state_snapshot(model)
    with pytest.raises(ValueError, match=r"reads other groups, while qkv_proj\.weight holds 3 slices in each of its "
                                         r"mp_num=4 groups.*silently wrong"):
        stiefelize(model, targets=[layout])
    assert unconverted_and_unchanged(model, before)


def test_codegen_whose_heads_span_two_groups_is_refused():
    """CodeGen with 2 heads of 16 in 4 groups: each head's query features lie in two groups (8 in each), so a head is
    no block of one group: refused naming the module; with strict=False skipped with a warning, unchanged."""
    model = _seeded(lambda: T.CodeGenForCausalLM(T.CodeGenConfig(n_embd=D, n_head=2, n_layer=1, vocab_size=V,
                                                                 rotary_dim=4, n_ctx=32, n_positions=32)))()
    before = state_snapshot(model)
    why = (r"transformer\.h\.0\.attn': CodeGenAttention matches layout 'CodeGen qkv_proj' but its 2 query heads of "
           r"size 16 do not fit whole in the 8-row query slice of each of the 4 groups of qkv_proj\.weight "
           r"\(mp_num=4\): a head spanning two groups cannot be one frame")
    with pytest.raises(ValueError, match=why):
        stiefelize(model)
    assert unconverted_and_unchanged(model, before)
    with pytest.warns(UserWarning, match=why):
        stiefelize(model, strict=False)
    assert unconverted_and_unchanged(model, before)
    # companion: the reference rows of head 0 do span two groups (rows 0:8 and 24:32)
    rows = codegen_rows(D, 2, "q")[0]
    assert rows.tolist() == list(range(0, 8)) + list(range(24, 32))


def test_grouped_blocks_are_checked_when_written():
    for bad in (dict(groups=0), dict(groups=True), dict(groups="not a name"), dict(groups=2.0)):
        with pytest.raises(ValueError, match="groups=.* is invalid"):
            Block("w", 0, 0, 3, **bad)
    for bad in (dict(part=0, parts=1), dict(span=(0, 8)), dict(parts=3, interleaved=True)):
        with pytest.raises(ValueError, match="parts >= 2 and without interleaved or span"):
            Block("w", **bad, groups=4)
    with pytest.raises(ValueError, match="same param, dim, parts and groups"):
        Layout("x", Block("w", 0, 0, 3, groups=4), Block("w", 0, 2, 3))
    with pytest.raises(ValueError, match="same param, dim, parts and groups"):
        Layout("x", Block("w", 0, 0, 3, groups=4), Block("w", 0, 2, 3, groups=2))
    with pytest.raises(ValueError, match="not one range; use locate_grouped"):
        Block("w", 0, 0, 3, groups=4).locate(96)
    with pytest.raises(ValueError, match="96 output features, not 5 group"):
        Block("w", 0, 0, 3, groups=5).locate_grouped(96, 5)
    # companions: well-formed blocks and the rows they name
    assert Block("w", 0, 2, 3, groups="mp_num").locate_grouped(96, 4) == (16, 8, 4)
    assert Block("qkv_proj.weight", 0, 2, 3, groups="mp_num").bias_block() == Block("qkv_proj.bias", 0, 2, 3,
                                                                                     groups="mp_num")
    assert "part 3/3 of each of its mp_num groups" in Block("w", 0, 2, 3, groups="mp_num").describe()


# ------------------------------------------------------------------------------------------ checkpoints, training
@pytest.mark.parametrize("gain", [None, "learn"])
@pytest.mark.parametrize("name", ["gpt_bigcode", "gpt_bigcode_multi_query", "codegen", "codegen_8_heads"])
def test_stock_checkpoint_holds_the_frames_at_the_reference_rows_and_loads_both_ways(name, gain):
    case = CASES[name]
    model = case.build()
    stock_keys = list(model.state_dict())
    stiefelize(model, logit_gain=gain)
    move_every_parameter_(model)  # so the checkpoint is not the initial state
    expected = run(case, model).detach()
    state = model.state_dict()
    assert list(state) == stock_keys
    # the stock weight holds gamma_h U_h^T at query head h's reference rows and U_g^T at key head g's
    for (path, attn), (_, qf, kf) in zip(attns(case, model), converted_query_key_frames(model), strict=True):
        q_param, q_rows, k_param, k_rows = case.spec(attn)
        p = _get(attn, q_param.rsplit(".", 1)[0]).parametrizations.weight[0]
        gains = torch.ones(len(q_rows), dtype=F64) if gain is None else torch.exp(p.gain_rate * p.q_log_gain).detach()
        w = state[f"{path}.{q_param}"]
        for h, s in enumerate(q_rows):
            torch.testing.assert_close(w[s].T, gains[h] * qf[h].detach(), rtol=0, atol=SAME_TOL)
        for g, s in enumerate(k_rows):
            assert torch.equal(w[s].T, kf[g].detach())
    # the stock class loads it (strict) and computes the converted model's function
    stock = case.build()
    stock.load_state_dict(state, strict=True)
    torch.testing.assert_close(run(case, stock), expected, rtol=0, atol=SAME_TOL)
    # a converted model loads the stock checkpoint without a warning: same frames, same function
    again = case.build()
    stiefelize(again, logit_gain=gain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(state, strict=True)
    for (_, qa, ka), (_, qb, kb) in zip(converted_query_key_frames(model), converted_query_key_frames(again),
                                        strict=True):
        torch.testing.assert_close(qb, qa, rtol=0, atol=SAME_TOL)
        torch.testing.assert_close(kb, ka, rtol=0, atol=SAME_TOL)
    torch.testing.assert_close(run(case, again), expected, rtol=0, atol=SAME_TOL)


@pytest.mark.parametrize("name", ["gpt_bigcode", "codegen", "mpt", "t5"])
def test_a_training_step_keeps_the_frames_orthonormal_and_moves_the_values(name):
    case = CASES[name]
    model = case.build()
    model.train()
    stiefelize(model, logit_gain="learn")
    frames = frame_parameters(model)
    start = [f.detach().clone() for f in frames]
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    inputs = case.inputs()
    labels = inputs.get("decoder_input_ids", inputs["input_ids"])
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    for f, f0 in zip(frames, start, strict=True):
        eye = torch.eye(f.shape[-1], dtype=F64)
        assert float((f.detach().transpose(-1, -2) @ f.detach() - eye).abs().max()) < ORTHO_TOL_F64
        assert float((f.detach() - f0).abs().max()) > DIFFER_MIN  # the frames trained


def test_qk_bias_drop_zeroes_the_query_and_key_entries_of_every_gpt_bigcode_head():
    case = CASES["gpt_bigcode"]
    model = case.build()
    biases = [attn.c_attn.bias.detach().clone() for _, attn in attns(case, model)]
    stiefelize(model, qk_bias="drop")
    for (_, attn), b0 in zip(attns(case, model), biases, strict=True):
        _, q_rows, _, k_rows = case.spec(attn)
        b = attn.c_attn.bias.detach()
        dropped = torch.zeros_like(b, dtype=torch.bool)
        for s in q_rows + k_rows:
            dropped[s] = True
        assert torch.equal(b[dropped], torch.zeros(int(dropped.sum()), dtype=F64))
        assert torch.equal(b[~dropped], b0[~dropped]) and bool((b0[~dropped] != 0).all())  # the value entries kept


def test_qk_bias_drop_zeroes_deberta_v1s_q_bias_and_keeps_its_v_bias():
    """DeBERTa v1 keeps its query bias as ``q_bias`` beside a bias-free ``in_proj`` (its layout names it): 'drop'
    holds it at zero, leaves ``v_bias``, and the exported checkpoint computes the converted model's function in the
    stock model, whose ``q_bias`` is then zero."""
    case = CASES["deberta_v1"]
    model = case.build()
    modules = [attn for _, attn in attns(case, model)]
    with torch.no_grad():
        for attn in modules:
            attn.q_bias.normal_()
            attn.v_bias.normal_()
    v_biases = [attn.v_bias.detach().clone() for attn in modules]
    stiefelize(model, qk_bias="drop")
    for attn, v0 in zip(modules, v_biases, strict=True):
        assert torch.equal(attn.q_bias, torch.zeros_like(attn.q_bias)) and torch.equal(attn.v_bias, v0)
        assert bool((v0 != 0).all())  # companion: the value bias is not zero, so keeping it is seen
    stock = case.build()
    with torch.no_grad():
        for _, attn in attns(case, stock):
            attn.q_bias.fill_(1.0)  # overwritten by the checkpoint's zeros
    stock.load_state_dict(export_state_dict(model))
    assert all(torch.equal(attn.q_bias, torch.zeros_like(attn.q_bias)) for _, attn in attns(case, stock))
    with torch.no_grad():
        torch.testing.assert_close(run(case, stock), run(case, model), rtol=0, atol=case.same_tol)


# ------------------------------------------------------------------------------------------ logit gains
#: the QK-norm children each case's forward applies after the projection
QK_NORMS = {"qwen3": "q_norm (Qwen3RMSNorm), k_norm (Qwen3RMSNorm)",
            "olmo2": "q_norm (Olmo2RMSNorm), k_norm (Olmo2RMSNorm)",
            "cohere": "q_norm (CohereLayerNorm), k_norm (CohereLayerNorm)"}


def _gain_grad(model, case) -> float:
    inputs = case.inputs()
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    return max(float(p.grad.abs().max()) for n, p in model.named_parameters() if n.endswith("q_log_gain"))


@pytest.mark.parametrize("gain", ["learn", "fit"])
@pytest.mark.parametrize("name", QK_NORMS)
def test_a_logit_gain_under_qk_norm_is_warned_naming_the_norm(name, gain):
    """Qwen3, OLMo2 and Cohere normalize q and k after the projection, so a gain on the query rows is no logit
    factor (a per-head norm divides it out: its gradient is zero up to the norm's eps): warned, naming the modules
    and the norms; the conversion itself is the reference (test above)."""
    case = CASES[name]
    model = case.build()
    paths = [p for p, _ in attns(case, model)]
    with pytest.warns(UserWarning, match=rf"logit_gain='{gain}' does not act as each query head's logit factor in "
                                         rf"'{paths[0]}', '{paths[1]}': {case.cls}: it normalizes its queries/keys "
                                         rf"after the projection \({re.escape(QK_NORMS[name])}\).*logit_gain=None"):
        stiefelize(model, logit_gain=gain)
    if name != "olmo2" and gain == "learn":  # a norm per head: at gain 1 the gradient is the norm's eps at work
        assert _gain_grad(model, case) < DEAD_GRAD_MAX


@pytest.mark.parametrize("name", ["mistral", "cohere_without_qk_norm"])
def test_companion_a_logit_gain_without_qk_norm_is_not_warned_and_trains(name):
    case = CASES["cohere"] if name == "cohere_without_qk_norm" else CASES[name]
    build = (_llama_like(T.CohereConfig, T.CohereForCausalLM, num_key_value_heads=2, use_qk_norm=False)
             if name == "cohere_without_qk_norm" else case.build)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stiefelize(model, logit_gain="learn")
    assert _gain_grad(model, case) > DIFFER_MIN


def test_companion_a_norm_of_the_keys_alone_is_not_warned_and_the_gain_trains():
    """A per-head norm of k alone leaves the query gain in the logits (q_h k_h^T scales with it): no warning, and
    the gain gets a gradient, where under the full QK-norm (test above) it is dead."""
    case = CASES["qwen3"]
    model = case.build()
    for _, attn in attns(case, model):
        attn.q_norm = torch.nn.Identity()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stiefelize(model, logit_gain="learn")
    assert _gain_grad(model, case) > DIFFER_MIN


def _deberta(version: int, **relative) -> nn.Module:
    """DeBERTa (v1) or DeBERTa-v2 with relative attention, c2p and p2c, and ``relative`` config entries."""
    if version == 1:
        cfg = T.DebertaConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=1, intermediate_size=2 * D,
                              vocab_size=V, relative_attention=True, pos_att_type=["c2p", "p2c"],
                              max_relative_positions=16, **relative)
        return _seeded(lambda: T.DebertaModel(cfg))()
    cfg = T.DebertaV2Config(hidden_size=D, num_attention_heads=H, num_hidden_layers=1, intermediate_size=2 * D,
                            vocab_size=V, relative_attention=True, pos_att_type=["c2p", "p2c"],
                            max_relative_positions=16, position_buckets=8, pad_token_id=0, **relative)
    return _seeded(lambda: T.DebertaV2Model(cfg))()


@pytest.mark.parametrize(("version", "names"), [(1, "pos_proj, pos_q_proj"), (2, "pos_key_proj, pos_query_proj")])
def test_a_logit_gain_beside_separate_position_projections_is_warned(version, names):
    """DeBERTa's c2p/p2c logits pair the queries with a position-key projection and the keys with a position-query
    projection of their own: a query gain (and the keys 'fit' rescales) scales them otherwise than the content
    logits, so 'fit' does not keep the function of scaled orthonormal heads (about 1e-5 here). Warned, naming them.
    Companion: DeBERTa-v2 sharing the content projections with the position terms (share_att_key) is not warned and
    keeps the function."""
    case = CASES["deberta_v1" if version == 1 else "deberta_v2"]
    model = _deberta(version, **({} if version == 1 else {"share_att_key": False}))
    set_heads(case, model, scaled=True, biases=True)
    with pytest.warns(UserWarning, match=rf"DisentangledSelfAttention: it adds relative-position logits .*\({names}"):
        result = stiefelize(model, logit_gain="fit", probe=_lm())
    assert result.output_change > 1e-8
    if version == 2:
        shared = _deberta(2, share_att_key=True)
        set_heads(case, shared, scaled=True, biases=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert stiefelize(shared, logit_gain="fit", probe=_lm()).output_change < case.same_tol


def test_a_logit_gain_on_mpt_with_clip_qkv_is_warned_and_not_without():
    make = lambda clip: _seeded(lambda: T.MptForCausalLM(T.MptConfig(  # noqa: E731
        d_model=D, n_heads=H, n_layers=1, vocab_size=V, expansion_ratio=2, attn_config={"clip_qkv": clip})))()
    with pytest.warns(UserWarning, match=r"MptAttention: it clamps q, k and v to \+-6 after the projection "
                                         r"\(clip_qkv\)"):
        stiefelize(make(6.0), logit_gain="learn")
    with warnings.catch_warnings():  # companion: no clamp, no warning
        warnings.simplefilter("error")
        stiefelize(make(None), logit_gain="learn")
