"""How the orchestrator turns a client body into the two legs' bodies, in two modes.

``FastRelay`` (config ``relay: fast``, the default) never builds Python objects
for a body: one compiled call per body (a ``fastcore.relay`` kernel) makes one
validating pass of the fastcore span scanner that checks all of it, decodes the
few small fields the orchestrator acts on (``stream``, ``max_tokens``,
``finish_reason``...) from their bytes, and cuts and splices every outgoing
body from the raw bytes with one allocation. Its Python work per request is
five calls and does not grow with the prompt.

``ParsedRelay`` (``relay: parsed``) is the baseline: what a typical pydantic
OpenAI orchestrator does (trtllm-serve's disaggregated server, for one):
``json.loads`` -> pydantic request/response models -> ``model_dump_json``. It
honours the same gates and gives clients the same outputs, so one deployment
can measure the difference.

Both raise :class:`server.errors.HTTPError`: 400 for a client's bad body,
502 for a worker's unusable one. Both hold a client body to the same policy as
the workers (server/worker/protocol.py): RFC 8259 JSON within fastcore's limits
(``fastcore.JSON_MAX_DEPTH``, ``fastcore.JSON_MAX_NUMBER_CHARS``), the fields
they act on strictly typed, no repeated key they would read one way and a worker
another (the fast mode refuses a repeat of the fields it reads and leaves other
repeats to the workers, which refuse them; the parsed mode, whose ``json.loads``
would keep the last copy and send only it on, refuses any top-level repeat).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

import fastcore
from fastcore import JSONSpanError, RelayError
from fastcore import relay as fastcore_relay
from server.errors import HTTPError

Span = tuple[int, int]

# Internal fields a client may never send (PROTOCOL.md, "Rules that hold everywhere").
INTERNAL_FIELDS_ALWAYS = ("disaggregated_params", "prompt_token_ids_b64")
INTERNAL_FIELDS_CHAT = ("prompt_token_ids",)
# finish_reason values of a context response after which a generation leg follows.
CONTINUE_REASONS = ("length", "not_finished")


@dataclass(slots=True)
class ClientRequest:
    """What the orchestrator needs of a client body; everything else stays bytes."""

    body: bytes
    chat: bool
    stream: bool
    include_usage: bool
    max_tokens: int | None
    model: str | None
    # FastRelay: the fastcore.relay.ClientBody (spans found once); ParsedRelay: its request model.
    parsed: Any = None


@dataclass(slots=True)
class ContextResult:
    body: bytes
    finished: bool
    parsed: Any = None  # ParsedRelay's response model


def _needs_generation(finish_reason: Any, completion_tokens: Any, max_tokens: int | None) -> bool:
    if finish_reason not in CONTINUE_REASONS:
        return False
    # Our context worker says "length" when the client's max_tokens is 1: that
    # leg already produced everything the client asked for.
    if finish_reason == "length" and max_tokens is not None and isinstance(completion_tokens, int):
        return completion_tokens < max_tokens
    return True


def malformed_json_error(body: bytes, what: str) -> str:
    """A message that says where ``body`` stops being JSON (byte offset)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"{what} is not valid UTF-8 (byte {exc.start})"
    try:
        fastcore.find_span(body, ())
    except JSONSpanError as exc:
        if exc.limit is not None:
            return f"{what} rejected: {exc}"
        return f"{what} is malformed JSON: {exc}"
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        offset = len(exc.doc[: exc.pos].encode("utf-8"))
        return f"{what} is malformed JSON: {exc.msg} (byte {offset})"
    except RecursionError:
        return f"{what} nests too deeply"
    except ValueError as exc:  # valid JSON Python will not read: an integer beyond its 4300 digits
        return f"{what} is not usable: {exc}"
    return f"{what} is malformed JSON"


def _check_max_tokens(key: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise HTTPError(400, f"'{key}' must be at least 1, got {value}", param=key)
    return value


# -- FastRelay: one compiled call per body -------------------------------------------------------
#
# Each body goes through one relay kernel of the fastcore scanner (fastcore.relay.Relay's
# ``*_kernel``): one validating scan, the small fields the orchestrator acts on decoded from their
# few bytes, every check, and the output built with one allocation, all in C (or in the pure twin).
# A refusal is a RelayError carrying the HTTP message and the 400's param; a malformed body, the
# scan's JSONSpanError, which _scan_refusal words.

def _scan_refusal(body: bytes, exc: JSONSpanError, what: str, status: int) -> HTTPError:
    """The error for a body the relay's scan stopped on: where it stops being UTF-8 or JSON, where
    it passes one of fastcore's limits (the workers refuse the same bodies), or the key it repeats
    (parsers disagree on which occurrence wins, so neither is guessed)."""
    try:
        str(body, "utf-8")  # only on this error path: a second look at the whole body is fine here
    except UnicodeDecodeError as error:
        return HTTPError(status, f"{what} is not valid UTF-8 (byte {error.start})")
    if exc.limit is not None or exc.key is not None:
        if status == 400:
            return HTTPError(400, f"{what} rejected: {exc}", param=exc.key)
        return HTTPError(status, f"{what} cannot be relayed: {exc}")
    return HTTPError(status, f"{what} is malformed JSON: {exc}")


class FastRelay:
    name = "fast"

    def __init__(self, *, tokids_b64: bool, strip_history: bool, relay: Any = None) -> None:
        # The relay kernels of the active scanner twin; tests pass ``fastcore.relay.Relay(twin)``
        # to run both.
        self.relay = relay if relay is not None else fastcore_relay
        self.tokids_b64 = tokids_b64
        self.strip_history = strip_history
        self._read_client = self.relay.client_kernel
        self._context_request = self.relay.context_request_kernel
        self._read_context = self.relay.context_kernel
        self._generation_request = self.relay.generation_request_kernel
        self._strip = self.relay.strip_kernel

    def read_client(self, body: bytes, chat: bool) -> ClientRequest:
        try:
            # One validating scan: the whole body is checked, and it finds every span both legs
            # splice and decodes the small fields read here.
            scan = self._read_client(body, chat)
        except JSONSpanError as exc:
            raise _scan_refusal(body, exc, "request body", 400) from None
        except RelayError as exc:
            raise HTTPError(400, str(exc), param=exc.field) from None
        return ClientRequest(body, chat, scan.stream, scan.include_usage, scan.max_tokens, scan.model, scan)

    def context_request(self, req: ClientRequest, disagg_request_id: int) -> bytes:
        return self._context_request(req.parsed, disagg_request_id, self.tokids_b64)

    def read_context(self, req: ClientRequest, body: bytes) -> ContextResult:
        try:
            # One validating scan; its spans go to generation_request.
            scan = self._read_context(body, req.max_tokens)
        except JSONSpanError as exc:
            raise _scan_refusal(body, exc, "context worker response", 502) from None
        except RelayError as exc:
            raise HTTPError(502, str(exc)) from None
        return ContextResult(body, scan.finished, scan)

    def generation_request(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        try:
            return self._generation_request(req.parsed, ctx.parsed, self.tokids_b64, self.strip_history)
        except RelayError as exc:
            raise HTTPError(502, str(exc)) from None

    def finished_answer(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        try:
            # read_context validated these bytes: this scan only finds the members to cut.
            return self._strip(ctx.body, False)
        except (RelayError, JSONSpanError) as exc:  # e.g. a choice beyond the first repeats a key
            raise HTTPError(502, f"context worker response cannot be relayed: {exc}") from None

    def client_answer(self, req: ClientRequest, body: bytes) -> bytes:
        try:
            # One validating scan; the body itself comes back when there is nothing to cut.
            return self._strip(body, True)
        except JSONSpanError as exc:
            raise _scan_refusal(body, exc, "generation worker response", 502) from None
        except RelayError as exc:
            raise HTTPError(502, f"generation worker response cannot be relayed: {exc}") from None


# ---------------------------------------------------------------------------
# The parsed baseline: OpenAI models in pydantic, as a typical orchestrator has
# them. Unknown fields are kept (extra="allow") and dumps leave out what the
# sender left out (exclude_unset), so workers and clients see the same JSON.


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


_CLIENT_EXCLUDE: Any = {
    "prompt_token_ids": True,
    "prompt_token_ids_b64": True,
    "choices": {"__all__": {"disaggregated_params"}},
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
    options = data.get("stream_options")
    if type(options) is dict:
        paths += [("stream_options", key) for key in options]
    try:
        fastcore.find_spans(body, paths)
    except JSONSpanError as exc:
        raise _scan_refusal(body, exc, "request body", 400) from None


class ParsedRelay:
    name = "parsed"

    def __init__(self, *, tokids_b64: bool, strip_history: bool) -> None:
        self.tokids_b64 = tokids_b64
        self.strip_history = strip_history

    def read_client(self, body: bytes, chat: bool) -> ClientRequest:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise HTTPError(400, malformed_json_error(body, "request body")) from None
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object")
        _check_client_members(body, data)
        for field in INTERNAL_FIELDS_ALWAYS + (INTERNAL_FIELDS_CHAT if chat else ()):
            if field in data:
                raise HTTPError(
                    400, f"'{field}' is an internal field and may not be sent by clients", param=field
                )
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        try:
            parsed: Any = model_cls.model_validate(data)
        except ValidationError as exc:
            message, location = _validation_message(exc)
            raise HTTPError(400, message, param=location) from None
        if chat and not parsed.messages:
            raise HTTPError(400, "'messages' must be a non-empty array", param="messages")
        key = "max_completion_tokens" if chat and parsed.max_completion_tokens is not None else "max_tokens"
        max_tokens = _check_max_tokens(key, getattr(parsed, key))
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return ClientRequest(body, chat, bool(parsed.stream), include_usage, max_tokens, parsed.model, parsed)

    def context_request(self, req: ClientRequest, disagg_request_id: int) -> bytes:
        params = DisaggregatedParams(request_type="context_only", disagg_request_id=disagg_request_id)
        if self.tokids_b64:
            params.return_prompt_token_ids_b64 = True
        update = {"stream": False, "stream_options": None, "disaggregated_params": params}
        return req.parsed.model_copy(update=update).model_dump_json(exclude_unset=True).encode()

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
        finished = not _needs_generation(choice.finish_reason, completion_tokens, req.max_tokens)
        if not finished and choice.disaggregated_params is None:
            raise HTTPError(502, "context worker response lacks choices[0].disaggregated_params")
        return ContextResult(body, finished, parsed)

    def generation_request(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        response = ctx.parsed
        params = response.choices[0].disaggregated_params.model_copy(
            update={"request_type": "generation_only", "ctx_usage": response.usage}
        )
        update: dict[str, Any] = {"disaggregated_params": params}
        if self.tokids_b64:
            if response.prompt_token_ids_b64 is None:
                raise HTTPError(502, "context worker response lacks prompt_token_ids_b64")
            update["prompt_token_ids_b64"] = response.prompt_token_ids_b64
        else:
            if response.prompt_token_ids is None:
                raise HTTPError(502, "context worker response lacks prompt_token_ids")
            update["prompt_token_ids" if req.chat else "prompt"] = response.prompt_token_ids
        if self.strip_history and req.chat:
            update["messages"] = req.parsed.messages[-1:]
        return req.parsed.model_copy(update=update).model_dump_json(exclude_unset=True).encode()

    def finished_answer(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        return ctx.parsed.model_dump_json(exclude_unset=True, exclude=_CLIENT_EXCLUDE).encode()

    def client_answer(self, req: ClientRequest, body: bytes) -> bytes:
        try:
            model_cls = ChatCompletionResponse if req.chat else CompletionResponse
            parsed = model_cls.model_validate(json.loads(body))
        except (ValueError, RecursionError) as exc:
            raise HTTPError(502, f"generation worker response is not usable: {exc}") from None
        return parsed.model_dump_json(exclude_unset=True, exclude=_CLIENT_EXCLUDE).encode()


def make_relay(mode: str, *, tokids_b64: bool, strip_history: bool) -> FastRelay | ParsedRelay:
    cls = {"fast": FastRelay, "parsed": ParsedRelay}[mode]
    return cls(tokids_b64=tokids_b64, strip_history=strip_history)


# ---------------------------------------------------------------------------
# A finished context response, streamed. The answer is one token long, so
# building its chunks from a parse of the (stripped) answer costs the same
# whatever the prompt length.


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def answer_as_sse(answer: bytes, *, chat: bool, include_usage: bool) -> bytes:
    """The SSE stream a streaming worker would have sent for the complete ``answer``.

    ``answer`` is a context worker's finished response, stripped: the fast relay
    checked only what it acts on, so a shape this cannot stream (nesting past
    Python's recursion limit, an integer past its 4300 digits, a choice that is
    not an object) is the worker's 502 here, never an exception of another kind.
    """
    try:
        return _answer_as_sse(answer, chat=chat, include_usage=include_usage)
    except (ValueError, RecursionError, AttributeError, TypeError) as exc:
        raise HTTPError(502, f"context worker response cannot be streamed: {exc!r}"[:500]) from None


def _answer_as_sse(answer: bytes, *, chat: bool, include_usage: bool) -> bytes:
    data = json.loads(answer)
    head = {
        "id": data.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": data.get("created", int(time.time())),
        "model": data.get("model"),
    }
    # The worker's own SSE shape (server/worker/protocol.py, StreamWriterState):
    # chat opens with a role chunk; text comes next; then a chunk with the
    # finish reason and an empty delta (chat) or empty text (completions).
    events: list[dict[str, Any]] = []
    for choice in data.get("choices", []):
        index, finish = choice.get("index", 0), choice.get("finish_reason")
        if chat:
            text = (choice.get("message") or {}).get("content") or ""
            opening = {"role": "assistant", "content": ""}
            events.append(
                {
                    **head,
                    "choices": [{"index": index, "delta": opening, "logprobs": None, "finish_reason": None}],
                }
            )
            if text:
                piece = {
                    "index": index,
                    "delta": {"content": text},
                    "logprobs": choice.get("logprobs"),
                    "finish_reason": None,
                }
                events.append({**head, "choices": [piece]})
            events.append(
                {
                    **head,
                    "choices": [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}],
                }
            )
        else:
            text = choice.get("text") or ""
            if text:
                piece = {
                    "index": index,
                    "text": text,
                    "logprobs": choice.get("logprobs"),
                    "finish_reason": None,
                }
                events.append({**head, "choices": [piece]})
            events.append(
                {**head, "choices": [{"index": index, "text": "", "logprobs": None, "finish_reason": finish}]}
            )
    if include_usage and data.get("usage") is not None:
        events.append({**head, "choices": [], "usage": data["usage"]})
    return b"".join(_sse(e) for e in events) + b"data: [DONE]\n\n"
