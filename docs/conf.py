"""Sphinx configuration: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # for _apidoc
sys.path.insert(0, str(HERE.parent))

# The API reference is generated from the code at every build (docs/_apidoc.py), so it cannot drift.
import _apidoc  # noqa: E402

_apidoc.write_api_pages(HERE / "api")

project = "apex"
author = "apex contributors"
copyright = "the apex contributors"  # noqa: A001
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"

autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False
autodoc_mock_imports: list[str] = []
autoclass_content = "both"
napoleon_google_docstring = True
napoleon_numpy_docstring = True
# Type hints name torch types Sphinx cannot resolve; they are rendered as text, not errors.
nitpicky = False

html_theme = "furo"
html_title = "apex"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_extra_path: list[str] = []

# The benchmark figure lives next to the report; copy it into the build.
html_copy_source = False

# Doctests run on the CPU with the PyTorch backend; keep them small.
os.environ.setdefault("APEX_BACKEND", "torch")
doctest_global_setup = """
import warnings
import torch
warnings.simplefilter("ignore")  # amp's one-off SlowHalfWarning on CPUs without bf16 hardware
torch.manual_seed(0)
"""


def _skip_self_alias(app, what, name, obj, skip, options):
    # ``LARC.LARC = LARC`` keeps upstream's ``apex.parallel.LARC.LARC`` path working; documenting that
    # attribute would recurse forever.
    if isinstance(obj, type) and getattr(obj, name, None) is obj:
        return True
    return None


# MathJax: the pages work offline (CI, air-gapped machines) with a local copy of MathJax 3's
# self-contained SVG bundle from the ``sphinx-mathjax-offline`` package (a docs extra); without it the
# default CDN copy is used.
_MATHJAX = importlib.util.find_spec("sphinx-mathjax-offline")
if _MATHJAX is not None and _MATHJAX.origin:
    _MATHJAX_JS = Path(_MATHJAX.origin).parent / "static" / "mathjax" / "tex-svg.js"
    if _MATHJAX_JS.exists():
        mathjax_path = "mathjax/tex-svg.js"


def _copy_mathjax(app, exc):
    if exc is None and app.builder.format == "html" and "mathjax_path" in globals():
        target = Path(app.outdir) / "_static" / "mathjax"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_MATHJAX_JS, target / "tex-svg.js")


def setup(app):
    app.connect("autodoc-skip-member", _skip_self_alias)
    app.connect("build-finished", _copy_mathjax)
