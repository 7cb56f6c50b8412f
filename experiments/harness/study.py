"""The study layer: run a study's grid of (cell, arm, seed) runs and turn its records into ``summary.json``,
PNG figures and ``report.md``.

A *cell* (:class:`Cell`) is one configuration of a study: a sweep over data size, weight decay, ... has one
cell per value, each with its runs under ``out/<cell.subdir>/runs/<arm>/seed<k>``; a study without a sweep
has one cell whose runs live in ``out/runs``. :func:`run_study` is the whole pipeline of a single-cell study;
:func:`run_cells` trains every cell; :func:`finalize_study` alone rebuilds the outputs from the records
already on disk (``--report-only``). Everything the report shows comes from files in the study folder (the
records, ``environment.json`` of each run, and ``study.json``, the commands that trained it), so rebuilding
a report from a committed folder gives the committed report byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import RunSpec, to_dict
from .jobs import RunOptions, check_placed_jobs, run_placed_jobs
from .records import load_study_records, run_paths, summarize
from .report import PaperReference, render_report, write_text
from .run_folder import CONFIG_FILE, ENVIRONMENT_FILE, _differences
from .runner import RunResult, TaskBuilder

__all__ = ["Cell", "finished_runs", "StudyOutputs", "run_study", "run_cells", "finalize_study", "speed_from_environment",
           "record_command", "recorded_commands", "cell_records", "check_runs_alike", "check_study_folder",
           "recorded_config", "run_info_from_records", "ReportNotWrittenError", "write_report"]

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
#: study-level record: the commands that trained the study, in order (``{"commands": [...]}``)
STUDY_FILE = "study.json"

#: Figure name (as returned by plot_study) -> caption in the report.
FIGURE_CAPTIONS = {
    "accuracy": "Accuracy per arm (mean over seeds, band ±1 sd)",
    "per_seed": "Validation accuracy of each seed, every arm on its panel (the dips a mean over seeds smooths "
                "away)",
    "reached": "Fraction of seeds that have reached the threshold by each epoch, per arm (when each seed groks)",
    "overview": "Validation accuracy, weight norm of the Euclidean matrices, and the largest principal angle "
                "of W_Q to its initial subspace",
    "weight_norms": "Frobenius norm of every weight matrix",
    "principal_angles": "Principal angles between the current and the initial column spaces of W_Q and W_K",
    "movement": "Movement of W_Q and W_K: total from initialisation, and of the last step before each evaluation",
}


@dataclass(frozen=True)
class Cell:
    """One configuration of a study.

    Parameters
    ----------
    config : dataclass
        The study config of this cell's runs.
    subdir : str
        Folder of the cell under the study's output folder (``""``: the study folder itself).
    sweep : str or None
        The swept config field (``"train_size"``, ``"weight_decay"``), ``None`` for a study without a sweep.
    value : float or None
        The swept value.
    """

    config: Any
    subdir: str = ""
    sweep: str | None = None
    value: float | None = None

    @property
    def label(self) -> str:
        return "all" if self.sweep is None else f"{self.sweep}={self.value:g}"

    def folder(self, out_dir: str | os.PathLike) -> Path:
        return Path(out_dir) / self.subdir if self.subdir else Path(out_dir)


@dataclass(frozen=True)
class StudyOutputs:
    """What a study call did: the run results of this call, and, unless the report was skipped, the summary
    and the paths of the files :func:`finalize_study` wrote."""

    results: tuple[RunResult, ...] = ()
    summary: dict[str, Any] | None = None
    summary_path: Path | None = None
    report_path: Path | None = None
    figures: dict[str, Path] = dataclasses.field(default_factory=dict)


class ReportNotWrittenError(RuntimeError):
    """A study call trained its runs and their records are complete on disk, but its report could not be written.

    The message is one sentence: the folder, the cause (the exception's type and message on one line) and how to
    rebuild the report once the cause is fixed (``--report-only``, which trains nothing). The cause is chained
    (``__cause__``) for a caller who wants its traceback; the command line prints the sentence alone (exit status
    1)."""

    def __init__(self, out_dir: str | os.PathLike, cause: BaseException):
        why = " ".join(f"{type(cause).__name__}: {cause}".split())
        super().__init__(f"the runs' records in {out_dir} are complete, but the report could not be written ({why}); "
                         f"rebuild it with --report-only --out {out_dir} once that is fixed")
        self.out_dir, self.cause = Path(out_dir), cause


def write_report(finalize: Any, out_dir: str | os.PathLike, *args: Any, **kwargs: Any) -> StudyOutputs:
    """``finalize(out_dir, *args, **kwargs)``, the report step after training: any error it raises (not an
    interrupt) becomes a :class:`ReportNotWrittenError` naming ``out_dir`` and the cause. The records the runs
    wrote are not touched by the report, so they stay complete whatever the report step does."""
    try:
        return finalize(out_dir, *args, **kwargs)
    except Exception as err:
        raise ReportNotWrittenError(out_dir, err) from err


def record_command(out_dir: str | os.PathLike, command: str | None) -> None:
    """Append ``command`` to the study's ``study.json`` (once: a rerun of the same command is not repeated)."""
    if not command:
        return
    path = Path(out_dir) / STUDY_FILE
    commands = recorded_commands(out_dir)
    if command not in commands:
        commands.append(command)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"commands": commands}, indent=2) + "\n")


def recorded_commands(out_dir: str | os.PathLike) -> list[str]:
    """The commands recorded in ``study.json`` (empty when there is none)."""
    path = Path(out_dir) / STUDY_FILE
    return list(json.loads(path.read_text()).get("commands", [])) if path.exists() else []


def cell_records(out_dir: str | os.PathLike, cell: Cell, arms: Sequence[str] | None,
                 seeds: Sequence[int] | None) -> list[dict[str, Any]]:
    """The records of one cell, restricted to ``arms`` (in that order) and ``seeds`` when given."""
    records = load_study_records(cell.folder(out_dir))
    if arms is not None:
        order = {a: i for i, a in enumerate(arms)}
        records = sorted((r for r in records if r["arm"] in order), key=lambda r: order[r["arm"]])
    if seeds is not None:
        wanted = set(seeds)
        records = [r for r in records if r["seed"] in wanted]
    if not records:
        raise ValueError(f"no records under {cell.folder(out_dir) / 'runs'} for arms {list(arms or [])} and "
                         f"seeds {list(seeds or [])}; run the study first (without --report-only), or check --out, "
                         f"--arms and --seeds.")
    check_runs_alike(cell.folder(out_dir), {(r["arm"], int(r["seed"])) for r in records})
    return records


def check_runs_alike(folder: str | os.PathLike, runs: Iterable[tuple[str, int]]) -> None:
    """Refuse to report ``runs`` (``(arm, seed)`` pairs under ``folder/runs``) trained with different settings.

    A mean over seeds, or a paired comparison of arms, is a statement about one configuration: a seed trained at
    another ``--lr``, for more ``--epochs`` or on another task, would be averaged in under the settings of the
    first run. The seeds of one arm must share every setting of their ``config.json``; runs of different arms may
    differ only in their optimizer settings (``optim.*``: an arm's own learning rate, say), never in the task, the
    model, the data or the schedule. Runs without a ``config.json`` are not checked.

    Raises
    ------
    InconsistentRecordsError
        Naming the runs and the flags that differ, and the fix (``--arms``/``--seeds`` to report runs alike, or
        rerun the others with the same flags).
    """
    from .config import flag_of
    from .records import InconsistentRecordsError

    wanted = set(runs)
    configs: dict[tuple[str, int], Any] = {}
    for path in run_paths(folder, CONFIG_FILE):
        key = (path.parent.parent.name, int(path.parent.name[len("seed"):]))
        if key in wanted:
            configs[key] = json.loads(path.read_text()).get("config")
    if len(configs) < 2:
        return
    items = sorted(configs.items())
    first_of_arm: dict[str, tuple[int, Any]] = {}
    for (arm, seed), config in items:
        first_of_arm.setdefault(arm, (seed, config))
    found = []
    for (arm, seed), config in items[1:]:
        ref_arm, (ref_seed, ref) = (arm, first_of_arm[arm]) if first_of_arm[arm][0] != seed else (
            items[0][0][0], (items[0][0][1], items[0][1]))
        diffs = _differences(ref, config)
        if arm != ref_arm:  # the first seed of another arm: the optimizer settings may be the arm's own
            diffs = [d for d in diffs if not d[0].startswith("optim.")]
        if diffs:
            found.append(f"{arm}/seed{seed} has " + ", ".join(f"{flag_of(p)} {json.dumps(b)}" for p, _, b in diffs)
                         + f" where {ref_arm}/seed{ref_seed} has "
                         + ", ".join(f"{flag_of(p)} {json.dumps(a)}" for p, a, _ in diffs))
    if found:
        raise InconsistentRecordsError(
            f"{Path(folder) / 'runs'} holds runs trained with different settings, which one report would mix: "
            f"{'; '.join(found)}. Report runs alike with --arms/--seeds, rerun the others with the same flags, or "
            f"move them to another --out folder.")


def speed_from_environment(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Training speed per run from each run's ``environment.json``: epochs and seconds summed over the calls."""
    runs = {}
    for path in run_paths(out_dir, ENVIRONMENT_FILE):
        calls = json.loads(path.read_text())
        epochs = sum((c.get("end_epoch") or c["start_epoch"]) - c["start_epoch"] for c in calls)
        seconds = sum(c.get("seconds") or 0.0 for c in calls)
        last = calls[-1] if calls else {}
        runs[f"{path.parent.parent.name}/{path.parent.name}"] = {
            "epochs_trained": epochs, "seconds": round(seconds, 1),
            "epochs_per_second": round(epochs / seconds, 2) if seconds > 0 and epochs > 0 else None,
            "device": last.get("device"), "threads": last.get("torch_threads"), "torch": last.get("torch"),
            "git_sha": last.get("git_sha"), "calls": len(calls),
            "commits": _distinct(_commit_label(c) for c in calls),
            "setups": _distinct(_setup_label(c) for c in calls)}
    return runs


def _distinct(items: Iterable[str | None]) -> list[str]:
    """The distinct non-empty items, in order of first appearance."""
    return list(dict.fromkeys(item for item in items if item))


def _commit_label(call: Mapping[str, Any]) -> str | None:
    """A call's git commit, 12 hex digits, marked ``*`` when the working tree had uncommitted changes."""
    sha = call.get("git_sha")
    return None if not sha else sha[:12] + ("*" if call.get("git_dirty") else "")


def _setup_label(call: Mapping[str, Any]) -> str:
    """A call's device, CPU model (when recorded), torch threads and torch version."""
    device = call.get("device")
    model = call.get("device_name") if device and device != "cpu" else call.get("cpu_model")
    return (f"{device}{f' ({model})' if model else ''}, {call.get('torch_threads')} torch thread(s), "
            f"torch {call.get('torch')}")


def run_info_from_records(out_dir: str | os.PathLike, speed: Mapping[str, Any]) -> dict[str, Any]:
    """The "Run" lines of a report, from the records only (so that a rebuild gives the same text): training
    speed, device and git SHA from the runs' ``environment.json``, the commands from ``study.json``."""
    info: dict[str, Any] = {}
    rates = [v["epochs_per_second"] for v in speed.values() if v.get("epochs_per_second")]
    secs = [v["seconds"] for v in speed.values() if v.get("seconds")]
    if rates:
        info["training"] = (f"{len(secs)} runs, {sum(secs) / 60:.1f} min of training in total, "
                            f"{sum(rates) / len(rates):.3g} epochs/s per run on average (evaluation included)")
    if speed:  # every setup and commit any call of any run was trained under, in order of the runs
        setups = _distinct(s for v in speed.values() for s in v["setups"])
        commits = _distinct(c for v in speed.values() for c in v["commits"])
        info["device" if len(setups) == 1 else "devices"] = "; ".join(setups)
        if commits:
            notes = [] if len(commits) == 1 else [str(len(commits))]
            if any(c.endswith("*") for c in commits):
                notes.append("* = with uncommitted changes")
            label = "git commit" if len(commits) == 1 else "git commits"
            info[f"{label} ({'; '.join(notes)})" if notes else label] = ", ".join(commits)
    commands = recorded_commands(out_dir)
    if commands:
        info["command" if len(commands) == 1 else "commands"] = "; ".join(f"`{c}`" for c in commands)
    return info


def recorded_config(out_dir: str | os.PathLike, cell: Cell | None = None) -> dict[str, Any] | None:
    """The study config (plain JSON) of the first run found under the (cell's) folder, from its ``config.json``."""
    folder = (cell or Cell(None)).folder(out_dir)
    for path in run_paths(folder, CONFIG_FILE):
        return json.loads(path.read_text())["config"]
    return None


def finished_runs(records: Sequence[dict[str, Any]], epochs: int | None
                  ) -> tuple[list[dict[str, Any]], str]:
    """Keep the records of the runs that reached ``epochs`` when at least one has, and say which were left out.

    A study whose runs are still training would otherwise average a run's value at its current epoch with
    others' endpoints. Returns ``(records, note)``: the finished runs' records and a sentence naming every run
    still in progress (its last evaluated epoch); when no run has reached ``epochs`` yet, every record is kept
    and the note says that the figures are at the runs' last evaluated epochs. ``epochs=None``: no filter,
    empty note."""
    if epochs is None or not records:
        return list(records), ""
    last: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r["arm"], int(r["seed"]))
        last[key] = max(last.get(key, r["epoch"]), r["epoch"])
    open_runs = {k: e for k, e in sorted(last.items()) if e < epochs}
    if not open_runs:
        return list(records), ""
    listed = ", ".join(f"{arm} seed {seed} (at epoch {e:,} of {epochs:,})" for (arm, seed), e in open_runs.items())
    if len(open_runs) == len(last):
        return list(records), (f"**No run has reached epoch {epochs:,} yet**: every figure below is at the runs' "
                               f"last evaluated epoch: {listed}.")
    kept = [r for r in records if (r["arm"], int(r["seed"])) not in open_runs]
    return kept, (f"**In progress, left out of every table and figure below**: {listed}. Rerun the training "
                  f"command to resume them; the report then includes them.")


def finalize_study(out_dir: str | os.PathLike, *, title: str, intro: str = "", config: Any = None,
                   arms: Sequence[str] | None = None, seeds: Sequence[int] | None = None,
                   paper: PaperReference | None = None, notes: Sequence[str] = (), threshold: float = 0.95,
                   last_fraction: float = 0.1, results: Sequence[RunResult] = ()) -> StudyOutputs:
    """Summarise the records under ``out_dir/runs`` (restricted to ``arms``/``seeds`` when given), draw the
    figures, and write ``summary.json`` and ``report.md`` into ``out_dir``. Everything written is a function
    of the files in ``out_dir`` and the arguments, so a rebuild gives the same bytes."""
    from .mechanism import mechanism_summary
    from .plotting import plot_study

    out_dir = Path(out_dir)
    records = cell_records(out_dir, Cell(config), arms, seeds)
    records, in_progress = finished_runs(records, getattr(getattr(config, "train", None), "epochs", None))
    if in_progress:
        intro = f"{intro}\n\n{in_progress}" if intro else in_progress
    summary = summarize(records, threshold=threshold, last_fraction=last_fraction)
    mechanism = mechanism_summary(summary) if summary["arms"] else None
    if mechanism is not None:  # arms that separate the start, the constraint and the step ran
        summary["mechanism"] = mechanism
    figures = plot_study(records, out_dir, threshold=threshold)
    speed = speed_from_environment(out_dir)
    config_dict = to_dict(config) if config is not None else None
    full = {"title": title, "config": config_dict, "summary": summary, "speed": speed,
            "paper": None if paper is None else to_dict(paper)}
    summary_path = out_dir / SUMMARY_FILE
    summary_path.write_text(json.dumps(full, indent=2) + "\n")
    report = render_report(title=title, summary=summary, intro=intro, paper=paper,
                           figures={FIGURE_CAPTIONS.get(k, k): p.name for k, p in figures.items()},
                           config=config_dict, run_info=run_info_from_records(out_dir, speed), notes=notes)
    report_path = write_text(out_dir / REPORT_FILE, report)
    return StudyOutputs(results=tuple(results), summary=full, summary_path=summary_path, report_path=report_path,
                        figures=figures)


def check_study_folder(out_dir: str | os.PathLike, experiments: Iterable[str]) -> None:
    """Refuse to train runs of ``experiments`` into an ``out_dir`` that holds runs of another study.

    A folder is one study: its ``study.json``, ``summary.json`` and ``report.md`` are those of the study trained
    there, and its report is rebuilt from every run under it. Runs of the grokking study placed beside a vision
    study's (a new arm, say) would overwrite the vision report with a grokking one and be mixed into the next
    rebuild.

    Raises
    ------
    ConfigMismatchError
        Naming ``--out``, the other study and one of its runs; nothing is written.
    """
    from .run_folder import ConfigMismatchError

    wanted = set(experiments)
    for path in sorted(Path(out_dir).glob(f"**/runs/*/seed*/{CONFIG_FILE}")):
        try:
            found = json.loads(path.read_text()).get("config", {}).get("experiment")
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable config.json is check_run_dir's to report, for the runs it places
        if found is not None and found not in wanted:
            raise ConfigMismatchError(
                f"--out {out_dir} holds runs of the {found} study ({path.parent}), not of "
                f"{' or '.join(sorted(wanted))}: a study folder holds one study (its report is rebuilt from every "
                f"run in it); use another --out folder.")


def run_cells(cells: Sequence[Cell], build_task: TaskBuilder, out_dir: str | os.PathLike, *, arms: Sequence[str],
              seeds: Sequence[int], arm_config: Any = None, command: str | None = None,
              options: RunOptions | None = None, **run_kwargs: Any) -> list[RunResult]:
    """Run (or resume) every (cell, arm, seed), all cells' runs in one pool (:func:`~.jobs.run_placed_jobs`,
    so ``options.workers`` runs stay busy across cells), and record
    ``command`` in ``study.json``. ``arm_config(config, arm)`` may adapt a cell's config to an arm (e.g. an
    arm's own frame learning rate); default: the cell's config. Paired: each seed gives every arm of a cell the
    same data and initial weights. ``options`` (:class:`~.jobs.RunOptions`) says how to run; single options
    given by keyword replace its fields."""
    options = RunOptions.of(options, **run_kwargs)
    grid = [(cell, [RunSpec(cell.config if arm_config is None else arm_config(cell.config, a), a, s)
                    for a in arms for s in seeds]) for cell in cells]
    placed = [(spec, cell.folder(out_dir) / "runs" / spec.name) for cell, specs in grid for spec in specs]
    check_study_folder(out_dir, {spec.experiment for _, specs in grid for spec in specs})
    check_placed_jobs(placed)  # refuse a folder holding other runs before anything is trained or written
    record_command(out_dir, command)
    return run_placed_jobs(placed, build_task, options)


def run_study(config: Any, build_task: TaskBuilder, out_dir: str | os.PathLike, *, arms: Sequence[str],
              seeds: Sequence[int], options: RunOptions | None = None, skip_report: bool = False,
              command: str | None = None, **kwargs: Any) -> StudyOutputs:
    """Run (or resume) every (arm, seed) of a single-cell study (:func:`run_cells`), then :func:`finalize_study`
    unless ``skip_report`` (a report that fails raises :class:`ReportNotWrittenError`). Returns :class:`StudyOutputs`
    either way (without a summary when skipped). Keywords
    naming a field of :class:`~.jobs.RunOptions` replace that option; the others go to :func:`finalize_study`."""
    run_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in RunOptions.__dataclass_fields__}
    results = run_cells([Cell(config)], build_task, out_dir, arms=arms, seeds=seeds, command=command,
                        options=RunOptions.of(options, **run_kwargs))
    if skip_report:
        return StudyOutputs(results=tuple(results))
    return write_report(finalize_study, out_dir, config=config, arms=arms, seeds=seeds, results=results, **kwargs)
