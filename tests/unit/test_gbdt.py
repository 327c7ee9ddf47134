"""Pure-logic tests of the distributed GBDT example (no processes, no sockets).

The collectives are simulated in one process: each simulated rank runs the real trainer in a
thread, and a barrier-based allreduce sums the ranks' contributions in a shuffled order, so the
"bit-identical for any world size" claim is checked against genuinely different float orders.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rabit2.examples import gbdt
from rabit2.examples.gbdt import Ops, Params, Trainer

OPS = Ops(sum="sum", min="min", max="max")
_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum}

SMALL = Params(rows=3000, features=6, bins=16, depth=3, trees=4, eta=0.3, seed=7, eval_rows=500)


def local_allreduce(
    data: np.ndarray, op: Any, prepare_fun: Callable[[np.ndarray], None] | None = None
) -> np.ndarray:
    """World size 1: the reduction is the identity (after the lazy preparation)."""
    assert op in _UFUNC
    if prepare_fun is not None:
        prepare_fun(data)
    return data


class SimComm:
    """``world`` ranks in threads; allreduce = barrier, shuffled-order reduction, copy back."""

    def __init__(self, world: int, seed: int = 0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[np.ndarray | None] = [None] * world
        self.result: np.ndarray | None = None
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[Any, tuple[int, ...], str]] = []

    def for_rank(self, rank: int) -> gbdt.AllreduceFn:
        def allreduce(
            data: np.ndarray, op: Any, prepare_fun: Callable[[np.ndarray], None] | None = None
        ) -> np.ndarray:
            if prepare_fun is not None:
                prepare_fun(data)
            self.slots[rank] = data.copy()
            self.barrier.wait()
            if rank == 0:
                order = self.rng.permutation(self.world)
                acc = self.slots[int(order[0])]
                assert acc is not None
                acc = acc.copy()
                for r in order[1:]:
                    other = self.slots[int(r)]
                    assert other is not None and other.shape == acc.shape
                    _UFUNC[op](acc, other, out=acc)
                self.result = acc
                self.calls.append((op, data.shape, str(data.dtype)))
            self.barrier.wait()
            assert self.result is not None
            data[...] = self.result
            return data

        return allreduce


def run_world(params: Params, world: int, seed: int = 0) -> tuple[list[Trainer], SimComm]:
    """Train on ``world`` simulated ranks; returns every rank's trainer."""
    sim = SimComm(world, seed)
    out: list[Trainer | None] = [None] * world
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            t = gbdt.train(params, sim.for_rank(rank), OPS, rank=rank, world=world)
            t.metrics()
            out[rank] = t
        except BaseException as e:
            errors.append(e)
            sim.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    trainers = [t for t in out if t is not None]
    assert len(trainers) == world
    return trainers, sim


def assert_models_equal(a: gbdt.Model, b: gbdt.Model) -> None:
    assert np.array_equal(a["lo"], b["lo"]) and np.array_equal(a["hi"], b["hi"])
    assert len(a["trees"]) == len(b["trees"])
    for ta, tb in zip(a["trees"], b["trees"], strict=True):
        for key in ("feature", "split_bin", "left", "right"):
            assert np.array_equal(ta[key], tb[key]), key
        assert ta["value"].tobytes() == tb["value"].tobytes()


# ------------------------------------------------------------------------------------------
# Fixed-point gradients
# ------------------------------------------------------------------------------------------


def test_quant_bits_keeps_sums_below_2_pow_52() -> None:
    assert gbdt.quant_bits(3000) == 30
    for rows in (2**22, 2**23, 10**8):
        q = gbdt.quant_bits(rows)
        assert rows * 2**q <= 2**52


def test_quantised_sums_are_order_independent() -> None:
    rng = np.random.default_rng(1)
    g = rng.uniform(-1, 1, 100_000)
    q = gbdt.quantise(g, 30)
    assert np.all(np.abs(q - g) <= 2.0**-31)
    sums = {float(np.sum(q[rng.permutation(q.size)])) for _ in range(5)}
    sums |= {sum(float(v) for v in q[::-1]), float(np.cumsum(q)[-1])}
    assert len(sums) == 1
    # Control: without quantisation the same experiment does see different last bits.
    raw = {float(np.sum(g[rng.permutation(g.size)])) for _ in range(5)}
    raw |= {sum(float(v) for v in g[::-1]), float(np.cumsum(g)[-1])}
    assert len(raw) > 1


def test_gradients_are_on_the_grid() -> None:
    t = Trainer(SMALL, local_allreduce, OPS)
    t.margin = np.random.default_rng(3).normal(0, 3, t.margin.size)
    g, h = t.gradients()
    scale = 2.0**t.qbits
    assert np.array_equal(g * scale, np.rint(g * scale))
    assert np.array_equal(h * scale, np.rint(h * scale))
    assert np.all(np.abs(g) <= 1) and np.all((h >= 0) & (h <= 0.25))


# ------------------------------------------------------------------------------------------
# Data and bins
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_shards_concatenate_to_the_full_data_set(world: int) -> None:
    rows = 2 * gbdt.BLOCK_ROWS + 123  # crosses block boundaries
    full_x, full_y = gbdt.make_rows(5, 1, 0, rows, 4)
    parts = [gbdt.make_rows(5, 1, *gbdt.shard_range(rows, r, world), 4) for r in range(world)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), full_x)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), full_y)
    assert set(np.unique(full_y)) == {0.0, 1.0}


def test_labels_follow_the_true_function() -> None:
    x, y = gbdt.make_rows(0, 1, 0, 20_000, 8)
    p = gbdt.sigmoid(gbdt.true_logit(x))
    # Labels are Bernoulli(p): the Bayes classifier beats chance clearly.
    assert np.mean((p > 0.5) == (y > 0.5)) > 0.7
    assert abs(float(y.mean()) - float(p.mean())) < 0.02


def test_bin_matrix_uniform_and_clipped() -> None:
    x = np.array([[0.0, -1.0], [0.49, 5.0], [0.5, 9.0], [1.0, 3.0], [2.0, -7.0]])
    lo, hi = np.array([0.0, 3.0]), np.array([1.0, 3.0])
    b = gbdt.bin_matrix(x, lo, hi, 4)
    assert b.dtype == np.uint8 and b.flags.f_contiguous
    assert b[:, 0].tolist() == [0, 1, 2, 3, 3]  # max value and out-of-range clip to last bin
    assert b[:, 1].tolist() == [0, 0, 0, 0, 0]  # constant feature: one bin
    assert gbdt.bin_matrix(x, lo, hi, 300).dtype == np.uint16


# ------------------------------------------------------------------------------------------
# Histograms and splits
# ------------------------------------------------------------------------------------------


def test_histogram_of_tiny_input_by_hand() -> None:
    binned = np.asfortranarray(np.array([[0, 2], [1, 2], [0, 0], [2, 1]], dtype=np.uint8))
    grad = np.array([0.5, -0.25, 1.0, -1.0])
    hess = np.array([0.25, 0.125, 0.0625, 0.25])
    pos = np.array([1, 1, 2, 1], dtype=np.int32)
    hist = gbdt.build_histograms(binned, grad, hess, pos, [2, 1], bins=3)
    expect = np.zeros((2, 2, 3, 2))
    # node 2 (slot 0): only row 2 -> feature 0 bin 0, feature 1 bin 0
    expect[0, 0, 0] = expect[0, 1, 0] = (1.0, 0.0625)
    # node 1 (slot 1): rows 0, 1, 3
    expect[1, 0, 0] = (0.5, 0.25)
    expect[1, 0, 1] = (-0.25, 0.125)
    expect[1, 0, 2] = (-1.0, 0.25)
    expect[1, 1, 1] = (-1.0, 0.25)
    expect[1, 1, 2] = (0.25, 0.375)
    assert np.array_equal(hist, expect)
    assert gbdt.node_sums(hist[1]) == (-0.75, 0.625)


def test_subtraction_trick_equals_direct_build() -> None:
    rng = np.random.default_rng(2)
    n, f, bins = 5000, 5, 16
    binned = np.asfortranarray(rng.integers(0, bins, (n, f), dtype=np.uint8))
    grad = gbdt.quantise(rng.uniform(-1, 1, n), 30)
    hess = gbdt.quantise(rng.uniform(0, 0.25, n), 30)
    parent = gbdt.build_histograms(binned, grad, hess, np.zeros(n, np.int32), [0], bins=bins)
    pos = np.where(binned[:, 3] <= 6, 1, 2).astype(np.int32)
    direct = gbdt.build_histograms(binned, grad, hess, pos, [1, 2], bins=bins)
    assert np.array_equal(parent[0] - direct[0], direct[1])
    assert np.array_equal(parent[0] - direct[1], direct[0])


def test_best_split_finds_the_planted_split() -> None:
    rng = np.random.default_rng(4)
    n, bins = 4000, 8
    binned = np.asfortranarray(rng.integers(0, bins, (n, 3), dtype=np.uint8))
    # Gradient depends only on feature 1 crossing bin 2: the ideal split is (1, 2).
    grad = np.where(binned[:, 1] <= 2, -0.5, 0.5)
    hess = np.full(n, 0.25)
    hist = gbdt.build_histograms(binned, grad, hess, np.zeros(n, np.int32), [0], bins=bins)[0]
    s = gbdt.best_split(hist, Params())
    assert s is not None and (s.feature, s.split_bin) == (1, 2)
    left = binned[:, 1] <= 2
    assert s.left_sum == (float(grad[left].sum()), float(hess[left].sum()))
    assert s.right_sum == (float(grad[~left].sum()), float(hess[~left].sum()))
    # No split when children would be lighter than min_child_weight.
    assert gbdt.best_split(hist, Params(min_child_weight=n)) is None
    # No split when the gradient carries no signal.
    root = np.zeros(n, np.int32)
    flat = gbdt.build_histograms(binned, np.zeros(n), hess, root, [0], bins=bins)[0]
    assert gbdt.best_split(flat, Params()) is None


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------


def test_loss_decreases_and_model_learns() -> None:
    params = Params(rows=6000, features=8, bins=32, depth=4, trees=6, seed=1, eval_rows=500)
    losses: list[float] = []
    t0 = Trainer(params, local_allreduce, OPS)
    losses.append(t0.metrics().logloss)
    trainer = gbdt.train(
        params, local_allreduce, OPS, on_tree=lambda _, t: losses.append(t.metrics().logloss)
    )
    assert losses[0] == pytest.approx(np.log(2))  # margin 0 => p = 0.5
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert losses[-1] < 0.6
    assert trainer.metrics().error < 0.33
    assert all(tree["depth"] <= params.depth for tree in trainer.model["trees"])


def test_margins_match_prediction_from_the_model() -> None:
    trainer = gbdt.train(SMALL, local_allreduce, OPS)
    again = gbdt.predict_margin(trainer.model, trainer.binned)
    assert again.tobytes() == trainer.margin.tobytes()


def test_collective_sequence_is_the_xgboost_pattern() -> None:
    params = Params(rows=4000, features=5, bins=16, depth=4, trees=2, seed=3, eval_rows=10)
    _, sim = run_world(params, 2)
    # MIN and MAX of the cuts, then per tree: one histogram allreduce per level.
    assert sim.calls[:2] == [("min", (5,), "float64"), ("max", (5,), "float64")]
    hist = [shape for op, shape, _ in sim.calls[2:] if len(shape) == 4]
    assert all(op == "sum" for op, _, _ in sim.calls[2:])
    assert len(hist) == params.trees * params.depth  # this data always splits to full depth
    per_tree = [s[0] for s in hist[: params.depth]]
    assert per_tree[:2] == [1, 1]  # root, then only the smaller child of the root
    assert all(n <= 2 ** (d - 1) for d, n in enumerate(per_tree) if d > 0)
    assert all(s[1:] == (5, 16, 2) for s in hist)
    assert sim.calls[-1] == ("sum", (3,), "float64")  # the final metric


@pytest.mark.parametrize("world", [2, 3, 4])
def test_digest_is_bit_identical_for_any_world_size(world: int) -> None:
    (single,), _ = run_world(SMALL, 1)
    trainers, _ = run_world(SMALL, world, seed=world)
    ref = single.eval_digest()
    for t in trainers:
        assert t.eval_digest() == ref
        assert_models_equal(t.model, single.model)
    margins = np.concatenate([t.margin for t in trainers])
    assert margins.tobytes() == single.margin.tobytes()


def test_more_ranks_than_rows_leaves_empty_shards_harmless() -> None:
    params = Params(
        rows=50, features=3, bins=8, depth=2, trees=2, eval_rows=20, min_child_weight=0.5
    )
    (single,), _ = run_world(params, 1)
    trainers, _ = run_world(params, 64)
    assert any(t.y.size == 0 for t in trainers)
    assert {t.eval_digest() for t in trainers} == {single.eval_digest()}


def test_restart_from_checkpoint_is_bit_identical() -> None:
    params = Params(rows=4000, features=6, bins=16, depth=3, trees=6, seed=9, eval_rows=300)
    straight = gbdt.train(params, local_allreduce, OPS)
    saved: list[bytes] = []
    gbdt.train(
        params,
        local_allreduce,
        OPS,
        on_tree=lambda t, tr: saved.append(pickle.dumps(tr.model)) if t == 2 else None,
    )
    model = pickle.loads(saved[0])  # what load_checkpoint returns: version 3
    assert len(model["trees"]) == 3
    calls: list[Any] = []

    def counting(data: np.ndarray, op: Any, prepare_fun: Any = None) -> np.ndarray:
        calls.append(op)
        return local_allreduce(data, op, prepare_fun)

    resumed = gbdt.train(params, counting, OPS, model=model)
    assert "min" not in calls and "max" not in calls  # cuts came from the checkpoint
    assert resumed.margin.tobytes() == straight.margin.tobytes()
    assert resumed.eval_digest() == straight.eval_digest()


def test_replay_without_prepare_fun_gives_the_same_model() -> None:
    """A replaying worker gets cached results and never runs ``prepare_fun`` (rabit)."""
    recorded: list[np.ndarray] = []

    def record(data: np.ndarray, op: Any, prepare_fun: Any = None) -> np.ndarray:
        out = local_allreduce(data, op, prepare_fun)
        recorded.append(out.copy())
        return out

    first = gbdt.train(SMALL, record, OPS)
    replay = iter(recorded)

    def cached(data: np.ndarray, op: Any, prepare_fun: Any = None) -> np.ndarray:
        data[...] = next(replay)
        return data

    second = gbdt.train(SMALL, cached, OPS)
    assert second.eval_digest() == first.eval_digest()


# ------------------------------------------------------------------------------------------
# Command line, with a fake rabit2 API
# ------------------------------------------------------------------------------------------


class FakeApi:
    """The slice of the rabit2 API the example uses, for a single process."""

    class Op:
        MAX, MIN, SUM = "max", "min", "sum"

    def __init__(self, start: tuple[int, Any] = (0, None)) -> None:
        self.start = start
        self.log: list[str] = []
        self.init_args: list[str] | None = None
        self.checkpoints: list[bytes] = []
        self.finalized = False

    def init(self, args: list[str] | None = None) -> None:
        self.init_args = args

    def get_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 1

    def allreduce(self, data: np.ndarray, op: Any, prepare_fun: Any = None) -> np.ndarray:
        return local_allreduce(data, op, prepare_fun)

    def load_checkpoint(self) -> tuple[int, Any]:
        return self.start

    def checkpoint(self, model: Any) -> None:
        self.checkpoints.append(pickle.dumps(model))

    def tracker_print(self, msg: str) -> None:
        self.log.append(msg)

    def finalize(self) -> None:
        self.finalized = True


def test_cli_single_process_and_resume(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--trees", "5", "--rows", "3000", "--bins", "16", "mock=0,9,0,0"]
    api = FakeApi()
    assert gbdt.main(argv, api) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert fields["rank"] == "0" and fields["world"] == "1" and fields["trees"] == "5"
    assert len(fields["digest"]) == 64 and float(fields["train_logloss"]) < np.log(2)
    assert api.init_args == ["mock=0,9,0,0"] and api.finalized
    assert len(api.checkpoints) == 5
    assert any("allreduce_s=" in m for m in api.log)
    assert sum(m.startswith("[tree ") for m in api.log) == 5

    # A restarted worker: load_checkpoint hands back version 2 and its model.
    resumed = FakeApi(start=(2, pickle.loads(api.checkpoints[1])))
    gbdt.main(argv, resumed)
    last2 = capsys.readouterr().out.strip().splitlines()[-1]
    fields2 = dict(kv.split("=", 1) for kv in last2.split()[1:])
    assert fields2["digest"] == fields["digest"]
    assert fields2["train_logloss"] == fields["train_logloss"]
    assert len(resumed.checkpoints) == 3


def test_parse_args_presets_and_overrides() -> None:
    p, rabit_args, trace = gbdt.parse_args(["--size", "bench", "--trees", "3", "a=1", "b=2"])
    assert (p.features, p.bins, p.depth, p.trees) == (100, 256, 6, 3)
    assert rabit_args == ["a=1", "b=2"] and trace is None
    assert gbdt.parse_args(["--trace", "/x/{rank}.jsonl"]).trace == "/x/{rank}.jsonl"
    assert gbdt.parse_args([])[0] == gbdt.PRESETS["ci"]
    with pytest.raises(SystemExit):
        gbdt.parse_args(["notkv"])
    with pytest.raises(SystemExit):
        gbdt.parse_args(["--bins", "1"])


def test_trace_has_one_line_per_allreduce(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--trace``: one JSON line per allreduce, whose seconds add up to ``allreduce_s``."""
    api = FakeApi()
    path = tmp_path / "trace-{rank}.jsonl"
    assert gbdt.main(["--trees", "3", "--rows", "2000", "--bins", "16", "--depth", "3",
                      "--trace", str(path)], api) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    lines = [json.loads(x) for x in (tmp_path / "trace-0.jsonl").read_text().splitlines()]
    done = next(m for m in api.log if m.startswith("gbdt done"))
    calls = int(done.split("allreduce_calls=")[1].split()[0])
    assert [x["call"] for x in lines] == list(range(calls)) and calls > 3 * 3
    assert all(x["bytes"] > 0 and x["s"] >= 0 and x["prepare_s"] >= 0 for x in lines)
    assert any(x["prepare_s"] > 0 for x in lines)  # the lazily built histograms
    # ready: when the input was (after prepare_fun), done: when the call returned
    assert all(x["ready"] <= x["done"] for x in lines)
    assert all(a["done"] <= b["ready"] for a, b in itertools.pairwise(lines))
    assert math.isclose(sum(x["s"] for x in lines), float(fields["allreduce_s"]),
                        rel_tol=1e-4, abs_tol=1e-5)
