"""What both orchestrator relay modes share: the request records the app holds, the error wording.

The modes themselves live in :mod:`.relay_fast` (the zero-parse relay) and :mod:`.relay_parsed`
(the pydantic baseline and its msgpack variant); :mod:`.relay_modes` picks one by config. The
protocol's names and rules come from :mod:`fastcore.protocol`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import fastcore
from fastcore import JSONSpanError, protocol
from server.errors import HTTPError

Span = tuple[int, int]


@dataclass(slots=True)
class ClientRequest:
    """What the orchestrator needs of a client body; everything else stays bytes."""

    body: bytes
    chat: bool
    stream: bool
    include_usage: bool
    max_tokens: int | None
    model: str | None
    # FastRelay: the relay kernel's ClientScan (spans found once); ParsedRelay: its request model.
    parsed: Any = None


@dataclass(slots=True)
class ContextResult:
    body: bytes
    finished: bool
    parsed: Any = None  # FastRelay: the kernel's ContextScan; ParsedRelay: its response model


def needs_generation(finish_reason: Any, completion_tokens: Any, max_tokens: int | None) -> bool:
    if finish_reason not in protocol.GENERATION_FOLLOWS:
        return False
    # Our context worker says "length" when the client's max_tokens is 1: that
    # leg already produced everything the client asked for.
    if (
        finish_reason == protocol.FINISH_LENGTH
        and max_tokens is not None
        and isinstance(completion_tokens, int)
    ):
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


def check_max_tokens(key: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise HTTPError(400, f"'{key}' must be at least 1, got {value}", param=key)
    return value


def scan_refusal(body: bytes, exc: JSONSpanError, what: str, status: int) -> HTTPError:
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


def check_disagg_request_id(disagg_request_id: int) -> None:
    """Refuse an id outside [2^40, 2^63) (``fastcore.protocol``): the app draws every id from there,
    so another one is a bug of the caller, not a client's error."""
    if not protocol.is_disagg_request_id(disagg_request_id):
        raise ValueError(f"disagg_request_id must be an int in [2^40, 2^63), got {disagg_request_id!r}")
