"""The optimizer step-time benchmark (``stiefel-attention bench step``): one optimizer step on the
query/key frames of transformer configurations, StiefelAdam against AdamW, stock geoopt and the matrix-product
floor."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._docfrag import fill
from .records import Timing
from .settings import (
    DISAGREEMENT_NOTE,
    BenchSettings,
    _clock,
    _interleave,
    _ratio,
    _settings,
    _state_bytes,
    _timing,
    _workspace_bytes,
    ratio_disagrees,
    torch_threads,
)

#: Benchmark configurations, width -> (depth, heads); head_dim = width // heads, one frame per head.
CONFIGS: dict[int, tuple[int, int]] = {128: (2, 4), 256: (4, 4), 512: (8, 8), 768: (12, 12)}

#: What :func:`step_time_benchmark` times, in display order: StiefelAdam, its competitors and the matrix-product
#: floor (not an optimizer, but timed beside them under the same name: the benchmark's word is "optimizer").
STEP_OPTIMIZERS = ("stiefel", "adamw_foreach", "adamw_fused", "geoopt-radam", "geoopt-radam-canonical", "matmul_floor")


@fill
@dataclass(frozen=True)
class StepTimeResult:
    """:func:`step_time_benchmark` for one configuration.

    ``ratios[name]`` is StiefelAdam's time over optimizer ``name``'s (median over rounds), so ``ratios["adamw_foreach"]``
    below 1.5 meets the AdamW target, ``ratios["matmul_floor"]`` below 1.3 the floor target, and
    ``1 / ratios["geoopt-radam"]`` is the speed-up over stock geoopt. ``state_ratio`` is optimizer-state
    bytes over parameter bytes per optimizer.

    Attributes
    ----------
    width, depth, heads, head_dim : int
        The configuration: model width, layers, heads and head size (``width // heads``).
    frames : int
        Frames stepped (``2 * depth * heads``).
    param_bytes : int
        Bytes of the frame parameters.
    dtype : str
        Of the parameters.
    timings : dict of str to Timing
        Per optimizer.
    ratios, state_ratio : dict of str to float
        As above.
    {{timing_run}}
    """

    width: int
    depth: int
    heads: int
    head_dim: int
    frames: int
    param_bytes: int
    dtype: str
    timings: dict[str, Timing]
    ratios: dict[str, float]
    state_ratio: dict[str, float]
    rounds: int
    clock: str
    threads: int

# ----------------------------------------------------------------------------------------------- step time
def frame_shapes(width: int, depth: int, heads: int) -> list[tuple[int, int, int]]:
    """Shapes of the query/key projections of a ``depth``-layer model, one frame per head: ``2 * depth``
    parameters of shape ``(heads, width, width // heads)``.

    Parameters
    ----------
    width : int
        Model width :math:`d`.
    depth : int
        Layers.
    heads : int
        Heads per layer, dividing ``width``.

    Returns
    -------
    list of (int, int, int)
        ``2 * depth`` copies of ``(heads, width, width // heads)``.
    """
    if width % heads:
        raise ValueError(f"bench: width={width} is not a multiple of heads={heads}; pick heads dividing width.")
    return [(heads, width, width // heads)] * (2 * depth)


def _matmul_floor(params: list[Any], steps: list[int]) -> Callable[[], None]:
    """The six ``d x r x r`` products of a StiefelAdam step, batched as StiefelAdam batches ``params``, on
    preallocated tensors of the same shapes, with the same destinations (``out=`` / ``baddbmm``), in the dtype
    the step computes in (float32 for bfloat16 and float16 frames)."""
    import torch

    from .._linalg import compute_dtype
    from ..optim._batching import _frame_batches

    gen = torch.Generator(device=params[0].device).manual_seed(0)
    work = []
    for _, batch in _frame_batches(params, steps):
        d, r = batch[0].shape[-2:]
        n = sum(p.numel() for p in batch) // (d * r)
        like = dict(dtype=compute_dtype(batch[0].dtype), device=batch[0].device, generator=gen)
        w, g, m = (torch.randn(n, d, r, **like) for _ in range(3))
        x = torch.randn(n, r, r, **like)
        y, w_new, m_new = (torch.empty_like(w) for _ in range(3))  # separate outputs: no feedback between runs
        work.append((w, g, m, x, y, w_new, m_new))

    def run() -> None:
        for w, g, m, x, y, w_new, m_new in work:
            a = torch.bmm(w.mT, g)  # W^T G
            torch.baddbmm(g, w, a, alpha=-0.5, out=y)  # G - W S
            torch.bmm(y.mT, y)  # Gram of W - s
            torch.bmm(y, x, out=w_new)  # (W - s) X
            b = torch.bmm(w_new.mT, m)  # W+^T m
            torch.baddbmm(m, w_new, b, alpha=-0.5, out=m_new)  # m - W+ S'

    return run


def _optimizer_steps(shapes: list[tuple[int, ...]], *, optimizers: tuple[str, ...], lr: float, dtype: Any,
                     device: str, seed: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], dict[str, str]]:
    """Build each optimizer's step function on its own copy of the same frames and gradients."""
    import geoopt
    import torch

    from ..manifolds import PolarStiefel
    from ..optim import StiefelAdam

    gen = torch.Generator().manual_seed(seed)
    st = PolarStiefel()
    start = [st.random(*s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in shapes]
    grads = [(1e-2 * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)
             for s in shapes]

    def params(manifold: Any | None) -> list[torch.Tensor]:
        out = []
        for w, g in zip(start, grads, strict=True):
            p = (torch.nn.Parameter(w.clone()) if manifold is None
                 else geoopt.ManifoldParameter(w.clone(), manifold=manifold))
            p.grad = g.clone()
            out.append(p)
        return out

    steps: dict[str, Callable[[], Any]] = {}
    opts: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for name in optimizers:
        if name == "stiefel":
            opts[name] = StiefelAdam(params(PolarStiefel()), lr=lr)
        elif name == "adamw_foreach":
            opts[name] = torch.optim.AdamW(params(None), lr=lr, weight_decay=0.0, foreach=True)
        elif name == "adamw_fused":
            try:
                opts[name] = torch.optim.AdamW(params(None), lr=lr, weight_decay=0.0, fused=True)
                opts[name].step()
            except (RuntimeError, ValueError) as exc:  # fused AdamW is not built for every device and dtype
                notes[name] = f"unavailable: {exc}".splitlines()[0][:120]
                opts.pop(name)
                continue
        elif name == "geoopt-radam":
            opts[name] = geoopt.optim.RiemannianAdam(params(geoopt.EuclideanStiefel()), lr=lr)
        elif name == "geoopt-radam-canonical":
            opts[name] = geoopt.optim.RiemannianAdam(params(geoopt.Stiefel()), lr=lr)
        elif name == "matmul_floor":
            continue
        else:
            raise ValueError(f"bench: optimizer {name!r} is unknown; use any of {STEP_OPTIMIZERS}.")
        steps[name] = opts[name].step
    if "matmul_floor" in optimizers:
        frames = params(PolarStiefel())
        steps["matmul_floor"] = _matmul_floor(frames, [1] * len(frames))
    return steps, opts, notes


def step_time_benchmark(
    widths: tuple[int, ...] = tuple(CONFIGS),
    *,
    optimizers: tuple[str, ...] = STEP_OPTIMIZERS,
    configs: dict[int, tuple[int, int]] | None = None,
    settings: BenchSettings | None = None,
    **overrides: Any,
) -> list[StepTimeResult]:
    """Time one optimizer step on the query/key frames of each configuration, every optimizer in one
    process.

    Parameters
    ----------
    widths : tuple of int
        Keys of ``configs`` (default :data:`CONFIGS`: 128, 256, 512, 768).
    optimizers : tuple of str
        Any of :data:`STEP_OPTIMIZERS`; ``"stiefel"`` must be among them (the ratios are relative to it).
    configs : dict, optional
        ``width -> (depth, heads)``; defaults to :data:`CONFIGS`.
    settings : BenchSettings, optional
        Protocol, lr, dtype, device, clock, threads and seed; default ``BENCH_DEFAULTS["step"]``. Optimizers slower
        than 0.25 s per step (geoopt's canonical Stiefel at large widths) run one step per round.
    **overrides
        Fields of :class:`BenchSettings` replacing those of ``settings`` (``rounds=3``, ``clock="cpu"``).

    Returns
    -------
    list of StepTimeResult
        One per width, in the order given.
    """
    import torch

    s = _settings("step", settings, overrides)
    _clock(s.clock)  # an unknown clock is refused before anything is built
    configs = CONFIGS if configs is None else configs
    if "stiefel" not in optimizers:
        raise ValueError("bench: optimizers must include 'stiefel' (every ratio is relative to it).")
    bad = [w for w in widths if w not in configs]
    if bad:
        raise ValueError(f"bench: widths {bad} have no configuration; choose from {sorted(configs)} or pass configs.")
    with torch_threads(s.threads):
        results = []
        for width in widths:
            depth, heads = configs[width]
            shapes = frame_shapes(width, depth, heads)
            tdtype = getattr(torch, s.dtype)
            steps, opts, notes = _optimizer_steps(shapes, optimizers=optimizers, lr=s.lr, dtype=tdtype,
                                                  device=s.device, seed=s.seed)
            samples, failed = _interleave(steps, s, required=("stiefel",))
            notes.update(failed)
            param_bytes = sum(math.prod(s) for s in shapes) * torch.tensor([], dtype=tdtype).element_size()
            timings, state_ratio = {}, {}
            for name in samples:
                state = workspace = None
                if name in opts:
                    state = _state_bytes(opts[name])
                    state_ratio[name] = state / param_bytes
                    workspace = _workspace_bytes(opts[name])
                timings[name] = _timing(name, samples[name], state_bytes=state, workspace_bytes=workspace,
                                       note=notes.get(name, ""))
            for name, note in notes.items():
                timings[name] = Timing(name=name, median_ms=math.nan, q1_ms=math.nan, q3_ms=math.nan, steps=0,
                                         note=note)
            ratios = {name: _ratio(samples["stiefel"], samples[name]) for name in samples if name != "stiefel"}
            results.append(StepTimeResult(
                width=width, depth=depth, heads=heads, head_dim=width // heads, frames=len(shapes) * heads,
                param_bytes=param_bytes, dtype=s.dtype, timings=timings, ratios=ratios, state_ratio=state_ratio,
                rounds=s.rounds, clock=s.clock, threads=torch.get_num_threads()))
            del steps, opts
        return results


# ----------------------------------------------------------------------------------------------- rendering
_OPTIMIZER_LABELS = {
    "adamw_foreach": "AdamW foreach",
    "adamw_fused": "AdamW fused",
    "geoopt-radam": "geoopt-radam",
    "geoopt-radam-canonical": "geoopt-radam-canonical",
    "matmul_floor": "matmul floor",
}


@fill
def format_step_table(results: list[StepTimeResult]) -> str:
    """A Markdown table: StiefelAdam's median step time, and for each competitor its time and the ratio
    (StiefelAdam / competitor for AdamW and the floor; competitor / StiefelAdam, the speed-up, for geoopt).

    Parameters
    ----------
    results : list of StepTimeResult
        From :func:`step_time_benchmark`.

    {{returns_table}}
    """
    competitors = [a for a in STEP_OPTIMIZERS if a != "stiefel" and any(a in r.timings for r in results)]
    head = ["width (layers x heads x head_dim)", "StiefelAdam ms"]
    for name in competitors:
        label = _OPTIMIZER_LABELS[name]
        head += [f"{label} ms", f"speed-up vs {label}" if name.startswith("geoopt") else f"x {label}"]
    head += ["state / params (StiefelAdam, AdamW)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flagged = False
    for r in results:
        row = [f"{r.width} ({r.depth} x {r.heads} x {r.head_dim})", f"{r.timings['stiefel'].median_ms:.3f}"]
        for name in competitors:
            t = r.timings.get(name)
            if t is None or name not in r.ratios:
                row += ["n/a", "n/a"]
                continue
            ratio = r.ratios[name]
            flag = "†" if ratio_disagrees(r.timings["stiefel"].median_ms, t.median_ms, ratio) else ""
            flagged = flagged or bool(flag)
            row += [f"{t.median_ms:.3f}", (f"{1 / ratio:.1f}x" if name.startswith("geoopt") else f"{ratio:.2f}") + flag]
        stiefel, adamw = r.state_ratio.get("stiefel"), r.state_ratio.get("adamw_foreach")
        row += [f"{'n/a' if stiefel is None else f'{stiefel:.4f}'}, {'n/a' if adamw is None else f'{adamw:.2f}'}"]
        lines.append("| " + " | ".join(row) + " |")
    notes = [f"- width {r.width}, {_OPTIMIZER_LABELS.get(t.name, t.name)}: {t.note}" for r in results
             for t in r.timings.values() if t.note]
    if flagged:
        notes.append(DISAGREEMENT_NOTE)
    return "\n".join(lines + ([""] + notes if notes else []))
