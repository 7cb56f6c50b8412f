"""Docstring fragments: one text for a parameter or section that several public functions document alike.

A docstring names a fragment on a line of its own, ``{{name}}``; :func:`fill` replaces that line with the fragment,
indented like the placeholder, so the text a reader sees (``help()``, Sphinx, numpydoc) is whole. This is torch's
``_foreach_doc`` practice, with a placeholder that cannot clash with the braces of LaTeX in the maths. A placeholder
that names no fragment raises at import, so a typo cannot reach a rendered page.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

__all__ = ["FRAGMENTS", "fill"]

T = TypeVar("T", bound=Callable)

#: The fragments, by name; each is written at zero indentation.
FRAGMENTS: dict[str, str] = {
    "column": """\
column : OptimizerColumn
    The optimizer and geometry certified.""",
    "seed_random": """\
seed : int, default 0
    Seed of the random frames, gradients and losses.""",
    "returns_certificate": """\
Returns
-------
Certificate
    The certificate of this row for ``column``.""",
    "decay_lambda": """\
decay : float, default 1.0
    The weight decay :math:`\\lambda`.""",
    "scales_c": """\
scales : tuple of float, default SCALES
    The factors :math:`c`.""",
    "steps_each": """\
steps : int, default 50
    Steps of each run.""",
    "lr_plain": """\
lr : float, default 0.05
    Learning rate.""",
    "lr_eta": """\
lr : float, default 0.05
    Learning rate :math:`\\eta`.""",
    "certs_cells": """\
certs : sequence of Certificate
    The cells (:func:`~.suite.run_certificates`, :func:`~.muon.run_muon_certificates`).""",
    "descriptions_ours": """\
descriptions : mapping of str to str, optional
    Column descriptions by column name.
ours : str, default OUR_COLUMN
    Name of the column the findings compare the others with.""",
    "returns_table": """\
Returns
-------
str
    The table, one row per entry of ``results``.""",
    "timing_run": """\
rounds : int
    Interleaved rounds.
clock : {"wall", "cpu"}
    The clock of the timings.
threads : int
    Torch threads during the run.""",
    "parameters_p": """\
Parameters
----------
p : torch.Tensor
    Any tensor or parameter.""",
    "parameters_model": """\
Parameters
----------
model : nn.Module
    Any model.""",
    "parameters_args": """\
Parameters
----------
args : argparse.Namespace
    Parsed by a parser of :func:`add_arguments`.""",
    "point_x": """\
x : torch.Tensor
    Point :math:`X`, a stack of frames of shape ``(..., d, r)``.""",
    "width_dim": """\
width : int
    Size of the parameter along ``dim``.""",
    "returns_groups": """\
Returns
-------
tuple of int
    ``(start, length, groups)``.""",
    "gauge_point": """\
loss_fn : callable
    ``loss_fn(w_q, w_k) -> torch.Tensor``, a scalar loss (e.g. :meth:`AttentionProblem.loss`,
    :func:`loss_from_module`).
w_q, w_k : torch.Tensor
    The point :math:`(W_Q, W_K)`, stacks of shape ``(F, D, C)`` (float64).
frames : bool
    Whether ``w_q``, ``w_k`` are frames (the gauge group is then :math:`O(r)`, :math:`B` skew), or
    unconstrained matrices (:math:`GL(r)`).
head_dim : int, optional
    Columns per head block, dividing ``C``; default ``C`` (one head per frame).""",
}

#: ``column`` and ``seed``, the two parameters most certificates of a column take first, in one fragment.
FRAGMENTS["column_seed"] = f"{FRAGMENTS['column']}\n{FRAGMENTS['seed_random']}"
#: The parameters of the weight-decay certificates that compare a run with decay to the run without it (5a, 5b).
FRAGMENTS["decay_run"] = "\n".join(FRAGMENTS[name] for name in ("column_seed", "steps_each", "lr_eta", "decay_lambda"))

_PLACEHOLDER = re.compile(r"^(?P<indent>[ \t]*)\{\{(?P<name>[a-z_]+)\}\}[ \t]*$", re.M)


def fill(obj: T) -> T:
    """Replace every ``{{name}}`` line of ``obj``'s docstring by :data:`FRAGMENTS` ``[name]``, indented alike.

    Parameters
    ----------
    obj : callable
        A function or class whose ``__doc__`` holds placeholders.

    Returns
    -------
    callable
        ``obj`` itself, its docstring filled.

    Raises
    ------
    KeyError
        A placeholder names no fragment.
    """
    def expand(match: re.Match) -> str:
        name, indent = match["name"], match["indent"]
        if name not in FRAGMENTS:
            raise KeyError(f"{getattr(obj, '__qualname__', obj)}: docstring placeholder {{{{{name}}}}} names no "
                           f"fragment; known: {', '.join(sorted(FRAGMENTS))}")
        return "\n".join(indent + line if line else line for line in FRAGMENTS[name].splitlines())

    if obj.__doc__:
        obj.__doc__ = _PLACEHOLDER.sub(expand, obj.__doc__)
    return obj
