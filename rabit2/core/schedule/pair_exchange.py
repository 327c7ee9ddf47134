"""Allreduce at world size 2: one exchange of whole inputs, reduced in a fixed order."""

from __future__ import annotations

import numpy as np

from rabit2.core.ops import Op, reduce_bytes_ordered
from rabit2.core.schedule import Plan, ScratchFn, Stream


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
