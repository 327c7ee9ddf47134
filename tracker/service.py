"""The rabit2 tracker: one asyncio server that every worker stays connected to.

What it does (``docs/protocol.md``, "Tracker protocol"):

* authenticates every connection with the job secret (``tracker/listener.py``);
* reads each connection's messages, relays ``print``s, watches liveness (EOF or no message
  for ``heartbeat_timeout``) and answers ``status``;
* hands every event of the job to its :class:`~tracker.registry.Registry` (registrations,
  rejoins, ends of connections, errors, unreachable ranks, shutdowns, the launcher's word)
  and applies what it decides: the messages to send (ranks and links, ``peer_lost``/
  ``peer_recovered`` notices, ``abort``, ``bye``), the connections to close, the hooks to
  call, the rejoin graces to time and the job's end;
* serves workers of the classic rabit protocol instead (``tracker/classic.py``).

A connection that misbehaves (wrong magic, bad MAC, garbage, a huge length, silence) is closed
with a reason logged on ``rabit2.tracker``; it never disturbs the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import operator
import secrets
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rabit2.core.control import (
    READ_SIZE,
    REFUSE_HELLO,
    FrameDecoder,
    check_progress,
    encode_frame,
)
from rabit2.errors import CollectiveTimeoutError, ProtocolError
from rabit2.io.handshake import RateLimitedLog, is_loopback
from tracker.classic import ClassicJob, labelled
from tracker.decisions import (
    Decision,
    EndSet,
    Fence,
    Finish,
    FormSet,
    Grace,
    Hook,
    Release,
    Send,
)
from tracker.listener import Listener
from tracker.registry import (
    REJOIN_GRACE_SEC,
    SILENCE_REASON,
    Registry,
    WrongJobError,
    natural_key,
)
from tracker.status import job_status

logger = logging.getLogger("rabit2.tracker")

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
CLOSED_BY_WORKER = "connection closed by the worker"
"""Why a worker's connection ended when the worker closed it: its process left (an exit, a
kill), as opposed to a network that stopped carrying it."""


def advertised_host() -> str:
    """The name workers on other hosts reach this host by, for a tracker that listens on
    every interface: its fully qualified name, else its short name, where that resolves to
    an address other than loopback; else the IPv4 address of the interface that routes
    outward (where ``/etc/hosts`` maps the host's own name to 127.0.0.1, as many images
    do, the name would send every worker to itself); the fully qualified name if there is
    no such route.  (A UDP socket's ``connect`` sends nothing.)"""
    for name in dict.fromkeys((socket.getfqdn(), socket.gethostname())):
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET)
        except OSError:
            continue
        if any(not str(info[4][0]).startswith("127.") for info in infos):
            return name
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        try:
            probe.connect(("10.255.255.255", 9))
            address = str(probe.getsockname()[0])
        except OSError:
            return socket.getfqdn()
    return socket.getfqdn() if address.startswith("127.") else address


class _Quiet(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A live set's tracker: every record at DEBUG (its losses and aborts are the job
    tracker's to tell, once)."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        super().log(logging.DEBUG, f"live set: {msg}", *args, **kwargs)


_SET_LOG = _Quiet(logger, {})
_STATUS_TASKS_ON_WIRE = 2000  # the most task rows a status_reply carries
_MAX_WRITE_BUFFER = 8 * 1024 * 1024  # per connection: ~8 status replies or 100k notices


@dataclass(frozen=True, slots=True)
class JobResult:
    """How the job ended: ``success`` iff every rank shut down and nobody aborted it;
    ``reason`` says why it ended (the abort's reason when aborted); ``status`` is
    :meth:`Tracker.status` at the end; ``origin``, the task whose own error (``error``
    from the worker) ended it, if one did."""

    success: bool
    reason: str
    status: dict[str, Any]
    origin: str | None = None


@dataclass(slots=True, eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    host: str  # the source IP we saw: the address neighbours dial (as classic rabit)
    peer: str  # host:port, for logs
    role: str
    fenced: bool = False  # replaced by a newer registration of the same task

    def send(self, msg: dict[str, Any]) -> None:
        self.send_frame(encode_frame(msg))

    def send_frame(self, frame: bytes) -> None:
        """Write an encoded frame, unless the peer does not read what it is sent."""
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > _MAX_WRITE_BUFFER:
            # A peer that does not read what we send would make us buffer without bound.
            logger.warning("closing connection from %s: it does not read its messages",
                           self.peer)
            self.writer.close()
            return
        self.writer.write(frame)


class Tracker:
    """The asyncio tracker.  All methods run on the tracker's event loop.

    ``n_workers`` workers join it at ``host:port`` (port 0: any free port) with the job
    ``secret``; :meth:`worker_env` is what they need to find it.  :class:`TrackerThread`
    runs one for synchronous code.

    Hooks (called on the loop; exceptions are logged and ignored):
    ``on_worker_lost(task_id, rank_or_None, reason)``, ``on_rank_assigned(task_id, rank)``,
    ``on_task_registered(task_id)`` (a rabit2 worker joined) and ``on_task_finished(task_id)``
    (a ``shutdown`` that does not hold: the task is done for good).
    """

    def __init__(
        self,
        n_workers: int,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        sortby: str = "task",
        heartbeat_timeout: float = 30.0,
        handshake_timeout: float = 10.0,
        print_fn: Callable[[str], None] | None = None,
        rejoin_grace: float = REJOIN_GRACE_SEC,
        classic: str = "loopback",
        elastic: bool = False,
        min_workers: int = 1,
        log: logging.Logger | logging.LoggerAdapter[Any] = logger,
    ) -> None:
        """Raises ``ValueError`` for a non-positive size or timeout, an unknown ``sortby`` or
        an empty ``secret`` (a key anyone can compute authenticates nobody), ``TypeError``
        for a size that is not an integer or a secret that is not ``bytes``.  ``secret``:
        the job's key; None (the default) makes a random one, which :meth:`worker_env`
        hands on.
        ``rejoin_grace``: how long a worker whose connection ended keeps its place for the
        same process to rejoin (``REJOIN_GRACE_SEC``) before it counts as lost.
        ``classic``: from where workers speaking the classic rabit protocol (unauthenticated)
        are served: "loopback", "any" or "none" (``tracker/classic.py``).
        ``elastic``: the job's workers form live sets (docs/elastic.md), and a task given up
        leaves the job while at least ``min_workers`` remain."""
        if classic not in ("loopback", "any", "none"):
            raise ValueError(f"classic must be loopback, any or none, got {classic!r}")
        if isinstance(n_workers, bool):
            raise TypeError("n_workers must be an int, got bool")
        n_workers = operator.index(n_workers)  # (TypeError: "... cannot be interpreted as
        # an integer"; numpy integers pass)
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        if secret is None:
            secret = secrets.token_bytes(32)
        if not isinstance(secret, bytes):
            raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
        if not secret:
            raise ValueError("secret must not be empty (leave it out for a random one)")
        if sortby not in ("task", "arrival"):
            raise ValueError(f"sortby must be 'task' or 'arrival', got {sortby!r}")
        if heartbeat_timeout <= 0 or handshake_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if not 1 <= min_workers <= n_workers:
            raise ValueError(f"min_workers must be in [1, {n_workers}], got {min_workers}")
        self.n_workers = n_workers
        self.host = host
        self.port = port
        self._secret = secret
        self._sortby = sortby
        self._heartbeat_timeout = heartbeat_timeout
        self._registry: Registry[_Conn] = Registry(n_workers, sortby=sortby,
                                                   rejoin_grace=rejoin_grace,
                                                   elastic=elastic, min_workers=min_workers,
                                                   log=log)
        self._log = log
        # elastic mode: the tracker of the current live set's collectives, and the set
        self._set_tracker: Tracker | None = None
        self._set_steps: asyncio.Task[None] | None = None  # (forming and ending, in order)
        self._retiring: set[asyncio.Task[None]] = set()  # previous sets' trackers closing
        self._set_host: str | None = None  # where members reach the sets' trackers
        self._graces: dict[str, asyncio.TimerHandle] = {}  # task id -> its rejoin grace
        self._classic_from = classic
        # tasks whose worker registered without recovery or elastic mode: a restart of one
        # of the job's workers could not join it (the launcher restarts none)
        self._no_restarts: set[str] = set()
        self._classic: ClassicJob | None = None  # made by the first classic worker
        self._handshake_timeout = handshake_timeout
        self._print_fn = print_fn or _print_stdout
        self._prints = 0
        self._conns: set[_Conn] = set()
        self._refusals = RateLimitedLog(logger)
        self._door = Listener(secret=secret, handshake_timeout=handshake_timeout,
                              max_handshakes=4 * n_workers + 64, check_hello=self._check_hello,
                              serve=self._serve_connection, serve_classic=self._serve_classic,
                              refusals=self._refusals)
        self._result: JobResult | None = None
        self._done = asyncio.Event()
        self._closing = False
        self.on_worker_lost: Callable[[str, int | None, str], None] | None = None
        self.on_rank_assigned: Callable[[str, int], None] | None = None
        self.on_task_finished: Callable[[str], None] | None = None
        self.on_task_registered: Callable[[str], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting; ``self.port`` is the bound port afterwards.

        Raises ``OSError`` if the address cannot be bound.
        """
        self.port = await self._door.start(self.host, self.port, max(128, 2 * self.n_workers))
        self._log.info("tracker listening on %s:%d for %d workers", self.host, self.port,
                    self.n_workers)

    async def close(self) -> None:
        """Stop accepting, close every connection and wait for the handlers.  Idempotent;
        raises nothing of its own."""
        self._closing = True
        await self._door.stop_accepting()
        for conn in list(self._conns):
            conn.writer.close()  # (closing is ours: not a worker loss)
        for grace in self._graces.values():
            grace.cancel()
        self._graces.clear()
        if self._set_steps is not None:
            self._set_steps.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._set_steps
        await self._end_set("the tracker closed")
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self._door.cancel_handlers()

    def worker_env(self) -> dict[str, str]:
        """The environment a worker needs to join this job (its port is the bound one after
        :meth:`start`).  Never raises."""
        host = advertised_host() if self.host in _WILDCARD_HOSTS else self.host
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
        """The job's result once it is done (every rank shut down, or aborted), else None.
        Never raises."""
        return self._result

    @property
    def takes_restarts(self) -> bool:
        """False once a worker of the job registered without recovery (and not in elastic
        mode).  Never raises; read from any thread."""
        return not self._no_restarts

    @property
    def classic(self) -> bool:
        """Whether this job's workers speak the classic rabit protocol, which has no abort
        message: once such a job has failed, its launcher stops the workers itself."""
        return self._classic is not None and self._classic.started

    def abort(self, reason: str) -> None:
        """Abort the job: push ``abort{reason}`` to every connected worker.  Idempotent (the
        first reason stays; nothing happens once the job has ended); never raises."""
        self._apply(self._registry.abort(reason))

    def worker_exited(self, task_id: str) -> None:
        """The launcher saw ``task_id``'s process end: if its connection ended too, it will
        not rejoin, so it is lost now rather than at the end of the rejoin grace; if its
        connection has not ended yet here, it is lost as soon as it does.  Never raises; an
        unknown task is ignored."""
        self._apply(self._registry.worker_exited(task_id))

    def mark_failed(self, task_id: str, reason: str) -> None:
        """The launcher gave up on ``task_id``: abort the job, naming the task and reason.
        Never raises; nothing happens once the job has ended."""
        self._apply(self._registry.mark_failed(task_id, reason))

    def status(self, only: str | None = None) -> dict[str, Any]:
        """A msgpack-able snapshot for humans and monitoring; ``only``: list that task alone
        in ``tasks`` (the totals still count every task).  Never raises."""
        if self._classic is not None and self._classic.started:
            return self._classic_status(only)
        try:
            now: float | None = asyncio.get_running_loop().time()
        except RuntimeError:  # (a caller outside the tracker's loop, after the job)
            now = None
        return self._registry.status(only, port=self.port, prints=self._prints, now=now)

    def _relay_classic_print(self, line: str) -> None:
        self._prints += 1
        self._print_fn(line)

    def _classic_status(self, only: str | None) -> dict[str, Any]:
        """:meth:`status` of a job of classic workers (``tracker/classic.py``)."""
        assert self._classic is not None
        tasks = self._classic.status()
        status = job_status(self.n_workers, self.port, self._prints, self._registry.outcome,
                            tasks, only, assigned=len(tasks) == self.n_workers)
        return {**status, "protocol": "classic"}

    # -- connections -----------------------------------------------------------------------

    async def _serve_connection(self, sock: socket.socket, hello: dict[str, Any], host: str,
                                peer: str) -> None:
        """A rabit2 connection, its handshake done: serve it until it ends."""
        streams = await _streams(sock, f"connection from {peer} after the handshake")
        if streams is None:
            return
        reader, writer = streams
        conn = _Conn(writer=writer, host=host, peer=peer, role=hello["role"])
        self._conns.add(conn)
        reason = CLOSED_BY_WORKER
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
            if not self._closing:  # (closing is ours: not a worker loss)
                self._connection_ended(conn, reason, broken)

    async def _serve_classic(self, sock: socket.socket, host: str, peer: str) -> None:
        """A worker of the classic rabit protocol (XGBoost 1.x/2.0, dmlc/rabit)."""
        why = None
        outcome = self._registry.outcome
        if self._classic_from == "none":
            why = "this job serves no classic rabit workers (--classic none)"
        elif self._classic_from == "loopback" and not is_loopback(host):
            why = ("classic rabit workers are served from loopback addresses only (the "
                   "classic protocol has no secret; --classic any serves them from anywhere)")
        elif self._registry.tasks:
            why = ("this job's workers speak rabit2's protocol; a classic rabit worker "
                   "(XGBoost 1.x/2.0) cannot join it")
        elif outcome is not None:
            why = f"the job has ended ({outcome.reason})"
        if why is not None:
            sock.close()
            self._refusals.warning("classic rabit worker from %s refused: %s", peer, why)
            return
        if self._classic is None:
            self._classic = ClassicJob(
                self.n_workers, self._relay_classic_print,
                on_done=lambda: self._apply(self._registry.finish(True, "every rank shut down")),
                sort_key=(lambda t: (natural_key(t), t)) if self._sortby == "task" else None,
                timeout=self._handshake_timeout,
                on_rank=lambda task_id, rank: _call_hook(self.on_rank_assigned, task_id, rank),
                on_joined=lambda task_id: _call_hook(self.on_task_registered, task_id),
                on_finished=lambda task_id: _call_hook(self.on_task_finished, task_id))
        streams = await _streams(sock, f"classic connection from {peer}")
        if streams is None:
            return
        reader, writer = streams
        try:
            await self._classic.serve(reader, writer, host)
        except ProtocolError as exc:  # (unauthenticated: limited as any refusal)
            self._refusals.warning("classic rabit worker from %s: %s", peer, exc)
        except OSError as exc:
            self._refusals.warning("classic connection from %s failed: %s", peer, exc)
        finally:
            writer.close()

    def _check_hello(self, hello: dict[str, Any]) -> dict[str, Any]:
        role = hello.get("role")
        if role not in ("worker", "monitor"):
            raise ProtocolError(f"hello.role must be 'worker' or 'monitor', got {role!r}")
        return {"world_size": self.n_workers, "heartbeat_timeout": self._heartbeat_timeout}

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader) -> str:
        """Read and handle frames until the connection ends; return why it ended."""
        loop = asyncio.get_running_loop()
        decoder = FrameDecoder()
        while True:
            # Before registering a worker gets the handshake budget; after, silence longer
            # than the heartbeat timeout means it is dead or paused.
            registered = self._registry.task_of(conn) is not None
            timeout = self._heartbeat_timeout if registered else self._handshake_timeout
            try:
                data = await asyncio.wait_for(reader.read(READ_SIZE), timeout)
            except TimeoutError as exc:
                if exc.errno is not None:  # the kernel's ETIMEDOUT, not our deadline
                    return f"connection timed out: {exc}"
                return f"{SILENCE_REASON} {timeout:g}s"
            if not data:
                return CLOSED_BY_WORKER
            self._registry.heard(conn, loop.time())
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
            conn.send_frame(_status_frame(self.status(only)))
            return True
        if conn.role != "worker":
            self._on_monitor(conn, kind, msg)
            return True
        registry = self._registry
        now = asyncio.get_running_loop().time()
        task = registry.task_of(conn)
        if task is None:
            if kind == "rejoin":
                self._apply(registry.rejoin(conn, msg, host=conn.host, peer=conn.peer, now=now))
                return True
            if kind != "register":
                raise ProtocolError(f"expected register, got {kind}")
            if self._classic is not None and self._classic.started:
                raise ProtocolError("this job's workers speak the classic rabit protocol "
                                    "(XGBoost 1.x/2.0); a rabit2 worker cannot join it")
            self._register(conn, msg, now)
            joined = registry.task_of(conn)
            if joined is not None:
                if msg.get("restarts", True) is False:
                    self._no_restarts.add(joined.task_id)
                _call_hook(self.on_task_registered, joined.task_id)
            return True
        if kind == "heartbeat":  # reading it already reset the liveness deadline
            if "progress" in msg:
                try:
                    self._registry.heartbeat(conn, check_progress(msg["progress"]))
                except ProtocolError as exc:  # (monitoring only: not worth the worker)
                    self._refusals.warning("ignoring the progress task %s reported: %s",
                                           task.task_id, exc)
            return True
        if kind == "print":
            self._prints += 1
            label = task.task_id if task.rank is None else str(task.rank)
            self._print_fn(labelled(label, msg["msg"]))
            return True
        if kind == "shutdown":
            decisions = registry.shutdown(conn, msg["hold"])
            self._apply(decisions)
            return not any(isinstance(d, Release) for d in decisions)
        decide = {
            "error": lambda: registry.error(conn, msg["msg"]),
            "unreachable": lambda: registry.unreachable(conn, msg["rank"], msg["reason"], now),
            "live": lambda: registry.live_ask(conn, msg),
            "live_done": lambda: registry.live_done(conn, msg),
        }.get(kind)
        if decide is None:
            raise ProtocolError(f"unexpected {kind} from a registered worker")
        self._apply(decide())
        return True

    def _register(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        """A worker's ``register``: refused (ProtocolError) or joined.  A worker set up for
        another world size ends a job that has not begun (no restart can fix it); a job
        under way only refuses it (a stray worker of another job)."""
        registry = self._registry
        try:
            decisions = registry.register(conn, msg, host=conn.host, peer=conn.peer, now=now)
        except WrongJobError as exc:
            if not registry.by_rank:
                self._apply(registry.abort(f"task {msg['task_id']} was refused, which no "
                                           f"restart can fix: {exc}"))
            raise
        self._apply(decisions)

    def _on_monitor(self, conn: _Conn, kind: str, msg: dict[str, Any]) -> None:
        """What a supervisor (``tracker.slot``) tells of a task: out of attempts, or a run
        of its process ended."""
        if kind == "give_up" and conn.role == "monitor":
            self._apply(self._registry.give_up(msg["task_id"], msg["reason"]))
        elif kind == "exited" and conn.role == "monitor":
            self._apply(self._registry.exit_reported(msg["task_id"], msg["attempt"]))
        else:
            raise ProtocolError(f"a {conn.role} connection may only send status, give_up or "
                                f"exited, not {kind}")

    def _connection_ended(self, conn: _Conn, reason: str, broken: bool) -> None:
        if self._registry.task_of(conn) is None:
            if not conn.fenced and (broken or conn.role == "worker"):
                logger.warning("connection from %s (%s, unregistered) closed: %s",
                               conn.peer, conn.role, reason)
            return
        self._apply(self._registry.connection_ended(conn, reason))

    # -- the registry's decisions ----------------------------------------------------------

    def _apply(self, decisions: list[Decision[_Conn]]) -> None:
        """Carry out what the registry decided, in order."""
        for decision in decisions:
            match decision:
                case Send(conn=conn, msg=msg):
                    conn.send(msg)
                case Fence(conn=conn):
                    conn.fenced = True
                    conn.writer.close()
                case Hook(name=name, args=args):
                    _call_hook(getattr(self, name), *args)
                case Grace(task_id=task_id, delay=delay, token=token):
                    previous = self._graces.pop(task_id, None)
                    if previous is not None:
                        previous.cancel()
                    self._graces[task_id] = asyncio.get_running_loop().call_later(
                        delay, self._grace_over, task_id, token)
                case Finish(success=success, reason=reason):
                    self._finish(success, reason)
                case Release():
                    pass  # (the caller stops reading that connection)
                case FormSet() | EndSet():
                    self._set_step(decision)

    def _set_step(self, decision: FormSet[_Conn] | EndSet) -> None:
        """Form or end a live set (elastic mode), after the steps decided before it."""
        previous = self._set_steps

        async def step() -> None:
            if previous is not None:
                await previous
            if isinstance(decision, EndSet):
                await self._end_set(decision.reason)
            else:
                await self._form_set(decision)

        self._set_steps = asyncio.get_running_loop().create_task(step())

    async def _form_set(self, form: FormSet[_Conn]) -> None:
        """Start the set's collectives' tracker (unless the previous one serves the same
        members), then tell each member the set, where that tracker listens and whether it
        is the one of the previous set (``same``)."""
        if not form.reuse or self._set_tracker is None:
            old, self._set_tracker = self._set_tracker, None
            if old is not None:  # its members leave it as they join the new one
                self._retiring.add(asyncio.get_running_loop().create_task(self._retire(old)))
            sub = Tracker(len(form.ranks), self.host, 0, secret=self._secret,
                          heartbeat_timeout=self._heartbeat_timeout,
                          handshake_timeout=self._handshake_timeout,
                          print_fn=self._print_fn, classic="none", log=_SET_LOG)
            try:
                await sub.start()
            except OSError as exc:
                self._apply(self._registry.live_failed(
                    form.epoch, f"its collectives' tracker could not start: {exc}"))
                return
            self._set_tracker = sub
        if self._set_tracker is None:
            return  # (the set failed meanwhile: its members hear that when they report)
        if self._set_host is None:  # (a wildcard address is resolved once, off the hot path)
            self._set_host = self.worker_env()["DMLC_TRACKER_URI"]
        for _, conn in form.members:
            conn.send({"t": "live_set", "epoch": form.epoch, "ranks": list(form.ranks),
                       "new": list(form.new), "host": self._set_host,
                       "port": self._set_tracker.port, "same": form.reuse})

    async def _retire(self, sub: Tracker) -> None:
        """Close a previous set's tracker once its members left it (bounded)."""
        with contextlib.suppress(CollectiveTimeoutError):
            await sub.wait_done(self._heartbeat_timeout)
        await sub.close()
        self._retiring.discard(asyncio.current_task())

    async def _end_set(self, reason: str) -> None:
        """Abort the current set's collectives (a member blocked in one is released) and
        close its tracker."""
        sub, self._set_tracker = self._set_tracker, None
        if sub is not None:
            if sub.result is None:
                sub.abort(f"the live set ended: {reason}")
            await sub.close()

    def _grace_over(self, task_id: str, token: int) -> None:
        self._graces.pop(task_id, None)
        self._apply(self._registry.grace_over(task_id, token))

    def _finish(self, success: bool, reason: str) -> None:
        # Record the outcome first so that the final status snapshot reports it.
        self._result = JobResult(success, reason, {}, self._registry.origin)
        self._result = dataclasses.replace(self._result, status=self.status())
        if not success and self._classic is not None:
            self._classic.abort()
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


def _status_frame(status: dict[str, Any]) -> bytes:
    """The ``status_reply`` frame of ``status``, its task rows cut to at most
    :data:`_STATUS_TASKS_ON_WIRE` and to what fits in one frame (``tasks_truncated: true``);
    the totals above the list stay exact."""
    rows = status["tasks"]
    keep = min(len(rows), _STATUS_TASKS_ON_WIRE)
    while True:
        if keep < len(rows):
            status = {**status, "tasks": rows[:keep], "tasks_truncated": True}
        try:
            return encode_frame({"t": "status_reply", "status": status})
        except ValueError:  # (over MAX_FRAME: rows grow with task ids, hosts and progress)
            if keep == 0:
                raise
            keep //= 2


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


__all__ = ["CLOSED_BY_WORKER", "JobResult", "Tracker"]
