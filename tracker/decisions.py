"""What the registry (``tracker/registry.py``) decides: plain values that the tracker
(``tracker/service.py``) carries out in order, each with the reason it was taken.  ``C`` is the
tracker's handle of a connection."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeAlias, TypeVar

C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Send(Generic[C]):
    """Write ``msg`` on ``conn``, the connection of task ``task_id``."""

    task_id: str
    conn: C
    msg: dict[str, Any]
    reason: str


@dataclass(frozen=True, slots=True)
class Fence(Generic[C]):
    """Close ``conn``: a newer connection of task ``task_id`` took its place."""

    task_id: str
    conn: C
    reason: str


@dataclass(frozen=True, slots=True)
class Release(Generic[C]):
    """Stop serving ``conn``: its worker is done with it (``bye`` was sent)."""

    task_id: str
    conn: C
    reason: str


@dataclass(frozen=True, slots=True)
class Hook:
    """Call the tracker's hook ``name`` with ``args``."""

    name: Literal["on_worker_lost", "on_rank_assigned", "on_task_finished"]
    args: tuple[Any, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Grace:
    """In ``delay`` seconds, call :meth:`Registry.grace_over` with ``task_id`` and ``token``."""

    task_id: str
    delay: float
    token: int
    reason: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The job ended: ``success`` iff every rank shut down and nobody aborted it."""

    success: bool
    reason: str


@dataclass(frozen=True, slots=True)
class FormSet(Generic[C]):
    """Elastic mode: live set ``epoch`` formed.  Start its collectives' tracker (or keep
    the previous set's when ``reuse``), then send ``live_set`` to each member, given as
    (task id, connection) in rank order."""

    epoch: int
    ranks: tuple[int, ...]
    new: tuple[int, ...]
    members: tuple[tuple[str, C], ...]
    reuse: bool
    reason: str


@dataclass(frozen=True, slots=True)
class EndSet:
    """Elastic mode: live set ``epoch`` failed; abort its collectives' job and close its
    tracker, so that a member blocked in one of its collectives is released."""

    epoch: int
    reason: str


Decision: TypeAlias = (Send[C] | Fence[C] | Release[C] | Hook | Grace | Finish | FormSet[C]
                       | EndSet)


__all__ = ["Decision", "EndSet", "Fence", "Finish", "FormSet", "Grace", "Hook", "Release",
           "Send"]
