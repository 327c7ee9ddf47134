"""Sizes and durations as the benchmark tables write them (shared by every bench script)."""

from __future__ import annotations

import argparse

_UNITS = {"": 1, "B": 1, "K": 1024, "KIB": 1024, "M": 1024**2, "MIB": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    """``4K`` / ``64KiB`` / ``1M`` / ``4096`` -> bytes (binary units); a multiple of 4."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits) :]
    if unit not in _UNITS or not digits.isdigit():
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    size = int(digits) * _UNITS[unit]
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a positive multiple of 4 B")
    return size


def fmt_time(s: float) -> str:
    """Seconds as a short figure (us below 1 ms, ms below 1 s)."""
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_size(b: int) -> str:
    """Bytes in binary units, as in the peer-baseline tables."""
    for unit, k in (("MiB", 1024**2), ("KiB", 1024)):
        if b >= k and b % k == 0:
            return f"{b // k} {unit}"
    return f"{b} B"
