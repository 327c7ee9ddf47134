"""The blocking, rabit-compatible API over the engine's loop thread: joining and leaving
the job, who this process is, messages; the collectives are in :mod:`rabit2.calls` and the
checkpoints in :mod:`rabit2.checkpoints`, both re-exported here.

One communicator per process (as in rabit, :mod:`rabit2.state`): :func:`init` creates it,
:func:`finalize` ends it.  Without a tracker in the configuration the process runs alone
(rank 0 of 1) and every collective is a local no-op, so the same program runs on a laptop
and in a job.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from rabit2 import logs
from rabit2.calls import agree, allgather, allreduce, broadcast
from rabit2.checkpoints import (
    checkpoint,
    lazy_checkpoint,
    load_checkpoint,
    recovery_statistics,
    version_number,
)
from rabit2.config import (
    Config,
    launcher_task,
    launcher_world,
    load_config,
    misspelled_env,
)
from rabit2.core.ops import Op
from rabit2.errors import JobAbortedError, LiveSetError, RabitError
from rabit2.state import comm as _comm
from rabit2.state import job as _job

logger = logging.getLogger("rabit2")

# ----------------------------------------------------------------------------- lifecycle


def init(args: Iterable[str | bytes] | None = None, **kwargs: Any) -> None:
    """Join the job (or start single-process mode when no tracker is configured).

    ``args`` are rabit-style ``"k=v"`` strings (e.g. ``sys.argv``; other strings are
    ignored); ``kwargs`` are xgboost.collective-style keyword parameters.  Environment
    variables set by ``rabit2-submit`` are read first.  A second call while initialised is
    ignored with a warning, as in rabit.

    Raises ``ValueError`` for unknown or malformed parameters and ``TypeError`` for
    ``args`` that are not a list of strings (a single string, or a dict: pass that as
    keywords, ``init(**params)``), before anything is contacted, and a
    :class:`~rabit2.errors.RabitError` if the job cannot be joined:
    :class:`~rabit2.errors.TrackerError` when the tracker cannot be reached after every
    attempt or refuses this worker, :class:`~rabit2.errors.CollectiveTimeoutError` when no
    rank is assigned or the neighbours do not connect in time,
    :class:`~rabit2.errors.JobAbortedError` when the job is aborted meanwhile, and
    :class:`~rabit2.errors.PeerLostError` or :class:`~rabit2.errors.ProtocolError` when a
    link to a neighbour cannot be set up.  After an error the process is not initialised.
    """
    with _comm.lock:
        if _comm.config is not None:
            logger.warning("rabit2.init() called twice; ignoring the second call")
            return
        try:
            config = load_config(args, kwargs)
        except (TypeError, ValueError) as exc:
            _give_up_on_bad_parameters(exc)
            raise
        logs.configure(config.log_level)
        for line in misspelled_env(os.environ):
            logger.warning("%s", line)
        _comm.version = _comm.seqno = 0
        _comm.global_model = _comm.local_model = _comm.lazy_model = None
        _comm.must_load = _comm.loaded_without_local = _comm.loaded = False
        if config.distributed and config.elastic:
            from rabit2.io.membership import Membership  # noqa: PLC0415
            from rabit2.live import heard_left  # noqa: PLC0415

            member = Membership(config)
            member.start()
            assert member.assignment is not None and member.tracker is not None
            member.tracker.on_live_left = heard_left
            _comm.engine, _comm.membership, _comm.live = None, member, None
            _comm.rank = _comm.job_rank = member.assignment.rank
            _comm.world = _comm.job_world = member.assignment.world_size
        elif config.distributed:
            from rabit2.io.engine import Engine  # noqa: PLC0415 - keeps single mode light

            engine = Engine(config)
            engine.start()
            assert engine.assignment is not None
            _comm.engine = engine
            _comm.rank = engine.assignment.rank
            _comm.world = engine.assignment.world_size
            _comm.must_load = engine.restarted
        else:
            _comm.engine = None
            _comm.rank, _comm.world = 0, 1
            world = launcher_world(os.environ)
            if world is not None and world[1] > 1:
                logger.warning(
                    "no tracker is configured, so this process runs alone (rank 0 of 1), but "
                    "%s=%d says its launcher started %d: start the job with rabit2-submit "
                    "(--cluster slurm or mpi) or give the workers a tracker's variables "
                    "(docs/user-guide.md, \"Other launchers\")", *world, world[1])
        _comm.config = config
        if config.distributed:
            _install_excepthook()


ABORT_WAIT_SEC = 5.0
"""How long :func:`abort_for` waits for the loop thread to fail a call of this rank still
under way."""

_TRACKER_KEYS = ("DMLC_TRACKER_URI", "DMLC_TRACKER_PORT", "RABIT2_SECRET")


def _give_up_on_bad_parameters(error: TypeError | ValueError) -> None:
    """A worker of a job whose parameters ``init`` refuses: a restart would be refused the
    same way, so tell the tracker (named by the launcher's variables) to give this task up
    and end the job, instead of each attempt failing in turn.  Best effort, bounded (5 s);
    nothing when no tracker is configured."""
    try:
        # the launcher's variables that find the tracker, alone (the bad value may be in
        # another variable of the environment: rabit2-submit --env RABIT2_RECOVER=maybe)
        where = {key: os.environ[key] for key in _TRACKER_KEYS if key in os.environ}
        task, _ = launcher_task(os.environ)
        job = load_config(environ=where if task is None else {**where, "DMLC_TASK_ID": task})
    except ValueError:
        return  # (the bad value is the launcher's own: nothing to reach)
    if not job.distributed or job.tracker_uri is None or job.task_id == "NULL":
        return
    import asyncio  # noqa: PLC0415 (only on this path)

    from rabit2.io.tracker_query import query_tracker_status  # noqa: PLC0415

    reason = f"rabit2.init refused its parameters, which no restart can fix: {error}"

    def tell() -> None:
        assert job.tracker_uri is not None
        with contextlib.suppress(RabitError, OSError):
            asyncio.run(query_tracker_status(job.tracker_uri, job.tracker_port, job.secret,
                                             5.0, give_up=(job.task_id, reason),
                                             task_id=job.task_id))

    # (on a thread of its own: this one may run an event loop already, as in a notebook)
    teller = threading.Thread(target=tell, name="rabit2-give-up", daemon=True)
    teller.start()
    teller.join(10.0)


def abort_for(error: BaseException) -> None:
    """A program error on this rank ends the job: tell the tracker (every other rank raises
    :class:`~rabit2.errors.JobAbortedError` naming this rank and ``error`` at once, instead
    of waiting for it) and leave; the launcher does not restart a worker that left so.  A
    :class:`~rabit2.errors.JobAbortedError` is the job's already: this only leaves (a
    RabitError that every rank saw is said again, which the tracker ignores after the first).
    In elastic mode the worker only leaves, as if lost: the job goes on without it (or gets
    it back when the launcher restarts it).  Safe to call when not initialised; never raises
    a RabitError."""
    member = _comm.membership
    if member is not None:
        # elastic mode: a program error makes this worker lost (restarted, or the job goes
        # on without it), not the job's end.  A call of this rank's still under way in
        # another thread (an await that timed out) ends now and lets go of the lock
        engine = _comm.engine
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.fail(LiveSetError(f"this rank left its live set: {_reason(error)}"),
                            ABORT_WAIT_SEC)
        with _comm.lock:
            _comm.engine = _comm.membership = _comm.config = _comm.live = None
        member.close()
        return
    # (before the lock: a collective still running in another thread, e.g. one whose
    # asyncio await was cancelled, holds it; signal_error never blocks)
    job = _job()
    if job is not None and not isinstance(error, JobAbortedError):
        reason = _reason(error)
        job.signal_error(reason)
        # the tracker tells every other rank; a call of this rank's still under way in
        # another thread (an await that timed out left it running) ends now, not at its
        # deadline, and lets go of the lock
        with contextlib.suppress(Exception):
            job.fail(JobAbortedError(f"this rank ended the job: {reason}"), ABORT_WAIT_SEC)
    with _comm.lock, contextlib.suppress(RabitError):
        finalize()


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"rank {get_rank()} raised {type(error).__name__}" + (f": {text}" if text else "")


_open_contexts = [0]  # contexts open in this process (rabit2's, rabit2.collective's, ...)


def enter(join: Callable[[], None]) -> bool:
    """How a context begins; whether it owns the job.  The outermost one owns it: it joins
    (``join()``, unless :func:`init` ran already) and, in :func:`leave`, ends it.  One
    inside another neither joins nor leaves: the job ends with the outer one."""
    owner = _open_contexts[0] == 0
    if owner and _comm.config is None:
        join()
    _open_contexts[0] += 1
    return owner


def in_context() -> bool:
    """Whether a context is open in this process."""
    return _open_contexts[0] > 0


def exited() -> None:
    """A context ended (:func:`leave` says so; ``rabit2.xgboost``'s ends its own way)."""
    _open_contexts[0] = max(0, _open_contexts[0] - 1)


def leave(error: BaseException | None, owner: bool = True) -> None:
    """How a context ends: :func:`finalize`, or :func:`abort_for` the exception that ended
    it; ``sys.exit()`` or ``sys.exit(0)`` is a normal end.  Nothing more where the context
    is not the ``owner`` of the job (one inside another: the outer context ends it)."""
    exited()
    if not owner:
        return
    if error is not None and not ends_normally(error):
        abort_for(error)
    else:
        finalize()


def ends_normally(error: BaseException | None) -> bool:
    """Whether a context that ``error`` ended (None: none) ends the job normally: no error,
    or ``sys.exit()`` / ``sys.exit(0)``."""
    return error is None or (isinstance(error, SystemExit) and error.code in (None, 0))


_previous_excepthook: list[Callable[..., Any]] = []


def _install_excepthook() -> None:
    """An uncaught exception in a distributed program aborts the job before Python prints
    it (the previous hook runs after)."""
    if _previous_excepthook:
        return
    _previous_excepthook.append(sys.excepthook)

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if _comm.config is not None and not isinstance(value, KeyboardInterrupt):
            with contextlib.suppress(Exception):
                abort_for(value)
        _previous_excepthook[0](kind, value, tb)

    sys.excepthook = hook
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    """The interpreter exits without :func:`finalize` (``sys.exit`` after a caught error, a
    program that just ends): close the links and stop the loop thread now, while Python
    can still run it.  Left to the interpreter's teardown, the daemon loop thread went on
    polling its sockets and crashed the process (SIGSEGV) in some exits.  The tracker sees
    the connection end, as it would have seen the process go."""
    engine, member = _comm.engine, _comm.membership
    _comm.engine = _comm.membership = _comm.config = None  # (no lock: a daemon thread
    _comm.live = None  # may hold it in a collective that never returns)
    with contextlib.suppress(Exception):
        if member is not None:
            member.close()
        elif engine is not None:
            engine.close()


def finalize() -> None:
    """Leave the job: tell the tracker, close every link.  Safe to call when not initialised.

    With recovery on this first waits (up to ``timeout_sec``), still serving the neighbours,
    until every rank has finalized, so that a worker restarted after its last collective
    can replay; raises :class:`~rabit2.errors.JobAbortedError` if the job is aborted then,
    and :class:`~rabit2.errors.MismatchError` if a peer began a call after this rank
    finalized (the ranks' sequences of calls differ).  Other failures while leaving (the
    tracker gone, no answer in time) are logged, not raised.  The process is not initialised
    afterwards, whether this returned or raised."""
    if _comm.live is not None:
        raise RuntimeError("finalize() inside a live set's block: leave the block first")
    with _comm.lock:
        engine, _comm.engine, _comm.config = _comm.engine, None, None
        member, _comm.membership, _comm.live = _comm.membership, None, None
        if member is not None:
            member.finalize()  # (the live set's engine included)
        elif engine is not None:
            engine.finalize()


def current_config() -> Config | None:
    """The configuration this process joined with (None when not initialised)."""
    return _comm.config


def get_rank() -> int:
    """This process's rank (0 when not initialised, as in rabit; in elastic mode its rank
    in the job, inside a live set too).  Never raises."""
    if _comm.config is None:
        return 0
    return _comm.job_rank if _comm.membership is not None else _comm.rank


def get_world_size() -> int:
    """The number of workers (1 when not initialised, as in rabit; in elastic mode the
    job's size: ``len(live)`` is a live set's).  Never raises."""
    if _comm.config is None:
        return 1
    return _comm.job_world if _comm.membership is not None else _comm.world


def is_distributed() -> bool:
    """Whether this process is a worker of a job: True from an :func:`init` that joined a
    tracker until :func:`finalize`; False when not initialised and in single-process mode
    (no tracker configured), where every collective is a local no-op.  Never raises."""
    return _comm.engine is not None or _comm.membership is not None


def get_processor_name() -> str:
    """This host's name (``socket.gethostname()``), as rabit's ``GetProcessorName``.  Needs
    no :func:`init` and raises no :class:`~rabit2.errors.RabitError`."""
    return socket.gethostname()


def tracker_print(msg: Any) -> None:
    """Print ``str(msg)`` on the tracker's console (locally when not distributed).

    Needs no :func:`init`.  In a job the line is queued for the tracker, which prints one
    worker's lines in the order they were sent.  It waits only while 4 MiB of earlier lines
    wait for the tracker, at most 10 s; then the line is dropped (a warning counts them), as
    are lines once the tracker connection is gone, rather than raised."""
    print_line(msg, wait=True)


def print_line(msg: Any, wait: bool) -> None:
    """:func:`tracker_print`; with ``wait`` False a line that finds no room is dropped at
    once (``rabit2.aio``: an event loop must not wait)."""
    text = str(msg)
    job = _job()
    if job is None:
        print(text, flush=True)
    else:
        job.tracker_print(text, wait)


def signal_error(msg: str = "signal_error() called") -> None:
    """Ask the tracker to abort the job, with ``msg`` as the reason: every worker's current
    or next collective raises :class:`~rabit2.errors.JobAbortedError`, this one's too (it
    should leave: :func:`finalize`, or exit).  Never blocks and never raises; a no-op when
    not distributed."""
    job = _job()
    if job is not None:
        job.signal_error(msg)


# ----------------------------------------------------------------------------- xgboost names


def communicator_print(msg: Any) -> None:
    """xgboost.collective spelling of :func:`tracker_print` (its behaviour and errors)."""
    tracker_print(msg)


class CommunicatorContext(contextlib.AbstractContextManager["CommunicatorContext"]):
    """``with CommunicatorContext(**args):`` = ``init(**args)`` ... ``finalize()``; an
    exception inside the block aborts the job (:func:`abort_for`) and propagates
    (``sys.exit(0)`` finalizes).  After :func:`init` it takes the job over (and ends it);
    inside another context it neither joins nor leaves: the outer one ends the job.

    Entering raises what :func:`init` raises.  Leaving normally raises what :func:`finalize`
    raises; leaving by an exception raises no error of its own (the job is aborted, naming
    the exception, and the exception propagates)."""

    def __init__(self, **args: Any) -> None:
        self.args = args
        self._owner = False

    def __enter__(self) -> CommunicatorContext:
        self._owner = enter(lambda: init(**self.args))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        leave(exc, self._owner)  # after an exception the others must not wait for this rank



__all__ = [
    "CommunicatorContext",
    "Op",
    "agree",
    "allgather",
    "allreduce",
    "broadcast",
    "checkpoint",
    "communicator_print",
    "finalize",
    "get_processor_name",
    "get_rank",
    "get_world_size",
    "init",
    "is_distributed",
    "lazy_checkpoint",
    "load_checkpoint",
    "recovery_statistics",
    "signal_error",
    "tracker_print",
    "version_number",
]

