"""Express broadcasts: a broadcast of world size 2 made in one step when nothing else is
going on (``docs/design.md``, "Express calls").

In the general path the root sends its stream (the head, then the payload) as DATA frames
and the other rank, which learns the size from the root's first frame, sends an empty DATA
frame towards the root (its announce, so that two ranks that disagree about the root meet
a frame they do not expect).  Here the I/O layer writes this rank's frames (the very frames
``Agent.begin`` sends) and reads the peer's exactly: the root reads the 48-byte announce; the
receiver reads the root's first header, lays out the rest from it (:meth:`ExpressBroadcasts.
lay_out`), and reads that.  :meth:`ExpressBroadcasts.done` then checks what came, hands the
payload to the caller's ``receive`` and applies the call to the agent's records in one step,
as the general path leaves them.

Anything else, and the call is begun the general way with what was written skipped and
what was read handed over, as for express pair calls (:mod:`rabit2.core.express`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from rabit2.core.express_inbox import PeerFrames
from rabit2.core.framing import (
    CHECKED_FRAME,
    FLAG_CHECKED,
    FRAME_MAGIC,
    HEADER,
    HEADER_SIZE,
    NONE_U8,
    UNKNOWN_TOTAL,
    CallDescriptor,
    CollectiveKind,
    FrameCorruptError,
    FrameKind,
    checksum,
    pack_header,
    unpack_tail,
)
from rabit2.core.fsm import Event, Mode, Phase, State
from rabit2.core.records import Call
from rabit2.core.schedule import Stream

if TYPE_CHECKING:
    from rabit2.core.express import Express, Owner

MAX_BYTES = 4 << 20
"""The largest broadcast stream (head and payload) made express."""
_DATA_CHECKED = FrameKind.DATA | FLAG_CHECKED


def frames_of(pieces: list[int], checked: bool) -> list[tuple[int, int]]:
    """``(offset, length)`` of each DATA frame a root sends of a stream made of pieces of
    these sizes: one frame on a link that does not check, else one piece at most and
    ``CHECKED_FRAME`` bytes at most each (``Sender.pump``)."""
    total = sum(pieces)
    if not checked:
        return [(0, total)]
    out: list[tuple[int, int]] = []
    at = 0
    for size in pieces:
        end = at + size
        while at < end:
            length = min(CHECKED_FRAME, end - at)
            out.append((at, length))
            at += length
    return out


def api_shaped(call: Call, is_root: bool) -> bool:
    """A broadcast as the API makes it: the root sends a head and a payload, 1 B to
    ``MAX_BYTES`` in all; another rank learns the size from the root's first frame."""
    if is_root:
        return len(call.pieces) == 2 and 0 < sum(len(p) for p in call.pieces) <= MAX_BYTES
    return call.receive is not None and call.head_size > 0


@functools.lru_cache(maxsize=64)
def _unsized(root: int) -> CallDescriptor:
    return CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, root, UNKNOWN_TOTAL)


def announce_of(root: int, version: int, seqno: int) -> bytes:
    """A receiver's announce: the empty DATA frame it sends towards the root before it knows
    the size, as the API makes its call (no dtype, no size; ``Sender.pump``)."""
    return pack_header(FrameKind.DATA, _unsized(root), version, seqno, 0, 0)


def first_total(inbox: memoryview, checked: bool, call: Call, version: int,
                seqno: int) -> int | None:
    """The size of the stream whose first header ``inbox`` holds, if it is the first frame
    of this call as a receiver expects it: the same call, root and checking, offset 0, its
    own checksum holding before the size is believed, the size at least the head and at
    most ``MAX_BYTES``; None if not (the general path reads it)."""
    (magic, kind, call_kind, dtype, op, root, got_version, got_seqno, total, offset, _,
     incarnation, _) = HEADER.unpack_from(inbox)
    if (magic != FRAME_MAGIC or kind != (_DATA_CHECKED if checked else FrameKind.DATA)
            or call_kind != CollectiveKind.BROADCAST or dtype != NONE_U8 or op != NONE_U8
            or root != call.root or got_version != version or got_seqno != seqno
            or offset or incarnation):
        return None
    try:
        unpack_tail(inbox, 0)
    except FrameCorruptError:
        return None
    return total if call.head_size <= total <= MAX_BYTES else None


class ExpressBroadcast(PeerFrames):
    """One broadcast made express.  ``parts``: what this rank writes; the inbox: where the
    peer's frames land, back to back (the root: the 48-byte announce; the receiver: the
    root's frames, laid out once the first header is in)."""

    __slots__ = ("announce", "call", "checked", "desc", "is_root", "nsent", "parts", "peer",
                 "total")

    def __init__(self, call: Call, desc: CallDescriptor, peer: int, is_root: bool,
                 announce: bytes, checked: bool) -> None:
        super().__init__()
        self.call, self.desc, self.peer, self.is_root = call, desc, peer, is_root
        self.announce = announce  # the receiver's empty DATA frame of this call
        self.checked = checked
        self.parts: list[bytes | memoryview] = []
        self.nsent = 0  # the bytes of parts
        self.total = 0  # the root's stream, head and payload

    def check_headers(self, got: int) -> bool:
        """Check what of the peer's frames the first ``got`` bytes of the inbox hold whole
        and was not checked yet; False at the first surprise (the general path must read
        it)."""
        if self.is_root:
            if got < HEADER_SIZE:
                return True
            self.valid = self.inbox[:HEADER_SIZE] == self.announce
            return self.valid
        if not self.frames:
            return True  # (the first header, read before the rest is laid out: lay_out)
        return self.check_frames(got)


class ExpressBroadcasts:
    """Express broadcasts, for one agent."""

    def __init__(self, agent: Owner, express: Express) -> None:
        self.agent = agent
        self.express = express

    def prepare(self, call: Call) -> ExpressBroadcast | None:
        """What to write for ``call`` if it may be made express: a broadcast of world size
        2 whose root sends 1 B to ``MAX_BYTES`` as a head and a payload, or whose receiver
        learns the size from the root; None otherwise, or when the agent or the link is not
        plainly idle (as :meth:`Express.prepare`; a frame read ahead is not taken here)."""
        agent = self.agent
        if (call.kind is not CollectiveKind.BROADCAST or agent.world != 2
                or agent.state is not State.READY or agent.dead_links):
            return None
        is_root = call.root == agent.rank
        if not api_shaped(call, is_root):
            return None
        peer = 1 - agent.rank
        link = agent.links.get(peer)
        if (link is None or link.phase is not Phase.UP or link.pending_needs
                or link.mode is not Mode.HEADER or link.end):
            return None
        recovery = agent.recovery
        if recovery is not None and not recovery.quiet():
            return None
        version, seqno = agent.version, agent.seqno
        desc = agent.planner.descriptor(call)
        announce = announce_of(call.root, version, seqno)
        xb = ExpressBroadcast(call, desc, peer, is_root, announce, link.checked)
        if not is_root:
            xb.parts = [announce]
            xb.nsent = HEADER_SIZE
            xb.inbox = self.express.inbox(HEADER_SIZE)
            return xb
        pieces = call.pieces
        xb.total = desc.total_bytes
        xb.frames = frames_of([len(p) for p in pieces], link.checked)
        if len(xb.frames) == 1:
            header = pack_header(FrameKind.DATA, desc, version, seqno, 0, xb.total, 0,
                                 checksum(pieces[1], checksum(pieces[0]))
                                 if link.checked else None)
            xb.parts = [header, *pieces]
        else:
            stream = Stream(pieces)
            for offset, length in xb.frames:
                view = stream.view(offset, length)  # (frames_of keeps to one piece)
                xb.parts += (pack_header(FrameKind.DATA, desc, version, seqno, offset, length,
                                         0, checksum(view)), view)
        xb.nsent = len(xb.frames) * HEADER_SIZE + xb.total
        xb.inbox = self.express.inbox(HEADER_SIZE)
        return xb

    def lay_out(self, xb: ExpressBroadcast) -> bool:
        """The receiver read the root's first header: lay out the root's frames from it (the
        inbox grows to hold them all); False if it is not the first frame of this call as
        this rank expects it (the general path reads it)."""
        agent = self.agent
        inbox = xb.inbox
        call = xb.call
        total = first_total(inbox, xb.checked, call, agent.version, agent.seqno)
        if total is None:
            return False
        head_size = call.head_size
        xb.total = total
        xb.lay(frames_of([head_size, total - head_size], xb.checked), bytes(inbox[:HEADER_SIZE]))
        xb.desc = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, call.root, total)
        size = len(xb.frames) * HEADER_SIZE + total
        xb.inbox = self.express.inbox(size)  # (the header read so far stays where it is)
        return xb.check_headers(HEADER_SIZE)

    def done(self, xb: ExpressBroadcast, now: float) -> bool:
        """The peer's frames are in the inbox, whole: make the call (True), or leave
        everything as it was (False: a checksum fails, or the caller's ``receive`` refuses
        the head; the general path then reads the same bytes and fails the same way)."""
        agent = self.agent
        link = agent.links[xb.peer]
        call = xb.call
        version, seqno = agent.version, agent.seqno
        if not xb.valid:
            return False
        if xb.is_root:
            pieces = list(call.pieces)
        else:
            if xb.checked:
                for i, crc in enumerate(xb.crcs):
                    if checksum(xb.payload(i)) != crc:
                        return False
            head_size = call.head_size
            head = memoryview(bytearray(xb.payload(0)[:head_size]))  # (the head is in frame 0)
            assert call.receive is not None
            try:
                dest = call.receive(head)
            except (ValueError, TypeError, MemoryError):
                return False
            if len(dest) != xb.total - head_size:
                return False
            at = head_size
            for i, (offset, length) in enumerate(xb.frames):
                data = xb.payload(i)
                lo = max(offset, head_size)
                if lo < offset + length:
                    dest[lo - at : offset + length - at] = data[lo - offset :]
            pieces = [head, dest]
        agent.go(Event.CALL_BROADCAST)
        agent.seqno += 1
        link.pos = 0 if xb.is_root else xb.total
        link.remaining = 0
        link.seen_version = version
        if xb.checked and not xb.is_root:
            link.corrupt_streak = 0
        agent.last_progress = now
        if xb.is_root:
            agent.count_express(xb.total, len(xb.frames), 0, 1)
        else:
            agent.count_express(0, 1, xb.total, len(xb.frames))
        recovery = agent.recovery
        if recovery is not None:
            recovery.results.add((version, seqno), xb.desc, pieces)
        agent.go(Event.OP_COMPLETE)
        return True

