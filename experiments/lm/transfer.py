r"""Does a frame-step rule transfer across widths? The report over several language-model studies.

The input is a folder of :mod:`~experiments.lm.study` studies, one per model shape (e.g.
``w64/``, ``w128/``, ``w256/``, ``w128-h64/``), each trained with the same flags apart from ``--width`` and
``--heads``, an ``adamw`` arm and a ``stiefel`` arm whose frame learning rate is swept (``--frame-lrs``) around
the model's learning rate. With ``adjust_lr_fn="match_rms_adamw"`` the frame lr is a per-entry step size, so the
*multiplier* :math:`\mu = \text{frame lr} / \text{lr}` is what a user would tune; the rule transfers when the
best :math:`\mu` stays at the same grid point whatever the width. The report gives, per shape, the final
validation bits per byte against :math:`\mu` (one curve per shape, AdamW as a dashed level), where each optimum
lies, whether it is bracketed (not at an edge of the grid) and how far :math:`\mu = 1` (the rule with the
model's lr, what a user who changes nothing gets) is from it, in grid points and in bits per byte.

Other models check the same rule (:func:`collect_check`): a folder of ``mu-<μ>/`` studies of another
experiment (the grokking or the vision study), each the ``stiefel`` arm at one multiplier, scored by that
experiment's own measure (:data:`CHECK_MEASURES`). A ``checks.json`` in the report's folder lists them
(``{"checks": [{"name": ..., "path": ..., "reference": ...}]}``, paths relative to that folder; ``reference``, a
study whose ``adamw`` runs of the same seeds are the AdamW level, is optional when the folder has its own
``adamw/`` study), and the report gets a table of where each check's optimum lies.

Everything is read from the records (``runs/<arm>/seed<k>/metrics.jsonl`` and ``config.json``), so
``transfer_report`` rebuilds ``summary.json``, ``report.md`` and the figure byte for byte.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["collect_shapes", "summarize_transfer", "render_transfer", "plot_transfer", "transfer_report",
           "CHECK_MEASURES", "collect_check", "summarize_check", "default_table"]

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
FIGURE_FILE = "transfer.png"
CHECKS_FILE = "checks.json"
#: The sub-folder of a shape holding its stiefel runs with the paper's step (``adjust_lr_fn="original"``, frame
#: lr = the model's lr), what the default was before the rule: reported beside the rule, not a grid point.
PAPERS_STEP_FOLDER = "papers-step"

#: How a check scores one finished run, per experiment: what is measured (``label``), whether ``lower`` or
#: ``higher`` is better, the format of a value, and ``score(records) -> float | None`` (``None``: the run never
#: got there, which ranks last). Grokking: the first evaluated epoch with validation accuracy >= 95% (the
#: grokking study's threshold); vision: the test accuracy at the last epoch.
CHECK_MEASURES: dict[str, dict[str, Any]] = {
    "grokking": {"label": "first epoch with val acc ≥ 95%", "better": "lower", "fmt": ".0f",
                 "score": lambda recs: next((float(r["epoch"]) for r in recs if (r.get("val_acc") or 0.0) >= 0.95),
                                            None)},
    "vision": {"label": "final test accuracy (%)", "better": "higher", "fmt": ".2f",
               "score": lambda recs: None if recs[-1].get("test_acc") is None else 100.0 * recs[-1]["test_acc"]},
}


def _finished_finals(folder: Path, arm: str, epochs: int) -> dict[int, float]:
    """Final ``val_bpb`` per seed of the runs of ``arm`` in ``folder`` that reached ``epochs``
    (:func:`_finished_runs`, the one reader of finished runs here)."""
    return {seed: recs[-1]["val_bpb"] for _, a, seed, recs in _finished_runs(folder)
            if a == arm and recs[-1]["epoch"] >= epochs and recs[-1].get("val_bpb") is not None}


def _papers_step_finals(folder: Path, lr: float, epochs: int) -> dict[str, float]:
    """Final ``val_bpb`` per seed of the paper's-step runs in ``folder`` (``{}`` when there is none); refuses a
    run there that is not the paper's step at the shape's lr, so the column cannot silently be something else."""
    if not folder.is_dir():
        return {}
    from ..harness.records import run_paths

    for spec in run_paths(folder, "config.json"):
        o = json.loads(spec.read_text())["config"]["optim"]
        if o.get("adjust_lr_fn", "original") != "original" or (o.get("frame_lr") or o["lr"]) != lr or o["lr"] != lr:
            raise ValueError(f"{spec}: a run in {PAPERS_STEP_FOLDER}/ must be the stiefel arm with "
                             f"adjust_lr_fn='original' at the shape's lr {lr:g} (frame lr = lr); this one has "
                             f"lr {o['lr']:g}, frame lr {o.get('frame_lr')}, adjust_lr_fn {o.get('adjust_lr_fn')!r}.")
    return {str(k): v for k, v in sorted(_finished_finals(folder, "stiefel", epochs).items())}


def collect_shapes(root: str | os.PathLike) -> list[dict[str, Any]]:
    """One entry per study folder under ``root`` (sorted by width, then head size): its shape (``width``,
    ``heads``, ``head_size``, ``depth``), the model ``lr``, ``adjust_lr_fn``, the ``adamw`` finals per seed and
    one ``points`` row per frame lr (``multiplier``, ``frame_lr``, ``finals`` per seed) with finished runs."""
    from ..harness.records import run_paths
    from ..harness.run_folder import CONFIG_FILE

    root = Path(root)
    shapes = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        configs = run_paths(folder, CONFIG_FILE)
        if not configs:
            continue
        config = json.loads(configs[0].read_text())["config"]
        epochs = config["train"]["epochs"]
        lr = config["optim"]["lr"]
        cells = [(folder, config["optim"]["frame_lr"] or lr)]
        for cell in folder.glob("frame-lr-*"):
            specs = run_paths(cell, CONFIG_FILE)
            if specs:
                cells.append((cell, json.loads(specs[0].read_text())["config"]["optim"]["frame_lr"]))
        points = []
        for cell, frame_lr in cells:
            finals = _finished_finals(cell, "stiefel", epochs)
            if finals:
                points.append({"multiplier": frame_lr / lr, "frame_lr": frame_lr,
                               "finals": {str(k): v for k, v in sorted(finals.items())}})
        shapes.append({"name": folder.name, "width": config["width"], "heads": config["heads"],
                       "head_size": config["width"] // config["heads"], "depth": config["depth"], "lr": lr,
                       "steps": epochs * config["steps_per_epoch"],
                       "adjust_lr_fn": config["optim"].get("adjust_lr_fn", "original"),
                       "adamw": {str(k): v for k, v in sorted(_finished_finals(folder, "adamw", epochs).items())},
                       # the paper's step at the model's lr (adjust_lr_fn="original"), when run, in papers-step/
                       "papers_step": _papers_step_finals(folder / PAPERS_STEP_FOLDER, lr, epochs),
                       "points": sorted(points, key=lambda p: p["multiplier"])})
    return sorted(shapes, key=lambda s: (s["width"], s["head_size"]))


def _finished_runs(folder: Path) -> list[tuple[dict[str, Any], str, int, list[dict[str, Any]]]]:
    """``(config, arm, seed, records)`` of every run under ``folder`` that reached its last epoch."""
    from ..harness.records import read_records, run_paths, seed_of
    from ..harness.run_folder import CONFIG_FILE

    out = []
    for spec in run_paths(folder, CONFIG_FILE):
        meta = json.loads(spec.read_text())
        recs = read_records(spec.parent / "metrics.jsonl") if (spec.parent / "metrics.jsonl").exists() else []
        if recs and recs[-1]["epoch"] >= meta["config"]["train"]["epochs"]:
            # the arm and seed from the folder (runs/<arm>/seed<k>), as the study's own reader takes them
            out.append((meta["config"], spec.parent.parent.name, seed_of(spec.parent), recs))
    return out


def _is_papers_step(config: Mapping[str, Any]) -> bool:
    o = config["optim"]
    return o.get("adjust_lr_fn", "original") == "original" and (o.get("frame_lr") or o["lr"]) == o["lr"]


def _papers_step_multiplier(config: Mapping[str, Any]) -> float | None:
    r"""The multiplier under ``"match_rms_adamw"`` that gives the paper's step at the model's lr: a ``d x r``
    frame's step :math:`\mathrm{lr}` is :math:`\mu\,\mathrm{lr}\sqrt{d r}` with :math:`\mu = 1/\sqrt{d r}`
    (``d`` the width, ``r`` the head size; ``None`` when the config does not name them)."""
    if "width" not in config or "heads" not in config:
        return None
    d = config["width"]
    return 1.0 / math.sqrt(d * (d // config["heads"]))


def collect_check(folder: str | os.PathLike, *, name: str, reference: str | os.PathLike | None = None
                  ) -> dict[str, Any]:
    r"""One check of the rule on another model: the ``stiefel`` runs of every study folder under ``folder``
    (one per multiplier :math:`\mu` = ``frame_lr / lr``) scored by :data:`CHECK_MEASURES` of their experiment,
    and the ``adamw`` runs (of ``folder``'s studies, or of ``reference``) as the AdamW level.

    Raises ``ValueError`` naming the folder when it holds no finished ``stiefel`` run, when its runs mix
    experiments, model lrs or run lengths, or when a reference run differs from them in either."""
    folder = Path(folder)
    studies = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    runs = [run for study in studies for run in _finished_runs(study)]
    stiefel = [r for r in runs if r[1] == "stiefel"]
    if not stiefel:
        raise ValueError(f"check {name!r}: {folder} holds no finished stiefel run (<study>/runs/stiefel/seed<k>/).")
    referenced = _finished_runs(Path(reference)) if reference is not None else []
    # the AdamW level: the folder's own adamw runs, else the reference's
    adamw = [r for r in runs if r[1] == "adamw"] or [r for r in referenced if r[1] == "adamw"]
    # the paper's step at the model's lr (adjust_lr_fn="original", frame lr = lr), from the folder or reference
    original = [r for r in runs + referenced if r[1] == "stiefel" and _is_papers_step(r[0])]
    stiefel = [r for r in stiefel if not _is_papers_step(r[0])]
    first = stiefel[0][0]
    kind, lr, epochs = first["experiment"], first["optim"]["lr"], first["train"]["epochs"]
    for config, arm, seed, _ in stiefel + adamw + original:
        if (config["experiment"], config["optim"]["lr"], config["train"]["epochs"]) != (kind, lr, epochs):
            raise ValueError(f"check {name!r}: run {arm}/seed{seed} is a {config['experiment']} run with lr "
                             f"{config['optim']['lr']:g} and {config['train']['epochs']} epochs, the others "
                             f"{kind} with lr {lr:g} and {epochs}; a check compares runs that differ in the frame "
                             f"lr only.")
    if kind not in CHECK_MEASURES:
        raise ValueError(f"check {name!r}: no measure for {kind!r} runs; known: {', '.join(CHECK_MEASURES)}.")
    score = CHECK_MEASURES[kind]["score"]
    points: dict[float, dict[str, float | None]] = {}
    for config, _, seed, recs in stiefel:
        mu = round((config["optim"]["frame_lr"] or lr) / lr, 6)
        points.setdefault(mu, {})[str(seed)] = score(recs)
    return {"name": name, "experiment": kind, "lr": lr, "epochs": epochs,
            "adjust_lr_fn": first["optim"].get("adjust_lr_fn", "original"),
            "adamw": {str(seed): score(recs) for _, _, seed, recs in sorted(adamw, key=lambda r: r[2])},
            "papers_step": {str(seed): score(recs) for _, _, seed, recs in sorted(original, key=lambda r: r[2])},
            "papers_step_multiplier": _papers_step_multiplier(first),
            "points": [{"multiplier": m, "scores": dict(sorted(v.items(), key=lambda kv: int(kv[0])))}
                       for m, v in sorted(points.items())]}


def _row_at(rows: Sequence[Mapping[str, Any]], mu: float | None) -> Mapping[str, Any] | None:
    """The row of multiplier ``mu`` (``None`` when it was not run or ``mu`` is ``None``)."""
    return next((r for r in rows if mu is not None and math.isclose(r["multiplier"], mu, rel_tol=1e-3)), None)


def _placement(rows: Sequence[Mapping[str, Any]], best: Mapping[str, Any] | None
               ) -> tuple[Mapping[str, Any] | None, dict[str, Any]]:
    r"""The :math:`\mu = 1` row (``None`` when not run) and where the best row lies on the grid: ``bracketed``
    (a grid point on each side of it; ``None`` with fewer than three multipliers, which cannot bracket anything)
    and ``default_grid_distance`` :math:`|\log_3 \mu^*|` (``None`` when unlocated or :math:`\mu = 1` was not
    run). One definition for the language-model shapes and the checks."""
    one = _row_at(rows, 1.0)
    located = best is not None and len(rows) >= 3
    index = rows.index(best) if located else None
    return one, {"located": located,
                 "bracketed": None if not located else 0 < index < len(rows) - 1,
                 "default_grid_distance": (None if not located or one is None
                                           else round(abs(math.log(best["multiplier"]) / math.log(3)), 3))}


def summarize_check(check: Mapping[str, Any]) -> dict[str, Any]:
    r"""Per multiplier the mean score over the seeds run at every multiplier (``None`` when a seed never got
    there: it ranks last), the best multiplier, whether it is bracketed, the grid distance of :math:`\mu = 1`
    from it, and AdamW's mean over the same seeds."""
    measure = CHECK_MEASURES[check["experiment"]]
    sign = 1.0 if measure["better"] == "lower" else -1.0
    points = check["points"]
    common = sorted(set.intersection(*(set(p["scores"]) for p in points)), key=int)

    def mean(scores: Mapping[str, float | None]) -> float | None:
        vals = [scores.get(k) for k in common]
        return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)

    rows = [{"multiplier": p["multiplier"], "mean": mean(p["scores"])} for p in points] if common else []
    ranked = sorted(rows, key=lambda r: (r["mean"] is None, sign * (r["mean"] or 0.0)))
    best = ranked[0] if ranked and ranked[0]["mean"] is not None else None
    one, where = _placement(rows, best)
    located = where["located"]
    adamw = mean(check["adamw"]) if common and all(k in check["adamw"] for k in common) else None
    papers = check.get("papers_step", {})
    papers_mean = mean(papers) if common and all(k in papers for k in common) else None
    return {"name": check["name"], "experiment": check["experiment"], "measure": measure["label"],
            "better": measure["better"], "seeds": common, "rows": rows, "adamw_mean": adamw,
            "papers_step_mean": papers_mean, "papers_step_multiplier": check.get("papers_step_multiplier"),
            "best_multiplier": None if best is None else best["multiplier"],
            "bracketed": where["bracketed"], "default_grid_distance": where["default_grid_distance"],
            "default_minus_best": (None if not located or one is None or one["mean"] is None
                                   else one["mean"] - best["mean"]),
            "commits": check.get("commits", [])}


def _mean(values: Mapping[str, float]) -> float | None:
    vals = list(values.values())
    return sum(vals) / len(vals) if vals else None


def summarize_transfer(shapes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    r"""Per shape: the mean final validation bpb at every multiplier (over the seeds that finished), the best
    multiplier (lowest mean), whether it is bracketed (a grid point on each side of it; ``None`` with fewer than
    three multipliers run), the grid distance
    :math:`|\log_3 \mu^*|` of :math:`\mu = 1` from it (``None`` when :math:`\mu = 1` was not run) and the bpb
    :math:`\mu = 1` loses against the best, next to AdamW's mean. Only seeds present at every multiplier of a
    shape are averaged, so the curve compares like with like."""
    out = []
    for shape in shapes:
        points = shape["points"]
        common = set.intersection(*(set(p["finals"]) for p in points)) if points else set()
        rows = [{"multiplier": p["multiplier"], "frame_lr": p["frame_lr"], "seeds": sorted(common, key=int),
                 "mean": _mean({s: p["finals"][s] for s in common})} for p in points] if common else []
        best = min(rows, key=lambda r: r["mean"]) if rows else None
        one, where = _placement(rows, best)
        located = where["located"]  # an optimum is located by three or more multipliers
        adamw = _mean({s: v for s, v in shape["adamw"].items() if s in common}) if common else None
        papers = shape.get("papers_step", {})
        papers_mean = _mean({s: papers[s] for s in common}) if common and common <= set(papers) else None
        out.append({
            "name": shape["name"], "width": shape["width"], "heads": shape["heads"], "head_size": shape["head_size"],
            "lr": shape["lr"], "adjust_lr_fn": shape["adjust_lr_fn"], "seeds": sorted(common, key=int),
            "rows": rows, "adamw_mean": adamw, "papers_step_mean": papers_mean,
            "best_multiplier": None if best is None else best["multiplier"],
            "bracketed": where["bracketed"], "default_grid_distance": where["default_grid_distance"],
            "default_loss_bpb": None if not located or one is None else one["mean"] - best["mean"],
            "default_minus_adamw": None if one is None or adamw is None else one["mean"] - adamw,
            "best_minus_adamw": None if not located or adamw is None else best["mean"] - adamw,
        })
    return {"shapes": out}


def _f(x: float | None, fmt: str = ".4f", sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+{fmt}}" if sign else f"{x:{fmt}}"


def render_transfer(summary: Mapping[str, Any], *, intro: str = "") -> str:
    """Markdown report of :func:`summarize_transfer`."""
    shapes = summary["shapes"]
    lines = ["# Frame-step rule across widths: final validation bits per byte against the multiplier", ""]
    if intro:
        lines += [intro, ""]
    multipliers = sorted({r["multiplier"] for s in shapes for r in s["rows"]})
    lines += ["## Final validation bpb per multiplier (mean over the seeds run at every multiplier)", "",
              "| shape | seeds | " + " | ".join(f"μ = {m:.3g}" for m in multipliers) + " | adamw |",
              "|---|---|" + "---|" * len(multipliers) + "---|"]
    for s in shapes:
        by = {round(r["multiplier"], 6): r for r in s["rows"]}
        cells = []
        for m in multipliers:
            r = by.get(round(m, 6))
            text = _f(r and r["mean"])
            cells.append(f"**{text}**" if r is not None and m == s["best_multiplier"] else text)
        lines.append(f"| {s['name']} (width {s['width']}, {s['heads']} heads of {s['head_size']}) "
                     f"| {', '.join(s['seeds']) or '–'} | " + " | ".join(cells) + f" | {_f(s['adamw_mean'])} |")
    lines += ["", "## Where each optimum lies", "",
              "| shape | best μ | bracketed | grid points from μ = 1 | μ = 1 − best (bpb) | μ = 1 − adamw (bpb) "
              "| best − adamw (bpb) |", "|---|---|---|---|---|---|---|"]
    for s in shapes:
        bracket = "–" if s["bracketed"] is None else ("yes" if s["bracketed"] else "no (at an edge)")
        lines.append(f"| {s['name']} | {_f(s['best_multiplier'], '.3g')} | {bracket} "
                     f"| {_f(s['default_grid_distance'], '.3g')} | {_f(s['default_loss_bpb'], sign=True)} "
                     f"| {_f(s['default_minus_adamw'], sign=True)} | {_f(s['best_minus_adamw'], sign=True)} |")
    lines += ["", f"![final validation bpb against the multiplier]({FIGURE_FILE})", ""]
    checks = summary.get("checks") or []
    if checks:
        lines += _render_checks(checks)
    lines += ["## What a user who changes nothing gets", "",
              "`StiefelAdam`'s default rule (`adjust_lr_fn=\"match_rms_adamw\"`) at the model's lr is μ = 1; "
              "beside it the best multiplier found, the paper's step (`\"original\"`) where it ran, and AdamW.", "",
              *default_table(summary), ""]
    info = summary.get("trained_on")
    if info:
        shas = ", ".join(c["sha"][:10] + (" (uncommitted changes)" if c["dirty"] else "") for c in info["commits"])
        lines += ["## Run", "", f"- trained on commit(s): {shas}", f"- CPU: {', '.join(info['cpus'])}",
                  f"- training time, all runs: {info['train_seconds'] / 3600:.2f} core-hours", ""]
    return "\n".join(lines)


def _render_checks(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Checks on other models", "",
             "The same rule on other models, each scored by its own measure (mean over the seeds run at every "
             "multiplier; 'not reached' ranks last). Bold: the best multiplier. 'paper's step': the stiefel arm "
             "with adjust_lr_fn='original' at the model's lr, which is the rule at μ = 1/√(d r) (d the width, "
             "r the head size).", ""]
    for c in checks:
        fmt = CHECK_MEASURES[c["experiment"]]["fmt"]
        m0 = c.get("papers_step_multiplier")
        papers = "paper's step" + (f" (μ = 1/{1 / m0:.3g})" if m0 else "")
        lines += [f"**{c['name']}** ({c['experiment']} study; {c['measure']}, {c['better']} is better; seeds "
                  f"{', '.join(c['seeds']) or '–'})", "",
                  "| " + " | ".join(f"μ = {r['multiplier']:.3g}" for r in c["rows"]) + f" | {papers} | adamw "
                  "| best μ | bracketed | grid points from μ = 1 | μ = 1 − best |",
                  "|" + "---|" * (len(c["rows"]) + 6)]
        cells = []
        for r in c["rows"]:
            text = "not reached" if r["mean"] is None else f"{r['mean']:{fmt}}"
            cells.append(f"**{text}**" if r["multiplier"] == c["best_multiplier"] else text)
        bracket = "–" if c["bracketed"] is None else ("yes" if c["bracketed"] else "no (at an edge)")
        lines += ["| " + " | ".join(cells) + f" | {_f(c.get('papers_step_mean'), fmt)} | {_f(c['adamw_mean'], fmt)} "
                  f"| {_f(c['best_multiplier'], '.3g')} "
                  f"| {bracket} | {_f(c['default_grid_distance'], '.3g')} "
                  f"| {_f(c['default_minus_best'], fmt, sign=True)} |", ""]
        if c.get("commits"):
            lines += ["trained on commit(s): " + ", ".join(
                x["sha"][:10] + (" (uncommitted changes)" if x["dirty"] else "") for x in c["commits"]), ""]
    return lines


def default_table(summary: Mapping[str, Any]) -> list[str]:
    r"""Markdown rows: what the rule at :math:`\mu = 1` (``StiefelAdam``'s default, the model's lr) gives on every
    shape and check, next to the best multiplier found, the paper's step (where it ran) and AdamW. The README
    quotes these lines; a test rebuilds them from the committed summary."""
    lines = ["| model | measure | seeds | default (μ = 1) | best found (μ) | grid points from the default "
             "| paper's step | AdamW |", "|---|---|---|---|---|---|---|---|"]

    def at_one(rows: Sequence[Mapping[str, Any]]) -> float | None:
        return best_of(rows, 1.0)

    def best_of(rows: Sequence[Mapping[str, Any]], mu: float | None) -> float | None:
        return (_row_at(rows, mu) or {}).get("mean")

    for s in summary["shapes"]:
        best = best_of(s["rows"], s["best_multiplier"])
        lines.append(f"| language model {s['name']} (width {s['width']}, heads of {s['head_size']}) "
                     f"| final validation bpb (lower is better) | {', '.join(s['seeds'])} | {_f(at_one(s['rows']))} "
                     f"| {_f(best)} ({_f(s['best_multiplier'], '.3g')}) | {_f(s['default_grid_distance'], '.3g')} "
                     f"| {_f(s.get('papers_step_mean'))} | {_f(s['adamw_mean'])} |")
    for c in summary.get("checks") or []:
        fmt = CHECK_MEASURES[c["experiment"]]["fmt"]
        best = best_of(c["rows"], c["best_multiplier"])
        edge = "" if c["bracketed"] is not False else ", at the grid's edge"
        lines.append(f"| {c['name']} | {c['measure']} ({c['better']} is better) | {', '.join(c['seeds'])} "
                     f"| {_f(at_one(c['rows']), fmt)} | {_f(best, fmt)} ({_f(c['best_multiplier'], '.3g')}{edge}) "
                     f"| {_f(c['default_grid_distance'], '.3g')} | {_f(c.get('papers_step_mean'), fmt)} "
                     f"| {_f(c['adamw_mean'], fmt)} |")
    return lines


def plot_transfer(summary: Mapping[str, Any], path: str | os.PathLike) -> Path | None:
    """Final validation bpb against the multiplier (log scale), one curve per shape; AdamW as a dashed level
    in the same colour."""
    from ..harness.plotting import _row, _save

    shapes = [s for s in summary["shapes"] if s["rows"]]
    if not shapes:
        return None
    fig, (ax,) = _row(width=7.0, height=4.5)
    for i, s in enumerate(shapes):
        color = f"C{i}"
        xs = [r["multiplier"] for r in s["rows"]]
        ax.plot(xs, [r["mean"] for r in s["rows"]], marker="o", color=color,
                label=f"{s['name']} (seeds {','.join(s['seeds'])})")
        if s["adamw_mean"] is not None:
            ax.axhline(s["adamw_mean"], color=color, linestyle="--", linewidth=0.9)
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("multiplier μ = frame lr / model lr (adjust_lr_fn='match_rms_adamw')")
    ax.set_ylabel("final validation bits per byte")
    ax.set_title("stiefel arm against μ, one curve per shape (dashed: adamw)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def trained_on(root: str | os.PathLike) -> dict[str, Any]:
    """The git commits (``sha``, whether the tree was ``dirty``), CPU models and total training seconds of every
    run under ``root``, from the runs' ``environment.json`` (one entry per training call)."""
    commits: dict[str, bool] = {}
    cpus: set[str] = set()
    seconds = 0.0
    from ..harness.records import run_paths

    for path in run_paths(root, "environment.json", parent="**/runs/*"):
        for call in json.loads(path.read_text()):
            sha = call.get("git_sha") or "unknown"
            commits[sha] = commits.get(sha, False) or bool(call.get("git_dirty"))
            cpus.add(call.get("cpu_model") or "unknown")
            seconds += float(call.get("seconds") or 0.0)
    return {"commits": [{"sha": k, "dirty": v} for k, v in sorted(commits.items())], "cpus": sorted(cpus),
            "train_seconds": round(seconds, 1)}


def setup_text(root: str | os.PathLike) -> str:
    """The shared setup of the studies under ``root`` in words, from the first run's ``config.json``."""
    from ..harness.records import run_paths
    from ..harness.run_folder import CONFIG_FILE

    first = next(iter(run_paths(root, CONFIG_FILE, parent="*/runs/*")), None)
    if first is None:
        return ""
    c = json.loads(first.read_text())["config"]
    needed = ("depth", "context", "batch_size", "steps_per_epoch", "lr_schedule", "warmup_fraction", "eval_windows")
    if any(k not in c for k in needed):  # not an lm study's config: no setup paragraph
        return ""
    o, t = c["optim"], c["train"]
    steps = t["epochs"] * c["steps_per_epoch"]
    corpus = (c.get("corpus_identity") or {}).get("source", c.get("corpus"))
    return (f"Byte-level GPT-2, depth {c['depth']}, context {c['context']}, batch {c['batch_size']}, {steps:,} steps "
            f"({c['lr_schedule']} schedule, warm-up {c['warmup_fraction']:g}), trained on {corpus}; final bits per "
            f"byte on {c['eval_windows']} fixed validation windows. Every non-frame parameter: AdamW lr {o['lr']:g}, "
            f"betas {tuple(o['betas'])}, weight decay {o['weight_decay']:g}. The stiefel arm's frames: StiefelAdam with "
            f"adjust_lr_fn={o.get('adjust_lr_fn', 'original')!r}, frame lr = μ · lr, trust radius "
            f"{o['trust_region']} as recorded (code before issue 40, commit {FRAME_UNITS_COMMIT}, read it per entry "
            f"under match_rms_adamw: times √(dr) in a frame's units; later code reads it in a frame's units"
            f"{_radius_reading(root)}). Width and heads per shape below; every other "
            f"setting is shared. Short runs chosen to locate each optimum within the session's CPU budget, not "
            f"to reach the best loss; read the figures as where the optimum lies, not as final model quality.")


#: The commit from which ``--trust-region`` is in a frame's units under every rule (issue 40), and its time.
FRAME_UNITS_COMMIT, FRAME_UNITS_TIME = "8c09df4", "2026-12-05T15:27:01+00:00"


def _radius_reading(root: str | os.PathLike) -> str:
    """``"; every run here started before it"`` when every run under ``root`` started (``environment.json``) before
    :data:`FRAME_UNITS_TIME`, so that its code read the radius per entry; ``""`` otherwise (a later run may run
    either code: its commit says which)."""
    from datetime import datetime

    from ..harness.records import run_paths

    limit, starts = datetime.fromisoformat(FRAME_UNITS_TIME), []
    for env in run_paths(root, "environment.json", parent="*/runs/*"):
        data = json.loads(env.read_text())
        starts += [r.get("started") for r in (data if isinstance(data, list) else [data])]
    if starts and all(s and datetime.fromisoformat(s) < limit for s in starts):
        return "; every run here started before it"
    return ""


def read_checks(root: str | os.PathLike) -> list[dict[str, Any]]:
    """The checks listed in ``root``/``checks.json`` (:func:`collect_check` of each); ``[]`` without that file.
    Raises ``ValueError`` naming the file for an entry without ``name`` and ``path``."""
    path = Path(root) / CHECKS_FILE
    if not path.exists():
        return []
    out = []
    for entry in json.loads(path.read_text()).get("checks", []):
        if not {"name", "path"} <= set(entry):
            raise ValueError(f"{path}: every check needs 'name' and 'path' (relative to {root}); got {entry}.")
        ref = entry.get("reference")
        check = collect_check(Path(root) / entry["path"], name=entry["name"],
                              reference=None if ref is None else Path(root) / ref)
        commits = trained_on(Path(root) / entry["path"])["commits"]
        if ref is not None:
            commits += trained_on(Path(root) / ref)["commits"]
        out.append({**check, "commits": sorted({c["sha"]: c for c in commits}.values(), key=lambda c: c["sha"])})
    return out


def transfer_report(root: str | os.PathLike, *, intro: str = "") -> dict[str, Any]:
    """Write ``summary.json``, ``report.md`` and ``transfer.png`` into ``root`` from the lm studies under it;
    returns the summary. Raises ``ValueError`` naming ``root`` when it holds no study."""
    root = Path(root)
    shapes = collect_shapes(root)
    if not shapes:
        raise ValueError(f"{root}: holds no language-model study folder (<shape>/runs/<arm>/seed<k>/config.json); "
                         f"train them first with experiments/lm/run_frame_step.sh.")
    summary = {"shapes_collected": shapes, **summarize_transfer(shapes), "trained_on": trained_on(root)}
    checks = read_checks(root)
    if checks:
        summary["checks_collected"] = checks
        summary["checks"] = [summarize_check(c) for c in checks]
    (root / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    plot_transfer(summary, root / FIGURE_FILE)
    (root / REPORT_FILE).write_text(render_transfer(summary, intro=intro or setup_text(root)))
    return summary
