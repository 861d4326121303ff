"""Zero-parse relay: build the bodies of docs/protocol.md legs (1) and (3) from raw bytes.

The orchestrator never turns a body into Python objects. One scanner pass
per body finds the byte spans it needs; one :func:`splice` writes the output.
The token field (tens of thousands of ids) is copied as bytes, never decoded:
with the ``gen_tokids_ctxbytes`` gate on, the ``prompt_token_ids_b64`` string
of the context response reaches the generation worker byte for byte, after a
check of its alphabet, padding and length.

Errors:

- :class:`fastcore.JSONSpanError` (a ``ValueError`` with ``offset``): the body is
  not valid JSON, or repeats a key the relay needs.
- :class:`fastcore.RelayError` (``field`` names the field): a client body the
  relay refuses (not an object, internal fields). The orchestrator answers 400.
- :class:`ContextResponseError` (a ``RelayError``): the context worker's
  response cannot be relayed. The orchestrator answers 502; a malformed
  context response raises this too, with the ``JSONSpanError`` as its cause.

An orchestrator reads each client body once (:func:`read_client_body`) and
hands the result to both legs; the builders also take raw bytes.

The relay kernels (``client_kernel``, ``context_request_kernel``,
``context_kernel``, ``generation_request_kernel``, ``strip_kernel``; the
scanner twin's ``read_client_request``, ``context_request``...) are the same
work as one call per body, for the orchestrator's hot path: the scan, the
checks, the small fields it acts on and the output bytes, in C with no Python
objects in between (server/orchestrator/relay_modes.FastRelay uses them; their
errors carry its HTTP messages). The builders here produce the same bytes.

The module-level functions use the active scanner twin (``fastcore.backend``);
``Relay(scanner_module)`` binds another one (the tests run both).
"""

from __future__ import annotations

import json
import re
from types import ModuleType
from typing import NamedTuple

from . import _jsonspan_impl, protocol
from . import _jsonspan_py as _paths
from .errors import JSONSpanError, RelayError, TokenDecodeError

Span = tuple[int, int]
BytesLike = bytes | bytearray | memoryview

#: Fields only the orchestrator may set (``fastcore.protocol`` says which on which route).
INTERNAL_FIELDS = protocol.INTERNAL_FIELDS

#: Context-leg finish reasons after which a generation leg follows (docs/protocol.md (2)).
GENERATION_FOLLOWS = frozenset(protocol.GENERATION_FOLLOWS)
_COMMON_FINISH_REASONS = _paths._COMMON_FINISH_REASONS

_WS = re.compile(rb"[ \t\n\r]*")

# The scanner paths and their indexes: one definition (the pure scanner twin's), shared by both twins'
# relay kernels and the functions here. Everything either leg needs from a client body, in one pass:
_CLIENT_PATHS = _paths.CLIENT_PATHS
#: Leg (1)'s ``disaggregated_params`` as JSON text, built from the protocol's names.
_DISAGGREGATED_PARAMS = protocol.DISAGGREGATED_PARAMS.encode()
_CONTEXT_PARAMS_OPEN = (
    f'{{"{protocol.REQUEST_TYPE}":"{protocol.CONTEXT_ONLY}","{protocol.DISAGG_REQUEST_ID}":'.encode() + b"%d"
)
_ASK_B64 = f',"{protocol.RETURN_PROMPT_TOKEN_IDS_B64}":true'.encode()

_ROOT, _MESSAGES, _DISAGG, _B64, _IDS, _STREAM, _STREAM_OPTIONS, _PROMPT, _LAST_MESSAGE = range(9)
# read_client_request: the same, plus the small fields an orchestrator acts on, in the same pass.
_CLIENT_REQUEST_PATHS = _paths.CLIENT_REQUEST_PATHS
_MODEL, _MAX_TOKENS, _MAX_COMPLETION_TOKENS, _INCLUDE_USAGE = range(9, 13)
_CONTEXT_PATHS = _paths.CONTEXT_PATHS
# read_context_response: the same, plus what an orchestrator checks before relaying, in the same pass.
_CONTEXT_RESPONSE_PATHS = _paths.CONTEXT_RESPONSE_PATHS
# strip_internal_fields' paths for the first ``choices`` choices, built once per count.
_strip_paths = _paths.strip_paths


class ClientBody(NamedTuple):
    """A client body checked and scanned once (:meth:`Relay.read_client_body`), for both legs."""

    body: BytesLike
    chat: bool
    #: spans of ``_CLIENT_PATHS``
    spans: tuple[Span | None, ...]
    #: the object has no members (fields are then added without a leading comma)
    empty: bool


class ClientFields(NamedTuple):
    """Spans of the small client fields an orchestrator acts on (:meth:`Relay.read_client_request`).

    Half-open byte ranges of raw JSON values in the validated body (``None``:
    absent). The first byte of a span says its type; a scalar is decoded by
    slicing it out. Each key is unique in its object (a repeat is refused).
    """

    stream: Span | None
    stream_options: Span | None
    #: ``stream_options.include_usage`` (only when ``stream_options`` is an object)
    include_usage: Span | None
    model: Span | None
    max_tokens: Span | None
    max_completion_tokens: Span | None
    messages: Span | None
    #: ``messages[-1]``: ``None`` unless ``messages`` is a non-empty array
    last_message: Span | None
    prompt: Span | None


class ContextFields(NamedTuple):
    """Spans an orchestrator checks in a context response (:meth:`Relay.read_context_response`)."""

    #: ``choices[0]``: ``None`` unless ``choices`` is a non-empty array
    first_choice: Span | None
    #: ``usage.completion_tokens`` (only when ``usage`` is an object)
    completion_tokens: Span | None


class ContextResponseError(RelayError):
    """The context worker's response cannot be relayed (the orchestrator's 502)."""


class ContextResponseInfo(NamedTuple):
    """What the orchestrator reads from a context response: small fields as objects, the rest as spans.

    Spans are half-open byte ranges of raw JSON values in the response body
    (``None``: absent).
    """

    finish_reason: str | None
    #: ``finish_reason`` is ``"length"`` or ``"not_finished"``: a generation leg follows.
    generation_follows: bool
    #: ``choices[0].disaggregated_params``
    disaggregated_params: Span | None
    usage: Span | None
    #: top-level ``prompt_token_ids`` (may be the span of ``null`` when the b64 form is used)
    prompt_token_ids: Span | None
    prompt_token_ids_b64: Span | None
    #: ``choices[0].disaggregated_params.request_type`` / ``.ctx_usage``: rewritten for leg (3)
    request_type: Span | None
    ctx_usage: Span | None


def _is_object(body: BytesLike, span: Span | None) -> bool:
    return span is not None and body[span[0]] == 0x7B  # '{'


def _is_empty_container(body: BytesLike, span: Span) -> bool:
    return _WS.match(body, span[0] + 1).end() == span[1] - 1  # type: ignore[union-attr]


def _edit_start(edit: tuple[int, int, object]) -> int:
    return edit[0]


def _member(name: bytes, value: bytes) -> bytes:
    return b'"' + name + b'":' + value


class Relay:
    """The relay functions bound to one scanner twin (a module with ``find_spans`` etc.)."""

    def __init__(self, scanner: ModuleType) -> None:
        self.scanner = scanner
        self._find_spans = scanner.find_spans
        self._find_member_spans = scanner.find_member_spans
        self._splice = scanner.splice
        self._check_token_b64 = scanner.check_token_b64
        self._strip_internal_fields = scanner.strip_internal_fields
        # The orchestrator's relay kernels (one call per body; see the scanner's "relay kernels"):
        #: ``(body, chat) -> ClientScan``
        self.client_kernel = scanner.read_client_request
        #: ``(ClientScan, disagg_request_id, return_b64) -> bytes``: leg (1)
        self.context_request_kernel = scanner.context_request
        #: ``(body, max_tokens) -> ContextScan``
        self.context_kernel = scanner.read_context_response
        #: ``(ClientScan, ContextScan, tokids_b64, strip_history) -> bytes``: leg (3)
        self.generation_request_kernel = scanner.generation_request
        #: ``(body, validate) -> bytes``
        self.strip_kernel = scanner.strip_internal_fields

    # -- client bodies --------------------------------------------------------------------------

    def read_client_body(
        self, body: BytesLike, *, chat: bool | None = None, validate: bool = True
    ) -> ClientBody:
        """Validate ``body`` and find what both legs need, once.

        Raises :class:`fastcore.JSONSpanError` (malformed, or a repeated key the
        relay uses) or :class:`fastcore.RelayError` (not an object; an internal
        field). ``chat`` says which route the body came in on; pass it (``None``
        guesses from the presence of ``messages``, which a client controls).
        ``validate=False``: as in :meth:`parse_context_response`.
        """
        return self._read_client(body, _CLIENT_PATHS, chat, validate)

    def read_client_request(
        self, body: BytesLike, *, chat: bool | None = None
    ) -> tuple[ClientBody, ClientFields]:
        """:meth:`read_client_body` (validating) plus the spans of the small fields an
        orchestrator checks (``stream``, ``model``, ``max_tokens``...), all in the same one pass.

        Raises as :meth:`read_client_body`, and also for a repeated ``model``,
        ``max_tokens``, ``max_completion_tokens`` or ``stream_options.include_usage``
        key. The :class:`ClientBody` serves both builders as
        :meth:`read_client_body`'s does.
        """
        client = self._read_client(body, _CLIENT_REQUEST_PATHS, chat, True)
        spans = client.spans
        return client, ClientFields(
            spans[_STREAM],
            spans[_STREAM_OPTIONS],
            spans[_INCLUDE_USAGE],
            spans[_MODEL],
            spans[_MAX_TOKENS],
            spans[_MAX_COMPLETION_TOKENS],
            spans[_MESSAGES],
            spans[_LAST_MESSAGE],
            spans[_PROMPT],
        )

    def _read_client(
        self, body: BytesLike, paths: tuple[tuple[str | int, ...], ...], chat: bool | None, validate: bool
    ) -> ClientBody:
        # ``paths`` starts with _CLIENT_PATHS: the builders index the spans by its constants.
        spans = tuple(self._find_spans(body, paths, validate=validate))
        if not _is_object(body, spans[_ROOT]):
            raise RelayError("the request body must be a JSON object")
        if chat is None:
            chat = spans[_MESSAGES] is not None
        _paths.check_internal_fields(spans, chat)
        root = spans[_ROOT]
        assert root is not None
        return ClientBody(body, chat, spans, _is_empty_container(body, root))

    def _client(self, client_body: BytesLike | ClientBody, chat: bool | None) -> ClientBody:
        if isinstance(client_body, ClientBody):
            return client_body
        return self.read_client_body(client_body, chat=chat)

    def check_client_body(self, body: BytesLike, *, chat: bool) -> None:
        """Raise unless ``body`` is a JSON object free of internal fields (docs/protocol.md, "Rules")."""
        self.read_client_body(body, chat=chat)

    def build_context_request(
        self,
        client_body: BytesLike | ClientBody,
        *,
        disagg_request_id: int,
        return_b64: bool,
        chat: bool | None = None,
    ) -> bytes:
        """Leg (1): the client's body with ``stream`` false, ``stream_options`` null, and
        ``disaggregated_params`` added.

        ``client_body``: raw bytes (``chat`` as in :meth:`read_client_body`), or
        the :class:`ClientBody` read from them, which spares this leg and the
        next a scan.
        """
        if isinstance(disagg_request_id, bool) or not isinstance(disagg_request_id, int):
            raise TypeError("disagg_request_id must be an int")
        client = self._client(client_body, chat)
        body, spans = client.body, client.spans
        root = spans[_ROOT]
        assert root is not None
        edits: list[tuple[int, int, bytes]] = []
        added: list[bytes] = []
        for span, name, value in (
            (spans[_STREAM], b"stream", b"false"),
            (spans[_STREAM_OPTIONS], b"stream_options", b"null"),
        ):
            if span is None:
                added.append(_member(name, value))
            else:
                edits.append((span[0], span[1], value))
        params = _CONTEXT_PARAMS_OPEN % disagg_request_id
        if return_b64:
            params += _ASK_B64
        added.append(_member(_DISAGGREGATED_PARAMS, params + b"}"))
        edits.sort()
        text = b",".join(added)
        edits.append((root[1] - 1, root[1] - 1, text if client.empty else b"," + text))
        return self._splice(body, edits)

    # -- context responses ----------------------------------------------------------------------

    def parse_context_response(
        self, ctx_response: BytesLike, *, validate: bool = True
    ) -> ContextResponseInfo:
        """Read leg (2): finish reason and the spans leg (3) needs, in one validating pass.

        ``validate=False`` is for a caller that has just validated the same bytes
        (with a full parser, or a validating scan of its own): the scan then
        checks only the containers on the relay's paths (3x faster on an id
        list) and still never reads out of bounds.
        """
        try:
            spans = self._find_spans(ctx_response, _CONTEXT_PATHS, validate=validate)
        except JSONSpanError as exc:
            raise ContextResponseError(f"context response is not valid JSON: {exc}") from exc
        return self._context_info(ctx_response, spans)

    def read_context_response(self, ctx_response: BytesLike) -> tuple[ContextResponseInfo, ContextFields]:
        """:meth:`parse_context_response` (validating) plus the spans of ``choices[0]`` and
        ``usage.completion_tokens``, in the same one pass.

        Raises as :meth:`parse_context_response` (a malformed body: a
        :class:`ContextResponseError` whose cause is the ``JSONSpanError``),
        and also for a repeated ``completion_tokens`` key in ``usage``.
        """
        try:
            spans = self._find_spans(ctx_response, _CONTEXT_RESPONSE_PATHS)
        except JSONSpanError as exc:
            raise ContextResponseError(f"context response is not valid JSON: {exc}") from exc
        count = len(_CONTEXT_PATHS)
        return self._context_info(ctx_response, spans), ContextFields(spans[count], spans[count + 1])

    @staticmethod
    def _context_info(ctx_response: BytesLike, spans: list[Span | None]) -> ContextResponseInfo:
        # ``spans`` starts with those of _CONTEXT_PATHS.
        root, finish, dp, usage, ids, b64, request_type, ctx_usage = spans[: len(_CONTEXT_PATHS)]
        if not _is_object(ctx_response, root):
            raise ContextResponseError("context response is not a JSON object")
        finish_reason: str | None = None
        if finish is not None:
            raw = bytes(ctx_response[finish[0] : finish[1]])
            if raw in _COMMON_FINISH_REASONS:
                finish_reason = _COMMON_FINISH_REASONS[raw]
            elif raw[:1] == b'"':
                finish_reason = json.loads(raw)  # a short string with escapes: the stdlib decodes them right
            else:
                raise ContextResponseError(
                    "context response: choices[0].finish_reason is not a string", field=protocol.FINISH_REASON
                )
        return ContextResponseInfo(
            finish_reason, finish_reason in GENERATION_FOLLOWS, dp, usage, ids, b64, request_type, ctx_usage
        )

    @staticmethod
    def _generation_params(
        ctx: BytesLike, view: memoryview, info: ContextResponseInfo
    ) -> list[bytes | memoryview]:
        """Leg (3)'s ``disaggregated_params`` as pieces: views of the context response and short bytes."""
        dp = info.disaggregated_params
        if not _is_object(ctx, dp):
            raise ContextResponseError(
                "context response has no choices[0].disaggregated_params object",
                field=protocol.DISAGGREGATED_PARAMS,
            )
        assert dp is not None
        usage = view[info.usage[0] : info.usage[1]] if info.usage is not None else b"null"
        replaced: list[tuple[int, int, bytes | memoryview]] = []
        added: list[bytes] = []
        if info.request_type is None:
            added.append(b'"request_type":"generation_only"')
        else:
            replaced.append((info.request_type[0], info.request_type[1], b'"generation_only"'))
        if info.ctx_usage is None:
            added.append(b'"ctx_usage":' + bytes(usage))
        else:
            replaced.append((info.ctx_usage[0], info.ctx_usage[1], usage))
        if len(replaced) > 1:
            replaced.sort(key=_edit_start)
        pieces: list[bytes | memoryview] = []
        previous = dp[0]
        for start, end, replacement in replaced:
            pieces += [view[previous:start], replacement]
            previous = end
        if not added:
            pieces.append(view[previous : dp[1]])
            return pieces
        pieces.append(view[previous : dp[1] - 1])
        if not _is_empty_container(ctx, dp):
            pieces.append(b",")
        pieces += [b",".join(added), b"}"]
        return pieces

    def build_generation_request(
        self,
        client_body: BytesLike | ClientBody,
        ctx_response: BytesLike,
        *,
        tokids_b64: bool,
        strip_history: bool,
        chat: bool | None = None,
        ctx_info: ContextResponseInfo | None = None,
    ) -> bytes:
        """Leg (3): the client's body plus the context leg's ``disaggregated_params`` and prompt ids.

        ``tokids_b64`` (gate ``gen_tokids_ctxbytes``): relay the context
        response's ``prompt_token_ids_b64`` string verbatim (both routes), or
        the list when the response has only the list (absent or null base64);
        otherwise splice its ``prompt_token_ids`` list in as ``prompt_token_ids``
        (chat) or as ``prompt`` (completions). ``strip_history`` (gate
        ``gen_strip_message_history``): ``messages`` keeps its last element.
        ``client_body``: raw bytes or their :class:`ClientBody`; ``ctx_info``:
        the result of :meth:`parse_context_response` on ``ctx_response``. Each
        spares a scan the caller already paid for.
        """
        info = ctx_info if ctx_info is not None else self.parse_context_response(ctx_response)
        client = self._client(client_body, chat)
        body, chat, spans, empty = client
        prompt, last_message = spans[_PROMPT], spans[_LAST_MESSAGE]
        root = spans[_ROOT]
        assert root is not None
        ctx_view = memoryview(ctx_response)
        edits: list[tuple[int, int, object]] = []
        # Small pieces are joined into one short bytes object; the ids stay a
        # view into the context response until splice's single copy.
        small: list[bytes | memoryview] = [
            b'"disaggregated_params":' if empty else b',"disaggregated_params":'
        ]
        small += self._generation_params(ctx_response, ctx_view, info)
        ids_view: memoryview | None = None

        b64 = info.prompt_token_ids_b64
        ids = info.prompt_token_ids
        if (b64 is None or ctx_response[b64[0]] == 0x6E) and ids is not None and ctx_response[ids[0]] == 0x5B:
            tokids_b64 = False  # asked for base64, got the list: relay the list (docs/protocol.md (2))
        if tokids_b64:
            if b64 is None or ctx_response[b64[0]] != 0x22:  # '"'
                raise ContextResponseError(
                    "context response has no prompt_token_ids_b64 string (is the context worker's "
                    "return_prompt_token_ids_b64 support on?) and no prompt_token_ids list",
                    field=protocol.PROMPT_TOKEN_IDS_B64,
                )
            try:
                self._check_token_b64(ctx_response, b64[0] + 1, b64[1] - 1)
            except TokenDecodeError as exc:
                raise ContextResponseError(
                    f"context response: invalid prompt_token_ids_b64: {exc}",
                    field=protocol.PROMPT_TOKEN_IDS_B64,
                ) from exc
            small.append(b',"prompt_token_ids_b64":')
            ids_view = ctx_view[b64[0] : b64[1]]
        else:
            if ids is None or ctx_response[ids[0]] != 0x5B:  # '['
                raise ContextResponseError(
                    "context response has no prompt_token_ids list", field=protocol.PROMPT_TOKEN_IDS
                )
            if chat:
                small.append(b',"prompt_token_ids":')
                ids_view = ctx_view[ids[0] : ids[1]]
            elif prompt is not None:
                edits.append((prompt[0], prompt[1], ctx_view[ids[0] : ids[1]]))
            else:
                small.append(b',"prompt":')
                ids_view = ctx_view[ids[0] : ids[1]]

        messages = spans[_MESSAGES]
        if strip_history and chat and messages is not None and last_message is not None:
            # Cut everything before and after the last element; keep its raw bytes.
            edits.append((messages[0], last_message[0], b"["))
            edits.append((last_message[1], messages[1], b"]"))
            if len(edits) > 2:
                edits.sort(key=_edit_start)

        insert_at = root[1] - 1
        edits.append((insert_at, insert_at, b"".join(small)))
        if ids_view is not None:
            edits.append((insert_at, insert_at, ids_view))
        return self._splice(body, edits)

    # -- responses to clients -------------------------------------------------------------------

    def strip_internal_fields(self, body: BytesLike, *, validate: bool = True) -> bytes:
        """``body`` (a worker's response) without ``disaggregated_params`` in any choice and
        without top-level ``prompt_token_ids`` / ``prompt_token_ids_b64``.

        The scan validates the whole body; ``validate=False`` (as in
        :meth:`parse_context_response`) is for bytes the caller has validated.
        Returns ``body`` itself (when ``bytes``) if there is nothing to cut.
        """
        return self._strip_internal_fields(body, validate)


_default = Relay(_jsonspan_impl)

read_client_body = _default.read_client_body
read_client_request = _default.read_client_request
read_context_response = _default.read_context_response
check_client_body = _default.check_client_body
build_context_request = _default.build_context_request
build_generation_request = _default.build_generation_request
parse_context_response = _default.parse_context_response
strip_internal_fields = _default.strip_internal_fields
client_kernel = _default.client_kernel
context_request_kernel = _default.context_request_kernel
context_kernel = _default.context_kernel
generation_request_kernel = _default.generation_request_kernel
strip_kernel = _default.strip_kernel

__all__ = [
    "GENERATION_FOLLOWS",
    "INTERNAL_FIELDS",
    "ClientBody",
    "ClientFields",
    "ContextFields",
    "ContextResponseError",
    "ContextResponseInfo",
    "Relay",
    "build_context_request",
    "build_generation_request",
    "check_client_body",
    "parse_context_response",
    "read_client_body",
    "read_client_request",
    "read_context_response",
    "strip_internal_fields",
]
