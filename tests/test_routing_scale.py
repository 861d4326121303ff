"""Routing cost independent of the fleet's size: Pool.choose's cached routable list
(server/orchestrator/pools.py) and kv_cache_aware's large-pool path (server/orchestrator/routing/kv_cache_aware.py:
a moving load window, the deepest chunk's holders)."""

from __future__ import annotations

import json

from server.orchestrator.pools import Pool
from server.orchestrator.routing import LOAD_SAMPLE, MAX_ASKED, KvCacheAwareRouter, request_key


def _pool(n: int, kind: str = "round_robin") -> Pool:
    pool = Pool(
        "generation",
        [f"http://w{i}" for i in range(n)],
        kind,
        {"chunk_bytes": 64} if kind != "round_robin" else None,
    )
    for w in pool.workers:
        w.healthy = True
    return pool


def test_the_cached_routable_list_follows_health_and_breakers() -> None:
    pool = _pool(3)
    a, b, c = pool.workers
    assert {id(pool.choose()) for _ in range(6)} == {id(a), id(b), id(c)}
    b.healthy = False
    assert all(pool.choose() is not b for _ in range(6))
    b.healthy = True
    assert any(pool.choose() is b for _ in range(6))
    assert c.breaker.failed(at_once=True)  # open: no leg
    assert all(pool.choose() is not c for _ in range(6))
    c.breaker.opened_at -= c.breaker.open_for + 1  # its time is up: the next leg is its probe
    chosen = []
    for _ in range(6):
        worker = pool.choose()
        assert worker is not None
        worker.breaker.chosen()  # as the leg that goes there does
        chosen.append(worker)
    assert chosen.count(c) == 1  # one probe at a time (the full pass decides while it is not closed)
    c.breaker.succeeded()
    assert any(pool.choose() is c for _ in range(6))
    pool.sync_discovered(["http://new"])  # a new member list: seen at once
    pool.workers[-1].healthy = True
    assert any(getattr(pool.choose(), "url", None) == "http://new" for _ in range(8))
    assert getattr(pool.choose(exclude=[a, b, c]), "url", None) == "http://new"


def _body(conversation: int, turns: int, system: str = "shared system prompt " * 20) -> bytes:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"{conversation}-{t} " + "u" * 300})
    return json.dumps({"messages": messages}).encode()


def test_a_large_pool_finds_the_holder_outside_its_load_window() -> None:
    """1,024 workers: the conversation's home is found by the inverted index, whichever window
    of loads is read; every worker holding the shared system prompt is not asked."""
    pool = _pool(1024, "kv_cache_aware")
    router = pool.router
    assert isinstance(router, KvCacheAwareRouter)
    for i, worker in enumerate(pool.workers):  # every worker holds the system prompt's chunks
        router.routed(worker, request_key(_body(10_000 + i, 0), True, None).hashes(64))
    home = pool.workers[700]
    router.routed(home, request_key(_body(1, 3), True, None).hashes(64))
    assert len(router._holders[request_key(_body(1, 3), True, None).hashes(64)[0]]) > MAX_ASKED
    for turn in range(4, 4 + LOAD_SAMPLE):  # windows all over the pool
        key = request_key(_body(1, turn), True, None)
        assert pool.choose(key=key) is home
        assert key.hit_chunks >= len(request_key(_body(1, turn - 1), True, None).hashes(64)) - 1
    cold = request_key(_body(2, 3, system="another system prompt " * 20), True, None)
    assert pool.choose(key=cold) is not None and cold.hit_chunks == 0
