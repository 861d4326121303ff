"""Conditional disaggregation in front of trtllm-serve workers (issue 20, item 7): their /server_info
says nothing of local_prefill, yet their generation workers serve a plain request whole, so a short
expected remainder skips the context leg; trtllm-serve's rule (require_prefix_hit: a cold prompt
always takes the context leg) on request."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from helpers import free_port, until
from trtllm_standin import start_standin

from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.orchestrator.pools import Capabilities


def test_a_trtllm_server_info_counts_as_local_prefill() -> None:
    trtllm = {"disaggregated_params": {}, "max_batch_size": 64, "tokens_per_block": 32}
    assert Capabilities.of(trtllm).local_prefill is True
    assert Capabilities.of(trtllm | {"local_prefill": False}).local_prefill is False  # a word said wins
    assert Capabilities.of({"role": "generation"}).local_prefill is False


def chat(content: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


@pytest.mark.parametrize("require_hit", [False, True])
async def test_short_remainders_skip_the_context_leg_in_front_of_trtllm_workers(require_hit: bool) -> None:
    ctx, gen = await start_standin("context"), await start_standin("generation")
    port = free_port()
    config = build_config({
        "port": port, "health_check_interval_s": 0.3,
        "context_servers": {"urls": [ctx.address]},
        "generation_servers": {"urls": [gen.address], "router": {"type": "kv_cache_aware", "tokens_per_block": 8}},
        "conditional_disagg_config": {"max_local_prefill_length": 200, "require_prefix_hit": require_hit},
    }, environ={})  # fmt: skip
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        await until(lambda: orch.generation_pool.healthy_count() == 1 and orch.context_pool.ready, 5.0)
        assert orch.generation_pool.workers[0].local_prefill

        async def legs(body: dict[str, Any]) -> tuple[int, int]:
            before = len(ctx.received()), len(gen.received())
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
            return len(ctx.received()) - before[0], len(gen.received()) - before[1]

        short = chat("a short question about the weather " * 4)
        long = chat("a long document to summarise " * 50)  # ~375 estimated tokens: above 200
        if require_hit:
            assert await legs(short) == (1, 1)  # no expected hit: trtllm-serve's rule sends the context leg
            assert await legs(short) == (0, 1)  # its prefix is there now: a short remainder, served whole
        else:
            assert await legs(short) == (0, 1)
        assert await legs(long) == (1, 1)
        plain = [r for r in gen.received() if r.body.get("disaggregated_params") is None]
        assert plain and all(r.status == 200 for r in gen.received() + ctx.received())
    finally:
        await server.cleanup()
        await ctx.stop()
        await gen.stop()
