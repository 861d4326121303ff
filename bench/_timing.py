"""Timing helpers shared by the benchmarks: best-of-N per-call time (``fastcore._timing``), tables.

Benchmarks report ratios against alternatives measured in the same run (the
machine is shared and noisy); the minimum over repeats is the least noisy
estimator of a call's cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastcore._timing import time_call


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into issue notes as is)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


__all__ = ["format_table", "time_call"]
