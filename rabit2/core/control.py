"""Control frames: the small messages of the tracker protocol and of every connection preamble.

Pure (no sockets, no asyncio, no clock).  A control frame on the wire is::

    u32 little-endian body length | body = msgpack map with str keys

Every body carries ``"t"`` (the message type, one of :data:`MESSAGE_FIELDS`) and ``"v"`` (the
protocol version).  :data:`MESSAGE_FIELDS` is the one table that says which fields each message
type must carry and of which Python type; decoding checks a body against it, so the code that
handles a message can rely on its fields.  Extra fields are allowed so that a newer peer may add
information without breaking an older one.

Authentication is a challenge/response with HMAC-SHA256 over the per-job secret (see
``docs/protocol.md``); :func:`auth_mac` and :func:`check_mac` are its two primitives.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Mapping
from typing import Any, Final

import msgpack

from rabit2.errors import ProtocolError

MAGIC: Final[bytes] = b"RABIT2\x00\x01"
"""Sent first by the connecting side on every connection (tracker and peer links)."""
PROTOCOL_VERSION: Final[int] = 1
MAX_FRAME: Final[int] = 1 << 20
"""Bound on a control frame body, checked before a single body byte is buffered."""
NONCE_SIZE: Final[int] = 16
MAC_SIZE: Final[int] = 32  # HMAC-SHA256 digest size

_LENGTH = struct.Struct("<I")
LENGTH_PREFIX_SIZE: Final[int] = _LENGTH.size

# The field table: message type -> {field name: required Python type}.  ``int`` fields reject
# ``bool`` (msgpack keeps them distinct, and a bool rank is always a bug).
MESSAGE_FIELDS: Final[Mapping[str, Mapping[str, type]]] = {
    # connection preamble (docs/protocol.md, "Connection preamble and authentication")
    "challenge": {"nonce": bytes},
    "auth": {"nonce": bytes, "mac": bytes, "hello": dict},
    "ok": {"mac": bytes, "welcome": dict},
    "refuse": {"reason": str, "code": str},
    # worker -> tracker
    "register": {"task_id": str, "attempt": int, "port": int, "world_size": int},
    "rejoin": {"task_id": str, "rank": int, "incarnation": int, "port": int, "attempt": int},
    "print": {"msg": str},
    "heartbeat": {},
    "shutdown": {"hold": bool},
    "error": {"msg": str},
    "unreachable": {"rank": int, "reason": str},
    "status": {},
    # elastic mode (docs/elastic.md)
    "live": {"epoch": int},
    "live_done": {"epoch": int, "ok": bool, "reason": str},
    # monitor -> tracker (a supervisor such as tracker.slot)
    "give_up": {"task_id": str, "reason": str},
    "exited": {"task_id": str, "attempt": int},
    # tracker -> worker
    "assign": {
        "rank": int,
        "world_size": int,
        "parent": int,
        "children": list,
        "ring_prev": int,
        "ring_next": int,
        "peers": dict,
        "incarnation": int,
    },
    "bye": {},
    "rejoined": {},
    "abort": {"reason": str},
    "status_reply": {"status": dict},
    "live_set": {"epoch": int, "ranks": list, "new": list, "host": str, "port": int},
    "live_result": {"epoch": int, "ok": bool, "reason": str},
    "live_left": {"epoch": int, "rank": int, "calls": int},
    "peer_lost": {"rank": int, "incarnation": int, "reason": str},
    "peer_recovered": {"rank": int, "incarnation": int, "host": str, "port": int},
    # peer links, recovery protocol (docs/recovery.md): CONTROL frames carry these bodies
    "state": {"inc": int, "at": list, "active": bool, "need": int, "seen": bool,
              "recovering": bool, "versions": list, "oldest": list},
    "need": {"call": list, "from": int, "caught_up": bool, "held": bool},
    "progress": {"call": list, "age_us": int},
    "fetch": {"id": int, "what": str, "call": list, "lo": int, "hi": int},
    "reply": {"id": int, "call": list, "found": bool, "size": int, "desc": list,
              "reason": str},
    "local": {"owner": int, "version": int, "hops": int, "size": int},
}

# What a worker's ``heartbeat`` may report of its progress (an optional ``progress`` map):
# field -> type.  Counters start at 0 in every process (a restarted worker counts afresh).
PROGRESS_FIELDS: Final[Mapping[str, type]] = {
    "version": int,  # checkpoint version
    "seqno": int,  # calls made in this version
    "calls": int,  # collectives completed
    "sent": int,  # payload bytes sent to peers
    "received": int,  # payload bytes received from peers
    "links_reset": int,  # peer links re-established (recovery)
    "replayed": int,  # calls whose result came from a neighbour (a restarted worker)
    "resumed": int,  # calls resumed at a byte offset after a link broke
    "replaying": bool,  # a restarted worker that has not caught up with its neighbours
    "in_call": bool,  # in a collective call now (not computing between calls)
}
_COUNTER_MAX: Final[int] = (1 << 63) - 1


def check_progress(value: object) -> dict[str, int | bool]:
    """The known fields of a heartbeat's ``progress`` map, checked against
    :data:`PROGRESS_FIELDS` (unknown fields are dropped: a newer worker may report more).
    Raises :class:`ProtocolError` on a wrong type or a counter outside ``[0, 2**63)``."""
    if not isinstance(value, dict):
        raise ProtocolError(f"heartbeat.progress: expected dict, got {type(value).__name__}")
    out: dict[str, int | bool] = {}
    for name, expected in PROGRESS_FIELDS.items():
        if name not in value:
            continue
        field = value[name]
        if expected is bool:
            ok = isinstance(field, bool)
        else:
            ok = type(field) is int and 0 <= field <= _COUNTER_MAX
        if not ok:
            raise ProtocolError(f"heartbeat.progress.{name}: expected a "
                                f"{'bool' if expected is bool else 'counter'}, got "
                                f"{_short(field)}")
        out[name] = field
    return out


REFUSE_AUTH: Final[str] = "auth"
"""``refuse.code`` when the peer failed to prove it knows the secret."""
REFUSE_HELLO: Final[str] = "hello"
"""``refuse.code`` when the peer authenticated but its hello or request was not acceptable."""


def _check_fields(msg: Mapping[str, Any]) -> None:
    """Validate type, version and fields of a decoded body.  Raises :class:`ProtocolError`."""
    kind = msg.get("t")
    if not isinstance(kind, str):
        raise ProtocolError(f"control frame without a str 't' field: {_short(msg)}")
    spec = MESSAGE_FIELDS.get(kind)
    if spec is None:
        raise ProtocolError(f"unknown control message type {kind!r}")
    version = msg.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{kind}: protocol version {version!r}, this side speaks {PROTOCOL_VERSION}"
        )
    for name, expected in spec.items():
        if name not in msg:
            raise ProtocolError(f"{kind}: missing field {name!r}")
        value = msg[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ProtocolError(
                f"{kind}.{name}: expected {expected.__name__}, got {type(value).__name__}"
            )


def _short(value: object, limit: int = 80) -> str:
    """A bounded repr for error messages: a hostile peer must not be able to flood the log."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def encode_body(msg: Mapping[str, Any]) -> bytes:
    """Encode one control message as a bare msgpack body (no length prefix), adding ``"v"``.

    Used inside peer CONTROL frames, whose 48-byte header already carries the length.
    Raises ``ValueError`` as :func:`encode_frame` does.
    """
    return encode_frame(msg)[LENGTH_PREFIX_SIZE:]


def encode_frame(msg: Mapping[str, Any]) -> bytes:
    """Encode one control message as length prefix + msgpack body, adding ``"v"``.

    Raises ``ValueError`` if ``msg`` does not satisfy :data:`MESSAGE_FIELDS`, holds a value
    msgpack cannot encode (a bug on this side, never the peer's fault), or if the body would
    exceed :data:`MAX_FRAME`.
    """
    body_map = dict(msg)
    body_map["v"] = PROTOCOL_VERSION
    try:
        _check_fields(body_map)
    except ProtocolError as exc:
        raise ValueError(f"refusing to send an invalid control frame: {exc}") from None
    try:
        body: bytes = msgpack.packb(body_map, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{body_map['t']}: not encodable as msgpack: {exc}") from None
    if len(body) > MAX_FRAME:
        raise ValueError(f"{body_map['t']}: control frame of {len(body)} bytes > {MAX_FRAME}")
    return _LENGTH.pack(len(body)) + body


def decode_length(prefix: bytes) -> int:
    """Decode and bound a 4-byte length prefix.  Raises :class:`ProtocolError` if > MAX_FRAME."""
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_FRAME:
        raise ProtocolError(f"control frame length {length} exceeds the bound {MAX_FRAME}")
    return int(length)


def decode_body(body: bytes) -> dict[str, Any]:
    """Decode and validate one frame body (without its length prefix).

    Raises :class:`ProtocolError` if the body is longer than :data:`MAX_FRAME`, is not valid
    msgpack, is not a map with str keys, or does not satisfy :data:`MESSAGE_FIELDS`.
    """
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"control frame body of {len(body)} bytes exceeds {MAX_FRAME}")
    try:
        # strict_map_key rejects non-str/bytes keys while decoding; raw=False makes every str
        # valid UTF-8.  The unpacker's own limits are bounded by len(body) <= MAX_FRAME.
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError, OverflowError, RecursionError) as e:
        raise ProtocolError(f"undecodable control frame: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict) or not all(isinstance(key, str) for key in msg):
        raise ProtocolError(f"control frame is not a map with str keys: {_short(msg)}")
    _check_fields(msg)
    return msg


READ_SIZE = 65536
"""How many bytes a reader of control frames asks its stream for at a time (what it reads
goes to a :class:`FrameDecoder`)."""


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole validated messages back.

    After a :class:`ProtocolError` the stream is out of sync for good; every later
    :meth:`feed` raises again, so the owner can only close the connection.
    """

    __slots__ = ("_buffer", "_failure", "_need")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need: int | None = None  # body length once the prefix has been read
        self._failure: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a returned message (at most MAX_FRAME + 4)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Consume ``data``; return the messages it completed, oldest first.

        Raises :class:`ProtocolError` on a length prefix above :data:`MAX_FRAME` (before the
        body is buffered) or on any body that :func:`decode_body` rejects.
        """
        if self._failure is not None:
            raise ProtocolError(f"control stream already failed: {self._failure}")
        self._buffer += data
        messages: list[dict[str, Any]] = []
        try:
            while True:
                if self._need is None:
                    if len(self._buffer) < LENGTH_PREFIX_SIZE:
                        break
                    self._need = decode_length(bytes(self._buffer[:LENGTH_PREFIX_SIZE]))
                    del self._buffer[:LENGTH_PREFIX_SIZE]
                if len(self._buffer) < self._need:
                    break
                body = bytes(self._buffer[: self._need])
                del self._buffer[: self._need]
                self._need = None
                messages.append(decode_body(body))
        except ProtocolError as exc:
            self._failure = exc
            self._buffer.clear()
            raise
        return messages


def new_nonce() -> bytes:
    """16 fresh random bytes from the OS CSPRNG, one per handshake side."""
    return os.urandom(NONCE_SIZE)


def auth_mac(secret: bytes, role: bytes, nonce_a: bytes, nonce_b: bytes) -> bytes:
    """HMAC-SHA256(secret, role + nonce_a + nonce_b).

    ``role`` (``b"client"`` / ``b"server"``) keeps one side's answer from being replayed as
    the other's; the two nonces make every handshake's MACs fresh.  An empty secret still
    yields a MAC (HMAC with an empty key): such a job is unauthenticated.
    """
    return hmac.new(secret, role + nonce_a + nonce_b, hashlib.sha256).digest()


def check_mac(expected: bytes, got: object) -> bool:
    """Constant-time MAC comparison; ``False`` for anything that is not ``bytes``."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


__all__ = [
    "LENGTH_PREFIX_SIZE",
    "MAC_SIZE",
    "MAGIC",
    "MAX_FRAME",
    "MESSAGE_FIELDS",
    "NONCE_SIZE",
    "PROGRESS_FIELDS",
    "PROTOCOL_VERSION",
    "REFUSE_AUTH",
    "REFUSE_HELLO",
    "FrameDecoder",
    "auth_mac",
    "check_mac",
    "check_progress",
    "decode_body",
    "decode_length",
    "encode_frame",
    "new_nonce",
]
