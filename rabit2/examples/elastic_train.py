"""Data-parallel training that goes on through lost workers and takes them back: elastic mode.

Run it under the launcher::

    rabit2-submit --cluster local -n 4 --elastic -- python -m rabit2.examples.elastic_train
    rabit2-submit --cluster local -n 4 --elastic --max-attempts 2 -- \\
        python -m rabit2.examples.elastic_train --die=2,40

A linear model is fitted to a fixed synthetic regression set by minibatch gradient descent.
Every step runs in ``with rabit2.live_set() as live``: the step's batch is split among the
live workers, each computes the gradient of its part, and one SUM allreduce adds them up.
The update is applied only after the block succeeded; a step whose block failed (a worker
was lost in it) is retried with the next set.  A worker that joins (``live.new``) gets the
model and the step number by a broadcast from ``live.source``, the first member that
holds them (``live[0]`` would not do when rank 0 itself is the one that came back).

``--die=RANK,STEP`` SIGKILLs that rank at that step on its first attempt, inside the block
(repeatable): with ``--max-attempts 1`` the others finish without it, with more attempts it
is restarted and rejoins.  Every worker ends by printing the same ``model=`` digest.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import numpy as np

import rabit2


def dataset(rows: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed regression set (the same on every worker): ``y = x @ w + noise``."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, features))
    w = rng.normal(size=features)
    return x, x @ w + rng.normal(scale=0.1, size=rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--pause", type=float, default=0.05,
                        help="seconds of 'compute' a step (long enough, by default, for a "
                             "restarted worker to come back before the last step)")
    parser.add_argument("--die", action="append", default=[], metavar="RANK,STEP")
    opts = parser.parse_args(argv)
    deaths = {tuple(int(v) for v in spec.split(",")) for spec in opts.die}
    x, y = dataset(opts.rows, opts.features)
    rabit2.init()
    rank = rabit2.get_rank()
    step, w = 0, np.zeros(opts.features)
    try:
        step, w = train(opts, x, y, rank, step, w, deaths)
    except rabit2.errors.JobFinishedError:  # (back after the others finished: nothing to do)
        print(f"elastic rank={rank} came back after the job finished", flush=True)
        rabit2.finalize()
        return
    digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
    print(f"elastic rank={rank} done steps={step} model={digest}", flush=True)
    rabit2.finalize()


def train(opts: argparse.Namespace, x: np.ndarray, y: np.ndarray, rank: int, step: int,
          w: np.ndarray, deaths: set[tuple[int, ...]]) -> tuple[int, np.ndarray]:
    """The training loop: one step per live set; the step and the weights at the end."""
    first_attempt = os.environ.get("DMLC_NUM_ATTEMPT", "0") == "0"
    while step < opts.steps:
        time.sleep(opts.pause)
        try:
            with rabit2.live_set() as live:
                if live.new and live.source is not None:  # someone joined: it takes the
                    step, w = rabit2.broadcast((step, w) if rank == live.source else None,
                                               root=live.source)  # model of a member
                batch = np.random.default_rng(step).choice(opts.rows, opts.batch, replace=False)
                mine = np.array_split(batch, len(live))[live.index(rank)]
                error = x[mine] @ w - y[mine]
                grad = np.append(x[mine].T @ error, [float(error @ error), len(mine)])
                rabit2.allreduce(grad, rabit2.Op.SUM)
                if first_attempt and (rank, step) in deaths:
                    os.kill(os.getpid(), signal.SIGKILL)
            count = grad[-1]  # (applied only once the whole step succeeded)
            w = w - opts.lr * grad[:-2] / count
            if step % 20 == 0 or step + 1 == opts.steps:
                loss = grad[-2] / count
                print(f"elastic rank={rank} step={step} live={list(live)} loss={loss:.6f}",
                      flush=True)
            step += 1
        except rabit2.LiveSetError as exc:
            print(f"elastic rank={rank} step={step} retried: {exc}", flush=True)
    return step, w


if __name__ == "__main__":
    main(sys.argv[1:])
