"""The process-wide communicator (rabit has exactly one per process): what :func:`rabit2.init`
made, the checks every public call starts with, and the one path every collective takes to
the engine.  Shared by the API's modules (:mod:`rabit2.api`, :mod:`rabit2.calls`,
:mod:`rabit2.checkpoints`, :mod:`rabit2.live`); not public.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

from rabit2.config import Config
from rabit2.core.records import Call
from rabit2.errors import MismatchError, NotInitializedError

logger = logging.getLogger("rabit2")


class Communicator:
    """The process-wide communicator (rabit has exactly one per process)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.config: Config | None = None
        self.engine: Any = None  # rabit2.io.engine.Engine when distributed
        self.rank = 0
        self.world = 1
        self.version = 0
        self.seqno = 0
        self.global_model: bytes | None = None
        self.lazy_model: Any = None
        self.local_model: bytes | None = None
        self.must_load = False  # a restarted worker whose checkpoint is with its neighbours
        self.loaded_without_local = False  # that worker's fetch left its local model there
        self.loaded = False  # the program called load_checkpoint (its calls before it are kept)
        # elastic mode (docs/elastic.md): the worker's place in the job, its rank and size
        # there, and the live set whose block it is in (rank and world are then the set's)
        self.membership: Any = None  # rabit2.io.membership.Membership
        self.job_rank = 0
        self.job_world = 1
        self.live: Any = None  # rabit2.live.LiveSet
        self.calling = False  # a collective of this process is under way (under ``lock``)


comm = Communicator()
forked_from: list[int] = []  # the worker's pid, in a process forked from it after init


def _not_initialized() -> NotInitializedError:
    if forked_from:
        return NotInitializedError(
            f"this process was forked from rabit2 worker {forked_from[0]} after its init: the "
            "job's links and thread stay with that process; make collectives there (or fork "
            "before init, or start the child with the 'spawn' method)")
    return NotInitializedError("call rabit2.init() first")


def forget_in_child() -> None:
    """``os.fork`` after init, in the child: the communicator's links and loop thread belong
    to the parent (the child has no thread to run them), so the child is not a worker: its
    collectives raise :class:`NotInitializedError` saying why, its ``finalize`` does
    nothing, instead of waiting for a loop that no thread runs."""
    if comm.config is not None:
        forked_from[:] = [os.getppid()]
    comm.config = comm.engine = comm.membership = comm.live = None
    comm.lock = threading.RLock()  # (the parent's may have been held by another thread)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_in_child)


def require() -> Communicator:
    if comm.config is None:
        raise _not_initialized()
    return comm


def collective() -> Communicator:
    """:func:`require`, for a collective (on every call's path: one check when not in
    elastic mode): in elastic mode only inside a live set."""
    if comm.membership is not None:
        if comm.live is None:
            raise RuntimeError("in elastic mode collectives run inside "
                               "`with rabit2.live_set():` (docs/elastic.md)")
        left = comm.membership.left
        if left is not None and comm.seqno >= left[1]:
            raise MismatchError(beyond_the_block(left, comm))
    if comm.config is None:
        raise _not_initialized()
    if comm.live is None and comm.engine is None and comm.config.elastic:
        # (alone, as in a job: a program checked alone meets the same rules under --elastic)
        raise RuntimeError("in elastic mode collectives run inside "
                           "`with rabit2.live_set():` (docs/elastic.md)")
    return comm


def job() -> Any:
    """What talks to the tracker for this process: the elastic membership, the engine, or
    None when not distributed."""
    return comm.membership if comm.membership is not None else comm.engine


# ----------------------------------------------------------------------------- fault hooks


def mock_hit(kind: str) -> tuple[int, int, bool]:
    """rabit's mock engine: ``mock=rank,version,seqno,trial`` kills us at that call.

    With a fifth field (``after_bytes``) the kill happens inside the call, once that many
    payload bytes of it have arrived; the byte count is returned for the engine (-1: none),
    with the rank whose link to reset instead of dying (-1: die), and whether to damage a
    byte from that rank instead of resetting.
    """
    cfg = comm.config
    if cfg is None or not cfg.mock:
        return -1, -1, False
    key = (comm.rank, comm.version, comm.seqno, cfg.num_attempt)
    for spec in cfg.mock:
        if (spec.rank, spec.version, spec.seqno, spec.trial) != key:
            continue
        if spec.after_bytes >= 0 and kind != "checkpoint":
            return spec.after_bytes, spec.reset_peer, bool(spec.damage)
        logger.error("[%d]@@@Hit Mock Error:%s at %s", comm.rank, kind, key)
        os.kill(os.getpid(), signal.SIGKILL)
    return -1, -1, False


def run(call: Call) -> None:
    comm = require()
    engine = comm.engine
    if engine is None:
        return
    # one collective at a time per process: calls from several threads queue here (their
    # order must still be the same on every rank, or the ranks get a MismatchError)
    with comm.lock:
        comm.calling = True
        try:
            left = comm.membership.left if comm.membership is not None else None
            if left is not None and comm.seqno >= left[1]:
                # (heard while this call waited for the lock or ran prepare_fun: the other
                # side of the check in rabit2.live.heard_left, which reads ``calling`` after
                # it set ``left``)
                raise MismatchError(beyond_the_block(left, comm))
            if comm.config is not None and comm.config.mock:
                engine.run_call(call, *mock_hit(call.kind.name.lower()))
            else:
                engine.run_call(call)
        except KeyboardInterrupt as exc:  # (the call left midway; a SystemExit from a
            interrupted(call, exc)  # signal handler ends the process: a lost worker, as ever)
            raise
        finally:
            comm.calling = False
        comm.seqno += 1


def interrupted(call: Call, exc: BaseException) -> None:
    """The caller left a collective midway (``KeyboardInterrupt`` in its wait, or while it
    made the call's steps itself): this rank's part of the call, and perhaps the call's
    state, is unfinished, so it cannot go on with the job.  The job ends, as after
    :func:`rabit2.signal_error` (every other rank raises ``JobAbortedError`` naming this
    call at once instead of waiting for it), and every later call on this rank raises that
    ``JobAbortedError`` (never blocks)."""
    what = call.kind.name.lower().split("_")[0]
    with contextlib.suppress(Exception):
        job().signal_error(f"rank {comm.rank}'s {what} call was interrupted by "
                           f"{type(exc).__name__}")


def beyond_the_block(left: tuple[int, int], comm: Communicator) -> str:
    """Elastic mode: this member is at a call of the block that member ``left[0]``, which
    left the block after ``left[1]`` calls, never made."""
    return (f"live set block: job rank {left[0]} left it after {left[1]} collective calls, "
            f"and job rank {comm.job_rank} is at call {comm.seqno + 1}: every member must make "
            "the same calls in a block")


__all__ = ["Communicator", "beyond_the_block", "collective", "comm", "interrupted", "job",
           "mock_hit", "require", "run"]
