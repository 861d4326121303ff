"""trtllm-serve's other endpoints on our workers and orchestrator (issue 20, items 5 and 6):
``POST /kv_cache_events`` from the prefix cache's block events, read as trtllm-serve's
kv_cache_aware router reads them; ``/version``, ``/perf_metrics``, ``/steady_clock_offset``,
``/prometheus/metrics``; the orchestrator's ``/cluster_info``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

from engines import small_config
from helpers import free_port, until
from tiny_workers import one_torch_thread, tiny_worker  # noqa: F401
from trtllm_cluster_standin import ClusterWorker, HttpStorageClient, ServerRole
from trtllm_standin import start_standin

import fastcore
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.worker.kv_cache import PagedKVCache
from server.worker.kv_events import KvEventLog, block_hash, events_of
from server.worker.synthetic import PrefixCacheModel


class TrtllmBlockTable:
    """What trtllm-serve's KvCacheAwareServerState.update_with_events keeps of a worker's events."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.created = 0

    def update(self, events: list[dict[str, Any]]) -> None:
        for raw in events:
            event = raw["data"] if "data" in raw else raw
            if event["type"] == "created":
                self.created += 1
            elif event["type"] == "stored":
                self.blocks.update(block["block_hash"] for block in event["blocks"])
            elif event["type"] == "removed":
                self.blocks.difference_update(event["block_hashes"])


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def poll(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    async with session.post(url + "/kv_cache_events", headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def cached_hashes(cache: PagedKVCache) -> set[int]:
    return {block_hash(digest) for digest, _ in cache._cached.values()}


async def test_kv_cache_events_follow_the_workers_prefix_cache(session: aiohttp.ClientSession) -> None:
    worker = await tiny_worker("both", kv_tokens=256)
    cache = worker.engine.cache
    table = TrtllmBlockTable()
    try:
        first = await poll(session, worker.url)
        assert first == [{"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [cache.num_blocks]},
                          "window_size": cache.block_size}]  # fmt: skip
        table.update(first)
        assert await poll(session, worker.url) == []  # each event once
        for i in range(12):  # more prompts than the cache holds: blocks are stored, then evicted
            body = {"model": "tiny", "prompt": f"prompt number {i} " + "x" * 90, "max_tokens": 1}
            async with session.post(worker.url + "/v1/completions", json=body) as r:
                assert r.status == 200
            events = await poll(session, worker.url)
            table.update(events)
            assert table.blocks == cached_hashes(cache)
        assert cache.evicted_blocks_total > 0  # removals were part of it
        stored = [e["data"] for e in events if e["data"]["type"] == "stored"]
        assert stored and all(b["tokens"] == [] and b["type"] == "stored_block" for s in stored for b in s["blocks"])
        async with session.get(worker.url + "/kv_cache_events") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
    finally:
        await worker.server.cleanup()


async def test_kv_cache_events_take_the_metrics_access_rule(session: aiohttp.ClientSession) -> None:
    worker = await tiny_worker("both", kv_tokens=256, metrics_token=b"tok")
    try:
        async with session.post(worker.url + "/kv_cache_events") as r:
            assert r.status == 401
        assert (await poll(session, worker.url, {"Authorization": "Bearer tok"}))[0]["data"]["type"] == "created"
        async with session.get(worker.url + "/prometheus/metrics") as r:
            assert r.status == 401
    finally:
        await worker.server.cleanup()


def test_the_event_log_of_each_cache_is_chained_and_bounded() -> None:
    cache = PagedKVCache(small_config(), 64, block_size=4, prefix_caching=True)
    log = events_of(cache, cache.block_size, cache.num_blocks)
    ids = np.arange(1, 14, dtype=np.int32)  # 3 full blocks
    blocks, _ = cache.allocate_prefix(ids, 13)
    done = cache.register(blocks, ids, 8)  # two blocks now
    cache.register(blocks, ids, 13, done)  # the third: its parent is the second
    events = [e["data"] for e in log.drain()]
    assert [e["type"] for e in events] == ["created", "stored", "stored"]
    assert events[1]["parent_hash"] is None and len(events[1]["blocks"]) == 2
    assert events[2]["parent_hash"] == events[1]["blocks"][1]["block_hash"]
    model = PrefixCacheModel(32)  # two blocks of 16
    model_log = events_of(model, model.block_size, model.num_blocks)
    _, hashes = model.lookup(np.arange(48, dtype=np.int32))
    model.remember(hashes)  # three blocks into two: the oldest removed
    table = TrtllmBlockTable()
    table.update(model_log.drain())
    assert table.blocks == {block_hash(d) for d in model._blocks} and model.evicted_blocks == 1
    small = KvEventLog(4, 16, max_events=3)
    for i in range(5):
        small.removed([bytes([i]) * 16])
    assert [e["event_id"] for e in small.drain()] == [3, 4, 5] and small.dropped == 3


async def test_worker_version_perf_metrics_and_clock(session: aiohttp.ClientSession) -> None:
    worker = await tiny_worker("both", kv_tokens=256)
    try:
        await check_common_endpoints(session, worker.url)
    finally:
        await worker.server.cleanup()


async def check_common_endpoints(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(url + "/version") as r:
        assert r.status == 200 and await r.json() == {"version": fastcore.__version__}
    async with session.get(url + "/perf_metrics") as r:
        assert r.status == 200 and await r.json() == []
    async with session.get(url + "/steady_clock_offset") as r:
        clock = await r.json()
        assert r.status == 200 and clock["transmit_ts"] >= clock["receive_ts"] > 0
    async with session.post(url + "/steady_clock_offset", json={"offset": -0.25}) as r:
        assert r.status == 200
    for bad in ({"offset": "soon"}, {"offset": float("inf")}, {}, [1]):
        async with session.post(url + "/steady_clock_offset", data=json.dumps(bad)) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "offset"
    async with session.get(url + "/prometheus/metrics") as r:
        page = await r.text()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain") and "# TYPE" in page
    async with session.delete(url + "/version") as r:
        assert r.status == 405


async def test_orchestrator_endpoints_and_cluster_info(session: aiohttp.ClientSession) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    data = {"port": port, "health_check_interval_s": 0.3, "context_servers": {}, "generation_servers": {},
            "disagg_cluster": {"cluster_uri": uri, "cluster_name": "ci", "heartbeat_interval_sec": 0.25,
                               "inactive_timeout_sec": 2, "api_key": "k",
                               "minimal_instances": {"context_servers": 1, "generation_servers": 2}}}  # fmt: skip
    server, orch = await start_server(build_config(data, environ={}))
    storage = HttpStorageClient(uri, api_key="k")
    standins = [await start_standin("context"), await start_standin("generation")]
    workers = [ClusterWorker(role, "127.0.0.1", s.port, storage, cluster_name="ci", heartbeat_s=0.25,
                             inactive_timeout_s=2) for s, role in zip(standins, ServerRole)]  # fmt: skip
    try:
        async with session.get(uri + "/cluster_info") as r:
            assert r.status == 200 and await r.json() == {
                "is_ready": False,
                "current_workers": {"context_servers": [], "generation_servers": []},
                "minimal_instances": {"context_servers": 1, "generation_servers": 2},
            }
        for worker in workers:
            assert await worker.register()
        await until(lambda: orch.generation_pool.healthy_count() == 1 and orch.context_pool.ready, 5.0)
        async with session.get(uri + "/cluster_info") as r:
            info = await r.json()
        assert info["is_ready"] is False  # 1 of the 2 generation workers asked for
        assert info["current_workers"] == {
            "context_servers": [{"worker_id": workers[0].info.worker_id, "host": "127.0.0.1", "port": standins[0].port, "role": 0}],
            "generation_servers": [{"worker_id": workers[1].info.worker_id, "host": "127.0.0.1", "port": standins[1].port, "role": 1}],
        }
        await check_common_endpoints(session, uri)
    finally:
        for worker in workers:
            await worker.stop_heartbeats()
        await server.cleanup()
        await storage.close()
        for s in standins:
            await s.stop()


async def test_cluster_info_without_discovery_says_readiness_only(session: aiohttp.ClientSession) -> None:
    ctx, gen = await start_standin("context"), await start_standin("generation")
    port = free_port()
    config = build_config({"port": port, "health_check_interval_s": 0.3, "context_servers": {"urls": [ctx.address]},
                           "generation_servers": {"urls": [gen.address]}}, environ={})  # fmt: skip
    server, orch = await start_server(config)
    try:
        await until(lambda: orch.generation_pool.ready and orch.context_pool.ready, 5.0)
        async with session.get(f"http://127.0.0.1:{port}/cluster_info") as r:
            assert await r.json() == {"is_ready": True}
    finally:
        await server.cleanup()
        await ctx.stop()
        await gen.stop()


async def test_cluster_info_and_prometheus_take_the_metrics_access_rule(session: aiohttp.ClientSession) -> None:
    """/cluster_info names every worker's address (what /metrics was closed for): with a metrics token,
    only a request carrying it reads it, as /prometheus/metrics; /version stays open."""
    ctx, gen = await start_standin("context"), await start_standin("generation")
    port = free_port()
    config = build_config({"port": port, "context_servers": {"urls": [ctx.address]}, "metrics_token": "mt",
                           "generation_servers": {"urls": [gen.address]}}, environ={})  # fmt: skip
    server, _ = await start_server(config)
    url = f"http://127.0.0.1:{port}"
    try:
        for path in ("/cluster_info", "/prometheus/metrics"):
            async with session.get(url + path) as r:
                assert r.status == 401, path
            async with session.get(url + path, headers={"Authorization": "Bearer mt"}) as r:
                assert r.status == 200, path
        async with session.get(url + "/version") as r:
            assert r.status == 200
    finally:
        await server.cleanup()
        await ctx.stop()
        await gen.stop()
