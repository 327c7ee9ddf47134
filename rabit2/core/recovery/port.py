"""What the recovery component may ask of the agent that owns it.

The agent drives calls and owns the links; recovery decides what a call owes a restarted or
reset neighbour and what a restarted rank fetches.  Everything recovery reads or changes on
the agent's side goes through this port, so that the dependency runs one way: the agent
knows its component, the component knows only this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rabit2.core import fsm
from rabit2.core.framing import CallDescriptor, FrameKind, checksum, pack_header
from rabit2.core.records import NO_CALL, ActiveCall, Command, Link
from rabit2.core.schedule import Plan, TreeBroadcast
from rabit2.errors import RabitError


class AgentPort(Protocol):
    """The agent, as its recovery component sees it (loop thread only, like the agent)."""

    rank: int
    world: int
    incarnation: int
    version: int  # (a restarted rank's checkpoint load sets where its program resumes)
    seqno: int
    state: fsm.State
    links: dict[int, Link]
    dead_links: dict[int, str]
    active: ActiveCall | None
    error: RabitError | None

    def go(self, event: fsm.Event) -> None:
        """Take a transition of the agent's table."""

    def fail(self, error: RabitError, cmds: list[Command]) -> None:
        """Fail the call in progress (or the next one) with ``error``, and tell the
        neighbours."""

    def size_to(self, plan: TreeBroadcast, total: int, active: ActiveCall) -> None:
        """A broadcast of unknown size learned its size."""

    def received(self, plan: Plan, peer: int, pos: int) -> None:
        """``peer``'s stream of the call holds ``pos`` bytes now."""

    def send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        """Send a CONTROL frame carrying ``msg``."""

    def send_frame(self, peer: int, parts: Sequence[bytes | memoryview],
                   cmds: list[Command]) -> None:
        """Send one frame: a packed header and its payload."""


def send_blob(agent: AgentPort, peer: int, header_call: tuple[int, int],
              blob: bytes | memoryview,
              cmds: list[Command], desc: CallDescriptor = NO_CALL) -> None:
    """Send ``blob`` as the BLOB frame a ``reply`` or ``local`` message announced."""
    crc = checksum(blob) if agent.links[peer].checked else None
    header = pack_header(FrameKind.BLOB, desc, header_call[0], header_call[1], 0, len(blob),
                         agent.incarnation, crc)
    agent.send_frame(peer, [header, blob], cmds)
