"""Cluster discovery with trtllm-serve, both ways (docs/protocol.md, "Talking to trtllm-serve").

- trtllm-serve workers (tests/trtllm_standin.py) registered its way (tests/trtllm_cluster_standin.py:
  its DisaggClusterWorker over its etcd storage or its HTTP storage client) serve through our
  orchestrator started from a trtllm-serve YAML with no ``urls``; a deleted or expired key stops
  their traffic.
- Our workers registered in trtllm-serve's format are found by trtllm-serve's cluster manager,
  in etcd and in its HTTP storage server.
- The records: trtllm-serve's, ours, both in one; every bound the embedded registry keeps holds
  for trtllm-serve's storage API too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import yaml
from helpers import free_port, until
from trtllm_cluster_standin import (
    ClusterManager,
    ClusterWorker,
    EtcdStorage,
    HttpStorageClient,
    HttpStorageServer,
    ServerRole,
    worker_key,
)
from trtllm_standin import start_standin

from server.cluster import ClusterSettings, RecordError, WorkerRecord, WorkerRegistration
from server.cluster.records import parse_entry
from server.launcher import Child, stop_all
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config

HEARTBEAT_S = 0.25
TTL_S = 2
API_KEY = "trtllm-storage-key"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 3}


def trtllm_yaml(cluster_uri: str, port: int, **cluster: Any) -> dict[str, Any]:
    """A trtllm-serve disaggregated YAML as its service-discovery examples write it: no urls."""
    text = f"""
hostname: 127.0.0.1
port: {port}
backend: pytorch
context_servers:
  num_instances: 1
  tensor_parallel_size: 1
  kv_cache_config:
    tokens_per_block: 32
generation_servers:
  num_instances: 1
  router:
    type: round_robin
disagg_cluster:
  cluster_uri: {cluster_uri}
  cluster_name: trt
  heartbeat_interval_sec: {HEARTBEAT_S}
  inactive_timeout_sec: {TTL_S}
  minimal_instances:
    context_servers: 1
    generation_servers: 1
"""
    data = yaml.safe_load(text)
    data["disagg_cluster"] |= cluster
    data["health_check_interval_s"] = 0.3
    return data


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def serve_both_routes(session: aiohttp.ClientSession, base: str) -> None:
    status, body = await post(session, base + "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    status, body = await post(session, base + "/v1/completions", COMPLETION)
    assert status == 200, body
    assert body["choices"][0]["text"]


async def trtllm_pair(storage: Any) -> tuple[list[Any], list[ClusterWorker]]:
    """A context and a generation trtllm-serve stand-in, each registered trtllm-serve's way."""
    standins = [await start_standin("context"), await start_standin("generation")]
    workers = []
    for standin, role in zip(standins, (ServerRole.CONTEXT, ServerRole.GENERATION)):
        worker = ClusterWorker(role, "127.0.0.1", standin.port, storage, cluster_name="trt",
                               heartbeat_s=HEARTBEAT_S, inactive_timeout_s=TTL_S)  # fmt: skip
        assert await worker.register()
        workers.append(worker)
    return standins, workers


async def leaves(orch: Any, pool: str, url: str) -> float:
    """Seconds until ``url`` is no longer in ``pool`` (printed: how fast traffic stops)."""
    target = orch.context_pool if pool == "context" else orch.generation_pool
    started = time.monotonic()
    await until(lambda: url not in {w.url for w in target.workers}, TTL_S + 5.0)
    return time.monotonic() - started


# -- trtllm-serve workers in front of which our orchestrator runs ---------------------------------


async def test_trtllm_workers_registered_in_etcd_serve_through_our_orchestrator(
    etcd: Any, session: aiohttp.ClientSession
) -> None:
    storage = EtcdStorage(f"etcd://127.0.0.1:{etcd.client_port}")
    port = free_port()
    server, orch = await start_server(build_config(trtllm_yaml(f"etcd://127.0.0.1:{etcd.client_port}", port),
                                                   environ={}))  # fmt: skip
    standins, workers = await trtllm_pair(storage)
    base = f"http://127.0.0.1:{port}"
    try:
        await until(lambda: orch.context_pool.healthy_count() == 1 and orch.generation_pool.healthy_count() == 1, 5)
        await serve_both_routes(session, base)
        assert standins[0].received("/v1/chat/completions") and standins[1].received("/v1/completions")
        # the orchestrator took trtllm-serve's record as it is: host, port, its ServerRole number
        assert orch.discovery is not None and orch.discovery.watcher is not None
        record = orch.discovery.watcher.workers[workers[1].info.worker_id]
        assert (record.role, record.url, record.layout) == ("generation", standins[1].url, "trtllm")
        # a deleted key: the worker leaves at the watch event, and its traffic stops
        assert await storage.delete(workers[1].key)
        print(f"\ndeleted key -> generation worker gone after {await leaves(orch, 'generation', standins[1].url):.3f}s")
        status, body = await post(session, base + "/v1/chat/completions", CHAT)
        assert status == 503, body
        # an expired key (the worker stopped heartbeating): gone after its lease's TTL
        await workers[0].stop_heartbeats()
        waited = await leaves(orch, "context", standins[0].url)
        print(f"expired lease -> context worker gone after {waited:.3f}s (TTL {TTL_S}s)")
    finally:
        await server.cleanup()
        for worker in workers:
            await worker.deregister()
        for standin in standins:
            await standin.stop()
        await storage.close()


async def test_trtllm_workers_registered_in_our_http_store_serve_and_leave(session: aiohttp.ClientSession) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server, orch = await start_server(build_config(trtllm_yaml(uri, port, api_key=API_KEY), environ={}))
    storage = HttpStorageClient(uri, api_key=API_KEY)
    standins, workers = await trtllm_pair(storage)
    try:
        await until(lambda: orch.context_pool.healthy_count() == 1 and orch.generation_pool.healthy_count() == 1, 5)
        await serve_both_routes(session, uri)
        # trtllm-serve's storage API answers in its shapes
        prefix = "/trtllm-disagg/trt/workers"
        listing = await storage.get_prefix(prefix)
        assert set(listing) == {w.key for w in workers}
        assert json.loads(listing[workers[0].key]) == {"worker_id": workers[0].info.worker_id, "host": "127.0.0.1",
                                                       "port": standins[0].port, "role": 0}  # fmt: skip
        assert await storage.get_prefix(prefix, keys_only=True) == {w.key: "" for w in workers}
        assert await storage.get(workers[1].key) == listing[workers[1].key]
        assert await storage.get(prefix + "/nobody") is None  # 400 {"result": null}
        assert not await storage.set(workers[0].key, listing[workers[0].key])  # exists, no overwrite
        # heartbeats keep them past the TTL
        await asyncio.sleep(TTL_S + 0.5)
        assert orch.generation_pool.healthy_count() == 1
        assert all(w.reregistrations == 0 for w in workers)
        # a deleted key (trtllm-serve's clean stop): gone at once
        assert await workers[1].deregister()
        assert standins[1].url not in {w.url for w in orch.generation_pool.workers}
        assert not await storage.delete(workers[1].key)  # 400 {"result": false}
        # an expired key
        await workers[0].stop_heartbeats()
        print(f"\nexpired key -> context worker gone after {await leaves(orch, 'context', standins[0].url):.3f}s")
        assert not await storage.expire(workers[0].key, TTL_S)  # gone: trtllm-serve's worker registers again
        assert await storage.get_prefix(prefix) is None  # empty: 400
    finally:
        for worker in workers:
            await worker.stop_heartbeats()
        await server.cleanup()
        for standin in standins:
            await standin.stop()
        await storage.close()


async def test_our_http_store_keeps_the_registry_bounds(session: aiohttp.ClientSession) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server, orch = await start_server(build_config(trtllm_yaml(uri, port, api_key=API_KEY), environ={}))
    key = worker_key("trt", "GENERATION-127.0.0.1:9-1-2-003")
    good = {"worker_id": "GENERATION-127.0.0.1:9-1-2-003", "host": "127.0.0.1", "port": 9, "role": 1}
    auth = {"Authorization": f"Bearer {API_KEY}"}

    async def set_item(item: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
        async with session.post(uri + "/set", json=item, headers=auth if headers is None else headers) as r:
            return r.status, await r.json(content_type=None)

    try:
        cases: list[tuple[dict[str, Any], dict[str, str] | None, int, str]] = [
            ({"key": key, "value": json.dumps(good)}, {}, 403, "Bearer"),
            ({"key": key, "value": json.dumps(good)}, {"Authorization": "Bearer wrong"}, 403, "Invalid API key"),
            ({"key": "/etc/anything", "value": "x"}, None, 400, "worker records only"),
            ({"key": key, "value": json.dumps(good | {"host": "0.0.0.0"})}, None, 400, "unspecified"),
            ({"key": key, "value": json.dumps(good | {"host": "169.254.169.254"})}, None, 400, "link-local"),
            ({"key": key, "value": json.dumps(good | {"port": True})}, None, 400, "'port'"),
            ({"key": key, "value": json.dumps(good | {"role": 2})}, None, 400, "MM_ENCODER"),
            ({"key": key + "x", "value": json.dumps(good)}, None, 400, "is not its key's"),
            ({"key": key, "value": json.dumps(good | {"pad": "x" * 5000})}, None, 400, "at most 4096 bytes"),
            ({"key": key, "value": json.dumps(good), "ttl": "ten"}, None, 400, "'ttl'"),
            ({"value": json.dumps(good)}, None, 400, "'key'"),
            ({"key": key, "value": json.dumps(good), "ttl": 10**400}, None, 200, ""),  # capped, no overflow
            ({"key": key + "\ud800", "value": json.dumps(good)}, None, 400, "not UTF-8"),
            ({"key": key, "value": '{"worker_id": "\ud800"}'}, None, 400, "'worker_id'"),
            ({"key": key, "value": json.dumps(good | {"host": "[::1]"})}, None, 400, "bare IPv6"),
        ]
        for item, headers, status, words in cases:
            got, body = await set_item(item, headers)
            assert got == status and (status == 200 or words in body["error"]["message"]), (item, body)
        async with session.delete(uri + "/delete", params={"key": key}, headers=auth) as r:
            assert r.status == 200  # the one that took (ttl capped)
        await until(lambda: not orch.generation_pool.workers, 5.0)
        async with session.post(uri + "/set", data=b"x" * (20 << 10), headers=auth) as r:
            assert r.status == 400 and "at most" in (await r.json())["error"]["message"]
        async with session.get(uri + "/get_prefix", params={"key_prefix": "/", "keys_only": "maybe"},
                               headers=auth) as r:  # fmt: skip
            assert r.status == 400 and (await r.json())["error"]["param"] == "keys_only"
        async with session.get(uri + "/expire", params={"key": key}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "ttl"
        async with session.get(uri + "/set", headers=auth) as r:
            assert r.status == 405
        # a ttl of -1 (trtllm-serve's "never") still expires here, after inactive_timeout_sec
        status, body = await set_item({"key": key, "value": json.dumps(good), "ttl": -1})
        assert (status, body) == (200, {"result": True})
        assert {w.url for w in orch.generation_pool.workers} == {"http://127.0.0.1:9"}
        await until(lambda: not orch.generation_pool.workers, TTL_S + 5.0)
    finally:
        await server.cleanup()


async def test_without_a_key_the_store_is_loopback_opt_in_only(session: aiohttp.ClientSession) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    good = {"worker_id": "CONTEXT-h:9-1-2-003", "host": "127.0.0.1", "port": 9, "role": 0}
    item = {"key": worker_key("trt", good["worker_id"]), "value": json.dumps(good), "ttl": TTL_S}
    for opt_in, status in ((False, 403), (True, 200)):
        data = trtllm_yaml(uri, port, allow_unsigned_loopback_registration=opt_in)
        server, _ = await start_server(build_config(data, environ={}))
        try:
            async with session.post(uri + "/set", json=item) as r:
                assert r.status == status, await r.text()
        finally:
            await server.cleanup()


# -- our workers registered trtllm-serve's way -----------------------------------------------------


def trtllm_record(role: str, port: int) -> WorkerRecord:
    from server.cluster.records import new_worker_id

    worker_id = new_worker_id(role, port, "trtllm", "127.0.0.1")
    return WorkerRecord(worker_id, role, "", f"http://127.0.0.1:{port}", layout="trtllm")


async def test_our_worker_registered_trtllm_style_in_etcd_is_found_by_trtllm_serve(etcd: Any) -> None:
    uri = f"etcd://127.0.0.1:{etcd.client_port}"
    settings = ClusterSettings(uri, "ours", HEARTBEAT_S, TTL_S, record_format="trtllm")
    registration = WorkerRegistration(settings, trtllm_record("generation", 8123))
    storage = EtcdStorage(uri)
    manager = ClusterManager(storage, "ours")
    try:
        assert await registration.start()
        found = await manager.workers()
        assert manager.unparsed == []
        assert list(found) == [registration.key]
        info = found[registration.key]
        assert (info.host, info.port, info.role) == ("127.0.0.1", 8123, ServerRole.GENERATION)
        assert info.worker_id.startswith("GENERATION-127.0.0.1:8123-")
        await asyncio.sleep(TTL_S + 0.5)  # the lease is kept alive
        assert list(await manager.workers()) == [registration.key]
        await registration.stop()
        assert await manager.workers() == {}
    finally:
        await registration.stop()
        await storage.close()


async def test_our_worker_registered_trtllm_style_in_trtllm_serves_http_store() -> None:
    store = await HttpStorageServer(api_key=API_KEY).start()
    settings = ClusterSettings(store.uri, "ours", HEARTBEAT_S, TTL_S, record_format="trtllm",
                               api_key=API_KEY.encode())  # fmt: skip
    registration = WorkerRegistration(settings, trtllm_record("context", 8124))
    client = HttpStorageClient(store.uri, api_key=API_KEY)
    manager = ClusterManager(client, "ours")
    try:
        assert await registration.start()
        found = await manager.workers()
        assert manager.unparsed == [] and list(found) == [registration.key]
        assert (found[registration.key].port, found[registration.key].role) == (8124, ServerRole.CONTEXT)
        await asyncio.sleep(TTL_S + 0.5)  # heartbeats (GET /expire) keep the key
        assert list(await manager.workers()) == [registration.key]
        assert registration.reregistrations == 0
        # the store lost the key (its expiry, a restart): the next heartbeat's 400 registers again
        del store.items[registration.key]
        # the store holds the key before the registration has read its answer and counted it
        await until(lambda: registration.reregistrations == 1, 5.0)
        assert registration.reregistrations == 1 and registration.key in store.items
        await registration.stop()
        assert registration.key not in store.items
        # without the key, trtllm-serve's store refuses and nothing is registered
        bad = WorkerRegistration(ClusterSettings(store.uri, "ours", HEARTBEAT_S, TTL_S, record_format="trtllm"),
                                 trtllm_record("context", 8125))  # fmt: skip
        assert not await bad.start(wait_s=1.0)
        await bad.stop()
        assert await manager.workers() == {}
    finally:
        await registration.stop()
        await client.close()
        await store.stop()


def test_trtllm_registration_refusals_name_what_is_wrong() -> None:
    settings = ClusterSettings("http://127.0.0.1:1", "c", record_format="trtllm")
    with pytest.raises(RecordError, match="one role, CONTEXT or GENERATION"):
        WorkerRegistration(settings, WorkerRecord("w", "both", "", "http://127.0.0.1:2", layout="trtllm"))
    remote = ClusterSettings("http://10.1.2.3:1", "c", record_format="trtllm", api_key=b"k")
    with pytest.raises(RecordError, match="bearer key over plain HTTP from loopback only"):
        WorkerRegistration(remote, trtllm_record("context", 2))
    with pytest.raises(RecordError, match="needs a record of that layout"):
        WorkerRegistration(settings, WorkerRecord("w", "context", "m", "http://127.0.0.1:2"))
    with pytest.raises(RecordError, match="record_format"):
        ClusterSettings("etcd://a:1", record_format="dynamo")
    with pytest.raises(RecordError, match="key_prefixes"):
        ClusterSettings("etcd://a:1", key_prefixes=())


# -- records ------------------------------------------------------------------------------------


def test_records_of_either_layout_or_both_under_either_prefix() -> None:
    s = ClusterSettings("etcd://a:1", "c")
    assert s.prefixes == ["/fastcore/c/workers/", "/trtllm-disagg/c/workers/"]
    assert ClusterSettings("etcd://a:1").prefix_of("trtllm") == "/trtllm-disagg//workers/"  # its empty name
    trt = {"worker_id": "CONTEXT-h:1-2-3-004", "host": "10.0.0.7", "port": 8001, "role": 0}
    ours = {"worker_id": "w1", "role": "generation", "model": "m", "url": "http://10.0.0.8:8002"}
    both = trt | {"model": "m", "capabilities": {"local_prefill": True}, "url": "http://10.0.0.7:8001"}
    for prefix in s.prefixes:
        _, rec = parse_entry(prefix, (prefix + trt["worker_id"]).encode(), json.dumps(trt).encode())
        assert (rec.role, rec.url, rec.model, rec.layout) == ("context", "http://10.0.0.7:8001", "", "trtllm")
        assert json.loads(rec.to_json()) == trt  # written back exactly as trtllm-serve reads it
        _, rec = parse_entry(prefix, (prefix + "w1").encode(), json.dumps(ours).encode())
        assert (rec.role, rec.layout) == ("generation", "fastcore")
        _, rec = parse_entry(prefix, (prefix + trt["worker_id"]).encode(), json.dumps(both).encode())
        assert (rec.model, rec.capabilities) == ("m", {"local_prefill": True})
        assert WorkerRecord.from_json(rec.to_json()) == rec
    v6 = WorkerRecord.from_obj(trt | {"host": "::1"})
    assert v6.url == "http://[::1]:8001"
    bad = [
        (trt | {"url": "http://10.0.0.9:8001"}, "disagree"),
        (trt | {"role": 4}, "EMBEDDING"),
        (trt | {"role": 9}, "unknown"),
        (trt | {"host": ""}, "'host'"),
        (trt | {"host": "2852039166"}, "four decimal numbers"),
        (trt | {"port": 0}, "'port'"),
        (trt | {"port": 70000}, "'port'"),
        ({k: v for k, v in trt.items() if k != "port"}, "'port'"),
        (ours | {"role": "router"}, "trtllm-serve's 0, 1"),
    ]
    for obj, words in bad:
        with pytest.raises(RecordError, match=words):
            WorkerRecord.from_obj(obj)


async def test_the_watcher_reads_both_prefixes_and_keeps_them_apart(etcd: Any) -> None:
    """Both prefixes are read and watched; a delete under one leaves the other's record; junk under
    trtllm-serve's prefix is skipped like junk under ours; the bound is over both."""
    from server.cluster import ClusterWatcher
    from server.cluster.etcd import EtcdClient

    uri = f"etcd://127.0.0.1:{etcd.client_port}"
    s = ClusterSettings(uri, "both", HEARTBEAT_S, TTL_S)
    seen: list[dict[str, WorkerRecord]] = []
    async with aiohttp.ClientSession() as session:
        client = EtcdClient([f"http://127.0.0.1:{etcd.client_port}"], session)
        ours = WorkerRecord("w-ours", "context", "m", "http://127.0.0.1:7001")
        theirs = {"worker_id": "GENERATION-h:7002-1-2-003", "host": "127.0.0.1", "port": 7002, "role": 1}
        await client.put(s.prefix_of("fastcore") + "w-ours", ours.to_json())
        await client.put(s.prefix_of("trtllm") + "junk", b"{not json")
        # an unbalanced bracket made urlsplit raise a plain ValueError that killed the watcher's task
        await client.put(s.prefix_of("fastcore") + "bad", b'{"worker_id":"bad","role":"context","model":"m",'
                                                           b'"url":"http://[x:1"}')  # fmt: skip
        watcher = ClusterWatcher(s, seen.append, session=session)
        await watcher.start()
        try:
            assert set(watcher.workers) == {"w-ours"} and watcher.ignored == 2
            await client.put(s.prefix_of("trtllm") + theirs["worker_id"], json.dumps(theirs).encode())
            await until(lambda: theirs["worker_id"] in watcher.workers, 5.0)
            # the same id under the other prefix: deleting it there leaves this one
            await client.put(s.prefix_of("trtllm") + "w-ours", b"[]")
            await client.delete(s.prefix_of("trtllm") + "w-ours")
            await client.delete(s.prefix_of("trtllm") + theirs["worker_id"])
            await until(lambda: theirs["worker_id"] not in watcher.workers, 5.0)
            assert "w-ours" in watcher.workers
            only = ClusterWatcher(ClusterSettings(uri, "both", HEARTBEAT_S, TTL_S, key_prefixes=("trtllm",)),
                                  lambda _: None, session=session)  # fmt: skip
            await only.start()
            assert only.workers == {}
            await only.stop()
        finally:
            await watcher.stop()
            for key in (s.prefix_of("fastcore") + "w-ours", s.prefix_of("fastcore") + "bad", s.prefix_of("trtllm") + "junk"):
                await client.delete(key)


# -- the worker process, told to register trtllm-serve's way ---------------------------------------

WORKER = [sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--prompt-tokens", "64",
          "--host", "127.0.0.1"]  # fmt: skip


def worker_process(role: str, cluster_uri: str, secret: str | None = None) -> tuple[Child, dict[str, str]]:
    port = free_port()
    argv = [*WORKER, "--role", role, "--port", str(port), "--cluster-uri", cluster_uri, "--cluster-name", "proc",
            "--heartbeat-interval-sec", str(HEARTBEAT_S), "--inactive-timeout-sec", str(TTL_S),
            "--cluster-record-format", "trtllm"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "FASTCORE_SHARED_SECRET"} | {"PYTHONUNBUFFERED": "1"}
    if secret is not None:
        env["FASTCORE_SHARED_SECRET"] = secret
    return Child(f"{role} {port}", argv, port), env


async def found_by_trtllm(manager: ClusterManager, port: int, role: ServerRole) -> None:
    for _ in range(300):
        found = await manager.workers()
        if found:
            (info,) = found.values()
            assert (info.host, info.port, info.role) == ("127.0.0.1", port, role)
            assert info.worker_id.startswith(f"{role.name}-127.0.0.1:{port}-")
            assert manager.unparsed == []
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the worker never registered")


async def gone_for_trtllm(manager: ClusterManager) -> None:
    for _ in range(300):
        if not await manager.workers():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the worker's key stayed")


async def test_a_worker_process_registers_trtllm_style_in_etcd_and_in_trtllms_http_store(etcd: Any) -> None:
    storage = EtcdStorage(f"etcd://127.0.0.1:{etcd.client_port}")
    store = await HttpStorageServer(api_key="proc-secret").start()
    client = HttpStorageClient(store.uri, api_key="proc-secret")
    children: list[Child] = []
    try:
        for manager, uri, secret, role in (
            (ClusterManager(storage, "proc"), f"etcd://127.0.0.1:{etcd.client_port}", None, ServerRole.GENERATION),
            (ClusterManager(client, "proc"), store.uri, "proc-secret", ServerRole.CONTEXT),
        ):
            child, env = worker_process(role.name.lower(), uri, secret)
            children.append(child)
            child.start(env)
            await found_by_trtllm(manager, child.port, role)
            stop_all([child])  # SIGTERM: deregisters (lease revoked / DELETE /delete)
            assert child.exit_code == 0
            await gone_for_trtllm(manager)
        # trtllm-serve's records have one role: a `both` worker says so and exits 2
        both, env = worker_process("both", f"etcd://127.0.0.1:{etcd.client_port}")
        proc = subprocess.run(both.argv, env=env, capture_output=True, timeout=60)
        assert proc.returncode == 2 and b"one role, CONTEXT or GENERATION" in proc.stderr, proc.stderr[-500:]
    finally:
        stop_all(children)
        await client.close()
        await store.stop()
        await storage.close()


async def test_our_orchestrator_follows_a_trtllm_orchestrators_http_store(session: aiohttp.ClientSession) -> None:
    """cluster_uri naming a trtllm-serve orchestrator (its HTTP storage, no /cluster/v1/workers): our
    orchestrator polls its /get_prefix, and serves through the trtllm-serve workers registered there."""
    store = await HttpStorageServer(api_key=API_KEY).start()
    storage = HttpStorageClient(store.uri, api_key=API_KEY)
    port = free_port()
    server, orch = await start_server(build_config(trtllm_yaml(store.uri, port, api_key=API_KEY), environ={}))
    standins, workers = await trtllm_pair(storage)
    try:
        await until(lambda: orch.context_pool.healthy_count() == 1 and orch.generation_pool.healthy_count() == 1, 5)
        await serve_both_routes(session, f"http://127.0.0.1:{port}")
        assert orch.discovery is not None and orch.discovery.connected
        assert await workers[1].deregister()
        print(f"\ndeleted key -> generation worker gone after {await leaves(orch, 'generation', standins[1].url):.3f}s "
              f"(polled every {HEARTBEAT_S}s)")  # fmt: skip
        # without its key the store refuses (403): the last known workers keep serving, disconnected
        store.api_key = "rotated"
        await until(lambda: not orch.discovery.connected, 5.0)  # type: ignore[union-attr]
        assert orch.context_pool.healthy_count() == 1
    finally:
        for worker in workers:
            await worker.stop_heartbeats()
        await server.cleanup()
        for standin in standins:
            await standin.stop()
        await storage.close()
        await store.stop()
