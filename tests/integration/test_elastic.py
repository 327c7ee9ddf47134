"""Elastic mode with real processes under ``rabit2-submit --elastic`` (docs/elastic.md): the
job goes on without lost workers, takes a restarted one back, and every live set's block
succeeds or fails on every member together.  The worker is
``tests/support/workers/elastic_worker.py``; it checks each step's sum against the set it ran
with, so every STEP line is a verified result."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKER = str(ROOT / "tests" / "support" / "workers" / "elastic_worker.py")


def submit(n: int, *args: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", str(n),
         "--elastic", "--timeout", "90", *extra, "--", sys.executable, WORKER, *args],
        capture_output=True, text=True, timeout=110, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def run_code(n: int, code: str, *args: str,
             flags: tuple[str, ...] = ("--elastic",)) -> subprocess.CompletedProcess[str]:
    """``python -c code args`` as a job of ``n`` under ``rabit2-submit flags`` (60 s)."""
    return subprocess.run(
        [sys.executable, "-m", "tracker.submit", "-n", str(n), *flags, "--timeout", "60",
         "--", sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=90, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def sets_seen(out: str) -> dict[int, list[tuple[int, str]]]:
    """rank -> the (epoch, members) of every set it took part in, in order."""
    seen: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for rank, epoch, live in re.findall(r"SET rank=(\d+) step=\d+ epoch=(\d+) live=([\d,]+)",
                                        out):
        seen[int(rank)].append((int(epoch), live))
    return seen


def totals(out: str) -> dict[int, int]:
    return {int(rank): int(total)
            for rank, total in re.findall(r"DONE rank=(\d+) total=(\d+)", out)}


def expected_total(out: str, rank: int) -> int:
    """What a worker's running total must be, from the sets its successful steps ran with."""
    total = 0
    for step, live in re.findall(rf"STEP rank={rank} step=(\d+) epoch=\d+ live=([\d,]+)", out):
        total += sum(int(r) + 1 + int(step) for r in live.split(","))
    return total


def test_survivors_go_on_without_one_then_two_lost_workers() -> None:
    """Rank 1 is killed inside a block, rank 3 later; neither is restarted.  The survivors
    finish every step, each step's sum is right for the set it ran with, and they saw the
    same sequence of sets; the failed block raised the same error on each of them."""
    done = submit(4, "--steps=8", "--die=1,2,in", "--die=3,5,in", extra=("--max-attempts", "1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert set(totals(out)) == {0, 2}
    assert totals(out)[0] == totals(out)[2] == expected_total(out, 0) == expected_total(out, 2)
    seen = sets_seen(out)
    assert seen[0] == seen[2], out
    members = [live for _, live in seen[0]]
    assert members[0] == "0,1,2,3" and members[-1] == "0,2" and "0,2,3" in members
    # the blocks the kills hit failed on every survivor, with one message each
    for step, lost in ((2, 1), (5, 3)):
        errors = re.findall(rf"RETRY rank=\d+ step={step} error=(.*)", out)
        assert len(errors) == 4 - (2 if step == 5 else 1), out
        # (it is lost, or left, whichever the tracker hears first: its connection ending,
        # or the launcher giving it up)
        assert len(set(errors)) == 1 and re.search(rf"rank {lost} (lost|left)", errors[0]), errors
    assert re.search(r"^1\s+1\s+1\s+-9\s+left$", done.stderr, re.M), done.stderr
    assert re.search(r"^3\s+3\s+1\s+-9\s+left$", done.stderr, re.M), done.stderr


def test_a_restarted_worker_joins_the_next_set_and_agrees_from_then_on() -> None:
    """Rank 0 is killed, restarted and comes back: the state it is handed comes from rank 1,
    the first member that holds it (a restarted rank other than 0 rejoins in the example's
    test below)."""
    victim = 0
    done = submit(3, "--steps=24", "--slow=0.2", f"--die={victim},2,in",
                  extra=("--max-attempts", "2", "--restart-delay", "0.5"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # it was out for a while, then came back, named as new in the set it joined
    seen = sets_seen(out)
    other = 2
    without = ",".join(str(r) for r in range(3) if r != victim)
    assert any(live == without for _, live in seen[other]), out
    back = re.search(rf"SET rank={victim} step=\d+ epoch=(\d+) live=0,1,2 new={victim}$",
                     out, re.M)
    assert back is not None, out
    assert len(set(totals(out).values())) == 1 and set(totals(out)) == {0, 1, 2}, out
    assert re.search(rf"DONE rank={victim} total=\d+ attempt=1", out), out
    since = int(back.group(1))  # from the set it came back in, all saw the same sets
    assert ([e for e in seen[other] if e[0] >= since]
            == [e for e in seen[victim] if e[0] >= since])
    assert totals(out)[other] == expected_total(out, other)


def test_a_worker_killed_while_it_waits_for_a_set_is_left_out_of_it() -> None:
    done = submit(3, "--steps=6", "--die=2,3,asking", extra=("--max-attempts", "1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "RETRY" not in out  # the set formed without it: no block failed
    assert sets_seen(out)[0] == sets_seen(out)[1]
    assert re.search(r"SET rank=0 step=3 epoch=\d+ live=0,1 ", out), out
    assert totals(out)[0] == totals(out)[1] == expected_total(out, 0)


def test_a_worker_killed_between_the_set_forming_and_joining_it_fails_that_set() -> None:
    """The set formed with rank 2 in it, which dies before it joins the set's collectives:
    the others cannot start them without it, so the set fails on each of them (at entry),
    with one message, and the next set goes on without rank 2."""
    done = submit(3, "--steps=5", "--die=2,2,joining", extra=("--max-attempts", "1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    errors = re.findall(r"RETRY rank=\d step=2 error=(.*)", out)
    assert len(errors) == 2 and len(set(errors)) == 1 and "rank 2" in errors[0], out
    assert re.search(r"SET rank=0 step=2 epoch=\d+ live=0,1 ", out), out
    assert totals(out)[0] == totals(out)[1] == expected_total(out, 0)


def test_fewer_workers_than_min_workers_end_the_job() -> None:
    done = submit(3, "--steps=6", "--die=1,2,in", extra=("--max-attempts", "1",
                                                          "--min-workers", "3"))
    assert done.returncode == 1, done.stderr
    assert "job: rank 1 (task 1) failed for good" in done.stderr, done.stderr


def test_collectives_outside_a_live_set_are_refused_in_elastic_mode() -> None:
    code = ("import numpy as np, rabit2\nrabit2.init()\n"
            "try:\n    rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
            "except RuntimeError as exc:\n    print('REFUSED', exc)\n"
            "with rabit2.live_set() as live:\n"
            "    a = rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
            "print('SUM', int(a[0]), len(live), rabit2.get_world_size())\n"
            "rabit2.finalize()\n")
    done = run_code(2, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("REFUSED in elastic mode collectives run inside") == 2, done.stdout
    assert done.stdout.count("SUM 2 2 2") == 2, done.stdout


def test_the_elastic_training_example_trains_through_a_loss_and_a_rejoin() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "-n", "4", "--elastic", "--max-attempts", "2",
         "--restart-delay", "0.5", "--timeout", "90", "--", sys.executable, "-m",
         "rabit2.examples.elastic_train", "--die=2,20", "--pause=0.05", "--steps=80"],
        capture_output=True, text=True, timeout=110, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    finals = re.findall(r"elastic rank=(\d) done steps=(\d+) model=([0-9a-f]{16})", out)
    assert sorted(rank for rank, _, _ in finals) == ["0", "1", "2", "3"], out
    assert {steps for _, steps, _ in finals} == {"80"} and len({m for _, _, m in finals}) == 1
    losses = re.findall(r"step=79 live=\[0, 1, 2, 3\] loss=([\d.]+)", out)
    assert losses and float(losses[0]) < 0.05, out  # it learned, and rank 2 is back


def test_a_call_left_running_in_another_thread_does_not_hold_up_abort_for() -> None:
    """As after an ``await`` that timed out in ``rabit2.aio``: rank 0's allreduce runs on in
    a thread (rank 1 never makes it) when rank 0 leaves by an error.  Leaving ends that call
    at once, not at its 10-minute deadline; rank 1's block fails, and it goes on."""
    code = (
        "import threading, time, numpy as np, rabit2\n"
        "from rabit2 import api\n"
        "rabit2.init()\n"
        "rank = rabit2.get_rank()\n"
        "try:\n"
        "    with rabit2.live_set():\n"
        "        if rank == 0:\n"
        "            got = []\n"
        "            def call():\n"
        "                try:\n"
        "                    rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
        "                except Exception as exc:\n"
        "                    got.append(type(exc).__name__ + ': ' + str(exc))\n"
        "            t = threading.Thread(target=call)\n"
        "            t.start()\n"
        "            time.sleep(0.5)\n"
        "            t0 = time.monotonic()\n"
        "            api.abort_for(RuntimeError('boom'))\n"
        "            t.join(10)\n"
        "            print('LEFT after', round(time.monotonic() - t0, 1), got, flush=True)\n"
        "            raise SystemExit(0)\n"
        "        time.sleep(2)\n"
        "except rabit2.LiveSetError as exc:\n"
        "    print('BLOCK FAILED', exc, flush=True)\n"
        "rabit2.finalize()\n")
    done = run_code(2, code, "rabit_timeout_sec=600", flags=("--elastic", "--max-attempts", "1"))
    out = done.stdout + done.stderr
    left = re.search(r"LEFT after ([\d.]+) \['LiveSetError: this rank left its live set: "
                     r"rank 0 raised RuntimeError: boom'\]", out)
    assert left is not None and float(left.group(1)) < 6, out
    assert "BLOCK FAILED live set" in done.stdout, out


def test_live_sets_and_checkpoints_are_refused_where_they_do_not_belong() -> None:
    """A live set in a job outside elastic mode; checkpoints in elastic mode, which has
    none (a newcomer gets the state from a member)."""
    plain = ("import rabit2\nrabit2.init()\n"
             "try:\n    rabit2.live_set().__enter__()\n"
             "except RuntimeError as exc:\n    print('REFUSED', exc)\n"
             "rabit2.finalize()\n")
    elastic = ("import rabit2\nrabit2.init()\n"
               "for call in (lambda: rabit2.checkpoint(1), rabit2.load_checkpoint):\n"
               "    try:\n        call()\n"
               "    except RuntimeError as exc:\n        print('REFUSED', exc)\n"
               "rabit2.finalize()\n")
    for flags, code, said, times in (
            ((), plain, "needs elastic mode", 2),  # (each of 2 ranks, once)
            (("--elastic",), elastic, "elastic mode has no checkpoints", 4)):
        done = run_code(2, code, flags=flags)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count(said) == times, done.stdout


@pytest.mark.parametrize("mode", ["fewer", "later", "caught"])
def test_members_that_make_different_calls_in_a_block_fail_it_at_once(mode: str) -> None:
    """Rank 0 makes a call the others never make: at once (``fewer``), after the others
    left the block (``later``), or because rank 1 caught the error of its own bad call
    (``caught``).  The block fails on every member with the same MismatchError, within
    seconds, not at rabit_timeout_sec (600 s here); the next set works."""
    code = (
        "import sys, time, numpy as np, rabit2\n"
        "rabit2.init(sys.argv[1:])\n"
        "r, mode = rabit2.get_rank(), sys.argv[1]\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    with rabit2.live_set():\n"
        "        rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
        "        if mode == 'caught':\n"
        "            try:\n"
        "                rabit2.allreduce(np.ones(2, dtype=bool) if r == 1 else np.ones(2),\n"
        "                                 rabit2.Op.SUM)\n"
        "            except TypeError:\n"
        "                pass\n"
        "        elif r == 0:\n"
        "            time.sleep(1.0 if mode == 'later' else 0)\n"
        "            rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
        "except rabit2.LiveSetError as exc:\n"
        "    print(f'FAILED {r} after {time.monotonic() - t:.1f}: {exc}', flush=True)\n"
        "with rabit2.live_set():\n"
        "    a = rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
        "print(f'NEXT {r} {a[0]:g}', flush=True)\n"
        "rabit2.finalize()\n")
    done = run_code(3, code, mode, "rabit_timeout_sec=600")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    failed = re.findall(r"FAILED (\d) after ([\d.]+): (.*)", done.stdout)
    assert sorted(int(r) for r, _, _ in failed) == [0, 1, 2], done.stdout
    assert len({message for _, _, message in failed}) == 1, failed
    assert "MismatchError: live set block: job rank" in failed[0][2], failed
    assert all(float(after) < 10 for _, after, _ in failed), failed
    assert sorted(re.findall(r"NEXT (\d) 3", done.stdout)) == ["0", "1", "2"], done.stdout


def test_an_error_in_a_block_says_which_job_rank_each_position_is() -> None:
    """The engine of a live set names its members by their positions in the set, while
    ``get_rank()`` says job ranks: once the set is not every rank in order, a block's error
    carries a note that maps them."""
    code = (
        "import os, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "if r == 1:\n"
        "    os._exit(3)\n"
        "for step in range(50):\n"
        "    try:\n"
        "        with rabit2.live_set() as live:\n"
        "            size = 2 + rabit2.get_rank() if tuple(live) == (0, 2) else 2\n"
        "            rabit2.allreduce(np.ones(size), rabit2.Op.SUM)\n"
        "    except rabit2.RabitError as exc:\n"
        "        if tuple(live) == (0, 2):\n"
        "            print('NOTES', r, type(exc).__name__, exc.__notes__, flush=True)\n"
        "            break\n"
        "rabit2.finalize()\n")
    done = run_code(3, code, flags=("--elastic", "--max-attempts", "1"))
    notes = re.findall(r"NOTES (\d) (\w+) (.*)", done.stdout)
    assert sorted(int(r) for r, _, _ in notes) == [0, 2], done.stdout + done.stderr[-3000:]
    for _, _, note in notes:
        assert "is a position in the set: 0 is job rank 0, 1 is job rank 2" in note, note


def test_a_member_that_exits_0_inside_a_block_left_the_job_which_goes_on() -> None:
    """Its block fails on the others, who go on without it; the summary says it left early
    and the job ends as the others left it."""
    code = (
        "import sys, numpy as np, rabit2\n"
        "rabit2.init()\n"
        "r = rabit2.get_rank()\n"
        "for step in range(3):\n"
        "    try:\n"
        "        with rabit2.live_set():\n"
        "            rabit2.allreduce(np.ones(2), rabit2.Op.SUM)\n"
        "            if r == 1 and step == 1:\n"
        "                sys.exit(0)\n"
        "    except rabit2.LiveSetError:\n"
        "        pass\n"
        "print('DONE', r, flush=True)\n"
        "rabit2.finalize()\n")
    done = run_code(3, code, flags=("--elastic", "--max-attempts", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(re.findall(r"DONE (\d)", done.stdout)) == ["0", "2"], done.stdout
    assert re.search(r"^1\s+1\s+1\s+0\s+left early$", done.stderr, re.M), done.stderr[-2000:]
    assert "job: every remaining rank shut down" in done.stderr, done.stderr[-2000:]


def test_the_root_cause_is_the_loss_that_ended_the_job_not_one_it_went_on_without() -> None:
    """Rank 1 is lost and the job goes on with three (--min-workers 3); rank 2 is lost later
    and that ends it: the summary's root cause names rank 2, not the first loss."""
    code = ("import os, sys, time, numpy as np, rabit2, rabit2.live\n"
            "from rabit2.errors import LiveSetError\n"
            "rabit2.init(sys.argv[1:])\n"
            "rank, step = rabit2.get_rank(), 0\n"
            "while step < 40:\n"
            "    try:\n"
            "        with rabit2.live_set():\n"
            "            if (rank, step) in ((1, 5), (2, 12)):\n"
            "                os.kill(os.getpid(), 9)\n"
            "            rabit2.allreduce(np.ones(4), rabit2.SUM)\n"
            "        step += 1\n"
            "    except LiveSetError:\n"
            "        continue\n"
            "    time.sleep(0.05)\n"
            "rabit2.finalize()\n")
    done = run_code(4, code, flags=("--elastic", "--max-attempts", "1", "--min-workers", "3"))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert re.search(r"^root cause: rank 2 \(task 2\) was killed by SIGKILL", out, re.M), out
    assert "job: rank 2 (task 2) failed for good" in out, out


def test_signal_error_ends_the_callers_later_blocks_too() -> None:
    """An elastic worker that calls signal_error and then retries the block, as elastic
    programs do on LiveSetError, gets JobAbortedError: no block runs in the aborted job."""
    code = ("import sys, numpy as np, rabit2, rabit2.live\n"
            "from rabit2.errors import LiveSetError, RabitError\n"
            "rabit2.init(sys.argv[1:])\n"
            "r = rabit2.get_rank()\n"
            "for attempt in range(3):\n"
            "    try:\n"
            "        with rabit2.live_set():\n"
            "            if r == 0 and attempt == 0:\n"
            "                rabit2.signal_error('stop')\n"
            "            rabit2.allreduce(np.ones(2), rabit2.SUM)\n"
            "            print(f'rank {r} block ran', flush=True)\n"
            "        break\n"
            "    except LiveSetError:\n"
            "        continue\n"
            "    except RabitError as exc:\n"
            "        print(f'rank {r} {type(exc).__name__}: {exc}', flush=True)\n"
            "        break\n"
            "rabit2.finalize()\n")
    done = run_code(2, code)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "block ran" not in out, out
    assert "rank 0 JobAbortedError: this rank ended the job: stop" in out, out
    assert "rank 1 JobAbortedError: the tracker aborted the job" in out, out
