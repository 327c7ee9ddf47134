"""Worker for the local-model and prepare_fun recovery tests: every rank checkpoints a global
model and a local one of its own after two allreduces per iteration; a restarted rank must
get both back for the version it resumes at, and must not prepare the calls it replays."""

import os
import sys

import numpy as np

import rabit2

rabit2.init(sys.argv[1:])
r, w = rabit2.get_rank(), rabit2.get_world_size()
v, model, local = rabit2.load_checkpoint(with_local=True)
assert v == 0 or (model == {"it": v - 1} and local == {"rank": r, "it": v - 1}), (r, v, model,
                                                                                  local)
attempt = os.environ.get("DMLC_NUM_ATTEMPT", "0")
print(f"START rank={r} version={v} attempt={attempt}", flush=True)
prepared = []
for it in range(v, 5):
    for j in range(2):
        x = np.zeros(100_000, dtype=np.int64)

        def prepare(a: np.ndarray, it: int = it, j: int = j) -> None:
            a[:] = np.arange(100_000) * (r + 1) + it + j  # the input is made only if needed
            prepared.append(f"{it}.{j}")

        rabit2.allreduce(x, rabit2.SUM, prepare_fun=prepare)
        assert (x == np.arange(100_000) * (w * (w + 1) // 2) + w * (it + j)).all()
    rabit2.checkpoint({"it": it}, {"rank": r, "it": it})
print(f"PREPARED rank={r} attempt={attempt} calls={','.join(prepared)}", flush=True)
print(f"OK rank={r}", flush=True)
rabit2.finalize()
