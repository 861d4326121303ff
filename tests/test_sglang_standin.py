"""The SGLang stand-in (tests/sglang_standin.py) on real sockets, driven as SGLang's mini_lb drives SGLang.

mini_lb's sequence, written again here: one body to the prefill and the decode
at once with ``bootstrap_host``, ``bootstrap_port`` and a ``bootstrap_room`` drawn
in [0, 2^63); the decode's answer is the client's, the prefill's is read and
discarded. The tests pin that the pair answers what one worker would, that each
broken rule is refused naming its field (or, not strict, recorded), that a
room whose prefill never comes fails the decode as SGLang fails it (a 500
naming ``KVPoll.WaitingForInput``) and a prefill whose decode never comes fails
after the bootstrap timeout, and what ``/server_info`` publishes.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from engine_standin import Route, StandinsThread, expected_tokens, prompt_ids_of, streamed_text
from sglang_standin import BootstrapPlane, SglangStandin, start_sglang
from trtllm_standin import detokenize

from bench.engine_protocols import ROOM_LIMIT

MESSAGES = [{"role": "user", "content": "Name one colour."}]
CHAT: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6}
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "once upon", "max_tokens": 6}
PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[SglangStandin, SglangStandin]]:
    plane = BootstrapPlane()
    prefill = await start_sglang("prefill", plane=plane)
    decode = await start_sglang("decode", plane=plane)
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


def with_room(body: dict[str, Any], prefill: SglangStandin, room: int | None = None) -> dict[str, Any]:
    """mini_lb's modified_request."""
    room = random.randint(0, ROOM_LIMIT - 1) if room is None else room
    return {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with session.post(url, json=body) as r:
        return r.status, await r.read()


async def mini_lb(
    session: aiohttp.ClientSession,
    prefill: SglangStandin,
    decode: SglangStandin,
    route: Route,
    body: dict[str, Any],
) -> tuple[int, bytes]:
    leg = with_room(body, prefill)
    (_, _), answer = await asyncio.gather(
        post(session, prefill.url + PATH[route], leg), post(session, decode.url + PATH[route], leg)
    )
    return answer


def text_of(route: Route, status: int, raw: bytes, stream: bool) -> str:
    assert status == 200, raw
    if stream:
        return streamed_text(raw, route)
    choice = json.loads(raw)["choices"][0]
    return choice["message"]["content"] if route == "chat" else choice["text"]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_pair_answers_what_one_worker_would(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin], route: Route, stream: bool
) -> None:
    prefill, decode = pair
    body = {**(CHAT if route == "chat" else COMPLETION), "stream": stream}
    status, raw = await mini_lb(session, prefill, decode, route, body)
    want = detokenize(expected_tokens(prompt_ids_of(route, body), body["max_tokens"]))
    assert text_of(route, status, raw, stream) == want
    assert decode.received()[0].kv_match is True and prefill.received()[0].status == 200
    assert prefill.violations == decode.violations == [] and not prefill.plane.rooms
    assert list(prefill.plane.ended.values()) == ["transferred"]


async def test_the_decode_may_come_first(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin]
) -> None:
    prefill, decode = pair
    leg = with_room(CHAT, prefill, room=ROOM_LIMIT - 1)
    decode_answer = asyncio.ensure_future(post(session, decode.url + PATH["chat"], leg))
    while not prefill.plane.rooms:
        await asyncio.sleep(0.001)
    assert (await post(session, prefill.url + PATH["chat"], leg))[0] == 200
    assert (await decode_answer)[0] == 200


async def test_unknown_fields_are_dropped_as_sglang_drops_them(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin]
) -> None:
    prefill, decode = pair
    body = {**CHAT, "kv_transfer_params": {"do_remote_decode": True}}
    status, _ = await mini_lb(session, prefill, decode, "chat", body)
    assert status == 200 and decode.received()[0].ignored == ["kv_transfer_params"]


@pytest.mark.parametrize("missing", ["bootstrap_host", "bootstrap_port", "bootstrap_room"])
async def test_a_leg_without_a_bootstrap_field_is_refused_naming_it(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin], missing: str
) -> None:
    prefill, decode = pair
    leg = {k: v for k, v in with_room(CHAT, prefill).items() if k != missing}
    for worker, mode in ((prefill, "PREFILL"), (decode, "DECODE")):
        status, raw = await post(session, worker.url + PATH["chat"], leg)
        error = json.loads(raw)
        assert status == 400 and error["object"] == "error" and error["code"] == 400
        assert error["message"] == f"{missing} is required in {mode} mode"


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("bootstrap_room", -1, 400),
        ("bootstrap_room", ROOM_LIMIT, 400),
        ("bootstrap_room", "12", 400),  # SGLang's lax pydantic takes it; mini_lb never sends it
        ("bootstrap_room", "twelve", 400),  # SGLang refuses this one itself
        ("bootstrap_port", "not a port", 400),
    ],
)
async def test_a_bad_bootstrap_field_is_refused_naming_it(
    session: aiohttp.ClientSession,
    pair: tuple[SglangStandin, SglangStandin],
    field: str,
    value: Any,
    status: int,
) -> None:
    _, decode = pair
    leg = {**with_room(CHAT, pair[0]), field: value}
    got, raw = await post(session, decode.url + PATH["chat"], leg)
    assert got == status and field in json.loads(raw)["message"]
    assert not decode.plane.rooms


async def test_lax_mode_does_what_sglang_does_and_records_the_rule(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin]
) -> None:
    prefill, decode = pair
    prefill.strict = decode.strict = False
    leg = {**with_room(CHAT, prefill), "bootstrap_room": "12"}
    (p_status, _), (d_status, _) = await asyncio.gather(
        post(session, prefill.url + PATH["chat"], leg), post(session, decode.url + PATH["chat"], leg)
    )
    assert p_status == d_status == 200
    assert "bootstrap_room='12'" in decode.violations[0]


async def test_a_room_whose_prefill_never_comes_fails_the_decode_as_sglang_does(
    session: aiohttp.ClientSession,
) -> None:
    plane = BootstrapPlane()
    prefill = await start_sglang("prefill", plane=plane, fault="5xx")
    decode = await start_sglang("decode", plane=plane, waiting_timeout_s=0.05)
    try:
        status, raw = await mini_lb(session, prefill, decode, "chat", CHAT)
        error = json.loads(raw)
        assert status == 500 and error["type"] == "InternalServerError"
        assert (
            "in KVPoll.WaitingForInput" in error["message"]
            and "KVTransferError(bootstrap_room=" in error["message"]
        )
        assert not plane.rooms and list(plane.ended.values()) == ["decode timed out"]
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_prefill_whose_decode_never_comes_fails_after_the_bootstrap_timeout(
    session: aiohttp.ClientSession,
) -> None:
    plane = BootstrapPlane()
    prefill = await start_sglang("prefill", plane=plane, bootstrap_timeout_s=0.05)
    try:
        status, raw = await post(session, prefill.url + PATH["chat"], with_room(CHAT, prefill))
        assert status == 500 and "KVPoll.Bootstrapping" in json.loads(raw)["message"]
        assert not plane.rooms and list(plane.ended.values()) == ["prefill timed out"]
    finally:
        await prefill.stop()


async def test_a_bootstrap_address_no_prefill_serves_fails_the_decode_at_once(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin]
) -> None:
    prefill, decode = pair
    leg = {**with_room(CHAT, prefill), "bootstrap_port": prefill.port}  # the HTTP port, not the bootstrap one
    status, raw = await post(session, decode.url + PATH["chat"], leg)
    assert status == 500 and "Could not fetch prefill parallel info" in json.loads(raw)["message"]


async def test_an_aborted_decode_leaves_its_room_and_the_prefill_then_waits_in_vain(
    session: aiohttp.ClientSession,
) -> None:
    plane = BootstrapPlane()
    prefill = await start_sglang("prefill", plane=plane, bootstrap_timeout_s=0.05)
    decode = await start_sglang("decode", plane=plane)
    try:
        leg = with_room(CHAT, prefill)
        with pytest.raises(asyncio.TimeoutError):
            await session.post(decode.url + PATH["chat"], json=leg, timeout=aiohttp.ClientTimeout(total=0.1))
        while not plane.ended:
            await asyncio.sleep(0.001)
        assert list(plane.ended.values()) == ["aborted"]
        status, raw = await post(session, prefill.url + PATH["chat"], leg)
        assert status == 500 and "KVPoll.Bootstrapping" in json.loads(raw)["message"]
    finally:
        await prefill.stop()
        await decode.stop()


async def test_fault_switches(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin]
) -> None:
    prefill, decode = pair
    decode.fault = "reset"
    with pytest.raises(aiohttp.ClientError):
        await post(session, decode.url + PATH["chat"], with_room(CHAT, prefill))
    decode.fault = "reset_mid_stream"
    leg = with_room({**CHAT, "stream": True}, prefill)
    results = await asyncio.gather(
        post(session, prefill.url + PATH["chat"], leg),
        post(session, decode.url + PATH["chat"], leg),
        return_exceptions=True,
    )
    assert results[0][0] == 200 and isinstance(results[1], aiohttp.ClientError)
    decode.fault = "stall"
    with pytest.raises(asyncio.TimeoutError):
        await session.post(decode.url + PATH["chat"], json=CHAT, timeout=aiohttp.ClientTimeout(total=0.1))


async def test_server_info_publishes_the_bootstrap_port(
    session: aiohttp.ClientSession, pair: tuple[SglangStandin, SglangStandin]
) -> None:
    prefill, decode = pair
    for path in ("/server_info", "/get_server_info"):
        async with session.get(prefill.url + path) as r:
            info = await r.json()
        assert info["disaggregation_mode"] == "prefill"
        assert info["disaggregation_bootstrap_port"] == prefill.bootstrap_port != prefill.port
        assert {"model_path", "tp_size", "dp_size", "disaggregation_transfer_backend", "version"} <= set(info)
    async with session.get(decode.url + "/server_info") as r:
        assert (await r.json())["disaggregation_mode"] == "decode"
    async with session.get(decode.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["owned_by"] == "sglang"


def test_a_pair_on_its_own_thread_serves_blocking_clients() -> None:
    async def start_pair() -> tuple[SglangStandin, SglangStandin]:
        plane = BootstrapPlane()
        return await start_sglang("prefill", plane=plane), await start_sglang("decode", plane=plane)

    with StandinsThread(start_pair) as started:
        prefill, decode = started.value
        with urllib.request.urlopen(prefill.url + "/server_info", timeout=10) as r:
            assert json.loads(r.read())["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    assert prefill.runner is None and decode.runner is None
