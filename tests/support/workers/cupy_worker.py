"""Worker program for tests/gpu: every collective on cupy arrays, checked against numpy.

Run under ``rabit2-submit``.  Three iterations, each checkpoint version ``it``; every input
depends only on (rank, iteration), so a restarted worker replays the same calls.  Every
result is checked byte for byte against a numpy reduction of every rank's input, and is
chained into a sha256 that travels in the checkpoint beside a cupy array of weights (which
a restarted worker gets back on its device).  Prints ``CUPY rank=R world=W digest=<hex>``
on success; an assertion exits non-zero.  ``k=v`` arguments (``mock=...``) go to
``rabit2.init``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import reduce
from typing import Any

import cupy as cp
import numpy as np

import rabit2

DTYPES = tuple(np.dtype(d) for d in ("float32", "float64", "float16", "int32", "uint8", "int64"))
COUNTS = (0, 1, 1000, 300_000)  # (300 000 float32: 1.2 MB, above the ring threshold)
OPS = ((rabit2.SUM, np.add), (rabit2.MAX, np.maximum), (rabit2.MIN, np.minimum))


def contribution(count: int, dtype: np.dtype, rank: int, it: int) -> np.ndarray:
    """Small integers: every sum is exact in every dtype, float16 included."""
    return ((np.arange(count) * 7 + rank * 3 + it) % 11 + 1).astype(dtype)


def iteration(h: Any, rank: int, world: int, it: int, attempt: int) -> None:
    """Every call of iteration ``it``, each result checked and fed to ``h``."""

    def check(got: object, expect: np.ndarray, what: str) -> None:
        assert isinstance(got, cp.ndarray), (what, type(got))
        host = cp.asnumpy(got)
        assert host.dtype == expect.dtype and host.shape == expect.shape, (what, host.shape)
        assert host.tobytes() == expect.tobytes(), what
        h.update(host.tobytes())

    # allreduce: every dtype and op, in place on the device, below and above the ring
    for dtype in DTYPES:
        for count in COUNTS:
            inputs = [contribution(count, dtype, r, it) for r in range(world)]
            for op, ref in OPS:
                if dtype.itemsize == 1 and op == rabit2.SUM:
                    continue  # (wraps)
                mine = cp.asarray(inputs[rank])
                out = rabit2.allreduce(mine, op)
                assert out is mine, "a device array is reduced in place"
                check(out, reduce(ref, inputs), f"allreduce {dtype} {count} {op}")

    # a strided view is reduced in place, the elements between untouched
    m = cp.arange(24, dtype=cp.int64).reshape(4, 6) * (rank + 1)
    view = m[:, ::2]
    assert rabit2.allreduce(view, rabit2.SUM) is view
    whole = np.arange(24, dtype=np.int64).reshape(4, 6)
    check(view, whole[:, ::2] * world * (world + 1) // 2, "strided view")
    assert (cp.asnumpy(m[:, 1::2]) == whole[:, 1::2] * (rank + 1)).all(), "between the view"

    # prepare_fun fills the array right before it is needed, once
    calls: list[object] = []

    def prepare(a: cp.ndarray) -> None:
        calls.append(a)
        a[...] = rank + it

    filled = cp.zeros(5, dtype=cp.int32)
    rabit2.allreduce(filled, rabit2.MAX, prepare)
    # (a restarted worker that replays a call whose result a neighbour kept skips it)
    assert calls == [filled] or (attempt > 0 and not calls), calls
    check(filled, np.full(5, world - 1 + it, dtype=np.int32), "prepare_fun")

    # work queued on another stream before the call is seen, work after it sees the
    # result: the staging copies run on the current stream
    with cp.cuda.Stream(non_blocking=True):
        big = cp.arange(4_000_000, dtype=cp.float64) * (rank + 1) + it
        rabit2.allreduce(big, rabit2.SUM)
        doubled = big * 2
    whole_f = np.arange(4_000_000, dtype=np.float64)
    check(doubled, (whole_f * world * (world + 1) / 2 + it * world) * 2, "streams")

    # a job may mix host and device arrays in one call
    inputs = [contribution(999, np.dtype(np.float32), r, it) for r in range(world)]
    mixed = cp.asarray(inputs[rank]) if rank % 2 else inputs[rank].copy()
    rabit2.allreduce(mixed, rabit2.SUM)
    check(cp.asarray(mixed), reduce(np.add, inputs), "mixed host and device")

    # broadcast: raw bytes; non-roots get a new device array or fill their own
    root = it % world
    source = contribution(50_000, np.dtype(np.float16), 7, it).reshape(250, 200)
    if rank == root:
        sent = cp.asarray(source)
        assert rabit2.broadcast(sent, root) is sent
        check(sent, source, "broadcast root")
    elif rank % 2:
        mine = cp.empty((250, 200), dtype=cp.float16)
        got = rabit2.broadcast(mine, root)
        assert got is mine, "a matching device array receives in place"
        check(got, source, "broadcast into")
    else:
        check(rabit2.broadcast(None, root), source, "broadcast new")
    # an object holding device arrays is pickled, and comes back on the device
    obj = {"w": cp.asarray(source[0]), "it": it} if rank == root else None
    got_obj = rabit2.broadcast(obj, root)
    assert got_obj["it"] == it
    check(got_obj["w"], source[0], "broadcast pickled")
    # a host array from the root stays a host array where the receiver passed no array of
    # its shape; a receiver's own array of the root's dtype and shape, numpy or cupy, is
    # written in place whichever the root passed
    host_sent = rabit2.broadcast(source if rank == root else cp.empty(1), root)
    assert isinstance(host_sent, np.ndarray) and host_sent.tobytes() == source.tobytes()
    mine_dev = cp.empty((250, 200), dtype=cp.float16)
    got = rabit2.broadcast(source if rank == root else mine_dev, root)
    assert rank == root or got is mine_dev, "a cupy array receives a numpy root's bytes"
    check(cp.asarray(got), source, "numpy root into cupy")
    mine_host = np.empty((250, 200), dtype=np.float16)
    got = rabit2.broadcast(cp.asarray(source) if rank == root else mine_host, root)
    assert rank == root or got is mine_host, "a numpy array receives a cupy root's bytes"
    check(cp.asarray(got), source, "cupy root into numpy")

    # allgather: rows from every rank, in rank order, on the device
    parts = [np.full((r + 1, 3), r * 10 + it, dtype=np.int32) for r in range(world)]
    check(rabit2.allgather(cp.asarray(parts[rank])), np.concatenate(parts), "allgather")


def main() -> int:
    rabit2.init(sys.argv[1:])
    rank, world = rabit2.get_rank(), rabit2.get_world_size()
    attempt = int(os.environ.get("DMLC_NUM_ATTEMPT", "0"))
    version, model = rabit2.load_checkpoint()
    if model is None:
        chain, weights = hashlib.sha256(b"seed").digest(), cp.zeros(1000, dtype=cp.float64)
    else:
        chain, weights = model["digest"], model["weights"]
        assert isinstance(weights, cp.ndarray), type(weights)
    for it in range(version, 3):
        h = hashlib.sha256(chain)
        iteration(h, rank, world, it, attempt)
        weights += cp.asarray(reduce(np.add, [contribution(1000, np.dtype(np.float64), r, it)
                                              for r in range(world)]))
        chain = h.digest()
        rabit2.checkpoint({"digest": chain, "weights": weights})
    h = hashlib.sha256(chain)
    h.update(cp.asnumpy(weights).tobytes())
    print(f"CUPY rank={rank} world={world} digest={h.hexdigest()}", flush=True)
    rabit2.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
