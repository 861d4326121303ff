"""The orchestrator with ``disagg_cluster``: pools that follow a registry, in this process, on real sockets.

Synthetic workers (the worker's whole HTTP protocol, no model) register
through :class:`server.cluster.WorkerRegistration`, as ``fastcore-serve worker
--cluster-uri`` does: with the orchestrator's embedded registry
(``cluster_uri: http://<its own address>``) and with a real etcd. Whole
processes (SIGKILLs, two orchestrators, load) are in tests/test_cluster_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from helpers import free_port, until
from tiny_workers import LiveWorker, one_torch_thread, synthetic_worker  # noqa: F401

from server.auth import SIGNATURE_HEADER
from server.cluster import ClusterSettings, WorkerRecord, WorkerRegistration, sign_registry
from server.cluster.local_etcd import LocalEtcd
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import ConfigError, build_config

SECRET = "cluster-test-secret"
HEARTBEAT_S = 0.2
TTL_S = 1.0
CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def cluster_config(uri: str | None = None, port: int | None = None, **cluster: Any) -> dict[str, Any]:
    port = port or free_port()
    section = {
        "cluster_uri": uri or f"http://127.0.0.1:{port}",
        "cluster_name": cluster.pop("name", "t"),
        "heartbeat_interval_sec": HEARTBEAT_S,
        "inactive_timeout_sec": TTL_S,
    } | cluster
    return {
        "port": port,
        "health_check_interval_s": 0.3,
        "context_servers": {"num_instances": 0},
        "generation_servers": {"num_instances": 0},
        "disagg_cluster": section,
    }


class Running:
    def __init__(self, server: Any, orch: Orchestrator) -> None:
        self.server, self.orch = server, orch
        self.url = f"http://127.0.0.1:{orch.config.port}"
        self.settings = orch.discovery.settings if orch.discovery else None  # type: ignore[union-attr]

    def urls(self, pool: str) -> set[str]:
        return {
            w.url
            for w in (self.orch.context_pool if pool == "context" else self.orch.generation_pool).workers
        }


async def orchestrator(data: dict[str, Any], secret: str | None = None, *, unsigned: bool = True) -> Running:
    """``unsigned``: without a secret, the embedded registry takes loopback peers (the opt-in flag)."""
    if secret is not None:
        data = data | {"shared_secret": secret}
    elif unsigned:
        data = data | {
            "disagg_cluster": data["disagg_cluster"] | {"allow_unsigned_loopback_registration": True}
        }
    server, orch = await start_server(build_config(data, environ={}))
    return Running(server, orch)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def worker_settings(orch: Running, secret: str | None = None) -> ClusterSettings:
    s = orch.settings
    assert s is not None
    return ClusterSettings(
        s.cluster_uri, s.cluster_name, HEARTBEAT_S, TTL_S, secret.encode() if secret else None
    )


async def join(
    settings: ClusterSettings, worker: LiveWorker, role: str, *, model: str = "synthetic", worker_id: str = ""
) -> WorkerRegistration:
    info = {"role": role, "model": model}
    rec = WorkerRecord(worker_id or f"{role}-{worker.port}", role, model, worker.url, info)
    reg = WorkerRegistration(settings, rec)
    assert await reg.start()
    return reg


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        return r.status, await r.json(content_type=None)


async def chat(session: aiohttp.ClientSession, orch: Running) -> tuple[int, Any]:
    async with session.post(orch.url + "/v1/chat/completions", json=CHAT) as r:
        return r.status, await r.json(content_type=None)


# -- the embedded registry -----------------------------------------------------------------


async def test_embedded_registry_workers_join_serve_and_leave(session: aiohttp.ClientSession) -> None:
    orch = await orchestrator(cluster_config())
    ctx, gen = await synthetic_worker("context"), await synthetic_worker("generation")
    try:
        status, body = await get(session, orch.url + "/health")
        assert status == 503 and body["error"]["code"] == "not_enough_workers"
        assert "context (0 of 1 healthy)" in body["error"]["message"]
        s = worker_settings(orch)
        regs = [await join(s, ctx, "context"), await join(s, gen, "generation")]
        await until(lambda: orch.orch.context_pool.healthy_count() == 1, 1.0)
        await until(lambda: orch.orch.generation_pool.healthy_count() == 1, 1.0)
        assert (await get(session, orch.url + "/health"))[0] == 200
        status, body = await chat(session, orch)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        status, listing = await get(session, orch.url + "/cluster/v1/workers")
        assert status == 200 and set(listing["workers"]) == {f"context-{ctx.port}", f"generation-{gen.port}"}
        async with session.get(orch.url + "/metrics") as r:
            page = await r.text()
        assert 'fastcore_orchestrator_cluster_workers{pool="context"} 1.0' in page
        assert "fastcore_orchestrator_cluster_connected 1.0" in page
        # a clean stop is a DELETE: gone at once
        await regs[1].stop()
        assert not orch.urls("generation")
        status, body = await get(session, orch.url + "/health")
        assert status == 503 and "generation (0 of 1 healthy)" in body["error"]["message"]
        # a worker that stops heartbeating is gone after its TTL
        assert regs[0]._task is not None
        regs[0]._task.cancel()
        regs[0].registered = False
        waited = await until(lambda: not orch.urls("context"), TTL_S + 2.0)
        assert waited > TTL_S / 2
        await regs[0].stop()
    finally:
        await ctx.server.cleanup()
        await gen.server.cleanup()
        await orch.server.cleanup()


async def test_embedded_registry_refuses_bad_registrations_with_4xx(session: aiohttp.ClientSession) -> None:
    orch = await orchestrator(cluster_config())
    base = orch.url + "/cluster/v1/workers"
    good = json.loads(WorkerRecord("w1", "context", "synthetic", "http://127.0.0.1:9").to_json())
    try:
        cases: list[tuple[str, str, Any, int, str]] = [
            ("PUT", "/w1", b"{nope", 400, "JSON"),
            ("PUT", "/w1", {"worker": good | {"role": "prefill"}}, 400, "role"),
            ("PUT", "/w1", {"worker": good | {"url": "http://x/v1"}}, 400, "url"),
            ("PUT", "/w1", {"worker": good | {"url": "https://127.0.0.1:9"}}, 400, "plain http"),
            ("PUT", "/w1", {"worker": good | {"url": "http://a:b@127.0.0.1:9"}}, 400, "userinfo"),
            ("PUT", "/w1", {"worker": good | {"url": "http://169.254.169.254:80"}}, 400, "link-local"),
            ("PUT", "/w1", {"worker": good | {"url": "http://[fe80::1%25lo]:80"}}, 400, "zone id"),
            ("PUT", "/w1", {"worker": good | {"capabilities": {"pad": "x" * 5000}}}, 413, "at most"),
            (
                "PUT",
                "/w1",  # 1.4 KB of UTF-8 in the body, 4.2 KB as the JSON the registry keeps and lists
                json.dumps({"worker": good | {"capabilities": {"s": "\u00e9" * 700}}}, ensure_ascii=False).encode(),
                400,
                "at most 4096 bytes",
            ),
            ("PUT", "/w1", {"worker": good, "ttl_s": "soon"}, 400, "ttl_s"),
            ("PUT", "/w1", [good], 400, "registration"),
            ("PUT", "/other", {"worker": good}, 400, "path names worker"),
            ("DELETE", "/nobody", None, 404, "no worker"),
            ("POST", "/w1", {"worker": good}, 405, "PUT or DELETE"),
            ("POST", "", {}, 405, "takes GET"),
            ("GET", "?after=x", None, 400, "version"),
        ]
        for method, path, body, status, words in cases:
            data = (
                body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
            )
            async with session.request(method, base + path, data=data) as r:
                answer = await r.json(content_type=None)
                assert r.status == status, (method, path, answer)
                assert words in answer["error"]["message"], (method, path, answer)
                assert isinstance(answer["error"]["code"], str | None)
        async with session.put(base + "/w1", data=b"x" * (70 << 10)) as r:
            assert r.status == 413
        # bounded: a full registry says 503 with Retry-After, a known worker still heartbeats
        assert orch.orch.discovery is not None and orch.orch.discovery.embedded is not None
        orch.orch.discovery.embedded.max_workers = 1
        async with session.put(base + "/w1", json={"worker": good}) as r:
            assert r.status == 200
        async with session.put(base + "/w2", json={"worker": good | {"worker_id": "w2"}}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "5"
        async with session.put(base + "/w1", json={"worker": good}) as r:
            assert r.status == 200
    finally:
        await orch.server.cleanup()


async def test_embedded_registry_long_poll_answers_on_a_change(session: aiohttp.ClientSession) -> None:
    orch = await orchestrator(cluster_config())
    base = orch.url + "/cluster/v1/workers"
    good = json.loads(WorkerRecord("w1", "context", "synthetic", "http://127.0.0.1:9").to_json())
    try:
        _, first = await get(session, base)
        poll = asyncio.ensure_future(get(session, f"{base}?after={first['version']}"))
        await asyncio.sleep(0.2)
        assert not poll.done(), "a GET at the current version waits for a change"
        async with session.put(base + "/w1", json={"worker": good}) as r:
            assert r.status == 200
        status, changed = await asyncio.wait_for(poll, 2.0)
        assert status == 200 and changed["version"] > first["version"] and "w1" in changed["workers"]
    finally:
        await orch.server.cleanup()


async def test_with_a_secret_the_registry_takes_only_signed_requests_once(
    session: aiohttp.ClientSession,
) -> None:
    orch = await orchestrator(cluster_config(), secret=SECRET)
    base = orch.url + "/cluster/v1/workers"
    ctx, gen = (
        await synthetic_worker("context", shared_secret=SECRET.encode()),
        await synthetic_worker("generation", shared_secret=SECRET.encode()),
    )
    try:
        for method, path in (("GET", ""), ("PUT", "/w1"), ("DELETE", "/w1")):
            async with session.request(method, base + path, data=b"{}") as r:
                body = await r.json(content_type=None)
                assert r.status == 403 and "missing" in body["error"]["message"], (method, body)
        wrong = worker_settings(orch, "not-the-secret")
        rec = WorkerRecord("w-wrong", "context", "synthetic", ctx.url)
        bad = WorkerRegistration(wrong, rec)
        assert await bad.start(wait_s=0.5) is False
        await bad.stop()
        s = worker_settings(orch, SECRET)
        regs = [await join(s, ctx, "context"), await join(s, gen, "generation")]
        await until(lambda: orch.orch.generation_pool.healthy_count() == 1, 1.0)
        assert (await chat(session, orch))[0] == 200
        # a captured signed request replayed verbatim is refused
        url = "/cluster/v1/workers"
        headers = {SIGNATURE_HEADER: sign_registry(SECRET.encode(), "GET", url)}
        async with session.get(orch.url + url, headers=headers) as r:
            assert r.status == 200
        async with session.get(orch.url + url, headers=headers) as r:
            assert r.status == 403 and "replayed" in (await r.json())["error"]["message"]
        for reg in regs:
            await reg.stop()
        assert not orch.urls("context") and not orch.urls("generation")
    finally:
        await ctx.server.cleanup()
        await gen.server.cleanup()
        await orch.server.cleanup()


def non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_without_a_secret_or_the_opt_in_nobody_may_register(session: aiohttp.ClientSession) -> None:
    """Unsigned registrations would let any local process take a share of the prompts: refused."""
    orch = await orchestrator(cluster_config(), unsigned=False)
    ctx = await synthetic_worker("context")
    good = json.loads(WorkerRecord("w1", "context", "synthetic", ctx.url).to_json())
    try:
        for method, path, body in (
            ("PUT", "/w1", {"worker": good}),
            ("GET", "", None),
            ("DELETE", "/w1", None),
        ):
            async with session.request(method, orch.url + "/cluster/v1/workers" + path, json=body) as r:
                answer = await r.json()
                assert r.status == 403, (method, answer)
                assert "allow_unsigned_loopback_registration" in answer["error"]["message"]
                assert "FASTCORE_SHARED_SECRET" in answer["error"]["message"]
        reg = WorkerRegistration(worker_settings(orch), WorkerRecord("w1", "context", "synthetic", ctx.url))
        assert await reg.start(wait_s=0.5) is False
        await reg.stop()
        assert not orch.urls("context")
    finally:
        await ctx.server.cleanup()
        await orch.server.cleanup()


async def test_the_listing_is_serialized_once_per_change(session: aiohttp.ClientSession) -> None:
    orch = await orchestrator(cluster_config())
    base = orch.url + "/cluster/v1/workers"
    assert orch.orch.discovery is not None
    registry = orch.orch.discovery.embedded
    assert registry is not None
    try:
        for i in range(3):
            rec = WorkerRecord(f"w{i}", "context", "synthetic", f"http://127.0.0.1:{9 + i}", {"n": i})
            async with session.put(f"{base}/w{i}", json={"worker": json.loads(rec.to_json())}) as r:
                assert r.status == 200
        listing = registry.listing()
        assert registry.listing() is listing, "every GET between two changes shares one serialization"
        async with session.get(base) as r:
            assert await r.read() == listing
        answer = json.loads(listing)
        assert answer["version"] == registry.version and answer["workers"]["w2"]["capabilities"] == {"n": 2}
        async with session.delete(f"{base}/w0") as r:
            assert r.status == 200
        assert registry.listing() is not listing and "w0" not in json.loads(registry.listing())["workers"]
    finally:
        await orch.server.cleanup()


async def test_without_a_secret_only_this_host_may_register(session: aiohttp.ClientSession) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    data = cluster_config() | {"hostname": "0.0.0.0"}
    orch = await orchestrator(data)
    good = json.loads(WorkerRecord("w1", "context", "synthetic", "http://127.0.0.1:9").to_json())
    try:
        async with session.put(f"http://{address}:{orch.orch.config.port}/cluster/v1/workers/w1",
                               json={"worker": good}) as r:  # fmt: skip
            body = await r.json()
            assert r.status == 403 and "FASTCORE_SHARED_SECRET" in body["error"]["message"]
        async with session.put(orch.url + "/cluster/v1/workers/w1", json={"worker": good}) as r:
            assert r.status == 200
    finally:
        await orch.server.cleanup()


async def test_another_orchestrator_follows_an_embedded_registry_over_http(
    session: aiohttp.ClientSession,
) -> None:
    host = await orchestrator(cluster_config())
    assert host.settings is not None
    follower = await orchestrator(cluster_config(uri=host.settings.cluster_uri))
    ctx, gen = await synthetic_worker("context"), await synthetic_worker("generation")
    try:
        assert follower.orch.discovery is not None and follower.orch.discovery.embedded is None
        s = worker_settings(host)
        regs = [await join(s, ctx, "context"), await join(s, gen, "generation")]
        await until(lambda: follower.orch.generation_pool.healthy_count() == 1, 1.0)
        assert (await chat(session, follower))[0] == 200
        await regs[0].stop()
        await until(lambda: not follower.urls("context"), 1.0)
        await regs[1].stop()
    finally:
        for live in (ctx, gen):
            await live.server.cleanup()
        await follower.server.cleanup()
        await host.server.cleanup()


# -- etcd ----------------------------------------------------------------------------------


async def test_etcd_discovery_beside_static_urls_and_a_refused_model(
    etcd: LocalEtcd, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    static_ctx = await synthetic_worker("context")
    ctx, gen, other = (
        await synthetic_worker("context"),
        await synthetic_worker("generation"),
        await synthetic_worker("generation"),
    )
    data = cluster_config(uri=etcd.uri, name="mixed", minimal_instances={"context_servers": 2})
    data["context_servers"] = {"urls": [static_ctx.url]}
    data["model"] = "synthetic"
    orch = await orchestrator(data)
    try:
        s = worker_settings(orch)
        with caplog.at_level(logging.WARNING, logger="fastcore.orchestrator"):
            regs = [
                await join(s, gen, "generation"),
                await join(s, other, "generation", model="llama-70b", worker_id="wrong-model"),
            ]
            await until(lambda: orch.orch.generation_pool.healthy_count() == 1, 1.0)
            await asyncio.sleep(0.3)
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == 1 and "llama-70b" in refused[0] and "wrong-model" in refused[0]
        assert orch.urls("generation") == {gen.url}
        # minimal_instances: 2 context workers, the static one counts
        status, body = await get(session, orch.url + "/health")
        assert status == 503 and "context (1 of 2 healthy)" in body["error"]["message"]
        regs.append(await join(s, ctx, "context"))
        await until(lambda: orch.orch.context_pool.healthy_count() == 2, 1.0)
        assert (await get(session, orch.url + "/health"))[0] == 200
        async with session.get(orch.url + "/metrics") as r:
            page = await r.text()
        assert "fastcore_orchestrator_cluster_refused_workers 1.0" in page
        for _ in range(4):
            assert (await chat(session, orch))[0] == 200
        for reg in regs:
            await reg.stop()
        await until(lambda: orch.urls("context") == {static_ctx.url}, 1.0)
        assert not orch.urls("generation")
    finally:
        for live in (static_ctx, ctx, gen, other):
            await live.server.cleanup()
        await orch.server.cleanup()


async def test_a_process_joining_a_shared_port_listens_once_its_discovered_workers_were_checked(
    etcd: LocalEtcd,
) -> None:
    """--workers N with discovery: the first health round runs before the first read of the registry
    (with no worker), so a process that joins the port (reuse_port) also checks the workers that read
    added before it listens: before, its first requests met 503 no_healthy_worker until the next round."""
    ctx, gen = await synthetic_worker("context"), await synthetic_worker("generation")
    data = cluster_config(uri=etcd.uri, name="joining")
    data["health_check_interval_s"] = 3600  # no second round: only the joining check can find them
    settings = ClusterSettings(etcd.uri, "joining", HEARTBEAT_S, TTL_S, None)
    regs = [await join(settings, ctx, "context"), await join(settings, gen, "generation")]
    server = None
    try:
        server, orch = await start_server(build_config(data, environ={}), reuse_port=True)
        workers = [w for pool in orch.pools for w in pool.workers]
        assert {w.url for w in workers} == {ctx.url, gen.url}
        assert all(w.checked and w.healthy for w in workers), workers
    finally:
        for reg in regs:
            await reg.stop()
        if server is not None:
            await server.cleanup()
        for live in (ctx, gen):
            await live.server.cleanup()


def test_cluster_config_errors_name_the_field() -> None:
    for section, words in (
        ({"cluster_uri": "zk://x:1"}, "cluster_uri"),
        ({"cluster_uri": "etcd://x:1", "heartbeat_interval_sec": 20}, "heartbeat_interval_sec"),
        ({"cluster_uri": "etcd://x:1", "minimal_instances": {"workers": 1}}, "minimal_instances"),
    ):
        data = cluster_config() | {"disagg_cluster": section}
        with pytest.raises(ConfigError, match=words):
            build_config(data, environ={})
    with pytest.raises(ConfigError, match="workers > 1"):
        build_config(cluster_config() | {"workers": 2}, environ={}).check_runnable()
