"""The worker side of the tracker protocol (``docs/protocol.md``, "Tracker protocol").

A worker holds ONE authenticated connection to the tracker for its whole life: it registers,
receives its assignment, sends heartbeats and prints over it, and the tracker pushes aborts and
peer notices down it.  Losing that connection unexpectedly is reported through ``on_abort``,
never discovered later by a hung collective.

Everything here runs on the worker's event loop; :meth:`TrackerClient.print` and
:meth:`TrackerClient.signal_error` may also be called from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading
from collections.abc import Callable
from typing import Any

from rabit2.config import Config
from rabit2.core.control import READ_SIZE, FrameDecoder, encode_frame
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    PeerLostError,
    ProtocolError,
    RabitError,
    TrackerError,
)
from rabit2.io.assignment import Assignment, parse_assignment
from rabit2.io.handshake import connect_authenticated

logger = logging.getLogger("rabit2.tracker_client")

# A print is a log line, not a data channel: cap it well below MAX_FRAME so that a huge
# message is truncated instead of failing the worker.
_MAX_PRINT_BYTES = 256 * 1024
_BACKOFF_FIRST_SEC = 0.5
_BACKOFF_MAX_SEC = 8.0
_CLOSE_WAIT_SEC = 1.0
REJOIN_SEC = 30.0
NO_ASSIGNMENT = "no rank assignment from the tracker within"
"""How a worker's init says it waited for its rank until its deadline (the launcher reads it:
a task that never joined is then the cause, not the one that waited)."""
"""How long a worker whose tracker connection ended dials the tracker again before it gives
up: the same tracker keeps its place for ``tracker.server.REJOIN_GRACE_SEC`` (5 s) and
refuses it after that; a tracker restarted at the same address within this time takes the
job over from the workers that rejoin it."""
_MAX_HELD_MESSAGES = 1000  # prints and errors kept while the connection is being rebuilt
PRINT_BACKLOG = 4 << 20
"""Bytes of prints that may wait for the tracker (in the connection's write buffer, or held
while it is rebuilt): a print beyond them waits for room (``PRINT_WAIT_SEC``), or is dropped
and counted where it cannot wait."""
PRINT_WAIT_SEC = 10.0


def _truncate(text: str) -> tuple[str, int]:
    """The line as sent (at most ``_MAX_PRINT_BYTES`` of UTF-8, what does not encode
    replaced) and its size in bytes."""
    data = text.encode("utf-8", errors="replace")
    if len(data) > _MAX_PRINT_BYTES:
        data = data[:_MAX_PRINT_BYTES].decode("utf-8", errors="ignore").encode() + (
            b" ...[truncated]")
    return data.decode(), len(data)


def _heartbeat_interval(config: Config, welcome: dict[str, Any]) -> float:
    """The configured heartbeat interval, but at most a third of the tracker's heartbeat
    timeout (its welcome says it): a worker that beats less often is declared lost."""
    interval = config.heartbeat_sec
    limit = welcome.get("heartbeat_timeout")
    if isinstance(limit, (int, float)) and limit > 0 and interval > limit / 3:
        # (a warning where the worker would have been declared lost: the default 1 s
        # against a tracker's --heartbeat-timeout of 2 s is only adjusted)
        logger.log(logging.WARNING if interval >= limit else logging.INFO,
                   "rabit2_heartbeat_sec=%g is not well below the tracker's heartbeat "
                   "timeout (%g s): beating every %g s instead", interval, limit, limit / 3)
        interval = limit / 3
    return interval


class TrackerClient:
    """One worker's persistent, authenticated connection to the tracker.

    Callbacks (set by the engine; called on the loop thread; an exception in one is logged
    and otherwise ignored so that it cannot kill the connection):

    * ``on_abort(reason)``: the tracker pushed ``abort`` or the connection was lost before
      :meth:`shutdown`/:meth:`close` (the reason says which).  Called at most once.
    * ``on_peer_lost(rank, incarnation, reason)`` / ``on_peer_recovered(rank, incarnation,
      (host, port))``: the tracker's notices about this worker's neighbours.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        heartbeat_sec: float,
    ) -> None:
        """Internal: use :meth:`connect`."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._reader = reader
        self._writer = writer
        self.connections = 1  # connections made so far (a rejoin makes another)
        self._assignment: Assignment | None = None
        self._failure: RabitError | None = None  # why no assignment can come any more
        self._lost: TrackerError | None = None  # set once the connection is closed
        self._assigned = asyncio.Event()  # set on assign or on failure
        self._bye = asyncio.Event()  # set on bye or when the connection is lost
        self._bye_received = False
        self._closing = False  # shutdown/close requested: a lost connection is expected
        self._abort_reported = False
        self.on_abort: Callable[[str], None] | None = None
        # how an abort is logged: a live set's own job (elastic mode) says it at DEBUG, the
        # set's outcome being what its members raise
        self.abort_log_level = logging.WARNING
        self.on_peer_lost: Callable[[int, int, str], None] | None = None
        self.on_peer_recovered: Callable[[int, int, tuple[str, int]], None] | None = None
        # elastic mode: a member left the current set's block after so many calls
        self.on_live_left: Callable[[int, int, int], None] | None = None
        self._replies: dict[str, asyncio.Future[dict[str, Any]]] = {}  # reply type -> waiter
        self._asked: dict[str, dict[str, Any]] = {}  # reply type -> what asked for it
        # what each heartbeat reports of this worker's progress (called on the loop thread)
        self.progress: Callable[[], dict[str, int | bool]] | None = None
        # to dial again after the connection ended (set by connect)
        self._config: Config | None = None
        self._listen_port = 0
        self._rejoining = False
        self._held: list[dict[str, Any]] = []  # sent while the connection is rebuilt
        self._held_print_bytes = 0
        self._dropped_prints = 0  # prints that did not fit in _held
        self._backlog_drops = 0  # prints dropped for want of room since the last that fit
        self._in_flight = 0  # print bytes handed to the loop and not yet written
        self._print_stalled = False  # a print waited for room in vain: the next ones do not
        self._print_lock = threading.Lock()  # (for those two: printing threads and the loop)
        self._limit_writes(writer)
        self._refused = ""
        self._heartbeat_sec = heartbeat_sec
        self._read_task = asyncio.create_task(self._read_loop(), name="rabit2-tracker-reader")
        self._heartbeat_task = asyncio.create_task(
            self._heartbeat_loop(heartbeat_sec), name="rabit2-tracker-heartbeat"
        )

    @classmethod
    async def connect(cls, config: Config, listen_port: int) -> TrackerClient:
        """Connect, authenticate and send ``register{task_id, attempt, port, world_size}``.

        Tries ``config.connect_retry`` times (at least once) with exponential backoff, each
        attempt bounded by ``config.connect_timeout_sec``.  Raises :class:`TrackerError` if no
        tracker is configured, if every attempt failed, or at once if the tracker refused us
        (wrong secret, unacceptable hello): retrying cannot fix those.
        """
        if not config.distributed or config.tracker_uri is None:
            raise TrackerError("no tracker configured (set DMLC_TRACKER_URI)")
        if not 0 < listen_port < 65536:
            raise ValueError(f"listen_port {listen_port} is not a TCP port")
        attempts = max(1, config.connect_retry)
        hello = {"role": "worker", "task_id": config.task_id}
        failures: list[str] = []
        for attempt in range(attempts):
            if attempt:
                delay = min(_BACKOFF_FIRST_SEC * 2 ** (attempt - 1), _BACKOFF_MAX_SEC)
                # jitter spreads a whole job's retries so they do not hit the tracker together
                await asyncio.sleep(delay * random.uniform(0.75, 1.25))
            try:
                sock, welcome = await connect_authenticated(
                    config.tracker_uri,
                    config.tracker_port,
                    config.secret,
                    hello,
                    config.connect_timeout_sec,
                )
            except (PeerLostError, CollectiveTimeoutError) as exc:
                failures.append(str(exc))
                logger.info("tracker connect attempt %d/%d failed: %s", attempt + 1, attempts, exc)
                continue
            except ProtocolError as exc:
                raise TrackerError(f"tracker refused the connection: {exc}") from exc
            client = await cls._from_socket(sock, _heartbeat_interval(config, welcome))
            client._config, client._listen_port = config, listen_port
            client._send(
                {
                    "t": "register",
                    "task_id": config.task_id,
                    "attempt": config.num_attempt,
                    "port": listen_port,
                    "world_size": config.world_size,
                    # (whether a restart of a lost worker can join this job: without
                    # recovery or elastic mode it cannot, and a launcher restarts nothing)
                    "restarts": config.recover or config.elastic,
                }
            )
            return client
        raise TrackerError(
            f"cannot reach the tracker at {config.tracker_uri}:{config.tracker_port} after "
            f"{attempts} attempts: {failures[-1] if failures else 'no attempt made'}"
        )

    @classmethod
    async def _from_socket(cls, sock: socket.socket, heartbeat_sec: float) -> TrackerClient:
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer, heartbeat_sec)

    async def wait_assignment(self, timeout: float) -> Assignment:
        """Wait until the tracker has assigned this worker its rank and links.

        Raises :class:`CollectiveTimeoutError` after ``timeout`` seconds,
        :class:`JobAbortedError` if the tracker aborted the job, and :class:`TrackerError` if
        the tracker refused the registration or the connection was lost.
        """
        try:
            await asyncio.wait_for(self._assigned.wait(), timeout)
        except TimeoutError:
            raise CollectiveTimeoutError(
                f"{NO_ASSIGNMENT} {timeout}s"
            ) from None
        if self._assignment is not None:
            return self._assignment
        raise self._failure or TrackerError("no assignment")

    def print(self, msg: str, wait: bool = True) -> None:
        """Queue ``msg`` for the tracker to print as ``[rank] msg``.

        Messages from one worker are printed in call order.  While more than
        ``PRINT_BACKLOG`` bytes of prints wait for the tracker, a thread other than the
        loop's waits for room, up to ``PRINT_WAIT_SEC`` (with ``wait``); then, or at once,
        the line is dropped and counted (a warning says how many).  Silently dropped once
        the connection is gone (the engine learns about that through ``on_abort``).
        """
        text, nbytes = _truncate(str(msg))
        line = {"t": "print", "msg": text}
        on_loop = threading.get_ident() == self._loop_thread
        loop = self._loop
        if not on_loop and (loop.is_closed() or not loop.is_running()):
            return  # (the client is going away: nothing would send it)
        backlog = self._print_backlog()
        if self._print_stalled and backlog <= PRINT_BACKLOG // 2:
            self._print_stalled = False
        if backlog > PRINT_BACKLOG:
            waited = wait and not on_loop and not self._print_stalled
            if waited:
                waiting = self._room_for_prints()
                try:
                    future = asyncio.run_coroutine_threadsafe(waiting, loop)
                except RuntimeError:  # (the loop closed meanwhile)
                    waiting.close()
                else:
                    try:
                        future.result(PRINT_WAIT_SEC + 1.0)
                    except Exception:  # (no room in time, or the loop stopped)
                        future.cancel()
            if self._print_backlog() > PRINT_BACKLOG:
                # waited in vain, the tracker stalled: later lines drop at once, until half
                # of the backlog has drained
                self._print_stalled = self._print_stalled or waited
                with self._print_lock:
                    self._backlog_drops += 1
                    first = self._backlog_drops == 1
                if first:
                    logger.warning("tracker_print lines are being dropped: more than %d bytes "
                                   "of them wait for the tracker, which prints them slower "
                                   "than this worker makes them", PRINT_BACKLOG)
                return
        with self._print_lock:
            dropped, self._backlog_drops = self._backlog_drops, 0
            self._in_flight += nbytes
        if dropped:
            logger.warning("%d tracker_print lines were dropped for want of room", dropped)
        if on_loop:
            self._send_print(line, nbytes)
            return
        try:
            loop.call_soon_threadsafe(self._send_print, line, nbytes)
        except RuntimeError:  # the loop closed meanwhile: dropped
            with self._print_lock:
                self._in_flight -= nbytes

    def _send_print(self, line: dict[str, Any], nbytes: int) -> None:
        with self._print_lock:
            self._in_flight -= nbytes
        self._send(line)

    def _print_backlog(self) -> int:
        """Bytes of prints waiting for the tracker: on their way to the loop, then in the
        connection's write buffer or held while it is rebuilt (any thread: an estimate)."""
        if self._rejoining:
            return self._in_flight + self._held_print_bytes
        transport = self._writer.transport
        waiting = 0 if transport.is_closing() else int(transport.get_write_buffer_size())
        return self._in_flight + waiting

    async def _room_for_prints(self) -> None:
        """Wait (on the loop) until the prints waiting for the tracker are down to half of
        ``PRINT_BACKLOG``, at most ``PRINT_WAIT_SEC``."""
        deadline = self._loop.time() + PRINT_WAIT_SEC
        while self._loop.time() < deadline and self._print_backlog() > PRINT_BACKLOG // 2:
            if not self._rejoining:
                with contextlib.suppress(ConnectionError, TimeoutError):
                    await asyncio.wait_for(self._writer.drain(), deadline - self._loop.time())
            if self._print_backlog() > PRINT_BACKLOG // 2:
                await asyncio.sleep(0.02)  # (held while rejoining, or drained only in part)

    @staticmethod
    def _limit_writes(writer: asyncio.StreamWriter) -> None:
        """``drain`` waits while more than ``PRINT_BACKLOG`` bytes wait to be sent, until
        half of that is left (heartbeats and control messages never wait: they are written,
        not drained)."""
        with contextlib.suppress(Exception):
            writer.transport.set_write_buffer_limits(high=PRINT_BACKLOG, low=PRINT_BACKLOG // 2)

    def leave_hold(self) -> None:
        """End a held shutdown now (this worker failed while it held): the tracker answers
        ``bye`` at once.  Never blocks."""
        self._send_from_any_thread({"t": "shutdown", "hold": False})

    @property
    def abort_error(self) -> JobAbortedError | None:
        """The tracker's abort of the job, once it came (any thread may ask)."""
        failure = self._failure
        return failure if isinstance(failure, JobAbortedError) else None

    def signal_error(self, msg: str) -> None:
        """Ask the tracker to abort the whole job with ``msg`` as the reason; never blocks."""
        self._send_from_any_thread({"t": "error", "msg": _truncate(str(msg))[0]})

    def report_unreachable(self, rank: int, reason: str) -> None:
        """Tell the tracker that the link to ``rank`` cannot be rebuilt (it decides whether
        that is a partition: ``docs/recovery.md``, "Partial partitions"); loop thread."""
        self._send({"t": "unreachable", "rank": rank, "reason": _truncate(reason)[0]})

    async def ask(self, msg: dict[str, Any], reply: str, timeout: float) -> dict[str, Any]:
        """Send ``msg`` and wait for the tracker's next message of type ``reply`` (elastic
        mode's ``live``/``live_set`` and ``live_done``/``live_result``: docs/elastic.md).

        Raises :class:`CollectiveTimeoutError` after ``timeout`` seconds,
        :class:`JobAbortedError` if the tracker aborted the job and :class:`TrackerError` if
        the connection was lost (or already was)."""
        if self._failure is not None:
            raise self._failure
        waiter = self._replies[reply] = asyncio.get_running_loop().create_future()
        self._asked[reply] = msg  # (asked again if the connection is rebuilt meanwhile)
        self._send(msg)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise CollectiveTimeoutError(
                f"no {reply} from the tracker within {timeout:g} s") from None
        finally:
            if self._replies.get(reply) is waiter:
                del self._replies[reply]
            if self._asked.get(reply) is msg:
                del self._asked[reply]

    async def shutdown(self, timeout: float, hold: bool = False,
                       leave_timeout: float = 10.0) -> None:
        """Tell the tracker this worker finished, wait for its ``bye``, then close.

        ``hold``: the tracker answers only once every rank has finished (recovery on: this
        worker keeps serving a restarted neighbour meanwhile), or aborts the job; an abort
        then raises :class:`JobAbortedError`.  If ``timeout`` passes first, the worker says
        ``shutdown`` again without ``hold`` and leaves (a warning, within ``leave_timeout``).

        The connection is closed when this returns or raises.  Raises
        :class:`CollectiveTimeoutError` if no ``bye`` arrived within ``timeout`` and
        :class:`TrackerError` if the connection was already lost or was lost first.  Works
        after an abort too, so that the tracker learns this worker is done.
        """
        try:
            if self._lost is not None:
                raise self._lost
            self._closing = True
            if self.progress is not None:
                # (the last word on this worker's progress: a hold that every rank's finalize
                # ends at once may leave no heartbeat to bring the final counters)
                self._send({"t": "heartbeat", "progress": self.progress()})
            self._send({"t": "shutdown", "hold": hold})
            try:
                await self._wait_bye(timeout)
            except CollectiveTimeoutError:
                if not hold:
                    raise
                logger.warning("not every rank finalized within %gs: leaving without them",
                               timeout)
                self._send({"t": "shutdown", "hold": False})
                await self._wait_bye(leave_timeout)
            if not self._bye_received:
                if isinstance(self._failure, JobAbortedError):
                    raise self._failure
                raise self._lost or TrackerError("tracker connection lost before bye")
        finally:
            await self.close()

    async def _wait_bye(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._bye.wait(), timeout)
        except TimeoutError:
            raise CollectiveTimeoutError(
                f"the tracker did not acknowledge shutdown within {timeout}s") from None

    async def close(self) -> None:
        """Close the connection without the shutdown exchange.  Idempotent; never raises."""
        self._closing = True
        if self._backlog_drops:
            logger.warning("%d tracker_print lines were dropped for want of room",
                           self._backlog_drops)
            self._backlog_drops = 0
        self._connection_closed(TrackerError("the tracker client was closed"))
        tasks = [self._read_task, self._heartbeat_task]
        for task in tasks:
            task.cancel()
        current = asyncio.current_task()
        await asyncio.gather(*(t for t in tasks if t is not current), return_exceptions=True)
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), _CLOSE_WAIT_SEC)

    # -- internals --------------------------------------------------------------------------

    def _send_from_any_thread(self, msg: dict[str, Any]) -> None:
        if threading.get_ident() == self._loop_thread:
            self._send(msg)
            return
        # call_soon_threadsafe is FIFO, so prints from one thread keep their order.
        with contextlib.suppress(RuntimeError):  # the loop is already closed: drop
            self._loop.call_soon_threadsafe(self._send, msg)

    def fileno(self) -> int:
        """The descriptor of the current connection to the tracker (-1: none)."""
        sock = self._writer.get_extra_info("socket")
        try:
            return -1 if sock is None or self._writer.is_closing() else int(sock.fileno())
        except (OSError, ValueError):
            return -1

    def _send(self, msg: dict[str, Any]) -> None:
        if self._rejoining and msg["t"] != "heartbeat":
            self._hold(msg)
            return
        if self._writer.is_closing():
            logger.debug("dropping %s: tracker connection is closed", msg["t"])
            return
        self._writer.write(encode_frame(msg))

    def _hold(self, msg: dict[str, Any]) -> None:
        """Keep ``msg`` until the connection is back.  At most ``_MAX_HELD_MESSAGES``: prints
        give way (the newest dropped, or the oldest for a control message), never a control
        message (``shutdown``, ``error``: finalize and signal_error wait on them)."""
        if len(self._held) >= _MAX_HELD_MESSAGES:
            if msg["t"] == "print":
                self._dropped_prints += 1
                return
            for i, held in enumerate(self._held):
                if held["t"] == "print":
                    del self._held[i]
                    self._held_print_bytes -= len(held["msg"].encode())
                    self._dropped_prints += 1
                    break
        if msg["t"] == "print":
            self._held_print_bytes += len(msg["msg"].encode())
        self._held.append(msg)

    async def _heartbeat_loop(self, interval: float) -> None:
        while not self._writer.is_closing():
            await asyncio.sleep(interval)
            if self.progress is None:
                self._send({"t": "heartbeat"})
            else:
                self._send({"t": "heartbeat", "progress": self.progress()})

    async def _read_loop(self) -> None:
        while True:
            reason = await self._read_until_closed()
            if (self._closing or self._assignment is None or self._failure is not None
                    or self._bye_received or self._config is None):
                break
            # a registered worker's connection ended: the path may have blinked while both
            # ends live, so dial again rather than end the job (docs/protocol.md)
            clock = asyncio.get_running_loop().time
            started = clock()
            if not await self._rejoin(reason):
                if self._closing:  # (this worker finalized meanwhile: it dials no more)
                    reason = (f"{reason}; not reached again before this worker finalized "
                              f"({clock() - started:.1f} s)")
                elif not self._refused:
                    reason = f"{reason}; could not reach it again within {REJOIN_SEC:g} s"
                break
        if self._refused:
            reason = f"{reason}; the tracker refused it: {self._refused}"
        self._connection_closed(TrackerError(f"lost the tracker connection: {reason}"))
        if not self._closing:
            self._report_abort(f"lost the tracker connection: {reason}")

    async def _read_until_closed(self) -> str:
        decoder = FrameDecoder()
        try:
            while True:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    return "the tracker closed the connection"
                for msg in decoder.feed(data):
                    self._dispatch(msg)
        except ProtocolError as exc:
            return f"the tracker sent an invalid message: {exc}"
        except OSError as exc:
            return f"the tracker connection failed: {exc}"

    async def _rejoin(self, reason: str) -> bool:
        """Dial the tracker again and send ``rejoin`` (same task, rank and incarnation), for
        up to :data:`REJOIN_SEC`; what is printed meanwhile is sent once it is back."""
        config, assignment = self._config, self._assignment
        assert config is not None and assignment is not None and config.tracker_uri
        logger.warning("lost the tracker connection (%s): dialing it again", reason)
        self._rejoining = True
        self._writer.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REJOIN_SEC
        delay = 0.05
        hello = {"role": "worker", "task_id": config.task_id}
        try:
            while not self._closing:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                try:
                    sock, _ = await connect_authenticated(
                        config.tracker_uri, config.tracker_port, config.secret, hello,
                        min(config.connect_timeout_sec, left))
                except (PeerLostError, CollectiveTimeoutError):
                    await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                    delay = min(delay * 2, 1.0)
                    continue
                except ProtocolError as exc:
                    self._refused = str(exc)
                    return False
                self._reader, self._writer = await asyncio.open_connection(sock=sock)
                self.connections += 1
                self._writer.write(encode_frame({
                    "t": "rejoin", "task_id": config.task_id, "rank": assignment.rank,
                    "incarnation": assignment.incarnation, "port": self._listen_port,
                    "attempt": config.num_attempt}))
                self._limit_writes(self._writer)
                held, self._held = self._held, []
                self._held_print_bytes = 0
                if self._dropped_prints:
                    logger.warning("%d tracker_print lines were dropped while the tracker "
                                   "connection was rebuilt", self._dropped_prints)
                    self._dropped_prints = 0
                for msg in held:
                    self._writer.write(encode_frame(msg))
                # what is still waited for may have been lost with the old connection: the
                # tracker answers a question asked again as it answered it the first time
                for msg in self._asked.values():
                    if not any(msg is sent for sent in held):
                        self._writer.write(encode_frame(msg))
                self._heartbeat_task.cancel()
                self._heartbeat_task = asyncio.create_task(
                    self._heartbeat_loop(self._heartbeat_sec), name="rabit2-tracker-heartbeat")
                return True
            return False
        finally:
            self._rejoining = False

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "assign":
            if self._assignment is not None:
                raise ProtocolError("a second assign on the same registration")
            self._assignment = parse_assignment(msg)
            self._assigned.set()
        elif kind == "abort":
            self._fail(JobAbortedError(f"the tracker aborted the job: {msg['reason']}"))
            self._report_abort(f"the tracker aborted the job: {msg['reason']}")
            if self._closing:
                self._bye.set()  # a held shutdown ends with the abort
        elif kind == "bye":
            self._bye_received = True
            self._bye.set()
        elif kind == "refuse":
            self._refused = msg["reason"]
            self._fail(TrackerError(f"the tracker refused this worker: {msg['reason']}"))
        elif kind == "rejoined":
            logger.warning("rejoined the tracker")
        elif kind == "peer_lost":
            self._call(self.on_peer_lost, msg["rank"], msg["incarnation"], msg["reason"])
        elif kind == "peer_recovered":
            address = (msg["host"], msg["port"])
            self._call(self.on_peer_recovered, msg["rank"], msg["incarnation"], address)
        elif kind == "live_left":
            self._call(self.on_live_left, msg["epoch"], msg["rank"], msg["calls"])
        elif kind in ("live_set", "live_result"):
            waiter = self._replies.pop(kind, None)
            self._asked.pop(kind, None)
            if waiter is None or waiter.done():  # (an answer to a question asked twice)
                logger.debug("ignoring a %s nobody waits for", kind)
            else:
                waiter.set_result(msg)
        else:
            raise ProtocolError(f"unexpected {kind} from the tracker")

    def _fail(self, error: RabitError) -> None:
        """Record the first reason no assignment can come and wake its waiter."""
        if self._failure is None:
            self._failure = error
        self._assigned.set()
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(self._failure)
        self._replies.clear()
        self._asked.clear()

    def _connection_closed(self, error: TrackerError) -> None:
        """Close the writer and wake every waiter; the first recorded reason wins."""
        self._writer.close()
        if self._lost is None:
            self._lost = error
        self._fail(error)
        self._bye.set()

    def _report_abort(self, reason: str) -> None:
        if self._abort_reported:
            return
        self._abort_reported = True
        logger.log(self.abort_log_level, "%s", reason)
        self._call(self.on_abort, reason)

    @staticmethod
    def _call(callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            logger.exception("tracker client callback %r failed", callback)


__all__ = ["TrackerClient"]
