"""Deprecated aliases of renamed public names and keywords, written once: a module's ``__getattr__`` built by
:func:`renamed_names` gives a former name the object of its new name, with a :class:`DeprecationWarning`, and
:func:`renamed_keyword` answers a former keyword argument the same way."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed_names(module: str, namespace: Mapping[str, Any],
                  renamed: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``renamed[old] = (new, why)`` answers ``old`` with ``namespace[new]`` and a
    warning that names the new name and says why; any other name raises :class:`AttributeError`."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new, why = renamed[name]
            warnings.warn(f"{module}.{name} is deprecated; use {new} ({why})", DeprecationWarning, stacklevel=2)
            return namespace[new]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed_keyword(kwargs: dict[str, Any], old: str, new: str, value: Any, default: Any, *, where: str,
                    why: str) -> Any:
    """The value of a renamed keyword argument: ``kwargs.pop(old)`` with a :class:`DeprecationWarning` when a caller
    passed the former name ``old`` (caught by the function's ``**kwargs``), else ``value``, the argument under its
    new name ``new``. Passing both, ``value`` differing from ``default``, is a :class:`TypeError`."""
    if old not in kwargs:
        return value
    if value is not default:
        raise TypeError(f"{where}() got both {old}= and {new}=; pass {new}= only ({old}= is its former name).")
    warnings.warn(f"{where}({old}=...) is deprecated; use {new}=... ({why})", DeprecationWarning, stacklevel=3)
    return kwargs.pop(old)
