"""The sans-I/O agent: framing on the receive side, held frames, failures, deadlines, stats.

Single agents are driven directly with hand-built frames; groups run over ``tests/sim/simnet.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rabit2.core.agent import (
    Agent,
    Call,
    CallComplete,
    CallFailed,
    CloseLink,
    Command,
    PauseReading,
    ResumeReading,
    Send,
)
from rabit2.core.framing import (
    HEADER_SIZE,
    NONE_U8,
    NONE_U16,
    CallDescriptor,
    CollectiveKind,
    FrameKind,
    decode_error,
    encode_error,
    pack_header,
    parse_header,
)
from rabit2.core.fsm import InvalidTransition, State
from rabit2.core.ops import Op, dtype_code
from rabit2.core.planning import AUTO_RING_MIN_BYTES, PAIR_MAX_BYTES
from rabit2.core.topology import topology
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RabitError,
)
from tests.sim.simnet import SimNet

BCAST = CollectiveKind.BROADCAST
TREE, RING = CollectiveKind.ALLREDUCE_TREE, CollectiveKind.ALLREDUCE_RING
PAIR = CollectiveKind.ALLREDUCE_PAIR
I64 = np.dtype(np.int64)


# ----------------------------------------------------------------------------- helpers


def ready_agent(rank: int, world: int, **kw: float) -> Agent:
    agent = Agent(**kw)  # type: ignore[arg-type]
    agent.start()
    agent.connect_tracker(rank, world)
    agent.connect_peers()
    agent.accept_peers(0.0)
    assert agent.state is State.READY
    return agent


def bcast_desc(root: int, nbytes: int) -> CallDescriptor:
    return CallDescriptor(BCAST, NONE_U8, NONE_U8, root, nbytes)


def data_frame(desc: CallDescriptor, call_id: tuple[int, int], offset: int,
               payload: bytes) -> bytes:
    return pack_header(FrameKind.DATA, desc, *call_id, offset, len(payload)) + payload


def error_frame(error_type: str, reason: str, origin: int) -> bytes:
    payload = encode_error(error_type, reason, origin)
    return pack_header(FrameKind.ERROR, bcast_desc(NONE_U16, 0), 0, 0, 0, len(payload)) + payload


def feed(agent: Agent, peer: int, data: bytes, piece: int | None = None,
         now: float = 0.0) -> tuple[list[Command], int]:
    """Deliver ``data`` from ``peer`` the way the I/O layer does: into ``recv_buffer``, at most
    ``piece`` bytes at a time.  Stops early when the agent pauses the link or fails the call.
    Returns the commands and how many bytes were consumed."""
    cmds: list[Command] = []
    pos = 0
    while pos < len(data):
        target = agent.recv_buffer(peer)
        assert len(target) > 0, "recv_buffer must never be empty"
        n = min(len(target), len(data) - pos, piece or len(data))
        target[:n] = data[pos : pos + n]
        pos += n
        out = agent.on_bytes(peer, n, now)
        cmds += out
        if any(isinstance(c, (PauseReading, CallFailed)) for c in out):
            break
    return cmds, pos


def of_type(cmds: list[Command], kind: type) -> list:  # type: ignore[type-arg]
    return [c for c in cmds if isinstance(c, kind)]


def only_failure(cmds: list[Command]) -> CallFailed:
    failures = of_type(cmds, CallFailed)
    assert len(failures) == 1, cmds
    return failures[0]  # type: ignore[no-any-return]


def error_sends(cmds: list[Command]) -> dict[int, tuple[str, str, int]]:
    """peer -> decoded ERROR frame, for every ERROR frame among ``cmds``."""
    out = {}
    for cmd in of_type(cmds, Send):
        header = parse_header(bytes(cmd.buffers[0]))
        if header.kind is FrameKind.ERROR:
            payload = b"".join(bytes(b) for b in cmd.buffers[1:])
            assert len(payload) == header.length
            out[cmd.peer] = decode_error(payload)
    return out


def bcast_call(buf: np.ndarray, root: int) -> Call:
    return Call(BCAST, memoryview(buf), root=root)


def rank0_of_two_receiving(nbytes: int, **kw: float) -> tuple[Agent, np.ndarray, list[Command]]:
    """Rank 0 of 2 in a broadcast from rank 1: it receives ``nbytes`` from rank 1."""
    agent = ready_agent(0, 2, **kw)
    buf = np.zeros(nbytes, np.uint8)
    cmds = agent.begin(bcast_call(buf, 1), 0.0)
    # the receiver announces itself with an empty frame towards the root
    (send,) = of_type(cmds, Send)
    header = parse_header(bytes(send.buffers[0]))
    assert (send.peer, header.kind, header.length, header.call_id) == (1, FrameKind.DATA, 0, (0, 0))
    return agent, buf, cmds


PAYLOAD = bytes(range(7, 7 + 50))


# ----------------------------------------------------------------------------- receive framing


@pytest.mark.parametrize("piece", [1, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, None])
def test_frame_delivered_in_any_pieces(piece: int | None) -> None:
    agent, buf, _ = rank0_of_two_receiving(len(PAYLOAD))
    frame = data_frame(bcast_desc(1, len(PAYLOAD)), (0, 0), 0, PAYLOAD)
    cmds, used = feed(agent, 1, frame, piece)
    assert used == len(frame)
    assert cmds == [CallComplete((0, 0))]
    assert buf.tobytes() == PAYLOAD
    assert agent.state is State.READY and agent.active is None


@pytest.mark.parametrize("piece", [1, 5, None])
def test_payload_split_over_several_frames(piece: int | None) -> None:
    agent, buf, _ = rank0_of_two_receiving(len(PAYLOAD))
    desc = bcast_desc(1, len(PAYLOAD))
    first = data_frame(desc, (0, 0), 0, PAYLOAD[:20])
    second = data_frame(desc, (0, 0), 20, PAYLOAD[20:])
    cmds, _ = feed(agent, 1, first, piece)
    assert cmds == [] and agent.state is State.BROADCAST
    cmds, _ = feed(agent, 1, second, piece)
    assert cmds == [CallComplete((0, 0))]
    assert buf.tobytes() == PAYLOAD


def test_recv_buffer_points_into_the_destination() -> None:
    agent, buf, _ = rank0_of_two_receiving(len(PAYLOAD))
    feed(agent, 1, pack_header(FrameKind.DATA, bcast_desc(1, 50), 0, 0, 0, 50))
    target = agent.recv_buffer(1)
    assert len(target) == 50
    target[:5] = b"\x01\x02\x03\x04\x05"  # zero copy: the bytes land in the user's array
    assert buf[:5].tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("piece", [1, 13, 45, None])
def test_trailing_frame_of_next_call_is_held_then_consumed(piece: int | None) -> None:
    agent, buf, _ = rank0_of_two_receiving(len(PAYLOAD))
    desc = bcast_desc(1, len(PAYLOAD))
    second_payload = bytes(reversed(PAYLOAD))
    stream = data_frame(desc, (0, 0), 0, PAYLOAD) + data_frame(desc, (0, 1), 0, second_payload)
    cmds, used = feed(agent, 1, stream, piece)
    # the first call completes; the next call's header is read and the link paused (the
    # agent may have read some of the payload behind that header too: it keeps it)
    assert cmds == [CallComplete((0, 0)), PauseReading(1)]
    assert len(PAYLOAD) + 2 * HEADER_SIZE <= used <= len(stream)
    assert agent.state is State.READY
    assert buf.tobytes() == PAYLOAD

    buf2 = np.zeros(len(PAYLOAD), np.uint8)
    begun = agent.begin(bcast_call(buf2, 1), 1.0)
    assert ResumeReading(1) in begun
    cmds, rest = feed(agent, 1, stream[used:], piece)
    assert used + rest == len(stream)
    assert of_type(begun + cmds, CallComplete) == [CallComplete((0, 1))]
    assert not of_type(begun + cmds, CallFailed)
    assert buf2.tobytes() == second_payload


@pytest.mark.parametrize("piece", [1, None])
def test_held_frame_survives_a_checkpoint(piece: int | None) -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    feed(agent, 1, data_frame(bcast_desc(1, 4), (0, 0), 0, b"abcd"))
    # the peer checkpointed and already started call (1, 0)
    frame = data_frame(bcast_desc(1, 4), (1, 0), 0, b"wxyz")
    cmds, used = feed(agent, 1, frame, piece)
    assert cmds == [PauseReading(1)]
    assert agent.checkpoint() == 1
    buf = np.zeros(4, np.uint8)
    begun = agent.begin(bcast_call(buf, 1), 0.0)
    assert ResumeReading(1) in begun
    cmds, _ = feed(agent, 1, frame[used:], piece)
    assert of_type(begun + cmds, CallComplete) == [CallComplete((1, 0))]
    assert buf.tobytes() == b"wxyz"


def test_checkpoint_inside_a_call_is_refused() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    with pytest.raises(RabitError, match="checkpoint"):
        agent.checkpoint()
    assert agent.version == 0


def test_bytes_on_a_held_link_are_a_protocol_error() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    desc = bcast_desc(1, 4)
    feed(agent, 1, data_frame(desc, (0, 0), 0, b"abcd") + data_frame(desc, (0, 1), 0, b"efgh"))
    target = agent.recv_buffer(1)  # the loop ignored PauseReading and read more
    target[:1] = b"e"
    cmds = agent.on_bytes(1, 1, 0.0)
    assert isinstance(only_failure(cmds).error, ProtocolError)
    assert CloseLink(1, str(only_failure(cmds).error)) in cmds
    assert agent.state is State.FAILED


def test_bytes_after_a_failure_are_discarded() -> None:
    # rank 1 of 3 receives a broadcast from rank 0 straight into the caller's array; the
    # call fails on another link while that payload is half read
    agent = ready_agent(1, 3)
    buf = np.zeros(8, np.uint8)
    agent.begin(bcast_call(buf, 0), 0.0)
    desc = bcast_desc(0, 8)
    feed(agent, 0, pack_header(FrameKind.DATA, desc, 0, 0, 0, 8) + b"\x01\x02\x03")
    assert buf.tolist()[:3] == [1, 2, 3]
    cmds, _ = feed(agent, 2, b"\x00" * HEADER_SIZE)
    assert isinstance(only_failure(cmds).error, ProtocolError)
    # the rest of the frame still arrives: it must not land in the caller's array, whose
    # owner has already been told that the call failed
    target = agent.recv_buffer(0)
    assert len(target) > 0 and not np.shares_memory(np.asarray(target), buf)
    target[:5] = b"\x09" * 5
    assert agent.on_bytes(0, 5, 1.0) == []
    assert buf.tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert agent.state is State.FAILED


def test_world_of_one_completes_at_once() -> None:
    agent = ready_agent(0, 1)
    buf = np.arange(4, dtype=np.int64)
    cmds = agent.begin(Call(TREE, memoryview(buf).cast("B"), I64, Op.SUM), 0.0)
    assert cmds == [CallComplete((0, 0))]
    assert buf.tolist() == [0, 1, 2, 3]
    assert agent.seqno == 1


def test_tracker_rank_out_of_range_is_protocol_error() -> None:
    agent = Agent()
    agent.start()
    with pytest.raises(ProtocolError):
        agent.connect_tracker(3, 3)


# ----------------------------------------------------------------------------- protocol breaches


def _three_rank_root() -> tuple[Agent, list[Command]]:
    """Rank 0 of 3 broadcasting 8 bytes to its children 1 and 2."""
    agent = ready_agent(0, 3)
    buf = np.arange(8, dtype=np.uint8)
    cmds = agent.begin(bcast_call(buf, 0), 0.0)
    assert {c.peer for c in of_type(cmds, Send)} == {1, 2}
    return agent, cmds


@pytest.mark.parametrize("piece", [1, None])
def test_garbage_header_fails_call_and_closes_link(piece: int | None) -> None:
    agent, _ = _three_rank_root()
    cmds, used = feed(agent, 1, b"\xde\xad" * (HEADER_SIZE // 2), piece)
    assert used == HEADER_SIZE
    failure = only_failure(cmds)
    assert failure.call_id == (0, 0)
    # (garbage fails the header's checksum before any field is looked at)
    assert isinstance(failure.error, ProtocolError) and "checksum" in str(failure.error)
    assert of_type(cmds, CloseLink) == [CloseLink(1, str(failure.error))]
    # the other neighbour is told, the offender is not
    sends = error_sends(cmds)
    assert set(sends) == {2}
    assert sends[2][0] == "protocol" and sends[2][2] == 0
    assert agent.state is State.FAILED and agent.active is None
    # every later call raises the recorded error
    err = failure.error
    with pytest.raises(type(err), match=re.escape(str(err))):
        agent.begin(bcast_call(np.zeros(8, np.uint8), 0), 1.0)


def test_wrong_offset_is_protocol_error() -> None:
    agent, _, _ = rank0_of_two_receiving(len(PAYLOAD))
    cmds, _ = feed(agent, 1, data_frame(bcast_desc(1, 50), (0, 0), 10, PAYLOAD[:10]))
    error = only_failure(cmds).error
    assert isinstance(error, ProtocolError) and "offset" in str(error)
    assert CloseLink(1, str(error)) in cmds


def test_offset_behind_stream_position_is_protocol_error() -> None:
    agent, _, _ = rank0_of_two_receiving(len(PAYLOAD))
    desc = bcast_desc(1, 50)
    assert feed(agent, 1, data_frame(desc, (0, 0), 0, PAYLOAD[:20]))[0] == []
    cmds, _ = feed(agent, 1, data_frame(desc, (0, 0), 0, PAYLOAD[:20]))  # a replay
    assert isinstance(only_failure(cmds).error, ProtocolError)


def test_overlong_frame_is_protocol_error() -> None:
    agent, buf, _ = rank0_of_two_receiving(len(PAYLOAD))
    header = pack_header(FrameKind.DATA, bcast_desc(1, 50), 0, 0, 0, 51)
    cmds, _ = feed(agent, 1, header)
    error = only_failure(cmds).error
    assert isinstance(error, ProtocolError) and "51 B" in str(error)
    assert not buf.any()


def test_overlong_second_frame_is_protocol_error() -> None:
    agent, _, _ = rank0_of_two_receiving(len(PAYLOAD))
    desc = bcast_desc(1, 50)
    feed(agent, 1, data_frame(desc, (0, 0), 0, PAYLOAD[:40]))
    cmds, _ = feed(agent, 1, pack_header(FrameKind.DATA, desc, 0, 0, 40, 11))
    assert isinstance(only_failure(cmds).error, ProtocolError)


def test_data_on_a_link_the_call_does_not_use() -> None:
    # world 5: rank 1's link to rank 3 is a tree link; a ring allreduce uses ranks 0 and 2 only
    assert topology(1, 5).neighbors == (0, 2, 3)
    agent = ready_agent(1, 5)
    buf = np.zeros(10, np.int64)
    agent.begin(Call(RING, memoryview(buf).cast("B"), I64, Op.SUM), 0.0)
    desc = CallDescriptor(RING, dtype_code(I64), int(Op.SUM), NONE_U16, 80)
    cmds, _ = feed(agent, 3, data_frame(desc, (0, 0), 0, bytes(8)))
    error = only_failure(cmds).error
    assert isinstance(error, ProtocolError) and "does not use" in str(error)
    assert CloseLink(3, str(error)) in cmds


def test_stale_frame_between_calls_is_a_sequence_mismatch() -> None:
    """A frame of a call this rank already finished: the call sequences diverged."""
    agent, _, _ = rank0_of_two_receiving(4)
    desc = bcast_desc(1, 4)
    feed(agent, 1, data_frame(desc, (0, 0), 0, b"abcd"))
    cmds, _ = feed(agent, 1, data_frame(desc, (0, 0), 0, b"abcd"))  # call (0, 0) again
    error = only_failure(cmds).error
    assert isinstance(error, MismatchError) and "sequence mismatch" in str(error)
    assert only_failure(cmds).call_id is None
    assert not of_type(cmds, CloseLink)  # flooded like any mismatch, the link is not at fault


def test_stale_frame_during_a_call_is_a_sequence_mismatch() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    desc = bcast_desc(1, 4)
    feed(agent, 1, data_frame(desc, (0, 0), 0, b"abcd"))
    agent.begin(bcast_call(np.zeros(4, np.uint8), 1), 0.0)
    cmds, _ = feed(agent, 1, data_frame(desc, (0, 0), 0, b"abcd"))
    failure = only_failure(cmds)
    assert isinstance(failure.error, MismatchError) and failure.call_id == (0, 1)


def test_extra_checkpoint_on_one_rank_fails_every_rank_at_once() -> None:
    """One rank checkpoints where the others do not: without the check every rank would wait
    for bytes that never come, until the progress deadline."""
    world = 5
    calls, _, _ = _allreduce_calls(world, 100, TREE, seed=2)
    net = SimNet(world, seed=2)
    net.agents[3].checkpoint()  # rank 3's next call is (1, 0); the others' is (0, 0)
    net.run(calls)
    assert set(net.failed) == set(range(world)) and net.done == {}
    assert all(isinstance(e, MismatchError) for e in net.failed.values()), net.failed
    assert any("sequence mismatch" in str(e) for e in net.failed.values())


def test_mismatched_descriptor_fails_and_tells_the_peer() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    cmds, _ = feed(agent, 1, data_frame(bcast_desc(1, 8), (0, 0), 0, b"abcdefgh"))
    failure = only_failure(cmds)
    assert isinstance(failure.error, MismatchError)
    assert "8 B" in str(failure.error) and "4 B" in str(failure.error)
    assert not of_type(cmds, CloseLink)  # a mismatch is not the link's fault
    assert error_sends(cmds)[1][0] == "mismatch"  # the rank that disagrees hears it too


def test_mismatch_on_a_held_frame_is_detected_when_the_call_begins() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    feed(agent, 1, data_frame(bcast_desc(1, 4), (0, 0), 0, b"abcd"))
    cmds, _ = feed(agent, 1, data_frame(bcast_desc(0, 4), (0, 1), 0, b""))
    assert cmds == [PauseReading(1)]
    cmds = agent.begin(bcast_call(np.zeros(4, np.uint8), 1), 0.0)
    assert isinstance(only_failure(cmds).error, MismatchError)
    assert ResumeReading(1) not in cmds


@pytest.mark.parametrize(
    ("error_type", "cls"),
    [("mismatch", MismatchError), ("peer_lost", PeerLostError), ("protocol", ProtocolError),
     ("timeout", CollectiveTimeoutError), ("aborted", JobAbortedError)],
)
def test_error_frame_raises_the_same_error_type(error_type: str, cls: type) -> None:
    agent, _ = _three_rank_root()
    cmds, _ = feed(agent, 1, error_frame(error_type, "it broke", 7), piece=3)
    failure = only_failure(cmds)
    assert type(failure.error) is cls
    assert "it broke" in str(failure.error) and "rank 7" in str(failure.error)
    # passed on to the other neighbour with the original origin, not back to the sender
    assert error_sends(cmds) == {2: (error_type, "it broke", 7)}
    assert not of_type(cmds, CloseLink)


def test_error_frame_between_calls_fails_the_agent() -> None:
    agent = ready_agent(0, 3)
    cmds, _ = feed(agent, 2, error_frame("peer_lost", "gone", 2))
    failure = only_failure(cmds)
    assert failure.call_id is None and isinstance(failure.error, PeerLostError)
    assert agent.state is State.FAILED


def test_empty_error_frame_is_protocol_error() -> None:
    agent, _ = _three_rank_root()
    cmds, _ = feed(agent, 1, pack_header(FrameKind.ERROR, bcast_desc(0, 0), 0, 0, 0, 0))
    assert isinstance(only_failure(cmds).error, ProtocolError)


def test_undecodable_error_frame_is_protocol_error() -> None:
    agent, _ = _three_rank_root()
    junk = b"\xc1\xc1\xc1"
    cmds, _ = feed(agent, 1, pack_header(FrameKind.ERROR, bcast_desc(0, 0), 0, 0, 0, 3) + junk)
    error = only_failure(cmds).error
    assert isinstance(error, ProtocolError)
    assert CloseLink(1, str(error)) in cmds


# ----------------------------------------------------------------------------- groups (SimNet)


def _allreduce_calls(world: int, count: int, kind: CollectiveKind, seed: int, *,
                     odd_rank: int = -1, odd_count: int = 0
                     ) -> tuple[dict[int, Call], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    data = [rng.integers(-1000, 1000, odd_count if r == odd_rank else count, dtype=np.int64)
            for r in range(world)]
    bufs = [d.copy() for d in data]
    calls = {r: Call(kind, memoryview(bufs[r]).cast("B"), I64, Op.SUM) for r in range(world)}
    return calls, data, bufs


def _drain(net: SimNet, limit: int = 1_000_000) -> None:
    for _ in range(limit):
        if not net.step():
            return
    raise AssertionError("simulation did not quiesce")


@pytest.mark.parametrize("kind", [TREE, RING])
@pytest.mark.parametrize("odd_rank", [0, 2, 4])
def test_mismatched_count_fails_every_rank(kind: CollectiveKind, odd_rank: int) -> None:
    world = 5
    calls, _, _ = _allreduce_calls(world, 100, kind, seed=odd_rank, odd_rank=odd_rank,
                                   odd_count=101)
    net = SimNet(world, seed=odd_rank, max_piece=77)
    net.run(calls)
    assert net.done == {}
    assert set(net.failed) == set(range(world))
    assert all(isinstance(e, MismatchError) for e in net.failed.values()), net.failed
    # ranks that did not see a bad frame themselves learned it from an ERROR frame
    relayed = [r for r, e in net.failed.items() if "reported by rank" in str(e)]
    assert relayed and len(relayed) < world
    assert all(a.state is State.FAILED for a in net.agents.values())


def test_mismatched_broadcast_root_fails_every_rank() -> None:
    world = 5
    bufs = [np.full(16, r, np.uint8) for r in range(world)]
    calls = {r: bcast_call(bufs[r], 3 if r == 1 else 0) for r in range(world)}
    net = SimNet(world, seed=3)
    net.run(calls)
    # a rank whose part of the tree agrees may finish before the news reaches it (it then
    # fails on its next call); rank 1 and the root it disagrees with never finish
    assert set(net.failed) == set(range(world))
    assert not {0, 1, 2, 3} & set(net.done)
    assert all(isinstance(e, MismatchError) for e in net.failed.values()), net.failed


def _kill(net: SimNet, victim: int) -> None:
    """The victim's process dies: its links close and its neighbours see a hang-up."""
    for src, dst in net.queues:
        if victim in (src, dst):
            net.closed.add((src, dst))
    for peer in net.agents[victim].links:
        net.execute(peer, net.agents[peer].on_hangup(victim, "connection reset", net.now))


@pytest.mark.parametrize("kind", [TREE, RING])
@pytest.mark.parametrize("victim", [0, 3, 4])
@pytest.mark.parametrize("after_steps", [0, 25])
def test_hangup_mid_call_fails_every_rank(kind: CollectiveKind, victim: int,
                                          after_steps: int) -> None:
    world = 5
    calls, _, _ = _allreduce_calls(world, 3000, kind, seed=victim)
    net = SimNet(world, seed=victim, max_piece=64, tree_chunk=256)
    net.begin(calls)
    for _ in range(after_steps):
        assert net.step()
    assert net.done == {} and net.failed == {}
    _kill(net, victim)
    _drain(net)
    survivors = set(range(world)) - {victim}
    assert survivors <= set(net.failed)
    assert not survivors & set(net.done)
    for rank in survivors:
        assert isinstance(net.failed[rank], PeerLostError), (rank, net.failed[rank])
        assert net.agents[rank].state is State.FAILED
    # the neighbours that needed the link name it; the others were told by ERROR frames
    direct = [r for r in survivors if f"link to rank {victim} lost" in str(net.failed[r])
              and "reported by" not in str(net.failed[r])]
    assert direct


def test_hangup_of_an_unused_link_mid_call_is_tolerated() -> None:
    # world 5 ring allreduce: rank 1's link to rank 3 is not part of the ring
    world = 5
    calls, data, bufs = _allreduce_calls(world, 500, RING, seed=1)
    net = SimNet(world, seed=1, max_piece=100)
    net.begin(calls)
    assert net.agents[1].on_hangup(3, "closed", net.now) == []
    assert net.agents[1].state is State.ALLREDUCE
    _drain(net)
    assert net.failed == {} and len(net.done) == world
    expect = np.sum(data, axis=0)
    assert all(np.array_equal(b, expect) for b in bufs)


def test_hangup_after_call_is_tolerated_until_the_link_is_needed() -> None:
    world = 3
    calls, _, _ = _allreduce_calls(world, 50, RING, seed=0)
    net = SimNet(world, seed=0)
    net.run(calls)
    assert len(net.done) == world and net.failed == {}
    for peer in net.agents[2].links:  # rank 2 finished and exited
        assert net.agents[peer].on_hangup(2, "closed by peer", net.now) == []
        assert net.agents[peer].state is State.READY
        # a second notice for the same link is idempotent
        assert net.agents[peer].on_hangup(2, "closed by peer", net.now) == []
    # the next call needs the ring link to rank 2: it fails at once on both survivors
    for rank in (0, 1):
        buf = np.zeros(50, np.int64)
        cmds = net.agents[rank].begin(Call(RING, memoryview(buf).cast("B"), I64, Op.SUM), 0.0)
        failure = only_failure(cmds)
        assert isinstance(failure.error, PeerLostError) and "rank 2" in str(failure.error)
        assert failure.call_id == (0, 1)
        assert net.agents[rank].state is State.FAILED


def test_hangup_after_call_in_a_pair() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    assert feed(agent, 1, data_frame(bcast_desc(1, 4), (0, 0), 0, b"abcd"))[0] == [
        CallComplete((0, 0))
    ]
    assert agent.on_hangup(1, "eof", 1.0) == []
    assert agent.state is State.READY
    cmds = agent.begin(bcast_call(np.zeros(4, np.uint8), 1), 2.0)
    assert isinstance(only_failure(cmds).error, PeerLostError)
    with pytest.raises(PeerLostError):
        agent.begin(bcast_call(np.zeros(4, np.uint8), 1), 3.0)


def test_hangup_of_a_link_whose_work_is_done_is_tolerated() -> None:
    # the root sent all 8 bytes at begin; child 1 acknowledged the call with its empty frame
    agent, _ = _three_rank_root()
    assert feed(agent, 1, pack_header(FrameKind.DATA, bcast_desc(0, 8), 0, 0, 0, 0))[0] == []
    assert agent.on_hangup(1, "eof", 0.0) == []
    assert agent.state is State.BROADCAST
    cmds, _ = feed(agent, 2, pack_header(FrameKind.DATA, bcast_desc(0, 8), 0, 0, 0, 0))
    assert cmds == [CallComplete((0, 0))]


def test_hangup_before_the_payload_arrived_fails() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    feed(agent, 1, pack_header(FrameKind.DATA, bcast_desc(1, 4), 0, 0, 0, 4))
    failure = only_failure(agent.on_hangup(1, "eof", 0.0))
    assert isinstance(failure.error, PeerLostError) and "eof" in str(failure.error)
    assert agent.state is State.FAILED


def test_pair_and_tree_disagree_is_a_mismatch() -> None:
    # two ranks configured with different algorithms must fail alike, not hang
    calls, _, bufs = _allreduce_calls(2, 30, PAIR, seed=4)
    calls[1] = Call(TREE, memoryview(bufs[1]).cast("B"), I64, Op.SUM)
    net = SimNet(2, seed=4, max_piece=50)
    net.run(calls)
    assert net.done == {}
    assert set(net.failed) == {0, 1}
    assert all(isinstance(e, MismatchError) for e in net.failed.values()), net.failed


def test_pair_is_chosen_only_at_world_two() -> None:
    assert ready_agent(0, 2).choose_allreduce(80, 8) is PAIR
    assert ready_agent(0, 3).choose_allreduce(80, 8) is TREE
    assert ready_agent(0, 2, ring_mincount=5).choose_allreduce(80, 8) is RING


@pytest.mark.parametrize("world", [2, 3, 4, 9])
def test_default_threshold_is_in_bytes_and_a_set_mincount_counts_elements(world: int) -> None:
    small = PAIR if world == 2 else TREE
    threshold = PAIR_MAX_BYTES if world == 2 else AUTO_RING_MIN_BYTES
    agent = ready_agent(0, world)
    assert agent.choose_allreduce(threshold, 8) is small
    assert agent.choose_allreduce(threshold + 8, 8) is RING
    assert agent.choose_allreduce(threshold + 1, 1) is RING
    # rabit's rule where the option is given: more than that many elements, whatever size
    rabit_rule = ready_agent(0, world, ring_mincount=32768)
    assert rabit_rule.choose_allreduce(32768 * 8, 8) is small
    assert rabit_rule.choose_allreduce(32769 * 4, 4) is RING


@pytest.mark.parametrize("world", [2, 3, 4, 9])
def test_a_set_ring_min_bytes_moves_the_threshold_at_world_three_and_more(world: int) -> None:
    moved = ready_agent(0, world, ring_min_bytes=2 << 20)
    if world == 2:  # the pair's own threshold stands
        assert moved.choose_allreduce(PAIR_MAX_BYTES + 8, 8) is RING
    else:
        assert moved.choose_allreduce(2 << 20, 8) is TREE
        assert moved.choose_allreduce((2 << 20) + 8, 8) is RING
    # rabit's element rule, where it is given, wins
    both = ready_agent(0, world, ring_min_bytes=2 << 20, ring_mincount=32768)
    assert both.choose_allreduce(32769 * 4, 4) is RING


def test_invalid_call_leaves_the_agent_ready() -> None:
    agent = ready_agent(0, 3)
    buf = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="world of exactly 2"):
        agent.begin(Call(PAIR, memoryview(buf).cast("B"), I64, Op.SUM), 0.0)
    assert (agent.state, agent.seqno, agent.active) == (State.READY, 0, None)


@pytest.mark.parametrize(
    ("op", "max_piece"),
    [(Op.SUM, 5), (Op.MAX, 5), (Op.MIN, 5), (Op.PROD, 5),
     (Op.SUM, 1 << 16), (Op.MAX, 1 << 16)],
)
def test_pair_exchange_bits_agree_with_nan_payloads(op: Op, max_piece: int) -> None:
    # NaNs with different payloads: x86 keeps the first operand's payload, so both ranks
    # must reduce in the same operand order to end with the same bits
    quiet_a, quiet_b = 0x7FF8000000000001, 0x7FF8000000000ABC
    raw = [np.array([quiet_a, quiet_b, 0x3FF0000000000000, quiet_a], np.uint64),
           np.array([quiet_b, quiet_a, quiet_b, 0x4000000000000000], np.uint64)]
    bufs = [r.view(np.float64).copy() for r in raw]
    net = CheckedNet(2, seed=int(op), max_piece=max_piece)
    net.run({r: Call(PAIR, memoryview(bufs[r]).cast("B"), np.dtype(np.float64), op)
             for r in range(2)})
    assert net.failed == {} and len(net.done) == 2
    assert bufs[0].tobytes() == bufs[1].tobytes()
    assert np.isnan(bufs[0]).all() or op is not Op.SUM


# ----------------------------------------------------------------------------- deadlines, abort


def test_progress_deadline() -> None:
    agent, _, _ = rank0_of_two_receiving(len(PAYLOAD), timeout=5.0)
    assert agent.on_tick(5.0) == []  # exactly at the deadline is still fine
    feed(agent, 1, data_frame(bcast_desc(1, 50), (0, 0), 0, PAYLOAD[:10]), now=4.0)
    assert agent.on_tick(9.0) == []  # progress at t=4 moved the deadline
    cmds = agent.on_tick(9.5)
    failure = only_failure(cmds)
    assert isinstance(failure.error, CollectiveTimeoutError) and failure.call_id == (0, 0)
    assert error_sends(cmds)[1][0] == "timeout"
    assert agent.state is State.FAILED
    assert agent.on_tick(100.0) == []  # failed once, reported once


def test_no_deadline_between_calls() -> None:
    agent = ready_agent(0, 2, timeout=1.0)
    assert agent.on_tick(1e9) == []
    assert agent.state is State.READY


def test_abort_mid_call() -> None:
    agent, _, _ = rank0_of_two_receiving(4)
    cmds = agent.abort("tracker says stop")
    failure = only_failure(cmds)
    assert isinstance(failure.error, JobAbortedError) and failure.call_id == (0, 0)
    assert "tracker says stop" in str(failure.error)
    assert error_sends(cmds) == {}  # every rank hears it from the tracker itself
    assert agent.state is State.FAILED
    assert agent.abort("again") == []
    with pytest.raises(JobAbortedError):
        agent.begin(bcast_call(np.zeros(4, np.uint8), 1), 0.0)


def test_abort_between_calls_and_before_start() -> None:
    agent = ready_agent(0, 3)
    failure = only_failure(agent.abort("bye"))
    assert failure.call_id is None and isinstance(failure.error, JobAbortedError)
    idle = Agent()
    assert idle.abort("early") == []
    assert isinstance(idle.error, JobAbortedError) and idle.state is State.IDLE


def test_shutdown_and_late_network_events() -> None:
    agent = ready_agent(0, 2)
    agent.shutdown()
    assert agent.state is State.TASK_COMPLETE
    assert agent.on_hangup(1, "closed", 0.0) == []
    assert agent.on_tick(1e6) == []
    assert agent.abort("late") == []
    with pytest.raises(InvalidTransition):
        agent.begin(bcast_call(np.zeros(1, np.uint8), 0), 0.0)


# ----------------------------------------------------------------------------- statistics


def test_statistics_count_frames_and_bytes() -> None:
    agent, _, _ = rank0_of_two_receiving(len(PAYLOAD))
    stats = agent.statistics()
    assert (stats.state, stats.frames_sent, stats.bytes_sent) == ("broadcast", 1, 0)
    assert (stats.frames_received, stats.bytes_received, stats.calls_completed) == (0, 0, 0)
    desc = bcast_desc(1, 50)
    feed(agent, 1, data_frame(desc, (0, 0), 0, PAYLOAD[:20]) + data_frame(desc, (0, 0), 20,
                                                                          PAYLOAD[20:]))
    stats = agent.statistics()
    assert stats.state == "ready" and stats.calls_completed == 1
    assert stats.frames_received == 2
    assert stats.bytes_received == len(PAYLOAD)  # payload only, like bytes_sent
    with pytest.raises(AttributeError):
        stats.calls_completed = 5  # type: ignore[misc]  # a frozen snapshot


def test_statistics_count_error_frames_sent() -> None:
    agent, _ = _three_rank_root()
    before = agent.statistics()
    assert (before.frames_sent, before.bytes_sent) == (2, 16)  # 8 B to each child
    feed(agent, 1, error_frame("timeout", "slow", 1))
    after = agent.statistics()
    assert after.frames_received == 1
    assert after.frames_sent == 3  # the ERROR frame passed on to rank 2
    assert after.bytes_sent == 16 and after.state == "failed"


@pytest.mark.parametrize(("kind", "world"), [(TREE, 5), (RING, 5), (PAIR, 2), (TREE, 2)])
def test_statistics_over_a_group(kind: CollectiveKind, world: int) -> None:
    count = 1000
    calls, _, _ = _allreduce_calls(world, count, kind, seed=2)
    net = SimNet(world, seed=2, max_piece=500, tree_chunk=1024)
    net.run(calls)
    assert net.failed == {}
    stats = [a.statistics() for a in net.agents.values()]
    assert all(s.calls_completed == 1 and s.state == "ready" for s in stats)
    frames = sum(s.frames_sent for s in stats)
    assert frames == sum(s.frames_received for s in stats)
    sent = sum(s.bytes_sent for s in stats)
    assert sent == sum(s.bytes_received for s in stats)
    assert sum(net.bytes_on_link.values()) == sent + frames * HEADER_SIZE
    nbytes = count * 8
    expected = {
        TREE: 2 * (world - 1) * nbytes,  # N each way on each of the world-1 tree edges
        RING: 2 * (world - 1) * nbytes,  # 2(n-1)/n * N on each of the n ring links
        PAIR: 2 * nbytes,  # N each way on the one link
    }[kind]
    assert sent == expected


# ----------------------------------------------------------------------------- invariants, fuzz


class CheckedNet(SimNet):
    """A SimNet that checks every active plan's invariants after every delivered piece."""

    checks = 0

    def step(self) -> bool:
        moved = super().step()
        for agent in self.agents.values():
            if agent.active is not None:
                agent.active.plan.check_invariants()
                self.checks += 1
        return moved


@pytest.mark.parametrize(("kind", "world"),
                         [(TREE, 6), (RING, 6), (TREE, 9), (RING, 2), (PAIR, 2)])
def test_plan_invariants_hold_after_every_piece(kind: CollectiveKind, world: int) -> None:
    calls, data, bufs = _allreduce_calls(world, 700, kind, seed=world)
    net = CheckedNet(world, seed=world, max_piece=97, tree_chunk=128)
    net.run(calls)
    assert net.checks > 100
    assert net.failed == {} and len(net.done) == world
    expect = np.sum(data, axis=0)
    assert all(np.array_equal(b, expect) for b in bufs)


def test_byte_by_byte_group() -> None:
    world = 4
    for kind in (TREE, RING):
        calls, data, bufs = _allreduce_calls(world, 20, kind, seed=9)
        net = CheckedNet(world, seed=9, max_piece=1, tree_chunk=16)
        net.run(calls)
        assert net.failed == {} and len(net.done) == world
        assert all(np.array_equal(b, np.sum(data, axis=0)) for b in bufs)
    for kind in (PAIR, TREE, RING):
        calls, data, bufs = _allreduce_calls(2, 20, kind, seed=9)
        net = CheckedNet(2, seed=9, max_piece=1, tree_chunk=16)
        net.run(calls)
        assert net.failed == {} and len(net.done) == 2
        assert all(np.array_equal(b, np.sum(data, axis=0)) for b in bufs)


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(1, 9),
    count=st.integers(0, 300),
    max_piece=st.sampled_from([1, 7, 40, 41, 333, 4096, 1 << 16]),
    kind=st.sampled_from([TREE, RING, PAIR]),
    tree_chunk=st.sampled_from([8, 100, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fuzz_allreduce_matches_numpy(*, world: int, count: int, max_piece: int,
                                      kind: CollectiveKind, tree_chunk: int, seed: int) -> None:
    if max_piece < 40:
        # pieces smaller than a header: every forwarded piece becomes a frame of its own, so
        # the simulation runs ~40 steps per payload byte; keep these examples small
        count = min(count, 5 * max_piece + 3)
    if kind is PAIR and world != 2:
        world = 2  # the pair exchange exists only at world size 2
    calls, data, bufs = _allreduce_calls(world, count, kind, seed=seed)
    net = CheckedNet(world, seed=seed, max_piece=max_piece, tree_chunk=tree_chunk)
    net.run(calls)
    assert net.failed == {}
    assert set(net.done) == set(range(world))
    expect = np.sum(data, axis=0, dtype=np.int64)
    for buf in bufs:
        assert buf.tobytes() == expect.tobytes()


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(1, 9),
    count=st.integers(0, 1000),
    max_piece=st.sampled_from([1, 5, 64, 1 << 16]),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_fuzz_broadcast_and_allgather(world: int, count: int, max_piece: int, seed: int,
                                      data: st.DataObject) -> None:
    if max_piece < 40:
        count = min(count, 50)
    root = data.draw(st.integers(0, world - 1), label="root")
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, count, dtype=np.uint8)
    bufs = [src.copy() if r == root else np.zeros(count, np.uint8) for r in range(world)]
    net = CheckedNet(world, seed=seed, max_piece=max_piece)
    net.run({r: bcast_call(bufs[r], root) for r in range(world)})
    assert net.failed == {} and set(net.done) == set(range(world))
    assert all(b.tobytes() == src.tobytes() for b in bufs)

    # a ring forwards each received piece as its own frame: byte-sized pieces cost a 40-byte
    # header per payload byte, so keep those blocks small
    largest = 6 if max_piece < 40 else 50
    sizes = data.draw(st.lists(st.integers(0, largest), min_size=world, max_size=world),
                      label="sizes")
    offsets = np.cumsum([0, *sizes])
    blocks = tuple((int(offsets[r]), int(offsets[r + 1])) for r in range(world))
    full = rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8)
    gbufs = []
    for lo, hi in blocks:
        b = np.zeros(len(full), np.uint8)
        b[lo:hi] = full[lo:hi]
        gbufs.append(b)
    net.run({r: Call(CollectiveKind.ALLGATHER, memoryview(gbufs[r]), blocks=blocks)
             for r in range(world)})
    assert net.failed == {} and set(net.done) == set(range(world))
    assert all(b.tobytes() == full.tobytes() for b in gbufs)


def test_early_frame_of_a_later_call_that_this_call_needs_is_a_sequence_mismatch() -> None:
    """The frame arrived (and was held) before this rank began the call that needs that
    peer's bytes: beginning the call must see the divergence, not wait for the deadline."""
    agent, _, _ = rank0_of_two_receiving(4)
    desc = bcast_desc(1, 4)
    feed(agent, 1, data_frame(desc, (0, 0), 0, b"abcd"))
    cmds, _ = feed(agent, 1, data_frame(desc, (1, 0), 0, b"wxyz"))  # the peer checkpointed
    assert cmds == [PauseReading(1)]
    cmds = agent.begin(bcast_call(np.zeros(4, np.uint8), 1), 0.0)  # this rank did not
    error = only_failure(cmds).error
    assert isinstance(error, MismatchError) and "sequence mismatch" in str(error)


# ----------------------------------------------------------------------------- progress


def _tree_job_with_a_slow_link(stall: bool) -> tuple[SimNet, list[np.ndarray]]:
    """World 4, a tree allreduce of 8 000 B per rank with a 1 ms progress deadline (network
    steps are 1 us): the link from rank 2 to its parent 1 delivers one byte per step (or
    none, ``stall``), so rank 3, a leaf of the root that sent its input at once, waits
    thousands of steps with no byte moving on its own links."""
    world = 4
    net = SimNet(world, seed=5, max_piece=4096, timeout=0.001, ring_mincount=1 << 30,
                 tree_chunk=1 << 20)
    assert topology(2, world).parent == 1 and topology(3, world).parent == 0
    if stall:
        net.paused.add((1, 2))  # rank 1 reads nothing from rank 2
    else:
        net.slow.add((2, 1))
    bufs = [np.full(1000, r + 1, dtype=np.int64) for r in range(world)]
    calls = {}
    for r in range(world):
        raw = memoryview(bufs[r]).cast("B")
        calls[r] = Call(net.agents[r].choose_allreduce(len(raw), 8), raw, np.dtype(np.int64),
                        Op.SUM)
    net.begin(calls)
    for step in range(200_000):
        if step % 50 == 0:
            net.tick()
        if not net.step():
            net.now += 1e-6  # (time passes while nothing can move)
        if len(net.done) + len(net.failed) == world:
            break
    return net, bufs


def test_bytes_moving_elsewhere_in_a_call_keep_every_rank_s_deadline_at_bay() -> None:
    net, bufs = _tree_job_with_a_slow_link(stall=False)
    assert net.now > 0.005  # the call took several progress deadlines
    assert not net.failed and len(net.done) == 4
    assert all((b == 10).all() for b in bufs)


def test_without_progress_notes_the_waiting_leaf_would_time_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(The control: what the notes prevent.)"""
    monkeypatch.setattr("rabit2.core.progress.tell", lambda *args, **kwargs: None)
    net, _ = _tree_job_with_a_slow_link(stall=False)
    assert any(isinstance(e, CollectiveTimeoutError) for e in net.failed.values())


@pytest.mark.parametrize("bad", [[], [1], [1, 2, 3], ["a", 0], [True, 0], [-1, 0], [0.5, 0]])
def test_a_progress_note_that_names_no_call_is_a_protocol_error(bad: list[object]) -> None:
    """(A finalized rank compares the call a note names with its own last one.)"""
    from rabit2.core import progress  # noqa: PLC0415

    with pytest.raises(ProtocolError, match="rank 3 sent a malformed progress note"):
        progress.call_of(3, {"t": "progress", "call": bad, "age_us": 0})
    assert progress.call_of(3, {"t": "progress", "call": [2, 7], "age_us": 0}) == (2, 7)


def test_a_call_where_nothing_moves_still_times_out_everywhere() -> None:
    """Notes passed round carry ages, which only grow: they never keep a stuck call alive."""
    net, _ = _tree_job_with_a_slow_link(stall=True)
    assert len(net.failed) == 4 and not net.done
    assert all(isinstance(e, CollectiveTimeoutError) for e in net.failed.values())
    assert net.now < 0.01  # within a few deadlines of the stall
