"""Optimizer state of a frame: where it lives, its shapes, its creation, float32 master copies, and the
checks and casts of :meth:`StiefelAdam.load_state_dict <geoopt_stiefel_attention.StiefelAdam.load_state_dict>`.

A frame parameter ``(..., d, r)`` has ``step`` (float32 scalar; on the CPU unless capturable), ``exp_avg``
``(..., d, r)``, ``exp_avg_sq`` at its true shape (``(..., 1, 1)`` for one second moment per frame),
``skipped_frames`` (int64) and, with ``master_weights`` for bf16/fp16 frames, a float32 ``master``. Every other
parameter has torch's AdamW state and ``skipped_frames`` too, the steps it was skipped for a non-finite gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer

from .. import _linalg
from .. import distributed as _distributed
from ..manifolds import is_frame as _is_frame

_local = _distributed.local_tensor  # a DTensor's local shard (whole frames; see distributed), else the tensor


def _capturable(group: dict[str, Any], device: torch.device) -> bool:
    """Whether the group's step runs the capturable path on ``device``: the group's ``capturable``, or, when it
    is ``None`` (the default), whether ``device`` is not the CPU."""
    cap = group.get("capturable")
    return device.type != "cpu" if cap is None else bool(cap)


#: Device types on which torch's own AdamW supports ``capturable=True`` (the step of the parameters that are not
#: frames); elsewhere (the CPU) it runs its default step, which reads its step counts on the host.
TORCH_CAPTURABLE_DEVICES = tuple(_torch_optimizer._get_capturable_supported_devices())


def _torch_capturable(group: dict[str, Any], device: torch.device) -> bool:
    """Whether torch's AdamW, given the group's parameters that are not frames on ``device``, runs its capturable
    step: the group is capturable there (:func:`_capturable`) and torch has a capturable step for the device."""
    return _capturable(group, device) and device.type in TORCH_CAPTURABLE_DEVICES


def _zeros_like_layout(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain zero tensor of ``p``'s shape and device, column-major like ``p`` when ``p`` is (e.g. the ``Q`` of
    ``torch.linalg.qr``), else contiguous."""
    if p.dim() >= 2 and not p.is_contiguous() and p.mT.is_contiguous():
        return torch.zeros(p.mT.shape, dtype=dtype, device=p.device).mT
    return torch.zeros(p.shape, dtype=dtype, device=p.device)


def _frame_state_shapes(p: torch.Tensor, second_moment: str | None) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor of a frame parameter ``p`` of shape ``(..., d, r)``."""
    shapes = {"exp_avg": tuple(p.shape), "master": tuple(p.shape)}
    if second_moment is not None:
        batch, r = tuple(p.shape[:-2]), p.shape[-1]
        shapes["exp_avg_sq"] = {"frame": batch + (1, 1), "column": batch + (1, r),
                                "element": tuple(p.shape)}[second_moment]
    return shapes


@dataclass(frozen=True)
class FrameRule:
    """What a frame optimizer's rule asks of a frame's loaded state: the keys it ``required``, the ``shapes`` of
    the state tensors it may hold, its int64 ``counters`` (created at zero when a state dict lacks them), and
    ``convert(state, where)``, which converts a state saved in another form (another optimizer's) in place
    before it is checked."""

    required: list[str]
    shapes: dict[str, tuple[int, ...]]
    counters: tuple[str, ...] = ("skipped_frames",)
    convert: Callable[[dict[str, Any], str], None] | None = None


def _loaded_state(p: torch.Tensor, saved: Any, group: dict[str, Any], label: str, name: str,
                  rule: FrameRule | None) -> dict[str, Any]:
    """The state of ``p`` from a state dict, checked against ``p`` and its group, converted and cast (see
    :meth:`FrameOptimizer.load_state_dict <geoopt_stiefel_attention.optim._base.FrameOptimizer.load_state_dict>`);
    raises before anything changes. ``rule`` is the frame optimizer's :class:`FrameRule` for a frame, ``None`` for
    a parameter that is not a frame (torch's AdamW state)."""
    where = f"{name}.load_state_dict: {label}"
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: its state is a {type(saved).__name__}, not a dict of state entries.")
    state = dict(saved)
    if not state:
        return state
    if "step" in state and not isinstance(state["step"], torch.Tensor):  # geoopt stores a Python int
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    if rule is None:
        rule = _euclidean_rule(p, group)
    elif rule.convert is not None:
        rule.convert(state, where)
    _check_loaded(state, rule, group, where)
    compute = _linalg.compute_dtype(p.dtype) if _is_frame(p) else p.dtype
    unsharded = ("step",) + rule.counters
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            state[key] = _placed(p, key, value, group, compute, sharded=key not in unsharded)
    for key in rule.counters:  # the skip counter (see FrameOptimizer.step) covers every parameter
        state.setdefault(key, torch.zeros((), dtype=torch.int64, device=p.device))
    return state


def _euclidean_rule(p: torch.Tensor, group: dict[str, Any]) -> FrameRule:
    """torch's AdamW state of a parameter that is not a frame, as a :class:`FrameRule`."""
    return FrameRule(["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else []),
                     {key: tuple(p.shape) for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")})


def _check_loaded(state: dict[str, Any], rule: FrameRule, group: dict[str, Any], where: str) -> None:
    """Refuse a loaded state that lacks a key ``rule`` requires or holds a tensor of another shape."""
    sm = group.get("second_moment")
    missing = [key for key in rule.required if key not in state]
    if missing:
        raise ValueError(f"{where}: its state lacks {missing} (has {sorted(state)}); the state dict does not "
                         f"belong to this parameter and group (second_moment={sm!r}, amsgrad={group.get('amsgrad')}).")
    for key, shape in rule.shapes.items():
        value = state.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{where}: its state {key!r} has shape {got}, expected {shape} "
                             f"(second_moment={sm!r}); the state dict does not belong to this parameter.")


def _placed(p: torch.Tensor, key: str, value: torch.Tensor, group: dict[str, Any], compute: torch.dtype,
            sharded: bool) -> torch.Tensor:
    """A loaded state tensor ``value`` (entry ``key`` of ``p``'s state) in the dtype, device and layout it is kept
    in: ``step`` float32, on the parameter's device in capturable mode (torch's rule), else on the CPU; a
    ``master`` copy float32; other floating-point state in ``compute`` (the frame arithmetic's dtype, or a
    Euclidean parameter's own); a sharded parameter's state (``sharded``: not a step count or counter) sharded
    like it; state of the parameter's shape in its memory layout (e.g. column-major frames)."""
    device = p.device
    if key == "step":
        dtype = torch.float32
        device = p.device if _capturable(group, p.device) else torch.device("cpu")
    elif key == "master":
        dtype = torch.float32
    elif value.is_floating_point() and (_is_frame(p) or p.is_floating_point()):
        dtype = compute
    else:
        dtype = value.dtype
    if _distributed.is_sharded(p) and sharded:
        return _distributed.to_placements_of(p, value, dtype)
    if tuple(value.shape) == tuple(p.shape):
        return _zeros_like_layout(p, dtype).to(device).copy_(value)
    return value.to(dtype=dtype, device=device, copy=True)


def convert_geoopt_frame_state(p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], where: str) -> None:
    """StiefelAdam's conversion of a frame's state saved by geoopt's ``RiemannianAdam``: its AMSGrad buffer is
    dropped with a warning (AMSGrad applies to Euclidean parameters only here), and its full-size
    ``exp_avg_sq`` (one scalar per frame stored at every entry) reduced to the ``(..., 1, 1)`` scalar it
    broadcasts, refused when it is not constant on each frame."""
    if "max_exp_avg_sq" in state:
        del state["max_exp_avg_sq"]
        warnings.warn(f"{where}: dropped the frame's AMSGrad buffer 'max_exp_avg_sq' (a geoopt checkpoint?); "
                      f"StiefelAdam's amsgrad applies to Euclidean parameters only.", UserWarning, stacklevel=4)
    v = state.get("exp_avg_sq")
    if group.get("second_moment") == "frame" and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) \
            and tuple(p.shape[-2:]) != (1, 1):
        head = v[..., :1, :1]
        if not torch.equal(v, head.expand_as(v)):
            raise ValueError(
                f"{where}: its full-size exp_avg_sq {tuple(v.shape)} is not constant on each frame, so it is "
                f"not one second moment per frame (geoopt's RiemannianAdam on EuclideanStiefel stores one "
                f"scalar per frame at every entry; this state is not of that kind). Load it into an "
                f"optimizer with second_moment='element', or drop this parameter's state in a "
                f"register_load_state_dict_pre_hook to restart its moments.")
        state["exp_avg_sq"] = head


def init_frame_state(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """Fill the empty ``state`` of frame parameter ``p`` with zero moments in the compute dtype, at their true
    shapes (:func:`_frame_state_shapes`), laid out like ``p``; returns ``state``."""
    ct = _linalg.compute_dtype(p.dtype)
    step_device = p.device if _capturable(group, p.device) else torch.device("cpu")
    state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
    # the parameter's memory layout (column-major frames then take the in-place path); a sharded frame's
    # state is a DTensor sharded like it, created at its local shape (whole frames: no communication)
    local = _local(p)
    state["exp_avg"] = _distributed.like_parameter(p, _zeros_like_layout(local, ct), tuple(p.shape))
    second_moment = group["second_moment"]
    if second_moment is not None:
        local_v = torch.zeros(_frame_state_shapes(local, second_moment)["exp_avg_sq"], dtype=ct,
                              device=p.device)
        state["exp_avg_sq"] = _distributed.like_parameter(
            p, local_v, _frame_state_shapes(p, second_moment)["exp_avg_sq"])
    state["skipped_frames"] = torch.zeros((), dtype=torch.int64, device=p.device)
    return state


def master_copies(states: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The float32 master copies of low-precision frames (``state["master"]``), made from the parameter at
    first use; entries that the parameter no longer rounds to (changed outside the optimizer, e.g. by
    ``proj_()`` or ``load_state_dict`` of the model alone) are re-read from the parameter."""
    masters = []
    for p in params:
        state = states[p]
        local = _local(p).detach()
        if state.get("master") is None:
            master = local.to(torch.float32, copy=True)
            state["master"] = _distributed.like_parameter(p, master, tuple(p.shape))
        else:
            master = _local(state["master"])
            torch.where(master.to(p.dtype) == local, master, local.to(master.dtype), out=master)
        masters.append(master)
    return masters
