"""Control-plane scale and per-link traffic at large world sizes.

1. Rendezvous: one tracker and W lightweight simulated workers (each a real
   ``TrackerClient``: TCP connection, HMAC handshake, register, assignment, shutdown) in one
   process, for W in 64, 256, 1024 by default.  Reports wall time from the first connect to
   the last assignment and to the tracker's "job done", plus the tracker's peak memory
   growth (tracemalloc), so that growth with W can be read off the table.
2. Bytes per link: the in-process simulation (``tests/sim/simnet.py``) runs one tree and one
   ring allreduce at world sizes up to 1024 and checks every directed link's payload
   against the formulas of ``docs/algorithms.md``.

Run: ``python bench/scale.py [--worlds 64,256,1024] [--sim-worlds 16,128,1024]``.
Needs ``ulimit -n`` above 2 W + 100 (the script raises its soft limit when it can).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from rabit2.config import Config
from rabit2.core.agent import Call
from rabit2.core.framing import HEADER_SIZE, CollectiveKind
from rabit2.core.ops import Op
from rabit2.core.schedule import ring_segments
from rabit2.core.topology import topology
from rabit2.io.tracker_client import TrackerClient
from tracker.server import Tracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests package
from tests.sim.simnet import SimNet


async def rendezvous(world: int) -> dict[str, float]:
    secret = b"s" * 32
    tracker = Tracker(world, "127.0.0.1", 0, secret=secret, heartbeat_timeout=120.0)
    await tracker.start()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()

    async def worker(task: int) -> TrackerClient:
        cfg = Config(tracker_uri="127.0.0.1", tracker_port=tracker.port, task_id=str(task),
                     secret=secret, connect_timeout_sec=60.0, heartbeat_sec=30.0)
        client = await TrackerClient.connect(cfg, 10_000 + task)
        assignment = await client.wait_assignment(120.0)
        assert assignment.world_size == world
        return client

    clients = await asyncio.gather(*(worker(t) for t in range(world)))
    assigned = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    await asyncio.gather(*(c.shutdown(60.0) for c in clients))
    result = await tracker.wait_done(60.0)
    done = time.perf_counter() - t0
    tracemalloc.stop()
    await tracker.close()
    assert result.success, result
    return {"world": world, "assigned_s": assigned, "done_s": done,
            "peak_mib": (peak - base) / 2**20}


def link_bytes(world: int, count: int = 4096) -> tuple[int, int]:
    """Run tree and ring allreduce over the simulation; return (links checked, violations)."""
    nbytes = count * 8
    checked = bad = 0
    for kind in (CollectiveKind.ALLREDUCE_TREE, CollectiveKind.ALLREDUCE_RING):
        net = SimNet(world, seed=world, max_piece=1 << 20)
        bufs = [np.full(count, r, dtype=np.float64) for r in range(world)]
        net.run({r: Call(kind, memoryview(bufs[r]).cast("B"), np.dtype(np.float64), Op.SUM)
                 for r in range(world)})
        assert not net.failed and len(net.done) == world
        segs = ring_segments(nbytes, 8, world)
        for (src, dst), sent in net.bytes_on_link.items():
            if kind is CollectiveKind.ALLREDUCE_TREE:
                expected = nbytes if dst in topology(src, world).tree_neighbors else 0
            elif dst == (src - 1) % world:
                lo, hi = segs[src]
                plo, phi = segs[(src - 1) % world]
                expected = 2 * nbytes - (hi - lo) - (phi - plo)
            else:
                expected = 0
            checked += 1
            overhead = sent - expected
            if overhead < 0 or overhead % HEADER_SIZE:
                bad += 1
        expect_sum = world * (world - 1) / 2
        assert all((b == expect_sum).all() for b in bufs)
    return checked, bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="64,256,1024")
    parser.add_argument("--sim-worlds", default="16,128,1024")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    print("| workers | all assigned (s) | job done (s) "
          "| peak Python memory, tracker + simulated workers (MiB) |")
    print("| --- | --- | --- | --- |")
    for world in (int(w) for w in args.worlds.split(",")):
        r = asyncio.run(rendezvous(world))
        print(f"| {world} | {r['assigned_s']:.2f} | {r['done_s']:.2f} | {r['peak_mib']:.1f} |",
              flush=True)
    print()
    print("| world | directed links checked | payload bytes off the formula |")
    print("| --- | --- | --- |")
    for world in (int(w) for w in args.sim_worlds.split(",")):
        checked, bad = link_bytes(world)
        print(f"| {world} | {checked} | {bad} |", flush=True)


if __name__ == "__main__":
    main()
