"""Agent clients against a whole local deployment as a user starts it (issue 39): ``fastcore-serve up
--model synthetic --tool-call-parser hermes --script FILE`` in a subprocess (a context and a generation
worker, the orchestrator with both gates on), then the official SDKs as an agent uses them: the
``openai`` SDK's chat completion with a tool call, the ``anthropic`` SDK's message and token count,
the ``openai`` SDK's Responses call; then Ctrl-C stops it all."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port, free_ports

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240.0
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAIN = "It is sunny in Paris."


def wait_up(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    seen: list[str] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if "fastcore-serve is up" in line:
            return
    raise AssertionError(f"up did not come up; exit code {proc.poll()}; output:\n{''.join(seen)}")


def test_the_sdks_of_agents_against_fastcore_serve_up(tmp_path: Path):
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    script = tmp_path / "answers.json"
    # each request takes the script's next answer (the context worker's turn; the generation worker goes
    # on with the answer its first token names)
    script.write_text(json.dumps([CALL, PLAIN, PLAIN, PLAIN]))
    port, base = free_port(), free_ports(2)
    argv = [sys.executable, "-m", "server.cli", "up", "--port", str(port), "--worker-base-port", str(base),
            "--model", "synthetic", "--tool-call-parser", "hermes", "--script", str(script)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, lines)
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        called = chat.chat.completions.create(model="synthetic", messages=ask, tools=[WEATHER])
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = claude.messages.create(model="synthetic", max_tokens=50, messages=ask)
        assert (message.stop_reason, [b.text for b in message.content]) == ("end_turn", [PLAIN])
        counted = claude.messages.count_tokens(model="synthetic", messages=ask)
        assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
        stopped = claude.messages.create(
            model="synthetic", max_tokens=50, messages=ask, stop_sequences=["sunny"]
        )
        assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == (
            "stop_sequence",
            "sunny",
            "It is ",
        )
        response = chat.responses.create(model="synthetic", input="Weather in Paris?", max_output_tokens=50)
        assert response.status == "completed" and response.output_text == PLAIN
        chat.close()
        claude.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:  # a failed assertion: stop it as Ctrl-C would, then for sure
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
