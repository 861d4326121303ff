"""The vLLM stand-in (tests/vllm_standin.py) on real sockets, driven as vLLM's reference proxies drive vLLM.

The proxies here are the sequences of vLLM's own: ``toy_proxy_server.py``
(NixlConnector: the prefill leg with ``kv_transfer_params``, ``stream: false``,
``max_tokens: 1``, no ``stream_options``/``min_tokens``, then the client's body
plus the prefill's ``kv_transfer_params`` to the decode, one ``X-Request-Id``) and
``mooncake_connector_proxy.py`` (both legs at once, a router-minted
``transfer_id``, the engine id from the bootstrap server's ``/query``). They
pin that the stand-in answers right when driven right, refuses each broken rule
as vLLM refuses it (or, not strict, does what vLLM does), and that its fault
switches and lease work.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from engine_standin import Route, expected_tokens, iter_events, prompt_ids_of, streamed_text
from trtllm_standin import detokenize
from vllm_standin import NIXL_SIDE_CHANNEL_PORT, KVPlane, VllmStandin, start_vllm

from bench.engine_protocols import NIXL_PREFILL_PARAMS

MESSAGES = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "Name one colour."}]
CHAT: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6}
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "once upon", "max_tokens": 6}
PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest_asyncio.fixture
async def nixl() -> AsyncIterator[tuple[VllmStandin, VllmStandin]]:
    plane = KVPlane()
    prefill = await start_vllm("prefill", plane=plane)
    decode = await start_vllm("decode", plane=plane)
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


@pytest_asyncio.fixture
async def mooncake() -> AsyncIterator[tuple[VllmStandin, VllmStandin]]:
    plane = KVPlane()
    prefill = await start_vllm("prefill", connector="mooncake", plane=plane)
    decode = await start_vllm("decode", connector="mooncake", plane=plane, transfer_timeout_s=5)
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


def prefill_leg(body: dict[str, Any], **params: Any) -> dict[str, Any]:
    """toy_proxy_server's send_request_to_service, written again."""
    leg = {
        k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    leg.update(stream=False, max_tokens=1, kv_transfer_params={**NIXL_PREFILL_PARAMS, **params})
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], xid: str | None = None
) -> tuple[int, bytes]:
    headers = {"X-Request-Id": xid} if xid else {}
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.read()


async def toy_proxy(
    session: aiohttp.ClientSession,
    prefill: VllmStandin,
    decode: VllmStandin,
    route: Route,
    body: dict[str, Any],
) -> tuple[int, bytes]:
    """NixlConnector's sequence: prefill, then the decode with the prefill's params verbatim."""
    xid = str(uuid.uuid4())
    status, raw = await post(session, prefill.url + PATH[route], prefill_leg(body), xid)
    assert status == 200, raw
    ktp = json.loads(raw).get("kv_transfer_params")
    return await post(
        session, decode.url + PATH[route], {**body, "kv_transfer_params": ktp} if ktp else body, xid
    )


async def mooncake_proxy(
    session: aiohttp.ClientSession,
    prefill: VllmStandin,
    decode: VllmStandin,
    route: Route,
    body: dict[str, Any],
) -> tuple[int, bytes]:
    """MooncakeConnector's sequence: both legs at once under one transfer_id."""
    async with session.get(prefill.bootstrap_addr + "/query") as r:
        engine_id = next(iter(await r.json()))
    xid, tid = str(uuid.uuid4()), uuid.uuid4().hex
    p_leg = prefill_leg(body)
    p_leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    d_params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_bootstrap_addr": prefill.bootstrap_addr,
        "remote_engine_id": engine_id,
        "remote_dp_rank": 0,
    }
    decode_answer = asyncio.ensure_future(
        post(session, decode.url + PATH[route], {**body, "kv_transfer_params": d_params}, xid)
    )
    await asyncio.sleep(0)  # the decode first: it must wait for the push
    (p_status, _), answer = await asyncio.gather(
        post(session, prefill.url + PATH[route], p_leg, xid), decode_answer
    )
    assert p_status == 200
    return answer


def text_of(route: Route, status: int, raw: bytes, stream: bool) -> str:
    assert status == 200, raw
    if stream:
        return streamed_text(raw, route)
    choice = json.loads(raw)["choices"][0]
    return choice["message"]["content"] if route == "chat" else choice["text"]


def expected_text(route: Route, body: dict[str, Any]) -> str:
    return detokenize(expected_tokens(prompt_ids_of(route, body), body["max_tokens"]))


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_nixl_legs_answer_what_one_worker_would(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin], route: Route, stream: bool
) -> None:
    prefill, decode = nixl
    body = {**(CHAT if route == "chat" else COMPLETION), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, raw = await toy_proxy(session, prefill, decode, route, body)
    assert text_of(route, status, raw, stream) == expected_text(route, body)
    p, d = prefill.received()[0], decode.received()[0]
    ktp = p.response["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert {
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
    } <= set(ktp)
    assert ktp["remote_port"] == NIXL_SIDE_CHANNEL_PORT and ktp["remote_engine_id"] == prefill.engine_id
    assert ktp["remote_request_id"].split("-", 1)[1].startswith(p.headers["x-request-id"])
    assert d.body["kv_transfer_params"] == ktp and d.kv_match is True
    assert p.headers["x-request-id"] == d.headers["x-request-id"]
    assert prefill.violations == decode.violations == [] and not prefill.plane.held
    assert await prefill.plane.released.get() == (ktp["remote_request_id"], "read")
    if stream:
        assert iter_events(raw)[-2]["usage"]["completion_tokens"] == body["max_tokens"]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_mooncake_legs_run_at_once_and_answer_right(
    session: aiohttp.ClientSession, mooncake: tuple[VllmStandin, VllmStandin], route: Route, stream: bool
) -> None:
    prefill, decode = mooncake
    body = {**(CHAT if route == "chat" else COMPLETION), "stream": stream}
    status, raw = await mooncake_proxy(session, prefill, decode, route, body)
    assert text_of(route, status, raw, stream) == expected_text(route, body)
    assert prefill.received()[0].response["kv_transfer_params"] is None  # the push needs no answer
    assert decode.received()[0].kv_match is True
    assert prefill.violations == decode.violations == [] and not prefill.plane.held


async def test_unknown_fields_are_ignored_as_vllm_ignores_them(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, _ = nixl
    status, _ = await post(session, prefill.url + PATH["chat"], {**prefill_leg(CHAT), "bootstrap_room": 7})
    assert status == 200
    assert prefill.received()[0].ignored == ["bootstrap_room"]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({**CHAT, "stream_options": {"include_usage": True}}, "Stream options"),
        ({**CHAT, "kv_transfer_params": "yes"}, "kv_transfer_params"),
        ({**CHAT, "min_tokens": 8}, "min_tokens"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 2}, "messages"),
    ],
)
async def test_what_vllm_refuses_is_a_400_in_its_error_shape(
    session: aiohttp.ClientSession, body: dict[str, Any], names: str
) -> None:
    worker = await start_vllm("both")
    try:
        status, raw = await post(session, worker.url + PATH["chat"], body)
    finally:
        await worker.stop()
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert names in error["message"]


@pytest.mark.parametrize(
    ("leg", "names"),
    [
        ({**CHAT, "max_tokens": 1}, "kv_transfer_params"),  # no PD leg at all
        ({**prefill_leg(CHAT), "max_tokens": 6}, "max_tokens"),
        ({**prefill_leg(CHAT), "max_completion_tokens": 6}, "max_tokens"),  # chat's cap wins
        ({**prefill_leg(CHAT), "stream": True}, "stream"),
        (
            {
                **prefill_leg(CHAT),
                "min_tokens": 1,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": False},
            },
            "do_remote_decode",
        ),
    ],
)
async def test_a_broken_prefill_leg_is_refused_naming_the_field(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin], leg: dict[str, Any], names: str
) -> None:
    prefill, _ = nixl
    status, raw = await post(session, prefill.url + PATH["chat"], leg)
    message = json.loads(raw)["error"]["message"]
    assert status == 400 and message.startswith("vllm stand-in (protocol)") and names in message
    assert not prefill.plane.held


async def test_a_decode_without_every_nixl_field_is_refused_and_computes_locally_when_lax(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, decode = nixl
    status, raw = await post(session, prefill.url + PATH["chat"], prefill_leg(CHAT))
    ktp = json.loads(raw)["kv_transfer_params"]
    partial = {k: v for k, v in ktp.items() if k != "remote_request_id"}
    status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": partial})
    assert status == 400 and "remote_request_id" in json.loads(raw)["error"]["message"]
    decode.strict = False
    status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": partial})
    assert text_of("chat", status, raw, False) == expected_text(
        "chat", CHAT
    )  # vLLM: "will not utilize KVTransfer"
    assert list(prefill.plane.held) == [ktp["remote_request_id"]]  # the prefill's blocks wait for their lease


async def test_blocks_read_twice_or_after_the_lease_are_what_vllm_reads(
    session: aiohttp.ClientSession,
) -> None:
    plane = KVPlane()
    prefill = await start_vllm("prefill", plane=plane, lease_s=0)
    decode = await start_vllm("decode", plane=plane, strict=False)
    try:
        status, raw = await post(session, prefill.url + PATH["chat"], prefill_leg(CHAT))
        ktp = json.loads(raw)["kv_transfer_params"]
        assert await plane.released.get() == (ktp["remote_request_id"], "expired")
        status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": ktp})
        # No error from vLLM: the decode computes from blocks that are no longer the prompt's.
        assert status == 200 and text_of("chat", status, raw, False) != expected_text("chat", CHAT)
        assert decode.received()[0].kv_match is False and "(expired)" in decode.violations[0]
        decode.strict = True
        status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": ktp})
        assert status == 400 and "not held (expired)" in json.loads(raw)["error"]["message"]
        unknown = {**ktp, "remote_request_id": "chatcmpl-nobody"}
        status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": unknown})
        assert status == 400 and "(unknown)" in json.loads(raw)["error"]["message"]
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_second_read_and_a_foreign_request_id_header_are_violations(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, decode = nixl
    status, raw = await post(session, prefill.url + PATH["chat"], prefill_leg(CHAT), "rid-1")
    ktp = json.loads(raw)["kv_transfer_params"]
    leg = {**CHAT, "kv_transfer_params": ktp}
    status, raw = await post(session, decode.url + PATH["chat"], leg, "rid-2")
    assert status == 400 and "X-Request-Id" in json.loads(raw)["error"]["message"]
    decode.strict = False
    assert (await post(session, decode.url + PATH["chat"], leg, "rid-1"))[
        0
    ] == 200  # refused above: still held
    status, raw = await post(session, decode.url + PATH["chat"], leg, "rid-1")
    assert status == 200 and "(read)" in decode.violations[-1]


async def test_a_transfer_from_no_such_engine_fails_the_request(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, decode = nixl
    status, raw = await post(session, prefill.url + PATH["chat"], prefill_leg(CHAT))
    ktp = {**json.loads(raw)["kv_transfer_params"], "remote_engine_id": "gone"}
    status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": ktp})
    error = json.loads(raw)["error"]
    assert (
        status == 500
        and error["type"] == "InternalServerError"
        and "kv_load_failure_policy" in error["message"]
    )


async def test_a_mooncake_push_that_never_comes_fails_the_decode(session: aiohttp.ClientSession) -> None:
    plane = KVPlane()
    prefill = await start_vllm("prefill", connector="mooncake", plane=plane)
    decode = await start_vllm("decode", connector="mooncake", plane=plane, transfer_timeout_s=0.05)
    try:
        params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": "never",
            "remote_bootstrap_addr": prefill.bootstrap_addr,
            "remote_engine_id": prefill.engine_id,
        }
        status, raw = await post(session, decode.url + PATH["chat"], {**CHAT, "kv_transfer_params": params})
        assert status == 500 and "not received" in json.loads(raw)["error"]["message"]
        assert not plane.waiting and not plane.held
        leg = prefill_leg(CHAT)
        leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        status, raw = await post(session, prefill.url + PATH["chat"], leg)
        assert status == 400 and "transfer_id" in json.loads(raw)["error"]["message"]
    finally:
        await prefill.stop()
        await decode.stop()


async def test_fault_switches(session: aiohttp.ClientSession) -> None:
    worker = await start_vllm("both", fault="5xx")
    try:
        status, raw = await post(session, worker.url + PATH["chat"], CHAT)
        assert status == 500 and json.loads(raw)["error"]["code"] == 500
        worker.fault = "reset"
        with pytest.raises(aiohttp.ClientError):
            await post(session, worker.url + PATH["chat"], CHAT)
        worker.fault = "stall"
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                worker.url + PATH["chat"], json=CHAT, timeout=aiohttp.ClientTimeout(total=0.2)
            ):
                pass
        worker.fault = "reset_mid_stream"
        with pytest.raises(aiohttp.ClientError):
            await post(session, worker.url + PATH["chat"], {**CHAT, "stream": True})
        sse = worker.received()[-1].sse
        assert len(sse) == 2 and "[DONE]" not in sse  # the role chunk and the first token, then the reset
        worker.fault = None
        assert (await post(session, worker.url + PATH["chat"], CHAT))[0] == 200
    finally:
        await worker.stop()


async def test_models_health_and_version_as_vllm_answers(session: aiohttp.ClientSession) -> None:
    worker = await start_vllm("decode", max_model_len=4096)
    try:
        async with session.get(worker.url + "/v1/models") as r:
            card = (await r.json())["data"][0]
        assert card["id"] == "tiny" and card["owned_by"] == "vllm" and card["max_model_len"] == 4096
        async with session.get(worker.url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with session.get(worker.url + "/version") as r:
            assert "version" in await r.json()
        async with session.get(worker.url + "/server_info") as r:
            assert r.status == 404  # vLLM serves no /server_info (a probe tells it from SGLang by that)
    finally:
        await worker.stop()


async def test_a_decode_with_another_prompt_than_its_prefill_is_a_violation(
    session: aiohttp.ClientSession, nixl: tuple[VllmStandin, VllmStandin]
) -> None:
    prefill, decode = nixl
    status, raw = await post(session, prefill.url + PATH["chat"], prefill_leg(CHAT))
    ktp = json.loads(raw)["kv_transfer_params"]
    other = {**CHAT, "messages": [{"role": "user", "content": "Name one animal."}], "kv_transfer_params": ktp}
    status, raw = await post(session, decode.url + PATH["chat"], other)
    assert status == 400 and "not the one its prefill computed" in json.loads(raw)["error"]["message"]
    assert decode.received()[0].kv_match is False
