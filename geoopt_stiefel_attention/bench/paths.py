"""The step-path benchmark (``stiefel-attention bench paths``): the StiefelAdam step's own paths (default,
capturable, compiled; row- and column-major frames; batched or per parameter) against the matrix-product floor."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._docfrag import fill
from .records import Timing
from .settings import (
    DISAGREEMENT_NOTE,
    BenchSettings,
    _interleave,
    _ratio,
    _settings,
    _state_bytes,
    _synchronize,
    _timing,
    _workspace_bytes,
    ratio_disagrees,
    torch_threads,
)
from .step import _matmul_floor


# ----------------------------------------------------------------------------------------------- step paths
@dataclass(frozen=True)
class FrameSet:
    r"""``params`` frame parameters of shape ``(heads, d, r)``: ``params * heads`` frames of ``St(d, r)``.

    Attributes
    ----------
    params : int
        Number of frame parameters.
    heads : int
        Frames per parameter.
    d, r : int
        Shape of each frame, :math:`\mathrm{St}(d, r)` with :math:`r \le d`.
    """

    params: int
    heads: int
    d: int
    r: int

    def __post_init__(self) -> None:
        for name in ("params", "heads", "d", "r"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"bench: FrameSet {name}={value!r} must be a positive int.")
        if self.r > self.d:
            raise ValueError(f"bench: FrameSet r={self.r} exceeds d={self.d}; a frame needs r <= d.")

    @property
    def label(self) -> str:
        return f"{self.params} x ({self.heads}, {self.d}, {self.r})"


#: The bench shape of issue #18: 12 layers x (W_Q, W_K) x 8 heads of 512 x 64 frames.
BENCH_FRAMES = FrameSet(params=24, heads=8, d=512, r=64)
#: Widths and ranks of the ``grid="full"`` sweep (24 parameters of 8 heads each, like the bench shape).
GRID_WIDTHS = (128, 256, 512, 1024)
GRID_RANKS = (32, 64, 128)

#: What :func:`step_path_benchmark` times, in display order: the step's paths and the matrix-product floor.
#: ``-colmajor``: the same frames stored column-major (the layout ``torch.linalg.qr(...).Q`` returns).
STEP_PATHS = ("eager", "capturable", "compiled", "eager-colmajor", "capturable-colmajor", "eager-per-param",
              "matmul_floor")
GRIDS = ("short", "full")


def path_frame_sets(grid: str = "short") -> list[FrameSet]:
    """``"short"``: the bench shape alone; ``"full"``: the bench shape, then 24 parameters of 8 heads of
    ``d x r`` frames for ``d`` in :data:`GRID_WIDTHS` and ``r`` in :data:`GRID_RANKS` (``r < d``; the bench
    shape once).

    Parameters
    ----------
    grid : {"short", "full"}, default "short"
        One of :data:`GRIDS`.

    Returns
    -------
    list of FrameSet
        The frame sets, the bench shape first.
    """
    if grid not in GRIDS:
        raise ValueError(f"bench: grid={grid!r} is unknown; use one of {GRIDS}.")
    sets = [BENCH_FRAMES]
    if grid == "full":
        grid_sets = (FrameSet(24, 8, d, r) for d in GRID_WIDTHS for r in GRID_RANKS if r < d)
        sets += [fs for fs in grid_sets if fs != BENCH_FRAMES]
    return sets


@fill
@dataclass(frozen=True)
class StepPathResult:
    """:func:`step_path_benchmark` for one :class:`FrameSet`.

    ``floor_ratio[path]`` is the path's step time over the matrix-product floor's (median over rounds of the
    per-round ratio of medians); ``compile_s`` the seconds the compiled path's first steps took (compilation;
    excluded from its timing), ``None`` without that path.

    Attributes
    ----------
    frames : FrameSet
        The frames stepped.
    dtype, device : str
        Of the frames.
    timings : dict of str to Timing
        Per path.
    floor_ratio : dict of str to float
        Per path other than the floor, as above.
    compile_s : float or None
        As above.
    compile_backend : str or None
        ``torch.compile`` backend of the compiled path; ``None`` without that path.
    {{timing_run}}
    """

    frames: FrameSet
    dtype: str
    device: str
    timings: dict[str, Timing]
    floor_ratio: dict[str, float]
    compile_s: float | None
    compile_backend: str | None
    rounds: int
    clock: str
    threads: int


def _path_steps(fs: FrameSet, *, paths: tuple[str, ...], lr: float, dtype: Any, device: str, seed: int,
                compile_backend: str) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], float | None]:
    """Each path's step on its own copy of the same frames and gradients; compiles the compiled path (its
    first three calls, timed and returned) so that its timed steps exclude compilation."""
    import geoopt
    import torch

    from ..manifolds import PolarStiefel
    from ..optim import StiefelAdam

    gen = torch.Generator().manual_seed(seed)
    st = PolarStiefel()
    shape = (fs.heads, fs.d, fs.r)
    start = [st.random(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
             for _ in range(fs.params)]
    grads = [(1e-2 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)
             for _ in range(fs.params)]

    def frames(column_major: bool) -> list[torch.Tensor]:
        def layout(t: torch.Tensor) -> torch.Tensor:  # column-major: strides (d r, 1, d), as linalg.qr's Q
            return t.mT.contiguous().mT if column_major else t.clone()

        out = []
        for w, g in zip(start, grads, strict=True):
            p = geoopt.ManifoldParameter(layout(w), manifold=PolarStiefel())
            p.grad = layout(g)
            out.append(p)
        return out

    steps: dict[str, Callable[[], Any]] = {}
    opts: dict[str, Any] = {}
    compile_s = None
    for path in paths:
        if path not in STEP_PATHS:
            raise ValueError(f"bench: path {path!r} is unknown; use any of {STEP_PATHS}.")
        if path == "matmul_floor":
            steps[path] = _matmul_floor(frames(False), [1] * fs.params)
            continue
        capturable = None if path.startswith("eager") else True  # None: the device's default (False on CPU)
        opts[path] = StiefelAdam(frames(path.endswith("-colmajor")), lr=lr, capturable=capturable)
        if path == "eager-per-param":  # one update call per parameter: what batching saves
            opts[path]._stack_numel = 1
        steps[path] = opts[path].step
        if path == "compiled":
            steps[path] = torch.compile(opts[path].step, backend=compile_backend)
            t0 = time.perf_counter()
            for _ in range(3):  # the first step creates the state; the next ones run the steady-state graph
                steps[path]()
            _synchronize(device)
            compile_s = time.perf_counter() - t0
    return steps, opts, compile_s


def step_path_benchmark(
    frame_sets: list[FrameSet] | None = None,
    *,
    paths: tuple[str, ...] = STEP_PATHS,
    compile_backend: str = "inductor",
    settings: BenchSettings | None = None,
    **overrides: Any,
) -> list[StepPathResult]:
    """Time the paths of one :class:`~geoopt_stiefel_attention.StiefelAdam` step against the six batched
    ``d x r x r`` products alone (``"matmul_floor"``, see :func:`_matmul_floor`), every path in one process.

    Paths (:data:`STEP_PATHS`): ``"eager"``, the default path (``capturable=None``: the host-reading path on
    the CPU, the capturable one on accelerators); ``"capturable"``, ``capturable=True`` (step counts as
    tensors, no host read: the path a GPU runs, selectable on the CPU); ``"compiled"``,
    ``torch.compile(opt.step, backend=compile_backend)`` of a capturable optimizer, timed after its first
    three (compiling) calls; ``"eager-colmajor"`` and ``"capturable-colmajor"``, the same frames stored
    column-major, as ``torch.linalg.qr(...).Q`` returns them; ``"eager-per-param"``, the default path with one
    update call per parameter instead of one per batch of same-shaped parameters (on an accelerator the batches
    span up to :data:`~geoopt_stiefel_attention.optim.ACCELERATOR_STACK_NUMEL` elements, on the CPU
    :data:`~geoopt_stiefel_attention.optim.STACK_NUMEL`). ``"matmul_floor"`` must be among the paths.

    Parameters
    ----------
    frame_sets : list of FrameSet, optional
        Default ``[BENCH_FRAMES]`` (:func:`path_frame_sets`).
    paths : tuple of str
        Any of :data:`STEP_PATHS`.
    compile_backend : str, default "inductor"
        ``torch.compile`` backend of the compiled path (``"aot_eager"`` traces without generating code).
    settings : BenchSettings, optional
        Default ``BENCH_DEFAULTS["paths"]``; with ``**overrides`` as in :func:`step_time_benchmark`.
    **overrides
        Fields of :class:`BenchSettings` replacing those of ``settings`` (``rounds=3``, ``clock="cpu"``).

    Returns
    -------
    list of StepPathResult
        One per frame set, in the order given.
    """
    import torch

    s = _settings("paths", settings, overrides)
    if "matmul_floor" not in paths:
        raise ValueError("bench: paths must include 'matmul_floor' (every ratio is relative to it).")
    frame_sets = [BENCH_FRAMES] if frame_sets is None else frame_sets
    with torch_threads(s.threads):
        results = []
        for fs in frame_sets:
            steps, opts, compile_s = _path_steps(fs, paths=paths, lr=s.lr, dtype=getattr(torch, s.dtype),
                                                 device=s.device, seed=s.seed, compile_backend=compile_backend)
            samples, _ = _interleave(steps, s, required=tuple(steps))
            timings = {}
            for path in samples:
                timings[path] = _timing(path, samples[path], state_bytes=_state_bytes(opts[path]) if path in opts else None,
                                       workspace_bytes=_workspace_bytes(opts.get(path)))
            results.append(StepPathResult(
                frames=fs, dtype=s.dtype, device=s.device, timings=timings,
                floor_ratio={path: _ratio(samples[path], samples["matmul_floor"]) for path in samples
                             if path != "matmul_floor"},
                compile_s=compile_s, compile_backend=compile_backend if "compiled" in paths else None,
                rounds=s.rounds, clock=s.clock, threads=torch.get_num_threads()))
            del steps, opts
            torch._dynamo.reset()  # each frame set compiles its own step; drop the last one's graphs
        return results


@fill
def format_path_table(results: list[StepPathResult]) -> str:
    """A Markdown table: per frame set, each path's median step time and its ratio to the product floor.

    Parameters
    ----------
    results : list of StepPathResult
        From :func:`step_path_benchmark`.

    {{returns_table}}
    """
    timed = [a for a in STEP_PATHS if a != "matmul_floor" and any(a in r.timings for r in results)]
    head = ["frames (params x (heads, d, r))", "floor ms"] + [f"{a} ms (x floor)" for a in timed]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flagged = False
    for r in results:
        floor = r.timings["matmul_floor"].median_ms
        row = [r.frames.label, f"{floor:.3f}"]
        for a in timed:
            if a not in r.timings:
                row.append("n/a")
                continue
            flag = "†" if ratio_disagrees(r.timings[a].median_ms, floor, r.floor_ratio[a]) else ""
            flagged = flagged or bool(flag)
            row.append(f"{r.timings[a].median_ms:.3f} ({r.floor_ratio[a]:.2f}{flag})")
        lines.append("| " + " | ".join(row) + " |")
    compiled = [f"{r.frames.label}: {r.compile_s:.1f} s" for r in results if r.compile_s is not None]
    if compiled:
        lines += ["", f"Compilation ({results[0].compile_backend}; first three calls, excluded): "
                      + ", ".join(compiled)]
    if flagged:
        lines += ["", DISAGREEMENT_NOTE]
    return "\n".join(lines)


