"""Misuses of ``rabit2.xgboost`` inside a real job; every rank prints how it ended.  Modes:
``params`` (ranks train with different eta), ``rounds`` (different num_boost_round),
``pairs`` (params as pairs that repeat eval_metric), ``second`` (a second context after the
first), ``finalized`` (xgboost.collective finalized inside the context)."""

from __future__ import annotations

import sys

import numpy as np
import xgboost

import rabit2
import rabit2.xgboost as rx


def main() -> None:
    mode = sys.argv[1]
    rng = np.random.default_rng(7)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    params: object = {"tree_method": "hist", "max_depth": 2, "objective": "binary:logistic"}
    rank = -1
    try:
        with rx.CommunicatorContext():
            rank = rabit2.get_rank()
            dtrain = xgboost.DMatrix(x[rank::2], y[rank::2])
            rounds = 3
            if mode == "params":
                params = {**params, "eta": 0.1 if rank == 0 else 0.3}  # type: ignore[dict-item]
            elif mode == "rounds":
                rounds = 3 + rank
            elif mode == "pairs":
                params = [*params.items(), ("eval_metric", "auc"),  # type: ignore[attr-defined]
                          ("eval_metric", "logloss")]
            elif mode == "finalized":
                xgboost.collective.finalize()
            history: dict[str, dict[str, list[float]]] = {}
            rx.train(params, dtrain, rounds, evals=[(dtrain, "train")],  # type: ignore[arg-type]
                     evals_result=history, verbose_eval=False)
            print(f"metrics rank={rank} {sorted(history['train'])}", flush=True)
        if mode == "second":
            with rx.CommunicatorContext():
                pass
        print(f"outcome rank={rank} ok", flush=True)
    except (RuntimeError, rabit2.RabitError) as exc:
        print(f"outcome rank={rank} {type(exc).__name__}: {' '.join(str(exc).split())}",
              flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
