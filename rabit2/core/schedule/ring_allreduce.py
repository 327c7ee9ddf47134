"""Ring allreduce: reduce-scatter, then allgather, around the ring."""

from __future__ import annotations

import numpy as np

from rabit2.core import schedule
from rabit2.core.ops import Op, reduce_bytes
from rabit2.core.schedule import Resume, ScratchFn
from rabit2.core.schedule.ring import RingChain


def ring_segments(nbytes: int, itemsize: int, world: int) -> list[tuple[int, int]]:
    """Byte ranges of the ring segments: segment ``k`` is reduced by rank ``k``.

    ``ceil(count / world)`` elements each; trailing segments are empty when count < world.
    """
    count = nbytes // itemsize
    step = -(-count // world) if count else 0
    segs = []
    for k in range(world):
        lo = min(k * step, count) * itemsize
        hi = min((k + 1) * step, count) * itemsize
        segs.append((lo, hi))
    return segs


class RingAllreduce(RingChain):
    """Reduce-scatter then allgather around the ring (each link carries 2(n-1)/n of the data)."""

    def __init__(
        self,
        buf: memoryview,
        dtype: np.dtype,
        op: Op,
        rank: int,
        world: int,
        scratch: ScratchFn,
        keep: memoryview | None = None,
    ) -> None:
        """``keep`` (recovery on; as long as ``buf``): the buffer the agent keeps as this
        call's result for replays.  The plan copies each result byte there as it makes it
        (its own segment step by step as it reduces it, the allgather's segments as they
        arrive), while the bytes are still in the cache, so that retaining the result costs
        no second pass over memory (except what a resume fetches: ``own_fetched``).  At
        world size 2 the allgather lands in ``keep`` and is copied into ``buf`` in whole
        elements: there the rank that receives our result segment is also the one whose
        input we reduce it from (``docs/recovery.md``)."""
        segs = ring_segments(len(buf), dtype.itemsize, world)
        prev, nxt = (rank - 1) % world, (rank + 1) % world

        def seg(k: int) -> memoryview:
            lo, hi = segs[k % world]
            return buf[lo:hi]

        rs_in = [(rank + 2 + t) % world for t in range(world - 1)]
        rs_bytes = sum(segs[k][1] - segs[k][0] for k in rs_in)
        # the reduce-scatter lands in the link's scratch, used as a ring (whole elements)
        landing = schedule.LANDING_RING
        ring_size = max(2 * schedule.MIN_RING_REDUCE, landing - landing % dtype.itemsize)
        ring = scratch(nxt, min(rs_bytes, ring_size))
        in_pieces: list[tuple[memoryview | int, memoryview | None, bool]] = []
        for k in rs_in:
            in_pieces.append((segs[k][1] - segs[k][0], seg(k), True))
        staged = keep if world == 2 else None
        if staged is None:
            in_pieces += [(seg(rank + 1 + t), None, False) for t in range(world - 1)]
        else:
            for t in range(world - 1):
                lo, hi = segs[(rank + 1 + t) % world]
                in_pieces.append((staged[lo:hi], buf[lo:hi], False))
        out_pieces = [seg(rank + 1 + t) for t in range(world - 1)]
        out_pieces += [seg(rank + t) for t in range(world - 1)]
        super().__init__(buf, prev, nxt, in_pieces, out_pieces, dtype, op, ring)
        self.rs_bytes = rs_bytes  # the reduce-scatter part of the in-stream comes first
        own = segs[rank]
        self.own_segment = own  # reduced last (the final in-piece of reduce-scatter)
        self.keep = keep
        self.staged = staged
        self.own_in_start = rs_bytes - (own[1] - own[0])
        if keep is not None:
            # the in-pieces that make result bytes, by where they start in the in-stream:
            # our own segment's reduction, then (world > 2; at world size 2 they land in
            # ``keep`` already) each allgather segment
            made = [(self.own_in_start, rank)]
            if staged is None:
                pos = rs_bytes
                for t in range(world - 1):
                    k = (rank + 1 + t) % world
                    made.append((pos, k))
                    pos += segs[k][1] - segs[k][0]
            for first, k in made:
                lo, hi = segs[k]
                if hi > lo:  # (empty pieces are not in the stream)
                    self._mirrors[self._in_starts.index(first)] = keep[lo:hi]
        self.in_from: int | None = None  # a resumed plan: where its in-stream restarted
        self.own_fetched = False  # a resume fetched (part of) our own segment's result

    def resume(self, out_needs: dict[int, int]) -> Resume:
        """``prev`` holds ``z`` bytes of our stream.  Out byte ``q >= first_out`` forwards in
        byte ``q - first_out``, so the next rank resends from there (whole elements), but
        never from beyond the allgather part, whose segments are our own result.  If that
        skips (part of) our own segment's last reduction, ``prev`` holds those final bytes:
        it received them from us in the allgather.  ``docs/recovery.md`` shows that the next
        rank still holds every byte asked for."""
        z = out_needs.get(self.prev, 0)
        pos = min(self._align_in(max(0, z - self._first_out)), self.rs_bytes)
        self._skip_to(pos)
        self.in_from = pos
        fetch = []
        if pos > self.own_in_start:
            lo = self.own_segment[0]
            fetch.append((self.prev, lo, lo + pos - self.own_in_start))
            self.own_fetched = True  # (those bytes bypass ``keep``)
        return Resume({self.next: pos}, fetch)

    def resume_needs(self) -> tuple[int, ...]:
        return (self.prev,)

    def _landed(self) -> int:
        """Allgather bytes that have overwritten, in ``buf``, the reduce-scatter part of the
        out-stream: its out byte ``q`` is gone once this passes ``q`` (negative: none)."""
        staged_or_received = self.processed if self.staged is not None else self.received[self.next]
        return staged_or_received - self.rs_bytes

    def refill_range(self, offset: int) -> tuple[int, int] | None:
        """After a resume, the in-stream bytes ``[lo, hi)`` to fetch again from ``next`` so
        that out-stream byte ``offset`` on can be made (a neighbour lost again asks from
        there); None if that is not the missing piece (nothing skipped there, or the
        allgather has overwritten the partial sums those bytes go into)."""
        if self.in_from is None or offset < self._first_out:
            return None
        lo = self._align_in(offset - self._first_out)
        # in-bytes from ``own_in_start`` on reduce into our own segment, which the resume
        # filled with result bytes fetched from ``prev`` where it skipped them: never again
        hi = min(self.in_from, self.own_in_start)
        if lo >= hi:
            return None
        if offset < self._landed():
            return None
        return lo, hi

    def refill(self, lo: int, data: memoryview) -> None:
        """Reduce the refetched in-stream bytes ``[lo, lo + len(data))`` (reduce-scatter
        pieces that the resume skipped: their targets still hold this rank's input) into
        place; from then on the out-stream can be served from the matching offset (what
        lies between is this rank's own segment, fetched as result bytes by the resume)."""
        assert self.in_from is not None and self.op is not None and self.dtype is not None
        hi = lo + len(data)
        assert hi == min(self.in_from, self.own_in_start)
        for (_, size, target, reduce), start in zip(self._ins, self._in_starts, strict=True):
            a, b = max(lo, start), min(hi, start + size)
            if a >= b:
                continue
            assert reduce and target is not None  # (the skipped part is reduce-scatter)
            reduce_bytes(self.op, self.dtype, target[a - start : b - start],
                         data[a - lo : b - lo])
        self.in_from = lo

    def final_from(self, peer: int) -> int:
        return self._first_out + self.own_in_start  # the allgather part of the out-stream

    def serves_from(self, peer: int, offset: int) -> bool:
        """Out byte ``q >= first_out`` forwards in byte ``q - first_out``, skipped below
        ``in_from`` after a resume.  The first out-piece is this rank's own input, intact
        until the allgather lands this rank's first result segment over it."""
        del peer
        # the reduce-scatter part reads, in stream order, the same segments of ``buf`` that
        # the allgather then overwrites with results in that order: out byte ``q`` of it is
        # gone once allgather byte ``q`` has landed
        if offset < self._first_out + self.own_in_start and offset < self._landed():
            return False
        if self.in_from is None:
            return True  # not resumed: everything else is still there
        if offset >= self._first_out:
            return offset - self._first_out >= self.in_from
        # the allgather overwrites the first out-piece from its start as its result arrives
        overwritten = min(max(0, self.received[self.next] - self.rs_bytes), self._first_out)
        return self.in_from == 0 and offset >= overwritten
