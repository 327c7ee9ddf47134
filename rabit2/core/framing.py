"""Peer data frames: a fixed 48-byte little-endian header followed by raw payload bytes.

Every byte on a peer link after the handshake belongs to a frame.  The header names the call
it belongs to (checkpoint ``version`` and ``seqno`` since that checkpoint), describes the call
(collective kind, dtype, op, root, total size) so that ranks which disagree about the call
detect it from the first frame they exchange, and says where the payload sits in the
*stream* of that call on that directed link (``offset``), so that an interrupted transfer can
resume at a byte offset.  See ``docs/protocol.md`` ("Peer data frames") for the byte table.

Every header ends with a CRC32C of its other 44 bytes, and a frame whose ``kind`` byte has
:data:`FLAG_CHECKED` set carries a CRC32C of its payload too (``docs/protocol.md``,
"Checksums"): TCP's 16-bit sum misses corruption in a NIC, a switch or memory, and a flipped
byte must never become a wrong result.  A frame that fails either check raises
:class:`FrameCorruptError`; the agent resets the link and resumes after the last verified
frame.

Nothing here touches a socket: :class:`FrameHeader` packs and unpacks, :func:`parse_header`
validates every field before anything is sized from it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
from typing import Any

import msgpack
from crc32c import crc32c

from rabit2.core.ops import SUPPORTED_DTYPES, Op, dtype_code
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RabitError,
    UnrecoverableError,
)

HEADER = struct.Struct("<HBBBBHIIQQIII")  # everything but the header's own CRC
HEADER_SIZE = HEADER.size + 4  # 48
_CRC = struct.Struct("<I")
FLAG_CHECKED = 0x80  # in the kind byte: the payload_crc field holds the payload's CRC32C
CHECKED_FRAME = 512 * 1024
"""The largest payload of a checked DATA frame: a receiver uses no byte of a frame before the
whole frame is verified, so a frame is also the step in which data is forwarded and reduced
(a landing ring of ``schedule.LANDING_RING`` holds several)."""
FRAME_MAGIC = 0x3252  # b"R2" little-endian
NONE_U8 = 0xFF
NONE_U16 = 0xFFFF
MAX_PAYLOAD = (1 << 32) - 1  # a frame payload length is a u32
MAX_ERROR_PAYLOAD = 64 * 1024  # an ERROR frame carries a short msgpack map
UNKNOWN_TOTAL = (1 << 64) - 1  # a broadcast receiver that learns the size from the root
MAX_BROADCAST = 1 << 40  # a size learned from the wire is bounded before anything is sized
MAX_CONTROL_PAYLOAD = 1 << 20  # a recovery control message is a small msgpack map


class FrameCorruptError(ProtocolError):
    """A frame failed its checksum: bytes were damaged on the way (the link is reset and the
    stream resumes after the last verified frame where recovery is on)."""


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
        """The call as a user wrote it, e.g. ``(tree allreduce, 80 B, float64, SUM)``: the
        algorithm too, since ranks whose settings differ may choose different ones."""
        parts = [_KIND_LABELS.get(self.kind, self.kind.name.lower()),
                 "size not known yet" if self.total_bytes == UNKNOWN_TOTAL
                 else f"{self.total_bytes} B"]
        if self.dtype_code != NONE_U8:
            dtype = _DTYPE_LABELS.get(self.dtype_code)
            parts.append(dtype if dtype is not None else f"dtype code {self.dtype_code}")
        if self.op_code != NONE_U8:
            parts.append(_OP_LABELS.get(self.op_code, f"op code {self.op_code}"))
        if self.root != NONE_U16:
            parts.append(f"root {self.root}")
        return "(" + ", ".join(parts) + ")"


_KIND_LABELS = {CollectiveKind.ALLREDUCE_TREE: "tree allreduce",
               CollectiveKind.ALLREDUCE_RING: "ring allreduce",
               CollectiveKind.ALLREDUCE_PAIR: "pair allreduce"}
_OP_LABELS = {op.value: op.name for op in Op}
_DTYPE_LABELS = {dtype_code(dtype): str(dtype) for dtype in SUPPORTED_DTYPES}


@dataclasses.dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    call: CallDescriptor
    version: int
    seqno: int
    offset: int
    length: int
    incarnation: int = 0
    payload_crc: int | None = None  # None: the payload is not checked

    @property
    def call_id(self) -> tuple[int, int]:
        return (self.version, self.seqno)

    def pack(self) -> bytes:
        return pack_header(self.kind, self.call, self.version, self.seqno, self.offset,
                           self.length, self.incarnation, self.payload_crc)


def pack_header(
    kind: FrameKind,
    call: CallDescriptor,
    version: int,
    seqno: int,
    offset: int,
    length: int,
    incarnation: int = 0,
    payload_crc: int | None = None,
) -> bytes:
    """Hot-path packer: the same bytes as ``FrameHeader(...).pack()`` without the object.
    ``payload_crc``: the payload's CRC32C (a checked frame), or None (not checked)."""
    body = HEADER.pack(
        FRAME_MAGIC, kind if payload_crc is None else kind | FLAG_CHECKED, call.kind,
        call.dtype_code, call.op_code, call.root, version, seqno, call.total_bytes, offset,
        length, incarnation, payload_crc or 0,
    )
    return body + _CRC.pack(crc32c(body))


CALL_PREFIX_SIZE = 24  # magic .. total_bytes: identical in every DATA frame of one call
_TAIL = struct.Struct("<QIIII")  # offset, length, incarnation, payload crc, header crc


_PREFIX = struct.Struct("<HBBBBHIIQ")  # HEADER's first CALL_PREFIX_SIZE bytes
_DATA = int(FrameKind.DATA)


def data_prefix(call: CallDescriptor, version: int, seqno: int, checked: bool) -> bytes:
    """The first 24 bytes of every DATA frame of this call, to recognise them in one compare
    (``checked``: as a sender that checksums its payloads writes them)."""
    return _PREFIX.pack(FRAME_MAGIC, _DATA | FLAG_CHECKED if checked else _DATA, call.kind,
                        call.dtype_code, call.op_code, call.root, version, seqno,
                        call.total_bytes)


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (hardware-accelerated where the CPU has
    an instruction for it)."""
    result: int = crc32c(data, value)
    return result


def unpack_tail(data: bytes | bytearray | memoryview, at: int) -> tuple[int, int, int]:
    """``(offset, length, payload crc)`` of the header that starts at ``at``, after checking
    the header's own CRC (:class:`FrameCorruptError`)."""
    offset, length, _, payload_crc, header_crc = _TAIL.unpack_from(data, at + CALL_PREFIX_SIZE)
    if crc32c(data[at : at + HEADER_SIZE - 4]) != header_crc:
        raise FrameCorruptError("frame header failed its checksum")
    return offset, length, payload_crc


def parse_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Decode and validate a 48-byte header.  Raises :class:`FrameCorruptError` if it fails
    its checksum, :class:`ProtocolError` on any other bad field."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    (header_crc,) = _CRC.unpack_from(data, HEADER_SIZE - 4)
    if crc32c(data[: HEADER_SIZE - 4]) != header_crc:
        raise FrameCorruptError("frame header failed its checksum")
    (magic, kind_byte, ckind, dtype_code, op_code, root, version, seqno, total, offset, length,
     incarnation, payload_crc) = HEADER.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"bad frame magic 0x{magic:04x}")
    kind = kind_byte & ~FLAG_CHECKED
    if payload_crc and not kind_byte & FLAG_CHECKED:
        raise ProtocolError("payload_crc set on a frame whose payload is not checked")
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
    return FrameHeader(frame_kind, call, version, seqno, offset, length, incarnation,
                       payload_crc if kind_byte & FLAG_CHECKED else None)


_ERROR_CLASSES: dict[str, type[RabitError]] = {
    "mismatch": MismatchError,
    "peer_lost": PeerLostError,
    "protocol": ProtocolError,
    "timeout": CollectiveTimeoutError,
    "aborted": JobAbortedError,
    "unrecoverable": UnrecoverableError,
}
_ERROR_NAMES = {cls: name for name, cls in _ERROR_CLASSES.items()}
ERROR_TYPES = tuple(_ERROR_CLASSES)
"""The error types an ERROR frame names: every rank raises the same one."""


def error_type_of(error: RabitError) -> str:
    """The wire name of ``error``'s type (any other error travels as a protocol error)."""
    return _ERROR_NAMES.get(type(error), "protocol")


def error_from_wire(error_type: str, message: str) -> RabitError:
    """The error an ERROR frame's type names (``error_type`` was checked by
    :func:`decode_error`)."""
    return _ERROR_CLASSES[error_type](message)


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


# ----------------------------------------------------------------------------- API payloads
# The layouts the API puts inside a collective's stream: they travel as data, but every rank
# reads them, so they are wire formats like the frames above.

BROADCAST_HEAD = struct.Struct("<BBBxIQ8Q")
"""What an API broadcast sends before its payload, in the same stream: kind, dtype code,
ndim, pad, reserved, payload bytes, shape[8] (rabit sends a length first)."""
HEAD_PICKLE, HEAD_ARRAY, HEAD_DEVICE = 1, 2, 3
"""A broadcast head's kinds: a pickled object, a numpy array's raw bytes, or a device
(cupy) array's raw bytes, which receivers put back on their device."""
MAX_NDIM = 8


def pack_broadcast_head(kind: int, code: int, shape: tuple[int, ...], nbytes: int) -> bytearray:
    """The head of a broadcast of ``nbytes`` payload bytes (``code`` and ``shape``: an
    array's dtype code and shape; 0 and () for a pickle)."""
    head = bytearray(BROADCAST_HEAD.size)
    BROADCAST_HEAD.pack_into(head, 0, kind, code, len(shape), 0, nbytes,
                             *shape, *([0] * (MAX_NDIM - len(shape))))
    return head


def unpack_broadcast_head(head: bytes | bytearray | memoryview
                          ) -> tuple[int, int, tuple[int, ...], int]:
    """``(kind, dtype code, shape, payload bytes)``.  Raises ``ValueError`` for more than
    :data:`MAX_NDIM` dimensions."""
    kind, code, ndim, _, nbytes, *shape = BROADCAST_HEAD.unpack(head)
    if kind in (HEAD_ARRAY, HEAD_DEVICE) and ndim > MAX_NDIM:
        raise ValueError(f"broadcast head has {ndim} dimensions")
    return kind, code, tuple(shape[:ndim]), nbytes


GATHER_INFO = 4
"""uint64 words per rank in an allgather's first round: payload bytes, dtype code, rows,
and a tag of the trailing shape (which must agree on every rank)."""


def shape_tag(shape: tuple[int, ...]) -> int:
    """A 63-bit tag of a shape, the same on every rank whatever its Python: the first 8
    bytes of the BLAKE2b digest of ``ndim`` (u8) and the dimensions (u64 each), little-endian,
    shifted right by one."""
    packed = struct.pack(f"<B{len(shape)}Q", len(shape), *(int(d) for d in shape))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1
