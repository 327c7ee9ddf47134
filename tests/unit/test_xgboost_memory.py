"""``rabit2.xgboost.memory``: buffers of a few MB freed and allocated again reuse their pages
while the thresholds are raised, and the environment's own thresholds come back after (each
case in a process of its own: malloc's settings are the process's)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rabit2.xgboost.memory import (
    GLIBC_FIRST,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    environments_thresholds,
)

ROOT = Path(__file__).resolve().parents[2]

# allocate and free two 2 MiB buffers 50 times (as a call through the endpoint does with its
# request and reply): page faults per iteration before raise_thresholds(), while raised,
# and after what it returned put the environment's back
PROBE = """
import os, sys
from rabit2.xgboost import memory
if os.environ.get("RABIT2_PROBE_LATE"):
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"  # (after start: glibc never reads it)
sys.path.insert(0, "tests/support/workers")
from xgb_misuse import faults

first = faults()
put_back = memory.raise_thresholds()
raised = faults()
if put_back is not None:
    put_back()
print(put_back is not None, first, raised, faults())
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


def _probe(**env: str) -> tuple[bool, float, float, float]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}).stdout.split()
    return out[0] == "True", float(out[1]), float(out[2]), float(out[3])


@glibc_only
def test_freed_payload_buffers_are_reused_not_faulted_in_again() -> None:
    put_back, _, raised, after = _probe()
    assert not put_back  # (glibc's dynamic thresholds: nothing to put back)
    assert raised < 100 and after < 100  # (of 1024 pages a time)


@glibc_only
@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "65536"},  # (Dask's workers)
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=65536"}])
def test_the_environments_thresholds_come_back_after(env: dict[str, str]) -> None:
    put_back, first, raised, after = _probe(**env)
    assert put_back
    assert first > 900 and after > 900  # (every buffer faulted in afresh, as the env says)
    assert raised < 100


def test_what_the_environment_set_is_read() -> None:
    assert environments_thresholds({}) == {}
    assert environments_thresholds({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) == {}
    assert environments_thresholds({"MALLOC_ARENA_MAX": "2"}) == {}
    assert environments_thresholds({"MALLOC_TRIM_THRESHOLD_": "65536"}) == {
        M_TRIM_THRESHOLD: 65536}
    assert environments_thresholds(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=0x20000"}) == {
        M_MMAP_THRESHOLD: 0x20000}
    assert environments_thresholds({"MALLOC_TRIM_THRESHOLD_": "65536", "GLIBC_TUNABLES":
                                    "glibc.malloc.trim_threshold=65536"}) == {
        M_TRIM_THRESHOLD: 65536}
    # what cannot be read or put back leaves glibc alone: None
    for env in ({"MALLOC_TRIM_THRESHOLD_": "lots"}, {"MALLOC_MMAP_THRESHOLD_": str(1 << 40)},
                {"MALLOC_TRIM_THRESHOLD_": "1", "GLIBC_TUNABLES":
                 "glibc.malloc.trim_threshold=2"}):
        assert environments_thresholds(env) is None
    assert GLIBC_FIRST == 128 << 10


@glibc_only
def test_a_threshold_set_in_os_environ_after_start_is_not_put_back() -> None:
    """glibc read the environment at exec: a variable set later (Dask's
    ``distributed.nanny.environ``, a forked child) never applied, so nothing is put back."""
    put_back, _, raised, after = _probe(RABIT2_PROBE_LATE="1")
    assert not put_back and raised < 100 and after < 100


def test_values_glibc_versions_read_differently_leave_glibc_alone() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": "65536 "}, {"MALLOC_TRIM_THRESHOLD_": "010"},
                {"MALLOC_TRIM_THRESHOLD_": "1_000"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=65536:"}):
        assert environments_thresholds(env) is None
