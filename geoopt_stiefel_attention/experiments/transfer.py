r"""Does a frame-step rule transfer across widths? The report over several language-model studies.

The input is a folder of :mod:`~geoopt_stiefel_attention.experiments.lm` studies, one per model shape (e.g.
``w64/``, ``w128/``, ``w256/``, ``w128-h64/``), each trained with the same flags apart from ``--width`` and
``--heads``, an ``adamw`` arm and a ``stiefel`` arm whose frame learning rate is swept (``--frame-lrs``) around
the model's learning rate. With ``adjust_lr_fn="match_rms_adamw"`` the frame lr is a per-entry step size, so the
*multiplier* :math:`\mu = \text{frame lr} / \text{lr}` is what a user would tune; the rule transfers when the
best :math:`\mu` stays at the same grid point whatever the width. The report gives, per shape, the final
validation bits per byte against :math:`\mu` (one curve per shape, AdamW as a dashed level), where each optimum
lies, whether it is bracketed (not at an edge of the grid) and how far :math:`\mu = 1` (the rule with the
model's lr, what a user who changes nothing gets) is from it, in grid points and in bits per byte.

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

__all__ = ["collect_shapes", "summarize_transfer", "render_transfer", "plot_transfer", "transfer_report"]

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
FIGURE_FILE = "transfer.png"


def _finished_finals(folder: Path, arm: str, epochs: int) -> dict[int, float]:
    """Final ``val_bpb`` per seed of the runs of ``arm`` in ``folder`` that reached ``epochs``."""
    from .records import group_runs, load_study_records

    runs = group_runs(r for r in load_study_records(folder) if r["arm"] == arm)
    return {s: recs[-1]["val_bpb"] for s, recs in runs.get(arm, {}).items()
            if recs[-1]["epoch"] >= epochs and recs[-1].get("val_bpb") is not None}


def collect_shapes(root: str | os.PathLike) -> list[dict[str, Any]]:
    """One entry per study folder under ``root`` (sorted by width, then head size): its shape (``width``,
    ``heads``, ``head_size``, ``depth``), the model ``lr``, ``adjust_lr_fn``, the ``adamw`` finals per seed and
    one ``points`` row per frame lr (``multiplier``, ``frame_lr``, ``finals`` per seed) with finished runs."""
    from .runner import CONFIG_FILE

    root = Path(root)
    shapes = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        configs = sorted(folder.glob(f"runs/*/seed*/{CONFIG_FILE}"))
        if not configs:
            continue
        config = json.loads(configs[0].read_text())["config"]
        epochs = config["train"]["epochs"]
        lr = config["optim"]["lr"]
        cells = [(folder, config["optim"]["frame_lr"] or lr)]
        for cell in folder.glob("frame-lr-*"):
            specs = sorted(cell.glob(f"runs/*/seed*/{CONFIG_FILE}"))
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
                       "points": sorted(points, key=lambda p: p["multiplier"])})
    return sorted(shapes, key=lambda s: (s["width"], s["head_size"]))


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
        one = next((r for r in rows if math.isclose(r["multiplier"], 1.0, rel_tol=1e-3)), None)
        index = rows.index(best) if best else None
        located = best is not None and len(rows) >= 3  # an optimum is located by three or more multipliers
        adamw = _mean({s: v for s, v in shape["adamw"].items() if s in common}) if common else None
        out.append({
            "name": shape["name"], "width": shape["width"], "heads": shape["heads"], "head_size": shape["head_size"],
            "lr": shape["lr"], "adjust_lr_fn": shape["adjust_lr_fn"], "seeds": sorted(common, key=int),
            "rows": rows, "adamw_mean": adamw,
            "best_multiplier": None if best is None else best["multiplier"],
            # fewer than three multipliers cannot bracket anything: None ("–"), not "at an edge"
            "bracketed": None if not located else 0 < index < len(rows) - 1,
            "default_grid_distance": (None if not located or one is None
                                      else round(abs(math.log(best["multiplier"]) / math.log(3)), 3)),
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
    info = summary.get("trained_on")
    if info:
        shas = ", ".join(c["sha"][:10] + (" (uncommitted changes)" if c["dirty"] else "") for c in info["commits"])
        lines += ["## Run", "", f"- trained on commit(s): {shas}", f"- CPU: {', '.join(info['cpus'])}",
                  f"- training time, all runs: {info['train_seconds'] / 3600:.2f} core-hours", ""]
    return "\n".join(lines)


def plot_transfer(summary: Mapping[str, Any], path: str | os.PathLike) -> Path | None:
    """Final validation bpb against the multiplier (log scale), one curve per shape; AdamW as a dashed level
    in the same colour."""
    from .plotting import _row, _save

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
    for path in sorted(Path(root).glob("**/runs/*/seed*/environment.json")):
        for call in json.loads(path.read_text()):
            sha = call.get("git_sha") or "unknown"
            commits[sha] = commits.get(sha, False) or bool(call.get("git_dirty"))
            cpus.add(call.get("cpu_model") or "unknown")
            seconds += float(call.get("seconds") or 0.0)
    return {"commits": [{"sha": k, "dirty": v} for k, v in sorted(commits.items())], "cpus": sorted(cpus),
            "train_seconds": round(seconds, 1)}


def setup_text(root: str | os.PathLike) -> str:
    """The shared setup of the studies under ``root`` in words, from the first run's ``config.json``."""
    from .runner import CONFIG_FILE

    first = next(iter(sorted(Path(root).glob(f"*/runs/*/seed*/{CONFIG_FILE}"))), None)
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
            f"{o['trust_region']} (per entry under match_rms_adamw). Width and heads per shape below; every other "
            f"setting is shared. Short runs chosen to locate each optimum within the session's CPU budget, not "
            f"to reach the best loss; read the figures as where the optimum lies, not as final model quality.")


def transfer_report(root: str | os.PathLike, *, intro: str = "") -> dict[str, Any]:
    """Write ``summary.json``, ``report.md`` and ``transfer.png`` into ``root`` from the lm studies under it;
    returns the summary. Raises ``ValueError`` naming ``root`` when it holds no study."""
    root = Path(root)
    shapes = collect_shapes(root)
    if not shapes:
        raise ValueError(f"{root}: holds no language-model study folder (<shape>/runs/<arm>/seed<k>/config.json); "
                         f"train them first with studies/lm/run_frame_step.sh.")
    summary = {"shapes_collected": shapes, **summarize_transfer(shapes), "trained_on": trained_on(root)}
    (root / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    plot_transfer(summary, root / FIGURE_FILE)
    (root / REPORT_FILE).write_text(render_transfer(summary, intro=intro or setup_text(root)))
    return summary
