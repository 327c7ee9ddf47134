"""Schedules and the agent over the seeded in-memory network, checked against numpy."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from rabit2.core.agent import Call
from rabit2.core.framing import HEADER_SIZE, CollectiveKind
from rabit2.core.ops import SUPPORTED_DTYPES, Op
from rabit2.core.schedule import ring_segments
from rabit2.core.topology import topology
from tests.sim.simnet import SimNet

WORLDS = [1, 2, 3, 4, 5, 7, 8, 16, 17]
ALGOS = {"tree": CollectiveKind.ALLREDUCE_TREE, "ring": CollectiveKind.ALLREDUCE_RING,
         "pair": CollectiveKind.ALLREDUCE_PAIR}


def counts(world: int) -> list[int]:
    return sorted({0, 1, max(world - 1, 0), world, world + 1, 3000})


def run_allreduce(world: int, count: int, algo: str, dtype: np.dtype, op: Op, seed: int,
                  max_piece: int = 4099) -> tuple[list[np.ndarray], list[np.ndarray], SimNet]:
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        data = [rng.standard_normal(count).astype(dtype) for _ in range(world)]
    else:
        info = np.iinfo(dtype)
        data = [rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
                for _ in range(world)]
    bufs = [d.copy() for d in data]
    net = SimNet(world, seed=seed, max_piece=max_piece, tree_chunk=1024,
                 ring_mincount=10**12 if algo == "tree" else 0)
    calls = {r: Call(ALGOS[algo], memoryview(bufs[r]).cast("B"), dtype, op)
             for r in range(world)}
    net.run(calls)
    assert not net.failed, net.failed
    assert len(net.done) == world
    return data, bufs, net


# the pair exchange exists for world size 2 only
_ALLREDUCE_CASES = [(w, a) for a in ("tree", "ring") for w in WORLDS] + [(2, "pair")]


@pytest.mark.parametrize(("world", "algo"), _ALLREDUCE_CASES)
def test_allreduce_sum_matches_numpy(world: int, algo: str) -> None:
    for count in counts(world):
        data, bufs, net = run_allreduce(world, count, algo, np.dtype(np.int64), Op.SUM,
                                        seed=world * 7919 + count)
        expect = np.sum(data, axis=0, dtype=np.int64)
        for r in range(world):
            assert bufs[r].tobytes() == expect.tobytes(), (r, count)
        for agent in net.agents.values():
            assert agent.active is None


_NP = {Op.SUM: np.add, Op.PROD: np.multiply, Op.MAX: np.maximum, Op.MIN: np.minimum,
       Op.BITOR: np.bitwise_or, Op.BITAND: np.bitwise_and, Op.BITXOR: np.bitwise_xor}


# bitwise ops on floats are rejected at the API, so they never reach a schedule
_DTYPE_OP_CASES = [
    pytest.param(dtype, op, id=f"{op.name}-{dtype}")
    for dtype in SUPPORTED_DTYPES
    for op in Op
    if not (dtype.kind == "f" and op in (Op.BITOR, Op.BITAND, Op.BITXOR))
]


@pytest.mark.parametrize(("dtype", "op"), _DTYPE_OP_CASES)
def test_every_dtype_and_op(dtype: np.dtype, op: Op) -> None:
    for world, algo in ((3, "tree"), (4, "ring"), (2, "pair")):
        data, bufs, _ = run_allreduce(world, 37, algo, dtype, op, seed=int(op) * 31 + world)
        # floats: every rank holds the same bytes; integers: equal to numpy whatever the order
        for r in range(1, world):
            assert bufs[r].tobytes() == bufs[0].tobytes()
        if dtype.kind != "f":
            expect = data[0].copy()
            for d in data[1:]:
                _NP[op](expect, d, out=expect, casting="no")
            assert bufs[0].tobytes() == expect.tobytes()
        else:
            expect = data[0].astype(np.float64)
            for d in data[1:]:
                expect = _NP[op](expect, d.astype(np.float64))
            np.testing.assert_allclose(bufs[0].astype(np.float64), expect, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_from_every_root(world: int) -> None:
    for count in counts(world):
        for root in range(world):
            rng = np.random.default_rng(count + root)
            src = rng.integers(0, 255, count, dtype=np.uint8)
            bufs = [src.copy() if r == root else np.zeros(count, np.uint8) for r in range(world)]
            net = SimNet(world, seed=root * 13 + count, max_piece=1500)
            net.run({r: Call(CollectiveKind.BROADCAST, memoryview(bufs[r]), root=root)
                     for r in range(world)})
            assert not net.failed and len(net.done) == world
            for r in range(world):
                assert bufs[r].tobytes() == src.tobytes()


@pytest.mark.parametrize("world", WORLDS)
def test_allgather_variable_blocks(world: int) -> None:
    sizes = [(r * 5 + 3) % 7 for r in range(world)]
    offsets = np.cumsum([0, *sizes])
    blocks = tuple((int(offsets[r]), int(offsets[r + 1])) for r in range(world))
    full = np.arange(offsets[-1], dtype=np.uint8)
    bufs = []
    for lo, hi in blocks:
        b = np.zeros(offsets[-1], np.uint8)
        b[lo:hi] = full[lo:hi]
        bufs.append(b)
    net = SimNet(world, seed=world)
    net.run({r: Call(CollectiveKind.ALLGATHER, memoryview(bufs[r]), blocks=blocks)
             for r in range(world)})
    assert not net.failed and len(net.done) == world
    for b in bufs:
        assert b.tobytes() == full.tobytes()


def test_large_ring_and_tree_pipelining() -> None:
    for algo in ("tree", "ring"):
        data, bufs, _ = run_allreduce(5, 300_000, algo, np.dtype(np.float32), Op.SUM, seed=5,
                                      max_piece=1 << 16)
        for r in range(1, 5):
            assert bufs[r].tobytes() == bufs[0].tobytes()
        np.testing.assert_allclose(bufs[0], np.sum(data, axis=0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ring", [1 << 20, 1024])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.int64])
def test_the_ring_reduce_scatter_lands_round_and_round_in_bounded_scratch(
        monkeypatch: pytest.MonkeyPatch, world: int, dtype: type, ring: int) -> None:
    """The ring's reduce-scatter lands in a cyclic buffer of the link's scratch: however
    large the call, the scratch stays at ``LANDING_RING`` bytes, no byte is overwritten
    before it is reduced (the plans' invariants hold after every delivery) and every rank
    ends with numpy's result.  ``ring=1024`` wraps every few hundred bytes, with
    deliveries of many sizes around the wrap."""
    small = ring < 4096
    monkeypatch.setattr("rabit2.core.schedule.MIN_RING_REDUCE", 256 if small else 64 * 1024)
    monkeypatch.setattr("rabit2.core.schedule.LANDING_RING", ring)
    itemsize = np.dtype(dtype).itemsize
    count = 6007 if small else 3 * (1 << 20) // itemsize
    rng = np.random.default_rng(world * itemsize)
    data = [rng.integers(-100, 100, count).astype(dtype) for _ in range(world)]
    if np.dtype(dtype).kind == "i":
        info = np.iinfo(dtype)
        data[0][:3] = [info.min, info.max, 0]
    expect = np.max(data, axis=0)

    def check(net: SimNet) -> None:
        for agent in net.agents.values():
            if agent.active is not None:
                agent.active.plan.check_invariants()

    for max_piece in ((1 << 18, 997) if not small else (4099, 333, 61)):
        bufs = [d.copy() for d in data]
        net = SimNet(world, seed=world + max_piece, max_piece=max_piece, ring_mincount=0)
        net.run({r: Call(CollectiveKind.ALLREDUCE_RING, memoryview(bufs[r]).cast("B"),
                         np.dtype(dtype), Op.MAX) for r in range(world)},
                cut=check if small else None)
        assert not net.failed and len(net.done) == world
        for r in range(world):
            assert bufs[r].tobytes() == expect.tobytes(), (r, max_piece)
            for link in net.agents[r].links.values():
                assert link.scratch.nbytes <= ring, (r, link.scratch.nbytes)


@pytest.mark.parametrize("algo", ["tree", "ring", "pair"])
def test_a_finished_call_holds_no_reference_to_the_callers_array(algo: str) -> None:
    """Once a call is over, nothing keeps the caller's array alive, without the cycle
    collector's help (a reference cycle through a plan made the arrays of every call wait
    for a collection: a 3-4 ms pause at an arbitrary later call)."""
    gc.collect()
    gc.disable()
    try:
        world = 2 if algo == "pair" else 4
        bufs = [np.full(300_000, r, dtype=np.float32) for r in range(world)]
        refs = [weakref.ref(b) for b in bufs]
        net = SimNet(world, seed=1, ring_mincount=0 if algo == "ring" else 10**12)
        net.run({r: Call(ALGOS[algo], memoryview(bufs[r]).cast("B"), np.dtype(np.float32),
                         Op.SUM) for r in range(world)})
        assert not net.failed and len(net.done) == world
        assert all((b == sum(range(world))).all() for b in bufs)
        del bufs
        assert [r() for r in refs] == [None] * world
    finally:
        gc.enable()


@pytest.mark.parametrize("world", [3, 5, 8, 16, 17])
def test_bytes_per_link_match_docs(world: int) -> None:
    """docs/algorithms.md: the tree moves N each way on every tree edge and nothing else;
    the ring moves 2N - |seg r| - |seg r-1| from r to r-1 only (2(n-1)/n N when even)."""
    count = 10_000
    nbytes = count * 8
    segs = ring_segments(nbytes, 8, world)
    for algo in ("tree", "ring"):
        _, _, net = run_allreduce(world, count, algo, np.dtype(np.float64), Op.SUM, seed=1,
                                  max_piece=1 << 16)
        for (src, dst), sent in net.bytes_on_link.items():
            if algo == "tree":
                expected = nbytes if dst in topology(src, world).tree_neighbors else 0
            elif dst == (src - 1) % world:
                mine, prev = segs[src], segs[(src - 1) % world]
                expected = 2 * nbytes - (mine[1] - mine[0]) - (prev[1] - prev[0])
            else:
                expected = 0
            headers = sent - expected
            # the only overhead is one 40-byte header per frame; a relay forwards each piece
            # as it lands (here pieces of at most 64 KiB), at least one per ring segment
            bound = HEADER_SIZE * (2 * world + nbytes // 2048)
            assert headers % HEADER_SIZE == 0 and 0 <= headers <= bound, (
                algo, src, dst, sent, expected)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_consecutive_calls_with_staggered_starts(world: int) -> None:
    """Ranks enter each call at different times: early frames are held, never lost."""
    net = SimNet(world, seed=world, max_piece=999, ring_mincount=64)
    rng = np.random.default_rng(world)
    for i, count in enumerate([10, 1000, 0, 77, 5000, 3]):
        data = [rng.integers(0, 1000, count).astype(np.int32) for _ in range(world)]
        bufs = [d.copy() for d in data]
        kind = net.agents[0].choose_allreduce(count * 4, 4)
        calls = {r: Call(kind, memoryview(bufs[r]).cast("B"), np.dtype(np.int32), Op.SUM)
                 for r in range(world)}
        order = list(range(world))
        net.rng.shuffle(order)
        net.done.clear()
        for r in order:  # start one rank, let the network run a while, start the next
            net.execute(r, net.agents[r].begin(calls[r], net.now))
            for _ in range(net.rng.randint(0, 50)):
                net.step()
        while net.step():
            pass
        assert not net.failed, (i, net.failed)
        assert len(net.done) == world, i
        expect = np.sum(data, axis=0, dtype=np.int32)
        for b in bufs:
            assert b.tobytes() == expect.tobytes()


def test_pair_exchange_agrees_bitwise_on_nan_payloads() -> None:
    """op(a, b) and op(b, a) may keep different NaNs: both ranks use one operand order."""
    a = np.array([np.nan, 1.0, -0.0], dtype=np.float64)
    b = np.array([np.nan, 2.0, 0.0], dtype=np.float64)
    b.view(np.uint64)[0] |= np.uint64(0x1234)  # a different NaN payload
    bufs = [a.copy(), b.copy()]
    for op in (Op.MAX, Op.MIN, Op.SUM):
        bufs = [a.copy(), b.copy()]
        net = SimNet(2, seed=3)
        net.run({r: Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[r]).cast("B"),
                         np.dtype(np.float64), op) for r in range(2)})
        assert not net.failed and len(net.done) == 2
        assert bufs[0].tobytes() == bufs[1].tobytes(), op


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_pair_exchange_bits_do_not_depend_on_how_bytes_arrive(seed: int, dtype: type) -> None:
    """Unchecked frames are reduced as they arrive, in pieces of any size: the pair still
    splits its reduction at fixed blocks only, so both ranks keep the NaN payloads a whole
    reduction in rank order keeps (numpy's vector loop and its tail can differ there)."""
    count = 300_007 // np.dtype(dtype).itemsize
    nan = {np.float16: 0x7E00, np.float32: 0x7FC00000, np.float64: 0x7FF8000000000000}[dtype]
    bits_of = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}[dtype]
    data = []
    for rank in range(2):
        a = np.random.default_rng(seed * 10 + rank).standard_normal(count).astype(dtype)
        a.view(bits_of)[::5] = nan | (rank + 1)
        data.append(a)
    for op, ufunc in ((Op.SUM, np.add), (Op.MAX, np.maximum)):
        bufs = [d.copy() for d in data]
        net = SimNet(2, seed=seed, max_piece=3001, checked=False)
        net.run({r: Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[r]).cast("B"),
                         np.dtype(dtype), op) for r in range(2)})
        assert not net.failed and len(net.done) == 2
        whole = ufunc(data[0], data[1])
        assert bufs[0].tobytes() == bufs[1].tobytes() == whole.tobytes(), op


def test_frames_are_split_at_the_u32_length_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream longer than a frame can describe goes out as several frames, in order."""
    import rabit2.core.sending as sending_module  # noqa: PLC0415

    monkeypatch.setattr(sending_module, "MAX_PAYLOAD", 1000)
    src = np.arange(5500, dtype=np.uint8)
    bufs = [src.copy(), np.zeros(5500, np.uint8), np.zeros(5500, np.uint8)]
    net = SimNet(3, seed=9, max_piece=1 << 16, checked=False)
    net.run({r: Call(CollectiveKind.BROADCAST, memoryview(bufs[r]), root=0) for r in range(3)})
    assert not net.failed and len(net.done) == 3
    assert all(b.tobytes() == src.tobytes() for b in bufs)
    assert net.agents[0].statistics().frames_sent >= 2 * 6  # 6 frames to each child


@pytest.mark.parametrize("world", [2, 3, 4])
def test_checked_frames_are_split_at_the_frame_limit(monkeypatch: pytest.MonkeyPatch,
                                                     world: int) -> None:
    """Checked frames are at most the frame limit long, and a receiver that takes them whole
    before it uses them still pipelines every schedule (a ring that wraps included)."""
    # (the limit the sender keeps and the receiver checks)
    monkeypatch.setattr("rabit2.core.sending.CHECKED_FRAME", 1000)
    monkeypatch.setattr("rabit2.core.pair.CHECKED_FRAME", 1000)
    monkeypatch.setattr("rabit2.core.schedule.MIN_RING_REDUCE", 256)
    monkeypatch.setattr("rabit2.core.schedule.LANDING_RING", 4096)
    n = 30_000
    net = SimNet(world, seed=world, max_piece=700, ring_mincount=1000)
    bufs = [np.full(n, r + 1, dtype=np.int64) for r in range(world)]
    calls = {}
    for r in range(world):
        raw = memoryview(bufs[r]).cast("B")
        kind = net.agents[r].choose_allreduce(len(raw), 8)
        calls[r] = Call(kind, raw, np.dtype(np.int64), Op.SUM)
    net.run(calls)
    assert not net.failed and len(net.done) == world
    assert all((b == sum(range(1, world + 1))).all() for b in bufs)
    sent = sum(a.statistics().frames_sent for a in net.agents.values())
    assert sent >= world * (n * 8 // world) // 1000  # (far more than one frame a step)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_broadcast_of_unknown_size_in_one_call(world: int) -> None:
    """Receivers learn the size from the root's first frame and name the payload's
    destination once the head has arrived, before any payload byte lands."""
    head = np.arange(80, dtype=np.uint8)
    for count in (0, 10, 5000, 100_000):
        for root in range(world):
            payload = (np.arange(count) % 251).astype(np.uint8)
            outs: dict[int, np.ndarray] = {}

            def call(r: int, root: int = root, count: int = count,
                     outs: dict[int, np.ndarray] = outs,
                     payload: np.ndarray = payload) -> Call:
                if r == root:
                    return Call(CollectiveKind.BROADCAST, memoryview(b""), root=root,
                                pieces=(memoryview(head), memoryview(payload)))

                def receive(h: memoryview) -> memoryview:
                    assert bytes(h) == head.tobytes()  # the head is complete first
                    outs[r] = np.empty(count, np.uint8)
                    return memoryview(outs[r])

                return Call(CollectiveKind.BROADCAST, memoryview(b""), root=root,
                            receive=receive, head_size=80)

            net = SimNet(world, seed=root + count, max_piece=3000)
            net.run({r: call(r) for r in range(world)})
            assert not net.failed and len(net.done) == world
            assert sorted(outs) == [r for r in range(world) if r != root]
            assert all(o.tobytes() == payload.tobytes() for o in outs.values())


def test_broadcast_head_that_names_no_buffer_fails_every_rank() -> None:
    """The receivers' callback rejects the head: a typed error everywhere, nothing sized."""
    def receive(h: memoryview) -> memoryview:
        raise ValueError("head names dtype #99")

    calls = {0: Call(CollectiveKind.BROADCAST, memoryview(b""), root=0,
                     pieces=(memoryview(bytes(80)), memoryview(bytes(64))))}
    calls.update({r: Call(CollectiveKind.BROADCAST, memoryview(b""), root=0, receive=receive,
                          head_size=80) for r in (1, 2, 3)})
    net = SimNet(4, seed=1)
    net.run(calls)
    assert set(net.failed) >= {1, 2, 3}
    from rabit2.errors import ProtocolError  # noqa: PLC0415

    assert all(isinstance(e, ProtocolError) for e in net.failed.values())
