"""How frames reach the update: frames of one shape ``(d, r)`` grouped into batches (whatever the number each
parameter holds), their state kept stacked in one buffer per batch, a reusable workspace, and :func:`update_batch`,
the one driver that stages a batch, runs the update (the fast kernel, or the readable reference for the ablation
second moments) and writes the results back."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _linalg
from .. import distributed as _distributed
from .._linalg import frame_step_scale
from ._kernel import _FAST_MODES, frame_update_
from ._reference import stiefel_adam_update
from ._state import master_copies

_local = _distributed.local_tensor  # a DTensor's local shard (whole frames; see distributed), else the tensor

#: Same-shaped frame parameters of a group are stacked into batches of at most this many elements, one call
#: per operation per batch (per-op dispatch dominates small problems); a parameter of more than half as many
#: elements is a batch of its own, updated in place with no staging copies. 2**16 was the fastest choice for
#: the widths 128-768 of ``stiefel-attention bench`` on a 2-core CPU.
STACK_NUMEL = 1 << 16

#: The batch size limit on other devices (accelerators), where kernel launches, not caches, set the cost: all
#: same-shaped frames of a group up to this many elements (64 MiB in float32) are updated by one call per
#: operation. Their first and second moments (and float32 master copies) are then kept stacked in one buffer
#: per batch, so only frames and gradients are staged (see :func:`update_batch`).
ACCELERATOR_STACK_NUMEL = 1 << 24

def _frame_lr(group: dict[str, Any], d: int, r: int, device: torch.device, dtype: torch.dtype,
              capturable: bool) -> tuple[float | torch.Tensor, float | None]:
    r"""The learning rate and trust radius a group's ``d x r`` frames step with: ``lr`` times
    :func:`frame_step_scale`, and the radius as it is (it bounds :math:`\|s\|_F` in a frame's own units, whatever
    the rule). A tensor ``lr`` stays a tensor on the capturable path (no host read) and is read as a float
    otherwise."""
    c = frame_step_scale(group["adjust_lr_fn"], d, r)
    lr, radius = group["lr"], _linalg.trust_radius(group["trust_region"], group["adjust_lr_fn"])
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device=device, dtype=dtype) if capturable else float(lr)
    if c != 1.0:
        lr = lr * c
    return lr, radius


def _frame_counts(tensors: list[torch.Tensor]) -> list[int]:
    """How many ``d x r`` frames each of ``tensors`` (local shards of frame parameters, or their state, all with
    the same trailing ``(d, r)``) holds."""
    d, r = tensors[0].shape[-2:]
    return [t.numel() // max(d * r, 1) for t in tensors]


def _frame_batches(frames: list[torch.Tensor], steps: list[int] | None,
                   stack_numel: int | None = None) -> list[tuple[int | None, list[torch.Tensor]]]:
    """Split frame parameters into update batches of one frame shape ``(d, r)``, dtype, device and step count
    (``steps=None``: any step count, the capturable path), each of at most ``stack_numel`` elements (default:
    :data:`STACK_NUMEL` on the CPU, :data:`ACCELERATOR_STACK_NUMEL` elsewhere); a parameter of more than half that
    many is a batch of its own. Parameters holding different numbers of frames of one shape (the query and key
    frames of grouped-query attention: 8 and 2 heads of ``d x r``) share a batch, filled in the given order."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p, step in zip(frames, steps if steps is not None else [None] * len(frames), strict=True):
        groups[(tuple(_local(p).shape[-2:]), p.dtype, p.device, step)].append(p)
    batches = []
    for (_, _, device, step), params in groups.items():
        limit = stack_numel or (STACK_NUMEL if device.type == "cpu" else ACCELERATOR_STACK_NUMEL)
        batch: list[torch.Tensor] = []
        size = 0
        for p in params:
            numel = _local(p).numel()
            if 2 * numel > limit:  # large: a batch of its own (updated in place when its layout allows)
                batches.append((step, [p]))
                continue
            if batch and size + numel > limit:
                batches.append((step, batch))
                batch, size = [], 0
            batch.append(p)
            size += numel
        if batch:
            batches.append((step, batch))
    return batches


def _stacked_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``(n, a, b)`` stack of every ``a x b`` matrix of ``tensors`` (``torch.cat`` of their
    ``reshape(-1, a, b)``) without a copy, when the tensors are dense, row-major, of one dtype and one trailing
    shape ``(a, b)``, and lie one after the other, in this order, in one storage; otherwise ``None``."""
    t0 = tensors[0]
    if t0.dim() < 2:
        return None
    tail = t0.shape[-2:]
    base, storage, offset = t0.data_ptr(), t0.untyped_storage().data_ptr(), 0
    for t in tensors:
        if (not t.is_contiguous() or t.shape[-2:] != tail or t.dtype != t0.dtype or t.device != t0.device
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != base + offset * t0.element_size()):
            return None
        offset += t.numel()
    a, b = tail
    return t0.as_strided((offset // max(a * b, 1), a, b), (a * b, b, 1))


def _stacked_state(states: list[dict[str, Any]], key: str,
                   others: Callable[[], Iterable[dict[str, Any]]] = tuple) -> torch.Tensor:
    """The ``states[i][key]`` tensors as one ``(n, a, b)`` stack of their ``a x b`` matrices (:func:`_stacked_view`)
    whose slices they are: a view if they already
    are consecutive slices of one buffer (every step after the first), else a new buffer, whose slices then
    replace them in the states (the first step of a batch, after ``load_state_dict``, or when the batch's
    members changed). The stacked slices are ordinary tensors of the same shape, dtype and values; they only
    share one storage.

    When a new buffer is made, a tensor of ``others()`` (the states of the group's other parameters) that is
    still a slice of one of the replaced buffers gets a storage of its own, so that no old buffer is kept
    alive by a slice left behind (a frame that had no gradient this step, or a step count that split a batch).
    """
    tensors = [state[key] for state in states]
    stacked = _stacked_view(tensors)
    if stacked is None:
        replaced = {t.untyped_storage().data_ptr() for t in tensors}
        stacked = _cat_frames(tensors)  # row-major, whatever the originals' layout
        for state, view in zip(states, _slices(stacked, tensors), strict=True):
            state[key] = view
        for state in others():
            t = state.get(key)
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in replaced
                    and t.untyped_storage().nbytes() > t.numel() * t.element_size()):
                state[key] = t.clone(memory_format=torch.contiguous_format)
    return stacked


def workspace(optimizer: Any, numel: int, dtype: torch.dtype, device: torch.device, reuse: bool = True) -> torch.Tensor:
    """A reusable flat buffer of ``numel`` elements: one per (dtype, device) in ``optimizer._workspaces``, grown
    to the largest batch, never part of the state (neither saved nor loaded). ``reuse=False`` (the capturable
    path) allocates a fresh one, which compiled and captured steps handle better than a buffer kept on the
    optimizer."""
    if not reuse:
        return torch.empty(numel, dtype=dtype, device=device)
    workspaces = optimizer.__dict__.setdefault("_workspaces", {})
    buf = workspaces.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = workspaces[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def step_tensor(states: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """The step counts of ``params`` as a tensor broadcastable to their stacked frames ``(n, 1, 1)``, in
    ``dtype``, on their device (the capturable path: no host read)."""
    device = params[0].device
    steps = [states[p]["step"] for p in params]
    if len(params) == 1:
        return steps[0].to(device=device, dtype=dtype)
    counts = _frame_counts([_local(p) for p in params])
    stacked = torch.stack(steps).to(device=device, dtype=dtype)
    if len(set(counts)) == 1:
        return stacked.repeat_interleave(counts[0]).view(-1, 1, 1)
    # parameters with different numbers of frames: each count repeated by device ops only (no host tensor)
    return torch.cat([s.expand(c) for s, c in zip(stacked.unsqueeze(1).unbind(0), counts, strict=True)]).view(-1, 1, 1)


def _cat_frames(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The ``(n, a, b)`` stack (a new, row-major tensor) of every ``a x b`` matrix of ``tensors``, in order: the
    inverse of :func:`_slices`."""
    tail = tensors[0].shape[-2:]
    return torch.cat([t.reshape(-1, *tail) for t in tensors])


def _slices(stack: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The consecutive slices of ``stack`` (``(n, ...)``) shaped like the tensors of ``like``, in order."""
    shape = like[0].shape
    if all(t.shape == shape for t in like):  # the usual case: one view and one unbind
        return list(stack.view(len(like), *shape).unbind(0))
    counts = _frame_counts(like)
    return [part.view(t.shape) for part, t in zip(stack.split(counts), like, strict=True)]


@dataclass
class _Staged:
    """A batch of ``n`` frames as an update rule reads and writes them, in the compute dtype: frames ``w`` and
    gradients ``g`` ``(n, d, r)``; ``state``, the rule's state tensors of the batch by key, each ``(n, a, b)`` (the
    first moment ``(n, d, r)``, a second moment or a gap per frame ``(n, 1, 1)``, ...); a ``scratch`` laid out like
    ``w`` (or ``None`` when the rule asked for none); ``write_back()`` copies ``w`` and the state to wherever they
    did not already live (parameters, master copies, state)."""

    w: torch.Tensor
    g: torch.Tensor
    state: dict[str, torch.Tensor]
    scratch: torch.Tensor | None
    write_back: Callable[[], None]


def stage(optimizer: Any, group: dict[str, Any], params: list[torch.Tensor], keys: list[str],
          masters: list[torch.Tensor] | None, capturable: bool, scratch: bool = True) -> _Staged:
    """Stage frames of one shape, dtype and device for an update rule that reads and writes the state entries
    ``keys`` of each frame (the first, the first moment, shaped like the frame; the others any ``(..., a, b)``).

    Several plain (unsharded) parameters, outside a region torch.compile traces (where reading storage
    pointers would break the graph), are updated as one stack (:func:`_stage_stacked`). A lone parameter whose
    frames (or float32 master copy) are dense in the compute dtype, row-major or column-major like its first
    moment, is updated in place, with its state (:func:`_stage_in_place`). Anything else is copied into the
    workspace and back (:func:`_stage_copied`). ``scratch`` asks for a scratch stack like the frames.
    """
    # local shards of sharded frames (whole frames, updated independently), else the tensors themselves
    locals_ = [_local(p).detach() for p in params]
    grads = [_distributed.local_grad(p) for p in params]
    ct = _linalg.compute_dtype(params[0].dtype)
    ws = functools.partial(workspace, optimizer, dtype=ct, device=params[0].device, reuse=not capturable)
    if len(params) > 1 and all(_local(p) is p for p in params) and not torch.compiler.is_compiling():
        return _stage_stacked(optimizer, group, params, keys, masters, locals_, grads, ws, scratch)
    states = [optimizer.state[p] for p in params]
    tensors = {key: [_local(state[key]) for state in states] for key in keys}
    src, m0 = (masters or locals_)[0], tensors[keys[0]][0]  # what the update reads: the master copy if any
    if len(params) == 1 and src.dtype == ct and src.stride() == m0.stride() and (
            src.is_contiguous() or src.mT.is_contiguous()):
        return _stage_in_place(src, grads[0], tensors, masters, locals_, ws, scratch)
    return _stage_copied(masters or locals_, grads, tensors, masters, locals_, ws, scratch)


def _stage_stacked(optimizer: Any, group: dict[str, Any], params: list[torch.Tensor], keys: list[str],
                   masters: list[torch.Tensor] | None, locals_: list[torch.Tensor], grads: list[torch.Tensor],
                   ws: Callable[[int], torch.Tensor], scratch: bool) -> _Staged:
    """Several parameters as one stack: their state tensors (``keys``, and master copies) are kept as consecutive
    slices of one buffer per batch (:func:`_stacked_state`), which the update reads and writes in place; frames
    (unless a master stack stands for them) and gradients are staged in the workspace, and the frames copied
    back."""
    d, r = locals_[0].shape[-2:]
    n = sum(_frame_counts(locals_))
    size = n * d * r
    states = [optimizer.state[p] for p in params]

    def others() -> list[dict[str, Any]]:  # only asked for when a batch is stacked anew
        members = set(params)
        return [optimizer.state[q] for q in group["params"] if q not in members and q in optimizer.state]

    stacks = {key: _stacked_state(states, key, others) for key in keys + (["master"] if masters else [])}
    master = stacks.pop("master", None)  # the stacked master copies are the frames the update reads
    state = {key: stack.view(n, *stack.shape[-2:]) for key, stack in stacks.items()}
    first = int(scratch)
    buf = ws((first + (1 if master is not None else 2)) * size)
    # [scratch] gradients, then frames (unless a master stack stands for them), each parameter a slice of the
    # workspace: one copy in for both, and the frames' slices are the sources of the copy back
    g = buf[first * size:(first + 1) * size].view(n, d, r)
    g_k = _slices(g, locals_)
    if master is None:
        w = buf[(first + 1) * size:].view(n, d, r)
        w_k = _slices(w, locals_)
        torch._foreach_copy_(g_k + w_k, grads + locals_)
    else:
        w = master.view(n, d, r)
        w_k = _slices(w, locals_)
        torch._foreach_copy_(g_k, grads)

    def write_back() -> None:  # the state and masters were updated in place; the frames come back from w
        torch._foreach_copy_(locals_, w_k)

    return _Staged(w, g, state, buf[:size].view(n, d, r) if scratch else None, write_back)


def _stage_in_place(src: torch.Tensor, grad: torch.Tensor, tensors: dict[str, list[torch.Tensor]],
                    masters: list[torch.Tensor] | None, locals_: list[torch.Tensor],
                    ws: Callable[[int], torch.Tensor], scratch: bool) -> _Staged:
    """A lone parameter (or its master copy) ``src``, laid out like its first moment, updated in place with its
    state ``tensors`` (one tensor per key); only the scratch comes from the workspace (column-major like ``src``
    if it is)."""
    d, r = src.shape[-2:]
    n = src.numel() // (d * r)
    state = {key: values[0].view(n, *values[0].shape[-2:]) for key, values in tensors.items()}
    work = None
    if scratch:
        buf = ws(n * d * r)
        work = buf.view(n, d, r) if src.is_contiguous() else buf.view(n, r, d).mT

    def write_back() -> None:  # frames (or their master copy) and state were updated in place
        if masters:
            torch._foreach_copy_(locals_, masters)

    return _Staged(src.view(n, d, r), grad.reshape(n, d, r).to(src.dtype), state, work, write_back)


def _stage_copied(sources: list[torch.Tensor], grads: list[torch.Tensor], tensors: dict[str, list[torch.Tensor]],
                  masters: list[torch.Tensor] | None, locals_: list[torch.Tensor],
                  ws: Callable[[int], torch.Tensor], scratch: bool) -> _Staged:
    """Frames whose dtype or layout differs from their first moment's, or sharded/compiled stacks: frames,
    gradients and first moments copied into the workspace, the other state entries stacked, everything copied
    back."""
    d, r = locals_[0].shape[-2:]
    n = sum(_frame_counts(locals_))
    size = n * d * r
    first = int(scratch)
    buf = ws((first + 3) * size)
    w, g, m = buf[first * size:].view(3, n, d, r).unbind(0)
    w_k, g_k, m_k = (_slices(t, locals_) for t in (w, g, m))
    key0, *rest = tensors
    torch._foreach_copy_(w_k, sources)
    torch._foreach_copy_(g_k, grads)
    torch._foreach_copy_(m_k, tensors[key0])
    state = {key0: m, **{key: _cat_frames(tensors[key]) for key in rest}}

    def write_back() -> None:
        torch._foreach_copy_(tensors[key0], m_k)
        for key in rest:
            torch._foreach_copy_(tensors[key], _slices(state[key], tensors[key]))
        if masters:
            torch._foreach_copy_(masters, w_k)
        torch._foreach_copy_(locals_, masters or w_k)

    return _Staged(w, g, state, buf[:size].view(n, d, r) if scratch else None, write_back)


def update_batch(optimizer: Any, group: dict[str, Any], params: list[torch.Tensor], step: int | None) -> None:
    """Update frames of one shape, dtype, device and step count (``step=None``: the capturable path, any
    step counts, read from the state as tensors), in place, with their state.

    The batch is staged (:func:`stage`), updated by the fused kernel (:func:`~._kernel.frame_update_`; second moment
    ``"frame"`` or ``None``) or by the readable :func:`stiefel_adam_update` (``"column"``, ``"element"``), then
    optionally re-projected (``stabilize``), written back, and its skipped frames counted in
    ``state["skipped_frames"]``.
    """
    beta1, beta2 = group["betas"]
    p0 = params[0]
    d, r = p0.shape[-2:]
    ct = _linalg.compute_dtype(p0.dtype)
    capturable = step is None
    masters = (master_copies(optimizer.state, params) if group["master_weights"] and p0.dtype != ct
               else None)
    keys = ["exp_avg"] + (["exp_avg_sq"] if group["second_moment"] is not None else [])
    batch = stage(optimizer, group, params, keys, masters, capturable)
    m, v = batch.state["exp_avg"], batch.state.get("exp_avg_sq")
    lr, radius = _frame_lr(group, d, r, p0.device, ct, capturable)
    hyper = dict(step=step_tensor(optimizer.state, params, ct) if capturable else step, lr=lr, beta1=beta1,
                 beta2=beta2, eps=group["eps"], trust_region=radius)
    if group["second_moment"] in _FAST_MODES:
        finite = frame_update_(batch.w, batch.g, m, v, batch.scratch, maximize=group["maximize"],
                                capturable=capturable, **hyper)
    else:
        order = None if radius is None else _linalg.series_order(float(radius) ** 2, ct)
        w_new, m_new, v_new, finite = stiefel_adam_update(
            batch.w, -batch.g if group["maximize"] else batch.g, m, v, second_moment=group["second_moment"],
            series_order=order, capturable=capturable, **hyper)
        batch.w.copy_(w_new)
        m.copy_(m_new)
        v.copy_(v_new)
    stabilize = group["stabilize"]  # None in capturable mode (refused by the validation)
    if stabilize is not None and step % stabilize == 0:
        batch.w.copy_(_linalg.polar_svd(batch.w))
        m.copy_(_linalg.proju(batch.w, m))
    batch.write_back()
    optimizer._count_skipped(group, params, finite)  # on the CPU's default step only when a frame was skipped


def _count_skipped(states: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor],
                   finite: torch.Tensor) -> None:
    """Add each parameter's frames that were skipped (``finite`` False, one entry per frame of the batch, in
    order) to its ``state["skipped_frames"]``."""
    _count_frames(states, params, ~finite, "skipped_frames")


def _count_frames(states: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor], flagged: torch.Tensor,
                  key: str) -> None:
    """Add each parameter's frames where ``flagged`` is True (one entry per frame of the batch, in order) to its
    int64 counter ``state[key]``, on the device (no host read)."""
    counts = _frame_counts([_local(p) for p in params])
    if len(set(counts)) == 1:
        added = list(flagged.reshape(len(params), -1).sum(dim=1).unbind(0))
    else:
        added = [part.sum() for part in flagged.reshape(-1).split(counts)]
    torch._foreach_add_([states[p][key] for p in params], added)
