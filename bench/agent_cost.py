"""CPU time of the sans-I/O agent alone per call: two agents in one process exchange a
float32 SUM allreduce at world size 2 (the pair exchange) through in-memory byte queues, no
sockets and no threads.  What a small call costs before any I/O; compare with
``socket_floor.py`` (the same exchange written directly on sockets).

    python bench/agent_cost.py [--size 4096] [--calls 5000] [--recover on|off] [--express]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rabit2.core.agent import Agent, Call, CallComplete, Command, Send
from rabit2.core.framing import CollectiveKind
from rabit2.core.ops import Op


class Pair:
    def __init__(self, recover: bool) -> None:
        self.agents = []
        for rank in range(2):
            agent = Agent(recover=recover)
            agent.start()
            agent.connect_tracker(rank, 2)
            agent.connect_peers()
            agent.accept_peers(0.0)
            self.agents.append(agent)
        self.queued: list[list[bytes]] = [[], []]
        for rank in range(2):
            self.run(rank, self.agents[rank].on_link_up(1 - rank, 0, 0.0))
        self.deliver(0, 1)
        self.deliver(1, 0)

    def run(self, rank: int, cmds: list[Command]) -> bool:
        done = False
        for cmd in cmds:
            if isinstance(cmd, Send):
                self.queued[rank].append(b"".join(bytes(b) for b in cmd.buffers))
            elif isinstance(cmd, CallComplete):
                if cmd.finish is not None:
                    cmd.finish()
                done = True
        return done

    def deliver(self, src: int, dst: int) -> bool:
        data = b"".join(self.queued[src])
        self.queued[src].clear()
        done, pos, agent = False, 0, self.agents[dst]
        while pos < len(data):
            buf = agent.recv_buffer(src)
            n = min(len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            done |= self.run(dst, agent.on_bytes(src, n, 0.0))
        return done

    def allreduce(self, bufs: list[np.ndarray]) -> None:
        done = [False, False]
        for rank in range(2):
            call = Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[rank]).cast("B"),
                        bufs[rank].dtype, Op.SUM)
            done[rank] = self.run(rank, self.agents[rank].begin(call, 0.0))
        while not all(done):
            done[1] |= self.deliver(0, 1)
            done[0] |= self.deliver(1, 0)

    def express(self, bufs: list[np.ndarray]) -> None:
        """The same call made express (``rabit2.core.express``): each rank's frame is copied
        into the other's inbox, as the I/O layer reads it."""
        xcs = []
        for rank in range(2):
            call = Call(CollectiveKind.ALLREDUCE_PAIR, memoryview(bufs[rank]).cast("B"),
                        bufs[rank].dtype, Op.SUM)
            xc = self.agents[rank].express.prepare(call)
            assert xc is not None
            xcs.append(xc)
        for rank in range(2):
            mine, theirs = xcs[rank], xcs[1 - rank]
            theirs.inbox[:] = b"".join(mine.parts())
        for rank in range(2):
            xc = xcs[rank]
            assert xc.check_headers(len(xc.inbox)) and self.agents[rank].express.done(xc, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="bytes per call")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--recover", choices=("on", "off"), default="on")
    parser.add_argument("--express", action="store_true",
                        help="make the calls express (docs/design.md, \"Express calls\")")
    args = parser.parse_args()
    pair = Pair(args.recover == "on")
    bufs = [np.zeros(args.size // 4, np.float32) for _ in range(2)]
    call = pair.express if args.express else pair.allreduce
    for _ in range(200):
        call(bufs)
    start = time.process_time()
    for _ in range(args.calls):
        call(bufs)
    per_call = (time.process_time() - start) / args.calls / 2
    how = "express" if args.express else "general path"
    print(f"agent CPU per rank per call, {args.size} B, recovery {args.recover}, {how}: "
          f"{per_call * 1e6:.1f} us (harness included)")


if __name__ == "__main__":
    main()
