r"""Data-parallel and sharded training with Stiefel frames.

**DDP** needs nothing special: :class:`torch.nn.parallel.DistributedDataParallel` all-reduces (averages)
every gradient, frames included, so each rank runs the same step of its frame optimizer
(:class:`~geoopt_stiefel_attention.StiefelAdam` or :class:`~geoopt_stiefel_attention.StiefelMuon`) on the same
frames and they stay identical and on the manifold.

**FSDP2, frames sharded by whole heads** (:func:`fully_shard_by_heads`). The update acts on one frame at a
time: for a stack of frames :math:`W_h \in \mathrm{St}(d, r)`, :math:`h = 1, \dots, H`, stored as one tensor
of shape ``(H, d, r)``, frame :math:`h` needs only its own :math:`W_h`, gradient :math:`G_h`, first moment
:math:`m_h` and scalar second moment :math:`v_h`:

.. math::

    \xi_h = G_h - W_h \operatorname{sym}(W_h^\top G_h), \qquad
    v_h \leftarrow \beta_2 v_h + (1 - \beta_2)\|\xi_h\|_F^2, \qquad
    W_h \leftarrow \operatorname{polar}(W_h - s_h).

So a frame tensor sharded along a leading (head or stack) dimension, ``Shard(0)`` in
:mod:`torch.distributed.tensor`, is updated shard by shard with no communication beyond FSDP's own
reduce-scatter of the gradients and all-gather of the parameters, and its optimizer state (first moment
``(H, d, r)``, second moment ``(H, 1, 1)``) is sharded the same way. A sharding along ``d`` or ``r`` (the last
two dimensions) would split frames and is refused (:func:`check_parameter`).

FSDP2 (``torch.distributed.fsdp.fully_shard``) replaces every parameter by a plain ``nn.Parameter`` holding a
:class:`~torch.distributed.tensor.DTensor`, and a :class:`geoopt.ManifoldParameter` loses its ``manifold`` on
the way: an optimizer would see an ordinary matrix and silently train the frame with AdamW, off the
manifold. :func:`fully_shard_by_heads` therefore gives each sharded frame its manifold back, keeps a frame
that has no leading dimension (a single ``(d, r)`` frame), and any other non-Euclidean geoopt parameter,
replicated, and declares the rest Euclidean;
the frame optimizers (:class:`~geoopt_stiefel_attention.StiefelAdam`,
:class:`~geoopt_stiefel_attention.StiefelMuon`) refuse any other sharded parameter (:func:`check_parameter`), so
the silent failure cannot happen. For the same reason :func:`fully_shard_by_heads` refuses, before changing
anything, a model whose parameters were already sharded by a plain ``fully_shard`` (e.g. per block first):
their frames have lost their manifold and cannot be told from Euclidean parameters any more.

"Frame" is :func:`~geoopt_stiefel_attention.is_frame` (any Stiefel manifold, geoopt's canonical
``Stiefel()`` included); "any other manifold" is :func:`~geoopt_stiefel_attention.manifolds.has_manifold`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# the refusals (what FSDP would do to frames without a word) live in the FSDP guard, integrations/fsdp.py; the public
# ones are exported here, and optim and convert read FSDP1_REFUSAL and flattened_by_fsdp1 as distributed.<name>
from .integrations.fsdp import (  # noqa: F401 - FSDP1_REFUSAL, flattened_by_fsdp1: read through this module
    FSDP1_REFUSAL,
    _presharded_error,
    check_parameter,
    declare_sharded_euclidean,
    flattened_by_fsdp1,
    frame_sharding_error,
    is_sharded,
)
from .manifolds import has_manifold, is_frame

__all__ = [
    "is_sharded",
    "check_parameter",
    "frame_sharding_error",
    "local_tensor",
    "local_grad",
    "like_parameter",
    "to_placements_of",
    "declare_sharded_euclidean",
    "average_gradients_hook",
    "fully_shard_by_heads",
    "local_frame_bytes",
]

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` held by this rank: the local shard of a ``DTensor`` (sharing its storage, so in-place
    changes reach the ``DTensor``), or ``t`` itself.

    Parameters
    ----------
    t : torch.Tensor
        A tensor, sharded or not.

    Returns
    -------
    torch.Tensor
        Its local shard, or ``t``.
    """
    return t._local_tensor if is_sharded(t) else t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """The local part of ``p.grad`` laid out like ``p``'s local shard.

    Under FSDP2 the gradient of a sharded parameter is a ``DTensor`` with the parameter's placements (FSDP
    reduce-scatters it), and this is free. A gradient with other placements (e.g. ``Partial`` sums from a
    hand-written ``DTensor`` model) is redistributed to the parameter's placements first, a collective.

    Parameters
    ----------
    p : torch.Tensor
        A parameter (sharded or not).

    Returns
    -------
    torch.Tensor or None
        The local gradient (``p.grad`` itself, possibly ``None``, when ``p`` is not sharded).

    Raises
    ------
    TypeError
        When ``p`` is sharded and its gradient is a plain tensor.
    """
    g = p.grad
    if not is_sharded(p):
        return g
    if not is_sharded(g):
        raise TypeError(f"parameter of shape {tuple(p.shape)} is a DTensor but its gradient is a plain "
                        f"{torch.typename(g)}; assign gradients as DTensors with the parameter's placements.")
    if tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh:
        g = g.redistribute(p.device_mesh, p.placements)
    return g._local_tensor


def like_parameter(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """State for parameter ``p``: ``local`` itself when ``p`` is not sharded, else the ``DTensor`` of global
    ``shape`` whose local shard on this rank is ``local``, on ``p``'s mesh with ``p``'s placements (so that
    ``torch.distributed.checkpoint`` saves and loads it shard by shard, like the parameter).

    ``shape`` must agree with ``p`` on every sharded dimension (true of the frame state: ``(..., d, r)``,
    ``(..., 1, 1)``, ``(..., 1, r)`` with frames sharded along the leading dimensions).

    Parameters
    ----------
    p : torch.Tensor
        A parameter (sharded or not).
    local : torch.Tensor
        This rank's part of the state.
    shape : tuple of int
        The state's global shape.

    Returns
    -------
    torch.Tensor
        ``local``, or a ``DTensor`` wrapping it.
    """
    if not is_sharded(p):
        return local
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    if local.dim() >= 2 and not local.is_contiguous() and local.mT.is_contiguous():  # column-major state
        stride = torch.empty(shape[:-2] + (shape[-1], shape[-2]), device="meta").mT.stride()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def to_placements_of(p: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of state ``value`` (global shape) as a ``DTensor`` sharded like parameter ``p``, in ``dtype``.

    A ``DTensor`` (what ``torch.distributed.checkpoint`` loads) with other placements is redistributed; a
    plain tensor holding the whole state (the same on every rank, e.g. a full optimizer state dict) is
    split by ``torch.distributed.tensor.distribute_tensor``. Every rank must call it (it may communicate).

    Parameters
    ----------
    p : torch.Tensor
        The sharded parameter whose mesh and placements the result takes.
    value : torch.Tensor
        The state, a ``DTensor`` or a plain tensor of global shape.
    dtype : torch.dtype
        Dtype of the result.

    Returns
    -------
    torch.Tensor
        A new ``DTensor`` with ``p``'s mesh and placements.
    """
    from torch.distributed.tensor import distribute_tensor

    if is_sharded(value):
        if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
            value = value.redistribute(p.device_mesh, p.placements)
        return value.to(dtype=dtype, copy=True)
    # a copy: for Replicate, distribute_tensor keeps the given tensor as the local one (it would alias the source)
    return distribute_tensor(value.to(dtype=dtype, device=p.device, copy=True), p.device_mesh, p.placements)


def average_gradients_hook(group=None):
    """A ``register_post_accumulate_grad_hook`` hook that averages ``p.grad`` over ``group`` (all-reduce).

    Averaging is linear, so with gradient accumulation (several backward passes before a step) the hook
    may run after each of them: an already averaged part is the same on every rank and stays unchanged.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The ranks to average over; ``None`` (the default) is the default process group.

    Returns
    -------
    callable
        ``hook(p)``, which averages ``p.grad`` in place (nothing for ``p.grad is None`` or one rank).
    """
    import torch.distributed as dist

    def hook(p: torch.Tensor) -> None:
        if p.grad is None:
            return
        world = dist.get_world_size(group)
        if world > 1:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(world)

    return hook


def _keep_replicated(p: torch.Tensor) -> bool:
    """Parameters FSDP must not shard: non-Euclidean geoopt parameters other than stacks of frames (a single
    ``(d, r)`` frame has no leading dimension to shard along; other manifolds have unknown geometry)."""
    return has_manifold(p) and not (is_frame(p) and p.dim() >= 3)


def _replicate(model: nn.Module, params: list[torch.Tensor], group) -> None:
    """Broadcast ``params`` from the group's first rank and average their gradients over ``group``."""
    import torch.distributed as dist

    source = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=source, group=group)
    hook = average_gradients_hook(group)
    for p in params:
        # Registered on frozen parameters too: one frozen now and unfrozen later (staged fine-tuning) must be
        # averaged as well, or the replicas drift apart. The hook lives on the tensor, not on requires_grad,
        # but it can only be registered while the tensor requires grad: switch that on for the registration.
        frozen = not p.requires_grad
        if frozen:
            p.requires_grad_(True)
        try:
            p.register_post_accumulate_grad_hook(hook)
        finally:
            if frozen:
                p.requires_grad_(False)


def fully_shard_by_heads(
    model: nn.Module,
    *,
    submodules: Iterable[nn.Module] = (),
    **fully_shard_kwargs,
) -> nn.Module:
    r"""Shard ``model`` with FSDP2 (``torch.distributed.fsdp.fully_shard``), frames by whole heads.

    - Every stack of frames of shape ``(H, d, r)`` (any :func:`~geoopt_stiefel_attention.is_frame` parameter
      with a leading dimension, e.g. ``w_q``/``w_k`` of
      :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention`) is sharded along its head dimension,
      ``Shard(0)`` (FSDP2's ``shard_placement_fn``): rank ``k`` of ``n`` holds heads
      ``k*ceil(H/n) ... min(H, (k+1)*ceil(H/n)) - 1`` (``torch.chunk``'s split). ``H`` need not be divisible
      by ``n``: FSDP2 pads uneven shards, a rank may hold fewer heads or none, and every rank still updates
      only whole frames. After sharding the frame gets its manifold back, so a frame optimizer
      (:class:`~geoopt_stiefel_attention.StiefelAdam`, :class:`~geoopt_stiefel_attention.StiefelMuon`) updates
      its local heads on the manifold.
    - A single frame ``(d, r)`` and any parameter on another non-Euclidean manifold stays out of the sharding
      (``ignored_params``): replicated, broadcast from the group's first rank, its gradient averaged over the
      group, :math:`G \leftarrow \frac1n\sum_k G_k`, by a post-accumulate-grad hook, registered whether or not
      it requires grad now (a frame frozen here and unfrozen later is averaged too).
    - Everything else is sharded as FSDP2 does by default (or by your ``shard_placement_fn``) and declared
      Euclidean.

    Each module in ``submodules`` (e.g. the transformer blocks) is sharded first, then ``model``. Build the
    optimizer after this call, from ``model.parameters()`` (or :func:`~geoopt_stiefel_attention.param_groups`).
    Checkpoint with ``torch.distributed.checkpoint`` and
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``: parameters and optimizer
    state are ``DTensor`` s with the same placements.

    Parameters
    ----------
    model : nn.Module
    submodules : iterable of nn.Module
        Modules to shard individually before ``model`` (FSDP2's usual per-block wrapping).
    **fully_shard_kwargs
        Passed to ``fully_shard`` (``mesh``, ``reshard_after_forward``, ``mp_policy``, ...). ``mesh`` must be
        one-dimensional if the model has replicated (``(d, r)`` or non-Stiefel) manifold parameters.
        ``ignored_params`` is extended with those; a ``shard_placement_fn`` is consulted for every parameter
        but the frame stacks.

    Returns
    -------
    nn.Module
        ``model`` (sharded in place, as ``fully_shard`` does).

    Raises
    ------
    ValueError
        When ``mesh`` is not one-dimensional but replicated manifold parameters need a group to average over;
        or when a parameter is already sharded (a ``DTensor``) and was not left so by an earlier
        ``fully_shard_by_heads`` (e.g. blocks sharded first with a plain ``fully_shard``, which drops the
        frames' manifold, so that they cannot be told from Euclidean parameters any more). Both are raised
        before anything is changed.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    submodules = list(submodules)
    why = _presharded_error(model, submodules)
    if why is not None:
        raise ValueError(why)
    # parameters sharded before this call: an earlier fully_shard_by_heads declared or restored them already
    presharded = {id(p) for p in model.parameters() if is_sharded(p)}
    manifolds = {name: p.manifold for name, p in model.named_parameters() if is_frame(p) and p.dim() >= 3}
    stacks = {id(model.get_parameter(name)) for name in manifolds}
    kept = [p for p in model.parameters() if _keep_replicated(p)]
    mesh = fully_shard_kwargs.get("mesh")
    group = None
    if kept and mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"fully_shard_by_heads: mesh has {mesh.ndim} dimensions, but "
                             f"{len(kept)} replicated manifold parameters (single (d, r) frames or non-Stiefel "
                             f"manifolds) need one data-parallel group to average over; pass a 1-D mesh, or "
                             f"store frames as (heads, d, r) stacks.")
        group = mesh.get_group()
    user_fn = fully_shard_kwargs.pop("shard_placement_fn", None)

    def placement(p: nn.Parameter):
        if id(p) in stacks:
            return Shard(0)
        return user_fn(p) if user_fn is not None else None

    if kept:
        _replicate(model, kept, group)
    ignored = set(fully_shard_kwargs.pop("ignored_params", None) or ()) | set(kept)
    for module in submodules:
        fully_shard(module, ignored_params=ignored, shard_placement_fn=placement, **fully_shard_kwargs)
    fully_shard(model, ignored_params=ignored, shard_placement_fn=placement, **fully_shard_kwargs)
    for name, manifold in manifolds.items():
        model.get_parameter(name).manifold = manifold
    # only what this call sharded itself (the presharded parameters were checked on entry)
    declare_sharded_euclidean(p for p in model.parameters() if not has_manifold(p) and id(p) not in presharded)
    return model


def local_frame_bytes(model: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes of the frames held by this rank: their local shards, local gradients and local optimizer state.

    Measured from the tensors themselves (``numel * element_size`` of each local shard, never a formula), so
    a replicated frame counts in full on every rank and a head-sharded one only its heads.

    Parameters
    ----------
    model : nn.Module
        Its frames (:func:`~geoopt_stiefel_attention.is_frame`) and their ``.grad`` are counted.
    optimizer : torch.optim.Optimizer, optional
        Its state tensors of the frames are counted (``"state"``); without it ``"state"`` is 0.

    Returns
    -------
    dict
        ``{"params": ..., "grads": ..., "state": ..., "total": ...}`` in bytes.
    """
    def nbytes(t: torch.Tensor) -> int:
        t = local_tensor(t)
        return t.numel() * t.element_size()

    frames = [p for p in model.parameters() if is_frame(p)]
    out = {"params": sum(nbytes(p) for p in frames),
           "grads": sum(nbytes(p.grad) for p in frames if p.grad is not None),
           "state": 0}
    if optimizer is not None:
        for p in frames:
            out["state"] += sum(nbytes(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    out["total"] = out["params"] + out["grads"] + out["state"]
    return out
