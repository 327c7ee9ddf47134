"""rabit2.dask.run on a real ``distributed.LocalCluster`` (one process per Dask worker, with
nannies): results in rank order, a Dask worker killed mid-job and its rank placed again and
recovered (plain rabit2 and XGBoost through rabit2), errors that end the job, bad input."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import rabit2
import rabit2.dask
from rabit2.errors import JobAbortedError
from tests.support.jobs import need_federated_xgboost

distributed = pytest.importorskip("distributed")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

N_WORKERS = 3
ITERATIONS = 12


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    cluster = distributed.LocalCluster(n_workers=N_WORKERS, threads_per_worker=1,
                                       processes=True, dashboard_address=":0")
    with cluster, distributed.Client(cluster) as dask_client:
        yield dask_client


_LOST: list[str] = []
"""Why the module's cluster lost a worker for good (a nanny whose restart failed): later tests
fail at once with it instead of each waiting out the minute."""


def all_back(client: Any) -> None:
    """Every worker of the cluster is back (a nanny restarts a killed one), within a minute;
    otherwise fail with what the nannies logged last."""
    if _LOST:
        pytest.fail(f"an earlier test left the cluster without a worker: {_LOST[0]}")
    try:
        client.wait_for_workers(N_WORKERS, timeout=60)
    except TimeoutError:
        try:
            logs = client.get_worker_logs(nanny=True)
            said = "; ".join(f"{nanny}: {' | '.join(msg for _, msg in lines[-4:])}"
                             for nanny, lines in logs.items())
        except Exception as exc:  # (only for the message)
            said = f"(the nannies' logs could not be read: {exc})"
        _LOST.append(f"{len(client.scheduler_info()['workers'])} of {N_WORKERS} workers "
                     f"after a minute; the nannies logged: {said[-3000:]}")
        pytest.fail(_LOST[0])


@pytest.fixture
def full(client: Any) -> Any:
    """The cluster with every worker back."""
    all_back(client)
    return client


def chained_sums(iterations: int) -> tuple[int, str, str]:
    """A rabit2 program: SUM allreduces whose results are chained into a digest kept in the
    checkpoint, so a rank placed again resumes where its checkpoint stood."""
    rank = rabit2.get_rank()
    version, digest = rabit2.load_checkpoint()
    digest = digest or ""
    for it in range(version, iterations):
        data = np.arange(1000, dtype=np.float64) * (rank + 1) + it
        rabit2.allreduce(data, rabit2.Op.SUM)
        digest = hashlib.sha256(digest.encode() + data.tobytes()).hexdigest()
        rabit2.checkpoint(digest)
    return rank, digest, distributed.get_worker().address


def expected_digest(world: int, iterations: int) -> str:
    digest = ""
    for it in range(iterations):
        data = sum(np.arange(1000, dtype=np.float64) * (r + 1) + it for r in range(world))
        digest = hashlib.sha256(digest.encode() + data.tobytes()).hexdigest()
    return digest


def test_one_rank_per_worker_results_in_rank_order(full: Any) -> None:
    results = rabit2.dask.run(full, chained_sums, ITERATIONS)
    assert [rank for rank, _, _ in results] == list(range(N_WORKERS))
    assert {digest for _, digest, _ in results} == {expected_digest(N_WORKERS, ITERATIONS)}
    assert len({address for _, _, address in results}) == N_WORKERS
    # as asked: two ranks on the first two workers
    two = rabit2.dask.run(full, chained_sums, ITERATIONS, workers=2)
    assert [rank for rank, _, _ in two] == [0, 1]
    assert {digest for _, digest, _ in two} == {expected_digest(2, ITERATIONS)}


def test_a_killed_dask_worker_s_rank_is_placed_again_and_recovers(full: Any) -> None:
    before = set(rabit2.dask._worker_processes(full))
    started = time.monotonic()
    # mock= SIGKILLs rank 1's process (its Dask worker) in its 6th iteration, first attempt
    results = rabit2.dask.run(full, chained_sums, ITERATIONS, config={"mock": "1,5,0,0"})
    assert time.monotonic() - started < 90
    assert [rank for rank, _, _ in results] == list(range(N_WORKERS))
    assert {digest for _, digest, _ in results} == {expected_digest(N_WORKERS, ITERATIONS)}
    assert results[1][2] not in before  # it ran again on the worker its nanny started
    assert results[0][2] in before and results[2][2] in before


def train_xgboost(rounds: int) -> str:
    import xgboost  # noqa: PLC0415

    import rabit2.xgboost as rx  # noqa: PLC0415
    from rabit2.examples.xgboost_train import shard  # noqa: PLC0415

    x, y = shard(rabit2.get_rank(), rabit2.get_world_size(), 3000, 8)
    booster = rx.train({"tree_method": "hist", "max_depth": 4, "objective": "binary:logistic",
                        "nthread": 1}, xgboost.DMatrix(x, y), rounds)
    return hashlib.sha256(bytes(booster.save_raw("json"))).hexdigest()


def test_xgboost_training_survives_a_killed_dask_worker_with_the_same_model(
        full: Any) -> None:
    need_federated_xgboost()
    import rabit2.xgboost as rx  # noqa: PLC0415

    clean = rabit2.dask.run(full, train_xgboost, 6, context=rx.CommunicatorContext)
    assert len(set(clean)) == 1
    all_back(full)
    killed = rabit2.dask.run(full, train_xgboost, 6, context=rx.CommunicatorContext,
                             config={"mock": "2,3,1,0"})
    assert killed == clean


def raises_on_rank_1() -> None:
    data = np.ones(4)
    rabit2.allreduce(data, rabit2.Op.SUM)
    if rabit2.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    rabit2.allreduce(data, rabit2.Op.SUM)  # the others wait here for rank 1


def test_an_exception_in_func_ends_the_job_and_is_raised(full: Any) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad input on rank 1"):
        rabit2.dask.run(full, raises_on_rank_1)
    assert time.monotonic() - started < 30  # at once, not at a deadline, and not retried
    # the workers are free for the next job
    assert rabit2.dask.run(full, rabit2.get_rank) == list(range(N_WORKERS))


def two_errors(delay: float) -> None:
    rank = rabit2.get_rank()
    if rank == 2:
        raise KeyError("rank 2 first")
    if rank == 1:
        time.sleep(delay)
        raise ValueError("rank 1 later")
    rabit2.allreduce(np.ones(2), rabit2.Op.SUM)


def test_the_error_raised_is_the_one_that_ended_the_job(full: Any) -> None:
    """Rank 2's error ends the job; rank 1 raises its own later, unaware: ``run`` raises
    rank 2's, the root cause, not the lowest rank's."""
    with pytest.raises(KeyError, match="rank 2 first"):
        rabit2.dask.run(full, two_errors, 1.0)


def stuck_in_func_on_rank_1() -> int:
    rabit2.allreduce(np.ones(3), rabit2.Op.SUM)
    if rabit2.get_rank() == 1:
        time.sleep(600)  # (user code that no abort reaches)
    return rabit2.get_rank()


def test_a_given_up_job_ends_near_its_timeout_and_frees_a_rank_stuck_in_func(
        full: Any) -> None:
    """``timeout`` ends the job within a few seconds of it, though rank 1 is busy in its own
    code: Dask cannot stop a running task, so its worker is restarted, and the next job
    gets every worker (instead of waiting out its join deadline for the busy one)."""
    started = time.monotonic()
    with pytest.raises(JobAbortedError, match=r"timed out after 4 s; tasks 1 had not returned "
                                              r"\(the Dask workers .* were restarted"):
        rabit2.dask.run(full, stuck_in_func_on_rank_1, timeout=4)
    assert time.monotonic() - started < 4 + 5 + 30  # (the timeout, the grace, a restart)
    all_back(full)
    started = time.monotonic()
    assert rabit2.dask.run(full, rabit2.get_rank) == list(range(N_WORKERS))
    assert time.monotonic() - started < 20


def exits_on_rank_1(how: str = "exit") -> int:
    if rabit2.get_rank() == 1:
        if how == "interrupt":
            raise KeyboardInterrupt("stop")
        sys.exit(2)
    rabit2.allreduce(np.ones(2), rabit2.Op.SUM)
    return rabit2.get_rank()


@pytest.mark.parametrize(("how", "message"), [
    ("exit", r"func called sys.exit\(2\) in rank 1's task"),
    ("interrupt", r"func raised KeyboardInterrupt in rank 1's task"),
])
def test_sys_exit_in_func_ends_the_job_but_not_the_dask_worker(full: Any, how: str,
                                                               message: str) -> None:
    before = full.run(os.getpid)
    with pytest.raises(RuntimeError, match=message):
        rabit2.dask.run(full, exits_on_rank_1, how)
    assert full.run(os.getpid) == before  # (the same worker processes: none ended)


def refuses_task_1(**params: Any) -> Any:
    """A context whose rank 1 fails before it joins (as an init error would)."""
    if params["dmlc_task_id"] == "1":
        raise RuntimeError("no GPU on this worker")
    return rabit2.CommunicatorContext(**params)


def test_an_error_before_a_rank_joins_ends_the_job_at_once(full: Any) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no GPU on this worker"):
        rabit2.dask.run(full, rabit2.get_rank, context=refuses_task_1)
    assert time.monotonic() - started < 20  # (the others do not wait out a deadline)
    assert rabit2.dask.run(full, rabit2.get_rank) == list(range(N_WORKERS))


def test_a_rank_lost_once_too_often_ends_the_job(full: Any) -> None:
    # (recovery is off with one attempt: the survivors may fail on the lost link first)
    with pytest.raises(JobAbortedError, match=r"task 1 failed for good|link to rank 1 lost"):
        rabit2.dask.run(full, chained_sums, ITERATIONS, max_attempts=1,
                        config={"mock": "1,2,0,0"})


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": N_WORKERS + 1}, "a job needs 1 to 3 workers"),
    ({"workers": 0}, "workers=0: a job needs 1 to 3 workers"),
    ({"workers": ["tcp://10.255.255.1:1"]}, "unknown"),
    ({"workers": "__twice__"}, r"named twice: \['tcp://"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"config": {"rabit_timout_sec": 5}}, "rabit_timout_sec"),
    ({"config": {"dmlc_task_id": "7"}}, "may not set dmlc_task_id"),
])
def test_bad_arguments_are_refused_before_anything_runs(full: Any, kwargs: dict[str, Any],
                                                        message: str) -> None:
    if kwargs.get("workers") == "__twice__":
        first = sorted(full.scheduler_info(n_workers=-1)["workers"])[0]
        kwargs = {"workers": [first, first]}
    with pytest.raises(ValueError, match=message):
        rabit2.dask.run(full, rabit2.get_rank, **kwargs)


def test_the_workers_are_asked_of_the_scheduler_not_the_clients_cache(full: Any) -> None:
    """The client's periodic refresh leaves its cached scheduler info without workers; a
    job that read that cache at the wrong moment saw every worker gone and placed every
    rank again while the first ones ran on (they then finished and their second attempts
    were refused as "already shut down")."""
    full._scheduler_identity = {"workers": {}}  # as the refresh leaves it
    full.scheduler_info = lambda *args, **kwargs: full._scheduler_identity
    try:
        assert len(rabit2.dask._worker_processes(full)) == N_WORKERS
    finally:
        del full.scheduler_info


def test_workers_that_share_a_process_are_refused() -> None:
    cluster = distributed.LocalCluster(n_workers=2, processes=False, dashboard_address=":0")
    with cluster, distributed.Client(cluster) as threads, \
            pytest.raises(ValueError, match="share one process"):
        rabit2.dask.run(threads, rabit2.get_rank)


def test_workers_may_be_one_address_and_not_a_bool_or_a_float(full: Any) -> None:
    address = sorted(rabit2.dask._worker_processes(full))[0]
    assert rabit2.dask.run(full, rabit2.get_world_size, workers=address) == [1]
    for bad in (True, 2.0):
        with pytest.raises(TypeError, match="workers must be"):
            rabit2.dask.run(full, rabit2.get_rank, workers=bad)  # type: ignore[arg-type]


def test_workers_may_be_named_as_dask_names_them(full: Any) -> None:
    """By name, or by address without its scheme, as Dask's own ``workers=`` takes them."""
    info = rabit2.dask._worker_processes(full)
    first, second = sorted(info)[:2]
    by_name = [info[second]["name"], info[first]["name"]]
    where = rabit2.dask.run(full, lambda: distributed.get_worker().address, workers=by_name)
    assert where == [second, first]
    bare = first.partition("://")[2]
    assert rabit2.dask.run(full, lambda: distributed.get_worker().address,
                           workers=[bare]) == [first]


def test_a_closed_client_is_refused() -> None:
    cluster = distributed.LocalCluster(n_workers=1, processes=True, dashboard_address=":0")
    with cluster:
        closed = distributed.Client(cluster)
        closed.close()
        with pytest.raises(ValueError, match="client is closed"):
            rabit2.dask.run(closed, rabit2.get_rank)


def test_an_asynchronous_client_is_refused(full: Any) -> None:
    async def main() -> None:
        async with distributed.Client(full.scheduler.address, asynchronous=True) as client:
            with pytest.raises(ValueError, match="needs a Client made with asynchronous=False"):
                rabit2.dask.run(client, rabit2.get_rank)

    asyncio.run(main())


def test_two_jobs_started_at_once_from_one_process_queue_one_after_the_other(
        full: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs on the same two single-thread workers, named in opposite orders.  Their
    ranks, submitted interleaved, held one worker each while waiting for the other's (until
    the join deadline); one job's ranks are now all queued before the other's.  (Each
    submission is slowed down here, so that the interleaving the lock prevents would
    happen.)"""
    submit = rabit2.dask._Job._submit

    def slowly(job: Any, rank: Any, address: str) -> None:
        submit(job, rank, address)
        time.sleep(0.3)

    monkeypatch.setattr(rabit2.dask._Job, "_submit", slowly)
    monkeypatch.setattr(rabit2.dask, "JOIN_TIMEOUT_SEC", 10.0)
    first, second = sorted(full.scheduler_info(n_workers=-1)["workers"])[:2]
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(rabit2.dask.run, full, _sum_after_a_while, 0.5, workers=order,
                            timeout=60) for order in ([first, second], [second, first])]
        assert [job.result(timeout=90) for job in jobs] == [[2.0, 2.0], [2.0, 2.0]]


def _sum_after_a_while(seconds: float) -> float:
    time.sleep(seconds)  # (the other job's ranks are placed meanwhile)
    data = np.ones(1)
    rabit2.allreduce(data, rabit2.Op.SUM)
    return float(data[0])


def test_two_jobs_at_once_on_workers_with_two_threads_fail_clearly_not_hang() -> None:
    """A worker with two threads may run a rank of each of two jobs at once, and a process
    joins one job at a time: a rank of the second job fails at once, naming that, instead of
    joining the first job's communicator (which hung, or mixed the jobs' calls)."""
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                                       dashboard_address=":0")
    with cluster, distributed.Client(cluster) as busy, ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        jobs = [pool.submit(rabit2.dask.run, busy, _sum_after_a_while, 2.0, timeout=60)
                for _ in range(2)]
        refused = 0
        for job in jobs:
            try:
                assert job.result(timeout=90) == [2.0, 2.0]
            except RuntimeError as exc:
                assert "a process joins one job at a time" in str(exc)
                refused += 1
        assert refused >= 1
        assert time.monotonic() - started < 60
        assert rabit2.dask.run(busy, _sum_after_a_while, 0.0) == [2.0, 2.0]  # (released)


def test_a_rank_that_cannot_start_ends_the_job_at_its_join_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose only thread is busy never starts its rank: the job ends when the join
    deadline passes, naming it, without waiting out the grace given to tasks that joined."""
    monkeypatch.setattr(rabit2.dask, "JOIN_TIMEOUT_SEC", 3.0)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=":0")
    with cluster, distributed.Client(cluster) as busy:
        second = sorted(busy.scheduler_info(n_workers=-1)["workers"])[1]
        blocker = busy.submit(time.sleep, 40, workers=[second], pure=False)
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(JobAbortedError, match="did not join the job within 3 s"):
            rabit2.dask.run(busy, rabit2.get_rank, timeout=60)
        assert time.monotonic() - started < 20
        busy.cancel(blocker)
