"""Worker for ``bench/recovery.py timeline``: 6 versions of a 16 MiB ring allreduce, a small
tree allreduce and a broadcast, with a checkpoint after each; prints ``EVENT name
attempt=A t=T`` (wall clock) at the points the timeline reports."""

from __future__ import annotations

import logging
import os
import sys
import time

START = time.time()

import numpy as np  # noqa: E402 - the start time is taken before the imports

import rabit2  # noqa: E402

ATTEMPT = int(os.environ.get("DMLC_NUM_ATTEMPT", "0"))


def event(name: str, t: float | None = None) -> None:
    print(f"EVENT {name} attempt={ATTEMPT} t={time.time() if t is None else t:.6f}", flush=True)


logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's "link down"
rabit2.init(sys.argv[1:])
rank, world = rabit2.get_rank(), rabit2.get_world_size()
event("start", START)
event("init")
version, model = rabit2.load_checkpoint()
event("loaded")
engine = rabit2.api._comm.engine
replaying = True
big = 4 << 20  # float32 elements: 16 MiB
for it in range(version, 6):
    for j, count in enumerate((big, 1000)):
        if replaying and not engine.replays_next():
            replaying = False
            event("replayed")
        x = np.full(count, rank + it + j, dtype=np.float32)
        rabit2.allreduce(x, rabit2.SUM)
        assert x[0] == sum(range(world)) + world * (it + j)
        if (it, j) == (3, 0):
            event("interrupted_done")
    rabit2.broadcast(np.arange(1000) if rank == 0 else None, 0)
    rabit2.checkpoint({"it": it})
rabit2.finalize()
