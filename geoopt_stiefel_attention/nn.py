r"""Multi-head attention with query/key projections on the Stiefel manifold, and helpers to use it.

Two modules share one constructor, one parameter layout, one initialisation and one forward pass:

- :class:`StiefelMultiheadAttention`: ``w_q`` and ``w_k`` are :class:`geoopt.ManifoldParameter` s on
  :class:`~geoopt_stiefel_attention.PolarStiefel` (stacks of frames with orthonormal columns);
- :class:`EuclideanMultiheadAttention`: the same tensors as plain :class:`torch.nn.Parameter` s.

Built with the same ``generator`` seed, the two differ only in ``w_q`` and ``w_k``, and the Stiefel frames are
the polar factors of the Euclidean matrices: an experiment's two arms start from the same random numbers.

Helpers: :func:`stiefelize` (from :mod:`geoopt_stiefel_attention.convert`, re-exported here) converts the
attention of an existing model in place, :func:`param_groups`
splits a model's parameters into frames / decayed matrices / no-decay parameters for an optimizer,
:func:`frame_parameters` lists the frames and :func:`query_key_projections` lists ``(path, w_q, w_k)`` of
every attention module of this library and of every module converted by :func:`stiefelize`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import geoopt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _attention_docs as _docs
from . import _guard, _torch_mha
from ._docfrag import fill

# param_groups and its kin live in ._groups (which does not import this module), public here as they have always been
from ._groups import GROUP_NAMES as GROUP_NAMES
from ._groups import decays_matrices as decays_matrices
from ._groups import frame_parameters, param_groups, project_frames_
from ._linalg import ORTHONORMALITY_TOLERANCE, orthonormality_error

# The converter lives in .convert, which does not import this module (no cycle); its stiefelize is re-exported
# here. The module-replacement helpers of from_euclidean/from_torch are at the end of this module.
from .convert import converted_query_key_frames, stiefelize
from .integrations import averaging as _averaging
from .integrations.casts import _FrameOwner
from .integrations.optimizers import warn_if_saved_off_manifold
from .manifolds import PolarStiefel

__all__ = [
    "FRAME_GRANULARITIES",
    "StiefelMultiheadAttention",
    "EuclideanMultiheadAttention",
    "stiefelize",
    "param_groups",
    "frame_parameters",
    "project_frames_",
    "query_key_projections",
]

#: The frame granularities: the accepted values of the ``frames`` option (how many frames a query or key
#: projection is cut into: ``"head"``, one frame per head; ``"layer"``, one frame for all heads). Not to be
#: confused with a :class:`~geoopt_stiefel_attention.Layout` (where a model stores its attention weights).
FRAME_GRANULARITIES = ("head", "layer")


# ---------------------------------------------------------------------------------------------- layout helpers
def _heads_to_flat(w: Tensor) -> Tensor:
    """``(H, d, Dh)`` per-head blocks -> ``(d, H*Dh)`` matrix whose columns ``h*Dh:(h+1)*Dh`` are head ``h``."""
    h, d, dh = w.shape
    return w.permute(1, 0, 2).reshape(d, h * dh)


def _flat_to_heads(m: Tensor, num_heads: int) -> Tensor:
    """Inverse of :func:`_heads_to_flat`."""
    d, n = m.shape
    return m.reshape(d, num_heads, n // num_heads).permute(1, 0, 2).contiguous()


def _check_int(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} is invalid; pass an int >= {minimum}.")
    return value


def _refuse_unsupported(owner: str, *, add_bias_kv: Any, add_zero_attn: Any) -> None:
    """The two options of ``nn.MultiheadAttention`` that these modules do not implement: refuse them by name."""
    if add_bias_kv:
        raise ValueError(
            f"{owner}: add_bias_kv={add_bias_kv!r} is not supported: it appends a learned key/value row to "
            f"every sequence, a bias that lies outside the query/key frames and that this module does not "
            f"implement. Build it with add_bias_kv=False.")
    if add_zero_attn:
        raise ValueError(
            f"{owner}: add_zero_attn={add_zero_attn!r} is not supported: it appends an all-zero key/value "
            f"row to every sequence, which this module does not implement. Build it with add_zero_attn=False.")


# ---------------------------------------------------------------------------------------------- the modules
_NO_OUT_PROJ = ("this library's attention modules have no out_proj Linear: the output projection is w_o, "
                "(num_heads * head_dim, embed_dim), with y = concat_h(o_h) @ w_o + b_o")


class _NotATensor:
    """``out_proj.weight`` and ``out_proj.bias`` of this library's attention modules, which have no torch
    ``out_proj`` Linear (their output projection is ``w_o``, ``b_o``).

    ``nn.TransformerEncoder.forward`` (eval mode, a ``src_key_padding_mask``, ``enable_nested_tensor=True``) reads
    ``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight`` and ``out_proj.bias`` of its first layer's
    ``self_attn``, with no check that it is torch's module, to decide whether to pack the batch into a nested
    tensor for torch's fused kernels (which take torch's weights); reading a missing ``out_proj`` raised
    ``AttributeError``. This object has a ``__torch_function__``, so torch's ``has_torch_function`` flags it and
    the encoder declines that path ("some Tensor argument has_torch_function"): its layers run on the padded
    batch with the padding mask, the path any encoder takes in training. Using it as a tensor (a torch function,
    or an attribute such as ``.shape``) raises, naming ``w_o``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func.__name__ if hasattr(func, '__name__') else func}: {_NO_OUT_PROJ}.")

    def __getattr__(self, attr: str):
        raise AttributeError(f"out_proj.{self.name}.{attr}: {_NO_OUT_PROJ}.")

    def __repr__(self) -> str:
        return f"<no out_proj.{self.name}: {_NO_OUT_PROJ}>"


class _NoOutProj:
    """``self_attn.out_proj`` of this library's attention modules, for ``nn.TransformerEncoder``'s fast-path
    checks only (:class:`_NotATensor`)."""

    __slots__ = ()
    weight = _NotATensor("weight")
    bias = _NotATensor("bias")

    def __repr__(self) -> str:
        return "<no out_proj Linear: the output projection is w_o>"


def _warn_off_manifold_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state-dict post hook: warn when ``w_q``/``w_k`` are off the manifold as they are saved (the last step of an
    optimizer that does not know the constraint, which no training forward sees: :mod:`.integrations.optimizers`).
    Kept here by name: modules pickled whole refer to it."""
    warn_if_saved_off_manifold(prefix.rstrip(".") or type(module).__name__,
                               (("w_q", module.w_q), ("w_k", module.w_k)), where="state_dict()",
                               consequence="The state dict holds the frames as they are.", stacklevel=3)


class _MultiheadAttentionBase(nn.Module):
    """Shared configuration, layout, initialisation and forward pass of the two attention modules."""

    #: whether a training forward pass checks that ``w_q``/``w_k`` are on the manifold (:mod:`._guard`)
    _checks_frames = False
    #: whether the module is the Euclidean arm of a paired experiment by design: :func:`param_groups` (which does not
    #: import this module) expects no frame in a model that holds one
    _euclidean_by_design = False

    #: ``None`` tells ``nn.TransformerEncoderLayer`` that there is no fused ``in_proj`` (so its fused
    #: inference fast path, which would read these tensors, is never taken).
    in_proj_weight = None
    in_proj_bias = None
    #: Not a Linear and no tensors: ``out_proj.weight``/``out_proj.bias`` are read by ``nn.TransformerEncoder``'s
    #: nested-tensor fast-path checks, which they make decline that path, so that the module runs inside an
    #: encoder built with ``enable_nested_tensor=True``. The output projection is ``w_o`` (and ``b_o``).
    out_proj = _NoOutProj()

    _owner = "MultiheadAttention"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        head_dim: int | None = None,
        frames: str = "head",
        logit_gain: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        _refuse_unsupported(owner, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
        self._configure(embed_dim, num_heads, head_dim=head_dim, dropout=dropout, bias=bias, kdim=kdim,
                        vdim=vdim, batch_first=batch_first, frames=frames, logit_gain=logit_gain)
        self._install(self._draw(generator=generator, device=device, dtype=dtype), logit_gain=logit_gain)
        if self._checks_frames:
            self.register_state_dict_post_hook(_warn_off_manifold_on_save)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # modules pickled before ``batch_first`` became an option were batch-first
        state.setdefault("batch_first", True)
        super().__setstate__(state)

    # -------------------------------------------------------------------------------- configuration
    def _configure(self, embed_dim, num_heads, *, head_dim, dropout, bias, kdim, vdim, batch_first, frames,
                   logit_gain) -> None:
        owner = type(self).__name__
        for name, flag in (("bias", bias), ("batch_first", batch_first), ("logit_gain", logit_gain)):
            if not isinstance(flag, bool):
                raise TypeError(f"{owner}: {name}={flag!r} is invalid; pass True or False.")
        embed_dim = _check_int(owner, "embed_dim", embed_dim)
        num_heads = _check_int(owner, "num_heads", num_heads)
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"{owner}: embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                                 f"change one of them or pass head_dim explicitly.")
            head_dim = embed_dim // num_heads
        head_dim = _check_int(owner, "head_dim", head_dim)
        kdim = embed_dim if kdim is None else _check_int(owner, "kdim", kdim)
        vdim = embed_dim if vdim is None else _check_int(owner, "vdim", vdim)
        if frames not in FRAME_GRANULARITIES:
            raise ValueError(f"{owner}: frames={frames!r} is not a frame granularity; use 'head' (one frame per "
                             f"head) or 'layer' (one frame for all heads).")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{owner}: dropout={dropout!r} is invalid; pass a float in [0, 1).")
        r = head_dim if frames == "head" else num_heads * head_dim
        what = "head_dim" if frames == "head" else "num_heads * head_dim"
        for name, d in (("embed_dim", embed_dim), ("kdim", kdim)):
            if r > d:
                raise ValueError(
                    f"{owner}: a frame in St({name}={d}, {r}) needs {what}={r} <= {name}; orthonormal columns "
                    f"cannot outnumber rows. Use fewer/smaller heads"
                    + (" or frames='head'." if frames == "layer" else "."))
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.kdim = kdim
        self.vdim = vdim
        self.frames = frames
        self.dropout = float(dropout)
        self.bias = bias
        self.batch_first = batch_first

    @property
    def _qkv_same_embed_dim(self) -> bool:
        # read by nn.TransformerEncoderLayer's fast-path checks
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim

    def _config(self) -> dict[str, Any]:
        return dict(embed_dim=self.embed_dim, num_heads=self.num_heads, head_dim=self.head_dim,
                    dropout=self.dropout, bias=self.bias, kdim=self.kdim, vdim=self.vdim,
                    batch_first=self.batch_first, frames=self.frames, logit_gain=self.logit_gain is not None)

    # -------------------------------------------------------------------------------- parameters
    def _draw(self, *, generator, device, dtype) -> dict[str, Tensor | None]:
        """The Euclidean initialisation in flat layout (identical for both classes).

        Each projection ``(fan_in, fan_out)`` is drawn, in the order Q, K, V, O, from
        :math:`U(-a, a)` with :math:`a = \\sqrt{6 / (\\text{fan_in} + \\text{fan_out})}` (Xavier-uniform per
        projection); biases are zero and log-gains zero.
        """
        dtype = torch.get_default_dtype() if dtype is None else dtype
        draw_device = generator.device if generator is not None else device
        n = self.num_heads * self.head_dim

        def uniform(fan_in: int, fan_out: int) -> Tensor:
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            u = torch.rand((fan_in, fan_out), generator=generator, dtype=dtype, device=draw_device)
            w = (2.0 * u - 1.0) * bound
            return w if device is None else w.to(device)

        weights: dict[str, Tensor | None] = {
            "q": uniform(self.embed_dim, n),
            "k": uniform(self.kdim, n),
            "v": uniform(self.vdim, n),
            "o": uniform(n, self.embed_dim),
        }
        zeros = dict(dtype=dtype, device=weights["q"].device)
        weights["b_v"] = torch.zeros(n, **zeros) if self.bias else None
        weights["b_o"] = torch.zeros(self.embed_dim, **zeros) if self.bias else None
        weights["gain"] = None
        return weights

    def _frame_layout(self, flat: Tensor) -> Tensor:
        """Flat ``(d, H*Dh)`` -> ``(H, d, Dh)`` (frames='head') or ``(1, d, H*Dh)`` (frames='layer')."""
        return _flat_to_heads(flat, self.num_heads) if self.frames == "head" else flat.unsqueeze(0).contiguous()

    def _flat(self, w: Tensor) -> Tensor:
        """Inverse of :meth:`_frame_layout`."""
        return _heads_to_flat(w) if self.frames == "head" else w[0]

    def _wrap_frame(self, w: Tensor) -> nn.Parameter:
        raise NotImplementedError

    def _install(self, weights: dict[str, Tensor | None], *, logit_gain: bool = False) -> None:
        """Create the parameters from flat weights (``q, k, v, o, b_v, b_o, gain``)."""
        h = self.num_heads
        with torch.no_grad():
            self.w_q = self._wrap_frame(self._frame_layout(weights["q"].detach()))
            self.w_k = self._wrap_frame(self._frame_layout(weights["k"].detach()))
            self.w_v = nn.Parameter(_flat_to_heads(weights["v"].detach(), h).clone())
            self.w_o = nn.Parameter(weights["o"].detach().clone())
            if self.bias:
                self.b_v = nn.Parameter(weights["b_v"].detach().clone())
                self.b_o = nn.Parameter(weights["b_o"].detach().clone())
            else:
                self.register_parameter("b_v", None)
                self.register_parameter("b_o", None)
            gain = weights.get("gain")
            if gain is None and logit_gain:
                gain = torch.zeros(h, dtype=self.w_o.dtype, device=self.w_o.device)
            if gain is not None:
                self.logit_gain = nn.Parameter(gain.detach().clone())
            else:
                self.register_parameter("logit_gain", None)

    def _export(self) -> dict[str, Tensor | None]:
        """The current parameters in flat layout (detached clones)."""
        with torch.no_grad():
            return {
                "q": self._flat(self.w_q.detach()).clone(),
                "k": self._flat(self.w_k.detach()).clone(),
                "v": _heads_to_flat(self.w_v.detach()).clone(),
                "o": self.w_o.detach().clone(),
                "b_v": None if self.b_v is None else self.b_v.detach().clone(),
                "b_o": None if self.b_o is None else self.b_o.detach().clone(),
                "gain": None if self.logit_gain is None else self.logit_gain.detach().clone(),
            }

    @classmethod
    def _build(cls, config: dict[str, Any], weights: dict[str, Tensor | None], *, training: bool = True):
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        cfg = dict(config)
        logit_gain = cfg.pop("logit_gain")
        obj._configure(**cfg, logit_gain=logit_gain)
        obj._install(weights, logit_gain=logit_gain)
        obj.train(training)
        return obj

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Redraw every parameter as the constructor does (from ``generator``, or torch's global RNG), in place:
        the parameter objects (which an optimizer may hold) and their ``requires_grad`` are kept, as by
        :meth:`torch.nn.MultiheadAttention._reset_parameters`."""
        held = dict(self.named_parameters(recurse=False))
        self._install(self._draw(generator=generator, device=self.w_o.device, dtype=self.w_o.dtype),
                      logit_gain=self.logit_gain is not None)
        with torch.no_grad():
            for name, fresh in list(self.named_parameters(recurse=False)):
                old = held.get(name)
                if old is not None and old.shape == fresh.shape and old.dtype == fresh.dtype:
                    old.copy_(fresh)
                    setattr(self, name, old)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}, frames={self.frames!r}, "
                f"dropout={self.dropout}, bias={self.bias}, logit_gain={self.logit_gain is not None}")

    # -------------------------------------------------------------------------------- forward
    def _masks(self, key_padding_mask, attn_mask, batch: int, tq: int, tk: int, dtype) -> Tensor | None:
        """Merge the masks into one additive float mask broadcastable to ``(B, H, Tq, Tk)``, or ``None``."""
        owner = type(self).__name__
        h = self.num_heads

        def additive(mask: Tensor, name: str) -> Tensor:
            if mask.dtype == torch.bool:
                return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
            if not torch.is_floating_point(mask):
                raise TypeError(f"{owner}: {name} has dtype {mask.dtype}; pass a bool mask (True = masked out) "
                                f"or a floating-point mask (added to the logits).")
            return mask.to(dtype)

        merged = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, tk):
                raise ValueError(f"{owner}: key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected "
                                 f"(batch, key_len) = {(batch, tk)}.")
            merged = additive(key_padding_mask, "key_padding_mask").view(batch, 1, 1, tk)
        if attn_mask is not None:
            if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (tq, tk):
                am = attn_mask.view(1, 1, tq, tk)
            elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (batch * h, tq, tk):
                am = attn_mask.view(batch, h, tq, tk)
            else:
                raise ValueError(f"{owner}: attn_mask has shape {tuple(attn_mask.shape)}; expected "
                                 f"(query_len, key_len) = {(tq, tk)} or (batch * num_heads, query_len, key_len) "
                                 f"= {(batch * h, tq, tk)}.")
            am = additive(am, "attn_mask")
            merged = am if merged is None else merged + am
        return merged

    def _batched(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
        """Check the inputs' ranks and bring them to ``(batch, seq, features)``: ``(query, key, value,
        key_padding_mask, unbatched)``, an unbatched call getting a batch of one."""
        owner = type(self).__name__
        if query.is_nested or key.is_nested or value.is_nested:
            raise ValueError(f"{owner}: nested (jagged) tensors are not supported; pad the sequences to one "
                             f"length and pass key_padding_mask (True = padding).")
        unbatched = query.dim() == 2
        if unbatched:
            if key.dim() != 2 or value.dim() != 2:
                raise ValueError(f"{owner}: unbatched query (2-D) needs 2-D key and value, got key.dim()="
                                 f"{key.dim()}, value.dim()={value.dim()}.")
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:
                    raise ValueError(f"{owner}: with an unbatched (2-D) query, key_padding_mask must be 1-D "
                                     f"(key_len,), got shape {tuple(key_padding_mask.shape)}.")
                key_padding_mask = key_padding_mask.unsqueeze(0)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            layout = "(batch, seq, features)" if self.batch_first else "(seq, batch, features)"
            raise ValueError(f"{owner}: query, key and value must be batched {layout} (batch_first="
                             f"{self.batch_first}) or unbatched (seq, features); got dims {query.dim()}, "
                             f"{key.dim()}, {value.dim()}.")
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        return query, key, value, key_padding_mask, unbatched

    def _check_sizes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """Check the feature sizes against the module's and the batch and key lengths against each other (the
        inputs batch-first)."""
        owner = type(self).__name__
        b, _, e = query.shape
        tk = key.shape[1]
        if e != self.embed_dim or key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(f"{owner}: feature sizes (query, key, value) = ({e}, {key.shape[-1]}, "
                             f"{value.shape[-1]}) do not match (embed_dim, kdim, vdim) = "
                             f"({self.embed_dim}, {self.kdim}, {self.vdim}).")
        if key.shape[0] != b or value.shape[0] != b or value.shape[1] != tk:
            raise ValueError(f"{owner}: batch/sequence sizes disagree (batch_first={self.batch_first}): "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} "
                             f"as (batch, seq, features).")

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head queries (times the logit gains), keys and values (plus ``b_v``), each ``(B, H, T, Dh)``."""
        h, dh = self.num_heads, self.head_dim
        b, tq = query.shape[:2]
        tk = key.shape[1]
        w_q = self._flat(self.w_q)
        w_k = self._flat(self.w_k)
        w_v = _heads_to_flat(self.w_v)
        q = (query @ w_q).reshape(b, tq, h, dh).transpose(1, 2)
        k = (key @ w_k).reshape(b, tk, h, dh).transpose(1, 2)
        v = value @ w_v
        if self.b_v is not None:
            v = v + self.b_v.to(v.dtype)  # .to: keep autocast's dtype (SDPA needs q, k, v alike)
        v = v.reshape(b, tk, h, dh).transpose(1, 2)
        if self.logit_gain is not None:
            q = q * self.logit_gain.exp().to(q.dtype).view(1, h, 1, 1)
        return q, k, v

    def _attend_with_weights(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, *,
                             average_attn_weights: bool) -> tuple[Tensor, Tensor]:
        """The attention written out (``need_weights=True``): ``(heads, weights)``, the weights after dropout and
        averaged over heads when ``average_attn_weights``."""
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p, training=True)
        heads = weights @ v
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return heads, weights

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        owner = type(self).__name__
        query, key, value, key_padding_mask, unbatched = self._batched(query, key, value, key_padding_mask)
        self._check_sizes(query, key, value)
        b, tq = query.shape[:2]
        tk = key.shape[1]
        # called here, not in a helper: the warning of check_at_evaluation names the caller of the module
        if self._checks_frames and torch.is_grad_enabled():
            _guard.check_frame_tensors(owner, (("w_q", self.w_q), ("w_k", self.w_k)))
        elif self._checks_frames:
            _averaging.check_at_evaluation(owner, [("w_q", self.w_q), ("w_k", self.w_k)], self)

        q, k, v = self._project(query, key, value)
        if is_causal and attn_mask is None and (key_padding_mask is not None or need_weights):
            attn_mask = torch.ones(tq, tk, dtype=torch.bool, device=query.device).triu(diagonal=1)
        use_sdpa_causal = is_causal and attn_mask is None
        mask = self._masks(key_padding_mask, attn_mask, b, tq, tk, q.dtype)
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            heads, weights = self._attend_with_weights(q, k, v, mask, dropout_p,
                                                       average_attn_weights=average_attn_weights)
            if unbatched:
                weights = weights.squeeze(0)
        else:
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                   is_causal=use_sdpa_causal)
        out = heads.transpose(1, 2).reshape(b, tq, self.num_heads * self.head_dim) @ self.w_o
        if self.b_o is not None:
            out = out + self.b_o.to(out.dtype)
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


class StiefelMultiheadAttention(_FrameOwner, _MultiheadAttentionBase):
    __doc__ = r"""Multi-head attention whose query and key projections are Stiefel frames.

    ``w_q`` and ``w_k`` are :class:`geoopt.ManifoldParameter` s on
    :class:`~geoopt_stiefel_attention.PolarStiefel`: every frame :math:`W` satisfies :math:`W^\top W = I`.
    Train them with :class:`~geoopt_stiefel_attention.StiefelAdam` (or any geoopt Riemannian optimizer);
    a stock torch optimizer would move them off the manifold. The initial frames are the polar factors
    :math:`W = A (A^\top A)^{-1/2}` of the Euclidean draw :math:`A` that :class:`EuclideanMultiheadAttention`
    makes from the same generator; everything else is identical.

    Constructor and call interface are those of :class:`torch.nn.MultiheadAttention` (both layouts via
    ``batch_first``, unbatched inputs, bool and float masks, ``need_weights=True`` by default), so a
    :class:`torch.nn.TransformerEncoderLayer` accepts the module as its ``self_attn`` (see :func:`stiefelize`),
    also inside an :class:`torch.nn.TransformerEncoder` built with ``enable_nested_tensor=True``: a padded batch
    then runs on the encoder's ordinary path with the padding mask (its nested-tensor fast path, torch's fused
    kernels, is declined; ``out_proj`` exists for that check only and is no tensor: the output projection is
    ``w_o``).
    Differences: no query/key biases, ``add_bias_kv``/``add_zero_attn`` are refused, and ``is_causal=True``
    without ``attn_mask`` applies the causal mask instead of raising.

    Frames are orthonormal to the precision of the dtype they are held in. A cast to a more precise dtype
    (``.double()`` or ``.to(torch.float64)`` of a float32 module, ``.float()`` of a half one) re-projects them
    to the new precision, keeping the parameter objects; a cast to a coarser one (``.half()``,
    ``.bfloat16()``) rounds them, which StiefelAdam's tolerance for that dtype accepts. A frame that was off
    the manifold before the cast is left as it is (see
    ``geoopt_stiefel_attention.integrations.casts.reproject_after_cast_``).
""" + _docs.LAYOUT_DOC + _docs.CONSTRUCTOR_DOC + r"""
    Examples
    --------
    >>> import torch
    >>> from geoopt_stiefel_attention import StiefelMultiheadAttention
    >>> attn = StiefelMultiheadAttention(32, 4, batch_first=True, generator=torch.Generator().manual_seed(0))
    >>> x = torch.randn(2, 5, 32)
    >>> y, w = attn(x, x, x)
    >>> y.shape, w.shape, attn.w_q.shape
    (torch.Size([2, 5, 32]), torch.Size([2, 5, 5]), torch.Size([4, 32, 8]))
    >>> attn.w_q.manifold.check_point_on_manifold(attn.w_q)
    True
"""

    _checks_frames = True
    _FRAME_PARAMS = ("w_q", "w_k")  # its frames, by name (read by distributed.flattened_by_fsdp1)

    def _wrap_frame(self, w: Tensor) -> nn.Parameter:
        manifold = PolarStiefel()
        return geoopt.ManifoldParameter(manifold.projx(w), manifold=manifold)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """``load_state_dict`` keeps ``w_q``/``w_k`` frames: a loaded matrix that is not orthonormal (a Euclidean
        module's weights share these keys and shapes) is replaced by its polar factor with a ``UserWarning``
        (to carry a Euclidean module's function over, use :meth:`from_euclidean` instead); a frame saved in a coarser
        dtype (a float32 checkpoint loaded into a float64 module), off the manifold by that dtype's rounding only, is
        re-projected silently, as by a cast (``.double()``). ``assign=True``
        installs the loaded tensors as :class:`geoopt.ManifoldParameter` s on the frame's manifold, keeping
        ``requires_grad``, rather than as plain parameters that no frame optimizer would see. Sharded (``DTensor``)
        frames load as torch loads them; the frame check of a training forward covers them."""
        assign = local_metadata.get("assign_to_params_buffers", False)
        for name in ("w_q", "w_k"):
            key, current = prefix + name, getattr(self, name, None)
            given = state_dict.get(key)
            if not isinstance(given, Tensor) or not isinstance(current, Tensor) or given.shape != current.shape \
                    or given.device.type == "meta" or not given.is_floating_point():
                continue  # torch reports a missing key or a shape mismatch itself
            if getattr(given, "_local_tensor", None) is not None or getattr(current, "_local_tensor", None) is not None:
                continue  # sharded (DTensor) frames: the training forward's frame check covers them
            # the frame is checked in, and its polar factor kept in, the dtype the frame will have: the module's
            # (loaded by copy_), or the state dict's (assign=True)
            target = given.dtype if assign else current.dtype
            tol = ORTHONORMALITY_TOLERANCE.get(target, 1e-4)
            # a frame saved in a coarser dtype (a float32 checkpoint, a float64 module) is off by its rounding
            rounding = max(tol, ORTHONORMALITY_TOLERANCE.get(given.dtype, tol))
            with torch.no_grad():
                err = float(orthonormality_error(given.detach().to(target)))
                if tol < err <= rounding:  # re-projected to this dtype's precision, as after .double()
                    given = PolarStiefel().projx(given.detach().to(target))
                elif not err <= tol:
                    warnings.warn(f"load_state_dict: {key} is not orthonormal (max|W^T W - I| = {err:.3g} > {tol:g}; "
                                  f"a Euclidean module's weights?); its polar factor is loaded. To carry a Euclidean "
                                  f"module's function over, use StiefelMultiheadAttention.from_euclidean.",
                                  UserWarning, stacklevel=3)
                    given = PolarStiefel().projx(given.detach().to(target))
            if assign and not isinstance(given, geoopt.ManifoldParameter):
                given = geoopt.ManifoldParameter(given.detach(), manifold=current.manifold,
                                                 requires_grad=current.requires_grad)
            state_dict[key] = given
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @classmethod
    def from_euclidean(
        cls,
        source: nn.Module,
        *,
        frames: str | None = None,
        logit_gain: bool | None = None,
        drop_qk_bias: bool = False,
        ignore_batch_first: bool = False,
    ) -> StiefelMultiheadAttention:
        r"""A Stiefel module from a :class:`torch.nn.MultiheadAttention` or an :class:`EuclideanMultiheadAttention`.

        Every query/key frame is the polar factor :math:`A (A^\top A)^{-1/2}` of the source's corresponding
        block :math:`A` (per head for ``frames="head"``, the whole projection for ``"layer"``): the closest
        frame in Frobenius norm. Values, output projection, biases and gains are copied exactly; device,
        dtype, dropout and training mode follow the source. When the source's blocks are already
        orthonormal the converted module computes the same function.

        Parameters
        ----------
        source : nn.MultiheadAttention or EuclideanMultiheadAttention
            The module to convert (left unchanged).
        frames : {"head", "layer"}, optional
            Frame granularity (:data:`FRAME_GRANULARITIES`); default the source's (``"head"`` for
            ``nn.MultiheadAttention``).
        logit_gain : bool, optional
            Add per-head log-gains (initialised to 0, so the function is unchanged); default the source's
            (``False`` for ``nn.MultiheadAttention``).
        drop_qk_bias : bool, default False
            ``nn.MultiheadAttention`` may carry query/key biases, which this module does not have. The key
            bias is always dropped, exactly: it adds :math:`q_i^\top b_K` to every logit of query ``i``, a
            constant the softmax ignores. A non-zero query bias :math:`b_Q` adds :math:`b_Q^\top k_j`, which
            does change the attention, so conversion is refused unless ``drop_qk_bias=True``.
        ignore_batch_first : bool, default False
            By default the new module keeps the source's ``batch_first``. ``True`` builds a batch-first module
            whatever the source's layout (then pass ``(batch, seq, embed)`` inputs).

        Raises
        ------
        ValueError
            For ``add_bias_kv``, ``add_zero_attn``, a non-zero query bias without ``drop_qk_bias``, or a
            frame granularity whose frames cannot exist.
        TypeError
            For another kind of source.
        """
        return _convert(cls, source, frames=frames, logit_gain=logit_gain, drop_qk_bias=drop_qk_bias,
                        ignore_batch_first=ignore_batch_first)


_MultiheadAttentionBase.forward.__doc__ = _docs.FORWARD_DOC


class EuclideanMultiheadAttention(_MultiheadAttentionBase):
    __doc__ = r"""Multi-head attention with the layout and initialisation of :class:`StiefelMultiheadAttention`,
    every parameter a plain :class:`torch.nn.Parameter`: the Euclidean arm of a paired experiment.

    Built from the same ``generator`` seed, it holds exactly the same ``w_v``, ``w_o``, biases and gains as
    the Stiefel module, and ``w_q``/``w_k`` whose polar factors are the Stiefel frames.
""" + _docs.LAYOUT_DOC + _docs.CONSTRUCTOR_DOC + r"""
    Examples
    --------
    >>> import torch
    >>> from geoopt_stiefel_attention import EuclideanMultiheadAttention, StiefelMultiheadAttention
    >>> e = EuclideanMultiheadAttention(32, 4, generator=torch.Generator().manual_seed(0))
    >>> s = StiefelMultiheadAttention(32, 4, generator=torch.Generator().manual_seed(0))
    >>> torch.equal(e.w_v, s.w_v), torch.equal(e.w_o, s.w_o)
    (True, True)
"""

    _euclidean_by_design = True

    def _wrap_frame(self, w: Tensor) -> nn.Parameter:
        return nn.Parameter(w.clone())

    @classmethod
    def from_stiefel(cls, source: StiefelMultiheadAttention) -> EuclideanMultiheadAttention:
        """A Euclidean module holding exactly the parameters of ``source`` (frames become plain matrices).

        Parameters
        ----------
        source : StiefelMultiheadAttention
            The module to copy (left unchanged).

        Returns
        -------
        EuclideanMultiheadAttention
            The new module, in ``source``'s training mode.
        """
        if not isinstance(source, StiefelMultiheadAttention):
            raise TypeError(f"EuclideanMultiheadAttention.from_stiefel: expected a StiefelMultiheadAttention, "
                            f"got {type(source).__name__}.")
        return cls._build(source._config(), source._export(), training=source.training)

    @classmethod
    def from_torch(cls, source: nn.MultiheadAttention, *, frames: str = "head", drop_qk_bias: bool = False,
                   ignore_batch_first: bool = False) -> EuclideanMultiheadAttention:
        r"""A Euclidean module computing what the :class:`torch.nn.MultiheadAttention` ``source`` computes.

        Weights are copied exactly (re-laid out); the options and refusals are those of
        :meth:`StiefelMultiheadAttention.from_euclidean`.

        Parameters
        ----------
        source : nn.MultiheadAttention
            The module to copy (left unchanged).
        frames : {"head", "layer"}, default "head"
            Frame granularity (:data:`FRAME_GRANULARITIES`) of the layout the weights are copied into.
        drop_qk_bias : bool, default False
            Drop the query/key biases, which this module does not have (the key bias exactly; a non-zero query
            bias :math:`b_Q` changes the logits by :math:`b_Q^\top k_j`, so without this flag it is refused).
        ignore_batch_first : bool, default False
            Build a batch-first module whatever ``source.batch_first`` is (by default it is kept).

        Returns
        -------
        EuclideanMultiheadAttention
            The new module, in ``source``'s training mode.
        """
        if not isinstance(source, nn.MultiheadAttention):
            raise TypeError(f"EuclideanMultiheadAttention.from_torch: expected nn.MultiheadAttention, got "
                            f"{type(source).__name__}.")
        config, weights = _source_parts(source, drop_qk_bias=drop_qk_bias, ignore_batch_first=ignore_batch_first)
        config["frames"] = frames
        return cls._build(config, weights, training=source.training)


@fill
def query_key_projections(model: nn.Module) -> list[tuple[str, Tensor, Tensor]]:
    """``(module path, w_q, w_k)`` for every attention module of ``model`` with separate query/key tensors,
    in ``named_modules()`` order: :class:`StiefelMultiheadAttention` and :class:`EuclideanMultiheadAttention`
    (their ``w_q``/``w_k``), and modules converted by :func:`~geoopt_stiefel_attention.stiefelize` (their
    ``(H, d, r)`` query frames and ``(H_kv, d, r)`` key frames).

    The tensors are the parameters themselves (the library's two classes share one layout), so two arms of
    an experiment can be compared entry by entry; clone them to record a starting point, e.g.
    ``start = [w.detach().clone() for _, w, _ in query_key_projections(model)]``. Unconverted
    ``nn.MultiheadAttention`` modules are not listed (their projections are fused into ``in_proj_weight``).

    {{parameters_model}}

    Returns
    -------
    list of (str, torch.Tensor, torch.Tensor)
        ``(path, w_q, w_k)`` per attention module, as above.
    """
    found = [(path, m.w_q, m.w_k) for path, m in model.named_modules() if isinstance(m, _MultiheadAttentionBase)]
    found += converted_query_key_frames(model)
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(found, key=lambda item: order[item[0]])


# ---------------------------------------------------------------------------------------------- module replacement
# from_euclidean/from_torch: a module of this library or a torch nn.MultiheadAttention, read as a config
# and flat weights, rebuilt as another module of this library (stiefelize, in .convert, converts in place)
def _convert(cls: type, source: nn.Module, *, frames: str | None, logit_gain: bool | None, drop_qk_bias: bool,
             ignore_batch_first: bool, path: str | None = None) -> nn.Module:
    """Build a library attention module ``cls`` from ``source``'s configuration and weights (used by
    :meth:`~geoopt_stiefel_attention.StiefelMultiheadAttention.from_euclidean` and ``from_torch``)."""
    config, weights = _source_parts(source, drop_qk_bias=drop_qk_bias, ignore_batch_first=ignore_batch_first,
                                    path=path)
    if frames is not None:
        config["frames"] = frames
    if logit_gain is not None:
        config["logit_gain"] = bool(logit_gain)
        if not logit_gain:
            weights["gain"] = None
    return cls._build(config, weights, training=source.training)


def _source_parts(source: nn.Module, *, drop_qk_bias: bool, ignore_batch_first: bool,
                  path: str | None = None) -> tuple[dict[str, Any], dict[str, Tensor | None]]:
    """Configuration and flat weights of a module that can be converted; ``ValueError`` naming why not."""
    where = f"module {path!r} " if path is not None else ""
    if isinstance(source, _MultiheadAttentionBase):
        config = source._config()
        if ignore_batch_first:
            config["batch_first"] = True
        return config, source._export()
    if not isinstance(source, nn.MultiheadAttention):
        raise TypeError(f"{where}({type(source).__name__}) is not an nn.MultiheadAttention or an "
                        f"EuclideanMultiheadAttention; nothing to convert.")
    return _torch_mha.torch_mha_parts(source, name=f"{where}(nn.MultiheadAttention)", drop_qk_bias=drop_qk_bias,
                                      ignore_batch_first=ignore_batch_first)
