"""trtllm-serve's disaggregated protocol (docs/protocol.md, legs (1)-(3)): the orchestrator's default.

Its legs' bodies are the relay mode's (:mod:`..relay_modes`: ``fast``, ``parsed``, ``parsed-msgpack``,
picked by the config key ``relay``), unchanged: this class only names what the orchestrator asks of
any worker protocol (:mod:`.`): the headers of each leg, whether a context worker's parked KV is
released on an abort, and where a worker's capabilities are read.
"""

from __future__ import annotations

from typing import Any

from fastcore import protocol as wire
from server.auth import TRTLLM_AUTH_HEADER, trtllm_disagg_auth

from ..pools import Capabilities
from ..relay_modes import ClientRequest, ContextResult, RelayMode, make_relay
from .base import ProtocolConfig

_TRTLLM_AUTH = TRTLLM_AUTH_HEADER.encode()


class TrtllmProtocol:
    """trtllm-serve's legs: the relay mode's bodies, its ``x-trtllm-disagg-auth``, /kv releases."""

    name = "trtllm"
    #: how the KV moves (the /metrics gauge fastcore_orchestrator_worker_protocol's label)
    transfer = wire.DISAGGREGATED_PARAMS
    #: the legs one after the other (context, then generation); sglang.py's run at once
    concurrent = False
    #: a fastcore context worker parks the prompt's KV behind an id, released by ``DELETE /kv/...``
    releases_kv = True
    #: a generation leg its worker may have read (then failed: a reset, no first byte) is sent again as it
    #: is to another worker: a fastcore generation worker whose KV fetch finds the /kv/<id> gone (read by
    #: the first) prefills the prompt from its ids, so the hand-off is not spent by a read
    resends_generation = True
    #: a generation worker whose /server_info says local_prefill (a fastcore worker) serves a client's
    #: plain request whole; trtllm-serve's do not say it, so they are never sent one
    serves_plain_request = True
    #: why it would not (protocols.refusal reads it where serves_plain_request is False)
    no_plain_request = ""
    #: where a worker says what it can do (pools.py's HealthChecker reads it when it becomes healthy)
    capabilities_path = wire.SERVER_INFO_PATH

    def __init__(self, config: ProtocolConfig) -> None:
        self.relay: RelayMode = make_relay(
            config.relay,
            tokids_b64=config.gen_tokids_ctxbytes,
            strip_history=config.gen_strip_message_history,
        )
        self.trtllm_key = config.trtllm_auth_key

    @staticmethod
    def refusal(config: ProtocolConfig) -> str | None:
        """Why ``config`` cannot run on this protocol (None: it can); every feature runs on trtllm's."""
        return None

    @staticmethod
    def capabilities(info: Any) -> Capabilities:
        return Capabilities.of(info)

    def context_headers(self, req: ClientRequest) -> bytes:
        """Header lines of leg (1) beside the relay mode's: none."""
        return b""

    def generation_headers(self, req: ClientRequest, ctx: ContextResult | None) -> bytes:
        """trtllm-serve's ``x-trtllm-disagg-auth`` line for leg (3) (docs/protocol.md): it signs the
        context response's ``ctx_info_endpoint`` and ``encoded_opaque_state`` (found by the relay's
        own scan), which leg (3) carries verbatim; a leg with neither, or no key, needs none."""
        if self.trtllm_key is None or ctx is None:
            return b""
        endpoint, state = self.relay.auth_fields(ctx)
        if endpoint is None and state is None:
            return b""
        return b"%s: %s\r\n" % (_TRTLLM_AUTH, trtllm_disagg_auth(self.trtllm_key, endpoint, state).encode())
