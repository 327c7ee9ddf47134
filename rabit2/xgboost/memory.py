"""Memory that XGBoost's calls through the endpoint reuse instead of faulting in afresh.

Each collective XGBoost makes through the endpoint allocates several buffers of the
payload's size in one process: XGBoost's gRPC client serialises the request and parses the
reply, gRPC's server in the endpoint assembles the request and the reply, and the endpoint
holds the result.  glibc serves each such buffer above its ``mmap`` threshold (128 KiB at
first, raised by what is freed) with a fresh mapping, and gives memory freed at the top of a
heap back to the kernel past its trim threshold (128 KiB at first): so each call of a few MB
faults in a few thousand fresh pages (measured: 2 MiB calls, 700-2 460 page faults each; with
the trim threshold of Dask's workers, 3 600-4 300), and on a VM a fresh page costs 1-2 us.
Keeping such buffers in the heap, and the heap's freed top, lets the next call reuse them
(``docs/xgboost.md``, "What it costs").

The thresholds set are those glibc's own dynamic ones reach once the process has freed a
buffer of 32 MiB: buffers up to 32 MiB come from a heap, and a heap's free top goes back to
the kernel past 64 MiB (so each thread's arena, whose heaps are 64 MiB at most, keeps its
free top).  :class:`rabit2.xgboost.CommunicatorContext` sets them when it joins (glibc only;
``rabit2_xgboost_heap=0`` leaves glibc alone).  Where the environment had set either
threshold (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or their ``glibc.malloc``
tunables in ``GLIBC_TUNABLES``, as Dask's nanny does), the context puts the environment's
values back when it ends and hands the freed memory back to the kernel; otherwise they stay
(glibc's dynamic thresholds cannot be put back, and these are what they become).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
from collections.abc import Callable, Mapping

logger = logging.getLogger("rabit2.xgboost")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Buffers up to this size come from a heap (glibc's largest threshold on 64-bit)."""
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Freed memory at the top of a heap that stays with the process (what glibc's dynamic
threshold sets with the ``mmap`` threshold above)."""
GLIBC_FIRST = 128 << 10
"""Either threshold where the environment set only the other (glibc's dynamic thresholds are
off then)."""
_VARIABLES = {"MALLOC_MMAP_THRESHOLD_": M_MMAP_THRESHOLD,
              "MALLOC_TRIM_THRESHOLD_": M_TRIM_THRESHOLD}
_TUNABLES = {"glibc.malloc.mmap_threshold": M_MMAP_THRESHOLD,
             "glibc.malloc.trim_threshold": M_TRIM_THRESHOLD}


_NUMBER = re.compile(r"[ \t]*\+?([1-9][0-9]*|0|0[xX][0-9a-fA-F]+)")
"""A value every glibc reads alike (no octal, no trailing characters: 2.39 rejects those)."""


def startup_environ() -> Mapping[str, str]:
    """The environment this process was started with, which is what glibc read (a later
    ``os.environ`` change, e.g. Dask's ``distributed.nanny.environ`` or a forked child's,
    never reached glibc); ``os.environ`` where ``/proc`` cannot tell."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return os.environ
    found: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, eq, value = entry.partition(b"=")
        if eq:
            found.setdefault(os.fsdecode(name), os.fsdecode(value))
    return found


def environments_thresholds(environ: Mapping[str, str]) -> dict[int, int] | None:
    """The thresholds the environment set for this process, by ``mallopt`` parameter (empty:
    none); None where it set one in a way this cannot read (then glibc is left alone)."""
    found: dict[int, int] = {}
    settings = [(param, environ[name]) for name, param in _VARIABLES.items()
                if name in environ]
    items = environ.get("GLIBC_TUNABLES", "").split(":")
    if items != [""] and ("=" not in items[-1] or any(i.count("=") > 1 for i in items)):
        return None  # (glibc 2.39 and later ignore the whole string then; 2.36 not)
    for item in items:
        name, _, value = item.partition("=")
        if name in _TUNABLES:
            settings.append((_TUNABLES[name], value))
    for param, value in settings:
        if not _NUMBER.fullmatch(value):
            return None
        number = int(value.strip(" \t"), 0)
        if found.get(param, number) != number or not 0 <= number < 1 << 31:
            return None
        found[param] = number
    return found


def raise_thresholds(environ: Mapping[str, str] | None = None) -> Callable[[], None] | None:
    """Set the two thresholds; returns what puts the environment's own back (None: nothing
    to put back, or nothing was set: not glibc, or an environment this cannot read)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    own = environments_thresholds(startup_environ() if environ is None else environ)
    if own is None:
        logger.debug("glibc's malloc thresholds left as the environment set them")
        return None
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD,
                                                                  TRIM_THRESHOLD)):
        logger.debug("glibc's mallopt refused the thresholds")
    if not own:
        return None

    def put_back() -> None:
        for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
            mallopt(param, own.get(param, GLIBC_FIRST))
        malloc_trim(0)

    return put_back
