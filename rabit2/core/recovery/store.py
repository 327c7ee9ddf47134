"""What a rank retains for a restarted neighbour: the results of finished calls (bounded by
``rabit2_replay_mb``), in memory that is recycled call after call: small results back to
back in slabs, larger ones in buffers of their own.

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
ENTRY_COST = 512
"""What each kept result is charged beyond its bytes: the Python objects that hold it (its
place in the ordered dict, the key, the view of its memory, the call's descriptor), 460-480
B measured with ``tracemalloc`` on CPython 3.11.  Without it, a loop of 8-byte calls that
never checkpoints would hold some 60 times the bound before any result went."""
SMALL_RESULT = 128 << 10
"""Results up to this size are kept in slabs, not buffers of their own (a 64 KiB broadcast
with its head among them)."""
SLAB_BYTES = 4 << 20
"""Size of a slab of small results (at most a sixteenth of the bound)."""
POPULATE_STEP = 256 << 10
"""Bytes of a slab whose pages are made at once, ahead of the copies that need them."""
MADV_POPULATE_WRITE = 23  # Linux 5.14 (the mmap module names it from Python 3.13 on)
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


class Slab:
    """Anonymous memory that small results are kept in, back to back, in the order of the
    calls; used again from its start once every result in it has gone.

    A result copied to fresh memory pays for its pages as the copy first touches them: 1.4-1.7
    us a page on the virtual machine measured, some 25 us for a 64 KiB result, several times
    the copy.  A slab makes its pages ``POPULATE_STEP`` bytes at a time in one system call
    (``MADV_POPULATE_WRITE``: 1 us a page there), and once a training loop checkpoints its
    results go into pages made already (``docs/performance.md``, "Slabs for small
    results")."""

    __slots__ = ("_map", "array", "data", "live", "pos", "ready")
    populate = hasattr(mmap, "MAP_PRIVATE")  # False once the kernel refused (before 5.14)

    def __init__(self, size: int) -> None:
        self._map = (mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                     if hasattr(mmap, "MAP_PRIVATE") else None)
        self.data = memoryview(self._map if self._map is not None else bytearray(size))
        self.array = np.frombuffer(self.data, dtype=np.uint8)
        self.pos = 0  # where the next result goes
        self.live = 0  # results kept (or reserved) here and not dropped yet
        self.ready = 0  # bytes whose pages were made

    def put(self, pieces: Sequence[memoryview], size: int) -> memoryview:
        """Copy a result, given as the pieces it is made of, after the last; where it is
        kept (the caller checked that ``size`` bytes fit)."""
        start = at = self._claim(size)
        data = self.data
        for piece in pieces:
            flat = piece if piece.format == "B" and piece.ndim == 1 else piece.cast("B")
            n = len(flat)
            data[at : at + n] = flat
            at += n
        return data[start : start + size]

    def reserve(self, size: int) -> np.ndarray:
        """Room for a result of ``size`` bytes after the last, to be made there (the caller
        checked that it fits)."""
        at = self._claim(size)
        return self.array[at : at + size]

    def _claim(self, size: int) -> int:
        """Where the next ``size`` bytes go, their pages made."""
        at = self.pos
        end = at + size
        if end > self.ready:
            self._make_pages(end)
        self.pos = end
        self.live += 1
        return at

    def make_ready(self, size: int) -> None:
        """Make the pages of the next ``size`` bytes now (the caller checked that they
        fit), so that claiming them later costs nothing."""
        if self.pos + size > self.ready:
            self._make_pages(self.pos + size)

    def _make_pages(self, end: int) -> None:
        """Make the pages of bytes ``[ready, end)`` and of the step after them."""
        upto = min(len(self.data), max(end, self.ready + POPULATE_STEP))
        upto = min(len(self.data), -(-upto // mmap.PAGESIZE) * mmap.PAGESIZE)
        if Slab.populate and self._map is not None:
            try:
                self._map.madvise(MADV_POPULATE_WRITE, self.ready, upto - self.ready)
            except (OSError, ValueError):
                Slab.populate = False  # (the copies touch the pages instead)
        self.ready = upto


class ResultStore:
    """Results of finished calls, kept for a restarted neighbour's replay.

    Bounded twice: by checkpoint generation (calls of versions older than the previous
    checkpoint are dropped) and by bytes (the oldest results go first).  Either way the
    retained calls stay one contiguous run ``[oldest, newest]``, which is what ``state``
    advertises.  Dropped buffers are reused for later results of the same size, so that a
    steady stream of calls copies into memory that is already mapped (a fresh 64 MiB
    allocation costs several times the copy itself in page faults).  Results of up to
    ``SMALL_RESULT`` bytes share slabs (:class:`Slab`); the slabs in use may hold up to two
    slabs more than the bound (a partly filled one at each end), and at most two emptied
    ones are kept for reuse.
    """

    def __init__(self, limit: int = DEFAULT_RETAIN_BYTES) -> None:
        self.limit = limit
        self._results: collections.OrderedDict[
            CallId, tuple[CallDescriptor, np.ndarray | memoryview, Slab | None]
        ] = collections.OrderedDict()
        self._slab_size = -(-max(SMALL_RESULT, min(SLAB_BYTES, limit // 16))
                            // mmap.PAGESIZE) * mmap.PAGESIZE
        self._slab: Slab | None = None  # the slab new small results go to
        self._empty_slabs: list[Slab] = []
        # room reserved in a slab by take() and not yet handed to keep()
        self._reserved: tuple[np.ndarray, Slab] | None = None
        self._spare: dict[int, list[np.ndarray]] = {}
        self._spare_bytes = 0
        self.nbytes = 0
        self._dropped_upto: CallId = (0, 0)  # calls before this were dropped (or never made)
        # the latest version that lost one of its own results for want of room while it was
        # the version being made: no restart can replay it any more (-1: none)
        self.overflowed = -1
        # the calls made before the program's first load_checkpoint, kept for good
        # (keep_bootstrap); None until that first load_checkpoint
        self._boot: dict[CallId, tuple[CallDescriptor, bytes]] | None = None

    def fits(self, size: int) -> bool:
        """Whether a result of ``size`` bytes can be kept at all (``rabit2_replay_mb``): a
        result alone in the store may take the whole bound, ``ENTRY_COST`` over it."""
        return size <= self.limit

    @property
    def charged(self) -> int:
        """What the kept results count against the bound: their bytes and ``ENTRY_COST``
        each."""
        return self.nbytes + ENTRY_COST * len(self._results)

    def wants(self, call: CallId) -> bool:
        """False once ``call``'s version has lost one of its own results (``overflowed``):
        no restart can replay that version any more, so keeping its later results would
        only cost copies and memory.  They are kept again from the next version on."""
        return call[0] != self.overflowed

    def add(self, call: CallId, desc: CallDescriptor, pieces: Sequence[memoryview]) -> None:
        """Keep a copy of the result, given as the pieces it is made of."""
        size = pieces[0].nbytes if len(pieces) == 1 else sum(p.nbytes for p in pieces)
        if not self.wants(call) or not self.fits(size):
            self._make_room(call, size)  # never kept: forget what came before it, copy nothing
            return
        if size <= SMALL_RESULT:
            if self._make_room(call, size):
                slab = self._slab_for(size)
                self._results[call] = (desc, slab.put(pieces, size), slab)
                self.nbytes += size
            return
        blob = self.take(size)
        pos = 0
        for piece in pieces:
            blob[pos : pos + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            pos += len(piece)
        self.keep(call, desc, blob)

    def take(self, size: int) -> np.ndarray:
        """A buffer for a result that is being made (a recycled one when possible, room in a
        slab for a small one); hand it back with :meth:`keep`, or drop it.  (One at a time
        for small results: taking another gives up the room of one not kept.)"""
        if size <= SMALL_RESULT:
            self._give_up_reserved()
            slab = self._slab_for(size)
            blob = slab.reserve(size)
            self._reserved = (blob, slab)
            return blob
        spare = self._spare.get(size)
        if spare:
            self._spare_bytes -= size
            return spare.pop()
        self._trim_spares(self.limit - size - self.charged)
        return fresh_buffer(size)

    def make_ready(self, size: int) -> None:
        """Make the memory the next result of ``size`` bytes will be kept in, and its pages,
        ahead of the call that makes it: a call that waits for a peer does it while it
        waits (``docs/performance.md``, "Kept results made while waiting").  Room in a slab
        for a small result; for a larger one a spare buffer of that size, within the same
        bound as the spares :meth:`keep` leaves (nothing if one is there already)."""
        if size <= SMALL_RESULT:
            self._slab_for(size).make_ready(size)
            return
        if (self._spare.get(size)
                or self.charged + self._spare_bytes + size + ENTRY_COST > self.limit):
            return
        blob = fresh_buffer(size)
        blob[:: mmap.PAGESIZE] = 0  # (each page made: what the first copy would pay)
        self._to_spares(blob)

    def keep(self, call: CallId, desc: CallDescriptor, blob: np.ndarray) -> None:
        """Keep ``blob`` (from :meth:`take`, filled with the result) without copying it; if
        the result cannot be kept, the buffer goes back to the spares (within the bound)."""
        reserved = self._reserved
        if reserved is not None and reserved[0] is blob:
            self._reserved = None
            if self._make_room(call, blob.nbytes):
                self._results[call] = (desc, blob, reserved[1])
                self.nbytes += blob.nbytes
            else:
                self._unref(reserved[1])
            return
        if self._make_room(call, blob.nbytes):
            self._results[call] = (desc, blob, None)
            self.nbytes += blob.nbytes
        elif self.charged + self._spare_bytes + blob.nbytes <= self.limit:
            self._to_spares(blob)

    def _make_room(self, call: CallId, size: int) -> bool:
        """Drop the oldest results until ``size`` more bytes fit; False if the result is not
        to be kept (it never fits, or its version lost a result: then everything up to it
        is forgotten)."""
        if not self.fits(size) or not self.wants(call):
            self.clear_before((call[0], call[1] + 1))
            self.overflowed = max(self.overflowed, call[0])
            return False
        while self._results and self.charged + size + ENTRY_COST > self.limit:
            old, (_, blob, slab) = self._results.popitem(last=False)
            self._release(blob, slab)
            self._dropped_upto = (old[0], old[1] + 1)
            if old[0] == call[0]:
                self.overflowed = max(self.overflowed, call[0])
        if not self.wants(call):  # (it just lost one: this one is no use either)
            self.clear_before((call[0], call[1] + 1))
            return False
        return True

    def _slab_for(self, size: int) -> Slab:
        """The slab a small result of ``size`` bytes goes to: the current one while it has
        room, then an emptied one, then a new one."""
        slab = self._slab
        if slab is not None and slab.pos + size <= len(slab.data):
            return slab
        slab = self._slab = (self._empty_slabs.pop() if self._empty_slabs
                             else Slab(self._slab_size))
        slab.pos = 0
        return slab

    def _release(self, blob: np.ndarray | memoryview, slab: Slab | None) -> None:
        """Keep a dropped buffer for the next result of its size (within the same bound:
        retained and spare bytes together stay under ``limit``), or its slab once every
        result in it has gone."""
        self.nbytes -= blob.nbytes
        if slab is None:
            assert isinstance(blob, np.ndarray)
            self._to_spares(blob)
        else:
            self._unref(slab)

    def _give_up_reserved(self) -> None:
        if self._reserved is not None:
            self._unref(self._reserved[1])
            self._reserved = None

    def _unref(self, slab: Slab) -> None:
        slab.live -= 1
        if slab.live:
            return
        if slab is self._slab:
            slab.pos = 0  # (its first pages were made already)
        elif len(self._empty_slabs) < 2:
            self._empty_slabs.append(slab)

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

    def keep_bootstrap(self, calls: int) -> str | None:
        """The program's first ``load_checkpoint``, after ``calls`` collectives of version 0:
        keep their results for the rest of the job (rabit's bootstrap cache), so that a
        worker restarted after later checkpoints replays them before it loads.  Only all of
        them or none: a replay needs every one, and the store may have dropped some already
        (``rabit2_replay_mb``), or they would take more than half of it: they count against
        the bound for good.  Later calls change nothing.  Why none are kept where some
        were made (None: kept, or none made)."""
        if self._boot is not None:
            return None
        self._boot = {}
        wanted = [(0, seqno) for seqno in range(calls)]
        if not all(call in self._results for call in wanted):
            return "the store dropped some of their results already"
        data = sum(self._results[call][1].nbytes for call in wanted)
        size = data + ENTRY_COST * len(wanted)
        if size > self.limit // 2:
            return (f"their results ({data} B, {size} B as kept) would take more than half "
                    "of it")
        for call in wanted:
            desc, blob, slab = self._results.pop(call)
            self._boot[call] = (desc, bytes(blob))  # (its own memory: slabs are reused)
            self._release(blob, slab)
        self.limit -= size
        return None

    @property
    def bootstrap_calls(self) -> int:
        """How many calls from ``(0, 0)`` on are kept for good (:meth:`keep_bootstrap`)."""
        return len(self._boot) if self._boot else 0

    def get(self, call: CallId) -> tuple[CallDescriptor, memoryview] | None:
        got = self._results.get(call)
        if got is None:
            boot = self._boot.get(call) if self._boot else None
            return None if boot is None else (boot[0], memoryview(boot[1]))
        desc, blob, slab = got
        if slab is not None:
            # a copy: the slab's bytes are used again once the result is dropped, perhaps
            # while a send of them still waits for the kernel
            return desc, memoryview(blob.tobytes())
        assert isinstance(blob, np.ndarray)
        return desc, blob.data

    def on_checkpoint(self, version: int, keep_from: int | None = None) -> None:
        """``version`` was just taken: keep the calls of ``version - 1`` on (of ``keep_from``
        on, if that is older), drop the rest."""
        oldest = version - GENERATIONS + 1
        if keep_from is not None:
            oldest = min(oldest, keep_from)
        self.clear_before((max(0, oldest), 0))

    def clear_before(self, call: CallId) -> None:
        for key in [k for k in self._results if k < call]:
            _, blob, slab = self._results.pop(key)
            self._release(blob, slab)
        self._dropped_upto = max(self._dropped_upto, call)

    @property
    def oldest(self) -> CallId:
        """The first call that may be retained: everything before it is gone."""
        return self._dropped_upto
