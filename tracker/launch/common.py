"""What every back-end of the launcher shares: exit statuses, the environment of a worker,
the record of a task, whole output lines and the summary."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
POLL_SEC = 0.02
ABORT_GRACE_SEC = 10.0  # after the tracker aborted, workers get this long to exit themselves


class Interrupted(Exception):
    """SIGTERM to the launcher: unwind like Ctrl-C so the workers are stopped."""


@dataclasses.dataclass(slots=True)
class TaskRun:
    """The launcher's record of one task (one rank) across its attempts."""

    task_id: int
    attempts: int = 0
    rank: int | None = None
    exit_code: int | None = None
    status: str = "pending"  # pending, running, restarting, ok, failed, killed
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float = 0.0
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """How one worker attempt is started: what :mod:`tracker.launch.local` or
    :mod:`tracker.launch.ssh` hands to the per-task launcher."""

    argv: list[str]
    env: dict[str, str] | None  # None: the launcher's own environment
    header: bytes | None = None  # written to the process's stdin, which then stays open
    cpus: tuple[int, ...] | None = None  # the CPUs it starts on (None: not pinned)


def build_worker_env(
    base: Mapping[str, str],
    tracker_env: Mapping[str, str],
    task_id: int,
    attempt: int,
    extra: Sequence[tuple[str, str]] = (),
    bind_cpus: Sequence[int] | None = None,
    recover: bool = False,
) -> dict[str, str]:
    """The environment of one worker attempt (pure).

    ``recover``: the launcher restarts failed workers, so survivors wait for the restarted
    one instead of failing (``RABIT2_RECOVER=1``, unless the environment already says).

    ``bind_cpus`` (``RABIT2_BIND_CPU``, a comma-separated list) is where the worker pins
    itself if it was not started there (the launcher starts it pinned already, see
    :func:`tracker.launch.local.pinned`).
    """
    env = dict(base)
    # Python workers write through a pipe: without this their lines arrive in 8 KiB bursts.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(tracker_env)
    env.update(
        DMLC_TASK_ID=str(task_id),
        DMLC_NUM_ATTEMPT=str(attempt),
        DMLC_ROLE="worker",
    )
    if bind_cpus:
        env["RABIT2_BIND_CPU"] = ",".join(str(cpu) for cpu in bind_cpus)
    if "RABIT2_RECOVER" not in base:
        env["RABIT2_RECOVER"] = "1" if recover else "0"
    env.update(extra)
    return env


def format_summary(tasks: Sequence[TaskRun], job_reason: str | None = None) -> str:
    """A fixed-width table: task, rank, attempts, exit code, status (pure)."""
    rows = [("task", "rank", "attempts", "exit", "status")]
    for task in tasks:
        rows.append((
            str(task.task_id),
            "-" if task.rank is None else str(task.rank),
            str(task.attempts),
            "-" if task.exit_code is None else str(task.exit_code),
            task.status,
        ))
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    if job_reason:
        lines.append(f"job: {job_reason}")
    return "\n".join(lines)


class LineWriter:
    """Writes whole lines; one lock keeps lines of different workers from mixing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, stream: TextIO, line: str) -> None:
        with self._lock:
            stream.write(line + "\n")
            stream.flush()
