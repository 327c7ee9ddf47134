"""The agent's transition table: every (state, event) pair, graph properties, generated docs."""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from rabit2.core.fsm import (
    LINK_MODES,
    LINK_PHASES,
    TRANSITIONS,
    Event,
    InvalidTransition,
    LinkEvent,
    Mode,
    Phase,
    PhaseEvent,
    State,
    link_transition,
    phase_transition,
    render_markdown,
    transition,
)
from rabit2.errors import RabitError
from tests.support import ROOT

ALL_PAIRS = list(itertools.product(State, Event))
LISTED = [pair for pair in ALL_PAIRS if pair in TRANSITIONS]
UNLISTED = [pair for pair in ALL_PAIRS if pair not in TRANSITIONS]
IN_CALL = (State.ALLREDUCE, State.BROADCAST, State.ALLGATHER)


def _pair_id(pair: tuple[State, Event]) -> str:
    return f"{pair[0].name}-{pair[1].name}"


def _successors(state: State) -> set[State]:
    return {nxt for (src, _), nxt in TRANSITIONS.items() if src is state}


def _reachable(start: State) -> set[State]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in _successors(todo.popleft()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        TRANSITIONS[(State.IDLE, Event.START)] = State.READY  # type: ignore[index]


def test_table_keys_and_values_are_enum_members() -> None:
    for (state, event), nxt in TRANSITIONS.items():
        assert isinstance(state, State) and isinstance(event, Event) and isinstance(nxt, State)
    # both partitions are non-trivial, so the parametrised tests below test something
    assert len(LISTED) > 40 and len(UNLISTED) > 40
    assert len(LISTED) + len(UNLISTED) == len(State) * len(Event)


@pytest.mark.parametrize("pair", LISTED, ids=_pair_id)
def test_listed_pair_returns_its_next_state(pair: tuple[State, Event]) -> None:
    assert transition(*pair) is TRANSITIONS[pair]


@pytest.mark.parametrize("pair", UNLISTED, ids=_pair_id)
def test_unlisted_pair_raises(pair: tuple[State, Event]) -> None:
    state, event = pair
    with pytest.raises(InvalidTransition) as info:
        transition(state, event)
    assert state.value in str(info.value) and event.value in str(info.value)


def test_invalid_transition_is_a_rabit_error() -> None:
    assert issubclass(InvalidTransition, RabitError)


def test_bootstrap_path() -> None:
    state = State.IDLE
    for event, expected in [
        (Event.START, State.CONNECTING_TRACKER),
        (Event.CONNECT_TRACKER, State.CONNECTING_PEERS),
        (Event.CONNECT_PEERS, State.ACCEPTING_PEERS),
        (Event.ACCEPT_PEERS, State.READY),
        (Event.CALL_ALLREDUCE, State.ALLREDUCE),
        (Event.OP_COMPLETE, State.READY),
        (Event.CALL_BROADCAST, State.BROADCAST),
        (Event.OP_FAILED, State.FAILED),
        (Event.SHUTDOWN, State.TASK_COMPLETE),
    ]:
        state = transition(state, event)
        assert state is expected, event


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.name)
def test_shutdown_goes_to_task_complete_where_listed(state: State) -> None:
    if (state, Event.SHUTDOWN) in TRANSITIONS:
        assert transition(state, Event.SHUTDOWN) is State.TASK_COMPLETE
    else:
        # only a call in progress refuses SHUTDOWN: it must finish or fail first
        assert state in IN_CALL


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.name)
def test_task_complete_reachable_from_every_state(state: State) -> None:
    assert State.TASK_COMPLETE in _reachable(state)


def test_in_call_states_reach_task_complete_through_ready_or_failed() -> None:
    for state in IN_CALL:
        for exit_event in (Event.OP_COMPLETE, Event.OP_FAILED):
            assert transition(transition(state, exit_event), Event.SHUTDOWN) is State.TASK_COMPLETE


def test_nothing_leaves_task_complete() -> None:
    outgoing = [(e, n) for (s, e), n in TRANSITIONS.items() if s is State.TASK_COMPLETE]
    assert outgoing, "TASK_COMPLETE must absorb late network events"
    assert all(nxt is State.TASK_COMPLETE for _, nxt in outgoing)
    for event in (Event.START, Event.CALL_ALLREDUCE, Event.CALL_BROADCAST,
                  Event.CALL_ALLGATHER, Event.PRIORITY, Event.OP_FAILED):
        with pytest.raises(InvalidTransition):
            transition(State.TASK_COMPLETE, event)


def test_failed_is_only_left_by_shutdown() -> None:
    assert _successors(State.FAILED) == {State.FAILED, State.TASK_COMPLETE}
    for event in (Event.CALL_ALLREDUCE, Event.CALL_BROADCAST, Event.CALL_ALLGATHER):
        with pytest.raises(InvalidTransition):
            transition(State.FAILED, event)


def test_every_state_reachable_from_idle() -> None:
    assert _reachable(State.IDLE) == set(State)


def test_peer_error_returns_to_the_call_it_interrupted() -> None:
    for call_state, resume in [(State.ALLREDUCE, Event.RESUME_ALLREDUCE),
                               (State.BROADCAST, Event.RESUME_BROADCAST),
                               (State.ALLGATHER, Event.RESUME_ALLGATHER)]:
        assert transition(call_state, Event.PEER_DOWN) is State.PEER_ERROR
        assert transition(State.PEER_ERROR, resume) is call_state
    assert transition(State.PEER_ERROR, Event.OP_COMPLETE) is State.READY
    with pytest.raises(InvalidTransition):
        transition(State.READY, Event.PEER_DOWN)


def test_calls_start_only_from_ready() -> None:
    for event, target in [(Event.CALL_ALLREDUCE, State.ALLREDUCE),
                          (Event.CALL_BROADCAST, State.BROADCAST),
                          (Event.CALL_ALLGATHER, State.ALLGATHER)]:
        sources = {s for (s, e) in TRANSITIONS if e is event}
        assert sources == {State.READY}
        assert TRANSITIONS[(State.READY, event)] is target


def test_docs_state_machine_is_up_to_date() -> None:
    doc = ROOT / "docs" / "state-machine.md"
    assert doc.read_text(encoding="utf-8") == render_markdown(), (
        "docs/state-machine.md is stale; regenerate it with "
        "`python -m rabit2.core.fsm > docs/state-machine.md`"
    )


def test_render_markdown_lists_every_transition() -> None:
    text = render_markdown()
    for (state, event), nxt in TRANSITIONS.items():
        assert f"| {state.value} | {event.value} | {nxt.value} |" in text
    for state in State:
        assert f"| {state.value} | " in text


# ----------------------------------------------------------------------------- fired events


def _core_source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "rabit2" / "core").rglob("*.py"))
                     if p.name != "fsm.py")


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_every_event_of_the_table_is_fired_by_the_agent(event: Event) -> None:
    """An event nothing fires is table entries that decide nothing: delete it."""
    source = _core_source()
    fired = f"Event.{event.name}" in source or (
        event.name.startswith(("CALL_", "RESUME_")) and "_EVENTS" in source)
    assert fired, f"nothing in rabit2/core fires {event.name}"


# ----------------------------------------------------------------------------- link modes


@pytest.mark.parametrize("pair", list(LINK_MODES), ids=lambda p: f"{p[0].name}-{p[1].name}")
def test_every_listed_link_pair_moves_as_listed(pair: tuple[Mode, LinkEvent]) -> None:
    assert link_transition(*pair) is LINK_MODES[pair]


@pytest.mark.parametrize("pair", [p for p in itertools.product(Mode, LinkEvent)
                                  if p not in LINK_MODES],
                         ids=lambda p: f"{p[0].name}-{p[1].name}")
def test_an_unlisted_link_pair_is_refused(pair: tuple[Mode, LinkEvent]) -> None:
    with pytest.raises(InvalidTransition):
        link_transition(*pair)


def test_a_reset_brings_every_mode_back_to_header_and_every_mode_leaves_by_a_frame() -> None:
    assert all(link_transition(m, LinkEvent.RESET) is Mode.HEADER for m in Mode)
    # (a link is never stuck: from every mode some event leads back to reading headers)
    for mode in Mode:
        assert any(LINK_MODES.get((mode, e)) is Mode.HEADER for e in LinkEvent if
                   e is not LinkEvent.RESET), mode


@pytest.mark.parametrize("event", list(LinkEvent), ids=lambda e: e.name)
def test_every_link_event_is_fired_by_the_core(event: LinkEvent) -> None:
    assert f"LinkEvent.{event.name}" in _core_source(), event


# ----------------------------------------------------------------------------- link phases


@pytest.mark.parametrize("pair", list(LINK_PHASES), ids=lambda p: f"{p[0].name}-{p[1].name}")
def test_every_listed_phase_pair_moves_as_listed(pair: tuple[Phase, PhaseEvent]) -> None:
    assert phase_transition(*pair) is LINK_PHASES[pair]


@pytest.mark.parametrize("pair", [p for p in itertools.product(Phase, PhaseEvent)
                                  if p not in LINK_PHASES],
                         ids=lambda p: f"{p[0].name}-{p[1].name}")
def test_an_unlisted_phase_pair_is_refused(pair: tuple[Phase, PhaseEvent]) -> None:
    with pytest.raises(InvalidTransition):
        phase_transition(*pair)


def test_every_phase_can_hang_up_and_every_phase_leads_back_to_up() -> None:
    for phase in Phase:
        if phase is not Phase.DOWN:
            assert phase_transition(phase, PhaseEvent.HANGUP) is Phase.DOWN
        seen, todo = {phase}, deque([phase])
        while todo:
            cur = todo.popleft()
            for event in PhaseEvent:
                nxt = LINK_PHASES.get((cur, event))
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert Phase.UP in seen, phase


def test_a_state_is_awaited_only_after_a_connection_came_up() -> None:
    entered = {nxt for (phase, event), nxt in LINK_PHASES.items()
               if nxt in (Phase.GREETING, Phase.GREETING_HELD) and phase is not nxt}
    assert entered == {Phase.GREETING, Phase.GREETING_HELD}
    assert all(event in (PhaseEvent.CONNECT, PhaseEvent.CONNECT_HELD, PhaseEvent.HOLD,
                         PhaseEvent.RELEASE)
               for (phase, event), nxt in LINK_PHASES.items()
               if nxt in (Phase.GREETING, Phase.GREETING_HELD) and phase is not nxt)
    assert (Phase.DOWN, PhaseEvent.STATE) not in LINK_PHASES


@pytest.mark.parametrize("event", list(PhaseEvent), ids=lambda e: e.name)
def test_every_phase_event_is_fired_by_the_core(event: PhaseEvent) -> None:
    assert f"PhaseEvent.{event.name}" in _core_source(), event
