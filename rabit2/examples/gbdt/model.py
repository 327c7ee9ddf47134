"""The model: its trees, the checkpointed state, and the margins and digest computed from it."""

from __future__ import annotations

import hashlib
from typing import TypedDict

import numpy as np
from numpy.typing import NDArray

from .data import F64, BinMatrix

MODEL_FORMAT = "rabit2-gbdt-1"


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
