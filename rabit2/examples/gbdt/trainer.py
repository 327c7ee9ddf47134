"""One rank's share of the training: the depth-wise tree growth over the histogram allreduces,
the metrics, and the training loop over trees."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .allreduce import AllreduceFn, Ops
from .data import (
    EVAL_STREAM,
    F64,
    I32,
    TRAIN_STREAM,
    bin_matrix,
    bin_threshold,
    logloss_terms,
    make_rows,
    shard_range,
    sigmoid,
)
from .histograms import best_split, build_histograms, leaf_weight, node_sums, quant_bits, quantise
from .model import MODEL_FORMAT, Model, Tree, margins_digest, predict_margin
from .params import Params


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
        x, self.y = make_rows(params.seed, TRAIN_STREAM, start, stop, params.features)
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
        """Quantised logistic gradients and hessians of the local rows (see the package doc)."""
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
        x, _ = make_rows(p.seed, EVAL_STREAM, 0, p.eval_rows, p.features)
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
    (:func:`.cli.main` allreduces the metrics, prints and checkpoints there), so it may issue
    collectives too.
    """
    trainer = Trainer(params, allreduce, ops, rank=rank, world=world, model=model)
    for t in range(len(trainer.model["trees"]), params.trees):
        trainer.train_tree()
        if on_tree is not None:
            on_tree(t, trainer)
    return trainer
