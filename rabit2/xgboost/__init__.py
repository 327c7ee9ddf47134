"""XGBoost on rabit2: ``xgboost.train`` whose collectives run through rabit2, with recovery.

::

    import rabit2.xgboost as rx
    with rx.CommunicatorContext():
        dtrain = xgboost.DMatrix(X, y)
        booster = rx.train(params, dtrain, num_boost_round=100)

launched by ``rabit2-submit --cluster local -n 4 -- python train.py``.  XGBoost (3.x, with
its federated communicator compiled in, as in the ``xgboost`` wheel on PyPI) sends each
collective to an endpoint this worker serves on loopback; rabit2 executes it across the
job.  ``rx.train`` checkpoints the training every round, so a worker lost mid-training is
restarted by the launcher and rejoins with a bit-identical model.  See ``docs/xgboost.md``.

Needs the ``xgboost`` extra: ``pip install "rabit2[xgboost]"``.
"""

from __future__ import annotations

try:
    import xgboost as _xgboost  # noqa: F401 (only whether it is there)
except ModuleNotFoundError as _missing:
    if _missing.name != "xgboost":
        raise
    raise ModuleNotFoundError(
        "rabit2.xgboost needs XGBoost 3.0-3.2: pip install 'rabit2[xgboost]' (in a checkout: "
        "pip install '.[xgboost]')", name="xgboost") from _missing

from rabit2.xgboost.context import CommunicatorContext
from rabit2.xgboost.training import TrainingState, train

__all__ = ["CommunicatorContext", "TrainingState", "train"]
