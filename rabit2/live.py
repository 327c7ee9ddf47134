"""Elastic mode's API: ``with rabit2.live_set() as live:`` (docs/elastic.md).

A live set is the same tuple of live ranks on every live worker, formed behind a barrier;
the collectives inside its block run over those ranks only, and the block is atomic: it
returns on every member, or raises :class:`~rabit2.errors.LiveSetError` (the same message)
on every member.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from types import TracebackType
from typing import Any

from rabit2 import state
from rabit2.errors import LiveSetError, MismatchError, RabitError

logger = logging.getLogger("rabit2")


class LiveSet(tuple[int, ...]):
    """The ranks of a live set, in order, with ``epoch`` (the set's number, from 1) and
    ``new`` (the ranks whose process was not in the last set that succeeded: the first
    set's, a restarted worker, one that came back)."""

    epoch: int
    new: tuple[int, ...]

    def __new__(cls, ranks: tuple[int, ...], epoch: int, new: tuple[int, ...]) -> LiveSet:
        live = super().__new__(cls, ranks)
        live.epoch = epoch
        live.new = new
        return live

    @property
    def source(self) -> int | None:
        """The first member that holds the job's state (one not in ``new``): where the
        newcomers take it from, ``broadcast(state, root=live.source)``.  None when every
        member is new (the first set, or every holder was lost: the program starts
        over)."""
        return next((rank for rank in self if rank not in self.new), None)

    def __repr__(self) -> str:
        return f"LiveSet({tuple(self)!r}, epoch={self.epoch}, new={self.new!r})"


_alone = {"sets": 0, "open": False}
"""Single-process mode: how many live sets this worker entered, and whether one is open."""


class live_set:  # (named as the function it stands for: ``with rabit2.live_set():``)
    """``with rabit2.live_set() as live:`` — wait until every live worker asked for the
    next live set, run the block's collectives over its ranks, and succeed or fail on every
    member together.

    Alone (no tracker: single-process mode) it is a set of this one worker, ``LiveSet((0,),
    epoch, new)`` with rank 0 new in the first set only, and the block runs as it is.

    Entering raises ``RuntimeError`` in a job outside elastic mode or inside another live
    set's block; :class:`~rabit2.errors.LiveSetError` if the set failed before its block began
    (a member lost while the set's links came up); what waiting for the set raises
    (:class:`~rabit2.errors.CollectiveTimeoutError` after ``rabit_timeout_sec``,
    :class:`~rabit2.errors.JobAbortedError`, :class:`~rabit2.errors.TrackerError`).
    Leaving waits until every member left the block, then raises
    :class:`~rabit2.errors.LiveSetError` on every member if any of them was lost in it or
    left it by an exception; a member whose own code raised sees that exception instead.
    """

    def __init__(self) -> None:
        self._live: LiveSet | None = None
        self._alone = False

    def __enter__(self) -> LiveSet:
        comm = state.require()
        member = comm.membership
        if member is None and comm.engine is None:
            # single-process mode (no tracker): a set of this one worker, as every other
            # call acts as one worker's; new in the first set only
            if _alone["open"]:
                raise RuntimeError("live_set() blocks do not nest")
            _alone["open"] = self._alone = True
            _alone["sets"] += 1
            # (inside it, as in a job: collectives run, finalize and checkpoints refuse)
            alone = LiveSet((0,), _alone["sets"], (0,) if _alone["sets"] == 1 else ())
            comm.live = alone
            return alone
        if member is None:
            raise RuntimeError("rabit2.live_set() needs elastic mode: rabit2-submit "
                               "--elastic, or rabit2.init(elastic=True) with a tracker")
        if comm.live is not None:
            raise RuntimeError("live_set() blocks do not nest")
        with comm.lock:
            offer = member.next_set()
            live = LiveSet(offer.ranks, offer.epoch, offer.new)
            self._live = live
            try:
                engine = member.join_set(offer, comm.job_rank)
            except RabitError as exc:
                _, reason = member.report(False, f"{type(exc).__name__}: {exc}", 0)
                raise LiveSetError(self._message(reason)) from exc
            comm.engine, comm.live = engine, live
            comm.rank, comm.world = live.index(comm.job_rank), len(live)
            comm.version = comm.seqno = 0
        logger.debug("live set %d: %s (new: %s)", live.epoch, tuple(live), live.new)
        return live

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._alone:
            _alone["open"] = self._alone = False
            state.comm.live = None
            return  # (an exception propagates, as a member's own does)
        comm = state.comm
        member = comm.membership
        with comm.lock:
            comm.engine, comm.live = None, None
            comm.rank, comm.world = comm.job_rank, comm.job_world
            calls = comm.seqno
        if member is None:  # (finalize() refuses inside a block; init again is the same)
            raise RuntimeError("the live set's job was left inside its block")
        ok = error is None
        reason = "" if ok else f"{type(error).__name__}: {' '.join(str(error).split())}"
        settled, why = member.report(ok, reason, calls)
        positions = self._positions()
        if isinstance(error, RabitError) and positions:
            error.add_note(positions)
        if settled or (error is not None and not isinstance(error, RabitError)):
            return  # (this member's own exception propagates; the others raise LiveSetError)
        failed = LiveSetError(self._message(why))
        if positions:
            failed.add_note(positions)
        raise failed from error

    def _message(self, reason: str) -> str:
        live = self._live
        assert live is not None
        return f"live set {live.epoch} {tuple(live)} failed: {reason}"

    def _positions(self) -> str:
        """What a rank named by the engine's messages means: the set's own engine numbers
        its members by their position in the set, while ``get_rank()`` and ``root=`` speak
        job ranks ("" where the two agree)."""
        live = self._live
        assert live is not None
        if tuple(live) == tuple(range(len(live))):
            return ""
        pairs = ", ".join(f"{i} is job rank {r}" for i, r in enumerate(live))
        return (f"(inside live set {live.epoch}'s block a plain \"rank N\" is a position in "
                f"the set: {pairs}; \"job rank N\" is the job's own rank)")


def heard_left(epoch: int, rank: int, calls: int) -> None:
    """The tracker says member ``rank`` left the block of set ``epoch`` after ``calls``
    collective calls (on the tracker connection's loop thread).  A call of this member's
    beyond them can never complete: it fails now with :class:`~rabit2.errors.MismatchError`,
    as does any later one in the block, instead of waiting for ``rabit_timeout_sec``."""
    comm = state.comm
    member = comm.membership
    if member is None or epoch != member.epoch:
        return
    if member.left is None or calls < member.left[1]:
        member.left = (rank, calls)
    engine = member.engine
    if engine is not None and comm.calling and comm.seqno >= calls:
        # (a call beyond them can never complete: failing it is right whatever the timing.
        # One that has not set ``calling`` yet checks ``left`` itself, under the lock)
        error = MismatchError(state.beyond_the_block(member.left, comm))
        threading.Thread(target=_fail, args=(engine, error), daemon=True,
                         name="rabit2-live-left").start()


def _fail(engine: Any, error: RabitError) -> None:
    with contextlib.suppress(RabitError):
        engine.fail(error, _FAIL_WAIT_SEC)


_FAIL_WAIT_SEC = 5.0


__all__ = ["LiveSet", "heard_left", "live_set"]
