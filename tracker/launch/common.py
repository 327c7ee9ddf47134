"""What every back-end of the launcher shares: exit statuses, the environment of a worker,
the record of a task, whole output lines and the summary."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import IO, TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
POLL_SEC = 0.02
ABORT_GRACE_SEC = 10.0  # after the tracker aborted, workers get this long to exit themselves


EXIT_USAGE = 2


class Interrupted(Exception):
    """SIGTERM to the launcher: unwind like Ctrl-C so the workers are stopped.  Its text
    is the signal's name."""


def interruption(exc: BaseException) -> str:
    """How the launcher was interrupted, as its summary says it: "Ctrl-C" or the signal."""
    return "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else str(exc) or "a signal"


@contextlib.contextmanager
def hurried() -> Iterator[threading.Event]:
    """While the launcher stops the workers, a Ctrl-C or SIGTERM (a second one, if the
    first began the stop) sets the event, which makes the stop kill at once, instead of
    raising in the middle of it and leaving workers behind.  On the main thread only (where
    signal handlers run); elsewhere the event is never set."""
    hurry = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hurry
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        hurry.set()

    saved = [(signum, signal.signal(signum, handler))
             for signum in (signal.SIGINT, signal.SIGTERM)]
    try:
        yield hurry
    finally:
        for signum, previous in saved:
            signal.signal(signum, previous)


LEFT_EARLY_SEC = 1.0
"""How long after a task's program ended with 0 the launcher (or a slot) looks again whether
the job still needed it: the tracker may not have recorded the job's end yet."""


def left_early(task: str, joined: bool) -> str:
    """Why a task whose program ended with status 0 while the job still needs it ends the
    job (restarting a program that ended by itself only ends it again): it ``joined`` and
    never finalized, or never joined while others did."""
    if joined:
        return (f"task {task} exited with 0 without rabit2.finalize() while the job ran: the "
                "others cannot finish without it")
    return (f"task {task} exited with 0 without joining the job (rabit2.init), which the "
            "others joined: they cannot start without it")


class LaunchError(Exception):
    """What keeps the job from starting at all (the tracker cannot listen, a worker cannot
    be started): one line and exit status 2, no traceback."""


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
    last_error: str = ""  # the last non-empty line its attempt wrote on stderr
    killed_for: str = ""  # why the launcher killed its attempt, if it did
    started_at: float = 0.0  # (time.monotonic()) when its current attempt started


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


def format_summary(tasks: Sequence[TaskRun], job_reason: str | None = None,
                   root_cause: str | None = None) -> str:
    """A fixed-width table: task, rank, attempts, exit code, status; then the first failure
    (``root cause:``) and the job's outcome (``job:``) (pure)."""
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
    if root_cause:
        lines.append(f"root cause: {root_cause}")
    if job_reason:
        lines.append(f"job: {job_reason}")
    return "\n".join(lines)


def attempts_text(count: int) -> str:
    """``1 attempt``, ``3 attempts``."""
    return f"{count} attempt{'' if count == 1 else 's'}"


def how_ended(code: int) -> str:
    """A process's end as the launcher says it: "exited with 3", "was killed by SIGKILL"
    (``code``: a ``Popen.returncode``, negative for a signal)."""
    if code >= 0:
        return f"exited with {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def describe_failure(task: TaskRun, code: int, attempts: int, when: float) -> str:
    """The first failure of a job, as the summary's ``root cause:`` row says it (pure):
    who, how it ended (an exit status, or the signal that killed it), which attempt, when,
    and the last line it wrote on stderr."""
    who = f"task {task.task_id}" if task.rank is None else f"rank {task.rank} (task {task.task_id})"
    how = how_ended(code)
    by = f", by the launcher: {task.killed_for}" if task.killed_for else ""
    said = f": {task.last_error}" if task.last_error else ""
    clock = time.strftime("%H:%M:%S", time.localtime(when))
    return f"{who} {how} at {clock} (attempt {task.attempts}/{attempts}){by}{said}"


class LineWriter:
    """Writes whole lines; one lock keeps lines of different workers from mixing.

    ``timestamps``: each line starts with the wall-clock time (``--timestamps``);
    ``log_file``: every whole line also goes there, always with the date and time
    (``--log-file``).  A line may end in ``\r`` (a progress bar redrawing itself): it is
    passed on as it is, and not written to the log file."""

    def __init__(self, timestamps: bool = False, log_file: TextIO | None = None) -> None:
        self._lock = threading.Lock()
        self.timestamps = timestamps
        self.log_file = log_file

    def write(self, stream: TextIO, text: str, end: str = "\n") -> None:
        """Write ``text`` (several lines if it has newlines), then ``end``."""
        now = time.time()
        lines = text.split("\n")
        with self._lock:
            for i, line in enumerate(lines):
                if self.timestamps:
                    stream.write(_clock(now, "%H:%M:%S"))
                stream.write(line + (end if i == len(lines) - 1 else "\n"))
                if self.log_file is not None and (end == "\n" or i < len(lines) - 1):
                    self.log_file.write(_clock(now, "%Y-%m-%d %H:%M:%S") + line + "\n")
            stream.flush()
            if self.log_file is not None:
                self.log_file.flush()


def _clock(now: float, fmt: str) -> str:
    return f"{time.strftime(fmt, time.localtime(now))}.{int(now * 1000) % 1000:03d} "


def output_segments(pipe: IO[bytes]) -> Iterator[tuple[str, str]]:
    """A worker's output as ``(text, end)``: lines ending in ``\n``, and progress updates
    ending in ``\r`` passed on at once rather than held until the next newline; a last
    unterminated piece ends in ``""``."""
    pending = b""
    read = pipe.read1 if hasattr(pipe, "read1") else pipe.read
    while chunk := read(65536):
        pending += chunk
        start = 0
        for brk in _BREAKS.finditer(pending):
            text, end = pending[start : brk.start()], "\r" if brk.group() == b"\r" else "\n"
            if text or end == "\n":  # (a redraw starts with \r: nothing before it)
                yield text.decode("utf-8", errors="replace"), end
            start = brk.end()
        pending = pending[start:]
    if pending:
        yield pending.decode("utf-8", errors="replace"), ""


_BREAKS = re.compile(rb"\r\n|\n|\r(?=[\s\S])")
"""Where a line or a redraw ends; a \r last in what was read waits for the next read (it may
be the first half of a \r\n)."""


class LogLines(logging.Handler):
    """The tracker's log records as the launcher's lines: ``[tracker] LEVEL message``."""

    def __init__(self, writer: LineWriter, stream: TextIO) -> None:
        super().__init__()
        self.writer = writer
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.writer.write(self.stream, f"[tracker] {record.levelname} {record.getMessage()}")
        except Exception:
            self.handleError(record)
