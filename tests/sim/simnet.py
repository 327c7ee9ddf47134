"""A seeded in-memory network that runs many :class:`rabit2.core.agent.Agent` s in one process.

Every directed link is a byte queue.  Each step picks a random link with queued bytes and
delivers a random-sized piece into the receiver's :meth:`Agent.recv_buffer`, so frames are
split at arbitrary points, exactly as TCP may split them.  Paused links are not delivered
until resumed.  Used by the schedule and agent tests; fault plans (kill a rank at a byte
count) are expressed as ``cut`` callbacks.  A byte damaged on a link (:meth:`SimNet.corrupt`)
reaches the receiver as it is; a live rank with recovery on that closes a link for it has
the link dialed again, as the I/O layer does.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from rabit2.core.agent import (
    Agent,
    Call,
    CallComplete,
    CallFailed,
    CheckpointLoaded,
    CloseLink,
    Command,
    PauseReading,
    ResumeReading,
    Send,
)


class SimNet:
    def __init__(self, world: int, seed: int = 0, max_piece: int = 1 << 16, **agent_kw: object):
        self.world = world
        self.rng = random.Random(seed)
        self.max_piece = max_piece
        self.agents: dict[int, Agent] = {}
        self.queues: dict[tuple[int, int], bytearray] = {}
        self.paused: set[tuple[int, int]] = set()  # (receiver, sender)
        self.closed: set[tuple[int, int]] = set()
        self.done: dict[int, tuple[int, int]] = {}
        self.failed: dict[int, Exception] = {}
        self.loaded: dict[int, tuple[int, bytes | None, bytes | None]] = {}
        self.dead: set[int] = set()
        self.agent_kw = agent_kw
        self.now = 0.0
        self.bytes_on_link: dict[tuple[int, int], int] = {}
        self.relinks: list[tuple[int, int]] = []  # links a live rank closed and redials
        self.slow: set[tuple[int, int]] = set()  # (src, dst): one byte per delivery
        for rank in range(world):
            agent = Agent(**agent_kw)  # type: ignore[arg-type]
            agent.start()
            agent.connect_tracker(rank, world)
            agent.connect_peers()
            agent.accept_peers(self.now)
            self.agents[rank] = agent
            for peer in agent.links:
                self.queues[(rank, peer)] = bytearray()
                self.bytes_on_link[(rank, peer)] = 0

    def execute(self, rank: int, cmds: list[Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, Send):
                if (rank, cmd.peer) in self.closed:
                    continue
                q = self.queues[(rank, cmd.peer)]
                for b in cmd.buffers:
                    q += bytes(b)  # the simulated kernel copies, like send(2)
                    self.bytes_on_link[(rank, cmd.peer)] += len(b)
            elif isinstance(cmd, PauseReading):
                self.paused.add((rank, cmd.peer))
            elif isinstance(cmd, ResumeReading):
                self.paused.discard((rank, cmd.peer))
            elif isinstance(cmd, CallComplete):
                if cmd.finish is not None:
                    cmd.finish()
                self.done[rank] = cmd.call_id
            elif isinstance(cmd, CallFailed):
                self.failed[rank] = cmd.error
            elif isinstance(cmd, CloseLink):
                self.closed.add((rank, cmd.peer))
                self.closed.add((cmd.peer, rank))
                agent = self.agents[rank]
                if agent.recovery is not None and agent.error is None:
                    self.relinks.append((rank, cmd.peer))  # (a reset, not a failure)
            elif isinstance(cmd, CheckpointLoaded):
                self.loaded[rank] = (cmd.version, cmd.blob, cmd.local)

    # -- faults: a rank dies (its links drop, in-flight bytes are cut) and comes back ----------

    def kill(self, rank: int) -> None:
        """SIGKILL: bytes to the victim are lost; of the bytes it had queued, a random
        prefix still arrives (the kernel may have sent some before the reset)."""
        self.dead.add(rank)
        self.done.pop(rank, None)
        for peer in self.agents[rank].links:
            del self.queues[(peer, rank)][:]
            q = self.queues[(rank, peer)]
            del q[self.rng.randint(0, len(q)) :]
        for peer in self.agents[rank].links:
            self.closed.add((rank, peer))
            if peer not in self.dead:
                self.execute(peer, self.agents[peer].on_hangup(rank, "killed", self.now))
                # (and the tracker tells the neighbours that the process died)
                self.execute(peer, self.agents[peer].on_peer_dead(rank, self.now))

    def reset(self, a: int, b: int) -> None:
        """The link between two live ranks breaks (a reset) and is dialed again at once."""
        for src, dst in ((a, b), (b, a)):
            q = self.queues[(src, dst)]
            del q[self.rng.randint(0, len(q)) :]  # part of what was in flight still arrives
        pending = {(a, b): bytes(self.queues[(a, b)]), (b, a): bytes(self.queues[(b, a)])}
        for src, dst in pending:
            del self.queues[(src, dst)][:]
        # deliver what arrived before the reset, then drop the connection
        for (src, dst), data in pending.items():
            pos = 0
            while pos < len(data) and (dst, src) not in self.paused and dst not in self.failed:
                target = self.agents[dst].recv_buffer(src)
                n = min(len(target), len(data) - pos)
                target[:n] = data[pos : pos + n]
                pos += n
                self.execute(dst, self.agents[dst].on_bytes(src, n, self.now))
        # what either side wrote while those last bytes arrived went to the dead connection
        for src, dst in pending:
            del self.queues[(src, dst)][:]
        self.paused.discard((a, b))
        self.paused.discard((b, a))
        self.execute(a, self.agents[a].on_hangup(b, "reset", self.now))
        self.execute(b, self.agents[b].on_hangup(a, "reset", self.now))
        self.execute(a, self.agents[a].on_link_up(b, self.agents[b].incarnation, self.now))
        self.execute(b, self.agents[b].on_link_up(a, self.agents[a].incarnation, self.now))

    def corrupt(self, src: int, dst: int, at: int) -> bool:
        """Damage byte ``at`` (modulo what is queued) of what ``src`` has queued for ``dst``,
        as a NIC, a switch or memory can without TCP noticing.  False if nothing is queued."""
        q = self.queues[(src, dst)]
        if not q or (src, dst) in self.closed:
            return False
        q[at % len(q)] ^= 0x5A
        return True

    def _relink(self, a: int, b: int) -> None:
        """``a`` closed its link to ``b`` (a corrupt frame): what was in flight on that
        connection is lost, ``b`` sees the reset, and the link is dialed again."""
        for src, dst in ((a, b), (b, a)):
            del self.queues[(src, dst)][:]
            self.paused.discard((src, dst))
        if a in self.dead or b in self.dead:
            return
        self.execute(b, self.agents[b].on_hangup(a, "reset by peer", self.now))
        self.closed.discard((a, b))
        self.closed.discard((b, a))
        self.execute(a, self.agents[a].on_link_up(b, self.agents[b].incarnation, self.now))
        self.execute(b, self.agents[b].on_link_up(a, self.agents[a].incarnation, self.now))

    def restart(self, rank: int, incarnation: int) -> Agent:
        """The launcher's restart: a fresh agent for ``rank``; links come up both ways."""
        # the victim's last bytes were either delivered or lost with the connection
        for peer in self.agents[rank].links:
            del self.queues[(rank, peer)][:]
        agent = Agent(**self.agent_kw)  # type: ignore[arg-type]
        agent.assigned(incarnation)
        agent.start()
        agent.connect_tracker(rank, self.world)
        agent.connect_peers()
        agent.accept_peers(self.now)
        self.agents[rank] = agent
        self.dead.discard(rank)
        self.failed.pop(rank, None)
        self.loaded.pop(rank, None)
        for peer in agent.links:
            if peer in self.dead:
                continue  # (dead too: the link comes up when that one is restarted)
            self.closed.discard((rank, peer))
            self.closed.discard((peer, rank))
            self.paused.discard((rank, peer))
            self.paused.discard((peer, rank))
            self.execute(peer, self.agents[peer].on_link_up(rank, incarnation, self.now))
            self.execute(rank, agent.on_link_up(peer, self.agents[peer].incarnation, self.now))
        return agent

    def begin(self, calls: dict[int, Call]) -> None:
        self.done.clear()
        order = list(calls)
        self.rng.shuffle(order)
        for rank in order:
            try:
                cmds = self.agents[rank].begin(calls[rank], self.now)
            except Exception as exc:
                self.failed[rank] = exc
                continue
            self.execute(rank, cmds)

    def step(self) -> bool:
        """Deliver one random piece; False when nothing can move."""
        while self.relinks:
            self._relink(*self.relinks.pop(0))
        ready = [
            (src, dst)
            for (src, dst), q in self.queues.items()
            if q and (dst, src) not in self.paused and (src, dst) not in self.closed
        ]
        if not ready:
            return False
        src, dst = self.rng.choice(ready)
        if dst in self.dead:
            del self.queues[(src, dst)][:]
            return True
        q = self.queues[(src, dst)]
        agent = self.agents[dst]
        target = agent.recv_buffer(src)
        n = min(len(q), len(target), self.rng.randint(1, self.max_piece))
        if (src, dst) in self.slow:
            n = 1
        target[:n] = q[:n]
        del q[:n]
        self.now += 1e-6
        self.execute(dst, agent.on_bytes(src, n, self.now))
        return True

    def tick(self) -> None:
        """The I/O layer's periodic deadline check, on every live rank."""
        for rank, agent in self.agents.items():
            if rank not in self.dead:
                self.execute(rank, agent.on_tick(self.now))

    def run(self, calls: dict[int, Call], max_steps: int = 10_000_000,
            cut: Callable[[SimNet], None] | None = None) -> None:
        self.begin(calls)
        for _ in range(max_steps):
            if cut is not None:
                cut(self)
            if not self.step():
                return
        raise AssertionError("simulation did not quiesce")
