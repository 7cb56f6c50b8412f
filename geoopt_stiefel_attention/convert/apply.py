r"""Applying a planned conversion: the parametrizations registered on each site's query/key weights (and biases
held at zero), the weights they replace, and the probe batch that measures the output change."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .checkpoints import _hook_state_dicts, _stock_names
from .layouts import _is_torch_mha
from .parametrization import _MARK, _QKWeight, _ZeroQKBias
from .result import ConvertedAttention
from .sites import _Site


def _weight_path(site: _Site, owner: nn.Module, attr: str) -> str:
    """The path in the model of weight ``attr`` of ``owner``, a module inside the site's attention module."""
    inner = next((n for n, m in site.module.named_modules() if m is owner), "")
    return ".".join(x for x in (site.path, inner, attr) if x)


def _converted_weights(sites: list[_Site]) -> list[tuple[Tensor, nn.Module, str, str]]:
    """``(weight, owner, attr, label)`` of every weight the sites convert, once each (a fused weight holds both the
    query and the key rows), read before the conversion replaces it; the label is the weight's path in the model."""
    out, seen = [], set()
    for site in sites:
        for piece in (site.q, site.k):
            if (id(piece.owner), piece.attr) in seen:
                continue
            seen.add((id(piece.owner), piece.attr))
            label = _weight_path(site, piece.owner, piece.attr)
            out.append((getattr(piece.owner, piece.attr), piece.owner, piece.attr, label))
    return out


def _apply(site: _Site, logit_gain: str | None, gain_rate: float, gain: Tensor | None,
           from_weights: bool = False) -> ConvertedAttention:
    q, k, r = site.q, site.k, site.r
    groups: dict[tuple[int, str], list] = {}
    for p in (q, k):
        groups.setdefault((id(p.owner), p.attr), [p.owner, p.attr, []])[2].append(p)
    for owner, attr, pieces in groups.values():
        weight = getattr(owner, attr)
        specs = [dict(role=p.role, start=p.start, length=p.length, r=r,
                      gain=gain if p.role == "q" else None) for p in pieces]
        _hook_state_dicts(owner, _stock_names(owner))
        label = _weight_path(site, owner, attr)
        parametrize.register_parametrization(owner, attr, _QKWeight(weight, pieces[0].dim, specs, gain_rate,
                                                                    label=label, groups=pieces[0].groups),
                                             unsafe=True)
        owner.parametrizations[attr][0].__dict__["_registered"] = True  # later right_inverse calls are assignments
        if _is_torch_mha(owner):  # its forward reads the weight three times: build it once per model forward
            owner.parametrizations[attr][0].__dict__["_reread"] = True
        plist = owner.parametrizations[attr]
        if plist.original.numel() == 0:
            # a pure q_proj/k_proj weight has no rest: keep the empty tensor torch.nn.utils.parametrize needs as a
            # non-persistent buffer, so no zero-size parameter reaches model.parameters() or a state dict
            empty = plist.original.detach()
            del plist._parameters["original"]
            plist.register_buffer("original", empty, persistent=False)
    bias_groups: dict[tuple[int, str], list] = {}
    for owner, attr, start, length in site.bias_spans:
        bias_groups.setdefault((id(owner), attr), [owner, attr, []])[2].append((start, length))
    for owner, attr, spans in bias_groups.values():
        _hook_state_dicts(owner, _stock_names(owner))
        parametrize.register_parametrization(owner, attr, _ZeroQKBias(getattr(owner, attr), spans))
    object.__setattr__(site.module, _MARK, (site.layout.q.param, site.layout.k.param))
    span = "none" if gain is None else f"{float(gain.min()):.3g}..{float(gain.max()):.3g}"
    gain_text = "none" if gain is None else (
        f"learn (kept from the weights: {span})" if logit_gain == "learn" and from_weights else
        "learn (1)" if logit_gain == "learn" else f"fit ({span})")
    return ConvertedAttention(site.path, site.layout.name + site.split, q.heads, k.heads, q.d, k.d, r, gain_text)


def _probe(model: nn.Module, batch: Any) -> Tensor:
    modes = [(m, m.training) for m in model.modules()]  # every module's own mode, restored as it was
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(batch, dict):
                out = model(**batch)
            elif isinstance(batch, tuple):
                out = model(*batch)
            else:
                out = model(batch)
    finally:
        for m, training in modes:
            m.training = training
    for name in ("logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            out = getattr(out, name)
            break
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, Tensor):
        raise ValueError(f"stiefelize: the probe output is a {type(out).__name__}; return a tensor (or an "
                         f"object with .logits / .last_hidden_state, or a tuple whose first element is one).")
    return out.detach().double().clone()
