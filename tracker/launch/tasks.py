"""One process per task, restarted by this launcher: ``--cluster local`` and ``ssh``.

:class:`TaskLauncher` starts every task (through :mod:`tracker.launch.local` or
:mod:`tracker.launch.ssh`), relays its output as ``[rank r]`` lines, restarts it when it
exits non-zero until ``--max-attempts``, gives up on the job (through the tracker) when a
task runs out of attempts, the job times out or the launcher is interrupted, stops every
process group on the way out and prints the per-task summary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import IO, TextIO

from rabit2.io.tracker_client import NO_ASSIGNMENT
from tracker.launch import orphans
from tracker.launch.common import (
    ABORT_GRACE_SEC,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    LEFT_EARLY_SEC,
    POLL_SEC,
    Interrupted,
    LaunchError,
    LineWriter,
    TaskRun,
    attempts_text,
    describe_failure,
    format_summary,
    how_ended,
    hurried,
    interruption,
    left_early,
    output_segments,
)
from tracker.launch.local import local_attempt, pinned
from tracker.launch.options import LaunchOptions
from tracker.launch.ssh import ssh_attempt
from tracker.registry import REJOIN_GRACE_SEC
from tracker.server import JobResult, TrackerThread
from tracker.service import CLOSED_BY_WORKER

LOST_EXIT_GRACE_SEC = 2.0
"""How long a worker the tracker declared lost (its connection ended) may take to exit on its
own before the launcher kills it."""


def job_line(result: JobResult | None, ok: bool, interrupted: bool) -> str:
    """The summary's ``job:`` row: how the job ended, in every case (pure)."""
    if result is None:
        return ("the launcher was interrupted before the job ended" if interrupted
                else "the workers exited before the job ended")
    if result.success and not ok:
        # every rank told the tracker it was done, and then a worker failed all the same
        return f"{result.reason}, but a worker exited non-zero afterwards"
    return result.reason


class TaskLauncher:
    """Runs the workers of one job on this machine against an already started tracker."""

    def __init__(
        self,
        options: LaunchOptions,
        tracker: TrackerThread,
        out: TextIO,
        err: TextIO,
        writer: LineWriter | None = None,
    ) -> None:
        self.options = options
        self.tracker = tracker
        self.tasks = [TaskRun(task_id=i) for i in range(options.num_workers)]
        self._out = out
        self._err = err
        self._writer = writer or LineWriter()
        self._abort_seen_at: float | None = None
        self._done_seen_at: float | None = None
        self._root_cause: str | None = None  # the job's first failure, as the summary says
        self._root_task: int | None = None  # the task whose exit it was, if it was one
        self._ended_ok: dict[int, float] = {}  # task id -> when its program ended with 0
        self._failures: dict[int, str] = {}  # task id -> its last failure, as said
        # task id -> (why, when) the tracker declared it lost because its connection ended
        self._lost: dict[str, tuple[str, float]] = {}

    def _note(self, message: str) -> None:
        self._writer.write(self._err, f"[rabit2-submit] {message}")

    def run(self) -> int:
        """Run the job to the end; return the exit status.  Never leaves a worker running."""
        options = self.options
        deadline = None if options.timeout is None else time.monotonic() + options.timeout
        interrupted = False
        try:
            for task in self.tasks:
                self._spawn(task)
            while not all(task.status in ("ok", "failed", "killed", "left", "left early")
                          for task in self.tasks):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._give_up(f"the job timed out after {options.timeout:g}s")
                    break
                if not self._step(now):
                    break
                time.sleep(POLL_SEC)
            else:
                self._settle_left_early()
        except (KeyboardInterrupt, Interrupted) as exc:
            interrupted = True
            self._give_up(f"the launcher was interrupted ({interruption(exc)})")
        finally:
            with hurried() as hurry:
                self._terminate_all(hurry)
                if options.reap_orphans:
                    stopped = orphans.stop(0.0 if hurry.is_set() else options.kill_grace)
                    if stopped:
                        self._note(f"stopped {stopped} process(es) the workers left behind")
                # bounded: a process that escaped the workers' groups may hold a pipe
                end = time.monotonic() + options.kill_grace + 1.0
                for task in self.tasks:
                    for reader in task.readers:
                        reader.join(max(0.0, end - time.monotonic()))
        if options.elastic and not interrupted:
            self._left_elastic_job()
        result = self.tracker.result()
        for task in self.tasks:
            task.rank = self.tracker.rank_of(str(task.task_id))
        if result is not None and not result.success:
            # the first failure may be one the job went on from (elastic mode went on
            # without it, or a restart recovered it): the root cause is then the failure of
            # the task the job ended for, where it names one
            ended_by = next((task.task_id for task in self.tasks
                             if task.task_id in self._failures and self._aborted_by(task)),
                            None)
            first = next((t for t in self.tasks if t.task_id == self._root_task), None)
            if ended_by is not None and first is not None and (
                    options.elastic or first.task_id == ended_by or first.status != "failed"):
                self._root_cause = self._failures[ended_by]
        self._note("summary:")
        # (elastic: a task that left a job that went on to succeed is no failure of it)
        left_ok = self.options.elastic and result is not None and result.success
        # (an aborted job failed, even where every program caught the error and exited 0)
        ok = (result is None or result.success) and all(
            (task.exit_code == 0 and task.status != "left early")
            or (left_ok and task.status in ("left", "left early")) for task in self.tasks)
        self._writer.write(self._err, format_summary(
            self.tasks, job_line(result, ok, interrupted), None if ok else self._root_cause))
        if interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK if ok else EXIT_FAILED

    def _left_elastic_job(self) -> None:
        """Elastic mode, every worker gone: a task whose program ended with status 0 without
        finalizing left the job, which went on without it (as without a lost worker that is
        not restarted); the tracker hears so, and the job ends as the others left it."""
        joined, told = self.tracker.joined(), False
        for task in self.tasks:
            tid = str(task.task_id)
            if task.status == "ok" and tid in joined and not self.tracker.has_finished(tid):
                task.status = "left early"
                self._give_up(f"task {tid} exited with 0 without rabit2.finalize(): it left "
                              "the job", task_id=task.task_id)
                told = True
        # (the tracker's thread settles the job: bounded)
        end = time.monotonic() + LEFT_EARLY_SEC
        while told and self.tracker.result() is None and time.monotonic() < end:
            time.sleep(POLL_SEC)

    def _step(self, now: float) -> bool:
        """Reap, restart or give up; False when the job is over for good."""
        result = self.tracker.result()
        if result is not None and not result.success and self._abort_seen_at is None:
            self._abort_seen_at = now
            self._note(f"job aborted: {result.reason}")
        if self._abort_seen_at is not None and self.tracker.serves_classic():
            # (no abort reaches a classic worker: one still running waits for a peer that
            # is gone, or trains on in a job that failed)
            self._note("the job's workers speak the classic rabit protocol, which has no "
                       "abort; stopping them")
            return False
        if self._abort_seen_at is not None and now - self._abort_seen_at > ABORT_GRACE_SEC:
            self._note("workers did not exit after the abort; stopping them")
            return False
        if result is not None and result.success:
            # every rank told the tracker it is done: a process that still does not exit
            # (stopped, or stuck after finalize) must not keep the launcher waiting
            if self._done_seen_at is None:
                self._done_seen_at = now
            elif now - self._done_seen_at > ABORT_GRACE_SEC:
                self._note("workers did not exit after the job finished; stopping them")
                return False
        silent = set(self.tracker.take_silent())
        for tid, why, at in self.tracker.take_disconnected():
            if not why.startswith(CLOSED_BY_WORKER):
                # (a worker that closed its connection is leaving: its exit handlers may
                # take their time, and a restart's attempt may already run; what is meant
                # here is a connection the network stopped carrying)
                self._lost[tid] = (why, at)
        for task in self.tasks:
            lost = self._lost.get(str(task.task_id))
            if lost is not None and now - lost[1] >= LOST_EXIT_GRACE_SEC:
                # (a process that is exiting got a moment to end on its own)
                del self._lost[str(task.task_id)]
                self._kill_lost(task, *lost)
            if str(task.task_id) in silent and task.proc is not None and task.status == "running":
                # a paused or wedged worker keeps its process alive but answers nothing: stop
                # it, so that the usual restart-or-give-up logic runs instead of waiting
                task.killed_for = (
                    f"no heartbeat for {self.options.heartbeat_timeout:g} s "
                    "(--heartbeat-timeout: a paused process, or one whose Python never let "
                    "go of the GIL, as in a long call into C that does not release it)")
                self._note(f"task {task.task_id} went silent; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(task.proc.pid, signal.SIGKILL)
            if task.status == "restarting" and now >= task.restart_at:
                if self._abort_seen_at is None:
                    self._spawn(task)
                else:  # (the job was aborted while its restart waited out --restart-delay)
                    task.status = "failed"
            if task.proc is None or task.status != "running":
                continue
            code = task.proc.poll()
            if code is None:
                continue
            self._exited(task, code, now)
        self._check_left_early(now)
        return True

    def _check_left_early(self, now: float) -> None:
        """A task whose program ended with status 0 while the job still needs it: one that
        never joined, once others did (they wait for it to be assigned their ranks), or one
        that joined and never finalized (its neighbours wait for it, or for a replacement).
        Restarting a program that ended by itself only ends it again, so the job is given up
        on, naming it, instead of waiting for the others' deadlines.  (Elastic mode: the job
        goes on without it; :meth:`_left_elastic_jobs` says so once the workers exited.)"""
        if (self.options.elastic or self._abort_seen_at is not None
                or self.tracker.result() is not None):
            return
        joined = self.tracker.joined()
        if not joined:
            return  # (no worker calls init: nothing waits)
        for task in self.tasks:
            tid = str(task.task_id)
            ended = self._ended_ok.get(task.task_id)
            # (a moment's grace: the tracker may not have recorded the job's end yet)
            if (task.status != "ok" or ended is None or now - ended < LEFT_EARLY_SEC
                    or self.tracker.has_finished(tid)):
                continue
            why = left_early(tid, tid in joined)
            task.status = "left early"  # (its exit status 0 is no success of the job)
            self._root_cause = why
            self._give_up(why, task_id=task.task_id)
            self._abort_seen_at = now
            return

    def _kill_lost(self, task: TaskRun, why: str, lost_at: float) -> None:
        """The tracker lost ``task`` by its connection (``why``) and it did not come back: a
        host that cannot be reached (its ssh may wait for minutes), or a process cut off
        from the tracker.  The job goes on without it, so its attempt is stopped, to be
        restarted or given up on; not an attempt started after that one ended."""
        if (task.proc is None or task.status != "running" or task.started_at >= lost_at - 1.0
                or task.proc.poll() is not None):
            return
        task.killed_for = (f"the tracker lost it ({why}) and it did not rejoin within "
                           f"{REJOIN_GRACE_SEC:g} s: its host unreachable, or the tracker's "
                           "port from it")
        self._note(f"task {task.task_id} lost its tracker connection ({why}); killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(task.proc.pid, signal.SIGKILL)

    def _settle_left_early(self) -> None:
        """Every task's program ended, the last ones within the grace that
        :meth:`_check_left_early` gives the tracker to record the job's end: give it that
        grace now, and then a task that joined and never finalized left early (the job is
        given up on, naming it), instead of the job passing for done."""
        if (self.options.elastic or self.tracker.result() is not None
                or not self.tracker.joined()):
            return
        end = time.monotonic() + LEFT_EARLY_SEC
        while self.tracker.result() is None and time.monotonic() < end:
            time.sleep(POLL_SEC)
        self._check_left_early(float("inf"))
        end = time.monotonic() + LEFT_EARLY_SEC  # (the tracker's thread settles the job)
        while self._abort_seen_at is not None and self.tracker.result() is None and (
                time.monotonic() < end):
            time.sleep(POLL_SEC)

    def _aborted_by(self, task: TaskRun) -> bool:
        """The job was aborted because of ``task`` (its program raised on it)."""
        result = self.tracker.result()
        who = (f"task {task.task_id} " if task.rank is None
               else f"rank {task.rank} (task {task.task_id}) ")
        return result is not None and not result.success and result.reason.startswith(who)

    def _exited(self, task: TaskRun, code: int, now: float) -> None:
        """Task ``task``'s attempt exited with ``code``: done, restart it, or give up."""
        assert task.proc is not None
        # what the worker started in its group and left running goes with it (its group id
        # is its PID, which cannot have been reused: it was reaped just now)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(task.proc.pid, signal.SIGTERM)
        self.tracker.worker_exited(str(task.task_id))  # (no rejoin will come)
        _close_stdin(task.proc)
        task.proc = None
        task.exit_code = code
        task.rank = self.tracker.rank_of(str(task.task_id))
        if code != 0 and (self.options.elastic or self._abort_seen_at is None
                          or self._aborted_by(task)):
            for reader in task.readers:
                reader.join(0.5)  # (its last lines, to name what it said last)
            failure = describe_failure(task, code, self.options.max_attempts, time.time())
            self._failures[task.task_id] = failure  # (its latest: the one a job may end for)
            if self._root_cause is None:
                self._root_cause, self._root_task = failure, task.task_id
        missing = self._never_joined(task) if code != 0 else []
        # (a signal by its name; one the launcher sent says why)
        ended = how_ended(code) + (f" ({task.killed_for})" if task.killed_for else "")
        if code == 0:
            task.status = "ok"
            self._ended_ok[task.task_id] = now
        elif missing and self._abort_seen_at is None and self.tracker.result() is None:
            # it waited for its rank until its deadline because these never joined: they are
            # the cause, and restarting it would only wait again
            task.status = "failed"
            why = (f"task(s) {', '.join(map(str, missing))} never joined the job "
                   f"(rabit2.init) while task {task.task_id} waited for its rank until its "
                   "deadline (rabit_timeout_sec); they are still running: stuck before "
                   "init, or slow to start")
            self._root_cause = why
            self._give_up(why, task_id=missing[0])
            self._abort_seen_at = now
            for other in self.tasks:  # (before init, no abort reaches them)
                if other.task_id in missing and other.proc is not None:
                    other.killed_for = "it never joined the job (rabit2.init)"
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(other.proc.pid, signal.SIGTERM)
        elif self._abort_seen_at is not None or self.tracker.result() is not None:
            task.status = "failed"  # the job is over: a restart could only hang
        elif self.tracker.has_finished(str(task.task_id)):
            # it shut down with the tracker before exiting (e.g. after a typed error it
            # reported): the tracker refuses a replacement, so do not start one
            task.status = "failed"
            self._note(f"task {task.task_id} {ended} after shutting down; "
                       "not restarting it")
        elif (task.rank is not None and task.attempts < self.options.max_attempts
              and not self.tracker.takes_restarts()):
            # its neighbours' calls failed when it was lost: a restart could not join
            task.status = "failed"
            self._give_up(f"task {task.task_id} {ended}; the job runs without "
                          "recovery (rabit2_recover off), so it is not restarted",
                          task_id=task.task_id)
            self._abort_seen_at = now
        elif task.attempts < self.options.max_attempts and not (
                self.options.elastic and any(other.status == "ok" for other in self.tasks)):
            # (elastic: once a worker finished, the job is ending; a restarted one would
            # find nobody to take the state from)
            task.status = "restarting"
            task.restart_at = now + self.options.restart_delay
            self._note(f"task {task.task_id} {ended} (attempt {task.attempts}/"
                       f"{self.options.max_attempts}); restarting")
        else:
            task.status = "failed"
            self._give_up(f"task {task.task_id} {ended} after "
                          f"{attempts_text(task.attempts)}", task_id=task.task_id)
            if self.options.elastic:
                # the tracker lets the job go on without it while --min-workers remain (or
                # aborts it: the next step sees that)
                task.status = "left"
                return
            # the tracker aborts the job: the others raise JobAbortedError and exit on
            # their own; whoever is still running after the grace period is stopped
            self._abort_seen_at = now

    def _never_joined(self, task: TaskRun) -> list[int]:
        """The tasks still running that never joined the job, where ``task`` joined and
        its init gave up waiting for its rank (:data:`NO_ASSIGNMENT`); else none."""
        joined = self.tracker.joined()
        if str(task.task_id) not in joined or task.rank is not None:
            return []
        for reader in task.readers:
            reader.join(0.5)  # (its last lines)
        if NO_ASSIGNMENT not in task.last_error:
            return []
        return [other.task_id for other in self.tasks
                if str(other.task_id) not in joined and other.status == "running"]

    def _give_up(self, reason: str, task_id: int | None = None) -> None:
        self._note(reason)
        if task_id is None:
            self.tracker.abort(reason)
        else:
            self.tracker.mark_failed(str(task_id), reason)

    def _spawn(self, task: TaskRun) -> None:
        start = ssh_attempt if self.options.cluster == "ssh" else local_attempt
        attempt = start(self.options, self.tracker.worker_env(), task.task_id, task.attempts)
        # A session of its own: Ctrl-C in the terminal reaches only the launcher (which then
        # stops the workers in order), and killpg also reaches the worker's own children.
        try:
            with pinned(attempt.cpus):
                proc = subprocess.Popen(
                    attempt.argv,
                    env=attempt.env,
                    stdin=subprocess.DEVNULL if attempt.header is None else subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
        except OSError as exc:  # (a script without a #! line, a missing interpreter, ...)
            if isinstance(exc, FileNotFoundError) and os.path.exists(attempt.argv[0]):
                exc = FileNotFoundError(exc.errno, f"{attempt.argv[0]} exists, but the "
                                        "interpreter its #! line names does not")
            if not task.attempts:
                raise LaunchError(f"cannot start task {task.task_id}: {exc}") from None
            self._start_failed(task, exc)
            return
        if attempt.header is not None and proc.stdin is not None:
            # a few KiB into an empty pipe: never blocks.  The pipe then stays open: its end
            # (this process or its ssh gone) is what stops the remote worker
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(attempt.header)
                proc.stdin.flush()
        task.proc = proc
        task.started_at = time.monotonic()
        task.attempts += 1
        task.last_error = task.killed_for = ""
        task.status = "running"
        task.exit_code = None
        for pipe, stream in ((proc.stdout, self._out), (proc.stderr, self._err)):
            if pipe is None:
                continue
            reader = threading.Thread(target=self._relay, args=(task, pipe, stream),
                                      daemon=True, name=f"rabit2-submit-relay-{task.task_id}")
            reader.start()
            task.readers.append(reader)

    def _start_failed(self, task: TaskRun, exc: OSError) -> None:
        """A restart of ``task`` could not start its process: an attempt that failed."""
        task.attempts += 1
        task.exit_code = 127
        reason = f"task {task.task_id} could not be started again: {exc}"
        if self._root_cause is None:
            self._root_cause = reason
        if task.attempts < self.options.max_attempts:
            task.status = "restarting"
            task.restart_at = time.monotonic() + max(self.options.restart_delay, POLL_SEC)
            self._note(f"{reason} (attempt {task.attempts}/{self.options.max_attempts})")
            return
        task.status = "failed"
        self._give_up(f"{reason}, after {attempts_text(task.attempts)}", task_id=task.task_id)
        self._abort_seen_at = time.monotonic()

    def _relay(self, task: TaskRun, pipe: IO[bytes], stream: TextIO) -> None:
        with pipe:
            for text, end in output_segments(pipe):
                rank = self.tracker.rank_of(str(task.task_id))
                label = task.task_id if rank is None else rank
                self._writer.write(stream, f"[rank {label}] {text}", end or "\n")
                if stream is self._err and end == "\n" and text.strip():
                    task.last_error = text.strip()[:300]

    def _terminate_all(self, hurry: threading.Event) -> None:
        """SIGTERM every worker's group, SIGKILL what is left after ``--kill-grace`` (at once
        once ``hurry`` is set: the launcher was interrupted again), and reap them."""
        running = [task for task in self.tasks if task.proc is not None]
        for task in running:
            _signal_group(task, signal.SIGTERM)
        deadline = time.monotonic() + self.options.kill_grace
        while (not hurry.is_set() and time.monotonic() < deadline
               and any(task.proc is not None and task.proc.poll() is None for task in running)):
            time.sleep(POLL_SEC)
        for task in running:
            proc = task.proc
            if proc is None:
                continue
            if proc.poll() is None:
                _signal_group(task, signal.SIGKILL)
                proc.wait()
            _close_stdin(proc)
            task.exit_code = proc.returncode
            task.status = "ok" if proc.returncode == 0 else "killed"
            task.proc = None
        for task in self.tasks:
            if task.status in ("pending", "restarting"):
                task.status = "killed"


def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _signal_group(task: TaskRun, signum: signal.Signals) -> None:
    if task.proc is None:
        return
    try:
        os.killpg(task.proc.pid, signum)
    except ProcessLookupError:
        pass  # already gone
    except PermissionError:
        task.proc.send_signal(signum)  # the group changed hands (the worker called setsid)

