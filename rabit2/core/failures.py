"""How a rank fails: once, typed, and heard by its neighbours.

Every failure goes through :meth:`Failures.fail`: the agent takes ``OP_FAILED``, the first
error is recorded (later ones change nothing), it is flooded to the neighbours as an ERROR
frame (unless it came from the tracker, which tells every rank itself), and the call in
progress ends with :class:`CallFailed`.  A neighbour's ERROR frame is recorded the same way
with its origin.  The deadlines are checked here too: no byte moved for ``timeout`` seconds,
or a lost input not back within ``recover_timeout``.
"""

from __future__ import annotations

from typing import Protocol

from rabit2.core import fsm, progress
from rabit2.core.framing import error_from_wire, error_type_of
from rabit2.core.records import ActiveCall, CallFailed, CloseLink, Command, Link
from rabit2.core.recovery.component import Recovery
from rabit2.core.sending import Sender
from rabit2.errors import CollectiveTimeoutError, JobAbortedError, RabitError

State, Event = fsm.State, fsm.Event


class Owner(Protocol):
    """What the failure path reads and changes of the agent that owns it."""

    rank: int
    state: fsm.State
    links: dict[int, Link]
    active: ActiveCall | None
    error: RabitError | None
    recovery: Recovery | None
    sender: Sender
    last_progress: float
    timeout: float

    def go(self, event: fsm.Event) -> None: ...
    def send_control(self, peer: int, msg: dict[str, object], cmds: list[Command]) -> None: ...


class Failures:
    """The failure path and the deadlines of one agent (loop thread only)."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent

    def fail(self, error: RabitError, cmds: list[Command], *, source: int = -1,
             close: int = -1, flood: bool = True) -> None:
        """Fail with ``error`` (the first one stands); ``source``: the peer it came from,
        which is not told again; ``close``: a link to close with it."""
        agent = self.agent
        if agent.state not in (State.FAILED, State.TASK_COMPLETE):
            agent.go(Event.OP_FAILED)
        if close >= 0:
            cmds.append(CloseLink(close, str(error)))
        if agent.error is not None:
            return
        self._record(error, cmds, source=source, origin=agent.rank, reason=str(error),
                     flood=flood)

    def remote_error(self, peer: int, error_type: str, reason: str, origin: int,
                     cmds: list[Command]) -> None:
        """``peer`` forwarded the failure of rank ``origin``."""
        agent = self.agent
        agent.go(Event.PRIORITY)
        if agent.error is not None:
            return
        error = error_from_wire(error_type, f"{reason} (reported by rank {origin})")
        self._record(error, cmds, source=peer, origin=origin, reason=reason)

    def abort(self, reason: str) -> list[Command]:
        """The tracker aborted the job (every rank hears it from the tracker)."""
        agent = self.agent
        cmds: list[Command] = []
        if agent.state in (State.FAILED, State.TASK_COMPLETE):
            return cmds
        if agent.state is State.IDLE:
            agent.error = JobAbortedError(reason)
            return cmds
        self.fail(JobAbortedError(reason), cmds, flood=False)
        return cmds

    def tick(self, now: float) -> list[Command]:
        """Check the deadlines of the call in progress; tell the neighbours it moves."""
        agent = self.agent
        agent.go(Event.TIMEOUT)
        cmds: list[Command] = []
        active = agent.active
        if active is None:
            return cmds
        if now - agent.last_progress > agent.timeout:
            plan = active.plan
            waiting = [peer for peer, stream in plan.in_streams.items()
                       if plan.received[peer] < stream.length]
            self.fail(CollectiveTimeoutError(
                f"rank {agent.rank}: no progress in call {active.call_id} for "
                f"{agent.timeout:g} s" + (f", waiting for bytes from rank "
                                          f"{', '.join(map(str, sorted(waiting)))}"
                                          if waiting else "")), cmds)
            return cmds
        late = agent.recovery.check_deadline(active, now) if agent.recovery is not None else None
        if late is not None:
            self.fail(late, cmds)
            return cmds
        progress.tell(agent, active, now, cmds)
        return cmds

    def _record(self, error: RabitError, cmds: list[Command], *, source: int, origin: int,
                reason: str, flood: bool = True) -> None:
        agent = self.agent
        agent.error = error
        call_id = agent.active.call_id if agent.active is not None else None
        if flood:
            agent.sender.flood_error(error_type_of(error), reason, origin, cmds, source)
        agent.active = None
        cmds.append(CallFailed(call_id, error))
