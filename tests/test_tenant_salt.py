"""Tenants share no prefix cache (issue 36 item 4): with API keys, each request's ``cache_salt`` is its
tenant's (server/orchestrator/tenant_salt.py), so tenant B replaying tenant A's prompt, or sending
A's ``cache_salt`` with it, finds nothing of A's cached (it found 1,104 of 1,116 tokens);
``share_prefix_cache_across_tenants: true`` keeps one cache for all.

Real tiny-model workers (they count their prefix hits and report ``cached_tokens``) and
orchestrators on 127.0.0.1, on every relay mode, both fast-relay twins and both request paths.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import pytest
import pytest_asyncio
from helpers import REQUIRE_EXTENSIONS, assert_openai_error, free_port, get, post
from tiny_workers import LiveWorker, one_torch_thread, tiny_worker  # noqa: F401 (autouse)
from trtllm_standin import start_standin

import fastcore
from fastcore.relay import Relay
from server.cache_keys import prompt_keys, salt_key
from server.orchestrator import relay_modes
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import build_config
from server.orchestrator.relay_fast import FastRelay
from server.orchestrator.routing import KvCacheAwareRouter, request_key
from server.orchestrator.tenant_salt import salted_body, tenant_salt
from server.orchestrator.tenants import Tenant
from server.routes import CHAT as CHAT_ROUTE
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SyntheticEngine


def live(test: Any) -> Any:
    """A test against live servers, on both of the orchestrator's request paths."""
    return pytest.mark.usefixtures("request_path")(pytest.mark.asyncio(loop_scope="module")(test))


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
A = {"Authorization": "Bearer key-of-a"}
B = {"Authorization": "Bearer key-of-b"}
#: each test's prompts are its own (the workers outlive a test): a number in the first block
_PROMPTS = itertools.count()
#: a tiny-model block is 16 byte-tokens: a prompt this long fills several
_TEXT = "The victim's confidential system prompt, which another tenant would love to confirm. " * 2


def fresh_prompt() -> str:
    return f"{next(_PROMPTS):06d} {_TEXT}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair() -> AsyncIterator[tuple[LiveWorker, LiveWorker]]:
    ctx, gen = await tiny_worker("context"), await tiny_worker("generation")
    yield ctx, gen
    await ctx.server.cleanup()
    await gen.server.cleanup()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("key-of-a tenant-a\nkey-of-b tenant-b\n")
    return str(path)


@pytest.fixture(params=["fast-py", "fast-c", "parsed", "parsed-msgpack"])
def relay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The relay mode; ``fast`` on one twin's kernels (the class the config's name picks)."""
    mode = str(request.param)
    if mode.startswith("fast-"):
        twin = relay_kernels(mode.removeprefix("fast-"))
        cls = type(f"FastRelay_{twin.__name__}", (FastRelay,), {"relay": Relay(twin)})
        monkeypatch.setitem(relay_modes.MODES, "fast", cls)
        return "fast"
    return mode


def relay_kernels(which: str) -> ModuleType:
    """The relay kernels' pure twin (``py``) or compiled one (``c``), as conftest's ``relay_twin``."""
    if which == "py":
        return importlib.import_module("fastcore._relay_py")
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    try:
        return importlib.import_module("fastcore._relay")
    except ImportError as exc:
        if REQUIRE_EXTENSIONS:
            pytest.fail(f"compiled twin fastcore._relay required but not importable: {exc}")
        pytest.skip(f"fastcore._relay not built: {exc}")


async def orchestrator(ctx_url: str, gen: Any, **overrides: Any) -> tuple[Any, Orchestrator, int]:
    data: dict[str, Any] = {
        "port": free_port(),
        "health_check_interval_s": 0.2,
        "context_servers": {"urls": [ctx_url.removeprefix("http://")]},
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


def chat(prompt: str, **extra: Any) -> bytes:
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}]
    return json.dumps(
        {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, **extra}
    ).encode()


def completion(prompt: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
    ).encode()


async def cached(
    port: int, body: bytes, who: dict[str, str], path: str = CHAT, worker: LiveWorker | None = None
) -> int:
    """The ``cached_tokens`` the client is told (checked against ``worker``'s own count of hits)."""
    before = worker.engine.prefix_hit_tokens if worker is not None else 0
    resp = await post(port, path, body, **who)
    assert resp.status == 200, resp.body[:300]
    tokens = int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    if worker is not None:
        assert worker.engine.prefix_hit_tokens - before == tokens
    return tokens


# ---------------------------------------------------------------- the oracle, closed


@live
async def test_another_tenant_replaying_a_prompt_finds_none_of_it_cached(
    pair: tuple[LiveWorker, LiveWorker], keys_file: str, relay: str
) -> None:
    ctx, gen = pair
    server, _, port = await orchestrator(ctx.url, gen, relay=relay, api_keys_file=keys_file,
                                         gen_tokids_ctxbytes=relay == "fast")  # fmt: skip
    try:
        for make, path in ((chat, CHAT), (completion, COMPLETIONS)):
            body = make(fresh_prompt())
            assert await cached(port, body, A, path, ctx) == 0
            assert await cached(port, body, A, path, ctx) >= 64  # a tenant reuses its own prefix
            assert await cached(port, body, B, path, ctx) == 0  # the oracle: nothing of A's
            assert await cached(port, body, B, path, ctx) >= 64  # what B itself warmed
            # A's own cache_salt does not take B into A's blocks either.
            prompt = fresh_prompt()
            salted = make(prompt, cache_salt="a-secret-salt")
            assert await cached(port, salted, A, path, ctx) == 0
            assert await cached(port, salted, A, path, ctx) >= 64
            assert await cached(port, salted, B, path, ctx) == 0
            # Within a tenant a salt still splits: A without it finds nothing.
            assert await cached(port, make(prompt), A, path, ctx) == 0
    finally:
        await server.cleanup()


@live
async def test_the_generation_leg_carries_the_tenants_salt(
    pair: tuple[LiveWorker, LiveWorker], keys_file: str, relay: str
) -> None:
    """The generation worker caches the KV it imported under the tenant's salt: the salt a client
    sending the derived one straight to that worker hits, and no other."""
    ctx, gen = pair
    server, _, port = await orchestrator(ctx.url, gen, relay=relay, api_keys_file=keys_file)
    try:
        prompt = fresh_prompt()
        await cached(port, chat(prompt, cache_salt="s"), A)
        direct = await post(gen.port, CHAT, chat(prompt, cache_salt=tenant_salt("tenant-a", "s")))
        assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        for salt in ("s", tenant_salt("tenant-b", "s"), tenant_salt("tenant-a", None)):
            other = await post(gen.port, CHAT, chat(prompt, cache_salt=salt))
            assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, salt
    finally:
        await server.cleanup()


@live
async def test_the_local_prefill_path_is_salted_too(
    pair: tuple[LiveWorker, LiveWorker], keys_file: str, relay: str
) -> None:
    """No context worker: the generation worker serves the client's body whole (context_fallback)."""
    _, gen = pair
    dead = f"http://127.0.0.1:{free_port()}"
    server, _, port = await orchestrator(dead, gen, relay=relay, api_keys_file=keys_file,
                                         context_fallback="local_prefill")  # fmt: skip
    try:
        body = completion(fresh_prompt())
        assert await cached(port, body, A, COMPLETIONS, gen) == 0
        assert await cached(port, body, A, COMPLETIONS, gen) >= 64
        assert await cached(port, body, B, COMPLETIONS, gen) == 0
    finally:
        await server.cleanup()


@live
async def test_requests_that_wait_for_admission_are_salted_too(
    pair: tuple[LiveWorker, LiveWorker], keys_file: str
) -> None:
    """The admission queue's path (a coroutine from the start) knows the tenant as well."""
    ctx, gen = pair
    server, orch, port = await orchestrator(
        ctx.url, gen, api_keys_file=keys_file, admission={"max_inflight": 1}
    )
    try:
        assert orch.admission is not None and not orch.callbacks
        body = chat(fresh_prompt())
        assert await cached(port, body, A, CHAT, ctx) == 0
        assert await cached(port, body, A, CHAT, ctx) >= 64
        assert await cached(port, body, B, CHAT, ctx) == 0
    finally:
        await server.cleanup()


@live
async def test_the_opt_out_shares_one_cache_and_relays_the_clients_salt(
    pair: tuple[LiveWorker, LiveWorker], keys_file: str, relay: str
) -> None:
    ctx, gen = pair
    server, orch, port = await orchestrator(ctx.url, gen, relay=relay, api_keys_file=keys_file,
                                            share_prefix_cache_across_tenants=True)  # fmt: skip
    try:
        assert not orch.tenant_salts
        body = chat(fresh_prompt())
        assert await cached(port, body, A, CHAT, ctx) == 0
        assert await cached(port, body, B, CHAT, ctx) >= 64
        salted = chat(fresh_prompt(), cache_salt="shared")
        await cached(port, salted, A)
        direct = await post(ctx.port, CHAT, salted)  # the client's salt, as sent
        assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    finally:
        await server.cleanup()


@live
async def test_without_keys_the_clients_salt_goes_as_sent(
    pair: tuple[LiveWorker, LiveWorker], relay: str
) -> None:
    ctx, gen = pair
    server, orch, port = await orchestrator(ctx.url, gen, relay=relay)
    try:
        assert not orch.tenant_salts
        salted = chat(fresh_prompt(), cache_salt="one-tenant")
        await cached(port, salted, {})
        assert await cached(ctx.port, salted, {}) >= 64
    finally:
        await server.cleanup()


@live
async def test_trtllm_serve_workers_get_the_salt_on_chat_and_none_on_completions(
    keys_file: str, relay: str
) -> None:
    """trtllm-serve's ChatCompletionRequest has ``cache_salt``; its CompletionRequest has none and
    refuses fields it does not model (tests/trtllm_standin.py): a completion goes without one."""
    registry: dict[int, list[int]] = {}
    ctx = await start_standin("context", kv_registry=registry)
    gen = await start_standin("generation", kv_registry=registry)
    server, orch, port = await orchestrator(
        ctx.url, gen, relay=relay, api_keys_file=keys_file, shared_secret=None
    )
    try:
        assert not orch.context_pool.salts_completions and not orch.generation_pool.salts_completions
        body = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert (await post(port, CHAT, body, **A)).status == 200
        legs = ctx.received(CHAT) + gen.received(CHAT)
        assert [leg.body["cache_salt"] for leg in legs] == [tenant_salt("tenant-a", None)] * 2
        resp = await post(port, COMPLETIONS, {"model": ctx.model, "prompt": "hi", "max_tokens": 3}, **A)
        assert resp.status == 200, resp.body[:300]
        assert [leg.status for leg in ctx.received(COMPLETIONS) + gen.received(COMPLETIONS)] == [200, 200]
        assert not any(
            "cache_salt" in leg.body for leg in ctx.received(COMPLETIONS) + gen.received(COMPLETIONS)
        )
        # A client's own salt on completions: trtllm-serve's 400, as it answers the client straight,
        # and never the client's value (the tenant's is what a worker of a mixed pool would cache).
        resp = await post(port, COMPLETIONS, {"model": ctx.model, "prompt": "hi", "cache_salt": "s"}, **A)
        assert resp.status == 400
        assert ctx.received(COMPLETIONS)[-1].raw.count(tenant_salt("tenant-a", "s").encode()) == 1
    finally:
        await server.cleanup()
        await ctx.stop()
        await gen.stop()


# ---------------------------------------------------------------- a client's salt refused


@pytest.mark.parametrize("salt", [5, "", "   ", [], True, {"a": 1}])
@live
async def test_a_bad_cache_salt_is_still_the_400_naming_it(
    pair: tuple[LiveWorker, LiveWorker], keys_file: str, relay: str, salt: Any
) -> None:
    ctx, gen = pair
    server, _, port = await orchestrator(ctx.url, gen, relay=relay, api_keys_file=keys_file)
    try:
        for body, path in (
            (completion("hi", cache_salt=salt), COMPLETIONS),
            (chat("hi", cache_salt=salt), CHAT),
        ):
            error = assert_openai_error(await post(port, path, body, **A), 400)
            assert error["param"] == "cache_salt"
            assert "'cache_salt' must be a non-empty string" in error["message"]
        # Two of them: which a worker would read is a guess, so neither is.
        twice = completion("hi", cache_salt="x")[:-1] + b',"cache_salt":"y"}'
        error = assert_openai_error(await post(port, COMPLETIONS, twice, **A), 400)
        assert error["param"] == "cache_salt", error
    finally:
        await server.cleanup()


# ---------------------------------------------------------------- the body and the routing key


def test_tenant_salts_are_the_tenants_and_never_meet() -> None:
    """A tenant name holds no NUL (tenants.py), so no two (tenant, salt) pairs hash the same input."""
    salts = {tenant_salt(t, s) for t in ("a", "b", "ab") for s in (None, "b", "x", "\0")}
    assert len(salts) == 12
    assert all(s.startswith("t:") and len(s) == 34 for s in salts)
    assert tenant_salt("tenant-a", None) == tenant_salt("tenant-a", None)  # every process agrees


@pytest.mark.parametrize(
    "body",
    [b'{"prompt":"p"}', b' { "prompt" : "p" , "cache_salt" : "c" } ', b'{"cache_salt":null,"prompt":"p"}',
     b'{"prompt":"p","cache_salt":"\\u00e9"}', '{"prompt":"p","cache_salt":"é"}'.encode(), b'{\n}'],
)  # fmt: skip
def test_salted_body_sets_one_top_level_cache_salt(body: bytes) -> None:
    salted = json.loads(salted_body(body, "tenant-a"))
    client = json.loads(body).get("cache_salt")
    assert salted == {**json.loads(body), "cache_salt": tenant_salt("tenant-a", client)}
    assert salted_body(b'{"prompt":"p"}', "tenant-a", add=False) == b'{"prompt":"p"}'


def test_the_routing_key_reads_the_tenants_salt(keys_file: str) -> None:
    """kv_cache_aware routing keys a prompt as the worker caches it: under the tenant's salt (else it
    would predict hits that cannot happen, and miss the tenant's own)."""
    config = build_config({"api_keys_file": keys_file, "context_servers": {"urls": ["127.0.0.1:1"]},
                           "generation_servers": {"urls": ["127.0.0.1:2"],
                                                  "router": {"type": "kv_cache_aware"}}}, environ={})  # fmt: skip
    orch = Orchestrator(config)
    for pool in orch.pools:
        pool.workers[0].healthy = True
    body = chat(_TEXT * 4, cache_salt="c")
    keys = {}
    for tenant in ("tenant-a", "tenant-b"):
        req, key, _, _ = orch.prepare(body, CHAT_ROUTE, None, Tenant(tenant))
        assert key is not None and key.salt == salt_key(tenant_salt(tenant, "c")) != 0
        # the worker's published keys of the body it receives: the key space is one
        assert key.hashes(64) == prompt_keys(req.body, True, 64)[0]
        keys[tenant] = key.hashes(64)
    assert keys["tenant-a"] and not set(keys["tenant-a"]) & set(keys["tenant-b"])
    assert request_key(body, True, None).hashes(64)[0] not in keys["tenant-a"]  # not the client's salt


@pytest.mark.asyncio(loop_scope="module")
async def test_another_orchestrator_routes_by_the_workers_events_under_the_tenants_salt(
    keys_file: str,
) -> None:
    """A worker publishes its cache under the salt it was sent (the tenant's): an orchestrator that
    never saw tenant A's prompt expects A's next turn to hit there, from those events alone, and
    B's same turn to hit nowhere (it predicted a hit the salt then denied: a route, and a leak's
    timing, wasted)."""
    chunk = 64
    workers = []
    for role in ("context", "generation"):
        engine = SyntheticEngine(0, bytes_per_token=1, kv_tokens=4096)
        settings = WorkerSettings(model_name="synthetic", role=role, cache_events_chunk_bytes=chunk)
        workers.append((*(await start_worker(engine, settings)), engine))
    (_, ctx_port, ctx_engine), (_, gen_port, _) = workers
    fronts = []
    for _ in range(2):
        config = build_config({
            "port": free_port(), "health_check_interval_s": 0.1, "api_keys_file": keys_file,
            "context_servers": {"urls": [f"127.0.0.1:{ctx_port}"],
                                "router": {"type": "kv_cache_aware", "args": {"chunk_bytes": chunk}}},
            "generation_servers": {"urls": [f"127.0.0.1:{gen_port}"]},
        }, environ={})  # fmt: skip
        fronts.append((*(await start_server(config)), config.port))
    (_, _, port_a), (_, other, _) = fronts
    try:
        for _ in range(200):
            if all(o.context_pool.ready and o.generation_pool.ready for _, o, _ in fronts):
                break
            await asyncio.sleep(0.05)
        for _ in range(200):  # the other orchestrator follows the worker's events (its first: a resync)
            if other.cache_view is not None and other.cache_view.resyncs >= 1:
                break
            await asyncio.sleep(0.05)
        text = "the agent reads the file and writes the patch " * 30
        message = {"role": "user", "content": text}
        resp = await post(port_a, CHAT, {"model": "synthetic", "messages": [message], "max_tokens": 2}, **A)
        assert resp.status == 200, resp.body[:300]
        assert ctx_engine.cache.cached_tokens
        message["content"] = text + "and then the tests"
        following = json.dumps({"model": "synthetic", "messages": [message], "max_tokens": 2}).encode()
        router = other.context_pool.router
        assert isinstance(router, KvCacheAwareRouter)
        home = other.context_pool.workers[0]
        key_a = other.prepare(following, CHAT_ROUTE, None, Tenant("tenant-a"))[1]
        key_b = other.prepare(following, CHAT_ROUTE, None, Tenant("tenant-b"))[1]
        assert key_a is not None and key_b is not None
        for _ in range(200):
            if router.expected_hit(home, key_a) > 0:
                break
            await asyncio.sleep(0.05)
        assert router.expected_hit(home, key_a) >= len(key_a.hashes(chunk)) - 3
        assert router.expected_hit(home, key_b) == 0
        assert router.expected_hit(home, request_key(following, True, None)) == 0  # the client's own body
    finally:
        for server, _, _ in fronts:
            await server.cleanup()
        for server, _, _ in workers:
            await server.cleanup()


def test_a_pool_salts_completions_only_when_every_healthy_worker_takes_a_salt() -> None:
    """``/server_info``: a fastcore worker says ``prefix_caching`` (and takes ``cache_salt`` on both
    routes); trtllm-serve's says neither, and an unknown server's nothing at all."""
    from server.orchestrator.pools import Capabilities, Pool

    assert Capabilities.of({"prefix_caching": False, "role": "both"}).cache_salt_completions
    assert not Capabilities.of({"disaggregated_params": {}, "max_batch_size": 64}).cache_salt_completions
    assert not Capabilities.of(None).cache_salt_completions
    pool = Pool("generation", ["127.0.0.1:1", "127.0.0.1:2"], "round_robin", {})
    ours, theirs = pool.workers
    ours.set_capabilities(Capabilities.of({"prefix_caching": True}))
    theirs.set_capabilities(Capabilities.of({"disaggregated_params": {}}))
    ours.healthy = True
    assert pool.salts_completions  # the trtllm-serve worker takes no leg while it is down
    theirs.healthy = True
    assert not pool.salts_completions
    theirs.set_capabilities(Capabilities.of({"prefix_caching": True}))  # replaced by ours, same URL
    assert pool.salts_completions
