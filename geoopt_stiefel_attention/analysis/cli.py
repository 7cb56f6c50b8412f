"""``stiefel-attention certify``: certify the propositions numerically against stock optimizers."""

from __future__ import annotations

import argparse

from .._docfrag import fill
from ..argtypes import UsageError, add_threads_argument, output_path_problem, positive_int, seed_int

HELP = ("Certify the five propositions and the gauge negative result numerically (float64) for StiefelAdam "
        "and stock optimizers, and manifold Muon's properties for StiefelMuon beside torch's Muon, StiefelAdam "
        "and geoopt; print the two tables.")


#: What ``--threads`` does here: both tables' certificates run with it.
THREADS_HELP = ("torch.set_num_threads for the certificates of both tables (default 1: the matrices are tiny, and "
                "one thread is fastest and steadiest on a shared machine)")


class _Given(argparse.Action):
    """Stores the value as ``store`` does, and records the flag in ``namespace._given``: a run-length flag that the
    selected tables do not read is refused when it is given at all, even at its default value
    (:func:`_refuse_unread_lengths`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace._given = (*getattr(namespace, "_given", ()), self.option_strings[0])


#: The exit statuses of ``certify``, also the end of its ``--help``.
EXIT_STATUS_HELP = ("Exit status: 0 when every certificate of StiefelAdam (main table) and StiefelMuon (default and "
                    "solved settings, Muon table) that was computed passed (FAIL cells of the other columns are "
                    "baselines, shown for contrast, and do not count); 1 when one of them failed; 2 for a usage "
                    "error (nothing computed). The last line printed says which (the verdict).")

#: Measured CPU time (user + sys, ``/usr/bin/time``) of ``certify`` by default and with ``--full``, one after the
#: other on the project's 2-core x86-64 machine under a load of about 10 (torch 2.14.1, ``--threads 1``; 70 s and
#: 198 s of wall time). On that machine idle, the full-length table took 34 s of CPU time and as long on the clock.
DEFAULT_CPU_S, FULL_CPU_S = 16, 44

#: Within a long section, a line of progress (a drift run's steps) is printed at most this often, in seconds.
DETAIL_EVERY_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .muon import DEFAULT_MUON_STEPS, FULL_MUON_STEPS
    from .suite import DEFAULT_OTHER_STEPS, DEFAULT_STEPS, FULL_OTHER_STEPS, FULL_STEPS

    parser.epilog = EXIT_STATUS_HELP
    parser.add_argument("--json", metavar="PATH", help="also write one JSON object per table cell to PATH (its "
                                                       "folder must exist)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown to PATH (its folder "
                                                           "must exist)")
    parser.add_argument("--seed", type=seed_int, default=0,
                        help="seed of every random draw, 0 to 2**64 - 1 (default 0)")
    parser.add_argument("--full", action="store_true",
                        help=f"the full-length drift runs: --steps {FULL_STEPS}, --other-steps {FULL_OTHER_STEPS}, "
                             f"--muon-steps {FULL_MUON_STEPS}; about {FULL_CPU_S / DEFAULT_CPU_S:.1f} times the "
                             f"default's time (measured on 2 loaded cores: about {FULL_CPU_S} s of CPU time against "
                             f"{DEFAULT_CPU_S} s by default). A length flag given with it still wins")
    parser.add_argument("--steps", type=positive_int, default=None, action=_Given,
                        help=f"steps of StiefelAdam's drift/conditioning run, in float64 and float32 "
                             f"(default {DEFAULT_STEPS}, {FULL_STEPS} with --full)")
    parser.add_argument("--other-steps", type=positive_int, default=None, action=_Given,
                        help=f"steps of the drift run for every other optimizer (default {DEFAULT_OTHER_STEPS}, "
                             f"{FULL_OTHER_STEPS} with --full)")
    parser.add_argument("--muon-steps", type=positive_int, default=None, action=_Given,
                        help=f"steps of the Muon table's drift runs, rows M4 and M5 (default {DEFAULT_MUON_STEPS}, "
                             f"{FULL_MUON_STEPS} with --full)")
    parser.add_argument("--optimizers", nargs="+", metavar="NAME",
                        help="only these columns (full names or short labels, e.g. StiefelAdam geoopt-radam AdamW; "
                             "StiefelMuon 'torch Muon' 'SM msign' for the Muon table, which is run only when one of "
                             "its Muon columns is named)")
    parser.add_argument("--only", nargs="+", metavar="N",
                        help="only these propositions: numbers 1-6 (all their rows, e.g. --only 5 6) or row labels "
                             "(e.g. 3a 5d); M for every row of the Muon table or its row labels (e.g. M1 M8)")
    parser.add_argument("--quiet", action="store_true",
                        help="print the table and the verdict only (no legend, findings or progress)")
    add_threads_argument(parser, help=THREADS_HELP)


@fill
def run_lengths(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(steps, other_steps, muon_steps)`` of a parsed ``certify`` command line: each length flag given wins;
    the others are the defaults, or the full-table lengths with ``--full``.

    {{parameters_args}}

    Returns
    -------
    tuple of int
        The drift-run lengths of StiefelAdam (3a-3c), of the other main-table columns, and of the Muon table.
    """
    from .muon import DEFAULT_MUON_STEPS, FULL_MUON_STEPS
    from .suite import DEFAULT_OTHER_STEPS, DEFAULT_STEPS, FULL_OTHER_STEPS, FULL_STEPS

    full = bool(getattr(args, "full", False))
    pick = [(args.steps, DEFAULT_STEPS, FULL_STEPS), (args.other_steps, DEFAULT_OTHER_STEPS, FULL_OTHER_STEPS),
            (args.muon_steps, DEFAULT_MUON_STEPS, FULL_MUON_STEPS)]
    steps, other, muon = (given if given is not None else (long if full else short) for given, short, long in pick)
    return steps, other, muon


def _select_columns(names):
    """(main-table columns, Muon-table columns) that ``names`` select; every column of both when ``names`` is
    None. The Muon table is run only when ``names`` includes a column of its own (one that is not in the main
    table: StiefelMuon, torch's Muon), and then holds every named column it has."""
    from .muon import muon_column_by_name, muon_columns
    from .optimizers import column_by_name, default_columns

    if not names:
        return list(default_columns()), list(muon_columns())
    main, muon, unknown = [], [], []
    for name in names:
        found = False
        try:
            main.append(column_by_name(name))
            found = True
        except KeyError:
            pass
        try:
            muon.append(muon_column_by_name(name))
            found = True
        except KeyError:
            pass
        if not found:
            unknown.append(name)
    if unknown:
        # a column of both tables (StiefelAdam) is listed once
        choices = list(dict.fromkeys([c.name for c in default_columns()] + [c.name for c in muon_columns()]))
        raise UsageError(f"--optimizers: No optimizer column named {unknown[0]!r}; choose one of {choices}.")
    for columns in (main, muon):
        named = [c.name for c in columns]
        twice = next((n for n in named if named.count(n) > 1), None)
        if twice is not None:
            raise UsageError(f"--optimizers: {' '.join(map(repr, names))} names the column {twice!r} twice (by its "
                             f"name or its label); list each column once.")
    main_names = {c.name for c in default_columns()}
    if not any(c.name not in main_names for c in muon):
        muon = []
    return main, muon


def _is_muon_token(token: str) -> bool:
    """Whether an ``--only`` token names rows of the Muon table (``M`` or a row label ``M1``-``M8``)."""
    from .muon import MUON_ROWS

    return token == "M" or token in {row.split()[0] for row in MUON_ROWS}


def _same_file(a: str, b: str) -> bool:
    """Whether two output paths name one file (the same path once resolved, or two links to one file)."""
    import os
    from pathlib import Path

    if Path(a).resolve() == Path(b).resolve():
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def _refuse_dropped(names, tokens, main_columns, muon_columns) -> None:
    """A :class:`UsageError` for the first column of ``--optimizers`` (``names``) or row of ``--only``
    (``tokens``) that no table being computed holds: a Muon column with no M row asked for, a main-table column
    with only M rows, an M row with no Muon column of its own named, a main-table row with only Muon columns."""
    from .muon import muon_column_by_name
    from .muon import muon_columns as all_muon_columns
    from .optimizers import column_by_name

    def resolves(lookup, name) -> bool:
        try:
            lookup(name)
        except KeyError:
            return False
        return True

    for name in names:
        in_main, in_muon = resolves(column_by_name, name), resolves(muon_column_by_name, name)
        if (in_main and main_columns) or (in_muon and muon_columns):
            continue
        table = "the Muon table" if in_muon and not in_main else "the main table"
        rows = "an M row (M, or M1-M8)" if table == "the Muon table" else "a row of its own (1-6, e.g. 1a)"
        raise UsageError(f"--optimizers/--only: {name!r} is a column of {table} only, and --only names no row of "
                         f"it; add {rows} to --only, or leave {name!r} out of --optimizers")
    main_names = {c.name for c in main_columns}
    own = [c.name for c in all_muon_columns() if not resolves(column_by_name, c.name)]
    for token in tokens:
        if _is_muon_token(token) and not muon_columns:
            raise UsageError(f"--optimizers/--only: {token} is a row of the Muon table, which runs only when "
                             f"--optimizers names one of its own columns ({', '.join(own)}); add one, or leave "
                             f"{token} out of --only")
        if not _is_muon_token(token) and not main_names:
            raise UsageError(f"--optimizers/--only: {token} is a row of the main table, and --optimizers names none "
                             f"of its columns; add one (e.g. StiefelAdam), or leave {token} out of --only")


def _refuse_unread_lengths(given, rows, main_columns, muon_rows, muon_columns) -> None:
    """A :class:`UsageError` for the first of ``--steps``, ``--other-steps``, ``--muon-steps``, ``--full`` given on
    the command line (``given``) that no certificate being computed reads: ``--steps`` is the drift run of
    StiefelAdam (rows 3a-3c), ``--other-steps`` that of every other main-table column, ``--muon-steps`` the Muon
    table's rows M4 and M5, ``--full`` all three."""
    from .muon import MUON_ROWS
    from .suite import DRIFT_ROWS, LONG_RUN_COLUMNS

    if not main_columns:
        no_drift = "the main table is not computed"
    elif rows is not None and not any(row.split()[0] in DRIFT_ROWS for row in rows):
        no_drift = "--only names none of the drift rows 3a-3c"
    else:
        no_drift = None
    if not muon_columns:
        no_muon_drift = "the Muon table is not computed (--optimizers names none of its own columns)"
    elif muon_rows is not None and not any(row in MUON_ROWS[3:5] for row in muon_rows):
        no_muon_drift = "--only names neither of the Muon table's drift rows M4 and M5"
    else:
        no_muon_drift = None
    long_run = ", ".join(LONG_RUN_COLUMNS)
    unread = {
        "--steps": no_drift or (None if any(c.name in LONG_RUN_COLUMNS for c in main_columns) else
                                f"it is the length of {long_run}'s drift run, and --optimizers leaves {long_run} out"),
        "--other-steps": no_drift or (None if any(c.name not in LONG_RUN_COLUMNS for c in main_columns) else
                                      f"it is the length of the drift run of the columns other than {long_run}, "
                                      f"and --optimizers names none"),
        "--muon-steps": no_muon_drift,
        "--full": no_drift and no_muon_drift and (f"it sets the lengths of the drift runs, and {no_drift}, and "
                                                  f"{no_muon_drift}"),
    }
    for flag in given:
        if unread.get(flag):
            raise UsageError(f"{flag}: nothing this command computes reads it: {unread[flag]}; leave {flag} out, "
                             f"or select what it is for")


def _refuse_bad_outputs(args: argparse.Namespace) -> None:
    """A :class:`UsageError` for a ``--json`` or ``--markdown`` path that cannot be written, or for both naming one
    file; checked before the tables are computed."""
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        problem = None if path is None else output_path_problem(path, folder=False)
        if problem is not None:
            raise UsageError(f"{flag} {path}: {problem}")
    if args.json is not None and args.markdown is not None and _same_file(args.json, args.markdown):
        raise UsageError(f"--json {args.json} and --markdown {args.markdown} name the same file, so the Markdown "
                         f"would overwrite the JSON; pass two different paths")


def _select_rows(only):
    """``(rows, muon_rows)`` that ``--only`` (``only``) selects: ``None`` for every row of a table when ``only`` is
    None, ``()`` for a table none of whose rows it names."""
    from . import muon as muon_certificates
    from . import suite

    if only is None:
        return None, None
    if len(set(only)) != len(only):
        raise UsageError(f"--only {' '.join(only)}: names a row twice; list each once")
    muon_rows = muon_certificates.select_muon_rows(only)
    main_tokens = [t for t in only if not _is_muon_token(t)]
    try:
        rows = suite.select_rows(main_tokens) if main_tokens else ()
    except ValueError as err:
        raise UsageError(f"--only: {err}; M or M1-M8 for the Muon table") from None
    return rows, muon_rows or ()


def _reporters(quiet: bool):
    """``(progress, detail)``: the callbacks that print a line of progress to stderr (none when ``quiet``), a
    section's name when it starts and, within one, a line when the last is :data:`DETAIL_EVERY_S` old."""
    import sys
    import time

    last_line = [time.perf_counter()]

    def progress(name: str) -> None:
        if not quiet:
            print(f"  certifying {name} ...", file=sys.stderr, flush=True)
            last_line[0] = time.perf_counter()

    def detail(text: str) -> None:  # within a column: a line when the last one is DETAIL_EVERY_S old
        if not quiet and time.perf_counter() - last_line[0] >= DETAIL_EVERY_S:
            print(f"    {text}", file=sys.stderr, flush=True)
            last_line[0] = time.perf_counter()

    return progress, detail


def _drift_note(certs, main_columns, steps: int, other_steps: int) -> str:
    """The heading's note on the main table's drift-run lengths; empty when no drift row was computed."""
    from . import suite

    if not (certs and any(c.name.split()[0] in suite.DRIFT_ROWS for c in certs)):
        return ""
    lengths = sorted({steps if c.name in suite.LONG_RUN_COLUMNS else other_steps for c in main_columns})
    return (f"; drift runs 3a-3c of {steps:,} steps for StiefelAdam and {other_steps:,} for the others"
            if len(lengths) > 1 else f"; drift runs 3a-3c of {lengths[0]:,} steps")


def _tables(certs, muon_certs, main_columns, muon_columns, muon_steps: int, quiet: bool):
    """``(blocks, markdown)``: the text of each computed table (legend and notes unless ``quiet``; the Muon table
    under its heading) and its Markdown."""
    from . import table

    labels = {c.name: c.label for c in main_columns}
    muon_labels = {c.name: c.short for c in muon_columns}
    muon_described = {c.name: c.description for c in muon_columns}
    ours_muon = table.OUR_MUON_COLUMN
    blocks, markdown = [], []
    if certs:
        blocks.append(table.format_text(certs, labels, legend=not quiet, notes=not quiet))
        markdown.append(table.format_markdown(certs, labels))
    if muon_certs:
        from .muon import DIRECTION_SHAPES

        also = ", ".join(f"{d}x{r}" for _, d, r in DIRECTION_SHAPES[1:])
        heading = (f"Manifold Muon (StiefelMuon): a stack of 3 frames of St(12, 4) (rows M1-M3 also {also}), float64 "
                   f"unless stated, drift runs of {muon_steps:,} steps:")
        blocks.append(("" if quiet else heading + "\n\n")
                      + table.format_text(muon_certs, muon_labels, legend=not quiet, notes=not quiet,
                                          descriptions=muon_described, ours=ours_muon))
        markdown.append(f"**{heading}**\n\n" + table.format_markdown(muon_certs, muon_labels,
                                                                       descriptions=muon_described, ours=ours_muon))
    return blocks, markdown


def run(args: argparse.Namespace) -> int:
    import time
    import warnings
    from pathlib import Path

    import torch

    from . import muon as muon_certificates
    from . import suite, table

    main_columns, muon_columns = _select_columns(args.optimizers)
    muon_columns.sort(key=lambda c: c.name != table.OUR_MUON_COLUMN)  # ours first, the rest in their order
    _refuse_bad_outputs(args)  # before the table is computed
    rows, muon_rows = _select_rows(args.only)
    if rows == ():
        main_columns = []
    if muon_rows == ():
        muon_columns = []
    if not main_columns and not muon_columns:
        raise UsageError("--optimizers/--only: no table left to compute (the Muon table needs a Muon column and an "
                         "M row; the main table a column and a row of its own)")
    _refuse_dropped(args.optimizers or [], args.only or [], main_columns, muon_columns)
    given = (*getattr(args, "_given", ()), *(("--full",) if getattr(args, "full", False) else ()))
    _refuse_unread_lengths(given, rows, main_columns, muon_rows, muon_columns)
    steps, other_steps, muon_steps = run_lengths(args)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    progress, detail = _reporters(args.quiet)
    certs, muon_certs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if main_columns:
            certs = suite.run_certificates(main_columns, seed=args.seed, steps=steps, other_steps=other_steps,
                                           progress=progress, rows=rows, threads=args.threads, detail=detail)
        if muon_columns:
            muon_certs = muon_certificates.run_muon_certificates(muon_columns, seed=args.seed,
                                                                 drift_steps=muon_steps, progress=progress,
                                                                 rows=muon_rows, threads=args.threads,
                                                                 detail=detail)
    elapsed = time.perf_counter() - start
    if not args.quiet:
        print(f"Certificates, seed {args.seed}, float64 unless stated "
              f"({len(certs) + len(muon_certs)} cells in {elapsed:.1f} s"
              f"{_drift_note(certs, main_columns, steps, other_steps)}):\n")
    blocks, markdown = _tables(certs, muon_certs, main_columns, muon_columns, muon_steps, args.quiet)
    print("\n\n".join(blocks))
    everything = certs + muon_certs
    for path, text in ((args.json, table.to_json(everything) + "\n"), (args.markdown, "\n".join(markdown))):
        if path:  # its folder exists: checked before the tables were computed
            Path(path).write_text(text)
    line, passed = table.verdict(everything)
    print("\n" + line, flush=True)
    return 0 if passed else 1
