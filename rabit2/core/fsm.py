"""The agent's state machine.  Everything that changes an agent's state lives in this table.

The table is data: ``TRANSITIONS[(state, event)] -> next state``.  A pair that is not in the
table is an error (:class:`InvalidTransition`), never a silent no-op.  ``docs/state-machine.md``
is generated from this table by :func:`render_markdown` (a test fails when it is stale).

Function-call events come from the API and the bootstrap code (``START``, ``CONNECT_TRACKER``,
``CONNECT_PEERS``, ``ACCEPT_PEERS``, ``CALL_*``, ``SHUTDOWN``); network events come from the
links (``READABLE``, ``PRIORITY`` for an out-of-band error notice from a peer, ``HANGUP``);
``OP_COMPLETE`` and ``TIMEOUT`` are raised by the agent itself when a schedule finishes or
a tick checks the deadlines, and ``OP_FAILED`` whenever this rank fails, from any state
that can (the one failure event: the failure is recorded, whatever state it came in).

Lazy recovery adds ``LINK_UP`` (a link connected or reconnected), ``PEER_DOWN`` (with
recovery on, a link whose input the call still needs was lost: the call waits in
``PEER_ERROR`` for the replacement instead of failing) and ``RESUME_*`` (every lost input is
back: the call goes on).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

from rabit2.errors import RabitError

_S = TypeVar("_S", bound=enum.Enum)
_E = TypeVar("_E", bound=enum.Enum)


class State(enum.Enum):
    # members are singletons: identity hashing is exact and much cheaper than Enum's
    # name-based __hash__, and the table is probed on every network event
    __hash__ = object.__hash__

    IDLE = "idle"
    CONNECTING_TRACKER = "connecting-tracker"
    CONNECTING_PEERS = "connecting-peers"
    ACCEPTING_PEERS = "accepting-peers"
    READY = "ready"
    ALLREDUCE = "allreduce"
    BROADCAST = "broadcast"
    ALLGATHER = "allgather"
    PEER_ERROR = "peer-error"
    FAILED = "failed"
    TASK_COMPLETE = "task-complete"


class Event(enum.Enum):
    __hash__ = object.__hash__

    START = "start"
    CONNECT_TRACKER = "connect-tracker"
    CONNECT_PEERS = "connect-peers"
    ACCEPT_PEERS = "accept-peers"
    CALL_ALLREDUCE = "call-allreduce"
    CALL_BROADCAST = "call-broadcast"
    CALL_ALLGATHER = "call-allgather"
    SHUTDOWN = "shutdown"
    READABLE = "readable"
    PRIORITY = "priority"
    HANGUP = "hang-up"
    OP_COMPLETE = "op-complete"
    OP_FAILED = "op-failed"
    TIMEOUT = "timeout"
    # lazy recovery (docs/recovery.md)
    LINK_UP = "link-up"  # a link (re)connected: both sides exchange their state
    PEER_DOWN = "peer-down"  # a link the call still needs input from was lost
    RESUME_ALLREDUCE = "resume-allreduce"  # every lost input is back: continue the call
    RESUME_BROADCAST = "resume-broadcast"
    RESUME_ALLGATHER = "resume-allgather"


class InvalidTransition(RabitError):
    """An event arrived in a state that has no transition for it (a bug or a protocol breach)."""


S, E = State, Event
_IN_CALL = (S.ALLREDUCE, S.BROADCAST, S.ALLGATHER)

_table: dict[tuple[State, Event], State] = {
    # bootstrap
    (S.IDLE, E.START): S.CONNECTING_TRACKER,
    (S.IDLE, E.SHUTDOWN): S.TASK_COMPLETE,
    (S.CONNECTING_TRACKER, E.CONNECT_TRACKER): S.CONNECTING_PEERS,
    (S.CONNECTING_TRACKER, E.OP_FAILED): S.FAILED,
    (S.CONNECTING_TRACKER, E.SHUTDOWN): S.TASK_COMPLETE,
    (S.CONNECTING_PEERS, E.CONNECT_PEERS): S.ACCEPTING_PEERS,
    (S.CONNECTING_PEERS, E.OP_FAILED): S.FAILED,
    (S.CONNECTING_PEERS, E.SHUTDOWN): S.TASK_COMPLETE,
    (S.ACCEPTING_PEERS, E.ACCEPT_PEERS): S.READY,
    (S.ACCEPTING_PEERS, E.OP_FAILED): S.FAILED,
    (S.ACCEPTING_PEERS, E.SHUTDOWN): S.TASK_COMPLETE,
    (S.READY, E.CALL_ALLREDUCE): S.ALLREDUCE,
    (S.READY, E.CALL_BROADCAST): S.BROADCAST,
    (S.READY, E.CALL_ALLGATHER): S.ALLGATHER,
    (S.READY, E.READABLE): S.READY,
    # a link that closes between calls is remembered; the next call that needs it fails
    (S.READY, E.HANGUP): S.READY,
    (S.READY, E.PRIORITY): S.FAILED,
    (S.READY, E.OP_FAILED): S.FAILED,  # e.g. a reset peer's need this rank cannot serve
    (S.READY, E.TIMEOUT): S.READY,
    (S.READY, E.SHUTDOWN): S.TASK_COMPLETE,
    (S.READY, E.LINK_UP): S.READY,
    # a call blocked on a crashed input: every other link keeps moving; the replacement's
    # link comes up, the call resumes at the byte offsets both sides hold
    (S.PEER_ERROR, E.READABLE): S.PEER_ERROR,
    (S.PEER_ERROR, E.HANGUP): S.PEER_ERROR,
    (S.PEER_ERROR, E.PEER_DOWN): S.PEER_ERROR,
    (S.PEER_ERROR, E.LINK_UP): S.PEER_ERROR,
    (S.PEER_ERROR, E.PRIORITY): S.FAILED,
    (S.PEER_ERROR, E.TIMEOUT): S.PEER_ERROR,
    (S.PEER_ERROR, E.OP_FAILED): S.FAILED,
    # the lost peer only had to receive from us: our own result is complete without it
    (S.PEER_ERROR, E.OP_COMPLETE): S.READY,
    (S.PEER_ERROR, E.RESUME_ALLREDUCE): S.ALLREDUCE,
    (S.PEER_ERROR, E.RESUME_BROADCAST): S.BROADCAST,
    (S.PEER_ERROR, E.RESUME_ALLGATHER): S.ALLGATHER,
    (S.PEER_ERROR, E.SHUTDOWN): S.TASK_COMPLETE,
    # after a failure every call raises the recorded error; network noise is ignored
    (S.FAILED, E.READABLE): S.FAILED,
    (S.FAILED, E.HANGUP): S.FAILED,
    (S.FAILED, E.PRIORITY): S.FAILED,
    (S.FAILED, E.TIMEOUT): S.FAILED,
    (S.FAILED, E.OP_FAILED): S.FAILED,
    (S.FAILED, E.LINK_UP): S.FAILED,
    (S.FAILED, E.SHUTDOWN): S.TASK_COMPLETE,
    # wiring may finish after a neighbour already reported a failure: the failure stands
    (S.FAILED, E.CONNECT_PEERS): S.FAILED,
    (S.FAILED, E.ACCEPT_PEERS): S.FAILED,
    # peers close their links once they are done
    (S.TASK_COMPLETE, E.READABLE): S.TASK_COMPLETE,
    (S.TASK_COMPLETE, E.HANGUP): S.TASK_COMPLETE,
    (S.TASK_COMPLETE, E.SHUTDOWN): S.TASK_COMPLETE,
    (S.TASK_COMPLETE, E.TIMEOUT): S.TASK_COMPLETE,
    # with recovery on, finalize holds until every rank finalized: a restarted neighbour's
    # link comes up and is served its checkpoint and results (docs/recovery.md)
    (S.TASK_COMPLETE, E.LINK_UP): S.TASK_COMPLETE,
}
# a neighbour that finished wiring may start its first call while we are still wiring: the
# agent holds its frames (pauses that link) until our call starts
for _state in (S.CONNECTING_PEERS, S.ACCEPTING_PEERS):
    _table.update(
        {
            (_state, E.READABLE): _state,
            (_state, E.HANGUP): _state,
            (_state, E.PRIORITY): S.FAILED,
            (_state, E.LINK_UP): _state,
        }
    )
for _state in _IN_CALL:
    _table.update(
        {
            (_state, E.READABLE): _state,
            (_state, E.TIMEOUT): _state,  # a tick: the agent checks its progress deadline
            (_state, E.OP_COMPLETE): S.READY,
            (_state, E.OP_FAILED): S.FAILED,
            (_state, E.PRIORITY): S.FAILED,
            # a closed link fails the call only if the call still needs it (agent decides)
            (_state, E.HANGUP): _state,
            (_state, E.PEER_DOWN): S.PEER_ERROR,
            (_state, E.LINK_UP): _state,
        }
    )

TRANSITIONS: Mapping[tuple[State, Event], State] = MappingProxyType(_table)
del _table


# ----------------------------------------------------------------------------- per link


class Mode(enum.Enum):
    """What the next bytes from a peer are (each link has its own receive mode)."""

    __hash__ = object.__hash__

    HEADER = "header"  # a frame header (and whatever small payload follows it in the stage)
    PAYLOAD = "payload"  # a DATA frame's payload, landing in the call's plan
    BODY = "body"  # the msgpack payload of an ERROR or CONTROL frame
    HELD = "held"  # a header of a later call was read; the link is paused until that call starts
    BLOB = "blob"  # the raw bytes a "reply" announced, landing where the fetch said


class LinkEvent(enum.Enum):
    __hash__ = object.__hash__

    DATA = "data"  # a DATA header of the call in progress, with a payload
    BODY = "control-or-error"  # a CONTROL or ERROR header
    BLOB = "blob"  # the BLOB header a reply announced
    LATER_CALL = "later-call"  # a header of a call this rank has not begun
    FRAME_DONE = "frame-done"  # the frame is whole (and verified): the next is a header
    CALL_BEGAN = "call-began"  # the call a held header belongs to began
    RESET = "reset"  # a new connection: nothing of the old one's framing carries over


LINK_MODES: Mapping[tuple[Mode, LinkEvent], Mode] = MappingProxyType({
    (Mode.HEADER, LinkEvent.DATA): Mode.PAYLOAD,
    (Mode.HEADER, LinkEvent.BODY): Mode.BODY,
    (Mode.HEADER, LinkEvent.BLOB): Mode.BLOB,
    (Mode.HEADER, LinkEvent.LATER_CALL): Mode.HELD,
    # an empty DATA frame (an announce), or a blob of 0 B: whole with its header
    (Mode.HEADER, LinkEvent.FRAME_DONE): Mode.HEADER,
    (Mode.PAYLOAD, LinkEvent.FRAME_DONE): Mode.HEADER,
    (Mode.BODY, LinkEvent.FRAME_DONE): Mode.HEADER,
    (Mode.BLOB, LinkEvent.FRAME_DONE): Mode.HEADER,
    (Mode.HELD, LinkEvent.CALL_BEGAN): Mode.HEADER,
    **{(mode, LinkEvent.RESET): Mode.HEADER for mode in Mode},
})
"""A link's receive modes: ``(mode, event) -> next mode``.  The receive side
(``rabit2.core.pair``) moves a link only through this table; a pair not listed is a bug."""


def link_transition(mode: Mode, event: LinkEvent) -> Mode:
    """The next receive mode, or :class:`InvalidTransition` for a pair not listed."""
    return _next(LINK_MODES, mode, event, "link event", "receive mode")


class Phase(enum.Enum):
    """Where a link stands in the recovery protocol (with recovery off a link stays ``up``)."""

    __hash__ = object.__hash__

    UP = "up"  # connected, and sending whatever of the call is ready
    HELD = "held"  # connected; our stream of the call waits for the peer's "need"
    GREETING = "greeting"  # just connected: nothing is sent until the peer's state is in
    GREETING_HELD = "greeting-held"  # both: the state first, then the need
    DOWN = "down"  # hung up, until the same process or its replacement connects


class PhaseEvent(enum.Enum):
    __hash__ = object.__hash__

    HANGUP = "hang-up"  # the connection closed or failed
    CONNECT = "connect"  # a connection came up: the peer's state comes first
    CONNECT_HELD = "connect-held"  # ... back during a call that sends to it: and then its need
    STATE = "state"  # the peer said where it stands
    HOLD = "hold"  # our stream of the call waits for the peer's need
    RELEASE = "release"  # the need was heard (or the call it was about ended)


_held = {Phase.UP: Phase.HELD, Phase.GREETING: Phase.GREETING_HELD}
LINK_PHASES: Mapping[tuple[Phase, PhaseEvent], Phase] = MappingProxyType({
    **{(phase, PhaseEvent.HANGUP): Phase.DOWN for phase in Phase if phase is not Phase.DOWN},
    (Phase.DOWN, PhaseEvent.CONNECT): Phase.GREETING,
    (Phase.DOWN, PhaseEvent.CONNECT_HELD): Phase.GREETING_HELD,
    # the same process dialing again where this rank did not see the old connection go down
    (Phase.UP, PhaseEvent.CONNECT): Phase.GREETING,
    (Phase.HELD, PhaseEvent.CONNECT): Phase.GREETING_HELD,
    (Phase.GREETING, PhaseEvent.CONNECT): Phase.GREETING,
    (Phase.GREETING_HELD, PhaseEvent.CONNECT): Phase.GREETING_HELD,
    (Phase.GREETING, PhaseEvent.STATE): Phase.UP,
    (Phase.GREETING_HELD, PhaseEvent.STATE): Phase.HELD,
    # a restarted rank says again where it resumes, once its checkpoint is chosen
    (Phase.UP, PhaseEvent.STATE): Phase.UP,
    (Phase.HELD, PhaseEvent.STATE): Phase.HELD,
    **{(phase, PhaseEvent.HOLD): _held.get(phase, phase)
       for phase in (Phase.UP, Phase.HELD, Phase.GREETING, Phase.GREETING_HELD)},
    (Phase.HELD, PhaseEvent.RELEASE): Phase.UP,
    (Phase.GREETING_HELD, PhaseEvent.RELEASE): Phase.GREETING,
    # a call begins: a need still awaited was about the call that ended
    (Phase.UP, PhaseEvent.RELEASE): Phase.UP,
    (Phase.GREETING, PhaseEvent.RELEASE): Phase.GREETING,
    (Phase.DOWN, PhaseEvent.RELEASE): Phase.DOWN,
})
"""A link's recovery phases: ``(phase, event) -> next phase``.  Only ``up`` sends a call's
stream; ``greeting`` and ``held`` wait for the peer to say where it stands and what it needs
(``docs/recovery.md``)."""
del _held


def phase_transition(phase: Phase, event: PhaseEvent) -> Phase:
    """The next recovery phase, or :class:`InvalidTransition` for a pair not listed."""
    return _next(LINK_PHASES, phase, event, "link event", "phase")


def transition(state: State, event: Event) -> State:
    """The next state, or :class:`InvalidTransition` for a pair the table does not list."""
    return _next(TRANSITIONS, state, event, "event", "state")


def _next(table: Mapping[tuple[_S, _E], _S], state: _S, event: _E, event_kind: str,
          state_kind: str) -> _S:
    """``table[(state, event)]``, or :class:`InvalidTransition` naming the pair."""
    try:
        return table[(state, event)]
    except KeyError:
        raise InvalidTransition(f"{event_kind} {event.value!r} is not valid in {state_kind} "
                                f"{state.value!r}") from None


def render_markdown() -> str:
    """The transition table as markdown, the body of ``docs/state-machine.md``."""
    lines = [
        "# Agent state machine",
        "",
        "Generated from `rabit2/core/fsm.py` by",
        "`python -m rabit2.core.fsm > docs/state-machine.md`;",
        "`tests/unit/test_fsm.py` fails when this file is stale. Every (state, event) pair that",
        "is not listed is an error (`InvalidTransition`).",
        "",
        "## Transitions",
        "",
        "| state | event | next state |",
        "| --- | --- | --- |",
    ]
    for state in State:
        for event in Event:
            nxt = TRANSITIONS.get((state, event))
            if nxt is not None:
                lines.append(f"| {state.value} | {event.value} | {nxt.value} |")
    lines += ["", "## Matrix", "", "Rows are states, columns events; `.` marks an invalid pair."]
    lines.append("")
    header = "| state | " + " | ".join(e.value for e in Event) + " |"
    lines += [header, "| --- |" + " --- |" * len(Event)]
    for state in State:
        cells = [TRANSITIONS[(state, e)].value if (state, e) in TRANSITIONS else "." for e in Event]
        lines.append(f"| {state.value} | " + " | ".join(cells) + " |")
    lines += ["", "## Diagram", "", "```mermaid", "stateDiagram-v2"]
    for (state, event), nxt in TRANSITIONS.items():
        if state is not nxt:
            lines.append(f"    {state.name} --> {nxt.name}: {event.value}")
    lines += ["```", "", "## A link's receive mode", "",
              "Each peer link has its own receive mode (`LINK_MODES`): what its next bytes "
              "are.", "", "| mode | event | next mode |", "| --- | --- | --- |"]
    for (mode, link_event), nxt_mode in LINK_MODES.items():
        lines.append(f"| {mode.value} | {link_event.value} | {nxt_mode.value} |")
    lines += ["", "## A link's recovery phase", "",
              "With recovery on, each peer link also has a phase (`LINK_PHASES`): whether this "
              "rank may send it the call's stream, or waits for its state or its need first.",
              "", "| phase | event | next phase |", "| --- | --- | --- |"]
    for (phase, phase_event), nxt_phase in LINK_PHASES.items():
        lines.append(f"| {phase.value} | {phase_event.value} | {nxt_phase.value} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
