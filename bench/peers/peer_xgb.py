"""XGBoost's collective: 3.x (``xgboost3``) and the classic rabit engine of 1.7.6 (``xgboost1.7``).

Each runs in its own Python: 3.x in the driver's, 1.7.6 in ``bench/peers/.venv17`` (numpy<2),
both installed by ``setup.sh``. The launcher is this file::

    PYTHON bench/peers/peer_xgb.py --label xgboost3 -n 2 -- <harness arguments>

It starts the version's own ``xgboost.tracker.RabitTracker`` on 127.0.0.1, then N worker
processes of ``harness.py`` that join through ``xgboost.collective.init`` with the tracker's
arguments (passed in the ``RABIT2_BENCH_XGB_ARGS`` environment variable, JSON). 1.7.6 gets
``rabit_enable_tcp_no_delay="true"``: the string, because 1.7 renders a Python ``True`` as
``1``, which leaves TCP_NODELAY off (and 4 KiB broadcasts then take ~40 ms).

The measured calls are the public ``collective.allreduce`` (copies its input) and
``collective.broadcast`` (pickles the array and broadcasts a length, then the bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from common import HERE, LOOPBACK, MAIN_PYTHON, Job, harness_cmd, probe, setup_failure

LABELS = ["xgboost3", "xgboost1.7"]
VENV17_PYTHON = HERE / ".venv17" / "bin" / "python"
ENV_ARGS = "RABIT2_BENCH_XGB_ARGS"


def python_for(label: str) -> str:
    """The interpreter that has the label's XGBoost."""
    return str(VENV17_PYTHON) if label == "xgboost1.7" else MAIN_PYTHON


def unavailable(label: str) -> str | None:
    """The right XGBoost must import in the right Python (``setup.sh xgb3`` / ``xgb17``)."""
    if label == "xgboost1.7":
        if not VENV17_PYTHON.exists():
            return setup_failure("xgb17") or "no venv bench/peers/.venv17 (run setup.sh xgb17)"
        return setup_failure("xgb17") or probe(
            VENV17_PYTHON,
            "import xgboost, xgboost.collective, xgboost.tracker; "
            "assert xgboost.__version__ == '1.7.6', xgboost.__version__",
        )
    return setup_failure("xgb3") or probe(
        MAIN_PYTHON,
        "import xgboost, xgboost.collective, xgboost.tracker; "
        "assert int(xgboost.__version__.split('.')[0]) >= 3, xgboost.__version__",
    )


def job(label: str, n: int, harness_args: list[str]) -> Job:
    """This file as launcher, run by the label's Python."""
    py = python_for(label)
    return Job([py, str(HERE / "peer_xgb.py"), "--label", label, "-n", str(n), "--", *harness_args])


# ---------------------------------------------------------------- launcher (tracker + workers)


def _start_tracker(label: str, n: int) -> tuple[Any, dict[str, Any]]:
    """The version's own tracker on loopback; returns (tracker, worker arguments)."""
    from xgboost.tracker import RabitTracker  # noqa: PLC0415

    if label == "xgboost1.7":
        tracker: Any = RabitTracker(host_ip=LOOPBACK, n_workers=n)
        tracker.start(n)
        args: dict[str, Any] = dict(tracker.worker_envs())
        args["rabit_enable_tcp_no_delay"] = "true"
    else:
        tracker = RabitTracker(n_workers=n, host_ip=LOOPBACK, port=0)
        tracker.start()
        args = dict(tracker.worker_args())
    return tracker, args


def launch(argv: Sequence[str] | None = None) -> int:
    """Start the tracker and ``n`` harness workers; exit with the first failure's status."""
    ap = argparse.ArgumentParser(description="launch N XGBoost-collective harness workers")
    ap.add_argument("--label", required=True, choices=LABELS)
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("harness_args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    hargs = [a for a in ns.harness_args if a != "--"]
    tracker, args = _start_tracker(ns.label, ns.n)
    task_key = "DMLC_TASK_ID" if ns.label == "xgboost1.7" else "dmlc_task_id"
    procs = []
    for i in range(ns.n):
        env = dict(os.environ)
        env[ENV_ARGS] = json.dumps({**args, task_key: f"task-{i}"})
        procs.append(subprocess.Popen(harness_cmd(sys.executable, ns.label, hargs), env=env))
    rc = 0
    pending = list(procs)
    while pending:  # the first worker to fail takes the others down (no hang on a dead peer)
        for p in list(pending):
            code = p.poll()
            if code is None:
                continue
            pending.remove(p)
            if code != 0 and rc == 0:
                rc = code
                for q in pending:
                    q.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    if rc == 0:
        if ns.label == "xgboost1.7":
            tracker.join()
        else:
            tracker.wait_for(60)
    return rc


# ---------------------------------------------------------------- worker side


class XgbComm:
    """``xgboost.collective`` public calls (allreduce copies; broadcast pickles)."""

    def __init__(self, label: str) -> None:
        import xgboost  # noqa: PLC0415 -- worker side only
        from xgboost import collective  # noqa: PLC0415

        self._c: Any = collective
        collective.init(**json.loads(os.environ[ENV_ARGS]))
        self.rank = int(collective.get_rank())
        self.world = int(collective.get_world_size())
        self.version = f"xgboost {xgboost.__version__}"
        self._sum = collective.Op.SUM

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """Returns a new array (XGBoost copies the input)."""
        return cast(np.ndarray, self._c.allreduce(a, self._sum))

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        """Public broadcast: the array is pickled on the root, unpickled on the others."""
        return cast(np.ndarray, self._c.broadcast(a, root))

    def barrier(self, one: np.ndarray) -> None:
        """1-element SUM allreduce."""
        self._c.allreduce(one, self._sum)

    def finalize(self) -> None:
        """Leave the job."""
        self._c.finalize()


def make_comm(label: str) -> XgbComm:
    """Worker side."""
    return XgbComm(label)


if __name__ == "__main__":
    sys.exit(launch())
