"""What translating a client API to chat completions costs the orchestrator per request, in process.

    python -m bench.api_translation                  # 1 KB and 160 KB of agentic history
    python -m bench.api_translation --sizes 250,40000
    python -m bench.api_translation --live 200       # and the live orchestrator's CPU per request

Each row is one request's synchronous work on the orchestrator's event loop (bench.orchestrator_work's
calls: the client body read, both legs built, the context answer read, the answer relayed; fast relay,
base64 ids, history stripped), for the chat route and for Anthropic's ``/v1/messages`` and OpenAI's
``/v1/responses`` (the same, plus the body translated to chat on the way in and the chat answer to the
API's on the way out: server/orchestrator/apis/). The Messages body is the chat body's history said in
Anthropic's blocks (tool calls as ``tool_use``, their results as ``tool_result``), the Responses body
in its items (``function_call`` and ``function_call_output``). The issue's target:
at most 2x the chat path's work at 160 KB.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import urllib.request
from typing import Any

from bench._timing import format_table, time_call
from bench.orchestrator_work import context_response, generation_response, one_request
from bench.workload import agentic_messages
from server.orchestrator.apis.anthropic import API as MESSAGES
from server.orchestrator.apis.responses import API as RESPONSES
from server.orchestrator.relay_modes import FastRelay


def messages_body(chat_messages: list[dict[str, Any]]) -> bytes:
    """The agentic chat history as a Messages request: system apart, each tool result a ``tool_result``
    answering a ``tool_use`` of the assistant turn before it."""
    system = [m["content"] for m in chat_messages if m["role"] == "system"]
    turns: list[dict[str, Any]] = []
    calls = 0
    for message in chat_messages:
        role, text = message["role"], message["content"]
        if role == "system":
            continue
        if role == "tool":
            calls += 1
            call_id = f"toolu_{calls}"
            turns.append(
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": call_id,
                            "name": "read_file",
                            "input": {"path": f"src/{calls}.py"},
                        }
                    ],
                }
            )
            turns.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call_id, "content": text}],
                }
            )
        else:
            turns.append({"role": role, "content": [{"type": "text", "text": text}]})
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "system": "\n".join(system),
        "messages": turns,
        "temperature": 0,
        "tools": [{"name": "read_file", "input_schema": {"type": "object"}}],
    }
    return json.dumps(body).encode()


def responses_body(chat_messages: list[dict[str, Any]]) -> bytes:
    """The agentic chat history as a Responses request: the system text as ``instructions``, each tool
    result a ``function_call_output`` answering the ``function_call`` item before it."""
    items: list[dict[str, Any]] = []
    calls = 0
    for message in chat_messages:
        role, text = message["role"], message["content"]
        if role == "system":
            continue
        if role == "tool":
            calls += 1
            call_id = f"call_{calls}"
            items.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "read_file",
                    "arguments": json.dumps({"path": f"src/{calls}.py"}),
                }
            )
            items.append({"type": "function_call_output", "call_id": call_id, "output": text})
        else:
            items.append({"type": "message", "role": role, "content": text})
    system = "\n".join(m["content"] for m in chat_messages if m["role"] == "system")
    body = {
        "model": "tiny",
        "max_output_tokens": 16,
        "instructions": system,
        "input": items,
        "temperature": 0,
        "tools": [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}],
    }
    return json.dumps(body).encode()


def responses_request(mode: Any, body: bytes, ctx: bytes, gen: bytes) -> bytes:
    call = RESPONSES.to_chat(body, None, "default")  # type: ignore[arg-type]
    return call.answer(one_request(mode, call.body, ctx, gen))


def chat_request(mode: Any, body: bytes, ctx: bytes, gen: bytes) -> bytes:
    return one_request(mode, body, ctx, gen)


def messages_request(mode: Any, body: bytes, ctx: bytes, gen: bytes) -> bytes:
    call = MESSAGES.to_chat(body, None)  # type: ignore[arg-type]
    return call.answer(one_request(mode, call.body, ctx, gen))


def run(sizes: list[int]) -> str:
    rows = []
    rng = random.Random(0)
    for n in sizes:
        history = agentic_messages(n)
        chat = json.dumps(
            {
                "model": "tiny",
                "messages": history,
                "max_tokens": 16,
                "temperature": 0,
                "tools": [
                    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
                ],
            }
        ).encode()
        anthropic = messages_body(history)
        ids = [rng.randrange(32000) for _ in range(n)]
        ctx, gen = context_response(ids, b64=True), generation_response(n)
        mode = FastRelay(tokids_b64=True, strip_history=True)
        base = time_call(functools.partial(chat_request, mode, chat, ctx, gen), min_time=0.3)
        translated = time_call(functools.partial(messages_request, mode, anthropic, ctx, gen), min_time=0.3)
        rows.append(
            [f"{n:,}", "chat completions", f"{len(chat) / 1e3:,.1f} KB", f"{base * 1e6:,.1f}", "1.0x"]
        )
        rows.append(
            [
                f"{n:,}",
                "messages (anthropic)",
                f"{len(anthropic) / 1e3:,.1f} KB",
                f"{translated * 1e6:,.1f}",
                f"{translated / base:,.2f}x",
            ]
        )
        openai = responses_body(history)
        translated = time_call(functools.partial(responses_request, mode, openai, ctx, gen), min_time=0.3)
        rows.append(
            [
                f"{n:,}",
                "responses (openai)",
                f"{len(openai) / 1e3:,.1f} KB",
                f"{translated * 1e6:,.1f}",
                f"{translated / base:,.2f}x",
            ]
        )
    return format_table(["prompt ids", "route", "client body", "µs / request", "vs chat"], rows)


def _post(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json", "x-api-key": "unused"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()


#: --live: how many turns the routes take (each a share of the N requests)
ROUNDS = 10


def run_live(sizes: list[int], requests: int) -> str:
    """The live orchestrator's CPU per request (both gates, synthetic workers: bench.deploy), one request
    at a time: the chat route vs /v1/messages and /v1/responses with the same history, the routes
    taking turns (:data:`ROUNDS`)."""
    from bench.deploy import Deployment

    rows = []
    for n in sizes:
        history = agentic_messages(n)
        chat = json.dumps({"model": "synthetic", "messages": history, "max_tokens": 16}).encode()
        anthropic = messages_body(history).replace(b'"model": "tiny"', b'"model": "synthetic"', 1)
        openai = responses_body(history).replace(b'"model": "tiny"', b'"model": "synthetic"', 1)
        routes = (
            ("chat completions", "/v1/chat/completions", chat),
            ("messages (anthropic)", "/v1/messages", anthropic),
            ("responses (openai)", "/v1/responses", openai),
        )
        spent = {path: 0.0 for _route, path, _body in routes}
        with Deployment("both-gates", prompt_tokens=n) as deployment:
            for _route, path, body in routes:
                for _ in range(10):  # warm-up
                    _post(deployment.url + path, body)
            # The routes take turns in ROUNDS rounds: a change of the machine's load during the run
            # (a shared machine's is the largest error here) falls on every route alike.
            for turn in range(ROUNDS):
                share = requests // ROUNDS + (turn < requests % ROUNDS)
                for _route, path, body in routes:
                    before = deployment.front_cpu_seconds()
                    for _ in range(share):
                        _post(deployment.url + path, body)
                    spent[path] += deployment.front_cpu_seconds() - before
        base = spent[routes[0][1]] / requests
        for route, path, body in routes:
            cpu = spent[path] / requests
            rows.append(
                [f"{n:,}", route, f"{len(body) / 1e3:,.1f} KB", f"{cpu * 1e6:,.0f}", f"{cpu / base:,.2f}x"]
            )
    return format_table(
        ["prompt ids", "route", "client body", "orchestrator CPU µs / request", "vs chat"], rows
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="250,40000", help="prompt ids per request (~4 bytes of history each)"
    )
    parser.add_argument(
        "--live",
        type=int,
        default=0,
        metavar="N",
        help="also N requests per route to a live orchestrator (its process's CPU)",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(run(sizes))
    if args.live:
        print()
        print(run_live(sizes, args.live))


if __name__ == "__main__":
    main()
