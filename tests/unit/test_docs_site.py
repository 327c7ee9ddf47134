"""The documentation site (``docs/conf.py``) builds with every warning an error, and its API
page documents every public name.

A broken cross-reference between the markdown pages, a docstring that is not valid
reStructuredText or a public module that no longer imports fails the build; a name added to
a module's ``__all__`` without an entry in ``docs/api.md`` fails the check of the page.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None,
    reason="sphinx is not installed (pip install '.[docs]' or '.[test]')",
)


def public_names(path: str) -> list[str]:
    """A module's ``__all__``, read from its source (rabit2.xgboost imports xgboost, which
    the build does not need)."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"):
            names: list[str] = ast.literal_eval(node.value)
            return names
    raise AssertionError(f"{path} has no __all__")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         str(ROOT / "docs"), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, f"the site does not build:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.mark.timeout(300)
def test_the_site_builds_without_warnings(site: Path) -> None:
    for page in ("index", "user-guide", "xgboost", "api", "design", "state-machine",
                 "benchmarks"):
        assert (site / f"{page}.html").is_file(), page


@pytest.mark.timeout(300)
def test_the_api_page_documents_every_public_name(site: Path) -> None:
    api = (site / "api.html").read_text(encoding="utf-8")
    modules = {"aio", "errors"}  # (rabit2.__all__ names two modules: each has a section)
    expected = [f"rabit2.{name}" for name in public_names("rabit2/__init__.py")
                if name not in modules]
    expected += [f"rabit2.errors.{name}" for name in public_names("rabit2/errors.py")]
    expected += [f"rabit2.collective.{name}" for name in public_names("rabit2/collective.py")]
    expected += [f"rabit2.xgboost.{name}" for name in public_names("rabit2/xgboost/__init__.py")]
    expected += [f"rabit2.aio.Communicator.{name}" for name in (
        "init", "finalize", "rank", "world_size", "allreduce", "broadcast", "allgather",
        "agree", "checkpoint", "load_checkpoint", "tracker_print")]
    expected += ["rabit2.aio.Communicator", "tracker.server.Tracker",
                 "tracker.server.TrackerThread", "tracker.server.JobResult"]
    missing = [name for name in expected if f'id="{name}"' not in api]
    assert not missing, f"docs/api.md does not document {missing}"


@pytest.mark.timeout(300)
def test_links_out_of_docs_lead_to_the_pages_that_carry_them(site: Path) -> None:
    # docs/README.md links ../bench/README.md, as GitHub shows it; the site has that page
    index = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="benchmarks.html"' in index
    assert 'href="../' not in index
