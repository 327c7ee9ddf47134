"""The replay store's slabs: small results kept back to back, their memory used again."""

from __future__ import annotations

import numpy as np
import pytest

from rabit2.core.framing import CallDescriptor, CollectiveKind
from rabit2.core.recovery import store as store_mod
from rabit2.core.recovery.store import ENTRY_COST, SMALL_RESULT, ResultStore, Slab

DESC = CallDescriptor(CollectiveKind.ALLREDUCE_PAIR, 0, 0, 0, 0)


def _result(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_small_results_come_back_whole_and_as_copies() -> None:
    """Each result comes back byte for byte, whatever the format and number of its pieces,
    and what ``get`` hands out does not change when the slab is used again."""
    store = ResultStore(limit=1 << 20)
    floats = np.arange(1000, dtype=np.float32)
    store.add((0, 0), DESC, [memoryview(floats)])  # a typed view, not bytes
    parts = _result(1, 3000)
    store.add((0, 1), DESC, [memoryview(parts[:1000]), memoryview(parts[1000:])])
    got0, got1 = store.get((0, 0)), store.get((0, 1))
    assert got0 is not None and got1 is not None
    assert bytes(got0[1]) == floats.tobytes() and bytes(got1[1]) == parts.tobytes()
    store.clear_before((1, 0))  # both dropped: the slab starts over
    store.add((1, 0), DESC, [memoryview(np.zeros(4000, np.uint8))])
    assert bytes(got0[1]) == floats.tobytes()  # (a copy, not the slab's bytes)
    assert store.nbytes == 4000


def test_an_emptied_slab_is_used_again_not_fresh_memory() -> None:
    """Results fill slabs in call order; once every result of a slab is dropped, later
    results go to the same memory."""
    store = ResultStore(limit=64 << 20)
    size = SMALL_RESULT
    per_slab = len(Slab(store._slab_size).data) // size
    for seqno in range(per_slab + 1):  # the last one opens a second slab
        store.add((0, seqno), DESC, [memoryview(_result(seqno, size))])
    first = store._results[(0, 0)][2]
    second = store._results[(0, per_slab)][2]
    assert first is not None and second is not None and first is not second
    store.on_checkpoint(2)  # drops version 0: both slabs empty
    assert store.nbytes == 0 and store._empty_slabs == [first] and second.pos == 0
    for seqno in range(per_slab + 1):
        store.add((2, seqno), DESC, [memoryview(_result(100 + seqno, size))])
    assert store._results[(2, 0)][2] is second and store._results[(2, per_slab)][2] is first
    for seqno in (0, per_slab // 2, per_slab):
        got = store.get((2, seqno))
        assert got is not None and bytes(got[1]) == _result(100 + seqno, size).tobytes()


def test_the_bound_still_drops_the_oldest_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slabs do not change what is kept: the oldest results go once the results exceed the
    bound.  (Also where the kernel cannot make pages ahead: the copies touch them.)"""
    monkeypatch.setattr(Slab, "populate", False)
    store = ResultStore(limit=10_000 + 3 * ENTRY_COST)
    for seqno in range(3):
        store.add((0, seqno), DESC, [memoryview(_result(seqno, 3000))])
    store.on_checkpoint(1)  # (version 0 is kept: a neighbour may still resume there)
    store.add((1, 0), DESC, [memoryview(_result(3, 3000))])
    assert store.nbytes == 9000 and store.oldest == (0, 1) and store.overflowed == -1
    assert store.get((0, 0)) is None
    got = store.get((1, 0))
    assert got is not None and bytes(got[1]) == _result(3, 3000).tobytes()


def test_pages_are_made_ahead_of_the_copies() -> None:
    """A slab makes the pages of a step at once, then none until a result goes past them."""
    slab = Slab(1 << 20)
    slab.put([memoryview(bytes(100))], 100)
    assert slab.ready == min(store_mod.POPULATE_STEP, 1 << 20)
    slab.put([memoryview(bytes(slab.ready))], slab.ready)
    assert slab.ready >= slab.pos and slab.live == 2


def test_a_result_made_in_reserved_room_is_kept_without_a_copy() -> None:
    """``take`` of a small size reserves room in a slab; ``keep`` of that very buffer keeps
    it there.  Room taken and never kept is given up at the next ``take``, and a result
    that is not to be kept gives its room back."""
    store = ResultStore(limit=1 << 20)
    room = store.take(4096)
    room[:] = _result(7, 4096)
    store.keep((0, 0), DESC, room)
    got = store.get((0, 0))
    assert got is not None and bytes(got[1]) == _result(7, 4096).tobytes()
    slab = store._results[(0, 0)][2]
    assert slab is not None and slab.live == 1
    store.take(4096)  # never kept ...
    assert slab.live == 2
    room = store.take(2048)  # ... given up here
    assert slab.live == 2
    store.keep((0, 1), DESC, room)
    assert store.nbytes == 4096 + 2048 and slab.live == 2
    store.on_checkpoint(2)
    assert store.nbytes == 0 and slab.live == 0 and slab.pos == 0
    over = ResultStore(limit=1000)
    room = over.take(4096)  # (larger than the bound: the caller asks fits() first)
    over.keep((0, 0), DESC, room)
    assert over.get((0, 0)) is None and over.nbytes == 0


def test_memory_made_ahead_is_what_the_next_result_takes() -> None:
    """``make_ready`` (a call waiting for a peer): a large result's buffer is made as a spare
    that the result then takes, once, within the bound; a small one's room in the slab has
    its pages made, and the result still goes to that room."""
    store = ResultStore(limit=1 << 20)
    large = SMALL_RESULT + 4096
    store.make_ready(large)
    spare = store._spare[large][0]
    store.make_ready(large)  # (one is there: nothing more)
    assert store._spare[large] == [spare] and store._spare_bytes == large
    blob = store.take(large)
    assert blob is spare and store._spare_bytes == 0
    blob[:] = _result(1, large)
    store.keep((0, 0), DESC, blob)
    got = store.get((0, 0))
    assert got is not None and bytes(got[1]) == _result(1, large).tobytes()
    store.make_ready(1 << 20)  # (kept bytes and spares would pass the bound: none made)
    assert (1 << 20) not in store._spare
    slab = store._slab_for(100)
    size = slab.ready - slab.pos + 100  # (past the pages made so far)
    at = slab.pos
    store.make_ready(size)
    ready = slab.ready
    assert ready >= at + size
    room = store.take(size)
    assert slab.ready == ready  # (no page made on the call's path)
    assert room.nbytes == size and slab.pos == at + size


def test_the_calls_before_the_first_load_are_kept_for_good() -> None:
    """keep_bootstrap: the results of calls (0, 0)..(0, n-1) outlive every later checkpoint,
    come back byte for byte, and count against the bound; a second load changes nothing."""
    store = ResultStore(limit=1 << 20)
    results = [_result(seed, 100 + seed) for seed in range(3)]
    for seqno, res in enumerate(results):
        store.add((0, seqno), DESC, [memoryview(res)])
    store.keep_bootstrap(2)  # the program loads after its second call
    store.add((0, 2), DESC, [memoryview(results[2])])  # (again: a later call of version 0)
    store.on_checkpoint(5)
    assert store.bootstrap_calls == 2 and store.oldest == (4, 0)
    for seqno in range(2):
        got = store.get((0, seqno))
        assert got is not None and bytes(got[1]) == results[seqno].tobytes()
    assert store.get((0, 2)) is None
    assert store.limit == (1 << 20) - 100 - 101 - 2 * ENTRY_COST  # (with what each costs)
    store.keep_bootstrap(3)
    assert store.bootstrap_calls == 2


@pytest.mark.parametrize("case", ["dropped", "over half", "checkpointed first"])
def test_calls_before_the_first_load_are_kept_all_or_none(case: str) -> None:
    """None is kept where a replay could not use them all (one was dropped), where they
    would take more than half the bound, or where the program checkpointed before loading."""
    store = ResultStore(limit=10_000)
    sizes = {"dropped": [6000, 6000], "over half": [3000, 2500],
             "checkpointed first": [100, 100]}[case]
    for seqno, size in enumerate(sizes):
        store.add((0, seqno), DESC, [memoryview(_result(seqno, size))])
    why = store.keep_bootstrap(0 if case == "checkpointed first" else 2)
    assert why == {"dropped": "the store dropped some of their results already",
                   "over half": f"their results (5500 B, {5500 + 2 * ENTRY_COST} B as kept) "
                                "would take more than half of it",
                   "checkpointed first": None}[case]
    assert store.bootstrap_calls == 0 and store.limit == 10_000
    store.keep_bootstrap(2)  # (decided at the first load)
    assert store.bootstrap_calls == 0


LARGE = SMALL_RESULT + 1  # the smallest result kept in a buffer of its own, not a slab


def _take_and_keep(store: ResultStore, call: tuple[int, int], size: int) -> np.ndarray:
    blob = store.take(size)
    blob[:] = _result(call[1], size)
    store.keep(call, DESC, blob)
    return blob


def test_a_result_that_is_not_kept_never_leaves_spares_over_the_bound() -> None:
    """``keep`` of a result the store cannot keep puts its buffer with the spares only while
    kept and spare bytes together stay within the bound."""
    store = ResultStore(limit=3 * (LARGE + ENTRY_COST))
    for seqno in range(3):
        _take_and_keep(store, (0, seqno), LARGE)
    assert store.nbytes == 3 * LARGE and store._spare_bytes == 0
    lost = _take_and_keep(store, (0, 3), LARGE)  # version 0 loses (0, 0): none kept now
    assert store.overflowed == 0 and store.nbytes == 0
    assert store.nbytes + store._spare_bytes == 3 * LARGE <= store.limit
    assert len(store._spare[LARGE]) == 3 and all(b is not lost for b in store._spare[LARGE])
    # exactly at the bound: the buffer of a result not kept goes back to the spares
    blob = store.take(LARGE)
    assert store._spare_bytes == 2 * LARGE
    store.keep((0, 4), DESC, blob)
    assert store.get((0, 4)) is None and store._spare_bytes == 3 * LARGE
    # a result larger than the bound is never kept, nor its buffer
    over = ResultStore(limit=LARGE)
    _take_and_keep(over, (0, 0), 2 * LARGE)
    assert over.get((0, 0)) is None and over.nbytes == 0 and over._spare_bytes == 0
    assert over._spare == {}


def test_taking_a_buffer_of_a_new_size_frees_older_spares_within_the_bound() -> None:
    """``take`` of a size no spare has frees spares until kept bytes, spares and the new
    buffer fit in the bound, and no more."""
    store = ResultStore(limit=4 * LARGE)
    _take_and_keep(store, (0, 0), LARGE)
    _take_and_keep(store, (0, 1), LARGE)
    store.on_checkpoint(2)  # both dropped: two spares of their size
    assert store.nbytes == 0 and store._spare_bytes == 2 * LARGE
    store.take(2 * LARGE)  # (never kept) exactly fits beside both spares
    assert store._spare_bytes == 2 * LARGE and len(store._spare[LARGE]) == 2
    store.take(3 * LARGE)
    assert store.nbytes + store._spare_bytes + 3 * LARGE <= store.limit
    assert store._spare_bytes == LARGE and len(store._spare[LARGE]) == 1
    _take_and_keep(store, (2, 0), LARGE)  # takes the last spare
    assert store.nbytes == LARGE and store._spare == {LARGE: []}
    store.clear_before((3, 0))
    assert store._spare_bytes == LARGE
    store.take(3 * LARGE + 1)  # one byte more than fits beside it
    assert store._spare_bytes == 0 and store._spare == {}


def test_results_that_add_up_to_the_bound_are_all_kept_and_one_byte_more_drops_the_oldest(
) -> None:
    """Each result counts its bytes and ``ENTRY_COST`` against the bound (one alone may
    take the whole bound: a 256 MiB result under the default 256 MiB is kept)."""
    store = ResultStore(limit=10_000 + 2 * ENTRY_COST)
    assert store.fits(store.limit) and not store.fits(store.limit + 1)
    alone = ResultStore(limit=LARGE)
    _take_and_keep(alone, (0, 0), LARGE)
    assert alone.get((0, 0)) is not None and alone.charged == LARGE + ENTRY_COST
    store.add((0, 0), DESC, [memoryview(_result(0, 6000))])
    store.add((1, 0), DESC, [memoryview(_result(1, 4000))])
    assert store.nbytes == 10_000 and store.oldest == (0, 0)
    assert store.get((0, 0)) is not None and store.get((1, 0)) is not None
    store.add((2, 0), DESC, [memoryview(_result(2, 1))])
    assert store.get((0, 0)) is None and store.oldest == (0, 1)
    assert store.nbytes == 4001 and store.overflowed == -1
    # large results, and the spares made ahead for them, to the byte the same way
    large = ResultStore(limit=2 * (LARGE + ENTRY_COST))
    _take_and_keep(large, (0, 0), LARGE)
    large.make_ready(LARGE + 1)  # one byte past the bound: not made
    assert large._spare_bytes == 0
    large.make_ready(LARGE)  # exactly the bound: made
    assert large._spare_bytes == LARGE
    _take_and_keep(large, (1, 0), LARGE)
    assert large.nbytes == 2 * LARGE and large.get((0, 0)) is not None
    _take_and_keep(large, (2, 0), 1 + SMALL_RESULT + 1)
    assert large.get((0, 0)) is None and large.get((1, 0)) is None
    assert large.oldest == (1, 1) and large.nbytes == LARGE + 1


def test_many_tiny_results_stay_within_the_bound_in_memory() -> None:
    """The bound holds for what the store takes in memory, not only for result bytes: a
    loop of 8-byte calls that never checkpoints keeps as many results as their bytes and
    the objects holding them fit in, and then its version is lost for replay (before each
    result was charged its objects, 50 000 of them took some 24 MB of Python objects under
    a 4 MiB bound, and the bound would have applied only at 524 288)."""
    import tracemalloc  # noqa: PLC0415

    limit = 4 << 20
    store = ResultStore(limit=limit)
    fit = limit // (8 + ENTRY_COST)
    lost_at = None
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seqno in range(50_000):
            desc = CallDescriptor(CollectiveKind.ALLREDUCE_PAIR, 0, 0, 0, 8)
            store.add((0, seqno), desc, [memoryview(np.full(8, seqno % 256, np.uint8))])
            if seqno == fit - 1:
                assert len(store._results) == fit and store.charged <= limit
                got = store.get((0, seqno))
                assert got is not None and bytes(got[1]) == bytes([seqno % 256]) * 8
            if lost_at is None and store.overflowed == 0:
                lost_at = seqno
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert lost_at == fit and not store._results
    assert peak <= fit * ENTRY_COST, (peak, fit)  # the charge covers what it holds
