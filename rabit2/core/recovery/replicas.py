"""Local models handed along the ring (``docs/recovery.md``, "What every rank keeps",
local checkpoints).

A rank's local model of each version goes to the next ``local_replica`` ranks of the ring
(and, from 2 on, to the previous one too), so that both ring neighbours of a lost rank hold
it and either can serve its replacement.  The hand-over is not waited for: a rank that dies
before its replica arrived resumes one version earlier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rabit2.core.framing import MAX_BROADCAST
from rabit2.core.records import Command, Fetch
from rabit2.core.recovery.port import AgentPort, send_blob
from rabit2.core.recovery.store import GENERATIONS
from rabit2.errors import ProtocolError


class LocalReplicas:
    """The local models this rank holds: its own and those handed on to it."""

    def __init__(self, agent: AgentPort, copies: int) -> None:
        self.agent = agent
        self.copies = copies  # ``rabit2_local_replica``
        self.models: dict[tuple[int, int], bytes] = {}  # (owner rank, version) -> blob

    def push(self, local: bytes, cmds: list[Command]) -> None:
        """Keep this rank's local model of the current version and hand it on."""
        agent = self.agent
        self.keep(agent.rank, agent.version, local)
        for peer, hops in self.targets():
            if agent.links[peer].up:
                self.send(peer, agent.rank, agent.version, hops, local, cmds)

    def targets(self) -> list[tuple[int, int]]:
        """Where this rank's local model goes first, and how far on from there: the next
        rank of the ring (it passes it on along the ring while ``hops`` > 1) and, from
        ``local_replica`` 2 on, the previous one - so that both ring neighbours of a lost
        rank hold its local model, and either can serve its replacement."""
        k, rank, world = self.copies, self.agent.rank, self.agent.world
        if world == 1 or k < 1:
            return []
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        if k == 1 or prev == nxt:
            return [(nxt, k)]
        return [(nxt, k - 1), (prev, 1)]

    def keep(self, owner: int, version: int, blob: bytes) -> None:
        self.models[(owner, version)] = blob
        for key in [k for k in self.models if k[0] == owner and k[1] <= version - GENERATIONS]:
            del self.models[key]

    def get(self, owner: int, version: int) -> bytes | None:
        return self.models.get((owner, version))

    def versions_of(self, owner: int) -> tuple[int, ...]:
        """The versions of ``owner``'s local model held here (said in this rank's state)."""
        return tuple(sorted(v for o, v in self.models if o == owner))

    def own(self) -> Iterator[tuple[int, bytes]]:
        """This rank's own local models, oldest version first."""
        for (owner, version), blob in sorted(self.models.items()):
            if owner == self.agent.rank:
                yield version, blob

    def send(self, peer: int, owner: int, version: int, hops: int, blob: bytes,
             cmds: list[Command]) -> None:
        self.agent.send_control(peer, {"t": "local", "owner": owner, "version": version,
                                       "hops": hops, "size": len(blob)}, cmds)
        if blob:
            send_blob(self.agent, peer, (version, 0), blob, cmds)

    def resend_own(self, peer: int, cmds: list[Command]) -> None:
        """A ring neighbour came back without the replicas of this rank's local model."""
        hops = dict(self.targets()).get(peer)
        if hops is not None:
            for version, blob in self.own():
                self.send(peer, self.agent.rank, version, hops, blob, cmds)

    def announced(self, peer: int, msg: dict[str, Any]) -> Fetch:
        """A ``local`` message: the model that its BLOB frame brings, as an unasked fetch."""
        size, owner, version, hops = msg["size"], msg["owner"], msg["version"], msg["hops"]
        if not (0 <= size <= MAX_BROADCAST and 0 <= owner < self.agent.world and version >= 0
                and hops >= 1):
            raise ProtocolError(f"rank {peer} hands on a malformed local model")
        return Fetch(0, peer, "replica", (version, owner), True, memoryview(bytearray(size)),
                     hops)

    def stored(self, fetch: Fetch, cmds: list[Command]) -> None:
        """A local model handed on along the ring arrived: keep it and pass it on."""
        assert fetch.dest is not None
        version, owner = fetch.call
        blob = bytes(fetch.dest)
        self.keep(owner, version, blob)
        agent = self.agent
        nxt = (agent.rank + 1) % agent.world
        if fetch.hops > 1 and nxt != owner and agent.links[nxt].up:
            self.send(nxt, owner, version, fetch.hops - 1, blob, cmds)
