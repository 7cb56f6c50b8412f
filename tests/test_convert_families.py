"""The table of model families (``geoopt_stiefel_attention.convert.families``): a new family is one entry.

A small attention module, ``ToyAttention``, whose query/key projections are called ``pq``/``pk`` and whose head size
is its attribute ``hd`` (names no built-in family uses), is converted by ``stiefelize(model)`` once a :class:`Family`
describing it is added to the table, and by nothing else: one StiefelAdam step trains it (the frames stay
orthonormal and move), and the exported checkpoint loads into the stock module and into a freshly converted one,
which then compute what the trained model computes. The entry's other fields act the same way: a q/k norm named in
it makes ``logit_gain`` warn, a refusal text refuses a module of its classes, and a hint is shown for one that
matches no layout. Each has its companion: without the entry the module is refused (``strict=True``) or left with a
warning (``strict=False``) as one that matches no layout, and no norm warning is given. The table's lookups are
checked against the names the converter read before the table existed (written out below), and a malformed entry
is refused naming the field.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import CHANGED_MIN, polar64
from torch import nn

from geoopt_stiefel_attention import (
    LAYOUTS,
    Block,
    Layout,
    StiefelAdam,
    export_state_dict,
    frame_parameters,
    param_groups,
    stiefelize,
)
from geoopt_stiefel_attention.convert import families
from geoopt_stiefel_attention.convert.families import Family

#: two float64 forward passes of the same weights, computed in a different order (the converted model rebuilds its
#: weights from frames; the stock module reads them): agreement to rounding
SAME_TOL = 1e-10
#: max |U^T U - I| of a float64 frame (a polar factor, or one after a polar retraction)
F64_ORTHO_TOL = 1e-12

D, HEADS, R = 12, 3, 4


class ToyAttention(nn.Module):
    """Multi-head self-attention with projections named ``pq``/``pk``/``pv``/``po`` and head size ``hd``."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.hd, self.h = R, HEADS  # attribute names the converter does not read
        self.pq, self.pk, self.pv = nn.Linear(D, HEADS * R), nn.Linear(D, HEADS * R), nn.Linear(D, HEADS * R)
        self.po = nn.Linear(HEADS * R, D)
        self.qn = nn.LayerNorm(R) if norm else None  # a norm of each head's queries, when asked for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.h, self.hd).transpose(1, 2) for p in (self.pq, self.pk, self.pv))
        if self.qn is not None:
            q = self.qn(q)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.hd), dim=-1)
        return self.po((att @ v).transpose(1, 2).reshape(b, t, self.h * self.hd))


class ToyModel(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.attn = ToyAttention(norm)
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attn(x))


TOY = Family("toy models (pq/pk, head size hd)", classes=("ToyAttention",),
             layouts=(Layout("toy pq/pk Linear", Block("pq.weight"), Block("pk.weight"), head_dim="hd"),),
             qk_norms=("qn",))


def _build(norm: bool = False) -> ToyModel:
    torch.manual_seed(0)
    return ToyModel(norm).double()


def _batch() -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _register(monkeypatch, *entries: Family) -> None:
    """Add ``entries`` to the table, as a new family is added: one more entry of FAMILIES."""
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, *entries))


def _head_blocks(w: torch.Tensor) -> torch.Tensor:
    """The ``(H, d, r)`` head blocks of an ``(H r, d)`` Linear weight, located by hand: head h is rows h r:(h+1) r."""
    return torch.stack([w[h * R:(h + 1) * R].T for h in range(HEADS)])


def _ortho_error(frames: torch.Tensor) -> float:
    eye = torch.eye(frames.shape[-1], dtype=frames.dtype)
    return float((frames.transpose(-1, -2) @ frames - eye).abs().max())


# ---------------------------------------------------------------------------------------------- a new family
def test_a_family_added_as_one_entry_converts_trains_and_round_trips(monkeypatch):
    _register(monkeypatch, TOY)
    model = _build()
    wq, wk = model.attn.pq.weight.detach().clone(), model.attn.pk.weight.detach().clone()
    result = stiefelize(model)  # targets="auto": the table, with the new entry
    assert [(c.path, c.layout, c.q_heads, c.k_heads, c.r) for c in result] == [("attn", "toy pq/pk Linear", 3, 3, 4)]
    # the frames are the polar factors of the head blocks (independent float64 SVD reference)
    for weight, before in ((model.attn.pq.weight, wq), (model.attn.pk.weight, wk)):
        expected = torch.stack([polar64(block) for block in _head_blocks(before)])
        torch.testing.assert_close(_head_blocks(weight.detach()), expected, rtol=0, atol=SAME_TOL)
    # one training step: the frames move and stay on the manifold
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    frames_before = [p.detach().clone() for p in frame_parameters(model)]
    x = _batch()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    moved = [float((p.detach() - b).norm()) for p, b in zip(frame_parameters(model), frames_before, strict=True)]
    assert len(moved) == 2 and min(moved) > CHANGED_MIN
    assert max(_ortho_error(p.detach()) for p in frame_parameters(model)) < F64_ORTHO_TOL
    # the exported checkpoint is the stock module's: it loads into ToyModel and computes what the trained model does
    with torch.no_grad():
        expected = model(x)
    state = export_state_dict(model)
    assert sorted(state) == sorted(_build().state_dict())
    stock = _build()
    stock.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(stock(x), expected, rtol=0, atol=SAME_TOL)
    assert _ortho_error(_head_blocks(state["attn.pq.weight"])) < F64_ORTHO_TOL
    # ... and into a freshly converted model, whose frames it sets
    again = _build()
    stiefelize(again)
    again.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(again(x), expected, rtol=0, atol=SAME_TOL)
    torch.testing.assert_close(again.attn.pq.weight.detach(), model.attn.pq.weight.detach(), rtol=0, atol=SAME_TOL)


def test_without_the_entry_the_module_is_refused_as_unknown():
    """Companion: the table as shipped knows no ToyAttention, so it is refused (strict) or left with a warning, and
    the model is unchanged."""
    assert TOY not in families.FAMILIES
    model = _build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'attn': ToyAttention looks like attention but matches no layout "
                                         r"\(its parameters: pq.weight"):
        stiefelize(model)
    with pytest.warns(UserWarning, match="no attention module of ToyModel was converted.*ToyAttention looks like "
                                         "attention but matches no layout"):
        result = stiefelize(model, strict=False)
    assert len(result) == 0 and result.skipped[0][0] == "attn"
    assert not frame_parameters(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_entry_qk_norms_make_a_gain_warn(monkeypatch):
    """A q/k norm the entry names makes logit_gain warn (the norm divides the gain out); the companion, a table whose
    entry does not name it, converts the same module without that warning."""
    _register(monkeypatch, TOY)
    with pytest.warns(UserWarning, match=r"logit_gain='learn' does not act as each query head's logit factor in "
                                         r"'attn': ToyAttention: it normalizes its queries/keys after the projection "
                                         r"\(qn \(LayerNorm\)\)"):
        stiefelize(_build(norm=True), logit_gain="learn")
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES[:-1])
    _register(monkeypatch, Family(TOY.name, classes=TOY.classes, layouts=TOY.layouts))  # the same, no qk_norms
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(stiefelize(_build(norm=True), logit_gain="learn")) == 1


def test_the_entry_refusal_and_hint_are_shown(monkeypatch):
    """A refusal text refuses a module of its classes that a built-in layout matches by name; a hint is shown for one
    that matches no layout. Companion: without those entries the first converts and the second gets the generic
    hint."""

    class FusedToyAttention(nn.Module):  # timm's "fused qkv Linear" layout matches it by its names
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.num_heads = nn.Linear(D, 3 * D), HEADS

    refused = nn.Sequential(FusedToyAttention())
    assert len(stiefelize(refused)) == 1  # companion: converted by the built-in table
    _register(monkeypatch,
              Family("fused toys", classes=("FusedToyAttention",), refusal="its {param} rows mix heads"),
              Family("toys", classes=("ToyAttention",), hint="ToyAttention is converted by ToyAttention.to_frames()"))
    with pytest.raises(ValueError, match=r"FusedToyAttention matches layout 'fused qkv Linear' but its qkv.weight rows "
                                         r"mix heads; leave it Euclidean \(strict=False"):
        stiefelize(nn.Sequential(FusedToyAttention()))
    with pytest.raises(ValueError,
                       match=r"matches no layout \(ToyAttention is converted by ToyAttention.to_frames\(\)\)"):
        stiefelize(_build())


# ---------------------------------------------------------------------------------------------- the table itself
#: The names the converter read before the table existed, written out as they were (each in its own constant of
#: convert/__init__.py); the table's lookups must give them, in this order, so that every message lists them alike.
BEFORE = {
    "qk_norms": ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "q_layer_norm",
                 "k_layer_norm", "qk_norm", "qk_layernorm", "norm_q"),
    "key_norms": frozenset({"k_norm", "k_layernorm", "key_layernorm", "k_layer_norm"}),
    "position_projections": ("pos_proj", "pos_q_proj", "pos_key_proj", "pos_query_proj"),
    "q_biases": ("q_bias",),
    "k_biases": ("k_bias",),
    "adapter_children": ("base_layer",),
}
#: The built-in layouts' names, in the order they were tried before the table existed.
LAYOUT_NAMES = (
    "timm AttentionCl qkv (head_first)", "q + kv Linear", "qk + v Linear", "torchvision MaxViT to_qkv Linear",
    "torch MultiheadAttention", "torch MultiheadAttention (kdim/vdim)", "q_proj/k_proj Linear", "query/key Linear",
    "q/k Linear", "q_lin/k_lin Linear", "query_proj/key_proj Linear", "fused qkv Linear + q_bias", "fused qkv Linear",
    "fused Wqkv Linear", "GPT-2 c_attn Conv1D", "GPT-2 cross-attention q_attn + c_attn Conv1D",
    "interleaved query_key_value", "GPTBigCode c_attn Linear", "DeBERTa in_proj Linear", "CodeGen qkv_proj")


def test_the_table_gives_the_names_the_converter_read_before():
    index = families.index()
    assert {name: getattr(index, name) for name in BEFORE} == BEFORE
    assert tuple(lay.name for lay in LAYOUTS) == LAYOUT_NAMES == tuple(lay.name for lay in families.builtin_layouts())
    assert set(index.qk_children) == {("to_q", "to_k"), ("wq", "wk"), ("w_q", "w_k"), ("q", "k"), ("query", "key"),
                                      ("q_proj", "k_proj"), ("q_lin", "k_lin"), ("query_proj", "key_proj")}


def test_the_lookups_follow_the_table(monkeypatch):
    """Companion: the lookups are read from the table, not kept beside it: another order of the entries lists the
    names in another order, and an added entry's names and layouts are found."""
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES[::-1])
    assert families.index().position_projections == BEFORE["position_projections"]  # one entry holds all four
    assert families.index().qk_norms != BEFORE["qk_norms"]
    assert tuple(lay.name for lay in families.builtin_layouts()) != LAYOUT_NAMES
    _register(monkeypatch, TOY)
    assert families.index().qk_norms[-1] == "qn" and families.builtin_layouts()[-1].name == "toy pq/pk Linear"


def test_a_family_matches_only_its_classes():
    """A layout of a family with classes matches modules of those classes (or derived from them) only."""
    layout = TOY.layouts[0]

    class OtherAttention(ToyAttention):
        pass

    class Unrelated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pq, self.pk, self.hd = nn.Linear(D, D), nn.Linear(D, D), R

    assert layout.matches(ToyAttention()) and layout.matches(OtherAttention())
    assert not layout.matches(Unrelated())
    assert Layout("toy", Block("pq.weight"), Block("pk.weight")).matches(Unrelated())  # companion: the bare layout


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(name=""), "name=''"),
    (dict(name="x", qk_norms="q_norm"), "qk_norms='q_norm' is invalid; pass a tuple of names"),
    (dict(name="x", layouts=[LAYOUTS[0]]), "layouts=.* is invalid; pass a tuple of Layout"),
    (dict(name="x", qk_children=(("q", "k", "v"),)), "qk_children=.* are \\(query name, key name\\) pairs"),
    (dict(name="x", qk_biases=("q_bias",)), "qk_biases=\\('q_bias',\\) are \\(query name, key name\\) pairs"),
    (dict(name="x", qk_norms=("q_norm",), key_norms=("k_norm",)), "key_norms \\['k_norm'\\] are not among qk_norms"),
    (dict(name="x", adapter_child=""), "adapter_child='' is invalid"),
    (dict(name="x", gain_caveat="text"), "gain_caveat='text' is invalid; pass a callable or None"),
    (dict(name="x", refusal="no"), "a refusal or hint given as text is shown for the modules of its classes"),
])
def test_a_malformed_entry_is_refused_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Family(**kwargs)
    Family("x", classes=("X",), refusal="no", hint="see X.convert()")  # companion: a well-formed entry
