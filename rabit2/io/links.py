"""Peer links: the protocol that reads and writes a link's socket (:class:`PeerLink`), and
what the engine does when a link goes down: hang-ups, the tracker's notices about a
neighbour, redials, the partition check (:class:`LinksMixin`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, cast

from rabit2.config import Config
from rabit2.core.agent import Agent, Command
from rabit2.errors import RabitError
from rabit2.io.tracker_client import Assignment, TrackerClient

if TYPE_CHECKING:
    from rabit2.io.engine import Engine

logger = logging.getLogger("rabit2.engine")

PARTITION_SEC = 15.0
"""How long a lost link may stay down before the tracker is asked whether the peer lives
(docs/recovery.md, "Partial partitions"): long enough for a reset to be dialed again, far
shorter than the replacement wait (``recover_timeout_sec``)."""
_NO_BYTES = memoryview(b"")


class PeerLink(asyncio.BufferedProtocol):
    """One authenticated TCP link to a neighbour; every callback goes to the engine."""

    def __init__(self, engine: Engine, peer: int) -> None:
        self.engine = engine
        self.faults = engine.faults
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.write_blocked = False
        self.current = True  # False once a newer connection to the same peer replaced it
        self.landing = _NO_BYTES  # where the last read went (failure injection only)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        # report "buffer non-empty" / "drained" exactly, so a call completes only once every
        # byte it handed to this transport has been copied into the kernel
        self.transport.set_write_buffer_limits(high=0, low=0)

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self.current:
            return self.engine.agent.discard_buffer()
        buf = self.engine.agent.recv_buffer(self.peer)
        if self.faults.damaging:
            self.landing = buf  # (failure injection only: no reference kept otherwise)
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if self.current:
            if self.faults.damaging:
                self.faults.damage(self.peer, nbytes, self.landing)
                self.landing = _NO_BYTES
            self.engine.on_bytes(self.peer, nbytes)

    def eof_received(self) -> bool:
        if self.current:
            self.engine.on_hangup(self.peer, "connection closed by peer")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        # nothing queued on a dead transport will ever drain: stop waiting for it
        self.write_blocked = False
        if self.current:
            self.engine.on_hangup(self.peer, f"connection lost: {exc}" if exc
                                  else "connection closed")
        self.engine.on_drained()

    def pause_writing(self) -> None:
        self.write_blocked = True

    def resume_writing(self) -> None:
        self.write_blocked = False
        self.engine.on_drained()


class LinksMixin:
    """The links of :class:`~rabit2.io.engine.Engine`, and how they come back after a loss."""

    if TYPE_CHECKING:  # owned by Engine and ConnectionsMixin
        config: Config
        agent: Agent
        loop: asyncio.AbstractEventLoop
        tracker: TrackerClient | None
        assignment: Assignment | None
        _closing: bool

        def _execute(self, cmds: list[Command]) -> None: ...
        async def _dial(self, peer: int, host: str, port: int) -> PeerLink: ...

    def _init_links(self) -> None:
        self.links: dict[int, PeerLink] = {}
        self._unsent: dict[int, int] = {}  # per link: bytes queued at the last tick
        self._issued: dict[int, int] = {}  # neighbour -> newest incarnation peer_recovered named
        self._redials: set[asyncio.Task[None]] = set()
        self._redialing: dict[int, asyncio.Task[None]] = {}  # rank -> its dialer
        self._partition_checks: dict[int, asyncio.TimerHandle] = {}
        # where restarted neighbours listen now (peer_recovered), also for notices that come
        # while this worker is still setting up (they are newer than its assignment)
        self._recovered_at: dict[int, tuple[str, int]] = {}

    def _incarnation_of(self, peer: int) -> int:
        incarnation = self.agent.link_incarnation(peer)
        assert incarnation is not None, f"rank {peer} is not a neighbour"
        return incarnation

    def on_hangup(self, peer: int, reason: str) -> None:
        if self.config.recover and self.agent.link_down_reason(peer) is None:
            logger.info("link to rank %d down at %.6f: %s", peer, time.time(), reason)
        self._execute(self.agent.on_hangup(peer, reason, self.loop.time()))
        assignment = self.assignment
        if (self.config.recover and assignment is not None and peer < assignment.rank
                and self.agent.error is None and not self.agent.ended):
            # the higher rank of a broken link dials again: the same process if it lives
            # (a reset), or its replacement once the tracker says where (peer_recovered).
            # A rank that holds in finalize waits for peer_recovered: links also close when
            # the ranks leave after bye.
            self._schedule_redial(peer, self._incarnation_of(peer), assignment.peers[peer])
        if self.config.recover and peer not in self._partition_checks:
            self._partition_checks[peer] = self.loop.call_later(
                PARTITION_SEC, self._check_partition, peer, self._incarnation_of(peer),
                self.loop.time())

    def _check_partition(self, peer: int, incarnation: int, since: float) -> None:
        """The link to ``peer`` went down ``PARTITION_SEC`` ago: still down, and no
        replacement connected?  Tell the tracker, which ends the job if ``peer`` is alive
        (both reach it but not each other: a partition), and leaves it to recovery if not
        (a dead or paused peer).  Asked again every ``PARTITION_SEC`` while it lasts."""
        self._partition_checks.pop(peer, None)
        agent = self.agent
        if (agent.link_is_up(peer) or agent.link_incarnation(peer) != incarnation
                or self._closing or self.tracker is None or agent.error is not None
                or agent.ended):
            return
        down = self.loop.time() - since
        logger.warning("the link to rank %d has been down for %.0f s: asking the tracker "
                       "whether rank %d is alive", peer, down, peer)
        self.tracker.report_unreachable(
            peer, f"rank {self.agent.rank}'s link to rank {peer} has been down for "
                  f"{down:.0f} s ({agent.link_down_reason(peer) or 'lost'})")
        self._partition_checks[peer] = self.loop.call_later(
            PARTITION_SEC, self._check_partition, peer, incarnation, since)

    def _on_peer_lost(self, rank: int, incarnation: int, reason: str) -> None:
        """The tracker saw a neighbour die or go silent (a paused process keeps its TCP
        links open, so only the tracker's heartbeat deadline can tell): treat it as that
        link's hang-up, so a call that needs it fails (or, with recovery on, waits for the
        replacement) now instead of at the progress deadline."""
        known = self.agent.link_incarnation(rank)
        if known is None or incarnation < known:
            return  # about an incarnation that was already replaced
        link = self.links.get(rank)
        if link is not None and link.write_blocked and link.transport is not None:
            # bytes queued for a peer that will never read them: drop the link, so that a
            # finished call stops waiting for them (connection_lost clears the flag)
            link.transport.abort()
        self.on_hangup(rank, f"the tracker lost rank {rank}: {reason}")
        self._execute(self.agent.on_peer_dead(rank, self.loop.time()))

    def _on_peer_recovered(self, rank: int, incarnation: int, address: tuple[str, int]) -> None:
        """A lost neighbour was restarted: the higher rank of a link dials, as at init."""
        if not self.config.recover:
            return
        self._recovered_at[rank] = address  # (the dial at init may be trying the old one)
        self._issued[rank] = max(self._issued.get(rank, -1), incarnation)
        assignment = self.assignment
        if assignment is None or self.agent.link_incarnation(rank) is None:
            return
        # where it listens now: a later reset of that link is dialed there, not at the
        # address of the process that died
        assignment.peers[rank] = address
        if rank < assignment.rank and not self.agent.bootstrapping:
            # (during init, the dial at init tries the new address itself)
            self._schedule_redial(rank, incarnation, address)

    def _schedule_redial(self, rank: int, incarnation: int, address: tuple[str, int]) -> None:
        if self._closing:
            return  # (closing the links hangs them up: no new task may outlive the loop)
        running = self._redialing.get(rank)
        if running is not None and not running.done():
            # one dialer per link: it dials where the tracker last said the peer listens,
            # until the link is up (a second one would make the peer take its connection
            # as a re-dial and reset the first)
            return
        task = self.loop.create_task(self._redial(rank, incarnation, address))
        self._redials.add(task)
        self._redialing[rank] = task
        task.add_done_callback(self._redials.discard)

    async def _redial(self, rank: int, incarnation: int, address: tuple[str, int]) -> None:
        deadline = self.loop.time() + self.config.recover_timeout_sec
        delay = 0.05
        while (self._incarnation_of(rank) < incarnation
               or not self.agent.link_is_up(rank)):
            try:
                # where a replacement listens once peer_recovered said so (the peer may have
                # died again after this redial began, e.g. while this worker was in init)
                await self._dial(rank, *self._recovered_at.get(rank, address))
                return
            except RabitError as exc:
                if (self.loop.time() + delay > deadline or self.agent.error is not None
                        or self._closing):  # (closing cancelled us; 3.11 can lose that)
                    logger.warning("cannot reconnect to rank %d: %s", rank, exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _sending_progressed(self) -> bool:
        """Did some link's queue of unsent bytes shrink since the last tick (the kernel took
        bytes from it)?  Progress deadlines count those bytes, not only received ones."""
        progressed = False
        for peer, link in self.links.items():
            transport = link.transport
            size = (0 if transport is None or transport.is_closing()
                    else transport.get_write_buffer_size())
            if size < self._unsent.get(peer, 0):
                progressed = True
            self._unsent[peer] = size
        return progressed
