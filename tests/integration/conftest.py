"""Fixtures of the tests that run real engines and jobs: both event loops."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    """Every engine test runs under both loops."""
    return str(request.param)
