"""Collective schedules as plans advanced by monotone byte counters.

A plan describes, for one rank and one call, a byte *stream* per directed link: what arrives
from each in-link (and where it lands) and what leaves on each out-link (and from where).
The driver tells the plan how far each in-stream has arrived (:meth:`Plan.on_received`); the
plan reduces what it can and answers how far each out-stream may be sent
(:meth:`Plan.out_ready`).  Nothing here blocks, reads a clock or touches a socket, so many
plans can be run against each other in one process (``tests/sim/test_schedule.py``).

Counters only grow.  For the tree allreduce at a node (after rabit's allreduce_base):

    received_from_child[c] >= reduced >= sent_up >= received_from_parent >= sent_down[c]

The last ``>=`` holds by causality: the parent sends final byte ``x`` only after it received
our byte ``x``, so receiving the final result into the same buffer we send from never
overwrites a byte that is still to be sent.  The same argument holds for the ring's allgather
phase.  Per-link byte counts for every schedule are in ``docs/algorithms.md``.

One module per algorithm: ``tree_allreduce``, ``pair_exchange`` (allreduce at world size
2), ``ring`` (the ring pass that the next two share), ``ring_allreduce``,
``ring_allgather`` and ``tree_broadcast``.  This module holds what they all build on (the
streams, :class:`Plan`, :class:`Resume`) and names them all.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

ScratchFn = Callable[[int, int], memoryview]
"""``scratch(peer, nbytes)``: a writable byte buffer owned by the link to ``peer``."""

# The ring's tunables.  They live here, where the agent reads LANDING_RING (to size a link's
# scratch) and the tests set smaller ones: the ring modules read them here on every use.
MIN_RING_REDUCE = 64 * 1024  # below this a numpy call costs more than it saves in pipelining
MIRROR_STEP = 256 * 1024  # reduce-then-copy step that stays in a core's L2 cache
LANDING_RING = 4 * 1024 * 1024
"""Bytes of the cyclic buffer the ring allreduce's reduce-scatter lands in (per link, at
most: a call that needs less takes less).  No call, however large, grows the link's
scratch beyond it.  A 1 MiB ring, which stays in the cache, made 16 MiB calls with
recovery on 5-13 % slower (several times as many reads and frames per call); 4 MiB was
level with an unbounded landing (``docs/performance.md``, "Landing ring")."""


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

    volatile_out = False
    """Whether the out-streams' bytes change once the call completes (:attr:`finish`):
    their sends are then ``volatile``."""
    finish: Callable[[], None] | None = None
    """For a plan that makes its result elsewhere than the caller's buffer: what puts it
    there once the call completed with it (not with a result fetched from a neighbour).
    It travels with :class:`~rabit2.core.records.CallComplete` and runs when the I/O layer
    executes that command, after the sends before it, which may still read the buffer."""

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


# the algorithms build on the above
from rabit2.core.schedule.pair_exchange import PairExchange  # noqa: E402
from rabit2.core.schedule.ring_allgather import RingAllgather  # noqa: E402
from rabit2.core.schedule.ring_allreduce import RingAllreduce, ring_segments  # noqa: E402
from rabit2.core.schedule.tree_allreduce import TreeAllreduce  # noqa: E402
from rabit2.core.schedule.tree_broadcast import PayloadFn, TreeBroadcast  # noqa: E402

__all__ = [
    "EMPTY",
    "LANDING_RING",
    "MIN_RING_REDUCE",
    "MIRROR_STEP",
    "PairExchange",
    "PayloadFn",
    "Plan",
    "Resume",
    "RingAllgather",
    "RingAllreduce",
    "ScratchFn",
    "Stream",
    "TreeAllreduce",
    "TreeBroadcast",
    "ring_segments",
]
