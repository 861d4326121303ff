"""bench.engine (issue 38 item 5): its verdicts, and a quick run end to end (no timed assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import engine as bench_engine


def test_the_verdicts_name_each_target_with_its_numbers() -> None:
    decode = [
        {"concurrency": 1, "decode_ratio_in_process": 1 / 1.3},  # 1.3x transformers' time per token
        {"concurrency": 32, "decode_ratio_in_process": 2.5},
    ]
    itl = [
        {"prefill_chunk_tokens": 0, "path": "in process", "ratio_p99": 30.0},
        {"prefill_chunk_tokens": 64, "prefill_step_ratio": 0.0, "path": "HTTP", "ratio_p99": 1.5},
        {"prefill_chunk_tokens": 512, "prefill_step_ratio": 1.5, "path": "HTTP", "ratio_p99": 2.5},
    ]
    lines = bench_engine.targets(decode, itl)
    assert lines == [
        "ITL p99 with a whole-context prefill, chunks of 64 (HTTP): 1.50x of alone (target <= 2x): met",
        "ITL p99 with a whole-context prefill, chunks of 512 paced 1.5x (HTTP): 2.50x of alone (target <= 2x): "
        "NOT met",
        "decode tok/s at 32: 2.50x transformers' static batch (target >= 2x): met",
        "time per token at 1 request: 1.30x transformers' (target <= 1.2x): NOT met",
    ]


def test_a_quick_run_writes_every_table_and_the_same_text_as_transformers(tmp_path: Path, capsys) -> None:
    out = tmp_path / "engine.json"
    argv = ["--quick", "--concurrency", "1,3", "--max-tokens", "4", "--chunks", "0,64:0,64", "--base-steps", "8",
            "--torch-threads", "1", "--device", "cpu", "--output", str(out), "--long-context", "320",
            "--long-chunks", "0,64"]  # fmt: skip
    assert bench_engine.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["decode"]] == [1, 3]
    for r in result["decode"]:
        for side in ("ours_in_process", "ours_http", "transformers"):
            assert r[side]["decode_tps"] > 0, side
        # CPU per generated token beside the wall clock (a shared machine's load moves the latter)
        for side in ("ours_in_process", "transformers"):
            assert r[side]["cpu_us_per_token"] > 0, side
        assert r["cpu_ratio_in_process"] == pytest.approx(
            r["transformers"]["cpu_us_per_token"] / r["ours_in_process"]["cpu_us_per_token"]
        )
    assert [(r["prefill_chunk_tokens"], r["prefill_step_ratio"], r["path"]) for r in result["itl"]] == [
        (0, 0.0, "in process"),
        (0, 0.0, "HTTP"),
        (64, 0.0, "in process"),
        (64, 0.0, "HTTP"),
        (64, 1.5, "in process"),
        (64, 1.5, "HTTP"),
        # --long-context: the tiny weights at a 320-token context, in process only
        (0, 0.0, "in process, 320-token context"),
        (64, 1.5, "in process, 320-token context"),
    ]
    assert [r["context"] for r in result["itl"]] == [2048] * 6 + [320] * 2
    assert result["itl"][-1]["prefill_s"] > 0 and (tmp_path / "engine.png").stat().st_size > 0
    assert all(r["gaps_during"] > 0 and r["base_p99_ms"] > 0 for r in result["itl"])
    # our greedy text is transformers' on the checkpoint the bench wrote
    assert result["same_text"] is True
    printed = capsys.readouterr().out
    assert (
        "ours / tf" in printed
        and "ours / tf (CPU)" in printed
        and "p99 prefill / alone" in printed
        and "time per token at 1 request" in printed
    )


def test_the_long_context_rows_alone(tmp_path: Path) -> None:
    """--concurrency '' --chunks '': no decode table and no rows at the tiny model's own context, the
    --long-context rows only (no PNG without decode rows)."""
    out = tmp_path / "long.json"
    argv = ["--concurrency", "", "--chunks", "", "--long-context", "320", "--long-chunks", "64:0", "--base-steps",
            "8", "--torch-threads", "1", "--device", "cpu", "--output", str(out)]  # fmt: skip
    assert bench_engine.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["decode"] == [] and [(r["context"], r["prefill_chunk_tokens"]) for r in result["itl"]] == [
        (320, 64)
    ]
    assert not (tmp_path / "long.png").exists()
