"""The federated endpoint: XGBoost's collectives, executed by rabit2's.

Each worker serves XGBoost's ``Federated`` gRPC service (``federated.proto``) on loopback, for
its own XGBoost only; every request becomes one rabit2 collective across the job.  Requests
are checked before anything is sent (the caller's rank, the sequence number, the data type and
operation, the size) and a bad one fails the call with a message that XGBoost raises as
``XGBoostError``; the job is then aborted so that every other rank fails too, at once.

For recovery (``docs/xgboost.md``) the endpoint also keeps the *prelude*: the results of the
calls made before training starts (the DMatrix's and the quantile sketch's).  They are global,
the same on every rank, so they travel in the checkpoint; a worker restarted after a
checkpoint gets its prelude calls answered from them, without the network, while the others
are already boosting.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np

import rabit2
from rabit2.errors import MismatchError, RabitError
from rabit2.xgboost import wire
from rabit2.xgboost._proto import DATA_TYPES, METHODS, REDUCE_OPS, SERVICE

logger = logging.getLogger("rabit2.xgboost")

# XGBoost's DataType -> numpy (LONG_DOUBLE, float128 in XGBoost, has no portable numpy twin)
_DTYPES: dict[int, np.dtype] = {
    DATA_TYPES.index(name): np.dtype(kind) for name, kind in (
        ("HALF", "<f2"), ("FLOAT", "<f4"), ("DOUBLE", "<f8"), ("INT8", "i1"),
        ("INT16", "<i2"), ("INT32", "<i4"), ("INT64", "<i8"), ("UINT8", "u1"),
        ("UINT16", "<u2"), ("UINT32", "<u4"), ("UINT64", "<u8"))
}
_OPS: dict[int, rabit2.Op] = {
    REDUCE_OPS.index("MAX"): rabit2.Op.MAX, REDUCE_OPS.index("MIN"): rabit2.Op.MIN,
    REDUCE_OPS.index("SUM"): rabit2.Op.SUM, REDUCE_OPS.index("BITWISE_AND"): rabit2.Op.BITAND,
    REDUCE_OPS.index("BITWISE_OR"): rabit2.Op.BITOR,
    REDUCE_OPS.index("BITWISE_XOR"): rabit2.Op.BITXOR,
}
SEQUENCE_WAIT_SEC = 5.0
"""How long a request that arrived ahead of its turn waits for the ones before it."""
PRELUDE_ENTRY = 512
"""What each call of the prelude log counts against its bound besides its result: its
record, its digest and their Python objects (as the replay store counts a kept result)."""


class EndpointError(Exception):
    """A request the endpoint refuses; ``code`` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 error: RabitError | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.error = error  # the typed rabit2 error behind it, raised again by rx.train


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One collective as the prelude log keeps it: what was asked, and the global result."""

    method: str
    dtype: int = -1  # Allreduce only
    op: int = -1  # Allreduce only
    root: int = -1  # Broadcast only
    size: int = -1  # bytes this rank sent where every rank sends the same (-1: not checked)
    result: bytes = b""

    def describe(self) -> str:
        if self.method == "Allreduce":
            return (f"Allreduce({DATA_TYPES[self.dtype]}, {REDUCE_OPS[self.op]}, "
                    f"{self.size} B)")
        if self.method == "Broadcast":
            return f"Broadcast(root {self.root}, {len(self.result)} B)"
        return f"{self.method}({len(self.result)} B in all)"


class Endpoint:
    """The ``Federated`` service of one worker.  Thread-safe; requests run one at a time in
    sequence-number order."""

    def __init__(self, rank: int, world: int, prelude_limit: int | None = None) -> None:
        """``prelude_limit``: the bytes of results (and ``PRELUDE_ENTRY`` each) the prelude
        log may keep, for ``rx.train``'s checkpoints (``rabit2_replay_mb``); None: keep no
        prelude (recovery off)."""
        self.rank, self.world = rank, world
        self._cond = threading.Condition()
        self._next_seq = 0
        self._busy = False
        self.failure: EndpointError | None = None
        self.calls = 0
        self._bytes = 0
        self._collective_s = 0.0  # inside rabit2's collectives
        self._handler_s = 0.0  # inside the gRPC handler, checks and copies included
        # prelude: recorded as it runs (fresh start), or replayed from a checkpoint
        self._recording: list[Record] | None = [] if prelude_limit is not None else None
        self._digests: list[bytes] = []  # of what this rank sent in each prelude call
        self._prelude_room = prelude_limit or 0  # what the prelude log may still take
        self._prelude_held = False  # kept whole from rx.train's agreement on (hold_prelude)
        # the prelude log outgrew its bound (XGBoost training outside rx.train, or a very
        # large sketch) and was dropped: rx.train takes no checkpoints in this context
        self.prelude_outgrown = False
        self._replay: collections.deque[Record] | None = None
        self._replay_digests: collections.deque[bytes] = collections.deque()
        self._replayed = 0
        # the broadcasts of training's first round, which a booster makes once (e.g. its
        # column sampler's seed) and a restarted worker's loaded booster makes again
        self._first_round: list[Record] | None = None
        self._prologue: list[tuple[int, int]] | None = None  # (root, size) still expected
        self._prologue_answers: list[Record] = []
        self._captured: list[Record] | None = None
        self._allowed_peers: set[str] = set()
        self.server: grpc.Server | None = None
        self.port = 0

    # ------------------------------------------------------------------ phases

    def replay_prelude(self, records: tuple[Record, ...], digests: tuple[bytes, ...]) -> None:
        """A restarted worker: answer the prelude's calls from ``records`` (the global
        results), each once this rank's input is found to be what it was: ``digests``."""
        with self._cond:
            self._recording = None
            self._replay = collections.deque(records)
            self._replay_digests = collections.deque(digests)

    def end_prelude(self) -> tuple[tuple[Record, ...], tuple[bytes, ...]] | None:
        """Training starts: the prelude is complete.  Returns it (for the checkpoints: the
        results, and the digests of this rank's inputs) on a fresh start, None where none
        was kept (recovery off, or it outgrew its bound); on a restart checks that every
        recorded call was made again."""
        with self._cond:
            if self._replay is not None:
                if self._replay:
                    raise MismatchError(
                        f"the restarted worker made {self._replayed} calls before training "
                        f"where the original run made {self._replayed + len(self._replay)} "
                        f"(the next one was {self._replay[0].describe()}): the program must "
                        "make the same calls before training on a restart")
                self._replay = None
                return (), ()
            if self._recording is None:
                return None
            records = tuple(self._recording)
            self._recording = None
            self._first_round = []
            return records, tuple(self._digests)

    def first_round_broadcasts(self) -> tuple[Record, ...]:
        """The broadcasts of training's first round, recorded since :meth:`end_prelude`;
        stops recording."""
        with self._cond:
            records = tuple(self._first_round or ())
            self._first_round = None
            return records

    def expect_prologue(self, extras: tuple[tuple[int, int], ...],
                        records: tuple[Record, ...]) -> None:
        """A restarted worker's first round: the broadcasts a loaded booster makes once
        (``extras``, as (root, size) in order, learned in the prelude) are answered from the
        first round's ``records`` of the same root and size (the last such)."""
        with self._cond:
            self._prologue = list(extras)
            self._prologue_answers = list(records)

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[Record]]:
        """Collect the calls made inside the block (results included)."""
        calls: list[Record] = []
        with self._cond:
            self._captured = calls
        try:
            yield calls
        finally:
            with self._cond:
                self._captured = None

    # ------------------------------------------------------------------ requests

    def handle(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            self._admit(context)
            seq = int(request.sequence_number)
            self._take_turn(request, seq)
            try:
                result = self._execute(method, request, request.send_buffer)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            self._handler_s += time.perf_counter() - started
            return result  # (serialized by wire.reply)
        except EndpointError as exc:
            context.abort(exc.code, str(exc))
            raise  # (abort raises; this keeps type checkers content)

    def _admit(self, context: grpc.ServicerContext) -> None:
        peer = context.peer()
        if peer in self._allowed_peers:
            return
        if not _is_own_connection(peer, self.port):
            logger.warning("federated endpoint: refused a call from %s, which is not this "
                           "worker's XGBoost", peer)
            raise EndpointError(grpc.StatusCode.PERMISSION_DENIED,
                                "rabit2: this endpoint serves its own worker's XGBoost only")
        self._allowed_peers.add(peer)

    def _take_turn(self, request: Any, seq: int) -> None:
        """Wait (bounded) until ``seq`` is the next sequence number and no call runs."""
        if request.rank != self.rank:
            self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"request from rank {request.rank} reached rank {self.rank}'s endpoint "
                       "(federated_rank must be rabit2.get_rank())")
        with self._cond:
            if self.failure is not None:
                raise EndpointError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"rabit2: an earlier call failed: {self.failure}",
                                    self.failure.error)
            ready = self._cond.wait_for(lambda: seq <= self._next_seq and not self._busy,
                                        SEQUENCE_WAIT_SEC)
            if ready and seq == self._next_seq:
                self._next_seq += 1
                self._busy = True
                return
            expected = self._next_seq
        self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                   f"sequence number {seq} out of order (expected {expected})")

    def _fail(self, code: grpc.StatusCode, message: str,
              error: RabitError | None = None, job_wide: bool = False) -> None:
        """Refuse this call and every later one.  What only this rank saw (a bad request, a
        restarted worker's diverging prelude) also aborts the job, so that the other ranks
        fail now rather than at a deadline; a ``job_wide`` rabit2 error is theirs already."""
        failure = EndpointError(code, f"rabit2: {message}", error)
        with self._cond:
            if self.failure is None:
                self.failure = failure
        if not job_wide and rabit2.is_distributed():
            rabit2.signal_error(f"rank {self.rank}: {message}")
        raise failure

    def _execute(self, method: str, request: Any, payload: memoryview) -> bytes:
        """Run one call; ``payload``: its ``send_buffer`` (a view of the request's bytes:
        ``wire``)."""
        record = self._describe(method, request, len(payload))
        self.calls += 1
        replayed = self._from_log(record, payload)
        if replayed is not None:
            logger.debug("call %d: %s answered from the checkpoint", self.calls,
                         record.describe())
            self._capture(dataclasses.replace(record, result=replayed))
            return replayed
        logger.debug("call %d: %s", self.calls, record.describe())
        started = time.perf_counter()
        try:
            result = _RUN[method](self, payload, record)
        except RabitError as exc:
            self._fail(grpc.StatusCode.ABORTED, f"{type(exc).__name__}: {exc}", exc,
                       job_wide=True)
        except (TypeError, ValueError) as exc:
            self._fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._collective_s += time.perf_counter() - started
        self._bytes += len(payload)
        done = dataclasses.replace(record, result=result)
        self._capture(done)
        with self._cond:
            if self._recording is not None:
                self._keep_in_prelude(done, payload)
            elif self._first_round is not None and method == "Broadcast":
                self._first_round.append(done)
        return result

    def _keep_in_prelude(self, record: Record, payload: memoryview) -> None:
        """Log a call of the prelude, within its bound; past it drop the log for good."""
        assert self._recording is not None
        cost = len(record.result) + PRELUDE_ENTRY
        if cost > self._prelude_room and not self._prelude_held:
            self._recording, self._digests = None, []
            self.prelude_outgrown = True
            logger.warning(
                "rank %d: the results of XGBoost's calls before rabit2.xgboost.train, kept "
                "for its checkpoints, outgrew rabit2_replay_mb at call %d: none are kept any "
                "more, and rabit2.xgboost.train in this context takes no checkpoints "
                "(xgboost.train and the scikit-learn estimators take none anyway)",
                self.rank, self.calls)
            return
        self._prelude_room -= cost
        self._recording.append(record)
        self._digests.append(_digest(payload))

    def hold_prelude(self) -> bool:
        """Whether the prelude log is still kept; if so it is kept whole from now on, bound
        or not (the calls left before training: ``rx.train``'s agreement on checkpoints, its
        probe), so that what the ranks agree on holds on each of them."""
        with self._cond:
            self._prelude_held = self._recording is not None
            return self._prelude_held

    def drop_prelude(self) -> None:
        """Keep no prelude log (``rx.train`` takes no checkpoints: another rank's log
        outgrew its bound); :meth:`end_prelude` returns None."""
        with self._cond:
            if self._recording is not None:
                self._recording, self._digests = None, []

    @property
    def keeps_prelude(self) -> bool:
        """Whether the prelude log is being kept (recovery on, within its bound), so that
        ``rx.train`` can checkpoint it."""
        with self._cond:
            return self._recording is not None

    def statistics(self) -> dict[str, float]:
        """Counters since the start: ``calls`` (XGBoost's requests), ``bytes`` (sent by this
        worker's XGBoost in the calls that ran), ``collective_s`` (seconds inside rabit2's
        collectives), ``handler_s`` (seconds inside the gRPC handler, checks and copies
        included; the gRPC transport and XGBoost's client are outside it)."""
        return {"calls": self.calls, "bytes": self._bytes, "collective_s": self._collective_s,
                "handler_s": self._handler_s}

    def _capture(self, record: Record) -> None:
        with self._cond:
            if self._captured is not None:
                self._captured.append(record)

    def _describe(self, method: str, request: Any, size: int) -> Record:
        if method == "Allreduce":
            dtype, op = int(request.data_type), int(request.reduce_operation)
            if dtype not in _DTYPES:
                name = DATA_TYPES[dtype] if 0 <= dtype < len(DATA_TYPES) else f"#{dtype}"
                self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Allreduce: data type {name} is not supported")
            if op not in _OPS:
                self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Allreduce: reduce operation #{op} is not supported")
            if size % _DTYPES[dtype].itemsize:
                self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Allreduce: {size} B is not a whole number of "
                           f"{DATA_TYPES[dtype]} elements")
            return Record(method, dtype=dtype, op=op, size=size)
        if method == "Broadcast":
            root = int(request.root)
            if not 0 <= root < self.world:
                self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Broadcast: root {root} is not a rank of this job (world "
                           f"{self.world})")
            return Record(method, root=root)
        if method == "Allgather":
            return Record(method, size=size)
        return Record(method)

    def _from_log(self, record: Record, payload: memoryview) -> bytes | None:
        """The result of a call a restarted worker makes again, or None to run it."""
        with self._cond:
            if self._replay is not None:
                if not self._replay:
                    self._fail(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the restarted worker made more calls before training than "
                               f"the original run ({self._replayed}); the next is "
                               f"{record.describe()}", MismatchError("prelude diverged"))
                expected = self._replay.popleft()
                sent = self._replay_digests.popleft() if self._replay_digests else b""
                self._replayed += 1
                if not _same_call(expected, record):
                    message = (f"call {self._replayed} before training is "
                               f"{record.describe()} on the restarted worker but was "
                               f"{expected.describe()} in the original run")
                    self._fail(grpc.StatusCode.FAILED_PRECONDITION, message,
                               MismatchError(message))
                if sent != _digest(payload):
                    message = (f"call {self._replayed} before training, "
                               f"{record.describe()}: this rank's input differs from the "
                               "original run's (the program must build the same data, and "
                               "pass the same params and rounds, on a restart)")
                    self._fail(grpc.StatusCode.FAILED_PRECONDITION, message,
                               MismatchError(message))
                return expected.result
            if not self._prologue:
                return None
            root, size = self._prologue.pop(0)
            if record.method != "Broadcast" or record.root != root:
                self._prologue = None  # not what a loaded booster makes once: run it
                return None
            for candidate in reversed(self._prologue_answers):
                if candidate.root == root and len(candidate.result) == size:
                    return candidate.result
            self._prologue = None
            return None

    # ------------------------------------------------------------------ the collectives

    def _allreduce(self, payload: memoryview, record: Record) -> bytes:
        data = bytearray(payload)
        rabit2.allreduce(np.frombuffer(data, dtype=_DTYPES[record.dtype]), _OPS[record.op])
        return bytes(data)

    def _allgather(self, payload: memoryview, record: Record) -> bytes:
        out = rabit2.allgather(np.frombuffer(payload, dtype=np.uint8))
        if out.nbytes != record.size * self.world:
            raise MismatchError(f"Allgather: ranks sent segments of different sizes "
                                f"({record.size} B here, {out.nbytes} B in all)")
        return out.tobytes()

    def _allgatherv(self, payload: memoryview, record: Record) -> bytes:
        return rabit2.allgather(np.frombuffer(payload, dtype=np.uint8)).tobytes()

    def _broadcast(self, payload: memoryview, record: Record) -> bytes:
        mine = record.root == self.rank
        data = np.frombuffer(payload, dtype=np.uint8) if mine else None
        out = rabit2.broadcast(data, record.root)
        if not isinstance(out, np.ndarray):
            raise MismatchError(f"Broadcast: the root sent {type(out).__name__}, not bytes")
        return bytes(payload) if mine else out.tobytes()

    # ------------------------------------------------------------------ the server

    def start(self) -> int:
        """Listen on 127.0.0.1 (an ephemeral port); returns the port."""
        handlers = {
            method: grpc.unary_unary_rpc_method_handler(
                _bind(self, method),
                request_deserializer=wire.reader(method), response_serializer=wire.reply)
            for method in METHODS
        }
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4,
                                                        thread_name_prefix="rabit2-fed"),
                             options=[("grpc.max_receive_message_length", -1),
                                      ("grpc.max_send_message_length", -1),
                                      ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE,
                                                                              handlers),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        if not self.port:
            raise OSError("the federated endpoint could not bind a loopback port")
        server.start()
        self.server = server
        return self.port

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)
            self.server = None


_RUN: dict[str, Callable[[Endpoint, memoryview, Record], bytes]] = {
    "Allreduce": Endpoint._allreduce,
    "Allgather": Endpoint._allgather,
    "AllgatherV": Endpoint._allgatherv,
    "Broadcast": Endpoint._broadcast,
}


def _bind(endpoint: Endpoint, method: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        return endpoint.handle(method, request, context)
    return handler


def _same_call(expected: Record, record: Record) -> bool:
    """Is a restarted worker's call the recorded one: kind, type, op, root, and the size
    where every rank sends the same?  (Its contents are checked by digest.)"""
    return (expected.method, expected.dtype, expected.op, expected.root, expected.size) == (
        record.method, record.dtype, record.op, record.root, record.size)


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _is_own_connection(peer: str, port: int) -> bool:
    """Is ``peer`` (gRPC's ``ipv4:127.0.0.1:PORT``) a TCP connection this process made to
    ``port``?  Looked up in the kernel's socket tables (a client may use an IPv6 socket with
    a v4-mapped address); where there are none (not Linux) every loopback peer is taken."""
    if not peer.startswith("ipv4:127.0.0.1:"):
        return False
    try:
        peer_port = int(peer.rsplit(":", 1)[1])
    except ValueError:
        return False
    if not os.path.exists("/proc/net/tcp"):
        return True
    wanted = {(f"0100007F:{peer_port:04X}", f"0100007F:{port:04X}"),
              (f"0000000000000000FFFF00000100007F:{peer_port:04X}",
               f"0000000000000000FFFF00000100007F:{port:04X}")}
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        inode = next((fields[9] for fields in (line.split() for line in lines)
                      if (fields[1], fields[2]) in wanted), inode)
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False
