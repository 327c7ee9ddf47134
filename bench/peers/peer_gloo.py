"""torch.distributed with the gloo backend (CPU), launched with ``torchrun`` on loopback."""

from __future__ import annotations

from typing import Any

import numpy as np
from common import LOOPBACK, MAIN_PYTHON, Job, free_port, harness_cmd, probe, setup_failure

LABELS = ["gloo"]
TORCH_VERSION = "2.13.0"


def unavailable(label: str) -> str | None:
    """torch 2.13.0 with gloo must import in the driver's Python (``setup.sh gloo``)."""
    return setup_failure("gloo") or probe(
        MAIN_PYTHON,
        "import torch, torch.distributed as d; "
        f"v = torch.__version__.split('+')[0]; assert v == '{TORCH_VERSION}', 'torch ' + v; "
        "assert d.is_gloo_available(), 'gloo not built'",
    )


def job(label: str, n: int, harness_args: list[str]) -> Job:
    """``torchrun --nproc-per-node N`` with a static rendezvous on 127.0.0.1."""
    argv = [
        MAIN_PYTHON,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(n),
        "--master-addr",
        LOOPBACK,
        "--master-port",
        str(free_port()),
        *harness_cmd("", label, harness_args)[1:],  # torchrun adds the Python itself
    ]
    return Job(argv, {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})


class GlooComm:
    """``dist.all_reduce`` / ``dist.broadcast`` on tensors sharing the numpy buffers."""

    def __init__(self) -> None:
        import torch  # noqa: PLC0415 -- worker side only
        import torch.distributed as dist  # noqa: PLC0415

        self._torch: Any = torch
        self._dist: Any = dist
        dist.init_process_group("gloo")
        self.rank = int(dist.get_rank())
        self.world = int(dist.get_world_size())
        self.version = f"torch {torch.__version__} gloo"
        self._sum = dist.ReduceOp.SUM

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """In place: the tensor is a view of ``a``."""
        self._dist.all_reduce(self._torch.from_numpy(a), op=self._sum)
        return a

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        """In place into ``a`` on non-roots."""
        self._dist.broadcast(self._torch.from_numpy(a), src=root)
        return a

    def barrier(self, one: np.ndarray) -> None:
        """1-element SUM allreduce."""
        self._dist.all_reduce(self._torch.from_numpy(one), op=self._sum)

    def finalize(self) -> None:
        """Destroy the process group."""
        self._dist.destroy_process_group()


def make_comm(label: str) -> GlooComm:
    """Worker side."""
    return GlooComm()
