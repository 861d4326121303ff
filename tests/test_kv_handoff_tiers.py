"""The KV hand-off from a context worker with a second KV tier (issue 40 item 4): the export reads
each block where it is (the device or tier 2, memory or files); a tier-2 block that cannot be read
makes the export a 404 and the generation worker prefills from the ids, with the same tokens."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import numpy as np
import pytest_asyncio
import torch
from helpers import get, post
from tiny_workers import LiveWorker, one_torch_thread, tiny_worker  # noqa: F401 (an autouse fixture)

from server.worker.app import WorkerSettings, start_worker
from server.worker.engine import TorchEngine
from server.worker.engine_api import ParkedKV, ParkedKVLost
from server.worker.kv_cache import PagedKVCache
from server.worker.kv_tier2 import KVTier2, Rates
from server.worker.tiny import build_tiny

BS = 16
PROMPT = "The tier keeps what the device let go of, and the export reads it from there. " * 3


def _hold(tier: KVTier2) -> None:
    """Loading held 10x faster than prefill (a preempted copy measured could flip the decision)."""
    held = Rates(tier.rates.bytes_per_token)
    held.observe_prefill(10_000, 1.0)
    held.observe_copy(100_000 * held.bytes_per_token, 1.0)
    held.observe_prefill = lambda tokens, seconds: None  # type: ignore[method-assign]
    held.observe_copy = lambda nbytes, seconds: None  # type: ignore[method-assign]
    tier.rates = held


async def tiered_context(path: Path | None, *, kv_tokens: int = 512, **settings: Any) -> LiveWorker:
    """A context worker on the tiny model with a small device cache and a 4096-token tier 2."""
    config, model, tokenizer = build_tiny()
    engine = TorchEngine(config, model, tokenizer, kv_tokens=kv_tokens, prefix_caching=True)
    engine.cache.attach_tier2(4096, str(path) if path is not None else None)
    assert engine.cache.tier2 is not None
    _hold(engine.cache.tier2)
    server, port = await start_worker(engine, WorkerSettings(role="context", **settings))
    return LiveWorker(server, port, engine)


@pytest_asyncio.fixture(loop_scope="function")
async def single() -> AsyncIterator[LiveWorker]:
    worker = await tiny_worker("both")
    yield worker
    await worker.server.cleanup()


@pytest_asyncio.fixture(loop_scope="function")
async def gen() -> AsyncIterator[LiveWorker]:
    worker = await tiny_worker("generation")
    yield worker
    await worker.server.cleanup()


def body(prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def context_leg(ctx: LiveWorker, prompt: str, disagg_id: int) -> dict[str, Any]:
    params = {"request_type": "context_only", "disagg_request_id": disagg_id}
    resp = await post(ctx.port, "/v1/completions", body(prompt, disaggregated_params=params))
    assert resp.status == 200, resp.body[:300]
    answer: dict[str, Any] = resp.json()
    return answer


async def generation_leg(gen: LiveWorker, ctx_answer: dict[str, Any]) -> str:
    params = dict(ctx_answer["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    resp = await post(
        gen.port, "/v1/completions", body(ctx_answer["prompt_token_ids"], disaggregated_params=params)
    )
    assert resp.status == 200, resp.body[:300]
    text: str = resp.json()["choices"][0]["text"]
    return text


async def alone(single: LiveWorker, prompt: str) -> str:
    resp = await post(single.port, "/v1/completions", body(prompt))
    assert resp.status == 200, resp.body[:300]
    text: str = resp.json()["choices"][0]["text"]
    return text


async def metric(worker: LiveWorker, name: str) -> float:
    text = (await get(worker.port, "/metrics")).body.decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def handoff(event: str) -> str:
    return f'fastcore_worker_kv_handoff_total{{event="{event}"}}'


async def push_out(ctx: LiveWorker, gen: LiveWorker, first_id: int) -> None:
    """Other prompts' context legs, each fetched: the device cache's earlier blocks go to tier 2."""
    for i in range(6):
        answer = await context_leg(ctx, f"{i} other text to push the old blocks out " * 5, first_id + i)
        await generation_leg(gen, answer)


def _tier(ctx: LiveWorker) -> KVTier2:
    tier = ctx.engine.cache.tier2
    assert tier is not None
    return tier


def _settle(ctx: LiveWorker) -> None:
    """The file store's writes done (a block is served only once its file is written)."""
    store = _tier(ctx).store
    wait = getattr(store, "wait_idle", None)
    if wait is not None:
        assert wait()


def _damage(path: Path) -> None:
    """Every spill file under ``path`` with its last byte flipped (its checksum no longer holds)."""
    for spilled in path.glob("*.kv"):
        raw = bytearray(spilled.read_bytes())
        raw[-1] ^= 0xFF
        spilled.write_bytes(bytes(raw))


@pytest.mark.parametrize("tier", ["memory", "files", "corrupt_files"])
async def test_a_context_leg_whose_prefix_came_from_tier2_hands_off_the_same_tokens(
    tier: str, tmp_path: Path, single: LiveWorker, gen: LiveWorker
) -> None:
    """The prefix's load runs before the context leg's prefill (a failed one cut there and
    recomputed): the KV parked is the device's, whichever way it came."""
    ctx = await tiered_context(tmp_path if tier != "memory" else None)
    try:
        await generation_leg(gen, await context_leg(ctx, PROMPT, 1))
        await push_out(ctx, gen, 100)
        assert ctx.engine.prefix_evicted_blocks > 0
        _settle(ctx)
        if tier == "corrupt_files":
            _damage(tmp_path)
        loaded = _tier(ctx).loaded_blocks_total
        turn = PROMPT + "And then?"
        got = await generation_leg(gen, await context_leg(ctx, turn, 2))
        if tier == "corrupt_files":  # the load failed: the prefix recomputed, the parked KV right
            assert _tier(ctx).loaded_blocks_total == loaded and _tier(ctx).failed_blocks_total >= 1
        else:
            assert _tier(ctx).loaded_blocks_total - loaded >= 8  # the prefix hit came from tier 2
        assert got == await alone(single, turn)
        assert await metric(gen, handoff("fetched")) == 8 and await metric(gen, handoff("recomputed")) == 0
        assert ctx.engine.kv_used_tokens == 0
    finally:
        await ctx.server.cleanup()
        _tier(ctx).close()


SHORT = "Parked KV that left the device is read from tier 2. " * 2


async def park_and_spill(ctx: LiveWorker) -> list[dict[str, Any]]:
    """Three context legs parked past the parked bound (the first pushed out of it), then plain
    completions until the device's room had to come from the first's blocks."""
    answers = [await context_leg(ctx, f"{i:03d} " + SHORT, i + 1) for i in range(3)]
    assert await metric(ctx, handoff("evicted")) == 1
    for i in range(6):
        resp = await post(
            ctx.port, "/v1/completions", body(f"{i} other text to push the old blocks out " * 5)
        )
        assert resp.status == 200, resp.body[:300]
    _settle(ctx)
    assert _tier(ctx).spilled_blocks_total > 0
    return answers


@pytest.mark.parametrize("files", [False, True], ids=["memory", "files"])
async def test_parked_kv_pushed_to_tier2_is_exported_from_there(
    files: bool, tmp_path: Path, single: LiveWorker, gen: LiveWorker
) -> None:
    ctx = await tiered_context(tmp_path if files else None, kv_tokens=1024, max_parked_fraction=0.25)
    try:
        answers = await park_and_spill(ctx)
        for i, answer in enumerate(answers):
            assert await generation_leg(gen, answer) == await alone(single, f"{i:03d} " + SHORT)
        # every leg's KV handed off, the first read (in part at least) from tier 2
        assert await metric(gen, handoff("fetched")) == 3 and await metric(gen, handoff("recomputed")) == 0
        assert _tier(ctx).exported_blocks_total >= 1
        assert await metric(ctx, "fastcore_worker_kv_tier2_exported_blocks_total") >= 1
        assert ctx.engine.kv_used_tokens == 0 and ctx.engine.parked_tokens == 0
    finally:
        await ctx.server.cleanup()
        _tier(ctx).close()


async def test_a_corrupt_tier2_file_fails_the_export_and_the_generation_leg_prefills(
    tmp_path: Path, single: LiveWorker, gen: LiveWorker
) -> None:
    ctx = await tiered_context(tmp_path, kv_tokens=1024, max_parked_fraction=0.25)
    try:
        answers = await park_and_spill(ctx)
        _damage(tmp_path)
        assert await generation_leg(gen, answers[0]) == await alone(single, "000 " + SHORT)
        assert await metric(ctx, handoff("lost")) == 1
        assert await metric(gen, 'fastcore_worker_kv_fetch_failures_total{reason="http_404"}') == 1
        assert await metric(gen, handoff("recomputed")) == 1
        assert await metric(ctx, "fastcore_worker_kv_tier2_export_failed_blocks_total") >= 1
        for i, answer in enumerate(answers[1:], 1):  # the others, still on the device, hand off
            assert await generation_leg(gen, answer) == await alone(single, f"{i:03d} " + SHORT)
        assert await metric(gen, handoff("fetched")) == 2
        assert ctx.engine.kv_used_tokens == 0 and ctx.engine.parked_count == 0
    finally:
        await ctx.server.cleanup()
        _tier(ctx).close()


# ---------------------------------------------------------------- the cache's side, block by block


def _cache(blocks: int, path: Path | None) -> PagedKVCache:
    config, _, _ = build_tiny()
    cache = PagedKVCache(config, blocks * BS, block_size=BS, prefix_caching=True)
    cache.attach_tier2(16 * BS, str(path) if path is not None else None)
    return cache


def _park(cache: PagedKVCache, full_blocks: int) -> tuple[ParkedKV, torch.Tensor, torch.Tensor]:
    """A parked entry of ``full_blocks`` full blocks and 3 tokens more, its K/V seeded, registered."""
    n = full_blocks * BS + 3
    ids = np.arange(n, dtype=np.int32) % 250
    blocks, _ = cache.allocate_prefix(ids, n)
    gen = torch.Generator().manual_seed(7)
    shape = (cache.num_layers, n, cache.kv_heads, cache.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    cache.write(blocks, k, v)
    cache.register(blocks, ids, n)
    return ParkedKV(1, blocks, n, 0, 0, None, 0.0), k, v


def _tier2_wait(cache: PagedKVCache) -> None:
    assert cache.tier2 is not None
    wait = getattr(cache.tier2.store, "wait_idle", None)
    if wait is not None:
        assert wait()


@pytest.mark.parametrize("files", [False, True], ids=["memory", "files"])
def test_an_entry_let_go_is_read_from_both_tiers_bit_for_bit(files: bool, tmp_path: Path) -> None:
    cache = _cache(8, tmp_path if files else None)
    parked, k, v = _park(cache, 5)  # 6 of the 8 blocks
    released = cache.let_go(parked)
    assert len(released) == 5 and len(parked.chain) == 5 and len(parked.blocks) == 1
    cache.free(released)
    taken = cache.allocate(4 * BS)  # the 2 free blocks, then the 2 least recently used: spilled
    cache.flush_tier2()
    cache.free(taken)
    _tier2_wait(cache)
    assert cache.tier2 is not None and cache.tier2.held_blocks == 2
    got_k, got_v = cache.read_parked(parked)  # 2 blocks from tier 2, 3 from the device, the held rest
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert cache.tier2.exported_blocks_total == 2 and cache.tier2.held_blocks == 2  # left there
    assert cache.used_blocks == 1  # the export's holds given back
    cache.free(parked.blocks)
    assert cache.used_blocks == 0
    cache.tier2.close()


def test_blocks_read_by_an_export_are_not_evicted_under_it() -> None:
    cache = _cache(8, None)
    parked, k, v = _park(cache, 5)
    cache.free(cache.let_go(parked))  # 5 blocks evictable, 2 free, the rest held
    taken: list[int] = []
    real_read = cache.read

    def read(blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not taken:  # while the export reads: every block a reservation may take is taken
            taken.extend(cache.allocate((len(cache._free) + len(cache._evictable)) * BS))
        return real_read(blocks, num_tokens)

    cache.read = read  # type: ignore[method-assign]
    got_k, got_v = cache.read_parked(parked)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert len(taken) == 2  # the free ones only: the 5 being read were held
    cache.free(taken + parked.blocks)
    assert cache.used_blocks == 0


@pytest.mark.parametrize("how", ["missing", "corrupt", "dropped", "other_ids"])
def test_a_block_let_go_and_lost_fails_the_export_never_wrong_kv(how: str, tmp_path: Path) -> None:
    cache = _cache(8, tmp_path)
    parked, _, _ = _park(cache, 5)
    cache.free(cache.let_go(parked))
    taken = cache.allocate(7 * BS)  # every block let go spilled to files
    cache.flush_tier2()
    cache.free(taken)
    _tier2_wait(cache)
    tier = cache.tier2
    assert tier is not None and tier.held_blocks == 5
    files = sorted(tmp_path.glob("*.kv"), key=lambda p: int(p.stem))
    if how == "missing":
        files[2].unlink()
    elif how == "corrupt":
        raw = bytearray(files[2].read_bytes())
        raw[-1] ^= 0xFF
        files[2].write_bytes(bytes(raw))
    elif how == "dropped":  # pushed out of the tier (least recently spilled first) by others' blocks
        for digest in list(tier._entries)[:2]:
            tier._release(tier._entries.pop(digest))
    else:  # the same hash with other ids (a forced collision): no block of those ids is served
        digest, chunk = parked.chain[2]
        parked.chain[2] = (digest, bytes(reversed(chunk)))
    with pytest.raises(ParkedKVLost):
        cache.read_parked(parked)
    assert tier.export_failed_blocks_total >= 1 and cache.used_blocks == 1
    cache.free(parked.blocks)
    assert cache.used_blocks == 0
    tier.close()
