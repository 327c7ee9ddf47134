"""The local launcher (tracker.submit): parsing, env, summary, and real worker processes.

The workers are tiny Python scripts that talk to the tracker through ``TrackerClient``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.jobs import assert_gone, assert_one_model, wait_until
from tracker.launch import tasks
from tracker.launch.common import TaskRun, build_worker_env, format_summary
from tracker.submit import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    LaunchOptions,
    parse_args,
    python_script,
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
            print(f"giving up ({attempt})", file=sys.stderr, flush=True)
            return 3 + attempt
        if MODE == "hang" or (MODE == "always-fail" and task == 0):
            # a stuck worker that even ignores SIGTERM: only SIGKILL ends it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(0.1)
        if MODE == "leave-before-joining" and task == 1:
            return 0
        client = await TrackerClient.connect(cfg, 20000 + task)
        assignment = await client.wait_assignment(30)
        client.print(f"assigned rank {assignment.rank} incarnation {assignment.incarnation}")
        if MODE == "fail-first" and task == 1 and attempt == 0:
            return 1  # dies without shutdown: the tracker sees the loss
        if MODE == "leave-without-finalize":
            if task == 1:
                return 0
            await client.shutdown(30, hold=True)  # (recovery on: waits for every rank)
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
        (["--cluster", "yarn", "-n", "2", "--", "x"], "available: local, ssh, slurm, mpi"),
        (["--cluster", "ssh", "-n", "2", "--", "x"], "needs --host-file"),
        (["--host-file", "h", "-n", "2", "--", "x"], "for --cluster ssh"),
        (["--cluster", "ssh", "--host-file", "/nonexistent/hosts", "-n", "2", "--", "x"],
         "--host-file /nonexistent/hosts: No such file"),
        (["--cluster", "slurm", "--srun", "srun 'x", "-n", "2", "--", "x"],
         """--srun "srun 'x": No closing quotation"""),
        (["--ssh", "ssh '", "-n", "2", "--", "x"], "--ssh \"ssh '\": No closing quotation"),
        (["--cluster", "mpi", "--bind", "core", "-n", "2", "--", "x"],
         "--bind core is for --cluster local"),
        (["--ssh", "", "-n", "2", "--", "x"], "--ssh must name"),
        (["--cluster", "mpi", "--mpirun", " ", "-n", "2", "--", "x"], "--mpirun must name"),
        (["--cluster", "slurm", "--srun", "", "-n", "2", "--", "x"], "--srun must name"),
        (["-n", "0", "--", "x"], "-n must be"),
        (["-n", "2"], "no command"),
        (["-n", "2", "--env", "novalue", "--", "x"], "K=V"),
        (["-n", "2", "--env", "DMLC_TASK_ID=0", "--", "x"], "sets DMLC_TASK_ID itself"),
        (["-n", "2", "--env", "RABIT2_SECRET=00ff", "--", "x"], "sets RABIT2_SECRET itself"),
        (["-n", "2", "--max-attempts", "0", "--", "x"], "max-attempts"),
        (["-n", "2", "--restart-delay", "nan", "--", "x"], "--restart-delay must be a finite"),
        (["-n", "2", "--timeout", "nan", "--", "x"], "--timeout must be a finite"),
        (["-n", "2", "--kill-grace", "1e300", "--", "x"], "--kill-grace must be a finite"),
        (["-n", "2", "--heartbeat-timeout", "inf", "--", "x"], "--heartbeat-timeout must be"),
        (["-n", "2", "--timeout", "0", "--", "x"], "--timeout must be > 0"),
        (["-n", "2", "--tracker-port", "70000", "--", "x"], "--tracker-port must be a TCP port"),
        (["-n", "2", "--metrics-host", "0.0.0.0", "--", "x"],
         "--metrics-host needs --metrics-port"),
        (["-n", "10000000", "--", "x"], "(ulimit -n)"),
        (["-n", "2", "--status-file", "/tmp", "--", "x"], "is a directory: name a file in it"),
        (["-n", "2", "--status-file", "/nonexistent/job.json", "--", "x"],
         "no folder /nonexistent"),
    ],
)
def test_parse_args_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_metrics_without_their_extra_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both commands say the extra is missing before anything starts (the tracker had logged
    that it listens first)."""
    from tracker import cli  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (as if not installed)
    for parse, argv in ((parse_args, ["-n", "2", "--metrics-port", "0", "--", "x"]),
                        (cli.parse_args, ["-n", "2", "--metrics-port", "0"])):
        with pytest.raises(SystemExit) as info:
            parse(argv)
        assert info.value.code == 2
        assert "pip install 'rabit2[metrics]'" in capsys.readouterr().err


def test_a_command_without_a_separator_keeps_its_own_options() -> None:
    """Everything from the first argument that is not an option's belongs to the command."""
    opts = parse_args(["-n", "2", "python", "-u", "train.py", "-n", "5", "--env", "X=1"])
    assert opts.num_workers == 2 and opts.env == ()
    assert opts.command == ("python", "-u", "train.py", "-n", "5", "--env", "X=1")
    # a "--" of the command's own stays the command's, with or without the launcher's
    for argv in (["-n", "2", "python", "t.py", "--", "--data", "x"],
                 ["-n", "2", "--", "python", "t.py", "--", "--data", "x"]):
        assert parse_args(argv).command == ("python", "t.py", "--", "--data", "x")


def test_both_commands_say_their_version(capsys: pytest.CaptureFixture[str]) -> None:
    import rabit2  # noqa: PLC0415
    from tracker import cli  # noqa: PLC0415

    for parse, prog in ((parse_args, "rabit2-submit"), (cli.parse_args, "rabit2-tracker")):
        with pytest.raises(SystemExit) as info:
            parse(["--version"])  # (before -n is asked for, as argparse does)
        assert info.value.code == 0
        assert capsys.readouterr().out == f"{prog} (rabit2 {rabit2.__version__})\n"


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


def test_the_root_cause_names_the_worker_its_end_and_its_last_words() -> None:
    from tracker.launch.common import describe_failure  # noqa: PLC0415

    task = TaskRun(task_id=2, attempts=1, rank=1, last_error="ValueError: bad input")
    said = describe_failure(task, -9, 3, time.time())
    assert re.fullmatch(r"rank 1 \(task 2\) was killed by SIGKILL at \d\d:\d\d:\d\d "
                        r"\(attempt 1/3\): ValueError: bad input", said), said
    assert "exited with 4" in describe_failure(TaskRun(task_id=0), 4, 1, 0.0)
    assert format_summary([task], "rank 1 failed", said).splitlines()[-2:] == [
        f"root cause: {said}", "job: rank 1 failed"]


# -- real workers -----------------------------------------------------------------------------


def test_successful_job(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run_job(options(worker, "ok", n=3, env=(("EXTRA", "yes"),)), out, err)
    assert code == EXIT_OK, err.getvalue()
    lines = out.getvalue().splitlines()
    for rank in range(3):
        assert f"[rank {rank}] argv ['k=v'] role worker extra yes" in lines
        assert f"[rank {rank}] assigned rank {rank} incarnation 0" in lines
    summary = err.getvalue()
    assert "task  rank  attempts  exit  status" in summary
    assert summary.count(" ok") == 3
    assert_all_dead(worker.parent / "pids")


def test_restart_then_success(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run_job(options(worker, "fail-first", max_attempts=2, restart_delay=0.1), out, err)
    assert code == EXIT_OK, err.getvalue()
    assert "task 1 exited with 1 (attempt 1/2); restarting" in err.getvalue()
    assert "[rank 1] assigned rank 1 incarnation 1" in out.getvalue()
    rows = [line.split() for line in err.getvalue().splitlines() if line[:1].isdigit()]
    assert ["1", "1", "2", "0", "ok"] in rows
    assert "root cause" not in err.getvalue()  # (the job succeeded)
    assert sorted(p.name for p in (worker.parent / "pids").glob("1.*")) == ["1.0.pid", "1.1.pid"]


def test_permanent_failure_stops_everyone(worker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Task 1 fails in both attempts; task 0 is stuck and ignores SIGTERM: the launcher
    gives it the abort grace (1 s here, 10 s by default) to exit on its own, then kills it."""
    monkeypatch.setattr(tasks, "ABORT_GRACE_SEC", 1.0)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = run_job(options(worker, "always-fail", max_attempts=2), out, err)
    assert code == EXIT_FAILED
    assert time.monotonic() - start < 15
    text = err.getvalue()
    assert "task 1 exited with 4 after 2 attempts" in text
    assert "[rank 1] giving up (0)" in text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert rows == [["0", "-", "1", "-9", "killed"], ["1", "-", "2", "4", "failed"]]
    assert "job: task 1 failed for good" in text
    assert "workers did not exit after the abort; stopping them" in text
    # the failure the job ended for (not the task's first, which a restart went on from),
    # with what the worker said last on stderr
    assert re.search(r"^root cause: task 1 exited with 4 at \d\d:\d\d:\d\d \(attempt 2/2\): "
                     r"giving up \(1\)$", text, re.M), text
    assert_all_dead(worker.parent / "pids")


@pytest.mark.parametrize(("mode", "why"), [
    ("leave-before-joining", "task 1 exited with 0 without joining the job (rabit2.init), "
                             "which the others joined: they cannot start without it"),
    ("leave-without-finalize", "task 1 exited with 0 without rabit2.finalize() while the job "
                               "ran: the others cannot finish without it"),
])
def test_a_program_that_ends_while_the_job_needs_it_ends_the_job(worker: Path, mode: str,
                                                                  why: str) -> None:
    """Status 0 is no failure to restart, but the others would wait for that worker until
    their deadlines (its assignment, or its replacement): the job ends in seconds, named."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = run_job(options(worker, mode, max_attempts=3), out, err)
    text = err.getvalue()
    assert code == EXIT_FAILED, text
    assert time.monotonic() - start < 15
    assert f"root cause: {why}" in text
    assert "restarting" not in text
    # (its exit status 0 is no success: the summary does not say "ok")
    assert re.search(r"^1\s+\S+\s+1\s+0\s+left early$", text, re.M), text
    assert_all_dead(worker.parent / "pids")


def test_timeout_bounds_the_job(worker: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = run_job(options(worker, "hang", timeout=1.0), out, err)
    assert code == EXIT_FAILED
    assert time.monotonic() - start < 10
    assert "timed out after 1s" in err.getvalue()
    assert_all_dead(worker.parent / "pids")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_cli_interrupt_leaves_no_worker(worker: Path, signum: int) -> None:
    """Ctrl-C, a kill, or the terminal that ran it going away (SIGHUP)."""
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
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    assert f"the launcher was interrupted ({how})" in stderr and "killed" in stderr, stderr
    assert_all_dead(pid_dir)


LEAVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from pathlib import Path
    pid_dir, mode = Path(sys.argv[1]), sys.argv[2]
    task = os.environ["DMLC_TASK_ID"]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    group = subprocess.Popen(["sleep", "600"])
    session = subprocess.Popen(["sleep", "600"], start_new_session=True)
    for name, pid in (("worker", os.getpid()), ("group", group.pid), ("session", session.pid)):
        (pid_dir / f"{name}.{task}.pid").write_text(str(pid))
    if mode == "stubborn":
        time.sleep(600)
""")


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob("*.pid")]


def test_what_the_workers_leave_behind_is_stopped_with_the_job(tmp_path: Path) -> None:
    """Each worker starts a process in its own group and one in a session of its own, and
    exits 0: rabit2-submit stops both kinds when the job ends (it adopts the orphans)."""
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = _run_cli("tracker.submit", "-n", "2", "--", sys.executable, str(script),
                    str(pid_dir), "exit")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert len(_pids(pid_dir)) == 6
    assert_gone(_pids(pid_dir), 5)
    assert re.search(r"stopped [2-4] process\(es\) the workers left behind", proc.stderr), (
        proc.stderr)


def test_a_second_interrupt_kills_at_once_and_leaves_nothing(tmp_path: Path) -> None:
    """Workers that ignore SIGTERM get the --kill-grace (60 s here) after a Ctrl-C; a second
    Ctrl-C kills them, and what they started, at once."""
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "2",
         "--kill-grace", "60", "--", sys.executable, str(script), str(pid_dir), "stubborn"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(lambda: len(_pids(pid_dir)) == 6, 20, proc, "the workers' children")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # (in the grace: the workers ignore SIGTERM)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr, stderr
    assert_gone(_pids(pid_dir), 5)


def test_bind_cpus_for_groups_or_round_robin() -> None:
    from tracker.launch.local import bind_cpus_for  # noqa: PLC0415

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


def test_workers_pinned_beside_another_make_only_express_calls_themselves_and_prefer_the_tree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tracker.launch import local  # noqa: PLC0415
    from tracker.launch.options import parse_args  # noqa: PLC0415

    assert local.shares_cpu(4, "auto", [2, 5]) and local.shares_cpu(3, "core", [2, 5])
    assert not local.shares_cpu(2, "auto", [2, 5]) and not local.shares_cpu(4, "none", [2, 5])
    monkeypatch.setattr(local, "bind_cpus_for", lambda task, n, bind: (task % 2,))
    monkeypatch.setattr(local, "shares_cpu", lambda n, bind: n > 2)
    for name in ("RABIT2_DRIVE_GENERAL", "RABIT2_RING_MIN_BYTES"):
        monkeypatch.delenv(name, raising=False)
    four = parse_args(["--cluster", "local", "-n", "4", "--", "python", "w.py"])
    env = local.local_attempt(four, {}, 0, 0).env
    assert env["RABIT2_DRIVE_GENERAL"] == "0"
    assert env["RABIT2_RING_MIN_BYTES"] == str(2 << 20)
    two = parse_args(["--cluster", "local", "-n", "2", "--", "python", "w.py"])
    env = local.local_attempt(two, {}, 0, 0).env
    assert "RABIT2_DRIVE_GENERAL" not in env and "RABIT2_RING_MIN_BYTES" not in env
    monkeypatch.setenv("RABIT2_DRIVE_GENERAL", "1")  # what the user says stands
    monkeypatch.setenv("RABIT2_RING_MIN_BYTES", "4096")
    env = local.local_attempt(four, {}, 0, 0).env
    assert env["RABIT2_DRIVE_GENERAL"] == "1" and env["RABIT2_RING_MIN_BYTES"] == "4096"
    told = parse_args(["--cluster", "local", "-n", "4", "--env", "RABIT2_RING_MIN_BYTES=0",
                       "--", "python", "w.py"])
    assert local.local_attempt(told, {}, 0, 0).env["RABIT2_RING_MIN_BYTES"] == "0"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_workers_start_pinned() -> None:
    """The launcher starts each worker on its CPUs (not only RABIT2_BIND_CPU), so that
    thread pools made at import time are sized for them; its own mask is unchanged."""
    from tracker.launch.local import pinned  # noqa: PLC0415

    cpu = sorted(os.sched_getaffinity(0))[-1]
    before = os.sched_getaffinity(0)
    with pinned((cpu,)):
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


# -- --cluster ssh: the pure parts (tests/cluster/test_ssh_cluster.py runs real ssh) ----------


def test_parse_host_file() -> None:
    from tracker.launch.options import Host, parse_host_file  # noqa: PLC0415

    hosts = parse_host_file(
        "# cluster\n\nnode1\nalice@node2:2222 slots=3   # a comment\n"
        "10.0.0.7 slots=2 max_slots=4\n"
    )
    assert hosts == (Host("node1"), Host("alice@node2", 2222, 3), Host("10.0.0.7", None, 2))
    assert hosts[1].address == "node2"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no host"),
        ("# only a comment\n", "names no host"),
        ("node1\nnode2:0\n", "line 2"),
        ("node1:ssh\n", "line 1"),
        ("node1 slots=0\n", "slots must be >= 1"),
        ("node1 slots=two\n", "line 1"),
        ("node1 cpus=2\n", "unknown field"),
        ("-oProxyCommand=x\n", "bad host name"),
        ("node;rm\n", "bad host name"),
        ("::1\n", "looks like an IPv6 address"),
        ("fe80::1 slots=2\n", "looks like an IPv6 address"),
        ("[::1]:22\n", "looks like an IPv6 address"),
    ],
)
def test_parse_host_file_errors(text: str, message: str) -> None:
    from tracker.launch.options import parse_host_file  # noqa: PLC0415

    with pytest.raises(ValueError, match=message):
        parse_host_file(text)


def _own_address() -> str | None:
    """An IPv4 address of this machine other than loopback (None: it has none)."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                         check=False).stdout
    found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return next((a for a in found if not a.startswith("127.")), None)


def test_the_tracker_listens_where_the_hosts_after_localhost_reach_it() -> None:
    """A host file that starts with localhost and goes on with other hosts: the tracker's
    address is the one that routes to the first other host, not loopback (which the others
    cannot reach).  (A UDP socket's connect sends nothing.)"""
    from tracker.launch.options import Host, tracker_host_for  # noqa: PLC0415

    own = _own_address()
    if own is None:
        pytest.skip("this machine has no IPv4 address besides loopback")
    assert tracker_host_for([Host("localhost"), Host(own)]) == own
    assert tracker_host_for([Host("localhost"), Host("127.0.0.1")]) == "127.0.0.1"


def test_hosts_are_filled_slot_by_slot_then_cycled() -> None:
    from tracker.launch.options import Host, hosts_by_slot  # noqa: PLC0415

    a, b = Host("a", slots=2), Host("b")
    assert hosts_by_slot([a, b], 7) == (a, a, b, a, a, b, a)
    assert hosts_by_slot([b], 2) == (b, b)


def test_ssh_argv_quotes_the_command_and_keeps_the_secret_off_it() -> None:
    from tracker.launch.options import Host, remote_python_for  # noqa: PLC0415
    from tracker.launch.ssh import ssh_argv  # noqa: PLC0415

    opts = LaunchOptions(num_workers=1, command=("/opt/py/bin/python3", "t.py", "a b", "it's"),
                         ssh=("ssh", "-F", "cfg"), remote_dir="/data/my job",
                         remote_python=remote_python_for(("/opt/py/bin/python3",)))
    argv = ssh_argv(opts, Host("bob@n1", 2200))
    assert argv[:3] == ["ssh", "-F", "cfg"]
    assert argv[3:11] == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=20",
                          "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]
    assert argv[11:14] == ["-p", "2200", "bob@n1"]
    remote = argv[14]
    # what the remote shell runs, word for word
    assert subprocess.run(["sh", "-c", f"printf '%s\\n' {remote.split('exec ', 1)[1]}"],
                          capture_output=True, text=True, check=True).stdout.splitlines() == [
        "/opt/py/bin/python3", "-m", "tracker.remote", "--", "/opt/py/bin/python3", "t.py",
        "a b", "it's"]
    assert remote.startswith("cd '/data/my job' && exec ")
    assert "SECRET" not in " ".join(argv)
    assert remote_python_for(("bash", "run.sh")) == "python3"
    no_dir = ssh_argv(LaunchOptions(num_workers=1, command=("x",)), Host("n2"))
    assert no_dir[-2:] == ["n2", "exec python3 -m tracker.remote -- x"]


def test_ssh_workers_get_the_job_variables_not_this_machines_environment() -> None:
    from tracker.launch.ssh import forwarded_env  # noqa: PLC0415

    forwarded = forwarded_env({"PATH": "/bin", "HOME": "/root", "RABIT2_RECOVER": "0",
                               "RABIT2_SPIN_US": "0", "DMLC_TASK_ID": "9"})
    assert forwarded == {"RABIT2_RECOVER": "0", "RABIT2_SPIN_US": "0"}
    env = build_worker_env(forwarded, {"RABIT2_SECRET": "ab"}, 1, 0, [("A", "1")],
                           recover=True)
    assert "PATH" not in env and env["RABIT2_RECOVER"] == "0"  # the launcher's setting wins
    assert env["DMLC_TASK_ID"] == "1" and env["A"] == "1" and env["RABIT2_SECRET"] == "ab"


def test_parse_args_ssh(tmp_path: Path) -> None:
    from tracker.launch.options import Host  # noqa: PLC0415

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2299 slots=2\nlocalhost\n")
    opts = parse_args(["--cluster", "ssh", "--host-file", str(hosts), "-n", "4",
                       "--ssh", "ssh -F 'my cfg'", "--remote-dir", "", "--",
                       sys.executable, "w.py"])
    assert opts.cluster == "ssh" and opts.ssh == ("ssh", "-F", "my cfg")
    assert opts.hosts == (Host("127.0.0.1", 2299, 2), Host("127.0.0.1", 2299, 2),
                          Host("localhost"), Host("127.0.0.1", 2299, 2))
    assert opts.tracker_host == "127.0.0.1"  # every host is this machine
    assert opts.remote_dir == "" and opts.remote_python == sys.executable
    opts = parse_args(["--cluster", "ssh", "--host-file", str(hosts), "-n", "1",
                       "--tracker-host", "0.0.0.0", "--remote-python", "py3", "--", "x"])
    assert opts.tracker_host == "0.0.0.0" and opts.remote_python == "py3"
    assert opts.remote_dir == os.getcwd()
    assert parse_args(["-n", "1", "--", "x"]).tracker_host == "127.0.0.1"


def test_parse_args_ssh_unknown_host(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import socket  # noqa: PLC0415

    def no_dns(host: str, *args: object, **kwargs: object) -> object:
        # (a real lookup of an unknown name would ask this machine's DNS server)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    hosts = tmp_path / "hosts"
    hosts.write_text("no-such-host.invalid\n")
    with pytest.raises(SystemExit) as info:
        parse_args(["--cluster", "ssh", "--host-file", str(hosts), "-n", "1", "--", "x"])
    assert info.value.code == 2
    assert "cannot resolve host 'no-such-host.invalid'" in capsys.readouterr().err


# -- --cluster slurm / mpi: the pure parts (tests/cluster/test_group_cluster.py runs the real ones)


def test_group_argv_runs_every_worker_under_a_slot() -> None:
    from tracker.launch.group import group_argv  # noqa: PLC0415

    opts = LaunchOptions(num_workers=4, command=("python", "t.py", "k=v"), cluster="slurm",
                         group=("srun", "-N", "2"), remote_python="python", max_attempts=2,
                         restart_delay=0.5, kill_grace=3)
    slot = ["python", "-m", "tracker.slot", "--max-attempts", "2", "--restart-delay", "0.5",
            "--kill-grace", "3", "--", "python", "t.py", "k=v"]
    assert group_argv(opts, ["B", "A"]) == [
        "srun", "-N", "2", "-n", "4", "--export=ALL", "--kill-on-bad-exit=0", "--label", *slot]
    mpi = dataclasses.replace(opts, cluster="mpi", group=("mpirun",))
    assert group_argv(mpi, ["B", "A"]) == ["mpirun", "-n", "4", "-x", "A", "-x", "B", *slot]


def test_group_env_leaves_task_ids_to_the_slots() -> None:
    from tracker.launch.group import group_env  # noqa: PLC0415

    env = group_env({"PATH": "/bin", "DMLC_TASK_ID": "7", "DMLC_NUM_ATTEMPT": "2"},
                    {"RABIT2_SECRET": "ab", "DMLC_NUM_WORKER": "4"}, [("X", "1")])
    assert "DMLC_TASK_ID" not in env and "DMLC_NUM_ATTEMPT" not in env
    assert "RABIT2_RECOVER" not in env  # each slot decides from --max-attempts
    assert env["PATH"] == "/bin" and env["RABIT2_SECRET"] == "ab" and env["X"] == "1"
    assert env["DMLC_ROLE"] == "worker" and env["PYTHONUNBUFFERED"] == "1"


def test_parse_args_slurm_and_mpi() -> None:
    opts = parse_args(["--cluster", "slurm", "-n", "4", "--srun", "srun -N 2", "--",
                       "python", "t.py"])
    assert opts.group == ("srun", "-N", "2") and opts.tracker_host == "0.0.0.0"
    assert opts.remote_python == "python"
    opts = parse_args(["--cluster", "mpi", "-n", "2", "--tracker-host", "10.0.0.1", "--",
                       "./run.sh"])
    assert opts.group == ("mpirun",) and opts.tracker_host == "10.0.0.1"
    assert opts.remote_python == "python3"
    assert parse_args(["-n", "1", "--", "x"]).group == ()


def test_a_missing_srun_or_mpirun_fails_the_job_clearly() -> None:
    opts = LaunchOptions(num_workers=2, command=("python", "-c", "pass"), cluster="mpi",
                         group=("/nonexistent/mpirun",), remote_python="python")
    out, err = io.StringIO(), io.StringIO()
    assert run_job(opts, out, err) == EXIT_USAGE  # (as a worker command that cannot start)
    assert "cannot start '/nonexistent/mpirun'" in err.getvalue()


def test_a_group_launcher_that_refuses_to_start_says_so_in_the_summary() -> None:
    """mpirun (here: false) exits at once, starting no worker: the job line says so."""
    opts = LaunchOptions(num_workers=2, command=("python", "-c", "pass"), cluster="mpi",
                         group=("false",), remote_python="python")
    out, err = io.StringIO(), io.StringIO()
    assert run_job(opts, out, err) == EXIT_FAILED
    summary = err.getvalue()
    assert ("job: false exited with 1 before the job ended; 2 task(s) never reached the "
            "tracker") in summary, summary
    assert "None" not in summary


@pytest.mark.parametrize("success, ok, interrupted, expected", [
    (None, False, True, "the launcher was interrupted before the job ended"),
    (None, False, False, "the workers exited before the job ended"),
    (True, True, False, "every rank shut down"),
    (True, False, False, "every rank shut down, but a worker exited non-zero afterwards"),
    (False, False, False, "task 1 failed for good"),
])
def test_the_job_line_names_every_ending(success: bool | None, ok: bool, interrupted: bool,
                                         expected: str) -> None:
    from tracker.launch.tasks import job_line  # noqa: PLC0415
    from tracker.service import JobResult  # noqa: PLC0415

    reason = "every rank shut down" if success else "task 1 failed for good"
    result = None if success is None else JobResult(success, reason, {})
    assert job_line(result, ok, interrupted) == expected


def test_dry_run_prints_the_commands_and_starts_nothing(tmp_path: Path) -> None:
    """--dry-run: the worker command lines (the secret is named, never shown), no tracker,
    no process; exit 0."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2222 slots=2\n")
    marker = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for extra in (["--cluster", "local"], ["--cluster", "ssh", "--host-file", str(hosts)],
                  ["--cluster", "slurm"], ["--cluster", "mpi", "--env", "X=1"]):
        done = subprocess.run([sys.executable, "-m", "tracker.submit", "--dry-run", "-n", "2",
                               *extra, *command], capture_output=True, text=True, timeout=30,
                              check=False)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith("# tracker on ") and "RABIT2_SECRET" in lines[0]
        body = "\n".join(lines[1:])
        if extra[1] == "local":
            assert body.count("DMLC_TASK_ID=") == 2
        elif extra[1] == "ssh":
            assert body.count("ssh -o BatchMode=yes") == 2 and "-p 2222 127.0.0.1" in body
        elif extra[1] == "slurm":
            assert body.startswith("srun -n 2 --export=ALL --kill-on-bad-exit=0 --label ")
        else:
            assert body.startswith("mpirun -n 2 ") and "-x RABIT2_SECRET -x X " in body
        assert "tracker.slot" in body or extra[1] in ("local", "ssh")
    assert not marker.exists()


# ----------------------------------------------------------------------------- log lines


def test_output_segments_pass_progress_updates_on_at_once() -> None:
    from tracker.launch.common import output_segments  # noqa: PLC0415

    class Pipe:
        def __init__(self, *chunks: bytes) -> None:
            self.chunks = list(chunks)

        def read1(self, size: int) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

    pipe = Pipe(b"one\nwin\r\n\r 10%", b"\r 20%\r", b"\r 30%\r\n\xff last")
    assert list(output_segments(pipe)) == [  # type: ignore[arg-type]
        ("one", "\n"), ("win", "\n"), (" 10%", "\r"), (" 20%", "\r"), (" 30%", "\n"),
        ("\ufffd last", "")]


def test_line_writer_stamps_lines_and_copies_whole_ones_to_the_log_file() -> None:
    from tracker.launch.common import LineWriter  # noqa: PLC0415

    out, log = io.StringIO(), io.StringIO()
    writer = LineWriter(timestamps=True, log_file=log)
    writer.write(out, "[rank 0] a\nb")
    writer.write(out, "[rank 1] 50%", "\r")
    lines = out.getvalue().split("\n")
    assert [line[13:] for line in lines] == ["[rank 0] a", "b", "[rank 1] 50%\r"]
    assert all(line[2] == ":" and line[8] == "." for line in lines)
    logged = log.getvalue().splitlines()
    assert [line[24:] for line in logged] == ["[rank 0] a", "b"]  # (no progress redraws)
    assert logged[0][4] == "-" and logged[0][13] == ":"


def test_submit_logs_the_tracker_and_the_workers_at_the_level_asked(tmp_path: Path) -> None:
    worker = tmp_path / "w.py"
    worker.write_text(textwrap.dedent("""
        import sys, rabit2
        rabit2.init()
        sys.stdout.write("\\rstep 1"); sys.stdout.flush()
        sys.stdout.write("\\rstep 2"); sys.stdout.flush()
        print()
        rabit2.tracker_print("printed\\nand its second line\\n")
        rabit2.finalize()
    """))
    log = tmp_path / "job.log"
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "2",
         "--log-level", "info", "--timestamps", "--log-file", str(log), "--",
         sys.executable, str(worker)],
        capture_output=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()  # (bytes: \r kept as it is)
    assert proc.returncode == 0, stdout + stderr
    out = stdout + stderr
    assert "[tracker] INFO all 2 workers registered" in out
    for rank in (0, 1):
        assert f"[rank {rank}] printed" in out
        assert f"[rank {rank}] and its second line" in out
        assert f"rabit2[rank {rank}] INFO joined the job" in out  # (RABIT2_LOG_LEVEL=INFO)
        assert f"[rank {rank}] step 1\r" in stdout  # a redraw, passed on as it is
    assert all(line[2] == ":" and line[8] == "." for line in out.split("\n") if line)
    logged = log.read_text()
    assert "[tracker] INFO all 2 workers registered" in logged and "job: every rank" in logged
    assert "\r" not in logged


def test_a_bad_log_level_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "-n", "1", "--log-level", "loud", "--",
         "true"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert proc.returncode == 2 and "--log-level" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_usage_and_environment_errors_are_one_line_with_exit_2(tmp_path: Path) -> None:
    no_shebang = tmp_path / "no_shebang.py"
    no_shebang.write_text("print(1)\n")
    bad_interpreter = tmp_path / "bad_interpreter.py"
    bad_interpreter.write_text("#!/no/such/interpreter\nprint(1)\n")
    for script in (no_shebang, bad_interpreter):
        script.chmod(0o755)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [
            (("tracker.submit", "-n", "2", "--", "no-such-program-here"),
             "no-such-program-here: command not found"),
            (("tracker.submit", "-n", "1", "--tracker-port", port, "--", "true"),
             f"the tracker cannot listen on 127.0.0.1:{port}: Address already in use"),
            (("tracker.cli", "-n", "1", "--port", port),
             f"cannot listen on 127.0.0.1:{port}: Address already in use"),
            (("tracker.cli", "-n", "1", "--log-level", "LOUD"), "--log-level: invalid choice"),
            (("tracker.cli", "-n", "1", "--secret", ""), "--secret must not be empty"),
            (("tracker.cli", "-n", "1", "--metrics-host", "0.0.0.0"),
             "--metrics-host needs --metrics-port"),
            (("tracker.submit", "-n", "2", "--", sys.executable, "no/such/train.py"),
             "no/such/train.py: no such file"),
            (("tracker.submit", "-n", "2", "--", sys.executable, "-u", "-X", "dev",
              "no/such/train.py"), "no/such/train.py: no such file"),
            (("tracker.submit", "-n", "2", "--", str(no_shebang)),
             "cannot start task 0: [Errno 8] Exec format error"),
            (("tracker.submit", "-n", "2", "--", str(bad_interpreter)),
             "exists, but the interpreter its #! line names does not"),
            (("tracker.submit", "-n", "1", "--log-file", str(tmp_path / "no" / "log"), "--",
              "true"), "--log-file"),
        ]
        for argv, said in cases:
            proc = _run_cli(*argv)
            assert proc.returncode == 2, (argv, proc.stderr)
            assert said in proc.stderr and "Traceback" not in proc.stderr, (argv, proc.stderr)


@pytest.mark.parametrize(("bad", "where"), [("rabit_timout_sec=60", "argv"),
                                            ("rabit2_recover=maybe", "argv"),
                                            ("RABIT2_RECOVER=maybe", "env")])
def test_parameters_init_refuses_end_the_job_without_a_restart(bad: str, where: str) -> None:
    """A typo in a rabit2 parameter fails every attempt the same way: the first attempt
    tells the tracker to give its task up, and the job ends at once, naming the key."""
    code = "import sys, rabit2\nrabit2.init(sys.argv[1:])\nrabit2.finalize()\n"
    started = time.monotonic()
    given = ("--env", bad, "--") if where == "env" else ("--",)
    proc = _run_cli("tracker.submit", "-n", "2", "--max-attempts", "3", *given,
                    sys.executable, "-c", code, *([bad] if where == "argv" else []))
    assert proc.returncode == 1, proc.stderr
    assert "restarting" not in proc.stderr, proc.stderr
    key = bad.partition("=")[0]
    assert re.search(rf"job: task \d failed for good: rabit2.init refused its parameters, "
                     rf"which no restart can fix: .*{key}", proc.stderr), proc.stderr
    assert time.monotonic() - started < 30


def test_a_worker_set_up_for_another_world_size_ends_the_job_without_a_restart() -> None:
    """The tracker refuses it, which no restart can change: it ends the job at once."""
    code = "import sys, rabit2\nrabit2.init(sys.argv[1:])\nrabit2.finalize()\n"
    started = time.monotonic()
    proc = _run_cli("tracker.submit", "-n", "2", "--max-attempts", "3", "--",
                    sys.executable, "-c", code, "dmlc_num_worker=3")
    assert proc.returncode == 1, proc.stderr
    assert "restarting" not in proc.stderr, proc.stderr
    assert re.search(r"job: task \d was refused, which no restart can fix: worker expects "
                     r"world size 3, job has 2", proc.stderr), proc.stderr
    # (the task the tracker refused first is the root cause, as for any other failure)
    assert re.search(r"^root cause: task \d exited with 1 .*worker expects world size 3",
                     proc.stderr, re.M), proc.stderr
    assert time.monotonic() - started < 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_busy_computing_dies_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no chance to stop its workers: each one that is its child
    asked the kernel to kill it when the launcher dies, and does not compute on."""
    pid_file = tmp_path / "worker.pid"
    worker = tmp_path / "w.py"
    worker.write_text(textwrap.dedent(f"""
        import os, time, rabit2
        rabit2.init()
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        end = time.monotonic() + 60
        while time.monotonic() < end:  # computing, no rabit2 call
            sum(range(10000))
    """))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "1", "--",
         sys.executable, str(worker)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", 60,
                   launcher, "the worker's pid")
        worker_pid = int(pid_file.read_text())
        launcher.kill()
        launcher.wait(10)
        assert_gone([worker_pid], 10, "worker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)


def test_dmlc_submit_and_xgboost_spellings_are_accepted() -> None:
    opts = parse_args(["--num-workers", "2", "--local-num-attempt", "5", "--host-ip",
                       "127.0.0.2", "--", sys.executable, "w.py"])
    assert (opts.num_workers, opts.max_attempts, opts.tracker_host) == (2, 5, "127.0.0.2")


@pytest.mark.parametrize(("args", "script"), [
    (["train.py", "k=v"], "train.py"), (["-u", "train.py"], "train.py"),
    (["-X", "dev", "-W", "error", "train.py"], "train.py"), (["-uXdev", "train.py"], "train.py"),
    (["-uBW", "error", "train.py"], "train.py"), (["--", "train.py"], "train.py"),
    (["-m", "pkg.mod", "x.py"], None), (["-um", "pkg.mod"], None), (["-c", "code", "x.py"], None),
    (["-"], None), (["--version"], None), (["-W", "error"], None), ([], None),
])
def test_the_script_a_python_command_line_runs(args: list[str], script: str | None) -> None:
    assert python_script(args) == script


def test_a_worker_that_never_reaches_init_is_named_by_the_others_timeout() -> None:
    """Task 1 sleeps before init: the others' wait for their ranks times out saying which
    tasks registered, so the missing one is plain."""
    code = ("import os, sys, time, rabit2\n"
            "if os.environ['DMLC_TASK_ID'] == '1':\n"
            "    time.sleep(6)  # (past the others' 3 s, and less than the abort's grace)\n"
            "rabit2.init(sys.argv[1:])\nrabit2.finalize()\n")
    started = time.monotonic()
    proc = _run_cli("tracker.submit", "-n", "3", "--max-attempts", "1", "--kill-grace", "1",
                    "--", sys.executable, "-c", code, "rabit_timeout_sec=3")
    assert proc.returncode == 1, proc.stderr
    assert ("no rank assignment from the tracker within 3.0s: 2 of 3 workers registered "
            "with the tracker (tasks 0, 2)") in proc.stderr, proc.stderr
    assert time.monotonic() - started < 30


def test_a_call_that_times_out_names_the_rank_it_waits_for() -> None:
    """Rank 1 does not make the first call in time: the rank that timed out says whose
    bytes it waited for (rank 1, or rank 0, which waited for rank 1 in its turn), and the
    job's reason names the rank that was not in a call, and only it: a rank whose call had
    just failed still counts as in it until its caller has the error.  (With these numbers
    the failure and a heartbeat came in the same turn of the loop, and every rank was
    named.)"""
    code = ("import sys, time, numpy as np, rabit2\n"
            "rabit2.init(sys.argv[1:])\n"
            "if rabit2.get_rank() == 1:\n"
            "    time.sleep(7)  # (past the others' 5 s, and less than the abort's grace)\n"
            "rabit2.allreduce(np.ones(4), rabit2.SUM)\n"
            "rabit2.finalize()\n")
    proc = _run_cli("tracker.submit", "-n", "3", "--max-attempts", "1", "--kill-grace", "1",
                    "--", sys.executable, "-c", code, "rabit_timeout_sec=5")
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"job: rank [02] \(task [02]\) signalled an error: rank [02] raised "
                     r"CollectiveTimeoutError: rank [02]: no progress in call \(0, 0\) for 5 s, "
                     r"waiting for bytes from rank [01]( \(reported by rank [02]\))? \(not in a "
                     r"collective call at their last heartbeat: rank 1\)", proc.stderr), proc.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_tracker_on_an_ipv6_address_runs_and_recovers_a_job() -> None:
    """The workers listen in the tracker's address family: the peers dial the address the
    tracker saw, IPv6 here, and a killed worker recovers over it."""
    proc = _run_cli("tracker.submit", "-n", "3", "--tracker-host", "::1", "--max-attempts",
                    "3", "--", sys.executable, "-m", "rabit2.examples.gbdt", "--size", "ci",
                    "mock=2,3,1,0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_one_model(proc.stdout, 3)
    assert re.search(r"^2\s+2\s+2\s+0\s+ok", proc.stderr, re.M), proc.stderr[-2000:]


def test_under_nohup_a_hangup_does_not_stop_the_job() -> None:
    """SIGHUP ignored when the launcher starts (as nohup leaves it) stays ignored: the job
    runs to its end."""
    code = "import time, rabit2\nrabit2.init()\ntime.sleep(1.5)\nrabit2.finalize()\n"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.submit", "-n", "2", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # noqa: PLW1509
    try:
        time.sleep(0.8)
        proc.send_signal(signal.SIGHUP)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_OK, stderr
    assert "job: every rank shut down" in stderr


def test_a_worker_that_prints_faster_than_the_tracker_holds_a_bounded_backlog(
        tmp_path: Path) -> None:
    """Lines printed faster than the tracker prints them wait in the worker only up to
    ``PRINT_BACKLOG``: the printing thread waits for room, and every line still arrives in
    order (before, 80 MB of lines took the worker's memory up by about that much)."""
    worker = tmp_path / "printer.py"
    worker.write_text(textwrap.dedent("""
        import resource, rabit2
        rabit2.init()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for i in range(400):
            rabit2.tracker_print(f"line {i:04d} " + "x" * 200_000)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(f"GREW {grown // 1024} MiB", flush=True)
        rabit2.finalize()
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "1", "--",
         sys.executable, str(worker)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"line (\d{4}) x{200000}$", proc.stdout, re.MULTILINE)
    assert lines == [f"{i:04d}" for i in range(400)]
    assert "dropped" not in proc.stderr
    grew = int(re.findall(r"GREW (\d+) MiB", proc.stdout)[0])
    assert grew < 40, grew  # (4 MiB of frames, the lines being made, the allocator's slack)
