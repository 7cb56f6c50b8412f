"""Argument types and the usage-error exit shared by the command-line subcommands.

Each type is an ``argparse`` ``type=`` callable: a bad value makes argparse print one ``error:`` line that
names the flag and exit with status 2 (no traceback). :func:`usage_error` does the same for checks that
involve several flags and can only run after parsing.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def usage_error(command: str, message: str) -> NoReturn:
    """Print ``"<command>: error: <message>"`` on stderr and exit with status 2, as argparse does."""
    print(f"{command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
