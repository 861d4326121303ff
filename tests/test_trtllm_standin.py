"""The trtllm-serve stand-in (tests/trtllm_standin.py), on real sockets.

These pin what the stand-in claims about trtllm-serve, so an orchestrator
tested against it is tested against trtllm's wire behaviour: unknown fields
are refused (with FastAPI's ``{"error": ...}`` body, not ErrorResponse), a
context leg's hand-off continues deterministically on a generation leg, base64
prompt ids appear on chat only when asked, the auth header is enforced only
with a key, msgpack bodies are decoded only under the header, and SSE is
framed as trtllm frames it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from trtllm_standin import (
    AUTH_HEADER,
    EOS_ID,
    TOKENIZER,
    StandinThread,
    TrtllmStandin,
    encode_prompt_b64,
    iter_sse,
    msgpack_encode,
    render_chat,
    standin_completion,
    start_standin,
    trtllm_auth_value,
)

from server.auth import TRTLLM_AUTH_HEADER, trtllm_disagg_auth

KEY = b"standin-key"
MESSAGES = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "Name one colour."}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "once upon", "max_tokens": 6}
DISAGG_ID = (1 << 40) + 12345


def ctx_params(**extra: Any) -> dict[str, Any]:
    """The ``disaggregated_params`` an orchestrator adds to a context leg (docs/protocol.md (1))."""
    return {"request_type": "context_only", "disagg_request_id": DISAGG_ID, **extra}


def context_body(base: dict[str, Any], **dp: Any) -> dict[str, Any]:
    return {**base, "stream": False, "stream_options": None, "disaggregated_params": ctx_params(**dp)}


def generation_params(ctx_answer: dict[str, Any]) -> dict[str, Any]:
    dp = dict(ctx_answer["choices"][0]["disaggregated_params"])
    dp["request_type"] = "generation_only"
    dp["ctx_usage"] = ctx_answer["usage"]
    return dp


def signed(dp: dict[str, Any]) -> dict[str, str]:
    return {AUTH_HEADER: trtllm_auth_value(KEY, dp["ctx_info_endpoint"], dp["encoded_opaque_state"])}


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[TrtllmStandin, TrtllmStandin]]:
    """A keyed context stand-in and a keyed generation stand-in sharing a KV registry."""
    ctx = await start_standin("context", key=KEY)
    gen = await start_standin("generation", key=KEY, kv_registry=ctx.kv_registry)
    yield ctx, gen
    await ctx.stop()
    await gen.stop()


@pytest_asyncio.fixture
async def both() -> AsyncIterator[TrtllmStandin]:
    standin = await start_standin("both")
    yield standin
    await standin.stop()


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as r:
        text = await r.text()
        return r.status, json.loads(text) if text else None


def assert_validation_error(status: int, body: Any, field: str) -> None:
    """trtllm's RequestValidationError handler: 400 {"error": "<text naming the field>"}."""
    assert status == 400
    assert set(body) == {"error"}, body
    assert field in body["error"]


def assert_error_response(status: int, body: Any, needle: str) -> None:
    """trtllm's create_error_response: ErrorResponse at top level, code = status."""
    assert status == 400
    assert body == {
        "object": "error",
        "message": body["message"],
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert needle in body["message"]


# ---------------------------------------------------------------------------
# Refusing what trtllm refuses


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/completions", {"prompt_token_ids_b64": "AQAAAA=="}, "prompt_token_ids_b64"),
        ("/v1/completions", {"prompt_token_ids": [1, 2]}, "prompt_token_ids"),
        ("/v1/chat/completions", {"no_such_field": 1}, "no_such_field"),
        ("/v1/chat/completions", {"return_prompt_token_ids_b64": True}, "return_prompt_token_ids_b64"),
    ],
)
async def test_unknown_top_level_fields_are_refused(
    both: TrtllmStandin, session: aiohttp.ClientSession, path: str, extra: dict[str, Any], field: str
) -> None:
    base = COMPLETION if path == "/v1/completions" else CHAT
    status, body = await post(session, both.url + path, {**base, **extra})
    assert_validation_error(status, body, field)
    assert "extra_forbidden" in body["error"]


@pytest.mark.parametrize(
    ("dp", "field"),
    [
        (ctx_params(conversation_id="c1"), "conversation_id"),  # not in DisaggregatedParams at 0076e939
        (ctx_params(ctx_info_endpoint=["tcp://a:1"]), "ctx_info_endpoint"),  # a string, not a list
        (ctx_params(schedule_style="context_first"), "schedule_style"),  # an IntEnum: 0 or 1
        (
            ctx_params(ctx_usage={"prompt_tokens": 3, "completion_tokens_details": {}}),
            "completion_tokens_details",
        ),
        ({"disagg_request_id": 5}, "request_type"),  # required
    ],
)
async def test_disaggregated_params_are_strict(
    both: TrtllmStandin, session: aiohttp.ClientSession, dp: dict[str, Any], field: str
) -> None:
    status, body = await post(
        session, both.url + "/v1/chat/completions", {**CHAT, "disaggregated_params": dp}
    )
    assert_validation_error(status, body, field)


async def test_schedule_style_travels_as_an_int(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    status, body = await post(
        session, both.url + "/v1/chat/completions", context_body(CHAT, schedule_style=0)
    )
    assert status == 200
    assert body["choices"][0]["disaggregated_params"]["schedule_style"] == 0


@pytest.mark.parametrize(
    ("path", "extra", "needle"),
    [
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "Stream options"),
        ("/v1/completions", {"suffix": "x"}, "suffix is not supported"),
        ("/v1/chat/completions", {"top_logprobs": 0}, "logprobs must be true"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "`tools` must be set"),
    ],
)
async def test_trtllm_before_validators_refuse(
    both: TrtllmStandin, session: aiohttp.ClientSession, path: str, extra: dict[str, Any], needle: str
) -> None:
    base = COMPLETION if path == "/v1/completions" else CHAT
    status, body = await post(session, both.url + path, {**base, **extra})
    assert_validation_error(status, body, needle)


async def test_bad_json_is_a_validation_error(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    async with session.post(
        both.url + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        assert "json_invalid" in (await r.json())["error"]


async def test_orchestrator_shaped_context_bodies_are_accepted(
    both: TrtllmStandin, session: aiohttp.ClientSession
) -> None:
    # stream false + stream_options null + the flag, on both routes; max_completion_tokens by name too.
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        status, _ = await post(session, both.url + path, context_body(base, return_prompt_token_ids_b64=True))
        assert status == 200, path
    chat = {k: v for k, v in CHAT.items() if k != "max_tokens"} | {"max_completion_tokens": 2}
    status, body = await post(session, both.url + "/v1/chat/completions", chat)
    assert (status, body["usage"]["completion_tokens"]) == (200, 2)


# ---------------------------------------------------------------------------
# Context -> generation, by hand


async def test_chat_round_trip_is_deterministic(
    pair: tuple[TrtllmStandin, TrtllmStandin], both: TrtllmStandin, session: aiohttp.ClientSession
) -> None:
    ctx, gen = pair
    prompt = render_chat(MESSAGES, add_generation_prompt=True, add_special_tokens=False)
    expected = standin_completion(prompt, 6)

    status, ctx_answer = await post(session, ctx.url + "/v1/chat/completions", context_body(CHAT))
    assert status == 200
    choice = ctx_answer["choices"][0]
    dp = choice["disaggregated_params"]
    assert choice["finish_reason"] == "length"
    assert dp["request_type"] == "context_only"
    assert dp["first_gen_tokens"] == expected[:1]
    assert dp["ctx_request_id"] == dp["disagg_request_id"] == DISAGG_ID
    assert isinstance(dp["encoded_opaque_state"], str) and dp["ctx_info_endpoint"].startswith("tcp://")
    # model_dump(): every field present, nulls included
    for key in ("draft_tokens", "ctx_dp_rank", "first_gen_log_probs", "first_gen_logits", "ctx_usage"):
        assert key in dp and dp[key] is None
    assert dp["return_prompt_token_ids_b64"] is False
    assert ctx_answer["prompt_token_ids"] == prompt
    assert ctx_answer["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + 1,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    gen_dp = generation_params(ctx_answer)
    gen_body = {**CHAT, "disaggregated_params": gen_dp, "prompt_token_ids": ctx_answer["prompt_token_ids"]}
    status, answer = await post(session, gen.url + "/v1/chat/completions", gen_body, signed(gen_dp))
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == TOKENIZER.decode(expected)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["prompt_token_ids"] is None
    assert gen.received()[-1].prompt_source == "ids" and gen.received()[-1].kv_match is True

    # and a single "both" stand-in gives the same text
    status, whole = await post(session, both.url + "/v1/chat/completions", CHAT)
    assert whole["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]


async def test_completions_round_trip_carries_the_list(
    pair: tuple[TrtllmStandin, TrtllmStandin], session: aiohttp.ClientSession
) -> None:
    ctx, gen = pair
    prompt = TOKENIZER.encode("once upon")  # with BOS, as a fastcore tiny worker encodes completions
    # Even when asked for base64, completions answer with the list (CompletionResponse has no b64 field).
    status, ctx_answer = await post(
        session, ctx.url + "/v1/completions", context_body(COMPLETION, return_prompt_token_ids_b64=True)
    )
    assert status == 200
    assert ctx_answer["prompt_token_ids"] == prompt
    assert "prompt_token_ids_b64" not in ctx_answer

    gen_dp = generation_params(ctx_answer)
    gen_body = {**COMPLETION, "prompt": ctx_answer["prompt_token_ids"], "disaggregated_params": gen_dp}
    status, answer = await post(session, gen.url + "/v1/completions", gen_body, signed(gen_dp))
    assert status == 200, answer
    assert answer["choices"][0]["text"] == TOKENIZER.decode(standin_completion(prompt, 6))
    assert gen.received()[-1].prompt_source == "ids" and gen.received()[-1].kv_match is True


async def test_a_generation_leg_without_ids_is_tokenized_again_as_trtllm_does(
    pair: tuple[TrtllmStandin, TrtllmStandin], session: aiohttp.ClientSession
) -> None:
    # trtllm renders messages (or tokenizes a text prompt) when no ids come: accepted, but recorded.
    ctx, gen = pair
    _, ctx_answer = await post(session, ctx.url + "/v1/chat/completions", context_body(CHAT))
    gen_dp = generation_params(ctx_answer)
    status, _ = await post(
        session, gen.url + "/v1/chat/completions", {**CHAT, "disaggregated_params": gen_dp}, signed(gen_dp)
    )
    assert status == 200
    assert gen.received()[-1].prompt_source == "text"


async def test_first_token_eos_ends_at_the_context(session: aiohttp.ClientSession) -> None:
    ctx = await start_standin("context", eos_at=0)
    try:
        status, answer = await post(session, ctx.url + "/v1/chat/completions", context_body(CHAT))
    finally:
        await ctx.stop()
    assert status == 200
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["disaggregated_params"]["first_gen_tokens"] == [EOS_ID]
    assert answer["choices"][0]["message"]["content"] == ""


async def test_roles_and_request_types_are_checked(
    pair: tuple[TrtllmStandin, TrtllmStandin], session: aiohttp.ClientSession
) -> None:
    ctx, gen = pair
    status, body = await post(session, gen.url + "/v1/chat/completions", context_body(CHAT))
    assert_error_response(status, body, "generation server got a context_only request")
    bad = {**CHAT, "disaggregated_params": {"request_type": "prefill"}}
    status, body = await post(session, ctx.url + "/v1/chat/completions", bad)
    assert_error_response(status, body, "Unknown request type")


# ---------------------------------------------------------------------------
# Base64 prompt ids: chat only, only when asked


async def test_chat_b64_only_when_asked(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    prompt = render_chat(MESSAGES, add_generation_prompt=True, add_special_tokens=False)
    _, plain = await post(session, both.url + "/v1/chat/completions", context_body(CHAT))
    assert plain["prompt_token_ids"] == prompt
    assert "prompt_token_ids_b64" in plain and plain["prompt_token_ids_b64"] is None

    _, asked = await post(
        session, both.url + "/v1/chat/completions", context_body(CHAT, return_prompt_token_ids_b64=True)
    )
    assert asked["prompt_token_ids"] is None
    assert asked["prompt_token_ids_b64"] == encode_prompt_b64(prompt)

    _, aggregated = await post(session, both.url + "/v1/chat/completions", CHAT)
    assert aggregated["prompt_token_ids"] is None and aggregated["prompt_token_ids_b64"] is None


async def test_generation_decodes_b64_as_trtllm_does(
    pair: tuple[TrtllmStandin, TrtllmStandin], session: aiohttp.ClientSession
) -> None:
    ctx, gen = pair
    _, ctx_answer = await post(
        session, ctx.url + "/v1/chat/completions", context_body(CHAT, return_prompt_token_ids_b64=True)
    )
    b64 = ctx_answer["prompt_token_ids_b64"]
    gen_dp = generation_params(ctx_answer)
    url = gen.url + "/v1/chat/completions"

    status, _ = await post(
        session, url, {**CHAT, "disaggregated_params": gen_dp, "prompt_token_ids_b64": b64}, signed(gen_dp)
    )
    assert status == 200
    assert gen.received()[-1].prompt_source == "b64" and gen.received()[-1].kv_match is True

    # base64.b64decode without validate=True drops characters outside the alphabet.
    lenient = b64[:4] + "!\n" + b64[4:]
    status, _ = await post(
        session,
        url,
        {**CHAT, "disaggregated_params": gen_dp, "prompt_token_ids_b64": lenient},
        signed(gen_dp),
    )
    assert status == 200
    assert gen.received()[-1].prompt_ids == TOKENIZER.encode(
        TOKENIZER.apply_chat_template(MESSAGES), add_special_tokens=False
    )

    for broken, needle in (("AQAAAA", "padding"), ("AQAA", "multiple of element size")):
        status, body = await post(
            session,
            url,
            {**CHAT, "disaggregated_params": gen_dp, "prompt_token_ids_b64": broken},
            signed(gen_dp),
        )
        assert_error_response(status, body, needle)


# ---------------------------------------------------------------------------
# Auth


async def test_auth_is_enforced_with_a_key(
    pair: tuple[TrtllmStandin, TrtllmStandin], session: aiohttp.ClientSession
) -> None:
    ctx, gen = pair
    # The context leg carries neither protected field: no header needed.
    status, ctx_answer = await post(session, ctx.url + "/v1/chat/completions", context_body(CHAT))
    assert status == 200
    gen_dp = generation_params(ctx_answer)
    body = {**CHAT, "disaggregated_params": gen_dp, "prompt_token_ids": ctx_answer["prompt_token_ids"]}
    url = gen.url + "/v1/chat/completions"

    status, answer = await post(session, url, body)
    assert_error_response(status, answer, "Invalid internal disaggregated request authentication")
    wrong = {
        AUTH_HEADER: trtllm_auth_value(
            b"other-key", gen_dp["ctx_info_endpoint"], gen_dp["encoded_opaque_state"]
        )
    }
    status, answer = await post(session, url, body, wrong)
    assert_error_response(status, answer, "Invalid internal")
    tampered = dict(gen_dp, encoded_opaque_state="AAAA")
    status, answer = await post(session, url, {**body, "disaggregated_params": tampered}, signed(gen_dp))
    assert_error_response(status, answer, "Invalid internal")
    upper = {AUTH_HEADER: signed(gen_dp)[AUTH_HEADER].upper()}
    status, answer = await post(session, url, body, upper)
    assert_error_response(status, answer, "Invalid internal")

    status, _ = await post(session, url, body, signed(gen_dp))
    assert status == 200
    # fastcore's own signer (server/auth.py) produces a header trtllm accepts.
    fastcore_header = {
        TRTLLM_AUTH_HEADER: trtllm_disagg_auth(
            KEY, gen_dp["ctx_info_endpoint"], gen_dp["encoded_opaque_state"]
        )
    }
    status, _ = await post(session, url, body, fastcore_header)
    assert status == 200


async def test_auth_value_is_trtllms_canonical_json() -> None:
    # docs/protocol.md's example: key k, E "tcp://h:1", S "AAAA"
    import hashlib
    import hmac

    message = b'{"ctx_info_endpoint":"tcp://h:1","encoded_opaque_state":"AAAA"}'
    expected = "sha256=" + hmac.new(b"k", message, hashlib.sha256).hexdigest()
    assert (
        trtllm_auth_value(b"k", "tcp://h:1", "AAAA")
        == expected
        == trtllm_auth_value("k", ["tcp://h:1"], "AAAA")
    )
    assert (
        trtllm_auth_value(b"k", None, None)
        == "sha256="
        + hmac.new(
            b"k", b'{"ctx_info_endpoint":null,"encoded_opaque_state":null}', hashlib.sha256
        ).hexdigest()
    )


async def test_without_a_key_no_header_is_needed(session: aiohttp.ClientSession) -> None:
    lax = await start_standin("both")
    strict = await start_standin("both", require_key=True)
    body = {
        **CHAT,
        "disaggregated_params": {
            "request_type": "generation_only",
            "first_gen_tokens": [65],
            "ctx_request_id": 9,
            "encoded_opaque_state": "AAAA",
        },
    }
    try:
        status, _ = await post(session, lax.url + "/v1/chat/completions", body)
        assert status == 200 and lax.unauthenticated_protected == 1  # trtllm: served, with a FutureWarning
        status, answer = await post(session, strict.url + "/v1/chat/completions", body)
        assert_error_response(status, answer, "require authenticated")
    finally:
        await lax.stop()
        await strict.stop()


# ---------------------------------------------------------------------------
# msgpack bodies


async def test_msgpack_bodies_are_decoded_under_the_header(
    both: TrtllmStandin, session: aiohttp.ClientSession
) -> None:
    url = both.url + "/v1/chat/completions"
    headers = {"Content-Type": "application/json", "X-TRTLLM-Msgpack": "1"}
    async with session.post(url, data=msgpack_encode(context_body(CHAT)), headers=headers) as r:
        assert r.status == 200
        answer = await r.json()
    assert answer["prompt_token_ids"] == render_chat(MESSAGES, True, False)
    rec = both.received()[-1]
    assert rec.msgpack and rec.body["disaggregated_params"]["disagg_request_id"] == DISAGG_ID
    assert rec.headers["x-trtllm-msgpack"] == "1"

    # msgpack with unknown fields is refused like JSON
    async with session.post(url, data=msgpack_encode({**CHAT, "nope": 1}), headers=headers) as r:
        assert r.status == 400 and "nope" in (await r.json())["error"]
    # Only the exact value "1" switches the decoder.
    # (msgpack is not UTF-8, so json.loads fails before parsing: FastAPI's generic body error)
    async with session.post(
        url, data=msgpack_encode(CHAT), headers={**headers, "X-TRTLLM-Msgpack": "true"}
    ) as r:
        assert (r.status, await r.json()) == (400, {"detail": "There was an error parsing the body"})
    # Content-Type must stay JSON: otherwise FastAPI never calls Request.json() and the bytes fail validation.
    async with session.post(
        url, data=msgpack_encode(CHAT), headers={**headers, "Content-Type": "application/msgpack"}
    ) as r:
        assert r.status == 400 and "model_type" in (await r.json())["error"]
    # Undecodable msgpack: FastAPI's generic body error.
    async with session.post(url, data=b"\xc1", headers=headers) as r:
        assert (r.status, await r.json()) == (400, {"detail": "There was an error parsing the body"})


async def test_msgpack_needs_the_workers_switch(session: aiohttp.ClientSession) -> None:
    standin = await start_standin("both", msgspec_enabled=False)
    try:
        headers = {"Content-Type": "application/json", "X-TRTLLM-Msgpack": "1"}
        async with session.post(
            standin.url + "/v1/chat/completions", data=msgpack_encode(CHAT), headers=headers
        ) as r:
            assert (r.status, await r.json()) == (400, {"detail": "There was an error parsing the body"})
    finally:
        await standin.stop()


# ---------------------------------------------------------------------------
# Streaming


async def test_chat_stream_shape(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    prompt = render_chat(MESSAGES, True, False)
    expected = standin_completion(prompt, 6)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(both.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    # the role chunk is written "data: {...} \n\n", with a space before the blank line
    assert raw.startswith(b"data: {") and raw.split(b"\n\n", 1)[0].endswith(b"} ")
    assert raw.endswith(b"data: [DONE]\n\n")
    events = list(iter_sse(raw))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    content = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == TOKENIZER.decode(expected)
    assert [c["choices"][0].get("finish_reason") for c in content] == [None] * 5 + ["length"]
    assert all("usage" not in c and "logprobs" not in c["choices"][0] for c in content)  # exclude_none
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


async def test_completion_stream_shape(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    async with session.post(both.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status == 200
        raw = await r.read()
    events = list(iter_sse(raw))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6  # one a token, and no usage chunk without stream_options
    # completion chunks are dumped in full: nulls present
    assert chunks[0]["usage"] is None and chunks[0]["choices"][0]["logprobs"] is None
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == TOKENIZER.decode(standin_completion(TOKENIZER.encode("once upon"), 6))


# ---------------------------------------------------------------------------
# Routes, records, threads


async def test_routes(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    async with session.get(both.url + "/health") as r:
        assert (r.status, await r.read()) == (200, b"")
    both.healthy = False
    async with session.get(both.url + "/health") as r:
        assert r.status == 503
    async with session.get(both.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["owned_by"] == "tensorrt_llm"
    async with session.get(both.url + "/server_info") as r:
        info = await r.json()
    assert r.status == 200 and "disaggregated_params" in info and "role" not in info
    async with session.get(both.url + "/v1/completions") as r:
        assert (r.status, await r.json()) == (405, {"detail": "Method Not Allowed"})
    async with session.get(both.url + "/v1/nothing") as r:
        assert (r.status, await r.json()) == (404, {"detail": "Not Found"})


async def test_requests_are_recorded(both: TrtllmStandin, session: aiohttp.ClientSession) -> None:
    await post(session, both.url + "/v1/completions", COMPLETION, {"X-Probe": "yes"})
    rec = both.received("/v1/completions")[-1]
    assert rec.body == COMPLETION and rec.headers["x-probe"] == "yes" and rec.status == 200
    assert rec.prompt_ids == TOKENIZER.encode("once upon") and rec.prompt_source == "text"
    assert rec.response["choices"][0]["text"]


def test_thread_mode_serves_blocking_clients() -> None:
    with StandinThread("both") as standin:
        req = urllib.request.Request(
            standin.url + "/v1/completions",
            data=json.dumps(COMPLETION).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        assert answer["object"] == "text_completion"
        assert len(standin.requests) == 1
