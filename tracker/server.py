"""The rabit2 tracker: one asyncio server that every worker stays connected to.

What it does (``docs/protocol.md``, "Tracker protocol"):

* authenticates every connection with the job secret (``rabit2.io.handshake``);
* collects ``n_workers`` registrations, assigns ranks (stable per task id: a task that
  registers again gets its old rank back with ``incarnation + 1``) and sends each worker its
  tree/ring links and its neighbours' addresses (``rabit2.core.topology``);
* relays ``print``s, watches liveness (EOF or no message for ``heartbeat_timeout``), pushes
  ``peer_lost``/``peer_recovered`` notices to the neighbours of a lost/returning rank, aborts
  the job on a worker's ``error`` or :meth:`Tracker.mark_failed`, and knows when every rank has
  shut down.

A connection that misbehaves (wrong magic, bad MAC, garbage, a huge length, silence) is closed
with a reason logged on ``rabit2.tracker``; it never disturbs the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import re
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rabit2.core.control import REFUSE_HELLO, FrameDecoder, encode_frame
from rabit2.core.topology import topology
from rabit2.errors import CollectiveTimeoutError, ProtocolError, RabitError
from rabit2.io.handshake import (
    RateLimitedLog,
    is_loopback,
    server_handshake,
    sock_read_exact,
    tune_socket,
)
from tracker.classic import CLASSIC_MAGIC, ClassicJob

logger = logging.getLogger("rabit2.tracker")
SILENCE_REASON = "no message for"  # how a heartbeat timeout is reported
# a rank that another cannot reach counts as alive if it was heard from this recently (its
# heartbeats come every rabit2_heartbeat_sec, 1 s by default)
_ALIVE_WITHIN_SEC = 5.0
REJOIN_GRACE_SEC = 5.0
"""A worker whose connection ended (EOF, reset: a blip on the path, or a death that its
neighbours see on their own links at once) may rejoin within this many seconds, as the same
process and incarnation, before it counts as lost; silence (heartbeats) counts at once."""

_READ_SIZE = 65536
_MAX_TASK_ID = 256  # task ids are labels; bound them like every other wire length
_NULL_TASK = "NULL"  # what classic workers send when DMLC_TASK_ID is unset
_ACCEPT_ERROR_PAUSE_SEC = 0.1  # e.g. EMFILE: back off instead of spinning on accept
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_STATUS_TASKS_ON_WIRE = 2000  # ~200 bytes each: a status_reply stays well under MAX_FRAME
_MAX_REASON = 64 * 1024  # characters of an abort reason (UTF-8: <= 256 KiB < MAX_FRAME)
_MAX_WRITE_BUFFER = 8 * 1024 * 1024  # per connection: ~8 status replies or 100k notices


@dataclass(frozen=True, slots=True)
class JobResult:
    """How the job ended: ``success`` iff every rank shut down and nobody aborted it."""

    success: bool
    reason: str
    status: dict[str, Any]


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders digit runs numerically: "2" < "10", "task2" < "task10"."""
    return tuple(
        (0, int(part)) if part.isascii() and part.isdigit() else (1, part)
        for part in re.split(r"([0-9]+)", text)
        if part
    )


@dataclass(slots=True, eq=False)
class _Task:
    task_id: str
    arrival: int
    attempt: int = 0
    incarnation: int = 0
    rank: int | None = None
    host: str = ""
    port: int = 0
    conn: _Conn | None = None
    finished: bool = False
    held: bool = False  # finished, and still serving until every rank has (shutdown hold)
    losses: int = 0  # times this task's worker was lost (connection or heartbeats)
    # its connection ended, not in silence: the same process may rejoin within the grace
    # (REJOIN_GRACE_SEC) before it counts as lost; the timer and the reason
    pending_loss: asyncio.TimerHandle | None = None
    loss_reason: str = ""


@dataclass(slots=True, eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    host: str  # the source IP we saw: the address neighbours dial (as classic rabit)
    peer: str  # host:port, for logs
    role: str
    task: _Task | None = None
    fenced: bool = False  # replaced by a newer registration of the same task
    heard: float = 0.0  # loop time of the last message from it

    def send(self, msg: dict[str, Any]) -> None:
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > _MAX_WRITE_BUFFER:
            # A peer that does not read what we send would make us buffer without bound.
            logger.warning("closing connection from %s: it does not read its messages",
                           self.peer)
            self.writer.close()
            return
        self.writer.write(encode_frame(msg))


class Tracker:
    """The asyncio tracker.  All methods run on the tracker's event loop.

    Hooks (called on the loop; exceptions are logged and ignored):
    ``on_worker_lost(task_id, rank_or_None, reason)``, ``on_rank_assigned(task_id, rank)`` and
    ``on_task_finished(task_id)`` (a ``shutdown`` that does not hold: the task is done for good).
    """

    def __init__(
        self,
        n_workers: int,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes = b"",
        sortby: str = "task",
        heartbeat_timeout: float = 30.0,
        handshake_timeout: float = 10.0,
        print_fn: Callable[[str], None] | None = None,
        rejoin_grace: float = REJOIN_GRACE_SEC,
        classic: str = "loopback",
    ) -> None:
        """Raises ``ValueError`` for a non-positive size or timeout or an unknown ``sortby``.
        ``rejoin_grace``: how long a worker whose connection ended keeps its place for the
        same process to rejoin (``REJOIN_GRACE_SEC``) before it counts as lost.
        ``classic``: from where workers speaking the classic rabit protocol (unauthenticated)
        are served: "loopback", "any" or "none" (``tracker/classic.py``)."""
        if classic not in ("loopback", "any", "none"):
            raise ValueError(f"classic must be loopback, any or none, got {classic!r}")
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        if sortby not in ("task", "arrival"):
            raise ValueError(f"sortby must be 'task' or 'arrival', got {sortby!r}")
        if heartbeat_timeout <= 0 or handshake_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.n_workers = n_workers
        self.host = host
        self.port = port
        self._secret = secret
        self._sortby = sortby
        self._heartbeat_timeout = heartbeat_timeout
        self._rejoin_grace = rejoin_grace
        self._classic_from = classic
        self._classic: ClassicJob | None = None  # made by the first classic worker
        self._adopted = False  # some worker rejoined from a previous tracker
        self._handshake_timeout = handshake_timeout
        self._print_fn = print_fn or _print_stdout
        self._tasks: dict[str, _Task] = {}
        self._by_rank: dict[int, _Task] = {}
        self._anonymous = 0
        self._prints = 0
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        # Handshakes in flight are bounded so that a flood of silent connections cannot
        # exhaust file descriptors; each one also ends at handshake_timeout.
        self._max_handshakes = 4 * n_workers + 64
        self._handshakes = 0
        self._in_handshake: dict[asyncio.Task[Any], float] = {}  # -> when it was accepted
        self._refusals = RateLimitedLog(logger)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._result: JobResult | None = None
        self._done = asyncio.Event()
        self._closing = False
        self.on_worker_lost: Callable[[str, int | None, str], None] | None = None
        self.on_rank_assigned: Callable[[str, int], None] | None = None
        self.on_task_finished: Callable[[str], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting; ``self.port`` is the bound port afterwards.

        Raises ``OSError`` if the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(max(128, 2 * self.n_workers))
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_task = asyncio.create_task(
            self._accept_loop(listener), name="rabit2-tracker-accept"
        )
        logger.info("tracker listening on %s:%d for %d workers", self.host, self.port,
                    self.n_workers)

    async def close(self) -> None:
        """Stop accepting, close every connection and wait for the handlers.  Idempotent."""
        self._closing = True
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._conns):
            conn.task = None  # closing is ours: not a worker loss
            conn.writer.close()
        for task in self._tasks.values():
            if task.pending_loss is not None:
                task.pending_loss.cancel()
                task.pending_loss = None
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def worker_env(self) -> dict[str, str]:
        """The environment a worker needs to join this job."""
        host = socket.getfqdn() if self.host in _WILDCARD_HOSTS else self.host
        return {
            "DMLC_TRACKER_URI": host,
            "DMLC_TRACKER_PORT": str(self.port),
            "DMLC_NUM_WORKER": str(self.n_workers),
            "RABIT2_SECRET": self._secret.hex(),
        }

    async def wait_done(self, timeout: float | None) -> JobResult:
        """Wait until every rank has shut down or the job was aborted.

        Raises :class:`CollectiveTimeoutError` if neither happened within ``timeout`` seconds.
        """
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except TimeoutError:
            raise CollectiveTimeoutError(f"the job did not finish within {timeout}s") from None
        result = self._result
        if result is None:  # _finish sets the result before the event; kept for mypy
            raise RuntimeError("tracker done without a result")
        return result

    @property
    def result(self) -> JobResult | None:
        """The job's result once it is done (every rank shut down, or aborted), else None."""
        return self._result

    def abort(self, reason: str) -> None:
        """Abort the job: push ``abort{reason}`` to every connected worker.  Idempotent."""
        self._abort(reason, exclude=None)

    def worker_exited(self, task_id: str) -> None:
        """The launcher saw ``task_id``'s process end: if its connection ended too, it will
        not rejoin, so it is lost now rather than at the end of the rejoin grace."""
        task = self._tasks.get(task_id)
        if task is not None and task.pending_loss is not None:
            self._declare_lost(task, task.loss_reason)

    def mark_failed(self, task_id: str, reason: str) -> None:
        """The launcher gave up on ``task_id``: abort the job, naming the task and reason."""
        task = self._tasks.get(task_id)
        who = f"task {task_id}" if task is None else _describe(task)
        self._abort(f"{who} failed for good: {reason}", exclude=None)

    def status(self, only: str | None = None) -> dict[str, Any]:
        """A msgpack-able snapshot for humans and monitoring; ``only``: list that task alone
        in ``tasks`` (the totals still count every task)."""
        tasks = sorted(self._tasks.values(), key=lambda t: (t.rank is None, t.rank, t.arrival))
        listed = tasks if only is None else [task for task in tasks if task.task_id == only]
        if self._classic is not None and self._classic.started:
            return self._classic_status(only)
        return {
            "world_size": self.n_workers,
            "port": self.port,
            "registered": len(self._tasks),
            "assigned": bool(self._by_rank),
            "finished": sum(task.finished for task in tasks),
            "done": self._result is not None,
            "success": None if self._result is None else self._result.success,
            "reason": None if self._result is None else self._result.reason,
            "prints": self._prints,
            "failures": sum(task.losses for task in tasks),
            "restarts": sum(task.incarnation for task in tasks),
            "tasks": [
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
                }
                for task in listed
            ],
        }

    def _relay_classic_print(self, line: str) -> None:
        self._prints += 1
        self._print_fn(line)

    def _classic_status(self, only: str | None) -> dict[str, Any]:
        """:meth:`status` of a job of classic workers (``tracker/classic.py``)."""
        assert self._classic is not None
        tasks = self._classic.status()
        listed = tasks if only is None else [t for t in tasks if t["task_id"] == only]
        return {
            "world_size": self.n_workers, "port": self.port, "registered": len(tasks),
            "assigned": len(tasks) == self.n_workers,
            "finished": sum(t["finished"] for t in tasks), "done": self._result is not None,
            "success": None if self._result is None else self._result.success,
            "reason": None if self._result is None else self._result.reason,
            "prints": self._prints, "failures": sum(t["losses"] for t in tasks),
            "restarts": sum(t["incarnation"] for t in tasks), "tasks": listed,
            "protocol": "classic",
        }

    # -- connections -----------------------------------------------------------------------

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:
                logger.warning("accept failed: %s", exc)
                await asyncio.sleep(_ACCEPT_ERROR_PAUSE_SEC)
                continue
            peer = f"{address[0]}:{address[1]}"
            if self._handshakes >= self._max_handshakes and self._in_handshake:
                # fair admission: the oldest unfinished handshake makes room.  A worker
                # finishes its handshake in milliseconds, so under a flood of idle or slow
                # connections it is the flood that is dropped, and a registration gets in
                oldest = min(self._in_handshake, key=self._in_handshake.__getitem__)
                del self._in_handshake[oldest]
                oldest.cancel()
                self._refusals.warning(
                    "dropped the oldest of %d unfinished handshakes to admit %s",
                    self._handshakes, peer)
            self._handshakes += 1  # counted here: a burst of accepts must see the count
            handler = asyncio.create_task(self._handle(sock, str(address[0]), peer))
            self._handlers.add(handler)
            self._in_handshake[handler] = loop.time()
            handler.add_done_callback(self._handlers.discard)

    async def _handle(self, sock: socket.socket, host: str, peer: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._handshake_timeout
        classic = False
        try:
            sock.setblocking(False)
            tune_socket(sock)
            # the first 4 bytes tell the protocols apart: rabit2's magic, or classic rabit's
            first = await sock_read_exact(loop, sock, len(CLASSIC_MAGIC), deadline)
            classic = first == CLASSIC_MAGIC
            if not classic:
                hello = await server_handshake(loop, sock, self._secret, deadline,
                                               self._check_hello, prefix=first)
        except (RabitError, OSError) as exc:
            sock.close()
            self._refusals.warning("connection from %s closed during handshake: %s", peer, exc)
            return
        except asyncio.CancelledError:
            sock.close()  # dropped to admit a newer connection, or the tracker closes
            raise
        finally:
            self._handshakes -= 1
            task = asyncio.current_task()
            if task is not None:
                self._in_handshake.pop(task, None)
        if classic:
            await self._serve_classic(sock, host, peer)
            return
        streams = await _streams(sock, f"connection from {peer} after the handshake")
        if streams is None:
            return
        reader, writer = streams
        conn = _Conn(writer=writer, host=host, peer=peer, role=hello["role"])
        self._conns.add(conn)
        reason = "connection closed by the worker"
        broken = True  # a protocol violation or a socket error, as opposed to a clean end
        try:
            reason = await self._serve(conn, reader)
            broken = False
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
            conn.send({"t": "refuse", "reason": str(exc), "code": REFUSE_HELLO})
        except OSError as exc:
            reason = f"connection failed: {exc}"
        except Exception as exc:
            # A bug of ours must cost one connection, not the tracker.
            logger.exception("internal error on the connection from %s", peer)
            reason = f"tracker internal error: {exc!r}"
        finally:
            self._conns.discard(conn)
            writer.close()
            self._connection_ended(conn, reason, broken)

    async def _serve_classic(self, sock: socket.socket, host: str, peer: str) -> None:
        """A worker of the classic rabit protocol (XGBoost 1.x/2.0, dmlc/rabit)."""
        why = None
        if self._classic_from == "none" or (
                self._classic_from == "loopback" and not is_loopback(host)):
            why = (f"classic rabit workers are served from {self._classic_from} addresses "
                   "only (the classic protocol has no secret; rabit2-tracker --classic any)")
        elif self._tasks:
            why = ("this job's workers speak rabit2's protocol; a classic rabit worker "
                   "(XGBoost 1.x/2.0) cannot join it")
        elif self._result is not None:
            why = f"the job has ended ({self._result.reason})"
        if why is not None:
            sock.close()
            self._refusals.warning("classic rabit worker from %s refused: %s", peer, why)
            return
        if self._classic is None:
            self._classic = ClassicJob(
                self.n_workers, self._relay_classic_print,
                on_done=lambda: self._finish(True, "every rank shut down"),
                sort_key=(lambda t: (natural_key(t), t)) if self._sortby == "task" else None,
                timeout=self._handshake_timeout,
                on_rank=lambda task_id, rank: _call_hook(self.on_rank_assigned, task_id, rank))
        streams = await _streams(sock, f"classic connection from {peer}")
        if streams is None:
            return
        reader, writer = streams
        try:
            await self._classic.serve(reader, writer, host)
        except ProtocolError as exc:
            logger.warning("classic rabit worker from %s: %s", peer, exc)
        except OSError as exc:
            logger.warning("classic connection from %s failed: %s", peer, exc)
        finally:
            writer.close()

    def _check_hello(self, hello: dict[str, Any]) -> dict[str, Any]:
        role = hello.get("role")
        if role not in ("worker", "monitor"):
            raise ProtocolError(f"hello.role must be 'worker' or 'monitor', got {role!r}")
        return {"world_size": self.n_workers, "heartbeat_timeout": self._heartbeat_timeout}

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader) -> str:
        """Read and handle frames until the connection ends; return why it ended."""
        decoder = FrameDecoder()
        while True:
            # Before registering a worker gets the handshake budget; after, silence longer
            # than the heartbeat timeout means it is dead or paused.
            timeout = self._handshake_timeout if conn.task is None else self._heartbeat_timeout
            try:
                data = await asyncio.wait_for(reader.read(_READ_SIZE), timeout)
            except TimeoutError as exc:
                if exc.errno is not None:  # the kernel's ETIMEDOUT, not our deadline
                    return f"connection timed out: {exc}"
                return f"{SILENCE_REASON} {timeout:g}s"
            if not data:
                return "connection closed by the worker"
            conn.heard = asyncio.get_running_loop().time()
            for msg in decoder.feed(data):
                if not self._on_message(conn, msg):
                    return "worker shut down"

    def _on_message(self, conn: _Conn, msg: dict[str, Any]) -> bool:
        """Handle one frame; False when the connection is finished (after shutdown)."""
        kind = msg["t"]
        if kind == "status":
            only = msg.get("task_id")
            if only is not None and not isinstance(only, str):
                raise ProtocolError("status.task_id must be a str")
            status = self.status(only)
            if len(status["tasks"]) > _STATUS_TASKS_ON_WIRE:
                # keep the reply under MAX_FRAME; the totals above the list stay exact
                status["tasks"] = status["tasks"][:_STATUS_TASKS_ON_WIRE]
                status["tasks_truncated"] = True
            conn.send({"t": "status_reply", "status": status})
            return True
        if kind == "give_up" and conn.role == "monitor":
            # a supervisor (tracker.slot) ran out of attempts for one task: like the
            # launcher's own give-up, the job ends at once instead of waiting for it
            task_id = msg["task_id"]
            if not 0 < len(task_id) <= _MAX_TASK_ID:
                raise ProtocolError(f"task_id must have 1..{_MAX_TASK_ID} characters")
            reason = msg["reason"][:_MAX_REASON]
            logger.error("task %s given up by its supervisor: %s", task_id, reason)
            self.mark_failed(task_id, reason)
            return True
        if conn.role != "worker":
            raise ProtocolError(f"a {conn.role} connection may only send status or give_up, "
                                f"not {kind}")
        task = conn.task
        if task is None:
            if kind == "rejoin":
                self._rejoin(conn, msg)
                return True
            if kind != "register":
                raise ProtocolError(f"expected register, got {kind}")
            self._register(conn, msg)
            return True
        if kind == "heartbeat":
            return True  # reading it already reset the liveness deadline
        if kind == "print":
            self._prints += 1
            label = task.task_id if task.rank is None else str(task.rank)
            self._print_fn(f"[{label}] {msg['msg']}")
            return True
        if kind == "error":
            self._abort(f"{_describe(task)} signalled an error: {msg['msg']}", exclude=conn)
            return True
        if kind == "unreachable":
            self._unreachable(task, msg["rank"], msg["reason"][:_MAX_REASON])
            return True
        if kind == "shutdown":
            task.finished = True
            if not msg["hold"] or self._result is not None:
                # (after an abort nothing is held: the task is done for good either way)
                _call_hook(self.on_task_finished, task.task_id)
            logger.info("%s shut down", _describe(task))
            everyone = bool(self._by_rank) and all(t.finished for t in self._by_rank.values())
            if msg["hold"] and not everyone and self._result is None:
                # recovery on: it keeps serving a restarted neighbour until every rank has
                # finished (then bye), and is treated as lost if it dies meanwhile
                task.held = True
                return True
            task.held = False  # (a held worker that gave up waiting says shutdown again)
            conn.send({"t": "bye"})
            if everyone:
                for other in self._by_rank.values():
                    if other.held and other.conn is not None:
                        other.conn.send({"t": "bye"})
                    other.held = False
                if self._result is None:  # (an aborted job stays aborted)
                    self._finish(True, "every rank shut down")
            return False
        raise ProtocolError(f"unexpected {kind} from a registered worker")

    def _register(self, conn: _Conn, msg: dict[str, Any]) -> None:
        """Record a registration; raises ProtocolError (sent back as refuse) to reject it."""
        if self._classic is not None and self._classic.started:
            raise ProtocolError("this job's workers speak the classic rabit protocol "
                                "(XGBoost 1.x/2.0); a rabit2 worker cannot join it")
        task_id: str = msg["task_id"]
        if not 0 < len(task_id) <= _MAX_TASK_ID:
            raise ProtocolError(f"task_id must have 1..{_MAX_TASK_ID} characters")
        if not 0 < msg["port"] < 65536:
            raise ProtocolError(f"port {msg['port']} is not a TCP port")
        if msg["world_size"] not in (-1, self.n_workers):
            raise ProtocolError(
                f"worker expects world size {msg['world_size']}, job has {self.n_workers}"
            )
        if task_id == _NULL_TASK:
            # Without a task id a restart cannot be recognised; give it a fresh identity.
            task_id = f"{_NULL_TASK}#{self._anonymous}"
            self._anonymous += 1
            logger.warning("worker at %s has no DMLC_TASK_ID; restarts will not keep its rank",
                           conn.peer)
        task = self._tasks.get(task_id)
        if task is None:
            if len(self._tasks) >= self.n_workers:
                raise ProtocolError(
                    f"unknown task id {task_id!r}: the job already has {self.n_workers} tasks"
                )
            task = _Task(task_id=task_id, arrival=len(self._tasks))
            if self._adopted:
                # a job taken over from a previous tracker: a worker that died meanwhile
                # comes back as its attempt (the previous tracker's incarnations are gone)
                task.incarnation = msg["attempt"]
            self._tasks[task_id] = task
        else:
            if task.finished:
                raise ProtocolError(f"task {task_id!r} already shut down")
            if task.pending_loss is not None:
                # a restart within the grace: the old process is lost after all (its
                # neighbours hear of that incarnation before they hear of the new one)
                self._declare_lost(task, task.loss_reason)
            task.incarnation += 1
            if task.conn is not None:
                # The newer process wins (incarnation fencing): the old one is a zombie.
                old, task.conn = task.conn, None
                old.task = None
                old.fenced = True
                old.writer.close()
                logger.warning("%s registered again; closed its previous connection",
                               _describe(task))
        task.attempt = msg["attempt"]
        task.host = conn.host
        task.port = msg["port"]
        task.conn = conn
        conn.task = task
        logger.info("task %s registered from %s:%d (attempt %d, incarnation %d)",
                    task_id, conn.host, task.port, task.attempt, task.incarnation)
        if task.rank is not None:
            conn.send(self._assign_msg(task, task.rank))
            self._notify_neighbors(task, {"t": "peer_recovered", "host": task.host,
                                          "port": task.port})
        elif len(self._tasks) == self.n_workers:
            self._assign_ranks()
        if self._result is not None and not self._result.success:
            conn.send({"t": "abort", "reason": self._result.reason})

    def _may_adopt(self, msg: dict[str, Any]) -> bool:
        """A rejoin from a task this tracker never saw: a tracker restarted at the address of
        one that went away takes its job over from the workers that rejoin it, while ranks
        are free for them (docs/protocol.md, "Tracker side")."""
        rank = msg["rank"]
        return (self._result is None and len(self._tasks) < self.n_workers
                and 0 <= rank < self.n_workers and rank not in self._by_rank
                and msg["incarnation"] >= 0 and 0 < msg["port"] < 65536
                and 0 < len(msg["task_id"]) <= _MAX_TASK_ID)

    def _adopt(self, conn: _Conn, msg: dict[str, Any]) -> _Task:
        task = _Task(task_id=msg["task_id"], arrival=len(self._tasks),
                     incarnation=msg["incarnation"], attempt=msg["incarnation"],
                     rank=msg["rank"], host=conn.host, port=msg["port"])
        self._tasks[task.task_id] = task
        self._by_rank[msg["rank"]] = task
        self._adopted = True
        logger.warning("%s joined this tracker from a previous one (%d of %d)",
                       _describe(task), len(self._by_rank), self.n_workers)
        return task

    def _assign_ranks(self) -> None:
        if self._sortby == "task":
            order = sorted(self._tasks.values(), key=lambda t: (natural_key(t.task_id), t.task_id))
        else:
            order = sorted(self._tasks.values(), key=lambda t: t.arrival)
        # (tasks that rejoined from a previous tracker keep their ranks; the rest take the
        # free ones in order)
        free = iter(r for r in range(self.n_workers) if r not in self._by_rank)
        for task in order:
            if task.rank is None:
                task.rank = next(free)
                self._by_rank[task.rank] = task
            _call_hook(self.on_rank_assigned, task.task_id, task.rank)
        order = [self._by_rank[r] for r in range(self.n_workers)]
        logger.info("all %d workers registered; ranks: %s", self.n_workers,
                    ", ".join(f"{t.task_id}->{t.rank}" for t in order))
        for rank, task in enumerate(order):
            if task.conn is not None:
                task.conn.send(self._assign_msg(task, rank))

    def _assign_msg(self, task: _Task, rank: int) -> dict[str, Any]:
        links = topology(rank, self.n_workers)
        peers = {
            str(rank): [self._by_rank[rank].host, self._by_rank[rank].port]
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
            "incarnations": {str(r): self._by_rank[r].incarnation for r in links.neighbors},
        }

    def _notify_neighbors(self, task: _Task, notice: dict[str, Any]) -> None:
        if task.rank is None:
            return
        for rank in topology(task.rank, self.n_workers).neighbors:
            neighbor = self._by_rank[rank]
            if neighbor.conn is not None and (neighbor.held or not neighbor.finished):
                neighbor.conn.send({**notice, "rank": task.rank, "incarnation": task.incarnation})

    def _connection_ended(self, conn: _Conn, reason: str, broken: bool) -> None:
        task = conn.task
        if task is None:
            if not (self._closing or conn.fenced) and (broken or conn.role == "worker"):
                logger.warning("connection from %s (%s, unregistered) closed: %s",
                               conn.peer, conn.role, reason)
            return
        conn.task = None
        task.conn = None
        if task.finished and not task.held:
            return
        if reason.startswith(SILENCE_REASON) or task.rank is None or self._closing:
            self._declare_lost(task, reason)
            return
        # the process may live (a blip on the path to it): it may rejoin within the grace
        logger.info("%s: connection ended (%s); it may rejoin within %g s", _describe(task),
                    reason, self._rejoin_grace)
        task.loss_reason = reason
        task.pending_loss = asyncio.get_running_loop().call_later(
            self._rejoin_grace, self._declare_lost, task, reason)

    def _declare_lost(self, task: _Task, reason: str) -> None:
        if task.pending_loss is not None:
            task.pending_loss.cancel()
            task.pending_loss = None
        if task.conn is not None:
            return  # (it rejoined or registered again meanwhile)
        # a held worker that dies was serving its neighbours: it is lost like any other (the
        # launcher restarts it, and its replacement replays and finalizes again)
        task.finished = task.held = False
        task.losses += 1
        # Fault tolerance hook point: the launcher may restart the task (it then registers
        # again) or give up (mark_failed).  Until then the job waits.
        logger.warning("%s lost: %s", _describe(task), reason)
        self._notify_neighbors(task, {"t": "peer_lost", "reason": reason})
        _call_hook(self.on_worker_lost, task.task_id, task.rank, reason)

    def _rejoin(self, conn: _Conn, msg: dict[str, Any]) -> None:
        """The same process, whose connection ended, connected again (``rejoin``): it takes
        its place back with no restart and no notice to its neighbours, if it comes within
        the grace.  Raises ProtocolError (sent back as refuse) otherwise."""
        task = self._tasks.get(msg["task_id"])
        adopted = task is None and self._may_adopt(msg)
        if adopted:
            task = self._adopt(conn, msg)
        if task is None or task.rank != msg["rank"] or task.incarnation != msg["incarnation"]:
            raise ProtocolError(f"rejoin of task {msg['task_id']!r} as rank {msg['rank']}, "
                                f"incarnation {msg['incarnation']}: no such worker here")
        if task.finished and not task.held:
            raise ProtocolError(f"task {task.task_id!r} already shut down")
        if task.conn is None and task.pending_loss is None and not adopted:
            raise ProtocolError(f"{_describe(task)} was declared lost (no rejoin within "
                                f"{self._rejoin_grace:g} s): a restart takes its place")
        if task.pending_loss is not None:
            task.pending_loss.cancel()
            task.pending_loss = None
        if task.conn is not None:  # (the old connection still looked open from here)
            old, task.conn = task.conn, None
            old.task = None
            old.fenced = True
            old.writer.close()
        task.conn = conn
        conn.task = task
        logger.warning("%s rejoined from %s after its connection ended", _describe(task),
                       conn.peer)
        conn.send({"t": "rejoined"})
        if self._result is not None and not self._result.success:
            conn.send({"t": "abort", "reason": self._result.reason})

    def _unreachable(self, task: _Task, rank: int, reason: str) -> None:
        """A worker's link to ``rank`` has been down for a while and cannot be rebuilt.  If
        ``rank`` is alive (heard from within the last few heartbeats, so neither dead nor
        paused: those are for recovery), the two cannot reach each other while both reach
        the tracker: a partition between them, which no restart mends.  The job ends, every
        rank naming the link (docs/recovery.md, "Partial partitions")."""
        other = self._by_rank.get(rank)
        if other is None or other.conn is None or other.finished or task.rank is None:
            return
        quiet = asyncio.get_running_loop().time() - other.conn.heard
        if quiet > _ALIVE_WITHIN_SEC:
            logger.info("%s cannot reach rank %d, which has been quiet for %.1f s: left to "
                        "recovery", _describe(task), rank, quiet)
            return
        self._abort(f"ranks {task.rank} and {rank} cannot reach each other while both reach "
                    f"the tracker: a network partition between their hosts ({task.host} and "
                    f"{other.host}); {reason}", exclude=None)

    def _abort(self, reason: str, exclude: _Conn | None) -> None:
        if len(reason) > _MAX_REASON:
            # a worker's error text is part of the reason; it must fit in one abort frame
            reason = reason[:_MAX_REASON] + " ...[truncated]"
        if self._result is not None:
            logger.info("abort after the job ended ignored: %s", reason)
            return
        logger.error("job aborted: %s", reason)
        for conn in self._conns:
            task = conn.task
            if conn is not exclude and task is not None and (task.held or not task.finished):
                conn.send({"t": "abort", "reason": reason})
        self._finish(False, reason)

    def _finish(self, success: bool, reason: str) -> None:
        # Record the outcome first so that the final status snapshot reports it.
        self._result = JobResult(success, reason, {})
        self._result = dataclasses.replace(self._result, status=self.status())
        self._done.set()


async def _streams(sock: socket.socket,
                   what: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """The asyncio streams of an accepted socket; None (closed, logged) if that fails."""
    try:
        return await asyncio.open_connection(sock=sock)
    except OSError as exc:
        sock.close()
        logger.warning("%s failed: %s", what, exc)
        return None
    except BaseException:
        sock.close()
        raise


def _describe(task: _Task) -> str:
    if task.rank is None:
        return f"task {task.task_id}"
    return f"rank {task.rank} (task {task.task_id})"


def _print_stdout(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _call_hook(hook: Callable[..., None] | None, *args: Any) -> None:
    if hook is None:
        return
    try:
        hook(*args)
    except Exception:
        logger.exception("tracker hook %r failed", hook)


class TrackerThread:
    """A :class:`Tracker` on its own event loop in a daemon thread, for synchronous callers.

    Every method is safe to call from any thread.
    """

    def __init__(self, n_workers: int, **kwargs: Any) -> None:
        """Same arguments as :class:`Tracker`."""
        self.tracker = Tracker(n_workers, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rabit2-tracker", daemon=True)
        self._started = concurrent.futures.Future[None]()
        self._ranks: dict[str, int] = {}
        self._ranks_lock = threading.Lock()
        self._silent: list[str] = []
        self._finished: set[str] = set()
        self.tracker.on_rank_assigned = self._remember_rank
        self.tracker.on_worker_lost = self._worker_lost
        self.tracker.on_task_finished = self._task_finished

    def _worker_lost(self, task_id: str, rank: int | None, reason: str) -> None:
        del rank
        if reason.startswith(SILENCE_REASON):
            with self._ranks_lock:
                self._silent.append(task_id)

    def _task_finished(self, task_id: str) -> None:
        with self._ranks_lock:
            self._finished.add(task_id)

    def has_finished(self, task_id: str) -> bool:
        """Whether the task told the tracker it is done for good (a ``shutdown`` that does
        not hold): the tracker refuses it from then on, so a launcher must not restart it,
        whatever its exit status."""
        with self._ranks_lock:
            return task_id in self._finished

    def take_silent(self) -> list[str]:
        """Task ids the tracker gave up on for silence (a paused or wedged process that
        still holds its connection) since the last call; the launcher stops them."""
        with self._ranks_lock:
            silent, self._silent = self._silent, []
        return silent

    def start(self, timeout: float = 10.0) -> None:
        """Start the thread and bind.  Raises what :meth:`Tracker.start` raised."""
        self._thread.start()
        self._started.result(timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.tracker.start())
        except BaseException as exc:
            self._started.set_exception(exc)
            self._loop.close()
            return
        self._started.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self.tracker.close())
            # Wake whoever still waits in join() instead of destroying pending tasks.
            leftovers = asyncio.all_tasks(self._loop)
            for task in leftovers:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            self._loop.close()

    def _remember_rank(self, task_id: str, rank: int) -> None:
        with self._ranks_lock:
            self._ranks[task_id] = rank

    def rank_of(self, task_id: str) -> int | None:
        """The rank assigned to ``task_id``, or None before assignment."""
        with self._ranks_lock:
            return self._ranks.get(task_id)

    def worker_env(self) -> dict[str, str]:
        """See :meth:`Tracker.worker_env` (valid after :meth:`start`)."""
        return self.tracker.worker_env()

    def join(self, timeout: float | None = None) -> JobResult | None:
        """Wait for the job's result; None if it is not done within ``timeout`` seconds or
        the tracker was stopped first."""
        waiter = self.tracker.wait_done(None)
        try:
            future = asyncio.run_coroutine_threadsafe(waiter, self._loop)
        except RuntimeError:  # the loop is closed: the tracker was stopped
            waiter.close()
            return self.tracker.result
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None
        except concurrent.futures.CancelledError:
            return self.tracker.result

    def result(self) -> JobResult | None:
        """The result if the job is done, else None; never waits.

        Reads one attribute that the tracker thread assigns once, atomically.
        """
        return self.tracker.result

    def status(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """:meth:`Tracker.status`, taken on the tracker's thread; None if it does not answer
        within ``timeout`` seconds or was stopped."""

        async def take() -> dict[str, Any]:
            return self.tracker.status()

        coro = take()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            return None
        try:
            return future.result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return None

    def abort(self, reason: str) -> None:
        """See :meth:`Tracker.abort`."""
        self._call_soon(self.tracker.abort, reason)

    def mark_failed(self, task_id: str, reason: str) -> None:
        """See :meth:`Tracker.mark_failed`."""
        self._call_soon(self.tracker.mark_failed, task_id, reason)

    def worker_exited(self, task_id: str) -> None:
        """See :meth:`Tracker.worker_exited`."""
        self._call_soon(self.tracker.worker_exited, task_id)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed: the job is over
            self._loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the tracker and end the thread.  Idempotent."""
        if self._thread.is_alive():
            self._call_soon(self._loop.stop)
            self._thread.join(timeout)


__all__ = ["JobResult", "Tracker", "TrackerThread", "natural_key"]
