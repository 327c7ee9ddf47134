"""A program error on one rank (an exception, not a crash) ends the job at once: the raising
rank's traceback reaches the user, every other rank fails with a typed error naming it, and
the launcher does not restart a program that raised."""

from __future__ import annotations

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
