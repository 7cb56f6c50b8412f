"""Markdown report of a study: the measured numbers per arm next to the paper's, and the figures.

:func:`render_report` turns a :func:`~geoopt_stiefel_attention.experiments.records.summarize` result
into markdown; it returns text and never prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PaperReference", "render_report", "write_text"]


@dataclass(frozen=True)
class PaperReference:
    """Published numbers to put next to the measured ones.

    Parameters
    ----------
    source : str
        Citation, e.g. ``"Guerrero, Stiefel Attention (2026)"``.
    epoch : int or None
        The epoch the published values refer to.
    values : mapping of str to float
        Arm name -> published value of the summary metric (a fraction, e.g. 0.970).
    note : str
        What the source itself says about the numbers (number of runs, stability).
    """

    source: str
    epoch: int | None
    values: Mapping[str, float]
    note: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "–" if x is None else format(x, fmt)


def _dip(x: int | None) -> str:
    return "never reached" if x is None else str(x)


def _mean_std(stat: Mapping[str, Any] | None, fmt) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    s = fmt(stat["mean"])
    if stat.get("std") is not None:
        s += f" ± {fmt(stat['std'])}"
    return s


def _per_seed(stat: Mapping[str, Any] | None, fmt) -> str:
    if not stat:
        return "–"
    return ", ".join(f"{k}: {fmt(v)}" for k, v in stat["per_seed"].items())


def render_report(*, title: str, summary: Mapping[str, Any], intro: str = "",
                  paper: PaperReference | None = None, figures: Mapping[str, str | os.PathLike] | None = None,
                  config: Mapping[str, Any] | None = None, run_info: Mapping[str, Any] | None = None,
                  notes: Sequence[str] = ()) -> str:
    """Markdown text of a study report.

    Parameters
    ----------
    title, intro : str
        Heading and a paragraph under it.
    summary : mapping
        The output of :func:`~geoopt_stiefel_attention.experiments.records.summarize`.
    paper : PaperReference, optional
        Published values, shown next to the measured final values.
    figures : mapping of str to path, optional
        Caption -> PNG path relative to the report.
    config : mapping, optional
        The study config (``to_dict``), shown as JSON.
    run_info : mapping, optional
        Key -> value lines (device, epochs per second, wall time, command).
    notes : sequence of str
        Bullet points at the end (caveats).
    """
    metric = summary["metric"]
    thr = summary["threshold"]
    frac = summary["last_fraction"]
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += ["## Results per arm", "",
              f"`{metric}` at the last evaluated epoch; first epoch with `{metric}` ≥ {_pct(thr, 0)} (resolution: the "
              f"evaluation interval); share of seeds whose `{metric}` stays ≥ {_pct(thr, 0)} at every evaluation of "
              f"the last {_pct(frac, 0)} of training, with the mean over those evaluations and the share of them "
              f"≥ {_pct(thr, 0)}; evaluations below {_pct(thr, 0)} after first reaching it (dips); frames' "
              f"movement ‖W − W₀‖_F of W_Q at the end, and the mean over evaluations of the last step's "
              f"‖ΔW_Q‖_F.", "",
              "| arm | seeds | last epoch | final (mean ± sd) | final per seed | first epoch ≥ thr (per seed) "
              "| stays ≥ thr | last 10%: mean, share ≥ thr | dips | ‖W_Q − W_Q0‖_F | mean step ‖ΔW_Q‖_F |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summary["arms"].items():
        epochs = sorted(set(s["last_epoch"].values()))
        first = s["first_epoch_reaching"]
        first_txt = ", ".join(f"{k}: {'never' if v is None else v}" for k, v in first["per_seed"].items())
        stays = s["stays_above"]
        n = len(stays["per_seed"])
        lines.append(
            f"| {arm} | {len(s['seeds'])} | {', '.join(map(str, epochs))} | {_mean_std(s['final'], _pct)} "
            f"| {_per_seed(s['final'], _pct)} | {first_txt} ({first['n_reached']}/{first['n']} reached) "
            f"| {round(stays['fraction'] * n)}/{n} | {_mean_std(s.get('tail_mean'), _pct)}, "
            f"{_mean_std(s.get('tail_share_above'), _pct)} | {_per_seed(s.get('dips_after_reaching'), _dip)} "
            f"| {_mean_std(s.get('final_move_total/q'), _num)} "
            f"| {_mean_std(s.get('mean_move_step/q'), _num)} |")
    lines.append("")
    if summary.get("paired"):
        lines += ["## Paired differences (same seed: same split and initial weights)", "",
                  f"| comparison | n | mean Δ{metric} | sd | paired t | positive |", "|---|---|---|---|---|---|"]
        for name, p in summary["paired"].items():
            lines.append(f"| {name} | {p['n']} | {_pct(p['mean'], 2)} | {_pct(p['std'], 2)} | {_num(p['t'])} "
                         f"| {p['n_positive']}/{p['n']} |")
        lines.append("")
    if paper is not None:
        at = "" if paper.epoch is None else f" at epoch {paper.epoch}"
        lines += ["## Next to the paper", "", f"Published{at} ({paper.source}). {paper.note}".rstrip(), "",
                  f"| arm | paper{at} | this study: final {metric} (mean ± sd) | this study per seed |",
                  "|---|---|---|---|"]
        for arm in dict.fromkeys([*paper.values, *summary["arms"]]):
            s = summary["arms"].get(arm)
            lines.append(f"| {arm} | {_pct(paper.values.get(arm))} | {_mean_std(s and s['final'], _pct)} "
                         f"| {_per_seed(s and s['final'], _pct)} |")
        lines.append("")
    if figures:
        lines += ["## Figures", ""]
        for caption, path in figures.items():
            lines += [f"**{caption}**", "", f"![{caption}]({Path(path).as_posix()})", ""]
    if run_info:
        lines += ["## Run", ""]
        lines += [f"- {k}: {v}" for k, v in run_info.items()]
        lines.append("")
    if config:
        lines += ["## Configuration", "", "```json", json.dumps(config, indent=2), "```", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (creating the folder) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
