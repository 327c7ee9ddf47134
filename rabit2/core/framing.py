"""Peer data frames: a fixed 40-byte little-endian header followed by raw payload bytes.

Every byte on a peer link after the handshake belongs to a frame.  The header names the call
it belongs to (checkpoint ``version`` and ``seqno`` since that checkpoint), describes the call
(collective kind, dtype, op, root, total size) so that ranks which disagree about the call
detect it from the first frame they exchange, and says where the payload sits in the
*stream* of that call on that directed link (``offset``), so that an interrupted transfer can
resume at a byte offset.  See ``docs/protocol.md`` ("Peer data frames") for the byte table.

Nothing here touches a socket: :class:`FrameHeader` packs and unpacks, :func:`parse_header`
validates every field before anything is sized from it.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import msgpack

from rabit2.errors import ProtocolError

HEADER = struct.Struct("<HBBBBHIIQQII")
HEADER_SIZE = HEADER.size  # 40
FRAME_MAGIC = 0x3252  # b"R2" little-endian
NONE_U8 = 0xFF
NONE_U16 = 0xFFFF
MAX_PAYLOAD = (1 << 32) - 1  # a frame payload length is a u32
MAX_ERROR_PAYLOAD = 64 * 1024  # an ERROR frame carries a short msgpack map
UNKNOWN_TOTAL = (1 << 64) - 1  # a broadcast receiver that learns the size from the root
MAX_BROADCAST = 1 << 40  # a size learned from the wire is bounded before anything is sized
MAX_CONTROL_PAYLOAD = 1 << 20  # a recovery control message is a small msgpack map


class FrameKind(enum.IntEnum):
    DATA = 1  # payload = raw bytes of the call's stream on this link
    ERROR = 2  # payload = msgpack {"type", "reason", "origin"}: the call failed somewhere
    CONTROL = 3  # payload = msgpack map of the recovery protocol (state, need, fetch, reply)
    BLOB = 4  # payload = the raw bytes a preceding CONTROL "reply" announced


class CollectiveKind(enum.IntEnum):
    ALLREDUCE_TREE = 1
    ALLREDUCE_RING = 2
    BROADCAST = 3
    ALLGATHER = 4
    ALLREDUCE_PAIR = 5  # world size 2, small calls: both ranks exchange and reduce at once


@dataclasses.dataclass(frozen=True, slots=True)
class CallDescriptor:
    """What a rank believes the current call is; every frame of the call carries it."""

    kind: CollectiveKind
    dtype_code: int  # NONE_U8 for byte-oriented calls (broadcast, allgather)
    op_code: int  # NONE_U8 unless an allreduce
    root: int  # NONE_U16 unless a broadcast
    total_bytes: int

    def agrees_with(self, other: CallDescriptor) -> bool:
        """Equal, where a broadcast receiver's unknown size matches any size."""
        if self == other:
            return True
        unknown = UNKNOWN_TOTAL in (self.total_bytes, other.total_bytes)
        return unknown and (self.kind, self.dtype_code, self.op_code, self.root) == (
            other.kind, other.dtype_code, other.op_code, other.root)

    def describe(self) -> str:
        size = "? B" if self.total_bytes == UNKNOWN_TOTAL else f"{self.total_bytes} B"
        parts = [self.kind.name.lower(), size]
        if self.dtype_code != NONE_U8:
            parts.append(f"dtype#{self.dtype_code}")
        if self.op_code != NONE_U8:
            parts.append(f"op#{self.op_code}")
        if self.root != NONE_U16:
            parts.append(f"root={self.root}")
        return "(" + ", ".join(parts) + ")"


@dataclasses.dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    call: CallDescriptor
    version: int
    seqno: int
    offset: int
    length: int
    incarnation: int = 0

    @property
    def call_id(self) -> tuple[int, int]:
        return (self.version, self.seqno)

    def pack(self) -> bytes:
        return HEADER.pack(
            FRAME_MAGIC,
            self.kind,
            self.call.kind,
            self.call.dtype_code,
            self.call.op_code,
            self.call.root,
            self.version,
            self.seqno,
            self.call.total_bytes,
            self.offset,
            self.length,
            self.incarnation,
        )


def pack_header(
    kind: FrameKind,
    call: CallDescriptor,
    version: int,
    seqno: int,
    offset: int,
    length: int,
    incarnation: int = 0,
) -> bytes:
    """Hot-path packer: the same bytes as ``FrameHeader(...).pack()`` without the object."""
    return HEADER.pack(
        FRAME_MAGIC, kind, call.kind, call.dtype_code, call.op_code, call.root,
        version, seqno, call.total_bytes, offset, length, incarnation,
    )


CALL_PREFIX_SIZE = 24  # magic .. total_bytes: identical in every DATA frame of one call
_TAIL = struct.Struct("<QII")  # offset, length, incarnation


def data_prefix(call: CallDescriptor, version: int, seqno: int) -> bytes:
    """The first 24 bytes of every DATA frame of this call, to recognise them in one compare."""
    return pack_header(FrameKind.DATA, call, version, seqno, 0, 0)[:CALL_PREFIX_SIZE]


def unpack_tail(data: bytes | bytearray | memoryview, at: int) -> tuple[int, int, int]:
    """``(offset, length, incarnation)`` of the header that starts at ``at``."""
    offset, length, incarnation = _TAIL.unpack_from(data, at + CALL_PREFIX_SIZE)
    return offset, length, incarnation


def parse_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Decode and validate a 40-byte header.  Raises :class:`ProtocolError` on any bad field."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    (magic, kind, ckind, dtype_code, op_code, root, version, seqno, total, offset, length,
     incarnation) = HEADER.unpack(data)
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"bad frame magic 0x{magic:04x}")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    try:
        call_kind = CollectiveKind(ckind)
    except ValueError:
        raise ProtocolError(f"unknown collective kind {ckind}") from None
    if frame_kind is FrameKind.ERROR and length > MAX_ERROR_PAYLOAD:
        raise ProtocolError(f"error frame of {length} B exceeds {MAX_ERROR_PAYLOAD} B")
    if frame_kind is FrameKind.CONTROL and length > MAX_CONTROL_PAYLOAD:
        raise ProtocolError(f"control frame of {length} B exceeds {MAX_CONTROL_PAYLOAD} B")
    call = CallDescriptor(call_kind, dtype_code, op_code, root, total)
    return FrameHeader(frame_kind, call, version, seqno, offset, length, incarnation)


ERROR_TYPES = ("mismatch", "peer_lost", "protocol", "timeout", "aborted", "unrecoverable")


def encode_error(error_type: str, reason: str, origin: int) -> bytes:
    """Payload of an ERROR frame: which error every rank should raise, why, and who saw it."""
    body: bytes = msgpack.packb({"type": error_type, "reason": reason[:4096], "origin": origin})
    return body


def decode_error(payload: bytes | bytearray | memoryview) -> tuple[str, str, int]:
    """Decode an ERROR frame payload; a malformed one is itself a :class:`ProtocolError`."""
    try:
        body: Any = msgpack.unpackb(bytes(payload), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable error frame: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("error frame payload is not a map")
    error_type, reason, origin = body.get("type"), body.get("reason"), body.get("origin")
    if (error_type not in ERROR_TYPES or not isinstance(reason, str)
            or not isinstance(origin, int) or isinstance(origin, bool)):
        raise ProtocolError("error frame lacks a known type, a reason or an origin")
    return error_type, reason, origin
