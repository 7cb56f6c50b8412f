r"""The parametrizations :func:`~geoopt_stiefel_attention.stiefelize` registers: a query/key weight rebuilt from
its ``(heads, d, r)`` frames (:class:`_QKWeight`), and a bias whose query/key entries are held at zero
(:class:`_ZeroQKBias`), with the small helpers that find a dotted parameter and cut a weight into head blocks.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any

import geoopt
import torch
from torch import Tensor, nn

from .. import _guard
from .._linalg import ORTHONORMALITY_TOLERANCE
from ..integrations import activation_checkpointing as _activation_checkpointing
from ..integrations import adapters as _adapters
from ..integrations import averaging as _averaging
from ..integrations import ddp as _ddp
from ..integrations.casts import _FrameOwner
from ..manifolds import PolarStiefel

#: Marker attribute set on a converted attention module (read by :func:`converted_query_key_frames`).
_MARK = "_stiefel_layout"

def _frames_from(w: Tensor, dim: int, start: int, length: int, r: int, groups: int = 1) -> Tensor:
    """The ``(heads, d, r)`` blocks of rows/columns ``start:start+length`` of ``w`` (head ``h``: ``h*r:(h+1)*r``).

    With ``groups > 1`` the axis is ``groups`` equal consecutive groups of ``L = w.shape[dim] / groups``
    entries (an interleaved :class:`~geoopt_stiefel_attention.Block`), ``start:start+length`` is the range within
    each group, and the heads come group by group: head ``g * (length // r) + j`` is entries
    ``g*L + start + j*r : g*L + start + (j+1)*r``."""
    if groups > 1:
        grouped = w.detach().unflatten(dim, (groups, -1)).narrow(dim + 1, start, length)
        if dim == 0:  # (G, length, d) -> (G * length/r, r, d) -> (heads, d, r)
            return grouped.reshape(groups * (length // r), r, -1).transpose(1, 2)
        return grouped.reshape(grouped.shape[0], groups * (length // r), r).permute(1, 0, 2)  # (d, G, length)
    block = w.detach().narrow(dim, start, length)
    if dim == 0:  # (H*r, d): head h rows are its (r, d) block, the frame is its transpose
        return block.reshape(length // r, r, -1).transpose(1, 2)
    return block.reshape(block.shape[0], length // r, r).permute(1, 0, 2)  # (d, H*r) -> (H, d, r)


def _rest_of(weight: Tensor, dim: int, segments: tuple[tuple[str, int, int], ...], groups: int = 1) -> Tensor | None:
    """The ``rest`` segments of ``weight`` (neither query nor key), concatenated in order along ``dim``: with
    ``groups > 1`` the segments are ranges within each of the ``groups`` equal groups, and the result holds
    them group by group (``(groups * rest_per_group, d)`` for ``dim=0``). ``None`` when there is no rest."""
    spans = [(s, n) for role, s, n in segments if role == "rest"]
    if not spans:
        return None
    if groups > 1:
        grouped = weight.unflatten(dim, (groups, -1))
        rest = [grouped.narrow(dim + 1, s, n) for s, n in spans]
        return (torch.cat(rest, dim=dim + 1) if len(rest) > 1 else rest[0]).flatten(dim, dim + 1).contiguous()
    return torch.cat([weight.narrow(dim, s, n) for s, n in spans], dim=dim).contiguous()


class _QKWeight(_FrameOwner):
    """Parametrization of one weight tensor holding query and/or key rows.

    ``original`` (kept by :mod:`torch.nn.utils.parametrize`) is the rest of the tensor: the slices along
    ``dim`` that are neither query nor key, concatenated in order (empty for a pure ``q_proj``). The
    frames ``q_frames``/``k_frames`` are ``(heads, d, r)`` :class:`geoopt.ManifoldParameter` s; the query
    log-gain ``q_log_gain`` (``(heads,)``, optional) scales head ``h``'s rows by
    :math:`\\exp(\\text{rate}\\,\\theta_h)`.

    With ``groups > 1`` (an interleaved :class:`~geoopt_stiefel_attention.Block`: q|k|v per key/value head) the
    axis is ``groups`` equal consecutive groups, the segments are ranges within every group, each role's frames
    come group by group (:func:`_frames_from`), and ``original`` holds the rest group by group (the value rows
    of head 0, then of head 1, ...).
    """

    _FRAME_PARAMS = ("q_frames", "k_frames")  # its frames, by name (read by distributed.flattened_by_fsdp1)

    #: one group: the segments are ranges of the whole axis (also for modules pickled before groups existed)
    groups = 1

    def __init__(self, weight: Tensor, dim: int, pieces: list[dict[str, Any]], gain_rate: float,
                 label: str = "converted weight", groups: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.groups = int(groups)
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
                frames = manifold.projx(_frames_from(weight, dim, piece["start"], piece["length"], piece["r"],
                                                     self.groups))
            setattr(self, f"{piece['role']}_frames",
                    geoopt.ManifoldParameter(frames.contiguous(), manifold=manifold,
                                             requires_grad=weight.requires_grad))
            if piece.get("gain") is not None:  # trained, or frozen, with the weight it scales
                self.q_log_gain = nn.Parameter(piece["gain"].log() / self.gain_rate,
                                               requires_grad=weight.requires_grad)
        width = weight.shape[dim] // self.groups  # of the whole axis, or of one group
        if weight.shape[dim] % self.groups or any(p["length"] % p["r"] for p in pieces) or (
                self.groups > 1 and width % pieces[0]["r"]):
            raise ValueError(f"{label}: {weight.shape[dim]} features are not {self.groups} equal groups of whole "
                             f"heads")
        if cursor < width:
            segments.append(("rest", cursor, width - cursor))
        self.segments = tuple(segments)

    def __getstate__(self) -> dict[str, Any]:
        """The module's state without what lives only in a live model: the weak references of ``_slot`` (set again
        by :func:`_watch_model` and by the model's next forward, see :func:`~..integrations.adapters.set_slots`), a
        weight built in an open forward, the DDP it passed, and the marks of an averaged copy."""
        state = dict(super().__getstate__())
        state.pop("_slot", None)
        state.pop("_built", None)
        state.pop("_ddp_checked", None)
        state.pop("_handed_out", None)  # a state-dict entry kept for the check of an averaged copy
        state.pop("_averaged_copy", None)
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> _QKWeight:
        """A copy (as :func:`copy.deepcopy` makes one) whose ``_slot`` points at the copies of the modules it names
        when they are copied with it (a copy of the whole model), and is left out otherwise."""
        done = memo.get(id(self))
        if done is not None:
            return done
        replica = type(self).__new__(type(self))
        memo[id(self)] = replica
        replica.__dict__ = copy.deepcopy(self.__getstate__(), memo)
        slot = self.__dict__.get("_slot")
        if slot is not None:
            parent, owner = memo.get(id(slot[0]())), memo.get(id(slot[2]()))
            if parent is not None and owner is not None and slot[0]() is not None and slot[2]() is not None:
                replica.__dict__["_slot"] = (weakref.ref(parent), slot[1], weakref.ref(owner))
        _averaging.mark_copy(replica, memo)  # an averaged model starts as a deep copy (integrations/averaging.py)
        return replica

    def _rows(self, role: str) -> Tensor:
        """The ``(heads, d, r)`` frames of ``role``, times the query gains (a new tensor when scaled)."""
        # The frame is used as it is, not through ``.as_subclass(Tensor)``: a ManifoldTensor disables
        # ``__torch_function__``, so every op below already returns a plain Tensor (whose gradient flows back
        # to the ManifoldParameter), and Dynamo traces it like any parameter; ``as_subclass`` of a tensor
        # subclass is a graph break under torch.compile (one per converted weight).
        frames = getattr(self, f"{role}_frames")
        if role == "q" and getattr(self, "q_log_gain", None) is not None:
            gain = torch.exp(self.gain_rate * self.q_log_gain)
            frames = frames * (gain if gain.dtype == frames.dtype else gain.to(frames.dtype)).view(-1, 1, 1)
        return frames

    def frames(self) -> list[tuple[str, Tensor]]:
        """``(name, frames)`` of each role, in segment order (read from the module's parameters directly: this runs
        at every training forward)."""
        names = self.__dict__.get("_frame_names")
        if names is None:  # computed once (also for modules pickled before it existed)
            names = self.__dict__["_frame_names"] = tuple(f"{role}_frames" for role, _, _ in self.segments
                                                          if role != "rest")
        params = self._parameters
        return [(name, params[name] if name in params else getattr(self, name)) for name in names]

    def check(self) -> None:
        """The frame check of a training forward (:func:`~geoopt_stiefel_attention._guard.check_frame_tensors`)."""
        _guard.check_frame_tensors(getattr(self, "label", "converted weight"), self.frames())

    def _head_width(self) -> int | None:
        """The head width ``r`` when every segment (frames and rest) is a whole number of ``r``-wide blocks:
        then the weight is one ``torch.cat`` of head blocks (:meth:`forward`); ``None`` otherwise. Computed
        once (also for modules pickled before it existed)."""
        r = self.__dict__.get("_r")
        if r is None:
            widths = {getattr(self, f"{role}_frames").shape[-1] for role, _, _ in self.segments if role != "rest"}
            r = widths.pop() if len(widths) == 1 else 0
            if r and any(n % r for _, _, n in self.segments):
                r = 0
            self.__dict__["_r"] = r
        return r or None

    def forward(self, rest: Tensor) -> Tensor:
        model = self.__dict__.get("_model_scope")  # see _check_model_frames
        # Under saved-tensor hooks (activation checkpointing without reentry, save_on_cpu) every read builds its
        # own weight: checkpointing recomputes the region in backward, outside the model's forward, where each read
        # builds, and matches the tensors saved then to those saved in the forward by position, so the forward must
        # build as often (reusing a weight there shifts every later saved tensor: a metadata error, or, where the
        # shapes agree, the gradients of other tensors).
        reuse = (model is not None and model[2] > 0 and self.__dict__.get("_reread", False)
                 and not (torch.is_grad_enabled() and _activation_checkpointing.saved_tensor_hooks_active()))
        if reuse:  # read again in the same forward of the converted model: the same tensor, built once
            built = self.__dict__.get("_built")
            if built is not None and built[1] == torch.is_grad_enabled():
                return built[0]
        slot = self.__dict__.get("_slot")
        if slot is not None and not torch.compiler.is_compiling():
            _adapters.check_not_wrapped(self, slot)
        ddp = _ddp.active()
        if ddp is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            _ddp.check_synchronised(self, ddp)
        if torch.is_grad_enabled() and (model is None or model[0] <= 0):
            self.check()
        weight = self._build(rest)
        if reuse:
            self.__dict__["_built"] = (weight, torch.is_grad_enabled())
        return weight

    def _build(self, rest: Tensor) -> Tensor:
        """The weight from the frames and ``rest``. Head blocks of width ``r`` are laid side by side by a single
        ``torch.cat`` of views (``(d, heads, r)`` along ``dim=1``, ``(heads, r, d)`` along ``dim=0``), so the
        weight is written once, with no intermediate copies; the values are those of :meth:`_build_by_rows`."""
        r = self._head_width()
        if r is None:
            return self._build_by_rows(rest)
        if self.groups > 1:
            return self._build_grouped(rest, r)
        parts, offset = [], 0
        for role, _start, length in self.segments:
            if role == "rest":
                # a segment that is all of rest is used as it is: a narrow would add a slice node, whose
                # backward zero-fills and copies a rest-sized gradient
                block = rest if length == rest.shape[self.dim] else rest.narrow(self.dim, offset, length)
                offset += length
                parts.append(block.unflatten(1, (length // r, r)) if self.dim == 1
                             else block.unflatten(0, (length // r, r)))
            else:
                frames = self._rows(role)
                parts.append(frames.permute(1, 0, 2) if self.dim == 1 else frames.transpose(1, 2))
        if self.dim == 1:  # (d, heads, r) blocks -> (d, heads * r)
            return torch.cat(parts, dim=1).flatten(1) if len(parts) > 1 else parts[0].reshape(parts[0].shape[0], -1)
        return torch.cat(parts, dim=0).flatten(0, 1) if len(parts) > 1 else parts[0].reshape(-1, parts[0].shape[-1])

    def _build_grouped(self, rest: Tensor, r: int) -> Tensor:
        """:meth:`_build` of an interleaved weight (``groups > 1``): the ``(G, heads per group, r, d)`` views of
        every segment (``(d, G, heads per group, r)`` along ``dim=1``) laid side by side by one ``torch.cat``
        along the heads of a group, so that group ``g`` is ``[its query heads, its key head, its value head]``."""
        g, dim = self.groups, self.dim
        grouped = rest.unflatten(dim, (g, -1)) if rest.shape[dim] else None
        parts, offset = [], 0
        for role, _start, length in self.segments:
            if role == "rest":
                block = grouped.narrow(dim + 1, offset, length)
                offset += length
                parts.append(block.unflatten(dim + 1, (length // r, r)))  # (G, m, r, d) or (d, G, m, r)
            else:
                frames = self._rows(role)  # (G*m, d, r), group by group
                parts.append(frames.transpose(1, 2).unflatten(0, (g, -1)) if dim == 0
                             else frames.permute(1, 0, 2).unflatten(1, (g, -1)))
        return torch.cat(parts, dim=dim + 1).flatten(dim, dim + 2)

    def _build_by_rows(self, rest: Tensor) -> Tensor:
        """The weight segment by segment (any segment widths; with ``groups > 1``, group by group)."""
        if self.groups > 1:
            g, dim = self.groups, self.dim
            grouped = rest.unflatten(dim, (g, -1)) if rest.shape[dim] else None
            parts, offset = [], 0
            for role, _start, length in self.segments:
                if role == "rest":
                    parts.append(grouped.narrow(dim + 1, offset, length))
                    offset += length
                else:
                    frames = self._rows(role)
                    h, d, r = frames.shape
                    parts.append(frames.transpose(1, 2).reshape(g, (h // g) * r, d) if dim == 0
                                 else frames.permute(1, 0, 2).reshape(d, g, (h // g) * r))
            return torch.cat(parts, dim=dim + 1).flatten(dim, dim + 1)
        parts, offset = [], 0
        for role, _start, length in self.segments:
            if role == "rest":
                parts.append(rest.narrow(self.dim, offset, length))
                offset += length
            else:
                frames = self._rows(role)
                h, d, r = frames.shape
                parts.append(frames.transpose(1, 2).reshape(h * r, d) if self.dim == 0
                             else frames.permute(1, 0, 2).reshape(d, h * r))
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0].contiguous()

    def right_inverse(self, weight: Tensor) -> Tensor:
        """The rest of ``weight`` (query/key slices removed), stored as ``original``.

        Called at registration and on assignment (``module.weight = w``); on assignment the frames are also
        set to the polar factors of ``w``'s query/key head blocks (the log-gains are kept), with a ``UserWarning``
        when the weight then reads back differently from ``w`` (blocks that are not scaled frames).
        """
        manifold = PolarStiefel()
        with torch.no_grad():
            for role, start, length in self.segments:
                if role != "rest":
                    frames = getattr(self, f"{role}_frames")
                    r = frames.shape[-1]
                    frames.copy_(manifold.projx(_frames_from(weight, self.dim, start, length, r, self.groups)))
        out = _rest_of(weight, self.dim, self.segments, self.groups)
        if out is None:
            shape = list(weight.shape)
            shape[self.dim] = 0
            out = weight.new_empty(shape)
        if self.__dict__.get("_registered", False):  # an assignment, not the call register_parametrization makes
            with torch.no_grad():
                reads = self._build(out.to(weight.dtype))
                tol = ORTHONORMALITY_TOLERANCE.get(reads.dtype, 1e-4) * max(1.0, float(weight.detach().abs().max()))
                gap = float((reads - weight.detach()).abs().max())
            if not gap <= tol:
                warnings.warn(f"{getattr(self, 'label', 'converted weight')}: the assigned weight's query/key head "
                              f"blocks are not (scaled) orthonormal frames, so their polar factors are set: it reads "
                              f"back up to {gap:.3g} away from what was assigned. Assign the weight of a stock model to "
                              f"the stock model, or use load_state_dict, which says the same per head.",
                              UserWarning, stacklevel=4)
        return out

    def extra_repr(self) -> str:
        groups = f", per group of {self.groups}" if self.groups > 1 else ""
        return ", ".join(f"{role}[{s}:{s + n}]" for role, s, n in self.segments) + f"{groups}, dim={self.dim}"


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

# ------------------------------------------------------------------------------------------- the model's check
#: Attribute of a converted model (the module :func:`~geoopt_stiefel_attention.stiefelize` was given):
#: ``(scope, weights, pre-hook handle, hook handle)``, see :func:`_check_model_frames`. A weight whose module's
#: forward reads it several times (``nn.MultiheadAttention.forward`` reads ``in_proj_weight`` three times) is
#: marked ``_reread``: inside the model's forward it is built once and the same tensor returned to every read.
_MODEL_HOOKS = "_stiefel_model_check_hooks"


def _frames_pass(weights: list[_QKWeight]) -> bool | None:
    """Whether every frame of ``weights`` is on the manifold, tested at once: same-shaped frame stacks concatenated,
    one product :math:`W^\top W - I` (a ``baddbmm``) and its largest absolute entry per shape and dtype, and one host
    read each (the usual case: one shape and dtype). ``None`` when a frame is of another kind (sharded, meta, not a
    ``(heads, d, r)`` stack), which the weights' own checks handle. NaN fails."""
    groups: dict[tuple[Any, ...], list[Tensor]] = {}
    for p in weights:
        for _name, w in p.frames():
            if getattr(w, "_local_tensor", None) is not None or w.is_meta or w.dim() != 3:
                return None
            groups.setdefault((w.shape[1], w.shape[2], w.dtype, w.device), []).append(w.detach())
    errs, tols = [], []
    for (_, _, dtype, _), ws in groups.items():
        errs.append(_guard.frame_error(torch.cat(ws) if len(ws) > 1 else ws[0]))
        tols.append(_guard.FRAME_CHECK_TOLERANCE.get(dtype, _guard.FRAME_CHECK_TOLERANCE[torch.float32]))
    return all(float(e) <= t for e, t in zip(errs, tols, strict=True))


def _check_model_frames(model: nn.Module, args: Any) -> None:
    """Forward pre-hook of a converted model: in a forward with gradients, check every frame of its converted
    weights at once (:func:`_frames_pass`: one Gram product, one distance and one host read per shape and dtype,
    instead of two operations per frame and a read per weight), then let the weights skip their own check until the
    model's forward returns. A frame off the manifold is reported by the weight's own check, with the message it
    always had. Frames of another kind (sharded, meta) leave the weights' checks on. In a forward without gradients
    (an evaluation) the weights whose frames changed since their last evaluation check are tested at once the same
    way, and only when that fails does each run its own check, which warns
    (:func:`~..integrations.averaging.check_at_evaluation`)."""
    if torch.compiler.is_compiling():
        return
    scope, weights = vars(model)[_MODEL_HOOKS][:2]
    if weights and "_slot" not in weights[0].__dict__:  # a copy or an unpickled model: no slots yet
        _adapters.set_slots(model, _QKWeight)
    if weights and "_averaged_copy" in weights[0].__dict__:  # entries of an averaged copy written in place?
        for p in weights:
            _averaging.check_written(p)
    scope[2] += 1
    scope[1].append(False)
    if not torch.is_grad_enabled():  # an evaluation: checked when the frames changed, and warned (see averaging)
        if _averaging.evaluation_check_skipped():
            return
        changed = [p for p in weights if _averaging.changed_since_evaluation(p.frames(), p)]
        if changed and _frames_pass(changed):
            for p in changed:
                _averaging.mark_evaluated(p.frames(), p)
            return
        for p in changed:
            _averaging.check_at_evaluation(getattr(p, "label", "converted weight"), p.frames(), p)
        return
    if _guard.capturing():  # no host read in a CUDA graph's capture: each weight records its check as an assertion
        return
    passed = _frames_pass(weights)
    if passed is None:  # frames of another kind: the weights check themselves
        return
    if not passed:  # NaN too: the weights' own checks name the frame
        for p in weights:
            p.check()
        return
    scope[0] += 1
    scope[1][-1] = True


def _end_model_check(model: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a converted model (also run when its forward raises): closes what
    :func:`_check_model_frames` opened; the weights are rebuilt, and checked, at the next forward."""
    if torch.compiler.is_compiling():
        return
    scope, weights = vars(model)[_MODEL_HOOKS][:2]
    if not scope[1]:  # the pre-hook did not run
        return
    if scope[1].pop():
        scope[0] -= 1
    scope[2] -= 1
    if scope[2] <= 0:
        for p in weights:
            p.__dict__.pop("_built", None)


def _watch_model(model: nn.Module) -> None:
    """Register :func:`_check_model_frames` and :func:`_end_model_check` on ``model`` (again after a further
    conversion: the list of its converted weights is rebuilt). Not on a bare ``nn.TransformerEncoderLayer``:
    a hook on it would turn off torch's fused inference path (its weights keep their own checks)."""
    _unwatch_model(model)
    _adapters.set_slots(model, _QKWeight)
    weights = [m for m in model.modules() if isinstance(m, _QKWeight)]
    if not weights or isinstance(model, nn.TransformerEncoderLayer):
        return
    # [open forwards whose check covered every frame, per open forward: whether it did, open forwards]
    scope: list[Any] = [0, [], 0]
    for p in weights:
        p.__dict__["_model_scope"] = scope
    pre = model.register_forward_pre_hook(_check_model_frames)
    post = model.register_forward_hook(_end_model_check, always_call=True)
    object.__setattr__(model, _MODEL_HOOKS, (scope, weights, pre, post))


def _unwatch_model(model: nn.Module) -> None:
    hooks = vars(model).get(_MODEL_HOOKS)
    if hooks is None:
        return
    hooks[2].remove()
    hooks[3].remove()
    for p in hooks[1]:
        p.__dict__.pop("_model_scope", None)
        p.__dict__.pop("_built", None)
    object.__delattr__(model, _MODEL_HOOKS)
