"""The scale benchmarks' own machinery, small: the numbers in the notes come from this code.

A real deployment (synthetic worker processes, an orchestrator or the floor
proxy, pinned as the benchmark pins them) driven by the load generator for a
handful of requests; and the statistics it reports.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from raw_http import serving

from bench.deploy import FLOOR, Deployment, cpu_seconds, rss_bytes
from bench.loadgen import RequestResult, one_unary_request, percentile, run_concurrency, summarize
from bench.workload import agentic_messages, chat_body
from server.http import Request, Responder


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 1) == 1.0
    assert percentile([], 50) is None


def test_summarize_counts_errors_and_timeouts_apart() -> None:
    results = [
        RequestResult(True, ttft=0.010, latency=0.020),
        RequestResult(True, ttft=0.030, latency=0.040),
        RequestResult(False, error="HTTP 503: full"),
        RequestResult(False, timed_out=True, error="timed out after 1s"),
    ]
    level = summarize("x", results, 2.0, concurrency=4)
    assert (level.requests, level.errors, level.timeouts) == (4, 2, 1)
    assert level.completions_per_s == 1.0
    assert level.ttft_p50_ms == 10.0 and level.latency_p99_ms == 40.0


async def answer(req: Request, out: Responder) -> None:
    out.send(200, b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}')


async def test_a_paced_closed_loop_starts_the_nth_request_no_sooner_than_n_over_the_rate() -> None:
    """bench.routers --rate: 4 clients, 21 requests paced at 100/s take at least 0.2 s (the 21st
    starts 0.2 s after the first; a local server answers them unpaced far sooner)."""
    async with serving(answer) as (_, port):
        began = time.perf_counter()
        level = await run_concurrency(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", 4, max_requests=21,
                                      max_seconds=60, timeout=30, request=one_unary_request, rate=100.0)  # fmt: skip
        took = time.perf_counter() - began
    assert (level.requests, level.errors) == (21, 0), level.error_samples
    assert took >= 0.2


def test_agentic_history_has_about_four_bytes_per_token() -> None:
    messages = agentic_messages(10_000)
    text = sum(len(m["content"]) for m in messages)
    assert 0.9 * 40_000 <= text <= 1.1 * 40_000
    assert {m["role"] for m in messages} == {"system", "user", "tool", "assistant"}


@pytest.mark.slow
@pytest.mark.parametrize("front", ["both-gates", "parsed", "parsed-msgpack", FLOOR])
def test_a_deployment_serves_the_load_generator(front: str) -> None:
    with Deployment(front, 2000) as dep:
        assert cpu_seconds(dep.front.proc.pid) >= 0 and rss_bytes(dep.front.proc.pid) > 0  # type: ignore[union-attr]
        body = chat_body(2000, model="synthetic", max_tokens=4)
        level = asyncio.run(
            run_concurrency(
                dep.url + "/v1/chat/completions", body, 4, max_requests=12, max_seconds=60, timeout=30
            )
        )
    assert level.requests == 12
    assert level.errors == 0, level.error_samples
    assert level.ttft_p50_ms is not None and level.completions_per_s > 0


@pytest.mark.slow
def test_load_cli_writes_results_and_a_plot(tmp_path: Path) -> None:
    from bench import load

    with Deployment("both-gates", 2000) as dep:
        argv = ["--url", dep.url, "--concurrency", "1,2", "--requests", "6", "--prompt-tokens", "2000",
                "--max-tokens", "4", "--model", "synthetic",
                "--output", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]  # fmt: skip
        assert load.main(argv) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert [lv["concurrency"] for lv in results["levels"]] == [1, 2]
    assert all(lv["requests"] == 6 and lv["errors"] == 0 for lv in results["levels"])
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_hundreds_of_concurrent_streams_complete_without_errors() -> None:
    """512 streaming requests, 256 at a time, through a real orchestrator: none fails, none times out."""
    with Deployment("both-gates", 2000) as dep:
        body = chat_body(2000, model="synthetic", max_tokens=8)
        level = asyncio.run(
            run_concurrency(
                dep.url + "/v1/chat/completions", body, 256, max_requests=512, max_seconds=120, timeout=60
            )
        )
    assert level.requests == 512
    assert (level.errors, level.timeouts) == (0, 0), level.error_samples


def test_the_relay_benchmark_races_every_contender_on_the_same_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bench.relay checks first that every contender (the msgpack leg decoded) builds the request
    the fast relay builds, then prints one row per size with each contender's time."""
    from bench import relay as bench_relay

    assert bench_relay.main(["--sizes", "1000", "--min-time", "0.01"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| prompt ids"))
    assert "(a') pydantic msgpack" in header and "a'/e" in header
    row = next(line for line in out.splitlines() if line.startswith("| 1,000"))
    assert len(row.split("|")) == len(header.split("|"))


@pytest.mark.slow
def test_the_agentic_benchmark_runs_every_router_and_cache_routing_computes_less(tmp_path: Path) -> None:
    """A short bench.agentic (synthetic text-mode workers): every router answers every turn,
    kv_cache_aware + conditional disaggregation prefills some turns on the generation worker, and
    the cache-aware routings compute fewer prompt ids than round robin.

    Deterministic: each worker's cache holds every conversation (no routing evicts), and a
    conversation never leaves its worker (load_factor 0), so the cache-aware routings compute each
    turn's new ids only, whichever worker the ring gives each conversation (its points are the
    workers' URLs, whose ports vary); round robin moves conversations between workers."""
    from bench import agentic

    out = tmp_path / "agentic.json"
    # 5 conversations on 2 workers: round robin cannot map one to the same worker turn after turn
    argv = ["--conversations", "5", "--turns", "4", "--first-tokens", "3000", "--turn-tokens", "500",
            "--max-tokens", "8", "--kv-tokens", "32000", "--max-local-prefill", "1024",
            "--conversation-load-factor", "0", "--output", str(out)]  # fmt: skip
    agentic.main(argv)  # its exit code is the targets, which a run this short need not meet
    results = {r["routing"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(agentic.ROUTINGS)
    assert all(r["turns"] == 20 and r["errors"] == 0 for r in results.values()), results
    assert results["kv_cache_aware+conditional"]["paths"].get("local_prefill", 0) > 0
    assert results["round_robin"]["paths"].get("local_prefill", 0) == 0
    for name in ("conversation", "kv_cache_aware", "kv_cache_aware+conditional"):
        assert results[name]["prefill_computed_tokens"] < results["round_robin"]["prefill_computed_tokens"], (
            name
        )
        assert results[name]["prefix_hit_tokens"] > 0


@pytest.mark.slow
def test_the_agentic_benchmark_on_the_tiny_model_reuses_real_kv_blocks() -> None:
    from bench import agentic

    assert agentic.main(["--tiny"]) == 0  # 0: every turn answered and the workers' caches hit


def test_the_cluster_abuse_benchmark_runs_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import cluster_abuse

    assert cluster_abuse.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "| 403 x50 " in out and "| 413 x40 " in out and "| 400 x6 " in out  # refused, not stored
    assert "etcd: skipped" in out or "s after start" in out  # a prefix of junk never blocks the sync
    assert "| load_factor 1.25 (default)       | 400               | 125 " in out
    streams = [
        c.strip() for c in out.split("streams (never read")[1].strip().splitlines()[-1].split("|")[1:-1]
    ]
    assert streams[:2] == ["8", "8"] and streams[4] == "8"  # every slot held, then every stream dropped


def test_the_request_path_benchmark_serves_unary_and_streaming_requests_in_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bench.request_path without valgrind: the real orchestrator on canned stand-in workers answers
    every request 200 (each read asserts it), unary and streaming; --profile reports calls per request."""
    from bench import request_path

    request_path.main(["--requests", "3"])
    request_path.main(["--profile", "3", "--stream", "--gates-off"])
    request_path.main(["--bytecodes", "3", "--unary"])
    request_path.main(
        ["--requests", "2", "--unary", "--prompt-tokens", "40000"]
    )  # a 160 KB body, 214 KB of ids
    out = capsys.readouterr().out
    assert "unary, gates on, 40000 prompt tokens: 2 requests" in out
    # the orchestrator's own files among the top ones (exchange.py: a completion from callbacks)
    assert "server/orchestrator/exchange.py" in out.split("bytecodes per request:")[1]
    assert "unary, gates on: 3 requests" in out and "streaming, gates on: 3 requests" in out
    assert "# streaming, gates off" in out and "Python function calls per request" in out
