"""The worker's event loop, running forever in its own daemon thread.

The loop is uvloop where available, plain asyncio when ``RABIT2_LOOP=asyncio``.  API threads
hand it coroutines with :meth:`LoopThread.run`; a polling caller may switch the loop thread to
SCHED_BATCH (:meth:`LoopThread.set_batch`, :class:`~rabit2.io.waiting.Poller`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from rabit2.errors import CollectiveTimeoutError

logger = logging.getLogger("rabit2.engine")
T = TypeVar("T")


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """uvloop unless ``kind == "asyncio"`` or uvloop is not installed (e.g. Windows)."""
    if kind == "uvloop":
        try:
            import uvloop  # noqa: PLC0415 - optional at import time by design
        except ImportError:
            logger.info("uvloop not installed; using the asyncio loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self, kind: str) -> None:
        self.loop = new_event_loop(kind)
        self._batch = False
        self.is_uvloop = type(self.loop).__module__.startswith("uvloop")
        self._native_id = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rabit2-loop", daemon=True)
        self._thread.start()
        self._started.wait(10)
        # the loop thread's CPU time, readable from the caller (None where unsupported)
        self.cpu_clock: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.cpu_clock = time.pthread_getcpuclockid(self._thread.ident or 0)

    def _run(self) -> None:
        self._native_id = threading.get_native_id()
        self._started.set()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def set_batch(self, on: bool) -> None:
        """Switch the loop thread between SCHED_BATCH and the normal policy (any thread;
        Linux).  A batch thread woken by another thread of its process waits for that
        thread to block or yield instead of preempting it while it holds the GIL (which
        costs two more context switches per hand-off).  Only beside a polling caller
        (:class:`~rabit2.io.waiting.Poller`), which yields the CPU on every turn: a batch
        loop thread beside a busy thread that never yields would wait a whole time slice."""
        if self._batch is on or not self._native_id or _POLICIES is None:
            return
        self._batch = on
        batch, normal, param = _POLICIES
        try:
            os.sched_setscheduler(self._native_id, batch if on else normal, param)
        except OSError as exc:  # a container may forbid it; only latency suffers
            logger.debug("cannot set the loop thread's scheduling policy: %s", exc)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it; ``CollectiveTimeoutError`` past ``timeout``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise CollectiveTimeoutError(f"operation did not finish within {timeout:g} s") from None

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


_POLICIES: tuple[int, int, Any] | None = (
    (os.SCHED_BATCH, os.SCHED_OTHER, os.sched_param(0))
    if hasattr(os, "SCHED_BATCH") and hasattr(os, "sched_setscheduler") else None
)
"""(batch, normal, parameter) where the OS has scheduling policies (Linux)."""


def bind_to_cpu(cpus: str | None) -> None:
    """Pin this process (before the loop thread starts, so it inherits the mask) to the
    comma-separated CPUs of ``RABIT2_BIND_CPU``.

    ``rabit2-submit --bind`` starts its workers pinned already (so that thread pools made
    at import are sized for it) and sets the variable too; other launchers may set it
    alone.  With the API thread and the loop thread on one core, handing a call to the loop
    is a context switch instead of a cross-core wake-up.
    """
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    except (ValueError, OSError) as exc:
        logger.warning("cannot bind to CPUs %s: %s", cpus, exc)
