r"""Records of a study: JSON-lines files, and the per-arm summary the reports are made from.

Each run writes ``metrics.jsonl``: one JSON object per evaluation with at least ``experiment``, ``arm``,
``seed``, ``epoch``, ``step`` and ``<set>_loss``/``<set>_acc`` for every evaluation set, plus whatever
the metric hooks add (``move_total/q``, ``norm/<name>``, ``angle_max_deg/q``, ...).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "InconsistentRecordsError", "SEED_DIR", "seed_of", "run_paths", "append_record",
           "read_records", "truncate_records", "load_study_records",
           "summarize", "summarize_cell", "mean_std", "group_runs", "tail_records", "tail_description",
           "dip_count", "DIP_DEFINITION", "W_Q_SUFFIXES", "w_q_norm"]

METRICS_FILE = "metrics.jsonl"
#: The name of a run's folder: ``seed`` and the seed's digits, nothing else (``seed0-old`` or ``seed0.bak`` is not
#: a run of seed 0, and no reader may take it for one).
SEED_DIR = re.compile(r"seed([0-9]+)")


class InconsistentRecordsError(ValueError):
    """The records on disk contradict each other (two records of one run at the same epoch, runs of one cell at
    different learning rates, ...): no report is made from them; the message names what to fix. The command line
    prints it as one line (exit status 2)."""


def seed_of(run_dir: str | os.PathLike) -> int | None:
    """The seed of a run folder named ``seed<digits>`` exactly (:data:`SEED_DIR`); ``None`` for any other name."""
    match = SEED_DIR.fullmatch(Path(run_dir).name)
    return None if match is None else int(match.group(1))


def run_paths(base: str | os.PathLike, filename: str, parent: str = "runs/*") -> list[Path]:
    """The files ``base/<parent>/seed<k>/<filename>`` (``parent`` a glob pattern, by default ``runs/*``: every
    arm), sorted, of run folders named ``seed<digits>`` exactly (:func:`seed_of`): a copy such as ``seed0-old`` or
    ``seed0.bak`` is not read. The one glob of run folders that every reader of records uses."""
    return sorted(p for p in Path(base).glob(f"{parent}/seed*/{filename}") if seed_of(p.parent) is not None)


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one record as a JSON line (and flush it to the OS)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=False) + "\n")
        f.flush()


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of one ``metrics.jsonl`` (an empty list when the file does not exist). A last line cut
    short by a crash is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON; the file is corrupt.") from None
    return out


def truncate_records(path: str | os.PathLike, n: int) -> None:
    """Keep the first ``n`` records of ``path`` (used on resume: later ones are written again)."""
    path = Path(path)
    records = read_records(path)
    if len(records) < n:
        raise ValueError(f"{path} has {len(records)} records, but its checkpoint counts {n}; the run folder is "
                         f"inconsistent. Delete the folder to start the run afresh.")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records[:n]))
    os.replace(tmp, path)


def load_study_records(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of every run under ``out_dir/runs/<arm>/seed<k>/metrics.jsonl`` (:func:`run_paths`: folders
    named ``seed<digits>`` only)."""
    out: list[dict[str, Any]] = []
    for path in run_paths(out_dir, METRICS_FILE):
        out.extend(read_records(path))
    return out


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (``ddof=1``; ``None`` for fewer than two values)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def group_runs(records: Iterable[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Group evaluation records as ``{arm: {seed: [records sorted by epoch]}}``.

    Raises
    ------
    InconsistentRecordsError
        Two records of the same arm and seed at the same epoch (e.g. a copy of a run folder read beside it, or the
        records of two cells passed together): they are not merged; the message names the arm, seed and epoch.
    """
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in records:
        runs.setdefault(r["arm"], {}).setdefault(int(r["seed"]), []).append(r)
    for arm, seeds in runs.items():
        for seed, recs in seeds.items():
            recs.sort(key=lambda r: r["epoch"])
            twice = sorted({a["epoch"] for a, b in zip(recs, recs[1:], strict=False) if a["epoch"] == b["epoch"]})
            if twice:
                raise InconsistentRecordsError(
                    f"records: arm {arm} seed {seed} has more than one record at epoch "
                    f"{', '.join(map(str, twice))}; two runs' records were read as one (a copy of a run folder, or "
                    f"two cells' records together). Move the copy out of the study folder.")
    return runs


def tail_records(recs: Sequence[dict[str, Any]], last_fraction: float) -> list[dict[str, Any]]:
    r"""The evaluations of one run that form its tail: every record with epoch :math:`e \ge (1 - f)\,E`, where
    :math:`E` is the run's last evaluated epoch and :math:`f` = ``last_fraction`` (both ends included). At
    :math:`E` = 20,000, :math:`f` = 0.1 and an evaluation every 100 epochs that is epochs 18,000 to 20,000:
    21 evaluations. ``recs`` sorted by epoch (:func:`group_runs`). The one definition of "the last ``f`` of
    training" that summaries, reports and READMEs use (:func:`tail_description` words it)."""
    if not recs:
        return []
    end = recs[-1]["epoch"]
    return [r for r in recs if r["epoch"] >= (1.0 - last_fraction) * end]


def tail_description(summary: dict[str, Any]) -> str:
    """The tail window of a :func:`summarize` result in words, from its records (``tail_window``), e.g. "the last
    10% of training: the evaluations at epochs 18,000–20,000 (21 per run)"; different windows across runs are
    listed."""
    windows = sorted({(w["first"], w["last"], w["n"]) for a in summary["arms"].values()
                      for w in a.get("tail_window", {}).values()})
    pct = f"{100 * summary['last_fraction']:.0f}%"
    if not windows:
        return f"the last {pct} of training"
    text = "; ".join(f"epochs {first:,}–{last:,} ({n} per run)" for first, last, n in windows)
    return f"the last {pct} of training: the evaluations at {text}"


#: What :func:`dip_count` counts, in the words reports and READMEs quote.
DIP_DEFINITION = ("a dip is a maximal run of consecutive evaluations below the threshold after the first evaluation "
                  "at or above it (a run still below at the end counts)")


def dip_count(values: Sequence[float], threshold: float) -> tuple[int, int]:
    """``(dips, evaluations below)`` of a metric's values after the first one at or above ``threshold``
    (:data:`DIP_DEFINITION`): e.g. ``[0.5, 0.96, 0.9, 0.8, 0.97, 0.9]`` at 0.95 has 2 dips over 3 evaluations."""
    first = next((i for i, v in enumerate(values) if v >= threshold), None)
    if first is None:
        return 0, 0
    dips = below = 0
    previous_below = False
    for v in values[first + 1:]:
        is_below = v < threshold
        below += is_below
        dips += is_below and not previous_below
        previous_below = is_below
    return dips, below


def _stat(per_seed: dict[int, float | None]) -> dict[str, Any]:
    mean, std = mean_std([v for v in per_seed.values() if v is not None])
    return {"mean": mean, "std": std, "per_seed": {str(k): v for k, v in sorted(per_seed.items())}}


def summarize(records: Iterable[dict[str, Any]], *, metric: str = "val_acc", threshold: float = 0.95,
              last_fraction: float = 0.1, final_keys: Sequence[str] = ("train_acc", "val_loss", "move_total/q",
              "move_total/k", "move_total_rel/q", "angle_max_deg/q", "angle_max_deg/k", "norm/euclidean"),
              mean_keys: Sequence[str] = ("move_step/q", "move_step/k")) -> dict[str, Any]:
    r"""Per-arm summary of a study's records.

    For each arm and seed, with :math:`E` the seed's last evaluated epoch:

    - ``final``: ``metric`` at epoch :math:`E` (mean, sample std, every seed);
    - ``first_epoch_reaching``: the first evaluated epoch with ``metric >= threshold`` (``None`` if never);
      its resolution is the evaluation interval;
    - ``tail_window``: the evaluations of the tail (:func:`tail_records`: epoch
      :math:`\ge (1 - \text{last\_fraction})E`, both ends included), as ``first``, ``last`` epoch and ``n``;
    - ``stays_above``: whether every evaluation of the tail has ``metric >= threshold``; ``fraction`` is the
      share of seeds for which it holds;
    - ``tail_mean`` and ``tail_share_above``: the mean of ``metric`` over those last evaluations, and the
      share of them at or above ``threshold`` (less brittle than ``stays_above``, which one dip breaks);
    - ``dips_after_reaching``: how many separate dips follow the first evaluation at ``threshold``
      (:data:`DIP_DEFINITION`, :func:`dip_count`; ``None`` if it was never reached): transient collapses such as
      loss spikes; ``evaluations_below_after_reaching``: how many evaluations those dips span;
      ``lowest_after_reaching``:
      the lowest ``metric`` after that first evaluation (the depth of the deepest dip is
      ``threshold - lowest`` when it is below ``threshold``);
    - ``final_<key>`` for each of ``final_keys`` present in the records, and ``mean_<key>`` (the mean over
      evaluations) for each of ``mean_keys``.

    ``first_epoch_reaching`` also carries the distribution over seeds (``min``, ``median``, ``max`` of the
    seeds that reached ``threshold``).

    ``paired`` compares the arms seed by seed (:func:`~.stats.compare_arms`: every other arm against the
    first one listed, and ``stiefel`` against every other arm) on the final ``metric``; ``paired_tail_mean``
    and ``paired_first_epoch`` do the same for the tail mean and for the first epoch reaching ``threshold``
    (on the seeds where both arms reached it). Each comparison carries its p-values adjusted by Holm's method
    over the comparisons of its table (:func:`~.stats.with_holm`: ``p_holm``, ``sign_test_p_holm``).
    """
    from .stats import compare_arms, describe, with_holm

    runs = group_runs(records)
    arms: dict[str, Any] = {}
    per_seed_of: dict[str, dict[str, dict[int, Any]]] = {}
    for arm, seeds in runs.items():
        final, first, stays, last_epoch = {}, {}, {}, {}
        tail_mean, tail_share, dips, below, lowest, window = {}, {}, {}, {}, {}, {}
        extra_final: dict[str, dict[int, Any]] = {k: {} for k in final_keys}
        extra_mean: dict[str, dict[int, Any]] = {k: {} for k in mean_keys}
        for seed, recs in seeds.items():
            end = recs[-1]["epoch"]
            last_epoch[seed] = end
            final[seed] = recs[-1].get(metric)
            first[seed] = next((r["epoch"] for r in recs if (r.get(metric) or 0.0) >= threshold), None)
            tail = tail_records(recs, last_fraction)
            window[seed] = {"first": tail[0]["epoch"], "last": tail[-1]["epoch"], "n": len(tail)}
            stays[seed] = bool(tail) and all((r.get(metric) or 0.0) >= threshold for r in tail)
            tail_vals = [r.get(metric) or 0.0 for r in tail]
            tail_mean[seed] = sum(tail_vals) / len(tail_vals) if tail_vals else None
            tail_share[seed] = sum(v >= threshold for v in tail_vals) / len(tail_vals) if tail_vals else None
            after = [r.get(metric) or 0.0 for r in recs if first[seed] is not None and r["epoch"] > first[seed]]
            counts = dip_count([r.get(metric) or 0.0 for r in recs], threshold)
            dips[seed], below[seed] = (None, None) if first[seed] is None else counts
            lowest[seed] = min(after) if after else None
            for k in final_keys:
                if k in recs[-1]:
                    extra_final[k][seed] = recs[-1][k]
            for k in mean_keys:
                vals = [r[k] for r in recs if r.get(k) is not None]
                if vals:
                    extra_mean[k][seed] = sum(vals) / len(vals)
        reached = [v for v in first.values() if v is not None]
        entry: dict[str, Any] = {
            "seeds": sorted(seeds),
            "last_epoch": {str(k): v for k, v in sorted(last_epoch.items())},
            "final": _stat(final),
            "first_epoch_reaching": {**_stat(first), "n_reached": len(reached), "n": len(first),
                                     "distribution": describe(reached)},
            "stays_above": {"per_seed": {str(k): v for k, v in sorted(stays.items())},
                            "fraction": sum(stays.values()) / len(stays)},
            "tail_window": {str(k): v for k, v in sorted(window.items())},
            "tail_mean": _stat(tail_mean),
            "tail_share_above": _stat(tail_share),
            "dips_after_reaching": _stat(dips),
            "evaluations_below_after_reaching": _stat(below),
            "lowest_after_reaching": _stat(lowest),
        }
        for k, per in extra_final.items():
            if per:
                entry[f"final_{k}"] = _stat(per)
        for k, per in extra_mean.items():
            if per:
                entry[f"mean_{k}"] = _stat(per)
        arms[arm] = entry
        per_seed_of[arm] = {"final": final, "tail_mean": tail_mean, "first": first}
    order = list(runs)

    def paired(key: str) -> dict[str, Any]:
        return with_holm(compare_arms({a: per_seed_of[a][key] for a in order}, order))

    return {"metric": metric, "threshold": threshold, "last_fraction": last_fraction, "arms": arms,
            "paired": paired("final"), "paired_tail_mean": paired("tail_mean"),
            "paired_first_epoch": paired("first")}


def summarize_cell(records: Iterable[dict[str, Any]], arms: Sequence[str], *, metric: str,
                   final_keys: Sequence[str] = (), all_keys: Sequence[str] = ()) -> dict[str, Any]:
    """Per-arm summary of one cell of a sweep study, and its paired comparisons.

    For each arm of ``arms`` found in the records: ``seeds``, ``last_epoch`` (the distinct last evaluated
    epochs), ``final_<metric>`` (:func:`~.stats.describe` of the last evaluation's ``metric`` over seeds, with
    ``per_seed``), ``final_<key>`` for each of ``final_keys`` and ``all_<key>`` (over every evaluation of every
    seed) for each of ``all_keys``. ``comparisons`` holds :func:`~.stats.compare_arms` of the final ``metric``
    (every arm against the first, and ``stiefel`` against every other arm).
    """
    from .stats import compare_arms, describe

    runs = group_runs(records)
    arms = [a for a in arms if a in runs]
    per_arm: dict[str, Any] = {}
    final: dict[str, dict[int, Any]] = {}
    for arm in arms:
        seeds = runs[arm]
        final[arm] = {s: recs[-1].get(metric) for s, recs in seeds.items()}
        last = {s: recs[-1] for s, recs in seeds.items()}
        entry: dict[str, Any] = {"seeds": sorted(seeds), "last_epoch": sorted({r["epoch"] for r in last.values()}),
                                 f"final_{metric}": {**(describe(final[arm].values()) or {}),
                                                     "per_seed": {str(s): v for s, v in sorted(final[arm].items())}}}
        for key in final_keys:
            vals = [r.get(key) for r in last.values()]
            if any(v is not None for v in vals):
                entry[f"final_{key}"] = describe(vals)
        for key in all_keys:
            vals = [r[key] for recs in seeds.values() for r in recs if r.get(key) is not None]
            if vals:
                entry[f"all_{key}"] = describe(vals)
        per_arm[arm] = entry
    return {"metric": metric, "arms": per_arm, "comparisons": compare_arms(final, arms)}


#: Suffixes of the recorded norms (``norm/<name>``) that belong to W_Q: the library's modules, converted frames.
W_Q_SUFFIXES = (".w_q", "q_frames")


def w_q_norm(record: Mapping[str, Any]) -> float | None:
    r""":math:`\|W_Q\|_F` of one record: :math:`(\sum \|W\|_F^2)^{1/2}` over the recorded W_Q matrices of every
    layer (the same matrices as ``move_total/q``); ``None`` when the record lists none."""
    values = [v for k, v in record.items() if k.startswith("norm/") and k.endswith(W_Q_SUFFIXES) and v is not None]
    return math.sqrt(sum(v * v for v in values)) if values else None
