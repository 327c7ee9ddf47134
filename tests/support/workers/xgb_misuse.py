"""Misuses of ``rabit2.xgboost`` inside a real job; every rank prints how it ended.  Modes:
``params`` (ranks train with different eta), ``rounds`` (different num_boost_round),
``pairs`` (params as pairs that repeat eval_metric), ``second`` (a second context after the
first), ``finalized`` (xgboost.collective finalized inside the context), ``schedule`` (a
LearningRateScheduler of a list: its function is code, not checkpointed state),
``unpicklable`` (a callback holding an open file), ``outside`` (``rx.train`` after a plain
``rabit2.init``), ``per-host`` (nthread and verbosity per rank, eta a numpy float on one),
``unbiased`` (``lambdarank_unbiased``, which no restart could go on with), ``no-replica``
(``rabit_local_replica=0`` with recovery on), ``plain-first`` (``xgboost.train`` inside the
context before ``rx.train``: the calls before ``rx.train`` grow past ``rabit2_replay_mb``),
``uneven-bound`` (the same with ``rabit2_replay_mb=1`` on rank 0 only: the ranks still agree
whether ``rx.train`` checkpoints), ``heap`` (page faults of freeing and allocating 2 MiB
buffers again, inside the context and after it)."""

from __future__ import annotations

import os
import resource
import sys

import numpy as np
import xgboost

import rabit2
import rabit2.xgboost as rx


class Holder(xgboost.callback.TrainingCallback):
    """A callback whose state holds an open file."""

    def __init__(self) -> None:
        super().__init__()
        self.log = open(os.devnull, "w")  # noqa: SIM115 - held for the whole training


def faults() -> float:
    """Page faults per iteration of allocating and freeing two 2 MiB buffers."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        a = bytearray(2 << 20)
        b = bytes(a)
        del a, b
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50


def main() -> None:
    mode = sys.argv[1]
    if mode == "heap":
        with rx.CommunicatorContext(sys.argv[2:]):
            inside = faults()
        print(f"outcome rank={os.environ['DMLC_TASK_ID']} heap inside={inside:.0f} "
              f"after={faults():.0f}", flush=True)
        return
    rng = np.random.default_rng(7)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    params: object = {"tree_method": "hist", "max_depth": 2, "objective": "binary:logistic"}
    rank = -1
    if mode == "outside":
        rabit2.init()
        try:
            rx.train(params, xgboost.DMatrix(x, y), 2, verbose_eval=False)  # type: ignore[arg-type]
        except RuntimeError as exc:
            print(f"outcome rank={rabit2.get_rank()} {type(exc).__name__}: "
                  f"{' '.join(str(exc).split())}", flush=True)
            rabit2.finalize()
            sys.exit(3)
    try:
        bound = ({"rabit2_replay_mb": 1} if mode == "uneven-bound"
                 and os.environ.get("DMLC_TASK_ID") == "0" else {})
        with rx.CommunicatorContext(
                rabit_local_replica=0 if mode == "no-replica" else None, **bound):
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
            elif mode == "per-host":
                params = {**params, "nthread": 1 + rank, "verbosity": rank,  # type: ignore[dict-item]
                          "eta": np.float64(0.3) if rank else 0.3}
            elif mode == "unbiased":
                params = {**params, "lambdarank_unbiased": True}  # type: ignore[dict-item]
            callbacks: list[xgboost.callback.TrainingCallback] = []
            if mode == "schedule":
                callbacks.append(xgboost.callback.LearningRateScheduler([0.3, 0.2, 0.1]))
            elif mode == "unpicklable":
                callbacks.append(Holder())
            if mode in ("plain-first", "uneven-bound"):
                xgboost.train({**params, "max_depth": 6}, dtrain, 60)  # type: ignore[dict-item]
            history: dict[str, dict[str, list[float]]] = {}
            rx.train(params, dtrain, rounds, evals=[(dtrain, "train")],  # type: ignore[arg-type]
                     evals_result=history, verbose_eval=False, callbacks=callbacks)
            print(f"metrics rank={rank} {sorted(history['train'])} "
                  f"checkpoint={rabit2.version_number()}", flush=True)
        if mode == "second":
            with rx.CommunicatorContext():
                pass
        print(f"outcome rank={rank} ok", flush=True)
    except (RuntimeError, TypeError, ValueError, rabit2.RabitError) as exc:
        rank = rank if rank >= 0 else int(os.environ["DMLC_TASK_ID"])  # (failed to join)
        print(f"outcome rank={rank} {type(exc).__name__}: {' '.join(str(exc).split())}",
              flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
