"""The two relay modes agree: fast (one validating fastcore scan per body + fastcore.relay
splices, both scanner twins) and parsed (json.loads -> pydantic -> model_dump_json) build the
same bodies for every gate, and refuse the same client bodies."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

import fastcore
from fastcore.relay import Relay
from server.errors import HTTPError
from server.orchestrator.relay_modes import (
    FastRelay,
    ParsedRelay,
    answer_as_sse,
    malformed_json_error,
)

GATES = [(False, False), (True, False), (False, True), (True, True)]
GATE_IDS = ["gates_off", "tokids", "strip", "gates_on"]
PROMPT_IDS = [1, 9038, 2501, 29871, 13, 0, 255, 70000]
DISAGG_ID = 7205759403792793601


def client_body(chat: bool, **extra: Any) -> bytes:
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "top_p": 0.9,
        "stop": ["\n\n", "END"],
        "user": "u-1",  # a field neither mode knows: passed through
        "logit_bias": {"50": -100},
    }
    if chat:
        body["messages"] = [
            {"role": "system", "content": 'Be terse. \u00e9\u4e2d "quoted" \\ back'},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "user", "content": [{"type": "text", "text": "last"}]},
        ]
    else:
        body["prompt"] = "Once upon a time"
    body.update(extra)
    return json.dumps(body).encode()


def context_response(
    chat: bool, *, b64: bool, finish: str = "not_finished", completion_tokens: int = 1
) -> bytes:
    params = {
        "request_type": "context_only",
        "first_gen_tokens": [42],
        "ctx_request_id": 17,
        "disagg_request_id": DISAGG_ID,
        "encoded_opaque_state": None,
        "ctx_info_endpoint": "http://127.0.0.1:8001/kv/17",
        "draft_tokens": None,
    }
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": finish,
        "disaggregated_params": params,
    }
    if chat:
        choice["message"] = {"role": "assistant", "content": "*"}
    else:
        choice["text"] = "*"
    body: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "completion_tokens": completion_tokens,
            "total_tokens": 9,
        },
    }
    if b64:
        body["prompt_token_ids"] = None
        body["prompt_token_ids_b64"] = fastcore.encode_tokens(PROMPT_IDS).decode()
    else:
        body["prompt_token_ids"] = PROMPT_IDS
    return json.dumps(body).encode()


@pytest.fixture(params=GATES, ids=GATE_IDS)
def modes(request, jsonspan) -> tuple[FastRelay, ParsedRelay]:
    tokids, strip = request.param
    return (
        FastRelay(tokids_b64=tokids, strip_history=strip, relay=Relay(jsonspan)),
        ParsedRelay(tokids_b64=tokids, strip_history=strip),
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_both_modes_build_the_same_bodies(modes, chat, stream):
    fast, parsed = modes
    extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = client_body(chat, **extra)
    ctx = context_response(chat, b64=fast.tokids_b64)
    outputs = []
    for mode in (fast, parsed):
        req = mode.read_client(body, chat)
        assert (req.stream, req.include_usage, req.max_tokens, req.model) == (stream, stream, 8, "tiny")
        context_request = json.loads(mode.context_request(req, DISAGG_ID))
        result = mode.read_context(req, ctx)
        assert not result.finished
        generation_request = json.loads(mode.generation_request(req, result))
        outputs.append((context_request, generation_request))
    assert outputs[0] == outputs[1]

    context_request, generation_request = outputs[0]
    # PROTOCOL.md (1)
    assert context_request["stream"] is False and context_request["stream_options"] is None
    expected_params = {"request_type": "context_only", "disagg_request_id": DISAGG_ID}
    if fast.tokids_b64:
        expected_params["return_prompt_token_ids_b64"] = True
    assert context_request["disaggregated_params"] == expected_params
    # PROTOCOL.md (3)
    params = generation_request["disaggregated_params"]
    assert params["request_type"] == "generation_only" and params["ctx_usage"]["completion_tokens"] == 1
    assert params["first_gen_tokens"] == [42] and params["ctx_request_id"] == 17
    assert generation_request.get("stream", False) == stream
    if fast.tokids_b64:
        assert fastcore.decode_tokens_list(generation_request["prompt_token_ids_b64"]) == PROMPT_IDS
    elif chat:
        assert generation_request["prompt_token_ids"] == PROMPT_IDS
    else:
        assert generation_request["prompt"] == PROMPT_IDS
    if chat:
        messages = json.loads(body)["messages"]
        assert generation_request["messages"] == (messages[-1:] if fast.strip_history else messages)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_answers_to_clients_are_the_same_and_carry_no_internal_fields(modes, chat):
    fast, parsed = modes
    body = client_body(chat, max_tokens=1)
    ctx = context_response(chat, b64=fast.tokids_b64, finish="length", completion_tokens=1)
    answers = []
    for mode in (fast, parsed):
        req = mode.read_client(body, chat)
        result = mode.read_context(req, ctx)
        assert result.finished
        finished = json.loads(mode.finished_answer(req, result))
        # A generation worker's response may echo internal fields too.
        relayed = json.loads(mode.client_answer(req, ctx))
        answers.append((finished, relayed))
    assert answers[0] == answers[1]
    finished = answers[0][0]
    assert "prompt_token_ids" not in finished and "prompt_token_ids_b64" not in finished
    assert "disaggregated_params" not in finished["choices"][0]
    assert finished["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("finish", "completion_tokens", "max_tokens", "finished"),
    [
        ("stop", 1, 8, True),  # first token was EOS
        ("length", 1, 1, True),  # the client asked for one token
        ("length", 1, None, False),
        ("length", 1, 8, False),
        ("not_finished", 1, 8, False),
        ("not_finished", 1, 1, False),
    ],
)
def test_when_the_context_response_is_the_answer(modes, finish, completion_tokens, max_tokens, finished):
    extra = {} if max_tokens is not None else {"max_tokens": None}
    body = client_body(False, **extra) if max_tokens is None else client_body(False, max_tokens=max_tokens)
    ctx = context_response(False, b64=modes[0].tokids_b64, finish=finish, completion_tokens=completion_tokens)
    for mode in modes:
        req = mode.read_client(body, False)
        assert mode.read_context(req, ctx).finished is finished


def test_max_completion_tokens_wins_on_chat(modes):
    body = client_body(True, max_tokens=8, max_completion_tokens=1)
    for mode in modes:
        assert mode.read_client(body, True).max_tokens == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_finished_answer_streams_as_the_worker_would(chat, include_usage):
    ctx = context_response(chat, b64=False, finish="stop")
    answer = ParsedRelay(tokids_b64=False, strip_history=False)
    req = answer.read_client(client_body(chat), chat)
    stripped = answer.finished_answer(req, answer.read_context(req, ctx))
    stream = answer_as_sse(stripped, chat=chat, include_usage=include_usage)
    events = stream.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-2]]
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == kind and c["id"] == "cmpl-1" for c in chunks)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == "*"
    else:
        assert "".join(c["text"] for c in choices) == "*"
    assert [c["finish_reason"] for c in choices][-1] == "stop"
    assert all(c["finish_reason"] is None for c in choices[:-1])
    usage = [c["usage"] for c in chunks if not c["choices"]]
    assert usage == (
        [{"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}] if include_usage else []
    )


def test_fast_mode_refuses_a_repeated_key_it_reads(jsonspan):
    fast = FastRelay(tokids_b64=True, strip_history=True, relay=Relay(jsonspan))
    with pytest.raises(HTTPError) as info:
        fast.read_client(b'{"prompt": "x", "stream": false, "stream": true}', False)
    assert info.value.status == 400 and info.value.param == "stream"
    assert "duplicate key 'stream'" in info.value.message and "(byte 33)" in info.value.message


def test_integers_beyond_64_bits_pass_through_both_modes(modes):
    # Neither mode reads "seed": both relay it, digit for digit.
    body = b'{"prompt": "x", "seed": 123456789012345678901234}'
    for mode in modes:
        context_request = mode.context_request(mode.read_client(body, False), 1)
        assert json.loads(context_request)["seed"] == 123456789012345678901234


@pytest.mark.parametrize(
    "ctx",
    [
        b'{"choices": [{"finish_reason": "not_finished"}], "usage": {}}',  # no disaggregated_params
        b"[1]",
        b'{"choices": [], "prompt_token_ids": [1]}',
        b'{"choices": [{"finish_reason": "not_finished",',
        b'{"choices": [{"finish_reason": 7, "disaggregated_params": {}}]}',
    ],
)
def test_unusable_context_responses_are_502_in_both_modes(modes, ctx):
    for mode in modes:
        req = mode.read_client(client_body(True), True)
        with pytest.raises(HTTPError) as info:
            mode.read_context(req, ctx)
        assert info.value.status == 502


def test_context_response_without_the_ids_the_gate_needs_is_502(modes):
    fast, _ = modes
    # The gate asks for one form; the worker sent the other.
    ctx = context_response(True, b64=not fast.tokids_b64)
    for mode in modes:
        req = mode.read_client(client_body(True), True)
        result = mode.read_context(req, ctx)
        with pytest.raises(HTTPError) as info:
            mode.generation_request(req, result)
        assert info.value.status == 502 and "prompt_token_ids" in info.value.message


def test_malformed_json_messages_give_the_byte_offset():
    assert malformed_json_error(b'{"a": 1,}', "request body").endswith("(byte 8)")
    assert "not valid UTF-8 (byte 6)" in malformed_json_error(b'{"a":"\xff"}', "request body")
    assert malformed_json_error(b"", "request body").endswith("(byte 0)")


def _python_events(fn: Any) -> int:
    """Python-level calls (functions and builtins) made by ``fn``: a loop over ids or bytes in
    Python would show up here, whatever the machine's speed."""
    events = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal events
        events += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return events


@pytest.mark.parametrize(("tokids", "strip"), GATES, ids=GATE_IDS)
def test_fast_mode_python_work_does_not_grow_with_the_prompt(jsonspan, tokids, strip):
    if jsonspan.__name__.endswith("_py"):
        pytest.skip("the pure-Python scanner twin is Python work per byte by design")
    fast = FastRelay(tokids_b64=tokids, strip_history=strip, relay=Relay(jsonspan))

    def pipeline(n_ids: int) -> Any:
        ids = [i % 32000 for i in range(n_ids)]
        messages = [{"role": "user", "content": "x" * (4 * n_ids)}, {"role": "user", "content": "last"}]
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 8}).encode()
        ctx = json.loads(context_response(True, b64=False))
        ctx["usage"]["prompt_tokens"] = n_ids
        if tokids:
            ctx["prompt_token_ids"] = None
            ctx["prompt_token_ids_b64"] = fastcore.encode_tokens(ids).decode()
        else:
            ctx["prompt_token_ids"] = ids
        ctx_bytes = json.dumps(ctx).encode()
        gen = context_response(True, b64=False, finish="length")

        def run() -> None:
            req = fast.read_client(body, True)
            fast.context_request(req, DISAGG_ID)
            fast.generation_request(req, fast.read_context(req, ctx_bytes))
            fast.client_answer(req, gen)

        run()  # warm: first-call imports and caches
        return run

    small, large = pipeline(1_000), pipeline(50_000)
    assert _python_events(small) == _python_events(large)
