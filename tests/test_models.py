"""Tests of the model builders: shapes, validation, paired starts, causality, one training step."""

from __future__ import annotations

import pytest
import torch
from conftest import F64, ORTHO_TOL_F64, assert_polar_factor

from geoopt_stiefel_attention import (
    PatchViT,
    StiefelAdam,
    StiefelMultiheadAttention,
    TinyTransformer,
    frame_parameters,
    param_groups,
    query_key_projections,
)

#: logits that must not depend on an input agree to this (float64)
CAUSAL_TOL = 1e-12
#: a difference that a real dependence must exceed
DIFFER_MIN = 1e-6

TINY = dict(vocab_size=13, seq_len=5, width=16, depth=2, heads=2, mlp=32)
VIT = dict(image_size=8, patch_size=4, in_channels=3, num_classes=5, width=16, depth=2, heads=2, mlp=32)
BUILDERS = {
    "tiny": lambda **kw: TinyTransformer(**TINY, **kw),
    "vit_cls": lambda **kw: PatchViT(**VIT, pool="cls", **kw),
    "vit_mean": lambda **kw: PatchViT(**VIT, pool="mean", **kw),
}


def batch(name: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if name == "tiny":
        return torch.randint(0, TINY["vocab_size"], (3, TINY["seq_len"]), generator=g)
    return torch.randn(3, 3, 8, 8, generator=g, dtype=F64)


@pytest.mark.parametrize("attention", ["euclidean", "stiefel"])
def test_output_shapes_default_sizes(attention):
    tiny = TinyTransformer(97, 3, attention=attention)
    assert tiny(torch.randint(0, 97, (4, 3))).shape == (4, 3, 97)
    assert tiny(torch.randint(0, 97, (4, 2))).shape == (4, 2, 97)  # shorter than seq_len
    vit = PatchViT(attention=attention, depth=1)
    assert vit(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    kinds = {type(m).__name__ for _, m in vit.named_modules()}
    expected = "StiefelMultiheadAttention" if attention == "stiefel" else "EuclideanMultiheadAttention"
    assert expected in kinds


@pytest.mark.parametrize("frames", ["head", "layer"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_paired_starts(name, frames):
    """Same seed: every non-Q/K parameter is identical, and the Stiefel Q/K are the polar factors of the
    Euclidean Q/K."""
    e = BUILDERS[name](attention="euclidean", seed=7, frames=frames, dtype=F64)
    s = BUILDERS[name](attention="stiefel", seed=7, frames=frames, dtype=F64)
    pe, ps = dict(e.named_parameters()), dict(s.named_parameters())
    assert list(pe) == list(ps)
    qk = [n for n in pe if n.endswith((".w_q", ".w_k"))]
    assert len(qk) == 2 * e.depth
    for n in pe:
        if n in qk:
            assert_polar_factor(ps[n].detach(), pe[n].detach())
        else:
            assert torch.equal(pe[n], ps[n]), n
    assert len(frame_parameters(s)) == len(qk) and frame_parameters(e) == []


@pytest.mark.parametrize("name", list(BUILDERS))
def test_different_seed_gives_other_weights(name):
    """Companion: a different seed changes every drawn non-Q/K weight."""
    a = dict(BUILDERS[name](attention="euclidean", seed=1).named_parameters())
    b = dict(BUILDERS[name](attention="euclidean", seed=2).named_parameters())
    drawn = [n for n in a if n.endswith(("weight", "w_v", "w_o", "embedding", "cls_token"))
             and "norm" not in n]
    assert drawn and all(not torch.equal(a[n], b[n]) for n in drawn)


def test_builders_ignore_global_rng():
    torch.manual_seed(0)
    a = TinyTransformer(**TINY, attention="stiefel", seed=3)
    torch.manual_seed(1)
    b = TinyTransformer(**TINY, attention="stiefel", seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_tiny_transformer_is_causal():
    model = TinyTransformer(**TINY, attention="stiefel", dtype=F64)
    tokens = batch("tiny")
    changed = tokens.clone()
    changed[:, 2] = (changed[:, 2] + 1) % TINY["vocab_size"]
    a, b = model(tokens), model(changed)
    assert (a[:, :2] - b[:, :2]).abs().max() < CAUSAL_TOL  # earlier positions cannot see position 2
    assert (a[:, 2:] - b[:, 2:]).abs().amax(dim=(0, 2)).min() > DIFFER_MIN  # later ones do (companion)


def test_patch_vit_sees_every_patch():
    """Bidirectional attention: changing the last patch changes the class-token logits."""
    model = PatchViT(**VIT, attention="stiefel", dtype=F64)
    x = batch("vit")
    y = x.clone()
    y[:, :, 4:, 4:] += 1.0
    assert (model(x) - model(y)).abs().max() > DIFFER_MIN


@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_training_step(name):
    model = BUILDERS[name](attention="stiefel", dtype=F64)
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-2)
    x = batch(name)
    logits = model(x)
    target = x if name == "tiny" else torch.arange(3) % VIT["num_classes"]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, n
    start = [w.detach().clone() for _, w, _ in query_key_projections(model)]
    opt.step()
    for w in frame_parameters(model):
        eye = torch.eye(w.shape[-1], dtype=F64)
        assert (w.detach().transpose(-1, -2) @ w.detach() - eye).abs().max() < ORTHO_TOL_F64
    moved = [float((w.detach() - w0).norm()) for (_, w, _), w0 in zip(query_key_projections(model), start,
                                                                         strict=True)]
    assert min(moved) > 0


def test_validation_errors():
    with pytest.raises(ValueError, match="width=18 is not divisible by heads=4"):
        TinyTransformer(10, 4, width=18, heads=4)
    with pytest.raises(ValueError, match="attention='riemann'"):
        TinyTransformer(10, 4, attention="riemann")
    with pytest.raises(ValueError, match="frames"):
        PatchViT(frames="row")
    with pytest.raises(ValueError, match="vocab_size"):
        TinyTransformer(0, 4)
    with pytest.raises(ValueError, match="depth"):
        TinyTransformer(10, 4, depth=0)
    with pytest.raises(ValueError, match="image_size=30 is not divisible by patch_size=4"):
        PatchViT(image_size=30)
    with pytest.raises(ValueError, match="pool"):
        PatchViT(pool="max")
    with pytest.raises(ValueError, match="seed"):
        PatchViT(seed=1.5)
    tiny = TinyTransformer(**TINY)
    with pytest.raises(ValueError, match="exceeds seq_len=5"):
        tiny(torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        tiny(torch.zeros(2, 3))
    vit = PatchViT(**VIT)
    with pytest.raises(ValueError, match=r"\(batch, 3, 8, 8\)"):
        vit(torch.randn(2, 3, 16, 16))


def test_attention_modules_and_layouts():
    model = PatchViT(**VIT, attention="stiefel", frames="layer", dtype=F64)
    attn = [m for m in model.modules() if isinstance(m, StiefelMultiheadAttention)]
    assert len(attn) == VIT["depth"] and all(m.w_q.shape == (1, 16, 16) for m in attn)
    assert [p for p, _, _ in query_key_projections(model)] == ["blocks.0.attn", "blocks.1.attn"]


@pytest.mark.parametrize("opt_cls", [StiefelAdam, torch.optim.AdamW])
def test_euclidean_arm_groups_with_empty_frames_group(opt_cls):
    """The Euclidean arm has an empty "frames" group; both optimizers accept it and train W_Q as a matrix."""
    model = TinyTransformer(**TINY, attention="euclidean")
    groups = param_groups(model)
    assert groups[0]["name"] == "frames" and groups[0]["params"] == []
    opt = opt_cls(groups, lr=1e-3)
    (path, w_q, _), = query_key_projections(model)[:1]
    start = w_q.detach().clone()
    model(batch("tiny")).square().mean().backward()
    opt.step()
    assert not torch.equal(start, w_q)
