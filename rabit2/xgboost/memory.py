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

Set once per process by :class:`rabit2.xgboost.CommunicatorContext`, on glibc only, and not
where the program or its environment chose glibc's malloc settings itself
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc`` tunables in
``GLIBC_TUNABLES``): those apply then.
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
"""Buffers up to this size come from the heap (glibc's largest allowed threshold on 64-bit)."""
TRIM_THRESHOLD = 512 << 20
"""Freed memory at the top of a heap that stays with the process."""

_done: list[bool] = []


def chosen_by_the_environment(environ: os._Environ[str] | dict[str, str]) -> bool:
    """Whether glibc's malloc thresholds were set for this process by its environment."""
    return ("MALLOC_MMAP_THRESHOLD_" in environ or "MALLOC_TRIM_THRESHOLD_" in environ
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


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
