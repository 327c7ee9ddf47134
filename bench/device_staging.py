"""What staging through host memory costs a cupy allreduce: float32 SUM over two workers
(``rabit2-submit --cluster local``, recovery on), a numpy array and a cupy array of the same
size in alternating rounds, medians per size; beside them the staging alone (the device to
host copy and back, no collective) in one process.  Needs cupy and a CUDA device.

    python bench/device_staging.py [--sizes 4K,64K,1M,16M,64M] [--calls 30] [--rounds 3]
                                   [--out results.csv]

The host copies are page-locked (``rabit2/device.py``); the "pageable" column stages the same
calls through plain numpy memory instead (``cupy.asnumpy``), for comparison.
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

import numpy as np

HERE = Path(__file__).resolve().parent
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def _label(nbytes: int) -> str:
    for suffix, unit in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def _worker(sizes: list[int], ncalls: int, rounds: int) -> None:
    import cupy as cp  # noqa: PLC0415 - the bench needs the gpu extra

    import rabit2  # noqa: PLC0415
    from rabit2 import calls  # noqa: PLC0415

    pinned = calls.to_host

    def pageable(data: Any) -> np.ndarray:
        return np.ascontiguousarray(cp.asnumpy(data))

    rabit2.init()
    rank = rabit2.get_rank()
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for nbytes in sizes:
            host = np.ones(nbytes // 4, dtype=np.float32)
            dev = cp.ones(nbytes // 4, dtype=cp.float32)
            for kind, data in (("numpy", host), ("cupy", dev), ("pageable", dev)):
                calls.to_host = pageable if kind == "pageable" else pinned
                for i in range(ncalls + 3):
                    rabit2.allreduce(np.zeros(1, np.uint8), rabit2.MAX)  # line the ranks up
                    t0 = time.perf_counter()
                    rabit2.allreduce(data, rabit2.SUM)
                    if kind != "numpy":
                        cp.cuda.get_current_stream().synchronize()
                    if i >= 3:
                        times.setdefault(f"{kind} {nbytes}", []).append(
                            time.perf_counter() - t0)
    if rank == 0:
        staging = _staging(sizes, ncalls)
        print("TIMES " + json.dumps({"times": times, "staging": staging}), flush=True)
    rabit2.finalize()


def _staging(sizes: list[int], calls: int) -> dict[int, float]:
    """Median seconds of the device-to-host copy and back alone, per size."""
    import cupy as cp  # noqa: PLC0415

    from rabit2.device import copy_into, to_host  # noqa: PLC0415

    out = {}
    for nbytes in sizes:
        dev = cp.ones(nbytes // 4, dtype=cp.float32)
        samples = []
        for _ in range(calls + 3):
            t0 = time.perf_counter()
            copy_into(dev, to_host(dev))
            cp.cuda.get_current_stream().synchronize()
            samples.append(time.perf_counter() - t0)
        out[nbytes] = float(np.median(samples[3:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    if args.worker:
        _worker(sizes, args.calls, args.rounds)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "2",
         "--max-attempts", "3", "--", sys.executable, str(Path(__file__).resolve()),
         "--worker", "--sizes", args.sizes, "--calls", str(args.calls),
         "--rounds", str(args.rounds)],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    line = next((x.split("TIMES ", 1)[1] for x in proc.stdout.splitlines()
                 if "TIMES " in x), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"the job failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    found = json.loads(line)
    times, staging = found["times"], {int(k): v for k, v in found["staging"].items()}
    rows = ["size,numpy_us,cupy_us,ratio,pageable_us,staging_alone_us"]
    for nbytes in sizes:
        host, dev, page = (float(np.median(times[f"{kind} {nbytes}"])) * 1e6
                           for kind in ("numpy", "cupy", "pageable"))
        rows.append(f"{_label(nbytes)},{host:.1f},{dev:.1f},{dev / host:.2f},{page:.1f},"
                    f"{staging[nbytes] * 1e6:.1f}")
    print("\n".join(rows))
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
