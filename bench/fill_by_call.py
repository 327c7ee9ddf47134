"""What the replay store's first fill costs, call by call: ``--n`` workers under
``rabit2-submit --cluster local`` make ``--calls`` float32 SUM allreduces of ``--size`` bytes,
each after a 1-element allreduce (as ``bench/peers`` times them), in a loop that never
checkpoints.  Each rank prints its minor page faults per call and the median of each window
of ``--window`` calls, in microseconds.  With recovery on, every result is kept in fresh
memory until ``rabit2_replay_mb`` is full (``docs/recovery.md``, "Results"); ``--recover off``
runs the same loop with nothing kept.  Alternate the two with ``--rounds``.

    python bench/fill_by_call.py [--n 2] [--size 1048576] [--calls 600] [--rounds 2]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from run import CHECKOUT_ENV

import rabit2

CHECKOUT = str(Path(__file__).resolve().parent.parent)


def worker(size: int, calls: int, window: int) -> None:
    rabit2.init()
    rank = rabit2.get_rank()
    data = np.ones(size // 4, dtype=np.float32)
    one = np.zeros(1, dtype=np.float32)
    spent = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(calls):
        rabit2.allreduce(one, rabit2.Op.SUM)
        data.fill(i % 13)
        start = time.perf_counter()
        rabit2.allreduce(data, rabit2.Op.SUM)
        spent.append(time.perf_counter() - start)
        if data[0] != (i % 13) * rabit2.get_world_size():
            raise SystemExit(f"rank {rank}: wrong result at call {i}")
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
    medians = " ".join(f"{np.median(spent[at:at + window]) * 1e6:.0f}"
                       for at in range(0, calls, window))
    print(f"FILL rank {rank}: {faults:.1f} faults/call; us per window of {window}: {medians}",
          flush=True)
    rabit2.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes per call")
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--recover", choices=("on", "off", "both"), default="both")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size, args.calls, args.window)
        return
    settings = ("on", "off") if args.recover == "both" else (args.recover,)
    for rnd in range(1, args.rounds + 1):
        for recover in settings:
            out = subprocess.run(
                [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n",
                 str(args.n), *(() if recover == "on" else ("--env", "RABIT2_RECOVER=0")),
                 "--", sys.executable, __file__, "--worker", "--size", str(args.size), "--calls",
                 str(args.calls), "--window", str(args.window)],
                capture_output=True, text=True, check=False, timeout=900, env=CHECKOUT_ENV,
                cwd=CHECKOUT)
            lines = sorted(line.split("FILL ", 1)[1] for line in
                           (out.stdout + out.stderr).splitlines() if "FILL rank" in line)
            print(f"round {rnd}, recovery {recover}:", flush=True)
            print("\n".join(f"  {line}" for line in lines) if lines
                  else (out.stdout + out.stderr)[-3000:], flush=True)


if __name__ == "__main__":
    main()
