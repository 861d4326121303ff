"""Workers' cache events in the orchestrator's key space (server/worker/kv_events.py ChunkEventLog,
``GET /cache_events``) and the orchestrator's exact view of them (server/orchestrator/cache_view.py).

Real synthetic text-mode workers (their modelled prefix cache) and real orchestrators on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from helpers import free_port

from server.cache_keys import prompt_keys, salt_key
from server.orchestrator.app import start_server
from server.orchestrator.cache_view import CacheView, _Follower
from server.orchestrator.config import build_config
from server.orchestrator.routing import KvCacheAwareRouter, request_key
from server.worker.app import WorkerSettings, start_worker
from server.worker.kv_events import ChunkEventLog
from server.worker.synthetic import SyntheticEngine

CHUNK = 64


def body_of(text: str, **extra: Any) -> bytes:
    return json.dumps({"model": "synthetic", "messages": [{"role": "user", "content": text}],
                       "max_tokens": 2, **extra}).encode()  # fmt: skip


# -- the worker's log -----------------------------------------------------------------------------------


def test_keys_are_the_routers_own_and_salted_apart() -> None:
    body = body_of("the agent reads the file " * 40)
    keys, _ = prompt_keys(body, True, CHUNK)
    assert keys and keys == request_key(body, True, None).hashes(CHUNK)
    salted = body_of("the agent reads the file " * 40, cache_salt="tenant-a")
    skeys, _ = prompt_keys(salted, True, CHUNK)
    assert skeys == request_key(salted, True, None).hashes(CHUNK)
    assert skeys == [k ^ salt_key("tenant-a") for k in keys] and not set(skeys) & set(keys)
    other, _ = prompt_keys(body_of("the agent reads the file " * 40, cache_salt="tenant-b"), True, CHUNK)
    assert not set(other) & set(skeys)


def test_a_log_maps_chunks_to_blocks_and_evicts_them_with_their_block() -> None:
    log = ChunkEventLog("i1", CHUNK, block_size=16, max_events=4)
    keys = list(range(100, 110))  # 10 chunks of 64 bytes: 640 bytes
    log.pending["r"] = (keys, 640)
    digests = [bytes([i]) * 16 for i in range(9)]  # 9 full blocks of 16 ids: 144 of 160 ids
    log.stored("r", digests, 160)
    # chunk i ends at token ceil((i+1) x 64 x 160 / 640) = 16 (i+1): block i; the 10th's is partial
    assert log.held == {100 + i: digests[i] for i in range(9)}
    assert log.answer(0, "i1")["events"] == [{"seq": 1, "stored": keys[:9]}]
    log.evicted([digests[8], digests[7], b"unknown"])
    assert log.answer(1, "i1")["events"] == [{"seq": 2, "removed": [108, 107]}]
    assert 108 not in log.held and 100 in log.held


def test_a_follower_behind_the_buffer_or_of_another_instance_gets_a_resync() -> None:
    log = ChunkEventLog("i1", CHUNK, block_size=16, max_events=2)
    for n in range(4):
        log.pending[str(n)] = ([n], 64)
        log.stored(str(n), [bytes([n]) * 16], 16)
    assert [e["seq"] for e in log.answer(2, "i1")["events"]] == [3, 4]
    for after, instance in ((1, "i1"), (0, "i1"), (5, "i1"), (3, "i0"), (3, None)):
        answer = log.answer(after, instance)
        assert answer["resync"] is True and sorted(answer["held"]) == [0, 1, 2, 3], (after, instance)
        assert answer["seq"] == 4 and answer["instance"] == "i1"


# -- GET /cache_events ------------------------------------------------------------------------------------


async def _text_worker(**settings: Any) -> tuple[Any, str, SyntheticEngine]:
    engine = SyntheticEngine(0, bytes_per_token=1, kv_tokens=4096)
    settings.setdefault("cache_events_chunk_bytes", CHUNK)  # the routers' here
    server, port = await start_worker(engine, WorkerSettings(model_name="synthetic", **settings))
    return server, f"http://127.0.0.1:{port}", engine


@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ("after=-1", 400, "after"),
        ("after=x", 400, "after"),
        ("chunk_bytes=48", 400, "chunk_bytes"),
        ("chunk_bytes=0", 400, "chunk_bytes"),
        ("wait=31", 400, "wait"),
        ("wait=nan", 400, "wait"),
    ],
)
async def test_bad_queries_are_400s_naming_the_parameter(query: str, status: int, param: str) -> None:
    server, url, _ = await _text_worker()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/cache_events?{query}") as resp:
                assert resp.status == status
                error = (await resp.json())["error"]
                assert error["param"] == param and param in error["message"]
    finally:
        await server.cleanup()


async def test_the_stream_is_guarded_one_chunk_size_and_long_polled() -> None:
    server, url, _ = await _text_worker(metrics_token=b"sekrit")
    auth = {"Authorization": "Bearer sekrit"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/cache_events") as resp:
                assert resp.status == 401  # the keys are an oracle of prompts: /metrics' rule
            async with session.get(f"{url}/cache_events?chunk_bytes={CHUNK}", headers=auth) as resp:
                first = await resp.json()
            assert first["resync"] is True and first["held"] == [] and first["chunk_bytes"] == CHUNK
            async with session.get(f"{url}/cache_events?chunk_bytes=128", headers=auth) as resp:
                assert resp.status == 400 and "64" in (await resp.json())["error"]["message"]  # the worker's
            instance = first["instance"]
            poll = asyncio.ensure_future(
                session.get(
                    f"{url}/cache_events?chunk_bytes={CHUNK}&after=0&instance={instance}&wait=20",
                    headers=auth,
                )
            )
            await asyncio.sleep(0.2)
            assert not poll.done()  # held open: nothing happened yet
            body = body_of("the agent reads the file " * 40)
            async with session.post(f"{url}/v1/chat/completions", data=body) as resp:
                assert resp.status == 200
            resp = await asyncio.wait_for(poll, 10)
            answer = await resp.json()
            (event,) = answer["events"]
            keys, _ = prompt_keys(body, True, CHUNK)
            assert event["seq"] == 1 and event["stored"] == keys[: len(event["stored"])]
            assert len(event["stored"]) >= len(keys) - 2
    finally:
        await server.cleanup()


async def test_a_worker_without_events_is_a_404() -> None:
    from tiny_workers import synthetic_worker

    worker = await synthetic_worker()  # fixed prompts: no modelled cache... but a cache object
    worker.engine.cache = None  # an engine without a prefix cache model
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(worker.url + "/cache_events") as resp:
                assert resp.status == 404
    finally:
        await worker.server.cleanup()


# -- the orchestrator's follower --------------------------------------------------------------------------


def test_a_gap_or_a_forgotten_index_asks_for_a_resync() -> None:
    from server.orchestrator.pools import Worker

    router = KvCacheAwareRouter({"chunk_bytes": CHUNK})
    worker = Worker("http://w")
    follower = _Follower(None, router, worker)  # type: ignore[arg-type]
    follower.view = type("View", (), {"events": 0, "resyncs": 0})()
    assert follower.apply({"instance": "i", "seq": 3, "resync": True, "held": [1, 2]})
    assert worker in router.followed and worker in router.exact and router._holders[1] == {worker}
    assert follower.apply({"instance": "i", "seq": 4, "events": [{"seq": 4, "stored": [5]}]})
    assert follower.apply({"instance": "i", "seq": 5, "events": [{"seq": 5, "removed": [1]}]})
    assert 1 not in router._holders and 5 in router._holders
    assert not follower.apply({"instance": "i", "seq": 7, "events": [{"seq": 7, "stored": [9]}]})  # 6 missed
    assert not follower.apply({"instance": "j", "seq": 6, "events": []})  # another process
    assert not follower.apply({"instance": "i", "seq": 6, "events": [{"seq": 6, "stored": [-1]}]})
    router.forget(worker)  # unhealthy meanwhile: its index is gone
    assert not follower.apply({"instance": "i", "seq": 5, "events": []})


async def test_two_orchestrators_see_each_others_requests_in_the_workers_events() -> None:
    """A prompt sent through orchestrator A is cached on a context worker; orchestrator B, which
    never saw it, holds it in its index from that worker's events and routes the prompt's next turn
    there (a hit), while the same prompt under another cache_salt expects no hit anywhere."""
    started = [await _text_worker(role=role) for role in ("context", "context", "generation")]
    urls = [url for _, url, _ in started]
    router = {"type": "kv_cache_aware", "args": {"chunk_bytes": CHUNK}}
    fronts = []
    for _ in range(2):
        config = build_config(
            {
                "port": free_port(),
                "health_check_interval_s": 0.1,
                "context_servers": {"urls": urls[:2], "router": router},
                "generation_servers": {"urls": urls[2:]},
            },
            environ={},
        )
        server, orch = await start_server(config)
        fronts.append((server, orch, f"http://127.0.0.1:{config.port}"))
    (_, _, url_a), (_, orch_b, url_b) = fronts
    try:
        for _ in range(200):
            if all(o.context_pool.ready and o.generation_pool.ready for _, o, _ in fronts):
                break
            await asyncio.sleep(0.05)
        view = orch_b.cache_view
        assert isinstance(view, CacheView)
        for _ in range(200):  # both context workers followed (their first answer: a resync)
            if view.resyncs >= 2:
                break
            await asyncio.sleep(0.05)
        text = "the agent reads the file and writes the patch " * 30
        async with aiohttp.ClientSession() as session:
            async with session.post(url_a + "/v1/chat/completions", data=body_of(text)) as resp:
                assert resp.status == 200
            served = [i for i, (_, _, engine) in enumerate(started[:2]) if engine.cache.cached_tokens]
            assert len(served) == 1
            home = orch_b.context_pool.workers[served[0]]
            router_b = orch_b.context_pool.router
            assert isinstance(router_b, KvCacheAwareRouter)
            following = body_of(text + " and then the tests")
            key = request_key(following, True, None)
            for _ in range(200):
                if router_b.expected_hit(home, key) > 0:
                    break
                await asyncio.sleep(0.05)
            assert router_b.expected_hit(home, key) >= len(key.hashes(CHUNK)) - 3
            other = next(w for w in orch_b.context_pool.workers if w is not home)
            assert router_b.expected_hit(other, key) == 0
            salted = request_key(body_of(text + " and then the tests", cache_salt="t2"), True, None)
            assert all(router_b.expected_hit(w, salted) == 0 for w in orch_b.context_pool.workers)
            before = started[served[0]][2].prefix_hit_tokens
            async with session.post(url_b + "/v1/chat/completions", data=following) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
            assert started[served[0]][2].prefix_hit_tokens > before
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for server, _, _ in fronts:
            await server.cleanup()
        for server, _, _ in started:
            await server.cleanup()


def test_a_resync_keeps_what_was_routed_just_before_it() -> None:
    """A worker's snapshot may be taken before it stored a request routed to it a moment ago (the
    first one, at startup, raced the first requests): those routes stay in its index; older ones
    (the worker answered for them since) do not."""
    from server.orchestrator.pools import Worker

    router = KvCacheAwareRouter({"chunk_bytes": CHUNK})
    worker = Worker("http://w")
    worker.healthy = True
    key = request_key(body_of("the agent reads the file " * 40), True, None)
    router.choose([worker], key)
    router.resync(worker, [])
    assert router.expected_hit(worker, key) == len(key.hashes(CHUNK))
    at, routed_to, hashes = router._recent[-1]
    router._recent[-1] = (at - 60.0, routed_to, hashes)
    router.resync(worker, [])
    assert router.expected_hit(worker, key) == 0
