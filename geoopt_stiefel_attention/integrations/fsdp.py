r"""FSDP around a model with frames: FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``).

**What goes wrong silently without it.** FSDP1 flattens its parameters and shards them by element count, which
splits frames across ranks, where no rank can retract them: a frame optimizer would update pieces of frames. FSDP2
replaces every parameter by a plain ``nn.Parameter`` holding a ``DTensor``, and a ``geoopt.ManifoldParameter`` loses
its ``manifold`` on the way: an optimizer would see an ordinary matrix and train the frame with AdamW, off the
manifold; and a ``DTensor`` sharded along ``d`` or ``r`` splits every frame.

**How it is detected.**

- *FSDP1*: :func:`flattened_by_fsdp1` reads the marks torch puts on what FSDP1 flattened (``_fsdp_flattened`` on a
  flat parameter and on its views, ``_param_infos`` listing a flat parameter's pieces, whose owners name their frames
  in ``_FRAME_PARAMS``), for :func:`~geoopt_stiefel_attention.param_groups` and the frame optimizers;
  :func:`~geoopt_stiefel_attention.stiefelize` refuses a model holding a ``FullyShardedDataParallel`` (the
  converter's refusal step, ``convert/__init__.py``). ``_fsdp_flattened`` and ``_param_infos`` are private to torch;
  ``tests/test_integrations_pins.py`` fails, naming this module, when a torch release drops them.
- *FSDP2*: a sharded parameter is a ``DTensor`` (:func:`is_sharded`). The frame optimizers call
  :func:`check_parameter` on every parameter: a frame is accepted when its placements keep frames whole
  (:func:`frame_sharding_error`), any other sharded parameter only when it was declared Euclidean
  (:func:`declare_sharded_euclidean`, done by :func:`~geoopt_stiefel_attention.distributed.fully_shard_by_heads`,
  which shards frames by whole heads and gives them their manifold back). ``fully_shard_by_heads`` refuses a model
  already sharded by a plain ``fully_shard`` (:func:`_presharded_error`), whose frames can no longer be told apart.

**What the user is shown.** ``NotImplementedError`` (``param_groups``, the optimizers) or ``TypeError``
(``stiefelize``) ending in :data:`FSDP1_REFUSAL`: convert first, then shard with FSDP2 by whole heads,
``geoopt_stiefel_attention.distributed.fully_shard_by_heads(model)``; for FSDP2, ``NotImplementedError`` naming the
parameter, its placements and ``fully_shard_by_heads`` (or ``declare_sharded_euclidean`` for parameters known not to
be frames); ``ValueError`` from ``fully_shard_by_heads`` on a presharded model, before anything changes. The public
names are exported by :mod:`geoopt_stiefel_attention.distributed`.

Tests: ``tests/test_distributed.py``, ``tests/test_training_stacks.py`` (``-k fsdp``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from .._docfrag import fill
from ..manifolds import has_manifold, is_frame

# the public names, exported by geoopt_stiefel_attention.distributed
__all__ = ["is_sharded", "frame_sharding_error", "declare_sharded_euclidean", "check_parameter"]

# Sharded parameters known not to be frames (filled by fully_shard_by_heads / declare_sharded_euclidean),
# keyed by id: tensors compare elementwise, so they cannot be members of a (Weak)Set.
_DECLARED_EUCLIDEAN: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

_FIX = ("Shard frames along their leading (head) dimension only, Shard(0) on a (heads, d, r) tensor, e.g. with "
        "geoopt_stiefel_attention.distributed.fully_shard_by_heads(model), or use DistributedDataParallel.")


#: Why FSDP1 cannot shard frames, and what to use: the end of every FSDP1 refusal.
FSDP1_REFUSAL = ("FullyShardedDataParallel (FSDP1) flattens its parameters and shards them by element count, which "
                 "splits frames across ranks, where no rank can retract them; convert the model first, then shard it "
                 "with FSDP2 by whole heads: geoopt_stiefel_attention.distributed.fully_shard_by_heads(model) "
                 "(accelerate: fsdp_version: 2; the HuggingFace Trainer: fsdp_config version 2, its default)")


def flattened_by_fsdp1(p: torch.Tensor) -> bool:
    """Whether ``p`` is a frame that FSDP1 flattened (``use_orig_params=True`` keeps it as a view of its flat
    parameter), or an FSDP1 flat parameter holding one (``use_orig_params=False``): torch marks both with
    ``_fsdp_flattened``, and a flat parameter lists its pieces' owners in ``_param_infos``; an owner names its frame
    parameters in ``_FRAME_PARAMS`` (the library's attention modules and the parametrization of ``stiefelize``)."""
    if not getattr(p, "_fsdp_flattened", False):
        return False
    if is_frame(p):
        return True
    return any(getattr(info, "param_name", None) in getattr(getattr(info, "module", None), "_FRAME_PARAMS", ())
               for info in getattr(p, "_param_infos", None) or ())


@fill
def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a :class:`torch.distributed.tensor.DTensor` (e.g. a parameter sharded by FSDP2).

    Costs nothing when ``torch.distributed.tensor`` was never imported (then no ``DTensor`` can exist).

    {{parameters_p}}

    Returns
    -------
    bool
        ``True`` for a ``DTensor``.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def frame_sharding_error(p: torch.Tensor) -> str | None:
    """Why the sharding of frame parameter ``p`` (a ``DTensor`` of shape ``(..., d, r)``) would split frames, or
    ``None`` when every placement is ``Replicate`` or ``Shard`` along a leading dimension (each rank then holds
    whole frames).

    Parameters
    ----------
    p : torch.Tensor
        A sharded frame parameter (``DTensor``).

    Returns
    -------
    str or None
        The reason, or ``None`` when the sharding keeps frames whole.
    """
    from torch.distributed.tensor import Replicate, Shard

    for placement in p.placements:
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard):
            dim = placement.dim % p.dim()
            if dim < p.dim() - 2:
                continue
            which = "d (rows)" if dim == p.dim() - 2 else "r (columns)"
            return (f"it is sharded along dim {dim}, the {which} dimension of its d x r frames, which splits "
                    f"every frame across ranks (placements {tuple(p.placements)}); the polar retraction and "
                    f"the per-frame second moment need whole frames")
        return (f"its placement {placement} is neither Replicate nor Shard along a leading dimension "
                f"(placements {tuple(p.placements)})")
    return None


def declare_sharded_euclidean(params: Iterable[torch.Tensor]) -> None:
    """Declare sharded (``DTensor``) parameters to be ordinary Euclidean parameters, not frames.

    Use it only when you shard a model yourself and have given every frame its manifold back (or kept it out
    of the sharding); :func:`fully_shard_by_heads` does this and declares the rest for you.

    Parameters
    ----------
    params : iterable of torch.Tensor
        Parameters to declare; those that are not sharded are ignored.
    """
    for p in params:
        if is_sharded(p):
            _DECLARED_EUCLIDEAN[id(p)] = p


def check_parameter(p: torch.Tensor, owner: str = "the frame optimizer") -> None:
    """Raise ``NotImplementedError`` for a sharded parameter the optimizer cannot train safely.

    ``owner`` begins every message: the optimizer's class name (``StiefelAdam``, ``StiefelMuon``), as the
    frame optimizers pass it.

    Accepted: a sharded frame whose placements keep frames whole (:func:`frame_sharding_error` is ``None``),
    and a sharded parameter declared Euclidean (:func:`declare_sharded_euclidean`, done by
    :func:`fully_shard_by_heads`). Refused: a frame sharded along ``d`` or ``r``; a sharded parameter on
    another manifold; a sharded parameter without a manifold that was not declared Euclidean (it may be a
    frame whose manifold FSDP2 dropped, which would silently be trained as a Euclidean matrix).

    Parameters
    ----------
    p : torch.Tensor
        The parameter to check (nothing is checked when it is not sharded).
    owner : str, default "the frame optimizer"
        First words of the error message.

    Raises
    ------
    NotImplementedError
        For the refused cases above.
    """
    if not is_sharded(p):
        return
    if is_frame(p):
        why = frame_sharding_error(p)
        if why is not None:
            raise NotImplementedError(f"{owner}: frame parameter of shape {tuple(p.shape)} cannot be trained: "
                                      f"{why}. {_FIX}")
        return
    if has_manifold(p):
        raise NotImplementedError(
            f"{owner}: parameter on {p.manifold.name} of shape {tuple(p.shape)} is sharded (a DTensor); only "
            f"Stiefel frames sharded along a leading dimension are supported. Keep it out of the sharding "
            f"(fully_shard(..., ignored_params=...)), as fully_shard_by_heads does.")
    if _DECLARED_EUCLIDEAN.get(id(p)) is not p:
        raise NotImplementedError(
            f"{owner}: parameter of shape {tuple(p.shape)} is sharded (a DTensor, e.g. by FSDP's fully_shard), "
            f"and FSDP drops the Stiefel manifold of sharded frames, so it may be a frame that would silently "
            f"be trained as a Euclidean matrix. Shard with "
            f"geoopt_stiefel_attention.distributed.fully_shard_by_heads(model), which gives the frames their "
            f"manifold back; or, if you restored every frame's manifold yourself, declare the rest with "
            f"geoopt_stiefel_attention.distributed.declare_sharded_euclidean(params).")


def _presharded_error(model: nn.Module, submodules: list[nn.Module]) -> str | None:
    """Why ``fully_shard_by_heads`` cannot shard ``model``: a parameter that is already a ``DTensor`` and not
    one an earlier ``fully_shard_by_heads`` left behind (a frame stack with its manifold back, or a parameter
    declared Euclidean), or ``None``."""
    module_names = {id(m): name for name, m in model.named_modules()}
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for i, module in enumerate([model, *submodules]):
        prefix = module_names.get(id(module), f"submodules[{i - 1}]")
        for name, p in module.named_parameters():
            named.setdefault(id(p), (f"{prefix}.{name}" if prefix else name, p))
    bad = []
    for name, p in named.values():
        if not is_sharded(p):
            continue
        if is_frame(p) and p.dim() >= 3:
            why = frame_sharding_error(p)
            if why is not None:
                bad.append((name, p, f"is a frame stack already sharded in a way that splits frames: {why}"))
        elif has_manifold(p):
            bad.append((name, p, f"is on {p.manifold.name} and already sharded (a DTensor), but it must stay "
                                 f"replicated (a single (d, r) frame or a non-Stiefel manifold)"))
        elif _DECLARED_EUCLIDEAN.get(id(p)) is not p:
            bad.append((name, p, "is already sharded (a DTensor, e.g. by a plain torch.distributed.fsdp."
                                 "fully_shard of its module) and has no manifold, so it may be a frame whose "
                                 "Stiefel manifold FSDP dropped, which would be declared Euclidean and trained "
                                 "off the manifold"))
    if not bad:
        return None
    # name first a parameter that may have been a frame (d >= r), not e.g. a LayerNorm weight
    name, p, why = min(bad, key=lambda b: not (b[1].dim() >= 2 and b[1].shape[-2] >= b[1].shape[-1]))
    owner = name.rpartition(".")[0]
    module = type(model.get_submodule(owner)).__name__ if owner in module_names.values() else "its module"
    more = f" ({len(bad) - 1} more parameters likewise)" if len(bad) > 1 else ""
    return (f"fully_shard_by_heads: parameter {name!r} of shape {tuple(p.shape)} ({module}) {why}{more}; call "
            f"fully_shard_by_heads on the unsharded model instead of fully_shard, with the blocks as "
            f"fully_shard_by_heads(model, submodules=blocks) (or, for a parameter that is not a frame, declare "
            f"it with declare_sharded_euclidean first).")
