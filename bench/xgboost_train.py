"""Real XGBoost training through rabit2 against XGBoost's own collectives, side by side.

    python bench/xgboost_train.py [--workers 2,4] [--rows 1000000] [--features 50]
                                  [--rounds 50] [--depth 8] [--repeat 1]
                                  [--device cpu|cuda] [--backends NAME,...]

The same ``hist`` training (``bench/xgboost_worker.py``: binary logistic, depth 8, one
thread per worker, data generation and DMatrix construction outside the timing) through:

* ``xgboost-rabit``: XGBoost's own tracker and collectives (``RabitTracker``);
* ``xgboost-federated``: XGBoost's own federated server (``run_federated_server``);
* ``rabit2``: ``rabit2.xgboost`` under ``rabit2-submit --max-attempts 1`` (no recovery);
* ``rabit2-ft``: the same with recovery on: a checkpoint every round, the prelude probes.

Backends alternate within each repeat.  Printed per world size: rank 0's training time
(median, min, max over repeats) and its ratio to the first of XGBoost's own backends run
(``xgboost-rabit`` unless ``--backends`` leaves it out); for rabit2 the
endpoint's counters per round (calls, MB, the time in rabit2's collectives and the time in
the gRPC handler); and whether every backend trained the same model.  The targets: rabit2
within 1.15x of ``xgboost-rabit``, ``rabit2-ft`` within 1.25x.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "xgboost_worker.py"
BACKENDS = ("xgboost-rabit", "xgboost-federated", "rabit2", "rabit2-ft")
TARGETS = {"rabit2": 1.15, "rabit2-ft": 1.25}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(out: str) -> dict[str, Any]:
    for line in out.splitlines():
        if "BENCH " in line:
            return dict(json.loads(line.split("BENCH ", 1)[1]))
    raise RuntimeError(f"no result line in:\n{out[-3000:]}")


def run_own(backend: str, n: int, worker_args: list[str], timeout: float) -> dict[str, Any]:
    import xgboost  # noqa: PLC0415
    from xgboost.federated import run_federated_server  # noqa: PLC0415
    from xgboost.tracker import RabitTracker  # noqa: PLC0415

    tracker = None
    if backend == "xgboost-rabit":
        tracker = RabitTracker(n_workers=n, host_ip="127.0.0.1", timeout=int(timeout))
        tracker.start()
        args = tracker.worker_args()
    else:
        port = free_port()
        run_federated_server(n, port, blocking=False, timeout=int(timeout))
        args = {"dmlc_communicator": "federated",
                "federated_server_address": f"127.0.0.1:{port}", "federated_world_size": n}
    env = dict(os.environ, XGB_BENCH_ARGS=json.dumps(args))
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--backend", backend, "--rank",
                               str(r), *worker_args], env=env, stdout=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL)
             for r in range(n)]
    out = "".join(p.communicate(timeout=timeout)[0] for p in procs)
    if tracker is not None:
        tracker.wait_for(60)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{backend} failed:\n{out[-3000:]}")
    _ = xgboost
    return parse(out)


def run_rabit2(backend: str, n: int, worker_args: list[str], timeout: float) -> dict[str, Any]:
    attempts = "1" if backend == "rabit2" else "3"
    cmd = [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", str(n),
           "--max-attempts", attempts, "--", sys.executable, str(WORKER), "--backend", "rabit2",
           *worker_args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)
    if done.returncode:
        raise RuntimeError(f"{backend} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return parse(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--device", default="cpu", help="XGBoost's device: cpu or cuda")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    opts = parser.parse_args()
    backends = tuple(b for b in BACKENDS if b in opts.backends.split(","))
    unknown = set(opts.backends.split(",")) - set(BACKENDS)
    if unknown or not any(b.startswith("xgboost") for b in backends):
        parser.error(f"--backends: a comma-separated subset of {', '.join(BACKENDS)} "
                     "with at least one of XGBoost's own")
    worker_args = ["--rows", str(opts.rows), "--features", str(opts.features), "--rounds",
                   str(opts.rounds), "--depth", str(opts.depth), "--device", opts.device]
    print(f"# {time.strftime('%Y-%m-%d')} {os.cpu_count()} cores; rows={opts.rows} "
          f"features={opts.features} rounds={opts.rounds} depth={opts.depth} "
          f"device={opts.device}", flush=True)
    for n in (int(w) for w in opts.workers.split(",")):
        results: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
        for rep in range(opts.repeat):
            order = backends if rep % 2 == 0 else tuple(reversed(backends))
            for backend in order:
                run = run_rabit2 if backend.startswith("rabit2") else run_own
                result = run(backend, n, worker_args, opts.timeout)
                results[backend].append(result)
                print(f"n={n} {backend}: {result['train_s']:.2f} s", flush=True)
        report(n, opts.rounds, results)


def report(n: int, rounds: int, results: dict[str, list[dict[str, Any]]]) -> None:
    own = next(b for b in results if b.startswith("xgboost"))
    base = statistics.median(r["train_s"] for r in results[own])
    print(f"\n## N={n}\n\n| backend | train s (median, min-max) | per round | vs {own} "
          "| target |\n| --- | --- | --- | --- | --- |")
    for backend, runs in results.items():
        times = [r["train_s"] for r in runs]
        med = statistics.median(times)
        target = TARGETS.get(backend) if own == "xgboost-rabit" else None
        verdict = "" if target is None else (
            f"<= {target}x: {'met' if med / base <= target else 'missed'}")
        print(f"| {backend} | {med:.2f} ({min(times):.2f}-{max(times):.2f}) | "
              f"{med / rounds * 1e3:.1f} ms | {med / base:.2f}x | {verdict} |")
    for backend in (b for b in ("rabit2", "rabit2-ft") if b in results):
        stats = results[backend][-1].get("endpoint") or {}
        if stats:
            calls = stats["calls"]
            overhead = (stats["handler_s"] - stats["collective_s"]) / max(calls, 1)
            print(f"\n{backend} endpoint, per round: {calls / rounds:.1f} calls, "
                  f"{stats['bytes'] / rounds / 1e6:.2f} MB sent, "
                  f"{stats['collective_s'] / rounds * 1e3:.1f} ms in rabit2's collectives, "
                  f"{stats['handler_s'] / rounds * 1e3:.1f} ms in the handler "
                  f"({overhead * 1e6:.0f} us of handler overhead per call)")
    models = {b: {r["model"] for r in runs} for b, runs in results.items()}
    same = len(set().union(*models.values())) == 1
    print(f"\nsame model from every backend: {same} {models if not same else ''}\n", flush=True)


if __name__ == "__main__":
    main()
