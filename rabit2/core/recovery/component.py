""":class:`Recovery`: the part of a rank's agent that exists only with recovery on
(``docs/recovery.md``).

It keeps what a restarted neighbour may ask for (checkpoints, results, local models), handles
links that come back (the ``state`` exchange, what the old connection lost), and drives a
restarted rank's replay.  The agent calls it at a few points of a call's life (begin,
complete, a link down or up, a checkpoint, a tick) and forwards the recovery messages; it
asks the agent for nothing beyond :class:`~rabit2.core.recovery.port.AgentPort`.

Sans-I/O like the agent: every method takes the command list it appends to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rabit2.core import fsm
from rabit2.core.framing import CallDescriptor
from rabit2.core.fsm import PhaseEvent
from rabit2.core.records import NO_CALL, RESUME_EVENTS, ActiveCall, Command, Link
from rabit2.core.recovery.fetches import Fetches
from rabit2.core.recovery.needs import Needs, sends_to
from rabit2.core.recovery.peer_state import PeerState, call_id
from rabit2.core.recovery.port import AgentPort
from rabit2.core.recovery.replay import Replay
from rabit2.core.recovery.replicas import LocalReplicas
from rabit2.core.recovery.store import GENERATIONS, SMALL_RESULT, CallId, ResultStore
from rabit2.core.schedule import EMPTY, PairExchange, RingAllreduce, TreeBroadcast
from rabit2.errors import PeerLostError, ProtocolError, RabitError, UnrecoverableError

State = fsm.State


class Recovery:
    """One rank's recovery state, and its answers to what happens on its links."""

    def __init__(self, agent: AgentPort, *, timeout: float, retain_bytes: int,
                 local_replica: int) -> None:
        self.agent = agent
        self.timeout = timeout  # how long a call waits for a lost input's replacement
        self.results = ResultStore(retain_bytes)
        # pickled global models by version, or functions that pickle them when asked
        self.checkpoints: dict[int, bytes | Callable[[], bytes]] = {}
        self.replicas = LocalReplicas(agent, local_replica)
        self.fetches = Fetches(agent, self)
        self.needs = Needs(agent, self)
        self.replay = Replay(agent, self)
        self.down_since: dict[int, float] = {}  # lost links the job waits to come back
        # the version each of those neighbours was last seen in: until this rank is past it,
        # it runs ahead of a lost neighbour through every call that needs no input from it
        # (docs/recovery.md, "Running ahead of a lost neighbour")
        self.lost_in_version: dict[int, int] = {}
        # the latest version in which this rank finished a collective that every rank
        # contributes to (from then on no restart needs the results of older versions)
        self.version_joined = 0
        self.pending_states = False  # some link holds a reset peer's state for a later call
        # some neighbour is replaying, or sent needs for calls not begun yet (begin looks)
        self.watch_replays = False
        self.stats = {"links_up": 0, "fetched_bytes": 0, "resent_bytes": 0,
                      "replayed_calls": 0, "resumed_calls": 0}

    # ------------------------------------------------------------------ what is kept

    def checkpoint_blob(self, version: int) -> bytes | None:
        blob = self.checkpoints.get(version)
        if callable(blob):
            blob = self.checkpoints[version] = blob()  # a lazy checkpoint, pickled now
        return blob

    def on_checkpoint(self, version: int, blob: bytes | Callable[[], bytes] | None) -> None:
        """Keep ``blob`` for :data:`GENERATIONS` versions, and the results of the calls made
        in them."""
        # past a checkpoint of its own, a version-0 choice at load was right (it would have
        # failed in a call of version 0 otherwise): a later state says nothing about it
        self.replay.no_live_incs = {}
        if blob is not None:
            self.checkpoints[version] = blob
        keep_from = version - GENERATIONS + 1
        if self.lost_in_version:
            # a lost neighbour, run ahead of, may resume from the version before the one
            # it was last seen in (for want of its local model of that one): keep it
            keep_from = min(keep_from, min(self.lost_in_version.values()) - 1)
        for old in [v for v in self.checkpoints if v < keep_from]:
            del self.checkpoints[old]
        self.results.on_checkpoint(version, keep_from)

    def ring_keep(self, nbytes: int, call: tuple[int, int]) -> memoryview | None:
        """The buffer a ring allreduce fills as it makes the result, to be retained (not for
        a result too large to be kept, except at world size 2, where that buffer also
        stages the allgather for the resume's sake)."""
        results = self.results
        if self.agent.world == 2 or (results.fits(nbytes) and results.wants(call)):
            return results.take(nbytes).data
        return None

    def result_buffer(self, nbytes: int, call: tuple[int, int]) -> np.ndarray | None:
        """A buffer of the store's own for the result of ``call``, to be made or copied in
        as the call goes and then retained; None for a small result (copied into a slab
        once made), one larger than ``rabit2_replay_mb`` or one of a version that can no
        longer be replayed (not kept at all)."""
        return self.express_keep(nbytes, call) if nbytes > SMALL_RESULT else None

    def keep_ready(self, nbytes: int, call: tuple[int, int]) -> None:
        """Make the memory ``call``'s result of ``nbytes`` will be kept in (a rank that
        waits for a peer's bytes: :meth:`ResultStore.make_ready`)."""
        results = self.results
        if results.fits(nbytes) and results.wants(call):
            results.make_ready(nbytes)

    def express_keep(self, nbytes: int, call: tuple[int, int]) -> np.ndarray | None:
        """The buffer an express call makes its result in, to be retained (for a small
        result, room in one of the store's slabs); None for a result that is not kept."""
        results = self.results
        if results.fits(nbytes) and results.wants(call):
            return results.take(nbytes)
        return None

    def pair_keep(self, nbytes: int, call: tuple[int, int]) -> memoryview | None:
        """The buffer a pair exchange makes its result in, to be retained."""
        kept = self.result_buffer(nbytes, call)
        return None if kept is None else kept.data

    def start_mirror(self, active: ActiveCall, plan: TreeBroadcast) -> None:
        """A receiving rank of a broadcast of known size: take the buffer that the stream
        is copied to as it arrives."""
        mirror = self.result_buffer(plan.in_streams[plan.in_link].length, active.call_id)
        if mirror is not None:
            active.mirror = mirror

    @staticmethod
    def mirror(active: ActiveCall, upto: int) -> None:
        """Copy a broadcast's received stream bytes ``[mirrored, upto)`` to the buffer that
        will be retained for replays."""
        plan = active.plan
        assert isinstance(plan, TreeBroadcast) and active.mirror is not None
        at = active.mirrored
        dest = active.mirror.data
        for view in plan.in_streams[plan.in_link].views(at, upto):
            dest[at : at + len(view)] = view
            at += len(view)
        active.mirrored = at

    def on_complete(self, active: ActiveCall, every_rank_contributes: bool) -> None:
        """Keep the finished call's result for replays."""
        if every_rank_contributes:
            self._joined(active.call_id[0])
        self._retain(active)

    def on_express(self, call: CallId, desc: CallDescriptor, result: memoryview,
                   keep: np.ndarray | None) -> None:
        """Keep the result of an express pair call (:mod:`rabit2.core.express`), made in
        ``keep`` (from :meth:`express_keep`) or, without one, copied from ``result``."""
        self._joined(call[0])
        if keep is None:
            self.results.add(call, desc, [result])
        else:
            self.results.keep(call, desc, keep)

    def quiet(self) -> bool:
        """Nothing of recovery is under way that the beginning of a call acts on (a replay,
        a reset peer's state, a neighbour still replaying): an express call may skip it."""
        return not (self.replay.restarted or self.pending_states or self.watch_replays)

    def _joined(self, version: int) -> None:
        if version > self.version_joined:
            # every rank contributed to a call of ``version``, so every rank has taken that
            # checkpoint: a restart resumes there or later, and the results of older
            # versions can go now rather than at the next checkpoint (their buffers then
            # serve this version's results: docs/recovery.md, "Versions")
            self.version_joined = version
            self.results.clear_before((version, 0))

    def _retain(self, active: ActiveCall) -> None:
        """A ring or a pair exchange filled its buffer as it made the result (only what a
        resume fetched into the ring's own segment is copied now, or the whole result when
        it was fetched); a broadcast receiver copied its stream while it arrived; the rest
        is copied now."""
        plan = active.plan
        if active.mirror is not None:
            assert isinstance(plan, TreeBroadcast)
            self.mirror(active, plan.in_streams[plan.in_link].length)
            self.results.keep(active.call_id, active.desc, active.mirror)
            return
        if not isinstance(plan, (RingAllreduce, PairExchange)) or plan.keep is None:
            self.results.add(active.call_id, active.desc, _result_pieces(active))
            return
        keep = plan.keep
        if active.has_result:
            keep[:] = active.call.buf  # (fetched into the caller's array)
        elif isinstance(plan, RingAllreduce) and plan.own_fetched:
            lo, hi = plan.own_segment
            keep[lo:hi] = active.call.buf[lo:hi]
        # the very array the store handed out (``take(...).data``), not a new array over
        # it: buffers are recycled call after call, and each such wrapper would hold the
        # previous one, a chain that grows without bound and overflows the C stack when it
        # is finally freed
        blob = keep.obj
        assert isinstance(blob, np.ndarray) and blob.nbytes == keep.nbytes
        self.results.keep(active.call_id, active.desc, blob)

    # ------------------------------------------------------------------ calls

    def begin(self, active: ActiveCall, cmds: list[Command]) -> None:
        """A call starts: replay it (a restarted rank), settle the states of reset peers that
        waited for it, and hold its streams back for neighbours still replaying."""
        agent = self.agent
        call = active.call_id
        if self.replay.restarted:
            self.replay.begin(active, cmds)
        for peer, link in agent.links.items() if self.pending_states else ():
            state = link.pending_state
            if state is None or state.at > call:
                continue  # (a later call: kept until this rank begins that one)
            link.pending_state = None
            if state.at == call and link.up:
                # a peer whose link was reset waits in this call; if we were behind when
                # the link came up it waits to hear that we hold none of its stream.
                # Not if we were just before this call then: our state said so, and a
                # peer that is not replaying took it as "all of it" (a second need made
                # it send its stream twice, over bytes that had arrived)
                self.needs.apply(active, peer, state.need, seen=state.seen)
                if (link.up_call != call and peer in active.plan.in_streams
                        and (state.recovering or link.up_at < call)):
                    self.needs.send(peer, call, 0, cmds)
        if self.pending_states:
            self.pending_states = any(link.pending_state is not None
                                      for link in agent.links.values())
        if self.watch_replays:
            self.needs.hold_for_replaying(active)

    def skip_lost(self, active: ActiveCall) -> None:
        """Run ahead of the lost neighbours the call needs nothing of but an announce."""
        for peer in active.plan.in_streams:
            if not self.agent.links[peer].up:
                self.skip_announce(active, peer)

    def skip_announce(self, active: ActiveCall, peer: int) -> None:
        """A lost neighbour owes this call nothing but the empty frame that announces it (a
        broadcast child towards the root): do not wait for it.  What this rank owes it waits
        in the result store, and the replacement's call is checked against it when it
        replays (a lost inner rank then fetches the result and forwards it to its children,
        which wait in the call for its input).  Only in the version it was last seen in:
        beyond that, the call waits for the replacement (how far survivors run ahead,
        docs/recovery.md)."""
        if (active.plan.in_streams.get(peer) is EMPTY and not active.frames_seen.get(peer)
                and active.call_id[0] <= self.lost_in_version.get(peer, -1)):
            active.skip_in.add(peer)

    def check_deadline(self, active: ActiveCall, now: float) -> RabitError | None:
        """A lost input not back within ``recover_timeout``."""
        agent = self.agent
        for peer, since in self.down_since.items():
            if now - since > self.timeout and active.needs_input(peer):
                return PeerLostError(
                    f"rank {agent.rank}: rank {peer} did not come back within "
                    f"{self.timeout:g} s ({agent.dead_links.get(peer, 'lost')})")
        return None

    # ------------------------------------------------------------------ links

    def link_down(self, peer: int, link: Link, now: float, cmds: list[Command]) -> None:
        """The link to ``peer`` closed or failed: the call waits for it to come back (the
        same process after a reset, or a replacement).  Raises :class:`RabitError`."""
        link.phase_go(PhaseEvent.HANGUP)
        self.down_since[peer] = now
        self.fetches.drop_stand_in(link, peer)
        self.fetches.lost(peer, cmds, park=True)

    def peer_dead(self, peer: int, link: Link) -> None:
        """The process behind the lost link died: a replacement will replay."""
        # (the version of the last call it sent a frame of: it got that far at least)
        self.lost_in_version.setdefault(peer, link.seen_version)

    def link_up(self, peer: int, link: Link, was_down: bool, same_process: bool,
                cmds: list[Command]) -> None:
        """A (new) connection to ``peer`` is ready and its framing reset: tell the peer where
        this rank stands, and ask again what the old connection was to bring."""
        agent = self.agent
        self.down_since.pop(peer, None)
        self.lost_in_version.pop(peer, None)
        active = agent.active
        held = False
        if was_down:
            self.stats["links_up"] += 1
            held = active is not None and sends_to(active.plan, peer)
        link.phase_go(PhaseEvent.CONNECT_HELD if held else PhaseEvent.CONNECT)
        agent.send_control(peer, self.state_for(peer).to_msg(), cmds)
        if was_down and same_process:
            self.fetches.reissue(peer, cmds)
        elif not same_process:
            # asked of a neighbour that died (parked, or still in flight if its
            # replacement connected before the old link was seen to go down): the
            # replacement holds none of it
            self.fetches.lost(peer, cmds, park=False)
        if was_down:
            # a ring neighbour came back without the replicas of our local model
            self.replicas.resend_own(peer, cmds)

    def state_for(self, peer: int) -> PeerState:
        agent = self.agent
        active = agent.active
        at = active.call_id if active is not None else (agent.version, agent.seqno)
        need, seen = -1, False
        if active is not None and peer in active.plan.in_streams and peer not in active.skip_in:
            need = active.plan.received[peer]
            seen = active.frames_seen.get(peer, 0) > 0
        return PeerState(agent.incarnation, at, active is not None, need, seen,
                         self.replay.replaying(), tuple(sorted(self.checkpoints)),
                         self.results.oldest, self.replicas.versions_of(peer),
                         self.results.bootstrap_calls)

    def states_known(self) -> bool:
        """Every neighbour has sent its state (a restarted rank waits for this in init)."""
        return all(link.peer_state is not None for link in self.agent.links.values())

    KINDS = frozenset({"state", "need", "fetch", "reply", "local"})
    """The recovery protocol's control messages (docs/protocol.md)."""

    def on_control(self, peer: int, link: Link, msg: dict[str, Any],
                   cmds: list[Command]) -> bool:
        """A recovery message from ``peer``; False if ``msg`` is none."""
        kind = msg["t"]
        if kind == "state":
            self._on_state(peer, link, PeerState.from_msg(msg), cmds)
        elif kind == "need":
            self.needs.on_need(peer, link, call_id(msg["call"], "need.call"), msg["from"],
                               cmds, msg["caught_up"], msg["held"])
        elif kind == "fetch":
            self.fetches.on_fetch(peer, msg, cmds)
        elif kind == "reply":
            self.fetches.on_reply(peer, link, msg, cmds)
        elif kind == "local":
            self.fetches.expect_blob(link, self.replicas.announced(peer, msg), cmds)
        else:
            return False
        return True

    def resume_event(self) -> fsm.Event | None:
        """A call that waited for lost inputs can go on: every in-link is up again."""
        agent = self.agent
        active = agent.active
        if (active is not None and agent.state is State.PEER_ERROR
                and all(agent.links[p].up for p in active.plan.in_streams)):
            return RESUME_EVENTS[active.call.kind]
        return None

    # ------------------------------------------------------------------ the state exchange

    def _on_state(self, peer: int, link: Link, state: PeerState, cmds: list[Command]) -> None:
        if state.incarnation != link.incarnation:
            raise ProtocolError(f"rank {peer} states incarnation {state.incarnation} on a "
                                f"link opened by incarnation {link.incarnation}")
        link.peer_state = state
        link.phase_go(PhaseEvent.STATE)
        self.watch_replays = self.watch_replays or state.recovering
        replay = self.replay
        if (replay.no_live_incs.get(peer) == state.incarnation and state.recovering
                and state.at[0] > self.agent.version):
            # a neighbour that was restarting when this rank took its checkpoint version for
            # want of a live neighbour has since resumed from a later one: the calls this
            # rank replays will never be made by it (without this, both wait in different
            # calls until the progress deadline).  The same process only: a neighbour
            # restarted again later may rightly be a checkpoint ahead of this rank
            raise UnrecoverableError(replay.version_zero_wrong(peer, state.at[0]))
        if replay.replaying():
            replay.peer_states[peer] = state
            # (a reset while this rank replays)
            if not self._stand_in(peer, state, cmds):
                self._resend_after_reset(peer, link, state, cmds)
        else:
            self._settle_state(peer, link, state, cmds)

    def _settle_state(self, peer: int, link: Link, state: PeerState,
                      cmds: list[Command]) -> None:
        """A live rank hears where a peer stands on a new connection to it."""
        agent = self.agent
        active = agent.active
        current = active.call_id if active is not None else (agent.version, agent.seqno)
        if state.active and state.at >= current and (active is None or state.at > current):
            # a call we have not begun (the peer may be replaying): settled when we begin it
            link.pending_state = state
            self.pending_states = True
        if self._stand_in(peer, state, cmds) or active is None:
            return
        if state.recovering:
            if state.at < active.call_id and sends_to(active.plan, peer):
                # a replaying peer behind the call we began while its state was on the
                # way (nothing of it was sent: the state was awaited): hold it back for
                # its need, as Needs.hold_for_replaying does at begin
                offset = link.pending_needs.pop(active.call_id, None)
                if offset is None:
                    link.phase_go(PhaseEvent.HOLD)
                else:
                    self.needs.apply(active, peer, offset)
                return
            self._resend_after_reset(peer, link, state, cmds)
            return  # otherwise it says what it needs with a "need" when it gets there
        # the same process came back on a new connection (the old one was reset): its state
        # says how much of our stream of its current call it holds
        if state.at == active.call_id:
            if link.up_call == active.call_id:
                # both were in this call when the link came up: resend what the old
                # connection lost (a peer that had not begun it needs all of it)
                link.phase_go(PhaseEvent.RELEASE)
                self.needs.apply(active, peer, state.need if state.active else 0,
                                 seen=state.seen)
            elif state.active and link.up_at < active.call_id and peer in active.plan.in_streams:
                # we were behind when the link came up and began this call since: the peer
                # still waits to hear how much of its stream we hold
                self.needs.send(peer, active.call_id, active.plan.received[peer], cmds)
        elif state.at > active.call_id:
            link.phase_go(PhaseEvent.RELEASE)  # it finished our call: it needs nothing more of it
            self.needs.apply(active, peer, -1)

    def _resend_after_reset(self, peer: int, link: Link, state: PeerState,
                            cmds: list[Command]) -> None:
        """Where a restarted rank (on either side) will send no ``need`` for our current
        call, the state is the answer: the peer is past the call (it needs none of our
        stream), or the link reset while both were in it (resend from its ``need``, as
        between two survivors)."""
        active = self.agent.active
        if active is None:
            return
        if state.at > active.call_id:
            link.phase_go(PhaseEvent.RELEASE)
            self.needs.apply(active, peer, -1)
        elif (state.active and state.at == active.call_id
              and link.up_call == active.call_id):
            link.phase_go(PhaseEvent.RELEASE)
            self.needs.apply(active, peer, state.need, seen=state.seen)
        elif (state.active and state.at == active.call_id
              and peer in active.plan.in_streams and peer not in active.skip_in):
            # we began this call after the link came up: the peer, in it already, waits to
            # hear how much of its stream we hold
            self.needs.send(peer, active.call_id, active.plan.received[peer], cmds)
        elif (state.at < active.call_id and self.replay.replaying()
              and peer in active.plan.in_streams and peer not in active.skip_in):
            # a replacement behind our call: if it catches up before it gets here, it holds
            # its stream back for our need, and the one we sent went down with the old
            # connection.  Said now, it waits there for the call
            self.needs.send(peer, active.call_id, active.plan.received[peer], cmds, held=True)

    def _stand_in(self, peer: int, state: PeerState, cmds: list[Command]) -> bool:
        """``peer`` is still in a call this rank finished (it may be in a later one, or
        between calls, or replaying), and this rank's stream of it went down with the old
        connection: send the retained result in its place.  Not when the peer takes none of
        our stream of that call (need -1, a link off the call's route): its input comes from
        another rank, which is still sending it."""
        agent = self.agent
        active = agent.active
        current = active.call_id if active is not None else (agent.version, agent.seqno)
        if not (state.active and state.at < current and state.need >= 0):
            return False
        got = self.results.get(state.at)
        if got is not None:
            self.fetches.reply(peer, 0, state.at, got[0], got[1], cmds)
        elif state.at < self.results.oldest:
            # dropped (more than two checkpoints ago, or too large to keep): say so, and
            # the peer fails at once if it still needs our bytes of that call
            self.fetches.reply(peer, 0, state.at, NO_CALL, None, cmds,
                               f"rank {agent.rank} finished call {state.at} and no longer "
                               "retains its result (it ran more than two checkpoints ahead, "
                               "or the result is larger than rabit2_replay_mb)")
        else:
            return False
        return True

    def statistics(self) -> dict[str, int]:
        """Counters of the recovery protocol: links re-established, bytes fetched for
        replay, bytes resent because a receiver asked for them again, calls replayed from
        a neighbour's result and calls resumed at an offset."""
        return dict(self.stats)


def _result_pieces(active: ActiveCall) -> list[memoryview]:
    """What a finished call leaves behind for a replay: the result (a broadcast's whole
    stream, head included)."""
    plan = active.plan
    if isinstance(plan, TreeBroadcast):
        if plan.in_link >= 0:
            return list(plan.in_streams[plan.in_link].pieces)
        return list(active.call.pieces or (active.call.buf,))
    return [active.call.buf]
