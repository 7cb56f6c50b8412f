r"""Put the query/key projections of an existing model on the Stiefel manifold, in place.

Conversion is data: one table of model families (:mod:`.families`) holds all that is known about any model,
and :data:`LAYOUTS` is its attention layouts, each entry (a :class:`Layout`) saying in which parameter the query
rows and the key rows live, along which axis, and in which slice of a fused projection. :func:`stiefelize`
walks the model, gives every module to the first layout that matches it, and registers a
:mod:`torch.nn.utils.parametrize` parametrization on each weight that holds query or key rows.
The parametrization rebuilds that weight from ``(heads, d, r)`` frames, :class:`geoopt.ManifoldParameter` s
on :class:`~geoopt_stiefel_attention.PolarStiefel`, plus the untouched rest of the tensor (the value block
of a fused projection), so the host model's forward code runs unchanged: it reads ``module.weight`` as
before and gets

.. math::

    W_Q = \big[\,\gamma_1 U_{Q,1},\ \dots,\ \gamma_H U_{Q,H}\,\big]^\top, \qquad
    W_K = \big[\,U_{K,1},\ \dots,\ U_{K,H_{kv}}\,\big]^\top, \qquad U^\top U = I_r,

in the ``(out, in)`` layout of :class:`torch.nn.Linear` (transposed for GPT-2's ``Conv1D``, which stores
``(in, out)``). :math:`\gamma_h` is an optional per-head logit gain (see :func:`stiefelize`); biases stay
free parameters.

The state dict of a converted model is the stock model's: a state-dict post hook on every module owning a
converted weight stores that weight under its stock key, rebuilt as above, and a load-state-dict pre hook
maps a stock entry back onto the frames (the polar factor of each head block, the query gain from its
scale), so ``save_pretrained`` writes a checkpoint the stock class loads. :func:`parametrized_state_dict`
gives the frames as stored (exact resume), :func:`export_state_dict` the stock dict, checked, and
:func:`unstiefelize` removes the parametrizations in place.

One job per module: ``families`` (the table: all that is known about any model family), ``layouts`` (what a
layout is), ``sites`` (finding the sites), ``refuse`` (what cannot be converted), ``gains`` (the logit gain),
``apply`` (registering the parametrizations), ``parametrization`` (what is registered on a weight),
``checkpoints`` (state dicts, export, undoing a conversion), ``result`` (what a conversion returns). This module
is the plan: :func:`stiefelize` finds the sites, refuses what cannot be converted, warns, and applies, one step
function each; it re-exports the others' public names (``__all__``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from ..integrations.optimizers import watch
from ..manifolds import is_frame
from .apply import _apply, _converted_weights, _probe
from .checkpoints import converted_query_key_frames, export_state_dict, parametrized_state_dict, unstiefelize
from .families import LAYOUTS, builtin_layouts
from .gains import _gain_caveat, _initial_gain, _rescale_biases, _saved_gain
from .layouts import Block, Layout
from .parametrization import _watch_model
from .refuse import _adapted, _adapter_layers, _refuse_unchangeable, _refuse_wrapped_model, _tied, _unmatched
from .result import ConversionResult, ConvertedAttention, _grouped, _where
from .sites import _first_match, _interleaved_tensors, _plan, _Refusal, _resolve_targets, _Site, _under

__all__ = [
    "Block",
    "Layout",
    "LAYOUTS",
    "ConvertedAttention",
    "ConversionResult",
    "stiefelize",
    "unstiefelize",
    "export_state_dict",
    "parametrized_state_dict",
    "converted_query_key_frames",
]

#: Default multiplier of the log-gain: :math:`\gamma_h = \exp(\text{rate}\cdot\theta_h)`.
GAIN_RATE = 10.0

#: Accepted values of ``logit_gain`` and ``qk_bias``.
GAIN_MODES = (None, "learn", "fit")
BIAS_MODES = ("keep", "drop")


# ---------------------------------------------------------------------------------------------- the plan
def stiefelize(
    model: nn.Module,
    *,
    targets: Any = "auto",
    logit_gain: str | None = None,
    qk_bias: str = "keep",
    strict: bool = True,
    probe: Any = None,
    gain_rate: float = GAIN_RATE,
) -> ConversionResult:
    r"""Put the query/key projections of every attention module of ``model`` on the Stiefel manifold, in place.

    For each attention module found, the query weight :math:`W_Q` (``H`` heads of size ``r``) and the key
    weight :math:`W_K` (``H_kv`` heads; ``H_kv < H`` under grouped-query attention) are replaced, head by
    head, by their polar factors :math:`U = A (A^\top A)^{-1/2}`, where :math:`A \in \mathbb{R}^{d\times r}`
    is the head's block (the closest frame in Frobenius norm). The frames become ``(H, d, r)`` and
    ``(H_kv, d, r)`` :class:`geoopt.ManifoldParameter` s on :class:`~geoopt_stiefel_attention.PolarStiefel`,
    and the original weight is rebuilt from them on every access by a :mod:`torch.nn.utils.parametrize`
    parametrization: the host module's forward code is not touched, so rotary embeddings, masks, KV caches
    and fused kernels see an ordinary weight. Value rows, output projections and biases stay ordinary
    parameters (``qk_bias="keep"``). Everything is planned and checked before anything is changed.

    **What changes.** Unless every head block is already orthonormal, the function changes: the singular
    values of each block become 1. A model initialised with std 0.02 (HuggingFace) has head blocks with
    singular values of about :math:`0.02\sqrt{d}`, so its logits grow by about
    :math:`1/(0.02^2 d)`; a trained model's logits may shrink or grow. Pass ``probe`` to have the relative
    change measured, and ``logit_gain="fit"`` to keep each head's logit scale.

    Parameters
    ----------
    model : nn.Module
        Converted in place.
    targets : "auto", sequence of Layout, Layout or callable, default "auto"
        ``"auto"``: the built-in table :data:`LAYOUTS` (torch ``nn.MultiheadAttention`` in any ``batch_first``,
        also inside ``nn.Transformer*`` and torchvision's ViT; ``q_proj``/``k_proj`` Linears as in Llama,
        Mistral, Qwen, OPT; ``query``/``key`` Linears as in BERT, RoBERTa, HF ViT; a fused ``qkv`` as in timm,
        split by the module's declared heads under grouped-query attention (HF EXAONE 4.5's vision tower);
        GPT-2's ``c_attn`` and cross-attention ``q_attn`` + ``c_attn``; the fused ``query_key_value`` of HF
        GPT-NeoX (Pythia), GPT-NeoX-Japanese, Bloom, Persimmon and Falcon in its three forms, whose q|k|v rows are
        interleaved per key/value head, read by ``Block(..., interleaved=True)``, and GPTBigCode's ``c_attn``
        Linear, interleaved the same way; CodeGen's ``qkv_proj``, ``mp_num`` groups of q|v|k, read by
        ``Block(..., groups="mp_num")``; on modules whose class name says attention, ``q``/``k`` (T5),
        ``q_lin``/``k_lin`` (DistilBERT), ``query_proj``/``key_proj`` (DeBERTa-v2) Linears and a fused ``Wqkv``
        (MPT, ModernBERT; DBRX split by its declared heads)). A sequence of :class:`Layout`
        replaces the table (extend it with ``(*LAYOUTS, Layout(...))``). A callable
        ``targets(path, module)`` is asked about every module and returns a :class:`Layout` (convert with
        it), ``True`` (convert with the built-in layout that matches) or ``None``/``False`` (leave it).
    logit_gain : {None, "learn", "fit"}, default None
        ``None``: no gain. Otherwise each query head ``h`` gets a learnable gain
        :math:`\gamma_h = \exp(\text{gain_rate}\cdot\theta_h)` multiplying its rebuilt query rows, hence its
        logits (rotary embeddings rotate within the head, so they commute with it; under grouped-query
        attention each query head has its own gain against the shared key head; a module that normalizes its
        queries or keys after the projection, ``q_norm``/``k_norm`` and the like (cosine attention with a
        ``logit_scale``: SwinV2), or clamps them, ``clip_qkv``, or pairs them with position projections of its
        own, DeBERTa's ``pos_proj``/``pos_key_proj``, is converted, but with a warning naming it: there the gain is
        no logit factor). ``"learn"`` starts at
        :math:`\gamma_h = 1`, the choice for training from scratch, except where the weights are exactly what a
        model converted with a gain saves (``save_pretrained``, ``state_dict``, :func:`unstiefelize`): every key
        head block a frame and every query head block a frame times :math:`\gamma_h \ne 1`; it then starts at
        those :math:`\gamma_h`, so converting a saved model again keeps its learned gains (``None`` warns there,
        naming the modules whose gains it resets). ``"fit"`` starts at
        :math:`\gamma_h = \rho(A_{Q,h})\,\rho(A_{K,g(h)})` with :math:`\rho(A) = \|A\|_F/\sqrt{r}` the RMS
        singular value, so each head keeps its logit scale (exactly when the blocks are scaled orthonormal
        frames; query/key biases are rescaled with it, :math:`b_{Q,h} \leftarrow \rho(A_{K,g(h)})\,b_{Q,h}`
        and :math:`b_{K,g} \leftarrow b_{K,g}/\rho(A_{K,g})`, which keeps the logits with biases too;
        ``probe=`` measures the change): the choice for preserving a trained model's function. Fitted to a freshly
        initialised HuggingFace model (std 0.02) it is about :math:`0.02^2 d` (0.013 at :math:`d = 32`) and attention
        starts almost uniform, so do not use it from scratch.
    qk_bias : {"keep", "drop"}, default "keep"
        ``"keep"``: query/key biases stay free parameters. ``"drop"``: they are set to zero and held there
        (a parametrization masks them), so the logits are pure bilinear forms of the frames.
    strict : bool, default True
        Raise ``ValueError`` when nothing is converted, or when a module that looks like attention (its class
        name contains "Attention", or it is an ``nn.MultiheadAttention``, and it holds no frame) matches no
        layout or cannot be converted. With ``False`` those modules are left as they are, listed in
        ``result.skipped`` and named in a warning.
    probe : Tensor, tuple or dict, optional
        An input batch (``model(probe)``, ``model(*probe)`` or ``model(**probe)``) on which the relative
        output change is measured in eval mode without gradients; the output is the tensor returned, or its
        ``logits``/``last_hidden_state``/first element.
    gain_rate : float, default :data:`GAIN_RATE`
        The rate in :math:`\gamma_h = \exp(\text{rate}\,\theta_h)`. Adam moves :math:`\theta` by about
        ``lr`` per step, so with rate 10 and ``lr = 1e-3`` a gain can grow tenfold in about 230 steps. Another
        value with ``logit_gain=None`` (no gains) warns that it has no effect.

    Returns
    -------
    ConversionResult
        The converted modules (path, layout, heads q/kv, d, r, gain), skipped modules and the output change.

    Notes
    -----
    **Saving and loading.** ``model.state_dict()`` (hence ``save_pretrained`` and ``Trainer`` checkpoints)
    is the stock model's: each converted weight under its stock key, :math:`W_Q = [\gamma_h U_{Q,h}]^\top`,
    :math:`W_K = [U_{K,g}]^\top` with the rest in place, in the stock key order. ``load_state_dict`` maps a
    stock weight back: the rest as given; for each head block :math:`A_h`, with a query gain
    :math:`\gamma_h = \|A_h\|_F/\sqrt r` (:math:`\theta_h = \log\gamma_h/\text{gain_rate}`) and
    :math:`A_h \leftarrow A_h/\gamma_h`, then the frame :math:`A_h` itself when it is orthonormal within
    :data:`~geoopt_stiefel_attention.optim.ORTHONORMALITY_TOLERANCE`, else its polar factor (with a
    warning: the function changes). Without a gain a state dict round-trips bit for bit, with one to float
    rounding; :func:`parametrized_state_dict` writes the frames as stored. Entries in that parametrized form
    load as they are. A pure ``q_proj``/``k_proj`` weight keeps its empty rest as a non-persistent buffer, so
    no zero-size parameter appears.

    **Optimizers.** Build them after converting (``StiefelAdam(param_groups(model))``): one built before holds the
    converted weights but not the frames that now carry the query/key rows, so it would never train them. Every
    ``torch.optim`` step is watched for this (a global step pre-hook): such an optimizer raises at its step once no
    optimizer has changed those frames in its last four steps while they have gradients (docs: "Build the
    optimizer after converting").

    **Writing a converted weight.** A converted weight is computed from its frames at each read, so an in-place
    write to it (``weight.copy_(w)``, ``nn.init.*_(weight)``, an init pass after conversion such as HuggingFace's
    ``post_init``) changes only the tensor that read returned, not the model (torch's parametrizations behave so).
    Assign instead (``module.weight = w``) or use ``load_state_dict``: both set the frames to the polar factors of
    the head blocks, and warn when the weight then reads back differently. A ``logit_gain`` of a weight with
    ``requires_grad=False`` is created frozen too.

    Raises
    ------
    ValueError
        For bad options, when nothing converts (the message lists the layouts searched), and for an
        attention-like module that cannot be converted (the message says why and what to pass); the model
        is then unchanged. A query/key weight (or, with ``qk_bias="drop"``, bias) that is one Parameter held by
        several modules (tied weights) cannot be converted: the
        message names every place it is held; untie them first. A layout that reads the fused weight of a module
        that interleaves q|k|v per head (one the built-in "interleaved query_key_value" layout matches) as ranges
        of the whole axis (``part``/``parts`` or ``span``, without ``interleaved=True``) is refused: those rows
        are not its query and key rows. A query/key projection held by an adapter layer (PEFT's LoRA, DoRA, IA3, ...:
        a module holding it as its ``base_layer``) is refused, naming the adapter layers: the adapter's update is
        added outside the frames (merge it first, ``model.merge_and_unload()``, or leave the query/key projections
        out of its ``target_modules``). Wrapping a converted query/key projection in such an adapter afterwards
        (``get_peft_model``) raises ``RuntimeError`` at the first read of the weight.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from geoopt_stiefel_attention import stiefelize, frame_parameters
    >>> layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64)  # batch_first=False
    >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> print(stiefelize(model))  # doctest: +NORMALIZE_WHITESPACE
    stiefelize: 2 attention module(s) converted, 16 frames
      layers.0.self_attn: torch MultiheadAttention, heads q/kv 4, q in St(32, 8), k in St(32, 8), logit gain none
      layers.1.self_attn: torch MultiheadAttention, heads q/kv 4, q in St(32, 8), k in St(32, 8), logit gain none
    >>> len(frame_parameters(model))
    4
    """
    _check_options(model, logit_gain, qk_bias, strict, gain_rate)
    _refuse_wrapped_model(model)
    table, chooser = _resolve_targets(targets)
    sites, problems = _find_sites(model, table, chooser, qk_bias)
    sites, problems = _refuse(model, sites, problems, table, chooser, strict)
    gains, saved = _warn(sites, logit_gain, qk_bias)
    return _apply_plan(model, sites, problems, gains, saved, logit_gain=logit_gain, qk_bias=qk_bias,
                       gain_rate=gain_rate, probe=probe)


def _check_options(model: Any, logit_gain: Any, qk_bias: Any, strict: Any, gain_rate: Any) -> None:
    """Refuse a bad option or a model that is no module; warn about a ``gain_rate`` with no gain to scale."""
    if logit_gain not in GAIN_MODES:
        raise ValueError(f"stiefelize: logit_gain={logit_gain!r} is unknown; pass None, 'learn' or 'fit'.")
    if qk_bias not in BIAS_MODES:
        raise ValueError(f"stiefelize: qk_bias={qk_bias!r} is unknown; pass 'keep' or 'drop'.")
    if not isinstance(strict, bool):
        raise ValueError(f"stiefelize: strict={strict!r} is invalid; pass True or False.")
    if isinstance(gain_rate, bool) or not isinstance(gain_rate, (int, float)) or not (
            math.isfinite(gain_rate) and gain_rate > 0):
        raise ValueError(f"stiefelize: gain_rate={gain_rate!r} is invalid; pass a finite float > 0.")
    if logit_gain is None and gain_rate != GAIN_RATE:
        warnings.warn(f"stiefelize: gain_rate={gain_rate!r} has no effect with logit_gain=None (it scales the learned "
                      f"or fitted query gains); pass logit_gain='learn' or 'fit', or leave gain_rate out.",
                      UserWarning, stacklevel=3)
    if not isinstance(model, nn.Module):
        raise TypeError(f"stiefelize: model must be an nn.Module, got {type(model).__name__}.")


def _find_sites(model: nn.Module, table: Sequence[Layout] | None, chooser: Callable | None,
                qk_bias: str) -> tuple[list[_Site], list[tuple[str, str]]]:
    """Step 1: the sites of ``model`` (each module the table or the chooser gives a layout, outside the sites already
    found), and the refusals ``(path, why)`` of the modules whose layout cannot read them."""
    sites: list[_Site] = []
    problems: list[tuple[str, str]] = []
    interleaving = _interleaved_tensors(model)  # fused weights whose equal slices are not q and k (refused)
    for path, module in model.named_modules():
        if any(_under(path, s.path) for s in sites):
            continue
        layout = _layout_for(path, module, table, chooser)
        if isinstance(layout, str):
            problems.append((path, layout))
        elif layout is not None:
            try:
                sites.append(_plan(path, module, layout, qk_bias, interleaving))
            except _Refusal as err:
                problems.append((path, f"{type(module).__name__} matches layout {layout.name!r} but {err}"))
    return sites, problems


def _layout_for(path: str, module: nn.Module, table: Sequence[Layout] | None,
                chooser: Callable | None) -> Layout | str | None:
    """The layout that converts ``module`` (the first of ``table`` that matches it, or the chooser's answer), ``None``
    to leave it, or a sentence saying why the chooser's answer cannot convert it."""
    if chooser is None:
        return _first_match(table, module)
    choice = chooser(path, module)
    if isinstance(choice, Layout):
        if not choice.matches(module):
            return f"targets chose layout {choice.describe()!r}, which does not match this {type(module).__name__}"
        return choice
    if choice is True:
        layout = _first_match(builtin_layouts(), module)
        if layout is None:
            return (f"targets chose this {type(module).__name__}, but no built-in layout matches it; return a "
                    f"Layout for it instead of True")
        return layout
    if choice not in (None, False):
        raise ValueError(f"stiefelize: targets({path!r}, module) returned {choice!r}; return a Layout, "
                         f"True, False or None.")
    return None


def _refuse(model: nn.Module, sites: list[_Site], problems: list[tuple[str, str]], table: Sequence[Layout] | None,
            chooser: Callable | None, strict: bool) -> tuple[list[_Site], list[tuple[str, str]]]:
    """Step 2: drop the sites that cannot be converted (adapter layers, tied weights; inference or sharded tensors
    raise), add the modules that look like attention and match no layout, then raise when ``strict`` and anything
    is refused or nothing converts; otherwise warn what is left unconverted. Returns the sites and all refusals."""
    wrapped = _adapter_layers(model)
    sites, adapted = _adapted(sites, wrapped)
    problems += adapted
    sites, tied = _tied(model, sites)
    problems += tied
    _refuse_unchangeable(sites)  # before anything changes
    if chooser is None:
        unmatched, unmatched_adapted = _unmatched(model, sites, problems, table, wrapped)
        problems += unmatched
        adapted += unmatched_adapted
    searched = ", ".join(lay.name for lay in (table or builtin_layouts()))  # names only: the table is in the docs
    if problems and strict:
        listing = "\n".join(f"  {line}" for line in _grouped(problems))
        # a tied weight's line carries its own fix (untie them), and so does an adapter's; the closing advice is for
        # the modules no layout fits
        others = [p for p in problems if p not in tied and p not in adapted]
        which = "them" if len(others) == len(problems) else "the modules not tied" if not adapted else "the others"
        closing = "" if not others else (
            f"\nLayouts searched: {searched}.\nPass targets= with a Layout for {which}, or strict=False to leave "
            f"them Euclidean.")
        raise ValueError(f"stiefelize: cannot convert {len(problems)} module(s) of {type(model).__name__}; "
                         f"nothing was changed.\n{listing}{closing}")
    if not sites:
        existing = sum(1 for p in model.parameters() if is_frame(p))
        held = f" (it already holds {existing} Stiefel frame tensors)" if existing else ""
        msg = (f"stiefelize: no attention module of {type(model).__name__} was converted{held}. Layouts "
               f"searched: {searched}. Pass targets=(*LAYOUTS, Layout(...)) for another layout"
               + ("; left unconverted: " + "; ".join(_grouped(problems))
                  if problems else " (no module looked like attention: a class named *Attention*, or query/key "
                                   "Linears such as to_q/to_k, wq/wk, q/k)."))
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    elif problems:
        warnings.warn("stiefelize: left unconverted (strict=False): " + "; ".join(_grouped(problems)), stacklevel=3)
    return sites, problems


def _warn(sites: list[_Site], logit_gain: str | None,
          qk_bias: str) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Step 3: warn about what the conversion does that the options may not say (nothing to drop; gains saved in the
    weights that ``logit_gain=None`` resets; gains that are no logit factor; biases a fitted gain cannot rescale).
    Returns each site's starting gain and the gains saved in its weights; the starting gains are read between the
    warnings as they always were, and a fitted gain of zero is refused there, before anything changes."""
    if qk_bias == "drop":
        nothing = [s.path for s in sites if not s.bias_spans]
        if nothing:
            more = ", ..." if len(nothing) > 4 else ""
            warnings.warn(f"stiefelize: qk_bias='drop' had nothing to drop in {len(nothing)} of {len(sites)} converted "
                          f"module(s) ({', '.join(_where(p) for p in nothing[:4])}{more}): they have no query/key "
                          f"bias.", stacklevel=3)
    # gains a converted model saved into its weights (gamma_h U_h): "learn" starts from them, None would drop them
    saved = [_saved_gain(site) if logit_gain in (None, "learn") else None for site in sites]
    if logit_gain is None and any(g is not None for g in saved):
        found = [(site.path, g) for site, g in zip(sites, saved, strict=True) if g is not None]
        lo = min(float(g.min()) for _, g in found)
        hi = max(float(g.max()) for _, g in found)
        names = ", ".join(_where(p) for p, _ in found[:4]) + (f", ... ({len(found)} modules)" if len(found) > 4 else "")
        warnings.warn(f"stiefelize: logit_gain=None resets the query gains saved in the weights of {names} (each "
                      f"query head block is a frame times a gain, {lo:.4g}..{hi:.4g}, and each key block a frame, as a "
                      f"model converted with a logit gain saves them), which changes those heads' logits by those "
                      f"factors; pass logit_gain='learn' to keep them.", UserWarning, stacklevel=3)
    # checked before any change
    gains = [_initial_gain(site, logit_gain, g) for site, g in zip(sites, saved, strict=True)]
    if logit_gain is not None:
        caveats = [(site.path, why) for site in sites if (why := _gain_caveat(site.module)) is not None]
        for line in _grouped(caveats):
            warnings.warn(f"stiefelize: logit_gain={logit_gain!r} does not act as each query head's logit factor in "
                          f"{line}; pass logit_gain=None for such modules (a callable targets= can convert them "
                          f"apart from the others).", UserWarning, stacklevel=3)
    if logit_gain == "fit" and qk_bias == "keep":
        unscaled = [(site.path, f"{b} (a {role} bias, not rescaled)") for site in sites
                    for role, b in (("query", site.q_bias), ("key", site.k_bias)) if isinstance(b, str)]
        for line in _grouped(unscaled):
            warnings.warn(f"stiefelize: logit_gain='fit' rescales each head's query/key biases with its gain, but "
                          f"cannot in {line}; so those heads' logits change (a query bias left as it is changes "
                          f"the attention weights; a key bias only shifts each query's logits by a constant, which a "
                          f"softmax ignores and a logit cap does not). Pass probe= to measure the change, or a "
                          f"targets= Layout whose q_bias/k_bias Block names the biases.", UserWarning, stacklevel=3)
    return gains, saved


def _apply_plan(model: nn.Module, sites: list[_Site], problems: list[tuple[str, str]], gains: list[Tensor | None],
                saved: list[Tensor | None], *, logit_gain: str | None, qk_bias: str, gain_rate: float,
                probe: Any) -> ConversionResult:
    """Step 4: convert the sites (biases rescaled first under ``"fit"``), watch the weights they replace for an
    optimizer built before, and measure the output change on the probe batch. The first change to the model is
    made here, after every check."""
    before = _probe(model, probe) if probe is not None else None
    if logit_gain == "fit" and qk_bias == "keep":
        for site in sites:
            _rescale_biases(site)  # read from this module: a test switches it off here to show what it prevents
    converted = _converted_weights(sites)  # the weights themselves, before conversion replaces them
    rows = [_apply(site, logit_gain, gain_rate, gain, from_weights=g is not None)
            for site, gain, g in zip(sites, gains, saved, strict=True)]
    for weight, owner, attr, label in converted:  # an optimizer built before this call holds them, not the frames
        plist = owner.parametrizations[attr][0]
        watch(weight, [t for _, t in plist.frames()] + [t for t in (getattr(plist, "q_log_gain", None),)
                                                        if t is not None], label)
    if rows:
        _watch_model(model)  # the frame check of a training forward, once for the whole model
    change = absolute = scale = None
    if before is not None:
        after = _probe(model, probe)
        absolute, scale = float((after - before).norm()), float(before.norm())
        # a ratio only where it is defined: a zero (or non-finite) output before conversion has no relative change
        change = absolute / scale if scale > 0 and math.isfinite(scale) else None
    return ConversionResult(tuple(rows), tuple(problems), change, absolute, scale)
