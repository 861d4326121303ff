"""Token figures learned from the workers (server/orchestrator/estimates.py) and the routing-quality
metrics; the kv_cache_aware router's inverted index (server/orchestrator/routing/prefix_index.py).

The end-to-end test runs real tiny workers (byte tokenizer: one byte per token) behind a real
orchestrator on 127.0.0.1: conditional disaggregation decides in their tokens, not in a fixed guess.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
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
    MAX_STEP,
    BytesPerToken,
    UsageLearner,
    read_usage,
)
from server.orchestrator.pools import Capabilities, HealthChecker, Pool, Worker
from server.orchestrator.routing import KvCacheAwareRouter, RequestKey, make_router, request_key
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SyntheticEngine

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


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        (b'{"model": "m",' + b" " * 1000 + b'"messages": [{"role": "user", "content": "hi"}]}', True, 35),
        (b'{"prompt": "abc", "messages": [1]}', False, 5),  # completions: the prompt's span
        (b'{"prompt": [1, 2, 3]}', False, 9),
        (b'{"model": "m", "prompt": "abc"}', True, 0),  # chat without messages: nothing to learn from
    ],
    ids=["padded-chat", "completions", "completion-ids", "chat-without-messages"],
)
def test_the_client_scan_gives_the_prompts_span_not_the_body(
    relay_twin: ModuleType, body: bytes, chat: bool, expected: int
) -> None:
    """What bytes per token is learned from (both relay twins; the parsed relay modes' own scan
    agrees): a client's padding outside its prompt is not a byte of it."""
    from server.orchestrator.relay_common import ClientRequest
    from server.orchestrator.relay_parsed import ParsedRelay

    try:
        scan = fastcore.relay.Relay(relay_twin).read_client_request(body, chat)
    except fastcore.RelayError:  # chat without messages: refused before anything is learned
        assert expected == 0
        return
    assert scan.prompt_bytes == expected
    parsed = ParsedRelay(tokids_b64=True, strip_history=False)
    assert parsed.prompt_bytes(ClientRequest(body, chat, False, False, None, None)) == expected


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


@pytest.fixture
def estimate_class(tally_twin: Callable[[str], Any]) -> Any:
    """Both twins of BytesPerToken (conftest's ``tally_twin``: the compiled one skipped where it is not
    built, a failure under FASTCORE_REQUIRE_EXTENSIONS=1)."""
    return tally_twin("BytesPerToken")


def test_a_long_prompt_weighs_more_than_a_short_one(estimate_class: Any) -> None:
    long_first, short_first = estimate_class(), estimate_class()
    for estimate in long_first, short_first:
        estimate.seed(2.0)
    long_first.observe(100_000, 50_000)  # 2 bytes per token, long
    long_first.observe(30, 10)  # 3, short
    short_first.observe(30_000, 10_000)  # 3, as long
    assert long_first.value < 2.001 and short_first.value > 2.05


def test_one_padded_prompt_moves_the_estimate_by_at_most_a_few_percent(estimate_class: Any) -> None:
    """5.6 MB of whitespace in one tenant's prompt took the pool's figure from 4.0 to 29.5 (and every
    tenant's token limit ~6x up with it): one answer now moves it by at most MAX_STEP, and a tenant
    sending a tenth of the prompt tokens, every one of them padded, moves it ~12%, not 7x."""
    estimate = estimate_class()
    for _ in range(300):
        estimate.observe(4_000, 1_000)
    assert estimate.value == pytest.approx(4.0)
    estimate.observe(5_600_000, 100_000)  # a long prompt padded to 56 bytes a token: was 4.0 -> 30
    assert 4.0 < estimate.value <= 4.0 * MAX_STEP + 1e-9
    for i in range(2_000):
        estimate.observe(56_000 if i % 10 == 0 else 4_000, 1_000)
    assert estimate.value < 4.6


def test_a_wrong_start_is_corrected_by_agreeing_answers(estimate_class: Any) -> None:
    """Bounded steps still get there: 1 byte per token from the 4 of before anything is known."""
    estimate = estimate_class()
    values = []
    for _ in range(300):
        estimate.observe(10_000, 10_000)
        values.append(estimate.value)
    assert values[0] == pytest.approx(4.0 / MAX_STEP) and values[19] < 1.8 and values[-1] < 1.02


def test_usage_teaches_both_pools_and_scores_the_prediction() -> None:
    context, generation = KvCacheAwareRouter({"chunk_bytes": 64}), make_router("round_robin")
    for router in context, generation:
        router.estimate.seed(2.0)
    learner = UsageLearner(context, generation)
    usage = {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 500}}
    learner.context_answer(answer(usage), 2000, hit_chunks=10)  # 2 bytes per token
    assert context.estimate.value == generation.estimate.value == pytest.approx(2.0)
    assert context.estimate.observed == 1
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
    for _ in range(300):
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
    """Tiny workers count one token per byte. Once answers have taught the orchestrator that (the
    first one's ratio replayed as the hundred answers the bounded steps take to converge), a
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
            got = await ask(session, warm)  # 1,200 tokens even at 4 bytes each: both legs
            assert orch.context_pool.router.estimate.observed == 1
            for _ in range(300):  # as many answers of this ratio would: each moves it by at most 5%
                orch.usage.learn(len(json.dumps(warm).encode()), got["usage"]["prompt_tokens"])
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


# -- local prefill's answers teach too (issue 36, 9) -----------------------------------------------------


class _UnpublishedEngine(SyntheticEngine):
    """A text-mode synthetic engine, one byte a token, that publishes no bytes_per_token (as a torch
    worker does not): the orchestrator starts from its guess of 4 and must learn the rest."""

    @property
    def bytes_per_token(self) -> int | None:
        return None


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_local_prefill_answers_correct_a_wrong_guess(stream: bool) -> None:
    """1,600-byte prompts of 1,600 tokens with max_local_prefill_length 512: at the guessed 4 bytes a
    token they look like 400 and are prefilled locally, where no context answer ever teaches the
    figure, so the guess kept itself (seven 1,386-token prompts all went local). Local answers' usage
    (the body's; a stream's last chunk's) now teaches it, and the prompts soon take both legs."""
    started = [
        await start_worker(
            _UnpublishedEngine(0, bytes_per_token=1), WorkerSettings(role=role, model_name="synthetic")
        )
        for role in ("context", "generation")
    ]
    router = {"type": "kv_cache_aware"}
    config = build_config(
        {
            "port": 0,
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [f"http://127.0.0.1:{started[0][1]}"], "router": router},
            "generation_servers": {"urls": [f"http://127.0.0.1:{started[1][1]}"], "router": router},
            "conditional_disagg_config": {"max_local_prefill_length": 512},
        },
        environ={},
    )
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    estimate = orch.generation_pool.router.estimate
    paths = []
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                if orch.context_pool.ready and orch.generation_pool.ready:
                    break
                await asyncio.sleep(0.05)
            for i in range(20):
                body: dict[str, Any] = {"model": "synthetic", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": f"{i:04d} " + "x" * 1560}]}  # fmt: skip
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                seen = await _metrics(session, url)
                paths.append(
                    seen.get('fastcore_orchestrator_requests_by_path_total{path="disaggregated"}', 0)
                )
                if paths[-1]:
                    break
    finally:
        await server.cleanup()
        for s, _ in started:
            await s.cleanup()
    assert estimate.observed >= 5 and estimate.value < 3.2, (estimate.observed, estimate.value)
    assert paths[0] == 0 and paths[-1] == 1 and len(paths) <= 8, paths
