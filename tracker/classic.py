"""The classic rabit tracker protocol, for workers that embed the classic C++ engine (XGBoost
1.x and 2.0, dmlc/rabit).

Every exchange is a fresh TCP connection from the worker: the magic 0xFF99 both ways, then
the worker's rank, world size, task id and command (``start``, ``recover``, ``print`` or
``shutdown``); integers are 4-byte little-endian, strings a length and their bytes.  For
``start`` and ``recover`` the tracker hands out the rank and the tree and ring neighbours,
then tells the worker which peers to dial (those already waiting for connections) and how
many to accept; the later of two linked workers dials the earlier.  The byte-level
conversation is in ``docs/protocol.md`` ("Classic rabit workers").

The protocol carries no secret: a classic worker is not authenticated.  The tracker therefore
serves it from loopback addresses only unless told otherwise (``Tracker(classic=...)``,
``--classic any`` or ``none`` on ``rabit2-tracker`` and ``rabit2-submit``), and a job is one
protocol or the other: a worker of the other kind is refused, naming the mismatch.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rabit2.core.topology import topology
from rabit2.errors import ProtocolError

logger = logging.getLogger("rabit2.tracker")

CLASSIC_MAGIC = struct.pack("<i", 0xFF99)
_INT = struct.Struct("<i")
_MAX_STRING = 64 * 1024  # a task id, a command, a host or a printed line
_COMMANDS = ("start", "recover", "print", "shutdown")


class _Wire:
    """Deadline-bounded reads and buffered writes of the classic framing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout

    async def read_int(self) -> int:
        try:
            data = await asyncio.wait_for(self.reader.readexactly(4), self.timeout)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ProtocolError(f"connection closed mid-message: {exc}") from None
        except TimeoutError:
            raise ProtocolError(f"no data within {self.timeout:g} s") from None
        value: int = _INT.unpack(data)[0]
        return value

    async def read_str(self) -> str:
        size = await self.read_int()
        if not 0 <= size <= _MAX_STRING:
            raise ProtocolError(f"string of {size} B")
        try:
            data = await asyncio.wait_for(self.reader.readexactly(size), self.timeout)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ProtocolError(f"connection closed mid-message: {exc}") from None
        except TimeoutError:
            raise ProtocolError(f"no data within {self.timeout:g} s") from None
        return data.decode("utf-8", errors="replace")

    def send_int(self, *values: int) -> None:
        for value in values:
            self.writer.write(_INT.pack(value))

    def send_str(self, text: str) -> None:
        data = text.encode()
        self.writer.write(_INT.pack(len(data)) + data)


def labelled(label: object, text: str) -> str:
    """A worker's printed ``text`` as the tracker shows it: every line starts with ``[rank
    r]`` (or the task id before a rank), as the launcher labels the worker's own output; a
    trailing newline adds no empty line."""
    return "\n".join(f"[rank {label}] {line}" for line in text.rstrip("\n").split("\n"))


@dataclass(slots=True)
class _Waiting:
    host: str
    port: int
    accepts: int  # connections it still waits for


@dataclass
class ClassicJob:
    """The state of a job of classic workers: ranks by task id, who waits for whom."""

    n_workers: int
    print_fn: Callable[[str], None]
    on_done: Callable[[], None]
    sort_key: Callable[[str], Any] | None = None  # task id -> order (None: arrival)
    timeout: float = 30.0
    on_rank: Callable[[str, int], None] | None = None  # a task was given its rank
    on_joined: Callable[[str], None] | None = None  # a task started (or restarted)
    on_finished: Callable[[str], None] | None = None  # a task shut down
    ranks: dict[str, int] = field(default_factory=dict)  # task id -> rank
    finished: set[int] = field(default_factory=set)
    restarts: dict[str, int] = field(default_factory=dict)  # task id -> starts after the first
    addresses: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> listening
    _waiting: dict[int, _Waiting] = field(default_factory=dict)
    _pending: list[tuple[str, str, _Wire]] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _anonymous: set[int] = field(default_factory=set)  # ranks of "NULL" task ids

    @property
    def started(self) -> bool:
        """Whether the job is one of classic workers: a rank was handed out, or a start
        waits for the others (one that left while it waited does not count)."""
        return bool(self.ranks or self._anonymous or self._pending)

    def status(self) -> list[dict[str, Any]]:
        """The tasks, as ``Tracker.status`` lists its own (a classic worker holds no tracker
        connection between its commands: never "connected")."""
        return [
            {"task_id": task_id, "rank": rank, "incarnation": self.restarts.get(task_id, 0),
             "attempt": self.restarts.get(task_id, 0),
             "host": self.addresses.get(rank, ("", 0))[0],
             "port": self.addresses.get(rank, ("", 0))[1], "connected": False,
             "finished": rank in self.finished, "losses": self.restarts.get(task_id, 0)}
            for task_id, rank in sorted([*self.ranks.items(),
                                         *(("NULL", r) for r in self._anonymous)],
                                        key=lambda item: item[1])
        ]

    def abort(self) -> None:
        """The job ended in failure.  A worker parked until every worker has started would
        wait for good (the classic protocol has no abort message): its connection is closed,
        which ends its start with an error at once.  Workers past their start are left to end
        by themselves; later starts are refused by the caller."""
        pending, self._pending = self._pending, []
        for task_id, _host, wire in pending:
            logger.info("classic task %s: its start ends with the job", task_id)
            wire.writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    host: str) -> None:
        """One classic connection, its magic already read.  Raises ProtocolError on a
        malformed message (the caller logs it and closes the connection)."""
        wire = _Wire(reader, writer, self.timeout)
        wire.writer.write(CLASSIC_MAGIC)
        rank = await wire.read_int()
        world = await wire.read_int()
        task_id = await wire.read_str()
        command = await wire.read_str()
        if command not in _COMMANDS:
            raise ProtocolError(f"unknown command {command!r}")
        if world not in (-1, self.n_workers):
            raise ProtocolError(f"worker expects world size {world}, job has {self.n_workers}")
        if command == "print":
            message = await wire.read_str()
            self.print_fn(labelled(rank if rank >= 0 else task_id, message.rstrip()))
            return
        if command in ("shutdown", "recover") and not self._holds(rank, task_id):
            # (a rank no worker was given cannot end the job, nor take a rank's place)
            raise ProtocolError(f"{command} from rank {rank} (task {task_id}), which no "
                                "worker of this job holds")
        if command == "shutdown":
            self.finished.add(rank)
            logger.info("classic rank %d (task %s) shut down", rank, task_id)
            if self.on_finished is not None and task_id != "NULL":
                self.on_finished(task_id)
            if len(self.finished) == self.n_workers:
                self.on_done()
            return
        known = self.ranks.get(task_id) if task_id != "NULL" else None
        if rank < 0 and known is None:
            await self._start(task_id, host, wire)
            return
        target = rank if rank >= 0 else known
        assert target is not None
        self._joined(task_id)
        if rank < 0:
            self.restarts[task_id] = self.restarts.get(task_id, 0) + 1
        self.finished.discard(target)
        # a restarted process, or one re-wiring all its links (recover): whatever it waited
        # for before is gone with its old sockets, and a peer told to dial that would fail
        self._waiting.pop(target, None)
        async with self._lock:
            await self._wire_up(wire, target, host)

    async def _start(self, task_id: str, host: str, wire: _Wire) -> None:
        """A task's first start: parked until every worker has started, then all are given
        their ranks in task order."""
        if task_id != "NULL":
            # a task that starts again while its first start still waits: that one's
            # process is gone (a live worker starts once)
            for old in [e for e in self._pending if e[0] == task_id]:
                self._pending.remove(old)
                old[2].writer.close()
        if self._assigned() + len(self._pending) >= self.n_workers:
            raise ProtocolError(f"unknown task id {task_id!r}: the job already has "
                                f"{self.n_workers} workers")
        self._joined(task_id)
        entry = (task_id, host, wire)
        self._pending.append(entry)
        if len(self._pending) + self._assigned() == self.n_workers:
            await self._assign_pending()
            return
        # parked (it blocks reading its rank)
        try:
            await wire.writer.drain()
            kept = await _closed(wire)
        except OSError:
            kept = False
        if not kept and entry in self._pending:  # it left while it waited
            self._pending.remove(entry)
            logger.warning("classic task %s left before every worker had started", task_id)

    async def _assign_pending(self) -> None:
        pending, self._pending = self._pending, []
        if self.sort_key is not None:
            key = self.sort_key
            pending.sort(key=lambda p: key(p[0]))
        taken = {*self.ranks.values(), *self._anonymous}
        free = [r for r in range(self.n_workers) if r not in taken]
        async with self._lock:
            for (task_id, host, wire), rank in zip(pending, free, strict=True):
                if task_id != "NULL":
                    self.ranks[task_id] = rank
                else:
                    self._anonymous.add(rank)
                logger.info("classic task %s -> rank %d", task_id, rank)
                if self.on_rank is not None:
                    self.on_rank(task_id, rank)
                try:
                    await self._wire_up(wire, rank, host)
                except (ProtocolError, OSError) as exc:  # (the others are served all the same)
                    logger.warning("classic rank %d (task %s): %s", rank, task_id, exc)
                finally:
                    wire.writer.close()

    def _joined(self, task_id: str) -> None:
        """``task_id`` was let in (the launcher judges how its process ends by it)."""
        if self.on_joined is not None and task_id != "NULL":
            self.on_joined(task_id)

    def _holds(self, rank: int, task_id: str) -> bool:
        """Whether ``rank`` was handed out, to ``task_id`` (or to a task without an id)."""
        if task_id == "NULL":
            return rank in self._anonymous
        return self.ranks.get(task_id) == rank

    def _assigned(self) -> int:
        """How many ranks were handed out."""
        return len(self.ranks) + len(self._anonymous)

    async def _wire_up(self, wire: _Wire, rank: int, host: str) -> None:
        """Steps 7-19: the rank, its neighbours, whom to dial and how many to accept."""
        links = topology(rank, self.n_workers)
        tree = ([links.parent] if links.parent >= 0 else []) + list(links.children)
        prev = links.ring_prev if links.ring_prev != rank else -1
        nxt = links.ring_next if links.ring_next != rank else -1
        wire.send_int(rank, links.parent, self.n_workers, len(tree), *tree, prev, nxt)
        needed = set(tree) | ({prev, nxt} - {-1})
        while True:
            await wire.writer.drain()
            count = await wire.read_int()
            if not 0 <= count <= len(needed):
                raise ProtocolError(f"rank {rank} holds {count} links")
            good = {await wire.read_int() for _ in range(count)}
            if not good <= needed:
                raise ProtocolError(f"rank {rank} holds links to {sorted(good - needed)}, "
                                    "which are not its neighbours")
            bad = sorted(needed - good)
            dial = [r for r in bad if r in self._waiting]
            wire.send_int(len(dial), len(bad) - len(dial))
            for peer in dial:
                waiting = self._waiting[peer]
                wire.send_str(waiting.host)
                wire.send_int(waiting.port, peer)
            await wire.writer.drain()
            if await wire.read_int() == 0:
                break  # (else it failed to reach some: it says what it holds again)
        port = await wire.read_int()
        self.addresses[rank] = (host, port)
        for peer in dial:
            waiting = self._waiting[peer]
            waiting.accepts -= 1
            if waiting.accepts <= 0:
                del self._waiting[peer]
        accepts = len(bad) - len(dial)
        if accepts > 0:
            self._waiting[rank] = _Waiting(host, port, accepts)
        else:
            self._waiting.pop(rank, None)


async def _closed(wire: _Wire) -> bool:
    """Hold a parked connection open until the job assigns it (the assigning coroutine
    writes to it and closes it: True) or the worker goes away (False)."""
    while not wire.writer.is_closing():
        if wire.reader.at_eof():
            return False
        await asyncio.sleep(0.05)
    return True
