"""The command line: parse the options, then train under the rabit contract (load the
checkpoint, checkpoint after every tree) and print the progress and the final line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from .allreduce import Ops, TimedAllreduce
from .model import Model
from .params import PRESETS, Params
from .trainer import Trainer, train


class Options(NamedTuple):
    """The command line: learner parameters, ``k=v`` arguments for ``rabit2.init``, and
    where to write the per-call trace (``--trace``; None: nowhere)."""

    params: Params
    rabit_args: list[str]
    trace: str | None = None


def parse_args(argv: Sequence[str] | None) -> Options:
    """Parse the command line (see :class:`Options`)."""
    ap = argparse.ArgumentParser(
        prog="python -m rabit2.examples.gbdt",
        description="Distributed histogram GBDT (binary logistic) over rabit2.",
    )
    ap.add_argument(
        "--size",
        choices=sorted(PRESETS),
        default="ci",
        help="preset; explicit options override it (default: ci)",
    )
    ap.add_argument("--rows", type=int, help="total training rows across all ranks")
    ap.add_argument("--features", type=int)
    ap.add_argument("--bins", type=int, help="bins per feature (ci: 64, bench: 256)")
    ap.add_argument("--depth", type=int, help="max depth = histogram allreduces per tree")
    ap.add_argument("--trees", type=int)
    ap.add_argument("--eta", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--eval-rows", type=int, dest="eval_rows")
    ap.add_argument(
        "--trace",
        metavar="PATH",
        help="write one JSON line per allreduce (call, bytes, s, prepare_s, and the "
        "perf_counter times ready and done) to PATH; "
        "'{rank}' in PATH is replaced by the rank",
    )
    ap.add_argument(
        "rabit_args",
        nargs="*",
        metavar="k=v",
        help="passed to rabit2.init, rabit style (e.g. mock=1,2,0,0)",
    )
    ns = ap.parse_args(argv)
    for kv in ns.rabit_args:
        if "=" not in kv:
            ap.error(f"expected k=v, got {kv!r}")
    overrides = {
        k: getattr(ns, k)
        for k in ("rows", "features", "bins", "depth", "trees", "eta", "seed", "eval_rows")
        if getattr(ns, k) is not None
    }
    params = replace(PRESETS[ns.size], **overrides)
    try:
        params.validate()
    except ValueError as e:
        ap.error(str(e))
    return Options(params, list(ns.rabit_args), ns.trace)


def main(argv: Sequence[str] | None = None, comm: Any = None) -> int:
    """Entry point. ``comm`` defaults to the :mod:`rabit2` module (tests may inject another)."""
    # Imported here so that the pure parts (and the tests) do not need the runtime.
    api: Any = comm if comm is not None else importlib.import_module("rabit2")
    params, rabit_args, trace_path = parse_args(argv)
    api.init(rabit_args)
    rank, world = int(api.get_rank()), int(api.get_world_size())
    with contextlib.ExitStack() as stack:
        trace = (stack.enter_context(open(trace_path.replace("{rank}", str(rank)), "w"))
                 if trace_path else None)
        _run(api, params, rank, world, TimedAllreduce(api.allreduce, trace))
    api.finalize()
    return 0


def _run(api: Any, params: Params, rank: int, world: int, timed: TimedAllreduce) -> None:
    ops = Ops(sum=api.Op.SUM, min=api.Op.MIN, max=api.Op.MAX)
    t_start = time.perf_counter()

    version, model = api.load_checkpoint()
    if model is not None and len(model["trees"]) != version:
        raise RuntimeError(f"checkpoint version {version} != {len(model['trees'])} trees")
    if rank == 0:
        api.tracker_print(
            f"gbdt: world={world} rows={params.rows} features={params.features} "
            f"bins={params.bins} depth={params.depth} trees={params.trees} start_version={version}"
        )

    def after_tree(t: int, trainer: Trainer) -> None:
        m = trainer.metrics()
        if rank == 0:
            api.tracker_print(f"[tree {t}] train-logloss={m.logloss:.6f} train-error={m.error:.4f}")
        # A fresh outer dict and list: the trees are never mutated, the list grows.
        m_ = trainer.model
        api.checkpoint(
            Model(
                format=m_["format"],
                lo=m_["lo"],
                hi=m_["hi"],
                bins=m_["bins"],
                trees=list(m_["trees"]),
            )
        )

    trainer = train(params, timed, ops, rank=rank, world=world, model=model, on_tree=after_tree)
    final = trainer.metrics()  # same call on every rank, restarted or not
    digest = trainer.eval_digest()
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        api.tracker_print(
            f"gbdt done: allreduce_s={timed.seconds:.6f} allreduce_calls={timed.calls} "
            f"allreduce_bytes={timed.bytes} total_s={elapsed:.3f}"
        )
    print(
        f"gbdt rank={rank} world={world} trees={len(trainer.model['trees'])} "
        f"train_logloss={final.logloss:.6f} train_error={final.error:.4f} "
        f"allreduce_s={timed.seconds:.6f} digest={digest}",
        flush=True,
    )
