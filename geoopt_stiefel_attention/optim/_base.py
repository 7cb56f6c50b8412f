"""The base of the frame optimizers: everything but the update rule, written once.

:class:`FrameOptimizer` owns what :class:`~geoopt_stiefel_attention.StiefelAdam` and
:class:`~geoopt_stiefel_attention.StiefelMuon` share: construction (:meth:`FrameOptimizer._construct`); parameter
groups in every form torch accepts, validated before anything changes; the options, each declared once with its
check (:mod:`._validation`) and checked when a group is added or its options change; AdamW (torch's own
implementation) for every parameter that is not a frame; state created lazily at its true shapes;
``state_dict``/``load_state_dict`` checked completely before anything changes; the step loop (closure, checks of
every gradient and fresh frame, frames and Euclidean parameters split per group, frames batched by shape); the
staging of a batch (:func:`~._batching.stage`: workspace, state stacked per batch); re-projection (``stabilize``);
and the refusal of a wrapper that replaced the frames in ``param_groups``. A subclass is its rule: its options and
their checks (``_OPTIONS``, ``_RULES``, ``_GROUP_DEFAULTS``), the state a frame keeps (``_init_frame_state``,
``_frame_spec``, ``_COUNTERS``), its update of one staged batch (``_update_batch``) and its name in messages.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.optim.adamw as _torch_adamw
from torch.nn.utils import parametrize as _parametrize

from .. import _linalg
from .. import distributed as _distributed
from ..manifolds import is_frame as _is_frame
from . import _batching, _state, _validation
from ._state import _capturable, _torch_capturable
from ._validation import _check_parameter

_local = _distributed.local_tensor  # a DTensor's local shard (whole frames; see distributed), else the tensor

__all__ = ["FrameOptimizer"]


def _sharded_squared_norms(grads: list[torch.Tensor], sharded: list[int]) -> list[torch.Tensor]:
    """The squared Frobenius norm of each gradient, a plain 0-dim tensor on its device (no host read); a sharded
    (``DTensor``) gradient's (positions ``sharded``) summed over the ranks of its mesh, one collective per mesh
    for all of them, so that every rank takes the same decision for the whole parameter (its value is exact for
    finiteness, which is what it is read for: a replicated gradient's is counted once per rank)."""
    squares = [n.square() for n in torch._foreach_norm([_local(g) for g in grads])]
    meshes: dict[int, tuple[Any, list[int]]] = {}
    for i in sharded:
        meshes.setdefault(id(grads[i].device_mesh), (grads[i].device_mesh, []))[1].append(i)
    for mesh, indices in meshes.values():
        summed = torch.stack([squares[i] for i in indices])
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(summed, group=mesh.get_group(dim))
        for i, value in zip(indices, summed.unbind(0), strict=True):
            squares[i] = value
    return squares


def _nonfinite(grads: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Whether the squared norm of each of ``grads`` is not finite (a NaN or Inf entry, or an overflow: what a
    frame's squared norm ``||xi||_F^2`` is held to): per device, the positions in ``grads`` and a bool tensor of
    their flags, computed on the device (no host read; without sharded gradients, one stack and one square per
    device)."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        by_device[g.device].append(i)
    sharded = [i for i, g in enumerate(grads) if _distributed.is_sharded(g)]
    if sharded:
        squares = _sharded_squared_norms(grads, sharded)
        return [(indices, torch.stack([squares[i] for i in indices]).isfinite().logical_not_())
                for indices in by_device.values()]
    norms = torch._foreach_norm(grads)
    return [(indices, torch.stack([norms[i] for i in indices]).square_().isfinite().logical_not_())
            for indices in by_device.values()]


class FrameOptimizer:
    """Mixin base of the frame optimizers (placed before a :class:`torch.optim.Optimizer` in the bases).

    A subclass sets ``_NAME`` (the class name, for messages), ``_OPTIONS`` and ``_RULES`` (its options, each with
    its one check, and the checks of their combinations: :mod:`._validation`), ``_GROUP_DEFAULTS`` (the values a
    state dict saved without an option loads with), ``_MOMENT_KEY`` (the frame's first-moment state entry,
    re-projected by :meth:`stabilize_group`), ``_COUNTERS`` (the int64 counters a frame's state keeps) and
    ``_STEP_ON_HOST`` (whether its update reads the step count as a number, so that batches are split by it), calls
    :meth:`_construct` from its constructor, and implements ``_init_frame_state(state, p, group)``,
    ``_frame_spec(p, group)`` (the required state keys of a frame and the shapes of its state, checked by
    :meth:`load_state_dict`) and ``_update_batch(group, params, step)`` (its update of one batch of frames of one
    shape, staged by :func:`~._batching.stage`).
    """

    _NAME: ClassVar[str] = "FrameOptimizer"
    _OPTIONS: ClassVar[tuple[_validation.Option, ...]] = ()
    _OPTION_NAMES: ClassVar[tuple[str, ...]] = ()
    _RULES: ClassVar[tuple[Callable[[dict[str, Any], str], None], ...]] = ()
    _GROUP_DEFAULTS: ClassVar[dict[str, Any]] = {}
    _MOMENT_KEY: ClassVar[str] = "exp_avg"
    _COUNTERS: ClassVar[tuple[str, ...]] = ("skipped_frames",)
    _STEP_ON_HOST: ClassVar[bool] = False

    def _init_frame_state(self, state: dict[str, Any], p: torch.Tensor,
                          group: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def _frame_spec(self, p: torch.Tensor,
                    group: dict[str, Any]) -> tuple[list[str], dict[str, tuple]]:  # pragma: no cover - as above
        raise NotImplementedError

    def _update_batch(self, group: dict[str, Any], params: list[torch.Tensor],
                      step: int | None) -> None:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    #: ``convert(p, group, state, where)``: converts, in place, a frame's loaded ``state`` saved in another form
    #: (another optimizer's checkpoint) before it is checked against :meth:`_frame_spec` (``where`` starts its
    #: messages); ``None``: nothing to convert.
    _CONVERT_LOADED: ClassVar[Callable[[torch.Tensor, dict[str, Any], dict[str, Any], str], None] | None] = None

    def _frame_rule(self, p: torch.Tensor, group: dict[str, Any]) -> _state.FrameRule | None:
        """What :func:`~._state._loaded_state` checks a loaded state of ``p`` against: the rule's
        :class:`~._state.FrameRule` for a frame, ``None`` (torch's AdamW state) for any other parameter."""
        if not _is_frame(p):
            return None
        required, shapes = self._frame_spec(p, group)
        convert = type(self)._CONVERT_LOADED
        return _state.FrameRule(required, shapes, self._COUNTERS,
                                functools.partial(convert, p, group) if convert is not None else None)

    def _check_frame_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Refuse, before anything changes, a frame whose state no longer fits its group's options (an option that
        shapes the state was changed after the first step). Nothing to check by default."""

    def _check_frames_group(self, k: int, group: dict[str, Any]) -> None:
        """Refuse, before anything changes, group ``k`` whose frames take a step now, when something written into it
        (by a scheduler) would not reach the frame update. Nothing to check by default."""

    # ------------------------------------------------------------------ options: declared once, checked on change
    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check every option of ``group`` that ``_OPTIONS`` declares and the combinations ``_RULES`` check; raise
        naming the option and the fix."""
        _validation.check_group(group, self._NAME, self._OPTIONS, self._RULES)

    def _check_options(self, k: int, group: dict[str, Any]) -> None:
        """Check group ``k``'s options before a step when they changed since they were last found valid (a
        scheduler or a user wrote into ``param_groups``); a tensor ``lr`` is checked every time."""
        if torch.compiler.is_compiling():  # traced: the checks become the graph's guards on the options
            self._validate_group(group)
            return
        valid = self.__dict__.setdefault("_valid_options", {})
        names = self._OPTION_NAMES
        if k in valid and _validation.options_unchanged(valid[k], group, names):
            return
        self._validate_group(group)
        valid[k] = _validation.option_snapshot(group, names)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._OPTION_NAMES = tuple(option.name for option in cls._OPTIONS)  # what _check_options compares

    #: Group options a state dict may lack because torch's base class fills them when it loads (``__setstate__``)
    #: or :meth:`load_state_dict` sets them; every other option of ``defaults`` must be in a saved group.
    _FILLED_ON_LOAD: ClassVar[frozenset[str]] = frozenset({"differentiable", "fused", "capturable",
                                                           "decoupled_weight_decay"})

    # ------------------------------------------------------------------ construction
    def _construct(self, params: list[Any], defaults: dict[str, Any]) -> None:
        """Build the optimizer from ``params`` (a list, see :meth:`_check_params_argument`) and the constructor's
        options ``defaults`` (every option of the rule): the options are checked once, then torch's
        :class:`~torch.optim.Optimizer` adds the groups (:meth:`add_param_group` checks each), and the result is
        checked as a whole (:meth:`_check_constructed`). geoopt's ``stabilize`` default is set for its
        ``add_param_group``."""
        self._validate_group(defaults)
        self._stabilize = defaults["stabilize"]
        self._constructing = True  # explicit empty lists among the constructor's groups are accepted silently
        try:
            torch.optim.Optimizer.__init__(self, params, defaults)
        finally:
            del self._constructing
        self._check_constructed()

    def _check_constructed(self) -> None:
        """After the constructor: refuse all-empty groups; warn once when no parameter is a frame."""
        if not any(group["params"] for group in self.param_groups):
            raise ValueError(f"{self._NAME}: all {len(self.param_groups)} parameter groups are empty, so the "
                             f"optimizer would train nothing; pass groups whose 'params' hold the tensors to "
                             f"train (is a generator already consumed?).")
        # Groups made by param_groups() (a group named "frames") were checked there, where expect_frames=False
        # marks a deliberate Euclidean baseline; anything else with no frame at all gets one warning here.
        if not any(_is_frame(p) for group in self.param_groups for p in group["params"]) and not any(
                group.get("name") == "frames" for group in self.param_groups):
            warnings.warn(f"{self._NAME} was constructed with no Stiefel frame among its parameters, so it trains "
                          f"them all as plain AdamW. Convert the model first (stiefelize(model)) or build it with "
                          f"attention='stiefel', then pass param_groups(model); for a Euclidean model use "
                          f"torch.optim.AdamW.", UserWarning, stacklevel=4)

    def _check_params_argument(self, params: Any) -> list[Any]:
        """``params`` as a list, refusing a lone tensor and an empty list (torch's messages, naming the fix)."""
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{self._NAME}: params must be an iterable of tensors, (name, tensor) pairs or group "
                            f"dicts, not a single {torch.typename(params)}; pass [tensor] or model.parameters().")
        params = list(params)
        if not params:
            raise ValueError(f"{self._NAME}: got an empty parameter list; pass model.parameters(), a list of "
                             f"tensors or a list of group dicts (is the generator already consumed?).")
        return params

    # ------------------------------------------------------------------ the frames it was given
    def _record_frames(self, params: list[Any]) -> None:
        """Remember the frames a group brought (the identity of each), for :meth:`_check_frames_still_held`."""
        given = self.__dict__.setdefault("_frames_given", [])
        for p in params:
            tensor = p[1] if isinstance(p, tuple) and len(p) == 2 else p
            if isinstance(tensor, torch.Tensor) and _is_frame(tensor):
                given.append(id(tensor))  # identities only: holding the tensors would change what dynamo traces

    def _check_frames_still_held(self) -> None:
        """Refuse to step when ``param_groups`` no longer hold every frame the optimizer was given.

        A wrapper that replaces ``param_groups[i]["params"]`` with other tensors (DeepSpeed ZeRO stages 1-3 hand
        the optimizer flat fp32 partitions; DeepSpeed's ``"fp16"``/``"bf16"`` modes, at ZeRO stage 0 too, hand it
        fp32 copies through ``FP16_Optimizer``, ``FP16_UnfusedOptimizer`` or ``BF16_Optimizer``) turns the frames
        into plain tensors the optimizer would update as AdamW, and the orthonormality constraint would be lost
        without a word. Raises ``RuntimeError`` before anything changes. The record survives
        :meth:`load_state_dict` (which keeps the parameters), ``copy.deepcopy`` and pickling (frames already
        replaced when the optimizer was copied stay counted as missing). Skipped while torch.compile traces (the
        set of identities is a host-side check).
        """
        given = self.__dict__.get("_frames_given") or []
        lost = self.__dict__.get("_frames_lost", 0)
        if not (given or lost) or torch.compiler.is_compiling():
            return
        held = {id(p) for group in self.param_groups for p in group["params"]}
        missing = lost + sum(1 for ident in given if ident not in held)
        if missing:
            raise RuntimeError(
                f"{self._NAME}: its parameter groups no longer hold {missing} of the {len(given) + lost} Stiefel "
                f"frames it was given; a wrapper replaced them with other tensors (DeepSpeed ZeRO stages 1-3 hand the "
                f"optimizer flattened partitions, and DeepSpeed's \"fp16\"/\"bf16\" modes, at ZeRO stage 0 too, hand it "
                f"fp32 copies through FP16_Optimizer, FP16_UnfusedOptimizer or BF16_Optimizer), so the orthonormality "
                f"constraint would be silently lost; use ZeRO stage 0, DDP, or FSDP2 with "
                f"geoopt_stiefel_attention.distributed.fully_shard_by_heads, with fp32 parameters: under DeepSpeed "
                f"leave out its \"fp16\" and \"bf16\" sections and compute in low precision with torch autocast (its "
                f"\"torch_autocast\" section, or torch.autocast in the forward).")

    # ------------------------------------------------------------------ groups and checkpoints
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as :meth:`torch.optim.Optimizer.add_param_group`.

        ``param_group["params"]`` may be a tensor, a list, tuple or generator of tensors, or of
        ``(name, tensor)`` pairs (``named_parameters()``). Every parameter is validated, whatever the form,
        before anything changes. An empty group given as a generator or iterator (often one that was consumed
        earlier), or added after construction, trains nothing and gives a ``UserWarning``; an explicit empty
        list among non-empty groups at construction is accepted silently, as by torch (e.g. the ``"frames"``
        group of :func:`~geoopt_stiefel_attention.param_groups` for a model without frames).

        Parameters
        ----------
        param_group : dict
            ``"params"`` and any of the optimizer's options; options not given take the optimizer's defaults.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"{self._NAME}: a parameter group must be a dict with a 'params' entry, not "
                            f"{type(param_group).__name__}.")
        if "params" not in param_group:
            raise ValueError(f"{self._NAME}: a parameter group needs a 'params' entry, e.g. "
                             "{'params': model.head.parameters(), 'lr': 1e-3}.")
        given = param_group["params"]
        if isinstance(given, torch.Tensor):
            params = [given]
        elif isinstance(given, (set, frozenset)):
            raise TypeError(f"{self._NAME}: parameters must be given in an ordered collection (list, tuple or "
                            f"generator), not a set, whose order changes between runs; pass a list.")
        else:
            params = list(given)  # a generator is read once, here; torch then sees the list
        param_group["params"] = params
        for p in params:
            tensor = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, tensor) pairs
            if isinstance(tensor, torch.Tensor):
                _distributed.check_parameter(tensor, self._NAME)  # sharded parameters, named by this class
                _check_parameter(tensor, self._NAME)
        constructing = self.__dict__.get("_constructing", False)
        defaults = {**self._GROUP_DEFAULTS, **self.defaults}
        for key in self._GROUP_DEFAULTS:
            param_group.setdefault(key, defaults[key])
        self._validate_group({**defaults, **param_group})
        _validation.check_euclidean_step({**defaults, **param_group}, len(self.param_groups),
                                         [t for t in (p[1] if isinstance(p, tuple) and len(p) == 2 else p
                                                      for p in params)
                                          if isinstance(t, torch.Tensor) and not _is_frame(t)], self._NAME)
        if not params and (not constructing or not isinstance(given, (list, tuple))):
            warnings.warn(f"{self._NAME}: parameter group {len(self.param_groups)} is empty and trains nothing "
                          f"(was its generator consumed before, e.g. model.parameters() passed twice?).",
                          UserWarning, stacklevel=2)
        super().add_param_group(param_group)
        self._record_frames(params)

    def __getstate__(self) -> dict[str, Any]:
        """torch's state plus the record of the frames it was given, as positions in ``param_groups`` (the
        identities change in a copy) and a count of those already missing, so a copy keeps refusing."""
        state = dict(super().__getstate__())
        given = self.__dict__.get("_frames_given") or []
        where = {id(p): (k, j) for k, group in enumerate(self.param_groups) for j, p in enumerate(group["params"])}
        state["_frames_given_at"] = [where[ident] for ident in given if ident in where]
        state["_frames_lost"] = self.__dict__.get("_frames_lost", 0) + sum(1 for ident in given if ident not in where)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        given_at = state.pop("_frames_given_at", None)
        lost = state.pop("_frames_lost", 0)
        super().__setstate__(state)
        for key, value in self._GROUP_DEFAULTS.items():
            self.defaults.setdefault(key, value)
            for group in self.param_groups:
                group.setdefault(key, value)
        self._stabilize = self.defaults.get("stabilize")  # what geoopt's add_param_group reads (lost by pickling)
        if "_frames_given" in self.__dict__:
            return  # a live optimizer (load_state_dict keeps the parameters): its record stands
        if given_at is not None:  # a copy or an unpickled optimizer: the record it was saved with
            self._frames_given = [id(self.param_groups[k]["params"][j]) for k, j in given_at]
            self._frames_lost = lost
        else:  # pickled by a version that saved no record: the frames its groups hold
            self._frames_given = []
            for group in self.param_groups:
                self._record_frames(group["params"])

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

        Parameters
        ----------
        state_dict : dict
            As returned by :meth:`state_dict` (of this optimizer, or of ``geoopt.optim.RiemannianAdam``), with the
            entries ``"state"`` and ``"param_groups"``.
        """
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{self._NAME}.load_state_dict: the state dict has {len(saved_groups)} parameter "
                             f"groups, this optimizer {len(self.param_groups)}; build the optimizer with the "
                             f"same groups as the one that was saved.")
        for k, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"{self._NAME}.load_state_dict: parameter group {k} has {len(group['params'])} "
                                 f"parameters here and {len(saved['params'])} in the state dict; build the "
                                 f"optimizer with the same groups as the one that was saved.")
        new_groups, rule_changed = [], []
        for k, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if ("adjust_lr_fn" in self._GROUP_DEFAULTS and "adjust_lr_fn" not in saved
                    and group.get("adjust_lr_fn") != self._GROUP_DEFAULTS["adjust_lr_fn"]):
                rule_changed.append(k)
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            has = sorted(key for key in saved if key != "params")
            for key, value in self._GROUP_DEFAULTS.items():
                saved.setdefault(key, value)
            missing = sorted(key for key in self.defaults if key not in saved and key not in self._FILLED_ON_LOAD)
            if missing:  # another optimizer's state dict (torch's Muon has no betas, amsgrad, maximize, foreach)
                raise ValueError(f"{self._NAME}.load_state_dict: parameter group {k} of the state dict lacks the "
                                 f"options {missing}, which every {self._NAME} group has (it has {has}), so it was "
                                 f"saved by another optimizer (torch.optim.Muon?), whose moments do not carry "
                                 f"over; load a state dict saved by {self._NAME}, or start this optimizer afresh.")
            saved["decoupled_weight_decay"] = True
            self._validate_group(saved)
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
                state[p] = _state._loaded_state(p, value, group, label, self._NAME, self._frame_rule(p, group))
            else:
                state[key] = value  # state of no parameter is kept as is, as torch does
        if rule_changed:  # not silent: the frames' step size changes with the rule
            rule = self._GROUP_DEFAULTS["adjust_lr_fn"]
            warnings.warn(f"{self._NAME}.load_state_dict: parameter group(s) {', '.join(map(str, rule_changed))} of "
                          f"the state dict have no 'adjust_lr_fn' (a geoopt optimizer's or an older checkpoint), so "
                          f"they load with adjust_lr_fn={rule!r}, the step they were saved with, not this optimizer's "
                          f"{self.param_groups[rule_changed[0]].get('adjust_lr_fn')!r}; set "
                          f"group['adjust_lr_fn'] after loading to train on with the other rule.",
                          UserWarning, stacklevel=2)
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
        self._check_frames_still_held()
        if not torch.compiler.is_compiling():
            self.__dict__.pop("_skip_log", None)  # what a step that raised midway may have left
            if _parametrize._cache_enabled:
                self._warn_cached()
        split = _validation.validate_step(self.param_groups, self.state, self._NAME, self._check_options,
                                          self._check_frame_state)
        for k, (group, (frames, _)) in enumerate(zip(self.param_groups, split, strict=True)):
            if frames:
                self._check_frames_group(k, group)
        for group, (frames, euclidean) in zip(self.param_groups, split, strict=True):
            if frames:
                self._step_frames(group, frames)
            if euclidean:
                self._step_euclidean(group, euclidean)
        if not torch.compiler.is_compiling():
            self._report_skipped()
        return loss

    def _warn_cached(self) -> None:
        """Warn when this step runs inside ``torch.nn.utils.parametrize.cached()``, a parametrized weight has been
        read there (the block's cache holds it) and this optimizer holds frames: the weights that ``stiefelize``
        rebuilds from frames are cached at their first read, so the forwards after this step would still use the
        frames as they were."""
        if _parametrize._cache and any(_is_frame(p) for group in self.param_groups for p in group["params"]):
            warnings.warn(f"{self._NAME}.step() inside torch.nn.utils.parametrize.cached(): the weights rebuilt from "
                          f"the frames (stiefelize) are cached until the block ends, so forward passes after this "
                          f"step in the block still use the frames as they were; step outside the block (it is meant "
                          f"for inference, or for weights that do not change).", UserWarning, stacklevel=3)

    def _step_frames(self, group: dict[str, Any], frames: list[torch.Tensor]) -> None:
        """The group's frames (those with a gradient): their state created at the first step
        (:meth:`_init_frame_state`), the step counts advanced, then the rule's update (:meth:`_update_batch`) on
        each batch of one frame shape, dtype and device (:func:`~._batching._frame_batches`; and one step count,
        for a rule that reads it on the host, outside the capturable path)."""
        states = []
        for p in frames:
            state = self.state[p]
            states.append(state if state else self._init_frame_state(state, p, group))
        torch._foreach_add_([state["step"] for state in states], 1.0)
        steps = None
        if self._STEP_ON_HOST:  # the step count is read on the host only outside the capturable path
            steps = [None if _capturable(group, p.device) else int(state["step"])
                     for p, state in zip(frames, states, strict=True)]
        for step, params in _batching._frame_batches(frames, steps, self.__dict__.get("_stack_numel")):
            if _local(params[0]).numel():  # a rank may hold no head of a sharded frame stack
                self._update_batch(group, params, step)

    def _step_euclidean(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch's AdamW on the group's parameters that are not frames, under the policy for non-finite gradients
        that frames follow: a parameter whose gradient has a NaN or Inf entry is skipped as a whole (its value,
        its moments and its step count stay as they were) and counted in its ``state["skipped_frames"]``.

        The criterion is the frames': the squared norm of the gradient is not finite (a NaN or Inf entry, or an
        overflow). Outside torch.compile, on the CPU (where torch's AdamW reads its step counts on the host anyway)
        or outside capturable mode, the flags are read on the host (:meth:`_adamw_skipping_on_host`); on an
        accelerator in capturable mode, and under torch.compile, the skip is made on the device with no host read
        (:meth:`_adamw_restoring_on_device`)."""
        lists, counters = self._adamw_lists(group, params)
        grads = lists[1]
        live = [i for i, g in enumerate(grads) if g.numel()]  # an empty tensor has no entry to be non-finite
        flags = _nonfinite([grads[i] for i in live]) if live else []
        device = params[0].device
        capturable = _capturable(group, device)
        if not torch.compiler.is_compiling() and (device.type in _linalg.HOST_READ_DEVICES or not capturable):
            self._adamw_skipping_on_host(group, lists, counters, live, flags, warn=not capturable)
        else:
            self._adamw_restoring_on_device(group, lists, counters, live, flags)

    def _adamw_lists(self, group: dict[str, Any],
                     params: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """torch's functional AdamW's lists for ``params`` (parameters, gradients, first and second moments, AMSGrad
        maxima, step counts), their state created at the first step, and each parameter's ``skipped_frames``
        counter (created for a state made by torch's AdamW, or before the policy covered these parameters)."""
        grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, counters = [], [], [], [], [], []
        amsgrad = group["amsgrad"]
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                step_device = p.device if _capturable(group, p.device) else torch.device("cpu")
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            counter = state.get("skipped_frames")
            if counter is None:
                counter = state["skipped_frames"] = torch.zeros((), dtype=torch.int64, device=p.device)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
            counters.append(counter)
        return [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps], counters

    def _adamw_skipping_on_host(self, group: dict[str, Any], lists: list[list[torch.Tensor]],
                                counters: list[torch.Tensor], live: list[int],
                                flags: list[tuple[list[int], torch.Tensor]], warn: bool) -> None:
        """The flags read on the host (free on the CPU, whose AdamW step reads its step counts anyway; one
        synchronisation on an accelerator outside capturable mode): the parameters flagged are counted (and, with
        ``warn``, remembered for the step's warning, where frames say it: the default step, not the capturable
        one), then AdamW runs on the others."""
        skip = {live[indices[j]] for indices, bad in flags if bool(bad.any())
                for j, flag in enumerate(bad.tolist()) if flag}
        if skip:
            for i in skip:
                counters[i].add_(1)
            if warn:
                self.__dict__.setdefault("_skip_log", []).append([lists[0][i] for i in sorted(skip)])
            lists = [[t for i, t in enumerate(lst) if i not in skip] for lst in lists]
            if not lists[0]:
                return
        self._adamw(group, *lists)

    def _adamw_restoring_on_device(self, group: dict[str, Any], lists: list[list[torch.Tensor]],
                                   counters: list[torch.Tensor], live: list[int],
                                   flags: list[tuple[list[int], torch.Tensor]]) -> None:
        """No host read (capturable steps, CUDA graphs, torch.compile): values and moments are copied before torch's
        AdamW runs and put back where the gradient was not finite, and the step counts taken back by one (the
        copies cost one extra pass over those tensors and their memory during the step)."""
        params, _, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        bad = [None] * len(live)
        for indices, stack in flags:
            for j, flag in zip(indices, stack.unbind(0), strict=True):
                bad[j] = flag
        restored = [[_local(lst[i]) for i in live] for lst in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
                    if lst]  # a sharded parameter's shard (every rank took the same decision)
        saved = [[t.clone() for t in lst] for lst in restored]
        self._adamw(group, *lists)
        for lst, copies in zip(restored, saved, strict=True):
            for t, old, flag in zip(lst, copies, bad, strict=True):
                torch.where(flag, old, t, out=t)
        if live:
            torch._foreach_sub_([steps[i] for i in live],
                                [flag.to(steps[i].device, steps[i].dtype) for i, flag in zip(live, bad, strict=True)])
            torch._foreach_add_([counters[i] for i in live], [flag.to(torch.int64) for flag in bad])

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
               exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor],
               steps: list[torch.Tensor]) -> None:
        """torch's functional AdamW with the group's options."""
        beta1, beta2 = group["betas"]
        # torch's capturable AdamW runs on accelerators only; on the CPU its default path has no device to sync
        # with and is traced by torch.compile without graph breaks
        _torch_adamw.adamw(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=_torch_capturable(group, params[0].device), differentiable=False,
            fused=None, has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )

    # ------------------------------------------------------------------ skipped updates: counted, and said once
    def _count_skipped(self, group: dict[str, Any], params: list[torch.Tensor], finite: torch.Tensor) -> None:
        """Count the frames of one batch that were skipped (``finite`` False: one entry per frame, in order) in
        their parameters' ``state["skipped_frames"]``; on a step that may read the host, remember the batch for the
        warning :meth:`_report_skipped` gives at the end of the step."""
        p0 = params[0]
        if _capturable(group, p0.device) or torch.compiler.is_compiling():
            _batching._count_skipped(self.state, params, finite)  # on the device, no host read
            return
        if p0.device.type in _linalg.HOST_READ_DEVICES and bool(finite.all()):
            return  # the common case on the CPU: nothing skipped (a free host read), nothing to count
        _batching._count_skipped(self.state, params, finite)
        self.__dict__.setdefault("_skip_log", []).append((params, finite))

    def _report_skipped(self) -> None:
        """One ``UserWarning`` naming the parameters whose update this step skipped for the first time (a frame
        with a NaN or Inf gradient, or a parameter that is not a frame whose gradient has such an entry); later
        skips of the same parameters are only counted. Called at the end of a step that may read the host."""
        log = self.__dict__.pop("_skip_log", None)
        if not log:
            return
        skipped = []
        for entry in log:
            if isinstance(entry, list):  # parameters that are not frames, known on the host
                skipped.extend(entry)
                continue
            params, finite = entry  # a batch of frames: the parameters with a skipped frame
            counts = _batching._frame_counts([_local(p) for p in params])
            flags = [bool(part.any()) for part in (~finite).reshape(-1).split(counts)]
            skipped.extend(p for p, flag in zip(params, flags, strict=True) if flag)
        warned = self.__dict__.setdefault("_skip_warned", set())
        new = [p for p in skipped if id(p) not in warned]
        if not new:
            return
        warned.update(id(p) for p in new)
        labels = [self._label(p) for p in new]
        shown = "; ".join(labels[:5]) + (f"; and {len(labels) - 5} more" if len(labels) > 5 else "")
        warnings.warn(f"{self._NAME}.step(): a NaN or Inf gradient skipped the update of {len(new)} parameter(s): "
                      f"{shown}. A skipped frame, and a skipped parameter that is not a frame as a whole, keep their "
                      f"values and moments; each skip is counted in optimizer.state[p]['skipped_frames'], and later "
                      f"skips of these parameters are counted without a warning. Check the loss and the inputs "
                      f"(torch.amp.GradScaler skips such steps whole).", UserWarning, stacklevel=5)

    def _label(self, p: torch.Tensor) -> str:
        """A parameter as messages name it: its name when the groups carry ``param_names``, its group, position
        and shape."""
        for k, group in enumerate(self.param_groups):
            for j, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    name = f"{names[j]!r} " if names else ""
                    what = "frame" if _is_frame(p) else "parameter"
                    return f"{what} {name}(group {k}, position {j}, shape {tuple(p.shape)})"
        return f"parameter of shape {tuple(p.shape)}"  # pragma: no cover - every stepped parameter is in a group

    @torch.no_grad()
    def stabilize_group(self, group: dict[str, Any]) -> None:
        """Re-project the group's frames onto the manifold (exact SVD) and their first moments onto the
        tangent spaces.

        Parameters
        ----------
        group : dict
            One of :attr:`param_groups`; its Euclidean parameters and frames without state are left as they are.
        """
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
            m = _local(self.state[p][self._MOMENT_KEY])
            m.copy_(_linalg.proju(local.to(m.dtype) if master is None else master, m))
