"""What a live set costs per step (elastic mode, docs/elastic.md): the same small allreduce
made plainly and inside ``with rabit2.live_set()`` blocks, one per step.  Run it under the
launcher, once without and once with ``--elastic``; rank 0 prints the mean per step.

    rabit2-submit --cluster local -n 2 -- python bench/elastic_cost.py
    rabit2-submit --cluster local -n 2 --elastic -- python bench/elastic_cost.py
    python bench/elastic_cost.py --help   # --steps, --warmup, --size
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import rabit2
from rabit2.api import current_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--size", type=int, default=4096, help="bytes of float32")
    opts = parser.parse_args()
    rabit2.init()
    config = current_config()
    elastic = config is not None and config.elastic
    data = np.ones(opts.size // 4, dtype=np.float32)

    def step() -> None:
        data.fill(1.0)  # (summed in place each step: it would overflow to inf)
        if elastic:
            with rabit2.live_set():
                rabit2.allreduce(data, rabit2.Op.SUM)
        else:
            rabit2.allreduce(data, rabit2.Op.SUM)

    for _ in range(opts.warmup):
        step()
    started = time.perf_counter()
    for _ in range(opts.steps):
        step()
    per_step = (time.perf_counter() - started) / opts.steps
    if rabit2.get_rank() == 0:
        kind = "live_set blocks" if elastic else "plain"
        print(f"{kind}: n={rabit2.get_world_size()} {opts.size} B allreduce, "
              f"{per_step * 1e6:.0f} us per step", flush=True)
    rabit2.finalize()


if __name__ == "__main__":
    main()
