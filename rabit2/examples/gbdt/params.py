"""The learner's parameters and the ``--size`` presets."""

from __future__ import annotations

from dataclasses import dataclass


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
