"""The layers stay sealed: a pure core, the I/O layer over it, the API over both, and the
tracker apart (docs/design.md, "Three layers, one import direction").  Checked on the
source, so a stray import fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "rabit2"

# what the sans-I/O core must never touch: it is driven by events and told the time, and
# its one source of entropy is os.urandom (for nonces, in control.py)
FORBIDDEN_IN_CORE = {"asyncio", "socket", "time", "threading", "selectors", "select",
                     "uvloop", "subprocess", "signal", "random", "secrets", "datetime"}
OS_IN_CORE = {PACKAGE / "core" / "control.py"}

# the API layer (what rabit2/io must not import; configuration, errors and logging are shared)
API_MODULES = ("rabit2.api", "rabit2.aio", "rabit2.xgboost", "rabit2.collective",
               "rabit2.state", "rabit2.calls", "rabit2.checkpoints", "rabit2.live",
               "rabit2.device", "rabit2.dask", "tracker")


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("rabit2")  # (relative imports stay inside the package)
            elif node.module is not None:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(PACKAGE / "core"), ids=lambda p: p.name)
def test_core_is_sans_io(path: Path) -> None:
    bad = {name for name in _imports(path) if name.split(".")[0] in FORBIDDEN_IN_CORE
           or (name.split(".")[0] == "os" and path not in OS_IN_CORE)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the core does no I/O"


@pytest.mark.parametrize("path", _modules(PACKAGE / "core"), ids=lambda p: p.name)
def test_core_imports_nothing_above_it(path: Path) -> None:
    above = {name for name in _imports(path)
             if name.startswith(("rabit2.io", "rabit2.api", "rabit2.aio", "rabit2.xgboost",
                                 "rabit2.collective", "tracker"))}
    assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


@pytest.mark.parametrize("path", _modules(PACKAGE / "io"), ids=lambda p: p.name)
def test_io_does_not_import_the_api(path: Path) -> None:
    above = {name for name in _imports(path) if name.startswith(API_MODULES)}
    assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


# launchers that live in the library's namespace: they start a tracker beside the caller
LAUNCHERS = {PACKAGE / "dask.py"}


@pytest.mark.parametrize("path", [path for path in _modules(PACKAGE) if path not in LAUNCHERS],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_library_does_not_import_the_tracker(path: Path) -> None:
    bad = {name for name in _imports(path) if name.split(".")[0] == "tracker"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the tracker is apart"


def test_a_launcher_is_imported_by_nothing_else_in_the_library() -> None:
    """(So the worker side never pulls in the tracker through one.)"""
    for path in _modules(PACKAGE):
        names = _imports(path)
        for launcher in LAUNCHERS:
            module = "rabit2." + launcher.stem
            assert path == launcher or module not in names, f"{path} imports {module}"


def test_api_does_not_touch_the_agent() -> None:
    """The API thread talks to the engine; only the engine's loop thread drives the agent."""
    for name in ("api.py", "state.py", "calls.py", "checkpoints.py", "live.py", "aio.py",
                 "collective.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        touched = [node.lineno for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr == "agent"]
        assert not touched, f"rabit2/{name} reaches into the agent at lines {touched}"
        assert not any(n.startswith("rabit2.core.agent") for n in _imports(PACKAGE / name))


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """(A checker that finds nothing proves nothing: it must see one.)"""
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom asyncio import sleep\nfrom . import x\n")
    assert {"time", "asyncio", "rabit2"} <= _imports(bad)
