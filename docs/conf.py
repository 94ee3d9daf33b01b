"""Sphinx configuration for the celery_redsem documentation (theme: furo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celery_redsem

ROOT = Path(__file__).resolve().parent.parent

project = "celery_redsem"
author = "celery_redsem developers"
copyright = "celery_redsem developers"
release = celery_redsem.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_click",
]

html_theme = "furo"
html_title = f"celery_redsem {release}"
html_static_path: list[str] = []
exclude_patterns = ["_build"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The changelog lives in ../CHANGELOG.md (Markdown, no MyST here): show it verbatim when present.
CHANGELOG = ROOT / "CHANGELOG.md"


def _include_changelog(app: Any, docname: str, source: list[str]) -> None:
    if docname != "changelog":
        return
    if CHANGELOG.exists():
        source[0] += "\n.. literalinclude:: ../CHANGELOG.md\n   :language: markdown\n"
    else:
        source[0] += "\n*CHANGELOG.md is not in this checkout.*\n"


def setup(app: Any) -> None:
    app.connect("source-read", _include_changelog)
