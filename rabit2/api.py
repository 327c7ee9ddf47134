"""The blocking, rabit-compatible API over the engine's loop thread.

One communicator per process (as in rabit): :func:`init` creates it, :func:`finalize` ends
it.  Without a tracker in the configuration the process runs alone (rank 0 of 1) and every
collective is a local no-op, so the same program runs on a laptop and in a job.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from rabit2 import logs
from rabit2.config import Config, launcher_world, load_config
from rabit2.core.framing import (
    BROADCAST_HEAD,
    GATHER_INFO,
    HEAD_ARRAY,
    HEAD_PICKLE,
    MAX_NDIM,
    CollectiveKind,
    pack_broadcast_head,
    shape_tag,
    unpack_broadcast_head,
)
from rabit2.core.ops import Op, check_op_dtype, dtype_code, dtype_from_code
from rabit2.core.records import Call
from rabit2.errors import JobAbortedError, MismatchError, NotInitializedError, RabitError

logger = logging.getLogger("rabit2")



class _Communicator:
    """The process-wide communicator (rabit has exactly one per process)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.config: Config | None = None
        self.engine: Any = None  # rabit2.io.engine.Engine when distributed
        self.rank = 0
        self.world = 1
        self.version = 0
        self.seqno = 0
        self.global_model: bytes | None = None
        self.lazy_model: Any = None
        self.local_model: bytes | None = None
        self.must_load = False  # a restarted worker whose checkpoint is with its neighbours
        # elastic mode (docs/elastic.md): the worker's place in the job, its rank and size
        # there, and the live set whose block it is in (rank and world are then the set's)
        self.membership: Any = None  # rabit2.io.membership.Membership
        self.job_rank = 0
        self.job_world = 1
        self.live: Any = None  # rabit2.live.LiveSet


_comm = _Communicator()


def _require() -> _Communicator:
    if _comm.config is None:
        raise NotInitializedError("call rabit2.init() first")
    return _comm


def _collective() -> _Communicator:
    """:func:`_require`, for a collective: in elastic mode only inside a live set."""
    comm = _require()
    if comm.membership is not None and comm.live is None:
        raise RuntimeError("in elastic mode collectives run inside `with rabit2.live_set():` "
                           "(docs/elastic.md)")
    return comm


# ----------------------------------------------------------------------------- lifecycle


def init(args: Iterable[str | bytes] | None = None, **kwargs: Any) -> None:
    """Join the job (or start single-process mode when no tracker is configured).

    ``args`` are rabit-style ``"k=v"`` strings (e.g. ``sys.argv``; other strings are
    ignored); ``kwargs`` are xgboost.collective-style keyword parameters.  Environment
    variables set by ``rabit2-submit`` are read first.  A second call while initialised is
    ignored with a warning, as in rabit.

    Raises ``ValueError`` for unknown or malformed parameters, before anything is
    contacted, and a :class:`~rabit2.errors.RabitError` if the job cannot be joined:
    :class:`~rabit2.errors.TrackerError` when the tracker cannot be reached after every
    attempt or refuses this worker, :class:`~rabit2.errors.CollectiveTimeoutError` when no
    rank is assigned or the neighbours do not connect in time,
    :class:`~rabit2.errors.JobAbortedError` when the job is aborted meanwhile, and
    :class:`~rabit2.errors.PeerLostError` or :class:`~rabit2.errors.ProtocolError` when a
    link to a neighbour cannot be set up.  After an error the process is not initialised.
    """
    with _comm.lock:
        if _comm.config is not None:
            logger.warning("rabit2.init() called twice; ignoring the second call")
            return
        try:
            config = load_config(args, kwargs)
        except ValueError as exc:
            _give_up_on_bad_parameters(exc)
            raise
        logs.configure(config.log_level)
        _comm.version = _comm.seqno = 0
        _comm.global_model = _comm.local_model = _comm.lazy_model = None
        if config.distributed and config.elastic:
            from rabit2.io.membership import Membership  # noqa: PLC0415

            member = Membership(config)
            member.start()
            assert member.assignment is not None
            _comm.engine, _comm.membership, _comm.live = None, member, None
            _comm.rank = _comm.job_rank = member.assignment.rank
            _comm.world = _comm.job_world = member.assignment.world_size
        elif config.distributed:
            from rabit2.io.engine import Engine  # noqa: PLC0415 - keeps single mode light

            engine = Engine(config)
            engine.start()
            assert engine.assignment is not None
            _comm.engine = engine
            _comm.rank = engine.assignment.rank
            _comm.world = engine.assignment.world_size
            _comm.must_load = engine.restarted
        else:
            _comm.engine = None
            _comm.rank, _comm.world = 0, 1
            world = launcher_world(os.environ)
            if world is not None and world[1] > 1:
                logger.warning(
                    "no tracker is configured, so this process runs alone (rank 0 of 1), but "
                    "%s=%d says its launcher started %d: start the job with rabit2-submit "
                    "(--cluster slurm or mpi) or give the workers a tracker's variables "
                    "(docs/user-guide.md, \"Other launchers\")", *world, world[1])
        _comm.config = config
        if config.distributed:
            _install_excepthook()


def _give_up_on_bad_parameters(error: ValueError) -> None:
    """A worker of a job whose parameters ``init`` refuses: a restart would be refused the
    same way, so tell the tracker (named by the launcher's variables) to give this task up
    and end the job, instead of each attempt failing in turn.  Best effort, bounded (5 s);
    nothing when no tracker is configured."""
    try:
        job = load_config(environ=os.environ)  # the launcher's variables alone
    except ValueError:
        return  # (the bad value is the launcher's own: nothing to reach)
    if not job.distributed or job.tracker_uri is None or job.task_id == "NULL":
        return
    import asyncio  # noqa: PLC0415 (only on this path)

    from rabit2.io.tracker_client import query_tracker_status  # noqa: PLC0415

    reason = f"rabit2.init refused its parameters, which no restart can fix: {error}"

    def tell() -> None:
        assert job.tracker_uri is not None
        with contextlib.suppress(RabitError, OSError):
            asyncio.run(query_tracker_status(job.tracker_uri, job.tracker_port, job.secret,
                                             5.0, give_up=(job.task_id, reason),
                                             task_id=job.task_id))

    # (on a thread of its own: this one may run an event loop already, as in a notebook)
    teller = threading.Thread(target=tell, name="rabit2-give-up", daemon=True)
    teller.start()
    teller.join(10.0)


def abort_for(error: BaseException) -> None:
    """A program error on this rank ends the job: tell the tracker (every other rank raises
    :class:`~rabit2.errors.JobAbortedError` naming this rank and ``error`` at once, instead
    of waiting for it) and leave; the launcher does not restart a worker that left so.  A
    :class:`~rabit2.errors.JobAbortedError` is the job's already: this only leaves (a
    RabitError that every rank saw is said again, which the tracker ignores after the first).
    In elastic mode the worker only leaves, as if lost: the job goes on without it (or gets
    it back when the launcher restarts it).  Safe to call when not initialised; never raises
    a RabitError."""
    member = _comm.membership
    if member is not None:
        # elastic mode: a program error makes this worker lost (restarted, or the job goes
        # on without it), not the job's end
        with _comm.lock:
            _comm.engine = _comm.membership = _comm.config = _comm.live = None
        member.close()
        return
    # (before the lock: a collective still running in another thread, e.g. one whose
    # asyncio await was cancelled, holds it; signal_error never blocks)
    job = _job()
    if job is not None and not isinstance(error, JobAbortedError):
        text = " ".join(str(error).split())
        job.signal_error(
            f"rank {get_rank()} raised {type(error).__name__}" + (f": {text}" if text else ""))
    with _comm.lock, contextlib.suppress(RabitError):
        finalize()


def leave(error: BaseException | None) -> None:
    """How a context ends: :func:`finalize`, or :func:`abort_for` the exception that ended
    it."""
    if error is None:
        finalize()
    else:
        abort_for(error)


_previous_excepthook: list[Callable[..., Any]] = []


def _install_excepthook() -> None:
    """An uncaught exception in a distributed program aborts the job before Python prints
    it (the previous hook runs after)."""
    if _previous_excepthook:
        return
    _previous_excepthook.append(sys.excepthook)

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if _comm.config is not None and not isinstance(value, KeyboardInterrupt):
            with contextlib.suppress(Exception):
                abort_for(value)
        _previous_excepthook[0](kind, value, tb)

    sys.excepthook = hook


def finalize() -> None:
    """Leave the job: tell the tracker, close every link.  Safe to call when not initialised.

    With recovery on this first waits (up to ``timeout_sec``), still serving the neighbours,
    until every rank has finalized, so that a worker restarted after its last collective
    can replay; raises :class:`~rabit2.errors.JobAbortedError` if the job is aborted then.
    Other failures while leaving (the tracker gone, no answer in time) are logged, not
    raised.  The process is not initialised afterwards, whether this returned or raised."""
    if _comm.live is not None:
        raise RuntimeError("finalize() inside a live set's block: leave the block first")
    with _comm.lock:
        engine, _comm.engine, _comm.config = _comm.engine, None, None
        member, _comm.membership, _comm.live = _comm.membership, None, None
        if member is not None:
            member.finalize()  # (the live set's engine included)
        elif engine is not None:
            engine.finalize()


def current_config() -> Config | None:
    """The configuration this process joined with (None when not initialised)."""
    return _comm.config


def get_rank() -> int:
    """This process's rank (0 when not initialised, as in rabit; in elastic mode its rank
    in the job, inside a live set too).  Never raises."""
    if _comm.config is None:
        return 0
    return _comm.job_rank if _comm.membership is not None else _comm.rank


def get_world_size() -> int:
    """The number of workers (1 when not initialised, as in rabit; in elastic mode the
    job's size: ``len(live)`` is a live set's).  Never raises."""
    if _comm.config is None:
        return 1
    return _comm.job_world if _comm.membership is not None else _comm.world


def is_distributed() -> bool:
    """Whether this process is a worker of a job: True from an :func:`init` that joined a
    tracker until :func:`finalize`; False when not initialised and in single-process mode
    (no tracker configured), where every collective is a local no-op.  Never raises."""
    return _comm.engine is not None or _comm.membership is not None


def _job() -> Any:
    """What talks to the tracker for this process: the elastic membership, the engine, or
    None when not distributed."""
    return _comm.membership if _comm.membership is not None else _comm.engine


def get_processor_name() -> str:
    """This host's name (``socket.gethostname()``), as rabit's ``GetProcessorName``.  Needs
    no :func:`init` and raises no :class:`~rabit2.errors.RabitError`."""
    return socket.gethostname()


def tracker_print(msg: Any) -> None:
    """Print ``str(msg)`` on the tracker's console (locally when not distributed).

    Needs no :func:`init`.  In a job it never blocks: the line is queued for the tracker,
    which prints one worker's lines in the order they were sent; once the tracker connection
    is gone lines are dropped rather than raised."""
    text = str(msg)
    job = _job()
    if job is None:
        print(text, flush=True)
    else:
        job.tracker_print(text)


def signal_error(msg: str = "signal_error() called") -> None:
    """Ask the tracker to abort the job, with ``msg`` as the reason: every other worker's
    current or next collective raises :class:`~rabit2.errors.JobAbortedError`.

    This worker is not told (it should leave: :func:`finalize`, or exit).  Never blocks and
    never raises; a no-op when not distributed."""
    job = _job()
    if job is not None:
        job.signal_error(msg)


# ----------------------------------------------------------------------------- fault hooks


def _mock_hit(kind: str) -> tuple[int, int, bool]:
    """rabit's mock engine: ``mock=rank,version,seqno,trial`` kills us at that call.

    With a fifth field (``after_bytes``) the kill happens inside the call, once that many
    payload bytes of it have arrived; the byte count is returned for the engine (-1: none),
    with the rank whose link to reset instead of dying (-1: die), and whether to damage a
    byte from that rank instead of resetting.
    """
    cfg = _comm.config
    if cfg is None or not cfg.mock:
        return -1, -1, False
    key = (_comm.rank, _comm.version, _comm.seqno, cfg.num_attempt)
    for spec in cfg.mock:
        if (spec.rank, spec.version, spec.seqno, spec.trial) != key:
            continue
        if spec.after_bytes >= 0 and kind != "checkpoint":
            return spec.after_bytes, spec.reset_peer, bool(spec.damage)
        logger.error("[%d]@@@Hit Mock Error:%s at %s", _comm.rank, kind, key)
        os.kill(os.getpid(), signal.SIGKILL)
    return -1, -1, False


def _run(call: Call) -> None:
    comm = _require()
    engine = comm.engine
    if engine is None:
        return
    # one collective at a time per process: calls from several threads queue here (their
    # order must still be the same on every rank, or the ranks get a MismatchError)
    with comm.lock:
        if comm.config is not None and comm.config.mock:
            engine.run_call(call, *_mock_hit(call.kind.name.lower()))
        else:
            engine.run_call(call)
        comm.seqno += 1


# ----------------------------------------------------------------------------- allreduce


def _flat_bytes(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, writable where it is."""
    return arr.data.cast("B")


_VALID: dict[tuple[type, Any, np.dtype], tuple[Op, np.dtype]] = {}
"""(op's class, op, dtype) pairs that passed ``check_op_dtype``, with its answer."""


def allreduce(data: Any, op: Any, prepare_fun: Callable[[Any], None] | None = None) -> Any:
    """Reduce ``data`` element-wise across all ranks; every rank gets the same bytes.

    ``data``: a numpy array of int8..uint64 or float16/32/64, any shape (or a cupy array
    with the ``gpu`` extra: it is staged through host memory).  A C-contiguous writable
    array is reduced in place; otherwise a contiguous copy is reduced and written back when
    ``data`` is writable.  The result (same shape and dtype, never promoted) is returned.
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
        if _is_cupy(data):
            return _allreduce_cupy(data, op, prepare_fun)
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
    if prepare_fun is not None and not (engine is not None and engine.replays_next()):
        prepare_fun(data)  # (a restarted worker replaying a finished call gets its result)
    if engine is None or (data.size == 0 and comm.world == 1):
        return data
    flags = data.flags
    inplace = flags.c_contiguous and flags.writeable
    work = data if inplace else np.ascontiguousarray(data).copy()
    buf = _flat_bytes(work)
    _run(Call(engine.choose_allreduce(len(buf), dtype.itemsize), buf, dtype, opv))
    if not inplace and data.flags.writeable:
        data[...] = work
        return data
    return work


def _is_cupy(data: Any) -> bool:
    return hasattr(data, "__cuda_array_interface__") and type(data).__module__.startswith("cupy")


def _allreduce_cupy(data: Any, op: Any, prepare_fun: Callable[[Any], None] | None) -> Any:
    import cupy  # noqa: PLC0415 - optional dependency (rabit2[gpu])

    if prepare_fun is not None:
        prepare_fun(data)
    host = cupy.asnumpy(data)
    allreduce(host, op)
    data[...] = cupy.asarray(host)
    return data


# ----------------------------------------------------------------------------- broadcast


def broadcast(data: Any, root: int) -> Any:
    """Send ``data`` from ``root`` to every rank and return it.

    A numpy array (C-contiguous after conversion, ndim <= 8) travels as raw bytes; anything
    else is pickled.  Non-root ranks may pass ``None``; a non-root that passes a writable
    C-contiguous array of the root's dtype and shape receives straight into it.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`, ``ValueError`` for a root outside ``[0, world)`` and (on the root)
    ``TypeError`` if the object cannot be pickled, before anything is sent;
    :class:`~rabit2.errors.MismatchError` on every rank when ranks disagree on the root;
    other :class:`~rabit2.errors.RabitError` subclasses when the job fails, as
    :func:`allreduce`.
    """
    comm = _collective()
    if comm.live is not None:  # (elastic mode: a rank of the live set, at its place there)
        if not isinstance(root, (int, np.integer)) or int(root) not in comm.live:
            raise ValueError(f"root must be a rank of the live set {tuple(comm.live)}, "
                             f"got {root!r}")
        root = comm.live.index(int(root))
    if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < comm.world:
        raise ValueError(f"root must be a rank in [0, {comm.world}), got {root!r}")
    root = int(root)
    if comm.engine is None:
        if not isinstance(data, np.ndarray):
            _pickle(data)  # the same TypeError alone as in a job
        return data
    if comm.rank == root:
        if isinstance(data, np.ndarray) and data.ndim <= MAX_NDIM and _supported(data.dtype):
            payload = _flat_bytes(np.ascontiguousarray(data))
            desc = pack_broadcast_head(HEAD_ARRAY, dtype_code(data.dtype), data.shape,
                                       len(payload))
        else:
            payload = memoryview(_pickle(data))
            desc = pack_broadcast_head(HEAD_PICKLE, 0, (), len(payload))
        # one call: the head (kind, dtype, shape, size) and the payload as one stream
        _run(Call(CollectiveKind.BROADCAST, memoryview(b""), root=root,
                  pieces=(memoryview(desc), payload)))
        return data
    received: dict[str, Any] = {}

    def place(head: memoryview) -> memoryview:
        """Called on the loop thread once the head arrived: where the payload goes."""
        kind, code, dims, nbytes = unpack_broadcast_head(head)
        if kind == HEAD_ARRAY:
            dtype = dtype_from_code(code)
            if math.prod(dims) * dtype.itemsize != nbytes:  # (exact: Python ints)
                raise ValueError(f"broadcast head: shape {dims} of {dtype} is not {nbytes} B")
            if (isinstance(data, np.ndarray) and data.dtype == dtype and data.shape == dims
                    and data.flags.c_contiguous and data.flags.writeable):
                out = data  # receive straight into the caller's array
            else:
                out = np.empty(dims, dtype=dtype)
            received["array"] = out
            return _flat_bytes(out)
        if kind != HEAD_PICKLE:
            raise ValueError(f"broadcast head of unknown kind {kind}")
        blob = bytearray(nbytes)
        received["pickle"] = blob
        return memoryview(blob)

    _run(Call(CollectiveKind.BROADCAST, memoryview(b""), root=root, receive=place,
              head_size=BROADCAST_HEAD.size))
    if "array" in received:
        return received["array"]
    return pickle.loads(received["pickle"])


def _pickle(data: Any) -> bytes:
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
    one row.  Raises ``TypeError`` for a non-array or an unsupported dtype before anything is
    sent, then :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`; other :class:`~rabit2.errors.RabitError` subclasses when the job fails,
    as :func:`allreduce`.
    """
    if not isinstance(data, np.ndarray):
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
        raise MismatchError(
            "allgather: ranks passed different dtypes or trailing shapes: "
            + ", ".join(f"rank {r}: dtype#{int(c)}" for r, (_, c, _, _) in enumerate(table))
        )
    sizes = [int(n) for n in table[:, 0]]
    offsets = np.cumsum([0, *sizes])
    rows = int(table[:, 2].sum())
    out = np.empty((rows, *arr.shape[1:]), dtype=arr.dtype)
    flat = _flat_bytes(out)
    flat[offsets[comm.rank] : offsets[comm.rank + 1]] = _flat_bytes(arr)
    gblocks = tuple((int(offsets[r]), int(offsets[r + 1])) for r in range(comm.world))
    _run(Call(CollectiveKind.ALLGATHER, flat, blocks=gblocks))
    return out


def agree(flag: bool) -> bool:
    """True on every rank iff every rank passed a true ``flag`` (a logical AND).

    One MIN :func:`allreduce` of a byte, with its errors:
    :class:`~rabit2.errors.NotInitializedError` before :func:`init`, other
    :class:`~rabit2.errors.RabitError` subclasses when the job fails.  It is not ULFM's
    agreement: a rank lost for good fails it as it fails any collective."""
    value = np.array([1 if flag else 0], dtype=np.uint8)
    allreduce(value, Op.MIN)
    return bool(value[0])


# ----------------------------------------------------------------------------- checkpoints


def checkpoint(global_model: Any, local_model: Any = None) -> None:
    """Record the model state after an iteration; the version number goes up by one.

    Models are pickled and kept in memory (nothing touches disk).  Collective calls after
    this point are numbered from zero again (their identity is (version, seqno)).  With
    recovery on, ``local_model`` is handed to the next ranks of the ring (not waited for).
    Nothing is exchanged with the other ranks, so no peer's failure is raised here.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`, and what ``pickle`` raises (``TypeError``, ``pickle.PicklingError``,
    ...) for a model that cannot be pickled, before the version goes up.
    """
    comm = _require()
    comm.global_model = pickle.dumps(global_model, protocol=pickle.HIGHEST_PROTOCOL)
    comm.lazy_model = None
    comm.local_model = (
        None if local_model is None else pickle.dumps(local_model, pickle.HIGHEST_PROTOCOL)
    )
    _advance_version(comm, comm.global_model, comm.local_model)


def lazy_checkpoint(global_model: Any, local_model: Any = None) -> None:
    """Like :func:`checkpoint` without pickling the global model now: it must not change
    until the next checkpoint (it is serialised only if a restarted peer needs it).  A
    ``local_model`` (beyond rabit, whose lazy checkpoint has none) is pickled now and
    replicated as with :func:`checkpoint`.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`, and what ``pickle`` raises for a ``local_model`` that cannot be
    pickled, before the version goes up."""
    comm = _require()
    comm.lazy_model = global_model
    comm.global_model = None
    comm.local_model = (
        None if local_model is None else pickle.dumps(local_model, pickle.HIGHEST_PROTOCOL)
    )
    # pickled on the loop thread only if a restarted neighbour asks for it
    _advance_version(comm, lambda: pickle.dumps(global_model, pickle.HIGHEST_PROTOCOL),
                     comm.local_model)


def _advance_version(comm: _Communicator, blob: bytes | Callable[[], bytes],
                     local: bytes | None = None) -> None:
    _mock_hit("checkpoint")
    comm.must_load = False  # a program that checkpoints before loading starts afresh
    if comm.engine is not None:
        comm.version = comm.engine.checkpoint(blob, local)
    else:
        comm.version += 1
    comm.seqno = 0


def load_checkpoint(with_local: bool = False) -> tuple[Any, ...]:
    """Return ``(version, global_model)`` (or with ``local_model`` too); ``(0, None)`` on a
    fresh start.

    In a worker that ``rabit2-submit`` restarted after a failure (recovery on), the first
    call fetches the checkpoint from a live neighbour (and, with ``with_local``, its local
    model from the next rank of the ring, which holds a replica): the program then replays
    from that version, and the results of calls the others already finished come from
    them.  Elsewhere it communicates nothing.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`.  The fetch of a restarted worker raises
    :class:`~rabit2.errors.UnrecoverableError` if no live neighbour holds what is needed,
    :class:`~rabit2.errors.CollectiveTimeoutError` if nothing arrives within
    ``timeout_sec``, and :class:`~rabit2.errors.JobAbortedError` if the job was aborted.
    """
    comm = _require()
    if comm.must_load:
        comm.must_load = False
        version, blob, local = comm.engine.load_checkpoint(with_local)
        comm.version, comm.seqno = version, 0
        comm.global_model, comm.lazy_model, comm.local_model = blob, None, local
    if comm.version == 0:
        return (0, None, None) if with_local else (0, None)
    if comm.lazy_model is not None:
        model = comm.lazy_model
    else:
        model = None if comm.global_model is None else pickle.loads(comm.global_model)
    if with_local:
        local = None if comm.local_model is None else pickle.loads(comm.local_model)
        return comm.version, model, local
    return comm.version, model


def version_number() -> int:
    """How many checkpoints this job has taken (the version :func:`load_checkpoint`
    returns; 0 when not initialised).  Never raises."""
    return _comm.version if _comm.config is not None else 0


def recovery_statistics() -> dict[str, int]:
    """Counters of this worker's part in recoveries so far (``docs/recovery.md``):
    ``links_up`` (links re-established after a loss or a reset), ``fetched_bytes`` (results,
    checkpoints and local models copied from neighbours), ``resent_bytes`` (bytes sent again
    because a replacement asked for them), ``replayed_calls`` and ``resumed_calls`` (calls a
    restarted worker fetched, or resumed at byte offsets), ``corrupt_frames`` (frames from a
    neighbour that failed their checksum, each followed by a reset of that link: see
    ``docs/protocol.md``, "Checksums").  All 0 in single-process mode; with recovery off only
    ``corrupt_frames`` can count.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`."""
    comm = _require()
    if comm.engine is None:
        return dict.fromkeys(("links_up", "fetched_bytes", "resent_bytes", "replayed_calls",
                              "resumed_calls", "corrupt_frames"), 0)
    stats: dict[str, int] = comm.engine.recovery_statistics()
    return stats


# ----------------------------------------------------------------------------- xgboost names


def communicator_print(msg: Any) -> None:
    """xgboost.collective spelling of :func:`tracker_print` (its behaviour and errors)."""
    tracker_print(msg)


class CommunicatorContext(contextlib.AbstractContextManager["CommunicatorContext"]):
    """``with CommunicatorContext(**args):`` = ``init(**args)`` ... ``finalize()``; an
    exception inside the block aborts the job (:func:`abort_for`) and propagates.

    Entering raises what :func:`init` raises.  Leaving normally raises what :func:`finalize`
    raises; leaving by an exception raises no error of its own (the job is aborted, naming
    the exception, and the exception propagates)."""

    def __init__(self, **args: Any) -> None:
        self.args = args

    def __enter__(self) -> CommunicatorContext:
        init(**self.args)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        leave(exc)  # after an exception the others must not wait for this rank


__all__ = [
    "CommunicatorContext",
    "Op",
    "agree",
    "allgather",
    "allreduce",
    "broadcast",
    "checkpoint",
    "communicator_print",
    "finalize",
    "get_processor_name",
    "get_rank",
    "get_world_size",
    "init",
    "is_distributed",
    "lazy_checkpoint",
    "load_checkpoint",
    "recovery_statistics",
    "signal_error",
    "tracker_print",
    "version_number",
]

