"""Progress notes: bytes that move anywhere in a call are progress for every rank in it.

A rank waiting for peers that are themselves still receiving over a slow link must not time
out, so each rank tells the neighbours of its call how long ago the call last moved (its own
bytes, or what a neighbour told it).  The notes carry ages, not times, so that clocks need
not agree, and a note passed round a cycle only ever grows older (``docs/design.md``,
"Deadlines").
"""

from __future__ import annotations

from typing import Any, Protocol

from rabit2.core.records import ActiveCall, Command, Link
from rabit2.errors import ProtocolError, RabitError


class Owner(Protocol):
    """What the notes read and change of the agent that sends and hears them."""

    links: dict[int, Link]
    active: ActiveCall | None
    error: RabitError | None
    timeout: float
    last_progress: float

    def send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None: ...


def tell(agent: Owner, active: ActiveCall, now: float, cmds: list[Command],
         exclude: int = -1) -> None:
    """Tell the call's neighbours (but ``exclude``) how long ago it last moved, at most
    twice per tick interval and link."""
    age = now - agent.last_progress
    if age >= agent.timeout or agent.error is not None:
        return
    spacing = min(1.0, agent.timeout / 4) / 2
    plan = active.plan
    msg = {"t": "progress", "call": list(active.call_id), "age_us": int(age * 1e6)}
    for peer, link in agent.links.items():
        if (peer != exclude and link.up and not link.awaiting_state
                and now - link.progress_told >= spacing
                and (peer in plan.in_streams or peer in plan.out_streams)):
            link.progress_told = now
            agent.send_control(peer, msg, cmds)


def call_of(peer: int, msg: dict[str, Any]) -> tuple[int, int]:
    """The call a progress note is about; ``ProtocolError`` if it names none."""
    call = msg.get("call")
    if (not isinstance(call, list) or len(call) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                       for x in call)):
        raise ProtocolError(f"rank {peer} sent a malformed progress note")
    return call[0], call[1]


def heard(agent: Owner, peer: int, msg: dict[str, Any], now: float,
          cmds: list[Command]) -> None:
    """A neighbour says the call moved ``age_us`` ago somewhere: progress here too."""
    active = agent.active
    age = msg["age_us"]
    if not isinstance(age, int) or isinstance(age, bool) or age < 0:
        raise ProtocolError(f"rank {peer} sent a malformed progress note")
    if active is None or call_of(peer, msg) != active.call_id:
        return  # (about a call this rank is not in)
    moved = now - age / 1e6
    if moved > agent.last_progress:
        agent.last_progress = moved
        tell(agent, active, now, cmds, exclude=peer)
