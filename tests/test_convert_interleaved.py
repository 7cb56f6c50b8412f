"""Tests of the converter on fused q|k|v weights interleaved per head: HF GPT-NeoX (Pythia), GPT-NeoX-Japanese,
Bloom, Persimmon and Falcon in its three layouts (original, ``new_decoder_architecture``, ``multi_query``).

Their ``query_key_value`` rows are not three equal slices: each model's forward splits them per head (or per
key/value head). The reference here is written out by hand from those forwards (``*_rows`` below, not through the
converter's table), with polar factors computed by an SVD in float64: the frames, the rebuilt weight, the outputs,
the fitted gains, the dropped biases and the stock checkpoints are compared with it. Each property has a companion
where it must fail: the equal-thirds (or contiguous) reading takes other rows, and a user layout of equal slices on
these modules, which used to convert silently wrong, is refused with the model unchanged. Tiny random-config models
in float64, no download.
"""

from __future__ import annotations

import copy
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
    rel,
    seeded_f64,
    state_snapshot,
    unconverted_and_unchanged,
)
from torch import nn

from geoopt_stiefel_attention import (
    LAYOUTS,
    Block,
    Layout,
    StiefelAdam,
    export_state_dict,
    frame_parameters,
    param_groups,
    parametrized_state_dict,
    stiefelize,
    unstiefelize,
)
from geoopt_stiefel_attention.convert import converted_query_key_frames

transformers = pytest.importorskip("transformers")

#: two float64 computations of one polar factor (an SVD here, the manifold's projection in the converter)
POLAR_TOL = 1e-10
#: agreement of two float64 forward passes that compute the same function in different orders
SAME_TOL = 1e-10
#: a change of the function (relative), or a difference of head blocks, must exceed this
DIFFER_MIN = 1e-4
#: gains recovered from a stock checkpoint (a norm, a log and an exp in float64)
GAIN_TOL = 1e-12

D, H, R, VOCAB = 32, 4, 8, 64  # width, query heads, head size (D / H), vocabulary


# ------------------------------------------------------------------------------------------ the reference
def per_head_rows(heads: int, kv_heads: int, r: int) -> tuple[list[slice], list[slice]]:
    """GPT-NeoX(-Japanese): ``qkv.view(..., H, 3 r)`` then thirds of the last axis; Bloom, Persimmon:
    ``view(..., H, 3, r)``; Falcon's original layout: ``view(..., -1, r).unflatten(-2, (H, 3))``. Rows of head
    ``h``: ``[q_h, k_h, v_h]``, ``r`` each, from ``3 h r``."""
    assert kv_heads == heads
    q = [slice(3 * h * r, 3 * h * r + r) for h in range(heads)]
    k = [slice(3 * h * r + r, 3 * h * r + 2 * r) for h in range(heads)]
    return q, k


def falcon_new_rows(heads: int, kv_heads: int, r: int) -> tuple[list[slice], list[slice]]:
    """Falcon's ``new_decoder_architecture``: ``view(..., G, -1, r)`` with ``G = num_kv_heads``;
    ``grouped[..., :-2, :].flatten(-3, -2)`` are the queries (query head ``g n + i``, ``n = H / G``, is block ``i``
    of group ``g``), ``grouped[..., -2, :]`` the key of group ``g``, ``grouped[..., -1, :]`` its value."""
    n = heads // kv_heads
    q = [slice((g * (n + 2) + i) * r, (g * (n + 2) + i + 1) * r) for g in range(kv_heads) for i in range(n)]
    k = [slice((g * (n + 2) + n) * r, (g * (n + 2) + n + 1) * r) for g in range(kv_heads)]
    return q, k


def falcon_multi_query_rows(heads: int, kv_heads: int, r: int) -> tuple[list[slice], list[slice]]:
    """Falcon's ``multi_query``: ``view(..., -1, r).split([H, 1, 1], dim=-2)``: every query head, one key, one
    value."""
    assert kv_heads == 1
    return [slice(h * r, (h + 1) * r) for h in range(heads)], [slice(heads * r, heads * r + r)]


def contiguous_rows(heads: int, kv_heads: int, r: int) -> tuple[list[slice], list[slice]]:
    """The reading of a plain fused q|k|v: query rows ``0 : H r``, key rows ``H r : (H + H_kv) r`` (equal thirds
    when ``H_kv = H``). Right for Falcon's ``multi_query``, wrong for the others."""
    return ([slice(h * r, (h + 1) * r) for h in range(heads)],
            [slice((heads + g) * r, (heads + g + 1) * r) for g in range(kv_heads)])


# ------------------------------------------------------------------------------------------ cases
@dataclass
class Case:
    """A tiny model with interleaved ``query_key_value`` weights: how to build it, its attention modules
    (``(path, module)``), its query/key heads and where its head rows are, from its forward (written by hand)."""

    build: Callable[[], nn.Module]
    attns: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    heads: tuple[int, int]
    rows: Callable[[int, int, int], tuple[list[slice], list[slice]]]

    def head_rows(self) -> tuple[list[slice], list[slice]]:
        return self.rows(*self.heads, R)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return seeded_f64(make, biases=lambda name, p: name.endswith("query_key_value.bias"))


def _falcon(**kw):
    return _seeded(lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=D, num_attention_heads=H, num_hidden_layers=2, vocab_size=VOCAB, bias=True, **kw)))


def _layers(attr: str, sub: str) -> Callable[[nn.Module], list[tuple[str, nn.Module]]]:
    def attns(model):
        layers = model.get_submodule(attr)
        return [(f"{attr}.{i}.{sub}", getattr(layer, sub)) for i, layer in enumerate(layers)]
    return attns


CASES = {
    "gpt_neox": Case(_seeded(lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=D, num_attention_heads=H, num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB))),
        _layers("gpt_neox.layers", "attention"), (H, H), per_head_rows),
    "gpt_neox_japanese": Case(_seeded(lambda: transformers.GPTNeoXJapaneseForCausalLM(
        transformers.GPTNeoXJapaneseConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=2,
                                           intermediate_multiple_size=2, vocab_size=VOCAB, bos_token_id=0,
                                           eos_token_id=0))),
        _layers("gpt_neox_japanese.layers", "attention"), (H, H), per_head_rows),
    "bloom": Case(_seeded(lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        hidden_size=D, n_head=H, n_layer=2, vocab_size=VOCAB))),
        _layers("transformer.h", "self_attention"), (H, H), per_head_rows),
    "persimmon": Case(_seeded(lambda: transformers.PersimmonForCausalLM(transformers.PersimmonConfig(
        hidden_size=D, num_attention_heads=H, num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
        bos_token_id=0, eos_token_id=0, qk_layernorm=False))),  # its default QK-norm would divide a logit gain
    # out (warned: test_convert_architectures.py); the interleaved rows are the same either way
        _layers("model.layers", "self_attn"), (H, H), per_head_rows),
    "falcon": Case(_falcon(new_decoder_architecture=False, multi_query=False),
                   _layers("transformer.h", "self_attention"), (H, H), per_head_rows),
    "falcon_new_decoder_architecture": Case(_falcon(new_decoder_architecture=True, num_kv_heads=2),
                                            _layers("transformer.h", "self_attention"), (H, 2), falcon_new_rows),
    "falcon_multi_query": Case(_falcon(new_decoder_architecture=False, multi_query=True),
                               _layers("transformer.h", "self_attention"), (H, 1), falcon_multi_query_rows),
}
#: what the result's layout says of each case's form
FORMS = {name: " (q|k|v per head)" for name in CASES} | {
    "falcon_new_decoder_architecture": " (per key/value head: its 2 query heads | k | v)",
    "falcon_multi_query": " (one group: q of 4 heads | k | v)"}
#: the cases whose rows a plain q|k|v reading gets wrong (every one but the single group of multi-query)
INTERLEAVED = [name for name in CASES if CASES[name].heads[1] > 1]


def _ids(seed=1):
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def run(model):
    return model(input_ids=_ids()).logits


def set_heads(model, case, scales=None, bias=True):
    """Make every query/key head block (at the reference rows) orthonormal (QR of a Gaussian), times
    ``scales[i]`` for the ``i``-th block of a layer (query heads, then key heads) if given; with ``bias=False``
    set the query/key biases to zero (a gain scales the logits only of a bias-free head)."""
    g = torch.Generator().manual_seed(5)
    q_rows, k_rows = case.head_rows()
    with torch.no_grad():
        for _, attn in case.attns(model):
            w, b = attn.query_key_value.weight, attn.query_key_value.bias
            for i, rows in enumerate(q_rows + k_rows):
                u, _ = torch.linalg.qr(torch.randn(D, R, generator=g, dtype=F64))
                w[rows] = (u * (1.0 if scales is None else scales[i])).T
                if b is not None and not bias:
                    b[rows] = 0


# ------------------------------------------------------------------------------------------ (a) the frames
@pytest.mark.parametrize("name", CASES)
def test_frames_are_the_polar_factors_of_the_head_blocks_the_forward_reads(name):
    case = CASES[name]
    model = case.build()
    stock = [attn.query_key_value.weight.detach().clone() for _, attn in case.attns(model)]
    report = stiefelize(model)
    q_rows, k_rows = case.head_rows()
    paths = [p for p, _ in case.attns(model)]
    assert [(c.path, c.layout, c.q_heads, c.k_heads, c.d_q, c.r) for c in report] == [
        (p, f"interleaved query_key_value{FORMS[name]}", *case.heads, D, R) for p in paths]
    found = converted_query_key_frames(model)
    assert [p for p, _, _ in found] == paths
    for (_, q_frames, k_frames), (_, attn), w in zip(found, case.attns(model), stock, strict=True):
        assert q_frames.shape == (case.heads[0], D, R) and k_frames.shape == (case.heads[1], D, R)
        expected = w.clone()
        for frames, rows in ((q_frames, q_rows), (k_frames, k_rows)):
            for h, s in enumerate(rows):
                truth = polar64(w[s].T)
                torch.testing.assert_close(frames[h].detach(), truth, rtol=0, atol=POLAR_TOL)
                expected[s] = truth.T
        # the weight the forward reads: polar factors at the query/key rows, every other row (values) as it was
        rebuilt = attn.query_key_value.weight.detach()
        torch.testing.assert_close(rebuilt, expected, rtol=0, atol=POLAR_TOL)
        others = torch.ones(w.shape[0], dtype=torch.bool)
        for s in q_rows + k_rows:
            others[s] = False
        assert int(others.sum()) == w.shape[0] - (len(q_rows) + len(k_rows)) * R
        assert torch.equal(rebuilt[others], w[others])


@pytest.mark.parametrize("name", CASES)
def test_rebuild_by_one_cat_equals_the_rebuild_segment_by_segment(name):
    case = CASES[name]
    model = case.build()
    stiefelize(model, logit_gain="learn")
    for _, attn in case.attns(model):
        plist = attn.query_key_value.parametrizations.weight
        with torch.no_grad():
            plist[0].q_log_gain.normal_(0, 0.05)
        assert torch.equal(plist[0]._build(plist.original), plist[0]._build_by_rows(plist.original))


# ------------------------------------------------------------------------------------------ (b) the function
@pytest.mark.parametrize("name", CASES)
def test_orthonormal_head_blocks_convert_exactly_and_others_change(name):
    case = CASES[name]
    model = case.build()
    set_heads(model, case)
    before = run(model).detach()
    report = stiefelize(model, probe={"input_ids": _ids()})
    torch.testing.assert_close(run(model), before, rtol=0, atol=SAME_TOL)
    assert report.output_change < SAME_TOL
    # companion: the initialised blocks are not orthonormal, so conversion changes the output
    fresh = case.build()
    report = stiefelize(fresh, probe={"input_ids": _ids()})
    assert report.output_change > DIFFER_MIN


@pytest.mark.parametrize("name", INTERLEAVED)
def test_orthonormal_blocks_at_the_contiguous_rows_do_not_convert_exactly(name):
    """Companion of the test above: blocks made orthonormal where a plain q|k|v reading looks for them are not
    the model's head blocks, so the conversion changes its output (the reference rows are what matters)."""
    case = CASES[name]
    model = case.build()
    set_heads(model, Case(case.build, case.attns, case.heads, contiguous_rows))
    report = stiefelize(model, probe={"input_ids": _ids()})
    assert report.output_change > DIFFER_MIN


#: Persimmon normalises each query/key head (qk_layernorm), which takes out a head's scale up to its LayerNorm's eps
#: (a scaled head reads 1e-7 away): no gain restores it exactly, and none is needed
@pytest.mark.parametrize("name", [name for name in CASES if name != "persimmon"])
def test_fit_gain_keeps_scaled_orthonormal_heads(name):
    case = CASES[name]
    heads, kv_heads = case.heads
    scales = torch.linspace(0.3, 2.5, heads + kv_heads).tolist()
    model = case.build()
    set_heads(model, case, scales, bias=False)
    before = run(model).detach()
    stiefelize(model, logit_gain="fit")
    torch.testing.assert_close(run(model), before, rtol=0, atol=SAME_TOL)
    # the gain of query head h is scale(q_h) * scale(k of its group), key head h // (H / H_kv)
    n = heads // kv_heads
    expected = torch.tensor([scales[h] * scales[heads + h // n] for h in range(heads)], dtype=F64)
    for _, attn in case.attns(model):
        p = attn.query_key_value.parametrizations.weight[0]
        torch.testing.assert_close(torch.exp(p.gain_rate * p.q_log_gain.detach()), expected, rtol=GAIN_TOL, atol=0)
    # companion: without the gain the scaled heads lose their logit scale
    plain = case.build()
    set_heads(plain, case, scales, bias=False)
    assert stiefelize(plain, probe={"input_ids": _ids()}).output_change > DIFFER_MIN


@pytest.mark.parametrize("name", ["gpt_neox", "bloom", "falcon_new_decoder_architecture"])
def test_qk_bias_drop_zeroes_the_query_and_key_entries_of_every_head(name):
    case = CASES[name]
    model = case.build()
    stock = [attn.query_key_value.bias.detach().clone() for _, attn in case.attns(model)]
    stiefelize(model, qk_bias="drop")
    q_rows, k_rows = case.head_rows()
    for (_, attn), b in zip(case.attns(model), stock, strict=True):
        expected = b.clone()
        for s in q_rows + k_rows:
            expected[s] = 0
        assert torch.equal(attn.query_key_value.bias.detach(), expected)
        assert float(expected.abs().min()) == 0 and bool((expected != 0).any())
    # companion: "keep" leaves them
    kept = case.build()
    stiefelize(kept)
    for (_, attn), b in zip(case.attns(kept), stock, strict=True):
        assert torch.equal(attn.query_key_value.bias.detach(), b)


# ------------------------------------------------------------------------------------------ (c) the silent case
def _thirds(param="query_key_value.weight"):
    return Layout("equal thirds", Block(param, 0, 0, 3), Block(param, 0, 1, 3))


@pytest.mark.parametrize("name", INTERLEAVED)
def test_a_plain_qkv_reading_takes_other_rows_and_is_refused(name):
    case = CASES[name]
    model = case.build()
    q_rows, k_rows = case.head_rows()
    naive_q, naive_k = contiguous_rows(*case.heads, R)
    w = case.attns(model)[0][1].query_key_value.weight.detach()
    # what the equal thirds (the declared-heads split under grouped-query attention) would take differs from the
    # model's head blocks, and so do their polar factors: test (a) would tell
    gap = max(float((polar64(w[a].T) - polar64(w[b].T)).abs().max())
              for a, b in zip(naive_q + naive_k, q_rows + k_rows, strict=True))
    assert gap > DIFFER_MIN
    before = state_snapshot(model)
    for layout in (_thirds(), Layout("spans", Block("query_key_value.weight", span=(0, H * R)),
                                     Block("query_key_value.weight", span=(H * R, 2 * H * R)))):
        with pytest.raises(ValueError, match=r"(?s)cannot convert 2 module\(s\).*"
                                             + case.attns(model)[0][0].replace(".", r"\.")
                                             + r".*interleaved per head.*silently wrong.*interleaved=True"):
            stiefelize(model, targets=[layout])
        assert unconverted_and_unchanged(model, before)
    # with strict=False the modules are skipped, named in a warning, and left unchanged
    with pytest.warns(UserWarning, match="interleaved per head"):
        result = stiefelize(model, targets=[_thirds()], strict=False)
    assert len(result) == 0 and len(result.skipped) == 2 and unconverted_and_unchanged(model, before)
    # a layout matching the decoder layer (a wrapper) that names the same weight is refused too
    wrapper_param = case.attns(model)[0][0].rsplit(".", 1)[1] + ".query_key_value.weight"
    wrapper = Layout("wrapper thirds", Block(wrapper_param, 0, 0, 3), Block(wrapper_param, 0, 1, 3),
                     head_dim=R, when=lambda m: hasattr(m, case.attns(model)[0][0].rsplit(".", 1)[1]))
    with pytest.raises(ValueError, match="interleaved per head"):
        stiefelize(model, targets=lambda path, m: wrapper if wrapper.matches(m) else None)
    assert unconverted_and_unchanged(model, before)


@pytest.mark.parametrize("name", INTERLEAVED)
def test_companion_the_interleaved_user_layout_converts_as_the_built_in_table(name):
    case = CASES[name]
    a, b = case.build(), case.build()
    stiefelize(a)
    mine = Layout("mine", Block("query_key_value.weight", 0, 0, 3, interleaved=True),
                  Block("query_key_value.weight", 0, 1, 3, interleaved=True))
    report = stiefelize(b, targets=[mine])
    assert [c.layout for c in report] == [f"mine{FORMS[name]}"] * 2
    for (_, qa, ka), (_, qb, kb) in zip(converted_query_key_frames(a), converted_query_key_frames(b), strict=True):
        assert torch.equal(qa, qb) and torch.equal(ka, kb)


def test_companion_equal_thirds_of_falcon_multi_query_are_one_group_and_convert():
    """Falcon's multi-query weight is one plain ``[q | k | v]``: a user layout of equal thirds is split by the
    declared heads (4 query, 1 key/value) and gives the built-in table's frames; it is not refused."""
    case = CASES["falcon_multi_query"]
    a, b = case.build(), case.build()
    stiefelize(a)
    report = stiefelize(b, targets=[_thirds()])
    assert [(c.q_heads, c.k_heads) for c in report] == [(H, 1)] * 2
    for (_, qa, ka), (_, qb, kb) in zip(converted_query_key_frames(a), converted_query_key_frames(b), strict=True):
        assert torch.equal(qa, qb) and torch.equal(ka, kb)


def test_falcon_whose_declared_key_value_heads_contradict_its_width_is_refused():
    """Falcon's original layout with ``num_kv_heads`` (2) other than its heads (4): the module declares 2 key/value
    heads but its weight holds three per head, so its query/key rows cannot be told apart: refused, unchanged."""
    model = _falcon(new_decoder_architecture=False, multi_query=False, num_kv_heads=2)()
    before = state_snapshot(model)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.self_attention.*96 output features, not 2 group\(s\) "
                                         r"of 2 query head\(s\).*cannot be told apart"):
        stiefelize(model)
    assert unconverted_and_unchanged(model, before)


def test_interleaved_blocks_are_checked_when_written():
    with pytest.raises(ValueError, match="parts >= 2"):
        Block("w", 0, 0, 1, interleaved=True)
    with pytest.raises(ValueError, match="parts >= 2"):
        Block("w", span=(0, 8), interleaved=True)
    with pytest.raises(ValueError, match="interleaved"):
        Block("w", interleaved=1)
    with pytest.raises(ValueError, match="same param, dim and parts"):
        Layout("x", Block("w", 0, 0, 3, interleaved=True), Block("w", 0, 1, 3))
    with pytest.raises(ValueError, match="same param, dim and parts"):
        Layout("x", Block("w", 0, 1, 3, interleaved=True), Block("w", 0, 1, 3, interleaved=True))
    # companions: well-formed blocks and the built-in rows that use them
    assert Block("w", 0, 1, 3, interleaved=True).locate_interleaved(96, 4, 4, 8) == (8, 8, 4)
    assert Block("w", 0, 0, 3, interleaved=True).locate_interleaved(64, 4, 2, 8) == (0, 16, 2)
    assert Block("w", 0, 1, 3, interleaved=True).locate_interleaved(64, 4, 2, 8) == (16, 8, 2)
    # GPTBigCode's c_attn interleaves the same way (tested in test_convert_architectures.py), and timm MaxViT's
    # AttentionCl per head (tested in test_convert_vision_models.py)
    assert [lay.name for lay in LAYOUTS if lay.q.interleaved] == ["timm AttentionCl qkv (head_first)",
                                                                  "interleaved query_key_value",
                                                                  "GPTBigCode c_attn Linear",
                                                                  "DeBERTa in_proj Linear"]


# ------------------------------------------------------------------------------------------ (d) checkpoints
@pytest.mark.parametrize("gain", [None, "learn"])
@pytest.mark.parametrize("name", CASES)
def test_stock_checkpoint_round_trip(name, gain):
    case = CASES[name]
    model = case.build()
    stock_keys = list(model.state_dict())
    stiefelize(model, logit_gain=gain)
    move_every_parameter_(model)  # so the checkpoint is not the initial state
    expected = run(model).detach()
    state = model.state_dict()
    assert list(state) == stock_keys
    # the stock weight holds gamma_h U_h^T at query head h's rows and U_g^T at key head g's rows (reference rows)
    q_rows, k_rows = case.head_rows()
    for (path, attn), (_, q_frames, k_frames) in zip(case.attns(model), converted_query_key_frames(model),
                                                     strict=True):
        w = state[f"{path}.query_key_value.weight"]
        p = attn.query_key_value.parametrizations.weight[0]
        gains = torch.ones(case.heads[0], dtype=F64) if gain is None else torch.exp(p.gain_rate * p.q_log_gain)
        for h, s in enumerate(q_rows):
            torch.testing.assert_close(w[s].T, gains[h].detach() * q_frames[h].detach(), rtol=0, atol=SAME_TOL)
        for g, s in enumerate(k_rows):
            assert torch.equal(w[s].T, k_frames[g].detach())
    # the stock class loads it (strict) and computes the converted model's function
    stock = case.build()
    stock.load_state_dict(state, strict=True)
    torch.testing.assert_close(run(stock), expected, rtol=0, atol=SAME_TOL)
    # a converted model loads the stock checkpoint: same frames (bit for bit without a gain), same function
    again = case.build()
    stiefelize(again, logit_gain=gain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every head block is a (scaled) frame: nothing to warn about
        again.load_state_dict(state, strict=True)
    for (_, qa, ka), (_, qb, kb) in zip(converted_query_key_frames(model), converted_query_key_frames(again),
                                        strict=True):
        if gain is None:
            assert torch.equal(qa, qb) and torch.equal(ka, kb)
        else:
            torch.testing.assert_close(qb, qa, rtol=0, atol=SAME_TOL)
            torch.testing.assert_close(kb, ka, rtol=0, atol=SAME_TOL)
    torch.testing.assert_close(run(again), expected, rtol=0, atol=SAME_TOL)
    # converting the stock model that loaded it again keeps the saved gains under "learn"
    stiefelize(stock, logit_gain=gain)
    torch.testing.assert_close(run(stock), expected, rtol=0, atol=SAME_TOL)
    # the parametrized form resumes exactly; the export is the stock dict; unstiefelize keeps the function
    exact = case.build()
    stiefelize(exact, logit_gain=gain)
    exact.load_state_dict(parametrized_state_dict(model), strict=True)
    assert torch.equal(run(exact), run(model))
    exported = export_state_dict(model)
    assert list(exported) == stock_keys and all(torch.equal(exported[k], state[k]) for k in stock_keys)
    with pytest.warns(UserWarning, match="unstiefelize"):
        unstiefelize(model)
    assert list(model.state_dict()) == stock_keys and not frame_parameters(model)
    torch.testing.assert_close(run(model), expected, rtol=0, atol=SAME_TOL)


@pytest.mark.parametrize("name", ["gpt_neox", "falcon_new_decoder_architecture"])
def test_loading_a_stock_checkpoint_of_other_blocks_sets_their_polar_factors_and_warns(name):
    case = CASES[name]
    stock = case.build()
    state = stock.state_dict()
    model = case.build()
    set_heads(model, case)
    stiefelize(model)
    with pytest.warns(UserWarning, match=r"query_key_value\.weight: query head\(s\) \[0, 1, 2, 3\].*key head"):
        model.load_state_dict(state, strict=True)
    q_rows, k_rows = case.head_rows()
    for (path, _), (_, q_frames, k_frames) in zip(case.attns(model), converted_query_key_frames(model), strict=True):
        w = state[f"{path}.query_key_value.weight"]
        for frames, rows in ((q_frames, q_rows), (k_frames, k_rows)):
            for h, s in enumerate(rows):
                torch.testing.assert_close(frames[h].detach(), polar64(w[s].T), rtol=0, atol=POLAR_TOL)
    # companion: the model converted from that stock model computes the same function
    direct = case.build()
    stiefelize(direct)
    torch.testing.assert_close(run(model), run(direct), rtol=0, atol=SAME_TOL)


def test_save_pretrained_of_a_converted_gpt_neox_loads_into_the_stock_class(tmp_path):
    case = CASES["gpt_neox"]
    model = case.build()
    stiefelize(model, logit_gain="learn")
    with torch.no_grad():
        for _, attn in case.attns(model):
            attn.query_key_value.parametrizations.weight[0].q_log_gain.normal_(0, 0.05)
    expected = run(model).detach()
    model.save_pretrained(tmp_path)
    stock = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path, dtype=F64).eval()
    torch.testing.assert_close(run(stock), expected, rtol=0, atol=SAME_TOL)
    assert not frame_parameters(stock)


# ------------------------------------------------------------------------------------------ (e) training
@pytest.mark.parametrize("name", CASES)
def test_a_training_step_keeps_the_frames_orthonormal(name):
    case = CASES[name]
    model = case.build()
    model.train()
    stiefelize(model, logit_gain="learn")
    frames = frame_parameters(model)
    start = [f.detach().clone() for f in frames]
    values = [attn.query_key_value.parametrizations.weight.original for _, attn in case.attns(model)]
    values_start = [v.detach().clone() for v in values]
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2)
    ids = _ids()
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    eye = torch.eye(R, dtype=F64)
    for f, f0 in zip(frames, start, strict=True):
        assert float((f.detach().mT @ f.detach() - eye).abs().max()) < ORTHO_TOL_F64
        assert float((f.detach() - f0).abs().max()) > DIFFER_MIN  # companion: they moved
    assert all(float((v.detach() - v0).abs().max()) > DIFFER_MIN for v, v0 in zip(values, values_start, strict=True))
    # the weight the forward reads is still the frames at the reference rows
    q_rows, _ = case.head_rows()
    (_, attn), (_, q_frames, _) = case.attns(model)[0], converted_query_key_frames(model)[0]
    p = attn.query_key_value.parametrizations.weight[0]
    gains = torch.exp(p.gain_rate * p.q_log_gain.detach())
    w = attn.query_key_value.weight.detach()
    for h, s in enumerate(q_rows):
        torch.testing.assert_close(w[s].T, gains[h] * q_frames[h].detach(), rtol=0, atol=SAME_TOL)


def test_the_interleaved_weight_is_copied_independently():
    case = CASES["falcon_new_decoder_architecture"]
    model = case.build()
    stiefelize(model)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(run(twin), run(model), rtol=0, atol=0)
    with torch.no_grad():
        frame_parameters(twin)[0].copy_(torch.linalg.qr(torch.randn_like(frame_parameters(twin)[0]))[0])
    assert rel(run(twin), run(model)) > DIFFER_MIN


@pytest.mark.parametrize("name", ["gpt_neox", "falcon_new_decoder_architecture"])
def test_a_converted_interleaved_model_compiles_in_one_graph_like_its_stock_model(name):
    """The grouped rebuild (one ``torch.cat`` of per-group views) traces into the model's graph: no break."""
    def explain(model):
        torch._dynamo.reset()
        e = torch._dynamo.explain(model)(input_ids=_ids())
        return e.graph_count, e.graph_break_count, e.op_count, [r.reason.splitlines()[0] for r in e.break_reasons]

    model = CASES[name].build().train()
    stock = explain(model)
    stiefelize(model)
    converted = explain(model)
    assert stock[:2] == (1, 0), stock[3]  # the companion: the stock model compiles in one graph
    assert converted[:2] == (1, 0) and converted[2] > stock[2], converted[3]
    torch._dynamo.reset()
