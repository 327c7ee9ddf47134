"""What the trainer needs of the collective: ``allreduce``'s signature, the reduction
operators, and a wrapper that times the calls and can trace each one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TextIO

from numpy.typing import NDArray


class AllreduceFn(Protocol):
    """``rabit2.allreduce``'s signature: reduce ``data`` across ranks, return the result."""

    def __call__(
        self,
        data: NDArray[Any],
        op: Any,
        prepare_fun: Callable[[NDArray[Any]], None] | None = None,
    ) -> NDArray[Any]: ...


class Ops(NamedTuple):
    """The reduction operators handed to ``allreduce`` (``rabit2.Op`` members in real runs).

    Injected together with ``allreduce`` so that tests can simulate the collective.
    """

    sum: Any
    min: Any
    max: Any


class TimedAllreduce:
    """Wraps an allreduce and accumulates wall time spent inside it.

    Time spent in ``prepare_fun`` (the lazily-built histograms) is subtracted: it is compute,
    not communication, and ``allreduce_s`` is what benchmarks compare across implementations.
    """

    def __init__(self, inner: AllreduceFn, trace: TextIO | None = None) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        self.trace = trace

    def __call__(
        self,
        data: NDArray[Any],
        op: Any,
        prepare_fun: Callable[[NDArray[Any]], None] | None = None,
    ) -> NDArray[Any]:
        prep_s = 0.0
        ready = 0.0  # when this rank's input was ready (perf_counter: one clock per host)
        wrapped: Callable[[NDArray[Any]], None] | None = None
        if prepare_fun is not None:
            fun = prepare_fun

            def wrapped(buf: NDArray[Any]) -> None:
                nonlocal prep_s, ready
                t = time.perf_counter()
                fun(buf)
                ready = time.perf_counter()
                prep_s += ready - t

        t0 = time.perf_counter()
        out = self.inner(data, op, wrapped)
        t1 = time.perf_counter()
        seconds = t1 - t0 - prep_s
        self.seconds += seconds
        if self.trace is not None:
            self.trace.write(json.dumps({"call": self.calls, "bytes": data.nbytes,
                                         "s": seconds, "prepare_s": prep_s,
                                         "ready": ready or t0, "done": t1}) + "\n")
        self.calls += 1
        self.bytes += data.nbytes
        return out
