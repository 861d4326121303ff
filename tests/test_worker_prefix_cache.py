"""KV block reuse: the paged cache's prefix index, the engine on top of it, and live workers.

The cache: a full block is reused only when its chained hash and its ids both
match, shared blocks are reference-counted, freed cached blocks go least
recently used first, and the last prompt id is always computed. The engine and
the HTTP worker: the same greedy tokens with reuse as without (completions and
chat, role both, a context -> generation hand-off, after eviction), fewer
tokens computed, and /metrics says how many were served from the cache.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import torch
from engines import make_request, run
from tiny_workers import one_torch_thread, tiny_worker  # noqa: F401

from server.worker.engine import TorchEngine, prompt_checksum
from server.worker.kv_cache import KVCacheFull, PagedKVCache
from server.worker.kv_transfer import decode_kv, encode_kv
from server.worker.tiny import build_tiny

BS = 16


def cache(blocks: int = 8) -> PagedKVCache:
    config, _, _ = build_tiny()
    return PagedKVCache(config, blocks * BS, block_size=BS, prefix_caching=True)


def ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 250, size=n, dtype=np.int32)


# -- the cache -------------------------------------------------------------------------


def test_a_registered_prefix_is_reused_block_for_block_and_never_the_last_id() -> None:
    c = cache()
    a = ids(40)
    blocks, cached = c.allocate_prefix(a, 41)
    assert cached == 0 and len(blocks) == 3
    c.register(blocks, a, 40)  # 2 full blocks computed
    b = np.concatenate([a[:32], ids(10, seed=1)])
    again, cached = c.allocate_prefix(b, 42)
    assert cached == 32 and again[:2] == blocks[:2] and not set(again[2:]) & set(blocks)
    # exactly 32 ids: the second block holds the last id, whose logits must be computed
    same, cached = c.allocate_prefix(a[:32], 33)
    assert cached == 16 and same[0] == blocks[0]
    assert c.hit_tokens_total == 48


def test_a_hash_match_with_other_ids_is_no_hit() -> None:
    c = cache()
    a = ids(33)
    blocks, _ = c.allocate_prefix(a, 33)
    c.register(blocks, a, 33)
    (digest, _), *_ = c.block_hashes(a, 1)
    c._cached[blocks[0]] = (digest, ids(16, seed=9).astype("<i4").tobytes())  # as a collision would
    _, cached = c.allocate_prefix(a, 33)
    assert cached == 0


def test_shared_blocks_are_counted_and_freed_cached_blocks_go_lru_first() -> None:
    c = cache(blocks=4)
    a, b = ids(33, seed=1), ids(33, seed=2)
    ba, _ = c.allocate_prefix(a, 33)  # 3 blocks
    c.register(ba, a, 33)
    shared, cached = c.allocate_prefix(a[:17], 17)  # block 0 shared, one fresh
    assert cached == 16 and shared[0] == ba[0] and shared[1] not in ba
    with pytest.raises(KVCacheFull):
        c.allocate(2 * BS)  # 3 + 1 blocks held: none free
    c.free(ba)
    assert c.used_blocks == 2  # block 0 still held by the second sequence; 1 evictable; 1 free
    c.free(shared)
    assert c.used_blocks == 0 and c.cached_blocks == 2
    bb, _ = c.allocate_prefix(b, 33)  # 3 blocks: the 2 free ones, then the least recently used cached one
    assert c.evicted_blocks_total == 1
    c.register(bb, b, 33)
    c.free(bb)
    again, cached = c.allocate_prefix(b, 33)
    assert cached == 32, "the newest blocks stay"
    c.free(again)
    # a's second block went first (freed before its first, which the second sequence still held)
    _, cached = c.allocate_prefix(a, 33)
    assert cached == 16


def test_a_prefix_hit_does_not_count_its_evictable_blocks_as_room() -> None:
    c = cache(blocks=3)
    a = ids(33)
    blocks, _ = c.allocate_prefix(a, 33)
    c.register(blocks, a, 33)
    c.free(blocks)  # 2 cached (evictable) + 1 free
    # a hit on both cached blocks leaves 1 free block: a sequence needing 2 fresh ones does not fit
    with pytest.raises(KVCacheFull, match="free"):
        c.allocate_prefix(np.concatenate([a[:32], ids(40, seed=3)]), 72)
    assert c.used_blocks == 0 and c.cached_blocks == 2, "a refused allocation takes nothing"


def test_without_prefix_caching_nothing_is_registered() -> None:
    config, _, _ = build_tiny()
    c = PagedKVCache(config, 8 * BS, block_size=BS)
    a = ids(40)
    blocks, cached = c.allocate_prefix(a, 40)
    c.register(blocks, a, 40)
    c.free(blocks)
    assert cached == 0 and c.cached_blocks == 0 and c.allocate_prefix(a, 40)[1] == 0


# -- the engine ---------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture
def engines() -> Any:
    config, model, tokenizer = build_tiny()
    made = [
        TorchEngine(config, model, tokenizer, kv_tokens=kv, prefix_caching=on)
        for on, kv in ((True, 2048), (False, 2048), (True, 512))
    ]
    yield made
    for e in made:
        e.stop()


async def test_the_same_tokens_with_reuse_as_without_and_fewer_computed(engines: list[TorchEngine]) -> None:
    reuse, plain, small = engines
    for e in engines:
        e.start(asyncio.get_running_loop())
    turns = [PROMPT, PROMPT + "And then?", PROMPT + "And then? It ran off into the woods, far away."]
    for prompt in turns:
        want, _, _ = await run(plain, prompt, max_tokens=12)
        got, _, _ = await run(reuse, prompt, max_tokens=12)
        assert got == want, prompt
    assert reuse.prefix_hit_tokens > 0
    assert reuse.prefill_computed_tokens + reuse.prefix_hit_tokens == plain.prefill_computed_tokens
    # seeded sampling too
    want, _, _ = await run(plain, turns[1], max_tokens=8, temperature=0.9, seed=5)
    got, _, _ = await run(reuse, turns[1], max_tokens=8, temperature=0.9, seed=5)
    assert got == want
    # a finished sequence's generated tokens are cached too: its continuation hits past the prompt
    first, _, _ = await run(reuse, turns[0], max_tokens=40)
    before = reuse.prefix_hit_tokens
    cont = reuse.tokenizer.decode(first)
    await run(reuse, turns[0] + cont, max_tokens=2)
    assert reuse.prefix_hit_tokens - before > len(reuse.tokenizer.encode(turns[0]))
    # after eviction: a 512-token cache fills with other prompts, then the first again
    for prompt in turns:
        await run(small, prompt, max_tokens=4)
    for seed in range(6):
        await run(small, f"{seed} other text to push the old blocks out " * 5, max_tokens=4)
    assert small.prefix_evicted_blocks > 0
    for prompt in turns:
        want, _, _ = await run(plain, prompt, max_tokens=12)
        got, _, _ = await run(small, prompt, max_tokens=12)
        assert got == want
    assert small.kv_used_tokens == 0 and reuse.kv_used_tokens == 0


async def test_a_hand_off_onto_a_cached_prefix_continues_like_one_engine(engines: list[TorchEngine]) -> None:
    reuse, plain, _ = engines
    for e in engines[:2]:
        e.start(asyncio.get_running_loop())
    prompt = PROMPT + "What next?"
    whole, _, _ = await run(plain, prompt, max_tokens=12)
    # context side (plain engine) parks; the generation side (reuse) has the prefix cached already
    await run(reuse, PROMPT, max_tokens=2)
    req, queue = make_request(plain, prompt, max_tokens=12)
    req.park_as = 11
    plain.submit(req)
    await asyncio.wait_for(queue.get(), 30)
    await asyncio.wait_for(queue.get(), 30)
    parked = plain.take_parked(11)
    assert parked is not None
    k, v = plain.read_parked(parked)
    body = b"".join(bytes(p) for p in encode_kv(k, v, prompt_crc32=parked.prompt_crc32,
                                                first_token=parked.first_token, first_logprob=None))  # fmt: skip
    payload = decode_kv(body, reuse.kv_layout, num_tokens=parked.num_tokens,
                        prompt_crc32=prompt_checksum(req.prompt_ids))  # fmt: skip
    cont, queue = make_request(reuse, prompt, max_tokens=12)
    cont.forced_tokens = [payload.first_token]
    cont.kv_import = (payload.k, payload.v)
    before = reuse.prefix_hit_tokens
    reuse.submit(cont)
    assert cont.cached_prefix > 0 and reuse.prefix_hit_tokens > before
    tokens: list[int] = []
    while True:
        d = await asyncio.wait_for(queue.get(), 30)
        tokens += d.token_ids
        if d.finish_reason:
            break
    assert tokens == whole
    # the shared blocks were read, never written: the cached prefix still serves
    again, _, _ = await run(reuse, PROMPT, max_tokens=2)
    want, _, _ = await run(plain, PROMPT, max_tokens=2)
    assert again == want


# -- live workers ---------------------------------------------------------------------------


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_live_workers_answer_the_same_with_reuse_chat_and_completions() -> None:
    reuse, plain = await tiny_worker(), await tiny_worker(prefix_caching=False)
    try:
        async with aiohttp.ClientSession() as session:
            history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
            for turn in range(3):
                chat = {"model": "tiny", "messages": history, "max_tokens": 10, "temperature": 0}
                a = await _post(session, reuse.url + "/v1/chat/completions", chat)
                b = await _post(session, plain.url + "/v1/chat/completions", chat)
                assert a["choices"][0]["message"] == b["choices"][0]["message"], turn
                history = [*history, a["choices"][0]["message"], {"role": "user", "content": f"More {turn}."}]
                comp = {"model": "tiny", "prompt": PROMPT * (turn + 1), "max_tokens": 10, "temperature": 0}
                a = await _post(session, reuse.url + "/v1/completions", comp)
                b = await _post(session, plain.url + "/v1/completions", comp)
                assert a["choices"][0]["text"] == b["choices"][0]["text"], turn
            async with session.get(reuse.url + "/metrics") as r:
                page = await r.text()
        hits = [
            ln for ln in page.splitlines() if ln.startswith("fastcore_worker_prefix_cache_hit_tokens_total")
        ]
        assert hits and float(hits[0].split()[1]) > 0
        assert "fastcore_worker_prefill_computed_tokens_total" in page
        assert reuse.engine.prefill_computed_tokens < plain.engine.prefill_computed_tokens
    finally:
        await reuse.server.cleanup()
        await plain.server.cleanup()


_ = torch  # the tiny model's engine runs on torch


async def test_parked_entries_sharing_a_prefix_count_its_blocks_once(engines: list[TorchEngine]) -> None:
    """Context legs whose prompts share a cached prefix park the same blocks: the parked KV (its
    /metrics gauge and the parked bound) counts them once, so it equals the KV in use."""
    reuse = engines[0]
    reuse.start(asyncio.get_running_loop())
    for i, tail in enumerate(("one", "two", "three")):
        req, queue = make_request(reuse, PROMPT + tail, max_tokens=4)
        req.park_as = 100 + i
        reuse.submit(req)
        await asyncio.wait_for(queue.get(), 30)
        await asyncio.wait_for(queue.get(), 30)
    assert reuse.parked_count == 3 and reuse.prefix_hit_tokens > 0
    assert reuse.parked_tokens == reuse.kv_used_tokens
    # eviction counts what it really frees: asking for all the parked KV takes every entry
    reuse.evict_parked(reuse.parked_tokens)
    assert reuse.parked_count == 0 and reuse.parked_tokens == 0 and reuse.kv_used_tokens == 0


async def test_usage_reports_the_prompt_tokens_served_from_the_cache() -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field), unary and streamed: 0 on a cold
    cache, the reused full blocks after (never the last prompt id)."""
    worker = await tiny_worker()
    try:
        async with aiohttp.ClientSession() as session:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            cold = (await _post(session, worker.url + "/v1/chat/completions", chat))["usage"]
            warm = (await _post(session, worker.url + "/v1/chat/completions", chat))["usage"]
            streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(worker.url + "/v1/chat/completions", json=streamed) as r:
                events = [e[6:] for e in (await r.text()).split("\n\n") if e.startswith("data: {")]
            stream_usage = next(u for u in (json.loads(e).get("usage") for e in events) if u)
        assert cold["prompt_tokens_details"] == {"cached_tokens": 0}
        expected = (warm["prompt_tokens"] - 1) // BS * BS
        assert expected > 0
        assert warm["prompt_tokens_details"] == {"cached_tokens": expected}
        assert stream_usage["prompt_tokens_details"] == {"cached_tokens": expected}
    finally:
        await worker.server.cleanup()
