"""``rx.CommunicatorContext``: rabit2 for the process, and XGBoost's collectives through it."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import xgboost

import rabit2
from rabit2.api import abort_for, current_config, enter, exited, in_context
from rabit2.config import load_config
from rabit2.errors import RabitError
from rabit2.xgboost.memory import raise_thresholds
from rabit2.xgboost.service import Endpoint
from rabit2.xgboost.training import TrainingState, restored_state

logger = logging.getLogger("rabit2.xgboost")

_lock = threading.Lock()
_active: list[CommunicatorContext] = []  # the open context (one per process at most)
# the jobs this process has left (tracker host, port, task id, digest of the job secret): its
# task cannot join one again
_left: set[tuple[str | None, int, str, bytes]] = set()


def active() -> CommunicatorContext | None:
    """The context this process is in, if any."""
    return _active[0] if _active else None


def check_xgboost() -> None:
    """Raise ``RuntimeError`` (before the job is touched) for an XGBoost that cannot use the
    endpoint: older than 3.0; 3.3, whose federated communicator refuses calls that training
    makes; 3.4 and later, whose wheels dropped it; or built without it (``xgboost-cpu``, the
    macOS and Windows wheels)."""
    major, minor = (int(part) for part in re.findall(r"\d+", xgboost.__version__)[:2])
    if major != 3 or minor >= 3:
        raise RuntimeError(
            f"rabit2.xgboost needs XGBoost 3.0, 3.1 or 3.2 (pip install 'xgboost>=3,<3.3'), "
            f"found {xgboost.__version__}: it serves XGBoost's federated communicator, which "
            "XGBoost 3.3 no longer lets training use and later releases removed")
    if not xgboost.build_info().get("USE_FEDERATED"):
        raise RuntimeError(
            f"this XGBoost build ({xgboost.__version__}) has no federated communicator, which "
            "rabit2.xgboost serves: install the 'xgboost' wheel for Linux (the 'xgboost-cpu' "
            "wheel is built without it)")


def _job_of(args: Iterable[str | bytes] | None,
            kwargs: dict[str, Any]) -> tuple[str | None, int, str, bytes]:
    """The job and task that ``rabit2.init(args, **kwargs)`` would join (its ``ValueError``
    and ``TypeError`` for bad parameters): the tracker's address, the task and a digest of
    the job's secret (each tracker makes its own: a later job on the same port is another
    job)."""
    config = load_config(args, kwargs)
    return (config.tracker_uri, config.tracker_port, config.task_id,
            hashlib.sha256(config.secret).digest())


class CommunicatorContext(contextlib.AbstractContextManager["CommunicatorContext"]):
    """Join the rabit2 job and route XGBoost's collectives through it.

    ``with CommunicatorContext(args, **kwargs):`` calls ``rabit2.init(args, **kwargs)``
    (the environment ``rabit2-submit`` sets is read as usual), starts this worker's federated
    endpoint on loopback, takes the training checkpoint from the neighbours when this worker
    was restarted, and initialises ``xgboost.collective`` with the federated communicator
    pointed at the endpoint.  Alone (no tracker configured) XGBoost runs as it would
    without it.  On the way out XGBoost's communicator, the endpoint and rabit2 are shut
    down; an exception inside the block first aborts the job, so that every other rank
    fails at once instead of waiting for this one.

    Entering raises ``RuntimeError`` if a context is already open in this process (this
    one, or ``rabit2.CommunicatorContext`` or ``rabit2.collective``'s: it joins and leaves
    the job itself, so use it instead of them; a ``rabit2.collective`` context inside it
    neither joins nor leaves), before the job is touched; what :func:`rabit2.init` raises
    (``ValueError``, a :class:`~rabit2.errors.RabitError`); in a job, ``RuntimeError`` for
    an XGBoost older than 3.0 or built without the federated communicator, and, in a
    restarted worker, what :func:`rabit2.load_checkpoint` raises
    (:class:`~rabit2.errors.UnrecoverableError` also when the checkpoint is not one
    :func:`rabit2.xgboost.train` wrote).  A failure after :func:`rabit2.init` aborts the job,
    naming it, before it is raised.  Leaving normally raises what :func:`rabit2.finalize`
    raises; leaving by an exception raises nothing of its own (the exception propagates).
    """

    def __init__(self, args: Iterable[str | bytes] | None = None, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.endpoint: Endpoint | None = None
        self.restored: TrainingState | None = None
        self.trained = False
        self._xgb = False  # xgboost.collective initialised by this context
        # puts back the malloc thresholds the environment set (rabit2.xgboost.memory)
        self._put_back: Callable[[], None] | None = None
        self._counted = False  # among the process's open contexts (rabit2.api.enter)

    def __enter__(self) -> CommunicatorContext:
        with _lock:
            if _active:
                raise RuntimeError("a rabit2.xgboost.CommunicatorContext is already open "
                                   "in this process")
            if in_context():
                raise RuntimeError(
                    "rabit2.xgboost.CommunicatorContext inside another rabit2 context: it "
                    "joins and leaves the job itself (the outer context's block would go on "
                    "alone after it); use it instead of the other")
            _active.append(self)
        try:
            job = _job_of(self.args, self.kwargs)
            if job in _left:
                raise RuntimeError(
                    "this worker already took part in this job and left it: a task joins "
                    "a job once, so one CommunicatorContext (and one rabit2.xgboost.train) "
                    "per worker process; train again in a new job")
            enter(lambda: rabit2.init(self.args, **self.kwargs))
            self._counted = True
            if rabit2.is_distributed():
                self._join()
        except BaseException as exc:
            # (e.g. an XGBoost without the federated communicator on one host: the job is
            # aborted, naming it, rather than the others waiting for this rank)
            self._close(failed=True, error=exc)
            raise
        return self

    def _join(self) -> None:
        _left.add(_job_of(self.args, self.kwargs))  # (from now on this task cannot rejoin)
        check_xgboost()
        config = current_config()
        if config is not None and config.recover and config.local_replica == 0:
            # (said here, naming what needs it, not by load_checkpoint below)
            raise ValueError("rabit2.xgboost.CommunicatorContext with recovery on keeps each "
                             "worker's own training state as a local model, which needs "
                             "rabit_local_replica >= 1 (default 2)")
        rank, world = rabit2.get_rank(), rabit2.get_world_size()
        if config is None or config.xgboost_heap:
            self._put_back = raise_thresholds()
        self.endpoint = Endpoint(rank, world, None if config is None or not config.recover
                                 else config.replay_mb << 20)
        port = self.endpoint.start()
        version, state, local = rabit2.load_checkpoint(with_local=True)
        self.restored = restored_state(version, state, local)
        if self.restored is not None:
            self.endpoint.replay_prelude(self.restored.prelude, self.restored.prelude_digests)
            logger.info("rank %d restarted: training goes on from round %d (checkpoint %d)",
                        rank, self.restored.next_round, version)
        xgboost.collective.init(dmlc_communicator="federated",
                                federated_server_address=f"127.0.0.1:{port}",
                                federated_world_size=world, federated_rank=rank)
        self._xgb = True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._close(failed=exc is not None, error=exc)

    def _close(self, failed: bool, error: BaseException | None = None) -> None:
        try:
            if self._xgb:
                self._xgb = False
                with contextlib.suppress(xgboost.core.XGBoostError):
                    xgboost.collective.finalize()
            if error is not None:
                abort_for(error)  # the others fail now, naming it; no restart
            elif failed:
                with contextlib.suppress(RabitError):
                    rabit2.finalize()
            else:
                rabit2.finalize()
        finally:
            put_back, self._put_back = self._put_back, None
            try:
                if self.endpoint is not None:
                    self.endpoint.stop()
            finally:
                if put_back is not None:
                    put_back()
            if self._counted:
                self._counted = False
                exited()
            with _lock:
                _active.clear()
