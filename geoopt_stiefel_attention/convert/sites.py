r"""Finding the sites: which modules of a model a conversion reads, and where their query and key rows live.

:func:`_resolve_targets` turns ``targets=`` into a table of layouts (or a chooser); :func:`_plan` reads one matched
module into a :class:`_Site` (its query/key pieces, head size, biases), raising :class:`_Refusal` with the reason
when its rows cannot be told or cannot become frames; :func:`_looks_like_attention` and :func:`_hint` name the
modules that look like attention and match no layout. What a model family looks like comes from
:mod:`.families`; nothing here changes a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..manifolds import is_frame
from . import families
from .families import HEAD_DIM_ATTRS, KV_GROUPS_ATTRS, KV_HEADS_ATTRS, NUM_HEADS_ATTRS
from .layouts import Block, Layout, _children_are, _get, _is_count, _is_linear, _owner
from .result import _where


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
    interleaved = [lay for lay in families.builtin_layouts() if lay.q.interleaved or lay.q.groups is not None]
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
        own = families.index().q_biases if role == "query" else families.index().k_biases
        elsewhere = [n for n, _ in module.named_parameters() if n.split(".")[-1] in own]
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
    """The site of ``module``, which ``layout`` matches: its query and key rows, head size and biases; raises
    :class:`_Refusal`, saying why, when they cannot be told or cannot become frames."""
    if any(layout is builtin for builtin in families.builtin_layouts()):  # a built-in layout matched it by names only
        why = families.refusal(module, layout)
        if why is not None:
            raise _Refusal(why)
    _refuse_slices_of_interleaved(module, layout, qk_bias, interleaving or {})
    if layout.q.interleaved:  # q|k|v per key/value head: ranges within each group (Layout checks k is too)
        rows = _interleaved_rows(module, layout)
    elif layout.q.groups is not None:  # the same slices of each of G groups (Layout checks k is one too)
        rows = _grouped_rows(module, layout)
    else:
        rows = _fused_rows(module, layout)
    q_block, k_block, q, k, r, split, grid = rows
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
    q_bias, k_bias = _site_biases(module, layout, rows, qk_bias)
    spans = (q_bias or []) + (k_bias or []) if qk_bias == "drop" else []
    return _Site(path, module, layout, r, q, k, spans, split, q_bias, k_bias)


#: What :func:`_plan` reads from a module's weights: ``(q_block, k_block, q, k, r, split, grid)``, the query/key
#: blocks (split by declared heads where needed), their pieces, the head size, how a fused weight was split (shown
#: in the result's layout) and ``(H, H_kv, r)`` of an interleaved layout (else ``None``).
_Rows = tuple[Block, Block, _Piece, _Piece, int, str, tuple[int, int, int] | None]


def _interleaved_rows(module: nn.Module, layout: Layout) -> _Rows:
    """The rows of a layout whose query/key blocks are interleaved per key/value head (ranges within each group)."""
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
    return q_block, k_block, q, k, r, split, grid


def _grouped_rows(module: nn.Module, layout: Layout) -> _Rows:
    """The rows of a layout whose query/key blocks are the same slices of each of a weight's groups."""
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
    return q_block, k_block, q, k, r, split, None


def _fused_rows(module: nn.Module, layout: Layout) -> _Rows:
    """The rows of a layout whose query/key blocks are one range each (a slice, a span, a whole weight)."""
    q_block, k_block, split = _fused_blocks(module, layout)
    q = _piece(module, q_block, "q")
    k = _piece(module, k_block, "k")
    r = _head_dim(module, layout, q.length)
    return q_block, k_block, q, k, r, split, None


def _site_biases(module: nn.Module, layout: Layout, rows: _Rows, qk_bias: str) -> list[Any]:
    """The query and key biases of a site (see :func:`_bias_spans`), each checked to hold one ``r``-wide block per
    head; with ``qk_bias="keep"`` a bias that cannot be located is kept as the sentence saying why (for
    ``logit_gain="fit"``, which rescales it, to warn with), with ``"drop"`` it is refused."""
    q_block, k_block, q, k, r, _, grid = rows
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
    return biases


def _qk_children(module: nn.Module) -> tuple[str, str] | None:
    """The first pair of query/key-like Linear children of ``module`` (``to_q``/``to_k``, ``wq``/``wk``, ...)."""
    return next((pair for pair in families.index().qk_children if _children_are(module, pair, _is_linear)),
                None)


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
        return families.builtin_layouts(), None
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


def _hint(module: nn.Module) -> str:
    """Why ``module`` matched no layout, and the :class:`Layout` to write for it (short: no layout table)."""
    why = families.hint(module)
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
