"""vLLM's prefill/decode protocol with its NixlConnector (docs/protocol.md, "Worker protocols").

Sequential, as trtllm-serve's: leg (1) to a prefill worker (``kv_producer``), leg (3) to a decode
worker (``kv_consumer``), which pulls the prompt's blocks. What differs is the bodies:

- leg (1): the client's body with ``kv_transfer_params`` asking for a remote decode, ``stream:
  false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` where the client sent it), without
  ``stream_options``, ``min_tokens`` and ``min_completion_tokens`` (vLLM refuses them beside one
  unstreamed token), and an ``X-Request-Id`` that leg (3) repeats (vLLM's request ids are built from it);
- leg (2): the prefill's answer; what the orchestrator needs of it is its top-level
  ``kv_transfer_params`` object (the blocks, the engine, its side channel), found by the span scanner
  and never parsed: without one the leg is the worker's 502, naming the field;
- leg (3): the client's body as sent plus that object, byte for byte. Its answer is the client's.

The legs are pieces for one vectored write (views of the client's body and the prefill's answer between
a few small new ``bytes``), as :class:`..relay_fast.FastRelay` writes trtllm-serve's. A prefill always
leads to a decode (vLLM's reference proxy does the same): its one token is not the client's answer.
vLLM has no release endpoint, but a decode request carrying the prefill's ``kv_transfer_params`` frees
its blocks however it ends: read, or aborted before it ran (vLLM's ``NixlConnectorScheduler.request_finished``
queues a receive with no blocks, and the decode worker sends the prefill the notification a finished read
sends). :meth:`VllmProtocol.release` sends one such request (the client's body with those params, ``stream:
false``, ``max_tokens: 1``, the legs' ``X-Request-Id``) to a decode worker, once, with a short deadline, and
drops its answer; without it the blocks stay until their lease ends (``kv_lease_duration``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import fastcore
from fastcore import JSONSpanError, RelayError
from fastcore import relay as fastcore_relay
from server.errors import HTTPError
from server.http import BodyPiece, UpstreamError, UpstreamTimeout

from ..pools import Capabilities
from ..relay_common import ClientRequest, ContextResult, scan_refusal
from .base import ProtocolConfig, scanner_refusal

Span = tuple[int, int]

KV_TRANSFER_PARAMS = "kv_transfer_params"
#: what vLLM's reference proxy (toy_proxy_server.py) puts on a NIXL prefill leg
PREFILL_PARAMS = (
    b'"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
    b'"remote_block_ids":null,"remote_host":null,"remote_port":null},"stream":false,"max_tokens":1'
)
_PREFILL_COMPLETION_CAP = b',"max_completion_tokens":1'
#: the client body's members leg (1) sets or drops; the first is refused (the orchestrator's to set)
_CLIENT_MEMBERS = (
    (KV_TRANSFER_PARAMS,),
    ("stream",),
    ("max_tokens",),
    ("max_completion_tokens",),
    ("stream_options",),
    ("min_tokens",),
    ("min_completion_tokens",),
)
_MAX_COMPLETION_TOKENS = 3
_CONTEXT_PATHS = (
    (KV_TRANSFER_PARAMS,),
    ("usage", "prompt_tokens"),
    ("usage", "prompt_tokens_details", "cached_tokens"),
)
_DECODE_KEY = b'"kv_transfer_params":'
_WHITESPACE = b" \t\r\n"
_COMMA, _OPEN = ord(","), ord("{")
_getrandbits = random.getrandbits
#: the release request's deadline: one token on a decode that pulls the blocks, or nothing to pull
RELEASE_TIMEOUT_S = 5.0
_RELEASE_TAIL = b',"stream":false,"max_tokens":1'
log = logging.getLogger(__name__)


class VllmClient:
    """What leg (1) and (3) splice from a client body: the relay kernel's scan, the spans of the members
    leg (1) rewrites, where the body's first member starts, and the request's ``X-Request-Id`` line."""

    __slots__ = ("first", "request_id", "scan", "spans")

    def __init__(self, scan: Any, spans: list[Span | None], first: int, request_id: bytes) -> None:
        self.scan = scan
        self.spans = spans
        self.first = first
        self.request_id = request_id


class VllmRelay:
    """The legs' bodies of vLLM's NixlConnector protocol, in the relay-mode interface app.py and
    exchange.py run (:mod:`..relay_modes`)."""

    name = "fast"
    leg_headers = b""
    #: the twins it runs (the tests choose them by subclass, as FastRelay's)
    relay: Any = fastcore_relay
    scanner: Any = fastcore

    def read_client(self, body: bytes, chat: bool) -> ClientRequest:
        """The client's body read and checked (one validating scan of the relay kernel, and one
        unvalidated pass for the members leg (1) rewrites); a ``kv_transfer_params`` of its own is a 400."""
        try:
            scan = self.relay.read_client_request(body, chat)
            spans = self.scanner.find_member_spans(body, _CLIENT_MEMBERS, validate=False)
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "request body", 400) from None
        except RelayError as exc:
            raise HTTPError(400, str(exc), param=exc.field) from None
        if spans[0] is not None:
            raise HTTPError(
                400,
                "'kv_transfer_params' is set by the orchestrator (the prefill/decode hand-off), not by a client",
                param=KV_TRANSFER_PARAMS,
            )
        request_id = b"X-Request-Id: %032x\r\n" % _getrandbits(128)
        client = VllmClient(scan, spans, _first_member(body), request_id)
        return ClientRequest(body, chat, scan.stream, scan.include_usage, scan.max_tokens, scan.model, client)

    def context_pieces(
        self, req: ClientRequest, disagg_request_id: int, ask_b64_completions: bool = True
    ) -> list[BodyPiece]:
        """Leg (1): the client's body, the members it rewrites cut (each with the comma before it,
        the first member with none), :data:`PREFILL_PARAMS` put in front of its first member."""
        return self._prefill_pieces(req, PREFILL_PARAMS)

    def _prefill_pieces(self, req: ClientRequest, front: bytes) -> list[BodyPiece]:
        """The prefill leg with ``front`` (its ``kv_transfer_params``, ``stream`` and ``max_tokens``)."""
        client: VllmClient = req.parsed
        body = req.body
        view = memoryview(body)
        first = client.first
        cuts: list[Span] = []
        first_cut = False
        for span in client.spans[1:]:
            if span is None:
                continue
            start, end = span
            before = start - 1
            while body[before] in _WHITESPACE:
                before -= 1
            if body[before] == _COMMA:
                cuts.append((before, end))
            else:  # the object's first member: the text put in front of it ends without a comma
                cuts.append((start, end))
                first_cut = True
        cuts.sort()
        if client.spans[_MAX_COMPLETION_TOKENS] is not None:
            front += _PREFILL_COMPLETION_CAP
        pieces: list[BodyPiece] = [view[:first], front if first_cut else front + b","]
        at = first
        for start, end in cuts:
            if start > at:
                pieces.append(view[at:start])
            at = end
        pieces.append(view[at:])
        return pieces

    def context_request(
        self, req: ClientRequest, disagg_request_id: int, ask_b64_completions: bool = True
    ) -> bytes:
        return b"".join(self.context_pieces(req, disagg_request_id, ask_b64_completions))

    def read_context(self, req: ClientRequest, body: bytes) -> ContextResult:
        """The prefill's answer: one validating scan finds its top-level ``kv_transfer_params`` (and
        its usage); an answer without that object cannot be handed to a decode: the worker's 502."""
        try:
            spans = self.scanner.find_spans(body, _CONTEXT_PATHS)
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "context worker response", 502) from None
        params = spans[0]
        if params is None or body[params[0]] != _OPEN:
            what = "no" if params is None else "a non-object"
            raise HTTPError(
                502,
                f"context worker response has {what} 'kv_transfer_params': a vLLM prefill worker with the "
                "NixlConnector answers the object its decode needs",
            )
        return ContextResult(body, False, spans)

    def prompt_bytes(self, req: ClientRequest) -> int:
        nbytes: int = req.parsed.scan.prompt_bytes
        return nbytes

    def usage_tokens(self, ctx: ContextResult) -> tuple[int | None, int | None]:
        count_at = fastcore_relay.count_at
        return count_at(ctx.body, ctx.parsed[1]), count_at(ctx.body, ctx.parsed[2])

    def auth_fields(self, ctx: ContextResult) -> tuple[object, object]:
        return None, None

    def generation_pieces(self, req: ClientRequest, ctx: ContextResult) -> list[BodyPiece]:
        """Leg (3): the client's body as sent with the prefill's ``kv_transfer_params`` in front of its
        first member, as the prefill wrote it (a view of its answer)."""
        first = req.parsed.first
        view = memoryview(req.body)
        start, end = ctx.parsed[0]
        return [view[:first], _DECODE_KEY, memoryview(ctx.body)[start:end], b",", view[first:]]

    def generation_request(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        return b"".join(self.generation_pieces(req, ctx))

    def release_pieces(self, req: ClientRequest, ctx: ContextResult) -> list[BodyPiece]:
        """The request that frees a prefill's blocks (:meth:`VllmProtocol.release`): leg (1)'s cuts of the
        client's body, the prefill's ``kv_transfer_params`` verbatim, ``stream: false``, ``max_tokens: 1``."""
        start, end = ctx.parsed[0]
        return self._prefill_pieces(req, _DECODE_KEY + ctx.body[start:end] + _RELEASE_TAIL)

    def finished_answer(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        """Never the client's: read_context says a decode follows every prefill."""
        return ctx.body

    def client_answer(self, req: ClientRequest, body: bytes) -> bytes:
        """The decode's answer, checked by one validating scan and relayed as vLLM wrote it."""
        try:
            self.scanner.find_span(body, ())
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "generation worker response", 502) from None
        return body


def _first_member(body: bytes) -> int:
    """Where the first member of ``body`` (a validated JSON object with at least one) starts."""
    at = 0
    while body[at] in _WHITESPACE:
        at += 1
    at += 1  # the "{"
    while body[at] in _WHITESPACE:
        at += 1
    return at


class VllmProtocol:
    """vLLM with its NixlConnector: :class:`VllmRelay`'s bodies, one ``X-Request-Id`` on both legs,
    blocks released by a throwaway decode (:meth:`release`), capabilities from ``/v1/models``."""

    name = "vllm"
    #: how the KV moves (the /metrics gauge fastcore_orchestrator_worker_protocol's label)
    transfer = "nixl"
    #: the legs one after the other (context, then generation); sglang.py's run at once
    concurrent = False
    #: no ``DELETE /kv/...``: a prefill's blocks are freed by a decode request (:meth:`release`)
    releases_kv = False
    #: whether :meth:`release` frees what a failed decode leg left held (the call site asks)
    releases_by_decode = True
    #: a decode leg its worker may have read is never sent again as it is: the decode pulls the prefill's
    #: blocks first, and a lease is read once ("not held (read)" for a second decode, a 400), so a
    #: decode that failed after it was sent (a reset, no first byte) costs a new prefill leg (app.py)
    resends_generation = False
    #: a decode worker serves a client's plain request whole: the local prefill of a failed prefill leg,
    #: and conditional disaggregation's decode-only requests (vllm-router's pd_uncached_token_threshold)
    serves_plain_request = True
    #: why it would not (protocols.refusal reads it where serves_plain_request is False)
    no_plain_request = ""
    #: vLLM serves no /server_info; /v1/models answers once the engine is up
    capabilities_path = "/v1/models"

    def __init__(self, config: ProtocolConfig) -> None:
        self.relay = VllmRelay()
        #: release requests by outcome: "sent" (the decode answered), "failed" (no answer in time, refused)
        self.releases = {"sent": 0, "failed": 0}

    @staticmethod
    def refusal(config: ProtocolConfig) -> str | None:
        """Why ``config`` cannot run on vLLM's protocol yet (None: it can)."""
        legs = "a vLLM decode leg is the client's body as sent plus the prefill's kv_transfer_params"
        refused = scanner_refusal(config, "vllm", legs)
        if refused is not None:
            return refused
        return None

    @staticmethod
    def capabilities(info: Any) -> Capabilities:
        """A vLLM worker's ``/v1/models`` list: it serves a plain request whole (``local_prefill``: a
        decode worker is the fallback of a failed prefill) and takes ``cache_salt`` on completions."""
        if isinstance(info, dict) and isinstance(info.get("data"), list):
            return Capabilities(local_prefill=True, cache_salt_completions=True)
        return Capabilities()

    def context_headers(self, req: ClientRequest) -> bytes:
        request_id: bytes = req.parsed.request_id
        return request_id

    def generation_headers(self, req: ClientRequest, ctx: ContextResult | None) -> bytes:
        request_id: bytes = req.parsed.request_id
        return request_id

    async def release(self, decode: Any, path: bytes, req: ClientRequest, ctx: ContextResult) -> int | None:
        """Free the blocks the prefill that answered ``ctx`` holds, by sending decode worker ``decode`` (an
        upstream pool: ``request(method, path, pieces, ...)``) one request on route ``path`` carrying its
        ``kv_transfer_params`` (:meth:`VllmRelay.release_pieces`): whether the decode reads the blocks or
        fails, vLLM's decode notifies the prefill, which frees them. One attempt within
        :data:`RELEASE_TIMEOUT_S`, its answer dropped; returns its status (None: none came), counted in
        :attr:`releases`. Never raises but for a cancellation: a release is best effort."""
        headers = self.generation_headers(req, ctx)
        try:
            resp = await decode.request(
                b"POST", path, self.relay.release_pieces(req, ctx), headers=headers,
                timeout=RELEASE_TIMEOUT_S, max_body=1 << 16,
            )  # fmt: skip
        except (UpstreamError, UpstreamTimeout, OSError) as exc:
            self.releases["failed"] += 1
            log.info("releasing a vLLM prefill's blocks through %s failed: %s", path.decode(), exc)
            return None
        resp.release()
        self.releases["sent"] += 1
        status: int = resp.status
        return status
