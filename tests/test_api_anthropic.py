"""Anthropic's Messages API at the orchestrator (issue 39 item 3; server/orchestrator/apis/anthropic.py):
the official ``anthropic`` SDK against a real orchestrator in front of scripted synthetic workers on
127.0.0.1 (a context and a generation worker: every request disaggregated), on both request paths
(callbacks and coroutines); the translation's refusals, each a 400 in Anthropic's shape naming the field."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic import AsyncAnthropic
from helpers import get, post

from server.orchestrator.apis.anthropic import API, MessageStream
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SYNTHETIC_EOS, SYNTHETIC_VOCAB, SyntheticEngine
from server.worker.synthetic_script import Script

#: a live test runs on both request paths (callbacks and coroutines)
LIVE = pytest.mark.usefixtures("request_path")

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
TOOLS = [WEATHER, CLOCK]
HERMES_TWO = (
    "I will look.\n<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
PLAIN = "It is sunny in Paris, 18 degrees. Enjoy the day!"
ASK = [{"role": "user", "content": "Weather and time?"}]
KEY = "sk-ant-test-key"


@contextlib.asynccontextmanager
async def deployment(
    answers: list[str], tmp_path: Path, **config: Any
) -> AsyncIterator[tuple[AsyncAnthropic, int]]:
    """A scripted context and generation worker (hermes parser) behind an orchestrator with one API key;
    the SDK's client of it and the orchestrator's port."""
    from server.orchestrator.app import start_server
    from server.orchestrator.config import build_config

    workers = []
    for role in ("context", "generation"):
        script = Script(answers, eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
        settings = WorkerSettings(role=role, model_name="synthetic", tool_call_parser="hermes")
        workers.append(await start_worker(SyntheticEngine(0, script=script), settings))
    (_, ctx_port), (_, gen_port) = workers
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} team-a\n")
    built = build_config({"port": 0, "health_check_interval_s": 0.2, "api_keys_file": str(keys), **config,
                          "context_servers": {"urls": [f"127.0.0.1:{ctx_port}"]},
                          "generation_servers": {"urls": [f"127.0.0.1:{gen_port}"]}}, environ={})  # fmt: skip
    server, _ = await start_server(built)
    port = server.sockets[0].getsockname()[1]
    client = AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0)
    try:
        for _ in range(200):
            if (await get(port, "/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        yield client, port
    finally:
        await client.close()
        await server.cleanup()
        for runner, _port in workers:
            await runner.cleanup()


def visible(message: Any) -> tuple[Any, ...]:
    blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]
    usage = message.usage  # the prompt's tokens (a repeated prompt's split into cached ones differs)
    return (message.stop_reason, message.stop_sequence, blocks,
            (usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens))  # fmt: skip


async def both_ways(client: AsyncAnthropic, **kw: Any) -> tuple[Any, Any, list[Any]]:
    """The unary message, the SDK's accumulation of the streamed one, and the stream's events."""
    kw = {"model": "synthetic", "max_tokens": 200, "messages": ASK, **kw}
    unary = await client.messages.create(**kw)
    async with client.messages.stream(**kw) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_message()
    return unary, final, events


@LIVE
async def test_text_unary_and_streamed_are_one_answer(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, _):
        unary, final, events = await both_ways(client, system="Be brief.", metadata={"user_id": "u1"},
                                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})  # fmt: skip
    assert visible(unary) == visible(final)
    assert visible(unary)[:3] == ("end_turn", None, [("text", PLAIN)])
    assert unary.usage.input_tokens > 0 and unary.usage.output_tokens > 0
    assert unary.id.startswith("msg_") and unary.role == "assistant" and unary.type == "message"
    kinds = [e.type for e in events if not e.type.startswith(("text", "input_json"))]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@LIVE
async def test_tool_use_and_tool_result_round_trip(tmp_path):
    async with deployment([HERMES_TWO, PLAIN], tmp_path) as (client, _):
        first = await client.messages.create(model="synthetic", max_tokens=300, messages=ASK, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "name", None)) for b in first.content] == [
            ("text", None), ("tool_use", "get_weather"), ("tool_use", "get_time")]  # fmt: skip
        assert first.content[1].input == {"city": "Paris"} and first.content[2].input == {}
        history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": first.content[1].id, "content": "18 C"},
                       {"type": "tool_result", "tool_use_id": first.content[2].id,
                        "content": [{"type": "text", "text": "noon"}], "is_error": False},
                       {"type": "text", "text": "Thanks"}]}]  # fmt: skip
        again = await client.messages.create(model="synthetic", max_tokens=300, messages=history, tools=TOOLS,
                                             tool_choice={"type": "auto"})  # fmt: skip
        assert visible(again)[:3] == ("end_turn", None, [("text", PLAIN)])


@LIVE
async def test_tool_use_streamed_as_the_sdk_accumulates_it(tmp_path):
    async with deployment([HERMES_TWO], tmp_path) as (client, _):
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, None):
            kw = {"tools": TOOLS} if choice is None else {"tools": TOOLS, "tool_choice": choice}
            unary, final, events = await both_ways(client, **kw)
            assert visible(unary) == visible(final)
            assert visible(unary)[0] == "tool_use"
            deltas = [e for e in events if e.type == "content_block_delta"]
            assert {e.delta.type for e in deltas} == {"text_delta", "input_json_delta"}


@LIVE
async def test_max_tokens_and_stop_sequences(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, _):
        unary, final, _ = await both_ways(client, max_tokens=3)
        assert visible(unary) == visible(final)
        assert unary.stop_reason == "max_tokens" and unary.content[0].text == PLAIN[:9]
        # one token: the context leg's answer is the whole answer, streamed whole by the orchestrator
        unary, final, _ = await both_ways(client, max_tokens=1)
        assert visible(unary) == visible(final) and visible(unary)[:3] == (
            "max_tokens",
            None,
            [("text", PLAIN[:3])],
        )
        unary, final, events = await both_ways(client, stop_sequences=["zz", "18"])
        assert visible(unary) == visible(final)
        # the worker names the stop string that matched (vLLM's stop_reason): the text cut before it
        assert visible(unary)[:3] == ("stop_sequence", "18", [("text", "It is sunny in Paris, ")])
        delta = next(e for e in events if e.type == "message_delta")
        assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", "18")
        # matched in the first token: the context leg's answer is the answer (streamed whole)
        unary, final, _ = await both_ways(client, stop_sequences=["t "])
        assert visible(unary) == visible(final)
        assert visible(unary)[:3] == ("stop_sequence", "t ", [("text", "I")])


@pytest.mark.parametrize("relay", ["parsed", "parsed-msgpack"])
async def test_the_matched_stop_sequence_through_the_parsed_relays(tmp_path, relay):
    """The generation worker's ``stop_reason`` survives the parsed relay modes (the fast relay's: above)."""
    async with deployment([PLAIN], tmp_path, relay=relay) as (client, _):
        unary, final, _ = await both_ways(client, stop_sequences=["18"])
    assert visible(unary) == visible(final)
    assert visible(unary)[:3] == ("stop_sequence", "18", [("text", "It is sunny in Paris, ")])


@LIVE
async def test_auth_failures_are_401s_in_anthropics_shape(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, port):
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            resp = await post(
                port, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": ASK}, **headers
            )
            assert resp.status == 401
            assert resp.json()["type"] == "error"
            assert resp.json()["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            await client.with_options(api_key="nope").messages.create(model="m", max_tokens=1, messages=ASK)
        # a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN) is a key too
        bearer = AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", auth_token=KEY, max_retries=0)
        answer = await bearer.messages.create(model="synthetic", max_tokens=5, messages=ASK)
        await bearer.close()
        assert answer.content[0].text == PLAIN[:15]


@LIVE
async def test_rate_limits_and_no_worker_in_anthropics_shape_with_retry_after(tmp_path):
    """The tenants' rate limit (admission: the coroutine path) applies to a translated request: its 429 is
    a rate_limit_error; no healthy worker is an overloaded_error; both carry retry-after."""
    limits = {"admission": {"rate_limits": {"team-a": {"requests_per_minute": 1}}}}
    async with deployment([PLAIN], tmp_path, **limits) as (client, _):
        await client.messages.create(model="synthetic", max_tokens=3, messages=ASK)
        with pytest.raises(anthropic.RateLimitError) as info:
            await client.messages.create(model="synthetic", max_tokens=3, messages=ASK)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "rate_limit_error"
        assert int(info.value.response.headers["retry-after"]) >= 1
    from server.orchestrator.app import start_server
    from server.orchestrator.config import build_config

    config = build_config({"port": 0, "context_servers": {"urls": ["127.0.0.1:9"]},
                           "generation_servers": {"urls": ["127.0.0.1:9"]}}, environ={})  # fmt: skip
    server, _ = await start_server(config)
    port = server.sockets[0].getsockname()[1]
    try:
        resp = await post(port, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": ASK})
        assert resp.status == 503 and resp.headers["retry-after"]
        assert resp.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                          "message": resp.json()["error"]["message"]}}  # fmt: skip
    finally:
        await server.cleanup()


@LIVE
async def test_a_workers_own_400_reaches_the_client_in_anthropics_shape(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, _):
        with pytest.raises(anthropic.BadRequestError) as info:  # our workers take at most 16 stop strings
            await client.messages.create(model="synthetic", max_tokens=3, messages=ASK,
                                         stop_sequences=[f"s{i}" for i in range(17)])  # fmt: skip
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert "stop" in info.value.body["error"]["message"]


GOOD = {"model": "m", "max_tokens": 10, "messages": ASK}
CALLED = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}],
    },
]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({k: v for k, v in GOOD.items() if k != "max_tokens"}, "max_tokens"),
        ({**GOOD, "max_tokens": "10"}, "max_tokens"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "max_tokens": True}, "max_tokens"),
        ({**GOOD, "model": 5}, "model"),
        ({**GOOD, "messages": []}, "messages"),
        ({**GOOD, "messages": "hi"}, "messages"),
        ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({**GOOD, "messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
        ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({**GOOD, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
        ({**GOOD, "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0].type"),
        ({**GOOD, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text"),
        # a tool_result without its tool_use: none before it, or another id
        ({**GOOD, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, "messages[0].content[0].tool_use_id"),
        ({**GOOD, "messages": [*CALLED, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]}, "messages[2].content[0].tool_use_id"),
        ({**GOOD, "messages": [*CALLED, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}]}]},
         "messages[2].content[0].content[0]"),
        ({**GOOD, "messages": [*CALLED, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": "yes"}]}]}, "messages[2].content[0].is_error"),
        ({**GOOD, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]}, "messages[0].content[0].input"),
        ({**GOOD, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0].type"),
        ({**GOOD, "system": 5}, "system"),
        ({**GOOD, "system": [{"type": "image"}]}, "system[0]"),
        ({**GOOD, "tools": {}}, "tools"),
        ({**GOOD, "tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name"),
        ({**GOOD, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({**GOOD, "tools": [{"name": "f", "input_schema": {}, "description": 1}]}, "tools[0].description"),
        ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({**GOOD, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({**GOOD, "tool_choice": "auto"}, "tool_choice.type"),
        ({**GOOD, "tools": [CLOCK], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({**GOOD, "tools": [CLOCK], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
         "tool_choice.disable_parallel_tool_use"),
        ({**GOOD, "stop_sequences": "END"}, "stop_sequences"),
        ({**GOOD, "stop_sequences": [""]}, "stop_sequences"),
        ({**GOOD, "temperature": 2}, "temperature"),
        ({**GOOD, "top_p": "1"}, "top_p"),
        ({**GOOD, "top_k": -1}, "top_k"),
        ({**GOOD, "stream": "yes"}, "stream"),
        ({**GOOD, "metadata": {"user": "x"}}, "metadata"),
        ({**GOOD, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({**GOOD, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({**GOOD, "output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ],
)  # fmt: skip
def test_every_malformed_field_is_a_400_naming_it(body, param):
    from server.errors import HTTPError

    with pytest.raises(HTTPError) as info:
        API.to_chat(json.dumps(body).encode(), None)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param and param in info.value.message


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b"", None, "empty"),
        (b"[1]", "body", "object"),
        (b'{"model": "m",}', "body", "byte 14"),
        (b"[" * 600 + b"]" * 600, "body", "deeper than the limit of 512"),
        (json.dumps({**GOOD, "messages": [{"role": "user", "content": "x\ud800"}]}).encode(),
         "messages[0].content", "lone surrogate"),
        (json.dumps({**GOOD, "tools": [{"name": "f", "input_schema": {"\udc00": 1}}]}).encode(),
         "tools[0].input_schema", "lone surrogate"),
        (b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "\xff"}]}', "body", "JSON"),
        # a repeated key where the texts are read (json.loads keeps the last; the scanner refuses it)
        (b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "a", "content": "b"}]}',
         "body", "duplicate key 'content'"),
    ],
)  # fmt: skip
def test_malformed_json_deep_nesting_and_lone_surrogates_are_400s(raw, param, words):
    from server.errors import HTTPError

    with pytest.raises(HTTPError) as info:
        API.to_chat(raw, None)  # type: ignore[arg-type]
    assert info.value.status == 400 and words in info.value.message
    if param is not None:
        assert (info.value.param or "").startswith(param)


@LIVE
async def test_malformed_bodies_reach_the_client_as_anthropic_400s(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, port):
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="synthetic", max_tokens=5, messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                          "data": "AAAA"}}]}])  # fmt: skip
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0]" in info.value.body["error"]["message"]
        for raw in (b"{", b"[" * 100_000, json.dumps({"model": "m", "messages": ASK}).encode()):
            resp = await post(port, "/v1/messages", raw, **{"x-api-key": KEY})
            assert resp.status == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        resp = await get(port, "/v1/messages", **{"x-api-key": KEY})
        assert resp.status == 405 and resp.json()["type"] == "error"
        # the routes under /v1/messages/ but count_tokens (tests/test_count_tokens.py): a 404 in its shape
        # saying why (key checked first)
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.batches.list()
        assert missing.value.body["error"]["type"] == "not_found_error"
        assert "count_tokens are served" in missing.value.body["error"]["message"]
        resp = await post(port, "/v1/messages/batches", {})
        assert resp.status == 401 and resp.json()["error"]["type"] == "authentication_error"
        # Claude Code's route (a query string) and headers
        resp = await post(port, "/v1/messages?beta=true", {"model": "synthetic", "max_tokens": 2, "messages": ASK},
                          **{"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "x"})  # fmt: skip
        assert resp.status == 200 and resp.json()["type"] == "message"


def test_the_request_as_chat():
    body = {"model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "B"}], "messages": [*CALLED, {"role": "user", "content": [
            {"type": "text", "text": "here"}, {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}]}],
            "tools": [CLOCK], "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "temperature": 0.2, "top_p": 0.5, "top_k": 3, "stream": True,
            "metadata": {"user_id": "u"}, "cache_control": {"type": "ephemeral"}, "service_tier": "auto"}  # fmt: skip
    chat = json.loads(API.to_chat(json.dumps(body).encode(), None).body)  # type: ignore[arg-type]
    assert chat == {
        "model": "m", "max_tokens": 7, "temperature": 0.2, "top_p": 0.5, "top_k": 3, "stop": ["END"],
        "stream": True, "stream_options": {"include_usage": True}, "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "A\nB"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"},  # before the user's text
            {"role": "user", "content": "here"}],
        "tools": [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK["input_schema"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }  # fmt: skip


def chat_stream(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


HEAD = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHUNKS = [
    {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"content": "Zürich ☀"}, "finish_reason": None}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {**HEAD, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                      "prompt_tokens_details": {"cached_tokens": 5}}},
]  # fmt: skip


def events_of(sse: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in sse.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_the_stream_cut_at_every_byte_gives_the_same_events():
    """Pieces may split anywhere (mid-line, mid-UTF-8 character): the same events as the whole stream."""
    sse = chat_stream(CHUNKS)
    call = API.to_chat(json.dumps(GOOD).encode(), None)  # type: ignore[arg-type]
    whole = MessageStream(call)
    expected = whole.feed(sse) + whole.flush()
    for cut in range(1, len(sse)):
        stream = MessageStream(call)
        assert stream.feed(sse[:cut]) + stream.feed(sse[cut:]) + stream.flush() == expected
    stream, out = MessageStream(call), b""
    for i in range(len(sse)):
        out += stream.feed(sse[i : i + 1])
    assert out + stream.flush() == expected
    events = events_of(expected)
    assert [k for k, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Zürich ☀"}
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 5}}  # fmt: skip


def test_a_stream_the_worker_cut_ends_with_an_error_event():
    call = API.to_chat(json.dumps(GOOD).encode(), None)  # type: ignore[arg-type]
    for sse in (
        chat_stream(CHUNKS[:2])[: -len(b"data: [DONE]\n\n")]
        + b'data: {"error": {"message": "its worker failed"}}\n\n',
        b"data: not json\n\n",
        b"",
    ):
        stream = MessageStream(call)
        events = events_of(stream.feed(sse) + stream.flush())
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
        assert "message_stop" not in [k for k, _ in events]
    stream = MessageStream(call)  # a stream that ends without [DONE]: closed as it stands
    events = events_of(stream.feed(chat_stream(CHUNKS[:2])[: -len(b"data: [DONE]\n\n")]) + stream.flush())
    assert [k for k, _ in events][-2:] == ["message_delta", "message_stop"]


def test_a_chat_answer_that_is_none_is_a_502_in_anthropics_shape():
    from server.orchestrator.apis import ApiResponder

    class Out:
        def send(self, status, body, content_type=b"application/json", headers=b""):
            self.sent = (status, json.loads(body), headers)

    out = Out()
    call = API.to_chat(json.dumps(GOOD).encode(), None)  # type: ignore[arg-type]
    ApiResponder(out, API, call).send(200, b'{"choices": "none"}')  # type: ignore[arg-type]
    assert out.sent[0] == 502 and out.sent[1]["error"]["type"] == "api_error"
    ApiResponder(out, API, call).send(
        200,
        b'{"choices": [{"message": {"tool_calls": [{"id": "c", "function": '
        b'{"name": "f", "arguments": "[1]"}}]}}]}',
    )  # type: ignore[arg-type]
    assert out.sent[0] == 502
    ApiResponder(out, API, call).send_error(429, "slow down", headers=b"Retry-After: 3\r\n")  # type: ignore[arg-type]
    assert out.sent == (429, {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
                        b"Retry-After: 3\r\n")  # fmt: skip
    ApiResponder(out, API, call).send(400, b"not json")  # type: ignore[arg-type]
    assert out.sent[:2] == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "not json"}},
    )


def test_the_translation_benchmark_runs_and_its_body_is_served_as_chat():
    """bench.api_translation's Messages body (the agentic history in Anthropic's blocks) translates to the
    chat body's own texts, spliced as the client's bytes (escapes kept), and the benchmark's table comes out."""
    from bench.api_translation import messages_body, run
    from bench.workload import agentic_messages

    history = [*agentic_messages(300), {"role": "user", "content": 'quote " back\\slash \n é 😀'}]
    chat = json.loads(API.to_chat(messages_body(history), None).body)  # type: ignore[arg-type]
    texts = [m["content"] for m in chat["messages"] if m["role"] != "assistant"]
    assert texts == [m["content"] for m in history if m["role"] != "assistant"]
    assert "messages (anthropic)" in run([50])


def test_a_tool_result_without_content_is_an_empty_tool_message():
    body = {
        **GOOD,
        "messages": [
            *CALLED,
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        ],
    }
    chat = json.loads(API.to_chat(json.dumps(body).encode(), None).body)  # type: ignore[arg-type]
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": ""}
