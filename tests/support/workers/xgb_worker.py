"""A real XGBoost training, through rabit2 (``rabit2.xgboost``) or through XGBoost's own
collectives (``--backend xgboost``, with the arguments of its ``CommunicatorContext`` as JSON in
XGB_TRACKER_ARGS: its tracker's, or its federated server's), on the same data.  Prints one
line per rank: the model's and the predictions' digests, and the device the booster used.

Options (``--key value``): rows, features, rounds, depth, method, world (for the data split;
defaults to the job's), kill ``rank,round,when`` (``when``: ``before`` the round's checkpoint,
``during`` it, ``after`` it, ``mid`` in the round's update), checkpoint-every, classifier (fit with
``XGBClassifier`` instead of ``train``), lr-decay (a ``LearningRateScheduler``).  Other ``k=v``
arguments go to rabit2 (``mock=...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal

import numpy as np
import xgboost

import rabit2
import rabit2.xgboost as rx


def data(rank: int, world: int, rows: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(12345)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] ** 2 - x[:, 2] * x[:, 3]
         + rng.normal(scale=0.5, size=rows) > 0.3).astype(np.float32)
    part = np.array_split(np.arange(rows), world)[rank]
    return x[part], y[part]


class Kill(xgboost.callback.TrainingCallback):
    """SIGKILL this process at a chosen point of a chosen round, on the first attempt only."""

    def __init__(self, round_: int, when: str) -> None:
        self.round, self.when = round_, when

    def __getattribute__(self, name: str) -> object:
        # (its state travels in the checkpoints: only the first attempt ever kills)
        if name == "when" and os.environ.get("DMLC_NUM_ATTEMPT", "0") != "0":
            return ""
        return object.__getattribute__(self, name)

    def before_iteration(self, model, epoch, evals_log):  # type: ignore[no-untyped-def]
        if self.when == "after" and epoch == self.round + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.when == "mid" and epoch == self.round:
            self._mock(1)  # mid-round: in the round's second collective
        return False

    def after_iteration(self, model, epoch, evals_log):  # type: ignore[no-untyped-def]
        if self.when == "before" and epoch == self.round:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.when == "during" and epoch == self.round:
            self._mock(0)  # the round's calls are done: the next hit is its checkpoint
        return False

    @staticmethod
    def _mock(ahead: int) -> None:
        """Arm rabit2's own fault hook (``mock=``) for a call ``ahead`` of the current one."""
        state = rabit2.api._comm
        cfg = state.config
        assert cfg is not None
        spec = rabit2.config.MockSpec(state.rank, state.version, state.seqno + ahead, 0)
        state.config = dataclasses.replace(cfg, mock=(spec,))


def main() -> None:
    if os.environ.get("XGB_WORKER_DEBUG"):
        import logging  # noqa: PLC0415
        logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--method", default="hist")
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--backend", default="rabit2")
    parser.add_argument("--classifier", action="store_true")
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--lr-decay", action="store_true",
                        help="a LearningRateScheduler changes eta after every round")
    parser.add_argument("--diverge", action="store_true",
                        help="a restarted run builds its DMatrix from other data")
    opts, rest = parser.parse_known_args()
    params = {"tree_method": opts.method, "max_depth": opts.depth, "eta": 0.3,
              "objective": "binary:logistic", "eval_metric": "logloss",
              **json.loads(opts.extra)}
    params = {key: value for key, value in params.items() if value is not None}  # (null: unset)
    if opts.backend == "xgboost":
        args = json.loads(os.environ["XGB_TRACKER_ARGS"])
        with xgboost.collective.CommunicatorContext(**args):
            rank, world = xgboost.collective.get_rank(), xgboost.collective.get_world_size()
            booster, dtrain = run(opts, params, rank, world, xgboost.train)
            report(rank, world, booster, dtrain)
        return
    with rx.CommunicatorContext(rest):
        rank, world = rabit2.get_rank(), rabit2.get_world_size()
        callbacks = []
        for spec in opts.kill:  # (the same callbacks on a restart, inert there)
            r, round_, when = spec.split(",")
            callbacks.append(Kill(int(round_), when if int(r) == rank else ""))
        booster, dtrain = run(opts, params, rank, world, rx.train, callbacks)
        report(rank, world, booster, dtrain)


def run(opts, params, rank, world, train, callbacks=()):  # type: ignore[no-untyped-def]
    restarted = os.environ.get("DMLC_NUM_ATTEMPT", "0") != "0"
    x, y = data(rank, world, opts.rows, opts.features + (opts.diverge and restarted))
    dtrain = xgboost.DMatrix(x, y)
    if opts.classifier:
        clf = xgboost.XGBClassifier(n_estimators=opts.rounds, **{
            k: v for k, v in params.items() if k != "objective"})
        clf.fit(x, y)
        return clf.get_booster(), dtrain
    kwargs = {"checkpoint_every": opts.checkpoint_every} if train is rx.train else {}
    callbacks = list(callbacks)
    if opts.lr_decay:
        callbacks.append(xgboost.callback.LearningRateScheduler(decay))
    booster = train(params, dtrain, opts.rounds, evals=[(dtrain, "train")],
                    verbose_eval=False, callbacks=callbacks, **kwargs)
    return booster, dtrain


def decay(round_: int) -> float:
    """The learning rate after ``round_`` (a function of the module: callbacks are pickled
    into checkpoints)."""
    return 0.5 * 0.8 ** round_


def report(rank: int, world: int, booster: xgboost.Booster, dtrain: xgboost.DMatrix) -> None:
    model = hashlib.sha256(bytes(booster.save_raw("json"))).hexdigest()
    x, _ = data(0, 1, 2000, booster.num_features())
    pred = booster.predict(xgboost.DMatrix(x))
    digest = hashlib.sha256(np.ascontiguousarray(pred).tobytes()).hexdigest()
    device = json.loads(booster.save_config())["learner"]["generic_param"]["device"]
    print(f"xgb rank={rank} world={world} model={model} pred={digest} device={device}",
          flush=True)
    if rank == 0 and os.environ.get("XGB_PRED_OUT"):
        np.save(os.environ["XGB_PRED_OUT"], pred)


if __name__ == "__main__":
    main()
