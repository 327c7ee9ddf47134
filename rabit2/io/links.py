"""Peer links: the protocol that reads and writes a link's socket (:class:`PeerLink`), and
what the engine does when a link goes down: hang-ups, the tracker's notices about a
neighbour, redials, the partition check (:class:`LinkKeeper`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, cast

from rabit2.errors import RabitError

if TYPE_CHECKING:
    from rabit2.io.engine import Engine

logger = logging.getLogger("rabit2.engine")

# How long a lost link may stay down before the tracker is asked whether the peer lives:
# this share of ``link_timeout_sec`` (15 s by default), at least PARTITION_MIN_SEC
# (docs/recovery.md, "Partial partitions").  Long enough for a reset to be dialed again, far
# shorter than the replacement wait (``recover_timeout_sec``).
PARTITION_SHARE = 0.75
PARTITION_MIN_SEC = 2.0
_NO_BYTES = memoryview(b"")


class PeerLink(asyncio.BufferedProtocol):
    """One authenticated TCP link to a neighbour; every callback goes to the engine."""

    def __init__(self, engine: Engine, peer: int) -> None:
        self.engine = engine
        self.faults = engine.faults
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.fd = -1  # the socket's descriptor (a caller driving its call reads it)
        self.write_blocked = False
        self.current = True  # False once a newer connection to the same peer replaced it
        self.landing = _NO_BYTES  # where the last read went (failure injection only)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        # report "buffer non-empty" / "drained" exactly, so a call completes only once every
        # byte it handed to this transport has been copied into the kernel
        self.transport.set_write_buffer_limits(high=0, low=0)

    def write_copied(self, buffers: list[bytes | memoryview]) -> None:
        """Write ``buffers`` so that their owner may change them as soon as this returns
        (a ``volatile`` send): the kernel takes what it can at once, and the transport gets
        a copy of the rest (left to itself, it would keep referring to the buffers)."""
        transport = self.transport
        assert transport is not None
        taken = 0
        if self.fd >= 0 and not transport.get_write_buffer_size():
            try:
                taken = os.writev(self.fd, buffers)
            except OSError:
                # would block; or broken, which the transport finds out with the rest too,
                # and hangs the link up as for any other write
                taken = 0
        rest: list[bytes | memoryview] = []
        for buf in buffers:
            if taken >= len(buf):
                taken -= len(buf)
            else:
                rest.append(memoryview(buf)[taken:])
                taken = 0
        if rest:
            transport.write(b"".join(rest))  # (one copy; a full kernel buffer is the rare case)

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


class LinkKeeper:
    """What the engine does when a link goes down and how it comes back: hang-ups, the
    tracker's notices about a neighbour, redials, the partition check."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._unsent: dict[int, int] = {}  # per link: bytes queued at the last tick
        self.redials: set[asyncio.Task[None]] = set()
        self._redialing: dict[int, asyncio.Task[None]] = {}  # rank -> its dialer
        self.partition_checks: dict[int, asyncio.TimerHandle] = {}

    def _incarnation_of(self, peer: int) -> int:
        incarnation = self.engine.agent.link_incarnation(peer)
        assert incarnation is not None, f"rank {peer} is not a neighbour"
        return incarnation

    def on_hangup(self, peer: int, reason: str) -> None:
        agent = self.engine.agent
        if agent.ended or self.engine.closing:
            # (every rank finished: links close as the job ends)
            logger.debug("link to rank %d closed as the job ends: %s", peer, reason)
        elif self.engine.config.recover and agent.link_down_reason(peer) is None:
            logger.info("link to rank %d down: %s", peer, reason)
        self.engine.execute(self.engine.agent.on_hangup(peer, reason, self.engine.loop.time()))
        assignment = self.engine.assignment
        if (self.engine.config.recover and assignment is not None and peer < assignment.rank
                and self.engine.agent.error is None
                and (not self.engine.agent.ended or self.engine.holding)):
            # the higher rank of a broken link dials again: the same process if it lives
            # (a reset), or its replacement once the tracker says where (peer_recovered).
            # So does a rank that holds in finalize: its neighbour may still be in a call
            # that needs it (a dial to a neighbour that left after its bye fails until this
            # rank's own bye ends the hold, and with it the dialing).
            self.schedule_redial(peer, self._incarnation_of(peer), assignment.peers[peer])
        if self.engine.config.recover and peer not in self.partition_checks:
            self.partition_checks[peer] = self.engine.loop.call_later(
                self._partition_sec, self._check_partition, peer, self._incarnation_of(peer),
                self.engine.loop.time())

    @property
    def _partition_sec(self) -> float:
        return max(PARTITION_MIN_SEC, PARTITION_SHARE * self.engine.config.link_timeout_sec)

    def _check_partition(self, peer: int, incarnation: int, since: float) -> None:
        """The link to ``peer`` went down :attr:`_partition_sec` ago: still down, and no
        replacement connected?  Tell the tracker, which ends the job if ``peer`` is alive
        (both reach it but not each other: a partition), and leaves it to recovery if not
        (a dead or paused peer).  Asked again as often while it lasts."""
        self.partition_checks.pop(peer, None)
        agent = self.engine.agent
        if (agent.link_is_up(peer) or agent.link_incarnation(peer) != incarnation
                or self.engine.closing or self.engine.tracker is None or agent.error is not None
                or agent.ended):
            return
        down = self.engine.loop.time() - since
        logger.warning("the link to rank %d has been down for %.0f s: asking the tracker "
                       "whether rank %d is alive", peer, down, peer)
        self.engine.tracker.report_unreachable(
            peer, f"rank {self.engine.agent.rank}'s link to rank {peer} has been down for "
                  f"{down:.0f} s ({agent.link_down_reason(peer) or 'lost'})")
        self.partition_checks[peer] = self.engine.loop.call_later(
            self._partition_sec, self._check_partition, peer, incarnation, since)

    def on_peer_lost(self, rank: int, incarnation: int, reason: str) -> None:
        """The tracker saw a neighbour die or go silent (a paused process keeps its TCP
        links open, so only the tracker's heartbeat deadline can tell): treat it as that
        link's hang-up, so a call that needs it fails (or, with recovery on, waits for the
        replacement) now instead of at the progress deadline."""
        known = self.engine.agent.link_incarnation(rank)
        if known is None or incarnation < known:
            return  # about an incarnation that was already replaced
        logger.info("the tracker lost rank %d: %s%s", rank, reason,
                    "; waiting for its replacement" if self.engine.config.recover else "")
        link = self.engine.links.get(rank)
        if link is not None and link.write_blocked and link.transport is not None:
            # bytes queued for a peer that will never read them: drop the link, so that a
            # finished call stops waiting for them (connection_lost clears the flag)
            link.transport.abort()
        self.on_hangup(rank, f"the tracker lost rank {rank}: {reason}")
        self.engine.execute(self.engine.agent.on_peer_dead(rank, self.engine.loop.time()))

    def on_peer_recovered(self, rank: int, incarnation: int, address: tuple[str, int]) -> None:
        """A lost neighbour was restarted: the higher rank of a link dials, as at init."""
        if not self.engine.config.recover:
            return
        logger.info("rank %d is back (incarnation %d, at %s:%d)", rank, incarnation, *address)
        self.engine.recovered_at[rank] = address  # (the dial at init may be trying the old one)
        self.engine.issued[rank] = max(self.engine.issued.get(rank, -1), incarnation)
        assignment = self.engine.assignment
        if assignment is None or self.engine.agent.link_incarnation(rank) is None:
            return
        # where it listens now: a later reset of that link is dialed there, not at the
        # address of the process that died
        assignment.peers[rank] = address
        if rank < assignment.rank and not self.engine.agent.bootstrapping:
            # (during init, the dial at init tries the new address itself)
            self.schedule_redial(rank, incarnation, address)

    def schedule_redial(self, rank: int, incarnation: int, address: tuple[str, int]) -> None:
        if self.engine.closing:
            return  # (closing the links hangs them up: no new task may outlive the loop)
        running = self._redialing.get(rank)
        if running is not None and not running.done():
            # one dialer per link: it dials where the tracker last said the peer listens,
            # until the link is up (a second one would make the peer take its connection
            # as a re-dial and reset the first)
            return
        task = self.engine.loop.create_task(self._redial(rank, incarnation, address))
        self.redials.add(task)
        self._redialing[rank] = task
        task.add_done_callback(self.redials.discard)

    async def _redial(self, rank: int, incarnation: int, address: tuple[str, int]) -> None:
        deadline = self.engine.loop.time() + self.engine.config.recover_timeout_sec
        delay = 0.05
        while (self._incarnation_of(rank) < incarnation
               or not self.engine.agent.link_is_up(rank)):
            try:
                # where a replacement listens once peer_recovered said so (the peer may have
                # died again after this redial began, e.g. while this worker was in init)
                where = self.engine.recovered_at.get(rank, address)
                await self.engine.connections.dial(rank, *where)
                return
            except RabitError as exc:
                engine = self.engine
                if engine.closing:
                    # (closing cancelled us; 3.11 can lose that): a neighbour that left
                    # first at the end of the job, nothing to report
                    logger.debug("not reconnecting to rank %d: closing (%s)", rank, exc)
                    return
                if engine.loop.time() + delay > deadline or engine.agent.error is not None:
                    logger.warning("cannot reconnect to rank %d: %s", rank, exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def sending_progressed(self) -> bool:
        """Did some link's queue of unsent bytes shrink since the last tick (the kernel took
        bytes from it)?  Progress deadlines count those bytes, not only received ones."""
        progressed = False
        for peer, link in self.engine.links.items():
            transport = link.transport
            size = (0 if transport is None or transport.is_closing()
                    else transport.get_write_buffer_size())
            if size < self._unsent.get(peer, 0):
                progressed = True
            self._unsent[peer] = size
        return progressed
