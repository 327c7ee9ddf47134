"""Collective schedules as plans advanced by monotone byte counters.

A plan describes, for one rank and one call, a byte *stream* per directed link: what arrives
from each in-link (and where it lands) and what leaves on each out-link (and from where).
The driver tells the plan how far each in-stream has arrived (:meth:`Plan.on_received`); the
plan reduces what it can and answers how far each out-stream may be sent
(:meth:`Plan.out_ready`).  Nothing here blocks, reads a clock or touches a socket, so many
plans can be run against each other in one process (``tests/test_schedule.py``).

Counters only grow.  For the tree allreduce at a node (after rabit's allreduce_base):

    received_from_child[c] >= reduced >= sent_up >= received_from_parent >= sent_down[c]

The last ``>=`` holds by causality: the parent sends final byte ``x`` only after it received
our byte ``x``, so receiving the final result into the same buffer we send from never
overwrites a byte that is still to be sent.  The same argument holds for the ring's allgather
phase.  Per-link byte counts for every schedule are in ``docs/algorithms.md``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

from rabit2.core.ops import Op, reduce_bytes, reduce_bytes_ordered

ScratchFn = Callable[[int, int], memoryview]
"""``scratch(peer, nbytes)``: a writable byte buffer owned by the link to ``peer``."""

MIN_RING_REDUCE = 64 * 1024  # below this a numpy call costs more than it saves in pipelining
MIRROR_STEP = 256 * 1024  # reduce-then-copy step that stays in a core's L2 cache
LANDING_RING = 4 * 1024 * 1024
"""Bytes of the cyclic buffer the ring allreduce's reduce-scatter lands in (per link, at
most: a call that needs less takes less).  No call, however large, grows the link's
scratch beyond it.  A 1 MiB ring, which stays in the cache, made 16 MiB calls with
recovery on 5-13 % slower (several times as many reads and frames per call); 4 MiB was
level with an unbounded landing (``bench/README.md``, "Landing ring")."""


class Stream:
    """A directed link's bytes for one call: a concatenation of contiguous pieces."""

    __slots__ = ("_last", "length", "pieces", "starts")

    def __init__(self, pieces: Sequence[memoryview], length: int | None = None) -> None:
        """``length`` may exceed the pieces when the tail's destination is not known yet."""
        if len(pieces) == 1:  # (most streams: one buffer, built on every call)
            total = len(pieces[0])
            self.pieces = [pieces[0]] if total else []
            self.starts = [0] if total else []
        else:
            self.pieces = [p for p in pieces if len(p)]
            self.starts = []
            total = 0
            for piece in self.pieces:
                self.starts.append(total)
                total += len(piece)
        self.length = total if length is None else length
        self._last = 0

    def _index(self, pos: int) -> int:
        last = self._last
        if last < len(self.starts) and self.starts[last] <= pos < self.starts[last] + len(
            self.pieces[last]
        ):
            return last
        self._last = bisect.bisect_right(self.starts, pos) - 1
        return self._last

    def view(self, pos: int, max_len: int) -> memoryview:
        """The contiguous destination at stream position ``pos`` (at most ``max_len`` bytes)."""
        i = self._index(pos)
        local = pos - self.starts[i]
        return self.pieces[i][local : local + max_len]

    def views(self, start: int, end: int) -> list[memoryview]:
        """The source pieces covering ``[start, end)``."""
        out: list[memoryview] = []
        pos = start
        while pos < end:
            i = self._index(pos)
            local = pos - self.starts[i]
            piece = self.pieces[i]
            take = min(end - pos, len(piece) - local)
            out.append(piece[local : local + take])
            pos += take
        return out


EMPTY = Stream(())


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


class Resume:
    """Where a restarted rank picks an interrupted call up (``docs/recovery.md``).

    ``in_from[peer]``: the in-stream offset this rank asks ``peer`` to resend from;
    ``fetch``: ``(peer, lo, hi)`` byte ranges of the result that ``peer`` holds as final
    bytes and this rank must copy before its own result is complete.
    """

    __slots__ = ("fetch", "in_from")

    def __init__(self, in_from: dict[int, int],
                 fetch: Sequence[tuple[int, int, int]] = ()) -> None:
        self.in_from = in_from
        self.fetch = [f for f in fetch if f[2] > f[1]]


class Plan:
    """Base of every schedule: streams per link plus the counters that gate them."""

    def __init__(self) -> None:
        self.in_streams: dict[int, Stream] = {}
        self.out_streams: dict[int, Stream] = {}
        self.received: dict[int, int] = {}

    def _set_streams(self, ins: dict[int, Stream], outs: dict[int, Stream]) -> None:
        self.in_streams = ins
        self.out_streams = outs
        self.received = dict.fromkeys(ins, 0)

    def on_received(self, peer: int, pos: int) -> None:
        """``pos`` bytes of ``peer``'s in-stream have arrived (monotone)."""
        self.received[peer] = pos

    def out_ready(self, peer: int) -> int:  # pragma: no cover - every plan overrides
        raise NotImplementedError

    def receiving_done(self) -> bool:
        received = self.received
        for peer, stream in self.in_streams.items():  # noqa: SIM110 - no generator per call
            if received[peer] != stream.length:
                return False
        return True

    def check_invariants(self) -> None:
        for peer, stream in self.in_streams.items():
            assert 0 <= self.received[peer] <= stream.length, (peer, self.received[peer])
        for peer, stream in self.out_streams.items():
            assert 0 <= self.out_ready(peer) <= stream.length, (peer, self.out_ready(peer))

    # -- lazy recovery: only a restarted rank calls these, on a fresh plan ------------------

    def resume(self, out_needs: dict[int, int]) -> Resume:
        """Fast-forward a fresh plan so that the interrupted call continues where the live
        neighbours stand.  ``out_needs[peer]`` is how many bytes of our out-stream ``peer``
        already holds (0 for a neighbour that starts afresh).  Every in-stream starts at 0
        unless a schedule knows better."""
        del out_needs
        return Resume(dict.fromkeys(self.in_streams, 0))

    def resume_needs(self) -> tuple[int, ...]:
        """The out-peers whose ``need`` :meth:`resume` depends on (where the in-streams
        restart follows from where they need our stream); the others' only bound what is
        sent.  A neighbour restarted too is waited for if it is one of these; what we need of
        their own streams must not depend on the resume (all of it, or none)."""
        return ()

    def final_from(self, peer: int) -> int:
        """The out-stream offset from which the bytes sent to ``peer`` are final result
        bytes (so that a rank holding only the final result can still serve them)."""
        del peer
        return 0

    def serves_from(self, peer: int, offset: int) -> bool:
        """Whether this rank can (still) send its stream to ``peer`` from ``offset``.  Always
        on a plan that was not resumed; after :meth:`resume`, the in-streams restart where the
        out-streams needed them then, and bytes made from skipped input cannot be sent (a
        neighbour lost again while this rank is still in the call would ask for them)."""
        del peer, offset
        return True


class TreeAllreduce(Plan):
    """Reduce up the tree into ``buf`` and broadcast the result down, pipelined in chunks.

    Each child's bytes land in that link's scratch; whenever every child has delivered a
    prefix of at least ``chunk`` more bytes (or everything), that prefix is reduced into
    ``buf`` and becomes sendable to the parent.  The root's reduced prefix is final; a
    non-root receives the final bytes from its parent straight into ``buf``.

    With ``stage_down`` (the root's children), the final bytes from the parent land in the
    parent link's scratch and are copied into ``buf`` one whole element at a time, so that
    ``buf`` never holds an element that is half result and half contribution: if the root
    dies mid-call, its replacement can take the result prefix from a child and the
    contributions behind it from every child (``docs/recovery.md``).
    """

    def __init__(
        self,
        buf: memoryview,
        dtype: np.dtype,
        op: Op,
        parent: int,
        children: Sequence[int],
        scratch: ScratchFn,
        chunk: int,
        stage_down: bool = False,
    ) -> None:
        super().__init__()
        self.buf, self.dtype, self.op = buf, dtype, op
        self.parent, self.children = parent, tuple(children)
        n = len(buf)
        itemsize = dtype.itemsize
        self.chunk = max(itemsize, chunk - chunk % itemsize)
        self.up_from = 0  # a resumed non-root: the first up-stream byte it can make
        self.scratch = {c: scratch(c, n) for c in self.children}
        ins = {c: Stream([self.scratch[c]]) for c in self.children}
        outs = {c: Stream([buf]) for c in self.children}
        self._down: memoryview | None = None
        self.final = 0  # bytes of ``buf`` that hold the result (non-root)
        if parent >= 0:
            if stage_down:
                self._down = scratch(parent, n)
                ins[parent] = Stream([self._down])
            else:
                ins[parent] = Stream([buf])
            outs[parent] = Stream([buf])
        self._set_streams(ins, outs)
        self.reduced = 0 if self.children else n

    def on_received(self, peer: int, pos: int) -> None:
        self.received[peer] = pos
        if peer != self.parent:
            self._reduce()
        elif self._down is None:
            self.final = pos
        else:
            upto = pos - pos % self.dtype.itemsize
            if upto > self.final:
                self.buf[self.final : upto] = self._down[self.final : upto]
                self.final = upto

    def _reduce(self) -> None:
        n = len(self.buf)
        avail = min(self.received[c] for c in self.children)
        avail -= avail % self.dtype.itemsize
        if avail - self.reduced < self.chunk and avail != n:
            return
        if avail <= self.reduced:
            return
        # below ``final`` the buffer already holds the result: a parent that sent it ahead
        # of our up-stream (a restarted one that fetched the result) needs none of ours
        lo = max(self.reduced, min(avail, self.final - self.final % self.dtype.itemsize))
        dst = self.buf[lo:avail]
        for c in self.children:
            reduce_bytes(self.op, self.dtype, dst, self.scratch[c][lo:avail])
        self.reduced = avail

    def out_ready(self, peer: int) -> int:
        if peer == self.parent:
            return self.reduced
        if self.parent < 0:
            return self.reduced
        return self.final

    def check_invariants(self) -> None:
        super().check_invariants()
        if self.children:
            assert self.reduced <= min(self.received[c] for c in self.children)
        if self.parent >= 0:
            assert self.final <= self.received[self.parent] <= self.reduced

    def resume(self, out_needs: dict[int, int]) -> Resume:
        """Non-root: the parent holds ``z`` bytes of our up-stream, so the children resend
        their contributions from ``z`` (rounded down to an element: every final byte any
        child holds lies below the root's reduced prefix, which is whole elements and at
        most ``z``), and the parent resends the result from 0.  Root: the children hold the
        result up to ``x_c``; take the result up to ``M`` = the furthest whole element from
        that child, and every child's contribution from ``M`` on."""
        itemsize = self.dtype.itemsize
        if self.parent >= 0:
            z = out_needs.get(self.parent, 0)
            start = z - z % itemsize
            if self.children:
                self.reduced = start
                self.up_from = start
                for c in self.children:
                    self.received[c] = start
            return Resume({self.parent: 0, **dict.fromkeys(self.children, start)})
        if not self.children:
            return Resume({})
        best = max(self.children, key=lambda c: out_needs.get(c, 0))
        x = out_needs.get(best, 0)
        start = x - x % itemsize
        self.reduced = start
        for c in self.children:
            self.received[c] = start
        return Resume(dict.fromkeys(self.children, start), [(best, 0, start)])

    def resume_needs(self) -> tuple[int, ...]:
        # a non-root's children resend from the parent's need; the root takes what its
        # children hold (a restarted child holds nothing, and waits for the root's need)
        return (self.parent,) if self.parent >= 0 else ()

    def final_from(self, peer: int) -> int:
        # the up-stream carries partial sums (at the root there is none); down is the result
        return len(self.buf) if peer == self.parent else 0

    def serves_from(self, peer: int, offset: int) -> bool:
        # up: partial sums, overwritten by the result from the start as it comes down (and,
        # after a resume, made only from ``up_from`` on: the children resent from there);
        # down: results
        return peer != self.parent or offset >= max(self.up_from, self.final)


class PairExchange(Plan):
    """World size 2: both ranks send their whole input and reduce what arrives.

    One network hop instead of the tree's two (up, then down), which halves small-call
    latency.  The input is first copied to the link's send buffer, so the reduction can
    overwrite ``buf`` while the copy is still being sent.  Both ranks compute
    ``op(input of rank 0, input of rank 1)`` in that order, so the bits agree even for
    NaN payloads.  Used up to the ring threshold (the copy stays small).
    """

    def __init__(self, buf: memoryview, dtype: np.dtype, op: Op, rank: int, peer: int,
                 scratch: ScratchFn, send_scratch: ScratchFn) -> None:
        super().__init__()
        self.buf, self.dtype, self.op, self.peer = buf, dtype, op, peer
        self.lower_first = rank < peer
        n = len(buf)
        self.landing = scratch(peer, n)
        self.copy = send_scratch(peer, n)
        self.copy[:] = buf
        self._set_streams({peer: Stream([self.landing])}, {peer: Stream([self.copy])})
        self.reduced = 0

    def on_received(self, peer: int, pos: int) -> None:
        self.received[peer] = pos
        upto = pos - pos % self.dtype.itemsize
        if upto <= self.reduced:
            return
        lo = self.reduced
        # the same call on both ranks, with inputs that never alias the output: which NaN
        # payload survives can depend on operand order and on aliasing
        mine, theirs = self.copy[lo:upto], self.landing[lo:upto]
        first, second = (mine, theirs) if self.lower_first else (theirs, mine)
        reduce_bytes_ordered(self.op, self.dtype, self.buf[lo:upto], first, second)
        self.reduced = upto

    def out_ready(self, peer: int) -> int:
        return len(self.copy)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self.reduced <= self.received[self.peer]

    def final_from(self, peer: int) -> int:
        return len(self.copy)  # the stream is this rank's input, never the result


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


class _RingChain(Plan):
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
            assert ring is not None and len(ring) >= min(cyclic, 2 * MIN_RING_REDUCE)
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
        step = MIRROR_STEP - MIRROR_STEP % self.dtype.itemsize
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
                if upto - self.processed < MIN_RING_REDUCE and upto != end:
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


class RingAllreduce(_RingChain):
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
        ring_size = max(2 * MIN_RING_REDUCE, LANDING_RING - LANDING_RING % dtype.itemsize)
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


class RingAllgather(_RingChain):
    """Every rank's block (``blocks[k]`` = byte range of rank k in ``buf``) reaches every rank."""

    def __init__(
        self, buf: memoryview, blocks: Sequence[tuple[int, int]], rank: int, world: int
    ) -> None:
        prev, nxt = (rank - 1) % world, (rank + 1) % world

        def block(k: int) -> memoryview:
            lo, hi = blocks[k % world]
            return buf[lo:hi]

        in_pieces: list[tuple[memoryview | int, memoryview | None, bool]] = [
            (block(rank + 1 + t), None, False) for t in range(world - 1)
        ]
        out_pieces = [block(rank + t) for t in range(world - 1)]
        super().__init__(buf, prev, nxt, in_pieces, out_pieces)


PayloadFn = Callable[[memoryview], memoryview]
"""``receive(head)``: given the first ``head_size`` bytes of a broadcast, the destination of
the rest (the API reads dtype and shape there and answers with the caller's array or a new
one)."""


class TreeBroadcast(Plan):
    """Pipelined flood from ``root`` over the tree: forward each byte as it arrives.

    Every non-root also sends an empty stream towards the root (its in-link), so that two
    ranks that disagree about the root exchange at least one frame and detect it.

    The stream is ``pieces`` (the root's, or a known-size buffer everywhere).  A non-root
    that does not know the size (``receive`` given) learns it from the first frame: call
    :meth:`size` with it; the stream is then a ``head_size`` head followed by the payload,
    whose destination ``receive(head)`` names once the head has arrived, before any payload
    byte lands.  One call carries both, where rabit broadcast a length and then the data.
    """

    def __init__(self, pieces: Sequence[memoryview], in_link: int, out_links: Sequence[int],
                 receive: PayloadFn | None = None, head_size: int = 0) -> None:
        super().__init__()
        self.in_link, self.out_links = in_link, tuple(out_links)
        self.receive, self.head_size = receive, head_size
        self.sized = receive is None
        self.resolved = receive is None
        self._head = memoryview(bytearray(0))
        self._total = sum(len(p) for p in pieces)
        self._build(list(pieces), self._total)

    def _build(self, pieces: list[memoryview], total: int) -> None:
        stream = Stream(pieces, total)
        ins: dict[int, Stream] = dict.fromkeys(self.out_links, EMPTY)
        # an unsized rank forwards nothing yet: its children's streams appear with the size
        outs: dict[int, Stream] = dict.fromkeys(self.out_links, stream) if self.sized else {}
        if self.in_link >= 0:
            ins[self.in_link] = stream
            outs[self.in_link] = EMPTY
        received = self.received
        self._set_streams(ins, outs)
        self.received.update(received)  # announces already counted stay counted
        self.length = total

    def size(self, total: int) -> None:
        """The root's first frame says the stream is ``total`` bytes: lay out the head."""
        if self.sized:
            return
        if total < self.head_size:
            raise ValueError(f"broadcast of {total} B is shorter than its {self.head_size} B head")
        self.sized = True
        self._total = total
        self._head = memoryview(bytearray(self.head_size))
        self._build([self._head], total)
        if self.head_size == 0:
            self._resolve()

    def _resolve(self) -> None:
        assert self.receive is not None
        payload = self.receive(self._head)
        if len(payload) != self._total - self.head_size:
            raise ValueError(f"broadcast payload of {len(payload)} B, stream says "
                             f"{self._total - self.head_size} B")
        self._build([self._head, payload], self._total)
        self.resolved = True

    def on_received(self, peer: int, pos: int) -> None:
        self.received[peer] = pos
        if not self.resolved and self.sized and peer == self.in_link and pos >= self.head_size:
            self._resolve()

    def out_ready(self, peer: int) -> int:
        if peer == self.in_link:
            return 0
        return self.length if self.in_link < 0 else self.received[self.in_link]
