"""The express pair exchange: a pair allreduce (world size 2) made in one step when nothing
else is going on (``docs/design.md``, "Express calls").

In the steady state of a training loop, a pair call is always the same exchange: this rank
sends its whole input as DATA frames (one, or one per ``CHECKED_FRAME`` bytes on a link that
checks), and the peer's frames arrive.  The general path plans the call, builds its
records, and moves every byte through the receive side's framing; for a small call that
Python costs more than the exchange itself.  Here the agent only says whether the call may
be made express (:meth:`Express.prepare`: the frames to send, where the peer's land), and
once the I/O layer wrote those frames and read the peer's whole, :meth:`Express.done` checks
them and applies the call to the agent's records in one step, the same records the general
path leaves behind.

Anything else, and the I/O layer begins the call on the agent the general way, with what
it wrote and read so far: the frames written are the very frames ``begin`` makes (their
bytes are skipped), and the bytes read are handed to the receive side as if just read.  So the
peer sees the same bytes on the wire either way, and either rank may take either path.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from rabit2.core import fsm
from rabit2.core.express_broadcast import ExpressBroadcasts
from rabit2.core.express_inbox import PeerFrames, unhold
from rabit2.core.express_tree import ExpressTrees
from rabit2.core.express_tree_broadcast import ExpressTreeBroadcasts
from rabit2.core.framing import (
    CHECKED_FRAME,
    HEADER_SIZE,
    CallDescriptor,
    CollectiveKind,
    FrameKind,
    checksum,
    pack_header,
)
from rabit2.core.fsm import Mode, Phase
from rabit2.core.ops import apply, ufunc_of
from rabit2.core.planning import Planner
from rabit2.core.records import Call, Link
from rabit2.core.recovery.component import Recovery
from rabit2.errors import RabitError

State, Event = fsm.State, fsm.Event


class Owner(Protocol):
    """What the express path reads and changes of the agent that owns it."""

    rank: int
    world: int
    version: int
    seqno: int
    state: fsm.State
    links: dict[int, Link]
    dead_links: dict[int, str]
    error: RabitError | None
    recovery: Recovery | None
    planner: Planner
    last_progress: float

    def go(self, event: fsm.Event) -> None: ...
    def count_express(self, sent: int, frames_sent: int, received: int,
                      frames_received: int) -> None: ...
    def uncount_frame(self) -> None: ...


MAX_BYTES = 4 << 20
"""The largest pair call made express (its inbox is as large)."""


class ExpressCall(PeerFrames):
    """One pair call made express: the frames this rank sends (``headers``, each followed by
    its piece of the caller's bytes: the very frames ``Agent.begin`` would send) and where
    the peer's frames land (the ``inbox``: each header, then its payload, back to back)."""

    __slots__ = ("call", "desc", "headers", "held", "nbytes", "peer")

    def __init__(self, call: Call, desc: CallDescriptor, peer: int,
                 frames: list[tuple[int, int]], headers: list[bytes], inbox: memoryview,
                 held: bool) -> None:
        super().__init__()
        self.call, self.desc, self.peer = call, desc, peer
        self.nbytes = len(call.buf)
        self.headers, self.inbox = headers, inbox
        self.lay(frames, headers[0])  # (the peer's headers start as this rank's)
        # the link is paused on a header read ahead (the loop read it between calls):
        # it and what followed it in the stage are the inbox's first bytes (take_held)
        self.held = held

    def parts(self) -> list[bytes | memoryview]:
        """What this rank writes: each header, then its piece of the caller's bytes."""
        buf = self.call.buf
        if len(self.frames) == 1:
            return [self.headers[0], buf]
        out: list[bytes | memoryview] = []
        for header, (offset, length) in zip(self.headers, self.frames, strict=True):
            out += (header, buf[offset : offset + length])
        return out

    def check_headers(self, got: int) -> bool:
        """:meth:`PeerFrames.check_frames`: the peer's headers are this rank's, but for the
        offset, length and checksums."""
        return self.check_frames(got)


class Express:
    """Express pair calls, for one agent."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent
        self._inbox = memoryview(bytearray(0))
        self._out = np.empty(0, dtype=np.uint8)
        # per (dtype, size): the inbox's payload and the scratch result as arrays of it
        self._views: dict[tuple[np.dtype, int], tuple[np.ndarray, np.ndarray]] = {}
        self.broadcasts = ExpressBroadcasts(agent, self)
        self.trees = ExpressTrees(agent)
        self.tree_broadcasts = ExpressTreeBroadcasts(agent, self)

    def inbox(self, size: int) -> memoryview:
        """The first ``size`` bytes of the inbox, grown if need be (keeping what it holds:
        an express broadcast grows it once the root's first header is in)."""
        if len(self._inbox) < size:
            grown = memoryview(bytearray(max(size, 2 * len(self._inbox))))
            grown[: len(self._inbox)] = self._inbox
            self._inbox = grown
            self._views.clear()
        return self._inbox[:size]

    def prepare(self, call: Call) -> ExpressCall | None:
        """The frames to send for ``call`` if it may be made express; None if it must take
        the general path: not a pair allreduce of 1 B to ``MAX_BYTES``, an agent that is
        not between calls, a link that is not plainly up with nothing staged (but the
        peer's first frame read ahead), or recovery with something under way that a call's
        beginning acts on."""
        agent = self.agent
        nbytes = len(call.buf)
        if (call.kind is not CollectiveKind.ALLREDUCE_PAIR or not 0 < nbytes <= MAX_BYTES
                or agent.state is not State.READY or agent.dead_links):
            return None
        peer = 1 - agent.rank
        link = agent.links.get(peer)
        if link is None or link.phase is not Phase.UP or link.pending_needs:
            return None
        # the frames the send side makes of the input: at most CHECKED_FRAME bytes each on a
        # link that checks, else one
        step = CHECKED_FRAME if link.checked else nbytes
        frames = ([(0, nbytes)] if nbytes <= step else
                  [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)])
        held = link.mode is Mode.HELD
        if held:
            # the peer's first frame came while this rank computed: taken if nothing
            # follows it in the stage (its header is checked like any other)
            if link.end - link.start > frames[0][1] or link.start < HEADER_SIZE:
                return None
        elif link.mode is not Mode.HEADER or link.end:
            return None
        recovery = agent.recovery
        if recovery is not None and not recovery.quiet():
            return None
        desc = agent.planner.descriptor(call)
        buf, version, seqno = call.buf, agent.version, agent.seqno
        if len(frames) == 1:
            headers = [pack_header(FrameKind.DATA, desc, version, seqno, 0, nbytes, 0,
                                   checksum(buf) if link.checked else None)]
        else:
            headers = [pack_header(FrameKind.DATA, desc, version, seqno, offset, length, 0,
                                   checksum(buf[offset : offset + length]))
                       for offset, length in frames]
        inbox = self.inbox(len(frames) * HEADER_SIZE + nbytes)
        return ExpressCall(call, desc, peer, frames, headers, inbox, held)

    def take_held(self, xc: ExpressCall) -> int:
        """Move the held header and the payload bytes staged after it to the inbox, and
        leave the link as if nothing had been read (the I/O layer reads on); how many bytes
        the inbox holds now.  From here the call is made express or the general way with
        those bytes handed over, as if just read."""
        link = self.agent.links[xc.peer]
        first, end = link.start - HEADER_SIZE, link.end
        taken = end - first
        xc.inbox[:taken] = link.stage[first:end]
        unhold(link, self.agent.uncount_frame)
        return taken

    def done(self, xc: ExpressCall, now: float) -> bool:
        """The peer's frames are in the inbox, whole: make the call (True), or leave
        everything as it was (False: a header did not pass
        :meth:`ExpressCall.check_headers`, or a payload fails its checksum, and the general
        path must read them)."""
        agent = self.agent
        link = agent.links[xc.peer]
        nbytes = xc.nbytes
        if not xc.valid:
            return False
        if link.checked:
            for i, crc in enumerate(xc.crcs):
                if checksum(xc.payload(i)) != crc:
                    return False
        call = xc.call
        dtype = call.dtype
        assert dtype is not None and call.op is not None
        call_id = (agent.version, agent.seqno)
        # the pair plan's reduction: operands in rank order, into a buffer that aliases
        # neither (which NaN payload survives can depend on both); frame by frame, at
        # offsets that are multiples of the plan's REDUCE_BLOCK.  (What may fail, taking
        # memory, comes before any record changes.)
        recovery = agent.recovery
        keep = None if recovery is None else recovery.express_keep(nbytes, call_id)
        ufunc = ufunc_of(call.op)
        lower = agent.rank < xc.peer
        if len(xc.frames) == 1:
            views = self._views.get((dtype, nbytes))
            if views is None:
                views = self._typed(dtype, nbytes)
            landing, out = views
            if keep is not None:
                out = keep.view(dtype)
            mine = np.frombuffer(call.buf, dtype)
            apply(ufunc, *((mine, landing) if lower else (landing, mine)), out)
        else:
            out = (keep if keep is not None else self._scratch(nbytes)).view(dtype)
            size = dtype.itemsize
            for i, (offset, length) in enumerate(xc.frames):
                lo, hi = offset // size, (offset + length) // size
                mine = np.frombuffer(call.buf[offset : offset + length], dtype)
                theirs = np.frombuffer(xc.payload(i), dtype)
                apply(ufunc, *((mine, theirs) if lower else (theirs, mine)), out[lo:hi])
        agent.go(Event.CALL_ALLREDUCE)
        agent.seqno += 1
        # what the general path leaves on the link after the frames of a pair call
        link.pos = nbytes
        link.remaining = 0
        link.seen_version = call_id[0]
        if link.checked:
            link.corrupt_streak = 0
        call.buf[:] = out.data.cast("B")
        agent.last_progress = now
        agent.count_express(nbytes, len(xc.frames), nbytes, len(xc.frames))
        if recovery is not None:
            recovery.on_express(call_id, xc.desc, call.buf, keep)
        agent.go(Event.OP_COMPLETE)
        return True

    def _scratch(self, nbytes: int) -> np.ndarray:
        if self._out.nbytes < nbytes:
            self._out = np.empty(nbytes, dtype=np.uint8)
            self._views.clear()
        return self._out[:nbytes]

    def _typed(self, dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The peer's payload in the inbox, and a scratch for the result, as ``dtype`` (a
        call of one frame)."""
        out = self._scratch(nbytes).view(dtype)
        if len(self._views) >= 16:
            self._views.clear()
        count = nbytes // dtype.itemsize
        views = (np.frombuffer(self._inbox, dtype, count, HEADER_SIZE), out)
        self._views[(dtype, nbytes)] = views
        return views
