"""trtllm-serve's router arguments and top-level keys (issue 20, item 4): each loads and acts, or is
refused at startup with a message naming what is missing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from routing_inputs import history, workers

from server.orchestrator.config import ConfigError, build_config
from server.orchestrator.routing import ConversationRouter, KvCacheAwareRouter, make_router, request_key


def config(**data: Any) -> Any:
    base = {"context_servers": {"urls": ["h:1"]}, "generation_servers": {"urls": ["h:2"]}}
    for name in ("context_servers", "generation_servers"):
        if name in data:
            data[name] = base[name] | data[name]
    cfg = build_config(base | data, environ={})
    cfg.check_runnable()
    return cfg


def body(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_tokens_per_block_sets_the_kv_cache_aware_chunk() -> None:
    assert KvCacheAwareRouter({"tokens_per_block": 32}).chunk_bytes == 128
    assert KvCacheAwareRouter().chunk_bytes == 512
    # trtllm-serve's extract_router_config: the workers' kv_cache_config.tokens_per_block
    cfg = config(generation_servers={"router": {"type": "kv_cache_aware"}, "kv_cache_config": {"tokens_per_block": 64}})
    assert cfg.generation_servers.router.args == {"tokens_per_block": 64}
    assert make_router("kv_cache_aware", cfg.generation_servers.router.args).chunk_bytes == 256
    # the router's own argument wins; a round_robin pool takes nothing
    cfg = config(generation_servers={"router": {"type": "kv_cache_aware", "chunk_bytes": 1024},
                                     "kv_cache_config": {"tokens_per_block": 64}},
                 context_servers={"kv_cache_config": {"tokens_per_block": 64}})  # fmt: skip
    assert cfg.generation_servers.router.args == {"chunk_bytes": 1024} and cfg.context_servers.router.args == {}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"tokens_per_block": 12}, "multiple of 8"),
        ({"tokens_per_block": 0}, "tokens_per_block must be an integer in"),
        ({"tokens_per_block": True}, "tokens_per_block must be an integer"),
        ({"tokens_per_block": 32, "chunk_bytes": 128}, "not both"),
    ],
)
def test_bad_tokens_per_block_is_refused_by_name(args: dict[str, Any], words: str) -> None:
    for kind in ("kv_cache_aware", "conversation"):
        with pytest.raises(ConfigError, match=words):
            config(generation_servers={"router": {"type": kind, **args}})


def test_match_threshold_keeps_a_conversation_without_an_id_on_its_worker() -> None:
    pool = workers(3)
    router = ConversationRouter({"match_threshold": 0.75, "tokens_per_block": 32})
    router.sync(pool)
    assert router.key_kinds == {"conversation", "prefix"}
    homes = {}
    for seed in range(6):
        turn1 = router.choose(pool, request_key(body(history(seed, 2, 400)), True, None))
        homes[seed] = turn1
    assert len({w.url for w in homes.values()}) == 3  # new conversations: least loaded, in turn
    for seed in range(6):  # the next turn shares most of its prompt with the last: the same worker
        assert router.choose(pool, request_key(body(history(seed, 3, 400)), True, None)) is homes[seed]
    # below the threshold (a short shared prefix, a long new tail): least loaded, not the match
    short = ConversationRouter({"match_threshold": 1.0, "tokens_per_block": 32})
    short.sync(pool)
    first = short.choose(pool, request_key(body(history(0, 2, 400)), True, None))
    assert short.choose(pool, request_key(body(history(0, 3, 400)), True, None)) is not first
    # without match_threshold (our default): no prefix matching, requests without an id in turn
    plain = ConversationRouter()
    assert plain.key_kinds == {"conversation"}
    picks = {plain.choose(pool, request_key(body(history(0, t, 400)), True, None)).url for t in (2, 3, 4)}
    assert len(picks) == 3


@pytest.mark.parametrize("threshold", [0, 1.5, -0.1, "high"])
def test_bad_match_threshold_is_refused(threshold: Any) -> None:
    with pytest.raises(ConfigError, match="match_threshold"):
        config(context_servers={"router": {"type": "conversation", "match_threshold": threshold}})


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"schedule_style": "generation_first"}, "generation_first .* is not built.*use context_first"),
        ({"perf_metrics_max_requests": 100}, r"perf_metrics_max_requests \(100\).*answers \[\]"),
        ({"generation_servers": {"router": {"type": "centralized_kv_cache_aware", "tokens_per_block": 32}}},
         "centralized_kv_cache_aware needs the workers' KV events pushed .* ZMQ"),
        ({"schedule_style": "sideways"}, "schedule_style"),
    ],
)
def test_trtllm_keys_not_built_are_refused_naming_what_is_missing(data: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config(**data)


def test_trtllm_keys_that_change_nothing_load() -> None:
    cfg = config(schedule_style="context_first", otlp_config={"otlp_traces_endpoint": None}, perf_metrics_max_requests=0)
    assert cfg.schedule_style == "context_first" and "schedule_style" not in cfg.unused_keys()
