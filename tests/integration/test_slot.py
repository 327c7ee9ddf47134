"""tracker.slot, the per-slot supervisor that gives srun/mpirun jobs rabit2-submit's
restarts: real processes, a real tracker, and (where Open MPI is installed) real mpirun."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.jobs import assert_gone, assert_one_model, wait_until
from tracker.server import TrackerThread
from tracker.slot import restart_refused

pytestmark = pytest.mark.timeout(120)

SECRET = bytes(range(32))


def slot(*command: str, env: dict[str, str], attempts: int = 3,
         **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tracker.slot", "--max-attempts", str(attempts),
         "--kill-grace", "0.5", "--", *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,  # type: ignore[call-overload]
    )


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "RABIT2_", "SLURM_", "OMPI_", "PMI"))}
    env.update(extra)
    return env


FLAKY = (
    "import os, sys\n"
    "print(os.environ['DMLC_TASK_ID'], os.environ['DMLC_NUM_ATTEMPT'],\n"
    "      os.environ['RABIT2_RECOVER'], flush=True)\n"
    "sys.exit(0 if int(os.environ['DMLC_NUM_ATTEMPT']) >= int(sys.argv[1]) else 3)\n"
)


def test_a_failing_worker_is_run_again_with_its_attempt_number() -> None:
    proc = slot(sys.executable, "-c", FLAKY, "2", env=base_env(SLURM_PROCID="5"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split("\n")[:3] == ["5 0 1", "5 1 1", "5 2 1"]  # srun's index, recovery on
    assert err.count("restarting") == 2 and "attempt 1/3" in err


def test_attempts_are_bounded_and_the_last_status_is_returned() -> None:
    proc = slot(sys.executable, "-c", FLAKY, "9", env=base_env(DMLC_TASK_ID="a",
                                                               DMLC_NUM_ATTEMPT="4"),
                attempts=2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert out.split() == ["a", "4", "1", "a", "5", "1"]  # numbering continues from 4
    assert "exited with 3 after 2 attempts; giving up" in err


def test_one_attempt_means_recovery_off_and_no_restart() -> None:
    proc = slot(sys.executable, "-c", FLAKY, "1", env=base_env(PMI_RANK="0"), attempts=1)
    out, _err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out.split() == ["0", "0", "0"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--", sys.executable, "-c", "pass"], {}, "no task id"),
        (["--max-attempts", "0", "--", "x"], {"DMLC_TASK_ID": "0"}, "--max-attempts"),
        (["--"], {"DMLC_TASK_ID": "0"}, "no command"),
        (["--", "x"], {"DMLC_TASK_ID": "0", "DMLC_NUM_ATTEMPT": "one"}, "not an integer"),
        (["--watch", "-1", "--", "x"], {"DMLC_TASK_ID": "0"}, "--watch must be >= 0"),
    ],
)
def test_usage_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tracker.slot", *argv], env=base_env(**env),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and message in done.stderr


def test_the_launcher_signalling_the_task_stops_it_and_nothing_restarts(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{child.pid}}\\n')\n"
        "time.sleep(300)\n"
    )
    # as srun and mpirun start a task: a process group of its own, which they signal
    proc = slot(sys.executable, "-c", script, env=base_env(DMLC_TASK_ID="0"),
                start_new_session=True)
    wait_until(pids.exists, 30, proc, "the worker")
    os.killpg(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "restarting" not in err
    assert len(pids.read_text().splitlines()) == 1  # one run only
    assert_gone(map(int, pids.read_text().split()), 10)


def test_no_restart_once_the_job_is_over_or_the_tracker_is_gone() -> None:
    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        env = base_env(DMLC_TASK_ID="1", **tracker.worker_env())
        assert restart_refused(env, "1") is None  # the job runs: a restart helps
        tracker.abort("test says stop")
        deadline = time.monotonic() + 10
        while tracker.result() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        why = restart_refused(env, "1")
        assert why is not None and "the job is over" in why and "test says stop" in why
        proc = slot(sys.executable, "-c", "import sys; sys.exit(1)", env=env)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert "not restarting: the job is over" in err and "restarting\n" not in err
    finally:
        tracker.stop()
    started = time.monotonic()
    why = restart_refused(env, "1", patience=1.0)
    assert why is not None and "cannot be asked" in why
    assert time.monotonic() - started < 5  # asked again for about a second, then refused
    assert restart_refused(base_env(), "1") is None  # no tracker at all: nothing to ask


def test_a_tracker_that_refuses_the_exit_report_still_allows_the_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker of an older rabit2 closes a monitor connection that sends ``exited``: the
    slot then asks without it, and the restart goes ahead."""
    from rabit2.errors import ProtocolError  # noqa: PLC0415
    from tracker.registry import Registry  # noqa: PLC0415

    def refuse(self: object, task_id: str, attempt: int) -> list[object]:
        raise ProtocolError("a monitor connection may only send status or give_up, not exited")

    monkeypatch.setattr(Registry, "exit_reported", refuse)
    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        env = base_env(DMLC_TASK_ID="1", **tracker.worker_env())
        started = time.monotonic()
        assert restart_refused(env, "1", exited=0) is None
        assert time.monotonic() - started < 5  # (not refused after 10 s of asking)
    finally:
        tracker.stop()


def test_a_tracker_blip_does_not_refuse_a_restart() -> None:
    """The tracker cannot be reached for a second (here: it is not up yet): the slot asks
    again with backoff and, once it answers, restarts the worker."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tracker = TrackerThread(2, host="127.0.0.1", port=port, secret=SECRET)
    env = base_env(DMLC_TASK_ID="1", DMLC_TRACKER_URI="127.0.0.1",
                   DMLC_TRACKER_PORT=str(port), RABIT2_SECRET=SECRET.hex())
    timer = threading.Timer(1.0, tracker.start)
    timer.start()
    try:
        started = time.monotonic()
        assert restart_refused(env, "1", patience=10.0) is None
        assert time.monotonic() - started >= 0.9
    finally:
        timer.join()
        tracker.stop()


MPIRUN = shutil.which("mpirun")


@pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_job_recovers_a_killed_worker_through_the_slot() -> None:
    """rabit2-tracker's variables + mpirun + tracker.slot: Open MPI starts the workers (task
    ids from OMPI_COMM_WORLD_RANK), a worker killed by mock= is restarted by its slot,
    rejoins and replays; every rank ends with the same model."""
    tracker = TrackerThread(4, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        job = tracker.worker_env()
        forward = [arg for key in job for arg in ("-x", key)]
        argv = [MPIRUN, "-n", "4", "--oversubscribe", *forward,
                sys.executable, "-m", "tracker.slot", "--", sys.executable, "-m",
                "rabit2.examples.gbdt", "--size", "ci", "mock=2,3,1,0"]
        if os.geteuid() == 0:
            argv.insert(1, "--allow-run-as-root")
        done = subprocess.run(argv, env=base_env(**job), capture_output=True, text=True,
                              timeout=100, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert_one_model(done.stdout, 4)
        assert "[rabit2 slot 2] exited with 137 (attempt 1/3); restarting" in done.stderr
        result = tracker.join(30)
        assert result is not None and result.success
    finally:
        tracker.stop()


def test_no_restart_of_a_task_that_shut_down_with_the_tracker() -> None:
    """A worker that told the tracker it is done and then failed has failed for good (the
    tracker would refuse its replacement), as rabit2-submit decides too."""
    import asyncio  # noqa: PLC0415

    from rabit2.config import load_config  # noqa: PLC0415
    from rabit2.io.tracker_client import TrackerClient  # noqa: PLC0415

    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        env = base_env(**tracker.worker_env())

        async def finish_task_0() -> None:
            cfg = load_config(environ={**env, "DMLC_TASK_ID": "0"})
            client = await TrackerClient.connect(cfg, 20001)
            await client.shutdown(5)  # before rank assignment: the task is done

        asyncio.run(finish_task_0())
        why = restart_refused(env, "0")
        assert why is not None and "failed for good" in why
        assert restart_refused(env, "1") is None  # the other task may still come
    finally:
        tracker.stop()


def test_giving_up_aborts_the_job_at_the_tracker() -> None:
    """Out of attempts, the slot tells the tracker (give_up), which aborts the job, as
    rabit2-submit does when a task has used up its attempts."""
    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        env = base_env(DMLC_TASK_ID="1", **tracker.worker_env())
        proc = slot(sys.executable, "-c", "import sys; sys.exit(4)", env=env, attempts=2)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 4 and "giving up" in err
        result = tracker.join(10)
        assert result is not None and not result.success
        assert "task 1 failed for good: exited with 4 after 2 attempts" in result.reason
    finally:
        tracker.stop()


def test_without_recovery_a_worker_that_had_a_rank_is_not_restarted() -> None:
    """``RABIT2_RECOVER=0`` with attempts left: the worker that exits 7 after its first call
    is not restarted (its restarts failed to reach the survivors, and the job ended naming
    their failures, not the exit); the slot ends the job naming the exit."""
    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    code = ("import os, numpy as np, rabit2\n"
            "rabit2.init()\n"
            "rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
            "if rabit2.get_rank() == 1:\n"
            "    os._exit(7)\n"
            "try:\n"
            "    rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
            "except rabit2.RabitError as exc:\n"
            "    print('FAILED', type(exc).__name__, exc, flush=True)\n"
            "    raise SystemExit(3)\n")
    try:
        env = base_env(RABIT2_RECOVER="0", **tracker.worker_env())
        procs = [slot(sys.executable, "-c", code, env={**env, "DMLC_TASK_ID": str(task)})
                 for task in (0, 1)]
        _, err1 = [proc.communicate(timeout=90) for proc in procs][1]
        assert procs[1].returncode == 7, err1
        assert "not restarting: the job runs without recovery" in err1, err1
        assert "restarting\n" not in err1 and "attempt 1/3" not in err1, err1
        result = tracker.join(10)
        assert result is not None and not result.success
        assert "exited with 7; the job runs without recovery" in result.reason, result.reason
    finally:
        tracker.stop()


def test_a_signal_to_the_slot_alone_stops_the_worker(tmp_path: Path) -> None:
    """SIGTERM to the supervisor only (not its group): it passes it on to the worker, and
    does not restart it."""
    marker = tmp_path / "up"
    script = f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(300)\n"
    proc = slot(sys.executable, "-c", script, env=base_env(DMLC_TASK_ID="0"),
                start_new_session=True)
    wait_until(marker.exists, 30, proc, "the worker")
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "restarting" not in err


RUN_AND_DIE_ONCE = (
    "import os, sys, time\n"
    "import numpy as np\n"
    "import rabit2\n"
    "rabit2.init()\n"
    "if os.environ['DMLC_TASK_ID'] == '0' and os.environ['DMLC_NUM_ATTEMPT'] == '0':\n"
    "    with open(sys.argv[1], 'w') as f:\n"
    "        f.write(repr(time.monotonic()))\n"
    "    os._exit(3)\n"
    "x = np.ones(4, np.float32)\n"
    "rabit2.allreduce(x, rabit2.Op.SUM)\n"
    "assert x.tolist() == [2.0] * 4, x\n"
    "rabit2.finalize()\n"
)


def test_the_slot_reports_the_exit_so_the_loss_is_known_before_the_restart(
        tmp_path: Path) -> None:
    """A worker dies after it registered; its slot waits 4 s before the restart. The slot
    tells the tracker that the run ended, so the loss is declared within moments of the exit
    (without that, only when the restart registers or the 5 s rejoin grace ends); the
    restart then rejoins and the job finishes."""
    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    marker = tmp_path / "died"
    procs: list[subprocess.Popen[str]] = []
    try:
        env = base_env(**tracker.worker_env())
        victim = subprocess.Popen(
            [sys.executable, "-m", "tracker.slot", "--max-attempts", "2", "--restart-delay",
             "4", "--", sys.executable, "-c", RUN_AND_DIE_ONCE, str(marker)],
            env={**env, "DMLC_TASK_ID": "0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        survivor = subprocess.Popen(
            [sys.executable, "-c", RUN_AND_DIE_ONCE, str(marker)],
            env={**env, "DMLC_TASK_ID": "1", "RABIT2_RECOVER": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        procs += [victim, survivor]
        wait_until(marker.exists, 60, victim, "the first run's death")
        wait_until(lambda: tracker.first_loss is not None, 10, victim, "the loss")
        declared = time.monotonic()
        died = float(marker.read_text() or "nan")
        assert declared - died < 2.5, (declared - died, tracker.first_loss)
        for proc in (victim, survivor):
            _out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        result = tracker.join(30)
        assert result is not None and result.success
    finally:
        for proc in procs:  # (a failed assertion: a slot stops its worker on SIGTERM)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate(timeout=15)
        tracker.stop()


@pytest.mark.parametrize("joined", [False, True], ids=["before-init", "without-finalize"])
def test_a_program_that_ends_with_0_while_the_job_needs_it_ends_the_job(joined: bool) -> None:
    """Status 0 is no failure to restart, but the other workers would wait for this one
    until their deadlines: the slot tells the tracker, which ends the job naming it (as
    rabit2-submit does for its own workers)."""
    import asyncio  # noqa: PLC0415

    from rabit2.config import load_config  # noqa: PLC0415
    from rabit2.io.tracker_client import TrackerClient  # noqa: PLC0415

    tracker = TrackerThread(2, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        env = base_env(**tracker.worker_env())

        async def join(task: str) -> TrackerClient:
            return await TrackerClient.connect(load_config(environ={**env, "DMLC_TASK_ID": task}),
                                               20000 + int(task))

        async def scenario() -> tuple[int, str]:
            other = await join("0")  # the other worker joined and waits
            code = ("import asyncio, sys\n"
                    "from rabit2.config import load_config\n"
                    "from rabit2.io.tracker_client import TrackerClient\n"
                    "async def main():\n"
                    "    c = await TrackerClient.connect(load_config(), 20001)\n"
                    "    await c.wait_assignment(10)\n"
                    "asyncio.run(main())\n") if joined else "pass"
            proc = slot(sys.executable, "-c", code, env={**env, "DMLC_TASK_ID": "1"})
            _out, err = await asyncio.to_thread(proc.communicate, timeout=60)
            await other.close()
            return proc.returncode, err

        started = time.monotonic()
        code, err = asyncio.run(scenario())
        assert code == 0, err
        result = tracker.join(10)
        assert result is not None and not result.success, result
        said = ("without rabit2.finalize() while the job ran" if joined
                else "without joining the job (rabit2.init), which the others joined")
        assert said in result.reason and said in err, (result.reason, err)
        assert "restarting" not in err
        assert time.monotonic() - started < 20
    finally:
        tracker.stop()


def test_a_program_that_ends_with_0_after_the_job_ended_says_nothing() -> None:
    tracker = TrackerThread(1, host="127.0.0.1", port=0, secret=SECRET)
    tracker.start()
    try:
        env = base_env(DMLC_TASK_ID="0", **tracker.worker_env())
        code = ("import asyncio\n"
                "from rabit2.config import load_config\n"
                "from rabit2.io.tracker_client import TrackerClient\n"
                "async def main():\n"
                "    c = await TrackerClient.connect(load_config(), 20000)\n"
                "    await c.wait_assignment(10)\n"
                "    await c.shutdown(10)\n"
                "asyncio.run(main())\n")
        proc = slot(sys.executable, "-c", code, env=env)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "ending the job" not in err, err
        result = tracker.join(10)
        assert result is not None and result.success, result
    finally:
        tracker.stop()
