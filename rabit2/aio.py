"""The asyncio API, for programs that already run an event loop.

``await comm.allreduce(arr, op)`` runs the collective without blocking the caller's loop:
the blocking call runs in the communicator's own worker thread and the loop stays free for
other tasks.  Collectives are ordered: every rank must issue the same sequence of calls, so
a call is issued when the method is called (``comm.allreduce(...)`` creates the coroutine),
and the calls of one communicator run one after another, in that order, whichever task,
thread or event loop made them. ::

    async with rabit2.aio.Communicator() as comm:      # init() ... finalize()
        await comm.allreduce(hist, rabit2.Op.SUM)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from rabit2 import api
from rabit2.device import on_callers_stream

T = TypeVar("T")


class Communicator:
    """Async wrapper of the process-wide communicator (there is one per process, as in rabit).

    ``args`` and ``kwargs`` are those of :func:`rabit2.init`.  Constructing it does not join
    the job and never raises: ``async with`` (or :meth:`init`) does.  Each method issues its
    blocking :mod:`rabit2` function at once to this communicator's worker thread, which runs
    them one at a time in the order issued, and raises that function's errors from the
    ``await``.  Cancelling an ``await`` (``asyncio.wait_for``, ``task.cancel()``) does not
    cancel the collective: it runs to its end in that thread, and the next call runs after
    it.
    """

    def __init__(self, args: Iterable[str | bytes] | None = None, **kwargs: Any) -> None:
        self._args = args  # (checked by init: rabit2.init's TypeError and ValueError)
        self._kwargs = kwargs
        self._guard = threading.Lock()
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    def _issue(self, fn: Callable[..., T], *args: Any) -> Coroutine[Any, Any, T]:
        """Hand ``fn(*args)`` to the worker thread now (after the calls issued before it);
        a coroutine that waits for its result."""
        with self._guard:
            if self._worker is None:
                # (one thread for the communicator's life: a second would break the order)
                self._worker = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="rabit2-aio")
            done = self._worker.submit(fn, *args)
        return _result(done)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._issue(fn, *args)

    async def init(self) -> None:
        """Join the job: :func:`rabit2.init` with the constructor's arguments, and its
        errors (``ValueError`` for bad parameters, a :class:`~rabit2.errors.RabitError` when
        the job cannot be joined)."""
        await self._run(lambda: api.init(self._args, **self._kwargs))

    async def finalize(self) -> None:
        """Leave the job: :func:`rabit2.finalize`, and its errors
        (:class:`~rabit2.errors.JobAbortedError` if the job is aborted while this worker
        waits for the others with recovery on)."""
        await self._run(api.finalize)

    async def __aenter__(self) -> Communicator:
        """:meth:`init`, with its errors; returns this communicator."""
        await self.init()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: object) -> None:
        """:meth:`finalize`, with its errors, when the block ended normally; when it raised,
        the exception ends the job as in :class:`rabit2.CommunicatorContext` (every other
        rank raises :class:`~rabit2.errors.JobAbortedError` naming it) and propagates.  That
        is not queued behind a call still under way (an ``await`` that timed out left it
        running): ending the job fails that call at once."""
        if error is None:
            await self.finalize()
        else:
            await asyncio.to_thread(api.abort_for, error)

    @property
    def rank(self) -> int:
        """This process's rank (:func:`rabit2.get_rank`: 0 when not initialised).  Never
        raises."""
        return api.get_rank()

    @property
    def world_size(self) -> int:
        """The number of workers (:func:`rabit2.get_world_size`: 1 when not initialised).
        Never raises."""
        return api.get_world_size()

    def allreduce(self, data: Any, op: Any,
                  prepare_fun: Callable[[Any], None] | None = None) -> Coroutine[Any, Any, Any]:
        """:func:`rabit2.allreduce` (in place when possible; the result is returned), with
        its errors: ``TypeError``/``ValueError`` for bad arguments before anything is sent,
        :class:`~rabit2.errors.NotInitializedError` before :meth:`init`,
        :class:`~rabit2.errors.MismatchError` when ranks disagree, other
        :class:`~rabit2.errors.RabitError` subclasses when the job fails.  The caller must
        not touch ``data`` until the ``await`` returns.  A cupy array is staged on the
        stream current where the method is called."""
        return self._issue(on_callers_stream(api.allreduce, data), data, op, prepare_fun)

    def broadcast(self, obj: Any, root: int) -> Coroutine[Any, Any, Any]:
        """:func:`rabit2.broadcast`: ``obj`` from ``root`` to every rank, returned.  Raises
        ``ValueError`` for a bad root, ``TypeError`` for an object the root cannot pickle,
        :class:`~rabit2.errors.NotInitializedError` before :meth:`init`, and
        :class:`~rabit2.errors.RabitError` subclasses when ranks disagree or the job fails."""
        return self._issue(on_callers_stream(api.broadcast, obj), obj, root)

    def allgather(self, data: Any) -> Coroutine[Any, Any, Any]:
        """:func:`rabit2.allgather`: every rank's array concatenated along axis 0.  Raises
        ``TypeError`` for a non-array or an unsupported dtype,
        :class:`~rabit2.errors.NotInitializedError` before :meth:`init`,
        :class:`~rabit2.errors.MismatchError` for different dtypes or trailing shapes, other
        :class:`~rabit2.errors.RabitError` subclasses when the job fails."""
        return self._issue(on_callers_stream(api.allgather, data), data)

    def agree(self, flag: bool) -> Coroutine[Any, Any, bool]:
        """:func:`rabit2.agree`: True on every rank iff every rank passed a true ``flag``.
        Raises :class:`~rabit2.errors.NotInitializedError` before :meth:`init` and
        :class:`~rabit2.errors.RabitError` subclasses when the job fails."""
        return self._issue(api.agree, flag)

    def checkpoint(self, global_model: Any, local_model: Any = None) -> Coroutine[Any, Any, None]:
        """:func:`rabit2.checkpoint`: pickle and keep the models; the version goes up by
        one.  Raises :class:`~rabit2.errors.NotInitializedError` before :meth:`init`, and
        ``TypeError`` or ``ValueError`` as :func:`rabit2.checkpoint` does."""
        return self._issue(api.checkpoint, global_model, local_model)

    def load_checkpoint(self, with_local: bool = False) -> Coroutine[Any, Any, tuple[Any, ...]]:
        """:func:`rabit2.load_checkpoint`: ``(version, global_model)`` (with
        ``local_model`` too when ``with_local``).  Raises
        :class:`~rabit2.errors.NotInitializedError` before :meth:`init`; in a restarted
        worker, :class:`~rabit2.errors.UnrecoverableError`,
        :class:`~rabit2.errors.CollectiveTimeoutError` or
        :class:`~rabit2.errors.JobAbortedError` when the checkpoint cannot be fetched."""
        return self._issue(api.load_checkpoint, with_local)

    def tracker_print(self, msg: Any) -> None:
        """:func:`rabit2.tracker_print`, at once (not awaited: it never blocks).  Needs no
        :meth:`init` and raises no :class:`~rabit2.errors.RabitError`."""
        api.tracker_print(msg)


async def _result(done: concurrent.futures.Future[T]) -> T:
    """The result of a call issued to a communicator's worker thread; cancelling this wait
    leaves the call running (it is never taken off the thread's queue)."""
    waited = asyncio.wrap_future(done)
    # (shielded: cancelling the wrapper would cancel a call still queued; its outcome is
    # then nobody's to retrieve, which asyncio must not report)
    waited.add_done_callback(lambda f: f.cancelled() or f.exception())
    return await asyncio.shield(waited)
