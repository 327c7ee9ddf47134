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
import os
import queue
import signal
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

import numpy as np

from rabit2 import api
from rabit2.calls import check_array, check_flag
from rabit2.core.ops import check_op_dtype, dtype_code
from rabit2.device import on_callers_stream
from rabit2.errors import RabitError

T = TypeVar("T")


class Communicator:
    """Async wrapper of the process-wide communicator (there is one per process, as in rabit).

    ``args`` and ``kwargs`` are those of :func:`rabit2.init`.  Constructing it does not join
    the job and never raises: ``async with`` (or :meth:`init`) does.  Each method checks its
    arguments' types at once (``TypeError``/``ValueError`` from the method itself), then
    issues its blocking :mod:`rabit2` function to this communicator's worker thread, which
    runs them one at a time in the order issued, and raises that function's errors from the
    ``await``.  Cancelling an ``await`` (``asyncio.wait_for``, ``task.cancel()``) does not
    cancel the collective: it runs to its end in that thread, and the next call runs after
    it; if it fails, the job's error is raised by :meth:`finalize` (and so by the end of the
    ``async with`` block) rather than lost.  The worker thread is a daemon: a call left
    running never holds up the interpreter's exit.
    """

    def __init__(self, args: Iterable[str | bytes] | None = None, **kwargs: Any) -> None:
        self._args = args  # (checked by init: rabit2.init's TypeError and ValueError)
        self._kwargs = kwargs
        self._guard = threading.Lock()
        self._worker: _Worker | None = None
        self._owner = False  # this block joined the job and ends it (rabit2.api.enter)
        self._unseen: BaseException | None = None  # a failed call whose await was cancelled

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Hand ``fn(*args)`` to the worker thread now, after the calls issued before it."""
        with self._guard:
            if self._worker is None or self._worker.pid != os.getpid():
                # (one thread for the communicator's life: a second would break the order;
                # a process forked after init has none, and gets the blocking API's error)
                self._worker = _Worker()
                # (its thread ends once this communicator is gone and its calls are done)
                weakref.finalize(self, self._worker.stop)
            return self._worker.submit(fn, *args)

    def _issue(self, fn: Callable[..., T], *args: Any) -> Coroutine[Any, Any, T]:
        """:meth:`_submit`; a coroutine that waits for its result."""
        return self._result(self._submit(fn, *args))

    async def _result(self, done: concurrent.futures.Future[T]) -> T:
        """The result of a call issued to the worker thread.  Cancelling this wait leaves
        the call running (it is never taken off the thread's queue); a job's error it then
        meets is kept for :meth:`finalize`."""
        waited = asyncio.wrap_future(done)
        # (shielded: cancelling the wrapper would cancel a call still queued; its outcome is
        # then nobody's to retrieve, which asyncio must not report)
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(waited)
        except asyncio.CancelledError:
            done.add_done_callback(self._keep_unseen)
            raise
        except RabitError:
            self._unseen = None  # (the job's error, seen by the program after all)
            raise

    def _keep_unseen(self, done: concurrent.futures.Future[Any]) -> None:
        error = None if done.cancelled() else done.exception()
        if isinstance(error, RabitError) and self._unseen is None:
            self._unseen = error

    def _raise_unseen(self) -> None:
        error, self._unseen = self._unseen, None
        if error is not None:
            raise error

    async def init(self) -> None:
        """Join the job: :func:`rabit2.init` with the constructor's arguments, and its
        errors (``ValueError`` for bad parameters, a :class:`~rabit2.errors.RabitError` when
        the job cannot be joined)."""
        await self._issue(self._join)

    def _join(self) -> None:
        api.init(self._args, **self._kwargs)

    async def finalize(self) -> None:
        """Leave the job: :func:`rabit2.finalize`, and its errors
        (:class:`~rabit2.errors.JobAbortedError` if the job is aborted while this worker
        waits for the others with recovery on); then the error of a call whose ``await``
        was cancelled, if that call failed."""
        await self._issue(api.finalize)
        self._raise_unseen()

    async def __aenter__(self) -> Communicator:
        """:meth:`init`, with its errors; returns this communicator.  As
        :class:`rabit2.CommunicatorContext`: after :func:`rabit2.init` the block takes the
        job over, and inside another context it neither joins nor leaves.  Cancelled while
        it joins (``asyncio.timeout``), the join goes on in the worker thread and then ends
        the job, as an exception leaving the block would."""
        done = self._submit(api.enter, self._join)
        try:
            self._owner = await self._result(done)
        except asyncio.CancelledError:
            done.add_done_callback(_leave_if_joined)
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: object) -> None:
        """:meth:`finalize`, with its errors, when the block ended normally (``sys.exit(0)``
        included), after the calls issued before; when it raised, the exception ends the job
        as in :class:`rabit2.CommunicatorContext` (every other rank raises
        :class:`~rabit2.errors.JobAbortedError` naming it) and propagates.  That is not
        queued behind a call still under way (an ``await`` that timed out left it running)
        and needs no thread of the event loop's: ending the job fails that call at once.
        Ctrl-C under ``asyncio.run`` reaches the block as ``CancelledError``; the other ranks
        are told ``KeyboardInterrupt``, as for a blocking program."""
        if api.ends_normally(error):
            await self._issue(api.leave, error, self._owner)
            self._raise_unseen()
        else:
            if _interrupted(error):
                error = KeyboardInterrupt()  # (the reason the other ranks are given)
            await asyncio.wrap_future(_on_a_thread_of_its_own(api.leave, error, self._owner))

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
        check_array("allreduce", data)
        check_op_dtype(op, np.dtype(data.dtype))
        return self._issue(on_callers_stream(api.allreduce, data), data, op, prepare_fun)

    def broadcast(self, obj: Any, root: int) -> Coroutine[Any, Any, Any]:
        """:func:`rabit2.broadcast`: ``obj`` from ``root`` to every rank, returned.  Raises
        ``ValueError`` for a bad root, ``TypeError`` for an object the root cannot pickle,
        :class:`~rabit2.errors.NotInitializedError` before :meth:`init`, and
        :class:`~rabit2.errors.RabitError` subclasses when ranks disagree or the job fails.
        The root pickles ``obj`` when the call runs: do not change it before the ``await``
        returns."""
        return self._issue(on_callers_stream(api.broadcast, obj), obj, root)

    def allgather(self, data: Any) -> Coroutine[Any, Any, Any]:
        """:func:`rabit2.allgather`: every rank's array concatenated along axis 0.  Raises
        ``TypeError`` for a non-array or an unsupported dtype,
        :class:`~rabit2.errors.NotInitializedError` before :meth:`init`,
        :class:`~rabit2.errors.MismatchError` for different dtypes or trailing shapes, other
        :class:`~rabit2.errors.RabitError` subclasses when the job fails."""
        check_array("allgather", data)
        dtype_code(np.dtype(data.dtype))
        return self._issue(on_callers_stream(api.allgather, data), data)

    def agree(self, flag: bool) -> Coroutine[Any, Any, bool]:
        """:func:`rabit2.agree`: True on every rank iff every rank passed a true ``flag``.
        Raises :class:`~rabit2.errors.NotInitializedError` before :meth:`init` and
        :class:`~rabit2.errors.RabitError` subclasses when the job fails."""
        check_flag(flag)
        return self._issue(api.agree, flag)

    def checkpoint(self, global_model: Any, local_model: Any = None) -> Coroutine[Any, Any, None]:
        """:func:`rabit2.checkpoint`: pickle and keep the models; the version goes up by
        one.  Raises :class:`~rabit2.errors.NotInitializedError` before :meth:`init`, and
        ``TypeError`` or ``ValueError`` as :func:`rabit2.checkpoint` does.  The models are
        pickled when the call runs: do not change them before the ``await`` returns."""
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
        """:func:`rabit2.tracker_print`, at once (not awaited: it never blocks; where 4 MiB
        of earlier lines still wait for the tracker, the line is dropped and counted).
        Needs no :meth:`init` and raises no :class:`~rabit2.errors.RabitError`."""
        api.print_line(msg, wait=False)


class _Worker:
    """The thread that runs one communicator's calls, one at a time, in the order issued.
    A daemon: a call left running by a cancelled ``await`` must not hold up the
    interpreter's exit (Python joins the threads of its executors before the exit handlers
    that close the job would run)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any],
                                             Callable[..., Any], tuple[Any, ...]] | None]
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="rabit2-aio", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((done, fn, args))
        return done

    def stop(self) -> None:
        """End the thread once the calls issued before are done."""
        self._queue.put(None)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            _settle(*item)
            del item  # (not kept alive until the next call)


def _settle(done: concurrent.futures.Future[T], fn: Callable[..., T],
            args: tuple[Any, ...]) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # (the caller's to see, whatever it is)
        done.set_exception(exc)
    else:
        done.set_result(result)


def _interrupted(error: BaseException | None) -> bool:
    """Whether ``error`` is how ``asyncio.run`` (an :class:`asyncio.Runner`) answers Ctrl-C:
    its SIGINT handler cancels the main task, and the block sees ``CancelledError`` where a
    blocking program sees ``KeyboardInterrupt``.  Told by the runner's count of interrupts
    (not public: where a Python lacks it, the ``CancelledError`` is named instead)."""
    if not isinstance(error, asyncio.CancelledError):
        return False
    try:
        handler = signal.getsignal(signal.SIGINT)
    except ValueError:
        return False
    runner = getattr(getattr(handler, "func", None), "__self__", None)
    return isinstance(runner, asyncio.Runner) and getattr(runner, "_interrupt_count", 0) > 0


def _on_a_thread_of_its_own(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """``fn(*args)`` on a new daemon thread (not the event loop's executor, which may be
    busy or shut down)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    threading.Thread(target=_settle, args=(done, fn, args), name="rabit2-aio-leave",
                     daemon=True).start()
    return done


def _leave_if_joined(entered: concurrent.futures.Future[bool]) -> None:
    """A block whose join was cancelled: once the join is done, end the job as an exception
    leaving the block would (nobody will leave it otherwise)."""
    if not entered.cancelled() and entered.exception() is None:
        _on_a_thread_of_its_own(api.leave, asyncio.CancelledError(
            "the asyncio block was cancelled while it joined the job"), entered.result())
