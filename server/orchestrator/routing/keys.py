"""Per-request routing keys: a request's conversation id and its prompt span's chunk hashes,
computed once per request from the raw body (one non-validating scan), only when a pool's router
reads them. Bad input never raises here: a body whose span cannot be found, a ``conversation_id``
that is an object: the request has no key of that kind (and goes to the least loaded worker)."""

from __future__ import annotations

import json
from typing import Any

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire
from server.cache_keys import CACHE_SALT, salt_key_at

#: trtllm-serve's conversation: the body's ``conversation_params.conversation_id`` (canonical), else
#: the first non-empty of its headers (its conversation_id.py CONVERSATION_ID_HEADERS), in order
CONVERSATION_PARAMS = wire.CONVERSATION_PARAMS
CONVERSATION_FIELD = wire.CONVERSATION_ID
TRTLLM_CONVERSATION_HEADERS = (
    b"x-session-id",
    b"x-correlation-id",
    b"x-session-affinity",
    b"x-multi-turn-session-id",
)
#: ours, older: a top-level ``conversation_id`` (moved into conversation_params before the legs:
#: trtllm-serve's workers forbid unknown fields) and this header, read after trtllm-serve's
CONVERSATION_HEADER = b"x-conversation-id"
CONVERSATION_HEADERS = (*TRTLLM_CONVERSATION_HEADERS, CONVERSATION_HEADER)
#: ids longer than this are not conversation ids (hashing megabytes per request is not routing)
MAX_CONVERSATION_ID_BYTES = 1024

_NESTED = (CONVERSATION_PARAMS, CONVERSATION_FIELD)
_CHAT_PATHS = (_NESTED, (CONVERSATION_FIELD,), (wire.MESSAGES,), (CACHE_SALT,))
_COMPLETION_PATHS = (_NESTED, (CONVERSATION_FIELD,), (wire.PROMPT,), (CACHE_SALT,))
_QUOTE, _MINUS = ord('"'), ord("-")


class RequestKey:
    """What the routers read of one request: its conversation id and its prompt span's chunk hashes.

    ``conversation``: the id's bytes (a string's decoded UTF-8, an integer's digits), or None.
    ``span``: the ``messages`` (chat) or ``prompt`` (completions) value's byte span, or None.
    Hashes are computed on first use per chunk size and kept (both pools may ask), each XORed with
    ``salt`` (the ``cache_salt``'s key, server/cache_keys.py; 0 without one): different salts
    share no key, as they share no cached block.
    ``hit_chunks``: set by the kv_cache_aware router to the expected hit on the worker it chose
    (``hit_tier2_chunks``: of it, in the worker's tier 2).
    """

    __slots__ = ("_hashes", "body", "conversation", "hit_chunks", "hit_tier2_chunks", "salt", "span")

    def __init__(
        self, body: bytes, conversation: bytes | None, span: tuple[int, int] | None, salt: int = 0
    ) -> None:
        self.body = body
        self.conversation = conversation
        self.span = span
        self.salt = salt
        self.hit_chunks = 0
        #: of them, those expected in the worker's second tier
        self.hit_tier2_chunks = 0
        self._hashes: tuple[int, list[int]] | None = None

    @property
    def prompt_bytes(self) -> int:
        return 0 if self.span is None else self.span[1] - self.span[0]

    def hashes(self, chunk: int) -> list[int]:
        """The chained hashes of the span's full ``chunk``-byte chunks ([] without a span)."""
        if self.span is None:
            return []
        cached = self._hashes
        if cached is not None and cached[0] == chunk:
            return cached[1]
        hashes = fastcore.chunk_hashes(self.body, self.span[0], self.span[1], chunk)
        if self.salt:
            salt = self.salt
            hashes = [h ^ salt for h in hashes]
        self._hashes = (chunk, hashes)
        return hashes


def conversation_of(body: bytes, span: tuple[int, int] | None) -> bytes | None:
    """A string's UTF-8 or an integer's digits; None for anything else (object, float, null...)."""
    if span is None:
        return None
    start, end = span
    if end - start > MAX_CONVERSATION_ID_BYTES + 2:
        return None
    first = body[start]
    if first == _QUOTE:
        raw = body[start + 1 : end - 1]
        if b"\\" not in raw:
            return raw or None
        try:
            value = json.loads(body[start:end])
        except ValueError:
            return None
        return value.encode("utf-8", "surrogatepass") or None
    raw = body[start:end]
    digits = raw[1:] if first == _MINUS else raw
    if digits.isdigit():  # an integer: no fraction, no exponent
        return raw
    return None


def conversation_header(request: Any) -> bytes | None:
    """The first non-empty conversation header of ``request`` (trtllm-serve's four, then ours)."""
    for name in CONVERSATION_HEADERS:
        value = request.header(name)
        if value is not None and value.strip():
            return value
    return None


def request_key(body: bytes, chat: bool, header: bytes | None) -> RequestKey:
    """The routing key of a client body (already validated by the relay): one non-validating scan
    finds the conversation id (``conversation_params.conversation_id``, else a top-level
    ``conversation_id``, else ``header``) and the prompt span. Never raises on a body's content."""
    try:
        nested, conversation, prompt, salt = fastcore.find_spans(
            body, _CHAT_PATHS if chat else _COMPLETION_PATHS, validate=False
        )
    except JSONSpanError:  # e.g. a repeated conversation_id: no key, least loaded
        nested = conversation = prompt = salt = None
    cid = conversation_of(body, nested)
    if cid is None:
        cid = conversation_of(body, conversation)
    if cid is None and header:
        header = header.strip()
        if 0 < len(header) <= MAX_CONVERSATION_ID_BYTES:
            cid = header
    return RequestKey(body, cid, prompt, salt_key_at(body, salt) if salt is not None else 0)
