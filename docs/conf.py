"""Sphinx configuration of the rabit2 documentation site.

Build it with ``python -m sphinx -b html docs docs/_build/html`` (the ``docs`` extra installs
what it needs).  The pages are the markdown files of this folder, read by MyST, as they read
on GitHub; the API reference (``api.md``) is autodoc over the docstrings.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from pygments.lexers.special import TextLexer

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# autodoc imports rabit2 and tracker from this checkout, not from wherever they are installed
sys.path.insert(0, str(ROOT))

project = "rabit2"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# README.md is the index on GitHub; index.md includes it
exclude_patterns = ["_build", "README.md", ".DS_Store"]

# the markdown links between pages name headings by their GitHub anchors (#error-model)
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
# a class's text and its __init__'s (the tracker's constructor says what it raises there)
autoclass_content = "both"
# rabit2.xgboost's dependencies (the xgboost extra) are not needed to document it
autodoc_mock_imports = ["xgboost", "grpc", "google.protobuf"]

html_theme = "alabaster"
html_title = "rabit2"
html_static_path: list[str] = []
html_show_sourcelink = False
html_show_sphinx = False

# --------------------------------------------------------------------- links out of docs/

# Markdown outside docs/ that the site carries, each included by a page of this folder:
# a link to one of them (as it reads on GitHub) goes to that page on the site.
_CARRIED = {
    ROOT / "bench" / "README.md": "benchmarks",
    ROOT / "bench" / "results" / "README.md": "benchmark-history",
}
_LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+\.md)(#[^)\s]*)?\)")


def _site_links(text: str, folder: Path) -> str:
    """Rewrite the relative ``.md`` links of a file in ``folder`` for the site: to a page of
    docs/ as a path from docs/, to a carried file as its page; the rest are left alone."""

    def one(match: re.Match[str]) -> str:
        target = (folder / match.group(1)).resolve()
        anchor = match.group(2) or ""
        if target in _CARRIED:
            return f"]({_CARRIED[target]}.md{anchor})"
        if target.parent == DOCS:
            return f"]({target.name}{anchor})"
        return match.group(0)

    return _LINK.sub(one, text)


def _on_source_read(app: Any, docname: str, source: list[str]) -> None:
    source[0] = _site_links(source[0], (DOCS / docname).parent)


def _on_include_read(app: Any, relative_path: Path, parent_docname: str,
                     content: list[str]) -> None:
    content[0] = _site_links(content[0], (DOCS / relative_path).parent)


def setup(app: Any) -> dict[str, Any]:
    # state-machine.md (generated) draws its diagram in a mermaid block: shown as its text
    app.add_lexer("mermaid", TextLexer)
    app.connect("source-read", _on_source_read)
    app.connect("include-read", _on_include_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
