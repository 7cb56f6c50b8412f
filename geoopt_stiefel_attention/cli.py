"""The ``stiefel-attention`` command.

Each subcommand lives in its own module, which provides ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int`` (the exit status). Modules import their heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .argtypes import OneLineParser, UsageError  # beside the argument types, which the studies import too

__all__ = ["SUBCOMMANDS", "STUDIES", "UsageError", "add_subcommands", "build_parser", "main", "parse_command_line",
           "run_command"]

#: subcommand name -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "demo": "geoopt_stiefel_attention.demo",
    "bench": "geoopt_stiefel_attention.bench.cli",
    "certify": "geoopt_stiefel_attention.analysis.cli",
}

#: the studies, which are not part of the installed package: ``stiefel-attention <study>`` says in one line where
#: they are (``python -m experiments <study>`` from a checkout) and exits with status 2
STUDIES = ("grokking", "vision", "lm")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stiefel-attention`` with every registered subcommand.

    Returns
    -------
    argparse.ArgumentParser
        The parser; each subcommand's namespace carries its ``run`` function.
    """
    from . import __version__

    parser = OneLineParser(
        prog="stiefel-attention",
        description="Stiefel-constrained attention: certify, benchmark and demonstrate the library.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_subcommands(parser, SUBCOMMANDS, metavar="COMMAND")
    return parser


def add_subcommands(parser: argparse.ArgumentParser, modules: dict[str, str], *, metavar: str) -> None:
    """One required subcommand per ``name -> module`` of ``modules``; each module provides ``HELP`` (one line),
    ``add_arguments(parser)`` and ``run(args) -> int`` (shared by ``python -m experiments``).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The parser to add the subcommands to.
    modules : dict of str to str
        Subcommand name to the import path of its module.
    metavar : str
        How the subcommand is shown in the usage line (e.g. ``"COMMAND"``).
    """
    sub = parser.add_subparsers(dest="command", metavar=metavar)
    sub.required = True
    for name, module_name in modules.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run, _parser=sp)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stiefel-attention`` console script; returns the exit status (see :func:`run_command`).

    The studies are not subcommands: ``stiefel-attention grokking`` (or ``vision``, ``lm``) prints one line saying
    to run ``python -m experiments grokking`` from a checkout of the repository, and exits with status 2.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after the program name; ``None`` (the default) reads ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in STUDIES:
        print(f"stiefel-attention {argv[0]}: error: the studies are not part of the installed package; from a "
              f"checkout of the repository run `python -m experiments {argv[0]} ...` (same flags).", file=sys.stderr)
        return 2
    args = parse_command_line(build_parser(), argv)
    return run_command(args._run, args, f"stiefel-attention {args.command}")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` of a parser built by :func:`add_subcommands`, except that an unknown flag is
    reported by the subcommand's parser (``stiefel-attention demo: error: unrecognized arguments: --bogus``), not
    by the top-level one, which argparse would name instead.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The top-level parser, with subcommands from :func:`add_subcommands`.
    argv : list of str or None
        The arguments after the program name (``None``: ``sys.argv[1:]``).

    Returns
    -------
    argparse.Namespace
        The parsed arguments, with the subcommand's ``_run`` and ``_parser``.
    """
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def run_command(run, args: argparse.Namespace, prog: str) -> int:
    """``run(args)``'s exit status, with the user's errors said in one line and no traceback.

    A :class:`UsageError` is printed as ``<prog>: error: ...`` and gives exit status 2, like argparse's own
    errors; Ctrl-C gives one line saying how to resume and exit status 130; a closed output pipe (``| head``)
    gives 0. ``python -m experiments`` runs its studies through the same function.

    Parameters
    ----------
    run : callable
        ``run(args) -> int or None`` (``None`` is status 0): a subcommand's ``run``.
    args : argparse.Namespace
        The parsed arguments, passed to ``run``.
    prog : str
        The program name that begins an error line, e.g. ``"stiefel-attention bench"``.

    Returns
    -------
    int
        The exit status.
    """
    try:
        return int(run(args) or 0)
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the output was piped into a command that stopped reading (``| head``)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as err:
        message = str(err) or "interrupted; rerun the same command to resume from the last checkpoint."
        print(f"{prog}: {message}", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
