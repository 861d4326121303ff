"""Orchestrator config (YAML + flags), routers and the health checker, without workers."""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from helpers import free_port

from server.orchestrator import cli
from server.orchestrator.config import ConfigError, OrchestratorConfig, build_config, merge_overrides
from server.orchestrator.pools import UNHEALTHY_AFTER_TIMEOUTS, Capabilities, HealthChecker, Pool

PROTOCOL_YAML = """
hostname: 127.0.0.1
port: 8000
gen_tokids_ctxbytes: true        # base64 int32 relay; default false
gen_strip_message_history: true  # default false
max_retries: 1
request_timeout_s: 180
context_servers:
  router: {type: round_robin}    # round_robin | least_loaded
  urls: ["127.0.0.1:8001", "127.0.0.1:8002"]
generation_servers:
  router: {type: least_loaded}
  urls: ["127.0.0.1:8003"]
"""


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_protocol_yaml_loads_into_one_typed_object(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(PROTOCOL_YAML)
    config = cli.config_from_args(_args("-c", str(path)))
    assert isinstance(config, OrchestratorConfig)
    assert config.gen_tokids_ctxbytes and config.gen_strip_message_history
    assert config.context_servers.urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert config.context_servers.router.type == "round_robin"
    assert config.generation_servers.router.type == "least_loaded"
    assert config.request_timeout_s == 180.0
    assert config.relay == "fast"


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(PROTOCOL_YAML)
    args = _args(
        "-c", str(path), "--port", "9100", "--no-gen-tokids-ctxbytes", "--relay", "parsed",
        "--generation-urls", "10.0.0.1:1,10.0.0.2:2", "--context-router", "least_loaded",
    )  # fmt: skip
    config = cli.config_from_args(args)
    assert config.port == 9100
    assert config.gen_tokids_ctxbytes is False
    assert config.gen_strip_message_history is True  # untouched by flags
    assert config.relay == "parsed"
    assert config.generation_servers.urls == ["http://10.0.0.1:1", "http://10.0.0.2:2"]
    assert config.context_servers.router.type == "least_loaded"
    assert config.context_servers.urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_flags_alone_suffice():
    config = cli.config_from_args(_args("--context-urls", "127.0.0.1:1", "--generation-urls", "127.0.0.1:2"))
    assert config.gen_tokids_ctxbytes is False and config.gen_strip_message_history is False
    assert config.max_body_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"port": "eighty"}, "port"),
        ({"port": 70000}, "port"),
        ({"relay": "slow"}, "relay"),
        ({"max_retries": -1}, "max_retries"),
        ({"context_servers": {"router": {"type": "random"}}}, "context_servers.router.type"),
        ({"generation_servers": {"urls": [""]}}, "generation_servers.urls"),
    ],
)
def test_bad_config_names_the_key(data, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        build_config(data, environ={})


TRTLLM_YAML = """
hostname: localhost
port: 8000
backend: pytorch
free_gpu_memory_fraction: 0.25
context_servers:
  num_instances: 2
  tensor_parallel_size: 1
  router: {type: round_robin}
  urls: ["localhost:8001", "localhost:8002"]
generation_servers:
  num_instances: 1
  max_batch_size: 256
  router:
    type: load_balancing
    args: {use_tokens: false}
  urls: ["localhost:8003"]
"""


def test_trtllm_serve_yaml_loads_unchanged_and_unused_keys_are_warned_once(tmp_path, caplog):
    path = tmp_path / "disagg_config.yaml"
    path.write_text(TRTLLM_YAML)
    with caplog.at_level("WARNING", logger="fastcore.orchestrator"):
        config = cli.config_from_args(_args("-c", str(path)))
    assert config.hostname == "localhost" and config.port == 8000
    assert config.context_servers.num_instances == 2 and len(config.context_servers.urls) == 2
    assert config.generation_servers.router.type == "load_balancing"
    assert config.generation_servers.router.kind == "least_loaded"
    assert Pool("generation", config.generation_servers.urls, config.generation_servers.router.kind).router.name == (
        "least_loaded"
    )
    warnings = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert warnings == [
        "config keys not used by the fastcore orchestrator (ignored): backend, free_gpu_memory_fraction, "
        "context_servers.tensor_parallel_size, generation_servers.max_batch_size"
    ]


def test_router_arguments_beside_type_as_trtllm_serve_writes_them():
    """trtllm-serve's extract_router_config takes every key of ``router`` but ``type`` as an argument."""
    pools = {"context_servers": {"urls": ["h:1"]}}
    config = build_config(
        pools | {"generation_servers": {"urls": ["h:2"], "router": {"type": "load_balancing", "use_tokens": False}}},
        environ={},
    )
    config.check_runnable()
    assert config.generation_servers.router.args == {"use_tokens": False}
    assert config.generation_servers.router.kind == "least_loaded"
    config = build_config(
        pools | {"generation_servers": {"urls": ["h:2"], "router": {"type": "load_balancing", "use_tokens": True}}},
        environ={},
    )
    config.check_runnable()  # balancing by tokens in flight
    twice = {"type": "load_balancing", "use_tokens": False, "args": {"use_tokens": True}}
    with pytest.raises(ConfigError, match="router argument 'use_tokens' given twice"):
        build_config(pools | {"generation_servers": {"urls": ["h:2"], "router": twice}}, environ={})


def test_a_misspelt_key_is_warned_with_a_suggestion_and_refused_with_strict_config(tmp_path, caplog, capsys):
    """A key the orchestrator does not use is warned about (trtllm-serve's YAML has many), with the
    key it most resembles; --strict-config refuses it instead (exit 2)."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "contxt_servers: {urls: ['h:1']}\ncontext_servers: {urls: ['h:1'], num_instance: 1}\n"
        "generation_servers: {urls: ['h:2']}\nrequest_timeout: 5\nbackend: pytorch\n"
    )
    with caplog.at_level("WARNING", logger="fastcore.orchestrator"):
        cli.config_from_args(_args("-c", str(path)))
    (warning,) = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert warning == (
        "config keys not used by the fastcore orchestrator (ignored): contxt_servers (did you mean "
        "context_servers?), request_timeout (did you mean request_timeout_s?), backend, "
        "context_servers.num_instance (did you mean context_servers.num_instances?)"
    )
    assert cli.run(_args("-c", str(path), "--strict-config")) == 2
    assert capsys.readouterr().err == (
        "fastcore-serve orchestrator: --strict-config: keys not used by the fastcore orchestrator: "
        "contxt_servers (did you mean context_servers?), request_timeout (did you mean request_timeout_s?), "
        "backend, context_servers.num_instance (did you mean context_servers.num_instances?)\n"
    )


def test_num_instances_other_than_the_urls_is_one_warning(caplog):
    with caplog.at_level("WARNING", logger="fastcore.orchestrator"):
        config = build_config(
            {"context_servers": {"num_instances": 3, "urls": ["h:1"]}, "generation_servers": {"urls": ["h:2"]}},
            environ={},
        )
        config.check_runnable()  # the CLI's check, then each orchestrator process's: no second warning
        config.check_runnable()
    said = [r.getMessage() for r in caplog.records if "num_instances" in r.getMessage()]
    assert len(said) == 1 and "context_servers.num_instances is 3 but 1 urls" in said[0]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"context_servers": {"num_instances": 2}}, r"context_servers\.urls: .*num_instances: 2"),
        ({"disagg_cluster": {"cluster_uri": "http://127.0.0.1:8000"}, "workers": 2}, r"http:// registry is kept by one orchestrator process"),
        ({"conditional_disagg_config": {"max_local_prefill_length": 512}}, "conditional_disagg_config: .*needs generation_servers.router.type: kv_cache_aware.*'round_robin'"),
        ({"conditional_disagg_config": {"max_local_prefill_length": 512}, "context_servers": {"urls": ["h:1"], "router": {"type": "kv_cache_aware"}}}, "conditional_disagg_config: .*needs generation_servers"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "block_size": 3}}}, r"generation_servers\.router: block_size: not an argument of kv_cache_aware; it takes chunk_bytes, "),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "conversation", "args": {"use_tokens": False}}}}, r"router: use_tokens: not an argument of conversation; it takes chunk_bytes, load_factor, "),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "chunk_bytes": 100}}}, r"generation_servers\.router\.args\.chunk_bytes must be a multiple of 32, got 100"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "chunk_bytes": 16}}}, r"router\.args\.chunk_bytes must be an integer in \[32, "),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "max_cached_tokens": 0}}}, r"router\.args\.max_cached_tokens must be an integer >= 1, got 0"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "load_weight": -1}}}, r"router\.args\.load_weight must be a number >= 0"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "load_weight": True}}}, r"router\.args\.load_weight must be a number"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "max_load_ratio": 0.5}}}, r"router\.args\.max_load_ratio must be a number >= 1"),
        ({"context_servers": {"urls": ["h:1"], "router": {"type": "conversation", "virtual_nodes": 0}}}, r"context_servers\.router\.args\.virtual_nodes must be an integer in \[1, 10000\], got 0"),
        ({"context_servers": {"urls": ["h:1"], "router": {"type": "conversation", "virtual_nodes": "8"}}}, r"virtual_nodes must be an integer"),
        ({"context_servers": {"urls": ["h:1"], "router": {"type": "conversation", "load_factor": 0.5}}}, r"context_servers\.router\.args\.load_factor must be 0 \(no bound\) or >= 1, got 0\.5"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "kv_cache_aware", "max_index_tokens": 0}}}, r"router\.args\.max_index_tokens must be an integer >= 1, got 0"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "load_balancing", "args": {"use_tokens": "yes"}}}}, r"router\.args\.use_tokens must be true or false, got 'yes'"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "load_balancing", "use_token": True}}}, r"^generation_servers\.router: use_token \(did you mean use_tokens\?\): not an argument of load_balancing; it takes use_tokens$"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "load_balancing", "args": {"speed": 1}}}}, r"generation_servers\.router: speed: not an argument of load_balancing; it takes use_tokens$"),
        ({"generation_servers": {"urls": ["h:2"], "router": {"type": "round_robin", "args": {"use_tokens": False}}}}, r"router: use_tokens: not an argument of round_robin, which takes none$"),
    ],
)
def test_sections_not_runnable_are_refused_with_a_message(data, match):
    data = {"context_servers": {"urls": ["h:1"]}, "generation_servers": {"urls": ["h:2"]}} | data
    config = build_config(data, environ={})
    with pytest.raises(ConfigError, match=match):
        config.check_runnable()


def test_routers_and_conditional_disaggregation_are_runnable():
    data = {
        "context_servers": {"urls": ["h:1"], "router": {"type": "conversation", "virtual_nodes": 64}},
        "generation_servers": {
            "urls": ["h:2"],
            "router": {"type": "kv_cache_aware", "chunk_bytes": 256, "max_cached_tokens": 1000,
                       "load_weight": 10, "max_load_ratio": 1.5},
        },
        "conditional_disagg_config": {"max_local_prefill_length": 2048},
    }  # fmt: skip
    config = build_config(data, environ={})
    config.check_runnable()
    assert config.generation_servers.router.args["chunk_bytes"] == 256
    assert config.conditional_disagg_config is not None
    assert config.conditional_disagg_config.max_local_prefill_length == 2048


def test_trtllm_serve_sections_are_validated_before_being_refused():
    with pytest.raises(ConfigError, match=r"disagg_cluster\.cluster_uri"):
        build_config({"disagg_cluster": {"cluster_name": "demo"}}, environ={})
    with pytest.raises(ConfigError, match=r"context_servers\.num_instances"):
        build_config({"context_servers": {"num_instances": -1}}, environ={})


def test_missing_pool_is_refused():
    with pytest.raises(ConfigError, match=r"generation_servers\.urls"):
        cli.config_from_args(_args("--context-urls", "127.0.0.1:1"))


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        cli.config_from_args(_args("-c", str(tmp_path / "absent.yaml")))
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        cli.config_from_args(_args("-c", str(bad)))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        cli.config_from_args(_args("-c", str(listy)))


def test_run_reports_config_errors(capsys):
    assert cli.run(_args("--context-urls", "127.0.0.1:1")) == 2
    assert "generation_servers.urls" in capsys.readouterr().err


def test_shared_secret_from_environment_unless_configured():
    assert build_config({}, environ={"FASTCORE_SHARED_SECRET": "s3"}).shared_secret_bytes == b"s3"
    assert (
        build_config({"shared_secret": "cfg"}, environ={"FASTCORE_SHARED_SECRET": "s3"}).shared_secret
        == "cfg"
    )
    assert build_config({}, environ={}).shared_secret_bytes is None
    assert "s3" not in repr(build_config({}, environ={"FASTCORE_SHARED_SECRET": "s3"}))


def test_trtllm_auth_key_is_its_own_key_or_the_shared_secret():
    assert build_config({"internal_request_auth_key": "k"}, environ={"FASTCORE_SHARED_SECRET": "s"}).trtllm_auth_key == b"k"
    assert build_config({}, environ={"FASTCORE_SHARED_SECRET": "s"}).trtllm_auth_key == b"s"
    assert build_config({}, environ={}).trtllm_auth_key is None
    assert "'k'" not in repr(build_config({"internal_request_auth_key": "k"}, environ={}))


def test_shared_secret_from_a_file_first(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"from-file\xff\n")
    config = build_config({"shared_secret_file": str(path)}, environ={"FASTCORE_SHARED_SECRET": "s3"})
    assert config.shared_secret_bytes == b"from-file\xff"  # any bytes, the newline dropped
    args = cli.config_from_args(
        _args("--context-urls", "127.0.0.1:1", "--generation-urls", "127.0.0.1:2", "--shared-secret-file", str(path))
    )
    assert args.shared_secret_bytes == b"from-file\xff"
    with pytest.raises(ConfigError, match="shared_secret_file: .*No such file"):
        build_config({"shared_secret_file": str(tmp_path / "missing")}, environ={})
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ConfigError, match="shared_secret_file: .*empty"):
        build_config({"shared_secret_file": str(tmp_path / "empty")}, environ={})


def test_merge_overrides_skips_none_and_does_not_mutate():
    data = {"context_servers": {"urls": ["a"]}}
    merged = merge_overrides(data, {"context_servers.router.type": "least_loaded", "port": None})
    assert merged == {"context_servers": {"urls": ["a"], "router": {"type": "least_loaded"}}}
    assert data == {"context_servers": {"urls": ["a"]}}


def _healthy_pool(router: str, n: int = 3) -> Pool:
    pool = Pool("p", [f"http://w{i}" for i in range(n)], router)
    for w in pool.workers:
        w.healthy = True
    return pool


def test_round_robin_cycles_and_skips_unhealthy_and_excluded():
    pool = _healthy_pool("round_robin")
    assert [pool.choose().url for _ in range(6)] == ["http://w0", "http://w1", "http://w2"] * 2
    pool.workers[1].healthy = False
    assert {pool.choose().url for _ in range(4)} == {"http://w0", "http://w2"}
    assert pool.choose(exclude=[pool.workers[0], pool.workers[2]]) is None


def test_least_loaded_prefers_fewest_in_flight_and_shares_ties():
    pool = _healthy_pool("least_loaded")
    pool.workers[0].in_flight = 3
    pool.workers[1].in_flight = 1
    pool.workers[2].in_flight = 2
    assert pool.choose().url == "http://w1"
    pool.workers[1].in_flight = 5
    assert pool.choose().url == "http://w2"
    for w in pool.workers:
        w.in_flight = 0
    assert {pool.choose().url for _ in range(3)} == {"http://w0", "http://w1", "http://w2"}


def test_pool_not_ready_until_a_worker_is_healthy():
    pool = Pool("p", ["http://a"], "round_robin")
    assert not pool.ready and pool.choose() is None
    pool.workers[0].healthy = True
    assert pool.ready


async def test_health_checker_takes_out_and_puts_back():
    """A real /health endpoint that flips between 200 and 503, and a port nobody listens on."""
    status = {"code": 200}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=status["code"])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    dead_port = free_port()
    pool = Pool("p", [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dead_port}"], "round_robin")
    changes = []
    try:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(
                [pool], session, interval=0.05, timeout=1, on_change=lambda p, w: changes.append(w.healthy)
            )
            await checker.check_all()
            assert [w.healthy for w in pool.workers] == [True, False]
            status["code"] = 503
            await checker.check_all()
            assert not pool.ready
            status["code"] = 200
            checker.start()
            for _ in range(100):
                if pool.ready:
                    break
                await asyncio.sleep(0.02)
            await checker.stop()
            assert pool.workers[0].healthy and not pool.workers[1].healthy
            checker.mark_unhealthy(pool, pool.workers[0])
            assert not pool.ready
            assert changes[-1] is False
    finally:
        await runner.cleanup()


async def test_health_timeouts_alone_do_not_take_out_a_serving_worker():
    """A /health that hangs past the timeout: slow, not dead.

    A worker still serving requests stays in however often its check times
    out (an overloaded orchestrator must not shed every worker into 503s);
    one that serves nothing goes out after UNHEALTHY_AFTER_TIMEOUTS timeouts
    in a row, and comes back when /health answers again.
    """
    answer = asyncio.Event()  # until set, /health hangs

    async def health(request: web.Request) -> web.Response:
        await answer.wait()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pool = Pool("p", [f"http://127.0.0.1:{port}"], "round_robin")
    worker = pool.workers[0]
    worker.healthy = True
    try:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker([pool], session, interval=1, timeout=0.05)
            for _ in range(UNHEALTHY_AFTER_TIMEOUTS + 2):
                worker.served += 1  # what the orchestrator records per answered leg
                await checker.check_worker(pool, worker)
                assert worker.healthy
            for i in range(UNHEALTHY_AFTER_TIMEOUTS):
                assert worker.healthy, f"out after only {i} silent timeouts"
                await checker.check_worker(pool, worker)
            assert not worker.healthy and not pool.ready
            answer.set()
            await checker.check_worker(pool, worker)
            assert worker.healthy and worker.timeouts == 0
    finally:
        answer.set()  # release the hung handlers so the server shuts down at once
        await runner.cleanup()


@pytest.mark.parametrize(
    ("answer", "b64"),
    [
        ((200, {"role": "context", "prompt_token_ids_b64_completions": True}), True),
        ((200, {"role": "context", "prompt_token_ids_b64_completions": False}), False),
        ((200, {"role": "context"}), False),  # a fastcore worker of before, or another server
        ((200, {"disaggregated_params": {}, "max_batch_size": 8}), False),  # trtllm-serve's /server_info
        ((200, {"prompt_token_ids_b64_completions": 1}), False),  # true means the JSON true
        ((200, [1, 2]), False),
        ((404, {"detail": "Not Found"}), False),
        ((200, "not json"), False),
    ],
)
async def test_b64_on_completions_only_when_server_info_says_so(answer, b64):
    status, info = answer

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(request: web.Request) -> web.Response:
        body = info if isinstance(info, str) else json.dumps(info)
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pool = Pool("context", [f"http://127.0.0.1:{port}"], "round_robin")
    try:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker([pool], session, interval=0.05, timeout=1)
            assert not pool.b64_completions  # nothing heard yet: the list
            await checker.check_all()
            assert pool.ready and pool.b64_completions is b64
    finally:
        await runner.cleanup()
    # One worker that cannot is enough for the pool to ask for the list.
    mixed = Pool("context", ["http://a", "http://b"], "round_robin")
    mixed.workers[0].b64_completions = True
    assert not mixed.b64_completions
    mixed.workers[1].b64_completions = True
    assert mixed.b64_completions
    mixed.workers[1].set_capabilities(Capabilities(b64_completions=False))  # read since: not a stale answer
    assert not mixed.b64_completions


def test_a_pools_readiness_follows_its_workers_health_though_kept_between_changes() -> None:
    """Pool.ready and b64_completions are read on every request and kept with the routable workers:
    each health, capability or membership change is seen by the next read."""
    pool = Pool("generation", ["http://a", "http://b"], "round_robin")
    assert not pool.ready  # nothing checked yet
    pool.workers[1].healthy = True
    assert pool.ready
    pool.workers[1].healthy = False
    assert not pool.ready
    pool.workers[0].healthy = True
    assert pool.ready
    pool.workers = [pool.workers[1]]  # a new member list (discovery): the unhealthy one alone
    assert not pool.ready


def test_disagg_cluster_is_validated_and_needs_no_urls():
    config = build_config(
        {"disagg_cluster": {"cluster_uri": "etcd://127.0.0.1:2379/", "cluster_name": "demo",
                            "minimal_instances": {"context_servers": 2, "generation_servers": 0}}},
        environ={},
    )  # fmt: skip
    config.check_runnable()  # discovered workers only: no urls needed
    cluster = config.disagg_cluster
    assert cluster is not None and cluster.cluster_uri == "etcd://127.0.0.1:2379"
    assert (cluster.minimal("context"), cluster.minimal("generation")) == (2, 0)
    assert build_config({"disagg_cluster": {"cluster_uri": "http://h:1"}}, environ={}).disagg_cluster.minimal(
        "context"
    ) == 1
    for bad, match in [
        ({"cluster_uri": "zk://h:1"}, r"disagg_cluster\.cluster_uri: .*etcd://HOST:PORT or http://HOST:PORT"),
        ({"cluster_uri": "etcd://"}, r"disagg_cluster\.cluster_uri"),
        ({"cluster_uri": "etcd://h:1", "minimal_instances": {"ctx": 1}}, r"minimal_instances: .*not ctx"),
        ({"cluster_uri": "etcd://h:1", "minimal_instances": {"context_servers": -1}}, r"integers >= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_config({"disagg_cluster": bad}, environ={})


def test_cluster_flags_override_the_file(tmp_path):
    config = cli.config_from_args(_args("--cluster-uri", "etcd://127.0.0.1:2379", "--cluster-name", "x",
                                        "--model", "tiny"))  # fmt: skip
    assert config.disagg_cluster is not None and config.disagg_cluster.cluster_name == "x"
    assert config.model == "tiny"


# -- defaults declared once (issue 24 item 7) --------------------------------------------------------


def test_the_configs_http_limits_are_server_http_limits_defaults():
    from server.http.limits import Limits

    config, server = OrchestratorConfig(), Limits()
    assert (config.max_body_bytes, config.max_header_bytes, config.max_client_connections) == (
        server.max_body_bytes, server.max_header_bytes, server.max_connections)  # fmt: skip
    assert (config.client_header_timeout_s, config.client_body_timeout_s, config.client_keepalive_timeout_s) == (
        server.header_timeout_s, server.body_timeout_s, server.keepalive_timeout_s)  # fmt: skip
    assert (config.max_inflight_body_bytes, config.client_ip_share, config.retry_after_s) == (
        server.max_inflight_body_bytes, server.peer_share, server.retry_after_s)  # fmt: skip


def test_a_worker_takes_the_legs_of_a_body_at_the_orchestrators_limit():
    """Why the worker's body limit is its own (server/http/limits.py): each leg is larger than the
    client body it carries, so a worker with the orchestrator's limit would answer 413 to bodies the
    orchestrator took; with WORKER_MAX_BODY_BYTES both legs of a 128k-token prompt fit."""
    import base64
    import struct

    import fastcore.relay as relay
    from server.http.limits import MAX_BODY_BYTES, WORKER_MAX_BODY_BYTES
    from server.worker.app import WorkerSettings

    assert WorkerSettings().limits().max_body_bytes == WORKER_MAX_BODY_BYTES
    frame = b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":""}]}'
    client = frame[:-4] + b"x" * (MAX_BODY_BYTES - len(frame)) + frame[-4:]
    assert len(client) == MAX_BODY_BYTES
    context = relay.build_context_request(client, disagg_request_id=7, return_b64=True, chat=True)
    assert MAX_BODY_BYTES < len(context) <= WORKER_MAX_BODY_BYTES
    ids = list(range(131072))
    answer = {"id": "c", "object": "text_completion", "prompt_token_ids": ids,
              "prompt_token_ids_b64": base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode(),
              "choices": [{"index": 0, "text": "", "finish_reason": "length", "disaggregated_params": {
                  "request_type": "context_only", "first_gen_tokens": [1], "ctx_request_id": 1,
                  "disagg_request_id": 7, "ctx_info_endpoint": "http://127.0.0.1:1/kv/7"}}]}  # fmt: skip
    for b64 in (False, True):  # the ids as a JSON list (gate off) or as base64 (on)
        leg = relay.build_generation_request(client, json.dumps(answer).encode(), tokids_b64=b64,
                                             strip_history=False, chat=True)  # fmt: skip
        assert MAX_BODY_BYTES < len(leg) <= WORKER_MAX_BODY_BYTES


def test_cluster_timings_default_to_what_a_worker_registers_with():
    from server.cluster.records import LAYOUTS, ClusterSettings

    config = build_config({"disagg_cluster": {"cluster_uri": "etcd://h:1"}}, environ={}).disagg_cluster
    worker = ClusterSettings(cluster_uri="etcd://h:1")
    assert config is not None
    assert (config.heartbeat_interval_sec, config.inactive_timeout_sec) == (
        worker.heartbeat_interval_s, worker.inactive_timeout_s)  # fmt: skip
    # the layouts the type names (a Literal, for the error it words) are the records' own, all read
    assert tuple(config.key_prefixes) == LAYOUTS == worker.key_prefixes


def test_router_types_are_the_routers_built_and_their_trtllm_names():
    from server.orchestrator.config import ROUTER_ALIASES, ROUTER_TYPES, ROUTERS_NOT_BUILT
    from server.orchestrator.routing import ROUTER_ARGS, ROUTERS

    assert ROUTER_TYPES == (*ROUTERS, *ROUTER_ALIASES) and set(ROUTER_ARGS) == set(ROUTERS)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for flag in ("--context-router", "--generation-router"):
        (action,) = [a for a in parser._actions if flag in a.option_strings]
        assert tuple(action.choices) == ROUTER_TYPES
    for kind in ROUTER_TYPES:  # each one the config takes, the CLI too, and it runs
        config = cli.config_from_args(_args("--context-urls", "h:1", "--generation-urls", "h:2",
                                            "--context-router", kind, "--generation-router", kind))  # fmt: skip
        assert config.context_servers.router.kind in ROUTERS
    for kind in ROUTERS_NOT_BUILT:  # parsed, then refused saying what is missing
        with pytest.raises(ConfigError, match=f"{kind} needs"):
            build_config({"context_servers": {"urls": ["h:1"], "router": {"type": kind}},
                          "generation_servers": {"urls": ["h:2"]}}, environ={}).check_runnable()  # fmt: skip
    with pytest.raises(ConfigError, match=r"router\.type: .*one of round_robin, .*load_balancing.*got 'random'"):
        build_config({"context_servers": {"router": {"type": "random"}}}, environ={})


def test_breaker_and_connect_defaults_are_the_pools_and_the_clients():
    from server.http.client import CONNECT_TIMEOUT_S, UpstreamPool
    from server.orchestrator.pools import CircuitBreaker, Pool

    config = OrchestratorConfig()
    breaker, pool = CircuitBreaker(), Pool("context", ["http://h:1"], "round_robin")
    assert (config.circuit_breaker_failures, config.circuit_breaker_open_s) == (breaker.threshold, breaker.open_s)
    assert (pool.breaker_failures, pool.breaker_open_s) == (breaker.threshold, breaker.open_s)
    assert config.connect_timeout_s == CONNECT_TIMEOUT_S == UpstreamPool("http://h:1").connect_timeout_s


def test_orchestrator_flags_show_their_defaults_in_help():
    """Each flag whose key has a default says it in --help (the defaults of the config model)."""
    from server.orchestrator.config import AdmissionConfig

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    helps = {a.option_strings[-1]: " ".join((a.help or "").split()) for a in parser._actions if a.option_strings}
    top, admission = OrchestratorConfig.model_fields, AdmissionConfig.model_fields
    expected = {
        "--context-router": "round_robin",
        "--generation-router": "round_robin",
        "--relay": top["relay"].default,
        "--max-retries": top["max_retries"].default,
        "--request-timeout-s": f"{top['request_timeout_s'].default:g}",
        "--context-timeout-s": f"{top['context_timeout_s'].default:g}",
        "--context-fallback": top["context_fallback"].default,
        "--drain-timeout-s": f"{top['drain_timeout_s'].default:g}",
        "--health-check-interval-s": f"{top['health_check_interval_s'].default:g}",
        "--max-body-bytes": top["max_body_bytes"].default,
        "--workers": top["workers"].default,
        "--max-inflight": admission["max_inflight"].default,
        "--max-queue": admission["max_queue"].default,
        "--max-queue-wait-s": f"{admission['max_queue_wait_s'].default:g}",
        "--no-metrics-requires-key": "off",
    }
    for flag, default in expected.items():
        assert f"(default {default})" in helps[flag], (flag, helps[flag])
