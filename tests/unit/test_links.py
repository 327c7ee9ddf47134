"""A peer link's volatile writes (``PeerLink.write_copied``), over a real socket pair and
uvloop's own transport: what the kernel does not take at once is copied, so the sender may
overwrite its buffers the moment the write returns."""

from __future__ import annotations

import asyncio
import os
import socket
import types

import pytest

from rabit2.io.links import PeerLink

uvloop = pytest.importorskip("uvloop")


def _engine() -> types.SimpleNamespace:
    """What a link calls back into (the link is what is under test here)."""
    events: list[str] = []
    return types.SimpleNamespace(
        faults=types.SimpleNamespace(damaging=False), events=events,
        on_drained=lambda: events.append("drained"),
        on_hangup=lambda peer, why: events.append(f"hangup {why}"))


async def _exchange(size: int, overwrite: bool) -> tuple[bytes, bytes, int]:
    loop = asyncio.get_running_loop()
    mine, theirs = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    engine = _engine()
    transport, link = await loop.create_connection(lambda: PeerLink(engine, 1), sock=mine)
    link.fd = mine.fileno()
    header = b"H" * 40
    payload = bytearray(os.urandom(size))
    sent = header + bytes(payload)
    link.write_copied([header, memoryview(payload)])
    queued = transport.get_write_buffer_size()
    if overwrite:
        payload[:] = bytes(size)  # the sender moves on: its result lands where its input was
    theirs.setblocking(False)
    got = bytearray()
    while len(got) < len(sent):
        got += await loop.sock_recv(theirs, 1 << 16)
    transport.close()
    theirs.close()
    return sent, bytes(got), queued


def _run(size: int, overwrite: bool) -> tuple[bytes, bytes, int]:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_exchange(size, overwrite))


def test_what_the_kernel_did_not_take_is_a_copy() -> None:
    """1 MiB through small socket buffers: most of it waits in the transport, and the
    buffer it came from is overwritten at once; the peer still reads the original bytes."""
    sent, got, queued = _run(1 << 20, overwrite=True)
    assert queued > 0  # (the case that matters: the kernel took only part of it)
    assert got == sent


def test_a_write_the_kernel_takes_whole_leaves_nothing_queued() -> None:
    sent, got, queued = _run(1000, overwrite=True)
    assert queued == 0 and got == sent
