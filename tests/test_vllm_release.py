"""vLLM's NixlConnector release (server/orchestrator/protocols/vllm.py ``VllmProtocol.release``): a decode
request carrying a prefill answer's ``kv_transfer_params`` frees the prefill's blocks (vLLM's
``request_finished`` notifies the prefill whether the decode read them or was aborted before it ran), so
the protocol frees a lease a failed decode leg left held by sending one such request, the client's body
with ``stream: false`` and ``max_tokens: 1``, to a decode worker; one attempt, counted, never raised.
Real sockets on 127.0.0.1: the strict stand-ins of tests/vllm_standin.py share one KV plane."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from helpers import eventually
from vllm_standin import KVPlane, VllmStandin, start_vllm

from fastcore.relay import Relay
from server.http.pool import UpstreamPool
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.orchestrator.protocols import VllmMooncakeProtocol, VllmProtocol, VllmRelay
from server.orchestrator.relay_common import ClientRequest, ContextResult

CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 6,
    "stream": True,
    "stream_options": {"include_usage": True},
}
CHAT_PATH = b"/v1/chat/completions"


@pytest.fixture
def protocol(relay_twin: ModuleType) -> VllmProtocol:
    """VllmProtocol whose relay runs on one twin's relay kernels and span scanner."""
    scan = importlib.import_module(
        "fastcore._scan_py" if relay_twin.__name__.endswith("_py") else "fastcore._scan"
    )
    cls = type(
        f"VllmRelay_{relay_twin.__name__}", (VllmRelay,), {"relay": Relay(relay_twin), "scanner": scan}
    )
    proto = VllmProtocol.__new__(VllmProtocol)
    proto.relay = cls()
    proto.releases = {"sent": 0, "failed": 0}
    return proto


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[VllmStandin, VllmStandin]]:
    plane = KVPlane()
    prefill = await start_vllm("prefill", plane=plane)
    decode = await start_vllm("decode", plane=plane)
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


async def _prefilled(proto: VllmProtocol, prefill: VllmStandin) -> tuple[ClientRequest, ContextResult]:
    """Leg (1) sent to ``prefill`` as the orchestrator sends it; the client's request and its answer."""
    req = proto.relay.read_client(json.dumps(CHAT).encode(), True)
    pool = UpstreamPool(prefill.url)
    try:
        resp = await pool.request(
            b"POST", CHAT_PATH, proto.relay.context_pieces(req, 1), headers=proto.context_headers(req),
            timeout=5.0, max_body=1 << 20,
        )  # fmt: skip
        body = bytes(resp.body())
        resp.release()
    finally:
        pool.close()
    assert resp.status == 200, body
    return req, proto.relay.read_context(req, body)


async def test_a_release_request_frees_the_prefills_lease(
    protocol: VllmProtocol, pair: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, decode = pair
    req, ctx = await _prefilled(protocol, prefill)
    (rid,) = prefill.plane.held
    pool = UpstreamPool(decode.url)
    try:
        status = await protocol.release(pool, CHAT_PATH, req, ctx)
    finally:
        pool.close()
    assert status == 200 and protocol.releases == {"sent": 1, "failed": 0}
    assert await asyncio.wait_for(prefill.plane.released.get(), 5) == (rid, "read")
    assert not prefill.plane.held
    # what the decode got: the client's body with the prefill's params verbatim, one unstreamed token,
    # the legs' X-Request-Id; a strict vLLM stand-in finds no violation in it
    assert prefill.violations == decode.violations == []
    sent = decode.received()[0].body
    assert sent["kv_transfer_params"]["remote_request_id"] == rid
    assert sent["stream"] is False and sent["max_tokens"] == 1 and "stream_options" not in sent
    assert sent["messages"] == CHAT["messages"]


async def test_a_release_that_gets_no_answer_is_counted_not_raised(
    protocol: VllmProtocol, pair: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, decode = pair
    req, ctx = await _prefilled(protocol, prefill)
    decode.fault = "reset"
    pool = UpstreamPool(decode.url)
    try:
        status = await protocol.release(pool, CHAT_PATH, req, ctx)
    finally:
        pool.close()
    assert status is None and protocol.releases == {"sent": 0, "failed": 1}
    assert len(prefill.plane.held) == 1  # left to its lease (kv_lease_duration)


def test_only_nixl_releases_by_a_decode_request() -> None:
    assert VllmProtocol.releases_by_decode and not VllmMooncakeProtocol.releases_by_decode


class OnceFailing(VllmStandin):
    """A decode that answers its first request 5xx before its pull (as the fault bench's decode 5xx),
    then serves: a release sent to it afterwards reaches the engine."""

    failed_once = False

    async def _generate(self, request: Any, route: Any) -> Any:
        if not self.failed_once:
            self.failed_once = True
            self.fault = "5xx"
            try:
                return await super()._generate(request, route)
            finally:
                self.fault = None
        return await super()._generate(request, route)


async def test_a_decode_5xx_leaves_no_lease_held(request_path: str) -> None:
    plane = KVPlane()
    prefill = await start_vllm("prefill", plane=plane)
    decode = OnceFailing("decode", plane=plane)
    await decode.start()
    data: dict[str, Any] = {
        "port": 0,
        "health_check_interval_s": 0.1,
        "worker_protocol": "vllm",
        "context_servers": {"urls": [prefill.url]},
        "generation_servers": {"urls": [decode.url]},
    }
    server = None
    try:
        server, orch = await start_server(build_config(data, environ={}))
        assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers), timeout=30)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=CHAT) as resp:
            answer = await resp.json()
        # the client's answer is what it is today: the decode's failure, a 502
        assert resp.status == 502 and answer["error"]["code"] == "generation_leg_failed"
        _, why = await asyncio.wait_for(plane.released.get(), 10)  # not kv_lease_duration (30 s)
        assert why == "read" and not plane.held and prefill.violations == decode.violations == []
    finally:
        if server is not None:
            await server.cleanup()
        await prefill.stop()
        await decode.stop()
