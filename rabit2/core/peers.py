"""A rank's neighbours coming and going: a link up, a link down, a peer that died.

The agent's entry points for these inputs (:meth:`rabit2.core.agent.Agent.on_link_up`,
``on_hangup``, ``on_peer_dead``) land here.  Without recovery a lost link the call needs
fails it; with recovery on the call waits for the peer to come back (the same process after
a reset, or its replacement) and the recovery component says what each side owes the other
(``docs/recovery.md``).  The fencing rule, the one check of which process may take a link,
lives here too.
"""

from __future__ import annotations

from typing import Any, Protocol

from rabit2.core import fsm
from rabit2.core.records import ActiveCall, Command, Link
from rabit2.core.recovery.component import Recovery
from rabit2.errors import PeerLostError, ProtocolError, RabitError

State, Event = fsm.State, fsm.Event


class Owner(Protocol):
    """What the link lifecycle reads and calls of the agent that owns it."""

    rank: int
    version: int
    seqno: int
    checked: bool
    state: fsm.State
    links: dict[int, Link]
    dead_links: dict[int, str]
    active: ActiveCall | None
    recovery: Recovery | None

    def go(self, event: fsm.Event) -> None: ...
    def advance(self, cmds: list[Command]) -> None: ...
    def fail(self, error: RabitError, cmds: list[Command], *, source: int = -1,
             close: int = -1, flood: bool = True) -> None: ...
    def send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None: ...


class Peers:
    """The link lifecycle of one agent (loop thread only)."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent

    def link_up(self, peer: int, incarnation: int, checked: bool | None) -> list[Command]:
        """A (new) connection to ``peer`` is ready: framing starts afresh, and with recovery
        on this rank tells the peer where it stands."""
        agent = self.agent
        agent.go(Event.LINK_UP)
        cmds: list[Command] = []
        self.fence(peer, incarnation)
        link = agent.links[peer]
        was_down = not link.up
        same_process = incarnation == link.incarnation
        link.incarnation = incarnation
        link.checked = agent.checked if checked is None else checked
        link.peer_state = link.pending_state = link.need_sent = None
        agent.dead_links.pop(peer, None)
        active = agent.active
        link.reset_framing(active.plan.received.get(peer, 0) if active is not None else 0)
        link.up_call = active.call_id if active is not None else None
        link.up_at = link.up_call or (agent.version, agent.seqno)
        recovery = agent.recovery
        if recovery is not None:
            try:
                recovery.link_up(peer, link, was_down, same_process, cmds)
            except RabitError as exc:
                agent.fail(exc, cmds)
                return cmds
            event = recovery.resume_event()
            if event is not None:
                agent.go(event)
        return cmds

    def fence(self, peer: int, incarnation: int) -> None:
        """The fencing rule: only a newer incarnation of ``peer``, or the same process
        dialing again (its end of the link broke, even where ours did not see it), may take
        the link; an older one is a zombie.  Raises :class:`ProtocolError` for one."""
        known = self.agent.links[peer].incarnation
        if incarnation < known:
            raise ProtocolError(f"rank {peer} incarnation {incarnation} is stale (known: "
                                f"{known})")

    def hangup(self, peer: int, reason: str, now: float) -> list[Command]:
        """The link to ``peer`` closed or failed."""
        agent = self.agent
        agent.go(Event.HANGUP)
        cmds: list[Command] = []
        recovery = agent.recovery
        if peer in agent.dead_links or agent.state is State.FAILED or (
                agent.state is State.TASK_COMPLETE and recovery is None):
            return cmds
        agent.dead_links[peer] = reason
        active = agent.active
        if recovery is None:
            # a peer that finished its last call closes its links; that is only an error if
            # the call in progress still needs that link
            if active is not None and active.needs(peer):
                agent.fail(self.lost(peer), cmds, source=peer)
            return cmds
        try:
            recovery.link_down(peer, agent.links[peer], now, cmds)
        except RabitError as exc:
            agent.fail(exc, cmds)
            return cmds
        if active is not None and agent.active is active:
            if active.needs_input(peer):
                if agent.state is not State.PEER_ERROR:
                    agent.go(Event.PEER_DOWN)  # wait for the replacement, only on this input
            else:
                agent.advance(cmds)  # its share is served later, if at all
        return cmds

    def dead(self, peer: int) -> list[Command]:
        """The process behind the lost link to ``peer`` died: a replacement will replay what
        it missed, and this rank runs ahead of it from here."""
        agent = self.agent
        cmds: list[Command] = []
        link = agent.links.get(peer)
        recovery = agent.recovery
        if recovery is None or link is None or link.up or agent.state in (
                State.FAILED, State.TASK_COMPLETE):
            return cmds
        recovery.peer_dead(peer, link)
        active = agent.active
        if active is not None:
            recovery.skip_announce(active, peer)
            agent.advance(cmds)
        return cmds

    def lost(self, peer: int) -> PeerLostError:
        return PeerLostError(
            f"rank {self.agent.rank}: link to rank {peer} lost ({self.agent.dead_links[peer]})"
        )
