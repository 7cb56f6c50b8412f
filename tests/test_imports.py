"""The package has no import cycle: the graph of its modules' imports of each other, read from the source with
``ast`` (module-level and function-level imports alike), is acyclic. Companion: the cycle finder finds the
cycle of a small graph that has one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import geoopt_stiefel_attention

PACKAGE = Path(geoopt_stiefel_attention.__file__).parent
NAME = "geoopt_stiefel_attention"


def _module_names(root: Path, name: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = [name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path = PACKAGE, name: str = NAME) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its body (inside functions too).

    ``from X import y`` counts as an import of ``X.y`` when that is a module of the package, else of ``X``.
    The implicit import of parent packages (``import a.b`` runs ``a/__init__``) is not an edge: every
    submodule would otherwise close a cycle through the top-level ``__init__`` that re-exports it.
    """
    modules = _module_names(root, name)
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` if it is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert f"{NAME}.convert" in graph[f"{NAME}.nn"]  # the graph sees module-level imports ...
    assert f"{NAME}.nn" in graph[f"{NAME}.experiments.ablation_arms"]  # ... and function-level ones
    assert f"{NAME}.optim" in graph[NAME]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_core_modules_keep_their_boundaries():
    """DESIGN.md: ``nn`` and ``optim`` never import each other; the core never imports the experiments."""
    graph = import_graph()
    optim = {m for m in graph if m == f"{NAME}.optim" or m.startswith(f"{NAME}.optim.")}
    assert not graph[f"{NAME}.nn"] & optim
    assert not any(f"{NAME}.nn" in graph[m] for m in optim)
    convert = sorted(m for m in graph if m.startswith(f"{NAME}.convert."))
    core = [f"{NAME}.{m}" for m in ("manifolds", "_linalg", "nn", "convert", "models")] + sorted(optim) + convert
    assert not any(t.startswith(f"{NAME}.experiments") for m in core for t in graph[m])


def test_cycle_finder_finds_a_cycle(tmp_path):
    """Companion: a tiny package whose ``a`` imports ``b`` at module level and ``b`` imports ``a`` inside a
    function (the lazy import that hid the nn/convert cycle) has a cycle, and it is found."""
    pkg = tmp_path / "tiny"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import tiny.a\n")
    graph = import_graph(pkg, "tiny")
    assert graph == {"tiny": {"tiny.a"}, "tiny.a": {"tiny.b"}, "tiny.b": {"tiny.a"}, "tiny.c": {"tiny.a"}}
    assert find_cycle(graph) == ["tiny.a", "tiny.b", "tiny.a"]
    graph["tiny.b"].clear()
    assert find_cycle(graph) is None
