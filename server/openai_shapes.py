"""The OpenAI response and streaming shapes, built in one place (torch-free).

A whole answer is :func:`answer_object`. A streamed response is the worker's SSE writer's
(server/worker/responses.py ``StreamWriterState``, which builds its events with these functions):
chat opens with a role chunk; each piece of text is a chunk; a chunk with the finish reason and an
empty delta (chat) or empty text (completions) closes each choice; the usage chunk follows when the
client asked for it (``stream_options.include_usage``); then ``[DONE]``. The orchestrator streams a
context leg's finished answer with :func:`answer_stream`, so both stay the same shape.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastcore import protocol as wire

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE ``data:`` event of ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk_object(chat: bool) -> str:
    """The ``object`` of a streamed chunk on the chat or completions route."""
    return wire.OBJECT_CHAT_COMPLETION_CHUNK if chat else wire.OBJECT_TEXT_COMPLETION


def answer_object(
    *,
    chat: bool,
    response_id: Any,
    created: Any,
    model: Any,
    text: str | None,
    finish_reason: str | None,
    usage: Any,
    logprobs: Any = None,
    tool_calls: list[dict[str, Any]] | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) ``chat.completion`` or ``text_completion`` with one choice.
    ``logprobs`` is already in the route's wire shape; ``tool_calls`` (chat): the calls parsed out
    of the text (``text`` is then what was outside them, None when nothing was); ``stop_reason``
    (vLLM's): the stop string or token id that ended it, a member only when there is one."""
    choice: dict[str, Any]
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if stop_reason is not None:
        choice[wire.STOP_REASON] = stop_reason
    return {
        "id": response_id,
        "object": wire.OBJECT_CHAT_COMPLETION if chat else wire.OBJECT_TEXT_COMPLETION,
        "created": created,
        "model": model,
        wire.CHOICES: [choice],
        wire.USAGE: usage,
    }


def stream_chunk(
    *,
    chat: bool,
    response_id: Any,
    created: Any,
    model: Any,
    index: int = 0,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: Any = None,
    tool_calls: list[dict[str, Any]] | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """One chunk of one choice. Chat: ``delta`` holds the role (``role``) and/or ``text`` (``None``:
    no content key, as in the closing chunk) and/or ``tool_calls`` pieces; completions: ``text``
    (``None`` is ``""``). ``logprobs`` is already in the route's wire shape."""
    choice: dict[str, Any]
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if stop_reason is not None:  # the closing chunk's, as answer_object's
        choice[wire.STOP_REASON] = stop_reason
    return {
        "id": response_id,
        "object": chunk_object(chat),
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(*, chat: bool, response_id: Any, created: Any, model: Any, usage: Any) -> dict[str, Any]:
    """The closing usage chunk (no choices)."""
    return {
        "id": response_id,
        "object": chunk_object(chat),
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def answer_stream(answer: dict[str, Any], *, chat: bool, include_usage: bool) -> bytes:
    """The SSE stream a streaming worker would have sent for the complete (parsed) ``answer``.

    Raises ``AttributeError`` / ``TypeError`` for a shape that is no OpenAI response (a choice that
    is not an object...): the caller words it.
    """
    head = {
        "chat": chat,
        "response_id": answer.get("id"),
        "created": answer.get("created", int(time.time())),
        "model": answer.get("model"),
    }
    events: list[dict[str, Any]] = []
    for choice in answer.get(wire.CHOICES, []):
        index, finish = choice.get("index", 0), choice.get(wire.FINISH_REASON)
        calls = None
        if chat:
            message = choice.get("message") or {}
            text, calls = message.get("content") or "", message.get("tool_calls")
            events.append(stream_chunk(**head, index=index, text="", role=True))
        else:
            text = choice.get("text") or ""
        if text:
            events.append(stream_chunk(**head, index=index, text=text, logprobs=choice.get("logprobs")))
        for i, call in enumerate(calls or ()):  # each call whole, in one piece
            events.append(stream_chunk(**head, index=index, tool_calls=[{"index": i, **call}]))
        events.append(
            stream_chunk(
                **head,
                index=index,
                text=None if chat else "",
                finish_reason=finish,
                stop_reason=choice.get(wire.STOP_REASON),
            )
        )
    if include_usage and answer.get(wire.USAGE) is not None:
        events.append(usage_chunk(**head, usage=answer[wire.USAGE]))
    return b"".join(sse_event(e) for e in events) + SSE_DONE
