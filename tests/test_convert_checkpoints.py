"""Checkpoints of converted HuggingFace models: ``save_pretrained`` writes the stock checkpoint.

For GPT-2 (fused ``c_attn`` Conv1D), Llama with grouped-query attention and BERT (``query``/``key``), each with
``logit_gain`` None, "learn" and "fit": the stock class loads ``converted.save_pretrained(d)`` with no missing or
unexpected keys and the converted model's logits; the query/key weights in the file equal an independent
float64 rebuild from the frames and gains (head blocks located by hand below, not through the converter's
table); a converted model is restored from the file and trains; ``state_dict``/``load_state_dict`` round-trip
(bit for bit without a gain, to float32 rounding with one) and leave the optimizer's state alone; no zero-size
parameter remains. Each property has a companion case where it must fail. Models are float32, as saved in
practice, built from tiny configs (no download).
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from conftest import CHANGED_MIN, F32_LOGIT_TOL, F32_ORTHO_TOL, F32_ROUNDTRIP_TOL
from torch.nn.utils import parametrize

from geoopt_stiefel_attention import (
    StiefelAdam,
    export_state_dict,
    frame_parameters,
    param_groups,
    parametrized_state_dict,
    stiefelize,
    unstiefelize,
)
from geoopt_stiefel_attention.convert import GAIN_RATE

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

D = 16
GAINS = [None, "learn", "fit"]


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_embd=D, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=40, hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _gpt2_blocks(i):
    """(stock key, dim, [(start, length, r, frames name, log-gain name or None)]) of layer i's q/k weights."""
    pre = f"transformer.h.{i}.attn.c_attn."
    raw = pre + "parametrizations.weight.0."
    return [(pre + "weight", 1, [(0, D, 8, raw + "q_frames", raw + "q_log_gain"), (D, D, 8, raw + "k_frames", None)])]


def _llama_blocks(i):
    pre = f"model.layers.{i}.self_attn."
    q, k = pre + "q_proj.", pre + "k_proj."
    return [(q + "weight", 0, [(0, D, 4, q + "parametrizations.weight.0.q_frames",
                                q + "parametrizations.weight.0.q_log_gain")]),
            (k + "weight", 0, [(0, 8, 4, k + "parametrizations.weight.0.k_frames", None)])]


def _bert_blocks(i):
    pre = f"bert.encoder.layer.{i}.attention.self."
    q, k = pre + "query.", pre + "key."
    return [(q + "weight", 0, [(0, D, 8, q + "parametrizations.weight.0.q_frames",
                                q + "parametrizations.weight.0.q_log_gain")]),
            (k + "weight", 0, [(0, D, 8, k + "parametrizations.weight.0.k_frames", None)])]


MODELS = {"gpt2": (_gpt2, _gpt2_blocks), "llama_gqa": (_llama, _llama_blocks), "bert": (_bert, _bert_blocks)}


def _ids():
    return torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _converted(name, gain, seed=0):
    """A converted float32 model moved away from its start: frames retracted along random tangents, log-gains
    spread (gains about 0.6 to 1.6), every other parameter perturbed."""
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    stiefelize(model, logit_gain=gain)
    g = torch.Generator().manual_seed(seed + 1)
    frames = {id(f) for f in frame_parameters(model)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if id(p) in frames:
                p.copy_(p.manifold.retr(p, 0.2 * p.manifold.proju(p, noise)))
            elif n.endswith("q_log_gain"):
                p.copy_(0.05 * noise)
            else:
                p.add_(0.01 * noise)
    return model.eval()


def _reference_weight(stock_weight, dim, pieces, params):
    """Independent float64 rebuild of a stock weight: head h of a piece is gamma_h * U_h (U_h its frame,
    gamma_h = exp(GAIN_RATE * theta_h)), transposed into rows for an (out, in) weight."""
    w = stock_weight.double().clone()
    for start, length, r, frames_name, gain_name in pieces:
        frames = params[frames_name].detach().double()
        gains = torch.exp(GAIN_RATE * params[gain_name].detach().double()) if gain_name in params else None
        for h in range(length // r):
            block = frames[h] * (gains[h] if gains is not None else 1.0)
            cols = slice(start + h * r, start + (h + 1) * r)
            if dim == 1:
                w[:, cols] = block
            else:
                w[cols, :] = block.t()
    return w


def _no_report(info):
    return {k: v for k, v in info.items() if v}


# ------------------------------------------------------------------------------------------ the stock checkpoint
@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_writes_the_stock_checkpoint(tmp_path, name, gain):
    model = _converted(name, gain)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    file = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert not [k for k in file if "parametrizations" in k]
    stock, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not _no_report(info), info
    assert float((_logits(stock) - expected).abs().max()) <= F32_LOGIT_TOL
    assert not frame_parameters(stock) and not parametrize.is_parametrized(stock)
    # the q/k weights in the file: the frames times the gains, located by hand, to float32 rounding
    params = dict(model.named_parameters())
    blocks = MODELS[name][1]
    for i in range(2):
        for key, dim, pieces in blocks(i):
            reference = _reference_weight(file[key], dim, pieces, params)
            assert float((file[key].double() - reference).abs().max()) <= F32_ROUNDTRIP_TOL, key
    # model.state_dict() is the stock model's, key for key and in its order; export_state_dict agrees
    torch.manual_seed(0)
    stock_keys = list(MODELS[name][0]().state_dict())
    state = model.state_dict()
    assert list(state) == stock_keys
    exported = export_state_dict(model)
    assert list(exported) == stock_keys and all(torch.equal(exported[k], state[k]) for k in state)


@pytest.mark.parametrize("name", MODELS)
def test_companion_the_parametrized_form_does_not_load_into_the_stock_class(tmp_path, name):
    model = _converted(name, "learn")
    expected = _logits(model)
    model.save_pretrained(tmp_path, state_dict=parametrized_state_dict(model))  # what save_pretrained wrote before
    stock, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    qk = [key for i in range(2) for key, _, _ in MODELS[name][1](i)]
    assert set(qk) <= set(info["missing_keys"])
    assert any("parametrizations" in k for k in info["unexpected_keys"])
    assert float((_logits(stock) - expected).abs().max()) > CHANGED_MIN


# ------------------------------------------------------------------------------------------ restoring
def _fresh_converted(name, gain):
    torch.manual_seed(123)  # another start: every weight is loaded from the checkpoint
    model = MODELS[name][0]()
    stiefelize(model, logit_gain=gain)
    return model


def _one_step(model):
    opt = StiefelAdam(param_groups(model, weight_decay=0.01), lr=1e-2)
    ids = _ids()
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    for f in frame_parameters(model):
        w = f.detach().double()
        eye = torch.eye(w.shape[-1], dtype=torch.float64)
        assert float((w.transpose(-1, -2) @ w - eye).abs().max()) <= F32_ORTHO_TOL
    assert math.isfinite(float(after)) and float(after) != float(loss.detach())


@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("name", MODELS)
def test_a_converted_model_is_restored_from_the_stock_checkpoint_and_trains(tmp_path, name, gain):
    model = _converted(name, gain)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    cls = type(model)
    # recipe 1: the stock class, then stiefelize; "fit" takes each head's gain back from its block's scale
    restored = cls.from_pretrained(tmp_path)
    stiefelize(restored, logit_gain=None if gain is None else "fit")
    assert float((_logits(restored) - expected).abs().max()) <= F32_LOGIT_TOL
    _one_step(restored)
    # recipe 2: a converted model (any start) loads the file; tied weights are not in it, as for the stock class
    fresh = _fresh_converted(name, gain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every block is a frame times a gain: nothing is re-projected
        file = safetensors_torch.load_file(tmp_path / "model.safetensors")
        result = fresh.load_state_dict(file, strict=False)
    assert not result.unexpected_keys
    tied = set(model.state_dict()) - set(file)  # HF writes one of each pair of tied weights
    assert set(result.missing_keys) == tied and all(k.endswith(("lm_head.weight", "decoder.weight", "decoder.bias"))
                                                   for k in tied)
    assert float((_logits(fresh) - expected).abs().max()) <= F32_LOGIT_TOL
    _one_step(fresh)


@pytest.mark.parametrize("name", MODELS)
def test_companion_restoring_without_the_gain_changes_the_function_and_warns_naming_the_modules(tmp_path, name):
    model = _converted(name, "learn")
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    restored = type(model).from_pretrained(tmp_path)
    paths = [c.path for c in stiefelize(MODELS[name][0]())]
    with pytest.warns(UserWarning, match=rf"logit_gain=None resets the query gains saved in the weights of "
                                         rf"'{paths[0]}', '{paths[1]}' \(each query head block is a frame times a "
                                         rf"gain, .*pass logit_gain='learn' to keep them\.$"):
        stiefelize(restored)  # no gain: every head's logit scale is reset to that of orthonormal frames
    assert float((_logits(restored) - expected).abs().max()) > CHANGED_MIN


def _reconverted(model, how, tmp_path, gain):
    """``model``'s saved state in a stock model, converted again with ``logit_gain=gain`` (warnings are errors)."""
    if how == "save_pretrained":
        model.save_pretrained(tmp_path)
        stock = type(model).from_pretrained(tmp_path)
    elif how == "state_dict":
        torch.manual_seed(7)
        stock = type(model)(model.config)
        stock.load_state_dict(model.state_dict(), strict=True)
    else:  # the converted model itself, unstiefelized
        with pytest.warns(UserWarning, match="unstiefelize"):
            stock = unstiefelize(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = stiefelize(stock, logit_gain=gain)
    return stock, report


@pytest.mark.parametrize("how", ["save_pretrained", "state_dict", "unstiefelize"])
@pytest.mark.parametrize("name", MODELS)
def test_learning_again_keeps_the_learned_gains_of_a_saved_model(tmp_path, name, how):
    """A model trained with a learned gain saves gamma_h U_h; converting that state again with
    logit_gain='learn' used to start every gain at 1 (a silent change of the logits): it starts at the saved
    gains, so the logits and the gains come back to float32 rounding."""
    model = _converted(name, "learn")
    expected = _logits(model)
    gains = {n: torch.exp(GAIN_RATE * p.detach()) for n, p in model.named_parameters() if n.endswith("q_log_gain")}
    assert max(float((g - 1).abs().max()) for g in gains.values()) > 0.1  # the gains moved
    restored, report = _reconverted(model, how, tmp_path, "learn")
    assert all(c.logit_gain.startswith("learn (kept from the weights: ") for c in report), str(report)
    assert float((_logits(restored) - expected).abs().max()) <= F32_LOGIT_TOL
    back = {n: torch.exp(GAIN_RATE * p.detach()) for n, p in restored.named_parameters() if n.endswith("q_log_gain")}
    assert back.keys() == gains.keys()
    assert all(float((back[n] - g).abs().max()) <= 1e-5 for n, g in gains.items())
    _one_step(restored)


@pytest.mark.parametrize("name", MODELS)
def test_companion_no_learned_gain_nothing_is_kept_and_nothing_warns(tmp_path, name):
    """Where no gain was learned (a model converted without one, or a freshly initialised stock model), 'learn'
    starts at 1 and None is silent: there is nothing to keep."""
    model = _converted(name, None)
    expected = _logits(model)
    for gain in (None, "learn"):
        restored, report = _reconverted(model, "state_dict", tmp_path, gain)
        assert all(c.logit_gain == ("none" if gain is None else "learn (1)") for c in report), str(report)
        assert float((_logits(restored) - expected).abs().max()) <= F32_LOGIT_TOL
    torch.manual_seed(0)
    fresh = MODELS[name][0]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = stiefelize(fresh, logit_gain="learn")
    assert all(c.logit_gain == "learn (1)" for c in report)


# ------------------------------------------------------------------------------------------ load_state_dict
@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("name", MODELS)
def test_state_dict_round_trips_and_leaves_the_optimizer_alone(name, gain):
    model = _converted(name, gain)
    expected = _logits(model)
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    expected = _logits(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    objects = {n: p for n, p in model.named_parameters()}
    moments = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in opt.state.items()}
    result = model.load_state_dict(model.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(p is objects[n] for n, p in model.named_parameters())  # copied into the same parameters
    for p, s in opt.state.items():
        assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items() if torch.is_tensor(v))
    for n, p in model.named_parameters():
        if gain is None:  # the frames are the blocks themselves: bit for bit
            assert torch.equal(p, before[n]), n
        else:  # gamma_h * U_h was rounded when it was formed: U_h and theta_h come back to float32 rounding
            assert float((p.detach() - before[n]).abs().max()) <= F32_ROUNDTRIP_TOL, n
    assert float((_logits(model) - expected).abs().max()) <= F32_LOGIT_TOL


@pytest.mark.parametrize("name", MODELS)
def test_companion_a_stock_checkpoint_of_non_orthonormal_blocks_warns_and_changes_the_function(name):
    torch.manual_seed(0)
    stock = MODELS[name][0]().eval()  # HF init, std 0.02: no head block is a frame
    expected = _logits(stock)
    model = _fresh_converted(name, None)
    with pytest.warns(UserWarning, match=r"polar factors.*stiefelize\(model, logit_gain='fit'\)"):
        model.load_state_dict(stock.state_dict(), strict=True)
    assert float((_logits(model) - expected).abs().max()) > CHANGED_MIN


def test_a_checkpoint_in_the_parametrized_form_loads_as_it_is():
    """Checkpoints written before the stock form (and parametrized_state_dict) load bit for bit, including
    the entries that became non-persistent buffers (an empty ``original``, the bias mask ``keep``)."""
    def converted(seed):
        torch.manual_seed(seed)
        model = _bert()
        stiefelize(model, logit_gain="learn", qk_bias="drop")
        return model

    model = converted(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("q_log_gain"):
                p.normal_(0, 0.05)
    expected = _logits(model)
    old = parametrized_state_dict(model)
    for key in [k for k in model.state_dict() if k.endswith(("query.weight", "key.weight"))]:
        old[key.replace(".weight", ".parametrizations.weight.original")] = torch.empty(0, D)
    for key in [k for k in model.state_dict() if k.endswith(("query.bias", "key.bias"))]:
        old[key.replace(".bias", ".parametrizations.bias.0.keep")] = torch.zeros(D)
    fresh = converted(123)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fresh.load_state_dict(old, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(fresh), expected)
    # companion: the same dict into the stock class misses every q/k weight
    torch.manual_seed(0)
    result = _bert().load_state_dict(old, strict=False)
    assert "bert.encoder.layer.0.attention.self.query.weight" in result.missing_keys and result.unexpected_keys


def test_keep_vars_gives_the_rebuilt_weight_in_the_graph():
    model = _converted("gpt2", "learn")
    key = "transformer.h.0.attn.c_attn.weight"
    live = model.state_dict(keep_vars=True)[key]
    assert live.requires_grad and live.grad_fn is not None
    plain = model.state_dict()[key]
    assert not plain.requires_grad and plain.is_contiguous() and torch.equal(plain, live.detach())


# ------------------------------------------------------------------------------------------ qk_bias="drop"
def test_a_dropped_bias_is_saved_under_its_stock_key():
    torch.manual_seed(0)
    model = _bert()
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.query.bias.normal_()
    stock_keys = list(model.state_dict())
    stiefelize(model, qk_bias="drop")
    expected = _logits(model)
    state = model.state_dict()
    assert list(state) == stock_keys
    assert torch.equal(state["bert.encoder.layer.0.attention.self.query.bias"], torch.zeros(D))
    torch.manual_seed(0)
    stock = _bert()
    stock.load_state_dict(state, strict=True)
    assert float((_logits(stock) - expected).abs().max()) <= F32_LOGIT_TOL
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not model.load_state_dict(state, strict=True).missing_keys
    # companion: a non-zero query bias loaded into the converted model cannot act, and says so
    state["bert.encoder.layer.0.attention.self.query.bias"] = torch.ones(D)
    with pytest.warns(UserWarning, match="query.bias has non-zero query/key entries"):
        model.load_state_dict(state, strict=True)
    assert torch.equal(model.bert.encoder.layer[0].attention.self.query.bias, torch.zeros(D))


# ------------------------------------------------------------------------------------------ zero-size parameters
@pytest.mark.parametrize("name", ["llama_gqa", "bert"])
def test_no_zero_size_parameter_after_conversion_and_unstiefelize_restores(name):
    torch.manual_seed(0)
    model = MODELS[name][0]()
    stock_keys = list(model.state_dict())
    stock_names = [n for n, _ in model.named_parameters()]
    stiefelize(model, logit_gain="learn")
    assert all(p.numel() > 0 for p in model.parameters())
    empty = [n for n, b in model.named_buffers() if b.numel() == 0]
    assert empty and all(n.endswith("parametrizations.weight.original") for n in empty)  # kept, not a parameter
    assert not set(empty) & set(model.state_dict())
    _one_step(model)  # forward, backward, StiefelAdam over param_groups
    expected = _logits(model)
    with pytest.warns(UserWarning, match="unstiefelize: .*Build the optimizer again"):
        unstiefelize(model)
    assert [n for n, _ in model.named_parameters()] == stock_names and list(model.state_dict()) == stock_keys
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad and p.numel() > 0 for p in model.parameters())
    assert float((_logits(model) - expected).abs().max()) <= F32_LOGIT_TOL


def test_companion_plain_parametrize_of_a_pure_projection_leaves_a_zero_size_parameter():
    class Rows(torch.nn.Module):  # rebuilds the whole weight from its own parameter, as _QKWeight does
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w.detach().clone())

        def forward(self, rest):
            return self.w

        def right_inverse(self, w):
            return w.new_empty(0, w.shape[1])

    lin = torch.nn.Linear(D, D)
    parametrize.register_parametrization(lin, "weight", Rows(lin.weight), unsafe=True)
    assert any(p.numel() == 0 for p in lin.parameters())


# ------------------------------------------------------------------------------- a coarser-dtype checkpoint
def _frames_by_name(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("_frames")}


def _load_quietly(model, state):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return model.load_state_dict(state, strict=True)


@pytest.mark.parametrize("form", ["stock", "parametrized"])
@pytest.mark.parametrize("gain", [None, "learn"])
@pytest.mark.parametrize("name", MODELS)
def test_a_float32_checkpoint_loads_into_a_float64_model_silently_as_frames_of_float64(name, gain, form):
    """A converted model moved to float64 (``.double()``) given a float32 state dict, in the stock or the
    parametrized form: its frames are orthonormal to float32's rounding only, which is no defect of the
    checkpoint, so they load without a warning, re-projected in float64 (as ``.double()`` does): the frames are
    float64 frames within float32's tolerance of the saved ones, the model computes the saved model's function and
    its training forward accepts them (the stock form used to warn "not orthonormal"; the parametrized form loaded
    them as they were, and the training forward refused them). Companion:
    test_companion_a_float32_checkpoint_off_the_manifold_still_warns_or_is_refused."""
    from geoopt_stiefel_attention._guard import FRAME_CHECK_TOLERANCE
    from geoopt_stiefel_attention._linalg import ORTHONORMALITY_TOLERANCE

    saved = _converted(name, gain)
    state = saved.state_dict() if form == "stock" else parametrized_state_dict(saved)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    model = _fresh_converted(name, gain).double()
    result = _load_quietly(model, state)
    assert not result.missing_keys and not result.unexpected_keys
    frames, before = _frames_by_name(model), _frames_by_name(saved)
    assert frames.keys() == before.keys() and frames
    for n, f in frames.items():
        w = f.detach()
        assert w.dtype == torch.float64
        eye = torch.eye(w.shape[-1], dtype=torch.float64)
        assert float((w.transpose(-1, -2) @ w - eye).abs().max()) <= FRAME_CHECK_TOLERANCE[torch.float64], n
        assert float((w - before[n].detach().double()).abs().max()) <= ORTHONORMALITY_TOLERANCE[torch.float32], n
    with torch.no_grad():
        expected = _logits(saved).double()
    assert float((_logits(model) - expected).abs().max()) <= F32_LOGIT_TOL
    model.train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()  # the training forward checks the frames in float64


@pytest.mark.parametrize("form", ["stock", "parametrized"])
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_companion_a_float32_checkpoint_off_the_manifold_still_warns_or_is_refused(name, form):
    """Query/key blocks off the manifold by far more than float32's rounding (1e-2, against float32's tolerance
    1e-4) are no rounding: loaded into a float64 model, the stock form still warns naming the heads and its
    polar factors are loaded (float64 frames), and the parametrized form is loaded as it is, so the training
    forward refuses it, as before."""
    from geoopt_stiefel_attention._guard import FRAME_CHECK_TOLERANCE, FrameOffManifoldError
    from geoopt_stiefel_attention._linalg import ORTHONORMALITY_TOLERANCE

    saved = _converted(name, None)
    g = torch.Generator().manual_seed(5)
    if form == "stock":
        state = saved.state_dict()
        for key, _dim, _pieces in MODELS[name][1](0):
            state[key] = state[key] + 1e-2 * torch.randn(state[key].shape, generator=g)
    else:
        state = parametrized_state_dict(saved)
        for key in [k for k in state if k.endswith("_frames")]:
            state[key] = state[key] + 1e-2 * torch.randn(state[key].shape, generator=g)
    model = _fresh_converted(name, None).double()
    if form == "stock":
        tol = re.escape(f"{ORTHONORMALITY_TOLERANCE[torch.float32]:g}")  # the checkpoint's dtype's
        with pytest.warns(UserWarning, match=rf"head\(s\) \[.*\] \(max\|A\^T A - I\| = .* > {tol}: not orthonormal"):
            model.load_state_dict(state, strict=True)
        for f in frame_parameters(model):  # their polar factors, in float64
            w = f.detach()
            eye = torch.eye(w.shape[-1], dtype=torch.float64)
            assert w.dtype == torch.float64
            assert float((w.transpose(-1, -2) @ w - eye).abs().max()) <= FRAME_CHECK_TOLERANCE[torch.float64]
        return
    _load_quietly(model, state)
    frames = _frames_by_name(model)
    for key in [k for k in state if k.endswith("_frames")]:
        assert torch.equal(frames[key].detach(), state[key].double())  # as it is
    ids = _ids()
    with pytest.raises(FrameOffManifoldError, match="off the Stiefel manifold"):
        model.train()(input_ids=ids, labels=ids)
