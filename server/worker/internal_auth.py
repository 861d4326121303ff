"""Who may send this worker a leg: internal requests (the two legs) authenticated by one of two means.

- fastcore's own :mod:`server.auth` signature (``X-Fastcore-Signature``) over
  the body's bytes as sent, checked before anything is parsed: what fastcore's
  orchestrator sends. A valid one authenticates any leg.
- trtllm-serve's ``x-trtllm-disagg-auth`` (HMAC over ``ctx_info_endpoint`` and
  ``encoded_opaque_state``), the only header trtllm-serve's orchestrator
  sends, and only on generation legs that carry one of those two fields. The
  key is ``trtllm_auth_key``, the shared secret unless given apart.

With a trtllm key, a leg carrying ``ctx_info_endpoint`` or
``encoded_opaque_state`` without a valid fastcore signature needs a valid
``x-trtllm-disagg-auth``, or is refused (403). With a shared secret, every other
leg without a valid fastcore signature (a context leg, a generation leg with
neither field: trtllm's orchestrator signs neither) is refused (403) unless
``accept_trtllm_orchestrator`` is set. That flag makes the worker a drop-in for
trtllm-serve behind trtllm's orchestrator: such legs are accepted unsigned (a
caller can then park KV and run prefills, as it could with plain requests;
fetching the KV still needs the fastcore signature), and a completions context
leg answers ``prompt_token_ids`` as a list even when asked for base64, since
trtllm's completion response model has no ``prompt_token_ids_b64`` (it refuses
unknown fields). ``/server_info`` says which.

The decisions are taken as the body is read (:meth:`server.worker.request.RequestReader.read`):
the signature before, an unsigned leg once its body is loaded, trtllm's header on the fields it signs.
A KV request (a fetch or release of parked KV, server/worker/kv_handoff.py) needs the fastcore
signature whenever there is a shared secret (:meth:`InternalAuth.check_kv_request`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastcore import protocol as wire
from server.auth import (
    SIGNATURE_HEADER,
    TRTLLM_AUTH_HEADER,
    WRONG_DESTINATION,
    Verifier,
    check_trtllm_disagg_auth,
)
from server.errors import HTTPError
from server.http import Request

if TYPE_CHECKING:
    from .request import ParsedRequest

_SIGNATURE = SIGNATURE_HEADER.lower().encode()
_TRTLLM_AUTH = TRTLLM_AUTH_HEADER.lower().encode()


def refusal_code(reason: str) -> str:
    """The error code of a signature refused for ``reason``: an orchestrator that signed for this
    worker's previous instance (it restarted since the last /health) tells it apart and retries."""
    return "wrong_destination" if reason == WRONG_DESTINATION else "bad_signature"


@dataclass(eq=False)
class InternalAuth:
    """One worker's rules for its legs and its KV requests: its signature verifier (it remembers
    the nonces it has accepted, so a replay is refused; None without a shared secret), its trtllm
    key, this process's instance id (what a signature may be bound to), whether trtllm's
    orchestrator fronts it."""

    verifier: Verifier | None
    trtllm_key: bytes | None
    instance: str
    accept_trtllm_orchestrator: bool = field(kw_only=True)

    def authenticate(self, request: Request) -> bool:
        """Check a fastcore signature on the body's bytes as sent, before anything is parsed;
        True if signed. A signature present is checked (a 403 names why it fails, whatever the
        header holds)."""
        verifier = self.verifier
        header = request.header(_SIGNATURE)
        if verifier is None or header is None:
            return False
        # Bound to this process's instance: nonces are per process, so only the binding stops a
        # leg signed for another worker (or for this one before a restart) from being replayed here.
        reason = verifier.check(request.body, header, destination=self.instance, bound=True)
        if reason is not None:
            raise HTTPError(403, f"{SIGNATURE_HEADER} refused: {reason}", code=refusal_code(reason))
        return True

    def check_kv_request(self, request: Request, signed: bytes, what: str) -> None:
        """A KV request's signature over ``signed`` (server/worker/kv_handoff.py), with a shared
        secret; a 403 naming ``what`` if it fails. Bound to this instance when the sender knows it
        (an orchestrator's release); a generation worker's fetch cannot be: the path names a random
        id parked here only."""
        if self.verifier is None:
            return
        reason = self.verifier.check(signed, request.header(_SIGNATURE), destination=self.instance)
        if reason is not None:
            raise HTTPError(403, f"KV {what} refused: {SIGNATURE_HEADER} {reason}", code=refusal_code(reason))

    def refuse_unsigned_early(self, body: dict[str, Any], request: Request, signed: bool) -> None:
        """With a shared secret, an unsigned body carrying ``disaggregated_params`` that nothing
        else can admit (no ``x-trtllm-disagg-auth``, no ``accept_trtllm_orchestrator``) is refused
        once loaded, before its fields are read, any tokenizing or engine work; :meth:`authorize`
        decides the rest after parsing."""
        if signed or self.verifier is None or self.accept_trtllm_orchestrator:
            return
        if request.header(_TRTLLM_AUTH) is None and body.get(wire.DISAGGREGATED_PARAMS) is not None:
            raise HTTPError(
                403,
                f"disaggregated_params without a {SIGNATURE_HEADER}: internal requests must be signed",
                param=wire.DISAGGREGATED_PARAMS,
                code="missing_signature",
            )

    def authorize(self, req: ParsedRequest, request: Request, signed: bool) -> None:
        """Whether the leg may run (the rules of the module docstring); a 403 if not."""
        disagg = req.disagg
        if disagg is None or signed:
            return
        trtllm_header = request.header(_TRTLLM_AUTH)
        endpoint = disagg.raw.get(wire.CTX_INFO_ENDPOINT)
        opaque = disagg.raw.get(wire.ENCODED_OPAQUE_STATE)
        key = self.trtllm_key
        if key is not None and (endpoint is not None or opaque is not None):
            if trtllm_header is None:
                raise HTTPError(
                    403,
                    f"a {disagg.request_type} request naming ctx_info_endpoint or "
                    f"encoded_opaque_state must carry {TRTLLM_AUTH_HEADER} or {SIGNATURE_HEADER}",
                    param=wire.DISAGGREGATED_PARAMS,
                    code="missing_signature",
                )
            if not check_trtllm_disagg_auth(key, endpoint, opaque, trtllm_header):
                raise HTTPError(
                    403,
                    f"{TRTLLM_AUTH_HEADER} refused: it does not sign this request's "
                    "ctx_info_endpoint and encoded_opaque_state",
                    param=wire.DISAGGREGATED_PARAMS,
                    code="bad_signature",
                )
            return
        if self.verifier is not None and not self.accept_trtllm_orchestrator:
            raise HTTPError(
                403,
                f"{disagg.request_type} request without a {SIGNATURE_HEADER}",
                param=wire.DISAGGREGATED_PARAMS,
                code="missing_signature",
            )
