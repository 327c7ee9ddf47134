"""Allreduce at world size 2: one exchange of whole inputs, reduced in a fixed order."""

from __future__ import annotations

import functools

import numpy as np

from rabit2.core.ops import Op, reduce_bytes_ordered
from rabit2.core.schedule import Plan, ScratchFn, Stream

REDUCE_BLOCK = 64 * 1024
"""A pair exchange reduces whole blocks of this many bytes as they arrive, and the rest once
all is in.  Each rank makes the result on its own, so where the reduction splits the array
must not depend on how the bytes happened to arrive: numpy's vector loop and its scalar tail
can keep different NaN payloads, and a split at a multiple of the widest vector (this block
is one, and a multiple of every item size) changes nothing (``tests/sim/test_schedule.py``)."""


class PairExchange(Plan):
    """World size 2: both ranks send their whole input and reduce what arrives.

    One network hop instead of the tree's two (up, then down), which halves small-call
    latency.  Both ranks compute ``op(input of rank 0, input of rank 1)`` in that order, so
    the bits agree even for NaN payloads; the output never aliases an operand.  Used up to
    the ring threshold.

    Without ``keep``, the input is first copied to the link's send buffer, so that the
    reduction can overwrite ``buf`` while the copy is still being sent.  With ``keep``
    (recovery on: the buffer retained as this call's result, as long as ``buf``), the input
    is sent from ``buf`` itself and the reduction writes ``keep``, which :attr:`finish`
    copies into ``buf`` once the call completed and every send before that was executed: one
    pass over the bytes fewer, since the result is retained without a further copy.  ``buf``
    then holds the input until the end (a resumed link is served from it), and the sends are
    volatile: ``buf`` changes then, perhaps before the kernel took all of it.
    """

    def __init__(self, buf: memoryview, dtype: np.dtype, op: Op, rank: int, peer: int,
                 scratch: ScratchFn, send_scratch: ScratchFn,
                 keep: memoryview | None = None) -> None:
        super().__init__()
        self.buf, self.dtype, self.op, self.peer = buf, dtype, op, peer
        self.lower_first = rank < peer
        n = len(buf)
        self.landing = scratch(peer, n)
        self.keep = keep
        if keep is None:
            self.input = send_scratch(peer, n)  # what is sent, and reduced from
            self.input[:] = buf
            self.out = buf  # where the result is made
        else:
            self.input = buf
            self.out = keep
            self.volatile_out = True
            # (not a bound method of this plan: that would make the plan, and the caller's
            # array it refers to, live until the cyclic garbage collector runs)
            self.finish = functools.partial(_copy, buf, keep)
        self._set_streams({peer: Stream([self.landing])}, {peer: Stream([self.input])})
        self.reduced = 0

    def on_received(self, peer: int, pos: int) -> None:
        self.received[peer] = pos
        n = len(self.input)
        upto = n if pos == n else pos - pos % REDUCE_BLOCK
        if upto <= self.reduced:
            return
        lo = self.reduced
        # the same call on both ranks, with inputs that never alias the output: which NaN
        # payload survives can depend on operand order and on aliasing
        mine, theirs = self.input[lo:upto], self.landing[lo:upto]
        first, second = (mine, theirs) if self.lower_first else (theirs, mine)
        reduce_bytes_ordered(self.op, self.dtype, self.out[lo:upto], first, second)
        self.reduced = upto

    def out_ready(self, peer: int) -> int:
        return len(self.input)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self.reduced <= self.received[self.peer]

    def final_from(self, peer: int) -> int:
        return len(self.input)  # the stream is this rank's input, never the result


def _copy(dst: memoryview, src: memoryview) -> None:
    dst[:] = src
