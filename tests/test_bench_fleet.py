"""bench.fleet's smoke test: ``--quick`` runs and writes every figure it prints (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server.orchestrator import fleet


def test_bench_fleet_quick_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    done = subprocess.run([sys.executable, "-m", "bench.fleet", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "extra us" in done.stdout and "bucket take us" in done.stdout
    results = json.loads(out.read_text())
    twins = ["python"] + (["cython"] if fleet.compiled is not None else [])
    for label in ("slots only", "slots + 2 rate limits"):
        assert set(results[label]) == {"per_process_us"} | {f"fleet_{twin}_us" for twin in twins}
    assert all(set(results[f"ops_{twin}_us"]) == {"slot", "bucket"} for twin in twins)
    assert set(results["several_hosts"]) == {"alone_us", "divided_us"} and "one of 2 hosts us" in done.stdout
