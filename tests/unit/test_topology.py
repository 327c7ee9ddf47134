"""Tree/ring maps against the reference tracker's, and structural properties for n in 1..1024."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rabit2.core.topology import broadcast_route, topology, tree_maps

# Reference maps from docs (rabit-protocol.md §2, experiment E3), "rank: parent [children]".
REFERENCE_MAPS = {
    4: "0:-1[1,3] 1:0[2] 2:1[] 3:0[]",
    5: "0:-1[1,4] 1:0[2,3] 2:1[] 3:1[] 4:0[]",
    8: "0:-1[1,7] 1:0[2,4] 2:1[3] 3:2[] 4:1[] 5:7[] 6:7[] 7:0[5,6]",
    10: "0:-1[1,9] 1:0[2,6] 2:1[3,4] 3:2[] 4:2[] 5:6[] 6:1[5] 7:9[] 8:9[] 9:0[7,8]",
    16: "0:-1[1,15] 1:0[2,8] 2:1[3,5] 3:2[] 4:5[] 5:2[4] 6:8[] 7:8[] 8:1[6,7] 9:15[10,11] "
    "10:9[] 11:9[] 12:14[] 13:14[] 14:15[12,13] 15:0[9,14]",
}

# Every n up to 66 (the first quirk node with two children appears at n=9, the first
# divergence from sorted order at n=16), a stride over the rest, powers of two and their
# neighbours, and both ends of the reference's verified range 1..1024.
SAMPLE_SIZES = sorted({*range(1, 67), *range(67, 1024, 29), 255, 256, 511, 512, 1023, 1024})


def parse_reference(text: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    parents: list[int] = []
    children: list[tuple[int, ...]] = []
    for index, entry in enumerate(text.split()):
        rank, rest = entry.split(":", 1)
        assert int(rank) == index
        parent, kids = rest.rstrip("]").split("[")
        parents.append(int(parent))
        children.append(tuple(int(kid) for kid in kids.split(",")) if kids else ())
    return tuple(parents), tuple(children)


def reference_tracker_maps(n: int) -> tuple[list[int], list[set[int]]]:
    """An independent oracle: the reference tracker's recursive walk, with a real ``set``.

    Unlike the implementation (which models CPython's set order explicitly), this iterates
    an actual set exactly like dmlc-core's ``find_share_ring``, so it checks the quirk model.
    Recursion depth is the tree depth (~log2 n), so recursion is harmless here.
    """

    def heap_children(i: int) -> set[int]:
        return {c for c in (2 * i + 1, 2 * i + 2) if c < n}

    def walk(i: int) -> list[int]:
        kids = set(heap_children(i))  # fresh 2-element set, as the reference builds it
        out = [i]
        for count, child in enumerate(kids, start=1):
            sub = walk(child)
            if count == len(kids):
                sub.reverse()
            out += sub
        return out

    rank_of = {node: rank for rank, node in enumerate(walk(0))}
    parents = [-1] * n
    children: list[set[int]] = [set() for _ in range(n)]
    for node in range(1, n):
        parents[rank_of[node]] = rank_of[(node - 1) // 2]
        children[rank_of[(node - 1) // 2]].add(rank_of[node])
    return parents, children


@pytest.mark.parametrize("n", sorted(REFERENCE_MAPS))
def test_reference_maps(n: int) -> None:
    assert tree_maps(n) == parse_reference(REFERENCE_MAPS[n])


def test_n4_worker_views_match_captured_tracker_replies() -> None:
    # E1 capture: what the real tracker told ranks 0 and 1 for n=4.
    rank0 = topology(0, 4)
    assert (rank0.parent, rank0.tree_neighbors, rank0.ring_prev, rank0.ring_next) == (
        -1,
        (1, 3),
        3,
        1,
    )
    rank1 = topology(1, 4)
    assert (rank1.parent, rank1.tree_neighbors, rank1.ring_prev, rank1.ring_next) == (
        0,
        (0, 2),
        0,
        2,
    )
    assert rank1.neighbors == (0, 2)
    assert topology(3, 4).neighbors == (0, 2)


def test_quirk_changes_the_map_at_16() -> None:
    # Heap node 3 has children 7, 8 and 7 % 8 == 7, so they are visited as (8, 7). With
    # ascending visits rank 4 would hang under rank 3; the reference puts it under rank 5.
    parents, children = tree_maps(16)
    assert parents[4] == 5
    assert children[3] == ()
    assert children[5] == (4,)


@pytest.mark.parametrize("n", [*range(1, 41), 63, 64, 100, 255, 256, 511, 1023, 1024])
def test_matches_reference_tracker_oracle(n: int) -> None:
    parents, children = tree_maps(n)
    oracle_parents, oracle_children = reference_tracker_maps(n)
    assert list(parents) == oracle_parents
    assert [set(kids) for kids in children] == oracle_children


@pytest.mark.parametrize("n", SAMPLE_SIZES)
def test_spanning_binary_tree_and_ring(n: int) -> None:
    parents, children = tree_maps(n)
    assert len(parents) == len(children) == n
    assert parents[0] == -1
    assert all(0 <= parents[r] < n and parents[r] != r for r in range(1, n))
    for rank, kids in enumerate(children):
        assert len(kids) <= 2
        assert list(kids) == sorted(set(kids))
        assert all(parents[kid] == rank for kid in kids)
    assert sum(len(kids) for kids in children) == n - 1
    # Every rank reaches the root; walking at most depth steps (no cycles).
    depth = {0: 0}
    for rank in range(n):
        path = []
        node = rank
        while node not in depth:
            path.append(node)
            node = parents[node]
            assert len(path) <= n
        for step, visited in enumerate(reversed(path), start=1):
            depth[visited] = depth[node] + step
    assert max(depth.values()) <= n.bit_length()  # a heap stays balanced

    for rank in range(n):
        view = topology(rank, n)
        assert (view.rank, view.world_size) == (rank, n)
        assert (view.parent, view.children) == (parents[rank], children[rank])
        assert view.ring_prev == (rank - 1) % n
        assert view.ring_next == (rank + 1) % n
        expected_tree = sorted([*children[rank], *([parents[rank]] if parents[rank] >= 0 else [])])
        assert list(view.tree_neighbors) == expected_tree
        expected = set(expected_tree) | {view.ring_prev, view.ring_next}
        expected.discard(rank)
        assert list(view.neighbors) == sorted(expected)
        assert len(view.neighbors) <= 5  # <= 3 tree links + <= 2 extra ring links


def test_single_worker() -> None:
    assert tree_maps(1) == ((-1,), ((),))
    view = topology(0, 1)
    assert (view.parent, view.children, view.ring_prev, view.ring_next) == (-1, (), 0, 0)
    assert view.tree_neighbors == ()
    assert view.neighbors == ()
    assert broadcast_route(0, 0, 1) == (-1, ())


def test_broadcast_route_example_from_capture() -> None:
    # E2: n=5, root 2 -> 1 -> {0, 3}, 0 -> 4.
    routes = [broadcast_route(rank, 2, 5) for rank in range(5)]
    assert routes == [(1, (4,)), (2, (0, 3)), (-1, (1,)), (1, ()), (0, ())]


def check_broadcast_tree(n: int, root: int) -> None:
    routes = [broadcast_route(rank, root, n) for rank in range(n)]
    tree = [set(topology(rank, n).tree_neighbors) for rank in range(n)]
    fed_by: dict[int, set[int]] = {rank: set() for rank in range(n)}
    for rank, (in_link, _) in enumerate(routes):
        if in_link >= 0:
            fed_by[in_link].add(rank)
    for rank, (in_link, out_links) in enumerate(routes):
        if rank == root:
            assert in_link == -1
            assert set(out_links) == tree[rank]
        else:
            assert in_link in tree[rank]
            assert set(out_links) == tree[rank] - {in_link}
        assert list(out_links) == sorted(out_links)
        # out_links of rank are exactly the ranks whose in_link is rank
        assert set(out_links) == fed_by[rank]
    for rank in range(n):  # following in-links from anywhere reaches the root
        node, steps = rank, 0
        while node != root:
            node = routes[node][0]
            steps += 1
            assert steps < n


@pytest.mark.parametrize("n", [n for n in SAMPLE_SIZES if n <= 40])
def test_broadcast_route_every_root_small(n: int) -> None:
    for root in range(n):
        check_broadcast_tree(n, root)


@pytest.mark.parametrize("n", [63, 64, 100, 1023, 1024])
def test_broadcast_route_sampled_roots_large(n: int) -> None:
    for root in sorted({0, 1, 2, n // 3, n // 2, n - 2, n - 1}):
        check_broadcast_tree(n, root)


def test_broadcast_route_many_roots_1024() -> None:
    # O(n) per root: each non-root points at a tree neighbour and no two ranks point at
    # each other. n-1 arcs on the n-1 edges of a tree with no 2-cycle cannot form a cycle
    # (a tree has no others), so the in-links are a spanning tree directed at the root.
    n = 1024
    parents, children = tree_maps(n)
    for root in sorted({*range(0, n, 8), *range(n - 8, n)}):  # an eighth keeps it fast
        in_links = [broadcast_route(rank, root, n)[0] for rank in range(n)]
        assert in_links.count(-1) == 1
        assert in_links[root] == -1
        for rank, in_link in enumerate(in_links):
            if rank != root:
                assert in_link == parents[rank] or in_link in children[rank]
                assert in_links[in_link] != rank


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: tree_maps(0), ValueError),
        (lambda: tree_maps(-3), ValueError),
        (lambda: topology(0, 0), ValueError),
        (lambda: topology(4, 4), ValueError),
        (lambda: topology(-1, 4), ValueError),
        (lambda: broadcast_route(0, 4, 4), ValueError),
        (lambda: broadcast_route(5, 0, 4), ValueError),
        (lambda: topology(True, 4), TypeError),
        (lambda: topology(0, 4.0), TypeError),  # type: ignore[arg-type]
        (lambda: tree_maps("4"), TypeError),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments(call: Callable[[], object], error: type[Exception]) -> None:
    with pytest.raises(error):
        call()


def test_memoised() -> None:
    assert tree_maps(777) is tree_maps(777)
