"""Reduction ops: numeric results vs numpy, dtype preservation, validation, wire codes."""

from __future__ import annotations

import enum
import itertools
import re
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rabit2.core.ops import (
    SUPPORTED_DTYPES,
    Op,
    apply,
    as_op,
    check_op_dtype,
    dtype_code,
    dtype_from_code,
    reduce_bytes,
    reduce_bytes_ordered,
    reduce_into,
    ufunc_of,
)
from rabit2.errors import ProtocolError

NUMPY_UFUNC = {
    Op.MAX: np.maximum,
    Op.MIN: np.minimum,
    Op.SUM: np.add,
    Op.PROD: np.multiply,
    Op.BITOR: np.bitwise_or,
    Op.BITAND: np.bitwise_and,
    Op.BITXOR: np.bitwise_xor,
}
BITWISE = {Op.BITOR, Op.BITAND, Op.BITXOR}
INTEGER_DTYPES = [dt for dt in SUPPORTED_DTYPES if dt.kind in "iu"]
FLOAT_DTYPES = [dt for dt in SUPPORTED_DTYPES if dt.kind == "f"]
VALID_PAIRS = [
    (op, dt)
    for op, dt in itertools.product(Op, SUPPORTED_DTYPES)
    if not (op in BITWISE and dt.kind == "f")
]
OTHER_ENDIAN = ">" if sys.byteorder == "little" else "<"


def random_array(rng: np.random.Generator, dtype: np.dtype, size: int) -> np.ndarray:
    """Full-range integers (so SUM/PROD overflow and wrap); floats with inf/nan/-0.0 mixed in."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=size, dtype=dtype, endpoint=True)
    values = rng.standard_normal(size) * 100
    values[:4] = [np.inf, -np.inf, np.nan, -0.0]
    return values.astype(dtype)


def test_codes_match_classic_rabit() -> None:
    assert [int(op) for op in (Op.MAX, Op.MIN, Op.SUM, Op.BITOR)] == [0, 1, 2, 3]
    classic = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float32", "float64"]
    assert [dtype_code(np.dtype(name)) for name in classic] == list(range(8))


@pytest.mark.parametrize(("op", "dtype"), VALID_PAIRS, ids=lambda v: getattr(v, "name", str(v)))
def test_reduce_matches_numpy_and_keeps_dtype(op: Op, dtype: np.dtype) -> None:
    rng = np.random.default_rng(1234)
    dst = random_array(rng, dtype, 257)
    src = random_array(rng, dtype, 257)
    with np.errstate(all="ignore"):
        expected = NUMPY_UFUNC[op](dst, src)
        assert expected.dtype == dtype  # the reference itself did not promote

        in_place = dst.copy()
        reduce_into(op, in_place, src)
        raw = bytearray(dst.tobytes())
        reduce_bytes(op, dtype, raw, src.tobytes())
        ordered = bytearray(len(raw))
        reduce_bytes_ordered(op, dtype, ordered, dst.tobytes(), src.tobytes())
        aliased = bytearray(src.tobytes())  # dst may alias the second operand
        reduce_bytes_ordered(op, dtype, aliased, dst.tobytes(), aliased)
        by_ufunc = np.empty_like(dst)
        apply(ufunc_of(op), dst, src, by_ufunc)
    assert ufunc_of(op) is NUMPY_UFUNC[op]
    assert in_place.dtype == dtype
    assert in_place.tobytes() == expected.tobytes()
    assert bytes(raw) == expected.tobytes()
    assert bytes(ordered) == expected.tobytes()
    assert bytes(aliased) == expected.tobytes()
    assert by_ufunc.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    ("dtype", "op", "left", "right", "result"),
    [
        ("int8", Op.SUM, 127, 1, -128),
        ("uint8", Op.SUM, 255, 1, 0),
        ("int16", Op.PROD, 300, 300, 90000 - 65536 * 1),
        ("uint64", Op.SUM, 2**64 - 1, 2, 1),
        ("int64", Op.PROD, 2**62, 4, 0),
        ("uint32", Op.BITXOR, 0xFFFF0000, 0x0F0F0F0F, 0xF0F00F0F),
    ],
)
def test_integer_overflow_wraps(dtype: str, op: Op, left: int, right: int, result: int) -> None:
    dst = np.array([left], dtype=dtype)
    reduce_into(op, dst, np.array([right], dtype=dtype))
    assert dst.dtype == np.dtype(dtype)
    assert int(dst[0]) == result


def test_float16_stays_float16() -> None:
    dst = np.array([60000, 1.0, 0.1], dtype=np.float16)
    with np.errstate(over="ignore"):
        reduce_into(Op.SUM, dst, np.array([60000, 2.0, 0.2], dtype=np.float16))
    assert dst.dtype == np.float16
    assert np.isinf(dst[0])
    assert dst[1] == np.float16(3.0)
    assert dst[2] == np.float16(0.1) + np.float16(0.2)  # rounded in float16, not float32


@pytest.mark.parametrize("errstate", ["raise", "warn"])
def test_float_errors_in_a_reduction_give_ieee_results_whatever_the_errstate(
    errstate: str,
) -> None:
    """inf - inf and float16 overflow never raise midway through a call, on any path."""
    left = np.array([np.inf, 6e4], dtype=np.float16)
    right = np.array([-np.inf, 6e4], dtype=np.float16)
    f16 = np.dtype(np.float16)
    with np.errstate(all="ignore"):
        expected = np.add(left, right).tobytes()
    assert np.isnan(np.frombuffer(expected, f16)[0]) and np.frombuffer(expected, f16)[1] == np.inf
    with warnings.catch_warnings(), np.errstate(all=errstate):  # type: ignore[arg-type]
        warnings.simplefilter("error", RuntimeWarning)
        in_place = left.copy()
        reduce_into(Op.SUM, in_place, right)
        raw = bytearray(left.tobytes())
        reduce_bytes(Op.SUM, f16, raw, right.tobytes())
        ordered = bytearray(len(raw))
        reduce_bytes_ordered(Op.SUM, f16, ordered, left.tobytes(), right.tobytes())
        out = np.empty_like(left)
        apply(ufunc_of(Op.SUM), left, right, out)
    assert in_place.tobytes() == expected
    assert bytes(raw) == expected
    assert bytes(ordered) == expected
    assert out.tobytes() == expected


def test_reduce_bytes_on_memoryview_slices_and_arrays() -> None:
    values = np.arange(8, dtype=np.int32)
    backing = bytearray(4 + values.nbytes)  # offset 4: a slice into a larger receive buffer
    view = memoryview(backing)[4:]
    view[:] = values.tobytes()
    reduce_bytes(Op.SUM, np.dtype(np.int32), view, memoryview(values.tobytes()))
    assert np.frombuffer(view, dtype=np.int32).tolist() == (values * 2).tolist()

    dst = np.ones(4, dtype=np.float64)
    reduce_bytes(Op.MAX, np.dtype(np.float64), dst, np.full(4, 3.0))
    assert dst.tolist() == [3.0] * 4

    odd = bytearray(1 + values.nbytes)  # misaligned start address still works
    odd_view = memoryview(odd)[1:]
    reduce_bytes(Op.BITOR, np.dtype(np.int32), odd_view, values.tobytes())
    assert np.frombuffer(odd_view, dtype=np.int32).tolist() == values.tolist()


@pytest.mark.parametrize("length", [1, 3, 5, 7, 9])
def test_reduce_bytes_rejects_partial_elements(length: int) -> None:
    with pytest.raises(ValueError):
        reduce_bytes(Op.SUM, np.dtype(np.float64), bytearray(length), bytes(length))


def test_reduce_bytes_rejects_bad_buffers() -> None:
    dt = np.dtype(np.int32)
    with pytest.raises(ValueError, match="differ"):
        reduce_bytes(Op.SUM, dt, bytearray(8), bytes(16))
    with pytest.raises(ValueError, match="read-only"):
        reduce_bytes(Op.SUM, dt, bytes(8), bytes(8))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reduce_bytes(Op.SUM, dt, memoryview(bytearray(16))[::2], bytes(8))
    with pytest.raises(ValueError):
        reduce_bytes(Op.SUM, dt, np.zeros(4, dtype=np.int32)[::2], bytes(8))
    with pytest.raises(TypeError):
        reduce_bytes(Op.SUM, np.dtype(np.complex64), bytearray(8), bytes(8))
    with pytest.raises(TypeError):
        reduce_bytes(Op.BITOR, np.dtype(np.float32), bytearray(8), bytes(8))
    with pytest.raises(ValueError):
        reduce_bytes(7, dt, bytearray(8), bytes(8))  # type: ignore[arg-type]


@pytest.mark.parametrize("op", [Op.MAX, Op.MIN, Op.SUM])
def test_reduce_bytes_ordered_keeps_its_operand_order(op: Op) -> None:
    """Which NaN payload or signed zero survives depends on the order; the pair schedule
    relies on both ranks reducing (first, second) in one order."""
    dt = np.dtype(np.float64)
    first = np.array([-0.0, 0.0] * 4 + [np.nan] * 8)
    second = np.array([0.0, -0.0] * 4 + [np.nan] * 8)
    first.view(np.uint64)[8:] |= 1  # two NaNs that differ only in their payloads
    second.view(np.uint64)[8:] |= 2
    with np.errstate(all="ignore"):
        forward, backward = NUMPY_UFUNC[op](first, second), NUMPY_UFUNC[op](second, first)
    if forward.tobytes() == backward.tobytes():  # (numpy's loops on this platform)
        pytest.skip("numpy gives the same bits in either order here: nothing to tell apart")
    out = bytearray(first.nbytes)
    reduce_bytes_ordered(op, dt, out, first.tobytes(), second.tobytes())
    assert bytes(out) == forward.tobytes()
    reduce_bytes_ordered(op, dt, out, second.tobytes(), first.tobytes())
    assert bytes(out) == backward.tobytes()


def test_reduce_bytes_ordered_rejects_bad_buffers() -> None:
    dt = np.dtype(np.int32)
    # a one-element operand would broadcast in numpy; on the wire it is a length mismatch
    for dst, first, second in [(16, 4, 16), (16, 16, 4), (4, 16, 16), (8, 8, 16)]:
        with pytest.raises(ValueError, match="differ"):
            reduce_bytes_ordered(Op.SUM, dt, bytearray(dst), bytes(first), bytes(second))
    with pytest.raises(ValueError, match="read-only"):
        reduce_bytes_ordered(Op.SUM, dt, bytes(8), bytes(8), bytes(8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        reduce_bytes_ordered(Op.SUM, dt, memoryview(bytearray(16))[::2], bytes(8), bytes(8))
    with pytest.raises(ValueError):
        reduce_bytes_ordered(Op.SUM, dt, bytearray(8), bytes(7), bytes(8))
    with pytest.raises(TypeError):
        reduce_bytes_ordered(Op.SUM, np.dtype(np.complex64), bytearray(8), bytes(8), bytes(8))
    with pytest.raises(ValueError, match=re.escape("unknown reduction op 7")):
        reduce_bytes_ordered(7, dt, bytearray(8), bytes(8), bytes(8))  # type: ignore[arg-type]


@pytest.mark.parametrize("op", [7, -1, "sum", None])
def test_ufunc_of_an_unknown_op_raises_value_error(op: object) -> None:
    with pytest.raises(ValueError, match="unknown reduction op"):
        ufunc_of(op)  # type: ignore[arg-type]


def test_reduce_into_rejects_bad_arrays() -> None:
    with pytest.raises(TypeError):
        reduce_into(Op.SUM, np.zeros(2, np.int32), np.zeros(2, np.int64))
    with pytest.raises(ValueError):
        reduce_into(Op.SUM, np.zeros(2, np.int32), np.zeros(3, np.int32))
    with pytest.raises(ValueError):
        reduce_into(Op.SUM, np.zeros((2, 2), np.int32), np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError):
        reduce_into(Op.SUM, np.zeros(2, np.complex128), np.zeros(2, np.complex128))
    readonly = np.zeros(2, np.int32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError):
        reduce_into(Op.SUM, readonly, np.zeros(2, np.int32))


@pytest.mark.parametrize(
    "dtype",
    [
        np.bool_,
        np.complex64,
        np.complex128,
        object,
        np.longdouble,
        "datetime64[s]",
        "U4",
        "S4",
        "i4,i4",
        ("i4", (2,)),
        np.dtype(OTHER_ENDIAN + "i4"),
        np.dtype(OTHER_ENDIAN + "f8"),
        "not-a-dtype",
    ],
    ids=str,
)
def test_unsupported_dtypes_raise_type_error(dtype: object) -> None:
    with pytest.raises(TypeError):
        check_op_dtype("sum", dtype)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dtype_code(dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(BITWISE))
def test_bitwise_on_float_raises_type_error(op: Op, dtype: np.dtype) -> None:
    with pytest.raises(TypeError):
        check_op_dtype(op, dtype)
    with pytest.raises(TypeError):
        reduce_into(op, np.zeros(2, dtype), np.zeros(2, dtype))


def test_check_op_dtype_normalises() -> None:
    native_int32 = np.dtype("i4").newbyteorder("=")
    assert check_op_dtype("Sum", native_int32) == (Op.SUM, np.dtype(np.int32))
    assert check_op_dtype(3, np.dtype("q")) == (Op.BITOR, np.dtype(np.int64))
    assert check_op_dtype(Op.MAX, "float16") == (Op.MAX, np.dtype(np.float16))  # type: ignore[arg-type]
    for op, dtype in VALID_PAIRS:
        assert check_op_dtype(op, dtype) == (op, dtype)


class XgboostOp(enum.IntEnum):
    """xgboost>=2.0's collective.Op: same names, different numbers from ours."""

    MAX = 0
    MIN = 1
    SUM = 2
    BITWISE_AND = 3
    BITWISE_OR = 4
    BITWISE_XOR = 5


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        (Op.PROD, Op.PROD),
        (0, Op.MAX),
        (6, Op.BITXOR),
        (np.int64(2), Op.SUM),
        ("sum", Op.SUM),
        ("SUM", Op.SUM),
        (" max ", Op.MAX),
        ("min", Op.MIN),
        ("prod", Op.PROD),
        ("bitor", Op.BITOR),
        ("OR", Op.BITOR),
        ("BITWISE_OR", Op.BITOR),
        ("bitwise_and", Op.BITAND),
        ("BITWISE_XOR", Op.BITXOR),
        (XgboostOp.BITWISE_AND, Op.BITAND),  # by name, not by value 3 (= our BITOR)
        (XgboostOp.SUM, Op.SUM),
    ],
)
def test_as_op_spellings(spelling: object, expected: Op) -> None:
    assert as_op(spelling) is expected


@pytest.mark.parametrize("spelling", [7, -1, True, False, 2.0, None, "avg", "", b"sum", [2]])
def test_unknown_op_raises_value_error(spelling: object) -> None:
    with pytest.raises(ValueError):
        as_op(spelling)
    with pytest.raises(ValueError):
        check_op_dtype(spelling, np.dtype(np.int32))


def test_dtype_code_round_trip() -> None:
    codes = [dtype_code(dt) for dt in SUPPORTED_DTYPES]
    assert len(set(codes)) == len(SUPPORTED_DTYPES)
    for dt, code in zip(SUPPORTED_DTYPES, codes, strict=True):
        assert dtype_from_code(code) == dt
        assert dtype_from_code(code).isnative
    assert dtype_code(np.dtype("int16")) == 10
    assert dtype_code(np.dtype("uint16")) == 11
    assert dtype_code(np.dtype("float16")) == 12


@pytest.mark.parametrize("code", [-1, 8, 9, 13, 255, 2**31 - 1])
def test_unknown_code_is_protocol_error(code: int) -> None:
    with pytest.raises(ProtocolError):
        dtype_from_code(code)


# Property tests: the tree/ring schedules reduce contributions in an order fixed by the
# topology, not by rank. For integers any order must give the same bytes (so the result
# does not depend on which child answered first); for floats a fixed order must give
# identical bytes every time (so every rank can trust the single computed result).


@st.composite
def contributions(draw: st.DrawFn, dtypes: list[np.dtype]) -> tuple[np.dtype, list[np.ndarray]]:
    dtype = draw(st.sampled_from(dtypes))
    count = draw(st.integers(min_value=1, max_value=6))
    length = draw(st.integers(min_value=0, max_value=24))
    elements = (
        hnp.from_dtype(dtype, allow_nan=True, allow_infinity=True) if dtype.kind == "f" else None
    )
    arrays = [draw(hnp.arrays(dtype, length, elements=elements)) for _ in range(count)]
    return dtype, arrays


def fold(op: Op, dtype: np.dtype, arrays: list[np.ndarray]) -> bytes:
    accumulator = bytearray(arrays[0].tobytes())
    with np.errstate(all="ignore"):
        for array in arrays[1:]:
            reduce_bytes(op, dtype, accumulator, array.tobytes())
    return bytes(accumulator)


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    case=contributions(INTEGER_DTYPES),
    data=st.data(),
)
def test_integer_reduction_is_order_independent(
    op: Op, case: tuple[np.dtype, list[np.ndarray]], data: st.DataObject
) -> None:
    dtype, arrays = case
    shuffled = data.draw(st.permutations(arrays))
    assert fold(op, dtype, shuffled) == fold(op, dtype, arrays)


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from([op for op in Op if op not in BITWISE]),
    case=contributions(FLOAT_DTYPES),
)
def test_float_reduction_in_fixed_order_is_deterministic(
    op: Op, case: tuple[np.dtype, list[np.ndarray]]
) -> None:
    dtype, arrays = case
    first = fold(op, dtype, arrays)
    again = fold(op, dtype, [array.copy() for array in arrays])
    assert first == again
    with np.errstate(all="ignore"):
        expected = arrays[0].copy()
        for array in arrays[1:]:
            expected = NUMPY_UFUNC[op](expected, array)
    assert expected.dtype == dtype
    assert first == expected.tobytes()
