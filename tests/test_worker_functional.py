"""Live torch workers on 127.0.0.1: the disaggregated matrix, bad input, admission, cancellation, metrics.

Each worker is the real app (``server.worker.app.start_worker``) around the
real ``tiny`` model, on a real socket; the test plays the orchestrator's part
of docs/protocol.md with plain HTTP. Workers start once per module.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import pytest_asyncio
import torch
from helpers import comparable_usage, streamed
from tiny_workers import LiveWorker, one_torch_thread, tiny_worker  # noqa: F401 (an autouse fixture)

from server.auth import SIGNATURE_HEADER, sign_body
from server.worker.kv_handoff import kv_signature

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT_BODY = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the weather in Lisbon."},
    ],
    "max_tokens": 24,
    "temperature": 0,
}
COMPLETION_BODY = {
    "model": "tiny",
    "prompt": "Once upon a time, in a land far away",
    "max_tokens": 24,
    "temperature": 0,
}
ROUTES = {"chat": ("/v1/chat/completions", CHAT_BODY), "completions": ("/v1/completions", COMPLETION_BODY)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers() -> AsyncIterator[dict[str, LiveWorker]]:
    started = {
        "both": await tiny_worker("both"),
        "context": await tiny_worker("context", kv_ttl_s=30.0),
        "generation": await tiny_worker("generation", kv_fetch_timeout_s=5.0),
    }
    yield started
    for w in started.values():
        await w.server.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# ---------------------------------------------------------------- helpers


def parse_sse(raw: str) -> list[dict[str, Any]]:
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", f"stream does not end with [DONE]: {events[-1:]}"
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


async def call(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **kw}) as resp:
        text = await resp.text()
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return resp.status, parse_sse(text)
        return resp.status, json.loads(text)


def outcome(route: str, result: Any) -> dict[str, Any]:
    """Text, finish reason and usage (without cached_tokens) of a response, streamed or not, in one shape."""
    if isinstance(result, dict):
        choice = result["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        return {"text": text, "finish_reason": choice["finish_reason"], "usage": comparable_usage(result["usage"])}
    chunks = [c for c in result if c["choices"]]
    usage = [c["usage"] for c in result if not c["choices"]]
    if route == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and chunks[-1]["choices"][0]["finish_reason"] == finishes[0]
    return {"text": text, "finish_reason": finishes[0], "usage": comparable_usage(usage[0] if usage else None)}


async def context_leg(
    http: aiohttp.ClientSession, ctx: LiveWorker, route: str, body: dict[str, Any], b64: bool
) -> dict[str, Any]:
    path = ROUTES[route][0]
    params: dict[str, Any] = {"request_type": "context_only", "disagg_request_id": 7205759403792793601}
    if b64:
        params["return_prompt_token_ids_b64"] = True
    status, resp = await call(http, ctx.url + path, {**body, "stream": False, "stream_options": None,
                                                    "disaggregated_params": params})  # fmt: skip
    assert status == 200, resp
    return resp


def generation_request(route: str, body: dict[str, Any], ctx: dict[str, Any], b64: bool) -> dict[str, Any]:
    params = dict(ctx["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    params["ctx_usage"] = ctx["usage"]
    gen = {**body, "disaggregated_params": params}
    if b64:
        gen["prompt_token_ids_b64"] = ctx["prompt_token_ids_b64"]
    elif route == "chat":
        gen["prompt_token_ids"] = ctx["prompt_token_ids"]
    else:
        gen["prompt"] = ctx["prompt_token_ids"]
    return gen


async def metric(http: aiohttp.ClientSession, worker: LiveWorker, name: str) -> float:
    async with http.get(worker.url + "/metrics") as resp:
        text = await resp.text()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("handoff", ["kv", "recompute"])
@pytest.mark.parametrize("ids", ["list", "b64"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_disaggregated_equals_single_worker(
    workers: dict[str, LiveWorker],
    http: aiohttp.ClientSession,
    route: str,
    stream: bool,
    ids: str,
    handoff: str,
) -> None:
    path, base = ROUTES[route]
    body = streamed(base, stream)
    status, single = await call(http, workers["both"].url + path, body)
    assert status == 200
    want = outcome(route, single)
    assert want["finish_reason"] == "length" and len(want["text"]) > 10

    b64 = ids == "b64"
    ctx = await context_leg(http, workers["context"], route, body, b64)
    choice = ctx["choices"][0]
    assert choice["finish_reason"] == "not_finished"
    assert ctx["usage"]["completion_tokens"] == 1
    assert ctx["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    if b64:
        assert ctx["prompt_token_ids"] is None
        raw = base64.b64decode(ctx["prompt_token_ids_b64"], validate=True)
        assert len(raw) // 4 == want["usage"]["prompt_tokens"]
    else:
        assert len(ctx["prompt_token_ids"]) == want["usage"]["prompt_tokens"]
    endpoint = choice["disaggregated_params"]["ctx_info_endpoint"]
    if handoff == "recompute":
        # Take the KV away first: the generation worker then gets 404 and must recompute.
        async with http.get(endpoint) as resp:
            assert resp.status == 200
            assert (await resp.read())[:4] == b"FCKV"
    gen_worker = workers["generation"]
    fetched = await metric(http, gen_worker, 'fastcore_worker_kv_handoff_total{event="fetched"}')
    recomputed = await metric(http, gen_worker, 'fastcore_worker_kv_handoff_total{event="recomputed"}')

    status, gen = await call(http, gen_worker.url + path, generation_request(route, body, ctx, b64))
    assert status == 200, gen
    assert outcome(route, gen) == want

    expect_fetched = handoff == "kv"
    assert (
        await metric(http, gen_worker, 'fastcore_worker_kv_handoff_total{event="fetched"}')
        == fetched + expect_fetched
    )
    assert await metric(
        http, gen_worker, 'fastcore_worker_kv_handoff_total{event="recomputed"}'
    ) == recomputed + (not expect_fetched)
    async with http.get(endpoint) as resp:  # fetched (by the generation worker or by us): gone
        assert resp.status == 404


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_disaggregated_logprobs_and_seeded_sampling(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession, route: str
) -> None:
    path, base = ROUTES[route]
    body = {**base, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    body.update({"logprobs": True, "top_logprobs": 3} if route == "chat" else {"logprobs": 3})
    status, single = await call(http, workers["both"].url + path, body)
    assert status == 200
    ctx = await context_leg(http, workers["context"], route, body, b64=True)
    status, gen = await call(
        http, workers["generation"].url + path, generation_request(route, body, ctx, True)
    )
    assert status == 200
    assert outcome(route, gen) == outcome(route, single)
    lp_single, lp_gen = single["choices"][0]["logprobs"], gen["choices"][0]["logprobs"]
    if route == "chat":
        lp_single, lp_gen = lp_single["content"], lp_gen["content"]
        assert len(lp_single) == 24 and all(len(e["top_logprobs"]) == 3 for e in lp_single)
        assert [e["token"] for e in lp_gen] == [e["token"] for e in lp_single]
        assert [e["logprob"] for e in lp_gen] == pytest.approx([e["logprob"] for e in lp_single], abs=1e-4)
    else:
        assert lp_gen["tokens"] == lp_single["tokens"]
        assert lp_gen["token_logprobs"] == pytest.approx(lp_single["token_logprobs"], abs=1e-4)
    # Another seed gives another text: the seed is really used.
    status, other = await call(http, workers["both"].url + path, {**body, "seed": 99})
    assert outcome(route, other)["text"] != outcome(route, single)["text"]


async def test_context_answers_when_first_token_finishes(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    path, base = ROUTES["completions"]
    status, ctx = await call(http, workers["context"].url + path, {**base, "max_tokens": 1,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1}})  # fmt: skip
    assert status == 200 and ctx["choices"][0]["finish_reason"] == "length"
    status, single = await call(http, workers["both"].url + path, base)
    first_char = single["choices"][0]["text"][:1]
    assert ctx["choices"][0]["text"] == first_char
    # A stop string met by the first token: "stop", and the text cut before it.
    status, ctx = await call(http, workers["context"].url + path, {**base, "stop": [first_char],
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 2}})  # fmt: skip
    assert ctx["choices"][0]["finish_reason"] == "stop" and ctx["choices"][0]["text"] == ""
    # A stop token as the first token: "stop", no text, one completion token.
    first_id = ctx["choices"][0]["disaggregated_params"]["first_gen_tokens"][0]
    status, stopped = await call(http, workers["context"].url + path, {**base, "stop_token_ids": [first_id],
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 3}})  # fmt: skip
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == ""
    assert stopped["usage"]["completion_tokens"] == 1
    # A finished context leg parks nothing.
    async with http.get(ctx["choices"][0]["disaggregated_params"]["ctx_info_endpoint"]) as resp:
        assert resp.status == 404


async def test_kv_unreachable_or_expired_recomputes(
    http: aiohttp.ClientSession, workers: dict[str, LiveWorker]
) -> None:
    ctx_worker = await tiny_worker("context", kv_ttl_s=0.2)
    try:
        path, body = ROUTES["chat"]
        ctx = await context_leg(http, ctx_worker, "chat", body, b64=True)
        assert ctx_worker.engine.parked_count == 1
        await wait_for(lambda: _async(ctx_worker.engine.parked_count == 0), "parked KV to expire")
        assert await metric(http, ctx_worker, 'fastcore_worker_kv_handoff_total{event="expired"}') == 1
        assert await metric(http, ctx_worker, "fastcore_worker_kv_used_tokens") == 0
        gen_worker = workers["generation"]
        before = await metric(http, gen_worker, 'fastcore_worker_kv_fetch_failures_total{reason="http_404"}')
        status, gen = await call(http, gen_worker.url + path, generation_request("chat", body, ctx, True))
        assert status == 200
        status, single = await call(http, workers["both"].url + path, body)
        assert outcome("chat", gen) == outcome("chat", single)
        after = await metric(http, gen_worker, 'fastcore_worker_kv_fetch_failures_total{reason="http_404"}')
        assert after == before + 1
        # Context worker gone: connection refused, same answer by recomputing.
        ctx = await context_leg(http, ctx_worker, "chat", body, b64=False)
    finally:
        await ctx_worker.server.cleanup()
    before = await metric(http, gen_worker, 'fastcore_worker_kv_fetch_failures_total{reason="unreachable"}')
    status, gen = await call(http, gen_worker.url + path, generation_request("chat", body, ctx, False))
    assert status == 200 and outcome("chat", gen) == outcome("chat", single)
    after = await metric(http, gen_worker, 'fastcore_worker_kv_fetch_failures_total{reason="unreachable"}')
    assert after == before + 1


async def test_kv_that_does_not_belong_is_not_used(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    path, body = ROUTES["completions"]
    gen_worker = workers["generation"]

    async def failures(reason: str) -> float:
        return await metric(http, gen_worker, f'fastcore_worker_kv_fetch_failures_total{{reason="{reason}"}}')

    before = {r: await failures(r) for r in ("mismatch", "no_endpoint")}
    # Another prompt's KV (the checksum and length differ): refused, the prefill recomputed.
    ctx = await context_leg(http, workers["context"], "completions", body, b64=False)
    other = {**body, "prompt": "a different prompt"}
    gen = generation_request("completions", other, ctx, False)
    gen["prompt"] = workers["both"].engine.tokenizer.encode(other["prompt"])
    status, got = await call(http, gen_worker.url + path, gen)
    status, want = await call(http, workers["both"].url + path, other)
    assert status == 200
    # The forced first token came from the other prompt, so only the length and usage are comparable.
    assert outcome("completions", got)["usage"] == outcome("completions", want)["usage"]
    assert await failures("mismatch") == before["mismatch"] + 1
    # A first token that is not the one the KV was made with: refused too.
    ctx = await context_leg(http, workers["context"], "completions", body, b64=False)
    gen = generation_request("completions", body, ctx, False)
    gen["disaggregated_params"]["first_gen_tokens"] = [
        (ctx["choices"][0]["disaggregated_params"]["first_gen_tokens"][0] + 1) % 256
    ]
    status, _ = await call(http, gen_worker.url + path, gen)
    assert status == 200 and await failures("mismatch") == before["mismatch"] + 2
    # No endpoint at all: recomputed without trying.
    gen = generation_request("completions", body, ctx, False)
    gen["disaggregated_params"]["ctx_info_endpoint"] = None
    status, got = await call(http, gen_worker.url + path, gen)
    status, want = await call(http, workers["both"].url + path, body)
    assert outcome("completions", got) == outcome("completions", want)
    assert await failures("no_endpoint") == before["no_endpoint"] + 1


async def _async(value: Any) -> Any:
    return value


# ---------------------------------------------------------------- batching


async def test_concurrent_mixed_lengths_equal_solo_runs(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    url = workers["both"].url + "/v1/completions"
    bodies = [
        {
            "model": "tiny",
            "prompt": "x" * (1 + 37 * i) + f" request {i}",
            "max_tokens": 8 + 5 * i,
            "temperature": 0,
        }
        for i in range(8)
    ]
    solo = [await call(http, url, b) for b in bodies]
    steps_before = workers["both"].engine.decode_steps_total
    together = await asyncio.gather(*(call(http, url, b) for b in bodies))
    steps = workers["both"].engine.decode_steps_total - steps_before
    for (s1, r1), (s2, r2) in zip(solo, together):
        assert s1 == s2 == 200
        assert outcome("completions", r2) == outcome("completions", r1)
    # Shared decode steps: far fewer than the sum of the requests' decode steps.
    assert steps < sum(b["max_tokens"] - 1 for b in bodies)


# ---------------------------------------------------------------- bad input


def _b64(ids: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()


GEN_PARAMS = {"request_type": "generation_only", "first_gen_tokens": [65], "ctx_request_id": 1,
              "disagg_request_id": 1, "ctx_info_endpoint": None}  # fmt: skip

BAD_INPUTS = [
    ("chat", b'{"model": "tiny", "messages": [}', 400, r"not valid JSON.*\(byte 31\)", None),
    ("chat", b"[1, 2]", 400, "must be a JSON object", None),
    ("chat", b"\xff\xfe", 400, "not valid UTF-8", None),
    ("chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "'nope' does not exist", "model"),
    ("chat", {"messages": [], "model": "tiny"}, 400, "'messages' must be a non-empty list", "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role must be one of", "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "'n' must be the integer 1", "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}, 400,
     r"'frequency_penalty' is not supported by this worker \(got 0.5\)", "frequency_penalty"),
    ("completions", {"prompt": "x", "echo": True}, 400, "'echo' is not supported", "echo"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "'temperature' must be a number", "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "'max_tokens' must be >= 1", "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400, "exceeds this model's context", "max_tokens"),
    ("completions", {"prompt": "x" * 3000}, 400, "the prompt has 3001 tokens; this model's context is 2048", "prompt"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, r"'prompt\[2\]' = 99999 is outside the vocabulary \[0, 262\)", "prompt"),
    ("completions", {"prompt": [1, -4]}, 400, r"'prompt\[1\]' = -4 is outside the vocabulary", "prompt"),
    ("completions", {"prompt": [[1, 2], [3]]}, 400, "batches are not supported", "prompt"),
    ("completions", {"prompt_token_ids_b64": "AQAAAAIA*AAAAwAA"}, 400, "Invalid base64 character 0x2a at byte 8", "prompt_token_ids_b64"),
    ("completions", {"prompt_token_ids_b64": "AQAAAA="}, 400, "not a multiple of 4", "prompt_token_ids_b64"),
    ("completions", {"prompt_token_ids_b64": "AQ==AAAAAAAAAAAA"}, 400, "Misplaced padding character '=' at byte 2", "prompt_token_ids_b64"),
    ("completions", {"prompt_token_ids_b64": "AQAAAAIA"}, 400, "not a whole number of int32", "prompt_token_ids_b64"),
    ("chat", {"prompt_token_ids_b64": _b64([5, 262]), "messages": []}, 400, "id 262 at index 1 is outside the vocabulary", "prompt_token_ids_b64"),
    ("chat", {"prompt_token_ids_b64": _b64([5] * 2049), "messages": []}, 400, "more than max_tokens=2048", "prompt_token_ids_b64"),
    ("chat", {"prompt_token_ids": [5] * 2048, "messages": []}, 400, "the prompt has 2048 tokens", "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "disaggregated_params": {**GEN_PARAMS}}, 400,
     "generation_only request must carry the prompt as token ids", "prompt_token_ids"),
    ("completions", {"prompt": "hello", "disaggregated_params": {**GEN_PARAMS}}, 400,
     "generation_only request must carry the prompt as token ids", "prompt"),
    ("completions", {"prompt": [1, 2], "disaggregated_params": {**GEN_PARAMS, "first_gen_tokens": [300]}}, 400,
     r"first_gen_tokens\[0\]' = 300 is outside the vocabulary", "disaggregated_params.first_gen_tokens"),
    ("completions", {"prompt": [1, 2], "disaggregated_params": {"request_type": "both"}}, 400,
     "request_type' must be", "disaggregated_params"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "status", "message", "param"), BAD_INPUTS)
async def test_bad_input_is_an_openai_error(
    workers: dict[str, LiveWorker],
    http: aiohttp.ClientSession,
    route: str,
    body: Any,
    status: int,
    message: str,
    param: str | None,
) -> None:
    if isinstance(body, dict):
        body = {"model": "tiny", **body}
    got, resp = await call(http, workers["generation"].url + ROUTES[route][0], body)
    assert got == status, resp
    error = resp["error"]
    assert re.search(message, error["message"]), error["message"]
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


async def test_engine_survives_bad_input(workers: dict[str, LiveWorker], http: aiohttp.ClientSession) -> None:
    url = workers["generation"].url
    for route, body, *_ in BAD_INPUTS:
        await call(
            http, url + ROUTES[route][0], body if isinstance(body, bytes) else {"model": "tiny", **body}
        )
    # Neutral values of the refused fields are fine: clients send them by default.
    neutral = {"n": None, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "echo": False}
    status, resp = await call(http, url + "/v1/completions", {**COMPLETION_BODY, **neutral})
    assert status == 200 and resp["choices"][0]["finish_reason"] == "length"
    async with http.get(url + "/health") as health:
        assert health.status == 200


TOKEN_FIELD_BAD_INPUTS = [
    # (route, raw body, message, param): the token field decoded from the body's bytes
    ("chat", b'{"model": "tiny", "messages": [], "prompt_token_ids_b64": "AQAAAAIA*AAAAwAA"}',
     r"Invalid base64 character 0x2a at byte 8 \(request body byte 67\)", "prompt_token_ids_b64"),
    ("chat", b'{"model": "tiny", "prompt_token_ids": [1], "messages": [], "prompt_token_ids": [2]}',
     "'prompt_token_ids' more than once", "prompt_token_ids"),
    ("completions", b'{"model": "tiny", "prompt_token_ids_b64": "AQAAAA==", "prompt_token_ids_b64": "AgAAAA=="}',
     "'prompt_token_ids_b64' more than once", "prompt_token_ids_b64"),
    ("completions", b'{"model": "tiny", "prompt": [1, 2], "user": ' + b"[" * 1000 + b"]" * 1000 + b"}",
     "nests arrays and objects deeper than the limit of 512 levels", None),
    ("completions", b'{"model": "tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
     "nests arrays and objects deeper than the limit of 512 levels", None),
    ("chat", b'{"model": "tiny", "messages": [], "seed": ' + b"7" * 5000 + b"}",
     "a number longer than the limit of 256 characters", None),
    ("completions", b'{"model": "tiny", "prompt": [1, ' + b"7" * 5000 + b"]}", "a number longer than the limit of 256 characters", None),
    ("completions", b'{"model": "tiny", "prompt": [1, 2.5]}', r"'prompt\[1\]' must be an integer token id", "prompt"),
    ("completions", b'{"model": "tiny", "prompt": [1, 2]} trailing', r"not valid JSON.*\(byte 36\)", None),
    ("chat", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3"}]}', r"not valid UTF-8 \(byte 60\)", None),
]  # fmt: skip


@pytest.mark.parametrize(("route", "raw", "message", "param"), TOKEN_FIELD_BAD_INPUTS)
async def test_token_field_and_parser_limits_are_400s(
    workers: dict[str, LiveWorker],
    http: aiohttp.ClientSession,
    route: str,
    raw: bytes,
    message: str,
    param: Any,
) -> None:
    status, resp = await call(http, workers["generation"].url + ROUTES[route][0], raw)
    assert status == 400, resp
    assert re.search(message, resp["error"]["message"]), resp["error"]["message"]
    assert resp["error"]["param"] == param and resp["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_long_id_prompts_in_both_forms_give_one_answer(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession, route: str
) -> None:
    """Ids far longer than a test prompt, as a list and as base64, escaped or not: the same completion."""
    ids = [(i * 37 + 11) % 256 for i in range(1500)]
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "x"}]
    as_list = {**body, "prompt_token_ids" if route == "chat" else "prompt": ids}
    as_b64 = {**body, "prompt_token_ids_b64": _b64(ids)}
    escaped = json.dumps(as_b64).replace("/", "\\/").encode()
    url = workers["both"].url + ROUTES[route][0]
    answers = [await call(http, url, b) for b in (as_list, as_b64, escaped)]
    assert [status for status, _ in answers] == [200, 200, 200]
    texts = [outcome(route, resp) for _, resp in answers]
    assert texts[0] == texts[1] == texts[2] and texts[0]["usage"]["prompt_tokens"] == 1500


async def test_roles_refuse_the_other_leg(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    ctx_only = {
        **COMPLETION_BODY,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 3},
    }
    status, resp = await call(http, workers["generation"].url + "/v1/completions", ctx_only)
    assert status == 400 and "role is generation" in resp["error"]["message"]
    gen_only = {**COMPLETION_BODY, "prompt": [1, 2, 3], "disaggregated_params": GEN_PARAMS}
    status, resp = await call(http, workers["context"].url + "/v1/completions", gen_only)
    assert status == 400 and "role is context" in resp["error"]["message"]


async def test_unknown_routes_and_kv_ids_are_openai_errors(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    url = workers["context"].url
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("GET", "/kv/123", 404), ("GET", "/kv/abc", 400)]:  # fmt: skip
        async with http.request(method, url + path) as resp:
            assert resp.status == status
            assert "message" in (await resp.json())["error"]


async def test_shared_secret_guards_internal_requests(http: aiohttp.ClientSession) -> None:
    secret = b"s3cret"
    ctx_worker = await tiny_worker("context", shared_secret=secret)
    gen_worker = await tiny_worker("generation", shared_secret=secret)
    try:
        url = ctx_worker.url + "/v1/completions"
        ctx_body = json.dumps({**COMPLETION_BODY,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 4}}).encode()  # fmt: skip
        status, resp = await call(http, url, ctx_body)
        assert status == 403 and SIGNATURE_HEADER in resp["error"]["message"]
        status, resp = await call(http, url, ctx_body, **{SIGNATURE_HEADER: sign_body(b"wrong", ctx_body)})
        assert status == 403
        async with http.get(ctx_worker.url + "/health") as resp:
            ctx_instance = (await resp.json())["instance"]
        # Signed for another worker (a replay there): refused.
        for_gen = sign_body(secret, ctx_body, destination="0" * 32)
        status, resp = await call(http, url, ctx_body, **{SIGNATURE_HEADER: for_gen})
        assert status == 403 and resp["error"]["code"] == "wrong_destination"
        signature = sign_body(secret, ctx_body, destination=ctx_instance)
        status, ctx = await call(http, url, ctx_body, **{SIGNATURE_HEADER: signature})
        assert status == 200
        # Plain client requests need no signature.
        status, _ = await call(http, url, COMPLETION_BODY)
        assert status == 200
        endpoint = ctx["choices"][0]["disaggregated_params"]["ctx_info_endpoint"]
        async with http.get(endpoint) as resp:
            assert resp.status == 403
        # The generation worker signs its fetch with the same secret: the KV path is taken.
        gen_body = json.dumps(generation_request("completions", COMPLETION_BODY, ctx, False)).encode()
        async with http.get(gen_worker.url + "/health") as resp:
            gen_instance = (await resp.json())["instance"]
        status, gen = await call(http, gen_worker.url + "/v1/completions", gen_body,
                                 **{SIGNATURE_HEADER: sign_body(secret, gen_body, destination=gen_instance)})  # fmt: skip
        assert status == 200
        assert await metric(http, gen_worker, 'fastcore_worker_kv_handoff_total{event="fetched"}') == 1
        status, plain = await call(http, gen_worker.url + "/v1/completions", COMPLETION_BODY)
        assert outcome("completions", gen) == outcome("completions", plain)
        status, resp = await call(http, gen_worker.url + "/v1/completions", gen_body)
        assert status == 403 and resp["error"]["code"] == "missing_signature"
        assert SIGNATURE_HEADER in resp["error"]["message"]
        path = "/kv/" + str(ctx["choices"][0]["disaggregated_params"]["ctx_request_id"])
        assert kv_signature(secret, path).startswith("t=")
    finally:
        await ctx_worker.server.cleanup()
        await gen_worker.server.cleanup()


# ---------------------------------------------------------------- admission, cancellation, metrics


async def test_full_worker_answers_503_then_recovers(http: aiohttp.ClientSession) -> None:
    small = await tiny_worker("both", kv_tokens=256, admission_wait_s=0)
    try:
        url = small.url + "/v1/completions"
        hold = {
            "model": "tiny",
            "prompt": "hold the cache",
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
        }
        async with http.post(url, json=hold) as streaming:
            assert streaming.status == 200
            await streaming.content.readline()  # admitted and decoding: 16 blocks of 16 taken
            async with http.post(url, json={**COMPLETION_BODY, "max_tokens": 100}) as full:
                assert full.status == 503 and full.headers["Retry-After"] == "1"
                resp = await full.json()
            assert resp["error"]["code"] == "worker_full" and "worker is full" in resp["error"]["message"]
            assert resp["error"]["type"] == "service_unavailable"
            assert await metric(http, small, 'fastcore_worker_rejected_total{reason="kv_full"}') == 1
            await streaming.read()
        async with http.post(url, json={**COMPLETION_BODY, "max_tokens": 100}) as resp:
            assert resp.status == 200
        # More than the whole cache: waiting would not help, so 400 rather than 503.
        status, resp = await call(http, url, {**COMPLETION_BODY, "max_tokens": 300})
        assert status == 400 and "whole KV cache holds 256" in resp["error"]["message"]
        assert resp["error"]["param"] == "max_tokens"
    finally:
        await small.server.cleanup()


def slow_down(worker: LiveWorker, seconds: float) -> None:
    """Every forward step of ``worker``'s model takes ``seconds`` longer (time for a test to act)."""
    model = worker.engine.model
    real_step = model.forward_step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return real_step(*args, **kwargs)

    model.forward_step = slow_step  # type: ignore[method-assign]


HOLD = {"model": "tiny", "prompt": "hold the cache", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
        "stream": True}  # fmt: skip


async def test_request_that_does_not_fit_waits_for_room_then_runs(http: aiohttp.ClientSession) -> None:
    small = await tiny_worker("both", kv_tokens=256, admission_wait_s=60)
    slow_down(small, 0.005)  # the holder still decodes while the waiter queues
    try:
        url = small.url + "/v1/completions"
        async with http.post(url, json=HOLD) as streaming:
            await streaming.content.readline()  # admitted and decoding: 16 blocks of 16 taken
            waiting = asyncio.ensure_future(call(http, url, {**COMPLETION_BODY, "max_tokens": 100}))
            for _ in range(200):
                if await metric(http, small, "fastcore_worker_waiting_for_kv") == 1:
                    break
                await asyncio.sleep(0.01)
            assert await metric(http, small, "fastcore_worker_waiting_for_kv") == 1
            assert not waiting.done()
            await streaming.read()  # the holder finishes: its KV frees, the waiter is admitted
        status, resp = await waiting
        assert status == 200 and resp["usage"]["completion_tokens"] > 0
        assert await metric(http, small, "fastcore_worker_admission_waits_total") == 1
        assert await metric(http, small, "fastcore_worker_waiting_for_kv") == 0
        assert await metric(http, small, 'fastcore_worker_rejected_total{reason="kv_full"}') == 0
    finally:
        await small.server.cleanup()


async def test_admission_wait_is_bounded_in_time_and_in_waiters(http: aiohttp.ClientSession) -> None:
    small = await tiny_worker("both", kv_tokens=256, admission_wait_s=0.3, max_waiting=1)
    slow_down(small, 0.01)  # the holder's 240 steps outlive every wait below
    try:
        url = small.url + "/v1/completions"
        body = {**COMPLETION_BODY, "max_tokens": 100}
        async with aiohttp.ClientSession() as own:
            holder = await own.post(url, json={**HOLD, "prompt": "x", "max_tokens": 240})  # the whole cache
            await holder.content.readline()
            started = time.monotonic()
            first = asyncio.ensure_future(call(http, url, body))
            for _ in range(200):
                if await metric(http, small, "fastcore_worker_waiting_for_kv") == 1:
                    break
                await asyncio.sleep(0.005)
            # The one waiting slot is taken: refused at once, not after the wait.
            status, resp = await call(http, url, body)
            assert status == 503 and resp["error"]["code"] == "worker_full"
            assert time.monotonic() - started < 0.3 + 0.25
            status, resp = await first  # waited its 0.3 s, then 503
            assert status == 503 and time.monotonic() - started >= 0.3
            # A waiter whose client leaves is gone from the queue at once.
            gone = asyncio.ensure_future(own.post(url, json=body))
            for _ in range(200):
                if await metric(http, small, "fastcore_worker_waiting_for_kv") == 1:
                    break
                await asyncio.sleep(0.005)
            assert await metric(http, small, "fastcore_worker_waiting_for_kv") == 1
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            await own.close()
            for _ in range(200):
                if await metric(http, small, "fastcore_worker_waiting_for_kv") == 0:
                    break
                await asyncio.sleep(0.005)
            assert await metric(http, small, "fastcore_worker_waiting_for_kv") == 0
        assert await metric(http, small, 'fastcore_worker_rejected_total{reason="kv_full"}') == 2
    finally:
        await small.server.cleanup()


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
async def test_client_disconnect_frees_the_slot(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession, stream: bool
) -> None:
    worker = workers["both"]
    generated_before = worker.engine.generated_tokens_total
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip
    async with aiohttp.ClientSession() as own:
        request = asyncio.ensure_future(own.post(worker.url + "/v1/completions", json=body))
        await wait_for(lambda: _async(worker.engine.running == 1), "the request to be decoding")
        if stream:
            resp = await request
            await resp.content.readline()
            resp.close()
        else:
            request.cancel()
    await wait_for(
        lambda: _async(worker.engine.running == 0 and worker.engine.kv_used_tokens == 0),
        "the slot to be freed",
    )
    # Stopped early, not run to max_tokens.
    assert worker.engine.generated_tokens_total - generated_before < 2000


async def test_metrics_and_info_endpoints(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    worker = workers["both"]
    await call(http, worker.url + "/v1/completions", COMPLETION_BODY)
    async with http.get(worker.url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    for name in ("fastcore_worker_queue_depth", "fastcore_worker_running_sequences", "fastcore_worker_kv_used_tokens",
                 "fastcore_worker_kv_capacity_tokens 16384", "fastcore_worker_decode_tokens_per_second",
                 "fastcore_worker_generated_tokens_total", 'fastcore_worker_requests_total{route="completions",status="200"}',
                 "fastcore_worker_time_to_first_token_seconds_count"):  # fmt: skip
        assert name in text
    assert await metric(http, worker, "fastcore_worker_decode_tokens_per_second") > 0
    async with http.get(worker.url + "/server_info") as resp:
        info = await resp.json()
    assert info["role"] == "both" and info["vocab_size"] == 262 and info["max_context_length"] == 2048
    assert info["kv_endpoint"] == "/kv/{ctx_request_id}"
    async with http.get(worker.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "tiny"
    async with http.get(worker.url + "/health") as resp:
        assert resp.status == 200


async def test_a_stopped_engine_is_unhealthy_and_refuses_work(http: aiohttp.ClientSession) -> None:
    worker = await tiny_worker("both")
    try:
        await asyncio.get_running_loop().run_in_executor(None, worker.engine.stop)
        async with http.get(worker.url + "/health") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["message"] == "the engine is not running"
        async with http.post(worker.url + "/v1/completions", json=COMPLETION_BODY) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "engine_down"
        assert worker.engine.kv_used_tokens == 0
    finally:
        await worker.server.cleanup()


async def test_engine_failures_reach_the_client_as_errors(http: aiohttp.ClientSession) -> None:
    """Fault injection on a live worker: a forward that raises, at prefill and mid-stream."""
    worker = await tiny_worker("both")
    model = worker.engine.model
    real_step = model.forward_step
    calls = {"n": 0, "fail_from": 0}

    def failing_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > calls["fail_from"]:
            raise RuntimeError("injected fault")
        return real_step(*args, **kwargs)

    model.forward_step = failing_step  # type: ignore[method-assign]
    try:
        url = worker.url + "/v1/completions"
        status, resp = await call(http, url, COMPLETION_BODY)
        assert status == 500 and resp["error"]["message"] == "prefill failed: injected fault"
        assert resp["error"]["code"] == "engine_error"
        # Mid-stream: the prefill and 3 decode steps work, then the 4th fails.
        calls.update(n=0, fail_from=4)
        async with http.post(url, json={**COMPLETION_BODY, "stream": True}) as streamed:
            assert streamed.status == 200
            events = [e for e in (await streamed.text()).split("\n\n") if e]
        chunks = [json.loads(e[6:]) for e in events]
        texts = [c["choices"][0]["text"] for c in chunks if "choices" in c]
        assert len(texts) == 4 and all(texts)  # one token from the prefill, three from decode steps
        assert chunks[-1]["error"]["message"] == "decode step failed: injected fault"
        assert "data: [DONE]" not in events
        assert worker.engine.engine_errors_total == 2 and worker.engine.kv_used_tokens == 0
        # The loop lives on.
        model.forward_step = real_step  # type: ignore[method-assign]
        status, resp = await call(http, url, COMPLETION_BODY)
        assert status == 200 and resp["choices"][0]["finish_reason"] == "length"
    finally:
        await worker.server.cleanup()


async def test_the_official_openai_client_reads_every_shape(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    from openai import AsyncOpenAI, NotFoundError

    worker = workers["both"]
    client = AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    try:
        _, raw_chat = await call(http, worker.url + "/v1/chat/completions", CHAT_BODY)
        want = outcome("chat", raw_chat)
        chat = await client.chat.completions.create(**CHAT_BODY, logprobs=True, top_logprobs=2)
        assert chat.choices[0].message.content == want["text"] and chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 24
        assert chat.choices[0].logprobs is not None and len(chat.choices[0].logprobs.content or []) == 24
        text, usage = "", None
        stream = await client.chat.completions.create(
            **CHAT_BODY, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            else:
                usage = chunk.usage
        assert (
            text == want["text"] and usage is not None and usage.total_tokens == want["usage"]["total_tokens"]
        )
        _, raw_completion = await call(http, worker.url + "/v1/completions", COMPLETION_BODY)
        completion = await client.completions.create(**COMPLETION_BODY)
        assert completion.choices[0].text == outcome("completions", raw_completion)["text"]
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        with pytest.raises(NotFoundError, match="does not exist"):
            await client.completions.create(**{**COMPLETION_BODY, "model": "gpt-5"})
    finally:
        await client.close()
