"""Elastic mode's live sets, on the tracker: which ranks form each set, and each set's
outcome (docs/elastic.md).  Pure: the registry (``tracker/registry.py``) owns one and hands it
the tasks; the decisions go out with the registry's.

A set forms once every eligible task (ranked, connected, not finished, not left) asked for
one (``live``).  It succeeds once every member reported ``live_done`` with ok; it fails at
the first member that reports otherwise or that is gone before it reported.  Every member
gets the same outcome (``live_result``), in answer to its ``live_done`` or at once if it
already sent one.

Messages go to a task's *current* connection: a worker whose tracker connection blinked
rejoins and asks again (the same ``live`` or ``live_done``), and gets the same answer.  The
outcome of every set is kept, so a late report of an older set gets that set's outcome.
Which processes hold the job's state is known from the last set that succeeded: ``new`` names
the members that were not in it (as that incarnation).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from tracker.decisions import Decision, EndSet, FormSet, Send

if TYPE_CHECKING:
    from tracker.registry import Task

C = TypeVar("C", bound=Hashable)

logger = logging.getLogger("rabit2.tracker")

_KEPT_OUTCOMES = 64  # outcomes of older sets kept for late reports


class LiveSets(Generic[C]):
    """The live sets of one elastic job; ``tasks`` is the registry's own table."""

    def __init__(self, tasks: Mapping[str, Task[C]]) -> None:
        self.tasks = tasks
        self.epoch = 0  # the current set's number (0: none yet)
        self.ranks: tuple[int, ...] = ()  # its members
        self.incarnations: dict[int, int] = {}  # rank -> its incarnation in the current set
        self.holders: dict[int, int] = {}  # rank -> incarnation, of the last good set
        self.asking: set[str] = set()  # task ids asking for the next set
        self.reported: dict[int, bool] = {}  # member -> ok, for the current set
        self.calls: dict[int, int] = {}  # member -> collective calls it made in the block
        self.announced: int | None = None  # the fewest calls the others were told of
        self.answer: dict[int, str] = {}  # members waiting for the outcome (rank -> task id)
        self.outcomes: dict[int, tuple[bool, str]] = {}  # epoch -> outcome, once settled
        self.history: list[tuple[int, ...]] = []  # every set formed, in order

    @property
    def outcome(self) -> tuple[bool, str] | None:
        """The current set's outcome, once settled."""
        return self.outcomes.get(self.epoch)

    # -- events -----------------------------------------------------------------------------

    def ask(self, task: Task[C]) -> list[Decision[C]]:
        """``task`` called ``live_set()`` (or asks again after its connection blinked: a
        blink before the set reached it already failed that set, so it waits for the
        next one like the others)."""
        self.asking.add(task.task_id)
        return self.try_form()

    def done(self, task: Task[C], epoch: int, ok: bool, reason: str,
             calls: int | None = None) -> list[Decision[C]]:
        """``task`` left the block of set ``epoch`` (``ok``: without an error) after
        ``calls`` collective calls (None: not said).  The members still in the block hear
        of it: a call of theirs beyond those never completes, and fails at once."""
        rank = task.rank
        if epoch != self.epoch or rank is None or rank not in self.ranks:
            # (a report of an older set, sent again after a blink: that set's outcome)
            settled = self.outcomes.get(epoch, (False, "that live set is over"))
            return self._send(task, epoch, settled)
        self.answer[rank] = task.task_id
        if self.outcome is not None:
            return self._send(task, self.epoch, self.outcome)
        self.reported[rank] = ok
        if not ok:
            return self._settle(False, f"job rank {rank} failed in it: {reason}")
        if calls is not None:
            self.calls[rank] = calls
            if len(set(self.calls.values())) > 1:
                made = ", ".join(f"job rank {r} {n}" for r, n in sorted(self.calls.items()))
                return self._settle(False, f"its members made different numbers of "
                                           f"collective calls in the block ({made})")
        if len(self.reported) == len(self.ranks) and all(self.reported.values()):
            return self._settle(True, "")
        if calls is None or (self.announced is not None and calls >= self.announced):
            return []  # (only a lower count tells the others anything: N messages a set)
        self.announced = calls
        return [Send(other.task_id, other.conn, {"t": "live_left", "epoch": epoch,
                                                 "rank": rank, "calls": calls},
                     f"rank {rank} left live set {epoch}'s block")
                for other in self.tasks.values()
                if other.rank in self.ranks and other.rank not in self.reported
                and other.conn is not None]

    def gone(self, task: Task[C], why: str) -> list[Decision[C]]:
        """``task`` was lost, finished, left, lost its connection or was replaced."""
        out: list[Decision[C]] = []
        self.asking.discard(task.task_id)
        rank = task.rank
        if (rank is not None and rank in self.ranks and self.outcome is None
                and rank not in self.reported):
            out += self._settle(False, f"job rank {rank} {why}")
        return out + self.try_form()

    def failed(self, epoch: int, reason: str) -> list[Decision[C]]:
        """Set ``epoch`` cannot run (its collectives' tracker did not start)."""
        if epoch != self.epoch or self.outcome is not None:
            return []
        return self._settle(False, reason)

    # -- internals --------------------------------------------------------------------------

    def try_form(self) -> list[Decision[C]]:
        """Form the next set if every eligible task asked for it."""
        if self.epoch and self.outcome is None:
            return []  # (the current set is not over)
        eligible = sorted((task for task in self.tasks.values()
                           if task.rank is not None and task.conn is not None
                           and not task.finished and not task.left),
                          key=lambda task: task.rank or 0)
        if not eligible or any(task.task_id not in self.asking for task in eligible):
            return []
        ranks = tuple(task.rank for task in eligible if task.rank is not None)
        incarnations = {task.rank: task.incarnation for task in eligible
                        if task.rank is not None}
        new = tuple(rank for rank in ranks if self.holders.get(rank) != incarnations[rank])
        if self.holders and new == ranks and any(t.finished for t in self.tasks.values()):
            return self._nothing_to_join(eligible)
        reuse = self.outcome == (True, "") and ranks == self.ranks and not new
        self.epoch += 1
        self.ranks, self.incarnations = ranks, incarnations
        self.asking, self.reported, self.answer, self.calls = set(), {}, {}, {}
        self.announced = None
        self.history.append(ranks)
        why = f"live set {self.epoch}: ranks {list(ranks)}" + (f", new {list(new)}" if new
                                                                 else "")
        logger.info("%s", why)
        members = tuple((task.task_id, task.conn) for task in eligible
                        if task.conn is not None)
        return [FormSet(self.epoch, ranks, new, members, reuse, why)]

    def _nothing_to_join(self, askers: list[Task[C]]) -> list[Decision[C]]:
        """Only newcomers ask, and the workers that had the job's state finished it: there
        is no set to join (they are told with an empty one, and leave)."""
        why = "the job's other workers finished it: there is no live set to join"
        out: list[Decision[C]] = []
        for task in askers:
            self.asking.discard(task.task_id)
            if task.conn is not None:
                out.append(Send(task.task_id, task.conn, {
                    "t": "live_set", "epoch": self.epoch, "ranks": [], "new": [], "host": "",
                    "port": 0, "reason": why}, why))
        return out

    def _settle(self, ok: bool, reason: str) -> list[Decision[C]]:
        self.outcomes[self.epoch] = (ok, reason)
        for old in [epoch for epoch in self.outcomes if epoch <= self.epoch - _KEPT_OUTCOMES]:
            del self.outcomes[old]
        out: list[Decision[C]] = []
        if ok:
            self.holders = dict(self.incarnations)  # they hold the job's state now
        else:
            logger.warning("live set %d failed: %s", self.epoch, reason)
            out.append(EndSet(self.epoch, reason))
        for task_id in self.answer.values():
            out += self._send(self.tasks[task_id], self.epoch, (ok, reason))
        return out

    def _send(self, task: Task[C], epoch: int, outcome: tuple[bool, str]) -> list[Decision[C]]:
        """The outcome of set ``epoch``, to ``task``'s current connection (none while it
        has none: it reports again once it is back, and gets it then)."""
        ok, reason = outcome
        if task.conn is None:
            return []
        return [Send(task.task_id, task.conn, {"t": "live_result", "epoch": epoch, "ok": ok,
                                               "reason": reason}, f"live set {epoch} settled")]


__all__ = ["LiveSets"]
