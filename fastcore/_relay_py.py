"""The relay kernels, pure-Python twin of ``fastcore._relay``: the reference.

What the orchestrator's fast relay (server/orchestrator/relay_fast.FastRelay) does with each body,
one call per body: one validating scan (``fastcore._scan_py``) plus every check, small-field decode
and output byte it needs. The compiled twin does all of it in C, with no Python objects in between.
RelayError messages are the orchestrator's HTTP error texts (``field`` is the offending field, the
400's ``param``), except strip_internal_fields', which callers prefix. The wire names are
``fastcore.protocol``'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from . import protocol as P
from ._codec_py import check_token_b64
from ._scan_py import (
    _COMMA,
    _OPEN_ARRAY,
    _OPEN_OBJECT,
    _QUOTE,
    _WS,
    Path,
    Span,
    _as_bytes,
    _skip_ws,
    find_member_spans,
    find_spans,
    splice,
)
from .errors import RelayError, TokenDecodeError

#: Everything either leg needs from a client body, found in one pass (fastcore.relay's read_client_body).
CLIENT_PATHS: tuple[Path, ...] = (
    (),
    (P.MESSAGES,),
    (P.DISAGGREGATED_PARAMS,),
    (P.PROMPT_TOKEN_IDS_B64,),
    (P.PROMPT_TOKEN_IDS,),
    (P.STREAM,),
    (P.STREAM_OPTIONS,),
    (P.PROMPT,),
    (P.MESSAGES, -1),
)
#: The same, plus the small fields the orchestrator acts on (read_client_request).
CLIENT_REQUEST_PATHS: tuple[Path, ...] = (
    *CLIENT_PATHS,
    (P.MODEL,),
    (P.MAX_TOKENS,),
    (P.MAX_COMPLETION_TOKENS,),
    (P.STREAM_OPTIONS, P.INCLUDE_USAGE),
    (P.CONVERSATION_ID,),
)
(
    C_ROOT,
    C_MESSAGES,
    C_DISAGG,
    C_B64,
    C_IDS,
    C_STREAM,
    C_STREAM_OPTIONS,
    C_PROMPT,
    C_LAST_MESSAGE,
    C_MODEL,
    C_MAX_TOKENS,
    C_MAX_COMPLETION_TOKENS,
    C_INCLUDE_USAGE,
    C_CONVERSATION_ID,
) = range(14)
#: The client-body spans of the internal fields, and each field's name: a client may send none of
#: ``fastcore.protocol.internal_request_fields(chat)`` (the one rule; both twins' kernels and
#: fastcore.relay's builders enforce it from here).
CLIENT_INTERNAL: tuple[tuple[int, str], ...] = (
    (C_DISAGG, P.DISAGGREGATED_PARAMS),
    (C_B64, P.PROMPT_TOKEN_IDS_B64),
    (C_IDS, P.PROMPT_TOKEN_IDS),
)


def check_internal_fields(spans: Sequence[Span | None], chat: bool) -> None:
    """Raise ``RelayError`` (the 400's message, ``field``) for an internal field in a client body's
    ``spans`` (those of ``CLIENT_PATHS`` first)."""
    forbidden = P.internal_request_fields(chat)
    for index, name in CLIENT_INTERNAL:
        if spans[index] is not None and name in forbidden:
            raise RelayError(P.internal_field_message(name), name)


_DP: Path = (P.CHOICES, 0, P.DISAGGREGATED_PARAMS)
#: What leg (3) needs from a context response (fastcore.relay's parse_context_response).
CONTEXT_PATHS: tuple[Path, ...] = (
    (),
    (P.CHOICES, 0, P.FINISH_REASON),
    _DP,
    (P.USAGE,),
    (P.PROMPT_TOKEN_IDS,),
    (P.PROMPT_TOKEN_IDS_B64,),
    (*_DP, P.REQUEST_TYPE),
    (*_DP, P.CTX_USAGE),
)
#: The same, plus what the orchestrator checks before relaying and what it signs trtllm-serve's
#: ``x-trtllm-disagg-auth`` over (read_context_response; ContextScan.auth_fields decodes the last two).
CONTEXT_RESPONSE_PATHS: tuple[Path, ...] = (
    *CONTEXT_PATHS,
    (P.CHOICES, 0),
    (P.USAGE, P.COMPLETION_TOKENS),
    (*_DP, P.CTX_INFO_ENDPOINT),
    (*_DP, P.ENCODED_OPAQUE_STATE),
    (P.USAGE, P.PROMPT_TOKENS),
    (P.USAGE, P.PROMPT_TOKENS_DETAILS, P.CACHED_TOKENS),
)
(
    X_ROOT,
    X_FINISH,
    X_DP,
    X_USAGE,
    X_IDS,
    X_B64,
    X_REQUEST_TYPE,
    X_CTX_USAGE,
    X_FIRST_CHOICE,
    X_COMPLETION_TOKENS,
    X_CTX_INFO_ENDPOINT,
    X_ENCODED_OPAQUE_STATE,
    X_PROMPT_TOKENS,
    X_CACHED_TOKENS,
) = range(14)

_STRIP_PATHS: dict[int, tuple[Path, ...]] = {}


def strip_paths(choices: int) -> tuple[Path, ...]:
    """strip_internal_fields' paths for the first ``choices`` choices (built once per count).

    ``("choices", choices)`` says whether there are more: then the caller scans again with more.
    """
    paths = _STRIP_PATHS.get(choices)
    if paths is None:
        paths = _STRIP_PATHS[choices] = (
            (),
            *((name,) for name in P.INTERNAL_RESPONSE_FIELDS),
            (P.CHOICES, choices),
            *((P.CHOICES, i, name) for i in range(choices) for name in P.INTERNAL_CHOICE_FIELDS),
        )
    return paths


# -- the wire text the kernels write, from fastcore.protocol's names (the compiled twin writes these
# very bytes: it reads them from here at import) -------------------------------------------------------


def _key(name: str) -> bytes:
    return json.dumps(name).encode() + b":"


STREAM_KEY = _key(P.STREAM)
STREAM_OPTIONS_KEY = _key(P.STREAM_OPTIONS)
#: leg (1)'s ``disaggregated_params`` member up to the id's digits
CONTEXT_PARAMS_OPEN = (
    _key(P.DISAGGREGATED_PARAMS)
    + b"{"
    + _key(P.REQUEST_TYPE)
    + json.dumps(P.CONTEXT_ONLY).encode()
    + b","
    + _key(P.DISAGG_REQUEST_ID)
)
ASK_B64 = b"," + _key(P.RETURN_PROMPT_TOKEN_IDS_B64) + b"true"
DISAGGREGATED_PARAMS_KEY = _key(P.DISAGGREGATED_PARAMS)
REQUEST_TYPE_KEY = _key(P.REQUEST_TYPE)
GENERATION_ONLY = json.dumps(P.GENERATION_ONLY).encode()
CTX_USAGE_KEY = _key(P.CTX_USAGE)
PROMPT_TOKEN_IDS_B64_KEY = _key(P.PROMPT_TOKEN_IDS_B64)
PROMPT_TOKEN_IDS_KEY = _key(P.PROMPT_TOKEN_IDS)
PROMPT_KEY = _key(P.PROMPT)
#: the finish reasons decoded without a JSON decoder: raw JSON -> value
COMMON_FINISH_REASONS: dict[bytes, str | None] = {
    b"null": None,
    **{json.dumps(r).encode(): r for r in P.COMMON_FINISH_REASONS},
}
#: the prefix of the 502's messages about a context response
CONTEXT_502 = "context worker response cannot be relayed: "


# -- the kernels' refusals: their texts, once (the compiled twin raises these too) ---------------------

#: what a small field must be, in ``must_be``'s words
A_BOOLEAN, A_STRING, AN_OBJECT, AN_INTEGER = "a boolean", "a string", "an object", "an integer"
A_NON_EMPTY_ARRAY, A_STRING_OR_ARRAY = "a non-empty array", "a string or an array"


def must_be(key: str, what: str) -> RelayError:
    """A client's small field of the wrong type (the 400's message and ``param``)."""
    return RelayError(f"'{key}' must be {what}", key)


def too_many_digits(key: str) -> RelayError:
    return RelayError(f"'{key}' must be an integer of at most {MAX_INT_DIGITS} digits", key)


def below_one(key: str, value: int) -> RelayError:
    return RelayError(f"'{key}' must be at least 1, got {value}", key)


def not_an_object(what: str) -> RelayError:
    """``what`` (``REQUEST_BODY``, ``RESPONSE_BODY``) is JSON but not an object."""
    return RelayError(f"{what} must be a JSON object")


REQUEST_BODY, RESPONSE_BODY = "request body", "the response body"


def context_refusal(reason: str, field: str | None = None) -> RelayError:
    """A context response leg (3) cannot be built from (the 502's message)."""
    return RelayError(CONTEXT_502 + "context response" + reason, field)


CTX_NOT_AN_OBJECT = " is not a JSON object"
CTX_FINISH_NOT_A_STRING = ": choices[0].finish_reason is not a string"
CTX_NO_PARAMS_OBJECT = " has no choices[0].disaggregated_params object"
CTX_NO_B64 = (
    " has no prompt_token_ids_b64 string (is the context worker's return_prompt_token_ids_b64 support on?)"
    " and no prompt_token_ids list"
)
CTX_NO_IDS = " has no prompt_token_ids list"


def bad_b64(exc: Exception) -> RelayError:
    return context_refusal(f": invalid prompt_token_ids_b64: {exc}", P.PROMPT_TOKEN_IDS_B64)


def no_first_choice() -> RelayError:
    return RelayError(f"context worker response has no {P.CHOICES}[0]", P.CHOICES)


def lacks_params() -> RelayError:
    return RelayError(
        f"context worker response lacks {P.CHOICES}[0].{P.DISAGGREGATED_PARAMS}", P.DISAGGREGATED_PARAMS
    )


def not_a_scan(what: str, expected: str, value: object) -> TypeError:
    """A kernel given another twin's scan (or none)."""
    return TypeError(f"{what} must be a {expected} of this twin, not {type(value).__name__}")


def not_an_id() -> TypeError:
    return TypeError("disagg_request_id must be an int")


#: An int of more digits than this is not a token count (and int() of thousands of digits is slow).
MAX_INT_DIGITS = 20
#: a token count (usage_tokens) is at most this many digits: a larger one is no worker's
MAX_COUNT_DIGITS = 15
_NULL, _TRUE, _FALSE, _MINUS = b"ntf-"
_MEMBER_SEPARATOR = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")


class _Scan:
    __slots__ = ()

    def _relay_key(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        # Equal across the twins: the compiled scan classes have the same _relay_key.
        key = getattr(other, "_relay_key", None)
        if key is None or type(other).__name__ != type(self).__name__:
            return NotImplemented
        return bool(self._relay_key() == key())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS if name != "body")  # type: ignore[attr-defined]
        return f"{type(self).__name__}({fields})"


class ClientScan(_Scan):
    """A client body read by :func:`read_client_request`: its small fields decoded, the spans both legs
    splice (those of ``CLIENT_REQUEST_PATHS``, ``None`` where absent) and the body as ``bytes``."""

    _FIELDS = ("body", "chat", "spans", "empty", "stream", "include_usage", "max_tokens", "model")
    __slots__ = _FIELDS

    def __init__(
        self,
        body: bytes,
        chat: bool,
        spans: tuple[Span | None, ...],
        empty: bool,
        stream: bool,
        include_usage: bool,
        max_tokens: int | None,
        model: str | None,
    ) -> None:
        self.body = body
        self.chat = chat
        self.spans = spans
        self.empty = empty  # the object has no members: fields are added without a leading comma
        self.stream = stream
        self.include_usage = include_usage
        self.max_tokens = max_tokens
        self.model = model

    @property
    def has_conversation_id(self) -> bool:
        """The body has a top-level ``conversation_id`` (ours, which the orchestrator moves into
        trtllm-serve's ``conversation_params``: workers refuse it at the top): found by this scan,
        so a body without one needs no scan of its own for it."""
        return self.spans[C_CONVERSATION_ID] is not None

    @property
    def prompt_bytes(self) -> int:
        """The bytes of the prompt's span, ``messages`` (chat) or ``prompt`` (completions); 0 without
        one: what an orchestrator learns bytes per token from (not the body, which a client may pad)."""
        span = self.spans[C_MESSAGES if self.chat else C_PROMPT]
        return 0 if span is None else span[1] - span[0]


class ContextScan(_Scan):
    """A context response read by :func:`read_context_response` (spans of ``CONTEXT_RESPONSE_PATHS``)."""

    _FIELDS = ("body", "spans", "finish_reason", "finished")
    __slots__ = _FIELDS

    def __init__(
        self, body: bytes, spans: tuple[Span | None, ...], finish_reason: str | None, finished: bool
    ) -> None:
        self.body = body
        self.spans = spans
        self.finish_reason = finish_reason
        self.finished = finished  # the context response is the answer: no generation leg

    def auth_fields(self) -> tuple[object, object]:
        """``choices[0].disaggregated_params``' ``ctx_info_endpoint`` and ``encoded_opaque_state``,
        decoded (``None`` where absent): what trtllm-serve's ``x-trtllm-disagg-auth`` signs. Decoded
        only when asked: the scan found their spans at no extra pass."""
        return _json_at(self.body, self.spans[X_CTX_INFO_ENDPOINT]), _json_at(
            self.body, self.spans[X_ENCODED_OPAQUE_STATE]
        )

    def usage_tokens(self) -> tuple[int | None, int | None]:
        """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` (None for either
        when absent or not a count: digits only, at most ``MAX_COUNT_DIGITS``), from the spans this
        scan found: what the orchestrator learns bytes per token and routing quality from, at no
        second pass over the answer."""
        return _count_at(self.body, self.spans[X_PROMPT_TOKENS]), _count_at(
            self.body, self.spans[X_CACHED_TOKENS]
        )


def _json_at(buf: bytes, span: Span | None) -> object:
    """The JSON value at ``span`` of a validated body, decoded (``None`` when absent)."""
    return None if span is None else json.loads(buf[span[0] : span[1]])


def _is_empty(buf: bytes, span: Span) -> bool:
    return _WS.match(buf, span[0] + 1).end() == span[1] - 1  # type: ignore[union-attr]


def _bool_at(buf: bytes, span: Span | None, key: str) -> bool | None:
    if span is None:
        return None
    first = buf[span[0]]
    if first == _TRUE:
        return True
    if first == _FALSE:
        return False
    if first == _NULL:
        return None
    raise must_be(key, A_BOOLEAN)


def _str_at(buf: bytes, span: Span | None, key: str) -> str | None:
    if span is None:
        return None
    start, end = span
    first = buf[start]
    if first == _NULL:
        return None
    if first != _QUOTE:
        raise must_be(key, A_STRING)
    if buf.find(b"\\", start + 1, end - 1) < 0:
        return buf[start + 1 : end - 1].decode("utf-8")  # the scan checked its UTF-8
    value: str = json.loads(buf[start:end])  # escapes: a short string, the stdlib decodes them right
    return value


def _count_at(buf: bytes, span: Span | None) -> int | None:
    """The count at ``span``: ``None`` if absent or not 1 to ``MAX_COUNT_DIGITS`` ASCII digits."""
    if span is None or span[1] - span[0] > MAX_COUNT_DIGITS:
        return None
    raw = buf[span[0] : span[1]]
    return int(raw) if raw.isdigit() else None


def _int_at(buf: bytes, span: Span | None) -> int | None:
    """The integer at ``span``: ``None`` if absent, not a number, over 20 digits or not integral."""
    if span is None:
        return None
    start, end = span
    first = buf[start]
    if not (first == _MINUS or 0x30 <= first <= 0x39) or end - start - (first == _MINUS) > MAX_INT_DIGITS:
        return None
    raw = buf[start:end]
    # A valid JSON number is an integer unless it has a fraction or an exponent.
    if raw.find(b".") >= 0 or raw.find(b"e") >= 0 or raw.find(b"E") >= 0:
        return None
    return int(raw)


def _max_tokens_at(buf: bytes, span: Span | None, key: str) -> int | None:
    """``max_tokens`` / ``max_completion_tokens``: an integer (not a bool) or null."""
    value = _int_at(buf, span)
    if value is None and span is not None:
        start, end = span
        first = buf[start]
        if first == _NULL:
            return None
        if (first == _MINUS or 0x30 <= first <= 0x39) and end - start - (first == _MINUS) > MAX_INT_DIGITS:
            raise too_many_digits(key)
        raise must_be(key, AN_INTEGER)
    return value


def read_client_request(body: bytes | bytearray | memoryview, chat: bool) -> ClientScan:
    """Validate a client body and read what the orchestrator needs of it, in one pass.

    ``chat``: the route (``/v1/chat/completions``). Raises ``JSONSpanError`` (malformed, or a
    repeated key the relay reads) or ``RelayError`` with the 400's message and ``field``: not an
    object, an internal field, a small field of the wrong type (``stream``, ``stream_options``,
    ``include_usage``, ``model``, ``max_tokens``, ``max_completion_tokens``), no ``messages``
    element (chat) or no ``prompt`` (completions), a token limit below 1.
    """
    buf = _as_bytes(body)
    chat = bool(chat)
    spans = tuple(find_spans(buf, CLIENT_REQUEST_PATHS))
    root = spans[C_ROOT]
    assert root is not None  # a scan that succeeds has the document's span
    if buf[root[0]] != _OPEN_OBJECT:
        raise not_an_object(REQUEST_BODY)
    check_internal_fields(spans, chat)
    stream = _bool_at(buf, spans[C_STREAM], P.STREAM)
    include_usage = None
    options = spans[C_STREAM_OPTIONS]
    if options is not None:
        first = buf[options[0]]
        if first == _OPEN_OBJECT:
            include_usage = _bool_at(buf, spans[C_INCLUDE_USAGE], P.INCLUDE_USAGE)
        elif first != _NULL:
            raise must_be(P.STREAM_OPTIONS, AN_OBJECT)
    model = _str_at(buf, spans[C_MODEL], P.MODEL)
    if chat:
        if spans[C_LAST_MESSAGE] is None:  # absent, not an array, or empty
            raise must_be(P.MESSAGES, A_NON_EMPTY_ARRAY)
        # Both are checked (as a request model would); the first set one counts.
        completion = _max_tokens_at(buf, spans[C_MAX_COMPLETION_TOKENS], P.MAX_COMPLETION_TOKENS)
        tokens = _max_tokens_at(buf, spans[C_MAX_TOKENS], P.MAX_TOKENS)
        key, value = (
            (P.MAX_COMPLETION_TOKENS, completion) if completion is not None else (P.MAX_TOKENS, tokens)
        )
    else:
        prompt = spans[C_PROMPT]
        if prompt is None or buf[prompt[0]] not in (_QUOTE, _OPEN_ARRAY):
            raise must_be(P.PROMPT, A_STRING_OR_ARRAY)
        key, value = P.MAX_TOKENS, _max_tokens_at(buf, spans[C_MAX_TOKENS], P.MAX_TOKENS)
    if value is not None and value < 1:
        raise below_one(key, value)
    return ClientScan(buf, chat, spans, _is_empty(buf, root), bool(stream), bool(include_usage), value, model)


def _client_scan(client: object) -> ClientScan:
    if type(client) is not ClientScan:
        raise not_a_scan("client", "ClientScan", client)
    return client


def _context_scan(context: object) -> ContextScan:
    if type(context) is not ContextScan:
        raise not_a_scan("context", "ContextScan", context)
    return context


#: A leg's body piece: ``bytes`` (new text, short runs) or a ``memoryview`` of a scan's body.
Piece = bytes | memoryview
#: The pieces forms view a run of a body this long or longer; shorter runs are copied, joined with
#: the new text around them (a view and its iovec cost more than copying a few hundred bytes).
VIEW_MIN = 2048


def context_request(client: ClientScan, disagg_request_id: int, return_b64: bool) -> bytes:
    """Leg (1) from a read client body: ``stream`` false, ``stream_options`` null, and
    ``disaggregated_params`` (context_only, the id, ``return_prompt_token_ids_b64`` if asked) added.
    The join of :func:`context_request_pieces`."""
    return b"".join(context_request_pieces(client, disagg_request_id, return_b64))


def context_request_pieces(client: ClientScan, disagg_request_id: int, return_b64: bool) -> list[Piece]:
    """Leg (1) as the pieces whose concatenation is :func:`context_request`'s bytes, for one vectored
    write: the untouched runs of the client body (``VIEW_MIN`` bytes or more) as memoryviews of
    ``client.body``, the new text and shorter runs joined into small ``bytes``. A view holds a reference to the (immutable) ``bytes`` it views, so the
    pieces stay valid as long as they are held, whatever happens to the scan; a caller holds them
    until the leg's write is done (the upstream connection's writelines, a retry's)."""
    client = _client_scan(client)
    if isinstance(disagg_request_id, bool) or not isinstance(disagg_request_id, int):
        raise not_an_id()
    spans = client.spans
    edits: list[tuple[int, int, Piece | list[Piece]]] = []
    added: list[bytes] = []
    for index, key, value in (
        (C_STREAM, STREAM_KEY, b"false"),
        (C_STREAM_OPTIONS, STREAM_OPTIONS_KEY, b"null"),
    ):
        span = spans[index]
        if span is None:
            added.append(key + value)
        else:
            edits.append((span[0], span[1], value))
    added.append(CONTEXT_PARAMS_OPEN + b"%d" % disagg_request_id + (ASK_B64 if return_b64 else b"") + b"}")
    edits.sort()
    text = b",".join(added)
    root = spans[C_ROOT]
    assert root is not None
    edits.append((root[1] - 1, root[1] - 1, text if client.empty else b"," + text))
    return _splice_pieces(client.body, edits)


def _splice_pieces(body: bytes, edits: list[tuple[int, int, Piece | list[Piece]]]) -> list[Piece]:
    """The pieces of ``splice(body, edits)`` (edits sorted and apart, as the kernels make them): the
    runs of ``body`` around the edits and each replacement (a piece, or a list of pieces), where
    every view of ``VIEW_MIN`` bytes or more stays a view and the pieces between are joined into
    one ``bytes``."""
    view = memoryview(body)
    pieces: list[Piece] = []
    previous = 0
    for start, end, replacement in edits:
        if start > previous:
            pieces.append(view[previous:start])
        if isinstance(replacement, list):
            pieces += [piece for piece in replacement if len(piece)]
        elif len(replacement):
            pieces.append(replacement)
        previous = end
    if previous < len(body):
        pieces.append(view[previous:])
    out: list[Piece] = []
    small: list[Piece] = []
    for piece in pieces:
        if type(piece) is memoryview and len(piece) >= VIEW_MIN:
            if small:
                out.append(b"".join(small))
                small = []
            out.append(piece)
        else:
            small.append(piece)
    if small:
        out.append(b"".join(small))
    return out


def read_context_response(body: bytes | bytearray | memoryview, max_tokens: int | None) -> ContextScan:
    """Validate a context response and decide whether a generation leg follows, in one pass.

    ``max_tokens``: the client's limit (``finish_reason`` "length" with ``usage.completion_tokens``
    already at it is the answer). Raises ``JSONSpanError`` (malformed, a repeated key the relay
    reads) or ``RelayError`` with the 502's message: not an object, a ``finish_reason`` that is not
    a string, no ``choices[0]``, or no ``disaggregated_params`` object when a generation leg follows.
    """
    buf = _as_bytes(body)
    spans = tuple(find_spans(buf, CONTEXT_RESPONSE_PATHS))
    root = spans[X_ROOT]
    assert root is not None
    if buf[root[0]] != _OPEN_OBJECT:
        raise context_refusal(CTX_NOT_AN_OBJECT)
    finish_reason: str | None = None
    finish = spans[X_FINISH]
    if finish is not None:
        raw = buf[finish[0] : finish[1]]
        if raw in COMMON_FINISH_REASONS:
            finish_reason = COMMON_FINISH_REASONS[raw]
        elif raw[0] == _QUOTE:
            finish_reason = json.loads(raw)  # a short string with escapes: the stdlib decodes them right
        else:
            raise context_refusal(CTX_FINISH_NOT_A_STRING, P.FINISH_REASON)
    if spans[X_FIRST_CHOICE] is None:
        raise no_first_choice()
    follows = finish_reason in P.GENERATION_FOLLOWS
    if follows and finish_reason == P.FINISH_LENGTH and max_tokens is not None:
        # Our context worker says "length" when the client's max_tokens is 1: that leg already
        # produced everything the client asked for.
        completion_tokens = _int_at(buf, spans[X_COMPLETION_TOKENS])
        if completion_tokens is not None:
            follows = completion_tokens < max_tokens
    params = spans[X_DP]
    if follows and (params is None or buf[params[0]] != _OPEN_OBJECT):
        raise lacks_params()
    return ContextScan(buf, spans, finish_reason, not follows)


def generation_request(
    client: ClientScan, context: ContextScan, tokids_b64: bool, strip_history: bool
) -> bytes:
    """Leg (3) as one ``bytes``: the join of :func:`generation_request_pieces` (which says what it is)."""
    return b"".join(generation_request_pieces(client, context, tokids_b64, strip_history))


def generation_request_pieces(
    client: ClientScan, context: ContextScan, tokids_b64: bool, strip_history: bool
) -> list[Piece]:
    """Leg (3): the client's body plus the context leg's ``disaggregated_params`` (``request_type``
    generation_only, ``ctx_usage`` the context leg's ``usage``) and prompt ids, as the pieces whose
    concatenation is :func:`generation_request`'s bytes: the untouched runs (``VIEW_MIN`` bytes or
    more) of the client body and of the context response (its prompt ids, base64 or list, among
    them) as memoryviews of ``client.body`` and ``context.body``, the new text and shorter runs
    joined into small ``bytes``: no long run of either body is copied. Each view holds a reference to the immutable ``bytes`` it views: the pieces stay valid
    while held, and the caller holds them until the leg's write is done (retries included).

    ``tokids_b64`` (gate ``gen_tokids_ctxbytes``): the context response's ``prompt_token_ids_b64``
    string, checked and copied verbatim, or, when the worker answered with the list only, the list
    (:func:`_token_b64`); otherwise its ``prompt_token_ids`` list as
    ``prompt_token_ids`` (chat) or ``prompt`` (completions). ``strip_history`` (gate
    ``gen_strip_message_history``): chat ``messages`` keeps its last element. Raises ``RelayError``
    with the 502's message when the context response lacks what the leg needs.
    """
    client = _client_scan(client)
    context = _context_scan(context)
    body, spans, ctx, found = client.body, client.spans, context.body, context.spans
    view = memoryview(ctx)
    params = found[X_DP]
    if params is None or ctx[params[0]] != _OPEN_OBJECT:
        raise context_refusal(CTX_NO_PARAMS_OBJECT, P.DISAGGREGATED_PARAMS)
    usage_span = found[X_USAGE]
    usage = ctx[usage_span[0] : usage_span[1]] if usage_span is not None else b"null"
    replaced: list[tuple[int, int, bytes]] = []
    added: list[bytes] = []
    request_type, ctx_usage = found[X_REQUEST_TYPE], found[X_CTX_USAGE]
    if request_type is None:
        added.append(REQUEST_TYPE_KEY + GENERATION_ONLY)
    else:
        replaced.append((request_type[0], request_type[1], GENERATION_ONLY))
    if ctx_usage is None:
        added.append(CTX_USAGE_KEY + usage)
    else:
        replaced.append((ctx_usage[0], ctx_usage[1], usage))
    replaced.sort()
    pieces: list[Piece] = [DISAGGREGATED_PARAMS_KEY if client.empty else b"," + DISAGGREGATED_PARAMS_KEY]
    previous = params[0]
    for start, end, replacement in replaced:
        pieces += [view[previous:start], replacement]
        previous = end
    if added:
        pieces.append(view[previous : params[1] - 1])
        if not _is_empty(ctx, params):
            pieces.append(b",")
        pieces += [b",".join(added), b"}"]
    else:
        pieces.append(view[previous : params[1]])
    edits: list[tuple[int, int, Piece | list[Piece]]] = []
    b64 = _token_b64(ctx, found) if tokids_b64 else None
    if b64 is not None:
        pieces += [b"," + PROMPT_TOKEN_IDS_B64_KEY, view[b64[0] : b64[1]]]
    else:
        ids = found[X_IDS]
        if ids is None or ctx[ids[0]] != _OPEN_ARRAY:
            raise context_refusal(CTX_NO_IDS, P.PROMPT_TOKEN_IDS)
        prompt = spans[C_PROMPT]
        if client.chat:
            pieces += [b"," + PROMPT_TOKEN_IDS_KEY, view[ids[0] : ids[1]]]
        elif prompt is not None:
            edits.append((prompt[0], prompt[1], view[ids[0] : ids[1]]))
        else:
            pieces += [b"," + PROMPT_KEY, view[ids[0] : ids[1]]]
    messages, last_message = spans[C_MESSAGES], spans[C_LAST_MESSAGE]
    if strip_history and client.chat and messages is not None and last_message is not None:
        # Cut everything before and after the last element; keep its raw bytes.
        edits.append((messages[0], last_message[0], b"["))
        edits.append((last_message[1], messages[1], b"]"))
    root = spans[C_ROOT]
    assert root is not None
    edits.append((root[1] - 1, root[1] - 1, pieces))
    return _splice_pieces(body, edits)


def _token_b64(ctx: bytes, found: tuple[Span | None, ...]) -> Span | None:
    """The checked ``prompt_token_ids_b64`` string of a context response (gate on), or ``None`` for
    the list fallback: a worker asked for base64 that answers with the ``prompt_token_ids`` list only
    (``prompt_token_ids_b64`` absent or null, as trtllm-serve's completions and its chat responses
    when not asked) is relayed with the list (docs/protocol.md (2)). ``RelayError`` (502): neither form,
    a ``prompt_token_ids_b64`` that is not a string, or not valid token base64."""
    b64 = found[X_B64]
    if b64 is None or ctx[b64[0]] == _NULL:
        ids = found[X_IDS]
        if ids is not None and ctx[ids[0]] == _OPEN_ARRAY:
            return None
    if b64 is None or ctx[b64[0]] != _QUOTE:
        raise context_refusal(CTX_NO_B64, P.PROMPT_TOKEN_IDS_B64)
    try:
        check_token_b64(ctx, b64[0] + 1, b64[1] - 1)
    except TokenDecodeError as exc:
        raise bad_b64(exc) from exc
    return b64


def strip_internal_fields(body: bytes | bytearray | memoryview, validate: bool = True) -> bytes:
    """``body`` (a worker's response) without ``disaggregated_params`` in any choice and without
    top-level ``prompt_token_ids`` / ``prompt_token_ids_b64``; ``body`` itself (when ``bytes``) if
    there is nothing to cut.

    The scan validates the whole body; ``validate=False`` (see ``find_spans``) is for bytes the
    caller has validated. Raises ``JSONSpanError``, or ``RelayError`` if the body is not an object.
    """
    buf = _as_bytes(body)
    choices = 8
    while True:
        spans = find_member_spans(buf, strip_paths(choices), validate=validate)
        if spans[3] is None:
            break
        choices *= 4  # more choices than asked for: rare (n > 8), scan again
    root = spans[0]
    assert root is not None
    if buf[root[0]] != _OPEN_OBJECT:
        raise not_an_object(RESPONSE_BODY)
    members = sorted(span for span in spans[1:3] + spans[4:] if span is not None)
    if not members:
        return buf
    return splice(buf, _deletions(buf, members))


def _deletions(buf: bytes, members: list[Span]) -> list[tuple[int, int, bytes]]:
    """Edits deleting ``members`` (key-to-value spans, sorted) and exactly the commas they leave."""
    runs: list[list[int]] = []
    for start, end in members:
        if runs and _MEMBER_SEPARATOR.fullmatch(buf, runs[-1][1], start):
            runs[-1][1] = end  # adjacent members of one object go as one run
        else:
            runs.append([start, end])
    edits = []
    for start, end in runs:
        after = _skip_ws(buf, end)
        if buf[after] == _COMMA:  # not the last member: take the comma after the run
            edits.append((start, _skip_ws(buf, after + 1), b""))
            continue
        comma = buf.rfind(b",", 0, start)
        if comma >= 0 and _WS.fullmatch(buf, comma + 1, start):
            edits.append((comma, end, b""))  # the last member: take the comma before it
        else:
            edits.append((start, end, b""))  # the only member
    return edits


__all__ = [
    "CLIENT_PATHS",
    "CLIENT_REQUEST_PATHS",
    "CONTEXT_PATHS",
    "CONTEXT_RESPONSE_PATHS",
    "MAX_COUNT_DIGITS",
    "ClientScan",
    "ContextScan",
    "context_request",
    "context_request_pieces",
    "generation_request",
    "generation_request_pieces",
    "read_client_request",
    "read_context_response",
    "strip_internal_fields",
    "strip_paths",
]
