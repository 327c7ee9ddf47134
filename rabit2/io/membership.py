"""An elastic worker's place in its job (docs/elastic.md): the tracker connection through
which it asks for live sets and reports their outcome, and the engine of the current set.

Between sets the worker holds only its tracker connection (on a loop thread of its own): no
peer links, no recovery.  Each set's collectives run on an :class:`Engine` of a job of the
set's size at the set's own tracker (rank: the place in the set, recovery off); a set with
the same members as the previous successful one keeps it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from typing import Any

from rabit2.config import Config
from rabit2.errors import JobAbortedError, JobFinishedError, RabitError
from rabit2.io.assignment import Assignment
from rabit2.io.engine import Engine
from rabit2.io.loop_thread import LoopThread
from rabit2.io.tracker_client import TrackerClient

logger = logging.getLogger("rabit2.engine")

_SLACK_SEC = 5.0  # on top of a wait's own deadline, for the loop thread to answer


@dataclasses.dataclass(frozen=True)
class SetOffer:
    """A live set as the tracker announced it."""

    epoch: int
    ranks: tuple[int, ...]
    new: tuple[int, ...]
    address: tuple[str, int]  # where the set's collectives' tracker listens
    same: bool  # that tracker is the previous set's (whose engine may go on)


class Membership:
    """An elastic worker's tracker connection and the engine of its current set."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.loop_thread = LoopThread(config.loop)
        # the port this worker names when it registers: reserved, never dialed (the sets'
        # engines listen on ports of their own)
        self._port = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tracker: TrackerClient | None = None
        self.assignment: Assignment | None = None
        self.engine: Engine | None = None  # the current set's
        self._engine_at: tuple[str, int] | None = None  # its tracker
        self.epoch = 0  # the last set offered
        # (rank, calls): a member that left the current set's block after so many calls
        # (the fewest heard of); None while none did
        self.left: tuple[int, int] | None = None
        self.signalled: JobAbortedError | None = None  # signal_error: every later call's

    def start(self) -> None:
        """Join the job: connect, register, get a rank.  Bounded; raises what
        :meth:`TrackerClient.connect` and ``wait_assignment`` raise."""
        cfg = self.config
        try:
            self._port.bind(("0.0.0.0", 0))
            port = self._port.getsockname()[1]
            budget = cfg.connect_timeout_sec * max(1, cfg.connect_retry) + cfg.timeout_sec
            self.tracker = self.loop_thread.run(TrackerClient.connect(cfg, port), budget)
            self.assignment = self.loop_thread.run(
                self.tracker.wait_assignment(cfg.timeout_sec), cfg.timeout_sec + _SLACK_SEC)
        except BaseException:
            self.close()
            raise

    def _ask(self, msg: dict[str, Any], reply: str) -> dict[str, Any]:
        assert self.tracker is not None
        timeout = self.config.timeout_sec
        return self.loop_thread.run(self.tracker.ask(msg, reply, timeout),
                                    timeout + _SLACK_SEC)

    def next_set(self) -> SetOffer:
        """Wait (barrier) for the next live set.  Raises :class:`CollectiveTimeoutError`,
        :class:`JobAbortedError`, :class:`JobFinishedError` (this worker came back after
        the others finished the job: there is nothing to join) or :class:`TrackerError`."""
        if self.signalled is not None:
            raise self.signalled
        msg = self._ask({"t": "live", "epoch": self.epoch}, "live_set")
        if not msg["ranks"]:  # (newcomers only, and the others finished the job)
            raise JobFinishedError(str(msg.get("reason", "there is no live set to join")))
        self.epoch, self.left = msg["epoch"], None
        return SetOffer(msg["epoch"], tuple(msg["ranks"]), tuple(msg["new"]),
                        (msg["host"], msg["port"]), bool(msg.get("same", False)))

    def join_set(self, offer: SetOffer, rank: int) -> Engine:
        """The engine of ``offer``'s collectives: the current one when the set's tracker is
        the same, else a new one (the old one leaves its set first).  Raises what
        :meth:`Engine.start` raises."""
        if self.engine is not None and offer.same and self._engine_at == offer.address:
            return self.engine
        self.leave_set(graceful=True)
        host, port = offer.address
        config = dataclasses.replace(
            self.config, tracker_uri=host, tracker_port=port, task_id=str(rank),
            num_attempt=0, world_size=len(offer.ranks), recover=False, elastic=False,
            mock=())
        engine = Engine(config)
        engine.start()  # (closes itself if it fails)
        if engine.tracker is not None:  # (the set's end is said by LiveSetError, once)
            engine.tracker.abort_log_level = logging.DEBUG
        self.engine, self._engine_at = engine, offer.address
        return engine

    def report(self, ok: bool, reason: str, calls: int) -> tuple[bool, str]:
        """Tell the tracker this worker left the current set's block after ``calls``
        collective calls; the set's outcome, the same on every member.  A failed set's
        engine is closed."""
        msg = self._ask({"t": "live_done", "epoch": self.epoch, "ok": ok,
                         "reason": reason[:1000], "calls": calls}, "live_result")
        self.left = None
        if not (ok and msg["ok"]):
            self.leave_set(graceful=False)
        return bool(msg["ok"]), str(msg["reason"])

    def leave_set(self, graceful: bool) -> None:
        """Leave the current set's collectives: ``graceful`` tells its tracker (the set
        succeeded), else the engine is only closed (it failed, its tracker is gone)."""
        engine, self.engine, self._engine_at = self.engine, None, None
        if engine is None:
            return
        if graceful:
            try:
                engine.finalize()
                return
            except RabitError as exc:
                logger.debug("leaving the previous live set: %s", exc)
        engine.close()

    def finalize(self) -> None:
        """Leave the job: the current set, then the tracker.  Bounded."""
        self.leave_set(graceful=True)
        try:
            if self.tracker is not None:
                self.loop_thread.run(
                    self.tracker.shutdown(self.config.connect_timeout_sec),
                    self.config.connect_timeout_sec + _SLACK_SEC)
        finally:
            self.close()

    def signal_error(self, msg: str) -> None:
        """Ask the tracker to abort the job; this worker's calls fail from now on too, the
        current set's and every later ``live_set()`` (any thread; never blocks)."""
        if self.tracker is not None:
            self.signalled = JobAbortedError(f"this rank ended the job: {msg}")
            self.tracker.signal_error(msg)
            engine = self.engine
            if engine is not None:
                engine.signalled_error = self.signalled
                engine.fail_soon(self.signalled)

    def tracker_print(self, msg: str, wait: bool = True) -> None:
        if self.tracker is not None:
            self.tracker.print(msg, wait)

    def close(self) -> None:
        """Release everything; safe to call twice and from any state."""
        self.leave_set(graceful=False)
        tracker, self.tracker = self.tracker, None
        if tracker is not None and not self.loop_thread.loop.is_closed():
            try:
                self.loop_thread.run(tracker.close(), 5.0)
            except RabitError as exc:
                logger.debug("closing the tracker connection: %s", exc)
        if not self.loop_thread.loop.is_closed():
            self.loop_thread.stop()
        self._port.close()


__all__ = ["Membership", "SetOffer"]
