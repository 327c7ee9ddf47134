"""Worker program for the lazy-recovery integration tests
(tests/integration/test_recovery_integration.py).

Run under ``rabit2-submit``.  It runs ``--iters`` iterations; iteration ``it`` is checkpoint
version ``it`` and makes the calls named by ``--calls`` (seqno = position in the list):

* ``t``: tree allreduce SUM of ``--tree-count`` int64 elements
* ``r``: ring allreduce SUM of ``--ring-count`` float64 elements (multiples of 1/8 with small
  magnitude, so every partial sum is exact and the result does not depend on the order)
* ``s``: small allreduce MAX of 7 uint32 elements (a tree allreduce, or the pair exchange at
  world size 2)
* ``b``: broadcast of ``--bcast-count`` int32 elements from rank ``--bcast-root``
* ``o``: broadcast of a pickled object (``--obj-kib`` KiB of bytes in a dict) from rank
  ``(it + 1) % world``

Every input depends only on (rank, iteration, seqno), so a restarted worker replays the same
calls with the same data.  The results are chained into a sha256 that travels inside the
checkpoint, so a restarted worker ends with the same digest as one that never stopped.

Options are ``--name=value`` strings (rabit2.init ignores them; ``k=v`` strings such as
``mock=...`` go to rabit2.init).  Output lines, all flushed at once:

* ``START rank=R attempt=A t=<time.time()>`` right after init
* ``BCAST_DONE rank=R attempt=A v=V s=S t=<time.time()>`` after every ``b`` broadcast returns
* ``STATS rank=R attempt=A links_up=.. fetched_bytes=.. resent_bytes=.. replayed_calls=..
  resumed_calls=..`` before finalize (also after a failure)
* ``DIGEST rank=R <hex>`` on success
* ``FAILED rank=R attempt=A type=<RabitError subclass> after=<s> msg=<message>`` on a
  RabitError
  (exit status 3)

* ``FAILED rank=taskT ...`` (exit status 4) if ``rabit2.init`` itself fails

``--diverge=V,S``: on attempt >= 1 (``DMLC_NUM_ATTEMPT``), the call at (V, S) is made with
one element more than on the first attempt (a restarted worker that diverges in its replay).
``--on-sigterm=report``: SIGTERM prints ``SIGTERM task=T`` and the worker carries on (so that
a collective that the launcher's give-up interrupts can still end with the tracker's typed
abort).  ``--pause-before-load=R,S``: on attempt >= 1, rank R sleeps S seconds between
``init`` and ``load_checkpoint``; ``--pause-before-init=T,S``: on attempt >= 1, task T sleeps
S seconds before ``init``.  ``--die-at-end=R,WHERE``: on attempt 0, rank R SIGKILLs itself
after its last collective, before the last ``checkpoint`` (WHERE = ``checkpoint``) or before
``finalize`` (WHERE = ``finalize``).  ``--tag=X`` is ignored: it marks the command line, to look
for leftover processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import time

import numpy as np

import rabit2
from rabit2.errors import RabitError


def options(argv: list[str]) -> dict[str, str]:
    opts = {"iters": "4", "calls": "tsrb", "tree-count": "30000", "ring-count": "2000000",
            "bcast-count": "200000", "bcast-root": "0", "diverge": "", "on-sigterm": "die",
            "obj-kib": "16", "pause-before-load": "", "pause-before-init": "", "die-at-end": "",
            "tag": ""}
    for arg in argv:
        if arg.startswith("--") and "=" in arg:
            key, _, value = arg[2:].partition("=")
            if key not in opts:
                raise SystemExit(f"recovery_worker: unknown option {arg!r}")
            opts[key] = value
    return opts


def tree_data(rank: int, it: int, seq: int, count: int) -> np.ndarray:
    base = np.arange(count, dtype=np.int64)
    return (base * (rank + 3) + it * 1_000_003 + seq * 7_919 + rank * rank) % 1_000_000_007


def ring_data(rank: int, it: int, seq: int, count: int) -> np.ndarray:
    base = np.arange(count, dtype=np.int64)
    units = (base * (2 * rank + 1) + it * 131 + seq * 17 + rank) % 4096 - 2048
    return units.astype(np.float64) / 8.0  # exact: every partial sum fits in 53 bits


def small_data(rank: int, it: int, seq: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.uint32) * 2_654_435_761 + rank * 97 + it * 13 + seq)
            % 1_000_003).astype(np.uint32)


def bcast_data(it: int, seq: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) * 31 + it * 1009 + seq) % 2_147_483_647).astype(
        np.int32)


def main() -> int:
    opts = options(sys.argv[1:])
    attempt = int(os.environ.get("DMLC_NUM_ATTEMPT", "0"))
    t_start = time.monotonic()
    if opts["on-sigterm"] == "report":
        # rabit2-submit SIGTERMs the other workers as soon as it gives up on a task: keep
        # running, so that the collective in progress can fail with the tracker's abort
        signal.signal(signal.SIGTERM, lambda signum, frame: print(
            f"SIGTERM task={os.environ.get('DMLC_TASK_ID')} t={time.time():.6f}", flush=True))
    if opts["pause-before-init"] and attempt >= 1:
        task, seconds = opts["pause-before-init"].split(",")
        if task == os.environ.get("DMLC_TASK_ID"):
            time.sleep(float(seconds))
    try:
        rabit2.init(sys.argv[1:])
    except RabitError as exc:
        print(f"FAILED rank=task{os.environ.get('DMLC_TASK_ID')} attempt={attempt} "
              f"type={type(exc).__name__} after={time.monotonic() - t_start:.2f} msg={exc}",
              flush=True)
        return 4
    rank, world = rabit2.get_rank(), rabit2.get_world_size()
    print(f"START rank={rank} attempt={attempt} t={time.time():.6f}", flush=True)
    iters = int(opts["iters"])
    calls = opts["calls"]
    diverge = tuple(int(x) for x in opts["diverge"].split(",")) if opts["diverge"] else None
    if opts["pause-before-load"] and attempt >= 1:
        who, seconds = opts["pause-before-load"].split(",")
        if int(who) == rank:
            time.sleep(float(seconds))
    try:
        version, model = rabit2.load_checkpoint()
        chain = model["digest"] if model is not None else hashlib.sha256(b"seed").hexdigest()
        if model is not None:
            assert model["it"] == version - 1, (model, version)
        for it in range(version, iters):
            for seq, kind in enumerate(calls):
                extra = 1 if diverge == (it, seq) and attempt >= 1 else 0
                if kind == "t":
                    out = tree_data(rank, it, seq, int(opts["tree-count"]) + extra)
                    rabit2.allreduce(out, rabit2.SUM)
                elif kind == "r":
                    out = ring_data(rank, it, seq, int(opts["ring-count"]) + extra)
                    rabit2.allreduce(out, rabit2.SUM)
                elif kind == "s":
                    out = small_data(rank, it, seq, 7 + extra)
                    rabit2.allreduce(out, rabit2.MAX)
                elif kind == "b":
                    root = int(opts["bcast-root"])
                    count = int(opts["bcast-count"]) + extra
                    mine = bcast_data(it, seq, count) if rank == root else None
                    out = rabit2.broadcast(mine, root)
                    print(f"BCAST_DONE rank={rank} attempt={attempt} v={it} s={seq} "
                          f"t={time.time():.6f}", flush=True)
                elif kind == "o":
                    root = (it + 1) % world
                    blob = bytes(range(256)) * (4 * int(opts["obj-kib"]))
                    obj = {"it": it, "seq": seq, "blob": blob}
                    got = rabit2.broadcast(obj if rank == root else None, root)
                    assert got == obj, "broadcast object differs"
                    out = np.frombuffer(repr(sorted(got.items())).encode(), dtype=np.uint8)
                else:
                    raise SystemExit(f"recovery_worker: unknown call kind {kind!r}")
                chain = hashlib.sha256(chain.encode() + kind.encode() + out.tobytes()).hexdigest()
            if it == iters - 1:
                die_at_end(opts, rank, attempt, "checkpoint")
            rabit2.checkpoint({"it": it, "digest": chain})
    except RabitError as exc:
        print_stats(rank, attempt)
        message = str(exc).replace("\n", " ")
        print(f"FAILED rank={rank} attempt={attempt} type={type(exc).__name__} "
              f"after={time.monotonic() - t_start:.2f} msg={message}", flush=True)
        with contextlib.suppress(RabitError):
            rabit2.finalize()
        return 3
    die_at_end(opts, rank, attempt, "finalize")
    print_stats(rank, attempt)
    print(f"DIGEST rank={rank} {chain}", flush=True)
    rabit2.finalize()
    return 0


def die_at_end(opts: dict[str, str], rank: int, attempt: int, where: str) -> None:
    if opts["die-at-end"] and attempt == 0:
        who, when = opts["die-at-end"].split(",")
        if int(who) == rank and when == where:
            print(f"DYING rank={rank} before {where} t={time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def print_stats(rank: int, attempt: int) -> None:
    if not rabit2.is_distributed():
        return
    try:
        stats = rabit2.recovery_statistics()
    except RabitError as exc:
        print(f"STATS rank={rank} attempt={attempt} unavailable={type(exc).__name__}",
              flush=True)
        return
    fields = " ".join(f"{key}={value}" for key, value in sorted(stats.items()))
    print(f"STATS rank={rank} attempt={attempt} {fields}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
