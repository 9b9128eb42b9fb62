"""Sphinx configuration of the optax_kahan documentation.

Build it (warnings are errors, as in CI):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optax_kahan  # noqa: E402

project = "optax_kahan"
author = "the optax_kahan authors"
copyright = "2026, the optax_kahan authors"  # noqa: A001
release = optax_kahan.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax served from the site's own _static/ (it renders offline).
    "sphinx-mathjax-offline",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# The API reference is written by hand as autodoc entries (docs/api.md);
# autosummary only draws the overview tables, with no generated pages.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# The docstrings' type hints name jax, optax and flax types that this site does
# not document: do not try to cross-reference them.
nitpicky = False

html_theme = "furo"
html_title = "optax_kahan"
html_static_path = ["_static"]
html_css_files = ["fit.css"]
