"""``rx.train``: ``xgboost.train`` with a rabit2 checkpoint every K rounds.

What a restarted worker needs to rejoin (``docs/xgboost.md``, "Recovery"):

* the booster after the last checkpoint (``save_raw("ubj")``, loaded bit for bit) and its
  parameters then (``save_config``, which callbacks may have changed), the round to go on
  from, the evaluation history and the callbacks' state;
* the results of the calls XGBoost made before training: building the DMatrix (the number of
  columns, the data split checks) and, for ``hist``, the quantile sketch.  The sketch happens
  in a booster's first update; ``train`` makes it happen before training with a one-level
  *probe* booster on the same DMatrix, whose gradient index the real booster then reuses, so
  that it belongs to the prelude on every worker;
* the broadcasts a booster makes once, in its first update (XGBoost 3: the column sampler's
  seed from rank 0).  A restarted worker's loaded booster makes them again where the others
  do not; they are answered from the copies recorded in the first round.

All of it is global (the same on every rank), so it is one ``lazy_checkpoint`` object,
serialised only if a restarted neighbour asks for it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import operator
import pickle
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xgboost
from xgboost.callback import (
    CallbackContainer,
    EarlyStopping,
    EvaluationMonitor,
    TrainingCallback,
)

import rabit2
from rabit2.api import current_config
from rabit2.errors import MismatchError
from rabit2.xgboost.service import Endpoint, Record

logger = logging.getLogger("rabit2.xgboost")

FORMAT = 1
_SAMPLING = ("subsample", "colsample_bytree", "colsample_bylevel", "colsample_bynode")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingState:
    """What ``train`` checkpoints: everything a restarted worker needs to go on.

    :func:`train` writes and reads it; a program does not build one.  A restarted worker
    whose checkpoint holds anything else (or one of another format) fails to enter
    :class:`~rabit2.xgboost.CommunicatorContext` with
    :class:`~rabit2.errors.UnrecoverableError`.
    """

    format: int
    prelude: tuple[Record, ...]
    first_round: tuple[Record, ...]
    model: bytes
    next_round: int
    stopped: bool
    history: dict[str, Any]
    # this rank's own, in its local checkpoint: its callbacks' state, the digests of what
    # it sent in each call of the prelude, and its booster's parameters as they are then
    # (``save_config``: a callback may have changed them, as LearningRateScheduler does;
    # this rank's own, since some may differ between ranks, such as nthread)
    callbacks: tuple[dict[str, Any], ...] = ()
    prelude_digests: tuple[bytes, ...] = ()
    config: str = ""


Params = Mapping[str, Any] | Sequence[tuple[str, Any]]
"""XGBoost's parameters: a dict, or a list of pairs (which may repeat a key, such as
``eval_metric``)."""


def _items(params: Params) -> list[tuple[str, Any]]:
    return list(params.items()) if isinstance(params, Mapping) else list(params)


def _agree_on(params: Params, num_boost_round: int, checkpoint_every: int, keep: bool) -> bool:
    """Every rank trains the same model: a digest of the parameters and the rounds, reduced
    (MIN and MAX) through XGBoost's own collectives, so that a restarted worker's replay of
    the calls before training covers it too.  Raises ``MismatchError`` on every rank where
    they differ (XGBoost checks only what changes a call's size; the rest trains a different
    model on each rank, silently).  Whether training checkpoints is agreed in the same
    calls: only if every rank can (``keep``: each bounds its log of the calls before
    training by its own ``rabit2_replay_mb``, and a checkpoint some ranks take and others
    do not would mismatch every later call)."""
    # (by key, a repeated key's values in their order; numpy scalars as Python's; the keys
    # that do not change the model left out, so that each host may set its own)
    items = sorted(((key, _plain(key, value)) for key, value in _items(params)
                    if key not in _PER_HOST), key=operator.itemgetter(0))
    text = repr((items, num_boost_round, checkpoint_every)).encode()
    digest = np.array([int.from_bytes(hashlib.sha256(text).digest()[:7], "little"),
                       1 if keep else 0], np.int64)
    low = xgboost.collective.allreduce(digest, xgboost.collective.Op.MIN)
    high = xgboost.collective.allreduce(digest, xgboost.collective.Op.MAX)
    if low[0] != high[0]:
        raise MismatchError("rabit2.xgboost.train: the ranks passed different params, "
                            "num_boost_round or checkpoint_every: every rank must train the "
                            "same model")
    return bool(low[1])


_PER_HOST = frozenset({"nthread", "n_jobs", "verbosity", "silent", "validate_parameters"})
"""Parameters that may differ between ranks: they do not change the model."""


def _plain(key: str, value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if key == "device" and isinstance(value, str):
        value = value.partition(":")[0]  # (each rank may use a GPU of its own)
    return value


def train(
    params: Params,
    dtrain: xgboost.DMatrix,
    num_boost_round: int = 10,
    *,
    evals: Sequence[tuple[xgboost.DMatrix, str]] | None = None,
    obj: Any = None,
    maximize: bool | None = None,
    early_stopping_rounds: int | None = None,
    evals_result: dict[str, Any] | None = None,
    verbose_eval: bool | int | None = True,
    xgb_model: Any = None,
    callbacks: Sequence[TrainingCallback] | None = None,
    custom_metric: Any = None,
    checkpoint_every: int = 1,
) -> xgboost.Booster:
    """``xgboost.train`` (same arguments, same result) that survives a lost worker.

    Inside :class:`rabit2.xgboost.CommunicatorContext` with recovery on (``rabit2-submit``
    with ``--max-attempts`` above 1), the training state is checkpointed every
    ``checkpoint_every`` rounds; a worker restarted by the launcher takes it from its
    neighbours and rejoins where the others are, and the final model is bit-identical to
    the one a run without the fault trains.  Outside a context, or alone, this is
    ``xgboost.train``.

    Raises ``ValueError`` before training for ``checkpoint_every < 1`` and, with recovery
    on, for row or column sampling (``subsample``/``colsample_*`` below 1: XGBoost keeps
    sampler state that no saved model carries, so a restarted worker would sample
    differently); ``TypeError`` if a callback's state cannot be copied into a checkpoint;
    ``RuntimeError`` for a second call in the same context.  A rabit2 failure during
    training is raised as its typed :class:`~rabit2.errors.RabitError` (XGBoost's error is
    its ``__cause__``).
    """
    from rabit2.xgboost import context  # noqa: PLC0415 - the module imports this one

    given_every = checkpoint_every
    try:
        if isinstance(checkpoint_every, bool):
            raise TypeError
        checkpoint_every = operator.index(checkpoint_every)  # (numpy integers too)
    except TypeError:
        checkpoint_every = 0
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer, got {given_every!r}")
    active = context.active()
    if active is None and rabit2.is_distributed() and rabit2.get_world_size() > 1:
        raise RuntimeError("rabit2.xgboost.train outside rabit2.xgboost.CommunicatorContext "
                           "in a job of several workers would train a separate model on "
                           "each rank: train inside the context (rabit2.init does not "
                           "connect XGBoost's collectives)")
    if active is None or active.endpoint is None:
        return xgboost.train(params, dtrain, num_boost_round, evals=evals, obj=obj,
                             maximize=maximize, early_stopping_rounds=early_stopping_rounds,
                             evals_result=evals_result, verbose_eval=verbose_eval,
                             xgb_model=xgb_model, callbacks=callbacks,
                             custom_metric=custom_metric)
    if active.trained:
        raise RuntimeError("rabit2.xgboost.train runs once per CommunicatorContext, and a "
                           "worker process joins a job once (its recovery replays what came "
                           "before it): train again in a new job")
    active.trained = True
    if (xgboost.collective.get_world_size() != rabit2.get_world_size()
            or xgboost.collective.get_rank() != rabit2.get_rank()):
        raise RuntimeError("XGBoost's communicator is no longer the one rabit2 set up (was "
                           "xgboost.collective finalized or initialised inside the context?)")
    config = current_config()
    recover = bool(config is not None and config.recover)
    lookup = dict(_items(params))  # (the last of a repeated key, as XGBoost takes it)
    given: dict[str, Any] | list[tuple[str, Any]] = (
        dict(params) if isinstance(params, Mapping) else list(params))  # (pairs kept)
    if recover:
        _refuse_what_cannot_recover(lookup)
    callbacks = [] if callbacks is None else list(callbacks)
    evals = list(evals) if evals else []
    if verbose_eval:
        period = 1 if verbose_eval is True else int(verbose_eval)
        callbacks.append(EvaluationMonitor(period=period))
    if early_stopping_rounds:
        callbacks.append(EarlyStopping(rounds=early_stopping_rounds, maximize=maximize))
    if recover:
        _snapshot(callbacks)  # a TypeError now, not at the first checkpoint
    endpoint = active.endpoint
    # (checkpoints hold the calls before training, a restarted worker's log: not where a
    # rank's log outgrew its bound; a restarted worker's log is the checkpoint's)
    keep = recover and (endpoint.hold_prelude() or active.restored is not None)
    try:
        checkpoints = _agree_on(given, num_boost_round, checkpoint_every, keep)
        return _train(active.restored, endpoint, recover, checkpoints, given, dtrain,
                      num_boost_round, evals, obj, evals_result, xgb_model, callbacks,
                      custom_metric, checkpoint_every)
    except xgboost.core.XGBoostError as exc:
        failure = endpoint.failure
        if failure is not None and failure.error is not None:
            raise failure.error from exc
        raise


def _refuse_what_cannot_recover(lookup: Mapping[str, Any]) -> None:
    """``ValueError`` for parameters whose training a restarted worker cannot go on with."""
    random = [f"{k} below 1" for k in _SAMPLING if float(lookup.get(k, 1.0)) < 1.0]
    if lookup.get("booster") == "dart":
        random.append("booster dart (random dropout)")
    if lookup.get("feature_selector") in ("random", "shuffle"):
        random.append(f"feature_selector {lookup['feature_selector']}")
    if random:
        raise ValueError(
            f"{', '.join(random)} cannot be recovered bit-exactly: XGBoost keeps random "
            "state that no saved model carries, so a restarted worker would draw "
            "differently. Train without it, or run without recovery (rabit2-submit "
            "--max-attempts 1)")
    if str(lookup.get("lambdarank_unbiased", "0")).lower() in ("1", "true"):
        raise ValueError(
            "lambdarank_unbiased cannot be recovered: XGBoost estimates the position "
            "bias from the first round on and no saved model carries it, so a restarted "
            "worker's booster refuses to go on. Train without it, or run without "
            "recovery (rabit2-submit --max-attempts 1)")


def _train(restored: TrainingState | None, endpoint: Endpoint, recover: bool,
           checkpoints: bool, params: dict[str, Any] | list[tuple[str, Any]],
           dtrain: xgboost.DMatrix, num_boost_round: int,
           evals: list[tuple[xgboost.DMatrix, str]], obj: Any,
           evals_result: dict[str, Any] | None, xgb_model: Any,
           callbacks: list[TrainingCallback], custom_metric: Any,
           checkpoint_every: int) -> xgboost.Booster:
    cache = [dtrain] + [d for d, _ in evals]
    extras: tuple[tuple[int, int], ...] = ()
    if checkpoints:
        extras = _probe(endpoint, params, dtrain)
    elif recover:
        # (rabit2's replay store, bounded by the same rabit2_replay_mb, has outgrown it by
        # now too: a worker lost from here on cannot be recovered)
        endpoint.drop_prelude()
        logger.warning("rank %d: rabit2.xgboost.train takes no checkpoints: the calls "
                       "before it outgrew rabit2_replay_mb%s", rabit2.get_rank(),
                       "" if endpoint.prelude_outgrown else " on another rank")
    kept = endpoint.end_prelude()
    assert kept is not None or not checkpoints  # (hold_prelude kept it whole)
    prelude, digests = kept or ((), ())
    if restored is not None:
        bst = xgboost.Booster(params, cache, model_file=bytearray(restored.model))
        _restore_params(bst, restored.config)
        start, stopped, first_round = restored.next_round, restored.stopped, restored.first_round
        endpoint.expect_prologue(extras, first_round)
        prelude, digests = restored.prelude, restored.prelude_digests
    else:
        bst = xgboost.Booster(params, cache, model_file=xgb_model)
        start, stopped, first_round = 0, False, ()
    container = CallbackContainer(callbacks, metric=custom_metric, output_margin=callable(obj))
    bst = container.before_training(bst)
    if restored is not None:
        container.history = copy.deepcopy(restored.history)
        if len(callbacks) != len(restored.callbacks):
            raise MismatchError(
                f"the restarted worker trains with {len(callbacks)} callbacks where the "
                f"checkpoint has the state of {len(restored.callbacks)}: the program must "
                "pass the same callbacks on a restart")
        for callback, state in zip(callbacks, restored.callbacks, strict=True):
            callback.__dict__.update(copy.deepcopy(state))
    for i in range(start, num_boost_round):
        if stopped or container.before_iteration(bst, i, dtrain, evals):
            break
        bst.update(dtrain, iteration=i, fobj=obj)
        stopped = container.after_iteration(bst, i, dtrain, evals)
        if restored is None and i == start:
            first_round = endpoint.first_round_broadcasts()
        if checkpoints and ((i + 1) % checkpoint_every == 0 or stopped
                        or i + 1 == num_boost_round):
            # the callbacks' state is this rank's own (a callback may act on one rank only)
            rabit2.lazy_checkpoint(TrainingState(
                FORMAT, prelude, first_round, bytes(bst.save_raw("ubj")), i + 1, stopped,
                copy.deepcopy(dict(container.history))),
                local_model={"callbacks": _snapshot(callbacks), "prelude": digests,
                             "config": bst.save_config()})
    bst = container.after_training(bst)
    if evals_result is not None:
        evals_result.update(container.history)
    booster: xgboost.Booster = bst.reset()
    return booster


def _restore_params(bst: xgboost.Booster, saved: str) -> None:
    """Set on ``bst`` every parameter whose value in ``saved`` (a ``save_config`` of the
    booster at the checkpoint) differs from ``bst``'s own: what callbacks changed with
    ``set_param`` since the booster was made.  (``load_config`` does not do it: XGBoost
    configures a booster again from the parameters it was given, eta among them.)"""
    def differing() -> list[tuple[str, Any]]:
        now = dict(_leaves(json.loads(bst.save_config())))
        # (an evaluation metric's own section, huber_slope or the ranking metrics' settings,
        # appears once the booster first evaluates, from the booster's parameters: a booster
        # just made has none to compare)
        return [(str(path[-1]), value) for path, value in _leaves(json.loads(saved))
                if now.get(path) != value and _settable(path)
                and (path in now or "metrics" not in path)]

    for key, value in differing():
        bst.set_param(key, value)
    left = differing()
    if left:  # (an alias set after it in XGBoost's order would win: never train on so)
        raise rabit2.errors.UnrecoverableError(
            f"the restarted worker's booster does not take back the parameters it had at "
            f"the checkpoint: {', '.join(f'{k}={v}' for k, v in left)}")


def _settable(path: tuple[str | int, ...]) -> bool:
    """Whether a ``save_config`` leaf is a training parameter ``set_param`` sets: one of a
    ``*_param`` section, but not the model's shape (loaded with the model) nor the keys each
    host may set for itself."""
    key = path[-1]
    return (isinstance(key, str) and len(path) >= 2 and isinstance(path[-2], str)
            and path[-2].endswith("_param") and not path[-2].endswith("model_param")
            and key not in _PER_HOST and key != "device")


def _leaves(tree: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...],
                                                                          Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _leaves(value, (*path, index))
    else:
        yield path, tree


def _probe(endpoint: Endpoint, params: Params,
           dtrain: xgboost.DMatrix) -> tuple[tuple[int, int], ...]:
    """Two one-level boosters on ``dtrain``, before training, on every worker.

    The first builds the quantile sketch (``hist``), which the real booster then reuses, so
    that it is part of the prelude.  The second is loaded from the first, as a restarted
    worker's booster is, and updated twice: what its first update makes beyond its second
    is what a loaded booster does once (XGBoost 3: broadcast the column sampler's seed).
    Returns those calls as (root, size) of broadcasts; () if they are anything else, and a
    restarted worker then makes them over the network (where the others do not: a typed
    MismatchError, never a wrong model)."""
    probe_params = [(key, value) for key, value in _items(params)
                    if key not in ("max_depth", "num_parallel_tree")]
    # (quiet: XGBoost's warnings about the params are the real booster's to give)
    probe_params += [("max_depth", 1), ("num_parallel_tree", 1), ("verbosity", 0)]
    first = xgboost.Booster(probe_params, [dtrain])
    first.update(dtrain, 0)
    loaded = xgboost.Booster(probe_params, [dtrain], model_file=first.save_raw("ubj"))
    with endpoint.capture() as once:
        loaded.update(dtrain, 1)
    with endpoint.capture() as again:
        loaded.update(dtrain, 2)
    shape = [(r.method, r.dtype, r.op, r.root, len(r.result)) for r in once]
    tail = [(r.method, r.dtype, r.op, r.root, len(r.result)) for r in again]
    extra = shape[:len(shape) - len(tail)]
    if shape[len(extra):] != tail or any(m != "Broadcast" for m, *_ in extra):
        logger.warning("a loaded booster's first update makes calls rabit2 does not know "
                       "(%s): a worker restarted in training will fail typed", extra)
        return ()
    return tuple((root, size) for _, _, _, root, size in extra)


def _snapshot(callbacks: list[TrainingCallback]) -> tuple[dict[str, Any], ...]:
    """Each callback's state, copied, for this rank's local checkpoint (which is pickled).
    Functions are code, not state: a restarted worker keeps those of its own callbacks (a
    LearningRateScheduler's schedule).  Raises ``TypeError`` naming the callback and the
    attribute whose value does not copy or pickle."""
    states = []
    for callback in callbacks:
        state = {key: value for key, value in vars(callback).items()
                 if not isinstance(value, _CODE)}
        try:
            copied = copy.deepcopy(state)
            pickle.dumps(copied, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # deepcopy and pickle raise many unrelated types
            raise TypeError(f"callback {type(callback).__name__} cannot be checkpointed: "
                            f"{_culprit(state)} ({exc})") from exc
        states.append(copied)
    return tuple(states)


_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


def _culprit(state: dict[str, Any]) -> str:
    """Which attribute of a callback's state does not copy or pickle."""
    for key, value in state.items():
        try:
            pickle.dumps(copy.deepcopy(value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # (looking for the one that fails)
            return f"its attribute {key!r} ({type(value).__name__}) does not copy or pickle"
    return "its state does not copy or pickle"


def restored_state(version: int, model: Any, local: Any) -> TrainingState | None:
    """The training state a restarted worker fetched (the global part from a neighbour,
    this rank's own from its replica), checked; None on a fresh start."""
    if version == 0:
        return None
    if not isinstance(model, TrainingState) or model.format != FORMAT:
        raise rabit2.errors.UnrecoverableError(
            f"checkpoint {version} is not one rabit2.xgboost.train wrote (got "
            f"{type(model).__name__}); a program that checkpoints itself cannot use it")
    if (not isinstance(local, dict) or not isinstance(local.get("callbacks"), tuple)
            or not isinstance(local.get("prelude"), tuple)
            or not isinstance(local.get("config"), str)):
        raise rabit2.errors.UnrecoverableError(
            f"checkpoint {version} has no state of this rank's own (got "
            f"{type(local).__name__})")
    return dataclasses.replace(model, callbacks=local["callbacks"],
                               prelude_digests=local["prelude"], config=local["config"])


__all__ = ["TrainingState", "train"]
