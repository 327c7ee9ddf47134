"""What the workers leave behind: processes they started that outlive them.

A worker runs in a process group of its own, which the launcher signals as a whole; a
process the worker started in another session (``setsid``, a daemon) is not in it.  On
Linux the ``rabit2-submit`` command makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``): such a process, orphaned when its worker exits, becomes the
launcher's child instead of init's, so that the launcher can find it by its parent and stop
it when the job ends.  A process that is still the launcher's unreaped child cannot have
its PID reused, so nothing else is ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def adopt() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux; elsewhere, or if
    the kernel refuses, nothing: False).  For a process that runs only the launcher: every
    child it has then, but the workers it manages, is an orphan to stop (:func:`stop`)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def children() -> list[int]:
    """This process's child processes, from ``/proc``."""
    me = os.getpid()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # (gone meanwhile)
            # the command name, in parentheses, may hold spaces: the fields follow the last ')'
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) > 1 and int(fields[1]) == me:
                found.append(int(entry))
    return found


def stop(grace: float) -> int:
    """Stop the orphans adopted so far (after :func:`adopt`, once the workers themselves
    were reaped): SIGTERM, ``grace`` seconds, SIGKILL; reap them, and those that they leave
    in turn (three rounds at most).  Returns how many there were."""
    stopped = 0
    for _ in range(3):
        orphans = children()
        if not orphans:
            break
        _stop(orphans, grace)
        stopped += len(orphans)
    return stopped


def _stop(orphans: list[int], grace: float) -> None:
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = list(orphans)
    while left:
        left = [pid for pid in left if not _reaped(pid)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True  # (not ours any more, or reaped already)
    return done == pid
