"""The command ``python -m experiments <study>``: one subcommand per study, with each study's flags.

Each study module provides ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; errors are
handled as in the ``stiefel-attention`` command (:func:`geoopt_stiefel_attention.cli.run_command`), and argparse's
own errors are one line too (:class:`~experiments.harness.cli_args.OneLineParser`, exit status 2).
"""

from __future__ import annotations

import argparse

from geoopt_stiefel_attention.cli import add_subcommands, parse_command_line, run_command

__all__ = ["PROG", "STUDIES", "build_parser", "main"]

PROG = "python -m experiments"

#: study name -> module implementing it
STUDIES: dict[str, str] = {
    "grokking": "experiments.grokking.study",
    "vision": "experiments.vision.study",
    "lm": "experiments.lm.study",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m experiments`` with every study as a subcommand."""
    from .harness.cli_args import OneLineParser

    parser = OneLineParser(prog=PROG, description="Run, resume or rebuild the report of a study.")
    add_subcommands(parser, STUDIES, metavar="STUDY")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m experiments argv``; returns the exit status (2 for a usage error, 130 for Ctrl-C)."""
    args = parse_command_line(build_parser(), argv)
    return run_command(args._run, args, f"{PROG} {args.command}")
