"""Client APIs served by translation to chat completions (Anthropic's Messages, OpenAI's Responses).

An API whose requests can be said as a chat completion is served by translating the client's body
into one on the way in and the chat answer into the API's on the way out; in between the request
runs the orchestrator's chat path unchanged (both legs, routers, gates, admission, tenants, traces,
the callback path and the coroutine path alike). Nothing of it touches that path: a translated
route is looked up only after the chat routes missed (``Orchestrator.handle``), and the answer is
translated by :class:`ApiResponder`, which the chat path is handed in place of the client's
:class:`~server.http.Responder` and writes through as it would.

The contract. A module here defines one object (its ``API``) with:

``name``
    a short label (logs, docs).
``paths``
    the ``POST`` routes it serves, as bytes (``(b"/v1/messages",)``).
``credentials(request) -> bytes | None``
    the client key as an ``Authorization`` header value (``b"Bearer <key>"``) from whichever header
    the API uses (Anthropic's ``x-api-key``); checked against the tenants' keys (tenants.py) when
    keys are configured.
``to_chat(body: bytes, request, tenant: str) -> call``
    the client's body read and checked, raising :class:`~server.errors.HTTPError` (a 4xx whose
    ``param`` names the API's own field) for anything malformed; the call holds what the answer's
    translation needs (the model asked for, stop sequences, ...) and ``call.body``, the chat
    completions body (bytes) that the chat path then serves. A streamed request's chat body should
    ask ``stream_options.include_usage`` where the API's stream ends with usage.
``call.answer(chat: bytes) -> bytes``
    a whole chat completion (JSON bytes, internal fields already stripped) as the API's JSON
    answer; ``ValueError`` for a chat answer it cannot read (the client gets a 502).
``call.stream() -> translator``
    a stream translator: ``translator.feed(data: bytes) -> bytes`` is handed the chat SSE bytes as
    they arrive (pieces split anywhere: mid-event, mid-line, mid-UTF-8 character) and returns the
    API's SSE bytes ready so far (``b""`` for none); ``translator.flush() -> bytes`` at the end of
    the stream returns the rest (closing events). The in-band error the chat path writes when a
    worker fails mid-stream (``data: {"error": {...}}``) arrives through ``feed`` too.
``error_body(status, message, param, code) -> bytes``
    the API's error body for one of our errors (or a worker's, read out of its OpenAI shape).

Optional:

``bind(config) -> api``
    called once per orchestrator with its :class:`~server.orchestrator.config.OrchestratorConfig`: the API
    object that orchestrator serves with (state of its own, e.g. a store built from the config);
    without it the module's object serves as it is.
``prefixes: tuple[bytes, ...]`` and ``serve_other(request, tenant: str, ask: WorkerAsk) -> (status, body)``
    routes under a path prefix (``GET``/``DELETE /v1/responses/<id>``, ``POST /v1/messages/count_tokens``)
    answered after the key check with a JSON body (or an :class:`~server.errors.HTTPError` in the API's
    shape): at once, or by a coroutine returning ``(status, body)`` where the answer needs a worker
    (``await ask(path, body)``: a context worker's answer to a ``POST`` of its own, :class:`WorkerAsk`,
    within the tenant's admission: a slot and a request of its rate).
    They are looked up after every other route missed (:func:`answer_other`).

Registering: import the module's ``API`` below and add it to ``APIS``; its paths become routes
(:func:`bound_apis`, per orchestrator), listed by the 404's route list. Tests: a real orchestrator in front of scripted
synthetic workers and the API's official SDK (tests/test_api_anthropic.py shows how).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from server.errors import HTTPError
from server.http import Request, Responder, UpstreamError, UpstreamTimeout

from ..tenants import Tenant
from .anthropic import API as ANTHROPIC
from .responses import API as RESPONSES

_JSON = b"application/json"
_SSE = b"text/event-stream"


class StreamTranslator(Protocol):
    def feed(self, data: bytes) -> bytes: ...
    def flush(self) -> bytes: ...


class ApiCall(Protocol):
    body: bytes

    def answer(self, chat: bytes) -> bytes: ...
    def stream(self) -> StreamTranslator: ...


class ClientApi(Protocol):
    name: str
    paths: tuple[bytes, ...]

    def credentials(self, request: Request) -> bytes | None: ...
    def to_chat(self, body: bytes, request: Request, tenant: str) -> ApiCall: ...
    def error_body(self, status: int, message: str, param: str | None, code: str | None) -> bytes: ...


def chat_error(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an OpenAI-shaped error body (ours, or a worker's normalised one); its
    text when it is not one."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            param, code = error.get("param"), error.get("code")
            return (
                error["message"],
                param if isinstance(param, str) else None,
                code if isinstance(code, str) else None,
            )
    except (ValueError, AttributeError, RecursionError):
        pass
    return body[:2000].decode("utf-8", "replace"), None, None


class ApiResponder:
    """The client's :class:`~server.http.Responder` as the chat path sees it, the answer translated into
    the API's on the way: a whole answer (:meth:`send`), a stream (:meth:`start`, :meth:`write`,
    :meth:`end`), an error (:meth:`send_error`, or :meth:`send` of a non-200). Everything else is the
    client's responder's (held writes, backpressure, abort, done)."""

    __slots__ = ("api", "call", "out", "translator")

    def __init__(self, out: Responder, api: ClientApi, call: ApiCall) -> None:
        self.out = out
        self.api = api
        self.call = call
        self.translator: StreamTranslator | None = None

    # -- translated ------------------------------------------------------------------------------

    def send(self, status: int, body: bytes, content_type: bytes = _JSON, headers: bytes = b"") -> None:
        if status != 200:
            message, param, code = chat_error(body)
            self.out.send(status, self.api.error_body(status, message, param, code), _JSON, headers)
            return
        if content_type == _SSE:  # a context worker's finished answer, streamed whole (app.py)
            translator = self.call.stream()
            self.out.send(200, translator.feed(body) + translator.flush(), content_type, headers)
            return
        try:
            answer = self.call.answer(body)
        except ValueError as exc:
            message = f"the worker's answer could not be translated: {exc}"
            self.out.send(502, self.api.error_body(502, message, None, "bad_worker_answer"), _JSON)
            return
        self.out.send(200, answer, content_type, headers)

    def send_error(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: bytes = b"",
    ) -> None:
        self.out.send(status, self.api.error_body(status, message, param, code), _JSON, headers)

    def start(self, status: int, content_type: bytes, headers: bytes = b"") -> None:
        self.translator = self.call.stream()
        self.out.start(status, content_type, headers)

    def write(self, data: bytes | memoryview) -> None:
        translator = self.translator
        if translator is None:
            self.out.write(data)
            return
        translated = translator.feed(bytes(data))
        if translated:
            self.out.write(translated)

    def end(self) -> None:
        translator = self.translator
        if translator is not None and not self.out.finished:
            self.translator = None
            rest = translator.flush()
            if rest:
                self.out.write(rest)
        self.out.end()

    def send_pieces(
        self, status: int, pieces: Sequence[bytes | memoryview], content_type: bytes, headers: bytes = b""
    ) -> None:
        self.send(status, b"".join(pieces), content_type, headers)

    # -- the client's responder's --------------------------------------------------------------

    def hold(self) -> None:
        self.out.hold()

    def flush(self) -> None:
        self.out.flush()

    def abort(self) -> None:
        self.out.abort()

    def done(self) -> None:
        self.out.done()

    async def drain(self) -> None:
        await self.out.drain()

    @property
    def flow(self) -> Any:
        return self.out.flow

    @flow.setter
    def flow(self, flow: Any) -> None:
        self.out.flow = flow

    @property
    def keep_alive(self) -> bool:
        return self.out.keep_alive

    @keep_alive.setter
    def keep_alive(self, keep: bool) -> None:
        self.out.keep_alive = keep

    @property
    def closed(self) -> bool:
        return self.out.closed

    @property
    def paused(self) -> bool:
        return self.out.paused

    @property
    def peer(self) -> object:
        return self.out.peer

    @property
    def started(self) -> bool:
        return self.out.started

    @property
    def finished(self) -> bool:
        return self.out.finished

    @property
    def status(self) -> int:
        return self.out.status


class WorkerAsk:
    """What an API's other route may ask of a worker: ``await ask(path, body)`` POSTs ``body`` to a
    healthy context worker's ``path`` and returns its status and body (a count of tokens:
    ``/tokenize``; the orchestrator has no tokenizer); no healthy worker is the chat route's 503,
    a request that failed (refused, reset, timed out) a 502 naming the worker.

    With admission configured the ask is the tenant's short request (``Admission.slot(tenant,
    None)``): one of its ``requests_per_minute`` and an admission slot held while the worker answers
    (queued as a completion is, fair share and all), so that a tenant's asks take worker time within
    its limits; over them, admission's 429 with ``Retry-After`` (in the API's shape)."""

    #: a worker's answer read up to this (a count's ids of a long prompt: megabytes at most)
    MAX_ANSWER = 64 << 20

    __slots__ = ("orchestrator", "tenant")

    def __init__(self, orchestrator: Any, tenant: Tenant) -> None:
        self.orchestrator = orchestrator
        self.tenant = tenant

    async def __call__(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        admission = self.orchestrator.admission
        if admission is None:
            return await self._ask(path, body)
        async with admission.slot(self.tenant, None):
            return await self._ask(path, body)

    async def _ask(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        orchestrator = self.orchestrator
        worker = orchestrator.context_pool.choose()
        if worker is None:
            raise orchestrator._unavailable("no healthy context worker")
        try:
            resp = await orchestrator._upstream(worker).request(
                b"POST", path, (body,), timeout=orchestrator.config.request_timeout_s
            )
            try:
                return resp.status, await resp.read(self.MAX_ANSWER)
            finally:
                resp.release()
        except (UpstreamError, UpstreamTimeout) as exc:
            message = f"POST {path.decode()} to context worker {worker.url} failed: {exc}"
            raise HTTPError(502, message, code="context_leg_failed") from None


def answer_other(
    api: Any, request: Request, tenant: Tenant, orchestrator: Any, out: Responder
) -> Awaitable[None] | None:
    """An API's other route (``prefixes``) answered: at once (None), or the coroutine that answers it
    once the API's has its answer (a worker asked)."""
    try:
        answer = api.serve_other(request, tenant.name, WorkerAsk(orchestrator, tenant))
    except HTTPError as exc:
        _send_api_error(api, out, exc)
        return None
    if isinstance(answer, tuple):
        out.send(*answer)
        return None
    return _answer_later(api, answer, out)


async def _answer_later(api: Any, answer: Awaitable[tuple[int, bytes]], out: Responder) -> None:
    try:
        status, body = await answer
    except HTTPError as exc:
        _send_api_error(api, out, exc)
        return
    out.send(status, body)


def _send_api_error(api: Any, out: Responder, exc: HTTPError) -> None:
    out.send(
        exc.status, api.error_body(exc.status, exc.message, exc.param, exc.code), headers=exc.header_lines()
    )


#: every translated API (add a module's API here)
APIS: tuple[ClientApi, ...] = (ANTHROPIC, RESPONSES)


def bound_apis(config: Any) -> tuple[dict[bytes, ClientApi], tuple[tuple[bytes, Any], ...]]:
    """One orchestrator's APIs (each ``bind(config)`` where it has one): path -> API (its POST routes,
    looked up only after the chat routes missed) and (prefix, API) for their other routes."""
    routes: dict[bytes, ClientApi] = {}
    prefixes: list[tuple[bytes, Any]] = []
    for api in APIS:
        bind = getattr(api, "bind", None)
        served = bind(config) if bind is not None else api
        routes.update((path, served) for path in served.paths)
        prefixes += [(prefix, served) for prefix in getattr(served, "prefixes", ())]
    return routes, tuple(prefixes)


__all__ = [
    "APIS",
    "ApiCall",
    "ApiResponder",
    "ClientApi",
    "StreamTranslator",
    "WorkerAsk",
    "answer_other",
    "bound_apis",
    "chat_error",
]
