"""The collectives of the blocking API: :func:`allreduce`, :func:`broadcast`,
:func:`allgather` and :func:`agree` (re-exported by :mod:`rabit2.api` and :mod:`rabit2`).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from rabit2.core.framing import (
    BROADCAST_HEAD,
    GATHER_INFO,
    HEAD_ARRAY,
    HEAD_DEVICE,
    HEAD_PICKLE,
    MAX_NDIM,
    CollectiveKind,
    pack_broadcast_head,
    shape_tag,
    unpack_broadcast_head,
)
from rabit2.core.ops import Op, check_op_dtype, dtype_code, dtype_from_code
from rabit2.core.records import Call
from rabit2.device import copy_into, is_device_array, matches, to_device, to_host
from rabit2.errors import MismatchError
from rabit2.state import collective as _collective
from rabit2.state import run as _run

# ----------------------------------------------------------------------------- allreduce


def _flat_bytes(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, writable where it is (a subclass's too: a masked
    array's ``.data`` is its data array, not its buffer)."""
    if arr.size == 0:  # (a memoryview of more than one dimension with a 0 in its shape
        return memoryview(bytearray())  # cannot be cast)
    return memoryview(arr).cast("B")  # type: ignore[arg-type]  # (numpy arrays are buffers)


_VALID: dict[tuple[type, Any, np.dtype], tuple[Op, np.dtype]] = {}
"""(op's class, op, dtype) pairs that passed ``check_op_dtype``, with its answer."""


def allreduce(data: Any, op: Any, prepare_fun: Callable[[Any], None] | None = None) -> Any:
    """Reduce ``data`` element-wise across all ranks; every rank gets the same bytes.

    ``data``: a numpy array of int8..uint64 or float16/32/64, any shape, or a cupy array
    (the ``gpu`` extra: staged through host memory, reduced in place, even a strided view).
    A C-contiguous writable numpy array is reduced in place; otherwise a contiguous copy is
    reduced and written back when ``data`` is writable.  The result (same shape and dtype,
    never promoted) is returned.
    ``prepare_fun(data)``, if given, is called right before the data is needed, as in rabit.

    Raises ``TypeError`` (not an array, unsupported dtype, bitwise op on floats) or
    ``ValueError`` (unknown op) before anything is sent, then
    :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`; :class:`~rabit2.errors.MismatchError` on every rank when ranks disagree
    on size, dtype or op; other :class:`~rabit2.errors.RabitError` subclasses when the job
    fails (:class:`~rabit2.errors.PeerLostError`, :class:`~rabit2.errors.UnrecoverableError`,
    :class:`~rabit2.errors.CollectiveTimeoutError`, :class:`~rabit2.errors.JobAbortedError`).
    After a :class:`~rabit2.errors.RabitError` every later collective raises the same error.
    """
    # (every call right after a training round's compute runs with cold caches, where each
    # Python call on this path costs microseconds: docs/performance.md, "Per-call cost after
    # compute")
    if not isinstance(data, np.ndarray):
        if is_device_array(data):
            return _allreduce_device(data, op, prepare_fun)
        raise TypeError(f"allreduce takes a numpy array, got {type(data).__name__}")
    key = (op.__class__, op, data.dtype)  # (the class: True == 1 but only 1 is an op)
    try:
        opv, dtype = _VALID[key]
    except KeyError:
        opv, dtype = check_op_dtype(op, data.dtype)
        if len(_VALID) < 256:
            _VALID[key] = opv, dtype
    except TypeError:  # an unhashable op: check_op_dtype says what is wrong with it
        opv, dtype = check_op_dtype(op, data.dtype)
    comm = _collective()
    engine = comm.engine
    if prepare_fun is not None:
        _prepare(prepare_fun, data, engine)
    if engine is None or (data.size == 0 and comm.world == 1):
        return data
    flags = data.flags
    inplace = flags.c_contiguous and flags.writeable
    work = data if inplace else np.array(data, order="C")  # (a copy, 0-d kept 0-d)
    buf = _flat_bytes(work)
    _run(Call(engine.choose_allreduce(len(buf), dtype.itemsize), buf, dtype, opv))
    if not inplace and data.flags.writeable:
        data[...] = work
        return data
    return work


def _prepare(prepare_fun: Callable[[Any], None], data: Any, engine: Any) -> None:
    """rabit's rule: ``prepare_fun(data)`` right before the data is needed, but not where a
    restarted worker replays a finished call (it gets the call's result from a neighbour)."""
    if not (engine is not None and engine.replays_next()):
        prepare_fun(data)


def _allreduce_device(data: Any, op: Any, prepare_fun: Callable[[Any], None] | None) -> Any:
    """:func:`allreduce` of a cupy array, with the numpy path's checks and ``prepare_fun``
    rule: the reduction of a host copy, written back into ``data``."""
    check_op_dtype(op, np.dtype(data.dtype))
    engine = _collective().engine
    if prepare_fun is not None:
        _prepare(prepare_fun, data, engine)
    if engine is None:
        return data
    host = to_host(data)
    allreduce(host, op)
    copy_into(data, host)
    return data


# ----------------------------------------------------------------------------- broadcast


def broadcast(data: Any, root: int) -> Any:
    """Send ``data`` from ``root`` to every rank and return it.

    A numpy array (C-contiguous after conversion, ndim <= 8) travels as raw bytes; anything
    else is pickled.  Non-root ranks may pass ``None``; a non-root that passes a writable
    C-contiguous array of the root's dtype and shape receives straight into it.  A cupy
    array travels as raw bytes too, staged through host memory.  A non-root that passes an
    array of the root's dtype and shape, numpy or cupy, gets it back written in place,
    whichever the root passed; otherwise it gets a new array of the root's kind (a cupy
    array on its current device, or a numpy array where cupy or a GPU is missing).

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`, ``ValueError`` for a root outside ``[0, world)`` and (on the root)
    ``TypeError`` if the object cannot be pickled, before anything is sent;
    :class:`~rabit2.errors.MismatchError` on every rank when ranks disagree on the root;
    other :class:`~rabit2.errors.RabitError` subclasses when the job fails, as
    :func:`allreduce`.
    """
    comm = _collective()
    if isinstance(root, bool):  # (True == 1, but a flag is not a rank)
        raise ValueError(f"root must be a rank, got {root!r}")
    if comm.live is not None:  # (elastic mode: a rank of the live set, at its place there)
        if not isinstance(root, (int, np.integer)) or int(root) not in comm.live:
            raise ValueError(f"root must be a rank of the live set {tuple(comm.live)}, "
                             f"got {root!r}")
        root = comm.live.index(int(root))
    if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < comm.world:
        raise ValueError(f"root must be a rank in [0, {comm.world}), got {root!r}")
    root = int(root)
    if comm.engine is None:
        if not isinstance(data, np.ndarray) and not is_device_array(data):
            pickled(data)  # the same TypeError alone as in a job
        return data
    call, result = broadcast_call(data, root, comm.rank == root)
    _run(call)
    return result()


def broadcast_call(data: Any, root: int, is_root: bool) -> tuple[Call, Callable[[], Any]]:
    """The call :func:`broadcast` makes of ``data`` (``root`` checked already), and what
    gives its result once the call is made.  Raises ``TypeError`` on the root if ``data``
    cannot be pickled."""
    if is_root:
        # (exactly an ndarray: a subclass, a masked array or a matrix, is pickled, so that
        # every rank gets what the root passed)
        device = is_device_array(data)
        if ((device or type(data) is np.ndarray) and data.ndim <= MAX_NDIM
                and _supported(np.dtype(data.dtype))):
            # (ascontiguousarray makes a 0-d array 1-d: the shape sent is the caller's)
            host = to_host(data) if device else np.ascontiguousarray(data).reshape(data.shape)
            payload = _flat_bytes(host)
            desc = pack_broadcast_head(HEAD_DEVICE if device else HEAD_ARRAY,
                                       dtype_code(host.dtype), host.shape, len(payload))
        else:
            payload = memoryview(pickled(data))
            desc = pack_broadcast_head(HEAD_PICKLE, 0, (), len(payload))
        # one call: the head (kind, dtype, shape, size) and the payload as one stream
        return (Call(CollectiveKind.BROADCAST, memoryview(b""), root=root,
                     pieces=(memoryview(desc), payload)), lambda: data)
    received: dict[str, Any] = {}

    def place(head: memoryview) -> memoryview:
        """Called once the head arrived (on the thread that drives the call): where the
        payload goes."""
        kind, code, dims, nbytes = unpack_broadcast_head(head)
        if kind in (HEAD_ARRAY, HEAD_DEVICE):
            dtype = dtype_from_code(code)
            if math.prod(dims) * dtype.itemsize != nbytes:  # (exact: Python ints)
                raise ValueError(f"broadcast head: shape {dims} of {dtype} is not {nbytes} B")
            if (type(data) is np.ndarray and data.dtype == dtype and data.shape == dims
                    and data.flags.c_contiguous and data.flags.writeable):
                out = data  # receive straight into the caller's array (whatever the root's)
            else:
                out = np.empty(dims, dtype=dtype)
            received["array"], received["kind"] = out, kind
            return _flat_bytes(out)
        if kind != HEAD_PICKLE:
            raise ValueError(f"broadcast head of unknown kind {kind}")
        blob = bytearray(nbytes)
        received["pickle"] = blob
        return memoryview(blob)

    def result() -> Any:
        if "array" not in received:
            return pickle.loads(received["pickle"])
        out = received["array"]
        if out is data:
            return data
        if is_device_array(data) and matches(data, out.dtype, out.shape):
            copy_into(data, out)  # (the caller's device array, whatever the root's)
            return data
        return to_device(out) if received["kind"] == HEAD_DEVICE else out

    return (Call(CollectiveKind.BROADCAST, memoryview(b""), root=root, receive=place,
                 head_size=BROADCAST_HEAD.size), result)


def pickled(data: Any) -> bytes:
    try:
        return pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickling raises many unrelated types
        raise TypeError(f"broadcast: cannot pickle {type(data).__name__}: {exc}") from exc


def _supported(dtype: np.dtype) -> bool:
    try:
        dtype_code(dtype)
    except TypeError:
        return False
    return True


# ----------------------------------------------------------------------------- allgather


def allgather(data: Any) -> np.ndarray:
    """Concatenate every rank's array along axis 0, in rank order, on every rank.

    Ranks may contribute different numbers of rows; dtype and trailing shape must agree
    (:class:`~rabit2.errors.MismatchError` on every rank otherwise).  A 0-d array counts as
    one row.  A cupy array is staged through host memory and gives a new cupy array on the
    current device.  Raises ``TypeError`` for a non-array or an unsupported dtype before anything is
    sent, then :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`; other :class:`~rabit2.errors.RabitError` subclasses when the job fails,
    as :func:`allreduce`.
    """
    if not isinstance(data, np.ndarray):
        if is_device_array(data):
            return to_device(allgather(to_host(data)))  # type: ignore[no-any-return]
        raise TypeError(f"allgather takes a numpy array, got {type(data).__name__}")
    code = dtype_code(data.dtype)
    comm = _collective()
    arr = np.ascontiguousarray(data).reshape(data.shape if data.ndim else (1,))
    if comm.engine is None:
        return arr.copy()
    info = np.zeros(comm.world * GATHER_INFO, dtype=np.uint64)
    mine = slice(comm.rank * GATHER_INFO, (comm.rank + 1) * GATHER_INFO)
    info[mine] = (arr.nbytes, code, arr.shape[0], shape_tag(arr.shape[1:]))
    blocks = tuple((r * GATHER_INFO * 8, (r + 1) * GATHER_INFO * 8) for r in range(comm.world))
    _run(Call(CollectiveKind.ALLGATHER, _flat_bytes(info), blocks=blocks))
    table = info.reshape(comm.world, GATHER_INFO)
    if len({(int(c), int(t)) for _, c, _, t in table}) != 1:
        error = _gather_mismatch(table, comm.rank, arr.shape[1:])
        if comm.membership is None:  # (a live set's block fails on its own: docs/elastic.md)
            comm.engine.fail(error)  # sticky, as any failed call: every rank found it alike
        raise error
    sizes = [int(n) for n in table[:, 0]]
    offsets = np.cumsum([0, *sizes])
    rows = int(table[:, 2].sum())
    out = np.empty((rows, *arr.shape[1:]), dtype=arr.dtype)
    flat = _flat_bytes(out)
    flat[offsets[comm.rank] : offsets[comm.rank + 1]] = _flat_bytes(arr)
    gblocks = tuple((int(offsets[r]), int(offsets[r + 1])) for r in range(comm.world))
    _run(Call(CollectiveKind.ALLGATHER, flat, blocks=gblocks))
    return out


def _gather_mismatch(table: np.ndarray, rank: int, trailing: tuple[int, ...]) -> MismatchError:
    """What differs between the ranks' allgather inputs: each rank's dtype, and which ranks
    share a trailing shape (the ranks exchanged only a tag of it: this rank names its own)."""
    tags = list(dict.fromkeys(int(t) for t in table[:, 3]))
    ranks = ", ".join(f"rank {r}: {dtype_from_code(int(c))} trailing shape "
                      f"{'ABCDEFGHIJKLMNOPQRSTUVWXYZ'[tags.index(int(t)) % 26]}"
                      for r, (_, c, _, t) in enumerate(table))
    return MismatchError(f"allgather: ranks passed different dtypes or trailing shapes: "
                         f"{ranks} (rank {rank}'s trailing shape is {trailing})")


def agree(flag: bool) -> bool:
    """True on every rank iff every rank passed a true ``flag`` (a logical AND).

    One MIN :func:`allreduce` of a byte, with its errors (and ``TypeError`` for a flag that
    is not a bool or an integer, before anything is sent):
    :class:`~rabit2.errors.NotInitializedError` before :func:`init`, other
    :class:`~rabit2.errors.RabitError` subclasses when the job fails.  It is not ULFM's
    agreement: a rank lost for good fails it as it fails any collective."""
    check_flag(flag)
    value = np.array([1 if flag else 0], dtype=np.uint8)
    allreduce(value, Op.MIN)
    return bool(value[0])



def check_flag(flag: Any) -> None:
    """``agree``'s ``TypeError`` for a flag that is not a bool or an integer."""
    if not isinstance(flag, (bool, np.bool_, int, np.integer)):
        raise TypeError(f"agree takes a bool, got {type(flag).__name__}")


def check_array(what: str, data: Any) -> None:
    """``what``'s ``TypeError`` for data that is neither a numpy nor a device array."""
    if not isinstance(data, np.ndarray) and not is_device_array(data):
        raise TypeError(f"{what} takes a numpy array, got {type(data).__name__}")


__all__ = ["agree", "allgather", "allreduce", "broadcast", "check_array", "check_flag",
           "pickled"]
