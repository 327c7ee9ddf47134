"""The launcher's options: :class:`LaunchOptions`, the command line and host files."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import resource
import shlex
import socket
from collections.abc import Sequence
from pathlib import Path

import rabit2

CLUSTERS = ("local", "ssh", "slurm", "mpi")


LAUNCHER_KEYS = ("DMLC_TRACKER_URI", "DMLC_TRACKER_PORT", "DMLC_NUM_WORKER", "DMLC_TASK_ID",
                 "DMLC_NUM_ATTEMPT", "DMLC_ROLE", "RABIT2_SECRET")
"""The variables the launcher gives each worker: ``--env`` cannot change them (a task id or a
secret set for every worker would break the job in ways no restart can fix)."""

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
    log_level: str | None = None  # the tracker's log, and RABIT2_LOG_LEVEL for the workers
    log_file: str | None = None  # every line of the launcher's output also goes there
    timestamps: bool = False  # every line of the launcher's output starts with the time
    metrics_port: int | None = None  # serve the job's metrics there (None: no endpoint)
    metrics_host: str = "127.0.0.1"
    status_file: str | None = None  # the job file's path (None: the default; "": none)
    elastic: bool = False  # live sets (docs/elastic.md): the job goes on without the lost
    min_workers: int = 1  # elastic: the fewest workers the job goes on with
    # this process adopted its workers' orphans (the rabit2-submit command:
    # tracker/launch/orphans.py): stop them when the job ends
    reap_orphans: bool = False


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
        slots = 1
        try:
            if name.count(":") > 1 or name.startswith("["):
                raise ValueError(f"{words[0]!r} looks like an IPv6 address, which host files do "
                                 "not take (the tracker listens on IPv4): name the host, or "
                                 "give its IPv4 address")
            if ":" in name:
                name, port_text = name.rsplit(":", 1)
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
    to the first host that is not this machine's loopback (no packet is sent; a host file
    that starts with ``localhost`` and goes on with other hosts needs an address they can
    reach), or loopback when every host is this machine.  Raises ``ValueError`` if a host
    name does not resolve."""
    addresses: list[str] = []
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host.address, host.port or 22, socket.AF_INET,
                                       socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"cannot resolve host {host.address!r} ({exc}); pass "
                             "--tracker-host with an address the workers can reach") from None
        addresses.append(str(infos[0][4][0]))
    remote = [i for i, address in enumerate(addresses) if not address.startswith("127.")]
    if not remote:
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        try:
            probe.connect((addresses[remote[0]], 9))
        except OSError as exc:
            raise ValueError(f"no route to host {hosts[remote[0]].address!r} ({exc})") from None
        return str(probe.getsockname()[0])


def remote_python_for(command: Sequence[str]) -> str:
    """The interpreter that runs :mod:`tracker.remote` on the hosts: the command's own when
    it is a Python (it has rabit2, so it has ``tracker``), else ``python3``."""
    first = os.path.basename(command[0]) if command else ""
    return command[0] if first.startswith("python") else "python3"


MAX_SECONDS = 1_000_000.0
"""The longest time an option may name (about 11.5 days), as for the workers' settings."""
FDS_PER_LOCAL_WORKER = 4
"""File descriptors the launcher holds per local worker: its output pipes, its stdin and the
tracker's connection to it."""


def _words(parser: argparse.ArgumentParser, option: str, text: str) -> tuple[str, ...]:
    """A command line given as one option's text, split as a shell would; a usage error
    (exit status 2) where its quotes do not close."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        parser.error(f"{option} {text!r}: {exc}")


def check_metrics(parser: argparse.ArgumentParser, host: str | None,
                  port: int | None) -> str:
    """The metrics endpoint's address (``--metrics-host``, loopback by default), checked
    with ``--metrics-port``: usage errors (exit status 2) for a port out of range, a host
    without a port, or a port where the metrics extra is not installed."""
    if host is not None and port is None:
        parser.error("--metrics-host needs --metrics-port (the endpoint is served only then)")
    if port is not None and not 0 <= port < 65536:
        parser.error("--metrics-port must be a TCP port (0: any free one)")
    if port is not None and importlib.util.find_spec("prometheus_client") is None:
        # (said before anything starts, not after the tracker logged that it listens)
        parser.error("--metrics-port needs prometheus-client: pip install 'rabit2[metrics]'")
    return host or "127.0.0.1"


def check_seconds(parser: argparse.ArgumentParser, name: str, value: float | None,
                  least: float | None) -> None:
    """A time option: finite, at most ``MAX_SECONDS``, and ``>= least`` (None: ``> 0``);
    exits with status 2 (``parser.error``) otherwise.  None (not given) passes."""
    if value is None:
        return
    if not math.isfinite(value) or value > MAX_SECONDS:
        parser.error(f"{name} must be a finite number of seconds, at most "
                     f"{MAX_SECONDS:.0f}, got {value}")
    if (least is None and not value > 0) or (least is not None and value < least):
        parser.error(f"{name} must be {'> 0' if least is None else f'>= {least:g}'}")


def check_process_room(parser: argparse.ArgumentParser, workers: int) -> None:
    """``--cluster local`` starts every worker here: refuse a number this process cannot
    hold the pipes and connections of (``ulimit -n``), or that exceeds the user's process
    limit (``ulimit -u``), before any is started."""
    fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FDS_PER_LOCAL_WORKER * workers + 64
    if fds != resource.RLIM_INFINITY and need > fds:
        parser.error(f"-n {workers} needs about {need} open files in the launcher; its limit "
                     f"is {fds} (ulimit -n)")
    procs, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if procs != resource.RLIM_INFINITY and workers > procs:
        parser.error(f"-n {workers} exceeds this user's process limit, {procs} (ulimit -u)")


def parse_args(argv: Sequence[str]) -> LaunchOptions:  # noqa: C901, PLR0912, PLR0915
    """Parse ``[options] -- command...``; exits with status 2 on bad usage (argparse)."""
    argv = list(argv)
    parser = argparse.ArgumentParser(
        prog="rabit2-submit",
        description="Launch a rabit2 job: a tracker plus N workers running COMMAND.",
        usage="%(prog)s [--cluster {local,ssh,slurm,mpi}] -n N [options] -- command [args...]",
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s (rabit2 {rabit2.__version__})")
    parser.add_argument("--cluster", default="local", help=f"one of: {', '.join(CLUSTERS)}")
    parser.add_argument("-n", "--num-workers", type=int, required=True)
    # (the second spellings are dmlc-submit's and XGBoost's tracker's)
    parser.add_argument("--max-attempts", "--local-num-attempt", type=int, default=3,
                        dest="max_attempts",
                        help="runs per task in all, the first included (default 3)")
    parser.add_argument("--restart-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--tracker-host", "--host-ip", default=None, dest="tracker_host",
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
    parser.add_argument("--log-level", type=str.upper, default=None,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="the tracker's log level (its lines read [tracker] LEVEL ...; "
                             "WARNING when not given); also RABIT2_LOG_LEVEL for the workers, "
                             "unless set (not given: their logging is left alone)")
    parser.add_argument("--log-file", default=None, metavar="F",
                        help="append every line of the launcher's output (workers, tracker, "
                             "summary) to F, each with its date and time")
    parser.add_argument("--timestamps", action="store_true",
                        help="start every line of the launcher's output with the time")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="serve the job's metrics in the Prometheus text format at "
                             "http://HOST:P/metrics while it runs (0: any free port; "
                             "needs the metrics extra)")
    parser.add_argument("--metrics-host", default=None, metavar="HOST",
                        help="address of the metrics endpoint (default 127.0.0.1; with "
                             "--metrics-port)")
    parser.add_argument("--status-file", default=None, metavar="F",
                        help="where to write the job file that rabit2-tracker --query reads "
                             "(default: job-HOST-PID.json in $RABIT2_RUN_DIR, $XDG_RUNTIME_DIR/"
                             "rabit2 or /tmp/rabit2-UID; '' for none)")
    parser.add_argument("--elastic", action="store_true",
                        help="elastic mode: the workers' steps run in live sets, and the job "
                             "goes on without a worker that runs out of attempts "
                             "(docs/elastic.md)")
    parser.add_argument("--min-workers", type=int, default=1, metavar="K",
                        help="--elastic: the job fails when fewer than K workers remain "
                             "(default 1)")
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
    # (without "--", the command begins at the first argument that is not an option's, and
    # every option after it is the command's, as torchrun and mpirun read theirs)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # (argparse keeps the "--" that ends the options; one the command has is the command's)
    command = args.rest[1:] if args.rest[:1] == ["--"] else list(args.rest)
    if args.cluster not in CLUSTERS:
        parser.error(f"--cluster {args.cluster!r} is not supported; available: "
                     f"{', '.join(CLUSTERS)}")
    if args.num_workers < 1:
        parser.error("-n must be >= 1")
    if args.max_attempts < 1:
        parser.error("--max-attempts must be >= 1")
    for name, value, least in (("--restart-delay", args.restart_delay, 0.0),
                               ("--kill-grace", args.kill_grace, 0.0),
                               ("--heartbeat-timeout", args.heartbeat_timeout, None),
                               ("--timeout", args.timeout, None)):
        check_seconds(parser, name, value, least)
    if not 0 <= args.tracker_port < 65536:
        parser.error("--tracker-port must be a TCP port (0: any free one)")
    if args.cluster == "local":
        check_process_room(parser, args.num_workers)
    if not 1 <= args.min_workers <= args.num_workers:
        parser.error("--min-workers must be between 1 and -n")
    if args.min_workers != 1 and not args.elastic:
        parser.error("--min-workers is for --elastic")
    metrics_host = check_metrics(parser, args.metrics_host, args.metrics_port)
    if not command:
        parser.error("no command given (put it after --)")
    if args.status_file:
        status_path = Path(args.status_file)
        if status_path.is_dir():
            parser.error(f"--status-file {args.status_file} is a directory: name a file in it")
        if not status_path.parent.is_dir():
            parser.error(f"--status-file {args.status_file}: no folder {status_path.parent}")
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
        except OSError as exc:
            parser.error(f"--host-file {args.host_file}: {exc.strerror or exc}")
        except ValueError as exc:
            parser.error(str(exc))
        hosts = hosts_by_slot(hosts, args.num_workers)
    elif args.host_file is not None:
        parser.error("--host-file is for --cluster ssh")
    elif args.cluster in ("slurm", "mpi") and tracker_host is None:
        tracker_host = "0.0.0.0"  # the workers may run on any node
    if args.bind == "core" and args.cluster != "local":
        parser.error(f"--bind core is for --cluster local ({args.cluster} places the "
                     "workers itself)")
    group_option = "--srun" if args.cluster == "slurm" else "--mpirun"
    group_command = _words(parser, group_option,
                           args.srun if args.cluster == "slurm" else args.mpirun)
    if args.cluster in ("slurm", "mpi") and not group_command:
        parser.error(f"{group_option} must name a command")
    ssh_command = _words(parser, "--ssh", args.ssh)
    if not ssh_command:
        parser.error("--ssh must name a command")
    env: list[tuple[str, str]] = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env expects K=V, got {item!r}")
        if key in LAUNCHER_KEYS:
            parser.error(f"--env {key}: rabit2-submit sets {key} itself, for each worker "
                         f"(its own: {', '.join(LAUNCHER_KEYS)})")
        env.append((key, value))
    if args.elastic and not any(key == "RABIT2_ELASTIC" for key, _ in env):
        env.append(("RABIT2_ELASTIC", "1"))
    if args.log_level is not None and "RABIT2_LOG_LEVEL" not in os.environ and not any(
            key == "RABIT2_LOG_LEVEL" for key, _ in env):
        env.append(("RABIT2_LOG_LEVEL", args.log_level))  # the workers log at it too
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
        log_level=args.log_level,
        log_file=args.log_file,
        timestamps=args.timestamps,
        metrics_port=args.metrics_port,
        metrics_host=metrics_host,
        status_file=args.status_file,
        elastic=args.elastic,
        min_workers=args.min_workers,
        cluster=args.cluster,
        hosts=hosts,
        ssh=ssh_command,
        remote_dir=os.getcwd() if args.remote_dir is None else args.remote_dir,
        remote_python=(remote_python_for(command) if args.remote_python is None
                       else args.remote_python),
        group=group_command if args.cluster in ("slurm", "mpi") else (),
    )
