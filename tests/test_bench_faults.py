"""``bench.faults`` small: a real deployment (synthetic worker processes, an orchestrator, the fault
proxy) through one cell of each kind, and its table. The numbers in bench/README come from this code."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench import engine_faults
from bench.faults import CELLS, Cell, run, table


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("protocol", engine_faults.PROTOCOLS)
def test_the_engine_matrix_runs_every_cell_on_each_protocols_standins(protocol: str) -> None:
    """``bench.faults --worker-protocol vllm|sglang --quick``: every cell runs on the engine's strict
    stand-ins and is reported (structure only: the figures are the bench's, not timed here)."""
    cells = asyncio.run(engine_faults.run_protocol(protocol, quick=True, concurrency=2, hangups=2))
    assert [(c.target, c.fault) for c in cells] == engine_faults.CELLS
    assert all(c.protocol == protocol and c.requests > 0 for c in cells), cells
    assert cells[-1].cuts + cells[-1].hung == 2  # each hang-up's legs cut, or counted
    rows = engine_faults.table(cells).splitlines()
    assert len(rows) == 2 + len(cells) and rows[2].startswith(f"| {protocol} prefill: 5xx | ")
    (verdict,) = engine_faults.verdicts(cells)
    assert verdict.startswith(f"verdict {protocol}: ")


def test_the_engine_verdict_names_each_missed_target() -> None:
    """0 hung, 0 left waiting, 0 failures where a fallback exists, SGLang's partner cut within 100 ms
    (and every failed leg's partner cut); a failure without a fallback is reported, not a miss."""
    Cell_ = engine_faults.EngineCell
    ok = [
        Cell_("sglang", "prefill", "5xx", requests=10, fallback=True, failed_legs=2, cuts=2, cut_max_ms=30.0),
        Cell_("sglang", "decode", "5xx", requests=10, failures=3, failed_legs=1, cuts=1, cut_max_ms=20.0),
    ]
    assert engine_faults.verdicts(ok) == ["verdict sglang: MET"]
    bad = [
        Cell_("sglang", "prefill", "5xx", requests=10, failures=1, fallback=True, failed_legs=2, cuts=1,
              cut_max_ms=150.0),
        Cell_("vllm", "prefill", "reset", requests=10, hung=1, left_waiting=2, fallback=True),
    ]  # fmt: skip
    sglang, vllm = engine_faults.verdicts(bad)
    for part in ("1 failures", "cut max 150.0 ms", "a partner never cut"):
        assert part in sglang, sglang
    assert "1 hung" in vllm and "2 left waiting" in vllm, vllm
    assert "1 of 2 partners never cut" in engine_faults.table(bad)
