"""Throwaway hosts on one machine: Linux network namespaces on a private bridge.

``Testbed(k)`` makes hosts 1..k, each a namespace with one interface ``eth0`` at
``<subnet>.<i>/24``, plugged by a veth pair into a bridge that lives in a namespace of its
own.  Nothing is attached to the root namespace and no namespace has a default route, so
test traffic can only reach the testbed's own addresses; a blackhole route for the subnet
in the root namespace makes a testbed address used by mistake from outside fail here
instead of leaving the machine.  :meth:`Testbed.down` kills every process left in the
namespaces and removes everything.  Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence


def _quiet(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True)


def available() -> str | None:
    """Why a testbed cannot be made here, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"r2probe{os.getpid() % 100000}"
    made = _quiet(["ip", "netns", "add", probe])
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _quiet(["ip", "netns", "del", probe])
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    done = _quiet(argv)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class Testbed:
    def __init__(self, hosts: int) -> None:
        tag = os.getpid() % 10000
        self.prefix = f"r2s{tag}"  # interface names stay within 15 characters
        self.subnet = f"10.213.{100 + tag % 150}"
        self.hosts = hosts
        self.switch = f"{self.prefix}-sw"
        self._namespaces: list[str] = []
        self._guard = False

    def ns(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def addr(self, host: int) -> str:
        return f"{self.subnet}.{host}"

    def run(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs inside ``host``."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def up(self) -> Testbed:
        try:
            _ip("route", "add", "blackhole", f"{self.subnet}.0/24")
            self._guard = True
            _ip("netns", "add", self.switch)
            self._namespaces.append(self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for host in range(1, self.hosts + 1):
                ns, inner, outer = self.ns(host), f"{self.prefix}h{host}i", f"{self.prefix}h{host}s"
                _ip("netns", "add", ns)
                self._namespaces.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "netns", self.switch)
                _ip("link", "set", inner, "name", "eth0", ns=ns)
                _ip("addr", "add", f"{self.addr(host)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", outer, "master", "br0", ns=self.switch)
                _ip("link", "set", outer, "up", ns=self.switch)
        except BaseException:
            self.down()
            raise
        return self

    def pids(self, host: int) -> list[int]:
        return [int(word) for word in _quiet(["ip", "netns", "pids", self.ns(host)]).stdout.split()]

    def down(self) -> None:
        for ns in self._namespaces:
            for pid in _quiet(["ip", "netns", "pids", ns]).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 5
        for ns in self._namespaces:
            while (_quiet(["ip", "netns", "pids", ns]).stdout.split()
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            _quiet(["ip", "netns", "del", ns])
        self._namespaces.clear()
        if self._guard:
            _quiet(["ip", "route", "del", "blackhole", f"{self.subnet}.0/24"])
            self._guard = False


@contextlib.contextmanager
def one_host_with_tc(*commands: str) -> Iterator[Testbed]:
    """One namespace whose loopback is set up with these ``tc`` commands (each a string of
    arguments); skips the test, with the reason, where namespaces or ``tc`` are missing."""
    import pytest  # noqa: PLC0415 - only tests call this

    why = available()
    if why is not None:
        pytest.skip(why)
    if shutil.which("tc") is None:
        pytest.skip("iproute2's `tc` is not installed")
    bed = Testbed(1).up()
    try:
        for args in commands:
            subprocess.run(bed.run(1, ["tc", *args.split()]), check=True, capture_output=True)
        yield bed
    finally:
        bed.down()
