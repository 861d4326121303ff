"""OpenAI's Responses API (``POST /v1/responses``) translated to one chat completion and back.

Sans-IO, like the rest of the orchestrator's protocol code: :mod:`.responses_request` checks a
client's body and builds the chat leg's body once (every gate, router and relay then treat it as any
chat request); :func:`response_object` turns a chat answer into a ``response`` object and
:class:`EventTranslator` turns the chat leg's SSE bytes, cut anywhere, into the Responses event
sequence whose ``response.completed`` carries what the unary answer would. Field and event names
follow the official ``openai`` SDK's ``types/responses``. Every malformed body is a 400 in OpenAI's
error shape naming the field (``param``), never a 500. Stored responses (``store``,
``previous_response_id``) live in :mod:`.responses_store`.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgspec

from server.errors import HTTPError, error_body
from server.http import Request

from .responses_request import ResponsesRequest, parse_body, read_request, with_history
from .responses_store import (
    ResponseStore,
    deleted,
    input_items_page,
    previous_history,
    refuse_store,
    stored_or_404,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ------------------------------------------------------------------ the answer


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") if isinstance(details, dict) else None) or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def input_items(given: Any) -> list[dict[str, Any]]:
    """A request's ``input`` (checked by :func:`chat_messages`) as OpenAI lists it back
    (``GET /v1/responses/{id}/input_items``): each item with an id (the client's, else a new one), a
    status, and a message's content as parts (``input_text``; an assistant's ``output_text``)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        given_id = item.get("id")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                part = (
                    {"type": "output_text", "text": content, "annotations": []}
                    if item["role"] == "assistant"
                    else {"type": "input_text", "text": content}
                )
                content = [part]
            out = {"type": "message", "role": item["role"], "content": content}
        elif kind == "function_call":
            out = {
                "type": kind,
                "call_id": item["call_id"],
                "name": item["name"],
                "arguments": item["arguments"],
            }
        else:
            out = {"type": kind, "call_id": item["call_id"], "output": item["output"]}
        prefix = {"message": "msg", "function_call": "fc"}.get(kind, "fco")
        out["id"] = given_id if isinstance(given_id, str) and given_id else new_id(prefix)
        out["status"] = "completed"
        items.append(out)
    return items


def envelope(request: ResponsesRequest, response_id: str, created_at: int, status: str) -> dict[str, Any]:
    """The ``response`` object without its output: what ``response.created`` carries."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": None,
        **request.echo,
        "output": [],
        "usage": None,
        "store": bool(request.store),
    }


def finish(response: dict[str, Any], output: list[dict[str, Any]], finish_reason: Any, usage: Any) -> None:
    """The finished response: its output, its status (a length cut is ``incomplete``), its usage."""
    complete = finish_reason != "length"
    response["status"] = "completed" if complete else "incomplete"
    if not complete:
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        if output:  # the item the limit cut, as a stream closes it
            output[-1]["status"] = "incomplete"
    response["output"] = output
    response["usage"] = _usage(usage)


def response_object(request: ResponsesRequest, answer: Any, response_id: str | None = None) -> dict[str, Any]:
    """A chat completion's answer as a ``response``; ValueError for a malformed one (the client's 502)."""
    try:
        choice = answer["choices"][0]
        message = choice["message"]
        output = []
        if isinstance(message.get("content"), str) and message["content"]:
            output.append(message_item(message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            fn = call["function"]
            output.append(call_item(str(call["id"]), str(fn["name"]), str(fn["arguments"]), "completed"))
        created = answer.get("created")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ValueError(f"the worker's chat answer is malformed ({exc!r})") from None
    response = envelope(
        request,
        response_id or new_id("resp"),
        int(created) if isinstance(created, int) else int(time.time()),
        "completed",
    )
    finish(response, output, choice.get("finish_reason"), answer.get("usage"))
    return response


def answer_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn's history holds."""
    text = "".join(
        p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in response["output"]
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


# ------------------------------------------------------------------ the stream


class EventTranslator:
    """The chat leg's SSE bytes, fed as they come (cut anywhere), as the Responses event stream.

    One output item is open at a time: text opens a ``message`` item, a new ``delta.tool_calls``
    index a ``function_call`` item; the next one (or the end) closes it with its ``...done`` events.
    ``[DONE]`` ends the stream with ``response.completed`` (``response.incomplete`` at a length cut)
    carrying the response the unary answer would; an in-band error or a stream cut before its end
    is ``response.failed``."""

    def __init__(self, request: ResponsesRequest, response_id: str | None = None) -> None:
        self.response = envelope(request, response_id or new_id("resp"), int(time.time()), "in_progress")
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # chat's tool_calls index -> its item
        self.finish_reason: Any = None
        self.usage: Any = None
        self.done = False
        self._line = b""
        self._data: list[bytes] = []

    def event(self, kind: str, **members: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **members}
        self.sequence += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), msgspec.json.encode(data))

    def start(self) -> bytes:
        return self.event("response.created", response=self.response) + self.event(
            "response.in_progress", response=self.response
        )

    def feed(self, data: bytes) -> bytes:
        """Whatever events the bytes complete (SSE: lines, an event ends at an empty one)."""
        out = []
        lines = (self._line + data).split(b"\n")
        self._line = lines.pop()
        for line in lines:
            line = line.rstrip(b"\r")
            if line:
                if line.startswith(b"data:"):
                    self._data.append(line[5:].lstrip(b" "))
                continue  # comments, event: and id: lines carry nothing chat needs
            if self._data and not self.done:
                payload, self._data = b"\n".join(self._data), []
                out.append(self._chunk(payload))
        return b"".join(out)

    def close(self) -> bytes:
        """The chat stream ended: a stream without its ``[DONE]`` failed."""
        if self.done:
            return b""
        return self._failed(
            {"code": "server_error", "message": "the answer's stream ended before it finished"}
        )

    def _chunk(self, payload: bytes) -> bytes:
        if payload == b"[DONE]":
            return self._completed()
        try:
            chunk = msgspec.json.decode(payload)  # refuses a lone surrogate: nothing then fails to encode
            if isinstance(chunk.get("error"), dict):
                error = chunk["error"]
                return self._failed(
                    {
                        "code": str(error.get("code") or "server_error"),
                        "message": str(error.get("message") or ""),
                    }
                )
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            out = []
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str) and delta["content"]:
                    out.append(self._text(delta["content"]))
                for call in delta.get("tool_calls") or ():
                    out.append(self._call(call))
                if choice.get("finish_reason") is not None:
                    self.finish_reason = choice["finish_reason"]
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
            return self._failed(
                {"code": "bad_gateway", "message": f"the worker's stream is malformed ({exc!r})"}
            )
        return b"".join(out)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != "message":
            out += self._close("completed")
            self.open = message_item("", "in_progress")
            part = self.open["content"].pop()
            out += self.event("response.output_item.added", output_index=len(self.output), item=self.open)
            out += self.event("response.content_part.added", content_index=0, part=part, **self._where())
            self.open["content"].append(part)
        self.open["content"][0]["text"] += text
        return out + self.event(
            "response.output_text.delta", content_index=0, delta=text, logprobs=[], **self._where()
        )

    def _call(self, call: dict[str, Any]) -> bytes:
        out = b""
        index = call["index"]
        function = call.get("function") or {}
        if index not in self.calls:
            out += self._close("completed")
            self.open = self.calls[index] = call_item(
                str(call["id"]), str(function["name"]), "", "in_progress"
            )
            out += self.event("response.output_item.added", output_index=len(self.output), item=self.open)
        elif self.open is not self.calls[index]:
            raise ValueError(f"tool call {index} goes on after another item began")
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            self.open["arguments"] += fragment
            out += self.event("response.function_call_arguments.delta", delta=fragment, **self._where())
        return out

    def _close(self, status: str) -> bytes:
        item, out = self.open, b""
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            out += self.event(
                "response.output_text.done", content_index=0, text=part["text"], logprobs=[], **where
            )
            out += self.event("response.content_part.done", content_index=0, part=part, **where)
        else:
            out += self.event(
                "response.function_call_arguments.done",
                name=item["name"],
                arguments=item["arguments"],
                **where,
            )
        item["status"] = status
        out += self.event("response.output_item.done", output_index=where["output_index"], item=item)
        self.output.append(item)
        self.open = None
        return out

    def _completed(self) -> bytes:
        out = self._close("incomplete" if self.finish_reason == "length" else "completed")
        finish(self.response, self.output, self.finish_reason, self.usage)
        self.done = True
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return out + self.event(kind, response=self.response)

    def _failed(self, error: dict[str, Any]) -> bytes:
        self.open = None
        self.done = True
        self.response.update(status="failed", error=error, output=self.output)
        return self.event("response.failed", response=self.response)


# ------------------------------------------------------------------ the hook (apis/__init__.py's contract)


class ResponsesCall:
    """One request's translation both ways; with a store, its finished response is kept."""

    def __init__(self, request: ResponsesRequest, store: ResponseStore | None, tenant: str) -> None:
        self.request = request
        self.body = msgspec.json.encode(request.chat)  # a tenth of json.dumps' time on a long history
        self.keep = store if store is not None and request.store is not False else None
        self.tenant = tenant
        self.history = request.chat["messages"][1 if request.echo["instructions"] else 0 :]

    def answer(self, chat: bytes) -> bytes:
        try:
            answer = msgspec.json.decode(chat)
        except RecursionError:
            raise ValueError("the worker's chat answer is nested too deeply") from None
        response = response_object(self.request, answer)
        self.kept(response)
        return msgspec.json.encode(response)

    def kept(self, response: dict[str, Any]) -> None:
        if self.keep is not None and response["status"] in ("completed", "incomplete"):
            response["store"] = self.keep.put(
                self.tenant,
                response,
                [*self.history, *answer_messages(response)],
                input_items(self.request.given),
            )

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)


class ResponsesStream:
    """The hook's stream translator (``feed`` / ``flush``) over :class:`EventTranslator`."""

    def __init__(self, call: ResponsesCall) -> None:
        self.call = call
        self.translator = EventTranslator(call.request)
        self.translator.response["store"] = call.keep is not None
        self.started = False

    def feed(self, data: bytes) -> bytes:
        head = b""
        if not self.started:
            self.started = True
            head = self.translator.start()
        done = self.translator.done
        out = head + self.translator.feed(data)
        if self.translator.done and not done and self.translator.response["status"] != "failed":
            self.call.kept(self.translator.response)
        return out

    def flush(self) -> bytes:
        return self.feed(b"") + self.translator.close()


_INPUT_ITEMS = "/input_items"


class ResponsesApi:
    """``POST /v1/responses`` (apis/__init__.py's contract). ``store``: the deployment's stored
    responses (None: off, ``store: true`` and ``previous_response_id`` refused)."""

    name = "responses"
    paths: tuple[bytes, ...] = (b"/v1/responses",)
    prefixes = (b"/v1/responses/",)

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store

    def bind(self, config: Any) -> ResponsesApi:
        """This orchestrator's API: its own store where ``responses_store`` is configured."""
        limits = getattr(config, "responses_store", None)
        return ResponsesApi(ResponseStore(limits) if limits is not None else None)

    def serve_other(self, request: Request, tenant: str, ask: Any = None) -> tuple[int, bytes]:
        """``GET`` / ``DELETE /v1/responses/{id}`` of a stored response (the tenant's own: 404 else),
        ``GET /v1/responses/{id}/input_items`` its input items, a page of them."""
        method, path = request.method, request.path
        response_id = path[len(self.prefixes[0]) :].decode("utf-8", "replace")
        if response_id.endswith(_INPUT_ITEMS):
            if method != b"GET":
                raise HTTPError(405, "/v1/responses/{id}/input_items takes GET", headers={"Allow": "GET"})
            stored = stored_or_404(self.store, tenant, response_id[: -len(_INPUT_ITEMS)])
            return 200, msgspec.json.encode(input_items_page(stored, request.query))
        if method not in (b"GET", b"DELETE"):
            raise HTTPError(405, "/v1/responses/{id} takes GET or DELETE", headers={"Allow": "GET, DELETE"})
        stored = stored_or_404(self.store, tenant, response_id)
        if method == b"DELETE":
            assert self.store is not None
            self.store.delete(tenant, response_id)
            return 200, json.dumps(deleted(response_id)).encode()
        return 200, msgspec.json.encode(stored.response)

    def credentials(self, request: Request) -> bytes | None:
        return request.header(b"authorization")

    def to_chat(self, body: bytes, request: Request, tenant: str = "") -> ResponsesCall:
        checked = read_request(parse_body(body))
        refuse_store(self.store, checked.store)
        if checked.previous_response_id is not None:
            with_history(checked, previous_history(self.store, tenant, checked.previous_response_id))
        return ResponsesCall(checked, self.store, tenant)

    def error_body(self, status: int, message: str, param: str | None, code: str | None) -> bytes:
        return error_body(status, message, param=param, code=code)


API = ResponsesApi()
