"""The endpoint's own reading and writing of the federated messages
(``rabit2.xgboost.wire``) against protobuf's: the same fields from the same bytes, the same
bytes for the same reply, and a clear error for bytes that are not a message."""

from __future__ import annotations

import pytest

pytest.importorskip("google.protobuf")

from hypothesis import given
from hypothesis import strategies as st

from rabit2.xgboost import wire
from rabit2.xgboost._proto import MESSAGES, METHODS

FIELDS = {
    "Allgather": ("sequence_number", "rank"),
    "AllgatherV": ("sequence_number", "rank"),
    "Allreduce": ("sequence_number", "rank", "data_type", "reduce_operation"),
    "Broadcast": ("sequence_number", "rank", "root"),
}
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)


def _key(number: int, kind: int) -> bytes:
    return _varint(number << 3 | kind)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# fields protobuf does not know here, or knows with another wire type: both are skipped
UNKNOWN = st.one_of(
    st.tuples(st.integers(6, 1000), st.integers(0, (1 << 64) - 1)).map(
        lambda f: _key(f[0], 0) + _varint(f[1])),
    st.tuples(st.integers(6, 1000), st.binary(max_size=20)).map(
        lambda f: _key(f[0], 2) + _varint(len(f[1])) + f[1]),
    st.tuples(st.integers(1, 1000), st.binary(min_size=8, max_size=8)).map(
        lambda f: _key(f[0], 1) + f[1]),
    st.tuples(st.integers(1, 1000), st.binary(min_size=4, max_size=4)).map(
        lambda f: _key(f[0], 5) + f[1]),
    st.just(_key(3, 0) + _varint(7)),  # send_buffer as a varint
    st.just(_key(2, 2) + _varint(2) + b"ab"),  # rank as bytes
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    method = draw(st.sampled_from(METHODS))
    message = MESSAGES[f"{method}Request"]()
    message.sequence_number = draw(st.integers(0, (1 << 64) - 1))
    message.send_buffer = draw(st.binary(max_size=300))
    for name in FIELDS[method][1:]:
        setattr(message, name, draw(INT32))
    raw = message.SerializeToString()
    extra = draw(st.lists(UNKNOWN, max_size=4))
    # unknown fields before, between (after the known ones) and after; a repeated field
    # takes its last value, as protobuf does
    raw = b"".join(extra[:1]) + raw + b"".join(extra[1:])
    if draw(st.booleans()):
        raw += _key(3, 2) + _varint(3) + b"xyz"
    return method, raw


@given(requests())
def test_a_request_reads_as_protobuf_reads_it(case: tuple[str, bytes]) -> None:
    method, raw = case
    ours = wire.reader(method)(raw)
    theirs = MESSAGES[f"{method}Request"].FromString(raw)
    for name in FIELDS[method]:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert bytes(ours.send_buffer) == theirs.send_buffer


@given(st.binary(max_size=70_000))
def test_a_reply_is_the_bytes_protobuf_writes(payload: bytes) -> None:
    serialized = wire.reply(payload)
    assert serialized == MESSAGES["AllreduceReply"](receive_buffer=payload).SerializeToString()
    assert wire.reply(bytearray(payload)) == wire.reply(memoryview(payload)) == serialized


def test_the_payload_is_a_view_of_the_received_bytes() -> None:
    raw = MESSAGES["AllreduceRequest"](send_buffer=b"\x01" * 1000, rank=1).SerializeToString()
    request = wire.reader("Allreduce")(raw)
    assert isinstance(request.send_buffer, memoryview) and request.send_buffer.obj is raw
    assert request.rank == 1 and request.data_type == 0 and request.root == 0


@pytest.mark.parametrize("raw", [
    b"\x08",  # a varint cut short
    b"\x08" + b"\xff" * 10 + b"\x01",  # a varint of eleven bytes
    b"\x1a\x05abc",  # bytes past the end
    b"\x1a\xff\xff\xff\xff\x0f",  # a length past the end
    b"\x0b",  # a group
    b"\x09\x00\x00",  # a fixed64 cut short
    b"\x00\x00",  # field number 0
])
def test_bytes_that_are_not_a_message_raise_valueerror(raw: bytes) -> None:
    with pytest.raises(ValueError, match="federated request"):
        wire.reader("Allreduce")(raw)


def test_an_unknown_method_has_no_reader() -> None:
    with pytest.raises(ValueError, match="no federated method"):
        wire.reader("Reduce")


def test_a_request_of_many_fields_is_read_by_protobuf_in_bounded_time() -> None:
    """Many tiny fields (what XGBoost never sends) go to protobuf's parser: the Python loop
    never runs long on gRPC's polling thread."""
    import time  # noqa: PLC0415

    raw = MESSAGES["AllreduceRequest"](rank=1, send_buffer=b"ab").SerializeToString()
    raw += b"\x30\x00" * (4 << 20)
    start = time.monotonic()
    request = wire.reader("Allreduce")(raw)
    assert time.monotonic() - start < 2.0
    assert request.rank == 1 and bytes(request.send_buffer) == b"ab"
