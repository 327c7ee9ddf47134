"""Workers of the classic rabit protocol (XGBoost 1.x/2.0) rendezvous through rabit2's tracker.

The real thing: ``xgboost==1.7.6`` (with ``numpy<2``) in a virtual environment the tests
build once and keep (``$RABIT2_TEST_CACHE``, default ``~/.cache/rabit2-tests``); skipped,
with pip's reason, where it cannot be built.  Its models are compared byte for byte with the
same job under XGBoost 1.7's own tracker.  The protocol checks need no XGBoost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tracker.classic import CLASSIC_MAGIC
from tracker.server import Tracker

CACHE = Path(os.environ.get("RABIT2_TEST_CACHE", Path.home() / ".cache" / "rabit2-tests"))
SECRET = bytes(range(32))

WORKER = textwrap.dedent("""
    import os, sys
    import numpy as np
    import xgboost as xgb
    from xgboost import rabit

    rabit.init()
    rank, world = rabit.get_rank(), rabit.get_world_size()
    if rank == 1 and os.environ.get("CRASH_FIRST") and os.environ.get("DMLC_NUM_ATTEMPT") == "0":
        os._exit(3)  # dies on its first attempt, after it joined
    mode = os.environ.get("LEAVE")
    leave = mode if rank == 1 else None
    if leave == "without-finalize":
        sys.exit(0)  # a program that ends while the job still needs it
    rng = np.random.default_rng(rank)
    X = rng.standard_normal((2000, 10))
    y = (X[:, 0] + 0.3 * X[:, 1] + 0.1 * rng.standard_normal(2000) > 0).astype(float)
    bst = xgb.train({"tree_method": "hist", "objective": "binary:logistic", "max_depth": 4,
                     "nthread": 1}, xgb.DMatrix(X, label=y), 5)
    rabit.tracker_print(f"rank {rank} of {world} trained")
    if rank == 0:
        bst.save_model(sys.argv[1])
    if mode == "failing-after-finalize" and rank == 0:
        import time
        time.sleep(3)  # (still in the job when rank 1 exits)
    rabit.finalize()
    if leave == "failing-after-finalize":
        sys.exit(5)  # done for good: no restart could rejoin the job
""")

OWN_TRACKER = textwrap.dedent("""
    import os, subprocess, sys
    from xgboost.tracker import RabitTracker

    n, out, worker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    tracker = RabitTracker(host_ip="127.0.0.1", n_workers=n, sortby="task")
    tracker.start(n)
    env = {**os.environ, **{k: str(v) for k, v in tracker.worker_envs().items()}}
    procs = [subprocess.Popen([sys.executable, worker, out],
                              env={**env, "DMLC_TASK_ID": str(i)}) for i in range(n)]
    codes = [p.wait(120) for p in procs]
    tracker.join()
    sys.exit(max(codes))
""")


@pytest.fixture(scope="module")
def xgb17() -> Path:
    """The Python of a virtual environment with xgboost 1.7.6 (built once, then reused)."""
    return xgb17_python()


def xgb17_python() -> Path:
    """(For other test modules too: builds the environment or skips the test.)"""
    venv = CACHE / "xgboost-1.7.6"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", "numpy<2", "scipy",
                  "xgboost==1.7.6"]]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                                  check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot build an xgboost 1.7.6 environment: "
                            f"{(done.stderr or done.stdout).strip()[-300:]}")
        (venv / "ready").write_text("ok\n")
    return python


def _scripts(tmp_path: Path) -> tuple[Path, Path]:
    worker, own = tmp_path / "worker.py", tmp_path / "own_tracker.py"
    worker.write_text(WORKER)
    own.write_text(OWN_TRACKER)
    return worker, own


def _submit(python: Path, worker: Path, model: Path, n: int,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", str(n),
         "--timeout", "150", "--", str(python), str(worker), str(model)],
        capture_output=True, text=True, timeout=200, check=False, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _summary(stderr: str) -> dict[int, tuple[str, int, str]]:
    """task -> (rank, attempts, status) from the launcher's table."""
    _, _, table = stderr.partition("[rabit2-submit] summary:")
    return {int(task): (rank, int(attempts), status) for task, rank, attempts, _, status
            in re.findall(r"^(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\w+)$", table, re.M)}


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_xgboost_1_7_trains_under_rabit2_submit_as_under_its_own_tracker(
        xgb17: Path, tmp_path: Path) -> None:
    worker, own = _scripts(tmp_path)
    theirs, ours = tmp_path / "theirs.json", tmp_path / "ours.json"
    done = subprocess.run([str(xgb17), str(own), "3", str(theirs), str(worker)],
                          capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    job = _submit(xgb17, worker, ours, 3)
    assert job.returncode == 0, job.stdout + job.stderr
    assert ours.read_bytes() == theirs.read_bytes()  # the same model, byte for byte
    for rank in range(3):
        assert f"[rank {rank}] rank {rank} of 3 trained" in job.stdout, job.stdout
    assert _summary(job.stderr) == {t: (str(t), 1, "ok") for t in range(3)}, job.stderr
    assert "job: every rank shut down" in job.stderr


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_a_lost_xgboost_1_7_worker_is_restarted_with_its_job(
        xgb17: Path, tmp_path: Path) -> None:
    """XGBoost 1.7's engine has no recovery: when rank 1 dies, its peers fail too, and the
    launcher restarts them all; they get their ranks back by task id and train again."""
    worker, _ = _scripts(tmp_path)
    plain, crashed = tmp_path / "plain.json", tmp_path / "crashed.json"
    assert _submit(xgb17, worker, plain, 3).returncode == 0
    job = _submit(xgb17, worker, crashed, 3, {"CRASH_FIRST": "1"})
    assert job.returncode == 0, job.stdout + job.stderr
    assert crashed.read_bytes() == plain.read_bytes()
    rows = _summary(job.stderr)
    assert rows[1] == ("1", 2, "ok"), job.stderr
    assert all(status == "ok" for _, _, status in rows.values()), job.stderr


@pytest.mark.integration
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("leave", "said"), [
    ("without-finalize", "task 1 exited with 0 without rabit2.finalize() while the job ran"),
    ("failing-after-finalize", "task 1 exited with 5 after shutting down; not restarting it"),
])
def test_the_launcher_sees_classic_workers_join_and_finish(
        xgb17: Path, tmp_path: Path, leave: str, said: str) -> None:
    """The launcher's judgement of a task that ended rests on whether it joined and whether
    it finished: classic workers tell the tracker both, as rabit2 workers do."""
    worker, _ = _scripts(tmp_path)
    started = time.monotonic()
    job = _submit(xgb17, worker, tmp_path / "model.json", 2, {"LEAVE": leave})
    assert job.returncode != 0, job.stdout + job.stderr
    assert said in job.stderr, job.stderr
    assert not re.search(r"task 1 exited with \d+ \(attempt", job.stderr), job.stderr  # (restarts)
    if leave == "without-finalize":  # (the job is given up on: no abort reaches a
        # classic worker, so the launcher stops the others at once)
        assert ("speak the classic rabit protocol, which has no abort; stopping them"
                in job.stderr), job.stderr
    assert time.monotonic() - started < 30  # (not the job's 150 s timeout, nor a grace)


# ----------------------------------------------------------------------------- protocol


async def _classic_start(port: int) -> bytes:
    """The first message of a classic worker's start; what the tracker answers (b"" when
    it closes the connection)."""
    try:
        reader, writer = await _start_as(port, b"0")
    except ConnectionResetError:
        return b""
    try:
        return await asyncio.wait_for(reader.read(4), 5)
    except ConnectionResetError:
        return b""  # (closed with our bytes unread: a reset)
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_a_classic_worker_is_refused_at_once_where_it_is_not_served(
        caplog: pytest.LogCaptureFixture) -> None:
    tracker = Tracker(1, secret=SECRET, classic="none")
    await tracker.start()
    try:
        assert await _classic_start(tracker.port) == b""  # closed: no silent wait
        assert any("classic rabit worker" in r.message and "refused" in r.message
                   for r in caplog.records)
    finally:
        await tracker.close()


@pytest.mark.asyncio
async def test_a_job_speaks_one_protocol(caplog: pytest.LogCaptureFixture) -> None:
    """A classic worker that meets a job of rabit2 workers, and a rabit2 worker that meets a
    job of classic ones, are told so, naming the mismatch."""
    from rabit2.config import Config  # noqa: PLC0415
    from rabit2.errors import TrackerError  # noqa: PLC0415
    from rabit2.io.tracker_client import TrackerClient  # noqa: PLC0415

    tracker = Tracker(2, secret=SECRET)
    await tracker.start()
    try:
        cfg = Config(tracker_uri="127.0.0.1", tracker_port=tracker.port, task_id="0",
                     secret=SECRET, connect_retry=1)
        client = await TrackerClient.connect(cfg, 20000)
        await asyncio.sleep(0.2)
        assert await _classic_start(tracker.port) == b""
        assert any("speak rabit2's protocol" in r.message for r in caplog.records)
        await client.close()
    finally:
        await tracker.close()
    tracker = Tracker(2, secret=SECRET)
    await tracker.start()
    try:
        # (a classic start, parked until the job has all its workers)
        reader, writer = await _start_as(tracker.port, b"0")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == CLASSIC_MAGIC
        cfg = Config(tracker_uri="127.0.0.1", tracker_port=tracker.port, task_id="1",
                     secret=SECRET, connect_retry=1)
        client = await TrackerClient.connect(cfg, 20001)
        with pytest.raises(TrackerError, match="classic rabit protocol"):
            await client.wait_assignment(5)
        await client.close()
        # a classic start that left while it waited does not make the job a classic one
        writer.close()
        await asyncio.sleep(0.3)
        cfg = dataclasses.replace(cfg, task_id="0")
        clients = [await TrackerClient.connect(cfg, 20002),
                   await TrackerClient.connect(dataclasses.replace(cfg, task_id="1"), 20003)]
        assert sorted([(await c.wait_assignment(5)).rank for c in clients]) == [0, 1]
        for c in clients:
            await c.close()
    finally:
        await tracker.close()


@pytest.mark.asyncio
async def test_a_rank_no_worker_holds_cannot_end_a_job_with_the_classic_protocol() -> None:
    """Two classic ``shutdown`` messages, from ranks never handed out, with no secret, ended
    a job that had no worker yet as a success; and a ``recover`` from such a rank took its
    place.  Both are refused now, and the job waits for its workers."""
    tracker = Tracker(2, secret=SECRET)
    await tracker.start()
    try:
        for rank, command in ((0, b"shutdown"), (1, b"shutdown"), (1, b"recover")):
            reader, writer = await asyncio.open_connection("127.0.0.1", tracker.port)
            writer.write(CLASSIC_MAGIC + rank.to_bytes(4, "little", signed=True)
                         + (-1).to_bytes(4, "little", signed=True)
                         + (4).to_bytes(4, "little") + b"evil"
                         + len(command).to_bytes(4, "little") + command)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(64), 5) == CLASSIC_MAGIC
            writer.close()
        await asyncio.sleep(0.3)
        assert tracker.result is None  # (the job did not end)
        assert not tracker.classic
    finally:
        await tracker.close()



async def _start_as(port: int, task: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A classic worker's start as task ``task``, its answer not read yet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    command = b"start"
    writer.write(CLASSIC_MAGIC + (-1).to_bytes(4, "little", signed=True) * 2
                 + len(task).to_bytes(4, "little") + task
                 + len(command).to_bytes(4, "little") + command)
    await writer.drain()
    return reader, writer


async def _rank_of(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """The rank a started worker is given, once it has answered the rest of the tracker's
    conversation as a worker that holds no links yet and reaches every peer it is told to
    dial (the tracker serves one worker's conversation at a time)."""
    async def ints(count: int) -> list[int]:
        data = await asyncio.wait_for(reader.readexactly(4 * count), 5)
        return [int.from_bytes(data[i:i + 4], "little", signed=True)
                for i in range(0, len(data), 4)]

    def send(*values: int) -> None:
        writer.write(b"".join(v.to_bytes(4, "little", signed=True) for v in values))

    magic, rank, _parent, _world, tree = await ints(5)
    assert magic.to_bytes(4, "little", signed=True) == CLASSIC_MAGIC
    await ints(tree + 2)  # the tree neighbours, the ring's previous and next
    send(0)  # holds no links
    dial, _accept = await ints(2)
    for _ in range(dial):
        (size,) = await ints(1)
        await asyncio.wait_for(reader.readexactly(size), 5)  # the host
        await ints(2)  # its port and rank
    send(0, 9000 + rank)  # reached them all; listens there
    await writer.drain()
    return rank


@pytest.mark.asyncio
async def test_a_classic_start_parked_for_the_others_ends_with_an_aborted_job() -> None:
    """The classic protocol has no abort message: a worker that waits for the others to
    start when the job is given up on has its connection closed at once (its start fails),
    and a start that comes later is refused, instead of both waiting for the launcher to
    stop them."""
    tracker = Tracker(2, secret=SECRET)
    await tracker.start()
    try:
        reader, writer = await _start_as(tracker.port, b"0")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == CLASSIC_MAGIC
        await asyncio.sleep(0.2)  # (parked: task 1 has not started)
        tracker.abort("task 1 failed for good")
        assert await asyncio.wait_for(reader.read(4), 5) == b""  # closed, nothing sent
        writer.close()
        assert await _classic_start(tracker.port) == b""
    finally:
        await tracker.close()


@pytest.mark.asyncio
async def test_a_classic_worker_lost_while_it_waits_for_the_others_hangs_nobody() -> None:
    """Task 1 starts and dies while it waits, and its restart comes before task 0: every
    worker gets its rank, by task id, at once."""
    tracker = Tracker(3, secret=SECRET)
    await tracker.start()
    conns = []
    try:
        conns.append(await _start_as(tracker.port, b"2"))
        _, lost = await _start_as(tracker.port, b"1")
        await asyncio.sleep(0.2)
        lost.close()  # (the process died: its socket closes)
        await asyncio.sleep(0.3)
        conns.append(await _start_as(tracker.port, b"1"))
        conns.append(await _start_as(tracker.port, b"0"))
        ranks = await asyncio.gather(*(_rank_of(reader, writer) for reader, writer in conns))
        assert ranks == [2, 1, 0]
    finally:
        for _, writer in conns:
            writer.close()
        await tracker.close()


@pytest.mark.asyncio
async def test_a_classic_job_without_task_ids_stays_classic_once_ranked() -> None:
    """XGBoost's own launchers give no DMLC_TASK_ID: the job is still a classic one after
    the ranks are handed out (its status says so, and a rabit2 worker is refused)."""
    tracker = Tracker(2, secret=SECRET)
    await tracker.start()
    conns = []
    try:
        conns = [await _start_as(tracker.port, b"NULL") for _ in range(2)]
        ranks = await asyncio.gather(*(_rank_of(reader, writer) for reader, writer in conns))
        assert sorted(ranks) == [0, 1]
        status = tracker.status()
        assert status.get("protocol") == "classic"
        assert sorted(task["rank"] for task in status["tasks"]) == [0, 1]
    finally:
        for _, writer in conns:
            writer.close()
        await tracker.close()
