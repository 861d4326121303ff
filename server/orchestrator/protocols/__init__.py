"""Worker protocols: what the orchestrator's legs say to its workers, one module per engine.

A protocol owns what is the engine's in a disaggregated completion: the legs' bodies (its ``relay``,
in the relay-mode interface of :mod:`..relay_modes`), their header lines (``context_headers``,
``generation_headers``: trtllm-serve's auth, vLLM's ``X-Request-Id``), whether a context worker's
parked KV is released on an abort (``releases_kv``), whether a generation leg its worker may have
read can be sent again as it is or costs a new context leg (``resends_generation``), whether a decode
worker may serve a client's plain request (``serves_plain_request``: local prefill, conditional
disaggregation; each worker's capabilities say whether it does), where and how a
worker's capabilities are read (``capabilities_path``, ``capabilities``), and the features it does
not run yet (``refusal``: the config is refused at startup, naming why). The sequence (context leg,
then generation leg), routers, breakers, retries, admission and metrics are the orchestrator's, the
same for every protocol.

- ``trtllm`` (:mod:`.trtllm`, the default): trtllm-serve's protocol, today's relay modes;
- ``vllm`` (:mod:`.vllm`): vLLM with its NixlConnector; ``vllm_transfer: mooncake`` (:mod:`.vllm_mooncake`):
  with its MooncakeConnector, both legs at once (``concurrent``);
- ``sglang`` (:mod:`.sglang`): SGLang's bootstrap, both legs at once (``concurrent``: run by ..pair.py).

A new protocol is one module here with a class of that shape, and its name in :data:`PROTOCOLS`
(config.py's ``WorkerProtocolName`` lists the names the config takes).
"""

from __future__ import annotations

from .base import ProtocolConfig, plain_request_refusal
from .sglang import SglangProtocol, SglangRelay
from .trtllm import TrtllmProtocol
from .vllm import VllmProtocol, VllmRelay
from .vllm_mooncake import VllmMooncakeProtocol, VllmMooncakeRelay

#: the config's ``worker_protocol`` that reads each worker's (protocols/detect.py)
AUTO = "auto"
WorkerProtocol = TrtllmProtocol | VllmProtocol | VllmMooncakeProtocol | SglangProtocol
#: config ``worker_protocol`` -> its class
PROTOCOLS: dict[str, type[TrtllmProtocol] | type[VllmProtocol] | type[SglangProtocol]] = {
    TrtllmProtocol.name: TrtllmProtocol,
    VllmProtocol.name: VllmProtocol,
    SglangProtocol.name: SglangProtocol,
}


def _protocol_class(
    config: ProtocolConfig,
) -> type[TrtllmProtocol] | type[VllmProtocol] | type[VllmMooncakeProtocol] | type[SglangProtocol]:
    """``worker_protocol``'s class; vLLM's ``vllm_transfer: mooncake`` is its concurrent variant."""
    if config.worker_protocol == AUTO:
        raise ValueError("worker_protocol: auto is resolved from the workers first (app.start_server)")
    if config.worker_protocol == VllmProtocol.name and config.vllm_transfer == "mooncake":
        return VllmMooncakeProtocol
    return PROTOCOLS[config.worker_protocol]


def make_protocol(config: ProtocolConfig) -> WorkerProtocol:
    return _protocol_class(config)(config)


def refusal(config: ProtocolConfig) -> str | None:
    """Why ``config``'s features cannot run on its ``worker_protocol`` (None: they can; ``auto``'s are
    asked again of the protocol the workers speak, once known)."""
    if config.worker_protocol == AUTO:
        return None
    protocol = _protocol_class(config)
    refused = protocol.refusal(config)
    if refused is None and not protocol.serves_plain_request:
        refused = plain_request_refusal(config, protocol.no_plain_request)
    return refused


__all__ = [
    "AUTO",
    "PROTOCOLS",
    "SglangProtocol",
    "SglangRelay",
    "TrtllmProtocol",
    "VllmMooncakeProtocol",
    "VllmMooncakeRelay",
    "VllmProtocol",
    "VllmRelay",
    "WorkerProtocol",
    "make_protocol",
    "refusal",
]
