"""tracker.remote, the far end of ``rabit2-submit --cluster ssh``, as a real process.

It is started here as ssh would start it (its stdin a pipe from the launcher); tests/
cluster/test_ssh_cluster.py runs it through a real sshd.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.jobs import assert_gone
from tracker.remote import HeaderError, check_header, encode_header

pytestmark = pytest.mark.timeout(60)


def start(*command: str, wait: float = 20.0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tracker.remote", "--wait", str(wait), "--", *command],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen[bytes], header: bytes) -> tuple[str, str]:
    """Send the job description and keep stdin open (its end would stop the command) until
    the command has exited on its own; returns its output."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(header)
    proc.stdin.flush()
    proc.wait(timeout=20)
    proc.stdin.close()
    with proc:  # (closes its pipes)
        return proc.stdout.read().decode(), proc.stderr.read().decode()


def test_runs_the_command_with_the_job_environment_and_returns_its_status() -> None:
    proc = start(sys.executable, "-c",
                 "import os, sys; print(os.environ['JOB_VAR'], os.environ.get('PATH') is not None);"
                 " sys.exit(7)")
    out, err = finish(proc, encode_header({"JOB_VAR": "a b=c"}, 1.0))
    assert proc.returncode == 7, err
    assert out.split() == ["a", "b=c", "True"]  # the host's own PATH is kept


def test_a_signal_death_is_reported_as_the_shell_does() -> None:
    proc = start(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _out, err = finish(proc, encode_header({}, 1.0))
    assert proc.returncode == 128 + 9, err


def test_the_launcher_going_away_stops_the_whole_process_group(tmp_path: Path) -> None:
    """End of stdin (the launcher or its ssh gone) stops the command and its children, even
    one that ignores SIGTERM (SIGKILL after the grace period)."""
    pids = tmp_path / "pids"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(300)\n"
    )
    proc = start(sys.executable, "-c", script)
    assert proc.stdin is not None
    proc.stdin.write(encode_header({}, 0.5))
    proc.stdin.flush()
    deadline = time.monotonic() + 20
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    worker, grandchild = map(int, pids.read_text().split())
    started = time.monotonic()
    proc.stdin.close()
    proc.wait(timeout=20)
    proc.stdout.close()
    proc.stderr.close()
    assert time.monotonic() - started < 10
    assert proc.returncode == 128 + 9  # SIGTERM was ignored, SIGKILL was not
    assert_gone((worker, grandchild), 10)


def _pids_from(path: Path, proc: subprocess.Popen[bytes], count: int) -> list[int]:
    deadline = time.monotonic() + 20
    while not path.exists() or len(path.read_text().split()) < count:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return [int(word) for word in path.read_text().split()]


def test_what_a_finished_command_left_in_its_group_is_stopped(tmp_path: Path) -> None:
    """A worker that exits 0 and leaves a helper running: the helper is stopped (SIGKILL
    after the grace where it ignores SIGTERM), so it neither holds the ssh session open nor
    outlives the job on the host, and the status stays the worker's."""
    pids = tmp_path / "pids"
    script = (
        "import subprocess, sys\n"
        "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(300)'\n"
        "helper = subprocess.Popen([sys.executable, '-c', code])\n"
        f"open({str(pids)!r}, 'w').write(str(helper.pid))\n"
    )
    proc = start(sys.executable, "-c", script)
    started = time.monotonic()
    _out, err = finish(proc, encode_header({}, 0.5))
    assert proc.returncode == 0, err
    assert "stopped what" in err and "left running in its process group" in err, err
    assert time.monotonic() - started < 10
    assert_gone(tuple(int(w) for w in pids.read_text().split()), 10)


def test_a_stop_kills_what_ignores_sigterm_after_the_command_died(tmp_path: Path) -> None:
    """Ctrl-C (end of stdin): the command dies of the SIGTERM, a member of its group that
    ignores SIGTERM gets the SIGKILL that follows the grace, before this program exits."""
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time\n"
        "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(300)'\n"
        "helper = subprocess.Popen([sys.executable, '-c', code])\n"
        "time.sleep(0.5)\n"  # (the helper's handler is in place)
        f"open({str(pids)!r}, 'w').write(str(helper.pid))\n"
        "time.sleep(300)\n"
    )
    proc = start(sys.executable, "-c", script)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(encode_header({}, 0.5))
    proc.stdin.flush()
    (helper,) = _pids_from(pids, proc, 1)
    proc.stdin.close()
    proc.wait(timeout=20)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == 128 + 15  # (the command itself took the SIGTERM)
    assert_gone((helper,), 5)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not json\n", "not JSON"),
        (b'["env"]\n', "must be a JSON object"),
        (b'{"env": {"A": 1}}\n', "map variable names to strings"),
        (b'{"env": {"A=B": "1"}}\n', "map variable names to strings"),
        (b'{"env": {}, "kill_grace": -1}\n', "kill_grace"),
        (b"", "stdin closed"),
    ],
)
def test_a_bad_job_description_is_refused_without_running_anything(
    payload: bytes, message: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    proc = start(sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    _out, err = proc.communicate(payload, timeout=20)
    assert proc.returncode == 2
    assert message in err.decode()
    assert not marker.exists()


def test_no_job_description_in_time_is_an_error_not_a_hang() -> None:
    proc = start(sys.executable, "-c", "pass", wait=0.5)
    started = time.monotonic()
    proc.wait(timeout=20)  # stdin stays open and silent
    assert proc.returncode == 2
    assert proc.stderr is not None and proc.stdin is not None
    assert "no job description on stdin within 0.5 s" in proc.stderr.read().decode()
    assert time.monotonic() - started < 15
    proc.stdin.close()
    proc.stdout.close()
    proc.stderr.close()


def test_an_unstartable_command_exits_127() -> None:
    proc = start("/nonexistent/python")
    _out, err = finish(proc, encode_header({}, 1.0))
    assert proc.returncode == 127 and "cannot start" in err


def test_check_header_accepts_what_encode_header_writes() -> None:
    import json  # noqa: PLC0415

    check_header(json.loads(encode_header({"K": "v"}, 2)))
    with pytest.raises(HeaderError):
        check_header({"env": {"": "x"}})
    with pytest.raises(HeaderError):
        check_header({"env": {}, "kill_grace": True})
