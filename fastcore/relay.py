"""Zero-parse relay: the bodies of docs/protocol.md legs (1) and (3) from raw bytes, one call per body.

The functions here are the relay kernels of the active twin (``fastcore._relay``, compiled, or its
pure twin ``fastcore._relay_py``, which documents them): the very code the orchestrator's fast
relay runs. Each makes one validating pass of the span scanner over its body, decodes the few small
fields it acts on from their bytes, and writes its output with one allocation (or, in the pieces
forms, as views of its inputs). The token field (tens
of thousands of ids) is copied as bytes, never decoded: with ``tokids_b64`` (gate
``gen_tokids_ctxbytes``) the ``prompt_token_ids_b64`` string of the context response reaches the
generation worker byte for byte, after a check of its alphabet, padding and length.

- :func:`read_client_request` ``(body, chat) -> ClientScan``: a client body, validated and read once
  for both legs (``stream``, ``include_usage``, ``max_tokens``, ``model``, the spans to splice);
- :func:`context_request` ``(client, disagg_request_id, return_b64) -> bytes``: leg (1);
- :func:`read_context_response` ``(body, max_tokens) -> ContextScan``: leg (2), and whether a
  generation leg follows (``finished``, ``finish_reason``);
- :func:`generation_request` ``(client, context, tokids_b64, strip_history) -> bytes``: leg (3);
- :func:`context_request_pieces`, :func:`generation_request_pieces` (same arguments) ``-> list``:
  the legs as pieces for one vectored write, whose join is the bytes above (those are that join):
  the long untouched runs of the client body and the context response as memoryviews of the scans'
  ``body`` bytes (each view holds a reference to them), the new text as small ``bytes``. No copy of
  a long body; the caller holds the pieces until the leg is written;
- :func:`strip_internal_fields` ``(body, validate=True) -> bytes``: a worker's answer for the client.

:func:`build_context_request` and :func:`build_generation_request` chain them for a caller holding
raw bytes (or the scans). Errors:

- :class:`fastcore.JSONSpanError` (a ``ValueError`` with ``offset``): a body is not valid JSON, or
  repeats a key the relay reads;
- :class:`fastcore.RelayError` (``field`` names the field): the message is the orchestrator's HTTP
  error text. A client body's (the 400): not an object, an internal field, a small field of the
  wrong type, no ``messages`` element (chat) or ``prompt`` (completions), a token limit below 1. A
  context response's (the 502, its message starting "context worker response"): what leg (3) needs
  is missing or malformed.

``Relay(twin)`` binds the same functions to one twin module (the tests run both).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import _relay_impl, _relay_py, _scan_impl, protocol
from .errors import RelayError

BytesLike = bytes | bytearray | memoryview

#: Fields only the orchestrator may set (``fastcore.protocol`` says which on which route).
INTERNAL_FIELDS = protocol.INTERNAL_FIELDS
#: Context-leg finish reasons after which a generation leg follows (docs/protocol.md (2)).
GENERATION_FOLLOWS = frozenset(protocol.GENERATION_FOLLOWS)
_MESSAGES = (protocol.MESSAGES,)


class Relay:
    """The relay kernels of one twin (``fastcore._relay`` or ``fastcore._relay_py``) and the builders."""

    def __init__(self, twin: ModuleType) -> None:
        self.twin = twin
        self.ClientScan: type = twin.ClientScan
        self.ContextScan: type = twin.ContextScan
        self.read_client_request = twin.read_client_request
        self.context_request = twin.context_request
        self.context_request_pieces = twin.context_request_pieces
        self.read_context_response = twin.read_context_response
        self.generation_request = twin.generation_request
        self.generation_request_pieces = twin.generation_request_pieces
        self.strip_internal_fields = twin.strip_internal_fields

    def _client(self, client_body: Any, chat: bool | None) -> Any:
        if type(client_body) is self.ClientScan:
            return client_body
        if chat is not None:
            return self.read_client_request(client_body, chat)
        # No route: a guess from the body a client controls (pass the route instead), chat when it has
        # ``messages``. A body read as chat has them, so only a refused read looks (a second scan,
        # which cost a third of the leg's time when it ran first on every call).
        try:
            return self.read_client_request(client_body, True)
        except RelayError:
            if _scan_impl.find_span(client_body, _MESSAGES, validate=False) is not None:
                raise
        return self.read_client_request(client_body, False)

    def build_context_request(
        self, client_body: Any, *, disagg_request_id: int, return_b64: bool, chat: bool | None = None
    ) -> bytes:
        """Leg (1) from a client body (raw bytes, or its :func:`read_client_request` scan, which
        spares this leg and the next a scan). ``chat``: the route; ``None`` guesses it from the
        presence of ``messages``."""
        return self.context_request(self._client(client_body, chat), disagg_request_id, return_b64)

    def build_generation_request(
        self,
        client_body: Any,
        ctx_response: Any,
        *,
        tokids_b64: bool,
        strip_history: bool,
        chat: bool | None = None,
    ) -> bytes:
        """Leg (3) from a client body and the context response (raw bytes, or their scans).

        ``tokids_b64`` (gate ``gen_tokids_ctxbytes``): relay the response's
        ``prompt_token_ids_b64`` string verbatim, or its list when it has only the list; otherwise
        its ``prompt_token_ids`` list as ``prompt_token_ids`` (chat) or ``prompt`` (completions).
        ``strip_history`` (gate ``gen_strip_message_history``): ``messages`` keeps its last element.
        """
        client = self._client(client_body, chat)
        context = ctx_response
        if type(context) is not self.ContextScan:
            context = self.read_context_response(ctx_response, client.max_tokens)
        return self.generation_request(client, context, tokids_b64, strip_history)


_default = Relay(_relay_impl)

#: where a :class:`ContextScan`'s ``spans`` (either twin) hold the response's top-level ``usage`` object
#: (its token counts: ``ContextScan.usage_tokens()``)
CONTEXT_USAGE_SPAN = _relay_py.X_USAGE
#: the token count at a span of a body (``usage_tokens``' rule: 1 to ``MAX_COUNT_DIGITS`` ASCII digits,
#: else None), for what reads ``usage`` with a scan of its own
count_at = _relay_py._count_at

ClientScan = _default.ClientScan
ContextScan = _default.ContextScan
read_client_request = _default.read_client_request
context_request = _default.context_request
context_request_pieces = _default.context_request_pieces
read_context_response = _default.read_context_response
generation_request = _default.generation_request
generation_request_pieces = _default.generation_request_pieces
strip_internal_fields = _default.strip_internal_fields
build_context_request = _default.build_context_request
build_generation_request = _default.build_generation_request

__all__ = [
    "CONTEXT_USAGE_SPAN",
    "GENERATION_FOLLOWS",
    "INTERNAL_FIELDS",
    "ClientScan",
    "ContextScan",
    "Relay",
    "build_context_request",
    "build_generation_request",
    "context_request",
    "context_request_pieces",
    "count_at",
    "generation_request",
    "generation_request_pieces",
    "read_client_request",
    "read_context_response",
    "strip_internal_fields",
]
