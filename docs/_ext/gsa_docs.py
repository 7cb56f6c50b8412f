"""Local Sphinx extension: show committed Markdown files (study READMEs, reports) inside the docs.

The experiment and benchmark READMEs and reports are Markdown, written next to the runs that produced them.
The docs include them rather than copying them, so a page never disagrees with the committed report::

    .. markdown-file:: ../../experiments/grokking/README.md
       :optional:

The file is converted to reStructuredText by a small converter that knows the Markdown the project writes
(ATX headings, paragraphs, lists, fenced code, pipe tables, images, links, inline code/emphasis). Headings
become rubrics (so they never clash with the page's own section levels) and images become figures, copied
into the site. When the converted text would not parse cleanly, the file is shown verbatim as a Markdown
code block instead, so that an unusual README can never break a ``-W`` build.

Options
-------
``:optional:``
    A missing file renders a note ("not committed yet") instead of a build warning. Drop the flag once the
    file is committed, so that the page cannot silently lose it later.
``:verbatim:``
    Always show the Markdown source as a code block (images are still shown as figures).
``:start-after: TEXT``
    Only the part of the file after the first line containing ``TEXT``.
"""

from __future__ import annotations

import os
import re

from docutils import nodes
from docutils.core import publish_doctree
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_IMAGE_LINE = re.compile(r"^\s*!\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)\s*$")
_IMAGE_ANY = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_BULLET = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+(.*)$")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LANGUAGES = {"": "text", "sh": "bash", "shell": "bash", "py": "python", "md": "markdown", "jsonl": "json"}


def _is_remote(uri: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*://", uri)) or uri.startswith(("mailto:", "#"))


def _inline(text: str) -> str:
    """Markdown inline markup -> reST inline markup (code spans first, so their content stays literal)."""
    pieces: list[str] = []
    pos = 0
    for m in _CODE_SPAN.finditer(text):
        pieces.append(_inline_plain(text[pos:m.start()]))
        code = m.group(2).strip()
        if "``" in code or not code:
            pieces.append(code)
        else:
            # reST inline markup must be delimited by whitespace or punctuation: join it to words with "\ "
            before = "\\ " if m.start() > 0 and text[m.start() - 1].isalnum() else ""
            after = "\\ " if m.end() < len(text) and text[m.end()].isalnum() else ""
            pieces.append(f"{before}``{code}``{after}")
        pos = m.end()
    pieces.append(_inline_plain(text[pos:]))
    return "".join(pieces)


def _inline_plain(text: str) -> str:
    def link(m: re.Match) -> str:
        label, uri = m.group(1), m.group(2)
        if _is_remote(uri) and not uri.startswith("#"):
            return f"`{label} <{uri}>`__"
        return f"{label} (``{uri}``)"

    text = text.replace("|", r"\|")
    text = re.sub(r"(?<=\w)_(?=\W|$)", r"\\_", text)  # ``name_`` would be a reference in reST
    text = re.sub(r"(?<![\w*])__(?=\S)(.+?)(?<=\S)__(?![\w*])", r"**\1**", text)  # __bold__ -> **bold**
    return _LINK.sub(link, text)


class _Converter:
    """Line-oriented Markdown -> reST conversion of one file."""

    def __init__(self, text: str, image_uri) -> None:
        self.lines = text.splitlines()
        self.image_uri = image_uri  # markdown image path -> (uri for the figure directive) or None
        self.out: list[str] = []

    def blank(self) -> None:
        if self.out and self.out[-1] != "":
            self.out.append("")

    def convert(self) -> str:
        lines = self.lines
        i = 0
        while i < len(lines):
            line = lines[i]
            fence = _FENCE.match(line)
            if fence:
                i = self._code(i, fence)
                continue
            if not line.strip():
                self.blank()
                i += 1
                continue
            heading = _HEADING.match(line)
            if heading:
                self.blank()
                self.out += [f".. rubric:: {_inline(heading.group(2))}", ""]
                i += 1
                continue
            image = _IMAGE_LINE.match(line)
            if image:
                self._figure(image.group(1), image.group(2))
                i += 1
                continue
            if "|" in line and i + 1 < len(lines) and _TABLE_RULE.match(lines[i + 1]):
                i = self._table(i)
                continue
            if line.lstrip().startswith(">"):
                self.blank()
                self.out += ["..", ""]  # an empty comment: the quote must not continue a preceding block
                while i < len(lines) and lines[i].lstrip().startswith(">"):
                    self.out.append("   " + _inline(lines[i].lstrip()[1:].strip()))
                    i += 1
                self.blank()
                continue
            if re.match(r"^\s*([-*_])(\s*\1){2,}\s*$", line):  # horizontal rule
                self.blank()
                i += 1
                continue
            if _BULLET.match(line):
                i = self._list(i)
                continue
            # paragraph: consecutive non-blank lines that start nothing else
            self.blank()
            while i < len(lines) and lines[i].strip() and not (
                    _FENCE.match(lines[i]) or _HEADING.match(lines[i]) or _IMAGE_LINE.match(lines[i])
                    or _BULLET.match(lines[i]) or lines[i].lstrip().startswith(">")):
                self.out.append(self._inline_with_images(lines[i].strip()))
                i += 1
            self.blank()
        return "\n".join(self.out) + "\n"

    def _inline_with_images(self, text: str) -> str:
        # an image inside running text cannot be a figure: keep its alt text and path
        return _inline(_IMAGE_ANY.sub(lambda m: f"{m.group(1)} ({m.group(2)})", text))

    def _code(self, i: int, fence: re.Match) -> int:
        indent, marker, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        body = []
        i += 1
        while i < len(self.lines) and not self.lines[i].strip().startswith(marker):
            body.append(self.lines[i][len(indent):] if self.lines[i].startswith(indent) else self.lines[i])
            i += 1
        self.blank()
        self.out += [f".. code:: {_LANGUAGES.get(lang, lang)}", ""]
        self.out += ["   " + b if b.strip() else "" for b in body] or ["   "]
        self.out.append("")
        return i + 1

    def _figure(self, alt: str, path: str) -> None:
        uri = path if _is_remote(path) else self.image_uri(path)
        self.blank()
        if uri is None:
            self.out += [f"*(figure {path} not found)*", ""]
            return
        self.out += [f".. figure:: {uri}", f"   :alt: {alt or os.path.basename(path)}", "   :width: 100%", ""]
        if alt:
            self.out += ["   " + _inline(alt), ""]

    def _table(self, i: int) -> int:
        def cells(row: str) -> list[str]:
            row = row.strip()
            row = row[1:] if row.startswith("|") else row
            row = row[:-1] if row.endswith("|") and not row.endswith(r"\|") else row
            return [c.strip() for c in re.split(r"(?<!\\)\|", row)]

        header = cells(self.lines[i])
        rows = []
        i += 2
        while i < len(self.lines) and "|" in self.lines[i] and self.lines[i].strip():
            rows.append(cells(self.lines[i]))
            i += 1
        width = len(header)
        self.blank()
        self.out += [".. list-table::", "   :header-rows: 1", ""]
        for row in [header] + rows:
            row = (row + [""] * width)[:width]
            for j, cell in enumerate(row):
                prefix = "   * - " if j == 0 else "     - "
                self.out.append(prefix + (_inline(cell.replace(r"\|", "|")) or r"\ "))
        self.out.append("")
        return i

    def _list(self, i: int) -> int:
        self.blank()
        base = len(_BULLET.match(self.lines[i]).group(1))
        previous = None
        while i < len(self.lines):
            line = self.lines[i]
            m = _BULLET.match(line)
            if m and len(m.group(1)) <= base + 1:
                marker = "-" if m.group(2) in "-*+" else "#."
                if previous is not None and marker != previous:
                    self.blank()  # a bullet list and an enumerated list are two lists
                previous = marker
                self.out.append(f"{marker} {self._inline_with_images(m.group(3))}")
                pad = " " * (len(marker) + 1)
                i += 1
                while i < len(self.lines) and self.lines[i].strip() and not _BULLET.match(self.lines[i]) \
                        and not _FENCE.match(self.lines[i]) and not _HEADING.match(self.lines[i]):
                    self.out.append(pad + self._inline_with_images(self.lines[i].strip()))
                    i += 1
                continue
            if m:  # nested item: flatten one level, keeping it readable
                self.out += ["", f"  - {self._inline_with_images(m.group(3))}", ""]
                i += 1
                continue
            if not line.strip() and i + 1 < len(self.lines) and _BULLET.match(self.lines[i + 1]):
                i += 1
                continue
            break
        self.blank()
        return i


def _parses_cleanly(rst: str) -> bool:
    """Whether docutils parses ``rst`` without any message of level WARNING or above."""
    settings = {"report_level": 5, "halt_level": 5, "warning_stream": False, "file_insertion_enabled": False,
                "raw_enabled": False, "syntax_highlight": "none"}
    try:
        doctree = publish_doctree(rst, settings_overrides=settings)
    except Exception:  # a role or directive that only works inside Sphinx (it needs the build environment)
        return False
    return not any(msg["level"] >= 2 for msg in doctree.findall(nodes.system_message))


class MarkdownFile(SphinxDirective):
    """``.. markdown-file:: PATH`` (path relative to the current page, like ``literalinclude``)."""

    required_arguments = 1
    has_content = False
    option_spec = {
        "optional": directives.flag,
        "verbatim": directives.flag,
        "start-after": directives.unchanged_required,
    }

    def run(self) -> list[nodes.Node]:
        rel, path = self.env.relfn2path(self.arguments[0], self.env.docname)
        shown = os.path.relpath(path, os.path.dirname(self.env.srcdir))
        if not os.path.isfile(path):
            if "optional" in self.options:
                logger.info("markdown-file: %s is not committed yet; rendering a placeholder", shown)
                note = nodes.note()
                para = nodes.paragraph()
                para += nodes.Text("This section shows ")
                para += nodes.literal(text=shown)
                para += nodes.Text(" once that file is committed; until then, run the commands above to "
                                   "produce your own.")
                note += para
                return [note]
            logger.warning("markdown-file: %s does not exist (add :optional: while it is not committed)",
                           shown, location=self.get_location())
            return []
        self.env.note_dependency(path)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        marker = self.options.get("start-after")
        if marker:
            head, found, tail = text.partition(marker)
            if not found:
                logger.warning("markdown-file: %r not found in %s", marker, shown, location=self.get_location())
            else:
                tail = tail.split("\n", 1)[1] if "\n" in tail else ""
                text = tail

        md_dir = os.path.dirname(path)
        doc_dir = os.path.dirname(self.env.doc2path(self.env.docname))

        def image_uri(img: str) -> str | None:
            full = os.path.normpath(os.path.join(md_dir, img))
            if not os.path.isfile(full):
                return None
            return os.path.relpath(full, doc_dir).replace(os.sep, "/")

        converter = _Converter(text, image_uri)
        rst = converter.convert()
        if "verbatim" in self.options or not _parses_cleanly(rst):
            if "verbatim" not in self.options:
                logger.info("markdown-file: %s shown verbatim (its converted text did not parse cleanly)", shown)
            figures = [line for line in text.splitlines() if _IMAGE_LINE.match(line)]
            rst = "\n".join([".. code:: markdown", ""] + ["   " + ln if ln.strip() else "" for ln in
                                                           text.splitlines()] + [""])
            fig_conv = _Converter("\n\n".join(figures), image_uri)
            rst += "\n" + fig_conv.convert()
        container = nodes.container(classes=["markdown-file"])
        self.state.nested_parse(StringList(rst.splitlines(), source=path), self.content_offset, container)
        return [container]


def _drop_foreign_docstrings(app, what, name, obj, options, lines) -> None:
    """Drop the docstring of a foreign object documented under one of our names.

    A dataclass field defaulting to ``torch.nn.functional.cross_entropy`` is a "method" to autodoc, which
    would show torch's docstring: neither ours nor necessarily valid reST under ``-W``.
    """
    if what in ("module", "class", "exception"):
        return
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and (callable(obj) or isinstance(obj, type)) \
            and not module.startswith("geoopt_stiefel_attention"):
        lines[:] = []


def _remove_stale_stubs(app) -> None:
    """Delete the stub pages autosummary wrote in an earlier build (it never removes a stale one, and a
    stub for a module that is gone or no longer exported is an orphan page: a warning under ``-W``)."""
    import shutil

    generated = os.path.join(app.srcdir, "generated")
    if os.path.isdir(generated):
        shutil.rmtree(generated, ignore_errors=True)


def setup(app):
    app.setup_extension("sphinx.ext.autodoc")
    app.add_directive("markdown-file", MarkdownFile)
    app.connect("builder-inited", _remove_stale_stubs, priority=100)  # before autosummary writes new ones
    app.connect("autodoc-process-docstring", _drop_foreign_docstrings)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
