"""The rabit2 tracker for callers: :class:`Tracker` (asyncio, ``tracker/service.py``) and
:class:`TrackerThread`, a tracker on its own event loop for synchronous code such as the
launcher.  The job's decisions are ``tracker/registry.py``'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from tracker.registry import REJOIN_GRACE_SEC, SILENCE_REASON, natural_key
from tracker.service import JobResult, Tracker


class TrackerThread:
    """A :class:`Tracker` on its own event loop in a daemon thread, for synchronous callers.

    Every method is safe to call from any thread.  Apart from the constructor (which
    raises ``ValueError`` as :class:`Tracker`'s does) only :meth:`start` raises.
    """

    def __init__(self, n_workers: int, **kwargs: Any) -> None:
        """Same arguments as :class:`Tracker`, and the same ``ValueError`` for bad ones."""
        self.tracker = Tracker(n_workers, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rabit2-tracker", daemon=True)
        self._started = concurrent.futures.Future[None]()
        self._ranks: dict[str, int] = {}
        self._ranks_lock = threading.Lock()
        self._silent: list[str] = []
        self._disconnected: list[tuple[str, str, float]] = []
        self._finished: set[str] = set()
        self._joined: set[str] = set()
        # the job's first lost worker, as a summary's root cause row says it (None: none)
        self.first_loss: str | None = None
        self.tracker.on_rank_assigned = self._remember_rank
        self.tracker.on_worker_lost = self._worker_lost
        self.tracker.on_task_finished = self._task_finished
        self.tracker.on_task_registered = self._task_joined

    def _worker_lost(self, task_id: str, rank: int | None, reason: str) -> None:
        with self._ranks_lock:
            if self.first_loss is None and self.tracker.result is None:
                # (a loss after the job ended, e.g. a survivor's grace running out after
                # an abort, is no cause of it)
                who = f"task {task_id}" if rank is None else f"rank {rank} (task {task_id})"
                clock = time.strftime("%H:%M:%S")
                self.first_loss = f"{who} was lost at {clock}: {reason}"
            if reason.startswith(SILENCE_REASON):
                self._silent.append(task_id)
            else:
                self._disconnected.append((task_id, reason, time.monotonic()))

    def _task_finished(self, task_id: str) -> None:
        with self._ranks_lock:
            self._finished.add(task_id)

    def _task_joined(self, task_id: str) -> None:
        with self._ranks_lock:
            self._joined.add(task_id)

    def joined(self) -> set[str]:
        """Task ids whose rabit2 worker registered with the tracker (``init``), at any
        attempt."""
        with self._ranks_lock:
            return set(self._joined)

    def takes_restarts(self) -> bool:
        """False once a worker of the job said it runs without recovery (and not in elastic
        mode): its calls fail when a neighbour is lost, so a restarted worker could not
        join, and a launcher gives up on a failed task at once."""
        return self.tracker.takes_restarts

    def has_finished(self, task_id: str) -> bool:
        """Whether the task told the tracker it is done for good (a ``shutdown`` that does
        not hold): the tracker refuses it from then on, so a launcher must not restart it,
        whatever its exit status."""
        with self._ranks_lock:
            return task_id in self._finished

    def serves_classic(self) -> bool:
        """Whether the job's workers speak the classic rabit protocol (no abort reaches
        them)."""
        return self.tracker.classic

    def take_silent(self) -> list[str]:
        """Task ids the tracker gave up on for silence (a paused or wedged process that
        still holds its connection) since the last call; the launcher stops them."""
        with self._ranks_lock:
            silent, self._silent = self._silent, []
        return silent

    def take_disconnected(self) -> list[tuple[str, str, float]]:
        """(task id, reason, ``time.monotonic()`` then) of the workers the tracker declared
        lost since the last call because their connection ended (after the rejoin grace, or
        as their process ended).
        A launcher stops such a process if it still runs: it cannot reach the tracker (an
        unreachable host, whose ssh may wait for minutes), and the job goes on without it."""
        with self._ranks_lock:
            lost, self._disconnected = self._disconnected, []
        return lost

    def start(self, timeout: float = 10.0) -> None:
        """Start the thread and bind.  Raises what :meth:`Tracker.start` raised (``OSError``
        if the address cannot be bound), ``TimeoutError`` if it has not bound within
        ``timeout`` seconds, and ``RuntimeError`` if called twice."""
        self._thread.start()
        self._started.result(timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.tracker.start())
        except BaseException as exc:
            self._started.set_exception(exc)
            self._loop.close()
            return
        self._started.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self.tracker.close())
            # Wake whoever still waits in join() instead of destroying pending tasks.
            leftovers = asyncio.all_tasks(self._loop)
            for task in leftovers:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            self._loop.close()

    def _remember_rank(self, task_id: str, rank: int) -> None:
        with self._ranks_lock:
            self._ranks[task_id] = rank

    def rank_of(self, task_id: str) -> int | None:
        """The rank assigned to ``task_id``, or None before assignment.  Never raises."""
        with self._ranks_lock:
            return self._ranks.get(task_id)

    def worker_env(self) -> dict[str, str]:
        """See :meth:`Tracker.worker_env` (valid after :meth:`start`).  Never raises."""
        return self.tracker.worker_env()

    def join(self, timeout: float | None = None) -> JobResult | None:
        """Wait for the job's result; None if it is not done within ``timeout`` seconds or
        the tracker was stopped first.  Never raises."""
        waiter = self.tracker.wait_done(None)
        try:
            future = asyncio.run_coroutine_threadsafe(waiter, self._loop)
        except RuntimeError:  # the loop is closed: the tracker was stopped
            waiter.close()
            return self.tracker.result
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None
        except concurrent.futures.CancelledError:
            return self.tracker.result

    def result(self) -> JobResult | None:
        """The result if the job is done, else None; never waits.

        Reads one attribute that the tracker thread assigns once, atomically.
        """
        return self.tracker.result

    def status(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """:meth:`Tracker.status`, taken on the tracker's thread; None if it does not answer
        within ``timeout`` seconds or was stopped."""
        return status_on_loop(self.tracker, self._loop, timeout)

    def abort(self, reason: str) -> None:
        """See :meth:`Tracker.abort`; queued for the tracker's thread, never raises."""
        self._call_soon(self.tracker.abort, reason)

    def mark_failed(self, task_id: str, reason: str) -> None:
        """See :meth:`Tracker.mark_failed`; queued for the tracker's thread, never raises."""
        self._call_soon(self.tracker.mark_failed, task_id, reason)

    def worker_exited(self, task_id: str) -> None:
        """See :meth:`Tracker.worker_exited`; queued for the tracker's thread, never
        raises."""
        self._call_soon(self.tracker.worker_exited, task_id)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed: the job is over
            self._loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the tracker and end the thread (waiting up to ``timeout`` seconds).
        Idempotent; never raises."""
        if self._thread.is_alive():
            self._call_soon(self._loop.stop)
            self._thread.join(timeout)


def status_on_loop(tracker: Tracker, loop: asyncio.AbstractEventLoop,
                   timeout: float = 5.0) -> dict[str, Any] | None:
    """:meth:`Tracker.status`, from any thread but ``loop``'s: taken on ``loop`` (the
    tracker's); None if it does not answer within ``timeout`` seconds or was stopped."""

    async def take() -> dict[str, Any]:
        return tracker.status()

    coro = take()
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError:  # the loop is closed
        coro.close()
        return None
    try:
        return future.result(timeout)
    except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
        future.cancel()
        return None


__all__ = ["REJOIN_GRACE_SEC", "JobResult", "Tracker", "TrackerThread", "natural_key",
           "status_on_loop"]
