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
