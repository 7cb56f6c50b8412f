"""Run a study's (arm, seed) grid and turn its records into ``summary.json``, PNG figures and ``report.md``.

:func:`run_study` is the whole pipeline; :func:`finalize_study` alone rebuilds the outputs from records
already on disk (``--report-only``, or collecting a run that finished in the background).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import RunSpec, to_dict
from .records import load_study_records, summarize
from .report import PaperReference, render_report, write_text
from .runner import ENVIRONMENT_FILE, RunResult, TaskBuilder, run_jobs

__all__ = ["StudyOutputs", "run_study", "finalize_study", "speed_from_environment"]

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"

#: Figure name (as returned by plot_study) -> caption in the report.
FIGURE_CAPTIONS = {
    "accuracy": "Accuracy per arm (mean over seeds, band ±1 sd)",
    "overview": "Validation accuracy, weight norm of the Euclidean matrices, and the largest principal angle "
                "of W_Q to its initial subspace",
    "weight_norms": "Frobenius norm of every weight matrix",
    "principal_angles": "Principal angles between the current and the initial column spaces of W_Q and W_K",
    "movement": "Movement of W_Q and W_K: total from initialisation, and of the last step before each evaluation",
}


@dataclass(frozen=True)
class StudyOutputs:
    """What :func:`finalize_study` wrote: the summary dict and the paths of its files."""

    summary: dict[str, Any]
    summary_path: Path
    report_path: Path
    figures: dict[str, Path]
    results: tuple[RunResult, ...] = ()


def speed_from_environment(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Training speed per run from each run's ``environment.json``: epochs and seconds summed over the calls."""
    runs = {}
    for path in sorted(Path(out_dir).glob(f"runs/*/seed*/{ENVIRONMENT_FILE}")):
        calls = json.loads(path.read_text())
        epochs = sum((c.get("end_epoch") or c["start_epoch"]) - c["start_epoch"] for c in calls)
        seconds = sum(c.get("seconds") or 0.0 for c in calls)
        last = calls[-1] if calls else {}
        runs[f"{path.parent.parent.name}/{path.parent.name}"] = {
            "epochs_trained": epochs, "seconds": round(seconds, 1),
            "epochs_per_second": round(epochs / seconds, 2) if seconds > 0 and epochs > 0 else None,
            "device": last.get("device"), "threads": last.get("torch_threads"), "torch": last.get("torch"),
            "git_sha": last.get("git_sha"), "calls": len(calls)}
    return runs


def finalize_study(out_dir: str | os.PathLike, *, title: str, intro: str = "", config: Any = None,
                   arms: Sequence[str] | None = None, seeds: Sequence[int] | None = None,
                   paper: PaperReference | None = None, notes: Sequence[str] = (), threshold: float = 0.95,
                   last_fraction: float = 0.1, extra_run_info: Mapping[str, Any] | None = None,
                   results: Sequence[RunResult] = ()) -> StudyOutputs:
    """Summarise the records under ``out_dir/runs`` (restricted to ``arms``/``seeds`` when given), draw the
    figures, and write ``summary.json`` and ``report.md`` into ``out_dir``."""
    from .plotting import plot_study

    out_dir = Path(out_dir)
    records = load_study_records(out_dir)
    if arms is not None:
        order = {a: i for i, a in enumerate(arms)}
        records = sorted((r for r in records if r["arm"] in order), key=lambda r: order[r["arm"]])
    if seeds is not None:
        records = [r for r in records if r["seed"] in set(seeds)]
    if not records:
        raise ValueError(f"finalize_study: no records under {out_dir / 'runs'} for arms={arms} seeds={seeds}; "
                         f"run the study first.")
    summary = summarize(records, threshold=threshold, last_fraction=last_fraction)
    figures = plot_study(records, out_dir, threshold=threshold)
    speed = speed_from_environment(out_dir)
    rates = [v["epochs_per_second"] for v in speed.values() if v["epochs_per_second"]]
    run_info: dict[str, Any] = {}
    if rates:
        run_info["training speed"] = (f"{sum(rates) / len(rates):.1f} epochs/s per run (mean over {len(rates)} "
                                      f"runs; evaluation included)")
        any_run = next(iter(speed.values()))
        run_info["device"] = f"{any_run['device']}, {any_run['threads']} torch thread(s), torch {any_run['torch']}"
        run_info["git SHA"] = any_run["git_sha"]
    run_info.update(extra_run_info or {})
    config_dict = to_dict(config) if config is not None else None
    full = {"title": title, "config": config_dict, "summary": summary, "speed": speed,
            "paper": None if paper is None else to_dict(paper)}
    summary_path = out_dir / SUMMARY_FILE
    summary_path.write_text(json.dumps(full, indent=2) + "\n")
    report = render_report(title=title, summary=summary, intro=intro, paper=paper,
                           figures={FIGURE_CAPTIONS.get(k, k): p.name for k, p in figures.items()},
                           config=config_dict, run_info=run_info, notes=notes)
    report_path = write_text(out_dir / REPORT_FILE, report)
    return StudyOutputs(summary=full, summary_path=summary_path, report_path=report_path, figures=figures,
                        results=tuple(results))


def run_study(config: Any, build_task: TaskBuilder, out_dir: str | os.PathLike, *, arms: Sequence[str],
              seeds: Sequence[int], workers: int = 1, device: str = "auto", threads: int | None = None,
              quiet: bool = False, stop_after_epochs: int | None = None, checkpoint_interval_s: float = 30.0,
              skip_report: bool = False, **finalize_kwargs: Any) -> StudyOutputs | tuple[RunResult, ...]:
    """Run (or resume) every (arm, seed) of ``config`` with :func:`~.runner.run_jobs`, then
    :func:`finalize_study` (unless ``skip_report``: then the run results alone are returned). Paired: each
    seed gives every arm the same data and initial weights."""
    specs = [RunSpec(config, arm, seed) for arm in arms for seed in seeds]
    results = run_jobs(specs, build_task, out_dir, workers=workers, device=device, threads=threads, quiet=quiet,
                       stop_after_epochs=stop_after_epochs, checkpoint_interval_s=checkpoint_interval_s)
    if skip_report:
        return tuple(results)
    return finalize_study(out_dir, config=config, arms=arms, seeds=seeds, results=results, **finalize_kwargs)
