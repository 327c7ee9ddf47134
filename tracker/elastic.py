"""Elastic mode's live sets, on the tracker: which ranks form each set, and each set's
outcome (docs/elastic.md).  Pure: the registry (``tracker/registry.py``) owns one and hands it
the tasks; the decisions go out with the registry's.

A set forms once every eligible task (ranked, connected, not finished, not left) asked for
one (``live``).  It succeeds once every member reported ``live_done`` with ok; it fails at
the first member that reports otherwise or that is gone before it reported.  Every member
gets the same outcome (``live_result``), in answer to its ``live_done`` or at once if it
already sent one.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

from tracker.decisions import Decision, EndSet, FormSet, Send

if TYPE_CHECKING:
    from tracker.registry import Task

C = TypeVar("C", bound=Hashable)

logger = logging.getLogger("rabit2.tracker")


class LiveSets(Generic[C]):
    """The live sets of one elastic job."""

    def __init__(self) -> None:
        self.epoch = 0  # the current set's number (0: none yet)
        self.ranks: tuple[int, ...] = ()  # its members
        self.incarnations: dict[int, int] = {}  # rank -> its incarnation in the current set
        self.asking: dict[str, C] = {}  # task id -> connection, asking for the next set
        self.reported: dict[int, bool] = {}  # member -> ok, for the current set
        self.answer: dict[int, tuple[str, C]] = {}  # member -> where its outcome goes
        self.outcome: tuple[bool, str] | None = None  # the current set's, once settled
        self.history: list[tuple[int, ...]] = []  # every set formed, in order

    # -- events -----------------------------------------------------------------------------

    def ask(self, task: Task[C], conn: C, tasks: Iterable[Task[C]]) -> list[Decision[C]]:
        """``task`` called ``live_set()``."""
        self.asking[task.task_id] = conn
        return self.try_form(tasks)

    def done(self, task: Task[C], conn: C, epoch: int, ok: bool,
             reason: str) -> list[Decision[C]]:
        """``task`` left the block of set ``epoch`` (``ok``: without an error)."""
        rank = task.rank
        if epoch != self.epoch or rank is None or rank not in self.ranks:
            # (a member of an older set, or a stranger to this one: it failed already)
            return [Send(task.task_id, conn, {"t": "live_result", "epoch": epoch, "ok": False,
                                              "reason": "that live set is over"},
                         "a report for a set that is over")]
        self.answer[rank] = (task.task_id, conn)
        if self.outcome is None:
            self.reported[rank] = ok
            if not ok:
                return self._settle(False, f"rank {rank} failed in it: {reason}")
            if len(self.reported) == len(self.ranks) and all(self.reported.values()):
                return self._settle(True, "")
            return []
        return [self._result(rank)]

    def gone(self, task: Task[C], why: str, tasks: Iterable[Task[C]]) -> list[Decision[C]]:
        """``task`` was lost, finished, left or lost its connection."""
        out: list[Decision[C]] = []
        self.asking.pop(task.task_id, None)
        rank = task.rank
        if (rank is not None and rank in self.ranks and self.outcome is None
                and rank not in self.reported):
            out += self._settle(False, f"rank {rank} {why}")
        return out + self.try_form(tasks)

    # -- internals --------------------------------------------------------------------------

    def try_form(self, tasks: Iterable[Task[C]]) -> list[Decision[C]]:
        """Form the next set if every eligible task asked for it."""
        tasks = list(tasks)
        eligible = [task for task in tasks if task.rank is not None and task.conn is not None
                    and not task.finished and not task.left]
        if not eligible or any(task.task_id not in self.asking for task in eligible):
            return []
        eligible.sort(key=lambda task: task.rank or 0)
        ranks = tuple(task.rank for task in eligible if task.rank is not None)
        incarnations = {task.rank: task.incarnation for task in eligible
                        if task.rank is not None}
        new = tuple(rank for rank in ranks if self.incarnations.get(rank) != incarnations[rank])
        if self.epoch > 0 and new == ranks and any(task.finished for task in tasks):
            return self._nothing_to_join(eligible)
        reuse = (self.outcome is not None and self.outcome[0] and ranks == self.ranks
                 and not new)
        members = tuple((task.task_id, self.asking[task.task_id]) for task in eligible)
        self.epoch += 1
        self.ranks, self.incarnations = ranks, incarnations
        self.asking, self.reported, self.answer, self.outcome = {}, {}, {}, None
        self.history.append(ranks)
        why = f"live set {self.epoch}: ranks {list(ranks)}" + (f", new {list(new)}" if new
                                                                 else "")
        logger.info("%s", why)
        return [FormSet(self.epoch, ranks, new, members, reuse, why)]

    def _nothing_to_join(self, askers: list[Task[C]]) -> list[Decision[C]]:
        """Only newcomers ask, and the workers that had the job's state finished it: there
        is no set to join (they are told with an empty one, and leave)."""
        why = "the job's other workers finished it: there is no live set to join"
        out: list[Decision[C]] = []
        for task in askers:
            conn = self.asking.pop(task.task_id)
            out.append(Send(task.task_id, conn, {"t": "live_set", "epoch": self.epoch,
                                                 "ranks": [], "new": [], "host": "",
                                                 "port": 0, "reason": why}, why))
        return out

    def _settle(self, ok: bool, reason: str) -> list[Decision[C]]:
        self.outcome = (ok, reason)
        out: list[Decision[C]] = []
        if not ok:
            logger.warning("live set %d failed: %s", self.epoch, reason)
            out.append(EndSet(self.epoch, reason))
        return out + [self._result(rank) for rank in sorted(self.answer)]

    def _result(self, rank: int) -> Send[C]:
        assert self.outcome is not None
        task_id, conn = self.answer[rank]
        ok, reason = self.outcome
        return Send(task_id, conn, {"t": "live_result", "epoch": self.epoch, "ok": ok,
                                    "reason": reason}, f"live set {self.epoch} settled")


__all__ = ["LiveSets"]
