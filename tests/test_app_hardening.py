"""Hardening, second round (issue 19, app level): what one client can learn of, or do to, another.

- a lone UTF-16 surrogate in any string of a request is a 400 naming the field, on every worker
  role and through every relay mode of the orchestrator (it was a tokenizer's 500, a 502);

Real workers (``tiny_workers``: the tiny torch model, the synthetic engine) and orchestrators
(``start_server``) in this test's event loop, on 127.0.0.1; raw HTTP from
``test_worker_hardening``'s helpers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from conftest import free_port
from test_worker_hardening import Response, assert_openai_error, get, post
from tiny_workers import LiveWorker, one_torch_thread, synthetic_worker, tiny_worker  # noqa: F401 (autouse)

from server.orchestrator.app import start_server
from server.orchestrator.config import build_config

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
    assert error["param"] == field.split("[")[0].split(".")[0]


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
