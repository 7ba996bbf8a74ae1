"""Which items a sampled check looks at."""
from __future__ import annotations


def spread(items: list, k: int | None) -> list:
    """``k`` items evenly spaced over ``items`` (first and last included); all when k is None."""
    n = len(items)
    if k is None or k >= n:
        return list(items)
    if k <= 0:
        return []
    if k == 1:
        return [items[n // 2]]
    return [items[round(i * (n - 1) / (k - 1))] for i in range(k)]
