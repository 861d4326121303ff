"""Anthropic's Messages API (``POST /v1/messages``) as chat completions (docs/api-anthropic.md).

The request is read and checked once (every refusal a 400 naming the field: ``messages[1].content[0]``)
and said as one chat completions body: ``system`` as the first system message, ``tool_use`` blocks
as the assistant's ``tool_calls`` (``input`` as its JSON arguments), ``tool_result`` blocks as
``tool`` messages (before the user's text, where chat templates expect them), ``tools`` as
functions, ``tool_choice`` and the sampling fields as chat's. The answer comes back as a message
(``text`` and ``tool_use`` blocks, ``stop_reason``, ``usage``) or, streamed, as Anthropic's event
sequence, translated chunk by chunk as the chat SSE arrives.

Usage: ``input_tokens`` are the prompt tokens our prefix cache did not serve and
``cache_read_input_tokens`` those it did (Anthropic counts them apart; their sum is the prompt).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Awaitable
from typing import Any

import msgspec

import fastcore
from fastcore import protocol as wire
from server.errors import HTTPError, check_not_empty, normalise_error_body
from server.http import Request
from server.surrogates import check_no_lone_surrogates

_SSE_DONE = b"[DONE]"
#: Anthropic's error types by status (its SDK's exceptions are chosen by status; the type says why)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STOP_REASONS: dict[Any, str] = {
    wire.FINISH_STOP: "end_turn",
    wire.FINISH_LENGTH: "max_tokens",
    wire.FINISH_TOOL_CALLS: "tool_use",
}
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}\Z")
#: top-level fields refused: features served on Anthropic's side (a container, MCP servers) that a
#: translation to chat cannot give; other fields this module does not read (``cache_control``,
#: ``service_tier``, ``speed``, ``inference_geo``, ...) change nothing a model here does and are ignored,
#: as the API's new ones keep coming (the SDK sends them)
_REFUSED_FIELDS = {
    "container": "containers (code execution) are not served here",
    "mcp_servers": "MCP servers are not served here: give their tools as client tools",
}
_BLOCK_EXTRAS = frozenset({"cache_control", "citations"})


def bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, param=param)


def _json_body(raw: bytes) -> dict[str, Any]:
    """The body as an object: fastcore's JSON policy (depth, numbers, grammar) first, by one scan,
    so that nothing deeper than it reaches a decoder; lone surrogates refused by name.

    msgspec decodes it (2-3x ``json.loads``' speed on a long history: most of what translating a
    body cost) and refuses a lone surrogate, a number past a float and the like: such a body is read
    again by ``json``, whose reading (and check_no_lone_surrogates' field) the client is told."""
    check_not_empty(raw)
    try:
        fastcore.find_spans(raw, (), validate=True)
    except fastcore.JSONSpanError as exc:
        raise bad(f"the request body is not valid JSON: {exc}", "body") from None
    try:
        body = _DECODE(raw)
    except msgspec.DecodeError:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}", "body") from None
        if isinstance(body, dict):
            check_no_lone_surrogates(raw, body)
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", "body")
    return body


_DECODE = msgspec.json.Decoder().decode


#: a text of the client's body: its path there (for the scanner) and its value
Piece = tuple[tuple[Any, ...], str]
#: what stands for a text in the chat body until its bytes are spliced in (a nonce: no client's string
#: can be taken for one); json.dumps writes its \x01 as \u0001
_MARK = "\x01" + secrets.token_hex(8) + ":"
_MARK_BYTES = b'"\\u0001' + _MARK[1:].encode()


class Texts:
    """The chat body's texts as the client's own bytes: the history is most of a body, and its strings
    copied as they are (valid JSON strings already: the scanner checked them) cost a slice, where
    encoding them again would cost most of the translation. The body is written with a marker per
    text (:meth:`mark`), then each marker is replaced by its texts' bytes (:meth:`splice`)."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[list[Piece]] = []

    def mark(self, pieces: list[Piece]) -> str:
        """A string for the chat body that becomes ``pieces`` joined by newlines."""
        self.groups.append(pieces)
        return f"{_MARK}{len(self.groups) - 1}"

    def splice(self, raw: bytes, skeleton: bytes) -> bytes:
        if not self.groups:
            return skeleton
        paths = tuple(path for group in self.groups for path, _value in group)
        try:
            spans = iter(fastcore.find_spans(raw, paths, validate=False))
        except fastcore.JSONSpanError as exc:  # a key repeated where a text is (json.loads kept the last)
            raise bad(f"the request body is not valid: {exc}", "body") from None
        strings = []
        for group in self.groups:
            inner = []
            for _path, value in group:
                span = next(spans)
                if span is not None and raw[span[0] : span[0] + 1] == b'"':
                    inner.append(raw[span[0] + 1 : span[1] - 1])
                else:  # a default (a tool_result without content): not in the client's bytes
                    inner.append(json.dumps(value, ensure_ascii=False).encode()[1:-1])
            strings.append(b'"' + b"\\n".join(inner) + b'"')
        parts = skeleton.split(_MARK_BYTES)
        out = [parts[0]]
        for part in parts[1:]:
            number, _quote, rest = part.partition(b'"')
            out += (strings[int(number)], rest)
        return b"".join(out)


def _text_of(blocks: Any, param: str, path: tuple[Any, ...]) -> list[Piece]:
    """A string, or a list of text blocks (``system``, a ``tool_result``'s content): its pieces."""
    if isinstance(blocks, str):
        return [(path, blocks)]
    if not isinstance(blocks, list):
        raise bad(f"'{param}' must be a string or a list of text blocks", param)
    texts = []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        kind = _block_type(block, where)
        if kind != "text":
            raise _unsupported(kind, where, "here only text blocks are")
        texts.append(_text(block, where, (*path, i)))
    return texts


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise bad(f"'{where}' must be a content block (an object)", where)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad(f"'{where}.type' must be a string", f"{where}.type")
    return kind


def _unsupported(kind: str, where: str, why: str) -> HTTPError:
    if kind in ("image", "document"):
        return bad(f"'{where}' is an {kind} block: this deployment serves text models ({why})", where)
    return bad(f"'{where}.type' is '{kind}': not a block type served here ({why})", f"{where}.type")


def _text(block: dict[str, Any], where: str, path: tuple[Any, ...]) -> Piece:
    _only(block, {"type", "text"}, where)
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"'{where}.text' must be a string", f"{where}.text")
    return (*path, "text"), text


def _only(block: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in block:
        if key not in allowed and key not in _BLOCK_EXTRAS:
            raise bad(f"'{where}.{key}' is not a field of a '{block.get('type')}' block", f"{where}.{key}")


def _user_turn(
    content: Any, where: str, path: tuple[Any, ...], open_calls: set[str], marks: Texts
) -> list[dict[str, Any]]:
    """A user message's chat messages: its tool results (each a ``tool`` message, answering a call of
    the assistant turn before it), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": marks.mark([(path, content)])}]
    if not isinstance(content, list) or not content:
        raise bad(f"'{where}' must be a string or a non-empty list of content blocks", where)
    results, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at, (*path, j)))
        elif kind == "tool_result":
            _only(block, {"type", "tool_use_id", "content", "is_error"}, at)
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in open_calls:
                raise bad(
                    f"'{at}.tool_use_id' names no tool_use block of the assistant turn before it",
                    f"{at}.tool_use_id",
                )
            if not isinstance(block.get("is_error", False), bool):
                raise bad(f"'{at}.is_error' must be a boolean", f"{at}.is_error")
            text = _text_of(block.get("content", ""), f"{at}.content", (*path, j, "content"))
            results.append({"role": "tool", "tool_call_id": call_id, "content": marks.mark(text)})
        else:
            raise _unsupported(kind, at, "a user turn holds text and tool_result blocks")
    if texts:
        results.append({"role": "user", "content": marks.mark(texts)})
    return results


def _assistant_turn(
    content: Any, where: str, path: tuple[Any, ...], marks: Texts
) -> tuple[dict[str, Any], set[str]]:
    """An assistant message as chat's, and the ids of its tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": marks.mark([(path, content)])}, set()
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of content blocks", where)
    texts: list[Piece] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at, (*path, j)))
        elif kind == "tool_use":
            _only(block, {"type", "id", "name", "input"}, at)
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"'{at}.id' must be a non-empty string", f"{at}.id")
            if not isinstance(name, str) or not name:
                raise bad(f"'{at}.name' must be a non-empty string", f"{at}.name")
            if not isinstance(arguments, dict):
                raise bad(f"'{at}.input' must be an object", f"{at}.input")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # never ours (no answer here thinks): dropped, as the API drops past turns' thinking
        else:
            raise _unsupported(kind, at, "an assistant turn holds text and tool_use blocks")
    message: dict[str, Any] = {"role": "assistant", "content": marks.mark(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message, {c["id"] for c in calls}


def _messages(body: dict[str, Any], marks: Texts) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": marks.mark(_text_of(system, "system", ("system",)))})
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"'{where}' must be an object", where)
        for key in message:
            if key not in ("role", "content"):
                raise bad(f"'{where}.{key}' is not a field of a message", f"{where}.{key}")
        role, content = message.get("role"), message.get("content")
        if role == "user":
            chat += _user_turn(content, f"{where}.content", ("messages", i, "content"), open_calls, marks)
            open_calls = set()
        elif role == "assistant":
            turn, open_calls = _assistant_turn(content, f"{where}.content", ("messages", i, "content"), marks)
            chat.append(turn)
        else:
            raise bad(f"'{where}.role' must be 'user' or 'assistant'", f"{where}.role")
    return chat


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list", "tools")
        functions = []
        for i, tool in enumerate(tools):
            at = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise bad(f"'{at}' must be an object", at)
            kind = tool.get("type", "custom")
            if kind != "custom":
                raise bad(
                    f"'{at}.type' is '{kind}': only client tools (input_schema) are supported, "
                    "no server tools",
                    f"{at}.type",
                )
            for key in tool:
                if key not in ("type", "name", "description", "input_schema", "cache_control"):
                    raise bad(f"'{at}.{key}' is not a field of a tool", f"{at}.{key}")
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise bad(f"'{at}.name' must be 1-128 characters of a-z, A-Z, 0-9, _ and -", f"{at}.name")
            if not isinstance(schema, dict):
                raise bad(f"'{at}.input_schema' must be an object (a JSON schema)", f"{at}.input_schema")
            function: dict[str, Any] = {"name": name, "parameters": schema}
            if "description" in tool:
                if not isinstance(tool["description"], str):
                    raise bad(f"'{at}.description' must be a string", f"{at}.description")
                function["description"] = tool["description"]
            names.add(name)
            functions.append({"type": "function", "function": function})
        if functions:
            chat["tools"] = functions
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("'tool_choice.type' must be one of auto, any, tool, none", "tool_choice.type")
    kind = choice["type"]
    for key in choice:
        if key not in ("type", "name", "disable_parallel_tool_use"):
            raise bad(f"'tool_choice.{key}' is not a field of tool_choice", f"tool_choice.{key}")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise bad(
            "'tool_choice.disable_parallel_tool_use' must be a boolean",
            "tool_choice.disable_parallel_tool_use",
        )
    if kind == "none":
        if "tools" in chat:
            chat["tool_choice"] = "none"
        return
    if not names:
        raise bad(f"'tool_choice' is '{kind}' but no tools are given", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise bad("'tool_choice.name' must name one of the tools", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = "auto" if kind == "auto" else "required"
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _number(body: dict[str, Any], name: str, low: float, high: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < low
        or (high is not None and value > high)
    ):
        span = f"from {low:g} to {high:g}" if high is not None else f"at least {low:g}"
        raise bad(f"'{name}' must be a number {span}", name)
    return value


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad("'max_tokens' is required", "max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("'max_tokens' must be an integer of at least 1", "max_tokens")
    chat["max_tokens"] = max_tokens
    for name, high in (("temperature", 1.0), ("top_p", 1.0)):
        value = _number(body, name, 0.0, high)
        if value is not None:
            chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise bad("'top_k' must be a non-negative integer", "top_k")
        chat["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
        if stops:
            chat["stop"] = stops


def _check_others(body: dict[str, Any]) -> None:
    for key, why in _REFUSED_FIELDS.items():
        if body.get(key) is not None:
            raise bad(f"'{key}': {why}", key)
    output = body.get("output_config")
    if output is not None and (not isinstance(output, dict) or output.get("format") is not None):
        raise bad("'output_config.format': structured outputs are not served here", "output_config.format")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' must be a non-empty string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or any(k != "user_id" for k in metadata):
            raise bad("'metadata' must be an object with at most 'user_id'", "metadata")
        if not isinstance(metadata.get("user_id", ""), (str, type(None))):
            raise bad("'metadata.user_id' must be a string", "metadata.user_id")
    thinking = body.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive")
    ):
        raise bad("'thinking.type' must be 'enabled', 'disabled' or 'adaptive'", "thinking.type")


class Messages:
    """One ``/v1/messages`` request: its chat body, and what its answer's translation needs."""

    __slots__ = ("body", "stops", "streamed")

    def __init__(self, body: bytes, stops: list[str], streamed: bool) -> None:
        self.body = body
        self.stops = stops
        self.streamed = streamed

    def answer(self, chat: bytes) -> bytes:
        try:
            answer = json.loads(chat)
            choice = answer[wire.CHOICES][0]
            message = choice["message"]
            content: list[dict[str, Any]] = []
            if message.get("content"):
                content.append({"type": "text", "text": message["content"]})
            for call in message.get("tool_calls") or ():
                arguments = json.loads(call["function"]["arguments"] or "{}")
                if not isinstance(arguments, dict):
                    raise ValueError("a tool call's arguments are not a JSON object")
                content.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": arguments,
                    }
                )
            reason, sequence = self.stop_reason(choice)
            out = message_head(answer.get("id"), answer.get("model"))
            out.update(
                content=content,
                stop_reason=reason,
                stop_sequence=sequence,
                usage=usage_of(answer.get(wire.USAGE)),
            )
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a chat completion ({type(exc).__name__}: {exc})") from None
        return json.dumps(out, ensure_ascii=False).encode()

    def stop_reason(self, choice: dict[str, Any]) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence of a chat choice: a stop string is known only where
        the worker names it (vLLM's ``stop_reason``)."""
        finish = choice.get(wire.FINISH_REASON)
        matched = choice.get(wire.STOP_REASON)
        if finish == wire.FINISH_STOP and isinstance(matched, str) and matched in self.stops:
            return "stop_sequence", matched
        return _STOP_REASONS.get(finish, "end_turn"), None

    def stream(self) -> MessageStream:
        return MessageStream(self)


def message_head(chat_id: Any, model: Any) -> dict[str, Any]:
    ident = chat_id if isinstance(chat_id, str) else ""
    ident = ident.removeprefix("chatcmpl-")
    return {"id": "msg_" + ident, "type": "message", "role": "assistant", "model": model}


def usage_of(usage: Any) -> dict[str, int]:
    """Anthropic's usage of a chat usage: the prompt's uncached tokens as ``input_tokens``, its cached
    ones as ``cache_read_input_tokens``."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get(wire.PROMPT_TOKENS_DETAILS)
    cached = details.get(wire.CACHED_TOKENS) or 0 if isinstance(details, dict) else 0
    cached = min(cached, prompt) if isinstance(cached, int) and isinstance(prompt, int) else 0
    return {
        "input_tokens": prompt - cached,
        "output_tokens": usage.get("completion_tokens") or 0,
        "cache_read_input_tokens": cached,
    }


def event(kind: str, payload: dict[str, Any]) -> bytes:
    payload = {"type": kind, **payload}
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(payload, ensure_ascii=False).encode())


class MessageStream:
    """Chat SSE in, Anthropic's events out (see the module): fed bytes as they arrive, cut anywhere."""

    __slots__ = ("block", "buffer", "call", "data", "ended", "finish", "started", "tool_blocks", "usage")

    def __init__(self, call: Messages) -> None:
        self.call = call
        self.buffer = b""
        self.data: list[bytes] = []
        self.started = False
        self.ended = False
        #: the open content block's index and kind ("text", or a chat tool call's index); -1: none open
        self.block: tuple[int, Any] = (-1, None)
        self.tool_blocks = 0
        self.finish: dict[str, Any] = {}
        self.usage: Any = None

    def feed(self, data: bytes) -> bytes:
        if self.ended:
            return b""
        out: list[bytes] = []
        buffer = self.buffer + data
        lines = buffer.split(b"\n")
        self.buffer = lines.pop()
        for line in lines:
            line = line.rstrip(b"\r")
            if line:
                if line.startswith(b"data:"):
                    self.data.append(line[5:].strip())
                continue
            if self.data:  # a blank line ends an event
                payload, self.data = b"\n".join(self.data), []
                self.event(payload, out)
                if self.ended:
                    break
        return b"".join(out)

    def flush(self) -> bytes:
        if self.ended:
            return b""
        out: list[bytes] = []
        if self.data:
            self.event(b"\n".join(self.data), out)
        if not self.ended:
            if self.started:
                self.close(out)
            else:
                out.append(error_event(502, "the worker's stream ended before its answer began"))
                self.ended = True
        return b"".join(out)

    def event(self, payload: bytes, out: list[bytes]) -> None:
        if payload == _SSE_DONE:
            self.close(out)
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            out.append(error_event(502, "the worker's stream sent an event that is not JSON"))
            self.ended = True
            return
        error = chunk.get("error")
        if error is not None:  # the chat path's in-band error (a worker failed mid-stream)
            message = error.get("message") if isinstance(error, dict) else None
            out.append(error_event(502, message if isinstance(message, str) else str(error)))
            self.ended = True
            return
        if not self.started:
            self.started = True
            head = message_head(chunk.get("id"), chunk.get("model"))
            head.update(
                content=[],
                stop_reason=None,
                stop_sequence=None,
                usage={"input_tokens": 0, "output_tokens": 0},
            )
            out.append(event("message_start", {"message": head}))
            out.append(event("ping", {}))
        if chunk.get(wire.USAGE) is not None:
            self.usage = chunk[wire.USAGE]
        for choice in chunk.get(wire.CHOICES) or ():
            if isinstance(choice, dict):
                self.choice(choice, out)

    def choice(self, choice: dict[str, Any], out: list[bytes]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self.block[1] != "text":
                    self.open(out, "text", {"type": "text", "text": ""})
                out.append(
                    event(
                        "content_block_delta",
                        {"index": self.block[0], "delta": {"type": "text_delta", "text": text}},
                    )
                )
            for piece in delta.get("tool_calls") or ():
                self.tool_piece(piece, out)
        if choice.get(wire.FINISH_REASON) is not None:
            self.finish = choice

    def tool_piece(self, piece: Any, out: list[bytes]) -> None:
        if not isinstance(piece, dict):
            return
        function = piece.get("function") or {}
        index = piece.get("index", 0)
        if self.block[1] != ("call", index):
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": piece.get("id") or "",
                "name": function.get("name") or "",
                "input": {},
            }
            self.open(out, ("call", index), block)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out.append(
                event(
                    "content_block_delta",
                    {
                        "index": self.block[0],
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    },
                )
            )

    def open(self, out: list[bytes], kind: Any, block: dict[str, Any]) -> None:
        index = self.block[0]
        if self.block[1] is not None:
            out.append(event("content_block_stop", {"index": index}))
        self.block = (index + 1, kind)
        out.append(event("content_block_start", {"index": index + 1, "content_block": block}))

    def close(self, out: list[bytes]) -> None:
        if not self.started:
            out.append(error_event(502, "the worker's stream ended before its answer began"))
            self.ended = True
            return
        if self.block[1] is not None:
            out.append(event("content_block_stop", {"index": self.block[0]}))
        reason, sequence = self.call.stop_reason(self.finish)
        out.append(
            event(
                "message_delta",
                {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage_of(self.usage)},
            )
        )
        out.append(event("message_stop", {}))
        self.ended = True


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """Anthropic's error object for one of our errors (``param``, ``code``: not in its shape; the
    message names the field)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return json.dumps(
        {"type": "error", "error": {"type": kind, "message": message}}, ensure_ascii=False
    ).encode()


def error_event(status: int, message: str) -> bytes:
    return b"event: error\ndata: %s\n\n" % error_body(status, message)


COUNT_TOKENS_PATH = b"/v1/messages/count_tokens"


def chat_body(body: bytes, *, counting: bool) -> tuple[bytes, dict[str, Any]]:
    """The Messages body said as a chat completions body (bytes) and its skeleton (the texts left
    out); ``counting`` (count_tokens): no ``max_tokens`` nor sampling fields read."""
    data = _json_body(body)
    _check_others(data)
    marks = Texts()
    chat: dict[str, Any] = {"model": data["model"], "messages": _messages(data, marks)}
    if not counting:
        _sampling(data, chat)
    _tools(data, chat)
    if data.get("stream", False) and not counting:
        chat["stream"] = True
        chat["stream_options"] = {wire.INCLUDE_USAGE: True}
    skeleton = json.dumps(chat, ensure_ascii=False, separators=(",", ":")).encode()
    return marks.splice(body, skeleton), chat


async def count_tokens(body: bytes, ask: Any) -> tuple[int, bytes]:
    """``POST /v1/messages/count_tokens``: the body translated as a message's would be, its prompt
    counted by a worker's ``/tokenize`` (vLLM's endpoint; ours, docs/protocol.md): the prompt a
    message of the same body is given, ``input_tokens`` plus ``cache_read_input_tokens`` of its
    usage. A worker's refusal is the client's in this API's shape; a worker that cannot count
    (no such endpoint: a 404) says so; an answer that is no count is a 502."""
    chat, _ = chat_body(body, counting=True)
    status, answer = await ask(wire.TOKENIZE_PATH.encode(), chat)
    if status != 200:
        message, param, code = _worker_error(status, answer)
        if status == 404:
            message = f"count_tokens asks a worker's POST {wire.TOKENIZE_PATH}, which answered 404: {message}"
        raise HTTPError(status if status < 500 else 502, message, param=param, code=code)
    try:
        count = json.loads(answer).get(wire.TOKENIZE_COUNT)
    except (ValueError, AttributeError, RecursionError):
        count = None
    if type(count) is not int or count < 0:
        raise HTTPError(
            502,
            f"the worker's {wire.TOKENIZE_PATH} answer holds no count: {answer[:200]!r}",
            code="bad_worker_answer",
        )
    return 200, json.dumps({"input_tokens": count}).encode()


def _worker_error(status: int, body: bytes) -> tuple[str, str | None, str | None]:
    """A worker's error, whatever its shape (ours, trtllm-serve's, a framework's): message, param, code."""
    error = json.loads(normalise_error_body(status, body))["error"]
    return error["message"], error["param"], error["code"]


class AnthropicMessages:
    """The API object apis/ registers (its contract: apis/__init__.py)."""

    name = "anthropic-messages"
    paths: tuple[bytes, ...] = (b"/v1/messages",)
    #: the API's other routes (count_tokens, batches): answered in its shape, saying why not served
    prefixes = (b"/v1/messages/",)

    @staticmethod
    def serve_other(request: Request, tenant: str, ask: Any) -> Awaitable[tuple[int, bytes]]:
        path = request.path
        if path != COUNT_TOKENS_PATH:
            why = "of Anthropic's API, POST /v1/messages and /v1/messages/count_tokens are served"
            raise HTTPError(404, f"{path.decode('utf-8', 'replace')[:100]} is not served here: {why}")
        if request.method != b"POST":
            raise HTTPError(405, "/v1/messages/count_tokens takes POST", headers={"Allow": "POST"})
        return count_tokens(request.body, ask)

    @staticmethod
    def credentials(request: Request) -> bytes | None:
        key = request.header(b"x-api-key")
        if key is not None:
            return b"Bearer " + key
        return request.header(b"authorization")

    @staticmethod
    def to_chat(body: bytes, request: Request, tenant: str = "") -> Messages:
        encoded, chat = chat_body(body, counting=False)
        return Messages(encoded, chat.get("stop", []), chat.get("stream", False))

    @staticmethod
    def error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
        return error_body(status, message, param, code)


API = AnthropicMessages()

__all__ = ["API", "AnthropicMessages", "MessageStream", "Messages", "error_body"]
