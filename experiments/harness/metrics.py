r"""Per-evaluation metric hooks of the shared training loop, and the maths they use.

A hook is an object with three optional methods (subclass :class:`MetricHook`):

- ``on_start(model)``: called once with the freshly initialised model, *before* a checkpoint is loaded,
  so a hook may keep a copy of the initial weights (a resumed run rebuilds the same initial model from its
  seed);
- ``before_last_step(model)``: called right before the last optimizer step that precedes an evaluation;
- ``metrics(model) -> dict[str, float | None]``: the values to add to the evaluation's record.

:class:`WeightNorms` and :class:`QKGeometry` are the built-in hooks; studies add their own.

A :class:`StepHook` instead adds values to every training step's record (``steps.jsonl``), read from the
training forward itself (no extra forward): ``attach(model)`` once the model is built, ``values()`` after each
step's forward and backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from geoopt_stiefel_attention.manifolds import is_frame

__all__ = ["MetricHook", "StepHook", "WeightNorms", "QKGeometry", "StepMovement", "principal_angles"]


class MetricHook:
    """Base class of the metric hooks; every method is a no-op."""

    def on_start(self, model: torch.nn.Module) -> None:
        """Called once with the freshly initialised model (before any checkpoint is loaded)."""

    def before_last_step(self, model: torch.nn.Module) -> None:
        """Called right before the last optimizer step that precedes an evaluation."""

    def metrics(self, model: torch.nn.Module) -> dict[str, float | None]:
        """Values to add to the current evaluation's record."""
        return {}


class StepHook:
    """Base class of the per-step hooks (module docstring); every method is a no-op."""

    def attach(self, model: torch.nn.Module) -> None:
        """Called once with the built (and prepared) model, before training; e.g. registers forward hooks."""

    def values(self) -> dict[str, Any]:
        """Values of the step just taken (its training forward) to add to its record."""
        return {}


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r"""Principal angles between the column spaces of ``a`` and ``b``, in radians, ascending.

    With orthonormal bases :math:`Q_a, Q_b` of the two column spaces (QR, in float64), the cosines of the
    angles are the singular values of :math:`Q_a^\top Q_b` and their sines those of
    :math:`Q_b - Q_a (Q_a^\top Q_b)`. Each angle is taken from the better-conditioned of the two
    (:math:`\arccos` when :math:`\cos^2\theta < 1/2`, else :math:`\arcsin`), so small angles are accurate too
    (Björck and Golub, 1973).

    Parameters
    ----------
    a, b : torch.Tensor
        ``(..., d, r)`` with the same shape and full column rank.

    Returns
    -------
    torch.Tensor
        ``(..., r)`` float64 angles in :math:`[0, \pi/2]`.
    """
    if a.shape != b.shape or a.ndim < 2:
        raise ValueError(f"principal_angles: a {tuple(a.shape)} and b {tuple(b.shape)} must have the same "
                         f"shape (..., d, r).")
    qa = torch.linalg.qr(a.detach().to(torch.float64)).Q
    qb = torch.linalg.qr(b.detach().to(torch.float64)).Q
    cross = qa.transpose(-1, -2) @ qb
    cos = torch.linalg.svdvals(cross).clamp(0.0, 1.0)  # descending: smallest angle first
    sin = torch.linalg.svdvals(qb - qa @ cross).clamp(0.0, 1.0).flip(-1)  # ascending
    return torch.where(cos.square() < 0.5, torch.arccos(cos), torch.arcsin(sin))


class WeightNorms(MetricHook):
    r"""Frobenius norm :math:`\|W\|_F` of every weight matrix (``ndim >= 2``), as ``norm/<name>``, plus
    ``norm/euclidean`` :math:`= (\sum \|W\|_F^2)^{1/2}` over the matrices that are not Stiefel frames (the
    quantity weight decay acts on).

    Parameters
    ----------
    include : callable, optional
        ``include(name, param) -> bool`` restricts the per-matrix entries (the total is over all of them).
    """

    def __init__(self, include: Callable[[str, torch.Tensor], bool] | None = None) -> None:
        self.include = include

    @torch.no_grad()
    def metrics(self, model: torch.nn.Module) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        total = 0.0
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            norm = float(torch.linalg.vector_norm(p.detach().to(torch.float64)))
            if not is_frame(p):
                total += norm * norm
            if self.include is None or self.include(name, p):
                out[f"norm/{name}"] = norm
        out["norm/euclidean"] = math.sqrt(total)
        return out


QKFunction = Callable[[torch.nn.Module], Sequence[tuple[str, torch.Tensor, torch.Tensor]]]


class QKGeometry(MetricHook):
    r"""Movement and principal angles of the query/key projections.

    ``qk(model)`` returns ``[(path, w_q, w_k), ...]`` with ``w_q, w_k`` of shape ``(heads, d, r)``: each head's
    projection as a ``d x r`` matrix whose column space is the head's query (key) subspace, for Stiefel
    and Euclidean attention alike. With :math:`W^{(0)}` the initial value, :math:`W^{-}` the value before the
    last step, and the norms taken over every layer and head together, the hook records for
    :math:`X \in \{q, k\}`:

    - ``move_step/X`` :math:`= \|W - W^{-}\|_F` (the last step's movement; ``None`` at epoch 0),
    - ``move_total/X`` :math:`= \|W - W^{(0)}\|_F`, and ``move_total_rel/X`` :math:`= \|W - W^{(0)}\|_F /
      \|W^{(0)}\|_F`,
    - ``angle_max_deg/X`` and ``angle_mean_deg/X``: the largest and the mean principal angle (degrees)
      between each head's current and initial column space, over all heads and layers; with more than one
      layer also per layer, ``angle_max_deg/X/<path>``.
    """

    def __init__(self, qk: QKFunction) -> None:
        self.qk = qk
        self._init: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prev: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _snapshot(self, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            return {path: (q.detach().to(torch.float64).clone(), k.detach().to(torch.float64).clone())
                    for path, q, k in self.qk(model)}

    def on_start(self, model: torch.nn.Module) -> None:
        self._init = self._snapshot(model)
        self._prev = None

    def before_last_step(self, model: torch.nn.Module) -> None:
        self._prev = self._snapshot(model)

    @torch.no_grad()
    def metrics(self, model: torch.nn.Module) -> dict[str, float | None]:
        now = self._snapshot(model)
        if set(now) != set(self._init):
            raise RuntimeError(f"QKGeometry: the model's projections {sorted(now)} differ from those at start "
                               f"{sorted(self._init)}; call on_start with the same model.")
        out: dict[str, float | None] = {}
        for i, x in enumerate(("q", "k")):
            step_sq = total_sq = init_sq = 0.0
            angles = []
            for path, pair in now.items():
                w, w0 = pair[i], self._init[path][i]
                total_sq += float((w - w0).square().sum())
                init_sq += float(w0.square().sum())
                if self._prev is not None:
                    step_sq += float((w - self._prev[path][i]).square().sum())
                deg = torch.rad2deg(principal_angles(w, w0))
                angles.append(deg)
                if len(now) > 1:
                    out[f"angle_max_deg/{x}/{path}"] = float(deg.max())
            out[f"move_step/{x}"] = math.sqrt(step_sq) if self._prev is not None else None
            out[f"move_total/{x}"] = math.sqrt(total_sq)
            out[f"move_total_rel/{x}"] = math.sqrt(total_sq / init_sq) if init_sq > 0 else None
            cat = torch.cat([a.flatten() for a in angles])
            out[f"angle_max_deg/{x}"] = float(cat.max())
            out[f"angle_mean_deg/{x}"] = float(cat.mean())
        self._prev = None
        return out


class StepMovement(MetricHook):
    r"""Per-step movement of the query/key projections, from every optimizer step.

    With :math:`\Delta_t W` the change of a projection in optimizer step :math:`t` and the norm taken over every
    layer and head together, the record of an evaluation holds, for :math:`X \in \{q, k\}` and the :math:`T`
    steps measured since the previous evaluation,

    - ``move_step_rms/X`` :math:`= \big(\frac1T \sum_t \|\Delta_t W_X\|_F^2\big)^{1/2}`,
    - ``move_step_rel_rms/X``: the same with each step divided by the current :math:`\|W_X\|_F`,
    - ``move_steps``: :math:`T` (``None`` and 0 at epoch 0 and for projections without a gradient).

    The change is read by a post-accumulate-grad hook on each projection: at the backward pass of step
    :math:`t+1` the parameter holds the result of step :math:`t`, so the last step before an evaluation is
    counted in the next window (and the first step after a resume is not counted).

    Parameters
    ----------
    qk : callable
        ``qk(model) -> [(path, w_q, w_k), ...]``, e.g. :func:`geoopt_stiefel_attention.nn.query_key_projections`.
    """

    def __init__(self, qk) -> None:
        self.qk = qk
        self._prev: dict[tuple[str, int], torch.Tensor] = {}
        self._sq: dict[tuple[str, int], torch.Tensor] = {}
        self._rel: dict[tuple[str, int], torch.Tensor] = {}
        self._count: dict[tuple[str, int], int] = {}
        self._keys: dict[str, list[tuple[str, int]]] = {"q": [], "k": []}
        self._handles: list[Any] = []

    def on_start(self, model: torch.nn.Module) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._prev, self._keys = [], {}, {"q": [], "k": []}
        self._reset()
        for i, (_, wq, wk) in enumerate(self.qk(model)):
            for x, w in (("q", wq), ("k", wk)):
                if w.requires_grad:
                    key = (x, i)
                    self._keys[x].append(key)
                    self._handles.append(w.register_post_accumulate_grad_hook(functools.partial(self._seen, key)))

    def _reset(self) -> None:
        self._sq, self._rel, self._count = {}, {}, {}

    @torch.no_grad()
    def _seen(self, key: tuple[str, int], param: torch.Tensor) -> None:
        now = param.detach().to(torch.float32).clone()
        prev = self._prev.get(key)
        self._prev[key] = now
        if prev is None:
            return
        sq = (now - prev).square().sum()
        self._sq[key] = self._sq.get(key, 0.0) + sq
        self._rel[key] = self._rel.get(key, 0.0) + sq / now.square().sum().clamp_min(1e-30)
        self._count[key] = self._count.get(key, 0) + 1

    def metrics(self, model: torch.nn.Module) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        steps = 0
        for x, keys in self._keys.items():
            counts = [self._count.get(k, 0) for k in keys]
            if not keys or min(counts) == 0:
                out[f"move_step_rms/{x}"] = out[f"move_step_rel_rms/{x}"] = None
                continue
            steps = max(steps, min(counts))
            out[f"move_step_rms/{x}"] = math.sqrt(sum(float(self._sq[k]) / self._count[k] for k in keys))
            # relative: mean over layers of each layer's squared relative step, as one rms number
            out[f"move_step_rel_rms/{x}"] = math.sqrt(sum(float(self._rel[k]) / self._count[k] for k in keys)
                                                      / len(keys))
        out["move_steps"] = steps
        self._reset()
        return out
