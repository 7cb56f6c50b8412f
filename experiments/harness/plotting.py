"""Seaborn figures of a study's records, saved as PNG (no pyplot state, no windows); one module for every study.

Every function takes the records (a list of dicts as written to ``metrics.jsonl``), or the paired comparisons
made from them, and a path, draws on a fresh :class:`matplotlib.figure.Figure`, saves it, and returns the path
(``None`` when the records hold nothing to draw). Curves over training are the mean over seeds with a band of
one standard deviation (seaborn ``errorbar="sd"``); with a single seed there is no band, and a series with a
single evaluation (a one-epoch run) is drawn as markers. The paired figures (:func:`plot_pairs`,
:func:`plot_gap_sweep`, :func:`plot_ablation`) show the final value per seed and per arm.
pandas, seaborn and matplotlib are imported inside the functions.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .records import group_runs, w_q_norm

__all__ = ["records_frame", "plot_curves", "plot_accuracy", "plot_reached_fraction", "plot_weight_norms", "plot_principal_angles",
           "plot_movement", "plot_w_q_norm_movement", "plot_overview", "plot_per_seed", "plot_study", "plot_pairs",
           "plot_movement_ratio",
           "plot_distance", "plot_gap_sweep", "plot_ablation", "plot_per_head"]

_DPI = 120


def records_frame(records: Sequence[dict[str, Any]]):
    """The records as a :class:`pandas.DataFrame` (one row per evaluation)."""
    import pandas as pd

    if not records:
        raise ValueError("plotting: no records to plot; run the study first (its runs/*/seed*/metrics.jsonl).")
    return pd.DataFrame.from_records(list(records))


def _long(df, keys: Sequence[str]):
    present = [k for k in keys if k in df.columns]
    if not present:
        return None
    long = df.melt(id_vars=["arm", "seed", "epoch"], value_vars=present, var_name="quantity", value_name="value")
    return long.dropna(subset=["value"])


def _figure(nrows: int = 1, ncols: int = 1, *, width: float = 7.0, height: float = 3.6, sharex: bool = True):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=sharex, squeeze=False)
    return fig, axes


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    return path


def _row(width: float = 7.0, height: float = 4.0, ncols: int = 1):
    """A figure with one row of ``ncols`` independent axes."""
    fig, axes = _figure(1, ncols, width=width, height=height, sharex=False)
    return fig, list(axes[0])


def _markers(df) -> dict[str, Any]:
    """``marker="o"`` when every series has a single evaluation (a line through one point draws nothing)."""
    return {"marker": "o"} if df["epoch"].nunique() <= 1 else {}


def _accuracy_axis(ax) -> None:
    """Limit an accuracy axis to [0, 1] (with a margin): a ±1 sd band must not suggest accuracies outside it."""
    ax.set_ylim(-0.02, 1.02)


def _point(xs: Sequence[Any]) -> str | None:
    return "o" if len(xs) == 1 else None


def _lines(ax, long, *, hue: str = "arm", style: str | None = "quantity", title: str = "", ylabel: str = "",
           logy: bool = False, estimator: str = "mean", errorbar: Any = "sd") -> None:
    """One line per ``hue`` (and ``style``) over epochs: ``estimator`` over seeds with an ``errorbar`` band (by
    default the mean and ±1 sd; ``"median"`` with ``("pi", 100)``: the median and the min–max band)."""
    import seaborn as sns

    multi_style = style is not None and long[style].nunique() > 1
    sns.lineplot(data=long, x="epoch", y="value", hue=hue, style=style if multi_style else None,
                 estimator=estimator, errorbar=errorbar, ax=ax, linewidth=1.2, **_markers(long))
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def plot_curves(records: Sequence[dict[str, Any]], path: str | os.PathLike, keys: Sequence[str], *,
                title: str = "", ylabel: str = "", logy: bool = False) -> Path | None:
    """Any record keys over training, one colour per arm, one line style per key (``None`` if absent)."""
    long = _long(records_frame(records), keys)
    if long is None or long.empty:
        return None
    fig, axes = _figure()
    _lines(axes[0, 0], long, title=title, ylabel=ylabel, logy=logy)
    return _save(fig, path)


def plot_accuracy(records: Sequence[dict[str, Any]], path: str | os.PathLike, *,
                  sets: Sequence[str] = ("train", "val"), threshold: float | None = 0.95) -> Path:
    """Accuracy of each evaluation set over training, per arm (mean and one-std band over seeds)."""
    df = records_frame(records)
    long = _long(df, [f"{s}_acc" for s in sets])
    if long is None:
        raise ValueError(f"plot_accuracy: the records have none of {[f'{s}_acc' for s in sets]}.")
    fig, axes = _figure(height=4.0)
    ax = axes[0, 0]
    _lines(ax, long, title=f"accuracy over training ({df['seed'].nunique()} seed(s) per arm; band: ±1 sd)",
           ylabel="accuracy")
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
    _accuracy_axis(ax)
    return _save(fig, path)


def plot_reached_fraction(records: Sequence[dict[str, Any]], path: str | os.PathLike, *, metric: str = "val_acc",
                          threshold: float = 0.95) -> Path | None:
    """The fraction of seeds whose ``metric`` has reached ``threshold`` (first evaluation at or above it) by each
    epoch, one step curve per arm: when each arm groks, seed by seed. ``None`` (no figure) when no run reached it."""
    runs = group_runs(records)
    firsts = {arm: [next((r["epoch"] for r in recs if (r.get(metric) or 0.0) >= threshold), None)
                    for recs in seeds.values()] for arm, seeds in runs.items()}
    if not any(e is not None for es in firsts.values() for e in es):
        return None
    end = max(recs[-1]["epoch"] for seeds in runs.values() for recs in seeds.values())
    fig, (ax,) = _row(width=7.0, height=4.0)
    for arm, es in firsts.items():
        xs = sorted(e for e in es if e is not None)
        steps = [0, *xs, end]
        fractions = [0.0, *[(i + 1) / len(es) for i in range(len(xs))], len(xs) / len(es)]
        ax.step(steps, fractions, where="post", linewidth=1.6, label=f"{arm} ({len(xs)}/{len(es)} seeds)")
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"fraction of seeds with {metric} ≥ {threshold:g}")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"first epoch at {metric} ≥ {threshold:g}, per arm", fontsize=10)
    return _save(fig, path)


#: Column that :func:`_with_norm_without_qk` adds.
_NO_QK = "norm/all_but_qk"
#: Suffixes of the parameter names that hold W_Q, W_K (the library's modules; converted weights' frames).
_QK_SUFFIXES = (".w_q", ".w_k", "q_frames", "k_frames")


def _with_norm_without_qk(df):
    r"""``df`` with the column ``norm/all_but_qk`` :math:`= (\sum \|W\|_F^2)^{1/2}` over every matrix recorded as
    ``norm/<name>`` except W_Q, W_K, when the records list W_Q, W_K among their matrices (else unchanged).

    The records' ``norm/euclidean`` sums the matrices that are not Stiefel frames: it includes W_Q, W_K in a
    Euclidean arm and leaves them out in a Stiefel arm, so two arms' totals would differ by bookkeeping (at the
    five-arm grokking study's start, seed 0: 29.33 against 24.63). This total is over the same matrices in every arm.
    """
    keys = [c for c in df.columns if c.startswith("norm/") and c != "norm/euclidean"]
    qk = [c for c in keys if c.endswith(_QK_SUFFIXES)]
    rest = [c for c in keys if c not in qk]
    if not qk or not rest:
        return df
    df = df.copy()
    df[_NO_QK] = (df[rest] ** 2).sum(axis=1, min_count=len(rest)) ** 0.5
    return df


def plot_weight_norms(records: Sequence[dict[str, Any]], path: str | os.PathLike, *,
                      max_matrices: int = 12) -> Path | None:
    """Frobenius norms of the weight matrices over training: one panel per arm, one line per matrix (mean
    over seeds), and in black the total over every matrix but W_Q, W_K (the same set in every arm, see
    :func:`_with_norm_without_qk`; the records' ``norm/euclidean`` when they list no single matrix). With more
    than ``max_matrices`` matrices only the total is drawn."""
    import seaborn as sns

    df = _with_norm_without_qk(records_frame(records))
    keys = [c for c in df.columns if c.startswith("norm/") and c not in ("norm/euclidean", _NO_QK)]
    total_key, total_label = (_NO_QK, "all matrices but W_Q, W_K") if _NO_QK in df.columns else \
        ("norm/euclidean", "all non-frame matrices")
    if not keys and total_key not in df.columns:
        return None
    arms = list(dict.fromkeys(df["arm"]))
    fig, axes = _figure(1, len(arms), width=5.5, height=4.0, sharex=True)
    for ax, arm in zip(axes[0], arms, strict=True):
        sub = df[df["arm"] == arm]
        if len(keys) <= max_matrices:
            long = _long(sub, keys)
            if long is not None and not long.empty:
                long["quantity"] = long["quantity"].str.removeprefix("norm/")
                sns.lineplot(data=long, x="epoch", y="value", hue="quantity", errorbar=None, ax=ax, linewidth=1.0,
                             **_markers(long))
        if total_key in sub.columns:
            total = sub.groupby("epoch")[total_key].mean()
            ax.plot(total.index, total.values, color="black", linewidth=1.8, label=total_label,
                    marker=_point(total.index))
        ax.set_title(f"{arm}: ||W||_F (mean over seeds)")
        ax.set_ylabel("Frobenius norm")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    return _save(fig, path)


def plot_principal_angles(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Largest and mean principal angle (degrees) between the current and the initial column spaces of
    W_Q and W_K over training, per arm."""
    keys = ["angle_max_deg/q", "angle_max_deg/k", "angle_mean_deg/q", "angle_mean_deg/k"]
    long = _long(records_frame(records), keys)
    if long is None or long.empty:
        return None
    fig, axes = _figure(1, 2, width=6.0, height=4.0)
    for ax, stat in zip(axes[0], ("max", "mean"), strict=True):
        sub = long[long["quantity"].str.startswith(f"angle_{stat}_deg")].copy()
        sub["quantity"] = sub["quantity"].map(lambda s: "W_Q" if s.endswith("/q") else "W_K")
        _lines(ax, sub, title=f"{stat} principal angle to the initial subspace", ylabel="degrees")
        ax.set_ylim(bottom=0)
    return _save(fig, path)


def plot_movement(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Total movement ``||W - W0||_F`` and last-step movement ``||W - W_prev||_F`` of W_Q and W_K, log scale."""
    df = records_frame(records)
    fig, axes = _figure(1, 2, width=6.0, height=4.0)
    drawn = False
    for ax, (kind, title) in zip(axes[0], (("move_total", "total movement ||W - W0||_F"),
                                           ("move_step", "last-step movement ||ΔW||_F")), strict=True):
        long = _long(df, [f"{kind}/q", f"{kind}/k"])
        if long is None or long.empty:
            continue
        long = long[long["value"] > 0]
        long["quantity"] = long["quantity"].map(lambda s: "W_Q" if s.endswith("/q") else "W_K")
        _lines(ax, long, title=title, ylabel="Frobenius norm", logy=True)
        drawn = True
    return _save(fig, path) if drawn else None


def plot_w_q_norm_movement(records: Sequence[dict[str, Any]], path: str | os.PathLike, *,
                           decay: tuple[float, float] | None = None, decay_arm: str = "adamw") -> Path | None:
    r"""‖W_Q‖_F (left: what weight decay shrinks) and ‖W_Q − W_Q0‖_F (right: shrinkage and rotation together) per
    arm over training, the median over seeds with a min–max band, so that an arm whose W_Q only shrinks and one
    whose W_Q turns are told apart (the rotation alone, scale-free: :func:`plot_principal_angles`). ``decay = (lr,
    weight decay)`` adds, dotted, what decoupled decay alone leaves of ``decay_arm``'s median start,
    :math:`\|W_{Q,0}\|_F (1 - \mathrm{lr}\,\lambda)^{t}`. ``None`` when the records hold no W_Q norm
    (:func:`~.records.w_q_norm`)."""
    df = records_frame(records)
    df["norm/w_q"] = [w_q_norm(r) for r in records]
    if df["norm/w_q"].isna().all():
        return None
    fig, axes = _figure(1, 2, width=6.5, height=4.2)
    band = {"estimator": "median", "errorbar": ("pi", 100)}
    for ax, (key, title) in zip(axes[0], (("norm/w_q", "‖W_Q‖_F (shrinkage)"),
                                          ("move_total/q", "‖W_Q − W_Q0‖_F (shrinkage and rotation)")), strict=True):
        long = _long(df, [key])
        if long is None or long.empty:
            continue
        _lines(ax, long, style=None, title=title + "; median, band min–max", ylabel="Frobenius norm", **band)
        ax.set_ylim(bottom=0)
    if decay is not None and decay_arm in set(df["arm"]):
        start = df[(df["arm"] == decay_arm) & (df["epoch"] == 0)]["norm/w_q"].median()
        steps = df[df["arm"] == decay_arm].groupby("epoch")["step"].first() if "step" in df else None
        if steps is not None and start == start:  # not NaN
            lr, wd = decay
            axes[0, 0].plot(steps.index, start * (1.0 - lr * wd) ** steps.values, color="grey", linestyle=":",
                            linewidth=1.4, label=f"decay alone (lr {lr:g}, λ {wd:g})")
            axes[0, 0].legend(fontsize=7)
    return _save(fig, path)


def plot_overview(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Validation accuracy, the total weight norm of every matrix but W_Q, W_K (the same set in every arm:
    :func:`_with_norm_without_qk`), and the largest principal angle of W_Q, stacked on one epoch axis (the
    mechanism beside the accuracy curves)."""
    df = _with_norm_without_qk(records_frame(records))
    norm_row = ((_NO_QK, "||W||_F, all matrices\nbut W_Q, W_K", True) if _NO_QK in df.columns
                else ("norm/euclidean", "||W||_F, non-frame matrices", True))
    rows = [("val_acc", "validation accuracy", False), norm_row,
            ("angle_max_deg/q", "max principal angle of W_Q (deg)", False)]
    rows = [r for r in rows if r[0] in df.columns]
    fig, axes = _figure(len(rows), 1, width=8.0, height=2.8)
    for ax, (key, label, logy) in zip(axes[:, 0], rows, strict=True):
        long = _long(df, [key])
        _lines(ax, long, style=None, title="", ylabel=label, logy=logy)
        if key.endswith("_acc"):
            _accuracy_axis(ax)
    return _save(fig, path)


def plot_per_seed(records: Sequence[dict[str, Any]], path: str | os.PathLike, *, key: str = "val_acc",
                  threshold: float | None = 0.95, max_seeds: int = 12) -> Path | None:
    """``key`` over training for each seed on its own panel, every arm on it: the dips of single runs that a
    mean over seeds smooths away. ``None`` (nothing drawn) with one seed (the per-arm figure shows it) or no
    ``key`` in the records; with more than ``max_seeds`` seeds also ``None``, with a warning."""
    import seaborn as sns

    df = records_frame(records)
    seeds = sorted(df["seed"].unique())
    if key not in df.columns or len(seeds) < 2:
        return None
    if len(seeds) > max_seeds:
        warnings.warn(f"plot_per_seed: {len(seeds)} seeds are more than max_seeds={max_seeds} panels; no per-seed "
                      f"figure drawn (pass a larger max_seeds to draw one).", stacklevel=2)
        return None
    ncols = 2 if len(seeds) > 3 else 1
    nrows = -(-len(seeds) // ncols)
    fig, axes = _figure(nrows, ncols, width=6.0, height=2.4)
    hue_order = sorted(df["arm"].unique())
    for ax, seed in zip(axes.flat, seeds, strict=False):
        one = df[df["seed"] == seed].dropna(subset=[key])
        sns.lineplot(data=one, x="epoch", y=key, hue="arm", hue_order=hue_order, ax=ax, linewidth=1.0,
                     legend=ax is axes.flat[0], **_markers(one))
        if threshold is not None:
            ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"seed {seed}")
        ax.set_ylabel(key)
        if key.endswith("_acc"):
            _accuracy_axis(ax)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(seeds):]:
        ax.set_visible(False)
    return _save(fig, path)


def plot_study(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *,
               threshold: float | None = 0.95) -> dict[str, Path]:
    """Every figure that the records support, as ``out_dir/<name>.png``; returns name -> path."""
    out_dir = Path(out_dir)
    made = {"accuracy": plot_accuracy(records, out_dir / "accuracy.png", threshold=threshold),
            "per_seed": plot_per_seed(records, out_dir / "per_seed.png", threshold=threshold),
            "reached": (None if threshold is None else
                        plot_reached_fraction(records, out_dir / "reached.png", threshold=threshold)),
            "overview": plot_overview(records, out_dir / "overview.png"),
            "weight_norms": plot_weight_norms(records, out_dir / "weight_norms.png"),
            "principal_angles": plot_principal_angles(records, out_dir / "principal_angles.png"),
            "movement": plot_movement(records, out_dir / "movement.png")}
    return {k: v for k, v in made.items() if v is not None}


# ---------------------------------------------------------------------------------------------- paired figures
def plot_pairs(records: Sequence[Mapping[str, Any]], arms: Sequence[str], path: Path, *, title: str,
               metric: str = "test_acc") -> Path | None:
    """Final ``metric`` per arm, one grey line per seed joining its arms (the pairs), mean ± 95% CI in black."""
    from .stats import mean_ci

    runs = group_runs(records)
    arms = [a for a in arms if a in runs]
    if not arms:
        return None
    fig, (ax,) = _row(width=max(4.5, 1.8 * len(arms)))
    seeds = sorted({s for a in arms for s in runs[a]})
    for s in seeds:
        xs = [i for i, a in enumerate(arms) if s in runs[a]]
        ys = [100 * runs[arms[i]][s][-1][metric] for i in xs]
        ax.plot(xs, ys, color="0.6", marker="o", markersize=3, linewidth=0.8, alpha=0.8)
    for i, a in enumerate(arms):
        m, lo, hi = mean_ci([100 * recs[-1][metric] for recs in runs[a].values()])
        if lo is not None:
            ax.errorbar([i], [m], yerr=[[m - lo], [hi - m]], color="black", marker="s", capsize=6, linewidth=1.6)
        else:
            ax.plot([i], [m], color="black", marker="s")
    ax.set_xticks(range(len(arms)), arms, rotation=15 if len(arms) > 3 else 0)
    ax.set_ylabel(f"final {metric} (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_movement_ratio(records: Sequence[Mapping[str, Any]], arms: Sequence[str], path: Path, *, title: str,
                        band: tuple[float, float] | None = None, band_label: str = "published") -> Path | None:
    """Left: per-step rms movement ‖ΔW_Q‖_F per arm over training (log scale). Right: its ratio, AdamW over each
    other arm, per seed (thin) and the median over seeds (thick), with a published ``band`` shaded. A series of
    one evaluation is drawn as a marker."""
    runs = group_runs(records)
    if "adamw" not in runs:
        return None
    fig, (ax0, ax1) = _row(width=6.0, ncols=2)
    colours = dict(zip(arms, ["C0", "C1", "C2", "C3", "C4", "C5", "C6"], strict=False))
    drawn = False
    for arm in arms:
        for s, recs in runs.get(arm, {}).items():
            pts = [(r["epoch"], r["move_step_rms/q"]) for r in recs if r.get("move_step_rms/q")]
            if pts:
                ax0.plot(*zip(*pts, strict=True), color=colours.get(arm), linewidth=0.7, alpha=0.6,
                         label=arm if s == min(runs[arm]) else None, marker=_point(pts))
                drawn = True
    for arm in arms:
        if arm == "adamw" or arm not in runs:
            continue
        per_epoch: dict[int, list[float]] = {}
        for s, recs in runs[arm].items():
            theirs = {r["epoch"]: r.get("move_step_rms/q") for r in runs["adamw"].get(s, [])}
            pts = [(r["epoch"], theirs[r["epoch"]] / r["move_step_rms/q"]) for r in recs
                   if r.get("move_step_rms/q") and theirs.get(r["epoch"])]
            if pts:
                ax1.plot(*zip(*pts, strict=True), color=colours.get(arm), linewidth=0.6, alpha=0.4, marker=_point(pts))
                for e, v in pts:
                    per_epoch.setdefault(e, []).append(v)
        if per_epoch:
            es = sorted(per_epoch)
            med = [sorted(per_epoch[e])[len(per_epoch[e]) // 2] for e in es]
            ax1.plot(es, med, color=colours.get(arm), linewidth=2.0, label=f"adamw / {arm} (median)", marker=_point(es))
    if not drawn:
        return None
    if band is not None:
        ax1.axhspan(*band, color="grey", alpha=0.2, label=f"{band_label}: {band[0]:g}–{band[1]:g}×")
    ax0.set_yscale("log")
    ax0.set_title("per-step movement ‖ΔW_Q‖_F (rms between evaluations)", fontsize=9)
    ax0.set_xlabel("epoch")
    ax0.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_title("ratio of per-step movement, AdamW W_Q over frames", fontsize=9)
    ax1.set_xlabel("epoch")
    ax1.legend(fontsize=7)
    for ax in (ax0, ax1):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_distance(records: Sequence[Mapping[str, Any]], arms: Sequence[str], path: Path, *, title: str) -> Path | None:
    """Distance from initialisation of W_Q over training: ‖W − W₀‖_F/‖W₀‖_F and the largest principal angle to
    the initial subspace, per arm (mean over seeds, band ±1 sd)."""
    import pandas as pd
    import seaborn as sns

    rows = [{"arm": r["arm"], "seed": r["seed"], "epoch": r["epoch"], "rel": r.get("move_total_rel/q"),
             "angle": r.get("angle_max_deg/q")} for r in records if r["arm"] in arms]
    df = pd.DataFrame(rows)
    if df.empty or df["rel"].isna().all():
        return None
    fig, (ax0, ax1) = _row(width=5.5, ncols=2)
    sns.lineplot(data=df, x="epoch", y="rel", hue="arm", hue_order=[a for a in arms if a in set(df["arm"])],
                 errorbar="sd", ax=ax0, **_markers(df))
    sns.lineplot(data=df, x="epoch", y="angle", hue="arm", hue_order=[a for a in arms if a in set(df["arm"])],
                 errorbar="sd", ax=ax1, legend=False, **_markers(df))
    ax0.set_ylabel("‖W_Q − W_Q0‖_F / ‖W_Q0‖_F")
    ax1.set_ylabel("largest principal angle to initial span (deg)")
    for ax in (ax0, ax1):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_gap_sweep(rows: Sequence[tuple[float, Mapping[str, Any]]], path: Path, *, xlabel: str, title: str,
                   logx: bool = False, scale: float = 100.0,
                   ylabel: str = "stiefel − adamw, final test accuracy (pp)") -> Path | None:
    """Mean paired gap (times ``scale``: 100 shows fractions as pp) with its 95% interval against the swept
    value, per-seed gaps as dots."""
    rows = [(x, c) for x, c in rows if c and c.get("mean") is not None]
    if not rows:
        return None
    fig, (ax,) = _row(width=6.0)
    xs = [x for x, _ in rows]
    means = [scale * c["mean"] for _, c in rows]
    lo = [scale * (c["mean"] - c["ci_low"]) if c["ci_low"] is not None else 0.0 for _, c in rows]
    hi = [scale * (c["ci_high"] - c["mean"]) if c["ci_high"] is not None else 0.0 for _, c in rows]
    for x, c in rows:
        ax.scatter([x] * len(c["differences"]), [scale * d for d in c["differences"]], color="0.6", s=10, zorder=1)
    ax.errorbar(xs, means, yerr=[lo, hi], color="black", marker="o", capsize=5, zorder=2, label="mean ± 95% CI")
    ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ablation(comparisons: Mapping[str, Mapping[str, Any]], arms: Sequence[str], path: Path, *,
                  title: str, base: str = "adamw") -> Path | None:
    """Bar chart: each arm's mean paired gap over ``base`` (pp) with its 95% interval; per-seed gaps as dots."""
    names = [a for a in arms if f"{a} - {base}" in comparisons]
    if not names:
        return None
    fig, (ax,) = _row(width=max(5.0, 1.6 * len(names)))
    for i, a in enumerate(names):
        c = comparisons[f"{a} - {base}"]
        m = 100 * c["mean"]
        ax.bar([i], [m], color=f"C{i + 1}", alpha=0.7)
        if c["ci_low"] is not None:
            ax.errorbar([i], [m], yerr=[[m - 100 * c["ci_low"]], [100 * c["ci_high"] - m]], color="black", capsize=6)
        ax.scatter([i] * len(c["differences"]), [100 * d for d in c["differences"]], color="black", s=8, zorder=3)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel(f"final test accuracy − {base} (pp)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_per_head(records: Sequence[Mapping[str, Any]], path: Path, *, rows: Sequence[tuple[str, str, bool]],
                  title: str) -> Path | None:
    """Per-head quantities ``<prefix>/<layer>/<head>`` over training: one row of panels per ``(prefix, ylabel,
    logy)`` of ``rows``, one panel per layer, one colour per arm, one line style per head (mean over seeds).
    ``None`` when the records hold none of the prefixes."""
    import seaborn as sns

    df = records_frame(records)
    found = []
    for prefix, ylabel, logy in rows:
        keys = [c for c in df.columns if c.startswith(prefix + "/") and c.count("/") == prefix.count("/") + 2]
        if not keys:
            continue
        long = df.melt(id_vars=["arm", "seed", "epoch"], value_vars=keys, var_name="key", value_name="value")
        long = long.dropna(subset=["value"])
        parts = long["key"].str[len(prefix) + 1:].str.split("/", expand=True)
        long["layer"], long["head"] = parts[0], "head " + parts[1]
        found.append((long, prefix, ylabel, logy))
    if not found:
        return None
    layers = sorted({v for long, *_ in found for v in long["layer"].unique()},
                    key=lambda v: int(v) if v.isdigit() else v)
    fig, axes = _figure(len(found), len(layers), width=4.2, height=3.4, sharex=True)
    for r, (long, prefix, ylabel, logy) in enumerate(found):
        for c, layer in enumerate(layers):
            ax = axes[r, c]
            sub = long[long["layer"] == layer]
            sns.lineplot(data=sub, x="epoch", y="value", hue="arm", style="head", errorbar=None, ax=ax,
                         linewidth=1.0, legend=(r == 0 and c == len(layers) - 1), **_markers(sub))
            ax.set_title(f"{prefix}, layer {layer}", fontsize=9)
            ax.set_ylabel(ylabel)
            if logy:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
