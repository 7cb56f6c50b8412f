r"""Tuned against tuned: a learning-rate grid per arm, a selection on validation, a final cell read once on test.

The language-model study (:mod:`~experiments.lm.study`) calls this module when it is given
``--lrs`` (the grid), ``--final-seeds`` (the final cell) or ``--time-steps`` (the timing pass); its
``--report-only`` calls :func:`finalize_tuned` on a folder laid out like this:

========================  ===============================================================================
folder                    what it holds
========================  ===============================================================================
``lr-<v>/runs/<arm>/``    the grid: every selected arm at learning rate ``v`` (``config.optim.lr``; each
                          arm's frames follow its ``adjust_lr_fn`` rule, so ``v`` is the arm's one knob)
``final/runs/<arm>/``     the final cell: each arm at *its* selected lr, on the final seeds
``warmup-<n>/lr-<v>/``    optional: a grid of some arms at another warm-up (``n`` steps), laid out like the
                          study's own grid (:func:`select_recipes` weighs it in the selection)
``timing.json``           the timing pass: every arm's training step timed in one process, interleaved
``report.md``             the report (with ``summary.json`` and ``lr_grid.png``), a function of the files
                          above only (rebuilt byte for byte by ``--report-only``)
========================  ===============================================================================

**Selection** (:func:`select_lrs`). For arm :math:`a` with grid :math:`\eta_1 < \dots < \eta_K` (the lr cells
that hold runs of :math:`a`) and seeds :math:`S`, the score of :math:`\eta_k` is the mean over :math:`S` of the
final validation bits per byte; the selected lr is the argmin :math:`\eta_{k^*}`. It is *bracketed* when
:math:`1 < k^* < K` (a grid point on each side); otherwise the report says which edge and names the next value
to add, one grid ratio beyond it (:math:`\eta_K \cdot \eta_K/\eta_{K-1}` above, :math:`\eta_1 \cdot
\eta_1/\eta_2` below, a factor of 3 for a one-point grid). A grid point that lacks a seed the others have (or a
run that has not finished) is named; the final cell refuses to start on an incomplete or unbracketed selection
(the latter unless ``--allow-unbracketed``).

**Warm-up** (:func:`select_recipes`). Where ``warmup-<n>/`` grids exist, an arm's recipe is the grid point of
lowest mean validation bpb among its selected lr (at the study's own warm-up) and its points in those grids (on
the same seeds); the final cell trains each arm at its recipe's lr and warm-up.

**Final cell.** Every arm at its selected lr (``run_cells(arm_config=...)``) on the final seeds: a seed fixes
the initial weights and the order of the training windows, so the arms are paired by seed. The final seeds are
disjoint from the grid's (refused otherwise): a run of the final cell never repeats a grid run that won the
selection, so its test readout is independent of the selection (no winner's curse). The test split is
read once, here: test bits per byte per arm with a Student-t 95% interval, and paired differences against
``adamw`` and against ``muon`` (paired t, sign test, Holm's adjustment over the family of every comparison of
the table), overall and per category (``code``, ``prose``, ``data``). Every run evaluates every split (one
training loop), so the grid's records hold test numbers too; :func:`read_grid` reads only the final validation
bpb, and nothing reads the grid's test numbers. A final run whose test bpb is not finite (it diverged) is listed
in the report and left out of the means and the pairs. Records that contradict each other are refused, naming
them (:class:`~experiments.harness.records.InconsistentRecordsError`): runs of one grid cell, or final runs of one
arm, at different lrs; finished runs of different lengths; two records of one run at one epoch. Only
``runs/<arm>/seed<digits>/`` folders are runs (a copy such as ``seed0-old`` is not read).

**Equal wall-clock** (:func:`equal_wallclock`). With :math:`t_a` the median seconds per training step of arm
:math:`a` in the timing pass and :math:`N` the steps of a full run, the common budget is the fastest arm's full
run, :math:`T = N \min_a t_a` (the largest budget that every arm's records cover). Arm :math:`a` fits
:math:`n_a = \lfloor T / t_a \rfloor` steps in it; its readout is the test bpb of its last evaluation at or
before step :math:`n_a` (records are written every ``eval_every`` epochs of ``steps_per_epoch`` steps), overall
and per category, compared as in the final cell. A slower
arm is read mid-schedule (its cosine decay has not finished), which favours the faster arms: an upper bound on
what equal wall-clock costs the slower ones, not a run trained for that budget. The step times are measured with
noise, so each pair :math:`(a, b)` is read by one of two rules (:func:`wallclock_rule`, named in the report per
row): with :math:`r_a = \max - \min` of arm :math:`a`'s seconds per step over the timing rounds, the *timing
noise* of the pair is :math:`\max(r_a, r_b)`; where :math:`|t_a - t_b|` is below it (the arms' speeds are not
resolved), both are read at the same step, their last evaluation at or before :math:`\min(n_a, n_b)` ("same
step"); otherwise each at its own :math:`n_a` ("budget"). A readout that moved by an evaluation interval on a
step-time difference within the noise would otherwise turn timing noise into a bpb difference.

**What a comparison may say** (:func:`reading`). "Is lower/higher" only when resolved: at least
:data:`MIN_SEEDS_FOR_CLAIM` pairs and a Holm-adjusted paired-t p below :data:`ALPHA`. Otherwise "suggested"
where the unadjusted 95% interval excludes 0, and "not resolved" where it does not, stated with the interval and
the smallest difference the pairs could have detected at :data:`POWER`
(:func:`~experiments.harness.stats.min_detectable_difference`, noncentral t) at :data:`ALPHA` and at the Holm
level :data:`ALPHA` / m, m the comparisons of the family: a null is not sameness.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..harness.study import Cell, StudyOutputs

__all__ = ["GRID_PREFIX", "FINAL_DIR", "TIMING_FILE", "BASELINES", "CATEGORY_SETS", "MIN_SEEDS_FOR_CLAIM",
           "IncompleteSelectionError", "grid_cells", "with_lr", "is_tuned_folder", "read_grid", "select_lrs",
           "WARMUP_PREFIX", "warmup_grids", "select_recipes", "with_recipe", "top_points", "confirm_recipes",
           "SELECTION_FILE",
           "final_cell", "time_arms", "equal_wallclock", "wallclock_rule", "wallclock_comparisons", "POWER",
           "tuned_comparisons", "run_tuned", "finalize_tuned",
           "readme_table", "numbers_not_in_summary", "find_config", "tuned_summary"]

#: Folder prefix of the grid's cells (``lr-0.003``).
GRID_PREFIX = "lr-"
#: Folder of the final cell.
FINAL_DIR = "final"
#: Folder prefix of a grid at another warm-up (``warmup-400``: 400 warm-up steps).
WARMUP_PREFIX = "warmup-"
#: The timing pass's file in the study folder.
TIMING_FILE = "timing.json"
#: The arms every other arm is compared with, when they ran.
BASELINES = ("adamw", "muon")
#: Evaluation sets of the test readout: the whole test split, then its categories.
CATEGORY_SETS = ("test", "test_code", "test_prose", "test_data")
#: Fewer paired seeds than this, or an unresolved difference: the report never says "is" (:func:`reading`).
MIN_SEEDS_FOR_CLAIM = 5
#: Family-wise level of the Holm-adjusted statements.
ALPHA = 0.05
#: The power at which a comparison that is not resolved states the smallest difference the study could detect
#: (:func:`~experiments.harness.stats.min_detectable_difference`, noncentral t).
POWER = 0.8
#: Two learning rates closer than this (relative) are the same grid point. Learning rates travel as ``%g`` text
#: (six significant digits: command lines, folder names), so a planned lr such as best / sqrt(3) = 0.0099999955 and
#: its recorded run at 0.01 differ by up to 5e-6 relative; grid points differ by a factor of sqrt(3) or more.
LR_REL_TOL = 1e-5
#: Grid ratio assumed beyond the edge of a one-point grid.
DEFAULT_GRID_RATIO = 3.0
#: Arm order of tables and figures (others follow in name order); the controls study's arms (issue 42) included.
ARM_ORDER = ("adamw", "adamw-qknorm", "muon", "stiefel", "stiefel-gain", "stiefel-muon", "stiefeladam-muon",
             "stiefelmuon-muon")

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
FIGURE_FILE = "lr_grid.png"


class IncompleteSelectionError(ValueError):
    """The grid misses an arm, a seed at some grid point, or a run has not finished: the selection cannot be
    made (the message names every missing run)."""


# ---------------------------------------------------------------------------------------------- cells
def _lr_text(v: float) -> str:
    return f"{v:g}"


def with_lr(config: Any, lr: float) -> Any:
    """``config`` with ``optim.lr = lr`` (everything else, ``frame_lr`` and ``adjust_lr_fn`` included, kept)."""
    return dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=float(lr)))


def grid_cells(config: Any, lrs: Sequence[float]) -> list[Cell]:
    """One cell per learning rate of ``lrs`` (sorted), under ``lr-<v>``; refuses a non-positive or non-finite
    value and two values that name the same folder."""
    values = sorted({float(v) for v in lrs})
    for v in values:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--lrs: {v:g} must be a finite float > 0.")
    names = [_lr_text(v) for v in values]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"--lrs: values print as the same grid point ({', '.join(clash)}); give distinct values.")
    return [Cell(with_lr(config, v), f"{GRID_PREFIX}{_lr_text(v)}", "lr", v) for v in values]


def final_cell(config: Any) -> Cell:
    """The final cell (``final/``); each arm's lr comes from ``run_cells(arm_config=...)``."""
    return Cell(config, FINAL_DIR)


def _grid_folders(out_dir: Path) -> list[Path]:
    folders = [p for p in out_dir.glob(f"{GRID_PREFIX}*") if p.is_dir()]
    return sorted(folders, key=lambda p: float(p.name[len(GRID_PREFIX):]) if _is_float(p.name[len(GRID_PREFIX):])
                  else math.inf)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_tuned_folder(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` holds a tuned study (a grid cell or the final cell with runs)."""
    out_dir = Path(out_dir)
    folders = [*_grid_folders(out_dir), out_dir / FINAL_DIR]
    return any(_config_paths(f) for f in folders)


def find_config(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The plain-JSON config of the first run of a tuned study (final cell first, then the grid)."""
    out_dir = Path(out_dir)
    for folder in [out_dir / FINAL_DIR, *_grid_folders(out_dir)]:
        for path in _config_paths(folder):
            return json.loads(path.read_text())["config"]
    return None


# ---------------------------------------------------------------------------------------------- selection
def _runs(folder: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    from ..harness.records import group_runs, load_study_records

    return group_runs(load_study_records(folder)) if (folder / "runs").is_dir() else {}


def _config_paths(folder: Path) -> list[Path]:
    """The ``config.json`` of every run of ``folder`` (``runs/<arm>/seed<digits>/`` only: :func:`run_paths`)."""
    from ..harness.records import run_paths

    return run_paths(folder, "config.json")


def _configs(folder: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """``(arm, seed) ->`` the recorded config of every run of ``folder`` (the arm and seed from the run's folder,
    ``runs/<arm>/seed<k>``, as the records are grouped)."""
    from ..harness.records import seed_of

    return {(path.parent.parent.name, seed_of(path.parent)): json.loads(path.read_text())["config"]
            for path in _config_paths(folder)}


def _epochs(folder: Path) -> dict[tuple[str, int], int]:
    """Per run ``(arm, seed)``, the epochs it was configured for in ``folder`` (each run its own: a seed configured
    for fewer epochs than another of its arm has finished at its own count)."""
    return {key: int(config["train"]["epochs"]) for key, config in _configs(folder).items()}


def _lrs_by_value(lrs: Mapping[Any, float]) -> dict[float, list[Any]]:
    """``lrs`` (key -> lr) grouped by value (values within :data:`LR_REL_TOL` are one), in order of value."""
    groups: dict[float, list[Any]] = {}
    for key, lr in sorted(lrs.items(), key=lambda kv: (kv[1], str(kv[0]))):
        same = next((v for v in groups if math.isclose(v, lr, rel_tol=LR_REL_TOL)), None)
        groups.setdefault(lr if same is None else same, []).append(key)
    return groups


def _one_lr(folder: Path, lrs: Mapping[Any, float], what: str) -> float:
    """The one lr of ``lrs`` (key -> lr of each run); else
    :class:`~experiments.harness.records.InconsistentRecordsError` naming ``folder`` and each lr with its runs
    (``what``: the runs that must agree)."""
    from ..harness.records import InconsistentRecordsError

    groups = _lrs_by_value(lrs)
    if len(groups) > 1:
        found = "; ".join(f"lr {_lr_text(lr)}: " + ", ".join(_run_text(k) for k in keys) for lr, keys in groups.items())
        raise InconsistentRecordsError(
            f"{folder}: {what} were trained at different learning rates ({found}); one number cannot stand for "
            f"them. Move the runs at the wrong lr out of {folder} (or retrain them) and rebuild the report.")
    return next(iter(groups))


def _run_text(key: Any) -> str:
    return f"{key[0]} seed{key[1]}" if isinstance(key, tuple) else str(key)


def read_grid(out_dir: str | os.PathLike) -> dict[str, Any]:
    """The grid's records: ``{"finals": {arm: {lr: {seed: final val bpb}}}, "unfinished": [(arm, lr, seed,
    epoch, epochs)]}``, the lr read from each cell's recorded configs (not from its folder name), each run finished
    at its own configured epochs.

    Raises
    ------
    ~experiments.harness.records.InconsistentRecordsError
        The runs of one cell were trained at different lrs (the message names the cell and every lr found), or the
        finished runs of one arm for different numbers of epochs (its grid points would not be comparable).
    """
    from ..harness.records import InconsistentRecordsError

    out_dir = Path(out_dir)
    finals: dict[str, dict[float, dict[int, float]]] = {}
    unfinished: list[tuple[str, float, int, int, int]] = []
    lengths: dict[str, dict[int, list[str]]] = {}  # arm -> epochs -> its finished runs of that length
    for folder in _grid_folders(out_dir):
        configs = _configs(folder)
        if not configs:
            continue
        lr = _one_lr(folder, {key: float(c["optim"]["lr"]) for key, c in configs.items()}, "the runs of this grid cell")
        epochs = {key: int(c["train"]["epochs"]) for key, c in configs.items()}
        for arm, seeds in _runs(folder).items():
            for seed, recs in seeds.items():
                last, wanted = recs[-1], epochs.get((arm, seed))
                if wanted is not None and last["epoch"] >= wanted and last.get("val_bpb") is not None:
                    finals.setdefault(arm, {}).setdefault(lr, {})[seed] = float(last["val_bpb"])
                    lengths.setdefault(arm, {}).setdefault(wanted, []).append(f"{folder.name} seed{seed}")
                else:
                    unfinished.append((arm, lr, seed, int(last["epoch"]), -1 if wanted is None else wanted))
                    finals.setdefault(arm, {}).setdefault(lr, {})
    mixed = {arm: per for arm, per in lengths.items() if len(per) > 1}
    if mixed:
        found = "; ".join(f"{arm}: " + ", ".join(f"{n} epochs ({', '.join(runs)})" for n, runs in sorted(per.items()))
                          for arm, per in mixed.items())
        raise InconsistentRecordsError(
            f"{out_dir}: the finished grid runs of an arm were configured for different numbers of epochs ({found}); "
            f"the selection compares an arm's grid points at one length. Train them to the same --epochs (or move the "
            f"others out of {out_dir}).")
    return {"finals": finals, "unfinished": sorted(unfinished)}


def _order(arms: Iterable[str]) -> list[str]:
    arms = list(dict.fromkeys(arms))
    return [a for a in ARM_ORDER if a in arms] + sorted(a for a in arms if a not in ARM_ORDER)


def select_lrs(grid: Mapping[str, Any], *, arms: Sequence[str] | None = None,
               seeds: Sequence[int] | None = None, strict: bool = False) -> dict[str, Any]:
    """Each arm's selected learning rate from :func:`read_grid`'s records (module docstring: the rule).

    Parameters
    ----------
    grid : mapping
        :func:`read_grid`'s result.
    arms : sequence of str, optional
        The arms that must be in the grid (default: those that are).
    seeds : sequence of int, optional
        The seeds every grid point must have (default: every seed any grid point has).
    strict : bool
        Raise :class:`IncompleteSelectionError` naming what is missing (an arm, a seed at a grid point, an
        unfinished run); ``False``: select on the seeds each arm has at every one of its grid points, list
        what is missing under ``"missing"`` and warn.

    Returns
    -------
    dict
        ``{"arms": {arm: {"grid", "rows" [{lr, mean, per_seed}], "seeds", "best_lr", "bracketed", "edge",
        "diverged", "next_lr"}}, "seeds", "missing"}``. A grid point whose mean is not finite (a seed diverged) is
        listed under ``"diverged"``, warned about, and ranks below every finite point: a divergence above (below)
        the best lr brackets it from that side.
    """
    finals = grid["finals"]
    wanted = _order(arms if arms is not None else finals)
    expected = sorted(seeds) if seeds is not None else sorted(
        {s for a in finals.values() for per in a.values() for s in per})
    missing: list[str] = []
    for arm, lr, seed, epoch, epochs in grid.get("unfinished", []):
        if arm in wanted and seed in expected:
            missing.append(f"{arm} at lr {_lr_text(lr)} seed {seed} (at epoch {epoch} of {epochs})")
    out: dict[str, Any] = {}
    for arm in wanted:
        per_lr = finals.get(arm)
        if not per_lr:
            missing.append(f"{arm}: no grid runs (train it with --arms {arm} --lrs ...)")
            continue
        lrs = sorted(per_lr)
        for lr in lrs:
            absent = [s for s in expected if s not in per_lr[lr]]
            missing += [f"{arm} at lr {_lr_text(lr)} seed {s}" for s in absent
                        if not any(u[:3] == (arm, lr, s) for u in grid.get("unfinished", []))]
        common = sorted(set.intersection(*(set(per_lr[lr]) for lr in lrs)))
        if not common:
            missing.append(f"{arm}: no seed finished at every grid point")
            continue
        rows = [{"lr": lr, "mean": sum(per_lr[lr][s] for s in common) / len(common),
                 "per_seed": {str(s): per_lr[lr][s] for s in common}} for lr in lrs]
        # a diverged point (NaN or inf mean) scores inf: below every finite one (a NaN would never compare)
        scores = [r["mean"] if math.isfinite(r["mean"]) else math.inf for r in rows]
        diverged = [r["lr"] for r, score in zip(rows, scores, strict=True) if score == math.inf]
        if len(diverged) == len(rows):
            missing.append(f"{arm}: every grid point diverged (non-finite validation bpb); add smaller lrs")
            continue
        if diverged:
            warnings.warn(f"lr selection: {arm} diverged at lr {', '.join(map(_lr_text, diverged))} (non-finite "
                          f"validation bpb); such a point counts as worse than every finite one", stacklevel=2)
        k = min(range(len(rows)), key=scores.__getitem__)
        best = rows[k]["lr"]
        bracketed = 0 < k < len(rows) - 1
        edge = None if bracketed else ("only" if len(rows) == 1 else ("low" if k == 0 else "high"))
        if edge == "high":
            next_lr = best * best / rows[k - 1]["lr"]
        elif edge == "low":
            next_lr = best * best / rows[k + 1]["lr"]
        elif edge == "only":
            next_lr = best * DEFAULT_GRID_RATIO
        else:
            next_lr = None
        out[arm] = {"grid": lrs, "rows": rows, "seeds": common, "best_lr": best, "best_mean": rows[k]["mean"],
                    "bracketed": bracketed, "edge": edge, "diverged": diverged,
                    "next_lr": None if next_lr is None else float(f"{next_lr:.3g}")}
    if missing and strict:
        raise IncompleteSelectionError(
            "the lr grid is incomplete, so no lr can be selected yet: missing " + "; ".join(missing)
            + ". Run (or resume) the grid with --lrs and --seeds first.")
    if missing:
        warnings.warn("lr selection on an incomplete grid: missing " + "; ".join(missing), stacklevel=2)
    return {"arms": out, "seeds": expected, "missing": missing}


def _unbracketed_text(arm: str, sel: Mapping[str, Any]) -> str:
    where = {"high": "its largest", "low": "its smallest", "only": "its only"}[sel["edge"]]
    return (f"{arm}: best lr {_lr_text(sel['best_lr'])} is {where} grid value (add "
            f"{_lr_text(sel['next_lr'])}" + (f" and {_lr_text(sel['best_lr'] / DEFAULT_GRID_RATIO)}"
                                              if sel["edge"] == "only" else "") + ")")


# ---------------------------------------------------------------------------------------------- warm-up
def warmup_grids(out_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{steps: {"warmup_fraction", "grid"}}`` of every ``warmup-<steps>/`` folder of ``out_dir`` holding runs
    (``grid``: its :func:`read_grid`; the fraction as its runs recorded it)."""
    out = {}
    for folder in sorted(Path(out_dir).glob(f"{WARMUP_PREFIX}*")):
        steps = folder.name[len(WARMUP_PREFIX):]
        config = find_config(folder) if steps.isdigit() else None
        if config is not None:
            out[int(steps)] = {"warmup_fraction": float(config["warmup_fraction"]), "grid": read_grid(folder)}
    return dict(sorted(out.items()))


def select_recipes(selection: Mapping[str, Any], warmups: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Each arm's recipe: ``{"lr", "warmup_steps", "warmup_fraction", "mean"}``, the selected lr at the study's own
    warm-up (``warmup_steps`` ``None``) unless a point of a warm-up grid (:func:`warmup_grids`) has a lower mean
    final validation bpb over the seeds the arm's selection used (a point missing one of them, or not finite, is
    no candidate). The choice is made on validation only, like :func:`select_lrs`'."""
    out = {}
    for arm, s in selection["arms"].items():
        best = {"lr": s["best_lr"], "warmup_steps": None, "warmup_fraction": None, "mean": s["best_mean"]}
        for steps, w in warmups.items():
            for lr, per_seed in w["grid"]["finals"].get(arm, {}).items():
                if not s["seeds"] or any(seed not in per_seed for seed in s["seeds"]):
                    continue
                mean = sum(per_seed[seed] for seed in s["seeds"]) / len(s["seeds"])
                if math.isfinite(mean) and (best["mean"] is None or mean < best["mean"]):
                    best = {"lr": lr, "warmup_steps": steps, "warmup_fraction": w["warmup_fraction"], "mean": mean}
        out[arm] = best
    return out


#: The file in the study folder that records a two-seed selection (``--confirm SEED POINTS``), for the report.
SELECTION_FILE = "selection.json"


def _score(value: float) -> float:
    return value if math.isfinite(value) else math.inf


def top_points(sources: Sequence[tuple[int | None, float | None, Mapping[str, Any]]], arm: str, *, seed: int,
               points: int) -> list[dict[str, Any]]:
    """``arm``'s ``points`` best grid points by final validation bpb on ``seed``, over every source grid: ``sources``
    are ``(warmup_steps, warmup_fraction, grid)`` triples (``None, None`` for the study's own warm-up; ``grid`` a
    :func:`read_grid` result), ranked by (bpb, source, lr), a non-finite bpb last. Each point is ``{"lr",
    "warmup_steps", "warmup_fraction", "per_seed": {seed: bpb}}`` with every seed the point has."""
    found = []
    for k, (steps, fraction, grid) in enumerate(sources):
        for lr, per in grid["finals"].get(arm, {}).items():
            if seed in per:
                found.append(((_score(per[seed]), k, lr), {"lr": lr, "warmup_steps": steps, "warmup_fraction": fraction,
                                                          "per_seed": {str(s): per[s] for s in sorted(per)}}))
    return [point for _, point in sorted(found, key=lambda item: item[0])[:points]]


def confirm_recipes(grid: Mapping[str, Any], warmups: Mapping[int, Mapping[str, Any]], *, arms: Sequence[str],
                    seeds: tuple[int, int], points: int) -> dict[str, Any]:
    """Each arm's recipe chosen on two seeds: its ``points`` best grid points on the first seed (:func:`top_points`,
    over its own grid and every warm-up grid), then the one of lowest mean final validation bpb over both seeds.

    Returns
    -------
    dict
        ``{arm: {"lr", "warmup_steps", "warmup_fraction", "mean", "per_seed", "points"}}``: ``points`` the
        candidates with both seeds and their means (the report shows them), ``warmup_steps`` ``None`` for the study's
        own warm-up.

    Raises
    ------
    IncompleteSelectionError
        A candidate misses the second seed (naming it): train it first.
    """
    first, second = seeds
    sources = [(None, None, grid)] + [(steps, w["warmup_fraction"], w["grid"]) for steps, w in sorted(warmups.items())]
    out: dict[str, Any] = {}
    missing = []
    for arm in _order(arms):
        top = top_points(sources, arm, seed=first, points=points)
        if not top:
            missing.append(f"{arm}: no grid point with seed {first}")
            continue
        lacking = [p for p in top if str(second) not in p["per_seed"]]
        missing += [f"{arm} at lr {_lr_text(p['lr'])}" + (f" with warm-up {p['warmup_steps']}" if p["warmup_steps"]
                                                          else "") + f" seed {second}" for p in lacking]
        if lacking:
            continue
        for p in top:
            p["mean"] = (p["per_seed"][str(first)] + p["per_seed"][str(second)]) / 2
        best = min(top, key=lambda p: _score(p["mean"]))
        out[arm] = {**{k: best[k] for k in ("lr", "warmup_steps", "warmup_fraction", "mean")},
                    "per_seed": {str(s): best["per_seed"][str(s)] for s in seeds}, "points": top}
    if missing:
        raise IncompleteSelectionError("the two-seed selection is incomplete: missing " + "; ".join(missing)
                                       + ". Train them (--seeds " + str(second) + " at those points) first.")
    return out


def with_recipe(config: Any, recipe: Mapping[str, Any]) -> Any:
    """``config`` at the recipe's lr (:func:`with_lr`) and, where it names one, its warm-up fraction."""
    config = with_lr(config, recipe["lr"])
    if recipe.get("warmup_fraction") is not None:
        config = dataclasses.replace(config, warmup_fraction=recipe["warmup_fraction"])
    return config


# ---------------------------------------------------------------------------------------------- timing
def time_arms(configs: Mapping[str, Any], build_task: Callable, *, steps: int, rounds: int = 3,
              device: str = "cpu", threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Seconds per training step of every arm, measured in this process, arms interleaved.

    Each arm's run is built as the training loop builds it (same task, model, optimizer; ``configs[arm]`` is
    its config, e.g. at its selected lr). One warm-up round, then ``rounds`` rounds; in each round every arm
    (in an order rotated by one per round, so none is always first) trains ``steps`` steps of the training loop
    (batches, forward, backward, clipping, schedule, optimizer step; no evaluation), timed with
    ``time.perf_counter``. Returns ``{"steps_per_round", "rounds", "arms": {arm: {"seconds_per_step" (the median
    over the rounds), "rounds" (each round's seconds per step)}}, "environment"}``.
    """
    import torch

    from ..harness.run_folder import environment_info
    from ..harness.runner import _build, _train_epoch, resolve_device

    if not (isinstance(steps, int) and steps > 0 and isinstance(rounds, int) and rounds > 0):
        raise ValueError(f"time_arms: steps={steps!r} and rounds={rounds!r} must be positive ints (--time-steps).")
    dev = resolve_device(device)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        from ..harness.config import RunSpec

        runs = {}
        for arm, config in configs.items():
            cfg = dataclasses.replace(config, steps_per_epoch=steps)
            runs[arm] = _build(RunSpec(cfg, arm, seed), build_task, Path(os.devnull), dev)
        names = list(runs)
        times: dict[str, list[float]] = {a: [] for a in names}
        for r in range(rounds + 1):
            for arm in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                _train_epoch(runs[arm], eval_now=False)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if r > 0:  # round 0 warms up
                    times[arm].append((time.perf_counter() - t0) / steps)
        env = environment_info(dev)
    finally:
        torch.set_num_threads(previous)
    return {"steps_per_round": steps, "rounds": rounds,
            "arms": {a: {"lr": configs[a].optim.lr, "seconds_per_step": _median(times[a]), "rounds": times[a]}
                     for a in names},
            "environment": env}


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def equal_wallclock(seconds_per_step: Mapping[str, float], *, total_steps: int, steps_per_epoch: int,
                    records: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
                    keys: str | Sequence[str] = ("test_bpb",)) -> dict[str, Any]:
    """The equal-wall-clock readout (module docstring): the budget ``T`` (seconds), and per arm its seconds per
    step, the steps ``n_a`` that fit ``T``, the epoch read (its last record at or before step ``n_a`` that holds
    ``keys[0]``) and, for every key of ``keys`` (the overall test bpb and its categories), the per-seed value in
    that record. ``records`` maps arm -> seed -> that run's records."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    arms = [a for a in seconds_per_step if a in records]
    if not arms:
        return {"budget_seconds": None, "keys": keys, "arms": {}}
    budget = total_steps * min(seconds_per_step[a] for a in arms)
    out = {}
    for arm in arms:
        t = seconds_per_step[arm]
        fits = min(total_steps, int(math.floor(budget / t * (1 + 1e-12))))
        out[arm] = {"seconds_per_step": t, "steps_fit": fits,
                    **_read_at(records[arm], fits, steps_per_epoch=steps_per_epoch, keys=keys)}
    return {"budget_seconds": budget, "keys": keys, "arms": out}


def _read_at(runs: Mapping[int, Sequence[Mapping[str, Any]]], steps: int, *, steps_per_epoch: int,
             keys: Sequence[str]) -> dict[str, Any]:
    """Each run's last record at or before step ``steps`` that holds ``keys[0]``: ``{"epoch_read", "steps_read",
    key: {seed: value}}`` (``runs``: seed -> that run's records)."""
    values: dict[str, dict[str, float]] = {k: {} for k in keys}
    epochs = set()
    for seed, recs in runs.items():
        within = [r for r in recs if r["epoch"] * steps_per_epoch <= steps and r.get(keys[0]) is not None]
        if within:
            for k in keys:
                if within[-1].get(k) is not None:
                    values[k][str(seed)] = float(within[-1][k])
            epochs.add(int(within[-1]["epoch"]))
    return {"epoch_read": sorted(epochs), "steps_read": sorted(e * steps_per_epoch for e in epochs), **values}


def wallclock_rule(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """How the equal-wall-clock row of two arms is read (module docstring), from their entries of the timing pass
    (``{"seconds_per_step", "rounds"}``): ``"same step"`` when their median step times differ by less than the
    timing noise, the larger of the two arms' ranges over the rounds (max - min), else ``"budget"``.

    Returns ``{"rule", "difference_seconds", "noise_seconds"}``."""
    diff = abs(float(a["seconds_per_step"]) - float(b["seconds_per_step"]))
    noise = max(max(x["rounds"]) - min(x["rounds"]) for x in (a, b))
    return {"rule": "same step" if diff < noise else "budget", "difference_seconds": diff, "noise_seconds": noise}


def _pairs(present: Iterable[str], arms: Sequence[str], baselines: Sequence[str]) -> list[tuple[str, str]]:
    """Every ``(arm, baseline)`` pair among the arms ``present``, each pair once, the earlier baseline
    subtracted (:func:`tuned_comparisons`)."""
    present = set(present)
    done, out = set(), []
    for base in baselines:
        if base not in present:
            continue
        for arm in arms:
            if arm == base or arm not in present or frozenset((arm, base)) in done:
                continue
            done.add(frozenset((arm, base)))
            out.append((arm, base))
    return out


def wallclock_comparisons(wall: Mapping[str, Any], timing: Mapping[str, Mapping[str, Any]],
                          records: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], arms: Sequence[str],
                          baselines: Sequence[str] = BASELINES, *, steps_per_epoch: int,
                          diverged: Mapping[str, Sequence[int]] | None = None) -> dict[str, dict[str, Any]]:
    """The equal-wall-clock comparisons (module docstring), one per set and pair of :func:`tuned_comparisons`,
    each read by :func:`wallclock_rule`: at ``"budget"`` each arm's values of :func:`equal_wallclock` (``wall``,
    without the diverged runs); at ``"same step"`` both arms at their last evaluation at or before the smaller of
    their ``steps_fit``. ``timing``: arm -> ``{"seconds_per_step", "rounds"}``; ``records``: arm -> seed -> that
    run's records; ``diverged``: arm -> seeds left out. Each comparison carries ``read = {"rule",
    "difference_seconds", "noise_seconds", "steps": {arm: steps read}}``; Holm and the detectable differences
    are over the whole family."""
    from ..harness.stats import paired_from_mapping, with_detectable, with_holm

    keys, per_arm = wall["keys"], wall["arms"]
    diverged = diverged or {}
    out = {}
    pairs = _pairs(per_arm, arms, baselines)
    reads = {}
    for arm, base in pairs:
        rule = wallclock_rule(timing[arm], timing[base])
        if rule["rule"] == "same step":
            step = min(per_arm[arm]["steps_fit"], per_arm[base]["steps_fit"])
            got = {x: _read_at(records[x], step, steps_per_epoch=steps_per_epoch, keys=keys) for x in (arm, base)}
            for x in (arm, base):
                for k in keys:
                    got[x][k] = {seed: v for seed, v in got[x][k].items()
                                 if math.isfinite(v) and int(seed) not in diverged.get(x, ())}
        else:
            got = {x: per_arm[x] for x in (arm, base)}
        reads[(arm, base)] = (rule, got)
    for k in keys:
        name = k.removesuffix("_bpb")
        for arm, base in pairs:
            rule, got = reads[(arm, base)]
            stats = paired_from_mapping(got[arm][k], got[base][k]).to_dict()
            out[f"{name}: {arm} - {base}"] = {**stats, "read": {**rule, "steps": {
                arm: got[arm]["steps_read"], base: got[base]["steps_read"]}}}
    return with_detectable(with_holm(out), alpha=ALPHA, power=POWER)


# ---------------------------------------------------------------------------------------------- statistics
def tuned_comparisons(per_set: Mapping[str, Mapping[str, Mapping[str, float]]], arms: Sequence[str],
                      baselines: Sequence[str] = BASELINES) -> dict[str, dict[str, Any]]:
    """Paired comparisons ``"<set>: <arm> - <baseline>"`` of every arm against each of ``baselines`` (default
    :data:`BASELINES`) that ran, each pair once (``muon - adamw``, not also ``adamw - muon``: the earlier baseline
    is subtracted), for every set of ``per_set`` (set -> arm -> seed -> value): mean difference with its 95%
    interval, paired t and sign test (:func:`~.stats.paired_from_mapping`), and both p-values adjusted by Holm
    over the whole family (:func:`~.stats.with_holm`: every set and every pair), and the smallest difference each
    could detect at :data:`POWER` (:func:`~.stats.with_detectable`: at :data:`ALPHA` and at the Holm level
    :data:`ALPHA` / m, m the comparisons of the family)."""
    from ..harness.stats import paired_from_mapping, with_detectable, with_holm

    out = {}
    for name, per_arm in per_set.items():
        for arm, base in _pairs(per_arm, arms, baselines):
            out[f"{name}: {arm} - {base}"] = paired_from_mapping(per_arm[arm], per_arm[base]).to_dict()
    return with_detectable(with_holm(out), alpha=ALPHA, power=POWER)


def _mean_ci(values: Sequence[float]) -> dict[str, Any]:
    from ..harness.stats import mean_ci

    m, lo, hi = mean_ci(list(values)) if values else (None, None, None)
    return {"n": len(values), "mean": m, "ci_low": lo, "ci_high": hi}


def _finished(folder: Path) -> tuple[dict[str, dict[int, list[dict[str, Any]]]], list[str]]:
    """The runs of ``folder`` that reached their epochs (each run its own configured epochs), and the names of
    those that did not (a run without a ``config.json`` has no epochs to reach: it is named, not counted)."""
    epochs = _epochs(folder)
    done, open_runs = {}, []
    for arm, seeds in _runs(folder).items():
        for seed, recs in seeds.items():
            wanted = epochs.get((arm, seed))
            if wanted is not None and recs[-1]["epoch"] >= wanted:
                done.setdefault(arm, {})[seed] = recs
            else:
                open_runs.append(f"{arm} seed {seed} (epoch {recs[-1]['epoch']} of "
                                 f"{'? (no config.json)' if wanted is None else wanted})")
    return done, open_runs


# ---------------------------------------------------------------------------------------------- provenance
def _trained_on(out_dir: Path) -> dict[str, Any]:
    """Per cell group (``grid``, each ``warm-up <n> grid``, ``final``), the commits (12 hex digits, ``*`` =
    uncommitted changes) and setups of every training call, from the runs' ``environment.json``."""
    from ..harness.study import speed_from_environment

    out = {}
    groups = [("grid", _grid_folders(out_dir))]
    groups += [(f"warm-up {steps} grid", _grid_folders(Path(out_dir) / f"{WARMUP_PREFIX}{steps}"))
               for steps in warmup_grids(out_dir)]
    for name, folders in [*groups, ("final", [out_dir / FINAL_DIR])]:
        commits, setups, seconds = [], [], 0.0
        for folder in folders:
            for v in speed_from_environment(folder).values():
                commits += [c for c in v["commits"] if c not in commits]
                setups += [s for s in v["setups"] if s not in setups]
                seconds += v["seconds"] or 0.0
        out[name] = {"commits": commits, "setups": setups, "train_hours": round(seconds / 3600, 2),
                     "one_clean_commit": len(commits) == 1 and not commits[0].endswith("*")}
    return out


# ---------------------------------------------------------------------------------------------- report
def _f(x: float | None, fmt: str = ".4f", sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+{fmt}}" if sign else f"{x:{fmt}}"


def _ci_text(s: Mapping[str, Any]) -> str:
    if s.get("mean") is None:
        return "–"
    return _f(s["mean"]) + ("" if s.get("ci_low") is None else f" [{_f(s['ci_low'])}, {_f(s['ci_high'])}]")


def _diverged_text(diverged: Mapping[str, Sequence[int]], what: str) -> str:
    """The runs left out because they diverged, in words (arm -> seeds)."""
    runs = "; ".join(f"{arm} seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
                     for arm, seeds in diverged.items())
    return (f"**Diverged, left out of the means and the paired differences** (a {what} that is not finite): {runs}. "
            "An arm's mean is then over its other seeds, and its pairs are fewer.")


def _direction(mean: float) -> str:
    """``"lower"``, ``"higher"`` or ``"equal"`` (a zero difference is neither lower nor higher)."""
    return "lower" if mean < 0 else "higher" if mean > 0 else "equal"


def reading(c: Mapping[str, Any]) -> str:
    """How a comparison may be worded (:func:`_sentence`, and the controls study's README paragraph):

    - ``"resolved"``: at least :data:`MIN_SEEDS_FOR_CLAIM` pairs and a Holm-adjusted paired-t p below
      :data:`ALPHA`: "is lower/higher";
    - ``"suggested"``: not resolved, but the unadjusted 95% interval excludes 0: "suggested", with that interval
      and both p-values;
    - ``"not resolved"``: the interval includes 0 (or there is none), or the mean difference is exactly 0: the
      interval and the smallest difference the study could have detected (``detectable``,
      :func:`~experiments.harness.stats.with_detectable`), never a direction or sameness;
    - ``"none"``: no pairs."""
    if c.get("mean") is None:
        return "none"
    p = c.get("p_holm")
    if c["mean"] != 0 and c["n"] >= MIN_SEEDS_FOR_CLAIM and p is not None and p < ALPHA:
        return "resolved"
    lo, hi = c["ci_low"], c["ci_high"]
    if c["mean"] != 0 and lo is not None and (lo > 0 or hi < 0):
        return "suggested"
    return "not resolved"


def _g2(x: float) -> str:
    return f"{x:.2g}"


def detectable_text(c: Mapping[str, Any], unit: str = "bpb") -> str:
    """The smallest difference a comparison's pairs could have detected, in words (``""`` where undefined: fewer
    than two pairs, or no spread), e.g. "with 10 pairs (sd of the differences 0.023) the smallest difference
    detectable at 80% power is 0.023 bpb at α = 0.05 and 0.042 at the Holm level α/48 (noncentral t)"."""
    d = c.get("detectable") or {}
    if d.get("difference") is None:
        return ""
    holm = ("" if d.get("holm_difference") is None or d["family"] < 2 else
            f" and {_g2(d['holm_difference'])} at the Holm level α/{d['family']}")
    return (f"with {c['n']} pairs (sd of the differences {_g2(c['std'])}) the smallest difference detectable at "
            f"{100 * d['power']:g}% power is {_g2(d['difference'])} {unit} at α = {d['alpha']:g}{holm} "
            f"({d['method']})")


def _count(c: Mapping[str, Any], direction: str) -> str:
    k = c.get("n_negative" if direction == "lower" else "n_positive")
    return "" if k is None else f"{direction} on {k} of {c['n']} pairs; "


def read_text(c: Mapping[str, Any]) -> str:
    """How an equal-wall-clock comparison was read (its ``read``, :func:`wallclock_comparisons`), in words; ``""``
    for a comparison without one (the final cell's)."""
    r = c.get("read")
    if r is None:
        return ""
    steps = list(r["steps"].values())
    at = ", ".join(f"{x:,}" for x in steps[0]) or "–"
    if r["rule"] == "same step":
        return (f"both read at step {at}, their median step times differing by less than the timing noise (the "
                f"larger range of their rounds)")
    arm, base = r["steps"]
    other = ", ".join(f"{x:,}" for x in steps[1]) or "–"
    return (f"each read within the budget, `{arm}` at step {at} and `{base}` at step {other}, their median step "
            f"times differing by more than the timing noise")


def _sentence(name: str, c: Mapping[str, Any]) -> str:
    """One comparison in words (:func:`_claim_sentence`), then, at equal wall-clock, how it was read
    (:func:`read_text`)."""
    how = read_text(c)
    return _claim_sentence(name, c) + (f" {how[0].upper()}{how[1:]}." if how else "")


def _claim_sentence(name: str, c: Mapping[str, Any]) -> str:
    """One comparison in words, by :func:`reading`: "is" only when resolved; "suggested" where the unadjusted
    interval excludes 0; otherwise "not resolved" with the interval and :func:`detectable_text` (a zero mean
    difference reads "equals ... on average", neither lower nor higher)."""
    kind = reading(c)
    if kind == "none":
        return f"- {name}: no pairs."
    what, base = name.split(": ", 1)[1].split(" - ")
    direction = _direction(c["mean"])
    p = c.get("p_holm")
    ptext = "–" if p is None else f"{p:.2g}"
    if kind == "resolved":
        return (f"- {name}: `{what}` has {direction} test bpb than `{base}`, by {abs(c['mean']):.4f} "
                f"({c['n']} pairs, Holm-adjusted paired-t p {ptext}).")
    ci = ("no interval" if c["ci_low"] is None else
          f"95% CI {c['ci_low']:+.4f} to {c['ci_high']:+.4f}")
    if kind == "suggested":
        raw = "–" if c.get("p_value") is None else f"{c['p_value']:.2g}"
        return (f"- {name}: suggested, not resolved: `{what}`'s test bpb is {direction} than `{base}`'s by "
                f"{abs(c['mean']):.4f} (unadjusted {ci}, paired-t p {raw}; {_count(c, direction)}"
                f"Holm-adjusted paired-t p {ptext}).")
    head = (f"`{what}`'s test bpb equals `{base}`'s on average, not resolved (mean difference 0; "
            if direction == "equal" else f"not resolved: mean difference {c['mean']:+.4f} (")
    mde = detectable_text(c)
    return f"- {name}: {head}{ci}; {c['n']} pairs, Holm-adjusted paired-t p {ptext})" + (f"; {mde}." if mde else ".")


def _rule_lines(comparisons: Mapping[str, Mapping[str, Any]], timing: Mapping[str, Any]) -> list[str]:
    """The equal-wall-clock rule of every pair (:func:`wallclock_rule`), one row per pair (every set of a pair is
    read alike)."""
    lines = ["How each pair is read (rule per row; every set of a pair is read alike):", "",
             "| pair | median ms per step | difference (ms) | timing noise (ms) | rule | steps read |",
             "|---|---|---|---|---|---|"]
    seen = set()
    for name, c in comparisons.items():
        pair = name.split(": ", 1)[1]
        r = c.get("read")
        if r is None or pair in seen:
            continue
        seen.add(pair)
        arms = list(r["steps"])
        ms = " / ".join(f"{1000 * timing['arms'][a]['seconds_per_step']:.1f}" for a in arms)
        steps = " / ".join(", ".join(f"{x:,}" for x in r["steps"][a]) or "–" for a in arms)
        rule = ("same step: both at the smaller of their steps that fit" if r["rule"] == "same step" else
                "budget: each at its own steps that fit")
        lines.append(f"| {pair} | {ms} | {1000 * r['difference_seconds']:.1f} | {1000 * r['noise_seconds']:.1f} | "
                     f"{rule} | {steps} |")
    return lines + [""]


def _comparison_sections(comparisons: Mapping[str, Mapping[str, Any]], sets: Sequence[str]) -> list[str]:
    from ..harness.report import comparison_table

    lines = []
    for name in sets:
        rows = {k: v for k, v in comparisons.items() if k.startswith(f"{name}: ")}
        if rows:
            lines += [f"**{name}**", ""] + comparison_table(rows, unit="bpb") + [""]
            lines += [_sentence(k, v) for k, v in rows.items()] + [""]
    return lines


def plot_lr_grid(selection: Mapping[str, Any], path: str | os.PathLike) -> Path | None:
    """Final validation bpb (mean over the selection's seeds) against the lr, one curve per arm, log x, each
    arm's selected lr marked with a star."""
    from ..harness.plotting import _row, _save

    arms = [a for a, s in selection["arms"].items() if s["rows"]]
    if not arms:
        return None
    fig, (ax,) = _row(width=7.0, height=4.5)
    for i, arm in enumerate(arms):
        s = selection["arms"][arm]
        color = f"C{i}"
        ax.plot([r["lr"] for r in s["rows"]], [r["mean"] for r in s["rows"]], marker="o", color=color,
                label=f"{arm} (best {_lr_text(s['best_lr'])}{'' if s['bracketed'] else ', at an edge'})")
        ax.plot([s["best_lr"]], [s["best_mean"]], marker="*", markersize=16, color=color, linestyle="none")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (the arm's one knob)")
    ax.set_ylabel("final validation bits per byte (mean over seeds)")
    ax.set_title("lr grid per arm (star: selected)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def finalize_tuned(out_dir: str | os.PathLike, config_type: type, *, arms: Sequence[str] | None = None
                   ) -> StudyOutputs:
    """Write ``summary.json``, ``report.md`` and ``lr_grid.png`` of the tuned study in ``out_dir``, from its
    records, ``timing.json`` and the runs' ``environment.json`` only (a rebuild gives the same bytes).

    The controls study (issue 42) adds its sections on top of this report: :func:`~.controls_report.finalize`
    picks the one a folder needs.

    Parameters
    ----------
    out_dir : path
        The study folder (module docstring: its layout).
    config_type : type
        The study's config class (the recorded configs are read back into it).
    arms : sequence of str, optional
        Restrict the report to these arms (default: every arm on disk).
    """
    from ..harness.report import write_text

    out_dir = Path(out_dir)
    summary, config, figure = tuned_summary(out_dir, config_type, arms=arms)
    lines = _render(summary, config)
    summary_path = out_dir / SUMMARY_FILE
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    report_path = write_text(out_dir / REPORT_FILE, "\n".join(lines))
    return StudyOutputs(summary=summary, summary_path=summary_path, report_path=report_path,
                        figures={} if figure is None else {"lr_grid": figure})


TITLE = "Tuned against tuned: byte-level GPT-2, each arm at its own best learning rate"


def tuned_summary(out_dir: str | os.PathLike, config_type: type, *, arms: Sequence[str] | None = None,
                  baselines: Sequence[str] = BASELINES, title: str = TITLE) -> tuple[dict[str, Any], Any, Path | None]:
    """The summary of a tuned study (what :func:`finalize_tuned` writes to ``summary.json``), the recorded config
    (as ``config_type``) and the lr-grid figure it drew (``lr_grid.png``, ``None`` without a grid); paired
    comparisons against each of ``baselines`` (:func:`tuned_comparisons`). Writes only the figure."""
    from ..harness.config import config_from_dict, to_dict

    out_dir = Path(out_dir)
    warmups = warmup_grids(out_dir)
    # with warm-up grids, a final run may train at another warm-up than the study's: its setup is then the grid's
    recorded = next((json.loads(path.read_text())["config"] for folder in (_grid_folders(out_dir) if warmups else [])
                     for path in _config_paths(folder)), None) or find_config(out_dir)
    if recorded is None:
        raise ValueError(f"{out_dir}: holds no tuned study (no lr-<v>/runs or final/runs); train it first.")
    config = config_from_dict(config_type, recorded)
    grid = read_grid(out_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an incomplete grid is stated in the report itself
        selection = select_lrs(grid, arms=[a for a in (arms or grid["finals"]) if a in grid["finals"]])
    recipes = select_recipes(selection, warmups) if warmups else None
    two_seed = json.loads((out_dir / SELECTION_FILE).read_text()) if (out_dir / SELECTION_FILE).exists() else None
    if two_seed is not None:
        recipes = confirm_recipes(grid, warmups, arms=list(selection["arms"]), seeds=tuple(two_seed["seeds"]),
                                  points=two_seed["points"])
    final_runs, open_runs = _finished(out_dir / FINAL_DIR)
    final_arms = _order(a for a in final_runs if arms is None or a in arms)
    final_configs = _configs(out_dir / FINAL_DIR)
    final_lrs = {arm: _one_lr(out_dir / FINAL_DIR / "runs" / arm,
                              {k: float(c["optim"]["lr"]) for k, c in final_configs.items() if k[0] == arm},
                              f"the final runs of {arm}")
                 for arm in dict.fromkeys(k[0] for k in final_configs)}
    final_epochs = _final_epochs(out_dir / FINAL_DIR, final_configs, final_runs, final_arms)

    sets = [s for s in CATEGORY_SETS
            if any(f"{s}_bpb" in recs[-1] for a in final_arms for recs in final_runs[a].values())]
    per_set, diverged = _without_diverged(
        {s: {a: {str(seed): float(recs[-1][f"{s}_bpb"]) for seed, recs in sorted(final_runs[a].items())
                 if recs[-1].get(f"{s}_bpb") is not None} for a in final_arms} for s in sets})
    test = {a: {s: {**_mean_ci(list(per_set[s][a].values())), "per_seed": per_set[s][a]} for s in sets}
            for a in final_arms}
    comparisons = tuned_comparisons(per_set, final_arms, baselines)

    timing_path = out_dir / TIMING_FILE
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else None
    wall = None
    if timing and final_arms:
        sps = {a: v["seconds_per_step"] for a, v in timing["arms"].items() if a in final_arms}
        total = final_epochs * config.steps_per_epoch
        wall = equal_wallclock(sps, total_steps=total, steps_per_epoch=config.steps_per_epoch,
                               records={a: final_runs[a] for a in final_arms}, keys=[f"{s}_bpb" for s in sets])
        wall_sets, wall_diverged = _without_diverged(
            {s: {a: v[f"{s}_bpb"] for a, v in wall["arms"].items()} for s in sets})
        for s in sets:
            for a, v in wall["arms"].items():
                v[f"{s}_bpb"] = wall_sets[s][a]
        if wall_diverged:  # only when there is one: an older summary rebuilds byte for byte
            wall["diverged"] = wall_diverged
        wall["comparisons"] = wallclock_comparisons(wall, timing["arms"], {a: final_runs[a] for a in final_arms},
                                                    final_arms, baselines, steps_per_epoch=config.steps_per_epoch,
                                                    diverged=wall_diverged)
    trained = _trained_on(out_dir)
    identity = config.corpus_identity or {}
    licence = identity.get("licence")
    figure = plot_lr_grid(selection, out_dir / FIGURE_FILE)

    summary = {"title": title,
               "corpus": identity, "licence": licence, "config": to_dict(config), "selection": selection,
               "grid_unfinished": [list(u) for u in grid["unfinished"]],
               **({"recipes": recipes} if recipes is not None else {}),
               "final": {"arms": final_arms, "lr": {a: final_lrs.get(a) for a in final_arms},
                         "seeds": {a: sorted(final_runs[a]) for a in final_arms}, "in_progress": open_runs,
                         # only when a run diverged: an older summary rebuilds byte for byte
                         **({"diverged": diverged} if diverged else {}),
                         "test": test, "comparisons": comparisons},
               "equal_wallclock": wall, "timing": timing and {k: v for k, v in timing.items() if k != "environment"},
               "timing_setup": None if not timing else _timing_setup(timing), "trained_on": trained,
               "figure": None if figure is None else FIGURE_FILE}
    return summary, config, figure


def _final_epochs(folder: Path, configs: Mapping[tuple[str, int], Mapping[str, Any]],
                  runs: Mapping[str, Mapping[int, Any]], arms: Sequence[str]) -> int | None:
    """The one number of epochs the finished final runs of ``arms`` were configured for (``None`` without any);
    :class:`~experiments.harness.records.InconsistentRecordsError` naming each count with its runs when they
    differ (runs of different lengths are not paired: their test numbers, and the equal-wall-clock budget, would
    mix them)."""
    from ..harness.records import InconsistentRecordsError

    epochs: dict[int, list[str]] = {}
    for arm in arms:
        for seed in sorted(runs[arm]):
            epochs.setdefault(int(configs[(arm, seed)]["train"]["epochs"]), []).append(f"{arm} seed{seed}")
    if len(epochs) > 1:
        found = "; ".join(f"{n} epochs: {', '.join(keys)}" for n, keys in sorted(epochs.items()))
        raise InconsistentRecordsError(
            f"{folder}: the finished final runs were configured for different numbers of epochs ({found}); runs of "
            f"different lengths are not compared. Train every final run to the same --epochs (or move the others "
            f"out of {folder}) and rebuild the report.")
    return next(iter(epochs), None)


def _without_diverged(per_set: Mapping[str, Mapping[str, Mapping[str, float]]]
                      ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, list[int]]]:
    """``per_set`` (set -> arm -> seed -> bpb) without the runs that diverged, and those runs (arm -> seeds): a run
    diverged when any of its values is not finite (NaN or inf); it is left out of every set, so that the sets
    keep the same pairs. The caller states them (a mean over the others is not the arm's mean over its seeds)."""
    bad: dict[str, set[str]] = {}
    for per_arm in per_set.values():
        for arm, per_seed in per_arm.items():
            bad.setdefault(arm, set()).update(s for s, v in per_seed.items() if not math.isfinite(v))
    clean = {name: {arm: {s: v for s, v in per_seed.items() if s not in bad.get(arm, ())}
                    for arm, per_seed in per_arm.items()} for name, per_arm in per_set.items()}
    return clean, {arm: sorted(int(s) for s in seeds) for arm, seeds in bad.items() if seeds}


def _timing_setup(timing: Mapping[str, Any]) -> str:
    e = timing.get("environment", {})
    sha = e.get("git_sha")
    return (f"{e.get('device')} ({e.get('cpu_model') if e.get('device') == 'cpu' else e.get('device_name')}), "
            f"{e.get('torch_threads')} torch thread(s), torch {e.get('torch')}, commit "
            f"{(sha or 'unknown')[:12]}{'*' if e.get('git_dirty') else ''}")


def _render(summary: Mapping[str, Any], config: Any, extra: Sequence[str] = ()) -> list[str]:
    """The report's lines; ``extra`` (lines of further sections) goes before its "Run" section."""
    sel, final, wall = summary["selection"], summary["final"], summary["equal_wallclock"]
    c = summary["corpus"] or {}
    o = config.optim
    lines = [f"# {summary['title']}", "",
             f"**Corpus**: {c.get('source', config.corpus)}, SHA-256 `{c.get('sha256', '?')}`; licence: "
             f"{summary['licence'] or 'not recorded with the runs'}. Split by file: test fraction "
             f"{config.test_fraction:g}, validation fraction {config.val_fraction:g}; {config.eval_windows} windows "
             f"per held-out split, at most {config.max_file_share:g} of them from one file, none with more than "
             f"{config.max_overlap:g} of its {config.overlap_ngram}-byte substrings in the training text.", "",
             f"**Setup**: GPT-2 of depth {config.depth}, width {config.width}, {config.heads} heads, context "
             f"{config.context}; batch {config.batch_size}; {config.total_steps:,} steps ({config.lr_schedule} "
             f"schedule, warm-up {config.warmup_fraction:g}); betas {o.betas}, weight decay {o.weight_decay:g}, "
             f"frame steps adjust_lr_fn={o.adjust_lr_fn!r}, frame lr "
             f"{'= the arm lr' if o.frame_lr is None else f'{o.frame_lr:g} (fixed)'}, trust radius {o.trust_region}. "
             "The lr is each arm's one knob; it was chosen on validation bpb alone, and the test split is read "
             "once, in the final cell (every run evaluates every split, so the grid's records also hold test "
             "numbers; neither the selection nor this report reads them).", ""]
    lines += ["## 1. Learning-rate grid (validation, final bpb, mean over seeds)", ""]
    if sel["missing"]:
        lines += ["**The grid is incomplete**: missing " + "; ".join(sel["missing"]) + ". The selection below "
                  "uses the seeds each arm has at every one of its grid points.", ""]
    grid_lrs = sorted({r["lr"] for s in sel["arms"].values() for r in s["rows"]})
    lines += ["| arm | seeds | " + " | ".join(_lr_text(v) for v in grid_lrs) + " | selected | bracketed |",
              "|---|---|" + "---|" * len(grid_lrs) + "---|---|"]
    for arm, s in sel["arms"].items():
        by = {r["lr"]: r["mean"] for r in s["rows"]}
        cells = [("**" + _f(by[v]) + "**" if v == s["best_lr"] else _f(by[v])) if v in by else "–" for v in grid_lrs]
        bracket = "yes" if s["bracketed"] else f"no: {_unbracketed_text(arm, s)}"
        lines.append(f"| {arm} | {', '.join(map(str, s['seeds']))} | " + " | ".join(cells)
                     + f" | {_lr_text(s['best_lr'])} | {bracket} |")
    diverged = [f"{arm} at lr {', '.join(map(_lr_text, s['diverged']))}" for arm, s in sel["arms"].items()
                if s.get("diverged")]
    if diverged:
        lines += ["", "**Diverged** (non-finite validation bpb on a seed; ranked below every finite point): "
                  + "; ".join(diverged) + "."]
    lines += ["", f"With {len(sel['seeds'])} seed(s) per grid point a selection suggests where each optimum lies; "
              "neighbouring grid values within the seeds' spread are not distinguished.", ""]
    if summary["figure"]:
        lines += [f"![validation bpb against lr per arm]({summary['figure']})", ""]

    if summary.get("recipes"):
        lines += ["**Recipes** (the selected lr at the study's warm-up, or a point of a `warmup-<n>/` grid with a lower "
                  "mean validation bpb on the same seeds):", "", "| arm | lr | warm-up steps | val bpb |",
                  "|---|---|---|---|"]
        own = int(config.warmup_fraction * config.total_steps)
        lines += [f"| {arm} | {_lr_text(r['lr'])} | {r['warmup_steps'] or own} | {_f(r['mean'])} |"
                  for arm, r in summary["recipes"].items()] + [""]
        two = [(arm, r) for arm, r in summary["recipes"].items() if r.get("points")]
        if two:
            seeds = list(two[0][1]["per_seed"])
            lines += [f"**Two-seed selection**: each arm's {len(two[0][1]['points'])} best grid points on seed "
                      f"{seeds[0]} (lr × warm-up), trained again on seed {seeds[1]}; the recipe (**bold**) is the lowest "
                      f"mean of both.", "",
                      f"| arm | lr | warm-up steps | val bpb, seed {seeds[0]} | seed {seeds[1]} | mean |",
                      "|---|---|---|---|---|---|"]
            for arm, r in two:
                for q in r["points"]:
                    mark = "**" if (q["lr"], q["warmup_steps"]) == (r["lr"], r["warmup_steps"]) else ""
                    lines.append(f"| {arm} | {mark}{_lr_text(q['lr'])}{mark} | {q['warmup_steps'] or own} "
                                 f"| {_f(q['per_seed'][seeds[0]])} | {_f(q['per_seed'][seeds[1]])} | {_f(q['mean'])} |")
            lines.append("")
    lines += ["## 2. Final cell: test bits per byte, each arm at its selected lr", ""]
    if not final["arms"]:
        lines += ["No final runs yet (`--final-seeds`).", ""]
    else:
        if final["in_progress"]:
            lines += ["**In progress, left out**: " + "; ".join(final["in_progress"]) + ".", ""]
        if final.get("diverged"):
            lines += [_diverged_text(final["diverged"], "final test bpb"), ""]
        pending = [a for a in sel["arms"] if a not in final["arms"]]
        if pending:
            lines += ["**The final cell is incomplete**: no finished final run yet for " + ", ".join(pending) + ".", ""]
        recipes = summary.get("recipes") or {}
        mismatch = [a for a in final["arms"] if a in sel["arms"] and not math.isclose(
            final["lr"][a], recipes.get(a, {}).get("lr", sel["arms"][a]["best_lr"]), rel_tol=LR_REL_TOL)]
        if mismatch:
            lines += ["**The final runs of " + ", ".join(mismatch) + " were trained at another lr than the grid "
                      "now selects** (the grid changed after they ran); retrain them.", ""]
        sets = [s for s in CATEGORY_SETS if any(s in final["test"][a] for a in final["arms"])]
        lines += ["| arm | lr | seeds | " + " | ".join(f"{s} bpb [95% CI]" for s in sets) + " |",
                  "|---|---|---|" + "---|" * len(sets)]
        for a in final["arms"]:
            lines.append(f"| {a} | {_lr_text(final['lr'][a])} | {', '.join(map(str, final['seeds'][a]))} | "
                         + " | ".join(_ci_text(final["test"][a].get(s, {})) for s in sets) + " |")
        lines += ["", "Paired differences of the final test bpb (negative: the first arm is better; pairs are seeds: "
                  "same initial weights and training windows); Holm over every row of this section.", ""]
        lines += _comparison_sections(final["comparisons"], sets)

    lines += ["## 3. At equal wall-clock", ""]
    if wall is None:
        lines += [f"No `{TIMING_FILE}` (or no final runs): run the timing pass (`--time-steps`).", ""]
    else:
        t = summary["timing"]
        lines += [f"Step times from the timing pass ({TIMING_FILE}): every arm's training step (no evaluation) timed in "
                  f"one process on {summary['timing_setup']}, {t['rounds']} interleaved rounds of "
                  f"{t['steps_per_round']} steps after a warm-up round, median over rounds. Budget: the fastest arm's "
                  f"full run, {wall['budget_seconds']:.3g} s; each arm fits the steps below (a slower arm is read "
                  "mid-schedule, before its decay ends: this favours the faster arms). The rounds' range shows this "
                  "machine's noise, so each pair is read by one of two rules: where the two arms' median step times "
                  "differ by less than the timing noise (the larger of their two ranges over the rounds), both are "
                  "read at the same step, their last evaluation within the smaller of their steps that fit; "
                  "otherwise each at its last evaluation within its own steps that fit.", ""]
        wall_sets = [k.removesuffix("_bpb") for k in wall["keys"]]
        lines += ["Per arm, read at its own steps that fit (the budget rule; a same-step row reads the pair as the next "
                  "table says):", "",
                  "| arm | ms per step | rounds (ms) | steps that fit | step read | "
                  + " | ".join(f"{s} bpb [95% CI]" for s in wall_sets) + " |",
                  "|---|---|---|---|---|" + "---|" * len(wall_sets)]
        for a, v in wall["arms"].items():
            rounds = t["arms"][a]["rounds"]
            lines.append(f"| {a} | {1000 * v['seconds_per_step']:.1f} | "
                         f"{1000 * min(rounds):.1f}–{1000 * max(rounds):.1f} | {v['steps_fit']:,} | "
                         f"{', '.join(f'{s:,}' for s in v['steps_read']) or '–'} | "
                         + " | ".join(_ci_text(_mean_ci(list(v[f"{s}_bpb"].values()))) for s in wall_sets) + " |")
        if wall.get("diverged"):
            lines += ["", _diverged_text(wall["diverged"], "test bpb at the step read")]
        lines += ["", *_rule_lines(wall["comparisons"], t),
                  "Paired differences at equal wall-clock, as in section 2; Holm over every row of this section.",
                  ""] + _comparison_sections(wall["comparisons"], wall_sets)

    lines += [*extra, "## Run", ""]
    for name, info in summary["trained_on"].items():
        if not info["commits"]:
            continue
        clean = ("one clean commit" if info["one_clean_commit"] else
                 "**not one clean commit** (* = uncommitted changes)")
        lines.append(f"- {name}: trained on {', '.join(info['commits'])} ({clean}); {'; '.join(info['setups'])}; "
                     f"{info['train_hours']:.2f} h of training")
    pairs = max((len(v) for v in final["seeds"].values()), default=0) or MIN_SEEDS_FOR_CLAIM
    lines += ["", "## Notes", "",
              f"- A difference \"is\" lower or higher only where at least {MIN_SEEDS_FOR_CLAIM} paired seeds give a "
              f"Holm-adjusted paired-t p below {ALPHA}; otherwise it is \"suggested\" where the unadjusted 95% "
              f"interval excludes 0, and \"not resolved\" where it does not, stated with the smallest difference the "
              f"pairs could have detected at {100 * POWER:g}% power (noncentral t; unadjusted and at the Holm level "
              f"α/m, Holm's strictest step, m the comparisons of the section). A null is not sameness. With {pairs} "
              f"pairs the smallest two-sided sign-test p is {2 * 0.5 ** pairs:.3g}.",
              "- bpb = loss / ln 2 (loss in nats per byte), on the fixed held-out windows of each split.",
              ""]
    return lines


# ---------------------------------------------------------------------------------------------- README
README_BEGIN = "<!-- tuned-results:begin (generated by tuned.readme_table from runs/tuned/summary.json) -->"
README_END = "<!-- tuned-results:end -->"
README_PLACEHOLDER = ("_No results yet: the study is in progress; the records of its finished runs are committed under "
                      "runs/tuned/ as they come in._")
README_IN_PROGRESS = ("_No results yet: the final cell is not complete (runs/tuned/report.md has the grid's selection and "
                      "the runs finished so far); this table quotes it once every selected arm has the same finished "
                      "seeds._")


def readme_table(summary: Mapping[str, Any]) -> list[str]:
    """The README's results block of a tuned study, from its ``summary.json``: per arm the selected lr, whether
    it is bracketed, test bpb with its 95% interval and the paired difference against each baseline; then each
    overall test comparison in words (the report's sentences), and the same at equal wall-clock where timed.

    Until the final cell is complete (every selected arm has final runs, all on the same seeds, none unfinished)
    it gives :data:`README_IN_PROGRESS`, which quotes no number: a partial cell is in ``report.md``, not in the
    README."""
    final, sel = summary["final"], summary["selection"]["arms"]
    seed_sets = {tuple(final["seeds"][a]) for a in final["arms"]}
    if set(final["arms"]) != set(sel) or len(seed_sets) != 1 or final["in_progress"]:
        return [README_IN_PROGRESS]
    bases = [b for b in BASELINES if b in final["arms"]]
    lines = ["| arm | selected lr | bracketed | seeds | test bpb [95% CI] | "
             + " | ".join(f"− {b} (95% CI), Holm p" for b in bases) + " |", "|---|---|---|---|---|" + "---|" * len(bases)]
    for a in final["arms"]:
        s = sel.get(a, {})
        diffs = []
        for b in bases:
            c = final["comparisons"].get(f"test: {a} - {b}")
            if not c or c["mean"] is None:
                diffs.append("–")
                continue
            ci = "" if c["ci_low"] is None else f" [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]"
            p = "" if c.get("p_holm") is None else f", {c['p_holm']:.2g}"
            diffs.append(f"{c['mean']:+.4f}{ci}{p}")
        gone = len(final.get("diverged", {}).get(a, ()))
        lines.append(f"| `{a}` | {_lr_text(final['lr'][a])} | {'yes' if s.get('bracketed') else 'no'} | "
                     f"{len(final['seeds'][a])}{f' ({gone} diverged, left out)' if gone else ''} | "
                     f"{_ci_text(final['test'][a].get('test', {}))} | " + " | ".join(diffs) + " |")
    if final.get("diverged"):
        lines += ["", _diverged_text(final["diverged"], "final test bpb")]
    lines += ["", "In words, by the report's rule (\"is\" only where the Holm-adjusted paired t resolves it; "
              "\"suggested\" where only the unadjusted interval excludes 0; otherwise \"not resolved\", with the "
              "smallest difference the pairs could have detected):", ""]
    lines += [_sentence(k, c) for k, c in final["comparisons"].items() if k.startswith("test: ")]
    wall = summary.get("equal_wallclock") or {}
    if wall.get("comparisons"):
        lines += ["", "At equal wall-clock (within the fastest arm's full-run time, each pair read by the report's "
                  "rule, named per row; the report has the step times):", ""]
        lines += [_sentence(k, c) for k, c in wall["comparisons"].items() if k.startswith("test: ")]
    return lines


_NUMBER = re.compile(r"(?<![\w.])[+−-]?\d+\.\d+(?:e[+-]?\d+)?|(?<![\w.])[+−-]?\d+e[+-]?\d+")


def _numbers(obj: Any) -> Iterable[float]:
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _numbers(v)


def numbers_not_in_summary(text: str, summary: Any) -> list[str]:
    """The decimal numbers quoted in ``text`` (``1.817``, ``+0.034``, ``3e-3``; integers are not checked) that no
    number of ``summary`` gives when printed at the text's precision (same decimals; for ``e`` notation the same
    significant digits). Magnitudes are compared (a difference may be quoted as "better by 0.034")."""
    values = [abs(v) for v in _numbers(summary)]
    bad = []
    for token in _NUMBER.findall(text):
        quoted = token.lstrip("+−-")
        if "e" in quoted:
            mant = quoted.split("e")[0]
            digits = len(mant.replace(".", "").lstrip("0")) or 1
            ok = any(v != 0 and f"{v:.{digits - 1}e}" == f"{float(quoted):.{digits - 1}e}" for v in values)
        else:
            decimals = len(quoted.split(".")[1])
            ok = any(f"{v:.{decimals}f}" == quoted for v in values)
        if not ok:
            bad.append(token)
    return bad


# ---------------------------------------------------------------------------------------------- running
def run_tuned(config: Any, out_dir: str | os.PathLike, build_task: Callable, *, arms: Sequence[str],
              seeds: Sequence[int] | None, lrs: Sequence[float] = (), final_seeds: Sequence[int] = (),
              time_steps: int | None = None, time_rounds: int = 3, allow_unbracketed: bool = False,
              options: Any = None, command: str | None = None, skip_report: bool = False,
              config_type: type | None = None, finalize: Callable | None = None,
              confirm: tuple[int, int] | None = None) -> StudyOutputs:
    """Run (or resume) the grid (``lrs``: every arm of ``arms`` at every lr, on ``seeds``), then, with
    ``final_seeds``, the final cell (each arm at its selected lr), then, with ``time_steps``, the timing pass;
    then the report unless ``skip_report``: ``finalize(out_dir, config_type)``, default :func:`finalize_tuned` (a
    report that fails raises :class:`~..harness.study.ReportNotWrittenError`; the records stay complete).
    With ``confirm = (second_seed, points)`` each arm's recipe is chosen on two seeds (:func:`confirm_recipes`: the
    first of ``seeds`` and ``second_seed``, over its ``points`` best grid points), recorded in
    :data:`SELECTION_FILE` for the report.

    Raises
    ------
    IncompleteSelectionError
        ``final_seeds`` on a grid that misses an arm, a seed or a finished run.
    ValueError
        ``final_seeds`` on an arm whose best lr is at an edge of its grid (naming the value to add), unless
        ``allow_unbracketed``; ``final_seeds`` that include a seed of the grid's selection (those runs would
        repeat the grid runs that won it, and the test readout would depend on the selection).
    """
    from ..harness.study import run_cells, write_report

    out_dir = Path(out_dir)
    arms = list(arms)
    results = []
    frame_arms = [a for a in arms if a.startswith("stiefel")]
    if (lrs or final_seeds) and frame_arms and config.optim.adjust_lr_fn == "original" and config.optim.frame_lr is None:
        warnings.warn(f"--lrs with adjust_lr_fn='original': the frames of {', '.join(frame_arms)} step by about lr in "
                      f"Frobenius norm, sqrt(d r) times less than AdamW's entries; pass --adjust-lr-fn "
                      f"match_rms_adamw so that one lr serves the whole arm.", stacklevel=2)
    if lrs:
        results += run_cells(grid_cells(config, lrs), build_task, out_dir, arms=arms, seeds=list(seeds or []),
                             command=command, options=options)
    chosen: dict[str, float] | None = None
    if final_seeds or time_steps:
        grid = read_grid(out_dir)
        strict = bool(final_seeds)
        if strict or all(a in grid["finals"] for a in arms):
            if confirm is not None:
                first = (list(seeds or []) or [0])[0]
                selection = select_lrs(grid, arms=arms, seeds=[first], strict=strict)
                recipes = confirm_recipes(grid, warmup_grids(out_dir), arms=arms, seeds=(first, confirm[0]),
                                          points=confirm[1])
                selection["arms"] = {a: {**s, "seeds": [first, confirm[0]]} for a, s in selection["arms"].items()}
                (out_dir / SELECTION_FILE).parent.mkdir(parents=True, exist_ok=True)
                (out_dir / SELECTION_FILE).write_text(json.dumps(
                    {"seeds": [first, confirm[0]], "points": confirm[1]}, indent=2) + "\n")
            else:
                selection = select_lrs(grid, arms=arms, seeds=seeds, strict=strict)
                recipes = select_recipes(selection, warmup_grids(out_dir))
            chosen = {a: r["lr"] for a, r in recipes.items()}
            edge = [_unbracketed_text(a, s) for a, s in selection["arms"].items() if not s["bracketed"]]
            if final_seeds and edge and not allow_unbracketed:
                raise ValueError("--final-seeds: the lr grid does not bracket every arm's optimum: " + "; ".join(edge)
                                 + ". Extend the grid with --arms <arm> --lrs <value>, or pass --allow-unbracketed.")
            # the seeds that decided the selection: each arm selects on every seed it has at all its grid points
            deciding = sorted({seed for s in selection["arms"].values() for seed in s["seeds"]})
            reused = sorted(set(final_seeds) & set(deciding))
            if reused:
                free = [s for s in range(max([*deciding, *final_seeds]) + 1 + len(final_seeds))
                        if s not in deciding][:len(final_seeds)]
                raise ValueError(f"--final-seeds {' '.join(map(str, final_seeds))}: seed(s) "
                                 f"{', '.join(map(str, reused))} selected the lrs on the grid; their final runs would "
                                 f"repeat the grid runs that won the selection, so the test readout would not be "
                                 f"independent of it. Use seeds the grid does not have, e.g. --final-seeds "
                                 f"{' '.join(map(str, free))}.")
    if final_seeds:
        assert chosen is not None
        results += run_cells([final_cell(config)], build_task, out_dir, arms=arms, seeds=list(final_seeds),
                             arm_config=lambda cfg, arm: with_recipe(cfg, recipes[arm]), command=command,
                             options=options)
    if time_steps:
        lr_of = chosen or {}
        timing = time_arms({a: with_lr(config, lr_of.get(a, config.optim.lr)) for a in arms}, build_task,
                           steps=time_steps, rounds=time_rounds, device=getattr(options, "device", "cpu") or "cpu",
                           threads=getattr(options, "threads", None))
        timing["command"] = command
        (out_dir / TIMING_FILE).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / TIMING_FILE).write_text(json.dumps(timing, indent=2) + "\n")
    if skip_report:
        return StudyOutputs(results=tuple(results))
    outputs = write_report(finalize or finalize_tuned, out_dir, config_type or type(config))
    return dataclasses.replace(outputs, results=tuple(results))
