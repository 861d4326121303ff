"""The worker under attack on 127.0.0.1 (issue 10): abandoned and hoarded KV, HTTP framing, signatures, KV sources.

Real workers (``start_worker``) on real sockets: the tiny torch model where KV
accounting matters, the synthetic engine where only the HTTP layer does.
Hostile clients are raw sockets, so they can send what no HTTP library would
and hang up whenever they like.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import pytest_asyncio
import torch
from helpers import Response, assert_openai_error, exchange, get, instance_of, post, read_response, request
from tiny_workers import LiveWorker, one_torch_thread, synthetic_worker, tiny_worker  # noqa: F401 (an autouse fixture)

from server.auth import SIGNATURE_HEADER, sign_body
from server.worker.app import WorkerSettings
from server.worker.kv_handoff import KVSources, kv_signature

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = b"hardening-secret"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def synthetic() -> AsyncIterator[LiveWorker]:
    worker = await synthetic_worker(
        "context",
        shared_secret=SECRET,
        max_body_bytes=4096,
        header_timeout_s=0.5,
        max_connections=64,
    )
    yield worker
    await worker.server.cleanup()


# ---------------------------------------------------------------- raw HTTP


async def metric(port: int, name: str) -> float:
    text = (await get(port, "/metrics")).body.decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def wait_for(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def context_body(prompt: str, disagg_id: int = 1, **extra: Any) -> dict[str, Any]:
    """A context leg. Prompts that must each hold their own KV (no shared prefix blocks for the
    prefix cache to reuse) start with their index."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": disagg_id},
        **extra,
    }


def handoff(event: str) -> str:
    return f'fastcore_worker_kv_handoff_total{{event="{event}"}}'


# ---------------------------------------------------------------- abandoned and hoarded KV


async def abandon(port: int, body: bytes, delay: float, reset: bool) -> None:
    """Send a context leg, hang up ``delay`` s later without reading a byte."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request("POST", "/v1/completions", body, port=port))
    await writer.drain()
    await asyncio.sleep(delay)
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def test_an_abandon_flood_leaves_no_kv_behind_and_honest_requests_are_served() -> None:
    """Rounds of context legs whose clients hang up mid-leg: their KV is freed at once, not after kv_ttl."""
    ctx = await tiny_worker("context", kv_tokens=4096, kv_ttl_s=120.0)
    model = ctx.engine.model
    real_step = model.forward_step

    def slow_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(0.03)  # every leg outlives its client's 0-20 ms: the hang-up is always mid-leg
        return real_step(*args, **kwargs)

    model.forward_step = slow_step  # type: ignore[method-assign]
    try:
        bodies = [json.dumps(context_body(f"{i:03d}" + "y" * (397 + i), i)).encode() for i in range(40)]
        for rnd in range(3):
            await asyncio.gather(
                *(
                    abandon(ctx.port, b, delay=0.005 * (i % 5), reset=bool((i + rnd) % 2))
                    for i, b in enumerate(bodies)
                )
            )
        # Every handler has seen its client go and the engine has let go of every block:
        # the TTL (120 s) cannot be what frees them.
        await wait_for(
            lambda: (
                ctx.engine.kv_used_tokens == 0 and ctx.engine.queue_depth == 0 and ctx.engine.running == 0
            ),
            "the abandoned legs' KV to be freed",
        )
        assert ctx.engine.parked_count == 0
        assert await metric(ctx.port, handoff("cancelled")) > 0
        assert await metric(ctx.port, handoff("expired")) == 0
        kv_used_after_flood = await metric(ctx.port, "fastcore_worker_kv_used_tokens")
        assert kv_used_after_flood == 0
        model.forward_step = real_step  # type: ignore[method-assign]
        rejected = await metric(ctx.port, 'fastcore_worker_rejected_total{reason="kv_full"}')
        # Honest requests: a 1,500-token context leg (most of the cache) and a plain one, no 503.
        honest = await post(ctx.port, "/v1/completions", context_body("z" * 1500, 99))
        assert honest.status == 200, honest.body[:300]
        endpoint = honest.json()["choices"][0]["disaggregated_params"]["ctx_info_endpoint"]
        fetched = await get(ctx.port, endpoint.split(str(ctx.port), 1)[1])
        assert fetched.status == 200 and fetched.body[:4] == b"FCKV"
        plain = await post(ctx.port, "/v1/completions", {"prompt": "z" * 1500, "max_tokens": 16})
        assert plain.status == 200, plain.body[:300]
        assert await metric(ctx.port, 'fastcore_worker_rejected_total{reason="kv_full"}') == rejected
        assert ctx.engine.kv_used_tokens == 0
    finally:
        model.forward_step = real_step  # type: ignore[method-assign]
        await ctx.server.cleanup()


async def test_honest_requests_during_an_abandon_flood_wait_for_room_instead_of_503() -> None:
    """The flood and honest traffic at once: each round asks for 4x the cache; honest legs queue, none fails."""
    ctx = await tiny_worker("context", kv_tokens=4096, kv_ttl_s=120.0)
    model = ctx.engine.model
    real_step = model.forward_step

    def slow_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(0.01)
        return real_step(*args, **kwargs)

    model.forward_step = slow_step  # type: ignore[method-assign]
    try:
        bodies = [json.dumps(context_body(f"{i:03d}" + "y" * (397 + i), i)).encode() for i in range(40)]

        async def flood() -> None:
            for rnd in range(4):
                await asyncio.gather(
                    *(
                        abandon(ctx.port, b, delay=0.005 * (i % 5), reset=bool((i + rnd) % 2))
                        for i, b in enumerate(bodies)
                    )
                )

        async def honest(i: int) -> int:
            await asyncio.sleep(0.02 * i)
            resp = await post(ctx.port, "/v1/completions", context_body(f"{i:03d}" + "z" * 1497, 1000 + i))
            if resp.status == 200:  # fetch it, as its generation worker would: the KV goes back
                endpoint = resp.json()["choices"][0]["disaggregated_params"]["ctx_info_endpoint"]
                await get(ctx.port, endpoint.split(str(ctx.port), 1)[1])
            return resp.status

        _, statuses = await asyncio.gather(flood(), asyncio.gather(*(honest(i) for i in range(6))))
        assert list(statuses) == [200] * 6
        assert await metric(ctx.port, 'fastcore_worker_rejected_total{reason="kv_full"}') == 0
        assert await metric(ctx.port, "fastcore_worker_admission_waits_total") > 0
        await wait_for(lambda: ctx.engine.kv_used_tokens == 0, "the flood's KV to be freed")
    finally:
        model.forward_step = real_step  # type: ignore[method-assign]
        await ctx.server.cleanup()


async def test_a_client_gone_after_its_leg_parked_frees_the_kv() -> None:
    """The other order: the engine parks first, then the handler learns its client left.

    The loop is held up while the engine thread finishes the prefill and the
    client resets the connection, so the park lands before the cancel.
    """
    ctx = await tiny_worker("context", kv_ttl_s=120.0)
    loop = asyncio.get_running_loop()
    model = ctx.engine.model
    real_step = model.forward_step
    client = socket.create_connection(("127.0.0.1", ctx.port))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    loop_held = threading.Event()

    def hold_loop() -> None:
        loop_held.set()
        time.sleep(0.3)  # the engine parks and the client resets meanwhile

    def step_then_hang_up(*args: Any, **kwargs: Any) -> torch.Tensor:
        model.forward_step = real_step  # type: ignore[method-assign]
        loop.call_soon_threadsafe(hold_loop)
        loop_held.wait(10)
        client.close()
        return real_step(*args, **kwargs)

    model.forward_step = step_then_hang_up  # type: ignore[method-assign]
    try:
        client.sendall(
            request("POST", "/v1/completions", json.dumps(context_body("late")).encode(), port=ctx.port)
        )
        await wait_for(
            lambda: loop_held.is_set() and ctx.engine.kv_used_tokens == 0, "the parked KV to be freed"
        )
        assert ctx.engine.parked_count == 0
        assert await metric(ctx.port, handoff("cancelled")) == 1
        assert await metric(ctx.port, handoff("parked")) == 1  # it did park: then it was freed
    finally:
        model.forward_step = real_step  # type: ignore[method-assign]
        client.close()
        await ctx.server.cleanup()


async def test_a_kv_fetch_abandoned_while_the_executor_is_busy_still_frees_the_kv() -> None:
    """A fetch whose client leaves before its read has started (every executor thread busy).

    The handler takes the parked entry, then awaits the read on the executor;
    cancelling that await used to cancel the job before it ran, and nothing
    freed the blocks again (seen after ``bench.load --abuse`` as one context
    leg's KV held, not parked, until restart).
    """
    ctx = await tiny_worker("context", kv_ttl_s=120.0)
    loop = asyncio.get_running_loop()
    previous = getattr(loop, "_default_executor", None)  # restored below; asyncio has no getter
    busy = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(busy)
    gate = threading.Event()
    client = None
    try:
        resp = await post(ctx.port, "/v1/completions", context_body("fetched late"))
        assert resp.status == 200, resp.body
        ctx_id = json.loads(resp.body)["choices"][0]["disaggregated_params"]["ctx_request_id"]
        assert ctx.engine.parked_count == 1
        blocker = loop.run_in_executor(None, gate.wait, 30)
        client = socket.create_connection(("127.0.0.1", ctx.port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sendall(request("GET", f"/kv/{ctx_id}", b"", port=ctx.port))
        await wait_for(lambda: ctx.engine.parked_count == 0, "the fetch to take the parked entry")
        client.close()
        for _ in range(500):  # the handler, cancelled, counts the fetch abandoned
            if await metric(ctx.port, handoff("abandoned")) == 1:
                break
            await asyncio.sleep(0.02)
        assert await metric(ctx.port, handoff("abandoned")) == 1
        assert ctx.engine.kv_used_tokens > 0  # the read has not run yet: the blocks are still out
        gate.set()
        await blocker
        await wait_for(lambda: ctx.engine.kv_used_tokens == 0, "the fetched KV to be freed")
    finally:
        gate.set()
        if client is not None:
            client.close()
        loop._default_executor = previous  # type: ignore[attr-defined]
        busy.shutdown(wait=False)
        await ctx.server.cleanup()


async def test_parked_kv_is_bounded_the_oldest_going_first() -> None:
    ctx = await tiny_worker("context", kv_tokens=2048, max_parked_fraction=0.25)  # 512 tokens parked at most
    try:
        ids = []
        for i in range(3):  # 13 blocks of 16 each: the third goes over 512
            resp = await post(ctx.port, "/v1/completions", context_body(f"{i:03d}" + "p" * 197, i))
            assert resp.status == 200
            ids.append(resp.json()["choices"][0]["disaggregated_params"]["ctx_request_id"])
        assert ctx.engine.parked_count == 2 and ctx.engine.parked_tokens <= 512
        assert await metric(ctx.port, handoff("evicted")) == 1
        assert await metric(ctx.port, "fastcore_worker_kv_parked_tokens") == ctx.engine.parked_tokens
        assert_openai_error(await get(ctx.port, f"/kv/{ids[0]}"), 404)
        for ctx_id in ids[1:]:
            assert (await get(ctx.port, f"/kv/{ctx_id}")).status == 200
        assert ctx.engine.kv_used_tokens == 0
    finally:
        await ctx.server.cleanup()


async def test_a_request_that_does_not_fit_evicts_parked_kv_before_a_503() -> None:
    ctx = await tiny_worker("context", kv_tokens=1024, max_parked_fraction=1.0, admission_wait_s=0)
    try:
        ids = []
        for i in range(4):  # 4 x 256 tokens: the whole cache parked
            resp = await post(ctx.port, "/v1/completions", context_body(f"{i:03d}" + "q" * 236, i))
            assert resp.status == 200
            ids.append(resp.json()["choices"][0]["disaggregated_params"]["ctx_request_id"])
        assert ctx.engine.kv_used_tokens == ctx.engine.kv_capacity_tokens == 1024
        plain = await post(
            ctx.port, "/v1/completions", {"prompt": "r" * 100, "max_tokens": 100, "temperature": 0}
        )
        assert plain.status == 200, plain.body[:300]
        assert await metric(ctx.port, handoff("evicted")) == 1  # 208 tokens needed: one entry of 256 went
        assert await metric(ctx.port, 'fastcore_worker_rejected_total{reason="kv_full"}') == 0
        assert (await get(ctx.port, f"/kv/{ids[0]}")).status == 404
        assert [(await get(ctx.port, f"/kv/{i}")).status for i in ids[1:]] == [200, 200, 200]
        # Nothing parked left to give way: a request that does not fit now is a 503.
        hold = await asyncio.open_connection("127.0.0.1", ctx.port)
        hold[1].write(request("POST", "/v1/completions", json.dumps(
            {"prompt": "s", "max_tokens": 1000, "stream": True, "ignore_eos": True}).encode()))  # fmt: skip
        await hold[1].drain()
        await wait_for(lambda: ctx.engine.running == 1, "the holder to decode")
        full = await post(ctx.port, "/v1/completions", {"prompt": "r" * 100, "max_tokens": 100})
        assert assert_openai_error(full, 503)["code"] == "worker_full" and full.headers["retry-after"] == "1"
        hold[1].close()
        await wait_for(lambda: ctx.engine.kv_used_tokens == 0, "the holder's slot to be freed")
    finally:
        await ctx.server.cleanup()


async def test_a_fresh_parked_entry_is_spared_while_waiting_and_evicted_at_the_deadline() -> None:
    # A request that does not fit waits rather than evict KV parked just now (its
    # generation leg is likely fetching it); when the wait runs out, it goes before any 503.
    ctx = await tiny_worker("context", kv_tokens=1024, max_parked_fraction=1.0, admission_wait_s=0.4)
    try:
        for i in range(4):  # 4 x 256 tokens: the whole cache parked, all of it fresh
            assert (
                await post(ctx.port, "/v1/completions", context_body(f"{i:03d}" + "q" * 236, i))
            ).status == 200
        started = time.monotonic()
        plain = await post(
            ctx.port, "/v1/completions", {"prompt": "r" * 100, "max_tokens": 100, "temperature": 0}
        )
        assert plain.status == 200, plain.body[:300]
        assert time.monotonic() - started >= 0.4  # it waited out its wait before evicting
        assert await metric(ctx.port, handoff("evicted")) == 1
        assert await metric(ctx.port, "fastcore_worker_admission_waits_total") == 1
        assert await metric(ctx.port, 'fastcore_worker_rejected_total{reason="kv_full"}') == 0
    finally:
        await ctx.server.cleanup()


async def test_a_replayed_signed_context_leg_is_refused() -> None:
    ctx = await tiny_worker("context", shared_secret=SECRET)
    try:
        body = json.dumps(context_body("replay me")).encode()
        signature = sign_body(SECRET, body, destination=await instance_of(ctx.port))
        first = await post(ctx.port, "/v1/completions", body, **{SIGNATURE_HEADER: signature})
        assert first.status == 200
        error = assert_openai_error(
            await post(ctx.port, "/v1/completions", body, **{SIGNATURE_HEADER: signature}), 403
        )
        assert "replayed" in error["message"] and error["code"] == "bad_signature"
        assert ctx.engine.parked_count == 1  # the replay parked nothing more
        # The KV fetch's signature is one-time too.
        path = f"/kv/{first.json()['choices'][0]['disaggregated_params']['ctx_request_id']}"
        fetch_signature = kv_signature(SECRET, path)
        assert (await get(ctx.port, path, **{SIGNATURE_HEADER: fetch_signature})).status == 200
        error = assert_openai_error(await get(ctx.port, path, **{SIGNATURE_HEADER: fetch_signature}), 403)
        assert "replayed" in error["message"]
        # Signed over another path, or long ago: refused.
        other = kv_signature(SECRET, "/kv/1")
        assert (
            "bad signature"
            in assert_openai_error(await get(ctx.port, path, **{SIGNATURE_HEADER: other}), 403)["message"]
        )
        stale = sign_body(SECRET, body, now=time.time() - 3600, destination=await instance_of(ctx.port))
        error = assert_openai_error(
            await post(ctx.port, "/v1/completions", body, **{SIGNATURE_HEADER: stale}), 403
        )
        assert "stale" in error["message"]
        assert ctx.engine.kv_used_tokens == 0
    finally:
        await ctx.server.cleanup()


async def test_parked_kv_released_by_a_signed_delete_only() -> None:
    ctx = await tiny_worker("context", shared_secret=SECRET)
    try:
        body = json.dumps(context_body("release me")).encode()
        signature = sign_body(SECRET, body, destination=await instance_of(ctx.port))
        first = await post(ctx.port, "/v1/completions", body, **{SIGNATURE_HEADER: signature})
        assert first.status == 200 and ctx.engine.parked_count == 1
        path = f"/kv/{first.json()['choices'][0]['disaggregated_params']['ctx_request_id']}"

        async def delete(signature: str | None) -> Response:
            headers = {SIGNATURE_HEADER: signature} if signature is not None else {}
            return await exchange(ctx.port, request("DELETE", path, headers=headers, port=ctx.port))

        # Unsigned, a fetch's signature, or another path's: refused, nothing freed.
        assert assert_openai_error(await delete(None), 403)["code"] == "bad_signature"
        assert assert_openai_error(await delete(kv_signature(SECRET, path)), 403)["code"] == "bad_signature"
        assert (
            assert_openai_error(await delete(sign_body(SECRET, b"DELETE /kv/1")), 403)["code"]
            == "bad_signature"
        )
        assert ctx.engine.parked_count == 1
        released = await delete(sign_body(SECRET, b"DELETE " + path.encode()))
        assert released.status == 200 and released.json() == {"released": True}
        assert ctx.engine.parked_count == 0 and ctx.engine.kv_used_tokens == 0
        assert await metric(ctx.port, handoff("released")) == 1
        # Gone: a second release is a 404, and so is the fetch.
        assert_openai_error(await delete(sign_body(SECRET, b"DELETE " + path.encode())), 404)
        assert_openai_error(await get(ctx.port, path, **{SIGNATURE_HEADER: kv_signature(SECRET, path)}), 404)
        put = await exchange(ctx.port, request("PUT", path, port=ctx.port))
        assert assert_openai_error(put, 405) and put.headers["allow"] == "GET, DELETE"
    finally:
        await ctx.server.cleanup()


# ---------------------------------------------------------------- signatures before parsing


@pytest.mark.parametrize(
    "header",
    [
        b"\xc3\xa9",
        b"",
        b"t=1,n=abc",
        b"t=x,n=0123456789abcdef,sha256=00",
        b"\xff" * 300,
        b"sha256=" + b"0" * 64,
    ],
    ids=["non-ascii", "empty", "short", "not-a-time", "binary", "old-scheme"],
)
async def test_any_signature_header_bytes_are_a_403_never_a_500(synthetic: LiveWorker, header: bytes) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    error = assert_openai_error(
        await post(synthetic.port, "/v1/completions", body, **{SIGNATURE_HEADER: header}), 403
    )
    assert SIGNATURE_HEADER in error["message"]
    error = assert_openai_error(await get(synthetic.port, "/kv/5", **{SIGNATURE_HEADER: header}), 403)
    assert "KV fetch refused" in error["message"]


UNSIGNED_DISAGG = [
    # The prompt is refused by the parser (out of the vocabulary, 400) if it ever got that far:
    # a 403 shows the body was refused before any parsing or tokenizing.
    b'{"prompt": [1, 99999999], "disaggregated_params": {"request_type": "context_only"}}',
    b'{"prompt": [1, 99999999], "disaggregated\\u005fparams": {"request_type": "context_only"}}',
    b'{"prompt": [1, 99999999], "disaggregated_params": "anything"}',
]


@pytest.mark.parametrize("raw", UNSIGNED_DISAGG, ids=["plain", "escaped-key", "not-an-object"])
async def test_an_unsigned_internal_request_is_refused_before_it_is_parsed(
    synthetic: LiveWorker, raw: bytes
) -> None:
    error = assert_openai_error(await post(synthetic.port, "/v1/completions", raw), 403)
    assert error["code"] == "missing_signature" and error["param"] == "disaggregated_params"


async def test_unsigned_plain_requests_still_go_through_the_parser(synthetic: LiveWorker) -> None:
    # No disaggregated_params (or a null one): the parser's own answers.
    assert (await post(synthetic.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})).status == 200
    null = b'{"prompt": "x", "max_tokens": 2, "disaggregated_params": null}'
    assert (await post(synthetic.port, "/v1/completions", null)).status == 200
    assert_openai_error(await post(synthetic.port, "/v1/completions", b'{"prompt": [1, 99999999]}'), 400)
    assert_openai_error(await post(synthetic.port, "/v1/completions", b'{"disaggregated_params": {'), 400)
    # Signed: the parser runs and the role is checked after the signature.
    body = json.dumps({"prompt": [1, 2], "disaggregated_params": {"request_type": "generation_only",
                       "first_gen_tokens": [3]}}).encode()  # fmt: skip
    signature = sign_body(SECRET, body, destination=await instance_of(synthetic.port))
    resp = await post(synthetic.port, "/v1/completions", body, **{SIGNATURE_HEADER: signature})
    assert "role is context" in assert_openai_error(resp, 400)["message"]


# ---------------------------------------------------------------- the HTTP layer


async def test_framework_errors_are_openai_json_without_a_server_banner(synthetic: LiveWorker) -> None:
    port = synthetic.port
    ok = await get(port, "/health")
    assert ok.status == 200 and "server" not in ok.headers
    assert_openai_error(await get(port, "/v1/nothing"), 404)
    error = assert_openai_error(await get(port, "/v1/completions"), 405)
    assert "takes POST" in error["message"]
    assert (await get(port, "/v1/completions")).headers["allow"] == "POST"
    assert_openai_error(await post(port, "/health", {}), 405)
    head = await exchange(port, request("HEAD", "/health"), head_only=True)
    assert head.status == 200 and head.body == b""
    # HEAD would hand parked KV to nobody: the KV endpoint takes GET only.
    refused = await exchange(port, request("HEAD", "/kv/5"), head_only=True)
    assert refused.status == 405 and refused.headers["allow"] == "GET, DELETE"
    # Malformed HTTP: a 400 in OpenAI's shape that does not echo the request's bytes.
    garbage = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header <script>\r\n\r\n")
    assert_openai_error(garbage, 400)
    assert b"<script>" not in garbage.body
    # A body over max_body_bytes (4096 here): 413 before the body is read.
    big = json.dumps({"prompt": "x" * 5000}).encode()
    assert_openai_error(await exchange(port, request("POST", "/v1/completions", big)), 413)


@pytest.mark.parametrize("raw_id", ["abc", "+5", "1_000", "1" * 21, ""])
async def test_kv_ids_that_are_not_ascii_digits_are_400s(synthetic: LiveWorker, raw_id: str) -> None:
    path = "/kv/" + raw_id
    resp = await get(synthetic.port, path, **{SIGNATURE_HEADER: kv_signature(SECRET, path)})
    assert assert_openai_error(resp, 400)["param"] == "ctx_request_id"


async def test_slow_headers_get_408_and_connections_are_capped() -> None:
    worker = await synthetic_worker(header_timeout_s=1.0, max_connections=2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert_openai_error(await read_response(reader), 408)
        writer.close()
        held = [await asyncio.open_connection("127.0.0.1", worker.port) for _ in range(2)]
        await wait_for(lambda: len(worker.server.connections) == 2, "two connections")
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        # One client past its share of the cap (server.http Limits.peer_share): 429, not an idle one closed.
        assert_openai_error(await read_response(reader), 429)
        writer.close()
        for _, w in held:
            w.close()
        await wait_for(lambda: len(worker.server.connections) == 0, "the connections to close")
        assert await metric(worker.port, "fastcore_worker_connections_refused_total") == 1
        assert await metric(worker.port, "fastcore_worker_http_framing_errors_total") >= 1
    finally:
        await worker.server.cleanup()


# ---------------------------------------------------------------- where KV is fetched from


class Listener:
    """A TCP server that counts the connections made to it (and answers nothing)."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])


def generation_body(endpoint: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": [72, 105, 33],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "disaggregated_params": {"request_type": "generation_only", "first_gen_tokens": [65],
                                 "ctx_request_id": 5, "ctx_info_endpoint": endpoint},
    }  # fmt: skip


async def test_kv_is_fetched_only_from_allowed_sources() -> None:
    listener = Listener()
    listen_port = await listener.start()
    ctx = await tiny_worker("context")
    gen = await tiny_worker("generation", kv_allow=(f"127.0.0.1:{ctx.port}",))
    loose = await tiny_worker("generation")  # no secret, no list: loopback only
    try:

        async def failures(worker: LiveWorker) -> float:
            return await metric(worker.port, 'fastcore_worker_kv_fetch_failures_total{reason="not_allowed"}')

        refused = [
            f"http://127.0.0.1:{listen_port}/kv/5",  # a loopback port not in the list
            f"http://localhost:{ctx.port}/kv/5",  # names are not resolved
            f"http://127.0.0.1:{ctx.port}/metrics",  # not a KV path
            f"http://127.0.0.1:{ctx.port}/kv/5?x=1",
            f"ftp://127.0.0.1:{ctx.port}/kv/5",
            "http://127.0.0.1:99999/kv/5",
        ]
        for n, endpoint in enumerate(refused, 1):
            resp = await post(gen.port, "/v1/completions", generation_body(endpoint))
            assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 4  # recomputed
            assert await failures(gen) == n
        # Without a list (and no secret): loopback only, and only KV paths.
        for n, endpoint in enumerate(
            [
                "http://192.0.2.1:80/kv/5",
                "http://example.com/kv/5",
                f"http://127.0.0.1:{listen_port}/metrics",
            ],
            1,
        ):
            assert (await post(loose.port, "/v1/completions", generation_body(endpoint))).status == 200
            assert await failures(loose) == n
        assert listener.connections == 0
        # Allowed: fetched, as before.
        ctx_resp = await post(ctx.port, "/v1/completions", context_body("allowed", 1, max_tokens=4))
        params = ctx_resp.json()["choices"][0]["disaggregated_params"]
        body = generation_body(params["ctx_info_endpoint"])
        body["prompt"] = ctx_resp.json()["prompt_token_ids"]
        body["disaggregated_params"]["first_gen_tokens"] = params["first_gen_tokens"]
        assert (await post(gen.port, "/v1/completions", body)).status == 200
        assert await metric(gen.port, handoff("fetched")) == 1
        # A loopback endpoint that is not a worker is tried by the loose worker (and fails as unreachable).
        await post(loose.port, "/v1/completions", generation_body(f"http://127.0.0.1:{listen_port}/kv/5"))
        assert listener.connections >= 1
    finally:
        for worker in (ctx, gen, loose):
            await worker.server.cleanup()
        assert listener.server is not None
        listener.server.close()


async def test_kv_sources_parse_and_match() -> None:
    sources = KVSources(["10.0.0.1", "[::1]:8001", "Ctx.Example:9000"], any_host=False)
    assert sources.allows("http://10.0.0.1:1234/kv/1") and sources.allows("https://10.0.0.1/kv/1")
    assert sources.allows("http://[::1]:8001/kv/22") and not sources.allows("http://[::1]:8002/kv/22")
    assert sources.allows("http://ctx.example:9000/kv/3") and not sources.allows("http://ctx.example/kv/3")
    assert not sources.allows("http://user@10.0.0.1/kv/1") and not sources.allows("http://10.0.0.1/kv/-1")
    assert not sources.allows("http://10.0.0.1/kv/1#x") and not sources.allows("not a url")
    loopback = KVSources([], any_host=False)
    assert loopback.allows("http://127.3.4.5:1/kv/1") and loopback.allows("http://localhost:1/kv/1")
    assert loopback.allows("http://[::1]:1/kv/1") and not loopback.allows("http://10.0.0.1/kv/1")
    assert KVSources([], any_host=True).allows("http://10.0.0.1/kv/1")
    for bad in ("a/b", "host:port", "", "http://x", "x?y"):
        with pytest.raises(ValueError):
            WorkerSettings(kv_allow=(bad,))
    with pytest.raises(ValueError, match="max_parked_fraction"):
        WorkerSettings(max_parked_fraction=1.5)


# -- streams whose client never reads ---------------------------------------------------------------


#: a long served-model name: every SSE chunk echoes it, so a never-read stream fills the socket
#: buffers (a few MB on loopback) in ~1.5k tokens instead of ~20k
LONG_MODEL = "synthetic-" + "x" * 2000


def _never_reading_stream(port: int) -> socket.socket:
    """A streamed completion without max_tokens (so up to the context's end) on a socket that is
    never read: a receive buffer as small as the kernel allows, so the worker's send side fills."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": LONG_MODEL, "prompt": "hi", "stream": True, "ignore_eos": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


async def test_a_stream_whose_client_stops_reading_is_dropped_and_its_kv_freed() -> None:
    """Never-read streams held a small worker's whole capacity until max_tokens (65k tokens each
    here); past stream_stall_timeout_s of a full write buffer they are dropped, their slots freed
    long before their max_tokens, and the worker serves again."""
    from server.worker.app import WorkerApp
    from server.worker.synthetic import SyntheticEngine

    engine = SyntheticEngine(64, token_latency_s=0.001)
    engine.max_num_seqs = 2  # the whole "KV": two sequences
    room = engine.max_context - 64  # each stream's max_tokens
    settings = WorkerSettings(model_name=LONG_MODEL, admission_wait_s=0, stream_stall_timeout_s=0.5)
    app = WorkerApp(engine, settings)
    server, port = await app.start("127.0.0.1", 0)
    socks = [_never_reading_stream(port) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while engine.running < 2:
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{port}/v1/completions"
        plain = {"model": LONG_MODEL, "prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=plain) as r:
                assert r.status == 503  # full: both slots held by clients that read nothing
            deadline = time.monotonic() + 300  # a safety net only: the check is the token count
            while engine.running:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert app.stalled_streams == 2
            assert engine.generated_tokens_total < room, "the streams ran to max_tokens"
            async with session.post(url, json=plain) as r:
                assert r.status == 200, await r.text()
    finally:
        for sock in socks:
            sock.close()
        await server.cleanup()


async def test_stream_stall_timeout_is_checked() -> None:
    with pytest.raises(ValueError, match="stream_stall_timeout_s"):
        WorkerSettings(stream_stall_timeout_s=0)
