r"""Attention layouts: where the query and key rows of an attention module live.

A :class:`Layout` names, for one kind of attention module, the :class:`Block` holding its query rows and the one
holding its key rows (a parameter, an axis, a slice). The built-in layouts belong to the model families of
:mod:`~geoopt_stiefel_attention.convert.families` (:data:`~geoopt_stiefel_attention.LAYOUTS` is theirs, in table
order), which :func:`~geoopt_stiefel_attention.stiefelize` tries in order; a layout nobody foresaw is one more
entry. This module holds the mechanism only (the two dataclasses and the structural tests their ``when`` uses);
what any model family looks like is in the families' table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from .._docfrag import fill


def _get(module: nn.Module, dotted: str) -> Any:
    owner_path, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return getattr(owner, attr)


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner_path, _, attr = dotted.rpartition(".")
    return (module.get_submodule(owner_path) if owner_path else module), attr


@dataclass(frozen=True)
class Block:
    r"""Where one projection (query or key) lives inside an attention module.

    Parameters
    ----------
    param : str
        Dotted name of the weight, relative to the attention module (``"q_proj.weight"``, ``"in_proj_weight"``).
    dim : {0, 1}, default 0
        The axis that enumerates output features: ``0`` for an ``(out, in)`` weight (:class:`torch.nn.Linear`,
        ``nn.MultiheadAttention``), ``1`` for an ``(in, out)`` weight (GPT-2's ``Conv1D``).
    part, parts : int, default 0, 1
        The projection is slice ``part`` of ``parts`` equal slices along ``dim`` (``part=1, parts=3`` is the
        key block of a fused q|k|v weight). A fused q|k|v weight of a module that declares fewer key/value heads
        than query heads (an int attribute among :data:`KV_HEADS_ATTRS` or :data:`KV_GROUPS_ATTRS`, on the
        module, then on ``module.config``) is not three equal slices: :func:`~geoopt_stiefel_attention.stiefelize`
        then takes the query rows ``0 : H r`` and the key rows ``H r : (H + H_kv) r`` from the declared head
        counts, and refuses a weight of another width.
    span : (int, int), optional
        An explicit ``(start, stop)`` range along ``dim`` instead of ``part``/``parts``, for fused projections
        with unequal blocks (a fused q|k|v weight under grouped-query attention).
    interleaved : bool, default False
        The slices repeat once per key/value head instead of once per weight: the axis is :math:`H_{kv}`
        consecutive groups, one per key/value head, and ``part`` is the slice of *each group* (``part=1,
        parts=3``: the key rows of every group of a q|k|v interleave). Slice 0 of group :math:`g` holds the
        rows of the :math:`n = H/H_{kv}` query heads that share key head :math:`g`, every other slice one head,
        so a group is :math:`(n + \text{parts} - 1)\,r` rows wide, and, for ``dim=0``, with
        :math:`L = (n + \text{parts} - 1)\,r`:

        .. math::

            \text{query head } h = g n + i:\ \text{rows } gL + i r \,:\, gL + (i + 1) r, \qquad
            \text{slice } j \ge 1 \text{ of group } g:\ \text{rows } gL + (n + j - 1) r \,:\, gL + (n + j) r.

        Without grouped-query attention (:math:`n = 1`, :math:`H_{kv} = H`) the rows of head :math:`h` are
        :math:`[q_h, k_h, v_h]`, :math:`r` each, at :math:`3hr`: HF GPT-NeoX (Pythia), Bloom, Persimmon,
        GPT-NeoX-Japanese and Falcon's original layout; with :math:`1 < H_{kv} < H`, Falcon's
        ``new_decoder_architecture``; with :math:`H_{kv} = 1` the plain ``[q | k | v]`` of Falcon's
        ``multi_query``. :math:`H`, :math:`H_{kv}` and :math:`r` are read from the module when it is converted
        (:data:`NUM_HEADS_ATTRS`, :data:`KV_HEADS_ATTRS`, :data:`HEAD_DIM_ATTRS`; :math:`H_{kv} = H` when none is
        declared), and a weight of another width is refused. Reading such a weight as equal slices of the whole
        axis (``part``/``parts`` without ``interleaved``, or a ``span``) takes query rows of some heads for the
        keys of others: :func:`~geoopt_stiefel_attention.stiefelize` refuses that for the modules of the
        built-in table that interleave.
    groups : int or str, optional
        The axis is ``groups`` equal consecutive groups (an int, or the name of the module attribute that holds
        it, e.g. ``"mp_num"``), each split into ``parts`` equal slices, and the block is slice ``part`` of
        *every* group. The heads come group by group: with :math:`L` the width of a slice and :math:`m = L/r`
        heads per slice, head :math:`g m + j` of the block is entries :math:`g\,\text{parts}\,L + \text{part}
        \, L + j r` to :math:`+ r`. HF CodeGen's ``qkv_proj`` is ``groups="mp_num"`` (4) groups of
        ``[q | v | k]`` (query ``part=0``, key ``part=2`` of ``parts=3``). Every slice must hold whole heads (a head
        that spans two groups cannot be one frame: refused). Reading such a weight as equal slices of the whole
        axis takes value rows for query or key rows: :func:`~geoopt_stiefel_attention.stiefelize` refuses that
        for the modules of the built-in table that are grouped.
    """

    param: str
    dim: int = 0
    part: int = 0
    parts: int = 1
    span: tuple[int, int] | None = None
    interleaved: bool = False
    groups: int | str | None = None

    def __post_init__(self) -> None:
        if self.dim not in (0, 1):
            raise ValueError(f"Block: dim={self.dim!r} is invalid; pass 0 for an (out, in) weight or 1 for "
                             f"an (in, out) weight.")
        if not (isinstance(self.parts, int) and isinstance(self.part, int) and 0 <= self.part < self.parts):
            raise ValueError(f"Block: part={self.part!r} of parts={self.parts!r} is invalid; pass ints with "
                             f"0 <= part < parts.")
        if self.span is not None and not (
                len(self.span) == 2 and all(_is_index(i) for i in self.span) and self.span[0] < self.span[1]):
            raise ValueError(f"Block: span={self.span!r} is invalid; pass (start, stop) ints with "
                             f"0 <= start < stop.")
        if self.span is not None and (self.part, self.parts) != (0, 1):
            raise ValueError(f"Block: span={self.span!r} and part={self.part!r}, parts={self.parts!r} both say "
                             f"where the block is; pass either span (an explicit range) or part/parts (equal "
                             f"slices), not both.")
        if not isinstance(self.interleaved, bool):
            raise ValueError(f"Block: interleaved={self.interleaved!r} is invalid; pass True or False.")
        if self.interleaved and (self.span is not None or self.parts < 2):
            raise ValueError(f"Block: interleaved=True names a slice of every key/value head's group of rows, "
                             f"given as part/parts with parts >= 2 (part=0, parts=3: the query slice of a q|k|v "
                             f"interleave); got part={self.part!r}, parts={self.parts!r}, span={self.span!r}.")
        if self.groups is not None:
            if not (_is_count(self.groups) or (isinstance(self.groups, str) and self.groups.isidentifier())):
                raise ValueError(f"Block: groups={self.groups!r} is invalid; pass an int >= 1 or the name of the "
                                 f"module attribute that holds it (e.g. 'mp_num').")
            if self.interleaved or self.span is not None or self.parts < 2:
                raise ValueError(f"Block: groups={self.groups!r} names slice part of parts equal slices of every "
                                 f"group, given as part/parts with parts >= 2 and without interleaved or span "
                                 f"(part=0, parts=3, groups='mp_num': the query slice of CodeGen's qkv_proj); got "
                                 f"part={self.part!r}, parts={self.parts!r}, span={self.span!r}, "
                                 f"interleaved={self.interleaved!r}.")

    @fill
    def locate(self, width: int) -> tuple[int, int]:
        """``(start, length)`` of this block in a tensor with ``width`` entries along ``dim``.

        Parameters
        ----------
        {{width_dim}}

        Returns
        -------
        tuple of int
            ``(start, length)``: ``span`` when given, else part ``part`` of ``parts`` equal parts.

        Raises
        ------
        ValueError
            For an interleaved or grouped block, a ``span`` beyond ``width``, or a ``width`` not divisible into
            ``parts`` parts.
        """
        if self.interleaved:
            raise ValueError(f"{self.param}: an interleaved block is not one range; use locate_interleaved")
        if self.groups is not None:
            raise ValueError(f"{self.param}: a block of every group (groups={self.groups!r}) is not one range; use "
                             f"locate_grouped")
        if self.span is not None:
            if self.span[1] > width:
                raise ValueError(f"{self.param} has {width} output features, fewer than span={self.span}")
            return self.span[0], self.span[1] - self.span[0]
        if width % self.parts:
            raise ValueError(f"{self.param} has {width} output features, not divisible into {self.parts} "
                             f"equal parts")
        length = width // self.parts
        return self.part * length, length

    @fill
    def locate_interleaved(self, width: int, heads: int, kv_heads: int, r: int) -> tuple[int, int, int]:
        r"""``(start, length, groups)`` of an interleaved block (``interleaved=True``) in a tensor with ``width``
        entries along ``dim``, for ``heads`` query heads, ``kv_heads`` key/value heads of size ``r``: the
        block is entries ``start : start + length`` of each of the ``groups`` (:math:`= H_{kv}`) equal
        consecutive groups, group by group (its head :math:`g\,m + j`, with :math:`m = \text{length}/r`, is
        entries :math:`gL + \text{start} + jr` to :math:`+ r`, :math:`L = \text{width}/\text{groups}`).

        Parameters
        ----------
        {{width_dim}}
        heads : int
            Query heads :math:`H`.
        kv_heads : int
            Key/value heads :math:`H_{kv}`, which divides :math:`H`.
        r : int
            Head size.

        {{returns_groups}}

        Raises
        ------
        ValueError
            When ``heads`` is not a multiple of ``kv_heads``, or ``width`` is not
            :math:`H_{kv}\,(H/H_{kv} + \text{parts} - 1)\,r`.
        """
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads in equal groups")
        n = heads // kv_heads
        slots = n + self.parts - 1
        if width != kv_heads * slots * r:
            raise ValueError(f"{self.param} has {width} output features, not {kv_heads} group(s) of {n} query "
                             f"head(s) and {self.parts - 1} more head(s) of size {r} ({kv_heads * slots * r}: "
                             f"H_kv (H/H_kv + {self.parts - 1}) r)")
        if self.part == 0:
            return 0, n * r, kv_heads
        return (n + self.part - 1) * r, r, kv_heads

    @fill
    def locate_grouped(self, width: int, groups: int) -> tuple[int, int, int]:
        """``(start, length, groups)`` of a block of every group (``groups=``) in a tensor with ``width`` entries
        along ``dim`` split into ``groups`` equal groups: entries ``start : start + length`` of each group.

        Parameters
        ----------
        {{width_dim}}
        groups : int
            Number of equal groups the parameter is split into.

        {{returns_groups}}

        Raises
        ------
        ValueError
            When ``width`` is not ``groups`` groups of ``parts`` equal slices.
        """
        if width % (groups * self.parts):
            raise ValueError(f"{self.param} has {width} output features, not {groups} group(s) of {self.parts} "
                             f"equal slices")
        length = width // (groups * self.parts)
        return self.part * length, length, groups

    def bias_block(self) -> Block:
        """Where the matching bias lives by default: the same slice of ``q_proj.bias`` / ``in_proj_bias``.

        Returns
        -------
        Block
            The same slice of the bias named after ``param`` (``weight`` replaced by ``bias``), along dimension 0.
        """
        head, _, last = self.param.rpartition(".")
        name = "bias" if last == "weight" else last.replace("weight", "bias")
        return Block(f"{head}.{name}" if head else name, 0, self.part, self.parts, self.span, self.interleaved,
                     self.groups)

    def describe(self) -> str:
        """A readable name of the block: the parameter and which of its rows or columns it is.

        Returns
        -------
        str
            E.g. ``"in_proj_weight (rows part 1/3)"``.
        """
        axis = "rows" if self.dim == 0 else "columns"
        if self.interleaved:
            return f"{self.param} ({axis} part {self.part + 1}/{self.parts} of each key/value head's group)"
        if self.groups is not None:
            return f"{self.param} ({axis} part {self.part + 1}/{self.parts} of each of its {self.groups} groups)"
        if self.span is not None:
            where = f"{axis} {self.span[0]}:{self.span[1]}"
        else:
            where = f"{axis}" if self.parts == 1 else f"{axis} part {self.part + 1}/{self.parts}"
        return f"{self.param} ({where})"


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _is_linear(m: Any) -> bool:
    return isinstance(m, nn.Linear)


def _is_conv1d(m: Any) -> bool:
    """GPT-2's ``Conv1D``: an ``(in, out)`` weight with ``nf`` output features (recognised by structure)."""
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and getattr(m, "nf", None) == w.shape[1]


def _children_are(module: nn.Module, names: Sequence[str], kind: Callable[[Any], bool]) -> bool:
    return all(kind(getattr(module, n, None)) for n in names)


@dataclass(frozen=True)
class Layout:
    """One attention layout: where the query and key rows of a module live.

    Parameters
    ----------
    name : str
        Shown in the conversion result.
    q, k : Block
        The query and key projections. The key may have fewer heads than the query (grouped-query
        attention): heads are counted as ``rows // head_dim`` for each.
    when : callable, optional
        ``when(module) -> bool``, a structural test beyond "the named parameters exist".
    q_bias, k_bias : Block, optional
        Where the query/key biases live, for ``qk_bias="drop"``; default the same slice of the weight's
        sibling bias (``q_proj.bias``, ``in_proj_bias``).
    head_dim : int, str or callable, optional
        The head size ``r``: an int, the name of a module attribute, or ``head_dim(module) -> int``. Default:
        the first int attribute among :data:`HEAD_DIM_ATTRS`, else the query width divided by the first
        among :data:`NUM_HEADS_ATTRS` (on the module, then on ``module.config``).

    Examples
    --------
    A layout nobody foresaw, with projections called ``wq``/``wk`` and ``n_heads`` heads:

    >>> from geoopt_stiefel_attention import LAYOUTS, Block, Layout
    >>> mine = Layout("wq/wk", Block("wq.weight"), Block("wk.weight"))
    >>> table = (*LAYOUTS, mine)   # pass as stiefelize(model, targets=table)
    """

    name: str
    q: Block
    k: Block
    when: Callable[[nn.Module], bool] | None = field(default=None, compare=False)
    head_dim: int | str | Callable[[nn.Module], int] | None = field(default=None, compare=False)
    q_bias: Block | None = None
    k_bias: Block | None = None

    def __post_init__(self) -> None:
        q, k = self.q, self.k
        if (q.interleaved or k.interleaved) and not (
                q.param == k.param and q.interleaved and k.interleaved and q.dim == k.dim and q.parts == k.parts
                and q.part != k.part):
            raise ValueError(f"Layout {self.name!r}: an interleaved query or key block is two different slices of "
                             f"one weight's key/value-head groups: pass q and k as Block(param, dim, part, parts, "
                             f"interleaved=True) with the same param, dim and parts and different parts (e.g. "
                             f"part=0 and part=1 of parts=3); got q={q}, k={k}.")
        if (q.groups is not None or k.groups is not None) and not (
                q.param == k.param and q.groups == k.groups and q.dim == k.dim and q.parts == k.parts
                and q.part != k.part):
            raise ValueError(f"Layout {self.name!r}: a query or key block of every group (groups=) is two different "
                             f"slices of one weight's groups: pass q and k as Block(param, dim, part, parts, "
                             f"groups=...) with the same param, dim, parts and groups and different parts (e.g. "
                             f"part=0 and part=2 of parts=3, groups='mp_num'); got q={q}, k={k}.")

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` has this layout: both parameters exist and ``when`` (if any) holds.

        Parameters
        ----------
        module : nn.Module
            Candidate attention module.

        Returns
        -------
        bool
            ``True`` when ``module`` has the two parameters as 2-D tensors and ``when(module)`` is true.
        """
        for block in (self.q, self.k):
            try:
                t = _get(module, block.param)
            except AttributeError:
                return False
            if not isinstance(t, Tensor) or t.dim() != 2:
                return False
        return self.when is None or bool(self.when(module))

    def describe(self) -> str:
        """A readable one-line summary: the layout's name and its query and key blocks.

        Returns
        -------
        str
            ``"<name>: q = <block>, k = <block>"`` (see :meth:`Block.describe`).
        """
        return f"{self.name}: q = {self.q.describe()}, k = {self.k.describe()}"


def _is_torch_mha(m: nn.Module) -> bool:
    return isinstance(m, nn.MultiheadAttention)


def _is_attention(m: nn.Module) -> bool:
    """Whether ``m``'s class name says it is attention (for layouts keyed on short, common child names)."""
    return "attention" in type(m).__name__.lower()


def _is_class(m: nn.Module, names: Sequence[str]) -> bool:
    """Whether ``m``'s class, or a class it derives from, is named one of ``names`` (the libraries that define
    them are not imported)."""
    return any(c.__name__ in names for c in type(m).__mro__)
