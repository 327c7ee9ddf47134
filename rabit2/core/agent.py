"""The Rabit-style agent: one rank's sans-I/O core.

The I/O layer owns sockets and a loop; it feeds the agent events and executes the commands the
agent returns.  Received bytes go straight where the agent says (:meth:`Agent.recv_buffer`
returns a view of the destination: the link's staging buffer, the user's array or a link's
scratch), so the hot path copies nothing but the few bytes that arrive with a header.

    begin(call) | on_bytes(peer, n) | on_hangup(peer) | on_tick(now) | abort(reason)
        ->  [Send | PauseReading | ResumeReading | CallComplete | CallFailed | CloseLink]

Every state change goes through :func:`rabit2.core.fsm.transition`.  Time is an argument
(``now``, seconds on any monotonic clock); the agent never reads a clock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from rabit2.core import fsm
from rabit2.core.control import decode_body, encode_body
from rabit2.core.framing import (
    CALL_PREFIX_SIZE,
    HEADER_SIZE,
    MAX_BROADCAST,
    MAX_PAYLOAD,
    NONE_U8,
    NONE_U16,
    UNKNOWN_TOTAL,
    CallDescriptor,
    CollectiveKind,
    FrameHeader,
    FrameKind,
    data_prefix,
    decode_error,
    encode_error,
    pack_header,
    parse_header,
    unpack_tail,
)
from rabit2.core.ops import Op, dtype_code
from rabit2.core.recovery import (
    DEFAULT_RETAIN_BYTES,
    GENERATIONS,
    CallId,
    PeerState,
    ResultStore,
    Role,
    call_id,
    checkpoint_version,
    descriptor_from_wire,
    descriptor_to_wire,
    role_of,
)
from rabit2.core.schedule import (
    PairExchange,
    PayloadFn,
    Plan,
    RingAllgather,
    RingAllreduce,
    TreeAllreduce,
    TreeBroadcast,
)
from rabit2.core.topology import broadcast_route, topology
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RabitError,
    UnrecoverableError,
)

State, Event = fsm.State, fsm.Event

_ERROR_CLASSES: dict[str, type[RabitError]] = {
    "mismatch": MismatchError,
    "peer_lost": PeerLostError,
    "protocol": ProtocolError,
    "timeout": CollectiveTimeoutError,
    "aborted": JobAbortedError,
    "unrecoverable": UnrecoverableError,
}
_ERROR_NAMES = {cls: name for name, cls in _ERROR_CLASSES.items()}


# ----------------------------------------------------------------------------- commands


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Write these buffers, in order, to the link to ``peer`` (header first)."""

    peer: int
    buffers: list[bytes | memoryview]


@dataclasses.dataclass(frozen=True, slots=True)
class PauseReading:
    peer: int


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeReading:
    peer: int


@dataclasses.dataclass(frozen=True, slots=True)
class CallComplete:
    """The current call finished on this rank; ``call_id`` = (version, seqno)."""

    call_id: tuple[int, int]


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


@dataclasses.dataclass(frozen=True, slots=True)
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


_NO_CALL = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, NONE_U16, 0)
"""The descriptor of frames that belong to no call (ERROR, CONTROL)."""

_RESUME_EVENTS = {
    CollectiveKind.ALLREDUCE_TREE: Event.RESUME_ALLREDUCE,
    CollectiveKind.ALLREDUCE_RING: Event.RESUME_ALLREDUCE,
    CollectiveKind.ALLREDUCE_PAIR: Event.RESUME_ALLREDUCE,
    CollectiveKind.BROADCAST: Event.RESUME_BROADCAST,
    CollectiveKind.ALLGATHER: Event.RESUME_ALLGATHER,
}

_CALL_EVENTS = {
    CollectiveKind.ALLREDUCE_TREE: Event.CALL_ALLREDUCE,
    CollectiveKind.ALLREDUCE_RING: Event.CALL_ALLREDUCE,
    CollectiveKind.ALLREDUCE_PAIR: Event.CALL_ALLREDUCE,
    CollectiveKind.BROADCAST: Event.CALL_BROADCAST,
    CollectiveKind.ALLGATHER: Event.CALL_ALLGATHER,
}


STAGE_SIZE = 16 * 1024  # holds a small call whole; larger payloads land zero-copy
"""Per-link staging buffer for frame headers and the payload bytes that arrive with them."""


class _Mode(enum.Enum):
    HEADER = 1
    PAYLOAD = 2
    BODY = 3  # the msgpack payload of an ERROR or CONTROL frame
    HELD = 4  # a header of a later call was read; the link is paused until that call starts
    BLOB = 5  # the raw bytes a "reply" announced, landing where the fetch said


class _Link:
    """Receive-side framing state of one peer link."""

    __slots__ = ("awaiting_need", "awaiting_state", "blob", "blob_fetch", "body_kind", "end",
                 "error_buf", "filled", "frame", "incarnation", "mode", "pending", "pos",
                 "remaining", "scratch", "send_scratch", "stage", "start", "state", "up",
                 "up_at", "up_call")

    def __init__(self) -> None:
        # headers are read into this staging buffer together with whatever follows them, so
        # a small frame costs one read instead of two; bytes [start, end) are not consumed
        self.stage = memoryview(bytearray(STAGE_SIZE))
        self.start = 0
        self.end = 0
        self.mode = _Mode.HEADER
        self.filled = 0
        self.frame: FrameHeader | None = None
        self.pos = 0  # stream position of the next payload byte
        self.remaining = 0  # payload bytes left in the current frame
        self.error_buf = bytearray()  # the body of an ERROR or CONTROL frame
        self.body_kind = FrameKind.ERROR
        self.blob = memoryview(b"")  # where the BLOB frame announced by a reply lands
        self.blob_fetch: _Fetch | None = None
        self.scratch = np.empty(0, dtype=np.uint8)
        self.send_scratch = np.empty(0, dtype=np.uint8)
        # recovery (docs/recovery.md)
        self.pending: PeerState | None = None  # a reset peer's state for a call not begun
        self.up_call: CallId | None = None  # the call in progress when the link came up
        self.up_at: CallId = (0, 0)  # where this rank stood then (the "at" of its state)
        self.up = True  # connected; False after a hang-up until the link comes up again
        self.incarnation = 0  # of the peer process at the other end
        self.state: PeerState | None = None  # what the peer said when the link came up
        # the link came up during a call: send nothing of that call until the peer says
        # from which offset it needs our stream (its "need")
        self.awaiting_need = False
        # the link just came up: send nothing of any call until the peer's state arrived
        # (what we send may depend on it, and an answer to it must not be overtaken)
        self.awaiting_state = False

    def reset_framing(self, pos: int) -> None:
        """A new connection: nothing of the old one's partial frames carries over."""
        self.mode = _Mode.HEADER
        self.start = self.end = self.filled = self.remaining = 0
        self.frame = None
        self.pos = pos
        self.blob_fetch = None


class _Fetch:
    """A request this rank sent with ``fetch`` and the place its answer goes."""

    __slots__ = ("call", "dest", "hops", "peer", "request", "what", "whole")

    def __init__(self, request: int, peer: int, what: str, call: CallId, whole: bool,
                 dest: memoryview | None, hops: int = 0) -> None:
        self.request, self.peer, self.what, self.call = request, peer, what, call
        self.whole = whole  # the whole result or checkpoint, not a byte range of it
        self.dest = dest  # None: a blob of the announced size is allocated (checkpoints)
        self.hops = hops  # a pushed local model: how many more ring hops it travels


class _Active:
    """Bookkeeping of the call in progress."""

    __slots__ = ("call", "call_id", "deferred", "desc", "fetching", "final", "frames_seen",
                 "plan", "prefix", "sent", "skip_in", "started_empty")

    def __init__(self, call: Call, call_id: tuple[int, int], desc: CallDescriptor,
                 plan: Plan) -> None:
        self.call, self.call_id, self.desc, self.plan = call, call_id, desc, plan
        # what every DATA frame of this call starts with (unknown-size broadcasts never
        # match it, and take the full parse)
        self.prefix = data_prefix(desc, *call_id)
        self.sent = dict.fromkeys(plan.out_streams, 0)
        self.frames_seen = dict.fromkeys(plan.in_streams, 0)
        self.started_empty: set[int] = set()
        # recovery of this call on a restarted rank (docs/recovery.md)
        self.fetching = 0  # fetches whose bytes this call still waits for
        self.final = False  # the whole result is fetched: every out-stream can be served
        self.skip_in: set[int] = set()  # in-streams this call does not wait for any more
        # needs for the out-streams of a broadcast whose size this rank does not know yet
        self.deferred: dict[int, tuple[int, bool]] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class AgentStats:
    """A frozen snapshot of counters, for humans and tests."""

    state: str
    calls_completed: int
    bytes_sent: int
    bytes_received: int
    frames_sent: int
    frames_received: int


class Agent:
    """One rank's agent.  Not thread-safe: the I/O layer calls it from its loop thread only."""

    def __init__(
        self,
        *,
        ring_mincount: int = 32768,
        tree_chunk: int = 1 << 20,
        timeout: float = 1800.0,
        recover: bool = False,
        recover_timeout: float = 300.0,
        retain_bytes: int = DEFAULT_RETAIN_BYTES,
        local_replica: int = 2,
    ) -> None:
        """``recover``: a lost link the call needs makes the call wait (up to
        ``recover_timeout`` seconds) for the peer's replacement instead of failing, and
        every finished call's result is kept for replay (``docs/recovery.md``)."""
        self.state = State.IDLE
        self.rank = 0
        self.world = 1
        self.ring_mincount = ring_mincount
        self.tree_chunk = tree_chunk
        self.timeout = timeout
        self.version = 0
        self.seqno = 0
        self.links: dict[int, _Link] = {}
        self.dead_links: dict[int, str] = {}
        self._discard = memoryview(bytearray(64 * 1024))
        self.active: _Active | None = None
        self.error: RabitError | None = None
        self.last_progress = 0.0
        self._calls_completed = 0
        self._bytes_sent = 0
        self._bytes_received = 0
        self._frames_sent = 0
        self._frames_received = 0
        # recovery
        self.recover = recover
        self.recover_timeout = recover_timeout
        self.incarnation = 0
        self.results = ResultStore(retain_bytes)
        self.checkpoints: dict[int, bytes | Callable[[], bytes]] = {}
        # local models: (owner rank, version) -> blob, this rank's own and those the ring
        # handed on from the ``local_replica`` ranks before it
        self.local_replica = local_replica
        self.local_models: dict[tuple[int, int], bytes] = {}
        self._loading: dict[str, Any] = {}  # a restarted rank's checkpoint, as it arrives
        self.down_since: dict[int, float] = {}  # lost links the job waits to come back
        # a restarted rank: what each neighbour said when its link came up
        self.peer_states: dict[int, PeerState] = {}
        self.restarted = False
        self._replay_until: CallId = (0, 0)  # calls before this were finished by a neighbour
        self._fetches: dict[int, _Fetch] = {}
        self._next_request = 1
        self._pending_states = False  # some link holds a reset peer's state for a later call
        self._recovery_stats = {"links_up": 0, "fetched_bytes": 0, "resent_bytes": 0,
                                "replayed_calls": 0, "resumed_calls": 0}

    # ------------------------------------------------------------------ lifecycle events

    def _go(self, event: fsm.Event) -> None:
        self.state = fsm.transition(self.state, event)

    def start(self) -> None:
        self._go(Event.START)

    def connect_tracker(self, rank: int, world: int) -> None:
        """The tracker assigned our rank: the topology and the set of links follow."""
        if not 0 <= rank < world:
            raise ProtocolError(f"tracker assigned rank {rank} of {world}")
        self._go(Event.CONNECT_TRACKER)
        self.rank, self.world = rank, world
        self.links = {p: _Link() for p in topology(rank, world).neighbors}

    def connect_peers(self) -> None:
        self._go(Event.CONNECT_PEERS)

    def accept_peers(self, now: float) -> None:
        self._go(Event.ACCEPT_PEERS)
        self.last_progress = now

    def bootstrap_failed(self, error: RabitError) -> None:
        self._go(Event.OP_FAILED)
        self.error = error

    def shutdown(self) -> list[Command]:
        """Leave the job.  A call still in progress (its caller gave up) fails first."""
        cmds: list[Command] = []
        if self.active is not None:
            self._fail(PeerLostError(f"rank {self.rank} finalized during a call"), cmds)
        self._go(Event.SHUTDOWN)
        return cmds

    # ------------------------------------------------------------------ receive side

    def recv_buffer(self, peer: int) -> memoryview:
        """Where the next bytes from ``peer`` must land (never empty)."""
        if self.error is not None:
            return self._discard  # after a failure nothing read from a peer is used
        link = self.links[peer]
        mode = link.mode
        if mode is _Mode.PAYLOAD:
            active = self.active
            assert active is not None
            return active.plan.in_streams[peer].view(link.pos, link.remaining)
        if mode is _Mode.BODY:
            return memoryview(link.error_buf)[link.filled :]
        if mode is _Mode.BLOB:
            return link.blob[link.filled : link.filled + link.remaining]
        # HEADER (HELD only if the loop delivers bytes it read before the pause took effect,
        # which on_bytes reports as a protocol breach)
        return link.stage[link.end :]

    def discard_buffer(self) -> memoryview:
        """Where bytes of a connection that was replaced go (they are never looked at)."""
        return self._discard

    def on_bytes(self, peer: int, nbytes: int, now: float) -> list[Command]:
        """``nbytes`` landed in the buffer returned by the last :meth:`recv_buffer`."""
        self._go(Event.READABLE)
        if self.state in (State.FAILED, State.TASK_COMPLETE):
            return []
        link = self.links[peer]
        cmds: list[Command] = []
        try:
            if link.mode is _Mode.PAYLOAD:
                self._bytes_received += nbytes  # payload only, like bytes_sent
                self.last_progress = now
                link.pos += nbytes
                link.remaining -= nbytes
                active = self.active
                assert active is not None
                self._received(active.plan, peer, link.pos)
                if link.remaining == 0:
                    link.mode = _Mode.HEADER
                    link.filled = 0
                self._pump(active, cmds)
                self._maybe_complete(active, cmds)
            elif link.mode is _Mode.HEADER:
                link.end += nbytes
                self._drain(peer, link, now, cmds)
            elif link.mode is _Mode.BODY:
                link.filled += nbytes
                if link.filled == len(link.error_buf):
                    link.mode, link.filled = _Mode.HEADER, 0
                    self._on_body(peer, link, now, cmds)
                else:
                    return cmds
                self._drain(peer, link, now, cmds)
            elif link.mode is _Mode.BLOB:
                self.last_progress = now
                link.filled += nbytes
                link.remaining -= nbytes
                if not link.remaining:
                    self._blob_done(peer, link, cmds)
                    self._drain(peer, link, now, cmds)
            else:
                raise ProtocolError(f"bytes from rank {peer} while its link is held")
        except ProtocolError as exc:
            self._fail(exc, cmds, source=peer, close=peer)
        except (MismatchError, UnrecoverableError) as exc:
            self._fail(exc, cmds)  # the peer that disagrees must hear it too
        return cmds

    def _drain(self, peer: int, link: _Link, now: float, cmds: list[Command]) -> None:
        """Consume every complete frame in the staging buffer (and the payload with it)."""
        stage = link.stage
        while link.mode is _Mode.HEADER and link.end - link.start >= HEADER_SIZE:
            start = link.start
            active = self.active
            link.start += HEADER_SIZE
            self._frames_received += 1
            if active is not None and stage[start : start + CALL_PREFIX_SIZE] == active.prefix:
                # fast path: a DATA frame of the current call (the common case)
                offset, length, _ = unpack_tail(stage, start)
                self._accept_data(peer, link, offset, length, active, now, cmds)
            else:
                frame = parse_header(stage[start : start + HEADER_SIZE])
                self._dispatch_header(peer, link, frame, now, cmds)
            self._take_staged(peer, link, now, cmds)
            if self.error is not None:
                return
            active = self.active
            if active is not None:  # finish this call before looking at the next frame
                self._pump(active, cmds)
                self._maybe_complete(active, cmds)
        if link.mode is _Mode.HELD:
            return  # the held frame's payload stays staged until its call starts
        if link.start == link.end:
            link.start = link.end = 0
        elif link.start:
            # keep the partial header, at the front so the next read has room
            size = link.end - link.start
            stage[:size] = stage[link.start : link.end]
            link.start, link.end = 0, size
        # (every frame consumed above was followed by a pump; a partial header changes nothing)

    def _take_staged(self, peer: int, link: _Link, now: float, cmds: list[Command]) -> None:
        """Move the staged bytes of the current frame's payload where they belong."""
        avail = link.end - link.start
        if not avail:
            return
        if link.mode is _Mode.PAYLOAD:
            active = self.active
            assert active is not None
            plan = active.plan
            take = min(avail, link.remaining)
            left = take
            while left:
                # the plan may lay out the rest of its stream once a piece is complete
                dest = plan.in_streams[peer].view(link.pos, left)
                n = len(dest)
                dest[:] = link.stage[link.start : link.start + n]
                link.start += n
                link.pos += n
                left -= n
                self._received(plan, peer, link.pos)
            link.remaining -= take
            self._bytes_received += take
            self.last_progress = now
            if not link.remaining:
                link.mode = _Mode.HEADER
        elif link.mode is _Mode.BODY:
            take = min(avail, len(link.error_buf) - link.filled)
            link.error_buf[link.filled : link.filled + take] = link.stage[
                link.start : link.start + take
            ]
            link.start += take
            link.filled += take
            if link.filled == len(link.error_buf):
                link.mode, link.filled = _Mode.HEADER, 0
                self._on_body(peer, link, now, cmds)
        elif link.mode is _Mode.BLOB:
            take = min(avail, link.remaining)
            link.blob[link.filled : link.filled + take] = link.stage[
                link.start : link.start + take
            ]
            link.start += take
            link.filled += take
            link.remaining -= take
            if not link.remaining:
                self._blob_done(peer, link, cmds)

    @staticmethod
    def _received(plan: Plan, peer: int, pos: int) -> None:
        try:
            plan.on_received(peer, pos)
        except (ValueError, TypeError, MemoryError) as exc:
            # a broadcast head that names no valid array, or a size that cannot be allocated
            raise ProtocolError(f"cannot place the data from rank {peer}: {exc}") from None

    def _dispatch_header(self, peer: int, link: _Link, frame: FrameHeader, now: float,
                         cmds: list[Command]) -> None:
        if frame.kind in (FrameKind.ERROR, FrameKind.CONTROL):
            if not frame.length:
                raise ProtocolError(f"empty {frame.kind.name.lower()} frame from rank {peer}")
            link.error_buf = bytearray(frame.length)
            link.body_kind = frame.kind
            link.mode, link.filled = _Mode.BODY, 0
            return
        if frame.kind is FrameKind.BLOB:
            fetch = link.blob_fetch
            if fetch is None or frame.length != len(link.blob):
                raise ProtocolError(f"rank {peer} sent a blob of {frame.length} B that no "
                                    "reply announced")
            link.mode, link.filled, link.remaining = _Mode.BLOB, 0, frame.length
            return
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if frame.call_id < current:
            # the peer is still in a call this rank has finished or never made
            raise self._diverged(peer, frame.call_id, current)
        if frame.call_id > current or active is None:
            if active is not None and self._needs_input(active, peer):
                # TCP keeps a peer's frames in order and a peer finishes sending a call before
                # it starts the next one: a later call's frame while this call still waits
                # for that peer's bytes means the ranks' call sequences diverged (an extra
                # collective or checkpoint on one side); waiting would hang until the deadline
                raise self._diverged(peer, frame.call_id, current)
            link.mode, link.frame = _Mode.HELD, frame
            cmds.append(PauseReading(peer))
            return
        self._accept_frame(peer, link, frame, active, now, cmds)

    def _on_body(self, peer: int, link: _Link, now: float, cmds: list[Command]) -> None:
        """A whole ERROR or CONTROL payload arrived."""
        body = bytes(link.error_buf)
        if link.body_kind is FrameKind.ERROR:
            error_type, reason, origin = decode_error(body)
            self._remote_error(peer, error_type, reason, origin, cmds)
            return
        msg = decode_body(body)
        kind = msg["t"]
        if kind == "state":
            self._on_state(peer, link, PeerState.from_msg(msg), now, cmds)
        elif kind == "need":
            self._on_need(peer, link, call_id(msg["call"], "need.call"), msg["from"], cmds)
        elif kind == "fetch":
            self._on_fetch(peer, msg, cmds)
        elif kind == "reply":
            self._on_reply(peer, link, msg, cmds)
        elif kind == "local":
            self._on_local(peer, link, msg, cmds)
        else:
            raise ProtocolError(f"rank {peer} sent a {kind!r} message on a peer link")

    def _diverged(self, peer: int, theirs: tuple[int, int], ours: tuple[int, int]) -> MismatchError:
        return MismatchError(
            f"sequence mismatch: rank {peer} is at call {theirs} (version, seqno) while rank "
            f"{self.rank} is at call {ours}: the ranks made different sequences of collectives "
            "or checkpoints"
        )

    @staticmethod
    def _needs_input(active: _Active, peer: int) -> bool:
        if peer in active.skip_in:
            return False
        stream = active.plan.in_streams.get(peer)
        return stream is not None and (
            active.plan.received[peer] < stream.length or active.frames_seen[peer] == 0
        )

    def _size_broadcast(self, plan: TreeBroadcast, frame: FrameHeader, active: _Active) -> None:
        """The first frame from the root's side says how large the broadcast is."""
        total = frame.call.total_bytes
        if total == UNKNOWN_TOTAL or total > MAX_BROADCAST:
            raise ProtocolError(f"broadcast size {total} from the wire is out of bounds")
        if frame.call.root != active.desc.root or frame.call.kind is not active.desc.kind:
            return  # the descriptor check reports the mismatch
        self._size_to(plan, total, active)

    def _size_to(self, plan: TreeBroadcast, total: int, active: _Active) -> None:
        try:
            plan.size(total)
        except (ValueError, TypeError, MemoryError) as exc:
            raise ProtocolError(f"broadcast of {total} B: {exc}") from None
        active.desc = dataclasses.replace(active.desc, total_bytes=total)
        active.prefix = data_prefix(active.desc, *active.call_id)
        for peer in plan.out_streams:
            active.sent.setdefault(peer, 0)
        deferred, active.deferred = active.deferred, {}
        for peer, (offset, seen) in deferred.items():
            self._apply_need(active, peer, offset, [], seen=seen)

    def _accept_frame(self, peer: int, link: _Link, frame: FrameHeader, active: _Active,
                      now: float, cmds: list[Command]) -> None:
        plan = active.plan
        if (isinstance(plan, TreeBroadcast) and not plan.sized and peer == plan.in_link
                and frame.kind is FrameKind.DATA):
            self._size_broadcast(plan, frame, active)
        if not frame.call.agrees_with(active.desc):
            raise MismatchError(
                f"collective mismatch at call {active.call_id}: rank {self.rank} called "
                f"{active.desc.describe()} but rank {peer} called {frame.call.describe()}"
            )
        self._accept_data(peer, link, frame.offset, frame.length, active, now, cmds)

    def _accept_data(self, peer: int, link: _Link, offset: int, length: int, active: _Active,
                     now: float, cmds: list[Command]) -> None:
        """A DATA frame of the current call: check where it goes before anything lands."""
        stream = active.plan.in_streams.get(peer)
        if stream is None:
            raise ProtocolError(
                f"rank {peer} sent data on a link that call {active.call_id} does not use"
            )
        if offset != link.pos:
            raise ProtocolError(f"rank {peer} sent offset {offset}, expected {link.pos}")
        if length > stream.length - link.pos:
            raise ProtocolError(
                f"rank {peer} sent {length} B at offset {offset} of a {stream.length} B stream"
            )
        active.frames_seen[peer] += 1
        self.last_progress = now
        if length:
            link.mode, link.remaining = _Mode.PAYLOAD, length
        else:
            link.mode = _Mode.HEADER
            self._maybe_complete(active, cmds)

    # ------------------------------------------------------------------ calls

    def descriptor(self, call: Call) -> CallDescriptor:
        dtype = dtype_code(call.dtype) if call.dtype is not None else NONE_U8
        op = int(call.op) if call.op is not None else NONE_U8
        root = call.root if call.kind is CollectiveKind.BROADCAST else NONE_U16
        if call.receive is not None:
            total = UNKNOWN_TOTAL
        elif call.pieces:
            total = sum(len(p) for p in call.pieces)
        else:
            total = len(call.buf)
        return CallDescriptor(call.kind, dtype, op, root, total)

    def choose_allreduce(self, nbytes: int, itemsize: int) -> CollectiveKind:
        """Tree for small calls, ring above ``rabit_reduce_ring_mincount`` elements (rabit).

        At world size 2 the tree degenerates into a relay through rank 0; a direct exchange
        does the same work in one hop instead of two.
        """
        if self.world > 1 and nbytes // itemsize > self.ring_mincount:
            return CollectiveKind.ALLREDUCE_RING
        if self.world == 2:
            return CollectiveKind.ALLREDUCE_PAIR
        return CollectiveKind.ALLREDUCE_TREE

    def begin(self, call: Call, now: float) -> list[Command]:
        """Start a collective.  Raises the recorded error if the agent has failed."""
        if self.state is State.FAILED:
            assert self.error is not None
            raise self.error
        event = _CALL_EVENTS[call.kind]
        fsm.transition(self.state, event)  # refuse before building anything
        plan = self._plan(call)  # may raise ValueError; the agent is unchanged then
        desc = self.descriptor(call)
        self._go(event)
        call_id = (self.version, self.seqno)
        self.seqno += 1
        active = _Active(call, call_id, desc, plan)
        self.active = active
        self.last_progress = now
        cmds: list[Command] = []
        if not self.recover:
            for peer in self.dead_links:
                if peer in plan.in_streams or peer in plan.out_streams:
                    self._fail(self._lost(peer), cmds, source=peer)
                    return cmds
        for link in self.links.values():
            link.pos = 0
            link.awaiting_need = False  # it was about the call that ended before this one
            if link.mode is not _Mode.BLOB:
                link.remaining = 0
        try:
            if self.restarted:
                self._begin_replay(active, cmds)
            for peer, link in self.links.items() if self._pending_states else ():
                state, link.pending = link.pending, None
                if state is not None and state.at == call_id and link.up:
                    # a peer whose link was reset waits in this call; if we were behind when
                    # the link came up it waits to hear that we hold none of its stream
                    self._apply_need(active, peer, state.need, cmds, seen=state.seen)
                    if link.up_at < call_id and peer in plan.in_streams:
                        self._send_control(peer, {"t": "need", "call": list(call_id),
                                                  "from": 0}, cmds)
        except RabitError as exc:
            self._fail(exc, cmds)
            return cmds
        self._pending_states = any(link.pending is not None for link in self.links.values())
        # frames of this call that arrived early were held: replay their headers now
        for peer, link in self.links.items():
            if link.mode is _Mode.HELD:
                assert link.frame is not None
                if link.frame.call_id == call_id:
                    link.mode = _Mode.HEADER
                    try:
                        self._accept_frame(peer, link, link.frame, active, now, cmds)
                        self._take_staged(peer, link, now, cmds)
                        self._drain(peer, link, now, cmds)
                    except (MismatchError, UnrecoverableError) as exc:
                        self._fail(exc, cmds)
                        return cmds
                    except ProtocolError as exc:
                        self._fail(exc, cmds, source=peer, close=peer)
                        return cmds
                    cmds.append(ResumeReading(peer))
                elif link.frame.call_id < call_id or self._needs_input(active, peer):
                    # this rank skipped the call that frame belongs to, or the peer already
                    # moved past this call although this call needs its bytes
                    self._fail(self._diverged(peer, link.frame.call_id, call_id), cmds)
                    return cmds
        if self.active is not active:
            return cmds
        if self.dead_links and any(not self.links[p].up and self._needs_input(active, p)
                                   for p in plan.in_streams):
            self._go(Event.PEER_DOWN)  # a lost neighbour's input: wait for its replacement
        self._pump(active, cmds)
        self._maybe_complete(active, cmds)
        return cmds

    def _plan(self, call: Call) -> Plan:
        kind = call.kind
        if self.world == 1:
            return TreeBroadcast([call.buf], -1, ())  # no links: every call is already complete
        if kind in (CollectiveKind.ALLREDUCE_TREE, CollectiveKind.ALLREDUCE_RING,
                    CollectiveKind.ALLREDUCE_PAIR):
            assert call.dtype is not None and call.op is not None
            if kind is CollectiveKind.ALLREDUCE_PAIR:
                if self.world != 2:
                    raise ValueError("the pair exchange needs a world of exactly 2")
                return PairExchange(call.buf, call.dtype, call.op, self.rank, 1 - self.rank,
                                    self._scratch, self._send_scratch)
            if kind is CollectiveKind.ALLREDUCE_RING:
                stage = self._send_scratch if self.recover and self.world == 2 else None
                return RingAllreduce(call.buf, call.dtype, call.op, self.rank, self.world,
                                     self._scratch, stage)
            topo = topology(self.rank, self.world)
            # with recovery on, the root's children stage its result (docs/recovery.md)
            return TreeAllreduce(call.buf, call.dtype, call.op, topo.parent, topo.children,
                                 self._scratch, self.tree_chunk,
                                 stage_down=self.recover and topo.parent == 0)
        if kind is CollectiveKind.BROADCAST:
            in_link, out_links = broadcast_route(self.rank, call.root, self.world)
            if call.receive is not None and in_link < 0:
                raise ValueError("the root of a broadcast must know what it sends")
            return TreeBroadcast(list(call.pieces) or [call.buf], in_link, out_links,
                                 call.receive, call.head_size)
        return RingAllgather(call.buf, call.blocks, self.rank, self.world)

    def _scratch(self, peer: int, nbytes: int) -> memoryview:
        link = self.links[peer]
        if link.scratch.nbytes < nbytes:
            link.scratch = np.empty(nbytes, dtype=np.uint8)
        return link.scratch.data[:nbytes]

    def _send_scratch(self, peer: int, nbytes: int) -> memoryview:
        link = self.links[peer]
        if link.send_scratch.nbytes < nbytes:
            link.send_scratch = np.empty(nbytes, dtype=np.uint8)
        return link.send_scratch.data[:nbytes]

    def _pump(self, active: _Active, cmds: list[Command]) -> None:
        """Send every out-stream byte that has become ready."""
        if active.fetching:
            return  # a restarted rank sends nothing until the result it resumes from is in
        plan = active.plan
        desc = active.desc
        version, seqno = active.call_id
        final = active.final
        links = self.links
        for peer, stream in plan.out_streams.items():
            link = links[peer]
            if link.awaiting_need or link.awaiting_state or not link.up:
                continue
            sent = active.sent.get(peer, 0)
            if stream.length == 0:
                if peer not in active.started_empty:
                    active.started_empty.add(peer)
                    header = pack_header(FrameKind.DATA, desc, version, seqno, 0, 0)
                    cmds.append(Send(peer, [header]))
                    self._frames_sent += 1
                continue
            ready = stream.length if final else plan.out_ready(peer)
            while ready > sent:
                end = min(ready, sent + MAX_PAYLOAD)  # a frame's length is a u32
                header = pack_header(FrameKind.DATA, desc, version, seqno, sent, end - sent)
                cmds.append(Send(peer, [header, *stream.views(sent, end)]))
                self._bytes_sent += end - sent
                self._frames_sent += 1
                sent = end
            active.sent[peer] = sent

    def _maybe_complete(self, active: _Active, cmds: list[Command]) -> None:
        if self.active is not active:
            return  # already completed (or failed) earlier in this event
        if active.fetching:
            return
        plan = active.plan
        if not active.skip_in:
            if not plan.receiving_done():
                return
            if any(n == 0 for n in active.frames_seen.values()):
                return
        elif any(self._needs_input(active, p) for p in plan.in_streams):
            return
        for peer, stream in plan.out_streams.items():
            link = self.links[peer]
            if link.awaiting_need or link.awaiting_state:
                # a replacement is connected and about to say what it needs of this call:
                # answer that before moving on, so no later frame overtakes the answer
                return
            if not link.up:
                continue  # a lost peer's share is served later, from the retained result
            if active.sent.get(peer, 0) != stream.length:
                return
            if stream.length == 0 and peer not in active.started_empty:
                return
        self.active = None
        self._calls_completed += 1
        if self.recover:
            self.results.add(active.call_id, active.desc, self._result_pieces(active))
        self._go(Event.OP_COMPLETE)
        cmds.append(CallComplete(active.call_id))

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, blob: bytes | Callable[[], bytes] | None = None) -> int:
        """Start a new version: sequence numbers restart at zero (rabit's call identity).

        With recovery on, ``blob`` (the pickled global model, or a function that pickles it
        when a restarted neighbour asks) is kept for :data:`GENERATIONS` versions, and so
        are the results of the calls made in them."""
        if self.active is not None:
            raise RabitError("checkpoint inside a collective")
        self.version += 1
        self.seqno = 0
        if self.recover:
            if blob is not None:
                self.checkpoints[self.version] = blob
            for old in [v for v in self.checkpoints if v <= self.version - GENERATIONS]:
                del self.checkpoints[old]
            self.results.on_checkpoint(self.version)
        return self.version

    def push_local(self, local: bytes) -> list[Command]:
        """With recovery on, hand this rank's local model of the current version to the next
        ``local_replica`` ranks of the ring (not waited for: see ``load_checkpoint``)."""
        cmds: list[Command] = []
        self._keep_local(self.rank, self.version, local)
        if self.recover:
            for peer, hops in self._replica_targets():
                if self.links[peer].up:
                    self._send_local(peer, self.rank, self.version, hops, local, cmds)
        return cmds

    def _replica_targets(self) -> list[tuple[int, int]]:
        """Where this rank's local model goes first, and how far on from there: the next
        rank of the ring (it passes it on along the ring while ``hops`` > 1) and, from
        ``local_replica`` 2 on, the previous one - so that both ring neighbours of a lost
        rank hold its local model, and either can serve its replacement."""
        k = self.local_replica
        if self.world == 1 or k < 1:
            return []
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if k == 1 or prev == nxt:
            return [(nxt, k)]
        return [(nxt, k - 1), (prev, 1)]

    def _keep_local(self, owner: int, version: int, blob: bytes) -> None:
        self.local_models[(owner, version)] = blob
        for key in [k for k in self.local_models
                    if k[0] == owner and k[1] <= version - GENERATIONS]:
            del self.local_models[key]

    def _send_local(self, peer: int, owner: int, version: int, hops: int, blob: bytes,
                    cmds: list[Command]) -> None:
        self._send_control(peer, {"t": "local", "owner": owner, "version": version,
                                  "hops": hops, "size": len(blob)}, cmds)
        if blob:
            header = pack_header(FrameKind.BLOB, _NO_CALL, version, 0, 0, len(blob),
                                 self.incarnation)
            cmds.append(Send(peer, [header, blob]))
            self._frames_sent += 1

    def _on_local(self, peer: int, link: _Link, msg: dict[str, Any],
                  cmds: list[Command]) -> None:
        size, owner, version, hops = msg["size"], msg["owner"], msg["version"], msg["hops"]
        if not (0 <= size <= MAX_BROADCAST and 0 <= owner < self.world and version >= 0
                and hops >= 1):
            raise ProtocolError(f"rank {peer} hands on a malformed local model")
        fetch = _Fetch(0, peer, "replica", (version, owner), True,
                       memoryview(bytearray(size)), hops)
        link.blob, link.blob_fetch = fetch.dest or memoryview(b""), fetch
        if not size:
            self._blob_done(peer, link, cmds)

    def _stored_local(self, peer: int, fetch: _Fetch, cmds: list[Command]) -> None:
        """A local model handed on along the ring arrived: keep it and pass it on."""
        assert fetch.dest is not None
        version, owner = fetch.call
        blob = bytes(fetch.dest)
        self._keep_local(owner, version, blob)
        nxt = (self.rank + 1) % self.world
        if fetch.hops > 1 and nxt != owner and self.links[nxt].up:
            self._send_local(nxt, owner, version, fetch.hops - 1, blob, cmds)
        del peer

    # ------------------------------------------------------------------ failures

    def on_hangup(self, peer: int, reason: str, now: float) -> list[Command]:
        """The link to ``peer`` closed or failed."""
        self._go(Event.HANGUP)
        cmds: list[Command] = []
        if peer in self.dead_links or self.state in (State.FAILED, State.TASK_COMPLETE):
            return cmds
        self.dead_links[peer] = reason
        active = self.active
        if not self.recover:
            # a peer that finished its last call closes its links; that is only an error if
            # the call in progress still needs that link
            if active is not None and self._needs(active, peer):
                self._fail(self._lost(peer), cmds, source=peer)
            return cmds
        link = self.links[peer]
        link.up = False
        link.awaiting_need = False
        self.down_since[peer] = now
        try:
            for fetch in [f for f in self._fetches.values() if f.peer == peer]:
                self._refetch(fetch, cmds)
        except RabitError as exc:
            self._fail(exc, cmds)
            return cmds
        if active is not None and self.active is active:
            if self._needs_input(active, peer):
                if self.state is not State.PEER_ERROR:
                    self._go(Event.PEER_DOWN)  # wait for the replacement, only on this input
            else:
                self._maybe_complete(active, cmds)  # its share is served later, if at all
        return cmds

    def _lost(self, peer: int) -> PeerLostError:
        return PeerLostError(
            f"rank {self.rank}: link to rank {peer} lost ({self.dead_links[peer]})"
        )

    @staticmethod
    def _needs(active: _Active, peer: int) -> bool:
        if Agent._needs_input(active, peer):
            return True
        out = active.plan.out_streams.get(peer)
        if out is None:
            return False
        if out.length == 0:
            return peer not in active.started_empty
        return active.sent.get(peer, 0) < out.length

    def on_tick(self, now: float) -> list[Command]:
        """Check the deadlines: no byte moved for ``timeout`` seconds, or a lost input not
        back within ``recover_timeout``, fails the call."""
        self._go(Event.TIMEOUT)
        cmds: list[Command] = []
        active = self.active
        if active is None:
            return cmds
        if now - self.last_progress > self.timeout:
            self._fail(
                CollectiveTimeoutError(
                    f"rank {self.rank}: no progress in call {active.call_id} for "
                    f"{self.timeout:g} s"
                ),
                cmds,
            )
            return cmds
        for peer, since in self.down_since.items():
            if now - since > self.recover_timeout and self._needs_input(active, peer):
                self._fail(PeerLostError(
                    f"rank {self.rank}: rank {peer} did not come back within "
                    f"{self.recover_timeout:g} s ({self.dead_links.get(peer, 'lost')})"), cmds)
                break
        return cmds

    def abort(self, reason: str) -> list[Command]:
        """The tracker aborted the job."""
        cmds: list[Command] = []
        if self.state in (State.FAILED, State.TASK_COMPLETE):
            return cmds
        if self.state is State.IDLE:
            self.error = JobAbortedError(reason)
            return cmds
        self._fail(JobAbortedError(reason), cmds, flood=False)
        return cmds

    def _remote_error(self, peer: int, error_type: str, reason: str, origin: int,
                      cmds: list[Command]) -> None:
        self._go(Event.PRIORITY)
        if self.error is not None:
            return
        error = _ERROR_CLASSES[error_type](f"{reason} (reported by rank {origin})")
        self._record_failure(error, cmds, source=peer, origin=origin, reason=reason)

    def _fail(self, error: RabitError, cmds: list[Command], *, source: int = -1,
              close: int = -1, flood: bool = True) -> None:
        if self.state not in (State.FAILED, State.TASK_COMPLETE):
            self._go(Event.OP_FAILED if self.state is not State.READY else Event.PRIORITY)
        if close >= 0:
            cmds.append(CloseLink(close, str(error)))
        if self.error is not None:
            return
        self._record_failure(error, cmds, source=source, origin=self.rank, reason=str(error),
                             flood=flood)

    def _record_failure(self, error: RabitError, cmds: list[Command], *, source: int,
                        origin: int, reason: str, flood: bool = True) -> None:
        self.error = error
        call_id = self.active.call_id if self.active is not None else None
        if flood:
            self._flood_raw(_ERROR_NAMES.get(type(error), "protocol"), reason, origin, cmds,
                            source)
        self.active = None
        cmds.append(CallFailed(call_id, error))

    def _flood_raw(self, error_type: str, reason: str, origin: int, cmds: list[Command],
                   source: int) -> None:
        """Tell every other neighbour, so that every rank fails with the same error type."""
        payload = encode_error(error_type, reason, origin)
        desc = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, NONE_U16, 0)
        header = pack_header(FrameKind.ERROR, desc, self.version, self.seqno, 0, len(payload))
        for peer in self.links:
            if peer != source:
                cmds.append(Send(peer, [header, payload]))
                self._frames_sent += 1

    # ------------------------------------------------------------------ recovery

    def on_link_up(self, peer: int, incarnation: int, now: float) -> list[Command]:
        """A (new) connection to ``peer`` is ready: tell it where this rank stands.

        Called for every link at ``init`` and again whenever a lost neighbour's
        replacement (or the same process, after a reset) connects.  Framing starts afresh;
        a call in progress sends nothing more to ``peer`` until ``peer`` says with a
        ``need`` from which offset it wants this rank's stream (``docs/recovery.md``)."""
        self._go(Event.LINK_UP)
        cmds: list[Command] = []
        link = self.links[peer]
        if incarnation < link.incarnation:
            raise ProtocolError(f"rank {peer} came back as incarnation {incarnation} after "
                                f"{link.incarnation}")
        was_down = not link.up
        link.incarnation = incarnation
        link.up = True
        link.state = link.pending = None
        self.dead_links.pop(peer, None)
        self.down_since.pop(peer, None)
        active = self.active
        link.reset_framing(active.plan.received.get(peer, 0) if active is not None else 0)
        link.up_call = active.call_id if active is not None else None
        link.up_at = link.up_call or (self.version, self.seqno)
        if was_down:
            self._recovery_stats["links_up"] += 1
            if active is not None and peer in active.plan.out_streams:
                link.awaiting_need = True
        if self.recover:
            link.awaiting_state = True
            self._send_control(peer, self._state_for(peer).to_msg(), cmds)
            hops = dict(self._replica_targets()).get(peer)
            if was_down and hops is not None:
                # a ring neighbour came back without the replicas of our local model
                for (owner, version), blob in sorted(self.local_models.items()):
                    if owner == self.rank:
                        self._send_local(peer, owner, version, hops, blob, cmds)
        if (active is not None and self.state is State.PEER_ERROR
                and all(self.links[p].up for p in active.plan.in_streams)):
            self._go(_RESUME_EVENTS[active.call.kind])
        del now
        return cmds

    def _state_for(self, peer: int) -> PeerState:
        active = self.active
        at = active.call_id if active is not None else (self.version, self.seqno)
        need, seen = -1, False
        if active is not None and peer in active.plan.in_streams:
            need = active.plan.received[peer]
            seen = active.frames_seen.get(peer, 0) > 0
        locals_ = tuple(sorted(v for owner, v in self.local_models if owner == peer))
        return PeerState(self.incarnation, at, active is not None, need, seen,
                         self._replaying(), tuple(sorted(self.checkpoints)),
                         self.results.oldest, locals_)

    def _replaying(self) -> bool:
        """A restarted rank before the call its neighbours are in.  Once it is in that call
        (resumed at the offsets) it answers a newly restarted neighbour like a survivor."""
        active = self.active
        return self.restarted and not (active is not None
                                       and active.call_id >= self._live_frontier())

    def _on_state(self, peer: int, link: _Link, state: PeerState, now: float,
                  cmds: list[Command]) -> None:
        del now
        if state.incarnation != link.incarnation:
            raise ProtocolError(f"rank {peer} states incarnation {state.incarnation} on a "
                                f"link opened by incarnation {link.incarnation}")
        link.state = state
        link.awaiting_state = False
        if self._replaying():
            self.peer_states[peer] = state
        else:
            self._settle_state(peer, link, state, cmds)
        if self.active is not None and self.error is None:
            self._pump(self.active, cmds)
            self._maybe_complete(self.active, cmds)

    def _settle_state(self, peer: int, link: _Link, state: PeerState,
                      cmds: list[Command]) -> None:
        """A live rank hears where a peer stands on a new connection to it."""
        active = self.active
        if state.recovering:
            return  # a restarted peer says what it needs with a "need" when it gets there
        # the same process came back on a new connection (the old one was reset): its state
        # says how much of our stream of its current call it holds
        current = active.call_id if active is not None else (self.version, self.seqno)
        if state.active and state.at >= current and (active is None or state.at > current):
            link.pending = state  # a call we have not begun: settled when we begin it
            self._pending_states = True
        if active is None:
            return
        if state.at == active.call_id:
            if link.up_call == active.call_id:
                # both were in this call when the link came up: resend what the old
                # connection lost (a peer that had not begun it needs all of it)
                link.awaiting_need = False
                self._apply_need(active, peer, state.need if state.active else 0, cmds,
                                 seen=state.seen)
            elif state.active and link.up_at < active.call_id and peer in active.plan.in_streams:
                # we were behind when the link came up and began this call since: the peer
                # still waits to hear how much of its stream we hold
                self._send_control(peer, {"t": "need", "call": list(active.call_id),
                                          "from": link.pos}, cmds)
        elif state.at > active.call_id:
            link.awaiting_need = False  # it finished our call: it needs nothing more of it
            self._apply_need(active, peer, -1, cmds)
        elif state.active and (got := self.results.get(state.at)) is not None:
            # it is still in a call we finished, and our stream of it went down with the
            # old connection: the result stands in for it
            self._reply(peer, 0, state.at, got[0], got[1], cmds)

    def states_known(self) -> bool:
        """Every neighbour has sent its state (a restarted rank waits for this in init)."""
        return all(link.state is not None for link in self.links.values())

    def _live_frontier(self) -> CallId:
        """The furthest call a surviving neighbour has reached: replay runs up to it."""
        ats = [st.at for st in self.peer_states.values() if not st.recovering]
        return max(ats) if ats else (0, 0)

    def replays(self) -> bool:
        """True if the next call's result will be fetched from a neighbour (a restarted
        rank replaying a call the others finished): ``prepare_fun`` is not called then."""
        nxt = (self.version, self.seqno)
        states = list(self.peer_states.values())  # may be called from the API thread
        return self.restarted and any(role_of(st, nxt) is Role.FINISHED for st in states)

    def _begin_replay(self, active: _Active, cmds: list[Command]) -> None:
        """A restarted rank starts a call: fetch it, resume it, or run it as usual."""
        call = active.call_id
        if call > self._live_frontier():
            self.restarted = False  # caught up: from here on this rank is a survivor
            self.peer_states = {}  # a new dict: the API thread may be reading the old one
            return
        if any(st.recovering for st in self.peer_states.values()):
            raise UnrecoverableError(
                f"rank {self.rank} and a neighbour are both being restarted: recovering two "
                "adjacent ranks at once is not supported (docs/recovery.md)")
        roles = {p: role_of(st, call) for p, st in self.peer_states.items()}
        finished = [p for p, role in roles.items() if role is Role.FINISHED]
        live = [p for p, role in roles.items() if role is Role.LIVE]
        if not finished and not live:
            return
        plan = active.plan
        if finished:
            self._recovery_stats["replayed_calls"] += 1
            self._fetch_result(active, finished, cmds)
            needs = {p: -1 for p in live}  # their streams of this call are not needed now
            active.skip_in.update(p for p, role in roles.items() if role is not Role.FRESH)
            for q, role in roles.items():
                # a neighbour that finished needs nothing; one that has not started needs
                # the whole stream, which must then be made of result bytes
                if role is not Role.LIVE:
                    self._apply_need(active, q, -1 if role is Role.FINISHED else 0, cmds)
        else:
            self._recovery_stats["resumed_calls"] += 1
            resume = plan.resume({q: max(0, self.peer_states[q].need) for q in live})
            needs = {p: resume.in_from.get(p, -1) for p in live}
            for p, offset in resume.in_from.items():
                self.links[p].pos = offset
                stream = plan.in_streams[p]
                if offset and roles[p] is not Role.LIVE:
                    raise UnrecoverableError(
                        f"rank {self.rank} must resume call {call} at byte {offset} of rank "
                        f"{p}'s stream, but rank {p} has not started that call")
                if offset >= stream.length > 0:
                    active.frames_seen[p] = 1  # nothing is left to come from there
            for peer, lo, hi in resume.fetch:
                self._request(peer, "result", call, lo, hi, active.call.buf[lo:hi], cmds,
                              active)
        for q in live:
            st = self.peer_states[q]
            self._apply_need(active, q, st.need, cmds, seen=st.seen)
            if q in plan.in_streams:
                self._send_control(q, {"t": "need", "call": list(call), "from": needs[q]},
                                   cmds)

    def _fetch_result(self, active: _Active, finished: list[int], cmds: list[Command]) -> None:
        call = active.call_id
        sources = [p for p in finished
                   if self.links[p].up and self.peer_states[p].oldest <= call]
        if not sources:
            raise UnrecoverableError(
                f"rank {self.rank} replays call {call}, but no live neighbour retains its "
                "result any more (raise rabit2_replay_mb, or checkpoint more often)")
        active.final = True
        dest = None if active.call.kind is CollectiveKind.BROADCAST else active.call.buf
        self._request(sources[0], "result", call, 0, -1, dest, cmds, active)

    def _on_need(self, peer: int, link: _Link, call: CallId, offset: int,
                 cmds: list[Command]) -> None:
        """``peer`` holds ``offset`` bytes of our stream of ``call`` (-1: wants none of it)."""
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if active is not None and call == current:
            link.awaiting_need = False
            self._apply_need(active, peer, offset, cmds)
            self._pump(active, cmds)
            self._maybe_complete(active, cmds)
        elif call < current:
            if offset < 0:
                return
            # the call finished here meanwhile: the result stands in for the stream
            got = self.results.get(call)
            if got is None:
                raise UnrecoverableError(f"rank {peer} resumes call {call}, which rank "
                                         f"{self.rank} finished and no longer retains")
            self._reply(peer, 0, call, got[0], got[1], cmds)
        else:
            raise ProtocolError(f"rank {peer} resumes call {call}, which rank {self.rank} "
                                "has not started")

    def _apply_need(self, active: _Active, peer: int, offset: int, cmds: list[Command],
                    seen: bool = False) -> None:
        plan = active.plan
        stream = plan.out_streams.get(peer)
        if stream is None:
            if isinstance(plan, TreeBroadcast) and not plan.sized and peer in plan.out_links:
                active.deferred[peer] = (offset, seen)  # its stream appears with the size
            return
        if offset < 0 or (seen and offset >= stream.length):
            active.sent[peer] = stream.length
            active.started_empty.add(peer)
            return
        if offset > stream.length:
            raise ProtocolError(f"rank {peer} needs call {active.call_id} from byte {offset} "
                                f"of a {stream.length} B stream")
        if active.final and offset < stream.length and offset < active.plan.final_from(peer):
            raise UnrecoverableError(
                f"rank {peer} needs partial sums of call {active.call_id} from byte {offset}, "
                f"but rank {self.rank} restarted and holds only that call's result")
        old = active.sent.get(peer, 0)
        self._recovery_stats["resent_bytes"] += max(0, old - offset)
        active.sent[peer] = offset
        active.started_empty.discard(peer)
        del cmds

    def _request(self, peer: int, what: str, call: CallId, lo: int, hi: int,
                 dest: memoryview | None, cmds: list[Command],
                 active: _Active | None = None) -> None:
        request = self._next_request
        self._next_request += 1
        self._fetches[request] = _Fetch(request, peer, what, call, lo == 0 and hi < 0, dest)
        if active is not None:
            active.fetching += 1
        self._send_control(peer, {"t": "fetch", "id": request, "what": what,
                                  "call": list(call), "lo": lo, "hi": hi}, cmds)

    def _refetch(self, fetch: _Fetch, cmds: list[Command]) -> None:
        """The neighbour a fetch went to was lost: ask another one that holds the same."""
        del self._fetches[fetch.request]
        active = self.active
        if active is not None and active.call_id == fetch.call and fetch.what == "result":
            active.fetching -= 1
        for peer, st in self.peer_states.items():
            if peer == fetch.peer or not self.links[peer].up:
                continue
            if fetch.what == "checkpoint" and fetch.call[0] in st.versions:
                self._request(peer, "checkpoint", fetch.call, 0, -1, None, cmds)
                return
            if fetch.what == "local" and fetch.call[0] in st.locals:
                self._request(peer, "local", fetch.call, 0, -1, None, cmds)
                return
            if (fetch.what == "result" and fetch.whole and active is not None
                    and role_of(st, fetch.call) is Role.FINISHED and st.oldest <= fetch.call):
                self._request(peer, "result", fetch.call, 0, -1, fetch.dest, cmds, active)
                return
        raise UnrecoverableError(
            f"rank {self.rank} lost rank {fetch.peer} while fetching {fetch.what} "
            f"{fetch.call}, and no other neighbour holds it")

    def _on_fetch(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        what, call = msg["what"], call_id(msg["call"], "fetch.call")
        request, lo, hi = msg["id"], msg["lo"], msg["hi"]
        none = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, NONE_U16, 0)
        data: memoryview | None = None
        desc = none
        reason = ""
        if what == "checkpoint":
            blob = self.checkpoints.get(call[0])
            if callable(blob):
                blob = self.checkpoints[call[0]] = blob()  # a lazy checkpoint, pickled now
            if blob is None:
                reason = f"rank {self.rank} holds no checkpoint of version {call[0]}"
            else:
                data = memoryview(blob)
        elif what == "local":
            local = self.local_models.get((call[1], call[0]))  # call = (version, owner)
            if local is None:
                reason = (f"rank {self.rank} holds no local model of rank {call[1]} "
                          f"version {call[0]}")
            else:
                data = memoryview(local)
        elif what == "result":
            active = self.active
            if (active is not None and active.call_id == call
                    and active.call.kind is not CollectiveKind.BROADCAST):
                desc, data = active.desc, active.call.buf  # final bytes, by the asker's reckoning
            elif (got := self.results.get(call)) is not None:
                desc, data = got
            else:
                reason = f"rank {self.rank} retains no result of call {call}"
        else:
            raise ProtocolError(f"rank {peer} fetches {what!r}")
        if data is not None:
            end = len(data) if hi < 0 else hi
            if not 0 <= lo <= end <= len(data):
                raise ProtocolError(f"rank {peer} fetches bytes [{lo}, {hi}) of {len(data)}")
            data = data[lo:end]
        self._reply(peer, request, call, desc, data, cmds, reason)

    def _reply(self, peer: int, request: int, call: CallId, desc: CallDescriptor,
               data: memoryview | None, cmds: list[Command], reason: str = "") -> None:
        size = 0 if data is None else len(data)
        self._send_control(peer, {"t": "reply", "id": request, "call": list(call),
                                  "found": data is not None, "size": size,
                                  "desc": descriptor_to_wire(desc), "reason": reason}, cmds)
        if data is not None and size:
            header = pack_header(FrameKind.BLOB, desc, call[0], call[1], 0, size,
                                 self.incarnation)
            cmds.append(Send(peer, [header, data]))
            self._frames_sent += 1

    def _on_reply(self, peer: int, link: _Link, msg: dict[str, Any],
                  cmds: list[Command]) -> None:
        call = call_id(msg["call"], "reply.call")
        size = msg["size"]
        if not 0 <= size <= MAX_BROADCAST:
            raise ProtocolError(f"rank {peer} replies with {size} B")
        request = msg["id"]
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if request == 0 and (call < current or (active is not None and active.final
                                                 and call == current)):
            # a result sent for a call we meanwhile finished (or already have): read, drop
            fetch = _Fetch(0, peer, "discard", call, True, memoryview(bytearray(size)))
        elif request == 0:
            # our need reached a rank that had finished the call: it sent the result
            if active is None or active.call_id != call:
                raise ProtocolError(f"rank {peer} sent an unasked result of call {call}")
            active.final = True
            active.skip_in.add(peer)
            dest = None if active.call.kind is CollectiveKind.BROADCAST else active.call.buf
            fetch = _Fetch(0, peer, "result", call, True, dest)
            active.fetching += 1
        else:
            found = self._fetches.get(request)
            if found is None or found.peer != peer or found.call != call:
                raise ProtocolError(f"rank {peer} replies to request {request} nobody made")
            fetch = found
        if not msg["found"]:
            raise UnrecoverableError(f"rank {self.rank} cannot recover: {msg['reason']}")
        if fetch.what == "result":
            desc = descriptor_from_wire(msg["desc"])
            if active is None or active.call_id != call or not desc.agrees_with(active.desc):
                mine = "no call" if active is None else active.desc.describe()
                raise MismatchError(
                    f"sequence mismatch: restarted rank {self.rank} replays call {call} as "
                    f"{mine}, but rank {peer} made it as {desc.describe()}")
        dest = fetch.dest
        if dest is None:
            dest = memoryview(bytearray(size))
        elif len(dest) != size:
            raise MismatchError(f"sequence mismatch: rank {peer} holds {size} B of call "
                                f"{call}, restarted rank {self.rank} asked for {len(dest)} B")
        fetch.dest = dest
        link.blob, link.blob_fetch = dest, fetch
        if not size:
            self._blob_done(peer, link, cmds)

    def _blob_done(self, peer: int, link: _Link, cmds: list[Command]) -> None:
        fetch = link.blob_fetch
        assert fetch is not None and fetch.dest is not None
        link.blob_fetch = None
        link.mode, link.filled, link.remaining = _Mode.HEADER, 0, 0
        self._fetches.pop(fetch.request, None)
        if fetch.what == "discard":
            return
        if fetch.what == "replica":
            self._stored_local(peer, fetch, cmds)
            return
        self._recovery_stats["fetched_bytes"] += len(fetch.dest)
        if fetch.what in ("checkpoint", "local"):
            blob = bytes(fetch.dest)
            if fetch.what == "checkpoint":
                self.checkpoints[fetch.call[0]] = blob
            else:
                self._keep_local(self.rank, fetch.call[0], blob)
            loading = self._loading
            loading[fetch.what] = blob
            loading["pending"] -= 1
            if not loading["pending"]:
                cmds.append(CheckpointLoaded(loading["version"], loading["checkpoint"],
                                             loading["local"]))
            return
        active = self.active
        if active is None or active.call_id != fetch.call:
            return
        if active.call.kind is CollectiveKind.BROADCAST:
            self._land_broadcast(active, fetch.dest)
        active.fetching -= 1
        self._pump(active, cmds)
        self._maybe_complete(active, cmds)
        del peer

    def _land_broadcast(self, active: _Active, data: memoryview) -> None:
        """A fetched broadcast result: the stream as the in-link would have delivered it."""
        plan = active.plan
        assert isinstance(plan, TreeBroadcast)
        if plan.in_link < 0:
            return  # the root replays its own data
        if not plan.sized:
            self._size_to(plan, len(data), active)
        if plan.length != len(data):
            raise MismatchError(f"sequence mismatch: the broadcast of call {active.call_id} "
                                f"has {len(data)} B, this rank expected {plan.length} B")
        pos = 0
        while pos < len(data):
            # the plan lays out the payload once the head is in: look the stream up again
            dest = plan.in_streams[plan.in_link].view(pos, len(data) - pos)
            if not dest:
                raise ProtocolError(f"the broadcast of call {active.call_id} has no place "
                                    f"for byte {pos} of its {len(data)} B result")
            dest[:] = data[pos : pos + len(dest)]
            pos += len(dest)
            self._received(plan, plan.in_link, pos)

    def load_checkpoint(self, with_local: bool = False) -> list[Command]:
        """A restarted rank asks its neighbours for the checkpoint it resumes from (and, with
        ``with_local``, for its own local model, which the ring's next rank holds); the
        answer comes as :class:`CheckpointLoaded`.  Raises :class:`UnrecoverableError` if no
        live neighbour holds what is needed."""
        if self.error is not None:
            raise self.error  # e.g. the job was aborted while this worker started
        version = checkpoint_version(self.peer_states) if self.restarted else self.version
        if with_local and version:
            # a rank that died between a call and its next checkpoint never handed on the
            # local model of the version its neighbours are in: resume one version earlier
            held = [v for p, st in self.peer_states.items() if self.links[p].up
                    for v in st.locals if v <= version]
            version = max(held, default=0)
        cmds: list[Command] = []
        self.version, self.seqno = version, 0
        self._loading = {"version": version, "checkpoint": None, "local": None, "pending": 0}
        if version == 0:
            cmds.append(CheckpointLoaded(0, None))
            return cmds
        sources = [p for p, st in self.peer_states.items()
                   if version in st.versions and self.links[p].up]
        if not sources:
            raise UnrecoverableError(f"no live neighbour of rank {self.rank} holds "
                                     f"checkpoint version {version}")
        self._loading["pending"] = 2 if with_local else 1
        self._request(sources[0], "checkpoint", (version, 0), 0, -1, None, cmds)
        if with_local:
            holders = [p for p, st in self.peer_states.items()
                       if version in st.locals and self.links[p].up]
            if not holders:
                raise UnrecoverableError(f"no live neighbour of rank {self.rank} holds its "
                                         f"local model of version {version}")
            self._request(holders[0], "local", (version, self.rank), 0, -1, None, cmds)
        return cmds

    def _send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        body = encode_body(msg)
        header = pack_header(FrameKind.CONTROL, _NO_CALL, self.version, self.seqno, 0,
                             len(body), self.incarnation)
        cmds.append(Send(peer, [header, body]))
        self._frames_sent += 1

    @staticmethod
    def _result_pieces(active: _Active) -> list[memoryview]:
        """What a finished call leaves behind for a replay: the result (a broadcast's
        whole stream, head included)."""
        plan = active.plan
        if isinstance(plan, TreeBroadcast):
            if plan.in_link >= 0:
                return list(plan.in_streams[plan.in_link].pieces)
            return list(active.call.pieces or (active.call.buf,))
        return [active.call.buf]

    def recovery_statistics(self) -> dict[str, int]:
        """Counters of the recovery protocol: links re-established, bytes fetched for
        replay, bytes resent because a receiver asked for them again, calls replayed from
        a neighbour's result and calls resumed at an offset."""
        return dict(self._recovery_stats)

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> AgentStats:
        return AgentStats(self.state.value, self._calls_completed, self._bytes_sent,
                          self._bytes_received, self._frames_sent, self._frames_received)

