"""A running job seen from outside: ``rabit2-submit --metrics-port`` scraped while a worker is
killed and recovers, ``rabit2-tracker --query`` through the job file, and the standalone
tracker's endpoint.  Real processes, real HTTP, prometheus_client's own parser."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

prometheus_parser = pytest.importorskip("prometheus_client.parser")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ITERATIONS = 40
KILLED_AT = 12  # rank 1 is SIGKILLed at that checkpoint version, on its first attempt

WORKER = textwrap.dedent(
    f"""
    import sys, time
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    rank = rabit2.get_rank()
    version, _ = rabit2.load_checkpoint()
    for it in range(version, {ITERATIONS}):
        data = np.full(256, rank + it, dtype=np.int64)
        rabit2.allreduce(data, rabit2.Op.SUM)
        assert int(data[0]) == sum(r + it for r in range(rabit2.get_world_size()))
        time.sleep(0.05)
        rabit2.checkpoint(it)
    print(f"done rank={{rank}}", flush=True)
    rabit2.finalize()
    """
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples | None:
    """One scrape, parsed; None when the endpoint does not answer (the job is over)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in prometheus_parser.text_string_to_metric_families(text)
            for sample in family.samples}


def rank(r: int) -> tuple[tuple[str, str], ...]:
    return (("rank", str(r)), ("task", str(r)))


def test_metrics_and_query_follow_a_job_through_a_kill_and_its_recovery(
        tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "RABIT2_RUN_DIR": str(tmp_path / "run"), "RABIT2_HEARTBEAT_SEC": "0.1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "3",
         "--metrics-port", "0", "--timeout", "90", "--", sys.executable, str(script),
         f"mock=1,{KILLED_AT},0,0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    scrapes: list[Samples] = []
    query: dict[str, Any] | None = None
    job_file: Path | None = None
    try:
        deadline = time.monotonic() + 30
        while not any("metrics: http" in line for line in err_lines):
            assert proc.poll() is None and time.monotonic() < deadline, err_lines
            time.sleep(0.02)
        note = next(line for line in err_lines if "metrics: http" in line)
        url = re.search(r"metrics: (http://\S+)", note).group(1)  # type: ignore[union-attr]
        job_file = Path(re.search(r"--query (\S+);", note).group(1))  # type: ignore[union-attr]
        assert job_file.parent == tmp_path / "run"
        assert stat.S_IMODE(job_file.stat().st_mode) == 0o600
        while proc.poll() is None:
            samples = scrape(url)
            if samples is not None:
                scrapes.append(samples)
            if query is None and samples and samples.get(
                    ("rabit2_worker_calls_total", rank(2)), 0) >= 3:
                # ask the running job through its job file, found without naming it
                done = subprocess.run([sys.executable, "-m", "tracker.cli", "--query"],
                                      capture_output=True, text=True, timeout=30, env=env,
                                      cwd=ROOT, check=False)
                assert done.returncode == 0, done.stderr
                query = json.loads(done.stdout)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    reader.join(5)
    assert proc.returncode == 0, "".join(err_lines)
    assert sorted(re.findall(r"done rank=(\d)", out)) == ["0", "1", "2"]
    assert not job_file.exists()  # removed when the job ended
    assert scrape(url) is None  # and the endpoint is closed

    # the query: the job, its ranks and what their heartbeats reported
    assert query is not None and query["world_size"] == 3
    assert all(task["progress"]["calls"] >= 1 for task in query["tasks"]
               if task["task_id"] == "2")

    # the scrapes: progress before the kill, the loss and the restart after it
    assert len(scrapes) >= 10
    key_inc = ("rabit2_worker_incarnation", rank(1))
    before = [s for s in scrapes if s.get(key_inc) == 0]
    after = [s for s in scrapes if s.get(key_inc) == 1]
    assert before and after
    assert before[0][("rabit2_job_state", (("state", "running"),))] == 1
    assert max(s.get(("rabit2_worker_calls_total", rank(1)), 0) for s in before) >= 3
    for samples in after:
        assert samples[("rabit2_job_failures_total", ())] == 1
        assert samples[("rabit2_job_restarts_total", ())] == 1
        assert samples[("rabit2_worker_losses_total", rank(1))] == 1
    # the restarted process counts afresh and goes on past the version it was killed at
    assert max(s.get(("rabit2_worker_version", rank(1)), 0) for s in after) > KILLED_AT
    # a survivor's counters never go back
    calls0 = [s[("rabit2_worker_calls_total", rank(0))] for s in scrapes
              if ("rabit2_worker_calls_total", rank(0)) in s]
    assert calls0 == sorted(calls0) and calls0[-1] >= ITERATIONS - 5
    # the job file went with the job: the command the launcher printed now finds no job
    gone = subprocess.run([sys.executable, "-m", "tracker.cli", "--query", str(job_file)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    assert gone.returncode == 1 and "cannot read job file" in gone.stderr, gone.stderr


def test_the_job_s_final_status_has_every_worker_s_final_progress(tmp_path: Path) -> None:
    """Each worker's last counters reach the tracker with its shutdown: the status (and so
    the metrics) at the end of a job show every call and checkpoint it made, not those of
    its last periodic heartbeat."""
    from tracker.server import TrackerThread  # noqa: PLC0415

    iterations = 7
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace(f"range(version, {ITERATIONS})",
                                     f"range(version, {iterations})"))
    tracker = TrackerThread(3, secret=bytes(range(32)))
    tracker.start()
    try:
        env = {**os.environ, **tracker.worker_env(), "PYTHONPATH": str(ROOT),
               "RABIT2_RECOVER": "1", "RABIT2_HEARTBEAT_SEC": "5"}
        workers = [subprocess.Popen([sys.executable, str(script)], env={**env,
                                    "DMLC_TASK_ID": str(i)}, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True) for i in range(3)]
        for worker in workers:
            _, err = worker.communicate(timeout=60)
            assert worker.returncode == 0, err
        deadline = time.monotonic() + 10
        while tracker.result() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        result = tracker.result()
        assert result is not None and result.success, result
        status = tracker.status()
    finally:
        tracker.stop()
    assert status is not None
    for task in status["tasks"]:
        assert task["progress"]["calls"] == iterations, task
        assert task["progress"]["version"] == iterations, task


def test_a_standalone_tracker_serves_metrics_until_it_stops(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.cli", "-n", "2", "--metrics-port", "0",
         "--log-level", "INFO"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = None
        deadline = time.monotonic() + 30
        assert proc.stderr is not None
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None
            found = re.search(r"metrics at (http://\S+)", proc.stderr.readline())
            url = found.group(1) if found else None
        samples = scrape(url)
        assert samples is not None
        assert samples[("rabit2_job_world_size", ())] == 2
        assert samples[("rabit2_job_workers_registered", ())] == 0
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert scrape(url) is None


@pytest.mark.parametrize("argv, message", [
    (["--query"], "no running rabit2-submit job"),
    (["--query", "{missing}"], "cannot read job file"),  # (a job that ended: its file gone)
])
def test_a_query_that_finds_no_job_says_so(tmp_path: Path, argv: list[str],
                                            message: str) -> None:
    env = {**os.environ, "RABIT2_RUN_DIR": str(tmp_path)}
    argv = [arg.format(missing=tmp_path / "gone.json") for arg in argv]
    done = subprocess.run([sys.executable, "-m", "tracker.cli", *argv], capture_output=True,
                          text=True, timeout=30, env=env, cwd=ROOT, check=False)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("named", ["in the run folder", "by --status-file"])
def test_a_query_of_a_job_file_left_by_a_killed_launcher_says_the_job_ended(
        tmp_path: Path, named: str) -> None:
    """A launcher killed with SIGKILL leaves its job file; asking through it says that its
    launcher is gone, not only that nothing listens at the tracker's address: the file's
    name says which launcher in the run folder, its pid and host fields elsewhere."""
    import socket  # noqa: PLC0415

    from tracker import jobfile  # noqa: PLC0415

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    info = {"host": "127.0.0.1", "port": port, "secret": "00ff", "pid": gone.pid,
            "launcher_host": socket.gethostname()}
    name = f"job-{jobfile._HOST}-{gone.pid}.json" if named == "in the run folder" else "k.json"
    left = jobfile.write(info, tmp_path / name)
    done = subprocess.run([sys.executable, "-m", "tracker.cli", "--query", str(left)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    assert done.returncode == 1, done.stderr
    assert ("the launcher that wrote that job file no longer runs (it was killed before it "
            "could remove it): its job has ended") in done.stderr, done.stderr


def test_a_taken_metrics_port_is_a_one_line_error(tmp_path: Path) -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "1",
             "--metrics-port", str(port), "--", sys.executable, "-c", "pass"],
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
            env={**os.environ, "RABIT2_RUN_DIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("rabit2-submit: error: the metrics endpoint cannot listen")
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # no job file left behind
