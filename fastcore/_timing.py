"""Best-of-N timing of a call, shared by ``python -m fastcore benchmark`` and ``bench/``.

It lives in the package (not in bench/, which the wheel does not ship) so the
installed ``python -m fastcore benchmark`` and the benchmarks time calls the
same way. The minimum over repeats is the least noisy estimator of a call's
cost on a shared machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
