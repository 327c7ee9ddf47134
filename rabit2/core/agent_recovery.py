"""The agent's part in lazy recovery (``docs/recovery.md``): link (re)connects and the
``state`` exchange, a restarted rank's replay (fetch or resume each call), the answers a
survivor gives (``need``, ``fetch``), checkpoints and local models handed to neighbours.

Sans-I/O like the rest of the agent: every method takes and returns commands.
:class:`RecoveryMixin` is a base of :class:`rabit2.core.agent.Agent`, which owns the state
named in the ``TYPE_CHECKING`` block below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rabit2.core import fsm
from rabit2.core.control import encode_body
from rabit2.core.framing import (
    MAX_BROADCAST,
    CallDescriptor,
    CollectiveKind,
    FrameKind,
    checksum,
    pack_header,
)
from rabit2.core.records import (
    NO_CALL,
    RESUME_EVENTS,
    ActiveCall,
    CheckpointLoaded,
    Command,
    Fetch,
    Link,
    Mode,
    Send,
)
from rabit2.core.recovery import (
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
from rabit2.core.schedule import Plan, RingAllreduce, TreeBroadcast
from rabit2.errors import MismatchError, ProtocolError, RabitError, UnrecoverableError

State, Event = fsm.State, fsm.Event


MAX_PENDING_NEEDS = 64
"""Needs a peer may send for calls this rank has not begun (a replaying peer runs ahead
through calls that this rank is still to make)."""


def _sends_to(plan: Plan, peer: int) -> bool:
    """Whether ``plan`` has (or, a broadcast whose size is not known yet, will have) an
    out-stream to ``peer``."""
    return peer in plan.out_streams or (isinstance(plan, TreeBroadcast) and not plan.sized
                                        and peer in plan.out_links)


class RecoveryMixin:
    """Recovery behaviour of :class:`~rabit2.core.agent.Agent` (see the module docstring)."""

    if TYPE_CHECKING:  # owned by Agent
        state: fsm.State
        rank: int
        world: int
        version: int
        seqno: int
        links: dict[int, Link]
        dead_links: dict[int, str]
        active: ActiveCall | None
        error: RabitError | None
        recover: bool
        incarnation: int
        results: ResultStore
        checkpoints: dict[int, bytes | Callable[[], bytes]]
        local_replica: int
        local_models: dict[tuple[int, int], bytes]
        down_since: dict[int, float]
        lost_in_version: dict[int, int]
        peer_states: dict[int, PeerState]
        restarted: bool
        _loading: dict[str, Any]
        _no_live_at_load: tuple[int, ...]
        _no_live_incs: dict[int, int]
        _fetches: dict[int, Fetch]
        _next_request: int
        _pending_states: bool
        _watch_replays: bool
        _recovery_stats: dict[str, int]
        _frames_sent: int
        checked: bool

        def _go(self, event: fsm.Event) -> None: ...
        def _pump(self, active: ActiveCall, cmds: list[Command]) -> None: ...
        def _maybe_complete(self, active: ActiveCall, cmds: list[Command]) -> None: ...
        def _size_to(self, plan: TreeBroadcast, total: int, active: ActiveCall) -> None: ...
        def _received(self, plan: Plan, peer: int, pos: int) -> None: ...
        def _fail(self, error: RabitError, cmds: list[Command], *, source: int = -1,
                  close: int = -1, flood: bool = True) -> None: ...
        @staticmethod
        def _needs_input(active: ActiveCall, peer: int) -> bool: ...

    # ------------------------------------------------------------------ local models

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
            header = pack_header(FrameKind.BLOB, NO_CALL, version, 0, 0, len(blob),
                                 self.incarnation, self._payload_crc(peer, blob))
            cmds.append(Send(peer, [header, blob]))
            self._frames_sent += 1

    def _on_local(self, peer: int, link: Link, msg: dict[str, Any],
                  cmds: list[Command]) -> None:
        size, owner, version, hops = msg["size"], msg["owner"], msg["version"], msg["hops"]
        if not (0 <= size <= MAX_BROADCAST and 0 <= owner < self.world and version >= 0
                and hops >= 1):
            raise ProtocolError(f"rank {peer} hands on a malformed local model")
        fetch = Fetch(0, peer, "replica", (version, owner), True,
                       memoryview(bytearray(size)), hops)
        link.blob, link.blob_fetch = fetch.dest or memoryview(b""), fetch
        if not size:
            self._blob_done(link, cmds)

    def _stored_local(self, fetch: Fetch, cmds: list[Command]) -> None:
        """A local model handed on along the ring arrived: keep it and pass it on."""
        assert fetch.dest is not None
        version, owner = fetch.call
        blob = bytes(fetch.dest)
        self._keep_local(owner, version, blob)
        nxt = (self.rank + 1) % self.world
        if fetch.hops > 1 and nxt != owner and self.links[nxt].up:
            self._send_local(nxt, owner, version, fetch.hops - 1, blob, cmds)

    # ------------------------------------------------------------------ recovery

    def on_link_up(self, peer: int, incarnation: int, now: float,
                   checked: bool | None = None) -> list[Command]:
        """A (new) connection to ``peer`` is ready: tell it where this rank stands.
        ``checked``: whether the frames sent on it carry payload checksums (None: this
        agent's default).

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
        same_process = incarnation == link.incarnation
        link.incarnation = incarnation
        link.checked = self.checked if checked is None else checked
        link.up = True
        link.state = link.pending = link.need_sent = None
        self.dead_links.pop(peer, None)
        self.down_since.pop(peer, None)
        self.lost_in_version.pop(peer, None)
        active = self.active
        link.reset_framing(active.plan.received.get(peer, 0) if active is not None else 0)
        link.up_call = active.call_id if active is not None else None
        link.up_at = link.up_call or (self.version, self.seqno)
        if was_down:
            self._recovery_stats["links_up"] += 1
            if active is not None and _sends_to(active.plan, peer):
                link.awaiting_need = True
        if self.recover:
            link.awaiting_state = True
            self._send_control(peer, self._state_for(peer).to_msg(), cmds)
            if was_down and same_process:
                self._reissue_fetches(peer, cmds)
            elif not same_process:
                # asked of a neighbour that died (parked, or still in flight if its
                # replacement connected before the old link was seen to go down): the
                # replacement holds none of it
                try:
                    for fetch in [f for f in self._fetches.values() if f.peer == peer]:
                        self._refetch(fetch, cmds)
                except RabitError as exc:
                    self._fail(exc, cmds)
                    return cmds
            hops = dict(self._replica_targets()).get(peer)
            if was_down and hops is not None:
                # a ring neighbour came back without the replicas of our local model
                for (owner, version), blob in sorted(self.local_models.items()):
                    if owner == self.rank:
                        self._send_local(peer, owner, version, hops, blob, cmds)
        if (active is not None and self.state is State.PEER_ERROR
                and all(self.links[p].up for p in active.plan.in_streams)):
            self._go(RESUME_EVENTS[active.call.kind])
        del now
        return cmds

    def _state_for(self, peer: int) -> PeerState:
        active = self.active
        at = active.call_id if active is not None else (self.version, self.seqno)
        need, seen = -1, False
        if active is not None and peer in active.plan.in_streams and peer not in active.skip_in:
            need = active.plan.received[peer]
            seen = active.frames_seen.get(peer, 0) > 0
        locals_ = tuple(sorted(v for owner, v in self.local_models if owner == peer))
        return PeerState(self.incarnation, at, active is not None, need, seen,
                         self._replaying(), tuple(sorted(self.checkpoints)),
                         self.results.oldest, locals_)

    def _replaying(self) -> bool:
        """A restarted rank before the call its neighbours are in.  Once it is in that call
        (resumed at the offsets), or past it between two calls, it answers a neighbour like
        a survivor: a neighbour still blocked in that call waits for this rank's word on it
        (a result, or ``need -1``), which a rank that says it replays would never give."""
        if not self.restarted:
            return False
        active = self.active
        if active is not None:
            return active.call_id < self._live_frontier()
        return (self.version, self.seqno) <= self._live_frontier()

    def _on_state(self, peer: int, link: Link, state: PeerState,
                  cmds: list[Command]) -> None:
        if state.incarnation != link.incarnation:
            raise ProtocolError(f"rank {peer} states incarnation {state.incarnation} on a "
                                f"link opened by incarnation {link.incarnation}")
        link.state = state
        link.awaiting_state = False
        self._watch_replays = self._watch_replays or state.recovering
        if (self._no_live_incs.get(peer) == state.incarnation and state.recovering
                and state.at[0] > self.version):
            # a neighbour that was restarting when this rank took its checkpoint version for
            # want of a live neighbour has since resumed from a later one: the calls this
            # rank replays will never be made by it (without this, both wait in different
            # calls until the progress deadline).  The same process only: a neighbour
            # restarted again later may rightly be a checkpoint ahead of this rank
            raise UnrecoverableError(self._version_zero_wrong(peer, state.at[0]))
        if self._replaying():
            self.peer_states[peer] = state
            # (a reset while this rank replays)
            if not self._stand_in(peer, state, cmds):
                self._resend_after_reset(peer, link, state, cmds)
        else:
            self._settle_state(peer, link, state, cmds)
        if self.active is not None and self.error is None:
            self._pump(self.active, cmds)
            self._maybe_complete(self.active, cmds)

    def _version_zero_cause(self, found: str = "") -> str:
        """Why a rank that took checkpoint version 0 for want of a live neighbour fails;
        ``found``: what showed that version to be wrong."""
        tail = "three or more neighbouring ranks lost together, docs/recovery.md"
        return (f"rank {self.rank} took checkpoint version 0: every neighbour, rank(s) "
                f"{list(self._no_live_at_load)}, was restarted too, and none could say which "
                f"version the job is at; " + (f"{found} ({tail})" if found else tail))

    def _version_zero_wrong(self, peer: int, version: int) -> str:
        return self._version_zero_cause(f"rank {peer} resumed from version {version}")

    def _settle_state(self, peer: int, link: Link, state: PeerState,
                      cmds: list[Command]) -> None:
        """A live rank hears where a peer stands on a new connection to it."""
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if state.active and state.at >= current and (active is None or state.at > current):
            # a call we have not begun (the peer may be replaying): settled when we begin it
            link.pending = state
            self._pending_states = True
        if state.recovering:
            if self._stand_in(peer, state, cmds) or active is None:
                return
            if state.at < active.call_id and _sends_to(active.plan, peer):
                # a replaying peer behind the call we began while its state was on the
                # way (nothing of it was sent: the state was awaited): hold it back for
                # its need, as _hold_for_replaying does at begin
                offset = link.pending_needs.pop(active.call_id, None)
                if offset is None:
                    link.awaiting_need = True
                else:
                    self._apply_need(active, peer, offset)
                return
            self._resend_after_reset(peer, link, state, cmds)
            return  # otherwise it says what it needs with a "need" when it gets there
        # the same process came back on a new connection (the old one was reset): its state
        # says how much of our stream of its current call it holds
        if self._stand_in(peer, state, cmds) or active is None:
            return
        if state.at == active.call_id:
            if link.up_call == active.call_id:
                # both were in this call when the link came up: resend what the old
                # connection lost (a peer that had not begun it needs all of it)
                link.awaiting_need = False
                self._apply_need(active, peer, state.need if state.active else 0,
                                 seen=state.seen)
            elif state.active and link.up_at < active.call_id and peer in active.plan.in_streams:
                # we were behind when the link came up and began this call since: the peer
                # still waits to hear how much of its stream we hold
                self._send_need(peer, active.call_id, active.plan.received[peer], cmds)
        elif state.at > active.call_id:
            link.awaiting_need = False  # it finished our call: it needs nothing more of it
            self._apply_need(active, peer, -1)

    def _resend_after_reset(self, peer: int, link: Link, state: PeerState,
                            cmds: list[Command]) -> None:
        """Where a restarted rank (on either side) will send no ``need`` for our current
        call, the state is the answer: the peer is past the call (it needs none of our
        stream), or the link reset while both were in it (resend from its ``need``, as
        between two survivors)."""
        active = self.active
        if active is None:
            return
        if state.at > active.call_id:
            link.awaiting_need = False
            self._apply_need(active, peer, -1)
        elif (state.active and state.at == active.call_id
              and link.up_call == active.call_id):
            link.awaiting_need = False
            self._apply_need(active, peer, state.need, seen=state.seen)
        elif (state.active and state.at == active.call_id
              and peer in active.plan.in_streams and peer not in active.skip_in):
            # we began this call after the link came up: the peer, in it already, waits to
            # hear how much of its stream we hold
            self._send_need(peer, active.call_id, active.plan.received[peer], cmds)

    def _stand_in(self, peer: int, state: PeerState, cmds: list[Command]) -> bool:
        """``peer`` is still in a call this rank finished (it may be in a later one, or
        between calls, or replaying), and this rank's stream of it went down with the old
        connection: send the retained result in its place.  Not when the peer takes none of
        our stream of that call (need -1, a link off the call's route): its input comes from
        another rank, which is still sending it."""
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if not (state.active and state.at < current and state.need >= 0):
            return False
        got = self.results.get(state.at)
        if got is not None:
            self._reply(peer, 0, state.at, got[0], got[1], cmds)
        elif state.at < self.results.oldest:
            # dropped (more than two checkpoints ago, or too large to keep): say so, and
            # the peer fails at once if it still needs our bytes of that call
            self._reply(peer, 0, state.at, NO_CALL, None, cmds,
                        f"rank {self.rank} finished call {state.at} and no longer retains "
                        "its result (it ran more than two checkpoints ahead, or the result "
                        "is larger than rabit2_replay_mb)")
        else:
            return False
        return True

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

    def _begin_replay(self, active: ActiveCall, cmds: list[Command]) -> None:
        """A restarted rank starts a call: fetch it, resume it, or run it as usual."""
        call = active.call_id
        if call > self._live_frontier():
            self.restarted = False  # caught up: from here on this rank is a survivor
            self.peer_states = {}  # a new dict: the API thread may be reading the old one
            self._need_from_all(active, cmds, caught_up=True)
            return
        roles, recovering, skipped = self._classify(call)
        plan = active.plan
        if skipped & set(plan.in_streams) and not any(r is Role.FINISHED for r in roles.values()):
            why = f" ({self._version_zero_cause()})" if self._no_live_at_load else ""
            raise UnrecoverableError(
                f"rank {self.rank} replays call {call}, which needs input from rank(s) "
                f"{sorted(skipped & set(plan.in_streams))}, restarted too and resumed from a "
                f"later checkpoint, and no live neighbour finished it{why}")
        active.skip_in.update(skipped)
        finished = [p for p, role in roles.items() if role is Role.FINISHED]
        live = [p for p, role in roles.items() if role is Role.LIVE]
        if not finished and not live:
            self._need_from_all(active, cmds)
            return
        if finished and isinstance(plan, TreeBroadcast) and roles.get(plan.in_link) is Role.FRESH:
            # a broadcast that reached the neighbours who finished it by another route:
            # this rank's in-link has not begun it, and will send the whole stream when it
            # does.  Fetching the result as well would end the call under that stream
            self._recovery_stats["resumed_calls"] += 1
            needs = {p: -1 for p in live}  # (downstream: their announce frames are not needed)
            active.skip_in.update(p for p, role in roles.items() if role is not Role.FRESH)
            active.skip_in.update(recovering)
            for p in finished:
                self._apply_need(active, p, -1)
        elif finished:
            self._recovery_stats["replayed_calls"] += 1
            self._fetch_result(active, finished, cmds)
            needs = {p: -1 for p in live}  # their streams of this call are not needed now
            active.skip_in.update(p for p, role in roles.items() if role is not Role.FRESH)
            active.skip_in.update(recovering)
            for q, role in roles.items():
                # a neighbour that finished needs nothing; one that has not started needs
                # the whole stream, which must then be made of result bytes
                if role is not Role.LIVE:
                    self._apply_need(active, q, -1 if role is Role.FINISHED else 0)
        else:
            self._recovery_stats["resumed_calls"] += 1
            # a neighbour restarted too whose need decides where our in-streams restart
            # (ring: the previous rank; tree: the parent) is waited for: it computes that
            # need from its own live neighbours first
            wait = {q: link.pending_needs.get(call) for q in plan.resume_needs()
                    if q in recovering and (link := self.links[q]).up
                    and link.state is not None and link.state.recovering}
            # (one that has caught up since is a survivor that sends no need: it holds
            # nothing of our stream of this call, which we have not begun until now)
            active.resume_wait = wait
            for q in wait:
                # what we need of its own stream does not depend on the resume (the parent
                # resends the result from 0; the ring's previous rank sends us nothing).
                # Said now: it may be behind, in a call we skipped, waiting to hear from us
                self._send_need(q, call, 0 if q in plan.in_streams else -1, cmds)
            self._resume(active, cmds)
            return
        self._settle_live(active, live, needs, cmds)

    def _settle_live(self, active: ActiveCall, live: list[int], needs: dict[int, int],
                     cmds: list[Command]) -> None:
        """Send our stream to each live neighbour from its need, tell it where we need its
        own (``needs``), and tell every other neighbour where ours of this call starts."""
        for q in live:
            st = self.peer_states[q]
            self._apply_need(active, q, st.need, seen=st.seen)
            if q in active.plan.in_streams:
                self._send_need(q, active.call_id, needs[q], cmds)
        self._need_from_all(active, cmds)

    def _classify(self, call: CallId) -> tuple[dict[int, Role], set[int], set[int]]:
        """Each neighbour's role in ``call`` of the replay, and which are restarted too.  A
        neighbour restarted too is not a live neighbour: its state is a snapshot from before
        its replay got here; it says where it needs our stream with a "need" when it gets to
        the call (held for it till then).  Past the call, it is finished (it can serve the
        result) if it replayed it, or it *skipped* the call (it resumed from a later
        checkpoint): then it needs nothing of ours and sends nothing."""
        roles = {p: role_of(st, call) for p, st in self.peer_states.items()}
        recovering = {p for p, st in self.peer_states.items()
                      if st.recovering and roles[p] is not Role.FINISHED}
        skipped = {p for p, st in self.peer_states.items()
                   if st.recovering and roles[p] is Role.FINISHED and st.oldest > call}
        for p in recovering | skipped:
            del roles[p]
        return roles, recovering, skipped

    def _resume(self, active: ActiveCall, cmds: list[Command]) -> None:
        """Resume the call the live neighbours are blocked in, once every awaited need of
        a neighbour restarted too is in."""
        wait = active.resume_wait
        if wait is not None and any(v is None for v in wait.values()):
            return
        active.resume_wait = None
        call, plan = active.call_id, active.plan
        roles, recovering, _ = self._classify(call)
        live = [p for p, role in roles.items() if role is Role.LIVE]
        out_needs = {q: max(0, self.peer_states[q].need) for q in live}
        for q in recovering:
            # its need if it already said it, else the lower bound: all of the stream.  A
            # neighbour that takes none of it (-1: it fetches the result, so the whole
            # result exists and nothing of ours is needed there) counts as holding it all
            told = (wait or {}).get(q)
            if told is None:
                told = self.links[q].pending_needs.get(call, 0)
            stream = plan.out_streams.get(q)
            out_needs[q] = stream.length if told < 0 and stream is not None else max(0, told)
        resume = plan.resume(out_needs)
        needs = {p: resume.in_from.get(p, -1) for p in live}
        for p, offset in resume.in_from.items():
            self.links[p].pos = offset
            stream = plan.in_streams[p]
            if offset and p not in live and p not in recovering:
                raise UnrecoverableError(
                    f"rank {self.rank} must resume call {call} at byte {offset} of rank "
                    f"{p}'s stream, but rank {p} has not started that call")
            if offset >= stream.length > 0:
                active.frames_seen[p] = 1  # nothing is left to come from there
        for peer, lo, hi in resume.fetch:
            if peer in recovering:
                raise UnrecoverableError(
                    f"rank {self.rank} must resume call {call} with result bytes "
                    f"[{lo}, {hi}) that only rank {peer} held, and it was restarted too "
                    "(two neighbours lost in the same call, docs/recovery.md)")
            self._request(peer, "result", call, lo, hi, active.call.buf[lo:hi], cmds,
                          active)
        for q in recovering:
            if q in plan.in_streams:
                self._send_need(q, call, resume.in_from.get(q, -1), cmds)
        self._settle_live(active, live, needs, cmds)

    def _answer_wait(self, active: ActiveCall | None, peer: int, need: int,
                     cmds: list[Command]) -> None:
        """``peer``'s need (or what stands for it) for the call our resume waits on it for."""
        wait = active.resume_wait if active is not None else None
        if active is not None and wait is not None and wait.get(peer, 0) is None:
            wait[peer] = need
            self._resume(active, cmds)

    def _need_from_all(self, active: ActiveCall, cmds: list[Command],
                       caught_up: bool = False) -> None:
        """A replaying rank tells every neighbour it has not told yet where its stream of
        this call starts: all of it if this rank takes it, none otherwise (they hold their
        streams back for it; ``docs/recovery.md``)."""
        call, plan = active.call_id, active.plan
        for peer, link in self.links.items():
            if link.up and link.need_sent != call:
                takes = peer in plan.in_streams and peer not in active.skip_in
                self._send_need(peer, call, 0 if takes else -1, cmds, caught_up, held=True)

    def _fetch_result(self, active: ActiveCall, finished: list[int], cmds: list[Command]) -> None:
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

    def _on_need(self, peer: int, link: Link, call: CallId, offset: int,
                 cmds: list[Command], caught_up: bool = False, held: bool = False) -> None:
        """``peer`` holds ``offset`` bytes of our stream of ``call`` (-1: wants none of it).
        A replaying peer says where each call's stream starts for every call it begins
        (``held``: it holds nothing of it, so it only matters where this rank holds the
        stream back for it or has not begun the call; ``caught_up``: the peer is done
        replaying)."""
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if caught_up and link.state is not None:
            link.state = dataclasses.replace(link.state, recovering=False)
            if call < current:
                # waited for as a neighbour restarted too, it has caught up meanwhile: a
                # survivor now, it sends no need for our call, and holds none of it
                self._answer_wait(active, peer, 0, cmds)
            if (active is not None and call < current and link.awaiting_need
                    and _sends_to(active.plan, peer)):
                # held back for it in a later call: it will need all of that stream
                link.awaiting_need = False
                self._apply_need(active, peer, 0)
                self._pump(active, cmds)
                self._maybe_complete(active, cmds)
        if active is not None and call == current:
            self._answer_wait(active, peer, offset, cmds)  # (a neighbour restarted too)
            if (held and peer in active.plan.in_streams and peer not in active.skip_in
                    and link.need_sent != call and self.error is None):
                # a neighbour that began this call while this rank replayed holds its own
                # stream back until it hears where to start; this rank's need for it may
                # have gone to the process it replaced (a held need changes nothing where
                # the stream was not held back)
                self._send_need(peer, call, active.plan.received[peer], cmds, held=True)
            if held and not link.awaiting_need:
                return  # the stream was not held back: it is flowing from its start
            link.awaiting_need = False
            self._apply_need(active, peer, offset, cmds=cmds)
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
        elif len(link.pending_needs) < MAX_PENDING_NEEDS:
            # a replaying peer (or one past its replay while this rank replays) is ahead
            link.pending_needs[call] = offset  # applied when this rank begins that call
            self._answer_wait(active, peer, -1, cmds)  # past our call: it needs none of it
            if active is not None and link.awaiting_need:
                # held back for it, but it is past this call (it resumed from a later
                # checkpoint than this rank): it needs none of that stream
                link.awaiting_need = False
                self._apply_need(active, peer, -1)
                self._pump(active, cmds)
                self._maybe_complete(active, cmds)
            self._watch_replays = True
        else:
            raise ProtocolError(f"rank {peer} sent needs for more than {MAX_PENDING_NEEDS} "
                                f"calls rank {self.rank} has not started")

    def _hold_for_replaying(self, active: ActiveCall) -> None:
        """Starting a call: send nothing of it to a neighbour that is still replaying until
        it says from where (its ``need``, perhaps already here).  Frames of a later call
        would stop it reading the link, behind them, the results it fetches from us."""
        call = active.call_id
        for peer, link in self.links.items():
            if link.pending_needs:
                for old in [c for c in link.pending_needs if c < call]:
                    del link.pending_needs[old]
            offset = link.pending_needs.pop(call, None)
            if not link.up or not _sends_to(active.plan, peer):
                continue
            if offset is not None:
                self._apply_need(active, peer, offset)
            elif link.state is not None and link.state.recovering:
                state = link.state
                if state.at > call or any(c > call for c in link.pending_needs):
                    # it resumed past this call (from a later checkpoint): it needs none
                    self._apply_need(active, peer, -1)
                elif self.restarted and state.at == call and state.active:
                    # both replaying, it was in this call when our link came up: its state
                    # said what it holds of our stream, and it sends no other need for it
                    self._apply_need(active, peer, state.need, seen=state.seen)
                else:
                    link.awaiting_need = True
        self._watch_replays = any(
            link.pending_needs or (link.state is not None and link.state.recovering)
            for link in self.links.values())

    def _send_need(self, peer: int, call: CallId, offset: int, cmds: list[Command],
                   caught_up: bool = False, held: bool = False) -> None:
        """Tell ``peer`` from which byte of its stream of ``call`` to send (-1: none of it),
        once per call and connection."""
        link = self.links[peer]
        if link.need_sent == call:
            return
        link.need_sent = call
        self._send_control(peer, {"t": "need", "call": list(call), "from": offset,
                                  "caught_up": caught_up, "held": held}, cmds)

    def _apply_need(self, active: ActiveCall, peer: int, offset: int,
                    seen: bool = False, cmds: list[Command] | None = None) -> None:
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
        if offset < stream.length and not active.plan.serves_from(peer, offset):
            if (isinstance(plan, RingAllreduce) and cmds is not None and active.refill is None
                    and not active.fetching and self.links[plan.next].up
                    and (gap := plan.refill_range(offset)) is not None):
                # a neighbour lost again asks from before where this rank's resume restarted
                # its in-stream: fetch those bytes of the next rank's stream again (it still
                # holds them unless its own result overwrote them: then it says so)
                active.refill = (peer, offset, seen)
                self.links[peer].awaiting_need = True
                self._request(plan.next, "stream", active.call_id, gap[0], gap[1],
                              memoryview(bytearray(gap[1] - gap[0])), cmds, active)
                return
            # partial sums the result has overwritten here, or (after a resume, which asked
            # the in-streams only for what the out-streams needed then) bytes made from
            # skipped input: sending the buffer's content in their place would corrupt the
            # result
            raise UnrecoverableError(
                f"rank {peer} needs call {active.call_id} from byte {offset}, but rank "
                f"{self.rank} cannot make those bytes any more (the result has overwritten "
                "those partial sums, or this rank was restarted and resumed the call past "
                "them); recovery would need them (two neighbours lost in the same call, "
                "docs/recovery.md)")
        old = active.sent.get(peer, 0)
        self._recovery_stats["resent_bytes"] += max(0, old - offset)
        active.sent[peer] = offset
        active.started_empty.discard(peer)

    def _request(self, peer: int, what: str, call: CallId, lo: int, hi: int,
                 dest: memoryview | None, cmds: list[Command],
                 active: ActiveCall | None = None, tried: frozenset[int] = frozenset()) -> None:
        request = self._next_request
        self._next_request += 1
        fetch = Fetch(request, peer, what, call, lo == 0 and hi < 0, dest, lo=lo, hi=hi)
        fetch.tried = tried
        self._fetches[request] = fetch
        if active is not None:
            active.fetching += 1
        self._send_control(peer, {"t": "fetch", "id": request, "what": what,
                                  "call": list(call), "lo": lo, "hi": hi}, cmds)

    def _reissue_fetches(self, peer: int, cmds: list[Command]) -> None:
        """The link to ``peer`` was reset (the same process is back): what this rank had
        asked it for may be lost with the old connection.  Ask again on the new one (the
        answers land where the old ones would have; an unasked result cut off by the reset
        was dropped at the hang-up)."""
        lost = [f for f in self._fetches.values() if f.peer == peer]
        active = self.active
        for fetch in lost:
            self._fetches.pop(fetch.request, None)
            mine = fetch.of_call and active is not None and active.call_id == fetch.call
            if fetch.of_call and not mine:
                continue  # (a call that is over: nothing waits for it)
            if mine:
                assert active is not None
                active.fetching -= 1
            self._request(peer, fetch.what, fetch.call, fetch.lo, fetch.hi, fetch.dest, cmds,
                          active if mine else None)

    def _refetch(self, fetch: Fetch, cmds: list[Command], why: str = "",
                 park: bool = False) -> None:
        """The neighbour a fetch went to was lost (or no longer holds what was asked, ``why``:
        its state was older than its store): ask another one that holds the same.  With
        ``park`` (its link just went down, perhaps only reset), a fetch no other neighbour
        can serve waits for that link instead: the same process asks again when it is
        back (:meth:`_reissue_fetches`), a replacement makes it fail."""
        del self._fetches[fetch.request]
        active = self.active
        if active is not None and active.call_id == fetch.call and fetch.of_call:
            active.fetching -= 1
        tried = fetch.tried | {fetch.peer}
        for peer, st in self.peer_states.items():
            if peer in tried or not self.links[peer].up:
                continue
            if fetch.what == "checkpoint" and fetch.call[0] in st.versions:
                self._request(peer, "checkpoint", fetch.call, 0, -1, None, cmds, tried=tried)
                return
            if fetch.what == "local" and fetch.call[0] in st.locals:
                self._request(peer, "local", fetch.call, 0, -1, None, cmds, tried=tried)
                return
            if (fetch.what == "result" and fetch.whole and active is not None
                    and role_of(st, fetch.call) is Role.FINISHED and st.oldest <= fetch.call):
                self._request(peer, "result", fetch.call, 0, -1, fetch.dest, cmds, active,
                              tried=tried)
                return
        if park:
            self._fetches[fetch.request] = fetch
            if active is not None and active.call_id == fetch.call and fetch.of_call:
                active.fetching += 1
            return
        raise UnrecoverableError(
            f"rank {self.rank} cannot fetch {fetch.what} {fetch.call}: "
            f"{why or f'rank {fetch.peer} was lost while serving it'}, and no other neighbour "
            "holds it")

    def _on_fetch(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        what, call = msg["what"], call_id(msg["call"], "fetch.call")
        request, lo, hi = msg["id"], msg["lo"], msg["hi"]
        data: memoryview | None = None
        desc = NO_CALL
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
        elif what == "stream":
            # bytes of our stream of the current call to the asker, fetched again by a
            # restarted neighbour whose resume skipped them (see _apply_need)
            active = self.active
            plan = active.plan if active is not None else None
            stream = plan.out_streams.get(peer) if plan is not None else None
            if (active is None or plan is None or stream is None or active.call_id != call
                    or not 0 <= lo < hi <= plan.out_ready(peer)
                    or not plan.serves_from(peer, lo)):
                reason = (f"rank {self.rank} can no longer send bytes [{lo}, {hi}) of its "
                          f"stream of call {call}")
            else:
                desc, data = active.desc, memoryview(b"".join(stream.views(lo, hi)))
                lo, hi = 0, -1
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
                                 self.incarnation, self._payload_crc(peer, data))
            cmds.append(Send(peer, [header, data]))
            self._frames_sent += 1

    def _on_reply(self, peer: int, link: Link, msg: dict[str, Any],
                  cmds: list[Command]) -> None:
        call = call_id(msg["call"], "reply.call")
        size = msg["size"]
        if not 0 <= size <= MAX_BROADCAST:
            raise ProtocolError(f"rank {peer} replies with {size} B")
        request = msg["id"]
        active = self.active
        current = active.call_id if active is not None else (self.version, self.seqno)
        if request == 0 and not msg["found"]:
            # a neighbour that finished our call no longer holds its stream for us
            if active is not None and call == active.call_id and self._needs_input(active, peer):
                raise UnrecoverableError(f"rank {self.rank} cannot finish call {call}: "
                                         f"{msg['reason']}")
            return
        if request == 0 and (call < current or (active is not None and active.final
                                                 and call == current)):
            # a result sent for a call we meanwhile finished (or already have): read, drop.
            # It stands in for that peer's stream, which will not come any more
            fetch = Fetch(0, peer, "discard", call, True, memoryview(bytearray(size)))
            if active is not None and call == current:
                active.skip_in.add(peer)
                self._maybe_complete(active, cmds)
        elif request == 0:
            # our need reached a rank that had finished the call: it sent the result
            if active is None or active.call_id != call:
                raise ProtocolError(f"rank {peer} sent an unasked result of call {call}")
            # it lands in a buffer of its own and is copied into the caller's array once
            # whole: if the sender dies (or the link resets) half way, the call goes back
            # to waiting for that peer's stream with its own state untouched
            if (active.call.kind is not CollectiveKind.BROADCAST
                    and size != len(active.call.buf)):
                raise MismatchError(f"sequence mismatch: rank {peer} holds {size} B of call "
                                    f"{call}, rank {self.rank} has {len(active.call.buf)} B")
            fetch = Fetch(0, peer, "result", call, True, None)
            fetch.replaced = peer not in active.skip_in
            active.final = True
            active.skip_in.add(peer)
            active.fetching += 1
        else:
            found = self._fetches.get(request)
            if found is None or found.peer != peer or found.call != call:
                raise ProtocolError(f"rank {peer} replies to request {request} nobody made")
            fetch = found
        if not msg["found"]:
            if request and fetch.whole and fetch.what in ("result", "checkpoint", "local"):
                # its store moved on since its state: another neighbour may still hold it
                self._refetch(fetch, cmds, msg["reason"])
                return
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
            self._blob_done(link, cmds)

    def _blob_done(self, link: Link, cmds: list[Command]) -> None:
        fetch = link.blob_fetch
        assert fetch is not None and fetch.dest is not None
        link.blob_fetch = None
        link.mode, link.filled, link.remaining = Mode.HEADER, 0, 0
        self._fetches.pop(fetch.request, None)
        if fetch.what == "discard":
            return
        if fetch.what == "replica":
            self._stored_local(fetch, cmds)
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
        if fetch.what == "stream":
            self._refilled(active, fetch, cmds)
            return
        if active.call.kind is CollectiveKind.BROADCAST:
            self._land_broadcast(active, fetch.dest)
        elif fetch.request == 0:
            active.call.buf[:] = fetch.dest  # an unasked result, whole now
        active.fetching -= 1
        self._pump(active, cmds)
        self._maybe_complete(active, cmds)

    def _refilled(self, active: ActiveCall, fetch: Fetch, cmds: list[Command]) -> None:
        """The skipped in-stream bytes are back: reduce them in, then serve the need that
        asked for what they make."""
        plan = active.plan
        assert isinstance(plan, RingAllreduce) and fetch.dest is not None
        plan.refill(fetch.lo, fetch.dest)
        active.fetching -= 1
        assert active.refill is not None
        peer, offset, seen = active.refill
        active.refill = None
        link = self.links[peer]
        if link.up and link.awaiting_need:
            link.awaiting_need = False
            self._apply_need(active, peer, offset, seen=seen)
        self._pump(active, cmds)
        self._maybe_complete(active, cmds)

    def _drop_stand_in(self, link: Link, peer: int) -> None:
        """The link that was bringing an unasked result of the current call went down half
        way: the call waits for that peer's stream again."""
        fetch, active = link.blob_fetch, self.active
        if (fetch is None or fetch.request != 0 or fetch.what != "result" or active is None
                or active.call_id != fetch.call):
            return
        link.blob_fetch = None
        active.fetching -= 1
        active.final = False
        if fetch.replaced:
            active.skip_in.discard(peer)

    def _land_broadcast(self, active: ActiveCall, data: memoryview) -> None:
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
        if self.restarted and self.peer_states and all(
                st.recovering for st in self.peer_states.values()):
            self._no_live_at_load = tuple(sorted(self.peer_states))
            self._no_live_incs = {p: st.incarnation for p, st in self.peer_states.items()}
            ahead = {p: st.at[0] for p, st in self.peer_states.items() if st.at[0] > 0}
            if ahead:
                # one of them has already resumed from a later checkpoint: version 0 would
                # replay calls it will never make (docs/recovery.md, "Limitations")
                peer = min(ahead)
                raise UnrecoverableError(self._version_zero_wrong(peer, ahead[peer]))
        wanted = version
        if with_local and version:
            # a rank that died between a call and its next checkpoint never handed on the
            # local model of the version its neighbours are in: resume one version earlier
            held = [v for p, st in self.peer_states.items() if self.links[p].up
                    for v in st.locals if v <= version]
            version = max(held, default=0)
        cmds: list[Command] = []
        self.version, self.seqno = version, 0
        self.results.clear_before((version, 0))  # (what "state" says this rank retains)
        self._loading = {"version": version, "checkpoint": None, "local": None, "pending": 0}
        if version:
            # where this rank resumes: a neighbour restarted too may hold a call of an older
            # version back for it, which it will never make (its state said "at (0, 0)")
            for peer, link in self.links.items():
                if link.up:
                    self._send_control(peer, self._state_for(peer).to_msg(), cmds)
        if version == 0:
            cmds.append(CheckpointLoaded(0, None))
            return cmds
        sources = [p for p, st in self.peer_states.items()
                   if version in st.versions and self.links[p].up]
        if not sources and version < wanted:
            restarted = sorted(p for p, st in self.peer_states.items() if st.recovering)
            raise UnrecoverableError(
                f"rank {self.rank} cannot resume: its local model of version {wanted} is held "
                f"by no live neighbour (rank(s) {restarted} were restarted too), and none "
                f"holds checkpoint version {version} any more, the latest it has a local "
                "model of (two neighbours lost together, docs/recovery.md)")
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

    def fail_load(self, error: UnrecoverableError) -> list[Command]:
        """:meth:`load_checkpoint` raised ``error``: this rank fails with it (the neighbours
        hear it, so they stop waiting for this rank's replay)."""
        cmds: list[Command] = []
        self._fail(error, cmds)  # (no-op for a rank that failed already)
        return cmds

    def _payload_crc(self, peer: int, payload: bytes | memoryview) -> int | None:
        return checksum(payload) if self.links[peer].checked else None

    def _send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        body = encode_body(msg)
        header = pack_header(FrameKind.CONTROL, NO_CALL, self.version, self.seqno, 0,
                             len(body), self.incarnation, self._payload_crc(peer, body))
        cmds.append(Send(peer, [header, body]))
        self._frames_sent += 1

    @staticmethod
    def _result_pieces(active: ActiveCall) -> list[memoryview]:
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
