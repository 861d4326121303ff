"""What a router learns from torch workers (issue 38 item 4, the worker's side).

- ``/server_info`` ``bytes_per_token``: seeded from the worker's tokenizer on a fixed sample, then
  the running ratio of the prompt spans it receives (``messages`` / ``prompt`` bytes as sent) to
  the ids it tokenizes them into, in the orchestrator's units and type
  (:class:`server.orchestrator.pools.Capabilities`).
- ``GET /cache_events`` from the torch engine's paged prefix cache: a prompt's keys stored once its
  full blocks are registered (whole or chunk by chunk), removed with the block each maps to when
  it is evicted; a kv_cache_aware orchestrator in front of real torch workers with a small KV pool
  (evictions) ends with an index that says what the workers hold.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

from helpers import free_port
from tiny_workers import one_torch_thread, tiny_worker  # noqa: F401

from fastcore import protocol as wire
from server.cache_keys import prompt_keys
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.orchestrator.pools import Capabilities
from server.orchestrator.routing import KvCacheAwareRouter, request_key
from server.worker.kv_cache import PagedKVCache
from server.worker.kv_events import ChunkEventLog
from server.worker.prompt_bytes import DECAY, SAMPLE_MESSAGES, PromptBytesPerToken, prompt_span_bytes
from server.worker.tiny import build_tiny

CHUNK = 64
BS = 16


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | bytes, **kw: Any) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, **kw) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# -- bytes_per_token ------------------------------------------------------------------------------------


def test_the_seed_is_the_sample_chat_as_the_worker_tokenizes_it() -> None:
    _, _, tokenizer = build_tiny()
    meter = PromptBytesPerToken(tokenizer)
    ids = tokenizer.encode(tokenizer.apply_chat_template(SAMPLE_MESSAGES), add_special_tokens=False)
    assert meter.seed == len(json.dumps(SAMPLE_MESSAGES).encode()) / len(ids)
    assert meter.value == round(meter.seed, 4)


def test_the_seed_is_near_a_long_chat_prompts_own_figure() -> None:
    """Issue 38's case: 1,386-token chat prompts on ``tiny`` read as 370 tokens at the orchestrator's
    default of 4; the seed is within 5% of their true figure before any answer."""
    _, _, tokenizer = build_tiny()
    text = "The agent reads pools.py, then config.yaml; it writes the patch and runs the tests. " * 20
    messages = [{"role": "user", "content": text[:1382]}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert len(ids) == 1386
    true = len(json.dumps(messages).encode()) / len(ids)
    assert abs(PromptBytesPerToken(tokenizer).seed / true - 1) < 0.05


def test_a_tokenizer_without_a_chat_is_measured_on_the_sample_text() -> None:
    class Plain:
        def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
            raise ValueError("no chat template")

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return list(range(len(text) // 3))

    meter = PromptBytesPerToken(Plain())
    text = " ".join(m["content"] for m in SAMPLE_MESSAGES)
    assert meter.seed == len(json.dumps(text).encode()) / (len(text) // 3)


def test_a_ratio_no_tokenizer_gives_is_not_counted() -> None:
    _, _, tokenizer = build_tiny()
    meter = PromptBytesPerToken(tokenizer)
    before = meter.value
    meter.observe(1000, 0)
    meter.observe(1000, 1)  # 1000 bytes a token
    meter.observe(10, 1000)
    assert meter.value == before

    class Silent:  # counts no ids at all: the orchestrator's default stands in
        def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
            return ""

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return []

    assert PromptBytesPerToken(Silent()).value == 4.0


def test_the_span_is_the_prompts_own_bytes() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    assert prompt_span_bytes(body, True) == len(b'[{"role": "user", "content": "hi"}]')
    assert prompt_span_bytes(b'{"prompt": "a\\"b"}', False) == len(b'"a\\"b"')
    assert prompt_span_bytes(b'{"prompt": "x"}', True) == 0  # chat without messages
    assert prompt_span_bytes(b"not json", False) == 0


async def test_server_info_publishes_the_measured_ratio_in_the_routers_type() -> None:
    worker = await tiny_worker()
    try:
        async with aiohttp.ClientSession() as session:
            info = await _get(session, worker.url + wire.SERVER_INFO_PATH)
            seed = info[wire.INFO_BYTES_PER_TOKEN]
            assert isinstance(seed, float) and Capabilities.of(info).bytes_per_token == seed
            expected_bytes, expected_tokens = _seed_sums(worker)
            # JSON-escaped text: many bytes per id (the byte tokenizer's id is one character)
            for i in range(3):
                text = f'say "{i}"\\n\t' * 20
                body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()
                answer = await _post(session, worker.url + "/v1/completions", body)
                span = prompt_span_bytes(body, False)
                expected_bytes = expected_bytes * DECAY + span
                expected_tokens = expected_tokens * DECAY + answer["usage"]["prompt_tokens"]
            # a prompt given as ids is no text the worker tokenized: not counted
            await _post(session, worker.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7] * 30,
                                                                   "max_tokens": 1})  # fmt: skip
            # nor a msgpack body (its span is not the bytes an orchestrator measured)
            packed = msgspec.msgpack.encode({"model": "tiny", "prompt": "xy" * 100, "max_tokens": 1})
            await _post(session, worker.url + "/v1/completions", packed, headers={"X-TRTLLM-Msgpack": "1"})
            info = await _get(session, worker.url + wire.SERVER_INFO_PATH)
            measured = info[wire.INFO_BYTES_PER_TOKEN]
            assert measured == round(expected_bytes / expected_tokens, 4) and measured > seed
    finally:
        await worker.server.cleanup()


def _seed_sums(worker: Any) -> tuple[float, float]:
    tokenizer = worker.engine.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(SAMPLE_MESSAGES), add_special_tokens=False)
    return float(len(json.dumps(SAMPLE_MESSAGES).encode())), float(len(ids))


async def test_the_synthetic_worker_keeps_its_own_figure() -> None:
    from tiny_workers import synthetic_worker

    worker = await synthetic_worker()  # fixed prompts: no figure at all
    try:
        async with aiohttp.ClientSession() as session:
            info = await _get(session, worker.url + wire.SERVER_INFO_PATH)
            assert wire.INFO_BYTES_PER_TOKEN not in info
    finally:
        await worker.server.cleanup()


async def test_conditional_disaggregation_sends_the_first_long_turn_to_the_context_worker() -> None:
    """Issue 38's case as a new user met it: max_local_prefill_length 512 in front of tiny context and
    generation workers. The first 1,386-token turn (its messages 370 tokens at the orchestrator's old
    4 bytes a token, so all seven such prompts were prefilled locally) goes through the context
    worker: the pools start from the workers' published bytes_per_token. After its answer each
    pool's figure is within 10% of the worker's /server_info figure and of the prompt's own."""
    text = "The agent reads pools.py, then config.yaml; it writes the patch and runs the tests. " * 20
    messages = [{"role": "user", "content": text[:1382]}]
    ctx, gen = await tiny_worker("context"), await tiny_worker("generation")
    router = {"type": "kv_cache_aware"}
    config = build_config(
        {
            "port": 0,
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [ctx.url], "router": router},
            "generation_servers": {"urls": [gen.url], "router": router},
            "conditional_disagg_config": {"max_local_prefill_length": 512},
        },
        environ={},
    )
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        for _ in range(200):
            if orch.context_pool.ready and orch.generation_pool.ready:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny", "messages": messages, "max_tokens": 4}
            answer = await _post(session, url + "/v1/chat/completions", body)
            assert answer["usage"]["prompt_tokens"] == 1386
            async with session.get(url + "/metrics") as resp:
                page = await resp.text()
            by_path = 'fastcore_orchestrator_requests_by_path_total{path="%s"} 1'
            assert by_path % "disaggregated" in page and 'path="local_prefill"} 1' not in page, page
            true = len(json.dumps(messages).encode()) / 1386
            for worker, pool in ((ctx, orch.context_pool), (gen, orch.generation_pool)):
                published = (await _get(session, worker.url + wire.SERVER_INFO_PATH))[
                    wire.INFO_BYTES_PER_TOKEN
                ]
                learned = pool.router.estimate.value
                assert abs(learned / published - 1) < 0.1 and abs(learned / true - 1) < 0.1, (
                    pool.name, learned, published, true,
                )  # fmt: skip
    finally:
        await server.cleanup()
        for w in (ctx, gen):
            await w.server.cleanup()


# -- the paged cache's key log ---------------------------------------------------------------------------


def _cache(blocks: int) -> PagedKVCache:
    config, _, _ = build_tiny()
    cache = PagedKVCache(config, blocks * BS, block_size=BS, prefix_caching=True)
    cache.chunks = ChunkEventLog("w", CHUNK, BS)
    return cache


def _completion(text: str) -> bytes:
    return json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_prompts_keys_are_stored_with_its_blocks_and_go_with_them(chunks: int) -> None:
    """Registered whole or chunk by chunk (chunked prefill), the same keys; an eviction takes the
    keys of the blocks it evicts."""
    cache = _cache(24)
    log = cache.chunks
    assert log is not None
    body = _completion("the agent reads the file " * 12)  # 302 bytes of span, 4 keys
    keys, span = prompt_keys(body, False, CHUNK)
    ids = np.arange(3, 3 + 301, dtype=np.int32) % 250
    log.track("a", body, False)
    blocks, _ = cache.allocate_prefix(ids, 302)
    done = (0, b"")
    for end in np.linspace(0, 301, chunks + 1)[1:].astype(int):
        done = cache.register(blocks, ids, int(end), done, ("a", 301))
    assert log.answer(0, "w")["events"] == [{"seq": 1, "stored": keys}] and span == 302
    cache.free(blocks)
    cache.allocate(24 * BS - 4 * BS)  # takes the free blocks, then the oldest cached: a's first ones
    gone = log.answer(1, "w")["events"]
    assert gone and all("removed" in e for e in gone)
    removed = [k for e in gone for k in e["removed"]]
    assert removed == keys[:3] and set(log.held) == {keys[3]}  # its block (15) was not taken


def test_without_an_owner_or_a_follower_nothing_is_stored() -> None:
    cache = _cache(8)
    log = cache.chunks
    assert log is not None
    body = _completion("x" * 100)
    log.track("a", body, False)
    ids = np.arange(101, dtype=np.int32)
    blocks, _ = cache.allocate_prefix(ids, 102)
    cache.register(blocks, ids, 101)  # no owner: trtllm's events only
    assert log.seq == 0
    cache.register(blocks, ids, 101, (6, b""), ("a", 101))  # registered before: nothing new
    assert log.seq == 0


def test_an_update_after_the_loop_closed_is_dropped_not_raised() -> None:
    """The engine thread may register blocks after the worker's loop closed (it stops): the key
    log's update is dropped, and the engine's step does not fail for it."""
    config, _, _ = build_tiny()
    cache = PagedKVCache(config, 8 * BS, block_size=BS, prefix_caching=True)
    loop = asyncio.new_event_loop()

    async def follow() -> None:
        cache.chunks = ChunkEventLog("w", CHUNK, BS)

    loop.run_until_complete(follow())
    loop.close()
    log = cache.chunks
    assert log is not None
    body = _completion("x" * 100)
    log.track("a", body, False)
    ids = np.arange(101, dtype=np.int32)
    blocks, _ = cache.allocate_prefix(ids, 102)
    assert cache.register(blocks, ids, 101, (0, b""), ("a", 101))[0] == 6
    assert log.seq == 0


# -- an orchestrator following real torch workers -----------------------------------------------------------


def _held_prefix(keys: list[int], held: dict[int, bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


async def test_kv_cache_aware_follows_torch_workers_through_evictions() -> None:
    """Two context workers with a 512-token KV pool each (32 blocks; a prompt holds 19), a
    generation worker, a kv_cache_aware orchestrator: after distinct prompts (each evicting most of
    the one before on its worker) and a repeated one (a hit), the orchestrator's index of each
    worker holds every key the worker holds, and expects for every prompt sent exactly the prefix
    the worker holds (0 for an evicted one)."""
    settings = {"cache_events_chunk_bytes": CHUNK}
    contexts = [await tiny_worker("context", kv_tokens=512, **settings) for _ in range(2)]
    generation = await tiny_worker("generation", **settings)
    router = {"type": "kv_cache_aware", "args": {"chunk_bytes": CHUNK}}
    config = build_config(
        {
            "port": free_port(),
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [w.url for w in contexts], "router": router},
            "generation_servers": {"urls": [generation.url]},
        },
        environ={},
    )
    front, orch = await start_server(config)
    url = f"http://127.0.0.1:{config.port}"
    try:
        for _ in range(200):
            if orch.context_pool.ready and orch.generation_pool.ready and orch.cache_view.resyncs >= 2:
                break
            await asyncio.sleep(0.05)
        assert orch.cache_view.resyncs >= 2
        # 300 bytes of text: a 302-byte span (4 keys of 64), 301 ids (19 blocks, the last key's in the 16th)
        texts = [f"{i:03d} the agent reads the file and then writes it back " * 6 for i in range(6)]
        texts = [t[:300] for t in texts]
        bodies = [_completion(t) for t in texts + texts[-1:]]
        async with aiohttp.ClientSession() as session:
            # the generation worker too, followed by hand: it stores what it imports
            await _get(session, f"{generation.url}/cache_events?chunk_bytes={CHUNK}")
            for body in bodies:
                await _post(session, url + "/v1/completions", body)
        assert sum(w.engine.cache.evicted_blocks_total for w in contexts) > 0
        pool_router = orch.context_pool.router
        assert isinstance(pool_router, KvCacheAwareRouter)
        keys = [request_key(body, False, None).hashes(CHUNK) for body in bodies[:-1]]
        assert all(len(k) == 4 for k in keys)

        def mismatches() -> list[str]:
            out = []
            for i, worker in enumerate(orch.context_pool.workers):
                log = contexts[i].engine.cache.chunks
                assert log is not None and worker.url == contexts[i].url
                entries = pool_router.index(worker).entries
                missing = [k for k in log.held if k not in entries]
                if missing:
                    out.append(f"{worker.url}: {len(missing)} held keys not in the index")
                for n, prompt in enumerate(keys):
                    held = _held_prefix(prompt, log.held)
                    expected = pool_router.index(worker).longest_prefix(prompt)
                    if held != expected:
                        out.append(
                            f"{worker.url}: prompt {n} holds {held} keys, the index expects {expected}"
                        )
            return out

        for _ in range(100):  # the followers apply each worker's events within a batch delay
            if not mismatches():
                break
            await asyncio.sleep(0.05)
        assert mismatches() == []
        # a chat leg relays the client's messages: the generation worker's import is held under
        # the client's keys (a completion's generation leg carries the prompt as ids: no text)
        chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": texts[0]}],
                           "max_tokens": 3}).encode()  # fmt: skip
        async with aiohttp.ClientSession() as session:
            await _post(session, url + "/v1/chat/completions", chat)
        chat_keys, _ = prompt_keys(chat, True, CHUNK)
        imported = generation.engine.cache.chunks.held
        assert _held_prefix(chat_keys, imported) >= len(chat_keys) - 1 >= 3
        held = [w.engine.cache.chunks.held for w in contexts]
        assert sum(map(len, held)) >= 4  # the last prompt, at least, is held whole
        # the first prompt's head was evicted from its worker: neither it nor the index has it
        assert all(keys[0][0] not in h for h in held)
        assert all(pool_router.index(w).longest_prefix(keys[0]) == 0 for w in orch.context_pool.workers)
    finally:
        await front.cleanup()
        for worker in [*contexts, generation]:
            await worker.server.cleanup()
