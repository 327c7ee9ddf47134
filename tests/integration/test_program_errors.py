"""A program error on one rank (an exception, not a crash) ends the job at once: the raising
rank's traceback reaches the user, every other rank fails with a typed error naming it, and
the launcher does not restart a program that raised."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import rabit2

    def body():
        a = np.ones(4)
        rabit2.allreduce(a, rabit2.Op.SUM)
        if rabit2.get_rank() == 1:
            raise ValueError("bad input on rank 1")
        rabit2.allreduce(a, rabit2.Op.SUM)  # the others wait here for rank 1

    if sys.argv[1] == "context":
        with rabit2.CommunicatorContext():
            body()
    else:
        rabit2.init()
        body()
        rabit2.finalize()
""")


def run_job(script: Path, code: str, n: int, *args: str,
            options: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], str]:
    """``code`` written to ``script`` and run by ``rabit2-submit --cluster local -n n
    options`` (60 s) with ``args``; the finished process and its output, both streams."""
    script.write_text(code)
    done = subprocess.run(
        ["rabit2-submit", "--cluster", "local", "-n", str(n), *options, "--timeout", "60",
         "--", sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)
    return done, done.stdout + done.stderr


@pytest.mark.parametrize("style", ["context", "init-finalize"])
def test_an_exception_on_one_rank_ends_the_job_at_once_without_a_restart(
        style: str, tmp_path: Path) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    started = time.monotonic()
    done = subprocess.run(
        ["rabit2-submit", "--cluster", "local", "-n", "3", "--timeout", "60", "--",
         sys.executable, str(script), style],
        capture_output=True, text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert elapsed < 30, out  # (the others used to wait for rank 1 until --timeout)
    assert "[rank 1] ValueError: bad input on rank 1" in out  # its own traceback
    for rank in (0, 2):
        assert re.search(rf"\[rank {rank}\] rabit2.errors.JobAbortedError: .*rank 1 raised "
                         r"ValueError: bad input on rank 1", out), out
    assert re.search(r"^1\s+1\s+1\s+1\s+failed$", out, re.M), out  # one attempt: no restart
    assert "restarting" not in out
    assert "job: rank 1 (task 1) signalled an error: rank 1 raised ValueError" in out
    assert re.search(r"^root cause: rank 1 \(task 1\) exited with 1 at [\d:]+ \(attempt 1/3\): "
                     r"ValueError: bad input on rank 1$", out, re.M), out


LAZY = textwrap.dedent("""
    import sys, threading, numpy as np, rabit2

    rabit2.init(sys.argv[1:])
    try:
        version, _ = rabit2.load_checkpoint()
        for it in range(version, 4):
            rabit2.allreduce(np.ones(10), rabit2.SUM)
            rabit2.lazy_checkpoint({"it": it, "lock": threading.Lock()})
    except rabit2.RabitError as exc:
        print(f"FAILED {rabit2.get_rank()} {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
""")


def test_a_lazy_checkpoint_that_cannot_be_pickled_fails_the_restart_typed(
        tmp_path: Path) -> None:
    """The model of a lazy checkpoint is pickled only when a restarted neighbour asks for it:
    one that cannot be pickled fails that restart with UnrecoverableError naming why, at
    once, on every rank (and not as a link that closes, later taken for a partition)."""
    script = tmp_path / "lazy.py"
    script.write_text(LAZY)
    started = time.monotonic()
    done = subprocess.run(
        ["rabit2-submit", "--cluster", "local", "-n", "2", "--max-attempts", "2", "--timeout",
         "60", "--", sys.executable, str(script), "mock=1,1,0,0"],
        capture_output=True, text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert time.monotonic() - started < 30, out[-3000:]
    for rank in (0, 1):
        assert re.search(rf"FAILED {rank} UnrecoverableError: .*rank 0 cannot pickle its lazy "
                         r"checkpoint of version 1: TypeError", out), out[-3000:]


CAUGHT = textwrap.dedent("""
    import atexit, sys, threading
    import numpy as np
    import rabit2

    def loop_left() -> None:  # (registered first: runs after rabit2's own exit handler)
        alive = any(t.name == "rabit2-loop" and t.is_alive() for t in threading.enumerate())
        print(f"rank {rank} loop thread alive at exit: {alive}", flush=True)

    atexit.register(loop_left)
    rabit2.init()
    rank = rabit2.get_rank()
    try:
        for it in range(5):
            if rank == 1 and it == 3:
                raise ValueError("bad data")
            rabit2.allreduce(np.ones(10), rabit2.Op.SUM)
    except rabit2.RabitError:
        sys.exit(1)
    rabit2.finalize()
""")


def test_a_worker_that_exits_without_finalize_stops_its_loop_thread_first(
        tmp_path: Path) -> None:
    """A worker that catches the job's RabitError and exits without finalize: its loop
    thread is stopped before the interpreter's teardown (left running there, polling its
    sockets, it crashed some of these exits with SIGSEGV), and each exits with its own
    status."""
    done, out = run_job(tmp_path / "caught.py", CAUGHT, 3, options=("--max-attempts", "1"))
    assert done.returncode == 1, out
    for rank in (0, 2):
        assert f"rank {rank} loop thread alive at exit: False" in out, out
    for task in range(3):
        assert re.search(rf"^{task}\s+{task}\s+1\s+1\s+failed$", out, re.M), out


NO_FINALIZE = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    import rabit2

    rabit2.init()
    rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
    if rabit2.get_rank() != 0:  # a call that rank 0 never makes, left in a daemon thread
        threading.Thread(target=rabit2.allreduce, args=(np.ones(4), rabit2.Op.SUM),
                         daemon=True).start()
        time.sleep(0.3)
    else:
        time.sleep(1)
    # ... and every rank ends without rabit2.finalize()
""")


def test_a_job_whose_every_worker_ends_without_finalize_fails(tmp_path: Path) -> None:
    """Every program ends with status 0 within a second of the others, none finalized, a
    call unfinished: the job failed (a worker left early), not "ok" for each task."""
    started = time.monotonic()
    done, out = run_job(tmp_path / "nofinalize.py", NO_FINALIZE, 3)
    assert done.returncode == 1, out
    assert time.monotonic() - started < 30, out
    assert re.search(r"root cause: task \d exited with 0 without rabit2.finalize\(\) while the "
                     "job ran", out), out
    assert re.search(r"^\d\s+\d\s+1\s+0\s+left early$", out, re.M), out


LATE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import rabit2

    if os.environ["DMLC_TASK_ID"] == "1":
        time.sleep(120)  # stuck before init
    rabit2.init(sys.argv[1:])
    rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
    rabit2.finalize()
""")


def test_a_task_that_never_joins_is_named_after_one_deadline(tmp_path: Path) -> None:
    """Task 1 never reaches init: the others wait for their ranks until their deadline
    (rabit_timeout_sec, 3 s here) and the job ends then, naming task 1, instead of their
    being restarted to wait again (attempts x deadline) and the job blaming task 0."""
    script = tmp_path / "late.py"
    script.write_text(LATE)
    started = time.monotonic()
    done = subprocess.run(
        ["rabit2-submit", "--cluster", "local", "-n", "3", "--max-attempts", "3",
         "--timeout", "100", "--", sys.executable, str(script), "rabit_timeout_sec=3"],
        capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert took < 30, (took, out)
    assert re.search(r"root cause: task\(s\) 1 never joined the job \(rabit2.init\) while task "
                     r"[02] waited for its rank until its deadline", out), out
    assert "restarting" not in out, out


SIGNALLED = textwrap.dedent("""
    import sys, time
    import numpy as np
    import rabit2
    import rabit2.errors

    rabit2.init(sys.argv[1:])
    rank = rabit2.get_rank()
    rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
    if rank == 1:
        rabit2.signal_error("disk full")
    started = time.monotonic()
    try:
        rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
    except rabit2.errors.JobAbortedError as exc:
        print(f"rank {rank} JobAbortedError after {time.monotonic() - started:.1f} s: {exc}",
              flush=True)
    rabit2.finalize()
""")


@pytest.mark.parametrize("world", [2, 3])
def test_the_rank_that_signals_an_error_raises_it_at_its_next_call_too(
        world: int, tmp_path: Path) -> None:
    """signal_error ends the job for every rank: the caller's next collective raises
    JobAbortedError at once too, rather than waiting for peers that left (its deadline)."""
    done, out = run_job(tmp_path / "signalled.py", SIGNALLED, world, "rabit_timeout_sec=20")
    assert done.returncode == 1, out
    for rank in range(world):
        found = re.search(rf"rank {rank} JobAbortedError after ([\d.]+) s: .*disk full", out)
        assert found is not None and float(found.group(1)) < 5, out


INTERRUPTED = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    rank = rabit2.get_rank()
    if rank == 1:
        time.sleep(2)  # (rank 0 waits for it in its call, and is interrupted there)
    else:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    for _ in range(3 if rank == 0 else 1):  # (rank 0: the call interrupted, then two more)
        try:
            rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
            print(f"rank {rank} call done", flush=True)
        except KeyboardInterrupt:
            print(f"rank {rank} interrupted", flush=True)
        except Exception as exc:
            print(f"rank {rank} {type(exc).__name__} after {time.monotonic() - started:.1f} s: "
                  f"{exc}", flush=True)
    rabit2.finalize()
""")


def test_a_call_left_by_an_interrupt_ends_the_job_typed(tmp_path: Path) -> None:
    """KeyboardInterrupt in a collective (Ctrl-C in a notebook or a terminal): the call is
    left midway, so the job ends: the interrupted rank's later calls and the other ranks
    raise JobAbortedError naming it at once (not an internal error in the next call, nor a
    wait for this rank's part of the call until the deadline)."""
    done, out = run_job(tmp_path / "interrupted.py", INTERRUPTED, 2, "rabit_timeout_sec=30",
                        options=("--max-attempts", "1"))
    assert done.returncode == 1, out
    assert "rank 0 interrupted" in out, out
    reason = r"rank 0's allreduce call was interrupted by KeyboardInterrupt"
    found = re.findall(rf"rank 0 JobAbortedError after ([\d.]+) s: .*{reason}", out)
    assert len(found) == 2 and all(float(t) < 5 for t in found), out
    found = re.findall(rf"rank 1 JobAbortedError after ([\d.]+) s: .*{reason}", out)
    assert found and float(found[0]) < 8, out


FORKED = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    pid = os.fork()
    if pid == 0:
        started = time.monotonic()
        try:
            rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
        except Exception as exc:
            print(f"child {type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}",
                  flush=True)
        rabit2.finalize()  # (nothing to leave)
        sys.exit(0)
    os.waitpid(pid, 0)
    a = np.ones(4)
    rabit2.allreduce(a, rabit2.Op.SUM)
    rabit2.finalize()
    print(f"parent {a.tolist()}", flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_process_forked_after_init_is_told_it_is_no_worker(tmp_path: Path) -> None:
    """The links and the loop thread stay with the worker: a child forked after init raises
    NotInitializedError saying so at once, and its finalize and exit do not wait for a loop
    that no thread runs; the parent goes on as before."""
    started = time.monotonic()
    done, out = run_job(tmp_path / "forked.py", FORKED, 2)
    assert done.returncode == 0, out
    assert time.monotonic() - started < 30, out
    assert len(re.findall(r"child NotInitializedError after 0\.\d s: this process was forked "
                          r"from rabit2 worker \d+ after its init", out)) == 2, out
    assert out.count("parent [2.0, 2.0, 2.0, 2.0]") == 2, out


SLOW_EXIT = textwrap.dedent("""
    import atexit, sys, time
    import numpy as np
    import rabit2

    slow = []
    atexit.register(lambda: slow and time.sleep(9))  # (the program's own: after rabit2's)
    rabit2.init()
    rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
    if rabit2.get_rank() == 1:
        slow.append(True)
        sys.exit(0)  # without finalize
    rabit2.allreduce(np.ones(4), rabit2.Op.SUM)
    rabit2.finalize()
""")


def test_a_worker_whose_exit_takes_its_time_is_not_taken_for_an_unreachable_one(
        tmp_path: Path) -> None:
    """Its connection closed as it began to exit, its own exit handler then runs for 9 s:
    the launcher does not kill it as a worker cut off from the tracker (and restart it), and
    the job ends naming what it did, leaving without finalize."""
    done, out = run_job(tmp_path / "slow_exit.py", SLOW_EXIT, 2,
                        options=("--max-attempts", "2"))
    assert done.returncode == 1, out
    assert "lost its tracker connection" not in out and "restarting" not in out, out
    assert re.search(r"root cause: task 1 exited with 0 without rabit2.finalize\(\)", out), out
    assert re.search(r"^1\s+1\s+1\s+0\s+left early$", out, re.M), out
