"""Collective micro-benchmark worker: float32 SUM allreduce and root-0 broadcast over rabit2.

Run it under the launcher (``bench/run.py`` does this for you)::

    rabit2-submit --cluster local -n 2 -- python bench/bench_collectives.py --out r.jsonl

The harness matches the side-by-side benchmark's (``bench/peers/harness.py``), so the figures
are comparable: per iteration a 1-element allreduce as a barrier, then the timed collective
(``time.perf_counter`` around the call only), then a check of every element of the result
against its closed form (untimed). The per-iteration times are reduced with MAX across ranks
afterwards, so each figure is the slowest rank's. Rank 0 writes one JSON line per (op, size)::

    {"impl", "op", "dtype", "world", "size_bytes", "iters", "median_s", "p90_s", "min_s",
     "mean_s", "algbw_GBps", "busbw_GBps", "span_median_s", "span_p90_s"}

``algbw = S / t``; ``busbw = 2 (N-1)/N * S / t`` for allreduce (the bytes each link carries in
a bandwidth-optimal ring, the NCCL convention) and ``S / t`` for broadcast; GB = 1e9 B; ``t`` is
the median. ``span_*`` is the peer baselines' own definition (first rank into the call to last
rank out of it, on the shared host clock) for a like-for-like comparison with their tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from units import parse_size

F32 = NDArray[np.float32]

DEFAULT_SIZES = "4K,64K,1M,16M,64M"




def default_iters(size: int) -> int:
    """Many iterations for small messages (noisy), about 10 for 64 MiB (~40-120 ms each)."""
    return max(10, min(1000, int(6e8 // size)))


def summarise(times: NDArray[np.float64], size: int, world: int, op: str) -> dict[str, float]:
    """Median/p90/min/mean and bandwidths (see module docstring) of per-iteration times."""
    med = float(np.median(times))
    alg = size / med / 1e9 if med > 0 else 0.0
    bus = alg * 2 * (world - 1) / world if op == "allreduce" else alg
    return {
        "median_s": med,
        "p90_s": float(np.percentile(times, 90)),
        "min_s": float(times.min()),
        "mean_s": float(times.mean()),
        "algbw_GBps": alg,
        "busbw_GBps": bus,
    }


class Bench:
    """One rank's benchmark state: the buffers of the largest size are reused for all sizes."""

    def __init__(self, api: Any, rank: int, world: int, max_bytes: int) -> None:
        self.api = api
        self.rank = rank
        self.world = world
        n = max_bytes // 4
        # Element j carries (j % 251 + 1): a misplaced chunk cannot go unnoticed, and every
        # value below stays a small integer, exact in float32 whatever the summation order.
        self.pattern: F32 = (np.arange(n, dtype=np.int64) % 251 + 1).astype(np.float32)
        self.buf: F32 = np.empty(n, dtype=np.float32)
        self.expect: F32 = np.empty(n, dtype=np.float32)
        self.one: F32 = np.zeros(1, dtype=np.float32)

    def barrier(self) -> None:
        """A 1-element allreduce: every rank enters the timed call at about the same time."""
        self.api.allreduce(self.one, self.api.Op.SUM)

    def _allreduce_iter(self, n: int, it: int) -> tuple[float, float]:
        c = np.float32(it % 13)
        a, e, base = self.buf[:n], self.expect[:n], self.pattern[:n]
        np.multiply(base, np.float32(self.rank + 1), out=a)
        a += c
        self.barrier()
        t0 = time.perf_counter()
        res = self.api.allreduce(a, self.api.Op.SUM)
        t1 = time.perf_counter()
        # sum over r of (r+1)*base + c  =  N(N+1)/2 * base + N*c, exact in float32
        np.multiply(base, np.float32(self.world * (self.world + 1) // 2), out=e)
        e += np.float32(self.world) * c
        self._check(res, e, "allreduce", n, it)
        return t0, t1

    def _broadcast_iter(self, n: int, it: int) -> tuple[float, float]:
        a, e, base = self.buf[:n], self.expect[:n], self.pattern[:n]
        np.multiply(base, np.float32(it % 13 + 1), out=e)
        if self.rank == 0:
            a[...] = e
        else:
            a.fill(-1.0)  # must be overwritten by the root's bytes
        self.barrier()
        t0 = time.perf_counter()
        res = self.api.broadcast(a, 0)
        t1 = time.perf_counter()
        self._check(res, e, "broadcast", n, it)
        return t0, t1

    def _check(self, res: Any, expect: F32, op: str, n: int, it: int) -> None:
        ok = (
            isinstance(res, np.ndarray)
            and res.dtype == np.float32
            and res.size == n
            and np.array_equal(res.reshape(-1), expect)
        )
        if not ok:
            raise SystemExit(f"rank {self.rank}: wrong {op} result, {4 * n} B, iteration {it}")

    def run(
        self, op: str, size: int, iters: int, warmup: int
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Time ``iters`` iterations; returns per-iteration (slowest rank, span) on all ranks.

        ``slowest`` is the MAX over ranks of each rank's own call duration. ``span`` is the
        peer-baseline metric, first rank in to last rank out: ``perf_counter`` is the
        system-wide CLOCK_MONOTONIC on Linux, so it is meaningful when every rank runs on one
        host (``--cluster local``).
        """
        n = size // 4
        step: Callable[[int, int], tuple[float, float]] = (
            self._allreduce_iter if op == "allreduce" else self._broadcast_iter
        )
        for w in range(warmup):
            step(n, w)
        starts = np.empty(iters, dtype=np.float64)
        ends = np.empty(iters, dtype=np.float64)
        for i in range(iters):
            starts[i], ends[i] = step(n, warmup + i)
        slowest = np.array(self.api.allreduce(ends - starts, self.api.Op.MAX))
        first_in = np.array(self.api.allreduce(starts, self.api.Op.MIN))
        last_out = np.array(self.api.allreduce(ends, self.api.Op.MAX))
        return slowest, last_out - first_in


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of the worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", help="JSON-lines file written by rank 0 (default: stdout only)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    ap.add_argument("--ops", default="allreduce,broadcast")
    ap.add_argument("--iters", type=int, help="iterations per size (default: adapts to size)")
    ap.add_argument("--iters-scale", type=float, default=1.0, help="multiplies default iters")
    ap.add_argument("--warmup", type=int, help="untimed iterations (default: iters/20, >= 2)")
    ap.add_argument("--warmup-mb", type=float, default=0.0,
                    help="at least this many MB of each size untimed first (e.g. 260 fills "
                         "the default 256 MB replay store: steady-state figures)")
    ap.add_argument("--quick", action="store_true", help="about 10x fewer iterations")
    ap.add_argument("--impl", default="rabit2", help="label stored in the JSON lines")
    ap.add_argument("rabit_args", nargs="*", metavar="k=v", help="passed to rabit2.init")
    ns = ap.parse_args(argv)
    ns.sizes = [parse_size(s) for s in ns.sizes.split(",") if s]
    ns.ops = [o for o in ns.ops.split(",") if o]
    if not ns.sizes or any(o not in ("allreduce", "broadcast") for o in ns.ops):
        ap.error("need at least one size; ops are allreduce and/or broadcast")
    if any("=" not in kv for kv in ns.rabit_args):
        ap.error("extra arguments must be k=v")
    if ns.quick:
        ns.iters_scale *= 0.1
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Run every (op, size), print a line per result on rank 0 and write ``--out``."""
    ns = parse_args(argv)
    import rabit2  # noqa: PLC0415 -- after argument parsing, so --help works without a tracker

    api: Any = rabit2
    api.init(ns.rabit_args)
    rank, world = int(api.get_rank()), int(api.get_world_size())
    bench = Bench(api, rank, world, max(ns.sizes))
    out = open(ns.out, "w") if (ns.out and rank == 0) else None  # noqa: SIM115
    try:
        for op in ns.ops:
            for size in ns.sizes:
                iters = ns.iters or max(3, round(default_iters(size) * ns.iters_scale))
                warmup = ns.warmup if ns.warmup is not None else max(2, iters // 20)
                warmup = max(warmup, math.ceil(ns.warmup_mb * (1 << 20) / size))
                times, span = bench.run(op, size, iters, warmup)
                if rank != 0:
                    continue
                row: dict[str, Any] = {
                    "impl": ns.impl,
                    "op": op,
                    "dtype": "float32",
                    "world": world,
                    "size_bytes": size,
                    "iters": iters,
                    **summarise(times, size, world, op),
                    "span_median_s": float(np.median(span)),
                    "span_p90_s": float(np.percentile(span, 90)),
                }
                print(
                    f"{op:9s} N={world} {size:>10d} B  median {row['median_s'] * 1e6:10.1f} us"
                    f"  p90 {row['p90_s'] * 1e6:10.1f} us  busbw {row['busbw_GBps']:.3f} GB/s",
                    flush=True,
                )
                if out is not None:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out is not None:
            out.close()
    api.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
