"""Run every certificate for every optimizer column: the data behind ``stiefel-attention certify``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import conditioning, equivariance, gauge, scale, steepest, weight_decay
from ._result import Certificate
from .optimizers import OptimizerColumn, default_columns

__all__ = ["ROWS", "DEFAULT_STEPS", "DEFAULT_OTHER_STEPS", "FULL_STEPS", "FULL_OTHER_STEPS", "LONG_RUN_COLUMNS",
           "DRIFT_ROWS", "run_certificates", "select_rows"]

#: Certificate names in table order.
ROWS = (
    "1a steepest descent: projection",
    "1b steepest descent: step direction",
    "1c first step = retr(W, -lr xi/||xi||)",
    "1d retraction is first order",
    "2a scale-free (eps=0)",
    "2b scale-free (default eps)",
    "3a polar step cond <= 1 + D^2",
    "3b no drift, float64",
    "3c no drift, float32",
    "4a left O(d)-equivariance",
    "4b right O(r)-equivariance",
    "5  rgrad of decay = 0",
    "5a coupled decay: no effect",
    "5b decay of retracted point: no effect",
    "5c decay never enlarges the step",
    "5d training: frames ignore decay",
    "6a gauge: no gradient along symmetry",
    "6b gauge: loss constant on orbit",
)

#: Steps of the long drift run (certificates 3a-3c) for the ``StiefelAdam`` column (``certify --steps``).
DEFAULT_STEPS = 2_000
#: Steps of the drift run for every other column (``certify --other-steps``). Long enough that drift shows: the
#: Cayley retraction of geoopt's ``Stiefel()`` (column geoopt-radam-canonical), which never re-orthonormalises,
#: ends 1.5-2.1 times above the tolerance of 3b and 1.4-2.3 times above that of 3c after 500 steps (seeds 0-5;
#: tests/test_analysis.py fails it at this length), while after 100 steps (seed 0) it is still at the tolerance.
DEFAULT_OTHER_STEPS = 500
#: ``certify --full``: the drift run of the StiefelAdam column in the full table.
FULL_STEPS = 10_000
#: ``certify --full``: the drift run of every other column in the full table.
FULL_OTHER_STEPS = 2_000
#: The columns whose drift run has ``steps`` steps (``other_steps`` for every other column) by default.
LONG_RUN_COLUMNS = ("StiefelAdam",)
#: The labels of the rows computed from the drift runs (``steps``, ``other_steps``).
DRIFT_ROWS = ("3a", "3b", "3c")


def select_rows(tokens: Sequence[str]) -> tuple[str, ...]:
    """The rows of :data:`ROWS` that ``tokens`` name, in table order: a proposition's number (``"5"``: rows
    5, 5a-5d) or a row's label (``"3a"``).

    Raises
    ------
    ValueError
        For a token that names no row (the message lists the valid ones).
    """
    labels = {row.split()[0]: row for row in ROWS}
    chosen = set()
    for token in tokens:
        found = [row for label, row in labels.items() if label == token or label.rstrip("abcd") == token]
        if not found:
            raise ValueError(f"{token!r} names no certificate; use a proposition number "
                             f"({', '.join(sorted({label.rstrip('abcd') for label in labels}))}) or a row label "
                             f"({', '.join(labels)})")
        chosen.update(found)
    return tuple(row for row in ROWS if row in chosen)


def run_certificates(columns: Sequence[OptimizerColumn] | None = None, *, seed: int = 0,
                     steps: int = DEFAULT_STEPS, other_steps: int = DEFAULT_OTHER_STEPS,
                     long_run_columns: Sequence[str] = LONG_RUN_COLUMNS,
                     progress: Callable[[str], None] | None = None,
                     rows: Sequence[str] | None = None, threads: int | None = 1,
                     detail: Callable[[str], None] | None = None) -> list[Certificate]:
    """Every certificate (rows :data:`ROWS`) for every column, in row-major order.

    Parameters
    ----------
    columns : sequence of OptimizerColumn, optional
        Defaults to :func:`~.optimizers.default_columns`.
    seed : int
        Seed of every random draw (frames, gradients, losses, orthogonal matrices).
    steps : int
        Length of the drift run (3a-3c) for the columns named in ``long_run_columns``.
    other_steps : int
        Length of the drift run for every other column.
    long_run_columns : sequence of str, default LONG_RUN_COLUMNS
        Names of the columns whose drift run has ``steps`` steps.
    progress : callable, optional
        Called with the name of each column before it is certified (the CLI reports progress with it).
    rows : sequence of str, optional
        Only these rows of :data:`ROWS` (:func:`select_rows` turns ``--only 5 6`` into them); the work of the
        other rows is skipped. Default: every row.
    threads : int or None, default 1
        ``torch.set_num_threads`` for the run, the caller's count restored afterwards (``stiefel-attention certify
        --threads``); ``None`` keeps the caller's count. One thread is the default because every matrix is tiny:
        intra-op threads only add synchronisation (100x slower on a busy machine). A figure at rounding level may
        change in its last bits with the count (the order of a reduction); the tolerances are far above rounding,
        so no outcome does.
    detail : callable, optional
        Called within a column's drift runs, after each chunk of 500 steps, with a line saying how far the run
        is (e.g. ``"StiefelAdam: drift run (float64), 500/2000 steps"``); the CLI prints some of them as progress.

    Returns
    -------
    list of Certificate
        One per (row, column), ordered by row, then column.
    """
    columns = list(default_columns() if columns is None else columns)
    if steps < 1 or other_steps < 1:
        raise ValueError(f"run_certificates: steps={steps} and other_steps={other_steps} must be >= 1.")
    unknown = [] if rows is None else [row for row in rows if row not in ROWS]
    if unknown or (rows is not None and not rows):
        raise ValueError(f"run_certificates: rows {unknown or '(none)'} are not rows of the table; choose from ROWS "
                         f"(or None for every row).")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"run_certificates: threads={threads!r} is invalid; pass an int >= 1 or None (keep the "
                         f"caller's torch.get_num_threads()).")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(columns, seed=seed, steps=steps, other_steps=other_steps, long_run_columns=long_run_columns,
                    progress=progress, rows=ROWS if rows is None else tuple(rows), detail=detail)
    finally:
        torch.set_num_threads(previous)


def _drift_reporter(detail: Callable[[str], None] | None, column: str, dtype: torch.dtype):
    """``run_drift``'s ``progress(done, total)`` as a line to ``detail`` (``None`` without ``detail``)."""
    if detail is None:
        return None
    name = str(dtype).replace("torch.", "")
    return lambda done, total: detail(f"{column}: drift run ({name}), {done}/{total} steps")


def _run(columns, *, seed, steps, other_steps, long_run_columns, progress, rows, detail) -> list[Certificate]:
    gauge_cache: dict[bool, list[Certificate]] = {}
    cells: dict[tuple[str, str], Certificate] = {}

    def wanted(*labels: str) -> bool:  # is any row starting with one of these labels selected?
        return any(row.split()[0] in labels for row in rows)

    for column in columns:
        if progress is not None:
            progress(column.name)
        found = []
        if wanted("1a", "1b", "1c", "1d"):
            found += [
                steepest.certify_projection(column, seed=seed),
                steepest.certify_step_direction(column, seed=seed),
                steepest.certify_first_step(column, seed=seed),
                steepest.certify_retraction_order(column, seed=seed),
            ]
        if wanted("2a", "2b"):
            found += [scale.certify_scale_invariance(column, seed=seed), scale.certify_scale_with_eps(column, seed=seed)]
        if wanted(*DRIFT_ROWS):
            n = steps if column.name in long_run_columns else other_steps
            runs = [conditioning.run_drift(column, steps=n, dtype=dt, seed=seed,
                                           progress=_drift_reporter(detail, column.name, dt))
                    for dt in (torch.float64, torch.float32)]
            found.append(conditioning.certify_conditioning(column, runs))
            found.extend(conditioning.certify_drift(column, run) for run in runs)
        if wanted("4a", "4b"):
            found.append(equivariance.certify_equivariance(column, "left", seed=seed))
            found.append(equivariance.certify_equivariance(column, "right", seed=seed))
        if wanted("5", "5a", "5b", "5c", "5d"):
            found.extend([
                weight_decay.certify_decay_gradient(column, seed=seed),
                weight_decay.certify_coupled_decay(column, seed=seed),
                weight_decay.certify_point_decay(column, seed=seed),
                weight_decay.certify_decay_in_retraction(column, seed=seed),
                weight_decay.certify_decay_training(column, seed=seed),
            ])
        if wanted("6a", "6b"):
            if column.on_manifold not in gauge_cache:
                gauge_cache[column.on_manifold] = gauge.certify_gauge(column, seed=seed)
            for cert in gauge_cache[column.on_manifold]:
                found.append(Certificate(cert.name, cert.statement, cert.measured, cert.tolerance, cert.passed,
                                         cert.details, column.name, cert.comparison))
        for cert in found:
            cells[(cert.name, column.name)] = cert
    return [cells[(row, column.name)] for row in rows for column in columns if (row, column.name) in cells]
