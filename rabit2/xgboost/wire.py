"""The federated messages on the wire, read and written without copying their payload.

protobuf's Python runtime copies a bytes field when it parses a message and again at every
read of it, and a reply's payload when the reply is made and again when it is serialized
(upb: 0.24-0.72 ms per read of 8 MiB, 0.6 ms to make a reply of 8 MiB, 1.5 ms to serialize
it).  Each request is a handful of varints around one bytes field, each reply that one
field alone (``federated.proto``), so the endpoint reads requests and writes replies itself:
the request's ``send_buffer`` is a view of the bytes gRPC received, and a reply is its
payload behind a two-to-eleven-byte header, made with one copy.  What protobuf itself
would read from the same bytes is what these read (``tests/unit/test_federated_wire.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import DecodeError

from rabit2.xgboost._proto import MESSAGES, METHODS

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5

# the varint fields of each request: field number -> (name, signed 32-bit)
_FIELDS: dict[str, dict[int, tuple[str, bool]]] = {
    "Allgather": {1: ("sequence_number", False), 2: ("rank", True)},
    "AllgatherV": {1: ("sequence_number", False), 2: ("rank", True)},
    "Allreduce": {1: ("sequence_number", False), 2: ("rank", True),
                  4: ("data_type", True), 5: ("reduce_operation", True)},
    "Broadcast": {1: ("sequence_number", False), 2: ("rank", True), 4: ("root", True)},
}
_SEND_BUFFER = 3
_MOST_FIELDS = 16
"""XGBoost sends at most five fields: a request with more, or with a field number or tag
XGBoost never uses, is left to protobuf's parser (in C, bounded), so that no request makes
this loop run long on gRPC's polling thread."""


class Request:
    """A federated request as protobuf would read it (a field absent reads 0, or empty)."""

    __slots__ = ("data_type", "rank", "reduce_operation", "root", "send_buffer",
                 "sequence_number")

    def __init__(self) -> None:
        self.sequence_number = 0
        self.rank = 0
        self.data_type = 0
        self.reduce_operation = 0
        self.root = 0
        self.send_buffer = memoryview(b"")


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    """The varint at ``at`` (at most ten bytes, as unsigned 64-bit) and where it ends."""
    value = shift = 0
    for i in range(at, min(at + 10, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, i + 1
        shift += 7
    raise ValueError("federated request: a varint runs past the message or its ten bytes")


def _int32(value: int) -> int:
    value &= 0xFFFF_FFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def reader(method: str) -> Callable[[bytes], Request]:
    """The request deserializer of ``method``: raises ``ValueError`` on bytes that are not
    a message (truncated, a group, a length past the end)."""
    if method not in METHODS:
        raise ValueError(f"no federated method {method!r}")
    fields = _FIELDS[method]
    message = MESSAGES[f"{method}Request"]

    def by_protobuf(raw: bytes) -> Request:
        try:
            parsed = message.FromString(raw)
        except DecodeError as exc:
            raise ValueError(f"federated request: {exc}") from None
        request = Request()
        for name, _ in fields.values():
            setattr(request, name, getattr(parsed, name))
        request.send_buffer = memoryview(parsed.send_buffer)
        return request

    def read(raw: bytes) -> Request:
        data = memoryview(raw)
        request = Request()
        at, end, seen = 0, len(data), 0
        while at < end:
            seen += 1
            if seen > _MOST_FIELDS or data[at] >= 0x80:  # (a tag past field 15)
                return by_protobuf(raw)
            key, at = _varint(data, at)
            number, kind = key >> 3, key & 7
            if number == 0:
                raise ValueError("federated request: field number 0")
            if kind == _VARINT:
                value, at = _varint(data, at)
                known = fields.get(number)
                if known is not None:
                    name, signed = known
                    setattr(request, name, _int32(value) if signed else value)
            elif kind == _BYTES:
                length, at = _varint(data, at)
                if length > end - at:
                    raise ValueError("federated request: a field runs past the message")
                if number == _SEND_BUFFER:
                    request.send_buffer = data[at : at + length]
                at += length
            elif kind in (_FIXED64, _FIXED32):
                at += 8 if kind == _FIXED64 else 4
                if at > end:
                    raise ValueError("federated request: a field runs past the message")
            else:
                raise ValueError(f"federated request: wire type {kind} (a group?)")
        return request

    return read


def reply(payload: bytes | bytearray | memoryview) -> bytes:
    """The serialized reply (``receive_buffer = 1``) that carries ``payload``, as protobuf
    writes it: nothing at all for an empty one."""
    size = len(payload)
    if not size:
        return b""
    head = bytearray(b"\x0a")
    while size >= 0x80:
        head.append((size & 0x7F) | 0x80)
        size >>= 7
    head.append(size)
    return b"".join((head, payload))
