"""The benchmark-sized GBDT example over rabit2 and over XGBoost 1.7.6's classic rabit engine.

The same trainer (``rabit2/examples/gbdt/``, loaded by path so that the classic engine's
Python needs nothing of rabit2) runs twice per N: once through ``rabit2-submit``, once with
its ``allreduce`` bound to ``xgboost.collective`` 1.7.6 (in ``bench/peers/.venv17``, launched
with XGBoost's own tracker, TCP_NODELAY on). Both print ``allreduce_s`` (time inside
allreduce calls, histogram building excluded) and the model digest, which must agree.

    python bench/peers/gbdt_compare.py [--n 2,4] [--size bench] [--runs 3] [--trace DIR]

``--trace DIR`` keeps every worker's per-call trace (the example's ``--trace``) in DIR and
prints, per message size, the seconds each implementation spent in those calls (slowest
rank), and the median time per call from the moment the last rank's input was ready to the
moment every rank had the result: the first includes waiting for the slower rank's compute,
the second is the collective alone (``perf_counter`` is one clock for every process of a
host).

Worker mode (internal): ``PYTHON gbdt_compare.py --worker -- <gbdt args>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GBDT = REPO / "rabit2" / "examples" / "gbdt"
VENV17_PYTHON = HERE / ".venv17" / "bin" / "python"
ENV_ARGS = "RABIT2_BENCH_XGB_ARGS"


class ClassicComm:
    """The handful of calls the GBDT example makes, over xgboost.collective 1.7."""

    def __init__(self) -> None:
        from xgboost import collective  # noqa: PLC0415 -- only in the classic worker

        self._c: Any = collective
        self.Op = collective.Op

    def init(self, args: list[str]) -> None:
        del args
        self._c.init(**json.loads(os.environ[ENV_ARGS]))

    def get_rank(self) -> int:
        return int(self._c.get_rank())

    def get_world_size(self) -> int:
        return int(self._c.get_world_size())

    def allreduce(self, data: Any, op: Any, prepare_fun: Any = None) -> Any:
        if prepare_fun is not None:  # the classic Python API has no lazy preparation
            prepare_fun(data)
        out = self._c.allreduce(data, op)  # 1.7 returns a flat array
        data[...] = out.reshape(data.shape)
        return data

    def load_checkpoint(self) -> tuple[int, None]:
        return 0, None  # 1.7's Python API has no checkpoints; the run starts fresh

    def checkpoint(self, model: Any) -> None:
        del model

    def tracker_print(self, msg: str) -> None:
        self._c.communicator_print(msg + "\n")

    def finalize(self) -> None:
        self._c.finalize()


def worker(gbdt_args: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(
        "gbdt_example", GBDT / "__init__.py", submodule_search_locations=[str(GBDT)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gbdt_example"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return int(module.main(gbdt_args, comm=ClassicComm()))


def run_classic(n: int, gbdt_args: list[str]) -> str:
    """XGBoost 1.7.6's own tracker and n workers of this file in the venv."""
    code = (
        "import json, os, subprocess, sys\n"
        "from xgboost.tracker import RabitTracker\n"
        f"n = {n}\n"
        "t = RabitTracker(host_ip='127.0.0.1', n_workers=n)\n"
        "t.start(n)\n"
        "args = dict(t.worker_envs()); args['rabit_enable_tcp_no_delay'] = 'true'\n"
        "procs = []\n"
        "for i in range(n):\n"
        "    env = dict(os.environ)\n"
        f"    env['{ENV_ARGS}'] = json.dumps({{**args, 'DMLC_TASK_ID': f'task-{{i}}'}})\n"
        f"    procs.append(subprocess.Popen([sys.executable, {str(Path(__file__))!r},"
        f" '--worker', '--', *{gbdt_args!r}], env=env))\n"
        "rc = max(p.wait() for p in procs)\n"
        "t.join()\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([str(VENV17_PYTHON), "-c", code], capture_output=True, text=True,
                          timeout=1200, check=False)
    return proc.stdout + proc.stderr


def run_rabit2(n: int, gbdt_args: list[str], submit_args: list[str]) -> str:
    proc = subprocess.run(
        ["rabit2-submit", "--cluster", "local", "-n", str(n), *submit_args, "--",
         sys.executable, "-m", "rabit2.examples.gbdt", *gbdt_args],
        capture_output=True, text=True, timeout=1200, check=False, cwd=REPO,
    )
    return proc.stdout + proc.stderr


def per_size(paths: list[Path]) -> dict[int, tuple[int, float, float]]:
    """From the ranks' traces: message size -> (calls, the slowest rank's seconds, the
    median per call of the time from the moment the last rank's input was ready to the
    moment every rank had its result).  The first two include the wait for the slower
    rank's compute (which neither implementation controls); the last is the collective
    itself, measured on the one clock the processes share."""
    traces = [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]
    totals: list[dict[int, float]] = [{} for _ in traces]
    after: dict[int, list[float]] = {}
    for calls in zip(*traces, strict=True):
        size = int(calls[0]["bytes"])
        for r, rec in enumerate(calls):
            totals[r][size] = totals[r].get(size, 0.0) + float(rec["s"])
        last_ready = max(float(rec["ready"]) for rec in calls)
        after.setdefault(size, []).append(max(float(rec["done"]) for rec in calls)
                                          - last_ready)
    return {size: (len(after[size]), max(t.get(size, 0.0) for t in totals),
                   statistics.median(after[size]))
            for size in sorted(after)}


def summary(out: str) -> tuple[float, set[str]]:
    """(the slowest rank's allreduce_s, the set of digests)."""
    times = [float(x) for x in re.findall(r"gbdt rank=\d+ .*allreduce_s=([0-9.]+)", out)]
    digests = set(re.findall(r"digest=([0-9a-f]{64})", out))
    if not times:
        raise RuntimeError("no result line in the output:\n" + out[-3000:])
    return max(times), digests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", default="2,4")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--runs", type=int, default=1, help="runs of each implementation per N")
    ap.add_argument("--trace", type=Path, metavar="DIR",
                    help="keep per-call traces in DIR and print a per-size breakdown")
    ap.add_argument("--submit-args", default="", metavar="ARGS",
                    help='extra rabit2-submit options, e.g. "--bind none --env RABIT2_RECOVER=0"')
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    if ns.worker:
        return worker([a for a in ns.rest if a != "--"])
    if not VENV17_PYTHON.exists():
        print("classic engine unavailable: run bench/peers/setup.sh xgb17 first")
        return 1
    print("| N | rabit2 allreduce_s | classic rabit (xgboost 1.7.6) allreduce_s | ratio | "
          "digests agree |")
    print("| --- | --- | --- | --- | --- |")
    breakdowns = []
    ratios: dict[int, list[float]] = {}
    for n in (int(x) for x in ns.n.split(",")):
        for run in range(ns.runs):
            traces: dict[str, list[Path]] = {}
            args: dict[str, list[str]] = {}
            for impl in ("rabit2", "classic"):
                args[impl] = ["--size", ns.size]
                if ns.trace is not None:
                    ns.trace.mkdir(parents=True, exist_ok=True)
                    stem = f"n{n}-run{run}-{impl}"
                    args[impl] += ["--trace", str(ns.trace / f"{stem}-{{rank}}.jsonl")]
                    traces[impl] = [ns.trace / f"{stem}-{r}.jsonl" for r in range(n)]
            # which goes first alternates, so neither always runs on the machine the other
            # just warmed (or disturbed)
            jobs = {"rabit2": lambda a=args["rabit2"], k=n: run_rabit2(
                        k, a, shlex.split(ns.submit_args)),
                    "classic": lambda a=args["classic"], k=n: run_classic(k, a)}
            order = ("rabit2", "classic") if run % 2 == 0 else ("classic", "rabit2")
            got = {impl: summary(jobs[impl]()) for impl in order}
            (r2, d2), (c17, d17) = got["rabit2"], got["classic"]
            agree = len(d2) == 1 and d2 == d17
            ratios.setdefault(n, []).append(c17 / r2)
            print(f"| {n} | {r2:.3f} s | {c17:.3f} s | {c17 / r2:.2f}x | {agree} |",
                  flush=True)
            if traces:
                breakdowns.append((n, run, per_size(traces["rabit2"]),
                                   per_size(traces["classic"])))
    print()
    for n, rs in ratios.items():
        wins = sum(1 for x in rs if x > 1)
        med = statistics.median(rs)
        print(f"N={n}: classic / rabit2 per run: median {med:.2f}x, "
              f"{min(rs):.2f}-{max(rs):.2f}x, rabit2 faster in {wins} of {len(rs)} runs; "
              "speed target (allreduce time no worse than classic rabit, median over the "
              f"runs): {'met' if med >= 1.0 else 'NOT met'}")
    for n, run, mine, theirs in breakdowns:
        print(f"\nN={n}, run {run}: seconds in the calls of each size (slowest rank), and "
              "per call (median) from the last rank's input being ready to every rank "
              "having the result\n")
        print("| bytes | calls | rabit2 | classic rabit | classic / rabit2 | rabit2 per call "
              "after ready | classic per call after ready |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        nan = (0, float("nan"), float("nan"))
        for size, (calls, secs, per_call) in mine.items():
            _, other, other_call = theirs.get(size, nan)
            print(f"| {size} | {calls} | {secs * 1e3:.1f} ms | {other * 1e3:.1f} ms | "
                  f"{other / secs if secs else float('nan'):.2f}x | {per_call * 1e6:.0f} us | "
                  f"{other_call * 1e6:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
