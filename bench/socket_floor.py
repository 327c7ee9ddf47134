"""The least a small allreduce can cost from Python over loopback TCP: two processes, one
frame each way per call (a header and the payload with ``sendmsg``, ``epoll``, ``recv_into``,
unpack, ``np.add``), driven by the calling thread, nothing else.  Compare with rabit2's calls
(``run.py``) and with the agent alone (``agent_cost.py``).

    python bench/socket_floor.py [--size 4096] [--calls 20000] [--poll]

``--poll``: wait for the peer's bytes by polling (``sched_yield`` between tries), as rabit2's
callers do for their first ``rabit2_spin_us``, instead of sleeping in ``epoll``: on a VM whose
idle vCPU halts, a sleeping process takes tens of microseconds to wake.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import struct
import time

import numpy as np

HEADER = struct.Struct("<IIQQ")  # magic, call, offset, length


def exchange(sock: socket.socket, epoll: select.epoll, buf: np.ndarray, stage: bytearray,
             call: int, poll: bool = False) -> None:
    size = buf.nbytes
    sock.sendmsg([HEADER.pack(0x52423221, call, 0, size), memoryview(buf).cast("B")])
    view, got, need = memoryview(stage), 0, HEADER.size + size
    while got < need:
        try:
            got += sock.recv_into(view[got:], need - got)
        except BlockingIOError:
            if poll:
                os.sched_yield()
            else:
                epoll.poll(1.0)
    magic, seen, _, length = HEADER.unpack_from(stage)
    if magic != 0x52423221 or seen != call or length != size:
        raise SystemExit("bad frame")
    np.add(buf, np.frombuffer(stage, buf.dtype, buf.size, HEADER.size), out=buf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="bytes per call")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--poll", action="store_true", help="poll instead of sleeping")
    args = parser.parse_args()
    server = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:
        sock = socket.create_connection(server.getsockname())
    else:
        sock, _ = server.accept()
    server.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    epoll = select.epoll()
    epoll.register(sock.fileno(), select.EPOLLIN)
    buf = np.zeros(args.size // 4, np.float32)
    stage = bytearray(HEADER.size + args.size)
    for call in range(500):
        exchange(sock, epoll, buf, stage, call, args.poll)
    start = time.perf_counter()
    for call in range(args.calls):
        exchange(sock, epoll, buf, stage, call, args.poll)
    per_call = (time.perf_counter() - start) / args.calls
    if pid:
        os.waitpid(pid, 0)
        how = "polling" if args.poll else "sleeping in epoll"
        print(f"{args.size} B allreduce, two processes, Python on sockets ({how}): "
              f"{per_call * 1e6:.1f} us per call")
    else:
        os._exit(0)


if __name__ == "__main__":
    main()
