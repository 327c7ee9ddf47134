"""Tree allreduce: reduce up the tree, broadcast the result down, pipelined in chunks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rabit2.core.ops import Op, reduce_bytes
from rabit2.core.schedule import Plan, Resume, ScratchFn, Stream


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
        self.result_upto = 0  # bytes of ``buf`` that hold the result (non-root)
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
            self.result_upto = pos
        else:
            upto = pos - pos % self.dtype.itemsize
            if upto > self.result_upto:
                self.buf[self.result_upto : upto] = self._down[self.result_upto : upto]
                self.result_upto = upto

    def _reduce(self) -> None:
        n = len(self.buf)
        avail = min(self.received[c] for c in self.children)
        avail -= avail % self.dtype.itemsize
        if avail - self.reduced < self.chunk and avail != n:
            return
        if avail <= self.reduced:
            return
        # below ``result_upto`` the buffer already holds the result: a parent that sent it
        # ahead of our up-stream (a restarted one that fetched the result) needs none of ours
        upto = self.result_upto
        lo = max(self.reduced, min(avail, upto - upto % self.dtype.itemsize))
        dst = self.buf[lo:avail]
        for c in self.children:
            reduce_bytes(self.op, self.dtype, dst, self.scratch[c][lo:avail])
        self.reduced = avail

    def out_ready(self, peer: int) -> int:
        if peer == self.parent:
            return self.reduced
        if self.parent < 0:
            return self.reduced
        return self.result_upto

    def check_invariants(self) -> None:
        super().check_invariants()
        if self.children:
            assert self.reduced <= min(self.received[c] for c in self.children)
        if self.parent >= 0:
            assert self.result_upto <= self.received[self.parent] <= self.reduced

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
        return peer != self.parent or offset >= max(self.up_from, self.result_upto)
