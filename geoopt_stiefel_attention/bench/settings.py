"""What every benchmark shares: :class:`BenchSettings` and each benchmark's defaults, and the interleaving
protocol (see :mod:`geoopt_stiefel_attention.bench`): clocks, :func:`_interleave`, per-step statistics, thread
count, optimizer-state bytes."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

from .records import Timing

CLOCKS = ("wall", "cpu")

@dataclass(frozen=True)
class BenchSettings:
    """The settings every benchmark shares: the interleaving protocol (see the module docstring), the
    optimizers' learning rate, and where and how the benchmark runs.

    Each benchmark takes ``settings=`` (default: its entry of :data:`BENCH_DEFAULTS`) and accepts any of these
    fields as a keyword too, which replaces the field (``step_time_benchmark(rounds=3)``).

    Attributes
    ----------
    rounds, steps_per_round, warmup : int
        Interleaved rounds, timed steps per entry and round (one for entries slower than 0.25 s per step),
        untimed steps per entry before the first round. An entry is what a benchmark times: an optimizer
        (``step``), a path of the step (``paths``), a study arm (``train``).
    lr : float
        Learning rate of every optimizer (1e-3: a typical value; with it a StiefelAdam step is far inside its
        trust region, and on CPU the retraction's series has order 1).
    dtype : str
        Of the parameters of :func:`step_time_benchmark` and :func:`step_path_benchmark`;
        :func:`train_step_benchmark` trains float32 parameters (mixed precision: its ``autocast``).
    device : str
        Torch device of the parameters.
    clock : {"wall", "cpu"}
        Wall time, or the process's CPU time (robust to other processes on a shared machine); ``"cpu"`` needs one
        thread (``threads=1``; refused on more: CPU time sums the threads).
    threads : int or None
        ``torch.set_num_threads`` for the run (restored afterwards); ``None`` keeps the current setting.
    seed : int
        Seed of the parameters, gradients and data (each entry gets identical copies).
    """

    rounds: int = 7
    steps_per_round: int = 5
    warmup: int = 3
    lr: float = 1e-3
    dtype: str = "float32"
    device: str = "cpu"
    clock: str = "wall"
    threads: int | None = None
    seed: int = 0


#: Default :class:`BenchSettings` of each benchmark (``stiefel-attention bench step|train|paths``).
BENCH_DEFAULTS: dict[str, BenchSettings] = {
    "step": BenchSettings(steps_per_round=5, warmup=3),
    "train": BenchSettings(steps_per_round=3, warmup=2),
    "paths": BenchSettings(steps_per_round=5, warmup=3),
}


def _settings(benchmark: str, settings: BenchSettings | None, overrides: dict[str, Any]) -> BenchSettings:
    """``settings`` (default ``BENCH_DEFAULTS[benchmark]``) with the fields named in ``overrides`` replaced."""
    names = {f.name for f in fields(BenchSettings)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"bench: {', '.join(unknown)} is not a benchmark setting; use any of {sorted(names)}.")
    return replace(BENCH_DEFAULTS[benchmark] if settings is None else settings, **overrides)


_SLOW_STEP_S = 0.25  # an entry whose warm-up step takes longer runs one step per round


# ----------------------------------------------------------------------------------------------- timing
def _clock(clock: str) -> Callable[[], float]:
    if clock not in CLOCKS:
        raise ValueError(f"bench: clock={clock!r} is unknown; use one of {CLOCKS}.")
    return time.perf_counter if clock == "wall" else time.process_time


def _check_cpu_clock_threads(clock: str) -> None:
    """Refuse ``clock="cpu"`` on more than one intra-op thread: the process's CPU time sums every thread's, so an
    entry that runs on two threads is charged twice its wall time and one that runs on one is not, and a ratio
    between them is neither their wall-time ratio nor stated as anything else."""
    import torch

    threads = torch.get_num_threads()
    if clock == "cpu" and threads > 1:
        raise ValueError(f"bench: clock='cpu' on {threads} threads: process CPU time sums the threads' times, so "
                         f"ratios between entries that parallelise differently are not wall-time ratios; use "
                         f"threads=1 with clock='cpu', or clock='wall'.")


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _interleave(steps: dict[str, Callable[[], Any]], settings: BenchSettings, *, warmup: int | None = None,
                required: tuple[str, ...] = ()) -> tuple[dict[str, list[list[float]]], dict[str, str]]:
    """Run every entry of ``steps`` (name -> step function) ``warmup`` times (default ``settings.warmup``), then
    ``settings.rounds`` rounds of ``settings.steps_per_round`` timed steps per entry (one step for entries slower
    than ``_SLOW_STEP_S``), rotating the order each round, timed with ``settings.clock`` on ``settings.device``.

    Returns the per-round lists of step times (seconds) of each entry that completed, and a note for each entry
    that raised (a competitor's bug must not abort the whole benchmark; an entry in ``required`` re-raises).
    """
    warmup = settings.warmup if warmup is None else warmup
    rounds, steps_per_round, device = settings.rounds, settings.steps_per_round, settings.device
    now = _clock(settings.clock)
    _check_cpu_clock_threads(settings.clock)
    per_round, failed = {}, {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        try:
            for _ in range(max(warmup, 1)):
                fn()
            _synchronize(device)
        except Exception as exc:  # noqa: BLE001 - reported in the result, see the docstring
            if name in required:
                raise
            failed[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:160]
            continue
        slow = (time.perf_counter() - t0) / max(warmup, 1) > _SLOW_STEP_S
        per_round[name] = 1 if slow else steps_per_round
    names = [name for name in steps if name not in failed]
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for k in range(rounds):
        order = names[k % len(names):] + names[: k % len(names)]
        for name in order:
            if name in failed:
                continue
            fn, times = steps[name], []
            try:
                for _ in range(per_round[name]):
                    _synchronize(device)
                    t0 = now()
                    fn()
                    _synchronize(device)
                    times.append(now() - t0)
            except Exception as exc:  # noqa: BLE001
                if name in required:
                    raise
                failed[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:160]
                continue
            samples[name].append(times)
    return {name: t for name, t in samples.items() if name not in failed}, failed


def _timing(name: str, rounds: list[list[float]], **extra: Any) -> Timing:
    flat = sorted(t for r in rounds for t in r)
    q = statistics.quantiles(flat, n=4) if len(flat) > 1 else [flat[0]] * 3
    return Timing(name=name, median_ms=1e3 * statistics.median(flat), q1_ms=1e3 * q[0], q3_ms=1e3 * q[2],
                     steps=len(flat), **extra)


def _ratio(num: list[list[float]], den: list[list[float]]) -> float:
    """Median over rounds of the ratio of per-round medians."""
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(num, den, strict=True))


#: Largest relative disagreement between a reported ratio (median over rounds of per-round ratios) and the ratio
#: of the two medians printed beside it before the row is flagged as unreliable (:func:`ratio_disagrees`). On a
#: quiet machine the two agree to a few percent; a row such as "99.97 ms | 15.8 ms | speed-up 10.0x" (seen with
#: torch's default thread count on a loaded 2-core machine) is off by a factor of 1.6.
RATIO_AGREEMENT = 0.25

#: The note printed under a table with flagged rows.
DISAGREEMENT_NOTE = (
    "† the ratio (median over interleaved rounds of per-round ratios) and the two medians beside it disagree by "
    f"more than {RATIO_AGREEMENT:.0%}: the machine's load changed during the measurement, so this row is not "
    "reliable; rerun it with --threads 1 --clock cpu on a quieter machine.")


def ratio_disagrees(num_ms: float, den_ms: float, ratio: float) -> bool:
    """Whether ``ratio`` and ``num_ms / den_ms`` differ by more than :data:`RATIO_AGREEMENT` (relative, either
    way); non-finite or non-positive inputs count as disagreeing."""
    values = (num_ms, den_ms, ratio)
    if not all(math.isfinite(v) and v > 0 for v in values):
        return True
    return abs(math.log((num_ms / den_ms) / ratio)) > math.log1p(RATIO_AGREEMENT)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block (``None``: unchanged), the previous count restored.

    Parameters
    ----------
    threads : int or None
        Threads inside the block; ``None`` leaves the count as it is.

    Yields
    ------
    None
        Control, once, with the count set.
    """
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _workspace_bytes(opt: Any) -> int | None:
    """Bytes of an optimizer's step workspaces (StiefelAdam's ``_workspaces``), ``None`` when it keeps none."""
    ws = getattr(opt, "_workspaces", None)
    return None if ws is None else sum(b.numel() * b.element_size() for b in ws.values())


def _state_bytes(opt: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))

