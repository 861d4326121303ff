"""Orchestrators run in the test's process on an event-loop thread, and what a client sees of them, for
the end-to-end tests (test_orchestrator_functional against worker processes, test_trtllm_interop
against trtllm-serve stand-ins): every relay mode, its config, the requests both send.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import openai
from helpers import comparable_usage, free_port

from server.orchestrator.app import start_server
from server.orchestrator.config import OrchestratorConfig, build_config

SECRET = "functional-test-secret"
STARTUP_TIMEOUT_S = 180.0

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red, green, blue."},
    {"role": "user", "content": "And three fruits?"},
]
PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 8

# Every relay mode and gate combination clients must not be able to tell apart.
MODES: dict[str, dict[str, Any]] = {
    "parsed": {"relay": "parsed"},
    "parsed_gates_on": {"relay": "parsed", "gen_tokids_ctxbytes": True, "gen_strip_message_history": True},
    "parsed_msgpack": {"relay": "parsed-msgpack"},
    "parsed_msgpack_gates_on": {
        "relay": "parsed-msgpack",
        "gen_tokids_ctxbytes": True,
        "gen_strip_message_history": True,
    },
    "fast_gates_off": {"relay": "fast"},
    "fast_tokids": {"relay": "fast", "gen_tokids_ctxbytes": True},
    "fast_gates_on": {"relay": "fast", "gen_tokids_ctxbytes": True, "gen_strip_message_history": True},
}


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_healthy(
    url: str, procs: list[subprocess.Popen[bytes]] = (), timeout: float = STARTUP_TIMEOUT_S
) -> None:  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"process {proc.args} exited with {proc.returncode} while starting")
        try:
            status, body = http_get(url + "/health", timeout=2)
            # "ok", not "degraded": a 200 also means "no context worker yet, requests fall back to local
            # prefill" (context_fallback), and a test's first request would take the fallback path.
            if status == 200 and b'"status": "ok"' in body:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


class LoopThread:
    """An event loop on a thread, for servers that a blocking client talks to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RunningOrchestrator:
    def __init__(self, loop: LoopThread, config: OrchestratorConfig) -> None:
        self.loop = loop
        self.runner, self.orchestrator = loop.run(start_server(config))
        self.url = f"http://127.0.0.1:{config.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        metric = next(m for m in self.orchestrator.registry.metrics if m.name == name)
        return metric.get(**labels) if hasattr(metric, "get") else float(metric.count(**labels))  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.loop.run(self.runner.cleanup())


def make_config(context: list[str], generation: list[str], **overrides: Any) -> OrchestratorConfig:
    data: dict[str, Any] = {
        "port": free_port(),
        "shared_secret": SECRET,
        "health_check_interval_s": 0.5,
        "context_servers": {"urls": context},
        "generation_servers": {"urls": generation},
    }
    data.update(overrides)
    return build_config(data, environ={})


def run_request(
    client: openai.OpenAI, route: str, stream: bool, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """The client-visible result: text, finish reason and usage."""
    common: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0}
    if stream:
        common.update(stream=True, stream_options={"include_usage": True})
    if route == "chat":
        result = client.chat.completions.create(messages=MESSAGES, **common)
    else:
        result = client.completions.create(prompt=PROMPT, **common)
    if not stream:
        choice = result.choices[0]
        text = choice.message.content if route == "chat" else choice.text
        return {
            "text": text,
            "finish_reason": choice.finish_reason,
            "usage": comparable_usage(result.usage.model_dump()),
        }
    parts, finish, usage = [], None, None
    for chunk in result:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = choice.delta.content if route == "chat" else choice.text
            parts.append(piece or "")
            finish = choice.finish_reason or finish
    return {"text": "".join(parts), "finish_reason": finish, "usage": comparable_usage(usage)}
