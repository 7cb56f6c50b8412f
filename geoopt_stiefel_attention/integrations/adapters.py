r"""Adapters (PEFT's LoRA, DoRA, IA3, ...: a layer that holds the projection it adapts as its ``base_layer``) on the
query/key projections of a converted model.

**What goes wrong silently without it.** An adapter adds its update to the weight outside the frames (LoRA:
:math:`W + \tfrac{\alpha}{r} B A`), so the query/key weight the model uses is no longer orthonormal, and
``merge_and_unload`` writes the update into a weight that is rebuilt from the frames at every read, where it is lost:
the merged model is the unadapted one.

**How it is detected.** Each converted weight keeps a weak reference to the module that holds its module, the
attribute name and its module (its slot, :func:`set_slots`); at each read of the weight outside ``torch.compile``
:func:`check_not_wrapped` looks whether that attribute now holds another module whose ``base_layer`` child is the
converted one (what ``get_peft_model``, ``PeftModel.from_pretrained`` and ``add_adapter`` install; PEFT reads the
weight while it injects the adapter, so the refusal comes at the wrapping). An adapter already in the model when it
is converted is refused by :func:`~geoopt_stiefel_attention.stiefelize` itself, before anything changes (the
converter's refusal step, ``convert/__init__.py``, with :data:`_ADAPTER_REASON` from here; which child an adapter holds and how it is named are the adapter entry of
the converter's family table, ``convert/families.py``).

**What the user is shown.** A ``RuntimeError`` naming the weight and the adapter (``lora.Linear``), and the two ways
out: leave the query/key projections out of the adapter's ``target_modules`` (the frames train with StiefelAdam), or
``unstiefelize(model)`` before adding the adapter to fine-tune the stock weights.

Tests: ``tests/test_training_stacks_2.py`` (``-k peft``).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from ..convert.families import adapted_child
from ..convert.families import adapter_name as _adapter_name

__all__: list[str] = []


#: Why an adapter layer (PEFT's LoRA, DoRA, IA3, ...: a module holding the projection as its ``base_layer``) cannot
#: wrap a converted query/key projection; the first words name where, the fix follows.
_ADAPTER_REASON = ("adds its update (LoRA: (lora_alpha/r) B A) to the weight outside the frames, so the query/key "
                  "weight is no longer orthonormal, and merge_and_unload would write it into a weight rebuilt from the "
                  "frames at every read, where it is lost")


def check_not_wrapped(p: nn.Module, slot: tuple[Any, str, Any]) -> None:
    """Refuse to build a converted weight whose module is now held by an adapter layer (its ``base_layer``): PEFT's
    ``get_peft_model`` / ``PeftModel.from_pretrained`` / ``add_adapter`` with the query/key projections among the
    targets. Raised at the first read after the wrapping (PEFT reads the weight while it injects the adapter)."""
    parent, owner = slot[0](), slot[2]()
    if parent is None or owner is None:
        return
    here = parent._modules.get(slot[1])
    if here is owner or here is None or here._modules.get(adapted_child(here)) is not owner:
        return
    raise RuntimeError(f"{getattr(p, 'label', 'converted weight')}: its converted module is wrapped by an adapter "
                       f"layer ({_adapter_name(here)}, e.g. PEFT's get_peft_model with this projection in "
                       f"target_modules), which {_ADAPTER_REASON}; leave the query/key projections out of the "
                       f"adapter's target_modules (the frames train with StiefelAdam), or call unstiefelize(model) "
                       f"before adding the adapter to fine-tune the stock weights (to undo the wrapping: "
                       f"peft_model.unload(), or build the model again).")


def set_slots(model: nn.Module, weight_type: type) -> None:
    """Give every converted weight (a parametrization of type ``weight_type``) of ``model`` its ``_slot``: weak
    references to the module holding its module, the attribute name, and its module, read by
    :func:`check_not_wrapped`."""
    for parent in model.modules():
        for name, child in parent._modules.items():
            plists = getattr(child, "parametrizations", None) if child is not None else None
            if not isinstance(plists, nn.ModuleDict):
                continue
            for plist in plists.values():
                if isinstance(plist[0], weight_type):
                    plist[0].__dict__["_slot"] = (weakref.ref(parent), name, weakref.ref(child))
