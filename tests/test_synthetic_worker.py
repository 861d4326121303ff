"""The synthetic worker: the torch worker's protocol with no model, on real sockets.

Checks that it is a faithful stand-in for the benchmarks: a context leg
returns the configured number of real ids (list or base64), the generation
leg built by ``fastcore.relay`` (the orchestrator's own code) continues it
through the real KV hand-off and gives what a single ``both`` worker gives,
and the CLI starts it without torch on the request path.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from helpers import free_port

import fastcore
from fastcore import relay
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SYNTHETIC_EOS, PrefillQueue, SyntheticEngine, synthetic_token

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT_TOKENS = 3000
ROUTES = {
    "chat": (
        "/v1/chat/completions",
        {"model": "synthetic", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hello"}],
         "max_tokens": 12, "temperature": 0},
    ),
    "completions": ("/v1/completions", {"model": "synthetic", "prompt": "once", "max_tokens": 12}),
}  # fmt: skip


class Worker:
    def __init__(self, runner: Any, port: int) -> None:
        self.runner = runner
        self.url = f"http://127.0.0.1:{port}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers() -> AsyncIterator[dict[str, Worker]]:
    started = {}
    for role in ("both", "context", "generation"):
        runner, port = await start_worker(
            SyntheticEngine(PROMPT_TOKENS), WorkerSettings(role=role, model_name="synthetic")
        )
        started[role] = Worker(runner, port)
    yield started
    for w in started.values():
        await w.runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.read()


def client_visible(raw: bytes, stream: bool, route: str) -> Any:
    """Text, finish reason and usage: what a client sees, without ids and timestamps."""
    if not stream:
        doc = json.loads(raw)
        choice = doc["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        return text, choice["finish_reason"], doc["usage"]
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "") if route == "chat" else c["choices"][0]["text"]
        for c in chunks
        if c["choices"]
    )
    finish = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return text, finish, usage


async def metric(http: aiohttp.ClientSession, worker: Worker, pattern: str) -> float:
    async with http.get(worker.url + "/metrics") as resp:
        text = await resp.text()
    match = re.search(pattern + r" (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("b64", [False, True], ids=["list", "b64"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_disaggregated_equals_single_worker(
    workers: dict[str, Worker], http: aiohttp.ClientSession, route: str, stream: bool, b64: bool
) -> None:
    path, base = ROUTES[route]
    client_body = json.dumps(
        {**base, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    ).encode()

    status, single = await post(http, workers["both"].url + path, client_body)
    assert status == 200, single

    ctx_body = relay.build_context_request(client_body, disagg_request_id=42, return_b64=b64)
    status, ctx = await post(http, workers["context"].url + path, ctx_body)
    assert status == 200, ctx
    ctx_doc = json.loads(ctx)
    # The prompt ids are the configured number of real ids, in the form asked for.
    if b64:
        assert ctx_doc["prompt_token_ids"] is None
        ids = fastcore.decode_tokens(ctx_doc["prompt_token_ids_b64"])
    else:
        assert "prompt_token_ids_b64" not in ctx_doc
        ids = np.asarray(ctx_doc["prompt_token_ids"], dtype=np.int32)
    assert ids.shape == (PROMPT_TOKENS,)
    assert ids.min() >= 0 and ids.max() < SYNTHETIC_EOS and len(np.unique(ids)) > PROMPT_TOKENS // 2
    params = ctx_doc["choices"][0]["disaggregated_params"]
    assert params["first_gen_tokens"] == [synthetic_token(PROMPT_TOKENS, 0)]
    assert ctx_doc["choices"][0]["finish_reason"] == "not_finished"

    fetched = await metric(http, workers["generation"], r'\w+handoff\w*\{event="fetched"\}')
    gen_body = relay.build_generation_request(client_body, ctx, tokids_b64=b64, strip_history=True)
    status, gen = await post(http, workers["generation"].url + path, gen_body)
    assert status == 200, gen
    assert client_visible(gen, stream, route) == client_visible(single, stream, route)
    # The KV hand-off ran through the real endpoint.
    assert await metric(http, workers["generation"], r'\w+handoff\w*\{event="fetched"\}') == fetched + 1


async def test_generation_worker_rejects_bad_ids(
    workers: dict[str, Worker], http: aiohttp.ClientSession
) -> None:
    path, base = ROUTES["chat"]
    client_body = json.dumps(base).encode()
    _, ctx = await post(http, workers["context"].url + path,
                        relay.build_context_request(client_body, disagg_request_id=1, return_b64=True))  # fmt: skip
    doc = json.loads(relay.build_generation_request(client_body, ctx, tokids_b64=True, strip_history=False))
    doc["prompt_token_ids_b64"] = fastcore.encode_tokens([1, 2, SYNTHETIC_EOS + 1]).decode()
    status, body = await post(http, workers["generation"].url + path, json.dumps(doc).encode())
    assert status == 400
    assert json.loads(body)["error"]["param"] == "prompt_token_ids_b64"


async def test_latencies_are_configurable() -> None:
    engine = SyntheticEngine(16, prefill_latency_s=0.05, token_latency_s=0.01)
    runner, port = await start_worker(engine, WorkerSettings(role="both", model_name="synthetic"))
    try:
        async with aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            status, body = await post(http, f"http://127.0.0.1:{port}/v1/completions",
                                      json.dumps({"prompt": "x", "max_tokens": 5}).encode())  # fmt: skip
            elapsed = loop.time() - t0
        assert status == 200, body
        # A lower bound only: the timers ran (prefill + 4 further tokens).
        assert elapsed >= 0.05 + 4 * 0.01
        assert json.loads(body)["usage"]["completion_tokens"] == 5
    finally:
        await runner.cleanup()


async def test_cli_serves_synthetic_model(http: aiohttp.ClientSession) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--prompt-tokens", "64",
         "--role", "context", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                async with http.get(f"http://127.0.0.1:{port}/server_info") as resp:
                    info = await resp.json()
                    break
            except aiohttp.ClientConnectionError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("synthetic worker did not start")
        assert info["role"] == "context"
        assert info["model"] == "synthetic"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_kv_fetch_abandoned_midway_is_counted_not_raised(http: aiohttp.ClientSession) -> None:
    """A generation worker that hangs up during a KV download: the context worker counts it and carries on."""
    big = 2_000_000  # 8 MB of KV: more than loopback socket buffers absorb
    runner, port = await start_worker(
        SyntheticEngine(big), WorkerSettings(role="context", model_name="synthetic")
    )
    url = f"http://127.0.0.1:{port}"
    try:
        body = relay.build_context_request(
            json.dumps({"prompt": "x", "max_tokens": 4}).encode(), disagg_request_id=3, return_b64=True
        )
        status, raw = await post(http, url + "/v1/completions", body)
        assert status == 200, raw[:200]
        endpoint = json.loads(raw)["choices"][0]["disaggregated_params"]["ctx_info_endpoint"]
        path = endpoint.split(str(port), 1)[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        assert (await reader.readexactly(12)).startswith(b"HTTP/1.1 200")
        # Hang up with a reset, mid-body.
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        for _ in range(200):
            if await metric(http, Worker(runner, port), r'\w+handoff\w*\{event="abandoned"\}') == 1:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("abandoned KV fetch not counted")
        # The worker still serves.
        status, _ = await post(
            http, url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        )
        assert status == 200
    finally:
        await runner.cleanup()


# -- the text mode and its modelled prefix cache (--prompt-tokens 0) ------------------------------


async def _text_worker(**kw: Any) -> tuple[Any, int, SyntheticEngine]:
    engine = SyntheticEngine(0, **kw)
    server, port = await start_worker(engine, WorkerSettings(role="both", model_name="synthetic"))
    return server, port, engine


async def test_text_mode_ids_follow_the_text_and_shared_prefixes_hit_the_modelled_cache() -> None:
    server, port, engine = await _text_worker(kv_tokens=1 << 16)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    history = [{"role": "user", "content": "x" * 4000}]
    try:
        async with aiohttp.ClientSession() as session:
            usages = []
            for turn in range(3):
                body = {"model": "synthetic", "messages": history, "max_tokens": 4}
                async with session.post(url, json=body) as r:
                    assert r.status == 200
                    answer = await r.json()
                usages.append(answer["usage"]["prompt_tokens"])
                history = [
                    *history,
                    answer["choices"][0]["message"],
                    {"role": "user", "content": f"more {turn} " * 50},
                ]
            async with session.get(f"http://127.0.0.1:{port}/server_info") as r:
                info = await r.json()
        # one id per 4 bytes of the rendered template: prompts grow with the conversation
        assert usages[0] == -(-len("<|user|>\n" + "x" * 4000 + "\n<|assistant|>\n") // 4)
        assert usages[0] < usages[1] < usages[2]
        # turn 1 computed everything, turns 2 and 3 only what follows the previous prompt's full blocks
        assert engine.prefix_hit_tokens >= (usages[0] // 16 + usages[1] // 16 - 4) * 16
        assert engine.prefill_computed_tokens + engine.prefix_hit_tokens == sum(usages)
        assert info["local_prefill"] is True and info["prefix_caching"] is True
    finally:
        await server.cleanup()


async def test_the_modelled_cache_evicts_least_recently_used_and_can_be_off() -> None:
    small = SyntheticEngine(0, kv_tokens=64)  # 4 blocks
    ids = np.arange(80, dtype=np.int32)  # 5 full blocks
    hit, hashes = small._prefix(ids)
    small._remember(hashes)
    assert hit == 0 and small.prefix_cached_tokens == 64 and small.prefix_evicted_blocks == 1
    # the first block was evicted: the chain is broken at once, nothing hits
    assert small._prefix(ids)[0] == 0
    off = SyntheticEngine(0, prefix_caching=False)
    off._remember(off._prefix(ids)[1])
    assert off._prefix(ids)[0] == 0 and off.prefix_cached_tokens == 0


async def test_text_mode_refuses_a_negative_prompt_size() -> None:
    with pytest.raises(ValueError, match="--prompt-tokens"):
        SyntheticEngine(-1)


# -- bytes per token, the shared prefill compute, usage.prompt_tokens_details.cached_tokens ----------

RENDERED = "<|user|>\n{}\n<|assistant|>\n"


@pytest.mark.parametrize("width", [1, 3, 4, 8])
async def test_text_mode_takes_bytes_per_token_and_publishes_it(width: int) -> None:
    server, port, _engine = await _text_worker(kv_tokens=1 << 16, bytes_per_token=width)
    content = "words of a prompt " * 40
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "synthetic", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            async with session.get(f"http://127.0.0.1:{port}/server_info") as r:
                info = await r.json()
        assert usage["prompt_tokens"] == -(-len(RENDERED.format(content)) // width)
        assert info["bytes_per_token"] == width
        # the modelled cache is the KV a cache-aware router sizes its view of this worker by
        assert info["kv_capacity_tokens"] == 1 << 16
    finally:
        await server.cleanup()


async def test_four_bytes_per_token_keeps_the_ids_of_before() -> None:
    text = "an agentic prompt, é and 🙂 included"
    raw = text.encode() + b"\0" * (-len(text.encode()) % 4)
    expected = np.frombuffer(raw, dtype="<u4") % SYNTHETIC_EOS
    assert np.array_equal(SyntheticEngine(0).tokenizer.encode(text), expected)
    three = SyntheticEngine(0, bytes_per_token=3).tokenizer.encode("abcdef")
    assert three.tolist() == [(ord("a") + 256 * ord("b") + 65536 * ord("c")) % SYNTHETIC_EOS,
                              (ord("d") + 256 * ord("e") + 65536 * ord("f")) % SYNTHETIC_EOS]  # fmt: skip


@pytest.mark.parametrize("width", [0, 9, -1])
async def test_bytes_per_token_outside_1_to_8_is_refused(width: int) -> None:
    with pytest.raises(ValueError, match="--bytes-per-token must be an integer from 1 to 8"):
        SyntheticEngine(0, bytes_per_token=width)


async def test_fixed_prompts_publish_no_bytes_per_token() -> None:
    assert SyntheticEngine(64).bytes_per_token is None
    assert SyntheticEngine(0, bytes_per_token=3).bytes_per_token == 3


async def _chat(session: aiohttp.ClientSession, url: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        **extra,
    }
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not extra.get("stream"):
            return await r.json()
        raw = await r.read()
    return client_visible(raw, True, "chat")[2][0]  # the streamed usage chunk's usage


async def test_prefills_queue_for_the_shared_compute_first_come_first_served() -> None:
    """A long uncached prompt holds the compute: a short one sent after it answers after it, and a
    copy of the long one queued behind it finds its blocks cached by the time its turn comes."""
    server, port, engine = await _text_worker(kv_tokens=1 << 16, prefill_tokens_per_s=20_000)
    url = f"http://127.0.0.1:{port}"
    long_text, short_text = "a long prompt " * 1000, "short"  # ~3,500 ids: 0.18 s of compute
    finished: list[str] = []
    try:
        async with aiohttp.ClientSession() as session:

            async def send(name: str, content: str) -> dict[str, Any]:
                answer = await _chat(session, url, content)
                finished.append(name)
                return answer

            first = asyncio.create_task(send("long", long_text))
            while engine.running == 0:  # the long one is in the engine (and so first in the queue)
                await asyncio.sleep(0.001)
            copy = asyncio.create_task(send("copy", long_text))
            while engine.running < 2:
                await asyncio.sleep(0.001)
            short = asyncio.create_task(send("short", short_text))
            answers = await asyncio.gather(first, copy, short)
        # Without a shared compute the short prompt's own timer ends first.
        assert finished == ["long", "copy", "short"]
        long_usage, copy_usage, _ = (a["usage"] for a in answers)
        assert long_usage["prompt_tokens_details"]["cached_tokens"] == 0
        cached = copy_usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == (copy_usage["prompt_tokens"] - 1) // 16 * 16 > 0
        assert engine.prefill_computed_tokens + engine.prefix_hit_tokens == sum(
            a["usage"]["prompt_tokens"] for a in answers
        )
        # busy for what was computed, at the configured rate
        assert engine.prefill_queue is not None
        assert engine.prefill_queue.busy_s == pytest.approx(engine.prefill_computed_tokens / 20_000)
    finally:
        await server.cleanup()


async def test_a_cancelled_prefill_leaves_the_queue() -> None:
    """Waiting: it leaves without taking a turn. Running: the rest of its turn goes to the next."""
    queue = PrefillQueue(1000.0)
    order: list[str] = []

    async def job(name: str, tokens: int) -> None:
        await queue.run(lambda: tokens)
        order.append(name)

    head = asyncio.create_task(job("head", 200))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(job("waiting", 10_000))
    last = asyncio.create_task(job("last", 10))
    await asyncio.sleep(0)
    assert queue.waiting == 2
    waiting.cancel()
    await asyncio.gather(head, last)
    assert order == ["head", "last"] and queue.waiting == 0
    assert queue.busy_s == pytest.approx(0.21)
    running = asyncio.create_task(job("running", 10_000))
    await asyncio.sleep(0)
    after = asyncio.create_task(job("after", 10))
    await asyncio.sleep(0.01)
    running.cancel()
    await after  # it did not wait out the cancelled one's 10 s
    assert order == ["head", "last", "after"]
    assert 0.21 + 0.01 <= queue.busy_s < 1.0


async def test_prefill_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--prefill-tokens-per-s must be > 0"):
        SyntheticEngine(0, prefill_tokens_per_s=-5)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_usage_says_how_many_prompt_tokens_the_cache_served(stream: bool) -> None:
    server, port, engine = await _text_worker(kv_tokens=1 << 16)
    url = f"http://127.0.0.1:{port}"
    extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    try:
        async with aiohttp.ClientSession() as session:
            first = await _chat(session, url, "x" * 2000, **extra)
            second = await _chat(session, url, "x" * 2000, **extra)
        first = first if stream else first["usage"]
        second = second if stream else second["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["prompt_tokens_details"]["cached_tokens"] == engine.prefix_hit_tokens > 0
    finally:
        await server.cleanup()


async def test_generation_leg_reports_the_context_workers_cached_tokens(http: aiohttp.ClientSession) -> None:
    """The context worker prefilled the client's prompt: the generation leg's usage carries that
    worker's cached_tokens (ctx_usage, as trtllm-serve's generation workers do), not its own."""
    ctx_server, ctx_port, ctx_engine = await _text_worker(kv_tokens=1 << 16)
    engine = SyntheticEngine(0, kv_tokens=1 << 16)
    gen_server, gen_port = await start_worker(
        engine, WorkerSettings(role="generation", model_name="synthetic")
    )
    try:
        client_body = json.dumps({"model": "synthetic", "messages": [{"role": "user", "content": "y" * 3000}],
                                  "max_tokens": 3}).encode()  # fmt: skip
        path = "/v1/chat/completions"
        usages = []
        for n in range(2):
            ctx_body = relay.build_context_request(client_body, disagg_request_id=70 + n, return_b64=True)
            status, ctx = await post(http, f"http://127.0.0.1:{ctx_port}{path}", ctx_body)
            assert status == 200, ctx
            gen_body = relay.build_generation_request(client_body, ctx, tokids_b64=True, strip_history=True)
            status, gen = await post(http, f"http://127.0.0.1:{gen_port}{path}", gen_body)
            assert status == 200, gen
            ctx_cached = json.loads(ctx)["usage"]["prompt_tokens_details"]["cached_tokens"]
            usages.append((ctx_cached, json.loads(gen)["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert usages[0] == (0, 0)
        assert usages[1][0] == usages[1][1] == ctx_engine.prefix_hit_tokens > 0
        # the generation worker holds the imported prompt's blocks now
        assert engine.prefix_cached_tokens > 0
        # A leg whose KV is not its prompt's (refused: the prefill recomputed here) reports this
        # worker's own count, not the context worker's.
        doc = json.loads(
            relay.build_generation_request(client_body, ctx, tokids_b64=True, strip_history=True)
        )
        other = engine.tokenizer.encode("<|user|>\n" + "z" * 3000 + "\n<|assistant|>\n")
        doc["prompt_token_ids_b64"] = fastcore.encode_tokens(other).decode()
        status, gen = await post(http, f"http://127.0.0.1:{gen_port}{path}", json.dumps(doc).encode())
        assert status == 200, gen
        assert json.loads(gen)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        await ctx_server.cleanup()
        await gen_server.cleanup()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--bytes-per-token", "9", "--bytes-per-token must be an integer from 1 to 8, got 9"),
        ("--prefill-tokens-per-s", "-1", "--prefill-tokens-per-s must be > 0, got -1.0"),
    ],
)
async def test_the_cli_refuses_bad_synthetic_flags_naming_them(flag: str, value: str, message: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--prompt-tokens", "0",
        "--port", str(free_port()), flag, value,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 2
    assert message in err.decode()
