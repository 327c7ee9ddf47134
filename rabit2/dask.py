"""Run a rabit2 job on the workers of a Dask cluster: :func:`run`.

::

    from distributed import Client
    import rabit2.dask

    def train(data_path):            # a plain rabit2 program: rabit2 is initialised here
        version, model = rabit2.load_checkpoint()
        ...
        return model

    with Client("scheduler:8786") as client:
        models = rabit2.dask.run(client, train, "/data/part")   # one result per rank

The tracker runs beside the client, in this process.  Each rank is one Dask task pinned to
one Dask worker (one rank per worker, in the order of their addresses, or as many as
``workers`` asks).  The task joins the job (``rabit2.init`` with the tracker's address, the
job's secret, its task id and attempt), calls ``func``, leaves (``rabit2.finalize``) and
returns ``func``'s result; an exception in ``func`` ends the job for every rank
(:class:`rabit2.CommunicatorContext`).

When a Dask worker that runs a rank goes away (its process died, or the tracker gave up on
it as silent and it was restarted), the rank's task is submitted again, with the next attempt
number, to a Dask worker that runs no rank of this job (a worker its nanny restarted, or a
spare one), and recovers through rabit2 as a restarted process does: it loads its checkpoint
from its neighbours and replays.  That happens at most ``max_attempts`` times per rank, as
``rabit2-submit --max-attempts`` does.

This module is a launcher, like ``rabit2-submit``: it is the one module of the library that
uses the tracker (``tracker.server``), and it needs ``distributed``.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from rabit2 import api
from rabit2.errors import JobAbortedError, RabitError

POLL_SEC = 0.1
"""How often :func:`run` looks at the tasks, the tracker and the cluster."""
PLACE_TIMEOUT_SEC = 60.0
"""How long a rank whose worker went away may wait for a free Dask worker to take it."""
JOIN_TIMEOUT_SEC = 120.0
"""How long a rank's task may take to join the job once submitted (a Dask worker whose
threads are all busy with other work does not start it)."""
ENDING_GRACE_SEC = 30.0
"""After the job ended (done, or aborted by a rank), how long the tasks get to return."""
GIVEN_UP_GRACE_SEC = 5.0
"""After :func:`run` gave the job up (``timeout``, a rank lost for good, ...), how long the
tasks get to return: a rank in a collective raises at once, and one busy in ``func`` is
stopped with its worker (below) rather than waited for."""


@dataclasses.dataclass
class _Rank:
    """One task of the job: where its current attempt runs."""

    task_id: str
    address: str = ""  # the Dask worker it is pinned to
    attempt: int = 0
    future: Any = None
    worker_id: str = ""  # the Dask worker process it was placed on (an address may return)
    submitted_at: float = 0.0
    lost_at: float | None = None  # its worker went away; waiting for a free one


def run(client: Any, func: Callable[..., Any], *args: Any,
        workers: int | Sequence[str] | None = None, max_attempts: int = 3,
        timeout: float | None = None, config: dict[str, Any] | None = None,
        tracker_host: str | None = None,
        context: Callable[..., AbstractContextManager[Any]] | None = None,
        **kwargs: Any) -> list[Any]:
    """Run ``func(*args, **kwargs)`` as a rabit2 job on the workers of ``client`` (a
    ``distributed.Client``); return the per-rank results, in rank order.

    ``workers``: how many ranks (each on its own Dask worker, the first ones in address
    order) or which workers, one rank each (addresses, with or without ``tcp://``, or worker
    names, as Dask's ``workers=`` takes them); default: every worker, one rank each.
    ``max_attempts``: runs per rank in all, the first included (a rank's worker lost that
    often ends the job).  ``timeout``: give up on the whole job after that many seconds.
    ``config``: rabit2 parameters for every rank (``init``'s keyword arguments, e.g.
    ``{"rabit_timeout_sec": 60}``).  ``tracker_host``: the address the ranks reach the
    tracker at (default: loopback when the scheduler is on this machine, else this
    machine's address on the route to the scheduler).  ``context``: what each rank runs
    ``func`` in, called with ``init``'s keyword arguments (default
    :class:`rabit2.CommunicatorContext`; :class:`rabit2.xgboost.CommunicatorContext` for
    XGBoost training through rabit2).  A keyword argument of ``func`` that has one of these
    names must be bound with ``functools.partial``.

    Raises ``ValueError`` for bad arguments (a closed or asynchronous client, no workers, a
    worker address
    the cluster does not have, two ranks that would share a process), ``TypeError`` for
    ``workers`` of another type; ``RuntimeError`` from a rank placed on a worker process
    that runs a rank of another job (a process joins one job at a time); an exception
    ``func`` raised (that of the rank whose error ended the job, else of the lowest rank
    that raised one not of rabit2's own);
    :class:`~rabit2.errors.JobAbortedError` when the job is given up (a rank lost more
    than ``max_attempts`` times, no free worker for a lost rank within 60 s, a rank that
    does not start, a silent worker without a nanny, ``timeout``); ``ImportError`` without
    ``distributed``.  Once the job ended, the ranks get 30 s to return (5 s after it was
    given up, so ``timeout`` is kept to within a few seconds); a rank still busy in ``func``
    then has its Dask worker restarted by its nanny, since nothing else stops a running
    task, and the error says so.
    """
    from tracker.server import TrackerThread  # noqa: PLC0415 (a launcher: see the docstring)

    if getattr(client, "status", "running") in ("closing", "closed"):
        raise ValueError("the Dask client is closed")
    if getattr(client, "asynchronous", False):
        raise ValueError("rabit2.dask.run blocks until the job ends and needs a Client made "
                         "with asynchronous=False (from async code: run it in a thread "
                         "with a synchronous Client)")
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    if timeout is not None and not timeout > 0:
        raise ValueError("timeout must be > 0")
    params = _check_config(config)
    addresses = _choose_workers(client, workers)
    host = tracker_host or _tracker_host(client)
    tracker = TrackerThread(len(addresses), host=host, port=0,
                            secret=bytes.fromhex(secrets.token_hex(32)))
    tracker.start()
    try:
        return _Job(client, tracker, func, args, kwargs, addresses, max_attempts, params,
                    timeout, context or api.CommunicatorContext).run()
    finally:
        tracker.stop()


def _check_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """The rabit2 parameters, checked here rather than on every rank (``ValueError``)."""
    from rabit2.config import load_config  # noqa: PLC0415

    params = dict(config or {})
    reserved = {"dmlc_tracker_uri", "dmlc_tracker_port", "dmlc_task_id", "dmlc_num_attempt",
                "dmlc_num_worker", "rabit2_secret"}
    taken = sorted(key for key in params if key.lower() in reserved)
    if taken:
        raise ValueError(f"config may not set {', '.join(taken)}: rabit2.dask.run sets them")
    load_config(kwargs=params, environ={})  # raises ValueError naming a bad key or value
    return params


def _worker_processes(client: Any) -> dict[str, Any]:
    """The cluster's workers now: address -> the scheduler's record of it.

    Asked of the scheduler itself: ``Client.scheduler_info`` returns the client's cached
    copy, which the client's own periodic refresh replaces every few seconds with one that
    lists no workers, so that a call racing with it saw every worker gone."""
    info = client.sync(client.scheduler.identity, n_workers=-1)
    workers: dict[str, Any] = info.get("workers", {})
    return workers


def _identities(workers: dict[str, Any]) -> dict[str, str]:
    """Address -> the worker process there, told apart from a later one at the same address:
    its name and its scratch directory (each worker process makes its own)."""
    return {address: f"{info.get('id', '')}|{info.get('local_directory', '')}"
            for address, info in workers.items()}


def _choose_workers(client: Any, wanted: int | Sequence[str] | None) -> list[str]:
    """One Dask worker address per rank (``ValueError`` when that cannot be).  A worker may
    be named as Dask's own ``workers=`` names it: by its address, its address without the
    ``tcp://`` scheme, or its name."""
    processes = _worker_processes(client)
    available = sorted(processes)
    if not available:
        raise ValueError("the Dask cluster has no workers")
    if isinstance(wanted, str):
        wanted = [wanted]  # (one address, not a sequence of characters)
    if isinstance(wanted, bool) or not isinstance(wanted, (int, Sequence, type(None))):
        raise TypeError(f"workers must be a number of workers or a list of worker "
                        f"addresses, got {wanted!r}")
    if wanted is None:
        chosen = available
    elif isinstance(wanted, int):
        if not 1 <= wanted <= len(available):
            raise ValueError(f"workers={wanted}: a job needs 1 to {len(available)} workers "
                             f"(the cluster's)")
        chosen = available[:wanted]
    else:
        aliases: dict[str, str] = {}
        for address, info in processes.items():
            aliases.setdefault(str(info.get("name", address)), address)
            aliases.setdefault(address.partition("://")[2] or address, address)
        for address in available:
            aliases[address] = address  # (an address is itself first)
        chosen = [aliases.get(str(worker), str(worker)) for worker in wanted]
        unknown = [address for address in chosen if address not in available]
        twice = sorted({address for address in chosen if chosen.count(address) > 1})
        if unknown or not chosen or twice:
            what = (f"named twice: {twice}" if twice and not unknown
                    else f"unknown: {unknown}" if chosen else "none named")
            raise ValueError(f"workers must name distinct workers of the cluster ({what}); "
                             f"available: {available}")
    pids = client.run(_process_id, workers=chosen)
    if len(set(pids.values())) != len(chosen):
        raise ValueError("several Dask workers share one process, and rabit2 runs one rank "
                         "per process: start the cluster with processes=True (a "
                         "LocalCluster's default) or one worker per process")
    return chosen


def _process_id() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def _tracker_host(client: Any) -> str:
    """The address the workers reach this process at: loopback with a scheduler on this
    machine, else the local address on the route to it (no packet is sent)."""
    address = getattr(client.scheduler, "address", "") or ""
    parsed = urllib.parse.urlsplit(address)
    if parsed.scheme not in ("tcp", "tls", "ws", "wss") or not parsed.hostname:
        return "127.0.0.1"  # (inproc://: the cluster lives in this process)
    scheduler = parsed.hostname
    try:
        resolved = socket.getaddrinfo(scheduler, None, socket.AF_INET)[0][4][0]
    except OSError:
        return "127.0.0.1"
    if str(resolved).startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((resolved, 9))
        return str(probe.getsockname()[0])


_SUBMITTING = threading.Lock()
"""Held while one job submits its ranks (in the calling process)."""

_ONE_RANK = threading.Lock()
"""Held by the rank that runs in this process: a process joins one job at a time (rabit2's
communicator is process-wide), and a Dask worker with several threads may be given a rank
of each of two jobs at once."""


def _rank_main(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               params: dict[str, Any],
               context: Callable[..., AbstractContextManager[Any]]) -> Any:
    """One rank, inside a Dask worker: join, call ``func``, leave; its result."""
    # (taken without waiting: two jobs whose ranks each wait for the other's worker would
    # never start)
    if not _ONE_RANK.acquire(blocking=False):
        raise RuntimeError("this Dask worker's process already runs a rank of another rabit2 "
                           "job, and a process joins one job at a time: run the jobs one "
                           "after another, or on different workers (workers=...)")
    try:
        if api.current_config() is not None:
            raise RuntimeError("this Dask worker's process already runs a rabit2 rank "
                               "outside rabit2.dask")
        with context(**params):
            return func(*args, **kwargs)
    except SystemExit as exc:  # (out of a task it would end the Dask worker's process)
        raise RuntimeError(f"func called sys.exit({exc.code!r}) in rank "
                           f"{params['dmlc_task_id']}'s task") from exc
    except Exception:
        raise
    except BaseException as exc:  # (KeyboardInterrupt and the like: as sys.exit)
        raise RuntimeError(f"func raised {type(exc).__name__} in rank "
                           f"{params['dmlc_task_id']}'s task") from exc
    finally:
        _ONE_RANK.release()


class _Job:
    """Watches one job: places and re-places its ranks, ends it, gathers the results."""

    def __init__(self, client: Any, tracker: Any, func: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any], addresses: list[str],
                 max_attempts: int, params: dict[str, Any], timeout: float | None,
                 context: Callable[..., AbstractContextManager[Any]]) -> None:
        self.client = client
        self.tracker = tracker
        self.func, self.args, self.kwargs = func, args, kwargs
        self.max_attempts = max_attempts
        self.params = params
        self.context = context
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.ranks = [_Rank(str(i)) for i in range(len(addresses))]
        self.addresses = addresses
        env = tracker.worker_env()
        self.job_params = {"dmlc_tracker_uri": env["DMLC_TRACKER_URI"],
                           "dmlc_tracker_port": env["DMLC_TRACKER_PORT"],
                           "dmlc_num_worker": env["DMLC_NUM_WORKER"],
                           "rabit2_secret": env["RABIT2_SECRET"]}
        # a rank placed again recovers, as under rabit2-submit (unless config says)
        if not any(key.lower() in ("recover", "rabit2_recover") for key in params):
            params["rabit2_recover"] = max_attempts > 1
        self.token = secrets.token_hex(4)  # makes the task keys of this job unique
        self.origin: str | None = None  # the task whose error ended the job, if one did
        # the workers at the last look: address -> the worker process's id
        self.present = _identities(_worker_processes(client))

    def run(self) -> list[Any]:
        try:
            # (one job's ranks all queued before another's: two jobs submitted at once
            # through one client, on workers of one thread each, would otherwise each hold
            # a worker with a rank waiting for the other's, until the join deadline; two
            # clients send on streams of their own, which this cannot order)
            with _SUBMITTING:
                for rank, address in zip(self.ranks, self.addresses, strict=True):
                    self._submit(rank, address)
            reason = self._watch()
            return self._results(reason)
        except BaseException as exc:
            if self.tracker.result() is None:
                self.tracker.abort(f"rabit2.dask.run ended by {type(exc).__name__}")
            self._cancel_all()
            raise

    def _submit(self, rank: _Rank, address: str) -> None:
        params = {**self.params, **self.job_params, "dmlc_task_id": rank.task_id,
                  "dmlc_num_attempt": str(rank.attempt)}
        rank.address = address
        rank.worker_id = self.present.get(address, "")
        rank.lost_at = None
        rank.submitted_at = time.monotonic()
        rank.future = self.client.submit(
            _rank_main, self.func, self.args, self.kwargs, params, self.context,
            key=f"rabit2-{self.token}-task{rank.task_id}-attempt{rank.attempt}",
            workers=[address], allow_other_workers=False, pure=False, retries=0)

    def _watch(self) -> str | None:
        """Until the job ends; the reason it was given up, or None when it ended by itself."""
        while True:
            result = self.tracker.result()
            if result is not None:
                return None
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline:
                return self._give_up(f"the job timed out after {self.timeout:g} s")
            failed = next((rank for rank in self.ranks if rank.future.status == "error"), None)
            if failed is not None:  # (raised there, maybe before it joined: end the job)
                self.origin = failed.task_id
                error = failed.future.exception()
                return self._give_up(f"task {failed.task_id} raised "
                                     f"{type(error).__name__}: {error}")
            reason = self._check_ranks(now)
            if reason is not None:
                return self._give_up(reason)
            time.sleep(POLL_SEC)

    def _check_ranks(self, now: float) -> str | None:
        """Re-place the ranks whose workers went away; why the job cannot go on, if so."""
        workers = _worker_processes(self.client)
        silent = set(self.tracker.take_silent())
        stuck = [rank.address for rank in self.ranks if rank.task_id in silent]
        if stuck:  # paused or wedged: its nanny restarts it, and the rank is placed again
            reason = self._restart(stuck, workers)
            if reason is not None:
                return reason
            workers = _worker_processes(self.client)
        self.present = _identities(workers)
        present = set(self.present)
        registered = {task["task_id"] for task in (self.tracker.status() or {}).get("tasks", ())}
        for rank in self.ranks:
            if rank.future.status == "finished":
                continue
            if rank.lost_at is None and self.present.get(rank.address) != rank.worker_id:
                # (gone, or a new worker process at the same address)
                rank.lost_at = now
                rank.future.cancel()
                if rank.attempt + 1 >= self.max_attempts:
                    return (f"task {rank.task_id} failed for good: its Dask worker "
                            f"{rank.address} went away on attempt "
                            f"{rank.attempt + 1}/{self.max_attempts}")
            if rank.lost_at is not None:
                free = sorted(present - {other.address for other in self.ranks
                                         if other.lost_at is None})
                if free:
                    rank.attempt += 1
                    self._submit(rank, free[0])
                elif now - rank.lost_at > PLACE_TIMEOUT_SEC:
                    return (f"no free Dask worker took task {rank.task_id} within "
                            f"{PLACE_TIMEOUT_SEC:g} s after its worker went away")
            elif (rank.attempt == 0 and rank.task_id not in registered
                  and now - rank.submitted_at > JOIN_TIMEOUT_SEC):
                # (it never began: nothing of it to wait for at the end)
                self.client.cancel([rank.future])
                return (f"task {rank.task_id} did not join the job within "
                        f"{JOIN_TIMEOUT_SEC:g} s on Dask worker {rank.address} (are its "
                        f"threads busy with other work, such as a rank of another job "
                        f"submitted through another client?)")
        return None

    def _restart(self, addresses: list[str], workers: dict[str, Any]) -> str | None:
        """Have the nannies of silent workers restart them; why the job cannot go on if a
        worker has no nanny (nothing here can stop it)."""
        orphans = [address for address in addresses if not workers.get(address, {}).get("nanny")]
        if orphans:
            return (f"the Dask workers {orphans} stopped answering and have no nanny to "
                    "restart them")
        try:
            self.client.restart_workers(addresses, timeout=PLACE_TIMEOUT_SEC,
                                        raise_for_error=False)
        except Exception as exc:  # (any failure: said in the reason)
            return f"restarting the silent Dask workers {addresses} failed: {exc}"
        return None

    def _stop(self, stuck: list[_Rank]) -> str:
        """Cancel the tasks that did not return, and have the nannies restart their workers
        (a task busy in ``func`` keeps its worker's thread, and rabit2's process-wide state,
        for good otherwise); what was done, for the error."""
        self._cancel_all()
        # (only where the attempt joined does func run: a task still queued behind other
        # work is cancelled, and that work left alone)
        joined = {(str(task["task_id"]), task.get("incarnation"))
                  for task in (self.tracker.status() or {}).get("tasks", ())}
        workers = _worker_processes(self.client)
        addresses = [rank.address for rank in stuck if rank.address in workers
                     and (rank.task_id, rank.attempt) in joined]
        nannied = [address for address in addresses if workers[address].get("nanny")]
        said = (f"; tasks {', '.join(rank.task_id for rank in stuck)} had not returned"
                + (f" (the Dask workers {nannied} were restarted to stop them)" if nannied
                   else ""))
        if nannied:
            # (a graceful restart waits for the running task's thread, which is the one that
            # does not return: the process ends at once, and its nanny starts it afresh)
            try:
                self.client.run(_end_process, workers=nannied, wait=False)
            except Exception as exc:  # (any failure: said in the error)
                said += f" (stopping them failed: {exc})"
        others = sorted(set(addresses) - set(nannied))
        if others:
            said += (f"; Dask workers {others} have no nanny to restart them: they stay busy "
                     "until their tasks return")
        return said

    def _give_up(self, reason: str) -> str:
        self.tracker.abort(reason)
        return reason

    def _cancel_all(self) -> None:
        self.client.cancel([rank.future for rank in self.ranks
                            if rank.future is not None and not rank.future.done()])

    def _results(self, reason: str | None) -> list[Any]:
        """Wait (bounded) for every task to return; the results, or the error that ended
        the job."""
        futures = [rank.future for rank in self.ranks]
        grace = ENDING_GRACE_SEC if reason is None else GIVEN_UP_GRACE_SEC
        deadline = time.monotonic() + grace
        while True:
            running = [rank for rank in self.ranks if not rank.future.done()]
            if running:
                # a task whose worker went away never returns: it is not waited for
                present = set(_worker_processes(self.client))
                gone = [rank.future for rank in running if rank.address not in present]
                if gone:
                    self.client.cancel(gone)
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(POLL_SEC)
        failed = [(rank.task_id, rank.future.exception()) for rank in self.ranks
                  if rank.future.status == "error"]
        errors = [error for _, error in failed]
        stuck = [rank for rank in self.ranks if not rank.future.done()]
        stopped = self._stop(stuck) if stuck else ""
        result = self.tracker.result()
        if reason is None and result is not None and not result.success:
            reason = result.reason
        program = [(task, error) for task, error in failed if not isinstance(error, RabitError)]
        if program:  # the root cause: what func raised on the rank that ended the job
            origin = self.origin or (result.origin if result is not None else None)
            raise next((error for task, error in program if task == origin), program[0][1])
        if reason is not None:
            raise JobAbortedError(reason + stopped)
        if errors:
            raise errors[0]
        if stuck:
            raise JobAbortedError(f"the job's tasks did not return within {grace:g} s after "
                                  f"it ended{stopped}")
        lost = [rank.task_id for rank in self.ranks if rank.future.status != "finished"]
        if lost:  # (a worker that went away after its rank had finished for good)
            raise JobAbortedError(f"the results of tasks {', '.join(lost)} were lost with "
                                  "their Dask workers after the job ended")
        by_rank: dict[int, Any] = {}
        for rank, future in zip(self.ranks, futures, strict=True):
            placed = self.tracker.rank_of(rank.task_id)
            try:
                value = future.result(timeout=ENDING_GRACE_SEC)
            except TimeoutError:  # (its worker went away with the result)
                raise JobAbortedError(f"the result of task {rank.task_id} was lost with its "
                                      "Dask worker after the job ended") from None
            by_rank[int(rank.task_id) if placed is None else placed] = value
        return [by_rank[i] for i in range(len(self.ranks))]


async def _end_process() -> None:
    """Run by a Dask worker's event loop (``Client.run`` waits for a plain function): the
    process ends a moment later, once its answer is out, whatever its task threads do."""
    import asyncio  # noqa: PLC0415

    asyncio.get_running_loop().call_later(0.2, os._exit, 1)


__all__ = ["run"]
