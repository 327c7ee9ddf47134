"""A call right after compute, as in a training loop: two workers compute for ``--gap-ms``
(a busy numpy loop, a different length on each rank and call, up to 30 % longer), then make
one float32 SUM allreduce of ``--size`` bytes; "after ready" is the time from the later
rank's call to the later return (``perf_counter`` is one clock for every process of a host).

Run over rabit2 (``rabit2-submit --cluster local``, recovery on unless ``--recover off``) and
over XGBoost 1.7.6's classic rabit engine (``bench/peers/.venv17``, made by
``bench/peers/setup.sh xgb17``; its own tracker, TCP_NODELAY on, workers not pinned, as in
``bench/peers/gbdt_compare.py``).  For rabit2 it also prints where the time went, medians
from the later rank's call (L: the later rank, F: the one that waited): the API and holding
the loop, the express write, L's last read and its return, when F's sleep in epoll ended,
F's last read and its return, and L's thread CPU time for its call.  The clock readings
wrap a few internal functions (as ``bench/express_stages.py`` does) and add about a
microsecond each.

``--checkpoint-every K``: rabit2 checkpoints (a tiny model) after every K calls, as a training
loop does after each round; the replay store then recycles the buffers of the results it
drops instead of keeping every result in fresh memory until ``rabit2_replay_mb`` is full.

    python bench/after_compute.py [--size 409600] [--gap-ms 1,20] [--calls 60]
                                  [--impls rabit2,classic] [--recover on|off]
                                  [--checkpoint-every K]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VENV17_PYTHON = HERE / "peers" / ".venv17" / "bin" / "python"
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)}
WARMUP = 5


def _compute(work: Any, gap: float, i: int, rank: int) -> None:
    end = time.perf_counter() + gap * (1 + 0.3 * ((i * 7 + rank * 3) % 5) / 5)
    while time.perf_counter() < end:
        work.sum()


def _after_ready(starts: Any, ends: Any) -> Any:
    """Per call: the later rank's start to the later return (arrays: rank x call)."""
    return ends.max(axis=0) - starts.max(axis=0)


class _Clocks:
    """The last reading of each kind in the call under way: ``h`` hold returned, ``w`` a
    write returned, ``r`` a read returned, ``s``/``S`` a sleep in epoll began/ended."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def mark(self, kind: str) -> None:
        self.at[kind] = time.perf_counter()


def _instrument(clocks: _Clocks) -> None:
    from rabit2.io import driving, express, express_wire, loop_thread  # noqa: PLC0415

    class _Os:
        @staticmethod
        def writev(fd: int, buffers: Any) -> int:
            n = os.writev(fd, buffers)
            clocks.mark("w")
            return n

        @staticmethod
        def readv(fd: int, buffers: Any) -> int:
            n = os.readv(fd, buffers)
            clocks.mark("r")
            return n

    express_wire.os = _Os  # type: ignore[assignment,attr-defined]
    express.os = _Os  # type: ignore[assignment,attr-defined]
    hold = loop_thread.LoopThread.hold

    def timed_hold(self: Any, timeout: float) -> bool:
        held = hold(self, timeout)
        clocks.mark("h")
        return held

    loop_thread.LoopThread.hold = timed_hold  # type: ignore[method-assign]
    wait = driving.Driver.wait

    def timed_wait(self: Any, epoll: Any, now: float, end: float) -> Any:
        sleeps = now >= self._spin_end
        if sleeps:
            clocks.mark("s")
        events = wait(self, epoll, now, end)
        if sleeps:
            clocks.mark("S")
        return events

    driving.Driver.wait = timed_wait  # type: ignore[method-assign]


def rabit2_worker(size: int, gap: float, calls: int, every: int) -> None:
    import numpy as np  # noqa: PLC0415

    import rabit2  # noqa: PLC0415

    clocks = _Clocks()
    _instrument(clocks)
    rabit2.init()
    rabit2.load_checkpoint()
    rank, world = rabit2.get_rank(), rabit2.get_world_size()
    buf = np.ones(size // 4, dtype=np.float32)
    work = np.random.default_rng(rank).random(1 << 16)
    kinds = ("h", "w", "s", "S", "r")
    rows = []
    for i in range(calls + WARMUP):
        _compute(work, gap, i, rank)
        buf[:] = 1
        clocks.at.clear()
        cpu, start = time.thread_time(), time.perf_counter()
        rabit2.allreduce(buf, rabit2.Op.SUM)
        end, cpu = time.perf_counter(), time.thread_time() - cpu
        assert (buf == world).all()
        if i >= WARMUP:
            rows.append([start, end, cpu, *(clocks.at.get(k, np.nan) for k in kinds)])
        if every and (i + 1) % every == 0:
            rabit2.checkpoint({"calls": i + 1})
    table = np.asarray(rabit2.allgather(np.asarray(rows).ravel())).reshape(world, calls, -1)
    if rank == 0:
        print(json.dumps(_rabit2_report(np, table)), flush=True)
    rabit2.finalize()


def _rabit2_report(np: Any, table: Any) -> dict[str, Any]:
    calls = np.arange(table.shape[1])
    later = np.argmax(table[:, :, 0], axis=0)
    late, first = table[later, calls], table[1 - later, calls]
    ready = late[:, 0]

    def us(values: Any) -> float | None:
        values = values[np.isfinite(values)]
        return round(float(np.median(values)) * 1e6, 1) if len(values) else None

    after = _after_ready(table[:, :, 0], table[:, :, 1])
    return {
        "after_ready_us": us(after), "p90_us": round(float(np.percentile(after, 90)) * 1e6, 1),
        "L_api_and_hold": us(late[:, 3] - ready), "L_write": us(late[:, 4] - ready),
        "L_last_read": us(late[:, 7] - ready), "L_return": us(late[:, 1] - ready),
        "L_cpu": us(late[:, 2]),
        "F_slept_share": round(float(np.mean(np.isfinite(first[:, 5]))), 2),
        "F_woke": us(first[:, 6] - ready), "F_last_read": us(first[:, 7] - ready),
        "F_return": us(first[:, 1] - ready),
        "F_waited_ms": round(float(np.median(ready - first[:, 0])) * 1e3, 2),
    }


def classic_worker(size: int, gap: float, calls: int, out: str) -> None:
    import numpy as np  # noqa: PLC0415
    from xgboost import collective  # noqa: PLC0415

    collective.init(**json.loads(os.environ["RABIT2_BENCH_XGB_ARGS"]))
    rank = collective.get_rank()
    buf = np.ones(size // 4, dtype=np.float32)
    work = np.random.default_rng(rank).random(1 << 16)
    rows = []
    for i in range(calls + WARMUP):
        _compute(work, gap, i, rank)
        buf[:] = 1
        start = time.perf_counter()
        buf[...] = collective.allreduce(buf, collective.Op.SUM)  # (1.7 returns a copy)
        end = time.perf_counter()
        if i >= WARMUP:
            rows.append((start, end))
    np.save(f"{out}.{rank}.npy", np.asarray(rows))
    collective.finalize()


def classic_job(size: int, gap: float, calls: int) -> None:
    """(In the 1.7 venv.)  The tracker and two workers; prints the JSON report."""
    import tempfile  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from xgboost.tracker import RabitTracker  # noqa: PLC0415

    tracker: Any = RabitTracker(host_ip="127.0.0.1", n_workers=2)  # (1.7: worker_envs)
    tracker.start(2)
    args = {**tracker.worker_envs(), "rabit_enable_tcp_no_delay": "true"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", "classic", "--size", str(size),
             "--gap-ms", str(gap * 1e3), "--calls", str(calls), "--out", out],
            env={**os.environ, "RABIT2_BENCH_XGB_ARGS": json.dumps(
                {**args, "DMLC_TASK_ID": f"task-{i}"})}) for i in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
        tracker.join()
        if max(codes):
            sys.exit(max(codes))
        table = np.stack([np.load(f"{out}.{r}.npy") for r in range(2)])
    after = _after_ready(table[:, :, 0], table[:, :, 1])
    print(json.dumps({"after_ready_us": round(float(np.median(after)) * 1e6, 1),
                      "p90_us": round(float(np.percentile(after, 90)) * 1e6, 1)}), flush=True)


def run(impl: str, size: int, gap_ms: float, calls: int, recover: str,
        every: int) -> dict[str, Any]:
    common = ["--size", str(size), "--gap-ms", str(gap_ms), "--calls", str(calls)]
    if impl == "classic":
        cmd = [str(VENV17_PYTHON), __file__, "--classic-job", *common]
        env = dict(os.environ)
    else:
        cmd = ["rabit2-submit", "--cluster", "local", "-n", "2",
               *(["--env", "RABIT2_RECOVER=0"] if recover == "off" else []),
               "--", sys.executable, __file__, "--worker", "rabit2", *common,
               "--checkpoint-every", str(every)]
        env = CHECKOUT_ENV
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env,
                          check=False)
    for line in (proc.stdout + proc.stderr).splitlines():
        start = line.find("{")
        if start >= 0 and "after_ready_us" in line:
            report: dict[str, Any] = json.loads(line[start:])
            return report
    raise RuntimeError(f"{impl} produced no report:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=409_600, help="bytes per call")
    parser.add_argument("--gap-ms", default="1,20", help="comma-separated compute gaps")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--impls", default="rabit2,classic")
    parser.add_argument("--recover", choices=("on", "off"), default="on")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="rabit2 checkpoints after every K calls (default: never)")
    parser.add_argument("--worker", choices=("rabit2", "classic"), help=argparse.SUPPRESS)
    parser.add_argument("--classic-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "rabit2":
        rabit2_worker(args.size, float(args.gap_ms) / 1e3, args.calls, args.checkpoint_every)
        return 0
    if args.worker == "classic":
        classic_worker(args.size, float(args.gap_ms) / 1e3, args.calls, args.out)
        return 0
    if args.classic_job:
        classic_job(args.size, float(args.gap_ms) / 1e3, args.calls)
        return 0
    impls = args.impls.split(",")
    if "classic" in impls and not VENV17_PYTHON.exists():
        print("classic engine unavailable: run bench/peers/setup.sh xgb17 first; skipped",
              file=sys.stderr)
        impls.remove("classic")
    for gap in (float(g) for g in args.gap_ms.split(",")):
        for impl in impls:
            report = run(impl, args.size, gap, args.calls, args.recover, args.checkpoint_every)
            print(f"{args.size} B, gap {gap:g} ms, {impl}: {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
