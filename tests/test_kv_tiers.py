"""A second KV tier (issue 40): the workers' tier events, the router's index and score, the
synthetic worker's tier, the /metrics families by tier."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest

from server.metrics import Registry
from server.orchestrator.cache_view import _Follower
from server.orchestrator.estimates import tier2_tokens
from server.orchestrator.routing import TIER_WEIGHT, KvCacheAwareRouter, PrefixIndex, request_key
from server.orchestrator.routing_metrics import routing_quality
from server.worker.app import WorkerSettings, start_worker
from server.worker.kv_events import ChunkEventLog
from server.worker.synthetic import BLOCK_SIZE, PrefixCacheModel, SyntheticEngine

CHUNK = 64


class FakeWorker:
    def __init__(self, url: str, in_flight: int = 0) -> None:
        self.url = url
        self.in_flight = in_flight
        self.in_flight_tokens = 0
        self.kv_capacity_tokens = None
        self.healthy = True


# -- the worker's log -------------------------------------------------------------------------------------


def _log_with_blocks() -> tuple[ChunkEventLog, list[bytes]]:
    log = ChunkEventLog("i1", CHUNK, block_size=16)
    digests = [bytes([i]) * 16 for i in range(4)]
    log.pending["r"] = (list(range(100, 104)), 4 * CHUNK)
    log.stored("r", digests, 64)
    return log, digests


def test_a_log_says_moves_between_tiers_and_a_resync_lists_tier2_apart() -> None:
    log, digests = _log_with_blocks()
    log.moved(digests[2:], 2)  # spilled to tier 2
    log.moved(digests[3:], 1)  # loaded back
    log.evicted(digests[2:3], 2)  # evicted from tier 2
    events = log.answer(1, "i1", tiers=True)["events"]
    assert events == [{"seq": 2, "moved": [102, 103], "tier": 2}, {"seq": 3, "moved": [103], "tier": 1},
                      {"seq": 4, "removed": [102], "tier": 2}]  # fmt: skip
    # a follower that reads no tier: a move to tier 2 is a removal, a move back a store
    assert log.answer(1, "i1")["events"] == [{"seq": 2, "removed": [102, 103]}, {"seq": 3, "stored": [103]},
                                             {"seq": 4, "removed": [102]}]  # fmt: skip
    log.moved(digests[:1], 2)
    resync = log.answer(0, None, tiers=True)
    assert sorted(resync["held"]) == [101, 103] and resync["held_tier2"] == [100]
    assert "held_tier2" not in log.answer(0, None) and sorted(log.answer(0, None)["held"]) == [101, 103]


# -- the router's index -----------------------------------------------------------------------------------


def _follower(router: KvCacheAwareRouter, worker: Any) -> _Follower:
    follower = _Follower(None, router, worker)  # type: ignore[arg-type]
    follower.view = type("View", (), {"events": 0, "resyncs": 0})()
    return follower


def test_the_follower_keeps_tiers_through_store_move_and_evict_events() -> None:
    router, worker = KvCacheAwareRouter({"chunk_bytes": CHUNK}), FakeWorker("http://w")
    follower = _follower(router, worker)
    rates = {"kv_tier2_load_tokens_per_s": 40_000, "prefill_tokens_per_s": 10_000}
    assert follower.apply({"instance": "i", "seq": 1, "resync": True, "held": [1, 2], "held_tier2": [3],
                           "tier_rates": rates})  # fmt: skip
    index = router.index(worker)
    assert set(index.entries) == {1, 2, 3} and index.tier2 == {3}
    assert router.tier_weight_of(worker) == pytest.approx(0.75)  # 1 - 10k / 40k
    events = [{"seq": 2, "moved": [1, 2], "tier": 2}, {"seq": 3, "moved": [2], "tier": 1},
              {"seq": 4, "stored": [7], "tier": 2}, {"seq": 5, "stored": [8]}, {"seq": 6, "removed": [1], "tier": 2}]  # fmt: skip
    assert follower.apply({"instance": "i", "seq": 6, "events": events})
    assert set(index.entries) == {2, 3, 7, 8} and index.tier2 == {3, 7}
    assert 1 not in router._holders
    for bad in (
        {"seq": 7, "moved": [1], "tier": 3},
        {"seq": 7, "moved": [1], "tier": "2"},
        {"seq": 7, "moved": [-1]},
    ):
        assert not follower.apply({"instance": "i", "seq": 7, "events": [bad]}), bad
    assert not follower.apply({"instance": "i", "seq": 1, "resync": True, "held": [], "held_tier2": "x"})


def test_the_approximate_index_spills_its_least_recent_to_tier2_and_evicts_past_it() -> None:
    index = PrefixIndex(limit=4, tier2_limit=4)
    clock = 0
    for chain in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10]):
        assert index.add(chain, clock) == ([3, 4] if chain == [9, 10] else [])
        clock += len(chain)
    # least recent first (a chain's tail before its head): 3 and 4 out, 7, 8, 1, 2 in tier 2
    assert set(index.entries) == {1, 2, 5, 6, 7, 8, 9, 10} and index.tier2 == {1, 2, 7, 8}
    assert index.tier2_count([1, 2, 3], 2) == 2 and index.tier2_count([5, 6, 7, 8], 4) == 2
    assert index.add([1, 2], clock) == []  # routed again: back on the device, 5 and 6 spill
    assert index.tier2 == {5, 6, 7, 8} and index.tier2_count([1, 2], 2) == 0
    exact = PrefixIndex(limit=4)  # no tier-2 bound: eviction drops, tier 2 keeps only what stays
    exact.add([1, 2, 3, 4], 0)
    exact.tier2.update([3, 4])
    exact.add([5, 6, 7, 8], 4)
    assert set(exact.entries) == {5, 6, 7, 8} and not exact.tier2


def _prompt(n_chunks: int) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * (CHUNK * n_chunks)}]}
    ).encode()


@pytest.mark.parametrize(("weight", "winner"), [(None, "b"), (0.75, "b"), (0.25, "a"), (0.0, "a")])
def test_a_worker_with_more_tier2_wins_only_when_its_weighted_sum_is_higher(
    weight: float | None, winner: str
) -> None:
    args: dict[str, Any] = {"chunk_bytes": CHUNK, "load_weight": 0.0}
    if weight is not None:
        args["tier_weight"] = weight
    router = KvCacheAwareRouter(args)
    a, b = FakeWorker("a"), FakeWorker("b")
    key = request_key(_prompt(12), True, None)
    hashes = key.hashes(CHUNK)
    n = len(hashes)
    router.stored(a, hashes[: n // 2])  # device only: n/2
    router.stored(b, hashes)  # n on b, of which all but n/4 in tier 2: n/4 + w x 3n/4
    router.moved(b, hashes[n // 4 :], 2)
    chosen = router.choose([a, b], key)
    assert chosen.url == winner
    if winner == "b":
        assert key.hit_chunks == n and key.hit_tier2_chunks == n - n // 4
        assert router.predicted_tier_tokens[1] == router.hit_tokens(n - n // 4)
    else:
        assert key.hit_chunks == n // 2 and key.hit_tier2_chunks == 0


def test_the_measured_weight_is_zero_where_loading_is_slower_than_prefill() -> None:
    router, worker = KvCacheAwareRouter({"chunk_bytes": CHUNK}), FakeWorker("w")
    assert router.tier_weight_of(worker) == TIER_WEIGHT
    router.tier_rates(worker, 5_000, 10_000)  # the tier loads at half the prefill's rate
    assert router.tier_weight_of(worker) == 0.0
    router.tier_rates(worker, 20_000, 10_000)
    assert router.tier_weight_of(worker) == pytest.approx(0.5)
    router.tier_rates(worker, None, 10_000)  # not said: the anchor
    assert router.tier_weight_of(worker) == TIER_WEIGHT
    assert KvCacheAwareRouter({"tier_weight": 0.3}).tier_weight_of(worker) == 0.3
    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(ValueError, match="tier_weight"):
            KvCacheAwareRouter({"tier_weight": bad})
    # a tier the worker does not take: a chain through tier 2 is predicted as recomputed
    slow = KvCacheAwareRouter({"chunk_bytes": CHUNK, "load_weight": 0.0})
    slow.tier_rates(worker, 5_000, 10_000)
    key = request_key(_prompt(8), True, None)
    hashes = key.hashes(CHUNK)
    slow.stored(worker, hashes)
    slow.moved(worker, hashes[2:], 2)
    assert slow.choose([worker], key) is worker and key.hit_chunks == 2 and key.hit_tier2_chunks == 0


# -- /metrics ---------------------------------------------------------------------------------------------


def test_hit_tokens_by_tier_predicted_and_achieved_on_metrics() -> None:
    router = KvCacheAwareRouter({"chunk_bytes": CHUNK})
    registry = Registry()
    routing_quality(registry, [SimpleNamespace(name="context", router=router)])  # type: ignore[list-item]
    router.predicted_tier_tokens[:] = [30, 12]
    answer = b'{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":40,"tier2_cached_tokens":16}}}'
    router.account(0, 100, 40, tier2_tokens(answer))
    text = registry.render().decode()
    for family, tier, value in (
        ("predicted", 1, 30),
        ("predicted", 2, 12),
        ("achieved", 1, 24),
        ("achieved", 2, 16),
    ):
        line = f'fastcore_orchestrator_prefix_{family}_tier_hit_tokens_total{{pool="context",tier="{tier}"}} {value}'
        assert line in text or line.replace(f" {value}", f" {value}.0") in text, line
    assert tier2_tokens(b'{"cached_tokens":3}') == 0 and tier2_tokens(b'"tier2_cached_tokens":"x"') == 0


# -- the synthetic worker's tier --------------------------------------------------------------------------


def _ids(n_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=n_blocks * BLOCK_SIZE + 1, dtype=np.int32)


def test_evicted_blocks_go_to_tier2_a_hit_loads_them_back_and_tier2_is_a_bounded_lru() -> None:
    cache = PrefixCacheModel(4 * BLOCK_SIZE, tier2_tokens=4 * BLOCK_SIZE)
    first, second, third = _ids(4, 1), _ids(4, 2), _ids(4, 3)
    for ids in (first, second):
        cache.remember(cache.lookup(ids)[1])
    assert cache.cached_tokens == cache.tier2_cached_tokens == 4 * BLOCK_SIZE  # first spilled
    hit, hashes = cache.lookup(first)
    assert hit == 4 * BLOCK_SIZE and cache.tier2_hit == 4 * BLOCK_SIZE
    cache.remember(hashes)  # loaded back: second spills
    assert cache.lookup(first)[0] == 4 * BLOCK_SIZE and cache.tier2_hit == 0
    cache.remember(cache.lookup(third)[1])  # first spills, second (the least recent of tier 2) out
    assert cache.lookup(second)[0] == 0 and cache.tier2_cached_tokens == 4 * BLOCK_SIZE
    assert cache.lookup(first)[0] == 4 * BLOCK_SIZE and cache.tier2_hit == 4 * BLOCK_SIZE
    assert PrefixCacheModel(4 * BLOCK_SIZE).tier2_taken is False


def test_a_tier_slower_than_prefill_is_not_taken() -> None:
    cache = PrefixCacheModel(4 * BLOCK_SIZE, tier2_tokens=4 * BLOCK_SIZE, load_tokens_per_s=5_000,
                             prefill_tokens_per_s=10_000)  # fmt: skip
    assert not cache.tier2_taken
    first = _ids(4, 1)
    for ids in (first, _ids(4, 2)):
        cache.remember(cache.lookup(ids)[1])
    assert cache.tier2_cached_tokens == 4 * BLOCK_SIZE  # kept, but never loaded
    assert cache.lookup(first)[0] == 0 and cache.tier2_hit == 0
    fast = PrefixCacheModel(
        BLOCK_SIZE, tier2_tokens=BLOCK_SIZE, load_tokens_per_s=20_000, prefill_tokens_per_s=10_000
    )
    assert fast.tier2_taken and fast.load_seconds(10_000) == 0.5


async def test_a_worker_reports_tier2_hits_in_usage_its_rates_in_server_info_and_tier_events() -> None:
    engine = SyntheticEngine(0, bytes_per_token=1, kv_tokens=16 * BLOCK_SIZE, kv_tier2_tokens=16 * BLOCK_SIZE,
                             tier2_load_tokens_per_s=1e9, prefill_tokens_per_s=1e7)  # fmt: skip
    server, port = await start_worker(
        engine, WorkerSettings(model_name="synthetic", cache_events_chunk_bytes=CHUNK)
    )
    url = f"http://127.0.0.1:{port}"
    texts = ["a" * 200, "b" * 200]  # 14 full blocks each (with the template's bytes): 28 of the device's 16

    async def send(session: aiohttp.ClientSession, text: str) -> dict[str, Any]:
        body = {"model": "synthetic", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return (await resp.json())["usage"]

    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/server_info") as resp:
                info = await resp.json()
            assert info["kv_tier2_capacity_tokens"] == 16 * BLOCK_SIZE
            assert info["kv_tier2_load_tokens_per_s"] == 1e9 and info["prefill_tokens_per_s"] == 1e7
            async with session.get(f"{url}/cache_events?chunk_bytes={CHUNK}&tiers=1") as resp:
                first = await resp.json()
            assert first["resync"] is True and first["tier_rates"]["prefill_tokens_per_s"] == 1e7
            for text in texts:
                assert "tier2_cached_tokens" not in (await send(session, text))["prompt_tokens_details"]
            usage = await send(session, texts[0])  # spilled by the second: loaded back from tier 2
            details = usage["prompt_tokens_details"]
            assert (
                details["tier2_cached_tokens"] > 0
                and details["cached_tokens"] >= details["tier2_cached_tokens"]
            )
            async with session.get(f"{url}/cache_events?chunk_bytes={CHUNK}&tiers=1&instance="
                                   f"{first['instance']}&after={first['seq']}") as resp:  # fmt: skip
                events = (await resp.json())["events"]
            assert {"moved": 2} in [{"moved": e["tier"]} for e in events if "moved" in e]
            assert {"moved": 1} in [{"moved": e["tier"]} for e in events if "moved" in e]
            async with session.get(f"{url}/cache_events?tiers=2") as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "tiers"
    finally:
        await server.cleanup()


async def test_an_orchestrators_follower_learns_a_workers_tiers_and_rates_over_http() -> None:
    """A real worker's stream, followed: a prompt the worker spilled to tier 2 is in the router's
    index as tier 2, and the weight is the one the worker's rates give."""
    from server.orchestrator.cache_view import CacheView
    from server.orchestrator.pools import Worker

    engine = SyntheticEngine(0, bytes_per_token=1, kv_tokens=16 * BLOCK_SIZE, kv_tier2_tokens=16 * BLOCK_SIZE,
                             tier2_load_tokens_per_s=4e7, prefill_tokens_per_s=1e7)  # fmt: skip
    server, port = await start_worker(
        engine, WorkerSettings(model_name="synthetic", cache_events_chunk_bytes=CHUNK)
    )
    worker = Worker(f"http://127.0.0.1:{port}")
    worker.healthy = True
    router = KvCacheAwareRouter({"chunk_bytes": CHUNK})
    view = CacheView([], None, wait_s=0.0)
    follower = _Follower(view, router, worker)
    bodies = [json.dumps({"model": "synthetic", "messages": [{"role": "user", "content": c * 200}],
                          "max_tokens": 1}).encode() for c in "ab"]  # fmt: skip
    try:
        await follower.poll_once()  # the resync: the log starts, the rates come
        assert worker in router.followed and router.tier_weight_of(worker) == pytest.approx(0.75)
        async with aiohttp.ClientSession() as session:
            for body in bodies:
                async with session.post(f"{worker.url}/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
                    assert resp.status == 200
        await follower.poll_once()
        hashes = request_key(bodies[0], True, None).hashes(CHUNK)
        index = router.index(worker)
        held = index.longest_prefix(hashes)
        assert held == len(hashes) and 0 < index.tier2_count(hashes, held) <= held
        assert index.tier2_count(request_key(bodies[1], True, None).hashes(CHUNK), held) == 0
    finally:
        follower.close()
        await server.cleanup()


def test_server_info_tier_figures_size_the_approximate_index_and_weigh_its_hits() -> None:
    from server.orchestrator.pools import Capabilities

    caps = Capabilities.of({"kv_tier2_capacity_tokens": 4096, "kv_tier2_load_tokens_per_s": 20_000,
                            "prefill_tokens_per_s": 10_000})  # fmt: skip
    assert caps.kv_tier2 == (4096, 20_000.0, 10_000.0)
    for info in ({}, {"kv_tier2_capacity_tokens": -1}, {"kv_tier2_capacity_tokens": "4096"}):
        assert Capabilities.of(info).kv_tier2 == (None, None, None), info
    assert Capabilities.of({"kv_tier2_capacity_tokens": 8, "prefill_tokens_per_s": True}).kv_tier2 == (
        8,
        None,
        None,
    )
    worker = FakeWorker("w")
    worker.kv_tier2 = caps.kv_tier2  # type: ignore[attr-defined]
    router = KvCacheAwareRouter({"chunk_bytes": CHUNK, "max_cached_tokens": 4 * CHUNK // 4})
    assert router.tier_weight_of(worker) == pytest.approx(0.5)  # 1 - 10k / 20k
    index = router.index(worker)
    assert index.limit == 4 and index.tier2_limit == 4096 * 4 // CHUNK
    router.routed(worker, [1, 2, 3, 4])
    router.routed(worker, [5, 6, 7, 8])
    assert router.index(worker).tier2 == {1, 2, 3, 4}  # spilled, not forgotten
    router.stored(worker, [9])  # its events: exact, no spill of its own
    assert router.index(worker).tier2_limit == 0
