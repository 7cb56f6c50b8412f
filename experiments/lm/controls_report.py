r"""The report of the controls study (issue 42): the tuned study's report, plus what the controls add.

``python -m experiments lm --report-only --out experiments/lm/records/controls`` reaches it through
:func:`finalize`, which hands a folder holding runs of an arm that only this study has
(:data:`CONTROL_ONLY_ARMS`) to :func:`finalize_controls` and any other tuned folder to :func:`~.tuned.finalize_tuned`. The folder is laid out as :mod:`~.tuned` describes
(``lr-<v>/``, ``warmup-<n>/lr-<v>/``, ``final/``, ``timing.json``); every run also holds ``steps.jsonl``, one
record per training step (its loss, the gradient norm before clipping, and per layer the largest attention logit
``logit_max`` and the smallest head's attention entropy ``entropy_min``: :class:`~.study.AttentionSteps`).

On top of the tuned report (selection on validation, final cell on test with paired t, sign test and Holm over
every comparison, equal wall-clock), with :data:`CONTROL_BASELINES` as the arms compared against:

**Stable range** (:func:`stable_range`). For one arm on one grid (the study's warm-up, or a ``warmup-<n>/`` grid)
with best mean validation bpb :math:`b` (final evaluation, mean over the grid's seeds): the lrs whose mean is at
most :math:`b` + :data:`STABLE_BPB`, and the *first lr above the best that diverges*. A grid point **diverges**
when any of its seeds ends with a final validation bpb that is not finite or more than :data:`DIVERGE_BPB` above
:math:`b`, or logged a non-finite training loss in ``steps.jsonl``.

**Spikes** (:func:`step_summary`). A *loss spike* starts at a step whose training loss exceeds
:data:`SPIKE_FACTOR` times the median loss of the :data:`SPIKE_WINDOW` steps before it (steps before the first
full window are not judged); consecutive such steps are one spike. A *gradient spike* is the same with the
gradient norm and :data:`GRAD_SPIKE_FACTOR`.

**Every step of the final cell** (:func:`plot_steps`, :func:`plot_step_layers`). Per arm, over training: the
training loss, the gradient norm, the largest attention logit (maximum over the layers) and the smallest attention
entropy (minimum over the layers), as the median over the final seeds with their min-max band; and per layer the
median over seeds of the largest logit and the smallest entropy.

**Warm-up** (:func:`warmup_comparison`). Each ``warmup-<n>/`` grid against the study's own warm-up, paired by
(lr, seed) over the grid points both hold: validation only, a descriptive comparison (the pairs share seeds
across lrs), always worded "suggests".

**Steps to reach** (:func:`steps_to_reach`). For an arm against ``adamw`` on the same seed: the first
evaluation step at which the arm's test bpb is at or below ``adamw``'s final test bpb, and the step efficiency
:math:`S / s` (:math:`S` the steps of ``adamw``'s run, :math:`s` that step). Evaluations are spaced, so the crossing
lies at or before :math:`s` and :math:`S / s` is a lower bound of the efficiency at that resolution.

**Reuse** (:func:`reuse_check`). Issue 42 lets a run of the tuned study (``records/tuned/``, beside this
folder) join only after two of its runs, retrained, reproduce their records. The study retrained every run
instead; the check compares the commits every run here was trained on (``environment.json``) with the tuned
study's, and the report names any run trained on one of them.

**The questions** (:func:`readme_paragraph`). A paragraph, in ``report.md`` and between
:data:`README_BEGIN` and :data:`README_END` in ``experiments/lm/README.md``, that answers the issue's three
questions from ``summary.json`` alone; :func:`readme_problems` checks the README against a summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..harness.records import run_paths, seed_of
from ..harness.study import StudyOutputs
from . import tuned

__all__ = ["CONTROL_ARMS", "CONTROL_ONLY_ARMS", "CONTROL_BASELINES", "STABLE_BPB", "DIVERGE_BPB", "SPIKE_WINDOW",
           "SPIKE_FACTOR", "GRAD_SPIKE_FACTOR", "README_BEGIN", "README_END", "README_PLACEHOLDER",
           "README_IN_PROGRESS", "finalize", "is_controls_folder", "step_summary", "stable_range", "warmup_comparison",
           "finalize_controls", "steps_to_reach", "reuse_check", "readme_paragraph", "readme_problems", "write_readme", "main",
           "STUDIES", "LEVEL_PLACEHOLDER", "LEVEL_TITLE", "study_block", "report_title"]

#: The study's arms, in table order.
CONTROL_ARMS = ("adamw", "adamw-qknorm", "muon", "stiefel", "stiefeladam-muon", "stiefelmuon-muon")
#: Arms no other lm study trains: a tuned folder holding one of them is the controls study.
CONTROL_ONLY_ARMS = ("adamw-qknorm", "stiefeladam-muon", "stiefelmuon-muon")
#: The arms every other arm is compared with (each pair once; Holm over every comparison of a section).
CONTROL_BASELINES = ("adamw", "adamw-qknorm", "muon")
#: Stable range: the lrs whose mean final validation bpb is within this of the arm's best (bits per byte).
STABLE_BPB = 0.05
#: Divergence: a seed's final validation bpb more than this above the arm's best (or not finite, or a non-finite
#: training loss on record).
DIVERGE_BPB = 0.5
#: Spikes: the steps of the trailing window a step is compared with.
SPIKE_WINDOW = 100
#: Loss spike: a step's training loss above this times the trailing window's median. Batch-to-batch noise alone
#: reached 1.21 (the largest ratio over the 1,900 judged steps of each of the study's first three finished grid
#: runs: adamw, adamw-qknorm and stiefel at lr 3e-3, commit bf01500, records discarded after a0259af), so the
#: threshold sits well above it.
SPIKE_FACTOR = 1.5
#: Gradient spike: a step's gradient norm (before clipping) above this times the trailing window's median (noise
#: alone reached 2.5 in the same runs).
GRAD_SPIKE_FACTOR = 5.0

TITLE = "Controls: QK-norm, a stabilised AdamW, manifold Muon, ten seeds (issue 42)"
#: A study folder's list of the runs it copied unchanged from another study (``from``, ``why``, ``trained_on``,
#: ``runs``), quoted by the report.
CARRIED_FILE = "carried_over.json"
#: The title of the level-ground study (issue 57): the controls protocol with every knob offered to every arm and the
#: ``stiefel-gain`` arm, whose presence among a folder's runs marks it (:func:`report_title`).
LEVEL_TITLE = ("Level ground: the frames against QK-norm with every knob offered to every arm, a learned gain for the "
               "frames, selection on two seeds (issue 57)")
#: The arm only the level-ground study has.
LEVEL_ARM = "stiefel-gain"
STEPS_FIGURE = "steps.png"
LAYERS_FIGURE = "steps_layers.png"
STEPS_FILE = "steps.jsonl"
#: Where the study's records live, and the README that quotes them.
RECORDS = Path(__file__).resolve().parent / "records" / "controls"
README = Path(__file__).resolve().parent / "README.md"
#: Steps to reach: (arm, against) pairs, each arm read against the other's final test bpb on the same seed.
REACH_PAIRS = (("muon", "adamw"), ("adamw-qknorm", "adamw"), ("stiefel", "adamw"))
#: The tuned study's folder name: its records sit beside this study's (``records/tuned`` next to
#: ``records/controls``).
TUNED_FOLDER = "tuned"

README_BEGIN = ("<!-- controls-results:begin (generated by controls_report.readme_paragraph from "
                "records/controls/summary.json) -->")
README_END = "<!-- controls-results:end -->"
README_PLACEHOLDER = ("_No results yet: the controls study is in progress (records/controls/ holds no report yet); "
                      "this paragraph is generated from its summary.json once the final cell is complete._")
README_IN_PROGRESS = ("_No results yet: the study's final cell is not complete (the study folder's report.md has "
                      "the grid, the stable lr ranges and the runs finished so far); this paragraph answers the "
                      "study's questions once every arm has the same finished final seeds._")
#: The studies whose answers experiments/lm/README.md quotes: each its records folder and its block's markers
#: and placeholder (``controls``: the module's README_BEGIN, README_END, README_PLACEHOLDER).
STUDIES = ("controls", "level")
LEVEL_PLACEHOLDER = ("_No results yet: the level-ground study is in progress (records/level/ holds no report yet); "
                     "this paragraph is generated from its summary.json once the final cell is complete._")


def study_block(study: str) -> tuple[str, str, str, Path]:
    """The README markers (begin, end), the placeholder and the records folder of ``study`` (one of
    :data:`STUDIES`)."""
    if study == "controls":
        return README_BEGIN, README_END, README_PLACEHOLDER, RECORDS
    if study == "level":
        return ("<!-- level-results:begin (generated by controls_report.readme_paragraph from "
                "records/level/summary.json) -->", "<!-- level-results:end -->", LEVEL_PLACEHOLDER,
                RECORDS.parent / "level")
    raise ValueError(f"study {study!r}: not one of {STUDIES}")


# ---------------------------------------------------------------------------------------------- records
def is_controls_folder(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` holds a run (grid, warm-up grid or final cell) of an arm of :data:`CONTROL_ONLY_ARMS`."""
    out_dir = Path(out_dir)
    return any(run_paths(out_dir, "config.json", parent=f"{cells}/runs/{arm}")
               for cells in (f"{tuned.GRID_PREFIX}*", tuned.FINAL_DIR, f"{tuned.WARMUP_PREFIX}*/{tuned.GRID_PREFIX}*")
               for arm in CONTROL_ONLY_ARMS)


def report_title(out_dir: str | os.PathLike) -> str:
    """The title of a controls folder's report, read from its records (a copy of the folder gets the same title):
    :data:`LEVEL_TITLE` when it holds a run of :data:`LEVEL_ARM` (grid, warm-up grid or final cell), else
    :data:`TITLE`."""
    out_dir = Path(out_dir)
    level = any(run_paths(out_dir, "config.json", parent=f"{cells}/runs/{LEVEL_ARM}")
                for cells in (f"{tuned.GRID_PREFIX}*", tuned.FINAL_DIR, f"{tuned.WARMUP_PREFIX}*/{tuned.GRID_PREFIX}*"))
    return LEVEL_TITLE if level else TITLE


def finalize(out_dir: str | os.PathLike, config_type: type, *, arms: Sequence[str] | None = None) -> StudyOutputs:
    """The report of a tuned folder: :func:`finalize_controls` when it is a controls folder
    (:func:`is_controls_folder`), :func:`~.tuned.finalize_tuned` otherwise (arguments as theirs)."""
    if is_controls_folder(out_dir):
        return finalize_controls(out_dir, config_type, arms=arms)
    return tuned.finalize_tuned(out_dir, config_type, arms=arms)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _spikes(values: Sequence[float], factor: float) -> list[int]:
    """Indices where a spike starts (module docstring): ``values[t] > factor * median(values[t-W:t])``, finite values
    only, ``t >= W``; consecutive spike steps count once."""
    import numpy as np

    x = np.array([v if _finite(v) else np.nan for v in values], dtype=float)
    if len(x) <= SPIKE_WINDOW:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(x[:-1], SPIKE_WINDOW)  # windows[i] = x[i : i + W]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN window: no reference, no spike
        reference = np.nanmedian(windows, axis=1)
    current = x[SPIKE_WINDOW:]
    hit = np.nan_to_num(current > factor * reference, nan=False).astype(bool)
    starts = [SPIKE_WINDOW + i for i in np.flatnonzero(hit) if i == 0 or not hit[i - 1]]
    return [int(s) for s in starts]


def step_summary(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What one run's ``steps.jsonl`` says: its steps, the steps with a non-finite loss, loss and gradient spikes
    (module docstring; the step of each), the largest gradient norm, and the largest attention logit and the
    smallest attention entropy over the steps, overall and per layer (finite values only; ``None`` without any)."""
    loss = [s.get("loss") for s in steps]
    grad = [s.get("grad_norm") for s in steps]
    loss_at = _spikes(loss, SPIKE_FACTOR)
    grad_at = _spikes(grad, GRAD_SPIKE_FACTOR)
    layers = max((len(s.get("logit_max") or ()) for s in steps), default=0)

    def per_layer(key: str, pick) -> list[float | None]:
        out = []
        for i in range(layers):
            vals = [s[key][i] for s in steps if len(s.get(key) or ()) > i and _finite(s[key][i])]
            out.append(pick(vals) if vals else None)
        return out

    logit = per_layer("logit_max", max)
    entropy = per_layer("entropy_min", min)
    finite_grad = [g for g in grad if _finite(g)]
    return {"steps": len(steps), "nonfinite_loss": sum(not _finite(v) for v in loss),
            "loss_spikes": len(loss_at), "loss_spike_steps": [int(steps[i]["step"]) for i in loss_at],
            "grad_spikes": len(grad_at), "grad_spike_steps": [int(steps[i]["step"]) for i in grad_at],
            "grad_norm_max": max(finite_grad) if finite_grad else None,
            "logit_max": max((v for v in logit if v is not None), default=None), "logit_max_per_layer": logit,
            "entropy_min": min((v for v in entropy if v is not None), default=None),
            "entropy_min_per_layer": entropy}


def _read_steps(run_dir: Path) -> list[dict[str, Any]]:
    from ..harness.records import read_records

    return read_records(run_dir / STEPS_FILE)


def _grid_steps(folder: Path) -> dict[tuple[str, float, int], dict[str, Any]]:
    """``(arm, lr, seed) -> step_summary`` of every grid run under ``folder`` that has ``steps.jsonl`` (the lr as
    its config records it)."""
    out = {}
    for cell in tuned._grid_folders(folder):
        for config in run_paths(cell, "config.json"):
            steps = _read_steps(config.parent)
            if steps:
                lr = float(json.loads(config.read_text())["config"]["optim"]["lr"])
                out[(config.parent.parent.name, lr, seed_of(config.parent))] = step_summary(steps)
    return out


def _lookup(table: Mapping[tuple[str, float, int], Any], arm: str, lr: float, seed: int) -> Any:
    return next((v for (a, x, s), v in table.items()
                 if a == arm and s == seed and math.isclose(x, lr, rel_tol=tuned.LR_REL_TOL)), None)


# ---------------------------------------------------------------------------------------------- stable range
def stable_range(selected: Mapping[str, Any], arm: str,
                 steps: Mapping[tuple[str, float, int], Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The stable range of ``arm`` on one grid (module docstring: the rule), from its entry of
    :func:`~.tuned.select_lrs` and the :func:`step_summary` of its runs (``(arm, lr, seed) ->``; optional).

    Returns ``{"best_lr", "best_mean", "within" (lrs within :data:`STABLE_BPB` of the best), "low", "high",
    "diverges_at" (the first lr above the best that diverges, ``None`` if none did), "highest_lr", "points"
    [{"lr", "mean", "per_seed", "within", "diverged", "why", "loss_spikes", "grad_spikes", "logit_max",
    "entropy_min"}]}``."""
    steps = steps or {}
    best, best_mean = selected["best_lr"], selected["best_mean"]
    points = []
    for row in selected["rows"]:
        lr, per_seed = row["lr"], row["per_seed"]
        runs = {int(s): _lookup(steps, arm, lr, int(s)) for s in per_seed}
        why = []
        bad = [s for s, v in per_seed.items() if not _finite(v)]
        far = [s for s, v in per_seed.items() if _finite(v) and v > best_mean + DIVERGE_BPB]
        nan_loss = [str(s) for s, r in runs.items() if r and r["nonfinite_loss"]]
        if bad:
            why.append(f"non-finite validation bpb (seed {', '.join(bad)})")
        if far:
            why.append(f"validation bpb more than {DIVERGE_BPB:g} above the best (seed {', '.join(far)})")
        if nan_loss:
            why.append(f"non-finite training loss (seed {', '.join(nan_loss)})")
        mean = row["mean"] if _finite(row["mean"]) else None
        have = [r for r in runs.values() if r]
        points.append({
            "lr": lr, "mean": mean, "per_seed": {s: (v if _finite(v) else None) for s, v in per_seed.items()},
            "within": not why and mean is not None and mean <= best_mean + STABLE_BPB, "diverged": bool(why),
            "why": why, "runs_with_steps": len(have),
            "loss_spikes": sum(r["loss_spikes"] for r in have) if have else None,
            "grad_spikes": sum(r["grad_spikes"] for r in have) if have else None,
            "logit_max": max((r["logit_max"] for r in have if r["logit_max"] is not None), default=None),
            "entropy_min": min((r["entropy_min"] for r in have if r["entropy_min"] is not None), default=None)})
    within = [p["lr"] for p in points if p["within"]]
    above = [p["lr"] for p in points if p["diverged"] and p["lr"] > best]
    return {"best_lr": best, "best_mean": best_mean, "within": within, "low": min(within, default=None),
            "high": max(within, default=None),
            "diverges_at": min(above) if above else None, "highest_lr": max(p["lr"] for p in points),
            "points": points}


def _stable_ranges(out_dir: Path, config: Any, selection: Mapping[str, Any], arms: Sequence[str] | None
                   ) -> list[dict[str, Any]]:
    """One entry per grid (the study's warm-up first, then each ``warmup-<n>/``): ``{"warmup_steps", "folder",
    "arms": {arm: stable_range}}``."""
    grids = [(int(config.warmup_fraction * config.total_steps), ".", selection, _grid_steps(out_dir))]
    for steps, w in tuned.warmup_grids(out_dir).items():
        folder = out_dir / f"{tuned.WARMUP_PREFIX}{steps}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an incomplete grid is stated in the report itself
            sel = tuned.select_lrs(w["grid"], arms=[a for a in w["grid"]["finals"] if arms is None or a in arms])
        grids.append((steps, folder.name, sel, _grid_steps(folder)))
    return [{"warmup_steps": steps, "folder": name,
             "arms": {a: stable_range(s, a, table) for a, s in sel["arms"].items()}}
            for steps, name, sel, table in grids]


# ---------------------------------------------------------------------------------------------- warm-up
def warmup_comparison(own: Mapping[str, Any], other: Mapping[str, Any], arm: str) -> dict[str, Any] | None:
    """The grid points of ``arm`` in both :func:`~.tuned.read_grid` results, paired by (lr, seed): the paired
    statistics of ``other - own`` (final validation bpb; labels ``<lr>/<seed>``) and the lrs; ``None`` without a
    common finite point."""
    from ..harness.stats import paired_stats

    a, b, labels, lrs = [], [], [], []
    for lr, per in sorted(other["finals"].get(arm, {}).items()):
        match = next((v for x, v in own["finals"].get(arm, {}).items()
                      if math.isclose(x, lr, rel_tol=tuned.LR_REL_TOL)), {})
        for seed in sorted(per):
            if seed in match and _finite(per[seed]) and _finite(match[seed]):
                a.append(per[seed])
                b.append(match[seed])
                labels.append(f"{tuned._lr_text(lr)}/{seed}")
                lrs += [lr] if lr not in lrs else []
    if not a:
        return None
    return {"lrs": lrs, **paired_stats(a, b, labels=labels).to_dict()}


# ---------------------------------------------------------------------------------------------- steps to reach
def steps_to_reach(runs: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], arm: str, against: str,
                   steps_per_epoch: int, split: str = "test") -> dict[str, Any] | None:
    """Per seed both arms finished: the first evaluation step at which ``arm``'s ``<split>_bpb`` is at or below
    ``against``'s final one, and the step efficiency (``against``'s steps over that step).

    ``runs``: arm -> seed -> the run's evaluation records in order (each with ``epoch`` and ``<split>_bpb``); the step
    of a record is ``epoch * steps_per_epoch``; the evaluation before training (epoch 0) is not a reach. A seed
    whose ``arm`` never reaches it (or whose records lack the
    split) is listed under ``never``. ``None`` when the arms share no seed. The median, low and high are over the
    seeds that reach it; an efficiency is a lower bound at the evaluations' spacing (the crossing lies at or before
    the step found)."""
    a, b = runs.get(arm, {}), runs.get(against, {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    key = f"{split}_bpb"
    per_seed, never, total = {}, [], None
    for seed in seeds:
        last = b[seed][-1]
        total = int(last["epoch"]) * steps_per_epoch
        target = last.get(key)
        hit = None if target is None or not _finite(target) else next(
            (int(r["epoch"]) * steps_per_epoch for r in a[seed]
             if int(r["epoch"]) > 0 and _finite(r.get(key)) and r[key] <= target), None)
        if hit is None:
            never.append(seed)
        else:
            per_seed[str(seed)] = hit
    out = {"arm": arm, "against": against, "split": split, "pairs": len(seeds), "per_seed": per_seed, "never": never,
           "steps_against": total, "median": None, "low": None, "high": None, "efficiency_median": None,
           "efficiency_low": None, "efficiency_high": None}
    if per_seed:
        hits = per_seed.values()
        median, low, high = statistics.median(hits), min(hits), max(hits)
        out.update(median=median, low=low, high=high, efficiency_median=total / median, efficiency_low=total / high,
                   efficiency_high=total / low)
    return out


def _reach_all(done: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], config: Any, arms: Sequence[str]
               ) -> list[dict[str, Any]]:
    """:func:`steps_to_reach` of every pair of :data:`REACH_PAIRS` among ``arms``, from the finished final runs
    ``done`` (arm -> seed -> evaluation records)."""
    out = []
    for arm, against in REACH_PAIRS:
        if arm in arms and against in arms:
            r = steps_to_reach(done, arm, against, int(config.steps_per_epoch))
            if r is not None:
                out.append(r)
    return out


def _reach_text(r: Mapping[str, Any]) -> str:
    never = "" if not r["never"] else f"; never on seed(s) {', '.join(map(str, r['never']))}"
    if r["median"] is None:
        return (f"`{r['arm']}` never reaches `{r['against']}`'s final {r['split']} bpb within the run "
                f"({r['pairs']} pairs)")
    head = (f"`{r['arm']}` reaches `{r['against']}`'s final {r['split']} bpb (same seed) by step {r['median']:,g} of "
            f"{r['steps_against']:,}")
    if r["low"] == r["high"]:
        return (f"{head} (on each of {len(r['per_seed'])} of {r['pairs']} pairs{never}), a step efficiency of at least "
                f"{r['efficiency_median']:.2f}×")
    return (f"{head} (median over {len(r['per_seed'])} of {r['pairs']} pairs; {r['low']:,}–{r['high']:,}{never}), a "
            f"step efficiency of at least {r['efficiency_median']:.2f}× ({r['efficiency_low']:.2f}–"
            f"{r['efficiency_high']:.2f}×)")


# ---------------------------------------------------------------------------------------------- every step
def _final_steps(out_dir: Path, arms: Sequence[str], done: Mapping[str, Mapping[int, Any]]
                 ) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """arm -> seed -> the steps of each finished final run (``done``: arm -> seed -> its records) that has
    ``steps.jsonl``."""
    out: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for arm in arms:
        for seed in sorted(done.get(arm, {})):
            steps = _read_steps(out_dir / tuned.FINAL_DIR / "runs" / arm / f"seed{seed}")
            if steps:
                out.setdefault(arm, {})[seed] = steps
    return out


def _final_step_summary(runs: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    per = {str(seed): step_summary(steps) for seed, steps in runs.items()}
    vals = list(per.values())
    layers = max(len(v["logit_max_per_layer"]) for v in vals)

    def over(key: str, i: int, pick):
        got = [v[key][i] for v in vals if len(v[key]) > i and v[key][i] is not None]
        return pick(got) if got else None

    def pick_all(key: str, pick):
        got = [v[key] for v in vals if v[key] is not None]
        return pick(got) if got else None

    return {"seeds": sorted(runs), "runs": per,
            "loss_spikes": sum(v["loss_spikes"] for v in vals),
            "runs_with_loss_spikes": sum(v["loss_spikes"] > 0 for v in vals),
            "grad_spikes": sum(v["grad_spikes"] for v in vals),
            "runs_with_grad_spikes": sum(v["grad_spikes"] > 0 for v in vals),
            "runs_with_nonfinite_loss": sum(v["nonfinite_loss"] > 0 for v in vals),
            "grad_norm_max": pick_all("grad_norm_max", max), "logit_max": pick_all("logit_max", max),
            "logit_max_per_layer": [over("logit_max_per_layer", i, max) for i in range(layers)],
            "entropy_min": pick_all("entropy_min", min),
            "entropy_min_per_layer": [over("entropy_min_per_layer", i, min) for i in range(layers)]}


def _series(runs: Mapping[int, Sequence[Mapping[str, Any]]]):
    """``(steps, {quantity: array (seeds, steps)}, {quantity: array (seeds, steps, layers)})``: ``loss``,
    ``grad_norm``, ``logit_max`` (max over layers), ``entropy_min`` (min over layers); NaN where a run lacks a
    step or a value is not finite."""
    import numpy as np

    last = max(int(s["step"]) for steps in runs.values() for s in steps)
    layers = max(len(s.get("logit_max") or ()) for steps in runs.values() for s in steps)
    n = len(runs)
    flat = {k: np.full((n, last + 1), np.nan) for k in ("loss", "grad_norm", "logit_max", "entropy_min")}
    per_layer = {k: np.full((n, last + 1, layers), np.nan) for k in ("logit_max", "entropy_min")}
    for i, steps in enumerate(runs.values()):
        for s in steps:
            t = int(s["step"])
            for k in ("loss", "grad_norm"):
                flat[k][i, t] = s[k] if _finite(s.get(k)) else np.nan
            for k in ("logit_max", "entropy_min"):
                row = [v if _finite(v) else np.nan for v in (s.get(k) or ())]
                per_layer[k][i, t, :len(row)] = row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices stay NaN
        flat["logit_max"] = np.nanmax(per_layer["logit_max"], axis=2)
        flat["entropy_min"] = np.nanmin(per_layer["entropy_min"], axis=2)
    return np.arange(last + 1), flat, per_layer


#: The rows of :data:`STEPS_FIGURE`: quantity, axis label, log scale.
STEP_ROWS = (("loss", "training loss (nats per byte)", False),
             ("grad_norm", "gradient norm before clipping", True),
             ("logit_max", "largest attention logit\n(max over layers)", True),
             ("entropy_min", "smallest attention entropy\n(min over layers, nats)", False))


def _grid_figure(nrows: int, ncols: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * ncols, 2.5 * nrows))  # fixed margins: a constrained layout of 24 axes is slow
    fig.subplots_adjust(left=1.0 / (3.2 * ncols), right=1 - 0.1 / (3.2 * ncols), bottom=0.5 / (2.5 * nrows),
                        top=1 - 0.55 / (2.5 * nrows), wspace=0.12, hspace=0.12)
    return fig, fig.subplots(nrows, ncols, sharex=True, sharey="row", squeeze=False)


def plot_steps(final_steps: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], path: str | os.PathLike
               ) -> Path | None:
    """Per arm (columns) and quantity (rows, :data:`STEP_ROWS`), over training steps: the median over the final
    seeds and their min-max band. ``None`` without steps on record."""
    import numpy as np

    from ..harness.plotting import _save

    arms = [a for a in final_steps if final_steps[a]]
    if not arms:
        return None
    fig, axes = _grid_figure(len(STEP_ROWS), len(arms))
    for j, arm in enumerate(arms):
        x, flat, _ = _series(final_steps[arm])
        for i, (key, label, log) in enumerate(STEP_ROWS):
            ax = axes[i][j]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                lo, mid, hi = (np.nanmin(flat[key], 0), np.nanmedian(flat[key], 0), np.nanmax(flat[key], 0))
            ax.fill_between(x, lo, hi, color=f"C{j}", alpha=0.25, linewidth=0)
            ax.plot(x, mid, color=f"C{j}", linewidth=0.7)
            if log and np.nanmin(lo, initial=np.inf) > 0:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            if i == 0:
                ax.set_title(f"{arm} ({len(final_steps[arm])} seeds)", fontsize=9)
            if i == len(STEP_ROWS) - 1:
                ax.set_xlabel("training step")
    fig.suptitle("Every training step of the final cell: median over seeds, band min-max", fontsize=10)
    return _save(fig, path)


def plot_step_layers(final_steps: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], path: str | os.PathLike
                     ) -> Path | None:
    """Per arm (columns): the largest attention logit and the smallest attention entropy of each layer (one line
    per layer, the median over the final seeds) over training steps."""
    import numpy as np

    from ..harness.plotting import _save

    arms = [a for a in final_steps if final_steps[a]]
    if not arms:
        return None
    fig, axes = _grid_figure(2, len(arms))
    for j, arm in enumerate(arms):
        x, _, per_layer = _series(final_steps[arm])
        for i, (key, label) in enumerate((("logit_max", "largest attention logit"),
                                          ("entropy_min", "smallest attention entropy (nats)"))):
            ax = axes[i][j]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mid = np.nanmedian(per_layer[key], axis=0)  # (steps, layers)
            for layer in range(mid.shape[1]):
                ax.plot(x, mid[:, layer], linewidth=0.7, label=f"layer {layer}")
            if key == "logit_max" and np.nanmin(mid, initial=np.inf) > 0:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
                if i == 0:
                    ax.legend(fontsize=7)
            if i == 0:
                ax.set_title(arm, fontsize=9)
            else:
                ax.set_xlabel("training step")
    fig.suptitle("Per layer, median over the final seeds", fontsize=10)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- summary
def _rules() -> dict[str, Any]:
    return {"stable_bpb": STABLE_BPB, "diverge_bpb": DIVERGE_BPB, "spike_window": SPIKE_WINDOW,
            "spike_factor": SPIKE_FACTOR, "grad_spike_factor": GRAD_SPIKE_FACTOR,
            "min_pairs_for_claim": tuned.MIN_SEEDS_FOR_CLAIM, "alpha": tuned.ALPHA}


def reuse_check(out_dir: str | os.PathLike, trained_on: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """Which commits of this study's runs are also the tuned study's (``<out_dir>/../tuned/summary.json``): a run
    carried over from ``runs/tuned`` holds that study's commit in its ``environment.json``. ``None`` when no tuned
    summary sits beside ``out_dir`` (nothing to compare with).

    Returns ``{"tuned": [commits], "commits": [this study's commits], "shared": [commits in both]}``, commits as
    :func:`~.tuned._trained_on` writes them (12 hex digits, ``*`` for uncommitted changes; compared without it).
    """
    path = Path(out_dir).resolve().parent / TUNED_FOLDER / tuned.SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        theirs = json.loads(path.read_text())["trained_on"]
        tuned_commits = list(dict.fromkeys(c for g in theirs.values() for c in g["commits"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a tuned study's summary ({type(e).__name__}: {e}); the reuse check needs its "
                         "'trained_on' commits") from None
    ours = list(dict.fromkeys(c for g in trained_on.values() for c in g["commits"]))
    bare = {c.rstrip("*") for c in tuned_commits}
    return {"tuned": tuned_commits, "commits": ours, "shared": [c for c in ours if c.rstrip("*") in bare]}


def controls_summary(out_dir: str | os.PathLike, summary: Mapping[str, Any], config: Any,
                     arms: Sequence[str] | None = None, *, figures: bool = True) -> dict[str, Any]:
    """What the controls add to the tuned summary (``summary["controls"]``): the rules, the stable ranges, the
    warm-up comparisons, the final cell's every-step records, and the figures (drawn into ``out_dir``)."""
    out_dir = Path(out_dir)
    own = int(config.warmup_fraction * config.total_steps)
    grid = tuned.read_grid(out_dir)
    warmup = {}
    for steps, w in tuned.warmup_grids(out_dir).items():
        for arm in w["grid"]["finals"]:
            if arms is None or arm in arms:
                c = warmup_comparison(grid, w["grid"], arm)
                if c is not None:
                    warmup.setdefault(str(steps), {})[arm] = c
    final_arms = summary["final"]["arms"]
    done, _ = tuned._finished(out_dir / tuned.FINAL_DIR)  # the final runs, read once for the steps and the reach
    final_steps = _final_steps(out_dir, final_arms, done)
    drawn = [] if not figures else [name for name, plot in ((STEPS_FIGURE, plot_steps),
                                                             (LAYERS_FIGURE, plot_step_layers))
                                    if plot(final_steps, out_dir / name) is not None]
    carried = _carried_over(out_dir)
    return {"rules": _rules(), "own_warmup_steps": own, "reuse": reuse_check(out_dir, summary["trained_on"]),
            "stable_range": _stable_ranges(out_dir, config, summary["selection"], arms),
            "warmup": warmup, "final_steps": {a: _final_step_summary(r) for a, r in final_steps.items()},
            "reach": _reach_all(done, config, final_arms),
            "figures": drawn, **({"carried_over": carried} if carried is not None else {})}


def _carried_over(out_dir: Path) -> dict[str, Any] | None:
    """What :data:`CARRIED_FILE` of a study folder says of the runs it copied from another study (where from, why,
    the commits that trained them, how many), or ``None`` without the file."""
    path = out_dir / CARRIED_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    out = {"from": data["from"], "why": data["why"], "trained_on": list(data["trained_on"]), "runs": len(data["runs"])}
    final = data.get("final")
    if final is not None:  # final runs carried by experiments.lm.carry
        out["final"] = {"from": final["from"], "why": final["why"], "trained_on": list(final["trained_on"]),
                        "runs": len(final["runs"]),
                        "arms": sorted({run.split("/")[2] for run in final["runs"]})}
        code = out_dir / "code_path.json"  # experiments.lm.carry.CODE_PATH_FILE (that module imports this one)
        if code.exists():
            checked = json.loads(code.read_text())
            out["final"]["against_record"] = {arm: checked["arms"][arm]["against_source_record"]
                                              for arm in out["final"]["arms"] if arm in checked["arms"]}
            out["final"]["check"] = {"epochs": checked["epochs"], "seed": checked["seed"],
                                     "machine": checked["machine"].get("cpu_model")}
    return out


def finalize_controls(out_dir: str | os.PathLike, config_type: type, *, arms: Sequence[str] | None = None,
                      figures: bool = True) -> StudyOutputs:
    """Write ``summary.json``, ``report.md``, ``lr_grid.png``, ``steps.png`` and ``steps_layers.png`` of the
    controls study in ``out_dir``, from its records only (the tuned report, :func:`~.tuned.tuned_summary` with
    :data:`CONTROL_BASELINES`, plus the sections of :func:`controls_lines`). ``figures=False`` draws only the lr
    grid (quicker; the report then links no every-step figure)."""
    from ..harness.report import write_text

    out_dir = Path(out_dir)
    summary, config, figure = tuned.tuned_summary(out_dir, config_type, arms=arms, baselines=CONTROL_BASELINES,
                                                  title=report_title(out_dir))
    summary["controls"] = controls_summary(out_dir, summary, config, arms, figures=figures)
    lines = tuned._render(summary, config, extra=controls_lines(summary))
    summary_path = out_dir / tuned.SUMMARY_FILE
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    report_path = write_text(out_dir / tuned.REPORT_FILE, "\n".join(lines))
    paths = {} if figure is None else {"lr_grid": figure}
    paths.update({Path(f).stem: out_dir / f for f in summary["controls"]["figures"]})
    return StudyOutputs(summary=summary, summary_path=summary_path, report_path=report_path, figures=paths)


# ---------------------------------------------------------------------------------------------- report
_f = tuned._f
_lr = tuned._lr_text


def _g(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def _range_text(r: Mapping[str, Any]) -> str:
    if not r["within"]:
        return "none (the best point itself diverged)"
    span = _lr(r["low"]) if r["low"] == r["high"] else f"{_lr(r['low'])}–{_lr(r['high'])}"
    return f"{span} ({len(r['within'])} grid lr{'s' if len(r['within']) != 1 else ''})"


def _diverges_text(r: Mapping[str, Any]) -> str:
    if r["diverges_at"] is not None:
        return f"diverges first at lr {_lr(r['diverges_at'])}"
    if r["highest_lr"] == r["best_lr"]:
        return "no lr above the best was tried"
    return f"no divergence up to lr {_lr(r['highest_lr'])}"


def controls_lines(summary: Mapping[str, Any]) -> list[str]:
    """The controls' sections of ``report.md`` (before its "Run" section)."""
    c = summary["controls"]
    rules = c["rules"]
    lines = ["## 4. Stable lr range per arm (validation)", "",
             f"Per grid: the lrs whose mean final validation bpb is within {rules['stable_bpb']:g} of the arm's best, "
             f"and the first lr above the best that diverges: a grid point diverges when any of its seeds ends with a "
             f"final validation bpb that is not finite or more than {rules['diverge_bpb']:g} above the arm's best, or "
             f"logged a non-finite training loss. Spikes are counted in each run's `steps.jsonl`: a loss spike starts "
             f"at a step whose training loss exceeds {rules['spike_factor']:g}× the median of the "
             f"{rules['spike_window']} steps before it (consecutive such steps are one spike); a gradient spike "
             f"likewise with the gradient norm before clipping and {rules['grad_spike_factor']:g}×.", "",
             "| arm | warm-up steps | best lr | best val bpb | lrs within the band | first divergence above the best |",
             "|---|---|---|---|---|---|"]
    for g in c["stable_range"]:
        for arm, r in g["arms"].items():
            lines.append(f"| {arm} | {g['warmup_steps']} | {_lr(r['best_lr'])} | {_f(r['best_mean'])} | "
                         f"{_range_text(r)} | {_diverges_text(r)} |")
    lines += ["", "Every grid point (loss and gradient spikes summed over its seeds; the largest attention logit "
              "and the smallest attention entropy over its seeds, steps and layers):", "",
              "| arm | warm-up steps | lr | val bpb (per seed) | in band | loss spikes | gradient spikes | "
              "largest logit | smallest entropy | diverged |", "|---|---|---|---|---|---|---|---|---|---|"]
    for g in c["stable_range"]:
        for arm, r in g["arms"].items():
            for p in r["points"]:
                seeds = ", ".join(f"{_f(v)}" for v in p["per_seed"].values())
                lines.append(f"| {arm} | {g['warmup_steps']} | {_lr(p['lr'])} | {_f(p['mean'])} ({seeds}) | "
                             f"{'yes' if p['within'] else 'no'} | {'–' if p['loss_spikes'] is None else p['loss_spikes']}"
                             f" | {'–' if p['grad_spikes'] is None else p['grad_spikes']} | {_g(p['logit_max'])} | "
                             f"{_g(p['entropy_min'])} | {'; '.join(p['why']) if p['diverged'] else 'no'} |")
    lines += ["", f"## 5. Warm-up against the study's own ({c['own_warmup_steps']} steps)", ""]
    if not c["warmup"]:
        lines += ["No `warmup-<n>/` grid on record yet.", ""]
    else:
        lines += ["Final validation bpb of the warm-up grid minus the study's grid, paired by lr and seed over the "
                  "points both hold (validation only; pairs at different lrs share a seed, so this describes, it "
                  "does not test). The recipe each arm's final cell trains is in section 1.", "",
                  "| arm | warm-up steps | lrs | pairs | mean Δ val bpb | 95% CI | lower / higher |",
                  "|---|---|---|---|---|---|---|"]
        for steps, per_arm in c["warmup"].items():
            for arm, w in per_arm.items():
                ci = "–" if w["ci_low"] is None else f"[{_f(w['ci_low'], sign=True)}, {_f(w['ci_high'], sign=True)}]"
                lines.append(f"| {arm} | {steps} | {', '.join(map(_lr, w['lrs']))} | {w['n']} | "
                             f"{_f(w['mean'], sign=True)} | {ci} | {w['n_negative']} / {w['n_positive']} |")
        lines.append("")
    lines += ["## 6. Every training step of the final cell", ""]
    steps = c["final_steps"]
    if not steps:
        lines += ["No finished final run with `steps.jsonl` yet.", ""]
    else:
        lines += ["Per arm, over the final seeds' every-step records (rules as in section 4; the logit and entropy "
                  "columns: the extreme over seeds and steps, per layer from the first layer):", "",
                  "| arm | seeds | loss spikes (runs with any) | gradient spikes (runs with any) | largest gradient norm | "
                  "largest attention logit, per layer | smallest attention entropy, per layer | runs with a "
                  "non-finite loss |", "|---|---|---|---|---|---|---|---|"]
        for arm, s in steps.items():
            lines.append(f"| {arm} | {len(s['seeds'])} | {s['loss_spikes']} ({s['runs_with_loss_spikes']}) | "
                         f"{s['grad_spikes']} ({s['runs_with_grad_spikes']}) | {_g(s['grad_norm_max'])} | "
                         f"{_g(s['logit_max'])}: {', '.join(map(_g, s['logit_max_per_layer']))} | "
                         f"{_g(s['entropy_min'])}: {', '.join(map(_g, s['entropy_min_per_layer']))} | "
                         f"{s['runs_with_nonfinite_loss']} |")
        lines.append("")
        captions = {STEPS_FIGURE: "training loss, gradient norm, largest attention logit (max over layers) and "
                                  "smallest attention entropy (min over layers) per arm: median over seeds, band "
                                  "min-max",
                    LAYERS_FIGURE: "largest attention logit and smallest attention entropy per layer and arm: "
                                   "median over seeds"}
        lines += [line for f in c["figures"] for line in (f"![{captions[f]}]({f})", "")]
    if c.get("reach"):
        lines += ["**Steps to reach `adamw`'s final test bpb** (per seed; evaluations every "
                  f"{summary['config']['steps_per_epoch']} steps, so each step found is an upper bound of the "
                  "crossing and each efficiency a lower bound):", "",
                  *(f"- {_reach_text(r)}." for r in c["reach"]), ""]
    lines += ["## 7. The study's questions", "", *readme_paragraph(summary), ""]
    lines += ["## 8. Runs carried over from the tuned study", "", _reuse_text(c.get("reuse")), ""]
    carried = c.get("carried_over")
    if carried is not None:
        lines += [f"**{carried['runs']} runs copied unchanged from `{carried['from']}`** ({carried['why']}; trained on "
                  f"{', '.join(sha[:12] for sha in carried['trained_on'])}; listed in `{CARRIED_FILE}`): the Run "
                  "section below names their commit beside this study's own.", ""]
        final = carried.get("final")
        if final is not None:
            lines += [f"**{final['runs']} final runs copied unchanged from `{final['from']}`** (arms "
                      f"{', '.join(f'`{a}`' for a in final['arms'])}: {final['why']}; trained on "
                      f"{', '.join(sha[:12] for sha in final['trained_on'])}; listed under `final` in `{CARRIED_FILE}`, "
                      f"the check in `code_path.json`).", ""]
            if final.get("check"):
                lines += [_against_record_text(final), ""]
    return lines


def _against_record_text(final: Mapping[str, Any]) -> str:
    """Whether the code-path check's run on this study's commit reproduced the carried records (another machine
    may round differently), arm by arm."""
    check = final["check"]
    same = [a for a, d in final["against_record"].items() if d is None]
    parts = [f"`{a}` first differs at {d['file']} record {d['record']} `{d['key']}` ({d['a']!r} here, {d['b']!r} on "
             "record)" for a, d in final["against_record"].items() if d is not None]
    if same:
        parts.append(f"{', '.join(f'`{a}`' for a in same)} reproduce{'s' if len(same) == 1 else ''} it bit for bit")
    return (f"Retrained for {check['epochs']} epochs of seed {check['seed']} on this study's commit and machine "
            f"({check['machine'] or 'CPU unrecorded'}), against the carried record of that seed: {'; '.join(parts)}. "
            "A difference here, with the code path unchanged, is the rounding of another CPU's kernels: the carried "
            "runs are what their recipe gives on the machine that trained them.")


def _reuse_text(r: Mapping[str, Any] | None) -> str:
    if r is None:
        return (f"Not checked: no `{TUNED_FOLDER}/{tuned.SUMMARY_FILE}` beside this folder to compare commits with.")
    if r["shared"]:
        return (f"**Runs trained on a commit of the tuned study** ({', '.join(r['shared'])}): they were carried over "
                "from `runs/tuned`, which issue 42 allows only once two of them, retrained, reproduce their records.")
    return (f"None: every run here was trained on {', '.join(r['commits']) or 'no commit on record'}, none on the "
            f"tuned study's commits ({', '.join(r['tuned'])}). The study retrained every arm rather than reuse runs "
            "of `runs/tuned` (issue 42 allows that only after two retrained runs reproduce their records).")


# ---------------------------------------------------------------------------------------------- README
def _comparison(comparisons: Mapping[str, Mapping[str, Any]], a: str, b: str, prefix: str = "test"
                ) -> dict[str, Any] | None:
    """The comparison ``a - b`` of ``comparisons`` (recorded either way round; flipped where it is ``b - a``)."""
    c = comparisons.get(f"{prefix}: {a} - {b}")
    if c is not None:
        return copy.copy(c)  # a copy that still knows its place in a summary read from disk (_SummaryNode)
    c = comparisons.get(f"{prefix}: {b} - {a}")
    if c is None:
        return None
    flip = copy.copy(c)
    flip["mean"] = None if c["mean"] is None else -c["mean"]
    flip["ci_low"], flip["ci_high"] = (None, None) if c["ci_low"] is None else (-c["ci_high"], -c["ci_low"])
    flip["n_positive"], flip["n_negative"] = c["n_negative"], c["n_positive"]
    return flip


def _resolved(c: Mapping[str, Any]) -> bool:
    return (c["n"] >= tuned.MIN_SEEDS_FOR_CLAIM and c.get("p_holm") is not None and c["p_holm"] < tuned.ALPHA)


def _claim(comparisons: Mapping[str, Mapping[str, Any]], a: str, b: str, prefix: str = "test") -> str:
    """``a`` against ``b`` in words, by :func:`~.tuned.reading`: "is lower/higher" only when resolved
    (:data:`~.tuned.MIN_SEEDS_FOR_CLAIM` pairs and a Holm-adjusted paired-t p below :data:`~.tuned.ALPHA`);
    "suggested" where the unadjusted 95% interval excludes 0, with the unadjusted p; otherwise "not resolved", with
    the interval and the smallest difference the pairs could have detected (:func:`~.tuned.detectable_text`), never
    a direction or sameness. Each with its interval, pairs and both Holm-adjusted p-values; at equal wall-clock,
    how the pair was read (:func:`~.tuned.read_text`)."""
    c = _comparison(comparisons, a, b, prefix)
    kind = "none" if c is None else tuned.reading(c)
    if kind == "none":
        return f"`{a}` and `{b}` have no pairs yet"
    direction = tuned._direction(c["mean"])
    ci = "" if c["ci_low"] is None else f"95% CI of the difference {c['ci_low']:+.4f} to {c['ci_high']:+.4f}; "
    p = "–" if c.get("p_holm") is None else f"{c['p_holm']:.2g}"
    sp = "–" if c.get("sign_test_p_holm") is None else f"{c['sign_test_p_holm']:.2g}"
    side = (f"{direction} on {c['n_negative' if direction == 'lower' else 'n_positive']} of them" if direction != "equal"
            else f"{c['n_negative']} negative and {c['n_positive']} positive differences")
    holm = f"Holm-adjusted p: paired t {p}, sign test {sp}"
    how = tuned.read_text(c)
    how = "" if not how else f", {how}"
    if kind == "resolved":
        return f"`{a}`'s test bpb is {direction} than `{b}`'s by {abs(c['mean']):.4f} ({ci}{c['n']} pairs, {side}; {holm}){how}"
    if kind == "suggested":
        raw = "–" if c.get("p_value") is None else f"{c['p_value']:.2g}"
        return (f"suggested, not resolved: `{a}`'s test bpb is {direction} than `{b}`'s by {abs(c['mean']):.4f} "
                f"(unadjusted {ci}{c['n']} pairs, {side}; unadjusted paired-t p {raw}; {holm}){how}")
    mde = tuned.detectable_text(c)
    head = (f"`{a}`'s test bpb equals `{b}`'s on average, not resolved (mean difference 0; " if direction == "equal"
            else f"not resolved: `{a}` − `{b}` is {c['mean']:+.4f} bpb (")
    return head + f"{ci}{c['n']} pairs, {side}; {holm})" + (f"; {mde}" if mde else "") + how


def _lead(verdict: str, claim: str) -> str:
    """``verdict`` then ``claim``: after a verdict that ends a sentence, the claim starts one."""
    return verdict + (claim[0].upper() + claim[1:] if verdict.endswith(". ") else claim)


def _verdict(c: Mapping[str, Any] | None, better: str, worse: str, unresolved: str) -> str:
    if c is None or c["mean"] is None or not _resolved(c):
        return unresolved
    return better if c["mean"] < 0 else worse


def _final_complete(summary: Mapping[str, Any]) -> bool:
    final, sel = summary["final"], summary["selection"]["arms"]
    return (bool(final["arms"]) and set(final["arms"]) == set(sel) and not final["in_progress"]
            and len({tuple(final["seeds"][a]) for a in final["arms"]}) == 1)


def _range_of(summary: Mapping[str, Any], arm: str, steps: int | None = None) -> str:
    c = summary["controls"]
    steps = c["own_warmup_steps"] if steps is None else steps
    g = next((g for g in c["stable_range"] if g["warmup_steps"] == steps and arm in g["arms"]), None)
    if g is None:
        return f"`{arm}`: no grid at warm-up {steps}"
    r = g["arms"][arm]
    return f"`{arm}` {_range_text(r)}, {_diverges_text(r)}"


def _logit_of(summary: Mapping[str, Any], arm: str) -> str:
    s = summary["controls"]["final_steps"].get(arm)
    return f"`{arm}` –" if s is None or s["logit_max"] is None else f"`{arm}` {s['logit_max']:.1f}"


def _and(arms: Sequence[str]) -> str:
    """```a```, ```a`` and ``b```, ```a``, ``b`` and ``c```."""
    names = [f"`{a}`" for a in arms]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _tuned_for_some(summary: Mapping[str, Any]) -> str:
    """Which arms had a warm-up grid (``warmup-<n>/``) and which did not, in words (``""`` when every arm had the
    same): a knob tuned for some compared arms only is said beside the comparison (DESIGN.md, "Controls")."""
    c = summary["controls"]
    arms = list(summary["selection"]["arms"])
    parts = []
    for g in c["stable_range"]:
        if g["warmup_steps"] == c["own_warmup_steps"]:
            continue
        tried = [a for a in arms if a in g["arms"]]
        others = [a for a in arms if a not in g["arms"]]
        if tried and others:
            chose = [a for a in tried if ((summary.get("recipes") or {}).get(a) or {}).get("warmup_steps")
                     == g["warmup_steps"]]
            which = ("none" if not chose else "both" if len(chose) == len(tried) == 2 else
                     "all" if len(chose) == len(tried) else _and(chose))
            parts.append(f"warm-up {g['warmup_steps']} was offered to {_and(tried)} only ({which} chose it); "
                         f"{_and(others)} ran at warm-up {c['own_warmup_steps']} only")
    if not parts:
        return ""
    return ("Not on level ground: " + "; ".join(parts) + ", so a comparison between the two groups was not tuned "
            "alike. ")


def readme_paragraph(summary: Mapping[str, Any]) -> list[str]:
    """The answers to the study's three questions, in plain words, from a controls ``summary.json`` (its final
    comparisons, stable ranges, warm-up comparisons and every-step records): each claim with its interval, its
    number of pairs and the Holm-adjusted p-values, "suggest" unless resolved. :data:`README_IN_PROGRESS` (no
    number) until the final cell is complete (:func:`~.tuned.readme_table`'s condition). A summary without
    ``controls`` (not the controls study's) is a :class:`KeyError`, never the in-progress text."""
    c = summary["controls"]  # every controls summary has it: one without is not the controls study's
    if not _final_complete(summary):
        return [README_IN_PROGRESS]
    comps = summary["final"]["comparisons"]
    rules = c["rules"]
    final = summary["final"]
    n_seeds = len(next(iter(final["seeds"].values())))

    geometry = _comparison(comps, "stiefel", "adamw-qknorm")
    # the level-ground study (issue 57) adds the frames with a learned logit gain, the scale QK-norm has
    gain = LEVEL_ARM in final["seeds"]
    shown = ("stiefel", LEVEL_ARM, "adamw-qknorm", "adamw") if gain else ("stiefel", "adamw-qknorm", "adamw")
    q1 = ("**Geometry or logit control?** "
          + _lead(_verdict(geometry, "The frames do more than bound the logits: ", "Bounding the logits is enough "
                           "here, and QK-norm does better than the frames: ", "This study does not separate the "
                           "geometry from logit control. "), _claim(comps, "stiefel", "adamw-qknorm"))
          + ". " + _tuned_for_some(summary)
          + ("" if not gain else "With a learned logit gain per head, the scale QK-norm learns too: "
             + _claim(comps, LEVEL_ARM, "adamw-qknorm") + ". ")
          + "QK-norm alone against AdamW: "
          + _claim(comps, "adamw-qknorm", "adamw") + "; the frames against AdamW: " + _claim(comps, "stiefel", "adamw")
          + ("" if not gain else "; the frames with the gain against AdamW: " + _claim(comps, LEVEL_ARM, "adamw"))
          + f". The largest attention logit of any training step (over the layers and the {n_seeds} final seeds) was "
          + ", ".join(_logit_of(summary, a) for a in shown)
          + f". Stable lr range (grid lrs within {rules['stable_bpb']:g} bpb of the best, validation): "
          + "; ".join(_range_of(summary, a) for a in shown) + ".")

    recipe = (summary.get("recipes") or {}).get("adamw")
    own = c["own_warmup_steps"]
    warm_parts = []
    for steps, per_arm in c["warmup"].items():
        w = per_arm.get("adamw")
        if w is None or w["mean"] is None:
            continue
        ci = "" if w["ci_low"] is None else f" (95% CI {w['ci_low']:+.4f} to {w['ci_high']:+.4f})"
        on = f"on the grid (validation, {w['n']} pairs of lr and seed at lr {', '.join(map(_lr, w['lrs']))})"
        warm_parts.append(
            f"{on} warm-up {steps} gives the same mean validation bpb as warm-up {own} (mean difference 0){ci}"
            if w["mean"] == 0 else
            f"{on} the data suggest warm-up {steps} gives {tuned._direction(w['mean'])} validation bpb than warm-up "
            f"{own} by {abs(w['mean']):.4f}{ci}")
    chosen = ("" if recipe is None else
              f"; the selection trains the final cell at warm-up {recipe['warmup_steps'] or own}, lr {_lr(recipe['lr'])}")
    warm = ("Warm-up: " + "; ".join(warm_parts) + chosen + ". ") if warm_parts else (
        f"Warm-up: no warm-up grid of `adamw` on record{chosen}. ")
    s = c["final_steps"].get("adamw")
    spikes = ("" if s is None else
              f"In the final cell's every-step records `adamw` had {s['loss_spikes']} loss spike(s) in "
              f"{s['runs_with_loss_spikes']} of {len(s['seeds'])} runs (a step's loss above "
              f"{rules['spike_factor']:g}× the median of the {rules['spike_window']} steps before it), "
              f"{s['runs_with_nonfinite_loss']} run(s) with a non-finite loss, and a largest gradient norm of "
              f"{_g(s['grad_norm_max'])}. ")
    ranges = "; ".join([_range_of(summary, "adamw")] + [
        _range_of(summary, "adamw", g["warmup_steps"]).replace("`adamw`", f"at warm-up {g['warmup_steps']}:", 1)
        for g in c["stable_range"] if g["warmup_steps"] != own and "adamw" in g["arms"]])
    q2 = ("**Is the AdamW baseline stable?** " + warm
          + f"Stable lr range at warm-up {own}: {ranges}. " + spikes
          + "Against Muon, at its recipe: " + _claim(comps, "muon", "adamw")
          + "".join(f"; {_reach_text(r)}" for r in c.get("reach", ()) if r["arm"] == "muon") + ".")

    frames = [_comparison(comps, a, "muon") for a in ("stiefeladam-muon", "stiefelmuon-muon")]
    helps = [f for f in frames if f is not None and f["mean"] is not None and _resolved(f)]
    verdict = ("This study does not show the constraint helping beside Muon. " if not helps else
               "The constraint helps beside Muon: " if all(f["mean"] < 0 for f in helps) else
               "The constraint costs test bpb beside Muon: " if all(f["mean"] > 0 for f in helps) else
               "The two frame optimizers beside Muon disagree: ")
    q3 = ("**Beside Muon, does the constraint help?** " + _lead(verdict, _claim(comps, "stiefeladam-muon", "muon"))
          + "; " + _claim(comps, "stiefelmuon-muon", "muon") + ".")
    wall = (summary.get("equal_wallclock") or {}).get("comparisons") or {}
    if wall:
        q3 += (" At equal wall-clock (within the fastest arm's full-run time, each pair read by the report's rule, "
               "section 3): "
               + _claim(wall, "stiefeladam-muon", "muon") + "; " + _claim(wall, "stiefelmuon-muon", "muon") + ".")
    diverged = [] if not final.get("diverged") else ["", tuned._diverged_text(final["diverged"], "final test bpb")]
    return [q1, "", q2, "", q3, *diverged]


def _readme_block(text: str, study: str = "controls") -> str | None:
    begin, end, _, _ = study_block(study)
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def readme_problems(readme_text: str, summary: Mapping[str, Any] | None, study: str = "controls") -> list[str]:
    """What is wrong with the README's paragraph of ``study`` (:func:`study_block`): missing markers; with no
    ``summary`` (no records yet), anything other than its placeholder; with one, a block other than
    :func:`readme_paragraph`'s, and every decimal number it quotes that the summary does not give
    (:func:`~.tuned.numbers_not_in_summary`). Empty: the README agrees with the summary."""
    begin, end, placeholder, _ = study_block(study)
    block = _readme_block(readme_text, study)
    if block is None:
        return [f"the README lacks the markers {begin!r} and {end!r}"]
    if summary is None:
        return [] if block == placeholder else ["no summary.json yet, but the README's block is not the "
                                                "in-progress placeholder"]
    problems = []
    if block != "\n".join(readme_paragraph(summary)):
        problems.append("the README's block is not readme_paragraph(summary.json): regenerate it "
                        "(python -m experiments.lm.controls_report readme)")
    problems += [f"{n} is quoted but summary.json gives no such number" for n in
                 tuned.numbers_not_in_summary(block, summary)]
    return problems


def write_readme(readme: str | os.PathLike = README, summary: Mapping[str, Any] | None = None,
                 study: str = "controls") -> bool:
    """Replace the README's block of ``study`` by :func:`readme_paragraph` of ``summary`` (the study's placeholder
    without one); returns whether the file changed."""
    begin, end, placeholder, _ = study_block(study)
    path = Path(readme)
    text = path.read_text()
    if _readme_block(text, study) is None:
        raise ValueError(f"{path}: lacks the markers {begin!r} and {end!r}; add them first.")
    body = "\n".join(readme_paragraph(summary)) if summary is not None else placeholder
    head, rest = text.split(begin, 1)
    new = head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1]
    if new != text:
        path.write_text(new)
    return new != text


PROG = "python -m experiments.lm.controls_report"


class SummaryKeyError(KeyError):
    """A key that the README paragraph reads is missing from a summary read by :func:`_read_summary`; ``where``
    is its place in the summary, e.g. ``["final"]["in_progress"]``. A :class:`KeyError`, so a caller catching one
    still does; the command line says it in one line naming the file (exit status 2)."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


class _SummaryNode(dict):
    """A JSON object of a summary read from disk that knows its place in the summary: a missing key
    (``node[key]``, not ``node.get(key)``, which stays the way to read an optional key) raises
    :class:`SummaryKeyError` naming the whole path, not a bare :class:`KeyError` naming the last key."""

    def __init__(self, items: Any = (), where: str = ""):
        super().__init__(items)
        self.where = where

    def __missing__(self, key: Any):
        raise SummaryKeyError(f"{self.where}[{json.dumps(key)}]")


def _located(value: Any, where: str = "") -> Any:
    """``value`` (parsed JSON) with every object a :class:`_SummaryNode` that knows its place."""
    if isinstance(value, dict):
        return _SummaryNode({k: _located(v, f"{where}[{json.dumps(k)}]") for k, v in value.items()}, where)
    if isinstance(value, list):
        return [_located(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _read_summary(path: Path, given: bool) -> dict[str, Any] | None:
    """The summary at ``path``: ``None`` when the default one does not exist yet (no records: the placeholder);
    a :class:`~geoopt_stiefel_attention.argtypes.UsageError` naming the file when one given with ``--summary``
    does not exist, or when it is not a JSON object. Its objects say where they are: a key the README paragraph
    needs and the file lacks raises :class:`SummaryKeyError` naming the key's path (:func:`main` says it in one
    line)."""
    from geoopt_stiefel_attention.argtypes import UsageError

    if not path.exists():
        if given:
            raise UsageError(f"--summary {path}: no such file; pass the summary.json of the controls study.")
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--summary {path}: cannot be read as JSON ({err}); rebuild it with python -m experiments "
                         f"lm --report-only --out {path.parent}.") from None
    if not isinstance(summary, dict):
        raise UsageError(f"--summary {path}: holds a JSON {type(summary).__name__}, not a summary object; rebuild it "
                         f"with python -m experiments lm --report-only --out {path.parent}.")
    return _located(summary)


def main(argv: Sequence[str] | None = None) -> int:
    """``readme [--check] [--summary PATH] [--readme PATH]``: write (or with ``--check`` only check) the README's
    controls paragraph from the study's ``summary.json`` (the placeholder while there is none). A missing or
    unreadable file (the README, a summary given with ``--summary``, a corrupt summary, a summary that lacks a key
    the paragraph needs) is one line naming it (and the key), exit status 2, and changes nothing; a README that
    disagrees with ``--check``: one line per problem, exit status 1."""
    from geoopt_stiefel_attention.argtypes import UsageError
    from geoopt_stiefel_attention.cli import run_command

    from ..harness.cli_args import OneLineParser

    parser = OneLineParser(prog=PROG, description=main.__doc__)
    parser.add_argument("command", choices=("readme",))
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the README disagrees")
    parser.add_argument("--study", choices=STUDIES, default="controls",
                        help="whose paragraph: the controls study's (default) or the level-ground study's")
    parser.add_argument("--summary", default=None,
                        help="the study's summary (default records/<study>/summary.json, absent before its records)")
    parser.add_argument("--readme", default=str(README))
    a = parser.parse_args(argv)

    def run(a: argparse.Namespace) -> int:
        path = Path(a.summary or study_block(a.study)[3] / tuned.SUMMARY_FILE)
        summary = _read_summary(path, given=a.summary is not None)
        readme = Path(a.readme)
        if not readme.is_file():
            raise UsageError(f"--readme {readme}: no such file; pass the README that holds the controls block.")
        try:
            if a.check:
                problems = readme_problems(readme.read_text(), summary, a.study)
                for p in problems:
                    print(f"controls_report: {p}", file=sys.stderr)
                return 1 if problems else 0
            changed = write_readme(readme, summary, a.study)  # builds the whole block first: nothing changes
        except SummaryKeyError as err:
            raise UsageError(f"--summary {path}: lacks the key {err.where} that the README paragraph needs; rebuild "
                             f"it with python -m experiments lm --report-only --out {path.parent}.") from None
        except ValueError as err:  # the markers are missing
            raise UsageError(str(err)) from None
        print(f"controls_report: {a.readme} {'updated' if changed else 'already up to date'}")
        return 0

    return run_command(run, a, PROG)


if __name__ == "__main__":
    sys.exit(main())
