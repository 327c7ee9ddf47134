"""cupy arrays in the collectives (the ``gpu`` extra), on a real GPU: skipped where cupy or a
CUDA device is missing.  Jobs run through ``rabit2-submit``; the worker checks every result
byte for byte against numpy (tests/support/workers/cupy_worker.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import rabit2
from rabit2.errors import NotInitializedError
from tests.support import ROOT, WORKERS

cp = pytest.importorskip("cupy")
try:
    _DEVICES = cp.cuda.runtime.getDeviceCount()
except cp.cuda.runtime.CUDARuntimeError:  # (cupy installed, no driver or no device)
    _DEVICES = 0
if not _DEVICES:
    pytest.skip("no CUDA device", allow_module_level=True)

WORKER = WORKERS / "cupy_worker.py"


pytestmark = pytest.mark.usefixtures("no_job")  # (tests/conftest.py)


def _job(world: int, *args: str, max_attempts: int = 1) -> dict[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RABIT2_RECOVER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", str(world),
         "--max-attempts", str(max_attempts), "--timeout", "150", "--",
         sys.executable, str(WORKER), *args],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT, check=False,
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = dict(re.findall(rf"CUPY rank=(\d+) world={world} digest=([0-9a-f]{{64}})",
                            proc.stdout))
    assert sorted(int(r) for r in found) == list(range(world)), proc.stdout[-4000:]
    return {int(r): d for r, d in found.items()}


@pytest.mark.integration
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_on_device_arrays_gives_numpys_bytes(world: int) -> None:
    digests = _job(world)
    assert len(set(digests.values())) == 1, digests


@pytest.mark.integration
def test_a_killed_worker_recovers_its_device_checkpoint_and_replays() -> None:
    clean = _job(3)
    # rank 1 dies in the second iteration's broadcast of a device array, which it roots; the
    # launcher restarts it, it loads the checkpoint (its cupy weights) from its neighbours
    # and replays
    recovered = _job(3, "mock=1,1,72,0", max_attempts=3)
    assert recovered == clean


def test_single_process_calls_return_device_arrays() -> None:
    rabit2.init()
    a = cp.arange(10, dtype=cp.float32)
    assert rabit2.allreduce(a, rabit2.SUM) is a
    assert rabit2.broadcast(a, 0) is a
    gathered = rabit2.allgather(a.reshape(2, 5))
    assert isinstance(gathered, cp.ndarray)
    assert cp.asnumpy(gathered).tobytes() == np.arange(10, dtype=np.float32).tobytes()
    calls: list[object] = []
    assert rabit2.allreduce(a, rabit2.MAX, calls.append) is a and calls == [a]


def test_bad_device_calls_fail_before_anything_runs() -> None:
    a = cp.ones(4, dtype=cp.float32)
    calls: list[object] = []
    with pytest.raises(NotInitializedError):
        rabit2.allreduce(a, rabit2.SUM, calls.append)
    rabit2.init()
    with pytest.raises(TypeError, match="bitwise"):
        rabit2.allreduce(a, rabit2.BITOR, calls.append)
    with pytest.raises(ValueError, match="op"):
        rabit2.allreduce(a, "median", calls.append)
    with pytest.raises(TypeError):
        rabit2.allreduce(cp.ones(4, dtype=cp.complex64), rabit2.SUM, calls.append)
    assert calls == []


@pytest.mark.integration
@pytest.mark.parametrize("where", ["stream", "per-thread-default"])
def test_asyncio_calls_stage_on_the_callers_stream(where: str) -> None:
    """``rabit2.aio`` runs its calls on a thread of its own, whose current stream is not the
    caller's: the copies must still wait for the kernels the caller queued, on a non-blocking
    stream or on the default stream where each thread has its own
    (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM``), and the result must be complete for the
    caller's next kernel."""
    code = (
        "import asyncio, contextlib, sys, cupy as cp, numpy as np, rabit2, rabit2.aio\n"
        "async def main():\n"
        "    async with rabit2.aio.Communicator() as comm:\n"
        "        rank, world = comm.rank, comm.world_size\n"
        "        bad = 0\n"
        "        for i in range(20):\n"
        "            with (cp.cuda.Stream(non_blocking=True) if sys.argv[1] == 'stream'\n"
        "                  else contextlib.nullcontext()):\n"
        "                a = cp.full(4_000_000, float(i), dtype=cp.float64)\n"
        "                for _ in range(60):\n"
        "                    a = cp.sqrt(a * a)\n"
        "                a += rank + 1\n"
        "                got = await comm.allreduce(a, rabit2.SUM)\n"
        "                twice = got * 2\n"
        "                b = await comm.broadcast(a if rank == 0 else None, 0)\n"
        "                g = await comm.allgather(a[:3].reshape(1, 3))\n"
        "                cp.cuda.get_current_stream().synchronize()\n"
        "            want = world * i + world * (world + 1) / 2\n"
        "            bad += int(cp.asnumpy(twice).min() != 2 * want)\n"
        "            bad += int(cp.asnumpy(twice).max() != 2 * want)\n"
        "            bad += int((cp.asnumpy(b) != want).any())\n"
        "            bad += int((cp.asnumpy(g) != want).any())\n"
        "        print('AIO rank', rank, 'bad', bad, flush=True)\n"
        "asyncio.run(main())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if where == "per-thread-default":
        env["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "2",
         "--timeout", "100", "--", sys.executable, "-c", code, where],
        capture_output=True, text=True, timeout=130, env=env, cwd=ROOT, check=False,
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(re.findall(r"AIO rank (\d) bad (\d+)", proc.stdout)) == [
        ("0", "0"), ("1", "0")], proc.stdout[-3000:]
