"""The orchestrator end to end: real torch worker processes (tiny model) on 127.0.0.1.

Workers are started once for the module (one ``both`` worker as the reference,
two context and two generation workers); each orchestrator under test runs on
its own event-loop thread in this process, on real sockets, so a test can
read its pools and metrics directly. Tests that kill workers start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from helpers import eventually_blocking, free_port, http_post
from orchestrators import (
    MAX_TOKENS,
    MESSAGES,
    MODES,
    PROMPT,
    SECRET,
    LoopThread,
    RunningOrchestrator,
    http_get,
    make_config,
    run_request,
    wait_healthy,
)

from server.auth import SIGNATURE_HEADER, Verifier
from server.errors import error_body

pytestmark = pytest.mark.slow

WORKER_ARGV = [sys.executable, "-m", "server.cli", "worker", "--model", "tiny", "--host", "127.0.0.1"]


class WorkerProcess:
    def __init__(self, role: str, *, secret: str | None = SECRET) -> None:
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("FASTCORE_SHARED_SECRET", None)
        if secret is not None:
            env["FASTCORE_SHARED_SECRET"] = secret
        self.proc = subprocess.Popen([*WORKER_ARGV, "--role", role, "--port", str(self.port)], env=env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self) -> WorkerProcess:
        wait_healthy(self.url, [self.proc])
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, list[WorkerProcess]]]:
    started = {
        "both": [WorkerProcess("both")],
        "context": [WorkerProcess("context"), WorkerProcess("context")],
        "generation": [WorkerProcess("generation"), WorkerProcess("generation")],
    }
    try:
        for group in started.values():
            for worker in group:
                worker.wait()
        yield started
    finally:
        for group in started.values():
            for worker in group:
                worker.stop()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def orchestrators(workers, loop_thread) -> Iterator[dict[str, RunningOrchestrator]]:
    context = [w.address for w in workers["context"]]
    generation = [w.address for w in workers["generation"]]
    running = {
        name: RunningOrchestrator(loop_thread, make_config(context, generation, **mode))
        for name, mode in MODES.items()
    }
    try:
        for orch in running.values():
            wait_healthy(orch.url, timeout=30)
        yield running
    finally:
        for orch in running.values():
            orch.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


_reference_cache: dict[tuple[str, bool, int], dict[str, Any]] = {}


def reference(workers, route: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    key = (route, stream, max_tokens)
    if key not in _reference_cache:
        _reference_cache[key] = run_request(_client(workers["both"][0].url), route, stream, max_tokens)
    return _reference_cache[key]


# ---------------------------------------------------------------------------
# Outputs: every mode equals one `both` worker


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("mode", list(MODES))
def test_openai_client_output_equals_single_worker(workers, orchestrators, mode, route, stream):
    expected = reference(workers, route, stream)
    assert expected["text"], "the tiny model should say something; equality would mean little otherwise"
    got = run_request(orchestrators[mode].client(), route, stream)
    assert got == expected


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
def test_finished_context_response_is_the_answer(workers, orchestrators, mode, route, stream):
    orch = orchestrators[mode]
    before = orch.metric("fastcore_orchestrator_finished_by_context_total")
    got = run_request(orch.client(), route, stream, max_tokens=1)
    assert got == reference(workers, route, stream, max_tokens=1)
    assert got["usage"]["completion_tokens"] == 1
    assert orch.metric("fastcore_orchestrator_finished_by_context_total") == before + 1


def test_unary_response_carries_no_internal_fields(orchestrators):
    for mode in ("parsed", "fast_gates_off", "fast_gates_on"):
        for path, body in (
            ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}),
            ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}),
            ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}),
        ):
            status, data = http_post(orchestrators[mode].url + path, json.dumps(body).encode())
            assert status == 200, data
            assert "prompt_token_ids" not in data and "prompt_token_ids_b64" not in data
            assert all("disaggregated_params" not in c for c in data["choices"])
            assert data["usage"]["prompt_tokens"] > 1


# ---------------------------------------------------------------------------
# What the generation worker receives, observed by a recording proxy in front of it


class RecordingProxy:
    """Records each request body, then forwards it to a real worker and streams the answer back.

    For fault injection it can instead answer POSTs with ``fail_status``, or
    with ``garbage`` as a 200 body, or after ``delay_s`` of silence.
    """

    def __init__(
        self,
        loop: LoopThread,
        target: str,
        *,
        fail_status: int | None = None,
        garbage: bytes | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.target = target
        self.fail_status = fail_status
        self.garbage = garbage
        self.delay_s = delay_s
        self.bodies: list[tuple[str, bytes, dict[str, str]]] = []
        self.cancelled = 0
        self.port = free_port()
        self.loop = loop
        self.runner = loop.run(self._start())

    async def _start(self) -> web.AppRunner:
        self.session = aiohttp.ClientSession()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST":
            self.bodies.append((request.path, body, dict(request.headers)))
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1  # the orchestrator dropped the connection
                raise
            if self.fail_status is not None:
                return web.Response(
                    status=self.fail_status, body=error_body(self.fail_status, "injected failure")
                )
            if self.garbage is not None:
                return web.Response(body=self.garbage, content_type="application/json")
        headers = {k: v for k, v in request.headers.items() if k in ("Content-Type", SIGNATURE_HEADER)}
        async with self.session.request(
            request.method, self.target + request.path, data=body, headers=headers
        ) as up:
            out = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")}
            )
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    def stop(self) -> None:
        async def _stop() -> None:
            await self.runner.cleanup()
            await self.session.close()

        self.loop.run(_stop())


@pytest.mark.parametrize(
    "mode", ["parsed", "fast_gates_off", "fast_tokids", "fast_gates_on", "parsed_gates_on"]
)
def test_generation_request_body_per_gate(workers, loop_thread, mode):
    proxy = RecordingProxy(loop_thread, workers["generation"][0].url)
    orch = RunningOrchestrator(
        loop_thread, make_config([workers["context"][0].address], [f"127.0.0.1:{proxy.port}"], **MODES[mode])
    )
    try:
        wait_healthy(orch.url, timeout=30)
        client = orch.client()
        assert run_request(client, "chat", False) == reference(workers, "chat", False)
        assert run_request(client, "completions", True) == reference(workers, "completions", True)
        (chat_path, chat_body, chat_headers), (comp_path, comp_body, _) = proxy.bodies
        assert (chat_path, comp_path) == ("/v1/chat/completions", "/v1/completions")
        # Signed over the exact bytes sent, with a fresh timestamp and nonce, for the worker behind the
        # proxy (its /health instance), checked as that worker does.
        instance = json.loads(http_get(workers["generation"][0].url + "/health")[1])["instance"]
        header = chat_headers[SIGNATURE_HEADER]
        assert Verifier(SECRET.encode()).check(chat_body, header, destination=instance, bound=True) is None
        chat, comp = json.loads(chat_body), json.loads(comp_body)
        for sent in (chat, comp):
            params = sent["disaggregated_params"]
            assert params["request_type"] == "generation_only"
            assert (1 << 40) <= params["disagg_request_id"] < (1 << 63)
            assert params["ctx_usage"]["completion_tokens"] == 1
            assert isinstance(params["first_gen_tokens"], list) and len(params["first_gen_tokens"]) == 1
        assert comp["stream"] is True and chat.get("stream") in (None, False)
        tokids = MODES[mode].get("gen_tokids_ctxbytes", False)
        if tokids:
            assert (
                isinstance(chat["prompt_token_ids_b64"], str) and len(chat["prompt_token_ids_b64"]) % 4 == 0
            )
            assert "prompt_token_ids" not in chat or chat["prompt_token_ids"] is None
            assert isinstance(comp["prompt_token_ids_b64"], str)
        else:
            # docs/protocol.md: gates off, the ids travel as a JSON list.
            assert "prompt_token_ids_b64" not in chat
            ids = chat["prompt_token_ids"]
            assert isinstance(ids, list) and len(ids) > 10 and all(isinstance(i, int) for i in ids)
            assert isinstance(comp["prompt"], list) and all(isinstance(i, int) for i in comp["prompt"])
        strip = MODES[mode].get("gen_strip_message_history", False)
        assert chat["messages"] == (MESSAGES[-1:] if strip else MESSAGES)
    finally:
        orch.stop()
        proxy.stop()


# ---------------------------------------------------------------------------
# Bad input from clients: same answer in every mode


BAD_BODIES = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "byte 31"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []} trailing', 400, "byte"),
    ("/v1/chat/completions", b"\xff\xfe{}", 400, "UTF-8"),
    ("/v1/chat/completions", b"", 400, "the request body is empty: send a JSON object"),
    ("/v1/completions", b" \r\n", 400, "the request body is empty: send a JSON object"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        400,
        "stream",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        400,
        "max_tokens",
    ),
    ("/v1/completions", b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream_options": 3}', 400, "stream_options"),
]
INTERNAL = [
    ("/v1/chat/completions", "disaggregated_params", {"request_type": "generation_only"}),
    ("/v1/chat/completions", "prompt_token_ids_b64", "AQAAAA=="),
    ("/v1/chat/completions", "prompt_token_ids", [1, 2, 3]),
    ("/v1/completions", "disaggregated_params", {"request_type": "context_only"}),
    ("/v1/completions", "prompt_token_ids_b64", "AQAAAA=="),
]


@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_BODIES)
def test_bad_client_bodies(orchestrators, mode, path, body, status, needle):
    got_status, data = http_post(orchestrators[mode].url + path, body)
    assert got_status == status
    assert needle in data["error"]["message"] or data["error"]["param"] == needle
    assert data["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
@pytest.mark.parametrize(("path", "field", "value"), INTERNAL)
def test_internal_fields_from_clients_are_refused(orchestrators, mode, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    status, data = http_post(orchestrators[mode].url + path, json.dumps(body).encode())
    assert status == 400
    assert data["error"]["param"] == field and field in data["error"]["message"]


@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
def test_oversized_body_is_413(workers, loop_thread, mode):
    config = make_config(
        [workers["context"][0].address],
        [workers["generation"][0].address],
        max_body_bytes=4096,
        **MODES[mode],
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        big = json.dumps({"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2}).encode()
        status, data = http_post(orch.url + "/v1/completions", big)
        assert status == 413 and "4096" in data["error"]["message"]

        # Without a Content-Length (chunked), the limit holds while reading.
        def chunks() -> Iterator[bytes]:
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        request = urllib.request.Request(
            orch.url + "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 413
        assert json.loads(info.value.read())["error"]["code"] == "request_too_large"
        small = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        assert http_post(orch.url + "/v1/completions", small)[0] == 200
    finally:
        orch.stop()


def test_compressed_body_415_and_body_budget_503_with_retry_after(workers, loop_thread):
    config = make_config(
        [workers["context"][0].address], [workers["generation"][0].address], max_inflight_body_bytes=4096,
        retry_after_s=7,
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        small = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            orch.url + "/v1/completions", data=small,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 415
        assert json.loads(info.value.read())["error"]["code"] == "unsupported_media_type"
        # Under the per-request limit, over what the whole process may hold at once.
        big = json.dumps({"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2}).encode()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(orch.url + "/v1/completions", data=big), timeout=30)
        assert info.value.code == 503 and info.value.headers["Retry-After"] == "7"
        assert "too many request bytes" in json.loads(info.value.read())["error"]["message"]
        assert orch.metric("fastcore_orchestrator_body_budget_refused_total") == 1
        assert orch.metric("fastcore_orchestrator_client_body_bytes") == 0
        assert http_post(orch.url + "/v1/completions", small)[0] == 200
    finally:
        orch.stop()


# ---------------------------------------------------------------------------
# Workers' errors, faults and the shared secret


def test_worker_4xx_reaches_the_client_with_its_body(orchestrators):
    for mode in ("parsed", "fast_gates_on"):
        client = orchestrators[mode].client()
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=3)
        assert info.value.status_code == 400
        assert "n" in str(info.value.body)
        # A streaming client gets the same 400 (nothing was streamed yet).
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=3, stream=True)


def test_workers_refuse_unsigned_internal_requests(workers, loop_thread):
    # The workers hold the secret; an orchestrator without it is refused and
    # the worker's 403 is what its client sees.
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1}}  # fmt: skip
    status, data = http_post(workers["context"][0].url + "/v1/completions", json.dumps(body).encode())
    assert status == 403, data
    config = make_config(
        [workers["context"][0].address], [workers["generation"][0].address], shared_secret=None
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        status, data = http_post(
            orch.url + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
        )
        assert status == 403 and "error" in data
    finally:
        orch.stop()


def test_context_worker_down_is_retried_on_the_other(workers, loop_thread):
    victim = WorkerProcess("context").wait()
    # A long health interval: the orchestrator still believes the victim is up.
    config = make_config(
        [victim.address, workers["context"][0].address],
        [workers["generation"][0].address],
        health_check_interval_s=60,
        max_retries=1,
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        assert eventually_blocking(lambda: orch.orchestrator.context_pool.workers[0].healthy)
        victim.kill()
        # round_robin starts at the victim.
        got = run_request(orch.client(), "chat", False)
        assert got == reference(workers, "chat", False)
        assert orch.metric("fastcore_orchestrator_retries_total", leg="context") == 1
        assert not orch.orchestrator.context_pool.workers[0].healthy
        assert run_request(orch.client(), "completions", True) == reference(workers, "completions", True)
    finally:
        orch.stop()
        victim.stop()


def test_all_workers_down_is_503_at_once(loop_thread):
    config = make_config(
        [f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"], health_check_interval_s=0.2
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        time.sleep(0.5)
        status, body = http_get(orch.url + "/health")
        assert status == 503 and b"context" in body
        started = time.monotonic()
        status, data = http_post(
            orch.url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        )
        assert status == 503 and data["error"]["type"] == "service_unavailable"
        assert data["error"]["code"] == "no_healthy_worker"
        # One condition, one answer: /v1/models with no healthy worker reads the same.
        status, models = http_get(orch.url + "/v1/models")
        assert status == 503 and json.loads(models)["error"]["code"] == "no_healthy_worker"
        with pytest.raises(openai.InternalServerError):
            orch.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True)
        # Workers the orchestrator still thinks are up, but are not: 502, no hang.
        for worker in orch.orchestrator.context_pool.workers + orch.orchestrator.generation_pool.workers:
            worker.healthy = True
        status, data = http_post(
            orch.url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        )
        assert status in (502, 503)
        assert time.monotonic() - started < 10
        assert http_get(orch.url + "/v1/models")[0] == 503
    finally:
        orch.stop()


def test_generation_worker_killed_mid_stream(workers, loop_thread):
    victim = WorkerProcess("generation").wait()
    config = make_config(
        [workers["context"][0].address], [victim.address, workers["generation"][1].address], relay="fast"
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        # /health is 200 once each pool has one worker up; this test needs the victim up too.
        assert eventually_blocking(lambda: orch.orchestrator.generation_pool.workers[0].healthy)
        client = orch.client()
        stream = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1500, temperature=0.0, stream=True
        )
        received = 0
        with pytest.raises(openai.APIError) as info:
            for _chunk in stream:
                received += 1
                if received == 2:
                    victim.kill()  # round_robin sent this request to the victim
        assert received >= 2
        assert eventually_blocking(
            lambda: (
                orch.metric("fastcore_orchestrator_requests_total", route="completions", status="502") == 1
            )
        )
        assert "mid-stream" in str(info.value) or "failed" in str(info.value)
        assert http_get(orch.url + "/health")[0] == 200
        assert run_request(client, "completions", True) == reference(workers, "completions", True)
        assert eventually_blocking(lambda: orch.orchestrator.generation_pool.workers[1].in_flight == 0)
    finally:
        orch.stop()
        victim.stop()


def worker_metric(worker: WorkerProcess, sample: str) -> float:
    status, body = http_get(worker.url + "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_cancels_the_generation_leg(workers, orchestrators, loop_thread):
    orch = orchestrators["fast_gates_on"]
    body = json.dumps(
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    ).encode()
    finished = 'fastcore_worker_request_seconds_count{route="completions"}'
    finished_before = sum(worker_metric(w, finished) for w in workers["generation"])

    async def read_two_chunks_then_leave() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(orch.url + "/v1/completions", data=body) as resp:
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")
                await resp.content.readuntil(b"\n\n")
                resp.close()  # drop the connection mid-stream

    before = orch.metric("fastcore_orchestrator_requests_total", route="completions", status="499")
    asyncio.run(read_two_chunks_then_leave())
    pools = orch.orchestrator.generation_pool.workers + orch.orchestrator.context_pool.workers
    assert eventually_blocking(lambda: orch.orchestrator.in_flight == 0 and all(w.in_flight == 0 for w in pools))
    assert (
        orch.metric("fastcore_orchestrator_requests_total", route="completions", status="499") == before + 1
    )
    # The generation worker saw the cancel: its sequence left the batch without
    # running to 1500 tokens (the worker times only requests that complete).
    assert eventually_blocking(
        lambda: all(
            worker_metric(w, "fastcore_worker_running_sequences") == 0 for w in workers["generation"]
        ),
        timeout=30,
    )
    assert sum(worker_metric(w, finished) for w in workers["generation"]) == finished_before
    # The orchestrator serves on.
    assert run_request(orch.client(), "completions", False) == reference(workers, "completions", False)


@pytest.mark.parametrize("how", ["client_left", "generation_refused"])
def test_parked_kv_is_released_when_the_generation_leg_is_given_up(workers, loop_thread, how):
    # The generation "worker" never fetches: it answers 400 (a leg that failed), or
    # holds the request until the client leaves.
    proxy = RecordingProxy(
        loop_thread, workers["generation"][0].url,
        **({"fail_status": 400} if how == "generation_refused" else {"delay_s": 30.0}),
    )  # fmt: skip
    ctx = workers["context"][0]
    orch = RunningOrchestrator(loop_thread, make_config([ctx.address], [f"127.0.0.1:{proxy.port}"]))
    released = 'fastcore_worker_kv_handoff_total{event="released"}'
    try:
        wait_healthy(orch.url, timeout=30)
        before = worker_metric(ctx, released)
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8}).encode()
        if how == "generation_refused":
            assert http_post(orch.url + "/v1/completions", body)[0] == 400
        else:

            async def leave_during_the_generation_leg() -> None:
                async with aiohttp.ClientSession() as session:
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with asyncio.timeout(1.0):
                            await session.post(orch.url + "/v1/completions", data=body)

            asyncio.run(leave_during_the_generation_leg())
        # Signed (the workers have the secret): the release is accepted, and the KV freed
        # long before its TTL.
        assert eventually_blocking(lambda: worker_metric(ctx, released) == before + 1)
        # The worker counts before it answers; the orchestrator after it reads the answer.
        assert eventually_blocking(lambda: orch.metric("fastcore_orchestrator_kv_released_total", status="200") == 1)
    finally:
        orch.stop()
        proxy.stop()


# ---------------------------------------------------------------------------
# Health, models, metrics


def test_health_models_and_metrics(orchestrators):
    orch = orchestrators["fast_gates_on"]
    assert http_get(orch.url + "/health")[0] == 200
    status, body = http_get(orch.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"]
    run_request(orch.client(), "chat", True)
    status, body = http_get(orch.url + "/metrics")
    text = body.decode()
    assert status == 200
    for needle in (
        'fastcore_orchestrator_requests_total{route="chat",status="200"}',
        "fastcore_orchestrator_requests_in_flight ",
        'fastcore_orchestrator_worker_healthy{pool="generation"',
        'fastcore_orchestrator_cpu_seconds_count{phase="validate"}',
        'fastcore_orchestrator_cpu_seconds_count{phase="build_generation"}',
        'fastcore_orchestrator_cpu_seconds_count{phase="total"}',
        "fastcore_orchestrator_context_leg_seconds_count",
        "fastcore_orchestrator_handoff_seconds_count",
        "fastcore_orchestrator_generation_ttfb_seconds_count",
        "fastcore_orchestrator_retries_total",
    ):
        assert needle in text, needle


def test_health_is_503_until_every_pool_has_a_ready_worker(workers, loop_thread):
    config = make_config(
        [workers["context"][0].address], [f"127.0.0.1:{free_port()}"], health_check_interval_s=0.2
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        time.sleep(0.5)
        status, body = http_get(orch.url + "/health")
        assert status == 503 and b"generation" in body and b"context" not in body
        # The generation pool's worker comes up: the orchestrator follows.
        orch.orchestrator.generation_pool.workers[0].url = workers["generation"][0].url
        wait_healthy(orch.url, timeout=10)
    finally:
        orch.stop()


# ---------------------------------------------------------------------------
# Several orchestrator processes on one port


def test_orchestrator_from_yaml_with_two_processes_on_one_port(workers, tmp_path):
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
hostname: 127.0.0.1
port: 1                          # overridden by --port
gen_tokids_ctxbytes: true
gen_strip_message_history: true
max_retries: 1
request_timeout_s: 60
context_servers:
  router: {{type: round_robin}}
  urls: ["{workers["context"][0].address}", "{workers["context"][1].address}"]
generation_servers:
  router: {{type: least_loaded}}
  urls: ["{workers["generation"][0].address}", "{workers["generation"][1].address}"]
"""
    )
    argv = [
        sys.executable,
        "-m",
        "server.cli",
        "orchestrator",
        "-c",
        str(config),
        "--port",
        str(port),
        "--workers",
        "2",
    ]
    env = {**os.environ, "FASTCORE_SHARED_SECRET": SECRET}
    proc = subprocess.Popen(argv, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [proc], timeout=60)
        children = _children(proc.pid)
        assert len(children) >= 2, children
        client = _client(url)
        for _ in range(3):
            assert run_request(client, "chat", False) == reference(workers, "chat", False)
        # Fresh connections, which the kernel spreads over both processes.
        for _ in range(3):
            assert _client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # multiprocessing's resource tracker leaves once the parent's pipe closes.
        assert eventually_blocking(
            lambda: all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in children)
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ---------------------------------------------------------------------------
# Worker 5xx, garbage and silence


def _with_proxies(loop_thread, workers, context_proxy=None, generation_proxy=None, **overrides):
    context = [f"127.0.0.1:{context_proxy.port}"] if context_proxy else []
    generation = [f"127.0.0.1:{generation_proxy.port}"] if generation_proxy else []
    config = make_config(
        [*context, workers["context"][0].address],
        [*generation, workers["generation"][0].address],
        **overrides,
    )
    orch = RunningOrchestrator(loop_thread, config)
    wait_healthy(orch.url, timeout=30)
    assert eventually_blocking(lambda: all(w.healthy for p in orch.orchestrator.pools for w in p.workers), timeout=10)
    return orch


@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
def test_full_worker_503_is_retried_on_another_worker_of_each_leg(workers, loop_thread, mode):
    full_context = RecordingProxy(loop_thread, workers["context"][1].url, fail_status=503)
    full_generation = RecordingProxy(loop_thread, workers["generation"][1].url, fail_status=503)
    orch = _with_proxies(loop_thread, workers, full_context, full_generation, **MODES[mode])
    try:
        # round_robin tries the full proxy of each pool first.
        assert run_request(orch.client(), "chat", True) == reference(workers, "chat", True)
        assert len(full_context.bodies) == 1 and len(full_generation.bodies) == 1
        assert orch.metric("fastcore_orchestrator_retries_total", leg="context") == 1
        assert orch.metric("fastcore_orchestrator_retries_total", leg="generation") == 1
    finally:
        orch.stop()
        full_context.stop()
        full_generation.stop()


@pytest.mark.parametrize("leg", ["context", "generation"])
def test_worker_500_is_not_retried_and_is_502_naming_the_leg(workers, loop_thread, leg):
    # A 500 may be the body's doing: another worker would fail the same way.
    failing = RecordingProxy(loop_thread, workers[leg][1].url, fail_status=500)
    pools = {"context": [workers["context"][0].address], "generation": [workers["generation"][0].address]}
    pools[leg] = [f"127.0.0.1:{failing.port}", workers[leg][0].address]
    # context_fallback: fail: the context leg's error itself (tests/test_faults.py: the fallback).
    config = make_config(pools["context"], pools["generation"], max_retries=1, context_fallback="fail")
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        for stream in (True, False):
            with pytest.raises(openai.APIStatusError) as info:
                orch.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=stream)
            assert info.value.status_code == 502
            body = info.value.body
            assert isinstance(body, dict)
            error = body.get("error", body)  # the SDK hands over the error object itself
            assert error["message"] == f"the {leg} leg failed: its worker answered 500"
            assert error["code"] == f"{leg}_leg_failed"
            # Neither the worker's address nor its body reaches the client.
            assert str(failing.port) not in str(info.value.body) and "injected" not in str(info.value.body)
            # round_robin: the next request starts on the healthy worker; skip it.
            run_request(orch.client(), "chat", False)
        assert len(failing.bodies) == 2
        assert orch.metric("fastcore_orchestrator_retries_total", leg=leg) == 0
    finally:
        orch.stop()
        failing.stop()


@pytest.mark.parametrize("mode", ["parsed", "fast_gates_on"])
def test_malformed_context_response_is_502(workers, loop_thread, mode):
    garbage = RecordingProxy(loop_thread, workers["context"][0].url, garbage=b'{"choices": [{"index": 0,')
    # context_fallback: fail: the malformed answer's own 502. With the default the request falls back
    # to the generation worker (tests/test_faults.py), once the orchestrator has read that worker's
    # /server_info: whether it had yet made this test a race.
    config = make_config([f"127.0.0.1:{garbage.port}"], [workers["generation"][0].address], **MODES[mode],
                         context_fallback="fail")  # fmt: skip
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        status, data = http_post(
            orch.url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4}).encode()
        )
        assert status == 502 and "context worker response" in data["error"]["message"]
        # Valid JSON that is no completion: 502 too, never a 500.
        garbage.garbage = b'{"choices": []}'
        status, data = http_post(
            orch.url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4}).encode()
        )
        assert status == 502, data
    finally:
        orch.stop()
        garbage.stop()


@pytest.mark.parametrize("leg", ["context", "generation"])
def test_silent_worker_times_out_with_504(workers, loop_thread, leg):
    silent = RecordingProxy(loop_thread, workers[leg][0].url, delay_s=3.0)
    pools = {"context": [workers["context"][0].address], "generation": [workers["generation"][0].address]}
    pools[leg] = [f"127.0.0.1:{silent.port}"]
    config = make_config(
        pools["context"], pools["generation"], request_timeout_s=0.5, max_retries=1, context_fallback="fail"
    )
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        started = time.monotonic()
        status, data = http_post(
            orch.url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4}).encode()
        )
        assert (
            status == 504
            and data["error"]["message"] == f"the {leg} leg timed out after 0.5 s"
            and data["error"]["code"] == f"{leg}_leg_timeout"
            and str(silent.port) not in data["error"]["message"]
        )
        assert time.monotonic() - started < 3.0
        # A POST that may still be running is not sent again.
        assert len(silent.bodies) == 1
    finally:
        orch.stop()
        silent.stop()


def test_client_disconnect_during_the_context_leg_cancels_it(workers, loop_thread):
    # The proxy holds the context leg far longer than the test waits: only a cancel ends it in time.
    slow_context = RecordingProxy(loop_thread, workers["context"][0].url, delay_s=60.0)
    config = make_config([f"127.0.0.1:{slow_context.port}"], [workers["generation"][0].address])
    orch = RunningOrchestrator(loop_thread, config)
    try:
        wait_healthy(orch.url, timeout=30)
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}).encode()

        async def send_then_leave() -> None:
            # Leave once the context leg has reached the worker (a fixed wait raced a busy machine).
            async with aiohttp.ClientSession() as session:
                post = asyncio.ensure_future(session.post(orch.url + "/v1/completions", data=body))
                deadline = time.monotonic() + 30
                while not slow_context.bodies and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await post

        asyncio.run(send_then_leave())
        assert len(slow_context.bodies) == 1
        # The context leg is gone on both ends, long before the proxy would answer.
        assert eventually_blocking(lambda: slow_context.cancelled == 1, timeout=10)
        assert orch.orchestrator.context_pool.workers[0].in_flight == 0
        assert eventually_blocking(
            lambda: (
                orch.metric("fastcore_orchestrator_requests_total", route="completions", status="499") == 1
            )
        )
    finally:
        orch.stop()
        slow_context.stop()


def test_a_dead_orchestrator_process_is_reported_and_takes_the_rest_down(workers):
    port = free_port()
    argv = [
        sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port), "--workers", "2",
        "--context-urls", workers["context"][0].address, "--generation-urls", workers["generation"][0].address,
    ]  # fmt: skip
    env = {**os.environ, "FASTCORE_SHARED_SECRET": SECRET}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc], timeout=60)
        # The serving processes, not multiprocessing's resource tracker.
        servers = [pid for pid in _children(proc.pid) if b"spawn_main" in _cmdline(pid)]
        assert len(servers) == 2
        victim = servers[0]
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(30) == 1
        stderr = proc.stderr.read() if proc.stderr else ""
        assert f"(pid {victim}) exited with code -9" in stderr
        assert eventually_blocking(lambda: all(not os.path.exists(f"/proc/{p}") or _is_zombie(p) for p in servers))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
