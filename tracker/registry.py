"""The job as the tracker sees it: registrations, ranks, losses and the job's end.

Pure: no sockets, no event loop, no clock.  The tracker (``tracker/service.py``) feeds it
events - a registration or rejoin on a connection, a connection that ended, a rank reported
unreachable, a worker's error or shutdown, the launcher's word that a process exited or failed
for good - and applies what each returns: a list of decisions (``tracker/decisions.py``), each
with the reason it was taken.  A connection is an opaque hashable handle of the caller's; time
is the caller's ``now``.  A registration or rejoin that must be refused raises
``ProtocolError`` (the tracker sends it back as ``refuse``).

What it decides (``docs/protocol.md``, "Tracker protocol"): ranks once ``n_workers`` tasks have
registered (stable per task id: a task that registers again gets its old rank back with
``incarnation + 1``), each worker's ``assign`` (its tree/ring links and its neighbours'
addresses, ``rabit2.core.topology``), ``peer_lost``/``peer_recovered`` notices to the
neighbours of a lost/returning rank, a rejoin within the grace, the adoption of workers that
rejoin from a previous tracker, the abort of the job and its end when every rank has shut down.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Generic

from rabit2.core.topology import topology
from rabit2.errors import ProtocolError
from tracker.decisions import C, Decision, Fence, Finish, Grace, Hook, Release, Send
from tracker.elastic import LiveSets
from tracker.status import job_status

logger = logging.getLogger("rabit2.tracker")
SILENCE_REASON = "no message for"  # how a heartbeat timeout is reported
# a rank that another cannot reach counts as alive if it was heard from this recently (its
# heartbeats come every rabit2_heartbeat_sec, 1 s by default)
_ALIVE_WITHIN_SEC = 5.0
REJOIN_GRACE_SEC = 5.0
"""A worker whose connection ended (EOF, reset: a blip on the path, or a death that its
neighbours see on their own links at once) may rejoin within this many seconds, as the same
process and incarnation, before it counts as lost; silence (heartbeats) counts at once."""

_MAX_TASK_ID = 256  # task ids are labels; bound them like every other wire length
_NULL_TASK = "NULL"  # what classic workers send when DMLC_TASK_ID is unset
_MAX_REASON = 64 * 1024  # characters of an abort reason (UTF-8: <= 256 KiB < MAX_FRAME)


class WrongJobError(ProtocolError):
    """A worker of this job (it knows the secret) that was set up for another world size: no
    restart can fix it, so the tracker ends the job as it refuses the worker."""


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders digit runs numerically: "2" < "10", "task2" < "task10"."""
    return tuple(
        (0, int(part)) if part.isascii() and part.isdigit() else (1, part)
        for part in re.split(r"([0-9]+)", text)
        if part
    )


@dataclass(slots=True, eq=False)
class Task(Generic[C]):
    """One task of the job: the launcher's label ``task_id`` and what its workers told."""

    task_id: str
    arrival: int
    attempt: int = 0
    incarnation: int = 0
    rank: int | None = None
    host: str = ""
    port: int = 0
    conn: C | None = None
    finished: bool = False
    held: bool = False  # finished, and still serving until every rank has (shutdown hold)
    losses: int = 0  # times this task's worker was lost (connection or heartbeats)
    heard: float = 0.0  # when its connection last delivered a message (the caller's clock)
    # what its latest heartbeat reported (rabit2.core.control.PROGRESS_FIELDS); None until
    # the current incarnation reports
    progress: dict[str, int | bool] | None = None
    left: bool = False  # elastic mode: given up, and the job goes on without it
    # its connection ended, not in silence: the same process may rejoin within the grace
    # (REJOIN_GRACE_SEC) before it counts as lost; the grace's token and the reason
    pending_loss: int | None = None
    loss_reason: str = ""
    # the launcher saw its process end while its connection still looked open here (the
    # two are heard on different threads, in either order): that connection's end is a
    # loss at once, with no grace for a rejoin that cannot come
    exited: bool = False


class Registry(Generic[C]):
    """The tasks of one job of ``n_workers`` and every decision about them."""

    def __init__(self, n_workers: int, *, sortby: str = "task",
                 rejoin_grace: float = REJOIN_GRACE_SEC, elastic: bool = False,
                 min_workers: int = 1, log: logging.Logger | logging.LoggerAdapter[Any] = logger
                 ) -> None:
        """``sortby``: ranks by task id ("task", in natural order) or by arrival.
        ``rejoin_grace``: how long a worker whose connection ended keeps its place.
        ``elastic``: live sets (docs/elastic.md); a task given up then leaves the job
        while at least ``min_workers`` remain."""
        self.n_workers = n_workers
        self._log = log  # (a live set's tracker logs at DEBUG: tracker/service.py)
        self.tasks: dict[str, Task[C]] = {}
        self.live: LiveSets[C] | None = LiveSets(self.tasks) if elastic else None
        self.min_workers = min_workers
        self._sortby = sortby
        self._rejoin_grace = rejoin_grace
        self.by_rank: dict[int, Task[C]] = {}
        self._by_conn: dict[C, Task[C]] = {}
        self._anonymous = 0
        self._adopted = False  # some worker rejoined from a previous tracker
        self._grace_tokens = 0  # handed out so far
        self.outcome: Finish | None = None
        self.origin: str | None = None  # the task whose own error ended the job

    def task_of(self, conn: C) -> Task[C] | None:
        """The task registered on ``conn``, if any."""
        return self._by_conn.get(conn)

    # -- events from a worker's connection --------------------------------------------------

    def heard(self, conn: C, now: float) -> None:
        """``conn`` delivered data at ``now``."""
        task = self._by_conn.get(conn)
        if task is not None:
            task.heard = now

    def heartbeat(self, conn: C, progress: dict[str, int | bool]) -> None:
        """A heartbeat on ``conn`` reported ``progress`` (already checked)."""
        task = self._by_conn.get(conn)
        if task is not None:
            task.progress = progress

    def live_ask(self, conn: C, msg: dict[str, Any]) -> list[Decision[C]]:
        """``live{epoch}``: the worker on ``conn`` called ``live_set()``."""
        task = self._by_conn[conn]
        if self.live is None:
            raise ProtocolError("live_set() needs an elastic job (rabit2-submit --elastic)")
        if task.rank is None:
            raise ProtocolError("live before the ranks were assigned")
        return self.live.ask(task)

    def live_done(self, conn: C, msg: dict[str, Any]) -> list[Decision[C]]:
        """``live_done{epoch, ok, reason}``: the worker on ``conn`` left a live set's
        block."""
        task = self._by_conn[conn]
        if self.live is None:
            raise ProtocolError("live_done needs an elastic job")
        calls = msg.get("calls")  # (optional: a worker may not say)
        if calls is not None and (type(calls) is not int or calls < 0):
            raise ProtocolError(f"live_done.calls: expected a count, got {calls!r}")
        return self.live.done(task, msg["epoch"], msg["ok"], msg["reason"][:_MAX_REASON],
                              calls)

    def live_failed(self, epoch: int, reason: str) -> list[Decision[C]]:
        """Live set ``epoch`` cannot run (the tracker could not start its collectives)."""
        return [] if self.live is None else self.live.failed(epoch, reason)

    def _gone(self, task: Task[C], why: str) -> list[Decision[C]]:
        """Elastic mode: ``task`` takes part in no live set any more (for now)."""
        if self.live is None or self.outcome is not None:
            return []
        return self.live.gone(task, why)

    def register(self, conn: C, msg: dict[str, Any], *, host: str, peer: str,
                 now: float) -> list[Decision[C]]:
        """A ``register`` on ``conn`` from ``host`` (``peer``: host:port, for logs).  Raises
        ProtocolError (sent back as refuse) to reject it."""
        task_id: str = msg["task_id"]
        if not 0 < len(task_id) <= _MAX_TASK_ID:
            raise ProtocolError(f"task_id must have 1..{_MAX_TASK_ID} characters")
        if not 0 < msg["port"] < 65536:
            raise ProtocolError(f"port {msg['port']} is not a TCP port")
        if msg["attempt"] < 0:
            raise ProtocolError(f"attempt {msg['attempt']} is negative")
        if not isinstance(msg.get("restarts", True), bool):
            raise ProtocolError("restarts must be a bool")
        if msg["world_size"] not in (-1, self.n_workers):
            raise WrongJobError(
                f"worker expects world size {msg['world_size']}, job has {self.n_workers}"
            )
        if task_id == _NULL_TASK:
            # Without a task id a restart cannot be recognised; give it a fresh identity.
            task_id = f"{_NULL_TASK}#{self._anonymous}"
            self._anonymous += 1
            self._log.warning("worker at %s has no DMLC_TASK_ID; restarts will not keep its rank",
                           peer)
        out: list[Decision[C]] = []
        task = self.tasks.get(task_id)
        if task is None:
            if len(self.tasks) >= self.n_workers:
                raise ProtocolError(
                    f"unknown task id {task_id!r}: the job already has {self.n_workers} tasks"
                )
            task = Task(task_id=task_id, arrival=len(self.tasks))
            if self._adopted:
                # a job taken over from a previous tracker: a worker that died meanwhile
                # comes back as its attempt (the previous tracker's incarnations are gone)
                task.incarnation = msg["attempt"]
            self.tasks[task_id] = task
        else:
            if task.finished:
                raise ProtocolError(f"task {task_id!r} already shut down")
            if (task.conn is not None and task.pending_loss is None
                    and msg["attempt"] <= task.attempt and now - task.heard <= _ALIVE_WITHIN_SEC):
                # a second process of a running task (launched twice by mistake), not its
                # restart: a restart comes with a later attempt, or after the old one went
                # quiet.  Replacing the live one would fail the job.
                raise ProtocolError(
                    f"{describe(task)} runs already (attempt {task.attempt}, heard from "
                    f"{now - task.heard:.1f} s ago): another process with task id "
                    f"{task_id!r} and attempt {msg['attempt']} is not its restart (a restart "
                    "has a higher DMLC_NUM_ATTEMPT)")
            if task.pending_loss is not None:
                # a restart within the grace: the old process is lost after all (its
                # neighbours hear of that incarnation before they hear of the new one)
                out += self._declare_lost(task, task.loss_reason)
            out += self._gone(task, "was replaced by a new process")
            task.incarnation += 1
            task.progress = None  # a new process counts afresh
            task.exited = False
            if task.conn is not None:
                # The newer process wins (incarnation fencing): the old one is a zombie.
                out.append(self._fence(task, f"{describe(task)} registered again"))
                self._log.warning("%s registered again; closed its previous connection",
                                  describe(task))
        task.attempt = msg["attempt"]
        task.host = host
        task.port = msg["port"]
        self._attach(task, conn, now)
        self._log.info("task %s registered from %s:%d (attempt %d, incarnation %d)",
                       task_id, host, task.port, task.attempt, task.incarnation)
        if task.rank is not None:
            why = f"{describe(task)} registered again as incarnation {task.incarnation}"
            out.append(Send(task_id, conn, self._assign_msg(task, task.rank), why))
            out += self._notify_neighbors(
                task, {"t": "peer_recovered", "host": task.host, "port": task.port}, why)
        elif len(self.tasks) == self.n_workers:
            out += self._assign_ranks()
        out += self._aborted_notice(task)
        return out

    def rejoin(self, conn: C, msg: dict[str, Any], *, host: str, peer: str,
               now: float) -> list[Decision[C]]:
        """The same process, whose connection ended, connected again (``rejoin``): it takes
        its place back with no restart and no notice to its neighbours, if it comes within
        the grace.  Raises ProtocolError (sent back as refuse) otherwise."""
        task = self.tasks.get(msg["task_id"])
        adopted = task is None and self._may_adopt(msg)
        if adopted:
            task = self._adopt(msg, host)
        if task is None or task.rank != msg["rank"] or task.incarnation != msg["incarnation"]:
            raise ProtocolError(f"rejoin of task {msg['task_id']!r} as rank {msg['rank']}, "
                                f"incarnation {msg['incarnation']}: no such worker here")
        if task.finished and not task.held:
            raise ProtocolError(f"task {task.task_id!r} already shut down")
        if task.conn is None and task.pending_loss is None and not adopted:
            raise ProtocolError(f"{describe(task)} was declared lost (no rejoin within "
                                f"{self._rejoin_grace:g} s): a restart takes its place")
        task.pending_loss = None  # (its grace ends for nothing)
        task.exited = False  # (a rejoin proves the process lives: what ended was another one)
        out: list[Decision[C]] = []
        if task.conn is not None:  # (the old connection still looked open from here)
            out.append(self._fence(task, f"{describe(task)} rejoined on a new connection"))
        self._attach(task, conn, now)
        self._log.warning("%s rejoined from %s after its connection ended", describe(task), peer)
        why = ("rejoined from a previous tracker" if adopted
               else "rejoined within the grace")
        out.append(Send(task.task_id, conn, {"t": "rejoined"}, f"{describe(task)} {why}"))
        out += self._aborted_notice(task)
        return out

    def error(self, conn: C, text: str) -> list[Decision[C]]:
        """The worker on ``conn`` signalled an error: the job is aborted."""
        task = self._by_conn[conn]
        if "CollectiveTimeoutError" in text:
            # who kept the others waiting: the ranks between calls at their last heartbeat
            idle = sorted(other.rank for other in self.by_rank.values()
                          if other.rank is not None and not other.finished
                          and other.progress is not None
                          and other.progress.get("in_call") is False)
            if idle:
                text += (f" (not in a collective call at their last heartbeat: rank "
                         f"{', '.join(map(str, idle))})")
        if self.outcome is None:
            self.origin = task.task_id
        return self.abort(f"{describe(task)} signalled an error: {text}", exclude=conn)

    def unreachable(self, conn: C, rank: int, reason: str, now: float) -> list[Decision[C]]:
        """A worker's link to ``rank`` has been down for a while and cannot be rebuilt.  If
        ``rank`` is alive (heard from within the last few heartbeats, so neither dead nor
        paused: those are for recovery), the two cannot reach each other while both reach
        the tracker: a partition between them, which no restart mends.  The job ends, every
        rank naming the link (docs/recovery.md, "Partial partitions")."""
        task = self._by_conn[conn]
        reason = reason[:_MAX_REASON]
        other = self.by_rank.get(rank)
        if other is None or other.conn is None or other.finished or task.rank is None:
            return []
        quiet = now - other.heard
        if quiet > _ALIVE_WITHIN_SEC:
            self._log.info("%s cannot reach rank %d, which has been quiet for %.1f s: left to "
                        "recovery", describe(task), rank, quiet)
            return []
        return self.abort(f"ranks {task.rank} and {rank} cannot reach each other while both "
                          f"reach the tracker: a network partition between their hosts "
                          f"({task.host} and {other.host}); {reason}")

    def shutdown(self, conn: C, hold: bool) -> list[Decision[C]]:
        """The worker on ``conn`` finished (``shutdown``); ``hold``: it keeps serving its
        neighbours until every rank has finished (recovery on)."""
        task = self._by_conn[conn]
        out: list[Decision[C]] = []
        task.finished = True
        if not hold or self.outcome is not None:
            # (after an abort nothing is held: the task is done for good either way)
            out.append(Hook("on_task_finished", (task.task_id,),
                            f"{describe(task)} shut down for good"))
        self._log.info("%s shut down", describe(task))
        out += self._gone(task, "shut down")
        everyone = bool(self.by_rank) and all(t.finished or t.left
                                              for t in self.by_rank.values())
        if hold and not everyone and self.outcome is None:
            # recovery on: it keeps serving a restarted neighbour until every rank has
            # finished (then bye), and is treated as lost if it dies meanwhile
            task.held = True
            return out
        task.held = False  # (a held worker that gave up waiting says shutdown again)
        out.append(Send(task.task_id, conn, {"t": "bye"}, f"{describe(task)} shut down"))
        out.append(Release(task.task_id, conn, "worker shut down"))
        if everyone:
            for other in self.by_rank.values():
                if other.held and other.conn is not None:
                    out.append(Send(other.task_id, other.conn, {"t": "bye"},
                                    "every rank shut down"))
                other.held = False
            out += self.finish(True, "every rank shut down")  # (an aborted job stays so)
        return out

    def connection_ended(self, conn: C, reason: str) -> list[Decision[C]]:
        """``conn`` closed (``reason``; it starts with SILENCE_REASON after a heartbeat
        timeout).  A registered worker that may live gets the rejoin grace (:class:`Grace`);
        one that went silent, or had no rank yet, is lost at once."""
        task = self._by_conn.pop(conn, None)
        if task is None:
            return []
        task.conn = None
        if task.finished and not task.held:
            return []
        gone = self._gone(task, f"lost its tracker connection ({reason})")
        if reason.startswith(SILENCE_REASON) or task.rank is None or task.exited:
            return gone + self._declare_lost(task, reason)
        # the process may live (a blip on the path to it): it may rejoin within the grace
        self._log.info("%s: connection ended (%s); it may rejoin within %g s", describe(task),
                    reason, self._rejoin_grace)
        self._grace_tokens += 1
        task.pending_loss = self._grace_tokens
        task.loss_reason = reason
        why = f"{describe(task)}: connection ended ({reason}); it may rejoin"
        return [*gone, Grace(task.task_id, self._rejoin_grace, self._grace_tokens, why)]

    def grace_over(self, task_id: str, token: int) -> list[Decision[C]]:
        """The grace given with ``token`` ended: the task is lost unless it came back."""
        task = self.tasks.get(task_id)
        if task is None or task.pending_loss != token:
            return []
        return self._declare_lost(task, task.loss_reason)

    # -- events from the launcher ------------------------------------------------------------

    def worker_exited(self, task_id: str, attempt: int | None = None) -> list[Decision[C]]:
        """The launcher (or a supervisor, ``tracker.slot``) saw ``task_id``'s process end:
        if its connection ended too, it will not rejoin, so it is lost now rather than at
        the end of the rejoin grace; if its connection has not ended yet here, it is lost as
        soon as it does.  ``attempt``: the run that ended; a report about another run than
        the one registered (a late one, about a run already replaced) changes nothing."""
        task = self.tasks.get(task_id)
        if task is None or (attempt is not None and attempt != task.attempt):
            return []
        if task.pending_loss is not None:
            return self._declare_lost(task, task.loss_reason)
        if task.conn is not None:
            task.exited = True
        return []

    def exit_reported(self, task_id: str, attempt: int) -> list[Decision[C]]:
        """A supervisor (tracker.slot) says run ``attempt`` of ``task_id`` ended: as
        :meth:`worker_exited`, for a task id read from the wire."""
        if not 0 < len(task_id) <= _MAX_TASK_ID:
            raise ProtocolError(f"task_id must have 1..{_MAX_TASK_ID} characters")
        return self.worker_exited(task_id, attempt)

    def mark_failed(self, task_id: str, reason: str) -> list[Decision[C]]:
        """The launcher gave up on ``task_id``: abort the job, naming the task and reason."""
        task = self.tasks.get(task_id)
        who = f"task {task_id}" if task is None else describe(task)
        if self.live is not None and task is not None and not task.left:
            remaining = sum(not t.left for t in self.tasks.values()) - 1
            if remaining >= self.min_workers:
                return self._leave(task, reason, remaining)
        return self.abort(f"{who} failed for good: {reason}")

    def _leave(self, task: Task[C], reason: str, remaining: int) -> list[Decision[C]]:
        """Elastic mode: the job goes on without ``task``."""
        task.left = True
        self._log.warning("%s left the job (%s); %d worker(s) go on", describe(task), reason,
                       remaining)
        out = self._gone(task, "left the job")
        if self.by_rank and all(t.finished or t.left for t in self.by_rank.values()):
            out += self.finish(True, "every remaining rank shut down")
        return out

    def give_up(self, task_id: str, reason: str) -> list[Decision[C]]:
        """A supervisor (tracker.slot) ran out of attempts for one task: like the
        launcher's own give-up, the job ends at once instead of waiting for it."""
        if not 0 < len(task_id) <= _MAX_TASK_ID:
            raise ProtocolError(f"task_id must have 1..{_MAX_TASK_ID} characters")
        reason = reason[:_MAX_REASON]
        self._log.error("task %s given up by its supervisor: %s", task_id, reason)
        return self.mark_failed(task_id, reason)

    def abort(self, reason: str, exclude: C | None = None) -> list[Decision[C]]:
        """Abort the job: ``abort{reason}`` to every connected worker but ``exclude``'s,
        then :class:`Finish`.  Nothing once the job has ended (the first reason stays)."""
        if len(reason) > _MAX_REASON:
            # a worker's error text is part of the reason; it must fit in one abort frame
            reason = reason[:_MAX_REASON] + " ...[truncated]"
        if self.outcome is not None:
            self._log.info("abort after the job ended ignored: %s", reason)
            return []
        self._log.error("job aborted: %s", reason)
        out: list[Decision[C]] = [
            Send(task.task_id, task.conn, {"t": "abort", "reason": reason}, "job aborted")
            for task in self.tasks.values()
            if task.conn is not None and task.conn != exclude
            and (task.held or not task.finished)
        ]
        return out + self.finish(False, reason)

    def finish(self, success: bool, reason: str) -> list[Decision[C]]:
        """The job ended (every rank shut down, or aborted).  The first outcome stands: a job
        of classic workers that all shut down after an abort stays aborted."""
        if self.outcome is not None:
            return []
        self.outcome = Finish(success, reason)
        return [self.outcome]

    # -- reports ----------------------------------------------------------------------------

    def status(self, only: str | None = None, *, port: int = 0, prints: int = 0,
               now: float | None = None) -> dict[str, Any]:
        """A msgpack-able snapshot for humans and monitoring; ``only``: list that task alone
        in ``tasks`` (the totals still count every task).  ``port`` and ``prints`` (lines
        relayed) are the tracker's own; with ``now`` (the caller's clock) each connected
        task says how long ago it was last heard from (``heartbeat_age``, seconds)."""
        tasks = sorted(self.tasks.values(), key=lambda t: (t.rank is None, t.rank, t.arrival))
        rows = [
            {
                "task_id": task.task_id,
                "rank": task.rank,
                "incarnation": task.incarnation,
                "attempt": task.attempt,
                "host": task.host,
                "port": task.port,
                "connected": task.conn is not None,
                "finished": task.finished,
                "losses": task.losses,
                "progress": task.progress,
                "heartbeat_age": (None if now is None or task.conn is None
                                  else round(max(0.0, now - task.heard), 3)),
            }
            for task in tasks
        ]
        return job_status(self.n_workers, port, prints, self.outcome, rows, only,
                          assigned=bool(self.by_rank))

    # -- internals --------------------------------------------------------------------------

    def _attach(self, task: Task[C], conn: C, now: float) -> None:
        task.conn = conn
        task.heard = now
        self._by_conn[conn] = task

    def _fence(self, task: Task[C], reason: str) -> Fence[C]:
        """Take ``task``'s connection from it (the caller closes it)."""
        old = task.conn
        assert old is not None
        del self._by_conn[old]
        task.conn = None
        return Fence(task.task_id, old, reason)

    def _aborted_notice(self, task: Task[C]) -> list[Decision[C]]:
        """A worker that (re)joins an aborted job hears why at once."""
        if self.outcome is None or self.outcome.success or task.conn is None:
            return []
        return [Send(task.task_id, task.conn, {"t": "abort", "reason": self.outcome.reason},
                     "the job was aborted")]

    def _may_adopt(self, msg: dict[str, Any]) -> bool:
        """A rejoin from a task this tracker never saw: a tracker restarted at the address of
        one that went away takes its job over from the workers that rejoin it, while ranks
        are free for them (docs/protocol.md, "Tracker side")."""
        rank = msg["rank"]
        return (self.outcome is None and len(self.tasks) < self.n_workers
                and 0 <= rank < self.n_workers and rank not in self.by_rank
                and msg["incarnation"] >= 0 and msg["attempt"] >= 0 and 0 < msg["port"] < 65536
                and 0 < len(msg["task_id"]) <= _MAX_TASK_ID)

    def _adopt(self, msg: dict[str, Any], host: str) -> Task[C]:
        # (its run, as the launcher counts them: a supervisor's exit report names it)
        task: Task[C] = Task(task_id=msg["task_id"], arrival=len(self.tasks),
                             incarnation=msg["incarnation"], attempt=msg["attempt"],
                             rank=msg["rank"], host=host, port=msg["port"])
        self.tasks[task.task_id] = task
        self.by_rank[msg["rank"]] = task
        self._adopted = True
        self._log.warning("%s joined this tracker from a previous one (%d of %d)",
                       describe(task), len(self.by_rank), self.n_workers)
        return task

    def _assign_ranks(self) -> list[Decision[C]]:
        if self._sortby == "task":
            order = sorted(self.tasks.values(), key=lambda t: (natural_key(t.task_id), t.task_id))
            why = f"all {self.n_workers} workers registered; ranks by task id"
        else:
            order = sorted(self.tasks.values(), key=lambda t: t.arrival)
            why = f"all {self.n_workers} workers registered; ranks by arrival"
        out: list[Decision[C]] = []
        # (tasks that rejoined from a previous tracker keep their ranks; the rest take the
        # free ones in order)
        free = iter(r for r in range(self.n_workers) if r not in self.by_rank)
        for task in order:
            if task.rank is None:
                task.rank = next(free)
                self.by_rank[task.rank] = task
            out.append(Hook("on_rank_assigned", (task.task_id, task.rank), why))
        order = [self.by_rank[r] for r in range(self.n_workers)]
        self._log.info("all %d workers registered; ranks: %s", self.n_workers,
                    ", ".join(f"{t.task_id}->{t.rank}" for t in order))
        for rank, task in enumerate(order):
            if task.conn is not None:
                out.append(Send(task.task_id, task.conn, self._assign_msg(task, rank), why))
        return out

    def _assign_msg(self, task: Task[C], rank: int) -> dict[str, Any]:
        links = topology(rank, self.n_workers)
        peers = {
            str(rank): [self.by_rank[rank].host, self.by_rank[rank].port]
            for rank in links.neighbors
        }
        return {
            "t": "assign",
            "rank": rank,
            "world_size": self.n_workers,
            "parent": links.parent,
            "children": list(links.children),
            "ring_prev": links.ring_prev,
            "ring_next": links.ring_next,
            "peers": peers,
            "incarnation": task.incarnation,
            # what each neighbour may present when it dials (fencing: no other incarnation)
            "incarnations": {str(r): self.by_rank[r].incarnation for r in links.neighbors},
        }

    def _notify_neighbors(self, task: Task[C], notice: dict[str, Any],
                          reason: str) -> list[Decision[C]]:
        if task.rank is None:
            return []
        out: list[Decision[C]] = []
        for rank in topology(task.rank, self.n_workers).neighbors:
            neighbor = self.by_rank.get(rank)
            if neighbor is None:
                continue  # (not back yet at a restarted tracker: it rejoins or registers)
            if neighbor.conn is not None and (neighbor.held or not neighbor.finished):
                out.append(Send(neighbor.task_id, neighbor.conn,
                                {**notice, "rank": task.rank, "incarnation": task.incarnation},
                                reason))
        return out

    def _declare_lost(self, task: Task[C], reason: str) -> list[Decision[C]]:
        task.pending_loss = None
        if task.conn is not None:
            return []  # (it rejoined or registered again meanwhile)
        # a held worker that dies was serving its neighbours: it is lost like any other (the
        # launcher restarts it, and its replacement replays and finalizes again)
        task.finished = task.held = False
        task.losses += 1
        # Fault tolerance hook point: the launcher may restart the task (it then registers
        # again) or give up (mark_failed).  Until then the job waits.
        self._log.warning("%s lost: %s", describe(task), reason)
        why = f"{describe(task)} lost: {reason}"
        out = self._notify_neighbors(task, {"t": "peer_lost", "reason": reason}, why)
        out.append(Hook("on_worker_lost", (task.task_id, task.rank, reason), why))
        return out


def describe(task: Task[Any]) -> str:
    """How logs and reasons name a task: its rank if it has one, and its id."""
    if task.rank is None:
        return f"task {task.task_id}"
    return f"rank {task.rank} (task {task.task_id})"


__all__ = ["REJOIN_GRACE_SEC", "SILENCE_REASON", "Registry", "Task", "describe", "natural_key"]
