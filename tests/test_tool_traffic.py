"""Tool traffic through the orchestrator on every relay mode (issue 39 item 2): a tool history
round trip (``tools`` with a deep schema, ``tool_choice``, ``parallel_tool_calls``, ``developer`` and
``tool`` messages, an assistant message with ``tool_calls`` and content null) reaches the generation
worker intact, and the worker's ``tool_calls`` reach the client, unary and streamed: relay ``fast``,
``parsed`` and ``parsed-msgpack`` x our scripted synthetic workers (hermes parser) and trtllm-serve
stand-ins (tests/trtllm_standin.py) x both gates off and on. With ``gen_strip_message_history`` the
generation leg keeps what the worker needs: the tools, the choice and the last message."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from helpers import until
from trtllm_standin import start_standin

import server.worker.request as worker_request
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SYNTHETIC_EOS, SYNTHETIC_VOCAB, SyntheticEngine
from server.worker.synthetic_script import Script

#: a schema nesting 300 levels (JSON_MAX_DEPTH is 512): what a scan does not need, skipped at any depth;
#: past pydantic's 255 levels, which the parsed modes' dumps could not write (a 500)
DEEP: dict[str, Any] = {"type": "string", "enum": ["Paris", "Zürich", None]}
for _ in range(150):
    DEEP = {"type": "object", "properties": {"inner": DEEP}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'The weather "now" in a city \u00e9\u4e2d',
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "deep": DEEP},
            "required": ["city"],
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "developer", "content": "Use the tools."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}], "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]  # fmt: skip
TOOL_FIELDS = {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True}
CALL = {"name": "get_weather", "arguments": {"city": "Zürich"}}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TRTLLM_CALL = {"id": "chatcmpl-tool-1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}  # fmt: skip
RELAYS = ["fast", "parsed", "parsed-msgpack"]
GATES = {"gates_off": (False, False), "gates_on": (True, True)}


@contextlib.asynccontextmanager
async def deployment(
    workers: str, relay: str, gates: tuple[bool, bool], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[int, list[dict[str, Any]]]]:
    """An orchestrator before a context and a generation worker; its port and the generation legs'
    bodies as the worker read them."""
    generation_bodies: list[dict[str, Any]] = []
    stops = []
    if workers == "ours":
        read = worker_request.read_request

        def recording(body: dict[str, Any], route: Any, **kw: Any) -> Any:
            params = body.get("disaggregated_params") or {}
            if params.get("request_type") == "generation_only":
                generation_bodies.append(body)
            return read(body, route, **kw)

        monkeypatch.setattr(worker_request, "read_request", recording)
        ports = []
        for role in ("context", "generation"):
            script = Script([HERMES], eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
            settings = WorkerSettings(role=role, model_name="tiny", tool_call_parser="hermes")
            runner, port = await start_worker(SyntheticEngine(0, script=script), settings)
            stops.append(runner.cleanup)
            ports.append(port)
        urls = [f"127.0.0.1:{p}" for p in ports]
    else:
        registry: dict[int, list[int]] = {}
        ctx = await start_standin("context", kv_registry=registry)
        gen = await start_standin("generation", kv_registry=registry, tool_calls=[TRTLLM_CALL])
        stops += [ctx.stop, gen.stop]
        urls = [ctx.address, gen.address]
    config = build_config({
        "port": 0, "health_check_interval_s": 0.2, "relay": relay,
        "gen_tokids_ctxbytes": gates[0], "gen_strip_message_history": gates[1],
        "context_servers": {"urls": [urls[0]]}, "generation_servers": {"urls": [urls[1]]},
    }, environ={})  # fmt: skip
    server, orch = await start_server(config)
    try:
        await until(lambda: orch.generation_pool.healthy_count() == 1 and orch.context_pool.ready, 10.0)
        port = server.sockets[0].getsockname()[1]
        if workers == "trtllm":
            yield port, generation_bodies
            generation_bodies += [r.body for r in gen.received() if r.path == "/v1/chat/completions"]
        else:
            yield port, generation_bodies
    finally:
        await server.cleanup()
        for stop in stops:
            await stop()


async def ask(port: int, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The answer's tool calls (arguments loaded) and finish reason, unary or assembled from the stream."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            if not body.get("stream"):
                choice = (await r.json())["choices"][0]
                calls = choice["message"].get("tool_calls") or []
                return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                        for c in calls], choice["finish_reason"]  # fmt: skip
            text = (await r.read()).decode()
    assembled: dict[int, dict[str, str]] = {}
    finish = None
    for line in text.split("\n"):
        if not line.startswith("data: ") or line.strip() == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            finish = choice.get("finish_reason") or finish
            for piece in choice["delta"].get("tool_calls") or []:
                call = assembled.setdefault(piece["index"], {"name": "", "arguments": ""})
                call["name"] += piece.get("function", {}).get("name") or ""
                call["arguments"] += piece.get("function", {}).get("arguments") or ""
    return [
        {"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(assembled.items())
    ], finish


@pytest.mark.parametrize("gates", list(GATES.values()), ids=list(GATES))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("workers", ["ours", "trtllm"])
@pytest.mark.parametrize("relay", RELAYS)
async def test_a_tool_round_trip_arrives_intact_and_its_calls_come_back(
    relay: str, workers: str, stream: bool, gates: tuple[bool, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": "tiny", "messages": HISTORY, "max_tokens": 64, "stream": stream, **TOOL_FIELDS}
    async with deployment(workers, relay, gates, monkeypatch) as (port, seen):
        calls, finish = await ask(port, body)
    assert (calls, finish) == ([CALL], "tool_calls")
    assert len(seen) == 1
    got = seen[0]
    for name, value in TOOL_FIELDS.items():
        assert got[name] == value, name
    assert got["messages"] == (HISTORY[-1:] if gates[1] else HISTORY)


# -- the relay modes themselves, both fastcore twins: every tool member at any depth, to the leg and back


def _modes(relay_twin: Any, tokids: bool, strip: bool) -> list[Any]:
    from relay_mode_inputs import fast_relay_class

    from server.orchestrator.relay_modes import ParsedMsgpackRelay, ParsedRelay

    gates = {"tokids_b64": tokids, "strip_history": strip}
    return [fast_relay_class(relay_twin)(**gates), ParsedRelay(**gates), ParsedMsgpackRelay(**gates)]


def _nested(levels: int) -> Any:
    value: Any = {"leaf": [None, 1.5, "é", True]}
    for i in range(levels):
        value = [value, None] if i % 2 else {"k": value, "n": None}
    return value


@pytest.mark.parametrize("strip", [False, True], ids=["history", "strip"])
@pytest.mark.parametrize("tokids", [False, True], ids=["ids", "b64"])
def test_every_mode_keeps_the_tool_members_at_any_depth(relay_twin, tokids, strip):
    from relay_mode_inputs import context_response

    deep = _nested(400)
    tools = [
        {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "object", "x-deep": deep}}}
    ]
    history = [*HISTORY[:-1], {**HISTORY[-1], "content": None, "x-extra": {"a": [deep]}}]
    fields = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "parallel_tool_calls": False}  # fmt: skip
    body = json.dumps({"model": "tiny", "messages": history, "max_tokens": 8, **fields}).encode()
    ctx = context_response(True, b64=tokids)
    calls = [
        {**TRTLLM_CALL, "x-deep": deep},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    answer = json.dumps({"id": "chatcmpl-9", "object": "chat.completion", "created": 1, "model": "tiny",
                         "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                             "role": "assistant", "content": None, "tool_calls": calls}}]}).encode()  # fmt: skip
    for mode in _modes(relay_twin, tokids, strip):
        req = mode.read_client(body, True)
        leg = mode.generation_request(req, mode.read_context(req, ctx))
        got = msgspec.msgpack.decode(leg) if mode.leg_headers else json.loads(leg)
        assert {name: got[name] for name in fields} == fields, type(mode)
        assert got["messages"] == (history[-1:] if strip else history), type(mode)
        message = json.loads(mode.client_answer(req, answer))["choices"][0]["message"]
        assert message == {"role": "assistant", "content": None, "tool_calls": calls}, type(mode)
