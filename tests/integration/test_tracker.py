"""Tracker, tracker client and the authenticated handshake, over real loopback sockets.

The async tests run on the loop pytest-asyncio provides; ``test_under_uvloop`` repeats the
core scenarios on uvloop, which the workers use by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import uvloop

from rabit2.config import Config
from rabit2.core.control import MAGIC, MAX_FRAME, encode_frame
from rabit2.core.topology import topology
from rabit2.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    JobAbortedError,
    PeerLostError,
    ProtocolError,
    RabitError,
    TrackerError,
)
from rabit2.io.assignment import Assignment
from rabit2.io.handshake import (
    RateLimitedLog,
    client_handshake,
    connect_authenticated,
    server_handshake,
    sock_read_exact,
    sock_read_frame,
    sock_write_frame,
)
from rabit2.io.tracker_client import TrackerClient
from rabit2.io.tracker_query import query_tracker_status
from tracker.classic import CLASSIC_MAGIC
from tracker.server import Tracker, TrackerThread, natural_key

pytestmark = pytest.mark.timeout(30)

SECRET = bytes(range(32))
HOST = "127.0.0.1"


class Prints:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


@pytest_asyncio.fixture
async def make_tracker() -> AsyncIterator[Callable[..., Any]]:
    trackers: list[Tracker] = []

    async def make(n: int, **kwargs: Any) -> Tracker:
        kwargs.setdefault("secret", SECRET)
        kwargs.setdefault("print_fn", Prints())
        tracker = Tracker(n, **kwargs)
        await tracker.start()
        trackers.append(tracker)
        return tracker

    yield make
    for tracker in trackers:
        await tracker.close()


def config(tracker: Tracker, task_id: str, **kwargs: Any) -> Config:
    values: dict[str, Any] = {
        "tracker_uri": HOST,
        "tracker_port": tracker.port,
        "task_id": task_id,
        "secret": SECRET,
        "heartbeat_sec": 0.2,
        "connect_retry": 1,
        "connect_timeout_sec": 5.0,
    }
    values.update(kwargs)
    return Config(**values)


async def join_job(tracker: Tracker, task_ids: list[str]) -> list[TrackerClient]:
    return list(await asyncio.gather(*(
        TrackerClient.connect(config(tracker, task_id), 20000 + int(natural_key(task_id)[-1][1]))
        for task_id in task_ids
    )))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def _wait_registered(tracker: Tracker, count: int) -> None:
    await wait_until(lambda: bool(tracker.status()["registered"] == count))


def check_consistent(assignments: list[Assignment], ports: dict[int, int]) -> None:
    """Every assignment matches the topology and names its neighbours' real addresses."""
    n = len(assignments)
    assert sorted(a.rank for a in assignments) == list(range(n))
    for a in assignments:
        links = topology(a.rank, n)
        assert (a.world_size, a.parent, a.children, a.ring_prev, a.ring_next) == (
            n, links.parent, links.children, links.ring_prev, links.ring_next)
        assert a.peers == {r: (HOST, ports[r]) for r in links.neighbors}


# -- handshake ----------------------------------------------------------------------------


async def _pair() -> tuple[socket.socket, socket.socket]:
    left, right = socket.socketpair()
    left.setblocking(False)
    right.setblocking(False)
    return left, right


@pytest.mark.asyncio
async def test_handshake_reads_nothing_past_itself() -> None:
    await _handshake_reads_nothing_past_itself()


async def _handshake_reads_nothing_past_itself() -> None:
    loop = asyncio.get_running_loop()
    client, server = await _pair()
    deadline = loop.time() + 5

    async def client_side() -> dict[str, Any]:
        welcome = await client_handshake(loop, client, SECRET, {"rank": 3}, deadline)
        await loop.sock_sendall(client, b"DATA")  # first bytes after the handshake
        return welcome

    hello, welcome = await asyncio.gather(
        server_handshake(loop, server, SECRET, deadline, lambda h: {"seen": h["rank"]}),
        client_side(),
    )
    assert hello["rank"] == 3
    assert welcome == {"seen": 3}
    assert await sock_read_exact(loop, server, 4, deadline) == b"DATA"
    client.close()
    with pytest.raises(PeerLostError):
        await sock_read_exact(loop, server, 1, deadline)
    server.close()


@pytest.mark.asyncio
async def test_wrong_client_secret_refused() -> None:
    loop = asyncio.get_running_loop()
    client, server = await _pair()
    deadline = loop.time() + 5
    results = await asyncio.gather(
        server_handshake(loop, server, SECRET, deadline, lambda h: {}),
        client_handshake(loop, client, b"wrong", {}, deadline),
        return_exceptions=True,
    )
    assert all(isinstance(result, AuthenticationError) for result in results)
    assert client.fileno() == -1 and server.fileno() == -1  # closed on failure


@pytest.mark.asyncio
async def test_impostor_server_detected() -> None:
    """A server that does not know the secret cannot fake the ok (mutual authentication)."""
    loop = asyncio.get_running_loop()
    client, server = await _pair()
    deadline = loop.time() + 5

    async def impostor() -> None:
        await sock_read_exact(loop, server, len(MAGIC), deadline)
        await sock_write_frame(loop, server, {"t": "challenge", "nonce": b"n" * 16})
        auth = await sock_read_frame(loop, server, deadline)
        await sock_write_frame(loop, server, {"t": "ok", "mac": auth["mac"], "welcome": {}})

    results = await asyncio.gather(
        impostor(), client_handshake(loop, client, SECRET, {}, deadline), return_exceptions=True
    )
    assert results[0] is None
    assert isinstance(results[1], AuthenticationError)
    server.close()


@pytest.mark.asyncio
async def test_handshake_hello_refused_and_deadline() -> None:
    loop = asyncio.get_running_loop()
    client, server = await _pair()

    def refuse(hello: dict[str, Any]) -> dict[str, Any]:
        raise ProtocolError("rank 9 is not in this job")

    results = await asyncio.gather(
        server_handshake(loop, server, SECRET, loop.time() + 5, refuse),
        client_handshake(loop, client, SECRET, {}, loop.time() + 5),
        return_exceptions=True,
    )
    assert isinstance(results[0], ProtocolError)
    assert isinstance(results[1], ProtocolError)
    assert not isinstance(results[1], AuthenticationError)
    assert "rank 9" in str(results[1])

    client, server = await _pair()  # a silent client
    start = loop.time()
    with pytest.raises(CollectiveTimeoutError):
        await server_handshake(loop, server, SECRET, loop.time() + 0.3, lambda h: {})
    assert loop.time() - start < 2
    client.close()


# -- tracker: rendezvous ------------------------------------------------------------------


@pytest.mark.parametrize(("args", "kwargs", "error", "message"), [
    ((2,), {"secret": b""}, ValueError, "secret must not be empty"),
    ((2,), {"secret": "00ff"}, TypeError, "secret must be bytes, got str"),
    (("2",), {}, TypeError, "'str' object cannot be interpreted as an integer"),
    ((True,), {}, TypeError, "n_workers must be an int, got bool"),
])
def test_a_tracker_refuses_a_key_that_authenticates_nobody_and_a_size_that_is_no_int(
        args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception],
        message: str) -> None:
    with pytest.raises(error, match=message):
        TrackerThread(*args, **kwargs)
    # (left out: a random key, handed on by worker_env; a numpy integer is a size)
    assert len(Tracker(np.int64(2)).worker_env()["RABIT2_SECRET"]) == 64

@pytest.mark.asyncio
async def test_ranks_by_natural_task_order(make_tracker: Callable[..., Any]) -> None:
    await _ranks_by_natural_task_order(await make_tracker(5))


async def _ranks_by_natural_task_order(tracker: Tracker) -> None:
    task_ids = ["10", "2", "0", "1", "3"]
    random.Random(1).shuffle(task_ids)
    clients = await join_job(tracker, task_ids)
    assignments = await asyncio.gather(*(c.wait_assignment(5) for c in clients))
    rank_of = {task: a.rank for task, a in zip(task_ids, assignments, strict=True)}
    assert rank_of == {"0": 0, "1": 1, "2": 2, "3": 3, "10": 4}
    ports = {rank: 20000 + int(task) for task, rank in rank_of.items()}
    check_consistent(list(assignments), ports)
    assert all(a.incarnation == 0 for a in assignments)
    await asyncio.gather(*(c.shutdown(5) for c in clients))
    result = await tracker.wait_done(5)
    assert result.success
    assert result.status["finished"] == 5 and result.status["done"]


@pytest.mark.asyncio
async def test_sortby_arrival_and_status_query(make_tracker: Callable[..., Any]) -> None:
    tracker = await make_tracker(3, sortby="arrival")
    clients = []
    for task_id in ["c", "a", "b"]:
        clients.append(await TrackerClient.connect(config(tracker, task_id), 21000))
        await _wait_registered(tracker, len(clients))
    status = await query_tracker_status(HOST, tracker.port, SECRET, 5)
    assert [t["task_id"] for t in status["tasks"]] == ["c", "a", "b"]
    assert [t["rank"] for t in status["tasks"]] == [0, 1, 2]
    one = await query_tracker_status(HOST, tracker.port, SECRET, 5, task_id="a")
    assert [t["task_id"] for t in one["tasks"]] == ["a"] and one["registered"] == 3
    none = await query_tracker_status(HOST, tracker.port, SECRET, 5, task_id="zz")
    assert none["tasks"] == [] and none["registered"] == 3
    assignments = [await c.wait_assignment(5) for c in clients]
    assert [a.rank for a in assignments] == [0, 1, 2]
    with pytest.raises(TrackerError):
        await query_tracker_status(HOST, tracker.port, b"wrong", 5)
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_restart_gets_old_rank_and_next_incarnation(
    make_tracker: Callable[..., Any],
) -> None:
    lost: list[tuple[str, int | None, str]] = []
    tracker = await make_tracker(2, rejoin_grace=0.1)  # (a close is a death here)
    tracker.on_worker_lost = lambda task, rank, reason: lost.append((task, rank, reason))
    survivor, victim = await join_job(tracker, ["0", "1"])
    notices: list[tuple[str, int, int, object]] = []
    survivor.on_peer_lost = lambda r, inc, why: notices.append(("lost", r, inc, why))
    survivor.on_peer_recovered = lambda r, inc, addr: notices.append(("recovered", r, inc, addr))
    first = await victim.wait_assignment(5)
    await survivor.wait_assignment(5)
    await victim.close()  # dies without shutdown
    await wait_until(lambda: bool(lost))
    assert lost[0][:2] == ("1", 1)
    await wait_until(lambda: bool(notices))
    assert notices[0][:3] == ("lost", 1, 0)

    restarted = await TrackerClient.connect(config(tracker, "1", num_attempt=1), 23456)
    second = await restarted.wait_assignment(5)
    assert second.rank == first.rank == 1
    assert second.incarnation == 1
    assert second.peers == first.peers
    await wait_until(lambda: len(notices) == 2)
    assert notices[1] == ("recovered", 1, 1, (HOST, 23456))
    status = tracker.status()
    assert status["tasks"][1]["incarnation"] == 1 and status["tasks"][1]["attempt"] == 1
    assert status["tasks"][1]["losses"] == 1 and status["tasks"][0]["losses"] == 0
    assert (status["restarts"], status["failures"]) == (1, 1)
    await asyncio.gather(survivor.shutdown(5), restarted.shutdown(5))
    assert (await tracker.wait_done(5)).success


@pytest.mark.asyncio
async def test_a_supervisor_reporting_the_exit_ends_the_rejoin_grace(
    make_tracker: Callable[..., Any],
) -> None:
    """A worker's connection ends (its process died) while the rejoin grace is 10 s: a
    supervisor's ``exited`` report about another run changes nothing, one about the run
    that registered makes it lost at once, and its neighbour hears of it then."""
    tracker = await make_tracker(2, rejoin_grace=10.0)
    survivor, victim = await join_job(tracker, ["0", "1"])
    await asyncio.gather(survivor.wait_assignment(5), victim.wait_assignment(5))
    notices: list[tuple[int, int]] = []
    survivor.on_peer_lost = lambda r, inc, why: notices.append((r, inc))
    await victim.close()  # dies without shutdown
    await wait_until(lambda: tracker._registry.tasks["1"].pending_loss is not None)
    status = await query_tracker_status(HOST, tracker.port, SECRET, 5, task_id="1",
                                        exited=("1", 3))
    assert status["failures"] == 0
    await asyncio.sleep(0.3)
    assert not notices
    status = await query_tracker_status(HOST, tracker.port, SECRET, 5, task_id="1",
                                        exited=("1", 0))
    assert status["failures"] == 1  # (handled before the status was made)
    await wait_until(lambda: bool(notices), timeout=5.0)
    assert notices == [(1, 0)]
    await survivor.close()


@pytest.mark.asyncio
async def test_a_worker_whose_connection_breaks_rejoins_without_a_loss(
    make_tracker: Callable[..., Any],
) -> None:
    """The tracker's end of a worker's connection is reset (a blip on the path): the worker
    dials again and rejoins as the same task, rank and incarnation, and nobody hears of a
    loss; what it prints then arrives; the job then ends normally."""
    tracker = await make_tracker(2)
    lost: list[str] = []
    tracker.on_worker_lost = lambda task, rank, reason: lost.append(task)
    first, second = await join_job(tracker, ["0", "1"])
    await asyncio.gather(first.wait_assignment(5), second.wait_assignment(5))
    notices: list[object] = []
    first.on_peer_lost = lambda *args: notices.append(args)
    aborts: list[str] = []
    second.on_abort = aborts.append
    conn = tracker._registry.tasks["1"].conn
    assert conn is not None
    conn.writer.transport.abort()
    await wait_until(lambda: tracker._registry.tasks["1"].conn not in (None, conn))
    second.print("said while the connection was down")  # (over the new one)
    prints = tracker._print_fn
    assert isinstance(prints, Prints)
    await wait_until(lambda: any("said while the connection was down" in line
                                 for line in prints.lines))
    await asyncio.sleep(0.3)
    assert not lost and not notices and not aborts
    status = tracker.status()
    assert status["failures"] == 0 and status["restarts"] == 0
    await asyncio.gather(first.shutdown(5), second.shutdown(5))
    assert (await tracker.wait_done(5)).success


@pytest.mark.asyncio
async def test_a_rejoin_after_the_grace_or_of_another_incarnation_is_refused(
    make_tracker: Callable[..., Any],
) -> None:
    tracker = await make_tracker(2, rejoin_grace=0.2)
    first, second = await join_job(tracker, ["0", "1"])
    await asyncio.gather(first.wait_assignment(5), second.wait_assignment(5))

    async def rejoin(incarnation: int) -> str:
        sock, _ = await connect_authenticated(HOST, tracker.port, SECRET,
                                              {"role": "worker", "task_id": "1"}, 5)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(encode_frame({"t": "rejoin", "task_id": "1", "rank": 1,
                                   "incarnation": incarnation, "port": 20001, "attempt": 0}))
        data = await asyncio.wait_for(reader.read(65536), 5)
        writer.close()
        return data.decode(errors="replace")

    assert "no such worker" in await rejoin(7)
    await second.close()  # its process died: no rejoin comes
    await wait_until(lambda: tracker.status()["failures"] == 1)
    assert "was declared lost" in await rejoin(0)
    await first.close()


@pytest.mark.asyncio
async def test_zombie_connection_is_fenced(make_tracker: Callable[..., Any]) -> None:
    """A restart (a later attempt) of a task whose old connection still looks open: the
    newer process wins, and the old one's connection is closed."""
    tracker = await make_tracker(1)
    (old,) = await join_job(tracker, ["0"])
    reasons: list[str] = []
    old.on_abort = reasons.append
    await old.wait_assignment(5)
    new = await TrackerClient.connect(config(tracker, "0", num_attempt=1), 20001)
    assert (await new.wait_assignment(5)).incarnation == 1
    await wait_until(lambda: bool(reasons))  # the tracker closed the old process's link
    assert "lost the tracker connection" in reasons[0]
    await new.shutdown(5)
    await old.close()


@pytest.mark.asyncio
async def test_a_second_process_of_a_live_task_is_refused_not_taken_for_its_restart(
        make_tracker: Callable[..., Any]) -> None:
    """The same task id and attempt while that task's worker heartbeats (a worker launched
    twice): refused, and the running one goes on, instead of being fenced off and failing
    its job."""
    tracker = await make_tracker(1)
    (live,) = await join_job(tracker, ["0"])
    reasons: list[str] = []
    live.on_abort = reasons.append
    await live.wait_assignment(5)
    twin = await TrackerClient.connect(config(tracker, "0"), 20002)
    with pytest.raises(TrackerError, match=r"rank 0 \(task 0\) runs already \(attempt 0, "
                                           r"heard from .* is not its restart"):
        await twin.wait_assignment(5)
    await asyncio.sleep(0.5)  # (a few heartbeats)
    assert not reasons
    await live.shutdown(5)
    await twin.close()


@pytest.mark.asyncio
async def test_extra_and_mismatched_registrations_refused(
    make_tracker: Callable[..., Any],
) -> None:
    tracker = await make_tracker(1)
    (member,) = await join_job(tracker, ["0"])
    await member.wait_assignment(5)
    stranger = await TrackerClient.connect(config(tracker, "7"), 20007)
    with pytest.raises(TrackerError, match="already has 1 tasks"):
        await stranger.wait_assignment(5)
    wrong_size = await TrackerClient.connect(config(tracker, "0", world_size=4), 20008)
    with pytest.raises(TrackerError, match="world size"):
        await wrong_size.wait_assignment(5)
    for client in (member, stranger, wrong_size):
        await client.close()


# -- tracker: robustness ------------------------------------------------------------------


async def _raw_connection(port: int, payload: bytes) -> float:
    """Send ``payload`` and return how long the tracker took to close the connection."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(HOST, port)
    start = loop.time()
    writer.write(payload)
    try:
        async with asyncio.timeout(10):
            while await reader.read(4096):
                pass  # the challenge, maybe a refuse; then EOF
    except ConnectionResetError:
        pass  # closed while our unread bytes were still queued: a reset, not a FIN
    writer.close()
    return loop.time() - start


async def _authenticated_garbage(port: int, payload: bytes) -> bool:
    """Authenticate as a monitor, then send ``payload``; True once the tracker closed us."""
    loop = asyncio.get_running_loop()
    sock, _ = await connect_authenticated(HOST, port, SECRET, {"role": "monitor"}, 5)
    await loop.sock_sendall(sock, payload)
    try:
        while await asyncio.wait_for(loop.sock_recv(sock, 4096), 10):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    return True


@pytest.mark.asyncio
async def test_bad_connections_do_not_disturb_the_job(
    make_tracker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rabit2.tracker")
    tracker = await make_tracker(3, handshake_timeout=0.5)
    bad_secret = config(tracker, "9", secret=b"not the secret")
    attacks = asyncio.gather(
        _raw_connection(tracker.port, os.urandom(64)),
        _raw_connection(tracker.port, b"GET / HTTP/1.1\r\n\r\n"),
        _raw_connection(tracker.port, MAGIC + struct.pack("<I", 0xFFFFFFFF)),
        _raw_connection(tracker.port, MAGIC + struct.pack("<I", MAX_FRAME + 1) + b"x" * 100),
        _raw_connection(tracker.port, b""),  # silent
        _raw_connection(tracker.port, MAGIC),  # silent after the magic
        _authenticated_garbage(tracker.port, struct.pack("<I", 1 << 30)),
        _authenticated_garbage(tracker.port, b"\x03\x00\x00\x00\xc1\xc1\xc1"),
        _authenticated_garbage(tracker.port, encode_frame({"t": "shutdown", "hold": False})),
        TrackerClient.connect(bad_secret, 20009),
        return_exceptions=True,
    )
    clients = await join_job(tracker, ["0", "1", "2"])
    assignments = await asyncio.gather(*(c.wait_assignment(5) for c in clients))
    check_consistent(list(assignments), {0: 20000, 1: 20001, 2: 20002})
    await asyncio.gather(*(c.shutdown(5) for c in clients))
    assert (await tracker.wait_done(5)).success
    results = await attacks
    durations = results[:6]
    assert all(isinstance(d, float) and d < 3 for d in durations), results
    assert results[6:9] == [True, True, True]
    assert isinstance(results[9], TrackerError) and "RABIT2_SECRET" in str(results[9])
    log = caplog.text
    for reason in ("wrong magic", "exceeds", "undecodable", "failed authentication",
                   "deadline", "may only send status"):
        assert reason in log, reason


@pytest.mark.asyncio
async def test_a_stranger_gets_little_memory_and_short_log_lines(
    make_tracker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Before it authenticates, a peer's ``auth`` frame may be 64 KiB (a declared 1 MiB was
    set aside for each pending handshake); a peer's values are quoted in at most 200
    characters, control characters escaped (a 10 KB role made a 10 KB line); the classic
    protocol's refusals are rate-limited as the others (one line each)."""
    caplog.set_level(logging.WARNING, logger="rabit2.tracker")
    tracker = await make_tracker(2)
    reader, writer = await asyncio.open_connection(HOST, tracker.port)
    writer.write(MAGIC + struct.pack("<I", 1 << 20) + b"x")
    await writer.drain()
    with contextlib.suppress(ConnectionResetError):
        while await asyncio.wait_for(reader.read(4096), 5):
            pass  # (the challenge, then the close)
    writer.close()
    with pytest.raises(RabitError, match=r"hello\.role must be"):
        await connect_authenticated(HOST, tracker.port, SECRET, {"role": "x\n" * 5000}, 5)
    garbage = (CLASSIC_MAGIC + struct.pack("<ii", -1, -1) + struct.pack("<i", 5) + b"ttttt"
               + struct.pack("<i", -9))
    for _ in range(30):
        reader, writer = await asyncio.open_connection(HOST, tracker.port)
        writer.write(garbage)
        await writer.drain()
        with contextlib.suppress(ConnectionResetError):
            await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
    await asyncio.sleep(0.2)
    messages = [record.getMessage() for record in caplog.records]
    assert any("frame of 1048576 bytes where at most 65536" in m for m in messages), messages
    assert max(len(m) for m in messages) < 1000, max(messages, key=len)[:300]
    assert not any("\n" in m for m in messages)
    assert sum("classic rabit worker from" in m for m in messages) <= 10, messages


@pytest.mark.asyncio
async def test_a_registration_gets_in_under_a_flood_of_idle_connections(
    make_tracker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """100 silent connections (more than the tracker's 4n+64 handshakes in flight) held
    open: the workers still register (the oldest unfinished handshake makes room for each
    newcomer), and the refusals are logged a few lines at a time, not once each."""
    caplog.set_level(logging.WARNING, logger="rabit2.tracker")
    tracker = await make_tracker(2, handshake_timeout=60)
    flood = [await asyncio.open_connection(HOST, tracker.port) for _ in range(100)]
    try:
        clients = await join_job(tracker, ["0", "1"])
        assignments = await asyncio.gather(*(c.wait_assignment(5) for c in clients))
        assert sorted(a.rank for a in assignments) == [0, 1]
        await asyncio.gather(*(c.shutdown(5) for c in clients))
        assert (await tracker.wait_done(5)).success
    finally:
        for _, writer in flood:
            writer.close()
    dropped = caplog.text.count("dropped the oldest of")
    assert 1 <= dropped <= 10, caplog.text  # 28+ drops, at most 10 lines per 10 s


def test_after_a_burst_of_idle_connections_every_handshake_gets_in_again() -> None:
    """A burst of connections (from another process, as fast as it can) accepted before any
    handler ran: the handlers cancelled to make room never ran, and the count of
    handshakes in flight kept them for good, so that later handshakes were dropped to
    admit one another.  Once the burst is gone, 30 at once all get in."""
    tracker = TrackerThread(2, secret=SECRET)
    tracker.start()
    port = int(tracker.worker_env()["DMLC_TRACKER_PORT"])
    try:
        burst = ("import socket, time\n"
                 f"s = [socket.create_connection(('127.0.0.1', {port})) for _ in range(400)]\n"
                 "time.sleep(1)\n")
        subprocess.run([sys.executable, "-c", burst], check=True, timeout=60)
        time.sleep(0.5)

        async def thirty() -> list[Any]:
            return await asyncio.gather(*(
                query_tracker_status(HOST, port, SECRET, 10) for _ in range(30)),
                return_exceptions=True)

        answers = asyncio.run(thirty())
        failed = [a for a in answers if isinstance(a, BaseException)]
        assert not failed, failed[:3]
    finally:
        tracker.stop()


def test_refusal_warnings_are_rate_limited() -> None:
    lines: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("rabit2.tracker.test-rate")
    log.addHandler(Sink())
    log.propagate = False
    now = [0.0]
    limited = RateLimitedLog(log, burst=3, period=10.0, clock=lambda: now[0])
    for i in range(50):
        limited.warning("refused %d", i)
    assert lines == ["refused 0", "refused 1", "refused 2"]
    now[0] = 10.5
    limited.warning("refused %d", 50)
    assert lines[3:] == ["47 more refused connections like the above in 10 s", "refused 50"]


@pytest.mark.asyncio
async def test_heartbeat_timeout_means_lost(make_tracker: Callable[..., Any]) -> None:
    lost: list[str] = []
    tracker = await make_tracker(1, heartbeat_timeout=0.5)
    tracker.on_worker_lost = lambda task, rank, reason: lost.append(reason)
    quiet = await TrackerClient.connect(config(tracker, "0"), 20000)
    quiet._heartbeat_task.cancel()  # (a paused process: connected, silent)
    await quiet.wait_assignment(5)
    await wait_until(lambda: bool(lost), timeout=3)
    assert "no message" in lost[0]
    await quiet.close()

    lost.clear()
    chatty = await TrackerClient.connect(config(tracker, "0", heartbeat_sec=0.1), 20000)
    await chatty.wait_assignment(5)
    await asyncio.sleep(1.2)
    assert lost == []
    await chatty.shutdown(5)


# -- tracker: prints, errors, aborts ------------------------------------------------------


@pytest.mark.asyncio
async def test_print_relay_keeps_order(make_tracker: Callable[..., Any]) -> None:
    prints = Prints()
    tracker = await make_tracker(2, print_fn=prints)
    clients = await join_job(tracker, ["0", "1"])
    await asyncio.gather(*(c.wait_assignment(5) for c in clients))
    for i in range(20):
        clients[1].print(f"line {i}")
    clients[0].print("x" * (1 << 20))  # truncated, not fatal
    await asyncio.gather(*(c.shutdown(5) for c in clients))
    mine = [line for line in prints.lines if line.startswith("[rank 1] ")]
    assert mine == [f"[rank 1] line {i}" for i in range(20)]
    assert any(line.startswith("[rank 0] xxx") and line.endswith("[truncated]")
               for line in prints.lines)
    assert tracker.status()["prints"] == 21


@pytest.mark.asyncio
async def test_signal_error_aborts_everyone_else(make_tracker: Callable[..., Any]) -> None:
    tracker = await make_tracker(3)
    clients = await join_job(tracker, ["0", "1", "2"])
    await asyncio.gather(*(c.wait_assignment(5) for c in clients))
    reasons: dict[int, str] = {}
    for i, client in enumerate(clients):
        client.on_abort = lambda reason, i=i: reasons.__setitem__(i, reason)
    clients[2].signal_error("disk full")
    result = await tracker.wait_done(5)
    assert not result.success and "disk full" in result.reason
    await wait_until(lambda: len(reasons) == 2)
    assert set(reasons) == {0, 1}
    assert all("rank 2" in r and "disk full" in r for r in reasons.values())
    for client in clients:
        await client.shutdown(5)  # still acknowledged after an abort


@pytest.mark.asyncio
async def test_an_unreachable_live_rank_is_a_partition_and_ends_the_job(
        make_tracker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker says its link to a rank cannot be rebuilt.  A rank that has been quiet (dead
    or paused) is left to recovery; one that is heard from is alive, so the two cannot reach
    each other while both reach the tracker: the job is aborted, naming the link."""
    monkeypatch.setattr("tracker.registry._ALIVE_WITHIN_SEC", 0.5)
    tracker = await make_tracker(3)
    clients = list(await asyncio.gather(
        TrackerClient.connect(config(tracker, "0"), 20000),
        TrackerClient.connect(config(tracker, "1"), 20001),
        TrackerClient.connect(config(tracker, "2", heartbeat_sec=30.0), 20002)))  # quiet
    await asyncio.gather(*(c.wait_assignment(5) for c in clients))
    reasons: dict[int, str] = {}
    for i, client in enumerate(clients):
        client.on_abort = lambda reason, i=i: reasons.__setitem__(i, reason)
    await asyncio.sleep(0.8)
    clients[0].report_unreachable(2, "rank 0's link to rank 2 has been down for 15 s")
    await asyncio.sleep(0.3)
    assert not tracker.status()["done"] and not reasons  # left to recovery
    clients[0].report_unreachable(1, "rank 0's link to rank 1 has been down for 15 s")
    result = await tracker.wait_done(5)
    assert not result.success
    assert "ranks 0 and 1 cannot reach each other while both reach the tracker" in result.reason
    await wait_until(lambda: len(reasons) == 3)
    assert all("network partition" in r for r in reasons.values())
    for client in clients:
        await client.shutdown(5)


@pytest.mark.asyncio
async def test_huge_error_message_is_bounded(make_tracker: Callable[..., Any]) -> None:
    """A worker that is not our client sends a ~1 MiB error: the abort still goes out."""
    loop = asyncio.get_running_loop()
    tracker = await make_tracker(2)
    (member,) = await join_job(tracker, ["0"])
    reasons: list[str] = []
    member.on_abort = reasons.append
    sock, _ = await connect_authenticated(HOST, tracker.port, SECRET, {"role": "worker"}, 5)
    register = {"t": "register", "task_id": "1", "attempt": 0, "port": 1, "world_size": 2}
    error = {"t": "error", "msg": "E" * (MAX_FRAME - 100)}
    await loop.sock_sendall(sock, encode_frame(register) + encode_frame(error))
    result = await tracker.wait_done(5)
    assert not result.success and result.reason.endswith("[truncated]")
    await wait_until(lambda: bool(reasons))
    assert "signalled an error: EEE" in reasons[0]
    sock.close()
    await member.close()


@pytest.mark.asyncio
async def test_abort_before_assignment_and_late_joiner(make_tracker: Callable[..., Any]) -> None:
    tracker = await make_tracker(3)
    early = await join_job(tracker, ["0", "1"])
    early[0].signal_error("bad input file")
    with pytest.raises(JobAbortedError, match="bad input file"):
        await early[1].wait_assignment(5)
    late = await TrackerClient.connect(config(tracker, "2"), 20002)
    reasons: list[str] = []
    late.on_abort = reasons.append
    await wait_until(lambda: bool(reasons))
    assert "bad input file" in reasons[0]
    for client in [*early, late]:
        await client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["abort", "mark_failed"])
async def test_abort_is_pushed(make_tracker: Callable[..., Any], how: str) -> None:
    tracker = await make_tracker(2)
    clients = await join_job(tracker, ["0", "1"])
    await asyncio.gather(*(c.wait_assignment(5) for c in clients))
    reasons: list[str] = []
    for client in clients:
        client.on_abort = reasons.append
    if how == "abort":
        tracker.abort("operator said stop")
        expected = "operator said stop"
    else:
        tracker.mark_failed("1", "exit code 1 after 3 attempts")
        expected = "rank 1 (task 1) failed for good: exit code 1 after 3 attempts"
    await wait_until(lambda: len(reasons) == 2)
    assert all(expected in r for r in reasons)
    assert not (await tracker.wait_done(1)).success
    for client in clients:
        await client.close()


@pytest.mark.asyncio
async def test_tracker_loss_is_reported(make_tracker: Callable[..., Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rabit2.io.tracker_client.REJOIN_SEC", 2.0)
    tracker = await make_tracker(1)
    (client,) = await join_job(tracker, ["0"])
    await client.wait_assignment(5)
    reasons: list[str] = []
    client.on_abort = reasons.append
    await tracker.close()
    await wait_until(lambda: bool(reasons), timeout=10)  # (after trying to rejoin for 2 s)
    assert "lost the tracker connection" in reasons[0]
    assert "could not reach it again within 2 s" in reasons[0]
    with pytest.raises(TrackerError):
        await client.shutdown(1)


@pytest.mark.asyncio
async def test_connect_failures(make_tracker: Callable[..., Any]) -> None:
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind((HOST, 0))
        free_port = probe.getsockname()[1]
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TrackerError, match="after 2 attempts"):
        await TrackerClient.connect(
            Config(tracker_uri=HOST, tracker_port=free_port, connect_retry=2), 20000)
    assert loop.time() - start < 3
    with pytest.raises(TrackerError, match="no tracker"):
        await TrackerClient.connect(Config(), 20000)
    tracker = await make_tracker(2)
    (lonely,) = await join_job(tracker, ["0"])
    with pytest.raises(CollectiveTimeoutError):
        await lonely.wait_assignment(0.3)
    await lonely.close()


def test_under_uvloop() -> None:
    async def scenarios() -> None:
        await _handshake_reads_nothing_past_itself()
        tracker = Tracker(5, secret=SECRET, print_fn=Prints())
        await tracker.start()
        try:
            await _ranks_by_natural_task_order(tracker)
        finally:
            await tracker.close()

    uvloop.run(scenarios())


# -- synchronous wrappers -----------------------------------------------------------------


def test_tracker_thread() -> None:
    prints = Prints()
    thread = TrackerThread(2, secret=SECRET, print_fn=prints)
    thread.start()
    try:
        env = thread.worker_env()
        assert env["DMLC_TRACKER_URI"] == HOST and env["DMLC_NUM_WORKER"] == "2"
        assert bytes.fromhex(env["RABIT2_SECRET"]) == SECRET
        assert thread.join(0.05) is None

        async def job() -> None:
            cfgs = [Config(tracker_uri=HOST, tracker_port=int(env["DMLC_TRACKER_PORT"]),
                           task_id=str(i), secret=SECRET) for i in range(2)]
            clients = [await TrackerClient.connect(c, 20000 + i) for i, c in enumerate(cfgs)]
            await asyncio.gather(*(c.wait_assignment(5) for c in clients))
            clients[0].print("from the other loop")
            await asyncio.gather(*(c.shutdown(5) for c in clients))

        asyncio.run(job())
        result = thread.join(5)
        assert result is not None and result.success
        assert thread.rank_of("1") == 1
        assert prints.lines == ["[rank 0] from the other loop"]
    finally:
        thread.stop()


def test_natural_key() -> None:
    ids = ["10", "9", "task10", "task2", "b", "a", "1"]
    assert sorted(ids, key=natural_key) == ["1", "9", "10", "a", "b", "task2", "task10"]


def test_tracker_cli_success() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.cli", "--n", "1", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "DMLC_TRACKER_ENV_START"
        env: dict[str, str] = {}
        for line in proc.stdout:
            if line.strip() == "DMLC_TRACKER_ENV_END":
                break
            key, _, value = line.strip().partition("=")
            env[key] = value
        assert len(bytes.fromhex(env["RABIT2_SECRET"])) == 32  # generated when not given

        async def worker() -> None:
            cfg = Config(tracker_uri=env["DMLC_TRACKER_URI"],
                         tracker_port=int(env["DMLC_TRACKER_PORT"]), task_id="0",
                         secret=bytes.fromhex(env["RABIT2_SECRET"]))
            client = await TrackerClient.connect(cfg, 20000)
            assert (await client.wait_assignment(5)).world_size == 1
            # --query: the running tracker's status, with the job secret from the env
            where = f"{env['DMLC_TRACKER_URI']}:{env['DMLC_TRACKER_PORT']}"
            query = [sys.executable, "-m", "tracker.cli", "--query", where]
            asked = await asyncio.to_thread(
                subprocess.run, query, capture_output=True, text=True, timeout=30,
                check=False, env={**os.environ, "RABIT2_SECRET": env["RABIT2_SECRET"]})
            assert asked.returncode == 0, asked.stderr
            status = json.loads(asked.stdout)
            assert status["registered"] == 1 and status["tasks"][0]["rank"] == 0
            assert not status["done"] and status["failures"] == 0
            refused = await asyncio.to_thread(
                subprocess.run, [*query, "--secret", "ab" * 32], capture_output=True,
                text=True, timeout=30, check=False)
            assert refused.returncode == 1 and "cannot query the tracker" in refused.stderr
            await client.shutdown(5)

        asyncio.run(worker())
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.asyncio
async def test_a_held_shutdown_waits_for_every_rank(make_tracker: Callable[..., Any]) -> None:
    """Recovery on: a finished worker holds (bye only once every rank finished) and still
    hears about a neighbour that dies and comes back meanwhile."""
    tracker = await make_tracker(2, rejoin_grace=0.1)  # (a close is a death here)
    lost: list[tuple[str, int | None, str]] = []
    tracker.on_worker_lost = lambda task, rank, reason: lost.append((task, rank, reason))
    early, late = await join_job(tracker, ["0", "1"])
    await asyncio.gather(early.wait_assignment(5), late.wait_assignment(5))
    notices: list[tuple[str, int, int]] = []
    early.on_peer_lost = lambda r, inc, why: notices.append(("lost", r, inc))
    early.on_peer_recovered = lambda r, inc, addr: notices.append(("recovered", r, inc))
    held = asyncio.ensure_future(early.shutdown(5, hold=True))
    await wait_until(lambda: tracker.status()["finished"] == 1)
    await late.close()  # rank 1 dies after its last collective
    await wait_until(lambda: notices == [("lost", 1, 0)])
    assert lost and lost[0][:2] == ("1", 1) and not held.done()
    restarted = await TrackerClient.connect(config(tracker, "1", num_attempt=1), 23457)
    await restarted.wait_assignment(5)
    await wait_until(lambda: notices[-1] == ("recovered", 1, 1))
    assert not held.done()
    await restarted.shutdown(5, hold=True)  # the last one: bye to both
    await asyncio.wait_for(held, 5)
    result = await tracker.wait_done(5)
    assert result.success, result


@pytest.mark.asyncio
async def test_a_held_worker_that_dies_is_lost_and_may_rejoin(
    make_tracker: Callable[..., Any],
) -> None:
    tracker = await make_tracker(2, rejoin_grace=0.1)  # (a close is a death here)
    lost: list[tuple[str, int | None, str]] = []
    tracker.on_worker_lost = lambda task, rank, reason: lost.append((task, rank, reason))
    victim, other = await join_job(tracker, ["0", "1"])
    await asyncio.gather(victim.wait_assignment(5), other.wait_assignment(5))
    notices: list[tuple[int, int]] = []
    other.on_peer_lost = lambda r, inc, why: notices.append((r, inc))
    held = asyncio.ensure_future(victim.shutdown(30, hold=True))
    await wait_until(lambda: tracker.status()["finished"] == 1)
    held.cancel()
    await victim.close()  # it dies while it holds
    await wait_until(lambda: notices == [(0, 0)])
    assert lost[0][:2] == ("0", 0) and tracker.status()["finished"] == 0
    again = await TrackerClient.connect(config(tracker, "0", num_attempt=1), 23458)
    assert (await again.wait_assignment(5)).incarnation == 1
    await asyncio.gather(again.shutdown(5, hold=True), other.shutdown(5, hold=True))
    assert (await tracker.wait_done(5)).success


@pytest.mark.asyncio
async def test_a_held_shutdown_ends_with_an_abort_or_its_deadline(
    make_tracker: Callable[..., Any],
) -> None:
    tracker = await make_tracker(3)
    a, b, c = await join_job(tracker, ["0", "1", "2"])
    await asyncio.gather(*(x.wait_assignment(5) for x in (a, b, c)))
    held = asyncio.ensure_future(a.shutdown(30, hold=True))
    t0 = time.monotonic()
    await b.shutdown(0.3, hold=True)  # nobody else finishes in time: it leaves, bounded
    assert time.monotonic() - t0 < 5
    await wait_until(lambda: tracker.status()["finished"] == 2)
    tracker.mark_failed("2", "exit code 1 after 3 attempts")
    with pytest.raises(JobAbortedError, match="failed for good"):
        await asyncio.wait_for(held, 5)
    await c.close()
    assert not (await tracker.wait_done(5)).success


def test_the_tracker_reads_a_secret_as_the_workers_do() -> None:
    """Hex is decoded, other text used as UTF-8 (rabit2.config's rule for RABIT2_SECRET)."""
    from tracker.cli import parse_args  # noqa: PLC0415

    assert parse_args(["--n", "2", "--secret", "00ff"]).secret == b"\x00\xff"
    assert parse_args(["--n", "2", "--secret", "pässwörd"]).secret == "pässwörd".encode()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--n is required"),
        (["--n", "0"], "--n must be >= 1"),
        (["--n", "2", "--secret", ""], "must not be empty"),
        (["--query", "nohostport"], "HOST:PORT"),
        (["--query", "h:0"], "HOST:PORT"),
        (["--query", "h:99999"], "HOST:PORT"),
        (["--query", "h:1", "--query-timeout", "0"], "must be > 0"),
    ],
)
def test_tracker_cli_usage_errors(argv: list[str], message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tracker.cli import parse_args  # noqa: PLC0415

    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_tracker_cli_query_of_no_tracker_fails_typed() -> None:
    """Nothing listens there: exit 1 with the reason, within the timeout."""
    import socket  # noqa: PLC0415

    with socket.socket() as probe:  # a free port on loopback, closed again
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "tracker.cli", "--query", f"127.0.0.1:{port}",
                           "--secret", "ab", "--query-timeout", "2"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 1 and "cannot query the tracker" in done.stderr


def test_tracker_cli_query_of_something_else_says_it_may_not_be_a_tracker() -> None:
    """A listener that never answers the handshake (another service at that port): exit 1
    within the timeout, saying what to check; without a secret, that none was given."""
    import socket  # noqa: PLC0415

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        for secret, said in ((["--secret", "ab"], "(is that a rabit2 tracker, and its secret?)"),
                             ([], "(no secret was given: --secret or RABIT2_SECRET)")):
            done = subprocess.run(
                [sys.executable, "-m", "tracker.cli", "--query", target, *secret,
                 "--query-timeout", "1"], capture_output=True, text=True, timeout=30,
                check=False, env={k: v for k, v in os.environ.items() if k != "RABIT2_SECRET"})
            assert done.returncode == 1 and said in done.stderr, done.stderr


@pytest.mark.asyncio
async def test_a_bad_status_filter_closes_that_connection_only(
    make_tracker: Callable[..., Any],
) -> None:
    """status.task_id must be a str: anything else is refused, naming the field, and closes
    that monitor connection; the job goes on."""
    from rabit2.core.control import FrameDecoder, encode_frame  # noqa: PLC0415
    from rabit2.io.handshake import connect_authenticated  # noqa: PLC0415

    tracker = await make_tracker(1)
    sock, _ = await connect_authenticated(HOST, tracker.port, SECRET, {"role": "monitor"}, 5)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(encode_frame({"t": "status", "task_id": 7}))
    received = await asyncio.wait_for(reader.read(), 5)  # to the end: the tracker closes
    (refusal,) = FrameDecoder().feed(received)
    assert refusal["t"] == "refuse" and "status.task_id must be a str" in refusal["reason"]
    writer.close()
    client = await TrackerClient.connect(config(tracker, "0"), 21500)
    assert (await client.wait_assignment(5)).world_size == 1
    await client.shutdown(5)
    assert (await tracker.wait_done(5)).success


@pytest.mark.asyncio
async def test_heartbeats_report_progress_and_a_bad_report_is_refused(
    make_tracker: Callable[..., Any], caplog: pytest.LogCaptureFixture,
) -> None:
    """What a worker's heartbeats report shows in the status; a report of the wrong shape
    is ignored with a warning naming the field (it is monitoring only: the worker stays)."""
    tracker = await make_tracker(2)
    good, bad = await join_job(tracker, ["0", "1"])
    await asyncio.gather(good.wait_assignment(5), bad.wait_assignment(5))
    good.progress = lambda: {"version": 2, "calls": 7, "replaying": False}
    with caplog.at_level(logging.WARNING, logger="rabit2.tracker"):
        bad.progress = lambda: {"calls": -5}
        await wait_until(lambda: "heartbeat.progress.calls" in caplog.text)
    rows = {task["task_id"]: task for task in tracker.status()["tasks"]}
    assert rows["0"]["progress"] == {"version": 2, "calls": 7, "replaying": False}
    assert rows["0"]["heartbeat_age"] < 5
    assert rows["1"]["progress"] is None and rows["1"]["connected"]
    assert tracker.status()["failures"] == 0
    bad.progress = None
    for client in (good, bad):
        await client.close()


def test_a_tracker_on_every_interface_advertises_a_name_others_can_reach() -> None:
    """Listening on 0.0.0.0, the tracker's URI must not send workers of other hosts to
    themselves: where this host's own name resolves to loopback only (as /etc/hosts often
    maps it), the address of the interface that routes outward stands in for it."""
    from tracker.service import advertised_host  # noqa: PLC0415

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        try:
            probe.connect(("10.255.255.255", 9))  # (sends nothing)
        except OSError:
            pytest.skip("this machine has no route outward")
    host = advertised_host()
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    assert any(not str(a).startswith("127.") for a in addresses), (host, addresses)


@pytest.mark.asyncio
async def test_prints_to_a_tracker_that_reads_nothing_are_bounded_and_counted(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A tracker that stops reading: prints wait in the worker only up to
    ``PRINT_BACKLOG``; beyond it a print from the loop is dropped at once, one from another
    thread after ``PRINT_WAIT_SEC``, and a warning counts them once lines flow again."""
    from rabit2.io import tracker_client as tc  # noqa: PLC0415

    monkeypatch.setattr(tc, "PRINT_WAIT_SEC", 0.3)
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    client = TrackerClient(reader, writer, heartbeat_sec=60.0)
    line = "x" * 200_000
    try:
        with caplog.at_level(logging.WARNING, logger="rabit2.tracker_client"):
            for _ in range(100):  # 20 MB from the loop's own thread
                client.print(line)
                await asyncio.sleep(0)
            waiting = writer.transport.get_write_buffer_size()
            assert tc.PRINT_BACKLOG - len(line) <= waiting <= tc.PRINT_BACKLOG + len(line)
            assert "being dropped" in caplog.text
            loop = asyncio.get_running_loop()
            start = time.monotonic()
            await loop.run_in_executor(None, client.print, line)  # waits, then drops
            assert 0.25 <= time.monotonic() - start < 5
            start = time.monotonic()  # the tracker stalled: the next line does not wait
            await loop.run_in_executor(None, client.print, line)
            assert time.monotonic() - start < 0.2
            assert writer.transport.get_write_buffer_size() == waiting
            theirs.setblocking(False)
            got = bytearray()
            deadline = time.monotonic() + 10
            while writer.transport.get_write_buffer_size() and time.monotonic() < deadline:
                with contextlib.suppress(BlockingIOError):
                    got += theirs.recv(1 << 20)
                await asyncio.sleep(0)
            client.print("after")  # flows again: the count of what was lost is logged
            while b"after" not in got[-64:] and time.monotonic() < deadline:
                with contextlib.suppress(BlockingIOError):
                    got += theirs.recv(1 << 20)
                await asyncio.sleep(0)
            kept = bytes(got).count(line.encode())
            assert 20 < kept < 40, kept  # (what the kernel and 4 MiB of buffer held)
            assert f"{102 - kept} tracker_print lines were dropped" in caplog.text
            client.print("a\udcff")  # (a lone surrogate: replaced, not raised)
    finally:
        await client.close()
        theirs.close()


def test_a_print_counts_its_utf8_bytes_and_never_raises_on_what_does_not_encode() -> None:
    from rabit2.io.tracker_client import _MAX_PRINT_BYTES, _truncate  # noqa: PLC0415

    assert _truncate("é" * 10) == ("é" * 10, 20)
    assert _truncate("a\udcff") == ("a?", 2)
    text, nbytes = _truncate("€" * _MAX_PRINT_BYTES)  # (3 bytes each: cut on a character)
    assert text.endswith(" ...[truncated]") and nbytes == len(text.encode())
    assert nbytes <= _MAX_PRINT_BYTES + len(" ...[truncated]")


def test_a_print_after_the_clients_loop_ended_returns_at_once() -> None:
    """A thread that prints while the worker shuts down: the loop stopped, then closed.
    The line is dropped at once, leaves no count behind and no coroutine unawaited."""
    loop = asyncio.new_event_loop()
    ours, theirs = socket.socketpair()

    async def make() -> TrackerClient:
        reader, writer = await asyncio.open_connection(sock=ours)
        return TrackerClient(reader, writer, heartbeat_sec=60.0)

    def from_another_thread(msg: str) -> float:
        took: list[float] = []

        def run() -> None:
            start = time.monotonic()
            client.print(msg)
            took.append(time.monotonic() - start)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(30)
        return took[0]

    client = loop.run_until_complete(make())
    try:
        for _ in range(3):  # (stopped: is_running() is False)
            assert from_another_thread("x" * 200_000) < 0.5 and client._in_flight == 0
    finally:
        loop.run_until_complete(client.close())
        loop.close()
        theirs.close()
    assert from_another_thread("after close") < 0.5 and client._in_flight == 0
