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

pytestmark = pytest.mark.usefixtures("request_path")

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
async def deployment(answers: list[str], tmp_path: Path, **config: Any) -> AsyncIterator[tuple[AsyncAnthropic, int]]:
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


async def test_tool_use_streamed_as_the_sdk_accumulates_it(tmp_path):
    async with deployment([HERMES_TWO], tmp_path) as (client, _):
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, None):
            kw = {"tools": TOOLS} if choice is None else {"tools": TOOLS, "tool_choice": choice}
            unary, final, events = await both_ways(client, **kw)
            assert visible(unary) == visible(final)
            assert visible(unary)[0] == "tool_use"
            deltas = [e for e in events if e.type == "content_block_delta"]
            assert {e.delta.type for e in deltas} == {"text_delta", "input_json_delta"}


async def test_max_tokens_and_stop_sequences(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, _):
        unary, final, _ = await both_ways(client, max_tokens=3)
        assert visible(unary) == visible(final)
        assert unary.stop_reason == "max_tokens" and unary.content[0].text == PLAIN[:9]
        unary, final, _ = await both_ways(client, stop_sequences=["18"])
        assert visible(unary) == visible(final)
        # our workers do not say which stop string matched (vLLM's stop_reason): end_turn, the text cut
        assert unary.content[0].text == "It is sunny in Paris, "


async def test_auth_failures_are_401s_in_anthropics_shape(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, port):
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            resp = await post(port, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": ASK}, **headers)
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
