"""mpi4py over Open MPI, launched with ``mpirun`` on loopback.

Two configurations: ``mpi-shm`` (Open MPI's defaults: shared memory between the ranks of one
host) and ``mpi-tcp`` (``--mca btl tcp,self --mca pml ob1``: every byte goes through loopback TCP).
"""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
from common import MAIN_PYTHON, Job, harness_cmd, probe, setup_failure

LABELS = ["mpi-shm", "mpi-tcp"]


def unavailable(label: str) -> str | None:
    """``mpirun`` on PATH and mpi4py importable (``setup.sh mpi``)."""
    failed = setup_failure("mpi")
    if failed:
        return failed
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin)"
    return probe(MAIN_PYTHON, "from mpi4py import MPI")


def job(label: str, n: int, harness_args: list[str]) -> Job:
    """``mpirun --allow-run-as-root --oversubscribe -np N`` restricted to ``lo``."""
    argv = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(n),
        "--mca",
        "btl_tcp_if_include",
        "lo",
        "--mca",
        "oob_tcp_if_include",
        "lo",
    ]
    if label == "mpi-tcp":
        argv += ["--mca", "btl", "tcp,self", "--mca", "pml", "ob1"]
    return Job([*argv, *harness_cmd(MAIN_PYTHON, label, harness_args)])


class MpiComm:
    """``Allreduce(IN_PLACE)`` / ``Bcast`` on the numpy buffers (no pickling)."""

    def __init__(self) -> None:
        import mpi4py  # noqa: PLC0415 -- worker side only
        from mpi4py import MPI  # noqa: PLC0415

        self._mpi: Any = MPI
        self._comm: Any = MPI.COMM_WORLD
        self.rank = int(self._comm.Get_rank())
        self.world = int(self._comm.Get_size())
        lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        self.version = f"mpi4py {mpi4py.__version__}, {lib}"

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """In-place SUM allreduce."""
        self._comm.Allreduce(self._mpi.IN_PLACE, a, op=self._mpi.SUM)
        return a

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        """In-place broadcast."""
        self._comm.Bcast(a, root=root)
        return a

    def barrier(self, one: np.ndarray) -> None:
        """1-element SUM allreduce."""
        self._comm.Allreduce(self._mpi.IN_PLACE, one, op=self._mpi.SUM)

    def finalize(self) -> None:
        """MPI_Finalize runs at exit (mpi4py's default)."""


def make_comm(label: str) -> MpiComm:
    """Worker side."""
    return MpiComm()
