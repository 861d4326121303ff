"""Stand-in workers and an orchestrator in front of them, for the callback request path's tests.

Moved out of tests/test_exchange.py (which test_hostile_workers shares): worker stand-ins on
127.0.0.1 (port 0) that answer ``GET /health`` and ``/server_info``, a ``DELETE`` with a 404, and
their ``POST``s from a script (canned answers of ``bench``, a refusal, a 4xx, a 5xx, a reset,
silence, an answer held until the test lets it go, a stream cut); ``orchestrator`` in front of
them, every count checked back to zero on the way out; the raw client's requests and checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from helpers import StandInServer, eventually
from raw_http import Response, connected, post

from bench.orchestrator_work import context_response, generation_response
from bench.request_path import http, sse_answer
from bench.workload import chat_body
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import build_config

IDS = [random.Random(0).randrange(32000) for _ in range(250)]
CONTEXT_OK = http(b"200 OK", context_response(IDS, b64=True))
GENERATION_BODY = generation_response(len(IDS))
GENERATION_OK = http(b"200 OK", GENERATION_BODY)
STREAM_OK = sse_answer(4)
#: the SSE body of STREAM_OK (what a client reads of the relayed stream)
STREAM_EVENTS = STREAM_OK.split(b"\r\n\r\n", 1)[1]
EVENT = STREAM_EVENTS.split(b"\n\n", 1)[0] + b"\n\n"
ANSWER_TEXT = "The answer is short. " * 4
REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Length: 0\r\n\r\n"
BROKEN = http(b"500 Internal Server Error", b"oops")
TOO_LONG = "the prompt is longer than this worker's context window"
BAD = http(b"400 Bad Request", json.dumps({"error": {"message": TOO_LONG, "type": "invalid_request_error",
                                                      "param": "messages", "code": "too_long"}}).encode())  # fmt: skip
#: a stream's head and one event, then the connection closes (no last chunk)
CUT = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
)
EMPTY_STREAM = http(b"200 OK", b"", b"text/event-stream")


# -- stand-in workers -------------------------------------------------------------------------------

#: script entries other than bytes (written as they are, the connection kept)
DEFAULT, RESET, SILENT = "default", "reset", "silent"


class Hold:
    """Answer ``answer`` once ``release`` is set (meanwhile the test sees the request held); with
    ``head``, its head goes first and the rest once released (a body in a later read); with ``at``,
    its first ``at`` bytes."""

    def __init__(self, answer: bytes, *, head: bool = False, at: int = 0) -> None:
        self.answer = answer
        self.at = answer.index(b"\r\n\r\n") + 4 if head else at
        self.release = asyncio.Event()


class Cut:
    """Write ``data``, then close the connection (a FIN: a stream cut by its worker)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


Step = bytes | str | Hold | Cut


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def generation_default(body: bytes) -> bytes:
    """A generation worker's answer: the SSE stream when the leg streams, else the JSON answer."""
    return STREAM_OK if json.loads(body).get("stream") else GENERATION_OK


class StandIn(StandInServer):
    """A worker on 127.0.0.1: its POSTs are answered by ``script`` in turn, then by ``default``."""

    def __init__(self, *script: Step, default: Callable[[bytes], bytes] = lambda body: CONTEXT_OK) -> None:
        super().__init__()
        self.script = list(script)
        self.default = default
        #: the body of every POST, in order; the path of every DELETE (KV releases)
        self.posts: list[bytes] = []
        self.deletes: list[bytes] = []
        #: POSTs being held (a Hold not released yet, or SILENT)
        self.held = 0
        #: connections that carried a POST (the health checks have their own)
        self.leg_connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        legs = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ", 2)[:2]
            lengths = [int(h[15:]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            body = await reader.readexactly(lengths[0] if lengths else 0)
            if method == b"GET":
                writer.write(http(b"200 OK", b'{"status": "ok"}' if path.startswith(b"/health") else b"{}"))
                continue
            if method == b"DELETE":
                self.deletes.append(path)
                writer.write(http(b"404 Not Found", b'{"error": "nothing parked"}'))
                continue
            self.posts.append(body)
            legs += 1
            self.leg_connections += legs == 1
            step = self.script.pop(0) if self.script else DEFAULT
            if step == DEFAULT:
                writer.write(self.default(body))
            elif step == RESET:
                reset(writer)
                return
            elif step == SILENT:
                self.held += 1
                await asyncio.Event().wait()  # until the test ends (cancelled)
            elif isinstance(step, Hold):
                if step.at:
                    writer.write(step.answer[: step.at])
                    await writer.drain()
                self.held += 1
                await step.release.wait()
                self.held -= 1
                writer.write(step.answer[step.at :])
            elif isinstance(step, Cut):
                writer.write(step.data)
                await writer.drain()
                return
            else:
                assert isinstance(step, bytes)
                writer.write(step)


def generation(*script: Step) -> StandIn:
    return StandIn(*script, default=generation_default)


# -- the orchestrator ------------------------------------------------------------------------------


def released_everything(orch: Orchestrator) -> bool:
    """No completion in flight, every worker's counts back to zero, no breaker probe held."""
    return (
        orch.in_flight == 0
        and not orch._serving
        and all(
            w.in_flight == 0 and w.in_flight_tokens == 0 and not w.breaker.probing
            for p in orch.pools
            for w in p.workers
        )
    )


@asynccontextmanager
async def orchestrator(
    contexts: list[StandIn], generations: list[StandIn], **config: Any
) -> AsyncIterator[tuple[Orchestrator, int]]:
    """An orchestrator in front of the stand-ins (round robin: the first listed is tried first), all
    healthy; on the way out every count must be back (the answer read, whatever the path)."""
    data = {
        "port": 0,
        "context_servers": {"urls": [s.url for s in contexts], "router": {"type": "round_robin"}},
        "generation_servers": {"urls": [s.url for s in generations], "router": {"type": "round_robin"}},
        "health_check_interval_s": 3600,
        "gen_tokids_ctxbytes": True,
        "gen_strip_message_history": True,
        **config,
    }
    server, orch = await start_server(build_config(data, environ={}))
    try:
        assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers))
        yield orch, server.sockets[0].getsockname()[1]
        assert await eventually(lambda: released_everything(orch)), [
            (w.url, w.in_flight, w.in_flight_tokens, w.breaker.probing) for p in orch.pools for w in p.workers
        ]
    finally:
        await server.cleanup()


def completion(stream: bool = False) -> bytes:
    """A chat completion request (an agentic history, so the gates have history to strip)."""
    return post(b"/v1/chat/completions", chat_body(64, stream=stream),
                extra=b"Content-Type: application/json\r\n")  # fmt: skip


async def ask(port: int, *requests: bytes) -> list[Response]:
    """``requests`` written at once on one new connection; their responses, in order."""
    async with connected(port) as client:
        await client.send(b"".join(requests))
        return await client.responses(len(requests), timeout=30)


def error_of(resp: Response, status: int) -> dict[str, Any]:
    """An OpenAI-shaped error answer's ``error`` object."""
    assert resp.status == status, resp
    assert resp.header(b"content-type") == b"application/json", resp
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return dict(error)


def in_band_error(resp: Response) -> dict[str, Any]:
    """A stream's last event: the error its worker's failure put there (headers were gone)."""
    assert resp.status == 200 and resp.header(b"content-type") == b"text/event-stream", resp
    last = resp.body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), resp.body
    return dict(json.loads(last[6:])["error"])


def assert_answer(resp: Response, stream: bool) -> None:
    """The canned generation answer, relayed: the SSE events as the worker sent them, or the JSON."""
    assert resp.status == 200, resp
    if stream:
        assert resp.header(b"content-type") == b"text/event-stream"
        assert resp.body == STREAM_EVENTS
    else:
        assert resp.header(b"content-type") == b"application/json"
        assert resp.json()["choices"][0]["message"]["content"] == ANSWER_TEXT
