"""fastcore's orchestrator in front of trtllm-serve workers (the stand-in of tests/trtllm_standin.py).

The whole matrix, every relay mode and gate, chat and completions, streaming
or not, with trtllm's internal auth on and off, runs through a context and a
generation stand-in whose request models refuse what trtllm-serve refuses.
Every leg must validate (the stand-ins answer 200 to each), the generation leg
must get the prompt the context leg saw, and the client's answer must equal,
in form and in tokens, what a `both` stand-in answers to the same request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import http_post
from orchestrators import (
    MESSAGES,
    MODES,
    PROMPT,
    LoopThread,
    RunningOrchestrator,
    make_config,
    run_request,
    wait_healthy,
)
from trtllm_standin import StandinThread

from server.auth import TRTLLM_AUTH_HEADER, check_trtllm_disagg_auth

KEY = b"trtllm-interop-key"
INTERNAL = ("disaggregated_params", "prompt_token_ids", "prompt_token_ids_b64")


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


class Cluster:
    """A context and a generation stand-in (sharing what the context saw) and a `both` one."""

    def __init__(self, loop_thread: LoopThread, key: bytes | None) -> None:
        registry: dict[int, list[int]] = {}
        self.key = key
        self.context = StandinThread("context", loop=loop_thread.loop, key=key, kv_registry=registry)
        self.generation = StandinThread("generation", loop=loop_thread.loop, key=key, kv_registry=registry)
        self.both = StandinThread("both", loop=loop_thread.loop)

    def close(self) -> None:
        for standin in (self.context, self.generation, self.both):
            standin.close()


@pytest.fixture(scope="module")
def clusters(loop_thread) -> Iterator[dict[str, Cluster]]:
    made = {"auth": Cluster(loop_thread, KEY), "no_auth": Cluster(loop_thread, None)}
    yield made
    for cluster in made.values():
        cluster.close()


@pytest.fixture(scope="module")
def orchestrators(loop_thread, clusters) -> Iterator[dict[tuple[str, str], RunningOrchestrator]]:
    running = {}
    for auth, cluster in clusters.items():
        for mode, overrides in MODES.items():
            extra: dict[str, Any] = {"shared_secret": None}
            if cluster.key is not None:
                extra["internal_request_auth_key"] = cluster.key.decode()
            config = make_config([cluster.context.standin.address], [cluster.generation.standin.address],
                                 **overrides, **extra)  # fmt: skip
            running[(auth, mode)] = RunningOrchestrator(loop_thread, config)
    try:
        for orch in running.values():
            wait_healthy(orch.url, timeout=30)
        yield running
    finally:
        for orch in running.values():
            orch.stop()


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("auth", ["auth", "no_auth"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("mode", list(MODES))
def test_orchestrator_fronts_trtllm_serve_workers(clusters, orchestrators, mode, route, stream, auth):
    cluster = clusters[auth]
    ctx_before, gen_before = len(cluster.context.requests), len(cluster.generation.requests)
    unsigned_before = cluster.generation.standin.unauthenticated_protected
    got = run_request(orchestrators[(auth, mode)].client(), route, stream)
    expected = run_request(_client(cluster.both.url), route, stream)
    assert expected["text"], "the stand-in says something; equality would mean little otherwise"
    assert got == expected
    legs = [r for r in cluster.context.requests[ctx_before:] + cluster.generation.requests[gen_before:]
            if r.method == "POST"]  # fmt: skip
    assert [r.status for r in legs] == [200, 200], [(r.path, r.status, r.response) for r in legs]
    ctx_leg, gen_leg = legs
    assert ctx_leg.body["disaggregated_params"]["request_type"] == "context_only"
    params = gen_leg.body["disaggregated_params"]
    assert params["request_type"] == "generation_only"
    assert (1 << 40) <= params["disagg_request_id"] < (1 << 63)
    # The generation leg's prompt is the one the context leg tokenized (no re-tokenizing).
    assert gen_leg.kv_match is True and gen_leg.prompt_source in ("ids", "b64")
    # Without a key trtllm serves protected fields with a FutureWarning (the stand-in counts it).
    unsigned = cluster.generation.standin.unauthenticated_protected - unsigned_before
    assert unsigned == (0 if cluster.key is not None else 1)
    if cluster.key is not None:
        assert check_trtllm_disagg_auth(
            cluster.key, params.get("ctx_info_endpoint"), params.get("encoded_opaque_state"),
            gen_leg.headers.get(TRTLLM_AUTH_HEADER),
        )  # fmt: skip


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
def test_no_internal_field_reaches_the_client(orchestrators, mode, route):
    path, body = (
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4})
        if route == "chat"
        else ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    )
    status, data = http_post(orchestrators[("no_auth", mode)].url + path, json.dumps(body).encode())
    assert status == 200, data
    text = json.dumps(data)
    for field in INTERNAL:
        assert f'"{field}"' not in text


def test_trtllm_error_bodies_reach_the_client_in_our_shape(orchestrators):
    # n > 1 is refused by the stand-in in trtllm's handler shape ({"object": "error", ...}).
    status, data = http_post(
        orchestrators[("no_auth", "fast_gates_on")].url + "/v1/completions",
        json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2}).encode(),
    )
    assert status == 400
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert isinstance(data["error"]["code"], str)
