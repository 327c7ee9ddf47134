"""Express broadcasts at world sizes 3-5 (docs/design.md, "Express calls") over real loopback
sockets: the same results and records as the general path, from every root, whichever rank
takes which path; and every way out of an express start (a late rank, a partial write,
ranks that disagree on the root) ends in the general path or in a typed error."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from rabit2.calls import broadcast_call
from rabit2.core.framing import BROADCAST_HEAD
from rabit2.errors import MismatchError
from rabit2.io.engine import Engine
from tests.integration.test_engine import (
    express_io,
    finish,
    on_all,
    small_socket_buffers,
    start_job,
)
from tests.integration.test_express_tree import express_and_general_n

# what the root sends: one frame, several checked frames, larger than an express broadcast,
# empty, and a pickled object
CASES: list[Any] = [
    np.arange(1, dtype=np.float32),
    np.arange(1024, dtype=np.float32),
    np.arange(32_748, dtype=np.float32),  # with its head, the largest result kept in a slab
    np.arange(200_000, dtype=np.float64).reshape(1000, 200),  # 1.6 MB: four checked frames
    np.arange(600_000, dtype=np.float64),  # 4.8 MB: the general path
    np.zeros(0, dtype=np.int8),
    {"model": list(range(100)), "name": "tree"},
]


def _value(i: int, case: Any, rank: int, root: int) -> Any:
    if isinstance(case, np.ndarray):
        return case * (i + 1) if rank == root else np.full_like(case, -1)
    return case if rank == root else None


def _runner(world: int, rounds: int = 1) -> Any:
    def run(rank: int, engine: Engine) -> list[bytes]:
        got = []
        for _ in range(rounds):
            for root in range(world):  # every root: a leaf's, an inner rank's view
                for i, case in enumerate(CASES):
                    call, result = broadcast_call(_value(i, case, rank, root), root,
                                                  rank == root)
                    engine.run_call(call)
                    out = result()
                    got.append(out.tobytes() if isinstance(out, np.ndarray)
                               else repr(out).encode())
        return got
    return run


@pytest.mark.parametrize(("world", "recover", "checksum"),
                         [(4, "1", "on"), (4, "1", "off"), (3, "0", "on"), (5, "1", "auto")])
def test_express_broadcasts_equal_the_general_path(world: int, recover: str,
                                                   checksum: str) -> None:
    outcomes = express_and_general_n(world, _runner(world), RABIT2_RECOVER=recover,
                                     RABIT2_CHECKSUM=checksum)
    for results in outcomes.values():
        got = iter(results[0][0])
        for root in range(world):
            for i, case in enumerate(CASES):
                want = _value(i, case, root, root)
                want = want.tobytes() if isinstance(want, np.ndarray) else repr(want).encode()
                assert next(got) == want, (root, i)
    # many were made express (not those larger than MAX_BYTES, nor those that found a frame
    # the loop read ahead)
    assert all(r[2] >= 2 * world for r in outcomes["1"]), [r[2] for r in outcomes["1"]]
    assert [r[2] for r in outcomes["0"]] == [0] * world
    for rank in range(world):
        assert outcomes["1"][rank][0] == outcomes["0"][rank][0]
        assert outcomes["1"][rank][1] == outcomes["0"][rank][1], rank


@pytest.mark.parametrize("general", [0, 1, 3])
def test_one_rank_general_the_others_express(general: int) -> None:
    """The same bytes on the wire either way: the root of the tree, an inner rank or a leaf
    on the general path."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1")
    engines[general].driver.express = None
    results = on_all(engines, _runner(4))
    assert all(r == results[0] for r in results), results
    assert all(e.driver.express.calls > 0 for e in engines if e.driver.express is not None)
    finish(tracker, engines)


def test_late_ranks_turn_express_starts_into_the_general_path() -> None:
    """Each call one rank comes after ``drive_ms``: the root, an inner rank, a leaf.  The
    others' express starts go on the general way, and every rank gets the root's bytes."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1", RABIT2_DRIVE_MS="5")

    def work(rank: int, engine: Engine) -> tuple[bytes, int]:
        out = b""
        for i in range(12):
            root = (i // 4) % 4
            if rank == i % 4:
                time.sleep(0.03)
            data = np.arange(1000 + i, dtype=np.float64) * (root + 1)
            call, result = broadcast_call(data if rank == root else None, root, rank == root)
            engine.run_call(call)
            got = result()
            assert got.tobytes() == data.tobytes(), (rank, i)
            out += got.tobytes()
        xio = express_io(engine)
        return out, xio.fallbacks

    results = on_all(engines, work)
    assert all(r[0] == results[0][0] for r in results)
    assert sum(r[1] for r in results) >= 6, results
    finish(tracker, engines)


@pytest.mark.parametrize("size", [24, 20_000, 400_000])
@pytest.mark.parametrize("late", ["the root", "the others"])
def test_frames_the_loop_read_while_a_rank_computed_are_taken(size: int, late: str) -> None:
    """Ranks compute longer than the loop lingers: their loops read what came meanwhile (the
    root's frames, a child's announce) and hold it.  Their calls take it from there, each
    byte counted once."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1")
    data = np.arange(size // 8, dtype=np.float64)

    def work(rank: int, engine: Engine) -> tuple[bytes, int, int]:
        out = b""
        for i in range(6):
            if (rank == 0) == (late == "the root"):
                time.sleep(0.06)
            call, result = broadcast_call(data * i if rank == 0 else None, 0, rank == 0)
            engine.run_call(call)
            got = result()
            assert got.tobytes() == (data * i).tobytes(), (rank, i)
            out += got.tobytes()
        xio = express_io(engine)
        return out, xio.held, engine.agent.statistics().bytes_received

    results = on_all(engines, work)
    assert all(r[0] == results[0][0] for r in results)
    held = [r[1] for r in results]
    if late == "the root":
        assert held[0] >= 3, held  # (the children's announces, read ahead)
    else:
        assert sum(held[1:]) >= 6, held  # (the stream from the root or a relay)
    assert results[0][2] == 0, results[0][2]  # (the root receives nothing but announces)
    # each byte of each call's stream (its head, then the array) once, on every other rank
    stream = BROADCAST_HEAD.size + data.nbytes
    assert [r[2] for r in results[1:]] == [6 * stream] * 3, [r[2] for r in results]
    finish(tracker, engines)


def test_partial_writes_are_finished() -> None:
    """With small socket buffers the kernel takes only part of a 512 KiB stream: a root's
    start goes on the general way after exactly the bytes written, an inner rank's is
    finished by the loop, and every rank gets the root's bytes.  (Not buffers smaller than
    the loopback's 64 KiB segments: TCP's persist timer then stalls such streams for
    seconds, whatever path sends them.)"""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="1")
    small_socket_buffers(engines, 65536)
    data = np.arange(65_536, dtype=np.float64)

    def work(rank: int, engine: Engine) -> tuple[bytes, int]:
        out = b""
        for i in range(8):
            root = i % 4
            call, result = broadcast_call(data * i if rank == root else None, root,
                                          rank == root)
            engine.run_call(call)
            got = result()
            assert got.tobytes() == (data * i).tobytes(), (rank, i)
            out += got.tobytes()
        xio = express_io(engine)
        return out, xio.fallbacks

    results = on_all(engines, work)
    assert all(r[0] == results[0][0] for r in results)
    assert sum(r[1] for r in results) >= 1, results  # (a root's partial write, at least)
    finish(tracker, engines)


@pytest.mark.parametrize("express", ["1", "0"])
@pytest.mark.parametrize("roots", [(0, 0, 0, 3), (1, 1, 2, 1), (2, 2, 2, 2)],
                         ids=["a leaf names itself", "an inner rank names another",
                              "agreed"])
def test_ranks_that_disagree_on_the_root_fail_typed(roots: tuple[int, ...],
                                                    express: str) -> None:
    """Ranks that name different roots meet frames they do not expect and raise
    MismatchError, express or not, well within the deadline; a rank whose neighbours agree
    with it may finish first, with the bytes of the root it named (a later call then
    fails: the error floods the job)."""
    tracker, engines = start_job(4, "uvloop", RABIT2_RECOVER="0", RABIT2_TIMEOUT="20",
                                 RABIT2_EXPRESS=express)
    data = np.arange(100, dtype=np.int32)

    def work(rank: int, engine: Engine) -> bytes:
        root = roots[rank]
        call, result = broadcast_call(data if root == rank else None, root, root == rank)
        engine.run_call(call)
        return bytes(result().tobytes())

    start = time.monotonic()
    results = on_all(engines, work)
    if len(set(roots)) == 1:
        assert results == [data.tobytes()] * 4
    else:
        odd = next(rank for rank, root in enumerate(roots) if roots.count(root) == 1)
        assert isinstance(results[odd], MismatchError), results
        assert sum(isinstance(r, MismatchError) for r in results) >= 2, results
        assert all(isinstance(r, MismatchError) or r == data.tobytes() for r in results)
    assert time.monotonic() - start < 20
    on_all(engines, lambda r, e: e.close())
    tracker.stop()
