r"""State dicts of a converted model, and undoing a conversion.

A converted weight is written under its stock key, rebuilt from its frames, and a stock entry is mapped back
onto the frames when loaded (state-dict hooks on every module owning a converted weight), so a converted model's
checkpoint is the stock model's. :func:`parametrized_state_dict` gives the frames as stored (exact resume),
:func:`export_state_dict` the stock dict, checked, and :func:`unstiefelize` removes the parametrizations.
"""

from __future__ import annotations

import contextvars
import math
import warnings

import geoopt
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._linalg import ORTHONORMALITY_TOLERANCE, orthonormality_error
from ..distributed import is_sharded
from ..integrations import averaging as _averaging
from ..integrations.optimizers import warn_if_saved_off_manifold
from ..manifolds import PolarStiefel, is_frame
from .layouts import _owner
from .parametrization import (
    _MARK,
    _OURS,
    _frames_from,
    _QKWeight,
    _rest_of,
    _unwatch_model,
    _ZeroQKBias,
)

# ---------------------------------------------------------------------------------------------- state dicts
# A converted weight is saved under its stock key (``c_attn.weight``), rebuilt from the frames, and a stock
# entry is mapped back onto the parametrization when loaded: a post hook of ``Module.state_dict`` and a pre
# hook of ``Module.load_state_dict`` (both public torch APIs) on every module that owns a converted weight.

#: "stock" (the default) or "parametrized": the form in which state dicts are written (see
#: :func:`parametrized_state_dict`).
_FORM: contextvars.ContextVar[str] = contextvars.ContextVar("stiefel_state_dict_form", default="stock")

#: Attribute of an owner module: ``(stock names, post-hook handle, load-pre-hook handle)``.
_HOOKS = "_stiefel_state_dict_hooks"


def _stock_to_frames(module: _QKWeight, weight: Tensor, key: str) -> tuple[dict[str, Tensor], list[str]]:
    r"""The parametrization's entries for a stock weight, and the heads it could not represent.

    Rest slices become ``original``; each query/key head block :math:`A` (``(d, r)``) becomes a frame: with a
    query log-gain, :math:`\gamma_h = \|A_h\|_F/\sqrt r`, :math:`\theta_h = \log(\gamma_h)/\text{rate}` and
    :math:`A_h \leftarrow A_h/\gamma_h` first; then :math:`A` itself when
    :math:`\max|A^\top A - I| \le` :data:`~geoopt_stiefel_attention._linalg.ORTHONORMALITY_TOLERANCE` of the
    frame's dtype (so the model's own state dict loads back bit for bit when there is no gain), else its polar
    factor :math:`A(A^\top A)^{-1/2}`, and the head is listed as not representable unless it is off by no more
    than the tolerance of the weight's own, coarser dtype (a float32 checkpoint loaded into a float64 model: its
    rounding, re-projected silently as by ``.double()``).
    """
    problems: list[str] = []
    out: dict[str, Tensor] = {}
    groups = module.groups  # > 1: the segments repeat in each key/value head's group (q|k|v interleaved)
    for role, start, length in module.segments:
        if role == "rest":
            continue
        frames = getattr(module, f"{role}_frames")
        ct = torch.promote_types(weight.dtype, frames.dtype)
        blocks = _frames_from(weight.to(device=frames.device, dtype=ct), module.dim, start, length,
                              frames.shape[-1], groups)
        r = blocks.shape[-1]
        gain_param = getattr(module, "q_log_gain", None) if role == "q" else None
        if gain_param is not None:
            gain = blocks.flatten(1).norm(dim=1) / math.sqrt(r)
            bad = [h for h, g in enumerate(gain.tolist()) if not (math.isfinite(g) and g > 0)]
            if bad:
                raise ValueError(f"load_state_dict: {key} has all-zero or non-finite query head block(s) {bad}; "
                                 f"a query head with a log-gain needs a non-zero block (its log-gain would be "
                                 f"-inf). Load this checkpoint into the stock model class instead.")
            out["0.q_log_gain"] = (gain.log() / module.gain_rate).to(gain_param.dtype)
            blocks = blocks / gain.view(-1, 1, 1)
        blocks = blocks.to(frames.dtype)
        tol = ORTHONORMALITY_TOLERANCE.get(frames.dtype, 1e-4)
        # a weight saved in a coarser dtype (a float32 checkpoint, a float64 model) is off by its rounding only
        rounding = max(tol, ORTHONORMALITY_TOLERANCE.get(weight.dtype, tol))
        err = torch.stack([orthonormality_error(b) for b in blocks])
        off = err > tol
        if bool(off.any()):
            blocks = torch.where(off.view(-1, 1, 1), PolarStiefel().projx(blocks), blocks)
        bad = err > rounding
        if bool(bad.any()):
            heads = bad.nonzero().flatten().tolist()
            scaled = "scaled " if gain_param is not None else ""
            problems.append(f"{'query' if role == 'q' else 'key'} head(s) {heads} (max|A^T A - I| = "
                            f"{float(err.max()):.3g} > {rounding:g}: not {scaled}orthonormal)")
        out[f"0.{role}_frames"] = blocks.contiguous()
    rest = _rest_of(weight, module.dim, module.segments, groups)
    if rest is not None:
        out["original"] = rest
    return out, problems


def _rounded_frames(given: Tensor, param: Tensor) -> Tensor:
    """A frame entry of the parametrized form, ``given``, for the frame parameter ``param`` (loaded by a copy into
    ``param``'s dtype): when ``given`` is of a coarser dtype (a float32 checkpoint, a float64 model), its heads off
    the manifold in ``param``'s dtype by no more than the tolerance of ``given``'s dtype (its rounding) are replaced
    by their polar factors in ``param``'s dtype, as by ``.double()``; other heads are kept as they are (a frame off
    by more is refused by the training forward's frame check, as it always was)."""
    target = param.dtype
    tol = ORTHONORMALITY_TOLERANCE.get(target, 1e-4)
    rounding = max(tol, ORTHONORMALITY_TOLERANCE.get(given.dtype, tol))
    if (rounding == tol or not given.is_floating_point() or given.dim() < 2 or given.device.type == "meta"
            or is_sharded(given) or tuple(given.shape) != tuple(param.shape)):
        return given
    cast = given.detach().to(target)
    stack = cast.reshape(-1, *cast.shape[-2:])
    err = torch.stack([orthonormality_error(b) for b in stack])
    fix = (err > tol) & (err <= rounding)
    if not bool(fix.any()):
        return given
    return torch.where(fix.view(-1, 1, 1), PolarStiefel().projx(stack), stack).view_as(cast)


def _ours_on(owner: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(attr, parametrization)`` for every weight of ``owner`` parametrized by :func:`stiefelize` alone."""
    plists = getattr(owner, "parametrizations", None)
    if plists is None or not parametrize.is_parametrized(owner):
        return []
    return [(attr, plists[attr][0]) for attr in plists.keys()
            if len(plists[attr]) == 1 and isinstance(plists[attr][0], _OURS)]


def _is_sharded_owner(owner: nn.Module, attr: str) -> bool:
    return any(is_sharded(t) for t in (*owner.parametrizations[attr].parameters(),
                                       *owner.parametrizations[attr].buffers()))


def _warn_off_manifold(prefix: str, ours: list[tuple[str, nn.Module]]) -> None:
    """Warn, once per weight, when a frame saved in this state dict is off the manifold (the last step of an optimizer
    that does not know the constraint, which no training forward sees: :mod:`..integrations.optimizers`)."""
    for attr, p in ours:
        if isinstance(p, _QKWeight):
            warn_if_saved_off_manifold(
                f"{prefix}{attr}", p.frames(), where="state_dict() (save_pretrained, a Trainer checkpoint)",
                consequence="The state dict holds the weight as it is, with query/key blocks that are not "
                            "orthonormal: loaded into a converted model, or converted again, they are replaced by "
                            "their polar factors, which changes the model's outputs.", stacklevel=3)


def _state_dict_post_hook(owner: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Replace the parametrization's entries of ``owner`` by its stock entries, in the stock order; warn when a
    frame is off the manifold (:func:`_warn_off_manifold`)."""
    ours = [(attr, p) for attr, p in _ours_on(owner) if not _is_sharded_owner(owner, attr)]
    if not ours:
        return
    _warn_off_manifold(prefix, ours)
    if _FORM.get() != "stock":
        return
    for _attr, p in ours:  # an averaged copy whose entries were written in place (integrations/averaging.py)
        if isinstance(p, _QKWeight):
            _averaging.check_written(p)
    stock_names = vars(owner)[_HOOKS][0]
    values = {}
    for attr, p in ours:
        first = p.q_frames if hasattr(p, "q_frames") else (
            p.k_frames if hasattr(p, "k_frames") else owner.parametrizations[attr].original)
        name = {id(v): k for k, v in p.named_parameters()}.get(id(first))
        raw = f"{prefix}parametrizations.{attr}." + (f"0.{name}" if name is not None else "original")
        keep_vars = state_dict.get(raw) is first  # torch passes keep_vars to state_dict, not to its post hooks
        with torch.set_grad_enabled(keep_vars and torch.is_grad_enabled()):
            value = getattr(owner, attr)
        values[attr] = (value if keep_vars else value.detach()).contiguous()
        if not keep_vars and isinstance(p, _QKWeight):
            _averaging.hand_out(p, f"{prefix}{attr}", values[attr])
    raw_prefixes = tuple(f"{prefix}parametrizations.{attr}." for attr in values)
    subtree = [k for k in state_dict if k.startswith(prefix)]
    entries = {k: state_dict.pop(k) for k in subtree}
    ordered = {}
    for name in stock_names:
        key = prefix + name
        if name in values:
            ordered[key] = values[name]
        elif key in entries:
            ordered[key] = entries.pop(key)
    for name in values:  # a weight the owner did not have when it was converted (not expected)
        ordered.setdefault(prefix + name, values[name])
    ordered.update((k, v) for k, v in entries.items() if not k.startswith(raw_prefixes))
    state_dict.update(ordered)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for k in [k for k in metadata if (k + ".").startswith(raw_prefixes)]:
            del metadata[k]


def _load_state_dict_pre_hook(owner: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Map a stock entry of ``owner``'s converted weights onto their parametrizations (other forms pass)."""
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    for attr, p in _ours_on(owner):
        plist = owner.parametrizations[attr]
        stock_key, raw = f"{prefix}{attr}", f"{prefix}parametrizations.{attr}."
        if "original" in plist._non_persistent_buffers_set:  # checkpoints before it became a buffer hold it
            old = state_dict.get(raw + "original")
            if isinstance(old, Tensor) and old.numel() == 0:
                del state_dict[raw + "original"]
        if isinstance(p, _ZeroQKBias):
            state_dict.pop(raw + "0.keep", None)  # persistent before it was made a non-persistent buffer
        if stock_key in state_dict:
            value = state_dict.pop(stock_key)
            clash = [k for k in state_dict if k.startswith(raw)]
            with torch.no_grad():  # its shape only: no frame check (frames of to_empty() are what this load fills)
                expected = tuple(getattr(owner, attr).shape)
            if clash:
                error_msgs.append(f"{stock_key} is given in both the stock form and the parametrized form "
                                  f"({clash[0]}, ...); keep one of them (model.state_dict() writes the stock form)")
                continue
            if not isinstance(value, Tensor) or tuple(value.shape) != expected:
                error_msgs.append(f"size mismatch for {stock_key}: copying a param with shape "
                                  f"{tuple(getattr(value, 'shape', ()))} from checkpoint, the shape in current model "
                                  f"is {expected}.")
                continue
            if _is_sharded_owner(owner, attr):
                error_msgs.append(f"{stock_key}: a stock-form weight cannot be loaded into frames sharded as "
                                  f"DTensors; load it before sharding (or load the parametrized form that "
                                  f"torch.distributed.checkpoint writes)")
                continue
            with torch.no_grad():
                if isinstance(p, _QKWeight):
                    entries, problems = _stock_to_frames(p, value.detach(), stock_key)
                    if problems:
                        warnings.warn(f"load_state_dict: {stock_key}: {'; '.join(problems)}; these blocks were "
                                      f"replaced by their polar factors, which changes the attention logits. To "
                                      f"keep a stock checkpoint's function, load it into the stock model class and "
                                      f"call stiefelize(model, logit_gain='fit').", stacklevel=2)
                else:
                    dropped = value.detach().to(p.keep.device) * (1 - p.keep)
                    if bool((dropped != 0).any()):
                        warnings.warn(f"load_state_dict: {stock_key} has non-zero query/key entries "
                                      f"(max {float(dropped.abs().max()):.3g}), which qk_bias='drop' holds at zero; "
                                      f"they do not act. Convert with qk_bias='keep' to keep them.", stacklevel=2)
                    entries = {"original": value.detach()}
            if "original" in plist._non_persistent_buffers_set:
                entries.pop("original", None)
            for name, tensor in entries.items():
                state_dict[raw + name] = tensor
        if not assign:  # frames of the parametrized form in a coarser dtype: re-projected in the model's dtype
            for name, param in p.named_parameters():
                given = state_dict.get(f"{raw}0.{name}")
                if is_frame(param) and isinstance(given, Tensor):
                    state_dict[f"{raw}0.{name}"] = _rounded_frames(given, param)
        if assign:  # load_state_dict(..., assign=True) installs the given tensors: keep frames on their manifold
            for name, param in p.named_parameters():
                given = state_dict.get(f"{raw}0.{name}")
                if is_frame(param) and isinstance(given, Tensor) and not isinstance(given, geoopt.ManifoldParameter):
                    state_dict[f"{raw}0.{name}"] = geoopt.ManifoldParameter(given, manifold=param.manifold,
                                                                            requires_grad=param.requires_grad)


def _hook_state_dicts(owner: nn.Module, stock_names: list[str]) -> None:
    """Register the two state-dict hooks on ``owner`` once (its first converted weight)."""
    if _HOOKS in vars(owner):
        return
    post = owner.register_state_dict_post_hook(_state_dict_post_hook)
    pre = owner.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    object.__setattr__(owner, _HOOKS, (tuple(stock_names), post, pre))


def _unhook_state_dicts(owner: nn.Module) -> None:
    hooks = vars(owner).get(_HOOKS)
    if hooks is not None and not _ours_on(owner):
        hooks[1].remove()
        hooks[2].remove()
        object.__delattr__(owner, _HOOKS)


def _stock_names(owner: nn.Module) -> list[str]:
    """The names of ``owner``'s own state-dict entries, in the order torch writes them."""
    return [*owner._parameters, *(b for b in owner._buffers if b not in owner._non_persistent_buffers_set)]



def _our_parametrized(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    found = []
    for path, module in model.named_modules():
        plist = getattr(module, "parametrizations", None)
        if plist is None or not parametrize.is_parametrized(module):
            continue
        for attr in list(plist.keys()):
            if any(isinstance(p, _OURS) for p in plist[attr]):
                found.append((path, module, attr))
    return found


def export_state_dict(model: nn.Module) -> dict[str, Tensor]:
    r"""The state dict of the stock (unconverted) model: its keys, in its order, plain contiguous tensors.

    Since the converter's state-dict hooks write the stock form, this is ``model.state_dict()`` (with every
    tensor detached and contiguous), checked: every weight rebuilt by :func:`stiefelize` is stored under its
    original key (``...c_attn.weight``) with its current value,

    .. math::

        W_Q = \big[\gamma_1 U_{Q,1},\ \dots,\ \gamma_H U_{Q,H}\big]^\top, \qquad
        W_K = \big[U_{K,1},\ \dots,\ U_{K,H_{kv}}\big]^\top,

    and the rest of that weight (value rows) in place, in place of the parametrization's entries; a bias
    held by ``qk_bias="drop"`` is stored under its key with its query/key entries zero. The result loads with
    ``load_state_dict(..., strict=True)`` into the unconverted model class and into a converted one, and
    saves with safetensors. It is the same inside :func:`parametrized_state_dict`.

    Parameters
    ----------
    model : nn.Module
        A model converted by :func:`stiefelize` (unchanged by the call).

    Returns
    -------
    dict of str to torch.Tensor
        The stock state dict, as above.

    Raises
    ------
    ValueError
        When ``model`` holds no stiefelized weight (exporting would silently equal ``model.state_dict()``),
        or when its frames are sharded ``DTensor`` s (FSDP2), whose state dict stays in the parametrized
        form: gather it (``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
        options=StateDictOptions(full_state_dict=True))``), load it into an unsharded converted model and
        export that.
    """
    ours = _our_parametrized(model)
    if not ours:
        raise ValueError("export_state_dict: the model holds no weight converted by stiefelize; use "
                         "model.state_dict() directly.")
    token = _FORM.set("stock")
    try:
        with torch.no_grad():
            state = model.state_dict()
    finally:
        _FORM.reset(token)
    raw = [k for k in state if any(k.startswith(f"{path}.parametrizations." if path else "parametrizations.")
                                   for path, _, _ in ours)]
    if raw:
        raise ValueError(f"export_state_dict: {raw[0]} stays in the parametrized form because its frames are "
                         f"sharded DTensors (FSDP2); gather the full state dict, load it into an unsharded "
                         f"converted model and export that.")
    return {k: v.detach().contiguous() for k, v in state.items()}


def parametrized_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, Tensor]:
    r"""``model.state_dict()`` in the parametrized form: the frames, log-gains and rest as stored.

    A converted model's ``state_dict()`` is the stock model's (see :func:`stiefelize`): loading it back
    recovers each frame from its rebuilt block, bit for bit when the module has no logit gain but only to
    float rounding when it has one (:math:`\gamma_h U_h` is rounded once it is formed). This function writes
    instead the parametrization's own entries (``<owner>.parametrizations.<attr>.original``,
    ``...<attr>.0.q_frames``, ``...0.k_frames``, ``...0.q_log_gain``), so a checkpoint resumes a run exactly;
    ``model.load_state_dict`` takes this form as it is (it is also the form of checkpoints written before the
    stock form existed). A model with nothing converted gives ``model.state_dict()``. Such a dict does not
    load into the stock model class (missing and unexpected keys).

    Parameters
    ----------
    model : nn.Module
    keep_vars : bool, default False
        As for :meth:`torch.nn.Module.state_dict`.

    Returns
    -------
    dict of str to Tensor
    """
    token = _FORM.set("parametrized")
    try:
        return model.state_dict(keep_vars=keep_vars)
    finally:
        _FORM.reset(token)


def unstiefelize(model: nn.Module) -> nn.Module:
    """Remove the parametrizations added by :func:`stiefelize`, in place: every converted weight becomes a
    plain :class:`torch.nn.Parameter` holding its current value (frames times gains, plus the rest), the
    state-dict hooks are removed, and the model's parameters and state dict have the stock names in the
    stock order again. Returns ``model``.

    **Optimizers must be rebuilt.** A converted weight was trained through its frames (and log-gains), which are
    other parameters and are gone afterwards. torch's ``remove_parametrizations`` keeps the ``original``
    Parameter so that an optimizer need not change, but here that cannot hold: a pure ``q_proj``/``k_proj``
    weight had no ``original`` parameter (its rest is empty) and becomes a new Parameter that an optimizer built
    on the converted model does not hold, so that optimizer would silently stop training it; a fused projection
    (``in_proj_weight``, ``c_attn``, ``qkv``) keeps its ``original`` Parameter, which grows from the rest to the
    whole weight, so that optimizer's state no longer fits it. Build the optimizer again from the unstiefelized
    model (e.g. ``torch.optim.AdamW(model.parameters())``); every call warns so.

    Parameters
    ----------
    model : nn.Module
        A model converted by :func:`stiefelize`; changed in place.

    Returns
    -------
    nn.Module
        ``model`` itself.

    Warns
    -----
    UserWarning
        Always, naming the weights that became plain Parameters: optimizers built on the converted model must be
        rebuilt.

    Raises
    ------
    ValueError
        When ``model`` holds no stiefelized weight.
    """
    ours = _our_parametrized(model)
    if not ours:
        raise ValueError("unstiefelize: the model holds no weight converted by stiefelize; nothing to undo.")
    new: list[str] = []  # weights that become new Parameters (a pure q_proj/k_proj: no `original` parameter)
    grown: list[str] = []  # weights whose `original` Parameter is kept and grows to the whole weight (fused)
    for _path, module, attr in ours:
        p0 = module.parametrizations[attr][0]
        requires_grad = any(t.requires_grad for t in p0.parameters()) or module.parametrizations[attr].original.requires_grad
        with torch.no_grad():
            parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
        p = getattr(module, attr)
        if not isinstance(p, nn.Parameter) or not p.is_contiguous():  # an empty `original` was a buffer
            setattr(module, attr, nn.Parameter(p.detach().contiguous(), requires_grad=requires_grad))
            new.append(f"{_path}.{attr}" if _path else attr)
        else:
            grown.append(f"{_path}.{attr}" if _path else attr)
    for _path, module, _attr in ours:
        hooks = vars(module).get(_HOOKS)
        if hooks is not None:
            order = {name: i for i, name in enumerate(hooks[0])}
            items = sorted(module._parameters.items(), key=lambda kv: order.get(kv[0], len(order)))
            module._parameters.clear()
            module._parameters.update(items)
        _unhook_state_dicts(module)
    for module in model.modules():
        _unwatch_model(module)
        if _MARK in vars(module):
            object.__delattr__(module, _MARK)

    def listed(names: list[str]) -> str:
        return ", ".join(repr(n) for n in names[:4]) + (f", ... ({len(names)} weights)" if len(names) > 4 else "")

    effects = ([f"would silently stop training {listed(new)} (new Parameters it does not hold)"] if new else []) + (
        [f"would fail on {listed(grown)} (its state no longer fits the Parameter, which grew from the rest to the "
         f"whole weight)"] if grown else [])
    warnings.warn(f"unstiefelize: {len(new) + len(grown)} converted weight(s) are plain Parameters again and their "
                  f"frames and gains are gone; an optimizer built on the converted model holds those frames, so it "
                  f"{' and '.join(effects)}. Build the optimizer again from the unstiefelized model, e.g. "
                  f"torch.optim.AdamW(model.parameters()).", UserWarning, stacklevel=2)
    return model


def converted_query_key_frames(model: nn.Module) -> list[tuple[str, Tensor, Tensor]]:
    """``(path, q_frames, k_frames)`` for every attention module converted by :func:`stiefelize`:
    the ``(H, d, r)`` and ``(H_kv, d, r)`` frame parameters, in ``named_modules()`` order.

    Parameters
    ----------
    model : nn.Module
        Any model (an empty list when nothing in it was converted).

    Returns
    -------
    list of (str, torch.Tensor, torch.Tensor)
        ``(path, q_frames, k_frames)`` per converted module.
    """
    found = []
    for path, module in model.named_modules():
        blocks = vars(module).get(_MARK)
        if blocks is None:
            continue
        frames = []
        for role, param in zip(("q", "k"), blocks, strict=True):
            owner, attr = _owner(module, param)
            frames.append(getattr(owner.parametrizations[attr][0], f"{role}_frames"))
        found.append((path, frames[0], frames[1]))
    return found
