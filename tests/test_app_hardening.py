"""Hardening, second round (issue 19, app level): what one client can learn of, or do to, another.

- a lone UTF-16 surrogate in any string of a request is a 400 naming the field, on every worker
  role and through every relay mode of the orchestrator (it was a tokenizer's 500, a 502);
- ``cache_salt`` (vLLM's, trtllm-serve's): requests with different salts share no prefix-cache
  block, on the torch engine and the synthetic one's modelled cache, and the orchestrator passes it
  to both legs (a guess at another tenant's prompt was 3 chunks of hits, TTFT 2.8 vs 20 ms);
- ``GET /metrics`` (hit counters, worker URLs, KV fetch failure reasons) is served with a metrics
  token only to ``Authorization: Bearer <token>``, loopback included, and without one only to
  loopback peers (it was served to anyone);
- a signed leg names its destination (the worker's instance id): replayed to another worker (whose
  nonce memory never saw it) it is a 403; the orchestrator signs each attempt for its worker and
  recovers from a worker restarted between health checks; without a secret a generation worker
  fetches KV from loopback only for a loopback caller;

Real workers (``tiny_workers``: the tiny torch model, the synthetic engine) and orchestrators
(``start_server``) in this test's event loop, on 127.0.0.1; raw HTTP from
``test_worker_hardening``'s helpers.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from helpers import Response, assert_openai_error, free_port, get, instance_of, post
from tiny_workers import LiveWorker, one_torch_thread, synthetic_worker, tiny_worker  # noqa: F401 (autouse)

from server.auth import SIGNATURE_HEADER, sign_body
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.worker.app import WorkerApp, WorkerSettings, start_worker
from server.worker.kv_handoff import KVSources
from server.worker.synthetic import SyntheticEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny_pair() -> AsyncIterator[tuple[LiveWorker, LiveWorker]]:
    ctx, gen = await tiny_worker("context"), await tiny_worker("generation")
    yield ctx, gen
    await ctx.server.cleanup()
    await gen.server.cleanup()


async def orchestrator(ctx: LiveWorker, gen: LiveWorker, **overrides: Any) -> tuple[Any, Any, int]:
    """An orchestrator over ``ctx`` and ``gen``, healthy; (server, orchestrator, port)."""
    data: dict[str, Any] = {
        "port": free_port(),
        "health_check_interval_s": 0.2,
        "context_servers": {"urls": [ctx.url.removeprefix("http://")]},
        "generation_servers": {"urls": [gen.url.removeprefix("http://")]},
        **overrides,
    }
    config = build_config(data, environ={})
    server, orch = await start_server(config)
    for _ in range(200):
        if (await get(config.port, "/health")).status == 200:
            break
        await asyncio.sleep(0.05)
    else:
        await server.cleanup()
        raise TimeoutError("orchestrator not healthy")
    return server, orch, config.port


# ---------------------------------------------------------------- item 6: lone surrogates

LONE = [
    # (route, raw body with the model name as %s, the field named)
    (CHAT, b'{"model":"%s","messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}',
     "messages[0].content"),
    (CHAT, b'{"model":"%s","messages":[{"role":"system","content":"s"},{"role":"user","content":'
           b'[{"type":"text","text":"x\\uDFFF"}]}],"max_tokens":2}', "messages[1].content[0].text"),
    (COMPLETIONS, b'{"model":"%s","prompt":"a\\udc00b","max_tokens":2}', "prompt"),
    (COMPLETIONS, b'{"model":"%s","prompt":"ok","stop":["\\ud83d"],"max_tokens":2}', "stop[0]"),
]  # fmt: skip


def assert_names_the_surrogate(resp: Response, field: str) -> None:
    error = assert_openai_error(resp, 400)
    assert error["code"] == "invalid_unicode", error
    assert f"'{field}'" in error["message"] and "lone surrogate" in error["message"], error
    assert error["param"] == field  # the same path as the message's, not its top-level field


@pytest.mark.parametrize("role", ["both", "context", "generation"])
async def test_a_lone_surrogate_is_a_400_naming_the_field_on_every_worker_role(role: str) -> None:
    for make, model in ((tiny_worker, b"tiny"), (synthetic_worker, b"synthetic")):
        worker = await make(role)
        try:
            for route, body, field in LONE:
                assert_names_the_surrogate(await post(worker.port, route, body % model), field)
            # A pair (an escaped emoji) and an escaped backslash before "ud800" are text.
            ok = b'{"model":"%s","prompt":"\\ud83d\\ude00 \\\\ud800","max_tokens":2}' % model
            resp = await post(worker.port, COMPLETIONS, ok)
            assert resp.status == 200, resp.body[:300]
        finally:
            await worker.server.cleanup()


@pytest.mark.parametrize("relay", ["fast", "parsed", "parsed-msgpack"])
async def test_a_lone_surrogate_through_the_orchestrator_is_a_400_in_every_relay_mode(
    tiny_pair: tuple[LiveWorker, LiveWorker], relay: str
) -> None:
    server, _, port = await orchestrator(*tiny_pair, relay=relay)
    try:
        for route, body, field in LONE:
            assert_names_the_surrogate(await post(port, route, body % b"tiny"), field)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "\U0001f600 hi"}], "max_tokens": 2}
        resp = await post(port, CHAT, json.dumps(chat).encode())  # ensure_ascii: a surrogate pair
        assert resp.status == 200, resp.body[:300]
    finally:
        await server.cleanup()


# ---------------------------------------------------------------- item 5: cache_salt

#: long enough for several full 16-id blocks of the tiny model's byte tokenizer
SECRET_PROMPT = "The victim's confidential system prompt, which another tenant would love to confirm. " * 2


def completion(prompt: str, salt: Any = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    return json.dumps(body).encode()


async def hits_of(
    worker: LiveWorker, body: bytes, path: str = COMPLETIONS, port: int | None = None
) -> tuple[int, str]:
    """(prefix-cache hit tokens on ``worker`` this request caused, its text), sent to ``port``
    (default: the worker itself)."""
    before = worker.engine.prefix_hit_tokens
    resp = await post(port or worker.port, path, body)
    assert resp.status == 200, resp.body[:300]
    choice = resp.json()["choices"][0]
    return worker.engine.prefix_hit_tokens - before, choice.get("text") or choice["message"]["content"]


async def test_requests_with_different_cache_salts_share_no_cached_prefix() -> None:
    worker = await tiny_worker("both")
    try:
        hits, text = await hits_of(worker, completion(SECRET_PROMPT, "tenant-a"))
        assert hits == 0
        # The oracle: the same prompt from another tenant (or none) finds nothing cached.
        for salt in ("tenant-b", None, "tenant-a "):
            assert await hits_of(worker, completion(SECRET_PROMPT, salt)) == (0, text), salt
        # The same tenant reuses its own prefix: the salt isolates, it does not disable.
        hits, again = await hits_of(worker, completion(SECRET_PROMPT, "tenant-a"))
        assert hits >= 64 and again == text
        # Unsalted requests share among themselves, as before.
        assert (await hits_of(worker, completion(SECRET_PROMPT)))[0] >= 64
        # The answer's own usage, an oracle as plain as /metrics, says nothing across salts.
        for salt, cached in (("tenant-z", 0), ("tenant-a", 64)):
            usage = (await post(worker.port, COMPLETIONS, completion(SECRET_PROMPT, salt))).json()["usage"]
            assert (usage["prompt_tokens_details"]["cached_tokens"] >= 64) == bool(cached), (salt, usage)
    finally:
        await worker.server.cleanup()


async def test_the_synthetic_workers_modelled_cache_is_salted_too() -> None:
    engine = SyntheticEngine(0)  # prompt_tokens 0: ids from the text, the prefix cache modelled
    server, port = await start_worker(engine, WorkerSettings(model_name="synthetic"))
    worker = LiveWorker(server, port, engine)
    try:
        first = {"model": "synthetic", "prompt": SECRET_PROMPT * 4, "max_tokens": 2, "cache_salt": "a"}
        await hits_of(worker, json.dumps(first).encode())
        assert (await hits_of(worker, json.dumps({**first, "cache_salt": "b"}).encode()))[0] == 0
        assert (await hits_of(worker, json.dumps({**first, "cache_salt": None}).encode()))[0] == 0
        assert (await hits_of(worker, json.dumps(first).encode()))[0] > 0
    finally:
        await server.cleanup()


@pytest.mark.parametrize("relay", ["fast", "parsed", "parsed-msgpack"])
async def test_the_orchestrator_passes_cache_salt_to_both_legs(relay: str) -> None:
    ctx, gen = await tiny_worker("context"), await tiny_worker("generation")
    server, _, port = await orchestrator(ctx, gen, relay=relay, gen_tokids_ctxbytes=relay == "fast",
                                         gen_strip_message_history=relay == "fast")  # fmt: skip
    try:
        messages = [{"role": "system", "content": SECRET_PROMPT}, {"role": "user", "content": "hi"}]
        chat = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
        salted = json.dumps({**chat, "cache_salt": "tenant-a"}).encode()
        hits, text = await hits_of(ctx, salted, CHAT, port)
        assert hits == 0
        # Another tenant's guess: no hit on the context worker, the same answer.
        guess = json.dumps({**chat, "cache_salt": "tenant-b"}).encode()
        assert await hits_of(ctx, guess, CHAT, port) == (0, text)
        assert (await hits_of(ctx, json.dumps(chat).encode(), CHAT, port))[0] == 0
        assert (await hits_of(ctx, salted, CHAT, port))[0] >= 64
        # The generation leg carried the salt: the KV it imported is cached under tenant-a's root.
        assert (await hits_of(gen, salted, CHAT))[0] >= 64
        assert (await hits_of(gen, json.dumps({**chat, "cache_salt": "tenant-c"}).encode(), CHAT))[0] == 0
    finally:
        await server.cleanup()
        await ctx.server.cleanup()
        await gen.server.cleanup()


@pytest.mark.parametrize("salt", [5, "", "   ", [], True, {"a": 1}])
async def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(
    tiny_pair: tuple[LiveWorker, LiveWorker], salt: Any
) -> None:
    ctx, _ = tiny_pair
    for relay in ("fast", "parsed"):
        server, _, port = await orchestrator(*tiny_pair, relay=relay)
        try:
            for target in (ctx.port, port):
                error = assert_openai_error(await post(target, COMPLETIONS, completion("hi", salt)), 400)
                assert error["param"] == "cache_salt"
                assert "'cache_salt' must be a non-empty string" in error["message"]
        finally:
            await server.cleanup()


# ---------------------------------------------------------------- item 5: who reads /metrics

TOKEN = "metrics-token-0123456789"


def assert_metrics_refused(resp: Response) -> None:
    error = assert_openai_error(resp, 401)
    assert resp.headers["www-authenticate"] == 'Bearer realm="metrics"'
    assert error["code"] == "metrics_token_required" and "Authorization: Bearer" in error["message"]
    assert b"fastcore_" not in resp.body and b"127.0.0.1" not in resp.body


async def test_a_workers_metrics_need_the_token_when_one_is_set() -> None:
    worker = await tiny_worker("both", metrics_token=TOKEN.encode())
    try:
        assert (await post(worker.port, COMPLETIONS, completion(SECRET_PROMPT))).status == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):  # fmt: skip
            assert_metrics_refused(await get(worker.port, "/metrics", **headers))
        for scheme in ("Bearer", "bearer"):
            page = await get(worker.port, "/metrics", Authorization=f"{scheme} {TOKEN}")
            assert page.status == 200 and b"fastcore_worker_prefix_cache_hit_tokens_total" in page.body
        # Only /metrics: health and completions need no token.
        assert (await get(worker.port, "/health")).status == 200
    finally:
        await worker.server.cleanup()


async def test_the_orchestrators_metrics_need_the_token_and_name_workers_only_then(
    tiny_pair: tuple[LiveWorker, LiveWorker],
) -> None:
    server, _, port = await orchestrator(*tiny_pair, metrics_token=TOKEN)
    try:
        assert (await post(port, COMPLETIONS, completion("hello"))).status == 200
        assert_metrics_refused(await get(port, "/metrics"))
        assert_metrics_refused(await get(port, "/metrics", Authorization="Bearer nope"))
        page = await get(port, "/metrics", Authorization=f"Bearer {TOKEN}")
        assert page.status == 200 and tiny_pair[0].url.encode() in page.body
    finally:
        await server.cleanup()


async def test_without_a_token_metrics_stay_served_to_loopback_peers(
    tiny_pair: tuple[LiveWorker, LiveWorker],
) -> None:
    """What tests, ``up`` and a Prometheus on the same host read, as before."""
    server, _, port = await orchestrator(*tiny_pair)
    try:
        for target in (port, tiny_pair[0].port):
            page = await get(target, "/metrics")
            assert page.status == 200 and b"fastcore_" in page.body
    finally:
        await server.cleanup()


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        (("127.0.0.1", 5), True),
        (("127.8.9.10", 5), True),
        (("::1", 5, 0, 0), True),
        (("::ffff:127.0.0.1", 5, 0, 0), True),
        (("10.0.0.7", 5), False),
        (("192.168.1.2", 5), False),
        (("::ffff:10.0.0.7", 5, 0, 0), False),
        (("2001:db8::1", 5, 0, 0), False),
        (("fe80::1%eth0", 5, 0, 2), False),
        (None, False),
        (("not an address", 5), False),
    ],
)
async def test_without_a_token_only_loopback_peers_may_read_metrics(peer: Any, loopback: bool) -> None:
    """The peer check itself, address by address (a live non-loopback client: the network
    namespace test below): any other address is a 403 that says how to allow it; with a token the
    address does not matter."""
    from server.metrics_access import MetricsAccess

    refused = MetricsAccess(None).refusal(None, peer)
    if loopback:
        assert refused is None
    else:
        assert refused is not None and refused.status == 403 and "metrics_token_file" in refused.message
    with_token = MetricsAccess(TOKEN.encode())
    assert with_token.refusal(f"Bearer {TOKEN}".encode(), peer) is None
    assert with_token.refusal(None, peer).status == 401  # type: ignore[union-attr]


async def test_the_token_comes_from_the_file_then_the_config_then_the_environment(tmp_path: Any) -> None:
    base = {"context_servers": {"urls": ["127.0.0.1:1"]}, "generation_servers": {"urls": ["127.0.0.1:2"]}}
    env = {"FASTCORE_METRICS_TOKEN": "from-env"}
    assert build_config(base, environ=env).metrics_token == "from-env"
    assert build_config(base, environ={}).metrics_token is None
    assert build_config({**base, "metrics_token": "inline"}, environ=env).metrics_token == "inline"
    path = tmp_path / "token"
    path.write_text("from-file\n")
    config = build_config({**base, "metrics_token_file": str(path)}, environ=env)
    assert config.metrics_token == "from-file" and "from-file" not in repr(config)
    path.write_text("")
    with pytest.raises(ValueError, match=r"metrics_token_file: metrics token file .* is empty"):
        build_config({**base, "metrics_token_file": str(path)}, environ=env)


async def test_up_reads_the_discovered_workers_with_the_token() -> None:
    """``fastcore-serve up`` waits on the orchestrator's /metrics (its cluster series): it sends the
    token its children inherit."""
    from server.launcher import discovered

    port = free_port()
    config = build_config(
        {"port": port, "metrics_token": TOKEN, "disagg_cluster": {"cluster_uri": f"http://127.0.0.1:{port}"}},
        environ={},
    )
    server, _ = await start_server(config)
    try:
        url = f"http://127.0.0.1:{port}"
        loop = asyncio.get_running_loop()  # urllib blocks: off the loop that serves the orchestrator
        assert await loop.run_in_executor(None, discovered, url, {}) == {}
        with_token = await loop.run_in_executor(None, discovered, url, {"FASTCORE_METRICS_TOKEN": TOKEN})
        assert with_token == {"context": 0.0, "generation": 0.0}
    finally:
        await server.cleanup()


# ---------------------------------------------------------------- item 9: where a signature goes

SECRET = b"app-hardening-secret"


def context_leg(prompt: str) -> bytes:
    disagg = {"request_type": "context_only", "disagg_request_id": 7}
    return json.dumps({"model": "synthetic", "prompt": prompt, "max_tokens": 2,
                       "disaggregated_params": disagg}).encode()  # fmt: skip


async def test_a_signed_leg_replayed_to_another_worker_is_refused() -> None:
    a = await synthetic_worker("context", shared_secret=SECRET)
    b = await synthetic_worker("context", shared_secret=SECRET)
    try:
        body = context_leg("for a only")
        for_a = sign_body(SECRET, body, destination=await instance_of(a.port))
        # b never saw the nonce: only the destination stops it (it was a 200 before).
        error = assert_openai_error(await post(b.port, COMPLETIONS, body, **{SIGNATURE_HEADER: for_a}), 403)
        assert error["code"] == "wrong_destination" and "signed for another worker" in error["message"]
        assert b.engine.parked_count == 0
        assert (await post(a.port, COMPLETIONS, body, **{SIGNATURE_HEADER: for_a})).status == 200
        # A leg bound to no worker is refused everywhere.
        unbound = sign_body(SECRET, body)
        for worker in (a, b):
            resp = await post(worker.port, COMPLETIONS, body, **{SIGNATURE_HEADER: unbound})
            assert assert_openai_error(resp, 403)["code"] == "wrong_destination"
    finally:
        await a.server.cleanup()
        await b.server.cleanup()


async def test_the_orchestrator_signs_each_leg_for_its_worker_and_survives_a_restart() -> None:
    ctx = await synthetic_worker("context", shared_secret=SECRET)
    gen = await synthetic_worker("generation", shared_secret=SECRET)
    server, orch, port = await orchestrator(ctx, gen, shared_secret=SECRET.decode())
    body = json.dumps({"model": "synthetic", "prompt": "hello there", "max_tokens": 3}).encode()
    try:
        assert (await post(port, COMPLETIONS, body)).status == 200
        # A worker restarted between two health checks: the orchestrator still signs for the old
        # instance. The context worker refuses; the request is prefilled on the generation worker.
        ctx_worker, gen_worker = orch.context_pool.workers[0], orch.generation_pool.workers[0]
        ctx_worker.instance = "0" * 32
        resp = await post(port, COMPLETIONS, body)
        assert resp.status == 200, resp.body[:300]
        assert not ctx_worker.healthy  # out until /health gives its new id
        # The generation worker: no other to take it, a 503 to retry (never the internal 403).
        gen_worker.instance = "0" * 32
        error = assert_openai_error(await post(port, COMPLETIONS, body), 503)
        assert error["code"] == "no_healthy_worker"
        for _ in range(200):
            if ctx_worker.healthy and gen_worker.healthy:
                break
            await asyncio.sleep(0.05)
        assert ctx_worker.instance == await instance_of(ctx.port)
        assert gen_worker.instance == await instance_of(gen.port)
        assert (await post(port, COMPLETIONS, body)).status == 200
    finally:
        await server.cleanup()
        await ctx.server.cleanup()
        await gen.server.cleanup()


async def test_without_a_secret_loopback_kv_sources_serve_loopback_callers_only() -> None:
    """A remote client's unsigned generation leg naming 127.0.0.1:<port> made the worker connect
    there: a probe of its host's local ports. The rule, case by case (a live remote caller: the
    network namespace test below)."""
    endpoint = "http://127.0.0.1:22/kv/1"
    default = KVSources((), any_host=False)
    assert default.allows(endpoint) and default.allows(endpoint, caller_local=True)
    assert not default.allows(endpoint, caller_local=False)
    assert not default.allows("http://localhost:22/kv/1", caller_local=False)
    # Sources named by the operator, or a secret (only signed callers name one): whoever calls.
    assert KVSources(("127.0.0.1:22",), any_host=False).allows(endpoint, caller_local=False)
    assert KVSources((), any_host=True).allows(endpoint, caller_local=False)


def _netns_usable() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _netns_usable(), reason="needs unshare -n and ip (root): a private network namespace")
async def test_a_non_loopback_client_reads_no_metrics_and_makes_no_loopback_kv_fetch() -> None:
    """A real non-loopback peer, in a network namespace of its own (tests/netns_peer.py): its
    GET /metrics is a 403 and its unsigned generation leg naming 127.0.0.1:<port> is not fetched
    (recomputed), while a loopback caller's is, as before."""
    script = Path(__file__).resolve().parent / "netns_peer.py"
    proc = await asyncio.create_subprocess_exec(
        "unshare", "-n", sys.executable, str(script), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    seen = json.loads(out.decode().strip().splitlines()[-1])
    assert seen["metrics_loopback"] == 200
    assert seen["metrics_outside"]["status"] == 403
    assert json.loads(seen["metrics_outside"]["body"])["error"]["code"] == "metrics_forbidden"
    assert "fastcore_worker" not in seen["metrics_outside"]["body"]
    local, outside = seen["127.0.0.1"], seen["192.0.2.1"]
    assert local["status"] == outside["status"] == 200  # the same answer either way
    assert local["endpoint"].startswith("http://127.0.0.1:") and outside["endpoint"].startswith(
        "http://127.0.0.1:"
    )
    assert (local["fetched"], outside["fetched"]) == (1, 0)
    assert seen["not_allowed"] == 1


# ---------------------------------------------------------------- a 404 names what is served


@pytest.mark.parametrize("registry", [False, True])
async def test_a_404_lists_every_route_the_orchestrator_serves(registry: bool) -> None:
    """The text is made from the route tables themselves: trtllm-serve's endpoints (/version,
    /cluster_info, ...) and, where this orchestrator keeps the worker registry, its paths too."""
    from server.cluster.embedded import REGISTRY_PATH, TRTLLM_STORE_ROUTES
    from server.trtllm_endpoints import ORCHESTRATOR_ROUTES

    port = free_port()
    pools = {"context_servers": {"urls": ["127.0.0.1:1"]}, "generation_servers": {"urls": ["127.0.0.1:2"]}}
    cluster = {"disagg_cluster": {"cluster_uri": f"http://127.0.0.1:{port}"}}
    config = build_config({"port": port, **(cluster if registry else pools)}, environ={})
    server, _ = await start_server(config)
    try:
        error = assert_openai_error(await get(port, CHAT[:-1]), 404)
    finally:
        await server.cleanup()
    message = error["message"]
    assert message.startswith(f"no route {CHAT[:-1]}: the orchestrator serves POST {CHAT}, ")
    trtllm = [p.decode() for p in ORCHESTRATOR_ROUTES]
    for path in (CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics", *trtllm):
        assert f" {path}" in message, path
    for path in (REGISTRY_PATH, *TRTLLM_STORE_ROUTES):
        assert (f" {path.decode()}" in message) == registry, path


# ---------------------------------------------------------------- a draining worker, as a client sees it


@pytest.mark.parametrize("stream", [False, True])
async def test_a_draining_workers_refusal_reaches_the_client_in_words_for_a_client(
    stream: bool, request_path: str
) -> None:
    """A worker that drains answers the orchestrator "draining (shutting down): send it elsewhere";
    with no other worker to send it to, the client is told that no worker can take it now (503 with
    Retry-After), not what the worker told the orchestrator."""
    apps = {role: WorkerApp(SyntheticEngine(64), WorkerSettings(role=role, model_name="synthetic"))
            for role in ("context", "generation")}  # fmt: skip
    servers = {role: await app.start("127.0.0.1", 0) for role, app in apps.items()}
    port = free_port()
    config = build_config({"port": port, "health_check_interval_s": 60,
                           **{f"{role}_servers": {"urls": [f"127.0.0.1:{servers[role][1]}"]} for role in apps}},
                          environ={})  # fmt: skip
    orch_server, _ = await start_server(config)
    try:
        for _ in range(200):
            if (await get(port, "/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        apps["generation"].draining = True  # the orchestrator's health check has not seen it yet
        body = {"model": "synthetic", "prompt": "hello", "max_tokens": 2, "stream": stream}
        resp = await post(port, COMPLETIONS, json.dumps(body).encode())
        error = assert_openai_error(resp, 503)
        assert error == {"message": "no healthy generation worker", "type": "service_unavailable",
                         "param": None, "code": "no_healthy_worker"}, error  # fmt: skip
        assert resp.headers["retry-after"] == str(config.retry_after_s)
    finally:
        await orch_server.cleanup()
        for server, _ in servers.values():
            await server.cleanup()
