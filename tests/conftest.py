"""For every folder: ``--slow`` (the soak tests) and the markers it acts on."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False, help="run soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow") or os.environ.get("RABIT2_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="soak test: run with --slow or RABIT2_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
