"""Worker for the local-model recovery test: every rank checkpoints a global model and a
local one of its own; a restarted rank must get both back, for the version it resumes at."""

import sys

import numpy as np

import rabit2

rabit2.init(sys.argv[1:])
r, w = rabit2.get_rank(), rabit2.get_world_size()
v, model, local = rabit2.load_checkpoint(with_local=True)
assert v == 0 or (model == {"it": v - 1} and local == {"rank": r, "it": v - 1}), (r, v, model,
                                                                                  local)
print(f"START rank={r} version={v}", flush=True)
for it in range(v, 5):
    x = np.arange(100_000, dtype=np.int64) * (r + 1) + it
    rabit2.allreduce(x, rabit2.SUM)
    assert (x == np.arange(100_000) * (w * (w + 1) // 2) + w * it).all()
    rabit2.checkpoint({"it": it}, {"rank": r, "it": it})
print(f"OK rank={r}", flush=True)
rabit2.finalize()
