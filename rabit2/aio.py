"""The asyncio API, for programs that already run an event loop.

``await comm.allreduce(arr, op)`` runs the collective without blocking the caller's loop:
the blocking call runs in a worker thread and the loop stays free for other tasks.
Collectives are ordered: concurrent awaits on one communicator run one after another, in
the order they were awaited, because every rank must issue the same sequence of calls.

    async with rabit2.aio.Communicator() as comm:      # init() ... finalize()
        await comm.allreduce(hist, rabit2.Op.SUM)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from rabit2 import api

T = TypeVar("T")


class Communicator:
    """Async wrapper of the process-wide communicator (there is one per process, as in rabit).

    Constructing it does not join the job: ``async with`` (or :meth:`init`) does.  Errors are
    those of the blocking API, raised from the ``await``.
    """

    def __init__(self, args: Iterable[str | bytes] | None = None, **kwargs: Any) -> None:
        self._args = list(args) if args is not None else None
        self._kwargs = kwargs
        self._lock = asyncio.Lock()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._lock:
            return await asyncio.to_thread(fn, *args)

    async def init(self) -> None:
        await self._run(lambda: api.init(self._args, **self._kwargs))

    async def finalize(self) -> None:
        await self._run(api.finalize)

    async def __aenter__(self) -> Communicator:
        await self.init()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.finalize()

    @property
    def rank(self) -> int:
        return api.get_rank()

    @property
    def world_size(self) -> int:
        return api.get_world_size()

    async def allreduce(self, data: Any, op: Any,
                        prepare_fun: Callable[[Any], None] | None = None) -> Any:
        return await self._run(api.allreduce, data, op, prepare_fun)

    async def broadcast(self, obj: Any, root: int) -> Any:
        return await self._run(api.broadcast, obj, root)

    async def allgather(self, data: Any) -> Any:
        return await self._run(api.allgather, data)

    async def agree(self, flag: bool) -> bool:
        return await self._run(api.agree, flag)

    async def checkpoint(self, global_model: Any, local_model: Any = None) -> None:
        await self._run(api.checkpoint, global_model, local_model)

    async def load_checkpoint(self, with_local: bool = False) -> tuple[Any, ...]:
        return await self._run(api.load_checkpoint, with_local)

    def tracker_print(self, msg: Any) -> None:
        api.tracker_print(msg)
