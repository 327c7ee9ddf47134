"""The worker's event loop, running forever in its own daemon thread, and lent to callers.

The loop is uvloop where available, plain asyncio when ``RABIT2_LOOP=asyncio``.  API threads
hand it coroutines with :meth:`LoopThread.run`; a polling caller may switch the loop thread to
SCHED_BATCH (:meth:`LoopThread.set_batch`, :class:`~rabit2.io.waiting.Poller`).

**Lending** (``docs/design.md``, "The caller drives its call").  The loop thread can *park*:
block inside one of its own callbacks, so that nothing of the loop runs.  While it is parked,
one caller may *hold* it (:meth:`LoopThread.hold`) and use the loop's objects from its own
thread (the agent, the transports, timers): they are then touched by one thread at a time, as
when the loop runs them.  After a caller lets go (:meth:`LoopThread.release`) the loop stays
parked for ``linger`` seconds, so the next call of a training loop finds it parked and takes
it without waking another thread; then, or after ``LEND_MAX`` seconds parked in all, it runs
again (timers, heartbeats, the tracker's notices, a recovering neighbour's requests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rabit2.errors import CollectiveTimeoutError

logger = logging.getLogger("rabit2.engine")
T = TypeVar("T")

LEND_MAX = 0.1
"""The longest the loop stays parked across calls that follow each other closely: then it runs
its timers and I/O once (heartbeats, the tracker's notices) and the next call parks it again."""


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
        # lending (see the module docstring); every field below is guarded by _gate
        self._gate = threading.Condition(threading.Lock())
        self._parked = False  # the loop thread is blocked in _park
        self._park_asked = False  # a _park callback is scheduled and has not run yet
        self._held = False  # a caller holds the parked loop
        self._claiming = False  # a caller waits for the loop to park, to hold it
        self._resume_at = 0.0  # (monotonic) when the parked, unheld loop runs again
        self._wanted = False  # the loop must run as soon as no caller holds it
        self._parked_since = 0.0
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

    # ------------------------------------------------------------------ lending

    def _park(self) -> None:
        """(On the loop thread.)  Block until no caller holds the loop and its lingering time
        is over, or someone needs it to run (:meth:`wake`)."""
        gate = self._gate
        with gate:
            self._park_asked = False
            self._parked = True
            self._parked_since = time.monotonic()
            gate.notify_all()
            while True:
                wait = self._resume_at - time.monotonic()
                if not (self._held or self._claiming) and (wait <= 0 or self._wanted):
                    break
                # (a caller that lets go with time left to linger does not wake this thread:
                # it looks again when that time is over, or after LEND_MAX while held)
                gate.wait(LEND_MAX if self._held or self._claiming else wait)
            self._parked = self._wanted = False
            gate.notify_all()

    def hold(self, timeout: float) -> bool:
        """(On a caller's thread.)  Take the loop: park it if it runs (a hand-off to the loop
        thread, once per lingering period) and hold it.  False if it did not park within
        ``timeout`` seconds, or is held already (a second caller thread): the call then goes
        to the loop as before."""
        gate = self._gate
        with gate:
            if self._held:
                return False
            if self._parked and time.monotonic() - self._parked_since >= LEND_MAX:
                # parked this long across calls that follow each other closely: it runs
                # once (heartbeats, timers, the tracker's notices) before it is held again
                self._wanted = True
                gate.notify_all()
                if not gate.wait_for(lambda: not self._parked, timeout):
                    return False
            if not self._parked:
                if not self._park_asked:
                    self._park_asked = True
                    self.loop.call_soon_threadsafe(self._park)
                self._claiming = True
                try:
                    parked = gate.wait_for(lambda: self._parked, timeout)
                finally:
                    self._claiming = False
                if not parked or self._held:
                    gate.notify_all()
                    return False
            self._held = True
            return True

    def release(self, linger: float) -> None:
        """(On the holding caller's thread.)  Let go of the loop; it stays parked for
        ``linger`` more seconds (0: it runs at once), but never more than ``LEND_MAX``
        in all since it parked."""
        gate = self._gate
        with gate:
            now = time.monotonic()
            self._held = False
            self._resume_at = min(now + linger, self._parked_since + LEND_MAX)
            if self._resume_at <= now or self._wanted:
                gate.notify_all()

    def wake(self) -> None:
        """The loop must run now (a coroutine or callback was handed to it): end the
        lingering of a parked loop that no caller holds."""
        gate = self._gate
        with gate:
            if self._parked or self._park_asked:
                self._wanted = True
                gate.notify_all()

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: object) -> None:
        """``loop.call_soon_threadsafe`` that also wakes a lingering loop."""
        self.loop.call_soon_threadsafe(callback, *args)
        self.wake()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it; ``CollectiveTimeoutError`` past ``timeout``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.wake()
        try:
            return fut.result(min(timeout, threading.TIMEOUT_MAX))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise CollectiveTimeoutError(f"operation did not finish within {timeout:g} s") from None

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call_soon_threadsafe(self.loop.stop)
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


_PR_SET_PDEATHSIG = 1


def die_with_launcher(launcher_pid: str | None) -> None:
    """Die with the launcher (``RABIT2_LAUNCHER_PID``, set by ``rabit2-submit --cluster
    local``): where this process is its child, Linux sends it SIGKILL when the launcher
    dies, even one SIGKILLed itself, so that no worker computes on for a job that is gone.
    A launcher that is already gone: this process goes too."""
    if not launcher_pid or not sys.platform.startswith("linux"):
        return
    try:
        parent = int(launcher_pid)
    except ValueError:
        logger.warning("RABIT2_LAUNCHER_PID=%r is not a process id", launcher_pid)
        return
    if os.getppid() != parent:
        return  # (started through another process, e.g. a shell: not the launcher's child)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as exc:
        logger.warning("cannot tie this worker's life to its launcher's: %s", exc)
        return
    if os.getppid() != parent:  # (it died before the request took effect)
        os.kill(os.getpid(), signal.SIGKILL)
