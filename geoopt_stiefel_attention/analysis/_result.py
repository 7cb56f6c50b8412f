"""The result object every certificate returns."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Certificate", "worst_figure", "require_steps"]

_COMPARISONS = ("<=", ">=")


@dataclass(frozen=True)
class Certificate:
    """Outcome of one numerical certificate for one optimizer (one cell of the table).

    Attributes
    ----------
    name : str
        Short identifier of the certificate, e.g. ``"4a left O(d)-equivariance"``.
    statement : str
        The property, in words, that the certificate checks.
    measured : float or None
        The measured figure; ``None`` when the certificate does not apply to the optimizer.
    tolerance : float or None
        The threshold the figure is compared with (see ``comparison``).
    passed : bool or None
        ``measured <= tolerance`` (or ``>=``); a NaN figure fails; ``None`` when not applicable.
    details : Mapping[str, Any]
        Supporting figures and settings (JSON-serialisable values), and ``reason`` when not applicable.
    optimizer : str or None
        Name of the optimizer column the certificate was run for.
    comparison : {"<=", ">="}
        How ``measured`` is compared with ``tolerance``.
    """

    name: str
    statement: str
    measured: float | None
    tolerance: float | None
    passed: bool | None
    details: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str | None = None
    comparison: str = "<="

    def __post_init__(self) -> None:
        if self.comparison not in _COMPARISONS:
            raise ValueError(f"Certificate: comparison={self.comparison!r} is unknown; use one of {_COMPARISONS}.")

    @classmethod
    def check(cls, name: str, statement: str, measured: float, tolerance: float, *,
              optimizer: str | None = None, details: Mapping[str, Any] | None = None,
              comparison: str = "<=") -> Certificate:
        """Build a certificate whose ``passed`` is computed from ``measured`` and ``tolerance``.

        Parameters
        ----------
        name : str
            Short identifier of the certificate.
        statement : str
            The property checked, in words.
        measured : float
            The measured figure (NaN fails).
        tolerance : float
            The threshold.
        optimizer : str, optional
            Name of the optimizer column.
        details : mapping, optional
            Supporting figures (JSON-serialisable values).
        comparison : {"<=", ">="}, default "<="
            Passes when ``measured <= tolerance`` (or ``>=``).

        Returns
        -------
        Certificate
            With ``passed`` set.
        """
        measured = float(measured)
        if math.isnan(measured):
            passed = False
        elif comparison == ">=":
            passed = measured >= tolerance
        else:
            passed = measured <= tolerance
        return cls(name, statement, measured, float(tolerance), bool(passed), dict(details or {}),
                   optimizer, comparison)

    @classmethod
    def not_applicable(cls, name: str, statement: str, reason: str, *,
                       optimizer: str | None = None) -> Certificate:
        """A cell for a property that has no meaning for this optimizer, with the reason.

        Parameters
        ----------
        name : str
            Short identifier of the certificate.
        statement : str
            The property, in words.
        reason : str
            Why it does not apply (``details["reason"]``).
        optimizer : str, optional
            Name of the optimizer column.

        Returns
        -------
        Certificate
            With ``measured``, ``tolerance`` and ``passed`` all ``None``.
        """
        return cls(name, statement, None, None, None, {"reason": reason}, optimizer)

    @property
    def applicable(self) -> bool:
        """Whether the certificate was measured (``passed`` is not ``None``)."""
        return self.passed is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the keys ``certificate, optimizer, passed, measured, tolerance, details``
        (plus ``statement`` and ``comparison``). Infinite figures become the strings ``"inf"``/``"-inf"``.

        Returns
        -------
        dict
            The certificate, as above.
        """
        return {
            "certificate": self.name,
            "optimizer": self.optimizer,
            "passed": self.passed,
            "measured": _json_float(self.measured),
            "tolerance": _json_float(self.tolerance),
            "comparison": self.comparison,
            "statement": self.statement,
            "details": {k: _json_value(v) for k, v in self.details.items()},
        }


def _json_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return x


def _json_value(v: Any) -> Any:
    if isinstance(v, float):
        return _json_float(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    return v


def worst_figure(figures: Iterable[float], *, what: str = "figures") -> float:
    """The largest of ``figures``, NaN when any of them is NaN; :class:`ValueError` when there are none.

    Python's ``max`` keeps the figure it holds when the next one is NaN (``max(0.0, nan) == 0.0``), so a NaN
    after the first figure would vanish and a certificate would read pass; every certificate that takes the
    worst of several figures takes it here. An empty sweep measured nothing, so it cannot pass either.
    """
    values = [float(x) for x in figures]
    if not values:
        raise ValueError(f"worst_figure: no {what} to take the worst of (an empty sweep checks nothing).")
    if any(math.isnan(x) for x in values):
        return float("nan")
    return max(values)


def require_steps(who: str, steps: int, *, name: str = "steps") -> None:
    """:class:`ValueError` unless ``steps`` is an int >= 1: with no step, a certificate that compares two
    trajectories compares their common start, and would pass whatever the optimizer does."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{who}: {name}={steps!r} must be an int >= 1 (with no step the certificate compares the "
                         f"start with itself and checks nothing).")
