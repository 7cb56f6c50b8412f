r"""Optimizer groups of a model's parameters, and its frames: :func:`param_groups`, :func:`decays_matrices`,
:func:`frame_parameters` and :func:`project_frames_`.

Public through :mod:`geoopt_stiefel_attention.nn` (and the package), where they have always been imported from; this
module does not import :mod:`~geoopt_stiefel_attention.nn` (the attention module that is the Euclidean arm of a
paired experiment declares itself with the class attribute ``_euclidean_by_design``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import geoopt
import torch
from torch import Tensor, nn

from ._docfrag import fill
from ._linalg import ADJUST_LR_FNS
from .integrations.fsdp import FSDP1_REFUSAL, flattened_by_fsdp1
from .manifolds import has_manifold, is_frame

#: Names of the three groups returned by :func:`param_groups`, in order.
GROUP_NAMES = ("frames", "decay", "no_decay")


def decays_matrices(name: str, p: Tensor) -> bool:
    """The default weight-decay rule of :func:`param_groups`: a non-frame parameter is decayed when it is a
    matrix or higher (``p.ndim >= 2``), whatever its ``name``."""
    return p.dim() >= 2


def param_groups(model: nn.Module, weight_decay: float = 0.01, *, no_decay_frames: bool = True,
                 expect_frames: bool = True, adjust_lr_fn: str | None = None,
                 decay: Callable[[str, Tensor], bool] = decays_matrices, drop_empty: bool = False) -> list[dict]:
    r"""Split the trainable parameters of ``model`` into three optimizer groups.

    The one function that groups parameters for the optimizer: the studies call it too, with their own
    ``decay`` rule (the language-model study keeps its token and position embeddings out of decay).

    1. ``"frames"``: every parameter for which :func:`~geoopt_stiefel_attention.is_frame` holds
       (:class:`geoopt.ManifoldParameter` s on a Stiefel manifold: :class:`~geoopt_stiefel_attention.PolarStiefel`,
       geoopt's ``EuclideanStiefel``, and geoopt's canonical-metric ``Stiefel()``, which
       :class:`~geoopt_stiefel_attention.StiefelAdam` refuses, naming the fix), ``weight_decay=0`` (with
       ``no_decay_frames=True``). For a Riemannian optimizer decay on a frame is a no-op anyway:
       :math:`P_W(\lambda W) = \lambda (W - W\operatorname{sym}(W^\top W)) = 0`.
    2. ``"decay"``: every other parameter for which ``decay(name, p)`` holds; by default
       (:func:`decays_matrices`) those with ``ndim >= 2`` (linear/attention/convolution weights,
       token and position embeddings, class tokens, the unembedding), ``weight_decay=weight_decay``. As in
       nanoGPT, embeddings are decayed by default: the weight-decay-driven dynamics the experiments study act
       on them.
    3. ``"no_decay"``: the rest (by default parameters with ``ndim < 2``: biases, LayerNorm weights and biases,
       logit gains), ``weight_decay=0``.

    Each group is a dict with ``"name"``, ``"params"`` and ``"weight_decay"``; all three are present
    (possibly with an empty ``params`` list, e.g. ``"frames"`` for a Euclidean model) unless ``drop_empty``. A
    model without frames gets a ``UserWarning`` (``StiefelAdam`` would then train it as plain AdamW: call
    :func:`~geoopt_stiefel_attention.stiefelize` first) unless ``expect_frames=False`` or the model is
    built from :class:`~geoopt_stiefel_attention.EuclideanMultiheadAttention` (the Euclidean arm of a paired
    experiment, by design).
    A trainable :class:`geoopt.ManifoldParameter` on another manifold (``geoopt.Sphere()``, ...) is grouped as a
    Euclidean parameter, by ``decay``, with a ``UserWarning`` naming it and its manifold: ``StiefelAdam`` refuses
    it, and a Euclidean optimizer such as :class:`torch.optim.AdamW` would move it off its manifold (train it
    with ``geoopt.optim.RiemannianAdam``, or recreate it on
    :class:`~geoopt_stiefel_attention.PolarStiefel` if it holds frames). Parameters with
    ``requires_grad=False`` are left out; parameters shared between modules appear once. A model with no
    trainable parameter at all raises ``ValueError`` (every group would be empty, and a stock optimizer such as
    :class:`torch.optim.AdamW` accepts empty groups and trains nothing).

    The groups suit :class:`~geoopt_stiefel_attention.StiefelAdam` (frames get the Riemannian update,
    the rest AdamW) and stock optimizers such as :class:`torch.optim.AdamW`, which train the frames as plain
    matrices: they leave the manifold, which is what a "Euclidean update of the same parameters" ablation
    wants and otherwise is a mistake.

    Parameters
    ----------
    model : nn.Module
    weight_decay : float, default 0.01
        Decoupled weight decay of the ``"decay"`` group (``>= 0``).
    no_decay_frames : bool, default True
        ``False`` gives the frames ``weight_decay`` too (a no-op under StiefelAdam, a real decay under AdamW).
    expect_frames : bool, default True
        Warn when the model holds no frame, trainable or frozen (and no
        :class:`~geoopt_stiefel_attention.EuclideanMultiheadAttention`); pass ``False`` for another Euclidean
        baseline.
    adjust_lr_fn : {"original", "match_rms_adamw"} or None, default None
        Written into the ``"frames"`` group when given: what ``lr`` means for each ``d x r`` frame under
        :class:`~geoopt_stiefel_attention.StiefelAdam`. ``"match_rms_adamw"`` multiplies the frame's step by
        :math:`\sqrt{d r}`, so the model's AdamW learning rate moves a frame as much per step as AdamW would
        move the same block; ``"original"`` is the paper's step, :math:`\|s\|_F \approx \mathrm{lr}` (see
        :func:`~geoopt_stiefel_attention.frame_step_scale`). The trust radius :math:`\Delta` is not scaled:
        under either rule it caps :math:`\|s\|_F \le \Delta` in the frame's own units, and only the value of
        ``trust_region="auto"`` depends on the rule (1 under ``"match_rms_adamw"``, 0.1 under ``"original"``;
        see :func:`~geoopt_stiefel_attention.optim.trust_radius`). ``None``: the optimizer's own default
        (``"match_rms_adamw"`` for :class:`~geoopt_stiefel_attention.StiefelAdam`).
    decay : callable ``(name, parameter) -> bool``, default :func:`decays_matrices`
        Which non-frame parameters get ``weight_decay``; ``name`` is the parameter's name in
        ``model.named_parameters()``.
    drop_empty : bool, default False
        Leave out groups without parameters.

    Returns
    -------
    list of dict
        ``[frames, decay, no_decay]`` in that order (without the empty ones if ``drop_empty``).

    Examples
    --------
    >>> from geoopt_stiefel_attention import StiefelAdam, TinyTransformer, param_groups
    >>> model = TinyTransformer(11, 4, width=16, heads=2, mlp=32, attention="stiefel")
    >>> [(g["name"], len(g["params"])) for g in param_groups(model)]
    [('frames', 2), ('decay', 7), ('no_decay', 10)]
    >>> opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-3)
    """
    _check_options(weight_decay, no_decay_frames=no_decay_frames, expect_frames=expect_frames,
                   adjust_lr_fn=adjust_lr_fn, decay=decay, drop_empty=drop_empty)
    frames, decayed, no_decay, other_manifold = _split(model, decay)
    explicit_euclidean = any(getattr(type(m), "_euclidean_by_design", False) for m in model.modules())
    holds_frames = bool(frames) or any(is_frame(p) for p in model.parameters())  # frozen frames are deliberate
    if expect_frames and not holds_frames and not explicit_euclidean:
        warnings.warn(f"param_groups: {type(model).__name__} has no Stiefel frame, so StiefelAdam "
                      f"would train every parameter as plain AdamW. Call stiefelize(model) first (it raises when "
                      f"it finds no attention), or pass expect_frames=False for a Euclidean baseline.",
                      UserWarning, stacklevel=2)
    if other_manifold:
        listed = ", ".join(f"{name!r} (on {manifold!r}, in {group!r})" for name, manifold, group in other_manifold)
        warnings.warn(f"param_groups: {listed}: geoopt.ManifoldParameter(s) on a manifold other than Stiefel, "
                      f"grouped as Euclidean parameters, which torch.optim.AdamW would train off their manifold "
                      f"without a word (StiefelAdam refuses them); train them with geoopt.optim.RiemannianAdam, "
                      f"or recreate them on geoopt_stiefel_attention.PolarStiefel() if they are Stiefel frames "
                      f"(a unit vector is a (d, 1) frame).", UserWarning, stacklevel=2)
    wd = float(weight_decay)
    frame_group = {"name": "frames", "params": frames, "weight_decay": 0.0 if no_decay_frames else wd}
    if adjust_lr_fn is not None:
        frame_group["adjust_lr_fn"] = adjust_lr_fn
    groups = [
        frame_group,
        {"name": "decay", "params": decayed, "weight_decay": wd},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]] if drop_empty else groups


def _check_options(weight_decay: Any, *, no_decay_frames: Any, expect_frames: Any, adjust_lr_fn: Any, decay: Any,
                   drop_empty: Any) -> None:
    """The argument checks of :func:`param_groups`, in its order; each error names the argument and the fix."""
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not (
            weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"param_groups: weight_decay={weight_decay!r} is invalid; pass a finite float >= 0.")
    if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"param_groups: adjust_lr_fn={adjust_lr_fn!r} is unknown; pass one of {ADJUST_LR_FNS} "
                         f"or None (the optimizer's default).")
    for flag, value in (("no_decay_frames", no_decay_frames), ("expect_frames", expect_frames),
                        ("drop_empty", drop_empty)):
        if not isinstance(value, bool):
            raise TypeError(f"param_groups: {flag}={value!r} is invalid; pass True or False.")
    if not callable(decay):
        raise TypeError(f"param_groups: decay={decay!r} is not callable; pass a function (name, parameter) -> "
                        f"bool, e.g. the default decays_matrices.")


def _split(model: nn.Module, decay: Callable[[str, Tensor], bool]) -> tuple[list, list, list, list]:
    """``model``'s trainable parameters as ``(frames, decayed, no_decay, other_manifold)``, ``other_manifold`` the
    ``(name, manifold, group)`` of those on a manifold that is not Stiefel; raises for FSDP1-flattened frames and
    for a model with no trainable parameter."""
    frames, decayed, no_decay = [], [], []
    frozen = 0
    other_manifold = []  # (name, manifold, group) of trainable parameters on a manifold that is not Stiefel
    for name, p in model.named_parameters():
        if flattened_by_fsdp1(p):
            raise NotImplementedError(f"param_groups: {name!r} {tuple(p.shape)} holds frames: {FSDP1_REFUSAL}.")
        if not p.requires_grad:
            frozen += 1
            continue
        if is_frame(p):
            frames.append(p)
            continue
        group = "decay" if decay(name, p) else "no_decay"
        (decayed if group == "decay" else no_decay).append(p)
        if has_manifold(p):
            other_manifold.append((name, p.manifold, group))
    if not (frames or decayed or no_decay):
        held = f"its {frozen} parameter(s) all have requires_grad=False" if frozen else "it holds no parameter"
        raise ValueError(f"param_groups: {type(model).__name__} has no trainable parameter ({held}), so every group "
                         f"would be empty and an optimizer built from them would train nothing; unfreeze what "
                         f"should train (requires_grad_(True)) or build no optimizer.")
    return frames, decayed, no_decay, other_manifold


@fill
def frame_parameters(model: nn.Module) -> list[geoopt.ManifoldParameter]:
    """Every frame of ``model`` (:func:`~geoopt_stiefel_attention.is_frame`; frozen ones included), in
    ``model.parameters()`` order: the library's own modules' ``w_q``/``w_k`` and the frames created by
    :func:`~geoopt_stiefel_attention.stiefelize`.

    {{parameters_model}}

    Returns
    -------
    list of geoopt.ManifoldParameter
        Its frames (empty when it has none).
    """
    return [p for p in model.parameters() if is_frame(p)]


@torch.no_grad()
def project_frames_(model: nn.Module) -> int:
    r"""Replace every trainable or frozen frame of ``model`` by its polar factor, in place: the closest frame in
    Frobenius norm,

    .. math::

        W \leftarrow U V^\top, \qquad W = U \Sigma V^\top \ \text{(thin SVD)},

    computed in float64 and rounded to the frame's dtype. For frames that left the manifold on purpose, above all an
    average of frames: an EMA or ``torch.optim.swa_utils.AveragedModel`` of a model's parameters averages each
    frame's entries, and a mean of orthonormal frames is not orthonormal (the polar factor of the mean is the
    usual extrinsic mean on the Stiefel manifold). Call it after each update of the average, e.g.
    ``ema.update_parameters(model); project_frames_(ema)``. The parameter objects are kept; sharded (``DTensor``)
    frames are projected shard by shard (each shard holds whole frames), meta and empty ones are skipped.

    Parameters
    ----------
    model : nn.Module
        Any model; its frames are :func:`frame_parameters`.

    Returns
    -------
    int
        The number of frame tensors projected.
    """
    from ._linalg import polar_svd
    from .distributed import local_tensor

    done = 0
    for p in frame_parameters(model):
        local = local_tensor(p)
        if local.device.type == "meta" or local.numel() == 0:
            continue
        local.copy_(polar_svd(local.double()).to(local.dtype))
        done += 1
    return done
