"""The zero-parse relay (``fastcore.relay``: the relay kernels) on both twins, against parse->modify->dump
references."""

from __future__ import annotations

import base64
import json
import struct
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle.relay import reference_context_request, reference_generation_request, reference_strip

import fastcore
from fastcore import JSONSpanError, RelayError
from fastcore import _relay_py as tables
from fastcore import relay as relay_module
from fastcore.relay import Relay

STATELESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture
def relay(relay_twin: ModuleType) -> Relay:
    return PiecesCheckedRelay(relay_twin)


class PiecesCheckedRelay(Relay):
    """A twin's kernels whose bytes legs (``context_request``, ``generation_request``, and the builders
    through them) also run the pieces forms, and check them: the join is the bytes, a refusal is the
    same, each view is a long run of the scans' bodies and no two ``bytes`` pieces are adjacent. So
    every case of this module checks both forms on both twins."""

    def __init__(self, twin: ModuleType) -> None:
        super().__init__(twin)
        self.context_request = _checked(twin.context_request, twin.context_request_pieces, twin.VIEW_MIN)
        self.generation_request = _checked(
            twin.generation_request, twin.generation_request_pieces, twin.VIEW_MIN
        )


def _checked(whole: Any, as_pieces: Any, view_min: int) -> Any:
    def call(*args: Any) -> bytes:
        try:
            expected = whole(*args)
        except Exception as exc:
            with pytest.raises(type(exc)) as info:
                as_pieces(*args)
            assert str(info.value) == str(exc) and getattr(info.value, "field", None) == getattr(
                exc, "field", None
            )
            raise
        pieces = as_pieces(*args)
        assert b"".join(pieces) == expected
        bodies = [scan.body for scan in args[:2] if hasattr(scan, "body")]
        for before, piece in zip([None, *pieces], pieces, strict=False):
            assert len(piece) > 0
            if type(piece) is memoryview:
                assert len(piece) >= view_min and any(piece.obj is body for body in bodies)
            else:
                assert type(piece) is bytes and type(before) is not bytes
        return expected

    return call


def is_chat(client: bytes) -> bool:
    return "messages" in json.loads(client)


# -- generated bodies ----------------------------------------------------------------------------------

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=30) | st.sampled_from(
    ['"usage": 1', '\\"prompt_token_ids\\"', "messages", '"}]', "\\", "é\u2028\U0001f600"]
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text
)
values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3), max_leaves=8
)
RESERVED = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "disaggregated_params",
    "prompt_token_ids",
    "prompt_token_ids_b64",
}
extra_fields = st.dictionaries(text.filter(lambda k: k not in RESERVED), values, max_size=4)
ids_lists = st.lists(st.integers(0, 2**31 - 1), max_size=50)


def dump(draw: st.DrawFn, value: Any) -> bytes:
    indent = draw(st.sampled_from([None, 0, 2, "\t"]))
    separators = draw(st.sampled_from([None, (",", ":"), (" ,\n", " :\r\n ")]))
    ensure_ascii = draw(st.booleans())
    return (
        " " * draw(st.integers(0, 2))
        + json.dumps(value, indent=indent, separators=separators, ensure_ascii=ensure_ascii)
    ).encode()


@st.composite
def client_bodies(draw: st.DrawFn, chat: bool) -> bytes:
    body: dict[str, Any] = draw(extra_fields)
    if chat:
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": text | st.none()}
        )
        body["messages"] = draw(st.lists(message, min_size=1, max_size=5))
    else:
        body["prompt"] = draw(text | ids_lists)
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["stream_options"] = draw(st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}))
    items = list(body.items())
    order = draw(st.permutations(range(len(items))))
    return dump(draw, dict(items[i] for i in order))


@st.composite
def context_responses(draw: st.DrawFn) -> bytes:
    ids = draw(ids_lists)
    params: dict[str, Any] = {
        "request_type": "context_only",
        "first_gen_tokens": draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=2)),
        "ctx_request_id": draw(st.integers(0, 2**63 - 1)),
        "disagg_request_id": draw(st.integers(0, 2**63 - 1)),
        "encoded_opaque_state": draw(
            st.none() | st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode())
        ),
        "ctx_info_endpoint": draw(text),
        "draft_tokens": None,
    }
    params.update(draw(st.dictionaries(text.filter(lambda k: k not in params), values, max_size=2)))
    if draw(st.booleans()):
        del params["request_type"]
    choice = {
        "index": 0,
        "text": draw(text),
        "finish_reason": draw(st.sampled_from(["length", "not_finished"])),
        "disaggregated_params": params,
    }
    response: dict[str, Any] = {"id": "cmpl-x", "object": "text_completion", "choices": [choice]}
    if draw(st.booleans()):
        response["usage"] = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    if draw(st.booleans()):
        response["prompt_token_ids"] = ids
        response["prompt_token_ids_b64"] = None
        if draw(st.booleans()):  # trtllm-serve's completions responses have no such key
            del response["prompt_token_ids_b64"]
    else:
        response["prompt_token_ids"] = None
        response["prompt_token_ids_b64"] = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
    # Both forms present, as a worker that was asked for b64 but also sends the list might.
    if draw(st.booleans()):
        response["prompt_token_ids"] = ids
        response["prompt_token_ids_b64"] = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
    return dump(draw, response)


# -- properties against the references ---------------------------------------------------------------


@given(st.booleans().flatmap(client_bodies), st.integers(0, 2**63 - 1), st.booleans())
@settings(max_examples=120, deadline=None, suppress_health_check=STATELESS)
def test_context_request_matches_reference(
    relay: Relay, client: bytes, request_id: int, return_b64: bool
) -> None:
    out = relay.build_context_request(client, disagg_request_id=request_id, return_b64=return_b64)
    assert json.loads(out) == reference_context_request(client, request_id, return_b64)
    read = relay.read_client_request(client, is_chat(client))
    assert relay.context_request(read, request_id, return_b64) == out


@given(st.booleans().flatmap(client_bodies), context_responses(), st.booleans(), st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=STATELESS)
def test_generation_request_matches_reference(
    relay: Relay, client: bytes, ctx: bytes, tokids_b64: bool, strip_history: bool
) -> None:
    response = json.loads(ctx)
    if (
        tokids_b64 and response.get("prompt_token_ids_b64") is None and response["prompt_token_ids"] is None
    ) or (not tokids_b64 and response["prompt_token_ids"] is None):
        with pytest.raises(RelayError) as info:
            relay.build_generation_request(client, ctx, tokids_b64=tokids_b64, strip_history=strip_history)
        assert info.value.field == ("prompt_token_ids_b64" if tokids_b64 else "prompt_token_ids")
        return
    out = relay.build_generation_request(client, ctx, tokids_b64=tokids_b64, strip_history=strip_history)
    assert json.loads(out) == reference_generation_request(client, ctx, tokids_b64, strip_history)
    if tokids_b64 and response.get("prompt_token_ids_b64") is not None:
        # The relayed string is the context response's bytes, verbatim.
        relayed = fastcore.find_span(out, ("prompt_token_ids_b64",))
        original = fastcore.find_span(ctx, ("prompt_token_ids_b64",))
        assert out[relayed[0] : relayed[1]] == ctx[original[0] : original[1]]
    # The orchestrator's path: each body read once, the scans handed on, the same bytes.
    read = relay.read_client_request(client, is_chat(client))
    context = relay.read_context_response(ctx, read.max_tokens)
    assert not context.finished
    assert context.spans == tuple(fastcore.find_spans(ctx, tables.CONTEXT_RESPONSE_PATHS))
    assert read.spans == tuple(fastcore.find_spans(client, tables.CLIENT_REQUEST_PATHS))
    assert relay.generation_request(read, context, tokids_b64, strip_history) == out
    assert (
        relay.build_generation_request(read, context, tokids_b64=tokids_b64, strip_history=strip_history)
        == out
    )


@given(context_responses(), st.integers(0, 12), st.booleans())
@settings(max_examples=100, deadline=None, suppress_health_check=STATELESS)
def test_strip_internal_fields_matches_reference(
    relay: Relay, ctx: bytes, extra_choices: int, pretty: bool
) -> None:
    doc = json.loads(ctx)
    doc["choices"] += [
        {"index": i + 1, "disaggregated_params": {"x": i}} if i % 2 else {"index": i + 1}
        for i in range(extra_choices)
    ]
    body = json.dumps(doc, indent=1 if pretty else None).encode()
    out = relay.strip_internal_fields(body)
    assert json.loads(out) == reference_strip(body)


# -- build_context_request -----------------------------------------------------------------------------


def test_context_request_exact_bytes(relay: Relay) -> None:
    client = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    assert relay.build_context_request(client, disagg_request_id=7205759403792793601, return_b64=True) == (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false,'
        b'"stream_options":null,"disaggregated_params":{"request_type":"context_only",'
        b'"disagg_request_id":7205759403792793601,"return_prompt_token_ids_b64":true}}'
    )
    assert relay.build_context_request(b' { "prompt":"x" } ', disagg_request_id=1, return_b64=False) == (
        b' { "prompt":"x" ,"stream":false,"stream_options":null,"disaggregated_params":'
        b'{"request_type":"context_only","disagg_request_id":1}} '
    )
    replaced = relay.build_context_request(
        b'{"stream_options": {"include_usage": true}, "stream": false, "prompt": "x"}',
        disagg_request_id=2,
        return_b64=False,
    )
    assert json.loads(replaced) == {
        "stream_options": None,
        "stream": False,
        "prompt": "x",
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 2},
    }


@pytest.mark.parametrize("request_id", [True, 1.0, "7", None])
def test_context_request_id_must_be_an_int(relay: Relay, request_id: Any) -> None:
    with pytest.raises(TypeError, match="disagg_request_id"):
        relay.build_context_request(b'{"prompt": "x"}', disagg_request_id=request_id, return_b64=False)


# -- client bodies the relay refuses -------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, chat, field",
    [
        (b'{"messages": [], "disaggregated_params": {}}', True, "disaggregated_params"),
        (b'{"prompt": "x", "disaggregated_params": null}', False, "disaggregated_params"),
        (b'{"messages": [], "prompt_token_ids_b64": "AAAA"}', True, "prompt_token_ids_b64"),
        (b'{"prompt": "x", "prompt_token_ids_b64": "AAAA"}', False, "prompt_token_ids_b64"),
        (b'{"messages": [], "prompt_token_ids": [1]}', True, "prompt_token_ids"),
        (
            b'{"messages": [], "prompt_token_\\u0069ds": [1]}',
            True,
            "prompt_token_ids",
        ),  # spelled with an escape
        (b'{"prompt_token_ids": [1]}', True, "prompt_token_ids"),  # the route decides, not the body
    ],
)
def test_internal_fields_from_clients_are_refused(relay: Relay, body: bytes, chat: bool, field: str) -> None:
    for call in (
        lambda: relay.read_client_request(body, chat),
        lambda: relay.build_context_request(body, disagg_request_id=1, return_b64=True, chat=chat),
        lambda: relay.build_generation_request(body, CTX, tokids_b64=True, strip_history=False, chat=chat),
    ):
        with pytest.raises(RelayError) as info:
            call()
        assert info.value.field == field
        assert field in str(info.value)
        assert not str(info.value).startswith("context worker")


def test_the_route_is_read_once(relay: Relay) -> None:
    chat = relay.read_client_request(CHAT, True)
    assert chat.chat and chat.body is CHAT
    completion = relay.read_client_request(b'{"prompt": "x"}', False)
    assert not completion.chat
    guessed = relay.build_context_request(b'{"prompt": "x"}', disagg_request_id=1, return_b64=False)
    assert guessed == relay.context_request(completion, 1, False)
    forced = relay.read_client_request(b'{"prompt": "x", "messages": [1]}', True)
    out = json.loads(relay.build_generation_request(forced, CTX, tokids_b64=False, strip_history=False))
    assert (
        out["prompt_token_ids"] == IDS and out["prompt"] == "x"
    )  # chat rules: the ids go in prompt_token_ids
    with pytest.raises(RelayError) as info:
        relay.read_client_request(b'{"prompt": "x", "prompt_token_ids": [1]}', True)
    assert info.value.field == "prompt_token_ids"


def test_without_a_route_the_body_decides_once(relay: Relay) -> None:
    # chat=None: chat if the body has messages, as when the guess scanned first; a chat read that is
    # refused is the answer only when messages is there.
    def guessed(body: bytes) -> bytes:
        return relay.build_context_request(body, disagg_request_id=1, return_b64=False)

    assert guessed(CHAT) == relay.context_request(relay.read_client_request(CHAT, True), 1, False)
    completion = b'{"prompt": [1], "prompt_token_ids": [1]}'  # an internal field on chat only
    assert guessed(completion) == relay.context_request(
        relay.read_client_request(completion, False), 1, False
    )
    for body, field in ((b'{"messages": [], "prompt": "x"}', "messages"), (b'{"messages": 1}', "messages")):
        with pytest.raises(RelayError) as info:
            guessed(body)
        assert info.value.field == field
    with pytest.raises(RelayError) as info:
        guessed(b'{"max_tokens": 1}')  # neither: the completions read says what is missing
    assert info.value.field == "prompt"


def test_completions_may_carry_prompt_token_ids(relay: Relay) -> None:
    body = b'{"prompt": [1, 2], "prompt_token_ids": [1, 2]}'
    relay.read_client_request(body, False)
    out = relay.build_context_request(body, disagg_request_id=3, return_b64=False)
    assert json.loads(out)["prompt_token_ids"] == [1, 2]


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"42", b"null", b' [{"messages": []}] '])
def test_client_body_must_be_an_object(relay: Relay, body: bytes) -> None:
    with pytest.raises(RelayError, match="must be a JSON object"):
        relay.read_client_request(body, True)
    with pytest.raises(RelayError, match="must be a JSON object"):
        relay.build_context_request(body, disagg_request_id=1, return_b64=False)


@pytest.mark.parametrize(
    "body, offset",
    [(b'{"messages": [}', 14), (b'{"stream": true, "stream": false}', 17), (b"", 0), (b'{"a": "\xff"}', 7)],
)
def test_malformed_client_bodies_name_the_byte(relay: Relay, body: bytes, offset: int) -> None:
    with pytest.raises(JSONSpanError) as info:
        relay.build_context_request(body, disagg_request_id=1, return_b64=False)
    assert info.value.offset == offset


# -- context responses ---------------------------------------------------------------------------------

IDS = [1, 9038, 2501, 29871, 13]
B64 = base64.b64encode(struct.pack("<5i", *IDS)).decode()
PARAMS = {
    "request_type": "context_only",
    "first_gen_tokens": [3681],
    "ctx_request_id": 11,
    "disagg_request_id": 7205759403792793601,
    "encoded_opaque_state": None,
    "ctx_info_endpoint": "127.0.0.1:9000",
    "draft_tokens": None,
}


def context_response(finish_reason: Any = "length", **fields: Any) -> bytes:
    response: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris"},
                "finish_reason": finish_reason,
                "disaggregated_params": PARAMS,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "prompt_token_ids": IDS,
        "prompt_token_ids_b64": B64,
    }
    response.update(fields)
    return json.dumps(response).encode()


CTX = context_response()
CHAT = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "capital?"}],
        "stream": True,
    }
).encode()


@pytest.mark.parametrize(
    "finish_reason, follows",
    [("length", True), ("not_finished", True), ("stop", False), (None, False), ("abort", False)],
)
def test_read_context_response(relay: Relay, finish_reason: str | None, follows: bool) -> None:
    ctx = context_response(finish_reason)
    info = relay.read_context_response(ctx, None)
    assert type(info) is relay.ContextScan
    assert info.finish_reason == finish_reason
    assert info.finished is not follows
    spans = info.spans
    assert json.loads(ctx[slice(*spans[tables.X_DP])]) == PARAMS
    assert json.loads(ctx[slice(*spans[tables.X_USAGE])])["prompt_tokens"] == 5
    assert json.loads(ctx[slice(*spans[tables.X_IDS])]) == IDS
    assert ctx[slice(*spans[tables.X_B64])] == f'"{B64}"'.encode()


def test_read_context_response_decodes_escaped_finish_reason(relay: Relay) -> None:
    ctx = CTX.replace(b'"finish_reason": "length"', b'"finish_reason": "l\\u0065ngth"')
    assert not relay.read_context_response(ctx, None).finished


@pytest.mark.parametrize(
    "ctx, message",
    [
        (b'{"choices": [', "unexpected end of data"),
        (b"[]", "not a JSON object"),
        (context_response(5), "finish_reason is not a string"),
        (context_response({"x": 1}), "finish_reason is not a string"),
    ],
)
def test_bad_context_responses(relay: Relay, ctx: bytes, message: str) -> None:
    error = JSONSpanError if "end of data" in message else RelayError
    with pytest.raises(error, match=message):
        relay.read_context_response(ctx, None)


def test_generation_request_exact_bytes(relay: Relay) -> None:
    out = relay.build_generation_request(CHAT, CTX, tokids_b64=True, strip_history=True)
    assert out == (
        b'{"model": "m", "messages": [{"role": "user", "content": "capital?"}], "stream": true,'
        b'"disaggregated_params":{"request_type": "generation_only", "first_gen_tokens": [3681], '
        b'"ctx_request_id": 11, "disagg_request_id": 7205759403792793601, "encoded_opaque_state": null, '
        b'"ctx_info_endpoint": "127.0.0.1:9000", "draft_tokens": null,'
        b'"ctx_usage":{"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},'
        b'"prompt_token_ids_b64":"' + B64.encode() + b'"}'
    )


def test_generation_request_completions(relay: Relay) -> None:
    client = b'{"model": "m", "prompt": "The capital of France is", "max_tokens": 8}'
    listed = json.loads(relay.build_generation_request(client, CTX, tokids_b64=False, strip_history=True))
    assert listed["prompt"] == IDS and "prompt_token_ids" not in listed
    relayed = json.loads(relay.build_generation_request(client, CTX, tokids_b64=True, strip_history=True))
    assert relayed["prompt_token_ids_b64"] == B64 and relayed["prompt"] == "The capital of France is"
    with pytest.raises(RelayError, match="'prompt' must be a string or an array"):
        relay.build_generation_request(b"{}", CTX, tokids_b64=False, strip_history=False, chat=False)


def test_generation_request_replaces_ctx_usage_and_adds_request_type(relay: Relay) -> None:
    params = {k: v for k, v in PARAMS.items() if k != "request_type"} | {"ctx_usage": "stale"}
    ctx = json.dumps(
        {"choices": [{"finish_reason": "length", "disaggregated_params": params}], "prompt_token_ids": IDS}
    ).encode()
    out = json.loads(relay.build_generation_request(CHAT, ctx, tokids_b64=False, strip_history=False))
    assert out["disaggregated_params"]["ctx_usage"] is None  # no usage in the context response
    assert out["disaggregated_params"]["request_type"] == "generation_only"
    empty = json.dumps({"choices": [{"disaggregated_params": {}}], "prompt_token_ids": IDS}).encode()
    out = json.loads(relay.build_generation_request(CHAT, empty, tokids_b64=False, strip_history=False))
    assert out["disaggregated_params"] == {"request_type": "generation_only", "ctx_usage": None}


@pytest.mark.parametrize(
    "messages",
    [b'[{"role": "user", "content": "only"}]', b'[1, [2], {"a": "]"}]', b" [ 1 , 2 ] "],
)
def test_strip_history_edge_cases(relay: Relay, messages: bytes) -> None:
    client = b'{"messages": ' + messages + b', "model": "m"}'
    out = relay.build_generation_request(client, CTX, tokids_b64=True, strip_history=True)
    expected = json.loads(messages)
    assert json.loads(out)["messages"] == (expected[-1:] if isinstance(expected, list) else expected)


@pytest.mark.parametrize(
    "ctx, tokids_b64, field, message",
    [
        (
            context_response(prompt_token_ids_b64=None, prompt_token_ids=None),
            True,
            "prompt_token_ids_b64",
            "no prompt_token_ids_b64 string",
        ),
        (
            context_response(prompt_token_ids_b64=[1]),
            True,
            "prompt_token_ids_b64",
            "no prompt_token_ids_b64 string",
        ),
        (context_response(prompt_token_ids=None), False, "prompt_token_ids", "no prompt_token_ids list"),
        (context_response(prompt_token_ids="1 2"), False, "prompt_token_ids", "no prompt_token_ids list"),
        (
            context_response(prompt_token_ids_b64="AQAA*AAA"),
            True,
            "prompt_token_ids_b64",
            "invalid base64 character",
        ),
        (
            context_response(prompt_token_ids_b64="AQAAAAA"),
            True,
            "prompt_token_ids_b64",
            "not a multiple of 4",
        ),
        (context_response(prompt_token_ids_b64="AQ=A"), True, "prompt_token_ids_b64", "padding"),
        (
            context_response(prompt_token_ids_b64="AQAAAAA="),
            True,
            "prompt_token_ids_b64",
            "whole number of int32",
        ),
        (
            context_response(choices=[{"finish_reason": "length"}]),
            True,
            "disaggregated_params",
            "lacks choices",
        ),
        (
            context_response(choices=[{"disaggregated_params": [1]}]),
            True,
            "disaggregated_params",
            "no choices",
        ),
        (context_response(choices=[]), False, "choices", "no choices"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_generation_request_refuses_bad_context_responses(
    relay: Relay, ctx: bytes, tokids_b64: bool, field: str | None, message: str
) -> None:
    with pytest.raises(RelayError, match=message) as info:
        relay.build_generation_request(CHAT, ctx, tokids_b64=tokids_b64, strip_history=False)
    assert info.value.field == field
    assert str(info.value).startswith("context worker response")


def test_escaped_base64_is_refused_not_relayed(relay: Relay) -> None:
    # "\/" is a legal JSON spelling of "/", but the bytes are relayed as they are.
    ctx = CTX.replace(B64.encode(), b"AQ\\/AAAA")
    with pytest.raises(RelayError, match="invalid base64 character"):
        relay.build_generation_request(CHAT, ctx, tokids_b64=True, strip_history=False)


# -- strip_internal_fields -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, expected",
    [
        (b'{"prompt_token_ids": [1]}', b"{}"),
        (b'{ "prompt_token_ids" : [1] }', b"{  }"),
        (b'{"prompt_token_ids": [1], "a": 1}', b'{"a": 1}'),
        (b'{"a": 1, "prompt_token_ids": [1]}', b'{"a": 1}'),
        (b'{"a": 1, "prompt_token_ids": [1], "b": 2}', b'{"a": 1, "b": 2}'),
        (b'{"prompt_token_ids": [1], "prompt_token_ids_b64": "AAAA"}', b"{}"),
        (b'{"prompt_token_ids": [1], "prompt_token_ids_b64": "AAAA", "a": 1}', b'{"a": 1}'),
        (b'{"a": 1, "prompt_token_ids": [1], "prompt_token_ids_b64": "AAAA"}', b'{"a": 1}'),
        (b'{"prompt_token_ids": [1], "a": 1, "prompt_token_ids_b64": "AAAA"}', b'{"a": 1}'),
        (b'{"a": 1, "prompt_token_ids": [1],\n "b": 2, "prompt_token_ids_b64": "AAAA"}', b'{"a": 1, "b": 2}'),
        (
            b'{"choices": [{"disaggregated_params": {}}, {"x": 1, "disaggregated_params": {}}], "prompt_token_ids": null}',
            b'{"choices": [{}, {"x": 1}]}',
        ),
        (b'{"a": {"prompt_token_ids": 1}}', b'{"a": {"prompt_token_ids": 1}}'),
        (b'{"a": "\\"prompt_token_ids\\": 1"}', b'{"a": "\\"prompt_token_ids\\": 1"}'),
    ],
)
def test_strip_internal_fields_at_every_position(relay: Relay, body: bytes, expected: bytes) -> None:
    out = relay.strip_internal_fields(body)
    assert out == expected
    assert json.loads(out) == reference_strip(body)


def test_strip_internal_fields_with_many_choices(relay: Relay) -> None:
    doc = {
        "choices": [{"index": i, "disaggregated_params": {"i": i}} for i in range(40)],
        "prompt_token_ids": [1],
    }
    out = relay.strip_internal_fields(json.dumps(doc).encode())
    assert json.loads(out) == {"choices": [{"index": i} for i in range(40)]}


def test_strip_internal_fields_errors(relay: Relay) -> None:
    with pytest.raises(RelayError, match="must be a JSON object"):
        relay.strip_internal_fields(b"[1]")
    with pytest.raises(JSONSpanError):
        relay.strip_internal_fields(b'{"a": ')
    with pytest.raises(JSONSpanError, match="duplicate key 'prompt_token_ids'"):
        relay.strip_internal_fields(b'{"prompt_token_ids": 1, "prompt_token_ids": 2}')


def test_module_functions_use_the_active_twin() -> None:
    import fastcore

    assert relay_module._default.twin is fastcore._relay_impl
    assert relay_module.read_client_request is fastcore._relay_impl.read_client_request
    assert json.loads(
        relay_module.build_context_request(b'{"prompt": [1]}', disagg_request_id=5, return_b64=False)
    )["disaggregated_params"] == {"request_type": "context_only", "disagg_request_id": 5}


def test_bytes_like_bodies(relay: Relay) -> None:
    """bytearray and memoryview bodies (e.g. a reused read buffer) give the same bytes out."""
    expected_context = relay.build_context_request(CHAT, disagg_request_id=9, return_b64=True)
    expected_generation = relay.build_generation_request(CHAT, CTX, tokids_b64=True, strip_history=True)
    expected_stripped = relay.strip_internal_fields(CTX)
    for kind in (bytearray, memoryview):
        assert (
            relay.build_context_request(kind(CHAT), disagg_request_id=9, return_b64=True) == expected_context
        )
        assert (
            relay.build_generation_request(kind(CHAT), kind(CTX), tokids_b64=True, strip_history=True)
            == expected_generation
        )
        assert relay.strip_internal_fields(kind(CTX)) == expected_stripped
        untouched = relay.strip_internal_fields(kind(b'{"a": 1}'))
        assert untouched == b'{"a": 1}' and type(untouched) is bytes
    body = b'{"a": 1}'
    assert relay.strip_internal_fields(body) is body  # nothing to cut: no copy


# -- strip_internal_fields on validated bytes -------------------------------------------------------


@given(context_responses(), st.integers(0, 12))
@settings(max_examples=60, deadline=None, suppress_health_check=STATELESS)
def test_strip_internal_fields_without_validation_on_validated_bytes(
    relay: Relay, ctx: bytes, extra_choices: int
) -> None:
    doc = json.loads(ctx)
    doc["choices"] += [{"index": i + 1, "disaggregated_params": {"x": i}} for i in range(extra_choices)]
    body = json.dumps(doc).encode()
    assert relay.strip_internal_fields(body, validate=False) == relay.strip_internal_fields(body)


def test_strip_internal_fields_validates_the_whole_body_by_default(relay: Relay) -> None:
    # Far from any internal field, still refused: the one scan checks every byte.
    for body in (b'{"a": [1, 2,]}', b'{"a": "\xff"}', b'{"a": {"b": tru}}', b'{"a": 1} {}'):
        with pytest.raises(JSONSpanError):
            relay.strip_internal_fields(body)
    assert relay.strip_internal_fields(b'{"a": [1, 2,]}', validate=False) == b'{"a": [1, 2,]}'


# -- the relay kernels' decisions and refusals -----------------------------------------------------------

CONTEXT_502 = "context worker response cannot be relayed: "


def kernel_outcome(call: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", call(*args))
    except (RelayError, JSONSpanError) as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "field", None), getattr(exc, "offset", None))


@pytest.mark.parametrize(
    ("finish_reason", "completion_tokens", "max_tokens", "finished"),
    [
        ("length", 1, 1, True),
        ("length", 1, 2, False),
        ("length", 1, None, False),
        ("length", "1", 1, False),  # not an integer: no decision from it
        ("length", 1.0, 1, False),
        ("length", 10**19, 10**19, True),
        ("length", 10**25, 10**24, False),  # past 20 digits: not a token count
        ("not_finished", 1, 1, False),
        ("stop", 0, 8, True),
        ("abort", 0, 8, True),
        ("tool_calls", 0, 8, True),
        ("other", 0, 8, True),
        (None, 0, 8, True),
    ],
)
def test_kernel_decides_whether_a_generation_leg_follows(
    relay: Relay, finish_reason: Any, completion_tokens: Any, max_tokens: int | None, finished: bool
) -> None:
    ctx = context_response(finish_reason, usage={"completion_tokens": completion_tokens})
    context = relay.read_context_response(ctx, max_tokens)
    assert (context.finished, context.finish_reason) == (finished, finish_reason)
    escaped = ctx.replace(b'"length"', b'"\\u006cength"')
    assert relay.read_context_response(escaped, max_tokens).finished is finished


@pytest.mark.parametrize(
    ("ctx", "message", "field"),
    [
        (b"[1]", CONTEXT_502 + "context response is not a JSON object", None),
        (
            b'{"choices": [{"finish_reason": 5}]}',
            CONTEXT_502 + "context response: choices[0].finish_reason is not a string",
            "finish_reason",
        ),
        (b'{"choices": []}', "context worker response has no choices[0]", "choices"),
        (
            b'{"choices": [{"finish_reason": "length", "disaggregated_params": []}]}',
            "context worker response lacks choices[0].disaggregated_params",
            "disaggregated_params",
        ),
    ],
)
def test_kernel_refuses_context_responses(relay: Relay, ctx: bytes, message: str, field: str | None) -> None:
    assert kernel_outcome(relay.read_context_response, ctx, None) == ("RelayError", message, field, None)


# One row a refusal: (body, chat, the message's start, field).
# fmt: off
CLIENT_REFUSALS = [
    (b"[]", True, "request body must be a JSON object", None),
    (b'{"prompt_token_ids": [1]}', True, "'prompt_token_ids' is an internal field", "prompt_token_ids"),
    (b'{"stream": 1, "messages": [1]}', True, "'stream' must be a boolean", "stream"),
    (b'{"stream_options": [], "prompt": "x"}', False, "'stream_options' must be an object", "stream_options"),
    (b'{"stream_options": {"include_usage": 0}}', False, "'include_usage' must be a boolean", "include_usage"),
    (b'{"model": 5, "prompt": "x"}', False, "'model' must be a string", "model"),
    (b'{"messages": []}', True, "'messages' must be a non-empty array", "messages"),
    (b'{"prompt": 5}', False, "'prompt' must be a string or an array", "prompt"),
    (b'{"prompt": "x", "max_tokens": 1.0}', False, "'max_tokens' must be an integer", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', False, "'max_tokens' must be an integer", "max_tokens"),
    (b'{"messages": [1], "max_completion_tokens": -123456789012345678901}', True,
     "'max_completion_tokens' must be an integer of at most 20 digits", "max_completion_tokens"),
    (b'{"messages": [1], "max_tokens": -12345678901234567890}', True,
     "'max_tokens' must be at least 1, got -12345678901234567890", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": -0}', False, "'max_tokens' must be at least 1, got 0", "max_tokens"),
]
# fmt: on


@pytest.mark.parametrize(("body", "chat", "message", "field"), CLIENT_REFUSALS)
def test_kernel_refuses_client_bodies(
    relay: Relay, body: bytes, chat: bool, message: str, field: str | None
) -> None:
    got = kernel_outcome(relay.read_client_request, body, chat)
    assert got[0] == "RelayError" and got[1].startswith(message) and got[2] == field, got


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, (False, False, None, None)),
        ({"stream": True, "stream_options": {"include_usage": True}}, (True, True, None, None)),
        ({"stream": None, "stream_options": None}, (False, False, None, None)),
        ({"stream_options": {"include_usage": None}}, (False, False, None, None)),
        ({"model": "m\u00e9\U0001f600", "max_tokens": 7}, (False, False, 7, "m\u00e9\U0001f600")),
        ({"model": 'a"\\b\u2028', "max_tokens": 10**19}, (False, False, 10**19, 'a"\\b\u2028')),
        ({"model": None, "max_tokens": None, "max_completion_tokens": 3}, (False, False, 3, None)),
        ({"max_tokens": 5, "max_completion_tokens": None}, (False, False, 5, None)),
        ({"max_tokens": 99999999999999999999}, (False, False, 99999999999999999999, None)),
    ],
)
@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_kernel_reads_the_small_fields(
    relay: Relay, fields: dict[str, Any], expected: tuple[Any, ...], ensure_ascii: bool
) -> None:
    body = json.dumps({"messages": [{"role": "user"}], **fields}, ensure_ascii=ensure_ascii).encode()
    scan = relay.read_client_request(body, True)
    assert (scan.stream, scan.include_usage, scan.max_tokens, scan.model) == expected


def test_kernels_take_bytes_like_bodies_and_only_their_own_scans(relay: Relay) -> None:
    scan = relay.read_client_request(CHAT, True)
    context = relay.read_context_response(CTX, None)
    for kind in (bytearray, memoryview):
        other = relay.read_client_request(kind(CHAT), True)
        assert type(other.body) is bytes and other == scan
        assert relay.read_context_response(kind(CTX), None) == context
        assert relay.strip_internal_fields(kind(CTX), True) == relay.strip_internal_fields(CTX, True)
    with pytest.raises(TypeError, match="body must be bytes-like, not str"):
        relay.read_client_request("{}", True)
    with pytest.raises(TypeError, match="client must be a ClientScan"):
        relay.context_request(relay.read_context_response(CTX, None), 1, True)
    with pytest.raises(TypeError, match="context must be a ContextScan"):
        relay.generation_request(scan, scan, True, True)
    for bad_id in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="disagg_request_id must be an int"):
            relay.context_request(scan, bad_id, True)
    assert (
        scan != context
        and scan == scan
        and scan != relay.read_client_request(CHAT.replace(b'"m"', b'"n"'), True)
    )
    with pytest.raises(TypeError):
        hash(scan)
    assert "ClientScan(" in repr(scan) and "ContextScan(" in repr(context)


# -- the list fallback, trtllm-serve's extra params, the auth fields --------------------------------------

COMPLETION = json.dumps({"model": "m", "prompt": "capital?", "max_tokens": 4}).encode()


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("b64", ["null", "absent"])
def test_asked_for_base64_and_got_the_list_relays_the_list(relay: Relay, chat: bool, b64: str) -> None:
    # trtllm-serve's chat responses carry "prompt_token_ids_b64": null unless asked; its completions
    # responses carry no such key. Either way the orchestrator relays the list (docs/protocol.md (2)).
    fields: dict[str, Any] = {"prompt_token_ids": IDS, "prompt_token_ids_b64": None}
    ctx = json.loads(context_response(**fields))
    if b64 == "absent":
        del ctx["prompt_token_ids_b64"]
    raw = json.dumps(ctx).encode()
    client = CHAT if chat else COMPLETION
    scan = relay.read_client_request(client, chat)
    kernel = relay.generation_request(scan, relay.read_context_response(raw, None), True, False)
    built = relay.build_generation_request(client, raw, tokids_b64=True, strip_history=False, chat=chat)
    assert kernel == built
    out = json.loads(kernel)
    assert "prompt_token_ids_b64" not in out
    assert out["prompt_token_ids" if chat else "prompt"] == IDS


def test_a_base64_string_wins_over_the_list_and_a_non_string_is_502(relay: Relay) -> None:
    scan = relay.read_client_request(CHAT, True)
    both = context_response(prompt_token_ids=IDS, prompt_token_ids_b64=B64)
    out = json.loads(relay.generation_request(scan, relay.read_context_response(both, None), True, False))
    assert out["prompt_token_ids_b64"] == B64 and "prompt_token_ids" not in out
    bad = context_response(prompt_token_ids=IDS, prompt_token_ids_b64=7)
    with pytest.raises(RelayError, match="no prompt_token_ids_b64 string") as info:
        relay.generation_request(scan, relay.read_context_response(bad, None), True, False)
    assert info.value.field == "prompt_token_ids_b64"


def test_trtllm_serves_extra_params_reach_the_generation_leg_verbatim(relay: Relay) -> None:
    from fastcore import protocol

    extras = {
        "schedule_style": 1,
        "ctx_dp_rank": 3,
        "first_gen_log_probs": [{"1": -0.5}],
        "first_gen_logits": None,
        "resolved_thinking": True,
    }
    assert set(extras) == set(protocol.TRTLLM_EXTRA_DISAGG_FIELDS)
    ctx = context_response(
        choices=[
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant"},
                "disaggregated_params": {**PARAMS, **extras},
            }
        ]
    )
    scan = relay.read_client_request(CHAT, True)
    out = json.loads(relay.generation_request(scan, relay.read_context_response(ctx, None), True, False))
    params = out["disaggregated_params"]
    assert params == {
        **PARAMS,
        **extras,
        "request_type": "generation_only",
        "ctx_usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"ctx_info_endpoint": "tcp://h:1", "encoded_opaque_state": "AAAA"}, ("tcp://h:1", "AAAA")),
        ({"ctx_info_endpoint": ["tcp://h:1", "tcp://h:2"]}, (["tcp://h:1", "tcp://h:2"], None)),
        ({"encoded_opaque_state": "QQ==", "ctx_info_endpoint": None}, (None, "QQ==")),
        ({}, (None, None)),
    ],
)
def test_the_auth_fields_of_a_context_response(relay: Relay, params: dict[str, Any], expected: tuple) -> None:
    choice = {
        "index": 0,
        "finish_reason": "length",
        "disaggregated_params": {"request_type": "context_only", **params},
    }
    scan = relay.read_context_response(context_response(choices=[choice]), None)
    assert scan.auth_fields() == expected


def test_a_repeated_auth_field_is_refused(relay: Relay) -> None:
    # Two copies would let the signer and the generation worker read different values.
    ctx = CTX.replace(
        b'"ctx_info_endpoint": "127.0.0.1:9000"', b'"ctx_info_endpoint": "a", "ctx_info_endpoint": "b"'
    )
    assert ctx != CTX
    with pytest.raises(JSONSpanError, match="ctx_info_endpoint"):
        relay.read_context_response(ctx, None)


# -- the pieces forms: views of the bodies, not copies ------------------------------------------------


def long_exchange(chat: bool, tokids_b64: bool) -> tuple[bytes, bytes, list[int]]:
    """A client body of ~40 KB and the context response of its 40k prompt ids."""
    ids = list(range(40_000))
    history = [{"role": "user", "content": f"turn {n} " + "x" * 400} for n in range(100)]
    route: dict[str, Any] = {"messages": history} if chat else {"prompt": "p" * 40_000}
    client = json.dumps({"model": "m", "user": "u" * 5_000, **route})
    response = json.loads(context_response(prompt_token_ids=ids))
    if tokids_b64:
        response["prompt_token_ids_b64"] = fastcore.encode_tokens(ids).decode()
    return client.encode(), json.dumps(response).encode(), ids


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("tokids_b64", [True, False], ids=["b64", "list"])
def test_generation_pieces_view_the_prompt_ids_of_the_context_response(
    relay: Relay, chat: bool, tokids_b64: bool
) -> None:
    client, ctx, ids = long_exchange(chat, tokids_b64)
    scan = relay.read_client_request(client, chat)
    context = relay.read_context_response(ctx, None)
    pieces = relay.generation_request_pieces(scan, context, tokids_b64, False)
    ids_text = json.dumps(fastcore.encode_tokens(ids).decode() if tokids_b64 else ids).encode()
    views = [piece for piece in pieces if type(piece) is memoryview]
    assert any(piece.obj is ctx and piece.tobytes() == ids_text for piece in views)  # no copy of the ids
    assert any(piece.obj is client for piece in views)  # nor of the client body's long runs
    copied = sum(len(piece) for piece in pieces if type(piece) is bytes)
    assert copied < 1_000  # the new text only
    assert b"".join(pieces) == relay.generation_request(scan, context, tokids_b64, False)


def test_context_pieces_view_the_client_body(relay: Relay) -> None:
    client, _, _ = long_exchange(True, True)
    scan = relay.read_client_request(client, True)
    pieces = relay.context_request_pieces(scan, 7, True)
    assert [type(piece) for piece in pieces] == [memoryview, bytes]
    assert pieces[0].obj is client and len(pieces[0]) == len(client) - 1
    assert b"".join(pieces) == relay.context_request(scan, 7, True)


def test_short_bodies_come_as_one_piece(relay: Relay) -> None:
    """Runs under ``VIEW_MIN`` bytes are copied: a 1 KB leg is one ``bytes``, as before."""
    client = json.dumps({"messages": [{"role": "user", "content": "x" * 1000}]}).encode()
    scan = relay.read_client_request(client, True)
    context = relay.read_context_response(context_response(), None)
    pieces = relay.generation_request_pieces(scan, context, False, False)
    assert len(pieces) == 1 and type(pieces[0]) is bytes
    assert relay.context_request_pieces(scan, 1, False) == [relay.context_request(scan, 1, False)]


def test_pieces_keep_what_they_view_alive(relay: Relay) -> None:
    """A view holds a reference to the bytes it views: the pieces stay valid with the bodies and the
    scans dropped (a bytearray body was copied into the scan's own bytes)."""
    import gc

    client, ctx, _ = long_exchange(True, True)
    expected = relay.build_generation_request(client, ctx, tokids_b64=True, strip_history=False, chat=True)
    scan = relay.read_client_request(bytearray(client), True)
    context = relay.read_context_response(bytearray(ctx), None)
    pieces = relay.generation_request_pieces(scan, context, True, False)
    del scan, context, client, ctx
    gc.collect()
    assert b"".join(pieces) == expected


@pytest.mark.parametrize(
    ("body", "found"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "conversation_id": "c1"}', True),
        (b'{"conversation_id": 7, "messages": [{"role": "user", "content": "hi"}]}', True),
        (b'{"conversation_id": null, "messages": [{"role": "user", "content": "hi"}]}', True),
        (
            b'{"messages": [{"role": "user", "content": "hi", "conversation_id": "c1"}]}',
            False,
        ),  # not top level
        (b'{"messages": [{"role": "user", "content": "\\"conversation_id\\": 1"}]}', False),  # in a string
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "conversation_params": {"conversation_id": "c"}}',
            False,
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', False),
        (
            b'{"conversation\\u005fid": "c1", "messages": [{"role": "user", "content": "hi"}]}',
            True,
        ),  # escaped name
    ],
)
def test_the_client_scan_says_whether_a_top_level_conversation_id_is_there(
    relay: Relay, body: bytes, found: bool
) -> None:
    """The orchestrator moves a top-level ``conversation_id`` into trtllm-serve's ``conversation_params``;
    the client body's one validating scan says whether there is one, so a body without needs no scan
    of its own for it."""
    assert relay.read_client_request(body, True).has_conversation_id is found


def test_a_repeated_conversation_id_is_refused_by_the_client_scan(relay: Relay) -> None:
    """Which of two ids would be moved is not the orchestrator's guess: the body is refused, naming it."""
    body = (
        b'{"messages": [{"role": "user", "content": "hi"}], "conversation_id": "a", "conversation_id": "b"}'
    )
    with pytest.raises(JSONSpanError, match="duplicate key 'conversation_id'"):
        relay.read_client_request(body, True)
