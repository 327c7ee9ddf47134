"""Where each stream restarts: the ``need`` a rank sends for a call (``docs/recovery.md``,
"Resume offsets, schedule by schedule").

A neighbour that comes back during a call (or a restarted rank that reaches it) says from
which byte of this rank's stream of the call it wants the rest; until then this rank holds
that stream back (the link's phase is ``held``).  A replaying rank says it for every call it
begins, so that a survivor which held its stream back knows where to start.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rabit2.core.fsm import PhaseEvent
from rabit2.core.records import ActiveCall, Command, Link
from rabit2.core.recovery.port import AgentPort
from rabit2.core.recovery.store import CallId
from rabit2.core.schedule import Plan, RingAllreduce, TreeBroadcast
from rabit2.errors import ProtocolError, UnrecoverableError

if TYPE_CHECKING:
    from rabit2.core.recovery.component import Recovery

MAX_PENDING_NEEDS = 64
"""Needs a peer may send for calls this rank has not begun (a replaying peer runs ahead
through calls that this rank is still to make)."""


def sends_to(plan: Plan, peer: int) -> bool:
    """Whether ``plan`` has (or, a broadcast whose size is not known yet, will have) an
    out-stream to ``peer``."""
    return peer in plan.out_streams or (isinstance(plan, TreeBroadcast) and not plan.sized
                                        and peer in plan.out_links)


class Needs:
    """The ``need`` messages a rank sends, applies and holds for calls not begun yet."""

    def __init__(self, agent: AgentPort, owner: Recovery) -> None:
        self.agent = agent
        self.owner = owner

    def send(self, peer: int, call: CallId, offset: int, cmds: list[Command],
             caught_up: bool = False, held: bool = False) -> None:
        """Tell ``peer`` from which byte of its stream of ``call`` to send (-1: none of it),
        once per call and connection."""
        link = self.agent.links[peer]
        if link.need_sent == call:
            return
        link.need_sent = call
        self.agent.send_control(peer, {"t": "need", "call": list(call), "from": offset,
                                       "caught_up": caught_up, "held": held}, cmds)

    def apply(self, active: ActiveCall, peer: int, offset: int, seen: bool = False,
              cmds: list[Command] | None = None) -> None:
        """``peer`` holds ``offset`` bytes of this rank's stream of the call (-1: it takes
        none of it; ``seen``: it saw a frame of it): send the rest from there."""
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
        rank = self.agent.rank
        if active.has_result and offset < stream.length and offset < plan.final_from(peer):
            raise UnrecoverableError(
                f"rank {peer} needs partial sums of call {active.call_id} from byte {offset}, "
                f"but rank {rank} restarted and holds only that call's result")
        if offset < stream.length and not plan.serves_from(peer, offset):
            if (isinstance(plan, RingAllreduce) and cmds is not None and active.refill is None
                    and not active.fetching and self.agent.links[plan.next].up
                    and (gap := plan.refill_range(offset)) is not None):
                # a neighbour lost again asks from before where this rank's resume restarted
                # its in-stream: fetch those bytes of the next rank's stream again (it still
                # holds them unless its own result overwrote them: then it says so)
                active.refill = (peer, offset, seen)
                self.agent.links[peer].phase_go(PhaseEvent.HOLD)
                self.owner.fetches.request(plan.next, "stream", active.call_id, gap[0], gap[1],
                                           memoryview(bytearray(gap[1] - gap[0])), cmds,
                                           active)
                return
            # partial sums the result has overwritten here, or (after a resume, which asked
            # the in-streams only for what the out-streams needed then) bytes made from
            # skipped input: sending the buffer's content in their place would corrupt the
            # result
            raise UnrecoverableError(
                f"rank {peer} needs call {active.call_id} from byte {offset}, but rank "
                f"{rank} cannot make those bytes any more (the result has overwritten "
                "those partial sums, or this rank was restarted and resumed the call past "
                "them); recovery would need them (two neighbours lost in the same call, "
                "docs/recovery.md)")
        old = active.sent.get(peer, 0)
        self.owner.stats["resent_bytes"] += max(0, old - offset)
        active.sent[peer] = offset
        active.started_empty.discard(peer)

    def _release(self, active: ActiveCall, peer: int, offset: int) -> None:
        """A stream held back for ``peer`` goes on from ``offset``."""
        self.agent.links[peer].phase_go(PhaseEvent.RELEASE)
        self.apply(active, peer, offset)

    def on_need(self, peer: int, link: Link, call: CallId, offset: int,
                cmds: list[Command], caught_up: bool = False, held: bool = False) -> None:
        """``peer`` holds ``offset`` bytes of our stream of ``call`` (-1: wants none of it).
        A replaying peer says where each call's stream starts for every call it begins
        (``held``: it holds nothing of it, so it only matters where this rank holds the
        stream back for it or has not begun the call; ``caught_up``: the peer is done
        replaying)."""
        agent, owner = self.agent, self.owner
        active = agent.active
        current = active.call_id if active is not None else (agent.version, agent.seqno)
        if caught_up and link.peer_state is not None:
            link.peer_state = dataclasses.replace(link.peer_state, recovering=False)
            if call < current:
                # waited for as a neighbour restarted too, it has caught up meanwhile: a
                # survivor now, it sends no need for our call, and holds none of it
                owner.replay.answer_wait(active, peer, 0, cmds)
            if (active is not None and call < current and link.awaiting_need
                    and sends_to(active.plan, peer)):
                # held back for it in a later call: it will need all of that stream
                self._release(active, peer, 0)
        if active is not None and call == current:
            owner.replay.answer_wait(active, peer, offset, cmds)  # (a neighbour restarted too)
            if (held and peer in active.plan.in_streams and peer not in active.skip_in
                    and link.need_sent != call and agent.error is None):
                # a neighbour that began this call while this rank replayed holds its own
                # stream back until it hears where to start; this rank's need for it may
                # have gone to the process it replaced (a held need changes nothing where
                # the stream was not held back)
                self.send(peer, call, active.plan.received[peer], cmds, held=True)
            if held and not link.awaiting_need:
                return  # the stream was not held back: it is flowing from its start
            link.phase_go(PhaseEvent.RELEASE)
            self.apply(active, peer, offset, cmds=cmds)
        elif call < current:
            if offset < 0:
                return
            # the call finished here meanwhile: the result stands in for the stream
            got = owner.results.get(call)
            if got is None:
                raise UnrecoverableError(f"rank {peer} resumes call {call}, which rank "
                                         f"{agent.rank} finished and no longer retains")
            owner.fetches.reply(peer, 0, call, got[0], got[1], cmds)
        elif len(link.pending_needs) < MAX_PENDING_NEEDS:
            # a replaying peer (or one past its replay while this rank replays) is ahead
            link.pending_needs[call] = offset  # applied when this rank begins that call
            owner.replay.answer_wait(active, peer, -1, cmds)  # past our call: needs none
            if active is not None and link.awaiting_need:
                # held back for it, but it is past this call (it resumed from a later
                # checkpoint than this rank): it needs none of that stream
                self._release(active, peer, -1)
            owner.watch_replays = True
        else:
            raise ProtocolError(f"rank {peer} sent needs for more than {MAX_PENDING_NEEDS} "
                                f"calls rank {agent.rank} has not started")

    def hold_for_replaying(self, active: ActiveCall) -> None:
        """Starting a call: send nothing of it to a neighbour that is still replaying until
        it says from where (its ``need``, perhaps already here).  Frames of a later call
        would stop it reading the link, behind them, the results it fetches from us."""
        call = active.call_id
        restarted = self.owner.replay.restarted
        for peer, link in self.agent.links.items():
            if link.pending_needs:
                for old in [c for c in link.pending_needs if c < call]:
                    del link.pending_needs[old]
            offset = link.pending_needs.pop(call, None)
            if not link.up or not sends_to(active.plan, peer):
                continue
            if offset is not None:
                self.apply(active, peer, offset)
            elif link.peer_state is not None and link.peer_state.recovering:
                state = link.peer_state
                if state.at > call or any(c > call for c in link.pending_needs):
                    # it resumed past this call (from a later checkpoint): it needs none
                    self.apply(active, peer, -1)
                elif restarted and state.at == call and state.active:
                    # both replaying, it was in this call when our link came up: its state
                    # said what it holds of our stream, and it sends no other need for it
                    self.apply(active, peer, state.need, seen=state.seen)
                else:
                    link.phase_go(PhaseEvent.HOLD)
        self.owner.watch_replays = any(
            link.pending_needs or (link.peer_state is not None and link.peer_state.recovering)
            for link in self.agent.links.values())

    def from_all(self, active: ActiveCall, cmds: list[Command], caught_up: bool = False) -> None:
        """A replaying rank tells every neighbour it has not told yet where its stream of
        this call starts: all of it if this rank takes it, none otherwise (they hold their
        streams back for it; ``docs/recovery.md``)."""
        call, plan = active.call_id, active.plan
        for peer, link in self.agent.links.items():
            if link.up and link.need_sent != call:
                takes = peer in plan.in_streams and peer not in active.skip_in
                self.send(peer, call, 0 if takes else -1, cmds, caught_up, held=True)
