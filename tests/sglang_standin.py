"""A stand-in for SGLang's disaggregated prefill and decode servers, for tests without GPUs.

Written from SGLang's own code (read through the project's code index; nothing
imported or copied):

- The legs: ``python/sglang/srt/disaggregation/mini_lb.py`` sends the client's
  body to a prefill and a decode server at once with ``bootstrap_host`` (the
  prefill's host, IPv6 in brackets), ``bootstrap_port`` (its
  ``--disaggregation-bootstrap-port``) and ``bootstrap_room``
  (``random.randint(0, 2**63 - 1)``), answers the decode's answer and discards
  the prefill's.
- The request models (``python/sglang/srt/entrypoints/openai/protocol.py``):
  ``bootstrap_host: str | list[str]``, ``bootstrap_port: int | list[int | None]``,
  ``bootstrap_room: int | list[int]``; pydantic's default ``extra="ignore"``, so an
  unknown field is dropped without a word (``Received.ignored`` lists them here).
- How the legs meet (``disaggregation/prefill.py``, ``decode.py``, the
  backends' ``conn.py``): the decode bootstraps to the prefill's bootstrap
  server, sends where the KV must go and waits for it; the prefill computes,
  waits for its decode of the same room and pushes. A decode whose prefill never
  comes fails after ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s by default,
  ``python/sglang/srt/environ.py``) with a 500: "Decode transfer failed for
  request ... with exception KVTransferError(bootstrap_room=R): Request R timed
  out after Xs in KVPoll.WaitingForInput". A prefill whose decode never comes
  fails after ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s) the same way
  (``KVPoll.Bootstrapping``). A bootstrap address no prefill serves fails the
  decode at once.
- ``/server_info`` (and ``/get_server_info``): the server's arguments
  (``disaggregation_mode``, ``disaggregation_bootstrap_port``,
  ``disaggregation_transfer_backend``, ``model_path``, ``tp_size``, ``dp_size``, ...),
  ``internal_states`` and ``version``.

A request without the bootstrap fields is refused with a 400 naming the field
("bootstrap_room is required in PREFILL mode"), as recent SGLang does; earlier
releases failed an assertion in the prefill's scheduler instead.

``strict`` (on by default) refuses (400, "sglang stand-in (protocol)") a leg that
breaks mini_lb's rules (bench/engine_protocols.py: a room outside [0, 2^63), a
string where SGLang's lax pydantic would coerce one, ...); off, the stand-in
does what SGLang does and records the rule in ``Received.violations``.

Use (in a running loop)::

    plane = BootstrapPlane()
    prefill = await start_sglang("prefill", plane=plane)
    decode = await start_sglang("decode", plane=plane)
    # both get {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
    #           "bootstrap_room": room}
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from engine_standin import (
    Answer,
    EngineStandin,
    Fault,
    Received,
    Refused,
    Route,
    expected_tokens,
    prompt_ids_of,
)
from pydantic import BaseModel, ValidationError

from bench import engine_protocols as rules

Mode = Literal["prefill", "decode"]
#: python/sglang/srt/environ.py's defaults, seconds
WAITING_TIMEOUT_S = 300.0
BOOTSTRAP_TIMEOUT_S = 300.0
VERSION = "0.5.6-standin"
RoomKey = tuple[str, int, int]


class _SglangRequest(BaseModel):
    """The fields of SGLang's OpenAI requests a router touches; others are dropped (extra="ignore")."""

    model: str = "default"
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    response_format: dict[str, Any] | None = None
    lora_path: str | list[str | None] | None = None
    session_params: dict[str, Any] | None = None
    custom_params: dict[str, Any] | None = None
    rid: str | list[str] | None = None
    priority: int | None = None
    # For PD disaggregation
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    data_parallel_rank: int | None = None


class ChatCompletionRequest(_SglangRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "none"
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool = False


class CompletionRequest(_SglangRequest):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


@dataclass
class Room:
    """One bootstrap room: the prefill's prompt once it has computed it, the decode once it bootstrapped."""

    prefilled: asyncio.Future[list[int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    bootstrapped: asyncio.Event = field(default_factory=asyncio.Event)


class BootstrapPlane:
    """The bootstrap servers and rooms of one deployment, shared by its stand-ins (pass the same to each).

    ``rooms`` holds the rooms a side still waits on (a test's "0 rooms left
    waiting" is ``not plane.rooms``); ``ended`` maps each finished room to how it
    ended ("transferred", "decode timed out", "prefill timed out", "aborted").
    """

    def __init__(self) -> None:
        #: (host, bootstrap port) of every prefill server up
        self.servers: set[tuple[str, int]] = set()
        self.rooms: dict[RoomKey, Room] = {}
        self.ended: dict[RoomKey, str] = {}

    def room(self, key: RoomKey) -> Room:
        return self.rooms.setdefault(key, Room())

    def end(self, key: RoomKey, how: str) -> None:
        if self.rooms.pop(key, None) is not None:
            self.ended[key] = how


def _failed(room: int, elapsed: float, state: str, side: str) -> Refused:
    return Refused(
        f"{side} transfer failed for request rank=0 bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): Request {room} timed out after {elapsed:.1f}s in KVPoll.{state}",
        500,
        "InternalServerError",
    )


class SglangStandin(EngineStandin):
    """``python -m sglang.launch_server --disaggregation-mode prefill|decode`` on 127.0.0.1."""

    engine = "sglang"
    owned_by = "sglang"
    known_paths = (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/health_generate",
        "/server_info",
        "/get_server_info",
        "/get_model_info",
    )

    def __init__(
        self,
        mode: Mode,
        *,
        plane: BootstrapPlane | None = None,
        waiting_timeout_s: float = WAITING_TIMEOUT_S,
        bootstrap_timeout_s: float = BOOTSTRAP_TIMEOUT_S,
        context_length: int = 2048,
        model: str = "tiny",
        fault: Fault | None = None,
        strict: bool = True,
    ) -> None:
        super().__init__(model=model, fault=fault, strict=strict)
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be prefill or decode, not {mode!r}")
        self.mode: Mode = mode
        self.plane = plane if plane is not None else BootstrapPlane()
        self.waiting_timeout_s = waiting_timeout_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.context_length = context_length
        self.bootstrap_port = 0
        self._bootstrap: asyncio.Server | None = None

    async def start(self, port: int = 0) -> int:
        await super().start(port)
        if self.mode == "prefill":
            # The bootstrap server listens on its own port (--disaggregation-bootstrap-port).
            self._bootstrap = await asyncio.start_server(self._bootstrap_conn, "127.0.0.1", 0)
            self.bootstrap_port = self._bootstrap.sockets[0].getsockname()[1]
            self.plane.servers.add(("127.0.0.1", self.bootstrap_port))
        return self.port

    async def stop(self) -> None:
        if self._bootstrap is not None:
            self.plane.servers.discard(("127.0.0.1", self.bootstrap_port))
            self._bootstrap.close()
            await self._bootstrap.wait_closed()
            self._bootstrap = None
        await super().stop()

    async def _bootstrap_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    # -- routes SGLang serves beside generation

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/get_model_info", self._model_info)

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.model,
            "max_model_len": self.context_length,
        }
        return self.json({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return web.Response(status=200)

    def server_info(self) -> dict[str, Any]:
        """What /server_info answers: the server's arguments, then its state and version."""
        return {
            "model_path": self.model,
            "tokenizer_path": self.model,
            "served_model_name": self.model,
            "host": "127.0.0.1",
            "port": self.port,
            "context_length": self.context_length,
            "tp_size": 1,
            "dp_size": 1,
            "page_size": 1,
            "enable_dp_attention": False,
            "load_balance_method": "round_robin",
            "disaggregation_mode": self.mode,
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": self.bootstrap_port or 8998,
            "disaggregation_ib_device": None,
            "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
            "version": VERSION,
        }

    async def _server_info(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return self.json(self.server_info())

    async def _model_info(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return self.json({"model_path": self.model, "tokenizer_path": self.model, "is_generation": True})

    def error_body(self, message: str, status: int, err_type: str) -> dict[str, Any]:
        """SGLang's ErrorResponse: flat, with "object": "error"."""
        return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}

    def extra_fields(self, route: Route, stream_chunk: bool) -> dict[str, Any]:
        return {"matched_stop": None} if stream_chunk else {}

    # -- one leg

    def _validate(self, route: Route, body: dict[str, Any], rec: Received) -> _SglangRequest:
        model = ChatCompletionRequest if route == "chat" else CompletionRequest
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise Refused(f"{where}: {first['msg']}") from None
        rec.ignored = sorted(set(body) - set(model.model_fields))
        for name in rules.SGLANG_BOOTSTRAP_FIELDS:
            if getattr(req, name) is None:
                raise Refused(f"{name} is required in {self.mode.upper()} mode")
        problems = rules.check_sglang(body)
        rec.violations += problems
        if problems and self.strict:
            raise Refused("sglang stand-in (protocol): " + "; ".join(problems))
        if isinstance(req.bootstrap_room, list) or req.n != 1:
            raise Refused("sglang stand-in: batches and n != 1 are not implemented")
        return req

    async def serve(self, request: web.Request, rec: Received, route: Route) -> Answer:
        req = self._validate(route, rec.body, rec)
        chat = route == "chat"
        cap = rules.effective_max_tokens(rec.body, chat)
        cap = 16 if cap is None else cap
        if cap < 1:
            raise Refused(f"max_new_tokens must be at least 1, got {cap}.")
        ids = prompt_ids_of(route, rec.body)
        if len(ids) >= self.context_length:
            raise Refused(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_length} tokens)."
            )
        rec.prompt_ids = ids
        key: RoomKey = (str(req.bootstrap_host), int(req.bootstrap_port), int(req.bootstrap_room))  # type: ignore[arg-type]
        if self.mode == "prefill":
            await self._prefill(key, ids)
            return Answer(expected_tokens(ids, 1), "length", len(ids))
        await self._decode(key, ids, rec)
        tokens = expected_tokens(ids, cap)
        return Answer(tokens, "stop" if len(tokens) < cap else "length", len(ids))

    async def _prefill(self, key: RoomKey, ids: list[int]) -> None:
        """Compute, then wait for the room's decode to bootstrap and push the KV to it."""
        if key[:2] not in self.plane.servers or key[1] != self.bootstrap_port:
            raise Refused(f"bootstrap_port {key[1]} is not this prefill's ({self.bootstrap_port})")
        room = self.plane.room(key)
        if not room.prefilled.done():
            room.prefilled.set_result(ids)
        started = time.monotonic()
        try:
            await asyncio.wait_for(room.bootstrapped.wait(), self.bootstrap_timeout_s)
        except TimeoutError:
            self.plane.end(key, "prefill timed out")
            raise _failed(key[2], time.monotonic() - started, "Bootstrapping", "Prefill") from None
        except asyncio.CancelledError:
            self.plane.end(key, "aborted")
            raise

    async def _decode(self, key: RoomKey, ids: list[int], rec: Received) -> None:
        """Bootstrap to the prefill's server, then wait for the room's KV (bounded, as SGLang's)."""
        if key[:2] not in self.plane.servers:
            raise Refused(
                f"Could not fetch prefill parallel info from bootstrap_addr: {key[0]}:{key[1]}",
                500,
                "InternalServerError",
            )
        room = self.plane.room(key)
        room.bootstrapped.set()
        started = time.monotonic()
        try:
            prefill_ids = await asyncio.wait_for(asyncio.shield(room.prefilled), self.waiting_timeout_s)
        except TimeoutError:
            self.plane.end(key, "decode timed out")
            raise _failed(key[2], time.monotonic() - started, "WaitingForInput", "Decode") from None
        except asyncio.CancelledError:
            self.plane.end(key, "aborted")  # a prefill that comes now waits for a decode that is gone
            raise
        rec.kv_match = prefill_ids == ids
        if not rec.kv_match:
            problem = f"bootstrap_room {key[2]}: the prefill computed another prompt"
            rec.violations.append(problem)
            if self.strict:
                raise Refused("sglang stand-in (protocol): " + problem)
        self.plane.end(key, "transferred")


async def start_sglang(mode: Mode, **options: Any) -> SglangStandin:
    """A started SGLang stand-in on 127.0.0.1 (``.url``, ``.bootstrap_port``, ``.plane``) in the running loop."""
    standin = SglangStandin(mode, **options)
    await standin.start()
    return standin


__all__ = [
    "BOOTSTRAP_TIMEOUT_S",
    "WAITING_TIMEOUT_S",
    "BootstrapPlane",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Room",
    "SglangStandin",
    "start_sglang",
]
