"""``stiefelize`` across timm and torchvision vision models, each against a reference written from its forward.

For every model that converts, the rows of the weight that hold head ``h``'s query and key are written out here by
hand, as the model's forward splits them (quoted next to each reader below, from ``timm/models/<name>.py`` and
``torchvision/models/<name>.py``, not through the converter's table). The reference takes each ``(d, r)`` head block
``A`` of the stock weights, computes its polar factor ``U V^T`` by an SVD in float64, and the converted model's state
dict must hold exactly that at those rows and every other entry unchanged; every attention module of the model must
be converted (none silently left out), and the converted model must run.

Models whose attention is not per-token query-key attention over the rows a layout reads are refused, naming the
module and what to do, with nothing changed: attention over channels (XCiT, EdgeNeXt, DaViT), factorized attention
(CoaT), a fused weight split per head into ``key_dim``/``key_dim``/``val_dim`` rows (EfficientFormer, TinyViT: the
refusal names the interleaved layout that reads it, checked against the reference), a projection followed by
BatchNorm (LeViT). Cosine attention (SwinV2) and MViTv2's per-head norm convert, but divide a logit gain out:
warned.
Tiny random models in float64, no download.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from conftest import F64, polar64
from torch import nn

from geoopt_stiefel_attention import (
    LAYOUTS,
    Block,
    Layout,
    export_state_dict,
    frame_parameters,
    stiefelize,
    unstiefelize,
)

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

#: two float64 computations of one polar factor (an SVD here, the manifold's projection in the converter)
POLAR_TOL = 1e-10
#: the gradient of a query gain that the forward divides out, relative to its frames' (measured 2e-15 to 2e-14)
DEAD_GRAD_REL = 1e-10
#: a gradient that is not zero must exceed this
LIVE_GRAD_MIN = 1e-6


# ------------------------------------------------------------------------------------------ the reference
# A reader maps an attention module to [(weight name in the module, [rows of head h for h in heads])] for its
# query, then its key, each written from the module's forward.
def _heads(start: int, heads: int, r: int, step: int | None = None) -> list[list[int]]:
    step = r if step is None else step
    return [list(range(start + h * step, start + h * step + r)) for h in range(heads)]


def thirds(weight: str, heads_attr: str = "num_heads") -> Callable:
    """``qkv(x).reshape(B, N, 3, H, r)``: the query of head h is rows ``h r``, its key rows ``H r + h r``."""
    def read(m):
        h = getattr(m, heads_attr)
        r = _get(m, weight).shape[0] // (3 * h)
        return [(weight, _heads(0, h, r)), (weight, _heads(h * r, h, r))]
    return read


def per_head(weight: str, sizes: Callable) -> Callable:
    """``qkv(x).view(B, N, H, -1).split([q, k, v])``: head h is rows ``h (q + k + v)``, its query first."""
    def read(m):
        q, k, v = sizes(m)
        return [(weight, _heads(0, m.num_heads, q, q + k + v)), (weight, _heads(q, m.num_heads, k, q + k + v))]
    return read


def halves(q: str, k: str) -> Callable:
    """A query weight of ``H r`` rows and a key block that is the first half of ``k`` (``kv(x).reshape(B, N, 2, H, r)``,
    or ``qk(x).reshape(B, N, 2, H, r)`` when ``q == k``)."""
    def read(m):
        h = m.num_heads
        r = _get(m, k).shape[0] // (2 * h)
        return [(q, _heads(0, h, r)), (k, _heads(h * r if q == k else 0, h, r))]
    return read


def separate(q: str, k: str) -> Callable:
    """Separate query and key Linears, ``reshape(B, N, H, r)`` each."""
    def read(m):
        h = m.num_heads
        r = _get(m, q).shape[0] // h
        return [(q, _heads(0, h, r)), (k, _heads(0, h, r))]
    return read


def _get(m: nn.Module, name: str) -> torch.Tensor:
    *path, attr = name.split(".")
    for p in path:
        m = getattr(m, p)
    return getattr(m, attr)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_error(model: nn.Module, before: dict, readers: dict[str, Callable], paths: list[str]) -> tuple[float, float]:
    """``(max |converted - polar64(stock)|`` over the query/key head blocks of the modules at ``paths``, ``max |change|``
    of every other state-dict entry)``. ``readers`` maps a class name to its reader."""
    after = state(model)
    assert after.keys() == before.keys()
    rows: dict[str, set[int]] = {}
    qk = 0.0
    for path in paths:
        module = model.get_submodule(path)
        for weight, heads in readers[type(module).__name__](module):
            key = f"{path}.{weight}" if path else weight
            for head in heads:
                qk = max(qk, float((after[key][head].t() - polar64(before[key][head].t())).abs().max()))
                rows.setdefault(key, set()).update(head)
    rest = 0.0
    for key, t in before.items():
        keep = torch.ones(t.shape[0] if t.dim() else 1, dtype=torch.bool)
        keep[sorted(rows.get(key, ()))] = False
        if t.dim() == 0 or not t.is_floating_point():
            assert torch.equal(after[key], t), key
        elif keep.any():
            rest = max(rest, float((after[key][keep] - t[keep]).abs().max()))
    return qk, rest


def attention_paths(model: nn.Module, readers: dict[str, Callable]) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__ in readers]


# ------------------------------------------------------------------------------------------ the models
def _timm(name: str, **kw) -> nn.Module:
    return timm.create_model(name, pretrained=False, num_classes=5, **kw)


VIT = dict(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)


def _maxvit(head_first: bool) -> nn.Module:
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitConvCfg, MaxxVitTransformerCfg
    cfg = MaxxVitCfg(embed_dim=(16,), depths=(1,), block_type=("M",), stem_width=8,
                     conv_cfg=MaxxVitConvCfg(block_type="mbconv", expand_ratio=2.0),
                     transformer_cfg=MaxxVitTransformerCfg(dim_head=8, head_first=head_first, window_size=2,
                                                           grid_size=2, rel_pos_type="bias"))
    return MaxxVit(cfg, img_size=16, num_classes=5)


def _volo() -> nn.Module:
    from timm.models.volo import VOLO
    return VOLO(layers=[1, 1, 1, 1], img_size=32, patch_size=8, stem_hidden_dim=8, embed_dims=[16, 32, 32, 32],
                num_heads=[1, 2, 2, 2], post_layers=("ca",), num_classes=5)


def _mvitv2() -> nn.Module:
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg
    return MultiScaleVit(MultiScaleVitCfg(depths=(1, 1), embed_dim=16, num_heads=(2, 2)), img_size=(32, 32),
                         num_classes=5)


def _tv_swin(v2: bool) -> nn.Module:
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2
    kw = dict(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2) if v2 else {}
    return SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=[2, 2],
                           num_classes=5, **kw)


def _tv_maxvit() -> nn.Module:
    return torchvision.models.MaxVit(input_size=(16, 16), stem_channels=8, partition_size=2, block_channels=[16],
                                     block_layers=[1], head_dim=8, stochastic_depth_prob=0.0, num_classes=5)


# timm's ViT Attention, DeiT, PiT, BEiT (q_bias/v_bias beside a bias-free qkv), EVA (fused), Swin, SwinV2,
# SwinV2-CR, CaiT's TalkingHeadAttn, Twins' LocallyGroupedAttn, ConViT's MHSA, DaViT's WindowAttention, torchvision's
# Swin (v1, v2: F.linear(x, qkv_weight).reshape(B, N, 3, H, C // H)): all reshape(B, N, 3, H, r)
QKV = thirds("qkv.weight")
# twins GlobalSubSampleAttn, PVTv2 Attention, AttentionPoolLatent: q(x).reshape(B, N, H, r);
# kv(x').reshape(B, -1, 2, H, r).unbind -> k, v
Q_KV = halves("q.weight", "kv.weight")


@dataclass
class Case:
    build: Callable[[], nn.Module]
    size: int  # input image side
    readers: dict[str, Callable]  # class name -> reader; every module of these classes must convert
    skipped: list[str] = field(default_factory=list)  # modules left Euclidean (strict=False), with a reason


CASES = {
    "timm_deit_distilled": Case(lambda: _timm("deit_tiny_distilled_patch16_224", **VIT), 16, {"Attention": QKV}),
    "timm_pit": Case(lambda: _timm("pit_ti_224", img_size=16, patch_size=4, stride=2, base_dims=(8, 8), depth=(1, 1),
                                   heads=(2, 4)), 16, {"Attention": QKV}),
    "timm_beit": Case(lambda: _timm("beit_base_patch16_224", **VIT), 16, {"Attention": QKV}),
    "timm_eva_fused": Case(lambda: _timm("eva02_tiny_patch14_224", **VIT, qkv_fused=True), 16, {"EvaAttention": QKV}),
    # EVA-02 (rotary): q_proj(x).reshape(B, N, H, -1), k_proj likewise
    "timm_eva02_separate": Case(lambda: _timm("eva02_tiny_patch14_224", **VIT, qkv_fused=False), 16,
                                {"EvaAttention": separate("q_proj.weight", "k_proj.weight")}),
    "timm_vit_qk_norm": Case(lambda: _timm("vit_tiny_patch16_224", qk_norm=True, **VIT), 16, {"Attention": QKV}),
    "timm_vit_attention_pool": Case(lambda: _timm("vit_tiny_patch16_224", global_pool="map", **VIT), 16,
                                    {"Attention": QKV, "AttentionPoolLatent": Q_KV}),
    "timm_swin": Case(lambda: _timm("swin_tiny_patch4_window7_224", img_size=16, patch_size=2, embed_dim=16,
                                    depths=(1, 1), num_heads=(2, 4), window_size=2), 16, {"WindowAttention": QKV}),
    "timm_swinv2": Case(lambda: _timm("swinv2_tiny_window8_256", img_size=16, patch_size=2, embed_dim=16,
                                      depths=(1, 1), num_heads=(2, 4), window_size=2), 16, {"WindowAttention": QKV}),
    "timm_swinv2_cr": Case(lambda: _timm("swinv2_cr_tiny_224", img_size=(16, 16), patch_size=2, embed_dim=16,
                                         depths=(1, 1), num_heads=(2, 4), window_size=(2, 2)), 16,
                           {"WindowMultiHeadAttention": QKV}),
    # CaiT's class attention (q, k, v Linears, no built-in layout) is left out and says why
    "timm_cait": Case(lambda: _timm("cait_xxs24_224", **VIT, depth_token_only=1), 16, {"TalkingHeadAttn": QKV},
                      skipped=["blocks_token_only.0.attn"]),
    # CrossViT's cross attention (wq/wk/wv Linears) likewise
    "timm_crossvit": Case(lambda: _timm("crossvit_tiny_240", img_size=32, img_scale=(1.0, 1.0), patch_size=(8, 16),
                                        embed_dim=(16, 16), depth=((1, 1, 0),), num_heads=(2, 2)), 32,
                          {"Attention": QKV}, skipped=["blocks.0.fusion.0.attn", "blocks.0.fusion.1.attn"]),
    # Twins-SVT: LocallyGroupedAttn (qkv) and GlobalSubSampleAttn (q + kv); Twins-PCPVT: GlobalSubSampleAttn only
    "timm_twins_svt": Case(lambda: _timm("twins_svt_small", img_size=32, patch_size=4, embed_dims=(8, 16),
                                         num_heads=(1, 2), mlp_ratios=(2, 2), depths=(2, 2), sr_ratios=(2, 1),
                                         wss=(2, 2)), 32,
                           {"LocallyGroupedAttn": QKV, "GlobalSubSampleAttn": Q_KV}),
    "timm_twins_pcpvt": Case(lambda: _timm("twins_pcpvt_small", img_size=32, patch_size=4, embed_dims=(8, 16),
                                           num_heads=(1, 2), mlp_ratios=(2, 2), depths=(1, 1), sr_ratios=(2, 1)), 32,
                             {"GlobalSubSampleAttn": Q_KV}),
    "timm_pvt_v2": Case(lambda: _timm("pvt_v2_b0", embed_dims=(8, 16), depths=(1, 1), num_heads=(1, 2),
                                      mlp_ratios=(2, 2), sr_ratios=(2, 1)), 32, {"Attention": Q_KV}),
    "timm_pvt_v2_linear": Case(lambda: _timm("pvt_v2_b2_li", embed_dims=(8, 16), depths=(1, 1), num_heads=(1, 2),
                                             mlp_ratios=(2, 2), sr_ratios=(2, 1)), 32, {"Attention": Q_KV}),
    # MaxViT's AttentionCl, head_first (timm's default): qkv(x).view(B, -1, H, 3 * dim_head).transpose(1, 2).chunk(3)
    "timm_maxvit_head_first": Case(lambda: _maxvit(True), 16,
                                   {"AttentionCl": per_head("qkv.weight", lambda m: [m.dim_head] * 3)}),
    # head_first=False (the TF ports): qkv(x).reshape(B, -1, 3, H, dim_head)
    "timm_maxvit_head_last": Case(lambda: _maxvit(False), 16, {"AttentionCl": QKV}),
    # ConViT: MHSA (qkv) and GPSA: qk(x).reshape(B, N, 2, H, C // H), q = qk[0], k = qk[1]
    "timm_convit": Case(lambda: _timm("convit_tiny", img_size=16, patch_size=8, embed_dim=8, depth=2, num_heads=2,
                                      local_up_to_layer=1), 16,
                        {"MHSA": QKV, "GPSA": halves("qk.weight", "qk.weight")}),
    # TNT's inner and outer Attention: qk(x).reshape(B, N, 2, H, r), v apart
    "timm_tnt": Case(lambda: _timm("tnt_s_patch16_224", img_size=16, patch_size=8, embed_dim=16, inner_dim=8, depth=1,
                                   num_heads_outer=2, num_heads_inner=2, first_stride=2), 16,
                     {"Attention": halves("qk.weight", "qk.weight")}),
    # VOLO: Attention (qkv) and the class attention of its post network: kv(x).reshape(B, N, 2, H, r), q(x[:, :1]);
    # its OutlookAttention (attention weights straight from a Linear of each token, no query or key) is left out
    "timm_volo": Case(lambda: _volo(), 32, {"Attention": QKV, "ClassAttention": Q_KV}, skipped=["network.0.0.attn"]),
    # MViTv2's MultiScaleAttention: qkv(x).reshape(B, N, 3, H, -1), then pooling and a per-head norm_q/norm_k
    "timm_mvitv2": Case(lambda: _mvitv2(), 32, {"MultiScaleAttention": QKV}),
    "torchvision_swin_t": Case(lambda: _tv_swin(False), 16, {"ShiftedWindowAttention": QKV}),
    "torchvision_swin_v2_t": Case(lambda: _tv_swin(True), 16, {"ShiftedWindowAttentionV2": QKV}),
    # torchvision MaxViT: q, k, v = to_qkv(x).chunk(3, -1); q.reshape(B, G, P, H, DH)
    "torchvision_maxvit_t": Case(_tv_maxvit, 16,
                                 {"RelativePositionalMultiHeadAttention": thirds("to_qkv.weight", "n_heads")}),
}


def _built(case: Case) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = case.build().to(F64).eval()
    x = torch.randn(2, 3, case.size, case.size, dtype=F64, generator=torch.Generator().manual_seed(1))
    return model, x


@pytest.mark.parametrize("name", list(CASES))
def test_converts_each_attention_module_to_the_reference_frames(name):
    case = CASES[name]
    model, x = _built(case)
    before = state(model)
    expected = attention_paths(model, case.readers)
    assert expected
    if case.skipped:
        with pytest.raises(ValueError, match="matches no layout"):
            stiefelize(model)
        assert state(model).keys() == before.keys() and not frame_parameters(model)
        with pytest.warns(UserWarning, match="left unconverted"):
            result = stiefelize(model, strict=False)
        assert [p for p, _ in result.skipped] == case.skipped
    else:
        result = stiefelize(model)
    assert [row.path for row in result] == expected  # every attention module, none silently left out
    qk, rest = reference_error(model, before, case.readers, expected)
    assert qk < POLAR_TOL and rest == 0.0
    assert torch.isfinite(model(x)).all()


#: two float64 forward passes of the same function in different orders
SAME_TOL = 1e-12


#: what stiefelize(qk_bias="drop", logit_gain="learn") says of ConViT (each tested where it is the subject)
_CONVIT_WARNINGS = ("stiefelize: qk_bias='drop' had nothing to drop",
                    "stiefelize: logit_gain='learn' does not act as each query head's logit factor in .*GPSA")


@pytest.mark.parametrize("name", ["timm_maxvit_head_first", "timm_pvt_v2", "timm_convit", "torchvision_maxvit_t", "timm_beit",
                                  "timm_eva_fused"])
def test_the_new_layouts_save_stock_checkpoints_and_convert_them_again(name):
    """The layouts added for vision models (per-head q|k|v, q + kv, qk + v, to_qkv, q_bias beside qkv), with dropped
    query/key biases and learned gains: the exported state dict loaded into the stock model computes the converted model's function,
    converting that stock model again keeps the gains, and unstiefelize gives the function back."""
    model, x = _built(CASES[name])
    stock, _ = _built(CASES[name])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    with warnings.catch_warnings():
        for expected in _CONVIT_WARNINGS:  # ConViT: no qk bias, and GPSA's position logits (tested on their own)
            warnings.filterwarnings("ignore", expected)
        stiefelize(model, qk_bias="drop", logit_gain="learn")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "q_log_gain"):
                m.q_log_gain.normal_(0, 0.1)
        y = model(x)
        stock.load_state_dict(export_state_dict(model))
        assert float((stock(x) - y).abs().max()) < SAME_TOL
    with warnings.catch_warnings():
        for expected in _CONVIT_WARNINGS:
            warnings.filterwarnings("ignore", expected)
        stiefelize(stock, qk_bias="drop", logit_gain="learn")
    with pytest.warns(UserWarning, match="are plain Parameters again"):
        unstiefelize(model)
    with torch.no_grad():
        assert float((stock(x) - y).abs().max()) < SAME_TOL and float((model(x) - y).abs().max()) < SAME_TOL


def test_the_reference_is_not_the_equal_thirds_where_the_forward_interleaves():
    """The per-head reference of MaxViT's head_first AttentionCl differs from equal thirds (what the converter used
    to read there), so the test above tells them apart."""
    model, _ = _built(CASES["timm_maxvit_head_first"])
    path = attention_paths(model, {"AttentionCl": None})[0]
    module = model.get_submodule(path)
    mine = CASES["timm_maxvit_head_first"].readers["AttentionCl"](module)
    assert mine != QKV(module) and mine[0][1][1] == list(range(24, 32))  # head 1's query: rows 3 r to 4 r


@pytest.mark.parametrize("name", ["timm_cait", "timm_crossvit"])
def test_the_layout_a_refusal_suggests_converts_to_the_reference(name):
    """CaiT's ClassAttn (q/k) and CrossViT's CrossAttention (wq/wk) match no layout; the Layout the refusal names
    converts them: q(x[:, 0]).reshape(B, 1, H, C // H) and k(x).reshape(B, N, H, C // H)."""
    case = CASES[name]
    model, x = _built(case)
    with pytest.raises(ValueError) as err:
        stiefelize(model)
    snippet = str(err.value).split("targets=(*LAYOUTS, ")[1].split(")))")[0] + "))"
    layout = eval(snippet)  # noqa: S307 - the message's own code
    cls = {"timm_cait": "ClassAttn", "timm_crossvit": "CrossAttention"}[name]
    readers = {cls: separate(layout.q.param, layout.k.param)}
    before = state(model)
    result = stiefelize(model, targets=lambda path, m: layout if type(m).__name__ == cls else None)
    assert [row.path for row in result] == case.skipped == attention_paths(model, readers)
    qk, rest = reference_error(model, before, readers, case.skipped)
    assert qk < POLAR_TOL and rest == 0.0
    assert torch.isfinite(model(x)).all()


def test_a_user_layout_of_thirds_on_an_interleaved_attention_cl_is_refused():
    """On MaxViT's head_first AttentionCl equal thirds are other rows (head 0's q, k, v and head 1's q as the
    queries): a user layout reading them is refused, naming the interleave; the built-in table converts it."""
    model, _ = _built(CASES["timm_maxvit_head_first"])
    thirds_layout = Layout("thirds", Block("qkv.weight", 0, 0, 3), Block("qkv.weight", 0, 1, 3))
    with pytest.raises(ValueError, match="interleaved per head"):
        stiefelize(model, targets=[thirds_layout])
    assert not frame_parameters(model)
    assert len(stiefelize(model)) == 2


def test_dropping_the_key_bias_of_a_fused_key_value_linear_drops_only_the_key_half():
    """PVTv2: qk_bias='drop' zeroes q.bias and the first half of kv.bias (the keys), not the value half."""
    model, x = _built(CASES["timm_pvt_v2"])
    attn = model.stages[1].blocks[0].attn
    with torch.no_grad():
        for b in (attn.q.bias, attn.kv.bias):
            b.normal_()
    values = attn.kv.bias[16:].detach().clone()
    stiefelize(model, qk_bias="drop")
    assert torch.equal(attn.q.bias, torch.zeros(16, dtype=F64)) and torch.equal(attn.kv.bias[:16],
                                                                                  torch.zeros(16, dtype=F64))
    assert torch.equal(attn.kv.bias[16:], values)
    assert torch.isfinite(model(x)).all()


# ------------------------------------------------------------------------------------------ refused
def _davit() -> nn.Module:
    return _timm("davit_tiny", embed_dims=(16, 32), depths=(1, 1), num_heads=(2, 4), window_size=2)


def _module(cls: str, **kw) -> Callable[[], nn.Module]:
    def build():
        module_name, _, name = cls.rpartition(".")
        import importlib
        return nn.Sequential(getattr(importlib.import_module(module_name), name)(**kw))
    return build


#: name -> (build, input side, the refusal's words). XCiT's XCA: qkv(x).reshape(B, N, 3, H, C // H).permute(2, 0,
#: 3, 4, 1), q, k normalized over the tokens, attn = q @ k^T is (C/H x C/H); EdgeNeXt's CrossCovarianceAttn likewise;
#: DaViT's ChannelAttention: attn = (k^T v).softmax() over channels, applied to q; CoaT: factor_att = q @ (k.softmax(
#: dim=2)^T v); EfficientFormer/TinyViT Attention: qkv(x).view(B, N, H, -1).split([key_dim, key_dim, val_dim]).
REFUSED = {
    "timm_xcit": (lambda: _timm("xcit_nano_12_p8_224", img_size=16, embed_dim=16, depth=1, num_heads=2,
                                cls_attn_layers=1), 16, "XCA matches layout 'fused qkv Linear' but it attends over "
                                                        "channels, not tokens"),
    "timm_edgenext": (lambda: _timm("edgenext_xx_small", depths=(1, 1, 1, 1), dims=(8, 16, 16, 32),
                                    heads=(2, 2, 2, 2)), 64, "CrossCovarianceAttn matches layout 'fused qkv Linear' "
                                                             "but it attends over channels, not tokens"),
    "timm_davit": (_davit, 32, "ChannelAttention matches layout 'fused qkv Linear' but it attends over channels"),
    "timm_coat": (lambda: _timm("coat_lite_tiny", img_size=32, patch_size=4, embed_dims=(8, 16, 16, 16),
                                serial_depths=(1, 1, 1, 1), num_heads=2, mlp_ratios=(2, 2, 2, 2),
                                crpe_window={3: 2}), 32, "FactorAttnConvRelPosEnc matches layout 'fused qkv Linear' "
                                                         "but it computes factorized attention"),
    "timm_efficientformer_attention": (
        _module("timm.models.efficientformer.Attention", dim=64, key_dim=4, num_heads=2, attn_ratio=4, resolution=2),
        None, "split per head into key_dim=4 query, key_dim=4 key and val_dim=16 value rows"),
    "timm_tiny_vit_attention": (
        _module("timm.models.tiny_vit.Attention", dim=32, key_dim=4, num_heads=2, attn_ratio=1, resolution=(2, 2)),
        None, "split per head into key_dim=4 query, key_dim=4 key and val_dim=4 value rows"),
    "timm_levit": (lambda: _timm("levit_128s", img_size=32, embed_dim=(16, 32), key_dim=4, depth=(1, 1),
                                 num_heads=(2, 4)), 32, "is a linear map followed by BatchNorm"),
}


def _refused_input(model: nn.Module, size: int | None) -> torch.Tensor:
    if size is None:  # an attention module alone: tokens of its width (its resolution's 4 positions)
        return torch.randn(2, 4, model[0].qkv.in_features, dtype=F64, generator=torch.Generator().manual_seed(1))
    return torch.randn(2, 3, size, size, dtype=F64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_that_is_not_token_attention_over_the_read_rows_is_refused(name):
    build, size, words = REFUSED[name]
    torch.manual_seed(0)
    model = build().to(F64).eval()
    before = state(model)
    with pytest.raises(ValueError, match="nothing was changed") as err:
        stiefelize(model)
    assert words in str(err.value)
    assert not frame_parameters(model) and all(torch.equal(v, before[k]) for k, v in state(model).items())
    # companion: left Euclidean with strict=False, named among the skipped modules, and the model still runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "left unconverted", or "no attention module was converted"
        result = stiefelize(model, strict=False)
    assert any(words in why for _, why in result.skipped)
    assert torch.isfinite(model(_refused_input(model, size))).all()


def test_strict_false_converts_davit_windows_and_leaves_its_channel_attention():
    """DaViT alternates window attention (token attention, qkv reshape(B, N, 3, H, C // H)) with channel attention:
    strict=False converts the first, to the reference, and leaves the second, saying why."""
    torch.manual_seed(0)
    model = _davit().to(F64).eval()
    before = state(model)
    with pytest.warns(UserWarning, match="attends over channels"):
        result = stiefelize(model, strict=False)
    readers = {"WindowAttention": QKV}
    assert [row.path for row in result] == attention_paths(model, readers)
    assert [p for p, _ in result.skipped] == attention_paths(model, {"ChannelAttention": None})
    qk, rest = reference_error(model, before, readers, attention_paths(model, readers))
    assert qk < POLAR_TOL and rest == 0.0


@pytest.mark.parametrize("name", ["timm_efficientformer_attention", "timm_tiny_vit_attention"])
def test_the_per_head_layout_a_refusal_names_converts_to_the_reference(name):
    """The refused key_dim/key_dim/val_dim split is read by the interleaved Layout the message names."""
    build, _, _ = REFUSED[name]
    torch.manual_seed(0)
    model = build().to(F64).eval()
    with pytest.raises(ValueError) as err:
        stiefelize(model)
    msg = str(err.value)
    layout = eval(msg[msg.index("targets=[") + len("targets=["):msg.index(")] (") + 1])  # noqa: S307
    before = state(model)
    result = stiefelize(model, targets=[layout])
    readers = {"Attention": per_head("qkv.weight", lambda m: [m.key_dim, m.key_dim, m.val_dim])}
    assert [(row.path, row.q_heads, row.r) for row in result] == [("0", 2, 4)]
    qk, rest = reference_error(model, before, readers, ["0"])
    assert qk < POLAR_TOL and rest == 0.0
    # the equal thirds the converter used to read are other rows
    assert readers["Attention"](model[0]) != QKV(model[0])


def test_a_model_without_attention_raises():
    model = _timm("test_resnet").to(F64)
    with pytest.raises(ValueError, match="no attention module of ResNet was converted"):
        stiefelize(model)
    assert not frame_parameters(model)


# ------------------------------------------------------------------------------------------ cosine attention
def _hf_swinv2() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Swinv2Config(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                    window_size=2)
    torch.manual_seed(0)
    model = transformers.Swinv2Model(cfg).to(F64).eval()
    x = torch.randn(2, 3, 16, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    return model, x


def _gain_gradients(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[float, float]]:
    """``path -> (max |d loss / d log-gain|, smallest max |d loss / d frames|)`` per converted module, after
    ``stiefelize(model, logit_gain="learn")`` with gains drawn away from 1. Before converting, every LayerNorm weight
    is set to one (SwinV2's post-norms start at zero, which cuts every gradient into the attention), every query
    bias to zero (with a query bias a normalization divides out all of a gain but its ratio to the bias) and the eps
    of MViTv2's query norm to zero (its small pooled queries let 0.5% of the gradient through the eps)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.fill_(1.0)
            if isinstance(getattr(m, "norm_q", None), nn.LayerNorm):
                m.norm_q.eps = 0.0
            if isinstance(getattr(m, "q_bias", None), nn.Parameter):
                m.q_bias.zero_()
            for name, parts in (("qkv", 3), ("query", 1)):
                lin = getattr(m, name, None)
                if isinstance(lin, nn.Linear) and lin.bias is not None:
                    lin.bias[: lin.out_features // parts].zero_()
    result = stiefelize(model, logit_gain="learn")
    weights = {row.path: model.get_submodule(row.path) for row in result}
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "q_log_gain"):
                m.q_log_gain.normal_(0, 0.1)
    out = model(x)
    getattr(out, "last_hidden_state", out).square().sum().backward()
    grads = {}
    for path, module in weights.items():
        qk = [m for m in module.modules() if hasattr(m, "q_log_gain")]
        frames = [p for m in qk for n, p in m.named_parameters() if n.endswith("_frames")]
        grads[path] = (max(float(m.q_log_gain.grad.abs().max()) for m in qk),
                       min(float(p.grad.abs().max()) for p in frames))
    return grads


@pytest.mark.parametrize(("name", "words"), [("timm_swinv2", "WindowAttention: it computes cosine attention"),
                                             ("timm_swinv2_cr", "WindowMultiHeadAttention: it computes cosine"),
                                             ("torchvision_swin_v2_t", "ShiftedWindowAttentionV2: it computes cosine"),
                                             ("hf_swinv2", "Swinv2SelfAttention: it computes cosine attention"),
                                             ("timm_mvitv2", "MultiScaleAttention: it normalizes its queries/keys "
                                                             "after the projection (norm_q (LayerNorm))")])
def test_a_logit_gain_that_the_forward_divides_out_is_warned(name, words):
    """SwinV2: F.normalize(q) @ F.normalize(k)^T * logit_scale; MViTv2: norm_q(pool_q(q)), a LayerNorm per head.
    A gain on the query rows is divided out (its gradient is zero, up to the norm's eps), so logit_gain warns,
    naming the modules; the rows convert as above."""
    model, x = _hf_swinv2() if name == "hf_swinv2" else _built(CASES[name])
    with pytest.warns(UserWarning, match="does not act as each query head's logit factor") as record:
        grads = _gain_gradients(model, x)
    message = next(str(w.message) for w in record if "logit factor" in str(w.message))
    assert words in message
    warned = [path for path in grads if repr(path) in message]
    assert warned == list(grads)
    for path, (gain, frames) in grads.items():
        assert frames > LIVE_GRAD_MIN and gain < DEAD_GRAD_REL * frames, path  # the attention learns, the gain not


def test_a_logit_gain_on_dot_product_window_attention_is_not_warned():
    """Companion: Swin v1 (q * scale @ k^T) takes a gain as each head's logit factor: no warning, live gradient."""
    model, x = _built(CASES["timm_swin"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = _gain_gradients(model, x)
    assert all(gain > LIVE_GRAD_MIN and frames > LIVE_GRAD_MIN for gain, frames in grads.values())


def test_the_vision_layouts_come_before_the_generic_fused_qkv():
    """The first layout that matches converts: the AttentionCl interleave must be tried before "fused qkv Linear"."""
    names = [lay.name for lay in LAYOUTS]
    assert names.index("timm AttentionCl qkv (head_first)") < names.index("fused qkv Linear")
