"""Worker configuration: environment, rabit-style ``k=v`` arguments and keyword arguments.

Precedence, lowest first (as in classic rabit): built-in defaults, environment variables,
``k=v`` strings given to :func:`rabit2.init`, keyword arguments.  Keys are case-insensitive;
``dmlc_*`` (xgboost.collective 2.x+) and ``rabit_*`` spellings are both accepted.

Unknown ``rabit_*``/``dmlc_*``/``rabit2_*`` keys raise ``ValueError`` so that a typo does not
silently change nothing; strings that are not ``k=v`` are ignored, as rabit ignores them
(this lets a program pass ``sys.argv`` straight through).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_TREE_MINSIZE = 1 << 20
# a peer link whose sent bytes stay unacknowledged this long ends (TCP_USER_TIMEOUT)
DEFAULT_LINK_TIMEOUT_SEC = 20.0


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The levels ``rabit2_log_level`` accepts (any case)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MockSpec:
    """``mock=rank,version,seqno,trial``: kill this process at that call on that attempt.

    ``after_bytes`` (the optional fifth field) delays the kill until that many payload bytes
    of the call have been received, to die in the middle of a transfer.  With a sixth field
    ``reset_peer`` the process does not die: it resets its link to that rank instead (both
    processes live; with recovery on the link is dialed again and the call resumes).  With a
    seventh field ``damage`` = 1 it neither dies nor resets: it flips the bits of one byte
    that arrives from ``reset_peer`` there, as a faulty NIC, switch or memory can without
    TCP noticing (``docs/protocol.md``, "Checksums"); where ``checksum`` is not set it is
    then on for every link, within one host too (give every rank the same ``mock=``: the
    sender adds the checksums).
    """

    rank: int
    version: int
    seqno: int
    trial: int
    after_bytes: int = -1
    reset_peer: int = -1
    damage: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    tracker_uri: str | None = None
    tracker_port: int = 9091
    task_id: str = "NULL"
    num_attempt: int = 0
    world_size: int = -1
    secret: bytes = b""
    timeout_sec: float = 1800.0
    connect_timeout_sec: float = 30.0
    connect_retry: int = 5
    heartbeat_sec: float = 1.0
    # a peer link's sent bytes unacknowledged this long end it (TCP_USER_TIMEOUT); a link
    # still down three quarters of this later asks the tracker whether the peer lives
    # (docs/recovery.md, "Partial partitions")
    link_timeout_sec: float = DEFAULT_LINK_TIMEOUT_SEC
    # None: ring above AUTO_RING_MIN_BYTES (rabit2.core.planning); set: above that many elements,
    # as in rabit
    reduce_ring_mincount: int | None = None
    # None: ring above AUTO_RING_MIN_BYTES at world size 3 and more; set: above that many
    # bytes (rabit2-submit --cluster local sets 2 MiB for workers that share a CPU)
    ring_min_bytes: int | None = None
    tree_reduce_minsize: int = DEFAULT_TREE_MINSIZE
    loop: str = "uvloop"
    # the caller polls (yielding the CPU) this long before it sleeps on a call's completion:
    # a sleeping vCPU takes ~60 us to wake on this VM class (docs/design.md, "Waiting")
    spin_us: int = 200
    # the caller drives its own call (no hand-off to the loop thread) for up to this long,
    # then hands it to the loop thread; 0: every call goes to the loop thread
    # (docs/design.md, "The caller drives its call")
    drive_ms: int = 10
    # calls that cannot be made express are driven too; off, they go to the loop thread
    # (rabit2-submit --cluster local turns it off for workers that share a pinned CPU)
    drive_general: bool = True
    # a pair call (world size 2) made in one step on the caller's thread where nothing else
    # goes on (docs/design.md, "Express calls"); needs drive_ms > 0
    express: bool = True
    # None: rabit2 leaves logging as the program set it (docs/user-guide.md, "Logging")
    log_level: str | None = None
    mock: tuple[MockSpec, ...] = ()
    # lazy recovery (docs/recovery.md); rabit2-submit turns it on when it restarts workers
    recover: bool = False
    recover_timeout_sec: float = 300.0
    replay_mb: int = 256
    local_replica: int = 2
    # TCP congestion control of the peer links: None picks reno where the kernel allows it
    # (docs/design.md, "Congestion control"); "system" keeps the kernel's default
    tcp_congestion: str | None = None
    # which peer links carry a CRC32C of every payload: "auto" (links between two hosts),
    # "on" or "off"; headers are always checked (docs/protocol.md, "Checksums")
    checksum: str = "auto"
    # elastic mode (docs/elastic.md): steps run in live sets; no recovery
    elastic: bool = False
    # rabit2.xgboost sets glibc's malloc thresholds for its payload-sized buffers
    # (rabit2/xgboost/memory.py)
    xgboost_heap: bool = True

    @property
    def distributed(self) -> bool:
        return self.tracker_uri not in (None, "", "NULL")


# canonical field <- accepted spellings (lower case)
_ALIASES: dict[str, str] = {
    "dmlc_tracker_uri": "tracker_uri",
    "rabit_tracker_uri": "tracker_uri",
    "dmlc_tracker_port": "tracker_port",
    "rabit_tracker_port": "tracker_port",
    "dmlc_task_id": "task_id",
    "rabit_task_id": "task_id",
    "dmlc_num_attempt": "num_attempt",
    "rabit_num_trial": "num_attempt",
    "dmlc_num_worker": "world_size",
    "rabit_world_size": "world_size",
    "rabit2_secret": "secret",
    "rabit_timeout_sec": "timeout_sec",
    "dmlc_timeout": "timeout_sec",
    "rabit2_timeout_sec": "timeout_sec",
    "rabit2_connect_timeout_sec": "connect_timeout_sec",
    "dmlc_worker_connect_retry": "connect_retry",
    "dmlc_retry": "connect_retry",
    "rabit2_heartbeat_sec": "heartbeat_sec",
    "rabit2_link_timeout_sec": "link_timeout_sec",
    "rabit_reduce_ring_mincount": "reduce_ring_mincount",
    "rabit2_ring_min_bytes": "ring_min_bytes",
    "rabit_tree_reduce_minsize": "tree_reduce_minsize",
    "rabit2_loop": "loop",
    "rabit2_spin_us": "spin_us",
    "rabit2_drive_ms": "drive_ms",
    "rabit2_express": "express",
    "rabit2_drive_general": "drive_general",
    "rabit2_log_level": "log_level",
    "mock": "mock",
    "rabit2_recover": "recover",
    "rabit2_recover_timeout_sec": "recover_timeout_sec",
    "rabit2_replay_mb": "replay_mb",
    "rabit_local_replica": "local_replica",
    "rabit2_tcp_congestion": "tcp_congestion",
    "rabit2_checksum": "checksum",
    "rabit2_elastic": "elastic",
    "rabit2_xgboost_heap": "xgboost_heap",
}
# the least value of each integer setting (named as users know it)
_LEAST = {
    "rabit_reduce_ring_mincount": 0,
    "rabit2_ring_min_bytes": 0,
    "rabit_tree_reduce_minsize": 1,
    "rabit2_replay_mb": 0,
    "rabit2_spin_us": 0,
    "rabit2_drive_ms": 0,
    "rabit_local_replica": 0,
    "dmlc_worker_connect_retry": 1,
}
# accepted for compatibility, no effect in rabit2 (documented in docs/user-guide.md)
_IGNORED = {
    "rabit_enable_tcp_no_delay",  # TCP_NODELAY is always on
    "rabit_timeout",  # deadlines are always on
    "rabit_reduce_buffer",
    "rabit_debug",
    "rabit_bootstrap_cache",
    "rabit_global_replica",
    "rabit_hadoop_mode",
    "dmlc_communicator",
    "xgboost_communicator",
    "dmlc_role",
    "dmlc_nccl_path",
    "dmlc_num_server",
    "dmlc_job_cluster",
    "report_stats",
    "force_local",
    "dmlc_worker_stop_process_on_error",  # an error is always raised, never exits the process
}
_ENV_KEYS = (
    "DMLC_TRACKER_URI",
    "DMLC_TRACKER_PORT",
    "DMLC_TASK_ID",
    "DMLC_NUM_ATTEMPT",
    "DMLC_NUM_WORKER",
    "DMLC_WORKER_CONNECT_RETRY",
    "RABIT2_SECRET",
    "RABIT2_TIMEOUT_SEC",
    "RABIT2_CONNECT_TIMEOUT_SEC",
    "RABIT2_HEARTBEAT_SEC",
    "RABIT2_LINK_TIMEOUT_SEC",
    "RABIT2_LOOP",
    "RABIT2_SPIN_US",
    "RABIT2_DRIVE_MS",
    "RABIT2_EXPRESS",
    "RABIT2_DRIVE_GENERAL",
    "RABIT2_RING_MIN_BYTES",
    "RABIT2_LOG_LEVEL",
    "RABIT2_RECOVER",
    "RABIT2_RECOVER_TIMEOUT_SEC",
    "RABIT2_REPLAY_MB",
    "RABIT2_TCP_CONGESTION",
    "RABIT2_CHECKSUM",
    "RABIT2_ELASTIC",
    "RABIT2_XGBOOST_HEAP",
)
_OTHER_ENV_KEYS = ("RABIT2_BIND_CPU", "RABIT2_LAUNCHER_PID", "RABIT2_RUN_DIR")
"""Read where they are used (the engine's start, the launcher), not by :func:`load_config`."""
_PREFIXES = ("rabit_", "dmlc_", "rabit2_")
# Where other launchers put a worker's index (and restart count) when DMLC_TASK_ID (and
# DMLC_NUM_ATTEMPT) is not set: srun, Open MPI's mpirun, PMIx/PMI launchers, Kubernetes
# indexed Jobs.  The first one present is used (docs/user-guide.md, "Other launchers").
_TASK_ID_FALLBACKS = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                      "JOB_COMPLETION_INDEX")
_ATTEMPT_FALLBACKS = ("SLURM_RESTART_COUNT",)
# Where they put the number of processes they started (the same launchers).
_WORLD_FALLBACKS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE",
                    "WORLD_SIZE")


def _parse_mock(value: str) -> MockSpec:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) not in (4, 5, 6, 7):
        raise ValueError(f"mock={value!r}: expected "
                         "rank,version,seqno,trial[,after_bytes[,reset_peer[,damage]]]")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"mock={value!r}: fields must be integers") from None
    return MockSpec(*nums)


MAX_SECONDS = 1_000_000.0
"""The longest a time setting may be (about 11.5 days): every deadline, summed with others or
in milliseconds for the kernel, must stay within what the clocks and sockets take."""


def _integer(field: str, value: Any) -> int:
    """An integer setting: an int, an integral float, or its decimal text (not a bool)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{field}: expected an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{field}: expected an integer, got {value!r}") from None


def secret_bytes(text: str) -> bytes:
    """A job secret as given in text (``RABIT2_SECRET``, ``rabit2_secret=``, the tracker's
    ``--secret``): hex is decoded, other text is used as UTF-8."""
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()


def _convert(field: str, value: Any) -> Any:  # noqa: C901, PLR0911, PLR0912
    if field == "secret":
        return value if isinstance(value, bytes) else secret_bytes(str(value))
    if field in ("recover", "elastic", "express", "drive_general", "xgboost_heap"):
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{field}: expected a boolean (1/0, true/false), got {value!r}")
    if field == "checksum":
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return "on"
        if text in ("0", "false", "no", "off"):
            return "off"
        if text == "auto":
            return "auto"
        raise ValueError(f"checksum: expected auto, on or off, got {value!r}")
    if field in ("tracker_port", "num_attempt", "world_size", "connect_retry",
                 "reduce_ring_mincount", "ring_min_bytes", "tree_reduce_minsize", "replay_mb",
                 "local_replica", "spin_us", "drive_ms"):
        number = _integer(field, value)
        if field == "tracker_port" and not 0 < number <= 65535:
            raise ValueError(f"tracker_port: expected a port number 1-65535, got {value!r}")
        if field == "world_size" and number != -1 and number < 1:
            raise ValueError(f"world_size: expected a number of workers (or -1: the "
                             f"tracker's), got {value!r}")
        return number
    if field in ("timeout_sec", "connect_timeout_sec", "heartbeat_sec", "recover_timeout_sec",
                 "link_timeout_sec"):
        try:
            if isinstance(value, bool):
                raise TypeError
            seconds = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{field}: expected seconds, got {value!r}") from None
        if not 0 < seconds <= MAX_SECONDS:  # also rejects NaN, which would never expire
            raise ValueError(f"{field}: must be a positive number of seconds, at most "
                             f"{MAX_SECONDS:.0f}, got {value!r}")
        return seconds
    if field == "loop":
        text = str(value).lower()
        if text not in ("uvloop", "asyncio"):
            raise ValueError(f"loop: expected 'uvloop' or 'asyncio', got {value!r}")
        return text
    if field == "tcp_congestion":
        text = str(value).strip().lower()
        if not text or not text.replace("_", "").isalnum():
            raise ValueError(f"tcp_congestion: expected an algorithm name such as 'reno' or "
                             f"'cubic', or 'system', got {value!r}")
        return text
    if field == "tracker_uri":
        text = str(value)
        return None if text in ("", "NULL") else text
    if field == "log_level":
        text = str(value).strip().upper()
        if text not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got "
                             f"{value!r}")
        return text
    return str(value)


def launcher_task(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(task id, attempt) as the launcher set them: ``DMLC_TASK_ID`` and
    ``DMLC_NUM_ATTEMPT``, else the first non-empty of the other launchers' variables
    (``SLURM_PROCID``, ..., ``SLURM_RESTART_COUNT``); None where none is set."""
    def first(names: tuple[str, ...]) -> str | None:
        return next((env[name] for name in names if env.get(name, "") != ""), None)

    return (first(("DMLC_TASK_ID", *_TASK_ID_FALLBACKS)),
            first(("DMLC_NUM_ATTEMPT", *_ATTEMPT_FALLBACKS)))


def launcher_world(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(variable, value) of the first launcher variable that says how many processes the
    launcher started (``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``, ...); None if none does."""
    for name in _WORLD_FALLBACKS:
        value = env.get(name, "")
        if value.isdigit():
            return name, int(value)
    return None


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Config))


def misspelled_env(environ: Mapping[str, str]) -> list[str]:
    """``RABIT2_*`` variables that rabit2 does not read and that look like one it does
    (``RABIT2_RECOVR``), each with what it probably meant: a line to warn with.  Other
    unknown ones (a tool's own) are left alone."""
    known = (*_ENV_KEYS, *_OTHER_ENV_KEYS)
    lines = []
    for name in sorted(environ):
        if name.startswith("RABIT2_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if close:
                lines.append(f"{name} is not a rabit2 variable (ignored): {close[0]}?")
    return lines


def load_config(  # noqa: C901
    args: Iterable[str | bytes] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build a :class:`Config`.  Raises ``ValueError`` for unknown keys or bad values."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    mocks: list[MockSpec] = []
    spelled: dict[str, str] = {}  # field -> the key it was last set by, as the caller wrote it

    def apply(key: str, value: Any, keyword: bool = False) -> None:
        lower = key.lower()
        communicator = (str(value).strip().lower() if value is not None
                        and lower in ("dmlc_communicator", "xgboost_communicator") else "rabit")
        if communicator == "federated":
            # (XGBoost's federated mode would train alone here, as rank 0 of 1, without a
            # word)
            raise ValueError(f"{key}='federated' asks for XGBoost's own federated "
                             "communicator, which rabit2.init does not start: rabit2 is the "
                             "communicator (rabit2.xgboost connects XGBoost to it)")
        if communicator != "rabit":  # (as XGBoost refuses a communicator it does not know)
            raise ValueError(f"{key}={value!r}: rabit2 is a rabit communicator; expected "
                             "'rabit'")
        if lower in _IGNORED:
            return
        field = _ALIASES.get(lower)
        if field is None:
            if keyword and lower in _FIELD_NAMES:
                # (as k=v strings, usually the program's own command line, bare names such
                # as secret= or loop= are the program's, as rabit leaves them)
                field = lower
            elif lower.startswith(_PREFIXES):
                raise ValueError(f"unknown rabit2 parameter {key!r}")
            else:
                return
        if value is None:  # (a keyword given as None is not set, as in XGBoost's init)
            return
        if field == "mock":
            mocks.append(_parse_mock(str(value)))
            return
        try:
            values[field] = _convert(field, value)
            spelled[field] = key
        except ValueError as exc:  # named as the caller spelled it (the message names field)
            text = str(exc)
            if key.lower() != field and text.startswith(f"{field}:"):
                text = key + text[len(field):]
            raise ValueError(text) from None

    for key in _ENV_KEYS:
        if key in env:
            apply(key, env[key])
    task, attempt = launcher_task(env)
    if "DMLC_TASK_ID" not in env and task is not None:
        apply("DMLC_TASK_ID", task)
    if "DMLC_NUM_ATTEMPT" not in env and attempt is not None:
        apply("DMLC_NUM_ATTEMPT", attempt)
    if isinstance(args, (str, bytes, Mapping)):
        raise TypeError(
            "init(args) takes a list of 'k=v' strings (such as sys.argv), got "
            f"{type(args).__name__}; pass a dict of parameters as keywords: init(**params)")
    for arg in args or ():
        if not isinstance(arg, (str, bytes)):
            raise TypeError(f"init(args) takes 'k=v' strings, got {type(arg).__name__} "
                            f"{arg!r} among them")
        text = arg.decode() if isinstance(arg, bytes) else arg
        key, sep, value = text.partition("=")
        if sep and key:
            apply(key.strip(), value.strip())
    for key, value in (kwargs or {}).items():
        if key.lower() == "mock" and isinstance(value, (list, tuple)):
            for item in value:
                apply(key, item)
        else:
            apply(key, value, keyword=True)
    for name, least in _LEAST.items():
        number = values.get(_ALIASES[name])
        if number is not None and number < least:
            raise ValueError(f"{spelled.get(_ALIASES[name], name)} must be >= {least}")
    if any(spec.damage for spec in mocks) and "checksum" not in values:
        # (a damaged byte is what checksums are for, and links within one host carry none
        # by default.  The sender adds them: this holds where every rank gets the same
        # mock= arguments, as rabit2-submit gives its workers the same command line)
        values["checksum"] = "on"
    return Config(**values, mock=tuple(mocks))
