"""``worker_protocol: vllm`` with ``vllm_transfer: mooncake`` (server/orchestrator/protocols/vllm_mooncake.py,
pair.py; docs/protocol.md "Worker protocols"): the legs' bodies on both fastcore twins, the bootstrap
server's ``/query`` read, the refusals, and a real orchestrator on 127.0.0.1 in front of strict vLLM
MooncakeConnector stand-ins (tests/vllm_standin.py) on both request paths (a concurrent protocol takes the
coroutine path on each): chat and completions, unary and streamed, each answer what one vLLM worker
serving the whole request answers, no protocol violation, the decode got its prefill's push; a prefill
that fails cuts the waiting decode (the stand-in sees its connection go) and is the client's 502; a
decode that fails is the client's 502. The stand-ins and the orchestrator share this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from engine_standin import Answer, Received, Refused, Route, iter_events, streamed_text
from helpers import eventually
from vllm_standin import KVPlane, VllmStandin, start_vllm

from bench import engine_protocols as rules
from fastcore.relay import Relay
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import ConfigError, build_config
from server.orchestrator.pools import Worker
from server.orchestrator.protocols import VllmMooncakeProtocol, VllmMooncakeRelay, make_protocol
from server.orchestrator.protocols.vllm_mooncake import engine_of

CHAT_BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Name three colours, then three fruits."}],
    "max_tokens": 6,
}
COMPLETION_BODY: dict[str, Any] = {
    "model": "tiny",
    "prompt": "Once upon a time, in a land far away,",
    "max_tokens": 6,
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


# -- the legs' bodies, on both twins --------------------------------------------------------------


@pytest.fixture
def relay(relay_twin: ModuleType) -> VllmMooncakeRelay:
    scan = importlib.import_module(
        "fastcore._scan_py" if relay_twin.__name__.endswith("_py") else "fastcore._scan"
    )
    cls = type(
        f"VllmMooncakeRelay_{relay_twin.__name__}",
        (VllmMooncakeRelay,),
        {"relay": Relay(relay_twin), "scanner": scan},
    )
    return cls()


@pytest.mark.parametrize(
    ("url", "host"), [("http://127.0.0.1:8100", "127.0.0.1"), ("http://[::1]:8100", "[::1]")]
)
@pytest.mark.parametrize("stream", [False, True])
def test_the_legs_share_one_transfer_id_and_name_the_prefills_bootstrap(
    relay: VllmMooncakeRelay, url: str, host: str, stream: bool
) -> None:
    body = {**CHAT_BODY, "max_completion_tokens": 6}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True}, min_tokens=2)
    req = relay.read_client(json.dumps(body).encode(), True)
    prefill = Worker(url)
    prefill.bootstrap_port, prefill.engine_id = 8998, 'engine "0"'
    prefill_pieces, decode_pieces = relay.pair_legs(req, prefill)
    sent_prefill = json.loads(b"".join(prefill_pieces))
    sent_decode = json.loads(b"".join(decode_pieces))
    assert rules.check_vllm_prefill(sent_prefill, True, "mooncake") == []
    assert rules.check_vllm_decode(sent_decode, "mooncake") == []
    transfer_id = sent_prefill["kv_transfer_params"]["transfer_id"]
    assert sent_prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                  "transfer_id": transfer_id}  # fmt: skip
    assert sent_decode == {**body, "kv_transfer_params": {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_bootstrap_addr": f"http://{host}:8998", "remote_engine_id": 'engine "0"', "remote_dp_rank": 0,
    }}  # fmt: skip
    again, _ = relay.pair_legs(req, prefill)
    assert json.loads(b"".join(again))["kv_transfer_params"]["transfer_id"] != transfer_id  # one per pair


def test_the_engine_id_is_rank_0s_of_the_bootstrap_servers_query() -> None:
    assert engine_of({"e1": {"1": {}}, "e0": {"0": {"host": "h"}}}) == "e0"
    assert engine_of({"lone": {}}) == "lone"
    for bad in ({}, [], None, "e", {"a": {}, "b": {}}, {"": {"0": {}}}):
        assert engine_of(bad) is None


def _config(**extra: Any) -> dict[str, Any]:
    return {"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]},
            "worker_protocol": "vllm", "vllm_transfer": "mooncake", **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("relay", "parsed"),
        ("gen_tokids_ctxbytes", True),
        ("context_fallback", "local_prefill"),
        ("conditional_disagg_config", {"max_local_prefill_length": 8}),
    ],
)
def test_features_not_built_for_mooncake_are_refused_at_startup(key: str, value: Any) -> None:
    extra: dict[str, Any] = {key: value}
    if key == "conditional_disagg_config":
        extra["generation_servers"] = {"urls": ["b:1"], "router": {"type": "kv_cache_aware"}}
    with pytest.raises(ConfigError, match=f"worker_protocol: vllm: {key}") as err:
        build_config(_config(**extra), environ={}).check_runnable()
    if key in ("context_fallback", "conditional_disagg_config"):
        assert "no plain request" in str(err.value)  # why: pair.py sends both legs or none
    config = build_config(_config(), environ={})
    config.check_runnable()
    assert isinstance(make_protocol(config), VllmMooncakeProtocol) and make_protocol(config).concurrent
    assert not make_protocol(build_config(_config(vllm_transfer="nixl"), environ={})).concurrent
    with pytest.raises(ConfigError, match="vllm_transfer"):
        build_config(_config(vllm_transfer="lmcache"), environ={})


# -- a real orchestrator in front of strict stand-ins ---------------------------------------------


class Leg(VllmStandin):
    """A strict Mooncake stand-in that says when a leg's connection was cut while it served it."""

    def __init__(self, role: Any, **options: Any) -> None:
        super().__init__(role, connector="mooncake", **options)
        self.cut = asyncio.Event()
        #: False: a prefill that fails (500) without pushing, once its decode waits for the push
        self.pushes = True
        #: True: a prefill that never answers (nor pushes)
        self.stalls = False

    async def serve(self, request: Any, rec: Received, route: Route) -> Answer:
        try:
            if self.stalls:
                await self.wait_forever()
            if not self.pushes:
                await eventually(lambda: bool(self.plane.waiting), timeout=30)
                raise Refused("Prefill failed before its push (stand-in)", 500, "InternalServerError")
            return await super().serve(request, rec, route)
        except asyncio.CancelledError:
            self.cut.set()
            raise


@dataclass
class Stack:
    orch: Orchestrator
    url: str
    prefill: Leg
    decode: Leg
    reference: VllmStandin
    session: aiohttp.ClientSession

    async def post(self, route: str, body: dict[str, Any], *, reference: bool = False) -> tuple[int, bytes]:
        url = (self.reference.url if reference else self.url) + PATHS[route]
        async with self.session.post(url, json=body) as resp:
            return resp.status, await resp.read()

    def violations(self) -> list[str]:
        return [v for w in (self.prefill, self.decode, self.reference) for v in w.violations]


def legs(worker: VllmStandin) -> list[Received]:
    return [r for r in worker.requests if r.method == "POST"]


@asynccontextmanager
async def mooncake_stack(
    request_path: str, prefill_class: type[Leg] = Leg, **config: Any
) -> AsyncIterator[Stack]:
    """A Mooncake prefill (its bootstrap server on a port from the kernel, the config's) and decode on one
    KV plane, a reference ``both`` worker, an orchestrator with ``vllm_transfer: mooncake``."""
    plane = KVPlane()
    prefill = prefill_class("prefill", plane=plane, transfer_timeout_s=30.0)
    decode = Leg("decode", plane=plane, transfer_timeout_s=30.0)
    for worker in (prefill, decode):
        await worker.start()
    reference = await start_vllm("both")
    data: dict[str, Any] = {
        "port": 0,
        "health_check_interval_s": 0.1,
        "worker_protocol": "vllm",
        "vllm_transfer": "mooncake",
        "vllm_mooncake_bootstrap_port": prefill.bootstrap_port,
        "context_servers": {"urls": [prefill.url]},
        "generation_servers": {"urls": [decode.url]},
        **config,
    }
    if request_path == "tasks":
        data["admission"] = {"max_inflight": 4}
    server = None
    try:
        server, orch = await start_server(build_config(data, environ={}))
        assert orch.callbacks == (request_path == "callbacks")  # both legs at once, from callbacks too
        port = server.sockets[0].getsockname()[1]
        assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers), timeout=30)
        async with aiohttp.ClientSession() as session:
            yield Stack(orch, f"http://127.0.0.1:{port}", prefill, decode, reference, session)
    finally:
        if server is not None:
            await server.cleanup()
        for worker in (prefill, decode, reference):
            await worker.stop()


def _body(route: str, stream: bool) -> dict[str, Any]:
    body = dict(CHAT_BODY if route == "chat" else COMPLETION_BODY)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True}, min_tokens=2)
    return body


def _seen(raw: bytes, route: str, stream: bool) -> tuple[Any, ...]:
    if stream:
        events = [e for e in iter_events(raw) if isinstance(e, dict)]
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        return streamed_text(raw, route), finish, [e["usage"] for e in events if e.get("usage")]
    answer = json.loads(raw)
    choice = answer["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    return text, choice["finish_reason"], answer["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_answers_what_one_vllm_worker_answers(request_path: str, route: str, stream: bool) -> None:
    async with mooncake_stack(request_path) as stack:
        prefill_worker = stack.orch.context_pool.workers[0]
        assert prefill_worker.engine_id == stack.prefill.engine_id  # read from the bootstrap's /query
        body = _body(route, stream)
        status, raw = await stack.post(route, body)
        ref_status, ref = await stack.post(route, body, reference=True)
        assert (status, ref_status) == (200, 200), raw[:300]
        assert _seen(raw, route, stream) == _seen(ref, route, stream)
        assert stack.violations() == []
        (prefill,), (decode,) = legs(stack.prefill), legs(stack.decode)
        assert decode.kv_match is True  # the decode got its prefill's push
        assert prefill.headers["x-request-id"] == decode.headers["x-request-id"]
        ktp = decode.body["kv_transfer_params"]
        assert ktp["transfer_id"] == prefill.body["kv_transfer_params"]["transfer_id"]
        assert ktp["remote_bootstrap_addr"] == stack.prefill.bootstrap_addr
        assert decode.body == {"kv_transfer_params": ktp, **body}
        async with stack.session.get(stack.url + "/metrics") as resp:
            page = (await resp.text()).splitlines()
        assert 'fastcore_orchestrator_worker_protocol{protocol="vllm",transfer="mooncake"} 1.0' in page


async def test_a_failed_prefill_cuts_the_waiting_decode_and_is_a_502(request_path: str) -> None:
    async with mooncake_stack(request_path) as stack:
        stack.prefill.pushes = False
        status, raw = await stack.post("chat", CHAT_BODY)
        assert status == 502 and json.loads(raw)["error"]["code"] == "context_leg_failed", raw[:300]
        assert await eventually(stack.decode.cut.is_set, timeout=30)  # cut, not left waiting for 30 s


async def test_a_failed_decode_is_a_502(request_path: str) -> None:
    async with mooncake_stack(request_path) as stack:
        stack.decode.fault = "5xx"
        status, raw = await stack.post("completions", COMPLETION_BODY)
        assert status == 502 and json.loads(raw)["error"]["code"] == "generation_leg_failed", raw[:300]
        stack.decode.fault = None
        status, raw = await stack.post("completions", COMPLETION_BODY)
        assert status == 200 and stack.violations() == []


class NoEngine(Leg):
    """A prefill whose bootstrap server names no engine (``GET /query`` answers ``{}``)."""

    async def _query(self, request: web.Request) -> web.Response:
        return self.json({})


async def test_a_prefill_whose_bootstrap_names_no_engine_is_never_chosen(request_path: str) -> None:
    async with mooncake_stack(request_path, prefill_class=NoEngine) as stack:
        (prefill,) = stack.orch.context_pool.workers
        assert prefill.healthy and prefill.engine_id is None and prefill.bootstrap_port is None
        status, raw = await stack.post("chat", CHAT_BODY)
        assert status == 503 and "prefill worker" in json.loads(raw)["error"]["message"], raw[:300]
        assert legs(stack.prefill) == [] and legs(stack.decode) == []


async def test_a_client_that_leaves_cuts_both_legs(request_path: str) -> None:
    async with mooncake_stack(request_path) as stack:
        stack.prefill.stalls = True  # the decode waits for a push that does not come
        sent = asyncio.get_running_loop().create_task(stack.post("chat", CHAT_BODY))
        assert await eventually(lambda: bool(stack.prefill.plane.waiting) and legs(stack.prefill), timeout=10)
        sent.cancel()  # the client's connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await sent
        await asyncio.wait_for(asyncio.gather(stack.prefill.cut.wait(), stack.decode.cut.wait()), 10)
        assert await eventually(lambda: stack.orch.in_flight == 0, timeout=10)


async def test_a_decode_that_resets_cuts_the_prefill_and_is_a_502(request_path: str) -> None:
    async with mooncake_stack(request_path) as stack:
        stack.prefill.stalls = True
        stack.decode.fault = "reset"
        status, raw = await stack.post("completions", COMPLETION_BODY)
        assert status == 502 and json.loads(raw)["error"]["code"] == "generation_leg_failed", raw[:300]
        await asyncio.wait_for(stack.prefill.cut.wait(), 10)
