"""OpenAI response building for workers (no torch, no engine): the answer's side of the protocol.

The builders (:func:`completion_body`, :class:`StreamWriterState`, ...) produce the
OpenAI JSON and SSE shapes. The torch worker and a synthetic engine share
them, and so can the orchestrator when it answers from a context response. A
context response's prompt ids go in as JSON members (:func:`prompt_ids_members`,
:func:`dump_with_members`). The request's side is :mod:`server.worker.request`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

import fastcore
from fastcore import protocol as wire
from server import openai_shapes

from .output import Delta, TokenLogprob
from .tokenizer import Tokenizer
from .tool_calls import ARGUMENT_FRAGMENT_CHARS, ToolCall, ToolCallStream, ToolRequest, parse_tool_calls

if TYPE_CHECKING:
    from .engine_api import EngineRequest
    from .request import ParsedRequest, Route


def prompt_ids_members(prompt_ids: np.ndarray, *, b64: bool) -> list[bytes]:
    """A context response's prompt-id members (docs/protocol.md (2)), as pieces of JSON text to append.

    The base64 form goes from the int32 array to base64 bytes
    (``fastcore.encode_tokens``) and into the body as they are: no Python
    ``str``, no pass of ``json.dumps``' escape scan over ~4/3 bytes per id
    (base64 never needs escaping), and no copy until :func:`dump_with_members`
    joins the pieces into the one body allocation. The list form is what a
    worker without the fast path sends.
    """
    if b64:
        return [_B64_MEMBERS_OPEN, fastcore.encode_tokens(prompt_ids), b'"']
    return [_LIST_MEMBER_OPEN, json.dumps(prompt_ids.tolist()).encode()]


_B64_MEMBERS_OPEN = f', "{wire.PROMPT_TOKEN_IDS}": null, "{wire.PROMPT_TOKEN_IDS_B64}": "'.encode()
_LIST_MEMBER_OPEN = f', "{wire.PROMPT_TOKEN_IDS}": '.encode()


def dump_with_members(body: dict[str, Any], members: list[bytes]) -> bytes:
    """``json.dumps(body)`` with ``members`` (JSON text starting with a comma) before its closing brace."""
    data = json.dumps(body).encode()
    return b"".join([memoryview(data)[:-1], *members, b"}"]) if members else data


# ---------------------------------------------------------------- responses

#: the finish_reason of an answer whose text held tool calls (OpenAI's)
TOOL_CALLS = "tool_calls"


def new_response_id(route: Route) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex


#: fastcore's extension of ``usage.prompt_tokens_details``: of ``cached_tokens``, those loaded
#: from the worker's second KV tier (docs/protocol.md)
TIER2_CACHED_TOKENS = "tier2_cached_tokens"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        wire.PROMPT_TOKENS: prompt_tokens,
        wire.COMPLETION_TOKENS: completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # OpenAI's field (trtllm-serve's UsageInfo has it too): prompt tokens served from the prefix cache
        wire.PROMPT_TOKENS_DETAILS: {wire.CACHED_TOKENS: cached_tokens},
    }


def request_usage(req: ParsedRequest, completion_tokens: int, engine_req: EngineRequest) -> dict[str, Any]:
    """A request's ``usage``; ``cached_tokens``: the prompt tokens this worker's prefix cache served
    (``engine_req.cached_prefix``).

    A generation leg that imported its context worker's KV reports that worker's count instead,
    from the context leg's usage the orchestrator relays (``disaggregated_params.ctx_usage``), as
    trtllm-serve's generation workers do: the context worker prefilled the client's prompt. One
    that recomputed the prefill (the KV unreachable or not the prompt's) reports its own. A
    ``cached_tokens`` there that is not a non-negative integer is ignored."""
    cached = engine_req.cached_prefix
    if engine_req.kv_imported and req.disagg is not None:
        ctx_usage = req.disagg.raw.get(wire.CTX_USAGE)
        details = ctx_usage.get(wire.PROMPT_TOKENS_DETAILS) if isinstance(ctx_usage, dict) else None
        value = details.get(wire.CACHED_TOKENS) if isinstance(details, dict) else None
        if type(value) is int and value >= 0:
            cached = value
    prompt_tokens = int(req.prompt_ids.size)
    usage = usage_body(prompt_tokens, completion_tokens, min(cached, prompt_tokens))
    if engine_req.tier2_prefix and not engine_req.kv_imported:  # ours: of cached_tokens, tier 2's
        usage[wire.PROMPT_TOKENS_DETAILS][TIER2_CACHED_TOKENS] = min(engine_req.tier2_prefix, prompt_tokens)
    return usage


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
    usage: dict[str, Any],
    logprobs: list[TokenLogprob] | None = None,
    tokenizer: Tokenizer | None = None,
    tools: ToolRequest | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) ``chat.completion`` or ``text_completion`` object; the tool calls
    in ``text`` parsed out when ``tools`` asks for it (``finish_reason`` then ``tool_calls``, and
    no ``stop_reason``: the calls ended the turn)."""
    lp = _logprobs_field(route, logprobs, tokenizer) if tokenizer is not None else None
    content: str | None = text
    calls = None
    if tools is not None and tools.parsing:
        content, found = parse_tool_calls(tools.stream(), text)
        if found:
            calls, finish_reason, stop_reason = [call.wire() for call in found], TOOL_CALLS, None
    return openai_shapes.answer_object(
        chat=route == "chat",
        response_id=response_id,
        created=created,
        model=model,
        text=content,
        finish_reason=finish_reason,
        usage=usage,
        logprobs=lp,
        tool_calls=calls,
        stop_reason=stop_reason,
    )


sse_event = openai_shapes.sse_event
SSE_DONE = openai_shapes.SSE_DONE


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
        #: what every chunk of it says (openai_shapes' terms)
        self.head: dict[str, Any] = {
            "chat": req.route == "chat",
            "response_id": self.response_id,
            "created": self.created,
            "model": req.model,
        }
        self.text_offset = 0
        tools = req.tools
        #: the tool-call parser the text goes through (chat with tools and a parser), else None
        self.tool_stream = tools.stream() if tools is not None and tools.parsing else None
        #: a plain text delta's event around its JSON-encoded text (:meth:`delta`'s usual chunk)
        self._text_event: tuple[bytes, bytes] | None = None
        if self.tool_stream is None and not req.want_logprobs:
            # The chunk _chunk makes of a marker text, cut around the marker's JSON string; a head
            # holding that string too (a model named so) leaves the template unused.
            marker = "\x00\x01"
            event = self._chunk(text=marker)
            before, found, after = event.partition(json.dumps(marker).encode())
            if found and found not in after:
                self._text_event = (before, after)

    def _chunk(self, logprobs: list[TokenLogprob] | None = None, **fields: Any) -> bytes:
        """One SSE chunk of this response (:func:`server.openai_shapes.stream_chunk`); ``logprobs``:
        the engine's, put in the route's wire shape (their text offsets after the text sent)."""
        lp = _logprobs_field(self.req.route, logprobs, self.tokenizer, self.text_offset)
        return sse_event(openai_shapes.stream_chunk(**self.head, logprobs=lp, **fields))

    def start(self) -> bytes:
        if self.req.route == "chat":
            # With tools, no content until there is some, as OpenAI streams a call: an SDK's assembly
            # of an answer that is only calls then has the unary answer's content, null, not ""
            text = None if self.tool_stream is not None else ""
            return self._chunk(text=text, role=True)
        return b""

    def delta(self, delta: Delta) -> bytes:
        text_event = self._text_event
        if text_event is not None and delta.finish_reason is None and delta.text:
            # A decode step's usual delta: _chunk's bytes (json.dumps of a str alone escapes it as
            # it does inside the chunk) without building and encoding the chunk's dicts, ~5 us
            self.text_offset += len(delta.text)
            return text_event[0] + json.dumps(delta.text).encode() + text_event[1]
        if self.tool_stream is not None:
            return self._tool_delta(delta, self.tool_stream)
        out = b""
        want_lp = self.req.want_logprobs and bool(delta.logprobs)
        if delta.text or want_lp:
            out += self._chunk(delta.logprobs if self.req.want_logprobs else None, text=delta.text)
            self.text_offset += len(delta.text)
        if delta.finish_reason is not None:
            text = None if self.req.route == "chat" else ""
            out += self._chunk(text=text, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        return out

    def _tool_delta(self, delta: Delta, stream: ToolCallStream) -> bytes:
        """A delta through the tool-call parser: the content it releases (with the delta's
        logprobs), each call it completes as the OpenAI SDK assembles one (index, id, type and
        name first, then the arguments in fragments), and the finish (``tool_calls`` when any)."""
        events = stream.feed(delta.text) if delta.text else []
        if delta.finish_reason is not None:
            events += stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        out = b""
        if content or (self.req.want_logprobs and delta.logprobs):
            out += self._chunk(delta.logprobs if self.req.want_logprobs else None, text=content)
            self.text_offset += len(content)
        index = stream.calls - sum(isinstance(e, ToolCall) for e in events)  # the first new call's
        for event in events:
            if isinstance(event, ToolCall):
                out += self._tool_call_events(event, index)
                index += 1
        if delta.finish_reason is not None:
            finish, stop = (TOOL_CALLS, None) if stream.calls else (delta.finish_reason, delta.stop_reason)
            out += self._chunk(text=None, finish_reason=finish, stop_reason=stop)
        return out

    def _tool_call_events(self, call: ToolCall, index: int) -> bytes:
        head = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        out = self._chunk(tool_calls=[head])
        args = call.arguments
        for start in range(0, len(args), ARGUMENT_FRAGMENT_CHARS):
            piece = {"index": index, "function": {"arguments": args[start : start + ARGUMENT_FRAGMENT_CHARS]}}
            out += self._chunk(tool_calls=[piece])
        return out

    def end(self, usage: dict[str, Any]) -> bytes:
        out = b""
        if self.req.include_usage:
            out += sse_event(openai_shapes.usage_chunk(**self.head, usage=usage))
        return out + SSE_DONE


__all__ = [
    "SSE_DONE",
    "StreamWriterState",
    "completion_body",
    "dump_with_members",
    "new_response_id",
    "prompt_ids_members",
    "request_usage",
    "sse_event",
    "usage_body",
]
