"""Packaging a user can trust: the license file matches the declared license, the citation file is complete and
consistent, the built metadata says Apache-2.0, and importing the package leaves ``warnings.filters`` alone; a
fresh machine gets every test's dependency from the extras and CI runs the README's command in a fresh virtual
environment; the wheel built offline carries what a package index shows (version, Python versions, classifiers,
project URLs, extras, ``py.typed``, the README with absolute links).

Import checks run in fresh interpreters (``subprocess``), since this process imported everything long ago.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import assert_quoted

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import geoopt_stiefel_attention

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
#: SHA-256 of the Apache License 2.0 text as published at https://www.apache.org/licenses/LICENSE-2.0.txt
#: (the file Debian ships as /usr/share/common-licenses/Apache-2.0).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
#: Seconds allowed for one fresh interpreter that imports torch and the package.
IMPORT_TIMEOUT_S = 120
#: Seconds allowed for building the sdist and the wheel offline (about 5 s on an idle 2-core machine).
BUILD_TIMEOUT_S = 300
#: Every module of the package a user may import (the experiments package needs optional dependencies).
MODULES = ("geoopt_stiefel_attention", "geoopt_stiefel_attention.nn", "geoopt_stiefel_attention.optim",
           "geoopt_stiefel_attention.manifolds", "geoopt_stiefel_attention.models",
           "geoopt_stiefel_attention.analysis", "geoopt_stiefel_attention.bench",
           "geoopt_stiefel_attention.demo", "geoopt_stiefel_attention.cli")


# ------------------------------------------------------------------------------------- license and metadata
def test_license_file_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    assert b"Apache License" in text[:200] and b"Version 2.0, January 2004" in text[:200]


def test_license_check_can_fail():
    text = (ROOT / "LICENSE").read_bytes().replace(b"Version 2.0", b"Version 3.0")
    assert hashlib.sha256(text).hexdigest() != APACHE_2_SHA256


def test_pyproject_declares_the_license_of_the_file():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    assert project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))  # one source of truth


def test_built_metadata_carries_the_license(tmp_path):
    """setuptools' own metadata hook (what ``pip install`` and ``python -m build`` call)."""
    script = ("import sys\nfrom setuptools import build_meta\n"
              "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=IMPORT_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    dist_info = tmp_path / proc.stdout.strip().splitlines()[-1]
    meta = Parser().parsestr((dist_info / "METADATA").read_text(encoding="utf-8"))
    assert meta["Name"] == "geoopt-stiefel-attention" and meta["Version"] == geoopt_stiefel_attention.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert (dist_info / "licenses" / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()


# ------------------------------------------------------------------------------------- citation
def test_citation_file_cites_the_package_and_the_paper():
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    for key in ("cff-version", "message", "title", "authors"):  # required by CFF 1.2.0
        assert cff.get(key), key
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["title"] == PYPROJECT["project"]["name"]
    assert cff["version"] == geoopt_stiefel_attention.__version__
    assert cff["license"] == PYPROJECT["project"]["license"]
    (paper,) = [r for r in cff["references"] if r["title"] == "Stiefel Attention"]
    assert paper["authors"] == [{"family-names": "Guerrero", "given-names": "R. D."}]
    assert (paper["year"], paper["month"], paper["journal"]) == (2026, 9, "arXiv")
    # no identifier is known: none may be invented
    assert not {"doi", "identifiers", "url"} & set(paper)


# ------------------------------------------------------------------------------------- warning filters
def _imports(*modules: str) -> str:
    return "\n".join(f"import {m}" for m in modules)


_USER_FILTER = "warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated', category=FutureWarning)"
_PRINT = "print(repr(warnings.filters))"

#: name -> (interpreter flags, code), each run in a fresh interpreter; three runs cover every check
SCENARIOS = {
    # dependencies first (print their filters); then, with a user's filter identical to the package's own,
    # import the package: nothing may change
    "dependencies": ((), f"import torch, geoopt\n{_PRINT}\n{_USER_FILTER}\nbefore = list(warnings.filters)\n"
                         f"{_imports(*MODULES)}\nassert warnings.filters == before, (before, warnings.filters)"),
    # the package first (print the filters); then a real change, which the comparison must see
    "package": ((), f"{_imports(*MODULES)}\n{_PRINT}\nwarnings.simplefilter('ignore', UserWarning)\n{_PRINT}"),
    # FutureWarnings are errors: the import stays quiet, while torch.jit.script's warning is live
    "future_warnings_are_errors": (("-W", "error::FutureWarning"),
                                   "import geoopt_stiefel_attention, torch\ntry:\n"
                                   "    torch.jit.script(lambda x: x)\nexcept FutureWarning as w:\n"
                                   "    print('live:', w)"),
}


@pytest.fixture(scope="module")
def fresh() -> dict[str, tuple[int, list[str], str]]:
    """``name -> (returncode, stdout lines, stderr)`` of every scenario, run in parallel fresh interpreters
    (one import of torch takes seconds on a busy machine)."""
    procs = {name: subprocess.Popen([sys.executable, *flags, "-c", f"import warnings\n{code}"], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (flags, code) in SCENARIOS.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=IMPORT_TIMEOUT_S)
        results[name] = (proc.returncode, out.splitlines(), err)
    return results


def test_first_import_keeps_the_filters_dependencies_install(fresh):
    """In a fresh interpreter the package leaves exactly the filters that importing torch and geoopt leaves:
    it neither adds its own nor drops those torch, numpy and scipy install at import time."""
    (rc_deps, deps, err_deps), (rc, ours, err) = fresh["dependencies"], fresh["package"]
    assert rc_deps == 0 and rc == 0, (err_deps, err)
    assert ours[0] == deps[0]


def test_filter_comparison_can_fail(fresh):
    _, ours, _ = fresh["package"]
    assert ours[1] != ours[0]


def test_import_after_dependencies_changes_nothing_and_keeps_a_users_filter(fresh):
    rc, _, err = fresh["dependencies"]
    assert rc == 0, err  # the script asserts warnings.filters == before


def test_import_is_quiet_even_when_future_warnings_are_errors(fresh):
    """geoopt's import-time ``torch.jit.script`` FutureWarning is silenced for that import only."""
    rc, out, err = fresh["future_warnings_are_errors"]
    assert rc == 0 and err == "", err
    assert out and out[0].startswith("live:") and "torch.jit.script" in out[0]  # companion: the warning is real


# ------------------------------------------------------------------------------------- a fresh machine
README_TEXT = (ROOT / "README.md").read_text(encoding="utf-8")
#: The README's test command (the second of its two commands).
TEST_COMMAND = 'pip install torch==2.14.1 torchvision==0.29.1 -e ".[dev,experiments,docs,models]" && python -m pytest'
#: Import name -> the distribution that provides it, where the two differ (docutils comes with sphinx).
IMPORT_TO_DIST = {"yaml": "pyyaml", "sklearn": "scikit-learn", "docutils": "sphinx", "tomli": "tomli"}
#: Imports that are not distributions: this package, pytest's conftest, the test modules themselves.
LOCAL_IMPORTS = ({"geoopt_stiefel_attention", "experiments", "conftest", "gsa_docs"}
                 | {p.stem for p in (ROOT / "tests").glob("*.py")})


def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip().lower().replace("_", "-")


def _declared() -> set[str]:
    project = PYPROJECT["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {_requirement_name(s) for s in specs}


def _third_party_imports(paths: list[Path]) -> dict[str, str]:
    """Top-level module imported (or ``pytest.importorskip``-ed) -> one file importing it, stdlib excluded."""
    found: dict[str, str] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in LOCAL_IMPORTS:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _undeclared(imports: dict[str, str]) -> list[str]:
    declared = _declared()
    return [f"{module} ({where})" for module, where in sorted(imports.items())
            if IMPORT_TO_DIST.get(module, module).lower().replace("_", "-") not in declared]


def test_every_import_of_the_tests_docs_and_package_is_declared():
    """What the tests, the docs' code and the package import is a dependency or in an extra, so that the README's
    test command installs it in a fresh environment."""
    paths = [*(ROOT / "tests").glob("*.py"), *(ROOT / "docs").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "geoopt_stiefel_attention").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]
    assert not _undeclared(_third_party_imports(paths))
    # companion: an import nobody declared is caught
    assert _undeclared({"polars": "tests/x.py"}) == ["polars (tests/x.py)"]


def _not_in_the_studies_extra(imports: dict[str, str], extra: list[str]) -> list[str]:
    """The imports that neither the core dependencies nor ``extra`` (a list of requirement specs) bring."""
    brought = {_requirement_name(s) for s in [*PYPROJECT["project"]["dependencies"], *extra]}
    return [f"{module} ({where})" for module, where in sorted(imports.items())
            if IMPORT_TO_DIST.get(module, module).lower().replace("_", "-") not in brought]


def test_the_experiments_extra_brings_everything_the_studies_import():
    """A study's missing-dependency message names the experiments extra (experiments.harness.cli_args): that extra,
    with the core dependencies, must bring every third-party package the studies import."""
    from experiments.harness.cli_args import OPTIONAL_PACKAGES, STUDIES_EXTRA

    extras = PYPROJECT["project"]["optional-dependencies"]
    imports = _third_party_imports(sorted((ROOT / "experiments").rglob("*.py")))
    assert "transformers" in imports and set(OPTIONAL_PACKAGES) <= set(imports)
    assert _not_in_the_studies_extra(imports, extras[STUDIES_EXTRA]) == []
    # companion: the extra as it was (no transformers, which the lm study imports) leaves the lm study short
    before = [s for s in extras[STUDIES_EXTRA] if _requirement_name(s) != "transformers"]
    assert [m.split()[0] for m in _not_in_the_studies_extra(imports, before)] == ["transformers"]


def test_extras_install_what_the_trainer_and_the_packaging_tests_need():
    extras = {name: {_requirement_name(s) for s in specs}
              for name, specs in PYPROJECT["project"]["optional-dependencies"].items()}
    assert "accelerate" in extras["models"]  # transformers' Trainer: "requires accelerate>=1.1.0"
    assert any(s.startswith("accelerate>=1.1") for s in PYPROJECT["project"]["optional-dependencies"]["models"])
    assert {"build", "setuptools", "twine", "pyyaml", "pytest", "pytest-timeout", "hypothesis"} <= extras["dev"]


def test_ci_runs_the_readme_test_command_in_a_fresh_virtual_environment():
    assert README_TEXT.count(TEST_COMMAND) == 1
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == TEST_COMMAND  # the README's command, verbatim, as the last thing CI does
    assert re.search(r'-m venv "\$venv"', script) and 'source "$venv/bin/activate"' in script
    assert "system-site-packages" not in script and "PYTHONNOUSERSITE=1" in script
    assert script.index("-m venv") < script.index(TEST_COMMAND)
    # companion: the comparison sees a changed command
    assert commands[-1] != TEST_COMMAND.replace("models", "")


#: The front page's length (issue 58: what it is, the two commands, an example, the update, the guarantees in brief,
#: what the studies found; each study's history lives in its own README).
FRONT_PAGE_LINES = 200


def _front_page_facts() -> list[str]:
    """The phrases of the README that state the project's own facts outside the tables other tests check, built
    from where each fact lives: the dependencies (pyproject), the pins of the set-up commands (the test command's),
    the vendored MathJax (its file), the paper (CITATION.cff), the certificate rows named (the certify suite's) and
    the step-size arithmetic of "The update" (the trust radii ``"auto"`` gives)."""
    import calendar
    import math

    from geoopt_stiefel_attention._linalg import AUTO_TRUST_REGION
    from geoopt_stiefel_attention.analysis.suite import ROWS

    deps = {_requirement_name(d): d for d in PYPROJECT["project"]["dependencies"]}
    pins = TEST_COMMAND.split(" -e ")[0]
    mathjax = (ROOT / "docs" / "_static" / "mathjax" / "tex-chtml.js").read_text(encoding="utf-8")
    version = re.search(r'VERSION="(\d+\.\d+\.\d+)"', mathjax).group(1)
    paper = _yaml(ROOT / "CITATION.cff")["references"][0]
    author = paper["authors"][0]
    delta, paper_delta = AUTO_TRUST_REGION["match_rms_adamw"], AUTO_TRUST_REGION["original"]
    labels = {row.split()[0]: row for row in ROWS}
    assert "cond <= 1 + D^2" in labels["3a"] and "right O(r)-equivariance" in labels["4b"]  # the rows named
    return [
        f"needs `torch{deps['torch'][len('torch'):]}` and `geoopt{deps['geoopt'][len('geoopt'):]}`",
        f'{pins} -e ".[experiments]" && stiefel-attention certify', f"`{pins.split()[2]}` is pinned",
        f"a copy of MathJax {version}",
        f'"{paper["title"]}", {author["given-names"]} {author["family-names"]}, {paper["journal"]}, '
        f"{calendar.month_name[paper['month']]} {paper['year']}",
        "it lacks the trust region (3a) and its QR retraction is not right O(r)-equivariant (4b)",
        f"√(dr) times less: {math.sqrt(128 * 32):.0f}× at 128×32",
        f"is Δ = {delta:g} under the default rule (condition ≤ {1 + delta ** 2:g}, ≤ "
        f"{math.degrees(math.atan(delta)):.0f}° per step) and the paper's {paper_delta:g} under `\"original\"`"]


def _yaml(path: Path):
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_front_page_is_short_and_states_the_projects_own_facts():
    """The README is a front page of at most FRONT_PAGE_LINES lines, and the facts it states outside the tables
    that other tests check are the project's (:func:`_front_page_facts`). Companion (assert_quoted): any of these
    phrases with one digit changed is caught."""
    assert len(README_TEXT.splitlines()) <= FRONT_PAGE_LINES
    assert_quoted(README_TEXT, _front_page_facts())


# ------------------------------------------------------------------------------------- ready to publish
#: Names of the project URLs a package index page shows.
URL_NAMES = ("Homepage", "Documentation", "Repository", "Issues", "Changelog")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(markdown: str) -> list[str]:
    return [url for url in _LINK.findall(markdown) if not re.match(r"https?://", url)]


def test_readme_links_work_on_the_package_index_page():
    """No relative link (it would point into the index, not the repository); links into the repository name
    files that exist."""
    assert _LINK.findall(README_TEXT) and not _relative_links(README_TEXT)
    blob = PYPROJECT["project"]["urls"]["Repository"] + "/blob/main/"
    ours = [url[len(blob):] for url in _LINK.findall(README_TEXT) if url.startswith(blob)]
    assert ours and all((ROOT / path).is_file() for path in ours), ours
    # companion: a relative link is caught
    assert _relative_links("see [the docs](docs/index.rst) and [geoopt](https://github.com/geoopt/geoopt)") == [
        "docs/index.rst"]


def test_project_urls_agree_with_the_citation_file_and_the_version_lives_in_one_place():
    yaml = pytest.importorskip("yaml")
    urls = PYPROJECT["project"]["urls"]
    assert tuple(urls) == URL_NAMES
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["repository-code"] == urls["Repository"] == urls["Homepage"]
    assert all(url.startswith(urls["Repository"]) for url in urls.values())
    # the version: written once in the package, read by pyproject and the docs, checked in CITATION.cff
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "geoopt_stiefel_attention.__version__"}
    assert "release = geoopt_stiefel_attention.__version__" in (ROOT / "docs" / "conf.py").read_text(encoding="utf-8")
    assert cff["version"] == geoopt_stiefel_attention.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "Keep a Changelog" in changelog and "## [Unreleased]" in changelog
    assert geoopt_stiefel_attention.__version__ in changelog


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """``(wheel, sdist)`` built offline from this checkout (``python -m build --no-isolation``: no download;
    the wheel is built from the sdist, as an index would)."""
    pytest.importorskip("build", reason="the dev extra is not installed (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return wheel, sdist


def _wheel_metadata(wheel: Path) -> tuple[Message, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(meta).decode("utf-8")), names


def test_wheel_metadata_is_ready_to_publish(built):
    wheel, sdist = built
    meta, names = _wheel_metadata(wheel)
    assert meta["Version"] == geoopt_stiefel_attention.__version__
    assert wheel.name.startswith(f"geoopt_stiefel_attention-{geoopt_stiefel_attention.__version__}-py3-none-any")
    assert meta["Requires-Python"] == PYPROJECT["project"]["requires-python"] == ">=3.10"
    classifiers = meta.get_all("Classifier")
    assert [c for c in classifiers if c.startswith("Development Status ::")] == ["Development Status :: 3 - Alpha"]
    assert {f"Programming Language :: Python :: 3.{m}" for m in (10, 11, 12, 13)} <= set(classifiers)
    assert "Typing :: Typed" in classifiers
    assert set(meta.get_all("Provides-Extra")) == {"dev", "docs", "experiments", "models"}
    assert any(r.startswith("accelerate>=1.1.0") and 'extra == "models"' in r for r in meta.get_all("Requires-Dist"))
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls == PYPROJECT["project"]["urls"]
    assert "geoopt_stiefel_attention/py.typed" in names  # PEP 561
    assert meta["Description-Content-Type"] == "text/markdown"
    description = meta.get_payload()
    assert description.strip() == README_TEXT.strip() and not _relative_links(description)
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"CHANGELOG.md", "CITATION.cff", "LICENSE", "README.md", "geoopt_stiefel_attention/py.typed"} <= members


#: Parts of a path that only the research has: its package, its records, the former in-package studies.
_RESEARCH_PARTS = ("experiments", "studies", "records", "runs")
#: Files only a study writes.
_RECORD_NAMES = ("metrics.jsonl", "summary.json", "study.json", "environment.json", "report.md")


def research_files(names: list[str]) -> list[str]:
    """The entries of a distribution's file list (with the sdist's top folder already removed) that belong to
    the research, not the library: anything under a folder named in :data:`_RESEARCH_PARTS` or a file named in
    :data:`_RECORD_NAMES`."""
    return [n for n in names if set(n.split("/")[:-1]) & set(_RESEARCH_PARTS) or n.rsplit("/", 1)[-1] in _RECORD_NAMES]


def test_the_distributions_hold_the_library_only(built, record_property):
    """Issue 39: the wheel is the library (``geoopt_stiefel_attention/`` and its ``.dist-info``), with no study code
    and no records; the sdist holds neither ``experiments/`` nor the tests that need it (both run from a checkout).
    Prints the
    sizes (``pytest -s``) and records them as test properties."""
    wheel, sdist = built
    _, names = _wheel_metadata(wheel)
    with tarfile.open(sdist) as tar:
        sdist_names = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name]
    with zipfile.ZipFile(wheel) as z:
        unpacked = sum(i.file_size for i in z.infolist())
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size / 1024:.0f} KiB ({unpacked / 1024:.0f} KiB unpacked, "
          f"{len(names)} files); sdist {sdist.name}: {sdist.stat().st_size / 1024:.0f} KiB ({len(sdist_names)} files)")
    record_property("wheel_bytes", wheel.stat().st_size)
    record_property("sdist_bytes", sdist.stat().st_size)
    assert all(n.startswith(("geoopt_stiefel_attention/", "geoopt_stiefel_attention-")) for n in names), names
    assert "geoopt_stiefel_attention/optim/adam.py" in names and "geoopt_stiefel_attention/cli.py" in names
    assert research_files(names) == [] and research_files(sdist_names) == []
    assert not any(n.startswith(("experiments/", "tests/")) for n in sdist_names)  # both run from a checkout
    assert wheel.stat().st_size < 512 * 1024  # the library alone; the studies' records were megabytes
    # companion: study code, records and the former in-package studies are caught
    caught = ["experiments/harness/runner.py", "geoopt_stiefel_attention/experiments/lm.py",
              "experiments/lm/records/tuned/report.md", "x/summary.json", "studies/grokking/README.md"]
    assert research_files([*caught, "geoopt_stiefel_attention/bench/records.py"]) == caught


def test_twine_accepts_the_distributions(built):
    """``twine check --strict``: the long description renders on the package index."""
    pytest.importorskip("twine", reason="the dev extra is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, built)],
                          capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
    assert proc.returncode == 0 and proc.stdout.count("PASSED") == 2, proc.stdout + proc.stderr


def test_no_lock_or_checkpoint_files_are_committed():
    """Run folders' locks and checkpoints stay local (.gitignore); only fixtures under tests/data may hold .pt."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    assert files  # companion: the listing itself works
    locks = [f for f in files if f.endswith(".lock")]
    checkpoints = [f for f in files if f.endswith(".pt") and not f.startswith("tests/data/")]
    assert not locks and not checkpoints, (locks, checkpoints)


#: Seconds allowed for one run of the linter over the repository (about 1 s).
LINT_TIMEOUT_S = 120


def _ruff(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff")  # in the dev extra, which CI installs
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=LINT_TIMEOUT_S)


def test_the_repository_passes_its_linter():
    """``ruff check`` with the repository's ``ruff.toml`` finds nothing (lint drift is caught by CI, which runs only
    the test command)."""
    out = _ruff("check", "--no-cache", ".", cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_companion_the_linter_with_the_repository_settings_fails_on_a_finding(tmp_path):
    """The same command, with the same settings, on a file holding a finding of a selected rule (F541: an f-string
    without placeholders) fails: the check above can fail."""
    (tmp_path / "ruff.toml").write_text((ROOT / "ruff.toml").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "bad.py").write_text('x = f"no placeholder"\n', encoding="utf-8")
    out = _ruff("check", "--no-cache", ".", cwd=tmp_path)
    assert out.returncode == 1 and "F541" in out.stdout, out.stdout + out.stderr
