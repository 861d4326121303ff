"""Timing helpers shared by the benchmarks: best-of-N per-call time, tables.

Benchmarks report ratios against alternatives measured in the same run (the
machine is shared and noisy); the minimum over repeats is the least noisy
estimator of a call's cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def time_call(fn: Callable[[], Any], *, min_time: float = 0.2, repeat: int = 5) -> float:
    """Seconds per call of ``fn``: the best of ``repeat`` runs of an auto-sized loop."""
    fn()  # warm up (caches, lazy imports)
    number = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time / repeat or number >= 1 << 20:
            break
        number *= 2
    best = elapsed / number
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into issue notes as is)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
