"""The Rabit-style agent: one rank's sans-I/O core.

The I/O layer owns sockets and a loop; it feeds the agent events and executes the commands the
agent returns.  Received bytes go straight where the agent says (:meth:`Agent.recv_buffer`
returns a view of the destination: the link's staging buffer, the user's array or a link's
scratch), so the hot path copies nothing but the few bytes that arrive with a header.

    begin(call) | on_bytes(peer, n) | on_hangup(peer) | on_tick(now) | abort(reason)
        ->  [Send | PauseReading | ResumeReading | CallComplete | CallFailed | CloseLink]

Every state change goes through the tables of :mod:`rabit2.core.fsm`.  Time is an argument
(``now``, seconds on any monotonic clock); the agent never reads a clock.

The agent owns its parts: the receive side (:mod:`rabit2.core.pair`), the send side
(:mod:`rabit2.core.sending`), planning (:mod:`rabit2.core.planning`), links coming and going
(:mod:`rabit2.core.peers`), the failure path (:mod:`rabit2.core.failures`) and, with recovery
on only, the recovery component (:mod:`rabit2.core.recovery`).  Each input changes records;
then one pass, :meth:`Agent.advance`, sends what became ready and completes the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rabit2.core import fsm
from rabit2.core.express import Express
from rabit2.core.failures import Failures
from rabit2.core.framing import CollectiveKind
from rabit2.core.fsm import TRANSITIONS, Mode, PhaseEvent
from rabit2.core.pair import Receiver, after_finalize
from rabit2.core.peers import Peers
from rabit2.core.planning import Planner
from rabit2.core.records import (
    CALL_EVENTS,
    EVERY_RANK_CONTRIBUTES,
    STAGE_SIZE,
    ActiveCall,
    AgentStats,
    Call,
    CallComplete,
    CallFailed,
    CheckpointLoaded,
    CloseLink,
    Command,
    Link,
    PauseReading,
    ResumeReading,
    Send,
)
from rabit2.core.recovery.component import Recovery
from rabit2.core.recovery.store import DEFAULT_RETAIN_BYTES
from rabit2.core.schedule import (
    Plan,
    TreeBroadcast,
)
from rabit2.core.sending import Sender
from rabit2.core.topology import topology
from rabit2.errors import (
    PeerLostError,
    ProtocolError,
    RabitError,
    UnrecoverableError,
)

State, Event = fsm.State, fsm.Event
_BOOTSTRAP = frozenset((State.CONNECTING_TRACKER, State.CONNECTING_PEERS, State.ACCEPTING_PEERS))


__all__ = [
    "STAGE_SIZE",
    "Agent",
    "AgentStats",
    "Call",
    "CallComplete",
    "CallFailed",
    "CheckpointLoaded",
    "CloseLink",
    "Command",
    "PauseReading",
    "ResumeReading",
    "Send",
]


class Agent:
    """One rank's agent.  Not thread-safe: the I/O layer calls it from its loop thread only."""

    def __init__(
        self,
        *,
        ring_mincount: int | None = None,
        ring_min_bytes: int | None = None,
        tree_chunk: int = 1 << 20,
        timeout: float = 1800.0,
        recover: bool = False,
        recover_timeout: float = 300.0,
        retain_bytes: int = DEFAULT_RETAIN_BYTES,
        local_replica: int = 2,
        checked: bool = True,
    ) -> None:
        """``recover``: a lost link the call needs makes the call wait (up to
        ``recover_timeout`` seconds) for the peer's replacement instead of failing, and
        every finished call's result is kept for replay (``docs/recovery.md``).
        ``checked``: the frames this rank sends carry a CRC32C of their payload, on every
        link unless :meth:`on_link_up` says otherwise for that link (frames are received as
        their sender wrote them: checked or not)."""
        self.state = State.IDLE
        self.rank = 0
        self.world = 1
        self.incarnation = 0  # of this process (the tracker counts restarts)
        self.timeout = timeout
        self.checked = checked
        self.version = 0
        self.seqno = 0
        self.links: dict[int, Link] = {}
        self.dead_links: dict[int, str] = {}
        self.active: ActiveCall | None = None
        self.error: RabitError | None = None
        self.last_progress = 0.0
        self._calls_completed = 0
        self.planner = Planner(self, ring_mincount, tree_chunk, ring_min_bytes)
        self.receiver = Receiver(self)
        self.sender = Sender(self)
        self.peers = Peers(self)
        self.failures = Failures(self)
        self.express = Express(self)
        # present only with recovery on (docs/recovery.md)
        self.recovery = (Recovery(self, timeout=recover_timeout, retain_bytes=retain_bytes,
                                  local_replica=local_replica) if recover else None)

    # ------------------------------------------------------------------ lifecycle events

    def go(self, event: fsm.Event) -> None:
        try:
            self.state = TRANSITIONS[(self.state, event)]
        except KeyError:
            fsm.transition(self.state, event)  # raises InvalidTransition, with the pair

    def start(self) -> None:
        self.go(Event.START)

    def connect_tracker(self, rank: int, world: int) -> None:
        """The tracker assigned our rank: the topology and the set of links follow."""
        if not 0 <= rank < world:
            raise ProtocolError(f"tracker assigned rank {rank} of {world}")
        self.go(Event.CONNECT_TRACKER)
        self.rank, self.world = rank, world
        self.links = {p: Link() for p in topology(rank, world).neighbors}
        for link in self.links.values():
            link.checked = self.checked

    def connect_peers(self) -> None:
        self.go(Event.CONNECT_PEERS)

    def accept_peers(self, now: float) -> None:
        self.go(Event.ACCEPT_PEERS)
        self.last_progress = now

    def bootstrap_failed(self, error: RabitError) -> None:
        self.go(Event.OP_FAILED)
        self.error = error

    def shutdown(self, check: bool = True) -> list[Command]:
        """Leave the job.  A call still in progress (its caller gave up) fails first; with
        ``check``, so does a peer's call this rank never made (a sequence mismatch)."""
        cmds: list[Command] = []
        if self.active is not None:
            self.fail(PeerLostError(f"rank {self.rank} finalized during a call"), cmds)
        elif check and self.state is not State.FAILED:
            # a frame of a call this rank never made, read ahead and held: a peer made more
            # calls (it waits for this rank, which will never join it)
            for peer, link in self.links.items():
                if link.mode is Mode.HELD and link.frame is not None:
                    self.fail(after_finalize(peer, link.frame.call_id, self.rank,
                                             (self.version, self.seqno)), cmds)
                    break
        self.go(Event.SHUTDOWN)
        return cmds

    # ------------------------------------------------------------------ receive side

    def recv_buffer(self, peer: int) -> memoryview:
        """Where the next bytes from ``peer`` must land (never empty)."""
        return self.receiver.recv_buffer(peer)

    def discard_buffer(self) -> memoryview:
        """Where bytes of a connection that was replaced go (they are never looked at)."""
        return self.receiver.discard_buffer()

    def on_bytes(self, peer: int, nbytes: int, now: float) -> list[Command]:
        """``nbytes`` landed in the buffer returned by the last :meth:`recv_buffer`."""
        return self.receiver.on_bytes(peer, nbytes, now)

    def received(self, plan: Plan, peer: int, pos: int) -> None:
        """``peer``'s stream of the call holds ``pos`` bytes now."""
        self.receiver.received(plan, peer, pos)

    def size_to(self, plan: TreeBroadcast, total: int, active: ActiveCall) -> None:
        """A broadcast of unknown size learned its size: lay out its streams."""
        self.planner.size_to(plan, total, active)

    # ------------------------------------------------------------------ calls

    def choose_allreduce(self, nbytes: int, itemsize: int) -> CollectiveKind:
        """The allreduce algorithm for ``nbytes`` of ``itemsize``-byte elements."""
        return self.planner.choose_allreduce(nbytes, itemsize)

    def begin(self, call: Call, now: float,
              sent_ahead: Sequence[int] = ()) -> list[Command]:
        """Start a collective.  Raises the recorded error if the agent has failed.

        ``sent_ahead``: peers an express start of the call (:mod:`rabit2.core.express_tree`)
        wrote its one frame of the whole out-stream to already; it counts as sent."""
        if self.state is State.FAILED:
            assert self.error is not None
            raise self.error
        nxt = fsm.transition(self.state, CALL_EVENTS[call.kind])  # refuse before building
        plan = self.planner.plan(call)  # may raise ValueError; the agent is unchanged then
        desc = self.planner.descriptor(call)
        self.state = nxt
        call_id = (self.version, self.seqno)
        self.seqno += 1
        active = ActiveCall(call, call_id, desc, plan)
        self.active = active
        for peer in sent_ahead:
            nbytes = plan.out_streams[peer].length
            active.sent[peer] = nbytes
            self.sender.bytes_sent += nbytes
            self.sender.frames_sent += 1
        recovery = self.recovery
        if (recovery is not None and isinstance(plan, TreeBroadcast) and plan.in_link >= 0
                and plan.sized):
            recovery.start_mirror(active, plan)
        self.last_progress = now
        cmds: list[Command] = []
        if recovery is None:
            for peer in self.dead_links:
                if peer in plan.in_streams or peer in plan.out_streams:
                    self.fail(self.peers.lost(peer), cmds, source=peer)
                    return cmds
        held: list[int] = []
        for peer, link in self.links.items():
            link.pos = 0
            link.phase_go(PhaseEvent.RELEASE)  # a need awaited was about the call that ended
            mode = link.mode
            if mode is Mode.HELD:
                held.append(peer)
            elif mode is not Mode.BLOB:
                link.remaining = 0
        if recovery is not None:
            try:
                recovery.begin(active, cmds)
            except RabitError as exc:
                self.fail(exc, cmds)
                return cmds
        # frames of this call that arrived early were held: replay their headers now
        if held and not self.receiver.release_held(held, active, now, cmds):
            return cmds
        if self.active is not active:
            return cmds
        if recovery is not None and self.dead_links:
            recovery.skip_lost(active)
        if self.dead_links and any(not self.links[p].up and active.needs_input(p)
                                   for p in plan.in_streams):
            self.go(Event.PEER_DOWN)  # a lost neighbour's input: wait for its replacement
        self.advance(cmds)
        return cmds

    def advance(self, cmds: list[Command]) -> None:
        """The transitions an input derives, taken in one pass after it (after each frame,
        for bytes): send every out-stream byte that became ready, and complete the call if
        nothing more is due in or out.  Handlers change records; only this moves a call on."""
        active = self.active
        if active is not None and self.error is None:
            self.sender.pump(active, cmds)
            self.maybe_complete(active, cmds)

    def maybe_complete(self, active: ActiveCall, cmds: list[Command]) -> None:
        if self.active is not active:
            return  # already completed (or failed) earlier in this event
        if active.fetching or active.resume_wait is not None:
            return
        plan = active.plan
        if not active.skip_in:
            if not plan.receiving_done():
                return
            if 0 in active.frames_seen.values():
                return
        elif any(active.needs_input(p) for p in plan.in_streams):
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
        if self.recovery is not None:
            self.recovery.on_complete(active, active.desc.kind in EVERY_RANK_CONTRIBUTES)
        self.go(Event.OP_COMPLETE)
        # (a fetched result is in the caller's buffer already)
        cmds.append(CallComplete(active.call_id, None if active.has_result else plan.finish))

    def count_express(self, sent: int, frames_sent: int, received: int,
                      frames_received: int) -> None:
        """An express call (:mod:`rabit2.core.express`) sent ``frames_sent`` frames with
        ``sent`` payload bytes, received ``frames_received`` with ``received``, and
        completed."""
        self._calls_completed += 1
        self.sender.bytes_sent += sent
        self.sender.frames_sent += frames_sent
        self.receiver.bytes_received += received
        self.receiver.frames_received += frames_received

    def uncount_frame(self) -> None:
        """A header counted as received was put back, to be read again (an express call
        took a held frame)."""
        self.receiver.frames_received -= 1

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, blob: bytes | Callable[[], bytes] | None = None) -> int:
        """Start a new version: sequence numbers restart at zero (rabit's call identity).

        With recovery on, ``blob`` (the pickled global model, or a function that pickles it
        when a restarted neighbour asks) is kept for two versions, and so are the results
        of the calls made in them."""
        if self.active is not None:
            raise RabitError("checkpoint inside a collective")
        self.version += 1
        self.seqno = 0
        if self.recovery is not None:
            self.recovery.on_checkpoint(self.version, blob)
        return self.version

    def push_local(self, local: bytes) -> list[Command]:
        """With recovery on, hand this rank's local model of the current version to the next
        ``local_replica`` ranks of the ring (not waited for: see ``load_checkpoint``)."""
        cmds: list[Command] = []
        if self.recovery is not None:
            self.recovery.replicas.push(local, cmds)
        return cmds

    def load_checkpoint(self, with_local: bool = False) -> list[Command]:
        """A restarted rank asks its neighbours for the checkpoint it resumes from (and, with
        ``with_local``, for its own local model, which the ring's next rank holds); the
        answer comes as :class:`CheckpointLoaded`.  Raises :class:`UnrecoverableError` if no
        live neighbour holds what is needed."""
        if self.error is not None:
            raise self.error  # e.g. the job was aborted while this worker started
        cmds: list[Command] = []
        if self.recovery is not None:
            self.recovery.replay.load_checkpoint(with_local, cmds)
        elif self.version and not with_local:
            raise UnrecoverableError(f"no live neighbour of rank {self.rank} holds "
                                     f"checkpoint version {self.version} (recovery is off)")
        else:
            self.version = self.seqno = 0
            cmds.append(CheckpointLoaded(0, None))
        return cmds

    def keep_bootstrap(self) -> str | None:
        """The program's first ``load_checkpoint`` in a worker that was not restarted (a
        restarted one does this in :meth:`load_checkpoint`): with recovery on, the results
        of the calls made before it are kept for the rest of the job, so that a worker
        restarted after later checkpoints can replay them (``docs/recovery.md``, "What every
        rank keeps").  Why they are not kept, if they are not."""
        if self.recovery is None:
            return None
        return self.recovery.results.keep_bootstrap(self.seqno if self.version == 0 else 0)

    def fail_load(self, error: UnrecoverableError) -> list[Command]:
        """:meth:`load_checkpoint` raised ``error``: this rank fails with it (the neighbours
        hear it, so they stop waiting for this rank's replay)."""
        cmds: list[Command] = []
        self.fail(error, cmds)  # (no-op for a rank that failed already)
        return cmds

    # ------------------------------------------------------------------ links

    def on_link_up(self, peer: int, incarnation: int, now: float,
                   checked: bool | None = None) -> list[Command]:
        """A (new) connection to ``peer`` is ready: tell it where this rank stands.
        ``checked``: whether the frames sent on it carry payload checksums (None: this
        agent's default).

        Called for every link at ``init`` and again whenever a lost neighbour's
        replacement (or the same process, after a reset) connects.  Framing starts afresh;
        a call in progress sends nothing more to ``peer`` until ``peer`` says with a
        ``need`` from which offset it wants this rank's stream (``docs/recovery.md``)."""
        del now
        return self.peers.link_up(peer, incarnation, checked)

    def fence(self, peer: int, incarnation: int) -> None:
        """Raises :class:`ProtocolError` if ``incarnation`` of ``peer`` may not take the
        link (:meth:`rabit2.core.peers.Peers.fence`)."""
        self.peers.fence(peer, incarnation)

    def link_incarnation(self, peer: int) -> int | None:
        """The incarnation of the process at the other end of the link to ``peer`` (the
        last one that connected); None if ``peer`` is not a neighbour."""
        link = self.links.get(peer)
        return None if link is None else link.incarnation

    def link_is_up(self, peer: int) -> bool:
        link = self.links.get(peer)
        return link is not None and link.up

    def link_down_reason(self, peer: int) -> str | None:
        """Why the link to ``peer`` went down, while it is down (None: it is not)."""
        return self.dead_links.get(peer)

    @property
    def bootstrapping(self) -> bool:
        """Between ``start`` and the end of wiring."""
        return self.state in _BOOTSTRAP

    @property
    def ended(self) -> bool:
        """Finalized or failed: no call will run any more."""
        return self.state is State.TASK_COMPLETE or self.state is State.FAILED

    @property
    def bytes_received(self) -> int:
        return self.receiver.bytes_received

    def states_known(self) -> bool:
        """Every neighbour has sent its state (a restarted rank waits for this in init)."""
        return self.recovery is None or self.recovery.states_known()

    def on_hangup(self, peer: int, reason: str, now: float) -> list[Command]:
        """The link to ``peer`` closed or failed."""
        return self.peers.hangup(peer, reason, now)

    def on_peer_dead(self, peer: int, now: float) -> list[Command]:
        """The tracker says the process at the other end of the (lost) link to ``peer``
        died: a replacement will replay what it missed, rather than the same process
        reconnecting and going on (a reset).  From here this rank runs ahead of it."""
        del now
        return self.peers.dead(peer)

    def on_send_progress(self, now: float) -> None:
        """The I/O layer saw bytes of this rank leave on a link (the kernel took some of
        what was queued): that is progress too, for a rank that only sends for a while (a
        broadcast's root, a leaf sending its input up a slow link)."""
        if self.active is not None:
            self.last_progress = max(self.last_progress, now)

    def on_tick(self, now: float) -> list[Command]:
        """Check the deadlines: no byte moved for ``timeout`` seconds, or a lost input not
        back within ``recover_timeout``, fails the call."""
        return self.failures.tick(now)

    def abort(self, reason: str) -> list[Command]:
        """The tracker aborted the job."""
        return self.failures.abort(reason)

    def fail(self, error: RabitError, cmds: list[Command], *, source: int = -1,
             close: int = -1, flood: bool = True) -> None:
        """Fail with ``error`` (:meth:`rabit2.core.failures.Failures.fail`)."""
        self.failures.fail(error, cmds, source=source, close=close, flood=flood)

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> AgentStats:
        return AgentStats(self.state.value, self._calls_completed, self.sender.bytes_sent,
                          self.receiver.bytes_received, self.sender.frames_sent,
                          self.receiver.frames_received)

    def recovery_statistics(self) -> dict[str, int]:
        """Counters of the recovery protocol (links re-established, bytes fetched for
        replay, bytes resent because a receiver asked for them again, calls replayed from a
        neighbour's result, calls resumed at an offset; all 0 with recovery off) and of the
        frames that failed their checksum."""
        stats = (self.recovery.statistics() if self.recovery is not None else
                 {"links_up": 0, "fetched_bytes": 0, "resent_bytes": 0, "replayed_calls": 0,
                  "resumed_calls": 0})
        stats["corrupt_frames"] = self.receiver.corrupt_frames
        return stats

    def assigned(self, incarnation: int) -> None:
        """The tracker counts this process as ``incarnation`` of its task: from 1 on it
        replaces a lost one and, with recovery on, replays (its neighbours' states first)."""
        self.incarnation = incarnation
        if self.recovery is not None and incarnation > 0:
            self.recovery.replay.restarted = True

    @property
    def replay_overflow(self) -> int:
        """The latest version whose results outgrew ``rabit2_replay_mb`` (-1: none)."""
        return self.recovery.results.overflowed if self.recovery is not None else -1

    @property
    def restarted(self) -> bool:
        """This rank replaces a lost one and has not caught up with its neighbours yet."""
        return self.recovery is not None and self.recovery.replay.restarted

    def replays(self) -> bool:
        """True if the next call's result will be fetched from a neighbour (a restarted
        rank replaying a call the others finished): ``prepare_fun`` is not called then."""
        return self.recovery is not None and self.recovery.replay.replays_next()

    # ------------------------------------------------------------------ sending

    def send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        """Send a CONTROL frame carrying ``msg``."""
        self.sender.send_control(peer, msg, cmds)

    def send_frame(self, peer: int, parts: Sequence[bytes | memoryview],
                   cmds: list[Command]) -> None:
        """Send one frame: a packed header and its payload."""
        self.sender.send_frame(peer, parts, cmds)
