"""Deprecated aliases of renamed public names, written once: a module's ``__getattr__`` built by
:func:`renamed_names` gives a former name the object of its new name, with a :class:`DeprecationWarning`."""

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
