"""The :class:`StiefelAdam` optimizer: arguments, groups, checkpoints and the step loop.

The step reads like geoopt's ``RiemannianAdam``: per group, frames and Euclidean parameters are split; the
frames take the Stiefel update batch by batch (:mod:`._batching`, with the maths in :mod:`._reference` and
:mod:`._kernel`), the rest torch's AdamW. State creation and checkpoint loading live in :mod:`._state`,
argument checks in :mod:`._validation`.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import geoopt
import torch
import torch.optim.adamw as _torch_adamw
import torch.optim.optimizer as _torch_optimizer

from .. import _linalg
from .. import distributed as _distributed
from ..manifolds import is_frame as _is_frame
from . import _batching, _state, _validation
from ._state import _capturable
from ._validation import _DEFAULT_TRUST_REGION, _GROUP_DEFAULTS, _check_parameter, _validate_hyperparameters

_local = _distributed.local_tensor  # a DTensor's local shard (whole frames; see distributed), else the tensor

__all__ = ["StiefelAdam"]

#: Device types on which torch's own AdamW supports ``capturable=True`` (its Euclidean part of the step).
_TORCH_CAPTURABLE_DEVICES = tuple(_torch_optimizer._get_capturable_supported_devices())


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
    ``"match_rms_adamw"``. The second moment ``v`` is stored at its true shape ``(..., 1, 1)``. Every other
    parameter is updated exactly as by :class:`torch.optim.AdamW` with the group's ``lr``, ``betas``, ``eps``
    and ``weight_decay``. The update is :func:`stiefel_adam_update` (the specification) run by a fused in-place
    kernel; the options are explained at length in the documentation's "StiefelAdam in detail" page.

    Parameters
    ----------
    params : iterable
        Parameters, ``(name, parameter)`` pairs or parameter-group dicts; frames and Euclidean parameters may
        be mixed.
    lr : float, default 1e-3
        Learning rate, ``>= 0``; a frame's step has :math:`\|s\|_F \approx c\,\mathrm{lr}`
        (:math:`\sqrt{d r}\,\mathrm{lr}` under the default ``adjust_lr_fn``).
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to :math:`\sqrt{\hat v}`, ``>= 0``.
    weight_decay : float, default 0
        Decoupled (AdamW) decay of Euclidean parameters; none on frames, whose Riemannian gradient of
        :math:`\tfrac{\lambda}{2}\|W\|_F^2` is :math:`\lambda (W - W \operatorname{sym}(W^\top W)) = 0`.
    trust_region : float or None, default 0.1
        Per-frame cap :math:`c\,\Delta` on :math:`\|s\|_F`; ``None`` disables it.
    second_moment : {"frame", "column", "element", None}, default "frame"
        ``"frame"`` is the method; the others exist for the ablations (``None``: Riemannian SGD with momentum).
    stabilize : int or None, default None
        Re-project frames (exact SVD) and first moments every ``stabilize`` steps.
    master_weights : bool, default False
        Keep and update a float32 master copy of bf16/fp16 frames in ``state["master"]``.
    adjust_lr_fn : {"original", "match_rms_adamw"}, default "match_rms_adamw"
        What ``lr`` and ``trust_region`` measure for a ``d x r`` frame (:func:`frame_step_scale`). The default
        reads them per entry, as AdamW does (:math:`c = \sqrt{d r}`), so the model's AdamW learning rate moves a
        frame about as much per step as AdamW would move the same block; ``"original"`` is the paper's step
        (:math:`c = 1`, a frame's step has Frobenius norm about ``lr``), and what geoopt's ``RiemannianAdam``
        takes. Groups of a state dict saved without the option (older checkpoints, geoopt's) load as
        ``"original"``.
    amsgrad, maximize, foreach : bool
        As in :class:`torch.optim.AdamW`; ``amsgrad`` and ``foreach`` concern Euclidean parameters only.
    differentiable, fused : bool
        Accepted for torch's signature; only ``False``/``None`` is supported.
    capturable : bool or None, default None
        As in :class:`torch.optim.Adam` (no host reads; CUDA graphs, ``torch.compile``); ``None`` means
        ``True`` on accelerators. Not combinable with ``stabilize``.

    Scope and warnings
    ------------------
    - Frames must be on the manifold at their first step (within :data:`ORTHONORMALITY_TOLERANCE`), or a
      ``ValueError`` suggests ``.proj_()``; ``CanonicalStiefel`` and other manifolds, sparse gradients and
      complex frames are refused. Validation happens before anything changes.
    - A frame whose gradient has a NaN or Inf entry is skipped for that step and counted in
      ``state["skipped_frames"]``; Euclidean parameters follow torch's AdamW, which does not skip.
    - bf16/fp16 frames compute and keep moments in float32; small steps are partly lost to rounding unless
      ``master_weights=True``.
    - Sharded (FSDP2/``DTensor``) frames are supported when sharded along a leading (head) dimension;
      a sharding that splits a frame is refused (see :mod:`geoopt_stiefel_attention.distributed`).
    - Cost: six batched ``d x r x r`` products per frame and step, no ``d x d`` work, no SVD or QR; one
      reusable scratch buffer per dtype and device. ``stiefel-attention bench`` measures it.
    - Given no frame at all, it is plain AdamW and says so once, at construction (a ``UserWarning`` naming
      :func:`~geoopt_stiefel_attention.stiefelize`), unless the groups come from
      :func:`~geoopt_stiefel_attention.param_groups`, which warns itself (or not, with ``expect_frames=False``).

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
        adjust_lr_fn: str = "match_rms_adamw",
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
                state[p] = _state._loaded_state(p, value, group, label)
            else:
                state[key] = value  # state of no parameter is kept as is, as torch does
        self.__setstate__({"state": state, "param_groups": new_groups})
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ------------------------------------------------------------------ the step
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
        _validation.validate_step(self.param_groups, self.state)
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

    def _step_frames(self, group: dict[str, Any], frames: list[torch.Tensor]) -> None:
        states = []
        for p in frames:
            state = self.state[p]
            states.append(state if state else _state.init_frame_state(state, p, group))
        torch._foreach_add_([state["step"] for state in states], 1.0)
        # the step count is read on the host only outside the capturable path
        steps = [None if _capturable(group, p.device) else int(state["step"])
                 for p, state in zip(frames, states, strict=True)]
        for step, params in _batching._frame_batches(frames, steps, self.__dict__.get("_stack_numel")):
            if _local(params[0]).numel():  # a rank may hold no head of a sharded frame stack
                _batching.update_batch(self, group, params, step)

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
                master = _state.master_copies(self.state, [p])[0]
                master.copy_(_linalg.polar_svd(master))
                local.copy_(master)
            else:
                local.copy_(p.manifold.projx(local))
            m = _local(self.state[p]["exp_avg"])
            m.copy_(_linalg.proju(local.to(m.dtype) if master is None else master, m))
