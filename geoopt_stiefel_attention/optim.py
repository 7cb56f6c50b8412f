"""``StiefelAdam``: Riemannian Adam with one second moment per frame, a trust region and polar retraction."""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import geoopt
import torch
import torch.optim.adamw as _torch_adamw
import torch.optim.optimizer as _torch_optimizer
from geoopt.manifolds import EuclideanStiefel

from . import _linalg
from . import distributed as _distributed
from ._linalg import ADJUST_LR_FNS, frame_step_scale
from .manifolds import has_manifold as _has_manifold
from .manifolds import is_frame as _is_frame

_local = _distributed.local_tensor  # a DTensor's local shard (whole frames; see distributed), else the tensor

__all__ = ["StiefelAdam", "stiefel_adam_update", "frame_step_scale", "SECOND_MOMENTS", "ADJUST_LR_FNS",
           "ORTHONORMALITY_TOLERANCE"]

#: The accepted values of the ``second_moment`` option.
SECOND_MOMENTS = ("frame", "column", "element", None)

#: Largest ``max |W^T W - I|`` accepted for a frame at its first step, per parameter dtype. A bf16-rounded
#: orthonormal frame is already about 1e-3 off, so the low-precision tolerances are loose. (Defined in
#: ``_linalg``, where the re-projection of frames after a cast reads it too.)
ORTHONORMALITY_TOLERANCE = _linalg.ORTHONORMALITY_TOLERANCE

_DEFAULT_TRUST_REGION = 0.1

#: The group options StiefelAdam adds to torch's Adam options, with the defaults a state dict saved before an
#: option existed (or by geoopt's RiemannianAdam) loads with.
_GROUP_DEFAULTS = {"trust_region": _DEFAULT_TRUST_REGION, "second_moment": "frame", "stabilize": None,
                   "master_weights": False, "adjust_lr_fn": "original"}


def _require(ok: bool, message: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(message)


def _validate_hyperparameters(group: dict[str, Any]) -> None:
    """Raise a ``ValueError`` that names the option and the fix when a group option is out of range."""
    lr = group["lr"]
    if not isinstance(lr, torch.Tensor):
        _require(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0 and math.isfinite(lr),
                 f"StiefelAdam: lr={lr!r} is invalid; pass a finite float >= 0 (e.g. lr=1e-3; lr=0 moves "
                 f"nothing, as at the start of a warm-up).")
    eps = group["eps"]
    _require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0 and math.isfinite(eps),
             f"StiefelAdam: eps={eps!r} is invalid; pass a finite float >= 0 (e.g. eps=1e-8).")
    betas = group["betas"]
    _require(isinstance(betas, (tuple, list)) and len(betas) == 2
             and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas),
             f"StiefelAdam: betas={betas!r} is invalid; pass two floats in [0, 1), e.g. betas=(0.9, 0.999).")
    wd = group["weight_decay"]
    _require(isinstance(wd, (int, float)) and wd >= 0 and math.isfinite(wd),
             f"StiefelAdam: weight_decay={wd!r} is invalid; pass a finite float >= 0.")
    tr = group["trust_region"]
    _require(tr is None or (isinstance(tr, (int, float)) and not isinstance(tr, bool) and tr > 0 and math.isfinite(tr)),
             f"StiefelAdam: trust_region={tr!r} is invalid; pass a finite float > 0 "
             f"(default {_DEFAULT_TRUST_REGION}) or None to disable the cap.")
    sm = group["second_moment"]
    _require(sm in SECOND_MOMENTS,
             f"StiefelAdam: second_moment={sm!r} is unknown; use one of 'frame' (default), 'column', "
             f"'element', or None (fixed-step Riemannian SGD with momentum).")
    fn = group.get("adjust_lr_fn", "original")
    _require(fn in ADJUST_LR_FNS,
             f"StiefelAdam: adjust_lr_fn={fn!r} is unknown; use 'original' (lr is a frame's step norm, the "
             f"paper's step) or 'match_rms_adamw' (lr is a per-entry step, as for AdamW).")
    st = group["stabilize"]
    _require(st is None or (isinstance(st, int) and not isinstance(st, bool) and st > 0),
             f"StiefelAdam: stabilize={st!r} is invalid; pass a positive int (re-project every that many "
             f"steps) or None.")
    cap = group.get("capturable")
    _require(cap is None or isinstance(cap, bool),
             f"StiefelAdam: capturable={cap!r} is invalid; pass True, False or None (True on accelerators).")
    _require(not (cap and st is not None),
             f"StiefelAdam: stabilize={st!r} cannot be combined with capturable=True (re-projecting every k "
             f"steps reads the step count on the host); pass stabilize=None or capturable=False.")
    mw = group.get("master_weights", False)
    _require(isinstance(mw, bool),
             f"StiefelAdam: master_weights={mw!r} is invalid; pass True (keep a float32 master copy of bf16/fp16 "
             f"frames) or False.")


def _check_manifold(p: torch.Tensor) -> None:
    """Reject a parameter on a manifold the optimizer does not implement, naming the fix."""
    if not _has_manifold(p):
        return
    manifold = p.manifold
    if _is_frame(p) and not isinstance(manifold, EuclideanStiefel):
        raise ValueError(
            f"StiefelAdam: parameter of shape {tuple(p.shape)} is on geoopt's CanonicalStiefel (the default "
            f"of geoopt.Stiefel()), whose canonical metric this optimizer does not implement. Create it on "
            f"geoopt_stiefel_attention.PolarStiefel() (or geoopt.EuclideanStiefel()) instead, or train it "
            f"with geoopt.optim.RiemannianAdam."
        )
    if not _is_frame(p):
        raise ValueError(
            f"StiefelAdam: parameter of shape {tuple(p.shape)} is on {manifold!r}; StiefelAdam trains "
            f"Stiefel frames (PolarStiefel / EuclideanStiefel) and Euclidean parameters only. Use "
            f"geoopt.optim.RiemannianAdam for other manifolds."
        )


def _check_parameter(p: torch.Tensor) -> None:
    """Reject parameters the optimizer cannot train, naming the fix."""
    _distributed.check_parameter(p)  # sharded (FSDP/DTensor) parameters: NotImplementedError
    _check_manifold(p)
    if not _is_frame(p):
        return
    if p.is_complex():
        raise TypeError(f"StiefelAdam: frame parameter of shape {tuple(p.shape)} is complex; Stiefel frames "
                        f"must be real (float64, float32, bfloat16 or float16).")
    if p.dim() < 2 or p.shape[-1] > p.shape[-2]:
        raise ValueError(f"StiefelAdam: frame parameter of shape {tuple(p.shape)} is not a stack of d x r frames "
                         f"with r <= d (orthonormal columns cannot outnumber rows). Store frames as (..., d, r), "
                         f"e.g. transpose a (r, d) matrix, or use fewer columns.")


def _capturable(group: dict[str, Any], device: torch.device) -> bool:
    """Whether the group's step runs the capturable path on ``device``: the group's ``capturable``, or, when it
    is ``None`` (the default), whether ``device`` is not the CPU."""
    cap = group.get("capturable")
    return device.type != "cpu" if cap is None else bool(cap)


def _can_read_host() -> bool:
    """False while torch.compile traces or a CUDA graph is captured (a host read would break or fail them)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _zeros_like_layout(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain zero tensor of ``p``'s shape and device, column-major like ``p`` when ``p`` is (e.g. the ``Q`` of
    ``torch.linalg.qr``), else contiguous."""
    if p.dim() >= 2 and not p.is_contiguous() and p.mT.is_contiguous():
        return torch.zeros(p.mT.shape, dtype=dtype, device=p.device).mT
    return torch.zeros(p.shape, dtype=dtype, device=p.device)


def _frame_state_shapes(p: torch.Tensor, second_moment: str | None) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor of a frame parameter ``p`` of shape ``(..., d, r)``."""
    shapes = {"exp_avg": tuple(p.shape), "master": tuple(p.shape)}
    if second_moment is not None:
        batch, r = tuple(p.shape[:-2]), p.shape[-1]
        shapes["exp_avg_sq"] = {"frame": batch + (1, 1), "column": batch + (1, r),
                                "element": tuple(p.shape)}[second_moment]
    return shapes


def _loaded_state(p: torch.Tensor, saved: Any, group: dict[str, Any], label: str) -> dict[str, Any]:
    """The state of ``p`` from a state dict, checked against ``p`` and its group, converted and cast (see
    :meth:`StiefelAdam.load_state_dict`); raises before anything changes."""
    where = f"StiefelAdam.load_state_dict: {label}"
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: its state is a {type(saved).__name__}, not a dict of state entries.")
    state = dict(saved)
    if not state:
        return state
    if "step" in state and not isinstance(state["step"], torch.Tensor):  # geoopt stores a Python int
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    frame = _is_frame(p)
    sm = group["second_moment"]
    if frame:
        required = ["step", "exp_avg"] + (["exp_avg_sq"] if sm is not None else [])
        shapes = _frame_state_shapes(p, sm)
        if "max_exp_avg_sq" in state:
            del state["max_exp_avg_sq"]
            warnings.warn(f"{where}: dropped the frame's AMSGrad buffer 'max_exp_avg_sq' (a geoopt checkpoint?); "
                          f"StiefelAdam's amsgrad applies to Euclidean parameters only.", UserWarning, stacklevel=3)
        v = state.get("exp_avg_sq")
        if sm == "frame" and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) \
                and tuple(p.shape[-2:]) != (1, 1):
            head = v[..., :1, :1]
            if not torch.equal(v, head.expand_as(v)):
                raise ValueError(
                    f"{where}: its full-size exp_avg_sq {tuple(v.shape)} is not constant on each frame, so it is "
                    f"not one second moment per frame (geoopt's RiemannianAdam on EuclideanStiefel stores one "
                    f"scalar per frame at every entry; this state is not of that kind). Load it into an "
                    f"optimizer with second_moment='element', or drop this parameter's state in a "
                    f"register_load_state_dict_pre_hook to restart its moments.")
            state["exp_avg_sq"] = head
    else:
        required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        shapes = {key: tuple(p.shape) for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(f"{where}: its state lacks {missing} (has {sorted(state)}); the state dict does not "
                         f"belong to this parameter and group (second_moment={sm!r}, amsgrad={group['amsgrad']}).")
    for key, shape in shapes.items():
        value = state.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{where}: its state {key!r} has shape {got}, expected {shape} "
                             f"(second_moment={sm!r}); the state dict does not belong to this parameter.")
    compute = _linalg.compute_dtype(p.dtype) if frame else p.dtype
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        device = p.device
        if key == "step":  # float32, on the parameter's device in capturable mode (torch's rule), else on the CPU
            dtype = torch.float32
            device = p.device if _capturable(group, p.device) else torch.device("cpu")
        elif key == "master":
            dtype = torch.float32
        elif value.is_floating_point() and (frame or p.is_floating_point()):
            dtype = compute
        else:
            dtype = value.dtype
        if _distributed.is_sharded(p) and key not in ("step", "skipped_frames"):  # sharded like the parameter
            state[key] = _distributed.to_placements_of(p, value, dtype)
        elif tuple(value.shape) == tuple(p.shape):  # the parameter's memory layout (e.g. column-major frames)
            state[key] = _zeros_like_layout(p, dtype).to(device).copy_(value)
        else:
            state[key] = value.to(dtype=dtype, device=device, copy=True)
    if frame:
        state.setdefault("skipped_frames", torch.zeros((), dtype=torch.int64, device=p.device))
    return state


def stiefel_adam_update(
    w: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    trust_region: float | None,
    second_moment: str | None = "frame",
    series_order: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""One StiefelAdam update of a stack of frames; pure (returns new tensors, changes none of its inputs).

    For each frame :math:`W \in \mathrm{St}(d, r)` of the stack with Euclidean gradient :math:`G`:

    1. :math:`\xi = G - W \operatorname{sym}(W^\top G)`
    2. :math:`m \leftarrow \beta_1 m + (1 - \beta_1)\xi`
    3. :math:`v \leftarrow \beta_2 v + (1 - \beta_2)\|\xi\|_F^2` (``second_moment="frame"``; ``"column"``
       sums :math:`\xi^2` over rows, ``"element"`` keeps :math:`\xi^2`; ``None`` keeps no :math:`v`)
    4. :math:`s = \mathrm{lr}\,\hat m / (\sqrt{\hat v} + \epsilon)` with
       :math:`\hat m = m/(1-\beta_1^t)`, :math:`\hat v = v/(1-\beta_2^t)`; ``None``: :math:`s = \mathrm{lr}\,\hat m`.
       For ``"column"`` and ``"element"``, :math:`s \leftarrow P_W(s)` (their scaling leaves the tangent space).
    5. :math:`s \leftarrow s \min(1, \Delta/\|s\|_F)` (``trust_region=None`` skips it)
    6. :math:`W \leftarrow (W - s)\big((W - s)^\top (W - s)\big)^{-1/2}`
    7. :math:`m \leftarrow m - W \operatorname{sym}(W^\top m)`

    A frame whose gradient has a non-finite entry (or whose :math:`\|\xi\|_F^2` overflows) is skipped: its
    ``W``, ``m`` and ``v`` come back unchanged, and the returned mask is ``False`` there. A frame whose step
    :math:`s` is exactly zero (``lr = 0``; or ``eps = 0`` and a zero second moment, see below) keeps its ``W``
    bit for bit (its moments are updated). With ``eps = 0``, entries whose :math:`\sqrt{\hat v}` is zero take
    a zero step instead of :math:`0/0`.

    Parameters
    ----------
    w, grad, exp_avg : torch.Tensor
        Shape ``(..., d, r)``, one dtype (the compute dtype).
    exp_avg_sq : torch.Tensor or None
        ``(..., 1, 1)`` for ``"frame"``, ``(..., 1, r)`` for ``"column"``, ``(..., d, r)`` for
        ``"element"``, ``None`` for ``second_moment=None``.
    step : int
        The step count ``t >= 1`` after this update (for the bias corrections).
    lr, beta1, beta2, eps, trust_region : float
        Hyper-parameters as in :class:`StiefelAdam`.
    second_moment : {"frame", "column", "element", None}
        Which second moment scales the step.
    series_order : int or None
        ``None`` retracts with an exact ``r x r`` eigendecomposition; an integer uses the Taylor series of
        that order, valid only when it was chosen by :func:`_linalg.series_order` for ``trust_region**2``.

    Returns
    -------
    w_new, exp_avg_new, exp_avg_sq_new, finite : torch.Tensor
        The updated frames and moments, and a boolean ``(..., 1, 1)`` mask of the frames that were updated.
    """
    wt = w.transpose(-1, -2)
    xi = grad - w @ _linalg.sym(wt @ grad)
    xi_sq = _linalg.frame_sq_norm(xi)
    finite = xi_sq < math.inf  # False for inf and NaN
    xi = torch.where(finite, xi, torch.zeros((), dtype=xi.dtype, device=xi.device))

    m = torch.where(finite, beta1 * exp_avg + (1.0 - beta1) * xi, exp_avg)
    bias1 = 1.0 - beta1**step
    if second_moment is None:
        v = None
        s = (lr / bias1) * m
    else:
        if second_moment == "frame":
            sq = xi_sq
        elif second_moment == "column":
            sq = xi.square().sum(dim=-2, keepdim=True)
        elif second_moment == "element":
            sq = xi.square()
        else:
            raise ValueError(f"second_moment={second_moment!r} is unknown; use one of {SECOND_MOMENTS}.")
        v = torch.where(finite, beta2 * exp_avg_sq + (1.0 - beta2) * sq, exp_avg_sq)
        bias2 = 1.0 - beta2**step
        denom = (v / bias2).sqrt() + eps
        s = (lr / bias1) * m / denom
        if eps == 0:
            s = torch.where(denom == 0, torch.zeros((), dtype=s.dtype, device=s.device), s)
        if second_moment != "frame":
            s = _linalg.proju(w, s)
    s = _linalg.cap_step(s, trust_region) * finite  # a zero step keeps NaNs out of the retraction
    moving = finite & (s != 0).any(dim=-1, keepdim=True).any(dim=-2, keepdim=True)
    w_new = _linalg.polar(w - s, order=series_order)
    m_new = _linalg.proju(w_new, m)
    # skipped frames and frames without a step come back bit-identical (a zero-step retraction would round them)
    return torch.where(moving, w_new, w), torch.where(moving, m_new, m), v, finite


#: Same-shaped frame parameters of a group are stacked into batches of at most this many elements, one call
#: per operation per batch (per-op dispatch dominates small problems); a parameter of more than half as many
#: elements is a batch of its own, updated in place with no staging copies. 2**16 was the fastest choice for
#: the widths 128-768 of ``stiefel-attention bench`` on a 2-core CPU.
STACK_NUMEL = 1 << 16

#: The batch size limit on other devices (accelerators), where kernel launches, not caches, set the cost: all
#: same-shaped frames of a group up to this many elements (64 MiB in float32) are updated by one call per
#: operation. Their first and second moments (and float32 master copies) are then kept stacked in one buffer
#: per batch, so only frames and gradients are staged (see ``StiefelAdam._update_batch``).
ACCELERATOR_STACK_NUMEL = 1 << 24

#: Device types on which torch's own AdamW supports ``capturable=True`` (its Euclidean part of the step).
_TORCH_CAPTURABLE_DEVICES = tuple(_torch_optimizer._get_capturable_supported_devices())

#: Second-moment modes with the fused in-place kernel; the ablation variants use :func:`stiefel_adam_update`.
_FAST_MODES = ("frame", None)


def _rounding_margin(dtype: torch.dtype) -> float:
    """Slack added to ``||s||^2`` in the bound on ``||(W - s)^T (W - s) - I||_2``: the rounding drift of ``W^T W``
    from the identity and of ``s`` from the tangent space (both a few units of roundoff)."""
    return 64 * torch.finfo(dtype).eps


def _frame_update_(
    w: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor | None,
    scratch: torch.Tensor,
    *,
    step: int | torch.Tensor,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    trust_region: float | None,
    maximize: bool = False,
    capturable: bool = False,
) -> torch.Tensor:
    r"""The update of :func:`stiefel_adam_update` for ``second_moment`` in ``("frame", None)``, in place.

    ``w`` and ``exp_avg`` (shape ``(n, d, r)``, compute dtype, both row-major or both column-major, i.e.
    ``x.mT`` contiguous) and ``exp_avg_sq`` (``(n, 1, 1)``) are overwritten; ``grad`` is only read;
    ``scratch`` (``(n, d, r)``, laid out like ``w``) holds first :math:`\xi`, then :math:`W - s`. ``step`` is an int or
    a tensor of step counts broadcastable to ``(n, 1, 1)`` (the capturable path). Six ``d x r x r`` products per step: :math:`W^\top G`, :math:`W S`, the Gram matrix of the
    actual :math:`W - s`, :math:`(W - s) X`, :math:`W_+^\top m` and :math:`W_+ S'`, the last four written
    into their destinations (``baddbmm``/``out=``) so that no ``d x r`` temporary is allocated.

    Skipped frames (non-finite :math:`\|\xi\|_F^2`) come back unchanged: the non-finite entries of their
    :math:`\xi` are zeroed and it is averaged in with weight 0 (:math:`m + 0\,(\xi - m) = m`; a ``-0.0`` entry of
    :math:`m` may come back as ``+0.0``, equal to it), their step is zero and their
    retraction and transport multiply by the identity and subtract zero. Frames whose step size is zero
    (``lr = 0``, or ``eps = 0`` with a zero second moment, whose :math:`1/\sqrt{\hat v}` is taken as 0) keep
    ``W`` bit-identical the same way; their moments are updated. On CPU the masking runs only when a
    frame is actually skipped and the series order follows the largest step actually taken (reading a CPU
    tensor costs no synchronisation); on other devices, and with ``capturable=True`` on any device, the
    masking always runs and the order follows the trust radius, so the step reads no tensor on the host.

    Returns the boolean ``(n, 1, 1)`` mask of updated frames.
    """
    on_host = w.device.type == "cpu" and not capturable  # may tensor values be read on the host?
    row_major = w.is_contiguous()

    def stored(t: torch.Tensor) -> torch.Tensor:
        """``t`` in storage order: itself, or for column-major frames its (contiguous) transpose. Every
        ``out=`` below writes through it, so no output is strided (which torch.compile refuses)."""
        return t if row_major else t.mT

    sign = -1.0 if maximize else 1.0
    # 1. xi = sign * (G - W sym(W^T G)), into scratch
    a = torch.bmm(w.mT, grad)
    a = a + a.mT  # 2 sym(W^T G), exactly symmetric: (W A)^T = A W^T
    factors = (w, a) if row_major else (a, w.mT)
    torch.baddbmm(stored(grad), *factors, beta=sign, alpha=-0.5 * sign, out=stored(scratch))
    xi = scratch
    xi_sq = torch.linalg.vector_norm(xi, dim=(-2, -1), keepdim=True).square_()
    finite = xi_sq < math.inf  # False for inf and NaN
    masked = not (on_host and bool(finite.all()))
    weight = 1.0 - beta1
    if masked:  # skipped frames: finite junk in xi, averaged in with weight 0 (m + 0 (xi - m) = m)
        xi.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        weight = finite.to(xi.dtype).mul_(weight)
    # 2. m <- beta1 m + (1 - beta1) xi
    exp_avg.lerp_(xi, weight)
    # 3.-4. v <- beta2 v + (1 - beta2) ||xi||^2; per-frame step size alpha, s = alpha m
    bias1 = 1.0 - beta1**step
    if exp_avg_sq is None:
        alpha = torch.zeros_like(xi_sq).add_(lr / bias1)
    else:
        if masked:
            xi_sq = torch.where(finite, xi_sq, exp_avg_sq)
        exp_avg_sq.lerp_(xi_sq, 1.0 - beta2)
        alpha = exp_avg_sq.div(1.0 - beta2**step).sqrt_().add_(eps).reciprocal_().mul_(lr / bias1)
        if eps == 0:  # v = 0 (then m = 0 too): no step instead of 1/0 (and 0 * inf when lr = 0)
            alpha.nan_to_num_(nan=0.0, posinf=0.0)
    moving = finite
    if (not isinstance(lr, torch.Tensor) and lr == 0) or eps == 0:  # only then can a step size be exactly 0
        moving = finite & (alpha != 0)
        masked = masked or not (on_host and bool(moving.all()))
    # 5. trust region: ||s|| = alpha ||m|| <= Delta
    order = None
    if trust_region is not None:
        m_norm = torch.linalg.vector_norm(exp_avg, dim=(-2, -1), keepdim=True)
        alpha = torch.minimum(alpha, trust_region / m_norm)  # Delta / 0 = inf leaves alpha as is
        radius = trust_region
        if on_host:
            radius = min(radius, float((alpha * m_norm).amax()))
        order = _linalg.series_order(radius**2 + _rounding_margin(w.dtype), w.dtype)
    if masked:
        alpha = alpha * moving
    # 6. W <- (W - s) X with X = ((W - s)^T (W - s))^{-1/2}
    torch.addcmul(stored(w), stored(exp_avg), alpha, value=-1.0, out=stored(scratch))
    y = scratch
    gram = torch.bmm(y.mT, y)
    x = _linalg.inv_sqrt_spd(gram) if order is None else _linalg.inv_sqrt_series(gram, order)
    if masked:
        x = torch.where(moving, x, torch.eye(x.shape[-1], dtype=x.dtype, device=x.device))
    if row_major:
        torch.bmm(y, x, out=w)
    else:  # column-major W: write W_+^T = X^T (W - s)^T into its contiguous transpose, no copy
        torch.bmm(x.mT, y.mT, out=w.mT)
    # 7. m <- m - W sym(W^T m)
    b = torch.bmm(w.mT, exp_avg)
    b = b + b.mT  # exactly symmetric
    if masked:
        b = b * moving
    if row_major:
        exp_avg.baddbmm_(w, b, alpha=-0.5)
    else:
        exp_avg.mT.baddbmm_(b, w.mT, alpha=-0.5)  # (W S)^T = S W^T for the symmetric S
    return finite


def _frame_lr(group: dict[str, Any], d: int, r: int, device: torch.device, dtype: torch.dtype,
              capturable: bool) -> tuple[float | torch.Tensor, float | None]:
    """The learning rate and trust radius a group's ``d x r`` frames step with (:func:`frame_step_scale`); a
    tensor ``lr`` stays a tensor on the capturable path (no host read) and is read as a float otherwise."""
    c = frame_step_scale(group["adjust_lr_fn"], d, r)
    lr, radius = group["lr"], group["trust_region"]
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device=device, dtype=dtype) if capturable else float(lr)
    if c != 1.0:
        lr = lr * c
        radius = None if radius is None else radius * c
    return lr, radius


def _frame_batches(frames: list[torch.Tensor], steps: list[int] | None,
                   stack_numel: int | None = None) -> list[tuple[int | None, list[torch.Tensor]]]:
    """Split frame parameters into update batches of one shape, dtype, device and step count (``steps=None``:
    any step count, the capturable path), each of at most ``stack_numel`` elements (default: :data:`STACK_NUMEL`
    on the CPU, :data:`ACCELERATOR_STACK_NUMEL` elsewhere); a parameter of more than half that many is a batch of
    its own."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p, step in zip(frames, steps if steps is not None else [None] * len(frames), strict=True):
        groups[(_local(p).shape, p.dtype, p.device, step)].append(p)
    batches = []
    for (_, _, device, step), params in groups.items():
        limit = stack_numel or (STACK_NUMEL if device.type == "cpu" else ACCELERATOR_STACK_NUMEL)
        per_batch = max(1, limit // max(_local(params[0]).numel(), 1))
        batches.extend((step, params[k:k + per_batch]) for k in range(0, len(params), per_batch))
    return batches


def _stacked_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(tensors)`` without a copy, when the tensors are dense, row-major, of one shape and dtype,
    and lie one after the other, in this order, in one storage; otherwise ``None``."""
    t0 = tensors[0]
    block = t0.numel() * t0.element_size()
    base, storage = t0.data_ptr(), t0.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (not t.is_contiguous() or t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != base + i * block):
            return None
    return t0.as_strided((len(tensors), *t0.shape), (t0.numel(), *t0.stride()))


def _stacked_state(states: list[dict[str, Any]], key: str,
                   others: Callable[[], Iterable[dict[str, Any]]] = tuple) -> torch.Tensor:
    """The ``states[i][key]`` tensors as one ``(k, ...)`` stack whose slices they are: a view if they already
    are consecutive slices of one buffer (every step after the first), else a new buffer, whose slices then
    replace them in the states (the first step of a batch, after ``load_state_dict``, or when the batch's
    members changed). The stacked slices are ordinary tensors of the same shape, dtype and values; they only
    share one storage.

    When a new buffer is made, a tensor of ``others()`` (the states of the group's other parameters) that is
    still a slice of one of the replaced buffers gets a storage of its own, so that no old buffer is kept
    alive by a slice left behind (a frame that had no gradient this step, or a step count that split a batch).
    """
    tensors = [state[key] for state in states]
    stacked = _stacked_view(tensors)
    if stacked is None:
        replaced = {t.untyped_storage().data_ptr() for t in tensors}
        stacked = torch.stack(tensors)  # row-major, whatever the layout of the originals
        for state, view in zip(states, stacked.unbind(0), strict=True):
            state[key] = view
        for state in others():
            t = state.get(key)
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in replaced
                    and t.untyped_storage().nbytes() > t.numel() * t.element_size()):
                state[key] = t.clone(memory_format=torch.contiguous_format)
    return stacked


class StiefelAdam(geoopt.optim.RiemannianAdam):
    r"""Riemannian Adam for Stiefel frames with one second moment per frame, a trust region and the
    polar retraction; AdamW for every other parameter.

    A parameter that is a :class:`geoopt.ManifoldParameter` on :class:`~geoopt_stiefel_attention.PolarStiefel`
    (or any :class:`geoopt.manifolds.EuclideanStiefel`) is a stack of frames ``(..., d, r)``. With step
    count :math:`t`, each frame :math:`W \in \mathrm{St}(d, r)` with Euclidean gradient :math:`G` is updated by

    .. math::

        \xi &= G - W \operatorname{sym}(W^\top G) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1)\,\xi \\
        v &\leftarrow \beta_2 v + (1 - \beta_2)\,\|\xi\|_F^2 \qquad \text{(one scalar per frame)} \\
        s &= c\,\mathrm{lr}\cdot \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon} \\
        s &\leftarrow s \cdot \min\!\big(1, c\,\Delta / \|s\|_F\big) \qquad \text{(trust region)} \\
        W &\leftarrow \operatorname{polar}(W - s) = (W - s)\big((W - s)^\top (W - s)\big)^{-1/2} \\
        m &\leftarrow m - W \operatorname{sym}(W^\top m) \qquad \text{(transport by projection)}

    where :math:`\operatorname{sym}(A) = (A + A^\top)/2` and :math:`c` is set by ``adjust_lr_fn``
    (:func:`frame_step_scale`): :math:`c = 1` for ``"original"`` (the paper's step), :math:`c = \sqrt{d r}` for
    ``"match_rms_adamw"``. The second moment ``v`` is stored at its true
    shape ``(..., 1, 1)``, so a frame's state is its first moment plus one number. Every other parameter
    (plain tensors, and geoopt tensors on ``Euclidean``) is updated exactly as by
    :class:`torch.optim.AdamW` with the group's ``lr``, ``betas``, ``eps`` and ``weight_decay``.

    Parameters
    ----------
    params : iterable
        Parameters, ``(name, parameter)`` pairs (``named_parameters()``) or dicts defining parameter groups
        whose ``"params"`` are any of these (lists, tuples or generators); frames and Euclidean parameters may
        be mixed.
    lr : float, default 1e-3
        Learning rate, ``>= 0``. For a frame, :math:`\|s\|_F \approx c\,\mathrm{lr}` per step for a steady
        gradient (see ``adjust_lr_fn``). With ``lr = 0`` (the start of a warm-up) frames stay bit for bit where they are while their
        moments and step count advance, as with torch's Adam.
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to :math:`\sqrt{\hat v}`, ``>= 0``. With ``eps = 0`` a frame whose second moment is zero (only
        zero Riemannian gradients so far, hence :math:`m = 0`) takes no step instead of :math:`0/0`.
    weight_decay : float, default 0
        Decoupled (AdamW) weight decay for Euclidean parameters. On frames it has no effect, by design:
        the Riemannian gradient of :math:`\tfrac{\lambda}{2}\|W\|_F^2` is
        :math:`P_W(\lambda W) = \lambda (W - W \operatorname{sym}(W^\top W)) = 0` identically on
        :math:`\mathrm{St}(d, r)`, and decaying the point itself would only be undone by the retraction.
    trust_region : float or None, default 0.1
        Per-frame cap :math:`c\,\Delta` on :math:`\|s\|_F`, in the units of ``lr``; ``None`` disables it.
        Inside the trust region the matrix inverted by the retraction has condition number at most
        :math:`1 + c^2\Delta^2`, which lets the
        retraction use a short Taylor series, exact to rounding, instead of an eigendecomposition.
    second_moment : {"frame", "column", "element", None}, default "frame"
        ``"frame"``: one scalar per frame (the method). ``"column"``: one per column. ``"element"``: a
        full-size tensor, the direction then projected onto the tangent space. ``None``: fixed-step
        Riemannian SGD with momentum, :math:`s = \mathrm{lr}\,\hat m` (a step of degree one in the
        gradient). The variants exist for the analysis and the ablation studies.
    stabilize : int or None, default None
        Re-project frames (exact SVD polar factor) and their first moments every ``stabilize`` steps.
        Not needed in practice: the retraction forms the Gram matrix of the actual iterate.
    master_weights : bool, default False
        Keep a float32 master copy of every bf16/fp16 frame in ``state["master"]`` and update that: the
        parameter is its rounding, :math:`W_{\mathrm{param}} = \mathrm{round}(W_{\mathrm{master}})`. Without
        it a bf16 frame is re-rounded after every step and a step smaller than half a bf16 spacing (about
        :math:`2^{-9}|W_{ij}|`) per entry is lost. Entries of the parameter changed outside the optimizer
        (no longer the rounding of the master) are taken from the parameter. No effect on float32/float64
        frames.
    adjust_lr_fn : {"original", "match_rms_adamw"}, default "original"
        What ``lr`` and ``trust_region`` measure for a ``d x r`` frame (:func:`frame_step_scale`).
        ``"original"``: the Frobenius norm of the frame's step (:math:`c = 1`, the paper's fixed step), so at
        the same ``lr`` a frame moves :math:`\sqrt{d r}` times less than AdamW moves the same block (64 times at
        128 x 32). ``"match_rms_adamw"``: a per-entry size, as for AdamW (:math:`c = \sqrt{d r}`), so the model's
        AdamW learning rate serves the frames too, as with torch's ``Muon(adjust_lr_fn="match_rms_adamw")``.
        Use it when training from scratch with one learning rate; ``"original"`` reproduces the paper and
        suits fine-tuning a converted trained model with small frame steps.
    amsgrad, maximize, foreach : bool
        As in :class:`torch.optim.AdamW`; ``amsgrad`` applies to Euclidean parameters only, ``foreach``
        selects torch's AdamW implementation for them (frames always use their own fused kernel).
    differentiable, fused : bool
        Accepted for torch's signature; only ``False``/``None`` is supported (a clear ``ValueError`` otherwise).
    capturable : bool or None, default None
        As in :class:`torch.optim.Adam`: step counts are tensors on the parameter's device and the step reads
        no tensor value on the host (bias corrections, skip masks and counts stay on the device; the
        retraction's series order follows the trust radius), so it can be captured in a CUDA graph and is
        traced by ``torch.compile`` without graph breaks. ``None`` means ``True`` for parameters on an
        accelerator and ``False`` on the CPU; ``True`` on the CPU runs the accelerator path. Not combinable
        with ``stabilize``. A frame's one-time first-step orthonormality check reads on the host, except
        under ``torch.compile`` tracing or CUDA-graph capture, where it is skipped.

    Scope and warnings
    ------------------
    - Frames must be on the manifold at their first step (:math:`\max|W^\top W - I|` within
      :data:`ORTHONORMALITY_TOLERANCE` for their dtype) or a ``ValueError`` suggests ``.proj_()``.
    - ``CanonicalStiefel`` (geoopt's default ``Stiefel()``) and other manifolds are rejected with a
      ``ValueError``; sparse gradients with a ``ValueError``; complex frames with a ``TypeError``.
      Validation happens before anything is changed.
    - A frame whose gradient has a NaN or Inf entry is skipped for that step (its frame and moments are
      left untouched) and counted in ``state["skipped_frames"]``; the step counter still advances.
      Euclidean parameters follow torch's AdamW, which does not skip.
    - bf16/fp16 frames compute in float32 and round back; their moments are kept in float32 (also across
      :meth:`load_state_dict`). Small steps are partly lost to bf16 rounding unless ``master_weights=True``.
    - Sharded (FSDP2/``DTensor``) frames sharded along a leading (head) dimension (``Shard(0)`` of an
      ``(H, d, r)`` stack) or replicated are updated shard by shard, with state sharded like them and no
      communication (each rank holds whole frames); a sharding along ``d`` or ``r``, or a sharded parameter
      that may be a frame whose manifold FSDP dropped, is refused with ``NotImplementedError``. See
      :mod:`geoopt_stiefel_attention.distributed` and ``fully_shard_by_heads``.
    - Cost: six batched ``d x r x r`` matrix products per frame and step (:math:`W^\top G`, :math:`W S`, the
      Gram matrix of :math:`W - s`, :math:`(W - s) X`, :math:`W_+^\top m`, :math:`W_+ S'`) and a few
      elementwise passes, in place, with no ``d x d`` work and no SVD or QR. Same-shaped small parameters of a
      group are stacked into one batched call per operation; large ones are updated in place one at a time.
      Apart from the state, the optimizer keeps one reusable scratch buffer per dtype and device (the
      capturable path allocates its scratch per step). The step makes no host synchronisation on
      accelerators (``capturable``). ``stiefel-attention bench`` measures all of this
      against AdamW and stock geoopt.
    - Given no frame at all, it is plain AdamW and says so once, at construction (a ``UserWarning`` naming
      :func:`~geoopt_stiefel_attention.stiefelize`), unless the groups come from
      :func:`~geoopt_stiefel_attention.param_groups`, which warns itself (or not, with ``expect_frames=False``).
    - The ``"frame"`` and ``None`` second moments run a fused in-place kernel; ``"column"`` and
      ``"element"`` (for ablations) run :func:`stiefel_adam_update`, the same update written as a pure
      function.

    Examples
    --------
    >>> import torch, geoopt
    >>> from geoopt_stiefel_attention import PolarStiefel, StiefelAdam
    >>> st = PolarStiefel()
    >>> w = geoopt.ManifoldParameter(st.random(4, 32, 8), manifold=st)
    >>> b = torch.nn.Parameter(torch.zeros(8))
    >>> opt = StiefelAdam([w, b], lr=1e-2, weight_decay=0.1)
    >>> ((w.sum(dim=1) + b) ** 2).sum().backward()
    >>> opt.step()
    >>> st.check_point_on_manifold(w)
    True
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        trust_region: float | None = _DEFAULT_TRUST_REGION,
        second_moment: str | None = "frame",
        stabilize: int | None = None,
        master_weights: bool = False,
        adjust_lr_fn: str = "original",
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        capturable: bool | None = None,
    ) -> None:
        if differentiable:
            raise ValueError("StiefelAdam: differentiable=True is not supported: the frame update runs in place "
                             "under torch.no_grad() (a polar retraction with a data-dependent series order), so "
                             "no graph through the step exists. Pass differentiable=False (the default).")
        if fused:
            raise ValueError("StiefelAdam: fused=True is not supported: frames always use their own fused "
                             "in-place kernel and other parameters torch's AdamW implementation selected by "
                             "`foreach`. Pass fused=None (the default).")
        if isinstance(params, torch.Tensor):
            raise TypeError(f"StiefelAdam: params must be an iterable of tensors, (name, tensor) pairs or group "
                            f"dicts, not a single {torch.typename(params)}; pass [tensor] or model.parameters().")
        params = list(params)
        if not params:
            raise ValueError("StiefelAdam: got an empty parameter list; pass model.parameters(), a list of "
                             "tensors or a list of group dicts (is the generator already consumed?).")
        self._pending_defaults = {"trust_region": trust_region, "second_moment": second_moment,
                                  "stabilize": stabilize, "master_weights": master_weights,
                                  "adjust_lr_fn": adjust_lr_fn}
        self._constructing = True
        _validate_hyperparameters(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       capturable=capturable, **self._pending_defaults))
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, stabilize=stabilize, capturable=capturable,
                         decoupled_weight_decay=True)
        self.defaults.update(self._pending_defaults)
        del self._pending_defaults, self._constructing
        if not any(group["params"] for group in self.param_groups):
            raise ValueError(f"StiefelAdam: all {len(self.param_groups)} parameter groups are empty, so the "
                             f"optimizer would train nothing; pass groups whose 'params' hold the tensors to "
                             f"train (is a generator already consumed?).")
        # Groups made by param_groups() (a group named "frames") were checked there, where expect_frames=False
        # marks a deliberate Euclidean baseline; anything else with no frame at all gets one warning here.
        if not any(_is_frame(p) for group in self.param_groups for p in group["params"]) and not any(
                group.get("name") == "frames" for group in self.param_groups):
            warnings.warn("StiefelAdam was constructed with no Stiefel frame among its parameters, so it trains "
                          "them all as plain AdamW. Convert the model first (stiefelize(model)) or build it with "
                          "attention='stiefel', then pass param_groups(model); for a Euclidean model use "
                          "torch.optim.AdamW.", UserWarning, stacklevel=2)

    # ------------------------------------------------------------------ groups and checkpoints
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as :meth:`torch.optim.Optimizer.add_param_group`.

        ``param_group["params"]`` may be a tensor, a list, tuple or generator of tensors, or of
        ``(name, tensor)`` pairs (``named_parameters()``). Every parameter is validated, whatever the form,
        before anything changes. An empty group given as a generator or iterator (often one that was consumed
        earlier), or added after construction, trains nothing and gives a ``UserWarning``; an explicit empty
        list among non-empty groups at construction is accepted silently, as by torch (e.g. the ``"frames"``
        group of :func:`~geoopt_stiefel_attention.param_groups` for a model without frames).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"StiefelAdam: a parameter group must be a dict with a 'params' entry, not "
                            f"{type(param_group).__name__}.")
        if "params" not in param_group:
            raise ValueError("StiefelAdam: a parameter group needs a 'params' entry, e.g. "
                             "{'params': model.head.parameters(), 'lr': 1e-3}.")
        given = param_group["params"]
        if isinstance(given, torch.Tensor):
            params = [given]
        elif isinstance(given, (set, frozenset)):
            raise TypeError("StiefelAdam: parameters must be given in an ordered collection (list, tuple or "
                            "generator), not a set, whose order changes between runs; pass a list.")
        else:
            params = list(given)  # a generator is read once, here; torch then sees the list
        param_group["params"] = params
        for p in params:
            tensor = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, tensor) pairs
            if isinstance(tensor, torch.Tensor):
                _check_parameter(tensor)
        constructing = self.__dict__.get("_constructing", False)
        defaults = {**_GROUP_DEFAULTS, **self.__dict__.get("_pending_defaults", {}), **self.defaults}
        for key in _GROUP_DEFAULTS:
            param_group.setdefault(key, defaults[key])
        _validate_hyperparameters({**defaults, **param_group})
        if not params and (not constructing or not isinstance(given, (list, tuple))):
            warnings.warn(f"StiefelAdam: parameter group {len(self.param_groups)} is empty and trains nothing "
                          f"(was its generator consumed before, e.g. model.parameters() passed twice?).",
                          UserWarning, stacklevel=2)
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key, value in _GROUP_DEFAULTS.items():
            self.defaults.setdefault(key, value)
            for group in self.param_groups:
                group.setdefault(key, value)
        self._stabilize = self.defaults["stabilize"]  # what geoopt's add_param_group reads (lost by pickling)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (see :meth:`torch.optim.Optimizer.load_state_dict`); it is checked completely
        before anything changes.

        As in torch, the ``register_load_state_dict_pre_hook`` hooks run first (and may return a new state
        dict), the saved group options replace the current ones, state tensors move to their parameter's
        device, and the post hooks run last. Floating-point state is cast as follows:

        - Euclidean parameters: to the parameter's dtype (torch's rule), ``step`` excepted;
        - frames: to the dtype the frame arithmetic runs in (float32 for bf16/fp16 frames, otherwise the
          frame's own dtype, so a checkpoint loads after the model moved between float32 and float64); a
          ``master`` copy stays float32, and the int64 ``skipped_frames`` counter keeps its dtype.

        Checkpoints of ``geoopt.optim.RiemannianAdam`` load: its integer step counts become tensors, and a
        frame's full-size ``exp_avg_sq`` is reduced to the ``(..., 1, 1)`` scalar it broadcasts (geoopt's
        second moment on ``EuclideanStiefel`` is one number per frame stored at every entry). A full-size
        second moment that is not constant on each frame cannot be a per-frame moment and is refused, as is
        any state whose shape does not fit its parameter and group, with a ``ValueError`` naming the
        parameter. geoopt's AMSGrad buffer of a frame is dropped with a warning (AMSGrad applies to Euclidean
        parameters only here), and the groups' ``decoupled_weight_decay`` is set to True: StiefelAdam applies
        decoupled decay to Euclidean parameters whatever the checkpoint says.
        """
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"StiefelAdam.load_state_dict: the state dict has {len(saved_groups)} parameter "
                             f"groups, this optimizer {len(self.param_groups)}; build the optimizer with the "
                             f"same groups as the one that was saved.")
        for k, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"StiefelAdam.load_state_dict: parameter group {k} has {len(group['params'])} "
                                 f"parameters here and {len(saved['params'])} in the state dict; build the "
                                 f"optimizer with the same groups as the one that was saved.")
        new_groups = []
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            for key, value in _GROUP_DEFAULTS.items():
                saved.setdefault(key, value)
            saved["decoupled_weight_decay"] = True
            _validate_hyperparameters(saved)
            new_groups.append(saved)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        located = {}  # saved id -> (parameter, its new group, a name for messages)
        for k, group in enumerate(new_groups):
            names = group.get("param_names") or [None] * len(group["params"])
            for j, (p, name) in enumerate(zip(group["params"], names, strict=True)):
                label = f"{name!r} " if name is not None else ""
                located[next(saved_ids)] = (p, group, f"parameter {label}(group {k}, position {j}, shape "
                                                       f"{tuple(p.shape)})")
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key in located:
                p, group, label = located[key]
                state[p] = _loaded_state(p, value, group, label)
            else:
                state[key] = value  # state of no parameter is kept as is, as torch does
        self.__setstate__({"state": state, "param_groups": new_groups})
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ------------------------------------------------------------------ the step
    def _validate_step(self) -> None:
        """Check every group's options (a scheduler or a user may have rewritten ``param_groups`` since the
        constructor checked them), every gradient and every fresh frame before anything is changed."""
        for group in self.param_groups:
            _validate_hyperparameters(group)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"StiefelAdam: parameter of shape {tuple(p.shape)} has a sparse gradient, "
                                     f"which is not supported; use a dense gradient (e.g. nn.Embedding("
                                     f"sparse=False)) or geoopt.optim.SparseRiemannianAdam.")
                if not _is_frame(p):
                    if _has_manifold(p):  # a manifold assigned after the parameter was added
                        _check_manifold(p)
                    continue
                if not isinstance(p.manifold, EuclideanStiefel):
                    _check_manifold(p)
                if p.grad.is_complex():
                    raise TypeError(f"StiefelAdam: frame parameter of shape {tuple(p.shape)} has a complex "
                                    f"gradient; frames and their gradients must be real.")
                local = _local(p)  # a sharded frame: each rank checks its own whole frames
                if not self.state.get(p) and local.numel() and (not _capturable(group, p.device)
                                                                or _can_read_host()):
                    err = float(_linalg.orthonormality_error(local))
                    tol = ORTHONORMALITY_TOLERANCE.get(p.dtype, 1e-4)
                    if not err <= tol:
                        raise ValueError(
                            f"StiefelAdam: frame parameter of shape {tuple(p.shape)} ({p.dtype}) is off the "
                            f"Stiefel manifold at its first step: max|W^T W - I| = {err:.3g} > {tol:g}. "
                            f"Project it first with `param.proj_()` (inside torch.no_grad())."
                        )

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Perform one optimisation step.

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss (run with gradients enabled).

        Returns
        -------
        torch.Tensor or None
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate_step()
        for group in self.param_groups:
            frames, euclidean = [], []
            for p in group["params"]:
                if p.grad is not None:
                    (frames if _is_frame(p) else euclidean).append(p)
            if frames:
                self._step_frames(group, frames)
            if euclidean:
                self._step_euclidean(group, euclidean)
        return loss

    def _init_frame_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        ct = _linalg.compute_dtype(p.dtype)
        step_device = p.device if _capturable(group, p.device) else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
        # the parameter's memory layout (column-major frames then take the in-place path); a sharded frame's
        # state is a DTensor sharded like it, created at its local shape (whole frames: no communication)
        local = _local(p)
        state["exp_avg"] = _distributed.like_parameter(p, _zeros_like_layout(local, ct), tuple(p.shape))
        second_moment = group["second_moment"]
        if second_moment is not None:
            local_v = torch.zeros(_frame_state_shapes(local, second_moment)["exp_avg_sq"], dtype=ct,
                                  device=p.device)
            state["exp_avg_sq"] = _distributed.like_parameter(
                p, local_v, _frame_state_shapes(p, second_moment)["exp_avg_sq"])
        state["skipped_frames"] = torch.zeros((), dtype=torch.int64, device=p.device)
        return state

    def _step_frames(self, group: dict[str, Any], frames: list[torch.Tensor]) -> None:
        states = []
        for p in frames:
            state = self.state[p]
            states.append(state if state else self._init_frame_state(p, group))
        torch._foreach_add_([state["step"] for state in states], 1.0)
        update = self._update_batch if group["second_moment"] in _FAST_MODES else self._update_batch_reference
        # the step count is read on the host only outside the capturable path
        steps = [None if _capturable(group, p.device) else int(state["step"])
                 for p, state in zip(frames, states, strict=True)]
        for step, params in _frame_batches(frames, steps, self.__dict__.get("_stack_numel")):
            if _local(params[0]).numel():  # a rank may hold no head of a sharded frame stack
                update(group, params, step)

    def _step_tensor(self, params: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The step counts of ``params`` as a tensor broadcastable to their stacked frames ``(n, 1, 1)``, in
        ``dtype``, on their device (the capturable path: no host read)."""
        device = params[0].device
        steps = [self.state[p]["step"] for p in params]
        if len(params) == 1:
            return steps[0].to(device=device, dtype=dtype)
        per_param = _local(params[0]).numel() // (params[0].shape[-2] * params[0].shape[-1])
        return torch.stack(steps).to(device=device, dtype=dtype).repeat_interleave(per_param).view(-1, 1, 1)

    def _workspace(self, numel: int, dtype: torch.dtype, device: torch.device, reuse: bool = True) -> torch.Tensor:
        """A reusable flat buffer of ``numel`` elements: one per (dtype, device), grown to the largest batch,
        never part of the state (neither saved nor loaded). ``reuse=False`` (the capturable path) allocates a
        fresh one, which compiled and captured steps handle better than a buffer kept on the optimizer."""
        if not reuse:
            return torch.empty(numel, dtype=dtype, device=device)
        workspaces = self.__dict__.setdefault("_workspaces", {})
        buf = workspaces.get((dtype, device))
        if buf is None or buf.numel() < numel:
            buf = workspaces[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def _update_batch(self, group: dict[str, Any], params: list[torch.Tensor], step: int | None) -> None:
        """Update same-shaped frames of one dtype, device and step count (``step=None``: the capturable path,
        any step counts, read from the state as tensors) with :func:`_frame_update_`.

        A lone parameter whose frames (or float32 master copy) are dense in the compute dtype, row-major or
        column-major like its first moment, is updated in place, with its state. Several parameters are
        updated as one stack: their state tensors (first and second moments, master copies) are kept as
        consecutive slices of one buffer per batch (:func:`_stacked_state`), which the update reads and writes
        in place; frames (unless a master stack stands for them) and gradients are staged in the workspace, and
        the frames copied back.
        """
        beta1, beta2 = group["betas"]
        p0 = params[0]
        d, r = p0.shape[-2:]
        ct = _linalg.compute_dtype(p0.dtype)
        capturable = step is None
        states = [self.state[p] for p in params]
        # local shards of sharded frames (whole frames, updated independently), else the tensors themselves
        locals_ = [_local(p).detach() for p in params]
        grads = [_distributed.local_grad(p) for p in params]
        masters = self._master_copies(params) if group["master_weights"] and p0.dtype != ct else None
        k = len(params)
        n = k * locals_[0].numel() // (d * r)
        size = n * d * r
        # state kept stacked: several plain (unsharded) parameters, outside a region torch.compile traces (where
        # reading storage pointers would break the graph)
        stack = k > 1 and all(_local(p) is p for p in params) and not torch.compiler.is_compiling()
        if stack:
            keys = ["exp_avg"] + (["exp_avg_sq"] if group["second_moment"] is not None else []) + (
                ["master"] if masters else [])
            members = set(params)

            def others() -> list[dict[str, Any]]:  # only asked for when a batch is stacked anew
                return [self.state[q] for q in group["params"] if q not in members and q in self.state]

            stacks = {key: _stacked_state(states, key, others) for key in keys}
            m, v = stacks["exp_avg"].view(n, d, r), stacks.get("exp_avg_sq")
            v = v.view(n, 1, 1) if v is not None else None
            master = stacks.get("master")  # the stacked master copies are the frames the update reads
            ws = self._workspace((2 if master is not None else 3) * size, ct, p0.device, reuse=not capturable)
            scratch, g = ws[:size].view(n, d, r), ws[size:2 * size].view(n, d, r)
            torch._foreach_copy_(list(g.view(k, *locals_[0].shape).unbind(0)), grads)
            if master is None:
                w = ws[2 * size:].view(n, d, r)
                torch._foreach_copy_(list(w.view(k, *locals_[0].shape).unbind(0)), locals_)
            else:
                w = master.view(n, d, r)
        else:
            exp_avgs = [_local(state["exp_avg"]) for state in states]
            exp_avg_sqs = ([_local(state["exp_avg_sq"]) for state in states] if group["second_moment"] is not None
                           else None)
            src, m0 = (masters or locals_)[0], exp_avgs[0]  # what the update reads: the master copy if any
            direct = k == 1 and src.dtype == ct and src.stride() == m0.stride() and (src.is_contiguous()
                                                                                    or src.mT.is_contiguous())
            ws = self._workspace(size if direct else 4 * size, ct, p0.device, reuse=not capturable)
            scratch = ws[:size].view(n, d, r)
            if direct and not src.is_contiguous():  # column-major frames: a column-major scratch, same strides
                scratch = ws[:size].view(n, r, d).mT
            if direct:
                w, m = src.view(n, d, r), m0.view(n, d, r)
                g = grads[0].reshape(n, d, r).to(ct)
                v = exp_avg_sqs[0].view(n, 1, 1) if exp_avg_sqs else None
            else:  # a frame whose dtype or layout differs from its first moment's, or sharded/compiled stacks
                staged = ws[size:].view(3, k, *locals_[0].shape)
                w_k, g_k, m_k = (list(t.unbind(0)) for t in staged.unbind(0))
                torch._foreach_copy_(w_k, masters or locals_)
                torch._foreach_copy_(g_k, grads)
                torch._foreach_copy_(m_k, exp_avgs)
                w, g, m = staged.view(3, n, d, r).unbind(0)
                v = torch.stack(exp_avg_sqs).view(n, 1, 1) if exp_avg_sqs else None
        lr, radius = _frame_lr(group, d, r, p0.device, ct, capturable)
        finite = _frame_update_(
            w, g, m, v, scratch, step=self._step_tensor(params, ct) if capturable else step, lr=lr,
            beta1=beta1, beta2=beta2, eps=group["eps"], trust_region=radius,
            maximize=group["maximize"], capturable=capturable)
        stabilize = group["stabilize"]  # None in capturable mode (refused by the validation)
        if stabilize is not None and step % stabilize == 0:
            w.copy_(_linalg.polar_svd(w))
            m.copy_(_linalg.proju(w, m))
        if stack:  # moments and masters were updated in place; the frames come back from w
            torch._foreach_copy_(locals_, list(w.view(k, *locals_[0].shape).unbind(0)))
        else:
            if not direct:
                torch._foreach_copy_(exp_avgs, m_k)
                if exp_avg_sqs:
                    torch._foreach_copy_(exp_avg_sqs, list(v.view(k, *exp_avg_sqs[0].shape).unbind(0)))
                if masters:
                    torch._foreach_copy_(masters, w_k)
            if masters or not direct:
                torch._foreach_copy_(locals_, masters or w_k)
        # on the CPU outside the capturable path, count only when a frame was skipped (a cheap host read)
        if capturable or p0.device.type != "cpu" or not bool(finite.all()):
            skipped = (~finite).reshape(k, -1).sum(dim=1)
            torch._foreach_add_([state["skipped_frames"] for state in states], list(skipped.unbind(0)))

    def _update_batch_reference(self, group: dict[str, Any], params: list[torch.Tensor], step: int | None) -> None:
        """Update frames with the pure :func:`stiefel_adam_update` (the ``"column"`` and ``"element"`` variants);
        ``step=None`` is the capturable path."""
        beta1, beta2 = group["betas"]
        d, r = params[0].shape[-2:]
        ct = _linalg.compute_dtype(params[0].dtype)
        capturable = step is None
        lr, radius = _frame_lr(group, d, r, params[0].device, ct, capturable)
        order = None if radius is None else _linalg.series_order(float(radius) ** 2, ct)
        states = [self.state[p] for p in params]
        locals_ = [_local(p).detach() for p in params]
        counts = [t.numel() // (d * r) for t in locals_]

        def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([t.reshape((-1,) + t.shape[-2:]) for t in tensors]).to(ct)

        def unstacked(stack: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
            return [x.reshape(t.shape) for x, t in zip(stack.split(counts), like, strict=True)]

        if capturable:  # per-frame step counts, as a tensor
            step = torch.cat([self.state[p]["step"].to(device=p.device, dtype=ct).expand(c)
                              for p, c in zip(params, counts, strict=True)])
            step = step.view(-1, 1, 1)
        g = stacked([_distributed.local_grad(p) for p in params])
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states] if group["second_moment"] is not None else None
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        masters = self._master_copies(params) if group["master_weights"] and params[0].dtype != ct else None
        w_new, m_new, v_new, finite = stiefel_adam_update(
            stacked(masters or locals_), -g if group["maximize"] else g,
            stacked(exp_avgs), stacked(exp_avg_sqs) if exp_avg_sqs else None,
            step=step, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
            trust_region=radius, second_moment=group["second_moment"], series_order=order)
        stabilize = group["stabilize"]
        if stabilize is not None and step % stabilize == 0:
            w_new = _linalg.polar_svd(w_new)
            m_new = _linalg.proju(w_new, m_new)
        torch._foreach_copy_(locals_, unstacked(w_new, locals_))
        if masters:
            torch._foreach_copy_(masters, unstacked(w_new, locals_))
        torch._foreach_copy_(exp_avgs, unstacked(m_new, locals_))
        if exp_avg_sqs:
            torch._foreach_copy_(exp_avg_sqs, unstacked(v_new, exp_avg_sqs))
        skipped = [c.sum() for c in (~finite).reshape(-1).split(counts)]
        torch._foreach_add_([s["skipped_frames"] for s in states], skipped)

    def _step_euclidean(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                step_device = p.device if _capturable(group, p.device) else torch.device("cpu")
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        # torch's capturable AdamW runs on accelerators only; on the CPU its default path has no device to sync
        # with and is traced by torch.compile without graph breaks
        device = params[0].device
        capturable = _capturable(group, device) and device.type in _TORCH_CAPTURABLE_DEVICES
        _torch_adamw.adamw(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=capturable, differentiable=False, fused=None,
            has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )

    def _master_copies(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The float32 master copies of low-precision frames (``state["master"]``), made from the parameter at
        first use; entries that the parameter no longer rounds to (changed outside the optimizer, e.g. by
        ``proj_()`` or ``load_state_dict`` of the model alone) are re-read from the parameter."""
        masters = []
        for p in params:
            state = self.state[p]
            local = _local(p).detach()
            if state.get("master") is None:
                master = local.to(torch.float32, copy=True)
                state["master"] = _distributed.like_parameter(p, master, tuple(p.shape))
            else:
                master = _local(state["master"])
                torch.where(master.to(p.dtype) == local, master, local.to(master.dtype), out=master)
            masters.append(master)
        return masters

    @torch.no_grad()
    def stabilize_group(self, group: dict[str, Any]) -> None:
        """Re-project the group's frames onto the manifold (exact SVD) and their first moments onto the
        tangent spaces."""
        for p in group["params"]:
            if not _is_frame(p) or not self.state[p]:
                continue
            local = _local(p)
            if not local.numel():
                continue
            master = self.state[p].get("master")
            if master is not None:
                master = self._master_copies([p])[0]
                master.copy_(_linalg.polar_svd(master))
                local.copy_(master)
            else:
                local.copy_(p.manifold.projx(local))
            m = _local(self.state[p]["exp_avg"])
            m.copy_(_linalg.proju(local.to(m.dtype) if master is None else master, m))
