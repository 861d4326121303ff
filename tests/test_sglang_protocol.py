"""``worker_protocol: sglang`` (server/orchestrator/protocols/sglang.py, pair.py; docs/protocol.md "Worker
protocols"): the legs' body on both fastcore twins, and a real orchestrator on 127.0.0.1 in front of
strict SGLang stand-ins (tests/sglang_standin.py) on both request paths (a concurrent protocol takes the
coroutine path on each): chat and completions, unary and streamed, each answer what the stand-ins answer
a mini_lb-style pair, no protocol violation; a leg that fails (5xx, reset) cuts its partner (the
stand-in sees its connection go: an event, no sleeps) and the client gets a 502, or a retry on another
pair with a new room; a client that leaves cuts both. The stand-ins and the orchestrator share this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from engine_standin import Answer, Received, Refused, Route, iter_events, streamed_text
from helpers import eventually
from sglang_standin import BootstrapPlane, SglangStandin

from bench import engine_protocols as rules
from fastcore.relay import Relay
from server.errors import HTTPError
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import ConfigError, build_config
from server.orchestrator.pair import PairExchange
from server.orchestrator.pools import Worker
from server.orchestrator.protocols import SglangProtocol, SglangRelay, VllmProtocol

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
#: a failed leg cuts its partner within this (the target is 100 ms; the bound leaves room for a loaded host)
CUT_BOUND_S = 1.0


# -- the legs' body, on both twins ----------------------------------------------------------------


@pytest.fixture
def relay(relay_twin: ModuleType) -> SglangRelay:
    scan = importlib.import_module(
        "fastcore._scan_py" if relay_twin.__name__.endswith("_py") else "fastcore._scan"
    )
    cls = type(
        f"SglangRelay_{relay_twin.__name__}", (SglangRelay,), {"relay": Relay(relay_twin), "scanner": scan}
    )
    return cls()


def _worker(url: str, port: int | None = 8998) -> Worker:
    worker = Worker(url)
    worker.bootstrap_port = port
    return worker


@pytest.mark.parametrize(
    ("url", "host"),
    [("http://127.0.0.1:30000", "127.0.0.1"), ("http://[::1]:30000", "[::1]"), ("p0:1", "p0")],
)
def test_both_legs_carry_the_clients_body_and_the_bootstrap_triple(
    relay: SglangRelay, url: str, host: str
) -> None:
    body = b' {"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    req = relay.read_client(body, True)
    leg = b"".join(relay.pair_pieces(req, _worker(url), (1 << 63) - 1))
    sent = json.loads(leg)
    assert sent == {**json.loads(body), "bootstrap_host": host, "bootstrap_port": 8998,
                    "bootstrap_room": (1 << 63) - 1}  # fmt: skip
    assert rules.check_sglang(sent) == []
    assert leg.endswith(body[body.index(b'"messages"') :])  # the client's bytes as sent, after the triple


@pytest.mark.parametrize("field", ["bootstrap_room", "bootstrap_host", "bootstrap_port"])
def test_a_clients_own_bootstrap_member_is_a_400(relay: SglangRelay, field: str) -> None:
    with pytest.raises(HTTPError) as err:
        relay.read_client(json.dumps({**CHAT_BODY, field: 1}).encode(), True)
    assert err.value.status == 400 and err.value.param == field


def test_the_bootstrap_port_comes_from_a_prefills_server_info() -> None:
    info = {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998}
    assert SglangProtocol.capabilities(info).bootstrap_port == 8998
    for bad in ({**info, "disaggregation_mode": "decode"}, {**info, "disaggregation_bootstrap_port": "8998"},
                {**info, "disaggregation_bootstrap_port": 0}, [], None):  # fmt: skip
        caps = SglangProtocol.capabilities(bad)
        assert caps.bootstrap_port is None and not caps.local_prefill


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("relay", "parsed"),
        ("gen_tokids_ctxbytes", True),
        ("context_fallback", "local_prefill"),
        ("conditional_disagg_config", {"max_local_prefill_length": 8}),
    ],
)
def test_features_not_built_for_sglang_are_refused_at_startup(key: str, value: Any) -> None:
    data: dict[str, Any] = {"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]},
                            "worker_protocol": "sglang", key: value}  # fmt: skip
    if key == "conditional_disagg_config":
        data["generation_servers"]["router"] = {"type": "kv_cache_aware"}
    with pytest.raises(ConfigError, match=f"worker_protocol: sglang: {key}"):
        build_config(data, environ={}).check_runnable()
    data["worker_protocol"] = "trtllm"
    build_config(data, environ={}).check_runnable()


@pytest.mark.parametrize(
    ("key", "value"),
    [("context_fallback", "local_prefill"), ("conditional_disagg_config", {"max_local_prefill_length": 8})],
)
def test_what_needs_a_decode_serving_a_plain_request_is_refused_naming_why(key: str, value: Any) -> None:
    """SGLang's decode workers cannot serve a request alone (serves_plain_request): local prefill and
    conditional disaggregation are refused saying so; vLLM's can, so both start there; the default
    context_fallback (not set) starts on SGLang (a failed pair goes to another prefill worker)."""
    assert not SglangProtocol.serves_plain_request and VllmProtocol.serves_plain_request
    data: dict[str, Any] = {"context_servers": {"urls": ["a:1"]},
                            "generation_servers": {"urls": ["b:1"], "router": {"type": "kv_cache_aware"}},
                            "worker_protocol": "sglang", key: value}  # fmt: skip
    with pytest.raises(ConfigError, match="cannot serve a plain request") as err:
        build_config(data, environ={}).check_runnable()
    assert str(err.value).startswith(f"worker_protocol: sglang: {key}: ")
    build_config({**data, "worker_protocol": "vllm"}, environ={}).check_runnable()
    del data[key]
    build_config(data, environ={}).check_runnable()


# -- a real orchestrator in front of strict stand-ins ---------------------------------------------

How = Literal["5xx", "reset", "stall"]


class Leg(SglangStandin):
    """A strict SGLang stand-in that says when a leg reaches it and when its connection is cut, and
    with ``how`` fails its legs once its partner joined the room: the prefill once the decode
    bootstrapped, the decode once the prefill computed (as a failed transfer does)."""

    def __init__(self, mode: Any, *, plane: BootstrapPlane, how: How | None = None) -> None:
        super().__init__(mode, plane=plane)
        self.how = how
        self.arrived = asyncio.Event()
        self.cut = asyncio.Event()
        self.failed_at = self.cut_at = 0.0

    async def serve(self, request: Any, rec: Received, route: Route) -> Answer:
        self.arrived.set()
        try:
            if self.how is None:
                return await super().serve(request, rec, route)
            body = rec.body
            room = self.plane.room((body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]))
            if self.mode == "prefill":
                await room.bootstrapped.wait()
            else:
                await asyncio.shield(room.prefilled)
            self.failed_at = time.monotonic()
            if self.how == "5xx":
                raise Refused("Prefill transfer failed (stand-in)", 500, "InternalServerError")
            if self.how == "reset":
                await self.reset(request)
            await self.wait_forever()
            raise AssertionError("unreachable")
        except asyncio.CancelledError:
            if not self.cut.is_set():
                self.cut_at = time.monotonic()
                self.cut.set()
            raise


class StreamThenStall(Leg):
    """A decode that streams its first event, says so (``streaming``), then waits until it is cut."""

    def __init__(self, mode: Any, *, plane: BootstrapPlane, how: How | None = None) -> None:
        super().__init__(mode, plane=plane, how=how)
        self.streaming = asyncio.Event()

    async def _stream(self, request: Any, rec: Received, route: Route, answer: Answer) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        rec.status = 200
        await out.write(
            b'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}\n\n'
        )
        self.streaming.set()
        try:
            await self.wait_forever()
        except asyncio.CancelledError:
            self.cut_at = time.monotonic()
            self.cut.set()
            raise
        return out


class FailsOnceDecodeStreams(Leg):
    """A prefill that pushes its KV, then answers 500 once its decode's stream has begun."""

    partner: StreamThenStall

    async def _prefill(self, key: Any, ids: list[int]) -> None:
        await super()._prefill(key, ids)
        await self.partner.streaming.wait()
        self.failed_at = time.monotonic()
        raise Refused("Prefill failed after the transfer (stand-in)", 500, "InternalServerError")


class FailsOnceTheClientHasItsAnswer(Leg):
    """A prefill that pushes its KV, then answers 500 once the test says the client has its (unary) answer."""

    client_has_it: asyncio.Event

    async def _prefill(self, key: Any, ids: list[int]) -> None:
        await super()._prefill(key, ids)
        await self.client_has_it.wait()
        raise Refused("Prefill failed after the transfer (stand-in)", 500, "InternalServerError")


class NoBootstrapPort(Leg):
    """A prefill whose /server_info publishes no disaggregation_bootstrap_port."""

    def server_info(self) -> dict[str, Any]:
        info = super().server_info()
        del info["disaggregation_bootstrap_port"]
        return info


@dataclass
class Stack:
    orch: Orchestrator
    url: str
    prefills: list[Leg]
    decodes: list[Leg]
    session: aiohttp.ClientSession

    async def post(self, route: str, body: dict[str, Any], key: str | None = None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.post(self.url + PATHS[route], json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    async def reference(self, route: str, body: dict[str, Any], room: int = 12345) -> bytes:
        """What the stand-ins answer a mini_lb-style pair sent by hand (both at once; the decode's)."""
        prefill, decode = self.prefills[0], self.decodes[0]
        leg = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
               "bootstrap_room": room}  # fmt: skip

        async def send(worker: Leg) -> bytes:
            async with self.session.post(worker.url + PATHS[route], json=leg) as resp:
                assert resp.status == 200
                return await resp.read()

        _, answer = await asyncio.gather(send(prefill), send(decode))
        return answer

    def violations(self) -> list[str]:
        return [v for w in (*self.prefills, *self.decodes) for v in w.violations]


def legs(worker: Leg) -> list[Received]:
    return [r for r in worker.requests if r.method == "POST"]


@asynccontextmanager
async def sglang_stack(request_path: str, prefills: list[How | None] | None = None,
                       decodes: list[How | None] | None = None, router: str = "round_robin",
                       prefill_class: type[Leg] = Leg, decode_class: type[Leg] = Leg,
                       **config: Any) -> AsyncIterator[Stack]:  # fmt: skip
    """Prefill and decode stand-ins on one bootstrap plane, an orchestrator with ``worker_protocol:
    sglang`` (with ``request_path == "tasks"``: the admission queue on too)."""
    plane = BootstrapPlane()
    started = [prefill_class("prefill", plane=plane, how=how) for how in (prefills or [None])]
    started += [decode_class("decode", plane=plane, how=how) for how in (decodes or [None])]
    for worker in started:
        await worker.start()
    p = [w for w in started if w.mode == "prefill"]
    d = [w for w in started if w.mode == "decode"]
    data: dict[str, Any] = {
        "port": 0,
        "health_check_interval_s": 0.1,
        "worker_protocol": "sglang",
        "context_servers": {"urls": [w.url for w in p], "router": {"type": router}},
        "generation_servers": {"urls": [w.url for w in d], "router": {"type": router}},
        **config,
    }
    if request_path == "tasks":
        data["admission"] = {"max_inflight": 4}
    server = None
    try:
        server, orch = await start_server(build_config(data, environ={}))
        assert orch.callbacks == (request_path == "callbacks")  # both legs at once, from callbacks too
        port = server.sockets[0].getsockname()[1]
        assert await eventually(
            lambda: all(w.healthy for pool in orch.pools for w in pool.workers), timeout=30
        )
        async with aiohttp.ClientSession() as session:
            yield Stack(orch, f"http://127.0.0.1:{port}", p, d, session)
    finally:
        if server is not None:
            await server.cleanup()
        for worker in started:
            await worker.stop()


def _body(route: str, stream: bool) -> dict[str, Any]:
    body = dict(CHAT_BODY if route == "chat" else COMPLETION_BODY)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _seen(raw: bytes, route: str, stream: bool) -> tuple[Any, ...]:
    """What a client sees of an answer: text, finish reason, usage."""
    if stream:
        events = [e for e in iter_events(raw) if isinstance(e, dict)]
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        usage = [e["usage"] for e in events if e.get("usage")]
        return streamed_text(raw, route), finish, usage
    answer = json.loads(raw)
    choice = answer["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    return text, choice["finish_reason"], answer["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_answers_what_the_standins_answer_a_pair(request_path: str, route: str, stream: bool) -> None:
    async with sglang_stack(request_path) as stack:
        body = _body(route, stream)
        status, raw = await stack.post(route, body)
        assert status == 200, raw[:300]
        ref = await stack.reference(route, body)
        assert _seen(raw, route, stream) == _seen(ref, route, stream)
        assert stack.violations() == []
        (prefill, _), (decode, _) = legs(stack.prefills[0]), legs(stack.decodes[0])
        assert decode.kv_match is True  # the decode got its prefill's KV, in one room
        triple = {"bootstrap_host": "127.0.0.1", "bootstrap_port": stack.prefills[0].bootstrap_port,
                  "bootstrap_room": decode.body["bootstrap_room"]}  # fmt: skip
        assert prefill.body == decode.body == {**body, **triple}
        assert prefill.status == 200 and not stack.prefills[0].plane.rooms  # no room left waiting
        assert [r.path for r in stack.prefills[0].requests if r.method == "GET"].count("/server_info") >= 1


@pytest.mark.parametrize("how", ["5xx", "reset"])
async def test_a_failed_prefill_cuts_the_decode_and_is_a_502(request_path: str, how: How) -> None:
    async with sglang_stack(request_path, prefills=[how]) as stack:
        status, raw = await stack.post("chat", CHAT_BODY)
        assert status == 502 and json.loads(raw)["error"]["code"] == "context_leg_failed", raw[:300]
        decode, prefill = stack.decodes[0], stack.prefills[0]
        await asyncio.wait_for(decode.cut.wait(), 10)  # the decode's connection went
        assert decode.cut_at - prefill.failed_at < CUT_BOUND_S
        assert len(legs(decode)) == 1 and stack.violations() == []


@pytest.mark.parametrize("how", ["5xx", "reset"])
async def test_a_failed_decode_cuts_the_prefill(request_path: str, how: How) -> None:
    async with sglang_stack(request_path, decodes=[how]) as stack:
        status, raw = await stack.post("completions", _body("completions", True))
        assert status == 502 and json.loads(raw)["error"]["code"] == "generation_leg_failed", raw[:300]
        decode, prefill = stack.decodes[0], stack.prefills[0]
        await asyncio.wait_for(prefill.cut.wait(), 10)
        assert prefill.cut_at - decode.failed_at < CUT_BOUND_S
        assert await eventually(lambda: not prefill.plane.rooms, timeout=10)  # no room left waiting


async def test_a_failed_pair_is_retried_on_another_with_a_new_room(request_path: str) -> None:
    async with sglang_stack(request_path, prefills=["reset", None]) as stack:
        for _ in range(2):  # round robin: one of them goes to the resetting prefill first
            status, raw = await stack.post("chat", CHAT_BODY)
            assert status == 200, raw[:300]
        broken, good = stack.prefills
        decoded = legs(stack.decodes[0])
        # each pair with the resetting prefill (one at least: round robin) was sent again, with the good one
        failed = len(legs(broken))
        assert failed >= 1 and len(legs(good)) == 2 and len(decoded) == 2 + failed
        rooms = [leg.body["bootstrap_room"] for leg in decoded]
        assert len(set(rooms)) == len(rooms)  # a new room for each retried pair
        assert {leg.body["bootstrap_port"] for leg in decoded} == {broken.bootstrap_port, good.bootstrap_port}
        assert [leg.kv_match for leg in decoded].count(True) == 2 and stack.violations() == []


async def test_a_client_that_leaves_cuts_both_legs(request_path: str) -> None:
    async with sglang_stack(request_path, prefills=["stall"], decodes=["stall"]) as stack:
        sent = asyncio.get_running_loop().create_task(stack.post("chat", CHAT_BODY))
        prefill, decode = stack.prefills[0], stack.decodes[0]
        # the stalled legs wait for their partners: both arrive, then stall
        await asyncio.wait_for(asyncio.gather(prefill.arrived.wait(), decode.arrived.wait()), 10)
        sent.cancel()  # the client's connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await sent
        await asyncio.wait_for(asyncio.gather(prefill.cut.wait(), decode.cut.wait()), 10)
        assert await eventually(lambda: stack.orch.in_flight == 0, timeout=10)


async def test_a_pair_from_callbacks_is_one_exchange_and_no_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both legs in flight at once, started from the client's request by one PairExchange with no task
    of its own (the coroutine path runs a task per leg); the client leaving cuts both, every count back."""
    monkeypatch.setattr(Orchestrator, "serve_from_callbacks", True)
    async with sglang_stack("callbacks", prefills=["stall"], decodes=["stall"]) as stack:
        sent = asyncio.get_running_loop().create_task(stack.post("chat", CHAT_BODY))
        prefill, decode = stack.prefills[0], stack.decodes[0]
        await asyncio.wait_for(asyncio.gather(prefill.arrived.wait(), decode.arrived.wait()), 10)
        serving = list(stack.orch._serving)
        assert len(serving) == 1 and isinstance(serving[0], PairExchange) and serving[0].task is None
        sent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sent
        await asyncio.wait_for(asyncio.gather(prefill.cut.wait(), decode.cut.wait()), 10)
        workers = [w for pool in stack.orch.pools for w in pool.workers]
        assert await eventually(lambda: stack.orch.in_flight == 0 and all(w.in_flight == 0 for w in workers))


async def test_a_client_bootstrap_room_never_reaches_a_worker(request_path: str) -> None:
    async with sglang_stack(request_path) as stack:
        status, raw = await stack.post("chat", {**CHAT_BODY, "bootstrap_room": 7})
        assert status == 400 and json.loads(raw)["error"]["param"] == "bootstrap_room"
        assert legs(stack.prefills[0]) == [] and legs(stack.decodes[0]) == []


@pytest.mark.parametrize("router", ["kv_cache_aware", "least_loaded"])
async def test_routers_and_tenants_run_as_on_trtllm(request_path: str, router: str) -> None:
    body = {**CHAT_BODY, "messages": [{"role": "user", "content": "Tell me about caches and kernels. " * 40}]}
    async with sglang_stack(
        request_path, prefills=[None, None], router=router, api_key="tenant-key"
    ) as stack:
        status, _ = await stack.post("chat", body)
        assert status == 401
        for _ in range(3):
            status, raw = await stack.post("chat", body, key="tenant-key")
            assert status == 200, raw[:300]
        prefill_legs = [leg for w in stack.prefills for leg in legs(w)]
        assert len(prefill_legs) == 3 and all(leg.kv_match for leg in legs(stack.decodes[0]))
        if router == "kv_cache_aware":  # one prompt: its prefix is on one prefill worker, each time
            assert len({leg.headers["host"] for leg in prefill_legs}) == 1
        assert stack.violations() == []


async def test_a_prefill_failing_mid_stream_ends_the_stream_in_band(request_path: str) -> None:
    async with sglang_stack(
        request_path, prefill_class=FailsOnceDecodeStreams, decode_class=StreamThenStall
    ) as stack:
        prefill, decode = stack.prefills[0], stack.decodes[0]
        assert isinstance(prefill, FailsOnceDecodeStreams) and isinstance(decode, StreamThenStall)
        prefill.partner = decode
        status, raw = await stack.post("chat", _body("chat", True))
        assert status == 200  # the head was relayed; the error comes in-band
        assert iter_events(raw)[-1]["error"]["code"] == "context_leg_failed", raw[-300:]
        await asyncio.wait_for(decode.cut.wait(), 10)
        assert decode.cut_at - prefill.failed_at < CUT_BOUND_S


async def test_a_prefill_failing_after_the_whole_answer_leaves_it_a_200(request_path: str) -> None:
    """The decode's whole answer went out (its KV had been pushed) before its prefill answered: the prefill's
    500 counts against that worker's breaker, the completion stays a 200, every count comes back."""
    async with sglang_stack(request_path, prefill_class=FailsOnceTheClientHasItsAnswer) as stack:
        prefill = stack.prefills[0]
        assert isinstance(prefill, FailsOnceTheClientHasItsAnswer)
        prefill.client_has_it = asyncio.Event()
        status, raw = await stack.post("chat", CHAT_BODY)
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"], raw[:300]
        prefill.client_has_it.set()
        orch = stack.orch
        (worker,) = orch.context_pool.workers
        workers = [w for pool in orch.pools for w in pool.workers]
        assert await eventually(lambda: orch.in_flight == 0 and all(w.in_flight == 0 for w in workers))
        assert worker.breaker.failures == 1 and worker.served == 0
        assert stack.violations() == []


async def test_a_prefill_without_a_bootstrap_port_is_never_chosen(request_path: str) -> None:
    async with sglang_stack(request_path, prefill_class=NoBootstrapPort) as stack:
        status, raw = await stack.post("chat", CHAT_BODY)
        assert status == 503 and "bootstrap port" in json.loads(raw)["error"]["message"], raw[:300]
        assert legs(stack.prefills[0]) == [] and legs(stack.decodes[0]) == []
