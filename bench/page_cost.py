"""What a fresh page of anonymous memory costs in this process: made by the first write that
touches it, against made ahead in one system call (``MADV_POPULATE_WRITE``, Linux 5.14; or
``MAP_POPULATE`` when the mapping is made), as the replay store's slabs do
(``rabit2.core.recovery.store.Slab``), with or without transparent huge pages asked for.
Prints microseconds per 4 KiB page, medians.

    python bench/page_cost.py [--mib 4] [--runs 20]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections.abc import Callable

MADV_POPULATE_WRITE = 23


def _fresh(size: int, flags: int = 0) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)


def touched(size: int, keep: list[mmap.mmap]) -> None:
    region = _fresh(size)
    keep.append(region)
    view = memoryview(region)
    for at in range(0, size, mmap.PAGESIZE):
        view[at] = 1


def populated_at_map(size: int, keep: list[mmap.mmap]) -> None:
    keep.append(_fresh(size, mmap.MAP_POPULATE))


def populated_in_steps(size: int, keep: list[mmap.mmap], step: int = 256 << 10,
                       huge: bool = False) -> None:
    region = _fresh(size)
    keep.append(region)
    if huge:
        region.madvise(mmap.MADV_HUGEPAGE)
    for at in range(0, size, step):
        region.madvise(MADV_POPULATE_WRITE, at, min(step, size - at))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=4, help="MiB per measured mapping")
    ap.add_argument("--runs", type=int, default=20)
    ns = ap.parse_args()
    size = ns.mib << 20
    pages = size // mmap.PAGESIZE
    ways: dict[str, Callable[[int, list[mmap.mmap]], None]] = {
        "first write": touched,
        "MAP_POPULATE": populated_at_map,
        "MADV_POPULATE_WRITE, 256 KiB steps": populated_in_steps,
    }
    if hasattr(mmap, "MADV_HUGEPAGE"):  # (2 MiB pages, where the system makes them)
        ways["the same after MADV_HUGEPAGE"] = (
            lambda size, keep: populated_in_steps(size, keep, huge=True))
    spent: dict[str, list[float]] = {name: [] for name in ways}
    keep: list[mmap.mmap] = []  # (kept mapped: unmapped pages would come back warm)
    for _ in range(ns.runs):
        for name, way in ways.items():  # alternating
            start = time.perf_counter()
            try:
                way(size, keep)
            except OSError as exc:
                print(f"{name}: {exc}")
                continue
            spent[name].append((time.perf_counter() - start) / pages * 1e6)
    for name, values in spent.items():
        if values:
            print(f"{name:36s} {statistics.median(values):.2f} us/page "
                  f"(min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
