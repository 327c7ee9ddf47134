"""What the agent hands out and keeps: the commands it returns to the I/O layer, the calls
the API hands it, and its records of each link and of the call in progress.

Pure data (no behaviour beyond small helpers): ``rabit2.core.agent`` and the recovery
component (``rabit2.core.recovery``) change these records; nothing here reads a clock or a
socket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rabit2.core import fsm
from rabit2.core.framing import (
    NONE_U8,
    NONE_U16,
    CallDescriptor,
    CollectiveKind,
    FrameHeader,
    FrameKind,
    data_prefix,
)
from rabit2.core.fsm import (
    LINK_MODES,
    LinkEvent,
    Mode,
    Phase,
    PhaseEvent,
    link_transition,
    phase_transition,
)
from rabit2.core.ops import Op
from rabit2.core.recovery.peer_state import PeerState
from rabit2.core.recovery.store import CallId
from rabit2.core.schedule import PayloadFn, Plan
from rabit2.errors import RabitError

Event = fsm.Event


# ----------------------------------------------------------------------------- commands


@dataclasses.dataclass(slots=True)  # (made per call: a frozen one takes ~5x longer to build)
class Send:
    """Write these buffers, in order, to the link to ``peer`` (header first).

    ``volatile``: the agent changes the buffers once this command has been executed, so
    what the kernel does not take at once must be copied (otherwise the I/O layer may keep
    referring to them until they are written)."""

    peer: int
    buffers: list[bytes | memoryview]
    volatile: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PauseReading:
    peer: int


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeReading:
    peer: int


@dataclasses.dataclass(slots=True)  # (made per call: a frozen one takes ~5x longer to build)
class CallComplete:
    """The current call finished on this rank; ``call_id`` = (version, seqno).

    ``finish``: to run when this command is executed, after every command before it (so
    after the sends that still read the caller's array): a plan that made the result
    elsewhere puts it there (:attr:`rabit2.core.schedule.Plan.finish`)."""

    call_id: tuple[int, int]
    finish: Callable[[], None] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class CallFailed:
    call_id: tuple[int, int] | None
    error: RabitError


@dataclasses.dataclass(frozen=True, slots=True)
class CloseLink:
    peer: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointLoaded:
    """A restarted rank fetched the checkpoint it resumes from (``blob`` None: version 0;
    ``local`` None unless its local model was asked for)."""

    version: int
    blob: bytes | None
    local: bytes | None = None


Command = (Send | PauseReading | ResumeReading | CallComplete | CallFailed | CloseLink
           | CheckpointLoaded)


# ----------------------------------------------------------------------------- calls


@dataclasses.dataclass(slots=True)  # (made per call: a frozen one takes ~5x longer to build)
class Call:
    """A collective as the API hands it to the agent (already validated)."""

    kind: CollectiveKind
    buf: memoryview  # flat, writable, C-contiguous bytes
    dtype: np.dtype | None = None
    op: Op | None = None
    root: int = -1
    blocks: tuple[tuple[int, int], ...] = ()  # allgather: byte range of each rank's block
    # broadcast: the root's stream as several pieces (a head, then the payload), and, on a
    # rank that does not know the size, where the payload goes once the head has arrived
    pieces: tuple[memoryview, ...] = ()
    receive: PayloadFn | None = None
    head_size: int = 0


NO_CALL = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, NONE_U16, 0)
"""The descriptor of frames that belong to no call (ERROR, CONTROL)."""

RESUME_EVENTS = {
    CollectiveKind.ALLREDUCE_TREE: Event.RESUME_ALLREDUCE,
    CollectiveKind.ALLREDUCE_RING: Event.RESUME_ALLREDUCE,
    CollectiveKind.ALLREDUCE_PAIR: Event.RESUME_ALLREDUCE,
    CollectiveKind.BROADCAST: Event.RESUME_BROADCAST,
    CollectiveKind.ALLGATHER: Event.RESUME_ALLGATHER,
}

CALL_EVENTS = {
    CollectiveKind.ALLREDUCE_TREE: Event.CALL_ALLREDUCE,
    CollectiveKind.ALLREDUCE_RING: Event.CALL_ALLREDUCE,
    CollectiveKind.ALLREDUCE_PAIR: Event.CALL_ALLREDUCE,
    CollectiveKind.BROADCAST: Event.CALL_BROADCAST,
    CollectiveKind.ALLGATHER: Event.CALL_ALLGATHER,
}


STAGE_SIZE = 16 * 1024  # holds a small call whole; larger payloads land zero-copy
"""Per-link staging buffer for frame headers and the payload bytes that arrive with them."""


@dataclasses.dataclass(frozen=True, slots=True)
class AgentStats:
    """A frozen snapshot of counters, for humans and tests."""

    state: str
    calls_completed: int
    bytes_sent: int
    bytes_received: int
    frames_sent: int
    frames_received: int


EVERY_RANK_CONTRIBUTES = frozenset((CollectiveKind.ALLREDUCE_TREE, CollectiveKind.ALLREDUCE_RING,
                                     CollectiveKind.ALLREDUCE_PAIR, CollectiveKind.ALLGATHER))
"""Collectives whose result depends on every rank's input (a broadcast does not: a rank on
its route can finish one while a rank off it is still in an older version)."""


NO_VIEW = memoryview(b"")


class Link:
    """Receive-side framing state of one peer link."""

    __slots__ = ("blob", "blob_fetch", "body_kind", "check_buf", "checked", "corrupt_streak",
                 "crc", "end", "error_buf", "expect", "filled", "frame", "incarnation", "mode",
                 "need_sent", "peer_state", "pending_needs", "pending_state", "phase", "pos",
                 "progress_told", "remaining", "scratch", "seen_version", "send_scratch",
                 "stage", "start", "up_at", "up_call")

    def __init__(self) -> None:
        # headers are read into this staging buffer together with whatever follows them, so
        # a small frame costs one read instead of two; bytes [start, end) are not consumed
        self.stage = memoryview(bytearray(STAGE_SIZE))
        self.start = 0
        self.end = 0
        self.mode = Mode.HEADER
        self.filled = 0
        self.frame: FrameHeader | None = None
        self.pos = 0  # stream position of the next payload byte
        self.remaining = 0  # payload bytes left in the current frame
        # checksums (docs/protocol.md, "Checksums"): the current frame's payload CRC32C, or
        # -1 (not checked); the CRC of what of it landed so far (``filled`` bytes), in the
        # buffer a checked DATA frame lands in until it is verified
        self.expect = -1
        self.crc = 0
        self.check_buf = NO_VIEW
        self.corrupt_streak = 0  # frames in a row that failed their checksum
        self.checked = True  # the frames this rank sends on this link carry payload CRCs
        self.seen_version = -1  # the version of the last call the peer sent a DATA frame of
        self.progress_told = -1e18  # when this rank last told the peer how its call moves
        self.error_buf = bytearray()  # the body of an ERROR or CONTROL frame
        self.body_kind = FrameKind.ERROR
        self.blob = memoryview(b"")  # where the BLOB frame announced by a reply lands
        self.blob_fetch: Fetch | None = None
        self.scratch = np.empty(0, dtype=np.uint8)
        self.send_scratch = np.empty(0, dtype=np.uint8)
        # recovery (docs/recovery.md)
        self.pending_state: PeerState | None = None  # a reset peer's state for a call not begun
        self.up_call: CallId | None = None  # the call in progress when the link came up
        self.up_at: CallId = (0, 0)  # where this rank stood then (the "at" of its state)
        # where the link stands (fsm.LINK_PHASES): after a connection comes up nothing of
        # any call is sent until the peer's state arrived (what we send may depend on it, and
        # an answer to it must not be overtaken); a stream held for the peer's "need" waits
        # until it says from which offset it wants it
        self.phase = Phase.UP
        self.incarnation = 0  # of the peer process at the other end
        self.peer_state: PeerState | None = None  # what the peer said when the link came up
        # the call whose "need" this rank sent on the current connection (one per call: a
        # second one would make the peer send its stream again)
        self.need_sent: CallId | None = None
        # a replaying peer's needs for calls this rank has not begun yet (call -> offset)
        self.pending_needs: dict[CallId, int] = {}

    def go(self, event: LinkEvent) -> None:
        """Move the receive mode through :data:`rabit2.core.fsm.LINK_MODES`."""
        try:
            self.mode = LINK_MODES[(self.mode, event)]
        except KeyError:
            link_transition(self.mode, event)  # raises InvalidTransition, with the pair

    def phase_go(self, event: PhaseEvent) -> None:
        """Move the recovery phase through :data:`rabit2.core.fsm.LINK_PHASES`."""
        self.phase = phase_transition(self.phase, event)

    @property
    def up(self) -> bool:
        """Connected (not hung up since it last came up)."""
        return self.phase is not Phase.DOWN

    @property
    def awaiting_state(self) -> bool:
        return self.phase is Phase.GREETING or self.phase is Phase.GREETING_HELD

    @property
    def awaiting_need(self) -> bool:
        return self.phase is Phase.HELD or self.phase is Phase.GREETING_HELD

    def reset_framing(self, pos: int) -> None:
        """A new connection: nothing of the old one's partial frames carries over."""
        self.go(LinkEvent.RESET)
        self.start = self.end = self.filled = self.remaining = 0
        self.expect = -1
        self.frame = None
        self.pos = pos
        self.blob_fetch = None


class Fetch:
    """A request this rank sent with ``fetch`` and the place its answer goes."""

    __slots__ = ("call", "dest", "hi", "hops", "lo", "peer", "replaced", "request", "tried",
                 "what", "whole")

    def __init__(self, request: int, peer: int, what: str, call: CallId, whole: bool,
                 dest: memoryview | None, hops: int = 0, lo: int = 0, hi: int = -1) -> None:
        self.request, self.peer, self.what, self.call = request, peer, what, call
        self.whole = whole  # the whole result or checkpoint, not a byte range of it
        self.lo, self.hi = lo, hi  # the byte range asked for (hi -1: to the end)
        # an unasked result: the sender's stream was skipped because of it (undone if the
        # result is cut off half way)
        self.replaced = False
        self.tried: frozenset[int] = frozenset()  # neighbours asked before, in vain
        self.dest = dest  # None: a blob of the announced size is allocated (checkpoints)
        self.hops = hops  # a pushed local model: how many more ring hops it travels

    @property
    def of_call(self) -> bool:
        """Bytes of a call (its result, or a range of a neighbour's stream of it): the call
        in progress counts it in ``fetching`` while it is out."""
        return self.what in ("result", "stream")


class ActiveCall:
    """Bookkeeping of the call in progress."""

    __slots__ = ("call", "call_id", "deferred", "desc", "fetching", "frames_seen", "has_result",
                 "mirror", "mirrored", "plan", "prefix", "prefix_checked", "refill",
                 "resume_wait", "sent", "skip_in", "started_empty")

    def __init__(self, call: Call, call_id: tuple[int, int], desc: CallDescriptor,
                 plan: Plan) -> None:
        self.call, self.call_id, self.desc, self.plan = call, call_id, desc, plan
        # what every DATA frame of this call starts with, unchecked and checked (frames of
        # unknown-size broadcasts never match them, and take the full parse)
        self.prefix = data_prefix(desc, *call_id, False)
        self.prefix_checked = data_prefix(desc, *call_id, True)
        self.sent = dict.fromkeys(plan.out_streams, 0)
        self.frames_seen = dict.fromkeys(plan.in_streams, 0)
        self.started_empty: set[int] = set()
        # recovery of this call on a restarted rank (docs/recovery.md)
        self.fetching = 0  # fetches whose bytes this call still waits for
        self.has_result = False  # the whole result is fetched: every out-stream can be served
        self.skip_in: set[int] = set()  # in-streams this call does not wait for any more
        # a resume that waits for the needs of neighbours restarted too: peer -> need, or
        # None while it has not come (nothing is sent until every one is in)
        self.resume_wait: dict[int, int | None] | None = None
        # a need this resumed call can serve only once the in-stream bytes its resume
        # skipped are fetched again: (peer, offset, seen), applied when they are in
        self.refill: tuple[int, int, bool] | None = None
        # needs for the out-streams of a broadcast whose size this rank does not know yet
        self.deferred: dict[int, tuple[int, bool]] = {}
        # recovery on, a broadcast's receiver: the retained copy of the stream, made as the
        # bytes arrive (while they are in cache, and while the sender is still sending)
        self.mirror: np.ndarray | None = None
        self.mirrored = 0

    def needs_input(self, peer: int) -> bool:
        """The call still waits for bytes (or the first, announcing frame) from ``peer``."""
        if peer in self.skip_in:
            return False
        stream = self.plan.in_streams.get(peer)
        return stream is not None and (
            self.plan.received[peer] < stream.length or self.frames_seen[peer] == 0
        )

    def needs(self, peer: int) -> bool:
        """The call still needs the link to ``peer``: input from it, or output to it."""
        if self.needs_input(peer):
            return True
        out = self.plan.out_streams.get(peer)
        if out is None:
            return False
        if out.length == 0:
            return peer not in self.started_empty
        return self.sent.get(peer, 0) < out.length
