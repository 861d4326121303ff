"""vLLM with its MooncakeConnector (``worker_protocol: vllm``, ``vllm_transfer: mooncake``; docs/protocol.md,
"Worker protocols").

Push, and concurrent: the prefill sends the prompt's KV to the decode, which waits for it, so both legs
go at once (:mod:`..pair` runs them, as SGLang's; a failed leg cuts its partner, or the decode would wait
for a push that never comes). The router mints a ``transfer_id`` per pair (vLLM's example proxy,
``examples/online_serving/disaggregated_serving/mooncake_connector/``, does the same):

- prefill leg: as NIXL's (:class:`.vllm.VllmRelay`: one token, not streamed, ``stream_options`` and the
  min-token members cut) with ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill":
  false, "transfer_id": T}``; its answer carries no ``kv_transfer_params`` and is read and dropped;
- decode leg: the client's body as sent with ``kv_transfer_params: {"do_remote_decode": false,
  "do_remote_prefill": true, "transfer_id": T, "remote_bootstrap_addr": "http://<prefill host>:<port>",
  "remote_engine_id": E, "remote_dp_rank": 0}``; its answer is the client's.

The bootstrap port is the config's ``vllm_mooncake_bootstrap_port`` (vLLM's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``,
8998 by default: one per prefill host), the engine id what the prefill's bootstrap server answers at
``GET /query`` (``{engine_id: {dp_rank: ...}}``), read at health-check time (:meth:`VllmMooncakeProtocol.probe`):
a prefill without one is never chosen. Both legs carry one ``X-Request-Id``.
"""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp

from server.http import BodyPiece

from ..pools import Capabilities, Worker, read_json
from ..relay_common import ClientRequest
from .base import ProtocolConfig
from .sglang import SglangRelay
from .vllm import VllmProtocol, VllmRelay

#: the bootstrap server's route that names its engines (vLLM's MooncakeBootstrapServer)
QUERY_PATH = "/query"
_PREFILL = (
    b'"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"%s"},'
    b'"stream":false,"max_tokens":1'
)
_DECODE = (
    b'"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":"%s",'
    b'"remote_bootstrap_addr":"http://%s:%d","remote_engine_id":%s,"remote_dp_rank":0},'
)
_getrandbits = random.getrandbits


class VllmMooncakeRelay(VllmRelay):
    """The legs' bodies of vLLM's MooncakeConnector: :meth:`pair_legs` for :mod:`..pair`."""

    def __init__(self) -> None:
        #: worker URL -> its host as a bootstrap address names it (IPv6 bracketed)
        self._hosts: dict[str, bytes] = {}
        #: engine id -> its JSON text
        self._engines: dict[str, bytes] = {}

    def pair_legs(self, req: ClientRequest, prefill: Worker) -> tuple[list[BodyPiece], list[BodyPiece]]:
        """The prefill leg's and the decode leg's pieces, on one new ``transfer_id``."""
        transfer_id = b"%032x" % _getrandbits(128)
        front = _PREFILL % transfer_id
        prefill_pieces = self._prefill_pieces(req, front)
        host = self._hosts.get(prefill.url)
        if host is None:
            host = self._hosts[prefill.url] = SglangRelay.url_host(prefill.url).encode()
        engine_id = prefill.engine_id or ""
        engine = self._engines.get(engine_id) or self._engines.setdefault(
            engine_id, json.dumps(engine_id).encode()
        )
        first = req.parsed.first
        view = memoryview(req.body)
        params = _DECODE % (transfer_id, host, prefill.bootstrap_port or 0, engine)
        return prefill_pieces, [view[:first], params, view[first:]]


class VllmMooncakeProtocol(VllmProtocol):
    """vLLM with its MooncakeConnector: :class:`VllmMooncakeRelay`'s legs at once (``concurrent``), one
    ``X-Request-Id`` on both, no release endpoint, capabilities from ``/v1/models`` and the prefill's
    bootstrap server (:meth:`probe`)."""

    concurrent = True
    transfer = "mooncake"
    #: its decode workers could, but pair.py sends both legs or none: no local prefill, no decode-only
    serves_plain_request = False
    no_plain_request = (
        "with vllm_transfer: mooncake the legs run at once (pair.py), which sends no plain request yet"
    )
    #: a Mooncake prefill pushes to the decode the router named; NIXL's release request is not its
    releases_by_decode = False
    #: what pair.py's log says a prefill it skips lacks
    bootstrap_source = (
        "an engine id at its Mooncake bootstrap server's GET /query (vllm_mooncake_bootstrap_port)"
    )

    def __init__(self, config: ProtocolConfig) -> None:
        self.relay = VllmMooncakeRelay()
        self.bootstrap_port: int = config.vllm_mooncake_bootstrap_port

    @staticmethod
    def refusal(config: ProtocolConfig) -> str | None:
        refused = VllmProtocol.refusal(config)
        if refused is not None:
            return refused
        return None

    async def probe(
        self, session: aiohttp.ClientSession, worker: Worker, timeout: aiohttp.ClientTimeout
    ) -> Capabilities:
        """``/v1/models`` (as NIXL's), then the bootstrap server's ``/query`` on the worker's host: a
        prefill's engine id (rank 0's); a decode has no bootstrap server (no engine id: never a prefill)."""
        caps = self.capabilities(await read_json(session, worker.url + self.capabilities_path, timeout))
        if not caps.local_prefill:
            return caps
        host = SglangRelay.url_host(worker.url)
        engines = await read_json(session, f"http://{host}:{self.bootstrap_port}{QUERY_PATH}", timeout)
        engine_id = engine_of(engines)
        if engine_id is not None:
            caps.bootstrap_port = self.bootstrap_port
            caps.engine_id = engine_id
        return caps


def engine_of(engines: Any) -> str | None:
    """The engine id of DP rank 0 in a bootstrap server's ``/query`` answer (``{engine_id: {rank: ...}}``;
    a lone engine whatever its ranks); None on any doubt."""
    if not isinstance(engines, dict) or not engines:
        return None
    for engine_id, ranks in engines.items():
        if isinstance(ranks, dict) and "0" in ranks and engine_id:
            return str(engine_id)
    if len(engines) == 1 and (engine_id := next(iter(engines))):
        return str(engine_id)
    return None
