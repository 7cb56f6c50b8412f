"""The import rules of DESIGN.md, read from the source with ``ast`` (module-level and function-level imports
alike): the package and the checkout's ``experiments`` each have an acyclic import graph; nothing in the package
imports ``experiments``; the core never imports plotting libraries or torchvision; ``nn`` and ``optim`` never
import each other; the harness never imports a study. Companions: the cycle finder finds the cycle of a small
graph that has one, and the scan of imported names finds a forbidden import in a small package that has one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import geoopt_stiefel_attention

PACKAGE = Path(geoopt_stiefel_attention.__file__).parent
NAME = "geoopt_stiefel_attention"
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _module_names(root: Path, name: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = [name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(root: Path = PACKAGE, name: str = NAME) -> dict[str, set[str]]:
    """Module -> every dotted name it imports, anywhere in its body, relative imports made absolute
    (``from X import y`` gives ``X.y``; ``import a.b`` gives ``a.b``)."""
    modules = _module_names(root, name)
    names: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = names.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.split(".")
                    source = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                found.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def importers_of(names: dict[str, set[str]], prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of ``names`` that import a name equal to, or below, one of ``prefixes``, with those names."""
    hits = {m: sorted(n for n in imported if any(n == p or n.startswith(p + ".") for p in prefixes))
            for m, imported in names.items()}
    return {m: found for m, found in sorted(hits.items()) if found}


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
    assert NAME in graph[f"{NAME}.cli"]  # ... and function-level ones (``from . import __version__``)
    assert f"{NAME}.optim" in graph[NAME]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_experiments_have_no_import_cycle():
    graph = import_graph(EXPERIMENTS, "experiments")
    assert "experiments.harness.runner" in graph["experiments.grokking.study"]  # a study uses the harness
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_nothing_in_the_package_imports_the_experiments():
    """The package is the library: no module of it imports ``experiments`` (nor the former
    ``geoopt_stiefel_attention.experiments``), at module level or inside a function."""
    names = imported_names()
    assert f"{NAME}.cli" in names and f"{NAME}.bench.gpu" in names  # the scan sees every module
    assert importers_of(names, ("experiments", f"{NAME}.experiments")) == {}
    assert not (PACKAGE / "experiments").exists()


def test_core_modules_keep_their_boundaries():
    """DESIGN.md: ``nn`` and ``optim`` never import each other; the core (``manifolds``, ``_linalg``, ``optim``,
    ``nn``, ``convert``, ``models``, ``analysis``) never imports plotting libraries, torchvision or the
    experiments."""
    graph = import_graph()
    optim = {m for m in graph if m == f"{NAME}.optim" or m.startswith(f"{NAME}.optim.")}
    assert not graph[f"{NAME}.nn"] & optim
    assert not any(f"{NAME}.nn" in graph[m] for m in optim)
    core = [m for m in graph if m in {f"{NAME}.{c}" for c in ("manifolds", "_linalg", "nn", "models")}
            or m.startswith((f"{NAME}.optim", f"{NAME}.convert", f"{NAME}.analysis"))]
    assert len(core) > 10
    names = imported_names()
    forbidden = ("matplotlib", "seaborn", "pandas", "torchvision", "experiments", f"{NAME}.experiments")
    assert importers_of({m: names[m] for m in core}, forbidden) == {}


def test_the_harness_never_imports_a_study():
    """The harness is shared by every study; a study imports the harness, never the other way round."""
    names = imported_names(EXPERIMENTS, "experiments")
    harness = {m: n for m, n in names.items() if m.startswith("experiments.harness")}
    assert any("experiments.harness.runner.train_run" in n for n in names.values())  # the scan sees the studies
    assert importers_of(harness, ("experiments.grokking", "experiments.vision", "experiments.lm")) == {}


def private_package_names(names: dict[str, set[str]]) -> dict[str, list[str]]:
    """The modules of ``names`` that import a private name of the package: a module, or a name defined in one,
    whose dotted path below :data:`NAME` has a part starting with ``_`` (``geoopt_stiefel_attention._linalg.sym``,
    ``geoopt_stiefel_attention.optim._batching``; dunders such as ``__version__`` are public)."""
    def private(name: str) -> bool:
        parts = name.split(".")
        return parts[0] == NAME and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])

    hits = {m: sorted(n for n in imported if private(n)) for m, imported in names.items()}
    return {m: found for m, found in sorted(hits.items()) if found}


def test_the_studies_use_the_public_api_only():
    """Issue 58: the research imports what a user can import; a private module of the package is the package's to
    change (the one-line CLI error type is public, :mod:`geoopt_stiefel_attention.argtypes`)."""
    names = imported_names(EXPERIMENTS, "experiments")
    assert any(f"{NAME}.argtypes.UsageError" in n for n in names.values())  # the scan sees the studies' imports
    assert private_package_names(names) == {}


def test_the_private_import_scan_finds_one(tmp_path):
    """Companion: a study module that imports ``_linalg`` inside a function, and one that imports a private helper
    of a public module, are both caught; ``__version__`` is not."""
    pkg = tmp_path / "study"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"from {NAME} import __version__\n")
    (pkg / "a.py").write_text(f"def f():\n    from {NAME} import _linalg\n    return _linalg\n")
    (pkg / "b.py").write_text(f"from {NAME}.optim._batching import _stacked_view\n")
    found = private_package_names(imported_names(pkg, "study"))
    assert found == {"study.a": [f"{NAME}._linalg"], "study.b": [f"{NAME}.optim._batching._stacked_view"]}


def test_the_import_scan_finds_a_forbidden_import(tmp_path):
    """Companion: a package that imports ``experiments`` inside a function, and seaborn through a relative
    re-export, is caught by the same scan."""
    pkg = tmp_path / "tiny"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from experiments.harness import runner\n    return runner\n")
    (pkg / "b.py").write_text("import seaborn.objects\nfrom . import a\n")
    names = imported_names(pkg, "tiny")
    assert importers_of(names, ("experiments",)) == {"tiny.a": ["experiments.harness.runner"]}
    assert importers_of(names, ("seaborn",)) == {"tiny.b": ["seaborn.objects"]}
    assert importers_of(names, ("seaborn.obj",)) == {}  # a prefix is a whole dotted name, not a string prefix


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


def private_reexports(path: Path) -> list[str]:
    """Private names (``_x``, not submodules) that a package's ``__init__`` imports at module level from one of
    its modules: re-exports of helpers that belong to the module defining them (issue 39)."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        if isinstance(node, ast.ImportFrom) and node.module:  # ``from . import _x`` imports a submodule: fine
            found += [a.asname or a.name for a in node.names
                      if (a.asname or a.name).startswith("_") and not (a.asname or a.name).startswith("__")]
    return found


def test_package_inits_re_export_no_private_names():
    """``optim`` and ``bench`` export public names only; a private helper is imported from its module."""
    for sub in ("optim", "bench", "analysis"):
        init = PACKAGE / sub / "__init__.py"
        if init.is_file():
            assert private_reexports(init) == [], sub


def test_the_private_reexport_scan_finds_one(tmp_path):
    """Companion: an ``__init__`` that re-exports ``_helper`` (and imports a private submodule, which is fine)."""
    init = tmp_path / "__init__.py"
    init.write_text("from . import _kernel\nfrom ._batching import PUBLIC, _helper\nfrom .x import _y as _z\n")
    assert private_reexports(init) == ["_helper", "_z"]
