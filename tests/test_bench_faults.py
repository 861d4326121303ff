"""``bench.faults`` small: a real deployment (synthetic worker processes, an orchestrator, the fault
proxy) through one cell of each kind, and its table. The numbers in bench/README come from this code."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench.faults import CELLS, Cell, run, table

pytestmark = pytest.mark.slow


def test_a_context_fault_a_kv_fault_and_a_hang_up_leave_nothing_behind() -> None:
    args = argparse.Namespace(
        quick=True, cells="context:frozen,kv:refused,client:mid_stream", concurrency=2, hangups=0
    )
    cells = asyncio.run(run(args))
    assert [(c.target, c.fault) for c in cells] == [
        ("context", "frozen"),
        ("kv", "refused"),
        ("client", "mid_stream"),
    ]
    for cell in cells:
        assert cell.requests > 0, cell
        # A generation worker can still serve: no client sees these faults, none hangs, no KV stays.
        assert (cell.failures, cell.hung, cell.kv_left, cell.unfreed) == (0, 0, 0, 0), cell
    frozen, kv, hang_up = cells
    assert frozen.fallbacks > 0 and frozen.recover_s is not None and kv.recover_s is not None
    assert hang_up.abort_p50_ms is not None and hang_up.abort_max_ms is not None
    rows = table(cells).splitlines()
    assert len(rows) == 2 + len(cells) and rows[2].startswith("| context: frozen | ")


def test_the_matrix_names_every_fault_of_the_issue() -> None:
    assert {t for t, _ in CELLS} == {"context", "kv", "generation", "client", "orchestrator"}
    assert [f for t, f in CELLS if t == "context"] == ["4xx", "5xx", "refused", "reset", "frozen", "killed"]
    assert [f for t, f in CELLS if t == "kv"] == ["refused", "timeout", "truncated"]
    assert [f for t, f in CELLS if t == "generation"] == ["killed", "frozen"]
    assert [f for t, f in CELLS if t == "client"] == ["before_context", "during_kv_fetch", "mid_stream"]
    assert CELLS[-1] == ("orchestrator", "shutdown")  # the last: the orchestrator is gone after it
    assert Cell("client", "mid_stream").name == "client: mid_stream"
