"""Tree broadcast: a pipelined flood from the root, sized by its first frame if need be."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rabit2.core.schedule import EMPTY, Plan, Stream

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
