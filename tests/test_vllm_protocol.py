"""``worker_protocol: vllm`` (server/orchestrator/protocols/vllm.py, docs/protocol.md "Worker protocols"):
the legs' bodies on both fastcore twins, and a real orchestrator on 127.0.0.1 in front of strict vLLM
NixlConnector stand-ins (tests/vllm_standin.py) on both request paths (from callbacks; in coroutines
with the admission queue on): chat and completions, unary and streamed, each answer what one vLLM
worker serving the whole request answers, no protocol violation; a prefill's 5xx falls back to the
decode worker or is the client's 502 as configured; a decode's error is the client's; a prefill answer
without ``kv_transfer_params`` is a 502 naming it. The stand-ins and the orchestrator share this loop.
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
from engine_standin import Received, iter_events, streamed_text
from helpers import eventually
from vllm_standin import KVPlane, VllmStandin, start_vllm

from bench import engine_protocols as rules
from fastcore.relay import Relay
from server.errors import HTTPError
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import ConfigError, build_config
from server.orchestrator.protocols import VllmRelay
from server.orchestrator.relay_common import ClientRequest

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
PARAMS = b'{"do_remote_prefill": true, "remote_block_ids": [[1, 2]], "remote_engine_id": "e", "tp_size": 1}'


# -- the legs' bodies, on both twins --------------------------------------------------------------


@pytest.fixture
def relay(relay_twin: ModuleType) -> VllmRelay:
    """VllmRelay on one twin's relay kernels and span scanner (the test chooses the class)."""
    scan = importlib.import_module(
        "fastcore._scan_py" if relay_twin.__name__.endswith("_py") else "fastcore._scan"
    )
    cls = type(
        f"VllmRelay_{relay_twin.__name__}", (VllmRelay,), {"relay": Relay(relay_twin), "scanner": scan}
    )
    return cls()


def _read(relay: VllmRelay, body: dict[str, Any] | bytes, chat: bool = True) -> ClientRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return relay.read_client(raw, chat)


@pytest.mark.parametrize(
    "body",
    [
        # every member leg (1) cuts, the first one first and the last one last
        b'{ "stream": true, "messages": [{"role": "user", "content": "hi"}], "stream_options": '
        b'{"include_usage": true}, "min_tokens": 3, "max_tokens": 9, "max_completion_tokens": 9 , '
        b'"min_completion_tokens": 2 }',
        # adjacent cuts in the middle, and nothing after the last kept member cut
        b'{"model":"tiny","max_tokens":5,"stream":false,"messages":[{"role":"user","content":"x"}],"top_p":1}',
        # none to cut
        b'{"messages":[{"role":"user","content":"x"}]}',
    ],
)
def test_prefill_leg_is_the_reference_proxys(relay: VllmRelay, body: bytes) -> None:
    req = _read(relay, body)
    leg = relay.context_request(req, 1 << 50)
    assert b"".join(relay.context_pieces(req, 1 << 50)) == leg
    sent, client = json.loads(leg), json.loads(body)
    assert rules.check_vllm_prefill(sent, True) == []
    assert sent["kv_transfer_params"] == rules.NIXL_PREFILL_PARAMS
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert ("max_completion_tokens" in sent) == ("max_completion_tokens" in client)
    for dropped in rules.PREFILL_DROPPED:
        assert dropped not in sent
    kept = {k: v for k, v in client.items() if k not in ("stream", "max_tokens", "max_completion_tokens",
                                                           *rules.PREFILL_DROPPED)}  # fmt: skip
    assert {k: v for k, v in sent.items() if k in kept} == kept


def test_decode_leg_is_the_clients_body_and_the_prefills_params_verbatim(relay: VllmRelay) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 4}'
    req = _read(relay, body)
    answer = b'{"id": "x", "kv_transfer_params": ' + PARAMS + b', "usage": {"prompt_tokens": 7}}'
    ctx = relay.read_context(req, answer)
    leg = relay.generation_request(req, ctx)
    assert b"".join(relay.generation_pieces(req, ctx)) == leg
    assert leg == b'{"kv_transfer_params":' + PARAMS + b',"messages": [{"role": "user", "content": "hi"}], ' \
                  b'"stream": true, "max_tokens": 4}'  # fmt: skip
    assert not ctx.finished and relay.usage_tokens(ctx) == (7, None)


def test_both_legs_carry_one_request_id(relay: VllmRelay) -> None:
    from server.orchestrator.protocols import VllmProtocol

    protocol = VllmProtocol(build_config({"context_servers": {"urls": ["a:1"]}, "generation_servers": {
        "urls": ["b:1"]}, "worker_protocol": "vllm"}, environ={}))  # fmt: skip
    req = _read(relay, COMPLETION_BODY, chat=False)
    ctx = relay.read_context(req, b'{"kv_transfer_params": {}}')
    line = protocol.context_headers(req)
    assert line.startswith(b"X-Request-Id: ") and line.endswith(b"\r\n") and len(line) == 16 + 32
    assert protocol.generation_headers(req, ctx) == line
    assert protocol.context_headers(_read(relay, COMPLETION_BODY, chat=False)) != line


def test_a_clients_own_kv_transfer_params_is_refused(relay: VllmRelay) -> None:
    with pytest.raises(HTTPError) as err:
        _read(relay, {**CHAT_BODY, "kv_transfer_params": {"do_remote_prefill": True}})
    assert err.value.status == 400 and err.value.param == "kv_transfer_params"


def test_a_client_body_the_scan_refuses_is_a_400(relay: VllmRelay) -> None:
    for body in (b'{"messages": [], "min_tokens": 1, "min_tokens": 2}', b'{"messages": [', b"[1]"):
        with pytest.raises(HTTPError) as err:
            _read(relay, body)
        assert err.value.status == 400


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b'{"id": "x", "choices": []}', "no 'kv_transfer_params'"),
        (b'{"id": "x", "kv_transfer_params": null}', "non-object 'kv_transfer_params'"),
        (b'{"kv_transfer_params": [1]}', "non-object 'kv_transfer_params'"),
        (b"[]", "no 'kv_transfer_params'"),
        (b'{"kv_transfer_params": {}', "malformed JSON"),
        (b'{"kv_transfer_params": {}, "kv_transfer_params": {}}', "duplicate key"),
    ],
)
def test_a_prefill_answer_without_its_params_object_is_a_502(
    relay: VllmRelay, answer: bytes, why: str
) -> None:
    req = _read(relay, CHAT_BODY)
    with pytest.raises(HTTPError) as err:
        relay.read_context(req, answer)
    assert err.value.status == 502 and why in err.value.message


def test_a_malformed_decode_answer_is_a_502(relay: VllmRelay) -> None:
    req = _read(relay, CHAT_BODY)
    assert relay.client_answer(req, b'{"choices": []}') == b'{"choices": []}'
    with pytest.raises(HTTPError) as err:
        relay.client_answer(req, b'{"choices": [')
    assert err.value.status == 502


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("relay", "parsed"),
        ("gen_tokids_ctxbytes", True),
        ("gen_strip_message_history", True),
    ],
)
def test_features_not_built_for_vllm_are_refused_at_startup(key: str, value: Any) -> None:
    data: dict[str, Any] = {"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]},
                            "worker_protocol": "vllm", key: value}  # fmt: skip
    with pytest.raises(ConfigError, match=f"worker_protocol: vllm: {key}"):
        build_config(data, environ={}).check_runnable()
    data["worker_protocol"] = "trtllm"
    build_config(data, environ={}).check_runnable()


# -- a real orchestrator in front of strict stand-ins ---------------------------------------------


@dataclass
class Stack:
    orch: Orchestrator
    url: str
    prefill: VllmStandin
    decode: VllmStandin
    reference: VllmStandin
    session: aiohttp.ClientSession
    prefills: list[VllmStandin]
    decodes: list[VllmStandin]

    async def post(
        self, route: str, body: dict[str, Any], *, reference: bool = False, key: str | None = None
    ) -> tuple[int, bytes]:
        url = (self.reference.url if reference else self.url) + PATHS[route]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    def violations(self) -> list[str]:
        return [v for w in (*self.prefills, *self.decodes, self.reference) for v in w.violations]

    def legs(self, worker: VllmStandin) -> list[Received]:
        return [r for r in worker.requests if r.method == "POST"]


class NoParamsPrefill(VllmStandin):
    """A prefill worker that is not a NIXL producer: its answers carry no ``kv_transfer_params``."""

    def extra_fields(self, route: Any, stream_chunk: bool) -> dict[str, Any]:
        return {}

    def _prefill(self, rec: Received, chat: bool, ids: list[int], cap: int, ktp: dict[str, Any]) -> Any:
        answer = super()._prefill(rec, chat, ids, cap, ktp)
        answer.top.pop("kv_transfer_params", None)
        return answer


class PullThenReset(VllmStandin):
    """A decode that, with ``reset_after_pull``, reads its prefill's blocks (the lease is spent) and then
    resets the connection with no byte of an answer, as a decode that died after its pull."""

    reset_after_pull = False

    async def serve(self, request: Any, rec: Received, route: Any) -> Any:
        answer = await super().serve(request, rec, route)
        if self.reset_after_pull:
            await self.reset(request)
            await self.wait_forever()
        return answer


@asynccontextmanager
async def vllm_stack(request_path: str, prefill_class: type[VllmStandin] = VllmStandin, prefills: int = 1,
                     router: str = "round_robin", decodes: int = 1, decode_class: type[VllmStandin] = VllmStandin,
                     **config: Any) -> AsyncIterator[Stack]:  # fmt: skip
    """Prefill and decode stand-ins (one KV plane), a reference ``both`` worker, an orchestrator
    with ``worker_protocol: vllm``; on the coroutine path with the admission queue on."""
    plane = KVPlane()
    started = [prefill_class("prefill", plane=plane) for _ in range(prefills)]
    decoding = [decode_class("decode", plane=plane) for _ in range(decodes)]
    for worker in (*started, *decoding):
        await worker.start()
    prefill, decode = started[0], decoding[0]
    reference = await start_vllm("both")
    data: dict[str, Any] = {
        "port": 0,
        "health_check_interval_s": 0.1,
        "worker_protocol": "vllm",
        "context_servers": {"urls": [w.url for w in started], "router": {"type": router}},
        "generation_servers": {"urls": [w.url for w in decoding], "router": {"type": router}},
        **config,
    }
    if request_path == "tasks":
        data["admission"] = {"max_inflight": 4}
    server = None
    try:
        server, orch = await start_server(build_config(data, environ={}))
        # conditional disaggregation runs on the coroutine path only
        assert orch.callbacks == (request_path == "callbacks" and "conditional_disagg_config" not in config)
        port = server.sockets[0].getsockname()[1]
        assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers), timeout=30)
        async with aiohttp.ClientSession() as session:
            yield Stack(
                orch, f"http://127.0.0.1:{port}", prefill, decode, reference, session, started, decoding
            )
    finally:
        if server is not None:
            await server.cleanup()
        for worker in (*started, *decoding, reference):
            await worker.stop()


def _body(route: str, stream: bool) -> dict[str, Any]:
    body = dict(CHAT_BODY if route == "chat" else COMPLETION_BODY)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True}, min_tokens=2)
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
    return text, choice["finish_reason"], answer["usage"], answer.get("kv_transfer_params")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_answers_what_one_vllm_worker_answers(request_path: str, route: str, stream: bool) -> None:
    async with vllm_stack(request_path) as stack:
        body = _body(route, stream)
        status, raw = await stack.post(route, body)
        ref_status, ref = await stack.post(route, body, reference=True)
        assert (status, ref_status) == (200, 200), raw[:300]
        assert _seen(raw, route, stream) == _seen(ref, route, stream)
        assert stack.violations() == []
        (prefill,), (decode,) = stack.legs(stack.prefill), stack.legs(stack.decode)
        assert decode.kv_match is True  # the decode read its prefill's blocks
        assert prefill.headers["x-request-id"] == decode.headers["x-request-id"]
        assert decode.body == {"kv_transfer_params": decode.body["kv_transfer_params"], **body}
        assert "x-trtllm-disagg-auth" not in decode.headers
        # no /kv release: vLLM has none (the blocks were read; their lease ends otherwise)
        assert [r.path for r in stack.prefill.requests if r.method not in ("GET", "POST")] == []


@pytest.mark.parametrize("fallback", ["local_prefill", "fail"])
async def test_a_failed_prefill_falls_back_to_the_decode_worker_or_is_a_502(
    request_path: str, fallback: str
) -> None:
    async with vllm_stack(request_path, context_fallback=fallback) as stack:
        stack.prefill.fault = "5xx"
        status, raw = await stack.post("chat", CHAT_BODY)
        if fallback == "fail":
            assert status == 502 and json.loads(raw)["error"]["code"] == "context_leg_failed"
            assert stack.legs(stack.decode) == []
            return
        _, ref = await stack.post("chat", CHAT_BODY, reference=True)
        assert status == 200 and _seen(raw, "chat", False) == _seen(ref, "chat", False)
        (decode,) = stack.legs(stack.decode)
        assert decode.body == CHAT_BODY  # the client's plain request, served whole
        assert stack.violations() == []


async def test_a_decode_error_is_the_clients(request_path: str) -> None:
    async with vllm_stack(request_path) as stack:
        stack.decode.fault = "5xx"
        status, raw = await stack.post("completions", COMPLETION_BODY)
        assert status == 502 and json.loads(raw)["error"]["code"] == "generation_leg_failed"
        stack.decode.fault = None
        # a decode's own 4xx (vLLM refuses min_tokens above max_tokens; the prefill leg has none) is the client's
        status, raw = await stack.post("completions", {**COMPLETION_BODY, "min_tokens": 10})
        assert status == 400 and "min_tokens" in json.loads(raw)["error"]["message"], raw[:300]
        assert stack.legs(stack.prefill)[-1].status == 200


async def test_a_prefill_answer_without_kv_transfer_params_is_a_502_naming_it(request_path: str) -> None:
    async with vllm_stack(request_path, NoParamsPrefill) as stack:
        status, raw = await stack.post("chat", CHAT_BODY)
        assert status == 502 and "kv_transfer_params" in json.loads(raw)["error"]["message"]
        assert stack.legs(stack.decode) == []


async def test_a_clients_kv_transfer_params_never_reaches_a_worker(request_path: str) -> None:
    async with vllm_stack(request_path) as stack:
        status, raw = await stack.post("chat", {**CHAT_BODY, "kv_transfer_params": {"remote_engine_id": "x"}})
        assert status == 400 and json.loads(raw)["error"]["param"] == "kv_transfer_params"
        assert stack.legs(stack.prefill) == [] and stack.legs(stack.decode) == []


async def test_capabilities_come_from_v1_models(request_path: str) -> None:
    async with vllm_stack(request_path) as stack:
        for worker in (stack.prefill, stack.decode):
            paths = {r.path for r in worker.requests if r.method == "GET"}
            assert "/v1/models" in paths and "/server_info" not in paths
        assert all(w.local_prefill for w in stack.orch.generation_pool.workers)  # the fallback's worker


async def test_a_client_that_leaves_mid_prefill_releases_nothing(request_path: str) -> None:
    async with vllm_stack(request_path) as stack:
        stack.prefill.fault = "stall"
        sent = asyncio.get_running_loop().create_task(stack.post("chat", CHAT_BODY))
        assert await eventually(lambda: stack.legs(stack.prefill), timeout=30)
        sent.cancel()  # the client's connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await sent
        assert await eventually(lambda: stack.orch.in_flight == 0 and not stack.orch._background, timeout=30)
        # vLLM has no release endpoint (the blocks' lease ends): nothing but legs and probes was sent
        assert {r.method for r in stack.prefill.requests} <= {"GET", "POST"}
        assert stack.legs(stack.decode) == []


async def test_a_decode_cut_mid_stream_ends_the_clients_stream_with_an_error(request_path: str) -> None:
    async with vllm_stack(request_path) as stack:
        stack.decode.fault = "reset_mid_stream"
        status, raw = await stack.post("chat", _body("chat", True))
        assert status == 200  # the head was relayed; the error comes in-band
        assert iter_events(raw)[-1]["error"]["code"] == "generation_leg_failed"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_decode_that_resets_after_its_pull_is_retried_from_a_new_prefill(
    request_path: str, stream: bool
) -> None:
    """A decode that read its prefill's blocks and reset: that lease is spent, so the leg is not sent
    again (to it or to another decode: "not held (read)", a 400); the completion goes on from a new
    prefill leg, whose blocks another decode reads. The client sees one answer, no violation."""
    async with vllm_stack(request_path, decodes=2, decode_class=PullThenReset) as stack:
        assert isinstance(stack.decode, PullThenReset)
        stack.decode.reset_after_pull = True
        body = _body("chat", stream)
        _, ref = await stack.post("chat", body, reference=True)
        for _ in range(2):  # round robin: one of them goes to the resetting decode first
            status, raw = await stack.post("chat", body)
            assert status == 200 and _seen(raw, "chat", stream) == _seen(ref, "chat", stream), raw[:300]
        spent, good = stack.legs(stack.decode), stack.legs(stack.decodes[1])
        assert len(spent) == 1 and spent[0].kv_match is True  # it read the blocks, then reset
        assert len(good) == 2 and all(leg.kv_match for leg in good)
        assert len(stack.legs(stack.prefill)) == 3  # the spent lease's request prefilled again
        assert stack.violations() == []


async def test_a_prefill_worker_that_resets_is_retried_on_another(request_path: str) -> None:
    async with vllm_stack(request_path, prefills=2) as stack:
        stack.prefill.fault = "reset"
        _, ref = await stack.post("chat", CHAT_BODY, reference=True)
        for _ in range(2):  # round robin: one of them goes to the resetting worker first
            status, raw = await stack.post("chat", CHAT_BODY)
            assert status == 200 and _seen(raw, "chat", False) == _seen(ref, "chat", False)
        assert stack.legs(stack.prefill) and all(leg.kv_match for leg in stack.legs(stack.decode))
        assert stack.violations() == []


@pytest.mark.parametrize("local", [True, False], ids=["decode-only", "disaggregated"])
async def test_conditional_disaggregation_serves_a_short_uncached_remainder_on_the_decode_alone(
    request_path: str, local: bool
) -> None:
    """vllm-router's pd_uncached_token_threshold as conditional_disagg_config: a prompt whose expected
    uncached remainder is at most max_local_prefill_length tokens goes to a decode worker alone, as the
    client's plain request (a vLLM decode worker serves one whole); a longer one takes both legs."""
    threshold = 100_000 if local else 1
    async with vllm_stack(request_path, router="kv_cache_aware",
                          conditional_disagg_config={"max_local_prefill_length": threshold}) as stack:  # fmt: skip
        for route, stream in (("chat", False), ("completions", True)):
            body = _body(route, stream)
            _, ref = await stack.post(route, body, reference=True)
            status, raw = await stack.post(route, body)
            assert status == 200 and _seen(raw, route, stream) == _seen(ref, route, stream), raw[:300]
        decoded = stack.legs(stack.decode)
        assert len(decoded) == 2 and stack.violations() == []
        if local:
            assert stack.legs(stack.prefill) == []
            assert [leg.body for leg in decoded] == [_body("chat", False), _body("completions", True)]
        else:
            assert len(stack.legs(stack.prefill)) == 2 and all(leg.kv_match for leg in decoded)


@pytest.mark.parametrize("router", ["kv_cache_aware", "least_loaded"])
async def test_routers_and_tenants_run_as_on_trtllm(request_path: str, router: str) -> None:
    """The routers read the client's bytes, not the protocol's; a tenant's cache_salt is on both legs."""
    body = {**CHAT_BODY, "messages": [{"role": "user", "content": "Tell me about caches and kernels. " * 40}]}
    async with vllm_stack(request_path, prefills=2, router=router, api_key="tenant-key") as stack:
        _, ref = await stack.post("chat", body, reference=True)
        status, raw = await stack.post("chat", body)
        assert status == 401
        for _ in range(3):
            status, raw = await stack.post("chat", body, key="tenant-key")
            assert status == 200 and _seen(raw, "chat", False) == _seen(ref, "chat", False)
        prefill_legs = [leg for w in stack.prefills for leg in stack.legs(w)]
        legs = [*prefill_legs, *stack.legs(stack.decode)]
        assert len(legs) == 6 and len({leg.body["cache_salt"] for leg in legs}) == 1
        if router == "kv_cache_aware":  # one prompt: its prefix is on one prefill worker, each time
            assert len({leg.headers["host"] for leg in prefill_legs}) == 1
        assert stack.violations() == []
