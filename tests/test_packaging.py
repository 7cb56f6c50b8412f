"""Packaging a user can trust: the license file matches the declared license, the citation file is complete and
consistent, the built metadata says Apache-2.0, and importing the package leaves ``warnings.filters`` alone.

Import checks run in fresh interpreters (``subprocess``), since this process imported everything long ago.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

import pytest

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
