"""``--cluster local``: a worker started on this machine, on its CPUs (``--bind``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

from tracker.launch.common import Attempt, build_worker_env
from tracker.launch.options import LaunchOptions

SHARED_CPU_RING_MIN_BYTES = 2 << 20
"""The tree/ring threshold for workers pinned beside others (world size 3 and more)."""


def local_attempt(options: LaunchOptions, job_env: Mapping[str, str], task_id: int,
                  attempt: int) -> Attempt:
    """Attempt ``attempt`` of task ``task_id``: the command itself, with the launcher's
    environment plus the job's, started on the task's CPUs."""
    cpus = bind_cpus_for(task_id, options.num_workers, options.bind)
    env = build_worker_env(os.environ, job_env, task_id, attempt, options.env, cpus,
                           recover=options.max_attempts > 1)
    env["RABIT2_LAUNCHER_PID"] = str(os.getpid())  # (the worker dies with this process)
    if shares_cpu(options.num_workers, options.bind):
        # pinned beside another worker, a caller that drives the general path of its call
        # holds the CPU the other needs: only express calls are made on the caller's thread,
        # the rest go to the loop thread (docs/design.md, "The caller drives its call")
        env.setdefault("RABIT2_DRIVE_GENERAL", "0")
        # and each of the ring's 2(n - 1) dependent steps waits for the next rank to get a
        # CPU: the tree, with fewer, is faster up to a few MiB (docs/performance.md, "Tree or
        # ring"); the same on every rank, as the launcher starts them all
        env.setdefault("RABIT2_RING_MIN_BYTES", str(SHARED_CPU_RING_MIN_BYTES))
    return Attempt(list(options.command), env, cpus=cpus)


def shares_cpu(num_workers: int, bind: str, cpus: Sequence[int] | None = None) -> bool:
    """Whether ``--bind`` pins some workers to a CPU another worker is pinned to (pure):
    more workers than the launcher's CPUs."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return bind != "none" and bool(cpus) and num_workers > len(cpus)


def bind_cpus_for(task_id: int, num_workers: int, bind: str,
                  cpus: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The CPUs task ``task_id`` is pinned to under ``--bind`` (None: not pinned; pure).

    ``core``: one CPU, round-robin.  ``auto``: the launcher's CPUs split into ``num_workers``
    equal contiguous groups (the rest unused), so that a worker's own thread pools (BLAS,
    OpenMP) get its share of the machine; one CPU each, round-robin, when there are more
    workers than CPUs.
    """
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if bind == "none" or not cpus:
        return None
    share = len(cpus) // num_workers if bind == "auto" else 0
    if share <= 1:
        return (cpus[task_id % len(cpus)],)
    return tuple(cpus[task_id * share : (task_id + 1) * share])


@contextlib.contextmanager
def pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """Start processes on ``cpus``: the calling thread (only it, on Linux) takes that CPU
    mask for the ``Popen``, which the child inherits from its first instruction, so that
    thread pools created at import time (OpenBLAS, OpenMP) are sized for it.  Pinning later,
    in ``rabit2.init``, left numpy's BLAS with a thread per CPU of the machine spinning on
    one CPU (a 4 KiB allreduce after a small matmul: 0.5-16 ms instead of ~0.05 ms)."""
    old = None
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            print(f"[rabit2-submit] cannot pin a worker to CPUs {list(cpus)}: {exc}",
                  file=sys.stderr)
    try:
        yield
    finally:
        if old is not None:
            os.sched_setaffinity(0, old)
