"""Runnable example programs for rabit2.

- :mod:`rabit2.examples.gbdt` -- a distributed, fault-tolerant histogram gradient-boosted tree
  learner (the XGBoost ``hist`` allreduce pattern), run as ``python -m rabit2.examples.gbdt``.
"""
