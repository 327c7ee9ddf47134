"""Distributed histogram gradient-boosted trees over rabit2 (the XGBoost ``hist`` pattern).

Run it under the launcher::

    rabit2-submit --cluster local -n 4 -- python -m rabit2.examples.gbdt --size ci
    rabit2-submit --cluster local -n 4 -- python -m rabit2.examples.gbdt mock=1,2,0,0

or alone (single-process mode, world size 1): ``python -m rabit2.examples.gbdt``.

What it does
------------
Depth-wise boosted trees with binary logistic loss, in numpy, data-parallel by rows:

1. Every rank generates the same synthetic data set from ``--seed`` (a known nonlinear function
   of Gaussian features, labels drawn from its sigmoid) and keeps only its contiguous block of
   rows. Rows are produced in fixed blocks seeded by ``(seed, block)``, so row ``i`` is the same
   whatever the world size, and a rank only generates the blocks it needs.
2. Bin cuts are global: per-feature min and max by ``allreduce`` MIN and MAX, then ``--bins``
   uniform bins. The cuts travel inside the checkpointed model, so a worker restarted after the
   first checkpoint does not repeat those two collectives (its call sequence since the checkpoint
   must match the survivors', see "Fault tolerance").
3. Per tree level, each rank builds the gradient/hessian histograms, float64 of shape
   ``(nodes, features, bins, 2)``, of the nodes built explicitly at that level over its own rows,
   and calls **one** ``allreduce(hist, SUM)`` per level -- the XGBoost pattern (rabit-protocol
   §6.5). Like XGBoost, only the smaller child of each split is built; the sibling is parent
   minus child (the "subtraction trick"), so level ``d`` carries at most ``2**(d-1)`` nodes.
   The histograms are built lazily in ``prepare_fun``, so a replaying worker whose result is
   served from the survivors' cache skips the work, as rabit intended.
4. Every rank then evaluates the same splits (gain with L2 ``lambda``, ``min_child_weight``) on
   the same reduced bytes, so every rank grows the same tree and routes its own rows.
5. Leaf weights come from the reduced sums. A 3-double allreduce per tree (loss sum, rows,
   errors) feeds the progress line that rank 0 prints with ``tracker_print``.

Bit-identical models for any world size
---------------------------------------
Floating-point addition is not associative: summing the same histogram contributions in a
different order (other shard boundaries, another reduction tree) changes the last bits, then a
split decision, then the whole model. So every gradient and hessian is rounded to a fixed-point
grid of ``2**-q`` before it enters a histogram (``q = 30`` for up to 2**22 rows). With
``|g| <= 1`` and ``0 <= h <= 0.25`` every value is an integer multiple of ``2**-q`` of at most
``2**q`` units, so every partial sum over at most ``n`` rows is such an integer below
``n * 2**q <= 2**52``, exactly representable in float64. Every float64 addition on the way is
therefore exact, and the reduced histogram -- and everything computed from it -- is the same
bytes whatever the order, the sharding or the number of workers. (XGBoost's GPU ``hist`` does the
same with integer-quantised gradients.) Rounding costs ``2**-31`` relative precision, far below
anything that matters for boosting.

Per-row margins depend only on the model and the row, so the final model, the evaluation
predictions and their ``digest`` are identical on 1, 2 or 4 workers, and after any crash and
restart. The printed train logloss is a plain float sum across ranks and may differ in its last
bits between world sizes; it is for humans, not for the digest.

Fault tolerance
---------------
The program follows rabit's contract: ``version, model = load_checkpoint()`` at start, trees
``range(version, n_trees)``, ``checkpoint(model)`` after each tree. The model (cuts + list of
trees, plain numpy/python data, picklable) is the only state: after a load, the per-row margins
are recomputed from it by adding the trees' outputs in the same order as training did, so a
restarted worker is bit-identical to one that never stopped. After the last tree every rank
performs the same final metric allreduce, so a worker restarted after the last checkpoint issues
exactly the same calls as the survivors did.

Output
------
Rank 0 prints per-tree progress and a summary with ``allreduce_s=`` (seconds spent inside
``allreduce``, excluding the lazily-run histogram building) via ``tracker_print``. The last line
on every rank's stdout is::

    gbdt rank=R world=W trees=T train_logloss=X train_error=E allreduce_s=S digest=<sha256>

where ``digest`` is the sha256 of the model's float64 margins on a fixed evaluation set that
every rank generates identically.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, TextIO, TypedDict

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
I32 = NDArray[np.int32]
BinMatrix = NDArray[np.uint8] | NDArray[np.uint16]

#: Rows are generated in blocks of this many, each from its own seed, so a rank can produce
#: exactly its shard and row ``i`` is identical for every world size.
BLOCK_ROWS = 4096

#: Streams of the generator: training rows and the evaluation set are independent.
_TRAIN_STREAM = 1
_EVAL_STREAM = 2

MODEL_FORMAT = "rabit2-gbdt-1"


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    """Data-set and learner parameters. Every rank must use the same values."""

    rows: int = 8192
    """Total training rows across all ranks."""
    features: int = 8
    bins: int = 64
    depth: int = 4
    """Maximum tree depth = number of histogram allreduces per tree."""
    trees: int = 8
    eta: float = 0.3
    reg_lambda: float = 1.0
    min_child_weight: float = 1.0
    min_split_gain: float = 1e-6
    seed: int = 0
    eval_rows: int = 4096

    def validate(self) -> None:
        """Raise ``ValueError`` on values the learner cannot handle."""
        if self.rows < 1 or self.features < 1 or self.eval_rows < 1:
            raise ValueError("rows, features and eval_rows must be >= 1")
        if not 2 <= self.bins <= 65536:
            raise ValueError("bins must be in [2, 65536]")
        if self.depth < 1 or self.trees < 0:
            raise ValueError("depth must be >= 1 and trees >= 0")
        if not self.eta > 0 or self.reg_lambda < 0 or self.min_child_weight < 0:
            raise ValueError("eta must be > 0; reg_lambda and min_child_weight >= 0")


#: ``--size`` presets. ``ci`` runs in a few seconds with 4 workers on 2 cores; ``bench`` has
#: XGBoost-sized messages: 100 features x 256 bins x 16 B = 409.6 KB per node-histogram,
#: depth 6 -> allreduces of 0.41/0.41/0.82/1.64/3.28/6.55 MB per tree (rabit-protocol §6.5).
PRESETS: dict[str, Params] = {
    "ci": Params(rows=8192, features=8, bins=64, depth=4, trees=8, eta=0.3),
    "bench": Params(rows=200_000, features=100, bins=256, depth=6, trees=10, eta=0.3),
}


def quant_bits(rows: int) -> int:
    """Fixed-point fraction bits for gradients so that sums over ``rows`` rows stay exact.

    Each quantised value is ``k * 2**-q`` with ``|k| <= 2**q``; a sum over ``rows`` rows is at
    most ``rows * 2**q`` units, which must stay below ``2**52`` (float64 has a 53-bit
    significand; one bit of margin). 30 bits is plenty of precision and is kept whenever the
    data set is small enough.
    """
    need = max(1, math.ceil(math.log2(max(rows, 2))))
    return min(30, 52 - need)


def quantise(x: F64, bits: int) -> F64:
    """Round ``x`` to the nearest multiple of ``2**-bits`` (scaling by a power of two is exact)."""
    scale = float(2**bits)
    return np.rint(x * scale) / scale


# --------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------


def shard_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous block ``[start, stop)`` of rows owned by ``rank``."""
    return rows * rank // world, rows * (rank + 1) // world


def make_rows(seed: int, stream: int, start: int, stop: int, features: int) -> tuple[F64, F64]:
    """Rows ``[start, stop)`` of a stream: features ``X`` and labels ``y`` (0.0 / 1.0).

    Row ``i`` depends only on ``(seed, stream, i)``: blocks of :data:`BLOCK_ROWS` rows each come
    from their own generator, so any shard can be produced without the rows before it.
    """
    if stop <= start:
        return np.empty((0, features)), np.empty(0)
    xs: list[F64] = []
    us: list[F64] = []
    first, last = start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS
    for block in range(first, last + 1):
        rng = np.random.default_rng([seed, stream, block])
        xs.append(rng.standard_normal((BLOCK_ROWS, features)))
        us.append(rng.random(BLOCK_ROWS))
    lo = start - first * BLOCK_ROWS
    hi = lo + (stop - start)
    x = np.concatenate(xs)[lo:hi]
    u = np.concatenate(us)[lo:hi]
    y = (u < sigmoid(true_logit(x))).astype(np.float64)
    return np.ascontiguousarray(x), y


def true_logit(x: F64) -> F64:
    """The known nonlinear function the learner has to find (features reused modulo F)."""
    f = x.shape[1]

    def c(k: int) -> F64:
        return x[:, k % f]

    return (
        2.0 * np.sin(1.5 * c(0))
        + 1.5 * c(1) * c(2)
        - (c(3) ** 2 - 1.0)
        + 1.5 * (c(4) > 0.3)
        - 0.8 * np.abs(c(5))
        + 0.5 * c(6)
        + 0.2
    )


def sigmoid(m: F64) -> F64:
    """Logistic function."""
    out: F64 = 1.0 / (1.0 + np.exp(-m))
    return out


def logloss_terms(margin: F64, y: F64) -> F64:
    """Per-row binary logloss from margins, overflow-free: ``log(1 + e^m) - y m``."""
    out: F64 = np.logaddexp(0.0, margin) - y * margin
    return out


# --------------------------------------------------------------------------------------------
# Bins
# --------------------------------------------------------------------------------------------


def bin_matrix(x: F64, lo: F64, hi: F64, bins: int) -> BinMatrix:
    """Uniform bins between the global ``lo`` and ``hi``; values outside are clipped.

    The result is Fortran-ordered so that a feature's column is contiguous for the per-feature
    ``bincount``. The same elementwise arithmetic runs on every rank, so equal ``x`` gives equal
    bins everywhere.
    """
    width = hi - lo
    scale = np.divide(bins, width, out=np.zeros_like(width), where=width > 0)
    dtype = np.uint8 if bins <= 256 else np.uint16
    n = x.shape[0]
    out: BinMatrix = np.empty(x.shape, dtype=dtype, order="F")
    # In row chunks through one small float buffer: whole-matrix float temporaries would cost
    # 2 x 8 B per cell (160 MB each for the bench preset) and their page faults dominate.
    tmp = np.empty((min(n, BLOCK_ROWS), x.shape[1]))
    for s in range(0, n, BLOCK_ROWS):
        t = tmp[: min(n, s + BLOCK_ROWS) - s]
        np.subtract(x[s : s + t.shape[0]], lo, out=t)
        t *= scale
        np.floor(t, out=t)
        np.clip(t, 0, bins - 1, out=t)
        out[s : s + t.shape[0]] = t  # exact small integers: the cast loses nothing
    return out


def bin_threshold(lo: float, hi: float, bins: int, b: int) -> float:
    """Human-readable upper edge of bin ``b`` (the model itself routes on bin indices)."""
    return lo + (b + 1) * (hi - lo) / bins


# --------------------------------------------------------------------------------------------
# Histograms and splits (pure)
# --------------------------------------------------------------------------------------------


def build_histograms(
    binned: BinMatrix,
    grad: F64,
    hess: F64,
    pos: I32,
    nodes: Sequence[int],
    *,
    bins: int,
    out: F64 | None = None,
) -> F64:
    """Gradient/hessian histograms of ``nodes`` over the local rows.

    Returns (or fills ``out``) shape ``(len(nodes), features, bins, 2)``: ``[..., 0]`` sums of
    gradients, ``[..., 1]`` sums of hessians of the rows whose node (``pos``) is in ``nodes``.
    """
    n_feat = binned.shape[1]
    shape = (len(nodes), n_feat, bins, 2)
    if out is None:
        out = np.zeros(shape)
    elif out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, expected {shape}")
    else:
        out.fill(0.0)
    if not nodes or pos.size == 0:
        return out
    slot_of = np.full(int(max(int(pos.max()), *nodes)) + 1, -1, dtype=np.int64)
    slot_of[np.asarray(nodes, dtype=np.int64)] = np.arange(len(nodes))
    slot_all = slot_of[pos]
    rows = np.flatnonzero(slot_all >= 0)
    if rows.size == 0:
        return out
    base = slot_all[rows] * bins
    g = grad[rows]
    h = hess[rows]
    size = len(nodes) * bins
    for f in range(n_feat):
        idx = base + binned[rows, f]
        out[:, f, :, 0] = np.bincount(idx, weights=g, minlength=size).reshape(len(nodes), bins)
        out[:, f, :, 1] = np.bincount(idx, weights=h, minlength=size).reshape(len(nodes), bins)
    return out


class Split(NamedTuple):
    """The best split of a node: rows with ``bin <= split_bin`` of ``feature`` go left."""

    feature: int
    split_bin: int
    gain: float
    left_sum: tuple[float, float]
    right_sum: tuple[float, float]


def node_sums(hist: F64) -> tuple[float, float]:
    """(G, H) of a node from its histogram ``(features, bins, 2)``.

    Every row falls in exactly one bin of every feature and sums are exact (quantised), so
    feature 0's total equals every other feature's total.
    """
    return float(hist[0, :, 0].sum()), float(hist[0, :, 1].sum())


def leaf_weight(g: float, h: float, params: Params) -> float:
    """Newton step ``-G / (H + lambda)``, shrunk by ``eta``."""
    return -g / (h + params.reg_lambda) * params.eta


def best_split(hist: F64, params: Params) -> Split | None:
    """The highest-gain valid split of one node's histogram, or ``None``.

    ``gain = GL^2/(HL+l) + GR^2/(HR+l) - G^2/(H+l)``; both children need a hessian sum of at
    least ``min_child_weight`` and the gain must exceed ``min_split_gain``. Ties go to the
    lowest (feature, bin), which makes the choice identical on every rank.
    """
    lam = params.reg_lambda
    gl = np.cumsum(hist[:, :-1, 0], axis=1)
    hl = np.cumsum(hist[:, :-1, 1], axis=1)
    g_tot, h_tot = node_sums(hist)
    gr = g_tot - gl
    hr = h_tot - hl
    valid = (hl >= params.min_child_weight) & (hr >= params.min_child_weight)
    if not valid.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = gl * gl / (hl + lam) + gr * gr / (hr + lam) - g_tot * g_tot / (h_tot + lam)
    gain = np.where(valid, gain, -np.inf)
    k = int(np.argmax(gain))
    f, b = divmod(k, gain.shape[1])
    best = float(gain[f, b])
    if not best > params.min_split_gain:
        return None
    return Split(
        feature=f,
        split_bin=b,
        gain=best,
        left_sum=(float(gl[f, b]), float(hl[f, b])),
        right_sum=(float(gr[f, b]), float(hr[f, b])),
    )


# --------------------------------------------------------------------------------------------
# Trees and model
# --------------------------------------------------------------------------------------------


class Tree(TypedDict):
    """One tree as flat arrays indexed by node id (0 = root); leaves have ``feature == -1``.

    ``value`` of a leaf already includes ``eta``. ``threshold`` is informative only.
    """

    feature: NDArray[np.int32]
    split_bin: NDArray[np.int32]
    left: NDArray[np.int32]
    right: NDArray[np.int32]
    value: F64
    threshold: F64
    depth: int


class Model(TypedDict):
    """The checkpointed state: the global bin cuts plus the trees, in training order."""

    format: str
    lo: F64
    hi: F64
    bins: int
    trees: list[Tree]


def predict_tree(tree: Tree, binned: BinMatrix) -> F64:
    """Leaf value of every row of ``binned`` (vectorised walk, one level per step)."""
    n = binned.shape[0]
    node = np.zeros(n, dtype=np.int32)
    rows = np.arange(n)
    for _ in range(tree["depth"]):
        feat = tree["feature"][node[rows]]
        inner = feat >= 0
        rows, feat = rows[inner], feat[inner]
        if rows.size == 0:
            break
        at = node[rows]
        go_left = binned[rows, feat] <= tree["split_bin"][at]
        node[rows] = np.where(go_left, tree["left"][at], tree["right"][at])
    out: F64 = tree["value"][node]
    return out


def predict_margin(model: Model, binned: BinMatrix) -> F64:
    """Sum of the trees' outputs, added tree by tree in order starting from 0.0.

    Training updates margins in exactly this order, so margins recomputed after a checkpoint
    load are bit-identical to the ones of a worker that never stopped.
    """
    margin = np.zeros(binned.shape[0])
    for tree in model["trees"]:
        margin += predict_tree(tree, binned)
    return margin


def margins_digest(margin: F64) -> str:
    """sha256 of little-endian float64 margins."""
    return hashlib.sha256(np.ascontiguousarray(margin, dtype="<f8").tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# The distributed trainer
# --------------------------------------------------------------------------------------------


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


@dataclass
class Metrics:
    """Global training metrics of the current model."""

    logloss: float
    error: float
    rows: int


class Trainer:
    """One rank's share of the training: its rows, their margins and the growing model.

    The constructor performs the only collectives outside the tree loop (the MIN/MAX for the
    bin cuts), and only when no model is given (fresh start, version 0).
    """

    def __init__(
        self,
        params: Params,
        allreduce: AllreduceFn,
        ops: Ops,
        *,
        rank: int = 0,
        world: int = 1,
        model: Model | None = None,
    ) -> None:
        params.validate()
        self.params = params
        self.rank = rank
        self.world = world
        self.allreduce = allreduce
        self.ops = ops
        self.qbits = quant_bits(params.rows)
        start, stop = shard_range(params.rows, rank, world)
        x, self.y = make_rows(params.seed, _TRAIN_STREAM, start, stop, params.features)
        if model is None:
            model = self._fresh_model(x)
        elif model.get("format") != MODEL_FORMAT or model["bins"] != params.bins:
            raise ValueError("checkpointed model does not match the parameters")
        self.model = model
        self.binned = bin_matrix(x, model["lo"], model["hi"], params.bins)
        del x  # only the bins are needed from here on
        # The model is the only state: margins are a pure function of it.
        self.margin = predict_margin(model, self.binned)

    def _fresh_model(self, x: F64) -> Model:
        """Global cuts from MIN/MAX allreduces; an empty shard contributes +inf/-inf."""
        f = self.params.features
        lo = x.min(axis=0) if x.shape[0] else np.full(f, np.inf)
        hi = x.max(axis=0) if x.shape[0] else np.full(f, -np.inf)
        # Copies: the cuts go into the checkpointed model and must not alias a comm buffer.
        lo = np.array(self.allreduce(np.array(lo, dtype=np.float64), self.ops.min), copy=True)
        hi = np.array(self.allreduce(np.array(hi, dtype=np.float64), self.ops.max), copy=True)
        return Model(format=MODEL_FORMAT, lo=lo, hi=hi, bins=self.params.bins, trees=[])

    def gradients(self) -> tuple[F64, F64]:
        """Quantised logistic gradients and hessians of the local rows (see module doc)."""
        p = sigmoid(self.margin)
        g = quantise(p - self.y, self.qbits)
        h = quantise(p * (1.0 - p), self.qbits)
        return g, h

    def _allreduce_hist(self, nodes: list[int], grad: F64, hess: F64, pos: I32) -> F64:
        """ONE SUM allreduce of the histograms of ``nodes``, built lazily in ``prepare_fun``."""
        p = self.params
        buf = np.zeros((len(nodes), p.features, p.bins, 2))

        def prepare(out: NDArray[Any]) -> None:
            build_histograms(self.binned, grad, hess, pos, nodes, bins=p.bins, out=out)

        res = self.allreduce(buf, self.ops.sum, prepare)
        if res is not buf:
            # rabit2 reduces contiguous arrays in place and returns them; should an
            # implementation hand back another array (e.g. a replayed cached result), keep our
            # own copy, since parent histograms are held until the next level.
            buf[...] = res
        return buf

    def train_tree(self) -> Tree:
        """Grow one tree depth-wise, append it to the model and update the margins."""
        p = self.params
        grad, hess = self.gradients()
        n = self.binned.shape[0]
        pos = np.zeros(n, dtype=np.int32)

        feature: list[int] = [-1]
        split_bin: list[int] = [-1]
        left: list[int] = [-1]
        right: list[int] = [-1]
        sums: list[tuple[float, float]] = [(0.0, 0.0)]

        hists: dict[int, F64] = {}
        expand = [0]  # nodes of the current level that may split
        build = [0]  # nodes whose histogram is built explicitly at this level
        derive: list[tuple[int, int, int]] = []  # (node, parent, built sibling)
        depth = 0
        for level in range(p.depth):
            reduced = self._allreduce_hist(build, grad, hess, pos)
            for k, nid in enumerate(build):
                hists[nid] = reduced[k]
            for nid, parent, sibling in derive:
                # Exact: both are sums on the fixed-point grid.
                hists[nid] = hists[parent] - hists[sibling]
            for _nid, parent, _sibling in derive:
                hists.pop(parent, None)
            if level == 0:
                sums[0] = node_sums(hists[0])

            next_expand: list[int] = []
            build, derive = [], []
            split_at = np.full(len(feature) + 2 * len(expand), -1, dtype=np.int32)
            bin_at = np.zeros_like(split_at)
            left_at = np.zeros_like(split_at)
            for nid in expand:
                split = best_split(hists[nid], p)
                if split is None:
                    continue
                lid = len(feature)
                for child_sum in (split.left_sum, split.right_sum):
                    feature.append(-1)
                    split_bin.append(-1)
                    left.append(-1)
                    right.append(-1)
                    sums.append(child_sum)
                feature[nid], split_bin[nid] = split.feature, split.split_bin
                left[nid], right[nid] = lid, lid + 1
                split_at[nid], bin_at[nid], left_at[nid] = split.feature, split.split_bin, lid
                next_expand += [lid, lid + 1]
                # Build the child with the smaller hessian sum (the same decision on every
                # rank: the sums are global and exact), derive its sibling by subtraction.
                small, big = (
                    (lid, lid + 1) if split.left_sum[1] <= split.right_sum[1] else (lid + 1, lid)
                )
                build.append(small)
                derive.append((big, nid, small))
            keep = {parent for _, parent, _ in derive}
            for nid in expand:
                if nid not in keep:
                    hists.pop(nid, None)  # a leaf now: its histogram is no longer needed
            if not next_expand:
                break
            depth = level + 1
            self._route(pos, split_at, bin_at, left_at)
            expand = next_expand
            if level == p.depth - 1:
                break  # children at max depth become leaves: no more histograms

        value = np.zeros(len(feature))
        for nid, (g, h) in enumerate(sums):
            if feature[nid] < 0:
                value[nid] = leaf_weight(g, h, p)
        lo, hi = self.model["lo"], self.model["hi"]
        thr = np.array(
            [
                bin_threshold(float(lo[f]), float(hi[f]), p.bins, b) if f >= 0 else math.nan
                for f, b in zip(feature, split_bin, strict=True)
            ]
        )
        tree = Tree(
            feature=np.asarray(feature, dtype=np.int32),
            split_bin=np.asarray(split_bin, dtype=np.int32),
            left=np.asarray(left, dtype=np.int32),
            right=np.asarray(right, dtype=np.int32),
            value=value,
            threshold=thr,
            depth=depth,
        )
        # pos holds every row's leaf; this is the same addition predict_margin performs.
        self.margin += tree["value"][pos]
        self.model["trees"].append(tree)
        return tree

    def _route(self, pos: I32, split_at: I32, bin_at: I32, left_at: I32) -> None:
        """Move the local rows of the nodes split at this level to their children."""
        feat = split_at[pos]
        rows = np.flatnonzero(feat >= 0)
        if rows.size == 0:
            return
        at = pos[rows]
        go_left = self.binned[rows, feat[rows]] <= bin_at[at]
        pos[rows] = np.where(go_left, left_at[at], left_at[at] + 1)

    def metrics(self) -> Metrics:
        """Global (logloss, error rate) by one 3-double SUM allreduce."""
        loss = float(logloss_terms(self.margin, self.y).sum())
        wrong = float(np.count_nonzero((self.margin > 0) != (self.y > 0.5)))
        buf = np.array([loss, float(self.y.size), wrong])
        res = self.allreduce(buf, self.ops.sum)
        rows = int(res[1])
        return Metrics(
            logloss=float(res[0]) / max(rows, 1), error=float(res[2]) / max(rows, 1), rows=rows
        )

    def eval_digest(self) -> str:
        """Digest of the model's margins on the fixed evaluation set (same on every rank)."""
        p = self.params
        x, _ = make_rows(p.seed, _EVAL_STREAM, 0, p.eval_rows, p.features)
        binned = bin_matrix(x, self.model["lo"], self.model["hi"], p.bins)
        return margins_digest(predict_margin(self.model, binned))


def train(
    params: Params,
    allreduce: AllreduceFn,
    ops: Ops,
    *,
    rank: int = 0,
    world: int = 1,
    model: Model | None = None,
    on_tree: Callable[[int, Trainer], None] | None = None,
) -> Trainer:
    """Train trees ``len(model["trees"]) .. params.trees - 1`` on this rank's shard.

    Collectives: MIN and MAX of the cuts (only without ``model``), then per tree one histogram
    SUM allreduce per level. ``on_tree(t, trainer)`` runs after every tree on every rank
    (:func:`main` allreduces the metrics, prints and checkpoints there), so it may issue
    collectives too.
    """
    trainer = Trainer(params, allreduce, ops, rank=rank, world=world, model=model)
    for t in range(len(trainer.model["trees"]), params.trees):
        trainer.train_tree()
        if on_tree is not None:
            on_tree(t, trainer)
    return trainer


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


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


if __name__ == "__main__":
    sys.exit(main())
