"""How an API thread waits for the loop thread to finish its call (``docs/design.md``,
"Waiting"): a :class:`Waiter` carries the outcome across, a :class:`Poller` decides whether
the caller polls for it before it sleeps."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from rabit2.io.loop_thread import LoopThread

logger = logging.getLogger("rabit2.engine")

yield_cpu: Callable[[], Any] = getattr(os, "sched_yield", lambda: time.sleep(0))
SLICE = 1e-3
"""While a caller polls: other threads of its CPU ran this long between two of its turns
(not the loop thread, which is doing the call's work) = the CPU is contended."""


class Backoff:
    """How many calls in a row wait without polling once polling found the CPU contended:
    16, doubling while it keeps happening, up to 65536, and 16 again after a call that
    polled undisturbed (:class:`Poller`, and the driver of calls made on the caller's
    thread)."""

    __slots__ = ("next", "skip")

    FIRST = 16
    LAST = 65536

    def __init__(self) -> None:
        self.skip = 0  # calls left that wait without polling
        self.next = self.FIRST  # how many the next contention skips

    def contended(self) -> None:
        """Polling found the CPU contended: the next ``next`` calls do not poll."""
        self.skip = self.next
        self.next = min(self.next * 2, self.LAST)

    def calm(self) -> None:
        """A call polled undisturbed."""
        self.next = self.FIRST


class Poller:
    """How a caller waits for its call (``docs/design.md``, "Waiting"): poll for up to
    ``spin`` seconds, yielding the CPU on every turn, with the loop thread SCHED_BATCH, then
    sleep.  If other threads of this CPU held it for a time slice meanwhile (a compute
    thread, a BLAS pool spinning after its last call), polling hands them the CPU and the
    batch loop thread waits behind them: the caller then sleeps at once and the loop thread
    goes back to the normal policy for the next calls (:class:`Backoff`), after which
    polling is tried again."""

    def __init__(self, spin: float, loop_thread: LoopThread) -> None:
        self.spin = spin
        self.loop_thread = loop_thread
        self.backoff = Backoff()

    def wait(self, waiter: Waiter, timeout: float) -> bool:
        if self.spin > 0.0:
            backoff = self.backoff
            if backoff.skip:
                backoff.skip -= 1
                if not backoff.skip:
                    self.loop_thread.set_batch(True)
            elif self._poll(waiter):
                logger.debug("CPU contended while polling: sleeping for the next %d calls",
                             backoff.next)
                self.loop_thread.set_batch(False)
                backoff.contended()
            else:
                backoff.calm()
        return waiter.lock.acquire(True, timeout)

    def _poll(self, waiter: Waiter) -> bool:
        """Poll until the call finishes or ``spin`` passes; True if the CPU was contended."""
        yield_cpu()  # (first: the loop thread takes the call at once)
        clock = time.perf_counter
        start = now = clock()
        end = start + self.spin
        loop_clock = self.loop_thread.cpu_clock
        loop_cpu = _cpu_time(loop_clock)
        mine = time.thread_time()
        while not waiter.finished and now < end:
            yield_cpu()
            last, now = now, clock()
            if now - last > SLICE:
                # a long turn: the loop thread doing the call's work, or someone else?
                used = time.thread_time() - mine + _cpu_time(loop_clock) - loop_cpu
                if (now - start) - used > SLICE:
                    return True
        return False


def _cpu_time(clock_id: int | None) -> float:
    """CPU seconds of the thread behind ``clock_id`` (0.0 if unknown or gone)."""
    if clock_id is None:
        return 0.0
    try:
        return time.clock_gettime(clock_id)
    except OSError:
        return 0.0


class Waiter:
    """Completion of one call, handed from the loop thread to the caller.

    A bare lock is the cheapest cross-thread wake-up CPython has (a concurrent.futures
    Future adds a Condition and costs ~12 us more per call on this path).  Before it sleeps
    on the lock, the caller may poll ``finished`` (:class:`Poller`).
    """

    __slots__ = ("error", "finished", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.error: BaseException | None = None
        self.finished = False

    def finish(self, error: BaseException | None) -> None:
        if not self.finished:
            self.finished = True
            self.error = error
            self.lock.release()
