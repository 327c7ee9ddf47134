"""``rabit2-submit --cluster ssh`` across hosts: real sshd servers in network namespaces.

Three hosts on a private bridge (tests/support/netns.py): the launcher, with its tracker, runs on
host 1; an sshd on each of hosts 2 and 3 starts two workers each.  Every byte stays in the
namespaces.  Skipped (with the reason) where namespaces or OpenSSH are missing; `.ci/run`
installs openssh-server.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import WORKERS, netns
from tests.support.jobs import assert_one_model, assert_one_xgboost_model, need_federated_xgboost

pytestmark = pytest.mark.timeout(180)

SSHD = "/usr/sbin/sshd"
WORKER = textwrap.dedent(
    """
    import os, socket, sys
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    rank, world = rabit2.get_rank(), rabit2.get_world_size()
    # the address this worker's peers dial: the host it runs on
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((os.environ["DMLC_TRACKER_URI"], 9))
    here = probe.getsockname()[0]
    data = np.arange(300_000, dtype=np.float64) * (rank + 1)
    rabit2.allreduce(data, rabit2.Op.SUM)
    assert np.array_equal(data, np.arange(300_000, dtype=np.float64)
                          * (world * (world + 1) // 2))
    model = rabit2.broadcast({"from": rank} if rank == 0 else None, 0)
    assert model == {"from": 0}
    corrupt = rabit2.recovery_statistics()["corrupt_frames"]
    print(f"rank={rank} world={world} host={here} ok corrupt_frames={corrupt}", flush=True)
    rabit2.finalize()
    """
)


def _why_not() -> str | None:
    for tool in (SSHD, shutil.which("ssh"), shutil.which("ssh-keygen")):
        if tool is None or not os.path.exists(tool):
            return "OpenSSH (client and server) is not installed"
    return netns.available()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[netns.Testbed, Path]]:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    keys = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
                       check=True)
    (keys / "authorized_keys").write_text((keys / "id.pub").read_text())
    (keys / "sshd_config").write_text(textwrap.dedent(f"""\
        HostKey {keys / 'host_key'}
        AuthorizedKeysFile {keys / 'authorized_keys'}
        PermitRootLogin prohibit-password
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        UsePAM no
        StrictModes no
        """))
    (keys / "ssh_config").write_text(textwrap.dedent(f"""\
        Host *
          IdentityFile {keys / 'id'}
          IdentitiesOnly yes
          StrictHostKeyChecking no
          UserKnownHostsFile /dev/null
          LogLevel ERROR
        """))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    bed = netns.Testbed(3).up()
    try:
        for host in (2, 3):
            subprocess.run(bed.run(host, [SSHD, "-f", str(keys / "sshd_config"),
                                          "-o", f"ListenAddress={bed.addr(host)}",
                                          "-o", f"PidFile={keys / f'sshd{host}.pid'}"]),
                           check=True)
        (keys / "hosts").write_text(f"{bed.addr(2)} slots=2\n{bed.addr(3)} slots=2\n")
        (keys / "worker.py").write_text(WORKER)
        # wait until both servers answer (bounded)
        deadline = time.monotonic() + 20
        for host in (2, 3):
            while subprocess.run(bed.run(1, ["ssh", "-F", str(keys / "ssh_config"),
                                             "-o", "BatchMode=yes", bed.addr(host), "true"]),
                                 check=False, capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, f"sshd on host {host} never answered"
                time.sleep(0.2)
        yield bed, keys
    finally:
        bed.down()


def submit(bed: netns.Testbed, keys: Path, *command: str,
           extra: tuple[str, ...] = ()) -> list[str]:
    """The rabit2-submit command line, run on host 1."""
    return bed.run(1, [
        sys.executable, "-m", "tracker.submit", "--cluster", "ssh",
        "--host-file", str(keys / "hosts"), "--ssh", f"ssh -F {keys / 'ssh_config'}",
        "-n", "4", "--kill-grace", "1", *extra, "--", sys.executable, *command,
    ])


def workers_left(bed: netns.Testbed) -> list[int]:
    """Processes on the worker hosts other than their sshd."""
    left = []
    for host in (2, 3):
        for pid in bed.pids(host):
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue  # gone meanwhile
            if not exe.endswith("/sshd"):
                left.append(pid)
    return left


def test_a_job_runs_across_hosts(cluster: tuple[netns.Testbed, Path]) -> None:
    bed, keys = cluster
    done = subprocess.run(submit(bed, keys, str(keys / "worker.py")), check=False,
                          capture_output=True, text=True, timeout=120, cwd=keys)
    assert done.returncode == 0, done.stdout + done.stderr
    hosts = dict(re.findall(r"rank=(\d) world=4 host=(\S+) ok", done.stdout))
    # filled slot by slot: tasks 0-1 on host 2, tasks 2-3 on host 3 (ranks follow task ids)
    assert hosts == {"0": bed.addr(2), "1": bed.addr(2), "2": bed.addr(3), "3": bed.addr(3)}
    assert "every rank shut down" in done.stderr
    assert workers_left(bed) == []


def test_a_byte_damaged_between_hosts_is_caught_by_default_and_the_link_resumes(
    cluster: tuple[netns.Testbed, Path],
) -> None:
    """Rank 1 (host 2) damages one byte that arrives from rank 2 (host 3) in the middle of
    the ring allreduce.  Links between hosts carry payload checksums by default
    (``rabit2_checksum=auto``, given here: a damage mock alone turns them on everywhere):
    the frame is refused, the link resets and resumes, and every rank's result is the exact
    one (the worker asserts it)."""
    bed, keys = cluster
    done = subprocess.run(submit(bed, keys, str(keys / "worker.py"), "mock=1,0,0,0,65536,2,1",
                                 "rabit2_checksum=auto"),
                          check=False, capture_output=True, text=True, timeout=120, cwd=keys)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "damages a byte from rank 2" in done.stdout + done.stderr
    counts = dict(re.findall(r"rank=(\d) world=4 host=\S+ ok corrupt_frames=(\d+)",
                             done.stdout))
    assert counts == {"0": "0", "1": "1", "2": "0", "3": "0"}, done.stdout + done.stderr
    assert re.search(r"^1\s+1\s+1\s+0\s+ok$", done.stderr, re.M), done.stderr  # no restart
    assert workers_left(bed) == []


def test_a_worker_killed_on_a_remote_host_is_restarted_and_the_job_recovers(
    cluster: tuple[netns.Testbed, Path],
) -> None:
    bed, keys = cluster
    done = subprocess.run(
        submit(bed, keys, "-m", "rabit2.examples.gbdt", "--size", "ci", "mock=2,3,1,0"),
        check=False, capture_output=True, text=True, timeout=150, cwd=keys,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert_one_model(done.stdout, 4)
    assert re.search(r"^2\s+2\s+2\s+0\s+ok$", done.stderr, re.M), done.stderr  # 2 attempts
    assert workers_left(bed) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_remote_worker_outlives_its_launcher(
    cluster: tuple[netns.Testbed, Path], signum: signal.Signals
) -> None:
    """Stopped (SIGTERM) or killed outright (SIGKILL, no clean-up code runs), the launcher
    leaves nothing behind on the hosts: its ssh pipes close, and tracker.remote stops the
    workers."""
    bed, keys = cluster
    sleeper = keys / "sleeper.py"
    sleeper.write_text("import time, rabit2\nrabit2.init()\nprint('up', flush=True)\n"
                       "time.sleep(300)\n")
    proc = subprocess.Popen(submit(bed, keys, str(sleeper)), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=keys)
    try:
        assert proc.stdout is not None
        ups = 0
        deadline = time.monotonic() + 60
        while ups < 4:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "the workers never came up"
            ups += line.rstrip().endswith("] up")
        assert len(workers_left(bed)) >= 4
        proc.send_signal(signum)
        proc.wait(timeout=30)
    finally:
        with proc:  # (closes its pipes)
            proc.kill()
    deadline = time.monotonic() + 20
    while workers_left(bed):
        assert time.monotonic() < deadline, f"left on the hosts: {workers_left(bed)}"
        time.sleep(0.1)


PARTITIONED = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    rank = rabit2.get_rank()
    try:
        for it in range(3000):  # ~5 minutes unless something ends it
            data = np.full(100_000, rank + 1.0)
            rabit2.allreduce(data, rabit2.Op.SUM)
            assert (data == 10.0).all()
            if rank == 0:
                print(f"iteration {it}", flush=True)
            time.sleep(0.1)
    except rabit2.RabitError as exc:
        print(f"rank={rank} failed {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    rabit2.finalize()
    """
)


def _partitioned_job_under_way(bed: netns.Testbed,
                               keys: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """The PARTITIONED job started on host 1, read until its iteration 5 (60 s at most);
    the job and the lines read.  The caller ends it (kill) whatever happens."""
    script = keys / "partitioned.py"
    script.write_text(PARTITIONED)
    proc = subprocess.Popen(submit(bed, keys, str(script), "rabit2_link_timeout_sec=4"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=keys)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while not any("iteration 5" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, lines


def _rest_of(proc: subprocess.Popen[str], lines: list[str]) -> str:
    """The job's output until it ends (150 s at most: its output so far if not)."""
    try:
        rest, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("".join(lines) + str(exc.output)) from None
    return str(rest)


def test_a_partition_between_two_hosts_that_both_reach_the_tracker_ends_the_job_typed(
    cluster: tuple[netns.Testbed, Path],
) -> None:
    """Hosts 2 and 3 stop reaching each other (a blackhole route each way) in the middle of
    the job, while both still reach the tracker on host 1.  No restart can mend that: every
    rank fails with JobAbortedError naming the partition soon after the links' timeout
    (``rabit2_link_timeout_sec``, 4 s here: the links' TCP_USER_TIMEOUT, then three
    quarters of it until the tracker is asked whether the peer lives), instead of waiting
    for the progress deadline (30 minutes by default)."""
    bed, keys = cluster
    proc, lines = _partitioned_job_under_way(bed, keys)
    routes = [(2, bed.addr(3)), (3, bed.addr(2))]
    cut = False
    try:
        for host, other in routes:
            subprocess.run(bed.run(host, ["ip", "route", "add", "blackhole", f"{other}/32"]),
                           check=True)
        cut = True
        started = time.monotonic()
        rest = _rest_of(proc, lines)
        took = time.monotonic() - started
    finally:
        if cut:
            for host, other in routes:
                subprocess.run(bed.run(host, ["ip", "route", "del", "blackhole", f"{other}/32"]),
                               check=False)
        proc.kill()
        proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode != 0, out
    failed = dict(re.findall(r"rank=(\d) failed (\w+): ", out))
    assert failed == dict.fromkeys("0123", "JobAbortedError"), out
    assert "cannot reach each other while both reach the tracker" in out, out
    assert f"({bed.addr(2)} and {bed.addr(3)})" in out or (
        f"({bed.addr(3)} and {bed.addr(2)})" in out), out
    assert took < 60, (took, out)
    print(f"partition to the end of the job: {took:.1f} s")
    assert workers_left(bed) == []


@pytest.mark.slow  # (about a minute: the tracker's connection timeout, then the restarts)
def test_a_host_that_becomes_unreachable_is_given_up_on_naming_it(
    cluster: tuple[netns.Testbed, Path],
) -> None:
    """Host 3 (ranks 2 and 3) drops off the network mid-job, its ssh sessions with it.  The
    tracker loses their connections (timed out) and, after its rejoin grace, declares them
    lost; the launcher kills their ssh, which would wait for many minutes, and restarts
    them, which fails while the host is gone, so the job ends naming a task of that host,
    instead of waiting for the survivors' recovery deadline (300 s) and blaming rank 0."""
    bed, keys = cluster
    proc, lines = _partitioned_job_under_way(bed, keys)
    down = False
    try:
        subprocess.run(bed.run(3, ["ip", "link", "set", "eth0", "down"]), check=True)
        down = True
        started = time.monotonic()
        rest = _rest_of(proc, lines)
        took = time.monotonic() - started
    finally:
        if down:
            subprocess.run(bed.run(3, ["ip", "link", "set", "eth0", "up"]), check=False)
        proc.kill()
        proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 1, out
    assert re.search(r"task [23] lost its tracker connection \(.*\); killing it", out), out
    cause = re.search(r"root cause: (.*)", out)
    assert cause is not None and re.search(r"task [23]", cause.group(1)), out
    assert took < 90, (took, out)
    print(f"host down to the end of the job: {took:.1f} s")
    # back on the network, what was left there learns that its session is gone
    deadline = time.monotonic() + 90
    while workers_left(bed):
        assert time.monotonic() < deadline, workers_left(bed)
        time.sleep(0.5)


def test_xgboost_1_7_workers_across_hosts_with_the_classic_protocol(
    cluster: tuple[netns.Testbed, Path], tmp_path: Path,
) -> None:
    """XGBoost 1.7.6 workers (the classic rabit engine) on two hosts, their tracker on a
    third: served with --classic any (the protocol has no secret), the same model as the
    same job on one host."""
    from tests.integration.test_classic_tracker import WORKER as CLASSIC_WORKER  # noqa: PLC0415
    from tests.integration.test_classic_tracker import xgb17_python  # noqa: PLC0415

    python = xgb17_python()
    bed, keys = cluster
    worker = keys / "classic_worker.py"
    worker.write_text(CLASSIC_WORKER)
    across, local = keys / "across.json", tmp_path / "local.json"
    done = subprocess.run(
        bed.run(1, [sys.executable, "-m", "tracker.submit", "--cluster", "ssh",
                    "--host-file", str(keys / "hosts"), "--ssh",
                    f"ssh -F {keys / 'ssh_config'}", "-n", "4", "--kill-grace", "1",
                    "--classic", "any", "--remote-python", sys.executable, "--",
                    str(python), str(worker), str(across)]),
        check=False, capture_output=True, text=True, timeout=150, cwd=keys)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank} of 4 trained" in done.stdout, done.stdout
    alone = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "4", "--",
         str(python), str(worker), str(local)],
        check=False, capture_output=True, text=True, timeout=150, cwd=keys)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert across.read_bytes() == local.read_bytes()
    assert workers_left(bed) == []


def test_a_host_that_refuses_ssh_fails_the_job_with_ssh_s_reason(tmp_path: Path) -> None:
    """No sshd where the host file points (a closed port on loopback): every attempt fails
    at once with ssh's own message, and the job ends after --max-attempts, typed, without
    waiting.  Needs only the ssh client."""
    if shutil.which("ssh") is None:
        pytest.skip("the OpenSSH client is not installed")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1:{port}\n")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "ssh", "--host-file", str(hosts),
         "--ssh", "ssh -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
         "-n", "2", "--max-attempts", "2", "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Connection refused" in done.stderr
    assert "exited with 255 after 2 attempts" in done.stderr
    assert time.monotonic() - started < 60


def test_xgboost_training_across_hosts_recovers_a_remote_worker(
    cluster: tuple[netns.Testbed, Path],
) -> None:
    """Real XGBoost through rabit2.xgboost on two ssh hosts, rank 2 killed mid-round: it is
    restarted on its host and every rank ends with one model."""
    need_federated_xgboost()
    bed, keys = cluster
    worker = str(WORKERS / "xgb_worker.py")
    done = subprocess.run(submit(bed, keys, worker, "--kill", "2,2,mid"), check=False,
                          capture_output=True, text=True, timeout=170, cwd=keys)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_one_xgboost_model(done.stdout, 4)
    assert re.search(r"^2\s+2\s+2\s+0\s+ok$", done.stderr, re.M), done.stderr
    assert workers_left(bed) == []
