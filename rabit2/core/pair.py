"""The receive side of a rank's peer links (its "pairs"): framing, checksums and
demultiplexing.

Bytes from a peer land where :meth:`Receiver.recv_buffer` says: the link's staging buffer
(headers and small payloads), the destination in the call's plan (large payloads, with no
copy), a checked frame's landing buffer until its CRC32C holds, or the buffer of a control
message or of a blob a fetch announced.  Each link's receive mode (``Link.mode``) moves

    HEADER -> PAYLOAD | BODY | BLOB -> HEADER        HEADER -> HELD -> HEADER (the call began)

and every complete frame is handed to the agent (data of the call in progress), to the agent's
failure path (ERROR), or to the recovery component (CONTROL, BLOB).  The frame layout is in
:mod:`rabit2.core.framing`.
"""

from __future__ import annotations

from typing import Any, Protocol

from rabit2.core import fsm, progress
from rabit2.core.control import decode_body
from rabit2.core.failures import Failures
from rabit2.core.framing import (
    CALL_PREFIX_SIZE,
    CHECKED_FRAME,
    HEADER_SIZE,
    FrameCorruptError,
    FrameHeader,
    FrameKind,
    checksum,
    decode_error,
    parse_header,
    unpack_tail,
)
from rabit2.core.fsm import LinkEvent, Mode
from rabit2.core.planning import Planner
from rabit2.core.records import (
    ActiveCall,
    CloseLink,
    Command,
    Link,
    PauseReading,
    ResumeReading,
)
from rabit2.core.recovery.component import Recovery
from rabit2.core.schedule import Plan, TreeBroadcast
from rabit2.errors import MismatchError, ProtocolError, RabitError, UnrecoverableError

State, Event = fsm.State, fsm.Event

MAX_CORRUPT_STREAK = 8
"""Corrupt frames in a row on one link after which the call fails instead of resetting the
link once more (a link that damages every frame will not heal by being reset)."""


class Owner(Protocol):
    """What the receive side reads and calls of the agent that owns it."""

    rank: int
    version: int
    seqno: int
    state: fsm.State
    links: dict[int, Link]
    active: ActiveCall | None
    error: RabitError | None
    recovery: Recovery | None
    planner: Planner
    failures: Failures
    last_progress: float
    timeout: float

    def go(self, event: fsm.Event) -> None: ...
    def advance(self, cmds: list[Command]) -> None: ...
    def fail(self, error: RabitError, cmds: list[Command], *, source: int = -1,
             close: int = -1, flood: bool = True) -> None: ...
    def on_hangup(self, peer: int, reason: str, now: float) -> list[Command]: ...
    def send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None: ...


def after_finalize(peer: int, theirs: tuple[int, int], rank: int,
                   ours: tuple[int, int]) -> MismatchError:
    """``peer`` began a call after ``rank`` finalized: the sequences of calls diverged."""
    return MismatchError(
        f"sequence mismatch: rank {peer} began call {theirs} (version, seqno) after rank "
        f"{rank} finalized at call {ours}: the ranks made different sequences of "
        "collectives or checkpoints")


class Receiver:
    """Every peer link's receive side, for one agent (loop thread only)."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent
        self._discard = memoryview(bytearray(64 * 1024))
        self.bytes_received = 0  # payload only, like the bytes sent
        self.frames_received = 0
        self.corrupt_frames = 0

    def recv_buffer(self, peer: int) -> memoryview:
        """Where the next bytes from ``peer`` must land (never empty)."""
        if self.agent.error is not None:
            return self._discard  # after a failure nothing read from a peer is used
        link = self.agent.links[peer]
        mode = link.mode
        if mode is Mode.PAYLOAD:
            active = self.agent.active
            assert active is not None
            if link.expect >= 0:  # a checked frame lands aside until it is verified
                return link.check_buf[link.filled : link.filled + link.remaining]
            return active.plan.in_streams[peer].view(link.pos, link.remaining)
        if not link.up:
            return self._discard  # a link reset for corruption, until it closes
        if mode is Mode.BODY:
            return memoryview(link.error_buf)[link.filled :]
        if mode is Mode.BLOB:
            return link.blob[link.filled : link.filled + link.remaining]
        # HEADER (HELD only if the loop delivers bytes it read before the pause took effect,
        # which on_bytes reports as a protocol breach)
        return link.stage[link.end :]

    def discard_buffer(self) -> memoryview:
        """Where bytes of a connection that was replaced go (they are never looked at)."""
        return self._discard

    def on_bytes(self, peer: int, nbytes: int, now: float) -> list[Command]:
        """``nbytes`` landed in the buffer returned by the last :meth:`recv_buffer`."""
        self.agent.go(Event.READABLE)
        if self.agent.state is State.FAILED or (self.agent.state is State.TASK_COMPLETE
                                          and self.agent.recovery is None):
            return []  # (a finalized rank with recovery on still serves its neighbours)
        link = self.agent.links[peer]
        cmds: list[Command] = []
        try:
            if link.mode is Mode.PAYLOAD:
                self.bytes_received += nbytes  # payload only, like bytes_sent
                self.agent.last_progress = now
                link.remaining -= nbytes
                active = self.agent.active
                assert active is not None
                if link.expect < 0:
                    link.pos += nbytes
                    self.received(active.plan, peer, link.pos)
                    if link.remaining == 0:
                        link.go(LinkEvent.FRAME_DONE)
                        link.filled = 0
                else:
                    # a checked frame: no byte of it is used before all of it is verified
                    at = link.filled
                    link.filled += nbytes
                    link.crc = checksum(link.check_buf[at : link.filled], link.crc)
                    if link.remaining:
                        return cmds
                    link.go(LinkEvent.FRAME_DONE)
                    self._verified(peer, link, active.plan)
                self.agent.advance(cmds)
            elif link.mode is Mode.HEADER:
                if not link.up:
                    return cmds  # (bytes read before a link reset for corruption took effect)
                link.end += nbytes
                self._drain(peer, link, now, cmds)
            elif link.mode is Mode.BODY:
                link.filled += nbytes
                if link.filled != len(link.error_buf):
                    return cmds
                self._body_whole(peer, link, now, cmds)
                self.agent.advance(cmds)
                self._drain(peer, link, now, cmds)
            elif link.mode is Mode.BLOB:
                self.agent.last_progress = now
                link.filled += nbytes
                link.remaining -= nbytes
                if not link.remaining:
                    self._blob_whole(link, cmds)
                    self.agent.advance(cmds)
                    self._drain(peer, link, now, cmds)
            else:
                raise ProtocolError(f"bytes from rank {peer} while its link is held")
        except FrameCorruptError as exc:
            self._corrupted(peer, exc, now, cmds)
        except ProtocolError as exc:
            self.agent.fail(exc, cmds, source=peer, close=peer)
        except (MismatchError, UnrecoverableError) as exc:
            self.agent.fail(exc, cmds)  # the peer that disagrees must hear it too
        return cmds

    def _drain(self, peer: int, link: Link, now: float, cmds: list[Command]) -> None:
        """Consume every complete frame in the staging buffer (and the payload with it)."""
        stage = link.stage
        while link.mode is Mode.HEADER and link.end - link.start >= HEADER_SIZE:
            start = link.start
            active = self.agent.active
            link.start += HEADER_SIZE
            self.frames_received += 1
            if active is not None and stage[start : start + CALL_PREFIX_SIZE] == (
                    active.prefix_checked if link.checked else active.prefix):
                # fast path: a DATA frame of the current call (the common case)
                offset, length, crc = unpack_tail(stage, start)
                self._accept_data(peer, link, offset, length, crc if link.checked else None,
                                  active, now, cmds)
            else:
                frame = parse_header(stage[start : start + HEADER_SIZE])
                self._dispatch_header(peer, link, frame, now, cmds)
            self._take_staged(peer, link, now, cmds)
            if self.agent.error is not None:
                return
            self.agent.advance(cmds)  # finish this call before looking at the next frame
        if link.mode is Mode.HELD:
            return  # the held frame's payload stays staged until its call starts
        if link.start == link.end:
            link.start = link.end = 0
        elif link.start:
            # keep the partial header, at the front so the next read has room
            size = link.end - link.start
            stage[:size] = stage[link.start : link.end]
            link.start, link.end = 0, size
        # (every frame consumed above was followed by a pump; a partial header changes nothing)

    def _take_staged(self, peer: int, link: Link, now: float, cmds: list[Command]) -> None:
        """Move the staged bytes of the current frame's payload where they belong."""
        avail = link.end - link.start
        if not avail:
            return
        if link.mode is Mode.PAYLOAD:
            active = self.agent.active
            assert active is not None
            plan = active.plan
            take = min(avail, link.remaining)
            if link.expect >= 0:  # a checked frame: aside until it is whole and verified
                at = link.filled
                link.check_buf[at : at + take] = link.stage[link.start : link.start + take]
                link.filled += take
                link.crc = checksum(link.check_buf[at : link.filled], link.crc)
                link.start += take
            else:
                self._place(peer, link, plan, link.stage[link.start : link.start + take])
                link.start += take
            link.remaining -= take
            self.bytes_received += take
            self.agent.last_progress = now
            if not link.remaining:
                link.go(LinkEvent.FRAME_DONE)
                if link.expect >= 0:
                    self._verified(peer, link, plan)
        elif link.mode is Mode.BODY:
            take = min(avail, len(link.error_buf) - link.filled)
            link.error_buf[link.filled : link.filled + take] = link.stage[
                link.start : link.start + take
            ]
            link.start += take
            link.filled += take
            if link.filled == len(link.error_buf):
                self._body_whole(peer, link, now, cmds)
        elif link.mode is Mode.BLOB:
            take = min(avail, link.remaining)
            link.blob[link.filled : link.filled + take] = link.stage[
                link.start : link.start + take
            ]
            link.start += take
            link.filled += take
            link.remaining -= take
            if not link.remaining:
                self._blob_whole(link, cmds)

    def _body_whole(self, peer: int, link: Link, now: float, cmds: list[Command]) -> None:
        """An ERROR or CONTROL frame's payload landed whole: verify it, then act on it."""
        link.go(LinkEvent.FRAME_DONE)
        link.filled = 0
        self._check_whole(link, link.error_buf)
        self._on_body(peer, link, now, cmds)

    def _blob_whole(self, link: Link, cmds: list[Command]) -> None:
        """The BLOB a fetch announced landed whole: verify it, then hand it to recovery."""
        self._check_whole(link, link.blob)
        recovery = self.agent.recovery
        assert recovery is not None  # (a blob is accepted only where a fetch announced it)
        recovery.fetches.blob_done(link, cmds)

    def received(self, plan: Plan, peer: int, pos: int) -> None:
        """``peer``'s stream of the call holds ``pos`` bytes now."""
        try:
            plan.on_received(peer, pos)
        except (ValueError, TypeError, MemoryError) as exc:
            # a broadcast head that names no valid array, or a size that cannot be allocated
            raise ProtocolError(f"cannot place the data from rank {peer}: {exc}") from None
        active = self.agent.active
        if active is not None and active.mirror is not None and pos > active.mirrored:
            Recovery.mirror(active, pos)

    def _place(self, peer: int, link: Link, plan: Plan, data: memoryview) -> None:
        """Copy ``data``, the next bytes of ``peer``'s stream, where they belong."""
        at, size = 0, len(data)
        while at < size:
            # the plan may lay out the rest of its stream once a piece is complete
            dest = plan.in_streams[peer].view(link.pos, size - at)
            n = len(dest)
            if not n:
                raise ProtocolError(f"rank {peer} sent bytes at offset {link.pos} that have "
                                    "no place yet")
            dest[:] = data[at : at + n]
            at += n
            link.pos += n
            self.received(plan, peer, link.pos)

    def _verified(self, peer: int, link: Link, plan: Plan) -> None:
        """A checked DATA frame landed whole, aside: its bytes go where they belong, as an
        unchecked frame's would have, only if its checksum holds.  (Landing them in place
        first would overwrite bytes the plan may still need if the frame proves damaged or
        the link breaks half way, such as a tree's partial sums.)"""
        if link.crc != link.expect:
            raise FrameCorruptError(f"a data frame at stream offset {link.pos} failed its "
                                    "checksum")
        link.corrupt_streak = 0
        filled, link.filled = link.filled, 0
        self._place(peer, link, plan, link.check_buf[:filled])

    @staticmethod
    def _check_whole(link: Link, body: bytes | bytearray | memoryview) -> None:
        """A checked CONTROL, ERROR or BLOB payload landed whole: verify it before use."""
        if link.expect >= 0 and checksum(body) != link.expect:
            raise FrameCorruptError("a control, error or blob frame failed its checksum")

    def _corrupted(self, peer: int, exc: FrameCorruptError, now: float,
                   cmds: list[Command]) -> None:
        """A frame from ``peer`` failed its checksum: nothing of it was used.  With recovery
        on, the link is reset like any other broken connection and the stream resumes after
        the last verified frame; a link that fails again and again, or one without recovery,
        fails the call (typed, never a wrong result)."""
        self.corrupt_frames += 1
        link = self.agent.links[peer]
        link.corrupt_streak += 1
        what = f"rank {self.agent.rank}, link from rank {peer}: {exc}"
        if self.agent.recovery is None or link.corrupt_streak > MAX_CORRUPT_STREAK:
            more = ("" if self.agent.recovery is None else
                    f" ({link.corrupt_streak} corrupt frames in a row on this link)")
            self.agent.fail(ProtocolError(what + more), cmds, source=peer, close=peer)
            return
        cmds.append(CloseLink(peer, f"{what}: the link is reset and resumes"))
        cmds.extend(self.agent.on_hangup(peer, f"reset after a corrupt frame: {exc}", now))

    def _dispatch_header(self, peer: int, link: Link, frame: FrameHeader, now: float,
                         cmds: list[Command]) -> None:
        if frame.kind in (FrameKind.ERROR, FrameKind.CONTROL):
            if not frame.length:
                raise ProtocolError(f"empty {frame.kind.name.lower()} frame from rank {peer}")
            link.error_buf = bytearray(frame.length)
            link.body_kind = frame.kind
            link.go(LinkEvent.BODY)
            link.filled = 0
            link.expect = -1 if frame.payload_crc is None else frame.payload_crc
            return
        if frame.kind is FrameKind.BLOB:
            fetch = link.blob_fetch
            if fetch is None or frame.length != len(link.blob):
                raise ProtocolError(f"rank {peer} sent a blob of {frame.length} B that no "
                                    "reply announced")
            link.go(LinkEvent.BLOB)
            link.filled, link.remaining = 0, frame.length
            link.expect = -1 if frame.payload_crc is None else frame.payload_crc
            return
        active = self.agent.active
        current = active.call_id if active is not None else (self.agent.version, self.agent.seqno)
        if frame.call_id < current:
            # the peer is still in a call this rank has finished or never made
            raise self._diverged(peer, frame.call_id, current)
        if frame.call_id > current or active is None:
            if active is None and self.agent.state is State.TASK_COMPLETE:
                # this rank finalized (and, with recovery on, still serves its neighbours):
                # no call of the peer's can follow, so waiting would hang it to its deadline
                raise after_finalize(peer, frame.call_id, self.agent.rank, current)
            if active is not None and active.needs_input(peer):
                # TCP keeps a peer's frames in order and a peer finishes sending a call before
                # it starts the next one: a later call's frame while this call still waits
                # for that peer's bytes means the ranks' call sequences diverged (an extra
                # collective or checkpoint on one side); waiting would hang until the deadline
                raise self._diverged(peer, frame.call_id, current)
            link.go(LinkEvent.LATER_CALL)
            link.frame = frame
            cmds.append(PauseReading(peer))
            return
        self._accept_frame(peer, link, frame, active, now, cmds)

    def _on_body(self, peer: int, link: Link, now: float, cmds: list[Command]) -> None:
        """A whole ERROR or CONTROL payload arrived."""
        body = bytes(link.error_buf)
        if link.body_kind is FrameKind.ERROR:
            error_type, reason, origin = decode_error(body)
            self.agent.failures.remote_error(peer, error_type, reason, origin, cmds)
            return
        msg = decode_body(body)
        kind = msg["t"]
        if kind == "progress":
            agent = self.agent
            if agent.active is None and agent.state is State.TASK_COMPLETE:
                # a neighbour in a call this rank, finalized, never made: one whose input it
                # waits for first (a leaf of a tree) sends it no frame to meet, so its note
                # is the only word of it here; waiting would hang both to the deadline
                call, ours = progress.call_of(peer, msg), (agent.version, agent.seqno)
                if call >= ours:
                    raise after_finalize(peer, call, agent.rank, ours)
            progress.heard(agent, peer, msg, now, cmds)
        elif (recovery := self.agent.recovery) is None or not recovery.on_control(
                peer, link, msg, cmds):
            if recovery is None and kind in Recovery.KINDS:
                raise MismatchError(
                    f"rank {peer} runs with recovery on (it sent a {kind!r} message) and rank "
                    f"{self.agent.rank} with it off: rabit2_recover must be the same on every "
                    "rank")
            raise ProtocolError(f"rank {peer} sent a {kind!r} message on a peer link")

    def _diverged(self, peer: int, theirs: tuple[int, int], ours: tuple[int, int]) -> MismatchError:
        return MismatchError(
            f"sequence mismatch: rank {peer} is at call {theirs} (version, seqno) while rank "
            f"{self.agent.rank} is at call {ours}: the ranks made different sequences of "
            "collectives or checkpoints"
        )

    def _accept_frame(self, peer: int, link: Link, frame: FrameHeader, active: ActiveCall,
                      now: float, cmds: list[Command]) -> None:
        plan = active.plan
        if (isinstance(plan, TreeBroadcast) and not plan.sized and peer == plan.in_link
                and frame.kind is FrameKind.DATA):
            self.agent.planner.size_broadcast(plan, frame, active)
        if not frame.call.agrees_with(active.desc):
            raise MismatchError(
                f"collective mismatch at call {active.call_id}: rank {self.agent.rank} called "
                f"{active.desc.describe()} but rank {peer} called {frame.call.describe()}"
            )
        self._accept_data(peer, link, frame.offset, frame.length, frame.payload_crc, active,
                          now, cmds)

    def _accept_data(self, peer: int, link: Link, offset: int, length: int, crc: int | None,
                     active: ActiveCall, now: float, cmds: list[Command]) -> None:
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
        if crc is not None and length > CHECKED_FRAME:
            raise ProtocolError(f"rank {peer} sent a checked frame of {length} B (at most "
                                f"{CHECKED_FRAME} B)")
        active.frames_seen[peer] += 1
        link.seen_version = active.call_id[0]
        self.agent.last_progress = now
        if length:
            link.go(LinkEvent.DATA)
            link.remaining = length
            if crc is None:
                link.expect = -1
            else:
                link.expect, link.crc, link.filled = crc, 0, 0
                if len(link.check_buf) < length:
                    link.check_buf = memoryview(bytearray(CHECKED_FRAME))
        else:
            link.go(LinkEvent.FRAME_DONE)  # (an announce: the pass after it completes)

    def release_held(self, held: list[int], active: ActiveCall, now: float,
                     cmds: list[Command]) -> bool:
        """A call began: the links in ``held`` paused on a header of a later call.  Frames of
        this call are taken now and the link reads again; False if the call failed."""
        call_id = active.call_id
        for peer in held:
            link = self.agent.links[peer]
            if link.mode is not Mode.HELD:
                continue
            link.remaining = 0
            assert link.frame is not None
            if link.frame.call_id == call_id:
                link.go(LinkEvent.CALL_BEGAN)
                try:
                    self._accept_frame(peer, link, link.frame, active, now, cmds)
                    self._take_staged(peer, link, now, cmds)
                    self._drain(peer, link, now, cmds)
                except (MismatchError, UnrecoverableError) as exc:
                    self.agent.fail(exc, cmds)
                    return False
                except FrameCorruptError as exc:
                    self._corrupted(peer, exc, now, cmds)
                    continue
                except ProtocolError as exc:
                    self.agent.fail(exc, cmds, source=peer, close=peer)
                    return False
                cmds.append(ResumeReading(peer))
            elif link.frame.call_id < call_id or active.needs_input(peer):
                # this rank skipped the call that frame belongs to, or the peer already
                # moved past this call although this call needs its bytes
                self.agent.fail(self._diverged(peer, link.frame.call_id, call_id), cmds)
                return False
        return True
