"""rabit2 itself, launched with ``rabit2-submit --cluster local``: ``rabit2`` with its default
options (fault tolerance on: results are kept for replays until the job outgrows the 256 MiB
replay store; never checkpointing, it then keeps nothing more), ``rabit2-ckpt`` the same
with a checkpoint after every iteration (untimed), as a training loop takes one per round,
so the replay store holds at most two checkpoints' results and recycles their buffers
instead of growing to ``rabit2_replay_mb`` with fresh memory, and ``rabit2-noft`` with
fault tolerance off (``RABIT2_RECOVER=0``, like the peers, none of which recovers a lost
worker)."""

from __future__ import annotations

import os
import shutil
from typing import Any, cast

import numpy as np
from common import HERE, MAIN_PYTHON, Job, harness_cmd, probe

LABELS = ["rabit2", "rabit2-ckpt", "rabit2-noft"]


def unavailable(label: str) -> str | None:
    """rabit2 must import in the driver's Python."""
    return probe(MAIN_PYTHON, "import rabit2, tracker.submit")


def job(label: str, n: int, harness_args: list[str]) -> Job:
    """``rabit2-submit --cluster local -n N -- python harness.py ...`` (default options)."""
    exe = shutil.which("rabit2-submit")
    submit = [exe] if exe else [MAIN_PYTHON, "-m", "tracker.submit"]
    return Job(
        [
            *submit,
            "--cluster",
            "local",
            "-n",
            str(n),
            *(["--env", "RABIT2_RECOVER=0"] if label == "rabit2-noft" else []),
            "--",
            *harness_cmd(MAIN_PYTHON, label, harness_args),
        ],
        # this checkout's rabit2 (and launcher), whatever copy pip installed: harness.py
        # would otherwise find the installed one first
        {"PYTHONPATH": os.pathsep.join(
            p for p in (str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")) if p)},
    )


class Rabit2Comm:
    """rabit2's public API: raw-bytes allreduce/broadcast of numpy arrays."""

    def __init__(self, label: str) -> None:
        import rabit2  # noqa: PLC0415 -- worker side only

        self._r: Any = rabit2
        rabit2.init([])
        self.rank = int(rabit2.get_rank())
        self.world = int(rabit2.get_world_size())
        self.version = f"rabit2 {rabit2.__version__}"
        if label == "rabit2-ckpt":
            self.between_iterations = self._checkpoint

    def _checkpoint(self) -> None:
        """An empty model: the cost measured is the replay store's, not pickling."""
        self._r.checkpoint(None)

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """In-place SUM allreduce (returns the result array)."""
        return cast(np.ndarray, self._r.allreduce(a, self._r.Op.SUM))

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        """Raw-bytes broadcast; non-roots receive into ``a``."""
        return cast(np.ndarray, self._r.broadcast(a, root))

    def barrier(self, one: np.ndarray) -> None:
        """1-element SUM allreduce."""
        self._r.allreduce(one, self._r.Op.SUM)

    def finalize(self) -> None:
        """Leave the job."""
        self._r.finalize()


def make_comm(label: str) -> Rabit2Comm:
    """Worker side."""
    return Rabit2Comm(label)
