"""How a rank makes each call: its descriptor (what every rank must agree on), the algorithm
(tree, ring or pair exchange) and the plan (:mod:`rabit2.core.schedule`) with the buffers it
works in.

Pure: the plan is built from the call, the rank's place in the job and its settings (a
broadcast whose size only its root knows is laid out when its first frame says the size).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from rabit2.core import schedule
from rabit2.core.framing import (
    MAX_BROADCAST,
    NONE_U8,
    NONE_U16,
    UNKNOWN_TOTAL,
    CallDescriptor,
    CollectiveKind,
    FrameHeader,
    data_prefix,
)
from rabit2.core.ops import dtype_code
from rabit2.core.records import ActiveCall, Call, Link
from rabit2.core.recovery.component import Recovery
from rabit2.core.recovery.store import fresh_buffer
from rabit2.core.schedule import (
    PairExchange,
    Plan,
    RingAllgather,
    RingAllreduce,
    TreeAllreduce,
    TreeBroadcast,
)
from rabit2.core.topology import broadcast_route, topology
from rabit2.errors import ProtocolError

AUTO_RING_MIN_BYTES = 512 * 1024
"""The default tree/ring threshold: the ring's 2(n - 1) dependent steps cost more than the
tree's extra bytes at the root (or, at world size 2, than the pair exchange's copy) up to
about here; measured in ``docs/performance.md`` ("Tree or ring")."""
PAIR_MAX_BYTES = 1 << 20
"""The default threshold at world size 2: the pair exchange up to here, the ring above.  The
pair moves the same bytes in one step instead of two and reduces twice as many; made express
(``docs/design.md``, "Express calls") it was 1.2-1.4x faster than the ring at 768 KiB-1 MiB,
and 1.06-1.2x slower at 2-4 MiB (``docs/performance.md``, "Tree or ring")."""
SCRATCH_RESERVE_FROM = 1 << 20
"""A link scratch this large or larger is allocated at the landing ring's size at least."""


def choose_allreduce(nbytes: int, itemsize: int, world: int,
                     ring_mincount: int | None, ring_min_bytes: int | None = None,
                     ) -> CollectiveKind:
    """Tree for small calls, ring above ``AUTO_RING_MIN_BYTES`` (``ring_min_bytes`` where
    that is set; ``PAIR_MAX_BYTES`` at world size 2), or above ``ring_mincount`` elements
    where that is set (rabit's ``rabit_reduce_ring_mincount``, which wins).

    At world size 2 the tree degenerates into a relay through rank 0; a direct exchange
    does the same work in one hop instead of two.
    """
    if world == 2:
        threshold = PAIR_MAX_BYTES
    else:
        threshold = AUTO_RING_MIN_BYTES if ring_min_bytes is None else ring_min_bytes
    if world > 1 and (nbytes > threshold if ring_mincount is None
                      else nbytes // itemsize > ring_mincount):
        return CollectiveKind.ALLREDUCE_RING
    if world == 2:
        return CollectiveKind.ALLREDUCE_PAIR
    return CollectiveKind.ALLREDUCE_TREE


class Owner(Protocol):
    """What planning reads of the agent that owns it."""

    rank: int
    world: int
    version: int
    seqno: int
    links: dict[int, Link]
    recovery: Recovery | None


class Planner:
    """Descriptors and plans for one agent's calls (loop thread only)."""

    def __init__(self, agent: Owner, ring_mincount: int | None, tree_chunk: int,
                 ring_min_bytes: int | None = None) -> None:
        self.agent = agent
        self.ring_mincount = ring_mincount  # ``rabit_reduce_ring_mincount``
        self.ring_min_bytes = ring_min_bytes  # ``rabit2_ring_min_bytes``
        self.tree_chunk = tree_chunk  # ``rabit_tree_reduce_minsize``
        self._descriptors: dict[tuple[Any, ...], CallDescriptor] = {}

    def descriptor(self, call: Call) -> CallDescriptor:
        key = None
        if call.receive is None and not call.pieces:
            # a training loop repeats a few shapes: reuse their descriptors
            key = (call.kind, call.dtype, call.op, call.root, len(call.buf))
            desc = self._descriptors.get(key)
            if desc is not None:
                return desc
        dtype = dtype_code(call.dtype) if call.dtype is not None else NONE_U8
        op = int(call.op) if call.op is not None else NONE_U8
        root = call.root if call.kind is CollectiveKind.BROADCAST else NONE_U16
        if call.receive is not None:
            total = UNKNOWN_TOTAL
        elif call.pieces:
            total = sum(len(p) for p in call.pieces)
        else:
            total = len(call.buf)
        desc = CallDescriptor(call.kind, dtype, op, root, total)
        if key is not None:
            if len(self._descriptors) >= 64:
                self._descriptors.clear()
            self._descriptors[key] = desc
        return desc

    def choose_allreduce(self, nbytes: int, itemsize: int) -> CollectiveKind:
        return choose_allreduce(nbytes, itemsize, self.agent.world, self.ring_mincount,
                                self.ring_min_bytes)

    def plan(self, call: Call) -> Plan:
        """The schedule of ``call`` on this rank.  Raises ValueError for a call that cannot
        be made here."""
        kind, rank, world = call.kind, self.agent.rank, self.agent.world
        recovery = self.agent.recovery
        if world == 1:
            return TreeBroadcast([call.buf], -1, ())  # no links: every call is already complete
        if kind in (CollectiveKind.ALLREDUCE_TREE, CollectiveKind.ALLREDUCE_RING,
                    CollectiveKind.ALLREDUCE_PAIR):
            assert call.dtype is not None and call.op is not None
            if kind is CollectiveKind.ALLREDUCE_PAIR:
                if world != 2:
                    raise ValueError("the pair exchange needs a world of exactly 2")
                # the result is made in the buffer that is then retained
                keep = (recovery.pair_keep(len(call.buf), (self.agent.version, self.agent.seqno))
                        if recovery is not None else None)
                return PairExchange(call.buf, call.dtype, call.op, rank, 1 - rank,
                                    self._scratch, self._send_scratch, keep)
            if kind is CollectiveKind.ALLREDUCE_RING:
                # the plan fills the buffer that is then retained as it makes the result
                keep = (recovery.ring_keep(len(call.buf), (self.agent.version, self.agent.seqno))
                        if recovery is not None else None)
                return RingAllreduce(call.buf, call.dtype, call.op, rank, world, self._scratch,
                                     keep)
            topo = topology(rank, world)
            # with recovery on, the root's children stage its result (docs/recovery.md)
            return TreeAllreduce(call.buf, call.dtype, call.op, topo.parent, topo.children,
                                 self._scratch, self.tree_chunk,
                                 stage_down=recovery is not None and topo.parent == 0)
        if kind is CollectiveKind.BROADCAST:
            in_link, out_links = broadcast_route(rank, call.root, world)
            if call.receive is not None and in_link < 0:
                raise ValueError("the root of a broadcast must know what it sends")
            return TreeBroadcast(list(call.pieces) or [call.buf], in_link, out_links,
                                 call.receive, call.head_size)
        return RingAllgather(call.buf, call.blocks, rank, world)

    def size_broadcast(self, plan: TreeBroadcast, frame: FrameHeader, active: ActiveCall) -> None:
        """The first frame from the root's side says how large the broadcast is."""
        if frame.call.root != active.desc.root or frame.call.kind is not active.desc.kind:
            return  # the descriptor check reports the mismatch (ranks that name other roots)
        total = frame.call.total_bytes
        if total == UNKNOWN_TOTAL or total > MAX_BROADCAST:
            raise ProtocolError(f"broadcast size {total} from the wire is out of bounds")
        self.size_to(plan, total, active)

    def size_to(self, plan: TreeBroadcast, total: int, active: ActiveCall) -> None:
        """A broadcast of unknown size learned its size: lay out its streams."""
        try:
            plan.size(total)
        except (ValueError, TypeError, MemoryError) as exc:
            raise ProtocolError(f"broadcast of {total} B: {exc}") from None
        desc = active.desc  # (dataclasses.replace costs several microseconds here)
        active.desc = CallDescriptor(desc.kind, desc.dtype_code, desc.op_code, desc.root, total)
        active.prefix = data_prefix(active.desc, *active.call_id, False)
        active.prefix_checked = data_prefix(active.desc, *active.call_id, True)
        recovery = self.agent.recovery
        if recovery is not None and plan.in_link >= 0:
            recovery.start_mirror(active, plan)
        for peer in plan.out_streams:
            active.sent.setdefault(peer, 0)
        deferred, active.deferred = active.deferred, {}
        for peer, (offset, seen) in deferred.items():
            assert recovery is not None  # (needs are deferred only with recovery on)
            recovery.needs.apply(active, peer, offset, seen=seen)

    def _scratch(self, peer: int, nbytes: int) -> memoryview:
        """The link's scratch.  Once a call needs 1 MiB or more of it, it is allocated at the
        landing ring's size at least, in ordinary pages (``fresh_buffer``): its pages are
        touched only as calls use them, and the calls of a GBDT tree's growing levels do not
        each fault in a fresh, larger buffer (``docs/performance.md``, "Landing ring").  Smaller
        ones come from the allocator, which may hand back memory the process already
        touched."""
        link = self.agent.links[peer]
        if link.scratch.nbytes < nbytes:
            link.scratch = fresh_buffer(
                nbytes if nbytes < SCRATCH_RESERVE_FROM else max(nbytes, schedule.LANDING_RING))
        return link.scratch.data[:nbytes]

    def _send_scratch(self, peer: int, nbytes: int) -> memoryview:
        link = self.agent.links[peer]
        if link.send_scratch.nbytes < nbytes:
            link.send_scratch = np.empty(nbytes, dtype=np.uint8)
        return link.send_scratch.data[:nbytes]

