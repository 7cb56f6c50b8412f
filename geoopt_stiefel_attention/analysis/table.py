"""The certificate table: certificates rendered as a table (plain text or Markdown) or as JSON records.

The same functions render the main table (rows :data:`~.suite.ROWS`, ``StiefelAdam`` beside stock optimizers)
and the manifold-Muon table (rows :data:`~.muon.MUON_ROWS`, ``StiefelMuon`` beside torch's ``Muon``,
``StiefelAdam`` and geoopt): ``ours`` names the column the findings compare the others with, ``descriptions``
the columns' one-line descriptions in the legend. Nothing here prints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from ._result import Certificate

__all__ = ["format_cell", "format_text", "format_markdown", "to_records", "to_json", "conclusions",
           "stiefel_adam_failures", "stiefel_muon_failures", "muon_labels", "muon_descriptions"]

OUR_COLUMN = "StiefelAdam"
#: The column the Muon table's findings compare the others with.
OUR_MUON_COLUMN = "StiefelMuon"


def _is_muon_row(name: str) -> bool:
    from .muon import MUON_ROWS

    return name in MUON_ROWS


def muon_labels() -> dict[str, str]:
    """Header label of every column of :func:`~.muon.muon_columns`, by name."""
    from .muon import muon_columns

    return {c.name: c.short for c in muon_columns()}


def muon_descriptions() -> dict[str, str]:
    """One-line description of every column of :func:`~.muon.muon_columns`, by name."""
    from .muon import muon_columns

    return {c.name: c.description for c in muon_columns()}


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


def conclusions(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                ours: str = OUR_COLUMN) -> list[str]:
    """The findings the table supports, as sentences built from the measured outcomes; every other column is
    compared with the column ``ours``."""
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
    if ours in cols:
        for col in cols:
            if col == ours:
                continue
            differ = [row for (row, c), cert in cells.items() if c == col and cert.passed is False
                      and cells.get((row, ours)) is not None and cells[(row, ours)].passed]
            if differ:
                out.append(f"{labels.get(col, col)} fails where {labels.get(ours, ours)} passes: "
                           + ", ".join(r.split(" ")[0] for r in differ) + ".")
    return out


def stiefel_adam_failures(certs: Iterable[Certificate]) -> list[Certificate]:
    """The certificates of the main table's ``StiefelAdam`` column that failed (the Muon table's rows, where
    StiefelAdam is a comparison column, are not counted)."""
    return [c for c in certs if c.optimizer == OUR_COLUMN and c.passed is False and not _is_muon_row(c.name)]


def stiefel_muon_failures(certs: Iterable[Certificate]) -> list[Certificate]:
    """The certificates of the Muon table's ``StiefelMuon`` columns (:data:`~.muon.MUON_OURS`: the default
    solver setting and the solved one) that failed."""
    from .muon import MUON_OURS

    return [c for c in certs if c.optimizer in MUON_OURS and c.passed is False and _is_muon_row(c.name)]


def _column_key(cols: Sequence[str], labels: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(labels.get(c, c), c) for c in cols]


def format_text(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                legend: bool = True, notes: bool = True, descriptions: Mapping[str, str] | None = None,
                ours: str = OUR_COLUMN) -> str:
    """An aligned plain-text table: certificates as rows, optimizers as columns, then a legend and notes.

    ``labels`` and ``descriptions`` (by column name) default to those of the main table's columns; ``ours`` is
    the column the findings compare the others with."""
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
        described = _descriptions() if descriptions is None else descriptions
        pad = max([12] + [len(lab) for lab, _ in heads])
        lines += [f"  {lab:<{pad}} {described.get(c, c)}" for lab, c in heads]
        lines += ["", "Certificates (figure compared with the tolerance; float64 unless stated):"]
        lines += [f"  {n}: {s} [{t}]" if t else f"  {n}: {s}" for n, s, t in _legend(certs)]
    if notes:
        found = conclusions(certs, labels, ours=ours)
        if found:
            lines += ["", "Findings:"] + [f"  - {s}" for s in found]
    return "\n".join(lines)


def _md(text: str) -> str:
    """Escape the characters that Markdown tables and emphasis would interpret."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")


def format_markdown(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                    descriptions: Mapping[str, str] | None = None, ours: str = OUR_COLUMN) -> str:
    """The table as GitHub Markdown, followed by the legend (columns with their ``descriptions``, when given)
    and the findings (other columns compared with ``ours``)."""
    labels = dict(_default_labels() if labels is None else labels)
    rows, cols, cells = _grid(certs)
    heads = _column_key(cols, labels)
    lines = ["| certificate | " + " | ".join(lab for lab, _ in heads) + " |",
             "|---|" + "---:|" * len(heads)]
    for r in rows:
        line = [format_cell(cells[(r, c)]) if (r, c) in cells else "" for _, c in heads]
        lines.append(f"| {_md(r)} | " + " | ".join(line) + " |")
    described = descriptions or {}
    lines += ["", "**Columns**", ""] + [f"- `{lab}`: {_md(described[c]) if c in described else c}"
                                        for lab, c in heads]
    lines += ["", "**Certificates**", ""]
    lines += [f"- **{_md(n)}**: {_md(s)}" + (f" (`{t}`)" if t else "") for n, s, t in _legend(certs)]
    found = conclusions(certs, labels, ours=ours)
    if found:
        lines += ["", "**Findings**", ""] + [f"- {_md(s)}" for s in found]
    return "\n".join(lines) + "\n"


def to_records(certs: Iterable[Certificate]) -> list[dict]:
    """One JSON-ready dict per cell (keys ``certificate, optimizer, passed, measured, tolerance, details``, ...)."""
    return [c.to_dict() for c in certs]


def to_json(certs: Iterable[Certificate], *, indent: int = 2) -> str:
    """:func:`to_records` serialised as a JSON list."""
    return json.dumps(to_records(certs), indent=indent)
