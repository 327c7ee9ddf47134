"""Deadlines measure progress, not time: a transfer over a slow link that takes longer than
the progress deadline completes as long as bytes keep moving.

The job runs inside one network namespace (tests/support/netns.py) whose loopback is shaped with
``tc`` to a few Mbit/s; nothing outside the namespace is slowed.  Skipped, with the reason,
where namespaces or ``tc`` are missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import netns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROGRAM = textwrap.dedent("""
    import sys, time
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    rank = rabit2.get_rank()
    data = np.arange(3 << 20, dtype=np.float64) if rank == 0 else None  # 24 MiB
    started = time.monotonic()
    out = rabit2.broadcast(data, root=0)
    took = time.monotonic() - started
    assert np.array_equal(out, np.arange(3 << 20, dtype=np.float64))
    print(f"rank={rank} broadcast ok in {took:.1f} s", flush=True)
    rabit2.finalize()
""")


@pytest.fixture(scope="module")
def slow_host() -> Iterator[netns.Testbed]:
    # 40 Mbit/s on the namespace's loopback (packets of an Ethernet's size, so that each
    # fits the token bucket): 24 MiB take about 5 s
    with netns.one_host_with_tc(
            "qdisc add dev lo root tbf rate 40mbit burst 64kb latency 500ms") as bed:
        subprocess.run(bed.run(1, ["ip", "link", "set", "lo", "mtu", "1500"]), check=True)
        yield bed


def test_a_transfer_slower_than_the_progress_deadline_completes(
        slow_host: netns.Testbed, tmp_path: Path) -> None:
    """A 24 MiB broadcast that takes ~5 s with a 2 s progress deadline: the root only
    sends (it receives nothing), and bytes leave it the whole time, so no rank fails."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    started = time.monotonic()
    done = subprocess.run(
        slow_host.run(1, [sys.executable, "-m", "tracker.submit", "--cluster", "local",
                          "-n", "2", "--max-attempts", "1", "--", sys.executable, str(script),
                          "rabit_timeout_sec=2"]),
        capture_output=True, text=True, timeout=100, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count("broadcast ok") == 2, out
    assert time.monotonic() - started > 3, out  # the link really was slower than the deadline


PAIR_PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import rabit2

    rabit2.init(sys.argv[1:])
    rank = rabit2.get_rank()
    for call in range(4):
        # 480 KB per rank: a pair exchange whose result is made in the buffer kept for
        # replays, while its input is still leaving over the slow link
        data = (np.arange(60_000, dtype=np.float64) * (rank + 1) + call)
        rabit2.allreduce(data, rabit2.Op.SUM)
        want = np.arange(60_000, dtype=np.float64) * 3 + 2 * call
        assert np.array_equal(data, want), (call, data[:4], want[:4])
    print(f"rank={rank} pair ok", flush=True)
    rabit2.finalize()
""")


def test_a_pair_exchange_whose_input_is_still_leaving_gets_the_exact_result(
        slow_host: netns.Testbed, tmp_path: Path) -> None:
    """At world size 2 with recovery on, the pair exchange sends the caller's array itself
    and writes the result over it once the call completes, perhaps before the kernel took
    all of it: over a slow link too, each rank gets the other's input, not its result
    (tests/unit/test_links.py makes the partial write certain)."""
    script = tmp_path / "pair.py"
    script.write_text(PAIR_PROGRAM)
    done = subprocess.run(
        slow_host.run(1, [sys.executable, "-m", "tracker.submit", "--cluster", "local",
                          "-n", "2", "--max-attempts", "2", "--", sys.executable, str(script)]),
        capture_output=True, text=True, timeout=100, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count("pair ok") == 2, out
