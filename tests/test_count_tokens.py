"""Counting a prompt's tokens (issue 39): a worker's ``POST /tokenize`` (vLLM's endpoint: a chat or
completion body's prompt ids as a completion of it would be given them) and the orchestrator's
``POST /v1/messages/count_tokens`` (Anthropic's, through its official SDK), which translates the
Messages body to chat and asks a worker; every refusal in Anthropic's shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic import AsyncAnthropic
from helpers import assert_openai_error, get, post

from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SYNTHETIC_EOS, SYNTHETIC_VOCAB, SyntheticEngine
from server.worker.synthetic_script import Script

PLAIN = "It is sunny in Paris, 18 degrees."
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}
KEY = "sk-ant-count"


@contextlib.asynccontextmanager
async def worker(**settings: Any) -> AsyncIterator[int]:
    script = Script([PLAIN], eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
    runner, port = await start_worker(SyntheticEngine(0, script=script),
                                      WorkerSettings(model_name="synthetic", **settings))  # fmt: skip
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_a_workers_tokenize_counts_the_prompt_a_completion_is_given():
    async with worker(tool_call_parser="hermes") as port:
        for body in (
            {"model": "synthetic", "messages": ASK},
            {"messages": [{"role": "system", "content": "Be brief."}, *ASK], "tools": [CHAT_TOOL]},
            {"model": "synthetic", "prompt": "Once upon a time"},
        ):
            counted = await post(port, "/tokenize", body)
            assert counted.status == 200, counted.body
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            answered = await post(port, route, {**body, "max_tokens": 1})
            usage = answered.json()["usage"]
            assert counted.json()["count"] == usage["prompt_tokens"] == len(counted.json()["tokens"])
            assert counted.json()["max_model_len"] > counted.json()["count"]


async def test_the_torch_workers_tokenize_counts_its_templates_prompt():
    """The tiny torch model's chat template (tools and a tool conversation rendered) and tokenizer."""
    from tiny_workers import tiny_worker

    worker = await tiny_worker()
    try:
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
        for body in ({"model": "tiny", "messages": ASK}, {"messages": history, "tools": [CHAT_TOOL]}):
            counted = (await post(worker.port, "/tokenize", body)).json()
            usage = (await post(worker.port, "/v1/chat/completions", {**body, "max_tokens": 1})).json()[
                "usage"
            ]
            assert counted["count"] == usage["prompt_tokens"] == len(counted["tokens"]) > 0
            assert counted["max_model_len"] == worker.engine.max_context
    finally:
        await worker.server.cleanup()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other", "messages": ASK}, 404, "model"),
        ({"messages": "hello"}, 400, "messages"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
        ({"prompt": 7}, 400, "prompt"),
        ({"model": "synthetic"}, 400, "messages"),
        (b"[1, 2", 400, None),
    ],
)
async def test_a_malformed_tokenize_is_a_4xx_naming_the_field(body, status, param):
    async with worker(tool_call_parser="hermes") as port:
        error = assert_openai_error(await post(port, "/tokenize", body), status)
        assert param is None or error["param"] == param
        assert_openai_error(await get(port, "/tokenize"), 405)


@contextlib.asynccontextmanager
async def deployment(
    tmp_path: Path, urls: list[str] | None = None, **settings: Any
) -> AsyncIterator[tuple[AsyncAnthropic, int]]:
    """An orchestrator (one client key) before a context and a generation worker, or before ``urls``;
    ``settings``: more of its config (admission, max_body_bytes)."""
    from server.orchestrator.app import start_server
    from server.orchestrator.config import build_config

    async with contextlib.AsyncExitStack() as stack:
        if urls is None:
            ports = [await stack.enter_async_context(worker(role=role, tool_call_parser="hermes"))
                     for role in ("context", "generation")]  # fmt: skip
            urls = [f"127.0.0.1:{p}" for p in ports]
        keys = tmp_path / "keys"
        keys.write_text(f"{KEY} team-a\n")
        built = build_config({"port": 0, "health_check_interval_s": 0.2, "api_keys_file": str(keys),
                              "context_servers": {"urls": urls[:1]},
                              "generation_servers": {"urls": urls[1:] or urls}, **settings}, environ={})  # fmt: skip
        server, _ = await start_server(built)
        stack.push_async_callback(server.cleanup)
        port = server.sockets[0].getsockname()[1]
        client = AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0)
        stack.push_async_callback(client.close)
        for _ in range(200):
            if (await get(port, "/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        yield client, port


@pytest.mark.usefixtures("request_path")
async def test_count_tokens_is_the_prompt_a_message_is_given(tmp_path):
    async with deployment(tmp_path) as (client, _):
        for kw in ({}, {"system": "Be brief.", "tools": [WEATHER]}):
            counted = await client.messages.count_tokens(model="synthetic", messages=ASK, **kw)
            message = await client.messages.create(model="synthetic", max_tokens=5, messages=ASK, **kw)
            usage = message.usage
            assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0
        with_tools = await client.messages.count_tokens(model="synthetic", messages=ASK, tools=[WEATHER])
        plain = await client.messages.count_tokens(model="synthetic", messages=ASK)
        assert with_tools.input_tokens > plain.input_tokens


async def test_count_tokens_refusals_in_anthropics_shape(tmp_path):
    async with deployment(tmp_path) as (client, port):
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.count_tokens(
                model="synthetic", messages=[{"role": "wizard", "content": "x"}]
            )
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].role" in info.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError, match="image block"):
            await client.messages.count_tokens(model="synthetic", messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://x"}}]}])  # fmt: skip
        # the worker's own refusal (an unknown model: its 404), in Anthropic's shape
        with pytest.raises(anthropic.NotFoundError) as info:
            await client.messages.count_tokens(model="other", messages=ASK)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.AuthenticationError):
            await client.with_options(api_key="wrong").messages.count_tokens(model="synthetic", messages=ASK)
        key = {"x-api-key": KEY}
        for raw, field in ((b"{", "body"), (b"[" * 100_000, "body"), (b'{"messages": []}', "model"),
                           (b'{"model": "synthetic", "messages": [{"role": "user", "content": "\\ud800"}]}',
                            "messages[0].content")):  # fmt: skip
            resp = await post(port, "/v1/messages/count_tokens", raw, **key)
            assert resp.status == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.body
            assert field in resp.json()["error"]["message"] or field == "body"
        resp = await get(port, "/v1/messages/count_tokens", **{"x-api-key": KEY})
        assert resp.status == 405 and resp.json()["error"]["type"] == "invalid_request_error"
        resp = await post(port, "/v1/messages/batches", {}, **{"x-api-key": KEY})
        assert resp.status == 404 and resp.json()["error"]["type"] == "not_found_error"


async def test_count_tokens_without_a_worker_or_with_a_broken_one(tmp_path):
    """No healthy worker: a 503 overloaded_error with retry-after; a worker without /tokenize (a 404):
    a 404 saying so; a worker whose answer is no count: a 502 api_error."""
    async with deployment(tmp_path, urls=["127.0.0.1:9"]) as (client, _):
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.count_tokens(model="synthetic", messages=ASK)
        assert info.value.status_code == 503 and info.value.body["error"]["type"] == "overloaded_error"
        assert info.value.response.headers["retry-after"]
    for answer, status, kind in ((b'{"count": "many"}', 502, "api_error"),
                                 (b"not json", 502, "api_error"),
                                 (None, 404, "not_found_error")):  # fmt: skip
        async with broken_worker(answer) as url, deployment(tmp_path, urls=[url]) as (client, _):
            with pytest.raises(anthropic.APIStatusError) as info:
                await client.messages.count_tokens(model="synthetic", messages=ASK)
            assert info.value.status_code == status and info.value.body["error"]["type"] == kind
            if status == 404:
                assert "/tokenize" in info.value.body["error"]["message"]


@contextlib.asynccontextmanager
async def broken_worker(tokenize: bytes | None) -> AsyncIterator[str]:
    """A healthy synthetic worker whose /tokenize answers ``tokenize`` (None: a 404, no such route)."""
    from server.worker import app as worker_app

    original = worker_app.WorkerApp.handle

    async def handle(self: Any, request: Any, out: Any) -> None:
        if request.path == b"/tokenize":
            if tokenize is None:
                out.send(
                    404,
                    b'{"error": {"message": "no route /tokenize", "type": "x", "param": null, "code": "x"}}',
                )
            else:
                out.send(200, tokenize, b"application/json")
            return
        await original(self, request, out)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_app.WorkerApp, "handle", handle)
        async with worker() as port:
            yield f"127.0.0.1:{port}"


async def test_count_tokens_counts_against_the_tenants_request_rate(tmp_path):
    """A count is a request of its tenant (requests_per_minute): over it, a 429 rate_limit_error with
    retry-after; it runs no prompt through a model, so prompt_tokens_per_minute is not charged."""
    limits = {"team-a": {"requests_per_minute": 2}}
    async with deployment(tmp_path, admission={"rate_limits": limits}) as (client, _):
        for _ in range(2):
            assert (await client.messages.count_tokens(model="synthetic", messages=ASK)).input_tokens > 0
        with pytest.raises(anthropic.RateLimitError) as info:
            await client.messages.count_tokens(model="synthetic", messages=ASK)
        assert info.value.body["error"]["type"] == "rate_limit_error"
        assert "requests per minute" in info.value.body["error"]["message"]
        assert int(info.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError):  # one bucket: the messages of that tenant too
            await client.messages.create(model="synthetic", max_tokens=5, messages=ASK)
    limits = {"*": {"prompt_tokens_per_minute": 1}}
    async with deployment(tmp_path, admission={"rate_limits": limits}) as (client, _):
        for _ in range(3):
            assert (await client.messages.count_tokens(model="synthetic", messages=ASK)).input_tokens > 0
        with pytest.raises(anthropic.RateLimitError, match="never be admitted"):
            await client.messages.create(model="synthetic", max_tokens=5, messages=ASK)


async def test_count_tokens_holds_an_admission_slot_while_its_worker_counts(tmp_path):
    """A count holds one of max_inflight's slots while a worker tokenises: with one slot and no queue,
    a second count (or a message) meanwhile is a 429; the slot is free again once it answered."""
    asked, answer = asyncio.Event(), asyncio.Event()
    async with (
        held_tokenize(asked, answer) as url,
        deployment(tmp_path, urls=[url], admission={"max_inflight": 1, "max_queue": 0}) as (client, _),
    ):
        first = asyncio.ensure_future(client.messages.count_tokens(model="synthetic", messages=ASK))
        await asyncio.wait_for(asked.wait(), 10)
        with pytest.raises(anthropic.RateLimitError) as info:
            await client.messages.count_tokens(model="synthetic", messages=ASK)
        assert "admission queue is full" in info.value.body["error"]["message"]
        assert info.value.response.headers["retry-after"]
        with pytest.raises(anthropic.RateLimitError):
            await client.messages.create(model="synthetic", max_tokens=5, messages=ASK)
        answer.set()
        assert (await asyncio.wait_for(first, 10)).input_tokens > 0
        assert (await client.messages.count_tokens(model="synthetic", messages=ASK)).input_tokens > 0


async def test_a_count_tokens_body_over_max_body_bytes_is_a_413(tmp_path):
    """The body is bounded as /v1/messages' is: the HTTP layer's max_body_bytes, before any route."""
    async with deployment(tmp_path, max_body_bytes=4096) as (client, port):
        long = [{"role": "user", "content": "x" * 5000}]
        for path in ("/v1/messages/count_tokens", "/v1/messages"):
            resp = await post(port, path, {"model": "synthetic", "max_tokens": 5, "messages": long},
                              **{"x-api-key": KEY})  # fmt: skip
            assert resp.status == 413, resp.body
        assert (await client.messages.count_tokens(model="synthetic", messages=ASK)).input_tokens > 0


@contextlib.asynccontextmanager
async def held_tokenize(asked: asyncio.Event, answer: asyncio.Event) -> AsyncIterator[str]:
    """A synthetic worker whose /tokenize sets ``asked`` and answers once ``answer`` is set."""
    from server.worker import app as worker_app

    original = worker_app.WorkerApp.handle

    async def handle(self: Any, request: Any, out: Any) -> None:
        if request.path == b"/tokenize":
            asked.set()
            await answer.wait()
        await original(self, request, out)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_app.WorkerApp, "handle", handle)
        async with worker() as port:
            yield f"127.0.0.1:{port}"
