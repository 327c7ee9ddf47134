"""The remote end of ``rabit2-submit --cluster ssh``: one worker attempt on another host.

``rabit2-submit`` runs, once per worker attempt::

    ssh HOST 'cd DIR && exec PYTHON -m tracker.remote -- COMMAND...'

and writes one JSON line to the ssh process's standard input::

    {"env": {"DMLC_TRACKER_URI": "...", "RABIT2_SECRET": "...", ...}, "kill_grace": 5.0}

The job's variables (the secret among them) travel on that pipe, never on a command line
that ``ps`` would show other users of the host.  This program then:

* runs COMMAND with the host's environment plus those variables, in a session of its own,
  with its output going where this program's goes (back through ssh);
* keeps reading its standard input: end-of-file means the launcher, or its ssh, is gone
  (killed, Ctrl-C, a dropped connection), and the command's whole process group gets
  SIGTERM, then SIGKILL after ``kill_grace`` seconds.  SIGTERM, SIGHUP or SIGINT to this
  program do the same.  No worker outlives its launcher;
* once the command exits, stops what it left running in its process group (SIGTERM, then
  SIGKILL after ``kill_grace``), so that no helper of a finished worker holds the ssh
  session open or outlives the job on the host;
* exits with the command's status (128 + N when signal N ended it, as a shell reports it),
  which ssh hands back to the launcher.

Exit status 2 (and a line on stderr) when the JSON line is missing, malformed or does not
arrive within ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

EXIT_USAGE = 2
MAX_HEADER = 1 << 20  # the JSON line; a job's environment is a few KiB


class HeaderError(ValueError):
    """The launcher's JSON line is missing, late, too long or malformed."""


def read_header(fd: int, timeout: float) -> tuple[dict[str, Any], bytes]:
    """Read the first line from ``fd`` within ``timeout`` seconds; returns the parsed object
    and any bytes read past the newline."""
    buf = bytearray()
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HeaderError(f"no job description on stdin within {timeout:g} s")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise HeaderError("stdin closed before the job description arrived")
        buf += chunk
        if len(buf) > MAX_HEADER and b"\n" not in buf:
            raise HeaderError(f"job description longer than {MAX_HEADER} bytes")
    line, _, rest = bytes(buf).partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise HeaderError(f"job description is not JSON: {exc}") from None
    check_header(header)
    return header, rest


def check_header(header: Any) -> None:
    """Raise :class:`HeaderError` unless ``header`` is ``{"env": {str: str}, ...}``."""
    if not isinstance(header, dict):
        raise HeaderError("job description must be a JSON object")
    env = header.get("env")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in v
        for k, v in env.items()
    ):
        raise HeaderError("job description's 'env' must map variable names to strings")
    grace = header.get("kill_grace", 5.0)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise HeaderError("job description's 'kill_grace' must be a number >= 0")


def encode_header(env: Mapping[str, str], kill_grace: float) -> bytes:
    """The line ``rabit2-submit`` writes (the inverse of :func:`read_header`)."""
    return json.dumps({"env": dict(env), "kill_grace": kill_grace}).encode() + b"\n"


class ChildGroup:
    """The command, stopped at most once: SIGTERM, then SIGKILL after ``grace`` seconds.

    ``whole_group``: the command leads a process group of its own (``start_new_session``),
    and the signals go to that group, its own children included.  Otherwise they go to the
    command alone, which then shares its parent's group, so that whatever kills that group
    (a launcher's process tracking) reaches the command too.
    """

    def __init__(self, proc: subprocess.Popen[bytes], grace: float,
                 whole_group: bool = True) -> None:
        self.proc = proc
        self.grace = grace
        self.whole_group = whole_group
        self._lock = threading.Lock()
        self._stopping = False
        self._kill_at = 0.0  # (time.monotonic()) when SIGKILL follows the SIGTERM

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._kill_at = time.monotonic() + self.grace
        self._signal(signal.SIGTERM)
        timer = threading.Timer(self.grace, self._signal, (signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    def finish(self) -> bool:
        """The command exited: what it left running in its process group (a helper it
        started, one that ignores SIGTERM) is stopped as :meth:`stop` does, SIGKILL
        included (the timer of :meth:`stop` dies with this process), before this returns.
        True if anything was left."""
        if not self.whole_group or not self._group_alive():
            return False
        with self._lock:
            sent = self._stopping
            self._stopping = True
            if not sent:
                self._kill_at = time.monotonic() + self.grace
        if not sent:
            self._signal(signal.SIGTERM)
        while self._group_alive() and time.monotonic() < self._kill_at:
            time.sleep(0.05)
        if self._group_alive():
            self._signal(signal.SIGKILL)
        return True

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _signal(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.whole_group:
                # (even after the leader exited: its group may not have, its own children)
                os.killpg(self.proc.pid, signum)
            elif self.proc.poll() is None:
                self.proc.send_signal(signum)


def _watch_stdin(fd: int, child: ChildGroup) -> None:
    """Stop the command once the launcher's end of stdin is gone."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            child.stop()
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tracker.remote",
        description="Remote end of rabit2-submit --cluster ssh (reads its job from stdin).",
    )
    parser.add_argument("--wait", type=float, default=60.0, metavar="S",
                        help="seconds to wait for the job description on stdin")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = command_after(parser, args.command)
    try:
        header, _ = read_header(0, args.wait)
    except HeaderError as exc:
        print(f"rabit2 remote: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    env = dict(os.environ)
    env.update(header["env"])
    try:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        print(f"rabit2 remote: cannot start {command[0]!r}: {exc}", file=sys.stderr,
              flush=True)
        return 127
    child = ChildGroup(proc, float(header.get("kill_grace", 5.0)))

    def on_signal(signum: int, frame: FrameType | None) -> None:
        child.stop()

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, on_signal)
    threading.Thread(target=_watch_stdin, args=(0, child), daemon=True,
                     name="rabit2-remote-stdin").start()
    code = proc.wait()
    if child.finish() and code == 0:
        print(f"rabit2 remote: stopped what {command[0]!r} left running in its process "
              "group", file=sys.stderr, flush=True)
    return exit_status(code)


def command_after(parser: argparse.ArgumentParser, words: Sequence[str]) -> list[str]:
    """The command of an ``[options] -- command...`` line (``argparse.REMAINDER`` keeps the
    ``--``); a usage error (exit 2) if there is none."""
    command = list(words)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no command given (put it after --)")
    return command


def exit_status(code: int) -> int:
    """A child's status as a shell reports it: 128 + N for death by signal N."""
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
