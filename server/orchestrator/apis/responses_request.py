"""A Responses API request (``POST /v1/responses``) read: the client's body checked and the chat leg's
body built from it once (:func:`read_request`; :func:`with_history` puts a stored conversation before it).

Every malformed body is a 400 in OpenAI's error shape naming the field (``param``), never a 500; a
top-level member not read here is refused by name, as OpenAI does. The answer and the stream's
translation back are :mod:`.responses`'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from server.errors import HTTPError
from server.surrogates import check_no_lone_surrogates

#: top-level members read as documented; anything else is refused by name, as OpenAI does
_SUPPORTED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "user",
        "text",
        "truncation",
        "include",
        "reasoning",
        "safety_identifier",
        "prompt_cache_key",
        "service_tier",
        "stream_options",
        "background",
        "top_logprobs",
    }
)
_ROLES = ("user", "assistant", "system", "developer")
_TOOL_CHOICES = ("none", "auto", "required")
#: OpenAI's rule for a function's name (the workers' too: server/worker/tool_calls.py)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, param=param, code="invalid_request_error")


@dataclass
class ResponsesRequest:
    """A checked Responses request: the chat leg's body and what the answer echoes."""

    chat: dict[str, Any]
    stream: bool
    store: bool | None  # None: the client left it out
    previous_response_id: str | None
    #: the conversation this request adds (chat messages, instructions left out): what a stored
    #: response keeps, so that a later ``previous_response_id`` goes on from it
    turn: list[dict[str, Any]] = field(default_factory=list)
    echo: dict[str, Any] = field(default_factory=dict)
    #: function_call_output call ids not called in ``turn`` -> where the input names them
    unresolved: dict[str, str] = field(default_factory=dict)
    #: the client's ``input`` as sent (checked): a stored response's input items (:func:`.responses.input_items`)
    given: Any = None


def _string(body: dict[str, Any], key: str, param: str, *, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise bad(f"Missing required parameter: '{param}'.", param)
        return None
    if not isinstance(value, str):
        raise bad(f"Invalid type for '{param}': expected a string.", param)
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad(f"'{key}' must be a number from {low:g} to {high:g}.", key)
    return value


def _bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(f"Invalid type for '{key}': expected a boolean.", key)
    return value


def _text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or text parts (``input_text``; ``output_text`` and ``refusal``
    where an earlier answer's message is fed back) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"Invalid type for '{param}': expected a string or an array of content parts.", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad(f"Invalid type for '{where}': expected an object.", where)
        kind = part.get("type")
        if kind not in kinds:
            # images, files and audio need a multimodal worker; none of ours is
            raise bad(f"'{where}.type' must be one of {', '.join(kinds)} (got {kind!r}).", f"{where}.type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad(f"Invalid type for '{where}.text': expected a string.", f"{where}.text")
        texts.append(text)
    return "".join(texts)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad(f"'{param}.role' must be one of {', '.join(_ROLES)}.", f"{param}.role")
    kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    return {"role": role, "content": _text_of(item.get("content"), f"{param}.content", kinds)}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise bad(f"'{param}.{key}' must be a non-empty string.", f"{param}.{key}")
    try:  # a worker renders the arguments as the object they encode: refused here by our name
        json.loads(item["arguments"])
    except (ValueError, RecursionError):
        where = f"{param}.arguments"
        raise bad(f"'{where}' must be a JSON text (the call's arguments).", where) from None
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _tool_result(
    item: dict[str, Any], param: str, calls: set[str], unresolved: dict[str, str]
) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"'{param}.call_id' must be a non-empty string.", f"{param}.call_id")
    if call_id not in calls:
        unresolved[call_id] = f"{param}.call_id"  # a previous response's call, or none: with_history says
    output = _text_of(item.get("output"), f"{param}.output", ("input_text",))
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def chat_messages(items: Any, unresolved: dict[str, str]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; consecutive ``function_call`` items
    join the assistant message before them (chat carries a turn's calls in one message). A result
    whose call is not in ``items`` goes in ``unresolved`` (its call id -> its param): it must name
    a call of the previous response's conversation."""
    calls: set[str] = set()
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad("Invalid type for 'input': expected a string or an array of items.", "input")
    if not items:  # a chat completion of no messages is the worker's 400, naming a field never sent
        raise bad("'input' must hold at least one item.", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"Invalid type for '{param}': expected an object.", param)
        kind = item.get("type", "message")  # EasyInputMessage leaves the type out
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            call = _function_call(item, param)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_tool_result(item, param, calls, unresolved))
        else:
            raise bad(
                f"'{param}.type' must be one of message, function_call, function_call_output (got {kind!r}).",
                f"{param}.type",
            )
    return messages


def _tools(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Responses' flat function tools as chat's nested ones, and the tools as the answer echoes them."""
    if not isinstance(value, list):
        raise bad("Invalid type for 'tools': expected an array.", "tools")
    chat, echo = [], []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"Invalid type for '{param}': expected an object.", param)
        if tool.get("type") != "function":
            # hosted tools (web search, file search, computer use...) run at OpenAI, not in a model
            raise bad(
                f"'{param}.type' must be 'function': hosted tools are not served here.", f"{param}.type"
            )
        if not isinstance(tool.get("name"), str) or not _FUNCTION_NAME.fullmatch(tool["name"]):
            raise bad(f"'{param}.name' must be 1 to 64 letters, digits, '_' or '-'.", f"{param}.name")
        function: dict[str, Any] = {"name": tool["name"]}
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if tool.get(key) is not None:
                if not isinstance(tool[key], kind) or (kind is not bool and isinstance(tool[key], bool)):
                    raise bad(f"Invalid type for '{param}.{key}'.", f"{param}.{key}")
                function[key] = tool[key]
        chat.append({"type": "function", "function": function})
        echo.append(
            {
                "type": "function",
                "description": None,
                "parameters": None,
                "strict": None,
                **{k: v for k, v in tool.items() if k != "type"},
                "name": tool["name"],
            }
        )
    return chat, echo


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> Any:
    if not tools:  # none or auto of no tools asks nothing (the workers refuse any choice without tools)
        if value in ("none", "auto"):
            return None
        raise bad("'tool_choice' other than none or auto needs 'tools'.", "tool_choice")
    if value in _TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        if value.get("name") not in {t["function"]["name"] for t in tools}:
            raise bad("'tool_choice.name' must name a function of 'tools'.", "tool_choice.name")
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad(
        "'tool_choice' must be one of none, auto, required or {'type': 'function', 'name': ...}.",
        "tool_choice",
    )


def _refuse_unserved(body: dict[str, Any]) -> None:
    """Members we read only to refuse what they ask for, each naming why."""
    for key in body:
        if key not in _SUPPORTED:
            raise bad(f"Unknown parameter: '{key}'.", key)
    if body.get("background"):
        raise bad("'background' responses are not served: stream or wait for the answer.", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise bad(
            "'truncation' must be 'disabled': the orchestrator never drops a conversation's items.",
            "truncation",
        )
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (
            fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text")
        ):
            raise bad(
                "'text.format.type' must be 'text': structured outputs are not served.", "text.format.type"
            )
    if body.get("top_logprobs"):
        raise bad("'top_logprobs' is not served.", "top_logprobs")
    if body.get("include"):
        raise bad("'include' is not served: nothing is kept beside the answer's own items.", "include")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad("'metadata' must be an object of strings.", "metadata")


def read_request(body: Any) -> ResponsesRequest:
    """A client's Responses body checked and translated into the chat leg's body."""
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.", "body")
    _refuse_unserved(body)
    model = _string(body, "model", "model", required=True)
    instructions = _string(body, "instructions", "instructions")
    if "input" not in body:
        raise bad("Missing required parameter: 'input'.", "input")
    stream, store = bool(_bool(body, "stream")), _bool(body, "store")
    previous = _string(body, "previous_response_id", "previous_response_id")
    unresolved: dict[str, str] = {}
    turn = chat_messages(body["input"], unresolved)
    chat: dict[str, Any] = {"model": model, "messages": turn, "stream": stream}
    if stream:
        chat["stream_options"] = {"include_usage": True}  # the final event's usage
    echo: dict[str, Any] = {
        "model": model,
        "instructions": instructions,
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": None,
        "top_p": None,
        "max_output_tokens": None,
        "previous_response_id": previous,
        "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "user": _string(body, "user", "user"),
    }
    if body.get("tools") is not None:
        chat["tools"], echo["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        if (choice := _tool_choice(body["tool_choice"], chat.get("tools", []))) is not None:
            chat["tool_choice"] = choice
        echo["tool_choice"] = body["tool_choice"]
    if (parallel := _bool(body, "parallel_tool_calls")) is not None:
        chat["parallel_tool_calls"] = echo["parallel_tool_calls"] = parallel
    for key, high in (("temperature", 2.0), ("top_p", 1.0)):
        if (value := _number(body, key, 0.0, high)) is not None:
            chat[key] = echo[key] = value
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise bad("'max_output_tokens' must be a positive integer.", "max_output_tokens")
        chat["max_tokens"] = echo["max_output_tokens"] = limit
    request = ResponsesRequest(chat, stream, store, previous, turn, echo, unresolved, body["input"])
    if previous is None:  # else the store's conversation comes first: with_history then
        with_history(request, [])
    return request


def with_history(request: ResponsesRequest, history: list[dict[str, Any]]) -> None:
    """The chat leg's messages: the instructions (never carried from a previous response, as OpenAI
    documents), a previous response's conversation, then this request's input. Each tool result
    must answer a call of that conversation (as OpenAI checks)."""
    called = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    for call_id, param in request.unresolved.items():
        if call_id not in called:
            raise bad(f"No function call found for function_call_output with call_id '{call_id}'.", param)
    head = (
        [{"role": "system", "content": request.echo["instructions"]}] if request.echo["instructions"] else []
    )
    request.chat["messages"] = [*head, *history, *request.turn]


def parse_body(body: bytes) -> Any:
    """The client's JSON, or a 400: not JSON, nested past the decoder, or a lone surrogate (named).

    msgspec first (twice json's speed; it refuses lone surrogates): what it refuses is read again by
    json, whose errors (and check_no_lone_surrogates' field) the client is told."""
    try:
        return msgspec.json.decode(body)
    except (ValueError, RecursionError):
        pass
    try:
        data = json.loads(body)
    except RecursionError:
        raise bad("The request body is nested too deeply.", "body") from None
    except ValueError as exc:
        raise bad(f"The request body is not valid JSON ({exc}).", "body") from None
    if isinstance(data, dict):  # (anything else is refused by read_request)
        check_no_lone_surrogates(body, data)
    return data
