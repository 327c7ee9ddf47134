"""A per-slot supervisor: restarts for launchers that never restart a worker.

srun, Open MPI's mpirun and Kubernetes start N processes and, when one dies, either let
the others run on without it or stop them all; none starts it again.  Put this program
between them and the worker, with the variables ``rabit2-tracker`` printed in the
environment::

    srun -n 4 python -m tracker.slot --max-attempts 3 -- python train.py
    mpirun -n 4 -x DMLC_TRACKER_URI ... python -m tracker.slot -- python train.py

It runs the command (with ``DMLC_TASK_ID`` from the launcher's own index, see
:func:`rabit2.config.launcher_task`, ``DMLC_NUM_ATTEMPT`` counting its runs and
``RABIT2_RECOVER=1`` unless set) and, when it exits non-zero, runs it again, up to
``--max-attempts`` runs in all, as ``rabit2-submit`` does for its workers; with recovery
on, the new run rejoins the job and replays. Before a restart it tells the tracker that the
run ended (``exited``, ``docs/protocol.md``: the other workers hear of the loss at once, as
under ``rabit2-submit``) and asks whether a new run is still any use: not when the job is
over (finished or aborted), when this task already shut down (it failed for good after
telling the tracker), or when the tracker cannot be reached. When its attempts are used up
it tells the tracker (``give_up``, ``docs/protocol.md``), which aborts the job as
``rabit2-submit`` would: the other workers raise ``JobAbortedError`` at once instead of
waiting for a replacement. While a worker runs, the slot asks the tracker every ``--watch``
seconds whether it declared that worker lost (paused or wedged past the heartbeat
deadline): then it kills it, and the usual restart follows. It also checks then that the
process that started it (srun's step, mpirun) is still there: once it is gone (killed before
it could pass a signal on), the slot stops the command and ends, as on SIGTERM, so that no
worker outlives its launcher. SIGTERM, SIGINT or SIGHUP (the
launcher cancelling the job) stop the command (SIGTERM, then SIGKILL after
``--kill-grace``; it runs in this program's process group, which the launcher tracks) and
end the supervisor without a restart. A worker that had a rank in a job without recovery
(``RABIT2_RECOVER=0``, not elastic) is not restarted (its neighbours' calls failed): the
slot tells the tracker, which ends the job naming it. Exit status: the last run's (128 + N
for signal N; in elastic mode 0 once the tracker was told, so that mpirun does not stop the
others), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from rabit2.config import launcher_task, load_config
from rabit2.errors import RabitError
from rabit2.io.tracker_query import query_tracker_status
from tracker.launch.common import LEFT_EARLY_SEC, attempts_text, left_early
from tracker.remote import ChildGroup, command_after, exit_status

QUERY_TIMEOUT = 10.0
RESTART_QUERY_PATIENCE = 10.0  # asking again, with backoff, before a restart is refused
_EXIT_GRACE = 2.0  # a worker seen disconnected gets this long to be exiting on its own


def _ask_tracker(env: Mapping[str, str], task: str, give_up: tuple[str, str] | None = None,
                 exited: int | None = None) -> dict[str, Any] | str | None:
    """The job's tracker status, listing ``task`` alone (after telling it ``give_up``, or
    that run ``exited`` of ``task`` ended, if given); a string saying why it cannot be
    asked; None when there is no tracker (a single-process program)."""
    try:
        cfg = load_config(environ=env)  # the tracker and secret exactly as a worker reads them
    except ValueError as exc:
        return f"the tracker cannot be asked ({exc})"
    if cfg.tracker_uri is None:
        return None
    try:
        return asyncio.run(query_tracker_status(
            cfg.tracker_uri, cfg.tracker_port, cfg.secret, QUERY_TIMEOUT, give_up,
            task_id=task, exited=None if exited is None else (task, exited)))
    except RabitError as exc:
        return f"the tracker cannot be asked ({exc})"


JOB_OVER = "the job is over"
SHUT_DOWN = "it shut down with the tracker before it exited: it failed for good"
NO_RECOVERY = ("the job runs without recovery (rabit2_recover off): its neighbours' calls "
               "failed, and a restart could not join it")


def restart_refused(env: Mapping[str, str], task: str,
                    patience: float = RESTART_QUERY_PATIENCE,
                    exited: int | None = None) -> str | None:
    """Why the tracker says a new run of ``task`` would be no use, or None if it would.
    ``exited``: the run of ``task`` that just ended, which the tracker hears first (it
    tells the other workers of the loss at once, instead of keeping the task's place for
    a rejoin that cannot come).

    A tracker that cannot be reached is asked again, with backoff, for ``patience`` seconds:
    a blip on the tracker's path must not cost the job a worker."""
    deadline = time.monotonic() + patience
    delay = 0.2
    status = _ask_tracker(env, task, exited=exited)
    if isinstance(status, str) and exited is not None:
        # (a tracker of an older rabit2 closes a connection that sends ``exited``: the
        # report is a courtesy, the restart is what matters)
        status = _ask_tracker(env, task)
    while isinstance(status, str) and time.monotonic() + delay <= deadline:
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
        status = _ask_tracker(env, task)
    if status is None or isinstance(status, str):
        return status
    if status.get("done"):
        return f"{JOB_OVER} ({status.get('reason')})"
    for entry in status.get("tasks", []):
        if entry.get("task_id") == task and entry.get("finished"):
            return SHUT_DOWN
        if (entry.get("task_id") == task and entry.get("rank") is not None
                and not _joins_again(env)):
            return NO_RECOVERY
    return None


def main(argv: Sequence[str] | None = None) -> int:  # noqa: C901
    parser = argparse.ArgumentParser(
        prog="python -m tracker.slot",
        description="Run a rabit2 worker and restart it when it fails (for srun, mpirun, ...).",
    )
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="runs in all, the first included (default 3)")
    parser.add_argument("--restart-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--kill-grace", type=float, default=5.0, metavar="S")
    parser.add_argument("--watch", type=float, default=5.0, metavar="S",
                        help="ask the tracker this often whether it declared the running "
                             "worker lost (a paused or wedged process); 0: never (default 5)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = command_after(parser, args.command)
    if args.max_attempts < 1:
        parser.error("--max-attempts must be >= 1")
    if args.restart_delay < 0 or args.kill_grace < 0:
        parser.error("--restart-delay and --kill-grace must be >= 0")
    if args.watch < 0:
        parser.error("--watch must be >= 0")
    env = dict(os.environ)
    task, attempt_text = launcher_task(env)
    if task is None:
        parser.error("no task id: set DMLC_TASK_ID, or run under srun/mpirun (SLURM_PROCID, "
                     "OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, JOB_COMPLETION_INDEX)")
    try:
        first_attempt = 0 if attempt_text is None else int(attempt_text)
    except ValueError:
        parser.error(f"attempt number {attempt_text!r} is not an integer")
    env["DMLC_TASK_ID"] = task
    env.setdefault("RABIT2_RECOVER", "1" if args.max_attempts > 1 else "0")
    env.setdefault("PYTHONUNBUFFERED", "1")

    stopped = threading.Event()
    current: list[ChildGroup] = []

    def stop(signum: int = 0, frame: FrameType | None = None) -> None:
        """Stop the worker and end without a restart (a signal's handler too)."""
        stopped.set()
        if current:
            current[0].stop()
    orphaned = functools.partial(_orphaned, os.getppid(), task, stop)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)

    code = 0
    for run in range(args.max_attempts):
        env["DMLC_NUM_ATTEMPT"] = str(first_attempt + run)
        try:
            # in this process's group: launchers track their tasks by process group
            # (Slurm's proctrack/pgid, Open MPI's orted), and one that kills this
            # supervisor's group outright must reach the worker too
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            _note(task, f"cannot start {command[0]!r}: {exc}")
            return 127
        current[:] = [ChildGroup(proc, args.kill_grace, whole_group=False)]
        if stopped.is_set():  # a signal between the check and the start
            current[0].stop()
        ended = threading.Event()
        if args.watch > 0:
            threading.Thread(target=_watch,
                             args=(env, task, first_attempt + run, proc, args.watch, ended,
                                   orphaned),
                             daemon=True, name="rabit2-slot-watch").start()
        code = exit_status(proc.wait())
        ended.set()
        if code == 0 and not stopped.is_set():
            why = _left_early(env, task)
            if why is not None:
                _note(task, f"{why}; ending the job")
                _ask_tracker(env, task, (task, why))
        if code == 0 or stopped.is_set():
            return code
        final = _after_failure(env, task, code, run + 1, args.max_attempts, first_attempt)
        if final is not None:
            return final
        if stopped.wait(args.restart_delay):
            return code
    return code


def _after_failure(env: Mapping[str, str], task: str, code: int, runs: int,
                   max_attempts: int, first_attempt: int) -> int | None:
    """The worker's ``runs``-th run exited with ``code``: None to restart it, or the slot's
    exit status.  In elastic mode that is 0 once the tracker knows (the job may go on
    without it, and a non-zero status would make mpirun stop every other worker, and srun
    report the job failed)."""
    if runs == max_attempts:
        _note(task, f"exited with {code} after {attempts_text(runs)}; giving up")
        # as rabit2-submit does: the job ends now, rather than the other workers waiting
        # for a replacement that will not come
        _ask_tracker(env, task, (task, f"exited with {code} after {attempts_text(runs)}"))
        return 0 if _elastic(env) else code
    why = restart_refused(env, task, exited=first_attempt + runs - 1)
    if why is not None:
        _note(task, f"exited with {code}; not restarting: {why}")
        if why == NO_RECOVERY:  # (the job ends now, naming this exit, as out of attempts)
            _ask_tracker(env, task, (task, f"exited with {code}; {why}"))
        return 0 if why.startswith((JOB_OVER, SHUT_DOWN)) and _elastic(env) else code
    _note(task, f"exited with {code} (attempt {runs}/{max_attempts}); restarting")
    return None


def _modes(env: Mapping[str, str]) -> tuple[bool, bool] | None:
    """The worker's (recover, elastic) settings; None where they do not even parse (the
    worker says what is wrong with them)."""
    try:
        config = load_config(environ=env)
    except ValueError:
        return None
    return config.recover, config.elastic


def _joins_again(env: Mapping[str, str]) -> bool:
    """Whether a restart of the worker can join its job once it had a rank: with recovery
    or in elastic mode (unknown settings: restarting stays the answer)."""
    modes = _modes(env)
    return modes is None or any(modes)


def _elastic(env: Mapping[str, str]) -> bool:
    """Whether the worker runs in elastic mode (a worker may leave the job)."""
    modes = _modes(env)
    return modes is not None and modes[1]


def _left_early(env: Mapping[str, str], task: str) -> str | None:
    """Why the job cannot go on now that ``task``'s program ended with status 0, or None:
    it never joined while others did, or it joined and never finalized (as
    ``rabit2-submit`` decides for its own workers).  Asked twice, ``LEFT_EARLY_SEC`` apart,
    so that a job's end the tracker has not recorded yet is not taken for it; not in elastic
    mode, where a worker may leave."""
    if _elastic(env):
        return None
    for look in range(2):
        status = _ask_tracker(env, task)
        if not isinstance(status, dict) or status.get("done"):
            return None
        mine = [t for t in status.get("tasks", []) if t.get("task_id") == task]
        if (mine and mine[0].get("finished")) or (not mine and not status.get("registered")):
            return None
        if not look:
            time.sleep(LEFT_EARLY_SEC)
    return left_early(task, bool(mine))


def _watch(env: Mapping[str, str], task: str, attempt: int, proc: subprocess.Popen[bytes],
           interval: float, ended: threading.Event, orphaned: Callable[[], bool]) -> None:
    """Kill the running worker (SIGKILL: a stopped process too) once the tracker has
    declared it lost, e.g. silent past its heartbeat deadline, so that the usual restart
    runs, as ``rabit2-submit`` does for its own workers.  "Lost" is: the tracker knows this
    run (its attempt number), no longer has a connection from it, and it did not shut down.
    A tracker that cannot be asked is asked again later; once the job is over it is not
    asked again.  Until the worker ends, ``orphaned()`` is checked each time (the slot's
    launcher gone: it stops the worker)."""
    asking = True  # (no tracker in the environment, or a job over: nothing more to ask)
    while not ended.wait(interval):
        if orphaned():
            return
        if not asking:
            continue
        status = _ask_tracker(env, task)
        if status is None or (isinstance(status, dict) and status.get("done")):
            asking = False
            continue
        if isinstance(status, str):
            continue
        entry = next((e for e in status.get("tasks", []) if e.get("task_id") == task), None)
        if (entry is not None and entry.get("attempt") == attempt
                and not entry.get("connected") and not entry.get("finished")):
            # a worker that closed its tracker connection because it is exiting is gone
            # within a moment; one that is paused or wedged is not
            if ended.wait(_EXIT_GRACE) or proc.poll() is not None:
                return
            _note(task, "the tracker declared it lost (silent or disconnected) while it "
                        "still runs; killing it")
            proc.kill()
            return


def _orphaned(parent: int, task: str, stop: Callable[[], None]) -> bool:
    """Whether the launcher that started this slot (``parent``) is gone, taking its signals
    with it; if so, stop the worker as on SIGTERM."""
    if os.getppid() == parent:
        return False
    _note(task, "the process that started this slot is gone; stopping the worker")
    stop()
    return True


def _note(task: str, message: str) -> None:
    """Say ``message`` on stderr, if anyone still reads it (a launcher killed outright took
    the other end of the pipe with it)."""
    with contextlib.suppress(OSError):
        print(f"[rabit2 slot {task}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
