"""Exact histograms and the splits chosen from them (pure functions, no communication).

Gradients are quantised to a fixed-point grid so that every histogram sum is exact whatever
the order of the additions (see the package documentation); the split search then reads the
same reduced bytes on every rank and picks the same split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .data import F64, I32, BinMatrix
from .params import Params


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
