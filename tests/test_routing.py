"""Routers (server/orchestrator/routing/: conversation.py, kv_cache_aware.py), and conditional disaggregation.

Unit tests drive the routers and pools directly; the end-to-end tests run an orchestrator in the
test's loop against stub workers written here as real aiohttp servers on 127.0.0.1 (real sockets,
nothing of ours mocked): they record every request they get, so which worker served what is seen.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers import free_port
from routing_inputs import history, workers

from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.orchestrator.pools import Capabilities, HealthChecker, Pool, Worker
from server.orchestrator.routing import (
    BYTES_PER_TOKEN,
    ConversationRouter,
    KvCacheAwareRouter,
    RequestKey,
    make_router,
    request_key,
)


def chat(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 4, **extra}).encode()


# -- request keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "header", "expected"),
    [
        ('"conv-1"', None, b"conv-1"),
        ('"caf\\u00e9"', None, "café".encode()),
        ("42", None, b"42"),
        ("-7", None, b"-7"),
        ("4.5", None, None),  # neither a string nor an integer
        ("1e3", None, None),
        ('{"id": 1}', None, None),  # an object: no id, never an exception
        ("[1]", None, None),
        ("null", None, None),
        ('""', None, None),
        ('{"id": 1}', b"from-header", b"from-header"),  # a bad body id falls back to the header
        ('"body"', b"header", b"body"),  # the body's id wins
        (None, b"  hdr  ", b"hdr"),
        (None, b"", None),
        (None, b"x" * 2000, None),  # too long to be an id
        ('"' + "x" * 2000 + '"', None, None),
    ],
)
def test_conversation_id_of_a_body(value: str | None, header: bytes | None, expected: bytes | None) -> None:
    members = '"model":"m","messages":[{"role":"user","content":"hi"}]'
    body = ("{" + members + (f',"conversation_id":{value}' if value is not None else "") + "}").encode()
    assert request_key(body, True, header).conversation == expected


def test_prompt_span_is_the_raw_messages_or_prompt_value() -> None:
    body = chat([{"role": "user", "content": "x" * 100}])
    key = request_key(body, True, None)
    assert key.span is not None and body[key.span[0] : key.span[1]].startswith(b'[{"role"')
    assert key.prompt_bytes == len(json.dumps([{"role": "user", "content": "x" * 100}]))
    completion = b'{"model":"m","prompt":"' + b"p" * 200 + b'"}'
    key = request_key(completion, False, None)
    assert key.span is not None and completion[key.span[0] : key.span[1]] == b'"' + b"p" * 200 + b'"'
    assert key.hashes(64) == key.hashes(64) and len(key.hashes(64)) == 202 // 64
    assert len(key.hashes(32)) == 202 // 32  # another chunk size: computed again, not the cached list


@pytest.mark.parametrize(
    "body",
    [
        b'{"conversation_id":"a","conversation_id":"b","messages":[]}',  # repeated: the scan refuses it
        b"not json at all",
        b'{"model":"m"}',  # no messages: no span
        b'{"messages": 12}',  # a span, shorter than a chunk
    ],
)
def test_bad_bodies_route_least_loaded(body: bytes) -> None:
    key = request_key(body, True, None)
    assert key.conversation is None
    assert key.hashes(32) == []
    pool = workers(3)
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 2, 0, 1
    for router in (ConversationRouter(), KvCacheAwareRouter()):
        assert router.choose(pool, key) is pool[1]
        assert router.choose(pool, None) is pool[1]


# -- conversation -----------------------------------------------------------------------------------


def owners(router: ConversationRouter, pool: list[Worker], n: int = 2000) -> dict[bytes, str]:
    router.sync(pool)
    return {
        cid: router.choose(pool, RequestKey(b"", cid, None)).url
        for cid in (f"conv-{i}".encode() for i in range(n))
    }


def test_conversation_sticks_and_spreads() -> None:
    pool = workers(4)
    router = ConversationRouter({"virtual_nodes": 64})
    first = owners(router, pool)
    for w in pool:
        w.in_flight = 5  # an even load moves nothing
    assert owners(router, pool) == first
    unbounded = ConversationRouter({"virtual_nodes": 64, "load_factor": 0})
    pool[0].in_flight = 50  # without the bound, no load moves a conversation
    assert owners(unbounded, pool) == first
    shares = {w.url: list(first.values()).count(w.url) / len(first) for w in pool}
    assert all(0.12 < share < 0.40 for share in shares.values()), shares


def test_a_joining_worker_moves_about_a_fifth() -> None:
    pool = workers(4)
    router = ConversationRouter()
    before = owners(router, pool)
    after = owners(router, pool + workers(5)[4:])
    moved = [cid for cid in before if before[cid] != after[cid]]
    assert 0.10 < len(moved) / len(before) < 0.32
    assert all(after[cid] == "http://w4" for cid in moved)  # only to the new worker


def test_a_dead_worker_moves_only_its_conversations() -> None:
    pool = workers(4)
    router = ConversationRouter()
    before = owners(router, pool)
    router.sync(pool)
    healthy = [w for w in pool if w.url != "http://w2"]
    after = {cid: router.choose(healthy, RequestKey(b"", cid, None)).url for cid in before}
    for cid, url in before.items():
        if url == "http://w2":
            assert after[cid] != "http://w2"
        else:
            assert after[cid] == url
    # Back in: every conversation goes home.
    assert owners(router, pool) == before
    # Gone from the pool (discovery): the ring is rebuilt without it; the others stay.
    assert {cid: u for cid, u in owners(router, healthy).items() if before[cid] != "http://w2"} == {
        cid: u for cid, u in before.items() if u != "http://w2"
    }


def test_the_ring_is_stable_across_processes() -> None:
    """blake2b, never the salted hash(): another interpreter with another hash seed agrees."""
    code = (
        "from server.orchestrator.pools import Worker\n"
        "from server.orchestrator.routing import ConversationRouter, RequestKey\n"
        "ws = [Worker(f'http://w{i}') for i in range(5)]\n"
        "r = ConversationRouter(); r.sync(ws)\n"
        "print(','.join(r.choose(ws, RequestKey(b'', f'c{i}'.encode(), None)).url for i in range(200)))\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]  # fmt: skip
    assert runs[0] == runs[1] and runs[0].count("http://w") == 200


def test_one_hot_conversation_cannot_pin_its_load_on_one_worker() -> None:
    """Bounded loads: requests of one id pile on its worker only up to load_factor x the mean, then
    go to the next workers on the ring; once the load is gone the conversation is home again."""
    pool = workers(4)
    router = ConversationRouter({"load_factor": 1.25})
    router.sync(pool)
    hot = RequestKey(b"", b"the-one-conversation", None)
    home = router.choose(pool, hot)
    for n in range(1, 41):  # 40 requests in flight at once, none finishing
        chosen = router.choose(pool, hot)
        chosen.in_flight += 1
        assert max(w.in_flight for w in pool) <= math.ceil(1.25 * n / 4), [w.in_flight for w in pool]
    # the home worker holds its bound (13 = ceil(1.25 x 40 / 4)), the ring's next ones the rest
    assert home.in_flight == max(w.in_flight for w in pool) == 13
    assert sum(w.in_flight for w in pool) == 40
    for w in pool:
        w.in_flight = 0
    assert router.choose(pool, hot) is home
    # the overflow follows the ring's order: a second worker, not a random one
    home.in_flight = 3
    ring_next = router.owner(hot.conversation or b"", {w.url: w for w in pool if w is not home})
    assert router.choose(pool, hot) is ring_next


def test_conversation_load_factor_is_checked() -> None:
    for bad in (0.5, -1, "x", True):
        with pytest.raises(ValueError, match="load_factor"):
            ConversationRouter({"load_factor": bad})
    assert ConversationRouter({"load_factor": 0}).capacity(workers(2)) == math.inf


def test_no_id_goes_least_loaded_and_empty_ring_falls_back() -> None:
    pool = workers(3)
    pool[0].in_flight = 3
    pool[2].in_flight = 1
    router = ConversationRouter()
    router.sync(pool)
    assert router.choose(pool, RequestKey(b"", None, None)) is pool[1]
    unsynced = ConversationRouter()  # no members known: least loaded too
    assert unsynced.choose(pool, RequestKey(b"", b"c", None)) is pool[1]


# -- kv_cache_aware ------------------------------------------------------------------------------------


def key_of(messages: list[dict[str, Any]]) -> RequestKey:
    return request_key(chat(messages), True, None)


def test_the_next_turn_goes_where_the_prefix_is() -> None:
    pool = workers(4)
    router = KvCacheAwareRouter({"chunk_bytes": 256})
    homes = {}
    for conv in range(8):
        homes[conv] = router.choose(pool, key_of(history(conv, 1)))
    # New conversations spread (no hit anywhere: load, then in turn).
    assert len({w.url for w in homes.values()}) == 4
    for conv in range(8):
        key = key_of(history(conv, 2))
        assert router.choose(pool, key) is homes[conv]
        assert key.hit_chunks >= len(key_of(history(conv, 1)).hashes(256)) - 1
        assert key.hit_chunks < len(key.hashes(256))
    assert router.hit_chunks > 0 and router.routed_chunks > router.hit_chunks


def test_load_outweighs_a_hit_on_a_hot_worker() -> None:
    pool = workers(2)
    router = KvCacheAwareRouter({"chunk_bytes": 256, "max_load_ratio": 1.5, "load_weight": 1.0})
    home = router.choose(pool, key_of(history(1, 1)))
    other = pool[1] if home is pool[0] else pool[0]
    home.in_flight = 10  # > 1.5x the mean (5) and > mean + 1: its hit earns nothing
    key = key_of(history(1, 2))
    assert router.choose(pool, key) is other and key.hit_chunks == 0
    home.in_flight = other.in_flight = 0
    home = router.choose(pool, key_of(history(5, 1)))
    other = pool[1] if home is pool[0] else pool[0]
    home.in_flight = 1  # mildly busier: the hit wins
    key = key_of(history(5, 2))
    assert router.choose(pool, key) is home and key.hit_chunks > 0
    # load_weight large: one request more than the mean costs more than any hit.
    heavy = KvCacheAwareRouter({"chunk_bytes": 256, "load_weight": 1e9})
    home.in_flight = other.in_flight = 0
    first = heavy.choose(pool, key_of(history(2, 1)))
    first.in_flight = 1
    assert heavy.choose(pool, key_of(history(2, 2))) is not first


def test_the_index_is_bounded_and_keeps_prefixes() -> None:
    (worker,) = workers(1)
    router = KvCacheAwareRouter({"chunk_bytes": 32, "max_cached_tokens": 80})  # 80*4/32 = 10 chunks
    assert router._limit(worker) == 10
    keys = [key_of(history(c, 1, size=100)) for c in range(5)]
    for key in keys:
        router.choose([worker], key)
    index = router.index(worker)
    assert len(index.entries) <= 10 + 10 // 4
    newest = keys[-1].hashes(32)
    held = index.longest_prefix(newest)
    assert held > 0 and all(h in index.entries for h in newest[:held])  # what stays is a prefix
    # The oldest are gone but for the first chunk, '[{"role": "system", "content": "c', every conversation's.
    assert index.longest_prefix(keys[0].hashes(32)) == 1
    worker.kv_capacity_tokens = 800  # the worker said how much it caches
    router.forget(worker)
    assert router._limit(worker) == 100 and router.index(worker).entries == {}


def test_a_worker_cannot_make_its_index_unbounded() -> None:
    """kv_capacity_tokens is the worker's word: max_index_tokens caps the index it sizes."""
    (worker,) = workers(1)
    worker.kv_capacity_tokens = 4_500_000_000
    router = KvCacheAwareRouter({"chunk_bytes": 32, "max_index_tokens": 800})  # 800*4/32 = 100 chunks
    assert router._limit(worker) == 100
    for c in range(60):  # 60 distinct prompts of ~13 chunks each: 780 chunks offered
        router.choose([worker], key_of(history(1000 + c, 1, size=100)))
    assert len(router.index(worker).entries) <= 100 + 100 // 4
    assert KvCacheAwareRouter()._limit(worker) == (1 << 20) * 4 // 512  # the default bound


def test_forget_sync_and_pool_events_clear_an_index() -> None:
    pool = Pool("generation", ["http://a", "http://b"], "kv_cache_aware", {"chunk_bytes": 64})
    for w in pool.workers:
        w.healthy = True
    router = pool.router
    assert isinstance(router, KvCacheAwareRouter) and pool.needs_key
    key = key_of(history(3, 1))
    chosen = pool.choose(key=key)
    assert chosen is not None and router.expected_hit(chosen, key) == len(key.hashes(64))
    # Leaves the pool through discovery: its index goes.
    pool.static = frozenset({"http://a"} - {chosen.url})
    pool.discovered = {chosen.url}
    pool.sync_discovered([])
    assert chosen not in router._indexes
    # A health event clears it too.
    (rest,) = pool.workers
    pool.choose(key=key)
    assert router.expected_hit(rest, key) > 0
    pool.forget(rest)
    assert router.expected_hit(rest, key) == 0


def test_round_robin_and_least_loaded_take_no_key() -> None:
    for kind in ("round_robin", "least_loaded"):
        assert not make_router(kind).needs_key
    assert make_router("conversation").key_kinds == {"conversation"}
    assert make_router("kv_cache_aware").key_kinds == {"prefix"}


@pytest.mark.parametrize(
    ("info", "b64", "local", "capacity"),
    [
        ({"local_prefill": True, "kv_capacity_tokens": 4096}, False, True, 4096),
        ({"local_prefill": 1, "kv_capacity_tokens": -5}, False, False, None),
        ({"local_prefill": "yes", "kv_capacity_tokens": True}, False, False, None),
        ({"prompt_token_ids_b64_completions": True}, True, False, None),
        ([1], False, False, None),
    ],
)
def test_capabilities_of_server_info(info: Any, b64: bool, local: bool, capacity: int | None) -> None:
    caps = Capabilities.of(info)
    assert (caps.b64_completions, caps.local_prefill, caps.kv_capacity_tokens) == (b64, local, capacity)


# -- stub workers ---------------------------------------------------------------------------------------


class StubWorker:
    """A real HTTP worker on 127.0.0.1 that records the bodies it gets and answers in protocol shape."""

    def __init__(self, role: str, *, local_prefill: bool = False, capacity: int | None = None) -> None:
        self.role = role
        self.info: dict[str, Any] = {"role": role, "model": "m", "local_prefill": local_prefill}
        if capacity is not None:
            self.info["kv_capacity_tokens"] = capacity
        self.bodies: list[dict[str, Any]] = []
        self.healthy = True
        self.full = False  # answer 503 (a full worker: retried elsewhere)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    async def start(self) -> StubWorker:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.full:
            return web.json_response({"error": {"message": "full"}}, status=503, headers={"Retry-After": "1"})
        params = body.get("disaggregated_params")
        if params is not None and params["request_type"] == "context_only":
            return web.json_response(
                {
                    "id": "c", "object": "chat.completion", "created": 1, "model": "m",
                    "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": "A"}, "finish_reason": "length",
                        "disaggregated_params": {
                            "request_type": "context_only", "first_gen_tokens": [7], "ctx_request_id": 5,
                            "disagg_request_id": params["disagg_request_id"], "encoded_opaque_state": None,
                            "ctx_info_endpoint": None, "draft_tokens": None,
                        },
                    }],
                    "prompt_token_ids": [1, 2, 3],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )  # fmt: skip
        where = "local" if params is None else "generation"
        answer = {
            "id": "g", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"{where}:{self.port}"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }  # fmt: skip
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "g", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": f"{where}:{self.port}"}, "finish_reason": "stop"}]}  # fmt: skip
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def orchestrator(ctx: list[StubWorker], gen: list[StubWorker], **config: Any) -> tuple[Any, Any, str]:
    port = free_port()
    data = {
        "port": port,
        "health_check_interval_s": 0.05,
        "context_servers": {"urls": [w.url for w in ctx]},
        "generation_servers": {"urls": [w.url for w in gen]},
    }
    for name in ("context_servers", "generation_servers"):
        data[name].update(config.pop(name, {}))
    server, orch = await start_server(build_config(data | config, environ={}))
    for _ in range(200):
        if all(w.healthy for p in orch.pools for w in p.workers):
            break
        await asyncio.sleep(0.02)
    return server, orch, f"http://127.0.0.1:{port}"


async def post(session: aiohttp.ClientSession, url: str, body: bytes, **headers: str) -> tuple[int, str]:
    async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
        return resp.status, await resp.text()


def served(worker: StubWorker) -> list[Any]:
    """The conversation of each leg the worker got: trtllm-serve's conversation_params (a top-level
    conversation_id never reaches a worker: trtllm-serve's forbid it)."""
    for body in worker.bodies:
        assert "conversation_id" not in body, body
    return [(b.get("conversation_params") or {}).get("conversation_id") for b in worker.bodies]


async def metric(session: aiohttp.ClientSession, url: str, line: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{line} not in /metrics")


# -- end to end -----------------------------------------------------------------------------------------


async def test_conversation_routing_end_to_end() -> None:
    ctx = [await StubWorker("context").start()]
    gen = [await StubWorker("generation").start() for _ in range(3)]
    server, orch, url = await orchestrator(ctx, gen, generation_servers={"router": {"type": "conversation"}})
    try:
        async with aiohttp.ClientSession() as session:
            for turn in range(3):
                for conv in range(6):
                    status, _ = await post(
                        session, url, chat(history(conv, turn + 1, 50), conversation_id=f"c{conv}")
                    )
                    assert status == 200
            homes = {}
            for w in gen:
                for cid in served(w):
                    assert homes.setdefault(cid, w.url) == w.url, "a conversation moved"
            assert len(homes) == 6
            # The header names the conversation when the body does not (and must agree with the body).
            status, _ = await post(session, url, chat(history(0, 1, 50)), **{"X-Conversation-Id": "c0"})
            assert status == 200
            home = next(w for w in gen if w.url == homes["c0"])
            assert served(home)[-1] is None  # the header-routed one landed home
            # A bad conversation_id (an object) is no error: least loaded.
            status, _ = await post(session, url, chat(history(0, 1, 50), conversation_id={"no": 1}))
            assert status == 200
            # Its worker goes unhealthy: its conversations move, the others stay.
            home.healthy = False
            for _ in range(100):
                if not any(w.url == home.url and w.healthy for w in orch.generation_pool.workers):
                    break
                await asyncio.sleep(0.02)
            before = {w.url: len(w.bodies) for w in gen}
            for conv in range(6):
                assert (await post(session, url, chat(history(conv, 4, 50), conversation_id=f"c{conv}")))[
                    0
                ] == 200
            for w in gen:
                moved_here = served(w)[before[w.url] :]
                for cid in moved_here:
                    assert homes[cid] == w.url or homes[cid] == home.url
            assert len(home.bodies) == before[home.url]
    finally:
        await server.cleanup()
        for w in ctx + gen:
            await w.stop()


async def test_kv_cache_aware_routing_end_to_end_and_metrics() -> None:
    ctx = [await StubWorker("context").start() for _ in range(2)]
    gen = [await StubWorker("generation").start() for _ in range(2)]
    router = {"router": {"type": "kv_cache_aware", "chunk_bytes": 256}}
    server, _, url = await orchestrator(ctx, gen, context_servers=router, generation_servers=router)
    try:
        async with aiohttp.ClientSession() as session:
            for turn in range(1, 4):
                for conv in range(4):
                    assert (await post(session, url, chat(history(conv, turn, 1000), user=f"u{conv}")))[
                        0
                    ] == 200
            for pool in (ctx, gen):
                homes: dict[str, str] = {}
                for w in pool:
                    for body in w.bodies:
                        assert homes.setdefault(body["user"], w.url) == w.url, "a conversation left its cache"
                assert len(set(homes.values())) == 2  # and the conversations spread
            hits = await metric(
                session, url, 'fastcore_orchestrator_prefix_hit_chunks_total{pool="generation"}'
            )
            total = await metric(session, url, 'fastcore_orchestrator_prefix_chunks_total{pool="generation"}')
            assert 0 < hits < total
            assert (
                await metric(
                    session, url, 'fastcore_orchestrator_requests_by_path_total{path="disaggregated"}'
                )
                == 12
            )
    finally:
        await server.cleanup()
        for w in ctx + gen:
            await w.stop()


async def test_conditional_disaggregation_end_to_end() -> None:
    """Short uncached remainders go straight to a local_prefill generation worker; long ones take both
    legs, the generation leg on the worker chosen first."""
    ctx = [await StubWorker("context").start()]
    gen = [await StubWorker("generation", local_prefill=True).start(), await StubWorker("generation").start()]
    server, _, url = await orchestrator(
        ctx, gen,
        generation_servers={"router": {"type": "kv_cache_aware", "chunk_bytes": 256}},
        conditional_disagg_config={"max_local_prefill_length": 1000},
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            by_path = 'fastcore_orchestrator_requests_by_path_total{path="%s"}'
            # Turn 1, 6 KB of history (~1500 tokens uncached): both legs.
            long = chat(history(1, 1, 3000), stream=True)
            status, text = await post(session, url, long)
            assert status == 200 and "generation:" in text
            assert len(ctx[0].bodies) == 1
            home = next(w for w in gen if w.bodies)
            assert home is gen[0]  # no hit anywhere, no load: the first in turn
            # Turn 2 on the same worker: ~6 KB cached, ~2 KB new: ~600 tokens uncached (<= 1000).
            turn2 = [*history(1, 1, 3000), {"role": "user", "content": "n" * 2000}]
            status, text = await post(session, url, chat(turn2, stream=True))
            assert status == 200 and f"local:{home.port}" in text, text
            assert len(ctx[0].bodies) == 1  # no context leg
            assert "disaggregated_params" not in home.bodies[-1]
            assert home.bodies[-1]["messages"] == turn2  # the client's request, as it came
            assert await metric(session, url, by_path % "local_prefill") == 1
            # A short new conversation (< 1000 tokens) on a worker that says local_prefill: local,
            # unary this time; the other worker, which does not say it, never gets a plain request.
            for conv in range(10, 16):
                status, text = await post(session, url, chat(history(conv, 1, 200)))
                assert status == 200
            assert all("disaggregated_params" in b for b in gen[1].bodies)
            assert any("disaggregated_params" not in b for b in gen[0].bodies)
            assert await metric(session, url, by_path % "local_prefill") >= 1
            assert await metric(session, url, by_path % "disaggregated") >= 1
            # The local worker is full (503): the retry may go to no worker that cannot prefill.
            gen[0].full = True
            before = (len(gen[0].bodies), len(gen[1].bodies))
            status, _ = await post(session, url, chat(turn2))
            assert status == 503
            assert (len(gen[0].bodies), len(gen[1].bodies)) == (before[0] + 1, before[1])
            # A long remainder on the same worker still takes both legs (the generation leg on it).
            gen[0].full = False
            status, _ = await post(session, url, chat([*turn2, {"role": "user", "content": "z" * 8000}]))
            assert status == 200 and "disaggregated_params" in gen[0].bodies[-1]
    finally:
        await server.cleanup()
        for w in ctx + gen:
            await w.stop()


async def test_without_a_local_prefill_worker_every_request_takes_both_legs() -> None:
    ctx = [await StubWorker("context").start()]
    gen = [await StubWorker("generation").start()]
    server, _, url = await orchestrator(
        ctx, gen,
        generation_servers={"router": {"type": "kv_cache_aware"}},
        conditional_disagg_config={"max_local_prefill_length": 100000},
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(3):
                assert (await post(session, url, chat(history(i, 1, 10))))[0] == 200
            assert len(ctx[0].bodies) == 3
            assert all("disaggregated_params" in b for b in gen[0].bodies)
    finally:
        await server.cleanup()
        for w in ctx + gen:
            await w.stop()


async def test_health_events_clear_the_index_and_read_capabilities() -> None:
    stub = await StubWorker("generation", local_prefill=True, capacity=2048).start()
    pool = Pool("generation", [stub.url], "kv_cache_aware", {"chunk_bytes": 64})
    router = pool.router
    assert isinstance(router, KvCacheAwareRouter)
    try:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker([pool], session, interval=1, timeout=1)
            await checker.check_all()
            (worker,) = pool.workers
            assert worker.healthy and worker.local_prefill and worker.kv_capacity_tokens == 2048
            assert router._limit(worker) == 2048 * BYTES_PER_TOKEN // 64
            key = key_of(history(1, 1))
            pool.choose(key=key)
            assert router.expected_hit(worker, key) > 0
            await checker.check_all()  # still healthy: the index stays
            assert router.expected_hit(worker, key) > 0
            stub.healthy = False
            await checker.check_all()
            assert not worker.healthy and router.expected_hit(worker, key) == 0
            stub.healthy = True
            await checker.check_all()
            pool.choose(key=key)
            checker.mark_unhealthy(pool, worker)  # a failed request
            assert router.expected_hit(worker, key) == 0
    finally:
        await stub.stop()


async def test_a_worker_restarted_between_two_health_checks_loses_its_index() -> None:
    """/health never failed, but the process behind the URL is new (its cache empty): the
    worker's /health says its instance, and a new one clears the router's index of it."""
    from server.worker.app import WorkerSettings, start_worker
    from server.worker.synthetic import SyntheticEngine

    port = free_port()
    settings = WorkerSettings(role="generation", model_name="synthetic")
    server, _ = await start_worker(SyntheticEngine(0), settings, port=port)
    pool = Pool("generation", [f"http://127.0.0.1:{port}"], "kv_cache_aware")
    (worker,) = pool.workers
    body = json.dumps({"model": "synthetic", "messages": [{"role": "user", "content": "x" * 4096}]}).encode()
    key = request_key(body, True, None)
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker([pool], session, interval=60.0, timeout=2.0)
        try:
            await checker.check_worker(pool, worker)
            assert worker.healthy and worker.instance and worker.local_prefill
            first = worker.instance
            assert pool.choose(key=key) is worker
            router = pool.router
            assert isinstance(router, KvCacheAwareRouter) and router.expected_hit(worker, key) > 0
            await checker.check_worker(pool, worker)  # the same process: the index stays
            assert router.expected_hit(worker, key) > 0
            await server.cleanup()
            server, _ = await start_worker(SyntheticEngine(0), settings, port=port)
            await checker.check_worker(pool, worker)
            assert worker.healthy and worker.instance != first
            assert router.expected_hit(worker, key) == 0
        finally:
            await server.cleanup()


async def test_conditional_disaggregation_with_real_workers_answers_as_one_worker_would() -> None:
    """Synthetic text-mode workers (the worker's whole protocol, a modelled prefix cache): a long
    first turn takes both legs, its follow-up (a short uncached remainder on the generation worker
    that now holds the prefix) is prefilled there; both answer what a single worker answers."""
    from server.worker.app import WorkerSettings, start_worker
    from server.worker.synthetic import SyntheticEngine

    started = [
        await start_worker(SyntheticEngine(0), WorkerSettings(role=role, model_name="synthetic"))
        for role in ("context", "generation", "both")
    ]
    ctx_port, gen_port, ref_port = (port for _, port in started)
    config = build_config(
        {
            "port": free_port(),
            "health_check_interval_s": 0.2,
            "gen_tokids_ctxbytes": True,
            "context_servers": {"urls": [f"127.0.0.1:{ctx_port}"], "router": {"type": "kv_cache_aware"}},
            "generation_servers": {"urls": [f"127.0.0.1:{gen_port}"], "router": {"type": "kv_cache_aware"}},
            "conditional_disagg_config": {"max_local_prefill_length": 1024},
        },
        environ={},
    )
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{config.port}"
    history = [{"role": "user", "content": "the agent reads the file " * 400}]
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                if orch.context_pool.ready and orch.generation_pool.ready:
                    break
                await asyncio.sleep(0.05)
            answers = []
            for turn in range(3):
                body = {"model": "synthetic", "messages": history, "max_tokens": 6}
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    got = await r.json()
                async with session.post(f"http://127.0.0.1:{ref_port}/v1/chat/completions", json=body) as r:
                    want = await r.json()
                assert got["choices"][0]["message"] == want["choices"][0]["message"], turn
                assert got["usage"] == want["usage"], turn
                answers.append(got)
                history = [
                    *history,
                    got["choices"][0]["message"],
                    {"role": "user", "content": f"and {turn}?"},
                ]
            async with session.get(url + "/metrics") as r:
                page = await r.text()
        assert 'fastcore_orchestrator_requests_by_path_total{path="disaggregated"} 1.0' in page
        assert 'fastcore_orchestrator_requests_by_path_total{path="local_prefill"} 2.0' in page
    finally:
        await server.cleanup()
        for s, _ in started:
            await s.cleanup()


def test_load_balancing_with_use_tokens_weighs_prompts_not_requests() -> None:
    router = make_router("least_loaded", {"use_tokens": True})
    a, b = Worker("http://a:1"), Worker("http://b:1")
    a.in_flight, a.in_flight_tokens = 1, 40_000  # one long prompt
    b.in_flight, b.in_flight_tokens = 3, 3_000  # three short ones
    assert router.choose([a, b]) is b
    assert make_router("least_loaded", {}).choose([a, b]) is a  # by requests: the opposite
    b.in_flight_tokens = 40_000  # equal tokens: fewer requests wins
    assert router.choose([a, b]) is a


async def test_use_tokens_accounting_returns_to_zero_on_every_path() -> None:
    """Tokens in flight go up by each request's estimate on both legs and back down whatever the
    outcome (answered, refused, worker gone)."""
    from server.worker.app import WorkerSettings, start_worker
    from server.worker.synthetic import SyntheticEngine

    started = [
        await start_worker(SyntheticEngine(64), WorkerSettings(role=role, model_name="synthetic"))
        for role in ("context", "generation")
    ]
    ctx_port, gen_port = (port for _, port in started)
    dead = free_port()
    lb = {"type": "load_balancing", "use_tokens": True}
    config = build_config(
        {
            "port": free_port(),
            "health_check_interval_s": 0.2,
            "context_servers": {"urls": [f"127.0.0.1:{ctx_port}"], "router": lb},
            "generation_servers": {"urls": [f"127.0.0.1:{gen_port}", f"127.0.0.1:{dead}"], "router": lb},
        },
        environ={},
    )
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{config.port}"
    try:
        for _ in range(100):
            if orch.context_pool.ready and orch.generation_pool.ready:
                break
            await asyncio.sleep(0.05)
        # the dead worker looks healthy to the router once: its refused connection is the error path
        dead_worker = next(w for w in orch.generation_pool.workers if w.url.endswith(f":{dead}"))
        dead_worker.healthy = True
        async with aiohttp.ClientSession() as session:
            seen = []
            body = {
                "model": "synthetic",
                "messages": [{"role": "user", "content": "x" * 4000}],
                "max_tokens": 2,
            }

            async def watch() -> None:
                while True:
                    seen.append(sum(w.in_flight_tokens for p in orch.pools for w in p.workers))
                    await asyncio.sleep(0)

            watcher = asyncio.ensure_future(watch())
            for stream in (False, True, False):
                async with session.post(url + "/v1/chat/completions", json=body | {"stream": stream}) as r:
                    assert r.status == 200
                    await r.read()
            async with session.post(url + "/v1/chat/completions", json=body | {"model": "other"}) as r:
                assert r.status == 404  # refused by the worker (no such model): counted, then given back
            watcher.cancel()
        assert max(seen) > 0, "tokens were counted while legs ran"
        assert all(w.in_flight_tokens == 0 and w.in_flight == 0 for p in orch.pools for w in p.workers)
    finally:
        await server.cleanup()
        for s, _ in started:
            await s.cleanup()


# -- trtllm-serve's conversation field and headers --------------------------------------------------


class _Headers:
    def __init__(self, **headers: bytes) -> None:
        self.headers = {k.replace("_", "-").encode(): v for k, v in headers.items()}

    def header(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


def test_trtllm_conversation_params_and_headers_name_the_conversation() -> None:
    from server.orchestrator.routing import conversation_header

    body = b'{"messages":[],"conversation_params":{"conversation_id":"p1"},"conversation_id":"top"}'
    assert request_key(body, True, b"hdr").conversation == b"p1"  # the body's conversation_params wins
    assert request_key(b'{"prompt":"x","conversation_params":{"conversation_id":"p2"}}', False, None).conversation == b"p2"
    assert request_key(b'{"messages":[],"conversation_params":"bad"}', True, b"h").conversation == b"h"
    # headers in trtllm-serve's order, then ours; blank ones skipped
    names = ["x_session_id", "x_correlation_id", "x_session_affinity", "x_multi_turn_session_id", "x_conversation_id"]
    for i, name in enumerate(names):
        later = {n: f"v{j}".encode() for j, n in enumerate(names) if j >= i}
        assert conversation_header(_Headers(**later)) == f"v{i}".encode()
    assert conversation_header(_Headers(x_session_id=b"  ", x_correlation_id=b"c")) == b"c"
    assert conversation_header(_Headers()) is None


@pytest.mark.parametrize(
    ("body", "legs"),
    [
        (b'{"conversation_id":"a","messages":[]}', {"conversation_params": {"conversation_id": "a"}, "messages": []}),
        (b'{"messages":[] , "conversation_id" : 42 }', {"messages": [], "conversation_params": {"conversation_id": "42"}}),
        (b'{"messages":[],"conversation_params":{"conversation_id":"p"},"conversation_id":"a"}',
         {"messages": [], "conversation_params": {"conversation_id": "p"}}),
        (b'{"conversation_id":{"x":1} ,\n "messages":[]}', {"messages": []}),  # no id: dropped
        (b'{"conversation\\u005fid":"a","messages":[]}', {"conversation_params": {"conversation_id": "a"}, "messages": []}),
        (b'{"conversation_id":"a"}', {"conversation_params": {"conversation_id": "a"}}),
    ],
)
def test_a_top_level_conversation_id_never_reaches_a_leg(body: bytes, legs: dict[str, Any]) -> None:
    from server.orchestrator.routing import conversation_to_params

    moved = conversation_to_params(body)
    assert json.loads(moved) == legs
    assert request_key(moved, True, None).conversation == request_key(body, True, None).conversation


def test_bodies_without_a_top_level_conversation_id_are_relayed_as_they_are() -> None:
    from server.orchestrator.routing import conversation_to_params

    for body in (b'{"messages":[]}', b'{"messages":[],"conversation_params":{"conversation_id":"p"}}',
                 b'{"conversation_id":"a","conversation_id":"b"}', b"not json"):  # fmt: skip
        assert conversation_to_params(body) is body


async def test_one_conversation_id_cannot_pin_its_load_on_one_worker_end_to_end() -> None:
    """12 requests of one conversation in flight at once over 3 generation workers (real sockets):
    bounded loads cap its home at ceil(1.25 x 12 / 3) = 5 and the ring's next workers take the rest
    (without the bound all 12 sat on one worker)."""

    class HeldWorker(StubWorker):
        """Holds each leg it gets until ``release`` is set."""

        def __init__(self, role: str) -> None:
            super().__init__(role)
            self.held = 0
            self.release = asyncio.Event()

        async def _chat(self, request: web.Request) -> web.StreamResponse:
            self.held += 1
            await self.release.wait()
            return await super()._chat(request)

    ctx = [await StubWorker("context").start()]
    gen = [await HeldWorker("generation").start() for _ in range(3)]
    server, _orch, url = await orchestrator(
        ctx, gen, generation_servers={"router": {"type": "conversation", "args": {"load_factor": 1.25}}}
    )
    try:
        async with aiohttp.ClientSession() as session:
            body = chat(history(7, 1, 50), conversation_id="one-hot-conversation")
            sent = [asyncio.ensure_future(post(session, url, body)) for _ in range(12)]
            for _ in range(500):
                if sum(w.held for w in gen) == 12:
                    break
                await asyncio.sleep(0.01)
            held = sorted(w.held for w in gen)
            assert sum(held) == 12 and held[-1] <= 5, held
            for w in gen:
                w.release.set()
            assert [status for status, _ in await asyncio.gather(*sent)] == [200] * 12
    finally:
        await server.cleanup()
        for w in ctx + gen:
            await w.stop()
