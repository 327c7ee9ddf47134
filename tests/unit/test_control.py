"""Control-frame codec and auth helpers (rabit2.core.control): pure, no sockets."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rabit2.core.control import (
    MAC_SIZE,
    MAX_FRAME,
    MESSAGE_FIELDS,
    NONCE_SIZE,
    PROGRESS_FIELDS,
    PROTOCOL_VERSION,
    FrameDecoder,
    auth_mac,
    check_mac,
    check_progress,
    decode_body,
    encode_frame,
    new_nonce,
)
from rabit2.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)

_SAMPLE_VALUES: dict[type, Any] = {
    bytes: b"\x00\xff" * 8,
    dict: {"role": "worker", "n": 3},
    str: "hé llo",
    int: 7,
    list: [1, 2],
    bool: True,
}

EXAMPLES: list[dict[str, Any]] = [
    {"t": kind, **{name: _SAMPLE_VALUES[typ] for name, typ in spec.items()}}
    for kind, spec in MESSAGE_FIELDS.items()
]


def _raw_frame(body_map: object) -> bytes:
    body: bytes = msgpack.packb(body_map, use_bin_type=True)
    return struct.pack("<I", len(body)) + body


def test_message_table_covers_the_protocol() -> None:
    required = {"challenge", "auth", "ok", "refuse", "register", "assign", "print", "heartbeat",
                "shutdown", "bye", "error", "abort", "status", "status_reply",
                "state", "need", "fetch", "reply"}
    assert required <= set(MESSAGE_FIELDS)


@pytest.mark.parametrize("msg", EXAMPLES, ids=[m["t"] for m in EXAMPLES])
def test_round_trip_every_type(msg: dict[str, Any]) -> None:
    frame = encode_frame(msg)
    (length,) = struct.unpack("<I", frame[:4])
    assert length == len(frame) - 4
    decoded = decode_body(frame[4:])
    assert decoded == {**msg, "v": PROTOCOL_VERSION}
    assert FrameDecoder().feed(frame) == [decoded]


def test_whole_byte_by_byte_and_trailing() -> None:
    frames = [encode_frame(m) for m in EXAMPLES]
    stream = b"".join(frames)
    expected = [{**m, "v": PROTOCOL_VERSION} for m in EXAMPLES]

    assert FrameDecoder().feed(stream) == expected

    decoder = FrameDecoder()
    got: list[dict[str, Any]] = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == expected
    assert decoder.buffered == 0

    # trailing data: a partial next frame stays buffered until it completes
    decoder = FrameDecoder()
    assert decoder.feed(frames[0] + frames[1][:5]) == [expected[0]]
    assert 0 < decoder.buffered <= 5
    assert decoder.feed(frames[1][5:]) == [expected[1]]


def test_extra_fields_allowed() -> None:
    msg = {"t": "print", "msg": "x", "future_field": [1, 2, 3]}
    assert decode_body(encode_frame(msg)[4:])["future_field"] == [1, 2, 3]


def test_huge_length_rejected_before_body() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(struct.pack("<I", MAX_FRAME + 1))
    # the stream is out of sync for good
    with pytest.raises(ProtocolError):
        decoder.feed(encode_frame({"t": "heartbeat"}))


@pytest.mark.parametrize(
    ("body_map", "match"),
    [
        ([1, 2], "not a map"),
        ({"v": PROTOCOL_VERSION}, "'t'"),
        ({"t": 3, "v": PROTOCOL_VERSION}, "'t'"),
        ({"t": "nope", "v": PROTOCOL_VERSION}, "unknown"),
        ({"t": "heartbeat"}, "version"),
        ({"t": "heartbeat", "v": 99}, "version"),
        ({"t": "heartbeat", "v": True}, "version"),
        ({"t": "print", "v": PROTOCOL_VERSION}, "missing field 'msg'"),
        ({"t": "print", "v": PROTOCOL_VERSION, "msg": b"bytes"}, "expected str"),
        ({"t": "register", "v": PROTOCOL_VERSION, "task_id": "0", "attempt": True, "port": 1,
          "world_size": 2}, "expected int"),
        ({1: 2}, "undecodable|str keys"),
    ],
)
def test_invalid_bodies(body_map: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        FrameDecoder().feed(_raw_frame(body_map))


def test_undecodable_msgpack() -> None:
    for body in (b"\xc1", b"\x81\xa1t", b"\xa2\xff\xfe", b"\x91" * 5000):
        with pytest.raises(ProtocolError):
            decode_body(body)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_body(b"\x00" * (MAX_FRAME + 1))


def test_encode_rejects_bugs_on_our_side() -> None:
    with pytest.raises(ValueError, match="unknown"):
        encode_frame({"t": "nope"})
    with pytest.raises(ValueError, match="missing"):
        encode_frame({"t": "abort"})
    with pytest.raises(ValueError, match="bytes"):
        encode_frame({"t": "print", "msg": "x" * (MAX_FRAME + 10)})
    with pytest.raises(ValueError, match="msgpack"):
        encode_frame({"t": "print", "msg": "x", "extra": 1 << 70})
    with pytest.raises(ValueError, match="msgpack"):
        encode_frame({"t": "print", "msg": "x", "extra": object()})


def test_auth_helpers() -> None:
    a, b = new_nonce(), new_nonce()
    assert len(a) == NONCE_SIZE and a != b
    mac = auth_mac(b"secret", b"client", a, b)
    assert len(mac) == MAC_SIZE
    assert check_mac(mac, bytes(mac))
    assert not check_mac(mac, auth_mac(b"other", b"client", a, b))
    assert not check_mac(mac, auth_mac(b"secret", b"server", a, b))  # roles do not mix
    assert not check_mac(mac, auth_mac(b"secret", b"client", b, a))  # nonce order matters
    assert not check_mac(mac, mac.hex())
    assert not check_mac(mac, None)
    assert len(auth_mac(b"", b"client", a, b)) == MAC_SIZE  # empty secret: still a MAC


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        messages = FrameDecoder().feed(data)
    except ProtocolError:
        return
    for msg in messages:
        assert msg["t"] in MESSAGE_FIELDS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bodies(body: bytes) -> None:
    try:
        msg = decode_body(body)
    except ProtocolError:
        return
    assert msg["t"] in MESSAGE_FIELDS


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(MESSAGE_FIELDS)), st.dictionaries(st.text(max_size=10), _values,
                                                                max_size=5))
def test_fuzz_structured_maps(kind: str, fields: dict[str, Any]) -> None:
    """Well-formed msgpack with arbitrary field values: valid or ProtocolError, nothing else."""
    body_map = {**fields, "t": kind, "v": PROTOCOL_VERSION}
    try:
        msg = FrameDecoder().feed(_raw_frame(body_map))[0]
    except ProtocolError:
        return
    for name, typ in MESSAGE_FIELDS[kind].items():
        assert isinstance(msg[name], typ)


def test_progress_keeps_known_fields_and_drops_unknown_ones() -> None:
    report = {"version": 3, "seqno": 1, "calls": 40, "sent": 1 << 40, "received": 0,
              "links_reset": 1, "replayed": 2, "resumed": 0, "replaying": True,
              "newer_field": "ignored"}
    assert check_progress(report) == {k: v for k, v in report.items() if k in PROGRESS_FIELDS}
    assert check_progress({}) == {}


@pytest.mark.parametrize("bad", [
    [], "x", {"calls": -1}, {"calls": True}, {"calls": 1.5}, {"calls": 1 << 63},
    {"replaying": 1}, {"version": "3"},
])
def test_bad_progress_is_a_protocol_error(bad: object) -> None:
    with pytest.raises(ProtocolError, match=r"heartbeat\.progress"):
        check_progress(bad)


def test_messages_held_while_the_tracker_link_is_rebuilt_keep_every_control_message() -> None:
    """While a worker rejoins, prints give way to control messages once the held queue is
    full: a shutdown or an error is never dropped (finalize and signal_error wait on them)."""
    from types import SimpleNamespace  # noqa: PLC0415

    from rabit2.io import tracker_client  # noqa: PLC0415

    client = SimpleNamespace(_held=[], _dropped_prints=0, _held_print_bytes=0)
    limit = tracker_client._MAX_HELD_MESSAGES
    for i in range(limit + 5):
        tracker_client.TrackerClient._hold(client, {"t": "print", "msg": str(i)})
    assert len(client._held) == limit and client._dropped_prints == 5
    tracker_client.TrackerClient._hold(client, {"t": "error", "msg": "disk full"})
    tracker_client.TrackerClient._hold(client, {"t": "shutdown", "hold": True})
    assert len(client._held) == limit and client._dropped_prints == 7
    assert [m["t"] for m in client._held[-2:]] == ["error", "shutdown"]
    assert client._held[0]["msg"] == "2"  # (the oldest prints gave way)
    assert client._held_print_bytes == sum(len(m["msg"]) for m in client._held
                                           if m["t"] == "print")
