"""SGLang's prefill/decode protocol: the bootstrap, both legs at once (docs/protocol.md, "Worker protocols").

Concurrent, unlike trtllm-serve's and vLLM's: the same body goes to a prefill worker and a decode
worker at once (SGLang's ``mini_lb.py`` and its router's PD mode do the same), the client's body with
three members put in front of its first one:

- ``bootstrap_host``: the prefill worker's host, as its URL names it (IPv6 in brackets);
- ``bootstrap_port``: its ``--disaggregation-bootstrap-port``, which its ``/server_info`` publishes as
  ``disaggregation_bootstrap_port`` (this protocol's capability probe; a prefill worker that does not
  publish one is never chosen);
- ``bootstrap_room``: random in [0, 2^63) (mini_lb's ``random.randint(0, 2**63 - 1)``), a new one for
  every pair a request is sent to.

The decode bootstraps to the prefill's server, the prefill pushes the prompt's KV to it; the decode's
answer is the client's, the prefill's is read and discarded. The legs are pieces of one vectored write
(views of the client's body around one small new ``bytes``): no Python parse of the body. Running the
two legs, cutting one when the other fails, and retrying the pair are :mod:`..pair`'s.
"""

from __future__ import annotations

import json
import random
from typing import Any
from urllib.parse import urlsplit

import fastcore
import fastcore.protocol as wire
from fastcore import JSONSpanError, RelayError
from fastcore import relay as fastcore_relay
from server.errors import HTTPError
from server.http import BodyPiece

from ..pools import Capabilities, Worker
from ..relay_common import ClientRequest, ContextResult, scan_refusal
from .base import ProtocolConfig, scanner_refusal
from .vllm import _first_member

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_BOOTSTRAP_PATHS = tuple((name,) for name in BOOTSTRAP_FIELDS)
#: /server_info's member that names a prefill worker's bootstrap port
BOOTSTRAP_PORT_INFO = "disaggregation_bootstrap_port"
ROOM_BITS = 63
_getrandbits = random.getrandbits
_SEQUENTIAL = "SGLang's legs run at once (server/orchestrator/pair.py), not in sequence"


class SglangRelay:
    """The client's body read and checked, and the one body both legs carry, in the relay-mode
    interface app.py runs (:mod:`..relay_modes`; the context/generation steps of a sequential protocol
    are not run: :mod:`..pair` runs the legs)."""

    name = "fast"
    leg_headers = b""
    #: the twins it runs (the tests choose them by subclass, as VllmRelay's)
    relay: Any = fastcore_relay
    scanner: Any = fastcore

    def __init__(self) -> None:
        #: worker URL -> the ``"bootstrap_host":"..."`` text of its legs
        self._hosts: dict[str, bytes] = {}

    def read_client(self, body: bytes, chat: bool) -> ClientRequest:
        """One validating scan of the relay kernel, one unvalidated pass for the bootstrap members: a
        client's own is a 400 (the orchestrator pairs the legs; a client's room would join another's)."""
        try:
            scan = self.relay.read_client_request(body, chat)
            spans = self.scanner.find_member_spans(body, _BOOTSTRAP_PATHS, validate=False)
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "request body", 400) from None
        except RelayError as exc:
            raise HTTPError(400, str(exc), param=exc.field) from None
        for name, span in zip(BOOTSTRAP_FIELDS, spans, strict=True):
            if span is not None:
                raise HTTPError(
                    400, f"'{name}' is set by the orchestrator (the prefill/decode bootstrap), not by a client",
                    param=name,
                )  # fmt: skip
        return ClientRequest(
            body,
            chat,
            scan.stream,
            scan.include_usage,
            scan.max_tokens,
            scan.model,
            (scan, _first_member(body)),
        )

    def pair_legs(self, req: ClientRequest, prefill: Worker) -> tuple[list[BodyPiece], list[BodyPiece]]:
        """The prefill leg's and the decode leg's pieces: one body, on a new room."""
        pieces = self.pair_pieces(req, prefill, new_room())
        return pieces, pieces

    def pair_pieces(self, req: ClientRequest, prefill: Worker, room: int) -> list[BodyPiece]:
        """Both legs' body: the client's, the bootstrap triple of ``prefill`` and ``room`` in front of its
        first member."""
        first = req.parsed[1]
        view = memoryview(req.body)
        host = self._hosts.get(prefill.url) or self._host(prefill.url)
        triple = b'%s,"bootstrap_port":%d,"bootstrap_room":%d,' % (host, prefill.bootstrap_port or 0, room)
        return [view[:first], triple, view[first:]]

    def _host(self, url: str) -> bytes:
        text = self._hosts[url] = b'"bootstrap_host":' + json.dumps(self.url_host(url)).encode()
        return text

    @staticmethod
    def url_host(url: str) -> str:
        """The host a worker's URL names, IPv6 bracketed (SGLang joins host and port with a colon; mini_lb
        brackets it too, and so does an ``http://host:port`` address)."""
        host = urlsplit(url if "://" in url else "http://" + url).hostname or ""
        return f"[{host}]" if ":" in host else host

    def prompt_bytes(self, req: ClientRequest) -> int:
        nbytes: int = req.parsed[0].prompt_bytes
        return nbytes

    def client_answer(self, req: ClientRequest, body: bytes) -> bytes:
        """The decode's answer, checked by one validating scan and relayed as SGLang wrote it."""
        try:
            self.scanner.find_span(body, ())
        except JSONSpanError as exc:
            raise scan_refusal(body, exc, "generation worker response", 502) from None
        return body

    def auth_fields(self, ctx: ContextResult) -> tuple[object, object]:
        return None, None

    # -- a sequential protocol's steps (app.py's context leg, then generation leg): never run here,
    # the orchestrator runs a concurrent protocol's pairs (pair.py)

    def context_pieces(
        self, req: ClientRequest, disagg_request_id: int, ask_b64_completions: bool = True
    ) -> list[BodyPiece]:
        raise NotImplementedError(_SEQUENTIAL)

    def read_context(self, req: ClientRequest, body: bytes) -> ContextResult:
        raise NotImplementedError(_SEQUENTIAL)

    def usage_tokens(self, ctx: ContextResult) -> tuple[int | None, int | None]:
        raise NotImplementedError(_SEQUENTIAL)

    def finished_answer(self, req: ClientRequest, ctx: ContextResult) -> bytes:
        raise NotImplementedError(_SEQUENTIAL)

    def generation_pieces(self, req: ClientRequest, ctx: ContextResult) -> list[BodyPiece]:
        raise NotImplementedError(_SEQUENTIAL)


class SglangProtocol:
    """SGLang's bootstrap: :class:`SglangRelay`'s body on both legs at once (``concurrent``), no release
    endpoint (a cut leg aborts its request: SGLang aborts on a disconnect), capabilities and the
    prefill's bootstrap port from ``/server_info``."""

    name = "sglang"
    #: how the KV moves (the /metrics gauge fastcore_orchestrator_worker_protocol's label)
    transfer = "bootstrap"
    #: both legs at once (pair.py runs them), not context then generation
    concurrent = True
    releases_kv = False
    #: a failed pair is retried whole with a new room (pair.py), never a leg alone
    resends_generation = False
    #: a decode worker serves only bootstrapped requests: no local prefill, no decode-only request
    serves_plain_request = False
    no_plain_request = "an SGLang decode worker cannot serve a plain request (it waits for a bootstrap)"
    capabilities_path = wire.SERVER_INFO_PATH
    #: what pair.py's log says a prefill it skips lacks
    bootstrap_source = "disaggregation_bootstrap_port in its /server_info"

    def __init__(self, config: ProtocolConfig) -> None:
        self.relay = SglangRelay()

    @staticmethod
    def refusal(config: ProtocolConfig) -> str | None:
        """Why ``config`` cannot run on SGLang's protocol (None: it can)."""
        refused = scanner_refusal(config, "sglang", "SGLang's legs are the client's body")
        if refused is not None:
            return refused
        return None

    @staticmethod
    def capabilities(info: Any) -> Capabilities:
        """An SGLang worker's ``/server_info``: a prefill's bootstrap port (``disaggregation_bootstrap_port``,
        an int in (0, 65536)); no local prefill (a decode worker serves only bootstrapped requests)."""
        if not isinstance(info, dict):
            return Capabilities()
        port = info.get(BOOTSTRAP_PORT_INFO)
        ok = type(port) is int and 0 < port < 65536 and info.get("disaggregation_mode") == "prefill"
        return Capabilities(bootstrap_port=port if ok else None)

    def context_headers(self, req: ClientRequest) -> bytes:
        return b""

    def generation_headers(self, req: ClientRequest, ctx: ContextResult | None) -> bytes:
        return b""


def new_room() -> int:
    """A bootstrap room: random in [0, 2^63), as mini_lb draws it."""
    return _getrandbits(ROOM_BITS)
