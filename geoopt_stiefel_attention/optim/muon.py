r"""The :class:`StiefelMuon` optimizer: manifold Muon on Stiefel frames, AdamW for everything else.

The update rule is written twice: readable in :func:`~._muon.stiefel_muon_update` (SVD msign, float64, the
specification) and fast in :func:`_muon_update_` below (batched, matrix products only), tested equal by
``tests/test_muon.py``. The bookkeeping (groups, checks, state dicts, AdamW, the step loop) is the shared
:class:`~._base.FrameOptimizer`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import geoopt
import torch

from .. import _linalg
from .. import distributed as _distributed
from ._base import FrameOptimizer
from ._batching import _cat_frames, _frame_batches, _slices
from ._kernel import _rounding_margin
from ._muon import muon_direction, muon_lr_scale
from ._state import _capturable, _zeros_like_layout, master_copies
from ._validation import SHARED_OPTIONS, SHARED_RULES, Option, _in_unit_interval, check_group

_local = _distributed.local_tensor

__all__ = ["StiefelMuon", "DEFAULT_DUAL_STEPS", "DEFAULT_NS_STEPS"]

#: Trial steps of the dual descent per optimizer step: the cheapest setting of the table in
#: ``benchmarks/README.md`` whose worst relative optimality gap stays below 1e-3 at the bench widths, on
#: Gaussian momenta. Momenta with a decaying spectrum need more (see :class:`StiefelMuon`'s notes).
DEFAULT_DUAL_STEPS = 10
#: Newton–Schulz iterations per ``r x r`` inverse square root inside the direction solver.
DEFAULT_NS_STEPS = 8

#: The group options StiefelMuon adds to AdamW's, with the values a state dict saved without them loads with.
_MUON_GROUP_DEFAULTS = {"momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw",
                        "dual_steps": DEFAULT_DUAL_STEPS, "ns_steps": DEFAULT_NS_STEPS, "master_weights": False,
                        "stabilize": None}


#: The options only StiefelMuon has (those both optimizers have are :data:`~._validation.SHARED_OPTIONS`).
MUON_OPTIONS: tuple[Option, ...] = (
    Option("momentum", _in_unit_interval, "pass a float in [0, 1) (torch's Muon uses 0.95)."),
    Option("nesterov", lambda v: isinstance(v, bool), "pass True or False."),
    Option("dual_steps", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 100,
           f"pass an int in [0, 100) (default {DEFAULT_DUAL_STEPS}; dual_steps=0 takes the cheap projected msign "
           f"direction)."),
    Option("ns_steps", lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 100,
           f"pass an int in [1, 100) (default {DEFAULT_NS_STEPS})."),
    Option("stabilize", lambda v: v is None,
           "(the polar retraction keeps frames on the manifold); pass stabilize=None.", verdict="is not supported"),
)


def _validate_muon_group(group: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the option and the fix when a StiefelMuon group option is out of range."""
    check_group(group, "StiefelMuon", SHARED_OPTIONS + MUON_OPTIONS, SHARED_RULES)


def _muon_update_(w: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float | torch.Tensor,
                  momentum: float, nesterov: bool, dual_steps: int, ns_steps: int, maximize: bool = False,
                  capturable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The update of :func:`~._muon.stiefel_muon_update` on a stack ``(n, d, r)``, with ``w`` and ``buf``
    overwritten in place (``grad`` is only read). The direction is :func:`~._muon.muon_direction`; the retraction
    :math:`\operatorname{polar}(W - \eta A)` inverts the square root of the Gram matrix of the actual
    :math:`W - \eta A` by the cheapest exact method for the bound :math:`\|\eta A\|_2 \le 1.05\,\eta` (see the
    certificates): :func:`~.._linalg.retraction_plan`'s Taylor series or Newton-Schulz, matrix products only; a
    tensor learning rate (no host read) takes the exact inverse square root of :func:`~.._linalg.inv_sqrt`.

    Returns the boolean ``(n, 1, 1)`` mask of frames whose gradient was finite, and the solver's gap
    ``(n, 1, 1)`` (see :func:`~._muon.muon_direction`).
    """
    xi = _linalg.proju(w, -grad if maximize else grad)
    finite = _linalg.frame_sq_norm(xi) < math.inf
    xi = torch.where(finite, xi, torch.zeros((), dtype=xi.dtype, device=xi.device))
    buf.lerp_(xi, finite.to(xi.dtype) * (1.0 - momentum))
    u = xi.lerp(buf, momentum) if nesterov else buf
    direction, gap = muon_direction(u, w, iterations=dual_steps, ns_steps=ns_steps)
    y = w - lr * direction
    gram = torch.bmm(y.mT, y)
    plan = bound = None
    if not isinstance(lr, torch.Tensor):  # ||lr * direction||_2 <= 1.05 lr (the solver's stated slack)
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
    return finite, gap


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
                 = P_W\big(\operatorname{msign}(U - 2 W \Lambda^\star)\big),
                 \quad \Lambda^\star = \operatorname*{argmin}_{\Lambda = \Lambda^\top} \|U - 2W\Lambda\|_* \\
        W &\leftarrow \operatorname{polar}(W - \eta A^\star), \qquad \eta = \mathrm{lr}\cdot s(d, r) \\
        B &\leftarrow B - W \operatorname{sym}(W^\top B) \qquad \text{(transport by projection)}

    where :math:`s(d, r)` is torch's ``Muon`` learning-rate adjustment for a ``d x r`` matrix (``adjust_lr_fn``):
    :math:`0.2\sqrt{\max(d, r)}` for ``"match_rms_adamw"`` (the default here, so that one lr serves the frames
    and the AdamW parameters), :math:`\sqrt{\max(1, d/r)}` for ``"original"`` (torch's default). The momentum
    recursion is torch's (``buf.lerp_(grad, 1 - momentum)``, ``grad.lerp(buf, momentum)``) applied to the
    Riemannian gradient. :math:`\Lambda^\star` is found by ``dual_steps`` steps of gradient descent on the dual
    :math:`\|U - 2W\Lambda\|_*` with a per-frame step that adapts itself, entirely on ``r x r`` matrices
    (:func:`~geoopt_stiefel_attention.optim._muon.muon_direction`, matrix products only, no SVD or
    eigendecomposition); ``dual_steps=0`` is the cheap approximation :math:`P_W \operatorname{msign}(P_W U)`,
    2-8 % below the optimum. The duality gap :math:`\|U - 2W\Lambda\|_* - \langle U, A\rangle` of the last step,
    as the solver's Newton–Schulz iterations estimate it (see the notes: not a bound where they have not
    converged), is kept per frame in ``state["dual_gap"]`` (``(..., 1, 1)``, no host read).

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
    dual_steps : int, default :data:`DEFAULT_DUAL_STEPS`
        Trial steps of the dual descent (``0``: the projected msign).
    ns_steps : int, default :data:`DEFAULT_NS_STEPS`
        Newton–Schulz iterations per ``r x r`` inverse square root.
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
    - The direction is exact to the solver's tolerance, not to rounding, and the default setting
      (``dual_steps=10, ns_steps=8``) was chosen on Gaussian momenta, where it is within 1e-3 of the optimum
      (``geoopt_stiefel_attention.analysis`` certifies this against an independent solver). **Momenta whose
      singular values span a wide range are not resolved by it**: with singular values falling off as
      :math:`1/i` the default direction is about 10 % short of the optimum (measured at 128 x 32 and 512 x 64,
      float64; ``tests/test_muon.py``), because 8 Newton–Schulz iterations do not resolve eigenvalues of
      :math:`Z^\top Z` far below the largest, and the dual descent then decides on wrong values.
      ``ns_steps=16, dual_steps=60`` brings it within 1e-3 there (``dual_steps=99``: 4e-5), at several times
      the cost. ``state["dual_gap"]`` is computed from the same Newton–Schulz estimates, so it is **not** an
      upper bound when they have not converged: it can be near zero, or negative, for a direction 10 % short.
      Read a negative gap as an unresolved solve.
    - Cost: four ``d x r x r`` products for the direction whatever ``dual_steps`` is (the descent runs on
      ``r x r`` matrices), plus the projection, retraction and transport; ``stiefel-attention bench`` measures it
      beside torch's ``Muon`` on the same frames.
    - Sharded frames (FSDP2 by heads) take the same copy path as bf16 frames (``DTensor`` local shards).

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
    _GROUP_DEFAULTS = _MUON_GROUP_DEFAULTS
    _MOMENT_KEY = "momentum_buffer"

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
        dual_steps: int = DEFAULT_DUAL_STEPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        master_weights: bool = False,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool | None = None,
    ) -> None:
        params = self._check_params_argument(params)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=betas,
                        eps=eps, adjust_lr_fn=adjust_lr_fn, dual_steps=dual_steps, ns_steps=ns_steps,
                        master_weights=master_weights, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, stabilize=None, differentiable=False, fused=None,
                        decoupled_weight_decay=True)
        _validate_muon_group(defaults)
        self._pending_defaults = {}
        self._constructing = True
        super().__init__(params, defaults, stabilize=None)
        del self._pending_defaults, self._constructing
        self._check_constructed()

    def _validate_group(self, group: dict[str, Any]) -> None:
        _validate_muon_group(group)

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
        return state

    def _step_frames(self, group: dict[str, Any], frames: list[torch.Tensor]) -> None:
        states = [self.state[p] if self.state[p] else self._init_frame_state(self.state[p], p, group)
                  for p in frames]
        torch._foreach_add_([state["step"] for state in states], 1.0)
        for _, params in _frame_batches(frames, None, self.__dict__.get("_stack_numel")):
            if _local(params[0]).numel():
                self._update_batch(group, params)

    def _update_batch(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Stack the frames of one shape (or their float32 master copies) in the compute dtype, update them with
        :func:`_muon_update_`, write frames, moments and gaps back, count skipped frames."""
        p0 = params[0]
        d, r = p0.shape[-2:]
        ct = _linalg.compute_dtype(p0.dtype)
        capturable = _capturable(group, p0.device)
        masters = master_copies(self.state, params) if group["master_weights"] and p0.dtype != ct else None
        locals_ = [_local(p).detach() for p in params]
        sources = masters or locals_
        bufs = [_local(self.state[p]["momentum_buffer"]) for p in params]
        gaps = [_local(self.state[p]["dual_gap"]) for p in params]
        w = _cat_frames([s.to(ct) for s in sources])
        g = _cat_frames([_distributed.local_grad(p).to(ct) for p in params])
        buf = _cat_frames(bufs)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(device=p0.device, dtype=ct) if capturable else float(lr)
        lr = lr * muon_lr_scale(group["adjust_lr_fn"], d, r)
        finite, gap = _muon_update_(w, g, buf, lr=lr, momentum=group["momentum"], nesterov=group["nesterov"],
                                    dual_steps=group["dual_steps"], ns_steps=group["ns_steps"],
                                    maximize=group["maximize"], capturable=capturable)
        torch._foreach_copy_(bufs, _slices(buf, bufs))
        torch._foreach_copy_(gaps, _slices(gap, gaps))
        new = _slices(w, locals_)
        if masters:
            torch._foreach_copy_(masters, new)
        torch._foreach_copy_(locals_, masters or new)
        self._count_skipped(group, params, finite)
