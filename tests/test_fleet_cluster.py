"""Orchestrators on several hosts sharing an etcd (server/orchestrator/fleet_cluster.py, config
``fleet_cluster``), against a real etcd on 127.0.0.1: the members divide each tenant's rate and
``max_inflight``; one leaving re-divides within one lease TTL; a breaker opened on one is honoured by
the other until its own probe; etcd stopped, each keeps its last share and says so once.

"Orchestrators" are :class:`FleetCluster` memberships, each with its own Admission and Pool, in this
process (the app's, started by start_server, in the last test). The rate counts run on a fake clock
once the shares are known, so they depend on no timing; the waits are bounded loops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers import free_port, need_etcd, read_prefix, until
from tiny_workers import one_torch_thread, synthetic_worker  # noqa: F401

from server.cluster.etcd import EtcdClient
from server.cluster.local_etcd import LocalEtcd
from server.errors import HTTPError
from server.metrics import Registry
from server.orchestrator.admission import Admission
from server.orchestrator.app import start_server
from server.orchestrator.config import AdmissionConfig, ConfigError, FleetClusterConfig, build_config
from server.orchestrator.fleet import MINUTE_NS, Fleet, Mapping
from server.orchestrator.fleet_cluster import FleetCluster, divide
from server.orchestrator.pools import Pool
from server.orchestrator.tenants import Tenant
from server.tasks import stop_tasks

TTL_S = 2
BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}]}'
WORKER = "http://127.0.0.1:9"
LIMITS = AdmissionConfig.model_validate(
    {"max_inflight": 8, "rate_limits": {"*": {"requests_per_minute": 120}}}
)


# -- the division, alone ------------------------------------------------------------------------


def test_the_parts_add_up_to_max_inflight_and_a_host_s_processes_count_as_one_group() -> None:
    assert divide({"a": "a", "b": "b"}, "a", 8) == (0.5, 4)
    parts = [divide({"a": "a", "b": "b", "c": "c"}, own, 8) for own in "abc"]
    assert [p[1] for p in parts] == [3, 3, 2] and sum(p[0] for p in parts) == pytest.approx(1)
    # host h runs two processes (one mapping: one group), host g one: h holds two thirds
    assert divide({"p0": "h", "p1": "h", "q": "g"}, "h", 9) == (pytest.approx(2 / 3), 6)
    # not registered yet: it counts itself; more groups than slots: never below 1
    assert divide({"b": "b"}, "a", 8) == (0.5, 4)
    assert divide({"a": "a", "b": "b", "c": "c"}, "c", 2) == (pytest.approx(1 / 3), 1)


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"cluster_uri": "http://127.0.0.1:1"}, "cluster_uri must be etcd://"),
        ({"cluster_uri": "etcd://127.0.0.1:1", "cluster_name": "a/b"}, "cluster_name"),
        ({"cluster_uri": "etcd://127.0.0.1:1", "lease_ttl_s": 1}, "lease_ttl_s"),
        ({"cluster_uri": "etcd://127.0.0.1:1", "ttl": 3}, "ttl"),
    ],
)
def test_a_bad_fleet_cluster_section_is_refused_naming_it(section: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        build_config({"fleet_cluster": section}, environ={})
    assert "fleet_cluster" in str(refused.value) and words in str(refused.value)


def test_a_host_s_processes_hold_the_group_s_share_on_their_mapping() -> None:
    """--workers 2 on one host of two: the mapping's buckets and slots are resized to the group's
    half (120 a minute: 60 a minute for the host, whichever process a request reaches; 4 slots)."""
    mapping = Mapping.create(2, buckets=64, breakers=16)
    try:
        now = [1000 * MINUTE_NS]
        admissions = []
        for index in range(2):
            fleet = Fleet(mapping, index)
            fleet.clock = lambda: now[0]
            admission = Admission(LIMITS, Registry(), retry_after_s=1)
            admission.share(fleet)
            admissions.append(admission)
        tenant = Tenant("alpha")
        admissions[0].slot(tenant, BODY)  # its bucket made whole, then halved by the share
        for admission in admissions:
            admission.divide(0.5, 4)
        admitted = 1
        for i in range(200):
            try:
                admissions[i % 2].slot(tenant, BODY)
                admitted += 1
            except HTTPError as exc:
                assert exc.code == "requests_per_minute"
        assert admitted == 60
        cores = [Fleet(mapping, index).core for index in range(2)]
        assert [cores[i % 2].acquire(admissions[0].max_inflight) for i in range(5)] == [True] * 4 + [False]
    finally:
        mapping.remove()


def test_a_prompt_over_this_orchestrator_s_part_says_so() -> None:
    config = AdmissionConfig.model_validate({"rate_limits": {"*": {"prompt_tokens_per_minute": 600}}})
    admission = Admission(config, Registry(), retry_after_s=1)
    admission.divide(0.5, 128)
    prompt = b'{"prompt":"' + b"x" * (400 * 4 - 2) + b'"}'  # 400 tokens: within 600, over its 300
    with pytest.raises(HTTPError) as refused:
        admission.slot(Tenant("alpha"), prompt)
    assert refused.value.status == 429 and "(600, this orchestrator's part 300)" in str(refused.value)


# -- memberships on a real etcd -----------------------------------------------------------------


@pytest.fixture
def config(etcd: LocalEtcd, request: pytest.FixtureRequest) -> FleetClusterConfig:
    """Each test its own fleet (cluster_name) on the module's etcd."""
    return FleetClusterConfig(cluster_uri=etcd.uri, cluster_name=request.node.name[:60], lease_ttl_s=TTL_S)


class Member:
    def __init__(self, config: FleetClusterConfig, admission: AdmissionConfig = LIMITS) -> None:
        self.admission = Admission(admission, Registry(), retry_after_s=1)
        self.pool = Pool("context", [WORKER], "round_robin", breaker_open_s=5.0)
        self.cluster = FleetCluster(config, admission=self.admission, pools=[self.pool])

    @property
    def breaker(self) -> Any:
        return self.pool.workers[0].breaker


@pytest.fixture
async def members(config: FleetClusterConfig) -> AsyncIterator[list[Member]]:
    made = [Member(config), Member(config)]
    for member in made:
        await member.cluster.start()
    await until(lambda: all(m.cluster.share == (0.5, 4) for m in made), 10)
    yield made
    for member in made:
        await member.cluster.stop()


def admitted_per_minute(
    admissions: list[Admission], minutes: int, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """A client at 480 requests a minute (4x the limit), alternating between the orchestrators, on
    a fake clock (set only here, with no await: the loop keeps the real one): what each minute
    admitted."""
    now = [time.monotonic()]
    with monkeypatch.context() as patch:
        patch.setattr("server.orchestrator.admission.time.monotonic", lambda: now[0])
        tenant, counts = Tenant("alpha"), []
        for _ in range(minutes):
            admitted = 0
            for i in range(480):
                now[0] += 0.125
                try:
                    admissions[i % 2].slot(tenant, BODY)
                    admitted += 1
                except HTTPError as exc:
                    assert exc.status == 429 and exc.code == "requests_per_minute"
            counts.append(admitted)
    return counts


async def test_two_orchestrators_hold_one_tenant_limit_within_15_percent(
    members: list[Member], monkeypatch: pytest.MonkeyPatch
) -> None:
    """120 requests a minute, 4x that over both: each holds half the bucket, so past the first
    minute (the full buckets and their refill) the fleet admits 120 +- 15% a minute; apart, each
    admits its own 120 (240). max_inflight 8 is 4 each."""
    counts = admitted_per_minute([m.admission for m in members], 4, monkeypatch)
    assert all(102 <= count <= 138 for count in counts[1:]), counts
    assert [m.admission.max_inflight for m in members] == [4, 4]
    apart = [Admission(LIMITS, Registry(), retry_after_s=1) for _ in range(2)]
    assert all(count >= 230 for count in admitted_per_minute(apart, 3, monkeypatch)[1:])


async def test_one_that_stops_or_dies_is_divided_again_within_one_lease_ttl(
    config: FleetClusterConfig,
) -> None:
    """Three members: a clean stop revokes its lease (the others re-divide at once); one that dies
    (its renewals stop, no revoke) counts until its lease expires, one TTL."""
    made = [Member(config) for _ in range(3)]
    for member in made:
        await member.cluster.start()
    try:
        await until(lambda: all(m.cluster.share[1] in (2, 3) and m.cluster.share[0] < 0.34 for m in made), 10)
        assert sum(m.admission.max_inflight for m in made) == 8
        tenant = Tenant("alpha")
        made[0].admission.slot(tenant, BODY)  # its bucket made at a third of the limit
        assert made[0].admission._tenants["alpha"].limits.requests.capacity == pytest.approx(40)  # type: ignore[union-attr]
        await made[2].cluster.stop()
        await until(lambda: all(m.cluster.share == (0.5, 4) for m in made[:2]), TTL_S)
        assert made[0].admission._tenants["alpha"].limits.requests.capacity == pytest.approx(60)  # type: ignore[union-attr]
        # a crash: its tasks end, its lease is left to expire
        dead = made[1].cluster
        await stop_tasks(dead._tasks)
        await dead._session.close()  # type: ignore[union-attr]
        dead.lease = None
        assert made[0].cluster.share == (0.5, 4)  # still counted: its lease lives
        took = await until(lambda: made[0].cluster.share == (1.0, 8), TTL_S + 3)
        assert took <= TTL_S + 3 and made[0].admission.max_inflight == 8
    finally:
        for member in made:
            await member.cluster.stop()


async def test_waiters_get_the_slots_a_larger_share_frees(config: FleetClusterConfig) -> None:
    """4 slots each; five completions wait on the first; the second leaves: the first's part is 8
    and four of its waiters go in at once (none of them waited on a poll of etcd)."""
    made = [Member(config), Member(config)]
    for member in made:
        await member.cluster.start()
    try:
        await until(lambda: all(m.cluster.share == (0.5, 4) for m in made), 10)
        admission, tenant = made[0].admission, Tenant("alpha")
        gate = asyncio.Event()

        async def completion() -> None:
            async with admission.slot(tenant, b"{}"):
                await gate.wait()

        tasks = [asyncio.ensure_future(completion()) for _ in range(9)]
        await until(lambda: admission.inflight == 4 and admission.queued == 5, 5)
        await made[1].cluster.stop()
        await until(lambda: admission.inflight == 8 and admission.queued == 1, TTL_S)
        gate.set()
        await asyncio.gather(*tasks)
    finally:
        for member in made:
            await member.cluster.stop()


async def test_a_breaker_opened_on_one_is_honoured_by_the_other_until_its_own_probe(
    members: list[Member], etcd: LocalEtcd, config: FleetClusterConfig
) -> None:
    first, second = members
    mine, theirs = first.breaker, second.breaker
    for _ in range(3):
        mine.failed()
    assert mine.state == mine.OPEN and theirs.state == theirs.CLOSED
    await until(lambda: theirs.state == theirs.OPEN, 5)
    assert mine.opened == 1 and theirs.opened == 0  # copied, not opened by a failure: not published again
    honoured_at = theirs.opened_at
    assert 4.0 < theirs.open_for <= 5.0  # what was left of the first's 5 s
    assert not theirs.allows(honoured_at + theirs.open_for - 0.1)
    async with aiohttp.ClientSession() as session:
        client = EtcdClient([etcd.url], session)
        prefix = f"/fastcore/{config.cluster_name}/fleet/breakers/"
        kvs, _ = await read_prefix(client, prefix)
        assert [json.loads(v)["url"] for _, v in kvs] == [WORKER]
        # its own half-open probe, one, after the period; a success closes it and deletes the key
        assert theirs.allows(honoured_at + theirs.open_for + 0.01)
        theirs.chosen()
        assert not theirs.allows(honoured_at + theirs.open_for + 0.02)
        theirs.succeeded()

        async def gone() -> bool:
            return not (await read_prefix(client, prefix))[0]

        deadline = time.monotonic() + 5
        while not await gone():
            assert time.monotonic() < deadline, "the breaker's key was not deleted"
            await asyncio.sleep(0.02)
    assert theirs.state == theirs.CLOSED and mine.state == mine.OPEN  # the first keeps its own


async def test_a_breaker_heard_of_while_probing_or_open_longer_is_left_alone(members: list[Member]) -> None:
    first, second = members
    theirs = second.breaker
    theirs.state, theirs.probing = theirs.HALF_OPEN, True  # its probe under way
    for _ in range(3):
        first.breaker.failed()
    await until(lambda: bool(first.cluster.published), 5)
    await until(lambda: bool(second.cluster.published), 5)
    assert theirs.state == theirs.HALF_OPEN and theirs.probing
    # junk under the prefix is ignored
    second.cluster._honour("x", b"not json", time.monotonic())
    second.cluster._honour("x", b'{"pool": "context", "url": 1, "open_s": 5, "by": "z"}', time.monotonic())
    assert theirs.state == theirs.HALF_OPEN
    theirs.succeeded()

    def heard(open_s: float, left_s: float) -> None:
        item = {"pool": "context", "url": WORKER, "open_s": open_s, "until": time.time() + left_s, "by": "z"}
        second.cluster._honour("k", json.dumps(item).encode(), time.monotonic())

    heard(5, -0.1)  # read after its end (a resync): not honoured
    assert theirs.state == theirs.CLOSED
    heard(5, 2)  # read 3 s late: what is left of it
    assert theirs.state == theirs.OPEN and 1.5 < theirs.open_for <= 2
    opened_at = theirs.opened_at
    heard(1, 1)  # open longer here already: left alone
    assert theirs.opened_at == opened_at and theirs.open_for > 1.5


@pytest.fixture
def own_etcd() -> Iterator[LocalEtcd]:
    """An etcd of this test's own, which it stops and starts."""
    need_etcd()
    server = LocalEtcd(free_port(), free_port()).start()
    yield server
    server.stop()


async def test_with_etcd_stopped_each_keeps_its_last_share_and_says_so_once(
    own_etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    config = FleetClusterConfig(cluster_uri=own_etcd.uri, cluster_name="outage", lease_ttl_s=TTL_S)
    made = [Member(config), Member(config)]
    for member in made:
        await member.cluster.start()
    try:
        await until(lambda: all(m.cluster.share == (0.5, 4) for m in made), 10)
        caplog.set_level(logging.WARNING, "fastcore.orchestrator")
        own_etcd.kill()
        await until(lambda: not any(m.cluster.connected for m in made), 5)
        await asyncio.sleep(1.5)  # several retries meanwhile
        assert all(m.cluster.share == (0.5, 4) and m.admission.max_inflight == 4 for m in made)
        said = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(said) == 2, [r.getMessage() for r in said]  # once each
        assert "keeping this orchestrator's last share" in said[0].getMessage()
        # it serves meanwhile, with its part of the limit
        tenant = Tenant("alpha")
        admitted = 0
        for _ in range(100):
            try:
                made[0].admission.slot(tenant, BODY)
                admitted += 1
            except HTTPError:
                pass
        assert 60 <= admitted <= 62
        own_etcd.start()
        await until(lambda: all(m.cluster.connected for m in made), 10)
        assert all(m.cluster.share == (0.5, 4) for m in made)
    finally:
        for member in made:
            await member.cluster.stop()


# -- two orchestrators, real sockets ------------------------------------------------------------


async def test_two_orchestrators_on_their_ports_share_a_tenant_s_limit(config: FleetClusterConfig) -> None:
    """start_server with fleet_cluster, twice, before one synthetic worker: 200 requests at once,
    alternating between the two ports, for a tenant at 120 a minute: 120 (+ the refill meanwhile,
    2 a second) are admitted, the rest 429; apart, each would admit 120 (all 200)."""
    worker = await synthetic_worker()
    servers = []
    try:
        for _ in range(2):
            data = {
                "port": free_port(),
                "context_servers": {"urls": [worker.url]},
                "generation_servers": {"urls": [worker.url]},
                "admission": {"rate_limits": {"*": {"requests_per_minute": 120}}},
                "fleet_cluster": config.model_dump(),
            }
            servers.append(await start_server(build_config(data, environ={})))
        orchestrators = [orch for _, orch in servers]
        await until(
            lambda: all(o.fleet_cluster and o.fleet_cluster.share[0] == 0.5 for o in orchestrators), 10
        )
        chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for orch in orchestrators:  # both have seen the worker healthy (a loaded machine: bounded)
                for _ in range(500):
                    async with session.get(f"http://127.0.0.1:{orch.config.port}/health") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.02)
            started = time.monotonic()

            async def post(i: int) -> int:
                port = orchestrators[i % 2].config.port
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(post(i) for i in range(200)))
        elapsed = time.monotonic() - started
        admitted = statuses.count(200)
        assert statuses.count(429) == 200 - admitted
        assert 102 <= admitted <= 138 + 2 * elapsed, (admitted, elapsed)
    finally:
        for server, _ in servers:
            await server.cleanup()
        await worker.server.cleanup()


async def test_a_breaker_one_orchestrator_opened_keeps_the_other_away(config: FleetClusterConfig) -> None:
    """Two start_server orchestrators, two context workers, one answering 500 to every leg (a
    breaker opens on one failure, for a minute). Once the first has sent it a leg, the second, told
    through etcd, sends it none of 20 requests (its own round robin would send it every other one)."""
    broken_legs = 0

    async def broken(request: web.Request) -> web.Response:
        nonlocal broken_legs
        broken_legs += 1
        return web.json_response({"error": {"message": "broken", "type": "internal_error"}}, status=500)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    broken_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    worker = await synthetic_worker()
    servers = []
    try:
        for _ in range(2):
            data = {
                "port": free_port(),
                "circuit_breaker_failures": 1,
                "circuit_breaker_open_s": 60,
                "circuit_breaker_panic_threshold": 0,
                "health_check_interval_s": 0.1,
                "context_servers": {"urls": [worker.url, broken_url], "router": {"type": "round_robin"}},
                "generation_servers": {"urls": [worker.url]},
                "fleet_cluster": config.model_dump(),
            }
            servers.append(await start_server(build_config(data, environ={})))
        first, second = (orch for _, orch in servers)
        await until(
            lambda: all(o.fleet_cluster and o.fleet_cluster.share[0] == 0.5 for o in (first, second)), 10
        )
        chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with aiohttp.ClientSession() as session:

            async def post(orch: Any) -> int:
                async with session.post(
                    f"http://127.0.0.1:{orch.config.port}/v1/chat/completions", json=chat
                ) as r:
                    await r.read()
                    return r.status

            for _ in range(200):
                if broken_legs:
                    break
                await post(first)
            assert broken_legs == 1
            theirs = next(w.breaker for w in second.context_pool.workers if w.url == broken_url)
            await until(lambda: theirs.state == theirs.OPEN, 10)
            statuses = [await post(second) for _ in range(20)]
        assert broken_legs == 1 and statuses == [200] * 20, (broken_legs, statuses)
    finally:
        for server, _ in servers:
            await server.cleanup()
        await worker.server.cleanup()
        await runner.cleanup()


async def test_metrics_say_the_live_members_and_this_orchestrator_s_share(config: FleetClusterConfig) -> None:
    """/metrics of start_server orchestrators with fleet_cluster: the members counted (itself
    included), its fraction of each rate and its part of max_inflight, etcd reachable; one stopping
    cleanly: the other's page says it is alone at once; none of these families without the section."""
    servers = []
    try:
        for _ in range(2):
            data = {"port": 0, "context_servers": {"urls": [WORKER]},
                    "generation_servers": {"urls": [WORKER]}, "admission": {"max_inflight": 8},
                    "fleet_cluster": config.model_dump()}  # fmt: skip
            servers.append(await start_server(build_config(data, environ={})))
        orchestrators = [orch for _, orch in servers]
        await until(
            lambda: all(o.fleet_cluster and o.fleet_cluster.share == (0.5, 4) for o in orchestrators), 10
        )
        for orch in orchestrators:
            page = await scrape(port_of(orch))
            assert page["fastcore_orchestrator_fleet_members"] == 2
            assert page["fastcore_orchestrator_fleet_share"] == 0.5
            assert page["fastcore_orchestrator_fleet_max_inflight"] == 4
            assert page["fastcore_orchestrator_fleet_connected"] == 1
        await servers.pop()[0].cleanup()
        alone = orchestrators[0]
        await until(lambda: alone.fleet_cluster is not None and alone.fleet_cluster.share == (1.0, 8), 10)
        page = await scrape(port_of(alone))
        assert page["fastcore_orchestrator_fleet_members"] == 1
        assert page["fastcore_orchestrator_fleet_share"] == 1
        assert page["fastcore_orchestrator_fleet_max_inflight"] == 8
    finally:
        for server, _ in servers:
            await server.cleanup()
    data = {
        "port": free_port(),
        "context_servers": {"urls": [WORKER]},
        "generation_servers": {"urls": [WORKER]},
    }
    server, orch = await start_server(build_config(data, environ={}))
    try:
        assert not [
            name for name in await scrape(port_of(orch)) if name.startswith("fastcore_orchestrator_fleet")
        ]
    finally:
        await server.cleanup()


def port_of(orchestrator: Any) -> int:
    return int(orchestrator.server.sockets[0].getsockname()[1])


async def scrape(port: int) -> dict[str, float]:
    """An orchestrator's /metrics: each unlabelled sample's value by name."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in text.splitlines())
        if name and not name.startswith("#") and "{" not in name
    }
