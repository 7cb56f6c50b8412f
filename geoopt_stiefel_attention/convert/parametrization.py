r"""The parametrizations :func:`~geoopt_stiefel_attention.stiefelize` registers: a query/key weight rebuilt from
its ``(heads, d, r)`` frames (:class:`_QKWeight`), and a bias whose query/key entries are held at zero
(:class:`_ZeroQKBias`), with the small helpers that find a dotted parameter and cut a weight into head blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import geoopt
import torch
from torch import Tensor, nn

from .. import _guard
from ..manifolds import PolarStiefel, frame_dtypes, reproject_after_cast_

#: Marker attribute set on a converted attention module (read by :func:`converted_query_key_frames`).
_MARK = "_stiefel_layout"

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

    def __init__(self, weight: Tensor, dim: int, pieces: list[dict[str, Any]], gain_rate: float,
                 label: str = "converted weight") -> None:
        super().__init__()
        self.dim = dim
        self.label = label  # where the weight lives, for the frame check's message
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
        if torch.is_grad_enabled():
            _guard.check_frame_tensors(getattr(self, "label", "converted weight"), [(f"{role}_frames", getattr(self, f"{role}_frames"))
                                                    for role, _, _ in self.segments if role != "rest"])
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
