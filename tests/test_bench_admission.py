"""``bench.admission --quick``: a real deployment (synthetic worker processes, an orchestrator with keys
and an admission section) through both phases, its JSON, table and plot. The numbers in bench/README
come from this code; nothing here gates on them, only on what every answer must be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.admission import KEYS, STREAMS, main

pytestmark = pytest.mark.slow


def test_quick_run_answers_200_or_429_with_retry_after_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    assert main(["--quick", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    fair, overload = data["phases"]
    assert (fair["phase"], overload["phase"]) == ("fair", "overload")
    for phase in (fair, overload):
        # under overload every answer is a completion or a 429 carrying Retry-After; no 5xx, no errors
        assert set(phase["statuses"]) <= {"200", "429"}, phase["statuses"]
        assert phase["every_429_has_retry_after"]
        assert {(r["tenant"], r["priority"]) for r in phase["rows"]} == {(t, p) for t, p, _ in STREAMS}
        assert all(r["other"] == 0 for r in phase["rows"])
        assert sum(r["completions"] for r in phase["rows"] if r["tenant"] == "small") > 0
    assert fair["statuses"].get("429", 0) == 0  # a queue of 1024 with 30 s: nothing refused
    assert overload["statuses"].get("429", 0) > 0  # a queue of 8 and 0.3 s: refusals
    assert set(data["micro"]) >= {"key_lookup_us", "priority_read_us", "auth_and_admission_us"}
    assert set(KEYS) == {"big", "small"}
    assert out.with_suffix(".png").stat().st_size > 0
