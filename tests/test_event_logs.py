"""The worker's two cache event logs are bounded in bytes and answered in pages (issue 36, item 7):
trtllm-serve's ``POST /kv_cache_events`` (server/worker/kv_events.py KvEventLog) and ours, ``GET
/cache_events`` (ChunkEventLog), whose chunk size is the worker's, whatever a caller asks.

Real synthetic text-mode workers on 127.0.0.1 (port 0) where HTTP is involved; the logs' own byte
accounting (deterministic) for the bounds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import tracemalloc
from typing import Any

import aiohttp
import numpy as np

from server.orchestrator.cache_view import CacheView, _Follower
from server.orchestrator.pools import Worker
from server.orchestrator.routing import KvCacheAwareRouter, request_key
from server.worker.app import WorkerSettings, start_worker
from server.worker.kv_events import (
    EVENT_BYTES,
    MAX_EVENT_BLOCKS,
    ChunkEventLog,
    KvEventLog,
    block_hash,
    events_of,
)
from server.worker.synthetic import PrefixCacheModel, SyntheticEngine

#: a 40k-token prompt's full blocks of 16
LONG_BLOCKS = 2500


def digests_of(prompt: int, count: int = LONG_BLOCKS) -> list[bytes]:
    """A unique prompt's chained block digests (deterministic, no hashing needed)."""
    return [(prompt << 32 | i).to_bytes(16, "little") for i in range(count)]


def body_of(text: str) -> bytes:
    return json.dumps({"model": "synthetic", "messages": [{"role": "user", "content": text}],
                       "max_tokens": 1}).encode()  # fmt: skip


def whole_log(log: KvEventLog) -> list[dict[str, Any]]:
    """Every page until the log is empty, concatenated; each page's size checked against the bound."""
    out: list[dict[str, Any]] = []
    while True:
        page = log.page()
        events = json.loads(page)
        if not events:
            return out
        assert len(page) <= log.answer_bytes or len(events) == 1, (len(page), len(events))
        out.extend(events)


class BlockTable:
    """What trtllm-serve's kv_cache_aware router keeps of a worker's events: a set of hashes."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def update(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            data = event["data"]
            if data["type"] == "stored":
                self.blocks.update(b["block_hash"] for b in data["blocks"])
            elif data["type"] == "removed":
                self.blocks.difference_update(data["block_hashes"])


# -- trtllm-serve's log -------------------------------------------------------------------------------


def test_the_trtllm_log_stays_under_its_byte_bound_after_many_unique_long_prompts() -> None:
    model = PrefixCacheModel(1 << 20)  # 65,536 blocks: long prompts store and evict
    log = events_of(model, model.block_size, model.num_blocks)
    log.max_bytes = 2 << 20
    tracemalloc.start()
    try:
        for prompt in range(200):
            model.remember(digests_of(prompt))
            assert log.bytes <= log.max_bytes
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*kv_events.py")])
    finally:
        tracemalloc.stop()
    held = sum(stat.size for stat in snapshot.statistics("filename"))
    assert log.dropped > 0  # the bound, not the count, dropped the oldest
    # the accounting is the log's real size (a compact array per event, no dict per block)
    assert held < 2 * log.max_bytes + (1 << 20), held
    events = whole_log(log)
    assert [e["event_id"] for e in events] == list(range(events[0]["event_id"], events[-1]["event_id"] + 1))
    assert log.bytes == 0 and log.page() == b"[]"


def test_trtllm_pages_concatenate_to_the_whole_log_in_its_shape() -> None:
    log = KvEventLog(64, 16)
    log.answer_bytes = 64 << 10
    parent, long = b"\x07" * 16, digests_of(1, 3 * MAX_EVENT_BLOCKS + 5)
    log.stored(parent, long)  # longer than one event holds: split, chained
    log.removed(long[:10])
    log.stored(b"", digests_of(2, 3))
    pages = []
    while (page := log.page()) != b"[]":
        pages.append(page)
        assert len(page) <= log.answer_bytes or len(json.loads(page)) == 1
    assert len(pages) > 3
    events = [e for page in pages for e in json.loads(page)]
    assert [e["event_id"] for e in events] == list(range(len(events)))
    assert events[0] == {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64]},
                         "window_size": 16}  # fmt: skip
    stored = [e["data"] for e in events if e["data"]["type"] == "stored"]
    assert all(len(s["blocks"]) <= MAX_EVENT_BLOCKS for s in stored)
    chain = [b["block_hash"] for s in stored[:-1] for b in s["blocks"]]
    assert chain == [block_hash(d) for d in long]
    assert stored[0]["parent_hash"] == block_hash(parent)
    for before, after in itertools.pairwise(stored[:-1]):  # a split event's pieces chain
        assert after["parent_hash"] == before["blocks"][-1]["block_hash"]
    assert stored[-1]["parent_hash"] is None
    assert stored[-1]["blocks"][0] == {"type": "stored_block", "block_hash": block_hash(digests_of(2, 1)[0]),
                                       "tokens": [], "cache_level": 0, "priority": 0}  # fmt: skip
    (removed,) = [e["data"] for e in events if e["data"]["type"] == "removed"]
    assert removed == {"type": "removed", "block_hashes": [block_hash(d) for d in long[:10]]}
    # one JSON text, as json.dumps wrote the old answer
    assert pages[0].startswith(b'[{"event_id":0,"data":{"type":"created","num_blocks_per_cache_level":[64]},')


async def _text_worker(**settings: Any) -> tuple[Any, str, SyntheticEngine]:
    engine = SyntheticEngine(0, bytes_per_token=4, kv_tokens=1 << 14)
    server, port = await start_worker(engine, WorkerSettings(model_name="synthetic", **settings))
    return server, f"http://127.0.0.1:{port}", engine


async def test_a_kv_cache_events_poll_answers_a_bounded_page_and_the_pages_make_the_cache() -> None:
    server, url, engine = await _text_worker()
    cache = engine.cache
    log = events_of(cache, cache.block_size, cache.num_blocks)
    log.answer_bytes = 32 << 10
    table = BlockTable()
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(6):  # 6 x 4,000 tokens into a 16k-token cache: stored, then evicted
                text = (f"prompt {i} " + "the agent reads the file ") * 640
                async with session.post(url + "/v1/chat/completions", data=body_of(text)) as r:
                    assert r.status == 200
            pages = 0
            while True:
                async with session.post(url + "/kv_cache_events") as r:
                    assert r.status == 200
                    raw = await r.read()
                events = json.loads(raw)
                if not events:
                    break
                pages += 1
                assert len(raw) <= log.answer_bytes or len(events) == 1
                assert int(r.headers["X-Fastcore-Events-Waiting"]) == log.waiting
                table.update(events)
        assert pages > 3
        assert table.blocks == {block_hash(d) for d in cache._blocks}
    finally:
        await server.cleanup()


# -- our log: GET /cache_events ---------------------------------------------------------------------------


def _store_prompt(log: ChunkEventLog, n: int, keys: int = 312, blocks: int = LONG_BLOCKS) -> list[bytes]:
    """One unique long prompt's keys (``keys`` chunks over ``blocks`` full blocks) stored."""
    log.pending[str(n)] = ([n << 20 | i for i in range(keys)], keys * log.chunk_bytes)
    digests = digests_of(n, blocks)
    log.stored(str(n), digests, blocks * log.block_size)
    return digests


def test_our_log_stays_under_its_byte_bound_and_a_follower_behind_it_resyncs() -> None:
    log = ChunkEventLog("i1", 512, block_size=16)
    log.max_bytes = 256 << 10
    previous: list[bytes] = []
    for n in range(300):
        digests = _store_prompt(log, n)
        log.evicted(previous)  # the cache holds one long prompt at a time
        previous = digests
        assert log.bytes <= log.max_bytes
    assert log.answer(1, "i1")["resync"] is True  # the oldest are gone: a gap, a resync
    assert sorted(log.answer(1, "i1")["held"]) == sorted(300 - 1 << 20 | i for i in range(312))


def test_both_logs_keep_their_events_by_one_rule() -> None:
    """One bound for both logs (kv_events._PackedEvents): at most max_events, the oldest dropped and
    counted, their bytes accounted the same way (the packed hashes or keys, 8 bytes each, plus
    EVENT_BYTES an event)."""
    ours, theirs = ChunkEventLog("i1", 512, block_size=16, max_events=3), KvEventLog(4, 16, max_events=3)
    for n in range(5):
        ours.pending[str(n)] = ([n], 512)
        ours.stored(str(n), digests_of(n, 1), 16)
        theirs.removed(digests_of(n, 1))
    assert [event["seq"] for event in ours.answer(2, "i1")["events"]] == [3, 4, 5]
    assert ours.dropped == 2 and theirs.dropped == 3  # theirs began with its "created" event
    assert ours.bytes == theirs.bytes == 3 * (EVENT_BYTES + 8)


def test_our_answers_are_paged_and_concatenate_to_every_event() -> None:
    log = ChunkEventLog("i1", 512, block_size=16)
    log.answer_bytes = 16 << 10
    for n in range(40):
        _store_prompt(log, n, keys=300, blocks=300)
    log.evicted(digests_of(3, 300))
    after, events = 0, []
    while after < log.seq:
        answer = log.answer(after, "i1")
        assert "resync" not in answer and answer["seq"] == log.seq
        assert len(json.dumps(answer, separators=(",", ":"))) <= log.answer_bytes
        assert answer.get("more", False) is (answer["events"][-1]["seq"] < log.seq)
        events.extend(answer["events"])
        after = answer["events"][-1]["seq"]
    assert [e["seq"] for e in events] == list(range(1, log.seq + 1))
    stored = [k for e in events for k in e.get("stored", [])]
    assert stored == [n << 20 | i for n in range(40) for i in range(300)]
    assert [k for e in events for k in e.get("removed", [])] == [3 << 20 | i for i in range(300)]


def test_our_log_holds_a_bounded_number_of_keys_per_block_and_in_all() -> None:
    log = ChunkEventLog("i1", 32, block_size=16)
    log.max_held_keys = 1000
    digests = digests_of(1, 1)
    for n in range(10):  # the same block under 10 paddings: 100 keys each would map to it
        log.pending[str(n)] = ([n << 20 | i for i in range(100)], 100 * 32)
        log.stored(str(n), digests, 16)
    assert len(log.held) <= 64  # a block holds at most 64 keys
    for n in range(10, 100):
        _store_prompt(log, n, keys=100, blocks=100)
    assert len(log.held) == log.max_held_keys


async def _follower(url: str, chunk_bytes: int = 512) -> tuple[_Follower, KvCacheAwareRouter, Worker]:
    router = KvCacheAwareRouter({"chunk_bytes": chunk_bytes})
    worker = Worker(url)
    worker.healthy = True
    return _Follower(CacheView([], None, wait_s=0.0), router, worker), router, worker


async def test_a_hostile_chunk_size_changes_nothing_a_follower_sees() -> None:
    server, url, engine = await _text_worker()  # the worker's chunk size: 512, its default
    follower, router, worker = await _follower(url)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/cache_events?chunk_bytes=32") as r:  # first, and hostile
                assert r.status == 400
                error = (await r.json())["error"]
                assert error["param"] == "chunk_bytes"
                assert "512" in error["message"] and "got 32" in error["message"]
            assert engine.cache.chunks is None or engine.cache.chunks.chunk_bytes == 512
            assert await follower.poll_once() == follower.view.batch_s  # a resync: following
            assert worker in router.followed and follower.instance is not None
            async with session.get(url + "/cache_events?chunk_bytes=64&after=0") as r:
                assert r.status == 400  # again, while followed: still refused, nothing changes
            async with session.get(url + "/cache_events") as r:  # no chunk_bytes: the worker's
                assert r.status == 200 and (await r.json())["chunk_bytes"] == 512
            body = body_of("the agent reads the file and writes the patch " * 200)
            async with session.post(url + "/v1/chat/completions", data=body) as r:
                assert r.status == 200
            for _ in range(3):  # events, not a 409/400 loop
                assert await follower.poll_once() in (0.0, follower.view.batch_s)
            key = request_key(body, True, None)
            assert router.expected_hit(worker, key) >= len(key.hashes(512)) - 2
            assert follower.view.events >= 1
    finally:
        follower.close()
        await server.cleanup()


async def test_a_follower_reads_every_page_at_once() -> None:
    server, url, engine = await _text_worker()
    follower, router, _ = await _follower(url)
    try:
        assert await follower.poll_once() == follower.view.batch_s  # the resync starts the log
        log = engine.cache.chunks
        log.answer_bytes = 256  # one event a page
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                body = body_of(f"prompt {i} " + "the agent reads the file and writes the patch " * 200)
                async with session.post(url + "/v1/chat/completions", data=body) as r:
                    assert r.status == 200
        delays = []
        while follower.seq < log.seq:
            delays.append(await follower.poll_once())
        assert len(delays) > 1 and delays[:-1] == [0.0] * (len(delays) - 1)  # more waiting: at once
        assert router._holders.keys() >= log.held.keys()
    finally:
        follower.close()
        await server.cleanup()


async def test_a_follower_polls_at_once_only_after_progress() -> None:
    """A worker whose answer applies nothing but says more is newer is polled at the batch delay,
    not at once in a loop."""
    from aiohttp import web

    async def events(request: web.Request) -> web.Response:
        return web.json_response({"instance": "i", "chunk_bytes": 512, "seq": 9, "events": [], "more": True})

    app = web.Application()
    app.router.add_get("/cache_events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    follower, router, worker = await _follower(f"http://127.0.0.1:{port}")
    try:
        router.resync(worker, [])
        follower.instance, follower.seq = "i", 3
        assert await follower.poll_once() == follower.view.batch_s
        assert follower.seq == 3
    finally:
        follower.close()
        await runner.cleanup()


async def test_the_workers_chunk_size_is_a_setting_checked_once() -> None:
    import pytest

    with pytest.raises(ValueError, match="cache_events_chunk_bytes"):
        WorkerSettings(cache_events_chunk_bytes=48)
    server, url, engine = await _text_worker(cache_events_chunk_bytes=64)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/cache_events?chunk_bytes=512") as r:
                assert r.status == 400 and "64" in (await r.json())["error"]["message"]
            async with session.get(url + "/cache_events?chunk_bytes=64") as r:
                assert r.status == 200 and (await r.json())["chunk_bytes"] == 64
        assert engine.cache.chunks.chunk_bytes == 64
    finally:
        await server.cleanup()


def test_a_resync_is_encoded_in_pieces_as_one_json_text() -> None:
    from server.worker.kv_events import encode_answer

    log = ChunkEventLog("i1", 512, block_size=16)
    for n in range(30):
        _store_prompt(log, n, keys=2000, blocks=2000)
    answer = log.answer(0, None)

    async def encode() -> bytes:
        return await encode_answer(answer)

    raw = asyncio.run(encode())
    assert json.loads(raw) == answer
    assert np.array_equal(np.sort(json.loads(raw)["held"]), np.sort(list(log.held)))
