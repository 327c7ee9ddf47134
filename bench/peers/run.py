"""Side-by-side benchmark: rabit2 and its peers, same workload, same harness, one run.

    python bench/peers/run.py                  # N = 2 and 4, 4 KiB .. 64 MiB, both ops
    python bench/peers/run.py --quick          # ~10x fewer iterations
    python bench/peers/run.py --n 2 --sizes 4K,64M --impls rabit2,gloo --out /tmp/p
    python bench/peers/run.py --n 2 --sizes 1M --impls rabit2-noft,xgboost1.7 --rounds 9 \
        --base rabit2-noft                     # paired rounds on a noisy machine

Implementations (each with its own launcher; see the ``peer_*.py`` adapters):
``rabit2`` (``rabit2-submit``), ``xgboost1.7`` (the classic rabit engine, its own tracker, in
``bench/peers/.venv17``), ``xgboost3`` (``xgboost.collective`` + its tracker), ``gloo``
(``torchrun``), ``mpi-tcp`` / ``mpi-shm`` (``mpirun``). ``setup.sh`` installs the peers and
is called first (skip with ``--skip-setup``); a peer that cannot be installed or run is
reported as ``unavailable: <reason>`` (or ``failed: <reason>`` if its job broke).

The workload and the timing are in ``harness.py``; the physical limits in ``limits.py``.
Results go to ``--out`` (default ``bench/results/peers-<stamp>/``): ``results.jsonl`` (one
line per impl, N, op and size), ``tables.md`` (also printed) and one log per job.

``--rounds K`` runs every job K times, the implementations alternating within each round (in
reverse order every other round), so that each round compares them under the same machine
state.  A cell is then the median over the rounds of each round's median, and a ratio is the
median of the per-round ratios, with the number of rounds the base implementation won.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from common import HERE, MAIN_PYTHON
from harness import COMPUTE_KINDS
from targets import combine_rounds, paired_ratio, verdicts

sys.path.insert(0, str(HERE.parent))  # bench/units.py
from units import fmt_size, fmt_time, parse_size

REPO = HERE.parent.parent
ADAPTERS = ["peer_rabit2", "peer_xgb", "peer_gloo", "peer_mpi"]
#: Table order: rabit2 first, then the TCP peers, shared-memory MPI last.
ORDER = [
    "rabit2", "rabit2-ckpt", "rabit2-noft", "xgboost1.7", "xgboost3", "gloo", "mpi-tcp", "mpi-shm",
]
DEFAULT_SIZES = "4K,64K,1M,16M,64M"








# ---------------------------------------------------------------------------- running jobs


def run_cmd(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int, str]:
    """Run ``argv`` in its own session, output to ``log``; kill its group on timeout."""
    with log.open("w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
            cwd=REPO,
        )
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job's own process group only
            proc.wait()
            return -1, f"timed out after {timeout:.0f} s"
    if rc == 0:
        return 0, ""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    wrong = [ln for ln in lines if "WRONG" in ln]
    errors = [ln for ln in lines if re.search(r"\b\w+(Error|Exception)\b:", ln)]
    tail = (wrong or errors or lines or [f"exit {rc}"])[-1]
    return rc, f"exit {rc}: {tail[:160]}"


def busbw(size: int, seconds: float, world: int, op: str) -> float:
    """Bus bandwidth in GB/s: 2(N-1)/N * S/t for allreduce, S/t for broadcast."""
    alg = size / seconds / 1e9
    return alg * 2 * (world - 1) / world if op == "allreduce" else alg


def summarise(ranks: list[dict[str, Any]], impl: str) -> list[dict[str, Any]]:
    """Per (op, size): first-rank-in to last-rank-out times over the ranks' stamps."""
    world = len(ranks)
    rows = []
    for k, first in enumerate(ranks[0]["results"]):
        starts = np.array([r["results"][k]["starts"] for r in ranks])
        ends = np.array([r["results"][k]["ends"] for r in ranks])
        span = ends.max(axis=0) - starts.min(axis=0)
        size, op = int(first["size_bytes"]), str(first["op"])
        med = float(np.median(span))
        alg = size / med / 1e9
        rows.append(
            {
                "impl": impl,
                "version": ranks[0]["version"],
                "status": "ok",
                "op": op,
                "dtype": "float32",
                "world": world,
                "size_bytes": size,
                "iters": int(first["iters"]),
                "median_s": med,
                "p90_s": float(np.percentile(span, 90)),
                "min_s": float(span.min()),
                "mean_s": float(span.mean()),
                "algbw_GBps": alg,
                "busbw_GBps": busbw(size, med, world, op),
                "call_median_s": float(np.median((ends - starts).max(axis=0))),
                "start_skew_median_s": float(np.median(starts.max(axis=0) - starts.min(axis=0))),
            }
        )
    return rows


def run_impl(
    adapter: ModuleType, label: str, n: int, ns: argparse.Namespace, out: Path, rnd: int = 0
) -> list[dict[str, Any]] | str:
    """One job: ``n`` ranks of ``label`` over every (op, size); rows, or why it failed."""
    job_name = f"{label}-n{n}" + (f"-r{rnd}" if ns.rounds > 1 else "")
    stamps = out / "stamps" / job_name
    hargs = [
        "--out",
        str(stamps),
        "--sizes",
        ",".join(map(str, ns.sizes)),
        "--ops",
        ",".join(ns.ops),
        "--iters-scale",
        str(ns.iters_scale),
        "--compute-mb",
        str(ns.compute_mb),
        "--compute",
        ns.compute,
    ]
    job = adapter.job(label, n, hargs)
    t0 = time.perf_counter()
    rc, why = run_cmd(job.argv, job.env, out / "logs" / f"{job_name}.log", ns.timeout)
    tag = f" round {rnd}" if ns.rounds > 1 else ""
    print(
        f"  {label:11s} N={n}{tag}: {'ok' if rc == 0 else why} "
        f"({time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    if rc != 0:
        return f"failed: {why}"
    files = [stamps / f"rank{r}.json" for r in range(n)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        return f"failed: no stamps from {', '.join(missing)}"
    rows = summarise([json.loads(f.read_text()) for f in files], label)
    for row in rows:
        row["round"] = rnd
    return rows


# ---------------------------------------------------------------------------- tables


def _cell(r: dict[str, Any]) -> str:
    return f"{fmt_time(r['median_s'])} / {fmt_time(r['p90_s'])} / {r['busbw_GBps']:.3f}"


def tables(
    rows: list[dict[str, Any]], status: dict[tuple[str, int], str], ns: argparse.Namespace
) -> str:
    """Markdown: per op and N, impl x size (median / p90 / busbw), then ratios to rabit2."""
    out: list[str] = []
    sizes = ns.sizes
    head = "| impl | " + " | ".join(fmt_size(s) for s in sizes) + " |"
    rule = "|---|" + "---|" * len(sizes)
    ok = combine_rounds(rows)
    for row in ok.values():
        row["busbw_GBps"] = busbw(row["size_bytes"], row["median_s"], row["world"], row["op"])
    limits = {(r["impl"], r["size_bytes"]): r for r in rows if r["impl"].startswith("limit:")}
    labels = [lb for lb in ORDER if lb in ns.impls]
    base_label = ns.base if ns.base in labels else labels[0]
    for op in ns.ops:
        for n in ns.n:
            what = "float32 SUM" if op == "allreduce" else "float32, root 0"
            out += [f"### {op} ({what}), N={n}: median / p90 / busbw GB/s", "", head, rule]
            for lb in labels:
                st = status.get((lb, n), "ok")
                if st != "ok":
                    out.append(f"| {lb} | {st} |" + " |" * (len(sizes) - 1))
                    continue
                cells = [_cell(ok[(lb, n, op, s)]) if (lb, n, op, s) in ok else "-" for s in sizes]
                out.append(f"| {lb} | " + " | ".join(cells) + " |")
            if n == 2 and limits:
                for key, name in (
                    ("limit:tcp-exchange", "limit: Python TCP exchange"),
                    ("limit:tcp-exchange-reno", "limit: Python TCP exchange, reno"),
                    ("limit:numpy-add", "limit: numpy add"),
                ):
                    cells = [_cell(limits[(key, s)]) if (key, s) in limits else "-" for s in sizes]
                    out.append(f"| {name} | " + " | ".join(cells) + " |")
            out.append("")
            base = {s: ok.get((base_label, n, op, s)) for s in sizes}
            peers = [lb for lb in labels
                     if lb != base_label and status.get((lb, n), "ok") == "ok"]
            if all(base.values()) and peers:
                paired = " per round (rounds it won)" if ns.rounds > 1 else ""
                out += [
                    f"Ratio to {base_label} (peer median / {base_label} median{paired}; "
                    f"> 1: {base_label} faster), {op}, N={n}:",
                    "",
                    head,
                    rule,
                ]
                for lb in peers:
                    cells = []
                    for s in sizes:
                        r = ok.get((lb, n, op, s))
                        b = base[s]
                        cells.append(paired_ratio(r, b) if r and b else "-")
                    out.append(f"| {lb} | " + " | ".join(cells) + " |")
                out.append("")
    rtt = limits.get(("limit:rtt-8B", 8))
    if rtt:
        out.append(
            f"8-byte round trip (two Python processes, loopback TCP): median "
            f"{fmt_time(rtt['median_s'])}, p90 {fmt_time(rtt['p90_s'])}."
        )
        out.append("")
    versions = {r["impl"]: r["version"] for r in rows if r.get("version")}
    if versions:
        out.append("Versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items()) + ".")
        out.append("")
    out.append(verdicts(rows))
    return "\n".join(out)


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of the driver."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="~10x fewer iterations")
    ap.add_argument("--n", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    ap.add_argument("--ops", default="allreduce,broadcast")
    ap.add_argument("--impls", default=",".join(ORDER), help=f"subset of {','.join(ORDER)}")
    ap.add_argument("--iters-scale", type=float, default=1.0, help="multiplies the iterations")
    ap.add_argument("--compute-mb", type=float, default=0.0, metavar="MB",
                    help="every rank moves MB MiB of memory (a numpy multiply) between the "
                         "barrier and each timed call, as a training round's compute leaves "
                         "the caches (default 0: calls back to back)")
    ap.add_argument("--compute", choices=COMPUTE_KINDS, default="stream",
                    help="stream: that numpy multiply; histogram: np.bincount of MB MiB of "
                         "(index, weight) rows into 51 200 bins plus a fresh 6.4 MB array, as "
                         "the GBDT example's histogram building (leaves colder caches)")
    ap.add_argument("--out", type=Path, help="default bench/results/peers-<stamp>/")
    ap.add_argument("--timeout", type=float, help="seconds per job (default 180, full 420)")
    ap.add_argument("--skip-setup", action="store_true", help="do not call setup.sh first")
    ap.add_argument("--no-limits", action="store_true", help="skip the physical-limit probes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every job this many times, alternating the implementations")
    ap.add_argument("--base", default="rabit2",
                    help="the implementation the ratios are taken to (default rabit2, else the "
                         "first one run)")
    ns = ap.parse_args(argv)
    ns.n = [int(x) for x in ns.n.split(",") if x]
    ns.sizes = [parse_size(s) for s in ns.sizes.split(",") if s]
    ns.ops = [o for o in ns.ops.split(",") if o]
    ns.impls = [i for i in ns.impls.split(",") if i]
    bad = [i for i in ns.impls if i not in ORDER]
    if bad or any(o not in ("allreduce", "broadcast") for o in ns.ops):
        ap.error(f"unknown impl {bad} or op; impls: {ORDER}, ops: allreduce,broadcast")
    if ns.rounds < 1:
        ap.error("--rounds must be >= 1")
    if ns.quick:
        ns.iters_scale *= 0.1
    if ns.timeout is None:
        ns.timeout = 180.0 if ns.quick else 420.0
    if ns.out is None:
        ns.out = REPO / "bench" / "results" / f"peers-{time.strftime('%Y%m%d-%H%M%S')}"
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Set up, probe the limits, run every (impl, N), write and print the tables."""
    ns = parse_args(argv)
    t_start = time.perf_counter()
    out: Path = ns.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not ns.skip_setup:
        print("setup: bash bench/peers/setup.sh (idempotent)", flush=True)
        rc, why = run_cmd(["bash", str(HERE / "setup.sh")], {}, out / "logs" / "setup.log", 1800)
        for line in (out / "logs" / "setup.log").read_text().splitlines():
            if line.startswith("[setup]"):
                print("  " + line, flush=True)
        if rc != 0:
            print(f"  setup.sh {why}", flush=True)

    rows: list[dict[str, Any]] = []
    if not ns.no_limits:
        print("limits: python bench/peers/limits.py", flush=True)
        lim = out / "limits.jsonl"
        rc, why = run_cmd(
            [
                MAIN_PYTHON,
                str(HERE / "limits.py"),
                "--sizes",
                ",".join(map(str, ns.sizes)),
                "--iters-scale",
                str(ns.iters_scale),
                "--rtt-iters",
                str(max(200, round(2000 * ns.iters_scale))),
                "--out",
                str(lim),
            ],
            {},
            out / "logs" / "limits.log",
            ns.timeout,
        )
        if rc == 0:
            rows += [json.loads(x) for x in lim.read_text().splitlines() if x.strip()]
        else:
            print(f"  limits {why}", flush=True)

    adapters: dict[str, ModuleType] = {}
    for name in ADAPTERS:
        mod = importlib.import_module(name)
        for lb in mod.LABELS:
            adapters[lb] = mod
    reasons: dict[str, str | None] = {}
    status: dict[tuple[str, int], str] = {}
    labels = [x for x in ORDER if x in ns.impls]
    for rnd in range(ns.rounds):
        for n in ns.n:
            print(f"N={n}:" + (f" round {rnd}" if ns.rounds > 1 else ""), flush=True)
            for lb in labels if rnd % 2 == 0 else labels[::-1]:
                if lb not in reasons:
                    reasons[lb] = adapters[lb].unavailable(lb)
                reason = reasons[lb]
                if reason is not None:
                    if (lb, n) not in status:
                        status[(lb, n)] = f"unavailable: {reason}"
                        print(f"  {lb:11s} N={n}: {status[(lb, n)]}", flush=True)
                        rows.append({"impl": lb, "world": n, "status": status[(lb, n)]})
                    continue
                res = run_impl(adapters[lb], lb, n, ns, out, rnd)
                if not isinstance(res, str):
                    rows += res
                    continue
                status.setdefault((lb, n), res)  # the first failure is the one reported
                rows.append({"impl": lb, "world": n, "status": res, "round": rnd})

    wall = time.perf_counter() - t_start
    text = tables(rows, status, ns)
    text += (
        f"\nTotal wall time {wall:.0f} s; iterations x{ns.iters_scale:g}"
        + (f"; {ns.rounds} alternating rounds" if ns.rounds > 1 else "")
        + (f"; {ns.compute_mb:g} MiB of {ns.compute} compute before each call"
           if ns.compute_mb else "")
        + "; time = first rank "
        "in to last rank out (shared CLOCK_MONOTONIC), after the implementation's own "
        "1-element allreduce as a barrier; every result checked against its closed form.\n"
    )
    with (out / "results.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / "tables.md").write_text(text)
    print()
    print(text)
    print(f"results: {out}/results.jsonl, {out}/tables.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
