"""``--cluster slurm`` and ``mpi``: one srun or mpirun starts every worker, each under
:mod:`tracker.slot`, which restarts it in place."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, TextIO

from tracker.launch.common import (
    ABORT_GRACE_SEC,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    POLL_SEC,
    Interrupted,
    LineWriter,
    TaskRun,
    build_worker_env,
    format_summary,
    hurried,
    interruption,
    output_segments,
)
from tracker.launch.options import LaunchOptions
from tracker.server import JobResult, TrackerThread

_SRUN_LABEL = re.compile(r"\s*(\d+): ")


def group_env(base: Mapping[str, str], tracker_env: Mapping[str, str],
              extra: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """The environment of the srun/mpirun process for ``--cluster slurm``/``mpi`` (pure).

    What every worker gets (:func:`build_worker_env`) but its task id and attempt, which
    each :mod:`tracker.slot` takes from its own launcher index and counts itself: a
    ``DMLC_TASK_ID`` here would give every worker the same one.  ``RABIT2_RECOVER`` is left
    to the slots (on when they may restart), unless set here.
    """
    env = build_worker_env(base, tracker_env, 0, 0)
    del env["DMLC_TASK_ID"], env["DMLC_NUM_ATTEMPT"]
    if "RABIT2_RECOVER" not in base:
        del env["RABIT2_RECOVER"]
    env.update(extra)
    return env


def group_forward(job: Iterable[str], extra: Sequence[tuple[str, str]],
                  environ: Mapping[str, str]) -> list[str]:
    """The variables mpirun must pass on to every worker (``-x``): the job's, the
    ``--env`` ones and the launcher's ``RABIT2_*`` settings (pure)."""
    return sorted({*job, "DMLC_ROLE", "PYTHONUNBUFFERED", *(key for key, _ in extra),
                   *(key for key in environ if key.startswith("RABIT2_"))})


def group_argv(options: LaunchOptions, forward: Sequence[str]) -> list[str]:
    """The one srun or mpirun command line that starts every worker under
    :mod:`tracker.slot` (pure).  mpirun gets ``-x NAME`` for each variable in ``forward``
    (Open MPI passes no environment to other nodes unless told); srun exports the whole
    environment (``--export=ALL``, also inside ``sbatch --export=NONE``, which would leave
    each worker alone), lets the other tasks run on when one fails
    (``--kill-on-bad-exit=0``: the slot restarts it) and labels each output line with the
    task's index."""
    slot = [options.remote_python, "-m", "tracker.slot",
            "--max-attempts", str(options.max_attempts),
            "--restart-delay", f"{options.restart_delay:g}",
            "--kill-grace", f"{options.kill_grace:g}", "--", *options.command]
    n = str(options.num_workers)
    if options.cluster == "slurm":
        return [*options.group, "-n", n, "--export=ALL", "--kill-on-bad-exit=0", "--label",
                *slot]
    exports = [arg for name in sorted(forward) for arg in ("-x", name)]
    return [*options.group, "-n", n, *exports, *slot]


class GroupLauncher:
    """``--cluster slurm`` / ``mpi``: one srun or mpirun starts every worker, each under
    :mod:`tracker.slot` (which restarts it in place, after asking the tracker); this
    process runs the tracker, relays the output, bounds the job and stops it, and prints a
    summary taken from the tracker.  A paused worker that the tracker declares lost is
    killed by its slot (``--watch``), not from here: this process has no handle on one
    remote worker."""

    def __init__(self, options: LaunchOptions, tracker: TrackerThread, out: TextIO,
                 err: TextIO, writer: LineWriter | None = None) -> None:
        self.options = options
        self.tracker = tracker
        self._out, self._err = out, err
        self._writer = writer or LineWriter()

    def _note(self, message: str) -> None:
        self._writer.write(self._err, f"[rabit2-submit] {message}")

    def run(self) -> int:
        options = self.options
        job = self.tracker.worker_env()
        argv = group_argv(options, group_forward(job, options.env, os.environ))
        env = group_env(os.environ, job, options.env)
        self._note(" ".join(shlex.quote(word) for word in argv))
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:  # (as a worker command that cannot be started: usage)
            self._note(f"cannot start {argv[0]!r}: {exc}")
            self.tracker.abort(f"{argv[0]} could not be started")
            return EXIT_USAGE
        readers = [threading.Thread(target=self._relay, args=(pipe, stream), daemon=True)
                   for pipe, stream in ((proc.stdout, self._out), (proc.stderr, self._err))]
        for reader in readers:
            reader.start()
        interrupted = ""  # (how, once it was)
        deadline = None if options.timeout is None else time.monotonic() + options.timeout
        over_since: float | None = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._note(f"the job timed out after {options.timeout:g}s")
                    self.tracker.abort(f"the job timed out after {options.timeout:g}s")
                    break
                result = self.tracker.result()
                if result is not None and not result.success and self.tracker.serves_classic():
                    self._note("the job's workers speak the classic rabit protocol, which "
                               f"has no abort; stopping {argv[0]}")
                    break
                if result is not None:
                    # the job is over (every rank done, or aborted): the workers get the
                    # same grace as rabit2-submit's own to exit before they are stopped
                    over_since = now if over_since is None else over_since
                    if now - over_since > ABORT_GRACE_SEC:
                        self._note(f"{argv[0]} did not exit after the job ended; stopping it")
                        break
                time.sleep(POLL_SEC)
        except (KeyboardInterrupt, Interrupted) as exc:
            interrupted = interruption(exc)
        finally:
            with hurried() as hurry:  # (a second Ctrl-C or SIGTERM: SIGKILL at once)
                if interrupted:
                    self._note(f"the launcher was interrupted ({interrupted})")
                    self.tracker.abort(f"the launcher was interrupted ({interrupted})")
                code = self._stop(proc, hurry)
                for reader in readers:
                    reader.join(options.kill_grace + 1.0)
        result = self.tracker.result()
        self._note("summary:")
        self._writer.write(self._err, self._summary(result, argv[0], code))
        if interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK if code == 0 and result is not None and result.success else EXIT_FAILED

    def _stop(self, proc: subprocess.Popen[bytes], hurry: threading.Event) -> int:
        """The group's exit status; SIGTERM to it (srun and mpirun pass it on to the slots,
        which stop their workers), SIGKILL after ``--kill-grace`` (and 5 s for srun or
        mpirun to pass on the slots' ends), or at once when ``hurry`` is set."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.options.kill_grace + 5.0
            while proc.poll() is None and not hurry.is_set() and time.monotonic() < deadline:
                time.sleep(POLL_SEC)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def _summary(self, result: JobResult | None, group: str, code: int) -> str:
        status = self.tracker.status() or {"tasks": []}
        succeeded = result is not None and result.success
        tasks = []
        for entry in status["tasks"]:
            task_id = str(entry["task_id"])
            tasks.append(TaskRun(
                task_id=int(task_id) if task_id.isdigit() else -1,
                attempts=int(entry["incarnation"]) + 1,
                rank=entry["rank"],
                # (one exit status for the whole group: a task's own is its slot's to say;
                # one that shut down in a failed job left it when the job was aborted)
                status=("done" if succeeded else "stopped") if entry["finished"] else "lost",
            ))
        missing = self.options.num_workers - len(tasks)
        reasons = [f"{group} exited with {code} before the job ended" if result is None
                   else result.reason]
        if succeeded and code != 0:
            reasons.append(f"but {group} exited with {code}: a worker exited non-zero "
                           "afterwards")
        if missing > 0:
            reasons.append(f"{missing} task(s) never reached the tracker")
        failed = not succeeded or code != 0
        return format_summary(tasks, "; ".join(reasons),
                              self.tracker.first_loss if failed else None)

    def _relay(self, pipe: IO[bytes] | None, stream: TextIO) -> None:
        """Pass the group's lines on; srun's ``--label`` ("3: ...", the task index, which is
        the task id) becomes ``[rank r]`` as with the other back-ends."""
        if pipe is None:
            return
        with pipe:
            for text, end in output_segments(pipe):
                label = _SRUN_LABEL.match(text) if self.options.cluster == "slurm" else None
                line = text
                if label is not None:
                    rank = self.tracker.rank_of(label.group(1))
                    line = f"[rank {label.group(1) if rank is None else rank}] {text[label.end():]}"
                self._writer.write(stream, line, end or "\n")
