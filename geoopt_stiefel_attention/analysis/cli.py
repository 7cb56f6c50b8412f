"""``stiefel-attention certify``: certify the propositions numerically against stock optimizers."""

from __future__ import annotations

import argparse

from .._argtypes import UsageError, add_threads_argument, output_path_problem, positive_int, seed_int

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .muon import DEFAULT_MUON_STEPS
    from .suite import DEFAULT_OTHER_STEPS, DEFAULT_STEPS

    parser.add_argument("--json", metavar="PATH", help="also write one JSON object per table cell to PATH")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown to PATH")
    parser.add_argument("--seed", type=seed_int, default=0,
                        help="seed of every random draw, 0 to 2**64 - 1 (default 0)")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, action=_Given,
                        help=f"steps of StiefelAdam's drift/conditioning run, in float64 and float32 "
                             f"(default {DEFAULT_STEPS})")
    parser.add_argument("--other-steps", type=positive_int, default=DEFAULT_OTHER_STEPS, action=_Given,
                        help=f"steps of the drift run for every other optimizer (default {DEFAULT_OTHER_STEPS})")
    parser.add_argument("--muon-steps", type=positive_int, default=DEFAULT_MUON_STEPS, action=_Given,
                        help=f"steps of the Muon table's drift runs, rows M4 and M5 (default {DEFAULT_MUON_STEPS})")
    parser.add_argument("--optimizers", nargs="+", metavar="NAME",
                        help="only these columns (full names or short labels, e.g. StiefelAdam geoopt-radam AdamW; "
                             "StiefelMuon 'torch Muon' 'SM msign' for the Muon table, which is run only when one of "
                             "its Muon columns is named)")
    parser.add_argument("--only", nargs="+", metavar="N",
                        help="only these propositions: numbers 1-6 (all their rows, e.g. --only 5 6) or row labels "
                             "(e.g. 3a 5d); M for every row of the Muon table or its row labels (e.g. M1 M8)")
    parser.add_argument("--quiet", action="store_true", help="print the table only (no legend, findings or progress)")
    add_threads_argument(parser, help=THREADS_HELP)


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
    """A :class:`UsageError` for the first of ``--steps``, ``--other-steps``, ``--muon-steps`` given on the command
    line (``given``) that no certificate being computed reads: ``--steps`` is the drift run of StiefelAdam
    (rows 3a-3c), ``--other-steps`` that of every other main-table column, ``--muon-steps`` the Muon table's
    rows M4 and M5."""
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
    }
    for flag in given:
        if unread.get(flag):
            raise UsageError(f"{flag}: nothing this command computes reads it: {unread[flag]}; leave {flag} out, "
                             f"or select what it is for")


def run(args: argparse.Namespace) -> int:
    import sys
    import time
    import warnings
    from pathlib import Path

    import torch

    from . import muon as muon_certificates
    from . import suite, table

    main_columns, muon_columns = _select_columns(args.optimizers)
    muon_columns.sort(key=lambda c: c.name != table.OUR_MUON_COLUMN)  # ours first, the rest in their order
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):  # before the table is computed
        problem = None if path is None else output_path_problem(path, folder=False)
        if problem is not None:
            raise UsageError(f"{flag} {path}: {problem}")
    if args.json is not None and args.markdown is not None and _same_file(args.json, args.markdown):
        raise UsageError(f"--json {args.json} and --markdown {args.markdown} name the same file, so the Markdown "
                         f"would overwrite the JSON; pass two different paths")
    rows, muon_rows = None, None
    if args.only is not None and len(set(args.only)) != len(args.only):
        raise UsageError(f"--only {' '.join(args.only)}: names a row twice; list each once")
    if args.only is not None:
        muon_rows = muon_certificates.select_muon_rows(args.only)
        main_tokens = [t for t in args.only if not _is_muon_token(t)]
        try:
            rows = suite.select_rows(main_tokens) if main_tokens else ()
        except ValueError as err:
            raise UsageError(f"--only: {err}; M or M1-M8 for the Muon table") from None
        muon_rows = muon_rows or ()
    if rows == ():
        main_columns = []
    if muon_rows == ():
        muon_columns = []
    if not main_columns and not muon_columns:
        raise UsageError("--optimizers/--only: no table left to compute (the Muon table needs a Muon column and an "
                         "M row; the main table a column and a row of its own)")
    _refuse_dropped(args.optimizers or [], args.only or [], main_columns, muon_columns)
    _refuse_unread_lengths(getattr(args, "_given", ()), rows, main_columns, muon_rows, muon_columns)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def progress(name: str) -> None:
        if not args.quiet:
            print(f"  certifying {name} ...", file=sys.stderr, flush=True)

    certs, muon_certs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if main_columns:
            certs = suite.run_certificates(main_columns, seed=args.seed, steps=args.steps,
                                           other_steps=args.other_steps, progress=progress, rows=rows,
                                           threads=args.threads)
        if muon_columns:
            muon_certs = muon_certificates.run_muon_certificates(muon_columns, seed=args.seed,
                                                                 drift_steps=args.muon_steps, progress=progress,
                                                                 rows=muon_rows, threads=args.threads)
    elapsed = time.perf_counter() - start
    labels = {c.name: c.label for c in main_columns}
    muon_labels = {c.name: c.short for c in muon_columns}
    muon_described = {c.name: c.description for c in muon_columns}
    ours_muon = table.OUR_MUON_COLUMN
    if not args.quiet:
        print(f"Certificates, seed {args.seed}, float64 unless stated "
              f"({len(certs) + len(muon_certs)} cells in {elapsed:.1f} s):\n")
    blocks, markdown = [], []
    if certs:
        blocks.append(table.format_text(certs, labels, legend=not args.quiet, notes=not args.quiet))
        markdown.append(table.format_markdown(certs, labels))
    if muon_certs:
        from .muon import DIRECTION_SHAPES

        also = ", ".join(f"{d}x{r}" for _, d, r in DIRECTION_SHAPES[1:])
        heading = (f"Manifold Muon (StiefelMuon): a stack of 3 frames of St(12, 4) (rows M1-M3 also {also}), float64 "
                   f"unless stated, drift runs of {args.muon_steps} steps:")
        blocks.append(("" if args.quiet else heading + "\n\n")
                      + table.format_text(muon_certs, muon_labels, legend=not args.quiet, notes=not args.quiet,
                                          descriptions=muon_described, ours=ours_muon))
        markdown.append(f"**{heading}**\n\n" + table.format_markdown(muon_certs, muon_labels,
                                                                       descriptions=muon_described, ours=ours_muon))
    print("\n\n".join(blocks))
    everything = certs + muon_certs
    for path, text in ((args.json, table.to_json(everything) + "\n"), (args.markdown, "\n".join(markdown))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    status = 0
    failed = table.stiefel_adam_failures(certs)
    if failed:
        print("\nStiefelAdam FAILED: " + ", ".join(c.name for c in failed), file=sys.stderr)
        status = 1
    failed = table.stiefel_muon_failures(muon_certs)
    if failed:
        print("\nStiefelMuon FAILED: " + ", ".join(f"{c.name} ({c.optimizer})" for c in failed), file=sys.stderr)
        status = 1
    return status
