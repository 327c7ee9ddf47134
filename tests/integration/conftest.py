"""Fixtures of the tests that run real engines and jobs: both event loops; and the warnings
rabit2's own code is known to raise, ignored only in the tests that show them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

# test name -> warning filters (pytest's "action:message:category") that only it gets, for a
# leak in rabit2 itself that warnings-as-errors (pyproject.toml) found: to be fixed there,
# and then removed here
KNOWN_LEAKS: dict[str, tuple[str, ...]] = {
    # rabit2/io/connections.py, _accept_loop: when the peer port holds more unfinished
    # handshakes than it admits it cancels the oldest one's task; a task cancelled before it
    # first ran never reaches the sock.close() in _accept_one, so the accepted socket is left
    # to the garbage collector.  Seen on asyncio's loop only, whose sock_accept returns
    # without yielding while connections are waiting, so a flood queues unstarted tasks.
    "test_a_flood_of_idle_connections_on_a_peer_port_is_bounded": (
        "ignore:unclosed <socket.socket:ResourceWarning",
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for spec in KNOWN_LEAKS.get(getattr(item, "originalname", ""), ()):
            item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(autouse=True)
def _collect_known_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test with a known leak, collect it while that test's filters still apply."""
    yield
    if getattr(request.node, "originalname", "") in KNOWN_LEAKS:
        gc.collect()


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    """Every engine test runs under both loops."""
    return str(request.param)
