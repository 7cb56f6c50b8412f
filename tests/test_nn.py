"""Tests of the attention modules, conversion helpers and parameter groups (float64 for numerics).

Every numerical check compares with an independent reference: attention written out head by head with
einsum and an explicit softmax, or torch's own ``nn.MultiheadAttention``; polar factors are checked by
their characterisation (orthonormal ``U`` with ``U^T A`` symmetric positive definite), not by an SVD.
"""

from __future__ import annotations

import math
import warnings

import geoopt
import pytest
import torch
from conftest import F64, ORTHO_TOL_F64, assert_polar_factor
from torch import nn

from geoopt_stiefel_attention import (
    EuclideanMultiheadAttention,
    StiefelAdam,
    StiefelMultiheadAttention,
    frame_parameters,
    is_frame,
    param_groups,
    query_key_projections,
    stiefelize,
)

#: agreement of two float64 computations of the same attention (different association orders)
REF_TOL = 1e-12
#: a difference that a real change of the function must exceed
DIFFER_MIN = 1e-4
#: relative agreement of a bfloat16-autocast forward with the float32 one
BF16_TOL = 3e-2

E, H, DH = 8, 2, 4  # embed_dim, heads, head_dim
CLASSES = (StiefelMultiheadAttention, EuclideanMultiheadAttention)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------- reference attention
def head_blocks(w: torch.Tensor, frames: str, num_heads: int) -> list[torch.Tensor]:
    """The per-head (d, Dh) blocks of a query/key parameter, per the documented layout."""
    if frames == "head":
        return [w[h] for h in range(num_heads)]
    dh = w.shape[-1] // num_heads
    return [w[0][:, h * dh:(h + 1) * dh] for h in range(num_heads)]


def reference_attention(m, xq, xk, xv, *, kpm=None, attn_mask=None, causal=False, head_order=None):
    """Multi-head attention written out from ``m``'s parameters: returns (output, per-head weights)."""
    nh, dh = m.num_heads, m.head_dim
    b, tq, tk = xq.shape[0], xq.shape[1], xk.shape[1]
    add = torch.zeros(b, nh, tq, tk, dtype=F64)
    if kpm is not None:
        kp = torch.where(kpm, -math.inf, 0.0) if kpm.dtype == torch.bool else kpm
        add = add + kp[:, None, None, :]
    if attn_mask is not None:
        am = torch.where(attn_mask, -math.inf, 0.0) if attn_mask.dtype == torch.bool else attn_mask
        add = add + (am.reshape(b, nh, tq, tk) if am.dim() == 3 else am[None, None])
    elif causal:
        i = torch.arange(tq)[:, None]
        j = torch.arange(tk)[None, :]
        add = add.masked_fill(j > i, -math.inf)
    wq = head_blocks(m.w_q.detach(), m.frames, nh)
    wk = head_blocks(m.w_k.detach(), m.frames, nh)
    out = torch.zeros(b, tq, m.embed_dim, dtype=F64)
    probs = []
    order = head_order or list(range(nh))
    for h in range(nh):
        gain = math.exp(float(m.logit_gain.detach()[h])) if m.logit_gain is not None else 1.0
        q = torch.einsum("bte,ed->btd", xq, wq[h]) * gain
        k = torch.einsum("bte,ed->btd", xk, wk[h])
        v = torch.einsum("bte,ed->btd", xv, m.w_v.detach()[h])
        if m.b_v is not None:
            v = v + m.b_v.detach()[h * dh:(h + 1) * dh]
        logits = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(dh) + add[:, h]
        z = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        p = z / z.sum(dim=-1, keepdim=True)
        probs.append(p)
        o = torch.einsum("bij,bjd->bid", p, v)
        rows = slice(order[h] * dh, (order[h] + 1) * dh)
        out = out + torch.einsum("btd,de->bte", o, m.w_o.detach()[rows])
    if m.b_o is not None:
        out = out + m.b_o.detach()
    return out, torch.stack(probs, dim=1)


def randomize_extras(m) -> None:
    """Give biases and log-gains non-trivial values so that the reference checks them too."""
    g = gen(123)
    with torch.no_grad():
        for p in (m.b_v, m.b_o, m.logit_gain):
            if p is not None:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def make(cls, frames="head", **kw):
    kw.setdefault("logit_gain", True)
    kw.setdefault("batch_first", True)
    m = cls(E, H, frames=frames, dtype=F64, generator=gen(0), **kw)
    randomize_extras(m)
    return m


def inputs(b=2, tq=5, tk=None, kdim=E, vdim=E, seed=1):
    g = gen(seed)
    tk = tq if tk is None else tk
    xq = torch.randn(b, tq, E, generator=g, dtype=F64)
    if tk == tq and kdim == E and vdim == E:
        return xq, xq, xq
    return xq, torch.randn(b, tk, kdim, generator=g, dtype=F64), torch.randn(b, tk, vdim, generator=g, dtype=F64)


def kpm_bool(b=2, tk=5):
    mask = torch.zeros(b, tk, dtype=torch.bool)
    mask[0, -2:] = True
    mask[1, 2] = True
    return mask


SCENARIOS = {
    "plain": {},
    "kpm_bool": {"kpm": kpm_bool()},
    "kpm_float": {"kpm": torch.randn(2, 5, generator=gen(7), dtype=F64)},
    "attn_bool_2d": {"attn_mask": (torch.rand(5, 5, generator=gen(8)) < 0.4) & ~torch.eye(5, dtype=torch.bool)},
    "attn_float_3d": {"attn_mask": torch.randn(2 * H, 5, 5, generator=gen(9), dtype=F64)},
    "causal": {"causal": True},
    "causal_kpm": {"causal": True, "kpm": kpm_bool()},
    "attn_bool_and_kpm_float": {"attn_mask": torch.ones(5, 5, dtype=torch.bool).triu(1),
                                "kpm": torch.randn(2, 5, generator=gen(10), dtype=F64)},
}


def call(m, xq, xk, xv, sc, **kw):
    return m(xq, xk, xv, key_padding_mask=sc.get("kpm"), attn_mask=sc.get("attn_mask"),
             is_causal=sc.get("causal", False), **kw)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("frames", ["head", "layer"])
@pytest.mark.parametrize("cls", CLASSES, ids=["stiefel", "euclidean"])
def test_forward_matches_written_out_reference(cls, frames, scenario):
    m = make(cls, frames)
    sc = SCENARIOS[scenario]
    xq, xk, xv = inputs()
    ref, ref_w = reference_attention(m, xq, xk, xv, kpm=sc.get("kpm"), attn_mask=sc.get("attn_mask"),
                                     causal=sc.get("causal", False))
    out, w = call(m, xq, xk, xv, sc, need_weights=False)  # SDPA path
    assert w is None
    torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)
    out2, w_avg = call(m, xq, xk, xv, sc, need_weights=True)  # explicit path
    torch.testing.assert_close(out2, ref, rtol=0, atol=REF_TOL)
    assert w_avg.shape == (2, 5, 5)
    torch.testing.assert_close(w_avg, ref_w.mean(dim=1), rtol=0, atol=REF_TOL)
    _, w_all = call(m, xq, xk, xv, sc, need_weights=True, average_attn_weights=False)
    assert w_all.shape == (2, H, 5, 5)
    torch.testing.assert_close(w_all, ref_w, rtol=0, atol=REF_TOL)


@pytest.mark.parametrize("cls", CLASSES, ids=["stiefel", "euclidean"])
def test_cross_attention_matches_reference(cls):
    m = make(cls, kdim=6, vdim=5)
    assert m.w_k.shape == (H, 6, DH) and m.w_v.shape == (H, 5, DH)
    xq, xk, xv = inputs(tq=3, tk=7, kdim=6, vdim=5)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 4:] = True
    ref, ref_w = reference_attention(m, xq, xk, xv, kpm=kpm, causal=True)
    out, _ = m(xq, xk, xv, key_padding_mask=kpm, is_causal=True, need_weights=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)
    out, w = m(xq, xk, xv, key_padding_mask=kpm, is_causal=True, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)
    assert w.shape == (2, H, 3, 7)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=REF_TOL)


def test_reference_check_can_fail():
    """Companion: a wrong head-to-output mapping, or an ignored mask, is far outside REF_TOL."""
    m = make(StiefelMultiheadAttention)
    xq, xk, xv = inputs()
    out, _ = m(xq, xk, xv)
    wrong, _ = reference_attention(m, xq, xk, xv, head_order=[1, 0])
    assert (out - wrong).abs().max() > DIFFER_MIN
    masked, _ = m(xq, xk, xv, key_padding_mask=kpm_bool())
    assert (out - masked).abs().max() > DIFFER_MIN


def test_unbatched_input_matches_batched():
    m = make(StiefelMultiheadAttention)
    xq, xk, xv = inputs(b=1)
    out_b, w_b = m(xq, xk, xv, need_weights=True, is_causal=True)
    out_u, w_u = m(xq[0], xk[0], xv[0], need_weights=True, is_causal=True)
    assert out_u.shape == (5, E) and w_u.shape == (5, 5)
    torch.testing.assert_close(out_u, out_b[0], rtol=0, atol=REF_TOL)
    torch.testing.assert_close(w_u, w_b[0], rtol=0, atol=REF_TOL)


def test_attention_dropout_only_in_training():
    m = StiefelMultiheadAttention(E, H, dropout=0.5, batch_first=True, dtype=F64, generator=gen(0))
    xq, xk, xv = inputs()
    m.eval()
    a, _ = m(xq, xk, xv)
    b, _ = m(xq, xk, xv)
    assert torch.equal(a, b)
    m.train()
    c, _ = m(xq, xk, xv)
    assert (a - c).abs().max() > DIFFER_MIN


# ------------------------------------------------------------------------------------- against nn.MultiheadAttention
def torch_mha(seed=0, **kw) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    kw.setdefault("batch_first", True)
    mha = nn.MultiheadAttention(E, H, dtype=F64, **kw)
    with torch.no_grad():
        if mha.in_proj_bias is not None:
            mha.in_proj_bias.normal_()
            mha.in_proj_bias[:E].zero_()  # no query bias (conversion would refuse it)
            mha.out_proj.bias.normal_()
    return mha


def orthonormalize_qk(mha: nn.MultiheadAttention, layout: str = "head") -> None:
    """Make the torch module's per-head (or whole-layer) Q/K blocks orthonormal, in torch's row layout."""
    with torch.no_grad():
        for w in (mha.in_proj_weight[:E], mha.in_proj_weight[E:2 * E]):
            if layout == "layer":
                q, _ = torch.linalg.qr(torch.randn(E, E, dtype=F64))
                w.copy_(q.t())
            else:
                for h in range(H):
                    q, _ = torch.linalg.qr(torch.randn(E, DH, dtype=F64))
                    w[h * DH:(h + 1) * DH].copy_(q.t())


MHA_CASES = {
    "plain": {},
    "kpm_bool": {"key_padding_mask": kpm_bool()},
    "causal_mask": {"attn_mask": nn.Transformer.generate_square_subsequent_mask(5, dtype=F64), "is_causal": True},
    "float_3d_and_kpm": {"attn_mask": torch.randn(2 * H, 5, 5, generator=gen(3), dtype=F64),
                         "key_padding_mask": torch.where(kpm_bool(), -math.inf, 0.0).to(F64)},
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_euclidean_from_torch_reproduces_nn_multihead_attention(case):
    """Torch's own implementation is the reference for the layout mapping, masks and weight shapes
    (the non-zero key bias is dropped, exactly: it is softmax-invariant)."""
    mha = torch_mha()
    m = EuclideanMultiheadAttention.from_torch(mha)
    x, _, _ = inputs()
    kw = MHA_CASES[case]
    for avg in (True, False):
        ref, ref_w = mha(x, x, x, need_weights=True, average_attn_weights=avg, **kw)
        out, w = m(x, x, x, need_weights=True, average_attn_weights=avg, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)
        assert w.shape == ref_w.shape
        torch.testing.assert_close(w, ref_w, rtol=0, atol=REF_TOL)
    out, _ = m(x, x, x, need_weights=False, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)


@pytest.mark.parametrize("layout", ["head", "layer"])
def test_from_euclidean_is_exact_for_orthonormal_blocks(layout):
    mha = torch_mha()
    orthonormalize_qk(mha, layout)
    s = StiefelMultiheadAttention.from_euclidean(mha, frames=layout)
    x, _, _ = inputs()
    for kw in MHA_CASES.values():
        ref, _ = mha(x, x, x, **kw)
        out, _ = s(x, x, x, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)


def test_from_euclidean_changes_non_orthonormal_blocks():
    """Companion: a generic original's Q/K blocks are not frames, so the converted function differs."""
    mha = torch_mha()
    s = StiefelMultiheadAttention.from_euclidean(mha)
    x, _, _ = inputs()
    assert (s(x, x, x)[0] - mha(x, x, x)[0]).abs().max() > DIFFER_MIN


def test_polar_characterisation_can_fail():
    """Companion: the raw matrix and a sign-flipped frame both violate the characterisation."""
    a = torch.randn(E, DH, generator=gen(5), dtype=F64)
    u = StiefelMultiheadAttention(E, H, dtype=F64).w_q.manifold.projx(a)
    assert_polar_factor(u, a)
    with pytest.raises(AssertionError):
        assert_polar_factor(a, a)
    flipped = u.clone()
    flipped[:, 0] *= -1
    with pytest.raises(AssertionError):
        assert_polar_factor(flipped, a)


def test_from_euclidean_torch_layout_and_exact_copies():
    mha = torch_mha()
    s = StiefelMultiheadAttention.from_euclidean(mha)
    w = mha.in_proj_weight.detach()
    b = mha.in_proj_bias.detach()
    assert isinstance(s.w_q, geoopt.ManifoldParameter) and isinstance(s.w_k, geoopt.ManifoldParameter)
    for h in range(H):
        rows = slice(h * DH, (h + 1) * DH)
        assert_polar_factor(s.w_q[h].detach(), w[:E][rows].t())
        assert_polar_factor(s.w_k[h].detach(), w[E:2 * E][rows].t())
        assert torch.equal(s.w_v[h], w[2 * E:][rows].t())
    assert torch.equal(s.b_v, b[2 * E:])
    assert torch.equal(s.w_o, mha.out_proj.weight.t())
    assert torch.equal(s.b_o, mha.out_proj.bias)
    assert s.logit_gain is None and s.dropout == mha.dropout


def test_from_euclidean_separate_kdim_vdim_projections():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, kdim=6, vdim=5, batch_first=True, dtype=F64)
    assert not mha._qkv_same_embed_dim
    with torch.no_grad():
        mha.in_proj_bias[E:].normal_()
        mha.out_proj.bias.normal_()
        for w in (mha.q_proj_weight, mha.k_proj_weight):
            for h in range(H):
                q, _ = torch.linalg.qr(torch.randn(w.shape[1], DH, dtype=F64))
                w[h * DH:(h + 1) * DH].copy_(q.t())
    s = StiefelMultiheadAttention.from_euclidean(mha)
    assert s.w_k.shape == (H, 6, DH) and s.w_v.shape == (H, 5, DH)
    xq, xk, xv = inputs(tq=3, tk=4, kdim=6, vdim=5)
    torch.testing.assert_close(s(xq, xk, xv)[0], mha(xq, xk, xv)[0], rtol=0, atol=REF_TOL)


def test_from_euclidean_of_euclidean_module():
    e = make(EuclideanMultiheadAttention)
    s = StiefelMultiheadAttention.from_euclidean(e)
    for name in ("w_v", "w_o", "b_v", "b_o", "logit_gain"):
        assert torch.equal(getattr(s, name), getattr(e, name)), name
    assert_polar_factor(s.w_q.detach(), e.w_q.detach())
    assert_polar_factor(s.w_k.detach(), e.w_k.detach())
    back = EuclideanMultiheadAttention.from_stiefel(s)
    assert type(back.w_q) is nn.Parameter and torch.equal(back.w_q, s.w_q)
    layer = StiefelMultiheadAttention.from_euclidean(e, frames="layer", logit_gain=False)
    assert layer.w_q.shape == (1, E, H * DH) and layer.logit_gain is None
    assert_polar_factor(layer.w_q.detach()[0], torch.cat(list(e.w_q.detach()), dim=1))


def test_from_euclidean_refusals():
    with pytest.raises(ValueError, match="add_bias_kv"):
        StiefelMultiheadAttention.from_euclidean(nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        StiefelMultiheadAttention.from_euclidean(nn.MultiheadAttention(E, H, add_zero_attn=True, batch_first=True))
    seq_first = nn.MultiheadAttention(E, H)
    assert StiefelMultiheadAttention.from_euclidean(seq_first).batch_first is False  # the source's layout
    assert StiefelMultiheadAttention.from_euclidean(seq_first, ignore_batch_first=True).batch_first is True
    with pytest.raises(TypeError, match="Linear"):
        StiefelMultiheadAttention.from_euclidean(nn.Linear(E, E))
    mha = torch_mha()
    orthonormalize_qk(mha)
    with torch.no_grad():
        mha.in_proj_bias[:E].normal_()
    with pytest.raises(ValueError, match="drop_qk_bias=True"):
        StiefelMultiheadAttention.from_euclidean(mha)
    s = StiefelMultiheadAttention.from_euclidean(mha, drop_qk_bias=True)
    x, _, _ = inputs()
    assert (s(x, x, x)[0] - mha(x, x, x)[0]).abs().max() > DIFFER_MIN  # the query bias mattered


# ------------------------------------------------------------------------------------- configuration
def test_configuration_errors():
    with pytest.raises(ValueError, match="not divisible"):
        StiefelMultiheadAttention(10, 3)
    assert StiefelMultiheadAttention(10, 3, head_dim=3).w_q.shape == (3, 10, 3)
    with pytest.raises(ValueError, match="head_dim"):
        StiefelMultiheadAttention(8, 2, head_dim=9)
    with pytest.raises(ValueError, match="kdim"):
        EuclideanMultiheadAttention(8, 2, kdim=3)
    with pytest.raises(ValueError, match="frames='head'"):
        StiefelMultiheadAttention(8, 4, head_dim=4, frames="layer")
    with pytest.raises(ValueError, match="frames"):
        StiefelMultiheadAttention(8, 2, frames="row")
    with pytest.raises(ValueError, match="dropout"):
        StiefelMultiheadAttention(8, 2, dropout=1.0)
    m = StiefelMultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="feature sizes"):
        m(x, torch.randn(2, 5, 7), x)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(3, 5, 5))
    with pytest.raises(TypeError, match="bool"):
        m(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.long))


def test_float32_frames_on_manifold_and_layouts():
    s = StiefelMultiheadAttention(16, 4, frames="layer", bias=False)
    assert s.w_q.shape == (1, 16, 16) and s.b_v is None and s.b_o is None
    err = (s.w_q[0].t() @ s.w_q[0] - torch.eye(16)).abs().max()
    assert err < 1e-5


# ------------------------------------------------------------------------------------- paired starts
@pytest.mark.parametrize("frames", ["head", "layer"])
def test_paired_initialisation(frames):
    kdim = 6 if frames == "head" else 10
    s = StiefelMultiheadAttention(E, H, kdim=kdim, frames=frames, logit_gain=True, dtype=F64, generator=gen(3))
    e = EuclideanMultiheadAttention(E, H, kdim=kdim, frames=frames, logit_gain=True, dtype=F64, generator=gen(3))
    assert [n for n, _ in s.named_parameters()] == [n for n, _ in e.named_parameters()]
    for name in ("w_v", "w_o", "b_v", "b_o", "logit_gain"):
        assert torch.equal(getattr(s, name), getattr(e, name)), name
    assert_polar_factor(s.w_q.detach(), e.w_q.detach())
    assert_polar_factor(s.w_k.detach(), e.w_k.detach())
    other = EuclideanMultiheadAttention(E, H, kdim=kdim, frames=frames, dtype=F64, generator=gen(4))
    assert not torch.equal(other.w_v, e.w_v)  # companion: another seed, other weights


# ------------------------------------------------------------------------------------- gradients and compile
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("frames", ["head", "layer"])
@pytest.mark.parametrize("cls", CLASSES, ids=["stiefel", "euclidean"])
def test_gradients_reach_every_parameter(cls, frames, need_weights):
    kdim = 6 if frames == "head" else 10
    m = make(cls, frames, kdim=kdim, vdim=5)
    xq, xk, xv = inputs(tq=4, tk=6, kdim=kdim, vdim=5)
    out, _ = m(xq, xk, xv, need_weights=need_weights, is_causal=True)
    out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


#: What counts as a zero gradient in float64 (rounding of a softmax backward that is exactly zero in exact
#: arithmetic).
ZERO_GRAD_TOL = 1e-13


def test_single_key_gives_query_key_no_gradient():
    """Companion: with one key the softmax is constant, so W_Q, W_K and the gains get exactly zero gradient
    (the check above can fail)."""
    m = make(StiefelMultiheadAttention)
    xq, xk, xv = inputs(tq=3, tk=1)
    m(xq, xk, xv)[0].square().sum().backward()
    # zero in exact arithmetic; SDPA's CPU kernels (which one runs depends on the thread count) may leave
    # rounding of order 1e-15 in float64, far below the O(1e-1) gradients of the multi-key case above
    for name in ("w_q", "w_k", "logit_gain"):
        assert getattr(m, name).grad.abs().max() <= ZERO_GRAD_TOL, name
    assert m.w_v.grad.abs().max() > 1e3 * ZERO_GRAD_TOL


def test_torch_compile_matches_eager():
    m = make(StiefelMultiheadAttention)
    xq, xk, xv = inputs()
    kpm = kpm_bool()
    eager, _ = m(xq, xk, xv, key_padding_mask=kpm, need_weights=False)
    eager.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    out, _ = compiled(xq, xk, xv, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out, eager, rtol=0, atol=REF_TOL)
    out.square().sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=REF_TOL)


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    """The default backend (inductor) compiles the module too; slow (about 25 s on 2 CPU cores)."""
    m = make(StiefelMultiheadAttention, "layer")
    xq, xk, xv = inputs()
    eager, _ = m(xq, xk, xv, is_causal=True, need_weights=False)
    out, _ = torch.compile(m)(xq, xk, xv, is_causal=True, need_weights=False)
    torch.testing.assert_close(out, eager, rtol=0, atol=REF_TOL)


@pytest.mark.parametrize("need_weights", [False, True])
def test_autocast_bfloat16_keeps_one_dtype(need_weights):
    """Under autocast the float32 biases and gains must not promote q/k/v back to float32 (SDPA needs them
    alike); the result is the float32 one up to bfloat16 rounding."""
    m = StiefelMultiheadAttention(16, 2, batch_first=True, logit_gain=True, generator=gen(0))
    randomize_extras(m)
    x = torch.randn(2, 5, 16, generator=gen(1))
    ref, _ = m(x, x, x, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = m(x, x, x, is_causal=True, need_weights=need_weights)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=BF16_TOL * ref.abs().max().item())
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


# ------------------------------------------------------------------------------------- stiefelize
def encoder(batch_first=True, layers=2) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, dtype=F64)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=batch_first)


def test_stiefelize_transformer_encoder_runs_and_trains():
    enc = encoder()
    for layer in enc.layers:
        orthonormalize_qk(layer.self_attn)
    x, _, _ = inputs()
    kpm = kpm_bool()
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    kpm_float = torch.where(kpm, -math.inf, 0.0).to(F64)  # same mask type as `causal` (torch warns otherwise)
    ref = enc(x, mask=causal, src_key_padding_mask=kpm_float, is_causal=True)
    report = stiefelize(enc)
    assert [c.path for c in report] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(type(layer.self_attn).__bases__[0] is nn.MultiheadAttention for layer in enc.layers)  # kept
    out = enc(x, mask=causal, src_key_padding_mask=kpm_float, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=REF_TOL)  # orthonormal blocks: same function
    # one StiefelAdam step with the parameter groups
    groups = param_groups(enc, weight_decay=0.1)
    assert [g["name"] for g in groups] == ["frames", "decay", "no_decay"]
    assert len(groups[0]["params"]) == 4
    before = [p.detach().clone() for p in enc.parameters() if p.requires_grad]
    opt = StiefelAdam(groups, lr=1e-2)
    loss = enc(x, src_key_padding_mask=kpm).square().mean()
    loss.backward()
    opt.step()
    for p in frame_parameters(enc):
        eye = torch.eye(p.shape[-1], dtype=F64)
        assert (p.detach().transpose(-1, -2) @ p.detach() - eye).abs().max() < ORTHO_TOL_F64
    after = [p.detach() for p in enc.parameters() if p.requires_grad]
    assert all(not torch.equal(b, p) for b, p in zip(before, after, strict=True))


def test_stiefelize_converts_what_the_module_path_refused():
    # batch_first=False, add_bias_kv and add_zero_attn: the parametrization leaves the torch module in charge
    model = nn.Sequential(nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True))
    assert len(stiefelize(model)) == 1 and len(frame_parameters(model)) == 2
    with pytest.raises(ValueError, match="add_bias_kv"):  # the module-replacing path still refuses it
        StiefelMultiheadAttention.from_euclidean(nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True))


def test_from_torch_parameters_are_contiguous():
    # the former .t().clone() kept transposed strides, which safetensors (and HF Trainer checkpoints) refuse
    s = StiefelMultiheadAttention.from_euclidean(torch_mha())
    e = EuclideanMultiheadAttention.from_torch(torch_mha())
    assert all(p.is_contiguous() for m in (s, e) for p in m.parameters())


def test_param_groups_warns_without_frames():
    plain = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E))
    with pytest.warns(UserWarning, match="has no Stiefel frame.*stiefelize"):
        groups = param_groups(plain)
    assert groups[0]["params"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        param_groups(plain, expect_frames=False)  # a Euclidean baseline: silent
        param_groups(TwoAttention())  # has frames: silent
        param_groups(nn.Sequential(EuclideanMultiheadAttention(E, H)))  # the library's Euclidean arm: silent
        frozen = nn.Sequential(StiefelMultiheadAttention(E, H))
        frozen[0].w_q.requires_grad_(False)
        frozen[0].w_k.requires_grad_(False)
        assert param_groups(frozen)[0]["params"] == []  # frozen frames: deliberate, silent



def test_param_groups_warns_about_a_parameter_on_a_manifold_other_than_stiefel():
    """A geoopt.Sphere parameter went into the Euclidean groups without a word: StiefelAdam then refused it, but
    torch.optim.AdamW trained it off its manifold silently. It is now named, with its manifold, its group and the
    choices, and grouped as before (the warning changes nothing)."""
    sphere = geoopt.Sphere()
    model = nn.Sequential(StiefelMultiheadAttention(E, H))
    model.directions = geoopt.ManifoldParameter(sphere.random(4, E, dtype=F64), manifold=sphere)  # ndim 2: "decay"
    model.unit = geoopt.ManifoldParameter(sphere.random(E, dtype=F64), manifold=sphere)  # ndim 1: "no_decay"
    with pytest.warns(UserWarning) as record:
        groups = param_groups(model)
    (message,) = [str(w.message) for w in record]
    assert message == ("param_groups: 'directions' (on Sphere manifold, in 'decay'), 'unit' (on Sphere manifold, in "
                       "'no_decay'): geoopt.ManifoldParameter(s) on a manifold other than Stiefel, grouped as "
                       "Euclidean parameters, which torch.optim.AdamW would train off their manifold without a word "
                       "(StiefelAdam refuses them); train them with geoopt.optim.RiemannianAdam, or recreate them on "
                       "geoopt_stiefel_attention.PolarStiefel() if they are Stiefel frames (a unit vector is a (d, 1) "
                       "frame).")
    assert any(p is model.directions for p in groups[1]["params"]) and any(p is model.unit for p in groups[2]["params"])
    with pytest.raises(ValueError, match="is on Sphere manifold.*geoopt.optim.RiemannianAdam"):
        StiefelAdam(groups, lr=1e-2)  # what the warning says of StiefelAdam
    # companion: frames on every Stiefel manifold (geoopt's canonical Stiefel() among them: a frame, which StiefelAdam
    # refuses by its own message), geoopt's Euclidean ManifoldParameter and a frozen sphere parameter pass silently
    canonical = geoopt.Stiefel()
    quiet = nn.Sequential(StiefelMultiheadAttention(E, H))
    quiet.canonical = geoopt.ManifoldParameter(canonical.random(E, 2, dtype=F64), manifold=canonical)
    quiet.euclidean = geoopt.ManifoldParameter(torch.randn(E, E, dtype=F64))
    quiet.frozen = geoopt.ManifoldParameter(sphere.random(E, dtype=F64), manifold=sphere, requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = param_groups(quiet)
    assert any(p is quiet.canonical for p in groups[0]["params"])
    assert any(p is quiet.euclidean for p in groups[1]["params"])


def test_param_groups_refuses_a_model_with_nothing_to_train():
    """Every group empty: torch.optim.AdamW accepted the groups and trained nothing, and the frozen frames kept the
    frames warning quiet, so nothing said so."""
    frozen = nn.Sequential(StiefelMultiheadAttention(E, H), nn.LayerNorm(E)).requires_grad_(False)
    with pytest.raises(ValueError, match=r"param_groups: Sequential has no trainable parameter \(its 8 parameter"
                                         r"\(s\) all have requires_grad=False\).*requires_grad_\(True\)"):
        param_groups(frozen)
    with pytest.raises(ValueError, match="it holds no parameter"):
        param_groups(nn.Module(), expect_frames=False)
    # companion: one trainable parameter is enough, and the groups train it
    frozen[1].weight.requires_grad_(True)
    groups = param_groups(frozen)
    assert [len(g["params"]) for g in groups] == [0, 0, 1]
    torch.optim.AdamW(groups, lr=1e-2)


def test_param_groups_refuses_flags_that_are_not_bools_and_a_decay_that_is_not_callable():
    """no_decay_frames="no" was read as True (a truthy string), decay=True failed inside the loop."""
    model = nn.Sequential(StiefelMultiheadAttention(E, H))
    for flag in ("no_decay_frames", "expect_frames", "drop_empty"):
        with pytest.raises(TypeError, match=rf"param_groups: {flag}='no' is invalid; pass True or False"):
            param_groups(model, **{flag: "no"})
    with pytest.raises(TypeError, match="param_groups: decay=True is not callable"):
        param_groups(model, decay=True)
    # companion: the bools and a callable rule are accepted
    groups = param_groups(model, 0.1, no_decay_frames=False, expect_frames=True, drop_empty=True,
                          decay=lambda name, p: name.endswith("w_o"))
    assert [(g["name"], len(g["params"]), g["weight_decay"]) for g in groups] == [
        ("frames", 2, 0.1), ("decay", 1, 0.1), ("no_decay", 3, 0.0)]


# ------------------------------------------------------------------------------------- parameter helpers
class TwoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = StiefelMultiheadAttention(E, H, batch_first=True, logit_gain=True, generator=gen(0))
        self.norm = nn.LayerNorm(E)
        self.second = EuclideanMultiheadAttention(E, H, batch_first=True, generator=gen(1))
        self.torch_attn = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x):
        x = self.norm(x + self.first(x, x, x)[0])
        x = x + self.second(x, x, x)[0]
        return x + self.torch_attn(x, x, x, need_weights=False)[0]


def test_param_groups_partition_and_rules():
    model = TwoAttention()
    model.norm.bias.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in groups}
    assert got["frames"] == ["first.w_k", "first.w_q"]
    assert got["decay"] == sorted(["first.w_v", "first.w_o", "second.w_q", "second.w_k", "second.w_v",
                                   "second.w_o", "torch_attn.in_proj_weight", "torch_attn.out_proj.weight"])
    assert got["no_decay"] == sorted(["first.b_v", "first.b_o", "first.logit_gain", "norm.weight", "second.b_v",
                                      "second.b_o", "torch_attn.in_proj_bias", "torch_attn.out_proj.bias"])
    assert [g["weight_decay"] for g in groups] == [0.0, 0.05, 0.0]
    assert param_groups(model, 0.05, no_decay_frames=False)[0]["weight_decay"] == 0.05
    assert [id(p) for p in frame_parameters(model)] == [id(model.first.w_q), id(model.first.w_k)]
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups(model, weight_decay=-1.0)


def test_param_groups_work_with_adamw_and_stiefel_adam():
    x = torch.randn(2, 5, E)
    for opt_cls, stays_on in ((StiefelAdam, True), (torch.optim.AdamW, False)):
        model = TwoAttention()
        opt = opt_cls(param_groups(model), lr=1e-2)
        model(x).square().sum().backward()
        opt.step()
        w = model.first.w_q.detach()
        err = float((w.transpose(-1, -2) @ w - torch.eye(DH)).abs().max())
        # StiefelAdam keeps the frames on St(d, r); AdamW trains them as plain matrices and leaves it
        assert (err < 1e-5) == stays_on, (opt_cls.__name__, err)


def test_query_key_projections():
    model = TwoAttention()
    got = query_key_projections(model)
    assert [path for path, _, _ in got] == ["first", "second"]
    assert got[0][1] is model.first.w_q and got[0][2] is model.first.w_k
    assert got[1][1] is model.second.w_q and got[1][2] is model.second.w_k


# ----------------------------------------------------------------------------- one grouping function (issue 24)
def _former_default_groups(model, weight_decay):
    """The studies' grouping as it was written before it called param_groups (the independent reference)."""
    frames, decayed, plain = [], [], []
    for p in model.parameters():
        if p.requires_grad:
            (frames if is_frame(p) else decayed if p.ndim >= 2 else plain).append(p)
    groups = [(frames, 0.0), (decayed, weight_decay), (plain, 0.0)]
    return [(g, wd) for g, wd in groups if g]


def _former_lm_groups(model, weight_decay):
    frames, decay, plain = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_frame(p):
            frames.append(p)
        elif p.ndim >= 2 and not name.endswith(("wte.weight", "wpe.weight")):
            decay.append(p)
        else:
            plain.append(p)
    return [(g, wd) for g, wd in [(frames, 0.0), (decay, float(weight_decay)), (plain, 0.0)] if g]


def _as_ids(groups):
    """Groups as comparable data: (parameter ids in order, weight decay) per group."""
    if groups and isinstance(groups[0], dict):
        groups = [(g["params"], g["weight_decay"]) for g in groups]
    return [([id(p) for p in params], wd) for params, wd in groups]


def _study_models():
    from geoopt_stiefel_attention.models import PatchViT, TinyTransformer

    models = {}
    for attention in ("stiefel", "euclidean"):
        models[f"grokking-{attention}"] = TinyTransformer(99, 4, width=16, depth=1, heads=2, mlp=32,
                                                          attention=attention)
        models[f"vision-{attention}"] = PatchViT(image_size=8, patch_size=4, in_channels=1, num_classes=3, width=8,
                                                 depth=1, heads=2, mlp=8, attention=attention, seed=0)
    return models


def test_study_groupings_are_param_groups_and_unchanged():
    """default_param_groups (grokking, vision) and lm_param_groups are param_groups with a decay rule, and put
    the same parameters in the same groups with the same weight decay as the former hand-written functions."""
    from experiments.harness.arms import default_param_groups

    for name, model in _study_models().items():
        for wd in (0.0, 1.0):
            assert _as_ids(default_param_groups(model, wd)) == _as_ids(_former_default_groups(model, wd)), name
    model = _study_models()["grokking-stiefel"]
    next(p for p in model.parameters() if p.ndim >= 2 and not is_frame(p)).requires_grad_(False)
    assert _as_ids(default_param_groups(model, 0.5)) == _as_ids(_former_default_groups(model, 0.5))


def test_lm_grouping_is_param_groups_and_unchanged():
    pytest.importorskip("transformers")
    from experiments.lm.study import LMConfig, build_model, lm_param_groups

    cfg = LMConfig(depth=1, width=16, heads=2, context=8)
    for stiefel, gain in ((False, None), (True, None), (True, "fit")):
        model = build_model(cfg, seed=0, stiefel=stiefel, logit_gain=gain)
        groups = lm_param_groups(model, 0.1)
        assert _as_ids(groups) == _as_ids(_former_lm_groups(model, 0.1))
        assert [g["name"] for g in groups] == (["frames", "decay", "no_decay"] if stiefel else ["decay", "no_decay"])


def test_grouping_comparison_detects_a_different_rule():
    """Companion: the LM rule (embeddings not decayed) and the default rule differ on a model with an
    embedding, and the comparison sees it; a custom rule moves exactly the parameters it names."""
    model = _study_models()["grokking-stiefel"]
    lm_rule = param_groups(model, 0.1, expect_frames=False, drop_empty=True,
                           decay=lambda name, p: p.ndim >= 2 and "embed" not in name)
    assert _as_ids(lm_rule) != _as_ids(_former_default_groups(model, 0.1))
    moved = {id(p) for name, p in model.named_parameters() if p.ndim >= 2 and "embed" in name and not is_frame(p)}
    assert moved and {id(p) for p in lm_rule[2]["params"]} - {id(p) for p in param_groups(model)[2]["params"]} == moved
