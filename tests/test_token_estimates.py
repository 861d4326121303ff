"""Token figures learned from the workers (server/orchestrator/estimates.py) and the routing-quality
metrics; the kv_cache_aware router's inverted index (server/orchestrator/routing.py).

The end-to-end test runs real tiny workers (byte tokenizer: one byte per token) behind a real
orchestrator on 127.0.0.1: conditional disaggregation decides in their tokens, not in a fixed guess.
"""

from __future__ import annotations

import asyncio
import json
import random
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from helpers import free_port
from tiny_workers import one_torch_thread, tiny_worker  # noqa: F401 (autouse fixture)

import fastcore
import fastcore.relay
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.orchestrator.estimates import (
    DEFAULT_BYTES_PER_TOKEN,
    BytesPerToken,
    UsageLearner,
    read_usage,
)
from server.orchestrator.pools import Capabilities, HealthChecker, Pool, Worker
from server.orchestrator.routing import KvCacheAwareRouter, RequestKey, make_router, request_key

# -- reading usage ----------------------------------------------------------------------------------


def answer(usage: Any) -> bytes:
    choices = [
        {"index": 0, "text": 'a "usage" in a string: {\\"prompt_tokens\\": 9}', "prompt_token_ids": [1, 2]}
    ]
    return json.dumps({"id": "x", "choices": choices, "usage": usage}).encode()


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (
            {"prompt_tokens": 123, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 64}},
            (123, 64),
        ),
        ({"prompt_tokens": 7}, (7, None)),
        ({"prompt_tokens": 7, "prompt_tokens_details": None}, (7, None)),
        ({"prompt_tokens": -7, "prompt_tokens_details": {"cached_tokens": 1.5}}, (None, None)),
        ({"prompt_tokens": "7"}, (None, None)),
        ({"prompt_tokens": 10**30}, (None, None)),  # no worker's count: not a number to learn from
        (None, (None, None)),
    ],
)
def test_read_usage_finds_both_numbers_without_a_parse(
    usage: Any, expected: tuple[int | None, int | None]
) -> None:
    assert read_usage(answer(usage)) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # usage first, a "usage" string value after it: the tail is no object, the whole is scanned
        (b'{"usage": {"prompt_tokens": 5}, "choices": [{"role": "usage"}]}', (5, None)),
        (b'{"usage": {"prompt_tokens": 5}, "note": "\\"usage\\": 9"}', (5, None)),  # escaped quotes
        (
            b'{"x": "usage", "usage": {"prompt_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}}}',
            (6, 2),
        ),
    ],
)
def test_read_usage_where_the_last_usage_is_no_key(body: bytes, expected: tuple[int, int | None]) -> None:
    assert read_usage(body) == expected


@pytest.mark.parametrize(
    "body", [b"", b"not json", b"[1, 2]", b'{"usage": {"prompt_tokens": 1, "prompt_tokens": 2}}']
)
def test_read_usage_of_junk_is_nothing(body: bytes) -> None:
    assert read_usage(body) == (None, None)


USAGES = [
    {"prompt_tokens": 123, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 64}},
    {"prompt_tokens": 7},
    {"prompt_tokens": 7, "prompt_tokens_details": None},
    {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}},
    {"prompt_tokens": -7, "prompt_tokens_details": {"cached_tokens": 1.5}},
    {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": -1}},
    {"prompt_tokens": 7e3, "prompt_tokens_details": {"cached_tokens": "3"}},
    {"prompt_tokens": "7"},
    {"prompt_tokens": 10**14},  # 15 digits: a count
    {"prompt_tokens": 10**15},  # 16: no worker's
    {"prompt_tokens": 10**30},
    {"prompt_tokens": True},
    {"prompt_tokens_details": {"cached_tokens": 5}},
    {},
    5,
    None,
]


def context_answer(usage: Any) -> bytes:
    """A context answer as our workers write it (the ids after ``usage``) with this ``usage``."""
    body = {
        "id": "x",
        "choices": [{"index": 0, "text": "a", "finish_reason": "not_finished", "disaggregated_params": {}}],
        "usage": usage,
        "prompt_token_ids_b64": "AQAAAA==",
    }
    return json.dumps(body).encode()


@pytest.mark.parametrize("usage", USAGES)
def test_the_relays_context_scan_reads_the_usage_tokens_read_usage_reads(
    relay_twin: ModuleType, usage: Any
) -> None:
    """The fast relay's one validating scan of a context answer finds ``usage``' two counts with the
    rest (ContextScan.usage_tokens, both twins): what read_usage, the parsed relay modes' own scan,
    reads from the same bytes."""
    body = context_answer(usage)
    scan = fastcore.relay.Relay(relay_twin).read_context_response(body, None)
    assert scan.usage_tokens() == read_usage(body)


def test_the_orchestrators_learner_reads_the_counts_of_the_relays_context_scan(
    relay_twin: ModuleType,
) -> None:
    """A context response as our workers write it (prompt_token_ids_b64 last, after usage)."""
    from bench.orchestrator_work import context_response

    body = context_response(list(range(4000)), b64=True)
    assert body.index(b'"usage"') < body.index(b"prompt_token_ids_b64")
    scan = fastcore.relay.Relay(relay_twin).read_context_response(body, None)
    assert scan.usage_tokens() == read_usage(body) == (4000, None)
    context, generation = make_router("round_robin"), make_router("round_robin")
    UsageLearner(context, generation).context_answer(body, 16000, None, scan.usage_tokens())
    assert context.estimate.observed == generation.estimate.observed == 1
    assert context.estimate.value == generation.estimate.value == pytest.approx(4.0)


# -- the estimate -----------------------------------------------------------------------------------


def test_an_estimate_learns_from_answers_and_a_seed_only_starts_it() -> None:
    estimate = BytesPerToken()
    assert estimate.value == DEFAULT_BYTES_PER_TOKEN and estimate.tokens(4000) == 1000
    estimate.seed(2.0)
    assert estimate.value == 2.0 and estimate.observed == 0
    for _ in range(50):
        estimate.observe(3000, 1000)  # the workers count 3 bytes per token
    assert abs(estimate.value - 3.0) < 0.1 and estimate.observed == 50
    estimate.seed(8.0)  # a seed after answers: ignored
    assert abs(estimate.value - 3.0) < 0.1


@pytest.mark.parametrize(
    ("nbytes", "tokens"), [(1000, 0), (1000, None), (0, 10), (1000, 10_000), (10**6, 10)]
)
def test_an_estimate_ignores_samples_no_tokenizer_gives(nbytes: int, tokens: int | None) -> None:
    estimate = BytesPerToken()
    estimate.observe(nbytes, tokens)
    assert estimate.value == DEFAULT_BYTES_PER_TOKEN and estimate.observed == 0


def test_a_long_prompt_weighs_more_than_a_short_one() -> None:
    estimate = BytesPerToken()
    estimate.observe(100_000, 100_000)  # 1 byte per token, long
    estimate.observe(40, 10)  # 4, short
    assert estimate.value < 1.01


def test_usage_teaches_both_pools_and_scores_the_prediction() -> None:
    context, generation = KvCacheAwareRouter({"chunk_bytes": 64}), make_router("round_robin")
    learner = UsageLearner(context, generation)
    usage = {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 500}}
    learner.context_answer(answer(usage), 2000, hit_chunks=10)  # 2 bytes per token
    assert context.estimate.value == generation.estimate.value == 2.0
    assert context.predicted_tokens == 10 * 64 // 2 and context.achieved_tokens == 500
    assert context.error_tokens == 500 - 320
    learner.context_answer(answer(None), 2000, hit_chunks=10)  # no usage: nothing learned
    assert context.estimate.observed == 1 and context.achieved_tokens == 500


def test_the_index_bound_follows_the_learned_bytes_per_token() -> None:
    """A worker of 2,048 KV tokens at 1 byte per token holds 32 chunks of 64 bytes, not 128 (the
    fixed 4-byte guess held four times what it caches, as hits it no longer has)."""
    router = KvCacheAwareRouter({"chunk_bytes": 64})
    worker = Worker("http://w")
    worker.healthy, worker.kv_capacity_tokens = True, 2048
    assert router._limit(worker) == 2048 * 4 // 64
    for _ in range(20):
        router.estimate.observe(10_000, 10_000)
    assert router._limit(worker) == 32
    key = request_key(
        json.dumps({"messages": [{"role": "user", "content": "x" * 64 * 200}]}).encode(), True, None
    )
    router.choose([worker], key)
    assert len(router.index(worker).entries) <= 32 + 32 // 4


async def test_a_published_bytes_per_token_seeds_the_pool() -> None:
    """A synthetic text-mode worker publishes ``bytes_per_token`` in /server_info: the health check
    seeds its pool's estimate with it."""
    from server.worker.app import WorkerSettings, start_worker
    from server.worker.synthetic import SyntheticEngine

    server, port = await start_worker(
        SyntheticEngine(0, bytes_per_token=3), WorkerSettings(role="generation")
    )
    pool = Pool("generation", [f"http://127.0.0.1:{port}"], "kv_cache_aware")
    try:
        async with aiohttp.ClientSession() as session:
            await HealthChecker([pool], session, interval=60.0, timeout=2.0).check_all()
        assert pool.router.estimate.value == 3.0
    finally:
        await server.cleanup()
    assert Capabilities.of({"bytes_per_token": True}).bytes_per_token is None
    assert Capabilities.of({"bytes_per_token": -1}).bytes_per_token is None


# -- the inverted index -----------------------------------------------------------------------------


def _key(conversation: int, turns: int) -> RequestKey:
    messages = [{"role": "system", "content": "shared " * 40}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"{conversation}-{t} " + "u" * 150})
    return request_key(json.dumps({"messages": messages}).encode(), True, None)


def test_the_inverted_index_mirrors_the_per_worker_indexes_and_picks_the_best_score() -> None:
    """Random traffic over 6 workers with small indexes (evictions), loads and departures: every
    chunk's holders are exactly the workers whose index holds it, and each choice scores as high as
    the best of a scan of every worker's index would."""
    rng = random.Random(7)
    router = KvCacheAwareRouter({"chunk_bytes": 32, "max_cached_tokens": 400, "load_weight": 8})
    fleet = [Worker(f"http://w{i}") for i in range(6)]
    for w in fleet:
        w.healthy = True
    for step in range(600):
        for w in fleet:
            w.in_flight = rng.randrange(4)
        candidates = [w for w in fleet if rng.random() < 0.8] or fleet[:1]
        key = _key(rng.randrange(12), rng.randrange(1, 8))
        mean = sum(w.in_flight for w in candidates) / len(candidates)
        hot = max(mean * router.max_load_ratio, mean + 1)
        per_chunk = 32 / router.estimate.value

        def score(w: Worker, key: RequestKey = key, mean: float = mean, hot: float = hot,
                  per_chunk: float = per_chunk) -> float:  # fmt: skip
            hit = router.expected_hit(w, key) if w.in_flight <= hot else 0
            return hit * per_chunk - 8 * (w.in_flight - mean)

        scores = {w: score(w) for w in candidates}  # before the choice indexes the request
        chosen = router.choose(candidates, key)
        assert chosen in candidates and scores[chosen] == max(scores.values()), step
        if step % 97 == 0:
            router.forget(fleet[rng.randrange(6)])
        for h, holders in router._holders.items():
            assert holders and all(h in router._indexes[w].entries for w in holders)
        for w, index in router._indexes.items():
            assert all(w in router._holders[h] for h in index.entries)
    router.sync(fleet[:2])
    assert set(router._indexes) <= set(fleet[:2])
    assert all(holders <= set(fleet[:2]) for holders in router._holders.values())


# -- conditional disaggregation in real tokens ------------------------------------------------------


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    rows = (row.rsplit(" ", 1) for row in text.splitlines() if row and not row.startswith("#"))
    return {name: float(value) for name, value in rows}


async def test_conditional_disaggregation_decides_in_the_workers_tokens() -> None:
    """Tiny workers count one token per byte. After one answer has taught the orchestrator that, a
    first turn of ~900 bytes (900 tokens, more than max_local_prefill_length 300; 225 at the old
    fixed 4 bytes per token, which prefilled it locally) takes the context leg, and its short
    follow-up (the prefix cached on the generation worker) is prefilled there. The context pool's
    predicted and achieved hit tokens reach /metrics."""
    ctx, gen = await tiny_worker("context"), await tiny_worker("generation")
    router = {"type": "kv_cache_aware", "args": {"chunk_bytes": 64}}
    config = build_config(
        {
            "port": free_port(),
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [ctx.url], "router": router},
            "generation_servers": {"urls": [gen.url], "router": router},
            "conditional_disagg_config": {"max_local_prefill_length": 300},
        },
        environ={},
    )
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{config.port}"
    by_path = 'fastcore_orchestrator_requests_by_path_total{path="%s"}'

    async def ask(session: aiohttp.ClientSession, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": "tiny", "messages": messages, "max_tokens": 4}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    try:
        for _ in range(200):
            if orch.context_pool.ready and orch.generation_pool.ready:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            warm = [{"role": "user", "content": "w" * 1200}]
            await ask(session, warm)  # 1,200 tokens even at 4 bytes each: both legs
            # its prefix again, and 500 tokens more: both legs, the context worker's cache serving the prefix
            await ask(session, [*warm, {"role": "user", "content": "v" * 500}])
            seen = await _metrics(session, url)
            assert seen[by_path % "disaggregated"] == 2
            assert 0.9 < seen['fastcore_orchestrator_bytes_per_token{pool="context"}'] < 1.2
            predicted = seen['fastcore_orchestrator_prefix_predicted_hit_tokens_total{pool="context"}']
            achieved = seen['fastcore_orchestrator_prefix_achieved_hit_tokens_total{pool="context"}']
            error = seen['fastcore_orchestrator_prefix_hit_error_tokens_total{pool="context"}']
            assert predicted > 900 and achieved > 900 and error < 0.1 * achieved, seen

            first = [{"role": "user", "content": "the file reads " * 60}]  # 900 bytes
            got = await ask(session, first)
            assert got["usage"]["prompt_tokens"] > 300
            seen = await _metrics(session, url)
            assert seen[by_path % "disaggregated"] == 3 and seen.get(by_path % "local_prefill", 0) == 0

            follow = [*first, got["choices"][0]["message"], {"role": "user", "content": "and then?"}]
            await ask(session, follow)
            seen = await _metrics(session, url)
            assert seen[by_path % "disaggregated"] == 3 and seen[by_path % "local_prefill"] == 1
    finally:
        await server.cleanup()
        for w in (ctx, gen):
            await w.server.cleanup()
