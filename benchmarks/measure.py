"""Shared by the benchmarks: best-of-N timing and a plain-text table."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest wall time of `repeats` calls: the least disturbed by the other load on a noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, head)), *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)
