"""Express tree broadcasts: a broadcast of world size 3 or more made in one pass on the
caller's thread when nothing else is going on (``docs/design.md``, "Express calls").

In the general path the root sends its stream (the head, then the payload) down the tree,
each rank forwards what arrives as it arrives, and every rank but the root sends an empty
DATA frame towards the root (its announce: ranks that disagree about the root meet a frame
they do not expect).  Here the I/O layer does the same in order:

- the root writes its frames to each child (the very frames ``Agent.begin`` sends), then
  reads each child's announce, which must be exactly the 48 bytes the general path sends;
- another rank writes its announce to its parent, reads the parent's first header (the
  size is in it: :meth:`ExpressTreeBroadcasts.size`), then the rest of the stream however
  the parent cut it, then its children's announces; it hands the head to the API's
  ``receive`` and copies the payload there (:meth:`ExpressTreeBroadcasts.receive`), and
  only then writes the stream to its children, as ``Sender.pump`` would cut it.

Up to that last step anything unexpected ends in the general path, with what was written
skipped from what ``begin`` sends and what was read handed over.  From there the call is
this rank's to finish: a frame the kernel took only part of is finished by the loop
(:meth:`ExpressTreeBroadcasts.done` has kept the result for a neighbour's replay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rabit2.core.express_broadcast import MAX_BYTES, announce_of, api_shaped, first_total, frames_of
from rabit2.core.express_inbox import unhold
from rabit2.core.express_tree import InStream, all_quiet
from rabit2.core.framing import (
    FLAG_CHECKED,
    HEADER_SIZE,
    NONE_U8,
    CallDescriptor,
    CollectiveKind,
    FrameKind,
    checksum,
    data_prefix,
    pack_header,
)
from rabit2.core.fsm import Event, State
from rabit2.core.records import Call
from rabit2.core.schedule import Stream
from rabit2.core.topology import broadcast_route

if TYPE_CHECKING:
    from rabit2.core.express import Express, Owner

_DATA_CHECKED = FrameKind.DATA | FLAG_CHECKED


class Exact:
    """Bytes this rank reads exactly: a child's announce (``expected``), or a parent's first
    header (anything: checked once it is in)."""

    __slots__ = ("expected", "got", "inbox", "peer")

    def __init__(self, peer: int, inbox: memoryview, expected: bytes | None = None) -> None:
        self.peer, self.inbox, self.expected = peer, inbox, expected
        self.got = 0

    def want(self) -> int:
        return len(self.inbox) - self.got

    def on_read(self, nbytes: int) -> bool:
        self.got += nbytes
        return (self.expected is None or self.got < len(self.inbox)
                or self.inbox == self.expected)

    def complete(self) -> bool:
        return self.got == len(self.inbox)


class ExpressTreeBroadcast:
    """One broadcast of world size 3 or more made express on this rank."""

    __slots__ = ("announce", "announces", "call", "call_id", "checked", "desc", "first", "held",
                 "held_rest", "in_link", "is_root", "nframes", "out_links", "parts", "pieces",
                 "stream", "total")

    def __init__(self, call: Call, call_id: tuple[int, int], desc: CallDescriptor,
                 in_link: int, out_links: tuple[int, ...], announce: bytes) -> None:
        self.call, self.call_id, self.desc = call, call_id, desc
        self.in_link, self.out_links = in_link, out_links
        self.is_root = in_link < 0
        self.announce = announce  # a non-root's empty DATA frame of this call, size unknown
        self.checked: dict[int, bool] = {}
        self.announces: list[Exact] = []  # the children's, read exactly
        self.first: Exact | None = None  # the parent's first header (a non-root)
        self.held: list[int] = []  # peers whose frame the loop read ahead
        self.held_rest = b""  # what was staged after the parent's first header, if held
        self.stream: InStream | None = None  # the parent's stream, once sized
        self.parts: dict[int, list[bytes | memoryview]] = {}  # per child, what goes to it
        self.nframes = 0  # the frames in them
        self.pieces: list[memoryview] = []  # the stream: the head, then the payload
        self.total = 0

    def lay_out(self) -> None:
        """The frames of the stream to each child, as ``Sender.pump`` cuts them when the
        whole stream is ready (one frame; on a link that checks, a piece at most and
        ``CHECKED_FRAME`` bytes at most each)."""
        version, seqno = self.call_id
        pieces = self.pieces
        for child in self.out_links:
            if not self.checked[child]:
                header = pack_header(FrameKind.DATA, self.desc, version, seqno, 0, self.total)
                self.parts[child] = [header, *pieces]
                self.nframes += 1
                continue
            stream = Stream(pieces)
            out: list[bytes | memoryview] = []
            for offset, length in frames_of([len(p) for p in pieces], True):
                view = stream.view(offset, length)  # (frames_of keeps to one piece)
                out += (pack_header(FrameKind.DATA, self.desc, version, seqno, offset, length,
                                    0, checksum(view)), view)
                self.nframes += 1
            self.parts[child] = out


class ExpressTreeBroadcasts:
    """Express broadcasts of world size 3 or more, for one agent."""

    def __init__(self, agent: Owner, express: Express) -> None:
        self.agent = agent
        self.trees = express.trees  # (the per-peer inboxes)
        self._announces: dict[int, memoryview] = {}  # per child: 48 bytes

    def prepare(self, call: Call) -> ExpressTreeBroadcast | None:
        """The express call for ``call`` if it may be made express: a broadcast of world
        size 3 or more whose root sends 1 B to ``MAX_BYTES`` as a head and a payload, or
        whose receiver learns the size from the root; an agent between calls, every link
        plainly up with nothing read ahead, recovery quiet.  None otherwise."""
        agent = self.agent
        if (call.kind is not CollectiveKind.BROADCAST or agent.world < 3
                or agent.state is not State.READY or agent.dead_links):
            return None
        is_root = call.root == agent.rank
        if not api_shaped(call, is_root):
            return None
        held: list[int] = []
        if not all_quiet(agent, held, HEADER_SIZE + MAX_BYTES):
            return None
        links = agent.links
        in_link, out_links = broadcast_route(agent.rank, call.root, agent.world)
        for peer in held:
            # a frame the loop read ahead: the parent's first (and no more of its stream
            # than that frame), or a child's announce
            link = links[peer]
            frame = link.frame
            staged = link.end - link.start
            if frame is None or staged > frame.length or (peer != in_link and (
                    peer not in out_links or frame.length)):
                return None
        version, seqno = agent.version, agent.seqno
        announce = announce_of(call.root, version, seqno)
        desc = agent.planner.descriptor(call)
        xb = ExpressTreeBroadcast(call, (version, seqno), desc, in_link, out_links, announce)
        xb.held = held
        for peer in (*out_links, in_link) if in_link >= 0 else out_links:
            neighbour = links.get(peer)
            if neighbour is None:
                return None
            xb.checked[peer] = neighbour.checked
        for child in out_links:
            xb.announces.append(Exact(child, self._announce_inbox(child), announce))
        if is_root:
            xb.pieces = list(call.pieces)
            xb.total = desc.total_bytes
            xb.lay_out()
        else:
            xb.first = Exact(in_link, memoryview(bytearray(HEADER_SIZE)))
        return xb

    def _announce_inbox(self, peer: int) -> memoryview:
        inbox = self._announces.get(peer)
        if inbox is None:
            inbox = self._announces[peer] = memoryview(bytearray(HEADER_SIZE))
        return inbox

    def take_held(self, xb: ExpressTreeBroadcast, peer: int) -> bool:
        """Move the frame the loop read ahead from ``peer`` to where this call reads it (a
        child's announce to its reader; the parent's first header to ``first``, the payload
        bytes staged after it kept for :meth:`size`), and leave the link as if nothing had
        been read; False if a child's announce is not the one expected."""
        link = self.agent.links[peer]
        first, start, end = link.start - HEADER_SIZE, link.start, link.end
        if peer == xb.in_link:
            assert xb.first is not None
            xb.first.inbox[:] = link.stage[first:start]
            xb.first.got = HEADER_SIZE
            xb.held_rest = bytes(link.stage[start:end])
            ok = True
        else:
            reader = next(r for r in xb.announces if r.peer == peer)
            reader.inbox[:] = link.stage[first:start]
            ok = reader.on_read(HEADER_SIZE)
        unhold(link, self.agent.uncount_frame)
        return ok

    def size(self, xb: ExpressTreeBroadcast) -> bool:
        """A non-root read its parent's first header: check it (the same call, root and
        checking as expected, any size, its own checksum holding before the size is
        believed) and lay out the stream it starts; False if it is not what this rank
        expects (the general path reads it)."""
        first = xb.first
        assert first is not None and first.complete()
        inbox = first.inbox
        checked = xb.checked[xb.in_link]
        version, seqno = xb.call_id
        total = first_total(inbox, checked, xb.call, version, seqno)
        if total is None or len(xb.held_rest) > total:
            return False
        xb.total = total
        xb.desc = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, xb.call.root, total)
        stream = xb.stream = InStream(xb.in_link, total, checked,
                                      self.trees.inbox(xb.in_link, HEADER_SIZE + total))
        stream.reset(data_prefix(xb.desc, version, seqno, checked))
        # the stream's first bytes, read: the header and, if the loop read it ahead, what
        # was staged after it (that frame's payload only)
        rest = xb.held_rest
        stream.inbox[:HEADER_SIZE] = inbox
        stream.inbox[HEADER_SIZE : HEADER_SIZE + len(rest)] = rest
        return stream.on_read(HEADER_SIZE + len(rest))

    def receive(self, xb: ExpressTreeBroadcast) -> bool:
        """A non-root has the whole stream (and its children's announces): hand the head to
        the caller's ``receive``, copy the payload where it says, and lay out the frames to
        the children; False if ``receive`` refuses the head (the general path then reads the
        same bytes and fails the same way)."""
        stream = xb.stream
        call = xb.call
        assert stream is not None and call.receive is not None
        head_size = call.head_size
        payloads = stream.payloads()
        head = bytearray(head_size)
        at = 0
        for offset, data in payloads:
            if offset >= head_size:
                break
            take = min(len(data), head_size - offset)
            head[offset : offset + take] = data[:take]
            at = offset + take
        assert at == head_size
        view = memoryview(head)
        try:
            dest = call.receive(view)
        except (ValueError, TypeError, MemoryError):
            return False
        if len(dest) != xb.total - head_size:
            return False
        for offset, data in payloads:
            lo = max(offset, head_size)
            end = offset + len(data)
            if lo < end:
                dest[lo - head_size : end - head_size] = data[lo - offset :]
        xb.pieces = [view, dest]
        xb.lay_out()
        return True

    def done(self, xb: ExpressTreeBroadcast, now: float) -> None:
        """Every frame is in and out (or this rank's to finish): the records as the general
        path leaves them, and the stream kept for a neighbour's replay."""
        agent = self.agent
        version, seqno = agent.version, agent.seqno
        agent.go(Event.CALL_BROADCAST)
        agent.seqno += 1
        stream = xb.stream
        children = set(xb.out_links)
        for peer, link in agent.links.items():
            link.remaining = 0
            if peer == xb.in_link:
                link.pos = xb.total
            else:
                link.pos = 0
                if peer not in children:
                    continue
            link.seen_version = version
            if xb.checked[peer]:
                link.corrupt_streak = 0
        agent.last_progress = now
        nchildren = len(xb.out_links)
        if xb.is_root:
            agent.count_express(xb.total * nchildren, xb.nframes, 0, nchildren)
        else:
            assert stream is not None
            agent.count_express(xb.total * nchildren, xb.nframes + 1, xb.total,
                                len(stream.frames) + nchildren)
        recovery = agent.recovery
        if recovery is not None:
            recovery.results.add((version, seqno), xb.desc, xb.pieces)
        agent.go(Event.OP_COMPLETE)
