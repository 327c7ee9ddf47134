"""Fault plans over the simulation: a job of many ranks on a :class:`SimNet`, and the
kills, link resets and damaged bytes it meets at chosen or random points.

A :class:`Job` runs the same program on every rank: iterations of collectives, a checkpoint
after each.  A :class:`Kill` ends a rank once it has received a number of payload bytes of a
given call; after a while the rank is restarted (a new agent, incarnation + 1), loads the
checkpoint from its neighbours and replays.  :class:`ResetJob` also resets links between
live ranks (:class:`Reset`), :class:`SourceKillJob` kills the neighbour a restarted rank
fetches its checkpoint from, and :class:`CorruptJob` damages bytes on links
(:class:`Corrupt`).  :meth:`Job.check` compares every result of every rank, replayed or
not, with numpy.

The random plans (:func:`random_plan`, :func:`random_adjacent_plan`,
:func:`random_chain_plan`) draw a world, a program and the faults from a seed;
:func:`run_random_plan` and :func:`recovers` run one and accept an exact result or only the
typed errors that docs/recovery.md documents.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from rabit2.core.agent import Call
from rabit2.core.framing import CollectiveKind
from rabit2.core.ops import Op
from rabit2.core.recovery.store import GENERATIONS
from rabit2.core.topology import topology
from rabit2.errors import UnrecoverableError
from tests.sim.simnet import SimNet

BCAST = CollectiveKind.BROADCAST
GATHER = CollectiveKind.ALLGATHER


@dataclasses.dataclass(frozen=True)
class Spec:
    """One collective of the program: ``kind`` is "allreduce", "broadcast" or "allgather"."""

    kind: str
    count: int
    dtype: str = "int64"
    op: Op = Op.SUM
    root: int = 0


def data_for(rank: int, it: int, j: int, spec: Spec) -> np.ndarray:
    rng = np.random.default_rng([rank, it if it >= 0 else 1 << 20, j])  # (-1: bootstrap)
    if np.dtype(spec.dtype).kind == "f":
        return rng.standard_normal(spec.count).astype(spec.dtype)
    return rng.integers(-1000, 1000, spec.count).astype(spec.dtype)


def expected(world: int, it: int, j: int, spec: Spec) -> bytes:
    inputs = [data_for(r, it, j, spec) for r in range(world)]
    if spec.kind == "allreduce":
        out = inputs[0].copy()
        for x in inputs[1:]:
            np.add(out, x, out=out)  # the tests use SUM on exact (integer) dtypes
        return out.tobytes()
    if spec.kind in ("broadcast", "object"):
        return inputs[spec.root % world].tobytes()
    return b"".join(x.tobytes() for x in inputs)


@dataclasses.dataclass
class Kill:
    rank: int
    at: tuple[int, int]  # (iteration, index of the call in it)
    after_bytes: int  # payload bytes of that call received before the kill
    restart_after: int = 2000  # network steps before the launcher restarts it
    killed_at_step: int = -1
    incarnation: int = 0


class Job:
    """Every rank runs ``bootstrap`` (calls made before the program's first
    ``load_checkpoint``, iteration -1), then ``program``: iterations of calls, each followed
    by a checkpoint.  A restarted rank replays ``bootstrap`` and then loads its checkpoint."""

    def __init__(self, world: int, program: list[list[Spec]], *, seed: int = 0,
                 max_piece: int = 1 << 12, kills: list[Kill] = (),
                 bootstrap: list[Spec] = (), **agent_kw: object) -> None:
        agent_kw.setdefault("recover", True)
        self.net = SimNet(world, seed, max_piece, **agent_kw)
        self.world = world
        self.program = program
        self.bootstrap = list(bootstrap)
        self.pos = dict.fromkeys(range(world), (-1, 0) if bootstrap else (0, 0))
        self.replaying_bootstrap: set[int] = set()
        self.inflight: dict[int, tuple[int, int, np.ndarray, int]] = {}
        self.results: dict[int, dict[tuple[int, int], bytes]] = {r: {} for r in range(world)}
        self.loading: dict[int, str] = {}  # rank -> "states" | "checkpoint"
        self.kills = list(kills)
        self.steps = 0
        self.calls_begun = dict.fromkeys(range(world), 0)
        self.resumed_from: dict[int, int] = {}  # a restarted rank: the version it loaded
        self.holders: dict[int, dict[str, np.ndarray]] = {}  # receivers of an "object"

    # -- the worker program -----------------------------------------------------------------

    def _advance(self, rank: int) -> None:
        """Begin the rank's next call (taking checkpoints on the way)."""
        agent = self.net.agents[rank]
        while True:
            it, j = self.pos[rank]
            if it == -1 and j == len(self.bootstrap):
                if rank in self.replaying_bootstrap:
                    self.replaying_bootstrap.discard(rank)
                    self.loading[rank] = "checkpoint"
                    self.net.execute(rank, agent.load_checkpoint(with_local=True))
                    return
                agent.keep_bootstrap()  # (the program's first load_checkpoint: version 0)
                self.pos[rank] = (0, 0)
                continue
            if it == len(self.program):
                return
            if it >= 0 and j == len(self.program[it]):
                agent.checkpoint(f"model after iteration {it}".encode())
                self.net.execute(rank, agent.push_local(f"rank {rank} local {it}".encode()))
                self.pos[rank] = (it + 1, 0)
                continue
            break
        spec = self.bootstrap[j] if it == -1 else self.program[it][j]
        mine = data_for(rank, it, j, spec)
        if spec.kind == "allreduce":
            arr = mine.copy()
            buf = arr.reshape(-1).view(np.uint8).data
            kind = agent.choose_allreduce(len(buf), arr.dtype.itemsize)
            call = Call(kind, buf, arr.dtype, spec.op)
        elif spec.kind == "broadcast":
            root = spec.root % self.world
            arr = mine.copy() if rank == root else np.zeros_like(mine)
            call = Call(BCAST, arr.view(np.uint8).data, root=root)
        elif spec.kind == "object":
            # as the API broadcasts: a head with the size, and receivers that learn it
            root = spec.root % self.world
            if rank == root:
                arr = mine.copy()
                head = np.array([arr.nbytes], dtype=np.uint64)
                call = Call(BCAST, memoryview(b""), root=root,
                            pieces=(head.view(np.uint8).data, arr.view(np.uint8).data))
            else:
                arr = np.zeros(0, dtype=spec.dtype)
                holder: dict[str, np.ndarray] = {}

                def place(head: memoryview, holder: dict[str, np.ndarray] = holder,
                          spec: Spec = spec) -> memoryview:
                    nbytes = int(np.frombuffer(head, dtype=np.uint64)[0])
                    holder["out"] = np.zeros(nbytes // np.dtype(spec.dtype).itemsize,
                                             dtype=spec.dtype)
                    return holder["out"].view(np.uint8).data

                call = Call(BCAST, memoryview(b""), root=root, receive=place, head_size=8)
                self.holders[rank] = holder
        else:
            arr = np.zeros(spec.count * self.world, dtype=spec.dtype)
            arr[rank * spec.count : (rank + 1) * spec.count] = mine
            size = spec.count * arr.dtype.itemsize
            blocks = tuple((r * size, (r + 1) * size) for r in range(self.world))
            call = Call(GATHER, arr.view(np.uint8).data, blocks=blocks)
        base = agent.statistics().bytes_received
        self.inflight[rank] = (it, j, arr, base)
        self.calls_begun[rank] += 1
        self.net.execute(rank, agent.begin(call, self.net.now))

    def _collect(self) -> None:
        for rank, call_id in list(self.net.done.items()):
            if rank not in self.inflight:
                continue
            it, j, arr, _ = self.inflight.pop(rank)
            del self.net.done[rank]
            holder = self.holders.pop(rank, None)
            if holder is not None:
                arr = holder["out"]
            self.results[rank][(it, j)] = arr.tobytes()
            self.pos[rank] = (it, j + 1)
            del call_id

    def _faults(self) -> None:
        for kill in self.kills:
            if kill.killed_at_step < 0:
                flight = self.inflight.get(kill.rank)
                if flight is None or (flight[0], flight[1]) != kill.at:
                    continue
                got = self.net.agents[kill.rank].statistics().bytes_received - flight[3]
                if got < kill.after_bytes and kill.rank not in self.net.done:
                    continue  # (a call that receives less than that dies when it completes)
                self.net.kill(kill.rank)
                self.replaying_bootstrap.discard(kill.rank)
                self.inflight.pop(kill.rank, None)
                self.holders.pop(kill.rank, None)
                kill.killed_at_step = self.steps
            elif kill.incarnation == 0 and self.steps - kill.killed_at_step >= (
                    kill.restart_after):
                kill.incarnation = self.net.agents[kill.rank].incarnation + 1
                self.net.restart(kill.rank, kill.incarnation)
                self.loading[kill.rank] = "states"

    def _loading(self, rank: int) -> None:
        agent = self.net.agents[rank]
        if self.loading[rank] == "states":
            if agent.states_known() and self.bootstrap:
                del self.loading[rank]  # (replays the bootstrap calls, then loads)
                self.replaying_bootstrap.add(rank)
                self.pos[rank] = (-1, 0)
            elif agent.states_known():
                self.loading[rank] = "checkpoint"
                self.net.execute(rank, agent.load_checkpoint(with_local=True))
        elif rank in self.net.loaded:
            version, blob, local = self.net.loaded.pop(rank)
            if version:
                assert blob == f"model after iteration {version - 1}".encode()
                assert local == f"rank {rank} local {version - 1}".encode()
            self.pos[rank] = (version, 0)
            self.resumed_from[rank] = version
            del self.loading[rank]

    def run(self, max_steps: int = 3_000_000) -> None:
        while self.steps < max_steps:
            self.steps += 1
            self._faults()  # first: a call that just completed can still be killed
            self._collect()
            if self.net.failed:
                rank, error = next(iter(self.net.failed.items()))
                raise error
            for rank in range(self.world):
                if rank in self.net.dead:
                    continue
                if rank in self.loading:
                    self._loading(rank)
                elif rank not in self.inflight:
                    self._advance(rank)
            moved = self.net.step()
            if not moved and not self.net.dead and not self.loading:
                if not self.inflight and all(
                        pos[0] == len(self.program) for pos in self.pos.values()):
                    return
                if any(r not in self.inflight for r in range(self.world)) or self.net.done:
                    continue
                raise AssertionError(f"stuck: inflight {sorted(self.inflight)}, "
                                     f"states {[a.state for a in self.net.agents.values()]}")
        raise AssertionError("the job did not finish")

    def check(self) -> None:
        for rank in range(self.world):
            for j, spec in enumerate(self.bootstrap):
                got = self.results[rank].get((-1, j))
                assert got == expected(self.world, -1, j, spec), (rank, -1, j, spec)
            for it, calls in enumerate(self.program):
                for j, spec in enumerate(calls):
                    got = self.results[rank].get((it, j))
                    if got is None and it < self.resumed_from.get(rank, 0):
                        continue  # died in an iteration its neighbours had checkpointed
                    assert got is not None, (rank, it, j)
                    assert got == expected(self.world, it, j, spec), (rank, it, j, spec)


SMALL = Spec("allreduce", 100)  # tree (or pair at world 2)
RING = Spec("allreduce", 5000)  # ring with ring_mincount below
PROGRAM = [[SMALL, RING, Spec("broadcast", 300, root=1)],
           [Spec("allgather", 50), RING, Spec("object", 3000, root=3)],
           [SMALL, Spec("broadcast", 2000, root=2)]]
KW = {"ring_mincount": 1000, "tree_chunk": 256}


def run_job(world: int, kills: list[Kill], seed: int = 0, program: list[list[Spec]] = PROGRAM,
            **kw: object) -> Job:
    job = Job(world, program, seed=seed, kills=kills, **{**KW, **kw})
    job.run()
    job.check()
    # every planned kill fired (and its rank came back): a plan whose fault never happened
    # would pass without testing recovery at all
    missed = [kill for kill in kills if kill.killed_at_step < 0 or kill.incarnation == 0]
    assert not missed, f"planned kills that never fired: {missed}"
    return job


# -- links reset between live ranks, a checkpoint source lost ---------------------------------


@dataclasses.dataclass
class Reset:
    a: int
    b: int
    at: tuple[int, int]  # when rank ``a`` is in this call ...
    after_bytes: int  # ... and has received this many payload bytes of it
    done: bool = False


class ResetJob(Job):
    def __init__(self, *args: object, resets: list[Reset], **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.resets = resets

    def _faults(self) -> None:
        super()._faults()
        for reset in self.resets:
            flight = self.inflight.get(reset.a)
            if reset.done or flight is None or (flight[0], flight[1]) != reset.at:
                continue
            if reset.b in self.net.dead:
                continue  # (a link to a dead rank is down already: nothing to reset)
            got = self.net.agents[reset.a].statistics().bytes_received - flight[3]
            if got >= reset.after_bytes or reset.a in self.net.done:
                self.net.reset(reset.a, reset.b)
                reset.done = True


class SourceKillJob(Job):
    """Kills the neighbour a restarted rank is fetching its checkpoint from, mid-fetch."""

    def __init__(self, *args: object, restart_source_after: int, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.source: int | None = None
        self.source_killed_at = -1
        self.restart_source_after = restart_source_after

    def _faults(self) -> None:
        super()._faults()
        victim = self.kills[0].rank
        agent = self.net.agents[victim]
        if self.source is None and self.loading.get(victim) == "checkpoint":
            fetches = [f for f in agent.recovery.fetches.requests.values()
                       if f.what == "checkpoint"]
            if fetches:
                self.source = fetches[0].peer
                self.net.kill(self.source)
                self.inflight.pop(self.source, None)
                self.holders.pop(self.source, None)
                self.source_killed_at = self.steps
        elif (self.source is not None and self.source in self.net.dead
              and self.steps - self.source_killed_at >= self.restart_source_after):
            self.net.restart(self.source, self.net.agents[self.source].incarnation + 1)
            self.loading[self.source] = "states"


# -- random plans -----------------------------------------------------------------------------

SOAK_SPECS = [Spec("allreduce", n) for n in (1, 7, 100, 999, 1500, 5000, 12_000)]
# documented limits (docs/recovery.md): a result dropped two checkpoints ago, or a neighbour
# lost while a restarted rank still replays or is in the call it resumed
RETENTION_LIMIT = r"no longer retains|retains its result any more"


def random_program(rng: np.random.Generator, world: int) -> list[list[Spec]]:
    """1-3 iterations of 1-3 random calls (every kind, sizes from 1 element up)."""
    program: list[list[Spec]] = []
    for _ in range(int(rng.integers(1, 4))):
        calls = []
        for _ in range(int(rng.integers(1, 4))):
            kind = str(rng.choice(["allreduce", "allreduce", "broadcast", "object", "allgather"]))
            if kind == "allreduce":
                calls.append(SOAK_SPECS[int(rng.integers(0, len(SOAK_SPECS)))])
            elif kind == "allgather":
                calls.append(Spec("allgather", int(rng.choice([1, 50, 2000]))))
            else:
                calls.append(Spec(kind, int(rng.choice([1, 300, 3000, 20_000])),
                                  root=int(rng.integers(0, world))))
        program.append(calls)
    return program


def random_plan(seed: int) -> tuple[ResetJob, bool]:
    """A random world, program and fault plan (1-2 kills or resets at random calls and byte
    offsets); also whether two of its kills hit the same or neighbouring ranks."""
    rng = np.random.default_rng([7919, seed])
    world = int(rng.integers(2, 9))
    program = random_program(rng, world)
    points = [(i, j) for i, calls in enumerate(program) for j in range(len(calls))]
    kills: list[Kill] = []
    resets: list[Reset] = []
    for _ in range(int(rng.integers(1, 3))):
        at = points[int(rng.integers(0, len(points)))]
        rank = int(rng.integers(0, world))
        if rng.random() < 0.7:
            kills.append(Kill(rank, at, int(rng.integers(0, 40_000)),
                              restart_after=int(rng.integers(1, 6000))))
        else:
            peer = int(rng.choice(topology(rank, world).neighbors))
            resets.append(Reset(rank, peer, at, int(rng.integers(0, 40_000))))
    victims = [k.rank for k in kills]
    close = len(set(victims)) < len(victims) or any(
        b in topology(a, world).neighbors for a in victims for b in victims if a != b)
    job = ResetJob(world, program, seed=seed, kills=kills, resets=resets,
                   max_piece=int(rng.integers(64, 6000)),
                   **{**KW, "tree_chunk": int(rng.choice([64, 256, 4096]))})
    return job, close


# what two neighbours lost together may still end in (docs/recovery.md, "Two neighbours
# lost together"): survivors that no longer hold the partial sums their resume needs, result
# bytes only the other restarted rank held, a source lost while serving, the retention limit
ADJACENT_LIMITS = (r"cannot make those bytes any more|restarted too|lost while serving it|"
                    r"retains no result|" + RETENTION_LIMIT)


def run_random_plan(seed: int) -> None:
    job, close = random_plan(seed)
    try:
        job.run()
    except UnrecoverableError as exc:
        # a typed error is right only where docs/recovery.md says recovery is impossible
        ahead = re.search(r"holds checkpoint version (\d+)", str(exc))
        if ahead is not None:
            # a neighbour ran two checkpoints past the lost rank's version through
            # broadcasts that avoid it ("Versions"): it no longer holds that version
            needed = int(ahead[1])
            assert any(agent.version >= needed + GENERATIONS
                       for agent in job.net.agents.values()), (seed, str(exc))
            return
        assert re.search(ADJACENT_LIMITS if close else RETENTION_LIMIT, str(exc)), (
            seed, str(exc))
        return
    job.check()


def random_adjacent_plan(seed: int) -> ResetJob:
    """A random world (3-8), program and pair of neighbours killed in the same call (or,
    in 40 % of plans, in two random calls), at random byte offsets and restart delays."""
    rng = np.random.default_rng([104729, seed])
    world = int(rng.integers(3, 9))
    program = random_program(rng, world)
    points = [(i, j) for i, calls in enumerate(program) for j in range(len(calls))]
    a = int(rng.integers(0, world))
    b = int(rng.choice(topology(a, world).neighbors))
    at = points[int(rng.integers(0, len(points)))]
    at2 = at if rng.random() < 0.6 else points[int(rng.integers(0, len(points)))]
    kills = [Kill(a, at, int(rng.integers(0, 40_000)), restart_after=int(rng.integers(1, 6000))),
             Kill(b, at2, int(rng.integers(0, 40_000)), restart_after=int(rng.integers(1, 6000)))]
    return kill_job(rng, world, program, seed, kills)


def kill_job(rng: np.random.Generator, world: int, program: list[list[Spec]], seed: int,
              kills: list[Kill]) -> ResetJob:
    """A fault plan's job: the kills, random delivery piece sizes and tree chunk."""
    return ResetJob(world, program, seed=seed, kills=kills, resets=[],
                    max_piece=int(rng.integers(64, 6000)),
                    **{**KW, "tree_chunk": int(rng.choice([64, 256, 4096]))})


def recovers(job: Job, limits: str, seed: int) -> bool:
    """Run a fault plan: True if it recovered bit for bit, False if it ended in one of the
    documented typed errors matching ``limits`` (anything else, a wrong result included,
    fails the test)."""
    try:
        job.run()
    except UnrecoverableError as exc:
        assert re.search(limits, str(exc)), (seed, str(exc))
        return False
    job.check()
    return True


def run_adjacent_plan(seed: int) -> bool:
    return recovers(random_adjacent_plan(seed), ADJACENT_LIMITS, seed)


# three or four ranks lost, each a neighbour of one lost before it (a host running several
# consecutive ranks goes down)
CHAIN_LIMITS = ADJACENT_LIMITS + r"|holds only that call's result"


def random_chain_plan(seed: int, k: int) -> ResetJob:
    """A random world (k+1 to 9) and program; ``k`` ranks killed, each a neighbour of one
    killed before it, in the same call (or, each with 40 % chance, in another random call),
    at random byte offsets and restart delays."""
    rng = np.random.default_rng([7919, seed])
    world = int(rng.integers(k + 1, 10))
    program = random_program(rng, world)
    points = [(i, j) for i, calls in enumerate(program) for j in range(len(calls))]
    chain = [int(rng.integers(0, world))]
    while len(chain) < k:
        near = {n for r in chain for n in topology(r, world).neighbors} - set(chain)
        chain.append(int(rng.choice(sorted(near))))
    at = points[int(rng.integers(0, len(points)))]
    kills = []
    for rank in chain:
        when = at if rng.random() < 0.6 else points[int(rng.integers(0, len(points)))]
        kills.append(Kill(rank, when, int(rng.integers(0, 40_000)),
                          restart_after=int(rng.integers(1, 6000))))
    return kill_job(rng, world, program, seed, kills)


def run_chain_plan(seed: int, k: int) -> bool:
    return recovers(random_chain_plan(seed, k), CHAIN_LIMITS, seed)


# -- damaged bytes ----------------------------------------------------------------------------


@dataclasses.dataclass
class Corrupt:
    at_step: int  # from this network step on, the first link with bytes queued ...
    byte: int  # ... has this byte (modulo what is queued) damaged
    link: tuple[int, int] | None = None  # (src, dst), once done


class CorruptJob(Job):
    def __init__(self, *args: object, corruptions: list[Corrupt], **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.corruptions = corruptions

    def _faults(self) -> None:
        super()._faults()
        for c in self.corruptions:
            if c.link is None and self.steps >= c.at_step:
                links = sorted(self.net.queues)
                start = c.byte % len(links)
                for src, dst in links[start:] + links[:start]:
                    if self.net.corrupt(src, dst, c.byte):
                        c.link = (src, dst)
                        break


def corrupt_job(world: int, seed: int, count: int = 1, **kw: object) -> CorruptJob:
    rng = np.random.default_rng([world, seed, 77])
    corruptions = [Corrupt(int(rng.integers(0, 60 * world)), int(rng.integers(0, 1 << 30)))
                   for _ in range(count)]
    return CorruptJob(world, PROGRAM, seed=seed, corruptions=corruptions, **{**KW, **kw})
