"""What the vLLM and SGLang stand-ins share: an aiohttp server, OpenAI answers, tokens, fault switches.

``tests/vllm_standin.py`` and ``tests/sglang_standin.py`` are prefill and decode
workers of those engines for tests without GPUs; this module holds what their
OpenAI surfaces have in common, so each of them is only its engine's rules
(which fields it models, which it refuses, how its legs meet). The answers'
shapes follow each engine's own response models (vLLM's
``vllm/entrypoints/openai`` protocol, SGLang's ``srt/entrypoints/openai/protocol.py``);
the engine-specific members are added by the subclass through ``extra_fields``.

Tokens: no model. Prompts are tokenized as a fastcore ``tiny`` worker does
(``trtllm_standin``'s tokenizer), output token ``i`` is
:func:`trtllm_standin.standin_token` ``(prompt_ids, i)``, so a decode leg that got
its prefill's KV answers exactly what one worker serving the request whole
answers, and a test can predict it. A decode leg whose KV was not its prompt's
(a lease that expired, a room that never came) answers other tokens
(:func:`garbage_tokens`), as a real engine reading wrong blocks would.

Fault switches (``fault``, settable at any time, for functional tests):
``"5xx"`` answers 500 in the engine's error shape, ``"stall"`` never answers
(the handler waits until the client goes or the stand-in stops), ``"reset"``
resets the connection (RST) before answering, ``"reset_mid_stream"`` sends the
head and the first event of a streamed answer, then resets.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from trtllm_standin import EOS_ID, TOKENIZER, detokenize, render_chat, standin_token

Route = Literal["chat", "completions"]
Fault = Literal["5xx", "stall", "reset", "reset_mid_stream"]
FAULTS = ("5xx", "stall", "reset", "reset_mid_stream")


def garbage_tokens(prompt_ids: Sequence[int], count: int) -> list[int]:
    """What a decode that read someone else's KV answers: the continuation of another prompt."""
    other = [*prompt_ids, 7]
    return [standin_token(other, i) for i in range(count)]


def expected_tokens(prompt_ids: Sequence[int], count: int, eos_at: int | None = None) -> list[int]:
    out: list[int] = []
    for i in range(count):
        out.append(EOS_ID if i == eos_at else standin_token(prompt_ids, i))
        if out[-1] == EOS_ID:
            break
    return out


def prompt_ids_of(route: Route, body: dict[str, Any]) -> list[int]:
    """The ids a worker computes from a validated body's messages or prompt (a string or one id list)."""
    if route == "chat":
        return render_chat(body["messages"], body.get("add_generation_prompt", True) is not False, False)
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TOKENIZER.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("stand-in: a batch of prompts is not implemented")


@dataclass
class Received:
    """One request as a stand-in saw it, for tests to inspect."""

    method: str
    path: str
    #: lower-cased names
    headers: dict[str, str]
    raw: bytes
    body: Any = None
    status: int | None = None
    #: top-level fields the engine's model does not know (vLLM logs and ignores them, SGLang drops them)
    ignored: list[str] = field(default_factory=list)
    #: what the leg did differently from the engine's PD protocol (bench/engine_protocols.py's rules)
    violations: list[str] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    #: decode legs: whether the KV it was handed was its own prompt's (None: no KV asked for)
    kv_match: bool | None = None
    response: Any = None
    sse: list[str] = field(default_factory=list)


class Refused(Exception):
    """An answer in the engine's error shape (a 4xx the engine gives, or its 500 on a failed transfer)."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type


@dataclass
class Answer:
    """What a leg answers: tokens from position 0, a finish reason, engine fields at the top level."""

    tokens: list[int]
    finish: str
    prompt_tokens: int
    top: dict[str, Any] = field(default_factory=dict)


class EngineStandin:
    """An engine's OpenAI server on 127.0.0.1: records, faults, answers; the subclass decides each leg."""

    engine = "engine"
    owned_by = "engine"
    known_paths: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")

    def __init__(self, *, model: str = "tiny", fault: Fault | None = None, strict: bool = True) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, not {fault!r}")
        self.model = model
        self.fault: Fault | None = fault
        #: refuse (400, naming the field) a leg that breaks the PD protocol; off, record it and go on
        self.strict = strict
        self.requests: list[Received] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._ids = itertools.count(1)
        self._waiting: set[asyncio.Future[None]] = set()

    # -- lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> int:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.add_routes(app)
        app.router.add_route("*", "/{tail:.*}", self._fallback)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        for waiter in list(self._waiting):
            waiter.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def received(self, path: str | None = None) -> list[Received]:
        return [r for r in self.requests if r.method == "POST" and (path is None or r.path == path)]

    @property
    def violations(self) -> list[str]:
        return [v for r in self.requests for v in r.violations]

    # -- what a subclass provides

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def error_body(self, message: str, status: int, err_type: str) -> dict[str, Any]:
        raise NotImplementedError

    async def serve(self, request: web.Request, rec: Received, route: Route) -> Answer:
        """Validate ``rec.body`` as the engine does and run the leg (raise :class:`Refused` to refuse)."""
        raise NotImplementedError

    def extra_fields(self, route: Route, stream_chunk: bool) -> dict[str, Any]:
        """Members the engine's answer has beside OpenAI's (per choice when ``stream_chunk``)."""
        return {}

    # -- plumbing

    def json(self, content: Any, status: int = 200) -> web.Response:
        return web.Response(body=json.dumps(content).encode(), status=status, content_type="application/json")

    def error(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
        return self.json(self.error_body(message, status, err_type), status)

    def _record(self, request: web.Request, raw: bytes) -> Received:
        headers = {k.lower(): v for k, v in request.headers.items()}
        rec = Received(method=request.method, path=request.path, headers=headers, raw=raw)
        self.requests.append(rec)
        return rec

    async def wait_forever(self) -> None:
        """Until the client goes (aiohttp cancels the handler) or the stand-in stops."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.add(waiter)
        try:
            await waiter
        finally:
            self._waiting.discard(waiter)

    async def reset(self, request: web.Request) -> None:
        """An RST, as a worker that died mid-request gives (SO_LINGER 0, then close)."""
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        await self.wait_forever()

    async def _fallback(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        if request.path in self.known_paths:
            return self.json({"detail": "Method Not Allowed"}, 405)
        return self.json({"detail": "Not Found"}, 404)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, route: Route) -> web.StreamResponse:
        rec = self._record(request, await request.read())
        if self.fault == "reset":
            await self.reset(request)
        if self.fault == "stall":
            await self.wait_forever()
        if self.fault == "5xx":
            return self._finish(rec, self.error("stand-in fault: 5xx", 500, "InternalServerError"))
        try:
            rec.body = json.loads(rec.raw)
        except ValueError as exc:
            return self._finish(rec, self.error(f"JSON decode error: {exc}", 400))
        if not isinstance(rec.body, dict):
            return self._finish(rec, self.error("the body must be a JSON object", 400))
        try:
            answer = await self.serve(request, rec, route)
        except Refused as exc:
            return self._finish(rec, self.error(exc.message, exc.status, exc.err_type))
        if rec.body.get("stream"):
            return await self._stream(request, rec, route, answer)
        return self._finish(rec, self.json(self._unary(rec.body, route, answer)))

    def _finish(self, rec: Received, answer: web.Response) -> web.Response:
        rec.status = answer.status
        if answer.body is not None:
            rec.response = json.loads(answer.body)  # type: ignore[arg-type]
        return answer

    def _usage(self, answer: Answer, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": answer.prompt_tokens,
            "total_tokens": answer.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        }

    def _unary(self, body: dict[str, Any], route: Route, answer: Answer) -> dict[str, Any]:
        text = detokenize(answer.tokens)
        n = next(self._ids)
        head = {"created": int(time.time()), "model": body.get("model") or self.model}
        if route == "chat":
            message = {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": answer.finish}
            out = {"id": f"chatcmpl-{uuid.uuid4().hex}-{n}", "object": "chat.completion", **head}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": answer.finish}
            out = {"id": f"cmpl-{uuid.uuid4().hex}-{n}", "object": "text_completion", **head}
        choice.update(self.extra_fields(route, stream_chunk=True))
        out["choices"] = [choice]
        out["usage"] = self._usage(answer, len(answer.tokens))
        out.update(self.extra_fields(route, stream_chunk=False))
        out.update(answer.top)
        return out

    async def _stream(
        self, request: web.Request, rec: Received, route: Route, answer: Answer
    ) -> web.StreamResponse:
        """SSE: (chat) a role chunk, a chunk a token, the finish on the last, usage when asked, [DONE]."""
        body = rec.body
        options = body.get("stream_options") or {}
        cid = f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if route == "chat" else "text_completion"
        head = {
            "id": cid,
            "object": obj,
            "created": int(time.time()),
            "model": body.get("model") or self.model,
        }
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        rec.status = 200

        async def send(payload: dict[str, Any]) -> None:
            text = json.dumps(payload)
            rec.sse.append(text)
            await out.write(f"data: {text}\n\n".encode())

        if route == "chat":
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await send({**head, "choices": [role]})
        for i, token in enumerate(answer.tokens):
            last = i == len(answer.tokens) - 1
            piece = detokenize([token])
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": answer.finish if last else None,
            }
            choice.update({"delta": {"content": piece}} if route == "chat" else {"text": piece})
            await send({**head, "choices": [choice]})
            if self.fault == "reset_mid_stream":
                await self.reset(request)  # after the first token's event: the client has started
            await asyncio.sleep(0)
        if options.get("include_usage"):
            await send({**head, "choices": [], "usage": self._usage(answer, len(answer.tokens))})
        rec.sse.append("[DONE]")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


class StandinsThread:
    """Stand-ins served from one event-loop thread, for blocking code (an orchestrator under test).

    A prefill and its decodes must share a loop (their KV plane's timers and
    futures are the loop's), so they are started together::

        with StandinsThread(lambda: start_pair()) as started:
            prefill, decode = started.value
    """

    def __init__(self, start: Callable[[], Awaitable[Any]]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="engine-standins")
        self._thread.start()
        self.value = self.run(start)

    def run(self, make: Callable[[], Awaitable[Any]], timeout: float = 30) -> Any:
        """``await make()`` on the stand-ins' loop, from this thread."""

        async def call() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def close(self) -> None:
        values = self.value if isinstance(self.value, (tuple, list)) else [self.value]

        async def stop_all() -> None:
            for standin in values:
                if isinstance(standin, EngineStandin):
                    await standin.stop()

        self.run(stop_all)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> StandinsThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_events(body: bytes) -> list[Any]:
    """The decoded ``data:`` payloads of an SSE body (``"[DONE]"`` kept as the string)."""
    out: list[Any] = []
    for event in body.decode().split("\n\n"):
        event = event.strip()
        if event.startswith("data:"):
            payload = event[len("data:") :].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def streamed_text(body: bytes, route: Route) -> str:
    """The text of a streamed answer, its pieces joined."""
    parts = []
    for event in iter_events(body):
        if isinstance(event, dict):
            for choice in event.get("choices", []):
                parts.append((choice["delta"].get("content") or "") if route == "chat" else choice["text"])
    return "".join(parts)


__all__ = [
    "FAULTS",
    "Answer",
    "EngineStandin",
    "Fault",
    "Received",
    "Refused",
    "Route",
    "StandinsThread",
    "expected_tokens",
    "garbage_tokens",
    "iter_events",
    "prompt_ids_of",
    "streamed_text",
]
