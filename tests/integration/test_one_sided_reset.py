"""A reset that only one end of a link sees: the other end takes the re-dial at once.

The job runs inside one network namespace (tests/support/netns.py) whose loopback drops every TCP
segment with RST set (``tc`` u32 filter), so when a worker aborts its link mid-call the
neighbour never hears of it: its end of the old connection still looks up, and neither
keepalive (about 25 s) nor a retransmission timeout would find it soon.  The worker that
reset dials again; that re-dial is the proof that the old link is dead.  Skipped, with the
reason, where namespaces or ``tc`` are missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support import ROOT, WORKERS, netns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKER = WORKERS / "recovery_worker.py"
R = 2  # the ring allreduce's seqno in the worker's default program


@pytest.fixture(scope="module")
def no_resets() -> Iterator[netns.Testbed]:
    with netns.one_host_with_tc(
            # everything through class 1:1, but TCP segments with RST into class 1:2, whose
            # queue holds nothing (a packet put there is dropped)
            "qdisc add dev lo root handle 1: htb default 1 r2q 100000",
            "class add dev lo parent 1: classid 1:1 htb rate 10gbit",
            "class add dev lo parent 1: classid 1:2 htb rate 10gbit",
            "qdisc add dev lo parent 1:2 handle 20: pfifo limit 0",
            # protocol 6 (TCP); the flags byte is at 20 + 13 behind a 20-byte IP header:
            # RST (0x04) and FIN (0x01), so that a closed end is never heard of
            "filter add dev lo parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
            "match u8 0x04 0x04 at 33 flowid 1:2",
            "filter add dev lo parent 1: protocol ip prio 2 u32 match ip protocol 6 0xff "
            "match u8 0x01 0x01 at 33 flowid 1:2") as bed:
        yield bed


def _job(bed: netns.Testbed, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        bed.run(1, [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", "4",
                    "--max-attempts", "3", "--timeout", "90", "--", sys.executable,
                    str(WORKER), *args]),
        capture_output=True, text=True, timeout=110, check=False, cwd=ROOT)
    return done, time.monotonic() - started


def _digests(out: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"DIGEST rank=(\d+) ([0-9a-f]{64})", out)}


def test_a_reset_only_one_end_sees_is_taken_up_at_once(no_resets: netns.Testbed) -> None:
    """Rank 2 aborts its link to rank 1 in the middle of the ring allreduce (rank 1 never
    sees the reset); rank 2 dials again, rank 1 takes the new connection at once, and the
    call resumes: the job ends in seconds with the same results as without the fault."""
    plain, _ = _job(no_resets)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    expected = _digests(plain.stdout)
    assert sorted(expected) == [0, 1, 2, 3] and len(set(expected.values())) == 1
    done, took = _job(no_resets, f"mock=2,1,{R},0,{1 << 20},1")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "resets its link to rank 1" in out, out
    assert _digests(done.stdout) == expected, out
    assert "already connected" not in out and "stale" not in out, out
    # without the re-dial taken at once: 25 s or more (keepalive), ranks refusing meanwhile
    assert took < 15, (took, out)
    print(f"job with a one-sided reset: {took:.1f} s")
