"""Express tree allreduces: a tree allreduce of world size 3 or more made in one pass on the
caller's thread when nothing else is going on (``docs/design.md``, "Express calls").

In the general path a tree allreduce is a plan advanced by every byte that arrives: each
child's stream lands in a scratch, the reduced prefix goes up, the parent's result comes
down and is forwarded.  For a small call, the Python of that machinery costs several times
the exchange, and with more workers than cores every microsecond of it is the others'
wait.  Here the agent only says whether the call may be made express
(:meth:`ExpressTrees.prepare`) and the I/O layer does the rest in order: read each child's
stream whole (:class:`InStream`), reduce (:meth:`ExpressTrees.reduce`), write one frame up,
read the parent's stream whole, write one frame to each child; then
:meth:`ExpressTrees.done` applies the call to the agent's records in one step, as the
general path leaves them.

The peers' frames are read exactly: a header, then at most what the frames already seen
say is still to come, so that nothing of a later call is ever read.  Anything else, and
the call is begun the general way: what was read is handed to the links as if just read,
and what was written counts as sent (:class:`Ahead`: the general path does not make those
frames again; the tail of a frame the kernel took only part of is queued first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from rabit2.core.express_inbox import header_at, unhold
from rabit2.core.framing import (
    CHECKED_FRAME,
    HEADER_SIZE,
    CallDescriptor,
    CollectiveKind,
    FrameKind,
    checksum,
    data_prefix,
    pack_header,
)
from rabit2.core.fsm import Event, Mode, Phase, State
from rabit2.core.ops import Op, apply, ufunc_of
from rabit2.core.records import Call
from rabit2.core.topology import topology

if TYPE_CHECKING:
    from rabit2.core.express import Owner

MAX_BYTES = CHECKED_FRAME
"""The largest tree allreduce made express: one frame each way on every link (the tree
takes calls up to 512 KiB by default, ``AUTO_RING_MIN_BYTES``)."""


class Reader(Protocol):
    """What the I/O layer reads into: ``want`` more bytes at ``inbox[got:]``, then
    ``on_read`` (False: not what was expected), until ``complete``."""

    peer: int
    got: int
    inbox: memoryview

    def want(self) -> int: ...
    def on_read(self, nbytes: int) -> bool: ...
    def complete(self) -> bool: ...


class InStream:
    """One peer's stream of a call as it comes off the wire: its frames, headers and payloads
    back to back in ``inbox``, however the peer cut them.  Reused call after call
    (:meth:`reset`)."""

    __slots__ = ("checked", "crcs", "frames", "got", "inbox", "landing", "landing_of", "nbytes",
                 "next_at", "peer", "prefix", "upto", "verified")

    def __init__(self, peer: int, nbytes: int, checked: bool, inbox: memoryview) -> None:
        self.peer, self.nbytes, self.checked = peer, nbytes, checked
        self.inbox = inbox  # grown (by the owner) when a frame shorter than the rest comes
        self.landing: np.ndarray | None = None  # a one-frame stream's payload, as the dtype
        self.landing_of: memoryview | None = None  # the inbox it is a view of
        self.prefix = b""
        self.got = 0  # wire bytes read
        self.next_at = 0  # where the next header starts in the inbox
        self.upto = 0  # stream bytes the headers seen so far cover
        self.frames: list[tuple[int, int, int]] = []  # (where in the inbox, offset, length)
        self.crcs: list[int] = []  # each frame's payload CRC32C
        self.verified = 0  # frames whose payload CRC held (a checked link)

    def reset(self, prefix: bytes) -> None:
        """A new call, whose DATA frames start with ``prefix``."""
        self.prefix = prefix
        self.got = self.next_at = self.upto = self.verified = 0
        if self.frames:
            self.frames.clear()
            self.crcs.clear()

    def want(self) -> int:
        """How many more wire bytes this stream has at least: never more than is still to
        come of it."""
        if self.upto == self.nbytes:
            return self.next_at - self.got
        return self.next_at + HEADER_SIZE + self.nbytes - self.upto - self.got

    def complete(self) -> bool:
        return self.upto == self.nbytes and self.got == self.next_at

    def on_read(self, nbytes: int) -> bool:
        """``nbytes`` more wire bytes are in: check each header now whole; False at the first
        that is not a DATA frame of this call going on where the last one stopped (the
        general path must read it), or at a payload that fails its checksum."""
        self.got += nbytes
        while self.upto < self.nbytes and self.next_at + HEADER_SIZE <= self.got:
            at = self.next_at
            tail = header_at(self.inbox, at, self.prefix)
            if tail is None:
                return False
            offset, length, crc = tail
            if offset != self.upto or not 0 < length <= self.nbytes - offset:
                return False
            self.frames.append((at, offset, length))
            self.crcs.append(crc)
            self.upto += length
            self.next_at = at + HEADER_SIZE + length
        return not self.checked or self._check_payloads()

    def _check_payloads(self) -> bool:
        """The CRCs of the payloads now whole (a checked link); each checked once."""
        frames = self.frames
        while self.verified < len(frames):
            at, _, length = frames[self.verified]
            if at + HEADER_SIZE + length > self.got:
                break
            payload = self.inbox[at + HEADER_SIZE : at + HEADER_SIZE + length]
            if checksum(payload) != self.crcs[self.verified]:
                return False
            self.verified += 1
        return True

    def payloads(self) -> list[tuple[int, memoryview]]:
        """``(offset, payload)`` of each frame (the stream complete)."""
        return [(offset, self.inbox[at + HEADER_SIZE : at + HEADER_SIZE + length])
                for at, offset, length in self.frames]

    def whole(self, dtype: np.dtype) -> np.ndarray | None:
        """The payload as ``dtype`` elements when the stream came as one frame."""
        if len(self.frames) != 1:
            return None
        landing = self.landing
        if landing is None or self.landing_of is not self.inbox or landing.dtype != dtype:
            landing = self.landing = np.frombuffer(self.inbox, dtype,
                                                   self.nbytes // dtype.itemsize, HEADER_SIZE)
            self.landing_of = self.inbox
        return landing


def all_quiet(agent: Owner, held: list[int] | None = None, most: int = 0) -> bool:
    """Every link of ``agent`` plainly up with nothing read ahead or staged, and recovery with
    nothing under way that a call's beginning acts on: a call of every link may be express.
    With ``held``, a link may also be paused on a frame the loop read ahead, with at most
    ``most`` bytes staged from its header on (its peer is appended to ``held``)."""
    for peer, link in agent.links.items():
        if link.phase is not Phase.UP or link.pending_needs:
            return False
        if link.mode is Mode.HELD and held is not None:
            if link.start < HEADER_SIZE or link.end - link.start + HEADER_SIZE > most:
                return False
            held.append(peer)
        elif link.mode is not Mode.HEADER or link.end:
            return False
    recovery = agent.recovery
    return recovery is None or recovery.quiet()


class ExpressTree:
    """A tree allreduce of one shape (element type, operator, size) made express on this
    rank; reused for every call of that shape (:meth:`ExpressTrees.prepare`)."""

    __slots__ = ("call", "call_id", "children", "desc", "dtype", "held", "ins", "keep",
                 "nbytes", "parent", "result", "ufunc", "up")

    def __init__(self, call: Call, parent: int, children: tuple[int, ...]) -> None:
        self.call = call
        self.call_id = (0, 0)
        self.desc: CallDescriptor | None = None
        self.nbytes = len(call.buf)
        assert call.dtype is not None and call.op is not None
        self.dtype, self.ufunc = call.dtype, ufunc_of(call.op)
        self.parent, self.children = parent, children
        self.ins: dict[int, InStream] = {}  # per peer, what it sends this rank
        self.held: list[int] = []  # peers whose first frame the loop read ahead
        self.up: memoryview = call.buf  # what goes to the parent (a leaf's own input)
        self.keep: np.ndarray | None = None  # the store's buffer the result is made in
        self.result: memoryview | None = None  # the result, once made or read

    def frame(self, peer: int, data: memoryview, crc: int | None = None
              ) -> list[bytes | memoryview]:
        """The one DATA frame of this call to ``peer`` carrying ``data`` (as
        ``Sender.pump`` makes it; ``crc``: the CRC32C of ``data``, if known)."""
        version, seqno = self.call_id
        if not self.ins[peer].checked:
            crc = None
        elif crc is None:
            crc = checksum(data)
        assert self.desc is not None
        return [pack_header(FrameKind.DATA, self.desc, version, seqno, 0, self.nbytes, 0, crc),
                data]


class ExpressTrees:
    """Express tree allreduces, for one agent."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent
        self._inboxes: dict[int, memoryview] = {}
        self._up = np.empty(0, dtype=np.uint8)
        self._result = np.empty(0, dtype=np.uint8)
        self._shapes: dict[tuple[np.dtype, Op, int], ExpressTree] = {}
        self._where = (-1, 0)  # (rank, world) the shapes were laid out for

    def prepare(self, call: Call) -> ExpressTree | None:
        """The express call for ``call`` if it may be made express: a tree allreduce of 1 B
        to ``MAX_BYTES``, an agent between calls, every link plainly up with nothing read
        ahead, and recovery with nothing under way that a call's beginning acts on; None
        otherwise (the general path)."""
        agent = self.agent
        if (call.kind is not CollectiveKind.ALLREDUCE_TREE or not 0 < len(call.buf) <= MAX_BYTES
                or agent.world < 2 or agent.state is not State.READY or agent.dead_links):
            return None
        held: list[int] = []
        if not all_quiet(agent, held, HEADER_SIZE + len(call.buf)):
            return None
        links = agent.links
        xt = self._shape(call)
        if xt is None or any(peer not in xt.ins for peer in held):
            return None
        xt.held = held
        xt.call = call
        xt.up = call.buf
        xt.keep = xt.result = None
        version, seqno = xt.call_id = (agent.version, agent.seqno)
        desc = xt.desc
        assert desc is not None
        prefix = checked_prefix = b""
        for peer, stream in xt.ins.items():
            checked = stream.checked = links[peer].checked
            if checked:
                if not checked_prefix:
                    checked_prefix = data_prefix(desc, version, seqno, True)
                stream.reset(checked_prefix)
            else:
                if not prefix:
                    prefix = data_prefix(desc, version, seqno, False)
                stream.reset(prefix)
        return xt

    def _shape(self, call: Call) -> ExpressTree | None:
        """The reusable express call of ``call``'s shape."""
        agent = self.agent
        assert call.dtype is not None and call.op is not None
        where = (agent.rank, agent.world)
        if where != self._where:
            self._shapes.clear()
            self._where = where
        key = (call.dtype, call.op, len(call.buf))
        xt = self._shapes.get(key)
        if xt is None:
            if len(self._shapes) >= 16:
                self._shapes.clear()
            topo = topology(agent.rank, agent.world)
            xt = ExpressTree(call, topo.parent, topo.children)
            xt.desc = agent.planner.descriptor(call)
            peers = topo.children if topo.parent < 0 else (*topo.children, topo.parent)
            for peer in peers:
                neighbour = agent.links.get(peer)
                if neighbour is None:
                    return None
                xt.ins[peer] = InStream(peer, xt.nbytes, neighbour.checked,
                                        self.inbox(peer, HEADER_SIZE + xt.nbytes))
            self._shapes[key] = xt
        for stream in xt.ins.values():
            inbox = self._inboxes[stream.peer]
            if stream.inbox.obj is not inbox.obj:  # (grown for another shape)
                stream.inbox = inbox[: HEADER_SIZE + xt.nbytes]
        return xt

    def grow(self, stream: InStream) -> None:
        """Make room in ``stream``'s inbox for what :meth:`InStream.want` says is still to
        come (a peer that cut its stream into several frames), keeping what it holds."""
        need = stream.got + stream.want()
        if len(stream.inbox) < need:
            inbox = self.inbox(stream.peer, need)
            if inbox.obj is not stream.inbox.obj:
                inbox[: stream.got] = stream.inbox[: stream.got]
            stream.inbox = inbox

    def inbox(self, peer: int, size: int) -> memoryview:
        """The first ``size`` bytes of ``peer``'s inbox (grown if need be, not keeping
        what it held)."""
        inbox = self._inboxes.get(peer)
        if inbox is None or len(inbox) < size:
            inbox = self._inboxes[peer] = memoryview(bytearray(
                max(size, 0 if inbox is None else 2 * len(inbox))))
        return inbox[:size]

    def reduce(self, xt: ExpressTree) -> None:
        """The children's streams are in: make what goes up (the root: the result), as the
        general plan reduces: the children in order, into a copy of the input."""
        nbytes = xt.nbytes
        keep = None
        if xt.parent < 0:
            recovery = self.agent.recovery
            keep = xt.keep = (None if recovery is None else
                              recovery.express_keep(nbytes, xt.call_id))
        if not xt.children:
            return  # a leaf sends its input
        if keep is None:
            if self._up.nbytes < nbytes:
                self._up = np.empty(nbytes, dtype=np.uint8)
            keep = self._up[:nbytes]
        dtype, ufunc = xt.dtype, xt.ufunc
        out = keep.view(dtype)
        np.copyto(out, np.frombuffer(xt.call.buf, dtype))
        size = dtype.itemsize
        for child in xt.children:
            stream = xt.ins[child]
            theirs = stream.whole(dtype)
            if theirs is not None:
                apply(ufunc, out, theirs, out)
                continue
            for offset, data in stream.payloads():
                lo, hi = offset // size, (offset + len(data)) // size
                apply(ufunc, out[lo:hi], np.frombuffer(data, dtype), out[lo:hi])
        xt.up = keep.data
        if xt.parent < 0:
            xt.result = xt.up

    def take_held(self, xt: ExpressTree, peer: int) -> bool:
        """Move the frame the loop read ahead from ``peer`` (its header and the bytes staged
        after it, no more than the stream's first frame can hold) to the stream's inbox, and
        leave the link as if nothing had been read (the I/O layer reads on); False if it is
        not what the stream expects (those bytes go to the general path, as if just read)."""
        link = self.agent.links[peer]
        stream = xt.ins[peer]
        first, end = link.start - HEADER_SIZE, link.end
        taken = end - first
        stream.inbox[:taken] = link.stage[first:end]
        unhold(link, self.agent.uncount_frame)
        return stream.on_read(taken)

    def down(self, xt: ExpressTree) -> tuple[memoryview, int | None] | None:
        """The parent's stream, in place, to forward to the children before anything else
        (and its CRC32C, if its link checks); None if it came in several frames (the
        result is then made first: :meth:`take_result`)."""
        stream = xt.ins[xt.parent]
        if len(stream.frames) != 1:
            return None
        return (stream.inbox[HEADER_SIZE : HEADER_SIZE + xt.nbytes],
                stream.crcs[0] if stream.checked else None)

    def take_result(self, xt: ExpressTree) -> None:
        """The parent's stream is in: the result, in the store's buffer where it is kept."""
        nbytes = xt.nbytes
        recovery = self.agent.recovery
        keep = xt.keep = (None if recovery is None else
                          recovery.express_keep(nbytes, xt.call_id))
        stream = xt.ins[xt.parent]
        if keep is None and len(stream.frames) == 1:
            xt.result = stream.inbox[HEADER_SIZE : HEADER_SIZE + nbytes]  # (read in place)
            return
        if keep is None:
            if self._result.nbytes < nbytes:
                self._result = np.empty(nbytes, dtype=np.uint8)
            keep = self._result[:nbytes]
        result = keep.data
        if len(stream.frames) == 1:
            result[:] = stream.inbox[HEADER_SIZE : HEADER_SIZE + nbytes]
        else:
            for offset, data in stream.payloads():
                result[offset : offset + len(data)] = data
        xt.result = result

    def done(self, xt: ExpressTree, now: float) -> None:
        """Every frame is in and out: the result to the caller, and the records as the
        general path leaves them."""
        agent = self.agent
        nbytes = xt.nbytes
        result = xt.result
        assert result is not None and xt.desc is not None
        call = xt.call
        call.buf[:] = result
        agent.go(Event.CALL_ALLREDUCE)
        agent.seqno += 1
        version = xt.call_id[0]
        ins = xt.ins
        frames_in = 0
        for peer, link in agent.links.items():
            stream = ins.get(peer)
            link.remaining = 0
            if stream is None:
                link.pos = 0
                continue
            link.pos = nbytes
            link.seen_version = version
            if stream.checked:
                link.corrupt_streak = 0
            frames_in += len(stream.frames)
        agent.last_progress = now
        out = len(ins)  # one frame to each neighbour of the tree
        agent.count_express(out * nbytes, out, out * nbytes, frames_in)
        recovery = agent.recovery
        if recovery is not None:
            recovery.on_express(xt.call_id, xt.desc, call.buf, xt.keep)
        agent.go(Event.OP_COMPLETE)
