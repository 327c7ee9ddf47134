"""The speed targets, judged from one run of the side-by-side benchmark.

    python bench/peers/targets.py bench/results/peers-<stamp>/results.jsonl

``run.py`` prints the same verdicts after its tables.  Every verdict compares medians taken
in that one run: with ``--rounds K`` a ratio is the median of the K per-round ratios (each
round ran the implementations back to back), shown with the rounds rabit2 won.  A target is
*met* when every size and every peer it names is at or past its bound, *not measured* when
the run lacks a peer or a size it names (an unavailable peer is never counted as beaten).

The GBDT target is judged by ``gbdt_compare.py``, which prints its own verdict.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/units.py
from units import fmt_size

Key = tuple[str, int, str, int]  # (impl, N, op, size in bytes)
VARIANTS = ("rabit2-noft", "rabit2-ckpt", "rabit2")
"""The rabit2 columns: fault tolerance off, on with a checkpoint per iteration, on and never
checkpointing (the default launch)."""
LIMITS = ("limit:tcp-exchange", "limit:tcp-exchange-reno")
KIB, MIB = 1024, 1024 * 1024


# ---------------------------------------------------------------------------- combining rounds


def combine_rounds(rows: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Per (impl, N, op, size): one row whose median and p90 are the medians over the rounds
    (the rows of one round when there is one), with the per-round medians in ``rounds_s``
    (indexed by round, None where that round has no row)."""
    groups: dict[Key, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            groups.setdefault((r["impl"], r["world"], r["op"], r["size_bytes"]), []).append(r)
    last = max((int(r.get("round", 0)) for r in rows if r.get("status") == "ok"), default=0)
    out = {}
    for key, rs in groups.items():
        row = dict(rs[0])
        row["median_s"] = float(np.median([r["median_s"] for r in rs]))
        row["p90_s"] = float(np.median([r["p90_s"] for r in rs]))
        per_round: list[float | None] = [None] * (last + 1)
        for r in rs:
            per_round[int(r.get("round", 0))] = r["median_s"]
        row["rounds_s"] = per_round
        out[key] = row
    return out


@dataclass(frozen=True)
class Ratio:
    """``peer / base`` median time (> 1: the base is faster)."""

    value: float
    won: int  # rounds in which the base was faster (0 with a single round)
    rounds: int  # rounds in which both ran (1: the plain ratio of the medians)

    def __str__(self) -> str:
        return self.text(2)

    def text(self, digits: int) -> str:
        x = f"{self.value:.{digits}f}x"
        return x if self.rounds <= 1 else f"{x} ({self.won}/{self.rounds})"


def ratio(peer: dict[str, Any], base: dict[str, Any]) -> Ratio:
    """Per round when both ran in several rounds (the median of the rounds' ratios, and in
    how many rounds the base was faster), else of the medians."""
    pairs = [(p, b) for p, b in zip(peer.get("rounds_s") or [peer["median_s"]],
                                    base.get("rounds_s") or [base["median_s"]], strict=False)
             if p is not None and b is not None]
    if len(pairs) <= 1:
        return Ratio(peer["median_s"] / base["median_s"], 0, 1)
    ratios = [p / b for p, b in pairs]
    return Ratio(float(np.median(ratios)), sum(1 for x in ratios if x > 1), len(ratios))


def paired_ratio(peer: dict[str, Any], base: dict[str, Any]) -> str:
    """:func:`ratio` as the tables write it, e.g. ``1.50x (2/3)``."""
    return str(ratio(peer, base))


# ---------------------------------------------------------------------------- the targets


@dataclass(frozen=True)
class Target:
    """rabit2 against ``peers`` for ``op`` at world size ``world`` and every size of the run
    that ``sizes`` accepts: met when each ratio peer / rabit2 is at least ``need``."""

    text: str
    op: str
    world: int
    sizes: Callable[[int], bool]
    peers: tuple[str, ...]
    need: float
    variants: tuple[str, ...] = VARIANTS


def _large(s: int) -> bool:
    return s >= MIB


def _small(s: int) -> bool:
    return 4 * KIB <= s <= 64 * KIB


TARGETS = (
    Target("N=2 allreduce, >= 1 MiB: no slower than classic rabit", "allreduce", 2, _large,
           ("xgboost1.7",), 1.0),
    Target("N=2 allreduce, >= 1 MiB: within 10 % of the loopback limit", "allreduce", 2,
           _large, ("limit",), 1 / 1.10),
    Target("N=2 allreduce, 4-64 KiB: within 2x of classic rabit", "allreduce", 2, _small,
           ("xgboost1.7",), 0.5),
    Target("N=2 allreduce, 4-64 KiB: >= 3x faster than gloo and XGBoost 3", "allreduce", 2,
           _small, ("gloo", "xgboost3"), 3.0),
    Target("N=4 allreduce, every size: faster than gloo and XGBoost 3", "allreduce", 4,
           lambda s: True, ("gloo", "xgboost3"), 1.0),
    Target("N=4 broadcast, every size: faster than gloo and XGBoost 3", "broadcast", 4,
           lambda s: True, ("gloo", "xgboost3"), 1.0),
    Target("N=2 broadcast, >= 1 MiB: no slower than classic rabit", "broadcast", 2, _large,
           ("xgboost1.7",), 1.0),
    # (judged with a checkpoint per iteration only: the default launch, which never
    # checkpoints, outgrows its 256 MiB replay store within five 64 MiB calls, after which
    # its version cannot be replayed and nothing more is copied)
    Target("fault tolerance at 64 MiB, N=2: within 5 % of rabit2 without it", "allreduce", 2,
           lambda s: s == 64 * MIB, ("rabit2-noft",), 1 / 1.05, ("rabit2-ckpt",)),
    Target("fault tolerance at 64 MiB, N=4: within 5 % of rabit2 without it", "allreduce", 4,
           lambda s: s == 64 * MIB, ("rabit2-noft",), 1 / 1.05, ("rabit2-ckpt",)),
)


def _limit_row(rows: list[dict[str, Any]], size: int) -> tuple[str, dict[str, Any]] | None:
    """The faster of the loopback exchanges (plain and reno) at ``size``: the stricter bound."""
    got = [r for r in rows if r.get("impl") in LIMITS and r.get("size_bytes") == size]
    if not got:
        return None
    best = min(got, key=lambda r: r["median_s"])
    return ("limit, reno" if best["impl"].endswith("reno") else "limit"), best


def judge(target: Target, variant: str, rows: list[dict[str, Any]],
          ok: dict[Key, dict[str, Any]]) -> tuple[bool | None, str]:
    """(met, or None when not measured; the cell's text) for one rabit2 variant."""
    sizes = sorted({k[3] for k in ok if k[1] == target.world and k[2] == target.op
                    and target.sizes(k[3])})
    if not sizes:
        return None, "not measured (no such size in this run)"
    short: list[str] = []
    lowest: tuple[float, str] | None = None
    for size in sizes:
        mine = ok.get((variant, target.world, target.op, size))
        if mine is None:
            return None, f"not measured ({variant} has no {fmt_size(size)} row)"
        for peer in target.peers:
            if peer == "limit":
                found = _limit_row(rows, size)
                if found is None:
                    return None, "not measured (no loopback limit in this run)"
                name, other = found
                r = Ratio(other["median_s"] / mine["median_s"], 0, 1)
            else:
                theirs = ok.get((peer, target.world, target.op, size))
                if theirs is None:
                    return None, f"not measured ({peer} did not run)"
                name, r = peer, ratio(theirs, mine)
            what = f"{fmt_size(size)}" + (f" {name}" if len(target.peers) > 1 else "")
            if r.value < target.need:
                short.append(f"{what} {r.text(3)}")
            if lowest is None or r.value < lowest[0]:
                lowest = (r.value, f"{what} {r.text(3)}")
    assert lowest is not None
    if short:
        return False, "**not met**: " + ", ".join(short)
    return True, f"met (lowest: {lowest[1]})"


def verdicts(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per target, one column per rabit2 variant in the run."""
    ok = combine_rounds(rows)
    variants = [v for v in VARIANTS if any(k[0] == v for k in ok)]
    if not variants:
        return ""
    out = [
        "### Speed targets, judged from this run",
        "",
        "Ratios are peer / rabit2 medians (> 1: rabit2 faster; with rounds, the median of the "
        "per-round ratios and the rounds rabit2 won); the loopback limit is the faster of the "
        "two Python TCP exchanges; a target is met when every ratio reaches its bound.",
        "",
        "| target | bound | " + " | ".join(f"`{v}`" for v in variants) + " |",
        "| --- | --- | " + " | ".join("---" for _ in variants) + " |",
    ]
    for t in TARGETS:
        cells = []
        for v in variants:
            if v not in t.variants:
                cells.append("-")
                continue
            cells.append(judge(t, v, rows, ok)[1])
        out.append(f"| {t.text} | >= {t.need:.3g}x | " + " | ".join(cells) + " |")
    out += ["", "The GBDT target: `python bench/peers/gbdt_compare.py --n 2,4 --runs 5` "
            "(prints its own verdict).", ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__)
        return 2
    rows = [json.loads(x) for x in Path(args[0]).read_text().splitlines() if x.strip()]
    text = verdicts(rows)
    print(text or "no rabit2 rows in that file")
    return 0 if text else 1


if __name__ == "__main__":
    sys.exit(main())
