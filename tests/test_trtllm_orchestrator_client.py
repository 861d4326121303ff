"""fastcore's torch workers driven exactly as trtllm-serve's orchestrator drives its own workers.

The other direction of ``tests/test_trtllm_standin.py``: there fastcore's
orchestrator fronts trtllm-serve stand-ins; here :class:`TrtllmOrchestrator`
plays trtllm-serve's orchestrator in front of real fastcore workers (the
``tiny`` torch model, real sockets on 127.0.0.1) and the answers must be the
tokens a ``both`` worker gives for the same client body: chat and
completions, streamed and not, JSON and msgpack bodies, internal auth on and
off, the base64 prompt relay on and off.

What it follows (NVIDIA/TensorRT-LLM, read through the project's code index;
the same release line as ``tests/trtllm_standin.py``):

- the request and response models are the stand-in's, written after
  ``tensorrt_llm/serve/openai_protocol.py`` at ``0076e9390e1ed11515f149eec356f5a03f4a00d8``
  (``extra="forbid"``: a field trtllm does not model fails here as it fails
  there). The orchestrator parses each non-streaming worker answer into them
  (``response_type(**resp_json)``), so a field too many in a fastcore answer
  fails this test.
- ``tensorrt_llm/serve/openai_disagg_service.py`` of the revision with the
  ``tokids_ctxbytes`` gate (``return_prompt_token_ids_b64`` in the context
  request; the index did not name its commit): ``_get_ctx_request`` (the
  client's request with ``disaggregated_params`` = ``{request_type:
  "context_only", disagg_request_id, schedule_style,
  return_prompt_token_ids_b64}``, ``stream`` false, ``stream_options`` null;
  that revision's ``conversation_id`` is left out, as 0076e939's
  ``DisaggregatedParams`` has none), ``_need_gen`` (a generation leg only
  after ``"length"`` / ``"not_finished"``), ``_get_gen_request`` (the context
  answer's ``disaggregated_params`` with ``request_type: "generation_only"``,
  ``schedule_style`` and ``ctx_usage``; completions get ``prompt`` = the
  list of ids, chat ``prompt_token_ids_b64`` when the context answer had it,
  else ``prompt_token_ids``).
- ``tensorrt_llm/serve/openai_client.py`` of the ``TRTLLM_SERVE_ENABLE_MSGSPEC``
  revision: bodies are ``model_dump(mode="json", exclude_unset=True)``, as
  JSON or as msgpack with ``X-TRTLLM-Msgpack: 1`` (Content-Type stays
  ``application/json``); a 4xx is an error, a stream is relayed as bytes.
- ``disagg_auth.py`` (``0cfda24b3c9d930f20d229d6af065d16dc436902``): with
  ``internal_request_auth_key`` set, a request whose ``disaggregated_params``
  carry ``ctx_info_endpoint`` or ``encoded_opaque_state`` gets
  ``x-trtllm-disagg-auth`` (computed here by the stand-in's own
  ``trtllm_auth_value``, not fastcore's). Context legs carry no auth.

The fastcore workers run with ``accept_trtllm_orchestrator`` (what trtllm's
unsigned context legs and its completion response model need); with auth on
they also have a shared secret, which is the trtllm key too.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from helpers import streamed
from pydantic import ValidationError
from tiny_workers import LiveWorker, one_torch_thread, tiny_worker  # noqa: F401 (an autouse fixture)
from trtllm_standin import (
    AUTH_HEADER,
    MSGPACK_HEADER,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DisaggregatedParams,
    DisaggScheduleStyle,
    msgpack_encode,
    trtllm_auth_value,
)

from server.auth import SIGNATURE_HEADER, sign_body

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = b"trtllm-orchestrator-secret"
OTHER_KEY = b"a-separate-trtllm-key"

CHAT_BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the tallest mountain in Portugal?"},
    ],
    "max_tokens": 20,
    "temperature": 0,
}
COMPLETION_BODY: dict[str, Any] = {
    "model": "tiny",
    "prompt": "The harbour at dawn was quiet, and",
    "max_tokens": 20,
    "temperature": 0,
}
ROUTES = {"chat": ("/v1/chat/completions", CHAT_BODY), "completions": ("/v1/completions", COMPLETION_BODY)}
MODELS = {
    "chat": (ChatCompletionRequest, ChatCompletionResponse),
    "completions": (CompletionRequest, CompletionResponse),
}
#: an endpoint nothing listens on: a generation leg naming it recomputes the prefill
DEAD_ENDPOINT = "http://127.0.0.1:1/kv/5"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers() -> AsyncIterator[dict[str, LiveWorker]]:
    trtllm = {"accept_trtllm_orchestrator": True}
    started = {
        "both": await tiny_worker("both"),
        "ctx-open": await tiny_worker("context", **trtllm),
        "gen-open": await tiny_worker("generation", **trtllm),
        "ctx-auth": await tiny_worker("context", shared_secret=SECRET, **trtllm),
        "gen-auth": await tiny_worker("generation", shared_secret=SECRET, **trtllm),
    }
    yield started
    for worker in started.values():
        await worker.server.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class LegError(Exception):
    """A worker's 4xx/5xx, as trtllm's client raises it (ClientResponseError with the body)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}: {body[:300]!r}")
        self.status = status
        self.body = body


class TrtllmOrchestrator:
    """trtllm-serve's orchestrator's request path (context first), against two worker URLs."""

    _ids = itertools.count(1 << 20)

    def __init__(
        self,
        http: aiohttp.ClientSession,
        ctx_url: str,
        gen_url: str,
        *,
        key: bytes | None = None,
        msgpack: bool = False,
        tokids_ctxbytes: bool = False,
    ) -> None:
        self.http = http
        self.ctx_url = ctx_url
        self.gen_url = gen_url
        self.key = key
        self.msgpack = msgpack
        self.tokids_ctxbytes = tokids_ctxbytes
        #: what went to the workers, as (url, headers, body bytes)
        self.sent: list[tuple[str, dict[str, str], bytes]] = []
        self.ctx_response: ChatCompletionResponse | CompletionResponse | None = None

    def _encode(self, request: ChatCompletionRequest | CompletionRequest) -> tuple[bytes, dict[str, str]]:
        """openai_client._post_with_retry's body and headers, with disagg_auth's header."""
        if self.msgpack:
            body = msgpack_encode(request.model_dump(mode="json", exclude_unset=True))
            headers = {"Content-Type": "application/json", MSGPACK_HEADER: "1"}
        else:
            body = request.model_dump_json(exclude_unset=True).encode()
            headers = {"Content-Type": "application/json"}
        dp = request.disaggregated_params
        if (
            self.key is not None
            and dp is not None
            and (dp.ctx_info_endpoint is not None or dp.encoded_opaque_state is not None)
        ):
            headers[AUTH_HEADER] = trtllm_auth_value(self.key, dp.ctx_info_endpoint, dp.encoded_opaque_state)
        return body, headers

    async def post(
        self, url: str, request: ChatCompletionRequest | CompletionRequest
    ) -> tuple[int, bytes, str]:
        body, headers = self._encode(request)
        self.sent.append((url, headers, body))
        async with self.http.post(url, data=body, headers=headers) as resp:
            return resp.status, await resp.read(), resp.headers.get("Content-Type", "")

    async def complete(self, route: str, client_body: dict[str, Any]) -> Any:
        """The client's answer: a response dict, or the SSE ``data:`` payloads of a stream."""
        path, _ = ROUTES[route]
        request_type, response_type = MODELS[route]
        request = request_type(**client_body)
        if (
            isinstance(request, CompletionRequest)
            and isinstance(request.prompt, list)
            and len(request.prompt) == 1
        ):
            request.prompt = request.prompt[0]  # openai_completion: a batch of one
        disagg_request_id = next(self._ids)
        ctx_request = request.model_copy(
            update={
                "disaggregated_params": DisaggregatedParams(
                    request_type="context_only",
                    disagg_request_id=disagg_request_id,
                    schedule_style=DisaggScheduleStyle.CONTEXT_FIRST,
                    return_prompt_token_ids_b64=self.tokids_ctxbytes,
                ),
                "stream": False,
                "stream_options": None,
            }
        )
        status, raw, _ = await self.post(self.ctx_url + path, ctx_request)
        if status >= 400:
            raise LegError(status, raw)
        ctx = self.ctx_response = response_type(**json.loads(raw))
        for choice in ctx.choices:  # _verify_ctx_response
            assert choice.disaggregated_params is not None
        choice = ctx.choices[0]
        if choice.finish_reason not in ("length", "not_finished"):  # _need_gen
            del choice.disaggregated_params
            return ctx.model_dump()
        dp = choice.disaggregated_params
        dp.request_type = "generation_only"
        dp.schedule_style = DisaggScheduleStyle.CONTEXT_FIRST
        dp.ctx_usage = ctx.usage
        request.disaggregated_params = dp
        if isinstance(request, CompletionRequest):
            request.prompt = ctx.prompt_token_ids
        elif ctx.prompt_token_ids_b64 is not None:
            request.prompt_token_ids_b64 = ctx.prompt_token_ids_b64
        else:
            request.prompt_token_ids = ctx.prompt_token_ids
        dp.disagg_request_id = disagg_request_id
        status, raw, content_type = await self.post(self.gen_url + path, request)
        if status >= 400:
            raise LegError(status, raw)
        if request.stream:
            assert content_type.startswith("text/event-stream")
            return sse_payloads(raw)
        return response_type(**json.loads(raw)).model_dump()


def sse_payloads(raw: bytes) -> list[dict[str, Any]]:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-1:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def outcome(route: str, result: Any) -> dict[str, Any]:
    """Text, finish reason and usage of an answer, streamed or not, in one shape."""
    if isinstance(result, dict):
        choice = result["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        usage = {k: result["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {"text": text, "finish_reason": choice["finish_reason"], "usage": usage}
    chunks = [c for c in result if c["choices"]]
    usage = [c["usage"] for c in result if not c["choices"]]
    if route == "chat":
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1
    return {"text": text, "finish_reason": finishes[0], "usage": usage[0] if usage else None}


async def direct(http: aiohttp.ClientSession, url: str, body: Any) -> Any:
    async with http.post(url, json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        if resp.headers["Content-Type"].startswith("text/event-stream"):
            return sse_payloads(raw)
        return json.loads(raw)


async def status_of(
    http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, json.loads(await resp.read())


def assert_openai_error(doc: dict[str, Any], status_code: str) -> None:
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == status_code and isinstance(doc["error"]["message"], str)


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("tokids", [False, True], ids=["list", "b64"])
@pytest.mark.parametrize("auth", [False, True], ids=["open", "auth"])
@pytest.mark.parametrize("wire", ["json", "msgpack"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_trtllm_orchestrator_gets_the_single_worker_tokens(
    workers: dict[str, LiveWorker],
    http: aiohttp.ClientSession,
    route: str,
    stream: bool,
    wire: str,
    auth: bool,
    tokids: bool,
) -> None:
    path, base = ROUTES[route]
    body = streamed(base, stream)
    want = outcome(route, await direct(http, workers["both"].url + path, body))
    assert want["finish_reason"] == "length" and len(want["text"]) > 5

    pool = "auth" if auth else "open"
    orchestrator = TrtllmOrchestrator(
        http,
        workers[f"ctx-{pool}"].url,
        workers[f"gen-{pool}"].url,
        key=SECRET if auth else None,
        msgpack=wire == "msgpack",
        tokids_ctxbytes=tokids,
    )
    got = await orchestrator.complete(route, body)
    assert outcome(route, got) == want

    # What went over the wire was trtllm's: msgpack flagged, the auth header only on the
    # generation leg (it names ctx_info_endpoint), trtllm's field names.
    (_, ctx_headers, _), (_, gen_headers, gen_raw) = orchestrator.sent
    for headers in (ctx_headers, gen_headers):
        assert (headers.get(MSGPACK_HEADER) == "1") == (wire == "msgpack")
    assert AUTH_HEADER not in ctx_headers
    assert (AUTH_HEADER in gen_headers) == auth
    ctx = orchestrator.ctx_response
    assert ctx is not None
    # Base64 on chat only: trtllm's completion response model has no prompt_token_ids_b64.
    if route == "chat" and tokids:
        assert ctx.prompt_token_ids is None and ctx.prompt_token_ids_b64
    else:
        assert ctx.prompt_token_ids and len(ctx.prompt_token_ids) == want["usage"]["prompt_tokens"]
    if wire == "json":
        gen_doc = json.loads(gen_raw)
        assert gen_doc["disaggregated_params"]["schedule_style"] == 0
        assert gen_doc["disaggregated_params"]["ctx_usage"]["completion_tokens"] == 1
        if route == "chat":
            assert "max_completion_tokens" in gen_doc and "max_tokens" not in gen_doc
        else:
            assert gen_doc["prompt"] == ctx.prompt_token_ids


async def test_every_field_of_trtllms_disaggregated_params_is_taken(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    """A generation leg with every DisaggregatedParams field trtllm models set (ctx_dp_rank,
    the first-token logprobs, resolved_thinking, ...): the worker reads what it needs."""
    path, base = ROUTES["chat"]
    want = outcome("chat", await direct(http, workers["both"].url + path, base))
    orchestrator = TrtllmOrchestrator(http, workers["ctx-auth"].url, workers["gen-auth"].url, key=SECRET)
    request = ChatCompletionRequest(**base)
    ctx_request = request.model_copy(update={"disaggregated_params": DisaggregatedParams(
        request_type="context_only", disagg_request_id=77, schedule_style=DisaggScheduleStyle.CONTEXT_FIRST,
        return_prompt_token_ids_b64=True, ctx_dp_rank=0), "stream": False, "stream_options": None})  # fmt: skip
    status, raw, _ = await orchestrator.post(workers["ctx-auth"].url + path, ctx_request)
    assert status == 200
    ctx = ChatCompletionResponse(**json.loads(raw))
    dp = ctx.choices[0].disaggregated_params
    assert dp is not None
    full = dp.model_copy(update={"request_type": "generation_only", "ctx_dp_rank": 0, "first_gen_log_probs": None,
                                 "first_gen_logits": None, "schedule_style": DisaggScheduleStyle.CONTEXT_FIRST,
                                 "ctx_usage": ctx.usage, "return_prompt_token_ids_b64": False,
                                 "resolved_thinking": False})  # fmt: skip
    gen = request.model_copy(
        update={"disaggregated_params": full, "prompt_token_ids_b64": ctx.prompt_token_ids_b64}
    )
    body = gen.model_dump(mode="json", exclude_unset=True)
    body["disaggregated_params"] = full.model_dump(mode="json")  # every field, nulls included
    assert set(body["disaggregated_params"]) == set(DisaggregatedParams.model_fields)
    headers = {AUTH_HEADER: trtllm_auth_value(SECRET, dp.ctx_info_endpoint, dp.encoded_opaque_state)}
    async with http.post(workers["gen-auth"].url + path, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert outcome("chat", ChatCompletionResponse(**await resp.json()).model_dump()) == want


async def test_a_context_answer_that_finishes_is_the_answer(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    """A stop string met by the first token: the context answer says "stop", so trtllm's
    orchestrator sends no generation leg and answers with it (its hand-off removed)."""
    path, base = ROUTES["completions"]
    first = (await direct(http, workers["both"].url + path, base))["choices"][0]["text"][:1]
    body = {**base, "stop": [first]}
    want = outcome("completions", await direct(http, workers["both"].url + path, body))
    assert want["finish_reason"] == "stop"
    orchestrator = TrtllmOrchestrator(http, workers["ctx-auth"].url, workers["gen-auth"].url, key=SECRET,
                                      msgpack=True)  # fmt: skip
    got = await orchestrator.complete("completions", body)
    assert len(orchestrator.sent) == 1  # no generation leg
    assert outcome("completions", got) == want and "disaggregated_params" not in got["choices"][0]


# ---------------------------------------------------------------- prompt ids: base64 only when asked


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("asked", [False, True])
async def test_base64_prompt_ids_only_when_asked(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession, route: str, asked: bool
) -> None:
    """A fastcore worker (no trtllm orchestrator in front) answers base64 on both routes, and only
    when asked; one fronted by trtllm's orchestrator answers the list on completions."""
    plain = await tiny_worker("context")
    try:
        path, base = ROUTES[route]
        params: dict[str, Any] = {"request_type": "context_only", "disagg_request_id": 9}
        if asked:
            params["return_prompt_token_ids_b64"] = True
        body = {**base, "disaggregated_params": params}
        for worker, b64 in ((plain, asked), (workers["ctx-open"], asked and route == "chat")):
            doc = await direct(http, worker.url + path, body)
            if b64:
                assert doc["prompt_token_ids"] is None and isinstance(doc["prompt_token_ids_b64"], str)
            else:
                assert "prompt_token_ids_b64" not in doc and len(doc["prompt_token_ids"]) > 3
        async with http.get(plain.url + "/server_info") as resp:
            info = await resp.json()
        assert info["prompt_token_ids_b64_chat"] is True and info["prompt_token_ids_b64_completions"] is True
        async with http.get(workers["ctx-open"].url + "/server_info") as resp:
            info = await resp.json()
        assert info["prompt_token_ids_b64_completions"] is False and info["msgpack_requests"] is True
        assert info["internal_auth"] == {"fastcore_signature": False, "trtllm_disagg_auth": False,
                                         "accept_trtllm_orchestrator": True}  # fmt: skip
        if route == "completions" and asked:
            # Why: trtllm's completion response model refuses the field the plain worker adds.
            doc = await direct(http, plain.url + path, body)
            with pytest.raises(ValidationError, match="prompt_token_ids_b64"):
                CompletionResponse(**doc)
    finally:
        await plain.server.cleanup()


# ---------------------------------------------------------------- internal auth


def generation_leg(endpoint: str | None = DEAD_ENDPOINT, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"request_type": "generation_only", "first_gen_tokens": [72], "ctx_request_id": 5,
                              "disagg_request_id": 5, "encoded_opaque_state": None, "draft_tokens": None,
                              "ctx_info_endpoint": endpoint, **extra}  # fmt: skip
    if endpoint is None:
        del params["ctx_info_endpoint"]
    return {"model": "tiny", "prompt": [1, 72, 101, 108, 108, 111], "max_tokens": 3, "temperature": 0,
            "disaggregated_params": params}  # fmt: skip


@pytest.mark.parametrize("wire", ["json", "msgpack"])
async def test_a_generation_leg_naming_the_kv_needs_a_valid_trtllm_header(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession, wire: str
) -> None:
    url = workers["gen-auth"].url + "/v1/completions"
    leg = generation_leg()
    body = msgpack_encode(leg) if wire == "msgpack" else json.dumps(leg).encode()
    flag = {MSGPACK_HEADER: "1"} if wire == "msgpack" else {}
    good = trtllm_auth_value(SECRET, DEAD_ENDPOINT, None)
    status, doc = await status_of(http, url, body, flag)
    assert status == 403 and "x-trtllm-disagg-auth" in doc["error"]["message"]
    assert_openai_error(doc, "missing_signature")
    for bad in (
        trtllm_auth_value(OTHER_KEY, DEAD_ENDPOINT, None),  # another key
        trtllm_auth_value(SECRET, "http://127.0.0.1:2/kv/5", None),  # signs another endpoint
        trtllm_auth_value(SECRET, DEAD_ENDPOINT, "AAAA"),  # signs another opaque state
        "sha256=" + "0" * 64,
        good.upper(),
        "garbage",
    ):
        status, doc = await status_of(http, url, body, {**flag, AUTH_HEADER: bad})
        assert status == 403, bad
        assert_openai_error(doc, "bad_signature")
    # Not latin-1 text: still a 403, never a 500.
    async with http.post(
        url, data=body, headers={**flag, AUTH_HEADER: "sha256=\u00e9".encode().decode("latin-1")}
    ) as resp:
        assert resp.status == 403
    status, doc = await status_of(http, url, body, {**flag, AUTH_HEADER: good})
    assert status == 200, doc
    # The header signs the opaque state too.
    leg = generation_leg(encoded_opaque_state="AAAA")
    body = msgpack_encode(leg) if wire == "msgpack" else json.dumps(leg).encode()
    status, doc = await status_of(http, url, body, {**flag, AUTH_HEADER: good})
    assert status == 403
    status, doc = await status_of(
        http, url, body, {**flag, AUTH_HEADER: trtllm_auth_value(SECRET, DEAD_ENDPOINT, "AAAA")}
    )
    assert status == 200, doc


async def test_a_fastcore_signature_authenticates_without_the_trtllm_header(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    """Over msgpack too: the signature is over the body's bytes as sent."""
    url = workers["gen-auth"].url + "/v1/completions"
    body = msgpack_encode(generation_leg())
    flag = {MSGPACK_HEADER: "1"}
    async with http.get(workers["gen-auth"].url + "/health") as resp:
        here = (await resp.json())["instance"]
    signed = {**flag, SIGNATURE_HEADER: sign_body(SECRET, body, destination=here)}
    status, doc = await status_of(http, url, body, signed)
    assert status == 200, doc
    signed = {**flag, SIGNATURE_HEADER: sign_body(SECRET, body, destination=here)}
    status, doc = await status_of(http, url, body + b"\x00", signed)
    assert status == 403
    assert_openai_error(doc, "bad_signature")


async def test_unsigned_legs_that_do_not_name_the_kv_need_the_trtllm_flag(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    """trtllm's context legs, and generation legs without ctx_info_endpoint, carry no auth: with a
    secret they pass only on a worker started with accept_trtllm_orchestrator."""
    strict = await tiny_worker("both", shared_secret=SECRET)
    try:
        leg = json.dumps(generation_leg(endpoint=None)).encode()
        context = json.dumps(
            {**COMPLETION_BODY, "disaggregated_params": {"request_type": "context_only"}}
        ).encode()
        for body in (leg, context):
            status, doc = await status_of(http, strict.url + "/v1/completions", body, {})
            assert status == 403
            assert_openai_error(doc, "missing_signature")
            # A trtllm header does not stand in for a signature where there is nothing it signs.
            status, doc = await status_of(http, strict.url + "/v1/completions", body,
                                          {AUTH_HEADER: trtllm_auth_value(SECRET, None, None)})  # fmt: skip
            assert status == 403
            assert_openai_error(doc, "missing_signature")
        status, _ = await status_of(http, workers["gen-auth"].url + "/v1/completions", leg, {})
        assert status == 200
        status, _ = await status_of(http, workers["ctx-auth"].url + "/v1/completions", context, {})
        assert status == 200
    finally:
        await strict.server.cleanup()


async def test_a_separate_trtllm_key_and_a_key_without_a_secret(http: aiohttp.ClientSession) -> None:
    separate = await tiny_worker("generation", shared_secret=SECRET, trtllm_auth_key=OTHER_KEY,
                            accept_trtllm_orchestrator=True)  # fmt: skip
    key_only = await tiny_worker("generation", trtllm_auth_key=OTHER_KEY)
    try:
        body = json.dumps(generation_leg()).encode()
        for worker in (separate, key_only):
            url = worker.url + "/v1/completions"
            status, _ = await status_of(
                http, url, body, {AUTH_HEADER: trtllm_auth_value(SECRET, DEAD_ENDPOINT, None)}
            )
            assert status == 403
            status, _ = await status_of(
                http, url, body, {AUTH_HEADER: trtllm_auth_value(OTHER_KEY, DEAD_ENDPOINT, None)}
            )
            assert status == 200
            status, _ = await status_of(http, url, body, {})
            assert status == 403
        # Without a secret, legs that name no KV need nothing.
        status, _ = await status_of(
            http, key_only.url + "/v1/completions", json.dumps(generation_leg(endpoint=None)).encode(), {}
        )
        assert status == 200
        async with http.get(separate.url + "/server_info") as resp:
            assert (await resp.json())["internal_auth"] == {
                "fastcore_signature": True, "trtllm_disagg_auth": True, "accept_trtllm_orchestrator": True}  # fmt: skip
    finally:
        await separate.server.cleanup()
        await key_only.server.cleanup()


# ---------------------------------------------------------------- msgpack bodies over HTTP


def _deep(levels: int) -> bytes:
    return b"\x81\xa1a" + b"\x91" * levels + b"\xc0"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"\x82\xa5model", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (msgpack_encode([1, 2]), "must be a JSON object"),
        (b"\x81\x01\x02", "keys must be strings"),
        (b"\x82\xa1n\x01\xa1n\x02", "'n' more than once"),
        (
            msgpack_encode({"disaggregated_params": 1})[:1]
            + b"\xb4disaggregated_params\x82\xa1x\x01\xa1x\x02",
            "'disaggregated_params.x' more than once",
        ),
        (_deep(100_000), "deeper than the limit of 512"),
        (_deep(600), "deeper than the limit of 512"),
        (msgpack_encode({"model": "tiny", "prompt": b"\x01\x00\x00\x00"}), "msgpack bin value"),
        (msgpack_encode({"model": "tiny", "prompt": "x", "temperature": float("nan")}), "JSON cannot carry"),
        (msgpack_encode({"model": "tiny", "prompt": "x", "n": 2}), "'n' must be the integer 1"),
        (msgpack_encode({"model": "tiny", "prompt": [1, 2, 99999]}), "'prompt[2]' = 99999 is outside"),
        (
            msgpack_encode({"model": "tiny", "prompt": "x", "prompt_token_ids_b64": "AAA"}),
            "'prompt_token_ids_b64' is invalid",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_hostile_msgpack_bodies_are_400s_naming_the_problem(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession, body: bytes, needle: str
) -> None:
    status, doc = await status_of(http, workers["both"].url + "/v1/completions", body, {MSGPACK_HEADER: "1"})
    assert status == 400, doc
    assert_openai_error(doc, "bad_request")
    assert needle in doc["error"]["message"]


async def test_a_body_without_the_msgpack_flag_is_json(
    workers: dict[str, LiveWorker], http: aiohttp.ClientSession
) -> None:
    body = msgpack_encode(COMPLETION_BODY)
    for headers in ({}, {MSGPACK_HEADER: "0"}):
        status, doc = await status_of(http, workers["both"].url + "/v1/completions", body, headers)
        assert status == 400 and doc["error"]["message"].startswith("request body is not valid")
    status, doc = await status_of(http, workers["both"].url + "/v1/completions", body, {MSGPACK_HEADER: "1"})
    assert status == 200, doc
