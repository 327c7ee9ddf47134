"""``xgboost.collective`` exactly, on rabit2: ``import rabit2.collective as collective``.

The rabit-style API (:mod:`rabit2`) reduces in place and returns the same array; code written
against ``xgboost.collective`` (3.x) expects what that module does, and this module does it:

* ``allreduce(data, op)`` returns a **new, flattened** array and leaves ``data`` untouched
  (XGBoost: ``data.ravel().copy()``), so a program that reuses its input gets the same numbers;
* ``Op`` has XGBoost 3's values: ``MAX=0, MIN=1, SUM=2, BITWISE_AND=3, BITWISE_OR=4,
  BITWISE_XOR=5`` (rabit's ``BITOR`` is 3: do not mix the two enums' integers), with rabit
  1.x's ``Op.OR`` as an alias of ``BITWISE_OR``;
* ``communicator_print`` strips the message; ``CommunicatorContext(**args)`` returns its
  arguments from ``__enter__``; ``is_distributed`` is a ``bool`` and ``get_processor_name`` a
  ``str``; ``RabitContext(rabit_args)`` is rabit 1.x's (XGBoost 1.x ``xgboost.rabit``).

What still differs from XGBoost is in ``docs/user-guide.md`` ("xgboost.collective on
rabit2").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterable
from enum import IntEnum
from typing import Any, TypeVar

import numpy as np

from rabit2 import api
from rabit2.calls import pickled
from rabit2.core.ops import Op as _RabitOp
from rabit2.core.ops import check_op_dtype

_T = TypeVar("_T")


class Op(IntEnum):
    """XGBoost 3's reduction operators (its integer values)."""

    MAX = 0
    MIN = 1
    SUM = 2
    BITWISE_AND = 3
    BITWISE_OR = 4
    BITWISE_XOR = 5
    OR = 4  # rabit 1.x's spelling of BITWISE_OR (an alias: Op.OR is Op.BITWISE_OR)


logger = logging.getLogger("rabit2")

_TO_RABIT = {
    Op.MAX: _RabitOp.MAX, Op.MIN: _RabitOp.MIN, Op.SUM: _RabitOp.SUM,
    Op.BITWISE_AND: _RabitOp.BITAND, Op.BITWISE_OR: _RabitOp.BITOR,
    Op.BITWISE_XOR: _RabitOp.BITXOR,
}


@dataclasses.dataclass
class Config:
    """XGBoost 3's ``collective.Config``: settings a framework hands on to the workers'
    communicator.  :meth:`get_comm_config` puts ``retry`` and ``timeout`` into ``init``'s
    arguments as ``dmlc_retry`` (tracker connection attempts) and ``dmlc_timeout`` (seconds
    a collective may wait).  The tracker fields are kept for code that sets them; rabit2's
    tracker takes its address and deadline from ``rabit2-submit`` or ``rabit2-tracker``."""

    retry: int | None = None
    timeout: int | None = None
    tracker_host_ip: str | None = None
    tracker_port: int | None = None
    tracker_timeout: int | None = None

    def get_comm_config(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` with ``dmlc_retry`` and ``dmlc_timeout`` set from the fields given
        (changed in place and returned, as XGBoost does)."""
        if self.retry is not None:
            args["dmlc_retry"] = self.retry
        if self.timeout is not None:
            args["dmlc_timeout"] = self.timeout
        return args


def init(**args: Any) -> None:
    """Join the job (``rabit2.init(**args)``; ``dmlc_*`` keys as in XGBoost), with
    :func:`rabit2.init`'s errors: ``ValueError`` for bad parameters, a
    :class:`~rabit2.errors.RabitError` when the job cannot be joined."""
    api.init(**args)


def finalize() -> None:
    """Leave the job (``rabit2.finalize()``), with its errors:
    :class:`~rabit2.errors.JobAbortedError` if the job is aborted while this worker waits
    for the others (recovery on).  Safe to call when not initialised."""
    api.finalize()


def get_rank() -> int:
    """This worker's rank (0 when not initialised).  Never raises."""
    return api.get_rank()


def get_world_size() -> int:
    """The number of workers (1 when not initialised).  Never raises."""
    return api.get_world_size()


def is_distributed() -> bool:
    """Whether this worker is part of a job (a ``bool``, as in XGBoost).  Never raises."""
    return bool(api.is_distributed())


def get_processor_name() -> str:
    """This host's name (a ``str``).  Needs no :func:`init`; raises no
    :class:`~rabit2.errors.RabitError`."""
    return str(api.get_processor_name())


def communicator_print(msg: Any) -> None:
    """Print ``str(msg)``, stripped, on the tracker's console (locally when alone).  Needs
    no :func:`init`; waits only while earlier lines crowd the tracker connection, and
    raises no :class:`~rabit2.errors.RabitError` (as :func:`rabit2.tracker_print`)."""
    api.tracker_print(str(msg).strip())


def broadcast(data: _T, root: int) -> _T:
    """Send ``data`` from ``root`` to every rank and return it (non-roots may pass None).

    XGBoost pickles every object; rabit2 sends numpy arrays as raw bytes and pickles the rest:
    the result is equal either way.  A non-root's own ``data`` is left as it is.  Before
    :func:`init` (as XGBoost: one worker) ``data`` is returned.  Raises ``ValueError`` if the
    root passes None (XGBoost asserts) or ``root`` is not a rank, and otherwise what
    :func:`rabit2.broadcast` raises (``TypeError`` for an object the root cannot pickle,
    :class:`~rabit2.errors.RabitError` subclasses when ranks disagree or the job fails)."""
    rank = api.get_rank()
    if rank == root and data is None:
        raise ValueError("broadcast: the root must pass the data")
    if not _initialised():
        # (XGBoost without init: one worker, nothing to send; what a job would refuse is
        # refused here too, so that a program tried alone does not first fail in the job)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or root != 0:
            raise ValueError(f"root must be a rank in [0, 1), got {root!r}")
        if not isinstance(data, np.ndarray):
            pickled(data)
        return data
    # (a non-root's own object is left as it is: the root's comes back as a new one)
    result: _T = api.broadcast(data if rank == root else None, root)
    return result


def allreduce(data: np.ndarray, op: Op) -> np.ndarray:
    """Reduce ``data`` across all ranks and return the result as a new 1-D array of the same
    dtype; ``data`` itself is not changed.

    Raises ``TypeError`` for anything but a numpy array, a dtype XGBoost does not reduce, an
    operator that is not an integer (a flag, a string, None) or is a ``rabit2.Op`` (whose
    integers differ); ``ValueError`` for an integer that is not an :class:`Op` value; then
    what :func:`rabit2.allreduce` raises (:class:`~rabit2.errors.MismatchError` when ranks
    disagree, other
    :class:`~rabit2.errors.RabitError` subclasses when the job fails).  Before :func:`init`
    (as XGBoost: one worker) the copy is returned."""
    if not isinstance(data, np.ndarray):
        raise TypeError("allreduce only takes in numpy.ndarray")
    if isinstance(op, (bool, np.bool_)):  # (True == 1, which is MIN here)
        raise TypeError(f"allreduce: a flag is no operator, got {op!r}")
    if isinstance(op, _RabitOp):
        # rabit2.Op.BITOR is 3, which here is BITWISE_AND: refuse rather than guess
        raise TypeError(f"allreduce: pass a rabit2.collective.Op, not {op!r} (the integers "
                        "of rabit2.Op and XGBoost's Op differ)")
    if not isinstance(op, (int, np.integer)):
        raise TypeError(f"allreduce: the operator must be a rabit2.collective.Op, not {op!r}")
    try:
        rabit_op = _TO_RABIT[Op(op)]
    except ValueError:
        raise ValueError(f"allreduce: {op!r} is not an operator of rabit2.collective.Op "
                         f"({', '.join(f'{o.name}={o.value}' for o in Op)})") from None
    buf = data.ravel().copy()
    try:
        if _initialised():  # (in place: a fresh contiguous copy, of its subclass)
            api.allreduce(buf, rabit_op)
        else:  # (without init, as XGBoost: one worker's result, checked as in a job)
            check_op_dtype(rabit_op, buf.dtype)
    except TypeError as exc:  # (raised before anything is sent; said in this module's
        raise TypeError(str(exc).replace(rabit_op.name, Op(op).name)) from None  # names)
    return buf


def _initialised() -> bool:
    """Whether :func:`init` ran (without it XGBoost's collectives act as one worker's)."""
    return api.current_config() is not None


def signal_error(msg: str = "signal_error() called") -> None:
    """Abort the job: every other rank raises :class:`~rabit2.errors.JobAbortedError`
    (XGBoost kills the process instead).  Never raises; a no-op when not distributed."""
    api.signal_error(msg)


class CommunicatorContext(contextlib.AbstractContextManager[dict[str, Any]]):
    """``with CommunicatorContext(**args) as args:`` = ``init(**args)`` ... ``finalize()``;
    an exception inside the block aborts the job, naming it (``rabit2.api.abort_for``), and
    ``sys.exit(0)`` finalizes.  After :func:`init` it takes the job over (and ends it);
    inside another context it neither joins nor leaves: the outer one ends the job.

    This connects the functions of this module only: XGBoost's own training inside it
    would train alone on each worker (a warning says so where ``xgboost`` is imported);
    :class:`rabit2.xgboost.CommunicatorContext`, used instead of it, connects XGBoost.

    Entering raises what :func:`init` raises, leaving normally what :func:`finalize`
    raises; leaving by an exception raises nothing of its own (the exception propagates)."""

    def __init__(self, **args: Any) -> None:
        self.args = args
        self._owner = False

    def __enter__(self) -> dict[str, Any]:
        self._owner = api.enter(lambda: init(**self.args))
        if self._owner and "xgboost" in sys.modules and api.get_world_size() > 1:
            logger.warning(
                "rabit2.collective.CommunicatorContext connects rabit2.collective's "
                "functions, not XGBoost: xgboost.train or XGBModel.fit inside it trains "
                "alone on each worker; use rabit2.xgboost.CommunicatorContext instead of it "
                "(docs/xgboost.md)")
        return self.args

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        api.leave(exc, self._owner)


class RabitContext(contextlib.AbstractContextManager["RabitContext"]):
    """rabit 1.x's context (XGBoost 1.x ``xgboost.rabit.RabitContext``): ``rabit_args`` are
    ``k=v`` strings or bytes (``TypeError`` for one string or a dict).

    Entering raises what :func:`rabit2.init` raises, leaving normally what
    :func:`rabit2.finalize` raises; an exception inside the block aborts the job and
    propagates (``sys.exit(0)`` finalizes); after ``init`` and inside another context as
    :class:`CommunicatorContext`."""

    def __init__(self, rabit_args: Iterable[str | bytes] | None = None) -> None:
        if isinstance(rabit_args, (str, bytes, bytearray, dict)):  # (list() would split it)
            raise TypeError(f"RabitContext takes a list of 'k=v' strings or bytes, got "
                            f"{type(rabit_args).__name__}")
        self.args = list(rabit_args or [])
        self._owner = False

    def __enter__(self) -> RabitContext:
        self._owner = api.enter(lambda: api.init(self.args))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        api.leave(exc, self._owner)


__all__ = [
    "CommunicatorContext",
    "Config",
    "Op",
    "RabitContext",
    "allreduce",
    "broadcast",
    "communicator_print",
    "finalize",
    "get_processor_name",
    "get_rank",
    "get_world_size",
    "init",
    "is_distributed",
    "signal_error",
]
