"""Markdown report of a study: the measured numbers per arm next to the paper's, and the figures.

:func:`render_report` turns a :func:`~experiments.harness.records.summarize` result
into markdown; it returns text and never prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .mechanism import mechanism_lines

__all__ = ["PaperReference", "protocol_differences", "paper_section_intro", "comparison_table", "figure_lines",
           "run_lines", "render_report", "write_text", "fmt_pp", "fmt_num", "fmt_p"]


@dataclass(frozen=True)
class PaperReference:
    """Published numbers, and the protocol they were measured with, for one study.

    Parameters
    ----------
    source : str
        Citation, e.g. ``"Guerrero, Stiefel Attention (2026)"``.
    epoch : int or None
        The epoch the published per-arm ``values`` refer to.
    values : mapping of str to float
        Arm name -> published value of the summary metric (a fraction, e.g. 0.970).
    note : str
        What the source itself says about the numbers (number of runs, stability).
    extra : mapping
        Other published figures, by name (e.g. ``paired_gap_pp``, ``movement_ratio``).
    protocol : mapping of str to value
        Dotted config path (``"p"``, ``"train.epochs"``, ``"dataset"``) -> the value the paper used. A report
        sets the published numbers beside its own only when the study's config matches every entry
        (:func:`protocol_differences`); otherwise it lists the settings that differ.
    """

    source: str
    epoch: int | None
    values: Mapping[str, float]
    note: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    protocol: Mapping[str, Any] = field(default_factory=dict)


def protocol_differences(paper: PaperReference, config: Any) -> list[tuple[str, Any, Any]]:
    """``(flag, paper's value, this study's value)`` for every protocol setting where ``config`` (a study
    config dataclass, or its plain-JSON dict) differs from the paper; empty when the protocol matches."""
    from .config import config_value, flag_of

    out = []
    for path, want in paper.protocol.items():
        have = config_value(config, path) if not isinstance(config, Mapping) else _lookup(config, path)
        if have != want:
            out.append((flag_of(path), want, have))
    return out


def _lookup(config: Mapping[str, Any], path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def paper_section_intro(paper: PaperReference, differences: Sequence[tuple[str, Any, Any]],
                        reached: Sequence[int] | None = None) -> list[str]:
    """The opening lines of a report's "Next to the paper" section: the source, and, when the protocol differs
    (``differences``) or the runs have not all reached ``paper.epoch`` (``reached``: the last epochs of the
    runs), what differs and that no published number is set beside this study's."""
    lines = ["## Next to the paper", "", f"Paper: {paper.source}. {paper.note}".rstrip(), ""]
    if differences:
        listed = "; ".join(f"{flag} {_show(mine)} here, {_show(theirs)} in the paper"
                           for flag, theirs, mine in differences)
        lines += [f"**This study does not follow the paper's protocol** ({listed}), so its numbers are not set "
                  f"beside the paper's. Rerun with the paper's settings to compare.", ""]
    elif reached is not None and paper.epoch is not None and list(reached) != [paper.epoch]:
        lines += [f"**Not every run has reached epoch {paper.epoch} yet** (last epochs: "
                  f"{', '.join(map(str, reached))}), so the paper's numbers at epoch {paper.epoch} are not set beside "
                  f"these. Rerun the training command to resume the runs.", ""]
    return lines


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def frame_rule_text(optim: Any) -> str:
    """What a run's frame lr means, for a report's setup paragraph: nothing under the studies' default rule (the
    paper's step, ``adjust_lr_fn="original"``: a frame's step has Frobenius norm about lr), else the rule by name
    and its step size, so that one frame lr is not read as another."""
    if getattr(optim, "adjust_lr_fn", "original") == "original":
        return ""
    return f" (adjust_lr_fn={optim.adjust_lr_fn!r}: per entry, a d × r frame's step is about lr·√(dr))"


def fmt_pp(x: float | None, digits: int = 2, sign: bool = True) -> str:
    """A fraction as percentage points, ``+1.23`` (``–`` for None)."""
    if x is None:
        return "–"
    return f"{100 * x:+.{digits}f}" if sign else f"{100 * x:.{digits}f}"


def fmt_num(x: float | None, fmt: str = ".3g") -> str:
    """A number in ``fmt`` (three significant digits by default), ``–`` for a missing one."""
    return "–" if x is None else format(x, fmt)


def fmt_p(p: float | None) -> str:
    """A p-value: two significant digits, scientific below 1e-4."""
    return "–" if p is None else (f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}")


def comparison_table(comparisons: Mapping[str, Mapping[str, Any]], *, unit: str = "pp") -> list[str]:
    """Markdown rows of paired comparisons (:meth:`~.stats.PairedStats.to_dict` dicts): pairs, mean difference,
    sd, confidence interval, paired t and two-sided p, positive pairs and the sign test, and where the comparisons
    carry them (:func:`~.stats.with_holm`) both p-values adjusted by Holm's method over the table, and where they carry
    it (:func:`~.stats.with_detectable`) the smallest difference detectable at the stated power, at the unadjusted
    level and at the Holm level. ``unit="pp"`` shows fractions as percentage points; any other unit shows the raw
    numbers with that unit."""
    def f(x: float | None, sign: bool = True) -> str:
        if unit == "pp":
            return fmt_pp(x, sign=sign)
        return "–" if x is None else (f"{x:+.4g}" if sign else f"{x:.4g}")

    holm = any("p_holm" in c for c in comparisons.values())
    detectable = next((c["detectable"] for c in comparisons.values() if "detectable" in c), None)
    extra = (" | Holm p (t / sign)", "|---") if holm else ("", "")
    if detectable is not None:
        extra = (extra[0] + f" | detectable at {100 * detectable['power']:g}% power ({unit}; α {detectable['alpha']:g}"
                 f" / Holm α/{detectable['family']})", extra[1] + "|---")
    lines = [f"| comparison | pairs | mean Δ ({unit}) | sd ({unit}) | 95% CI ({unit}) | paired t | p (two-sided) "
             f"| positive | sign-test p{extra[0]} |", "|---|---|---|---|---|---|---|---|---" + extra[1] + "|"]
    for name, c in comparisons.items():
        ci = "–" if c["ci_low"] is None else f"[{f(c['ci_low'])}, {f(c['ci_high'])}]"
        adjusted = f" | {fmt_p(c.get('p_holm'))} / {fmt_p(c.get('sign_test_p_holm'))}" if holm else ""
        if detectable is not None:
            d = c.get("detectable") or {}
            adjusted += (f" | {f(d.get('difference'), sign=False)} / {f(d.get('holm_difference'), sign=False)}")
        lines.append(f"| {name} | {c['n']} | {f(c['mean'])} | {f(c['std'], sign=False)} | {ci} | {fmt_num(c['t'])} "
                     f"| {fmt_p(c['p_value'])} | {c['n_positive']}/{c['n']} | {fmt_p(c['sign_test_p'])}{adjusted} |")
    return lines


def figure_lines(figures: Mapping[str, str | os.PathLike]) -> list[str]:
    """A "Figures" section: caption -> PNG path relative to the report."""
    if not figures:
        return []
    lines = ["## Figures", ""]
    for caption, path in figures.items():
        lines += [f"**{caption}**", "", f"![{caption}]({Path(path).as_posix()})", ""]
    return lines


def run_lines(run_info: Mapping[str, Any] | None) -> list[str]:
    """A "Run" section of ``- key: value`` lines."""
    if not run_info:
        return []
    return ["## Run", ""] + [f"- {k}: {v}" for k, v in run_info.items()] + [""]


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _dip(x: int | None) -> str:
    return "never reached" if x is None else str(x)


def _mean_std(stat: Mapping[str, Any] | None, fmt) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    s = fmt(stat["mean"])
    if stat.get("std") is not None:
        s += f" ± {fmt(stat['std'])}"
    return s


def _seed_list(stat: Mapping[str, Any] | None, fmt) -> str:
    if not stat:
        return "–"
    return ", ".join(f"{k}: {fmt(v)}" for k, v in stat["per_seed"].items())


def _distribution(d: Mapping[str, Any] | None) -> str:
    if not d:
        return "–"
    return f"{d['median']:g} [{d['min']:g}, {d['max']:g}]"


def render_report(*, title: str, summary: Mapping[str, Any], intro: str = "",
                  paper: PaperReference | None = None, figures: Mapping[str, str | os.PathLike] | None = None,
                  config: Mapping[str, Any] | None = None, run_info: Mapping[str, Any] | None = None,
                  notes: Sequence[str] = ()) -> str:
    """Markdown text of a study report over seeds.

    Per arm: the endpoint (final ``metric``, mean ± sd and per seed; the tail mean over the last
    ``last_fraction`` of training), when the threshold was first reached (per seed, and median [min, max]
    over the seeds that reached it), the dips after reaching it (count per seed, and the lowest value), and the
    movement of W_Q. Then the paired comparisons across seeds (:func:`comparison_table`) of the final
    metric, the tail mean and the first epoch at the threshold. The paper's values are set beside the measured
    ones only when ``config`` follows ``paper.protocol`` and every run reached ``paper.epoch``; otherwise
    the report says which settings differ.

    Parameters
    ----------
    title, intro : str
        Heading and a paragraph under it.
    summary : mapping
        The output of :func:`~experiments.harness.records.summarize`.
    paper : PaperReference, optional
        Published values and their protocol.
    figures : mapping of str to path, optional
        Caption -> PNG path relative to the report.
    config : mapping, optional
        The study config (``to_dict``), shown as JSON and checked against ``paper.protocol``.
    run_info : mapping, optional
        Key -> value lines (device, speed, command).
    notes : sequence of str
        Bullet points at the end (caveats).
    """
    from .records import DIP_DEFINITION, tail_description

    metric = summary["metric"]
    thr = _pct(summary["threshold"], 0)
    arms = summary["arms"]
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += ["## Endpoint per arm", "",
              f"`{metric}` at the last evaluated epoch, and its mean over the tail, {tail_description(summary)} "
              f"(tail mean); 'stays ≥ {thr}': seeds whose `{metric}` is ≥ {thr} at every one of those "
              f"evaluations.", "",
              "| arm | seeds | last epoch | final (mean ± sd) | final per seed | tail mean (mean ± sd) "
              "| tail mean per seed | stays ≥ thr |", "|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        epochs = sorted(set(a["last_epoch"].values()))
        stays = a["stays_above"]
        n = len(stays["per_seed"])
        lines.append(f"| {arm} | {len(a['seeds'])} | {', '.join(map(str, epochs))} | {_mean_std(a['final'], _pct)} "
                     f"| {_seed_list(a['final'], _pct)} | {_mean_std(a.get('tail_mean'), _pct)} "
                     f"| {_seed_list(a.get('tail_mean'), _pct)} | {round(stays['fraction'] * n)}/{n} |")
    lines += ["", f"## Reaching {thr} and falling back", "",
              f"First evaluated epoch with `{metric}` ≥ {thr} (resolution: the evaluation interval), its median "
              f"[min, max] over the seeds that reached it; dips: {DIP_DEFINITION.replace('the threshold', thr)}; "
              f"the evaluations below {thr} they span; and the lowest `{metric}` after first reaching {thr} (the "
              f"depth of the deepest dip).", "",
              "| arm | reached | first epoch ≥ thr per seed | median [min, max] | dips per seed "
              "| evaluations below, per seed | lowest after reaching, per seed |", "|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        first = a["first_epoch_reaching"]
        first_txt = ", ".join(f"{k}: {'never' if v is None else v}" for k, v in first["per_seed"].items())
        lines.append(f"| {arm} | {first['n_reached']}/{first['n']} | {first_txt} "
                     f"| {_distribution(first.get('distribution'))} "
                     f"| {_seed_list(a.get('dips_after_reaching'), _dip)} "
                     f"| {_seed_list(a.get('evaluations_below_after_reaching'), _dip)} "
                     f"| {_seed_list(a.get('lowest_after_reaching'), _pct)} |")
    if any(a.get("final_move_total/q") or a.get("mean_move_step/q") for a in arms.values()):
        lines += ["", "## Movement of W_Q", "", "| arm | ‖W_Q − W_Q0‖_F at the end | mean over evaluations of the "
                  "last step's ‖ΔW_Q‖_F |", "|---|---|---|"]
        for arm, a in arms.items():
            lines.append(f"| {arm} | {_mean_std(a.get('final_move_total/q'), fmt_num)} "
                         f"| {_mean_std(a.get('mean_move_step/q'), fmt_num)} |")
    lines.append("")
    paired = [(f"final `{metric}`", summary.get("paired"), "pp"),
              ("tail mean", summary.get("paired_tail_mean"), "pp"),
              (f"first epoch ≥ {thr} (seeds where both arms reached it)", summary.get("paired_first_epoch"),
               "epochs")]
    if any(c for _, c, _ in paired):
        lines += ["## Paired comparisons across seeds (same seed: same split and initial weights)", ""]
        for label, comps, unit in paired:
            if comps:
                lines += [f"**{label}**", ""] + comparison_table(comps, unit=unit) + [""]
    lines += mechanism_lines(summary.get("mechanism"))
    if paper is not None:
        diffs = protocol_differences(paper, config) if config is not None else []
        reached = sorted({e for a in arms.values() for e in a["last_epoch"].values()})
        lines += paper_section_intro(paper, diffs, reached)
        if not diffs and (paper.epoch is None or reached == [paper.epoch]) and paper.values:
            at = "" if paper.epoch is None else f" at epoch {paper.epoch}"
            lines += [f"| arm | paper{at} | this study: final {metric} (mean ± sd) | this study per seed "
                      f"| this study: tail mean |", "|---|---|---|---|---|"]
            for arm in dict.fromkeys([*paper.values, *arms]):
                a = arms.get(arm)
                lines.append(f"| {arm} | {_pct(paper.values.get(arm))} | {_mean_std(a and a['final'], _pct)} "
                             f"| {_seed_list(a and a['final'], _pct)} | {_mean_std(a and a.get('tail_mean'), _pct)} |")
            lines.append("")
    lines += figure_lines(figures or {})
    lines += run_lines(run_info)
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
