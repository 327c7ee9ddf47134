"""The same program through ``xgboost.collective`` (``xgboost``: XGBoost's own tracker, its
arguments as JSON in XGB_TRACKER_ARGS) or ``rabit2.collective`` (``rabit2``: under
rabit2-submit).  Prints what every call returned, and the inputs afterwards, as one JSON line
per rank, so that a test can set the two side by side."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np


def main() -> None:
    if sys.argv[1] == "xgboost":
        from xgboost import collective  # noqa: PLC0415

        args = json.loads(os.environ["XGB_TRACKER_ARGS"])
    else:
        from rabit2 import collective  # noqa: PLC0415

        args = {}
    # before init: one worker, whose collectives give back what they were given
    alone = {"sum": collective.allreduce(np.arange(3, dtype=np.float64), collective.Op.SUM
                                         ).tolist(),
             "bcast": collective.broadcast({"x": 1}, 0),
             "config": collective.Config(retry=2, timeout=60).get_comm_config({"k": 1})}
    with collective.CommunicatorContext(**args):
        rank, world = collective.get_rank(), collective.get_world_size()
        out: dict[str, np.ndarray] = {}
        a = (np.arange(12, dtype=np.float64).reshape(3, 4) + 0.25) * (rank + 1)
        out["sum"] = collective.allreduce(a, collective.Op.SUM)
        out["max"] = collective.allreduce(a, collective.Op.MAX)  # the same input again
        out["min"] = collective.allreduce(a, collective.Op.MIN)
        b = np.array([[rank + 1, 6], [12, 255]], dtype=np.int32)
        for name in ("BITWISE_AND", "BITWISE_OR", "BITWISE_XOR"):
            out[name] = collective.allreduce(b, getattr(collective.Op, name))
        u = np.array([[1, 2], [3, 4]], dtype=np.uint8) * (rank + 1)
        out["u8"] = collective.allreduce(u, collective.Op.SUM)
        f = np.linspace(0, 1, 7, dtype=np.float32)[::2] * (rank + 1)  # not contiguous
        out["f32"] = collective.allreduce(f, collective.Op.SUM)
        obj = collective.broadcast({"from": rank, "list": [1, 2]} if rank == 0 else None, 0)
        own = np.zeros(3)  # (a non-root's own array: left as it is, or overwritten?)
        got = collective.broadcast(np.arange(3.0) if rank == 0 else own, 0)
        # (subclasses: each rank's mask stays its own, the data is reduced)
        mk = collective.allreduce(np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, rank % 2, 0]),
                                  collective.Op.SUM)
        mx = collective.allreduce(np.matrix([[1.0, 2.0]]) * (rank + 1), collective.Op.MAX)
        masked = collective.broadcast(
            np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0]) if rank == 0 else None, 0)
        report: dict[str, Any] = {
            name: {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.tolist()}
            for name, v in out.items()
        }
        report.update(alone=alone, own_after=own.tolist(), got=got.tolist(),
                      got_is_own=got is own, masked=[type(masked).__name__,
                                                     np.ma.getmaskarray(masked).tolist(),
                                                     np.ma.filled(masked, -1.0).tolist()])
        report.update(sub_masked=[type(mk).__name__, np.ma.getmaskarray(mk).tolist(),
                                  np.ma.getdata(mk).tolist()],
                      sub_matrix=[type(mx).__name__, np.asarray(mx).tolist()])
        report.update(a_after=a.tolist(), b_after=b.tolist(), f_after=f.tolist(), bcast=obj,
                      is_distributed=[type(collective.is_distributed()).__name__,
                                      collective.is_distributed()],
                      processor_name=type(collective.get_processor_name()).__name__)
        line = json.dumps({"rank": rank, "world": world, "report": report}, sort_keys=True)
        print("SEMANTICS " + line, flush=True)


if __name__ == "__main__":
    main()
