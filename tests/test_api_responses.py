"""OpenAI's Responses API (issue 39 item 4): the translation to one chat completion and back
(request -> chat body, chat answer -> response, the chat SSE cut anywhere -> the same Responses
events), the bounded per-tenant store, and the official ``openai`` SDK against a real orchestrator
in front of scripted synthetic workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_openai_error, get, post
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from server.errors import HTTPError
from server.orchestrator.apis.responses import (
    API,
    EventTranslator,
    ResponsesApi,
    answer_messages,
    response_object,
)
from server.orchestrator.apis.responses_request import read_request, with_history
from server.orchestrator.apis.responses_store import (
    ResponseStore,
    previous_history,
    refuse_store,
    stored_or_404,
)
from server.orchestrator.config import ResponsesStoreConfig
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SYNTHETIC_EOS, SYNTHETIC_VOCAB, SyntheticEngine
from server.worker.synthetic_script import Script

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


def test_a_string_input_instructions_tools_and_sampling_become_one_chat_body():
    request = read_request({"model": "m", "input": "Hi", "instructions": "Be brief.", "tools": [WEATHER],
                            "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0.5,
                            "top_p": 0.9, "max_output_tokens": 7, "parallel_tool_calls": False})  # fmt: skip
    assert request.chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "stream": False,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 7,
    }
    assert not request.stream and request.store is None and request.previous_response_id is None
    assert "tool_choice" not in read_request({"model": "m", "input": "Hi", "tool_choice": "auto"}).chat
    streamed = read_request({"model": "m", "input": "Hi", "stream": True})
    assert streamed.chat["stream_options"] == {"include_usage": True} and streamed.stream


def test_items_become_chat_messages_calls_joining_their_assistant_turn():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "and time?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}", "id": "fc_1",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]  # fmt: skip
    messages = read_request({"model": "m", "input": items}).chat["messages"]
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]  # fmt: skip
    call = [{"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"}]
    assert read_request({"model": "m", "input": call}).chat["messages"] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]  # fmt: skip


MALFORMED = [
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f" * 65}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                               "arguments": "[" * 100_000 + "]" * 100_000}]}, "input[0].arguments"),
    ([], "body"),
    ({"input": "x"}, "model"),
    ({"model": 3, "input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 3}, "input"),
    ({"model": "m", "input": [3]}, "input[0]"),
    ({"model": "m", "input": [{"type": "reasoning"}]}, "input[0].type"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]},
     "input[0].content[0].text"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0].type"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": 1, "arguments": "{}"}]},
     "input[0].name"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"model": "m", "input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input[0].call_id"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                              {"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[1].output"),
    ({"model": "m", "input": "x", "instructions": ["x"]}, "instructions"),
    ({"model": "m", "input": "x", "tools": {}}, "tools"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]},
     "tools[0].parameters"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"model": "m", "input": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "input": "x", "top_p": True}, "top_p"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "max_output_tokens": 1.5}, "max_output_tokens"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "input": "x", "store": 1}, "store"),
    ({"model": "m", "input": "x", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"model": "m", "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"model": "m", "input": "x", "metadata": {"a": 1}}, "metadata"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.type"),
    ({"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"model": "m", "input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "input": "x", "frobnicate": 1}, "frobnicate"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), MALFORMED)
def test_every_malformed_body_is_a_400_naming_its_field(body, param):
    with pytest.raises(HTTPError) as info:
        read_request(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_a_tool_result_may_answer_the_previous_responses_call():
    body = {"model": "m", "previous_response_id": "resp_1", "instructions": "Be brief.",
            "input": [{"type": "function_call_output", "call_id": "c1", "output": "18 C"}]}  # fmt: skip
    request = read_request(body)
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]  # fmt: skip
    with pytest.raises(HTTPError) as info:
        with_history(request, history[:1])
    assert info.value.param == "input[0].call_id"
    with_history(request, history)
    assert request.chat["messages"] == [{"role": "system", "content": "Be brief."}, *history,
                                        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]  # fmt: skip


# ------------------------------------------------------------------ the answer, unary and streamed

CHAT_ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "I will look.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}}],
    "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
              "prompt_tokens_details": {"cached_tokens": 16}},
}  # fmt: skip


def chat_sse(answer: dict[str, Any]) -> bytes:
    """The chat stream our workers send for ``answer``: the role, text in pieces, each call's head
    then its arguments in fragments, the finish, the usage chunk, [DONE]."""
    choice = answer["choices"][0]
    message = choice["message"]
    chunks: list[dict[str, Any]] = [{"delta": {"role": "assistant", "content": ""}}]
    text = message.get("content") or ""
    chunks += [{"delta": {"content": text[i : i + 3]}} for i in range(0, len(text), 3)]
    for index, call in enumerate(message.get("tool_calls") or ()):
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}  # fmt: skip
        chunks.append({"delta": {"tool_calls": [head]}})
        arguments = call["function"]["arguments"]
        for i in range(0, len(arguments), 4):
            piece = {"index": index, "function": {"arguments": arguments[i : i + 4]}}
            chunks.append({"delta": {"tool_calls": [piece]}})
    chunks.append({"delta": {}, "finish_reason": choice["finish_reason"]})
    events = [{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, **c}]} for c in chunks]
    events.append({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": answer["usage"]})
    return b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events) + b"data: [DONE]\n\n"


def normalised(data: bytes) -> bytes:
    """Item ids in order of appearance (each translator makes its own)."""
    names: dict[bytes, bytes] = {}
    data = re.sub(rb'"created_at": ?\d+', b'"created_at": 0', data)
    return re.sub(
        rb"(msg|fc|call)_[0-9a-f]{16,32}",
        lambda m: names.setdefault(m.group(0), b"item%d" % len(names)),
        data,
    )


def events_of(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    return json.loads(normalised(json.dumps(response).encode()))


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_the_stream_cut_anywhere_gives_the_same_events_and_the_unary_response(finish):
    answer = json.loads(json.dumps(CHAT_ANSWER))
    answer["choices"][0]["finish_reason"] = finish
    request = read_request({"model": "m", "input": "Weather?", "tools": [WEATHER, CLOCK], "stream": True})
    sse = chat_sse(answer).replace(b"\n\n", b"\r\n\r\n", 2) + b": a comment\n\n"

    def translate(cuts: list[int]) -> bytes:
        translator = EventTranslator(request, "resp_1")
        out, start = [translator.start()], 0
        for cut in [*cuts, len(sse)]:
            out.append(translator.feed(sse[start:cut]))
            start = cut
        return normalised(b"".join(out) + translator.close())

    whole = translate([])
    assert all(translate([cut]) == whole for cut in range(1, len(sse)))
    assert translate(list(range(1, len(sse)))) == whole
    events = events_of(whole)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    last = "response.completed" if finish == "tool_calls" else "response.incomplete"
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    assert kinds[-1] == last and "response.output_text.done" in kinds
    assert (
        kinds.count("response.output_item.done") == 3
        and kinds.count("response.function_call_arguments.done") == 2
    )
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"city": "Paris"}{}'
    final = events[-1]["response"]
    unary = response_object(
        read_request({"model": "m", "input": "Weather?", "tools": [WEATHER, CLOCK]}), answer
    )
    assert without_ids(final) == without_ids(unary) | {"id": "resp_1"}
    assert unary["usage"] == {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 16},
                              "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 42}  # fmt: skip
    kinds_out = [(i["type"], i["status"]) for i in unary["output"]]
    tail = "incomplete" if finish == "length" else "completed"
    assert kinds_out == [("message", "completed"), ("function_call", "completed"), ("function_call", tail)]
    assert unary["status"] == ("completed" if finish == "tool_calls" else "incomplete")
    assert answer_messages(unary) == [{"role": "assistant", **{k: v for k, v in
                                       answer["choices"][0]["message"].items() if k != "role"}}]  # fmt: skip


def test_a_broken_or_cut_chat_stream_is_response_failed_and_a_broken_answer_a_502():
    request = read_request({"model": "m", "input": "x", "stream": True})
    for data in (b'data: {"error": {"message": "worker gone", "code": "bad_gateway"}}\n\n',
                 b"data: {not json\n\n", b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}\n\n',
                 b'data: {"choices": [{"delta": {"content": "\\ud800"}}]}\n\n',
                 b'data: {"choices": [{"delta": {"content": "par"}}]}\n\n'):  # fmt: skip
        translator = EventTranslator(request)
        events = events_of(translator.start() + translator.feed(data) + translator.close())
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
        assert events[-1]["response"]["error"]["message"]
        assert translator.feed(b"data: [DONE]\n\n") == b"" and translator.close() == b""
    for answer in ({}, {"choices": []}, {"choices": [{"message": {"tool_calls": [{"id": "x"}]}}]}):
        with pytest.raises(ValueError, match="malformed"):  # the hook's 502
            response_object(request, answer)


# ------------------------------------------------------------------ the store


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def stored_response(rid: str, text: str = "x") -> dict[str, Any]:
    return {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_the_store_is_bounded_per_tenant_and_never_crosses_tenants():
    clock = Clock()
    store = ResponseStore(ResponsesStoreConfig(max_entries=2, max_bytes=400, ttl_s=10), clock)
    for rid in ("r1", "r2", "r3"):
        assert store.put("a", stored_response(rid), [{"role": "user", "content": rid}])
    assert store.get("a", "r1") is None and store.get("a", "r2") and store.get("a", "r3")  # entries
    assert store.get("b", "r2") is None and not store.delete("b", "r2")  # another tenant's
    with pytest.raises(HTTPError) as info:
        stored_or_404(store, "b", "r2")
    assert info.value.status == 404
    assert not store.put("b", stored_response("big", "y" * 400), [])  # past the whole bound: not kept
    store.put("b", stored_response("b1", "y" * 150), [])
    store.put("b", stored_response("b2", "y" * 150), [])
    assert store.get("b", "b1") is None and store.get("b", "b2")  # bytes
    assert store.get("a", "r2")  # b's bytes never evict a's
    clock.now = 10.0
    assert store.get("a", "r2") is None  # ttl
    store.sweep()
    assert not any(store._tenants.values()) and not any(store._bytes.values())
    store.put("a", stored_response("r4"), [{"role": "user", "content": "hi"}])
    assert previous_history(store, "a", "r4") == [{"role": "user", "content": "hi"}]
    assert store.delete("a", "r4") and store.get("a", "r4") is None
    with pytest.raises(HTTPError) as info:
        previous_history(store, "a", "r4")
    assert (info.value.status, info.value.param, "r4" in info.value.message) == (
        400,
        "previous_response_id",
        True,
    )


def test_store_and_previous_response_id_are_refused_when_the_store_is_off():
    for call in (lambda: previous_history(None, "a", "r1"), lambda: refuse_store(None, True)):
        with pytest.raises(HTTPError) as info:
            call()
        assert info.value.status == 400 and "responses_store" in info.value.message
    refuse_store(None, None)
    refuse_store(None, False)


# ------------------------------------------------------------------ the openai SDK, end to end

HERMES_TWO = (
    "I will look.\n<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
PLAIN = "It is sunny in Paris, 18 degrees."
KEY = "sk-test-key"


@contextlib.asynccontextmanager
async def deployment(
    answers: list[str], tmp_path: Path, **config: Any
) -> AsyncIterator[tuple[AsyncOpenAI, int]]:
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
    keys.write_text(f"{KEY} team-a\nsk-other team-b\n")
    built = build_config({"port": 0, "health_check_interval_s": 0.2, "api_keys_file": str(keys), **config,
                          "context_servers": {"urls": [f"127.0.0.1:{ctx_port}"]},
                          "generation_servers": {"urls": [f"127.0.0.1:{gen_port}"]}}, environ={})  # fmt: skip
    server, _ = await start_server(built)
    port = server.sockets[0].getsockname()[1]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
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


def comparable(response: Any) -> dict[str, Any]:
    """A response without what each request makes anew (ids, times, the prefix cache's hits)."""
    response = without_ids(response.model_dump(exclude_none=True) | {"id": "resp", "created_at": 0})
    response["usage"].pop("input_tokens_details")
    return response


async def both_ways(client: AsyncOpenAI, **kw: Any) -> tuple[Any, Any, list[Any]]:
    """The unary response, the SDK's accumulation of the streamed one, and the stream's events."""
    kw = {"model": "synthetic", "tools": [WEATHER, CLOCK], **kw}
    unary = await client.responses.create(**kw)
    async with client.responses.stream(**kw) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    return unary, final, events


@pytest.mark.usefixtures("request_path")
@pytest.mark.parametrize(
    "relay", [{}, {"relay": "fast", "gen_tokids_ctxbytes": True, "gen_strip_message_history": True},
              {"relay": "parsed"}, {"relay": "parsed-msgpack", "gen_tokids_ctxbytes": True}],
)  # fmt: skip
async def test_the_sdk_unary_and_streamed_agree_through_a_function_call_round_trip(tmp_path, relay):
    async with deployment([HERMES_TWO, HERMES_TWO, PLAIN, PLAIN], tmp_path, **relay) as (client, _):
        ask = [{"role": "user", "content": "Weather and time?"}]
        unary, final, events = await both_ways(client, input=ask, instructions="Be brief.")
        assert comparable(unary) == comparable(final)
        assert unary.status == "completed" and unary.output_text == "I will look."
        calls = [(i.type, i.name, json.loads(i.arguments)) for i in unary.output if i.type == "function_call"]
        assert calls == [
            ("function_call", "get_weather", {"city": "Paris"}),
            ("function_call", "get_time", {}),
        ]
        assert unary.usage.input_tokens > 0 and unary.usage.output_tokens > 0
        assert unary.usage.input_tokens_details.cached_tokens >= 0
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert {"response.output_text.delta", "response.function_call_arguments.delta"} <= set(kinds)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # the round trip: the answer's items fed back with each call's output
        outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": "18 C" if i.name == "get_weather"
                    else "noon"} for i in unary.output if i.type == "function_call"]  # fmt: skip
        history = [*ask, *(i.model_dump(exclude_none=True) for i in unary.output), *outputs]
        again, again_final, _ = await both_ways(client, input=history)
        assert again.output_text == again_final.output_text == PLAIN
        assert comparable(again) == comparable(again_final) and again.status == "completed"


async def test_max_output_tokens_is_an_incomplete_response(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, _):
        unary = await client.responses.create(model="synthetic", input="Weather?", max_output_tokens=4)
        assert unary.status == "incomplete" and unary.incomplete_details.reason == "max_output_tokens"
        assert (
            PLAIN.startswith(unary.output_text)
            and unary.output_text != PLAIN
            and unary.usage.output_tokens == 4
        )
        events = [e async for e in await client.responses.create(model="synthetic", input="Weather?",
                                                                     max_output_tokens=4, stream=True)]  # fmt: skip
        assert events[-1].type == "response.incomplete"
        assert comparable(events[-1].response) == comparable(unary)


STREAMING_HOSTILE = [
    (b"{not json", "body"),
    (b'{"model": "synthetic", "input": "\\ud800"}', "input"),
    (b'{"model": "synthetic", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    (json.dumps({"model": "synthetic", "input": [{"role": "user", "content": [{"type": "input_file"}]}]}).encode(),
     "input[0].content[0].type"),
    (json.dumps({"model": "synthetic", "input": "x", "tools": [{"type": "file_search"}]}).encode(), "tools[0].type"),
    (json.dumps({"model": "synthetic", "input": "x", "store": True}).encode(), "store"),
    (json.dumps({"model": "synthetic", "input": "x", "previous_response_id": "resp_1"}).encode(),
     "previous_response_id"),
]  # fmt: skip


async def test_malformed_bodies_and_the_store_off_are_400s_in_openais_shape(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, port):
        for body, param in STREAMING_HOSTILE:
            resp = await post(port, "/v1/responses", body, authorization=f"Bearer {KEY}")
            error = assert_openai_error(resp, 400)
            assert error["param"] == param, error
        with pytest.raises(BadRequestError) as info:
            await client.responses.create(model="synthetic", input="x", store=True)
        assert "responses_store" in str(info.value)
        resp = await post(
            port, "/v1/responses", {"model": "synthetic", "input": "x"}, authorization="Bearer nope"
        )
        assert assert_openai_error(resp, 401)


def test_the_api_keeps_answers_per_tenant_and_goes_on_from_them():
    """ResponsesApi with a store: a unary and a streamed answer kept for their tenant, a
    previous_response_id going on from the conversation (its call answered), another tenant's a 400."""
    store = ResponseStore(ResponsesStoreConfig())
    api = ResponsesApi(store)
    body = {"model": "m", "input": "Weather?", "instructions": "Be brief.", "tools": [WEATHER, CLOCK]}
    call = api.to_chat(json.dumps(body).encode(), None, "a")  # type: ignore[arg-type]
    first = json.loads(call.answer(json.dumps(CHAT_ANSWER).encode()))
    assert first["store"] is True and store.get("a", first["id"])
    again = {"model": "m", "previous_response_id": first["id"], "instructions": "Be brief.",
             "input": [{"type": "function_call_output", "call_id": "call_a", "output": "18 C"}], "stream": True}  # fmt: skip
    with pytest.raises(HTTPError) as info:
        api.to_chat(json.dumps(again).encode(), None, "b")  # type: ignore[arg-type]
    assert info.value.param == "previous_response_id" and first["id"] in info.value.message
    call = api.to_chat(json.dumps(again).encode(), None, "a")  # type: ignore[arg-type]
    messages = json.loads(call.body)["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1:] == [{"role": "user", "content": "Weather?"}, *answer_messages(first),
                            {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}]  # fmt: skip
    translator = call.stream()
    sse = chat_sse(CHAT_ANSWER)
    events = events_of(translator.feed(sse[:50]) + translator.feed(sse[50:]) + translator.flush())
    final = events[-1]["response"]
    assert events[0]["response"]["store"] is True and final["store"] is True
    assert final["previous_response_id"] == first["id"] and store.get("a", final["id"])
    unstored = api.to_chat(json.dumps({**body, "store": False}).encode(), None, "a")  # type: ignore[arg-type]
    assert json.loads(unstored.answer(json.dumps(CHAT_ANSWER).encode()))["store"] is False
    assert len(store._tenants["a"]) == 2
    for hostile in (
        b"{",
        b"[" * 100_000,
        b'{"model": "m", "input": ["\\udfff"]}',
        b'{"model": "m", "input": "x", "metadata": {"\\ud800": "v"}}',
        b"[]",
    ):
        with pytest.raises(HTTPError) as info:
            api.to_chat(hostile, None, "a")  # type: ignore[arg-type]
        assert info.value.status == 400
    with pytest.raises(ValueError):
        call.answer(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.usefixtures("request_path")
async def test_stored_responses_through_the_sdk_per_tenant(tmp_path):
    """responses_store on: a call answered, then previous_response_id with only its outputs; GET and
    DELETE by id; another tenant reads, chains from and deletes none of them."""
    store = {"responses_store": {"max_entries": 8, "max_bytes": 1 << 20, "ttl_s": 60}}
    async with deployment([HERMES_TWO, PLAIN], tmp_path, **store) as (client, port):
        first = await client.responses.create(
            model="synthetic", input="Weather and time?", tools=[WEATHER, CLOCK]
        )
        assert first.store is True and [i.type for i in first.output][1:] == [
            "function_call",
            "function_call",
        ]
        outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": "ok"}
                   for i in first.output if i.type == "function_call"]  # fmt: skip
        async with client.responses.stream(model="synthetic", previous_response_id=first.id, input=outputs,
                                           tools=[WEATHER, CLOCK]) as stream:  # fmt: skip
            second = await stream.get_final_response()
        assert second.output_text == PLAIN and second.previous_response_id == first.id
        assert comparable(await client.responses.retrieve(second.id)) == comparable(second)
        other = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-other", max_retries=0)
        try:
            with pytest.raises(BadRequestError) as info:
                await other.responses.create(
                    model="synthetic", previous_response_id=first.id, input="and now?"
                )
            assert first.id in str(info.value)
            for path in (f"/v1/responses/{first.id}",):
                assert_openai_error(await get(port, path, authorization="Bearer sk-other"), 404)
            with pytest.raises(NotFoundError):
                await other.responses.delete(first.id)
        finally:
            await other.close()
        await client.responses.delete(first.id)
        with pytest.raises(NotFoundError):
            await client.responses.retrieve(first.id)
        unstored = await client.responses.create(model="synthetic", input="x", store=False)
        assert unstored.store is False
        with pytest.raises(NotFoundError):
            await client.responses.retrieve(unstored.id)
        resp = await post(port, f"/v1/responses/{second.id}", {}, authorization=f"Bearer {KEY}")
        assert_openai_error(resp, 405)


@pytest.mark.usefixtures("request_path")
async def test_a_stored_responses_input_items_through_the_sdks_pagination(tmp_path):
    """GET /v1/responses/{id}/input_items: the request's input as items with ids, newest first by
    default, paged by limit and after (the SDK's cursor pages follow has_more and the last id);
    every id the tenant's own; bad queries 400s naming the parameter, unknown ids 404s."""
    store = {"responses_store": {"max_entries": 8, "max_bytes": 1 << 20, "ttl_s": 60}}
    async with deployment([HERMES_TWO, PLAIN, PLAIN], tmp_path, **store) as (client, port):
        first = await client.responses.create(
            model="synthetic", input="Weather and time?", tools=[WEATHER, CLOCK]
        )
        page = await client.responses.input_items.list(first.id)
        assert [(i.type, i.role, i.content[0].text) for i in page.data] == [
            ("message", "user", "Weather and time?")
        ]
        assert page.data[0].id and page.has_more is False and page.first_id == page.last_id == page.data[0].id
        calls = [i for i in first.output if i.type == "function_call"]
        given = [{"role": "developer", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "input_text", "text": "Weather and time?"}]},
                 *(i.model_dump(exclude_none=True) for i in first.output),
                 *({"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls)]  # fmt: skip
        second = await client.responses.create(model="synthetic", input=given, tools=[WEATHER, CLOCK])
        kinds = ["message", "message", "message", "function_call", "function_call",
                 "function_call_output", "function_call_output"]  # fmt: skip
        ascending = [i async for i in client.responses.input_items.list(second.id, order="asc", limit=2)]
        assert [i.type for i in ascending] == kinds and len({i.id for i in ascending}) == 7
        assert [i.role for i in ascending[:3]] == ["developer", "user", "assistant"]
        assert (
            ascending[3].id == calls[0].id and ascending[3].call_id == calls[0].call_id
        )  # the client's ids kept
        assert ascending[5].output == "ok" and ascending[2].content[0].text == "I will look."
        descending = [i async for i in client.responses.input_items.list(second.id, limit=3)]
        assert [i.id for i in descending] == [i.id for i in reversed(ascending)]
        page = await client.responses.input_items.list(second.id, limit=3, after=ascending[4].id)
        assert [i.id for i in page.data] == [i.id for i in ascending[3::-1][:3]] and page.has_more is True
        assert (page.first_id, page.last_id) == (ascending[3].id, ascending[1].id)
        last = await client.responses.input_items.list(second.id, order="asc", after=ascending[5].id)
        assert [i.id for i in last.data] == [ascending[6].id] and last.has_more is False
        # a chained response lists its own input, not its predecessor's
        third = await client.responses.create(
            model="synthetic", input="and now?", previous_response_id=first.id
        )
        assert [i.content[0].text async for i in client.responses.input_items.list(third.id)] == ["and now?"]
        with pytest.raises(NotFoundError):
            await client.responses.input_items.list("resp_nothing")
        other = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-other", max_retries=0)
        try:
            with pytest.raises(NotFoundError):
                await other.responses.input_items.list(first.id)
        finally:
            await other.close()
        auth = {"authorization": f"Bearer {KEY}"}
        for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                             ("order=up", "order"), ("after=item_nothing", "after")):  # fmt: skip
            error = assert_openai_error(
                await get(port, f"/v1/responses/{first.id}/input_items?{query}", **auth), 400
            )
            assert error["param"] == param
        assert_openai_error(await post(port, f"/v1/responses/{first.id}/input_items", {}, **auth), 405)
        assert_openai_error(await get(port, f"/v1/responses/{first.id}/other", **auth), 404)
        await client.responses.delete(first.id)
        with pytest.raises(NotFoundError):
            await client.responses.input_items.list(first.id)


async def test_get_and_delete_with_the_store_off_are_404s(tmp_path):
    async with deployment([PLAIN], tmp_path) as (client, _):
        with pytest.raises(NotFoundError):
            await client.responses.retrieve("resp_nothing")
        with pytest.raises(NotFoundError):
            await client.responses.delete("resp_nothing")


HOSTILE_VALUES = [None, 3, -1, 2.5, True, "x", "", [], [3], ["x"], {}, {"a": 1}, {"type": "x"}, [{}], [[]]]


def test_any_member_replaced_by_any_value_is_served_or_a_400_never_an_exception():
    """Every member of a full body, and of its items, tools and parts, replaced by each hostile value."""
    base = {"model": "m", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "auto",
            "temperature": 1, "top_p": 1, "max_output_tokens": 5, "stream": True, "store": False,
            "parallel_tool_calls": True, "metadata": {"k": "v"}, "text": {"format": {"type": "text"}},
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c", "output": "ok"}]}  # fmt: skip
    api = ResponsesApi()

    def paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        found = [at] if at else []
        children = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        )
        for key, child in children:
            found += paths(child, (*at, key))
        return found

    tried = 0
    for path in paths(base):
        for hostile in HOSTILE_VALUES:
            body = json.loads(json.dumps(base))
            holder = body
            for key in path[:-1]:
                holder = holder[key]
            holder[path[-1]] = hostile
            tried += 1
            try:
                call = api.to_chat(json.dumps(body).encode(), None, "a")  # type: ignore[arg-type]
            except HTTPError as exc:
                assert exc.status == 400 and exc.param, (path, hostile)
                continue
            json.loads(call.body)
            translator = call.stream()
            translator.feed(chat_sse(CHAT_ANSWER))
            translator.flush()
    assert tried > 500


def test_a_put_frees_its_tenants_expired_entries():
    clock = Clock()
    store = ResponseStore(ResponsesStoreConfig(max_entries=100, max_bytes=1 << 20, ttl_s=10), clock)
    store.put("a", stored_response("r1"), [])
    store.put("b", stored_response("b1"), [])
    clock.now = 10.0
    store.put("a", stored_response("r2"), [])
    assert list(store._tenants["a"]) == ["r2"] and store._bytes["a"] == store._tenants["a"]["r2"].size


async def test_the_openai_agents_sdk_runs_a_tool_through_the_deployment(tmp_path):
    """docs/api-responses.md's recipe: an Agents SDK agent (Responses model) with a function tool; the
    model's call is run by the SDK, its output fed back, the scripted answer final (skipped without
    the ``openai-agents`` package)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "18 C"

    one_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    async with deployment([one_call, PLAIN], tmp_path) as (client, _):
        model = agents.OpenAIResponsesModel(model="synthetic", openai_client=client)
        agent = agents.Agent(name="assistant", instructions="Be brief.", model=model, tools=[get_weather])
        result = await agents.Runner.run(agent, "What is the weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        async for _event in streamed.stream_events():
            pass
    assert result.final_output == streamed.final_output == PLAIN and seen == ["Paris", "Paris"]


@pytest.mark.usefixtures("request_path")
async def test_an_answer_the_context_leg_finishes_streams_as_the_unary_one(tmp_path):
    """One token: the context worker's answer is the whole answer, streamed by the orchestrator."""
    async with deployment([PLAIN], tmp_path) as (client, _):
        kw = {"model": "synthetic", "input": "Weather?", "max_output_tokens": 1}
        unary = await client.responses.create(**kw)
        events = [e async for e in await client.responses.create(**kw, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and unary.status == "incomplete"
    assert comparable(events[-1].response) == comparable(unary) and unary.usage.output_tokens == 1


def test_the_translation_benchmark_body_is_served_as_the_chat_history():
    """bench.api_translation's Responses body (the agentic history as items) translates to the chat
    body's own messages, and its row comes out."""
    from bench.api_translation import responses_body, run
    from bench.workload import agentic_messages

    history = [*agentic_messages(300), {"role": "user", "content": 'quote " back\\slash \n é 😀'}]
    chat = json.loads(API.to_chat(responses_body(history), None, "default").body)  # type: ignore[arg-type]
    texts = [(m["role"], m["content"]) for m in chat["messages"] if m["role"] != "assistant"]
    assert texts == [(m["role"], m["content"]) for m in history if m["role"] != "assistant"]
    assert "responses (openai)" in run([50])
