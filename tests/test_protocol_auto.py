"""``worker_protocol: auto`` (server/orchestrator/protocols/detect.py; docs/protocol.md "Worker protocols"):
each engine told from what its stand-in serves (written from the engines' code: trtllm-serve's and a
fastcore worker's /server_info, vLLM's /v1/models card, SGLang's /server_info and its older
/get_server_info), a real orchestrator started with ``auto`` in front of vLLM, SGLang and trtllm-serve
stand-ins serving a completion on the protocol it chose, a mixed pool and an unknown worker refused at
startup naming the workers, and a worker that turns healthy later as another engine kept out of routing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers import eventually
from sglang_standin import BootstrapPlane, SglangStandin
from trtllm_standin import TrtllmStandin
from vllm_standin import KVPlane, VllmStandin

from server.orchestrator.app import start_server
from server.orchestrator.config import ConfigError, build_config
from server.orchestrator.pools import HealthChecker, Pool
from server.orchestrator.protocols import VllmProtocol
from server.orchestrator.protocols.detect import (
    UNKNOWN,
    choose,
    detect,
    guard_probe,
    probe_of,
    protocol_of_models,
    protocol_of_server_info,
    resolve_auto,
)

CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
TIMEOUT = aiohttp.ClientTimeout(total=10)


def test_a_fastcore_workers_server_info_is_trtllm() -> None:
    assert protocol_of_server_info({"role": "context", "instance": "i", "model": "m"}) == "trtllm"
    assert protocol_of_server_info({"disaggregated_params": {}, "max_batch_size": 64}) == "trtllm"
    assert protocol_of_server_info({"disaggregation_mode": "decode", "version": "0.5"}) == "sglang"
    for other in ({"role": "context"}, {"version": "1"}, [], None):
        assert protocol_of_server_info(other) is None
    assert protocol_of_models({"data": [{"id": "m", "owned_by": "vllm"}]}) == "vllm"
    assert protocol_of_models({"data": [{"id": "m", "owned_by": "sglang"}]}) is None


def test_a_mixed_or_unknown_pool_is_refused_naming_its_workers() -> None:
    assert choose({"http://a:1": "vllm", "http://b:1": "vllm"}) == "vllm"
    with pytest.raises(
        ValueError, match=r"vllm: http://a:1; sglang: http://b:1|sglang: http://b:1; vllm: http://a:1"
    ):
        choose({"http://a:1": "vllm", "http://b:1": "sglang"})
    with pytest.raises(ValueError, match="worker http://c:1 answers as no engine"):
        choose({"http://a:1": "vllm", "http://c:1": UNKNOWN})


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


class Nobody:
    """An HTTP server that is no engine: /health 200, everything else 404."""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", _ok)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def _started(*workers: Any) -> None:
    for worker in workers:
        await worker.start()


@asynccontextmanager
async def stood_up(kind: str) -> AsyncIterator[tuple[list[Any], list[Any]]]:
    """A prefill and a decode stand-in of engine ``kind``."""
    if kind == "vllm":
        plane = KVPlane()
        pair: list[Any] = [VllmStandin("prefill", plane=plane), VllmStandin("decode", plane=plane)]
    elif kind == "sglang":
        bootstrap = BootstrapPlane()
        pair = [SglangStandin("prefill", plane=bootstrap), SglangStandin("decode", plane=bootstrap)]
    else:
        pair = [TrtllmStandin("context"), TrtllmStandin("generation")]
    await _started(*pair)
    try:
        yield [pair[0]], [pair[1]]
    finally:
        for worker in pair:
            await worker.stop()


def _auto(prefills: list[Any], decodes: list[Any]) -> dict[str, Any]:
    return {
        "port": 0,
        "health_check_interval_s": 0.1,
        "worker_protocol": "auto",
        "context_servers": {"urls": [w.url for w in prefills]},
        "generation_servers": {"urls": [w.url for w in decodes]},
    }


@pytest.mark.parametrize("kind", ["vllm", "sglang", "trtllm"])
async def test_auto_speaks_what_the_workers_speak(kind: str) -> None:
    async with stood_up(kind) as (prefills, decodes), aiohttp.ClientSession() as session:
        assert {await detect(session, w.url, TIMEOUT) for w in (*prefills, *decodes)} == {kind}
        server, orch = await start_server(build_config(_auto(prefills, decodes), environ={}))
        try:
            assert orch.config.worker_protocol == kind and orch.protocol.name == kind
            assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers), timeout=30)
            port = server.sockets[0].getsockname()[1]
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT_BODY) as resp:
                assert resp.status == 200, await resp.text()
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                page = await resp.text()
            transfer = {"vllm": "nixl", "sglang": "bootstrap", "trtllm": "disaggregated_params"}[kind]
            line = f'fastcore_orchestrator_worker_protocol{{protocol="{kind}",transfer="{transfer}"}} 1.0'
            assert line in page.splitlines(), [x for x in page.splitlines() if "worker_protocol" in x]
        finally:
            await server.cleanup()


class OldSglang(SglangStandin):
    """An SGLang that serves its server info at /get_server_info only (older versions)."""

    async def _server_info(self, request: web.Request) -> web.Response:
        if request.path == "/server_info":
            return self.json({"detail": "Not Found"}, 404)
        return await super()._server_info(request)


async def test_an_older_sglangs_get_server_info_is_sglang() -> None:
    old = OldSglang("decode", plane=BootstrapPlane())
    await old.start()
    try:
        async with aiohttp.ClientSession() as session:
            assert await detect(session, old.url, TIMEOUT) == "sglang"
        assert [r.path for r in old.requests] == [
            "/v1/models",
            "/get_server_info",
        ]  # after /server_info's 404
    finally:
        await old.stop()


async def test_a_mixed_pool_is_refused_at_startup_naming_the_workers() -> None:
    vllm = VllmStandin("prefill", plane=KVPlane())
    sglang = SglangStandin("decode", plane=BootstrapPlane())
    await _started(vllm, sglang)
    try:
        with pytest.raises(ConfigError) as err:
            await start_server(build_config(_auto([vllm], [sglang]), environ={}))
        message = str(err.value)
        assert message.startswith("worker_protocol: auto: the workers speak more than one protocol")
        assert f"sglang: {sglang.url}" in message and f"vllm: {vllm.url}" in message
    finally:
        await vllm.stop()
        await sglang.stop()


async def test_an_unknown_worker_is_refused_at_startup_naming_it() -> None:
    nobody = Nobody()
    vllm = VllmStandin("decode", plane=KVPlane())
    await _started(nobody, vllm)
    try:
        with pytest.raises(ConfigError, match=f"worker {nobody.url} answers as no engine"):
            await start_server(build_config(_auto([nobody], [vllm]), environ={}))
    finally:
        await nobody.stop()
        await vllm.stop()


async def test_a_refused_feature_of_the_detected_protocol_is_refused_at_startup() -> None:
    async with stood_up("sglang") as (prefills, decodes):
        data = {**_auto(prefills, decodes), "relay": "parsed"}
        with pytest.raises(ConfigError, match="worker_protocol: sglang: relay: parsed"):
            await start_server(build_config(data, environ={}))


async def test_a_worker_that_turns_up_as_another_engine_is_kept_out(caplog: pytest.LogCaptureFixture) -> None:
    sglang = SglangStandin("decode", plane=BootstrapPlane())
    vllm = VllmStandin("decode", plane=KVPlane())
    await _started(sglang, vllm)
    pool = Pool("generation", [sglang.url, vllm.url], "round_robin")
    try:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker([pool], session, interval=0.1, timeout=5,
                                    probe=guard_probe("vllm", probe_of(VllmProtocol)))  # fmt: skip
            with caplog.at_level(logging.WARNING, logger="fastcore.orchestrator"):
                await checker.check_all()
                await checker.check_all()
            stranger, same = pool.workers
            assert not stranger.healthy and same.healthy and same.local_prefill
            kept_out = [r.getMessage() for r in caplog.records if "kept out of routing" in r.getMessage()]
            assert kept_out == [
                f"generation worker {sglang.url} is kept out of routing: it answers as sglang; "
                "worker_protocol: auto chose vllm at startup"
            ]  # once, not every round
            assert pool.choose() is same
    finally:
        await sglang.stop()
        await vllm.stop()


async def test_auto_with_the_registry_kept_here_is_refused() -> None:
    """auto reads the records before the orchestrator starts: a registry this orchestrator keeps
    (http:// naming its own address) has none then (etcd's or another orchestrator's has)."""
    data = {
        "worker_protocol": "auto",
        "port": 8123,
        "disagg_cluster": {"cluster_uri": "http://127.0.0.1:8123"},
    }
    config = build_config(data, environ={})
    config.check_runnable()  # etcd or another orchestrator's registry: decided at the start
    with pytest.raises(
        ConfigError, match=r"worker_protocol: auto: disagg_cluster: .* this orchestrator's own"
    ):
        await resolve_auto(config)


async def test_the_cli_says_why_a_mixed_pool_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from server.orchestrator.cli import serve

    vllm = VllmStandin("prefill", plane=KVPlane())
    sglang = SglangStandin("decode", plane=BootstrapPlane())
    await _started(vllm, sglang)
    try:
        with pytest.raises(SystemExit) as exit_:
            await serve(build_config(_auto([vllm], [sglang]), environ={}), reuse_port=False)
        assert exit_.value.code == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.startswith(
            "fastcore-serve orchestrator: worker_protocol: auto: the workers speak more than one"
        ), last
    finally:
        await vllm.stop()
        await sglang.stop()


async def test_a_silent_worker_is_skipped_and_named(caplog: pytest.LogCaptureFixture) -> None:
    gone = Nobody()
    await gone.start()
    await gone.stop()  # its port now refuses connections: a worker not up yet
    async with stood_up("vllm") as (prefills, decodes):
        data = _auto(prefills, decodes)
        data["generation_servers"]["urls"].append(gone.url)
        with caplog.at_level(logging.WARNING, logger="fastcore.orchestrator"):
            server, orch = await start_server(build_config(data, environ={}))
        try:
            assert orch.protocol.name == "vllm"
            assert f"worker_protocol: auto: {gone.url} did not answer; decided from the others" in caplog.text
        finally:
            await server.cleanup()
