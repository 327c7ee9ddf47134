"""Integration worker for the asyncio API: collectives awaited from a running loop.

With ``raise`` as its first argument, rank 1 raises ``ValueError`` inside the ``async with``
block instead, and every other rank reports the error its next collective raises."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import rabit2


async def fail_in_block() -> None:
    rank = -1  # (the abort can reach a worker still wiring its links, before it has a rank)
    try:
        async with rabit2.aio.Communicator() as comm:
            rank = comm.rank
            if rank == 1:
                raise ValueError("bad input on rank 1")
            await comm.allreduce(np.ones(4), rabit2.Op.SUM)
    except rabit2.RabitError as exc:
        task = os.environ.get("DMLC_TASK_ID")
        print(f"ASYNC ABORTED task={task} rank={rank} {type(exc).__name__}: {exc}", flush=True)


async def main() -> None:
    if sys.argv[1:] == ["raise"]:
        await fail_in_block()
        return
    async with rabit2.aio.Communicator(sys.argv[1:]) as comm:
        rank, world = comm.rank, comm.world_size
        ticks = 0

        async def ticker() -> None:  # the caller's loop keeps running during collectives
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        a = np.full(200_000, rank + 1, dtype=np.int64)
        results = await asyncio.gather(comm.allreduce(a, rabit2.Op.SUM),
                                       comm.broadcast({"from": 0} if rank == 0 else None, 0))
        assert (results[0] == world * (world + 1) // 2).all()
        assert results[1] == {"from": 0}
        assert await comm.agree(True)
        task.cancel()
        assert ticks > 0
        print(f"ASYNC OK rank={rank}", flush=True)


asyncio.run(main())
