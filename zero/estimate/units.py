"""Bytes and counts as people read them, for the estimator's tables."""
from __future__ import annotations


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 0.25."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size / 4:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{int(nbytes)} B"


def human_count(count: int) -> str:
    """A count in k, M, B or T, to 3 significant digits."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)
