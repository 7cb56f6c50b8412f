"""The documentation cannot rot: the site builds with warnings as errors, and every code example runs.

1. ``sphinx-build -W -b html docs <tmp>`` succeeds, and the API reference lists every public name;
2. every Python example in ``README.md`` (```` ```python ```` fences) and in ``docs/**/*.rst``
   (``.. code-block:: python``, ``.. testcode::``, ``.. doctest::`` and bare ``>>>`` blocks) runs; the
   blocks of one file run in order in one namespace, so a page can build on its earlier examples;
3. the doctests in the package's docstrings pass (``doctest`` over every module of the package);
4. every relative link in the repository's tracked Markdown files names a tracked file or folder, and every
   command shown in the README, the docs and the studies' and benchmarks' READMEs parses.

Each check is paired with a case where it must fail: a page with a reST error fails the ``-W`` build, a
failing snippet, a wrong doctest output and a link to a missing path are reported.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import geoopt_stiefel_attention

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: Flags of every doctest run here: ``...`` matches anything, runs of whitespace compare equal.
DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: Languages of ``.. code-block::`` / fences that are executed as Python.
PYTHON_LANGUAGES = {"python", "py", "python3"}
#: Wall-clock limit of one Sphinx build, in seconds (the build itself takes about 10 s on 2 busy cores).
SPHINX_TIMEOUT_S = 300
#: A code block with ``:class: slow-example`` runs only with ``pytest -m slow`` (it must be self-contained).
SLOW_CLASS = "slow-example"
#: Modules whose docstrings are not collected: running them has side effects.
SKIP_MODULES = {"geoopt_stiefel_attention.__main__"}
#: A valid 1x1 PNG, for a figure in a test build.
_PNG_1X1 = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415478"
                         "9c63f8cfc0000003010100c9fe92ef0000000049454e44ae426082")


# --------------------------------------------------------------------------------------- extracting examples
@dataclass(frozen=True)
class Example:
    """One code example: ``kind`` is ``"code"`` (executed) or ``"doctest"`` (run by ``doctest``)."""

    path: str
    line: int
    kind: str
    source: str
    slow: bool = False


_RST_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(code-block|code|sourcecode|testcode|doctest|testsetup)::\s*(\S*)\s*$")
_MD_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def _indented_body(lines: list[str], start: int, indent: int) -> tuple[list[str], int]:
    """Lines after ``start`` indented deeper than ``indent`` (blank lines included), and the next index."""
    body: list[str] = []
    i = start
    while i < len(lines):
        line = lines[i]
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
        i += 1
    while body and not body[-1].strip():
        body.pop()
    return body, i


def rst_examples(text: str, path: str) -> list[Example]:
    """The Python examples of a reST text, in order."""
    lines = text.splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _RST_DIRECTIVE.match(line)
        if m:
            indent, directive, language = len(m.group(1)), m.group(2), m.group(3).lower()
            body, nxt = _indented_body(lines, i + 1, indent)
            options = []
            while body and (re.match(r"^\s*:[\w-]+:", body[0]) or not body[0].strip()):  # directive options
                options.append(body.pop(0).strip())
            slow = any(o.startswith(":class:") and SLOW_CLASS in o.split() for o in options)
            source = textwrap.dedent("\n".join(body))
            if directive in ("testcode", "testsetup") or (directive != "doctest" and language in PYTHON_LANGUAGES):
                found.append(Example(path, i + 1, "code", source, slow))
            elif directive == "doctest" or language == "pycon":
                found.append(Example(path, i + 1, "doctest", source, slow))
            i = nxt
            continue
        if line.rstrip().endswith("::") and not line.lstrip().startswith(".."):  # literal block: not code
            indent = len(line) - len(line.lstrip())
            _, i = _indented_body(lines, i + 1, indent)
            continue
        if line.lstrip().startswith(".. ") and "::" not in line:  # comment: may hide anything
            indent = len(line) - len(line.lstrip())
            _, i = _indented_body(lines, i + 1, indent)
            continue
        if line.lstrip().startswith(">>>"):  # a bare doctest block runs to the next blank line
            start = i
            while i < len(lines) and lines[i].strip():
                i += 1
            found.append(Example(path, start + 1, "doctest", textwrap.dedent("\n".join(lines[start:i]))))
            continue
        i += 1
    return found


def markdown_examples(text: str, path: str) -> list[Example]:
    """The ```` ```python ```` fenced blocks of a Markdown text, in order."""
    lines = text.splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        m = _MD_FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        marker, language = m.group(2), m.group(3).lower()
        body = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(marker):
            body.append(lines[j])
            j += 1
        if language in PYTHON_LANGUAGES:
            found.append(Example(path, i + 1, "code", textwrap.dedent("\n".join(body))))
        elif language == "pycon":
            found.append(Example(path, i + 1, "doctest", textwrap.dedent("\n".join(body))))
        i = j + 1
    return found


def run_examples(examples: list[Example], namespace: dict | None = None) -> None:
    """Run the examples of one file in order, in one namespace; raise ``AssertionError`` naming the first
    example that fails."""
    ns = {"__name__": "__docs_example__"} if namespace is None else namespace
    parser = doctest.DocTestParser()
    for ex in examples:
        where = f"{ex.path}:{ex.line}"
        if ex.kind == "code":
            try:
                exec(compile(ex.source, where, "exec"), ns)  # noqa: S102 - running the documented example
            except Exception as err:  # report which example broke, with its source
                raise AssertionError(f"example at {where} raised {type(err).__name__}: {err}\n"
                                     f"{textwrap.indent(ex.source, '    ')}") from err
        else:
            test = parser.get_doctest(ex.source, ns, where, ex.path, ex.line - 1)
            runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
            out: list[str] = []
            result = runner.run(test, out=out.append, clear_globs=False)
            if result.failed:
                raise AssertionError(f"doctest at {where} failed:\n{''.join(out)}")


def _doc_files() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts and "generated" not in p.parts)


def _package_modules() -> list[str]:
    """The modules of the package and of the checkout's ``experiments`` (whose ``__main__`` runs a study)."""
    import experiments

    names = [geoopt_stiefel_attention.__name__, experiments.__name__]
    for package in (geoopt_stiefel_attention, experiments):
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            if info.name not in SKIP_MODULES and info.name != "experiments.__main__":
                names.append(info.name)
    return sorted(names)


# --------------------------------------------------------------------------------------- 1. the Sphinx build
def _sphinx_build(src: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(out / "doctrees"),
           str(src), str(out / "html")]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=SPHINX_TIMEOUT_S, env=env, cwd=ROOT)


def _hermetic_source(tmp: Path) -> Path:
    """A copy of ``docs/`` inside a fresh tree whose other top-level entries link to the checkout.

    The build writes autosummary stubs into its source directory; building a copy keeps the working tree
    clean, lets two test runs build at once, and starts every build without stale stubs.
    """
    import shutil

    root = tmp / "checkout"
    root.mkdir()
    shutil.copytree(DOCS, root / "docs", ignore=shutil.ignore_patterns("_build", "generated", "__pycache__"))
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", ".git") and not (root / entry.name).exists():
            (root / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return root / "docs"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e '.[docs]')")
    tmp = tmp_path_factory.mktemp("site")
    proc = _sphinx_build(_hermetic_source(tmp), tmp / "out")
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    return tmp / "out" / "html"


def test_site_builds_with_warnings_as_errors(built_site):
    for page in ("index", "quickstart", "from_geoopt", "propositions/index", "experiments/index", "benchmarks",
                 "api"):
        assert (built_site / f"{page}.html").is_file(), page


def test_api_reference_lists_every_public_name(built_site):
    api = (built_site / "api.html").read_text(encoding="utf-8")
    missing = [name for name in geoopt_stiefel_attention.__all__
               if name != "__version__" and f"geoopt_stiefel_attention.{name}" not in api]
    assert not missing, f"add these to docs/api.rst: {missing}"
    for name in geoopt_stiefel_attention.__all__:
        if name != "__version__":
            assert (built_site / "generated" / f"geoopt_stiefel_attention.{name}.html").is_file(), name


def test_scope_and_warnings_section_is_rendered(built_site):
    page = (built_site / "generated" / "geoopt_stiefel_attention.StiefelAdam.html").read_text(encoding="utf-8")
    assert "Scope and warnings" in page and "skipped_frames" in page


_REMOTE = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*?\b(?:src|href)\s*=\s*["']((?:https?:)?//[^"']*)""",
                     re.IGNORECASE)


def remote_assets(page: str) -> list[str]:
    """URLs of scripts, stylesheets, images and frames that ``page`` loads from another host."""
    return [m.group(1) for m in _REMOTE.finditer(page)]


def test_pages_load_nothing_from_the_network(built_site):
    """Maths renders offline: every page loads the vendored MathJax, nothing from a CDN."""
    pages = sorted(built_site.rglob("*.html"))
    offenders = {str(p.relative_to(built_site)): remote_assets(p.read_text(encoding="utf-8")) for p in pages}
    assert not {k: v for k, v in offenders.items() if v}
    math_page = (built_site / "propositions" / "conditioning.html").read_text(encoding="utf-8")
    assert 'src="../_static/mathjax/tex-chtml.js' in math_page and 'class="math' in math_page
    fonts = built_site / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert (built_site / "_static" / "mathjax" / "tex-chtml.js").is_file() and len(list(fonts.glob("*.woff"))) >= 20


def test_remote_asset_check_can_fail():
    cdn = ('<script defer="defer" src="https://cdn.jsdelivr.net/npm/mathjax@4/tex-mml-chtml.js"></script>'
           '<link rel="stylesheet" href="//fonts.example.org/a.css"><a href="https://example.org">a link</a>'
           '<script src="_static/doctools.js"></script>')
    assert remote_assets(cdn) == ["https://cdn.jsdelivr.net/npm/mathjax@4/tex-mml-chtml.js",
                                  "//fonts.example.org/a.css"]


def test_sphinx_build_fails_on_a_rest_error(tmp_path):
    """Companion: the same command fails on a page with a reST error, so the passing build means something."""
    pytest.importorskip("sphinx")
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text("project = 'broken'\n")
    (src / "index.rst").write_text("Title\n=====\n\n.. this-directive-does-not-exist::\n\n`unclosed\n")
    proc = _sphinx_build(src, tmp_path / "out")
    assert proc.returncode != 0
    assert "this-directive-does-not-exist" in proc.stderr + proc.stdout


# --------------------------------------------------------------------------------------- the markdown-file directive
SAMPLE_README = textwrap.dedent("""\
    # A study

    Runs `(a + b) mod 97` on the `TinyTransformer`s defaults; see [the paper](https://example.org/p) and
    [the report](report.md). W_Q and x_ are names; a|b is not a substitution.

    | arm | val acc | seeds |
    |-----|--------:|:-----:|
    | adamw | 0.611 | 5 |
    | stiefel | **0.970** | 5 |

    ![Accuracy per arm](accuracy.png)

    - one `item`
      continued
    1. numbered

    ```bash
    python -m experiments grokking --out runs/grok
    ```

    > a quote after a code block
    """)


def _gsa_docs():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        return importlib.import_module("gsa_docs")
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def test_markdown_conversion_parses_cleanly():
    pytest.importorskip("sphinx")
    gsa = _gsa_docs()
    rst = gsa._Converter(SAMPLE_README, lambda path: path).convert()
    assert gsa._parses_cleanly(rst), rst
    for piece in (".. rubric:: A study", ".. list-table::", ".. figure:: accuracy.png", ".. code:: bash",
                  "`the paper <https://example.org/p>`__", "x\\_", "a\\|b", "``TinyTransformer``\\ s"):
        assert piece in rst, piece


def test_markdown_conversion_detects_what_would_not_parse():
    """Companion: text the converter cannot make valid reST is detected (the directive then shows the file
    verbatim instead of failing the build)."""
    pytest.importorskip("sphinx")
    gsa = _gsa_docs()
    assert not gsa._parses_cleanly(gsa._Converter("an *unclosed emphasis\n", lambda path: path).convert())


def test_markdown_file_directive_in_a_build(tmp_path):
    pytest.importorskip("sphinx")
    src = tmp_path / "src"
    (src / "page").mkdir(parents=True)
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "README.md").write_text(SAMPLE_README, encoding="utf-8")
    (tmp_path / "study" / "accuracy.png").write_bytes(_PNG_1X1)
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(DOCS / '_ext')!r})\n"
                                 f"extensions = ['gsa_docs']\nproject = 't'\n")
    (src / "index.rst").write_text("Index\n=====\n\n.. toctree::\n\n   page/study\n")
    (src / "page" / "study.rst").write_text("Study\n=====\n\n.. markdown-file:: ../../study/README.md\n\n"
                                            ".. markdown-file:: ../../study/not-yet.md\n   :optional:\n")
    proc = _sphinx_build(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "out" / "html" / "page" / "study.html").read_text(encoding="utf-8")
    assert "<table" in html and "0.970" in html and "not-yet.md" in html
    assert (tmp_path / "out" / "html" / "_images" / "accuracy.png").is_file()
    # companion: without :optional:, a missing file fails the -W build
    (src / "page" / "study.rst").write_text("Study\n=====\n\n.. markdown-file:: ../../study/not-yet.md\n")
    proc = _sphinx_build(src, tmp_path / "out2")
    assert proc.returncode != 0 and "not-yet.md" in proc.stderr


# --------------------------------------------------------------------------------------- links between Markdown files
#: ``[text](target)`` and ``![alt](target)`` (one level of brackets inside the text), an optional title after it.
_MD_LINK = re.compile(r"""!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^\s()<>]*)>?(?:\s+(?:"[^"]*"|'[^']*'))?\s*\)""")
#: ``[label]: target``, a reference definition.
_MD_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
#: ``<a href="...">`` and ``<img src="...">``.
_HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.I)
#: A target that is no file of the repository: a URL scheme (``https:``, ``mailto:``), ``//host`` or ``#anchor``.
_NOT_A_PATH = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)
#: An inline code span (CommonMark: a run of backticks closed by a run of the same length).
_CODE_SPAN_ANY = re.compile(r"(?<!`)(`+)(?!`)[\s\S]*?(?<!`)\1(?!`)")


def _markdown_prose(text: str) -> str:
    """``text`` with fenced code blocks and inline code spans blanked (newlines kept, so line numbers hold):
    what looks like a link there is code, not a link."""
    lines, fence = [], None
    for line in text.split("\n"):
        m = _MD_FENCE.match(line)
        if fence is not None:
            fence = None if line.strip().startswith(fence) else fence
            lines.append("")
        elif m:
            fence = m.group(2)
            lines.append("")
        else:
            lines.append(line)
    paragraphs = "\n".join(lines).split("\n\n")  # a code span never crosses a blank line
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    return "\n\n".join(_CODE_SPAN_ANY.sub(blank, paragraph) for paragraph in paragraphs)


def relative_links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every link of a Markdown text that names a path rather than a URL or an anchor."""
    prose = _markdown_prose(text)
    found = []
    for pattern in (_MD_LINK, _MD_REFERENCE, _HTML_LINK):
        for m in pattern.finditer(prose):
            target = m.group(1)
            if target and not _NOT_A_PATH.match(target):
                found.append((prose.count("\n", 0, m.start(1)) + 1, target))
    return sorted(found)


def broken_links(path: str, text: str, tracked: set[str]) -> list[str]:
    """The relative links of the Markdown file ``path`` (relative to the repository root) that name neither a
    tracked file nor a folder holding one (``tracked``: the paths ``git ls-files`` lists); a link leaving the
    repository is broken too. A ``#fragment`` or ``?query`` after the path is not checked."""
    import posixpath
    from urllib.parse import unquote

    folders = set()
    for f in tracked:  # every ancestor of a tracked file is a folder
        while (f := posixpath.dirname(f)) and f not in folders:
            folders.add(f)
    broken = []
    for line, target in relative_links(text):
        rel = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
        if not rel:
            continue
        joined = rel.lstrip("/") if rel.startswith("/") else posixpath.join(posixpath.dirname(path), rel)
        resolved = posixpath.normpath(joined)
        if resolved == ".":
            resolved = ""
        if resolved.startswith("../") or resolved == ".." or (resolved not in tracked and resolved not in folders):
            broken.append(f"{path}:{line}: ({target}) -> {resolved or '.'}: no tracked file or folder")
    return broken


def _tracked_files() -> list[str]:
    try:
        proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        proc = None
    if proc is None or proc.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in proc.stdout.split("\0") if f]


def test_relative_markdown_links_name_tracked_files():
    """Every relative link in every tracked Markdown file (READMEs, reports, the changelog) resolves, from the
    file's folder, to a tracked file or to a folder that holds one: a moved or renamed folder cannot leave a
    README pointing at nothing."""
    tracked = _tracked_files()
    pages = [f for f in tracked if f.endswith(".md")]
    assert "experiments/README.md" in pages and "benchmarks/README.md" in pages
    checked, broken = 0, []
    for page in pages:
        text = (ROOT / page).read_text(encoding="utf-8")
        checked += len(relative_links(text))
        broken += broken_links(page, text, set(tracked))
    assert not broken, "\n".join(broken)
    assert checked >= 50, f"only {checked} relative links found"


def test_markdown_link_check_can_fail():
    """Companion: a link to a missing file, to a folder that was moved, out of the repository, or a title or an
    anchor after a missing path, is reported with its line; links that resolve, URLs, anchors and links inside
    code are not."""
    tracked = {"study/README.md", "study/records/full/report.md", "study/records/full/a b.png", "top.md"}
    text = textwrap.dedent("""\
        Report: [records/full/report.md](records/full/report.md) ([folder](records/full/), [up](../top.md),
        [root](/top.md "title"), ![fig](records/full/a%20b.png), [sec](#results), [web](https://example.org/x)).
        In code: `[x](runs/full/)` and

        ```bash
        cat [y](runs/full/report.md)
        ```

        Moved: [runs/full/](runs/full/) and ![f](runs/full/a.png "the figure") and [r](runs/full/report.md#table).
        Outside: [o](../../elsewhere.md). Reference: [ref][1].

        [1]: records/gone.md
        <img src="img/x.png"> <a href="records/full/report.md">ok</a>
        """)
    assert broken_links("study/README.md", text, tracked) == [
        "study/README.md:9: (runs/full/) -> study/runs/full: no tracked file or folder",
        "study/README.md:9: (runs/full/a.png) -> study/runs/full/a.png: no tracked file or folder",
        "study/README.md:9: (runs/full/report.md#table) -> study/runs/full/report.md: no tracked file or folder",
        "study/README.md:10: (../../elsewhere.md) -> ../elsewhere.md: no tracked file or folder",
        "study/README.md:12: (records/gone.md) -> study/records/gone.md: no tracked file or folder",
        "study/README.md:13: (img/x.png) -> study/img/x.png: no tracked file or folder",
    ]
    assert broken_links("study/README.md", "[ok](records/full/report.md) [up](../top.md)", tracked) == []


# --------------------------------------------------------------------------------------- 2. examples in pages
def test_readme_has_python_examples():
    assert markdown_examples(README.read_text(encoding="utf-8"), "README.md"), "README.md lost its example"


def test_readme_examples_run():
    run_examples(markdown_examples(README.read_text(encoding="utf-8"), "README.md"))


@pytest.mark.parametrize("page", _doc_files(), ids=lambda p: str(p.relative_to(DOCS)))
def test_doc_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    examples = rst_examples(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))
    run_examples([ex for ex in examples if not ex.slow])


def _pages_with_slow_examples() -> list[Path]:
    return [p for p in _doc_files() if any(ex.slow for ex in rst_examples(p.read_text(encoding="utf-8"), str(p)))]


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_slow_examples(), ids=lambda p: str(p.relative_to(DOCS)))
def test_doc_page_slow_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_examples(rst_examples(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT))))


def test_tutorial_pages_have_examples():
    for page in ("quickstart.rst", "from_geoopt.rst"):
        examples = rst_examples((DOCS / page).read_text(encoding="utf-8"), page)
        assert len(examples) >= 4, f"{page} has only {len(examples)} runnable examples"


def test_extraction_finds_every_kind_of_block():
    text = textwrap.dedent("""\
        Title
        =====

        .. code-block:: python

           x = 1

        .. code-block:: bash

           echo not python

        Literal block::

           >>> this_is_not_run

        .. doctest::

           >>> x + 1
           2

        >>> x * 10
        10

        .. testcode::

           y = x + 1

        .. code-block:: python
           :class: slow-example

           z = 3
    """)
    kinds = [(ex.kind, ex.source.splitlines()[0], ex.slow) for ex in rst_examples(text, "t.rst")]
    assert kinds == [("code", "x = 1", False), ("doctest", ">>> x + 1", False), ("doctest", ">>> x * 10", False),
                     ("code", "y = x + 1", False), ("code", "z = 3", True)]
    md = "text\n\n```python\na = 2\n```\n\n```bash\nls\n```\n"
    assert [ex.source for ex in markdown_examples(md, "t.md")] == ["a = 2"]


def test_failing_examples_are_reported():
    """Companion: an example that raises, and a doctest with the wrong output, both fail the check."""
    with pytest.raises(AssertionError, match=r"t\.rst:4 raised ZeroDivisionError"):
        run_examples(rst_examples("Title\n=====\n\n.. code-block:: python\n\n   1 / 0\n", "t.rst"))
    with pytest.raises(AssertionError, match="doctest at t.rst:1 failed"):
        run_examples(rst_examples(">>> 1 + 1\n3\n", "t.rst"))


# --------------------------------------------------------------------------------------- shell commands in pages
def shell_commands(text: str) -> list[tuple[int, str]]:
    """``(line, command)`` for every command in the ``bash``/``console``/``shell`` blocks of a reST or
    Markdown text: continuation lines joined, comments dropped, ``&&`` and ``;`` chains split."""
    lines = text.splitlines()
    blocks: list[tuple[int, list[str]]] = []
    i = 0
    while i < len(lines):
        m = _RST_DIRECTIVE.match(lines[i])
        fence = _MD_FENCE.match(lines[i])
        if m and m.group(3).lower() in ("bash", "console", "shell", "sh"):
            body, nxt = _indented_body(lines, i + 1, len(m.group(1)))
            blocks.append((i + 2, textwrap.dedent("\n".join(body)).splitlines()))
            i = nxt
        elif fence and fence.group(3).lower() in ("bash", "console", "shell", "sh"):
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence.group(2)):
                j += 1
            blocks.append((i + 2, lines[i + 1:j]))
            i = j + 1
        else:
            i += 1
    commands = []
    for start, body in blocks:
        joined = "\n".join(body).replace("\\\n", " ")
        for k, line in enumerate(joined.splitlines()):
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line.startswith("$ "):
                line = line[2:]
            for part in re.split(r"&&|;", line):
                if part.strip():
                    commands.append((start + k, part.strip()))
    return commands


#: The READMEs beside the code (the studies' and the benchmarks'), whose commands are checked like the docs'.
STUDY_READMES = ("experiments/README.md", "experiments/grokking/README.md", "experiments/vision/README.md",
                 "experiments/lm/README.md", "benchmarks/README.md")


def _documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in [README, *_doc_files(), *(ROOT / name for name in STUDY_READMES)]:
        for line, command in shell_commands(path.read_text(encoding="utf-8")):
            found.append((f"{path.relative_to(ROOT)}:{line}", command))
    return found


def test_documented_cli_commands_parse():
    """Every ``stiefel-attention ...`` and ``python -m experiments ...`` command shown in the README, the docs and
    the studies' and benchmarks' READMEs is accepted by its parser (nothing is run), and every ``python <script>.py`` names a file of the repository."""
    import shlex

    from experiments.cli import build_parser as study_parser
    from geoopt_stiefel_attention.cli import build_parser

    parser, studies = build_parser(), study_parser()
    checked = 0
    for where, command in _documented_commands():
        argv = shlex.split(command)
        for k, token in enumerate(argv):  # a redirection or a pipe ends the command's own arguments
            if token in (">", ">>", "<", "|", "2>", "2>&1", "&>") or token.startswith((">", "2>")):
                argv = argv[:k]
                break
        if argv[0] == "stiefel-attention":
            if {"--help", "-h", "--version"} & set(argv):
                continue
            try:
                parser.parse_args(argv[1:])
            except SystemExit as err:
                raise AssertionError(f"{where}: `{command}` is rejected by the CLI parser") from err
            checked += 1
        elif argv[:3] == ["python", "-m", "experiments"]:
            if {"--help", "-h"} & set(argv):
                continue
            try:
                studies.parse_args(argv[3:])
            except SystemExit as err:
                raise AssertionError(f"{where}: `{command}` is rejected by the parser of python -m experiments") \
                    from err
            checked += 1
        elif argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py"):
            assert (ROOT / argv[1]).is_file(), f"{where}: `{command}` names a script that does not exist"
    assert checked >= 5, f"only {checked} stiefel-attention commands found in the docs"


def test_cli_command_check_can_fail():
    """Companion: a command with an unknown flag is rejected, and the extractor finds it."""
    from geoopt_stiefel_attention.cli import build_parser

    text = "Run::\n\n.. code-block:: bash\n\n   stiefel-attention demo --no-such-flag \\\n      --x 1  # comment\n"
    [(line, command)] = shell_commands(text)
    assert line == 5 and command.split() == ["stiefel-attention", "demo", "--no-such-flag", "--x", "1"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--no-such-flag"])


# --------------------------------------------------------------------------------------- 3. docstring doctests
@pytest.mark.parametrize("module_name", _package_modules())
def test_docstring_doctests(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    out: list[str] = []
    previous = torch.get_default_dtype()
    try:
        for test in finder.find(module, module_name, globs={}):
            runner.run(test, out=out.append)
    finally:
        torch.set_default_dtype(previous)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(out)


def test_public_api_docstrings_have_examples():
    """The classes and helpers users meet first carry a runnable Examples section."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in ("PolarStiefel", "StiefelAdam", "StiefelMultiheadAttention", "param_groups", "TinyTransformer"):
        obj = getattr(geoopt_stiefel_attention, name)
        tests = [t for t in finder.find(obj, name, globs={}) if t.examples]
        assert tests, f"{name} has no doctest example"
