"""Tool calls (OpenAI's function calling) on the worker: the request's side and the parsers.

The request's side: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` read and checked
as OpenAI checks them (a 400 naming the field path, e.g. ``tools[0].function.name``), and the
conversation's tool turns (assistant ``tool_calls``, ``tool`` results) checked and prepared for
a chat template: an assistant call's ``function.arguments`` (a JSON string on the wire) handed
to the template as the object it encodes, as vLLM does (``chat_utils``), because templates
written for ``transformers`` print it with ``tojson`` (Qwen2.5's, Hermes') and would otherwise
print a quoted string.

The answer's side: the calls are parsed out of the generated text by the parser the worker was
started with (``--tool-call-parser``, vLLM's names):

- ``hermes`` (Hermes 2 Pro, Qwen2.5): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  several in a row for parallel calls; the text outside the tags is the content;
- ``llama3_json`` (Llama 3.1+ with its JSON tool prompt): the output opens with a JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` too), possibly after ``<|python_tag|>``,
  several separated by ``;``; text after them is content;
- ``none``: no parsing (the ``tiny`` model's default).

One incremental parser (:class:`ToolCallStream`) serves both a streamed and a whole answer, so
a stream's calls are the unary answer's. A call is announced once its JSON is complete and
parses: a name cannot be taken back once streamed, and malformed JSON inside the tags stays
content, as vLLM leaves it. No decoding is constrained: ``tool_choice: required`` or a named
function asks the model through its template, and an answer without a call is sent as it is
(``finish_reason`` ``stop`` / ``length``, no calls), never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .json_body import bad_request, brief

TOOL_CALL_PARSERS = ("none", "hermes", "llama3_json")
TOOL_CHOICES = ("none", "auto", "required")
#: OpenAI's rule for a function's name
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: a streamed call's arguments go in fragments of at most this many characters
ARGUMENT_FRAGMENT_CHARS = 64


@dataclass
class ToolCall:
    name: str
    #: the arguments as JSON text, as OpenAI sends them
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def wire(self) -> dict[str, Any]:
        """The call as ``message.tool_calls`` holds it."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolRequest:
    """A chat request's tools: the schemas, the choice, and the parser its answer goes through."""

    tools: list[dict[str, Any]]
    #: "none", "auto", "required", or "function": the one named by ``function``
    choice: str
    function: str | None
    parallel: bool
    parser: str

    @property
    def parsing(self) -> bool:
        return self.parser != "none" and self.choice != "none" and bool(self.tools)

    def stream(self) -> ToolCallStream:
        return _STREAMS[self.parser](self.parallel)  # only when parsing: "none" has no stream


def _check_tool(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(f"'{where}' must be an object", where)
    if tool.get("type") != "function":
        raise bad_request(
            f"'{where}.type' must be 'function', got {brief(tool.get('type'))}", f"{where}.type"
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"'{where}.function' must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"'{where}.function.name' must be a string of 1 to 64 letters, digits, '_' or '-', "
            f"got {brief(name)}",
            f"{where}.function.name",
        )
    for key, kind, what in (
        ("description", str, "a string"),
        ("parameters", dict, "an object"),
        ("strict", bool, "a boolean"),
    ):
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            raise bad_request(f"'{where}.function.{key}' must be {what}", f"{where}.function.{key}")
    return name


def _tool_choice(body: dict[str, Any], names: list[str]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if not names:
        raise bad_request("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(
                f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                f"got {brief(choice)}",
                "tool_choice",
            )
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict):
        raise bad_request(
            "'tool_choice' must be a string or {'type': 'function', 'function': {'name': ...}}", "tool_choice"
        )
    name = function.get("name")
    if not isinstance(name, str):
        raise bad_request("'tool_choice.function.name' must be a string", "tool_choice.function.name")
    if name not in names:
        raise bad_request(
            f"'tool_choice.function.name' {brief(name)} names no function of 'tools'",
            "tool_choice.function.name",
        )
    return "function", name  # (a function may be named "none")


def read_tools(body: dict[str, Any], parser: str) -> ToolRequest | None:
    """The request's tools, checked; None when it has none (nor any tool field)."""
    tools = body.get("tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None and body.get("tool_choice") is None:
        return None
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    names = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    choice, function = _tool_choice(body, names)
    return ToolRequest(tools, choice, function, parallel is not False, parser)


def _tool_call_arguments(call: dict[str, Any], where: str) -> Any:
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"'{where}.function' must be an object", f"{where}.function")
    if not isinstance(function.get("name"), str):
        raise bad_request(f"'{where}.function.name' must be a string", f"{where}.function.name")
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise bad_request(
            f"'{where}.function.arguments' must be a string of JSON", f"{where}.function.arguments"
        )
    try:
        value = json.loads(arguments) if arguments.strip() else {}
        # An escaped lone surrogate inside the string is one once decoded: no tokenizer encodes it
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"'{where}.function.arguments' holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape)",
            f"{where}.function.arguments",
        ) from None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
        raise bad_request(
            f"'{where}.function.arguments' is not valid JSON", f"{where}.function.arguments"
        ) from None
    return value


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a chat template takes them: tool turns checked (400s naming the path), each
    assistant call's arguments as the object they encode. The others are passed as they are."""
    out = messages
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(
                    f"'messages[{i}].tool_call_id' must be a string", f"messages[{i}].tool_call_id"
                )
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise bad_request(f"'messages[{i}].tool_calls' must be a list", f"messages[{i}].tool_calls")
        prepared = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call, dict):
                raise bad_request(f"'{where}' must be an object", where)
            if not isinstance(call.get("id"), str):
                raise bad_request(f"'{where}.id' must be a string", f"{where}.id")
            if call.get("type", "function") != "function":
                raise bad_request(f"'{where}.type' must be 'function'", f"{where}.type")
            arguments = _tool_call_arguments(call, where)
            prepared.append({**call, "function": {**call["function"], "arguments": arguments}})
        if out is messages:
            out = list(messages)  # the body's own messages stay as sent (their bytes are cache keys)
        out[i] = {**message, "tool_calls": prepared}
    return out


# ------------------------------------------------------------------ parsers


def _call_of(obj: Any, *argument_keys: str) -> ToolCall | None:
    """A call from a parsed JSON object, or None when it is none (no name, arguments not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    try:
        if isinstance(arguments, str):  # some models send the arguments as JSON text already
            json.loads(arguments)
            return ToolCall(obj["name"], arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
    except (ValueError, RecursionError):
        return None


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


Event = str | ToolCall  # a piece of content, or a whole call


class ToolCallStream:
    """Text in, content and whole calls out: ``feed`` each piece of generated text, then ``finish``.
    Text that may still turn into a call is held back until it is known."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls = 0
        self.buffer = ""
        #: whitespace-only content, sent once other content follows it or no call was found: so
        #: the newlines around calls are neither streamed nor in a unary answer's content
        self.held = ""

    def feed(self, text: str) -> list[Event]:
        return self._gate(self._feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._gate(self._finish(), final=True)

    def _gate(self, events: list[Event], *, final: bool) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCall):
                out.append(event)
            elif not event.strip():
                self.held += event
            else:
                body = event.rstrip()
                out.append(self.held + body)
                self.held = event[len(body) :]
        if final:
            if self.held and not self.calls:
                out.append(self.held)
            self.held = ""
        return out

    def _call(self, call: ToolCall, out: list[Event]) -> None:
        # parallel_tool_calls: false: the first call only (no decoding constrains the model)
        if self.parallel or not self.calls:
            self.calls += 1
            out.append(call)

    def _feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def _finish(self) -> list[Event]:
        raise NotImplementedError


class HermesStream(ToolCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.inside = False

    def _feed(self, text: str) -> list[Event]:
        self.buffer += text
        out: list[Event] = []
        while True:
            buffer = self.buffer
            if not self.inside:
                start = buffer.find(self.OPEN)
                if start < 0:
                    keep = _held_prefix(buffer, self.OPEN)
                    if len(buffer) > keep:
                        out.append(buffer[: len(buffer) - keep])
                    self.buffer = buffer[len(buffer) - keep :]
                    return out
                if start:
                    out.append(buffer[:start])
                self.buffer, self.inside = buffer[start + len(self.OPEN) :], True
                continue
            end = buffer.find(self.CLOSE)
            if end < 0:
                return out
            call = self._parse(buffer[:end])
            if call is None:  # malformed: the text stays, tags and all
                out.append(self.OPEN + buffer[: end + len(self.CLOSE)])
            else:
                self._call(call, out)
            self.buffer, self.inside = buffer[end + len(self.CLOSE) :], False

    def _finish(self) -> list[Event]:
        out: list[Event] = []
        if self.inside:  # a call the model ended without its closing tag (vLLM takes it too)
            call = self._parse(self.buffer)
            if call is not None:
                self._call(call, out)
            else:
                out.append(self.OPEN + self.buffer)
        elif self.buffer:
            out.append(self.buffer)
        self.buffer, self.inside = "", False
        return out

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            return _call_of(json.loads(body), "arguments")
        except (ValueError, RecursionError):  # a model's runaway nesting is text, not a call
            return None


class Llama3JsonStream(ToolCallStream):
    TAG = "<|python_tag|>"
    _DECODER = json.JSONDecoder()

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        #: "start": not known yet; "calls": reading calls; "text": the rest is content
        self.state = "start"

    def _feed(self, text: str) -> list[Event]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(self.TAG):
                self.buffer, self.state = head[len(self.TAG) :], "calls"
            elif head.startswith("{"):
                self.buffer, self.state = head, "calls"
            elif not head or self.TAG.startswith(head):
                return []
            else:
                self.state = "text"
        if self.state == "text":
            out, self.buffer = self.buffer, ""
            return [out] if out else []
        return self._calls(final=False)

    def _calls(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            rest = self.buffer.lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest:
                self.buffer = "" if final else self.buffer
                return out
            if rest[0] != "{":
                self.state = "text"
                self.buffer = ""
                out.append(rest)
                return out
            try:
                obj, end = self._DECODER.raw_decode(rest)
            except (ValueError, RecursionError):  # not complete yet, or never will be: known at the end
                if final:
                    self.state, self.buffer = "text", ""
                    out.append(rest)
                return out
            call = _call_of(obj, "parameters", "arguments")
            if call is None:  # JSON but no call: the rest is content
                self.state, self.buffer = "text", ""
                out.append(rest)
                return out
            self._call(call, out)
            self.buffer = rest[end:]

    def _finish(self) -> list[Event]:
        if self.state == "calls":
            return self._calls(final=True)
        out, self.buffer = self.buffer, ""
        return [out] if out else []


_STREAMS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
}


def parse_tool_calls(stream: ToolCallStream, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when only whitespace is left around calls) and its calls."""
    events = stream.feed(text) + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return (None if calls and not content else content), calls


__all__ = [
    "ARGUMENT_FRAGMENT_CHARS",
    "TOOL_CALL_PARSERS",
    "HermesStream",
    "Llama3JsonStream",
    "ToolCall",
    "ToolCallStream",
    "ToolRequest",
    "parse_tool_calls",
    "read_tools",
    "template_messages",
]
