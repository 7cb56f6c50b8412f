"""Sphinx configuration of the geoopt-stiefel-attention documentation.

Build (warnings are errors; ``tests/test_docs.py`` runs exactly this)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "_ext"))
if ROOT not in sys.path:  # the package imports from the checkout even when it is not installed
    sys.path.insert(0, ROOT)

import geoopt_stiefel_attention  # noqa: E402

project = "geoopt-stiefel-attention"
author = "geoopt-stiefel-attention developers"
copyright = "geoopt-stiefel-attention developers"
release = geoopt_stiefel_attention.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
    "gsa_docs",  # docs/_ext/gsa_docs.py: the ``markdown-file`` directive for committed READMEs and reports
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]
root_doc = "index"
language = "en"
today_fmt = "%Y-%m-%d"
default_role = "py:obj"  # `name` in running text links to a Python object, as in numpydoc
pygments_style = "sphinx"

# -- autodoc / autosummary --------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autosummary_ignore_module_all = False  # module pages list what the module's __all__ exports
autodoc_typehints = "none"  # the numpydoc "Parameters" sections carry the types
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    # document members inherited from our own private bases (e.g. ``forward`` of the attention modules),
    # not the whole of torch.nn.Module / torch.optim.Optimizer / geoopt.optim.RiemannianAdam
    "inherited-members": "Module, Optimizer, RiemannianAdam, OptimMixin, EuclideanStiefel, Stiefel, Manifold",
}
autodoc_mock_imports: list[str] = []

# -- napoleon (our docstrings are numpydoc) --------------------------------------------------------------
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True  # "Attributes" as a field list: no duplicate object descriptions with autodoc
napoleon_use_param = True
napoleon_use_rtype = False
napoleon_preprocess_types = False
# StiefelAdam's docstring ends with a "Scope and warnings" list (see the design notes); render it as its own
# titled section instead of letting the underline read as a reST section title.
napoleon_custom_sections = ["Scope and warnings"]

# -- doctest (``.. doctest::`` blocks in the pages; tests/test_docs.py runs the examples directly) -----------
doctest_global_setup = "import torch\ntorch.manual_seed(0)"

# -- maths ------------------------------------------------------------------------------------------------
# MathJax 3.2.2 is vendored (docs/_static/mathjax: the ``tex-chtml.js`` component and its woff-v2 fonts from
# the npm package ``mathjax@3.2.2``, Apache-2.0, LICENSE alongside), so the built pages render their maths
# without a network. Only the optional speech/explorer tools of MathJax's right-click menu would fetch
# more (and fail quietly offline). tests/test_docs.py checks that no page loads a remote script.
mathjax_path = "mathjax/tex-chtml.js"  # relative to html_static_path
math_number_all = False

# -- HTML -------------------------------------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"{project} {release}"
html_static_path = ["_static"]
html_theme_options = {
    "description": "Stiefel-constrained attention on top of geoopt",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_show_sourcelink = True
