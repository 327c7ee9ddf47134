"""Driver-side helpers shared by the adapters (standard library only).

An adapter module ``peer_<name>.py`` provides, for each implementation label it serves:

* ``LABELS``: the labels it measures (``--impl`` values of ``harness.py``);
* ``unavailable(label) -> str | None``: why it cannot run here, or ``None``;
* ``job(label, n, harness_args) -> Job``: the launcher command that starts ``n`` ranks of
  ``harness.py`` with ``harness_args``;
* ``make_comm(label)``: the worker-side :class:`harness.Comm` (imports the peer lazily).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.py"
SETUP_STATE = HERE / ".setup"
LOOPBACK = "127.0.0.1"


@dataclass
class Job:
    """A launcher invocation: ``argv`` run with the driver's environment plus ``env``."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def setup_failure(peer: str) -> str | None:
    """The failure recorded by ``setup.sh`` for ``peer`` (``None`` if ok or never run)."""
    status = SETUP_STATE / f"{peer}.status"
    if not status.exists():
        return None
    text = status.read_text().strip()
    return None if text == "ok" else f"setup.sh {text}"


def probe(python: str | Path, code: str, timeout: float = 120) -> str | None:
    """Run ``code`` in ``python``; ``None`` if it exits 0, else the last line of its output."""
    try:
        proc = subprocess.run(
            [str(python), "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return lines[-1][:200] if lines else f"exit {proc.returncode}"


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def harness_cmd(python: str | Path, label: str, harness_args: list[str]) -> list[str]:
    """``python harness.py --impl label ...``."""
    return [str(python), str(HARNESS), "--impl", label, *harness_args]


MAIN_PYTHON = sys.executable
