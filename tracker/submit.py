"""``rabit2-submit``: start a tracker and N workers, restart crashed workers, report.

``rabit2-submit --cluster local -n 4 [--max-attempts K] -- python train.py k=v ...``
``rabit2-submit --cluster ssh --host-file HOSTS -n 4 -- python train.py k=v ...``
``rabit2-submit --cluster slurm -n 4 -- python train.py`` (or ``--cluster mpi``)

* ``local`` starts the workers as child processes; ``ssh`` starts each one through
  ``ssh HOST`` (hosts from ``--host-file``, filled slot by slot), where
  :mod:`tracker.remote` runs it and stops it when the launcher's ssh goes away.
  Everything below holds for both.
* ``slurm`` and ``mpi`` hand all N to one ``srun`` or ``mpirun``, each worker under
  :mod:`tracker.slot`, which restarts it in place (:mod:`tracker.launch.group`): same
  environment, restarts and recovery; srun's ``--label`` becomes ``[rank r]`` (mpirun's
  output is passed on as it comes), and the summary comes from the tracker.

* A fresh job secret (``secrets.token_hex(32)``) is generated for every job, so a local job is
  always authenticated.
* Each worker gets ``DMLC_TRACKER_URI``, ``DMLC_TRACKER_PORT``, ``DMLC_TASK_ID=i``,
  ``DMLC_NUM_WORKER``, ``DMLC_NUM_ATTEMPT``, ``DMLC_ROLE=worker`` and ``RABIT2_SECRET``, then
  every ``--env K=V`` (which wins).  The command is passed through unchanged.
* Every output line of a worker is prefixed with ``[rank r]`` (``[rank i]`` with its task id
  until the tracker has assigned ranks), and so are its ``tracker_print`` lines; a progress
  update ending in ``\r`` is passed on at once.  The tracker's log lines read ``[tracker]
  LEVEL message`` (``--log-level``, which the workers get as ``RABIT2_LOG_LEVEL`` too);
  ``--timestamps`` starts every line with the time, and ``--log-file`` appends every line to
  a file with the date and time.
* A worker that exits non-zero is restarted until it has run ``--max-attempts`` times in all.
  When a task runs out of attempts (or ``--timeout`` passes, or Ctrl-C/SIGTERM), the tracker
  aborts the job and every other worker's process group gets SIGTERM, then SIGKILL after a
  grace period: no worker process is left behind.
* A per-task summary is printed at the end; the exit status is 0 iff every worker exited 0.

This module parses the command line and picks the back-end; the back-ends are in
:mod:`tracker.launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from tracker import jobfile
from tracker.launch import orphans
from tracker.launch.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Interrupted,
    LaunchError,
    LineWriter,
    LogLines,
)
from tracker.launch.group import GroupLauncher, group_argv, group_forward
from tracker.launch.local import local_attempt
from tracker.launch.options import LaunchOptions, parse_args
from tracker.launch.ssh import ssh_argv
from tracker.launch.tasks import TaskLauncher
from tracker.metrics import MetricsServer
from tracker.server import TrackerThread

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "LaunchOptions", "main", "parse_args",
           "run_job"]


def dry_run_lines(options: LaunchOptions) -> list[str]:
    """What ``--dry-run`` prints: one command line per worker (``local``, ``ssh``) or the
    one srun/mpirun line, as a shell would take it, with the job's variables named but not
    their values (the tracker's address and secret exist only once it runs) (pure)."""
    job = ["DMLC_TRACKER_URI", "DMLC_TRACKER_PORT", "DMLC_NUM_WORKER", "RABIT2_SECRET"]
    lines = [f"# tracker on {options.tracker_host}:{options.tracker_port or '<any free port>'}; "
             f"every worker gets {', '.join(job)}, DMLC_ROLE=worker, DMLC_NUM_ATTEMPT (0, "
             "then 1, 2, ... when restarted)"
             + (", PYTHONUNBUFFERED=1, RABIT2_LAUNCHER_PID" if options.cluster == "local"
                else "")
             + "".join(f", {key}={value}" for key, value in options.env)]
    if options.cluster in ("slurm", "mpi"):
        lines.append(shlex.join(group_argv(options,
                                           group_forward(job, options.env, os.environ))))
        return lines
    for task in range(options.num_workers):
        if options.cluster == "ssh":
            command = shlex.join(ssh_argv(options, options.hosts[task]))
            lines.append(f"# task {task}: job variables on stdin to tracker.remote\n{command}")
        else:
            # what the launcher sets besides the job's variables and --env (recovery, the
            # CPUs, the settings of workers that share one)
            attempt = local_attempt(options, dict.fromkeys(job, ""), task, 0)
            assert attempt.env is not None
            given = {*job, *dict(options.env), "DMLC_ROLE", "DMLC_NUM_ATTEMPT",
                     "DMLC_TASK_ID", "RABIT2_LAUNCHER_PID"}
            own = " ".join(f"{key}={shlex.quote(value)}"
                           for key, value in sorted(attempt.env.items())
                           if key not in given and os.environ.get(key) != value)
            where = ("" if attempt.cpus is None
                     else f" (CPUs {','.join(map(str, attempt.cpus))})")
            words = [f"DMLC_TASK_ID={task}", own, shlex.join(options.command)]
            lines.append(" ".join(word for word in words if word) + where)
    return lines


def check_local_command(command: Sequence[str]) -> None:
    """A command that cannot run on this machine, whatever the attempt: a missing
    executable, or a Python given a script that does not exist.  Raises
    :class:`LaunchError` (exit status 2) before anything starts; restarts cannot fix it."""
    if shutil.which(command[0]) is None:
        raise LaunchError(f"{command[0]}: command not found (or not executable)")
    if os.path.basename(command[0]).startswith("python"):
        script = python_script(command[1:])
        if script is not None and not os.path.exists(script):
            raise LaunchError(f"{script}: no such file (the script {command[0]} would run)")


def python_script(args: Sequence[str]) -> str | None:
    """The script (a file, a directory or a zip) that ``python ARGS`` runs; None for
    ``-c``, ``-m``, standard input, or none (pure).  Python's options come first: flags
    that may be run together (``-uB``), and ``-W``/``-X``, whose value is the rest of the
    word or the next word."""
    at = 0
    while at < len(args):
        word = args[at]
        if word == "--":
            return args[at + 1] if at + 1 < len(args) else None
        if word == "-" or word.startswith("--"):  # (stdin; --help, --version and such)
            return None
        if not word.startswith("-"):
            return word
        for i, letter in enumerate(word[1:], 1):
            if letter in "cm":
                return None
            if letter in "WX":
                at += i == len(word) - 1  # (the value is the next word)
                break
        at += 1
    return None


def run_job(options: LaunchOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Start a tracker and the workers, run the job, stop everything; return the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    if options.dry_run:
        out.write("\n".join(dry_run_lines(options)) + "\n")
        return EXIT_OK
    if options.cluster == "local":
        check_local_command(options.command)
    with contextlib.ExitStack() as stack:
        try:
            log_file = (None if options.log_file is None
                        else stack.enter_context(open(options.log_file, "a", encoding="utf-8")))
        except OSError as exc:
            raise LaunchError(f"--log-file {options.log_file}: {exc.strerror or exc}") from None
        writer = LineWriter(options.timestamps, log_file)
        stack.enter_context(_tracker_log(writer, err, options.log_level or "WARNING"))
        return _run(options, writer, out, err)


@contextlib.contextmanager
def _tracker_log(writer: LineWriter, err: TextIO, level: str) -> Iterator[None]:
    """The tracker's log records as ``[tracker] LEVEL message`` lines of the launcher."""
    logger = logging.getLogger("rabit2.tracker")
    handler = LogLines(writer, err)
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _run(options: LaunchOptions, writer: LineWriter, out: TextIO, err: TextIO) -> int:
    tracker = TrackerThread(
        options.num_workers,
        host=options.tracker_host,
        port=options.tracker_port,
        secret=bytes.fromhex(secrets.token_hex(32)),
        heartbeat_timeout=options.heartbeat_timeout,
        classic=options.classic,
        elastic=options.elastic,
        min_workers=options.min_workers,
        # tracker_print relays ("[rank] msg") share the workers' line lock
        print_fn=lambda line: writer.write(out, line),
    )
    kind = GroupLauncher if options.cluster in ("slurm", "mpi") else TaskLauncher
    launcher = kind(options, tracker, out, err, writer)
    try:
        tracker.start()
    except OSError as exc:  # (a port taken, an address that does not resolve)
        raise LaunchError(f"the tracker cannot listen on {options.tracker_host}:"
                          f"{options.tracker_port}: {exc.strerror or exc}") from None
    stack = contextlib.ExitStack()  # closed last to first: job file, metrics, tracker
    stack.callback(tracker.stop)
    try:
        metrics = _serve_metrics(options, tracker, stack)
        env = tracker.worker_env()
        note = f"[rabit2-submit] tracker at {env['DMLC_TRACKER_URI']}:{env['DMLC_TRACKER_PORT']}"
        job_file = _write_job_file(options, env, metrics, stack, writer, err)
        if job_file is not None:
            note += f"; status: rabit2-tracker --query {shlex.quote(str(job_file))}"
        if metrics is not None:
            note += f"; metrics: {metrics}"
        writer.write(err, note)
        return launcher.run()
    finally:
        stack.close()


def _serve_metrics(options: LaunchOptions, tracker: TrackerThread,
                   stack: contextlib.ExitStack) -> str | None:
    """Start the metrics endpoint if asked; its URL.  Raises :class:`LaunchError`."""
    if options.metrics_port is None:
        return None
    try:
        server = MetricsServer(tracker.status, options.metrics_host, options.metrics_port)
        server.start()
    except ImportError as exc:
        raise LaunchError(str(exc)) from None
    except OSError as exc:
        raise LaunchError(f"the metrics endpoint cannot listen on {options.metrics_host}:"
                          f"{options.metrics_port}: {exc.strerror or exc}") from None
    stack.callback(server.close)
    return server.url


def _write_job_file(options: LaunchOptions, env: dict[str, str], metrics: str | None,
                    stack: contextlib.ExitStack, writer: LineWriter,
                    err: TextIO) -> Path | None:
    """The job file for ``rabit2-tracker --query`` (:mod:`tracker.jobfile`), removed when
    the job ends; None when turned off or when it cannot be written (a warning says why:
    the job runs without it)."""
    if options.status_file == "":
        return None
    info = {"host": env["DMLC_TRACKER_URI"], "port": int(env["DMLC_TRACKER_PORT"]),
            "secret": env["RABIT2_SECRET"], "pid": os.getpid(),
            "launcher_host": socket.gethostname(),
            "world_size": options.num_workers, "cluster": options.cluster,
            "command": list(options.command),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "metrics": metrics}
    try:
        path = jobfile.write(info, None if options.status_file is None
                             else Path(options.status_file))
    except OSError as exc:
        writer.write(err, f"[rabit2-submit] warning: no job file, so rabit2-tracker --query "
                          f"cannot find this job: {exc}")
        return None
    stack.callback(jobfile.remove, path)
    return path


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point."""
    options = parse_args(sys.argv[1:] if argv is None else argv)
    # (this process runs only the launcher: what a worker leaves behind is stopped at the end)
    options = dataclasses.replace(options, reap_orphans=orphans.adopt())
    # (SIGHUP: the terminal or the ssh session that ran it went away; not under nohup, which
    # set it to be ignored)
    previous = {signum: signal.signal(signum, _raise_interrupted)
                for signum in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        return run_job(options)
    except LaunchError as exc:
        print(f"rabit2-submit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
