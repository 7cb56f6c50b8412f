"""One statement of the update (issue 39, item 5): the algorithm box of :class:`StiefelAdam`'s docstring is the
source; the box of ``docs/index.rst`` ("The update") and the README's plain-text box say the same, line for line.

The docstring and the docs page are LaTeX, the README is plain text; :func:`plain` renders a LaTeX line as the
README writes it (``\\beta_1`` -> ``β1``, ``\\frac{a}{b}`` -> ``(a) / (b)``, ...) and :func:`canonical` drops what
only typesets (spaces, ``·`` for a product, the annotations after ``&&`` or ``\\qquad``), so that the three are
compared as formulas. Companions: the docs' former box (without the step scale ``c``) and a README line with a
changed exponent are caught.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from geoopt_stiefel_attention import StiefelAdam

ROOT = Path(__file__).resolve().parents[1]

#: LaTeX -> the README's plain text, applied in order after ``\frac`` and ``\sqrt`` are rewritten.
_PLAIN = [
    (r"\leftarrow", "←"), (r"\operatorname{sym}", "sym"), (r"\operatorname{polar}", "polar"),
    (r"\mathrm{lr}", "lr"), (r"\xi", "ξ"), (r"\beta_1^t", "β1ᵗ"), (r"\beta_2^t", "β2ᵗ"), (r"\beta_1", "β1"),
    (r"\beta_2", "β2"), (r"\epsilon", "eps"), (r"\Delta", "Δ"), (r"^\top", "ᵀ"), (r"\|", "‖"), ("_F^2", "²_F"),
    (r"\cdot", "·"), (r"\min", "min"), (r"\big(", "("), (r"\big)", ")"), (r"\!", ""), (r"\,", ""), ("&", ""),
]


def _braced(text: str, start: int) -> tuple[str, int]:
    """The content of the ``{...}`` group opening at ``text[start]`` and the index after it."""
    assert text[start] == "{", text[start:]
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i], i + 1
    raise ValueError(f"unbalanced braces in {text!r}")


def _macros(text: str) -> str:
    """``\\frac{a}{b}`` -> ``(a) / (b)`` and ``\\sqrt{x}`` -> ``sqrt(x)``, innermost groups included."""
    for name in (r"\frac", r"\sqrt"):
        while name in text:
            i = text.index(name)
            first, j = _braced(text, i + len(name))
            if name == r"\frac":
                second, j = _braced(text, j)
                text = f"{text[:i]}({_macros(first)}) / ({_macros(second)}){text[j:]}"
            else:
                text = f"{text[:i]}sqrt({_macros(first)}){text[j:]}"
    return text


def plain(latex: str) -> str:
    """One line of a LaTeX algorithm box as the README writes it (annotations dropped)."""
    line = re.split(r"&&|\\qquad", latex)[0].strip()
    line = _macros(line)
    for old, new in _PLAIN:
        line = line.replace(old, new)
    return line


def canonical(line: str) -> str:
    """A formula without what only typesets: spaces and the product dot; one minus sign."""
    return re.sub(r"[\s·]", "", line).replace("−", "-")


def _math_block(text: str, after: str) -> list[str]:
    """The equations (split at ``\\\\``) of the first ``.. math::`` block after the marker ``after`` in a reST
    text or docstring; an equation may continue on the next line (``&& \\text{...}``)."""
    rest = text[text.index(after):]
    lines = rest[rest.index(".. math::"):].splitlines()[1:]
    body: list[str] = []
    indent = 0
    for line in lines:
        if line.strip() and not body:
            indent = len(line) - len(line.lstrip())
        elif body and line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        if line.strip():
            body.append(line.strip())
        elif body:
            break
    return [eq.strip() for eq in " ".join(body).split("\\\\") if eq.strip()]


def docstring_box() -> list[str]:
    return [canonical(plain(line)) for line in _math_block(StiefelAdam.__doc__, "is updated by")]


def docs_box(text: str | None = None) -> list[str]:
    text = (ROOT / "docs" / "index.rst").read_text(encoding="utf-8") if text is None else text
    return [canonical(plain(line)) for line in _math_block(text, ".. _the-update:")]


def readme_box(text: str | None = None) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8") if text is None else text
    section = text[text.index("## The update"):]
    block = section.split("```")[1].splitlines()[1:]
    # each line: the formula, then two or more spaces and the annotation
    return [canonical(re.split(r"\s{2,}", line.strip())[0]) for line in block if line.strip()]


def test_the_docstring_box_is_the_seven_steps():
    box = docstring_box()
    assert len(box) == 7
    assert box[0] == "ξ=G-Wsym(WᵀG)" and box[3] == "s=clr(m/(1-β1ᵗ))/(sqrt(v/(1-β2ᵗ))+eps)"


def test_docs_index_states_the_docstrings_update():
    assert docs_box() == docstring_box()


def test_readme_states_the_docstrings_update():
    assert readme_box() == docstring_box()


def test_the_step_scale_is_defined_where_the_update_is_stated():
    """Each statement says what ``c`` is: √(dr) by default, 1 for the paper's step."""
    assert r"c = \sqrt{d r}" in StiefelAdam.__doc__
    index = (ROOT / "docs" / "index.rst").read_text(encoding="utf-8")
    assert r"c = \sqrt{d r}" in index and r"c = 1" in index
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "c = √(dr) by default, 1 for the paper's step" in readme


@pytest.mark.parametrize("changed", ["docs", "readme"])
def test_a_drifted_statement_is_caught(changed):
    """Companion: the docs' former box, which left out ``c`` (the √(dr) of the default ``adjust_lr_fn``), and a
    README whose second moment lost its square, both differ from the docstring's box."""
    if changed == "docs":
        old = ("x\n\n.. _the-update:\n\n.. math::\n\n"
               r"   s &= \mathrm{lr} \cdot \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon} \\"
               "\n\nafter\n")
        assert docs_box(old) == ["s=lr(m/(1-β1ᵗ))/(sqrt(v/(1-β2ᵗ))+eps)"]
        assert docs_box(old)[0] != docstring_box()[3]
    else:
        readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("‖ξ‖²_F", "‖ξ‖_F", 1)
        assert readme_box(readme) != docstring_box()
