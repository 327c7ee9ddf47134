"""The I/O driver: one background event loop per worker, TCP links, and the agent on top.

The loop runs in a daemon thread for the life of the worker (:mod:`rabit2.io.loop_thread`)
and feeds the :class:`~rabit2.core.agent.Agent` events and executes the commands it returns.
A call (:meth:`Engine.run_call`) is driven by the caller's own thread while it holds the
parked loop (:mod:`rabit2.io.driving`), and handed to the loop thread, which the caller then
waits for (:mod:`rabit2.io.waiting`), when it takes longer or leaves the happy path.
Joining the job and the peer port are in :mod:`rabit2.io.connections`, the links and their
recovery in :mod:`rabit2.io.links`, the ``mock=`` hooks in :mod:`rabit2.io.faults`.

Links are :class:`asyncio.BufferedProtocol` s: ``get_buffer`` returns the view the agent
names (the frame header buffer, the user's array or a link's scratch), so received bytes are
never copied in Python.  Sends are ``writelines([header, view, ...])`` of views of the user's
array; a call is reported complete only after every link's write buffer has drained, so the
caller can reuse its array the moment ``run_call`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence

from rabit2.config import Config
from rabit2.core.agent import (
    Agent,
    Call,
    CallComplete,
    CallFailed,
    CheckpointLoaded,
    CloseLink,
    Command,
    PauseReading,
    ResumeReading,
    Send,
)
from rabit2.core.framing import CollectiveKind
from rabit2.core.fsm import State
from rabit2.core.planning import choose_allreduce
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    PeerLostError,
    ProtocolError,
    RabitError,
    TrackerError,
    UnrecoverableError,
)
from rabit2.io.assignment import Assignment
from rabit2.io.connections import Connections
from rabit2.io.driving import Driver
from rabit2.io.express_wire import Ahead, Written
from rabit2.io.faults import FaultInjector
from rabit2.io.handshake import resolve_congestion
from rabit2.io.links import LinkKeeper, PeerLink
from rabit2.io.loop_thread import LoopThread, bind_to_cpu, die_with_launcher
from rabit2.io.tracker_client import TrackerClient
from rabit2.io.waiting import Poller, Waiter

logger = logging.getLogger("rabit2.engine")
ROOT_CAUSE_WAIT_SEC = 2.0
"""How long a call that failed on a lost link waits for the tracker's abort, which names the
failure that ended the peer (:meth:`Engine.run_call`)."""


class Engine:
    """A worker's connection to the job: tracker client, peer links, agent, loop thread."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # the peer links' congestion control (a bad explicit setting fails here, at init)
        self.congestion = resolve_congestion(config.tcp_congestion)
        bind_to_cpu(os.environ.get("RABIT2_BIND_CPU"))
        die_with_launcher(os.environ.get("RABIT2_LAUNCHER_PID"))
        self.agent = Agent(
            ring_mincount=config.reduce_ring_mincount,
            ring_min_bytes=config.ring_min_bytes,
            tree_chunk=config.tree_reduce_minsize,
            timeout=config.timeout_sec,
            recover=config.recover,
            recover_timeout=config.recover_timeout_sec,
            retain_bytes=config.replay_mb << 20,
            local_replica=config.local_replica,
            checked=config.checksum != "off",
        )
        # the loop thread defers to a polling caller (both off with rabit2_spin_us=0)
        self.loop_thread = LoopThread(config.loop)
        self.loop_thread.set_batch(config.spin_us > 0)
        self.loop = self.loop_thread.loop
        self._poller = Poller(config.spin_us / 1e6, self.loop_thread)
        self.driver = Driver(self, config.drive_ms / 1e3, config.spin_us / 1e6, config.express,
                             config.drive_general)
        self.faults = FaultInjector(self.agent)
        self.tracker: TrackerClient | None = None
        self.assignment: Assignment | None = None
        self.links: dict[int, PeerLink] = {}
        # what the tracker said of restarted neighbours: the newest incarnation it named,
        # and where each listens now (also notices that come while this worker sets up:
        # they are newer than its assignment)
        self.issued: dict[int, int] = {}
        self.recovered_at: dict[int, tuple[str, int]] = {}
        self.connections = Connections(self)
        self.keeper = LinkKeeper(self)
        self._pending: Waiter | None = None
        self._completed = False  # the agent finished the call; waiting for writes to drain
        self.calling = 0  # collectives under way in run_call (the callers' threads)
        self._sent_at = 0.0  # when bytes last left on a link, or a drain wait began
        self._drain_timer: asyncio.TimerHandle | None = None  # the drain wait's deadline
        self._tick_handle: asyncio.TimerHandle | None = None
        self._writelines = self.loop_thread.is_uvloop
        self._overflow_told = False  # the replay store's first overflow was logged
        self._ckpt_waiter: Waiter | None = None
        self._ckpt_loaded: tuple[int, bytes | None, bytes | None] = (0, None, None)
        self.closing = False
        self.holding = False  # in finalize, holding until every rank has finalized
        self.failed = asyncio.Event()  # set when the tracker aborts the job
        self.signalled = False  # this worker asked the tracker to abort the job
        self.signalled_error: JobAbortedError | None = None  # (signal_error: every call's)
        # the same, for a caller's thread (also set when the tracker connection ends)
        self._tracker_ended = threading.Event()

    # ------------------------------------------------------------------ bootstrap

    def start(self) -> None:
        """Connect to the tracker, get a rank, wire up the links.  Blocks; bounded."""
        budget = self.config.connect_timeout_sec * max(1, self.config.connect_retry) + (
            self.config.timeout_sec
        )
        try:
            self.loop_thread.run(self.connections.bootstrap(), budget)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ calls

    def run_call(self, call: Call, kill_after_bytes: int = -1, reset_peer: int = -1,
                 damage: bool = False) -> None:
        """Run one collective; blocks the calling thread until it finished or failed.

        ``kill_after_bytes >= 0`` is failure injection (``mock=...,after_bytes``): the
        process SIGKILLs itself once that many payload bytes of this call have arrived (or,
        with ``reset_peer >= 0``, resets its link to that rank instead, or with ``damage``
        flips the bits of one byte that arrives from that rank).
        """
        if self.signalled_error is not None:
            raise self.signalled_error
        waiter = Waiter()
        # (the heartbeats say so until the caller has the outcome: a call failed on the loop
        # thread is still this rank's call in the heartbeat sent in the same turn, before
        # the caller could report its error)
        self.calling += 1
        try:
            if not self.driver.run(call, waiter, kill_after_bytes, reset_peer, damage):
                self.loop_thread.call_soon_threadsafe(self.begin_call, call, waiter,
                                                      kill_after_bytes, reset_peer, damage)
            # the agent's progress deadline fails a stuck call; this outer bound only guards
            # against a dead loop thread
            bound = self.config.timeout_sec * 2 + 60
            if not waiter.finished and not self._poller.wait(waiter, bound):
                raise CollectiveTimeoutError(
                    f"the loop thread did not answer within {bound:g} s")
        finally:
            self.calling -= 1
        if waiter.error is not None:
            raise self._root_cause(waiter.error)

    def _root_cause(self, error: BaseException) -> BaseException:
        """The error a failed call raises.  A lost link is most often the echo of a failure
        that the tracker is about to name to every rank: a peer that refused a bad request and
        left, a worker that exited and is not restarted.  The peer's socket closes at once,
        while the tracker's abort takes two hops, so the call waits up to
        ``ROOT_CAUSE_WAIT_SEC`` for that abort and raises it (chained to the lost link)
        rather than the echo.  Only a failure waits, and not once the tracker is gone."""
        tracker = self.tracker
        if not isinstance(error, PeerLostError) or tracker is None:
            return error
        self._tracker_ended.wait(ROOT_CAUSE_WAIT_SEC)
        abort = tracker.abort_error
        if abort is None:
            return error
        named = JobAbortedError(str(abort))
        named.__cause__ = error
        return named

    def begin_call(self, call: Call, waiter: Waiter, kill_after_bytes: int = -1,
                   reset_peer: int = -1, damage: bool = False,
                   written: Written | Sequence[Written] | None = None,
                   ahead: Ahead | None = None) -> None:
        """Begin ``call`` on the agent; ``waiter`` hears how it ends.  On the loop thread, or
        on a caller's thread that holds the parked loop (:mod:`rabit2.io.driving`).
        ``written``, ``ahead``: what an express start of the call wrote already
        (:mod:`rabit2.io.express_wire`)."""
        self.faults.arm(kill_after_bytes, reset_peer, damage)
        skips = (() if written is None else (written,) if isinstance(written, Written)
                 else written)
        try:
            cmds = self.agent.begin(call, self.loop.time(), () if ahead is None else ahead.peers)
            for skip in skips:
                cmds = skip.skip(cmds)
        except Exception as exc:  # the caller must see every failure, never wait it out
            on_wire = ([skip.peer for skip in skips if skip.count]
                       + ([] if ahead is None else ahead.peers))
            if on_wire and self.agent.error is None:
                # bytes of this call are on the wire: the peer's stream cannot be kept whole,
                # so the link closes and every rank hears a typed error
                failed: list[Command] = []
                reason = (f"rank {self.agent.rank}: a call begun express could not go on the "
                          f"general way: {exc}")
                self.agent.fail(ProtocolError(reason), failed, close=on_wire[0])
                failed += [CloseLink(peer, reason) for peer in on_wire[1:]]
                self.execute(failed)
            waiter.finish(self.agent.error or exc)
            return
        self._pending = waiter
        self._completed = False
        if ahead is not None:
            ahead.queue(self.links)
        self.execute(cmds)

    def execute(self, cmds: list[Command]) -> None:  # noqa: C901, PLR0912
        for cmd in cmds:
            if isinstance(cmd, Send):
                link = self.links.get(cmd.peer)
                if link is None or link.transport is None or link.transport.is_closing():
                    continue
                if cmd.volatile:
                    link.write_copied(cmd.buffers)
                elif self._writelines:
                    link.transport.writelines(cmd.buffers)
                else:
                    # asyncio's writelines joins (copies) everything first on Python 3.11
                    for buf in cmd.buffers:
                        link.transport.write(buf)
            elif isinstance(cmd, CallComplete):
                if cmd.finish is not None:
                    cmd.finish()  # (the sends before it were written or copied)
                self.call_done()
                if self.faults.kill_at >= 0:  # fewer bytes arrived than asked: fail at the end
                    self.faults.fire(self.links)
                self._completed = True
                self.on_drained()
                if self._pending is not None:
                    # the last bytes are queued on a link whose peer stopped reading: that
                    # wait has the same progress deadline as the call itself
                    waiting = self._pending
                    self._sent_at = max(self._sent_at, self.loop.time())
                    self._drain_timer = self.loop.call_later(
                        self.config.timeout_sec, self._drain_deadline, waiting)
            elif isinstance(cmd, CallFailed):
                waiter, self._pending = self._pending, None
                self._stop_drain_timer()
                if waiter is not None:
                    waiter.finish(cmd.error)
                if (self.holding and self.tracker is not None
                        and not isinstance(cmd.error, JobAbortedError)):
                    # found while this rank holds in finalize (a peer's call after it
                    # finalized): the job ends here, and so does the hold (the tracker's
                    # abort goes to every rank but the one that signalled it); finalize
                    # raises it
                    self.tracker.signal_error(f"{type(cmd.error).__name__}: {cmd.error}")
                    self.tracker.leave_hold()
                ckpt = self._ckpt_waiter
                if ckpt is not None and cmd.call_id is None:
                    self._ckpt_waiter = None
                    ckpt.finish(cmd.error)
            elif isinstance(cmd, CheckpointLoaded):
                if cmd.version:
                    logger.info("resuming from checkpoint version %d, loaded from the "
                                "neighbours", cmd.version)
                self._ckpt_loaded = (cmd.version, cmd.blob, cmd.local)
                ckpt = self._ckpt_waiter
                if ckpt is not None:
                    self._ckpt_waiter = None
                    ckpt.finish(None)
            elif isinstance(cmd, PauseReading):
                transport = self.links[cmd.peer].transport
                if transport is not None:
                    transport.pause_reading()
            elif isinstance(cmd, ResumeReading):
                transport = self.links[cmd.peer].transport
                if transport is not None:
                    transport.resume_reading()
            elif isinstance(cmd, CloseLink):
                logger.warning("closing link to rank %d: %s", cmd.peer, cmd.reason)
                transport = self.links[cmd.peer].transport
                if transport is not None:
                    transport.abort()

    def call_done(self) -> None:
        """A call completed (the general way or express)."""
        if self.agent.replay_overflow >= 0 and not self._overflow_told:
            self._tell_overflow()

    def _tell_overflow(self) -> None:
        """Say (once per process) that the replay store lost a result of the version being
        made: until the next checkpoint, a lost worker cannot be recovered
        (docs/recovery.md, "What every rank keeps")."""
        self._overflow_told = True
        logger.warning(
            "rank %d: the results of version %d outgrew rabit2_replay_mb (%d MiB): a worker "
            "lost before the next checkpoint cannot be recovered; checkpoint more often or "
            "raise rabit2_replay_mb (said once)", self.agent.rank,
            self.agent.replay_overflow, self.config.replay_mb)

    def on_hangup(self, peer: int, reason: str) -> None:
        """A link closed or failed (its :class:`PeerLink` says so)."""
        self.keeper.on_hangup(peer, reason)

    def on_bytes(self, peer: int, nbytes: int) -> None:
        try:
            cmds = self.agent.on_bytes(peer, nbytes, self.loop.time())
        except Exception as exc:
            # a defect on the path of ``peer``'s bytes (what comes off the wire is checked
            # where it is decoded): the job ends at once with it named, on every rank,
            # rather than the link closing and the loss being taken for a crash or partition
            logger.exception("rank %d: handling the bytes from rank %d failed",
                             self.agent.rank, peer)
            cmds = []
            if self.agent.error is None:  # (every neighbour hears it, ``peer`` too)
                self.agent.fail(ProtocolError(
                    f"rank {self.agent.rank}: handling the bytes from rank {peer} failed: "
                    f"{type(exc).__name__}: {exc}"), cmds)
        self.execute(cmds)
        if self.faults.kill_at >= 0:
            self.faults.after_bytes(self.links)

    def on_drained(self) -> None:
        """Resolve the finished call once no link holds unsent bytes of the caller's array."""
        if not self._completed or self._pending is None:
            return
        for link in self.links.values():
            if link.write_blocked:
                return
        waiter, self._pending = self._pending, None
        self._completed = False
        self._stop_drain_timer()
        waiter.finish(None)

    def _stop_drain_timer(self) -> None:
        """The drain's deadline is moot (the call ended): cancelled, not left pending for
        ``timeout_sec`` (one per call that had to wait for its last bytes to leave)."""
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def _drain_deadline(self, waiter: Waiter) -> None:
        quiet = self.loop.time() - self._sent_at
        if self._pending is waiter and quiet < self.config.timeout_sec:
            # bytes are still leaving (a slow link): a progress deadline, not a total one
            self._drain_timer = self.loop.call_later(self.config.timeout_sec - quiet,
                                                     self._drain_deadline, waiter)
            return
        if self._pending is waiter:
            self._pending, self._completed = None, False
            blocked = [p for p, link in self.links.items() if link.write_blocked]
            waiter.finish(CollectiveTimeoutError(
                f"rank {self.agent.rank}: ranks {blocked} did not read this call's last bytes "
                f"within {self.config.timeout_sec:g} s"
            ))

    # ------------------------------------------------------------------ the job and the clock

    def on_abort(self, reason: str) -> None:
        self.execute(self.agent.abort(reason))
        self.failed.set()
        self._tracker_ended.set()

    def schedule_tick(self) -> None:
        interval = min(1.0, self.config.timeout_sec / 4)
        self._tick_handle = self.loop.call_later(interval, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        if self.keeper.sending_progressed():
            self._sent_at = now
            self.agent.on_send_progress(now)
        self.execute(self.agent.on_tick(now))
        self.schedule_tick()

    # ------------------------------------------------------------------ tracker services

    def tracker_print(self, msg: str, wait: bool = True) -> None:
        if self.tracker is None:
            raise TrackerError("not connected to a tracker")
        self.tracker.print(msg, wait)
        self.loop_thread.wake()  # (a loop lent to calls must not hold it back)

    def signal_error(self, msg: str) -> None:
        """Ask the tracker to abort the job; this rank's calls fail from now on too (any
        thread; never blocks: a call made on the caller's thread before the loop thread
        failed the agent raises it all the same)."""
        if self.tracker is not None:
            self.signalled = True
            self.signalled_error = JobAbortedError(f"this rank ended the job: {msg}")
            self.tracker.signal_error(msg)
            self.fail_soon(self.signalled_error)

    def checkpoint(self, blob: bytes | Callable[[], bytes] | None = None,
                   local: bytes | None = None) -> int:
        """Bump the version; with recovery on, keep ``blob`` for restarted neighbours and
        hand ``local`` (this rank's local model) on to the next ranks of the ring.  That
        hand-over is not waited for: a rank that dies before its replica arrived resumes
        one version earlier, which every rank keeps too (``docs/recovery.md``)."""
        return self.loop_thread.run(self._checkpoint(blob, local), self.config.timeout_sec)

    async def _checkpoint(self, blob: bytes | Callable[[], bytes] | None,
                          local: bytes | None) -> int:
        version = self.agent.checkpoint(blob)
        if self.config.recover:
            # (an empty blob when there is none: a restarted rank that loads with_local
            # then learns it had none, rather than that its neighbours lost it)
            self.execute(self.agent.push_local(b"" if local is None else local))
        return version

    def fail(self, error: RabitError, timeout: float | None = None) -> None:
        """Fail with ``error``: found between calls by every rank alike (an allgather's
        inputs that do not fit together), or this rank ends the job (a call still under way
        in another thread raises it at once).  Every later call raises it, as after a
        failed call, and finalize ends the job with it.  ``timeout``: how long to wait for
        the loop thread (``timeout_sec`` when None)."""
        if self.loop.is_closed():
            return  # (closed: no call is under way, and none can begin)
        self.loop_thread.run(self._fail(error),
                             self.config.timeout_sec if timeout is None else timeout)

    async def _fail(self, error: RabitError) -> None:
        self._fail_now(error)

    def fail_soon(self, error: RabitError) -> None:
        """:meth:`fail`, without waiting for the loop thread (any thread; never blocks)."""
        if not self.loop.is_closed():
            self.loop_thread.call_soon_threadsafe(self._fail_now, error)
            self.loop_thread.wake()

    def _fail_now(self, error: RabitError) -> None:
        cmds: list[Command] = []
        self.agent.fail(error, cmds, flood=False)  # (every rank found it: none is told)
        self.execute(cmds)

    @property
    def restarted(self) -> bool:
        """This worker replaces a lost one and replays (decided at init, from the
        assignment: the API thread asks, and must not read the loop thread's agent)."""
        assignment = self.assignment
        return self.config.recover and assignment is not None and assignment.incarnation > 0

    def choose_allreduce(self, nbytes: int, itemsize: int) -> CollectiveKind:
        """The allreduce algorithm for ``nbytes`` of ``itemsize``-byte elements (the API
        thread asks: from the assignment and the settings, not from the agent)."""
        world = self.assignment.world_size if self.assignment is not None else 1
        return choose_allreduce(nbytes, itemsize, world, self.config.reduce_ring_mincount,
                                self.config.ring_min_bytes)

    def replays_next(self) -> bool:
        """The next call's result comes from a neighbour (``prepare_fun`` is skipped).  Only
        a restarted worker can replay; it asks its agent on the loop thread."""
        if not self.restarted:
            return False
        return self.loop_thread.run(self._replays_next(), self.config.timeout_sec)

    async def _replays_next(self) -> bool:
        return self.agent.replays()

    def load_checkpoint(self, with_local: bool = False) -> tuple[int, bytes | None, bytes | None]:
        """A restarted worker's checkpoint (and local model), fetched from its neighbours.
        Bounded by ``timeout_sec``; raises :class:`UnrecoverableError` if no neighbour
        holds it."""
        waiter = Waiter()
        self.loop_thread.call_soon_threadsafe(self._begin_load, waiter, with_local)
        if not waiter.lock.acquire(True, self.config.timeout_sec):
            raise CollectiveTimeoutError(
                f"no checkpoint from the neighbours within {self.config.timeout_sec:g} s")
        if waiter.error is not None:
            raise waiter.error
        return self._ckpt_loaded

    def _begin_load(self, waiter: Waiter, with_local: bool) -> None:
        self._ckpt_waiter = waiter
        try:
            cmds = self.agent.load_checkpoint(with_local)
        except Exception as exc:
            self._ckpt_waiter = None
            if isinstance(exc, UnrecoverableError):
                # the job cannot go on: the neighbours hear it now, the tracker at finalize
                self.execute(self.agent.fail_load(exc))
            waiter.finish(exc)
            return
        self.execute(cmds)

    def keep_bootstrap(self) -> None:
        """The program's first ``load_checkpoint`` (not restarted): :meth:`Agent.keep_bootstrap`."""
        self.loop_thread.run(self._keep_bootstrap(), self.config.timeout_sec)

    async def _keep_bootstrap(self) -> None:
        calls = self.agent.seqno if self.agent.version == 0 else 0
        why = self.agent.keep_bootstrap()
        if why is not None:
            logger.warning(
                "rank %d: the %d collective calls made before the first load_checkpoint are "
                "not kept for a restarted worker's replay (rabit2_replay_mb, %d MiB): %s; a "
                "worker lost once a call after the first checkpoint finished cannot be "
                "recovered: raise rabit2_replay_mb", self.agent.rank, calls,
                self.config.replay_mb, why)

    def recovery_statistics(self) -> dict[str, int]:
        """The agent's recovery counters (links re-established, bytes fetched, resent...)."""
        return self.loop_thread.run(self._recovery_statistics(), self.config.timeout_sec)

    async def _recovery_statistics(self) -> dict[str, int]:
        return self.agent.recovery_statistics()

    def progress(self) -> dict[str, int | bool]:
        """What the heartbeats report (``rabit2.core.control.PROGRESS_FIELDS``); on the
        loop thread, which owns the agent."""
        agent = self.agent
        stats = agent.statistics()
        recovery = agent.recovery_statistics()
        return {"version": agent.version, "seqno": agent.seqno,
                "calls": stats.calls_completed, "sent": stats.bytes_sent,
                "received": stats.bytes_received, "links_reset": recovery["links_up"],
                "replayed": recovery["replayed_calls"], "resumed": recovery["resumed_calls"],
                "replaying": agent.restarted,
                "in_call": agent.active is not None or self.calling > 0}

    # ------------------------------------------------------------------ shutdown

    def finalize(self) -> None:
        """Tell the tracker we are done, close every link, stop the loop.  Bounded.

        With recovery on (and no failure) the worker first holds, still serving its
        neighbours, until every rank has finalized: a neighbour that dies after its last
        collective is restarted, replays from the results kept here and finalizes too
        (``docs/recovery.md``).  The hold is bounded by ``timeout_sec``; an abort of the job
        meanwhile raises :class:`JobAbortedError`."""
        assignment = self.assignment
        hold = (self.config.recover and assignment is not None and assignment.world_size > 1
                and self.agent.error is None and self.tracker is not None)
        wait = self.config.timeout_sec if hold else self.config.connect_timeout_sec
        try:
            self.loop_thread.run(self._finalize(hold, wait),
                                 wait + self.config.connect_timeout_sec + 5)
        finally:
            self.close()

    async def _finalize(self, hold: bool, wait: float) -> None:
        before = self.agent.error
        if self.agent.state is not State.TASK_COMPLETE:
            # (which may find the ranks diverged; not after this worker ended the job, whose
            # peers' calls are the echo of what it named)
            self.execute(self.agent.shutdown(check=not self.signalled))
        error = self.agent.error
        if hold and (error is not None or self.signalled):
            hold, wait = False, min(wait, self.config.connect_timeout_sec)
        if (error is not None and not isinstance(error, JobAbortedError)
                and self.tracker is not None):
            # a typed failure is final (the launcher does not restart a worker that shut
            # down with the tracker): abort the job, so that a replacement still in init,
            # which no peer's error reaches, stops at once instead of at its deadlines
            self.tracker.signal_error(f"{type(error).__name__}: {error}")
        self.holding = hold
        try:
            if self.tracker is not None:
                await self.tracker.shutdown(wait, hold=hold,
                                            leave_timeout=self.config.connect_timeout_sec)
        except JobAbortedError:
            if hold:
                raise
        except RabitError as exc:
            logger.warning("tracker shutdown: %s", exc)
        finally:
            self.holding = False
        stats = self.agent.statistics()
        logger.info("left the job after %d calls (%d B sent, %d B received)",
                    stats.calls_completed, stats.bytes_sent, stats.bytes_received)
        found = self.agent.error
        if found is not None and found is not before and not isinstance(found, JobAbortedError):
            raise found  # (found in finalize: the ranks' sequences of calls diverged)

    def close(self) -> None:
        """Release every resource; safe to call twice and from any state."""
        if self.loop.is_closed():
            return

        async def _close() -> None:
            self.closing = True
            pending = [*self.keeper.redials, *self.connections.tasks()]
            self.connections.stop_listening()
            for task in pending:
                task.cancel()
            # let them unwind here, so that none is destroyed pending with the loop
            await asyncio.gather(*pending, return_exceptions=True)
            if self._tick_handle is not None:
                self._tick_handle.cancel()
            for handle in self.keeper.partition_checks.values():
                handle.cancel()
            for link in self.links.values():
                if link.transport is not None:
                    link.transport.close()
            if self.tracker is not None:
                await self.tracker.close()

        with contextlib.suppress(Exception):
            self.loop_thread.run(_close(), 5)
        self.loop_thread.stop()
        self.driver.close()

