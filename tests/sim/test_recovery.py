"""Lazy recovery in the simulation: ranks die at chosen points and come back, the job's
results stay bit-identical to numpy, and survivors never restart a call.

A :class:`Job` runs the same program on every rank of a :class:`SimNet`: iterations of
collectives, a checkpoint after each.  A fault plan kills a rank once it has received a
number of payload bytes of a given call; after a while the rank is restarted (a new agent,
incarnation + 1), loads the checkpoint from its neighbours and replays.  Every result of
every rank, replayed or not, is checked against numpy.  The job and its fault plans are
:mod:`tests.sim.faultplan`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rabit2.core.agent import Agent, Call, CallComplete, Command, Send
from rabit2.core.framing import CallDescriptor, CollectiveKind
from rabit2.core.fsm import State
from rabit2.core.ops import Op
from rabit2.core.recovery.store import ENTRY_COST, ResultStore
from rabit2.core.schedule import RingAllreduce
from rabit2.core.topology import topology
from rabit2.errors import (
    MismatchError,
    PeerLostError,
    ProtocolError,
    RabitError,
    UnrecoverableError,
)
from tests.sim.faultplan import (
    BCAST,
    KW,
    PROGRAM,
    RING,
    SMALL,
    Job,
    Kill,
    Reset,
    ResetJob,
    SourceKillJob,
    Spec,
    corrupt_job,
    expected,
    random_chain_plan,
    random_plan,
    run_adjacent_plan,
    run_chain_plan,
    run_job,
    run_random_plan,
)
from tests.sim.simnet import SimNet


def test_no_fault_job_with_recovery_on() -> None:
    job = run_job(5, [])
    assert all(a.recovery_statistics()["links_up"] == 0 for a in job.net.agents.values())


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("spec", [Spec("allreduce", 1), Spec("allreduce", 1500),
                                  Spec("allreduce", 5001), Spec("broadcast", 20_000, root=1),
                                  Spec("object", 20_000, root=2)], ids=str)
def test_retained_results_are_the_results(world: int, spec: Spec) -> None:
    """What a rank keeps for replays equals the call's result (a world-2 ring keeps its
    staging buffer; a broadcast receiver copies the stream as it arrives, head included)."""
    job = run_job(world, [], program=[[spec, spec]], max_piece=997)
    for rank, agent in job.net.agents.items():
        for seqno in (0, 1):
            got = agent.recovery.results.get((0, seqno))
            assert got is not None
            if spec.kind == "allreduce":
                assert bytes(got[1]) == expected(world, 0, seqno, spec)
            else:  # the stream: for an object, an 8-byte size head and then the array
                assert bytes(got[1]).endswith(expected(world, 0, seqno, spec)), rank


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_large_broadcast_replays_from_the_copy_made_while_it_arrived(
        world: int, victim: int) -> None:
    """A rank killed after two large broadcasts (and before the next call) is served what
    it did not send itself from its neighbours' retained copies, bit for bit."""
    victim %= world
    program = [[Spec("broadcast", 30_000, root=1), Spec("object", 25_000, root=0), SMALL]]
    for seed in range(2):
        job = run_job(world, [Kill(victim, (0, 2), 0)], seed=seed, program=program,
                      max_piece=1 << 14)
        stats = job.net.agents[victim].recovery_statistics()
        assert stats["replayed_calls"] >= 1 and stats["fetched_bytes"] >= 30_000 * 8, stats


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("at", [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("victim", [0, 1, -1])
def test_kill_mid_call_then_restart(world: int, at: tuple[int, int], victim: int) -> None:
    victim %= world
    spec = PROGRAM[at[0]][at[1]]
    nbytes = spec.count * 8
    for seed, after in enumerate([0, nbytes // 3, nbytes - 1]):
        job = run_job(world, [Kill(victim, at, after)], seed=seed)
        assert job.net.agents[victim].incarnation == 1  # it was killed and came back
        stats = job.net.agents[victim].recovery_statistics()
        assert stats["fetched_bytes"] > 0 or at == (0, 0)


@pytest.mark.parametrize("seed", range(6))
def test_kill_at_random_points(seed: int) -> None:
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 9))
    it = int(rng.integers(0, len(PROGRAM)))
    j = int(rng.integers(0, len(PROGRAM[it])))
    kill = Kill(int(rng.integers(0, world)), (it, j), int(rng.integers(0, 30000)),
                restart_after=int(rng.integers(1, 5000)))
    run_job(world, [kill], seed=seed, max_piece=int(rng.integers(1, 5000)))


BOOTSTRAP = [Spec("allreduce", 3), Spec("broadcast", 40, root=1), Spec("allgather", 5)]
"""Calls a program makes before its first load_checkpoint (XGBoost's feature count, a
config from rank 0, ...): kept for good by every rank (rabit's bootstrap cache)."""


@pytest.mark.parametrize(("world", "victim", "at"), [
    (2, 1, (-1, 1)), (3, 1, (-1, 2)), (4, 0, (-1, 0)),  # before the first load_checkpoint
    (2, 0, (2, 0)), (3, 2, (2, 1)), (5, 3, (1, 2)),  # two checkpoints later
])
def test_calls_before_the_first_load_checkpoint_are_replayed(
        world: int, victim: int, at: tuple[int, int]) -> None:
    """A restarted worker replays the calls its program makes before load_checkpoint, from
    neighbours that kept them for good, also once they are two checkpoints further on; at
    version 0 its later calls go on from there rather than from call (0, 0) again."""
    for seed, after in enumerate([0, 60]):
        job = run_job(world, [Kill(victim, at, after)], seed=seed, bootstrap=BOOTSTRAP)
        assert job.net.agents[victim].incarnation == 1
        # (one version earlier where its local model of the latest had not gone out yet)
        assert job.resumed_from[victim] in (max(0, at[0] - 1), max(0, at[0]))
        stats = job.net.agents[victim].recovery_statistics()
        assert stats["replayed_calls"] >= (len(BOOTSTRAP) if at[0] > 0 else 0)


@pytest.mark.parametrize("seed", range(6))
def test_kill_at_random_points_with_calls_before_load_checkpoint(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    world = int(rng.integers(2, 9))
    it = int(rng.integers(-1, len(PROGRAM)))
    calls = BOOTSTRAP if it == -1 else PROGRAM[it]
    kill = Kill(int(rng.integers(0, world)), (it, int(rng.integers(0, len(calls)))),
                int(rng.integers(0, 30000)), restart_after=int(rng.integers(1, 5000)))
    run_job(world, [kill], seed=seed, max_piece=int(rng.integers(1, 5000)),
            bootstrap=BOOTSTRAP)


def test_calls_before_load_checkpoint_over_half_the_store_are_not_kept() -> None:
    """Kept for good only up to half of rabit2_replay_mb: beyond that a restart two
    checkpoints later cannot replay them, and says what to do."""
    with pytest.raises(UnrecoverableError, match="kept for good only where"):
        run_job(3, [Kill(1, (2, 0), 0)], bootstrap=[Spec("allreduce", 200)],
                retain_bytes=3000)


def test_two_ranks_far_apart_killed_at_once() -> None:
    world = 8
    far = next(r for r in range(2, world) if r not in topology(0, world).neighbors)
    run_job(world, [Kill(0, (1, 1), 3000), Kill(far, (1, 1), 1000)])


def test_same_rank_killed_again_during_its_recovery() -> None:
    run_job(5, [Kill(2, (1, 1), 5000, restart_after=100),
                Kill(2, (2, 0), 100, restart_after=100)])


def test_survivors_block_only_on_the_lost_input() -> None:
    """While rank 4 is dead, ranks outside its subtree finish a broadcast from rank 0."""
    world = 8
    program = [[Spec("broadcast", 4000, root=0)]]
    victim = next(r for r in range(1, world) if not topology(r, world).children)  # a leaf
    job = Job(world, program, kills=[Kill(victim, (0, 0), 1000, restart_after=10**9)], **KW)
    with pytest.raises(AssertionError, match="did not finish"):
        job.run(max_steps=200_000)
    others = [r for r in range(world) if r != victim]
    assert all((0, 0) in job.results[r] for r in others)
    assert all(job.results[r][(0, 0)] == expected(world, 0, 0, program[0][0]) for r in others)


@pytest.mark.parametrize("world", [4, 8])
def test_survivors_run_ahead_of_a_lost_leaf_until_their_next_checkpoint(world: int) -> None:
    """A leaf is lost in the middle of the first of several broadcasts and not restarted:
    every other rank finishes all of that version's broadcasts (the leaf owes them nothing
    but its announce frame), and waits at the first call after the next checkpoint, where
    the leaf's replacement must be back (the run-ahead bound).  Restarted late, the leaf
    replays what it missed from its parent's results, and every result is exact."""
    bcasts = [Spec("broadcast", 4000, root=0), Spec("broadcast", 300, root=0),
              Spec("object", 2000, root=0)]
    program = [bcasts, [Spec("broadcast", 100, root=0), SMALL]]
    victim = next(r for r in range(1, world) if not topology(r, world).children)  # a leaf
    others = [r for r in range(world) if r != victim]
    held = Job(world, program, kills=[Kill(victim, (0, 0), 1000, restart_after=10**9)], **KW)
    with pytest.raises(AssertionError, match="did not finish"):
        held.run(max_steps=200_000)
    for r in others:
        assert all(held.results[r].get((0, j)) == expected(world, 0, j, spec)
                   for j, spec in enumerate(bcasts)), r
        assert (1, 1) not in held.results[r]  # (an allreduce needs the leaf's input)
    # past its checkpoint the leaf's parent waits for the replacement's announce
    assert (1, 0) not in held.results[topology(victim, world).parent]
    # the same job with the leaf restarted long after the others ran ahead
    job = run_job(world, [Kill(victim, (0, 0), 1000, restart_after=150_000)], program=program)
    assert job.resumed_from.get(victim, 0) == 0
    parent = topology(victim, world).parent
    assert job.net.agents[parent].recovery_statistics()["links_up"] == 1


def _subtree(rank: int, world: int) -> set[int]:
    below = {rank}
    for child in topology(rank, world).children:
        below |= _subtree(child, world)
    return below


@pytest.mark.parametrize("world", [6, 8])
def test_survivors_run_ahead_of_a_lost_inner_rank_until_their_next_checkpoint(
        world: int) -> None:
    """The same with an inner rank of the tree lost: every rank outside its subtree finishes
    that version's broadcasts (its parent does not wait for its announce), its subtree waits
    for its input; restarted late, it fetches each result from its parent and forwards it to
    its children, still waiting in the call, and every result is exact."""
    bcasts = [Spec("broadcast", 4000, root=0), Spec("broadcast", 300, root=0),
              Spec("object", 2000, root=0)]
    program = [bcasts, [Spec("broadcast", 100, root=0), SMALL]]
    victim = next(r for r in range(1, world) if topology(r, world).children)  # inner
    below = _subtree(victim, world)
    # (killed in the second broadcast: its frames of the first told its parent that it got
    # to version 0, how far the parent may run ahead of it)
    held = Job(world, program, kills=[Kill(victim, (0, 1), 100, restart_after=10**9)], **KW)
    with pytest.raises(AssertionError, match="did not finish"):
        held.run(max_steps=200_000)
    for r in range(world):
        done = [held.results[r].get((0, j)) == expected(world, 0, j, spec)
                for j, spec in enumerate(bcasts)]
        assert all(done) if r not in below else not any(done[1:]), r
    assert (1, 0) not in held.results[topology(victim, world).parent]
    job = run_job(world, [Kill(victim, (0, 1), 100, restart_after=150_000)], program=program)
    assert job.resumed_from.get(victim, 0) == 0


def test_no_survivor_resends_bytes_that_arrived() -> None:
    """Resumed mid-ring: survivors resend only what the dead rank held."""
    job = run_job(4, [Kill(2, (0, 1), 20000)], program=[[RING, RING]])
    agents = job.net.agents
    resent = sum(agents[r].recovery_statistics()["resent_bytes"] for r in range(4) if r != 2)
    # at most what the victim itself had received of that call
    assert resent <= 20000 + 5000 * 8


def test_a_worker_that_never_returns_fails_every_neighbour_in_bounded_time() -> None:
    job = Job(4, [[RING]], kills=[Kill(1, (0, 0), 100, restart_after=10**9)],
              recover_timeout=5.0, **KW)
    with pytest.raises(AssertionError):
        job.run(max_steps=100_000)
    net = job.net
    for rank in range(4):
        if rank != 1:
            net.execute(rank, net.agents[rank].on_tick(net.now + 10.0))
    while net.step():
        pass
    for rank in (0, 2, 3):
        assert isinstance(net.failed.get(rank), PeerLostError), (rank, net.failed)


def test_diverging_restarted_worker_gets_a_sequence_mismatch() -> None:
    program = [[SMALL], [SMALL, SMALL]]
    job = Job(3, program, kills=[Kill(1, (1, 1), 0, restart_after=10)], **KW)
    original = job._advance

    def diverge(rank: int) -> None:
        if rank == 1 and job.net.agents[1].incarnation == 1:
            job.program = [[SMALL], [Spec("allreduce", 101), SMALL]]  # the replay differs
        original(rank)
        job.program = program

    job._advance = diverge  # type: ignore[method-assign]
    with pytest.raises(MismatchError, match="sequence mismatch"):
        job.run()


def test_lost_retained_results_are_unrecoverable() -> None:
    with pytest.raises(UnrecoverableError):
        run_job(3, [Kill(1, (1, 1), 100)], retain_bytes=16)


def test_recovering_agent_reports_its_state() -> None:
    job = run_job(3, [Kill(2, (0, 1), 1000)])
    assert all(a.state is State.READY for a in job.net.agents.values())
    assert not any(a.restarted for a in job.net.agents.values())


def test_without_recovery_a_kill_still_fails_fast() -> None:
    job = Job(4, [[RING]], kills=[Kill(1, (0, 0), 100, restart_after=10**9)], recover=False,
              **KW)
    with pytest.raises(RabitError):
        job.run(max_steps=100_000)


def _unused(agent: Agent) -> None:
    del agent


@pytest.mark.parametrize("world", [2, 3, 4, 6])
@pytest.mark.parametrize("at", [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_connection_reset_between_live_ranks_resumes_without_restart(
        world: int, at: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng([world, seed, *at])
    a = int(rng.integers(0, world))
    b = int(rng.choice(topology(a, world).neighbors))
    reset = Reset(a, b, at, int(rng.integers(0, 20000)))
    job = ResetJob(world, PROGRAM, seed=seed, resets=[reset], **KW)
    job.run()
    job.check()
    assert reset.done
    assert all(agent.incarnation == 0 for agent in job.net.agents.values())  # no restart
    assert job.net.agents[a].recovery_statistics()["links_up"] == 1
    assert not job.resumed_from  # and no replay


def test_checkpoint_source_killed_while_serving() -> None:
    """The restarted rank takes the checkpoint from another neighbour; the source itself
    comes back once the first one waits in the interrupted call, and is recovered too."""
    job = SourceKillJob(5, PROGRAM, kills=[Kill(2, (1, 1), 5000, restart_after=50)],
                        restart_source_after=20000, **KW)
    job.run()
    job.check()
    assert job.source is not None and job.net.agents[job.source].incarnation == 1


def test_a_neighbour_restarted_while_the_first_one_replays_recovers_too() -> None:
    """The checkpoint source dies while serving and comes back at once, while the first
    restarted rank still replays: two adjacent ranks recover together (it was an
    UnrecoverableError before adjacent losses were handled)."""
    job = SourceKillJob(5, PROGRAM, kills=[Kill(2, (1, 1), 5000, restart_after=50)],
                        restart_source_after=1)
    job.run()
    job.check()
    assert job.source is not None and job.net.agents[job.source].incarnation == 1


@pytest.mark.parametrize("checkpointed", [True, False])
def test_finalized_neighbours_serve_a_restarted_rank(checkpointed: bool) -> None:
    """With recovery on, a rank that has shut down (finalize holds) still answers a
    neighbour restarted after the last collective: the checkpoint, and the results of the
    calls since it (replayed bit for bit)."""
    net = SimNet(3, recover=True, ring_mincount=50)
    counts = (10, 500)  # a tree and a ring allreduce
    inputs = {r: [np.arange(c, dtype=np.int64) * (r + 2) + r for c in counts]
              for r in range(3)}
    want = [sum(inputs[r][i] for r in range(3)) for i in range(len(counts))]

    def call(agent: Agent, arr: np.ndarray) -> Call:
        buf = arr.view(np.uint8).data
        return Call(agent.choose_allreduce(len(buf), 8), buf, arr.dtype, Op.SUM)

    if checkpointed:
        for agent in net.agents.values():
            agent.checkpoint(b"model v1")
    for i in range(len(counts)):
        arrs = {r: inputs[r][i].copy() for r in range(3)}
        net.run({r: call(net.agents[r], arrs[r]) for r in range(3)})
        assert all((arrs[r] == want[i]).all() for r in range(3))
    for rank in (0, 2):
        net.execute(rank, net.agents[rank].shutdown())
        assert net.agents[rank].state is State.TASK_COMPLETE
    net.kill(1)  # dies after its last collective
    agent = net.restart(1, 1)
    while net.step():
        pass
    assert agent.states_known()
    net.execute(1, agent.load_checkpoint())
    while net.step():
        pass
    version, blob, _ = net.loaded[1]
    assert (version, blob) == ((1, b"model v1") if checkpointed else (0, None))
    for i in range(len(counts)):
        arr = inputs[1][i].copy()
        net.execute(1, agent.begin(call(agent, arr), net.now))
        while net.step():
            pass
        assert net.done.pop(1) == (version, i) and (arr == want[i]).all()
    assert agent.recovery_statistics()["replayed_calls"] == len(counts)
    assert not net.failed


def test_a_broadcast_larger_than_the_store_is_not_copied() -> None:
    """A result above ``rabit2_replay_mb`` is not kept, so a receiver does not copy it."""
    job = Job(3, [[Spec("broadcast", 40_000, root=0)]], retain_bytes=100_000, **KW)
    taken: list[int] = []
    for agent in job.net.agents.values():
        store = agent.recovery.results
        store.take = lambda size, take=store.take: taken.append(size) or take(size)  # type: ignore[method-assign]
    job.run()
    job.check()
    assert taken == []
    for agent in job.net.agents.values():
        assert agent.recovery.results.get((0, 0)) is None and agent.recovery.results.nbytes == 0


def test_the_store_tells_when_it_dropped_a_result_of_the_version_being_made() -> None:
    """``overflowed`` is the version that lost one of its own results for want of room
    (then no restart can replay it); dropping an older version's results to make room is
    the bound doing its job, not an overflow."""
    store = ResultStore(limit=3 * (1000 + ENTRY_COST))  # (three results with their objects)
    desc = CallDescriptor(CollectiveKind.ALLREDUCE_RING, 0, 0, 0, 1000)
    blob = memoryview(bytes(1000))
    store.add((1, 0), desc, [blob])
    store.add((1, 1), desc, [blob])
    store.on_checkpoint(2)
    store.add((2, 0), desc, [blob])
    store.add((2, 1), desc, [blob])  # drops (1, 0): an older version
    assert store.overflowed == -1 and store.oldest == (1, 1)
    store.add((2, 2), desc, [blob])  # drops (1, 1)
    store.add((2, 3), desc, [blob])  # drops (2, 0): version 2 can no longer be replayed
    # ... so nothing of it is worth keeping: everything up to (2, 3) is forgotten
    assert store.overflowed == 2 and store.oldest == (2, 4) and store.nbytes == 0
    store.add((3, 0), desc, [memoryview(bytes(store.limit + 1))])  # never fits
    assert store.overflowed == 3 and store.get((3, 0)) is None


def test_a_version_that_lost_a_result_keeps_nothing_more_until_the_next_checkpoint() -> None:
    """Once a version has lost one of its own results no restart can replay it: its later
    results are neither copied nor kept (a job that never checkpoints stops paying for the
    store once it outgrew it), a buffer taken for one goes back to the spares, and the
    next version is kept again."""
    store = ResultStore(limit=600_000)
    desc = CallDescriptor(CollectiveKind.ALLREDUCE_RING, 0, 0, 0, 200_000)
    big = memoryview(bytes(200_000))
    for seqno in range(4):  # the fourth drops (0, 0): version 0 overflowed
        store.add((0, seqno), desc, [big])
    assert store.overflowed == 0 and store.nbytes == 0 and store.oldest == (0, 4)
    assert not store.wants((0, 4)) and store.wants((1, 0))
    store.add((0, 4), desc, [big])
    assert store.get((0, 4)) is None and store.nbytes == 0 and store.oldest == (0, 5)
    staged = store.take(200_000)  # (a world-2 ring stages its allgather in one regardless)
    store.keep((0, 5), desc, staged)
    assert store.get((0, 5)) is None and store.oldest == (0, 6)
    assert store.take(200_000) is staged  # the same (warm) buffer, not fresh memory
    store.on_checkpoint(1)
    store.add((1, 0), desc, [big])
    got = store.get((1, 0))
    assert got is not None and got[1].nbytes == 200_000 and store.oldest == (0, 6)


# -- found by the randomized fault soak (test_random_fault_plans below) ----------------------


def test_a_reset_off_the_calls_route_does_not_end_the_call_early() -> None:
    """Ranks 3 and 4 reset their link while 3 still receives a broadcast from rank 2 (the
    route from root 4 runs 4 -> 1 -> 2 -> 3; the ring link 3-4 is off it).  Rank 4 has
    finished the broadcast, but 3 takes none of 4's stream: 4 must not send it the result,
    or 3 completes early and 2's last frames of the call reach it in the next one."""
    program = [[Spec("object", 20_000, root=4)], [Spec("object", 300, root=6)]]
    hits = 0
    for seed, after in enumerate((2_000, 16_349, 60_000, 120_000)):
        reset = Reset(3, 4, (0, 0), after)
        job = ResetJob(8, program, seed=seed, resets=[reset], max_piece=3000, **KW)
        job.run()
        job.check()
        hits += reset.done
        assert all(agent.incarnation == 0 for agent in job.net.agents.values())
    assert hits == 4


def test_a_reset_after_a_restarted_rank_caught_up_settles_the_blocked_neighbour() -> None:
    """A restarted rank 0 finishes the call its neighbours were blocked in; its link to
    rank 6 (still in that call) then resets.  Rank 0 is no longer replaying, so it must say
    where it stands like a survivor (and send 6 the result), not as a replaying rank that
    6 would wait on for a ``need`` that never comes."""
    program = [[Spec("allreduce", 999)], [Spec("object", 300, root=0), Spec("allreduce", 999)]]
    kill = Kill(0, (0, 0), 14_642, restart_after=3625)
    reset = Reset(0, 6, (0, 0), 1 << 30)  # once the restarted rank 0 completed the call
    job = ResetJob(7, program, seed=17, kills=[kill], resets=[reset], max_piece=3000, **KW)
    job.run()
    job.check()
    assert reset.done and job.net.agents[0].incarnation == 1


@pytest.mark.parametrize("seed", range(3))
def test_a_reset_while_a_rank_is_between_calls_resends_its_last_result(seed: int) -> None:
    """World 2: the root of the last broadcast has finished it (and the program) when its
    link to the other rank resets; that rank still needs the end of the stream.  The root,
    between calls, must send the retained result in its place."""
    program = [[Spec("allreduce", 100), Spec("broadcast", 300, root=1)]]
    reset = Reset(1, 0, (0, 1), 1 << 30)  # rank 1 receives nothing: reset as it completes
    job = ResetJob(2, program, seed=seed, resets=[reset], max_piece=7, **KW)
    job.run()
    job.check()
    assert reset.done


def test_a_neighbour_lost_while_a_restarted_rank_is_in_its_resumed_call_recovers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 dies mid ring allreduce and resumes it at the offsets its neighbours held;
    while it is still in that call its ring neighbour 6 dies and its replacement asks for
    0's stream from an earlier byte than the resume made.  Rank 0 fetches the in-stream
    bytes its resume skipped from rank 1 again (``fetch`` what "stream"), reduces them in,
    and serves rank 6 from there.  (Sending its buffer's unreduced bytes instead was a wrong
    result, then an UnrecoverableError.)"""
    refills: list[int] = []
    real = RingAllreduce.refill

    def spy(plan: RingAllreduce, lo: int, data: memoryview) -> None:
        refills.append(len(data))
        real(plan, lo, data)

    monkeypatch.setattr(RingAllreduce, "refill", spy)
    program = [[Spec("allreduce", 5000), Spec("allreduce", 1500)]]
    kills = [Kill(0, (0, 0), 30_420, restart_after=1492),
             Kill(6, (0, 0), 28_602, restart_after=5512)]
    # (an interleaving found with unchecked frames, which their senders split differently)
    job = Job(7, program, seed=130, kills=kills, max_piece=2007, checked=False,
              **{**KW, "tree_chunk": 4096})
    job.run()
    job.check()
    assert refills and all(n > 0 for n in refills)


def test_a_ring_refill_reduces_the_skipped_bytes_and_serves_from_there() -> None:
    """Unit: a resumed ring plan names the in-stream range its resume skipped below a
    requested out-offset, reduces the refetched bytes into the segments they belong to
    (which still hold this rank's input), and can then serve from that offset."""
    buf = np.arange(12, dtype=np.int64) + 100
    plan = RingAllreduce(buf.view(np.uint8).data, np.dtype(np.int64), Op.SUM, 0, 4,
                         lambda peer, n: memoryview(bytearray(n)))
    first = plan.final_from(plan.prev) - plan.own_in_start  # the first out-piece's length
    assert plan.refill_range(first) is None  # not resumed: nothing was skipped
    plan.resume({plan.prev: first + 24})  # the previous rank held 3 elements past it
    assert plan.in_from == 24
    assert not plan.serves_from(plan.prev, first)
    assert plan.refill_range(first + 24) is None  # (made already)
    lo, hi = plan.refill_range(first + 8) or (-1, -1)
    assert (lo, hi) == (8, 24)
    before = buf.copy()
    plan.refill(lo, np.array([1000, 2000], dtype=np.int64).view(np.uint8).data)
    assert plan.serves_from(plan.prev, first + 8) and plan.in_from == 8
    changed = np.flatnonzero(buf != before)
    assert sorted((buf - before)[changed].tolist()) == [1000, 2000]

    # resumed past the start of its own segment's reduction: the resume fetched those
    # result bytes from the previous rank, so a refill stops short of them
    buf = np.arange(12, dtype=np.int64) + 100
    plan = RingAllreduce(buf.view(np.uint8).data, np.dtype(np.int64), Op.SUM, 0, 4,
                         lambda peer, n: memoryview(bytearray(n)))
    resume = plan.resume({plan.prev: first + plan.own_in_start + 8})
    assert resume.fetch and plan.in_from == plan.own_in_start + 8
    lo, hi = plan.refill_range(first + 8) or (-1, -1)
    assert (lo, hi) == (8, plan.own_in_start)
    own = slice(plan.own_segment[0] // 8, plan.own_segment[1] // 8)
    mine = buf[own].copy()
    plan.refill(lo, np.ones((hi - lo) // 8, dtype=np.int64).view(np.uint8).data)
    assert (buf[own] == mine).all() and plan.in_from == 8


@pytest.mark.parametrize("step", [4096, 256 * 1024])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_ring_retains_its_result_copied_while_it_made_it(
        monkeypatch: pytest.MonkeyPatch, world: int, step: int) -> None:
    """With recovery on the ring copies each result byte into the retained buffer as it
    makes it (its own segment step by step as it reduces it, ``schedule.MIRROR_STEP``; the
    allgather's segments as they arrive, or at world size 2 by landing them there): the
    retained result is the whole result, bit for bit, however the bytes arrive."""
    monkeypatch.setattr("rabit2.core.schedule.MIRROR_STEP", step)
    rng = np.random.default_rng(step + world)
    data = [rng.integers(-1000, 1000, 300_001).astype(np.float32) for _ in range(world)]
    bufs = [d.copy() for d in data]
    net = SimNet(world, seed=step + world, max_piece=70_001, recover=True, ring_mincount=0)
    net.run({r: Call(CollectiveKind.ALLREDUCE_RING, memoryview(bufs[r]).cast("B"),
                     np.dtype(np.float32), Op.SUM) for r in range(world)})
    assert not net.failed and len(net.done) == world
    expect = np.sum(data, axis=0, dtype=np.float32).tobytes()  # (exact: small integers)
    assert all(b.tobytes() == expect for b in bufs)
    for r in range(world):
        kept = net.agents[r].recovery.results.get(net.done[r])
        assert kept is not None
        assert bytes(kept[1]) == bufs[r].tobytes()


@pytest.mark.parametrize("seed", range(3))
def test_a_pair_exchange_makes_its_result_in_the_retained_buffer(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """At world size 2 with recovery on, a result above the small-result size is made in
    the buffer the store then keeps (one buffer taken per call, nothing copied into it at
    the end); the input is sent from the caller's array itself, in volatile sends, and the
    array holds the input until the call completes, then the result."""
    taken = _count_takes(monkeypatch)
    rng = np.random.default_rng(seed)
    data = [rng.integers(-1000, 1000, 30_001).astype(np.float64) for _ in range(2)]
    bufs = [d.copy() for d in data]
    net = SimNet(2, seed=seed, max_piece=9_001, recover=True)
    sends: list[Send] = []
    seen_input = []
    execute = net.execute

    def watching(rank: int, cmds: list[Command]) -> None:
        sends.extend(c for c in cmds if isinstance(c, Send) and len(c.buffers) > 1)
        if not any(isinstance(c, CallComplete) for c in cmds):
            seen_input.append(bufs[rank].tobytes() == data[rank].tobytes())
        execute(rank, cmds)

    monkeypatch.setattr(net, "execute", watching)
    net.run({r: Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[r]).cast("B"),
                     np.dtype(np.float64), Op.SUM) for r in range(2)})
    assert not net.failed and len(net.done) == 2
    expect = (data[0] + data[1]).tobytes()
    assert all(b.tobytes() == expect for b in bufs)
    assert taken == [bufs[0].nbytes] * 2  # one retained buffer per rank, no other
    assert sends and all(c.volatile for c in sends)
    assert seen_input and all(seen_input)  # (before completing, the array is the input)
    for r in range(2):
        kept = net.agents[r].recovery.results.get(net.done[r])
        assert kept is not None and bytes(kept[1]) == expect


def test_a_pair_plan_that_makes_its_result_aside_is_freed_by_reference_counting() -> None:
    """Its ``finish`` refers to the caller's array and the kept buffer, not to the plan: a
    plan in a reference cycle would keep the caller's array alive until the cyclic garbage
    collector runs, call after call."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    from rabit2.core.schedule import PairExchange  # noqa: PLC0415

    def scratch(peer: int, n: int) -> memoryview:
        return memoryview(bytearray(n))

    buf = memoryview(bytearray(800))
    plan = PairExchange(buf, np.dtype(np.float64), Op.SUM, 0, 1, scratch, scratch,
                        keep=memoryview(bytearray(800)))
    assert plan.finish is not None and plan.volatile_out
    ref = weakref.ref(plan)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del plan
        assert ref() is None
    finally:
        if enabled:
            gc.enable()


def test_a_small_pair_result_and_recovery_off_keep_the_input_copy() -> None:
    """Up to the small-result size (kept as bytes), and with recovery off (nothing kept),
    the pair exchange sends a copy of the input as before: its sends are not volatile."""
    for recover, count in ((True, 1000), (False, 30_001)):
        bufs = [np.full(count, r + 1, np.float64) for r in range(2)]
        net = SimNet(2, recover=recover)
        begun = {r: net.agents[r].begin(
            Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[r]).cast("B"),
                 np.dtype(np.float64), Op.SUM), 0.0) for r in range(2)}
        sends = [c for cmds in begun.values() for c in cmds if isinstance(c, Send)]
        assert sends and not any(c.volatile for c in sends)
        for r, cmds in begun.items():
            net.execute(r, cmds)
        while net.step():
            pass
        assert all((b == 3.0).all() for b in bufs)


@pytest.mark.parametrize("checked", [False, True])
def test_a_pair_resend_answered_with_the_last_bytes_in_one_read_sends_the_input(
        checked: bool) -> None:
    """A 160 KB pair exchange whose link resets while rank 0 lacks only the last 800 bytes of
    rank 1's input, and rank 1's lacks half of rank 0's.  After the reset rank 0 reads rank
    1's state and those 800 bytes in one read: its resend of the input to rank 1 is queued,
    then the call completes.  The resend must carry the input, not the result that lands in
    the same array once the call completed (on links without payload checksums nothing else
    would tell them apart)."""
    count = 20_000  # above the small-result size: the result is made in the kept buffer
    data = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(2)]
    bufs = [d.copy() for d in data]
    net = SimNet(2, seed=0, recover=True, checked=checked)
    for r in range(2):
        net.execute(r, net.agents[r].begin(
            Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[r]).cast("B"),
                 np.dtype(np.float64), Op.SUM), 0.0))

    def deliver(src: int, dst: int, nbytes: int) -> None:
        q, pos = net.queues[(src, dst)], 0
        while pos < nbytes:
            target = net.agents[dst].recv_buffer(src)
            n = min(len(target), nbytes - pos)
            target[:n] = q[pos : pos + n]
            pos += n
            net.execute(dst, net.agents[dst].on_bytes(src, n, net.now))
        del q[:nbytes]

    deliver(1, 0, len(net.queues[(1, 0)]) - 800)
    deliver(0, 1, len(net.queues[(0, 1)]) // 2)
    for link in ((0, 1), (1, 0)):
        del net.queues[link][:]  # (in flight when the link reset)
    for a, b in ((0, 1), (1, 0)):
        net.execute(a, net.agents[a].on_hangup(b, "reset", net.now))
    for a, b in ((0, 1), (1, 0)):
        net.execute(a, net.agents[a].on_link_up(b, net.agents[b].incarnation, net.now))
    deliver(0, 1, len(net.queues[(0, 1)]))  # rank 1 answers with what rank 0 lacks
    deliver(1, 0, len(net.queues[(1, 0)]))  # its state and the 800 bytes, in one read
    while net.step():
        pass
    assert not net.failed and len(net.done) == 2
    want = data[0] + data[1]
    assert all(np.array_equal(b, want) for b in bufs)


@pytest.mark.parametrize("checked", [False, True])
def test_a_pair_input_staged_whole_before_the_call_began(
        monkeypatch: pytest.MonkeyPatch, checked: bool) -> None:
    """Rank 1's whole input arrived (staged, held) before rank 0 began: rank 0's call
    completes inside ``begin``, with its own send still queued in the same commands; that
    send must carry rank 0's input, and the array the result."""
    monkeypatch.setattr("rabit2.core.recovery.component.SMALL_RESULT", 0)
    data = [np.arange(100, dtype=np.float64) * (r + 1) for r in range(2)]
    bufs = [d.copy() for d in data]
    net = SimNet(2, seed=1, recover=True, checked=checked)

    def call(r: int) -> Call:
        return Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[r]).cast("B"),
                    np.dtype(np.float64), Op.SUM)

    net.execute(1, net.agents[1].begin(call(1), 0.0))
    while net.step():
        pass
    begun = net.agents[0].begin(call(0), 0.0)
    assert any(isinstance(c, CallComplete) for c in begun)  # (completed within begin)
    net.execute(0, begun)
    while net.step():
        pass
    assert not net.failed and len(net.done) == 2
    want = data[0] + data[1]
    assert all(np.array_equal(b, want) for b in bufs)


PAIR_SEEDS = [s for s in range(600) if int(np.random.default_rng([7919, s]).integers(2, 9)) == 2]
"""Seeds of ``random_plan`` whose world size is 2 (where allreduces go pairwise)."""


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("seed", PAIR_SEEDS[:24])
def test_random_fault_plans_with_every_pair_result_made_in_place(
        monkeypatch: pytest.MonkeyPatch, seed: int, checked: bool) -> None:
    """Random fault plans at world size 2 with every pair exchange making its result in the
    retained buffer (normally only above 64 KiB): kills, resets and resumes meet results made
    aside, arrays that hold the input until the end, and results fetched from a neighbour
    instead; with payload checksums and without (as between ranks on one host), where a
    send that carried result bytes would go unnoticed but for the results."""
    monkeypatch.setattr("rabit2.core.recovery.component.SMALL_RESULT", 0)
    monkeypatch.setitem(KW, "checked", checked)
    run_random_plan(seed)


@pytest.mark.slow
@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("seed", PAIR_SEEDS[24:])
def test_random_fault_plans_with_every_pair_result_made_in_place_soak(
        monkeypatch: pytest.MonkeyPatch, seed: int, checked: bool) -> None:
    """The same, over the other seeds below 600 (``pytest --slow -k made_in_place_soak``)."""
    monkeypatch.setattr("rabit2.core.recovery.component.SMALL_RESULT", 0)
    monkeypatch.setitem(KW, "checked", checked)
    run_random_plan(seed)


@pytest.mark.parametrize("at", [(0, 0), (1, 1), (2, 0)])
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_mid_pair_call_with_its_result_made_in_place(
        monkeypatch: pytest.MonkeyPatch, at: tuple[int, int], victim: int) -> None:
    """A rank killed before, inside and at the end of a pair exchange whose result is made
    in the retained buffer: its restart replays and resumes, and every result is exact."""
    monkeypatch.setattr("rabit2.core.recovery.component.SMALL_RESULT", 0)
    program = [[SMALL, Spec("allreduce", 700)], [Spec("broadcast", 300, root=1), SMALL],
               [Spec("allreduce", 900), SMALL]]
    nbytes = program[at[0]][at[1]].count * 8
    for seed, after in enumerate([0, nbytes // 3, nbytes - 1]):
        run_job(2, [Kill(victim, at, after)], seed=seed, program=program)


def _count_takes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of every buffer the replay stores hand out from now on."""
    taken: list[int] = []
    take = ResultStore.take

    def counting_take(self: ResultStore, size: int) -> np.ndarray:
        taken.append(size)
        return take(self, size)

    monkeypatch.setattr(ResultStore, "take", counting_take)
    return taken


def test_older_results_go_once_every_rank_has_joined_the_new_version() -> None:
    """The results of version v - 1 are dropped when this rank finishes a call of version v
    that every rank contributes to (an allreduce): then no rank is behind v any more.  A
    broadcast is not proof (a rank off its route can still be in v - 1), so they stay; the
    dropped buffers serve the version's later results of the same size."""
    world = 3
    net = SimNet(world, seed=4, recover=True, ring_mincount=0)

    def ring(i: int) -> dict[int, Call]:
        bufs = [np.full(40_000, r + i, dtype=np.float32) for r in range(world)]
        return {r: Call(CollectiveKind.ALLREDUCE_RING, memoryview(bufs[r]).cast("B"),
                        np.dtype(np.float32), Op.SUM) for r in range(world)}

    net.run(ring(0))
    for agent in net.agents.values():
        agent.checkpoint(b"v1")
    net.run(ring(1))
    spare_before = {r: agent.recovery.results.get((1, 0)) for r, agent in net.agents.items()}
    for agent in net.agents.values():
        agent.checkpoint(b"v2")
    bufs = [np.full(1000, 7, dtype=np.int32) if r == 0 else np.empty(1000, np.int32)
            for r in range(world)]
    net.run({r: Call(BCAST, memoryview(bufs[r]).cast("B"), root=0) for r in range(world)})
    for agent in net.agents.values():  # a broadcast proves nothing: version 1 stays
        store = agent.recovery.results
        assert store.get((1, 0)) is not None and store.oldest <= (1, 0)
    net.run(ring(2))
    for agent in net.agents.values():
        store = agent.recovery.results
        assert store.get((1, 0)) is None and store.oldest == (2, 0)
    net.run(ring(3))
    assert not net.failed
    for r, agent in net.agents.items():
        kept = agent.recovery.results.get((2, 2))
        before = spare_before[r]
        assert kept is not None and before is not None
        # the new result sits in the buffer the dropped one had
        assert np.shares_memory(np.frombuffer(kept[1], np.uint8),
                                np.frombuffer(before[1], np.uint8))


def test_a_ring_result_too_large_to_keep_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``rabit2_replay_mb`` a result is never kept: a ring at world size > 2 then
    takes no buffer for it and copies nothing while it makes the result."""
    taken = _count_takes(monkeypatch)
    world = 3
    data = [np.full(30_000, r + 1, dtype=np.float32) for r in range(world)]
    bufs = [d.copy() for d in data]
    net = SimNet(world, seed=3, recover=True, ring_mincount=0, retain_bytes=64 * 1024)
    net.run({r: Call(CollectiveKind.ALLREDUCE_RING, memoryview(bufs[r]).cast("B"),
                     np.dtype(np.float32), Op.SUM) for r in range(world)})
    assert not net.failed and len(net.done) == world
    assert all((b == 6).all() for b in bufs)
    for r in range(world):
        agent = net.agents[r]
        store = agent.recovery.results
        assert store.get(net.done[r]) is None and store.nbytes == 0
    assert taken == []


def test_rings_of_a_version_that_overflowed_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """World 3, 120 KB results and room for two: the third ring call drops the first
    result of its own version, so from the fourth call on the agents take no buffer and
    copy nothing for replays (no restart could use them), and the results stay right."""
    taken = _count_takes(monkeypatch)
    world = 3
    net = SimNet(world, seed=5, recover=True, ring_mincount=0, retain_bytes=250_000)
    for i in range(5):
        data = [np.full(30_000, r + i, dtype=np.float32) for r in range(world)]
        bufs = [d.copy() for d in data]
        net.run({r: Call(CollectiveKind.ALLREDUCE_RING, memoryview(bufs[r]).cast("B"),
                         np.dtype(np.float32), Op.SUM) for r in range(world)})
        assert not net.failed and len(net.done) == world
        expect = np.sum(data, axis=0, dtype=np.float32).tobytes()
        assert all(b.tobytes() == expect for b in bufs)
        if i == 2:
            assert len(taken) == 3 * world  # one buffer per rank and call so far
    assert len(taken) == 3 * world
    for agent in net.agents.values():
        assert agent.recovery.results.overflowed == 0 and agent.recovery.results.nbytes == 0
        assert agent.recovery.results.oldest == (0, 5)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["overflowed", "checkpointing"])
def test_recycled_ring_buffers_do_not_chain(checkpoint: bool) -> None:
    """World 2 rings recycle their replay buffers call after call (a version that
    overflowed, or checkpoints that drop old results): the store must get back the array it
    handed out, never a new array over it, or each call adds a link to a chain of arrays
    that only grows and overflows the C stack when it is freed."""
    world, n = 2, 50_000
    net = SimNet(world, seed=9, recover=True, ring_mincount=0, retain_bytes=500_000)
    for i in range(40):
        if checkpoint:
            for agent in net.agents.values():
                agent.checkpoint(None)
        data = [np.full(n, r + i, dtype=np.float32) for r in range(world)]
        bufs = [d.copy() for d in data]
        net.run({r: Call(CollectiveKind.ALLREDUCE_RING, memoryview(bufs[r]).cast("B"),
                         np.dtype(np.float32), Op.SUM) for r in range(world)})
        assert not net.failed and all((b == 2 * i + 1).all() for b in bufs)

    def depth(obj: object) -> int:
        d = 0
        while isinstance(obj, (np.ndarray, memoryview)):
            obj = obj.base if isinstance(obj, np.ndarray) else obj.obj
            d += 1
        return d

    for agent in net.agents.values():
        store = agent.recovery.results
        arrays = [a for spares in store._spare.values() for a in spares]
        arrays += [blob for _, blob, _ in store._results.values() if isinstance(blob, np.ndarray)]
        assert arrays and max(depth(a) for a in arrays) <= 2, [depth(a) for a in arrays]


def test_one_need_per_call_when_a_link_resets_while_a_restarted_rank_is_between_calls() -> None:
    """World 2: rank 0 dies after its first call, is restarted and replays it; its link
    then resets while it is between that call and the one rank 1 is blocked in.  It begins
    that call (asking for rank 1's stream with a need) before rank 1's state from the new
    connection arrives; that state must not make it ask a second time, or rank 1 sends
    its stream twice and the copy lands in the next call."""
    program = [[Spec("allgather", 1)], [Spec("allreduce", 100)]]
    job = ResetJob(2, program, seed=727, kills=[Kill(0, (0, 0), 11_250, restart_after=1935)],
                   resets=[Reset(0, 1, (0, 0), 32_153)], max_piece=1869, **KW)
    job.run()
    job.check()
    assert job.resets[0].done and job.net.agents[0].incarnation == 1


@pytest.mark.parametrize(("world", "program", "kill", "reset", "seed", "max_piece"), [
    (6, [[Spec("allreduce", 5000), Spec("allreduce", 999), Spec("allreduce", 1500)]],
     Kill(4, (0, 2), 20_994, restart_after=1953), Reset(4, 3, (0, 2), 32_850), 582, 5079),
    (8, [[Spec("allgather", 50)]],
     Kill(7, (0, 0), 34_447, restart_after=3819), Reset(7, 6, (0, 0), 8502), 651, 1330),
], ids=["ring", "allgather"])
def test_a_reset_while_the_restarted_rank_replays_gets_the_result_to_the_blocked_neighbour(
        world: int, program: list[list[Spec]], kill: Kill, reset: Reset, seed: int,
        max_piece: int) -> None:
    """The restarted rank replays the call its neighbour is blocked in from the result
    (another neighbour finished it) and serves the blocked one from it; their link resets
    before the last bytes arrive.  The restarted rank, still replaying, must send the result
    again on the new connection (the neighbour waits for nothing else)."""
    job = ResetJob(world, program, seed=seed, kills=[kill], resets=[reset],
                   max_piece=max_piece, **{**KW, "tree_chunk": 64 if world == 6 else 4096})
    job.run()
    job.check()
    assert reset.done


def test_a_replayed_broadcast_whose_in_link_has_not_begun_it_is_received_not_fetched() -> None:
    """Rank 4 dies; its neighbours run ahead through broadcasts that avoid it, except rank
    6, its in-link for the broadcast from root 3, which is still blocked earlier.  The
    restarted rank replays that broadcast: rank 3 finished it, but fetching the result
    from 3 would end the call while 6 (which begins it later) sends the whole stream into
    the next call.  It must take the stream from 6."""
    program = [[Spec("allgather", 1), Spec("allgather", 2000)],
               [Spec("allreduce", 7), Spec("object", 20_000, root=5)],
               [Spec("broadcast", 20_000, root=3)]]
    job = ResetJob(7, program, seed=728, kills=[Kill(4, (1, 0), 22_709, restart_after=3128)],
                   resets=[Reset(1, 0, (0, 1), 38_135)], max_piece=5554, **KW)
    job.run()
    job.check()
    assert job.net.agents[4].incarnation == 1


def test_a_reset_during_an_unsized_broadcast_waits_for_the_peers_need() -> None:
    """Ranks 5 and 0 reset their link while rank 0 receives a small object broadcast whose
    size it does not know yet (so it has no out-stream to 5 yet) and 5 is still one call
    behind.  When the size arrives, rank 0 must still wait for 5's need before sending:
    sending at once and again from the need doubled the stream (protocol error)."""
    program = [[Spec("allreduce", 12_000), Spec("allreduce", 100)],
               [Spec("allreduce", 12_000)],
               [Spec("broadcast", 20_000, root=0), Spec("object", 1, root=2),
                Spec("allreduce", 12_000)]]
    reset = Reset(5, 0, (2, 0), 30_007)
    job = ResetJob(6, program, seed=289, kills=[Kill(0, (2, 2), 16_955, restart_after=472)],
                   resets=[reset], max_piece=4794, **{**KW, "tree_chunk": 64})
    job.run()
    job.check()
    assert reset.done


def test_a_stand_in_dropped_two_checkpoints_ago_is_a_typed_error_not_a_hang() -> None:
    """World 3: rank 2 finishes an allgather, then a broadcast that avoids rank 1, and
    checkpoints twice while rank 1 still receives the end of 2's allgather stream; their
    link then resets.  Rank 2 no longer retains that result (two generations), so rank 1
    cannot finish: it must fail at once with UnrecoverableError, not wait forever."""
    program = [[Spec("allgather", 2000)], [Spec("broadcast", 1)]]
    # (an interleaving found with unchecked frames, which their senders split differently)
    job = ResetJob(3, program, seed=2098, resets=[Reset(2, 1, (1, 0), 30_104)],
                   max_piece=2509, checked=False, **{**KW, "tree_chunk": 64})
    with pytest.raises(UnrecoverableError, match="no longer retains"):
        job.run()


# -- randomized fault plans (the soak) --------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_fault_plans(seed: int) -> None:
    """Random programs, world sizes and kill/reset points: every job either finishes with
    every result exact, or (only in the documented cases) fails with UnrecoverableError;
    never a hang, a protocol error or a wrong result."""
    run_random_plan(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 10_000))
def test_random_fault_plans_soak(seed: int) -> None:
    """The same, over many more plans (``pytest --slow -k random_fault_plans_soak``, about
    five minutes).  On 2026-11-24 seeds 0-40 000 passed (seed 20 028: a neighbour two
    checkpoints ahead, the documented limitation)."""
    run_random_plan(seed)


@pytest.mark.parametrize("seed", range(20))
def test_random_fault_plans_with_a_landing_ring_that_wraps(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The same plans with the ring's reduce-scatter landing in a 1 KiB cyclic buffer, so
    that kills, resets, resumes and refills meet bytes that landed round and round."""
    monkeypatch.setattr("rabit2.core.schedule.MIN_RING_REDUCE", 256)
    monkeypatch.setattr("rabit2.core.schedule.LANDING_RING", 1024)
    run_random_plan(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20, 3000))
def test_random_fault_plans_with_a_landing_ring_that_wraps_soak(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The same, over many more plans (``pytest --slow -k wraps_soak``)."""
    monkeypatch.setattr("rabit2.core.schedule.MIN_RING_REDUCE", 256)
    monkeypatch.setattr("rabit2.core.schedule.LANDING_RING", 1024)
    run_random_plan(seed)


def test_a_reset_with_a_restarted_rank_that_replayed_past_the_call_releases_it() -> None:
    """Rank 6 is restarted and replays past the call rank 4 is blocked in; their link then
    resets while 6 is between calls, still replaying.  Rank 4 must not wait for a need from
    6 for that call (6 needs none of it any more)."""
    program = [[Spec("broadcast", 3000, root=2)],
               [Spec("allreduce", 7), Spec("broadcast", 3000, root=1), Spec("allreduce", 999)]]
    reset = Reset(6, 4, (1, 0), 17_781)
    job = ResetJob(7, program, seed=1743, kills=[Kill(6, (1, 0), 30_020, restart_after=3436)],
                   resets=[reset], max_piece=1698, **{**KW, "tree_chunk": 64})
    job.run()
    job.check()
    assert reset.done


@pytest.mark.parametrize("seed", range(6))
def test_a_reset_while_a_restarted_rank_fetches_from_its_only_neighbour_asks_again(
        seed: int) -> None:
    """World 2: the restarted rank fetches a broadcast's result from the only neighbour
    that holds it, and their link resets just then.  The fetch waits for the link to come
    back and is asked again (it was an UnrecoverableError: "no other neighbour holds it")."""
    program = [[Spec("broadcast", 20_000, root=1), Spec("allreduce", 100)]]
    reset = Reset(0, 1, (0, 0), 0)
    job = ResetJob(2, program, seed=seed, kills=[Kill(0, (0, 0), 0, restart_after=50)],
                   resets=[reset], max_piece=997, **KW)
    job.run()
    job.check()
    assert reset.done and job.net.agents[0].incarnation == 1


# Soak plans that each caught a bug (fixed), run on every test run: seed -> what went wrong.
SOAK_REGRESSIONS = {
    10099: "a reset peer's state for a call two ahead was dropped when this rank began the "
           "call in between; the peer waited for a need forever",
    4055: "a second reset cut off the result a finished neighbour was sending in place of "
          "its stream; the call waited for the rest of a blob gone with the old connection",
    10593: "a neighbour already sending frames of a later call put them ahead of the result "
           "a replaying rank was fetching from it; the rank held the link at that frame",
    31623: "the same, for a call begun while the replaying peer's state was on the way",
    15525: "the sender of a stand-in result died half way; the call must wait for its "
           "stream again, with its buffer untouched",
    45: "a replaying rank's 'your stream starts at 0' made a neighbour that was not holding "
        "the call back send it twice (also seeds 104, 168, 287, 1359)",
    104: "see 45", 168: "see 45", 287: "see 45", 1359: "see 45",
    13117: "a fetch answered 'not found' (the neighbour's store moved on since its state) "
           "was an UnrecoverableError although another neighbour held the result",
    27264: "a second stand-in for a call already served did not release its sender's "
           "stream; the root of a tiny broadcast waited for it forever",
    672: "a reset with a rank still replaying: neither end sent another need, and each "
         "had to act on the other's state (also seeds 1716, 1975, 9164)",
    1716: "see 672", 1975: "see 672", 9164: "see 672",
    38025: "a reset while the survivor was between calls, at the very call the replaying "
           "peer was in: once it began that call it never said where the peer's stream "
           "should start, and the peer held it back waiting",
}


def test_random_adjacent_fault_plans() -> None:
    """Two neighbours killed together, 60 random plans: no hang, no wrong result, no error
    but the documented ones, and most of them recover (99.6 % over 3 000 plans)."""
    recovered = sum(run_adjacent_plan(seed) for seed in range(60))
    assert recovered >= 50, recovered


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(60, 3000))
def test_random_adjacent_fault_plans_soak(seed: int) -> None:
    """The same, one plan at a time (``pytest --slow -k adjacent_fault_plans_soak``)."""
    run_adjacent_plan(seed)


# Three or four ranks lost, each a neighbour of one lost before it (a host running several
# consecutive ranks goes down).  Known to end stuck, until the progress deadline: a restarted
# rank whose neighbours were all restarted too has no live neighbour to learn its checkpoint
# version from (docs/recovery.md, "Limitations").  (chain length, seed) pairs found so far.
# plans where a restarted rank takes version 0 for want of a live neighbour although one of
# its restarted neighbours resumes from a later checkpoint (docs/recovery.md, "Limitations");
# they waited for the progress deadline until that was detected
_CHAIN_VERSION_ZERO = [(3, 55), (3, 250), (3, 348), (3, 352), (4, 45), (4, 84), (4, 122)]


@pytest.mark.parametrize("k", [3, 4])
def test_random_chain_fault_plans(k: int) -> None:
    """Three or four neighbouring ranks lost, 40 random plans each: no wrong result, only
    documented errors, and nearly all recover (3: 383 of 400 plans, 4: 380 of 400)."""
    recovered = sum(run_chain_plan(seed, k) for seed in range(40))
    assert recovered >= 37, recovered


def test_a_replacement_that_catches_up_before_a_replaying_neighbour_s_call_hears_its_need(
        ) -> None:
    """Chain plan (k=4, seed 173): a replaying inner rank fetched a broadcast whose result
    its parent had run ahead with, and sent its need to a child that was then lost too.  The
    child's replacement caught up before it reached that call, so it held its announce back
    for the replaying rank's need, which had gone down with the old connection: both waited.
    The need is said again on the new connection as soon as the replacement's state
    shows it behind."""
    assert run_chain_plan(173, 4)


@pytest.mark.slow
@pytest.mark.parametrize("k", [3, 4])
@pytest.mark.parametrize("seed", range(40, 400))
def test_random_chain_fault_plans_soak(k: int, seed: int) -> None:
    """The same, one plan at a time (``pytest --slow -k chain_fault_plans_soak``)."""
    run_chain_plan(seed, k)


@pytest.mark.parametrize(("k", "seed"), _CHAIN_VERSION_ZERO)
def test_a_rank_that_took_version_0_wrongly_ends_typed_at_once(k: int, seed: int) -> None:
    """The middle rank of the chain has only restarted neighbours, so it cannot learn the
    job's checkpoint version and takes 0, while a restarted neighbour resumes from a later
    one.  Whether it hears that at load or after, it fails with UnrecoverableError naming
    the cause, long before any deadline (it used to wait in a call that neighbour never
    makes until the progress deadline), and every rank that began a call fails typed."""
    job = random_chain_plan(seed, k)
    with pytest.raises(UnrecoverableError,
                       match=r"took checkpoint version 0: every neighbour.*resumed from "
                             r"version [1-9].*three or more neighbouring ranks"):
        job.run(max_steps=100_000)  # (before: "the job did not finish" in these steps)
    while job.net.step():
        pass
    assert all(isinstance(e, UnrecoverableError) for e in job.net.failed.values())


# Adjacent-loss plans that each caught a bug (fixed): seed -> what went wrong.
ADJACENT_REGRESSIONS = {
    184: "a neighbour restarted too that resumed from a later checkpoint was waited for in "
         "a call it skipped",
    125: "the replacement of a fetch's source connected before the old link was seen to "
         "go down; the fetch waited for the dead process",
    210: "both replaying, one already in the call when the link came up: its state said "
         "what it held, and no other need was coming",
    355: "a need for a later call from a neighbour restarted too did not release the call "
         "it skipped",
}


@pytest.mark.parametrize("seed", sorted(ADJACENT_REGRESSIONS))
def test_adjacent_plans_that_caught_a_bug(seed: int) -> None:
    assert run_adjacent_plan(seed)


@pytest.mark.parametrize("seed", [1469, 1109, 1290])
def test_adjacent_kills_in_the_general_soak_recover(seed: int) -> None:
    """Plans of the general soak with two neighbouring kills that caught a bug: 1469, a
    restarted rank took the result from a restarted parent (which had fetched it) before
    its children's contributions and reduced them over it (a wrong result); 1109 and 1290,
    a restarted rank waited for a neighbour's need while that one waited, in a call the
    first had skipped, for its need."""
    job, close = random_plan(seed)
    assert close
    job.run()
    job.check()


@pytest.mark.parametrize("seed", sorted(SOAK_REGRESSIONS))
def test_soak_plans_that_caught_a_bug(seed: int) -> None:
    """Each plan in :data:`SOAK_REGRESSIONS` recovers bit for bit."""
    job, _ = random_plan(seed)
    job.run()
    job.check()


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("world", [2, 3, 4, 6])
@pytest.mark.parametrize("seed", range(6))
def test_a_damaged_byte_is_caught_and_the_link_resumes_after_the_last_good_frame(
        world: int, seed: int) -> None:
    job = corrupt_job(world, seed)
    job.run()
    job.check()  # every result on every rank is the exact one
    (c,) = job.corruptions
    assert c.link is not None
    stats = [a.recovery_statistics() for a in job.net.agents.values()]
    assert sum(s["corrupt_frames"] for s in stats) == 1
    src, dst = c.link
    assert stats[dst]["corrupt_frames"] == 1
    assert stats[dst]["links_up"] == stats[src]["links_up"] == 1
    assert all(agent.incarnation == 0 for agent in job.net.agents.values())  # no restart
    assert not job.resumed_from


@pytest.mark.parametrize("seed", range(4))
def test_many_damaged_bytes_on_many_links(seed: int) -> None:
    job = corrupt_job(5, seed, count=12)
    job.run()
    job.check()
    done = sum(c.link is not None for c in job.corruptions)
    assert done >= 6
    # (two damaged bytes in one frame, or one on a connection that was reset before it
    # arrived, are one detection or none)
    caught = sum(a.recovery_statistics()["corrupt_frames"] for a in job.net.agents.values())
    assert 1 <= caught <= done


@pytest.mark.parametrize("seed", range(4))
def test_without_recovery_a_damaged_byte_fails_the_call_typed(seed: int) -> None:
    job = corrupt_job(3, seed, recover=False)
    with pytest.raises(ProtocolError, match="checksum"):
        job.run()


def test_a_link_that_damages_every_frame_fails_typed_instead_of_resetting_forever() -> None:
    job = corrupt_job(2, 0, count=0)

    def damage_everything() -> None:
        Job._faults(job)
        job.net.corrupt(1, 0, 3)  # a header byte of whatever rank 1 sends next

    job._faults = damage_everything  # type: ignore[method-assign]
    with pytest.raises(ProtocolError, match="corrupt frames in a row"):
        job.run()


def test_ranks_that_check_and_ranks_that_do_not_work_together() -> None:
    job = corrupt_job(4, 0, count=0)
    for rank in (1, 2):  # (their links to 0 and 3 are checked one way only)
        for link in job.net.agents[rank].links.values():
            link.checked = False
    job.run()
    job.check()
