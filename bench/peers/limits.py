"""Physical limits of this machine, measured with the same clock and statistics as the peers.

    python bench/peers/limits.py --sizes 4096,1048576 --iters-scale 0.1 --out limits.jsonl

Three probes (two processes on loopback, unpinned, like the Python peers):

* ``tcp-exchange``: both processes send S bytes to each other at the same time and receive S
  bytes over plain sockets with TCP_NODELAY into a preallocated buffer. Up to 256 KiB: one
  thread, send then receive, on a connection with 1 MiB socket buffers (room for the whole
  message, so two blocking senders cannot dead-lock), ``sendall`` then ``recv_into``. Larger:
  one thread with a non-blocking socket on a second connection with the kernel's default
  (auto-tuned) buffers, sending what the socket takes and receiving what has arrived, asleep
  in ``poll`` only when neither moved. (Until 2026-11-24 this used a sender thread started per
  iteration, which cost 25-50 % at 1-64 MiB: the limits of the earlier runs in
  ``bench/results/`` are that slower probe.) Each iteration is preceded by an 8-byte exchange
  as a barrier and timed from the first process entering to the last leaving, exactly like a
  collective. This is the floor for an N=2 allreduce in Python: each rank must ship its S
  bytes and receive the peer's.
* ``tcp-exchange-reno``: the same with TCP congestion control ``reno`` on both connections,
  as rabit2 sets on its links by default (``rabit2_tcp_congestion``); on a machine whose
  default is BBR (this VM) this is the faster of the two, so it is the limit to compare with.
* ``numpy-add``: ``np.add(a, b, out=a)`` on S bytes of float32 in one process; the cost of
  the reduction itself.
* ``rtt-8B``: an 8-byte ping-pong; the cost of one wake-up of each process.

Output: one JSON line per (probe, size) with ``impl`` = ``limit:<probe>`` and the same fields
as the collectives (``median_s``, ``p90_s``, ``busbw_GBps`` = S / median).
"""

from __future__ import annotations

import argparse
import json
import pickle
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SMALL_MAX = 256 * 1024
SOCK_BUF = 1024 * 1024
_POLLERS: dict[int, Any] = {}  # a non-blocking connection's fd -> its select.poll object


def default_iters(size: int) -> int:
    """Same schedule as the collectives (harness.default_iters)."""
    return max(10, min(1000, int(6e8 // size)))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` with ``recv_into``."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def exchange(
    small: socket.socket, large: socket.socket, send: memoryview, recv: memoryview
) -> None:
    """Send ``send`` and receive ``len(recv)`` bytes at the same time (both sides call it)."""
    if len(send) <= SMALL_MAX:
        small.sendall(send)
        recv_exact(small, recv)
        return
    # one thread, non-blocking: send what the socket takes, take what has arrived, and
    # sleep in poll only when neither moved
    sent = got = 0
    n_out, n_in = len(send), len(recv)
    fd = large.fileno()
    while sent < n_out or got < n_in:
        moved = False
        if sent < n_out:
            try:
                sent += large.send(send[sent:])
                moved = True
            except BlockingIOError:
                pass
        if got < n_in:
            try:
                k = large.recv_into(recv[got:], n_in - got)
            except BlockingIOError:
                k = -1
            if k == 0:
                raise ConnectionError("peer closed")
            if k > 0:
                got += k
                moved = True
        if not moved:
            events = (select.POLLOUT if sent < n_out else 0) | (select.POLLIN if got < n_in else 0)
            poller = _POLLERS[fd]
            poller.modify(fd, events)
            poller.poll()


def tune(sock: socket.socket, buffers: bool, congestion: str = "") -> None:
    """TCP_NODELAY; fixed 1 MiB socket buffers if ``buffers``; ``congestion`` control if
    given (else the kernel's default)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    if buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def _nonblocking(sock: socket.socket) -> None:
    """Make ``sock`` the large connection: non-blocking, with a poll object of its own."""
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    _POLLERS[sock.fileno()] = poller


def exchange_loop(
    small: socket.socket, large: socket.socket, sizes: list[int], scale: float
) -> list[tuple[int, list[float], list[float]]]:
    """The exchange schedule, run identically by both processes; returns the stamps."""
    buf_out = bytearray(b"\x07" * max(sizes))
    buf_in = bytearray(max(sizes))
    b8o, b8i = memoryview(bytearray(8)), memoryview(bytearray(8))
    out: list[tuple[int, list[float], list[float]]] = []
    for size in sizes:
        iters = max(3, round(default_iters(size) * scale))
        warm = max(2, iters // 20)
        so, si = memoryview(buf_out)[:size], memoryview(buf_in)[:size]
        starts: list[float] = []
        ends: list[float] = []
        for i in range(warm + iters):
            exchange(small, large, b8o, b8i)
            t0 = time.perf_counter()
            exchange(small, large, so, si)
            t1 = time.perf_counter()
            if i >= warm:
                starts.append(t0)
                ends.append(t1)
        out.append((size, starts, ends))
    return out


def child(port: int, sizes: list[int], scale: float, congestion: str) -> int:
    """The second process: exchange, echo the ping-pong, then send its stamps."""
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock, True, congestion)
    large = socket.create_connection(("127.0.0.1", port))
    tune(large, False, congestion)
    _nonblocking(large)
    stamps = exchange_loop(sock, large, sizes, scale)
    large.close()
    b8 = memoryview(bytearray(8))
    (count,) = struct.unpack("!q", sock.recv(8, socket.MSG_WAITALL))
    for _ in range(count):
        recv_exact(sock, b8)
        sock.sendall(b8)
    blob = pickle.dumps(stamps)
    sock.sendall(struct.pack("!q", len(blob)) + blob)
    sock.close()
    return 0


def stats(times: np.ndarray, size: int) -> dict[str, float]:
    """Median / p90 and S / median."""
    med = float(np.median(times))
    return {
        "median_s": med,
        "p90_s": float(np.percentile(times, 90)),
        "min_s": float(times.min()),
        "busbw_GBps": size / med / 1e9 if med > 0 else 0.0,
        "iters": int(times.size),
    }


def numpy_add(sizes: list[int], scale: float) -> list[dict[str, Any]]:
    """Time ``np.add(a, b, out=a)`` per size."""
    rows = []
    for size in sizes:
        a = np.ones(size // 4, dtype=np.float32)
        b = np.ones(size // 4, dtype=np.float32)
        iters = max(5, round(default_iters(size) * scale))
        times = []
        for i in range(iters + 2):
            t0 = time.perf_counter()
            np.add(a, b, out=a)
            t1 = time.perf_counter()
            if i >= 2:
                times.append(t1 - t0)
        rows.append(
            {
                "impl": "limit:numpy-add",
                "op": "add",
                "world": 1,
                "size_bytes": size,
                **stats(np.array(times), size),
            }
        )
    return rows


def parent(
    sizes: list[int], scale: float, rtt_iters: int, congestion: str = ""
) -> list[dict[str, Any]]:
    """Start the child, run the exchange and ping-pong, return the result rows."""
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            str(port),
            "--sizes",
            ",".join(map(str, sizes)),
            "--iters-scale",
            str(scale),
            "--congestion",
            congestion,
        ]
    )
    sock, _ = lst.accept()
    tune(sock, True, congestion)
    large, _ = lst.accept()
    tune(large, False, congestion)
    _nonblocking(large)
    lst.close()
    mine = exchange_loop(sock, large, sizes, scale)
    large.close()
    sock.sendall(struct.pack("!q", rtt_iters))
    b8 = memoryview(bytearray(8))
    rtts = []
    for _ in range(rtt_iters):
        t0 = time.perf_counter()
        sock.sendall(b8)
        recv_exact(sock, b8)
        rtts.append(time.perf_counter() - t0)
    (length,) = struct.unpack("!q", sock.recv(8, socket.MSG_WAITALL))
    theirs = pickle.loads(sock.recv(length, socket.MSG_WAITALL))
    sock.close()
    proc.wait(30)
    rows: list[dict[str, Any]] = []
    for (size, s0, e0), (_, s1, e1) in zip(mine, theirs, strict=True):
        span = np.maximum(np.array(e0), np.array(e1)) - np.minimum(np.array(s0), np.array(s1))
        rows.append(
            {
                "impl": "limit:tcp-exchange" + (f"-{congestion}" if congestion else ""),
                "op": "exchange",
                "world": 2,
                "size_bytes": size,
                **stats(span, size),
            }
        )
    rows.append(
        {
            "impl": "limit:rtt-8B",
            "op": "pingpong",
            "world": 2,
            "size_bytes": 8,
            **stats(np.array(rtts), 8),
        }
    )
    return rows + numpy_add(sizes, scale)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the probes (or the child side of them)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", required=True, help="comma-separated byte counts")
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--rtt-iters", type=int, default=2000)
    ap.add_argument("--out", type=Path, help="JSON-lines file (default: stdout)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--congestion", default="", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    sizes = [int(s) for s in ns.sizes.split(",") if s]
    if ns.child is not None:
        return child(ns.child, sizes, ns.iters_scale, ns.congestion)
    rows = parent(sizes, ns.iters_scale, ns.rtt_iters)
    if hasattr(socket, "TCP_CONGESTION"):
        reno = parent(sizes, ns.iters_scale, 1, "reno")
        rows += [r for r in reno if r["impl"] == "limit:tcp-exchange-reno"]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if ns.out:
        ns.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
