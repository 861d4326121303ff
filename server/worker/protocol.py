"""OpenAI request parsing and response building for workers (no torch, no engine).

:func:`parse_request` turns the raw body of ``/v1/chat/completions`` or
``/v1/completions`` into a :class:`ParsedRequest`: validated sampling
parameters, the prompt as int32 ids (tokenized, or taken as given from
``prompt_token_ids`` / ``prompt_token_ids_b64`` / a list ``prompt``), and the
``disaggregated_params`` of PROTOCOL.md. Every problem raises
:class:`server.errors.HTTPError` with a 400/404 naming the field.

The builders (:func:`completion_body`, :func:`stream_chunk`, ...) produce the
OpenAI JSON and SSE shapes. The torch worker and a synthetic engine share
them, and so can the orchestrator when it answers from a context response.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from server.errors import HTTPError

from .output import Delta, SamplingParams, TokenLogprob
from .tokenizer import Tokenizer

Route = Literal["chat", "completions"]

CONTEXT_ONLY = "context_only"
GENERATION_ONLY = "generation_only"
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

    @property
    def is_context_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == CONTEXT_ONLY

    @property
    def is_generation_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == GENERATION_ONLY


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param)


def load_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says where it is malformed (byte offset)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        offset = len(text[: exc.pos].encode("utf-8"))
        raise bad_request(f"request body is not valid JSON: {exc.msg} (byte {offset})") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


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


def _ids_from_list(value: Any, name: str, vocab_size: int) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{name}' must be a non-empty list of token ids", name)
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad_request(f"'{name}[{i}]' must be an integer token id", name)
        if not 0 <= t < vocab_size:
            raise bad_request(f"'{name}[{i}]' = {t} is outside the vocabulary [0, {vocab_size})", name)
    return np.asarray(value, dtype=np.int32)


def _ids_from_b64(value: Any, vocab_size: int, max_context: int) -> np.ndarray:
    """``prompt_token_ids_b64`` -> int32 array via ``fastcore.decode_tokens``: no Python list."""
    name = "prompt_token_ids_b64"
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a base64 string", name)
    import fastcore  # the codec; imported here so a worker starts even while it is being built

    try:
        ids = fastcore.decode_tokens(value, max_tokens=max_context)
    except (ValueError, OverflowError) as exc:  # TokenDecodeError is a ValueError; it names the byte offset
        raise bad_request(f"'{name}' is invalid: {exc}", name) from None
    if ids.size == 0:
        raise bad_request(f"'{name}' holds no token ids", name)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise bad_request(
            f"'{name}' id {int(ids[i])} at index {i} is outside the vocabulary [0, {vocab_size})", name
        )
    return ids


def _parse_disagg(body: dict[str, Any], vocab_size: int) -> DisaggParams | None:
    raw = body.get("disaggregated_params")
    if raw is None:
        return None
    name = "disaggregated_params"
    if not isinstance(raw, dict):
        raise bad_request(f"'{name}' must be an object", name)
    kind = raw.get("request_type")
    if kind not in (CONTEXT_ONLY, GENERATION_ONLY):
        raise bad_request(
            f"'{name}.request_type' must be '{CONTEXT_ONLY}' or '{GENERATION_ONLY}', got {kind!r}", name
        )
    params = DisaggParams(request_type=kind, disagg_request_id=raw.get("disagg_request_id"), raw=raw)
    params.return_prompt_token_ids_b64 = raw.get("return_prompt_token_ids_b64") is True
    if kind == GENERATION_ONLY:
        first = raw.get("first_gen_tokens")
        if not isinstance(first, list) or not first:
            raise bad_request(f"'{name}.first_gen_tokens' must be a non-empty list of token ids", name)
        params.first_gen_tokens = _ids_from_list(first, f"{name}.first_gen_tokens", vocab_size).tolist()
        ctx_id = raw.get("ctx_request_id")
        if ctx_id is not None and (not isinstance(ctx_id, int) or isinstance(ctx_id, bool)):
            raise bad_request(f"'{name}.ctx_request_id' must be an integer", name)
        params.ctx_request_id = ctx_id
        endpoint = raw.get("ctx_info_endpoint")
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
) -> tuple[np.ndarray, bool]:
    vocab = tokenizer.vocab_size
    if "prompt_token_ids_b64" in body and body["prompt_token_ids_b64"] is not None:
        return _ids_from_b64(body["prompt_token_ids_b64"], vocab, max_context), True
    if route == "chat" and body.get("prompt_token_ids") is not None:
        return _ids_from_list(body["prompt_token_ids"], "prompt_token_ids", vocab), True
    if route == "completions":
        prompt = body.get("prompt")
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
            "prompt_token_ids",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32), False


# Fields this worker does not implement, with the values that mean "off": anything
# else is refused rather than silently ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


def prompt_ids_members(prompt_ids: np.ndarray, *, b64: bool) -> list[bytes]:
    """A context response's prompt-id members (PROTOCOL.md (2)), as pieces of JSON text to append.

    The base64 form goes from the int32 array to base64 bytes
    (``fastcore.encode_tokens``) and into the body as they are: no Python
    ``str``, no pass of ``json.dumps``' escape scan over ~4/3 bytes per id
    (base64 never needs escaping), and no copy until :func:`dump_with_members`
    joins the pieces into the one body allocation. The list form is what a
    worker without the fast path sends.
    """
    if b64:
        import fastcore

        return [
            b', "prompt_token_ids": null, "prompt_token_ids_b64": "',
            fastcore.encode_tokens(prompt_ids),
            b'"',
        ]
    return [b', "prompt_token_ids": ', json.dumps(prompt_ids.tolist()).encode()]


def dump_with_members(body: dict[str, Any], members: list[bytes]) -> bytes:
    """``json.dumps(body)`` with ``members`` (JSON text starting with a comma) before its closing brace."""
    data = json.dumps(body).encode()
    return b"".join([memoryview(data)[:-1], *members, b"}"]) if members else data


def parse_request(
    raw: bytes,
    route: Route,
    *,
    tokenizer: Tokenizer,
    model_name: str,
    max_context: int,
) -> ParsedRequest:
    body = load_json_body(raw)
    model = body.get("model", model_name)
    if model != model_name:
        raise HTTPError(404, f"model {model!r} does not exist; this worker serves {model_name!r}",
                        param="model", code="model_not_found")  # fmt: skip
    for name, neutral in _UNSUPPORTED.items():
        if body.get(name) not in neutral:
            raise bad_request(f"'{name}' is not supported by this worker (got {body[name]!r})", name)
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1 (got {n!r}): this worker returns one choice per request", "n")
    stream = _bool_field(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = stream_options.get("include_usage") is True
    disagg = _parse_disagg(body, tokenizer.vocab_size)
    prompt_ids, from_ids = _prompt(body, route, tokenizer, disagg, max_context)
    if prompt_ids.size >= max_context:
        raise bad_request(
            f"the prompt has {prompt_ids.size} tokens; this model's context is {max_context} tokens "
            "(prompt plus at least one generated token)",
            "messages" if route == "chat" and not from_ids else "prompt",
        )
    room = max_context - int(prompt_ids.size)
    max_tokens = _int_field(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"max_tokens ({max_tokens}) plus the prompt ({prompt_ids.size} tokens) exceeds "
            f"this model's context of {max_context} tokens",
            "max_tokens",
        )
    stop_token_ids = body.get("stop_token_ids") or []
    if stop_token_ids:
        stop_token_ids = _ids_from_list(stop_token_ids, "stop_token_ids", tokenizer.vocab_size).tolist()
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
    )


# ---------------------------------------------------------------- responses


def new_response_id(route: Route) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(logprobs: list[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(
    logprobs: list[TokenLogprob], tokenizer: Tokenizer, text_offset: int = 0
) -> dict[str, Any]:
    tokens, offsets, top = [], [], []
    for lp in logprobs:
        piece = tokenizer.decode([lp.token_id])
        tokens.append(piece)
        offsets.append(text_offset)
        text_offset += len(piece)
        top.append({tokenizer.decode([t]): v for t, v in lp.top})
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _logprobs_field(
    route: Route, logprobs: list[TokenLogprob] | None, tokenizer: Tokenizer, text_offset: int = 0
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    if route == "chat":
        return chat_logprobs(logprobs, tokenizer)
    return completion_logprobs(logprobs, tokenizer, text_offset)


def completion_body(
    *,
    route: Route,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, int],
    logprobs: list[TokenLogprob] | None = None,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) ``chat.completion`` or ``text_completion`` object."""
    lp = _logprobs_field(route, logprobs, tokenizer) if tokenizer is not None else None
    if route == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp,
            "finish_reason": finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        kind = "text_completion"
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def stream_chunk(
    *,
    route: Route,
    response_id: str,
    created: int,
    model: str,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
    tokenizer: Tokenizer | None = None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """One SSE chunk. Chat: ``delta`` holds the role (first chunk) and/or content."""
    lp = _logprobs_field(route, logprobs, tokenizer, text_offset) if tokenizer is not None else None
    if route == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    *, route: Route, response_id: str, created: int, model: str, usage: dict[str, int]
) -> dict[str, Any]:
    kind = "chat.completion.chunk" if route == "chat" else "text_completion"
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class StreamWriterState:
    """Builds the SSE events of one response from engine deltas.

    Shared rules keep a generation worker's stream identical to a single
    worker's: the chat role chunk first, one chunk per delta that carries
    text (or logprobs), a final chunk with the finish reason and an empty
    delta, the usage chunk when asked, then ``[DONE]``.
    """

    def __init__(self, req: ParsedRequest, tokenizer: Tokenizer, response_id: str | None = None) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.response_id = response_id or new_response_id(req.route)
        self.created = int(time.time())
        self.text_offset = 0

    def _common(self) -> dict[str, Any]:
        return {"route": self.req.route, "response_id": self.response_id, "created": self.created,
                "model": self.req.model}  # fmt: skip

    def start(self) -> bytes:
        if self.req.route == "chat":
            return sse_event(stream_chunk(**self._common(), text="", role=True))
        return b""

    def delta(self, delta: Delta) -> bytes:
        out = b""
        want_lp = self.req.want_logprobs and bool(delta.logprobs)
        if delta.text or want_lp:
            out += sse_event(
                stream_chunk(
                    **self._common(),
                    text=delta.text,
                    logprobs=delta.logprobs if self.req.want_logprobs else None,
                    tokenizer=self.tokenizer,
                    text_offset=self.text_offset,
                )
            )
            self.text_offset += len(delta.text)
        if delta.finish_reason is not None:
            text = None if self.req.route == "chat" else ""
            out += sse_event(stream_chunk(**self._common(), text=text, finish_reason=delta.finish_reason))
        return out

    def end(self, usage: dict[str, int]) -> bytes:
        out = b""
        if self.req.include_usage:
            out += sse_event(usage_chunk(**self._common(), usage=usage))
        return out + SSE_DONE


__all__ = [
    "CONTEXT_ONLY",
    "GENERATION_ONLY",
    "SSE_DONE",
    "DisaggParams",
    "ParsedRequest",
    "StreamWriterState",
    "completion_body",
    "load_json_body",
    "new_response_id",
    "parse_request",
    "sse_event",
    "stream_chunk",
    "usage_body",
    "usage_chunk",
]
