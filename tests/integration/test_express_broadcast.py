"""Express broadcasts at world size 2 (docs/design.md, "Express calls") over real loopback
sockets: the same results and records as the general path, whichever rank takes which
path, and every way out of an express start ends in the general path or in a typed
error."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from rabit2.calls import broadcast_call
from rabit2.errors import MismatchError
from rabit2.io.engine import Engine
from tests.integration.test_engine import finish, on_all, start_job
from tests.integration.test_express import _records, express_and_general

# what the root sends: arrays of one frame, of several checked frames, larger than an
# express broadcast, empty, and a pickled object
CASES: list[Any] = [
    np.arange(1, dtype=np.float32),
    np.arange(1024, dtype=np.float32),
    np.arange(16_384, dtype=np.float32),
    np.arange(32_768, dtype=np.float32),  # 128 KiB and its head: a buffer of its own
    np.arange(32_748, dtype=np.float32),  # ... and with it, the largest kept in a slab
    np.arange(200_000, dtype=np.float64).reshape(1000, 200),  # 1.6 MB: four checked frames
    np.arange(600_000, dtype=np.float64),  # 4.8 MB: the general path
    np.zeros(0, dtype=np.int8),
    {"model": list(range(100)), "name": "tree"},
]


def _value(i: int, case: Any, rank: int) -> Any:
    if isinstance(case, np.ndarray):
        return case * (i + 1) if rank == i % 2 else np.full_like(case, -1)
    return case if rank == i % 2 else None


def _run_cases(rank: int, engine: Engine, rounds: int = 2) -> list[bytes]:
    got = []
    for _ in range(rounds):
        for i, case in enumerate(CASES):
            root = i % 2  # both roots
            call, result = broadcast_call(_value(i, case, rank), root, rank == root)
            engine.run_call(call)
            out = result()
            got.append(out.tobytes() if isinstance(out, np.ndarray) else repr(out).encode())
    return got


@pytest.mark.parametrize("recover", ["1", "0"])
@pytest.mark.parametrize("checksum", ["on", "off"])
def test_express_broadcasts_equal_the_general_path(recover: str, checksum: str) -> None:
    outcomes = express_and_general(_run_cases, RABIT2_RECOVER=recover, RABIT2_CHECKSUM=checksum)
    for results in outcomes.values():
        for i, case in enumerate(CASES):
            want = _value(i, case, i % 2)
            want = want.tobytes() if isinstance(want, np.ndarray) else repr(want).encode()
            assert results[0][0][i] == want, i
    # most were made express (not those larger than MAX_BYTES, nor one whose peer's frame the
    # loop read ahead)
    assert all(n >= len(CASES) for n in (r[2] for r in outcomes["1"])), outcomes["1"]
    assert [r[2] for r in outcomes["0"]] == [0, 0]
    for rank in (0, 1):
        assert outcomes["1"][rank][0] == outcomes["0"][rank][0]
        assert outcomes["1"][rank][1] == outcomes["0"][rank][1], rank


def test_one_rank_express_the_other_general() -> None:
    """The same bytes on the wire either way."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1")
    engines[0].driver.express = None

    def work(rank: int, engine: Engine) -> list[bytes]:
        return _run_cases(rank, engine, rounds=3)

    results = on_all(engines, work)
    assert results[0] == results[1]
    assert engines[1].driver.express is not None and engines[1].driver.express.calls > 0
    assert _records(engines[0])[:4] == _records(engines[1])[:4]
    finish(tracker, engines)


@pytest.mark.parametrize("late", [0, 1])
def test_a_late_peer_turns_an_express_start_into_the_general_path(late: int) -> None:
    """The root, or the receiver, comes after ``drive_ms``: the other rank's express start
    goes on the general way, and both get the root's bytes."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="1", RABIT2_DRIVE_MS="5")
    data = np.arange(3000, dtype=np.float64)

    def work(rank: int, engine: Engine) -> bytes:
        if rank == late:
            time.sleep(0.3)
        call, result = broadcast_call(data if rank == 0 else None, 0, rank == 0)
        engine.run_call(call)
        out = result()
        call, result = broadcast_call(data if rank == 0 else None, 0, rank == 0)
        engine.run_call(call)  # (and the next one is express again)
        assert result().tobytes() == data.tobytes()
        return bytes(out.tobytes())

    results = on_all(engines, work)
    assert results == [data.tobytes(), data.tobytes()]
    xio = engines[1 - late].driver.express
    assert xio is not None and xio.fallbacks >= 1
    finish(tracker, engines)


@pytest.mark.parametrize("express", ["1", "0"])
@pytest.mark.parametrize("roots", [(0, 1), (1, 0)], ids=["two roots", "no root"])
def test_ranks_that_disagree_on_the_root_fail_typed(roots: tuple[int, int], express: str) -> None:
    """Each rank the root, or neither: both raise MismatchError (an express start meets a
    frame it did not expect, and the general path reports it)."""
    tracker, engines = start_job(2, "uvloop", RABIT2_RECOVER="0", RABIT2_TIMEOUT="20",
                                 RABIT2_EXPRESS=express)
    data = np.arange(100, dtype=np.int32)

    def work(rank: int, engine: Engine) -> None:
        root = roots[rank]
        call, _ = broadcast_call(data if root == rank else None, root, root == rank)
        engine.run_call(call)

    start = time.monotonic()
    results = on_all(engines, work)
    assert all(isinstance(r, MismatchError) for r in results), results
    assert time.monotonic() - start < 20
    on_all(engines, lambda r, e: e.close())
    tracker.stop()
