"""The side-by-side benchmark's driver and worker agree on the implementations' labels."""

from __future__ import annotations

import ast
from pathlib import Path

PEERS = Path(__file__).resolve().parent.parent / "bench" / "peers"


def _assigned(path: Path, name: str) -> object:
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name:
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} assigns no {name}")


def test_every_adapter_label_is_a_harness_impl() -> None:
    impls = _assigned(PEERS / "harness.py", "IMPLS")
    assert isinstance(impls, dict)
    for adapter in sorted(PEERS.glob("peer_*.py")):
        labels = _assigned(adapter, "LABELS")
        assert isinstance(labels, list) and labels
        for label in labels:
            assert impls.get(label) == adapter.stem, (label, adapter.name)


def test_rounds_are_combined_and_ratios_paired_per_round() -> None:
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(PEERS))
    try:
        import run  # noqa: PLC0415
    finally:
        sys.path.remove(str(PEERS))

    def row(impl: str, rnd: int, median: float) -> dict[str, object]:
        return {"impl": impl, "status": "ok", "op": "allreduce", "world": 2,
                "size_bytes": 1 << 20, "median_s": median, "p90_s": 2 * median, "round": rnd}

    # the base is faster in rounds 0 and 2, slower in round 1 (a machine-state swing)
    rows = [row("rabit2", 0, 1.0), row("gloo", 0, 2.0),
            row("rabit2", 1, 4.0), row("gloo", 1, 3.0),
            row("rabit2", 2, 1.0), row("gloo", 2, 1.5)]
    combined = run.combine_rounds(rows)
    base, peer = combined[("rabit2", 2, "allreduce", 1 << 20)], combined[
        ("gloo", 2, "allreduce", 1 << 20)]
    assert base["median_s"] == 1.0 and peer["median_s"] == 2.0  # medians over the rounds
    assert base["p90_s"] == 2.0 and base["rounds_s"] == [1.0, 4.0, 1.0]
    # per-round ratios 2.0, 0.75, 1.5: median 1.5, the base won two of three
    assert run.paired_ratio(peer, base) == "1.50x (2/3)"
    # a single round: the plain ratio of the medians
    one = run.combine_rounds([row("rabit2", 0, 2.0), row("gloo", 0, 3.0)])
    assert run.paired_ratio(one[("gloo", 2, "allreduce", 1 << 20)],
                            one[("rabit2", 2, "allreduce", 1 << 20)]) == "1.50x"


def test_gbdt_traces_split_the_wait_for_compute_from_the_collective(tmp_path: Path) -> None:
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(PEERS))
    try:
        import gbdt_compare  # noqa: PLC0415
    finally:
        sys.path.remove(str(PEERS))

    # two calls of 100 B; rank 1's input is ready 5 s late in the first (rank 0 waits)
    ranks = [
        [{"bytes": 100, "s": 6.0, "ready": 0.0, "done": 6.0},
         {"bytes": 100, "s": 1.0, "ready": 10.0, "done": 11.0}],
        [{"bytes": 100, "s": 1.0, "ready": 5.0, "done": 6.5},
         {"bytes": 100, "s": 3.0, "ready": 10.0, "done": 13.0}],
    ]
    paths = []
    for r, calls in enumerate(ranks):
        paths.append(tmp_path / f"t-{r}.jsonl")
        paths[-1].write_text("".join(json.dumps(c) + "\n" for c in calls))
    calls, slowest, per_call = gbdt_compare.per_size(paths)[100]
    assert calls == 2 and slowest == 7.0  # rank 0: 6 + 1 s, most of it waiting
    assert per_call == 2.25  # median of 1.5 s (6.5 - 5) and 3 s (13 - 10)


def test_the_histogram_compute_runs_between_the_barrier_and_each_timed_call() -> None:
    """``--compute histogram``: the GBDT-like work before each call, the same on every
    implementation (a one-rank loop with a comm that records what happens in what order)."""
    import sys  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    import pytest  # noqa: PLC0415

    sys.path.insert(0, str(PEERS))
    try:
        import harness  # noqa: PLC0415
    finally:
        sys.path.remove(str(PEERS))

    events: list[str] = []

    class Alone:
        rank, world, version = 0, 1, "test"

        def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
            events.append("call")
            return a

        def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
            events.append("call")
            return a

        def barrier(self, one: np.ndarray) -> None:
            events.append("barrier")

        def finalize(self) -> None:
            pass

    loop = harness.Loop(Alone(), 4096, compute_mb=1.0, compute="histogram")
    assert loop.work is not None
    index, weight = loop.work
    assert index.size == weight.size == (1 << 20) // 16  # 16 B per (int64, float64) row
    assert index.min() >= 0 and index.max() < harness.HIST_BINS
    real = loop._compute
    loop._compute = lambda: (events.append("compute"), real())  # type: ignore[method-assign]
    starts, ends = loop.run("allreduce", 4096, iters=3, warmup=1)
    assert len(starts) == len(ends) == 3
    assert events == ["barrier", "compute", "call"] * 4
    ns = harness.parse_args(["--impl", "rabit2", "--out", "x", "--sizes", "4096",
                             "--compute-mb", "1", "--compute", "histogram"])
    assert ns.compute == "histogram"
    with pytest.raises(SystemExit):
        harness.parse_args(["--impl", "rabit2", "--out", "x", "--sizes", "4096",
                            "--compute", "fft"])
