r"""The parallel runner of a study's (arm, seed) jobs: how to run them (:class:`RunOptions`), and
:func:`run_jobs` / :func:`run_placed_jobs`, which call :func:`~.runner.train_run` once per job, in this process or
in ``options.workers`` spawned ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .arms import check_arm
from .config import RunSpec
from .run_folder import check_run_dir
from .runner import RunResult, TaskBuilder, _progress_keys, train_run

__all__ = ["RunOptions", "check_placed_jobs", "epochs_per_second", "run_jobs", "run_placed_jobs"]

def _job(args: tuple) -> RunResult:
    spec, build_task, run_dir, kwargs = args
    return train_run(spec, build_task, run_dir, **kwargs)


@dataclass(frozen=True)
class RunOptions:
    """How to run a study's jobs: the six running flags, made once from the command line and passed down.

    Parameters
    ----------
    workers : int
        Runs trained at the same time, in separate processes when more than one.
    device : str
        ``"auto"`` (CUDA when present, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    threads : int or None
        torch threads per run (``None``: torch's choice for one worker, else ``cpu_count // workers``).
    quiet : bool
        No progress bars.
    stop_after_epochs : int or None
        Train at most this many epochs per run in this call, then checkpoint and stop.
    checkpoint_interval_s : float
        Least seconds between two checkpoints (one is always written at the end).
    """

    workers: int = 1
    device: str = "auto"
    threads: int | None = None
    quiet: bool = False
    stop_after_epochs: int | None = None
    checkpoint_interval_s: float = 30.0

    @classmethod
    def from_args(cls, args: Any) -> RunOptions:
        """The options of a parsed study command (``--workers`` ... ``--checkpoint-interval``)."""
        return cls(workers=args.workers, device=args.device, threads=args.threads, quiet=args.quiet,
                   stop_after_epochs=args.stop_after_epochs, checkpoint_interval_s=args.checkpoint_interval)

    @classmethod
    def of(cls, options: RunOptions | None = None, **kwargs: Any) -> RunOptions:
        """``options`` with any option given by keyword (the older keyword form) replaced."""
        return dataclasses.replace(options or cls(), **kwargs)


def run_jobs(specs: Sequence[RunSpec], build_task: TaskBuilder, out_dir: str | os.PathLike,
             options: RunOptions | None = None, **kwargs: Any) -> list[RunResult]:
    """Run (or resume) every spec, each in ``out_dir/runs/<arm>/seed<k>``, ``options.workers`` at a time.

    With ``workers > 1`` the runs go to separate processes (``spawn``); ``build_task`` must then be a
    module-level function. ``threads=None`` gives each process ``max(1, cpu_count // workers)`` threads when
    ``workers > 1`` and leaves torch's default otherwise. Per-run progress bars are shown for ``workers=1``;
    with more workers one bar counts finished runs. The options may also be given one by one as keywords
    (``workers=2, device="cpu"``), which replace those of ``options``.

    Returns
    -------
    list of RunResult
        In the order of ``specs``.
    """
    options = RunOptions.of(options, **kwargs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"run_jobs: duplicate (arm, seed) jobs in {names}; each arm/seed pair must appear once.")
    out_dir = Path(out_dir)
    return run_placed_jobs([(s, out_dir / "runs" / s.name) for s in specs], build_task, options)


def check_placed_jobs(placed: Sequence[tuple[RunSpec, Path]]) -> None:
    """Refuse, before any work, ``(spec, run_dir)`` pairs of which two share a folder, name an unknown arm, or
    place a run in a folder that holds another run (:func:`check_run_dir`)."""
    folders = [Path(d).resolve() for _, d in placed]
    if len(set(folders)) != len(folders):
        raise ValueError(f"run_jobs: two runs share a folder in {[str(d) for d in folders]}; each run needs its own.")
    for s, d in placed:
        check_arm(s.arm, s.experiment, getattr(s.config, "optim", None))  # fail before any work on an unknown arm
        check_run_dir(Path(d), s)  # ... or on a folder that holds another run


def run_placed_jobs(placed: Sequence[tuple[RunSpec, Path]], build_task: TaskBuilder,
                    options: RunOptions | None = None) -> list[RunResult]:
    """Run (or resume) each ``(spec, run_dir)`` pair in its own folder, ``options.workers`` at a time in one pool.

    :func:`run_jobs` places every spec under one study folder; a study of several cells (one folder per
    learning rate, say) hands all its runs here at once, so that the workers stay busy across cells instead of
    waiting at the end of each. Runs, threads and progress bars as in :func:`run_jobs`.

    Returns
    -------
    list of RunResult
        In the order of ``placed``.
    """
    options = options or RunOptions()
    workers, threads, quiet = options.workers, options.threads, options.quiet
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"run_jobs: workers={workers!r} must be an int >= 1.")
    check_placed_jobs(placed)
    if workers > 1 and threads is None:
        threads = max(1, (os.cpu_count() or 1) // workers)
    kwargs = {"device": options.device, "threads": threads, "stop_after_epochs": options.stop_after_epochs,
              "checkpoint_interval_s": options.checkpoint_interval_s}
    jobs = [(s, build_task, Path(d), kwargs) for s, d in placed]
    if workers == 1 or len(jobs) == 1:
        return [_job((s, b, d, {**kw, "quiet": quiet})) for s, b, d, kw in jobs]

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: dict[int, RunResult] = {}
    ctx = multiprocessing.get_context("spawn")
    bar = None
    if not quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="runs", unit="run", dynamic_ncols=True)
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
            futures = {pool.submit(_job, (s, b, d, {**kw, "quiet": True})): i for i, (s, b, d, kw) in enumerate(jobs)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if bar is not None:
                    res = results[futures[fut]]
                    final = res.final_record or {}
                    key = next((k for k in _progress_keys(final) if k.startswith("val_")), "val_acc")
                    value = final.get(key)
                    bar.set_postfix_str(f"{res.name} {key}={value if value is None else round(value, 3)}")
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return [results[i] for i in range(len(jobs))]


def epochs_per_second(results: Sequence[RunResult]) -> float | None:
    """Mean epochs per second over the results that trained in this call (``None`` if none did)."""
    rates = [r.epochs_per_second for r in results if r.epochs_per_second is not None]
    return sum(rates) / len(rates) if rates else None
