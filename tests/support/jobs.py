"""Helpers for tests that run real processes and jobs: bounded waits, never a hang."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable


def wait_until(condition: Callable[[], bool], within: float,
               proc: subprocess.Popen[str] | subprocess.Popen[bytes] | None = None,
               what: str = "the condition") -> None:
    """Poll ``condition`` for up to ``within`` seconds; fail if it never holds, or if
    ``proc`` exits meanwhile."""
    deadline = time.monotonic() + within
    while not condition():
        assert proc is None or proc.poll() is None, f"exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {within:g} s"
        time.sleep(0.05)


def assert_gone(pids: Iterable[int], within: float, what: str = "process") -> None:
    """Every process in ``pids`` ends within ``within`` seconds (in all)."""
    deadline = time.monotonic() + within
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"{what} {pid} is still alive"
            time.sleep(0.05)


def assert_one_model(stdout: str, world: int) -> None:
    """Every rank of a ``rabit2.examples.gbdt`` run printed its last line, all with the
    same model digest.  (No line anchors: an unbuffered print is two writes, which mpirun
    may forward apart.)"""
    digests = re.findall(rf"gbdt rank=(\d+) world={world} .*? digest=([0-9a-f]{{64}})",
                         stdout)
    assert sorted(int(rank) for rank, _ in digests) == list(range(world)), stdout
    assert len({digest for _, digest in digests}) == 1, stdout


def need_federated_xgboost() -> None:
    """Skip (with the reason) where XGBoost with its federated communicator is missing."""
    import pytest  # noqa: PLC0415

    xgboost = pytest.importorskip("xgboost")
    if not xgboost.build_info().get("USE_FEDERATED"):
        pytest.skip("this XGBoost build has no federated communicator (xgboost-cpu?)")


def assert_one_xgboost_model(stdout: str, world: int) -> None:
    """Every rank of a ``tests/support/workers/xgb_worker.py`` job printed the same model digest."""
    found = re.findall(rf"xgb rank=(\d+) world={world} model=([0-9a-f]{{64}})", stdout)
    assert sorted(int(rank) for rank, _ in found) == list(range(world)), stdout
    assert len({model for _, model in found}) == 1, found
