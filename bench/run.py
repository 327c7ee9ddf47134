"""Benchmark driver: runs bench_collectives.py under ``rabit2-submit`` for several world sizes.

    python bench/run.py                 # N = 2 and 4, all sizes, both ops
    python bench/run.py --quick         # ~10x fewer iterations
    python bench/run.py --n 2,4 --gbdt  # also the GBDT example at --size bench

Raw JSON lines go to ``bench/results/<stamp>.jsonl`` (git-ignored); a markdown table is printed.
See bench/README.md for what the columns mean.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from units import fmt_size, fmt_time

HERE = Path(__file__).resolve().parent
# the workers import this checkout's rabit2, whatever copy pip installed (a script in
# bench/ would otherwise find the installed one first)
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)}
WORKER = HERE / "bench_collectives.py"


def submit_cmd(override: str | None) -> list[str]:
    """The launcher: ``--submit`` if given, else ``rabit2-submit`` on PATH, else the module."""
    if override:
        return shlex.split(override)
    exe = shutil.which("rabit2-submit")
    return [exe] if exe else [sys.executable, "-m", "tracker.submit"]


def run_job(cmd: list[str], log: Path, timeout: float) -> str:
    """Run one launcher job, tee its output to ``log``; raise with the tail on failure."""
    print("$", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
        env=CHECKOUT_ENV,
    )
    log.write_text(proc.stdout)
    print(f"  exit {proc.returncode} after {time.perf_counter() - t0:.1f} s, log {log}")
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise SystemExit(f"job failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout






def table(rows: list[dict[str, Any]], worlds: Sequence[int]) -> str:
    """Markdown: one table per op, a row per size, median / p90 / busbw per world size."""
    out: list[str] = []
    for op in dict.fromkeys(r["op"] for r in rows):
        head = ["size"]
        for n in worlds:
            head += [f"N={n} median", f"N={n} p90", f"N={n} busbw GB/s", f"N={n} span"]
        out += [f"### {op} (float32{' SUM' if op == 'allreduce' else ', root 0'})", ""]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for size in sorted({r["size_bytes"] for r in rows if r["op"] == op}):
            cells = [fmt_size(size)]
            for n in worlds:
                hit = [r for r in rows if (r["op"], r["size_bytes"], r["world"]) == (op, size, n)]
                if hit:
                    r = hit[0]
                    span = r.get("span_median_s")
                    cells += [
                        fmt_time(r["median_s"]),
                        fmt_time(r["p90_s"]),
                        f"{r['busbw_GBps']:.3f}",
                        fmt_time(span) if span is not None else "-",
                    ]
                else:
                    cells += ["-"] * 4
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


_FINAL = re.compile(
    r"gbdt rank=(\d+) world=(\d+) trees=(\d+) train_logloss=(\S+) "
    r"train_error=(\S+) allreduce_s=(\S+) digest=([0-9a-f]{64})"
)


def run_gbdt(
    submit: list[str], n: int, args: list[str], log: Path, timeout: float
) -> dict[str, Any]:
    """The GBDT example at ``--size bench``; allreduce time of rank 0 and the digests."""
    cmd = [
        *submit,
        "--cluster",
        "local",
        "-n",
        str(n),
        "--",
        sys.executable,
        "-m",
        "rabit2.examples.gbdt",
        "--size",
        "bench",
        *args,
    ]
    t0 = time.perf_counter()
    text = run_job(cmd, log, timeout)
    wall = time.perf_counter() - t0
    finals = {int(m[1]): m for m in _FINAL.finditer(text)}
    if sorted(finals) != list(range(n)):
        raise SystemExit(f"gbdt N={n}: expected a final line from every rank, see {log}")
    digests = {m[7] for m in finals.values()}
    r0 = finals[0]
    return {
        "impl": "rabit2",
        "op": "gbdt-bench",
        "world": n,
        "trees": int(r0[3]),
        "train_logloss": float(r0[4]),
        "allreduce_s": float(r0[6]),
        "allreduce_s_max": max(float(m[6]) for m in finals.values()),
        "job_wall_s": wall,
        "digest": r0[7],
        "digests_agree": len(digests) == 1,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, run the jobs, write the raw results and print the tables."""
    ap = argparse.ArgumentParser(description="Run the rabit2 collective benchmarks.")
    ap.add_argument(
        "--n",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[2, 4],
        help="comma-separated world sizes (default 2,4)",
    )
    ap.add_argument("--quick", action="store_true", help="~10x fewer iterations")
    ap.add_argument("--sizes", help="e.g. 4K,64K,1M,16M,64M (worker default)")
    ap.add_argument("--ops", help="allreduce,broadcast (default both)")
    ap.add_argument("--iters", type=int, help="fixed iterations per size")
    ap.add_argument("--gbdt", action="store_true", help="also run the GBDT example (--size bench)")
    ap.add_argument("--gbdt-only", action="store_true", help="only the GBDT example")
    ap.add_argument("--submit", help="launcher command (default: rabit2-submit)")
    ap.add_argument("--recover", choices=("on", "off"), default="on",
                    help="fault tolerance as rabit2-submit sets it (on, the default) or off "
                         "(RABIT2_RECOVER=0; the figures before 2026-11-23 are without it)")
    ap.add_argument("--results", type=Path, default=HERE / "results", help="output directory")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("worker_args", nargs="*", metavar="k=v", help="passed to rabit2.init")
    ns = ap.parse_args(argv)

    submit = submit_cmd(ns.submit)
    if ns.recover == "off":
        submit += ["--env", "RABIT2_RECOVER=0"]
    ns.results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    raw = ns.results / f"{stamp}.jsonl"
    rows: list[dict[str, Any]] = []
    extra: list[str] = []
    for flag, val in (("--sizes", ns.sizes), ("--ops", ns.ops), ("--iters", ns.iters)):
        if val is not None:
            extra += [flag, str(val)]
    if ns.quick:
        extra.append("--quick")

    if not ns.gbdt_only:
        for n in ns.n:
            part = ns.results / f"{stamp}-collectives-n{n}.jsonl"
            cmd = [
                *submit,
                "--cluster",
                "local",
                "-n",
                str(n),
                "--",
                sys.executable,
                str(WORKER),
                "--out",
                str(part),
                *extra,
                *ns.worker_args,
            ]
            run_job(cmd, ns.results / f"{stamp}-collectives-n{n}.log", ns.timeout)
            rows += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]

    gbdt_rows: list[dict[str, Any]] = []
    if ns.gbdt or ns.gbdt_only:
        gargs = ["--trees", "3"] if ns.quick else []
        for n in ns.n:
            log = ns.results / f"{stamp}-gbdt-n{n}.log"
            gbdt_rows.append(run_gbdt(submit, n, [*gargs, *ns.worker_args], log, ns.timeout))

    with raw.open("w") as f:
        for r in rows + gbdt_rows:
            f.write(json.dumps(r) + "\n")

    print()
    if rows:
        print(table(rows, ns.n))
    if gbdt_rows:
        print("### GBDT example, --size bench (rank 0 time inside allreduce)\n")
        print("| N | trees | allreduce_s | job wall | train logloss | digests agree |")
        print("|---|---|---|---|---|---|")
        for g in gbdt_rows:
            print(
                f"| {g['world']} | {g['trees']} | {g['allreduce_s']:.3f} s | "
                f"{g['job_wall_s']:.1f} s | {g['train_logloss']:.6f} | {g['digests_agree']} |"
            )
    print(f"raw results: {raw}")
    # The example is bit-identical by construction: any disagreement is a correctness bug.
    if gbdt_rows and (
        len({g["digest"] for g in gbdt_rows}) > 1 or not all(g["digests_agree"] for g in gbdt_rows)
    ):
        print("ERROR: GBDT digests differ between ranks or world sizes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
