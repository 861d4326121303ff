"""The two relay modes agree: fast (one validating fastcore scan per body + fastcore.relay
splices, both scanner twins) and parsed (json.loads -> pydantic -> model_dump_json) build the
same bodies for every gate, and refuse the same client bodies."""

from __future__ import annotations

import json
import sys
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from relay_mode_inputs import DISAGG_ID, PROMPT_IDS, context_response, fast_relay_class

import fastcore
from fastcore import _relay_py as relay_twin_py
from fastcore.limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS
from server.errors import HTTPError
from server.orchestrator.relay_modes import (
    FastRelay,
    ParsedMsgpackRelay,
    ParsedRelay,
    answer_as_sse,
    malformed_json_error,
)

GATES = [(False, False), (True, False), (False, True), (True, True)]
GATE_IDS = ["gates_off", "tokids", "strip", "gates_on"]


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


@pytest.fixture(params=GATES, ids=GATE_IDS)
def modes(request, relay_twin) -> tuple[FastRelay, ParsedRelay]:
    tokids, strip = request.param
    return (
        fast_relay_class(relay_twin)(tokids_b64=tokids, strip_history=strip),
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
    # docs/protocol.md (1)
    assert context_request["stream"] is False and context_request["stream_options"] is None
    expected_params = {"request_type": "context_only", "disagg_request_id": DISAGG_ID}
    if fast.tokids_b64:
        expected_params["return_prompt_token_ids_b64"] = True
    assert context_request["disaggregated_params"] == expected_params
    # docs/protocol.md (3)
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
def test_the_legs_go_out_as_pieces_whose_join_is_the_body(modes, chat):
    """What the orchestrator sends (``context_pieces``, ``generation_pieces``): the fast relay's pieces
    join to its leg bodies, the client body's long run a view of it (test_relay checks the prompt
    ids'); the parsed modes send their bytes."""
    fast, parsed = modes
    body = client_body(chat, user="u" * 5_000)
    ctx = context_response(chat, b64=fast.tokids_b64)
    for mode in (fast, parsed):
        req = mode.read_client(body, chat)
        context_pieces = mode.context_pieces(req, DISAGG_ID)
        result = mode.read_context(req, ctx)
        generation_pieces = mode.generation_pieces(req, result)
        if mode is parsed:
            assert context_pieces == mode.context_request(req, DISAGG_ID)
            assert generation_pieces == mode.generation_request(req, result)
            continue
        assert b"".join(context_pieces) == mode.context_request(req, DISAGG_ID)
        assert b"".join(generation_pieces) == mode.generation_request(req, result)
        assert any(type(piece) is memoryview and piece.obj is body for piece in context_pieces)
        assert any(type(piece) is memoryview and piece.obj is body for piece in generation_pieces)


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


def test_fast_mode_refuses_a_repeated_key_it_reads(relay_twin):
    fast = fast_relay_class(relay_twin)(tokids_b64=True, strip_history=True)
    with pytest.raises(HTTPError) as info:
        fast.read_client(b'{"prompt": "x", "stream": false, "stream": true}', False)
    assert info.value.status == 400 and info.value.param == "stream"
    assert "duplicate key 'stream'" in info.value.message and "(byte 33)" in info.value.message


def test_integers_beyond_64_bits_pass_through_both_modes(modes):
    # Neither mode reads "seed": both relay it, digit for digit.
    body = b'{"prompt": "x", "seed": 123456789012345678901234}'
    for mode in modes:
        context_request = mode.context_request(mode.read_client(body, False), DISAGG_ID)
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


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_context_response_without_the_ids_the_gate_needs_is_502(modes, chat):
    fast, _ = modes
    # Gate off: the worker sent base64 only. Gate on: it sent neither form.
    ctx = context_response(chat, b64=True)
    if fast.tokids_b64:
        ctx = json.dumps({**json.loads(ctx), "prompt_token_ids_b64": None}).encode()
    for mode in modes:
        req = mode.read_client(client_body(chat), chat)
        result = mode.read_context(req, ctx)
        with pytest.raises(HTTPError) as info:
            mode.generation_request(req, result)
        assert info.value.status == 502 and "prompt_token_ids" in info.value.message


@pytest.mark.parametrize("b64", ["null", "absent"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_asked_for_base64_and_got_the_list_both_modes_relay_the_list(relay_twin, chat, b64):
    # trtllm-serve: chat responses carry "prompt_token_ids_b64": null unless asked; completions none.
    ctx = json.loads(context_response(chat, b64=False))
    if b64 == "absent":
        ctx.pop("prompt_token_ids_b64", None)
    else:
        ctx["prompt_token_ids_b64"] = None
    raw = json.dumps(ctx).encode()
    fast = fast_relay_class(relay_twin)(tokids_b64=True, strip_history=False)
    parsed = ParsedRelay(tokids_b64=True, strip_history=False)
    sent = []
    for mode in (fast, parsed):
        req = mode.read_client(client_body(chat), chat)
        sent.append(json.loads(mode.generation_request(req, mode.read_context(req, raw))))
    assert sent[0] == sent[1]
    assert "prompt_token_ids_b64" not in sent[0]
    assert sent[0]["prompt_token_ids" if chat else "prompt"] == PROMPT_IDS


@pytest.mark.parametrize(
    "chat, ask, asked", [(True, False, True), (False, False, False), (False, True, True)]
)
def test_completions_ask_for_base64_only_when_told(relay_twin, chat, ask, asked):
    for mode in (
        fast_relay_class(relay_twin)(tokids_b64=True, strip_history=False),
        ParsedRelay(tokids_b64=True, strip_history=False),
    ):
        req = mode.read_client(client_body(chat), chat)
        params = json.loads(mode.context_request(req, DISAGG_ID, ask_b64_completions=ask))[
            "disaggregated_params"
        ]
        assert params.get("return_prompt_token_ids_b64", False) is asked
    gate_off = fast_relay_class(relay_twin)(tokids_b64=False, strip_history=False)
    req = gate_off.read_client(client_body(chat), chat)
    assert (
        "return_prompt_token_ids_b64"
        not in json.loads(gate_off.context_request(req, DISAGG_ID, True))["disaggregated_params"]
    )


@pytest.mark.parametrize("bad", [0, 2**40 - 1, 2**63, -1, True])
def test_a_disagg_request_id_outside_the_protocols_range_is_refused(relay_twin, bad):
    for mode in (
        fast_relay_class(relay_twin)(tokids_b64=True, strip_history=False),
        ParsedRelay(tokids_b64=True, strip_history=False),
    ):
        with pytest.raises(ValueError, match=r"\[2\^40, 2\^63\)"):
            mode.context_request(mode.read_client(client_body(True), True), bad)


def test_both_modes_read_the_auth_fields(relay_twin):
    ctx = json.loads(context_response(True, b64=True))
    ctx["choices"][0]["disaggregated_params"]["encoded_opaque_state"] = "AAAA"
    raw = json.dumps(ctx).encode()
    for mode in (
        fast_relay_class(relay_twin)(tokids_b64=True, strip_history=False),
        ParsedRelay(tokids_b64=True, strip_history=False),
    ):
        req = mode.read_client(client_body(True), True)
        assert mode.auth_fields(mode.read_context(req, raw)) == ("http://127.0.0.1:8001/kv/17", "AAAA")


def test_the_parsed_mode_relays_trtllm_serves_extra_params(relay_twin):
    extras = {
        "schedule_style": 0,
        "ctx_dp_rank": 2,
        "first_gen_log_probs": [[-0.1]],
        "resolved_thinking": False,
    }
    ctx = json.loads(context_response(True, b64=True))
    ctx["choices"][0]["disaggregated_params"].update(extras)
    raw = json.dumps(ctx).encode()
    sent = []
    for mode in (
        fast_relay_class(relay_twin)(tokids_b64=True, strip_history=False),
        ParsedRelay(tokids_b64=True, strip_history=False),
    ):
        req = mode.read_client(client_body(True), True)
        sent.append(json.loads(mode.generation_request(req, mode.read_context(req, raw))))
    assert sent[0] == sent[1]
    assert extras.items() <= sent[1]["disaggregated_params"].items()


@pytest.mark.parametrize("tokids", [False, True])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_msgpack_mode_sends_the_parsed_modes_objects_as_msgpack(chat, tokids):
    parsed = ParsedRelay(tokids_b64=tokids, strip_history=True)
    packed = ParsedMsgpackRelay(tokids_b64=tokids, strip_history=True)
    assert parsed.leg_headers == b"" and packed.leg_headers == b"X-TRTLLM-Msgpack: 1\r\n"
    ctx = context_response(chat, b64=tokids)
    legs = []
    for mode in (parsed, packed):
        req = mode.read_client(client_body(chat), chat)
        result = mode.read_context(req, ctx)
        legs.append(
            (
                mode.context_request(req, DISAGG_ID),
                mode.generation_request(req, result),
                mode.client_answer(req, ctx),
            )
        )
    (json_ctx, json_gen, json_answer), (mp_ctx, mp_gen, mp_answer) = legs
    assert msgspec.msgpack.decode(mp_ctx) == json.loads(json_ctx)
    assert msgspec.msgpack.decode(mp_gen) == json.loads(json_gen)
    assert mp_answer == json_answer  # responses stay JSON


def test_the_msgpack_mode_refuses_what_msgpack_cannot_carry():
    packed = ParsedMsgpackRelay(tokids_b64=False, strip_history=False)
    req = packed.read_client(client_body(True, big=2**70), True)
    with pytest.raises(HTTPError) as info:
        packed.context_request(req, DISAGG_ID)
    assert info.value.status == 400 and "msgpack" in info.value.message


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
def test_fast_mode_python_work_does_not_grow_with_the_prompt(relay_twin, tokids, strip):
    if relay_twin.__name__.endswith("_py"):
        pytest.skip("the pure-Python scanner twin is Python work per byte by design")
    fast = fast_relay_class(relay_twin)(tokids_b64=tokids, strip_history=strip)

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


# -- client bodies: every refusal, and where the two modes part ----------------------------------

ABSENT = object()  # a field taken out of the base body


def fast_relay(relay_twin: ModuleType) -> FastRelay:
    return fast_relay_class(relay_twin)(tokids_b64=True, strip_history=True)


def small_body(chat: bool, fields: dict[str, Any]) -> bytes:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not ABSENT}).encode()


def refusal(mode: Any, body: bytes, chat: bool) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        mode.read_client(body, chat)
    assert info.value.status == 400
    return info.value


FIELD_REFUSALS = [
    (True, {"stream": "yes"}, "stream"),
    (True, {"stream": 1}, "stream"),
    (False, {"stream": []}, "stream"),
    (False, {"stream": {}}, "stream"),
    (False, {"stream_options": 3}, "stream_options"),
    (False, {"stream_options": "x"}, "stream_options"),
    (False, {"stream_options": []}, "stream_options"),
    (True, {"stream_options": True}, "stream_options"),
    (False, {"stream_options": {"include_usage": "yes"}}, "include_usage"),
    (True, {"stream_options": {"include_usage": 1}}, "include_usage"),
    (True, {"stream_options": {"include_usage": {}}}, "include_usage"),
    (True, {"model": 5}, "model"),
    (False, {"model": True}, "model"),
    (False, {"model": ["tiny"]}, "model"),
    (True, {"model": {}}, "model"),
    (True, {"messages": ABSENT}, "messages"),
    (True, {"messages": None}, "messages"),
    (True, {"messages": "hi"}, "messages"),
    (True, {"messages": []}, "messages"),
    (True, {"messages": {}}, "messages"),
    (True, {"messages": 1}, "messages"),
    (False, {"prompt": ABSENT}, "prompt"),
    (False, {"prompt": None}, "prompt"),
    (False, {"prompt": 5}, "prompt"),
    (False, {"prompt": True}, "prompt"),
    (False, {"prompt": {}}, "prompt"),
    (True, {"max_tokens": "ten"}, "max_tokens"),
    (False, {"max_tokens": "8"}, "max_tokens"),
    (False, {"max_tokens": 1.5}, "max_tokens"),
    (False, {"max_tokens": 8.0}, "max_tokens"),
    (True, {"max_tokens": True}, "max_tokens"),
    (False, {"max_tokens": False}, "max_tokens"),
    (False, {"max_tokens": []}, "max_tokens"),
    (False, {"max_tokens": {}}, "max_tokens"),
    (True, {"max_tokens": 0}, "max_tokens"),
    (False, {"max_tokens": -1}, "max_tokens"),
    (False, {"max_tokens": -(10**19)}, "max_tokens"),
    (True, {"max_completion_tokens": "ten"}, "max_completion_tokens"),
    (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (True, {"max_completion_tokens": True}, "max_completion_tokens"),
    (True, {"max_completion_tokens": 2.0}, "max_completion_tokens"),
    # Both are checked (as the parsed model does), though max_completion_tokens counts.
    (True, {"max_completion_tokens": 5, "max_tokens": "ten"}, "max_tokens"),
    (True, {"disaggregated_params": {"request_type": "generation_only"}}, "disaggregated_params"),
    (False, {"disaggregated_params": None}, "disaggregated_params"),
    (True, {"prompt_token_ids_b64": "AQAAAA=="}, "prompt_token_ids_b64"),
    (False, {"prompt_token_ids_b64": "AQAAAA=="}, "prompt_token_ids_b64"),
    (True, {"prompt_token_ids": [1, 2]}, "prompt_token_ids"),
]


@pytest.mark.parametrize(("chat", "fields", "param"), FIELD_REFUSALS)
def test_each_field_is_refused_by_both_modes(relay_twin, chat, fields, param):
    body = small_body(chat, fields)
    fast = refusal(fast_relay(relay_twin), body, chat)
    assert fast.param == param and f"'{param}'" in fast.message
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, chat)
    assert param in (parsed.param or "")  # pydantic names the place its own way ("prompt.str")


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (b'{"prompt": "x", "max_tokens": 1e2}', "max_tokens", "must be an integer"),
        (b'{"prompt": "x", "max_tokens": 1E2}', "max_tokens", "must be an integer"),
        (b'{"prompt": "x", "max_tokens": 10.0}', "max_tokens", "must be an integer"),
        (b'{"prompt": "x", "max_tokens": -0}', "max_tokens", "at least 1, got 0"),
        (b'{"prompt": "x", "max_tokens": -0.0}', "max_tokens", "must be an integer"),
    ],
)
def test_number_spellings_both_modes_refuse(relay_twin, body, param, needle):
    fast = refusal(fast_relay(relay_twin), body, False)
    assert fast.param == param and needle in fast.message
    assert refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, False).param == param


@pytest.mark.parametrize(
    ("chat", "fields", "expected"),
    [
        (
            False,
            {"stream": None, "stream_options": None, "model": None, "max_tokens": None},
            (False, False, None, None),
        ),
        (False, {"stream": True, "stream_options": {}}, (True, False, 8, "tiny")),
        (False, {"stream": False, "stream_options": {"include_usage": None}}, (False, False, 8, "tiny")),
        (
            True,
            {"stream": True, "stream_options": {"include_usage": True, "x": [1]}},
            (True, True, 8, "tiny"),
        ),
        (False, {"model": 't\u00e9ny\n"q" \\ \U0001f600'}, (False, False, 8, 't\u00e9ny\n"q" \\ \U0001f600')),
        (False, {"model": ""}, (False, False, 8, "")),
        (False, {"max_tokens": 10**20 - 1}, (False, False, 10**20 - 1, "tiny")),
        (False, {"max_tokens": 1}, (False, False, 1, "tiny")),
        (True, {"max_completion_tokens": None, "max_tokens": 3}, (False, False, 3, "tiny")),
        (True, {"max_completion_tokens": 2, "max_tokens": 0}, (False, False, 2, "tiny")),
        (True, {"max_completion_tokens": 2, "max_tokens": None}, (False, False, 2, "tiny")),
        (False, {"max_completion_tokens": "ignored on completions"}, (False, False, 8, "tiny")),
        (False, {"prompt": []}, (False, False, 8, "tiny")),
        (False, {"prompt": [[1, 2], []]}, (False, False, 8, "tiny")),
        (False, {"prompt": ["a", "b"]}, (False, False, 8, "tiny")),
        (False, {"prompt": ""}, (False, False, 8, "tiny")),
        (False, {"prompt_token_ids": [1, 2]}, (False, False, 8, "tiny")),  # not internal on completions
        (True, {"prompt": 5}, (False, False, 8, "tiny")),  # not read on chat
        (False, {"messages": 5}, (False, False, 8, "tiny")),  # not read on completions
    ],
)
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_values_both_modes_accept(relay_twin, chat, fields, expected, ensure_ascii):
    body = small_body(chat, fields)
    if not ensure_ascii:
        body = json.dumps(json.loads(body), ensure_ascii=False).encode()
    for mode in (fast_relay(relay_twin), ParsedRelay(tokids_b64=True, strip_history=True)):
        req = mode.read_client(body, chat)
        assert (req.stream, req.include_usage, req.max_tokens, req.model) == expected


MALFORMED_CLIENT_BODIES = [
    (
        b'{"model": "tiny", "messages": [',
        "malformed JSON: JSON is malformed: unexpected end of data (byte 31)",
    ),
    (b'{"model": "tiny", "messages": []} trailing', "trailing characters after the value (byte 34)"),
    (b"", "unexpected end of data (byte 0)"),
    (b"   ", "unexpected end of data (byte 3)"),
    (b"\xff\xfe{}", "request body is not valid UTF-8 (byte 0)"),
    (b'{"messages": [{"content": "\xc3("}]}', "request body is not valid UTF-8 (byte 27)"),
    (b'{"a": 1,}', "expected '\"' to start an object key (byte 8)"),
    (b'{"max_tokens": 01}', "expected ',' or '}' (byte 16)"),
    (b'{"max_tokens": 1.}', "expected a digit (byte 17)"),
    (b'{"stream": tru}', "invalid literal (byte 14)"),
    (b'{"model": "a\\x"}', "invalid escape (byte 12)"),
    (b'{"model": "a\nb"}', "unescaped control character in string (byte 12)"),
    (b'{"messages": ' + b"[" * 500, "unexpected end of data (byte 513)"),
    (b"[" * 500, "unexpected end of data (byte 500)"),
    (b'{"a": ' + b"[" * 500 + b"}", "expected a value (byte 506)"),
]


@pytest.mark.parametrize(("body", "needle"), MALFORMED_CLIENT_BODIES)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_malformed_client_bodies_say_where_in_both_modes(relay_twin, body, needle, chat):
    fast = refusal(fast_relay(relay_twin), body, chat)
    assert needle in fast.message and fast.message.startswith("request body is ")
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, chat)
    assert parsed.message == fast.message


@pytest.mark.parametrize(
    "key", ["stream", "stream_options", "model", "max_tokens", "max_completion_tokens", "messages", "prompt"]
)
def test_both_modes_refuse_a_repeated_field_they_read(relay_twin, key):
    value = {"stream_options": "{}", "model": '"m"', "messages": '[{"role": "user"}]', "prompt": '"p"'}
    raw = value.get(key, "null")
    body = (
        f'{{"messages": [{{"role": "user"}}], "prompt": "x", "{key}": {raw}, "{key}": {raw}}}'
        if key not in ("messages", "prompt")
        else f'{{"messages": [{{"role": "user"}}], "prompt": "x", "{key}": {raw}}}'
    ).encode()
    chat = key != "prompt"
    fast = refusal(fast_relay(relay_twin), body, chat)
    assert fast.param == key and f"duplicate key '{key}'" in fast.message
    # json.loads would keep the last copy and send only it on: the parsed mode refuses it the same way.
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, chat)
    assert (parsed.param, parsed.message) == (fast.param, fast.message)


def test_fast_mode_refuses_a_repeated_include_usage(relay_twin):
    body = b'{"prompt": "x", "stream_options": {"include_usage": true, "include_usage": false}}'
    assert refusal(fast_relay(relay_twin), body, False).param == "include_usage"
    assert refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, False).param == "include_usage"
    # Repeats of fields it does not read the fast mode leaves to the workers (which refuse them); the
    # parsed mode, which would send one copy on, refuses them itself.
    other = b'{"prompt": "x", "user": 1, "user": 2, "stream_options": {"x": 1, "x": 2}}'
    assert fast_relay(relay_twin).read_client(other, False).max_tokens is None
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), other, False)
    assert (
        parsed.param == "user" and "duplicate key 'user'" in parsed.message and "(byte 27)" in parsed.message
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x", "max_tokens": 100000000000000000000}',  # 21 digits
        b'{"prompt": "x", "max_tokens": -100000000000000000000}',
        b'{"prompt": "x", "max_tokens": 1' + b"0" * 255 + b"}",  # the longest number the limit allows
    ],
)
def test_fast_mode_refuses_max_tokens_beyond_20_digits(relay_twin, body):
    error = refusal(fast_relay(relay_twin), body, False)
    assert error.param == "max_tokens" and "at most 20 digits" in error.message


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "temperature": -Infinity}',
        b'\xef\xbb\xbf{"prompt": "x"}',  # a byte order mark
        '{"prompt": "x"}'.encode("utf-16-le"),
        '{"prompt": "x"}'.encode("utf-32"),
        b'{"prompt": "\xed\xa0\x80"}',  # an encoded surrogate (json.loads decodes with surrogatepass)
    ],
)
def test_both_modes_refuse_what_only_pythons_json_reads(relay_twin, body):
    """The parsed mode's ``json.loads`` takes these, which RFC 8259 does not: its scan of the body
    (the one that finds repeated keys) refuses them as the fast mode does."""
    fast = refusal(fast_relay(relay_twin), body, False)
    assert fast.param is None
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, False)
    assert parsed.param is None and parsed.message.startswith("request body is ")


def deep_value(levels: int, kind: str) -> bytes:
    """A JSON value nesting ``levels`` containers."""
    if kind == "arrays":
        return b"[" * levels + b"]" * levels
    if kind == "numbers":  # the innermost a number list: the scanners' fast path
        return b"[" * (levels - 1) + b"[1,2]" + b"]" * (levels - 1)
    return b'{"a":' * (levels - 1) + b"{}" + b"}" * (levels - 1)


#: Where limit_body puts the value, and the levels open around it there.
LIMIT_FIELDS = {"x": 1, "messages": 3, "stream_options": 2, "seed": 1, "max_tokens": 1}


def limit_body(field: str, value: bytes, chat: bool) -> tuple[bytes, int]:
    """A client body (for the route) with ``value`` in ``field``, read by the relay or not, and the
    value's offset. ``messages``: the last message's content; ``stream_options``: a member of it."""
    head = b'{"messages": [{"role": "user", "content": "x"}], ' if chat else b'{"prompt": "x", '
    if field == "messages":
        head = b'{"messages": [{"role": "user", "content": "y"}, {"role": "user", "content": '
        return head + value + b"}]}", len(head)
    head += b'"' + field.encode() + b'": '
    if field == "stream_options":
        head += b'{"include_usage": true, "x": '
        return head + value + b"}}", len(head)
    return head + value + b"}", len(head)


@pytest.mark.parametrize("field", ["x", "messages", "stream_options"])
@pytest.mark.parametrize("kind", ["arrays", "numbers", "objects"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_both_modes_hold_the_depth_limit_exactly(relay_twin, field, kind, chat):
    """JSON_MAX_DEPTH levels pass both modes and one more is refused by both, the same 400 with the
    offset of the bracket past the limit, in a field the relay reads or one it skips over."""
    chat = chat or field == "messages"
    outer = LIMIT_FIELDS[field]
    body, offset = limit_body(field, deep_value(JSON_MAX_DEPTH - outer, kind), chat)
    fast_relay(relay_twin).read_client(body, chat)
    ParsedRelay(tokids_b64=True, strip_history=True).read_client(body, chat)
    body, offset = limit_body(field, deep_value(JSON_MAX_DEPTH - outer + 1, kind), chat)
    deepest = offset + (JSON_MAX_DEPTH - outer) * (5 if kind == "objects" else 1)
    assert body[deepest] in b"[{"
    fast = refusal(fast_relay(relay_twin), body, chat)
    assert (
        fast.message
        == (
            f"request body rejected: JSON nests arrays and objects deeper than the limit of {JSON_MAX_DEPTH} "
            f"levels (byte {deepest})"
        )
        and fast.param is None
    )
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, chat)
    assert (parsed.message, parsed.param) == (fast.message, fast.param)


@pytest.mark.parametrize("field", ["x", "messages", "seed", "stream_options", "max_tokens"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_both_modes_hold_the_number_length_limit_exactly(relay_twin, field, chat):
    """A number of JSON_MAX_NUMBER_CHARS characters passes (or is refused for what it is), one more is
    the same 400 from both modes with its offset, in a field the relay skips over or one it reads."""
    chat = chat or field == "messages"
    fast_mode, parsed_mode = fast_relay(relay_twin), ParsedRelay(tokids_b64=True, strip_history=True)
    for length in (JSON_MAX_NUMBER_CHARS, JSON_MAX_NUMBER_CHARS + 1):
        token = b"9" * length if field in ("max_tokens", "seed") else b"-0." + b"7" * (length - 3)
        body, offset = limit_body(field, token, chat)
        if length == JSON_MAX_NUMBER_CHARS:
            if field == "max_tokens":  # within the limit, past the 20 digits of a token count
                assert refusal(fast_mode, body, chat).param == "max_tokens"
            else:
                fast_mode.read_client(body, chat)
                parsed_mode.read_client(body, chat)
            continue
        fast = refusal(fast_mode, body, chat)
        assert (
            fast.message
            == (
                f"request body rejected: JSON has a number longer than the limit of {JSON_MAX_NUMBER_CHARS} "
                f"characters (byte {offset})"
            )
            and fast.param is None
        )
        parsed = refusal(parsed_mode, body, chat)
        assert (parsed.message, parsed.param) == (fast.message, fast.param)


@pytest.mark.parametrize(
    "body",
    [
        # Valid JSON nested deeper than Python's recursion limit: refused by the scan, never a RecursionError.
        b'{"prompt": "x", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"prompt": "x", "x": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
        # An integer past Python's int() limit of 4300 digits: never a ValueError.
        b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
    ],
)
def test_both_modes_refuse_what_python_cannot_load(relay_twin, body):
    fast = refusal(fast_relay(relay_twin), body, False)
    parsed = refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, False)
    assert fast.message == parsed.message and "rejected: JSON" in fast.message and "limit of" in fast.message


def test_a_context_response_past_the_limits_is_502(relay_twin):
    """The workers answer within the limits; a response past them is the worker's 502, not relayed."""
    fast = fast_relay(relay_twin)
    req = fast.read_client(small_body(True, {}), True)
    for extra in (b'"x": ' + deep_value(JSON_MAX_DEPTH, "arrays"), b'"x": 1' + b"0" * JSON_MAX_NUMBER_CHARS):
        ctx = context_response(True, b64=True)
        ctx = ctx[:-1] + b", " + extra + b"}"
        error = fast_502(lambda: fast.read_context(req, ctx))
        assert error.message.startswith("context worker response cannot be relayed: JSON")
        assert "limit of" in error.message


@pytest.mark.parametrize(
    ("chat", "fields"),
    [
        (True, {"messages": [1, "two"]}),  # the elements are not read
        (False, {"prompt": [1.5, {"a": None}]}),
        (False, {"temperature": "hot", "n": "many"}),  # fields the orchestrator does not act on
    ],
)
def test_fast_mode_leaves_the_fields_it_does_not_act_on_to_the_workers(relay_twin, chat, fields):
    body = small_body(chat, fields)
    assert fast_relay(relay_twin).read_client(body, chat).max_tokens == 8
    refusal(ParsedRelay(tokids_b64=True, strip_history=True), body, chat)


# -- context and generation worker responses ------------------------------------------------------


@pytest.mark.parametrize(
    "finished",
    [
        b'{"choices": [7]}',
        b'{"choices": [{"message": "x", "finish_reason": "stop"}]}',
    ],
)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_finished_answer_that_cannot_stream_is_502(relay_twin, finished, chat):
    fast = fast_relay(relay_twin)
    req = fast.read_client(
        small_body(chat, {"stream": True, "stream_options": {"include_usage": True}}), chat
    )
    result = fast.read_context(req, finished)
    assert result.finished
    answer = fast.finished_answer(req, result)
    if finished.startswith(b'{"choices": [{"message": "x"') and not chat:
        answer_as_sse(answer, chat=chat, include_usage=True)  # completions never read "message"
        return
    error = fast_502(lambda: answer_as_sse(answer, chat=chat, include_usage=True))
    assert error.message.startswith("context worker response cannot be streamed")


def fast_502(call: Any) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        call()
    assert info.value.status == 502
    return info.value


@pytest.mark.parametrize(
    ("ctx", "message"),
    [
        (
            b'{"choices": [{"finish_reason": "not_finished",',
            "context worker response is malformed JSON: JSON is malformed: unexpected end of data (byte 46)",
        ),
        (
            b"",
            "context worker response is malformed JSON: JSON is malformed: unexpected end of data (byte 0)",
        ),
        (b'{"choices": [{}]} x', "trailing characters after the value (byte 18)"),
        (b'{"choices": [{"text": "\xff"}]}', "context worker response is not valid UTF-8 (byte 23)"),
        (b'{"choices": [{}], "choices": [{}]}', "cannot be relayed: JSON has duplicate key 'choices'"),
        (
            b'{"choices": [{}], "usage": {"completion_tokens": 1, "completion_tokens": 2}}',
            "duplicate key 'completion_tokens'",
        ),
        (
            b'{"choices": [{"finish_reason": "stop", "finish_reason": "length"}]}',
            "duplicate key 'finish_reason'",
        ),
        (b"[1]", "cannot be relayed: context response is not a JSON object"),
        (b'"choices"', "not a JSON object"),
        (b'{"usage": {}}', "has no choices[0]"),
        (b'{"choices": []}', "has no choices[0]"),
        (b'{"choices": "x"}', "has no choices[0]"),
        (b'{"choices": {"0": {"finish_reason": "stop"}}}', "has no choices[0]"),
        (b'{"choices": [{"finish_reason": 7}]}', "finish_reason is not a string"),
        (b'{"choices": [{"finish_reason": "not_finished"}]}', "lacks choices[0].disaggregated_params"),
        (b'{"choices": [{"finish_reason": "length", "disaggregated_params": null}]}', "lacks choices[0]"),
    ],
)
def test_malformed_context_responses_are_502s_that_say_why(relay_twin, ctx, message):
    fast = fast_relay(relay_twin)
    req = fast.read_client(small_body(True, {}), True)
    assert message in fast_502(lambda: fast.read_context(req, ctx)).message


@pytest.mark.parametrize(
    ("completion_tokens", "finished"),
    [
        (b"1", True),  # max_tokens 1: the context leg produced the whole answer
        (b"0", False),
        (b"-1", False),
        # Not an integer of at most 20 digits: unknown, so the generation leg runs.
        (b"1.0", False),
        (b'"1"', False),
        (b"true", False),
        (b"null", False),
        (b"[1]", False),
        (b"1" + b"0" * 30, False),
        (b"1" + b"0" * 255, False),
    ],
)
def test_completion_tokens_decide_whether_the_answer_is_finished(relay_twin, completion_tokens, finished):
    fast = fast_relay(relay_twin)
    req = fast.read_client(small_body(False, {"max_tokens": 1}), False)
    ctx = context_response(False, b64=True, finish="length").replace(
        b'"completion_tokens": 1', b'"completion_tokens": ' + completion_tokens
    )
    assert completion_tokens in ctx
    assert fast.read_context(req, ctx).finished is finished


def test_a_finished_answer_whose_other_choices_repeat_a_key_is_502(relay_twin):
    fast = fast_relay(relay_twin)
    req = fast.read_client(small_body(False, {"max_tokens": 1}), False)
    ctx = json.loads(context_response(False, b64=True, finish="stop"))
    ctx["choices"].append({"index": 1})
    body = (
        json.dumps(ctx)
        .encode()
        .replace(b'{"index": 1}', b'{"disaggregated_params": 1, "disaggregated_params": 2}')
    )
    result = fast.read_context(req, body)
    assert result.finished
    assert (
        "duplicate key 'disaggregated_params'" in fast_502(lambda: fast.finished_answer(req, result)).message
    )


GENERATION_RESPONSE = context_response(True, b64=True, finish="stop")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            GENERATION_RESPONSE[:-1],
            "generation worker response is malformed JSON: "
            f"JSON is malformed: unexpected end of data (byte {len(GENERATION_RESPONSE) - 1})",
        ),
        (
            b"",
            "generation worker response is malformed JSON: JSON is malformed: unexpected end of data (byte 0)",
        ),
        (
            GENERATION_RESPONSE + b"}",
            f"trailing characters after the value (byte {len(GENERATION_RESPONSE)})",
        ),
        (b'{"id": "\xc3\x28"}', "generation worker response is not valid UTF-8 (byte 8)"),
        (
            b'{"choices": [{"message": {"content": "a\x01"}}]}',
            "unescaped control character in string (byte 39)",
        ),
        (b"[1]", "generation worker response cannot be relayed: the response body must be a JSON object"),
        (b"null", "must be a JSON object"),
        (
            b'{"prompt_token_ids": [1], "prompt_token_ids": null}',
            "generation worker response cannot be relayed: JSON has duplicate key 'prompt_token_ids'",
        ),
        (
            b'{"choices": [{"disaggregated_params": {}, "disaggregated_params": {}}]}',
            "duplicate key 'disaggregated_params'",
        ),
    ],
)
def test_malformed_generation_responses_are_502s_that_say_why(modes, body, message):
    fast, parsed = modes
    req = fast.read_client(small_body(True, {}), True)
    assert message in fast_502(lambda: fast.client_answer(req, body)).message
    parsed_req = parsed.read_client(small_body(True, {}), True)
    fast_502(lambda: parsed.client_answer(parsed_req, body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "x", "choices": [{"index": 0, "text": "hi"}]}',
        b'{"choices": [], "usage": {"completion_tokens": 1' + b"0" * 255 + b"}}",
        b'{"choices": [{"logprobs": ' + b"[" * 509 + b"]" * 509 + b"}]}",  # 512 levels
        b'{"choices": [{"x": {"disaggregated_params": 1}}], "a": {"prompt_token_ids": 1}}',  # not internal there
    ],
)
def test_a_generation_response_with_nothing_to_cut_is_relayed_as_is(relay_twin, body):
    fast = fast_relay(relay_twin)
    req = fast.read_client(small_body(True, {}), True)
    assert fast.client_answer(req, body) is body  # one validating scan, no copy


def test_internal_fields_are_cut_from_every_choice_of_a_generation_response(modes):
    doc = json.loads(GENERATION_RESPONSE)
    doc["choices"] = [
        {"index": i, "text": str(i), "finish_reason": "stop"}
        | ({"disaggregated_params": {"request_type": "generation_only", "i": i}} if i % 3 else {})
        for i in range(12)
    ]
    body = json.dumps(doc).encode()
    answers = []
    for mode in modes:
        req = mode.read_client(small_body(False, {}), False)
        answers.append(json.loads(mode.client_answer(req, body)))
    assert answers[0] == answers[1]
    assert all("disaggregated_params" not in c for c in answers[0]["choices"])
    assert "prompt_token_ids" not in answers[0] and "prompt_token_ids_b64" not in answers[0]


# -- properties: the modes agree on generated bodies; the twins agree on every byte -----------------

STATELESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
_texts = st.text(max_size=10)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _texts
)
_any = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=2) | st.dictionaries(_texts, kids, max_size=2),
    max_leaves=4,
)
_not_a_list = _scalars | st.dictionaries(_texts, _any, max_size=2)
_counts = st.integers(-3, 40) | st.sampled_from([2**31, 2**63, 10**20 - 1, -(10**20 - 1)])
_ids = st.integers(0, 2**31 - 1)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _texts | st.none()}
)
# Each field: mostly values a client would send, sometimes anything at all.
CLIENT_FIELDS = {
    "stream": st.booleans() | st.none() | _any,
    "stream_options": st.none()
    | st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | st.none(), "x": _any})
    | st.fixed_dictionaries({"include_usage": _any})
    | _any,
    "model": _texts | st.none() | _any,
    "max_tokens": _counts | st.none() | _any,
    "max_completion_tokens": _counts | st.none() | _any,
    # The parsed mode validates each message and prompt element; the fast mode leaves that to the
    # workers (test_fast_mode_leaves_...): elements are drawn from what both take.
    "messages": st.lists(_message, min_size=1, max_size=3) | st.just([]) | _not_a_list,
    "prompt": _texts
    | st.lists(_texts, max_size=3)
    | st.lists(_ids, max_size=3)
    | st.lists(st.lists(_ids, max_size=3), max_size=2)
    | _not_a_list,
    "temperature": st.floats(0, 2),
    "user": _texts,
}
INTERNAL = {
    "disaggregated_params": {"request_type": "context_only"},
    "prompt_token_ids_b64": "AQAAAA==",
    "prompt_token_ids": [1, 2],
}


@st.composite
def generated_client_bodies(draw: st.DrawFn) -> bytes:
    fields = draw(st.fixed_dictionaries({}, optional=CLIENT_FIELDS))
    for route_field in ("messages", "prompt"):  # mostly present, and mostly usable
        if draw(st.sampled_from([True, True, True, False])):
            usable = [{"role": "user", "content": "x"}] if route_field == "messages" else "x"
            fields[route_field] = draw(CLIENT_FIELDS[route_field]) if draw(st.booleans()) else usable
    internal = draw(st.sampled_from([*[None] * 12, *INTERNAL]))  # now and then
    if internal is not None:
        fields[internal] = INTERNAL[internal]
    order = draw(st.permutations(list(fields)))
    indent = draw(st.sampled_from([None, 0, 2]))
    return json.dumps({k: fields[k] for k in order}, indent=indent, ensure_ascii=draw(st.booleans())).encode()


def outcome(call: Any, *args: Any) -> tuple[Any, ...]:
    """What a relay call gave: its result, or the HTTPError (anything else fails the test)."""
    try:
        return ("ok", call(*args))
    except HTTPError as exc:
        return ("refused", exc.status, exc.message, exc.param)


def _fields(req: Any) -> tuple[Any, ...]:
    return (req.stream, req.include_usage, req.max_tokens, req.model)


@given(body=generated_client_bodies(), chat=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=STATELESS)
def test_both_modes_accept_and_refuse_the_same_client_bodies(relay_twin, body, chat):
    fast = fast_relay(relay_twin)
    parsed = ParsedRelay(tokids_b64=True, strip_history=True)
    got = [outcome(lambda mode=mode: _fields(mode.read_client(body, chat))) for mode in (fast, parsed)]
    event(f"{got[0][0]}: {got[0][-1] if got[0][0] == 'refused' else 'ok'}")
    assert got[0][0] == got[1][0], (body, got)
    if got[0][0] == "ok":
        assert got[0] == got[1]
        context_requests = [
            json.loads(m.context_request(m.read_client(body, chat), DISAGG_ID)) for m in (fast, parsed)
        ]
        assert context_requests[0] == context_requests[1]
    else:
        assert got[0][1] == got[1][1] == 400


_MUTATION_BYTES = st.sampled_from([*b'"{}[],:\\ 0-.eEtfnu\x00\x1f\x7f\xc3\xa9\xed\xff\x80\xf4'])


@st.composite
def mutated(draw: st.DrawFn, bodies: Any) -> bytes:
    body = bytearray(draw(bodies))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(body)))
        kind = draw(st.sampled_from(["cut", "drop", "insert", "replace", "repeat"]))
        if kind == "cut":
            del body[at:]
        elif kind == "drop":
            del body[at : at + 1]
        elif kind == "insert":
            body.insert(at, draw(_MUTATION_BYTES))
        elif kind == "replace" and at < len(body):
            body[at] = draw(_MUTATION_BYTES)
        elif kind == "repeat":
            end = draw(st.integers(at, min(len(body), at + 40)))
            body[at:at] = body[at:end]
    return bytes(body)


def _ctx_bodies() -> Any:
    return st.tuples(st.booleans(), st.booleans(), st.sampled_from(["length", "not_finished", "stop"])).map(
        lambda t: context_response(t[0], b64=t[1], finish=t[2])
    )


@given(
    body=mutated(generated_client_bodies() | st.sampled_from([client_body(True), client_body(False)])),
    ctx=mutated(_ctx_bodies()),
    gen=mutated(_ctx_bodies()),
    chat=st.booleans(),
)
@settings(max_examples=300, deadline=None, suppress_health_check=STATELESS)
def test_fast_mode_gives_the_same_answer_on_both_twins_and_only_http_errors(relay_twin, body, ctx, gen, chat):
    twins = [fast_relay(relay_twin), fast_relay(relay_twin_py)]
    got = [outcome(lambda fast=fast: _fields(fast.read_client(body, chat))) for fast in twins]
    event(f"client body {got[0][0]}")
    assert got[0] == got[1]
    # Any mutated body either side of the legs: an HTTPError or the same bytes out.
    good = client_body(chat, max_tokens=1)
    for call in (
        lambda fast: (
            fast.context_request(fast.read_client(body, chat), DISAGG_ID) if got[0][0] == "ok" else None
        ),
        lambda fast: fast.read_context(fast.read_client(good, chat), ctx).parsed,
        lambda fast: _generation(fast, good, chat, ctx),
        lambda fast: fast.client_answer(fast.read_client(good, chat), gen),
    ):
        assert outcome(call, twins[0]) == outcome(call, twins[1])
    parsed = ParsedRelay(tokids_b64=True, strip_history=True)
    outcome(lambda: parsed.read_client(body, chat))  # only HTTPErrors there too


def _generation(fast: FastRelay, good: bytes, chat: bool, ctx: bytes) -> Any:
    req = fast.read_client(good, chat)
    result = fast.read_context(req, ctx)
    if not result.finished:
        return fast.generation_request(req, result)
    answer = fast.finished_answer(req, result)
    return answer, answer_as_sse(answer, chat=chat, include_usage=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", True), ("n", 1.0), ("n", "1"), ("seed", "5"), ("seed", True), ("top_k", 1.0), ("temperature", True),
     ("temperature", "0.5"), ("top_p", False), ("model", 5), ("stop", [1]), ("stop", 1)],
)  # fmt: skip
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_parsed_mode_reads_fields_strictly(field, value, chat):
    """Lax pydantic would convert these (``true`` to 1, ``"5"`` to 5) and send the converted value on,
    a reading the workers (which refuse them) never make: the parsed mode refuses them."""
    error = refusal(ParsedRelay(tokids_b64=True, strip_history=True), small_body(chat, {field: value}), chat)
    assert error.param is not None and error.param.split(".")[0] == field


def test_the_parsed_mode_sends_strict_numbers_on_unchanged():
    parsed = ParsedRelay(tokids_b64=True, strip_history=True)
    body = small_body(False, {"temperature": 1, "top_p": 0.5, "n": 1, "seed": 7, "top_k": 3, "stop": ["x"]})
    sent = json.loads(parsed.context_request(parsed.read_client(body, False), DISAGG_ID))
    assert (sent["temperature"], sent["top_p"], sent["n"], sent["seed"], sent["top_k"], sent["stop"]) == (
        1.0,
        0.5,
        1,
        7,
        3,
        ["x"],
    )
