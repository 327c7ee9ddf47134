"""What frame checksums cost: the same collectives with ``rabit2_checksum`` on and off, side
by side (alternating jobs, so both settings see the same machine noise).

    python bench/checksum_cost.py                       # N = 2 and 4, 4K..64M, 3 rounds
    python bench/checksum_cost.py --n 2 --sizes 64M --rounds 5

Each job runs ``bench_collectives.py`` under ``rabit2-submit`` (recovery on, the default
launch); a round runs one job per setting, in alternating order.  Printed: per (op, N, size)
the median over rounds of each setting's median call time, and their ratio (on / off).
The figures, their date and machine: ``docs/performance.md`` ("Checksums"); every run:
``bench/results/checksums.csv``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from run import WORKER, run_job, submit_cmd
from units import fmt_size, fmt_time

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="2,4", help="world sizes, e.g. 2,4")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--ops", default="allreduce,broadcast")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="~10x fewer iterations per job")
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--timeout", type=float, default=900)
    ns = ap.parse_args(argv)
    ns.results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    submit = submit_cmd(None)
    # (op, n, size) -> setting -> medians, one per round
    medians: dict[tuple[str, int, int], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for rnd in range(ns.rounds):
        for n in (int(x) for x in ns.n.split(",")):
            order = ("1", "0") if rnd % 2 == 0 else ("0", "1")
            for setting in order:
                part = ns.results / f"{stamp}-checksum{setting}-n{n}-r{rnd}.jsonl"
                cmd = [*submit, "--cluster", "local", "-n", str(n), "--", sys.executable,
                       str(WORKER), "--out", str(part), "--sizes", ns.sizes, "--ops", ns.ops,
                       *(["--quick"] if ns.quick else []), f"rabit2_checksum={setting}"]
                run_job(cmd, part.with_suffix(".log"), ns.timeout)
                for line in part.read_text().splitlines():
                    row = json.loads(line)
                    key = (row["op"], row["world"], row["size_bytes"])
                    medians[key]["on" if setting == "1" else "off"].append(row["median_s"])
    print(f"\n### Checksums on / off ({ns.rounds} rounds, median of per-job medians)\n")
    print("| op | N | size | off | on | on / off |")
    print("|---|---|---|---|---|---|")
    for (op, n, size), by in sorted(medians.items()):
        off, on = statistics.median(by["off"]), statistics.median(by["on"])
        print(f"| {op} | {n} | {fmt_size(size)} | {fmt_time(off)} | {fmt_time(on)} | "
              f"{on / off:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
