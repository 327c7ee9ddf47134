"""What a rank retains for a restarted neighbour: the results of finished calls (bounded by
``rabit2_replay_mb``), in buffers that are recycled call after call.

Nothing here touches a socket or a clock.
"""

from __future__ import annotations

import collections
import mmap
from collections.abc import Sequence

import numpy as np

from rabit2.core.framing import CallDescriptor

CallId = tuple[int, int]

DEFAULT_RETAIN_BYTES = 256 << 20
"""Bound on the results a rank keeps for replay (``rabit2_replay_mb``)."""
SMALL_RESULT = 64 << 10  # results up to this size are kept as bytes objects, not buffers
GENERATIONS = 2
"""Checkpoint versions (and the results of calls made in them) kept on every rank: the
current one and the one before, so that a neighbour that checkpointed just before a peer
died can still serve a neighbour that did not (``docs/recovery.md``, "Versions").  The
older version's results go earlier, once the rank finishes a call of the newer one that
every rank contributes to (``Agent``)."""


_SMALL_PAGES_FROM = 1 << 20


def fresh_buffer(size: int) -> np.ndarray:
    """A new byte buffer for retained results or a link's scratch.  Large ones are private
    anonymous mappings of ordinary pages: numpy asks for transparent huge pages above
    4 MiB, and on a virtual machine the first touch of fresh huge pages in a worker made
    the calls that fill the store 3-6x slower than with small pages (16 MiB allreduce at
    N=2: 45-70 ms against 14-24 ms; 64 MiB: 200-430 ms against 60-80 ms; MAP_POPULATE: no
    better), while the steady state, which recycles buffers, is the same (8-10 ms and
    ~35 ms).  The guest kernel reports free blocks of 8 MiB and more to the host
    (``page_reporting_order=11``), so fresh huge pages often need the host to fault memory
    back in; explicitly madvised mappings were 35 ms or 220-330 ms per 64 MiB call
    depending on that."""
    if size < _SMALL_PAGES_FROM or not hasattr(mmap, "MAP_PRIVATE"):
        return np.empty(size, dtype=np.uint8)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8)  # the array keeps the mapping alive


class ResultStore:
    """Results of finished calls, kept for a restarted neighbour's replay.

    Bounded twice: by checkpoint generation (calls of versions older than the previous
    checkpoint are dropped) and by bytes (the oldest results go first).  Either way the
    retained calls stay one contiguous run ``[oldest, newest]``, which is what ``state``
    advertises.  Dropped buffers are reused for later results of the same size, so that a
    steady stream of calls copies into memory that is already mapped (a fresh 64 MiB
    allocation costs several times the copy itself in page faults).
    """

    def __init__(self, limit: int = DEFAULT_RETAIN_BYTES) -> None:
        self.limit = limit
        self._results: collections.OrderedDict[
            CallId, tuple[CallDescriptor, np.ndarray | bytes]] = collections.OrderedDict()
        self._spare: dict[int, list[np.ndarray]] = {}
        self._spare_bytes = 0
        self.nbytes = 0
        self._dropped_upto: CallId = (0, 0)  # calls before this were dropped (or never made)
        # the latest version that lost one of its own results for want of room while it was
        # the version being made: no restart can replay it any more (-1: none)
        self.overflowed = -1

    def fits(self, size: int) -> bool:
        """Whether a result of ``size`` bytes can be kept at all (``rabit2_replay_mb``)."""
        return size <= self.limit

    def wants(self, call: CallId) -> bool:
        """False once ``call``'s version has lost one of its own results (``overflowed``):
        no restart can replay that version any more, so keeping its later results would
        only cost copies and memory.  They are kept again from the next version on."""
        return call[0] != self.overflowed

    def add(self, call: CallId, desc: CallDescriptor, pieces: Sequence[memoryview]) -> None:
        """Keep a copy of the result, given as the pieces it is made of."""
        size = len(pieces[0]) if len(pieces) == 1 else sum(len(p) for p in pieces)
        if not self.wants(call) or not self.fits(size):
            self._make_room(call, size)  # never kept: forget what came before it, copy nothing
            return
        if size <= SMALL_RESULT:
            # a small result: one bytes object, cheaper to make than a numpy buffer
            if self._make_room(call, size):
                self._results[call] = (desc, b"".join(pieces))
                self.nbytes += size
            return
        blob = self.take(size)
        pos = 0
        for piece in pieces:
            blob[pos : pos + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            pos += len(piece)
        self.keep(call, desc, blob)

    def take(self, size: int) -> np.ndarray:
        """A buffer for a result that is being made (a recycled one when possible); hand it
        back with :meth:`keep`, or drop it."""
        spare = self._spare.get(size)
        if spare:
            self._spare_bytes -= size
            return spare.pop()
        self._trim_spares(self.limit - size - self.nbytes)
        return fresh_buffer(size)

    def keep(self, call: CallId, desc: CallDescriptor, blob: np.ndarray) -> None:
        """Keep ``blob`` (from :meth:`take`, filled with the result) without copying it; if
        the result cannot be kept, the buffer goes back to the spares (within the bound)."""
        if self._make_room(call, blob.nbytes):
            self._results[call] = (desc, blob)
            self.nbytes += blob.nbytes
        elif self.nbytes + self._spare_bytes + blob.nbytes <= self.limit:
            self._to_spares(blob)

    def _make_room(self, call: CallId, size: int) -> bool:
        """Drop the oldest results until ``size`` more bytes fit; False if the result is not
        to be kept (it never fits, or its version lost a result: then everything up to it
        is forgotten)."""
        if not self.fits(size) or not self.wants(call):
            self.clear_before((call[0], call[1] + 1))
            self.overflowed = max(self.overflowed, call[0])
            return False
        while self._results and self.nbytes + size > self.limit:
            old, (_, blob) = self._results.popitem(last=False)
            self._release(blob)
            self._dropped_upto = (old[0], old[1] + 1)
            if old[0] == call[0]:
                self.overflowed = max(self.overflowed, call[0])
        if not self.wants(call):  # (it just lost one: this one is no use either)
            self.clear_before((call[0], call[1] + 1))
            return False
        return True

    def _release(self, blob: np.ndarray | bytes) -> None:
        """Keep a dropped buffer for the next result of its size (within the same bound:
        retained and spare bytes together stay under ``limit``)."""
        if isinstance(blob, bytes):
            self.nbytes -= len(blob)
            return
        self.nbytes -= blob.nbytes
        self._to_spares(blob)

    def _to_spares(self, blob: np.ndarray) -> None:
        self._spare.setdefault(blob.nbytes, []).append(blob)
        self._spare_bytes += blob.nbytes

    def _trim_spares(self, room: int) -> None:
        """Free spare buffers (other sizes first come first) until they fit in ``room``."""
        for size in list(self._spare):
            spares = self._spare[size]
            while spares and self._spare_bytes > max(0, room):
                spares.pop()
                self._spare_bytes -= size
            if not spares:
                del self._spare[size]

    def get(self, call: CallId) -> tuple[CallDescriptor, memoryview] | None:
        got = self._results.get(call)
        if got is None:
            return None
        blob = got[1]
        return got[0], memoryview(blob) if isinstance(blob, bytes) else blob.data

    def on_checkpoint(self, version: int, keep_from: int | None = None) -> None:
        """``version`` was just taken: keep the calls of ``version - 1`` on (of ``keep_from``
        on, if that is older), drop the rest."""
        oldest = version - GENERATIONS + 1
        if keep_from is not None:
            oldest = min(oldest, keep_from)
        self.clear_before((max(0, oldest), 0))

    def clear_before(self, call: CallId) -> None:
        for key in [k for k in self._results if k < call]:
            self._release(self._results.pop(key)[1])
        self._dropped_upto = max(self._dropped_upto, call)

    @property
    def oldest(self) -> CallId:
        """The first call that may be retained: everything before it is gone."""
        return self._dropped_upto
