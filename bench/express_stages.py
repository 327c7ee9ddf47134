"""Where an express call's time goes (``docs/design.md``, "Express calls"): two workers under
``rabit2-submit --cluster local`` make back-to-back float32 SUM allreduces (or broadcasts from
rank 0: ``--op broadcast``) at N=2, with a clock read around each stage of the call (each
stage's function wrapped once; the wrappers add a few tenths of a microsecond per stage to
the whole call).  Prints, per rank, the median of the whole call and of each stage; what the
stages leave out is the API's own work.  Back to back, a broadcast's receiver waits for the
root in its ``receive`` stages.

    python bench/express_stages.py [--size 4096] [--calls 20000] [--runs 1] [--op allreduce]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

STAGES = ("hold", "prepare", "write", "receive", "lay_out", "done", "release")


def _timed(owner: Any, name: str, stage: str, spent: dict[str, list[int]]) -> None:
    """Wrap ``owner.name`` so that each call's nanoseconds go to ``spent[stage]``."""
    inner: Callable[..., Any] = getattr(owner, name)
    clock = time.perf_counter_ns
    sink = spent[stage]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(clock() - start)

    setattr(owner, name, wrapper)


class _Os:
    """``os`` for ``rabit2.io.express_wire``, with ``writev`` timed."""

    def __init__(self, spent: dict[str, list[int]]) -> None:
        self._spent = spent["write"]
        self.readv = os.readv

    def writev(self, fd: int, buffers: Any) -> int:
        start = time.perf_counter_ns()
        try:
            return os.writev(fd, buffers)
        finally:
            self._spent.append(time.perf_counter_ns() - start)


def worker(size: int, calls: int, op: str) -> None:
    import numpy as np  # noqa: PLC0415

    import rabit2  # noqa: PLC0415
    from rabit2.core.express import Express  # noqa: PLC0415
    from rabit2.core.express_broadcast import ExpressBroadcasts  # noqa: PLC0415
    from rabit2.io import express_wire  # noqa: PLC0415
    from rabit2.io.express import ExpressIO  # noqa: PLC0415
    from rabit2.io.loop_thread import LoopThread  # noqa: PLC0415

    spent: dict[str, list[int]] = {stage: [] for stage in STAGES}
    rabit2.init()
    a = np.ones(size // 4, np.float32)
    for _ in range(1000):
        rabit2.allreduce(a, rabit2.Op.SUM)
        a[:] = 1
    _timed(LoopThread, "hold", "hold", spent)
    _timed(LoopThread, "release", "release", spent)
    staged = ExpressBroadcasts if op == "broadcast" else Express
    _timed(staged, "prepare", "prepare", spent)
    _timed(staged, "done", "done", spent)
    _timed(ExpressBroadcasts, "lay_out", "lay_out", spent)
    _timed(ExpressIO, "_receive", "receive", spent)
    express_wire.os = _Os(spent)  # type: ignore[assignment]
    whole = []
    clock = time.perf_counter_ns
    rank = rabit2.get_rank()
    for i in range(calls):
        a[:] = 1 if op == "allreduce" else (i % 7 if rank == 0 else -1)
        start = clock()
        if op == "allreduce":
            rabit2.allreduce(a, rabit2.Op.SUM)
        else:
            rabit2.broadcast(a, 0)
        whole.append(clock() - start)
    assert (a == (2 if op == "allreduce" else (calls - 1) % 7)).all()
    parts = [f"call {statistics.median(whole) / 1e3:.1f}"]
    parts += [f"{stage} {statistics.median(v) / 1e3:.1f}" if v else f"{stage} -"
              for stage, v in spent.items()]
    print(f"rank {rabit2.get_rank()} {size} B, us (medians): " + ", ".join(parts), flush=True)
    rabit2.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="bytes per call")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--op", choices=("allreduce", "broadcast"), default="allreduce")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size, args.calls, args.op)
        return
    for _ in range(args.runs):
        out = subprocess.run(
            ["rabit2-submit", "--cluster", "local", "-n", "2", "--", sys.executable, __file__,
             "--worker", "--size", str(args.size), "--calls", str(args.calls),
             "--op", args.op],
            capture_output=True, text=True, check=False, timeout=600)
        lines = [line for line in (out.stdout + out.stderr).splitlines() if " B, us " in line]
        print("\n".join(lines) if lines else out.stdout + out.stderr, flush=True)


if __name__ == "__main__":
    main()
