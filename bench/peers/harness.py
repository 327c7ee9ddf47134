"""Worker side of the side-by-side benchmark: the same measured loop for every implementation.

Every launcher (``rabit2-submit``, ``torchrun``, ``mpirun``, the XGBoost trackers) starts this
file on each rank::

    python bench/peers/harness.py --impl gloo --out DIR --sizes 4096,65536 --ops allreduce

``--impl`` names an adapter module ``peer_<module>`` in this folder (see ``IMPLS``) whose
``make_comm(label)`` returns a :class:`Comm`. Per (op, size) and per iteration:

1. the implementation's own 1-element float32 SUM allreduce, as a barrier;
2. ``time.perf_counter()`` just before and just after the collective call (on Linux this is
   the system-wide CLOCK_MONOTONIC, so the stamps of the ranks are comparable on one host);
3. an untimed check of every element against a closed form: in allreduce rank ``r`` sends
   ``(r+1)*p[j] + c`` with ``p[j] = j % 251 + 1`` and ``c`` changing per iteration, so the
   result is ``N(N+1)/2 * p[j] + N*c`` (small integers, exact in float32 in any order); in
   broadcast the root sends ``p[j] * k`` and the other ranks pre-fill ``-1``.

A wrong result ends the worker with exit status 3. Each rank writes its raw stamps to
``DIR/rank<r>.json``; the driver (``run.py``) turns them into first-rank-in to
last-rank-out times. This file must run unchanged under numpy 1.x (the XGBoost 1.7 venv).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

#: ``--impl`` label -> adapter module (several labels may share one module).
IMPLS: dict[str, str] = {
    "rabit2": "peer_rabit2",
    "rabit2-ckpt": "peer_rabit2",
    "rabit2-noft": "peer_rabit2",
    "gloo": "peer_gloo",
    "mpi-shm": "peer_mpi",
    "mpi-tcp": "peer_mpi",
    "xgboost3": "peer_xgb",
    "xgboost1.7": "peer_xgb",
}


class Comm(Protocol):
    """What an adapter provides to the measured loop (one instance per rank)."""

    rank: int
    world: int
    version: str

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """float32 SUM allreduce of ``a``; returns the result (may be ``a`` itself)."""

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        """Broadcast ``a`` from ``root``; returns the received array (may be ``a``)."""

    def barrier(self, one: np.ndarray) -> None:
        """The implementation's own 1-element allreduce of ``one``."""

    def finalize(self) -> None:
        """Leave the job."""


HIST_BINS = 51_200  # the GBDT example's 400 KB level: 2 nodes x 8 features x 400 bins x 8 B
COMPUTE_KINDS = ("stream", "histogram")


def default_iters(size: int) -> int:
    """Iterations per size: 1000 up to 64 KiB, about 570 at 1 MiB, 35 at 16 MiB, 10 at 64 MiB."""
    return max(10, min(1000, int(6e8 // size)))


class Loop:
    """One rank's buffers (sized for the largest message) and the measured loop."""

    def __init__(self, comm: Comm, max_bytes: int, compute_mb: float = 0.0,
                 compute: str = "stream") -> None:
        self.comm = comm
        # --compute-mb: work between the barrier and each timed call, as the compute of a
        # training round leaves the caches: "stream" reads half and writes half of it (a
        # numpy multiply); "histogram" builds a 51 200-bin histogram of that many MiB of
        # (index int64, weight float64) rows with np.bincount and allocates a fresh 6.4 MB
        # array, as the GBDT example's histogram building does
        self.compute = compute
        words = int(compute_mb * (1 << 20)) // 8
        self.work: tuple[np.ndarray, np.ndarray] | None = None
        if words and compute == "histogram":
            rng = np.random.default_rng(comm.rank)
            rows = words // 2
            self.work = (rng.integers(0, HIST_BINS, rows), rng.random(rows))
        elif words:
            self.work = (np.ones(words, dtype=np.float32), np.empty(words, dtype=np.float32))
        n = max_bytes // 4
        self.pattern = (np.arange(n, dtype=np.int64) % 251 + 1).astype(np.float32)
        self.buf = np.empty(n, dtype=np.float32)
        self.expect = np.empty(n, dtype=np.float32)
        self.one = np.zeros(1, dtype=np.float32)

    def _allreduce(self, n: int, it: int) -> tuple[float, float]:
        c = np.float32(it % 13)
        world, rank = self.comm.world, self.comm.rank
        a, e, base = self.buf[:n], self.expect[:n], self.pattern[:n]
        np.multiply(base, np.float32(rank + 1), out=a)
        a += c
        self.comm.barrier(self.one)
        self._compute()
        t0 = time.perf_counter()
        res = self.comm.allreduce_sum(a)
        t1 = time.perf_counter()
        np.multiply(base, np.float32(world * (world + 1) // 2), out=e)
        e += np.float32(world) * c
        self._check(res, e, "allreduce", n, it)
        return t0, t1

    def _broadcast(self, n: int, it: int) -> tuple[float, float]:
        a, e, base = self.buf[:n], self.expect[:n], self.pattern[:n]
        np.multiply(base, np.float32(it % 13 + 1), out=e)
        if self.comm.rank == 0:
            a[...] = e
        else:
            a.fill(-1.0)
        self.comm.barrier(self.one)
        self._compute()
        t0 = time.perf_counter()
        res = self.comm.broadcast(a, 0)
        t1 = time.perf_counter()
        self._check(res, e, "broadcast", n, it)
        return t0, t1

    def _compute(self) -> None:
        """The work of ``--compute-mb`` / ``--compute`` (nothing without it)."""
        if self.work is None:
            return
        if self.compute == "histogram":
            hist = np.bincount(self.work[0], weights=self.work[1], minlength=HIST_BINS)
            fresh = np.zeros(800_000)  # (a temporary as large as the deepest level's)
            fresh += hist[0]
        else:
            np.multiply(self.work[0], np.float32(1.0001), out=self.work[1])

    def _check(self, res: Any, expect: np.ndarray, op: str, n: int, it: int) -> None:
        ok = (
            isinstance(res, np.ndarray)
            and res.dtype == np.float32
            and res.size == n
            and bool(np.array_equal(res.reshape(-1), expect))
        )
        if not ok:
            sys.stderr.write(
                f"rank {self.comm.rank}: WRONG {op} result, {4 * n} B, iteration {it}\n"
            )
            sys.stderr.flush()
            os._exit(3)

    def run(self, op: str, size: int, iters: int, warmup: int) -> tuple[list[float], list[float]]:
        """Warm up, then time ``iters`` iterations; returns this rank's (starts, ends)."""
        n = size // 4
        step: Callable[[int, int], tuple[float, float]] = (
            self._allreduce if op == "allreduce" else self._broadcast
        )
        for w in range(warmup):
            step(n, w)
        starts: list[float] = []
        ends: list[float] = []
        between = getattr(self.comm, "between_iterations", None)
        for i in range(iters):
            t0, t1 = step(n, warmup + i)
            starts.append(t0)
            ends.append(t1)
            if between is not None:
                between()  # untimed (rabit2-ckpt: a checkpoint, as a training loop takes)
        return starts, ends


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of the worker (the driver builds it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--impl", required=True, choices=sorted(IMPLS))
    ap.add_argument("--out", required=True, type=Path, help="folder for rank<r>.json")
    ap.add_argument("--sizes", required=True, help="comma-separated byte counts")
    ap.add_argument("--ops", default="allreduce,broadcast")
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--compute-mb", type=float, default=0.0,
                    help="MiB of memory traffic before each timed call (default none)")
    ap.add_argument("--compute", choices=COMPUTE_KINDS, default="stream",
                    help="what that traffic is (default stream)")
    ns = ap.parse_args(argv)
    ns.sizes = [int(s) for s in ns.sizes.split(",") if s]
    ns.ops = [o for o in ns.ops.split(",") if o]
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Run every (op, size) and write this rank's stamps."""
    ns = parse_args(argv)
    adapter = importlib.import_module(IMPLS[ns.impl])
    comm: Comm = adapter.make_comm(ns.impl)
    loop = Loop(comm, max(ns.sizes), ns.compute_mb, ns.compute)
    results: list[dict[str, Any]] = []
    for op in ns.ops:
        for size in ns.sizes:
            iters = max(3, round(default_iters(size) * ns.iters_scale))
            warmup = max(2, iters // 20)
            starts, ends = loop.run(op, size, iters, warmup)
            results.append(
                {"op": op, "size_bytes": size, "iters": iters, "starts": starts, "ends": ends}
            )
    record = {
        "impl": ns.impl,
        "version": comm.version,
        "rank": comm.rank,
        "world": comm.world,
        "pid": os.getpid(),
        "results": results,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    tmp = ns.out / f".rank{comm.rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(ns.out / f"rank{comm.rank}.json")
    comm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
