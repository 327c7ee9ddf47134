"""Ring allgather: every rank's block travels once around the ring."""

from __future__ import annotations

from collections.abc import Sequence

from rabit2.core.schedule.ring import RingChain


class RingAllgather(RingChain):
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
