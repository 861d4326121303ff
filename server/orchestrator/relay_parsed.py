"""The orchestrator's parsed relay modes: the pydantic baseline and its msgpack-legs variant.

``ParsedRelay`` (config ``relay: parsed``) is what a typical pydantic OpenAI orchestrator does
(trtllm-serve's disaggregated server, for one): ``json.loads`` -> pydantic request/response models
-> ``model_dump_json``. ``ParsedMsgpackRelay`` (``relay: parsed-msgpack``) sends the same leg bodies
as msgpack (``X-TRTLLM-Msgpack: 1``), as newer trtllm-serve orchestrators do. Both honour the same
gates and give clients the same outputs as the fast mode (server/orchestrator/relay_fast.py), so one
deployment can measure the difference.

Both hold a client body to the workers' policy (server/worker/json_body.py): RFC 8259 JSON within
fastcore's limits, the fields they act on strictly typed, and, since ``json.loads`` would keep the
last copy of a repeated key and send only it on, no top-level repeat.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

import fastcore
from fastcore import JSONSpanError, protocol
from server.errors import HTTPError
from server.surrogates import check_no_lone_surrogates

from .relay_common import (
    ClientRequest,
    ContextResult,
    check_disagg_request_id,
    check_max_tokens,
    malformed_json_error,
    needs_generation,
    scan_refusal,
)
from .routing import conversation_to_params

# -- the OpenAI models in pydantic, as a typical orchestrator has them ----------------------------------
# Unknown fields are kept (extra="allow": trtllm-serve's extra disaggregated_params members among them,
# fastcore.protocol.TRTLLM_EXTRA_DISAGG_FIELDS) and dumps leave out what the sender left out
# (exclude_unset), so workers and clients see the same JSON.


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class DisaggregatedParams(_Model):
    request_type: str
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    disagg_request_id: int | None = None
    encoded_opaque_state: str | None = None
    ctx_info_endpoint: Any = None
    draft_tokens: list[int] | None = None
    return_prompt_token_ids_b64: bool | None = None
    ctx_usage: UsageInfo | None = None


class StreamOptions(_Model):
    include_usage: StrictBool | None = None


class ChatMessage(_Model):
    role: str
    content: Any = None


# Every typed field is strict (pydantic's lax mode would take "stream": "yes" as true,
# "n": true or "seed": "5" as ints, and send the converted value on): both modes and the
# workers read one body one way. A number field takes an int (sent on as a float).
class _RequestCommon(_Model):
    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    n: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: Any = None
    disaggregated_params: DisaggregatedParams | None = None
    prompt_token_ids_b64: str | None = None


class ChatCompletionRequest(_RequestCommon):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    prompt_token_ids: list[int] | None = None


class CompletionRequest(_RequestCommon):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatChoice(_Model):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: Any = None
    disaggregated_params: DisaggregatedParams | None = None


class CompletionChoice(_Model):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: Any = None
    disaggregated_params: DisaggregatedParams | None = None


class _ResponseCommon(_Model):
    id: str
    object: str
    created: int
    model: str
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None


class ChatCompletionResponse(_ResponseCommon):
    choices: list[ChatChoice]


class CompletionResponse(_ResponseCommon):
    choices: list[CompletionChoice]


def _dump(model: BaseModel, mode: str, **options: Any) -> Any:
    """``model_dump_json`` (``mode`` "bytes") or ``model_dump(mode=mode)``. pydantic's serializer
    stops at 255 levels of nesting (its recursion guard, a ValueError), below the JSON_MAX_DEPTH
    (512) that a body read here may hold: a tool schema or history that deep is the builtin
    ``json`` module's text or the Python objects (the values are json.loads', the same in either
    mode), never a 500."""
    try:
        if mode == "bytes":
            return model.model_dump_json(**options).encode()
        return model.model_dump(mode=mode, **options)
    except ValueError as exc:
        if "depth exceeded" not in str(exc):
            raise
    value = model.model_dump(**options)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() if mode == "bytes" else value


_CLIENT_EXCLUDE: Any = {
    **{name: True for name in protocol.INTERNAL_RESPONSE_FIELDS},
    protocol.CHOICES: {"__all__": set(protocol.INTERNAL_CHOICE_FIELDS)},
}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or None
    return f"'{field}': {err['msg']}" if field else err["msg"], field


def _check_client_members(body: bytes, data: dict[str, Any]) -> None:
    """One validating scan of the client ``body`` (``json.loads`` made ``data`` of it) for every
    top-level key and those of ``stream_options``: a repeat (``json.loads`` kept the last copy, and
    only it would be sent on), fastcore's limits and what RFC 8259 refuses (``NaN``, a byte order
    mark) are the fast mode's and the workers' 400s, worded as the fast mode words them."""
    paths: list[tuple[str, ...]] = [(key,) for key in data]
    options = data.get(protocol.STREAM_OPTIONS)
    if type(options) is dict:
        paths += [(protocol.STREAM_OPTIONS, key) for key in options]
    try:
        fastcore.find_spans(body, paths)
    except JSONSpanError as exc:
        raise scan_refusal(body, exc, "request body", 400) from None


class ParsedRelay:
    """The pydantic baseline (config ``relay: parsed``): JSON legs."""

    name = "parsed"
    #: Extra header lines for both legs' requests: none, the bodies are JSON.
    leg_headers = b""

    def __init__(self, *, tokids_b64: bool, strip_history: bool) -> None:
        self.tokids_b64 = tokids_b64
        self.strip_history = strip_history

    def read_client(self, body: bytes, chat: bool) -> ClientRequest:
        # ours into trtllm-serve's conversation_params first: the request models take no conversation_id
        body = conversation_to_params(body)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise HTTPError(400, malformed_json_error(body, "request body")) from None
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object")
        _check_client_members(body, data)
        # Before pydantic: its JSON (and msgpack) writer would fail on one, a 500.
        check_no_lone_surrogates(body, data)
        for field in protocol.internal_request_fields(chat):
            if field in data:
                raise HTTPError(400, protocol.internal_field_message(field), param=field)
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        try:
            parsed: Any = model_cls.model_validate(data)
        except ValidationError as exc:
            message, location = _validation_message(exc)
            raise HTTPError(400, message, param=location) from None
        if chat and not parsed.messages:
            raise HTTPError(400, "'messages' must be a non-empty array", param="messages")
        key = (
            protocol.MAX_COMPLETION_TOKENS
            if chat and parsed.max_completion_tokens is not None
            else protocol.MAX_TOKENS
        )
        max_tokens = check_max_tokens(key, getattr(parsed, key))
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return ClientRequest(body, chat, bool(parsed.stream), include_usage, max_tokens, parsed.model, parsed)

    def context_request(
        self, req: ClientRequest, disagg_request_id: int, ask_b64_completions: bool = True
    ) -> bytes:
        """Leg (1); ``ask_b64_completions`` as in ``FastRelay.context_request``."""
        check_disagg_request_id(disagg_request_id)
        params = DisaggregatedParams(request_type=protocol.CONTEXT_ONLY, disagg_request_id=disagg_request_id)
        if self.tokids_b64 and (req.chat or ask_b64_completions):
            params.return_prompt_token_ids_b64 = True
        update = {"stream": False, protocol.STREAM_OPTIONS: None, protocol.DISAGGREGATED_PARAMS: params}
        return self._leg_body(req.parsed.model_copy(update=update), 400, "request body")

    def _leg_body(self, leg: BaseModel, status: int, what: str) -> bytes:
        """A leg's body from its model: JSON here (``status`` and ``what`` say whose fields a body
        this cannot carry came from: the msgpack variant's 400 or 502)."""
        return _dump(leg, "bytes", exclude_unset=True)

    def read_context(self, req: ClientRequest, body: bytes) -> ContextResult:
        try:
            data = json.loads(body)
            model_cls = ChatCompletionResponse if req.chat else CompletionResponse
            parsed: Any = model_cls.model_validate(data)
        except (ValueError, RecursionError) as exc:  # ValidationError is a ValueError
            raise HTTPError(502, f"context worker response is not usable: {exc}") from None
        if not parsed.choices:
            raise HTTPError(502, "context worker response has no choices[0]")
        choice = parsed.choices[0]
        completion_tokens = parsed.usage.completion_tokens if parsed.usage else None
        finished = not needs_generation(choice.finish_reason, completion_tokens, req.max_tokens)
        if not finished and choice.disaggregated_params is None:
            raise HTTPError(502, "context worker response lacks choices[0].disaggregated_params")
        return ContextResult(body, finished, parsed)

    def prompt_bytes(self, req: ClientRequest) -> int:
        """As ``FastRelay.prompt_bytes``: its own non-validating scan (the baseline's model keeps no
        byte spans)."""
        path = (protocol.MESSAGES,) if req.chat else (protocol.PROMPT,)
        try:
            span = fastcore.find_span(req.body, path, validate=False)
        except JSONSpanError:
            return 0
        return 0 if span is None else span[1] - span[0]

    def usage_tokens(self, ctx: ContextResult) -> None:
        """None: the learner reads ``usage`` from the bytes itself (the baseline's parse is its own)."""
        return None

    def auth_fields(self, ctx: ContextResult) -> tuple[object, object]:
        """As ``FastRelay.auth_fields``: from the parsed response model."""
        params = ctx.parsed.choices[0].disaggregated_params
        if params is None:
            return None, None
        return params.ctx_info_endpoint, params.encoded_opaque_state

    def generation_request(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        response = ctx.parsed
        params = response.choices[0].disaggregated_params.model_copy(
            update={protocol.REQUEST_TYPE: protocol.GENERATION_ONLY, protocol.CTX_USAGE: response.usage}
        )
        update: dict[str, Any] = {protocol.DISAGGREGATED_PARAMS: params}
        # Asked for base64 and got only the list (null or absent): the list goes on (docs/protocol.md (2)).
        if self.tokids_b64 and response.prompt_token_ids_b64 is not None:
            update[protocol.PROMPT_TOKEN_IDS_B64] = response.prompt_token_ids_b64
        else:
            if response.prompt_token_ids is None:
                raise HTTPError(
                    502,
                    "context worker response lacks prompt_token_ids"
                    + (" and prompt_token_ids_b64" if self.tokids_b64 else ""),
                )
            update[protocol.PROMPT_TOKEN_IDS if req.chat else "prompt"] = response.prompt_token_ids
        if self.strip_history and req.chat:
            update["messages"] = req.parsed.messages[-1:]
        return self._leg_body(req.parsed.model_copy(update=update), 502, "context worker response")

    # The legs as the orchestrator sends them: here one bytes body each (FastRelay's are pieces).
    context_pieces = context_request
    generation_pieces = generation_request

    def finished_answer(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        return _dump(ctx.parsed, "bytes", exclude_unset=True, exclude=_CLIENT_EXCLUDE)

    def client_answer(self, req: ClientRequest, body: bytes) -> bytes:
        try:
            model_cls = ChatCompletionResponse if req.chat else CompletionResponse
            parsed = model_cls.model_validate(json.loads(body))
        except (ValueError, RecursionError) as exc:
            raise HTTPError(502, f"generation worker response is not usable: {exc}") from None
        return _dump(parsed, "bytes", exclude_unset=True, exclude=_CLIENT_EXCLUDE)


_MSGPACK = msgspec.msgpack.Encoder()
#: The header line that flags a msgpack leg body (Content-Type stays application/json).
_MSGPACK_HEADER = f"{protocol.X_TRTLLM_MSGPACK}: {protocol.X_TRTLLM_MSGPACK_VALUE}\r\n".encode()


class ParsedMsgpackRelay(ParsedRelay):
    """The pydantic baseline with msgpack legs (config ``relay: parsed-msgpack``), as newer
    trtllm-serve orchestrators send them: each leg's body is the msgpack of the object the JSON
    baseline sends, flagged by :attr:`leg_headers`. Workers answer in JSON, read as the baseline
    reads them."""

    name = "parsed-msgpack"
    leg_headers = _MSGPACK_HEADER

    def _leg_body(self, leg: BaseModel, status: int, what: str) -> bytes:
        try:
            return _MSGPACK.encode(_dump(leg, "json", exclude_unset=True))
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # msgpack ints stop at 64 bits
            raise HTTPError(status, f"{what} cannot be sent as msgpack: {exc}") from None
