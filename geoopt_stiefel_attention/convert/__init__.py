r"""Put the query/key projections of an existing model on the Stiefel manifold, in place.

Conversion is data: :data:`LAYOUTS` is one table of attention layouts, each entry (a :class:`Layout`) saying
in which parameter the query rows and the key rows live, along which axis, and in which slice of a fused
projection. :func:`stiefelize` walks the model, gives every module to the first layout that matches it, and
registers a :mod:`torch.nn.utils.parametrize` parametrization on each weight that holds query or key rows.
The parametrization rebuilds that weight from ``(heads, d, r)`` frames, :class:`geoopt.ManifoldParameter` s
on :class:`~geoopt_stiefel_attention.PolarStiefel`, plus the untouched rest of the tensor (the value block
of a fused projection), so the host model's forward code runs unchanged: it reads ``module.weight`` as
before and gets

.. math::

    W_Q = \big[\,\gamma_1 U_{Q,1},\ \dots,\ \gamma_H U_{Q,H}\,\big]^\top, \qquad
    W_K = \big[\,U_{K,1},\ \dots,\ U_{K,H_{kv}}\,\big]^\top, \qquad U^\top U = I_r,

in the ``(out, in)`` layout of :class:`torch.nn.Linear` (transposed for GPT-2's ``Conv1D``, which stores
``(in, out)``). :math:`\gamma_h` is an optional per-head logit gain (see :func:`stiefelize`); biases stay
free parameters.

The state dict of a converted model is the stock model's: a state-dict post hook on every module owning a
converted weight stores that weight under its stock key, rebuilt as above, and a load-state-dict pre hook
maps a stock entry back onto the frames (the polar factor of each head block, the query gain from its
scale), so ``save_pretrained`` writes a checkpoint the stock class loads. :func:`parametrized_state_dict`
gives the frames as stored (exact resume), :func:`export_state_dict` the stock dict, checked, and
:func:`unstiefelize` removes the parametrizations in place.

One job per module: ``layouts`` (the table), ``parametrization`` (what is registered on a weight),
``checkpoints`` (state dicts, export, undoing a conversion); this module plans and applies a
conversion (:func:`stiefelize`) and re-exports the others' public names (``__all__``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .. import distributed as _distributed
from .._linalg import ORTHONORMALITY_TOLERANCE, orthonormality_error
from ..integrations.adapters import _ADAPTER_REASON, _adapter_name
from ..integrations.optimizers import watch
from ..manifolds import is_frame
from .checkpoints import (
    _hook_state_dicts,
    _stock_names,
    converted_query_key_frames,
    export_state_dict,
    parametrized_state_dict,
    unstiefelize,
)
from .layouts import (
    HEAD_DIM_ATTRS,
    KV_GROUPS_ATTRS,
    KV_HEADS_ATTRS,
    LAYOUTS,
    NUM_HEADS_ATTRS,
    Block,
    Layout,
    _children_are,
    _is_linear,
    _is_torch_mha,
    _normalized_projection,
    _not_token_attention,
)
from .parametrization import (
    _MARK,
    _frames_from,
    _get,
    _owner,
    _QKWeight,
    _watch_model,
    _ZeroQKBias,
)

__all__ = [
    "Block",
    "Layout",
    "LAYOUTS",
    "ConvertedAttention",
    "ConversionResult",
    "stiefelize",
    "unstiefelize",
    "export_state_dict",
    "parametrized_state_dict",
    "converted_query_key_frames",
]

#: Default multiplier of the log-gain: :math:`\gamma_h = \exp(\text{rate}\cdot\theta_h)`.
GAIN_RATE = 10.0

#: Accepted values of ``logit_gain`` and ``qk_bias``.
GAIN_MODES = (None, "learn", "fit")
BIAS_MODES = ("keep", "drop")



# ---------------------------------------------------------------------------------------------- the result
@dataclass(frozen=True)
class ConvertedAttention:
    r"""One converted attention module (a row of the :class:`ConversionResult`).

    Attributes
    ----------
    path : str
        The module's path in ``model.named_modules()`` (``""`` for the model itself).
    layout : str
        Name of the :class:`Layout` that converted it.
    q_heads, k_heads : int
        Query frames :math:`H` and key frames :math:`H_{kv}` (fewer under grouped-query attention).
    d_q, d_k : int
        Input widths: query frames lie in :math:`\mathrm{St}(d_q, r)`, key frames in :math:`\mathrm{St}(d_k, r)`.
    r : int
        Head size.
    logit_gain : str
        ``"none"``, ``"learn (1)"``, ``"learn (kept from the weights: min..max)"`` (the gains a converted model
        saved, see :func:`stiefelize`) or ``"fit (min..max)"`` (the fitted gains' range).
    """

    path: str
    layout: str
    q_heads: int
    k_heads: int
    d_q: int
    d_k: int
    r: int
    logit_gain: str

    def __str__(self) -> str:
        heads = f"{self.q_heads}" if self.q_heads == self.k_heads else f"{self.q_heads}/{self.k_heads}"
        return (f"{self.path or '<root>'}: {self.layout}, heads q/kv {heads}, q in St({self.d_q}, {self.r}), "
                f"k in St({self.d_k}, {self.r}), logit gain {self.logit_gain}")


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`stiefelize` did. ``str(result)`` is a readable summary; iterate for the rows.

    Attributes
    ----------
    converted : tuple of ConvertedAttention
        One row per converted attention module, in ``named_modules()`` order.
    skipped : tuple of (path, reason)
        Modules that look like attention and were left unchanged (only with ``strict=False``).
    output_change : float or None
        :math:`\\|y_\\text{after} - y_\\text{before}\\|_F / \\|y_\\text{before}\\|_F` on the probe batch, when
        ``probe`` was given and the ratio is defined; ``None`` without a probe, or when the output before
        conversion is zero or not finite (``str(result)`` then says which, and gives the absolute change).
    output_change_abs : float or None
        :math:`\\|y_\\text{after} - y_\\text{before}\\|_F`, when ``probe`` was given.
    output_norm_before : float or None
        :math:`\\|y_\\text{before}\\|_F`, when ``probe`` was given (zero, for example, for a model whose head is
        initialised to zero, as torchvision's ViT is).
    """

    converted: tuple[ConvertedAttention, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    output_change: float | None = None
    output_change_abs: float | None = None
    output_norm_before: float | None = None

    @property
    def num_frames(self) -> int:
        """Number of frames created (query heads plus key heads)."""
        return sum(c.q_heads + c.k_heads for c in self.converted)

    def __len__(self) -> int:
        return len(self.converted)

    def __iter__(self):
        return iter(self.converted)

    def __str__(self) -> str:
        lines = [f"stiefelize: {len(self.converted)} attention module(s) converted, {self.num_frames} frames"]
        lines += [f"  {c}" for c in self.converted]
        lines += [f"  skipped {_where(p)}: {why}" for p, why in self.skipped]
        if self.output_change is not None:
            lines.append(f"  relative output change on the probe batch: {self.output_change:.3g}")
        elif self.output_norm_before is not None:
            why = "zero" if self.output_norm_before == 0 else f"not finite (norm {self.output_norm_before})"
            lines.append(f"  relative output change on the probe batch undefined: the output before conversion is "
                         f"{why}; absolute change {self.output_change_abs:.3g}")
        return "\n".join(lines)

# ---------------------------------------------------------------------------------------------- planning
@dataclass
class _Piece:
    role: str
    owner: nn.Module
    attr: str
    dim: int
    start: int
    length: int
    d: int
    heads: int
    groups: int = 1  # > 1: start/length are the range within each of `groups` equal groups (interleaved q|k|v)


@dataclass
class _Site:
    path: str
    module: nn.Module
    layout: Layout
    r: int
    q: _Piece
    k: _Piece
    bias_spans: list[tuple[nn.Module, str, int, int]]  # the query/key bias entries qk_bias="drop" holds at zero
    split: str = ""  # how a fused weight was split by declared heads (shown in the result's layout)
    # the query/key bias (see _bias_spans): None where there is none, a sentence where it cannot be located
    q_bias: list[tuple[nn.Module, str, int, int]] | str | None = None
    k_bias: list[tuple[nn.Module, str, int, int]] | str | None = None


class _Refusal(ValueError):
    pass


def _explicit_head_dim(module: nn.Module, layout: Layout) -> Any:
    """The head size the layout or the module states (``layout.head_dim``, else the first int attribute among
    :data:`HEAD_DIM_ATTRS`); ``None`` when neither states one."""
    spec = layout.head_dim
    if callable(spec):
        return spec(module)
    if isinstance(spec, str):
        return getattr(module, spec, None)
    if spec is not None:
        return spec
    return next((getattr(module, a) for a in HEAD_DIM_ATTRS if _is_count(getattr(module, a, None))), None)


def _declared(module: nn.Module, names: Sequence[str]) -> tuple[int, str] | tuple[None, None]:
    """The first int count among ``names`` on ``module``, then on ``module.config``, with where it was read."""
    for source, where in ((module, ""), (getattr(module, "config", None), "config.")):
        for a in names:
            value = getattr(source, a, None)
            if _is_count(value):
                return int(value), where + a
    return None, None


def _head_dim(module: nn.Module, layout: Layout, q_width: int) -> int:
    value = _explicit_head_dim(module, layout)
    if value is None and layout.head_dim is None:
        heads, _ = _declared(module, NUM_HEADS_ATTRS)
        if heads is not None:
            if q_width % heads:
                raise _Refusal(f"the query width {q_width} is not divisible by num_heads={heads}")
            value = q_width // heads
    if not _is_count(value):
        raise _Refusal(f"cannot tell its head size (looked for an int attribute among {HEAD_DIM_ATTRS}, then "
                       f"{NUM_HEADS_ATTRS} on the module and its config; got {value!r}); pass "
                       f"targets=[Layout({layout.name!r}, q=..., k=..., head_dim=<int or attribute name>)]")
    return int(value)


def _kv_heads(module: nn.Module, heads: int) -> tuple[int, str] | tuple[None, None]:
    """The key/value heads ``module`` declares (:data:`KV_HEADS_ATTRS`, else ``heads`` over one of
    :data:`KV_GROUPS_ATTRS`), each looked for on the module first, then on its config."""
    for source, where in ((module, ""), (getattr(module, "config", None), "config.")):
        for a in KV_HEADS_ATTRS:
            value = getattr(source, a, None)
            if _is_count(value):
                return int(value), where + a
        for a in KV_GROUPS_ATTRS:
            value = getattr(source, a, None)
            if _is_count(value) and heads % value == 0:
                return heads // int(value), f"{where}{a}={value}"
    return None, None


def _fused_blocks(module: nn.Module, layout: Layout) -> tuple[Block, Block, str]:
    """The query and key blocks of ``module`` and a note on how they were found.

    A layout whose query and key are equal slices of one weight (``part``/``parts``, a fused q|k|v) assumes as
    many key heads as query heads. Where the module declares its heads, that is checked against the weight's
    width: under grouped-query attention (fewer key/value heads declared) the query and key rows are taken by
    the declared counts instead (q|k|v order, ``part`` 0 and 1 of 3), and a width that fits neither is refused."""
    qb, kb = layout.q, layout.k
    if not (qb.param == kb.param and qb.span is None and kb.span is None and qb.parts == kb.parts > 1
            and qb.dim == kb.dim):
        return qb, kb, ""
    heads, heads_at = _declared(module, NUM_HEADS_ATTRS)
    if heads is None:
        return qb, kb, ""  # nothing declared to check against: the layout's equal slices
    try:
        w = _get(module, qb.param)
    except AttributeError:
        return qb, kb, ""
    width = int(w.shape[qb.dim])
    r = _explicit_head_dim(module, layout)
    r = int(r) if _is_count(r) else None
    kv, kv_at = _kv_heads(module, heads)
    axis = "rows" if qb.dim == 0 else "columns"
    if kv is None or kv == heads:
        if r is not None and width != qb.parts * heads * r:
            raise _Refusal(f"{qb.param} has {width} {axis}, not {qb.parts} equal parts of {heads_at}={heads} heads of "
                           f"size {r} ({qb.parts * heads * r}), so its query/key rows cannot be told apart; pass "
                           f"targets=[Layout({layout.name!r}, q=Block({qb.param!r}, span=(start, stop)), "
                           f"k=Block({kb.param!r}, span=(start, stop)), head_dim={r})] with the module's actual rows")
        return qb, kb, ""
    if r is None:
        r = width // (heads + 2 * kv) if width % (heads + 2 * kv) == 0 else None
    fix = (f"pass targets=[Layout({layout.name!r}, q=Block({qb.param!r}, span=(start, stop)), "
           f"k=Block({kb.param!r}, span=(start, stop)){'' if r is None else f', head_dim={r}'})] with the "
           f"module's actual query and key {axis}")
    if (qb.part, kb.part, qb.parts) != (0, 1, 3):
        raise _Refusal(f"it declares {kv_at}={kv} key/value heads for {heads_at}={heads} query heads, so "
                       f"{qb.param} is not {qb.parts} equal parts as the layout says; {fix}")
    if r is None or width != (heads + 2 * kv) * r:
        size = "of an undeclared size" if r is None else f"of size {r}"
        raise _Refusal(f"{qb.param} has {width} {axis}, which is not q|k|v for the {heads_at}={heads} query and "
                       f"{kv_at}={kv} key/value heads {size} that it declares ((H + 2 H_kv) r rows), so its "
                       f"query/key rows cannot be told apart; {fix}")
    q_span, k_span = (0, heads * r), (heads * r, (heads + kv) * r)
    return (Block(qb.param, qb.dim, span=q_span), Block(kb.param, kb.dim, span=k_span),
            f" (grouped-query split: q {axis} {q_span[0]}:{q_span[1]}, k {axis} {k_span[0]}:{k_span[1]})")


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _piece(module: nn.Module, block: Block, role: str, where: tuple[int, int, int] | None = None) -> _Piece:
    """The planned piece of one block; ``where`` is ``(start, length, groups)`` of an interleaved block (resolved
    by :func:`_interleaved_grid`), ``None`` for a block located by its own ``part``/``parts`` or ``span``."""
    owner, attr = _owner(module, block.param)
    if parametrize.is_parametrized(owner, attr):
        raise _Refusal(f"{block.param} is already parametrized "
                       f"({type(owner.parametrizations[attr][0]).__name__}); "
                       f"call unstiefelize(model) first if it was stiefelized")
    w = getattr(owner, attr)
    if not isinstance(w, nn.Parameter) or not torch.is_floating_point(w):
        raise _Refusal(f"{block.param} is not a floating-point nn.Parameter ({type(w).__name__}, "
                       f"{getattr(w, 'dtype', None)}); quantized or buffer weights cannot hold frames")
    if where is not None:
        start, length, groups = where
    else:
        try:
            start, length = block.locate(w.shape[block.dim])
        except ValueError as err:
            raise _Refusal(str(err)) from None
        groups = 1
    return _Piece(role, owner, attr, block.dim, start, length, int(w.shape[1 - block.dim]), 0, groups)


#: Parameter names of query/key biases kept apart from the projection weights (timm's BEiT/EVA attention).
_QK_BIAS_NAMES = ("q_bias", "k_bias")


def _split_bias(given: Block | None, block: Block, declared: Block) -> Block | None:
    """A layout's own bias Block, moved to the span of its weight's block when :func:`_fused_blocks` split that
    weight by declared heads and the bias was given as the same equal slice (``part``/``parts``)."""
    if given is None or block is declared or given.span is not None or (given.part, given.parts) != (
            declared.part, declared.parts):
        return given
    return Block(given.param, given.dim, span=block.span)


def _interleaved_grid(module: nn.Module, layout: Layout) -> tuple[int, int, int]:
    r"""``(H, H_kv, r)`` of a module whose layout's query/key blocks are interleaved (``Block(...,
    interleaved=True)``), from what it declares (:data:`NUM_HEADS_ATTRS`, :data:`KV_HEADS_ATTRS` or
    :data:`KV_GROUPS_ATTRS`, :data:`HEAD_DIM_ATTRS` or ``layout.head_dim``, on the module, then on its config)
    and the width of the fused weight; :math:`H_{kv} = H` when it declares no key/value heads. Refused when
    they cannot be told, or the weight is not :math:`H_{kv}(H/H_{kv} + \text{parts} - 1)\,r` wide, or the
    query is not slice 0 of each group under grouped-query attention (:meth:`Block.locate_interleaved`)."""
    qb, kb = layout.q, layout.k
    w = _get(module, qb.param)
    width = int(w.shape[qb.dim])
    axis = "rows" if qb.dim == 0 else "columns"
    heads, heads_at = _declared(module, NUM_HEADS_ATTRS)
    r = _explicit_head_dim(module, layout)
    if r is not None and not _is_count(r):
        raise _Refusal(f"its head size is {r!r}, not a positive int")
    kv, kv_at = _kv_heads(module, heads) if heads is not None else (None, None)
    if heads is None:
        if r is None or kv is not None or width % (qb.parts * r):
            raise _Refusal(f"cannot tell how {qb.param} interleaves its heads (looked for an int attribute among "
                           f"{NUM_HEADS_ATTRS} and {HEAD_DIM_ATTRS} on the module and its config); pass "
                           f"targets=[Layout({layout.name!r}, q=..., k=..., head_dim=<int>)] on a module that "
                           f"declares its number of heads")
        heads, heads_at = width // (qb.parts * r), f"{width} {axis} / ({qb.parts} r)"
    if kv is None:
        kv, kv_at = heads, "as many key/value heads as query heads"
    else:
        kv_at = f"{kv_at}={kv}"
    if heads % kv:
        raise _Refusal(f"{heads_at}={heads} query heads cannot share {kv_at} key/value heads in equal groups")
    slots = heads // kv + qb.parts - 1
    if r is None:
        if width % (kv * slots):
            raise _Refusal(f"{qb.param} has {width} {axis}, not {kv} group(s) of {slots} heads of one size "
                           f"({heads_at}={heads}, {kv_at}), so its query/key {axis} cannot be told apart")
        r = width // (kv * slots)
    if heads > kv and (qb.part != 0 or kb.part == 0):
        raise _Refusal(f"under grouped-query attention ({heads_at}={heads}, {kv_at}) the query {axis} of each "
                       f"key/value head's group are its slice 0 (the group's {heads // kv} query heads), but the "
                       f"layout gives the query as part {qb.part} and the key as part {kb.part}")
    try:
        qb.locate_interleaved(width, heads, kv, int(r))
    except ValueError as err:
        raise _Refusal(f"{err} for the heads it declares ({heads_at}={heads}, {kv_at}), so its query/key {axis} "
                       f"cannot be told apart") from None
    return heads, kv, int(r)


def _block_groups(module: nn.Module, block: Block) -> int:
    """The number of groups of a block of every group (``Block(..., groups=)``): the int, or the module's int
    attribute it names; refused when the module has no such attribute."""
    if _is_count(block.groups):
        return int(block.groups)
    value = getattr(module, block.groups, None)
    if not _is_count(value):
        raise _Refusal(f"its {block.param} is read in groups={block.groups!r} groups, but the module's "
                       f"{block.groups} is {value!r}, not a positive int; pass targets=[Layout(..., q=Block("
                       f"{block.param!r}, ..., groups=<int>), k=...)] with the number of groups its forward uses")
    return int(value)


def _interleaved_tensors(model: nn.Module) -> dict[int, tuple[Tensor, str, nn.Module, Layout]]:
    """``id(parameter) -> (parameter, path, module, layout)`` for the fused weight (and its bias) of every module
    of ``model`` that a built-in interleaved layout (q|k|v per key/value head) or grouped layout (``groups=``, the
    same slices in every group) matches and whose rows are not one plain q|k|v (more than one group; a module
    whose heads or groups cannot be told counts as interleaved)."""
    found: dict[int, tuple[Tensor, str, nn.Module, Layout]] = {}
    interleaved = [lay for lay in LAYOUTS if lay.q.interleaved or lay.q.groups is not None]
    for path, module in model.named_modules():
        layout = _first_match(interleaved, module)
        if layout is None:
            continue
        try:
            groups = (_interleaved_grid(module, layout)[1] if layout.q.interleaved
                      else _block_groups(module, layout.q))
            if groups == 1:
                continue  # one group: [q | k | v], which a span or the declared-heads split reads correctly
        except _Refusal:
            pass
        for block in (layout.q, layout.q.bias_block()):
            try:
                t = _get(module, block.param)
            except AttributeError:
                continue
            if isinstance(t, nn.Parameter):  # a parametrized weight reads as a new tensor each time: not held
                found[id(t)] = (t, path, module, layout)
    return found


def _refuse_slices_of_interleaved(module: nn.Module, layout: Layout, qk_bias: str,
                                  interleaving: dict[int, tuple[Tensor, str, nn.Module, Layout]]) -> None:
    """Refuse a block given as a range of the whole axis (``part``/``parts`` or ``span``) of a tensor that holds
    q|k|v interleaved per head (:func:`_interleaved_tensors`): its equal slices are not the query/key rows."""
    blocks = [("query", layout.q), ("key", layout.k)]
    if qk_bias == "drop":
        blocks += [("query bias", layout.q_bias or layout.q.bias_block()),
                   ("key bias", layout.k_bias or layout.k.bias_block())]
    for role, block in blocks:
        try:
            t = _get(module, block.param)
        except AttributeError:
            continue
        held = interleaving.get(id(t))
        if held is None or held[0] is not t:
            continue
        _, where, owner, builtin = held
        reading = ("reads a range of the whole axis" if block.groups is None and not block.interleaved
                   else "reads other groups")
        if builtin.q.interleaved:
            if block.interleaved:
                continue
            raise _Refusal(
                f"its {role} block {block.describe()} {reading}, while {block.param} holds "
                f"q|k|v interleaved per head ({type(owner).__name__} at {_where(where)}, built-in layout "
                f"{builtin.name!r}: q = {builtin.q.describe()}, k = {builtin.k.describe()}), so those are not its "
                f"{role} rows and the conversion would be silently wrong; leave the module to the built-in table "
                f"(targets='auto', or targets=(*LAYOUTS, ...)), or describe the interleave: Block({block.param!r}, "
                f"{block.dim}, part, 3, interleaved=True) with part 0 for the query and 1 for the key")
        # a grouped built-in (the same slices in each of G groups): only a block of the same groups reads its rows
        try:
            same = block.groups is not None and _block_groups(module, block) == _block_groups(owner, builtin.q)
        except _Refusal:
            same = False
        if same:
            continue
        try:
            count = _block_groups(owner, builtin.q)
            count = f"{builtin.q.groups}={count}" if isinstance(builtin.q.groups, str) else f"{count}"
        except _Refusal:
            count = f"{builtin.q.groups}"
        raise _Refusal(
            f"its {role} block {block.describe()} {reading}, while {block.param} holds {builtin.q.parts} slices in "
            f"each of its {count} groups ({type(owner).__name__} at {_where(where)}, built-in layout "
            f"{builtin.name!r}: q = {builtin.q.describe()}, k = {builtin.k.describe()}), so those are not its "
            f"{role} rows and the conversion would be silently wrong; leave the module to the built-in table "
            f"(targets='auto', or targets=(*LAYOUTS, ...)), or describe the groups: Block({block.param!r}, "
            f"{block.dim}, part, {builtin.q.parts}, groups={builtin.q.groups!r}) with part {builtin.q.part} for "
            f"the query and {builtin.k.part} for the key")


def _bias_spans(module: nn.Module, layout: Layout, role: str, block: Block, declared: Block,
                grid: tuple[int, int, int] | None, must: bool) -> list[tuple[nn.Module, str, int, int]] | None:
    """Where the ``role`` ("query"/"key") bias of a site lives: ``(owner, attr, start, length)`` spans, one per group
    of an interleaved or grouped block (in head order: span ``g`` holds the heads of group ``g``), or ``None`` when
    the module has no such bias. With ``must`` (``qk_bias="drop"``), a query/key bias kept where the layout does not
    look (timm BEiT/EVA: ``q_bias`` beside a bias-free ``qkv``) is refused: it would stay active."""
    bias_block = _split_bias(layout.q_bias if role == "query" else layout.k_bias, block, declared) or block.bias_block()
    try:
        b = _get(module, bias_block.param)
    except AttributeError:
        b = None
    if b is None:
        own = _QK_BIAS_NAMES[0] if role == "query" else _QK_BIAS_NAMES[1]
        elsewhere = [n for n, _ in module.named_parameters() if n.split(".")[-1] == own]
        if elsewhere:
            raise _Refusal(f"qk_bias='drop' looks for the {role} bias at {bias_block.param!r}, which it does not have, "
                           f"but it holds {elsewhere}; pass targets= with a Layout whose q_bias/k_bias Block names them"
                           if must else f"its {role} bias is not at {bias_block.param!r}, where the layout looks, but "
                           f"it holds {elsewhere}")
        return None
    if b.dim() != 1:
        raise _Refusal(f"{bias_block.param} has shape {tuple(b.shape)}; a bias is 1-D")
    try:
        if bias_block.interleaved:  # the same range in every key/value head's group
            if grid is None:
                raise ValueError(f"{bias_block.param}: an interleaved bias needs interleaved weight blocks")
            start, length, groups = bias_block.locate_interleaved(b.shape[0], *grid)
        elif bias_block.groups is not None:  # the same range in every group
            start, length, groups = bias_block.locate_grouped(b.shape[0], _block_groups(module, bias_block))
        else:
            (start, length), groups = bias_block.locate(b.shape[0]), 1
    except ValueError as err:
        raise _Refusal(str(err)) from None
    owner, attr = _owner(module, bias_block.param)
    step = b.shape[0] // groups
    return [(owner, attr, g * step + start, length) for g in range(groups)]


def _plan(path: str, module: nn.Module, layout: Layout, qk_bias: str,
          interleaving: dict[int, tuple[Tensor, str, nn.Module, Layout]] | None = None) -> _Site:
    if any(layout is builtin for builtin in LAYOUTS):  # a built-in layout matched it by names only
        why = _not_token_attention(module, layout)
        if why is not None:
            raise _Refusal(why)
    _refuse_slices_of_interleaved(module, layout, qk_bias, interleaving or {})
    grid = None
    if layout.q.interleaved:  # q|k|v per key/value head: ranges within each group (Layout checks k is too)
        grid = _interleaved_grid(module, layout)
        width = int(_get(module, layout.q.param).shape[layout.q.dim])
        q_block, k_block = layout.q, layout.k
        q = _piece(module, q_block, "q", q_block.locate_interleaved(width, *grid))
        k = _piece(module, k_block, "k", k_block.locate_interleaved(width, *grid))
        heads, kv, r = grid
        n = heads // kv
        if (q_block.part, k_block.part, q_block.parts) == (0, 1, 3):  # the result's layout says which form
            split = (" (q|k|v per head)" if n == 1 else f" (one group: q of {heads} heads | k | v)" if kv == 1
                     else f" (per key/value head: its {n} query heads | k | v)")
        else:
            split = f" ({kv} groups of {n + q_block.parts - 1} heads: q part {q_block.part}, k part {k_block.part})"
    elif layout.q.groups is not None:  # the same slices of each of G groups (Layout checks k is one too)
        q_block, k_block = layout.q, layout.k
        groups = _block_groups(module, q_block)
        width = int(_get(module, q_block.param).shape[q_block.dim])
        try:
            q_where, k_where = q_block.locate_grouped(width, groups), k_block.locate_grouped(width, groups)
        except ValueError as err:
            raise _Refusal(f"{err} ({q_block.groups}={groups})") from None
        q = _piece(module, q_block, "q", q_where)
        k = _piece(module, k_block, "k", k_where)
        r = _head_dim(module, layout, groups * q.length)
        axis = "rows" if q_block.dim == 0 else "columns"
        if q.length % r:
            heads = f"{groups * q.length // r} " if (groups * q.length) % r == 0 else ""
            raise _Refusal(f"its {heads}query heads of size {r} do not fit whole in the {q.length}-{axis[:-1]} "
                           f"query slice of each of the {groups} groups of {q_block.param} ({q_block.groups}="
                           f"{groups}): a head spanning two groups cannot be one frame, so it cannot be converted "
                           f"(pass strict=False to leave it Euclidean)")
        split = (f" ({groups} groups of {q_block.parts} slices: q slice {q_block.part}, k slice {k_block.part} "
                 f"of each)")
    else:
        q_block, k_block, split = _fused_blocks(module, layout)
        q = _piece(module, q_block, "q")
        k = _piece(module, k_block, "k")
        r = _head_dim(module, layout, q.length)
    for p, block in ((q, q_block), (k, k_block)):
        if p.length % r:
            raise _Refusal(f"{block.param}: {p.length} {'query' if p.role == 'q' else 'key'} features are not "
                           f"a whole number of heads of size {r}")
        p.heads = p.groups * p.length // r
        if r > p.d:
            raise _Refusal(f"a frame in St({p.d}, {r}) cannot exist: the head size {r} exceeds the input width "
                           f"{p.d} of {block.param}")
    if q.heads % k.heads:
        raise _Refusal(f"{q.heads} query heads cannot share {k.heads} key heads in equal groups")
    biases: list[Any] = []
    for role, block, declared in (("query", q_block, layout.q), ("key", k_block, layout.k)):
        try:
            biases.append(_bias_spans(module, layout, role, block, declared, grid, must=qk_bias == "drop"))
        except _Refusal as err:
            if qk_bias == "drop":
                raise
            biases.append(str(err))  # kept as it is; logit_gain="fit", which rescales it, says why it cannot
    for i, (p, role) in enumerate(((q, "query"), (k, "key"))):  # a bias holds one r-wide block per head
        if isinstance(biases[i], list) and sum(n for *_, n in biases[i]) != p.heads * r:
            found = sum(n for *_, n in biases[i])
            why = f"its {role} bias has {found} entries for {p.heads} heads of size {r}"
            if qk_bias == "drop":
                raise _Refusal(why)
            biases[i] = why
    q_bias, k_bias = biases
    spans = (q_bias or []) + (k_bias or []) if qk_bias == "drop" else []
    return _Site(path, module, layout, r, q, k, spans, split, q_bias, k_bias)


#: Names of query/key Linear children that mark a module as attention even when its class name does not say so.
_QK_CHILD_NAMES = (("to_q", "to_k"), ("wq", "wk"), ("w_q", "w_k"), ("q", "k"), ("query", "key"), ("q_proj", "k_proj"),
                   ("q_lin", "k_lin"), ("query_proj", "key_proj"))


def _qk_children(module: nn.Module) -> tuple[str, str] | None:
    """The first pair of query/key-like Linear children of ``module`` (``to_q``/``to_k``, ``wq``/``wk``, ...)."""
    return next((pair for pair in _QK_CHILD_NAMES if _children_are(module, pair, _is_linear)), None)


def _looks_like_attention(module: nn.Module) -> bool:
    if not ("attention" in type(module).__name__.lower() or isinstance(module, nn.MultiheadAttention)
            or _qk_children(module) is not None):
        return False
    params = list(module.parameters())
    return bool(params) and not any(is_frame(p) for p in params)


def _resolve_targets(targets: Any) -> tuple[tuple[Layout, ...] | None, Callable | None]:
    if isinstance(targets, str):
        if targets != "auto":
            raise ValueError(f"stiefelize: targets={targets!r} is unknown; pass 'auto', a sequence of Layout, or "
                             f"a callable (path, module) -> Layout | bool | None.")
        return LAYOUTS, None
    if isinstance(targets, Layout):
        return (targets,), None
    if callable(targets):
        return None, targets
    if isinstance(targets, Iterable):
        table = tuple(targets)
        bad = [t for t in table if not isinstance(t, Layout)]
        if not table or bad:
            raise ValueError(f"stiefelize: targets must be 'auto', Layout objects or a callable; got "
                             f"{bad[0] if bad else 'an empty sequence'!r}. Extend the built-ins with "
                             f"targets=(*LAYOUTS, Layout(...)).")
        return table, None
    raise ValueError(f"stiefelize: targets={targets!r} is invalid; pass 'auto', a sequence of Layout, or a "
                     f"callable (path, module) -> Layout | bool | None.")


def _first_match(table: Sequence[Layout], module: nn.Module) -> Layout | None:
    return next((lay for lay in table if lay.matches(module)), None)


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _tied(model: nn.Module, sites: list[_Site]) -> tuple[list[_Site], list[tuple[str, str]]]:
    """Split the planned sites into those whose converted tensors are each reachable under one name only, and the
    refusals of the others (``(path, why)``).

    A parametrization is registered on one module's attribute, so a Parameter shared with another module (tied
    weights: ``layers[1].q_proj.weight = layers[0].q_proj.weight``) would be rebuilt from frames in one place and
    resized under the other: refused before anything changes, naming every place it is held."""
    names: dict[int, list[str]] = {}  # a Parameter -> the (module, attribute) places holding it, by name
    for path, module in model.named_modules():  # a module reachable twice is one place (converted once)
        for attr, p in module._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{path}.{attr}" if path else attr)
    kept, problems = [], []
    for site in sites:
        targets = {(id(p.owner), p.attr): (p.owner, p.attr) for p in (site.q, site.k)}
        targets.update({(id(owner), attr): (owner, attr) for owner, attr, _, _ in site.bias_spans})
        shared: dict[int, str] = {}  # one entry per shared Parameter (a query weight tied to the key weight is one)
        for owner, attr in targets.values():
            held = names.get(id(getattr(owner, attr)), [])
            if len(held) > 1:
                shared[id(getattr(owner, attr))] = " and ".join(repr(n) for n in held)
        if shared:
            problems.append((site.path, f"its query/key tensor is one Parameter held under several names "
                                        f"({'; '.join(shared.values())}: tied weights), and a frame parametrization would "
                                        f"replace it under one name only; untie them first (e.g. "
                                        f"module.weight = nn.Parameter(module.weight.detach().clone()) under each "
                                        f"name but one)"))
        else:
            kept.append(site)
    return kept, problems


# ---------------------------------------------------------------------------------------------- public API
def stiefelize(
    model: nn.Module,
    *,
    targets: Any = "auto",
    logit_gain: str | None = None,
    qk_bias: str = "keep",
    strict: bool = True,
    probe: Any = None,
    gain_rate: float = GAIN_RATE,
) -> ConversionResult:
    r"""Put the query/key projections of every attention module of ``model`` on the Stiefel manifold, in place.

    For each attention module found, the query weight :math:`W_Q` (``H`` heads of size ``r``) and the key
    weight :math:`W_K` (``H_kv`` heads; ``H_kv < H`` under grouped-query attention) are replaced, head by
    head, by their polar factors :math:`U = A (A^\top A)^{-1/2}`, where :math:`A \in \mathbb{R}^{d\times r}`
    is the head's block (the closest frame in Frobenius norm). The frames become ``(H, d, r)`` and
    ``(H_kv, d, r)`` :class:`geoopt.ManifoldParameter` s on :class:`~geoopt_stiefel_attention.PolarStiefel`,
    and the original weight is rebuilt from them on every access by a :mod:`torch.nn.utils.parametrize`
    parametrization: the host module's forward code is not touched, so rotary embeddings, masks, KV caches
    and fused kernels see an ordinary weight. Value rows, output projections and biases stay ordinary
    parameters (``qk_bias="keep"``). Everything is planned and checked before anything is changed.

    **What changes.** Unless every head block is already orthonormal, the function changes: the singular
    values of each block become 1. A model initialised with std 0.02 (HuggingFace) has head blocks with
    singular values of about :math:`0.02\sqrt{d}`, so its logits grow by about
    :math:`1/(0.02^2 d)`; a trained model's logits may shrink or grow. Pass ``probe`` to have the relative
    change measured, and ``logit_gain="fit"`` to keep each head's logit scale.

    Parameters
    ----------
    model : nn.Module
        Converted in place.
    targets : "auto", sequence of Layout, Layout or callable, default "auto"
        ``"auto"``: the built-in table :data:`LAYOUTS` (torch ``nn.MultiheadAttention`` in any ``batch_first``,
        also inside ``nn.Transformer*`` and torchvision's ViT; ``q_proj``/``k_proj`` Linears as in Llama,
        Mistral, Qwen, OPT; ``query``/``key`` Linears as in BERT, RoBERTa, HF ViT; a fused ``qkv`` as in timm,
        split by the module's declared heads under grouped-query attention (HF EXAONE 4.5's vision tower);
        GPT-2's ``c_attn`` and cross-attention ``q_attn`` + ``c_attn``; the fused ``query_key_value`` of HF
        GPT-NeoX (Pythia), GPT-NeoX-Japanese, Bloom, Persimmon and Falcon in its three forms, whose q|k|v rows are
        interleaved per key/value head, read by ``Block(..., interleaved=True)``, and GPTBigCode's ``c_attn``
        Linear, interleaved the same way; CodeGen's ``qkv_proj``, ``mp_num`` groups of q|v|k, read by
        ``Block(..., groups="mp_num")``; on modules whose class name says attention, ``q``/``k`` (T5),
        ``q_lin``/``k_lin`` (DistilBERT), ``query_proj``/``key_proj`` (DeBERTa-v2) Linears and a fused ``Wqkv``
        (MPT, ModernBERT; DBRX split by its declared heads)). A sequence of :class:`Layout`
        replaces the table (extend it with ``(*LAYOUTS, Layout(...))``). A callable
        ``targets(path, module)`` is asked about every module and returns a :class:`Layout` (convert with
        it), ``True`` (convert with the built-in layout that matches) or ``None``/``False`` (leave it).
    logit_gain : {None, "learn", "fit"}, default None
        ``None``: no gain. Otherwise each query head ``h`` gets a learnable gain
        :math:`\gamma_h = \exp(\text{gain_rate}\cdot\theta_h)` multiplying its rebuilt query rows, hence its
        logits (rotary embeddings rotate within the head, so they commute with it; under grouped-query
        attention each query head has its own gain against the shared key head; a module that normalizes its
        queries or keys after the projection, ``q_norm``/``k_norm`` and the like (cosine attention with a
        ``logit_scale``: SwinV2), or clamps them, ``clip_qkv``, or pairs them with position projections of its
        own, DeBERTa's ``pos_proj``/``pos_key_proj``, is converted, but with a warning naming it: there the gain is
        no logit factor). ``"learn"`` starts at
        :math:`\gamma_h = 1`, the choice for training from scratch, except where the weights are exactly what a
        model converted with a gain saves (``save_pretrained``, ``state_dict``, :func:`unstiefelize`): every key
        head block a frame and every query head block a frame times :math:`\gamma_h \ne 1`; it then starts at
        those :math:`\gamma_h`, so converting a saved model again keeps its learned gains (``None`` warns there,
        naming the modules whose gains it resets). ``"fit"`` starts at
        :math:`\gamma_h = \rho(A_{Q,h})\,\rho(A_{K,g(h)})` with :math:`\rho(A) = \|A\|_F/\sqrt{r}` the RMS
        singular value, so each head keeps its logit scale (exactly when the blocks are scaled orthonormal
        frames; query/key biases are rescaled with it, :math:`b_{Q,h} \leftarrow \rho(A_{K,g(h)})\,b_{Q,h}`
        and :math:`b_{K,g} \leftarrow b_{K,g}/\rho(A_{K,g})`, which keeps the logits with biases too;
        ``probe=`` measures the change): the choice for preserving a trained model's function. Fitted to a freshly initialised
        HuggingFace model (std 0.02) it is about :math:`0.02^2 d` (0.013 at :math:`d = 32`) and attention
        starts almost uniform, so do not use it from scratch.
    qk_bias : {"keep", "drop"}, default "keep"
        ``"keep"``: query/key biases stay free parameters. ``"drop"``: they are set to zero and held there
        (a parametrization masks them), so the logits are pure bilinear forms of the frames.
    strict : bool, default True
        Raise ``ValueError`` when nothing is converted, or when a module that looks like attention (its class
        name contains "Attention", or it is an ``nn.MultiheadAttention``, and it holds no frame) matches no
        layout or cannot be converted. With ``False`` those modules are left as they are, listed in
        ``result.skipped`` and named in a warning.
    probe : Tensor, tuple or dict, optional
        An input batch (``model(probe)``, ``model(*probe)`` or ``model(**probe)``) on which the relative
        output change is measured in eval mode without gradients; the output is the tensor returned, or its
        ``logits``/``last_hidden_state``/first element.
    gain_rate : float, default :data:`GAIN_RATE`
        The rate in :math:`\gamma_h = \exp(\text{rate}\,\theta_h)`. Adam moves :math:`\theta` by about
        ``lr`` per step, so with rate 10 and ``lr = 1e-3`` a gain can grow tenfold in about 230 steps. Another
        value with ``logit_gain=None`` (no gains) warns that it has no effect.

    Returns
    -------
    ConversionResult
        The converted modules (path, layout, heads q/kv, d, r, gain), skipped modules and the output change.

    Notes
    -----
    **Saving and loading.** ``model.state_dict()`` (hence ``save_pretrained`` and ``Trainer`` checkpoints)
    is the stock model's: each converted weight under its stock key, :math:`W_Q = [\gamma_h U_{Q,h}]^\top`,
    :math:`W_K = [U_{K,g}]^\top` with the rest in place, in the stock key order. ``load_state_dict`` maps a
    stock weight back: the rest as given; for each head block :math:`A_h`, with a query gain
    :math:`\gamma_h = \|A_h\|_F/\sqrt r` (:math:`\theta_h = \log\gamma_h/\text{gain_rate}`) and
    :math:`A_h \leftarrow A_h/\gamma_h`, then the frame :math:`A_h` itself when it is orthonormal within
    :data:`~geoopt_stiefel_attention.optim.ORTHONORMALITY_TOLERANCE`, else its polar factor (with a
    warning: the function changes). Without a gain a state dict round-trips bit for bit, with one to float
    rounding; :func:`parametrized_state_dict` writes the frames as stored. Entries in that parametrized form
    load as they are. A pure ``q_proj``/``k_proj`` weight keeps its empty rest as a non-persistent buffer, so
    no zero-size parameter appears.

    **Optimizers.** Build them after converting (``StiefelAdam(param_groups(model))``): one built before holds the
    converted weights but not the frames that now carry the query/key rows, so it would never train them. Every
    ``torch.optim`` step is watched for this (a global step pre-hook): such an optimizer raises at its step once no
    optimizer has changed those frames in its last four steps while they have gradients (docs: "Build the
    optimizer after converting").

    **Writing a converted weight.** A converted weight is computed from its frames at each read, so an in-place
    write to it (``weight.copy_(w)``, ``nn.init.*_(weight)``, an init pass after conversion such as HuggingFace's
    ``post_init``) changes only the tensor that read returned, not the model (torch's parametrizations behave so).
    Assign instead (``module.weight = w``) or use ``load_state_dict``: both set the frames to the polar factors of
    the head blocks, and warn when the weight then reads back differently. A ``logit_gain`` of a weight with
    ``requires_grad=False`` is created frozen too.

    Raises
    ------
    ValueError
        For bad options, when nothing converts (the message lists the layouts searched), and for an
        attention-like module that cannot be converted (the message says why and what to pass); the model
        is then unchanged. A query/key weight (or, with ``qk_bias="drop"``, bias) that is one Parameter held by
        several modules (tied weights) cannot be converted: the
        message names every place it is held; untie them first. A layout that reads the fused weight of a module
        that interleaves q|k|v per head (one the built-in "interleaved query_key_value" layout matches) as ranges
        of the whole axis (``part``/``parts`` or ``span``, without ``interleaved=True``) is refused: those rows
        are not its query and key rows. A query/key projection held by an adapter layer (PEFT's LoRA, DoRA, IA3, ...:
        a module holding it as its ``base_layer``) is refused, naming the adapter layers: the adapter's update is
        added outside the frames (merge it first, ``model.merge_and_unload()``, or leave the query/key projections
        out of its ``target_modules``). Wrapping a converted query/key projection in such an adapter afterwards
        (``get_peft_model``) raises ``RuntimeError`` at the first read of the weight.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from geoopt_stiefel_attention import stiefelize, frame_parameters
    >>> layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64)  # batch_first=False
    >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> print(stiefelize(model))  # doctest: +NORMALIZE_WHITESPACE
    stiefelize: 2 attention module(s) converted, 16 frames
      layers.0.self_attn: torch MultiheadAttention, heads q/kv 4, q in St(32, 8), k in St(32, 8), logit gain none
      layers.1.self_attn: torch MultiheadAttention, heads q/kv 4, q in St(32, 8), k in St(32, 8), logit gain none
    >>> len(frame_parameters(model))
    4
    """
    if logit_gain not in GAIN_MODES:
        raise ValueError(f"stiefelize: logit_gain={logit_gain!r} is unknown; pass None, 'learn' or 'fit'.")
    if qk_bias not in BIAS_MODES:
        raise ValueError(f"stiefelize: qk_bias={qk_bias!r} is unknown; pass 'keep' or 'drop'.")
    if not isinstance(strict, bool):
        raise ValueError(f"stiefelize: strict={strict!r} is invalid; pass True or False.")
    if isinstance(gain_rate, bool) or not isinstance(gain_rate, (int, float)) or not (
            math.isfinite(gain_rate) and gain_rate > 0):
        raise ValueError(f"stiefelize: gain_rate={gain_rate!r} is invalid; pass a finite float > 0.")
    if logit_gain is None and gain_rate != GAIN_RATE:
        warnings.warn(f"stiefelize: gain_rate={gain_rate!r} has no effect with logit_gain=None (it scales the learned "
                      f"or fitted query gains); pass logit_gain='learn' or 'fit', or leave gain_rate out.",
                      UserWarning, stacklevel=2)
    if not isinstance(model, nn.Module):
        raise TypeError(f"stiefelize: model must be an nn.Module, got {type(model).__name__}.")
    fsdp1 = _fsdp1_class()
    for path, module in model.named_modules():
        where = "model is" if not path else f"model.{path} is"
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise TypeError(f"stiefelize: {where} a DistributedDataParallel, which registered the parameters it "
                            f"synchronises when it was built, so the new frames would train apart on each rank; "
                            f"convert the model before wrapping it: stiefelize(model); "
                            f"ddp = DistributedDataParallel(model).")
        if fsdp1 is not None and isinstance(module, fsdp1):
            raise TypeError(f"stiefelize: {where} a FullyShardedDataParallel: {_distributed.FSDP1_REFUSAL}.")
    table, chooser = _resolve_targets(targets)

    sites: list[_Site] = []
    problems: list[tuple[str, str]] = []
    interleaving = _interleaved_tensors(model)  # fused weights whose equal slices are not q and k (refused)
    for path, module in model.named_modules():
        if any(_under(path, s.path) for s in sites):
            continue
        layout = None
        if chooser is not None:
            choice = chooser(path, module)
            if isinstance(choice, Layout):
                layout = choice
                if not layout.matches(module):
                    problems.append((path, f"targets chose layout {layout.describe()!r}, which does not match "
                                           f"this {type(module).__name__}"))
                    continue
            elif choice is True:
                layout = _first_match(LAYOUTS, module)
                if layout is None:
                    problems.append((path, f"targets chose this {type(module).__name__}, but no built-in "
                                           f"layout matches it; return a Layout for it instead of True"))
                    continue
            elif choice not in (None, False):
                raise ValueError(f"stiefelize: targets({path!r}, module) returned {choice!r}; return a Layout, "
                                 f"True, False or None.")
        else:
            layout = _first_match(table, module)
        if layout is None:
            continue
        try:
            sites.append(_plan(path, module, layout, qk_bias, interleaving))
        except _Refusal as err:
            problems.append((path, f"{type(module).__name__} matches layout {layout.name!r} but {err}"))
    wrapped = _adapter_layers(model)
    sites, adapted = _adapted(sites, wrapped)
    problems += adapted
    sites, tied = _tied(model, sites)
    problems += tied
    for site in sites:  # before anything changes
        frozen = [name for name, p in site.module.named_parameters() if p.is_inference()]
        if frozen:
            raise TypeError(f"stiefelize: {_where(site.path)} holds inference tensors ({', '.join(frozen)}: the model "
                            f"was built or loaded under torch.inference_mode()), which cannot be changed in place "
                            f"outside it; build or load the model outside inference mode (torch.no_grad() is enough "
                            f"to save memory), then convert it.")
        sharded = [name for name, p in site.module.named_parameters() if _distributed.is_sharded(p)]
        if sharded:
            raise TypeError(f"stiefelize: {_where(site.path)} holds sharded parameters ({', '.join(sharded)}: "
                            f"DTensors, from fully_shard or a tensor-parallel plan applied before the conversion), "
                            f"whose query/key blocks cannot become whole frames; convert the model first, then shard "
                            f"it with geoopt_stiefel_attention.distributed.fully_shard_by_heads.")
    if chooser is None:
        claimed = [s.path for s in sites] + [p for p, _ in problems]
        candidates = [p for p, m in model.named_modules()
                      if _looks_like_attention(m) and not any(_under(p, c) or _under(c, p) for c in claimed)]
        for p in candidates:
            if not any(q != p and _under(q, p) for q in candidates):  # report the innermost
                m = model.get_submodule(p)
                inside = [(w, layer) for w, layer in wrapped.items() if _under(w, p) or _under(p, w)]
                # the adapters around a projection a layout of the table reads (q_proj, c_attn, the module itself)
                # first: one on the value or output projection alone is no reason
                qk = [(w, layer) for w, layer in inside if _adapted_name(w, p) in _qk_owner_names(table or LAYOUTS)]
                if qk or inside:  # its projections are held by adapter layers, so the table's names do not match
                    adapted.append((p, _adapter_refusal(p, qk or inside)))
                    problems.append(adapted[-1])
                    continue
                problems.append((p, f"{type(m).__name__} looks like attention but matches no layout "
                                    f"({_hint(m)})"))
    searched = ", ".join(lay.name for lay in (table or LAYOUTS))  # names only: the table is in the docs
    if problems and strict:
        listing = "\n".join(f"  {line}" for line in _grouped(problems))
        # a tied weight's line carries its own fix (untie them), and so does an adapter's; the closing advice is for
        # the modules no layout fits
        others = [p for p in problems if p not in tied and p not in adapted]
        which = "them" if len(others) == len(problems) else "the modules not tied" if not adapted else "the others"
        closing = "" if not others else (
            f"\nLayouts searched: {searched}.\nPass targets= with a Layout for {which}, or strict=False to leave "
            f"them Euclidean.")
        raise ValueError(f"stiefelize: cannot convert {len(problems)} module(s) of {type(model).__name__}; "
                         f"nothing was changed.\n{listing}{closing}")
    if not sites:
        existing = sum(1 for p in model.parameters() if is_frame(p))
        held = f" (it already holds {existing} Stiefel frame tensors)" if existing else ""
        msg = (f"stiefelize: no attention module of {type(model).__name__} was converted{held}. Layouts "
               f"searched: {searched}. Pass targets=(*LAYOUTS, Layout(...)) for another layout"
               + ("; left unconverted: " + "; ".join(_grouped(problems))
                  if problems else " (no module looked like attention: a class named *Attention*, or query/key "
                                   "Linears such as to_q/to_k, wq/wk, q/k)."))
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    elif problems:
        warnings.warn("stiefelize: left unconverted (strict=False): " + "; ".join(_grouped(problems)), stacklevel=2)

    if qk_bias == "drop":
        nothing = [s.path for s in sites if not s.bias_spans]
        if nothing:
            warnings.warn(f"stiefelize: qk_bias='drop' had nothing to drop in {len(nothing)} of {len(sites)} converted "
                          f"module(s) ({', '.join(_where(p) for p in nothing[:4])}{', ...' if len(nothing) > 4 else ''}):"
                          f" they have no query/key bias.", stacklevel=2)
    # gains a converted model saved into its weights (gamma_h U_h): "learn" starts from them, None would drop them
    saved = [_saved_gain(site) if logit_gain in (None, "learn") else None for site in sites]
    if logit_gain is None and any(g is not None for g in saved):
        found = [(site.path, g) for site, g in zip(sites, saved, strict=True) if g is not None]
        lo = min(float(g.min()) for _, g in found)
        hi = max(float(g.max()) for _, g in found)
        names = ", ".join(_where(p) for p, _ in found[:4]) + (f", ... ({len(found)} modules)" if len(found) > 4 else "")
        warnings.warn(f"stiefelize: logit_gain=None resets the query gains saved in the weights of {names} (each "
                      f"query head block is a frame times a gain, {lo:.4g}..{hi:.4g}, and each key block a frame, as a "
                      f"model converted with a logit gain saves them), which changes those heads' logits by those "
                      f"factors; pass logit_gain='learn' to keep them.", UserWarning, stacklevel=2)
    gains = [_initial_gain(site, logit_gain, g) for site, g in zip(sites, saved, strict=True)]  # checked before any change
    if logit_gain is not None:
        caveats = [(site.path, why) for site in sites if (why := _gain_caveat(site.module)) is not None]
        for line in _grouped(caveats):
            warnings.warn(f"stiefelize: logit_gain={logit_gain!r} does not act as each query head's logit factor in "
                          f"{line}; pass logit_gain=None for such modules (a callable targets= can convert them "
                          f"apart from the others).", UserWarning, stacklevel=2)
    if logit_gain == "fit" and qk_bias == "keep":
        unscaled = [(site.path, f"{b} (a {role} bias, not rescaled)") for site in sites
                    for role, b in (("query", site.q_bias), ("key", site.k_bias)) if isinstance(b, str)]
        for line in _grouped(unscaled):
            warnings.warn(f"stiefelize: logit_gain='fit' rescales each head's query/key biases with its gain, but "
                          f"cannot in {line}; so those heads' logits change (a query bias left as it is changes "
                          f"the attention weights; a key bias only shifts each query's logits by a constant, which a "
                          f"softmax ignores and a logit cap does not). Pass probe= to measure the change, or a "
                          f"targets= Layout whose q_bias/k_bias Block names the biases.", UserWarning, stacklevel=2)
    before = _probe(model, probe) if probe is not None else None
    if logit_gain == "fit" and qk_bias == "keep":
        for site in sites:
            _rescale_biases(site)
    converted = _converted_weights(sites)  # the weights themselves, before conversion replaces them
    rows = [_apply(site, logit_gain, gain_rate, gain, from_weights=g is not None)
            for site, gain, g in zip(sites, gains, saved, strict=True)]
    for weight, owner, attr, label in converted:  # an optimizer built before this call holds them, not the frames
        plist = owner.parametrizations[attr][0]
        watch(weight, [t for _, t in plist.frames()] + [t for t in (getattr(plist, "q_log_gain", None),)
                                                        if t is not None], label)
    if rows:
        _watch_model(model)  # the frame check of a training forward, once for the whole model
    change = absolute = scale = None
    if before is not None:
        after = _probe(model, probe)
        absolute, scale = float((after - before).norm()), float(before.norm())
        # a ratio only where it is defined: a zero (or non-finite) output before conversion has no relative change
        change = absolute / scale if scale > 0 and math.isfinite(scale) else None
    return ConversionResult(tuple(rows), tuple(problems), change, absolute, scale)


def _adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The adapter layers of ``model`` (PEFT's LoRA, DoRA, IA3, ... layers: modules holding the layer they adapt as
    their ``base_layer`` child), by the path of the module they wrap."""
    found = {}
    for path, module in model.named_modules():
        base = module._modules.get("base_layer")
        if isinstance(base, nn.Module):
            found[f"{path}.base_layer" if path else "base_layer"] = module
    return found


def _adapted_name(wrapped_path: str, site_path: str) -> str:
    """The wrapped module's path inside the attention module at ``site_path`` ("" for the module itself)."""
    inner = wrapped_path[:-len(".base_layer")] if wrapped_path.endswith(".base_layer") else ""
    return inner[len(site_path):].lstrip(".") if _under(inner, site_path) else ""


def _qk_owner_names(table: Sequence[Layout]) -> set[str]:
    """The modules (relative paths) whose weights the layouts of ``table`` read as queries or keys."""
    return {block.param.rpartition(".")[0] for layout in table for block in (layout.q, layout.k)}


def _adapter_refusal(site_path: str, layers: Sequence[tuple[str, nn.Module]]) -> str:
    kinds = sorted({_adapter_name(m) for _, m in layers})
    where = ", ".join(repr(_adapted_name(w, site_path) or "<the module itself>") for w, _ in layers[:4])
    return (f"its query/key projection is wrapped by an adapter layer ({', '.join(kinds)} at {where}), which "
            f"{_ADAPTER_REASON}; leave the query/key projections out of the adapter's target_modules, or merge the "
            f"adapter first (model = model.merge_and_unload()) and convert the merged model")


def _adapted(sites: list[_Site], wrapped: dict[str, nn.Module]) -> tuple[list[_Site], list[tuple[str, str]]]:
    """Refuse the sites whose query/key weight lies in a module an adapter layer wraps (a user layout naming
    ``q_proj.base_layer.weight``, or an adapter wrapping the attention module itself): its output is the adapted
    one, not the weight the frames would rebuild."""
    if not wrapped:
        return sites, []
    kept, problems = [], []
    for site in sites:
        owners = set()
        for piece in (site.q, site.k):
            inner = next((n for n, m in site.module.named_modules() if m is piece.owner), "")
            owners.add(".".join(x for x in (site.path, inner) if x))
        layers = [(w, layer) for w, layer in wrapped.items() if any(_under(o, w) for o in owners)]
        if layers:
            problems.append((site.path, _adapter_refusal(site.path, layers)))
        else:
            kept.append(site)
    return kept, problems


def _fsdp1_class() -> type | None:
    """``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1), or ``None`` where torch has no distributed
    package."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _where(path: str) -> str:
    return repr(path) if path else "<root>"


def _grouped(problems: Sequence[tuple[str, str]], shown: int = 3) -> list[str]:
    """``"<paths>: <why>"`` once per distinct reason, naming at most ``shown`` paths (and how many there are)."""
    groups: dict[str, list[str]] = {}
    for path, why in problems:
        groups.setdefault(why, []).append(path)
    lines = []
    for why, paths in groups.items():
        more = f", ... ({len(paths)} modules)" if len(paths) > shown else ""
        lines.append(f"{', '.join(_where(p) for p in paths[:shown])}{more}: {why}")
    return lines


def _hint(module: nn.Module) -> str:
    """Why ``module`` matched no layout, and the :class:`Layout` to write for it (short: no layout table)."""
    if type(module).__name__ == "EuclideanMultiheadAttention":
        return "it is this library's Euclidean module: use StiefelMultiheadAttention.from_euclidean(module)"
    why = _normalized_projection(module)
    if why is not None:
        return why
    pair = _qk_children(module)
    if pair is None:
        names = [n for n, _ in module.named_parameters()][:6]
        return (f"its parameters: {', '.join(names)}; write a Layout naming its query and key weights, e.g. "
                f"Layout('mine', q=Block('<query>.weight'), k=Block('<key>.weight'), head_dim=<int>) (a fused "
                f"q|k|v weight is often interleaved per head, Block(..., interleaved=True), not equal thirds: "
                f"read the module's forward for which rows are head h's query and key)")
    q, k = pair
    known = (HEAD_DIM_ATTRS + NUM_HEADS_ATTRS)
    found = next((a for a in known if _is_count(getattr(module, a, None))), None)
    head_dim = "" if found is not None else ", head_dim=<int>"
    heads = f"heads from its {found}={getattr(module, found)}" if found is not None else "no head count found"
    return (f"query/key Linears {q!r}/{k!r}, {heads}; no built-in layout uses these names. Add one: "
            f"stiefelize(model, targets=(*LAYOUTS, Layout('{q}/{k}', q=Block('{q}.weight'), "
            f"k=Block('{k}.weight'){head_dim})))")


def _saved_gain(site: _Site) -> Tensor | None:
    r"""The query gains a model converted with a logit gain saved into this site's weights, or ``None``.

    A converted model's state dict (``save_pretrained``, :func:`export_state_dict`, ``unstiefelize``) holds each
    query head block as :math:`\gamma_h U_h` and each key head block as a frame :math:`U_{K,g}`. Where every block
    is exactly that (orthonormal within the weight dtype's
    :data:`~geoopt_stiefel_attention._linalg.ORTHONORMALITY_TOLERANCE` after dividing the query block by
    :math:`\gamma_h = \|A_h\|_F/\sqrt r`) and some :math:`\gamma_h` differs from 1 by more than that tolerance,
    the :math:`\gamma_h` are returned; a freshly initialised or otherwise trained weight is not of that form."""
    q, k, r = site.q, site.k, site.r
    wq, wk = getattr(q.owner, q.attr), getattr(k.owner, k.attr)
    if any(w.device.type == "meta" or getattr(w, "_local_tensor", None) is not None for w in (wq, wk)):
        return None
    tol = ORTHONORMALITY_TOLERANCE.get(wq.dtype, 1e-4)
    with torch.no_grad():
        keys = _frames_from(wk, k.dim, k.start, k.length, r, k.groups).double()
        if not float(orthonormality_error(keys)) <= ORTHONORMALITY_TOLERANCE.get(wk.dtype, 1e-4):
            return None
        blocks = _frames_from(wq, q.dim, q.start, q.length, r, q.groups).double()
        gain = blocks.flatten(1).norm(dim=1) / math.sqrt(r)
        if not (bool(torch.isfinite(gain).all()) and bool((gain > 0).all())):
            return None
        if not float(orthonormality_error(blocks / gain.view(-1, 1, 1))) <= tol:
            return None
        if not float((gain - 1).abs().max()) > tol:
            return None
    return gain.to(wq.dtype)


#: Names of the child modules that normalize the queries or keys after their projection (QK-norm: Qwen3, OLMo2,
#: Cohere, Gemma3, Persimmon, ...); an ``nn.Identity`` there (QK-norm switched off) does not count.
_QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "q_layer_norm",
                  "k_layer_norm", "qk_norm", "qk_layernorm", "norm_q")  # norm_q: timm MViTv2 (after pooling q)
_KEY_NORM_NAMES = {"k_norm", "k_layernorm", "key_layernorm", "k_layer_norm"}


def _gain_caveat(module: nn.Module) -> str | None:
    """Why a gain on the query rows of ``module`` would not multiply its logits (``None`` when it does): a norm of
    the queries or keys after the projection (it divides the gain out), cosine attention (a ``logit_scale``
    Parameter: q and k L2-normalized per head in the forward, SwinV2 and Swin2SR; it divides the gain out too), a
    clamp of q, k and v (``clip_qkv``), or relative-position logits through separate position projections
    (DeBERTa's c2p/p2c without ``share_att_key``)."""
    found = [n for n in _QK_NORM_NAMES
             if isinstance(c := getattr(module, n, None), nn.Module) and not isinstance(c, nn.Identity)]
    # a norm of the keys alone leaves the queries' scale, and with it the gain, in the logits
    norms = [f"{n} ({type(getattr(module, n)).__name__})" for n in found] if set(found) - _KEY_NORM_NAMES else []
    clip = getattr(module, "clip_qkv", None)
    if clip is None:
        clip = getattr(getattr(module, "config", None), "clip_qkv", None)
    why = []
    if norms:
        why.append(f"it normalizes its queries/keys after the projection ({', '.join(norms)}), which divides a gain "
                   f"on the query rows out (a norm over all heads at once keeps only the gains' ratios)")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
        why.append(f"it clamps q, k and v to +-{clip:g} after the projection (clip_qkv), so a gain stops scaling a "
                   f"logit where the query entries reach the clamp")
    if isinstance(getattr(module, "logit_scale", None), nn.Parameter):  # SwinV2 (timm, torchvision, HF), Swin2SR
        why.append("it computes cosine attention (q and k normalized per head, times its logit_scale), which divides "
                   "a gain on the query rows out (only its ratio to a query bias remains)")
    position = [n for n in _POSITION_PROJ_NAMES if isinstance(getattr(module, n, None), nn.Module)]
    if position and getattr(module, "relative_attention", True):
        why.append(f"it adds relative-position logits that pair its queries or keys with separate position "
                   f"projections ({', '.join(position)}: DeBERTa's c2p/p2c), which a gain on the query rows, or the "
                   f"keys 'fit' rescales, scale otherwise than the content logits")
    return f"{type(module).__name__}: " + "; ".join(why) if why else None


#: Projections of relative positions that disentangled attention pairs with the queries or keys, apart from the
#: query/key projections: DeBERTa's ``pos_proj``/``pos_q_proj``, DeBERTa-v2's ``pos_key_proj``/``pos_query_proj``
#: (absent with ``share_att_key``, where the position terms go through the converted projections themselves).
_POSITION_PROJ_NAMES = ("pos_proj", "pos_q_proj", "pos_key_proj", "pos_query_proj")


def _initial_gain(site: _Site, logit_gain: str | None, saved: Tensor | None = None) -> Tensor | None:
    """The per-query-head gain a site starts with: none, ones (``"learn"``; the gains ``saved`` in the weights
    where :func:`_saved_gain` found them), or the product of the q and k blocks' RMS singular values
    (``"fit"``). A fitted gain must be positive and finite: a zero block would give a log-gain of -inf, a head
    whose logits stay zero for the whole of training."""
    if logit_gain is None:
        return None
    q, k, r = site.q, site.k, site.r
    wq = getattr(q.owner, q.attr)
    with torch.no_grad():
        if logit_gain == "learn":
            return saved if saved is not None else torch.ones(q.heads, dtype=wq.dtype, device=wq.device)
        gain = _rms_singular(q, r) * _rms_singular(k, r).repeat_interleave(q.heads // k.heads)
    bad = [h for h, g in enumerate(gain.tolist()) if not (math.isfinite(g) and g > 0)]
    if bad:
        raise ValueError(f"stiefelize: logit_gain='fit' at {_where(site.path)} gives query head(s) {bad} a gain of "
                         f"{[float(gain[h]) for h in bad]} (an all-zero or non-finite query/key block): such a "
                         f"head's logits would stay zero for the whole of training. Nothing was changed; use "
                         f"logit_gain='learn' (starts at 1) or give those heads non-zero weights first.")
    return gain


def _rms_singular(piece: _Piece, r: int) -> Tensor:
    r"""The RMS singular value :math:`\rho(A_h) = \|A_h\|_F/\sqrt r` of each head block of ``piece`` (as stored)."""
    w = getattr(piece.owner, piece.attr)
    with torch.no_grad():
        blocks = _frames_from(w, piece.dim, piece.start, piece.length, r, piece.groups)
        return blocks.flatten(1).norm(dim=1) / math.sqrt(r)


def _rescale_biases(site: _Site) -> None:
    r"""Rescale the query/key biases of a site ``logit_gain="fit"`` converts, before its weights are converted, so
    that each head keeps its logits exactly when its blocks are scaled orthonormal frames, biases or not: with
    :math:`A_{Q,h} = \rho_Q U_{Q,h}^\top`, :math:`A_{K,g} = \rho_K U_{K,g}^\top` and the gain
    :math:`\gamma_h = \rho_Q\rho_K` on the query frame,

    .. math:: (\gamma_h U_{Q,h}^\top x + \rho_K b_{Q,h})^\top (U_{K,g}^\top y + b_{K,g}/\rho_K)
              = (A_{Q,h} x + b_{Q,h})^\top (A_{K,g} y + b_{K,g}),

    so :math:`b_{Q,h} \leftarrow \rho_{K,g(h)} b_{Q,h}` and :math:`b_{K,g} \leftarrow b_{K,g}/\rho_{K,g}`."""
    if not isinstance(site.q_bias, list) and not isinstance(site.k_bias, list):
        return
    rho_k = _rms_singular(site.k, site.r)
    per_query = rho_k.repeat_interleave(site.q.heads // site.k.heads)
    for spans, factor in ((site.q_bias, per_query), (site.k_bias, 1 / rho_k)):
        if not isinstance(spans, list):
            continue
        head = 0
        for owner, attr, start, length in spans:  # in head order (one span per group)
            n = length // site.r
            bias = getattr(owner, attr)
            with torch.no_grad():
                bias[start:start + length].view(n, site.r).mul_(factor[head:head + n, None].to(bias.dtype))
            head += n


def _weight_path(site: _Site, owner: nn.Module, attr: str) -> str:
    """The path in the model of weight ``attr`` of ``owner``, a module inside the site's attention module."""
    inner = next((n for n, m in site.module.named_modules() if m is owner), "")
    return ".".join(x for x in (site.path, inner, attr) if x)


def _converted_weights(sites: list[_Site]) -> list[tuple[Tensor, nn.Module, str, str]]:
    """``(weight, owner, attr, label)`` of every weight the sites convert, once each (a fused weight holds both the
    query and the key rows), read before the conversion replaces it; the label is the weight's path in the model."""
    out, seen = [], set()
    for site in sites:
        for piece in (site.q, site.k):
            if (id(piece.owner), piece.attr) in seen:
                continue
            seen.add((id(piece.owner), piece.attr))
            label = _weight_path(site, piece.owner, piece.attr)
            out.append((getattr(piece.owner, piece.attr), piece.owner, piece.attr, label))
    return out


def _apply(site: _Site, logit_gain: str | None, gain_rate: float, gain: Tensor | None,
           from_weights: bool = False) -> ConvertedAttention:
    q, k, r = site.q, site.k, site.r
    groups: dict[tuple[int, str], list] = {}
    for p in (q, k):
        groups.setdefault((id(p.owner), p.attr), [p.owner, p.attr, []])[2].append(p)
    for owner, attr, pieces in groups.values():
        weight = getattr(owner, attr)
        specs = [dict(role=p.role, start=p.start, length=p.length, r=r,
                      gain=gain if p.role == "q" else None) for p in pieces]
        _hook_state_dicts(owner, _stock_names(owner))
        label = _weight_path(site, owner, attr)
        parametrize.register_parametrization(owner, attr, _QKWeight(weight, pieces[0].dim, specs, gain_rate,
                                                                    label=label, groups=pieces[0].groups),
                                             unsafe=True)
        owner.parametrizations[attr][0].__dict__["_registered"] = True  # later right_inverse calls are assignments
        if _is_torch_mha(owner):  # its forward reads the weight three times: build it once per model forward
            owner.parametrizations[attr][0].__dict__["_reread"] = True
        plist = owner.parametrizations[attr]
        if plist.original.numel() == 0:
            # a pure q_proj/k_proj weight has no rest: keep the empty tensor torch.nn.utils.parametrize needs as a
            # non-persistent buffer, so no zero-size parameter reaches model.parameters() or a state dict
            empty = plist.original.detach()
            del plist._parameters["original"]
            plist.register_buffer("original", empty, persistent=False)
    bias_groups: dict[tuple[int, str], list] = {}
    for owner, attr, start, length in site.bias_spans:
        bias_groups.setdefault((id(owner), attr), [owner, attr, []])[2].append((start, length))
    for owner, attr, spans in bias_groups.values():
        _hook_state_dicts(owner, _stock_names(owner))
        parametrize.register_parametrization(owner, attr, _ZeroQKBias(getattr(owner, attr), spans))
    object.__setattr__(site.module, _MARK, (site.layout.q.param, site.layout.k.param))
    span = "none" if gain is None else f"{float(gain.min()):.3g}..{float(gain.max()):.3g}"
    gain_text = "none" if gain is None else (
        f"learn (kept from the weights: {span})" if logit_gain == "learn" and from_weights else
        "learn (1)" if logit_gain == "learn" else f"fit ({span})")
    return ConvertedAttention(site.path, site.layout.name + site.split, q.heads, k.heads, q.d, k.d, r, gain_text)


def _probe(model: nn.Module, batch: Any) -> Tensor:
    modes = [(m, m.training) for m in model.modules()]  # every module's own mode, restored as it was
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(batch, dict):
                out = model(**batch)
            elif isinstance(batch, tuple):
                out = model(*batch)
            else:
                out = model(batch)
    finally:
        for m, training in modes:
            m.training = training
    for name in ("logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            out = getattr(out, name)
            break
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, Tensor):
        raise ValueError(f"stiefelize: the probe output is a {type(out).__name__}; return a tensor (or an "
                         f"object with .logits / .last_hidden_state, or a tuple whose first element is one).")
    return out.detach().double().clone()

