r"""The :class:`StiefelMuon` optimizer: manifold Muon on Stiefel frames, AdamW for everything else.

The update rule is written twice: readable in :func:`~._muon.stiefel_muon_update` (SVD msign, float64, the
specification) and fast in :func:`_muon_update_` below (batched, matrix products only), tested equal by
``tests/test_muon.py``. The bookkeeping (groups, checks, state dicts, AdamW, the step loop) is the shared
:class:`~._base.FrameOptimizer`'s.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import geoopt
import torch

from .. import _linalg
from .. import distributed as _distributed
from ._base import FrameOptimizer
from ._batching import _count_frames, _frame_counts, stage
from ._kernel import _rounding_margin
from ._muon import DEFAULT_DIRECTION_TOL, muon_direction, muon_lr_scale
from ._state import _capturable, _zeros_like_layout, master_copies
from ._validation import MUON_OPTIONS, SHARED_OPTIONS, SHARED_RULES

_local = _distributed.local_tensor

__all__ = ["StiefelMuon", "DEFAULT_DIRECTION_TOL"]

#: The group options StiefelMuon adds to AdamW's, with the values a state dict saved without them loads with.
_MUON_GROUP_DEFAULTS = {"momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw",
                        "direction_tol": None, "direction_steps": None, "master_weights": False,
                        "stabilize": None}

#: Options of the earlier fixed-count solver (issue 56): refused, and dropped with a warning from an old state dict.
_RETIRED_OPTIONS = ("dual_steps", "ns_steps")


def _retired(given: dict[str, Any], where: str) -> str | None:
    """What to say of the options of the earlier solver that ``given`` sets (not ``None``), or ``None``."""
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        return None
    settings = ", ".join(f"{key}={value!r}" for key, value in given.items())
    return (f"{where}: {settings}: the fixed-count dual descent these options set was removed (issue 56); the direction "
            f"is now solved until a certified duality gap: use direction_tol (relative gap) and direction_steps (cap "
            f"on its iterations) instead")


def _refuse_retired(given: dict[str, Any], where: str) -> None:
    """Refuse, before anything changes, the options of the earlier solver (no alias for a version never released)."""
    message = _retired(given, where)
    if message is not None:
        raise ValueError(message + ".")


def _muon_update_(w: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float | torch.Tensor,
                  momentum: float, nesterov: bool, direction_tol: float | None = None,
                  direction_steps: int | None = None, maximize: bool = False, capturable: bool = False,
                  reproject: bool = False) -> tuple[torch.Tensor, Any]:
    r"""The update of :func:`~._muon.stiefel_muon_update` on a stack ``(n, d, r)``, with ``w`` and ``buf``
    overwritten in place (``grad`` is only read). The direction is :func:`~._muon.muon_direction`; the retraction
    :math:`\operatorname{polar}(W - \eta A)` inverts the square root of the Gram matrix of the actual
    :math:`W - \eta A` by the cheapest exact method for the bound :math:`\|\eta A\|_2 \le 1.05\,\eta` (see the
    certificates): :func:`~.._linalg.retraction_plan`'s Taylor series or Newton-Schulz, matrix products only; a
    tensor learning rate (no host read) takes the exact inverse square root of :func:`~.._linalg.inv_sqrt`.

    ``reproject`` (frames stored in bfloat16/float16, whose float32 copy is about 1e-3 off the manifold): first
    one Newton–Schulz step :math:`W \leftarrow W(3I - W^\top W)/2` (orthonormal to about 1e-5), so that the direction
    is that of a frame (the solver's certificate assumes :math:`W^\top W = I`).

    Returns the boolean ``(n, 1, 1)`` mask of frames whose gradient was finite, and the solver's
    :class:`~._muon.DirectionSolve` (gap, bound, certified; see :func:`~._muon.muon_direction`).
    """
    frame = 1.5 * w - 0.5 * torch.bmm(w, torch.bmm(w.mT, w)) if reproject else w
    xi = _linalg.proju(frame, -grad if maximize else grad)
    finite = _linalg.frame_sq_norm(xi) < math.inf
    xi = torch.where(finite, xi, torch.zeros((), dtype=xi.dtype, device=xi.device))
    buf.lerp_(xi, finite.to(xi.dtype) * (1.0 - momentum))
    u = xi.lerp(buf, momentum) if nesterov else buf
    solve = muon_direction(u, frame, tol=direction_tol, max_steps=direction_steps, synchronize=not capturable)
    y = frame - lr * solve.direction
    gram = torch.bmm(y.mT, y)
    plan = bound = None
    if not isinstance(lr, torch.Tensor):  # ||lr * direction||_2 <= lr to rounding; 1.05 lr leaves room
        bound = (1.05 * lr) ** 2 + _rounding_margin(w.dtype)
        plan = _linalg.retraction_plan(bound, w.dtype)
    if plan is not None:
        x = _linalg.inv_sqrt_planned(gram, bound, plan)
    else:
        x = _linalg.inv_sqrt(gram, synchronize=not capturable)
    moving = finite
    if not isinstance(lr, torch.Tensor) and lr == 0:
        moving = torch.zeros_like(finite)
    w_new = torch.bmm(y, x)
    w.copy_(torch.where(moving, w_new, w))
    transported = buf - torch.bmm(w, _linalg.sym(torch.bmm(w.mT, buf)))
    buf.copy_(torch.where(moving, transported, buf))
    return finite, solve


class StiefelMuon(FrameOptimizer, geoopt.optim.mixin.OptimMixin, torch.optim.Optimizer):
    r"""Manifold Muon for Stiefel frames: the spectral-norm steepest tangent direction, polar retraction;
    AdamW for every other parameter.

    torch's :class:`~torch.optim.Muon` orthogonalises a matrix's momentum (msign) and takes a step of fixed
    spectral size. On :math:`\mathrm{St}(d, r)` the matching method is steepest descent under the spectral norm
    restricted to the tangent space. With step count :math:`t`, each frame :math:`W` with Euclidean gradient
    :math:`G` is updated by

    .. math::

        \xi &= G - W \operatorname{sym}(W^\top G) \\
        B &\leftarrow \mu B + (1 - \mu)\,\xi \\
        U &= (1 - \mu)\,\xi + \mu B \quad\text{(Nesterov; } U = B \text{ without)} \\
        A^\star &= \operatorname*{argmax}_{W^\top A + A^\top W = 0,\ \|A\|_2 \le 1} \langle U, A \rangle
                 = \operatorname{msign}(U W^\top - W U^\top)\, W \\
        W &\leftarrow \operatorname{polar}(W - \eta A^\star), \qquad \eta = \mathrm{lr}\cdot s(d, r) \\
        B &\leftarrow B - W \operatorname{sym}(W^\top B) \qquad \text{(transport by projection)}

    where :math:`s(d, r)` is torch's ``Muon`` learning-rate adjustment for a ``d x r`` matrix (``adjust_lr_fn``):
    :math:`0.2\sqrt{\max(d, r)}` for ``"match_rms_adamw"`` (the default here, so that one lr serves the frames
    and the AdamW parameters), :math:`\sqrt{\max(1, d/r)}` for ``"original"`` (torch's default). The momentum
    recursion is torch's (``buf.lerp_(grad, 1 - momentum)``, ``grad.lerp(buf, momentum)``) applied to the
    Riemannian gradient.

    :math:`A^\star` has a closed form (proved in :mod:`geoopt_stiefel_attention.optim._muon`: every feasible
    :math:`A` is :math:`\Omega W` for a skew :math:`\Omega` with :math:`\|\Omega\|_2 \le 1`, so
    :math:`\max\langle U, A\rangle = \tfrac12\|UW^\top - WU^\top\|_*`), computed by
    :func:`~geoopt_stiefel_attention.optim.muon_direction`: matrix products only (no SVD, eigendecomposition or
    solve), batched over frames, on a ``d x d`` skew matrix for :math:`d \le 2r` and a ``2r x 2r`` one otherwise,
    and stopped per frame on a **certificate**: an upper bound :math:`\bar U \ge \max\langle U, A\rangle`
    computed from the iterate, so that a relative duality gap :math:`(\bar U - \langle U, A\rangle)/\bar U \le`
    ``direction_tol`` proves the direction optimal to that tolerance. The gap :math:`\bar U - \langle U,
    A\rangle` of the last step is kept per frame in ``state["dual_gap"]`` (``(..., 1, 1)``, no host read).

    Parameters
    ----------
    params : iterable
        Parameters, ``(name, parameter)`` pairs or group dicts; frames and Euclidean parameters may be mixed.
    lr : float, default 1e-3
        Learning rate, ``>= 0``; a frame's step has spectral norm :math:`\eta = \mathrm{lr}\cdot s(d, r)`.
    momentum : float, default 0.95
        :math:`\mu \in [0, 1)`, as in torch's ``Muon``.
    nesterov : bool, default True
        Nesterov momentum, as in torch's ``Muon``.
    weight_decay : float, default 0.1
        Decoupled (AdamW) decay of Euclidean parameters (torch's ``Muon`` default); none on frames, where its
        Riemannian gradient :math:`\lambda P_W(W) = 0`.
    betas, eps : default (0.9, 0.999), 1e-8
        AdamW's, for the Euclidean parameters only.
    adjust_lr_fn : {"match_rms_adamw", "original"}, default "match_rms_adamw"
        torch's ``Muon`` meanings (see above).
    direction_tol : float or None, default None
        Relative duality gap at which the direction solver stops a frame, in ``(0, 1)``; ``None`` takes
        :data:`DEFAULT_DIRECTION_TOL` of the compute dtype (1e-7 in float64, 1e-3 in float32 and for
        bf16/fp16 frames; typical certified gaps are far smaller, see the notes).
    direction_steps : int or None, default None
        Cap on the solver's iterations, in ``[1, 1000]``; ``None`` takes the count that suffices for every
        input (:func:`~geoopt_stiefel_attention.optim._muon.certified_direction_steps`: 42 in float64, 26 in
        float32). The eager step stops earlier, once every frame of a batch is certified (one round, 14 or 13
        iterations, for most momenta); the capturable step always runs the count.
    dual_steps, ns_steps : optional
        Removed (issue 56): passing either raises, naming ``direction_tol`` and ``direction_steps``.
    master_weights : bool, default False
        Keep and update a float32 master copy of bf16/fp16 frames in ``state["master"]``.
    amsgrad, maximize, foreach : bool
        As in :class:`torch.optim.AdamW` (``maximize`` applies to frames too).
    capturable : bool or None, default None
        No host reads in the frame step (CUDA graphs, ``torch.compile``); ``None`` means ``True`` on
        accelerators.

    Scope and warnings
    ------------------
    - Frames must be on the manifold at their first step (``ValueError`` naming ``proj_()``); other manifolds,
      sparse and complex gradients are refused before anything changes, with the same checks and messages as
      :class:`~geoopt_stiefel_attention.StiefelAdam`, whose base it shares.
    - A frame whose gradient has a NaN or Inf entry is skipped for that step and counted in
      ``state["skipped_frames"]``; so is, as a whole, any other parameter whose gradient has one (its value,
      moments and step count unchanged). The default step warns once per parameter, naming it; the capturable
      step counts on the device without a warning.
    - The options both optimizers have are checked by one table, before anything moves: the same value gets
      the same answer and words as in :class:`~geoopt_stiefel_attention.StiefelAdam` (a bool is not a number:
      ``weight_decay=True`` is refused by both; a tensor ``lr`` with ``foreach=True`` too, as by torch's AdamW).
    - **The direction is certified optimal**, for every frame shape (square :math:`r = d`, near-square
      :math:`r = d - 1`, :math:`r \ll d`) and momentum (decaying spectra, rank-deficient momenta, zero): each
      frame's solve stops once its relative duality gap is at most ``direction_tol``, checked against the bound
      above (tested against an independent convex solver, cvxpy with Clarabel, in ``tests/test_muon.py``).
      Typical certified gaps are far below the default tolerances (float64 about 1e-14; float32 about 1e-6 on
      Gaussian and :math:`1/i`-spectrum momenta, 4e-5 rank one at 128 x 32); the float32 default 1e-3 leaves room
      for what float32 cannot resolve in the whitening of the momentum's normal part (about :math:`r\sqrt
      d\,\epsilon` for rank-deficient momenta, 3e-4 for one singular value above a flat rest at 1e-5 of it; see
      :func:`~geoopt_stiefel_attention.optim.muon_direction`). bfloat16/float16 frames are made orthonormal in
      their float32 copy (one Newton–Schulz step) before the solve.
    - **A frame not certified within** ``direction_steps`` is not silent: it is counted in
      ``state["uncertified_frames"]`` (int64, per parameter, every step it happens), and the eager step warns
      once per parameter, naming it and the gap reached. The capturable step (``capturable=True``: no host
      read, for CUDA graphs and ``torch.compile``) runs the bound-derived count, which suffices in exact
      arithmetic for every input (the proof is in
      :func:`~geoopt_stiefel_attention.optim._muon.certified_direction_steps`), and keeps the counter on the
      device without reading it.
    - Cost: the solve is one round (13-14 iterations of two ``k x k`` products, :math:`k = \min(d, 2r)`) for
      momenta whose singular values span less than four decades, plus about ten ``d x r x r`` products (the
      whitening of the normal part, for :math:`d > 2r`); ``stiefel-attention bench`` measures the step beside
      torch's ``Muon``. Against the earlier fixed-count solver (``dual_steps=10, ns_steps=8``, which was not
      optimal: 4-12 % short on 10 x 9 frames, 8-17 % on :math:`1/i` spectra), the StiefelMuon step takes
      0.94-1.35x its time at the bench widths and the direction alone 0.93-2.0x (float32, one thread, one
      interleaved run: ``benchmarks/muon_solver_before_after.py``, ``benchmarks/README.md``).
    - Frames are staged as :class:`~geoopt_stiefel_attention.StiefelAdam`'s are: the momentum buffers and gaps of a
      batch of same-shaped frames kept stacked in one buffer, frames and gradients in a reusable workspace, a lone
      parameter updated in place; sharded frames (FSDP2 by heads) take the copy path, as bf16 frames without
      master copies do.

    Examples
    --------
    >>> import torch, geoopt
    >>> from geoopt_stiefel_attention import PolarStiefel, StiefelMuon
    >>> st = PolarStiefel()
    >>> w = geoopt.ManifoldParameter(st.random(4, 32, 8), manifold=st)
    >>> b = torch.nn.Parameter(torch.zeros(8))
    >>> opt = StiefelMuon([w, b], lr=1e-2)
    >>> ((w.sum(dim=1) + b) ** 2).sum().backward()
    >>> opt.step()
    >>> st.check_point_on_manifold(w)
    True
    """

    _NAME = "StiefelMuon"
    _OPTIONS = SHARED_OPTIONS + MUON_OPTIONS
    _RULES = SHARED_RULES
    _GROUP_DEFAULTS = _MUON_GROUP_DEFAULTS
    _MOMENT_KEY = "momentum_buffer"
    _COUNTERS = ("skipped_frames", "uncertified_frames")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adjust_lr_fn: str = "match_rms_adamw",
        direction_tol: float | None = None,
        direction_steps: int | None = None,
        master_weights: bool = False,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool | None = None,
        dual_steps: int | None = None,
        ns_steps: int | None = None,
    ) -> None:
        params = self._check_params_argument(params)
        _refuse_retired({"dual_steps": dual_steps, "ns_steps": ns_steps}, "StiefelMuon")
        self._construct(params, dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=betas, eps=eps,
            adjust_lr_fn=adjust_lr_fn, direction_tol=direction_tol, direction_steps=direction_steps,
            master_weights=master_weights, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, stabilize=None, differentiable=False, fused=None, decoupled_weight_decay=True))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """:meth:`torch.optim.Optimizer.add_param_group`; a group that sets the options of the earlier solver
        (``dual_steps``, ``ns_steps``) is refused, naming the options that replace them.

        Parameters
        ----------
        param_group : dict
            The group: ``"params"`` and any options (the constructor's defaults fill the rest).
        """
        _refuse_retired({key: param_group[key] for key in _RETIRED_OPTIONS if key in param_group},
                        "StiefelMuon.add_param_group")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`FrameOptimizer.load_state_dict`; a state dict saved before issue 56 (whose groups hold the earlier
        solver's ``dual_steps`` and ``ns_steps``) loads with a ``UserWarning`` that they are dropped, and its
        groups take ``direction_tol=None, direction_steps=None``.

        Parameters
        ----------
        state_dict : dict
            As returned by :meth:`state_dict`, with the entries ``"state"`` and ``"param_groups"`` (the argument is
            not modified).
        """
        groups = state_dict.get("param_groups") or []
        # (a group without AdamW's betas is another optimizer's, e.g. torch's Muon, whose ns_steps means something
        # else: the base refuses it, naming what it lacks)
        retired = {key: group[key] for group in groups if "betas" in group for key in _RETIRED_OPTIONS if key in group}
        if retired:
            warnings.warn(_retired(retired, "StiefelMuon.load_state_dict") + "; they are dropped from the loaded "
                          "groups, which take direction_tol=None, direction_steps=None.", UserWarning, stacklevel=2)
            state_dict = {**state_dict, "param_groups": [
                {key: value for key, value in group.items() if "betas" not in group or key not in _RETIRED_OPTIONS}
                for group in groups]}
        super().load_state_dict(state_dict)

    def _check_frames_group(self, k: int, group: dict[str, Any]) -> None:
        """Refuse a group of frames whose momentum a scheduler meant to cycle: ``OneCycleLR`` and ``CyclicLR`` with
        ``cycle_momentum=True`` (their default) cycle ``betas[0]`` of an optimizer whose defaults have ``betas``, as
        StiefelMuon's do (AdamW's, for the Euclidean parameters), so the frames' ``momentum``, which they cycle for
        torch's ``Muon``, would stay fixed without a word. They mark the group with ``max_momentum`` and
        ``base_momentum``."""
        if "max_momentum" in group or "base_momentum" in group:
            raise ValueError(
                f"StiefelMuon: parameter group {k} holds Stiefel frames and has 'max_momentum'/'base_momentum', "
                f"written by a scheduler that cycles momentum (OneCycleLR or CyclicLR with cycle_momentum=True); "
                f"since StiefelMuon's groups also have AdamW's 'betas', it cycles betas[0], which only Euclidean "
                f"parameters read, while the frames' momentum would stay at {group['momentum']!r} (torch's Muon "
                f"would have it cycled). Pass cycle_momentum=False to the scheduler (and write group['momentum'] "
                f"yourself to schedule it), or delete both keys from the group if no such scheduler is in use.")

    def _frame_spec(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[list[str], dict[str, tuple]]:
        shape = tuple(p.shape)
        return ["step", "momentum_buffer"], {"momentum_buffer": shape, "master": shape,
                                             "dual_gap": shape[:-2] + (1, 1)}

    def _init_frame_state(self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        ct = _linalg.compute_dtype(p.dtype)
        local = _local(p)
        state["step"] = torch.zeros((), dtype=torch.float32,
                                    device=p.device if _capturable(group, p.device) else torch.device("cpu"))
        state["momentum_buffer"] = _distributed.like_parameter(p, _zeros_like_layout(local, ct), tuple(p.shape))
        state["dual_gap"] = _distributed.like_parameter(
            p, torch.zeros(local.shape[:-2] + (1, 1), dtype=ct, device=p.device), tuple(p.shape[:-2]) + (1, 1))
        state["skipped_frames"] = torch.zeros((), dtype=torch.int64, device=p.device)
        state["uncertified_frames"] = torch.zeros((), dtype=torch.int64, device=p.device)
        return state

    def _update_batch(self, group: dict[str, Any], params: list[torch.Tensor], step: int | None) -> None:
        """Update frames of one shape, dtype and device on the shared staging (:func:`~._batching.stage`: frames and
        gradients in the workspace or in place, the momentum buffers and gaps stacked in the state, as
        StiefelAdam's moments) by :func:`_muon_update_`, write them back, count skipped frames and frames whose
        direction was not certified (and warn once per parameter about those, on the eager path)."""
        p0 = params[0]
        d, r = p0.shape[-2:]
        ct = _linalg.compute_dtype(p0.dtype)
        capturable = _capturable(group, p0.device)
        masters = master_copies(self.state, params) if group["master_weights"] and p0.dtype != ct else None
        batch = stage(self, group, params, ["momentum_buffer", "dual_gap"], masters, capturable, scratch=False)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(device=p0.device, dtype=ct) if capturable else float(lr)
        lr = lr * muon_lr_scale(group["adjust_lr_fn"], d, r)
        tol = group["direction_tol"]
        tol = DEFAULT_DIRECTION_TOL[ct] if tol is None else tol
        finite, solve = _muon_update_(batch.w, batch.g, batch.state["momentum_buffer"], lr=lr,
                                      momentum=group["momentum"], nesterov=group["nesterov"], direction_tol=tol,
                                      direction_steps=group["direction_steps"], maximize=group["maximize"],
                                      capturable=capturable, reproject=p0.dtype != ct)
        batch.state["dual_gap"].copy_(solve.gap)
        batch.write_back()
        self._count_skipped(group, params, finite)
        uncertified = finite & ~solve.certified
        _count_frames(self.state, params, uncertified, "uncertified_frames")
        if not capturable and bool(uncertified.any()):  # the eager path reads the host
            self._warn_uncertified(group, params, uncertified, solve, tol)

    def _warn_uncertified(self, group: dict[str, Any], params: list[torch.Tensor], uncertified: torch.Tensor,
                          solve: Any, tol: float) -> None:
        """One ``RuntimeWarning`` per parameter (the first step it happens) whose frames' directions were not
        certified: its name, how many frames, the largest relative gap reached and the options to change."""
        warned = self.__dict__.setdefault("_warned_uncertified", set())
        relative = (solve.gap / solve.bound.clamp_min(torch.finfo(solve.bound.dtype).tiny)).flatten()
        names = group.get("param_names") or [None] * len(group["params"])
        where = {id(p): j for j, p in enumerate(group["params"])}
        counts = _frame_counts([_local(p) for p in params])
        for p, mask, rel in zip(params, uncertified.flatten().split(counts), relative.split(counts), strict=True):
            if id(p) in warned or not bool(mask.any()):
                continue
            warned.add(id(p))
            j = where.get(id(p))
            name = f"{names[j]!r} " if j is not None and names[j] is not None else ""
            steps = group["direction_steps"]
            warnings.warn(
                f"StiefelMuon: the direction of {int(mask.sum())} of {mask.numel()} frames of parameter {name}"
                f"(shape {tuple(p.shape)}) was not certified within direction_steps="
                f"{steps if steps is not None else solve.steps} iterations: relative duality gap "
                f"{float(rel[mask].max()):.2e} > direction_tol={tol:g}. The step was taken with that direction; "
                f"it is counted in state['uncertified_frames'] (this warning is shown once per parameter). Raise "
                f"direction_steps (or pass None), or direction_tol.", RuntimeWarning, stacklevel=4)
