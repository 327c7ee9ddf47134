"""The ring pass that the ring allreduce and the ring allgather share: each rank forwards
what it received (after reducing it, or copying it into place) to its ring predecessor."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from rabit2.core import schedule
from rabit2.core.ops import Op, reduce_bytes
from rabit2.core.schedule import Plan, Stream


class _CyclicStream(Stream):
    """An in-stream whose first ``cyclic`` bytes land round and round in ``ring`` (byte
    ``p`` at ``ring[p % len(ring)]``) and the rest in ``pieces``.  A view never reaches a
    byte that the plan has not processed yet: the plan keeps ``processed`` up to date
    (the stream holds no reference to the plan, so that a finished plan, and the arrays
    it views, are freed at once rather than by the cycle collector)."""

    __slots__ = ("cyclic", "processed", "ring")

    def __init__(self, ring: memoryview, cyclic: int, rest: Sequence[memoryview]) -> None:
        super().__init__(rest)
        self.ring, self.cyclic = ring, cyclic
        self.length += cyclic
        self.processed = 0

    def view(self, pos: int, max_len: int) -> memoryview:
        cyclic = self.cyclic
        if pos >= cyclic:
            return super().view(pos - cyclic, max_len)
        size = len(self.ring)
        at = pos % size
        room = min(max_len, size - at, cyclic - pos, self.processed + size - pos)
        return self.ring[at : at + room]

    def views(self, start: int, end: int) -> list[memoryview]:  # pragma: no cover
        raise NotImplementedError("an in-stream's landing bytes are never sent")


class RingChain(Plan):
    """A ring pass where out-piece ``j`` (``j >= 1``) forwards in-piece ``j - 1``.

    Data flows from rank ``r + 1`` to rank ``r`` (receive from ``ring_next``, send to
    ``ring_prev``), as in classic rabit.  An in-piece is ``(landing, target, reduce)``: with
    a target, it lands in scratch and is reduced into (``reduce``) or copied to (not
    ``reduce``: staged, one whole element at a time) its place in ``buf``; without one it
    lands in ``buf`` directly.  An out byte is ready once the in byte it forwards has been
    processed (received, and reduced or copied if needed).
    """

    def __init__(
        self,
        buf: memoryview,
        prev: int,
        nxt: int,
        in_pieces: Sequence[tuple[memoryview | int, memoryview | None, bool]],
        out_pieces: Sequence[memoryview],
        dtype: np.dtype | None = None,
        op: Op | None = None,
        ring: memoryview | None = None,
    ) -> None:
        """An in-piece's landing is a view, or (only for leading pieces, with ``ring``) its
        length in bytes: those pieces land in the cyclic buffer ``ring``."""
        super().__init__()
        self.buf, self.dtype, self.op = buf, dtype, op
        self.prev, self.next = prev, nxt
        # (landing view or None: in the ring, length, target or None, reduce?) for every
        # non-empty piece, in stream order
        self._ins: list[tuple[memoryview | None, int, memoryview | None, bool]] = []
        for land, target, reduce in in_pieces:
            size = land if isinstance(land, int) else len(land)
            if size:
                self._ins.append((None if isinstance(land, int) else land, size, target,
                                  reduce))
        self._in_starts: list[int] = []
        total = cyclic = 0
        for landing, size, _, _ in self._ins:
            self._in_starts.append(total)
            total += size
            if landing is None:
                assert cyclic == total - size, "ring pieces come first"
                cyclic = total
        self._ring = ring
        self._first_out = len(out_pieces[0]) if out_pieces else 0
        rest = [land for land, _, _, _ in self._ins if land is not None]
        self._cyclic: _CyclicStream | None = None
        if cyclic:
            # (room to make progress: bytes wait unreduced only below MIN_RING_REDUCE)
            assert ring is not None and len(ring) >= min(cyclic, 2 * schedule.MIN_RING_REDUCE)
            if dtype is not None:
                assert len(ring) % dtype.itemsize == 0  # no element straddles the wrap
            self._cyclic = _CyclicStream(ring, cyclic, rest)
        in_stream = self._cyclic if self._cyclic is not None else Stream(rest)
        self._set_streams({nxt: in_stream}, {prev: Stream(out_pieces)})
        self.processed = 0
        self._piece = 0  # index of the in-piece that holds ``processed``
        # in-pieces whose result bytes are also copied, as they are made, to a view of the
        # buffer kept for replays (RingAllreduce with ``keep``): index -> that view
        self._mirrors: dict[int, memoryview] = {}

    def _landing(self, piece: int, lo: int, hi: int) -> list[tuple[int, int, memoryview]]:
        """Where bytes ``[lo, hi)`` of reduce piece ``piece`` landed in the ring:
        ``(lo', hi', view)`` parts (two where it wraps)."""
        ring = self._ring
        assert ring is not None and self._ins[piece][0] is None  # (reduce pieces: the ring)
        size = len(ring)
        start = self._in_starts[piece]
        parts = []
        while lo < hi:
            at = (start + lo) % size
            n = min(hi - lo, size - at)
            parts.append((lo, lo + n, ring[at : at + n]))
            lo += n
        return parts

    def _reduce_mirrored(self, target: memoryview, land: memoryview, mirror: memoryview,
                         lo: int, hi: int) -> None:
        """Reduce ``land`` (bytes ``[lo, hi)`` of the piece) into ``target`` and copy each
        step of the result to ``mirror`` while it is still in the cache (one pass over
        memory instead of two)."""
        assert self.op is not None and self.dtype is not None
        step = schedule.MIRROR_STEP - schedule.MIRROR_STEP % self.dtype.itemsize
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            reduce_bytes(self.op, self.dtype, target[a:b], land[a - lo : b - lo])
            mirror[a:b] = target[a:b]

    def on_received(self, peer: int, pos: int) -> None:
        self.received[peer] = pos
        itemsize = self.dtype.itemsize if self.dtype is not None else 1
        while self._piece < len(self._ins):
            land, size, target, reduce = self._ins[self._piece]
            start = self._in_starts[self._piece]
            end = start + size
            upto = min(pos, end)
            mirror = self._mirrors.get(self._piece)
            if not reduce:
                # forward whole elements only: a result element must never be half written
                # over a partial sum that a restarted neighbour may need (docs/recovery.md)
                if upto != end:
                    upto -= (upto - start) % itemsize
                if upto > self.processed:
                    lo, hi = self.processed - start, upto - start
                    assert land is not None  # (only reduce pieces land in the ring)
                    if target is not None:
                        target[lo:hi] = land[lo:hi]
                    if mirror is not None:
                        mirror[lo:hi] = land[lo:hi]  # just received: still in the cache
                self.processed = max(self.processed, upto)
                if self._cyclic is not None:
                    self._cyclic.processed = self.processed
            else:
                upto -= (upto - start) % itemsize
                if upto - self.processed < schedule.MIN_RING_REDUCE and upto != end:
                    return
                if upto > self.processed:
                    lo, hi = self.processed - start, upto - start
                    assert self.op is not None and self.dtype is not None and target is not None
                    for a, b, landed in self._landing(self._piece, lo, hi):
                        if mirror is not None:
                            self._reduce_mirrored(target, landed, mirror, a, b)
                        else:
                            reduce_bytes(self.op, self.dtype, target[a:b], landed)
                    self.processed = upto
                    if self._cyclic is not None:
                        self._cyclic.processed = upto
            if upto < end:
                return
            self._piece += 1

    def out_ready(self, peer: int) -> int:
        return min(self.out_streams[self.prev].length, self._first_out + self.processed)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self.processed <= self.received[self.next]
        stream = self.in_streams[self.next]
        if isinstance(stream, _CyclicStream):  # no byte overwritten before it was processed
            assert stream.processed == self.processed
            cyclic = stream.cyclic
            assert (min(self.received[self.next], cyclic) - min(self.processed, cyclic)
                    <= len(stream.ring))

    def _skip_to(self, pos: int) -> None:
        """Start the in-stream at ``pos`` (a piece boundary or a whole element into one)."""
        self.processed = pos
        if self._cyclic is not None:
            self._cyclic.processed = pos
        self.received[self.next] = pos
        self._piece = bisect.bisect_right(self._in_starts, pos) - 1 if self._ins else 0
        if self._ins and pos >= self._in_starts[-1] + self._ins[-1][1]:
            self._piece = len(self._ins)
        self._piece = max(self._piece, 0)

    def _align_in(self, pos: int) -> int:
        """``pos`` rounded down to a whole element of the in-piece it falls in."""
        itemsize = self.dtype.itemsize if self.dtype is not None else 1
        i = bisect.bisect_right(self._in_starts, pos) - 1
        if i < 0 or i >= len(self._ins):
            return pos
        start = self._in_starts[i]
        return pos - (pos - start) % itemsize
