"""The local launcher (tracker.submit): parsing, env, summary, and real worker processes.

The workers are tiny Python scripts that talk to the tracker through ``TrackerClient``.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tracker.submit import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    LaunchOptions,
    TaskRun,
    build_worker_env,
    format_summary,
    parse_args,
    run_job,
)

pytestmark = pytest.mark.timeout(60)

WORKER = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    from pathlib import Path
    from rabit2.config import load_config
    from rabit2.io.tracker_client import TrackerClient

    MODE, PIDDIR = sys.argv[1], Path(sys.argv[2])

    async def main() -> int:
        cfg = load_config()
        task, attempt = int(cfg.task_id), cfg.num_attempt
        (PIDDIR / f"{task}.{attempt}.pid").write_text(str(os.getpid()))
        print(f"argv {sys.argv[3:]} role {os.environ['DMLC_ROLE']} extra "
              f"{os.environ.get('EXTRA')}", flush=True)
        if MODE == "always-fail" and task == 1:
            print("giving up", file=sys.stderr, flush=True)
            return 3
        if MODE == "hang" or (MODE == "always-fail" and task == 0):
            # a stuck worker that even ignores SIGTERM: only SIGKILL ends it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(0.1)
        client = await TrackerClient.connect(cfg, 20000 + task)
        assignment = await client.wait_assignment(30)
        client.print(f"assigned rank {assignment.rank} incarnation {assignment.incarnation}")
        if MODE == "fail-first" and task == 1 and attempt == 0:
            return 1  # dies without shutdown: the tracker sees the loss
        await client.shutdown(10)
        return 0

    sys.exit(asyncio.run(main()))
    """
)


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "pids").mkdir()
    return script


def options(worker: Path, mode: str, n: int = 2, **kwargs: object) -> LaunchOptions:
    values: dict[str, object] = {
        "num_workers": n,
        "command": (sys.executable, str(worker), mode, str(worker.parent / "pids"), "k=v"),
        "kill_grace": 0.5,
    }
    values.update(kwargs)
    return LaunchOptions(**values)  # type: ignore[arg-type]


def assert_all_dead(pid_dir: Path) -> None:
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- pure parts -------------------------------------------------------------------------------


def test_parse_args() -> None:
    opts = parse_args(["--cluster", "local", "-n", "3", "--max-attempts", "2", "--env", "A=1=2",
                       "--timeout", "9", "--", "python", "train.py", "rabit_x=1", "--flag"])
    assert opts.num_workers == 3 and opts.max_attempts == 2 and opts.timeout == 9
    assert opts.env == (("A", "1=2"),)
    assert opts.command == ("python", "train.py", "rabit_x=1", "--flag")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cluster", "slurm", "-n", "2", "--", "x"], "available: local"),
        (["-n", "0", "--", "x"], "-n must be"),
        (["-n", "2"], "no command"),
        (["-n", "2", "--env", "novalue", "--", "x"], "K=V"),
        (["-n", "2", "--max-attempts", "0", "--", "x"], "max-attempts"),
    ],
)
def test_parse_args_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_build_worker_env() -> None:
    tracker_env = {"DMLC_TRACKER_URI": "127.0.0.1", "DMLC_TRACKER_PORT": "9",
                   "DMLC_NUM_WORKER": "4", "RABIT2_SECRET": "ab"}
    env = build_worker_env({"PATH": "/bin", "DMLC_TASK_ID": "stale"}, tracker_env, 2, 1,
                           [("RABIT2_HEARTBEAT_SEC", "0.5")])
    assert env["PATH"] == "/bin"
    assert env["DMLC_TASK_ID"] == "2" and env["DMLC_NUM_ATTEMPT"] == "1"
    assert env["DMLC_ROLE"] == "worker" and env["RABIT2_SECRET"] == "ab"
    assert env["DMLC_NUM_WORKER"] == "4" and env["RABIT2_HEARTBEAT_SEC"] == "0.5"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_recovery_is_on_when_the_launcher_restarts_workers() -> None:
    assert build_worker_env({}, {}, 0, 0, recover=True)["RABIT2_RECOVER"] == "1"
    assert build_worker_env({}, {}, 0, 0, recover=False)["RABIT2_RECOVER"] == "0"
    # the user's own setting wins, from the environment or from --env
    assert build_worker_env({"RABIT2_RECOVER": "0"}, {}, 0, 0, recover=True)[
        "RABIT2_RECOVER"] == "0"
    assert build_worker_env({}, {}, 0, 0, [("RABIT2_RECOVER", "0")], recover=True)[
        "RABIT2_RECOVER"] == "0"


def test_format_summary() -> None:
    tasks = [TaskRun(task_id=0, attempts=1, rank=0, exit_code=0, status="ok"),
             TaskRun(task_id=1, attempts=3, exit_code=-9, status="killed")]
    lines = format_summary(tasks, "rank 1 failed").splitlines()
    assert lines[0].split() == ["task", "rank", "attempts", "exit", "status"]
    assert lines[1].split() == ["0", "0", "1", "0", "ok"]
    assert lines[2].split() == ["1", "-", "3", "-9", "killed"]
    assert lines[3] == "job: rank 1 failed"


# -- real workers -----------------------------------------------------------------------------


def test_successful_job(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run_job(options(worker, "ok", n=3, env=(("EXTRA", "yes"),)), out, err)
    assert code == EXIT_OK, err.getvalue()
    lines = out.getvalue().splitlines()
    for rank in range(3):
        assert f"[rank {rank}] argv ['k=v'] role worker extra yes" in lines
        assert f"[{rank}] assigned rank {rank} incarnation 0" in lines
    summary = err.getvalue()
    assert "task  rank  attempts  exit  status" in summary
    assert summary.count(" ok") == 3
    assert_all_dead(worker.parent / "pids")


def test_restart_then_success(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run_job(options(worker, "fail-first", max_attempts=2, restart_delay=0.1), out, err)
    assert code == EXIT_OK, err.getvalue()
    assert "task 1 exited with 1 (attempt 1/2); restarting" in err.getvalue()
    assert "[1] assigned rank 1 incarnation 1" in out.getvalue()
    rows = [line.split() for line in err.getvalue().splitlines() if line[:1].isdigit()]
    assert ["1", "1", "2", "0", "ok"] in rows
    assert sorted(p.name for p in (worker.parent / "pids").glob("1.*")) == ["1.0.pid", "1.1.pid"]


def test_permanent_failure_stops_everyone(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = run_job(options(worker, "always-fail", max_attempts=2), out, err)
    assert code == EXIT_FAILED
    assert time.monotonic() - start < 20
    text = err.getvalue()
    assert "task 1 exited with 3 after 2 attempts" in text
    assert "[rank 1] giving up" in text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert rows == [["0", "-", "1", "-9", "killed"], ["1", "-", "2", "3", "failed"]]
    assert "job: task 1 failed for good" in text
    assert_all_dead(worker.parent / "pids")


def test_timeout_bounds_the_job(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = run_job(options(worker, "hang", timeout=1.0), out, err)
    assert code == EXIT_FAILED
    assert time.monotonic() - start < 10
    assert "timed out after 1s" in err.getvalue()
    assert_all_dead(worker.parent / "pids")


def test_cli_interrupt_leaves_no_worker(worker: Path) -> None:
    pid_dir = worker.parent / "pids"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "2",
         "--kill-grace", "0.5", "--", sys.executable, str(worker), "hang", str(pid_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while len(list(pid_dir.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)  # let the workers install their SIGTERM handler
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "interrupted" in stderr and "killed" in stderr
    assert_all_dead(pid_dir)


def test_bind_cpus_for_groups_or_round_robin() -> None:
    from tracker.submit import bind_cpus_for  # noqa: PLC0415

    two = [2, 5]
    assert [bind_cpus_for(t, 2, "auto", two) for t in range(2)] == [(2,), (5,)]
    # oversubscribed too: pinned polling workers beat floating ones (docs/design.md, Waiting)
    assert [bind_cpus_for(t, 4, "auto", two) for t in range(4)] == [(2,), (5,), (2,), (5,)]
    assert [bind_cpus_for(t, 4, "core", two) for t in range(4)] == [(2,), (5,), (2,), (5,)]
    assert bind_cpus_for(0, 1, "none", two) is None
    # a larger machine: each worker gets its share, so its BLAS/OpenMP pools have room
    eight = list(range(8))
    assert [bind_cpus_for(t, 3, "auto", eight) for t in range(3)] == [
        (0, 1), (2, 3), (4, 5)]
    assert bind_cpus_for(1, 2, "core", eight) == (1,)
    assert bind_cpus_for(0, 1, "auto", eight) == tuple(eight)
    env = build_worker_env({}, {}, task_id=1, attempt=0, bind_cpus=(4, 5))
    assert env["RABIT2_BIND_CPU"] == "4,5"
    assert "RABIT2_BIND_CPU" not in build_worker_env({}, {}, task_id=1, attempt=0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_workers_start_pinned() -> None:
    """The launcher starts each worker on its CPUs (not only RABIT2_BIND_CPU), so that
    thread pools made at import time are sized for them; its own mask is unchanged."""
    from tracker.submit import _pinned  # noqa: PLC0415

    cpu = sorted(os.sched_getaffinity(0))[-1]
    before = os.sched_getaffinity(0)
    with _pinned((cpu,)):
        out = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == f"[{cpu}]"
    assert os.sched_getaffinity(0) == before


def test_bind_and_heartbeat_options_are_parsed_and_checked() -> None:
    options = parse_args(["-n", "2", "--bind", "none", "--heartbeat-timeout", "2.5", "--",
                          "true"])
    assert (options.bind, options.heartbeat_timeout) == ("none", 2.5)
    for bad in (["--bind", "socket"], ["--heartbeat-timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["-n", "2", *bad, "--", "true"])
