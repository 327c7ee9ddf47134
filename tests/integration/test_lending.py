"""The loop thread lent to a caller: while a caller holds it nothing of the loop runs, and it
goes back to work when let go, when its lingering time is over, or when it is needed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from rabit2.io.loop_thread import LEND_MAX, LoopThread


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_thread(request: pytest.FixtureRequest) -> Iterator[LoopThread]:
    lt = LoopThread(request.param)
    yield lt
    lt.stop()


def _ran(lt: LoopThread) -> threading.Event:
    """A callback handed to the loop the plain way (no wake-up), and whether it ran."""
    ran = threading.Event()
    lt.loop.call_soon_threadsafe(ran.set)
    return ran


def test_nothing_of_the_loop_runs_while_a_caller_holds_it(loop_thread: LoopThread) -> None:
    assert loop_thread.hold(5)
    ran = _ran(loop_thread)
    assert not ran.wait(0.3)
    loop_thread.release(0.0)
    assert ran.wait(5)


def test_a_released_loop_lingers_then_runs_again(loop_thread: LoopThread) -> None:
    assert loop_thread.hold(5)
    loop_thread.release(0.05)
    ran = _ran(loop_thread)
    assert ran.wait(5)  # (after its lingering time: at most LEND_MAX since it parked)
    # the next hold parks it again
    assert loop_thread.hold(5)
    loop_thread.release(0.0)


def test_a_lingering_loop_runs_at_once_when_it_is_needed(loop_thread: LoopThread) -> None:
    assert loop_thread.hold(5)
    loop_thread.release(30.0)  # (capped at LEND_MAX; wake cuts it short)

    async def answer() -> int:
        return 42

    start = time.monotonic()
    assert loop_thread.run(answer(), 5) == 42
    assert time.monotonic() - start < LEND_MAX + 5


def test_a_second_caller_does_not_get_a_held_loop(loop_thread: LoopThread) -> None:
    assert loop_thread.hold(5)
    got: list[bool] = []
    other = threading.Thread(target=lambda: got.append(loop_thread.hold(0.2)))
    other.start()
    other.join(10)
    assert got == [False]
    loop_thread.release(0.0)
    assert loop_thread.hold(5)
    loop_thread.release(0.0)


def test_a_held_loop_is_usable_from_the_holding_thread(loop_thread: LoopThread) -> None:
    # what a driven call does: use the loop's objects from the caller's thread while held
    assert loop_thread.hold(5)
    fired = threading.Event()
    loop_thread.loop.call_later(0.01, fired.set)
    loop_thread.release(0.0)
    assert fired.wait(5)


def test_stop_ends_a_lingering_loop(loop_thread: LoopThread) -> None:
    assert loop_thread.hold(5)
    loop_thread.release(30.0)
    start = time.monotonic()
    loop_thread.stop()
    assert loop_thread.loop.is_closed()
    assert time.monotonic() - start < 5


def test_a_loop_held_call_after_call_still_runs_its_timers(loop_thread: LoopThread) -> None:
    # a training loop of small calls: held, let go, held again at once; the loop must still
    # run its timers and I/O (the tracker's heartbeats) about every LEND_MAX
    ticks: list[float] = []

    def beat() -> None:
        ticks.append(time.monotonic())
        loop_thread.loop.call_later(0.01, beat)

    loop_thread.call_soon_threadsafe(beat)
    assert loop_thread.hold(5)
    loop_thread.release(0.0)
    start = time.monotonic()
    while time.monotonic() - start < 20 * LEND_MAX:
        assert loop_thread.hold(5)
        loop_thread.release(1.0)
    during = [t for t in ticks if t >= start]
    assert len(during) >= 5, during  # (about 20 expected; never starved)


def test_what_is_handed_to_a_held_loop_runs_when_it_is_let_go(loop_thread: LoopThread) -> None:
    assert loop_thread.hold(5)
    ran = threading.Event()
    loop_thread.call_soon_threadsafe(ran.set)  # (wants the loop: no lingering after release)
    assert not ran.wait(0.2)
    loop_thread.release(30.0)
    assert ran.wait(5)
