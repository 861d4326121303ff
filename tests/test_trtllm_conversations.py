"""One conversation, one worker, in front of trtllm-serve workers (tests/trtllm_standin.py, which
forbid unknown fields as trtllm-serve does): its ``conversation_params.conversation_id``, each of its
four headers when the body has none, and our top-level ``conversation_id`` (moved into
``conversation_params`` before the legs)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from helpers import free_port, until
from trtllm_standin import start_standin

from server.orchestrator.app import start_server
from server.orchestrator.config import build_config

HEADERS = (
    "x-session-id",
    "x-correlation-id",
    "x-session-affinity",
    "x-multi-turn-session-id",
    "x-conversation-id",
)


def chat(conv: str, turn: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"conversation {conv} turn {t}"} for t in range(turn + 1)]
    return {"model": "tiny", "messages": messages, "max_tokens": 2} | extra


async def test_conversations_stick_to_one_trtllm_worker() -> None:
    ctx = [await start_standin("context")]
    gen = [await start_standin("generation") for _ in range(3)]
    port = free_port()
    config = build_config({
        "port": port, "health_check_interval_s": 0.3,
        "context_servers": {"urls": [s.address for s in ctx], "router": {"type": "conversation"}},
        "generation_servers": {"urls": [s.address for s in gen], "router": {"type": "conversation", "load_factor": 0}},
    }, environ={})  # fmt: skip
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        await until(lambda: orch.generation_pool.healthy_count() == 3 and orch.context_pool.ready, 5.0)
        async with aiohttp.ClientSession() as session:
            ways: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
            for i in range(4):
                ways[f"p{i}"] = ({"conversation_params": {"conversation_id": f"p{i}"}}, {})
                ways[f"t{i}"] = ({"conversation_id": f"t{i}"}, {})  # ours: moved into conversation_params
            for i, header in enumerate(HEADERS):
                ways[f"h{i}"] = ({}, {header: f"h{i}"})
            homes: dict[str, set[int]] = {}
            for turn in range(3):
                for conv, (extra, headers) in ways.items():
                    before = [len(s.received()) for s in gen]
                    async with session.post(url, json=chat(conv, turn, **extra), headers=headers) as r:
                        assert r.status == 200, await r.text()
                    took = [i for i, s in enumerate(gen) if len(s.received()) > before[i]]
                    assert len(took) == 1
                    homes.setdefault(conv, set()).update(took)
        assert all(len(where) == 1 for where in homes.values()), homes
        assert len({next(iter(w)) for w in homes.values()}) > 1, "the conversations spread over the workers"
        legs = [r for s in ctx + gen for r in s.received()]
        assert legs and all(r.status == 200 for r in legs), [
            (r.path, r.status, r.response) for r in legs if r.status != 200
        ]
        assert all("conversation_id" not in r.body for r in legs)
        moved = [
            r.body["conversation_params"]
            for r in legs
            if r.body.get("conversation_params", {}).get("conversation_id", "").startswith("t")
        ]
        assert moved and all(set(p) == {"conversation_id"} for p in moved)
    finally:
        await server.cleanup()
        for s in ctx + gen:
            await s.stop()


async def _one_request(relay: str, body: bytes) -> tuple[int, str, list[Any]]:
    """``body`` through an orchestrator (relay mode ``relay``) in front of trtllm-serve stand-ins: the
    client's status and text, and the legs the workers received."""
    ctx, gen = await start_standin("context"), await start_standin("generation")
    port = free_port()
    config = build_config({
        "port": port, "health_check_interval_s": 0.3, "relay": relay,
        "context_servers": {"urls": [ctx.address]}, "generation_servers": {"urls": [gen.address]},
    }, environ={})  # fmt: skip
    server, orch = await start_server(config)
    try:
        await until(lambda: orch.generation_pool.ready and orch.context_pool.ready, 5.0)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.text(), [*ctx.received(), *gen.received()]
    finally:
        await server.cleanup()
        await ctx.stop()
        await gen.stop()


@pytest.mark.parametrize("relay", ["fast", "parsed"])
async def test_our_conversation_id_is_moved_on_every_relay_mode(relay: str) -> None:
    """The fast relay's client scan finds it (the body read again, moved); the parsed modes, whose
    models take no conversation_id, move it first: on both, no leg carries it at the top."""
    body = json.dumps(chat("c", 0, conversation_id="t7")).encode()
    status, text, legs = await _one_request(relay, body)
    assert status == 200, text
    assert len(legs) == 2 and all(r.status == 200 for r in legs)
    assert all(
        "conversation_id" not in r.body and r.body["conversation_params"] == {"conversation_id": "t7"}
        for r in legs
    )


async def test_a_repeated_conversation_id_is_the_orchestrators_400_naming_it() -> None:
    """Which of two ids to move is no guess: refused before any leg (it used to reach the workers as it
    was, and trtllm-serve refused it there)."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "conversation_id": "a", "conversation_id": "b"}'
    status, text, legs = await _one_request("fast", body)
    assert status == 400 and "conversation_id" in json.loads(text)["error"]["message"], text
    assert legs == []
