"""The shape of the guards (DESIGN.md, "The shape that absorbs new guarantees"): one module per outside system in
``geoopt_stiefel_attention/integrations/``, each opening with what goes wrong silently, how it is detected and what
the user is shown, and naming its tests; ``docs/guarantees.md`` indexes every one of them with those tests; and no
module of the package walks the Python stack. Companions: a module without one of the three parts, an index that
leaves a module out, and a package that reads ``sys._getframe`` are each reported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import geoopt_stiefel_attention

PACKAGE = Path(geoopt_stiefel_attention.__file__).parent
ROOT = PACKAGE.parent
INDEX = ROOT / "docs" / "guarantees.md"
#: The three parts every guard's docstring opens with, in this order.
PARTS = ("What goes wrong silently without it.", "How it is detected.", "What the user is shown.")


def guard_modules(root: Path = PACKAGE / "integrations") -> dict[str, str]:
    """Module file name -> its docstring, for every guard module (the package's ``__init__`` is the list of them)."""
    return {path.name: ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            for path in sorted(root.glob("*.py")) if path.name != "__init__.py"}


def docstring_problems(name: str, doc: str) -> list[str]:
    """What a guard's docstring lacks: one of :data:`PARTS` (in order), or a ``Tests:`` line naming test files
    that exist."""
    problems = []
    places = [doc.find(f"**{part}**") for part in PARTS]
    if -1 in places or places != sorted(places):
        problems.append(f"{name}: its docstring must say, in order, {', '.join(PARTS)} (as bold run-in headings)")
    tests = re.findall(r"``(tests/test_\w+\.py)``", doc[doc.find("Tests:"):] if "Tests:" in doc else "")
    if not tests or any(not (ROOT / t).is_file() for t in tests):
        problems.append(f"{name}: its docstring must end with a Tests: line naming existing test files, got {tests}")
    return problems


def index_problems(index: str, modules: dict[str, str]) -> list[str]:
    """Guard modules the index does not link, and tests a module names that the index does not link."""
    problems = []
    for name, doc in modules.items():
        if f"(../geoopt_stiefel_attention/integrations/{name})" not in index:
            problems.append(f"docs/guarantees.md does not link integrations/{name}")
        for test in re.findall(r"``(tests/test_\w+\.py)``", doc[doc.find("Tests:"):]):
            if f"(../{test})" not in index:
                problems.append(f"docs/guarantees.md does not link {test}, the tests of integrations/{name}")
    return problems


#: What reads the Python stack: frame objects and the functions that hand them out.
STACK_WALKS = re.compile(r"\b(_getframe|currentframe|inspect\.stack|extract_stack|walk_stack|f_back|f_locals)\b")


def stack_walks(root: Path = PACKAGE) -> list[str]:
    """``file:line`` of every line of code (not a comment or docstring) in ``root`` that reads the Python stack."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            text = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if text is not None and STACK_WALKS.fullmatch(text) or (
                    isinstance(node, ast.Attribute) and text == "stack" and isinstance(node.value, ast.Name)
                    and node.value.id == "inspect"):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_guard_says_what_goes_wrong_how_it_is_detected_and_the_fix_and_names_its_tests():
    modules = guard_modules()
    assert {"ddp.py", "fsdp.py", "deepspeed.py", "averaging.py", "adapters.py", "parametrize.py", "optimizers.py",
            "casts.py"} <= set(modules)
    assert [p for name, doc in modules.items() for p in docstring_problems(name, doc)] == []


def test_companion_a_guard_without_a_part_or_its_tests_is_reported(tmp_path):
    (tmp_path / "ok.py").write_text('"""**What goes wrong silently without it.** x **How it is detected.** y\n'
                                    '**What the user is shown.** z\n\nTests: ``tests/test_guard.py``.\n"""\n')
    (tmp_path / "bad.py").write_text('"""**How it is detected.** y **What goes wrong silently without it.** x\n'
                                     '**What the user is shown.** z\n\nTests: ``tests/test_nothing_here.py``.\n"""\n')
    modules = guard_modules(tmp_path)
    assert docstring_problems("ok.py", modules["ok.py"]) == []
    assert len(docstring_problems("bad.py", modules["bad.py"])) == 2


def test_docs_guarantees_indexes_every_guard_and_its_tests():
    assert index_problems(INDEX.read_text(encoding="utf-8"), guard_modules()) == []


def test_companion_an_index_that_leaves_out_a_guard_or_its_tests_is_reported():
    modules = guard_modules()
    index = INDEX.read_text(encoding="utf-8")
    assert index_problems(index.replace("(../geoopt_stiefel_attention/integrations/ddp.py)", "(elsewhere)"),
                          modules) == ["docs/guarantees.md does not link integrations/ddp.py"]
    assert "docs/guarantees.md does not link tests/test_deepspeed.py, the tests of integrations/deepspeed.py" in \
        index_problems(index.replace("(../tests/test_deepspeed.py)", "(elsewhere)"), modules)


def test_no_module_of_the_package_walks_the_python_stack():
    assert stack_walks() == []


def test_companion_a_stack_walk_is_found(tmp_path):
    (tmp_path / "a.py").write_text('"""Mentions sys._getframe in prose only."""\nimport sys\n\n\ndef caller():\n'
                                   '    # sys._getframe in a comment is not code\n'
                                   '    return sys._getframe(1).f_locals\n')
    (tmp_path / "b.py").write_text("import inspect\n\nframes = inspect.stack()\n")
    assert stack_walks(tmp_path) == ["a.py:7", "a.py:7", "b.py:3"]
