"""Express tree allreduces (docs/design.md, "Express calls") at world sizes 3-5 over real
loopback sockets: the same results, bit for bit, and the same records as the general path,
whichever rank takes which path; and every way out of an express start (a late rank
anywhere in the tree, a partial write, ranks that disagree) ends in the general path with
nothing lost, or in a typed error on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from rabit2.core.agent import Call
from rabit2.core.framing import CollectiveKind
from rabit2.core.ops import Op
from rabit2.errors import MismatchError, RabitError
from rabit2.io.engine import Engine
from tests.integration.test_engine import (
    allreduce_call,
    express_io,
    finish,
    on_all,
    small_socket_buffers,
    start_job,
)

# (dtype, op, count): every op, NaNs whose payloads differ between the ranks, 1 element to
# the largest tree call made express (512 KiB, one checked frame)
CASES = [
    (np.float32, Op.SUM, 1),
    (np.float32, Op.SUM, 1024),
    (np.float64, Op.MAX, 3000),
    (np.float32, Op.MIN, 16_384),
    (np.int32, Op.BITOR, 5000),
    (np.uint8, Op.BITXOR, 777),
    (np.float16, Op.SUM, 100),
    (np.float32, Op.SUM, 40_000),  # above a slab's results: kept in a buffer of its own
    (np.float64, Op.SUM, 65_536),  # 512 KiB
]
UFUNCS = {Op.SUM: np.add, Op.MAX: np.maximum, Op.MIN: np.minimum, Op.BITOR: np.bitwise_or,
          Op.BITXOR: np.bitwise_xor}


def _input(rank: int, dtype: type, count: int, i: int, nans: bool = True) -> np.ndarray:
    rng = np.random.default_rng(1000 * i + rank)
    if np.issubdtype(dtype, np.floating):
        a = rng.integers(-50, 50, count).astype(dtype)  # (sums exact in any order)
        if nans and count > 8:
            bits = a.view(np.uint16 if dtype == np.float16 else
                          np.uint32 if dtype == np.float32 else np.uint64)
            nan = {np.float16: 0x7E00, np.float32: 0x7FC00000, np.float64: 0x7FF8000000000000}
            bits[::7] = nan[dtype] | (rank + 1)
        return a
    return rng.integers(0, 100, count).astype(dtype)


def _expected(world: int, dtype: type, op: Op, count: int, i: int) -> np.ndarray:
    out = _input(0, dtype, count, i, nans=False)
    for rank in range(1, world):
        UFUNCS[op](out, _input(rank, dtype, count, i, nans=False), out=out)
    return out


def _run_cases(rank: int, engine: Engine, rounds: int = 2) -> list[bytes]:
    got = []
    for _ in range(rounds):
        for i, (dtype, op, count) in enumerate(CASES):
            for nans in (True, False):
                a = _input(rank, dtype, count, i, nans)
                call = allreduce_call(a, engine, op)
                assert call.kind is CollectiveKind.ALLREDUCE_TREE
                engine.run_call(call)
                got.append(a.tobytes())
    return got


def records(engine: Engine) -> tuple[object, ...]:
    """What the agent, its links and the replay store hold after the calls (the frame counts
    aside: the general path forwards a result in as many frames as it arrived in)."""
    agent = engine.agent
    stats = agent.statistics()
    links = tuple((peer, link.pos, link.seen_version, link.mode, link.phase)
                  for peer, link in sorted(agent.links.items()))
    kept: list[tuple[object, ...]] = []
    if agent.recovery is not None:
        store = agent.recovery.results
        for call in store._results:
            got = store.get(call)
            assert got is not None
            kept.append((call, got[0], bytes(got[1].cast("B"))))
    return (agent.version, agent.seqno, agent.state, stats.calls_completed, stats.bytes_sent,
            stats.bytes_received, links, tuple(kept))


def express_and_general_n(world: int, run: Callable[[int, Engine], list[bytes]],
                          **env: str) -> dict[str, list[Any]]:
    """``run`` on fresh engines of ``world`` ranks with express calls on ("1") and off
    ("0"): per setting, each rank's results, records and express calls (every rank's
    results equal)."""
    outcomes = {}
    for express in ("1", "0"):
        tracker, engines = start_job(world, "uvloop", RABIT2_EXPRESS=express, **env)

        def work(rank: int, engine: Engine) -> tuple[list[bytes], tuple[object, ...], int]:
            got = run(rank, engine)
            xio = engine.driver.express
            return got, records(engine), 0 if xio is None else xio.calls

        outcomes[express] = on_all(engines, work)
        finish(tracker, engines)
    for results in outcomes.values():
        assert all(not isinstance(r, BaseException) for r in results), results
        assert all(r[0] == results[0][0] for r in results)  # every rank, the same bits
    return outcomes


@pytest.mark.parametrize(("world", "recover", "checksum"),
                         [(4, "1", "on"), (4, "1", "off"), (4, "0", "on"), (3, "0", "off"),
                          (5, "1", "auto")])
def test_express_trees_equal_the_general_path(world: int, recover: str, checksum: str) -> None:
    outcomes = express_and_general_n(world, _run_cases, RABIT2_RECOVER=recover,
                                     RABIT2_CHECKSUM=checksum)
    for express, results in outcomes.items():
        got = results[0][0]
        for i, (dtype, op, count) in enumerate(CASES):
            assert got[2 * i + 1] == _expected(world, dtype, op, count, i).tobytes(), (express, i)
    # express was taken by every rank (not always: a frame read ahead takes the general path)
    assert all(r[2] >= len(CASES) for r in outcomes["1"]), [r[2] for r in outcomes["1"]]
    assert [r[2] for r in outcomes["0"]] == [0] * world
    for rank in range(world):
        assert outcomes["1"][rank][0] == outcomes["0"][rank][0]  # NaN payloads included
        assert outcomes["1"][rank][1] == outcomes["0"][rank][1], rank


@pytest.mark.parametrize("general", [0, 1, 3])
def test_one_rank_general_the_others_express(general: int) -> None:
    """The wire carries the same bytes either way: the root, an inner rank or a leaf that
    makes its calls the general way agrees with the others, bit for bit."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1")
    engines[general].driver.express = None
    results = on_all(engines, lambda rank, engine: _run_cases(rank, engine, rounds=1))
    assert all(r == results[0] for r in results), results
    assert all(e.driver.express.calls > 0 for e in engines if e.driver.express is not None)
    finish(tracker, engines)


def test_late_ranks_turn_express_starts_into_the_general_path() -> None:
    """Each call one rank comes after ``drive_ms``: the root, an inner rank, a leaf.  The
    others' express starts fall back where they stand (nothing written yet, or their frame
    up written and counted as sent), finish the general way, and the results hold."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1", RABIT2_DRIVE_MS="5")

    def work(rank: int, engine: Engine) -> tuple[bytes, int]:
        out = b""
        for i in range(12):
            if rank == i % 4:
                time.sleep(0.03)
            a = np.full(1000 + i, float(rank + i), dtype=np.float32)
            engine.run_call(allreduce_call(a, engine))
            assert (a == 6 + 4 * i).all(), (rank, i)
            out += a.tobytes()
        xio = express_io(engine)
        return out, xio.fallbacks

    results = on_all(engines, work)
    assert all(r[0] == results[0][0] for r in results), results
    assert sum(r[1] for r in results) >= 12, results
    finish(tracker, engines)


@pytest.mark.parametrize("size", [24, 20_000, 400_000])
def test_frames_the_loop_read_while_this_rank_computed_are_taken(size: int) -> None:
    """The root and an inner rank compute longer than the loop lingers: their loops read the
    children's frames (and what fits the stage after each header) and hold them.  Their
    calls take them from there, each byte counted once."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1")

    def work(rank: int, engine: Engine) -> tuple[bytes, int, int]:
        out = b""
        for i in range(6):
            if rank in (0, 1):
                time.sleep(0.06)
            a = np.arange(size // 4, dtype=np.float32) * (rank + 1) + i
            engine.run_call(allreduce_call(a, engine))
            assert (a == np.arange(size // 4, dtype=np.float32) * 10 + 4 * i).all(), (rank, i)
            out += a.tobytes()
        xio = express_io(engine)
        return out, xio.held, engine.agent.statistics().bytes_received

    results = on_all(engines, work)
    assert all(r[0] == results[0][0] for r in results), results
    assert results[0][1] >= 3, [r[1] for r in results]  # (read ahead before most calls)
    # the root: each child's stream once a call; a leaf: the result once a call
    assert results[0][2] == 6 * 2 * (size // 4 * 4), results[0][2]
    assert results[3][2] == 6 * (size // 4 * 4), results[3][2]
    finish(tracker, engines)


def test_partial_writes_are_finished_by_the_general_path() -> None:
    """With small socket buffers the kernel takes only part of a 512 KiB frame: the rest is
    queued before anything else, the general path goes on from there, and the results
    hold."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1")
    small_socket_buffers(engines, 16384)

    def work(rank: int, engine: Engine) -> tuple[bytes, int]:
        out = b""
        for i in range(4):
            a = np.arange(65_536, dtype=np.float64) * (rank + 1) + i
            engine.run_call(allreduce_call(a, engine))
            assert (a == np.arange(65_536) * 10 + 4 * i).all(), (rank, i)
            out += a.tobytes()
            b = np.full(64, rank, dtype=np.int32)  # and a small call after each
            engine.run_call(allreduce_call(b, engine))
            assert (b == 6).all()
        xio = express_io(engine)
        return out, xio.fallbacks

    results = on_all(engines, work)
    assert all(r[0] == results[0][0] for r in results), results
    assert sum(r[1] for r in results) >= 4, results
    finish(tracker, engines)


@pytest.mark.parametrize("express", ["1", "0"])
@pytest.mark.parametrize("odd", [0, 1, 3])
def test_ranks_that_disagree_fail_typed(odd: int, express: str) -> None:
    """One rank (the root, an inner rank, a leaf) calls with another element type: its
    frames are not those the others expect, and every rank raises MismatchError, express
    or not, well within the deadline."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1", RABIT2_EXPRESS=express)
    started = time.monotonic()

    def work(rank: int, engine: Engine) -> type[BaseException] | None:
        a = np.ones(1000, dtype=np.float64 if rank == odd else np.float32)
        try:
            engine.run_call(Call(CollectiveKind.ALLREDUCE_TREE, memoryview(a).cast("B"),
                                 a.dtype, Op.SUM))
        except RabitError as exc:
            return type(exc)
        return None

    results = on_all(engines, work)
    assert all(r is MismatchError for r in results), results
    assert time.monotonic() - started < 30
    on_all(engines, lambda r, e: e.close())
    tracker.stop()
