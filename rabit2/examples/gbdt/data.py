"""The synthetic data set: every rank's shard of rows, the labels' function, and the bins.

Every rank generates the same rows from the seed and keeps only its own contiguous block; the
evaluation set is a separate stream every rank generates whole.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
I32 = NDArray[np.int32]
BinMatrix = NDArray[np.uint8] | NDArray[np.uint16]

#: Rows are generated in blocks of this many, each from its own seed, so a rank can produce
#: exactly its shard and row ``i`` is identical for every world size.
BLOCK_ROWS = 4096

#: Streams of the generator: training rows and the evaluation set are independent.
TRAIN_STREAM = 1
EVAL_STREAM = 2


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
