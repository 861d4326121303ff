"""etcd discovery of vLLM and SGLang workers (issue 37): a worker record names its protocol, and
``fastcore-serve register`` (server/cluster/sidecar.py) keeps the lease of a worker that cannot
register itself. A real etcd (conftest's ``etcd``), the engines' strict stand-ins on 127.0.0.1, an
orchestrator with ``worker_protocol`` and ``disagg_cluster`` in this process; the sidecar as a process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from helpers import until
from sglang_standin import BootstrapPlane, start_sglang
from vllm_standin import KVPlane, start_vllm

from server.cluster import ClusterSettings, RecordError, WorkerRecord, WorkerRegistration
from server.cluster.etcd import EtcdClient
from server.cluster.local_etcd import LocalEtcd
from server.cluster.records import PROTOCOLS
from server.orchestrator import protocols
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config

HEARTBEAT_S = 0.2
TTL_S = 1.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4}


# -- the record ---------------------------------------------------------------------------------


def test_a_record_names_its_protocol_and_one_that_names_none_speaks_trtllm() -> None:
    rec = WorkerRecord("d-1", "generation", "tiny", "http://127.0.0.1:9", protocol="vllm")
    assert json.loads(rec.to_json())["protocol"] == "vllm"
    assert WorkerRecord.from_json(rec.to_json()) == rec
    plain = WorkerRecord("c-1", "context", "tiny", "http://127.0.0.1:9")
    assert "protocol" not in json.loads(plain.to_json())  # what every record meant before the field
    assert WorkerRecord.from_json(plain.to_json()).protocol == "trtllm"
    # trtllm-serve's own layout: its workers speak trtllm
    assert WorkerRecord.from_obj({"worker_id": "w", "host": "h", "port": 1, "role": 0}).protocol == "trtllm"


@pytest.mark.parametrize("value", ["tensorrt", "", 3, None])
def test_a_record_with_an_unknown_protocol_is_refused_naming_the_field(value: Any) -> None:
    obj = {
        "worker_id": "w",
        "role": "context",
        "model": "tiny",
        "url": "http://127.0.0.1:9",
        "protocol": value,
    }
    with pytest.raises(RecordError, match="'protocol'"):
        WorkerRecord.from_obj(obj)


def test_the_records_protocols_are_the_orchestrators() -> None:
    assert set(PROTOCOLS) == set(protocols.PROTOCOLS)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_disagg_cluster_runs_on_every_protocol(protocol: str) -> None:
    data = {"worker_protocol": protocol, "context_fallback": "fail",
            "disagg_cluster": {"cluster_uri": "etcd://127.0.0.1:1"}}  # fmt: skip
    build_config(data, environ={}).check_runnable()


# -- discovery through a real etcd ----------------------------------------------------------------


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _config(etcd: LocalEtcd, protocol: str, name: str) -> dict[str, Any]:
    return {
        "port": 0,
        "health_check_interval_s": 0.1,
        "worker_protocol": protocol,
        "context_fallback": "fail",
        "context_servers": {"num_instances": 0},
        "generation_servers": {"num_instances": 0},
        "disagg_cluster": {"cluster_uri": etcd.uri, "cluster_name": name,
                           "heartbeat_interval_sec": HEARTBEAT_S, "inactive_timeout_sec": TTL_S},
    }  # fmt: skip


async def _chat(session: aiohttp.ClientSession, port: int) -> tuple[int, Any]:
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as resp:
        return resp.status, await resp.json(content_type=None)


def _register(etcd: LocalEtcd, name: str, url: str, role: str, protocol: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "server.cli", "register", "--url", url, "--role", role,
            "--protocol", protocol, "--cluster-uri", etcd.uri, "--cluster-name", name,
            "--heartbeat-interval-sec", str(HEARTBEAT_S), "--inactive-timeout-sec", str(TTL_S)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())


async def _records(etcd: LocalEtcd, name: str, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
    prefix = ClusterSettings(etcd.uri, name).prefix
    client = EtcdClient(ClusterSettings(etcd.uri, name).etcd_endpoints(), session)
    return [json.loads(value) async for kvs, _ in client.range_prefix_pages(prefix) for _, value in kvs]


async def test_vllm_workers_kept_registered_by_the_sidecar_serve_and_leave_when_it_stops(
    etcd: LocalEtcd, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ``fastcore-serve register`` processes keep a vLLM prefill and decode registered (the model
    read from the worker's /v1/models); an orchestrator with ``worker_protocol: vllm`` finds them and
    serves a completion through both; a record that names no protocol (a trtllm worker's) is refused,
    naming it; a sidecar's SIGTERM revokes its lease and the worker leaves at once."""
    plane = KVPlane()
    prefill, decode = await start_vllm("prefill", plane=plane), await start_vllm("decode", plane=plane)
    sidecars = [_register(etcd, "vllm-pd", prefill.url, "context", "vllm"),
                _register(etcd, "vllm-pd", decode.url, "generation", "vllm")]  # fmt: skip
    server = None
    trtllm = WorkerRegistration(
        ClusterSettings(etcd.uri, "vllm-pd", HEARTBEAT_S, TTL_S),
        WorkerRecord("trtllm-gen", "generation", "tiny", "http://127.0.0.1:9"),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="fastcore.orchestrator"):
            server, orch = await start_server(build_config(_config(etcd, "vllm", "vllm-pd"), environ={}))
            assert await trtllm.start()
            await until(lambda: orch.context_pool.healthy_count() == 1, 20.0)
            await until(lambda: orch.generation_pool.healthy_count() == 1, 20.0)
        records = await _records(etcd, "vllm-pd", session)
        assert sorted((r.get("protocol", "-"), r["role"], r["model"]) for r in records) == [
            ("-", "generation", "tiny"), ("vllm", "context", "tiny"), ("vllm", "generation", "tiny")]  # fmt: skip
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert any("trtllm-gen" in m and "'trtllm'" in m and "'vllm'" in m for m in refused), refused
        assert {w.url for w in orch.generation_pool.workers} == {decode.url}
        status, body = await _chat(session, server.sockets[0].getsockname()[1])
        assert status == 200, body
        assert [r.kv_match for r in decode.requests if r.method == "POST"] == [True]
        assert prefill.violations == [] and decode.violations == []
        sidecars[1].send_signal(signal.SIGTERM)
        assert sidecars[1].wait(10) == 0
        await until(lambda: not orch.generation_pool.workers, 2 * TTL_S)  # revoked, not expired
    finally:
        for proc in sidecars:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        await trtllm.stop()
        if server is not None:
            await server.cleanup()
        await prefill.stop()
        await decode.stop()


async def test_sglang_workers_registered_with_their_protocol_serve(
    etcd: LocalEtcd, session: aiohttp.ClientSession
) -> None:
    """SGLang's prefill and decode registered in etcd naming ``sglang`` (as the sidecar writes them):
    found, the prefill's bootstrap port read from its /server_info at its health check, a completion
    served by the pair."""
    plane = BootstrapPlane()
    prefill, decode = await start_sglang("prefill", plane=plane), await start_sglang("decode", plane=plane)
    settings = ClusterSettings(etcd.uri, "sglang-pd", HEARTBEAT_S, TTL_S)
    regs = [
        WorkerRegistration(settings, WorkerRecord("p-1", "context", "tiny", prefill.url, protocol="sglang")),
        WorkerRegistration(
            settings, WorkerRecord("d-1", "generation", "tiny", decode.url, protocol="sglang")
        ),
    ]
    server = None
    try:
        server, orch = await start_server(build_config(_config(etcd, "sglang", "sglang-pd"), environ={}))
        for reg in regs:
            assert await reg.start()
        await until(lambda: orch.context_pool.healthy_count() == 1, 20.0)
        await until(lambda: orch.generation_pool.healthy_count() == 1, 20.0)
        await until(lambda: all(w.bootstrap_port for w in orch.context_pool.workers), 20.0)
        status, body = await _chat(session, server.sockets[0].getsockname()[1])
        assert status == 200, body
        assert prefill.violations == [] and decode.violations == []
    finally:
        for reg in regs:
            await reg.stop()
        if server is not None:
            await server.cleanup()
        await prefill.stop()
        await decode.stop()


async def test_auto_takes_the_protocol_the_registered_records_name(
    etcd: LocalEtcd, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """``worker_protocol: auto`` with etcd discovery: the start waits for the first registered worker
    and takes the protocol its record names (vllm); a trtllm record registered later is refused with
    one line naming both; the vLLM pair serves a completion."""
    plane = KVPlane()
    prefill, decode = await start_vllm("prefill", plane=plane), await start_vllm("decode", plane=plane)
    settings = ClusterSettings(etcd.uri, "auto-pd", HEARTBEAT_S, TTL_S)
    regs = [
        WorkerRegistration(settings, WorkerRecord("p-1", "context", "tiny", prefill.url, protocol="vllm")),
        WorkerRegistration(settings, WorkerRecord("d-1", "generation", "tiny", decode.url, protocol="vllm")),
        WorkerRegistration(settings, WorkerRecord("trtllm-gen", "generation", "tiny", "http://127.0.0.1:9")),
    ]
    server = None
    try:
        starting = asyncio.ensure_future(
            start_server(build_config(_config(etcd, "auto", "auto-pd"), environ={}))
        )
        await asyncio.sleep(0.3)
        assert not starting.done()  # nothing registered yet: the start waits
        for reg in regs[:2]:
            assert await reg.start()
        server, orch = await asyncio.wait_for(starting, 20)
        assert orch.protocol.name == "vllm" and orch.protocol_detected
        with caplog.at_level(logging.WARNING, logger="fastcore.orchestrator"):
            assert await regs[2].start()
            await until(lambda: "trtllm-gen" in orch.discovery.refused, 10.0)
        refused = [r.getMessage() for r in caplog.records if "trtllm-gen" in r.getMessage()]
        assert len(refused) == 1 and "'trtllm'" in refused[0] and "'vllm'" in refused[0], refused
        await until(lambda: orch.context_pool.healthy_count() == 1, 20.0)
        await until(lambda: orch.generation_pool.healthy_count() == 1, 20.0)
        status, body = await _chat(session, server.sockets[0].getsockname()[1])
        assert status == 200, body
        assert prefill.violations == [] and decode.violations == []
    finally:
        if not starting.done():
            starting.cancel()
        for reg in regs:
            await reg.stop()
        if server is not None:
            await server.cleanup()
        await prefill.stop()
        await decode.stop()


def test_the_sidecar_refuses_a_bad_url_or_protocol_with_one_line_and_exit_2() -> None:
    for extra in (
        ["--url", "https://x:1", "--protocol", "vllm"],
        ["--url", "http://127.0.0.1:9", "--protocol", "x"],
    ):
        argv = [sys.executable, "-m", "server.cli", "register", "--role", "context", "--model", "tiny",
                "--cluster-uri", "etcd://127.0.0.1:1", *extra]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().count("\n") == 0 and ("url" in done.stderr or "protocol" in done.stderr)


async def test_the_sidecar_waits_for_its_worker_before_registering(etcd: LocalEtcd) -> None:
    """Without ``--model`` the sidecar reads the worker's /v1/models: until the worker answers,
    nothing is registered (an orchestrator is not sent to a worker still loading)."""
    from server.cluster.sidecar import worker_model

    vllm = await start_vllm("decode")
    try:
        assert await worker_model(vllm.url, attempts=1) == "tiny"
    finally:
        await vllm.stop()
    assert await worker_model(vllm.url, attempts=2, interval_s=0.05) is None
