"""Argument types and the usage error shared by the command-line subcommands.

Each type is an ``argparse`` ``type=`` callable: a bad value makes argparse print one ``error:`` line that
names the flag and exit with status 2 (no traceback). :class:`UsageError` does the same for checks that
involve several flags and can only run after parsing: a subcommand raises it, and
:func:`geoopt_stiefel_attention.cli.main` prints it as one line and returns 2. :func:`output_path_problem`
says why an output path cannot be written, so that a command checks its output flags before it starts any work.
This module imports nothing of the package, so that the CLI and the studies can both import it. It is public so
that the studies (``python -m experiments``) and users' own scripts build command lines that fail the same way.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

__all__ = ["UsageError", "OneLineParser", "positive_int", "nonnegative_int", "positive_float", "seed_int",
           "thread_count", "add_threads_argument", "output_path_problem", "THREADS_MAX", "SEED_MAX"]

_TYPE_DOC = """

    Parameters
    ----------
    text : str
        The flag's value as typed.

    Returns
    -------
    {kind}
        The value.

    Raises
    ------
    argparse.ArgumentTypeError
        For any other value: argparse then prints one line naming the flag and exits with status 2.
    """


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1, as an ``argparse`` ``type=``."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


#: The most threads ``--threads`` takes. Far beyond any CPU's count; asking torch for many more made it start
#: threads until the process ran out of memory maps and failed later with a traceback (``--threads 100000``).
THREADS_MAX = 1024


def thread_count(text: str) -> int:
    """A thread count: an integer from 1 to :data:`THREADS_MAX`, as an ``argparse`` ``type=``."""
    value = positive_int(text)
    if value > THREADS_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {THREADS_MAX}, got {value}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser, default: int | None = 1, *,
                         help: str | None = None) -> None:  # noqa: A002 - argparse's own name
    """``--threads N``: ``torch.set_num_threads`` for the command, the same flag on every subcommand.

    The default is one thread: the library's commands work on small matrices, where intra-op threads mostly
    add synchronisation, and on a shared, loaded machine they can make a command many times slower (measured:
    ``demo`` 5 min 54 s with torch's default thread count on a loaded 2-core machine, 8.2 s with one thread).
    A command where part of the work keeps its own thread count passes ``help`` saying exactly what the flag does.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The command's parser.
    default : int or None, default 1
        The thread count without the flag (``None``: torch's own choice).
    help : str, optional
        The flag's help text (default: the sentence above).
    """
    where = "torch's own choice" if default is None else f"{default}"
    parser.add_argument("--threads", type=thread_count, default=default,
                        help=help or f"torch.set_num_threads for the command (default {where}; one thread is "
                                     f"fastest for small matrices and steadiest on a shared machine)")


def nonnegative_int(text: str) -> int:
    """An integer >= 0, as an ``argparse`` ``type=``."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


#: The largest seed ``torch.manual_seed`` and ``torch.Generator.manual_seed`` take: an unsigned 64-bit integer
#: (one more raises ``ValueError: Overflow when unpacking long long`` inside the command).
SEED_MAX = 2**64 - 1


def seed_int(text: str) -> int:
    """A seed: an integer from 0 to :data:`SEED_MAX` (torch's range), checked before any work is done, as an
    ``argparse`` ``type=``."""
    value = _int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**64 - 1 = {SEED_MAX} (the seeds torch "
                                         f"takes), got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0, as an ``argparse`` ``type=``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class UsageError(ValueError):
    """A user error on the command line: :func:`~geoopt_stiefel_attention.cli.main` prints it as one line
    (``stiefel-attention <command>: error: <message>``, naming the flag) and returns exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (a value of the wrong type, a missing value, an unknown flag or choice) are
    one line, ``<prog>: error: argument --flag: ...``, with exit status 2 and no usage block: the same form as
    every other usage error of the commands (:class:`UsageError`). Its subcommands' parsers are of this class too
    (``add_subparsers`` makes them of the parent's class). ``stiefel-attention`` and ``python -m experiments``
    both parse with it.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`argparse.ArgumentParser`, passed on unchanged.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Print ``<prog>: error: <message>`` as one line to stderr and exit with status 2.

        Parameters
        ----------
        message : str
            argparse's description of the error (it names the flag).
        """
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def output_path_problem(path: str | os.PathLike, *, folder: bool) -> str | None:
    """Why ``path`` cannot be written as an output, or ``None`` when it can; creates nothing that stays.

    Parameters
    ----------
    path : str or os.PathLike
        The value of an output flag: a file to write (``folder=False``), whose folder must exist (a mistyped
        folder would otherwise become a new tree without a word), or a folder to create or fill (``folder=True``),
        whose missing parents the command creates with it.
    folder : bool
        Whether ``path`` names a folder rather than a file.

    Returns
    -------
    str or None
        A reason that completes ``"<flag> <path>: "``, ending with the fix, or ``None``.

    Notes
    -----
    Permissions are asked of :func:`os.access` and then tried for real: a folder is created in (and removed
    from) the deepest existing folder on the way, since ``os.access`` answers yes to root on read-only and
    virtual file systems (``/proc``, ``/sys``), where creating anything fails.
    """
    target = Path(path)
    if str(path) == "":
        return "is empty; pass a path."
    if folder and target.exists() and not target.is_dir():
        return "is a file, not a folder; pass a folder (it is created if missing)."
    if not folder and target.is_dir():
        return "is a folder; pass the path of a file to write."
    existing = target if folder else target.parent
    while not existing.exists():
        if existing == existing.parent:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so {'the folder' if folder else 'the file'} cannot be created; pass another path."
    if not folder and existing != target.parent:
        return (f"its folder {target.parent} does not exist; create it first (mkdir -p {target.parent}) or pass a "
                f"path in an existing folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable; pass a path you can write to."
    if not folder and target.exists() and not os.access(target, os.W_OK):
        return "is a read-only file; pass a path you can write to."
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as err:
        return f"nothing can be created in {existing} ({err.strerror}); pass a path you can write to."
    return None


for _fn, _kind in ((positive_int, "int"), (thread_count, "int"), (nonnegative_int, "int"), (seed_int, "int"),
                   (positive_float, "float")):
    _fn.__doc__ = (_fn.__doc__ or "") + _TYPE_DOC.format(kind=_kind)
