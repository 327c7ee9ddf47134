"""Reduction operators, supported dtypes and their wire codes, and the in-place reducers.

Pure: numpy and the stdlib only. The reducers run on the receive hot path (once per chunk
that arrives from a child or ring neighbour), so :func:`reduce_bytes` does no allocation
beyond two zero-copy ``np.frombuffer`` views and one ufunc call with ``out=``.

Two rules keep results bit-identical with what a C reducer would produce:

* the dtype is never promoted: every ufunc runs with ``out=dst, casting="no"``, so int8
  sums wrap like C int8 and float16 stays float16 (``np.add.reduce`` would widen ints);
* the caller fixes the reduction order (the schedule does); integer ops are associative
  and commutative even with wrap-around, floating point ops are not.

Wire codes for dtypes (stable; never renumber, only append). Codes 0..7 are classic rabit's
``DataType`` enum; 8 and 9 were rabit's ``kLongLong``/``kULongLong`` (the same layout as
int64/uint64 on LP64) and are left unassigned so that no code means two things:

====  =========
code  dtype
====  =========
0     int8
1     uint8
2     int32
3     uint32
4     int64
5     uint64
6     float32
7     float64
10    int16
11    uint16
12    float16
====  =========
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from rabit2.errors import ProtocolError

__all__ = [
    "SUPPORTED_DTYPES",
    "Op",
    "apply",
    "as_op",
    "check_op_dtype",
    "dtype_code",
    "dtype_from_code",
    "reduce_bytes",
    "reduce_bytes_ordered",
    "reduce_into",
]


class Op(enum.IntEnum):
    """Element-wise reduction operators. Codes 0..3 are classic rabit's ``OpType``.

    :func:`rabit2.allreduce` takes a member, its integer code (not a ``bool``), its name in any case
    (``"sum"``) or a member of another enum such as XGBoost's ``collective.Op``, matched by
    name (``BITWISE_OR`` is ``BITOR``); anything else raises ``ValueError``.  The bitwise
    operators (``BITOR``, ``BITAND``, ``BITXOR``) take integer dtypes only: on a floating
    point array they raise ``TypeError``.  Both before anything is sent.
    """

    MAX = 0
    MIN = 1
    SUM = 2
    BITOR = 3
    OR = 3  # (xgboost.rabit 1.x's name of BITOR: an alias)
    PROD = 4
    BITAND = 5
    BITXOR = 6


_CODE_TO_DTYPE: Mapping[int, np.dtype] = MappingProxyType(
    {
        0: np.dtype(np.int8),
        1: np.dtype(np.uint8),
        2: np.dtype(np.int32),
        3: np.dtype(np.uint32),
        4: np.dtype(np.int64),
        5: np.dtype(np.uint64),
        6: np.dtype(np.float32),
        7: np.dtype(np.float64),
        10: np.dtype(np.int16),
        11: np.dtype(np.uint16),
        12: np.dtype(np.float16),
    }
)

# Keyed by (kind, itemsize) rather than by dtype so that aliases of one layout ('l' and 'q'
# on LP64, '<i4' and 'i4' on little-endian hosts) all resolve to the same canonical dtype.
_LAYOUT_TO_CODE: Mapping[tuple[str, int], int] = MappingProxyType(
    {(dt.kind, dt.itemsize): code for code, dt in _CODE_TO_DTYPE.items()}
)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in (
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)
"""Every dtype a collective accepts, in native byte order."""

_SUPPORTED_SET: frozenset[np.dtype] = frozenset(SUPPORTED_DTYPES)

# A plain (private) dict rather than a MappingProxyType: it is probed once per received
# chunk and the proxy adds an indirection.
_UFUNC_BY_OP: dict[Op, np.ufunc] = {
    Op.MAX: np.maximum,
    Op.MIN: np.minimum,
    Op.SUM: np.add,
    Op.PROD: np.multiply,
    Op.BITOR: np.bitwise_or,
    Op.BITAND: np.bitwise_and,
    Op.BITXOR: np.bitwise_xor,
}

_BITWISE_OPS = frozenset({Op.BITOR, Op.BITAND, Op.BITXOR})

# Names accepted by as_op, upper-cased. Besides our own member names: xgboost >= 2.0 spells
# the bitwise ops BITWISE_*, and xgboost.rabit 1.x called BITOR just OR.
_OP_NAMES: Mapping[str, Op] = MappingProxyType(
    {
        **{member.name: member for member in Op},
        "OR": Op.BITOR,
        "BITWISE_OR": Op.BITOR,
        "BITWISE_AND": Op.BITAND,
        "BITWISE_XOR": Op.BITXOR,
    }
)


def _canonical_dtype(dtype: object) -> np.dtype:
    """Return the supported dtype equal in layout to ``dtype``, or raise ``TypeError``."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]  # validated right here
    except TypeError as exc:
        raise TypeError(f"not a numpy dtype: {dtype!r}") from exc
    if dt.fields is not None or dt.subdtype is not None:
        raise TypeError(f"structured and subarray dtypes are not supported: {dt}")
    if not dt.isnative:
        raise TypeError(f"dtype {dt.str} is not in native byte order; convert it first")
    code = _LAYOUT_TO_CODE.get((dt.kind, dt.itemsize))
    if code is None:
        raise TypeError(
            f"unsupported dtype {dt}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    canonical = _CODE_TO_DTYPE[code]
    # Same kind and size but a different type (e.g. an 8-byte longdouble) is still refused:
    # numpy would not treat it as interchangeable with the canonical dtype in ufunc loops.
    if dt != canonical:
        raise TypeError(f"unsupported dtype {dt}")
    return canonical


def dtype_code(dtype: np.dtype) -> int:
    """Return the stable wire code of ``dtype`` (see the module docstring for the table).

    Raises:
        TypeError: ``dtype`` is not one of :data:`SUPPORTED_DTYPES` (or an alias of one).
    """
    cacheable = isinstance(dtype, np.dtype)
    code = _CODE_OF.get(dtype) if cacheable else None  # (the validation is the slow part)
    if code is None:
        canonical = _canonical_dtype(dtype)
        code = _LAYOUT_TO_CODE[(canonical.kind, canonical.itemsize)]
        if cacheable:
            _CODE_OF[dtype] = code
    return code


_CODE_OF: dict[np.dtype, int] = {}  # dtypes seen by dtype_code (only supported ones)


def dtype_from_code(code: int) -> np.dtype:
    """Return the dtype for a wire ``code``.

    Raises:
        ProtocolError: the code is not in the table. It came off the wire, so an unknown
            value means the peer speaks something else, not that our caller erred.
    """
    try:
        return _CODE_TO_DTYPE[code]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown dtype code {code!r}") from None


def as_op(op: object) -> Op:
    """Normalise ``op`` to an :class:`Op`.

    Accepts an :class:`Op`; an int code 0..6 (``bool`` is refused: ``True`` would silently
    mean MIN); a name in any case (``"sum"``, ``"MAX"``, ``"bitor"``, xgboost's
    ``"BITWISE_OR"``/``"BITWISE_AND"``/``"BITWISE_XOR"``, xgboost.rabit's ``"OR"``); or a
    member of another enum (xgboost's ``collective.Op``), matched **by name**, because its
    integer values disagree with ours (xgboost 2.x has BITWISE_AND = 3, we have BITOR = 3).

    Raises:
        ValueError: anything else, including out-of-range codes and unknown names.
    """
    if isinstance(op, Op):
        return op
    if isinstance(op, enum.Enum):
        op = op.name
    if isinstance(op, str):
        try:
            return _OP_NAMES[op.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown reduction op {op!r}; use one of "
                             f"{', '.join(_OP_NAMES)}") from None
    if not isinstance(op, bool):
        try:
            return Op(operator.index(op))  # type: ignore[arg-type]  # guarded by except
        except (TypeError, ValueError):
            pass
    raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(_OP_NAMES)}")


def check_op_dtype(op: object, dtype: np.dtype) -> tuple[Op, np.dtype]:
    """Validate an (op, dtype) pair before any byte is sent; return the normalised pair.

    Raises:
        ValueError: ``op`` is not a known operator (see :func:`as_op`).
        TypeError: ``dtype`` is unsupported (bool, complex, object, float128, non-native
            byte order, structured, ...), or ``op`` is bitwise and ``dtype`` is floating.
    """
    normalised = as_op(op)
    canonical = _canonical_dtype(dtype)
    if normalised in _BITWISE_OPS and canonical.kind == "f":
        raise TypeError(
            f"{normalised.name} is a bitwise op and needs an integer dtype, not {canonical}"
        )
    return normalised, canonical


def reduce_into(op: Op, dst: np.ndarray, src: np.ndarray) -> None:
    """Set ``dst[...] = op(dst, src)`` element-wise, in place, in ``dst``'s dtype.

    ``dst`` and ``src`` must be 1-D arrays of one supported dtype and one length; ``dst``
    must be writeable. ``op`` should have passed :func:`check_op_dtype` with that dtype.
    Floating point overflow and invalid operations produce IEEE results (inf/nan) whatever
    ``np.errstate`` says (:func:`apply`); integers wrap.

    Raises:
        ValueError: unknown ``op``, shapes that are not 1-D and equal, read-only ``dst``.
        TypeError: dtypes differ or are unsupported, or a bitwise op on a float dtype.
    """
    if dst.dtype != src.dtype:
        raise TypeError(f"dtype mismatch: dst is {dst.dtype}, src is {src.dtype}")
    if dst.ndim != 1 or dst.shape != src.shape:
        raise ValueError(f"need two 1-D arrays of one length, got {dst.shape} and {src.shape}")
    if dst.dtype not in _SUPPORTED_SET:
        raise TypeError(f"unsupported dtype {dst.dtype}")
    apply(ufunc_of(op), dst, src, dst)


def apply(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = ufunc(a, b)``, the reduction step of every path, whatever ``np.errstate`` the
    thread has (a caller's, or the one an asyncio callback inherited from the thread that
    scheduled it).  numpy signals an invalid or overflowing float operation (inf - inf) only
    once the whole result is made, and the result is the IEEE one: under ``raise`` (or a
    warnings filter that makes its ``RuntimeWarning`` an error) the signal is dropped here,
    since an exception midway through a call would leave the other ranks waiting for bytes
    that never come.  Under numpy's default (``warn``) the warning shows as numpy's own do.
    (Entering ``np.errstate`` on every call instead cost 4 us a call on a 2-vCPU VM.)"""
    try:  # noqa: SIM105 (contextlib.suppress costs a context manager per step)
        ufunc(a, b, out=out, casting="no")
    except (FloatingPointError, RuntimeWarning):
        pass


def reduce_bytes(
    op: Op,
    dtype: np.dtype,
    dst: memoryview | bytearray | np.ndarray,
    src: memoryview | bytes | np.ndarray,
) -> None:
    """Reduce the raw buffer ``src`` into the writeable raw buffer ``dst`` as ``dtype`` elements.

    Both buffers are reinterpreted in place (zero copy) and must be C-contiguous, of equal
    byte length, a multiple of ``dtype.itemsize``. Misaligned start addresses are fine
    (numpy handles them, a little slower). Same numeric semantics as :func:`reduce_into`.

    Raises:
        ValueError: unknown ``op``; a length that is not a multiple of the item size;
            lengths that differ; a non-contiguous or read-only ``dst``.
        TypeError: ``dtype`` unsupported, or a bitwise op on a float dtype.
    """
    # Hot path (once per received chunk): two set/dict probes, two zero-copy views, one
    # ufunc call; the full check_op_dtype ran once when the collective started.
    if dtype not in _SUPPORTED_SET:
        raise TypeError(f"unsupported dtype {dtype}")
    ufunc = _UFUNC_BY_OP.get(op)
    if ufunc is None:
        raise ValueError(f"unknown reduction op {op!r}")
    # np.frombuffer itself raises ValueError for a length that is not a multiple of the
    # item size and for a non-contiguous exporter; the views are writeable iff the
    # exporter is, which is how a read-only dst is caught below.
    try:
        target = np.frombuffer(dst, dtype=dtype)
        source = np.frombuffer(src, dtype=dtype)
    except BufferError as exc:  # a strided memoryview refuses a contiguous export
        raise ValueError(f"buffers must be C-contiguous: {exc}") from None
    if target.size != source.size:
        raise ValueError(f"buffer lengths differ: dst {target.nbytes}, src {source.nbytes}")
    if not target.flags.writeable:
        raise ValueError("dst buffer is read-only")
    apply(ufunc, target, source, target)


def reduce_bytes_ordered(
    op: Op,
    dtype: np.dtype,
    dst: memoryview | bytearray | np.ndarray,
    first: memoryview | bytes | np.ndarray,
    second: memoryview | bytes | np.ndarray,
) -> None:
    """``dst = op(first, second)`` on raw buffers, operands in this order (``dst`` may alias
    either).  Two ranks that reduce the same pair in the same order get the same bits even
    where ``op(a, b)`` and ``op(b, a)`` could differ (e.g. which NaN payload survives).
    Same errors as :func:`reduce_bytes`.
    """
    if dtype not in _SUPPORTED_SET:
        raise TypeError(f"unsupported dtype {dtype}")
    ufunc = ufunc_of(op)
    try:
        out = np.frombuffer(dst, dtype=dtype)
        a = np.frombuffer(first, dtype=dtype)
        b = np.frombuffer(second, dtype=dtype)
    except BufferError as exc:
        raise ValueError(f"buffers must be C-contiguous: {exc}") from None
    if not out.size == a.size == b.size:
        raise ValueError("buffer lengths differ")
    if not out.flags.writeable:
        raise ValueError("dst buffer is read-only")
    apply(ufunc, a, b, out)


def ufunc_of(op: Op) -> np.ufunc:
    """The numpy ufunc that reduces with ``op`` (ValueError for an unknown op)."""
    ufunc = _UFUNC_BY_OP.get(op)
    if ufunc is None:
        raise ValueError(f"unknown reduction op {op!r}")
    return ufunc
