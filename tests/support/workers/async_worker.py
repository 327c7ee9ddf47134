"""Integration worker for the asyncio API: collectives awaited from a running loop.

With ``raise`` as its first argument, rank 1 raises ``ValueError`` inside the ``async with``
block instead, and every other rank reports the error its next collective raises."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
import time

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


async def interrupted_in_block() -> None:
    """Rank 1 gets Ctrl-C (SIGINT) inside the block; every other rank reports the error its
    next collective raises."""
    async with rabit2.aio.Communicator() as comm:
        rank = comm.rank
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)  # (asyncio.run cancels this task)
            await asyncio.sleep(30)
        try:
            await comm.allreduce(np.ones(4), rabit2.Op.SUM)
        except rabit2.RabitError as exc:
            print(f"ASYNC INTERRUPTED rank={rank} {type(exc).__name__}: {exc}", flush=True)
            raise


async def cancel_while_queued() -> None:
    """Rank 0 issues two calls, and cancels its wait for the second while the first waits
    for rank 1: the second still runs, in its place, and so does the third after it."""
    async with rabit2.aio.Communicator() as comm:
        rank = comm.rank
        a, b, c = (np.full(3, value * (rank + 1), dtype=np.float64) for value in (1, 10, 100))
        if rank == 0:
            first = asyncio.create_task(comm.allreduce(a, rabit2.Op.SUM))
            second = asyncio.create_task(comm.allreduce(b, rabit2.Op.SUM))
            await asyncio.sleep(0.2)
            second.cancel()
            await first
            await comm.allreduce(c, rabit2.Op.SUM)
        else:
            await asyncio.sleep(1.0)
            for arr in (a, b, c):
                await comm.allreduce(arr, rabit2.Op.SUM)
        print(f"ASYNC CANCEL rank={rank} a={a[0]:g} b={b[0]:g} c={c[0]:g}", flush=True)


async def leave_after_timeout() -> None:
    """Rank 0's wait times out and the TimeoutError leaves the block while its call still
    runs (rank 1 is busy): rank 0 leaves at once, and rank 1's call raises the abort."""
    start = time.monotonic()
    rank = -1
    try:
        async with rabit2.aio.Communicator() as comm:
            rank = comm.rank
            if rank == 0:
                await asyncio.wait_for(comm.allreduce(np.ones(4), rabit2.Op.SUM), 0.5)
            else:
                await asyncio.sleep(3.0)
                await comm.allreduce(np.ones(4), rabit2.Op.SUM)
    except (TimeoutError, rabit2.RabitError) as exc:
        print(f"ASYNC LEFT rank={rank} after={time.monotonic() - start:.1f} "
              f"{type(exc).__name__}: {exc}", flush=True)


async def exit_zero_in_block() -> None:
    """Rank 0 calls ``sys.exit(0)`` inside the block: a normal end, as in
    ``CommunicatorContext``; the job ends well."""
    async with rabit2.aio.Communicator() as comm:
        await comm.allreduce(np.ones(2), rabit2.Op.SUM)
        if comm.rank == 0:
            sys.exit(0)
        await asyncio.sleep(0.5)
    print("ASYNC EXIT0 rank=1 left", flush=True)


async def context_inside_block() -> None:
    """Library code opens ``rabit2.CommunicatorContext`` inside the block: it neither joins
    nor leaves, and the block's next call runs in the same job."""
    async with rabit2.aio.Communicator() as comm:
        def library() -> float:
            with rabit2.CommunicatorContext():
                return float(rabit2.allreduce(np.ones(2), rabit2.Op.SUM)[0])

        inner = await asyncio.to_thread(library)
        after = (await comm.allreduce(np.ones(2), rabit2.Op.SUM))[0]
        print(f"ASYNC NESTED rank={comm.rank} inner={inner:g} after={after:g}", flush=True)


async def failure_after_a_cancelled_wait() -> None:
    """Rank 0 gives up waiting for a call (rank 1 is late), and rank 1 is then killed: the
    call fails with nobody awaiting it, and leaving the block raises that error, not
    nothing."""
    rank = -1
    try:
        async with rabit2.aio.Communicator() as comm:
            rank = comm.rank
            if rank == 1:
                await asyncio.sleep(1.0)
                os.kill(os.getpid(), 9)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(comm.allreduce(np.ones(2), rabit2.Op.SUM), 0.3)
            await asyncio.sleep(3.0)
        print(f"ASYNC UNSEEN rank={rank} left without an error", flush=True)
    except rabit2.RabitError as exc:
        print(f"ASYNC UNSEEN rank={rank} {type(exc).__name__}: {exc}", flush=True)


async def leave_with_a_busy_executor() -> None:
    """The loop's default executor is busy (one thread, sleeping) when an exception leaves
    rank 0's block: the job still ends at once, not once the executor is free."""
    start = time.monotonic()
    rank = -1
    try:
        async with rabit2.aio.Communicator() as comm:
            rank = comm.rank
            if rank == 0:
                loop = asyncio.get_running_loop()
                loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
                loop.run_in_executor(None, time.sleep, 8)
                raise ValueError("bad input on rank 0")
            await comm.allreduce(np.ones(2), rabit2.Op.SUM)
    except (ValueError, rabit2.RabitError) as exc:
        print(f"ASYNC BUSY rank={rank} after={time.monotonic() - start:.1f} "
              f"{type(exc).__name__}: {exc}", flush=True)


async def exit_after_a_cancelled_wait() -> None:
    """Rank 0 gives up a wait (rank 1 is late) and exits with status 2 while the call runs:
    the process ends at once, not at the call's deadline."""
    comm = rabit2.aio.Communicator()
    await comm.init()
    if comm.rank == 1:
        await asyncio.sleep(30)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(comm.allreduce(np.ones(2), rabit2.Op.SUM), 0.5)
    print(f"ASYNC EXITING rank={comm.rank}", flush=True)
    sys.exit(2)


def from_two_threads() -> None:
    """One communicator, two threads, each with an event loop of its own."""
    comm = rabit2.aio.Communicator()
    asyncio.run(comm.init())
    results: list[float] = []

    async def calls() -> None:
        for _ in range(200):
            results.append(float((await comm.allreduce(np.ones(3), rabit2.Op.SUM))[0]))

    threads = [threading.Thread(target=asyncio.run, args=(calls(),)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    rank = comm.rank
    asyncio.run(comm.finalize())
    print(f"ASYNC THREADS rank={rank} calls={len(results)} "
          f"all2={all(r == 2 for r in results)}", flush=True)


async def main() -> None:
    if sys.argv[1:] == ["raise"]:
        await fail_in_block()
        return
    if sys.argv[1:] == ["cancel"]:
        await cancel_while_queued()
        return
    if sys.argv[1:] == ["timeout"]:
        await leave_after_timeout()
        return
    modes = {"exit0": exit_zero_in_block, "nested": context_inside_block,
             "unseen": failure_after_a_cancelled_wait, "busy": leave_with_a_busy_executor,
             "exit2": exit_after_a_cancelled_wait, "interrupt": interrupted_in_block}
    if sys.argv[1:2] and sys.argv[1] in modes:
        await modes[sys.argv[1]]()
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


if sys.argv[1:] == ["threads"]:
    from_two_threads()
else:
    asyncio.run(main())
