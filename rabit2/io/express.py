"""Express calls on the caller's thread (``docs/design.md``, "Express calls"): pair
allreduces and broadcasts at world size 2 (larger worlds: :mod:`rabit2.io.express_tree`).

The caller holds the parked loop (:mod:`rabit2.io.driving`).  For a call the agent may make
express (:meth:`rabit2.core.express.Express.prepare`, or
:meth:`rabit2.core.express_broadcast.ExpressBroadcasts.prepare`), this thread writes the
call's frames straight to the link's socket with one ``writev``, reads the peer's straight
into the inbox (polling, then sleeping in the driver's epoll, exactly as a driven call
waits; a broadcast's receiver reads the root's first header, then the rest it names), and
lets the agent make the call from them (``done``).

Anything else — the kernel took part of the frames, the peer sent something other than its
frames of this call, the link closed or broke, the tracker spoke, ``drive_ms`` passed — and
the call is begun on the agent the general way: the bytes already written are skipped from
what ``begin`` sends (they are the same bytes, checked), and those already read are handed
to the link as if just read.  The driver then goes on with the call, or hands it to the loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rabit2.core.express import MAX_BYTES as PAIR_MAX_BYTES
from rabit2.core.express import ExpressCall
from rabit2.core.express_broadcast import ExpressBroadcast
from rabit2.core.express_tree import MAX_BYTES as TREE_MAX_BYTES
from rabit2.core.framing import HEADER_SIZE, CollectiveKind
from rabit2.core.records import Call
from rabit2.io.express_tree import TreeExpressIO
from rabit2.io.express_wire import Written, feed, write

if TYPE_CHECKING:
    from rabit2.io.driving import Driver
    from rabit2.io.links import PeerLink
    from rabit2.io.waiting import Waiter


class ExpressIO:
    """Express calls, for one driver (those of world size 3 and more:
    :class:`~rabit2.io.express_tree.TreeExpressIO`)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.calls = 0  # made express
        self.fallbacks = 0  # begun express, finished the general way
        self.held = 0  # begun express with the peer's frame read ahead by the loop
        self.trees = TreeExpressIO(self)  # world size 3 and more

    def may_take(self, call: Call) -> bool:
        """Whether ``call`` is of a kind and size made express (whether it is made so
        depends on the agent and its links then: :meth:`run`)."""
        kind = call.kind
        if kind is CollectiveKind.BROADCAST:
            return True
        if kind is CollectiveKind.ALLREDUCE_TREE:
            return 0 < len(call.buf) <= TREE_MAX_BYTES
        return kind is CollectiveKind.ALLREDUCE_PAIR and 0 < len(call.buf) <= PAIR_MAX_BYTES

    def run(self, call: Call, waiter: Waiter) -> bool:
        """Make ``call`` express if it can be; False if nothing was done (the caller begins
        it as usual), True if it finished here (``waiter``) or was begun on the agent."""
        if call.kind is CollectiveKind.BROADCAST:
            if self.driver.engine.agent.world > 2:
                return self.trees.broadcast(call, waiter)
            return self._broadcast(call, waiter)
        if call.kind is CollectiveKind.ALLREDUCE_TREE:
            return self.trees.allreduce(call, waiter)
        driver = self.driver
        engine = driver.engine
        xc = engine.agent.express.prepare(call)
        if xc is None:
            return False
        link = self._idle_link(xc.peer, xc.held)
        if link is None:
            return False
        engine.faults.arm(-1, -1, False)  # (as begin_call does for a call without a fault)
        got = 0
        if xc.held:
            self.held += 1
            got = engine.agent.express.take_held(xc)
            assert link.transport is not None
            link.transport.resume_reading()
        fd = link.fd
        frame = xc.parts()
        sent = write(fd, frame)
        if sent < len(xc.inbox):  # (what this rank sends is as long as what it receives)
            # (a broken socket: the general path meets the error too, and the loop acts on it)
            self._general(xc, call, waiter, Written(xc.peer, max(sent, 0), frame), got)
            return True
        got = self._receive(xc, fd, got, xc.nbytes)
        if got == len(xc.inbox) and engine.agent.express.done(xc, engine.loop.time()):
            self.finished(waiter)
            return True
        self._general(xc, call, waiter, Written(xc.peer, sent, frame), got)
        return True

    def _broadcast(self, call: Call, waiter: Waiter) -> bool:
        """An express broadcast (:mod:`rabit2.core.express_broadcast`): the root writes its
        frames and reads the announce; the receiver writes its announce, reads the root's
        first header, then the rest it lays out."""
        engine = self.driver.engine
        broadcasts = engine.agent.express.broadcasts
        xb = broadcasts.prepare(call)
        if xb is None:
            return False
        link = self._idle_link(xb.peer, False)
        if link is None:
            return False
        engine.faults.arm(-1, -1, False)
        fd = link.fd
        frame = xb.parts
        sent = write(fd, frame)
        if sent < xb.nsent:
            self._general(xb, call, waiter, Written(xb.peer, max(sent, 0), frame), 0)
            return True
        got = self._receive(xb, fd, 0)
        if not xb.is_root and got == HEADER_SIZE and broadcasts.lay_out(xb):
            got = self._receive(xb, fd, got)
        if got == len(xb.inbox) and broadcasts.done(xb, engine.loop.time()):
            self.finished(waiter)
            return True
        self._general(xb, call, waiter, Written(xb.peer, sent, frame), got)
        return True

    def idle_fds(self, peers: Iterable[int], held: Sequence[int] = ()) -> dict[int, int] | None:
        """Each of ``peers``' socket, if every link is idle (:meth:`_idle_link`; paused, for
        those ``held``)."""
        fds: dict[int, int] = {}
        for peer in peers:
            link = self._idle_link(peer, peer in held)
            if link is None:
                return None
            fds[peer] = link.fd
        return fds

    def _idle_link(self, peer: int, held: bool) -> PeerLink | None:
        """``peer``'s link if this thread may write to and read from its socket now: current,
        nothing queued, reading (paused: ``held``, on a frame read ahead)."""
        link = self.driver.engine.links.get(peer)
        transport = None if link is None else link.transport
        if (link is None or transport is None or not link.current or link.fd < 0
                or link.write_blocked or transport.is_closing()
                or transport.get_write_buffer_size() or transport.is_reading() == held):
            return None
        return link

    def keep_ready(self, nbytes: int) -> None:
        """The call under way will keep a result of ``nbytes``: make that memory now, while
        this rank waits for its peers (nothing without recovery)."""
        agent = self.driver.engine.agent
        if agent.recovery is not None:
            agent.recovery.keep_ready(nbytes, (agent.version, agent.seqno))

    def finished(self, waiter: Waiter) -> None:
        """An express call was made: count it, and wake its caller."""
        self.calls += 1
        self.driver.engine.call_done()
        waiter.finish(None)

    def _receive(self, xc: ExpressCall | ExpressBroadcast, fd: int, got: int,
                 result: int = 0) -> int:
        """Read the peer's frames into the inbox, after the ``got`` bytes there; how many
        bytes it holds then, fewer than the frames' when something else came first (another
        frame's header, the end of the stream, an error, the tracker) or ``drive_ms``
        passed.  If the peer's bytes are not all in yet, the memory a ``result`` of that
        many bytes will be kept in is made first (:meth:`Recovery.keep_ready`)."""
        driver = self.driver
        inbox = xc.inbox
        want = len(inbox)
        if got and (not xc.check_headers(got) or got == want):
            return got  # (a held frame, whole or not the one expected)
        clock = time.monotonic
        epoll = None
        end = 0.0
        while True:
            try:
                nbytes = os.readv(fd, [inbox[got:]])
            except BlockingIOError:
                nbytes = -1
            except OSError:
                return got  # (the loop reads the error too, and hangs the link up)
            if nbytes == 0:
                return got  # the end of the stream: the loop hangs the link up
            if nbytes > 0:
                got += nbytes
                if not xc.check_headers(got):
                    return got
                if got == want:
                    return got
                continue
            if epoll is None and result:
                self.keep_ready(result)
                result = 0
                continue  # (read again: bytes may have come meanwhile)
            now = clock()
            if epoll is None:  # (the first wait: most frames are in already)
                epoll = driver.sync()
                if epoll is None:
                    return got
                end = driver.start_wait(now)
            if now >= end:
                return got
            try:
                events = driver.wait(epoll, now, end)
            except InterruptedError:
                events = []
            for ready, _ in events:
                if ready != fd:
                    return got  # the tracker spoke: the loop hears it

    def _general(self, xc: ExpressCall | ExpressBroadcast, call: Call, waiter: Waiter,
                 written: Written, got: int) -> None:
        """Begin ``call`` on the agent after an express start: skip what was written, hand
        over what was read."""
        self.fallbacks += 1
        engine = self.driver.engine
        engine.begin_call(call, waiter, written=written)
        link = engine.links.get(xc.peer)
        if got and link is not None:
            feed(link, xc.inbox[:got])
