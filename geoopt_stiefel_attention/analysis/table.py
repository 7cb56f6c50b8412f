"""The certificate table: certificates rendered as a table (plain text or Markdown) or as JSON records.

Nothing here prints. (Formerly ``analysis.report``; in this project a *report* is a study's report, written
by :mod:`geoopt_stiefel_attention.experiments.report`.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from ._result import Certificate

__all__ = ["format_cell", "format_text", "format_markdown", "to_records", "to_json", "conclusions",
           "stiefel_adam_failures"]

OUR_COLUMN = "StiefelAdam"


def _default_labels() -> dict[str, str]:
    from .optimizers import default_columns

    return {c.name: c.label for c in default_columns()}


def _descriptions() -> dict[str, str]:
    from .optimizers import default_columns

    return {c.name: c.description for c in default_columns()}


def format_cell(cert: Certificate) -> str:
    """``"<figure> ok"``, ``"<figure> FAIL"`` or ``"n/a"``."""
    if not cert.applicable:
        return "n/a"
    m = cert.measured
    if m is None or math.isnan(m):
        figure = "nan"
    elif math.isinf(m):
        figure = "inf" if m > 0 else "-inf"
    elif m == 0:
        figure = "0"
    elif 1e-2 <= abs(m) < 1e3:
        figure = f"{m:#.4g}"
    else:
        figure = f"{m:.1e}"
    return f"{figure} {'ok' if cert.passed else 'FAIL'}"


def _grid(certs: Sequence[Certificate]):
    rows: list[str] = []
    cols: list[str] = []
    cells: dict[tuple[str, str], Certificate] = {}
    for c in certs:
        opt = c.optimizer or "-"
        if c.name not in rows:
            rows.append(c.name)
        if opt not in cols:
            cols.append(opt)
        cells[(c.name, opt)] = c
    return rows, cols, cells


def _tolerance_text(cert: Certificate) -> str:
    return f"{cert.comparison} {cert.tolerance:.3g}" if cert.tolerance is not None else ""


def _legend(certs: Sequence[Certificate]) -> list[tuple[str, str, str]]:
    seen: dict[str, tuple[str, str, str]] = {}
    for c in certs:
        if c.name not in seen or (not seen[c.name][2] and c.tolerance is not None):
            seen[c.name] = (c.name, c.statement, _tolerance_text(c))
    return list(seen.values())


def _names_where(certs: Sequence[Certificate], name: str, passed: bool | None, labels: Mapping[str, str]) -> list[str]:
    return [labels.get(c.optimizer, c.optimizer) for c in certs if c.name == name and c.passed is passed]


def conclusions(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None) -> list[str]:
    """The findings the table supports, as sentences built from the measured outcomes."""
    labels = dict(_default_labels() if labels is None else labels)
    out = []
    _, cols, cells = _grid(certs)
    names = {c.name for c in certs}
    prefix = {n[:2]: n for n in names}

    def passing(key):
        return _names_where(certs, prefix[key], True, labels) if key in prefix else []

    if "4a" in prefix and "4b" in prefix and "1b" in prefix:
        left, right = set(passing("4a")), set(passing("4b"))
        out.append(
            "Equivariance: left O(d) holds for " + (", ".join(sorted(left)) or "none")
            + "; right O(r) as well for " + (", ".join(sorted(left & right)) or "none")
            + ". Steepest descent in the embedded metric (1b) holds for " + (", ".join(passing("1b")) or "none")
            + ". Equivariance alone does not force the per-frame second moment (a per-column one is still "
              "left O(d)-equivariant); steepest descent does.")
    if "2a" in prefix:
        out.append("Scale-free steps (2a) hold for " + (", ".join(passing("2a")) or "none")
                   + ": degree zero in the gradient is shared by every Adam-type method; a fixed-step "
                     "(SGD-type) update is of degree one.")
    if "6a" in prefix:
        out.append("Gauge: in attention the loss is invariant along (W_Q B, -W_K B^T), and the gradient has no "
                   "component there (6a, 6b), for frames and unconstrained matrices alike. A direction along "
                   "which the loss is invariant carries no gradient, so no optimizer moves along it and removing "
                   "the gauge cannot be what the Stiefel constraint buys.")
    if OUR_COLUMN in cols:
        for col in cols:
            if col == OUR_COLUMN:
                continue
            differ = [row for (row, c), cert in cells.items() if c == col and cert.passed is False
                      and cells.get((row, OUR_COLUMN)) is not None and cells[(row, OUR_COLUMN)].passed]
            if differ:
                out.append(f"{labels.get(col, col)} fails where StiefelAdam passes: "
                           + ", ".join(r.split(" ")[0] for r in differ) + ".")
    return out


def stiefel_adam_failures(certs: Iterable[Certificate]) -> list[Certificate]:
    """The certificates of the ``StiefelAdam`` column that failed."""
    return [c for c in certs if c.optimizer == OUR_COLUMN and c.passed is False]


def _column_key(cols: Sequence[str], labels: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(labels.get(c, c), c) for c in cols]


def format_text(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                legend: bool = True, notes: bool = True) -> str:
    """An aligned plain-text table: certificates as rows, optimizers as columns, then a legend and notes."""
    labels = dict(_default_labels() if labels is None else labels)
    rows, cols, cells = _grid(certs)
    heads = _column_key(cols, labels)
    first = max([len("certificate")] + [len(r) for r in rows]) + 2
    widths = [max(len(lab), 12, *(len(format_cell(cells[(r, c)])) for r in rows if (r, c) in cells)) + 2
              for lab, c in heads]
    header = "certificate".ljust(first) + "".join(lab.rjust(w) for (lab, _), w in zip(heads, widths, strict=True))
    lines = [header, "-" * len(header)]
    for r in rows:
        line = r.ljust(first)
        for (_lab, c), w in zip(heads, widths, strict=True):
            line += (format_cell(cells[(r, c)]) if (r, c) in cells else "").rjust(w)
        lines.append(line)
    if legend:
        lines += ["", "Columns:"]
        described = _descriptions()
        lines += [f"  {lab:<12} {described.get(c, c)}" for lab, c in heads]
        lines += ["", "Certificates (figure compared with the tolerance; float64 unless stated):"]
        lines += [f"  {n}: {s} [{t}]" if t else f"  {n}: {s}" for n, s, t in _legend(certs)]
    if notes:
        found = conclusions(certs, labels)
        if found:
            lines += ["", "Findings:"] + [f"  - {s}" for s in found]
    return "\n".join(lines)


def _md(text: str) -> str:
    """Escape the characters that Markdown tables and emphasis would interpret."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")


def format_markdown(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None) -> str:
    """The table as GitHub Markdown, followed by the legend and the findings."""
    labels = dict(_default_labels() if labels is None else labels)
    rows, cols, cells = _grid(certs)
    heads = _column_key(cols, labels)
    lines = ["| certificate | " + " | ".join(lab for lab, _ in heads) + " |",
             "|---|" + "---:|" * len(heads)]
    for r in rows:
        line = [format_cell(cells[(r, c)]) if (r, c) in cells else "" for _, c in heads]
        lines.append(f"| {_md(r)} | " + " | ".join(line) + " |")
    lines += ["", "**Columns**", ""] + [f"- `{lab}`: {c}" for lab, c in heads]
    lines += ["", "**Certificates**", ""]
    lines += [f"- **{_md(n)}**: {_md(s)}" + (f" (`{t}`)" if t else "") for n, s, t in _legend(certs)]
    found = conclusions(certs, labels)
    if found:
        lines += ["", "**Findings**", ""] + [f"- {_md(s)}" for s in found]
    return "\n".join(lines) + "\n"


def to_records(certs: Iterable[Certificate]) -> list[dict]:
    """One JSON-ready dict per cell (keys ``certificate, optimizer, passed, measured, tolerance, details``, ...)."""
    return [c.to_dict() for c in certs]


def to_json(certs: Iterable[Certificate], *, indent: int = 2) -> str:
    """:func:`to_records` serialised as a JSON list."""
    return json.dumps(to_records(certs), indent=indent)
