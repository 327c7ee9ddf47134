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

Modules
-------
``params`` the parameters and presets; ``data`` the synthetic rows and their bins;
``histograms`` the exact histograms and the split search; ``model`` the trees, the checkpointed
model and its digest; ``allreduce`` the collective the trainer is handed and its timing;
``trainer`` the tree growth and the training loop; ``cli`` (run by ``__main__``) the command
line and the checkpointed run.
"""

from .allreduce import AllreduceFn, Ops, TimedAllreduce
from .cli import Options, main, parse_args
from .data import (
    BLOCK_ROWS,
    bin_matrix,
    bin_threshold,
    logloss_terms,
    make_rows,
    shard_range,
    sigmoid,
    true_logit,
)
from .histograms import (
    Split,
    best_split,
    build_histograms,
    leaf_weight,
    node_sums,
    quant_bits,
    quantise,
)
from .model import MODEL_FORMAT, Model, Tree, margins_digest, predict_margin, predict_tree
from .params import PRESETS, Params
from .trainer import Metrics, Trainer, train

__all__ = [
    "BLOCK_ROWS",
    "MODEL_FORMAT",
    "PRESETS",
    "AllreduceFn",
    "Metrics",
    "Model",
    "Ops",
    "Options",
    "Params",
    "Split",
    "TimedAllreduce",
    "Trainer",
    "Tree",
    "best_split",
    "bin_matrix",
    "bin_threshold",
    "build_histograms",
    "leaf_weight",
    "logloss_terms",
    "main",
    "make_rows",
    "margins_digest",
    "node_sums",
    "parse_args",
    "predict_margin",
    "predict_tree",
    "quant_bits",
    "quantise",
    "shard_range",
    "sigmoid",
    "train",
    "true_logit",
]
