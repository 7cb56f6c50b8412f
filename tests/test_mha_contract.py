"""The ``nn.MultiheadAttention`` contract: every call pattern torch's module accepts either gives torch's result
or raises a clear error.

The reference is torch's own :class:`torch.nn.MultiheadAttention` in float64. The library's modules are built
from it: :meth:`EuclideanMultiheadAttention.from_torch` for any weights, and
:meth:`StiefelMultiheadAttention.from_euclidean` after the torch module's per-head query/key blocks were made
orthonormal (then the polar factors are those blocks and the function is unchanged). The grid covers both
layouts (``batch_first``) and unbatched inputs, self- and cross-attention (``kdim``/``vdim``), bool and float
key-padding and attention masks (2-D and 3-D), the causal hint, ``need_weights``/``average_attn_weights``,
and dropout switched off by ``eval()``. Torch's signatures themselves are compared with ours.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import F64
from torch import nn

from geoopt_stiefel_attention import EuclideanMultiheadAttention, StiefelMultiheadAttention
from geoopt_stiefel_attention._linalg import ORTHONORMALITY_TOLERANCE

#: max |difference| between the library's float64 forward and torch's (outputs and attention weights)
TORCH_TOL = 1e-12
#: a difference that a real change of the function must exceed (for the must-fail companions)
DIFFER_MIN = 1e-3

E, H, DH = 8, 2, 4     # embed_dim, num_heads, head_dim
N, L, S = 3, 4, 5      # batch, query length, key length (cross-attention)
KDIM, VDIM = 6, 3      # cross-attention feature sizes
DROPOUT = 0.25         # the grid's modules are in eval mode, where dropout must be off


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def orthonormal_rows(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """A ``(rows, cols)`` matrix with orthonormal rows (rows <= cols), from the QR of a Gaussian matrix."""
    q, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=F64))
    return q.t()


def torch_source(*, cross: bool, batch_first: bool, orthonormal: bool, dropout: float = DROPOUT,
                 seed: int = 0) -> nn.MultiheadAttention:
    """A float64 ``nn.MultiheadAttention`` with random weights and biases (no query bias, which the library's
    modules do not have; the key bias is kept: it is softmax-invariant and must be dropped exactly)."""
    torch.manual_seed(seed)
    kdim, vdim = (KDIM, VDIM) if cross else (None, None)
    mha = nn.MultiheadAttention(E, H, dropout, True, False, False, kdim, vdim, batch_first, None, F64)
    g = gen(seed + 100)
    with torch.no_grad():
        mha.in_proj_bias.copy_(torch.randn(3 * E, generator=g, dtype=F64))
        mha.in_proj_bias[:E].zero_()
        mha.out_proj.bias.copy_(torch.randn(E, generator=g, dtype=F64))
        if orthonormal:
            if mha._qkv_same_embed_dim:
                w_q, w_k = mha.in_proj_weight[:E], mha.in_proj_weight[E:2 * E]
            else:
                w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
            for w in (w_q, w_k):  # torch stores (out, in): head h's block is rows h*DH:(h+1)*DH
                for h in range(H):
                    w[h * DH:(h + 1) * DH].copy_(orthonormal_rows(DH, w.shape[1], g))
    return mha.eval()


def library_module(kind: str, source: nn.MultiheadAttention) -> nn.Module:
    if kind == "euclidean":
        return EuclideanMultiheadAttention.from_torch(source)
    return StiefelMultiheadAttention.from_euclidean(source)


# ------------------------------------------------------------------------------------- the call grid
def _bool_mask(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bool mask (True = masked) that never masks key 0, so no query loses all its keys."""
    mask = torch.rand(shape, generator=gen(seed)) < 0.4
    mask[..., 0] = False
    return mask


def _float_mask(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed), dtype=F64)


#: name -> (key_padding_mask kind, attn_mask kind, is_causal); kinds: None, "bool", "float", "bool3", "float3"
MASKS = {
    "none": (None, None, False),
    "kpm_bool": ("bool", None, False),
    "kpm_float": ("float", None, False),
    "attn_bool_2d": (None, "bool", False),
    "attn_float_2d": (None, "float", False),
    "attn_bool_3d": (None, "bool3", False),
    "attn_float_3d": (None, "float3", False),
    "kpm_bool_attn_bool_3d": ("bool", "bool3", False),
    "kpm_float_attn_float_2d": ("float", "float", False),
    "kpm_bool_attn_float_3d": ("bool", "float3", False),  # mixed kinds: torch warns (deprecated) but accepts
    "causal_hint": (None, "causal", True),
}

#: name -> keyword arguments of the call (``"default"`` passes none: weights are returned, averaged)
MODES = {
    "default": {},
    "no_weights": {"need_weights": False},
    "per_head_weights": {"need_weights": True, "average_attn_weights": False},
}

LAYOUTS = ("batch_first", "seq_first", "unbatched")


def assert_matches_torch_in_every_mode(module: nn.Module, source: nn.MultiheadAttention, qkv, kw: dict) -> None:
    """``module`` gives ``source``'s output, and its weights where torch returns them, in each of :data:`MODES`."""
    for mode in MODES.values():
        ref, ref_w = source(*qkv, **kw, **mode)
        out, w = module(*qkv, **kw, **mode)
        torch.testing.assert_close(out, ref, rtol=0, atol=TORCH_TOL)
        if ref_w is not None:
            torch.testing.assert_close(w, ref_w, rtol=0, atol=TORCH_TOL)


def make_inputs(layout: str, cross: bool, mask_name: str):
    """Query, key, value and masks in the layout torch expects, plus the keyword arguments of the call."""
    g = gen(1)
    s = S if cross else L
    q = torch.randn(N, L, E, generator=g, dtype=F64)
    k = torch.randn(N, s, KDIM, generator=g, dtype=F64) if cross else q
    v = torch.randn(N, s, VDIM, generator=g, dtype=F64) if cross else q
    kpm_kind, attn_kind, is_causal = MASKS[mask_name]
    batch = () if layout == "unbatched" else (N,)
    heads = H if layout == "unbatched" else N * H
    kpm = {None: None, "bool": lambda: _bool_mask(batch + (s,), 2),
           "float": lambda: _float_mask(batch + (s,), 3)}[kpm_kind]
    attn = {None: None, "bool": lambda: _bool_mask((L, s), 4), "float": lambda: _float_mask((L, s), 5),
            "bool3": lambda: _bool_mask((heads, L, s), 6), "float3": lambda: _float_mask((heads, L, s), 7),
            "causal": lambda: nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)}[attn_kind]
    if layout == "unbatched":
        q, k, v = q[0], k[0], v[0]
    elif layout == "seq_first":
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kw = {}
    if kpm is not None:
        kw["key_padding_mask"] = kpm()
    if attn is not None:
        kw["attn_mask"] = attn()
    if is_causal:
        kw["is_causal"] = True
    return (q, k, v), kw


def grid():
    for mask_name in MASKS:
        for cross in (False, True):
            if cross and MASKS[mask_name][2]:
                continue  # the causal hint needs a square mask: self-attention only
            for layout in LAYOUTS:
                yield pytest.param(layout, cross, mask_name, id=f"{layout}-{'cross' if cross else 'self'}-{mask_name}")


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask is deprecated")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("layout", "cross", "mask_name"), list(grid()))
@pytest.mark.parametrize("kind", ["euclidean", "stiefel"])
def test_matches_torch(kind, layout, cross, mask_name, mode):
    source = torch_source(cross=cross, batch_first=layout == "batch_first", orthonormal=kind == "stiefel")
    module = library_module(kind, source)
    assert not module.training and module.dropout == DROPOUT  # dropout configured, switched off by eval()
    (q, k, v), kw = make_inputs(layout, cross, mask_name)
    kw.update(MODES[mode])
    ref, ref_w = source(q, k, v, **kw)
    out, w = module(q, k, v, **kw)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=TORCH_TOL)
    if ref_w is None:
        assert w is None
    else:
        assert w is not None and w.shape == ref_w.shape
        torch.testing.assert_close(w, ref_w, rtol=0, atol=TORCH_TOL)


@pytest.mark.parametrize("kind", ["euclidean", "stiefel"])
def test_without_biases_matches_torch(kind):
    """``bias=False``: torch has no input or output biases, the library's modules no value/output biases."""
    torch.manual_seed(3)
    source = nn.MultiheadAttention(E, H, bias=False, kdim=KDIM, vdim=VDIM, dtype=F64).eval()
    with torch.no_grad():
        for h in range(H):
            rows = slice(h * DH, (h + 1) * DH)
            source.q_proj_weight[rows].copy_(orthonormal_rows(DH, E, gen(10 + h)))
            source.k_proj_weight[rows].copy_(orthonormal_rows(DH, KDIM, gen(20 + h)))
    module = library_module(kind, source)
    assert module.b_v is None and module.b_o is None
    (q, k, v), kw = make_inputs("seq_first", True, "kpm_float_attn_float_2d")
    assert_matches_torch_in_every_mode(module, source, (q, k, v), kw)


def test_comparison_can_fail():
    """The grid's comparison detects a wrong layout, a dropped mask and non-orthonormal Stiefel sources."""
    source = torch_source(cross=False, batch_first=False, orthonormal=False)
    (q, k, v), kw = make_inputs("seq_first", False, "attn_float_2d")
    ref, _ = source(q, k, v, **kw)
    wrong_layout = EuclideanMultiheadAttention.from_torch(source, ignore_batch_first=True)
    assert (wrong_layout(q, k, v)[0] - source(q, k, v)[0]).abs().max() > DIFFER_MIN
    module = EuclideanMultiheadAttention.from_torch(source)
    assert (module(q, k, v)[0] - ref).abs().max() > DIFFER_MIN
    # the polar factor of a non-orthonormal block is a different matrix: a different function
    assert (StiefelMultiheadAttention.from_euclidean(source)(q, k, v, **kw)[0] - ref).abs().max() > DIFFER_MIN


def test_training_mode_without_dropout_matches_torch():
    source = torch_source(cross=True, batch_first=True, orthonormal=True, dropout=0.0).train()
    (q, k, v), kw = make_inputs("batch_first", True, "kpm_bool")
    for module in (EuclideanMultiheadAttention.from_torch(source), StiefelMultiheadAttention.from_euclidean(source)):
        assert module.training
        assert_matches_torch_in_every_mode(module, source, (q, k, v), kw)


def test_training_mode_dropout_drops_weights_like_torch():
    """With ``need_weights=True`` both modules draw one dropout mask over the (batch x heads, L, S) weights;
    from the same RNG state they drop the same entries."""
    source = torch_source(cross=False, batch_first=True, orthonormal=False, dropout=0.5).train()
    module = EuclideanMultiheadAttention.from_torch(source)
    (q, k, v), _ = make_inputs("batch_first", False, "none")
    torch.manual_seed(5)
    ref, ref_w = source(q, k, v, average_attn_weights=False)
    torch.manual_seed(5)
    out, w = module(q, k, v, average_attn_weights=False)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=TORCH_TOL)
    torch.testing.assert_close(out, ref, rtol=0, atol=TORCH_TOL)
    assert (w == 0).any()  # dropout did act


@pytest.mark.parametrize("mask", ["key_padding_mask", "attn_mask"])
@pytest.mark.parametrize("layout", ["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", ["euclidean", "stiefel"])
def test_fully_masked_queries_as_torch(kind, layout, mask):
    """A query whose keys are all masked: with need_weights=True its output and weights are NaN; with
    need_weights=False its attention is zero, so its output is the output bias b_O (what SDPA gives such a row);
    both as torch's nn.MultiheadAttention outside its inference fast path. The other queries are unaffected.
    Companion: torch's fast path (eval, no grad, batch-first self-attention) gives NaN with need_weights=False,
    which is why the documentation does not promise NaN there."""
    source = torch_source(cross=False, batch_first=layout == "batch_first", orthonormal=kind == "stiefel")
    module = library_module(kind, source)
    (q, k, v), _ = make_inputs(layout, False, "none")
    if mask == "key_padding_mask":
        m = torch.zeros(N, L, dtype=torch.bool)
        m[1] = True  # every key of batch entry 1: all its queries
        dead = torch.zeros(N, L, dtype=torch.bool)
        dead[1] = True
    else:
        m = torch.zeros(L, L, dtype=torch.bool)
        m[2] = True  # query 2 sees no key, in every batch entry
        dead = torch.zeros(N, L, dtype=torch.bool)
        dead[:, 2] = True
    for need_weights in (True, False):
        ref, ref_w = source(q, k, v, need_weights=need_weights, **{mask: m})
        out, w = module(q, k, v, need_weights=need_weights, **{mask: m})
        torch.testing.assert_close(out, ref, rtol=0, atol=TORCH_TOL, equal_nan=True)
        out_bf = out if layout == "batch_first" else out.transpose(0, 1)
        assert out_bf[~dead].isfinite().all()
        if need_weights:
            torch.testing.assert_close(w, ref_w, rtol=0, atol=TORCH_TOL, equal_nan=True)
            assert out_bf[dead].isnan().all() and w[dead].isnan().all() and w[~dead].isfinite().all()
        else:
            torch.testing.assert_close(out_bf[dead], module.b_o.detach().expand(int(dead.sum()), E), rtol=0,
                                       atol=TORCH_TOL)
    if layout == "batch_first":
        with torch.no_grad():
            fast, _ = source(q, q, q, need_weights=False, **{mask: m})
        assert fast[dead].isnan().all()


# ------------------------------------------------------------------------------------- inside nn.TransformerEncoder
def _padded_encoder_run(kind: str | None, monkeypatch):
    """A float64 ``nn.TransformerEncoder`` built with ``enable_nested_tensor=True`` (torch's default) whose layers'
    ``self_attn`` are then replaced by the library's module of ``kind`` (``None``: torch's own kept), in eval mode;
    returns the encoder, the padded batch (lengths 6, 4, 2, padding at the end), its mask, and a list that counts
    the encoder's nested-tensor packings (``torch._nested_tensor_from_mask``)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=F64)
    encoder = nn.TransformerEncoder(layer, 2)
    assert encoder.use_nested_tensor  # the encoder would pack a padded batch into a nested tensor
    if kind is not None:
        for lay in encoder.layers:
            lay.self_attn = library_module(kind, lay.self_attn)
    packs = []
    pack = torch._nested_tensor_from_mask
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", lambda *a, **k: packs.append(1) or pack(*a, **k))
    x = torch.randn(3, 6, E, generator=gen(7), dtype=F64)
    lengths = (6, 4, 2)
    pad = torch.arange(6).expand(3, 6) >= torch.tensor(lengths).view(3, 1)
    return encoder.eval(), x, lengths, pad, packs


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("kind", ["euclidean", "stiefel"])
def test_swapped_into_a_built_encoder_a_padded_batch_runs_with_the_padding_respected(kind, grad, monkeypatch):
    """The library's module assigned as ``self_attn`` of an ``nn.TransformerEncoder`` built with
    ``enable_nested_tensor=True``, in eval mode with a ``src_key_padding_mask`` (the encoder's nested-tensor
    fast path read ``self_attn.out_proj.weight``, which the module lacked: AttributeError): the encoder declines
    that path (no nested tensor is made) and each sequence's output over its own positions is that sequence run
    alone, unpadded. Companions: without the mask the padded sequences' outputs are not (the reference tells a
    padded run from an unpadded one), and with torch's own module kept the same encoder does take the nested path
    (so the library's module is what declines it) and gives the same reference."""
    encoder, x, lengths, pad, packs = _padded_encoder_run(kind, monkeypatch)
    with torch.set_grad_enabled(grad):
        out = encoder(x, src_key_padding_mask=pad)
        unmasked = encoder(x)
        alone = [encoder(x[b:b + 1, :n])[0] for b, n in enumerate(lengths)]
    assert packs == [] and not out.is_nested and out.shape == x.shape
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :n], alone[b], rtol=0, atol=TORCH_TOL)
    for b, n in enumerate(lengths[1:], start=1):  # companion: padded keys attended to
        assert float((unmasked[b, :n] - alone[b]).detach().abs().max()) > DIFFER_MIN
    stock, x, lengths, pad, packs = _padded_encoder_run(None, monkeypatch)  # companion: torch's module
    with torch.no_grad():
        fast = stock(x, src_key_padding_mask=pad)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(fast[b, :n], stock(x[b:b + 1, :n])[0], rtol=0, atol=TORCH_TOL)
    assert len(packs) == 1


@pytest.mark.parametrize("kind", ["euclidean", "stiefel"])
def test_out_proj_is_no_tensor_and_says_where_the_output_projection_is(kind):
    """``module.out_proj`` exists for the encoder's fast-path checks only: used as a tensor (a torch function, an
    attribute) it raises, naming ``w_o``; companion: torch's ``has_torch_function`` flags it (which is what makes
    the encoder decline its nested path), and does not flag the module's real output projection."""
    module = library_module(kind, torch_source(cross=False, batch_first=True, orthonormal=kind == "stiefel"))
    with pytest.raises(TypeError, match="no out_proj Linear: the output projection is w_o"):
        torch.add(module.out_proj.weight, 1)
    with pytest.raises(AttributeError, match=r"out_proj\.bias\.shape: .*w_o"):
        _ = module.out_proj.bias.shape
    assert torch.overrides.has_torch_function((module.out_proj.weight,))
    assert not torch.overrides.has_torch_function((module.w_o, module.b_o))
    assert "out_proj" not in dict(module.named_modules()) and not any("out_proj" in k for k in module.state_dict())


# ------------------------------------------------------------------------------------- signatures
def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("cls", [StiefelMultiheadAttention, EuclideanMultiheadAttention])
def test_constructor_and_forward_signatures_extend_torch(cls):
    """Torch's constructor arguments, in torch's order with torch's defaults, come first (the library's own
    options follow as keyword-only); ``forward`` has torch's parameters and defaults."""
    torch_init = _parameters(nn.MultiheadAttention.__init__)
    assert _parameters(cls.__init__)[:len(torch_init)] == torch_init
    extra = list(inspect.signature(cls.__init__).parameters.values())[len(torch_init) + 1:]
    assert extra and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert _parameters(cls.forward) == _parameters(nn.MultiheadAttention.forward)


def test_positional_constructor_as_in_torch():
    args = (E, H, 0.1, False, False, False, KDIM, VDIM, True, "cpu", F64)
    ref = nn.MultiheadAttention(*args)
    m = EuclideanMultiheadAttention(*args)
    assert (m.embed_dim, m.num_heads, m.dropout, m.kdim, m.vdim, m.batch_first) == (
        ref.embed_dim, ref.num_heads, ref.dropout, ref.kdim, ref.vdim, ref.batch_first)
    assert m.b_o is None and m.w_o.dtype == F64 and m.w_k.shape == (H, KDIM, DH)
    default = StiefelMultiheadAttention(E, H)
    assert default.batch_first is False and nn.MultiheadAttention(E, H).batch_first is False


def test_need_weights_defaults_true():
    m = StiefelMultiheadAttention(E, H, batch_first=True, dtype=F64, generator=gen(0))
    x = torch.randn(N, L, E, generator=gen(1), dtype=F64)
    out, w = m(x, x, x)
    assert w is not None and w.shape == (N, L, L)
    torch.testing.assert_close(w.sum(-1), torch.ones(N, L, dtype=F64), rtol=0, atol=TORCH_TOL)
    assert m(x, x, x, need_weights=False)[1] is None


# ------------------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
@pytest.mark.parametrize("cls", [StiefelMultiheadAttention, EuclideanMultiheadAttention])
def test_unsupported_options_are_refused_by_name(cls, option):
    nn.MultiheadAttention(E, H, **{option: True})  # torch accepts it
    with pytest.raises(ValueError, match=rf"{option}=True is not supported.*{option}=False"):
        cls(E, H, **{option: True})
    with pytest.raises(ValueError, match=option):
        (EuclideanMultiheadAttention.from_torch if cls is EuclideanMultiheadAttention
         else cls.from_euclidean)(nn.MultiheadAttention(E, H, **{option: True}))


def test_is_causal_without_mask_applies_the_causal_mask():
    """Torch refuses ``is_causal=True`` without ``attn_mask``; the library applies the causal mask, which
    equals torch given the explicit causal mask."""
    source = torch_source(cross=False, batch_first=False, orthonormal=False)
    module = EuclideanMultiheadAttention.from_torch(source)
    (q, k, v), kw = make_inputs("seq_first", False, "causal_hint")
    with pytest.raises(RuntimeError, match="attn_mask"):
        source(q, k, v, is_causal=True)
    ref, ref_w = source(q, k, v, **kw)
    for need_weights in (True, False):
        out, _ = module(q, k, v, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(out, ref, rtol=0, atol=TORCH_TOL)
    assert (module(q, k, v)[0] - ref).abs().max() > DIFFER_MIN  # the mask mattered


@pytest.mark.parametrize(("layout", "call", "message"), [
    ("batch_first", lambda m, x: m(x, x[..., :-1], x), "feature sizes"),
    ("batch_first", lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(N + 1, L, dtype=torch.bool)),
     "key_padding_mask"),
    ("unbatched", lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(1, L, dtype=torch.bool)),
     "key_padding_mask must be 1-D"),
    ("unbatched", lambda m, x: m(x, x, x, attn_mask=torch.zeros(N * H, L, L)), "attn_mask"),
    ("batch_first", lambda m, x: m(x, x, x, attn_mask=torch.zeros(L, L, dtype=torch.long)), "bool"),
    ("seq_first", lambda m, x: m(x, x[:, :1], x), "batch/sequence sizes disagree"),
    ("batch_first", lambda m, x: m(x[None], x[None], x[None]), "batched"),
    ("batch_first", lambda m, x: m(x, x[0], x), "batched"),
    ("unbatched", lambda m, x: m(x, x[None], x), "unbatched query"),
    ("batch_first", lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(L, dtype=torch.bool)), "key_padding_mask"),
    ("batch_first", lambda m, x: m(x, x, x, attn_mask=torch.zeros(L, dtype=torch.bool)), "attn_mask"),
    ("batch_first", lambda m, x: m(*(torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.jagged),) * 3),
     "nested"),
])
def test_bad_calls_raise_clear_errors(layout, call, message):
    m = EuclideanMultiheadAttention(E, H, batch_first=layout == "batch_first", dtype=F64)
    x = torch.randn(N, L, E, dtype=F64)
    if layout == "unbatched":
        x = x[0]
    with pytest.raises((ValueError, TypeError), match=message):
        call(m, x)


def test_flag_types_are_checked():
    with pytest.raises(TypeError, match="batch_first"):
        StiefelMultiheadAttention(E, H, batch_first="yes")


def test_modules_pickled_before_batch_first_stay_batch_first():
    m = StiefelMultiheadAttention(E, H, batch_first=True)
    state = m.__dict__.copy()
    del state["batch_first"]  # as in a module saved by version 0.1.0
    restored = StiefelMultiheadAttention.__new__(StiefelMultiheadAttention)
    restored.__setstate__(state)
    assert restored.batch_first is True
    x = torch.randn(N, L, E)
    torch.testing.assert_close(restored(x, x, x)[0], m(x, x, x)[0], rtol=0, atol=0)  # read as (batch, seq, embed)


def test_load_state_dict_keeps_the_frames_frames():
    """A Euclidean module's state dict has the Stiefel module's keys and shapes: loaded as it is, the frames would
    be plain matrices and the module the Euclidean one without a word. Their polar factors are loaded, with a
    warning; assign=True (loading onto a meta module) keeps them ManifoldParameters that a frame optimizer sees.
    Companion: the module's own state dict loads silently and exactly."""
    import warnings

    from geoopt_stiefel_attention import frame_parameters

    stiefel = StiefelMultiheadAttention(16, 4, generator=torch.Generator().manual_seed(0))
    euclid = EuclideanMultiheadAttention(16, 4, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"w_[qk] is not orthonormal .*polar factor is loaded.*from_euclidean"):
        stiefel.load_state_dict(euclid.state_dict())
    for w in (stiefel.w_q, stiefel.w_k):
        assert w.manifold.check_point_on_manifold(w)
    assert torch.equal(stiefel.w_v, euclid.w_v)
    other = StiefelMultiheadAttention(16, 4, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        other.load_state_dict(stiefel.state_dict())
    assert torch.equal(other.w_q, stiefel.w_q) and torch.equal(other.w_k, stiefel.w_k)
    with torch.device("meta"):
        empty = StiefelMultiheadAttention(16, 4)
    empty.w_k.requires_grad_(False)
    empty.load_state_dict(stiefel.state_dict(), assign=True)
    assert [n for n, _ in empty.named_parameters() if n in ("w_q", "w_k")] == ["w_q", "w_k"]
    assert len(frame_parameters(empty)) == 2 and not empty.w_k.requires_grad
    assert torch.equal(empty.w_q, stiefel.w_q) and empty.w_q.device.type == "cpu"


@pytest.mark.parametrize(("source_dtype", "dtype"), [(torch.float32, F64), (torch.float16, torch.float32),
                                                     (torch.bfloat16, torch.float32)])
def test_load_state_dict_from_a_coarser_dtype_loads_frames_of_the_module_precision(source_dtype, dtype):
    """A frame saved in a coarser dtype (a float32 checkpoint loaded into a float64 module) is off the manifold by
    its rounding only: as after ``.double()``, its polar factor is loaded, in the module's dtype and without a
    warning, and the module trains (the polar factor was rounded back to the checkpoint's dtype, so the next
    training forward refused the frames, after a warning that named a Euclidean module's weights). Companion: a
    Euclidean module's state dict in that coarser dtype still warns, and its polar factors are loaded in the
    module's precision too."""
    import warnings

    from geoopt_stiefel_attention._guard import FRAME_CHECK_TOLERANCE

    def assert_frames(module):
        for w in (module.w_q, module.w_k):
            eye = torch.eye(w.shape[-1], dtype=dtype)
            assert (w.detach().transpose(-1, -2) @ w.detach() - eye).abs().max() <= FRAME_CHECK_TOLERANCE[dtype]
        x = torch.randn(N, L, 16, generator=gen(3), dtype=dtype)
        module.train()(x, x, x)[0].sum().backward()  # the training forward checks the frames

    saved = StiefelMultiheadAttention(16, 4, batch_first=True, generator=gen(0)).to(source_dtype)
    module = StiefelMultiheadAttention(16, 4, batch_first=True, generator=gen(1), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        module.load_state_dict(saved.state_dict())
    assert_frames(module)
    for w, src in ((module.w_q, saved.w_q), (module.w_k, saved.w_k)):  # the saved frames, re-projected
        assert (w.detach() - src.detach().to(dtype)).abs().max() <= ORTHONORMALITY_TOLERANCE[source_dtype]
    with torch.device("meta"):
        empty = StiefelMultiheadAttention(16, 4, batch_first=True, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        empty.load_state_dict(saved.state_dict(), assign=True)  # assign=True keeps the state dict's dtype
    assert torch.equal(empty.w_q, saved.w_q) and torch.equal(empty.w_k, saved.w_k)  # frames of it: as they are
    euclid = EuclideanMultiheadAttention(16, 4, batch_first=True, generator=gen(2)).to(source_dtype)
    with pytest.warns(UserWarning) as record:
        module.load_state_dict(euclid.state_dict())
    assert sorted(str(r.message).split()[1] for r in record) == ["w_k", "w_q"]
    assert all("is not orthonormal" in str(r.message) and "from_euclidean" in str(r.message) for r in record)
    assert_frames(module)


@pytest.mark.parametrize("cls", [StiefelMultiheadAttention, EuclideanMultiheadAttention])
def test_reset_parameters_redraws_in_place_keeping_the_objects_an_optimizer_holds(cls):
    """As torch's nn.MultiheadAttention._reset_parameters: new values in the same parameter objects (an optimizer
    built before keeps training them) with their requires_grad; the values are a fresh module's from the same
    generator (companion: they differ from the values before)."""
    module = cls(16, 4, generator=torch.Generator().manual_seed(0))
    held = dict(module.named_parameters())
    before = {n: p.detach().clone() for n, p in held.items()}
    module.w_k.requires_grad_(False)
    module.reset_parameters(torch.Generator().manual_seed(5))
    fresh = cls(16, 4, generator=torch.Generator().manual_seed(5))
    for name, p in module.named_parameters():
        assert p is held[name]
        assert torch.equal(p, dict(fresh.named_parameters())[name])
        assert torch.equal(p, torch.zeros_like(p)) or not torch.equal(p, before[name])  # biases start at zero
    assert not module.w_k.requires_grad and module.w_q.requires_grad
