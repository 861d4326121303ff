"""The orchestrator's fast relay (config ``relay: fast``, the default): one compiled call per body.

``FastRelay`` never builds Python objects for a body: one compiled call per body (a
``fastcore.relay`` kernel) makes one validating pass of the fastcore span scanner that checks all of
it, decodes the few small fields the orchestrator acts on (``stream``, ``max_tokens``,
``finish_reason``...) from their bytes, and cuts and splices every outgoing body from the raw bytes:
the legs as pieces for one vectored write (``context_pieces``, ``generation_pieces``: views of the
client body and the context response between a few small new ``bytes``, neither body copied), a
client's answer with one allocation. Its Python work per request is five calls and does not grow with the prompt.
The protocol's rules (internal fields, the base64 list fallback) are the kernels' (fastcore.protocol
names them); this adapter only turns their errors into HTTP ones.

Each body goes through one relay kernel of ``fastcore.relay`` (``read_client_request``,
``context_request[_pieces]``, ``read_context_response``, ``generation_request[_pieces]``,
``strip_internal_fields``): a refusal is a RelayError carrying the HTTP message and the 400's param; a malformed
body, the scan's JSONSpanError, which :func:`.relay_common.scan_refusal` words.
"""

from __future__ import annotations

from typing import Any

from fastcore import JSONSpanError, RelayError
from fastcore import relay as fastcore_relay
from server.errors import HTTPError
from server.http import BodyPiece

from .relay_common import ClientRequest, ContextResult, check_disagg_request_id, scan_refusal
from .routing import conversation_to_params


class FastRelay:
    """The zero-parse relay (config ``relay: fast``)."""

    name = "fast"
    #: Extra header lines for both legs' requests: none, the bodies are JSON.
    leg_headers = b""
    #: The relay kernels it runs: the active twin's. The tests choose the twin by the class (a
    #: subclass whose ``relay`` is ``fastcore.relay.Relay(twin)``), not by an argument.
    relay: Any = fastcore_relay

    def __init__(self, *, tokids_b64: bool, strip_history: bool) -> None:
        self.tokids_b64 = tokids_b64
        self.strip_history = strip_history
        relay = self.relay
        self._read_client = relay.read_client_request
        self._context_request = relay.context_request
        self._context_pieces = relay.context_request_pieces
        self._read_context = relay.read_context_response
        self._generation_request = relay.generation_request
        self._generation_pieces = relay.generation_request_pieces
        self._strip = relay.strip_internal_fields

    def read_client(self, body: bytes, chat: bool) -> ClientRequest:
        """The client's body read and checked; the request's ``body`` is what both legs carry: ours
        with a top-level ``conversation_id`` moved into trtllm-serve's ``conversation_params``
        (workers refuse it at the top), which the scan says is there: read again only then."""
        scan = self._scan_client(body, chat)
        if scan.has_conversation_id:
            body = conversation_to_params(body)
            scan = self._scan_client(body, chat)
        return ClientRequest(body, chat, scan.stream, scan.include_usage, scan.max_tokens, scan.model, scan)

    def _scan_client(self, body: bytes, chat: bool) -> Any:
        try:
            # One validating scan: the whole body is checked, and it finds every span both legs
            # splice and decodes the small fields read here.
            return self._read_client(body, chat)
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "request body", 400) from None
        except RelayError as exc:
            raise HTTPError(400, str(exc), param=exc.field) from None

    def context_request(
        self, req: ClientRequest, disagg_request_id: int, ask_b64_completions: bool = True
    ) -> bytes:
        """Leg (1). It asks for ``prompt_token_ids_b64`` when the gate is on, on chat always and on
        completions when ``ask_b64_completions`` (the context worker's ``/server_info`` says it
        answers completions with base64); a worker that answers with the list anyway is relayed
        with the list (:meth:`generation_request`)."""
        check_disagg_request_id(disagg_request_id)
        return_b64 = self.tokids_b64 and (req.chat or ask_b64_completions)
        return self._context_request(req.parsed, disagg_request_id, return_b64)

    def context_pieces(
        self, req: ClientRequest, disagg_request_id: int, ask_b64_completions: bool = True
    ) -> list[BodyPiece]:
        """Leg (1) as the orchestrator sends it: :meth:`context_request`'s bytes as pieces (the client
        body's long runs as memoryviews of its bytes, which they keep alive), for one vectored write."""
        check_disagg_request_id(disagg_request_id)
        return_b64 = self.tokids_b64 and (req.chat or ask_b64_completions)
        return self._context_pieces(req.parsed, disagg_request_id, return_b64)

    def read_context(self, req: ClientRequest, body: bytes) -> ContextResult:
        try:
            # One validating scan; its spans go to generation_request.
            scan = self._read_context(body, req.max_tokens)
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "context worker response", 502) from None
        except RelayError as exc:
            raise HTTPError(502, str(exc)) from None
        return ContextResult(body, scan.finished, scan)

    def prompt_bytes(self, req: ClientRequest) -> int:
        """The bytes of the client's prompt span (``messages`` or ``prompt``; 0 without one), which
        read_client's scan found: what bytes per token is learned from."""
        nbytes: int = req.parsed.prompt_bytes
        return nbytes

    def usage_tokens(self, ctx: ContextResult) -> tuple[int | None, int | None]:
        """The context response's ``usage.prompt_tokens`` and ``.prompt_tokens_details.cached_tokens``
        (read_context's scan found their spans)."""
        tokens: tuple[int | None, int | None] = ctx.parsed.usage_tokens()
        return tokens

    def auth_fields(self, ctx: ContextResult) -> tuple[object, object]:
        """``ctx_info_endpoint`` and ``encoded_opaque_state`` of the context response (``None`` where
        absent), for trtllm-serve's ``x-trtllm-disagg-auth`` (server/auth.py ``trtllm_disagg_auth``);
        read_context's scan found them, this decodes them."""
        return ctx.parsed.auth_fields()

    def generation_request(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        try:
            return self._generation_request(req.parsed, ctx.parsed, self.tokids_b64, self.strip_history)
        except RelayError as exc:
            raise HTTPError(502, str(exc)) from None

    def generation_pieces(self, req: ClientRequest, ctx: ContextResult) -> list[BodyPiece]:
        """Leg (3) as the orchestrator sends it: :meth:`generation_request`'s bytes as pieces, the
        long runs of the client body and the context response (the prompt ids) as memoryviews of
        their bytes (which the views keep alive), for one vectored write and the signature over
        them: neither body is copied."""
        try:
            return self._generation_pieces(req.parsed, ctx.parsed, self.tokids_b64, self.strip_history)
        except RelayError as exc:
            raise HTTPError(502, str(exc)) from None

    def finished_answer(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        try:
            # read_context validated these bytes: this scan only finds the members to cut.
            return self._strip(ctx.body, False)
        except (RelayError, JSONSpanError) as exc:  # e.g. a choice beyond the first repeats a key
            raise HTTPError(502, f"context worker response cannot be relayed: {exc}") from None

    def client_answer(self, req: ClientRequest, body: bytes) -> bytes:
        try:
            # One validating scan; the body itself comes back when there is nothing to cut.
            return self._strip(body, True)
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "generation worker response", 502) from None
        except RelayError as exc:
            raise HTTPError(502, f"generation worker response cannot be relayed: {exc}") from None
