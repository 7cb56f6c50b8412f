r"""``torch.nn.parallel.DistributedDataParallel`` (DDP) around a converted model.

**What goes wrong silently without it.** DDP registers the parameters it synchronises when it is built. A model
converted after the wrapping (``stiefelize(ddp.module)``) has frames DDP never registered: their gradients are not
averaged, so each rank trains its own frames. With ``find_unused_parameters=True`` DDP itself says nothing (measured:
the frames of two ranks 0.069 apart after 3 steps); without it, DDP fails at the second step on "parameters that were
not used", which does not name the cause.

**How it is detected.** At each build of a converted weight with gradients enabled, outside ``torch.compile``,
:func:`active` reads the DDP whose forward is running (DDP's class attribute ``_active_ddp_module``, set around its
forward) and :func:`check_synchronised` compares the weight's trainable frames with what that DDP registered
(``_module_parameters``, plus ``_delay_all_reduce_params``, the parameters it was told to ignore and those marked
``_ddp_ignored``). Each weight passes once per DDP. A DDP wrapped around the model before the conversion
(``stiefelize(ddp)``) is refused by :func:`~geoopt_stiefel_attention.stiefelize` itself, before anything changes (the
converter's refusal step, ``convert/__init__.py``).

These four names are private attributes of torch; ``tests/test_integrations_pins.py`` fails, in one sentence naming
this module, when a torch release drops one of them. Where ``_module_parameters`` is missing the check passes (there
is nothing to compare with); where ``_active_ddp_module`` is missing nothing is checked.

**What the user is shown.** A ``RuntimeError`` naming the weight and its frames, and the order that works: convert
first, then wrap (``stiefelize(model); ddp = DistributedDataParallel(model)``).

Tests: ``tests/test_training_stacks.py`` (``-k ddp``), ``tests/test_distributed.py``.
"""

from __future__ import annotations

import weakref

from torch import nn

__all__: list[str] = []

_DDP = nn.parallel.DistributedDataParallel


def active() -> nn.Module | None:
    """The ``DistributedDataParallel`` whose forward is running in this process (``None`` outside one): DDP's class
    attribute ``_active_ddp_module``, which its forward sets and clears. It is not set by DDP's Python reducer
    (compiled autograd), so the check is off there."""
    return getattr(_DDP, "_active_ddp_module", None)


def check_synchronised(p: nn.Module, ddp: nn.Module) -> None:
    """Refuse to build a converted weight, inside the forward of ``DistributedDataParallel`` ``ddp``, whose trainable
    frames ``ddp`` does not synchronise: they were made after it was built (``stiefelize(ddp.module)``), so it never
    registered them and each rank would train its own frames (with ``find_unused_parameters=True`` DDP itself says
    nothing; without, it fails at the second step on "parameters that were not used"). Only a weight inside
    ``ddp.module`` is checked (DDP's marker of its forward is one class attribute, which another thread's model, or
    a module called from the forward but held elsewhere, also sees); each passes once per DDP (``_ddp_checked``
    holds a weak reference to the last DDP it passed)."""
    checked = p.__dict__.get("_ddp_checked")
    if checked is not None and checked() is ddp:
        return
    inner = getattr(ddp, "module", None)
    if not isinstance(inner, nn.Module) or not any(m is p for m in inner.modules()):
        return  # read in that forward but not part of the wrapped model (another model, another thread): not its frames
    registered = getattr(ddp, "_module_parameters", None)
    if registered is None:  # a DDP that does not list what it registered (another torch): nothing to compare with
        return
    held = {id(q) for q in registered}
    held.update(id(q) for q in getattr(ddp, "_delay_all_reduce_params", ()))
    ignored = getattr(ddp, "parameters_to_ignore", ())
    held.update(id(q) for name, q in ddp.module.named_parameters() if name in ignored)  # left out by the user
    missing = [name for name, w in p.frames() if w.requires_grad and id(w) not in held
               and not getattr(w, "_ddp_ignored", False)]
    if missing:
        raise RuntimeError(
            f"{getattr(p, 'label', 'converted weight')}: DistributedDataParallel does not synchronise its frames "
            f"({', '.join(missing)}): they were made by stiefelize after DDP wrapped the model, so DDP never "
            f"registered them and each rank would train its own frames; convert first, then wrap: "
            f"stiefelize(model); ddp = DistributedDataParallel(model).")
    p.__dict__["_ddp_checked"] = weakref.ref(ddp)
