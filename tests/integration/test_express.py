"""Express pair calls (docs/design.md, "Express calls") over real loopback sockets: the same
results, bit for bit, and the same records as the general path, whichever rank takes which
path; and every way out of an express start (a late peer, a partial write) ends in the
general path with nothing lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from rabit2.core.agent import Call
from rabit2.core.framing import CollectiveKind
from rabit2.core.ops import Op
from rabit2.errors import ProtocolError, RabitError
from rabit2.io.engine import Engine
from rabit2.io.express_wire import Written
from tests.integration.test_engine import (
    allreduce_call,
    express_io,
    finish,
    on_all,
    small_socket_buffers,
    start_job,
)

# (dtype, op, count): float NaN payloads that differ between the ranks, integers, every op
CASES = [
    (np.float32, Op.SUM, 1),
    (np.float32, Op.SUM, 1024),
    (np.float64, Op.MAX, 3000),
    (np.float32, Op.MIN, 16_384),
    (np.float32, Op.SUM, 32_768),  # 128 KiB: the largest result kept in a slab
    (np.float32, Op.SUM, 32_769),  # made in a buffer of the replay store's own
    (np.int32, Op.BITOR, 5000),
    (np.uint8, Op.BITXOR, 777),
    (np.float16, Op.SUM, 100),
    (np.float64, Op.SUM, 65_536),  # 512 KiB: one checked frame
    (np.float32, Op.MAX, 300_001),  # three checked frames (a pair call asked for by name)
    (np.float64, Op.SUM, 262_147),  # five
]


def _input(rank: int, dtype: type, count: int, i: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * i + rank)
    if np.issubdtype(dtype, np.floating):
        a = rng.standard_normal(count).astype(dtype)
        if count > 8:
            # NaNs with payloads of this rank's own at the same places on both ranks, so
            # that which payload survives shows
            bits = a.view(np.uint16 if dtype == np.float16 else
                          np.uint32 if dtype == np.float32 else np.uint64)
            nan = {np.float16: 0x7E00, np.float32: 0x7FC00000, np.float64: 0x7FF8000000000000}
            bits[::7] = nan[dtype] | (rank + 1)
        return a
    return rng.integers(0, 100, count).astype(dtype)


def _expected(dtype: type, op: Op, count: int, i: int) -> np.ndarray:
    a, b = _input(0, dtype, count, i), _input(1, dtype, count, i)
    ufunc = {Op.SUM: np.add, Op.MAX: np.maximum, Op.MIN: np.minimum, Op.BITOR: np.bitwise_or,
             Op.BITXOR: np.bitwise_xor}[op]
    out = np.empty_like(a)
    ufunc(a, b, out=out)
    return out


def _run_cases(rank: int, engine: Engine, rounds: int = 2) -> list[bytes]:
    got = []
    for _ in range(rounds):
        for i, (dtype, op, count) in enumerate(CASES):
            a = _input(rank, dtype, count, i)
            # (the pair exchange also above the ring threshold, as rabit_reduce_ring_mincount
            # can make it)
            engine.run_call(Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(a).cast("B"),
                                 a.dtype, op))
            got.append(a.tobytes())
    return got


def _records(engine: Engine) -> tuple[object, ...]:
    agent = engine.agent
    stats = agent.statistics()
    link = agent.links[1 - agent.rank]
    kept: list[tuple[object, ...]] = []
    if agent.recovery is not None:
        store = agent.recovery.results
        for call in store._results:
            got = store.get(call)
            assert got is not None
            kept.append((call, got[0], bytes(got[1].cast("B"))))
    return (agent.version, agent.seqno, agent.state, stats.calls_completed, stats.bytes_sent,
            stats.bytes_received, stats.frames_sent, stats.frames_received, link.pos,
            link.seen_version, link.mode, link.phase, tuple(kept))


def express_and_general(run: Callable[[int, Engine], list[bytes]],
                        **env: str) -> dict[str, list[Any]]:
    """``run`` on a fresh pair of engines with express calls on ("1") and off ("0"): per
    setting, each rank's results, records and express calls (both ranks' results equal)."""
    outcomes = {}
    for express in ("1", "0"):
        tracker, engines = start_job(2, "uvloop", RABIT2_EXPRESS=express, **env)

        def work(rank: int, engine: Engine) -> tuple[list[bytes], tuple[object, ...], int]:
            got = run(rank, engine)
            xio = engine.driver.express
            return got, _records(engine), 0 if xio is None else xio.calls

        outcomes[express] = on_all(engines, work)
        finish(tracker, engines)
    for results in outcomes.values():
        assert all(not isinstance(r, BaseException) for r in results), results
        assert results[0][0] == results[1][0]
    return outcomes


@pytest.mark.parametrize("recover", ["1", "0"])
@pytest.mark.parametrize("checksum", ["on", "off"])
def test_express_results_and_records_equal_the_general_path(recover: str, checksum: str) -> None:
    outcomes = express_and_general(_run_cases, RABIT2_RECOVER=recover, RABIT2_CHECKSUM=checksum)
    for express, results in outcomes.items():
        # both ranks hold the same bits, which are numpy's for the operands in rank order
        for i, (dtype, op, count) in enumerate(CASES):
            assert results[0][0][i] == _expected(dtype, op, count, i).tobytes(), (express, i)
    express_calls = [r[2] for r in outcomes["1"]]
    assert all(n >= len(CASES) for n in express_calls), express_calls  # express was taken
    assert [r[2] for r in outcomes["0"]] == [0, 0]
    # and left the agent, its link and the replay store as the general path does
    for rank in (0, 1):
        assert outcomes["1"][rank][0] == outcomes["0"][rank][0]
        assert outcomes["1"][rank][1] == outcomes["0"][rank][1], rank


def test_one_rank_express_the_other_general() -> None:
    """The wire carries the same bytes either way: a rank that makes its calls express and one
    that makes them the general way agree, bit for bit."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1")
    engines[1].driver.express = None

    def work(rank: int, engine: Engine) -> list[bytes]:
        return _run_cases(rank, engine, rounds=3)

    results = on_all(engines, work)
    assert results[0] == results[1]
    assert engines[0].driver.express is not None and engines[0].driver.express.calls > 0
    assert _records(engines[0])[:4] == _records(engines[1])[:4]
    finish(tracker, engines)


def test_a_late_peer_turns_an_express_start_into_the_general_path() -> None:
    """Rank 0 writes its frame and waits; rank 1 comes after ``drive_ms``: rank 0's call is
    begun on the agent with its frame skipped, handed to the loop, and finishes there."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1", RABIT2_DRIVE_MS="5")

    def work(rank: int, engine: Engine) -> tuple[bytes, int]:
        out = b""
        for i in range(6):
            if rank == 1 and i % 2:
                time.sleep(0.05)
            a = np.full(1000 + i, float(rank + i), dtype=np.float32)
            engine.run_call(allreduce_call(a, engine))
            assert (a == 2 * i + 1).all(), (rank, i)
            out += a.tobytes()
        xio = express_io(engine)
        return out, xio.fallbacks

    results = on_all(engines, work)
    assert results[0][0] == results[1][0]
    assert results[0][1] >= 3, results  # rank 0 fell back at each late call
    finish(tracker, engines)


@pytest.mark.parametrize("size", [24, 20_000, 400_000, 1_500_000])
def test_a_frame_the_loop_read_while_this_rank_computed_is_taken(size: int) -> None:
    """Rank 1 computes longer than the loop lingers: its loop reads rank 0's frame header (and
    what fits the stage after it) and holds it.  Rank 1's call takes it from there."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1")

    def work(rank: int, engine: Engine) -> tuple[bytes, int, int]:
        out = b""
        for i in range(6):
            if rank == 1:
                time.sleep(0.06)
            a = np.arange(size // 4, dtype=np.float32) * (rank + 1) + i
            engine.run_call(Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(a).cast("B"),
                                 a.dtype, Op.SUM))
            assert (a == np.arange(size // 4, dtype=np.float32) * 3 + 2 * i).all(), (rank, i)
            out += a.tobytes()
        xio = express_io(engine)
        return out, xio.held, engine.agent.statistics().bytes_received

    results = on_all(engines, work)
    assert results[0][0] == results[1][0]
    assert results[1][1] >= 3, results  # (the loop read ahead before most of rank 1's calls)
    assert results[0][2] == results[1][2] == 6 * (size // 4 * 4), results  # each byte once
    finish(tracker, engines)


def test_a_late_peer_holds_the_loop_for_drive_ms_once() -> None:
    """An express start that waits ``drive_ms`` for a late peer hands the call to the loop
    then, not after a second ``drive_ms`` of the general path's own."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1", RABIT2_DRIVE_MS="300")
    held: list[float] = []
    driver = engines[0].driver
    run = driver.run

    def timed(*args: object) -> bool:
        start = time.monotonic()
        try:
            return run(*args)  # type: ignore[arg-type]
        finally:
            held.append(time.monotonic() - start)

    driver.run = timed  # type: ignore[method-assign]

    def work(rank: int, engine: Engine) -> None:
        for i in range(3):
            if rank == 1:
                time.sleep(0.7)
            a = np.full(100, float(rank + i), dtype=np.float32)
            engine.run_call(allreduce_call(a, engine))
            assert (a == 2 * i + 1).all()

    assert on_all(engines, work) == [None, None]
    # (0.6 s and more: waited twice; the margin is for a loaded machine)
    assert len(held) == 3 and max(held) < 0.5, held
    finish(tracker, engines)


def test_a_fallback_that_cannot_skip_what_was_written_fails_typed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Never expected: the general path would not send what an express start wrote.  The
    call then fails with a typed error and the link closes (the stream cannot be kept
    whole); the peer hears it through the job's abort, never waits out a deadline."""

    def refuse(self: Written, cmds: list[object]) -> list[object]:
        raise ProtocolError("the frames differ (injected)")

    monkeypatch.setattr(Written, "skip", refuse)
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1", RABIT2_DRIVE_MS="5")
    started = time.monotonic()

    def work(rank: int, engine: Engine) -> type[BaseException] | None:
        if rank == 1:
            time.sleep(0.2)  # rank 0's express start waits 5 ms, then falls back
        a = np.ones(1000, dtype=np.float32)
        try:
            engine.run_call(allreduce_call(a, engine))
        except RabitError as exc:
            if rank == 0:
                engine.finalize()  # (a failed worker's finalize aborts the job)
            return type(exc)
        return None

    results = on_all(engines, work)
    assert results[0] is ProtocolError, results
    assert isinstance(results[1], type) and issubclass(results[1], RabitError), results
    assert time.monotonic() - started < 30
    on_all(engines, lambda r, e: e.close())
    tracker.stop()


def test_a_partial_write_is_finished_by_the_general_path() -> None:
    """With small socket buffers the kernel takes only part of a 512 KiB frame: the rest is
    sent the general way, after exactly the bytes written, and the results hold."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1")
    small_socket_buffers(engines, 16384)

    def work(rank: int, engine: Engine) -> tuple[bytes, int]:
        out = b""
        for i in range(4):
            a = np.arange(65_536, dtype=np.float64) * (rank + 1) + i
            engine.run_call(allreduce_call(a, engine))
            assert (a == np.arange(65_536) * 3 + 2 * i).all(), (rank, i)
            out += a.tobytes()
            b = np.full(64, rank, dtype=np.uint8)  # and a small call after each
            engine.run_call(Call(CollectiveKind.BROADCAST, memoryview(b), root=1))
            assert (b == 1).all()
        xio = express_io(engine)
        return out, xio.fallbacks

    results = on_all(engines, work)
    assert results[0][0] == results[1][0]
    assert results[0][1] + results[1][1] >= 4, results
    finish(tracker, engines)
