"""``stiefel-attention certify``: certify the propositions numerically against stock optimizers."""

from __future__ import annotations

import argparse

from .._argtypes import UsageError, add_threads_argument, nonnegative_int, output_path_problem, positive_int

HELP = ("Certify the five propositions and the gauge negative result numerically (float64) for StiefelAdam "
        "and stock optimizers; print the table.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .suite import DEFAULT_OTHER_STEPS, DEFAULT_STEPS

    parser.add_argument("--json", metavar="PATH", help="also write one JSON object per table cell to PATH")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown to PATH")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="seed of every random draw (default 0)")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS,
                        help=f"steps of StiefelAdam's drift/conditioning run, in float64 and float32 "
                             f"(default {DEFAULT_STEPS})")
    parser.add_argument("--other-steps", type=positive_int, default=DEFAULT_OTHER_STEPS,
                        help=f"steps of the drift run for every other optimizer (default {DEFAULT_OTHER_STEPS})")
    parser.add_argument("--optimizers", nargs="+", metavar="NAME",
                        help="only these columns (full names or short labels, e.g. StiefelAdam geoopt-radam AdamW)")
    parser.add_argument("--only", nargs="+", metavar="N",
                        help="only these propositions: numbers 1-6 (all their rows, e.g. --only 5 6) or row labels "
                             "(e.g. 3a 5d)")
    parser.add_argument("--quiet", action="store_true", help="print the table only (no legend, findings or progress)")
    add_threads_argument(parser)


def run(args: argparse.Namespace) -> int:
    import sys
    import time
    import warnings
    from pathlib import Path

    import torch

    from . import table
    from .optimizers import column_by_name, default_columns
    from .suite import run_certificates, select_rows

    try:
        columns = [column_by_name(n) for n in args.optimizers] if args.optimizers else list(default_columns())
    except KeyError as err:
        raise UsageError(f"--optimizers: {err.args[0]}") from None
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):  # before the table is computed
        problem = None if path is None else output_path_problem(path, folder=False)
        if problem is not None:
            raise UsageError(f"{flag} {path}: {problem}")
    try:
        rows = None if args.only is None else select_rows(args.only)
    except ValueError as err:
        raise UsageError(f"--only: {err}") from None
    torch.set_num_threads(args.threads)  # tiny matrices: one thread is fastest
    start = time.perf_counter()

    def progress(name: str) -> None:
        if not args.quiet:
            print(f"  certifying {name} ...", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        certs = run_certificates(columns, seed=args.seed, steps=args.steps, other_steps=args.other_steps,
                                 progress=progress, rows=rows)
    elapsed = time.perf_counter() - start
    labels = {c.name: c.label for c in columns}
    if not args.quiet:
        print(f"Certificates of the propositions, seed {args.seed}, float64 unless stated "
              f"({len(certs)} cells in {elapsed:.1f} s):\n")
    print(table.format_text(certs, labels, legend=not args.quiet, notes=not args.quiet))
    for path, text in ((args.json, table.to_json(certs) + "\n"), (args.markdown, table.format_markdown(certs, labels))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    failed = table.stiefel_adam_failures(certs)
    if failed:
        print("\nStiefelAdam FAILED: " + ", ".join(c.name for c in failed), file=sys.stderr)
        return 1
    return 0
