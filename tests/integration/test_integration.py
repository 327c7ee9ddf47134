"""Real processes through ``rabit2-submit``: every collective, every world size, both loops."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.support import ROOT, WORKERS


def submit(n: int, *cmd: str, loop: str = "uvloop", timeout: float = 240,
           extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RABIT2_LOOP": loop, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", str(n),
         "--max-attempts", "1", "--timeout", str(timeout - 30), *extra, "--", *cmd],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False,
    )


@pytest.mark.integration
@pytest.mark.parametrize(("world", "loop_kind"), [
    *((world, loop) for world in (1, 2) for loop in ("uvloop", "asyncio")),
    (3, "uvloop"), (4, "uvloop"),
    # (the larger worlds of both loops: the soak run; tests/sim checks every schedule at
    # them, and the recovery tests run jobs of 8)
    pytest.param(8, "uvloop", marks=pytest.mark.slow),
    pytest.param(3, "asyncio", marks=pytest.mark.slow),
    pytest.param(4, "asyncio", marks=pytest.mark.slow),
    pytest.param(8, "asyncio", marks=pytest.mark.slow),
], indirect=["loop_kind"])
def test_every_collective(world: int, loop_kind: str) -> None:
    proc = submit(world, sys.executable, str(WORKERS / "collectives.py"), loop=loop_kind)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(world):
        assert f"OK rank={rank} world={world}" in out, out[-4000:]
        assert f"rank {rank} passed" in out


@pytest.mark.integration
@pytest.mark.parametrize("world", [2, 3])
def test_a_callers_errstate_changes_no_result_and_raises_nothing(world: int) -> None:
    """inf - inf and a float16 overflow under the caller's ``np.errstate(all="raise")``, in
    calls made on the caller's thread and on the loop thread: every rank gets the IEEE
    result (what numpy gives with errors ignored), and nothing warns or raises midway (which
    left the other ranks waiting for bytes that never came)."""
    code = (
        "import sys, warnings, numpy as np, rabit2\n"
        "warnings.simplefilter('error')\n"
        "rabit2.init(sys.argv[1:])\n"
        "r = rabit2.get_rank()\n"
        "for n in (16, 300_000):\n"
        "    for dtype, value in ((np.float64, np.inf), (np.float16, 60000.0)):\n"
        "        a = np.full(n, value if r == 0 else -value if dtype == np.float64 else value,\n"
        "                    dtype=dtype)\n"
        "        with np.errstate(all='raise'):\n"
        "            rabit2.allreduce(a, rabit2.Op.SUM)\n"
        "        want = 'nan' if dtype == np.float64 else 'inf'\n"
        "        assert str(a[0]) == want and (a == a[0]).all() | np.isnan(a).all(), a\n"
        "        print(f'OK rank={r} n={n} {np.dtype(dtype).name} {a[0]}', flush=True)\n"
        "rabit2.finalize()\n")
    proc = submit(world, sys.executable, "-c", code, "rabit_timeout_sec=30", timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert len(re.findall(r"^\[rank \d\] OK rank=", proc.stdout, re.M)) == world * 4, out[-4000:]


@pytest.mark.integration
def test_0_d_arrays_keep_their_shape_on_every_rank() -> None:
    """A 0-d array broadcast (to a rank that passes None, or its own 0-d array, which is
    filled in place), one through rabit2.collective, and a read-only 0-d allreduce: 0-d
    results everywhere, with the root's value and the sum."""
    code = (
        "import numpy as np, rabit2, rabit2.collective as coll\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "got = rabit2.broadcast(np.array(7.5) if r == 0 else None, root=0)\n"
        "assert type(got) is np.ndarray and got.shape == () and got == 7.5, repr(got)\n"
        "mine = np.array(0.0)\n"
        "got = rabit2.broadcast(np.array(2.5) if r == 0 else mine, root=0)\n"
        "assert got.shape == () and got == 2.5, repr(got)\n"
        "assert r == 0 or (got is mine and mine == 2.5), repr(mine)\n"
        "got = coll.broadcast(np.array(1.5) if r == 0 else None, 0)\n"
        "assert got.shape == () and got == 1.5, repr(got)\n"
        "ro = np.array(float(r + 1))\n"
        "ro.flags.writeable = False\n"
        "got = rabit2.allreduce(ro, rabit2.Op.SUM)\n"
        "assert got.shape == () and got == 3.0 and ro == r + 1, repr(got)\n"
        "print(f'OK {r}', flush=True)\n"
        "rabit2.finalize()\n")
    proc = submit(2, sys.executable, "-c", code)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(re.findall(r"OK (\d)", proc.stdout)) == ["0", "1"], proc.stdout


@pytest.mark.integration
def test_gbdt_digest_is_the_same_for_1_2_and_4_workers() -> None:
    digests = {}
    for world in (1, 2, 4):
        proc = submit(world, sys.executable, "-m", "rabit2.examples.gbdt", "--size", "ci")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        found = set(re.findall(r"digest=([0-9a-f]{64})", out))
        assert len(re.findall(r"digest=", out)) == world, out[-2000:]
        assert len(found) == 1, found
        digests[world] = found.pop()
    assert digests[1] == digests[2] == digests[4], digests


@pytest.mark.integration
def test_mismatched_call_fails_every_rank_and_the_job() -> None:
    code = (
        "import sys, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "try:\n"
        "    rabit2.allreduce(np.zeros(100 + (r == 2), np.float32), rabit2.SUM)\n"
        "except rabit2.errors.MismatchError as exc:\n"
        "    print('MISMATCH', r, flush=True)\n"
        "    sys.exit(3)\n"
    )
    proc = submit(4, sys.executable, "-c", code, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in range(4):
        assert f"MISMATCH {rank}" in out, out[-3000:]


@pytest.mark.integration
def test_a_replay_store_that_overflows_is_reported_once() -> None:
    """With recovery on and ``rabit2_replay_mb=1``, 2 MiB results cannot be kept: every
    rank says so once (a lost worker could not be recovered), and the job still succeeds."""
    code = (
        "import numpy as np, rabit2\n"
        "rabit2.init()\n"
        "for _ in range(3):\n"
        "    x = np.ones(1 << 19, np.float32)\n"
        "    rabit2.allreduce(x, rabit2.SUM)\n"
        "    assert (x == rabit2.get_world_size()).all()\n"
        "print('DONE', rabit2.get_rank(), flush=True)\n"
        "rabit2.finalize()\n"
    )
    proc = submit(2, sys.executable, "-c", code, timeout=120,
                  extra=("--max-attempts", "2", "--env", "RABIT2_REPLAY_MB=1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rank in range(2):
        assert f"DONE {rank}" in out, out[-3000:]
        said = re.findall(rf"rank {rank}: the results of version 0 outgrew rabit2_replay_mb", out)
        assert len(said) == 1, out[-3000:]


def _async_job(n: int, *mode: str, ok: bool, extra: tuple[str, ...] = ()) -> str:
    """``async_worker.py`` (in ``mode``) under the launcher: its output; it ended as ``ok``
    says (exit status 0 or not)."""
    proc = submit(n, sys.executable, str(WORKERS / "async_worker.py"), *mode, timeout=120,
                  extra=extra)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-4000:]
    return out


@pytest.mark.integration
def test_asyncio_api() -> None:
    out = _async_job(3, ok=True)
    for rank in range(3):
        assert f"ASYNC OK rank={rank}" in out


@pytest.mark.integration
def test_an_exception_in_an_asyncio_block_ends_the_job_for_every_rank() -> None:
    # (with restarts, so recovery is on, as in tests/integration/test_program_errors.py)
    out = _async_job(3, "raise", ok=False, extra=("--max-attempts", "3"))
    # (tasks get ranks in task order here; the abort may reach a task still wiring its links,
    # before it knows its rank)
    for task in (0, 2):
        assert re.search(rf"ASYNC ABORTED task={task} rank=(-1|{task}) JobAbortedError: .*rank 1 "
                         r"raised ValueError: bad input on rank 1", out), out[-4000:]
    assert "restarting" not in out


@pytest.mark.integration
def test_ctrl_c_in_an_asyncio_block_is_named_as_in_a_blocking_program() -> None:
    out = _async_job(2, "interrupt", ok=False, extra=("--max-attempts", "1"))
    assert re.search(r"ASYNC INTERRUPTED rank=0 JobAbortedError: .*rank 1 raised "
                     r"KeyboardInterrupt", out), out[-4000:]
    assert "raised CancelledError" not in out, out[-4000:]


@pytest.mark.integration
def test_an_asyncio_wait_cancelled_while_queued_leaves_its_call_in_place() -> None:
    out = _async_job(2, "cancel", ok=True)
    for rank in range(2):  # (a/b/c: 1, 10, 100 times rank + 1, summed)
        assert f"ASYNC CANCEL rank={rank} a=3 b=30 c=300" in out, out[-4000:]


@pytest.mark.integration
def test_leaving_an_asyncio_block_after_a_timed_out_wait_ends_the_job_at_once() -> None:
    out = _async_job(2, "timeout", ok=False, extra=("--env", "RABIT2_TIMEOUT_SEC=60"))
    left = re.search(r"ASYNC LEFT rank=0 after=([0-9.]+) TimeoutError", out)
    assert left and float(left.group(1)) < 15, out[-4000:]  # (not the 60 s deadline)
    assert re.search(r"ASYNC LEFT rank=1 after=[0-9.]+ JobAbortedError: .*rank 0 raised "
                     r"TimeoutError", out), out[-4000:]


@pytest.mark.integration
def test_sys_exit_0_in_an_asyncio_block_ends_the_job_well() -> None:
    out = _async_job(2, "exit0", ok=True, extra=("--max-attempts", "3"))
    assert "ASYNC EXIT0 rank=1 left" in out and "job: every rank shut down" in out, out[-4000:]


@pytest.mark.integration
def test_a_context_inside_an_asyncio_block_neither_joins_nor_leaves() -> None:
    out = _async_job(2, "nested", ok=True)
    for rank in range(2):
        assert f"ASYNC NESTED rank={rank} inner=2 after=2" in out, out[-4000:]


@pytest.mark.integration
def test_the_failure_of_a_call_nobody_awaits_is_raised_leaving_the_block() -> None:
    out = _async_job(2, "unseen", ok=False, extra=("--max-attempts", "1"))
    assert re.search(r"ASYNC UNSEEN rank=0 (JobAbortedError|PeerLostError): .*rank 1", out), \
        out[-4000:]


@pytest.mark.integration
def test_an_exception_leaving_an_asyncio_block_ends_the_job_with_the_executor_busy() -> None:
    out = _async_job(2, "busy", ok=False, extra=("--env", "RABIT2_TIMEOUT_SEC=60"))
    # (the abort may reach rank 1 while it still joins, before it knows its rank)
    left = re.search(r"ASYNC BUSY rank=(?:-1|1) after=([0-9.]+) JobAbortedError: .*rank 0 raised "
                     r"ValueError: bad input on rank 0", out)
    assert left and float(left.group(1)) < 5, out[-4000:]  # (not the executor's 8 s)


@pytest.mark.integration
def test_a_process_exits_at_once_though_a_call_whose_wait_it_gave_up_runs() -> None:
    started = time.monotonic()
    out = _async_job(2, "exit2", ok=False, extra=("--max-attempts", "1",
                                                  "--env", "RABIT2_TIMEOUT_SEC=60"))
    assert "ASYNC EXITING rank=0" in out, out[-4000:]
    assert re.search(r"rank 0 \(task 0\) exited with 2", out), out[-4000:]
    assert time.monotonic() - started < 20, out[-4000:]  # (not rank 1's 30 s nor the 60 s)


@pytest.mark.integration
def test_one_asyncio_communicator_serves_two_threads_with_loops_of_their_own() -> None:
    out = _async_job(2, "threads", ok=True)
    for rank in range(2):
        assert f"ASYNC THREADS rank={rank} calls=400 all2=True" in out, out[-4000:]


@pytest.mark.integration
def test_paused_worker_fails_its_neighbours_within_the_heartbeat_deadline() -> None:
    """SIGSTOP keeps a process's sockets open: only the tracker's heartbeat deadline sees it.
    Its neighbours must fail with PeerLostError soon after, not at the 30-minute progress
    deadline, and the launcher must not leave the stopped process behind."""
    code = (
        "import os, signal, sys, time, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "if r == 1:\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    rabit2.allreduce(np.zeros(1000, np.float32), rabit2.SUM)\n"
        "except (rabit2.errors.PeerLostError, rabit2.errors.JobAbortedError) as exc:\n"
        "    print(f'LOST {r} after {time.monotonic() - t:.1f}s: {type(exc).__name__}',"
        " flush=True)\n"
        "    sys.exit(3)\n"
    )

    t0 = time.monotonic()
    proc = submit(3, sys.executable, "-c", code, timeout=120,
                  extra=("--heartbeat-timeout", "3", "--kill-grace", "1"))
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 2):
        assert f"LOST {rank}" in out, out[-3000:]
    assert elapsed < 60, out[-3000:]
    # the summary says why the launcher killed it
    assert re.search(r"rank 1 \(task 1\) was killed by SIGKILL at [\d:]+ \(attempt 1/\d\), "
                     r"by the launcher: no heartbeat for 3 s \(--heartbeat-timeout", out), out
    assert "after 1 attempts" not in out


@pytest.mark.integration
def test_a_heartbeat_interval_beyond_the_trackers_timeout_does_not_get_workers_killed() -> None:
    """rabit2_heartbeat_sec=5 against --heartbeat-timeout 2: the workers beat every 2/3 s
    instead (the tracker's welcome names its timeout), and a 4 s pause between two calls is
    not taken for a silent worker."""
    code = (
        "import time, numpy as np, rabit2\n"
        "rabit2.init(rabit2_heartbeat_sec=5)\n"
        "rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "time.sleep(4)\n"
        "rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "r = rabit2.get_rank()\n"
        "rabit2.finalize()\n"
        "print('DONE', r, flush=True)\n"
    )
    proc = submit(2, sys.executable, "-c", code, timeout=120,
                  extra=("--heartbeat-timeout", "2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "DONE 0" in out and "DONE 1" in out
    assert "beating every 0.666667 s instead" in out, out[-3000:]


@pytest.mark.integration
@pytest.mark.parametrize(("count", "victim", "after"), [(2_000_000, 2, 1 << 20), (30_000, 1, 4096)],
                         ids=["ring", "tree"])
def test_kill_9_mid_transfer_fails_every_survivor_fast(count: int, victim: int,
                                                       after: int) -> None:
    """``mock=rank,version,seqno,trial,after_bytes`` SIGKILLs a worker in the middle of a
    transfer.  Without recovery every survivor must still get a typed error at
    once (its own link resets, or the flooded error), and the launcher must report it."""
    code = (
        "import sys, time, numpy as np, rabit2\n"
        "rabit2.init(sys.argv[1:])\n"
        "r = rabit2.get_rank()\n"
        "rabit2.allreduce(np.ones(10, np.float64), rabit2.SUM)\n"
        "t = time.monotonic()\n"
        "try:\n"
        f"    rabit2.allreduce(np.ones({count}, np.float64), rabit2.SUM)\n"
        "except rabit2.errors.RabitError as exc:\n"
        "    print(f'FAILED {r} {type(exc).__name__} after {time.monotonic() - t:.2f}s',"
        " flush=True)\n"
        "    sys.exit(3)\n"
        "print(f'SURVIVED {r}', flush=True)\n"
    )
    # (attempts left, recovery off: the victim is not restarted either)
    proc = submit(5, sys.executable, "-c", code, f"mock={victim},0,1,0,{after}", timeout=120,
                  extra=("--max-attempts", "2", "--env", "RABIT2_RECOVER=0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "killing rank" in out
    for rank in set(range(5)) - {victim}:
        found = re.search(rf"FAILED {rank} (PeerLostError|JobAbortedError) after ([0-9.]+)s",
                          out)
        assert found, out[-3000:]
        assert float(found.group(2)) < 10
    assert "SURVIVED" not in out


@pytest.mark.integration
def test_a_survivor_names_why_its_peer_left_not_the_lost_link() -> None:
    """Without recovery, rank 1 exits with status 7 while the others wait in an allreduce.
    Its sockets close at once, the launcher's abort comes two hops later: every survivor
    raises the abort, which names the exit, and not the bare PeerLostError.  Nothing is
    restarted (a restart could not join a job without recovery): task 1's row shows its
    one attempt and its own exit status."""
    code = (
        "import os, sys, time, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "if r == 1:\n"
        "    time.sleep(0.3)\n"
        "    os._exit(7)\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "except rabit2.errors.RabitError as exc:\n"
        "    print(f'FAILED {r} {type(exc).__name__} after {time.monotonic() - t:.2f}s: {exc}',"
        " flush=True)\n"
        "    sys.exit(3)\n"
    )
    proc = submit(3, sys.executable, "-c", code, timeout=120,
                  extra=("--max-attempts", "3", "--env", "RABIT2_RECOVER=0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 2):
        found = re.search(rf"FAILED {rank} (\w+) after ([0-9.]+)s: (.*)", out)
        assert found, out[-3000:]
        assert found.group(1) == "JobAbortedError", found.group(0)
        assert "task 1 exited with 7" in found.group(3), found.group(0)
        assert "without recovery" in found.group(3), found.group(0)
        assert float(found.group(2)) < 10
    row = re.search(r"^1 +1 +(\d+) +(\d+) +failed$", out, re.MULTILINE)
    assert row and row.groups() == ("1", "7"), out[-3000:]
    assert "restarting" not in out


@pytest.mark.integration
def test_a_restart_that_waits_out_its_delay_is_not_started_in_an_aborted_job() -> None:
    """Task 1 fails and waits 3 s (``--restart-delay``) for its restart; meanwhile rank 0
    aborts the job (``signal_error``).  The restart is not started into the ended job."""
    code = (
        "import os, sys, time, rabit2\n"
        "rabit2.init()\n"
        "if rabit2.get_rank() == 1:\n"
        "    os._exit(5)\n"
        "time.sleep(0.5)\n"
        "rabit2.signal_error('rank 0 gives up')\n"
        "time.sleep(5)\n"
    )
    proc = submit(2, sys.executable, "-c", code, timeout=120,
                  extra=("--max-attempts", "3", "--restart-delay", "3"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 0 gives up" in out
    row = re.search(r"^1 +1 +(\d+) +(\d+) +failed$", out, re.MULTILINE)
    assert row and row.groups() == ("1", "5"), out[-3000:]


@pytest.mark.integration
def test_an_allgather_of_different_trailing_shapes_says_what_differs() -> None:
    code = (
        "import sys, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "try:\n"
        "    rabit2.allgather(np.zeros((2, 3 + (r == 1)), np.float32))\n"
        "except rabit2.errors.MismatchError as exc:\n"
        "    print('MISMATCH', r, exc, flush=True)\n"
        "try:\n"  # (sticky, as after any failed call)
        "    rabit2.allreduce(np.ones(4), rabit2.SUM)\n"
        "except rabit2.errors.RabitError as exc:\n"
        "    print('STILL', r, type(exc).__name__, exc, flush=True)\n"
        "rabit2.finalize()\n"
    )
    proc = submit(3, sys.executable, "-c", code, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]  # (finalize ends the job with it)
    for rank in range(3):
        # (or, on a rank that a faster one's finalize outran, the tracker's abort, which
        # names the same mismatch: it failed that rank before the rank found it itself)
        assert re.search(rf"STILL {rank} (MismatchError |JobAbortedError .*)allgather: ranks "
                         "passed", out), out[-3000:]
    table = ("rank 0: float32 trailing shape A, rank 1: float32 trailing shape B, "
             "rank 2: float32 trailing shape A")
    for rank, shape in ((0, "(3,)"), (1, "(4,)"), (2, "(3,)")):
        assert f"MISMATCH {rank} allgather: ranks passed different dtypes or trailing shapes: "\
               f"{table} (rank {rank}'s trailing shape is {shape})" in out, out[-3000:]


@pytest.mark.integration
def test_ranks_that_differ_in_recovery_fail_with_a_mismatch_naming_the_setting() -> None:
    code = (
        "import os, sys, numpy as np, rabit2\n"
        "rabit2.init(rabit2_recover=os.environ['DMLC_TASK_ID'] == '1')\n"
        "r = rabit2.get_rank()\n"
        "try:\n"
        "    rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "except rabit2.errors.MismatchError as exc:\n"
        "    print('MISMATCH', r, exc, flush=True)\n"
        "    sys.exit(3)\n"
    )
    proc = submit(2, sys.executable, "-c", code, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"MISMATCH {rank} .*rabit2_recover must be the same on every rank",
                         out), out[-3000:]


def _mismatch_job(world: int, calls: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """A job (recovery on) whose ranks make ``calls`` (lines of a ``try`` block; ``r`` is
    the rank), then finalize; each prints ``MISMATCH r <error>`` for a MismatchError."""
    code = ("import sys, time, numpy as np, rabit2\n"
            "rabit2.init()\n"
            "r = rabit2.get_rank()\n"
            "try:\n" + calls +
            "    rabit2.finalize()\n"
            "except rabit2.errors.MismatchError as exc:\n"
            "    print('MISMATCH', r, exc, flush=True)\n"
            "    sys.exit(3)\n")
    proc = submit(world, sys.executable, "-c", code, timeout=120, extra=("--max-attempts", "2"))
    return proc, proc.stdout + proc.stderr


@pytest.mark.integration
@pytest.mark.parametrize("delay", [0.0, 0.5], ids=["at-once", "once-the-other-holds"])
def test_an_extra_call_after_the_other_rank_finalized_is_a_mismatch_on_both(
        delay: float) -> None:
    """With recovery on a rank that finalized holds, serving its neighbours: rank 0's extra
    call (its frame read before that rank finalized, or after) is a sequence mismatch on
    both ranks within seconds (rank 1's from finalize), not a wait to the deadline."""
    started = time.monotonic()
    proc, out = _mismatch_job(2, "    rabit2.allreduce(np.ones(3), rabit2.SUM)\n"
                                 "    if r == 0:\n"
                                 f"        time.sleep({delay})\n"
                                 "        rabit2.allreduce(np.ones(3), rabit2.SUM)\n")
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"MISMATCH {rank} sequence mismatch: rank 0 began call \(0, 1\) .*"
                         r"after rank 1 finalized", out), out[-3000:]
    assert "restarting" not in out
    assert time.monotonic() - started < 30


@pytest.mark.integration
@pytest.mark.parametrize(("world", "early"), [(3, 1), pytest.param(7, 5, marks=pytest.mark.slow)])
def test_a_leaf_that_finalized_before_a_call_of_the_others_is_a_mismatch_on_every_rank(
        world: int, early: int) -> None:
    """A leaf of the tree finalizes while the others make a call: no frame ever reaches it
    (its parent waits for its input first), so only the parent's progress notes tell it of
    the call.  It fails the call everywhere within seconds, not at the deadline."""
    started = time.monotonic()
    proc, out = _mismatch_job(world, f"    if r != {early}:\n"
                                     "        rabit2.allreduce(np.ones(3), rabit2.SUM)\n")
    assert proc.returncode != 0
    said = (rf"sequence mismatch: rank \d+ began call \(0, 0\) .*after rank {early} "
            rf"finalized at call \(0, 0\)")
    for rank in range(world):
        # (a rank several hops from the finalized one may hear the tracker's abort, which
        # names the mismatch, before the flooded error reaches it)
        assert (re.search(rf"MISMATCH {rank} {said}", out) or re.search(
            rf"^\[rank {rank}\] rabit2\.errors\.JobAbortedError: .*MismatchError: {said}",
            out, re.M)), out[-3000:]
    assert "restarting" not in out
    assert time.monotonic() - started < 30


@pytest.mark.integration
def test_diverging_call_sequences_fail_fast_with_a_sequence_mismatch() -> None:
    """Rank 1 checkpoints where the others do not: a typed error everywhere, not a hang."""
    code = (
        "import sys, time, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "if r == 1:\n"
        "    rabit2.checkpoint({'extra': True})\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    rabit2.allreduce(np.ones(10), rabit2.SUM)\n"
        "except rabit2.errors.MismatchError as exc:\n"
        "    print(f'DIVERGED {r} after {time.monotonic() - t:.2f}s: {exc}', flush=True)\n"
        "    rabit2.finalize()\n"  # a clean exit: no restart races with the other reports
        "    sys.exit(0)\n"
        "print(f'NO ERROR {r}', flush=True)\n"
    )
    proc = submit(3, sys.executable, "-c", code, timeout=120)
    out = proc.stdout + proc.stderr
    assert "NO ERROR" not in out
    for rank in range(3):
        found = re.search(rf"DIVERGED {rank} after ([0-9.]+)s: .*sequence mismatch", out)
        assert found, out[-3000:]
        assert float(found.group(1)) < 10


@pytest.mark.integration
def test_root_does_not_wait_forever_for_a_paused_receiver_to_drain() -> None:
    """The root hands its last bytes to the kernel, the receiver is paused mid-transfer and
    never reads them: the root must come back (done or a typed error) soon after the
    tracker declares the receiver lost, not after the outer bound of an hour."""
    code = (
        "import os, signal, sys, threading, time, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "data = np.ones(64 << 20, np.uint8) if r == 0 else None\n"
        "if r == 1:\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)  # paused: it never reads the root's bytes\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    rabit2.broadcast(data, 0)\n"
        "    print(f'ROOT DONE {r} after {time.monotonic() - t:.1f}s', flush=True)\n"
        "except rabit2.errors.RabitError as exc:\n"
        "    print(f'ROOT DONE {r} after {time.monotonic() - t:.1f}s: {type(exc).__name__}',"
        " flush=True)\n"
        "rabit2.finalize()\n"
    )
    proc = submit(2, sys.executable, "-c", code, timeout=120,
                  extra=("--heartbeat-timeout", "3", "--kill-grace", "1"))
    out = proc.stdout + proc.stderr
    found = re.search(r"ROOT DONE 0 after ([0-9.]+)s", out)
    assert found, out[-3000:]
    assert float(found.group(1)) < 30


@pytest.mark.integration
def test_a_clean_job_tells_its_story_at_info_and_nothing_that_reads_like_a_failure() -> None:
    """``RABIT2_LOG_LEVEL=INFO``: each worker says where it joined, its links and that it
    left, with its rank and the time; at DEBUG a clean run still has no warning, error or
    lost link in it."""
    for level in ("INFO", "DEBUG"):
        env_level = ("--env", f"RABIT2_LOG_LEVEL={level}")
        proc = submit(3, sys.executable, str(WORKERS / "collectives.py"), extra=env_level,
                      timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        for rank in range(3):
            for said in ("joined the job at tracker", "links up to ranks", "left the job after"):
                assert re.search(rf"rabit2\[rank {rank}\] INFO {said}", out), (said, out[-3000:])
        records = re.findall(r"rabit2\[rank \d\] (\w+) (.*)", out)
        assert not [r for r in records if r[0] in ("WARNING", "ERROR", "CRITICAL")], records
        assert not [r for r in records if re.search(r"\b(down|lost|fail)", r[1])], records
