"""Client API keys, tenants, fair share, priorities and overload as 429 (docs/protocol.md, "Client
authentication and admission"; server/orchestrator/tenants.py and admission.py).

Synthetic workers and the orchestrator run on real sockets on 127.0.0.1 in this process, so a test
can read the admission queue's state and order its requests by it (each request is sent once the
one before it is queued: arrival order is then known, never raced); the SIGHUP test runs a real
orchestrator process. Nothing asserts a duration: a wait is a poll for a state, bounded only so a
broken build fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers import eventually, free_port

from server.errors import HTTPError
from server.metrics import Registry
from server.orchestrator.admission import Admission, TokenBucket, read_priority
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import AdmissionConfig, ConfigError, build_config
from server.orchestrator.tenants import KeyFileError, Tenant, parse_key_file
from server.worker.app import WorkerApp, WorkerSettings
from server.worker.synthetic import SyntheticEngine

BODY = {"model": "synthetic", "messages": [{"role": "user", "content": "hello there " * 10}], "max_tokens": 2}
#: a stream that runs until its client leaves (a slot held for as long as a test needs it)
ENDLESS = {**BODY, "max_tokens": 4000, "stream": True}
KEYS = "key-a-0123456789 alpha\nkey-b-0123456789 beta\n"
#: admission waits (queues drain behind synthetic workers on a shared machine) get 20 s
eventually_long = functools.partial(eventually, timeout=20.0)


async def start_app(role: str) -> tuple[Any, str]:
    app = WorkerApp(
        SyntheticEngine(0, token_latency_s=0.005), WorkerSettings(role=role, model_name="synthetic")
    )
    server, port = await app.start("127.0.0.1", 0)
    return server, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def workers() -> AsyncIterator[tuple[str, str]]:
    ctx, ctx_url = await start_app("context")
    gen, gen_url = await start_app("generation")
    try:
        yield ctx_url, gen_url
    finally:
        await ctx.cleanup()
        await gen.cleanup()


@asynccontextmanager
async def orchestrator(
    environ: dict[str, str] | None = None, **config: Any
) -> AsyncIterator[tuple[Orchestrator, str]]:
    async with workers() as (ctx_url, gen_url):
        data = {"port": 0, "health_check_interval_s": 0.1, "context_servers": {"urls": [ctx_url]},
                "generation_servers": {"urls": [gen_url]}, **config}  # fmt: skip
        server, orch = await start_server(build_config(data, environ=environ or {}))
        try:
            assert await eventually_long(lambda: all(w.healthy for p in orch.pools for w in p.workers))
            yield orch, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            await server.cleanup()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(session: aiohttp.ClientSession, url: str, key: str | None = None,
               body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any], Any]:  # fmt: skip
    headers = bearer(key) if key else {}
    async with session.post(url + "/v1/chat/completions", json=body or BODY, headers=headers) as resp:
        return resp.status, dict(resp.headers), json.loads(await resp.read())


async def metrics(session: aiohttp.ClientSession, url: str, **headers: str) -> str:
    async with session.get(url + "/metrics", headers=headers) as resp:
        assert resp.status == 200
        return await resp.text()


def sample(page: str, name: str) -> float:
    for row in page.splitlines():
        if row.startswith(name + " "):
            return float(row.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on the page")


class Holder:
    """A stream that holds one admission slot until :meth:`release` (its client leaves)."""

    def __init__(self, url: str, key: str | None = None) -> None:
        self.url, self.key = url, key
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            headers = bearer(self.key) if self.key else {}
            async with session.post(self.url + "/v1/chat/completions", json=ENDLESS, headers=headers) as resp:
                assert resp.status == 200
                async for _ in resp.content:
                    pass

    async def hold(self, orch: Orchestrator) -> Holder:
        assert orch.admission is not None
        before = orch.admission.inflight
        self.task = asyncio.create_task(self._run())
        assert await eventually_long(lambda: orch.admission.inflight == before + 1)  # type: ignore[union-attr]
        return self

    async def release(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


# -- the key file and the priority field, alone ------------------------------------------------------


def test_key_file_lines_weights_and_errors_name_the_line_never_the_key() -> None:
    keys = parse_key_file(b"# comment\n\nk1 alpha 2\nk#2 alpha 2\nk3 beta\n", "keys")
    assert keys == {b"k1": Tenant("alpha", 2.0), b"k#2": Tenant("alpha", 2.0), b"k3": Tenant("beta", 1.0)}
    bad = {
        b"secret-one\n": "line 1: expected '<key> <tenant> [weight] [priority=MIN..MAX]'",
        b"secret-one a 0\n": "line 1: weight must be a number > 0",
        b"secret-one a nan\n": "weight must be a number > 0",
        b"secret-one a\nsecret-one b\n": "line 2: this key is listed twice",
        b"secret-one a 1\nsecret-two a 2\n": "line 2: tenant a has weight 2 here and 1",
        b"secret-one bad/name\n": "a tenant name is",
        b"# nothing\n": "no keys",
    }
    for text, message in bad.items():
        with pytest.raises(KeyFileError, match=re.escape(message)) as info:
            parse_key_file(text, "keys")
        assert "secret" not in str(info.value)


def test_priority_is_read_from_the_raw_body_and_a_bad_one_is_a_400_naming_it() -> None:
    assert read_priority(b'{"messages": [{"priority": 5}]}') == 0  # only the top level counts
    assert read_priority(b'{"priority": -3, "model": "m"}') == -3
    assert read_priority(b'{"priority": 0}') == 0
    assert read_priority(b"not json") == 0  # the relay's own check answers it
    for value in (b'"high"', b"1.5", b"true", b"null", b"[1]", b"1e3", b"99999999999999999999"):
        with pytest.raises(HTTPError) as info:
            read_priority(b'{"priority": ' + value + b"}")
        assert info.value.status == 400 and info.value.param == "priority"
        assert "priority must be an integer" in info.value.message


def test_token_bucket_holds_a_minute_and_says_how_long_to_wait() -> None:
    bucket = TokenBucket(60.0)  # one a second
    now = bucket.stamp
    assert bucket.wait(60, now) == 0
    bucket.take(60)
    assert bucket.wait(1, now) == pytest.approx(1.0)
    assert bucket.wait(1, now + 1.0) == 0
    assert bucket.wait(1000, now + 1.0) == pytest.approx(59.0)  # capped at the bucket: a minute's worth


def test_prompt_token_limits_use_the_learned_bytes_per_token() -> None:
    config = AdmissionConfig(rate_limits={"*": {"prompt_tokens_per_minute": 100}})
    body = b'{"prompt": "' + b"x" * 108 + b'"}'  # 120 bytes
    for bytes_per_token, served in ((4.0, 3), (2.0, 1)):  # 30 tokens a request, then 60
        admission = Admission(config, Registry(), 1, lambda b=bytes_per_token: b)
        count = 0
        try:
            for _ in range(5):
                admission.slot(Tenant("t"), body)
                count += 1
        except HTTPError as exc:
            assert exc.status == 429 and exc.code == "prompt_tokens_per_minute"
        assert count == served


def test_admission_config_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"admission\.max_inflight"):
        build_config({"admission": {"max_inflight": 0}}, environ={})
    with pytest.raises(ConfigError, match=r"admission\.rate_limits"):
        build_config({"admission": {"rate_limits": {"a": {"requests_per_minute": -1}}}}, environ={})
    with pytest.raises(ConfigError, match="metrics_requires_key: needs api_keys_file"):
        build_config({"metrics_requires_key": True}, environ={})
    with pytest.raises(ConfigError, match="api_keys_file: cannot read"):
        build_config({"api_keys_file": "/nonexistent/keys"}, environ={})


async def _order(weights: dict[str, float], arrivals: list[tuple[str, int]]) -> list[int]:
    """The order in which one slot serves ``arrivals`` (tenant, priority), queued in that order."""
    admission = Admission(AdmissionConfig(max_inflight=1, client_priority=True), Registry(), retry_after_s=1)
    await admission.slot(Tenant("holder"), b"{}").__aenter__()
    served: list[int] = []

    async def one(i: int, tenant: str, priority: int) -> None:
        body = b'{"priority": %d}' % priority
        async with admission.slot(Tenant(tenant, weights.get(tenant, 1.0)), body):
            served.append(i)

    tasks = []
    for i, (tenant, priority) in enumerate(arrivals):
        tasks.append(asyncio.create_task(one(i, tenant, priority)))
        await eventually_long(lambda n=i + 1: admission.queued == n)
    admission.release()
    await asyncio.gather(*tasks)
    assert admission.inflight == 0 and admission.queued == 0
    return served


async def test_deficit_round_robin_shares_by_weight_and_priority_orders_within_a_tenant() -> None:
    a4_b2 = [("a", 0)] * 4 + [("b", 0)] * 2
    assert await _order({}, a4_b2) == [0, 4, 1, 5, 2, 3]  # equal weights: turns alternate
    assert await _order({"a": 2.0}, a4_b2) == [0, 1, 4, 2, 3, 5]  # two of a's per one of b's
    assert await _order({"b": 0.5}, a4_b2) == [0, 1, 4, 2, 3, 5]  # b: a request every other turn
    # lower priority first within a tenant, arrival order among equals
    assert await _order({}, [("a", 0), ("a", 0), ("a", -5), ("a", 3), ("a", -5)]) == [2, 4, 0, 1, 3]


async def test_a_full_queue_gives_a_newcomer_the_place_of_the_tenant_holding_the_most() -> None:
    admission = Admission(
        AdmissionConfig(max_inflight=1, max_queue=3, client_priority=True), Registry(), retry_after_s=1
    )
    await admission.slot(Tenant("holder"), b"{}").__aenter__()
    outcome: dict[str, object] = {}

    async def one(name: str, tenant: str, priority: int = 0) -> None:
        try:
            async with admission.slot(Tenant(tenant), b'{"priority": %d}' % priority):
                outcome[name] = "served"
        except HTTPError as exc:
            outcome[name] = exc.code

    tasks = []
    arrivals = [("big1", "big", 0), ("big2", "big", 0), ("big3", "big", 0), ("small1", "small", 0),
                ("small2", "small", 0), ("big-urgent", "big", -1), ("big4", "big", 0)]  # fmt: skip
    for i, (name, tenant, priority) in enumerate(arrivals):
        tasks.append(asyncio.create_task(one(name, tenant, priority)))
        queued, refused = min(i + 1, 3), max(0, i - 2)  # from the 4th on, one 429 an arrival
        assert await eventually_long(lambda q=queued, r=refused: admission.queued == q and len(outcome) == r)
    # small1 took big3's place (big held 3 of 3); small2 found the shares even (big 2, small 1+1): refused;
    # big-urgent took its own tenant's last place (big2), more urgent; big4 is no more urgent: refused
    assert outcome == {
        "big3": "queue_full",
        "small2": "queue_full",
        "big2": "queue_full",
        "big4": "queue_full",
    }
    admission.release()
    await asyncio.gather(*tasks)
    assert [n for n, o in outcome.items() if o == "served"] == ["big-urgent", "small1", "big1"]
    assert admission.queued == 0 and admission.inflight == 0


# -- keys on real sockets -------------------------------------------------------------------------------


async def test_missing_and_wrong_keys_get_the_same_401_and_health_stays_open(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with orchestrator(api_keys_file=str(keys)) as (_, url), aiohttp.ClientSession() as session:
        answers = []
        for headers in ({}, bearer("key-a-0123456789x"), bearer("nope"), {"Authorization": "Basic a2V5"},
                        {"Authorization": "key-a-0123456789"}):  # fmt: skip
            async with session.post(url + "/v1/chat/completions", json=BODY, headers=headers) as resp:
                answers.append((resp.status, resp.headers.get("WWW-Authenticate"), await resp.read()))
            async with session.get(url + "/v1/models", headers=headers) as resp:
                answers.append((resp.status, resp.headers.get("WWW-Authenticate"), await resp.read()))
        assert len(set(answers)) == 1
        status, challenge, body = answers[0]
        assert status == 401 and challenge.startswith("Bearer")
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert (await post(session, url, "key-a-0123456789"))[0] == 200
        assert (await post(session, url, "key-b-0123456789"))[0] == 200
        async with session.get(url + "/v1/models", headers=bearer("key-b-0123456789")) as resp:
            assert resp.status == 200
        async with session.get(url + "/health") as resp:
            assert resp.status == 200
        page = await metrics(session, url)  # loopback: the metrics rule as before
        assert sample(page, "fastcore_orchestrator_unauthorized_total") == 10


async def test_fastcore_api_key_is_one_key_without_a_file() -> None:
    async with (
        orchestrator(environ={"FASTCORE_API_KEY": "env-key"}) as (_, url),
        aiohttp.ClientSession() as s,
    ):
        assert (await post(s, url))[0] == 401
        assert (await post(s, url, "wrong"))[0] == 401
        assert (await post(s, url, "env-key"))[0] == 200


async def test_metrics_requires_key_takes_a_client_key_or_the_metrics_token(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with orchestrator(api_keys_file=str(keys), metrics_requires_key=True, metrics_token="scrape") as (
        _, url), aiohttp.ClientSession() as session:  # fmt: skip
        for headers, status in (({}, 401), (bearer("nope"), 401), (bearer("key-a-0123456789"), 200),
                                (bearer("scrape"), 200)):  # fmt: skip
            async with session.get(url + "/metrics", headers=headers) as resp:
                assert resp.status == status, headers
            async with session.get(url + "/prometheus/metrics", headers=headers) as resp:
                assert resp.status == status, headers


@pytest.mark.slow
async def test_sighup_reloads_the_key_file_in_a_real_process(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("old-key-123 alpha\n")
    log = tmp_path / "stderr"
    async with workers() as (ctx_url, gen_url):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port), "--context-urls", ctx_url,
             "--generation-urls", gen_url, "--health-check-interval-s", "0.1", "--api-keys-file", str(keys)],
            stderr=log.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:

                async def status(key: str) -> int:
                    try:
                        return (await post(session, url, key))[0]
                    except aiohttp.ClientError:
                        return 0

                async def until(key: str, want: int) -> bool:
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        if await status(key) == want:
                            return True
                        await asyncio.sleep(0.05)
                    return False

                assert await until("old-key-123", 200)
                assert await status("new-key-456") == 401
                keys.write_text("new-key-456 beta\n")
                proc.send_signal(signal.SIGHUP)
                assert await until("new-key-456", 200)
                assert await status("old-key-123") == 401
                keys.write_text("broken line with four fields\n")  # refused: the keys in force stay
                proc.send_signal(signal.SIGHUP)
                assert await eventually_long(
                    lambda: "api_keys_file not reloaded" in log.read_text(), timeout=30
                )
                assert await status("new-key-456") == 200
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        err = log.read_text()
        assert "api_keys_file reloaded" in err and "line 1" in err
        assert "new-key-456" not in err and "old-key-123" not in err and "broken" not in err
        assert proc.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
async def test_sighup_without_a_key_file_is_a_logged_no_op(processes: int, tmp_path: Path) -> None:
    """As nginx's reload: SIGHUP to an orchestrator with no api_keys_file (one process, or the parent
    of --workers 2) re-reads nothing, says so, and the orchestrator goes on serving (SIGHUP's
    default action ended it)."""
    log = tmp_path / "stderr"
    said = "SIGHUP: no api_keys_file, nothing to reload"
    async with workers() as (ctx_url, gen_url):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port), "--context-urls", ctx_url,
             "--generation-urls", gen_url, "--health-check-interval-s", "0.1", "--workers", str(processes)],
            stderr=log.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            assert await eventually_long(
                lambda: log.read_text().count("listening on") == processes, timeout=60
            )
            proc.send_signal(signal.SIGHUP)
            assert await eventually_long(lambda: log.read_text().count(said) == processes)
            assert proc.poll() is None
            for _ in range(4):  # a new connection each: whichever process takes it
                async with aiohttp.ClientSession() as session:
                    assert (await post(session, f"http://127.0.0.1:{port}"))[0] == 200
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        assert proc.returncode == 0, log.read_text()[-2000:]


# -- admission on real sockets --------------------------------------------------------------------------


async def test_queue_full_and_queue_timeout_are_429_with_retry_after() -> None:
    admission = {"max_inflight": 1, "max_queue": 1, "max_queue_wait_s": 0.3}
    async with (
        orchestrator(admission=admission, retry_after_s=3) as (orch, url),
        aiohttp.ClientSession() as s,
    ):
        assert orch.admission is not None
        holder = await Holder(url).hold(orch)
        try:
            queued = asyncio.create_task(post(s, url))
            assert await eventually_long(lambda: orch.admission.queued == 1)  # type: ignore[union-attr]
            status, headers, body = await post(s, url)  # the queue is full
            assert status == 429 and headers["Retry-After"] == "3"
            assert body["error"]["code"] == "queue_full" and "(1 waiting)" in body["error"]["message"]
            status, headers, body = await queued  # the holder never ends: not started in time
            assert status == 429 and headers["Retry-After"] == "3"
            assert body["error"]["code"] == "queue_timeout"
            assert "max_queue_wait_s" in body["error"]["message"]
        finally:
            await holder.release()
        assert await eventually_long(lambda: orch.admission.inflight == 0)  # type: ignore[union-attr]
        assert (await post(s, url))[0] == 200
        page = await metrics(s, url)
        assert (
            sample(page, 'fastcore_orchestrator_tenant_rejected_total{reason="queue_full",tenant="default"}')
            == 1
        )
        assert (
            sample(
                page, 'fastcore_orchestrator_tenant_rejected_total{reason="queue_timeout",tenant="default"}'
            )
            == 1
        )
        assert sample(page, 'fastcore_orchestrator_tenant_admitted_total{tenant="default"}') == 2
        assert sample(page, 'fastcore_orchestrator_requests_total{route="chat",status="429"}') == 2


async def test_a_queued_client_that_leaves_is_dropped_at_once() -> None:
    async with orchestrator(admission={"max_inflight": 1}) as (orch, url), aiohttp.ClientSession() as s:
        admission = orch.admission
        assert admission is not None
        holder = await Holder(url).hold(orch)
        try:
            leaver = asyncio.create_task(post(s, url))
            assert await eventually_long(lambda: admission.queued == 1)
            assert sample(await metrics(s, url), 'fastcore_orchestrator_tenant_queued{tenant="default"}') == 1
            leaver.cancel()
            await asyncio.gather(leaver, return_exceptions=True)
            assert await eventually_long(lambda: admission.queued == 0)
            assert sample(await metrics(s, url), 'fastcore_orchestrator_tenant_queued{tenant="default"}') == 0
            assert admission.inflight == 1  # only the holder
        finally:
            await holder.release()
        assert await eventually_long(lambda: admission.inflight == 0)
        assert (await post(s, url))[0] == 200  # the slot and the queue are usable again


async def test_fair_share_and_priority_through_the_orchestrator(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("ka alpha 2\nkb beta\n")
    admission_config = {"max_inflight": 1, "client_priority": True}
    async with orchestrator(api_keys_file=str(keys), admission=admission_config) as (orch, url):
        admission = orch.admission
        assert admission is not None
        async with aiohttp.ClientSession() as s:
            holder = await Holder(url, "ka").hold(orch)
            done: list[str] = []

            async def one(name: str, key: str, priority: int = 0) -> None:
                status, _, _ = await post(s, url, key, {**BODY, "priority": priority})
                assert status == 200
                done.append(name)

            arrivals = [("b1", "kb", 0), ("b2", "kb", 0), ("b3", "kb", 0), ("a1", "ka", 0), ("a2", "ka", 0),
                        ("a3", "ka", 0), ("a-urgent", "ka", -10)]  # fmt: skip
            tasks = []
            for i, (name, key, priority) in enumerate(arrivals):
                tasks.append(asyncio.create_task(one(name, key, priority)))
                assert await eventually_long(lambda n=i + 1: admission.queued == n)
            await holder.release()
            await asyncio.gather(*tasks)
        # beta queued first: its turn, then alpha's two (the urgent one first), and so on
        assert done == ["b1", "a-urgent", "a1", "b2", "a2", "a3", "b3"]
        async with aiohttp.ClientSession() as s:
            page = await metrics(s, url)
            assert sample(page, 'fastcore_orchestrator_tenant_admitted_total{tenant="alpha"}') == 5
            assert sample(page, 'fastcore_orchestrator_tenant_admitted_total{tenant="beta"}') == 3
            assert sample(page, 'fastcore_orchestrator_tenant_queue_wait_seconds_count{tenant="beta"}') == 3
            status, _, body = await post(s, url, "ka", {**BODY, "priority": "high"})
            assert status == 400 and body["error"]["param"] == "priority"


async def test_rate_limits_per_tenant_answer_429_with_retry_after(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("ka alpha\nkb beta\n")
    limits = {"alpha": {"requests_per_minute": 2}, "*": {"prompt_tokens_per_minute": 100}}
    async with orchestrator(api_keys_file=str(keys), admission={"rate_limits": limits}) as (_, url):
        async with aiohttp.ClientSession() as s:
            assert (await post(s, url, "ka"))[0] == 200
            assert (await post(s, url, "ka"))[0] == 200
            status, headers, body = await post(s, url, "ka")
            assert status == 429 and body["error"]["code"] == "requests_per_minute"
            assert 1 <= int(headers["Retry-After"]) <= 30  # one request a 30 s refill
            # beta: 100 prompt tokens a minute, each request 46 as the workers count them (charged
            # as estimated at admission, then corrected to that)
            big = {**BODY, "messages": [{"role": "user", "content": "x" * 160}]}
            status, _, body = await post(s, url, "kb", big)
            tokens = body["usage"]["prompt_tokens"]
            assert status == 200 and 2 * tokens <= 100 < 3 * tokens
            assert (await post(s, url, "kb", big))[0] == 200
            status, headers, body = await post(s, url, "kb", big)
            assert status == 429 and body["error"]["code"] == "prompt_tokens_per_minute"
            assert int(headers["Retry-After"]) >= 1
            page = await metrics(s, url)
            assert (
                sample(
                    page,
                    'fastcore_orchestrator_tenant_rejected_total{reason="requests_per_minute",tenant="alpha"}',
                )
                == 1
            )
            assert (
                sample(
                    page,
                    'fastcore_orchestrator_tenant_rejected_total{reason="prompt_tokens_per_minute",tenant="beta"}',
                )
                == 1
            )


@pytest.mark.slow
async def test_sighup_to_the_parent_of_workers_n_reloads_every_process(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("old-key-123 alpha\n")
    log = tmp_path / "stderr"
    async with workers() as (ctx_url, gen_url):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port), "--context-urls", ctx_url,
             "--generation-urls", gen_url, "--health-check-interval-s", "0.1", "--api-keys-file", str(keys),
             "--workers", "2"],
            stderr=log.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            assert await eventually_long(lambda: log.read_text().count("listening on") == 2, timeout=60)
            keys.write_text("new-key-456 beta\n")
            proc.send_signal(signal.SIGHUP)
            assert await eventually_long(
                lambda: log.read_text().count("api_keys_file reloaded") == 2, timeout=30
            )
            for _ in range(8):  # a new connection each: whichever process takes it
                async with aiohttp.ClientSession() as session:
                    assert (await post(session, f"http://127.0.0.1:{port}", "old-key-123"))[0] == 401
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        assert proc.returncode == 0, log.read_text()[-2000:]


@pytest.mark.parametrize("keyed", [False, True], ids=["without-keys", "with-keys"])
async def test_priority_grants_through_the_orchestrator(tmp_path: Any, keyed: bool) -> None:
    """On real sockets, one slot held: without keys (client_priority off) a request claiming -2^63
    waits its turn; with keys (client_priority: true), a key of range priority=0..10 claiming it is
    read as 0, behind another key's -1 and the 0 that came first (both keys of one tenant)."""
    config: dict[str, Any] = {"admission": {"max_inflight": 1}}
    keys = {"honest": None, "greedy": None}
    if keyed:
        path = tmp_path / "keys"
        path.write_text("key-honest alpha\nkey-greedy alpha priority=0..10\n")
        config = {"api_keys_file": str(path), "admission": {"max_inflight": 1, "client_priority": True}}
        keys = {"honest": "key-honest", "greedy": "key-greedy"}
    async with orchestrator(**config) as (orch, url), aiohttp.ClientSession() as session:
        admission = orch.admission
        assert admission is not None
        holder = await Holder(url, keys["honest"]).hold(orch)
        done: list[str] = []

        async def one(name: str, key: str | None, priority: int) -> None:
            status, _, _ = await post(session, url, key, {**BODY, "priority": priority})
            assert status == 200
            done.append(name)

        arrivals = [
            ("first", keys["honest"], 0),
            ("greedy", keys["greedy"], -(1 << 63)),
            ("urgent", keys["honest"], -1),
        ]
        tasks = []
        for i, (name, key, priority) in enumerate(arrivals):
            tasks.append(asyncio.create_task(one(name, key, priority)))
            assert await eventually_long(lambda n=i + 1: admission.queued == n)
        await holder.release()
        await asyncio.gather(*tasks)
    # without keys: no priority counts, arrival order; with keys: the unbounded key's -1 first, the
    # greedy key's -2^63 read as 0, after the first 0 that came before it
    assert done == (["urgent", "first", "greedy"] if keyed else ["first", "greedy", "urgent"])
