"""``rabit2-submit --cluster slurm`` and ``--cluster mpi`` with the real launchers.

Slurm: a private slurmctld + slurmd (one node, this machine, free ports, state in a
temporary directory) started by the fixture and stopped after.  MPI: Open MPI's mpirun.
Each is skipped, with the reason, where it is not installed; `.ci/run` installs both.
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

from tests.support import WORKERS
from tests.support.jobs import (
    assert_gone,
    assert_one_model,
    assert_one_xgboost_model,
    need_federated_xgboost,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

GBDT = ("-m", "rabit2.examples.gbdt", "--size", "ci", "mock=2,3,1,0")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop_daemon(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster of this machine; yields the environment that points at it."""
    tools = [shutil.which(tool) for tool in ("srun", "sinfo", "slurmctld", "slurmd")]
    if None in tools:
        pytest.skip("Slurm (slurm-wlm) is not installed")
    if os.geteuid() != 0:
        pytest.skip("the private Slurm daemons run as root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    # (config_overrides below lets this 2-core machine offer 8 CPUs: 4 workers oversubscribed)
    node = ("CPUs=8 Sockets=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=2000 "
            "State=UNKNOWN")
    conf.write_text(textwrap.dedent(f"""\
        ClusterName=rabit2test
        SlurmctldHost={host}(127.0.0.1)
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/none
        CredType=cred/none
        MpiDefault=none
        ProctrackType=proctrack/pgid
        TaskPlugin=task/none
        SwitchType=switch/none
        SchedulerType=sched/backfill
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        ReturnToService=2
        SlurmctldPort={_free_port()}
        SlurmdPort={_free_port()}
        StateSaveLocation={d}/state
        SlurmdSpoolDir={d}/spool
        SlurmctldPidFile={d}/slurmctld.pid
        SlurmdPidFile={d}/slurmd.pid
        SlurmctldLogFile={d}/log/slurmctld.log
        SlurmdLogFile={d}/log/slurmd.log
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        NodeName={host} NodeAddr=127.0.0.1 {node}
        PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
        SlurmdParameters=config_overrides
        """))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(conf)], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 30
        while subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                             text=True, check=False).stdout.strip() != "idle":
            if time.monotonic() > deadline:
                log = (d / "log" / "slurmctld.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"the private Slurm node never became idle:\n{log}")
            time.sleep(0.2)
        yield env
    finally:
        _stop_daemon(d / "slurmd.pid")
        _stop_daemon(d / "slurmctld.pid")


def _mpirun() -> str:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed")
    flags = " --oversubscribe"  # 4 workers on 2 cores
    if os.geteuid() == 0:
        flags += " --allow-run-as-root"
    return mpirun + flags


def submit(cluster: str, *command: str, extra: tuple[str, ...] = ()) -> list[str]:
    launcher = ("--mpirun", _mpirun()) if cluster == "mpi" else ()
    return [sys.executable, "-m", "tracker.submit", "--cluster", cluster, "-n", "4",
            "--tracker-host", "127.0.0.1", "--kill-grace", "1", *launcher, *extra, "--",
            sys.executable, *command]


@pytest.fixture(params=["slurm", "mpi"])
def cluster(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    if request.param == "slurm":
        return "slurm", request.getfixturevalue("slurm")
    _mpirun()  # (skips where there is none)
    return "mpi", dict(os.environ)


def test_a_killed_worker_is_restarted_in_its_slot_and_the_job_recovers(
    cluster: tuple[str, dict[str, str]],
) -> None:
    kind, env = cluster
    done = subprocess.run(submit(kind, *GBDT), env=env, capture_output=True, text=True,
                          timeout=150, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_one_model(done.stdout, 4)
    assert "[rabit2 slot 2] exited with 137 (attempt 1/3); restarting" in done.stderr
    assert re.search(r"^2\s+2\s+2\s+-\s+done$", done.stderr, re.M), done.stderr
    assert "job: every rank shut down" in done.stderr
    if kind == "slurm":  # srun's --label, relabelled as the other back-ends do
        assert re.search(r"^\[rank 0\] gbdt rank=0 ", done.stdout, re.M), done.stdout


def test_a_worker_that_keeps_failing_ends_the_job_at_once(
    cluster: tuple[str, dict[str, str]],
) -> None:
    """Rank 1 dies in every attempt while the others wait in a call for its replacement:
    when its slot gives up it tells the tracker, which aborts the job, so the others raise
    JobAbortedError at once instead of waiting out rabit2_recover_timeout_sec (300 s)."""
    kind, env = cluster
    script = ("import os, numpy as np, rabit2\nrabit2.init()\n"
              "a = np.ones(4)\nrabit2.allreduce(a, rabit2.Op.SUM)\n"
              "if rabit2.get_rank() == 1:\n    os._exit(5)\n"
              "rabit2.allreduce(a, rabit2.Op.SUM)\nrabit2.finalize()\n")
    start = time.monotonic()
    done = subprocess.run(submit(kind, "-c", script, extra=("--max-attempts", "2")), env=env,
                          capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[rabit2 slot 1] exited with 5 after 2 attempts; giving up" in done.stderr
    assert "JobAbortedError" in done.stderr and "failed for good" in done.stderr
    assert re.search(r"^root cause: rank 1 \(task 1\) was lost at \d\d:\d\d:\d\d: ",
                     done.stderr, re.M), done.stderr
    assert time.monotonic() - start < 90


@pytest.mark.parametrize(("cluster", "how"), [
    ("slurm", "SIGTERM"), ("slurm", "timeout"), ("mpi", "SIGTERM"), ("slurm", "SIGTERM twice"),
    pytest.param("mpi", "timeout", marks=pytest.mark.slow),  # (the soak run)
    pytest.param("mpi", "SIGTERM twice", marks=pytest.mark.slow),
], indirect=["cluster"])
def test_no_worker_outlives_the_launcher(cluster: tuple[str, dict[str, str]], how: str,
                                         tmp_path: Path) -> None:
    kind, env = cluster
    pids = tmp_path / "pids"
    pids.mkdir()
    sleeper = ("import os, time, rabit2\nrabit2.init()\n"
               f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
               "time.sleep(300)\n")
    extra = ("--timeout", "8") if how == "timeout" else ()
    proc = subprocess.Popen(submit(kind, "-c", sleeper, extra=extra), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(list(pids.iterdir())) == 4, 60, proc, "4 workers up")
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        if how == "SIGTERM twice":  # (a second one while it stops the group: at once)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    if how.startswith("SIGTERM"):
        assert proc.returncode == 130, err
        assert "summary:" in err and "Traceback" not in err, err
    else:
        assert proc.returncode == 1 and "timed out after 8s" in err, err
    assert_gone((int(p.name) for p in pids.iterdir()), 20, "worker")


def test_an_elastic_job_goes_on_without_a_worker_out_of_attempts(
        cluster: tuple[str, dict[str, str]]) -> None:
    """Elastic mode: rank 1's worker exits 7 with no attempt left; the others finish the
    job without it, and neither mpirun (which stops every process once one exits non-zero)
    nor srun's status fails it.  A worker that exits non-zero after the job succeeded is
    named in the job line."""
    kind, env = cluster
    code = ("import os, numpy as np, rabit2\n"
            "rabit2.init()\n"
            "r = rabit2.get_rank()\n"
            "for step in range(6):\n"
            "    try:\n"
            "        with rabit2.live_set():\n"
            "            if r == 1 and step == 3:\n"
            "                os._exit(7)\n"
            "            rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
            "    except rabit2.LiveSetError:\n"
            "        pass\n"
            "rabit2.tracker_print(f'DONE {r}')  # (whole lines: mpirun interleaves prints)\n"
            "rabit2.finalize()\n")
    done = subprocess.run(submit(kind, "-c", code, extra=("--elastic", "--max-attempts", "1")),
                          env=env, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert sorted(re.findall(r"DONE (\d)", done.stdout)) == ["0", "2", "3"], done.stdout
    if kind == "mpi":
        return  # (mpirun stops the others once one exits non-zero: slurm's case below)
    late_code = ("import sys, numpy as np, rabit2\n"
                 "rabit2.init()\n"
                 "r = rabit2.get_rank()\n"
                 "rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
                 "rabit2.finalize()\n"
                 "sys.exit(4 if r == 2 else 0)\n")
    late = subprocess.run(submit(kind, "-c", late_code), env=env, capture_output=True,
                          text=True, timeout=150, check=False)
    assert late.returncode == 1, late.stderr[-3000:]
    assert "job: every rank shut down; but srun exited with 4" in late.stderr, late.stderr


@pytest.mark.parametrize("cluster", ["slurm", pytest.param("mpi", marks=pytest.mark.slow)],
                         indirect=True)  # (mpi: the soak run; the slot code is shared)
def test_a_paused_worker_is_killed_by_its_slot_and_replaced(
    cluster: tuple[str, dict[str, str]],
) -> None:
    """Rank 1 stops itself (SIGSTOP: alive, silent). The tracker declares it lost after
    --heartbeat-timeout; its slot, watching the tracker, kills it; the replacement
    rejoins and the job finishes with the right sums."""
    kind, env = cluster
    script = ("import os, signal, numpy as np, rabit2\nrabit2.init()\n"
              "a = np.ones(4)\nrabit2.allreduce(a, rabit2.Op.SUM)\n"
              "if rabit2.get_rank() == 1 and os.environ['DMLC_NUM_ATTEMPT'] == '0':\n"
              "    os.kill(os.getpid(), signal.SIGSTOP)\n"
              "b = np.ones(4) * (rabit2.get_rank() + 1)\nrabit2.allreduce(b, rabit2.Op.SUM)\n"
              "assert a.tolist() == [4.0] * 4 and b.tolist() == [10.0] * 4, (a, b)\n"
              "print('sums ok', flush=True)\nrabit2.finalize()\n")
    done = subprocess.run(submit(kind, "-c", script, extra=("--heartbeat-timeout", "2")),
                          env=env, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("sums ok") == 4
    assert "[rabit2 slot 1] the tracker declared it lost" in done.stderr
    assert re.search(r"^1\s+1\s+2\s+-\s+done$", done.stderr, re.M), done.stderr


def test_xgboost_1_7_workers_under_the_cluster_launchers(
    cluster: tuple[str, dict[str, str]], tmp_path: Path,
) -> None:
    """XGBoost 1.7.6 workers (the classic rabit protocol) started by srun or mpirun: one
    model, the same as under rabit2-submit --cluster local, and every rank in the summary.
    (The slots run rabit2's Python; the workers run the XGBoost 1.7 environment's.)"""
    from tests.integration.test_classic_tracker import WORKER as CLASSIC_WORKER  # noqa: PLC0415
    from tests.integration.test_classic_tracker import xgb17_python  # noqa: PLC0415

    python = xgb17_python()
    kind, env = cluster
    worker = tmp_path / "classic_worker.py"
    worker.write_text(CLASSIC_WORKER)
    there, here = tmp_path / "there.json", tmp_path / "here.json"
    launcher = ("--mpirun", _mpirun()) if kind == "mpi" else ()
    done = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", kind, "-n", "4",
         "--tracker-host", "127.0.0.1", "--kill-grace", "1", *launcher,
         "--remote-python", sys.executable, "--", str(python), str(worker), str(there)],
        env=env, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank} of 4 trained" in done.stdout, done.stdout
        assert re.search(rf"^{rank}\s+{rank}\s+1\s+-\s+done$", done.stderr, re.M), done.stderr
    assert "job: every rank shut down" in done.stderr
    local = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "4", "--",
         str(python), str(worker), str(here)],
        capture_output=True, text=True, timeout=170, check=False)
    assert local.returncode == 0, local.stdout + local.stderr
    assert there.read_bytes() == here.read_bytes()


@pytest.mark.parametrize("cluster", ["slurm", pytest.param("mpi", marks=pytest.mark.slow)],
                         indirect=True)  # (mpi: the soak run; the group code is shared)
def test_a_failed_classic_job_is_stopped_at_once_under_the_cluster_launchers(
    cluster: tuple[str, dict[str, str]], tmp_path: Path,
) -> None:
    """XGBoost 1.7 workers cannot be told that the job was given up on (the classic
    protocol has no abort): when rank 1 leaves without finalizing, srun or mpirun is stopped
    at once rather than left until the others' own timeouts, and no worker outlives it."""
    from tests.integration.test_classic_tracker import WORKER as CLASSIC_WORKER  # noqa: PLC0415
    from tests.integration.test_classic_tracker import xgb17_python  # noqa: PLC0415

    python = xgb17_python()
    kind, env = cluster
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = tmp_path / "classic_worker.py"
    # (each worker leaves its pid; the others then wait in XGBoost 1.7's first collective
    # for rank 1, which never comes)
    worker.write_text(f"import os\nopen(os.path.join({str(pids)!r}, str(os.getpid())), "
                      "'w').close()\n" + CLASSIC_WORKER)
    launcher = ("--mpirun", _mpirun()) if kind == "mpi" else ()
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", kind, "-n", "3",
         "--tracker-host", "127.0.0.1", "--kill-grace", "1", *launcher,
         "--remote-python", sys.executable, "--", str(python), str(worker),
         str(tmp_path / "model.json")],
        env={**env, "LEAVE": "without-finalize"}, capture_output=True, text=True,
        timeout=170, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("the job's workers speak the classic rabit protocol, which has no abort; "
            "stopping") in done.stderr, done.stderr
    assert "without rabit2.finalize() while the job ran" in done.stderr, done.stderr
    assert time.monotonic() - start < 60, done.stderr
    assert_gone((int(p.name) for p in pids.iterdir()), 20, "worker")


@pytest.mark.parametrize("cluster", ["slurm", pytest.param("mpi", marks=pytest.mark.slow)],
                         indirect=True)  # (mpi: the soak run; the slot code is shared)
def test_xgboost_training_recovers_under_the_cluster_launchers(
    cluster: tuple[str, dict[str, str]],
) -> None:
    """Real XGBoost through rabit2.xgboost, rank 2 killed mid-round: its slot restarts it,
    it takes the training state from its neighbours, and every rank ends with one model."""
    need_federated_xgboost()
    kind, env = cluster
    worker = str(WORKERS / "xgb_worker.py")
    done = subprocess.run(submit(kind, worker, "--kill", "2,2,mid"), env=env,
                          capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_one_xgboost_model(done.stdout, 4)
    assert "[rabit2 slot 2] exited with 137 (attempt 1/3); restarting" in done.stderr
