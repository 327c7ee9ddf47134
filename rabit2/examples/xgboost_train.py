"""Distributed XGBoost training through rabit2, with recovery of a lost worker.

Run it under the launcher (needs ``pip install "rabit2[xgboost]"``)::

    rabit2-submit --cluster local -n 4 -- python -m rabit2.examples.xgboost_train
    rabit2-submit --cluster local -n 4 -- python -m rabit2.examples.xgboost_train mock=2,3,1,0

The second line kills rank 2 in its second collective of boosting round 3 (rabit's mock
spec: rank, checkpoint version, call, attempt); the launcher restarts it, it takes the
training state from its neighbours and rejoins, and every rank prints the same ``model=``
digest as a run without the kill.  Each rank trains on its own block of rows of a
synthetic data set (``--rows``, ``--features``); ``--rounds`` and ``--depth`` as in XGBoost.
Alone (``python -m rabit2.examples.xgboost_train``) it is plain single-process XGBoost.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
import xgboost

import rabit2
import rabit2.xgboost as rx


def shard(rank: int, world: int, rows: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's rows of a fixed synthetic binary-classification set."""
    rng = np.random.default_rng(2024)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    signal = x[:, 0] - 0.7 * x[:, 1] * x[:, 2] + np.sin(2 * x[:, 3])
    y = (signal + rng.normal(scale=0.6, size=rows) > 0).astype(np.float32)
    part = np.array_split(np.arange(rows), world)[rank]
    return x[part], y[part]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments of the form k=v go to rabit2.init: rabit's parameters "
               "(rabit_timeout_sec=600, ...) and mock=RANK,VERSION,CALL,ATTEMPT, which kills "
               "that rank at that call to show recovery (docs/xgboost.md).")
    parser.add_argument("--rows", type=int, default=100_000, help="rows in all (100 000)")
    parser.add_argument("--features", type=int, default=20, help="features (20)")
    parser.add_argument("--rounds", type=int, default=20, help="boosting rounds (20)")
    parser.add_argument("--depth", type=int, default=6, help="max_depth (6)")
    opts, rabit_args = parser.parse_known_args(argv)  # k=v arguments go to rabit2
    params = {"tree_method": "hist", "max_depth": opts.depth, "eta": 0.2,
              "objective": "binary:logistic", "eval_metric": "logloss"}
    with rx.CommunicatorContext(rabit_args):
        rank, world = rabit2.get_rank(), rabit2.get_world_size()
        x, y = shard(rank, world, opts.rows, opts.features)
        dtrain = xgboost.DMatrix(x, y)
        history: dict[str, dict[str, list[float]]] = {}
        booster = rx.train(params, dtrain, opts.rounds, evals=[(dtrain, "train")],
                           evals_result=history, verbose_eval=5)
        digest = hashlib.sha256(bytes(booster.save_raw("json"))).hexdigest()[:16]
        loss = history["train"]["logloss"][-1]
        print(f"xgboost rank={rank} world={world} rounds={booster.num_boosted_rounds()} "
              f"logloss={loss:.6f} model={digest}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
