"""One worker of ``bench/xgboost_train.py``: the same ``hist`` training through one backend.

``--backend rabit2``: ``rabit2.xgboost`` (``rx.train``) under ``rabit2-submit``;
``xgboost-rabit`` / ``xgboost-federated``: ``xgboost.train`` inside
``xgboost.collective.CommunicatorContext`` with the arguments in ``XGB_BENCH_ARGS`` (JSON;
``federated_rank`` is this process's ``--rank``).  Rank 0 prints one JSON line: training
seconds (data generation and DMatrix construction excluded), rounds, the model's digest and,
for rabit2, the endpoint's counters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import numpy as np
import xgboost

BLOCK = 65536


def shard(rank: int, world: int, rows: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows in fixed blocks seeded by their index: any world size sees the same data set."""
    part = np.array_split(np.arange(rows), world)[rank]
    lo, hi = int(part[0]), int(part[-1]) + 1
    xs, ys = [], []
    for block in range(lo // BLOCK, (hi - 1) // BLOCK + 1):
        rng = np.random.default_rng([7, block])
        start = block * BLOCK
        n = min(BLOCK, rows - start)
        x = rng.normal(size=(n, features)).astype(np.float32)
        y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] - np.abs(x[:, 3])
             + rng.normal(scale=0.5, size=n) > 0).astype(np.float32)
        a, b = max(lo, start) - start, min(hi, start + n) - start
        xs.append(x[a:b])
        ys.append(y[a:b])
    return np.concatenate(xs), np.concatenate(ys)


def train(opts: argparse.Namespace, rank: int, world: int, fn: Any,
          **kwargs: Any) -> tuple[xgboost.Booster, float]:
    x, y = shard(rank, world, opts.rows, opts.features)
    dtrain = xgboost.DMatrix(x, y)
    params = {"tree_method": "hist", "max_depth": opts.depth, "eta": 0.1,
              "objective": "binary:logistic", "eval_metric": "logloss", "nthread": opts.nthread,
              "device": opts.device}
    start = time.perf_counter()
    booster = fn(params, dtrain, opts.rounds, evals=[(dtrain, "train")], verbose_eval=False,
                 **kwargs)
    return booster, time.perf_counter() - start


def report(rank: int, booster: xgboost.Booster, seconds: float, extra: dict[str, Any]) -> None:
    if rank == 0:
        digest = hashlib.sha256(bytes(booster.save_raw("json"))).hexdigest()[:16]
        print("BENCH " + json.dumps({"train_s": seconds, "rounds": booster.num_boosted_rounds(),
                                     "model": digest, **extra}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--features", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--nthread", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=-1)
    opts = parser.parse_args()
    if opts.backend == "rabit2":
        import rabit2  # noqa: PLC0415
        import rabit2.xgboost as rx  # noqa: PLC0415

        with rx.CommunicatorContext() as ctx:
            rank, world = rabit2.get_rank(), rabit2.get_world_size()
            booster, seconds = train(opts, rank, world, rx.train)
            stats = ctx.endpoint.statistics() if ctx.endpoint is not None else {}
            report(rank, booster, seconds, {"endpoint": stats})
        return
    args = json.loads(os.environ["XGB_BENCH_ARGS"])
    if opts.backend == "xgboost-federated":
        args["federated_rank"] = opts.rank
    with xgboost.collective.CommunicatorContext(**args):
        rank, world = xgboost.collective.get_rank(), xgboost.collective.get_world_size()
        booster, seconds = train(opts, rank, world, xgboost.train)
        report(rank, booster, seconds, {})


if __name__ == "__main__":
    main()
