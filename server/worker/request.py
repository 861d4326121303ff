"""A generation request read into a :class:`ParsedRequest`: one object owns it.

:class:`RequestReader` turns the raw body of ``/v1/chat/completions`` or
``/v1/completions`` into a :class:`ParsedRequest`: validated sampling
parameters, the prompt as int32 ids (tokenized, or taken as given from
``prompt_token_ids`` / ``prompt_token_ids_b64`` / a list ``prompt``), and the
``disaggregated_params`` of docs/protocol.md. Every problem raises
:class:`server.errors.HTTPError` with a 400/404 naming the field.

The body is read once: a JSON body by one validating scan and one parse of the
rest (:mod:`server.worker.json_body`), its token field decoded from the body's
bytes (base64 by ``fastcore.decode_tokens`` on a memoryview, a list by
pysimdjson into an int64 buffer); a msgpack body by one msgpack decode, its
ids decoded as integers (:mod:`server.worker.msgpack_body`). Either way
:func:`read_request` then reads the fields from the same dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

import fastcore
from fastcore import protocol as wire
from server.errors import HTTPError

from .json_body import JSON_BODY, SIMDJSON, JSONBody, RawJSON, Route, bad_request, brief
from .msgpack_body import TokenIds, load_msgpack_body
from .output import SamplingParams
from .tokenizer import Tokenizer
from .tool_calls import ToolRequest, read_tools, template_messages

if TYPE_CHECKING:
    from server.http import Request

#: trtllm-serve's flag for a msgpack body (openai_server._MsgspecRequest); only "1" means msgpack
_MSGPACK = wire.X_TRTLLM_MSGPACK.lower().encode()
CONTEXT_ONLY = wire.CONTEXT_ONLY
GENERATION_ONLY = wire.GENERATION_ONLY
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass
class DisaggParams:
    request_type: str  # "context_only" or "generation_only"
    disagg_request_id: Any = None
    return_prompt_token_ids_b64: bool = False
    first_gen_tokens: list[int] = field(default_factory=list)
    ctx_request_id: int | None = None
    ctx_info_endpoint: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedRequest:
    route: Route
    # The body's values; a JSON body's token field (the one prompt_ids came from) is a RawJSON of its bytes.
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    # int32, 1-D; from the tokenizer or straight from the request's ids.
    prompt_ids: np.ndarray
    prompt_from_ids: bool
    disagg: DisaggParams | None
    # Chat: logprobs as {"content": [...]}; completions: the legacy columns.
    want_logprobs: bool = False
    #: vLLM's and trtllm-serve's ``cache_salt``: requests with different salts share no cached KV
    cache_salt: str | None = None
    #: the body came as msgpack (``X-TRTLLM-Msgpack: 1``): ``body`` holds its JSON twin's values
    msgpack: bool = False
    #: chat: the request's tools, tool_choice and the parser its answer goes through (tool_calls.py)
    tools: ToolRequest | None = None

    @property
    def is_context_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == CONTEXT_ONLY

    @property
    def is_generation_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == GENERATION_ONLY


def _int_field(
    body: dict[str, Any], name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be an integer", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{name}' must be <= {maximum}, got {value}", name)
    return value


def _float_field(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def _checked_ids(ids: np.ndarray, name: str, vocab_size: int) -> np.ndarray:
    """int64 ids from a JSON list, range-checked as :func:`_ids_from_list` does, as int32."""
    if ids.size == 0:
        raise bad_request(f"'{name}' must be a non-empty list of token ids", name)
    unsigned = ids.view(np.uint64)  # negatives wrap to huge values: one comparison checks both ends
    if unsigned.max() >= vocab_size:
        i = int(np.argmax(unsigned >= vocab_size))
        raise bad_request(f"'{name}[{i}]' = {int(ids[i])} is outside the vocabulary [0, {vocab_size})", name)
    return ids.astype(np.int32)


def _raw_int_list(value: RawJSON) -> np.ndarray | None:
    """A flat JSON list of integers straight from the body's bytes as int64, or None."""
    if value.data.find(b"[", value.start + 1, value.end) != -1:
        return None  # nested: as_buffer would flatten it
    return SIMDJSON.int64_list(memoryview(value.data)[value.start : value.end])


_INT_ONLY = {int}


def _ids_from_list(value: Any, name: str, vocab_size: int) -> np.ndarray:
    if isinstance(value, RawJSON):
        ids = _raw_int_list(value)
        if ids is not None:
            return _checked_ids(ids, name, vocab_size)
        value = value.value()  # anything else: the general path, with its messages
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{name}' must be a non-empty list of token ids", name)
    if type(value) is TokenIds or set(map(type, value)) == _INT_ONLY:  # one conversion, checked as above
        try:
            return _checked_ids(np.fromiter(value, np.int64, len(value)), name, vocab_size)
        except OverflowError:  # beyond int64: the loop below names the id
            pass
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad_request(f"'{name}[{i}]' must be an integer token id", name)
        if not 0 <= t < vocab_size:
            raise bad_request(f"'{name}[{i}]' = {t} is outside the vocabulary [0, {vocab_size})", name)
    return np.asarray(value, dtype=np.int32)


def _decode_b64(value: Any, max_context: int) -> np.ndarray:
    name = wire.PROMPT_TOKEN_IDS_B64
    if isinstance(value, RawJSON):
        inner = memoryview(value.data)[value.start + 1 : value.end - 1]
        try:
            return fastcore.decode_tokens(inner, max_tokens=max_context)
        except (ValueError, OverflowError):
            # Escapes, non-ASCII or bad data: the string's value decides, and gives the message.
            text = value.value()
            try:
                return fastcore.decode_tokens(text, max_tokens=max_context)
            except (ValueError, OverflowError) as exc:
                message = f"'{name}' is invalid: {exc}"
                offset = getattr(exc, "offset", None)
                if offset is not None and b"\\" not in inner:
                    # Without escapes, the string's byte i is the body's byte start + 1 + i.
                    message += f" (request body byte {value.start + 1 + offset})"
                raise bad_request(message, name) from None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a base64 string", name)
    try:
        return fastcore.decode_tokens(value, max_tokens=max_context)
    except (ValueError, OverflowError) as exc:  # TokenDecodeError is a ValueError; it names the byte offset
        raise bad_request(f"'{name}' is invalid: {exc}", name) from None


def _ids_from_b64(value: Any, vocab_size: int, max_context: int) -> np.ndarray:
    """``prompt_token_ids_b64`` -> int32 array via ``fastcore.decode_tokens``: no Python list.

    ``value``: the string, or the :class:`RawJSON` of it in the body (decoded from
    the body's bytes: no ``str`` either).
    """
    name = wire.PROMPT_TOKEN_IDS_B64
    ids = _decode_b64(value, max_context)
    if ids.size == 0:
        raise bad_request(f"'{name}' holds no token ids", name)
    unsigned = ids.view(np.uint32)  # negatives wrap to huge values: one comparison checks both ends
    if unsigned.max() >= vocab_size:
        i = int(np.argmax(unsigned >= vocab_size))
        raise bad_request(
            f"'{name}' id {int(ids[i])} at index {i} is outside the vocabulary [0, {vocab_size})", name
        )
    return ids


def _parse_disagg(body: dict[str, Any], vocab_size: int) -> DisaggParams | None:
    name = wire.DISAGGREGATED_PARAMS
    raw = body.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request(f"'{name}' must be an object", name)
    kind = raw.get(wire.REQUEST_TYPE)
    if kind not in wire.REQUEST_TYPES:
        raise bad_request(
            f"'{name}.request_type' must be '{CONTEXT_ONLY}' or '{GENERATION_ONLY}', got {brief(kind)}", name
        )
    params = DisaggParams(request_type=kind, disagg_request_id=raw.get(wire.DISAGG_REQUEST_ID), raw=raw)
    want_b64 = raw.get(wire.RETURN_PROMPT_TOKEN_IDS_B64)
    if want_b64 is not None and type(want_b64) is not bool:
        raise bad_request(f"'{name}.return_prompt_token_ids_b64' must be a boolean", name)
    params.return_prompt_token_ids_b64 = want_b64 is True
    if kind == GENERATION_ONLY:
        first = raw.get(wire.FIRST_GEN_TOKENS)
        if not isinstance(first, list) or not first:
            raise bad_request(f"'{name}.first_gen_tokens' must be a non-empty list of token ids", name)
        params.first_gen_tokens = _ids_from_list(first, f"{name}.first_gen_tokens", vocab_size).tolist()
        ctx_id = raw.get(wire.CTX_REQUEST_ID)
        if ctx_id is not None and (not isinstance(ctx_id, int) or isinstance(ctx_id, bool)):
            raise bad_request(f"'{name}.ctx_request_id' must be an integer", name)
        params.ctx_request_id = ctx_id
        endpoint = raw.get(wire.CTX_INFO_ENDPOINT)
        if endpoint is not None and not isinstance(endpoint, str):
            raise bad_request(f"'{name}.ctx_info_endpoint' must be a string", name)
        params.ctx_info_endpoint = endpoint
    return params


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return stop


def _logprobs(body: dict[str, Any], route: Route) -> int | None:
    if route == "chat":
        if not _bool_field(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return _int_field(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    value = body.get("logprobs")
    if value is None:
        return None
    return _int_field(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)


def _prompt(
    body: dict[str, Any],
    route: Route,
    tokenizer: Tokenizer,
    disagg: DisaggParams | None,
    max_context: int,
    tools: ToolRequest | None = None,
) -> tuple[np.ndarray, bool]:
    vocab = tokenizer.vocab_size
    if body.get(wire.PROMPT_TOKEN_IDS_B64) is not None:
        return _ids_from_b64(body[wire.PROMPT_TOKEN_IDS_B64], vocab, max_context), True
    if route == "chat" and body.get(wire.PROMPT_TOKEN_IDS) is not None:
        return _ids_from_list(body[wire.PROMPT_TOKEN_IDS], wire.PROMPT_TOKEN_IDS, vocab), True
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, RawJSON):
            ids = _raw_int_list(prompt)
            if ids is not None:
                return _checked_ids(ids, "prompt", vocab), True
            prompt = prompt.value()  # a batch, strings, floats...: the general path below
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if prompt and not isinstance(prompt[0], int):
                raise bad_request(
                    "'prompt' must be a string or a list of token ids; batches are not supported", "prompt"
                )
            return _ids_from_list(prompt, "prompt", vocab), True
        if disagg is not None and disagg.request_type == GENERATION_ONLY:
            raise bad_request(
                "a generation_only request must carry the prompt as token ids "
                "('prompt' as a list of ids, or 'prompt_token_ids_b64')",
                "prompt",
            )
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")
        return np.asarray(tokenizer.encode(prompt), dtype=np.int32), False
    if disagg is not None and disagg.request_type == GENERATION_ONLY:
        raise bad_request(
            "a generation_only request must carry the prompt as token ids "
            "('prompt_token_ids' or 'prompt_token_ids_b64')",
            wire.PROMPT_TOKEN_IDS,
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", "messages")
    messages = template_messages(messages)
    # tools= only when given: a template sees them as transformers passes them (the schemas as sent)
    extra = {"tools": tools.tools} if tools is not None and tools.tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    except RecursionError:  # a template walking deeply nested content
        raise bad_request("'messages' nest too deeply for the chat template", "messages") from None
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32), False


# Fields this worker does not implement, with the values that mean "off": anything
# else is refused rather than silently ignored. A value matches by type too (``true``
# is not 1, ``0.0`` is not ``false``).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(off) and value == off for off in neutral)


def _token_limit(body: dict[str, Any], route: Route) -> tuple[str, int | None]:
    """The request's token limit and the field it came from, read as the orchestrator reads it
    (fastcore's read_client_request): chat checks both fields' types and the first set one
    counts (``max_completion_tokens``), completions has ``max_tokens`` only."""
    tokens = _int_field(body, wire.MAX_TOKENS)
    if route == "chat":
        completion = _int_field(body, wire.MAX_COMPLETION_TOKENS)
        if completion is not None:
            tokens = completion
            key = wire.MAX_COMPLETION_TOKENS
        else:
            key = wire.MAX_TOKENS
    else:
        key = wire.MAX_TOKENS
    if tokens is not None and tokens < 1:
        raise bad_request(f"'{key}' must be >= 1, got {tokens}", key)
    return key, tokens


def _model(body: dict[str, Any], model_name: str) -> str:
    model = body.get("model")
    if model is None:  # absent or null, as the orchestrator reads it
        return model_name
    if type(model) is not str:
        raise bad_request("'model' must be a string", "model")
    if model != model_name:
        raise HTTPError(
            404,
            f"model {brief(model)} does not exist; the model served is {model_name!r} (GET /v1/models lists it)",
            param="model",
            code="model_not_found",
        )
    return model


def read_request(
    body: dict[str, Any],
    route: Route,
    *,
    tokenizer: Tokenizer,
    model_name: str,
    max_context: int,
    tool_call_parser: str = "none",
) -> ParsedRequest:
    """The request in ``body`` (a loaded body: :class:`RequestReader`, or the reference
    ``json_body.load_json_body``), or an :class:`HTTPError` (400/404). ``tool_call_parser``: how
    a chat answer's tool calls are read out of its text (tool_calls.py)."""
    # Every field is read strictly, by type (no bool for a number, no 1.0 for an int), and as
    # the orchestrator reads the ones it acts on: a body is never read two ways. The parts below
    # read the fields in this order (the first bad one is the 400).
    _model(body, model_name)
    _refuse_unsupported(body)
    stream = _bool_field(body, "stream")
    include_usage = _include_usage(body)
    tools = _route_tools(body, route, tool_call_parser)
    key, max_tokens = _token_limit(body, route)
    disagg = _parse_disagg(body, tokenizer.vocab_size)
    prompt_ids, from_ids = _prompt(body, route, tokenizer, disagg, max_context, tools)
    max_tokens = _fit_context(prompt_ids.size, max_context, key, max_tokens, route, from_ids)
    params = _sampling_params(body, route, max_tokens, tokenizer.vocab_size)
    return ParsedRequest(
        route=route,
        body=body,
        model=model_name,
        stream=stream,
        include_usage=include_usage,
        params=params,
        prompt_ids=prompt_ids,
        prompt_from_ids=from_ids,
        disagg=disagg,
        want_logprobs=params.logprobs is not None,
        cache_salt=_cache_salt(body),
        tools=tools,
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 for a field this worker does not do, given a value that is not its neutral one
    (``n`` other than 1 among them)."""
    for name, neutral in _UNSUPPORTED.items():
        if not _is_neutral(body.get(name), neutral):
            raise bad_request(f"'{name}' is not supported by this worker (got {brief(body[name])})", name)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise bad_request(
            f"'n' must be the integer 1 (got {brief(n)}): this worker returns one choice per request", "n"
        )


def _include_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage`` (False without ``stream_options``)."""
    stream_options = body.get(wire.STREAM_OPTIONS)
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", wire.STREAM_OPTIONS)
    return _bool_field(stream_options, wire.INCLUDE_USAGE)


def _route_tools(body: dict[str, Any], route: Route, tool_call_parser: str) -> ToolRequest | None:
    """A chat request's tools (:func:`read_tools`); a completion's must be absent or empty."""
    if route == "chat":
        return read_tools(body, tool_call_parser)
    if _is_neutral(body.get("tools"), (None, [])):
        return None
    # OpenAI's completions have no tools
    raise bad_request(f"'tools' is not supported on completions (got {brief(body['tools'])})", "tools")


def _fit_context(
    prompt_size: int, max_context: int, key: str, max_tokens: int | None, route: Route, from_ids: bool
) -> int:
    """The generated tokens' bound: ``max_tokens`` (``key``: the field that gave it) where the
    prompt plus it fit the model's context, the room left when none was given; else a 400."""
    if prompt_size >= max_context:
        raise bad_request(
            f"the prompt has {prompt_size} tokens; this model's context is {max_context} tokens "
            "(prompt plus at least one generated token)",
            "messages" if route == "chat" and not from_ids else "prompt",
        )
    room = max_context - int(prompt_size)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"{key} ({max_tokens}) plus the prompt ({prompt_size} tokens) exceeds "
            f"this model's context of {max_context} tokens",
            key,
        )
    return max_tokens


def _sampling_params(body: dict[str, Any], route: Route, max_tokens: int, vocab_size: int) -> SamplingParams:
    """The sampling fields, read in this order: stop_token_ids, top_k, temperature, top_p, seed,
    stop, ignore_eos, logprobs (then a top_p of 0 refused)."""
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None or stop_token_ids == []:
        stop_token_ids = []
    else:
        stop_token_ids = _ids_from_list(stop_token_ids, "stop_token_ids", vocab_size).tolist()
    top_k = _int_field(body, "top_k", minimum=-1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        seed=_int_field(body, "seed"),
        stop=_stop_strings(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool_field(body, "ignore_eos"),
        logprobs=_logprobs(body, route),
    )
    if params.top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", "top_p")
    return params


def _cache_salt(body: dict[str, Any]) -> str | None:
    """``cache_salt`` as vLLM and trtllm-serve read it: absent or null is none; anything but a
    string with a non-blank character is a 400 (their wording)."""
    salt = body.get(wire.CACHE_SALT)
    if salt is None:
        return None
    if type(salt) is not str or not salt.strip():
        raise bad_request(
            f"Parameter '{wire.CACHE_SALT}' must be a non-empty string if provided (got {brief(salt)})",
            wire.CACHE_SALT,
        )
    return salt


class LegAuth(Protocol):
    """The decisions on a leg's internal auth taken as its body is read (:mod:`server.worker.internal_auth`)."""

    def authenticate(self, request: Request) -> bool: ...

    def refuse_unsigned_early(self, body: dict[str, Any], request: Request, signed: bool) -> None: ...

    def authorize(self, req: ParsedRequest, request: Request, signed: bool) -> None: ...


class RequestReader:
    """Reads one worker's generation requests into validated :class:`ParsedRequest` objects: the
    body (JSON, or msgpack when the request says so) loaded once, the leg's internal auth
    decided on the way, the fields read, the prompt turned into ids, the leg checked against the
    worker's role."""

    #: the JSON loader, on the active scanner twin (a test or benchmark chooses the other by a subclass)
    json_body: ClassVar[JSONBody] = JSON_BODY

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        max_context: int,
        role: str,
        tool_call_parser: str = "none",
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.role = role
        self.tool_call_parser = tool_call_parser

    def read(self, request: Request, route: Route, auth: LegAuth) -> ParsedRequest:
        """``request``'s body as a validated request, or a 400/403/404: the fastcore signature is
        checked on the bytes as sent before anything is read; an unsigned leg is refused once its
        body is loaded, before any field is read or anything tokenized."""
        signed = auth.authenticate(request)
        msgpack = request.header(_MSGPACK) == b"1"
        body = load_msgpack_body(request.body) if msgpack else self.json_body.load(request.body, route)
        auth.refuse_unsigned_early(body, request, signed)
        req = read_request(
            body,
            route,
            tokenizer=self.tokenizer,
            model_name=self.model_name,
            max_context=self.max_context,
            tool_call_parser=self.tool_call_parser,
        )
        req.msgpack = msgpack
        auth.authorize(req, request, signed)
        self._check_role(req)
        return req

    def tokenize(self, request: Request) -> np.ndarray:
        """``POST /tokenize`` (vLLM's): the prompt ids of a chat body (``messages``, ``tools``: the
        template applied with its generation prompt) or a completion body (``prompt``), as a
        completion of that body is given them. Nothing else of a completion is read, nor the
        context's bound: a count is asked of any prompt, often to learn whether it fits."""
        body = self.json_body.load(request.body, "chat")
        _model(body, self.model_name)
        if "prompt" in body and "messages" not in body:
            ids, _ = _prompt(body, "completions", self.tokenizer, None, self.max_context)
            return ids
        tools = read_tools(body, self.tool_call_parser)
        ids, _ = _prompt(body, "chat", self.tokenizer, None, self.max_context, tools)
        return ids

    def _check_role(self, req: ParsedRequest) -> None:
        if req.disagg is None:
            return
        kind = req.disagg.request_type
        if kind == CONTEXT_ONLY and self.role == "generation":
            raise HTTPError(
                400,
                "this worker's role is generation: it does not take context_only requests",
                param=wire.DISAGGREGATED_PARAMS,
            )
        if kind == GENERATION_ONLY and self.role == "context":
            raise HTTPError(
                400,
                "this worker's role is context: it does not take generation_only requests",
                param=wire.DISAGGREGATED_PARAMS,
            )


__all__ = [
    "CONTEXT_ONLY",
    "GENERATION_ONLY",
    "DisaggParams",
    "ParsedRequest",
    "RawJSON",
    "RequestReader",
    "Route",
    "read_request",
]
