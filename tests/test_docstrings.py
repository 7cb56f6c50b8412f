"""Every public docstring is numpydoc: a summary, every parameter documented by its name, a Returns section.

The public API is what ``geoopt_stiefel_attention.__all__`` and the ``__all__`` of its public submodules
export (:data:`PUBLIC_MODULES`): each function, each class (its constructor's parameters, documented in the
class docstring or in ``__init__``'s) and each public method that the class defines itself. numpydoc's own
validator checks them, with only these checks selected (:data:`CHECKS`):

- ``GL08``/``SS01``: a docstring, with a summary line;
- ``PR01``/``PR02``: the ``Parameters`` section names every parameter of the signature, keyword-only ones and
  ``*args``/``**kwargs`` included, and no parameter that the signature does not have;
- ``RT01``/``YD01``: a ``Returns`` section where the function returns a value, ``Yields`` where it yields.

A dataclass documents its fields, which are its constructor's parameters, in ``Attributes`` (or
``Parameters``). Stylistic checks (line lengths, a final period, the order of sections) are not run. The
companion tests show that the check fails on a docstring with an undocumented parameter, one that documents a
parameter the signature does not have, and one without a Returns section.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings

import pytest

numpydoc_validate = pytest.importorskip("numpydoc.validate", reason="numpydoc is not installed (pip install -e '.[dev]')")
from numpydoc.docscrape import get_doc_object  # noqa: E402

PACKAGE = "geoopt_stiefel_attention"
#: The modules whose ``__all__`` is the public API.
PUBLIC_MODULES = ("", ".analysis", ".argtypes", ".bench", ".cli", ".convert", ".distributed", ".integrations.casts",
                  ".manifolds", ".models", ".nn", ".optim")
#: numpydoc's checks that are run (see the module docstring).
CHECKS = frozenset({"GL08", "SS01", "PR01", "PR02", "RT01", "YD01"})


def _doc(obj: object):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpydoc warns about sections it does not know, e.g. "Scope and warnings"
        return get_doc_object(obj)


def docstring_errors(obj: object) -> list[tuple[str, str]]:
    """numpydoc's errors of :data:`CHECKS` for ``obj``, as ``(code, message)`` pairs (empty: it conforms)."""
    doc = _doc(obj)
    validator = numpydoc_validate.Validator(doc)
    errors = [(code, msg) for code, msg in numpydoc_validate.validate(doc)["errors"] if code in CHECKS]
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        # a dataclass documents its fields, its constructor's parameters, in Attributes (or Parameters)
        fields = {f.name for f in dataclasses.fields(obj) if f.init}
        parameters = set(validator.doc_parameters)
        attributes = {n.strip() for attr in doc["Attributes"] for n in attr.name.split(",")}
        errors = [(code, msg) for code, msg in errors if code not in ("PR01", "PR02")]
        if fields - parameters - attributes:
            errors.append(("PR01", f"Parameters {sorted(fields - parameters - attributes)} not documented"))
        if parameters - fields:
            errors.append(("PR02", f"Unknown parameters {sorted(parameters - fields)}"))
    return errors


def public_objects() -> dict[str, object]:
    """Every public function, class and method of the API, by its import path (defined in the package)."""
    found: dict[str, object] = {}
    for suffix in PUBLIC_MODULES:
        module = importlib.import_module(PACKAGE + suffix)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants (dicts, tuples, strings) have no signature to document
            if not getattr(obj, "__module__", "").startswith(PACKAGE):
                continue
            path = f"{obj.__module__}.{obj.__qualname__}"
            found[path] = obj
            if not inspect.isclass(obj):
                continue
            for attr, value in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if inspect.isfunction(value) and value.__module__.startswith(PACKAGE):
                    found[f"{path}.{attr}"] = getattr(obj, attr)
    return found


def test_public_docstrings_are_numpydoc():
    objects = public_objects()
    assert len(objects) > 100  # the walk reached the subpackages
    problems = [f"{path}: {code} {msg}" for path, obj in objects.items() for code, msg in docstring_errors(obj)]
    assert not problems, "docstrings that are not numpydoc:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------- the check can fail
def _undocumented_parameter(x: float, scale: float = 2.0) -> float:
    """Scale a number.

    Parameters
    ----------
    x : float
        The number.

    Returns
    -------
    float
        :math:`s x`.
    """
    return scale * x


def _documents_a_missing_parameter(x: float) -> float:
    """Double a number.

    Parameters
    ----------
    x : float
        The number.
    y : float
        Not a parameter.

    Returns
    -------
    float
        :math:`2 x`.
    """
    return 2 * x


def _no_returns_section(x: float, *, shift: float = 0.0) -> float:
    """Shift a number.

    Parameters
    ----------
    x : float
        The number.
    shift : float, default 0.0
        Added to it.
    """
    return x + shift


def _conforms(x: float, *args: float, **kwargs: float) -> float:
    """Sum numbers.

    Parameters
    ----------
    x : float
        The first number.
    *args : float
        More numbers.
    **kwargs : float
        Named numbers.

    Returns
    -------
    float
        The sum.
    """
    return x + sum(args) + sum(kwargs.values())


@dataclasses.dataclass
class _DataclassMissingField:
    """A pair.

    Attributes
    ----------
    a : int
        First.
    """

    a: int
    b: int


def test_docstring_check_fails_on_an_undocumented_parameter():
    errors = docstring_errors(_undocumented_parameter)
    assert [code for code, _ in errors] == ["PR01"] and "scale" in errors[0][1]


def test_docstring_check_fails_on_a_parameter_the_signature_lacks():
    errors = docstring_errors(_documents_a_missing_parameter)
    assert [code for code, _ in errors] == ["PR02"] and "'y'" in errors[0][1]


def test_docstring_check_fails_without_returns_or_docstring():
    assert [code for code, _ in docstring_errors(_no_returns_section)] == ["RT01"]

    def undocumented(x: float) -> float:
        return x

    assert "GL08" in [code for code, _ in docstring_errors(undocumented)]


def test_docstring_check_accepts_a_conforming_docstring():
    assert docstring_errors(_conforms) == []
    errors = docstring_errors(_DataclassMissingField)
    assert [code for code, _ in errors] == ["PR01"] and "'b'" in errors[0][1]


def test_no_public_docstring_keeps_a_fragment_placeholder():
    """Shared docstring fragments (``{{name}}`` lines, :mod:`geoopt_stiefel_attention._docfrag`) are filled at
    import: what a reader sees is whole. Companion: an unknown name raises, naming it, and a known one is indented
    like its placeholder."""
    from geoopt_stiefel_attention import _docfrag

    left = [path for path, obj in public_objects().items() if "{{" in (getattr(obj, "__doc__", None) or "")]
    assert not left, left

    def documented(column):
        """Summary.

        Parameters
        ----------
        {{column}}
        """

    assert "\n        column : OptimizerColumn\n            The optimizer and geometry certified.\n" in \
        _docfrag.fill(documented).__doc__

    def misspelt():
        """Summary.

        {{colum}}
        """

    with pytest.raises(KeyError, match=r"\{\{colum\}\} names no fragment"):
        _docfrag.fill(misspelt)
