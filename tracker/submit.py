"""``rabit2-submit``: start a tracker and N workers, restart crashed workers, report.

``rabit2-submit --cluster local -n 4 [--max-attempts K] -- python train.py k=v ...``
``rabit2-submit --cluster ssh --host-file HOSTS -n 4 -- python train.py k=v ...``
``rabit2-submit --cluster slurm -n 4 -- python train.py`` (or ``--cluster mpi``)

* ``local`` starts the workers as child processes; ``ssh`` starts each one through
  ``ssh HOST`` (hosts from ``--host-file``, filled slot by slot), where
  :mod:`tracker.remote` runs it and stops it when the launcher's ssh goes away.
  Everything below holds for both.
* ``slurm`` and ``mpi`` hand all N to one ``srun`` or ``mpirun``, each worker under
  :mod:`tracker.slot`, which restarts it in place (:class:`GroupLauncher`): same
  environment, restarts and recovery; srun's ``--label`` becomes ``[rank r]`` (mpirun's
  output is passed on as it comes), and the summary comes from the tracker.

* A fresh job secret (``secrets.token_hex(32)``) is generated for every job, so a local job is
  always authenticated.
* Each worker gets ``DMLC_TRACKER_URI``, ``DMLC_TRACKER_PORT``, ``DMLC_TASK_ID=i``,
  ``DMLC_NUM_WORKER``, ``DMLC_NUM_ATTEMPT``, ``DMLC_ROLE=worker`` and ``RABIT2_SECRET``, then
  every ``--env K=V`` (which wins).  The command is passed through unchanged.
* Every output line of a worker is prefixed with ``[rank r]`` (``[rank i]`` with its task id
  until the tracker has assigned ranks).
* A worker that exits non-zero is restarted until it has run ``--max-attempts`` times in all.
  When a task runs out of attempts (or ``--timeout`` passes, or Ctrl-C/SIGTERM), the tracker
  aborts the job and every other worker's process group gets SIGTERM, then SIGKILL after a
  grace period: no worker process is left behind.
* A per-task summary is printed at the end; the exit status is 0 iff every worker exited 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import IO, TextIO

from tracker.remote import encode_header
from tracker.server import JobResult, TrackerThread

CLUSTERS = ("local", "ssh", "slurm", "mpi")
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
_POLL_SEC = 0.02
_SRUN_LABEL = re.compile(r"\s*(\d+): ")
_ABORT_GRACE_SEC = 10.0  # after the tracker aborted, workers get this long to exit themselves


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """One line of a ``--host-file``: ``name`` (``[user@]host``), ``:port``, ``slots=N``."""

    name: str
    port: int | None = None
    slots: int = 1

    @property
    def address(self) -> str:
        """The host part alone (what ``ssh`` connects to, without ``user@``)."""
        return self.name.rpartition("@")[2]


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchOptions:
    """Everything the launcher needs; built by :func:`parse_args` or directly by tests."""

    num_workers: int
    command: tuple[str, ...]
    max_attempts: int = 3
    restart_delay: float = 0.0
    tracker_host: str = "127.0.0.1"
    tracker_port: int = 0
    env: tuple[tuple[str, str], ...] = ()
    timeout: float | None = None
    kill_grace: float = 5.0
    bind: str = "auto"
    heartbeat_timeout: float = 30.0
    classic: str = "loopback"  # from where classic rabit workers (XGBoost 1.x/2.0) are served
    cluster: str = "local"
    hosts: tuple[Host, ...] = ()  # --cluster ssh: one entry per slot, in fill order
    ssh: tuple[str, ...] = ("ssh",)
    remote_dir: str = ""  # --cluster ssh: where the command runs ("": the login directory)
    remote_python: str = "python3"  # --cluster ssh/slurm/mpi: runs tracker.remote/.slot
    group: tuple[str, ...] = ()  # --cluster slurm/mpi: the srun/mpirun command and options
    dry_run: bool = False


def parse_host_file(text: str) -> tuple[Host, ...]:
    """The hosts of a host file (pure); raises ``ValueError`` naming the bad line.

    One host per line: ``host``, ``user@host``, ``host:port`` (the ssh port), optionally
    followed by ``slots=N`` (Open MPI's hostfile spelling: N workers on that host before the
    next host gets any).  ``#`` starts a comment; blank lines are skipped.
    """
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        name, port_text = words[0], None
        if ":" in name:
            name, port_text = name.rsplit(":", 1)
        slots = 1
        try:
            if not name or name.startswith("-") or any(c in name for c in "'\"\\$`;&|<>"):
                raise ValueError(f"bad host name {words[0]!r}")
            port = None if port_text is None else int(port_text)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"port {port} out of range")
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if key not in ("slots", "max_slots") or not sep:
                    raise ValueError(f"unknown field {word!r} (expected slots=N)")
                if key == "slots":
                    slots = int(value)
                    if slots < 1:
                        raise ValueError("slots must be >= 1")
        except ValueError as exc:
            raise ValueError(f"host file line {number} ({raw.strip()!r}): {exc}") from None
        hosts.append(Host(name, port, slots))
    if not hosts:
        raise ValueError("the host file names no host")
    return tuple(hosts)


def hosts_by_slot(hosts: Sequence[Host], num_workers: int) -> tuple[Host, ...]:
    """The host of each task, filling each host's slots in turn and starting over from the
    first host when every slot is taken (pure)."""
    slots = [host for host in hosts for _ in range(host.slots)]
    return tuple(slots[i % len(slots)] for i in range(num_workers))


def tracker_host_for(hosts: Sequence[Host]) -> str:
    """The local address the workers on ``hosts`` reach the tracker at: the one that routes
    to the first host (no packet is sent), or loopback when every host is this machine.
    Raises ``ValueError`` if a host name does not resolve."""
    addresses: list[str] = []
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host.address, host.port or 22, socket.AF_INET,
                                       socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"cannot resolve host {host.address!r} ({exc}); pass "
                             "--tracker-host with an address the workers can reach") from None
        addresses.append(str(infos[0][4][0]))
    if all(address.startswith("127.") for address in addresses):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        try:
            probe.connect((addresses[0], 9))
        except OSError as exc:
            raise ValueError(f"no route to host {hosts[0].address!r} ({exc})") from None
        return str(probe.getsockname()[0])


def remote_python_for(command: Sequence[str]) -> str:
    """The interpreter that runs :mod:`tracker.remote` on the hosts: the command's own when
    it is a Python (it has rabit2, so it has ``tracker``), else ``python3``."""
    first = os.path.basename(command[0]) if command else ""
    return command[0] if first.startswith("python") else "python3"


def ssh_argv(options: LaunchOptions, host: Host) -> list[str]:
    """The ``ssh`` command line that starts one worker attempt on ``host`` (pure).

    The job's environment is not on it: it goes to :mod:`tracker.remote` on ssh's stdin.
    ``BatchMode=yes`` (a password prompt would wait forever) and ``ConnectTimeout`` follow
    the ``--ssh`` command, so options given there win (ssh keeps an option's first value).
    """
    remote = " ".join(shlex.quote(word) for word in (
        options.remote_python, "-m", "tracker.remote", "--", *options.command))
    if options.remote_dir:
        remote = f"cd {shlex.quote(options.remote_dir)} && exec {remote}"
    else:
        remote = f"exec {remote}"
    argv = [*options.ssh, "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]
    if host.port is not None:
        argv += ["-p", str(host.port)]
    return [*argv, host.name, remote]


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


class _Interrupted(Exception):
    """SIGTERM to the launcher: unwind like Ctrl-C so the workers are stopped."""


def parse_args(argv: Sequence[str]) -> LaunchOptions:
    """Parse ``[options] -- command...``; exits with status 2 on bad usage (argparse)."""
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    else:
        command = []
    parser = argparse.ArgumentParser(
        prog="rabit2-submit",
        description="Launch a rabit2 job: a tracker plus N workers running COMMAND.",
        usage="%(prog)s --cluster {local,ssh,slurm,mpi} -n N [options] -- command [args...]",
    )
    parser.add_argument("--cluster", default="local", help=f"one of: {', '.join(CLUSTERS)}")
    parser.add_argument("-n", "--num-workers", type=int, required=True)
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="runs per task in all, the first included (default 3)")
    parser.add_argument("--restart-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--tracker-host", default=None,
                        help="tracker listen address (default: 127.0.0.1; with ssh, the "
                             "local address that routes to the first host; with slurm and "
                             "mpi, every interface, advertised by this host's name)")
    parser.add_argument("--tracker-port", type=int, default=0)
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="extra environment for every worker (repeatable)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="give up on the whole job after S seconds")
    parser.add_argument("--kill-grace", type=float, default=5.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping workers")
    parser.add_argument("--bind", choices=("auto", "core", "none"), default="auto",
                        help="auto (default): start each worker on an equal group of the "
                             "CPUs (one CPU each, round-robin, when there are more workers "
                             "than CPUs); core: worker i on CPU i mod ncpu; none: no pinning")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands that would start the workers, and exit")
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0, metavar="S",
                        help="a worker silent this long (e.g. a paused process) is lost "
                             "and killed; with recovery on it is restarted and its "
                             "neighbours wait, else their calls fail (default 30)")
    parser.add_argument("--classic", choices=("loopback", "any", "none"), default="loopback",
                        help="from where workers that speak the classic rabit protocol "
                             "(XGBoost 1.x/2.0; it carries no secret) are served "
                             "(default loopback)")
    ssh = parser.add_argument_group("--cluster ssh")
    ssh.add_argument("--host-file", metavar="F",
                     help="hosts, one per line: [user@]host[:port] [slots=N]")
    ssh.add_argument("--ssh", default="ssh", metavar="CMD",
                     help="ssh command and options, e.g. 'ssh -F ./ssh_config' (default ssh)")
    ssh.add_argument("--remote-dir", default=None, metavar="DIR",
                     help="directory the command runs in on the hosts (default: this one; "
                          "'' for the login directory)")
    ssh.add_argument("--remote-python", default=None, metavar="PY",
                     help="Python with rabit2 on the hosts (default: the command's own "
                          "interpreter if it is a python, else python3; also for slurm "
                          "and mpi)")
    group = parser.add_argument_group("--cluster slurm / mpi")
    group.add_argument("--srun", default="srun", metavar="CMD",
                       help="srun command and options, e.g. 'srun -N 2' (default srun)")
    group.add_argument("--mpirun", default="mpirun", metavar="CMD",
                       help="mpirun command and options, e.g. 'mpirun --hostfile H' "
                            "(default mpirun)")
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    command = list(args.rest) + command
    if args.cluster not in CLUSTERS:
        parser.error(f"--cluster {args.cluster!r} is not supported; available: "
                     f"{', '.join(CLUSTERS)}")
    if args.num_workers < 1:
        parser.error("-n must be >= 1")
    if args.max_attempts < 1:
        parser.error("--max-attempts must be >= 1")
    if args.restart_delay < 0 or args.kill_grace < 0:
        parser.error("--restart-delay and --kill-grace must be >= 0")
    if not args.heartbeat_timeout > 0:
        parser.error("--heartbeat-timeout must be > 0")
    if args.timeout is not None and args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if not command:
        parser.error("no command given (put it after --)")
    hosts: tuple[Host, ...] = ()
    tracker_host = args.tracker_host
    if args.cluster == "ssh":
        if not args.host_file:
            parser.error("--cluster ssh needs --host-file")
        try:
            with open(args.host_file, encoding="utf-8") as f:
                hosts = parse_host_file(f.read())
            if tracker_host is None:
                tracker_host = tracker_host_for(hosts)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        hosts = hosts_by_slot(hosts, args.num_workers)
    elif args.host_file is not None:
        parser.error("--host-file is for --cluster ssh")
    elif args.cluster in ("slurm", "mpi") and tracker_host is None:
        tracker_host = "0.0.0.0"  # the workers may run on any node
    group_command = tuple(shlex.split(args.srun if args.cluster == "slurm" else args.mpirun))
    if args.cluster in ("slurm", "mpi") and not group_command:
        parser.error(f"--{'srun' if args.cluster == 'slurm' else 'mpirun'} must name a command")
    ssh_command = tuple(shlex.split(args.ssh))
    if not ssh_command:
        parser.error("--ssh must name a command")
    env: list[tuple[str, str]] = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env expects K=V, got {item!r}")
        env.append((key, value))
    return LaunchOptions(
        num_workers=args.num_workers,
        command=tuple(command),
        max_attempts=args.max_attempts,
        restart_delay=args.restart_delay,
        tracker_host="127.0.0.1" if tracker_host is None else tracker_host,
        tracker_port=args.tracker_port,
        env=tuple(env),
        timeout=args.timeout,
        kill_grace=args.kill_grace,
        bind=args.bind,
        heartbeat_timeout=args.heartbeat_timeout,
        classic=args.classic,
        dry_run=args.dry_run,
        cluster=args.cluster,
        hosts=hosts,
        ssh=ssh_command,
        remote_dir=os.getcwd() if args.remote_dir is None else args.remote_dir,
        remote_python=(remote_python_for(command) if args.remote_python is None
                       else args.remote_python),
        group=group_command if args.cluster in ("slurm", "mpi") else (),
    )


def bind_cpus_for(task_id: int, num_workers: int, bind: str,
                  cpus: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The CPUs task ``task_id`` is pinned to under ``--bind`` (None: not pinned; pure).

    ``core``: one CPU, round-robin.  ``auto``: the launcher's CPUs split into ``num_workers``
    equal contiguous groups (the rest unused), so that a worker's own thread pools (BLAS,
    OpenMP) get its share of the machine; one CPU each, round-robin, when there are more
    workers than CPUs.
    """
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if bind == "none" or not cpus:
        return None
    share = len(cpus) // num_workers if bind == "auto" else 0
    if share <= 1:
        return (cpus[task_id % len(cpus)],)
    return tuple(cpus[task_id * share : (task_id + 1) * share])


@contextlib.contextmanager
def _pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """Start processes on ``cpus``: the calling thread (only it, on Linux) takes that CPU
    mask for the ``Popen``, which the child inherits from its first instruction, so that
    thread pools created at import time (OpenBLAS, OpenMP) are sized for it.  Pinning later,
    in ``rabit2.init``, left numpy's BLAS with a thread per CPU of the machine spinning on
    one CPU (a 4 KiB allreduce after a small matmul: 0.5-16 ms instead of ~0.05 ms)."""
    old = None
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            print(f"[rabit2-submit] cannot pin a worker to CPUs {list(cpus)}: {exc}",
                  file=sys.stderr)
    try:
        yield
    finally:
        if old is not None:
            os.sched_setaffinity(0, old)


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
    :func:`_pinned`).
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


class LocalLauncher:
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
            while not all(task.status in ("ok", "failed", "killed") for task in self.tasks):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._give_up(f"the job timed out after {options.timeout:g}s")
                    break
                if not self._step(now):
                    break
                time.sleep(_POLL_SEC)
        except (KeyboardInterrupt, _Interrupted):
            interrupted = True
            self._give_up("the launcher was interrupted")
        finally:
            self._terminate_all()
            for task in self.tasks:
                for reader in task.readers:
                    # bounded: a grandchild that escaped the process group may hold the pipe
                    reader.join(self.options.kill_grace + 1.0)
        result = self.tracker.result()
        for task in self.tasks:
            task.rank = self.tracker.rank_of(str(task.task_id))
        self._note("summary:")
        self._writer.write(self._err, format_summary(self.tasks, None if result is None
                                                  else result.reason))
        if interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK if all(task.exit_code == 0 for task in self.tasks) else EXIT_FAILED

    def _step(self, now: float) -> bool:
        """Reap, restart or give up; False when the job is over for good."""
        result = self.tracker.result()
        if result is not None and not result.success and self._abort_seen_at is None:
            self._abort_seen_at = now
            self._note(f"job aborted: {result.reason}")
        if self._abort_seen_at is not None and now - self._abort_seen_at > _ABORT_GRACE_SEC:
            self._note("workers did not exit after the abort; stopping them")
            return False
        if result is not None and result.success:
            # every rank told the tracker it is done: a process that still does not exit
            # (stopped, or stuck after finalize) must not keep the launcher waiting
            if self._done_seen_at is None:
                self._done_seen_at = now
            elif now - self._done_seen_at > _ABORT_GRACE_SEC:
                self._note("workers did not exit after the job finished; stopping them")
                return False
        silent = set(self.tracker.take_silent())
        for task in self.tasks:
            if str(task.task_id) in silent and task.proc is not None and task.status == "running":
                # a paused or wedged worker keeps its process alive but answers nothing: stop
                # it, so that the usual restart-or-give-up logic runs instead of waiting
                self._note(f"task {task.task_id} went silent; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(task.proc.pid, signal.SIGKILL)
            if task.status == "restarting" and now >= task.restart_at:
                self._spawn(task)
            if task.proc is None or task.status != "running":
                continue
            code = task.proc.poll()
            if code is None:
                continue
            self.tracker.worker_exited(str(task.task_id))  # (no rejoin will come)
            _close_stdin(task.proc)
            task.proc = None
            task.exit_code = code
            if code == 0:
                task.status = "ok"
            elif self._abort_seen_at is not None:
                task.status = "failed"  # the job is over: a restart could only hang
            elif self.tracker.has_finished(str(task.task_id)):
                # it shut down with the tracker before exiting (e.g. after a typed error it
                # reported): the tracker refuses a replacement, so do not start one
                task.status = "failed"
                self._note(f"task {task.task_id} exited with {code} after shutting down; "
                           "not restarting it")
            elif task.attempts < self.options.max_attempts:
                task.status = "restarting"
                task.restart_at = now + self.options.restart_delay
                self._note(f"task {task.task_id} exited with {code} (attempt {task.attempts}/"
                           f"{self.options.max_attempts}); restarting")
            else:
                task.status = "failed"
                self._give_up(f"task {task.task_id} exited with {code} after "
                              f"{task.attempts} attempts", task_id=task.task_id)
                # the tracker aborts the job: the others raise JobAbortedError and exit on
                # their own; whoever is still running after the grace period is stopped
                self._abort_seen_at = now
        return True

    def _give_up(self, reason: str, task_id: int | None = None) -> None:
        self._note(reason)
        if task_id is None:
            self.tracker.abort(reason)
        else:
            self.tracker.mark_failed(str(task_id), reason)

    def _spawn(self, task: TaskRun) -> None:
        options = self.options
        recover = options.max_attempts > 1
        header = None
        if options.cluster == "ssh":
            # the job's variables go to tracker.remote on ssh's stdin (never on a command
            # line); ssh itself runs with the launcher's environment, and is not pinned
            cpus = None
            argv = ssh_argv(options, options.hosts[task.task_id])
            env = build_worker_env(forwarded_env(os.environ), self.tracker.worker_env(),
                                   task.task_id, task.attempts, options.env, None, recover)
            header = encode_header(env, options.kill_grace)
            popen_env = None
        else:
            cpus = bind_cpus_for(task.task_id, options.num_workers, options.bind)
            argv = list(options.command)
            popen_env = build_worker_env(os.environ, self.tracker.worker_env(), task.task_id,
                                         task.attempts, options.env, cpus, recover=recover)
        # A session of its own: Ctrl-C in the terminal reaches only the launcher (which then
        # stops the workers in order), and killpg also reaches the worker's own children.
        with _pinned(cpus):
            proc = subprocess.Popen(
                argv,
                env=popen_env,
                stdin=subprocess.DEVNULL if header is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        if header is not None and proc.stdin is not None:
            # a few KiB into an empty pipe: never blocks.  The pipe then stays open: its end
            # (this process or its ssh gone) is what stops the remote worker
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(header)
                proc.stdin.flush()
        task.proc = proc
        task.attempts += 1
        task.status = "running"
        task.exit_code = None
        for pipe, stream in ((proc.stdout, self._out), (proc.stderr, self._err)):
            if pipe is None:
                continue
            reader = threading.Thread(target=self._relay, args=(task.task_id, pipe, stream),
                                      daemon=True, name=f"rabit2-submit-relay-{task.task_id}")
            reader.start()
            task.readers.append(reader)

    def _relay(self, task_id: int, pipe: IO[bytes], stream: TextIO) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                rank = self.tracker.rank_of(str(task_id))
                label = task_id if rank is None else rank
                text = raw.decode("utf-8", errors="replace").rstrip("\n")
                self._writer.write(stream, f"[rank {label}] {text}")

    def _terminate_all(self) -> None:
        running = [task for task in self.tasks if task.proc is not None]
        for task in running:
            _signal_group(task, signal.SIGTERM)
        deadline = time.monotonic() + self.options.kill_grace
        for task in running:
            proc = task.proc
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(task, signal.SIGKILL)
                proc.wait()
            _close_stdin(proc)
            task.exit_code = proc.returncode
            task.status = "ok" if proc.returncode == 0 else "killed"
            task.proc = None
        for task in self.tasks:
            if task.status in ("pending", "restarting"):
                task.status = "killed"


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
    environment, lets the other tasks run on when one fails (``--kill-on-bad-exit=0``: the
    slot restarts it) and labels each output line with the task's index."""
    slot = [options.remote_python, "-m", "tracker.slot",
            "--max-attempts", str(options.max_attempts),
            "--restart-delay", f"{options.restart_delay:g}",
            "--kill-grace", f"{options.kill_grace:g}", "--", *options.command]
    n = str(options.num_workers)
    if options.cluster == "slurm":
        return [*options.group, "-n", n, "--kill-on-bad-exit=0", "--label", *slot]
    exports = [arg for name in sorted(forward) for arg in ("-x", name)]
    return [*options.group, "-n", n, *exports, *slot]


def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What of the launcher's environment an ssh worker gets: the ``RABIT2_*`` settings
    only (not ``PATH``, ``HOME``, ... of this machine; ``--env`` adds more) (pure)."""
    return {key: value for key, value in environ.items() if key.startswith("RABIT2_")}


def _signal_group(task: TaskRun, signum: signal.Signals) -> None:
    if task.proc is None:
        return
    try:
        os.killpg(task.proc.pid, signum)
    except ProcessLookupError:
        pass  # already gone
    except PermissionError:
        task.proc.send_signal(signum)  # the group changed hands (the worker called setsid)


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
        except OSError as exc:
            self._note(f"cannot start {argv[0]!r}: {exc}")
            self.tracker.abort(f"{argv[0]} could not be started")
            return EXIT_FAILED
        readers = [threading.Thread(target=self._relay, args=(pipe, stream), daemon=True)
                   for pipe, stream in ((proc.stdout, self._out), (proc.stderr, self._err))]
        for reader in readers:
            reader.start()
        interrupted = False
        deadline = None if options.timeout is None else time.monotonic() + options.timeout
        over_since: float | None = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._note(f"the job timed out after {options.timeout:g}s")
                    self.tracker.abort(f"the job timed out after {options.timeout:g}s")
                    break
                if self.tracker.result() is not None:
                    # the job is over (every rank done, or aborted): the workers get the
                    # same grace as rabit2-submit's own to exit before they are stopped
                    over_since = now if over_since is None else over_since
                    if now - over_since > _ABORT_GRACE_SEC:
                        self._note(f"{argv[0]} did not exit after the job ended; stopping it")
                        break
                time.sleep(_POLL_SEC)
        except (KeyboardInterrupt, _Interrupted):
            interrupted = True
            self._note("the launcher was interrupted")
            self.tracker.abort("the launcher was interrupted")
        finally:
            code = self._stop(proc)
            for reader in readers:
                reader.join(options.kill_grace + 1.0)
        result = self.tracker.result()
        self._note("summary:")
        self._writer.write(self._err, self._summary(result))
        if interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK if code == 0 and result is not None and result.success else EXIT_FAILED

    def _stop(self, proc: subprocess.Popen[bytes]) -> int:
        """The group's exit status; SIGTERM to it (srun and mpirun pass it on to the slots,
        which stop their workers), SIGKILL after ``--kill-grace``."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.options.kill_grace + 5.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def _summary(self, result: JobResult | None) -> str:
        status = self.tracker.status() or {"tasks": []}
        tasks = []
        for entry in status["tasks"]:
            task_id = str(entry["task_id"])
            tasks.append(TaskRun(
                task_id=int(task_id) if task_id.isdigit() else -1,
                attempts=int(entry["incarnation"]) + 1,
                rank=entry["rank"],
                status="done" if entry["finished"] else "lost",
            ))
        missing = self.options.num_workers - len(tasks)
        reason = None if result is None else result.reason
        if missing > 0:
            reason = f"{reason}; {missing} task(s) never reached the tracker"
        return format_summary(tasks, reason)

    def _relay(self, pipe: IO[bytes] | None, stream: TextIO) -> None:
        """Pass the group's lines on; srun's ``--label`` ("3: ...", the task index, which is
        the task id) becomes ``[rank r]`` as with the other back-ends."""
        if pipe is None:
            return
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                label = _SRUN_LABEL.match(line) if self.options.cluster == "slurm" else None
                if label is not None:
                    rank = self.tracker.rank_of(label.group(1))
                    line = f"[rank {label.group(1) if rank is None else rank}] {line[label.end():]}"
                self._writer.write(stream, line)


def dry_run_lines(options: LaunchOptions) -> list[str]:
    """What ``--dry-run`` prints: one command line per worker (``local``, ``ssh``) or the
    one srun/mpirun line, as a shell would take it, with the job's variables named but not
    their values (the tracker's address and secret exist only once it runs) (pure)."""
    job = ["DMLC_TRACKER_URI", "DMLC_TRACKER_PORT", "DMLC_NUM_WORKER", "RABIT2_SECRET"]
    lines = [f"# tracker on {options.tracker_host}:{options.tracker_port or '<any free port>'}; "
             f"every worker gets {', '.join(job)}, DMLC_ROLE=worker"
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
            cpus = bind_cpus_for(task, options.num_workers, options.bind)
            where = "" if cpus is None else f" (CPUs {','.join(map(str, cpus))})"
            lines.append(f"DMLC_TASK_ID={task} {shlex.join(options.command)}{where}")
    return lines


def run_job(options: LaunchOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Start a tracker and the workers, run the job, stop everything; return the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    if options.dry_run:
        out.write("\n".join(dry_run_lines(options)) + "\n")
        return EXIT_OK
    writer = LineWriter()
    tracker = TrackerThread(
        options.num_workers,
        host=options.tracker_host,
        port=options.tracker_port,
        secret=bytes.fromhex(secrets.token_hex(32)),
        heartbeat_timeout=options.heartbeat_timeout,
        classic=options.classic,
        # tracker_print relays ("[rank] msg") share the workers' line lock
        print_fn=lambda line: writer.write(out, line),
    )
    kind = GroupLauncher if options.cluster in ("slurm", "mpi") else LocalLauncher
    launcher = kind(options, tracker, out, err, writer)
    tracker.start()
    try:
        return launcher.run()
    finally:
        tracker.stop()


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point."""
    options = parse_args(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return run_job(options)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
