"""What an express call writes and hands over (``docs/design.md``, "Express calls"): its
frames written straight to a link's socket, and, when the call goes on the general way, what
was written (:class:`Written`, skipped from what ``begin`` sends; :class:`Ahead`, counted as
sent) and what was read (:func:`feed`, handed to the link as if just read)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rabit2.core.records import Command, Send
from rabit2.errors import ProtocolError

if TYPE_CHECKING:
    from rabit2.io.links import PeerLink


class Written:
    """What an express call wrote to ``peer`` before it took the general path: the first
    ``count`` bytes of ``frame``."""

    __slots__ = ("count", "frame", "peer")

    def __init__(self, peer: int, count: int, frame: Sequence[bytes | memoryview]) -> None:
        self.peer, self.count, self.frame = peer, count, frame

    def skip(self, cmds: list[Command]) -> list[Command]:
        """``cmds`` (from ``Agent.begin``) without the bytes already written; raises
        :class:`ProtocolError` if they are not the bytes ``begin`` sends first (never
        expected: sending anything else would corrupt the peer's stream)."""
        left = self.count
        dropped: list[bytes] = []
        out: list[Command] = []
        for cmd in cmds:
            if left and isinstance(cmd, Send) and cmd.peer == self.peer:
                rest: list[bytes | memoryview] = []
                for buf in cmd.buffers:
                    size = len(buf)
                    if left >= size:
                        dropped.append(bytes(buf))
                        left -= size
                    elif left:
                        view = memoryview(buf)
                        dropped.append(bytes(view[:left]))
                        rest.append(view[left:])
                        left = 0
                    else:
                        rest.append(buf)
                if rest:
                    out.append(Send(cmd.peer, rest, cmd.volatile))
                continue
            out.append(cmd)
        expected = b"".join(bytes(part) for part in self.frame)[: self.count]
        if left or b"".join(dropped) != expected:
            raise ProtocolError("the general path would not send the frame an express call "
                                "wrote: the peer's stream cannot be kept whole")
        return out


class Ahead:
    """What an express tree call (:mod:`rabit2.core.express_tree`) wrote before it took the
    general path: its one frame of the whole out-stream to each of ``peers``, which counts
    as sent (``Agent.begin``); ``rest``, per peer, the tail of a frame the kernel took only
    part of, queued on the link before anything else."""

    __slots__ = ("peers", "rest")

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.rest: dict[int, bytes] = {}

    def wrote(self, peer: int, count: int, frame: Sequence[bytes | memoryview]) -> None:
        """The kernel took ``count`` bytes of ``frame`` for ``peer`` (-1: the socket broke)."""
        if count <= 0:
            return
        self.peers.append(peer)
        if count < sum(len(part) for part in frame):
            # (a copy: the express call's buffers serve the next call)
            self.rest[peer] = b"".join(bytes(part) for part in frame)[count:]

    def queue(self, links: dict[int, PeerLink]) -> None:
        for peer, rest in self.rest.items():
            link = links.get(peer)
            transport = None if link is None else link.transport
            if transport is not None and not transport.is_closing():
                transport.write(rest)


def write(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """What the kernel took of ``parts`` (-1: the socket is broken)."""
    try:
        return os.writev(fd, parts)
    except BlockingIOError:
        return 0
    except OSError:
        return -1


def feed(link: PeerLink, data: memoryview) -> None:
    """Hand ``data``, read from ``link``'s socket, to the link as if just read into the
    buffers its agent names.  (It all fits before any pause: what an express call reads is
    at most as long as the peer's frames of this call, and the link is paused only on a frame
    of a later call, which cannot follow all of them within that length.)"""
    at, size = 0, len(data)
    while at < size:
        transport = link.transport
        if not link.current or transport is None or transport.is_closing():
            return  # the link is being dropped: what it read goes with it
        assert transport.is_reading(), "bytes left after a pause"
        view = link.get_buffer(-1)
        nbytes = min(len(view), size - at)
        view[:nbytes] = data[at : at + nbytes]
        link.buffer_updated(nbytes)
        at += nbytes
