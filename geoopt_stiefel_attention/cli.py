"""The ``stiefel-attention`` command.

Each subcommand lives in its own module, which provides ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int`` (the exit status). Modules import their heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand name -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "demo": "geoopt_stiefel_attention.demo",
    "bench": "geoopt_stiefel_attention.bench",
    "certify": "geoopt_stiefel_attention.analysis.cli",
    "grokking": "geoopt_stiefel_attention.experiments.grokking",
    "vision": "geoopt_stiefel_attention.experiments.vision",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stiefel-attention`` with every registered subcommand."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="stiefel-attention",
        description="Stiefel-constrained attention: train, certify, benchmark and reproduce experiments.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stiefel-attention`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
