r"""Why does an arm grok earlier? The start, the constraint and the step, as paired contrasts.

The grokking study's arms differ from each other in one ingredient at a time (see
:mod:`~experiments.harness.ablation_arms`), so the difference of their first epochs at the
threshold, seed by seed, measures that ingredient:

- **the start**: ``adamw-orthostart`` − ``adamw`` (W_Q, W_K start orthonormal, from the ``stiefel`` arm's
  frames, instead of random; AdamW as usual);
- **training W_Q, W_K at all**: ``adamw-frozen`` − ``adamw`` (W_Q, W_K frozen at AdamW's random start);
- **orthonormality of frozen W_Q, W_K**: ``stiefel-frozen`` − ``adamw-frozen``;
- **the constraint with its step**: ``stiefel`` − ``adamw-orthostart`` (from the same frames, trained on the
  manifold by StiefelAdam instead of freely by AdamW);
- **the step on the manifold**: ``stiefel`` − ``stiefel-frozen`` (frames moved by StiefelAdam instead of held);
- **weight decay on W_Q, W_K**: ``adamw-qk-nodecay`` − ``adamw`` (the same AdamW, without decay on W_Q, W_K);
- **training W_Q, W_K without decay**: ``adamw-frozen`` − ``adamw-qk-nodecay`` (frozen instead of trained, neither
  decayed): with the contrast above, it tells "attention that is not trained" from "attention that is not decayed".

:func:`mechanism_summary` computes the contrasts that both arms ran (paired t and sign tests on the seeds where
both reached the threshold, Holm's adjustment over the contrasts present) and a verdict per contrast by one
written rule (:data:`VERDICTS`); :func:`mechanism_lines` is the report's paragraph, generated from that summary
so that the words cannot drift from the records.

**One CPU kind per pair.** float32 trajectories part between CPU kinds (another matrix kernel rounds otherwise,
and grokking's collapse cycles amplify it), so a pair of runs trained on two kinds measures the kinds as well as
the arms. Given the study's runs (:func:`study_runs`: the runs under ``runs/``, and the runs of its arms retrained
on another machine in the folders :data:`PAIRING_FOLDERS`, e.g. ``same_cpu/<arm>/seed<k>``, each with the
machine and commits of its ``environment.json``), :func:`mechanism_summary` pairs each seed's runs of one machine
kind only (:func:`pair_by_machine`: the study's own runs first), leaves out seeds without such a pair, and keeps
the by-seed contrast of the study's own runs across machine kinds beside it, for comparison only. The contrasts'
runs, machines and commits are listed in the report. :func:`w_q_over_training` tabulates ‖W_Q‖_F (shrinkage),
‖W_Q − W_Q0‖_F (movement) and the largest principal angle to the start (rotation) per arm over training, and
:func:`refine_study_outputs` writes both into a finished study's ``summary.json`` and ``report.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .records import w_q_norm

__all__ = ["Contrast", "CONTRASTS", "VERDICTS", "verdict", "PAIRING_FOLDERS", "Run", "run_machine", "study_runs",
           "pair_by_machine", "mechanism_summary", "w_q_over_training", "mechanism_lines",
           "refine_study_outputs", "seeds_text", "cross_machine_note"]


@dataclass(frozen=True)
class Contrast:
    """One question: ``arm - against`` in first epoch at the threshold (negative: ``arm`` groks earlier)."""

    question: str
    arm: str
    against: str
    differs: str


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("the start", "adamw-orthostart", "adamw",
             "W_Q, W_K start orthonormal (the stiefel arm's frames) instead of random, then AdamW as usual"),
    Contrast("training W_Q, W_K at all", "adamw-frozen", "adamw", "W_Q, W_K frozen at AdamW's random start"),
    Contrast("orthonormality of frozen W_Q, W_K", "stiefel-frozen", "adamw-frozen",
             "frozen orthonormal frames instead of frozen random W_Q, W_K"),
    Contrast("the constraint with its step", "stiefel", "adamw-orthostart",
             "from the same frames, trained on the manifold by StiefelAdam instead of freely by AdamW"),
    Contrast("the step on the manifold", "stiefel", "stiefel-frozen",
             "frames moved by StiefelAdam instead of held at their start"),
    Contrast("weight decay on W_Q, W_K", "adamw-qk-nodecay", "adamw",
             "W_Q, W_K trained by AdamW without weight decay instead of with it (lambda = 1)"),
    Contrast("training W_Q, W_K without decay", "adamw-frozen", "adamw-qk-nodecay",
             "W_Q, W_K frozen at their random start instead of trained by AdamW without decay"),
)

#: The rule that turns a contrast into words, applied in this order.
VERDICTS = (
    ("too few pairs", "fewer than 3 pairs"),
    ("clear", "at least 5 pairs and Holm-adjusted paired-t p < 0.05"),
    ("suggested", "unadjusted paired-t p < 0.05 or unadjusted sign-test p < 0.1"),
    ("not seen", "otherwise"),
)


def verdict(comparison: Mapping[str, Any]) -> str:
    """The :data:`VERDICTS` word for one paired comparison (a :func:`~.stats.with_holm` entry)."""
    n = comparison["n"]
    if n < 3:
        return "too few pairs"
    if n >= 5 and comparison.get("p_holm") is not None and comparison["p_holm"] < 0.05:
        return "clear"
    t_p, sign_p = comparison.get("p_value"), comparison.get("sign_test_p")
    if (t_p is not None and t_p < 0.05) or (sign_p is not None and sign_p < 0.1):
        return "suggested"
    return "not seen"


# ---------------------------------------------------------------------------------------------- runs and machines
#: The folders of a study that hold runs, ``<folder>/<arm>/seed<k>``, in the order :func:`pair_by_machine` looks in
#: them: the study's own runs, then runs of its arms retrained on the commit and machine kind of another arm's runs
#: (``repro/``: the reproduction check of a new arm's commit; ``same_cpu/``: the retrained pairs).
PAIRING_FOLDERS = ("runs", "repro", "same_cpu")
#: The machine of a run whose ``environment.json`` names none (records from before the CPU model was recorded).
UNRECORDED = "machine not recorded"


@dataclass(frozen=True)
class Run:
    """One finished run of a study: where it lies, when it first reached the threshold, and where it was trained.

    ``machine`` is the CPU model (the device name on an accelerator) of every call that trained it, ``None`` when
    the calls ran on different machines (such a run pairs with none); ``commits`` are the short git SHAs of the
    calls (``*``: uncommitted changes)."""

    folder: str
    arm: str
    seed: int
    first_epoch: int | None
    machine: str | None
    commits: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return f"{self.folder}/{self.arm}/seed{self.seed}"


def run_machine(calls: Sequence[Mapping[str, Any]]) -> str | None:
    """The machine of a run from its ``environment.json`` calls: the CPU model (the device name on an accelerator)
    they all share, :data:`UNRECORDED` when none is recorded, ``None`` when they differ."""
    kinds = {(c.get("device_name") if c.get("device") not in (None, "cpu") else c.get("cpu_model")) or UNRECORDED
             for c in calls}
    return UNRECORDED if not kinds else (kinds.pop() if len(kinds) == 1 else None)


def _commits(calls: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c["git_sha"][:7] + ("*" if c.get("git_dirty") else "")
                               for c in calls if c.get("git_sha")))


def _calls(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "environment.json"
    return json.loads(path.read_text()) if path.exists() else []


def _run_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.json"
    return json.loads(path.read_text()).get("config") if path.exists() else None


def study_runs(out_dir: str | os.PathLike, summary: Mapping[str, Any]
               ) -> tuple[dict[str, dict[int, list[Run]]], list[str]]:
    """Every run of ``summary``'s arms that can be paired, as ``({arm: {seed: [Run, ...]}}, left_out)``.

    The study's own runs are those ``summary`` (:func:`~.records.summarize`) holds, with their machines from
    ``out_dir/runs/<arm>/seed<k>/environment.json``; after them, in the order of :data:`PAIRING_FOLDERS`, the runs
    of the same arms under ``out_dir/<folder>/<arm>/seed<k>`` that ran the same configuration as the arm's own
    runs to the same last epoch (their first epoch at the threshold by :func:`~.records.summarize`'s definition).
    ``left_out`` names the runs of those folders that do not qualify, and why. Nothing here needs a flag: adding a
    run to a folder adds it to the next rebuild."""
    from .records import METRICS_FILE, read_records, run_paths, seed_of, summarize

    out_dir = Path(out_dir)
    arms = summary["arms"]
    runs: dict[str, dict[int, list[Run]]] = {}
    configs: dict[str, Any] = {}
    for arm, a in arms.items():
        for key, first in a["first_epoch_reaching"]["per_seed"].items():
            run_dir = out_dir / "runs" / arm / f"seed{key}"
            calls = _calls(run_dir)
            configs.setdefault(arm, _run_config(run_dir))
            runs.setdefault(arm, {})[int(key)] = [Run("runs", arm, int(key), first, run_machine(calls),
                                                      _commits(calls))]
    left_out = []
    for folder in PAIRING_FOLDERS[1:]:
        for path in run_paths(out_dir, METRICS_FILE, parent=f"{folder}/*"):
            run_dir, arm = path.parent, path.parent.parent.name
            seed, name = seed_of(run_dir), f"{folder}/{arm}/{run_dir.name}"
            if arm not in arms:
                continue
            records = read_records(path)
            last = set(arms[arm]["last_epoch"].values())
            if _run_config(run_dir) != configs.get(arm) or not (run_dir / "environment.json").exists():
                left_out.append(f"{name} (not the configuration of the study's {arm} runs, or no environment.json)")
                continue
            if not records or len(last) != 1 or records[-1]["epoch"] not in last:
                left_out.append(f"{name} (last epoch {records[-1]['epoch'] if records else None}, the study's "
                                f"{arm} runs end at {', '.join(map(str, sorted(last)))})")
                continue
            first = summarize(records, metric=summary["metric"], threshold=summary["threshold"],
                              last_fraction=summary["last_fraction"])["arms"][arm]["first_epoch_reaching"]
            calls = _calls(run_dir)
            runs[arm].setdefault(seed, []).append(Run(folder, arm, seed, first["per_seed"][str(seed)],
                                                      run_machine(calls), _commits(calls)))
    return runs, left_out


def pair_by_machine(arm_runs: Sequence[Run], against_runs: Sequence[Run]) -> tuple[Run, Run] | None:
    """The first pair (in the order given: the study's own runs first) of one run of each arm trained on the same
    machine kind; ``None`` when there is none (a run of mixed machines pairs with none)."""
    return next(((a, b) for a in arm_runs for b in against_runs if a.machine is not None and a.machine == b.machine),
                None)


def _sources(runs: Mapping[str, Mapping[int, Sequence[Run]]]) -> list[dict[str, Any]]:
    """The runs grouped by folder and arm: seeds, first epochs, machines and commits."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for arm, seeds in runs.items():
        for seed in sorted(seeds):
            for r in seeds[seed]:
                groups.setdefault((r.folder, arm), []).append(r)
    order = {f: i for i, f in enumerate(PAIRING_FOLDERS)}
    return [{"folder": f, "arm": arm, "seeds": [r.seed for r in rs],
             "first_epoch": {str(r.seed): r.first_epoch for r in rs},
             "machines": list(dict.fromkeys(r.machine or "mixed" for r in rs)),
             "commits": sorted({c for r in rs for c in r.commits})}
            for (f, arm), rs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], list(runs).index(kv[0][1])))]


def mechanism_summary(summary: Mapping[str, Any], runs: Mapping[str, Mapping[int, Sequence[Run]]] | None = None,
                      *, left_out: Sequence[str] = ()) -> dict[str, Any] | None:
    """The contrasts of :data:`CONTRASTS` whose two arms are in ``summary`` (the output of
    :func:`~.records.summarize`), on the first epoch at the threshold; ``None`` when no contrast's arms ran.

    Without ``runs`` the pairs are the seeds of the summary. With ``runs`` (:func:`study_runs`) each seed's pair is
    :func:`pair_by_machine`'s (runs of one machine kind, the study's own first), a seed without one is left out
    (``unpaired_seeds``), and a contrast whose own runs cross machine kinds also carries that by-seed contrast as
    ``cross_machine``, for comparison only (outside the Holm family, no verdict)."""
    from .stats import paired_from_mapping, with_holm

    arms = summary["arms"]
    present = [c for c in CONTRASTS if c.arm in arms and c.against in arms]
    if not present:
        return None
    first = {a: {int(k): v for k, v in arms[a]["first_epoch_reaching"]["per_seed"].items()} for a in arms}
    pairings: dict[Contrast, dict[str, Any]] = {}
    stats = {}
    for c in present:
        name = f"{c.arm} - {c.against}"
        if runs is None:
            stats[name] = paired_from_mapping(first[c.arm], first[c.against]).to_dict()
            continue
        seeds = sorted(set(runs[c.arm]) | set(runs[c.against]))
        chosen = {s: pair_by_machine(runs[c.arm].get(s, ()), runs[c.against].get(s, ())) for s in seeds}
        pairs = {s: p for s, p in chosen.items() if p is not None}
        stats[name] = paired_from_mapping({s: a.first_epoch for s, (a, _) in pairs.items()},
                                          {s: b.first_epoch for s, (_, b) in pairs.items()}).to_dict()
        own = {s: (runs[c.arm][s][0], runs[c.against][s][0]) for s in seeds
               if s in runs[c.arm] and s in runs[c.against]}
        pairing: dict[str, Any] = {
            "pairs": {str(s): [a.path, b.path] for s, (a, b) in pairs.items()},
            "machines": list(dict.fromkeys(a.machine for a, _ in pairs.values())),
            "commits": sorted({x for a, b in pairs.values() for x in (*a.commits, *b.commits)}),
            "unpaired_seeds": [s for s in seeds if s not in pairs]}
        if any(a.machine != b.machine or a.machine is None for a, b in own.values()):
            cross = paired_from_mapping({s: a.first_epoch for s, (a, _) in own.items()},
                                        {s: b.first_epoch for s, (_, b) in own.items()}).to_dict()
            pairing["cross_machine"] = {**cross, "machines": list(dict.fromkeys(
                f"{a.machine or 'mixed'} × {b.machine or 'mixed'}" for a, b in own.values()))}
        pairings[c] = pairing
    comparisons = with_holm(stats)
    out: dict[str, Any] = {"threshold": summary["threshold"], "metric": summary["metric"]}
    if runs is not None:
        out["paired_by"] = "machine"
    out["contrasts"] = [{"question": c.question, "arm": c.arm, "against": c.against, "differs": c.differs,
                         **comparisons[f"{c.arm} - {c.against}"],
                         "verdict": verdict(comparisons[f"{c.arm} - {c.against}"]), **pairings.get(c, {})}
                        for c in present]
    if runs is not None:
        out["runs"] = _sources(runs)
        out["left_out"] = list(left_out)
    return out


# ---------------------------------------------------------------------------------------------- W_Q over training
#: The quantities of :func:`w_q_over_training`: key -> (record value, label, format in the report).
W_Q_QUANTITIES = {"norm": (w_q_norm, "‖W_Q‖_F", ".3g"),
                  "move": (lambda r: r.get("move_total/q"), "‖W_Q − W_Q0‖_F", ".3g"),
                  "angle": (lambda r: r.get("angle_max_deg/q"), "largest principal angle to the start (°)", ".1f")}


def w_q_over_training(records: Sequence[Mapping[str, Any]], *, epochs: Sequence[int] = (0, 1000, 2000),
                      decay: tuple[float, float] | None = None, decay_arm: str = "adamw") -> dict[str, Any] | None:
    r"""‖W_Q‖_F (shrinkage), ‖W_Q − W_Q0‖_F (movement) and the largest principal angle of W_Q to its start
    (rotation, scale-free) per arm at ``epochs`` and at the last evaluated epoch: median, min and max over seeds
    (:func:`~.stats.describe`), at each seed's last evaluation at or before the epoch. ``decay = (lr, weight
    decay)`` adds what decoupled weight decay alone would leave of the median start of ``decay_arm``,
    :math:`\|W_{Q,0}\|_F\,(1 - \mathrm{lr}\,\lambda)^{t}` at step :math:`t`. ``None`` when no record holds W_Q."""
    from .records import group_runs
    from .stats import describe

    runs = group_runs(records)
    if not any(w_q_norm(r) is not None for seeds in runs.values() for recs in seeds.values() for r in recs):
        return None
    end = max(recs[-1]["epoch"] for seeds in runs.values() for recs in seeds.values())
    at = sorted({e for e in epochs if e < end} | {end})

    def value_at(recs, epoch, get):
        before = [r for r in recs if r["epoch"] <= epoch]
        return get(before[-1]) if before else None

    table = {arm: {key: [describe([value_at(recs, e, get) for recs in seeds.values()]) for e in at]
                   for key, (get, *_) in W_Q_QUANTITIES.items()} for arm, seeds in runs.items()}
    out: dict[str, Any] = {"epochs": at, "arms": table}
    if decay is not None and decay_arm in runs and table[decay_arm]["norm"][0] is not None and at[0] == 0:
        lr, wd = decay
        start = table[decay_arm]["norm"][0]["median"]
        steps = {e: value_at(next(iter(runs[decay_arm].values())), e, lambda r: r.get("step", r["epoch"])) for e in at}
        out["decay_alone"] = {"arm": decay_arm, "lr": lr, "weight_decay": wd,
                              "values": [start * (1.0 - lr * wd) ** steps[e] for e in at]}
    return out


# ---------------------------------------------------------------------------------------------- report
def _epochs(x: float | None, sign: bool = True) -> str:
    return "–" if x is None else (f"{x:+,.0f}" if sign else f"{x:,.0f}")


def seeds_text(seeds: Sequence[int]) -> str:
    """Seeds as runs of consecutive numbers: ``[0, 1, 2, 3, 5]`` -> ``"0–3, 5"``."""
    out, seeds = [], sorted(seeds)
    i = 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        out.append(str(seeds[i]) if i == j else f"{seeds[i]}–{seeds[j]}" if j > i + 1 else f"{seeds[i]}, {seeds[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"


def _side(pairs: Mapping[str, Sequence[str]], index: int) -> str:
    """The runs on one side of a contrast's pairs, by folder: ``runs/adamw`` seeds 0–4."""
    folders: dict[str, list[int]] = {}
    for seed, paths in pairs.items():
        folders.setdefault(paths[index].rsplit("/", 1)[0], []).append(int(seed))
    return "; ".join(f"`{f}/` seeds {seeds_text(s)}" for f, s in folders.items()) or "–"


def _p(x: float | None) -> str:
    return "–" if x is None else f"{x:.2g}"


def _contrast_line(c: Mapping[str, Any], holm: bool = True) -> str:
    ci = "" if c["ci_low"] is None else f", 95% CI [{_epochs(c['ci_low'])}, {_epochs(c['ci_high'])}]"
    p = (f", Holm p {_p(c.get('p_holm'))}" if holm and c.get("p_holm") is not None
         else f", p {_p(c.get('p_value'))}" if not holm and c.get("p_value") is not None else "")
    return f"{_epochs(c['mean'])} epochs over {c['n']} pair(s){ci}, {c['n_negative']}/{c['n']} earlier{p}"


def _w_q_lines(w: Mapping[str, Any] | None, figure: str | None) -> list[str]:
    if not w:
        return []
    def cell(d, fmt):
        if d is None:
            return "–"
        lo, mid, hi = (format(d[k], fmt) for k in ("min", "median", "max"))
        return mid if lo == hi else f"{mid} [{lo}, {hi}]"

    lines = ["### W_Q over training: shrinkage, movement, rotation", "",
             "Per arm, the median [min, max] over seeds of ‖W_Q‖_F (what weight decay shrinks), ‖W_Q − W_Q0‖_F "
             "(movement: shrinkage and rotation together) and the largest principal angle of W_Q to its start "
             "(rotation alone, scale-free), at each seed's evaluation at the epoch.", "",
             "| arm | quantity | " + " | ".join(f"epoch {e:,}" for e in w["epochs"]) + " |",
             "|---|---|" + "---|" * len(w["epochs"])]
    for arm, q in w["arms"].items():
        for key, (_, label, fmt) in W_Q_QUANTITIES.items():
            lines.append(f"| {arm} | {label} | " + " | ".join(cell(d, fmt) for d in q[key]) + " |")
    if "decay_alone" in w:
        d = w["decay_alone"]
        lines.append(f"| decay alone | ‖W_Q0‖_F (1 − lr·λ)^step, lr {d['lr']:g}, λ {d['weight_decay']:g}, from "
                     f"{d['arm']}'s median start | " + " | ".join(f"{v:.3g}" for v in d["values"]) + " |")
    lines.append("")
    if figure:
        caption = "‖W_Q‖_F and ‖W_Q − W_Q0‖_F per arm over training (median over seeds, band: min–max)"
        lines += [f"**{caption}**", "", f"![{caption}]({figure})", ""]
    return lines


def mechanism_lines(mechanism: Mapping[str, Any] | None) -> list[str]:
    """The report's section: one sentence per contrast, generated from :func:`mechanism_summary`; with machine
    pairing, which runs each contrast pairs and the cross-machine contrasts for comparison; and the W_Q table and
    figure when the summary carries them (:func:`refine_study_outputs`)."""
    if not mechanism:
        return []
    thr = f"{mechanism['threshold']:.0%}"
    rule = "; ".join(f"**{word}**: {why}" for word, why in VERDICTS)
    by_machine = mechanism.get("paired_by") == "machine"
    pairs_are = ("on the seeds where both reached it and whose two runs were trained on one machine kind (below)"
                 if by_machine else "on the seeds where both reached it")
    lines = ["## Start, constraint or step?", "",
             f"Each question is one paired contrast of the first epoch with `{mechanism['metric']}` ≥ {thr} "
             f"(arm − against, seed by seed, {pairs_are}; negative: the arm groks earlier), "
             f"with Holm's adjustment over the contrasts listed. Verdicts by one rule: {rule}.", ""]
    for c in mechanism["contrasts"]:
        later = "earlier" if (c["mean"] or 0) < 0 else "later"
        lines.append(f"- **{c['question']}** (`{c['arm']}` − `{c['against']}`: {c['differs']}): {_contrast_line(c)}: "
                     f"{c['verdict']}" + ("" if c["verdict"] in ("not seen", "too few pairs") else f" ({later})") + ".")
    lines.append("")
    if by_machine:
        lines += ["Runs of one machine kind only are paired: float32 trajectories part between CPU kinds (their "
                  "matrix kernels round differently and the collapse cycles amplify it), so a pair across kinds "
                  "would add that difference to the arm's. Each seed pairs the study's own runs (`runs/`) when they "
                  "share a machine kind, else runs of the arm retrained on the other arm's commit and machine kind "
                  f"({', '.join(f'`{f}/`' for f in PAIRING_FOLDERS[1:])}); a seed without such a pair is left out "
                  "until one is trained (rebuilding the report picks it up).", "",
                  "| contrast | pairs | arm's runs | against's runs | machine | commits | seeds without a pair |",
                  "|---|---|---|---|---|---|---|"]
        for c in mechanism["contrasts"]:
            lines.append(f"| {c['question']} | {len(c['pairs'])} | {_side(c['pairs'], 0)} | {_side(c['pairs'], 1)} "
                         f"| {', '.join(c['machines']) or '–'} | {', '.join(c['commits']) or '–'} "
                         f"| {seeds_text(c['unpaired_seeds']) if c['unpaired_seeds'] else '–'} |")
        lines.append("")
        crossed = [c for c in mechanism["contrasts"] if "cross_machine" in c]
        if crossed:
            lines += ["**For comparison only, across machine kinds** (not in the Holm family, no verdict): the same "
                      "contrasts on the study's own runs (`runs/` × `runs/`), paired by seed whatever machine "
                      "trained them:", ""]
            for c in crossed:
                x = c["cross_machine"]
                lines.append(f"- {c['question']} (`{c['arm']}` − `{c['against']}`, {'; '.join(x['machines'])}): "
                             f"{_contrast_line(x, holm=False)}.")
            lines.append("")
        if mechanism.get("left_out"):
            lines += ["Runs in those folders not used: " + "; ".join(mechanism["left_out"]) + ".", ""]
    return lines + _w_q_lines(mechanism.get("w_q"), mechanism.get("w_q_figure"))


#: The heading of the report's generic table of paired comparisons (:func:`~.report.render_report`).
PAIRED_HEADING = "## Paired comparisons across seeds (same seed: same split and initial weights)\n\n"


def cross_machine_note(runs: Mapping[str, Mapping[int, Sequence[Run]]]) -> str | None:
    """The sentence that goes under the generic paired-comparisons table when the study's own runs (``runs/``) of
    different arms were trained on different machine kinds: those rows pair across kinds, for comparison only.
    ``None`` when every arm's own runs share one machine kind."""
    own = {arm: list(dict.fromkeys((rs[0].machine or "mixed") for rs in seeds.values() if rs and rs[0].folder == "runs"))
           for arm, seeds in runs.items()}
    kinds = list(dict.fromkeys(k for ks in own.values() for k in ks))
    if len(kinds) < 2:
        return None
    where = "; ".join(f"{', '.join(f'`{a}`' for a, ks in own.items() if ks == [k])} on {k}" for k in kinds
                      if any(ks == [k] for ks in own.values()))
    mixed = [f"`{a}`" for a, ks in own.items() if len(ks) > 1]
    if mixed:
        where += f"; {', '.join(mixed)} on several"
    return (f"The study's own runs were trained on {len(kinds)} machine kinds ({where}): a row that pairs arms of "
            f"different kinds compares across them and is for comparison only (float32 trajectories part between "
            f"CPU kinds); the contrasts below pair runs of one kind.\n\n")


#: The figure :func:`refine_study_outputs` draws into the study folder.
W_Q_FIGURE = "w_q_norm_movement.png"


def refine_study_outputs(outputs: Any, out_dir: str | os.PathLike, *, decay: tuple[float, float] | None = None):
    """Rewrite a finished study's contrasts (``outputs``: the :class:`~.study.StudyOutputs` of
    :func:`~.study.finalize_study`) with runs of one machine kind per pair (:func:`study_runs`,
    :func:`mechanism_summary`), add the W_Q table (:func:`w_q_over_training`, ``decay``: the model's lr and weight
    decay) and its figure, and write ``summary.json`` and the report's "Start, constraint or step?" section again.
    A study without contrasts is left as it is. Returns ``outputs`` (its summary updated)."""
    from .plotting import plot_w_q_norm_movement
    from .records import load_study_records

    full = outputs.summary
    if not full or "mechanism" not in full["summary"]:
        return outputs
    out_dir = Path(out_dir)
    summary = full["summary"]
    old = mechanism_lines(summary["mechanism"])
    runs, left_out = study_runs(out_dir, summary)
    mechanism = mechanism_summary(summary, runs, left_out=left_out)
    kept = {a: set(v["seeds"]) for a, v in summary["arms"].items()}
    records = [r for r in load_study_records(out_dir) if int(r["seed"]) in kept.get(r["arm"], ())]
    w_q = w_q_over_training(records, decay=decay)
    if w_q is not None:
        mechanism["w_q"] = w_q
        figure = plot_w_q_norm_movement(records, out_dir / W_Q_FIGURE, decay=decay)
        if figure is not None:
            mechanism["w_q_figure"] = figure.name
    summary["mechanism"] = mechanism
    outputs.summary_path.write_text(json.dumps(full, indent=2) + "\n")
    report = outputs.report_path.read_text()
    old_text, new_text = "\n".join(old), "\n".join(mechanism_lines(mechanism))
    if report.count(old_text) != 1:
        raise RuntimeError(f"{outputs.report_path}: the section 'Start, constraint or step?' was not found once; "
                           f"the report was not rewritten.")
    report = report.replace(old_text, new_text)
    note = cross_machine_note(runs)
    if note is not None and note not in report:
        if report.count(PAIRED_HEADING) != 1:
            raise RuntimeError(f"{outputs.report_path}: the paired-comparisons heading was not found once; the "
                               f"report was not rewritten.")
        report = report.replace(PAIRED_HEADING, PAIRED_HEADING + note)
    outputs.report_path.write_text(report)
    return outputs
