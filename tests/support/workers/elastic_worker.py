"""Worker program for the elastic-mode tests (tests/integration/test_elastic.py), run under
``rabit2-submit --elastic``.

It runs ``--steps`` steps, each in ``with rabit2.live_set() as live``: newcomers get the
state by a broadcast from ``live[0]``; then every member allreduces ``rank + 1 + step`` and
checks the sum against the set it ran with; the state (the step and a running total of the
sums) is applied only after the block succeeded.  A ``LiveSetError`` retries the step.

Lines, all flushed at once:

* ``SET rank=R step=S epoch=E live=r,r,... new=r,...`` when a set formed
* ``STEP rank=R step=S epoch=E live=... total=T`` when a step succeeded
* ``RETRY rank=R step=S epoch=E error=<message>`` when a set failed
* ``DONE rank=R total=T attempt=A`` at the end

``--die=RANK,STEP,WHERE`` (first attempt only): rank RANK SIGKILLs itself at step STEP,
``in`` the block after its allreduce, ``asking`` (0.3 s after it called ``live_set()``,
while the others are still computing: it dies inside the barrier) or ``joining`` (inside
``live_set()`` once the set formed, before it joined the set's collectives).  Repeatable.
``--slow=S``: every rank sleeps S seconds per step (outside the block).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import rabit2
from rabit2.io.membership import Membership


def _die_joining(self: Membership, *args: object) -> None:
    """In place of ``Membership.join_set``: die once the set formed, before joining it."""
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    steps, slow = 10, 0.0
    deaths: dict[tuple[int, int], str] = {}
    for arg in argv:
        if arg.startswith("--steps="):
            steps = int(arg.split("=", 1)[1])
        elif arg.startswith("--slow="):
            slow = float(arg.split("=", 1)[1])
        elif arg.startswith("--die="):
            rank_s, step_s, where = arg.split("=", 1)[1].split(",")
            deaths[(int(rank_s), int(step_s))] = where
    rabit2.init()
    rank = rabit2.get_rank()
    attempt = int(os.environ.get("DMLC_NUM_ATTEMPT", "0"))
    try:
        state = run(steps, slow, deaths, rank, attempt)
    except rabit2.errors.JobFinishedError:  # (back after the others finished)
        print(f"FINISHED-WITHOUT rank={rank}", flush=True)
        rabit2.finalize()
        return
    print(f"DONE rank={rank} total={state['total']} attempt={attempt}", flush=True)
    rabit2.finalize()


def run(steps: int, slow: float, deaths: dict[tuple[int, int], str], rank: int,
        attempt: int) -> dict[str, int]:
    """The steps; the state at the end."""
    state = {"step": 0, "total": 0}
    while state["step"] < steps:
        step = state["step"]
        die = deaths.get((rank, step)) if attempt == 0 else None
        if die == "joining":
            Membership.join_set = _die_joining  # type: ignore[method-assign,assignment]
        if die == "asking":
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            time.sleep(slow)
            if any(where == "asking" and step_ == step for (_, step_), where in deaths.items()):
                time.sleep(1.0)  # (the others come late: the dying rank waits in the barrier)
        try:
            with rabit2.live_set() as live:
                if live.new and live.source is not None:  # newcomers take the state
                    state = rabit2.broadcast(state if rank == live.source else None,
                                             root=live.source)
                    step = state["step"]
                members = ",".join(map(str, live))
                print(f"SET rank={rank} step={step} epoch={live.epoch} live={members} "
                      f"new={','.join(map(str, live.new))}", flush=True)
                data = np.full(4, rank + 1 + step, dtype=np.int64)
                rabit2.allreduce(data, rabit2.Op.SUM)
                expected = sum(r + 1 + step for r in live)
                assert int(data[0]) == expected, (data, expected, live)
                if die == "in":
                    os.kill(os.getpid(), signal.SIGKILL)
            state = {"step": step + 1, "total": state["total"] + int(data[0])}
            print(f"STEP rank={rank} step={step} epoch={live.epoch} live={members} "
                  f"total={state['total']}", flush=True)
        except rabit2.LiveSetError as exc:
            print(f"RETRY rank={rank} step={step} error={exc}", flush=True)
    return state


if __name__ == "__main__":
    main(sys.argv[1:])
