"""Frame headers and ERROR payloads: round trips, every rejection, and fuzzing."""

from __future__ import annotations

import itertools
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rabit2.core.framing import (
    ERROR_TYPES,
    FLAG_CHECKED,
    FRAME_MAGIC,
    HEAD_ARRAY,
    HEAD_DEVICE,
    HEAD_PICKLE,
    HEADER,
    HEADER_SIZE,
    MAX_CONTROL_PAYLOAD,
    MAX_ERROR_PAYLOAD,
    MAX_NDIM,
    NONE_U8,
    NONE_U16,
    UNKNOWN_TOTAL,
    CallDescriptor,
    CollectiveKind,
    FrameCorruptError,
    FrameHeader,
    FrameKind,
    checksum,
    decode_error,
    encode_error,
    pack_broadcast_head,
    pack_header,
    parse_header,
    shape_tag,
    unpack_broadcast_head,
    unpack_tail,
)
from rabit2.errors import ProtocolError

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


def _header(kind: FrameKind = FrameKind.DATA, ckind: CollectiveKind = CollectiveKind.BROADCAST,
            **overrides: int) -> FrameHeader:
    call = CallDescriptor(ckind, overrides.pop("dtype_code", 7), overrides.pop("op_code", 2),
                          overrides.pop("root", 3), overrides.pop("total_bytes", 4096))
    fields = {"version": 5, "seqno": 9, "offset": 128, "length": 64, "incarnation": 2}
    fields.update(overrides)
    return FrameHeader(kind, call, **fields)


def _raw(**fields: int) -> bytes:
    """A header with arbitrary raw field values (no enum validation on the packing side)."""
    values = {"magic": FRAME_MAGIC, "kind": 1, "ckind": 1, "dtype": 7, "op": 2, "root": 0,
              "version": 0, "seqno": 0, "total": 8, "offset": 0, "length": 8, "inc": 0,
              "payload_crc": 0}
    values.update(fields)
    body = HEADER.pack(*values.values())
    return body + struct.pack("<I", checksum(body))


def test_header_size_is_48() -> None:
    assert HEADER_SIZE == 48
    assert len(_header().pack()) == 48
    assert struct.unpack_from("<H", _header().pack())[0] == FRAME_MAGIC
    assert _header().pack()[:2] == b"R2"


@pytest.mark.parametrize(("kind", "ckind"), list(itertools.product(FrameKind, CollectiveKind)),
                         ids=lambda k: k.name)
def test_round_trip_every_kind(kind: FrameKind, ckind: CollectiveKind) -> None:
    length = 17 if kind is FrameKind.DATA else MAX_ERROR_PAYLOAD
    header = _header(kind, ckind, length=length)
    parsed = parse_header(header.pack())
    assert parsed == header
    assert parsed.kind is kind and parsed.call.kind is ckind
    assert parsed.call_id == (5, 9)


def test_round_trip_extreme_values() -> None:
    header = _header(FrameKind.DATA, CollectiveKind.ALLGATHER, dtype_code=NONE_U8,
                     op_code=NONE_U8, root=NONE_U16, total_bytes=U64_MAX, version=U32_MAX,
                     seqno=U32_MAX, offset=U64_MAX, length=U32_MAX, incarnation=U32_MAX)
    assert parse_header(header.pack()) == header
    zero = _header(total_bytes=0, version=0, seqno=0, offset=0, length=0, incarnation=0)
    assert parse_header(zero.pack()) == zero


@pytest.mark.parametrize("kind", list(FrameKind), ids=lambda k: k.name)
def test_pack_header_matches_dataclass(kind: FrameKind) -> None:
    for ckind in CollectiveKind:
        h = _header(kind, ckind, length=33)
        assert pack_header(h.kind, h.call, h.version, h.seqno, h.offset, h.length,
                           h.incarnation) == h.pack()
        # incarnation defaults to 0 on both sides
        h0 = _header(kind, ckind, incarnation=0)
        assert pack_header(h0.kind, h0.call, h0.version, h0.seqno, h0.offset,
                           h0.length) == h0.pack()


@pytest.mark.parametrize("container", [bytes, bytearray, memoryview])
def test_parse_accepts_every_buffer_type(container: type) -> None:
    raw = _header().pack()
    assert parse_header(container(raw)) == _header()


@pytest.mark.parametrize("size", [0, 1, 47, 49, 96])
def test_parse_rejects_wrong_length(size: int) -> None:
    data = (_header().pack() * 2)[:size]
    with pytest.raises(ProtocolError, match="48 bytes"):
        parse_header(data)


def test_payload_checksum_round_trip() -> None:
    payload = bytes(range(200))
    header = _header(length=len(payload), payload_crc=checksum(payload))
    raw = header.pack()
    assert raw[2] == FrameKind.DATA | FLAG_CHECKED  # the kind byte says it is checked
    parsed = parse_header(raw)
    assert parsed == header and parsed.payload_crc == checksum(payload)
    # CRC32C (Castagnoli), the iSCSI check value
    assert checksum(b"123456789") == 0xE3069283
    assert checksum(b"56789", checksum(b"1234")) == 0xE3069283
    unchecked = parse_header(_header().pack())
    assert unchecked.payload_crc is None and _header().pack()[2] == FrameKind.DATA


def test_a_payload_crc_without_the_checked_flag_is_refused() -> None:
    """One encoding per header: an unchecked frame's payload_crc field is 0."""
    with pytest.raises(ProtocolError, match="not checked"):
        parse_header(_raw(payload_crc=5))


def test_every_single_bit_flip_of_a_header_is_caught() -> None:
    raw = bytearray(_header(payload_crc=12345).pack())
    for bit in range(8 * HEADER_SIZE):
        damaged = bytearray(raw)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameCorruptError, match="checksum"):
            parse_header(damaged)


def test_unpack_tail_catches_every_single_bit_flip_of_a_header_inside_a_buffer() -> None:
    """The hot path reads a header where it lies in a landing buffer, not a 48-byte copy."""
    at = 13
    header = _header(payload_crc=12345).pack()
    buf = bytearray(b"\xa5" * at) + bytearray(header) + bytearray(b"\x5a" * 29)
    assert unpack_tail(buf, at) == (128, 64, 12345)
    assert unpack_tail(memoryview(buf), at) == (128, 64, 12345)
    for bit in range(8 * HEADER_SIZE):
        damaged = bytearray(buf)
        damaged[at + bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameCorruptError, match="checksum"):
            unpack_tail(damaged, at)
    # bytes around the header are none of its business
    around = bytearray(buf)
    around[at - 1] ^= 0xFF
    around[at + HEADER_SIZE] ^= 0xFF
    assert unpack_tail(around, at) == (128, 64, 12345)


@pytest.mark.parametrize("magic", [0, 0x5232, 0x3253, 0xFFFF])
def test_parse_rejects_bad_magic(magic: int) -> None:
    with pytest.raises(ProtocolError, match="magic"):
        parse_header(_raw(magic=magic))


@pytest.mark.parametrize("kind", [0, 5, 0x7F, 0xFF])
def test_parse_rejects_unknown_frame_kind(kind: int) -> None:
    with pytest.raises(ProtocolError, match="frame kind"):
        parse_header(_raw(kind=kind))


@pytest.mark.parametrize("ckind", [0, max(CollectiveKind) + 1, 0xFF])
def test_parse_rejects_unknown_collective_kind(ckind: int) -> None:
    with pytest.raises(ProtocolError, match="collective kind"):
        parse_header(_raw(ckind=ckind))


def test_parse_bounds_error_frame_length() -> None:
    assert parse_header(_raw(kind=FrameKind.ERROR, length=MAX_ERROR_PAYLOAD)).length == (
        MAX_ERROR_PAYLOAD
    )
    for length in (MAX_ERROR_PAYLOAD + 1, U32_MAX):
        with pytest.raises(ProtocolError, match="exceeds"):
            parse_header(_raw(kind=FrameKind.ERROR, length=length))
    # a CONTROL frame carries a small msgpack map, bounded the same way
    assert parse_header(_raw(kind=FrameKind.CONTROL, length=MAX_CONTROL_PAYLOAD)).length == (
        MAX_CONTROL_PAYLOAD
    )
    for length in (MAX_CONTROL_PAYLOAD + 1, U32_MAX):
        with pytest.raises(ProtocolError, match=r"control frame .* exceeds"):
            parse_header(_raw(kind=FrameKind.CONTROL, length=length))
    # a DATA frame's length is bounded by the agent against its stream, not here
    assert parse_header(_raw(kind=FrameKind.DATA, length=U32_MAX)).length == U32_MAX


def test_descriptor_describe() -> None:
    desc = CallDescriptor(CollectiveKind.ALLREDUCE_TREE, 7, 2, NONE_U16, 80)
    assert desc.describe() == "(tree allreduce, 80 B, float64, SUM)"
    bcast = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, 3, UNKNOWN_TOTAL)
    assert bcast.describe() == "(broadcast, size not known yet, root 3)"
    # (codes off the wire that no rank sends are named as codes)
    odd = CallDescriptor(CollectiveKind.ALLREDUCE_PAIR, 99, 42, NONE_U16, 8)
    assert odd.describe() == "(pair allreduce, 8 B, dtype code 99, op code 42)"


# ----------------------------------------------------------------------------- error payloads


@pytest.mark.parametrize("error_type", ERROR_TYPES)
def test_error_payload_round_trip(error_type: str) -> None:
    payload = encode_error(error_type, "rank 3 disagrees: ünïcode", 3)
    assert len(payload) <= MAX_ERROR_PAYLOAD
    assert decode_error(payload) == (error_type, "rank 3 disagrees: ünïcode", 3)
    assert decode_error(bytearray(payload)) == decode_error(memoryview(payload))


def test_error_reason_is_truncated_to_fit_a_frame() -> None:
    payload = encode_error("protocol", "x" * 100_000, 0)
    assert len(payload) <= MAX_ERROR_PAYLOAD
    error_type, reason, origin = decode_error(payload)
    assert (error_type, len(reason), origin) == ("protocol", 4096, 0)
    # a reason of multi-byte characters still fits
    assert len(encode_error("protocol", "\U0001f600" * 100_000, 0)) <= MAX_ERROR_PAYLOAD


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # the one byte msgpack never uses
        b"\x92\x01",  # truncated array
        b"\x81\xa4type",  # truncated map
        msgpack.packb({"type": "protocol", "reason": "r", "origin": 1}) + b"\x00",  # extra data
        msgpack.packb(["protocol", "r", 1]),
        msgpack.packb("protocol"),
        msgpack.packb(None),
        msgpack.packb({}),
        msgpack.packb({"type": "nonsense", "reason": "r", "origin": 1}),
        msgpack.packb({"type": "protocol", "reason": b"bytes", "origin": 1}),
        msgpack.packb({"type": "protocol", "reason": 5, "origin": 1}),
        msgpack.packb({"type": "protocol", "reason": "r", "origin": "1"}),
        msgpack.packb({"type": "protocol", "reason": "r", "origin": 1.5}),
        msgpack.packb({"type": "protocol", "reason": "r"}),
        msgpack.packb({"type": ["protocol"], "reason": "r", "origin": 1}),
        msgpack.packb({1: "protocol"}),  # non-string keys are refused by the decoder
        msgpack.packb(msgpack.ExtType(5, b"xyz")),
    ],
)
def test_decode_error_rejects_garbage(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_error(payload)


# ----------------------------------------------------------------------------- fuzzing


def _parse_or_protocol_error(data: bytes) -> FrameHeader | None:
    try:
        return parse_header(data)
    except ProtocolError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_fuzz_random_headers(data: bytes) -> None:
    header = _parse_or_protocol_error(data)
    if header is not None:
        assert header.pack() == data


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER_SIZE - 6, max_size=HEADER_SIZE - 6))
def test_fuzz_headers_with_valid_magic(rest: bytes) -> None:
    body = struct.pack("<H", FRAME_MAGIC) + rest  # and a valid header checksum
    data = body + struct.pack("<I", checksum(body))
    header = _parse_or_protocol_error(data)
    if header is not None:
        assert header.pack() == data
        assert header.kind is not FrameKind.ERROR or header.length <= MAX_ERROR_PAYLOAD


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2 * HEADER_SIZE))
def test_fuzz_any_length(data: bytes) -> None:
    header = _parse_or_protocol_error(data)
    assert header is None or len(data) == HEADER_SIZE


def _decode_or_protocol_error(payload: bytes) -> tuple[str, str, int] | None:
    try:
        return decode_error(payload)
    except ProtocolError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_error_payload_bytes(payload: bytes) -> None:
    result = _decode_or_protocol_error(payload)
    if result is not None:
        error_type, reason, origin = result
        assert error_type in ERROR_TYPES and isinstance(reason, str) and isinstance(origin, int)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8) | st.sampled_from(ERROR_TYPES),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.sampled_from(["type", "reason", "origin"]),
                      children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(_msgpack_values)
def test_fuzz_error_payload_structures(value: object) -> None:
    result = _decode_or_protocol_error(msgpack.packb(value))
    if result is not None:
        assert isinstance(value, dict)
        assert result == (value["type"], value["reason"], value["origin"])


@pytest.mark.parametrize(
    ("kind", "code", "shape", "nbytes"),
    [
        (HEAD_PICKLE, 0, (), 12345),
        (HEAD_ARRAY, 7, (3, 4), 96),
        (HEAD_ARRAY, 2, (), 1),
        (HEAD_DEVICE, 9, (1,) * MAX_NDIM, 4),
        (HEAD_ARRAY, 7, (U64_MAX, 0, 2**40), U64_MAX),
    ],
)
def test_a_broadcast_head_round_trips(kind: int, code: int, shape: tuple[int, ...],
                                      nbytes: int) -> None:
    head = pack_broadcast_head(kind, code, shape, nbytes)
    assert unpack_broadcast_head(head) == (kind, code, shape, nbytes)
    assert unpack_broadcast_head(bytes(head)) == unpack_broadcast_head(memoryview(head))


@pytest.mark.parametrize("kind", [HEAD_ARRAY, HEAD_DEVICE])
def test_a_broadcast_head_with_more_than_max_ndim_dimensions_is_refused(kind: int) -> None:
    head = pack_broadcast_head(kind, 7, (2,) * MAX_NDIM, 2**MAX_NDIM)
    assert unpack_broadcast_head(head)[2] == (2,) * MAX_NDIM
    for ndim in (MAX_NDIM + 1, 0xFF):
        head[2] = ndim  # the ndim byte, as a damaged or hostile root might send it
        with pytest.raises(ValueError, match="dimensions"):
            unpack_broadcast_head(head)


def test_the_allgather_shape_tag_is_a_fixed_function_of_the_shape() -> None:
    # pinned: the tag travels between ranks, so it may not depend on the Python that runs
    # a rank (as the hash of a tuple does)
    assert shape_tag(()) == 2612498352262937418
    assert shape_tag((3, 4)) == 5892923559969883823
    assert shape_tag((3, 4)) == shape_tag((np.int64(3), np.int32(4)))
    tags = {shape_tag(s) for s in [(), (0,), (3,), (3, 4), (4, 3), (3, 4, 1), (2**40,)]}
    assert len(tags) == 7 and all(0 <= t < 2**63 for t in tags)
