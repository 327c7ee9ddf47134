"""For every folder: ``--slow`` (the soak tests, deselected without it) and the markers it
acts on; an error that an event loop reports instead of raising fails the test it happened
in.

Warnings are errors (``filterwarnings`` in pyproject.toml), and with them the exceptions
pytest reports as warnings: one raised in a thread and never caught, one raised where
Python can only print it (a ``__del__``, a callback of the garbage collector).  An event
loop, asyncio's or uvloop's, in a test or in an engine's or a tracker's thread, does
neither: an exception in a callback, or a task's that nobody retrieved, goes to the loop's
exception handler, whose default only logs it on the ``asyncio`` logger.  Those records
are collected here and fail the test during which they were logged.
"""

from __future__ import annotations

import compileall
import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False, help="run soak tests")


def _soaks_run(config: pytest.Config) -> bool:
    return bool(config.getoption("--slow")) or os.environ.get("RABIT2_SLOW") == "1"


def pytest_report_header(config: pytest.Config) -> str:
    return ("soak tests: run" if _soaks_run(config)
            else "soak tests: deselected (run them with --slow or RABIT2_SLOW=1)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the checkout's packages once.  The jobs of the tests start thousands of
    Python processes that import rabit2 from this checkout; where bytecode is not written
    (``PYTHONDONTWRITEBYTECODE``, common in containers) each of them would compile the
    sources again, some 0.1 s of CPU apiece.  Reading bytecode is not turned off by that
    setting, and a stale file is compiled afresh as always."""
    root = Path(__file__).resolve().parent.parent
    for package in ("rabit2", "tracker", "tests"):
        compileall.compile_dir(root / package, quiet=2, workers=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # deselected rather than skipped: some 17 000 skips cost the default run about 10 s
    if _soaks_run(config):
        return
    soaks = [item for item in items if "slow" in item.keywords]
    if soaks:
        config.hook.pytest_deselected(items=soaks)
        items[:] = [item for item in items if "slow" not in item.keywords]


class LoopErrors(logging.Handler):
    """What event loops' default exception handlers logged (at ERROR, on ``asyncio``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reports.append(self.format(record))

    def take(self) -> str:
        """Everything logged since the last call, one report after another."""
        reports, self.reports = self.reports, []
        return "\n\n".join(reports)


@pytest.fixture(scope="session", autouse=True)
def loop_errors() -> Iterator[LoopErrors]:
    handler = LoopErrors()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    yield handler
    # a task dropped with an exception nobody retrieved reports it when it is collected
    gc.collect()
    logger.removeHandler(handler)
    if reports := handler.take():
        pytest.fail(f"an event loop reported an error after the last test:\n{reports}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _loop_errors_fail_the_test(loop_errors: LoopErrors) -> Iterator[None]:
    # (set up before, and so torn down after, the fixtures that start loops and engines)
    yield
    if reports := loop_errors.take():
        pytest.fail("an event loop reported an error while this test ran (or collected a task\n"
                    f"an earlier test left with one):\n{reports}", pytrace=False)


@pytest.fixture
def no_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No tracker, no inherited rabit2 settings (single-process mode); the communicator
    finalized before and after the test."""
    import rabit2  # noqa: PLC0415 - (only where a test asks for it)
    from rabit2.config import _ENV_KEYS  # noqa: PLC0415

    for key in _ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    rabit2.finalize()
    yield
    rabit2.finalize()
