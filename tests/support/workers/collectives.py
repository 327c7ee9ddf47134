"""Worker program for the integration tests: every collective, checked against closed forms.

Run under ``rabit2-submit``; prints ``OK rank=<r> world=<n>`` on success and exits non-zero
(with the assertion) on any wrong byte.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np

import rabit2
from rabit2.core.ops import SUPPORTED_DTYPES

rabit2.init(sys.argv[1:])
rank, world = rabit2.get_rank(), rabit2.get_world_size()
assert rabit2.is_distributed() == (world > 1 or "DMLC_TRACKER_URI" in os.environ)
version, model = rabit2.load_checkpoint()
assert (version, model) == (0, None)

# the peer links use the congestion control the worker was configured with (default: reno
# where this process may set it; docs/design.md, "Congestion control"); checked before any
# call, while no neighbour can have finished and closed its link
engine = rabit2.api._comm.engine
if world > 1 and hasattr(socket, "TCP_CONGESTION"):
    from rabit2.io.handshake import resolve_congestion

    expected = resolve_congestion(engine.config.tcp_congestion)
    for peer, link in engine.links.items():
        sock = link.transport.get_extra_info("socket")
        used = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        used = used.rstrip(b"\0").decode()
        assert expected is None or used == expected, (peer, used, expected)
        print(f"rank {rank} link {peer} congestion {used}", flush=True)


def contribution(count: int, dtype: np.dtype, r: int) -> np.ndarray:
    return ((np.arange(count) * 7 + r * 3) % 11 + 1).astype(dtype)


# every dtype, SUM/MAX/MIN, sizes around the world size and across the tree/ring threshold
# (512 KiB: 140 000 elements of 4 and 8 bytes take the ring, 600 000 of every size; 2 MiB
# where the launcher pins workers beside others: 600 000 of 4 and 8 bytes)
for dtype in SUPPORTED_DTYPES:
    for count in sorted({0, 1, world - 1, world, world + 1, 100, 40_000, 140_000, 600_000}):
        inputs = [contribution(count, dtype, r) for r in range(world)]
        for op, ref in ((rabit2.SUM, np.add), (rabit2.MAX, np.maximum), (rabit2.MIN, np.minimum)):
            if dtype.itemsize == 1 and op == rabit2.SUM:
                continue  # wraps; covered by the unit tests
            expect = inputs[0].copy()
            for other in inputs[1:]:
                ref(expect, other, out=expect)
            mine = inputs[rank].copy()
            out = rabit2.allreduce(mine, op)
            assert out is mine, "contiguous arrays are reduced in place"
            assert out.dtype == dtype
            if dtype.kind == "f" and op == rabit2.SUM:
                assert np.allclose(out, expect), (dtype, count)
            else:
                assert out.tobytes() == expect.tobytes(), (dtype, count, op)

# bit-identical float results on every rank: gather them and compare bytes
x = np.random.default_rng(rank).standard_normal(50_001)
rabit2.allreduce(x, rabit2.SUM)
digests = rabit2.allgather(np.frombuffer(__import__("hashlib").sha256(x.tobytes()).digest(),
                                         dtype=np.uint8).reshape(1, 32))
assert all((digests[r] == digests[0]).all() for r in range(world)), "ranks disagree"

# non-contiguous and multi-dimensional input
m = np.arange(24, dtype=np.int64).reshape(4, 6) * (rank + 1)
view = m[:, ::2]
out = rabit2.allreduce(view, rabit2.SUM)
assert out.shape == (4, 3)
assert (view == np.arange(24).reshape(4, 6)[:, ::2] * world * (world + 1) // 2).all()

# prepare_fun is called before the data is used
def prepare(a: np.ndarray) -> None:
    a[:] = rank

p = np.zeros(5, dtype=np.int32)
rabit2.allreduce(p, rabit2.SUM, prepare_fun=prepare)
assert (p == world * (world - 1) // 2).all()

# broadcast from every root: arrays (raw bytes, into a given buffer too) and objects
for root in range(world):
    arr = rabit2.broadcast(np.arange(1000.0) * root if rank == root else None, root)
    assert (arr == np.arange(1000.0) * root).all()
    into = np.empty((10, 3), dtype=np.float32)
    got = rabit2.broadcast(np.full((10, 3), root, np.float32) if rank == root else into, root)
    assert (got == root).all() and (rank == root or got is into)
    obj = rabit2.broadcast({"root": root, "blob": b"x" * 70_000} if rank == root else None, root)
    assert obj == {"root": root, "blob": b"x" * 70_000}
big = rabit2.broadcast(np.arange(3_000_000, dtype=np.int32) if rank == 0 else None, 0)
assert (big == np.arange(3_000_000, dtype=np.int32)).all()

# allgather with different row counts per rank
g = rabit2.allgather(np.full((rank + 1, 3), rank, dtype=np.int16))
assert g.shape == (world * (world + 1) // 2, 3)
assert (g[:, 0] == np.repeat(np.arange(world), np.arange(1, world + 1))).all()
# empty arrays of more than one dimension, and a rank that gathers no rows
for shape in ((0, 3), (3, 0), (2, 0, 4)):
    e = np.empty(shape, dtype=np.float32)
    assert rabit2.allreduce(e, rabit2.SUM).shape == shape
    got = rabit2.broadcast(np.empty(shape, np.float32) if rank == 0 else None, 0)
    assert got.shape == shape and got.dtype == np.float32
g = rabit2.allgather(np.full((2, 3), rank, np.int32) if rank % 2 == 0
                     else np.empty((0, 3), np.int32))
assert g.shape == (2 * ((world + 1) // 2), 3)
assert (g[::2, 0] == np.arange(0, world, 2)).all()
assert rabit2.allgather(np.empty((0, 5), np.uint8)).shape == (0, 5)
assert rabit2.agree(True) is True
assert rabit2.agree(rank != world - 1) is (world == 0)

# checkpoints: versions count up, call numbering restarts
rabit2.checkpoint({"it": 1}, local_model=[rank])
assert rabit2.version_number() == 1
rabit2.lazy_checkpoint({"it": 2})
assert rabit2.load_checkpoint() == (2, {"it": 2})
total = rabit2.allreduce(np.array([rank], dtype=np.int64), rabit2.SUM)
assert total[0] == world * (world - 1) // 2

rabit2.tracker_print(f"rank {rank} passed")
rabit2.finalize()
print(f"OK rank={rank} world={world}", flush=True)
