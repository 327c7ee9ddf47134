"""The express pair exchange: a pair allreduce (world size 2) made in one step when nothing
else is going on (``docs/design.md``, "Express calls").

In the steady state of a training loop, a pair call is always the same exchange: this rank
sends one DATA frame holding its whole input, and the peer's one DATA frame arrives.  The
general path plans the call, builds its records, and moves every byte through the receive
side's framing; that Python costs more than the exchange itself.  Here the agent only says
whether the call may be made express (:meth:`Express.prepare`: the frame to send, where
the peer's frame lands), and once the I/O layer wrote that frame and read the peer's frame
whole, :meth:`Express.done` checks the peer's frame and applies the call to the agent's
records in one step, the same records the general path leaves behind.

Anything else, and the I/O layer begins the call on the agent the general way, with what
it wrote and read so far: the frame written is the very frame ``begin`` makes (its bytes
are skipped), and the bytes read are handed to the receive side as if just read.  So the
peer sees the same bytes on the wire either way, and either rank may take either path.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from rabit2.core import fsm
from rabit2.core.framing import (
    CALL_PREFIX_SIZE,
    CHECKED_FRAME,
    HEADER_SIZE,
    CallDescriptor,
    CollectiveKind,
    FrameCorruptError,
    FrameKind,
    checksum,
    pack_header,
    unpack_tail,
)
from rabit2.core.fsm import LinkEvent, Mode, Phase
from rabit2.core.ops import ufunc_of
from rabit2.core.planning import Planner
from rabit2.core.records import Call, Link
from rabit2.core.recovery.component import Recovery
from rabit2.errors import RabitError

State, Event = fsm.State, fsm.Event


class Owner(Protocol):
    """What the express path reads and changes of the agent that owns it."""

    rank: int
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
    def count_express(self, nbytes: int) -> None: ...
    def uncount_frame(self) -> None: ...


class ExpressCall:
    """One pair call made express: the frame this rank sends (``header``, then the caller's
    bytes) and where the peer's frame lands (``inbox``: its header, then its payload)."""

    __slots__ = ("call", "crc", "desc", "header", "held", "inbox", "nbytes", "peer", "valid")

    def __init__(self, call: Call, desc: CallDescriptor, peer: int, header: bytes,
                 inbox: memoryview, held: bool) -> None:
        self.call, self.desc, self.peer, self.header = call, desc, peer, header
        self.nbytes = len(call.buf)
        self.inbox = inbox
        # the link is paused on a header read ahead (the loop read it between calls):
        # it and what followed it in the stage are the inbox's first bytes (take_held)
        self.held = held
        self.crc = 0  # the payload CRC32C the peer's header names
        self.valid = False  # the peer's header passed check_header

    def check_header(self) -> bool:
        """The peer's header (the first bytes of the inbox) is that of its one DATA frame of
        this call, as this rank's own frame is: the same call and descriptor, offset 0, the
        same length, its own checksum holding."""
        inbox = self.inbox
        if inbox[:CALL_PREFIX_SIZE] != self.header[:CALL_PREFIX_SIZE]:
            return False
        try:
            offset, length, self.crc = unpack_tail(inbox, 0)
        except FrameCorruptError:
            return False  # (the general path resets the link for it)
        self.valid = offset == 0 and length == self.nbytes
        return self.valid


class Express:
    """Express pair calls, for one agent."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent
        self._inbox = memoryview(bytearray(0))
        self._out = np.empty(0, dtype=np.uint8)
        # per (dtype, size): the inbox's payload and the scratch result as arrays of it
        self._views: dict[tuple[np.dtype, int], tuple[np.ndarray, np.ndarray]] = {}

    def prepare(self, call: Call) -> ExpressCall | None:
        """The frame to send for ``call`` if it may be made express; None if it must take
        the general path: not a pair allreduce, no single checked frame, an agent that is
        not between calls, a link that is not plainly up with nothing staged, or recovery
        with something under way that a call's beginning acts on."""
        agent = self.agent
        nbytes = len(call.buf)
        if (call.kind is not CollectiveKind.ALLREDUCE_PAIR or not 0 < nbytes <= CHECKED_FRAME
                or agent.state is not State.READY or agent.dead_links):
            return None
        peer = 1 - agent.rank
        link = agent.links.get(peer)
        if link is None or link.phase is not Phase.UP or link.pending_needs:
            return None
        held = link.mode is Mode.HELD
        if held:
            # the peer's frame came while this rank computed: taken if nothing follows it
            # in the stage (its header is checked like any other)
            if link.end - link.start > nbytes or link.start < HEADER_SIZE:
                return None
        elif link.mode is not Mode.HEADER or link.end:
            return None
        recovery = agent.recovery
        if recovery is not None and not recovery.quiet():
            return None
        desc = agent.planner.descriptor(call)
        crc = checksum(call.buf) if link.checked else None
        header = pack_header(FrameKind.DATA, desc, agent.version, agent.seqno, 0, nbytes, 0,
                             crc)
        size = HEADER_SIZE + nbytes
        if len(self._inbox) < size:
            self._inbox = memoryview(bytearray(max(size, 2 * len(self._inbox))))
            self._views.clear()
        return ExpressCall(call, desc, peer, header, self._inbox[:size], held)

    def take_held(self, xc: ExpressCall) -> int:
        """Move the held header and the payload bytes staged after it to the inbox, and
        leave the link as if nothing had been read (the I/O layer reads on); how many bytes
        the inbox holds now.  From here the call is made express or the general way with
        those bytes handed over, as if just read."""
        link = self.agent.links[xc.peer]
        first, end = link.start - HEADER_SIZE, link.end
        taken = end - first
        xc.inbox[:taken] = link.stage[first:end]
        link.go(LinkEvent.CALL_BEGAN)
        link.start = link.end = 0
        link.frame = None
        link.remaining = 0
        self.agent.uncount_frame()  # (it is counted again as it is handed over or made)
        return taken

    def done(self, xc: ExpressCall, now: float) -> bool:
        """The peer's frame is in the inbox, whole: make the call (True), or leave everything
        as it was (False: its header did not pass :meth:`ExpressCall.check_header`, or its
        payload fails its checksum, and the general path must read it)."""
        agent = self.agent
        link = agent.links[xc.peer]
        nbytes = xc.nbytes
        if not xc.valid or (link.checked and checksum(xc.inbox[HEADER_SIZE:]) != xc.crc):
            return False
        call = xc.call
        dtype = call.dtype
        assert dtype is not None and call.op is not None
        agent.go(Event.CALL_ALLREDUCE)
        call_id = (agent.version, agent.seqno)
        agent.seqno += 1
        # what the general path leaves on the link after the one frame of a pair call
        link.pos = nbytes
        link.remaining = 0
        link.seen_version = call_id[0]
        if link.checked:
            link.corrupt_streak = 0
        # the pair plan's reduction: operands in rank order, into a buffer that aliases
        # neither (which NaN payload survives can depend on both)
        recovery = agent.recovery
        keep = None if recovery is None else recovery.result_buffer(nbytes, call_id)
        key = (dtype, nbytes)
        views = self._views.get(key)
        if views is None:
            views = self._typed(dtype, nbytes)
        landing, out = views
        if keep is not None:
            out = np.frombuffer(keep, dtype)
        mine = np.frombuffer(call.buf, dtype)
        first, second = (mine, landing) if agent.rank < xc.peer else (landing, mine)
        ufunc_of(call.op)(first, second, out=out, casting="no")
        call.buf[:] = out.data.cast("B")
        agent.last_progress = now
        agent.count_express(nbytes)
        if recovery is not None:
            recovery.on_express(call_id, xc.desc, call.buf, keep)
        agent.go(Event.OP_COMPLETE)
        return True

    def _typed(self, dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The peer's payload in the inbox, and a scratch for the result, as ``dtype``."""
        if self._out.nbytes < nbytes:
            self._out = np.empty(nbytes, dtype=np.uint8)
            self._views.clear()
        if len(self._views) >= 16:
            self._views.clear()
        count = nbytes // dtype.itemsize
        views = (np.frombuffer(self._inbox, dtype, count, HEADER_SIZE),
                 self._out[:nbytes].view(dtype))
        self._views[(dtype, nbytes)] = views
        return views
