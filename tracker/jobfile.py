"""Job files: where a running ``rabit2-submit`` job's tracker listens, and its secret.

``rabit2-submit`` writes one when its tracker is up and removes it when it ends, so that
``rabit2-tracker --query`` (no argument: the one job of this user on this machine; or the
file's path) can ask that tracker for its status, as ``ray status`` or Dask's scheduler file
do.  The file holds the job's secret, so it is private: mode 0600, in a directory of this
user's that nobody else may write to (checked, not assumed)::

    $RABIT2_RUN_DIR, else $XDG_RUNTIME_DIR/rabit2, else <tmp>/rabit2-<uid>
        job-<host>-<launcher pid>.json

A job file is read only from such a directory and only if this user owns it and nobody else
may read or write it: a file planted by another user is not trusted.  Files are named by host
and pid, so that a run directory shared between hosts lists each host's jobs apart.

Content (JSON): ``host``, ``port`` (where the workers reach the tracker), ``secret`` (hex),
``pid`` (the launcher's), ``world_size``, ``cluster``, ``command``, ``started`` (ISO 8601)
and ``metrics`` (the metrics URL, or null).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

_PREFIX = "job-"
_HOST = socket.gethostname().replace("-", "_") or "localhost"


def run_dir() -> Path:
    """The directory job files go to (see the module's docstring); not created here."""
    explicit = os.environ.get("RABIT2_RUN_DIR")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "rabit2"
    return Path(tempfile.gettempdir()) / f"rabit2-{os.getuid()}"


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or check that only this user can write to it; raises
    ``OSError`` saying why it cannot hold a secret."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    _check_private(path)


def _check_private(path: Path) -> None:
    """Raise ``OSError`` unless ``path`` is a directory (not a link) of this user that
    nobody else may write to (``FileNotFoundError`` when it does not exist)."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a directory")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} is not private to this user (owner uid {info.st_uid}, mode "
                      f"{stat.S_IMODE(info.st_mode):o}); set RABIT2_RUN_DIR")


def write(info: dict[str, Any], path: Path | None = None) -> Path:
    """Write a job file (0600) atomically; ``path`` defaults to this process's one in
    :func:`run_dir`.  Returns its path; raises ``OSError`` when it cannot be written safely."""
    if path is None:
        folder = run_dir()
        _private_dir(folder)
        _prune(folder)
        path = folder / f"{_PREFIX}{_HOST}-{os.getpid()}.json"
    elif path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: name a file in it")
    fd, staging = tempfile.mkstemp(prefix=".job-", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    return path


def read(path: str | Path) -> tuple[str, int, str]:
    """The tracker's host, port and secret (hex) from a job file; raises ``ValueError``
    naming the file and what is wrong with it (including a file this user does not own or
    that others may read or write, and a symbolic link)."""
    try:
        # (non-blocking: a FIFO must not hang the open; a directory is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot read job file {path}: {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a job file (not a regular file)")
    with os.fdopen(fd, encoding="utf-8") as f:
        owner = os.fstat(f.fileno())
        if owner.st_uid != os.getuid() or owner.st_mode & 0o077:
            raise ValueError(f"{path} is not private to this user (owner uid "
                             f"{owner.st_uid}, mode {stat.S_IMODE(owner.st_mode):o})")
        try:
            info = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read job file {path}: {exc}") from None
    host, port, secret = (info.get(key) if isinstance(info, dict) else None
                          for key in ("host", "port", "secret"))
    if (not isinstance(host, str) or type(port) is not int or not 0 < port < 65536
            or not isinstance(secret, str)):
        raise ValueError(f"{path} is not a rabit2 job file (host, port, secret)")
    return host, port, secret


def launcher_alive(path: Path) -> bool | None:
    """Whether the launcher that wrote job file ``path`` on this host still runs (None:
    unknown: written on another host, or not a job file).  The launcher is named by the
    file's name in the run folder, elsewhere (``--status-file``) by its ``pid`` and
    ``launcher_host`` fields."""
    host, _, pid_text = path.stem[len(_PREFIX):].rpartition("-")
    pid = int(pid_text) if path.name.startswith(_PREFIX) and pid_text.isdigit() else None
    if pid is None:
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(info, dict) or type(info.get("pid")) is not int:
            return None
        host, pid = str(info.get("launcher_host", "")).replace("-", "_"), info["pid"]
    if host != _HOST or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's (in a shared RABIT2_RUN_DIR)
    return True


def _prune(folder: Path) -> None:
    """Remove the job files of launchers that were killed before they could."""
    for path in folder.glob(f"{_PREFIX}*.json"):
        if launcher_alive(path) is False:
            with contextlib.suppress(OSError):
                path.unlink()


def running(folder: Path | None = None) -> list[Path]:
    """The job files in ``folder`` (default :func:`run_dir`) whose launcher still runs,
    oldest first.  A file left by a launcher that was killed is skipped."""
    folder = run_dir() if folder is None else folder
    try:
        _check_private(folder)
    except FileNotFoundError:
        return []
    found: list[tuple[float, Path]] = []
    for path in folder.glob(f"{_PREFIX}*.json"):
        if launcher_alive(path):
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path))
    return [path for _, path in sorted(found)]


def remove(path: Path) -> None:
    """Remove a job file; a file already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


__all__ = ["launcher_alive", "read", "remove", "run_dir", "running", "write"]
