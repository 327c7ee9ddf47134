"""Memory that XGBoost's calls through the endpoint reuse instead of faulting in afresh.

Each collective XGBoost makes through the endpoint allocates several buffers of the
payload's size in one process: XGBoost's gRPC client serialises the request and parses the
reply, gRPC's server in the endpoint assembles the request and the reply, and the endpoint
holds the result.  glibc serves each such buffer above its ``mmap`` threshold (128 KiB at
first, raised by what is freed) with a fresh mapping, and gives memory freed at the top of a
heap back to the kernel past its trim threshold (128 KiB): so each call of a few MB faults
in a few thousand fresh pages (measured: 2 MiB calls, 700-2 460 page faults each), and on
a VM a fresh page costs 1-2 us.  Keeping such buffers in the heap, and the heap's freed top,
lets the next call reuse them (``docs/xgboost.md``, "What it costs").

The thresholds set are those glibc's own dynamic ones reach once the process has freed a
buffer of 32 MiB: buffers up to 32 MiB come from a heap, and a heap's free top goes back to
the kernel past 64 MiB (so each thread's arena, whose heaps are 64 MiB at most, keeps its
free top).  Set once per process, for good, by :class:`rabit2.xgboost.CommunicatorContext`,
on glibc only, and not where the environment set either threshold
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or their ``glibc.malloc`` tunables
in ``GLIBC_TUNABLES``): those apply then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("rabit2.xgboost")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Buffers up to this size come from a heap (glibc's largest threshold on 64-bit)."""
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Freed memory at the top of a heap that stays with the process (what glibc's dynamic
threshold sets with the ``mmap`` threshold above)."""
_TUNABLES = ("glibc.malloc.mmap_threshold=", "glibc.malloc.trim_threshold=")

_done: list[bool] = []


def chosen_by_the_environment(environ: os._Environ[str] | dict[str, str]) -> bool:
    """Whether the environment set glibc's ``mmap`` or trim threshold for this process."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return ("MALLOC_MMAP_THRESHOLD_" in environ or "MALLOC_TRIM_THRESHOLD_" in environ
            or any(name in tunables for name in _TUNABLES))


def keep_payload_buffers() -> bool:
    """Raise glibc's ``mmap`` and trim thresholds (once per process); whether they are set
    (False: not glibc, or the environment chose them)."""
    if _done:
        return _done[0]
    libc_name, _ = platform.libc_ver()
    ok = False
    if libc_name == "glibc" and not chosen_by_the_environment(os.environ):
        try:
            libc = ctypes.CDLL(None)
            ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                      and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):
            ok = False
        if not ok:
            logger.debug("glibc's mallopt refused the thresholds: left as they were")
    _done.append(ok)
    return ok
