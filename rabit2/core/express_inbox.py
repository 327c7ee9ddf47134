"""The peer's frames of an express call (``docs/design.md``, "Express calls"): back to back in
one inbox, each header checked as soon as it is in."""

from __future__ import annotations

from collections.abc import Callable

from rabit2.core.framing import CALL_PREFIX_SIZE, HEADER_SIZE, FrameCorruptError, unpack_tail
from rabit2.core.fsm import LinkEvent
from rabit2.core.records import Link


def unhold(link: Link, uncount: Callable[[], None]) -> None:
    """Leave ``link``, whose staged frame (read ahead by the loop, the link paused on it) an
    express call took, as if nothing had been read: the I/O layer reads on.  The frame is
    counted again as it is handed over or made (``uncount``)."""
    link.go(LinkEvent.CALL_BEGAN)
    link.start = link.end = 0
    link.frame = None
    link.remaining = 0
    uncount()


def header_at(inbox: memoryview, at: int, prefix: bytes) -> tuple[int, int, int] | None:
    """``(offset, length, payload crc)`` of the header at ``inbox[at:]`` if it is a DATA
    frame of the call that ``prefix`` starts and its own CRC holds; None if not (the
    general path must read it: it resets the link for a header that fails its CRC)."""
    if inbox[at : at + CALL_PREFIX_SIZE] != prefix:
        return None
    try:
        return unpack_tail(inbox, at)
    except FrameCorruptError:
        return None


class PeerFrames:
    """Where the peer's frames of one express call land: ``frames`` (each one's stream
    ``(offset, length)``), each header then its payload, in ``inbox``."""

    __slots__ = ("crcs", "frames", "inbox", "prefix", "starts", "valid")

    def __init__(self) -> None:
        self.inbox = memoryview(b"")
        self.frames: list[tuple[int, int]] = []
        self.starts: list[int] = []  # where each header starts in the inbox
        self.prefix = b""  # the first bytes of every header of the call
        self.crcs: list[int] = []  # the payload CRC32Cs the headers name, so far
        self.valid = False  # every header passed check_frames

    def lay(self, frames: list[tuple[int, int]], prefix: bytes) -> None:
        self.frames, self.prefix = frames, prefix[:CALL_PREFIX_SIZE]
        self.starts = ([0] if len(frames) == 1 else
                       [offset + i * HEADER_SIZE for i, (offset, _) in enumerate(frames)])

    def check_frames(self, got: int) -> bool:
        """Check each header that the first ``got`` bytes of the inbox hold whole and that was
        not checked yet: the call's prefix, the frame's offset and length, the header's own
        checksum.  False at the first that fails (the general path must read them)."""
        inbox, crcs, frames = self.inbox, self.crcs, self.frames
        while len(crcs) < len(frames) and self.starts[len(crcs)] + HEADER_SIZE <= got:
            i = len(crcs)
            tail = header_at(inbox, self.starts[i], self.prefix)
            if tail is None or tail[:2] != frames[i]:
                return False
            crcs.append(tail[2])
        self.valid = len(crcs) == len(frames)
        return True

    def payload(self, i: int) -> memoryview:
        """The payload of the peer's frame ``i`` in the inbox."""
        at = self.starts[i] + HEADER_SIZE
        return self.inbox[at : at + self.frames[i][1]]
