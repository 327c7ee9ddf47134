"""Tree and ring maps, identical to the classic rabit tracker's, plus broadcast routing.

Everything here is a pure function of ``(rank, world_size)`` (and ``root`` for broadcast):
no sockets, no clock, stdlib only. The maps are what the tracker sends a worker in a
``start``/``recover`` reply, so they must match the reference tracker (dmlc-core
``RabitTracker.get_link_map``) exactly for real rabit / XGBoost 1.x-2.0 workers to agree
with us. The construction, in three steps (see ``docs/topology.md``):

1. A binary heap over *provisional* ids ``0..n-1``: parent ``(i-1)//2``, children
   ``2i+1``, ``2i+2``.
2. A ring that reuses tree edges: a DFS from the root that emits each node, then its
   children's subtrees in visiting order, the **last** child's subtree reversed.
   The reference visits the children through a Python ``set``; CPython iterates
   ``{2i+1, 2i+2}`` in ascending order *except* when ``2i+1 % 8 == 7``, where the
   second element lands in hash slot 0 and so comes first. We reproduce that quirk
   explicitly instead of relying on set iteration order.
3. Relabel: the k-th id emitted by the DFS becomes final rank k. The ring is then simply
   ``k-1 -> k -> k+1 (mod n)`` and rank 0 is the tree root.

Ring allreduce relies on ``ring_next == rank + 1`` (mod n), which step 3 guarantees.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

__all__ = [
    "Topology",
    "broadcast_route",
    "topology",
    "tree_maps",
]

# Cache sizes: one entry per world size is tiny; broadcast routes are O(n) each and there
# are n possible roots per world size, so bound that cache to keep memory predictable.
_TREE_CACHE_SIZE = 64
_ROUTE_CACHE_SIZE = 128


@dataclass(frozen=True, slots=True)
class Topology:
    """One rank's view of the overlay: its tree links and its ring links.

    ``parent`` is -1 for the root (rank 0). ``children`` are ascending final ranks (the
    reference tracker sends tree neighbours as an unordered set, so order carries no
    meaning on the wire). ``ring_prev``/``ring_next`` equal ``rank`` when
    ``world_size == 1``.
    """

    rank: int
    world_size: int
    parent: int
    children: tuple[int, ...]
    ring_prev: int
    ring_next: int

    @property
    def tree_neighbors(self) -> tuple[int, ...]:
        """Parent (if any) and children, sorted ascending."""
        if self.parent < 0:
            return self.children
        return tuple(sorted((self.parent, *self.children)))

    @property
    def neighbors(self) -> tuple[int, ...]:
        """Every peer this rank must hold a link to: tree neighbours and ring prev/next.

        Sorted, distinct, never containing ``rank`` itself (empty when ``world_size == 1``).
        """
        peers = {*self.tree_neighbors, self.ring_prev, self.ring_next}
        peers.discard(self.rank)
        return tuple(sorted(peers))


def _check_world_size(world_size: object) -> int:
    """Normalise ``world_size`` to an int >= 1 (TypeError / ValueError otherwise)."""
    if isinstance(world_size, bool):
        raise TypeError("world_size must be an int, not bool")
    size = operator.index(world_size)  # type: ignore[arg-type]  # raises TypeError itself
    if size < 1:
        raise ValueError(f"world_size must be >= 1, got {size}")
    return size


def _check_rank(rank: object, world_size: int, what: str = "rank") -> int:
    """Normalise ``rank`` to an int in ``[0, world_size)`` (TypeError / ValueError otherwise)."""
    if isinstance(rank, bool):
        raise TypeError(f"{what} must be an int, not bool")
    value = operator.index(rank)  # type: ignore[arg-type]
    if not 0 <= value < world_size:
        raise ValueError(f"{what} must be in [0, {world_size}), got {value}")
    return value


def _heap_children_in_visit_order(node: int, world_size: int) -> tuple[int, ...]:
    """Heap children of provisional id ``node`` in the order the reference tracker visits them.

    The reference iterates ``set(children)``. For two small ints ``a, a+1`` in an 8-slot
    CPython set table, ``a`` sits in slot ``a % 8`` and ``a+1`` in slot ``(a+1) % 8``; that
    is ascending unless ``a % 8 == 7``, where ``a+1`` wraps to slot 0 and is iterated first.
    """
    first, second = 2 * node + 1, 2 * node + 2
    if second < world_size:
        return (second, first) if first % 8 == 7 else (first, second)
    if first < world_size:
        return (first,)
    return ()


def _provisional_to_rank(world_size: int) -> list[int]:
    """Map provisional heap id -> final rank (the position of that id in the DFS ring walk).

    Instead of building the walk as nested, partially reversed lists (the reference recurses),
    we place each subtree into its contiguous block of final ranks directly. A subtree laid
    out *forwards* over ``[lo, hi)`` puts its root at ``lo`` and its children's blocks after
    it in visiting order, the last one reversed. A *reversed* layout is the mirror image of
    the forward one, so its root goes to ``hi - 1``, each child's block is mirrored within
    ``[lo, hi)`` and every child's direction flips. Iterative with an explicit stack: no
    recursion limit, O(n).
    """
    subtree_size = [1] * world_size
    # Heap children always have larger ids than their parent, so one descending pass works.
    for node in range(world_size - 1, 0, -1):
        subtree_size[(node - 1) // 2] += subtree_size[node]

    rank_of = [0] * world_size
    stack: list[tuple[int, int, bool]] = [(0, 0, False)]  # (node, block start, reversed?)
    while stack:
        node, lo, is_reversed = stack.pop()
        hi = lo + subtree_size[node]
        rank_of[node] = hi - 1 if is_reversed else lo
        children = _heap_children_in_visit_order(node, world_size)
        cursor = lo + 1  # forward layout: the node itself occupies lo
        for index, child in enumerate(children):
            size = subtree_size[child]
            child_reversed = index == len(children) - 1  # the last child's subtree is reversed
            start = cursor
            if is_reversed:
                # Mirror [start, start+size) within [lo, hi) and flip the direction.
                start = lo + hi - (cursor + size)
                child_reversed = not child_reversed
            stack.append((child, start, child_reversed))
            cursor += size
    return rank_of


@functools.lru_cache(maxsize=_TREE_CACHE_SIZE)
def _tree_maps_cached(world_size: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    rank_of = _provisional_to_rank(world_size)
    parents = [-1] * world_size
    children: list[list[int]] = [[] for _ in range(world_size)]
    for node in range(1, world_size):
        child_rank, parent_rank = rank_of[node], rank_of[(node - 1) // 2]
        parents[child_rank] = parent_rank
        children[parent_rank].append(child_rank)
    return tuple(parents), tuple(tuple(sorted(kids)) for kids in children)


def tree_maps(world_size: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Return ``(parents, children)`` indexed by final rank, as the reference tracker builds them.

    ``parents[r]`` is -1 for the root (rank 0); ``children[r]`` is ascending, at most two
    ranks. The ring is implicit: ``r-1 -> r -> r+1 (mod n)``. Memoised per world size;
    O(n) and fast for the reference's whole tested range (1..1024) and beyond.

    Raises:
        TypeError: ``world_size`` is not an integer (bool included).
        ValueError: ``world_size < 1``.
    """
    return _tree_maps_cached(_check_world_size(world_size))


def topology(rank: int, world_size: int) -> Topology:
    """Return ``rank``'s tree and ring links in a group of ``world_size`` workers.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an integer (bool included).
        ValueError: ``world_size < 1`` or ``rank`` not in ``[0, world_size)``.
    """
    size = _check_world_size(world_size)
    me = _check_rank(rank, size)
    parents, children = _tree_maps_cached(size)
    return Topology(
        rank=me,
        world_size=size,
        parent=parents[me],
        children=children[me],
        ring_prev=(me - 1) % size,
        ring_next=(me + 1) % size,
    )


@functools.lru_cache(maxsize=_ROUTE_CACHE_SIZE)
def _broadcast_routes(root: int, world_size: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Routes of every rank for a broadcast from ``root`` (validated arguments only).

    In a tree the path to ``root`` leaves every rank through its parent, except on the
    chain of ``root``'s ancestors, where it goes down towards ``root`` instead. So start
    from "in-link = parent" and re-point that chain: O(n), no graph search.
    """
    parents, children = _tree_maps_cached(world_size)
    # Off the ancestor chain the in-link is the parent and the out-links are the children,
    # so most routes share the cached children tuples; only the chain is rebuilt.
    routes = [(parents[rank], children[rank]) for rank in range(world_size)]
    below, node = -1, root  # `below` = the chain node we came up from (-1 at root itself)
    while node >= 0:
        tree_links = children[node] if parents[node] < 0 else (parents[node], *children[node])
        routes[node] = (below, tuple(sorted(link for link in tree_links if link != below)))
        below, node = node, parents[node]
    return tuple(routes)


def broadcast_route(rank: int, root: int, world_size: int) -> tuple[int, tuple[int, ...]]:
    """Return ``(in_link, out_links)`` for a pipelined tree broadcast from ``root``.

    Data enters ``rank`` on ``in_link`` (the tree neighbour on the path towards ``root``;
    -1 when ``rank == root``) and is forwarded, as it arrives, on every other tree link
    (``out_links``, ascending). Over all ranks the in-links form a spanning tree rooted at
    ``root``, so every tree edge carries the payload exactly once, away from the root.
    Classic rabit finds the in-link at run time (the first readable tree link); we compute
    it up front so a stray byte on another link is a protocol error, not a new route.
    Memoised per ``(root, world_size)``.

    Raises:
        TypeError: an argument is not an integer (bool included).
        ValueError: ``world_size < 1`` or ``rank``/``root`` not in ``[0, world_size)``.
    """
    size = _check_world_size(world_size)
    me = _check_rank(rank, size)
    origin = _check_rank(root, size, "root")
    return _broadcast_routes(origin, size)[me]
