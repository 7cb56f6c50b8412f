"""Seaborn figures of a study's records, saved as PNG (no pyplot state, no windows).

Every function takes the records (a list of dicts as written to ``metrics.jsonl``) and a path, draws on a
fresh :class:`matplotlib.figure.Figure`, saves it, and returns the path. Curves are the mean over seeds
with a band of one standard deviation (seaborn ``errorbar="sd"``); with a single seed there is no band.
pandas, seaborn and matplotlib are imported inside the functions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["records_frame", "plot_curves", "plot_accuracy", "plot_weight_norms", "plot_principal_angles",
           "plot_movement", "plot_overview", "plot_study"]

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


def _lines(ax, long, *, hue: str = "arm", style: str | None = "quantity", title: str = "", ylabel: str = "",
           logy: bool = False) -> None:
    import seaborn as sns

    multi_style = style is not None and long[style].nunique() > 1
    sns.lineplot(data=long, x="epoch", y="value", hue=hue, style=style if multi_style else None,
                 errorbar="sd", ax=ax, linewidth=1.2)
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
    ax.set_ylim(-0.02, 1.02)
    return _save(fig, path)


def plot_weight_norms(records: Sequence[dict[str, Any]], path: str | os.PathLike, *,
                      max_matrices: int = 12) -> Path | None:
    """Frobenius norms of the weight matrices over training: one panel per arm, one line per matrix (mean
    over seeds), and the total over non-frame matrices (``norm/euclidean``) in black. With more than
    ``max_matrices`` matrices only the total is drawn."""
    import seaborn as sns

    df = records_frame(records)
    keys = [c for c in df.columns if c.startswith("norm/") and c != "norm/euclidean"]
    if not keys and "norm/euclidean" not in df.columns:
        return None
    arms = list(dict.fromkeys(df["arm"]))
    fig, axes = _figure(1, len(arms), width=5.5, height=4.0, sharex=True)
    for ax, arm in zip(axes[0], arms, strict=True):
        sub = df[df["arm"] == arm]
        if len(keys) <= max_matrices:
            long = _long(sub, keys)
            if long is not None and not long.empty:
                long["quantity"] = long["quantity"].str.removeprefix("norm/")
                sns.lineplot(data=long, x="epoch", y="value", hue="quantity", errorbar=None, ax=ax, linewidth=1.0)
        if "norm/euclidean" in sub.columns:
            total = sub.groupby("epoch")["norm/euclidean"].mean()
            ax.plot(total.index, total.values, color="black", linewidth=1.8, label="all non-frame matrices")
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


def plot_overview(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Validation accuracy, total non-frame weight norm, and largest principal angle of W_Q, stacked on one
    epoch axis (the mechanism beside the accuracy curves)."""
    df = records_frame(records)
    rows = [("val_acc", "validation accuracy", False), ("norm/euclidean", "||W||_F, non-frame matrices", True),
            ("angle_max_deg/q", "max principal angle of W_Q (deg)", False)]
    rows = [r for r in rows if r[0] in df.columns]
    fig, axes = _figure(len(rows), 1, width=8.0, height=2.8)
    for ax, (key, label, logy) in zip(axes[:, 0], rows, strict=True):
        long = _long(df, [key])
        _lines(ax, long, style=None, title="", ylabel=label, logy=logy)
    return _save(fig, path)


def plot_study(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *,
               threshold: float | None = 0.95) -> dict[str, Path]:
    """Every figure that the records support, as ``out_dir/<name>.png``; returns name -> path."""
    out_dir = Path(out_dir)
    made = {"accuracy": plot_accuracy(records, out_dir / "accuracy.png", threshold=threshold),
            "overview": plot_overview(records, out_dir / "overview.png"),
            "weight_norms": plot_weight_norms(records, out_dir / "weight_norms.png"),
            "principal_angles": plot_principal_angles(records, out_dir / "principal_angles.png"),
            "movement": plot_movement(records, out_dir / "movement.png")}
    return {k: v for k, v in made.items() if v is not None}
