"""Timing helpers shared by the benchmarks: best-of-N per-call time (``fastcore._timing``), tables.

Benchmarks report ratios against alternatives measured in the same run (the
machine is shared and noisy); the minimum over repeats is the least noisy
estimator of a call's cost.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
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


def instructions_per_loop(argv: Callable[[int], list[str]], loops: tuple[int, int], missing: str) -> float:
    """CPU instructions per loop of ``python *argv(count)`` under callgrind: two runs ``loops`` apart,
    differenced, so that start-up cancels out (``missing``: the exit message without valgrind)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit(missing)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in loops:
            out = os.path.join(tmp, f"callgrind.{count}")
            command = [
                valgrind,
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                *argv(count),
            ]
            subprocess.run(command, check=True, env=env, capture_output=True)
            with open(out) as f:
                match = re.search(r"^totals: (\d+)", f.read(), re.MULTILINE)
            assert match is not None, "no totals line in the callgrind output"
            totals.append(int(match.group(1)))
    return (totals[1] - totals[0]) / (loops[1] - loops[0])
