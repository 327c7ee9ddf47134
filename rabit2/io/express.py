"""Express calls on the caller's thread (``docs/design.md``, "Express calls"): pair
allreduces and broadcasts at world size 2.

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
from rabit2.core.express_tree import ExpressTree, InStream, Reader
from rabit2.core.express_tree_broadcast import ExpressTreeBroadcast
from rabit2.core.framing import HEADER_SIZE, CollectiveKind
from rabit2.core.records import Call, Command, Send
from rabit2.errors import ProtocolError
from rabit2.io.waiting import yield_cpu

if TYPE_CHECKING:
    from rabit2.io.driving import Driver
    from rabit2.io.links import PeerLink
    from rabit2.io.waiting import Waiter


class Written:
    """What an express call wrote to ``peer`` before it took the general path: the first
    ``count`` bytes of ``frame``."""

    __slots__ = ("count", "frame", "peer")

    def __init__(self, peer: int, count: int, frame: Sequence[bytes | memoryview]) -> None:
        self.peer, self.count, self.frame = peer, count, frame

    def skip(self, cmds: list[Command]) -> list[Command]:
        """``cmds`` (from ``Agent.begin``) without the bytes already written; raises
        :class:`ProtocolError` if they are not the bytes ``begin`` sends first (never
        expected: sending anything else would corrupt the peer's stream)."""
        left = self.count
        dropped: list[bytes] = []
        out: list[Command] = []
        for cmd in cmds:
            if left and isinstance(cmd, Send) and cmd.peer == self.peer:
                rest: list[bytes | memoryview] = []
                for buf in cmd.buffers:
                    size = len(buf)
                    if left >= size:
                        dropped.append(bytes(buf))
                        left -= size
                    elif left:
                        view = memoryview(buf)
                        dropped.append(bytes(view[:left]))
                        rest.append(view[left:])
                        left = 0
                    else:
                        rest.append(buf)
                if rest:
                    out.append(Send(cmd.peer, rest, cmd.volatile))
                continue
            out.append(cmd)
        expected = b"".join(bytes(part) for part in self.frame)[: self.count]
        if left or b"".join(dropped) != expected:
            raise ProtocolError("the general path would not send the frame an express call "
                                "wrote: the peer's stream cannot be kept whole")
        return out


class Ahead:
    """What an express tree call (:mod:`rabit2.core.express_tree`) wrote before it took the
    general path: its one frame of the whole out-stream to each of ``peers``, which counts
    as sent (``Agent.begin``); ``rest``, per peer, the tail of a frame the kernel took only
    part of, queued on the link before anything else."""

    __slots__ = ("peers", "rest")

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.rest: dict[int, bytes] = {}

    def wrote(self, peer: int, count: int, frame: Sequence[bytes | memoryview]) -> None:
        """The kernel took ``count`` bytes of ``frame`` for ``peer`` (-1: the socket broke)."""
        if count <= 0:
            return
        self.peers.append(peer)
        if count < sum(len(part) for part in frame):
            # (a copy: the express call's buffers serve the next call)
            self.rest[peer] = b"".join(bytes(part) for part in frame)[count:]

    def queue(self, links: dict[int, PeerLink]) -> None:
        for peer, rest in self.rest.items():
            link = links.get(peer)
            transport = None if link is None else link.transport
            if transport is not None and not transport.is_closing():
                transport.write(rest)


class ExpressIO:
    """Express pair calls, for one driver."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.calls = 0  # made express
        self.fallbacks = 0  # begun express, finished the general way
        self.held = 0  # begun express with the peer's frame read ahead by the loop

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
                return self._tree_broadcast(call, waiter)
            return self._broadcast(call, waiter)
        if call.kind is CollectiveKind.ALLREDUCE_TREE:
            return self._tree(call, waiter)
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
        sent = _write(fd, frame)
        if sent < len(xc.inbox):  # (what this rank sends is as long as what it receives)
            # (a broken socket: the general path meets the error too, and the loop acts on it)
            self._general(xc, call, waiter, Written(xc.peer, max(sent, 0), frame), got)
            return True
        got = self._receive(xc, fd, got)
        if got == len(xc.inbox) and engine.agent.express.done(xc, engine.loop.time()):
            self._finished(waiter)
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
        sent = _write(fd, frame)
        if sent < xb.nsent:
            self._general(xb, call, waiter, Written(xb.peer, max(sent, 0), frame), 0)
            return True
        got = self._receive(xb, fd, 0)
        if not xb.is_root and got == HEADER_SIZE and broadcasts.lay_out(xb):
            got = self._receive(xb, fd, got)
        if got == len(xb.inbox) and broadcasts.done(xb, engine.loop.time()):
            self._finished(waiter)
            return True
        self._general(xb, call, waiter, Written(xb.peer, sent, frame), got)
        return True

    def _tree(self, call: Call, waiter: Waiter) -> bool:
        """An express tree allreduce (:mod:`rabit2.core.express_tree`): read the children's
        streams, reduce, write up, read the parent's stream, write down."""
        engine = self.driver.engine
        trees = engine.agent.express.trees
        xt = trees.prepare(call)
        fds = None if xt is None else self._idle_fds(xt.ins, xt.held)
        if xt is None or fds is None:
            return False
        engine.faults.arm(-1, -1, False)
        ahead = Ahead()
        for peer in xt.held:
            # the loop read its first frame while this rank computed: from the stage
            self.held += 1
            taken = trees.take_held(xt, peer)
            transport = engine.links[peer].transport
            assert transport is not None
            transport.resume_reading()
            if not taken:
                return self._tree_general(xt, call, waiter, ahead)
        whole = HEADER_SIZE + xt.nbytes  # one frame each way on every link
        if xt.children and not self._read_streams(xt, fds, xt.children):
            return self._tree_general(xt, call, waiter, ahead)
        trees.reduce(xt)
        down = None
        if xt.parent >= 0:
            frame = xt.frame(xt.parent, xt.up)
            sent = _write(fds[xt.parent], frame)
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
            sent = _write(fds[child], frame)
            ahead.wrote(child, sent, frame)
            if sent < whole:
                return self._tree_general(xt, call, waiter, ahead)
        if xt.children:
            yield_cpu()  # (a child that shares this CPU goes on now: what is left can wait)
        if xt.result is None:
            trees.take_result(xt)
        trees.done(xt, engine.loop.time())
        self._finished(waiter)
        return True

    def _tree_broadcast(self, call: Call, waiter: Waiter) -> bool:
        """An express broadcast of world size 3 or more
        (:mod:`rabit2.core.express_tree_broadcast`)."""
        engine = self.driver.engine
        broadcasts = engine.agent.express.tree_broadcasts
        xb = broadcasts.prepare(call)
        fds = None if xb is None else self._idle_fds(xb.checked, xb.held)
        if xb is None or fds is None:
            return False
        engine.faults.arm(-1, -1, False)
        written: list[Written] = []
        for peer in xb.held:
            # the loop read its frame while this rank computed: from the stage
            self.held += 1
            taken = broadcasts.take_held(xb, peer)
            transport = engine.links[peer].transport
            assert transport is not None
            transport.resume_reading()
            if not taken:
                return self._broadcast_general(xb, call, waiter, written)
        if xb.is_root:
            for child in xb.out_links:
                parts = xb.parts[child]
                sent = _write(fds[child], parts)
                written.append(Written(child, max(sent, 0), parts))
                if sent < sum(len(part) for part in parts):
                    return self._broadcast_general(xb, call, waiter, written)
            yield_cpu()  # (a child that shares this CPU reads it now)
            if not self._read_all(xb.announces, fds):
                return self._broadcast_general(xb, call, waiter, written)
        else:
            sent = _write(fds[xb.in_link], [xb.announce])
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
                sent = _write(fds[child], parts)
                link = engine.links.get(child)
                if 0 <= sent < sum(len(part) for part in parts) and link is not None:
                    transport = link.transport
                    if transport is not None and not transport.is_closing():
                        transport.write(b"".join(bytes(part) for part in parts)[sent:])
            if xb.out_links:
                yield_cpu()
        broadcasts.done(xb, engine.loop.time())
        self._finished(waiter)
        return True

    def _broadcast_general(self, xb: ExpressTreeBroadcast, call: Call, waiter: Waiter,
                           written: list[Written]) -> bool:
        """Begin ``call`` on the agent after an express start of a broadcast: skip what was
        written, hand over what was read (the stream first, then the announces)."""
        self.fallbacks += 1
        engine = self.driver.engine
        engine.begin_call(call, waiter, written=written)
        read: list[Reader] = []
        if xb.stream is not None:
            read.append(xb.stream)
        elif xb.first is not None:
            read.append(xb.first)
        for reader in (*read, *xb.announces):
            link = engine.links.get(reader.peer)
            if reader.got and link is not None:
                _feed(link, reader.inbox[: reader.got])
                if reader is xb.first and xb.held_rest:  # (staged after it, not sized)
                    _feed(link, memoryview(xb.held_rest))
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
        driver = self.driver
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
        trees = self.driver.engine.agent.express.trees
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
        self.fallbacks += 1
        engine = self.driver.engine
        engine.begin_call(call, waiter, ahead=ahead)
        for peer, stream in xt.ins.items():
            link = engine.links.get(peer)
            if stream.got and link is not None:
                _feed(link, stream.inbox[: stream.got])
        return True

    def _idle_fds(self, peers: Iterable[int], held: Sequence[int] = ()) -> dict[int, int] | None:
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

    def _finished(self, waiter: Waiter) -> None:
        self.calls += 1
        self.driver.engine.call_done()
        waiter.finish(None)

    def _receive(self, xc: ExpressCall | ExpressBroadcast, fd: int, got: int) -> int:
        """Read the peer's frames into the inbox, after the ``got`` bytes there; how many
        bytes it holds then, fewer than the frames' when something else came first (another
        frame's header, the end of the stream, an error, the tracker) or ``drive_ms``
        passed."""
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
            _feed(link, xc.inbox[:got])


def _write(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """What the kernel took of ``parts`` (-1: the socket is broken)."""
    try:
        return os.writev(fd, parts)
    except BlockingIOError:
        return 0
    except OSError:
        return -1


def _feed(link: PeerLink, data: memoryview) -> None:
    """Hand ``data``, read from ``link``'s socket, to the link as if just read into the
    buffers its agent names.  (It all fits before any pause: what an express call reads is
    at most as long as the peer's frames of this call, and the link is paused only on a frame
    of a later call, which cannot follow all of them within that length.)"""
    at, size = 0, len(data)
    while at < size:
        transport = link.transport
        if not link.current or transport is None or transport.is_closing():
            return  # the link is being dropped: what it read goes with it
        assert transport.is_reading(), "bytes left after a pause"
        view = link.get_buffer(-1)
        nbytes = min(len(view), size - at)
        view[:nbytes] = data[at : at + nbytes]
        link.buffer_updated(nbytes)
        at += nbytes
