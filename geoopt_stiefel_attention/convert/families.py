r"""The table of model families: all that :func:`~geoopt_stiefel_attention.stiefelize` knows about any model.

One :class:`Family` per kind of model, as peft keeps one mapping from model type to target modules: the classes of
its attention modules, the :class:`~geoopt_stiefel_attention.Layout` s that read their query and key rows, the
names of the child modules that normalize its queries or keys (QK-norm), of its position projections, of its
query/key Linear children and of its query/key biases kept apart, the names of an adapter library's layers, why its
modules must not be converted though a layout matches their names, and the hint shown when none matches. The
converter reads nothing about a model family anywhere else, so a new family is one more entry of
:data:`FAMILIES`. :data:`~geoopt_stiefel_attention.LAYOUTS` is the entries' layouts, in table order.

Head counts are read under the attribute names of :data:`HEAD_DIM_ATTRS`, :data:`NUM_HEADS_ATTRS`,
:data:`KV_HEADS_ATTRS` and :data:`KV_GROUPS_ATTRS`, which families share (``head_dim`` serves torch, Llama and
timm alike); a family whose attributes are named otherwise says so in its layout (``Layout(..., head_dim=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .layouts import (
    Block,
    Layout,
    _children_are,
    _is_attention,
    _is_class,
    _is_conv1d,
    _is_linear,
    _is_torch_mha,
)

#: Attribute names read (in order) for a module's head size, then for its number of query heads.
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
#: Attribute names read (in order) for a module's number of key/value heads (grouped-query attention), then
#: for its number of query heads per key/value head.
KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
KV_GROUPS_ATTRS = ("num_key_value_groups",)

#: The advice that closes a refusal given as text (:attr:`Family.refusal`).
LEAVE = "leave it Euclidean (strict=False, or a targets callable that returns None for it)"


# ---------------------------------------------------------------------------------------------- one family
@dataclass(frozen=True)
class Family:
    r"""One model family: what the converter knows about its attention modules.

    Parameters
    ----------
    name : str
        The models of the family, for the reader (``"GPT-2"``, ``"timm ViT, Swin, ..."``).
    classes : tuple of str, default ()
        Names of its attention classes, matched along the class hierarchy (the libraries that define them are
        not imported). With classes, its layouts match only modules of these classes (each is stored with that
        test added to its ``when``), and a text ``refusal`` applies to them.
    layouts : tuple of Layout, default ()
        The layouts that read its query and key rows, tried in this order after those of the entries above it.
    qk_children : tuple of (str, str), default ()
        Names of a query/key pair of Linear children that mark a module as attention even when its class name does
        not say so (``("q_proj", "k_proj")``); a module that holds one and matches no layout is reported.
    qk_norms : tuple of str, default ()
        Child modules that normalize the queries or keys after their projection (QK-norm); a query gain
        :math:`\gamma_h` is divided out there, so ``logit_gain`` warns. An ``nn.Identity`` there does not count.
    key_norms : tuple of str, default ()
        The names among ``qk_norms`` that normalize the keys alone: they leave the queries' scale, and with it the
        gain, in the logits (no warning for them alone).
    position_projections : tuple of str, default ()
        Projections of relative positions paired with the queries or keys apart from the query/key projections
        (disentangled attention); a gain scales those logits otherwise than the content logits (warned).
    qk_biases : (str, str), optional
        Names of query and key bias parameters kept apart from the projection weights; ``qk_bias="drop"`` refuses a
        module holding one where its layout does not look.
    adapter_child : str, optional
        For an adapter library: the name of the child under which its layers hold the layer they adapt (PEFT's
        ``base_layer``). A query/key projection held so is refused (the adapter's update bypasses the frames).
    adapter_package : str, optional
        For an adapter library: the package of its layers' modules, ``"peft.tuners"``; a layer of
        ``peft.tuners.lora.layer`` is then named ``lora.Linear`` (as PEFT prints it).
    refusal : str or callable, optional
        Why a module must not be converted although a built-in layout matches its names: a text, shown for the
        modules of ``classes`` (``{param}`` is replaced by the layout's query weight, and :data:`LEAVE` appended),
        or ``refusal(module, layout) -> str | None``, asked about every such module.
    hint : str or callable, optional
        Why a module that looks like attention matched no layout, and what to do: a text, shown for the modules of
        ``classes``, or ``hint(module) -> str | None``, asked about every such module.
    gain_caveat : callable, optional
        ``gain_caveat(module) -> str | None``: why a gain on the query rows of a converted module would not be its
        logits' factor, beyond ``qk_norms`` and ``position_projections`` (``logit_gain`` warns with it).

    Examples
    --------
    A family nobody foresaw, with projections called ``wq``/``wk`` on ``ToyAttention`` modules with ``hd``-wide
    heads, is one more entry (``stiefelize`` then converts such modules with ``targets="auto"``):

    >>> from geoopt_stiefel_attention import Block, Layout
    >>> from geoopt_stiefel_attention.convert.families import FAMILIES, Family
    >>> toy = Family("toy", classes=("ToyAttention",),
    ...              layouts=(Layout("toy wq/wk", Block("wq.weight"), Block("wk.weight"), head_dim="hd"),))
    >>> table = (*FAMILIES, toy)
    """

    name: str
    classes: tuple[str, ...] = ()
    layouts: tuple[Layout, ...] = ()
    qk_children: tuple[tuple[str, str], ...] = ()
    qk_norms: tuple[str, ...] = ()
    key_norms: tuple[str, ...] = ()
    position_projections: tuple[str, ...] = ()
    qk_biases: tuple[str, str] | None = None
    adapter_child: str | None = None
    adapter_package: str | None = None
    refusal: str | Callable[[nn.Module, Layout], str | None] | None = dataclasses.field(default=None, compare=False)
    hint: str | Callable[[nn.Module], str | None] | None = dataclasses.field(default=None, compare=False)
    gain_caveat: Callable[[nn.Module], str | None] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"Family: name={self.name!r} is invalid; pass a non-empty str naming its models.")
        for option in ("classes", "qk_norms", "key_norms", "position_projections"):
            value = getattr(self, option)
            if not (isinstance(value, tuple) and all(_is_name(n) for n in value)):
                raise ValueError(f"Family {self.name!r}: {option}={value!r} is invalid; pass a tuple of names "
                                 f"(str), e.g. ('q_norm', 'k_norm').")
        if not (isinstance(self.layouts, tuple) and all(isinstance(lay, Layout) for lay in self.layouts)):
            raise ValueError(f"Family {self.name!r}: layouts={self.layouts!r} is invalid; pass a tuple of Layout.")
        pairs = self.qk_children + ((self.qk_biases,) if self.qk_biases is not None else ())
        if not (isinstance(self.qk_children, tuple) and all(_is_pair(p) for p in pairs)):
            raise ValueError(f"Family {self.name!r}: qk_children={self.qk_children!r} and qk_biases="
                             f"{self.qk_biases!r} are (query name, key name) pairs of str; pass e.g. "
                             f"qk_children=(('q_proj', 'k_proj'),), qk_biases=('q_bias', 'k_bias').")
        if set(self.key_norms) - set(self.qk_norms):
            raise ValueError(f"Family {self.name!r}: key_norms {sorted(set(self.key_norms) - set(self.qk_norms))} "
                             f"are not among qk_norms={self.qk_norms!r}; list every key norm in qk_norms too.")
        for option in ("adapter_child", "adapter_package"):
            value = getattr(self, option)
            if value is not None and not _is_name(value):
                raise ValueError(f"Family {self.name!r}: {option}={value!r} is invalid; pass a name (str) or None.")
        for option in ("refusal", "hint", "gain_caveat"):
            value = getattr(self, option)
            if not (value is None or callable(value) or (isinstance(value, str) and option != "gain_caveat")):
                raise ValueError(f"Family {self.name!r}: {option}={value!r} is invalid; pass "
                                 f"{'a callable' if option == 'gain_caveat' else 'a str or a callable'} or None.")
        if isinstance(self.refusal, str) or isinstance(self.hint, str):
            if not self.classes:
                raise ValueError(f"Family {self.name!r}: a refusal or hint given as text is shown for the modules "
                                 f"of its classes, and it names none; pass classes=(...) or a callable.")
        if self.classes:  # its layouts read its own classes only
            object.__setattr__(self, "layouts", tuple(_of_classes(lay, self.classes) for lay in self.layouts))

    def is_member(self, module: nn.Module) -> bool:
        """Whether ``module``'s class, or a class it derives from, is one of :attr:`classes`.

        Parameters
        ----------
        module : nn.Module
            Any module.

        Returns
        -------
        bool
            ``False`` for a family without classes.
        """
        return bool(self.classes) and _is_class(module, self.classes)

    def refuses(self, module: nn.Module, layout: Layout) -> str | None:
        """Why ``module``, which the built-in ``layout`` matches by its names, must not be converted.

        Parameters
        ----------
        module : nn.Module
            The matched module.
        layout : Layout
            The built-in layout that matched it.

        Returns
        -------
        str or None
            The reason (ending with what to do), or ``None`` when this family has none for it.
        """
        if callable(self.refusal):
            return self.refusal(module, layout)
        if self.refusal is None or not self.is_member(module):
            return None
        return f"{self.refusal.replace('{param}', layout.q.param)}; {LEAVE}"

    def hints(self, module: nn.Module) -> str | None:
        """Why ``module``, which looks like attention, matched no layout, and what to do.

        Parameters
        ----------
        module : nn.Module
            The unmatched module.

        Returns
        -------
        str or None
            The hint, or ``None`` when this family has none for it.
        """
        if callable(self.hint):
            return self.hint(module)
        return self.hint if self.hint is not None and self.is_member(module) else None


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and bool(x)


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(_is_name(n) for n in x)


def _of_classes(layout: Layout, classes: tuple[str, ...]) -> Layout:
    """``layout`` matching only modules of ``classes`` (tested first, then its own ``when``)."""
    when = layout.when
    return dataclasses.replace(layout, when=lambda m: _is_class(m, classes) and (when is None or bool(when(m))))


# ---------------------------------------------------------------------------------------------- refusals, hints
def _split_per_head(module: nn.Module, layout: Layout) -> str | None:
    """A fused weight that the module splits per head into ``key_dim`` query, ``key_dim`` key and ``val_dim`` value
    rows (timm EfficientFormer, TinyViT) rather than into the equal slices the layout reads; ``None`` otherwise."""
    kd, vd, heads = (getattr(module, a, None) for a in ("key_dim", "val_dim", "num_heads"))
    if not (layout.q.param == layout.k.param and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                     for x in (kd, vd, heads))):
        return None
    p = layout.q.param
    split = (f"{p} is split per head into key_dim={kd} query, key_dim={kd} key and val_dim={vd} value rows "
             f"(view(..., num_heads, -1).split([key_dim, key_dim, val_dim])), not into the equal slices the "
             f"layout reads")
    if vd % kd == 0:
        n = 2 + vd // kd
        return (f"{split}; pass targets=[Layout('q|k|v per head', Block({p!r}, 0, 0, {n}, interleaved=True), "
                f"Block({p!r}, 0, 1, {n}, interleaved=True), head_dim='key_dim')] (each head's value rows as "
                f"{n - 2} more slices of key_dim)")
    return f"{split}; {LEAVE}"


def _euclidean_module(module: nn.Module) -> str | None:
    """This library's Euclidean attention module, which has its own conversion."""
    if type(module).__name__ == "EuclideanMultiheadAttention":
        return "it is this library's Euclidean module: use StiefelMultiheadAttention.from_euclidean(module)"
    return None


def _normalized_projection(module: nn.Module) -> str | None:
    """Why ``module``, which looks like attention and matches no layout, cannot be converted by a layout naming its
    weights (``None`` when a layout could): a query/key projection followed by BatchNorm (timm LeViT's
    ``LinearNorm``/``ConvNorm``, EfficientFormerV2's ``ConvNorm``)."""
    normed = [n for n in ("qkv", "kv", "qk", "q", "k") if isinstance(child := getattr(module, n, None), nn.Module)
              and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in child.modules())]
    if not normed:
        return None
    return (f"its query/key projection ({', '.join(normed)}) is a linear map followed by BatchNorm, whose "
            f"per-feature scale acts on every query/key row after the weight, so frames on the weight would not be "
            f"its query/key heads; {LEAVE}")


def _clamps_qkv(module: nn.Module) -> str | None:
    """A clamp of q, k and v after the projection (``clip_qkv`` on the module or its config)."""
    clip = getattr(module, "clip_qkv", None)
    if clip is None:
        clip = getattr(getattr(module, "config", None), "clip_qkv", None)
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
        return (f"it clamps q, k and v to +-{clip:g} after the projection (clip_qkv), so a gain stops scaling a "
                f"logit where the query entries reach the clamp")
    return None


def _cosine_attention(module: nn.Module) -> str | None:
    """Cosine attention: a ``logit_scale`` Parameter, q and k L2-normalized per head in the forward."""
    if isinstance(getattr(module, "logit_scale", None), nn.Parameter):
        return ("it computes cosine attention (q and k normalized per head, times its logit_scale), which divides "
                "a gain on the query rows out (only its ratio to a query bias remains)")
    return None


# ---------------------------------------------------------------------------------------------- the table
#: The model families, in the order their layouts are tried (the first layout that matches a module converts it).
FAMILIES: tuple[Family, ...] = (
    # query/key Linears that mark a module as attention, though no built-in layout reads them (the hint says how)
    Family("diffusers Attention (to_q/to_k)", qk_children=(("to_q", "to_k"),)),
    Family("reference implementations (Meta's Llama, Mistral: wq/wk; w_q/w_k)",
           qk_children=(("wq", "wk"), ("w_q", "w_k"))),
    # vision models (timm, torchvision), each as its forward splits the rows:
    # timm MaxViT/CoAtNet's AttentionCl with head_first (the default): view(..., H, 3 * dim_head).chunk(3), so the
    # rows of head h are [q_h, k_h, v_h] at 3 h r (with head_first=False it is the plain q|k|v of "fused qkv Linear")
    Family("timm MaxViT, CoAtNet", classes=("AttentionCl",), layouts=(
        Layout("timm AttentionCl qkv (head_first)", Block("qkv.weight", 0, 0, 3, interleaved=True),
               Block("qkv.weight", 0, 1, 3, interleaved=True), head_dim="dim_head",
               when=lambda m: getattr(m, "head_first", None) is True and _children_are(m, ("qkv",), _is_linear)),)),
    # a query Linear beside a fused key|value Linear, reshape(..., 2, H, r): spatial-reduction attention, keys from
    # the reduced sequence
    Family("timm PVTv2, Twins, VOLO class attention, AttentionPoolLatent", layouts=(
        Layout("q + kv Linear", Block("q.weight"), Block("kv.weight", 0, 0, 2),
               when=lambda m: _children_are(m, ("q", "kv"), _is_linear)
               and m.kv.out_features == 2 * m.q.out_features),)),
    # a fused query|key Linear beside a value Linear, reshape(..., 2, H, r)
    Family("timm ConViT (GPSA), TNT", layouts=(
        Layout("qk + v Linear", Block("qk.weight", 0, 0, 2), Block("qk.weight", 0, 1, 2),
               when=lambda m: _children_are(m, ("qk", "v"), _is_linear)),)),
    # to_qkv(x).chunk(3), then (n_heads, head_dim) per chunk
    Family("torchvision MaxViT", classes=("RelativePositionalMultiHeadAttention",), layouts=(
        Layout("torchvision MaxViT to_qkv Linear", Block("to_qkv.weight", 0, 0, 3), Block("to_qkv.weight", 0, 1, 3),
               when=lambda m: _children_are(m, ("to_qkv",), _is_linear)),)),
    Family("torch MultiheadAttention (also in nn.Transformer*, torchvision ViT)", layouts=(
        Layout("torch MultiheadAttention", Block("in_proj_weight", 0, 0, 3), Block("in_proj_weight", 0, 1, 3),
               when=lambda m: _is_torch_mha(m) and m._qkv_same_embed_dim),
        Layout("torch MultiheadAttention (kdim/vdim)", Block("q_proj_weight"), Block("k_proj_weight"),
               when=lambda m: _is_torch_mha(m) and not m._qkv_same_embed_dim,
               q_bias=Block("in_proj_bias", 0, 0, 3), k_bias=Block("in_proj_bias", 0, 1, 3)))),
    # QK-norm: Qwen3, OLMo2, Cohere, Gemma3 (q_norm/k_norm), StableLM, Phi, LFM2 (q_layernorm/k_layernorm), HunYuan
    # (query_layernorm/key_layernorm), Idefics (q_layer_norm/k_layer_norm), Llama 4 (qk_norm, both at once)
    Family("Llama, Mistral, Qwen, OPT, ... (q_proj/k_proj)", qk_children=(("q_proj", "k_proj"),), layouts=(
        Layout("q_proj/k_proj Linear", Block("q_proj.weight"), Block("k_proj.weight"),
               when=lambda m: _children_are(m, ("q_proj", "k_proj"), _is_linear)),),
        qk_norms=("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm",
                  "q_layer_norm", "k_layer_norm", "qk_norm", "qk_layernorm"),
        key_norms=("k_norm", "k_layernorm", "key_layernorm", "k_layer_norm")),
    Family("BERT, RoBERTa, HF ViT, ... (query/key)", qk_children=(("query", "key"),), layouts=(
        Layout("query/key Linear", Block("query.weight"), Block("key.weight"),
               when=lambda m: _children_are(m, ("query", "key"), _is_linear)),)),
    # short or model-specific child names: only on a module whose class says it is attention
    Family("T5, MPNet, LongT5, UMT5 (q/k)", qk_children=(("q", "k"),), layouts=(
        Layout("q/k Linear", Block("q.weight"), Block("k.weight"),
               when=lambda m: _is_attention(m) and _children_are(m, ("q", "k"), _is_linear)),)),
    Family("DistilBERT, XLM, FlauBERT (q_lin/k_lin)", qk_children=(("q_lin", "k_lin"),), layouts=(
        Layout("q_lin/k_lin Linear", Block("q_lin.weight"), Block("k_lin.weight"),
               when=lambda m: _is_attention(m) and _children_are(m, ("q_lin", "k_lin"), _is_linear)),)),
    Family("DeBERTa-v2, SEW-D, ProphetNet (query_proj/key_proj)", qk_children=(("query_proj", "key_proj"),), layouts=(
        Layout("query_proj/key_proj Linear", Block("query_proj.weight"), Block("key_proj.weight"),
               when=lambda m: _is_attention(m) and _children_are(m, ("query_proj", "key_proj"), _is_linear)),)),
    # a bias-free qkv Linear, its query bias a parameter beside it (the key bias a zero buffer)
    Family("timm BEiT, EVA", qk_biases=("q_bias", "k_bias"), layouts=(
        Layout("fused qkv Linear + q_bias", Block("qkv.weight", 0, 0, 3), Block("qkv.weight", 0, 1, 3),
               when=lambda m: _children_are(m, ("qkv",), _is_linear) and m.qkv.bias is None
               and isinstance(getattr(m, "q_bias", None), nn.Parameter), q_bias=Block("q_bias")),)),
    # timm's Attention with qk_norm=True (q_norm/k_norm); MViTv2's norm_q, a LayerNorm per head of its pooled queries
    Family("timm ViT, Swin, MViTv2, ... (qkv)", layouts=(
        Layout("fused qkv Linear", Block("qkv.weight", 0, 0, 3), Block("qkv.weight", 0, 1, 3),
               when=lambda m: _children_are(m, ("qkv",), _is_linear)),),
        qk_norms=("q_norm", "k_norm", "norm_q"), key_norms=("k_norm",)),
    # Wqkv rows [q | k | v] in equal thirds; DBRX: split by its declared key/value heads
    Family("MPT, ModernBERT, DBRX (Wqkv)", layouts=(
        Layout("fused Wqkv Linear", Block("Wqkv.weight", 0, 0, 3), Block("Wqkv.weight", 0, 1, 3),
               when=lambda m: _is_attention(m) and _children_are(m, ("Wqkv",), _is_linear)),)),
    Family("GPT-2 (Conv1D c_attn, cross-attention q_attn)", layouts=(
        Layout("GPT-2 c_attn Conv1D", Block("c_attn.weight", 1, 0, 3), Block("c_attn.weight", 1, 1, 3),
               when=lambda m: _children_are(m, ("c_attn",), _is_conv1d) and getattr(m, "q_attn", None) is None),
        Layout("GPT-2 cross-attention q_attn + c_attn Conv1D", Block("q_attn.weight", 1),
               Block("c_attn.weight", 1, 0, 2), when=lambda m: _children_are(m, ("q_attn", "c_attn"), _is_conv1d)))),
    # q|k|v interleaved per key/value head (Block(..., interleaved=True)), as their forwards split it:
    # view(..., H, 3 * r) then thirds of the last axis (GPT-NeoX, GPT-NeoX-Japanese), view(..., H, 3, r) (Bloom,
    # Persimmon), and Falcon's three forms: unflatten(-2, (H, 3)) (original), view(..., H_kv, -1, r) with each group's
    # query heads, then its key, then its value (new_decoder_architecture), split([H, 1, 1]) (multi_query: one group).
    # In every case group g of the module's own num_kv_heads (H where it declares none) is [its H/H_kv query heads,
    # k_g, v_g]. Persimmon normalizes q and k (q_layernorm/k_layernorm).
    Family("GPT-NeoX (Pythia), GPT-NeoX-Japanese, Bloom, Persimmon, Falcon",
           classes=("GPTNeoXAttention", "GPTNeoXJapaneseAttention", "BloomAttention", "PersimmonAttention",
                    "FalconAttention"),
           layouts=(Layout("interleaved query_key_value", Block("query_key_value.weight", 0, 0, 3, interleaved=True),
                           Block("query_key_value.weight", 0, 1, 3, interleaved=True),
                           when=lambda m: _children_are(m, ("query_key_value",), _is_linear)),),
           qk_norms=("q_layernorm", "k_layernorm"), key_norms=("k_layernorm",)),
    # c_attn is an nn.Linear (not GPT-2's Conv1D) that its forward splits per head, view(..., H, 3 r) then thirds of
    # the last axis ([q_h, k_h, v_h] at 3 h r), or, with multi_query, as [q | k | v] with one key/value head (its
    # num_key_value_groups is H): the interleave above with H_kv = H or one group
    Family("GPTBigCode (StarCoder, SantaCoder)", classes=("GPTBigCodeAttention",), layouts=(
        Layout("GPTBigCode c_attn Linear", Block("c_attn.weight", 0, 0, 3, interleaved=True),
               Block("c_attn.weight", 0, 1, 3, interleaved=True),
               when=lambda m: not getattr(m, "is_cross_attention", False)
               and _children_are(m, ("c_attn",), _is_linear)),)),
    # DeBERTa v1: in_proj(x).view(..., H, 3 r).chunk(3): [q_h, k_h, v_h] per head (DeBERTa-v2's class of the same
    # name has query_proj/key_proj and no in_proj); its query bias is q_bias beside the bias-free in_proj. Both pair
    # relative positions with the queries or keys through projections of their own: pos_proj/pos_q_proj (v1),
    # pos_key_proj/pos_query_proj (v2; absent with share_att_key, where the position terms go through the converted
    # projections themselves)
    Family("DeBERTa (v1, v2)", classes=("DisentangledSelfAttention",), layouts=(
        Layout("DeBERTa in_proj Linear", Block("in_proj.weight", 0, 0, 3, interleaved=True),
               Block("in_proj.weight", 0, 1, 3, interleaved=True),
               when=lambda m: _children_are(m, ("in_proj",), _is_linear), q_bias=Block("q_bias")),),
        position_projections=("pos_proj", "pos_q_proj", "pos_key_proj", "pos_query_proj")),
    # qkv_proj is mp_num (4) equal groups, each [q | v | k]; its forward takes the query (key) features group by
    # group, then heads of head_dim consecutive features: the query is slice 0 and the key slice 2 of every group
    Family("CodeGen", classes=("CodeGenAttention",), layouts=(
        Layout("CodeGen qkv_proj", Block("qkv_proj.weight", 0, 0, 3, groups="mp_num"),
               Block("qkv_proj.weight", 0, 2, 3, groups="mp_num"),
               when=lambda m: _children_are(m, ("qkv_proj",), _is_linear)),)),
    # converted, but a query gain is not their logits' factor
    Family("DBRX, OLMo (clip_qkv)", gain_caveat=_clamps_qkv),
    Family("SwinV2 (timm, torchvision, HF), Swin2SR (cosine attention)", gain_caveat=_cosine_attention),
    # refused though a built-in layout matches their names. Attention over channels, not tokens: the forward
    # reshapes the fused qkv rows per head like token attention but takes each head's logits between its q and k
    # channels (a C_h x C_h matrix over the tokens)
    Family("timm XCiT, EdgeNeXt, DaViT, HF Florence-2 vision (channel attention)",
           classes=("XCA", "CrossCovarianceAttn", "ChannelAttention", "ChannelAttentionV2",
                    "Florence2VisionChannelAttention"),
           refusal="it attends over channels, not tokens (each head's logits are its q channels against its k "
                   "channels across the tokens), so the rows of {param} are no per-token query/key frames"),
    # q @ (softmax(k over tokens)^T v), no query-key logits
    Family("timm CoaT (factorized attention)", classes=("FactorAttnConvRelPosEnc",),
           refusal="it computes factorized attention, q (softmax over the tokens of k)^T v, which has no query-key "
                   "logits for frames to shape"),
    Family("timm EfficientFormer, TinyViT (q|k|v split per head by key_dim/val_dim)", refusal=_split_per_head),
    # matching no layout: what to do instead
    Family("geoopt_stiefel_attention's EuclideanMultiheadAttention", hint=_euclidean_module),
    Family("timm LeViT, EfficientFormerV2 (BatchNorm after the query/key projection)", hint=_normalized_projection),
    # adapter layers: a projection held as their base_layer computes W x + (its update), outside the frames
    Family("PEFT adapter layers (LoRA, DoRA, IA3, ...)", adapter_child="base_layer", adapter_package="peft.tuners"),
)


# ---------------------------------------------------------------------------------------------- lookups
@dataclass(frozen=True)
class _Index:
    """What the converter reads from one table: the union of its entries' names, in table order."""

    layouts: tuple[Layout, ...]
    qk_children: tuple[tuple[str, str], ...]
    qk_norms: tuple[str, ...]
    key_norms: frozenset[str]
    position_projections: tuple[str, ...]
    q_biases: tuple[str, ...]
    k_biases: tuple[str, ...]
    adapter_children: tuple[str, ...]


_INDEXED: list[Any] = [None, None]  # (the table last indexed, its _Index)


def _union(values: Any) -> tuple:
    return tuple(dict.fromkeys(v for v in values if v is not None))


def index() -> _Index:
    """The lookups of the current :data:`FAMILIES` (rebuilt when the table is replaced)."""
    if _INDEXED[0] is not FAMILIES:
        t = FAMILIES
        _INDEXED[:] = [t, _Index(
            layouts=tuple(lay for f in t for lay in f.layouts),
            qk_children=_union(p for f in t for p in f.qk_children),
            qk_norms=_union(n for f in t for n in f.qk_norms),
            key_norms=frozenset(n for f in t for n in f.key_norms),
            position_projections=_union(n for f in t for n in f.position_projections),
            q_biases=_union(f.qk_biases[0] for f in t if f.qk_biases is not None),
            k_biases=_union(f.qk_biases[1] for f in t if f.qk_biases is not None),
            adapter_children=_union(f.adapter_child for f in t))]
    return _INDEXED[1]


def builtin_layouts() -> tuple[Layout, ...]:
    """The layouts of :data:`FAMILIES`, in table order (what ``targets="auto"`` searches)."""
    return index().layouts


def refusal(module: nn.Module, layout: Layout) -> str | None:
    """The first family's reason (table order) why ``module``, matched by the built-in ``layout`` by its names, must
    not be converted; ``None`` when none refuses it."""
    return next((why for f in FAMILIES if (why := f.refuses(module, layout)) is not None), None)


def hint(module: nn.Module) -> str | None:
    """The first family's hint (table order) for ``module``, which matched no layout; ``None`` when none has one."""
    return next((text for f in FAMILIES if (text := f.hints(module)) is not None), None)


def gain_caveats(module: nn.Module) -> list[str]:
    """The families' reasons (table order) why a query gain of ``module`` is not its logits' factor, beyond its
    query/key norms and position projections."""
    return [why for f in FAMILIES if f.gain_caveat is not None and (why := f.gain_caveat(module)) is not None]


def adapted_child(wrapper: nn.Module) -> str | None:
    """The name of the child module that ``wrapper``, an adapter layer, adapts (PEFT's ``base_layer``), or ``None``
    when ``wrapper`` holds no module under an adapter library's name."""
    return next((n for n in index().adapter_children if isinstance(wrapper._modules.get(n), nn.Module)), None)


def adapter_name(wrapper: nn.Module) -> str:
    """``lora.Linear`` for PEFT's ``peft.tuners.lora.layer.Linear`` (the name PEFT prints), else the class name."""
    module, name = type(wrapper).__module__, type(wrapper).__name__
    parts = module.split(".")
    for package in _union(f.adapter_package for f in FAMILIES):
        prefix = package.split(".")
        if len(parts) > len(prefix) and parts[:len(prefix)] == prefix:
            return f"{parts[len(prefix)]}.{name}"
    return name


#: The built-in layouts (those of :data:`FAMILIES` when the package was imported), tried in this order; the first
#: that matches a module converts it.
LAYOUTS: tuple[Layout, ...] = builtin_layouts()
