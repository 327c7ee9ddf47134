"""Express calls of world size 3 and more on the caller's thread (``docs/design.md``,
"Express calls", "Trees"): tree allreduces and broadcasts.

The caller holds the parked loop (:mod:`rabit2.io.driving`).  For a call the agent may make
express (:meth:`rabit2.core.express_tree.ExpressTrees.prepare`, or
:meth:`rabit2.core.express_tree_broadcast.ExpressTreeBroadcasts.prepare`), this thread reads
its neighbours' streams (:class:`rabit2.core.express_tree.InStream`: however they were cut,
never a byte of a later call) and writes its own frames, in the general path's order, then
lets the agent apply the call (``done``).  Anything else, and the call is begun on the agent
the general way with what was read handed over and what was written skipped
(:class:`~rabit2.io.express_wire.Written`) or counted as sent
(:class:`~rabit2.io.express_wire.Ahead`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from rabit2.core.express_tree import ExpressTree, InStream, Reader
from rabit2.core.express_tree_broadcast import ExpressTreeBroadcast
from rabit2.core.framing import HEADER_SIZE
from rabit2.core.records import Call
from rabit2.io.express_wire import Ahead, Written, feed, write
from rabit2.io.waiting import yield_cpu

if TYPE_CHECKING:
    from rabit2.io.express import ExpressIO
    from rabit2.io.waiting import Waiter


class TreeExpressIO:
    """Express calls of world size 3 and more, for one :class:`~rabit2.io.express.ExpressIO`
    (its counters, its checks that the links are idle)."""

    def __init__(self, xio: ExpressIO) -> None:
        self.xio = xio

    def allreduce(self, call: Call, waiter: Waiter) -> bool:
        """An express tree allreduce (:mod:`rabit2.core.express_tree`): read the children's
        streams, reduce, write up, read the parent's stream, write down."""
        engine = self.xio.driver.engine
        trees = engine.agent.express.trees
        xt = trees.prepare(call)
        fds = None if xt is None else self._claim(xt.ins, xt.held)
        if xt is None or fds is None:
            return False
        ahead = Ahead()
        if not self._take_held(xt.held, lambda peer: trees.take_held(xt, peer)):
            return self._tree_general(xt, call, waiter, ahead)
        whole = HEADER_SIZE + xt.nbytes  # one frame each way on every link
        if xt.children and not self._read_streams(xt, fds, xt.children):
            return self._tree_general(xt, call, waiter, ahead)
        trees.reduce(xt)
        down = None
        if xt.parent >= 0:
            frame = xt.frame(xt.parent, xt.up)
            sent = write(fds[xt.parent], frame)
            ahead.wrote(xt.parent, sent, frame)
            yield_cpu()  # (a parent that shares this CPU reads it now: nothing to do but wait)
            if sent < whole or not self._read_streams(xt, fds, (xt.parent,), False):
                return self._tree_general(xt, call, waiter, ahead)
            # (the children wait for it: forwarded as it came, before anything else)
            down = trees.down(xt) if xt.children else None
            if down is None:
                trees.take_result(xt)
        if down is None:
            assert xt.result is not None
            down = (xt.result, None)
        for child in xt.children:
            frame = xt.frame(child, *down)
            sent = write(fds[child], frame)
            ahead.wrote(child, sent, frame)
            if sent < whole:
                return self._tree_general(xt, call, waiter, ahead)
        if xt.children:
            yield_cpu()  # (a child that shares this CPU goes on now: what is left can wait)
        if xt.result is None:
            trees.take_result(xt)
        trees.done(xt, engine.loop.time())
        self.xio.finished(waiter)
        return True

    def _claim(self, peers: Iterable[int], held: Sequence[int]) -> dict[int, int] | None:
        """Each of ``peers``' socket if every link is idle (:meth:`ExpressIO.idle_fds`), the
        call then armed with no failure injection (as ``begin_call`` arms a call without
        one); None if the call cannot be made express."""
        fds = self.xio.idle_fds(peers, held)
        if fds is not None:
            self.xio.driver.engine.faults.arm(-1, -1, False)
        return fds

    def broadcast(self, call: Call, waiter: Waiter) -> bool:
        """An express broadcast of world size 3 or more
        (:mod:`rabit2.core.express_tree_broadcast`)."""
        engine = self.xio.driver.engine
        broadcasts = engine.agent.express.tree_broadcasts
        xb = broadcasts.prepare(call)
        fds = None if xb is None else self._claim(xb.checked, xb.held)
        if xb is None or fds is None:
            return False
        written: list[Written] = []
        if not self._take_held(xb.held, lambda peer: broadcasts.take_held(xb, peer)):
            return self._broadcast_general(xb, call, waiter, written)
        if xb.is_root:
            for child in xb.out_links:
                parts = xb.parts[child]
                sent = write(fds[child], parts)
                written.append(Written(child, max(sent, 0), parts))
                if sent < sum(len(part) for part in parts):
                    return self._broadcast_general(xb, call, waiter, written)
            yield_cpu()  # (a child that shares this CPU reads it now)
            if not self._read_all(xb.announces, fds):
                return self._broadcast_general(xb, call, waiter, written)
        else:
            sent = write(fds[xb.in_link], [xb.announce])
            written.append(Written(xb.in_link, max(sent, 0), [xb.announce]))
            assert xb.first is not None
            # (the children's announces come meanwhile: read as they come)
            if (sent < HEADER_SIZE or not self._read_all([xb.first, *xb.announces], fds, False,
                                                         xb.first)
                    or not broadcasts.size(xb)):
                return self._broadcast_general(xb, call, waiter, written)
            assert xb.stream is not None
            if (not self._read_all([xb.stream, *xb.announces], fds)
                    or not broadcasts.receive(xb)):
                return self._broadcast_general(xb, call, waiter, written)
            # from here the call is this rank's to finish: what the kernel does not take now
            # is queued, a copy, for the loop to send
            for child in xb.out_links:
                parts = xb.parts[child]
                sent = write(fds[child], parts)
                link = engine.links.get(child)
                if 0 <= sent < sum(len(part) for part in parts) and link is not None:
                    transport = link.transport
                    if transport is not None and not transport.is_closing():
                        transport.write(b"".join(bytes(part) for part in parts)[sent:])
            if xb.out_links:
                yield_cpu()
        broadcasts.done(xb, engine.loop.time())
        self.xio.finished(waiter)
        return True

    def _broadcast_general(self, xb: ExpressTreeBroadcast, call: Call, waiter: Waiter,
                           written: list[Written]) -> bool:
        """Begin ``call`` on the agent after an express start of a broadcast: skip what was
        written, hand over what was read (the stream first, then the announces)."""
        self.xio.fallbacks += 1
        engine = self.xio.driver.engine
        engine.begin_call(call, waiter, written=written)
        read: list[Reader] = []
        if xb.stream is not None:
            read.append(xb.stream)
        elif xb.first is not None:
            read.append(xb.first)
        for reader in (*read, *xb.announces):
            link = engine.links.get(reader.peer)
            if reader.got and link is not None:
                feed(link, reader.inbox[: reader.got])
                if reader is xb.first and xb.held_rest:  # (staged after it, not sized)
                    feed(link, memoryview(xb.held_rest))
        return True

    def _take_held(self, held: Sequence[int], take: Callable[[int], bool]) -> bool:
        """Take the frame each of ``held`` the loop read while this rank computed (``take``:
        from the stage to where the call reads it) and let its link read on; False at one
        that is not what the call expects (the general path gets what was taken)."""
        links = self.xio.driver.engine.links
        for peer in held:
            self.xio.held += 1
            taken = take(peer)
            transport = links[peer].transport
            assert transport is not None
            transport.resume_reading()
            if not taken:
                return False
        return True

    def _read_streams(self, xt: ExpressTree, fds: dict[int, int], peers: Sequence[int],
                      read_first: bool = True) -> bool:
        """Read the streams of ``peers`` whole (True); False when something else comes first
        (a frame that is not the next of this call, the end of a stream, an error, bytes on
        another link or from the tracker) or ``drive_ms`` passed.  ``read_first``: some
        bytes may be in already (else wait before the first read)."""
        return self._read_all([xt.ins[peer] for peer in peers], fds, read_first)

    def _read_all(self, readers: Sequence[Reader], fds: dict[int, int],
                  read_first: bool = True, until: Reader | None = None) -> bool:
        """Read what each of ``readers`` wants, whole (:meth:`_read_streams`); with
        ``until``, only until that one is complete (the others as they come)."""
        driver = self.xio.driver
        pending = [reader for reader in readers if not reader.complete()]
        if not pending or (until is not None and until.complete()):
            return True
        clock = time.monotonic
        epoll = None
        end = 0.0
        while True:
            if read_first:
                waiting = self._read_some(pending, fds)
                if not waiting or (until is not None and until not in waiting):
                    return waiting is not None
                if len(waiting) < len(pending):
                    pending = waiting
                    continue  # (read on before waiting: most bytes are in already)
            read_first = True
            now = clock()
            if epoll is None:
                epoll = driver.sync()
                if epoll is None:
                    return False
                end = driver.start_wait(now)
            if now >= end:
                return False
            try:
                events = driver.wait(epoll, now, end)
            except InterruptedError:
                events = []
            for fd, _ in events:
                if any(fds[stream.peer] == fd for stream in pending):
                    continue
                if fd not in fds.values():
                    return False  # another link, or the tracker: the general path hears it
                # a later call's frames from a neighbour done with this one: read then
                driver.mute(fd)

    def _read_some(self, pending: Sequence[Reader], fds: dict[int, int]) -> list[Reader] | None:
        """One read of each stream in ``pending``: those still to complete (None: a stream
        met something else, ended or broke)."""
        trees = self.xio.driver.engine.agent.express.trees
        waiting: list[Reader] = []
        for stream in pending:
            want = stream.want()
            if stream.got + want > len(stream.inbox):
                assert isinstance(stream, InStream)
                trees.grow(stream)
            try:
                nbytes = os.readv(fds[stream.peer], [stream.inbox[stream.got : stream.got + want]])
            except BlockingIOError:
                waiting.append(stream)
                continue
            except OSError:
                return None  # (the loop reads the error too, and hangs the link up)
            if nbytes == 0 or not stream.on_read(nbytes):
                return None  # (the end of the stream: the loop hangs the link up)
            if not stream.complete():
                waiting.append(stream)
        return waiting

    def _tree_general(self, xt: ExpressTree, call: Call, waiter: Waiter,
                      ahead: Ahead) -> bool:
        """Begin ``call`` on the agent after an express start: what was written counts as
        sent, what was read is handed over (the children's streams first)."""
        self.xio.fallbacks += 1
        engine = self.xio.driver.engine
        engine.begin_call(call, waiter, ahead=ahead)
        for peer, stream in xt.ins.items():
            link = engine.links.get(peer)
            if stream.got and link is not None:
                feed(link, stream.inbox[: stream.got])
        return True
