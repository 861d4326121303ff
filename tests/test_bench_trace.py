"""``bench.trace``: a Mooncake trace replayed through a real deployment, small.

The trace's format and the prompts built from it (equal hash ids, equal text,
``input_length`` ids on the synthetic worker's tokenizer), the offline oracle
against a hand count, and one short replay per router on real worker and
orchestrator processes: every request answered, and what the clients were told
was cached (``usage.prompt_tokens_details.cached_tokens``) is what the workers
counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import trace
from bench.trace import (
    TEMPLATE,
    BlockTexts,
    TraceRequest,
    block_oracle,
    load_trace,
    oracle,
    working_set_tokens,
)
from server.worker.synthetic import SyntheticTokenizer


def test_the_shipped_trace_loads_with_its_licence() -> None:
    requests = load_trace(trace.TRACE)
    assert len(requests) == 3993
    assert "Apache License" in (trace.TRACE.parent / "LICENSE-APACHE").read_text()[:200]
    # every request names one block per 512 tokens, the last one partial
    assert all((len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512 for r in requests)
    tail = load_trace(trace.TRACE, 5, start=-5)
    assert len(tail) == 5 and tail[0].timestamp_ms == 0 and tail[-1].hash_ids == requests[-1].hash_ids


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not a trace request"):
        load_trace(path)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_prompts_share_text_where_they_share_blocks_and_have_input_length_ids(width: int) -> None:
    texts = BlockTexts(width)
    a = TraceRequest(0, 1200, 4, [7, 8, 9])
    b = TraceRequest(0, 700, 4, [7, 8])
    c = TraceRequest(0, 700, 4, [10, 8])
    pa, pb, pc = (texts.prompt(r, width) for r in (a, b, c))
    assert pa.startswith(texts[7] + texts[8][:100]) and pb == pa[: len(pb)]
    assert pc[:20] != pa[:20]
    tokenizer = SyntheticTokenizer(0, bytes_per_token=width)
    for r, p in ((a, pa), (b, pb)):
        assert tokenizer.encode(TEMPLATE.format(p)).size == r.input_length


def test_the_oracle_is_one_lru_cache_of_the_fleets_kv() -> None:
    texts = BlockTexts(4)
    requests = [TraceRequest(0, 1024, 1, [1, 2]), TraceRequest(0, 1024, 1, [1, 2]), TraceRequest(0, 1024, 1, [3, 4]),
                TraceRequest(0, 1024, 1, [1, 2])]  # fmt: skip
    prompts = [texts.prompt(r, 4) for r in requests]
    tokenizer = SyntheticTokenizer(0)
    n = tokenizer.encode(TEMPLATE.format(prompts[0])).size
    reusable = (n - 1) // 16 * 16
    # room for both prompts: the repeats hit whole; room for one: the fourth was evicted by the third
    assert oracle(prompts, 4, 4096) == (2 * reusable, 4 * n)
    assert oracle(prompts, 4, 1100) == (reusable, 4 * n)
    assert block_oracle(requests, 4096) == pytest.approx(2 * 1023 / 4096)
    assert working_set_tokens(requests) == 4 * 512


def test_a_short_replay_per_router(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    code = trace.main([
        "--n", "12", "--start", "-12", "--speedup", "50", "--orchestrators", "1",
        "--routings", "round_robin,kv_cache_aware", "--context-workers", "2", "--generation-workers", "1",
        "--prefill-tokens-per-s", "5000000", "--no-plot", "--output", str(out),
    ])  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert code == 0
    assert [r["routing"] for r in results] == ["round_robin", "kv_cache_aware"]
    for r in results:
        assert r["requests"] == 12 and r["errors"] == 0, r["error_samples"]
        assert r["prompt_tokens"] == r["prefix_hit_tokens"] + r["prefill_computed_tokens"] > 0
        # the clients' usage (the context worker's count, relayed) adds up to the workers' /metrics
        assert r["usage_cached_tokens"] == r["prefix_hit_tokens"]
        assert 0 < r["oracle_fraction"] < 1 and r["context_busy"] is not None and r["ttft_p50_ms"] is not None
    assert np.isclose(results[0]["oracle_fraction"], results[1]["oracle_fraction"])
