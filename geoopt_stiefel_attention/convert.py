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
"""

from __future__ import annotations

import contextvars
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import geoopt
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import _deprecated
from ._linalg import orthonormality_error
from .distributed import is_sharded
from .manifolds import PolarStiefel, frame_dtypes, is_frame, reproject_after_cast_
from .optim import ORTHONORMALITY_TOLERANCE

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

#: Attribute names read (in order) for a module's head size, then for its number of query heads.
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")

#: Marker attribute set on a converted attention module (read by :func:`converted_query_key_frames`).
_MARK = "_stiefel_layout"


# ---------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Block:
    """Where one projection (query or key) lives inside an attention module.

    Parameters
    ----------
    param : str
        Dotted name of the weight, relative to the attention module (``"q_proj.weight"``, ``"in_proj_weight"``).
    dim : {0, 1}, default 0
        The axis that enumerates output features: ``0`` for an ``(out, in)`` weight (:class:`torch.nn.Linear`,
        ``nn.MultiheadAttention``), ``1`` for an ``(in, out)`` weight (GPT-2's ``Conv1D``).
    part, parts : int, default 0, 1
        The projection is slice ``part`` of ``parts`` equal slices along ``dim`` (``part=1, parts=3`` is the
        key block of a fused q|k|v weight).
    span : (int, int), optional
        An explicit ``(start, stop)`` range along ``dim`` instead of ``part``/``parts``, for fused projections
        with unequal blocks (a fused q|k|v weight under grouped-query attention).
    """

    param: str
    dim: int = 0
    part: int = 0
    parts: int = 1
    span: tuple[int, int] | None = None

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

    def locate(self, width: int) -> tuple[int, int]:
        """``(start, length)`` of this block in a tensor with ``width`` entries along ``dim``."""
        if self.span is not None:
            if self.span[1] > width:
                raise ValueError(f"{self.param} has {width} output features, fewer than span={self.span}")
            return self.span[0], self.span[1] - self.span[0]
        if width % self.parts:
            raise ValueError(f"{self.param} has {width} output features, not divisible into {self.parts} "
                             f"equal parts")
        length = width // self.parts
        return self.part * length, length

    def bias_block(self) -> Block:
        """Where the matching bias lives by default: the same slice of ``q_proj.bias`` / ``in_proj_bias``."""
        head, _, last = self.param.rpartition(".")
        name = "bias" if last == "weight" else last.replace("weight", "bias")
        return Block(f"{head}.{name}" if head else name, 0, self.part, self.parts, self.span)

    def describe(self) -> str:
        axis = "rows" if self.dim == 0 else "columns"
        if self.span is not None:
            where = f"{axis} {self.span[0]}:{self.span[1]}"
        else:
            where = f"{axis}" if self.parts == 1 else f"{axis} part {self.part + 1}/{self.parts}"
        return f"{self.param} ({where})"


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


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

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` has this layout: both parameters exist and ``when`` (if any) holds."""
        for block in (self.q, self.k):
            try:
                t = _get(module, block.param)
            except AttributeError:
                return False
            if not isinstance(t, Tensor) or t.dim() != 2:
                return False
        return self.when is None or bool(self.when(module))

    def describe(self) -> str:
        return f"{self.name}: q = {self.q.describe()}, k = {self.k.describe()}"


def _is_torch_mha(m: nn.Module) -> bool:
    return isinstance(m, nn.MultiheadAttention)


#: The built-in layouts, tried in this order; the first that matches a module converts it.
LAYOUTS: tuple[Layout, ...] = (
    Layout("torch MultiheadAttention", Block("in_proj_weight", 0, 0, 3), Block("in_proj_weight", 0, 1, 3),
           when=lambda m: _is_torch_mha(m) and m._qkv_same_embed_dim),
    Layout("torch MultiheadAttention (kdim/vdim)", Block("q_proj_weight"), Block("k_proj_weight"),
           when=lambda m: _is_torch_mha(m) and not m._qkv_same_embed_dim,
           q_bias=Block("in_proj_bias", 0, 0, 3), k_bias=Block("in_proj_bias", 0, 1, 3)),
    Layout("q_proj/k_proj Linear", Block("q_proj.weight"), Block("k_proj.weight"),
           when=lambda m: _children_are(m, ("q_proj", "k_proj"), _is_linear)),
    Layout("query/key Linear", Block("query.weight"), Block("key.weight"),
           when=lambda m: _children_are(m, ("query", "key"), _is_linear)),
    Layout("fused qkv Linear", Block("qkv.weight", 0, 0, 3), Block("qkv.weight", 0, 1, 3),
           when=lambda m: _children_are(m, ("qkv",), _is_linear)),
    Layout("GPT-2 c_attn Conv1D", Block("c_attn.weight", 1, 0, 3), Block("c_attn.weight", 1, 1, 3),
           when=lambda m: _children_are(m, ("c_attn",), _is_conv1d) and getattr(m, "q_attn", None) is None),
    Layout("GPT-2 cross-attention q_attn + c_attn Conv1D", Block("q_attn.weight", 1), Block("c_attn.weight", 1, 0, 2),
           when=lambda m: _children_are(m, ("q_attn", "c_attn"), _is_conv1d)),
)


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
        ``"none"``, ``"learn (1)"`` or ``"fit (min..max)"`` (the fitted gains' range).
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

    (Formerly ``ConversionReport``, still importable as a deprecated alias: in this project a *report* is a
    study's report.)

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


# ---------------------------------------------------------------------------------------------- parametrizations
def _get(module: nn.Module, dotted: str) -> Any:
    owner_path, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return getattr(owner, attr)


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner_path, _, attr = dotted.rpartition(".")
    return (module.get_submodule(owner_path) if owner_path else module), attr


def _frames_from(w: Tensor, dim: int, start: int, length: int, r: int) -> Tensor:
    """The ``(heads, d, r)`` blocks of rows/columns ``start:start+length`` of ``w`` (head ``h``: ``h*r:(h+1)*r``)."""
    block = w.detach().narrow(dim, start, length)
    if dim == 0:  # (H*r, d): head h rows are its (r, d) block, the frame is its transpose
        return block.reshape(length // r, r, -1).transpose(1, 2)
    return block.reshape(block.shape[0], length // r, r).permute(1, 0, 2)  # (d, H*r) -> (H, d, r)


class _QKWeight(nn.Module):
    """Parametrization of one weight tensor holding query and/or key rows.

    ``original`` (kept by :mod:`torch.nn.utils.parametrize`) is the rest of the tensor: the slices along
    ``dim`` that are neither query nor key, concatenated in order (empty for a pure ``q_proj``). The
    frames ``q_frames``/``k_frames`` are ``(heads, d, r)`` :class:`geoopt.ManifoldParameter` s; the query
    log-gain ``q_log_gain`` (``(heads,)``, optional) scales head ``h``'s rows by
    :math:`\\exp(\\text{rate}\\,\\theta_h)`.
    """

    def __init__(self, weight: Tensor, dim: int, pieces: list[dict[str, Any]], gain_rate: float) -> None:
        super().__init__()
        self.dim = dim
        self.gain_rate = float(gain_rate)
        manifold = PolarStiefel()
        segments, cursor = [], 0
        for piece in sorted(pieces, key=lambda p: p["start"]):
            if piece["start"] > cursor:
                segments.append(("rest", cursor, piece["start"] - cursor))
            segments.append((piece["role"], piece["start"], piece["length"]))
            cursor = piece["start"] + piece["length"]
            with torch.no_grad():
                frames = manifold.projx(_frames_from(weight, dim, piece["start"], piece["length"], piece["r"]))
            setattr(self, f"{piece['role']}_frames",
                    geoopt.ManifoldParameter(frames.contiguous(), manifold=manifold,
                                             requires_grad=weight.requires_grad))
            if piece.get("gain") is not None:
                self.q_log_gain = nn.Parameter(piece["gain"].log() / self.gain_rate)
        if cursor < weight.shape[dim]:
            segments.append(("rest", cursor, weight.shape[dim] - cursor))
        self.segments = tuple(segments)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _QKWeight:
        """``.to()``, ``.double()``, ``.half()``, ...: after a cast to a more precise dtype the frames are
        re-projected to that precision (:func:`~geoopt_stiefel_attention.manifolds.reproject_after_cast_`)."""
        before = frame_dtypes(self)
        super()._apply(fn, recurse)
        reproject_after_cast_(self, before)
        return self

    def _rows(self, role: str) -> Tensor:
        # The frame is used as it is, not through ``.as_subclass(Tensor)``: a ManifoldTensor disables
        # ``__torch_function__``, so every op below already returns a plain Tensor (whose gradient flows back
        # to the ManifoldParameter), and Dynamo traces it like any parameter; ``as_subclass`` of a tensor
        # subclass is a graph break under torch.compile (one per converted weight).
        frames = getattr(self, f"{role}_frames")
        if role == "q" and getattr(self, "q_log_gain", None) is not None:
            frames = frames * torch.exp(self.gain_rate * self.q_log_gain).to(frames.dtype).view(-1, 1, 1)
        h, d, r = frames.shape
        if self.dim == 0:
            return frames.transpose(1, 2).reshape(h * r, d)
        return frames.permute(1, 0, 2).reshape(d, h * r)

    def forward(self, rest: Tensor) -> Tensor:
        parts, offset = [], 0
        for role, _start, length in self.segments:
            if role == "rest":
                parts.append(rest.narrow(self.dim, offset, length))
                offset += length
            else:
                parts.append(self._rows(role))
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0].contiguous()

    def right_inverse(self, weight: Tensor) -> Tensor:
        """The rest of ``weight`` (query/key slices removed), stored as ``original``.

        Called at registration and on assignment (``module.weight = w``); on assignment the frames are also
        set to the polar factors of ``w``'s query/key head blocks (the log-gains are kept).
        """
        manifold = PolarStiefel()
        with torch.no_grad():
            for role, start, length in self.segments:
                if role != "rest":
                    frames = getattr(self, f"{role}_frames")
                    r = frames.shape[-1]
                    frames.copy_(manifold.projx(_frames_from(weight, self.dim, start, length, r)))
        rest = [weight.narrow(self.dim, s, n) for role, s, n in self.segments if role == "rest"]
        if not rest:
            shape = list(weight.shape)
            shape[self.dim] = 0
            return weight.new_empty(shape)
        return torch.cat(rest, dim=self.dim).contiguous()

    def extra_repr(self) -> str:
        return ", ".join(f"{role}[{s}:{s + n}]" for role, s, n in self.segments) + f", dim={self.dim}"


class _ZeroQKBias(nn.Module):
    """Parametrization of a bias whose query/key entries are held at zero (``qk_bias="drop"``).

    The mask ``keep`` is a non-persistent buffer: it follows from the layout, so it is not part of any
    state dict (checkpoints written before it was made non-persistent carry it; loading drops it).
    """

    def __init__(self, bias: Tensor, spans: list[tuple[int, int]]) -> None:
        super().__init__()
        keep = torch.ones_like(bias.detach())
        for start, length in spans:
            keep[start:start + length] = 0
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, bias: Tensor) -> Tensor:
        return bias * self.keep


_OURS = (_QKWeight, _ZeroQKBias)


# ---------------------------------------------------------------------------------------------- state dicts
# A converted weight is saved under its stock key (``c_attn.weight``), rebuilt from the frames, and a stock
# entry is mapped back onto the parametrization when loaded: a post hook of ``Module.state_dict`` and a pre
# hook of ``Module.load_state_dict`` (both public torch APIs) on every module that owns a converted weight.

#: "stock" (the default) or "parametrized": the form in which state dicts are written (see
#: :func:`parametrized_state_dict`).
_FORM: contextvars.ContextVar[str] = contextvars.ContextVar("stiefel_state_dict_form", default="stock")

#: Attribute of an owner module: ``(stock names, post-hook handle, load-pre-hook handle)``.
_HOOKS = "_stiefel_state_dict_hooks"


def _stock_to_frames(module: _QKWeight, weight: Tensor, key: str) -> tuple[dict[str, Tensor], list[str]]:
    r"""The parametrization's entries for a stock weight, and the heads it could not represent.

    Rest slices become ``original``; each query/key head block :math:`A` (``(d, r)``) becomes a frame: with a
    query log-gain, :math:`\gamma_h = \|A_h\|_F/\sqrt r`, :math:`\theta_h = \log(\gamma_h)/\text{rate}` and
    :math:`A_h \leftarrow A_h/\gamma_h` first; then :math:`A` itself when
    :math:`\max|A^\top A - I| \le` :data:`~geoopt_stiefel_attention.optim.ORTHONORMALITY_TOLERANCE` of the
    frame's dtype (so the model's own state dict loads back bit for bit when there is no gain), else its polar
    factor :math:`A(A^\top A)^{-1/2}`, and the head is listed as not representable.
    """
    problems: list[str] = []
    out: dict[str, Tensor] = {}
    rest = []
    for role, start, length in module.segments:
        if role == "rest":
            rest.append(weight.narrow(module.dim, start, length))
            continue
        frames = getattr(module, f"{role}_frames")
        ct = torch.promote_types(weight.dtype, frames.dtype)
        blocks = _frames_from(weight.to(device=frames.device, dtype=ct), module.dim, start, length,
                              frames.shape[-1])
        r = blocks.shape[-1]
        gain_param = getattr(module, "q_log_gain", None) if role == "q" else None
        if gain_param is not None:
            gain = blocks.flatten(1).norm(dim=1) / math.sqrt(r)
            bad = [h for h, g in enumerate(gain.tolist()) if not (math.isfinite(g) and g > 0)]
            if bad:
                raise ValueError(f"load_state_dict: {key} has all-zero or non-finite query head block(s) {bad}; "
                                 f"a query head with a log-gain needs a non-zero block (its log-gain would be "
                                 f"-inf). Load this checkpoint into the stock model class instead.")
            out["0.q_log_gain"] = (gain.log() / module.gain_rate).to(gain_param.dtype)
            blocks = blocks / gain.view(-1, 1, 1)
        blocks = blocks.to(frames.dtype)
        tol = ORTHONORMALITY_TOLERANCE.get(frames.dtype, 1e-4)
        err = torch.stack([orthonormality_error(b) for b in blocks])
        off = err > tol
        if bool(off.any()):
            blocks = torch.where(off.view(-1, 1, 1), PolarStiefel().projx(blocks), blocks)
            heads = off.nonzero().flatten().tolist()
            scaled = "scaled " if gain_param is not None else ""
            problems.append(f"{'query' if role == 'q' else 'key'} head(s) {heads} (max|A^T A - I| = "
                            f"{float(err.max()):.3g} > {tol:g}: not {scaled}orthonormal)")
        out[f"0.{role}_frames"] = blocks.contiguous()
    if rest:
        out["original"] = torch.cat(rest, dim=module.dim).contiguous()
    return out, problems


def _ours_on(owner: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(attr, parametrization)`` for every weight of ``owner`` parametrized by :func:`stiefelize` alone."""
    plists = getattr(owner, "parametrizations", None)
    if plists is None or not parametrize.is_parametrized(owner):
        return []
    return [(attr, plists[attr][0]) for attr in plists.keys()
            if len(plists[attr]) == 1 and isinstance(plists[attr][0], _OURS)]


def _is_sharded_owner(owner: nn.Module, attr: str) -> bool:
    return any(is_sharded(t) for t in (*owner.parametrizations[attr].parameters(),
                                       *owner.parametrizations[attr].buffers()))


def _state_dict_post_hook(owner: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Replace the parametrization's entries of ``owner`` by its stock entries, in the stock order."""
    if _FORM.get() != "stock":
        return
    ours = [(attr, p) for attr, p in _ours_on(owner) if not _is_sharded_owner(owner, attr)]
    if not ours:
        return
    stock_names = vars(owner)[_HOOKS][0]
    values = {}
    for attr, p in ours:
        first = p.q_frames if hasattr(p, "q_frames") else (
            p.k_frames if hasattr(p, "k_frames") else owner.parametrizations[attr].original)
        name = {id(v): k for k, v in p.named_parameters()}.get(id(first))
        raw = f"{prefix}parametrizations.{attr}." + (f"0.{name}" if name is not None else "original")
        keep_vars = state_dict.get(raw) is first  # torch passes keep_vars to state_dict, not to its post hooks
        with torch.set_grad_enabled(keep_vars and torch.is_grad_enabled()):
            value = getattr(owner, attr)
        values[attr] = (value if keep_vars else value.detach()).contiguous()
    raw_prefixes = tuple(f"{prefix}parametrizations.{attr}." for attr in values)
    subtree = [k for k in state_dict if k.startswith(prefix)]
    entries = {k: state_dict.pop(k) for k in subtree}
    ordered = {}
    for name in stock_names:
        key = prefix + name
        if name in values:
            ordered[key] = values[name]
        elif key in entries:
            ordered[key] = entries.pop(key)
    for name in values:  # a weight the owner did not have when it was converted (not expected)
        ordered.setdefault(prefix + name, values[name])
    ordered.update((k, v) for k, v in entries.items() if not k.startswith(raw_prefixes))
    state_dict.update(ordered)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for k in [k for k in metadata if (k + ".").startswith(raw_prefixes)]:
            del metadata[k]


def _load_state_dict_pre_hook(owner: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Map a stock entry of ``owner``'s converted weights onto their parametrizations (other forms pass)."""
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    for attr, p in _ours_on(owner):
        plist = owner.parametrizations[attr]
        stock_key, raw = f"{prefix}{attr}", f"{prefix}parametrizations.{attr}."
        if "original" in plist._non_persistent_buffers_set:  # checkpoints before it became a buffer hold it
            old = state_dict.get(raw + "original")
            if isinstance(old, Tensor) and old.numel() == 0:
                del state_dict[raw + "original"]
        if isinstance(p, _ZeroQKBias):
            state_dict.pop(raw + "0.keep", None)  # persistent before it was made a non-persistent buffer
        if stock_key in state_dict:
            value = state_dict.pop(stock_key)
            clash = [k for k in state_dict if k.startswith(raw)]
            expected = tuple(getattr(owner, attr).shape)
            if clash:
                error_msgs.append(f"{stock_key} is given in both the stock form and the parametrized form "
                                  f"({clash[0]}, ...); keep one of them (model.state_dict() writes the stock form)")
                continue
            if not isinstance(value, Tensor) or tuple(value.shape) != expected:
                error_msgs.append(f"size mismatch for {stock_key}: copying a param with shape "
                                  f"{tuple(getattr(value, 'shape', ()))} from checkpoint, the shape in current model "
                                  f"is {expected}.")
                continue
            if _is_sharded_owner(owner, attr):
                error_msgs.append(f"{stock_key}: a stock-form weight cannot be loaded into frames sharded as "
                                  f"DTensors; load it before sharding (or load the parametrized form that "
                                  f"torch.distributed.checkpoint writes)")
                continue
            with torch.no_grad():
                if isinstance(p, _QKWeight):
                    entries, problems = _stock_to_frames(p, value.detach(), stock_key)
                    if problems:
                        warnings.warn(f"load_state_dict: {stock_key}: {'; '.join(problems)}; these blocks were "
                                      f"replaced by their polar factors, which changes the attention logits. To "
                                      f"keep a stock checkpoint's function, load it into the stock model class and "
                                      f"call stiefelize(model, logit_gain='fit').", stacklevel=2)
                else:
                    dropped = value.detach().to(p.keep.device) * (1 - p.keep)
                    if bool((dropped != 0).any()):
                        warnings.warn(f"load_state_dict: {stock_key} has non-zero query/key entries "
                                      f"(max {float(dropped.abs().max()):.3g}), which qk_bias='drop' holds at zero; "
                                      f"they do not act. Convert with qk_bias='keep' to keep them.", stacklevel=2)
                    entries = {"original": value.detach()}
            if "original" in plist._non_persistent_buffers_set:
                entries.pop("original", None)
            for name, tensor in entries.items():
                state_dict[raw + name] = tensor
        if assign:  # load_state_dict(..., assign=True) installs the given tensors: keep frames on their manifold
            for name, param in p.named_parameters():
                given = state_dict.get(f"{raw}0.{name}")
                if is_frame(param) and isinstance(given, Tensor) and not isinstance(given, geoopt.ManifoldParameter):
                    state_dict[f"{raw}0.{name}"] = geoopt.ManifoldParameter(given, manifold=param.manifold,
                                                                            requires_grad=param.requires_grad)


def _hook_state_dicts(owner: nn.Module, stock_names: list[str]) -> None:
    """Register the two state-dict hooks on ``owner`` once (its first converted weight)."""
    if _HOOKS in vars(owner):
        return
    post = owner.register_state_dict_post_hook(_state_dict_post_hook)
    pre = owner.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    object.__setattr__(owner, _HOOKS, (tuple(stock_names), post, pre))


def _unhook_state_dicts(owner: nn.Module) -> None:
    hooks = vars(owner).get(_HOOKS)
    if hooks is not None and not _ours_on(owner):
        hooks[1].remove()
        hooks[2].remove()
        object.__delattr__(owner, _HOOKS)


def _stock_names(owner: nn.Module) -> list[str]:
    """The names of ``owner``'s own state-dict entries, in the order torch writes them."""
    return [*owner._parameters, *(b for b in owner._buffers if b not in owner._non_persistent_buffers_set)]


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


@dataclass
class _Site:
    path: str
    module: nn.Module
    layout: Layout
    r: int
    q: _Piece
    k: _Piece
    bias_spans: list[tuple[nn.Module, str, int, int]]


class _Refusal(ValueError):
    pass


def _head_dim(module: nn.Module, layout: Layout, q_width: int) -> int:
    spec = layout.head_dim
    if callable(spec):
        value = spec(module)
    elif isinstance(spec, str):
        value = getattr(module, spec, None)
    elif spec is not None:
        value = spec
    else:
        value = next((getattr(module, a) for a in HEAD_DIM_ATTRS if _is_count(getattr(module, a, None))), None)
        if value is None:
            for source in (module, getattr(module, "config", None)):
                heads = next((getattr(source, a) for a in NUM_HEADS_ATTRS if _is_count(getattr(source, a, None))),
                             None)
                if heads is not None:
                    if q_width % heads:
                        raise _Refusal(f"the query width {q_width} is not divisible by num_heads={heads}")
                    value = q_width // heads
                    break
    if not _is_count(value):
        raise _Refusal(f"cannot tell its head size (looked for an int attribute among {HEAD_DIM_ATTRS}, then "
                       f"{NUM_HEADS_ATTRS} on the module and its config; got {value!r}); pass "
                       f"targets=[Layout({layout.name!r}, q=..., k=..., head_dim=<int or attribute name>)]")
    return int(value)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _piece(module: nn.Module, block: Block, role: str) -> _Piece:
    owner, attr = _owner(module, block.param)
    if parametrize.is_parametrized(owner, attr):
        raise _Refusal(f"{block.param} is already parametrized "
                       f"({type(owner.parametrizations[attr][0]).__name__}); "
                       f"call unstiefelize(model) first if it was stiefelized")
    w = getattr(owner, attr)
    if not isinstance(w, nn.Parameter) or not torch.is_floating_point(w):
        raise _Refusal(f"{block.param} is not a floating-point nn.Parameter ({type(w).__name__}, "
                       f"{getattr(w, 'dtype', None)}); quantized or buffer weights cannot hold frames")
    try:
        start, length = block.locate(w.shape[block.dim])
    except ValueError as err:
        raise _Refusal(str(err)) from None
    return _Piece(role, owner, attr, block.dim, start, length, int(w.shape[1 - block.dim]), 0)


#: Parameter names of query/key biases kept apart from the projection weights (timm's BEiT/EVA attention).
_QK_BIAS_NAMES = ("q_bias", "k_bias")


def _plan(path: str, module: nn.Module, layout: Layout, qk_bias: str) -> _Site:
    q = _piece(module, layout.q, "q")
    k = _piece(module, layout.k, "k")
    r = _head_dim(module, layout, q.length)
    for p, block in ((q, layout.q), (k, layout.k)):
        if p.length % r:
            raise _Refusal(f"{block.param}: {p.length} {'query' if p.role == 'q' else 'key'} features are not "
                           f"a whole number of heads of size {r}")
        p.heads = p.length // r
        if r > p.d:
            raise _Refusal(f"a frame in St({p.d}, {r}) cannot exist: the head size {r} exceeds the input width "
                           f"{p.d} of {block.param}")
    if q.heads % k.heads:
        raise _Refusal(f"{q.heads} query heads cannot share {k.heads} key heads in equal groups")
    spans = []
    if qk_bias == "drop":
        for role, block in (("query", layout.q_bias or layout.q.bias_block()),
                            ("key", layout.k_bias or layout.k.bias_block())):
            try:
                b = _get(module, block.param)
            except AttributeError:
                b = None
            if b is None:
                # a bias kept somewhere the layout does not look (timm BEiT/EVA: q_bias beside a bias-free qkv)
                # would stay active while the user asked for it to be dropped
                elsewhere = [n for n, _ in module.named_parameters() if n.split(".")[-1] in _QK_BIAS_NAMES]
                if elsewhere:
                    raise _Refusal(f"qk_bias='drop' looks for the {role} bias at {block.param!r}, which it does not have, but it holds {elsewhere}; "
                                   f"pass targets= with a Layout whose q_bias/k_bias Block names them")
                continue
            if b.dim() != 1:
                raise _Refusal(f"{block.param} has shape {tuple(b.shape)}; a bias is 1-D")
            try:
                start, length = block.locate(b.shape[0])
            except ValueError as err:
                raise _Refusal(str(err)) from None
            owner, attr = _owner(module, block.param)
            spans.append((owner, attr, start, length))
    return _Site(path, module, layout, r, q, k, spans)


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
    frames: str | None = None,
    drop_qk_bias: bool | None = None,
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
        Mistral, Qwen, OPT; ``query``/``key`` Linears as in BERT, RoBERTa, HF ViT; timm's fused ``qkv``;
        GPT-2's ``c_attn`` and cross-attention ``q_attn`` + ``c_attn``). A sequence of :class:`Layout`
        replaces the table (extend it with ``(*LAYOUTS, Layout(...))``). A callable
        ``targets(path, module)`` is asked about every module and returns a :class:`Layout` (convert with
        it), ``True`` (convert with the built-in layout that matches) or ``None``/``False`` (leave it).
    logit_gain : {None, "learn", "fit"}, default None
        ``None``: no gain. Otherwise each query head ``h`` gets a learnable gain
        :math:`\gamma_h = \exp(\text{gain_rate}\cdot\theta_h)` multiplying its rebuilt query rows, hence its
        logits (rotary embeddings rotate within the head, so they commute with it; under grouped-query
        attention each query head has its own gain against the shared key head). ``"learn"`` starts at
        :math:`\gamma_h = 1`, the choice for training from scratch. ``"fit"`` starts at
        :math:`\gamma_h = \rho(A_{Q,h})\,\rho(A_{K,g(h)})` with :math:`\rho(A) = \|A\|_F/\sqrt{r}` the RMS
        singular value, so each head keeps its logit scale (exactly when the blocks are scaled orthonormal
        frames): the choice for preserving a trained model's function. Fitted to a freshly initialised
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
        ``lr`` per step, so with rate 10 and ``lr = 1e-3`` a gain can grow tenfold in about 230 steps.
    frames, drop_qk_bias
        Deprecated (the options of the former module-replacing converter). ``frames="head"`` is what
        ``stiefelize`` does; ``frames="layer"`` is refused (use
        ``StiefelMultiheadAttention.from_euclidean(module, frames="layer")``). ``drop_qk_bias=True`` means
        ``qk_bias="drop"``; ``logit_gain=True``/``False`` mean ``"learn"``/``None``.

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

    Raises
    ------
    ValueError
        For bad options, when nothing converts (the message lists the layouts searched), and for an
        attention-like module that cannot be converted (the message says why and what to pass); the model
        is then unchanged.

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
    logit_gain, qk_bias = _legacy(logit_gain, qk_bias, frames, drop_qk_bias)
    if logit_gain not in GAIN_MODES:
        raise ValueError(f"stiefelize: logit_gain={logit_gain!r} is unknown; pass None, 'learn' or 'fit'.")
    if qk_bias not in BIAS_MODES:
        raise ValueError(f"stiefelize: qk_bias={qk_bias!r} is unknown; pass 'keep' or 'drop'.")
    if not isinstance(strict, bool):
        raise ValueError(f"stiefelize: strict={strict!r} is invalid; pass True or False.")
    if isinstance(gain_rate, bool) or not isinstance(gain_rate, (int, float)) or not (
            math.isfinite(gain_rate) and gain_rate > 0):
        raise ValueError(f"stiefelize: gain_rate={gain_rate!r} is invalid; pass a finite float > 0.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"stiefelize: model must be an nn.Module, got {type(model).__name__}.")
    table, chooser = _resolve_targets(targets)

    sites: list[_Site] = []
    problems: list[tuple[str, str]] = []
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
            sites.append(_plan(path, module, layout, qk_bias))
        except _Refusal as err:
            problems.append((path, f"{type(module).__name__} matches layout {layout.name!r} but {err}"))
    if chooser is None:
        claimed = [s.path for s in sites] + [p for p, _ in problems]
        candidates = [p for p, m in model.named_modules()
                      if _looks_like_attention(m) and not any(_under(p, c) or _under(c, p) for c in claimed)]
        for p in candidates:
            if not any(q != p and _under(q, p) for q in candidates):  # report the innermost
                m = model.get_submodule(p)
                problems.append((p, f"{type(m).__name__} looks like attention but matches no layout "
                                    f"({_hint(m)})"))
    searched = ", ".join(lay.name for lay in (table or LAYOUTS))  # names only: the table is in the docs
    if problems and strict:
        listing = "\n".join(f"  {line}" for line in _grouped(problems))
        raise ValueError(f"stiefelize: cannot convert {len(problems)} module(s) of {type(model).__name__}; "
                         f"nothing was changed.\n{listing}\nLayouts searched: {searched}.\nPass targets= with a "
                         f"Layout for them, or strict=False to leave them Euclidean.")
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
    gains = [_initial_gain(site, logit_gain) for site in sites]  # checked for every site before any change
    before = _probe(model, probe) if probe is not None else None
    rows = [_apply(site, logit_gain, gain_rate, gain) for site, gain in zip(sites, gains, strict=True)]
    change = absolute = scale = None
    if before is not None:
        after = _probe(model, probe)
        absolute, scale = float((after - before).norm()), float(before.norm())
        # a ratio only where it is defined: a zero (or non-finite) output before conversion has no relative change
        change = absolute / scale if scale > 0 and math.isfinite(scale) else None
    return ConversionResult(tuple(rows), tuple(problems), change, absolute, scale)


def _legacy(logit_gain: Any, qk_bias: str, frames: Any, drop_qk_bias: Any) -> tuple[Any, str]:
    """Map the former converter's options onto the new ones, with a DeprecationWarning."""
    def deprecated(old: str, new: str) -> None:
        warnings.warn(f"stiefelize: {old} is deprecated; {new}.", DeprecationWarning, stacklevel=3)

    if isinstance(logit_gain, bool):
        new = "learn" if logit_gain else None
        deprecated(f"logit_gain={logit_gain}", f"pass logit_gain={new!r}")
        logit_gain = new
    if frames is not None:
        if frames != "head":
            raise ValueError(f"stiefelize: frames={frames!r} is not supported: stiefelize makes one frame per head. "
                             f"For one frame per layer use StiefelMultiheadAttention.from_euclidean(module, "
                             f"frames='layer') or build the model with StiefelMultiheadAttention(..., "
                             f"frames='layer').")
        deprecated("frames='head'", "one frame per head is what stiefelize does; drop the argument")
    if drop_qk_bias is not None:
        deprecated(f"drop_qk_bias={drop_qk_bias}", "pass qk_bias='drop' or 'keep'")
        qk_bias = "drop" if drop_qk_bias else qk_bias
    return logit_gain, qk_bias


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
    pair = _qk_children(module)
    if pair is None:
        names = [n for n, _ in module.named_parameters()][:6]
        return (f"its parameters: {', '.join(names)}; write a Layout naming its query and key weights, e.g. "
                f"Layout('mine', q=Block('<query>.weight'), k=Block('<key>.weight'), head_dim=<int>)")
    q, k = pair
    known = (HEAD_DIM_ATTRS + NUM_HEADS_ATTRS)
    found = next((a for a in known if _is_count(getattr(module, a, None))), None)
    head_dim = "" if found is not None else ", head_dim=<int>"
    heads = f"heads from its {found}={getattr(module, found)}" if found is not None else "no head count found"
    return (f"query/key Linears {q!r}/{k!r}, {heads}; no built-in layout uses these names. Add one: "
            f"stiefelize(model, targets=(*LAYOUTS, Layout('{q}/{k}', q=Block('{q}.weight'), "
            f"k=Block('{k}.weight'){head_dim})))")


def _initial_gain(site: _Site, logit_gain: str | None) -> Tensor | None:
    """The per-query-head gain a site starts with: none, ones (``"learn"``), or the product of the q and k
    blocks' RMS singular values (``"fit"``). A fitted gain must be positive and finite: a zero block would
    give a log-gain of -inf, a head whose logits stay zero for the whole of training."""
    if logit_gain is None:
        return None
    q, k, r = site.q, site.k, site.r
    wq, wk = getattr(q.owner, q.attr), getattr(k.owner, k.attr)
    with torch.no_grad():
        if logit_gain == "learn":
            return torch.ones(q.heads, dtype=wq.dtype, device=wq.device)
        rms_q = _frames_from(wq, q.dim, q.start, q.length, r).flatten(1).norm(dim=1) / math.sqrt(r)
        rms_k = _frames_from(wk, k.dim, k.start, k.length, r).flatten(1).norm(dim=1) / math.sqrt(r)
        gain = rms_q * rms_k.repeat_interleave(q.heads // k.heads)
    bad = [h for h, g in enumerate(gain.tolist()) if not (math.isfinite(g) and g > 0)]
    if bad:
        raise ValueError(f"stiefelize: logit_gain='fit' at {_where(site.path)} gives query head(s) {bad} a gain of "
                         f"{[float(gain[h]) for h in bad]} (an all-zero or non-finite query/key block): such a "
                         f"head's logits would stay zero for the whole of training. Nothing was changed; use "
                         f"logit_gain='learn' (starts at 1) or give those heads non-zero weights first.")
    return gain


def _apply(site: _Site, logit_gain: str | None, gain_rate: float, gain: Tensor | None) -> ConvertedAttention:
    q, k, r = site.q, site.k, site.r
    groups: dict[tuple[int, str], list] = {}
    for p in (q, k):
        groups.setdefault((id(p.owner), p.attr), [p.owner, p.attr, []])[2].append(p)
    for owner, attr, pieces in groups.values():
        weight = getattr(owner, attr)
        specs = [dict(role=p.role, start=p.start, length=p.length, r=r,
                      gain=gain if p.role == "q" else None) for p in pieces]
        _hook_state_dicts(owner, _stock_names(owner))
        parametrize.register_parametrization(owner, attr, _QKWeight(weight, pieces[0].dim, specs, gain_rate),
                                             unsafe=True)
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
    gain_text = "none" if gain is None else (
        "learn (1)" if logit_gain == "learn" else f"fit ({float(gain.min()):.3g}..{float(gain.max()):.3g})")
    return ConvertedAttention(site.path, site.layout.name, q.heads, k.heads, q.d, k.d, r, gain_text)


def _probe(model: nn.Module, batch: Any) -> Tensor:
    was_training = model.training
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
        model.train(was_training)
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


def _our_parametrized(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    found = []
    for path, module in model.named_modules():
        plist = getattr(module, "parametrizations", None)
        if plist is None or not parametrize.is_parametrized(module):
            continue
        for attr in list(plist.keys()):
            if any(isinstance(p, _OURS) for p in plist[attr]):
                found.append((path, module, attr))
    return found


def export_state_dict(model: nn.Module) -> dict[str, Tensor]:
    r"""The state dict of the stock (unconverted) model: its keys, in its order, plain contiguous tensors.

    Since the converter's state-dict hooks write the stock form, this is ``model.state_dict()`` (with every
    tensor detached and contiguous), checked: every weight rebuilt by :func:`stiefelize` is stored under its
    original key (``...c_attn.weight``) with its current value,

    .. math::

        W_Q = \big[\gamma_1 U_{Q,1},\ \dots,\ \gamma_H U_{Q,H}\big]^\top, \qquad
        W_K = \big[U_{K,1},\ \dots,\ U_{K,H_{kv}}\big]^\top,

    and the rest of that weight (value rows) in place, in place of the parametrization's entries; a bias
    held by ``qk_bias="drop"`` is stored under its key with its query/key entries zero. The result loads with
    ``load_state_dict(..., strict=True)`` into the unconverted model class and into a converted one, and
    saves with safetensors. It is the same inside :func:`parametrized_state_dict`.

    Raises
    ------
    ValueError
        When ``model`` holds no stiefelized weight (exporting would silently equal ``model.state_dict()``),
        or when its frames are sharded ``DTensor`` s (FSDP2), whose state dict stays in the parametrized
        form: gather it (``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
        options=StateDictOptions(full_state_dict=True))``), load it into an unsharded converted model and
        export that.
    """
    ours = _our_parametrized(model)
    if not ours:
        raise ValueError("export_state_dict: the model holds no weight converted by stiefelize; use "
                         "model.state_dict() directly.")
    token = _FORM.set("stock")
    try:
        with torch.no_grad():
            state = model.state_dict()
    finally:
        _FORM.reset(token)
    raw = [k for k in state if any(k.startswith(f"{path}.parametrizations." if path else "parametrizations.")
                                   for path, _, _ in ours)]
    if raw:
        raise ValueError(f"export_state_dict: {raw[0]} stays in the parametrized form because its frames are "
                         f"sharded DTensors (FSDP2); gather the full state dict, load it into an unsharded "
                         f"converted model and export that.")
    return {k: v.detach().contiguous() for k, v in state.items()}


def parametrized_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, Tensor]:
    r"""``model.state_dict()`` in the parametrized form: the frames, log-gains and rest as stored.

    A converted model's ``state_dict()`` is the stock model's (see :func:`stiefelize`): loading it back
    recovers each frame from its rebuilt block, bit for bit when the module has no logit gain but only to
    float rounding when it has one (:math:`\gamma_h U_h` is rounded once it is formed). This function writes
    instead the parametrization's own entries (``<owner>.parametrizations.<attr>.original``,
    ``...<attr>.0.q_frames``, ``...0.k_frames``, ``...0.q_log_gain``), so a checkpoint resumes a run exactly;
    ``model.load_state_dict`` takes this form as it is (it is also the form of checkpoints written before the
    stock form existed). A model with nothing converted gives ``model.state_dict()``. Such a dict does not
    load into the stock model class (missing and unexpected keys).

    Parameters
    ----------
    model : nn.Module
    keep_vars : bool, default False
        As for :meth:`torch.nn.Module.state_dict`.

    Returns
    -------
    dict of str to Tensor
    """
    token = _FORM.set("parametrized")
    try:
        return model.state_dict(keep_vars=keep_vars)
    finally:
        _FORM.reset(token)


def unstiefelize(model: nn.Module) -> nn.Module:
    """Remove the parametrizations added by :func:`stiefelize`, in place: every converted weight becomes a
    plain :class:`torch.nn.Parameter` holding its current value (frames times gains, plus the rest), the
    state-dict hooks are removed, and the model's parameters and state dict have the stock names in the
    stock order again. Returns ``model``.

    Raises
    ------
    ValueError
        When ``model`` holds no stiefelized weight.
    """
    ours = _our_parametrized(model)
    if not ours:
        raise ValueError("unstiefelize: the model holds no weight converted by stiefelize; nothing to undo.")
    for _path, module, attr in ours:
        p0 = module.parametrizations[attr][0]
        requires_grad = any(t.requires_grad for t in p0.parameters()) or module.parametrizations[attr].original.requires_grad
        with torch.no_grad():
            parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
        p = getattr(module, attr)
        if not isinstance(p, nn.Parameter) or not p.is_contiguous():  # an empty `original` was a buffer
            setattr(module, attr, nn.Parameter(p.detach().contiguous(), requires_grad=requires_grad))
    for _path, module, _attr in ours:
        hooks = vars(module).get(_HOOKS)
        if hooks is not None:
            order = {name: i for i, name in enumerate(hooks[0])}
            items = sorted(module._parameters.items(), key=lambda kv: order.get(kv[0], len(order)))
            module._parameters.clear()
            module._parameters.update(items)
        _unhook_state_dicts(module)
    for module in model.modules():
        if _MARK in vars(module):
            object.__delattr__(module, _MARK)
    return model


def converted_query_key_frames(model: nn.Module) -> list[tuple[str, Tensor, Tensor]]:
    """``(path, q_frames, k_frames)`` for every attention module converted by :func:`stiefelize`:
    the ``(H, d, r)`` and ``(H_kv, d, r)`` frame parameters, in ``named_modules()`` order."""
    found = []
    for path, module in model.named_modules():
        blocks = vars(module).get(_MARK)
        if blocks is None:
            continue
        frames = []
        for role, param in zip(("q", "k"), blocks, strict=True):
            owner, attr = _owner(module, param)
            frames.append(getattr(owner.parametrizations[attr][0], f"{role}_frames"))
        found.append((path, frames[0], frames[1]))
    return found


__getattr__ = _deprecated.renamed_names(__name__, globals(), {
    "ConversionReport": ("ConversionResult", "what stiefelize returns; a 'report' is a study's report")})
