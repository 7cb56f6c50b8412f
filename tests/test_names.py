"""One word per concept: a renamed public name still works, as a deprecated alias that warns and gives the
object of the new name. Companion: an unknown attribute of the same modules still raises AttributeError.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

PKG = "geoopt_stiefel_attention"

#: (module, former name, current name)
RENAMED = [
    (PKG, "ConversionReport", "ConversionResult"),
    (f"{PKG}.convert", "ConversionReport", "ConversionResult"),
    (f"{PKG}.nn", "FRAME_LAYOUTS", "FRAME_GRANULARITIES"),
    (f"{PKG}.bench", "STEP_ARMS", "STEP_OPTIMIZERS"),
    (f"{PKG}.bench", "PATH_ARMS", "STEP_PATHS"),
    (f"{PKG}.bench", "ArmTiming", "Timing"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED, ids=[f"{m}.{o}" for m, o, _ in RENAMED])
def test_former_name_warns_and_gives_the_new_object(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=new):
        value = getattr(mod, old)
    assert value is getattr(mod, new)
    assert old not in getattr(mod, "__all__", ()) or old == new


@pytest.mark.parametrize("module", sorted({m for m, _, _ in RENAMED}))
def test_unknown_names_still_raise(module):
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = importlib.import_module(module).no_such_name


def test_from_import_of_a_former_name_warns():
    with pytest.warns(DeprecationWarning, match="ConversionResult"):
        from geoopt_stiefel_attention import ConversionReport  # noqa: F401


def test_former_certificate_table_module_warns_and_renders_the_same():
    from geoopt_stiefel_attention.analysis import table

    sys.modules.pop(f"{PKG}.analysis.report", None)
    with pytest.warns(DeprecationWarning, match="analysis.table"):
        report = importlib.import_module(f"{PKG}.analysis.report")
    assert report.format_text is table.format_text and report.__all__ == table.__all__


def test_current_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module, _, new in RENAMED:
            getattr(importlib.import_module(module), new)
