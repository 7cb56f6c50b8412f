r"""Refusing what cannot be converted: the checks :func:`~geoopt_stiefel_attention.stiefelize` makes on its planned
sites and on the model before anything changes.

A model already wrapped for data parallelism (:func:`_refuse_wrapped_model`); a query/key projection an adapter
layer holds (:func:`_adapted`); a query/key tensor held under several names (:func:`_tied`); parameters that cannot
be changed in place or become whole frames (:func:`_refuse_unchangeable`); a module that looks like attention and
matches no layout (:func:`_unmatched`). Each returns the refusals as ``(path, why)`` or raises; nothing here changes
a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import distributed as _distributed
from ..integrations.adapters import _ADAPTER_REASON
from . import families
from .layouts import Layout
from .result import _where
from .sites import _hint, _looks_like_attention, _Site, _under


def _refuse_wrapped_model(model: nn.Module) -> None:
    """Refuse a model holding a DistributedDataParallel or an FSDP1 wrapper: they registered the parameters they
    synchronise or shard when they were built, before the frames existed."""
    fsdp1 = _fsdp1_class()
    for path, module in model.named_modules():
        where = "model is" if not path else f"model.{path} is"
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise TypeError(f"stiefelize: {where} a DistributedDataParallel, which registered the parameters it "
                            f"synchronises when it was built, so the new frames would train apart on each rank; "
                            f"convert the model before wrapping it: stiefelize(model); "
                            f"ddp = DistributedDataParallel(model).")
        if fsdp1 is not None and isinstance(module, fsdp1):
            raise TypeError(f"stiefelize: {where} a FullyShardedDataParallel: {_distributed.FSDP1_REFUSAL}.")


def _fsdp1_class() -> type | None:
    """``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1), or ``None`` where torch has no distributed
    package."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _refuse_unchangeable(sites: list[_Site]) -> None:
    """Refuse a site holding inference tensors (not changeable in place) or sharded parameters (DTensors, whose
    query/key blocks cannot become whole frames)."""
    for site in sites:
        frozen = [name for name, p in site.module.named_parameters() if p.is_inference()]
        if frozen:
            raise TypeError(f"stiefelize: {_where(site.path)} holds inference tensors ({', '.join(frozen)}: the model "
                            f"was built or loaded under torch.inference_mode()), which cannot be changed in place "
                            f"outside it; build or load the model outside inference mode (torch.no_grad() is enough "
                            f"to save memory), then convert it.")
        sharded = [name for name, p in site.module.named_parameters() if _distributed.is_sharded(p)]
        if sharded:
            raise TypeError(f"stiefelize: {_where(site.path)} holds sharded parameters ({', '.join(sharded)}: "
                            f"DTensors, from fully_shard or a tensor-parallel plan applied before the conversion), "
                            f"whose query/key blocks cannot become whole frames; convert the model first, then shard "
                            f"it with geoopt_stiefel_attention.distributed.fully_shard_by_heads.")


def _unmatched(model: nn.Module, sites: list[_Site], problems: list[tuple[str, str]], table: Sequence[Layout],
               wrapped: dict[str, nn.Module]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The innermost modules that look like attention and that no site or refusal claims, each with why (in
    ``named_modules()`` order), and those of them whose projections adapter layers hold (the table's names then do
    not match them: the adapter is the reason, not the layout)."""
    claimed = [s.path for s in sites] + [p for p, _ in problems]
    candidates = [p for p, m in model.named_modules()
                  if _looks_like_attention(m) and not any(_under(p, c) or _under(c, p) for c in claimed)]
    found, adapted = [], []
    for p in candidates:
        if any(q != p and _under(q, p) for q in candidates):  # report the innermost
            continue
        m = model.get_submodule(p)
        inside = [(w, layer) for w, layer in wrapped.items() if _under(w, p) or _under(p, w)]
        # the adapters around a projection a layout of the table reads (q_proj, c_attn, the module itself)
        # first: one on the value or output projection alone is no reason
        qk = [(w, layer) for w, layer in inside if _adapted_name(w, p) in _qk_owner_names(table)]
        if qk or inside:  # its projections are held by adapter layers, so the table's names do not match
            adapted.append((p, _adapter_refusal(p, qk or inside)))
            found.append(adapted[-1])
            continue
        found.append((p, f"{type(m).__name__} looks like attention but matches no layout ({_hint(m)})"))
    return found, adapted


def _tied(model: nn.Module, sites: list[_Site]) -> tuple[list[_Site], list[tuple[str, str]]]:
    """Split the planned sites into those whose converted tensors are each reachable under one name only, and the
    refusals of the others (``(path, why)``).

    A parametrization is registered on one module's attribute, so a Parameter shared with another module (tied
    weights: ``layers[1].q_proj.weight = layers[0].q_proj.weight``) would be rebuilt from frames in one place and
    resized under the other: refused before anything changes, naming every place it is held."""
    names: dict[int, list[str]] = {}  # a Parameter -> the (module, attribute) places holding it, by name
    for path, module in model.named_modules():  # a module reachable twice is one place (converted once)
        for attr, p in module._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{path}.{attr}" if path else attr)
    kept, problems = [], []
    for site in sites:
        targets = {(id(p.owner), p.attr): (p.owner, p.attr) for p in (site.q, site.k)}
        targets.update({(id(owner), attr): (owner, attr) for owner, attr, _, _ in site.bias_spans})
        shared: dict[int, str] = {}  # one entry per shared Parameter (a query weight tied to the key weight is one)
        for owner, attr in targets.values():
            held = names.get(id(getattr(owner, attr)), [])
            if len(held) > 1:
                shared[id(getattr(owner, attr))] = " and ".join(repr(n) for n in held)
        if shared:
            problems.append((site.path, f"its query/key tensor is one Parameter held under several names "
                                        f"({'; '.join(shared.values())}: tied weights), and a frame parametrization "
                                        f"would replace it under one name only; untie them first (e.g. "
                                        f"module.weight = nn.Parameter(module.weight.detach().clone()) under each "
                                        f"name but one)"))
        else:
            kept.append(site)
    return kept, problems


def _adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The adapter layers of ``model`` (PEFT's LoRA, DoRA, IA3, ... layers: modules holding the layer they adapt as
    their ``base_layer`` child, or under the name another adapter family of the table gives), by the path of the
    module they wrap."""
    found = {}
    for path, module in model.named_modules():
        child = families.adapted_child(module)
        if child is not None:
            found[f"{path}.{child}" if path else child] = module
    return found


def _adapted_name(wrapped_path: str, site_path: str) -> str:
    """The wrapped module's path inside the attention module at ``site_path`` ("" for the module itself)."""
    head, _, child = wrapped_path.rpartition(".")
    inner = head if head and child in families.index().adapter_children else ""
    return inner[len(site_path):].lstrip(".") if _under(inner, site_path) else ""


def _qk_owner_names(table: Sequence[Layout]) -> set[str]:
    """The modules (relative paths) whose weights the layouts of ``table`` read as queries or keys."""
    return {block.param.rpartition(".")[0] for layout in table for block in (layout.q, layout.k)}


def _adapter_refusal(site_path: str, layers: Sequence[tuple[str, nn.Module]]) -> str:
    kinds = sorted({families.adapter_name(m) for _, m in layers})
    where = ", ".join(repr(_adapted_name(w, site_path) or "<the module itself>") for w, _ in layers[:4])
    return (f"its query/key projection is wrapped by an adapter layer ({', '.join(kinds)} at {where}), which "
            f"{_ADAPTER_REASON}; leave the query/key projections out of the adapter's target_modules, or merge the "
            f"adapter first (model = model.merge_and_unload()) and convert the merged model")


def _adapted(sites: list[_Site], wrapped: dict[str, nn.Module]) -> tuple[list[_Site], list[tuple[str, str]]]:
    """Refuse the sites whose query/key weight lies in a module an adapter layer wraps (a user layout naming
    ``q_proj.base_layer.weight``, or an adapter wrapping the attention module itself): its output is the adapted
    one, not the weight the frames would rebuild."""
    if not wrapped:
        return sites, []
    kept, problems = [], []
    for site in sites:
        owners = set()
        for piece in (site.q, site.k):
            inner = next((n for n, m in site.module.named_modules() if m is piece.owner), "")
            owners.add(".".join(x for x in (site.path, inner) if x))
        layers = [(w, layer) for w, layer in wrapped.items() if any(_under(o, w) for o in owners)]
        if layers:
            problems.append((site.path, _adapter_refusal(site.path, layers)))
        else:
            kept.append(site)
    return kept, problems
