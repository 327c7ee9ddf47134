"""Checkpoints of the blocking API: :func:`checkpoint`, :func:`lazy_checkpoint`,
:func:`load_checkpoint`, :func:`version_number` and :func:`recovery_statistics` (re-exported by
:mod:`rabit2.api` and :mod:`rabit2`).  What every rank keeps, and how a restarted worker gets
it back: ``docs/recovery.md``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from rabit2.state import Communicator as _Communicator
from rabit2.state import comm as _comm
from rabit2.state import mock_hit as _mock_hit
from rabit2.state import require as _require

# ----------------------------------------------------------------------------- checkpoints


def checkpoint(global_model: Any, local_model: Any = None) -> None:
    """Record the model state after an iteration; the version number goes up by one.

    Models are pickled and kept in memory (nothing touches disk).  Collective calls after
    this point are numbered from zero again (their identity is (version, seqno)).  The global
    model must be the same on every rank, as in rabit: a restarted worker gets a
    neighbour's.  With recovery on, ``local_model`` is handed to the next ranks of the ring
    (not waited for).  Nothing is exchanged with the other ranks, so no peer's failure is
    raised here.  A collective under way on another thread finishes first.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`, ``TypeError`` (chained to what ``pickle`` raised) for a model that
    cannot be pickled, and ``ValueError`` for a ``local_model`` with recovery on where
    ``rabit_local_replica=0`` keeps no copy of it; then nothing changes (the version, the
    models kept).
    """
    comm = _checkpointing("checkpoint", local_model is not None)
    blob = _pickled(global_model, "checkpoint")
    local = None if local_model is None else _pickled(local_model, "checkpoint")
    with comm.lock:  # (behind a collective of another thread: docs/user-guide.md, "Threads")
        _advance_version(comm, blob, local)
        comm.global_model, comm.lazy_model, comm.local_model = blob, None, local


def lazy_checkpoint(global_model: Any, local_model: Any = None) -> None:
    """Like :func:`checkpoint` without pickling the global model now: it must not change
    until the next checkpoint (it is serialised only if a restarted peer needs it).  A
    ``local_model`` (beyond rabit, whose lazy checkpoint has none) is pickled now and
    replicated as with :func:`checkpoint`.

    Raises :class:`~rabit2.errors.NotInitializedError` before :func:`init` or after
    :func:`finalize`, and ``TypeError`` for a ``local_model`` that cannot be pickled
    (``ValueError`` for one that no neighbour would keep, as :func:`checkpoint`), before
    the version goes up.  A global model that cannot be pickled fails the
    restart that needs it: :class:`~rabit2.errors.UnrecoverableError` naming the pickling
    error, on every rank."""
    comm = _checkpointing("lazy_checkpoint", local_model is not None)
    local = None if local_model is None else _pickled(local_model, "lazy_checkpoint")
    with comm.lock:
        # pickled on the loop thread only if a restarted neighbour asks for it
        _advance_version(comm, lambda: pickle.dumps(global_model, pickle.HIGHEST_PROTOCOL),
                         local)
        comm.global_model, comm.lazy_model, comm.local_model = None, global_model, local


def _checkpointing(who: str, local: bool = False) -> _Communicator:
    """The communicator, for a checkpoint call: :class:`~rabit2.errors.NotInitializedError`
    before :func:`init`, ``RuntimeError`` in elastic mode (which has no checkpoints: a
    newcomer gets the state from a member, docs/elastic.md); for one that keeps or loads a
    local model (``local``), ``ValueError`` where recovery is on but no neighbour keeps
    local models (rabit's rule: a restarted worker could never get its own back)."""
    comm = _require()
    config = comm.config
    if comm.membership is not None or (config is not None and config.elastic):
        raise RuntimeError(f"{who}: elastic mode has no checkpoints; a worker that joins "
                           "a live set gets the state from a member (docs/elastic.md)")
    if (local and comm.engine is not None and config is not None and config.recover
            and config.local_replica == 0):
        raise ValueError(f"{who}: a local model with recovery on needs rabit_local_replica "
                         ">= 1 (default 2): with 0 no neighbour keeps a copy, and a "
                         "restarted worker could not get its own back")
    return comm


def _pickled(model: Any, who: str) -> bytes:
    """``model`` pickled; ``TypeError`` (chained to what pickle raised) if it cannot be."""
    try:
        return pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickling raises many unrelated types
        raise TypeError(f"{who}: cannot pickle {type(model).__name__}: {exc}") from exc


def _advance_version(comm: _Communicator, blob: bytes | Callable[[], bytes],
                     local: bytes | None = None) -> None:
    _mock_hit("checkpoint")
    comm.must_load = False  # a program that checkpoints before loading starts afresh
    comm.loaded_without_local = False  # (the local model is the program's own again)
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
    :func:`finalize`; ``ValueError`` for ``with_local`` where recovery is on but
    ``rabit_local_replica=0`` keeps no local models; ``RuntimeError`` for ``with_local`` in
    a restarted worker whose first call fetched the checkpoint without its local model.
    The fetch of a restarted worker raises
    :class:`~rabit2.errors.UnrecoverableError` if no live neighbour holds what is needed,
    :class:`~rabit2.errors.CollectiveTimeoutError` if nothing arrives within
    ``timeout_sec``, and :class:`~rabit2.errors.JobAbortedError` if the job was aborted.
    """
    if not isinstance(with_local, (bool, np.bool_)) and not (
            type(with_local) is int and with_local in (0, 1)):  # (1: ported C, as in rabit)
        raise TypeError(f"with_local must be a bool, got {with_local!r}")
    comm = _checkpointing("load_checkpoint", bool(with_local))
    with comm.lock:  # (behind a collective of another thread)
        return _load(comm, bool(with_local))


def _load(comm: _Communicator, with_local: bool) -> tuple[Any, ...]:
    if comm.must_load:
        comm.must_load = False
        version, blob, local = comm.engine.load_checkpoint(with_local)
        if version:  # (at version 0 the calls made before it stay where they were)
            comm.version, comm.seqno = version, 0
        comm.global_model, comm.lazy_model, comm.local_model = blob, None, local
        comm.loaded_without_local = not with_local and version > 0
    elif with_local and comm.loaded_without_local:
        raise RuntimeError(
            "load_checkpoint(with_local=True): this restarted worker fetched checkpoint "
            f"{comm.version} from its neighbours in an earlier load_checkpoint() without its "
            "local model; ask for it in the first call (with_local=True)")
    elif not comm.loaded and comm.engine is not None:
        comm.engine.keep_bootstrap()  # (the calls before it, for a later restart's replay)
    comm.loaded = True
    if comm.version == 0:
        return (0, None, None) if with_local else (0, None)
    if comm.lazy_model is not None:
        model = comm.lazy_model
    else:
        model = None if comm.global_model is None else pickle.loads(comm.global_model)
    if with_local:
        # (b"": a checkpoint without a local model, as a restarted worker fetches it)
        local = pickle.loads(comm.local_model) if comm.local_model else None
        return comm.version, model, local
    return comm.version, model


def version_number() -> int:
    """The version of this worker's last checkpoint: how many checkpoints it has taken, or
    the version :func:`load_checkpoint` returned (so 0 in a restarted worker until it
    loads; 0 when not initialised).  Never raises."""
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



__all__ = ["checkpoint", "lazy_checkpoint", "load_checkpoint", "recovery_statistics",
           "version_number"]
