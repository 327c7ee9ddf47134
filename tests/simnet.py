"""A seeded in-memory network that runs many :class:`rabit2.core.agent.Agent` s in one process.

Every directed link is a byte queue.  Each step picks a random link with queued bytes and
delivers a random-sized piece into the receiver's :meth:`Agent.recv_buffer`, so frames are
split at arbitrary points, exactly as TCP may split them.  Paused links are not delivered
until resumed.  Used by the schedule and agent tests; fault plans (kill a rank at a byte
count) are expressed as ``cut`` callbacks.
"""

from __future__ import annotations

import random
from collections.abc import Callable

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
        self.now = 0.0
        self.bytes_on_link: dict[tuple[int, int], int] = {}
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
                self.done[rank] = cmd.call_id
            elif isinstance(cmd, CallFailed):
                self.failed[rank] = cmd.error
            elif isinstance(cmd, CloseLink):
                self.closed.add((rank, cmd.peer))
                self.closed.add((cmd.peer, rank))

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
        ready = [
            (src, dst)
            for (src, dst), q in self.queues.items()
            if q and (dst, src) not in self.paused and (src, dst) not in self.closed
        ]
        if not ready:
            return False
        src, dst = self.rng.choice(ready)
        q = self.queues[(src, dst)]
        agent = self.agents[dst]
        target = agent.recv_buffer(src)
        n = min(len(q), len(target), self.rng.randint(1, self.max_piece))
        target[:n] = q[:n]
        del q[:n]
        self.now += 1e-6
        self.execute(dst, agent.on_bytes(src, n, self.now))
        return True

    def run(self, calls: dict[int, Call], max_steps: int = 10_000_000,
            cut: Callable[[SimNet], None] | None = None) -> None:
        self.begin(calls)
        for _ in range(max_steps):
            if cut is not None:
                cut(self)
            if not self.step():
                return
        raise AssertionError("simulation did not quiesce")
