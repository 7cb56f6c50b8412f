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

from .._docfrag import fill
from ._result import Certificate

__all__ = ["format_cell", "format_text", "format_markdown", "to_records", "to_json", "conclusions",
           "stiefel_adam_failures", "stiefel_muon_failures", "verdict", "muon_labels", "muon_descriptions"]

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


#: Columns whose step is of degree one in the gradient (fixed-step, SGD-type): the 2a finding expects them to fail.
FIXED_STEP_COLUMNS = frozenset({"geoopt-rsgd", "StiefelAdam(second_moment=None)"})
#: The per-column second-moment variant of the main table: the equivariance finding rests on its 4a and 1b cells.
PER_COLUMN_VARIANT = "StiefelAdam(second_moment='column')"


def _listing(names: Sequence[str]) -> str:
    return ", ".join(names) or "none"


def conclusions(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                ours: str = OUR_COLUMN) -> list[str]:
    """The findings the table supports, as sentences built from the measured outcomes; every other column is
    compared with the column ``ours``.

    A finding is stated only where the cells it rests on were computed and came out as it says; otherwise the
    sentence says which cells failed or were not computed and that the finding is not established by this table.
    The cells of ``ours`` that fail are listed last."""
    labels = dict(_default_labels() if labels is None else labels)
    out = []
    _, cols, cells = _grid(certs)
    names = {c.name for c in certs}
    prefix = {n[:2]: n for n in names}

    def passing(key):
        return _names_where(certs, prefix[key], True, labels) if key in prefix else []

    def failing(key):
        return _names_where(certs, prefix[key], False, labels) if key in prefix else []

    def cell(key, column):
        return cells.get((prefix[key], column)) if key in prefix else None

    def label(column):
        return labels.get(column, column)

    if "4a" in prefix and "4b" in prefix and "1b" in prefix:
        out.append(_equivariance_finding(passing, cell, label, ours))
    if "2a" in prefix:
        out.append(_scale_finding(certs, prefix, passing, label))
    if "6a" in prefix or "6b" in prefix:
        out.append(_gauge_finding(certs, prefix, passing, failing))
    if ours in cols:
        out.extend(_column_findings(cols, cells, label, ours))
    return out


def _equivariance_finding(passing, cell, label, ours: str) -> str:
    """The equivariance sentence (rows 4a, 4b, 1b): who is left and right equivariant, who is steepest descent,
    and whether the per-column variant's 4a and 1b cells and the 1b cell of ``ours`` show that equivariance alone
    leaves the second moment open and steepest descent fixes it."""
    left, right = set(passing("4a")), set(passing("4b"))
    text = ("Equivariance: left O(d) holds for " + _listing(sorted(left))
            + "; right O(r) as well for " + _listing(sorted(left & right))
            + ". Steepest descent in the embedded metric (1b) holds for " + _listing(passing("1b")) + ".")
    needed = {(f"4a {label(PER_COLUMN_VARIANT)}", True): cell("4a", PER_COLUMN_VARIANT),
              (f"1b {label(PER_COLUMN_VARIANT)}", False): cell("1b", PER_COLUMN_VARIANT),
              (f"1b {label(ours)}", True): cell("1b", ours)}
    absent = [what for (what, _), c in needed.items() if c is None or c.passed is None]
    contrary = [f"{what} {'fails' if c.passed is False else 'passes'}" for (what, expected), c in needed.items()
                if c is not None and c.passed is not None and c.passed is not expected]
    if not absent and not contrary:
        return text + (" Equivariance alone does not force the per-frame second moment (a per-column one is still "
                       "left O(d)-equivariant); steepest descent does.")
    return text + (" Whether equivariance alone leaves the second moment open and steepest descent fixes it is "
                   "not established by this table ("
                   + "; ".join(contrary + ([f"not computed: {', '.join(absent)}"] if absent else [])) + ").")


def _scale_finding(certs: Sequence[Certificate], prefix: Mapping[str, str], passing, label) -> str:
    """The scale-freedom sentence (row 2a): whether every Adam-type column passes (degree zero in the gradient)
    and every fixed-step column (:data:`FIXED_STEP_COLUMNS`) fails (degree one)."""
    scale = [c for c in certs if c.name == prefix["2a"] and c.passed is not None]
    adam = [c for c in scale if c.optimizer not in FIXED_STEP_COLUMNS]
    fixed = [c for c in scale if c.optimizer in FIXED_STEP_COLUMNS]
    text = "Scale-free steps (2a) hold for " + _listing(passing("2a"))
    if any(c.passed is False for c in adam):
        text += ("; they fail for " + _listing([label(c.optimizer) for c in adam if c.passed is False])
                 + ", Adam-type, so the table does not show degree zero in the gradient shared by every "
                   "Adam-type method")
    elif adam:
        text += ": degree zero in the gradient is shared by every Adam-type method"
    else:
        text += " (no Adam-type column is in this table)"
    if fixed and all(c.passed is False for c in fixed):
        return text + "; a fixed-step (SGD-type) update is of degree one."
    if fixed:
        return text + ("; the fixed-step (SGD-type) " + _listing([label(c.optimizer) for c in fixed if c.passed])
                       + " passes too, so the table does not show a fixed-step update to be of degree one.")
    return text + " (no fixed-step, SGD-type, column is in this table)."


def _column_findings(cols: Sequence[str], cells: Mapping[tuple[str, str], Certificate], label, ours: str) -> list[str]:
    """One sentence per column that fails where ``ours`` passes (the rows), in column order, then the rows in
    which ``ours`` itself fails, if any."""
    out = []
    for col in cols:
        if col == ours:
            continue
        differ = [row for (row, c), cert in cells.items() if c == col and cert.passed is False
                  and cells.get((row, ours)) is not None and cells[(row, ours)].passed]
        if differ:
            out.append(f"{label(col)} fails where {label(ours)} passes: "
                       + ", ".join(r.split(" ")[0] for r in differ) + ".")
    own = [row for (row, c), cert in cells.items() if c == ours and cert.passed is False]
    if own:
        out.append(f"{label(ours)} itself fails: " + ", ".join(r.split(" ")[0] for r in own) + ".")
    return out


def _gauge_finding(certs: Sequence[Certificate], prefix: Mapping[str, str], passing, failing) -> str:
    """The gauge sentence: the negative result when 6a and 6b were computed and pass for every column, else which
    of them failed (and for whom) or were not computed."""
    keys = ("6a", "6b")
    failed = {key: failing(key) for key in keys if key in prefix}
    if all(key in prefix for key in keys) and not any(failed.values()):
        kinds = {str(c.details.get("parametrisation", "")).split(" ")[0] for c in certs
                 if c.name in (prefix["6a"], prefix["6b"])} - {""}
        scope = (", for frames and unconstrained matrices alike" if kinds >= {"frames", "unconstrained"}
                 else f", for {kinds.pop()} parametrisations (the only kind in this table)" if len(kinds) == 1
                 else "")
        return ("Gauge: in attention the loss is invariant along (W_Q B, -W_K B^T), and the gradient has no "
                f"component there (6a, 6b){scope}. A direction along which the loss is invariant carries no "
                "gradient, so no optimizer moves along it and removing the gauge cannot be what the Stiefel "
                "constraint buys.")
    parts = []
    for key in keys:
        if key not in prefix:
            parts.append(f"{key} was not computed")
        elif failed[key]:
            parts.append(f"{key} fails for {_listing(failed[key])}"
                         + (f" (passes for {_listing(passing(key))})" if passing(key) else ""))
        else:
            parts.append(f"{key} passes for {_listing(passing(key))}")
    return ("Gauge: not established by this table (" + "; ".join(parts) + "): it does not show that the gradient "
            "has no component along the symmetry (W_Q B, -W_K B^T), nor that removing the gauge cannot be what "
            "the Stiefel constraint buys.")


@fill
def stiefel_adam_failures(certs: Iterable[Certificate]) -> list[Certificate]:
    """The certificates of the main table's ``StiefelAdam`` column that failed (the Muon table's rows, where
    StiefelAdam is a comparison column, are not counted).

    Parameters
    ----------
    {{certs_cells}}

    Returns
    -------
    list of Certificate
        The failed cells, in the order given.
    """
    return [c for c in certs if c.optimizer == OUR_COLUMN and c.passed is False and not _is_muon_row(c.name)]


def stiefel_muon_failures(certs: Iterable[Certificate]) -> list[Certificate]:
    """The certificates of the Muon table's ``StiefelMuon`` columns (:data:`~.muon.MUON_OURS`: the default
    solver setting and the solved one) that failed."""
    from .muon import MUON_OURS

    return [c for c in certs if c.optimizer in MUON_OURS and c.passed is False and _is_muon_row(c.name)]


def verdict(certs: Iterable[Certificate]) -> tuple[str, bool]:
    """The closing line of ``stiefel-attention certify`` and whether it is a pass: every certificate of ours that
    was computed passed.

    Ours are the main table's ``StiefelAdam`` column (:func:`stiefel_adam_failures`) and the Muon table's
    ``StiefelMuon`` columns (:data:`~.muon.MUON_OURS`, :func:`stiefel_muon_failures`); every other cell that
    fails (a stock optimizer, a variant, the projected msign, StiefelAdam as a column of the Muon table) is a
    baseline, shown for contrast. A table without a column of ours passes, and the line says that nothing of
    ours was certified.

    Parameters
    ----------
    certs : sequence of Certificate
        The cells of both tables (:func:`~.suite.run_certificates`, :func:`~.muon.run_muon_certificates`).

    Returns
    -------
    tuple of (str, bool)
        The line (``"Verdict: ..."``) and whether no certificate of ours failed.
    """
    from .muon import MUON_OURS

    certs = list(certs)
    adam = [c for c in certs if c.optimizer == OUR_COLUMN and not _is_muon_row(c.name) and c.applicable]
    muon = [c for c in certs if c.optimizer in MUON_OURS and _is_muon_row(c.name) and c.applicable]
    failed = stiefel_adam_failures(certs) + stiefel_muon_failures(certs)
    ours = {id(c) for c in failed}
    baselines = sum(1 for c in certs if c.applicable and not c.passed and id(c) not in ours)
    names = " and ".join(name for name, cells in (("StiefelAdam", adam), ("StiefelMuon", muon)) if cells)
    if baselines == 0:
        contrast = "no baseline cell failed"
    else:
        are = "s are baselines" if baselines > 1 else " is a baseline"
        contrast = f"{'the other ' if failed else ''}{baselines} FAIL cell{are}, shown for contrast"
    if failed:
        which = ", ".join(f"{c.name.split()[0]} ({c.optimizer})" for c in failed)
        return (f"Verdict: FAILED: {len(failed)} of the {len(adam) + len(muon)} {names} certificates failed: "
                f"{which}; {contrast}.", False)
    if not names:
        return (f"Verdict: no StiefelAdam or StiefelMuon certificate was computed (the selection leaves their "
                f"columns out), so nothing of ours is certified here; {contrast}.", True)
    count = len(adam) + len(muon)
    return f"Verdict: every {names} certificate passed ({count} cell{'s' if count > 1 else ''}); {contrast}.", True


def _column_key(cols: Sequence[str], labels: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(labels.get(c, c), c) for c in cols]


@fill
def format_text(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                legend: bool = True, notes: bool = True, descriptions: Mapping[str, str] | None = None,
                ours: str = OUR_COLUMN) -> str:
    """An aligned plain-text table: certificates as rows, optimizers as columns, then a legend and notes.

    ``labels`` and ``descriptions`` (by column name) default to those of the main table's columns; ``ours`` is
    the column the findings compare the others with.

    Parameters
    ----------
    {{certs_cells}}
    labels : mapping of str to str, optional
        Column headers by column name.
    legend : bool, default True
        Add the columns' descriptions and the certificates' statements.
    notes : bool, default True
        Add the findings.
    {{descriptions_ours}}

    Returns
    -------
    str
        The table.
    """
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


@fill
def format_markdown(certs: Sequence[Certificate], labels: Mapping[str, str] | None = None, *,
                    descriptions: Mapping[str, str] | None = None, ours: str = OUR_COLUMN) -> str:
    """The table as GitHub Markdown, followed by the legend (columns with their ``descriptions``, when given)
    and the findings (other columns compared with ``ours``).

    Parameters
    ----------
    {{certs_cells}}
    labels : mapping of str to str, optional
        Column headers by column name.
    {{descriptions_ours}}

    Returns
    -------
    str
        The Markdown document.
    """
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


@fill
def to_records(certs: Iterable[Certificate]) -> list[dict]:
    """One JSON-ready dict per cell (keys ``certificate, optimizer, passed, measured, tolerance, details``, ...).

    Parameters
    ----------
    {{certs_cells}}

    Returns
    -------
    list of dict
        :meth:`Certificate.to_dict` of each cell.
    """
    return [c.to_dict() for c in certs]


@fill
def to_json(certs: Iterable[Certificate], *, indent: int = 2) -> str:
    """:func:`to_records` serialised as a JSON list.

    Parameters
    ----------
    {{certs_cells}}
    indent : int, default 2
        JSON indentation.

    Returns
    -------
    str
        The JSON list.
    """
    return json.dumps(to_records(certs), indent=indent)
