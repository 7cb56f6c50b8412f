r"""Data-parallel and sharded training with Stiefel frames.

**DDP** needs nothing special: :class:`torch.nn.parallel.DistributedDataParallel` all-reduces (averages)
every gradient, frames included, so each rank runs the same :class:`~geoopt_stiefel_attention.StiefelAdam`
step on the same frames and they stay identical and on the manifold.

**FSDP** (``torch.distributed.fsdp.fully_shard``, "FSDP2") shards every parameter into a
:class:`~torch.distributed.tensor.DTensor` along dim 0 and replaces it by a plain ``nn.Parameter``: a
:class:`geoopt.ManifoldParameter` loses its ``manifold`` on the way, so an optimizer would see an ordinary
matrix and silently train the frame with AdamW, off the manifold. A frame's polar retraction
:math:`W \leftarrow (W - s)((W - s)^\top (W - s))^{-1/2}` and its scalar second moment
:math:`v \leftarrow \beta_2 v + (1 - \beta_2)\|\xi\|_F^2` need the whole ``d x r`` frame. This module
therefore

- keeps the frames out of the sharding (:func:`fully_shard_except_frames`): they stay replicated
  :class:`geoopt.ManifoldParameter` s, their gradients are averaged over the data-parallel group by a
  post-accumulate-grad hook (exactly what DDP would do), and everything else is sharded by FSDP2. "Frame" is
  :func:`~geoopt_stiefel_attention.is_frame` (any Stiefel manifold, geoopt's canonical ``Stiefel()``
  included), and every other geoopt parameter on a non-Euclidean manifold (a ``Sphere``, ...) is kept out
  the same way (:func:`~geoopt_stiefel_attention.manifolds.has_manifold`), since FSDP would drop its manifold
  too;
- makes :class:`~geoopt_stiefel_attention.StiefelAdam` refuse, with ``NotImplementedError``, any sharded
  (``DTensor``) parameter that was not declared Euclidean by :func:`fully_shard_except_frames` or
  :func:`declare_sharded_euclidean` (see :func:`check_parameter`), so the silent failure cannot happen.

Frames are small (``H * d * Dh`` numbers per projection, as many as a ``d x d`` matrix at most), so
replicating them costs little memory next to the MLPs and embeddings that FSDP shards.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from .manifolds import has_manifold, is_frame

__all__ = [
    "is_sharded",
    "check_parameter",
    "declare_sharded_euclidean",
    "average_gradients_hook",
    "fully_shard_except_frames",
]

# Sharded parameters known not to be frames (filled by fully_shard_except_frames / declare_sharded_euclidean),
# keyed by id: tensors compare elementwise, so they cannot be members of a (Weak)Set.
_DECLARED_EUCLIDEAN: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a :class:`torch.distributed.tensor.DTensor` (e.g. a parameter sharded by FSDP2).

    Costs nothing when ``torch.distributed.tensor`` was never imported (then no ``DTensor`` can exist).
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def declare_sharded_euclidean(params: Iterable[torch.Tensor]) -> None:
    """Declare sharded (``DTensor``) parameters to be ordinary Euclidean parameters, not frames.

    Use it only when you shard a model yourself and have kept every Stiefel frame out of the sharding
    (e.g. ``fully_shard(model, ignored_params=set(frame_parameters(model)))`` plus your own averaging of
    the frame gradients); :func:`fully_shard_except_frames` does both and declares the rest for you.
    """
    for p in params:
        if is_sharded(p):
            _DECLARED_EUCLIDEAN[id(p)] = p


def check_parameter(p: torch.Tensor, owner: str = "StiefelAdam") -> None:
    """Raise ``NotImplementedError`` for a sharded parameter the optimizer cannot train safely.

    A sharded frame (a ``DTensor`` that still carries a Stiefel manifold) cannot be retracted shard by
    shard. A sharded parameter without a manifold may be a frame whose manifold FSDP2 dropped; it is
    accepted only after :func:`fully_shard_except_frames` or :func:`declare_sharded_euclidean` said it is
    not a frame.
    """
    if not is_sharded(p):
        return
    fix = ("Use DistributedDataParallel, or shard with geoopt_stiefel_attention.distributed."
           "fully_shard_except_frames(model), which keeps the frames replicated (and averages their "
           "gradients) and shards everything else.")
    if has_manifold(p):
        what = "frame parameter" if is_frame(p) else f"parameter on {p.manifold.name}"
        raise NotImplementedError(
            f"{owner}: {what} of shape {tuple(p.shape)} is sharded (a DTensor); a retraction onto the manifold "
            f"(for frames: the polar retraction and the per-frame second moment) needs whole frames. {fix}")
    if _DECLARED_EUCLIDEAN.get(id(p)) is not p:
        raise NotImplementedError(
            f"{owner}: parameter of shape {tuple(p.shape)} is sharded (a DTensor, e.g. by FSDP's fully_shard), "
            f"and FSDP drops the Stiefel manifold of sharded frames, so it may be a frame that would silently "
            f"be trained as a Euclidean matrix. {fix} If you kept every frame out of the sharding yourself, "
            f"declare the rest with geoopt_stiefel_attention.distributed.declare_sharded_euclidean(params).")


def average_gradients_hook(group=None):
    """A ``register_post_accumulate_grad_hook`` hook that averages ``p.grad`` over ``group`` (all-reduce).

    Averaging is linear, so with gradient accumulation (several backward passes before a step) the hook
    may run after each of them: an already averaged part is the same on every rank and stays unchanged.
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


def fully_shard_except_frames(
    model: nn.Module,
    *,
    submodules: Iterable[nn.Module] = (),
    group=None,
    **fully_shard_kwargs,
) -> nn.Module:
    r"""Shard ``model`` with FSDP2 (``torch.distributed.fsdp.fully_shard``) except its Stiefel frames.

    Every frame (:func:`~geoopt_stiefel_attention.is_frame`), and every other parameter on a non-Euclidean
    geoopt manifold (:func:`~geoopt_stiefel_attention.manifolds.has_manifold`), is passed in
    ``ignored_params``: it stays a replicated :class:`geoopt.ManifoldParameter` on every rank, and a post-accumulate-grad hook averages its
    gradient over ``group``, :math:`G \leftarrow \frac1n \sum_{k=1}^{n} G_k` (what FSDP does for the
    sharded parameters and DDP for all). Each module in ``submodules`` (e.g. the transformer blocks) is
    sharded first, then ``model``. The sharded parameters are declared Euclidean so that
    :class:`~geoopt_stiefel_attention.StiefelAdam` accepts them (it trains them with AdamW, shard by shard).

    Build the optimizer after this call, from ``model.parameters()``. The frames are broadcast from the group's
    first rank (as DDP does at construction), and the averaged gradients keep them identical on every rank.

    Parameters
    ----------
    model : nn.Module
    submodules : iterable of nn.Module
        Modules to shard individually before ``model`` (FSDP2's usual per-block wrapping).
    group : ProcessGroup, optional
        The data-parallel group the frames are broadcast in and their gradients averaged over (default: the
        world).
    **fully_shard_kwargs
        Passed to ``fully_shard`` (``mesh``, ``reshard_after_forward``, ``mp_policy``, ...).
        ``ignored_params`` is extended with the frames.

    Returns
    -------
    nn.Module
        ``model`` (sharded in place, as ``fully_shard`` does).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    frames = [p for p in model.parameters() if has_manifold(p)]  # frames, and any other manifold
    source = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in frames:
            dist.broadcast(p.data, src=source, group=group)
    ignored = set(fully_shard_kwargs.pop("ignored_params", None) or ()) | set(frames)
    for module in submodules:
        fully_shard(module, ignored_params=ignored, **fully_shard_kwargs)
    fully_shard(model, ignored_params=ignored, **fully_shard_kwargs)
    hook = average_gradients_hook(group)
    for p in frames:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)
    declare_sharded_euclidean(p for p in model.parameters() if not has_manifold(p))
    return model
