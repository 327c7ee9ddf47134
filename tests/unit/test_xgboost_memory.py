"""``rabit2.xgboost.memory``: buffers of a few MB freed and allocated again reuse their pages
(each case in a process of its own: malloc's settings are the process's)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rabit2.xgboost.memory import chosen_by_the_environment

ROOT = Path(__file__).resolve().parents[2]

# allocate and free two 2 MiB buffers 50 times (as a call through the endpoint does with its
# request and reply), first after keep_payload_buffers(); print what it returned and the page
# faults per iteration
PROBE = """
import resource, sys
from rabit2.xgboost import memory
print(memory.keep_payload_buffers(), memory.keep_payload_buffers())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    a = bytearray(2 << 20)
    b = bytes(a)
    del a, b
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""


def _probe(**env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not chosen_by_the_environment({k: v})}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}).stdout.split("\n")
    return out[0], float(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_payload_buffers_are_reused_not_faulted_in_again() -> None:
    said, faults = _probe()
    assert said == "True True"
    assert faults < 100  # (of 1024 pages: glibc's own settings fault in nearly all of them)


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_the_environments_choice_of_malloc_settings_is_left_alone(env: dict[str, str]) -> None:
    said, _ = _probe(**env)
    assert said == "False False"


def test_what_counts_as_the_environments_choice() -> None:
    assert not chosen_by_the_environment({"GLIBC_TUNABLES": "glibc.rtld.nns=2"})
    assert chosen_by_the_environment(
        {"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.mmap_threshold=65536"})
    # (other malloc settings leave the thresholds to rabit2, in either spelling)
    assert not chosen_by_the_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert not chosen_by_the_environment({"MALLOC_ARENA_MAX": "2"})
