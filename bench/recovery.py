"""What fault tolerance costs and how long a recovery takes, through ``rabit2-submit``.

    python bench/recovery.py overhead [--n 2,4] [--sizes 1M,16M,64M] [--rounds 3] [--steady]
    python bench/recovery.py timeline [--n 4] [--repeat 3] [--victims 2,3]

``overhead`` runs ``bench_collectives.py`` with recovery off and on (``RABIT2_RECOVER=0/1``),
alternating, ``--rounds`` times each, and prints the median of each setting and their ratio:
the no-fault cost of keeping results for replay and of the staging that makes offsets safe
(docs/recovery.md).  The benchmark never checkpoints, so the first ``rabit2_replay_mb / size``
calls of each size also fill the replay store with fresh memory; ``--steady`` times each
size only once the store is full (steady state: buffers are recycled).  ``timeline`` kills
one worker in the middle of a ring allreduce and reports, from the workers' own clocks (one
host): detection, restart, init, checkpoint load, replay and resume, as in
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run import run_job, submit_cmd
from units import fmt_size, fmt_time, parse_size

HERE = Path(__file__).resolve().parent
COLLECTIVES = HERE / "bench_collectives.py"
WORKER = HERE / "recovery_worker.py"


def overhead(args: argparse.Namespace) -> None:
    rows: dict[tuple[int, str, int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.n:
            for rnd in range(args.rounds):
                for setting in ("0", "1"):
                    out = Path(tmp) / f"n{n}-{setting}-{rnd}.jsonl"
                    cmd = [*submit_cmd(args.submit), "--cluster", "local", "-n", str(n),
                           "--max-attempts", "1", "--env", f"RABIT2_RECOVER={setting}", "--",
                           sys.executable, str(COLLECTIVES), "--sizes", args.sizes,
                           "--ops", args.ops, "--out", str(out), "--iters-scale",
                           str(args.iters_scale)]
                    if args.steady:
                        # fill the replay store before timing: no first-touch page faults
                        cmd += ["--warmup-mb", "260"]
                    run_job(cmd, Path(tmp) / f"n{n}-{setting}-{rnd}.log", 1800)
                    for line in out.read_text().splitlines():
                        rec = json.loads(line)
                        key = (n, rec["op"], rec["size_bytes"], setting)
                        rows.setdefault(key, []).append(rec["median_s"])
    print("\n| N | op | size | recovery off | recovery on | on / off |")
    print("|---|---|---|---|---|---|")
    for n, op, size in dict.fromkeys((k[0], k[1], k[2]) for k in rows):
        off = statistics.median(rows[(n, op, size, "0")])
        on = statistics.median(rows[(n, op, size, "1")])
        print(f"| {n} | {op} | {fmt_size(size)} | {fmt_time(off)} | {fmt_time(on)} | "
              f"{on / off:.3f} |")


_EVENT = re.compile(r"^\[rank (\d+)\] EVENT (\w+) attempt=(\d+) t=([0-9.]+)", re.M)
_KILL = re.compile(r"mock: killing rank (\d+) mid-call at ([0-9.]+)")
_DOWN = re.compile(r"^\[rank (\d+)\] .*link to rank (\d+) down at ([0-9.]+)", re.M)


def timeline(args: argparse.Namespace) -> None:
    victims, n = [int(v) for v in args.victims.split(",")], args.n[0]
    phases: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            cmd = [*submit_cmd(args.submit), "--cluster", "local", "-n", str(n),
                   "--env", "RABIT2_LOG_LEVEL=INFO", "--", sys.executable, str(WORKER),
                   *(f"mock={v},3,0,0,{parse_size(args.kill_after)}" for v in victims)]
            out = run_job(cmd, Path(tmp) / f"timeline-{rep}.log", 600)
            kill = min(float(t) for _, t in _KILL.findall(out))
            downs = [float(t) for r, p, t in _DOWN.findall(out)
                     if int(p) in victims and int(r) not in victims and float(t) >= kill]
            ev = {(int(r), name, int(att)): float(t) for r, name, att, t in _EVENT.findall(out)}
            new: dict[str, float] = {}  # the slower victim's replacement, event by event
            for (r, name, att), t in ev.items():
                if r in victims and att == 1:
                    new[name] = max(new.get(name, t), t)
            blocked = [t for (r, name, att), t in ev.items()
                       if r not in victims and name == "interrupted_done"]
            marks = [("detect", min(downs)), ("process start", new["start"]),
                     ("init done", new["init"]), ("checkpoint loaded", new["loaded"]),
                     ("replay done", new["replayed"]),
                     ("interrupted call done (restarted)", new["interrupted_done"]),
                     ("interrupted call done (last survivor)", max(blocked))]
            for name, t in marks:
                phases.setdefault(name, []).append(t - kill)
    who = f"rank {victims[0]}" if len(victims) == 1 else f"ranks {args.victims} (the slower)"
    print(f"\nN={n}, {who} killed after {args.kill_after} of a 16 MiB ring allreduce "
          f"in version 3 (median of {args.repeat}; seconds after the kill)\n")
    print("| event | after the kill |")
    print("|---|---|")
    for name, values in phases.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.0f} ms |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("overhead", "timeline"))
    parser.add_argument("--n", default=None, help="world sizes, e.g. 2,4")
    parser.add_argument("--sizes", default="1M,16M,64M")
    parser.add_argument("--ops", default="allreduce,broadcast")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steady", action="store_true",
                        help="overhead: time each size only once the replay store is full")
    parser.add_argument("--iters-scale", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kill-after", default="4M")
    parser.add_argument("--victims", default="2",
                        help="timeline: the ranks killed (e.g. 2,3: two neighbours at once)")
    parser.add_argument("--submit", default=None)
    args = parser.parse_args(argv)
    args.n = [int(x) for x in (args.n or ("2,4" if args.what == "overhead" else "4")).split(",")]
    t0 = time.perf_counter()
    (overhead if args.what == "overhead" else timeline)(args)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
