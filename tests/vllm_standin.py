"""A stand-in for ``vllm serve`` as a disaggregated prefill or decode worker, for tests without GPUs.

Both of vLLM's P/D connectors, with the request and answer fields written from
vLLM's own code (read through the project's code index; nothing imported or
copied):

- NixlConnector (sequential, the decode pulls): the legs of
  ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``; the prefill's
  answer carries ``kv_transfer_params`` as
  ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``'s
  ``request_finished`` returns it (``do_remote_prefill: true``,
  ``do_remote_decode: false``, ``remote_block_ids``, ``remote_engine_id``,
  ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size`` and the
  newer ``dcp_size``, ``pp_size``, ``remote_num_tokens``,
  ``remote_blocks_expiry_time``, ``transfer_mode``); the blocks are held under a
  lease (``kv_lease_duration``, 30 s by default) until a decode reads them.
- MooncakeConnector (the prefill pushes; the legs may run at once):
  ``.../v1/mooncake/mooncake_connector.py`` (the prefill needs a router-minted
  ``transfer_id``, the decode ``remote_engine_id``, ``remote_bootstrap_addr`` and
  ``transfer_id``; the prefill answers no ``kv_transfer_params``) and the example
  proxy ``examples/online_serving/disaggregated_serving/mooncake_connector/``
  (the engine id is read from the bootstrap server's ``GET /query``).

What vLLM does where the protocol is broken, and so what this stand-in does:

- Unknown top-level fields are accepted and ignored (vLLM's ``OpenAIBaseModel``
  is ``extra="allow"`` and logs them); they are listed in ``Received.ignored``.
- A decode whose ``kv_transfer_params`` lacks a field its connector needs logs
  "Got invalid KVTransferParams ... will not utilize KVTransfer" and computes
  the prompt itself (the prefill's blocks stay held until the lease ends).
- A NIXL decode that reads blocks whose lease ended, or that were read before,
  gets no error: the prefill only logs "Potentially invalid KV blocks for
  unrecognized request ... were retrieved by a decode worker. They may have
  expired." (``nixl/worker.py``), and the decode computes from whatever the blocks hold. The
  stand-in answers other tokens (``kv_match`` False).
- A transfer that fails (no such prefill engine; a Mooncake push that never
  comes within ``transfer_timeout_s``) fails the request under vLLM's default
  ``kv_load_failure_policy: "fail"``: a 500 here.

``strict`` (on by default) turns each broken protocol rule (bench/engine_protocols.py)
into a 400 whose message starts "vllm stand-in (protocol)" and names the field,
so a test fails at the leg that broke it; off, the stand-in does what vLLM does
and records the rule in ``Received.violations``.

Use (in a running loop)::

    plane = KVPlane()
    prefill = await start_vllm("prefill", plane=plane)
    decode = await start_vllm("decode", plane=plane)
"""

from __future__ import annotations

import asyncio
import time
import uuid
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
    garbage_tokens,
    prompt_ids_of,
)
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from bench import engine_protocols as rules

Role = Literal["prefill", "decode", "both"]
Connector = Literal["nixl", "mooncake"]
#: vLLM's defaults: VLLM_NIXL_SIDE_CHANNEL_PORT, kv_lease_duration
NIXL_SIDE_CHANNEL_PORT = 5600
KV_LEASE_S = 30.0
VERSION = "0.11.0-standin"


# ---------------------------------------------------------------------------
# vLLM's request models: the fields a router touches typed as vLLM types them, the rest by name


class _VllmModel(BaseModel):
    """vLLM's OpenAIBaseModel: unknown fields allowed (and logged, here recorded)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return data


class ChatCompletionRequest(_VllmModel):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("top_logprobs") and not data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return data


class CompletionRequest(_VllmModel):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _prompt(self) -> CompletionRequest:
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return self


def validate(route: Route, body: dict[str, Any]) -> tuple[_VllmModel, list[str]]:
    """The body as vLLM's model takes it, and the fields it ignores; a 400 naming the field when refused."""
    model = ChatCompletionRequest if route == "chat" else CompletionRequest
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise Refused(f"{where}: {first['msg']}") from None
    return req, sorted(set(body) - set(model.model_fields))


def sampling_checks(req: _VllmModel, cap: int) -> None:
    """vLLM's SamplingParams refusals (ValueErrors, so 400s)."""
    if cap < 1:
        raise Refused(f"max_tokens must be at least 1, got {cap}.")
    if req.min_tokens > cap:
        raise Refused(f"min_tokens must be less than or equal to max_tokens={cap}, got {req.min_tokens}.")
    if req.n not in (None, 1):
        raise Refused("vllm stand-in: n != 1 is not implemented")


# ---------------------------------------------------------------------------
# The KV plane: what passes between a prefill and a decode stand-in outside HTTP


@dataclass
class Held:
    """Blocks a prefill holds for a decode: a NIXL lease or a Mooncake push waiting to go."""

    engine_id: str
    prompt_ids: list[int]
    x_request_id: str | None
    block_ids: list[int] = field(default_factory=list)
    bootstrap_addr: str | None = None
    timer: asyncio.TimerHandle | None = None


class KVPlane:
    """The engines' side channel, shared by the stand-ins of one deployment (pass the same to each).

    ``held`` is what prefills hold now (a test's "0 KV left waiting" is
    ``not plane.held``); ``released`` receives ``(key, why)`` as each is let go
    ("read", "expired", "aborted"), so a test can await a lease's end.
    """

    def __init__(self) -> None:
        #: engine_id -> (host, side-channel port) or the Mooncake bootstrap address
        self.engines: dict[str, tuple[str, int] | str] = {}
        self.held: dict[str, Held] = {}
        #: keys let go before, and why, to tell a reused id from an unknown one
        self.gone: dict[str, str] = {}
        self.released: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        #: decodes waiting for a push that has not come yet (Mooncake's legs run at once)
        self.waiting: dict[str, asyncio.Future[Held]] = {}
        self._blocks = 0

    def hold(self, key: str, held: Held, lease_s: float) -> None:
        self._blocks += 1
        held.block_ids = [self._blocks]
        held.timer = asyncio.get_running_loop().call_later(lease_s, self.release, key, "expired")
        self.held[key] = held
        waiter = self.waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(held)

    async def pushed(self, key: str) -> Held:
        """The blocks held under ``key``, once a prefill holds them."""
        held = self.held.get(key)
        if held is not None:
            return held
        waiter = self.waiting.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.shield(waiter)
        finally:
            if self.waiting.get(key) is waiter and not waiter.done():
                del self.waiting[key]

    def release(self, key: str, why: str) -> Held | None:
        held = self.held.pop(key, None)
        if held is None:
            return None
        if held.timer is not None:
            held.timer.cancel()
        self.gone[key] = why
        self.released.put_nowait((key, why))
        return held


# ---------------------------------------------------------------------------
# The server


class VllmStandin(EngineStandin):
    """``vllm serve`` with a KV connector: role "prefill" (kv_producer), "decode" (kv_consumer) or "both".

    Args:
        connector: "nixl" or "mooncake".
        plane: the :class:`KVPlane` a prefill and its decodes share.
        lease_s: NIXL's ``kv_lease_duration`` (and how long a Mooncake prefill holds blocks).
        transfer_timeout_s: how long a Mooncake decode waits for its push.
        max_model_len: prompts this long or longer are refused, as vLLM refuses them.
    """

    engine = "vllm"
    owned_by = "vllm"
    known_paths = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version")

    def __init__(
        self,
        role: Role = "both",
        *,
        connector: Connector = "nixl",
        plane: KVPlane | None = None,
        engine_id: str | None = None,
        lease_s: float = KV_LEASE_S,
        transfer_timeout_s: float = 30.0,
        max_model_len: int = 2048,
        eos_at: int | None = None,
        model: str = "tiny",
        fault: Fault | None = None,
        strict: bool = True,
    ) -> None:
        super().__init__(model=model, fault=fault, strict=strict)
        if role not in ("prefill", "decode", "both") or connector not in ("nixl", "mooncake"):
            raise ValueError(f"role {role!r} / connector {connector!r} unknown")
        self.role: Role = role
        self.connector: Connector = connector
        self.plane = plane if plane is not None else KVPlane()
        self.engine_id = engine_id or f"standin-{uuid.uuid4()}"
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        self.max_model_len = max_model_len
        self.eos_at = eos_at
        self.healthy = True
        self.bootstrap_port = 0
        self._bootstrap: web.AppRunner | None = None

    @property
    def bootstrap_addr(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap_port}"

    async def start(self, port: int = 0) -> int:
        await super().start(port)
        if self.role == "prefill" and self.connector == "mooncake":
            # MooncakeBootstrapServer: the proxy reads the engine ids per DP rank from GET /query.
            app = web.Application()
            app.router.add_get("/query", self._query)
            self._bootstrap = web.AppRunner(app)
            await self._bootstrap.setup()
            await web.TCPSite(self._bootstrap, "127.0.0.1", 0).start()
            self.bootstrap_port = int(self._bootstrap.addresses[0][1])
            self.plane.engines[self.engine_id] = self.bootstrap_addr
        elif self.role == "prefill":
            self.plane.engines[self.engine_id] = ("127.0.0.1", NIXL_SIDE_CHANNEL_PORT)
        return self.port

    async def stop(self) -> None:
        if self._bootstrap is not None:
            await self._bootstrap.cleanup()
            self._bootstrap = None
        self.plane.engines.pop(self.engine_id, None)
        await super().stop()

    # -- routes vLLM serves beside generation

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return self.json({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return web.Response(status=200 if self.healthy else 503)

    async def _version(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return self.json({"version": VERSION})

    async def _query(self, request: web.Request) -> web.Response:
        return self.json({self.engine_id: {"0": {"host": "127.0.0.1"}}})

    def error_body(self, message: str, status: int, err_type: str) -> dict[str, Any]:
        """vLLM's ErrorResponse: the error nested under "error"."""
        return {"error": {"message": message, "type": err_type, "param": None, "code": status}}

    def extra_fields(self, route: Route, stream_chunk: bool) -> dict[str, Any]:
        if stream_chunk:
            return {"stop_reason": None}
        return {
            "service_tier": None,
            "system_fingerprint": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": None,
        }

    # -- one leg

    def protocol(self, rec: Received, problems: list[str]) -> None:
        """A broken PD rule: recorded; in strict mode refused (400) naming it."""
        rec.violations += problems
        if problems and self.strict:
            raise Refused("vllm stand-in (protocol): " + "; ".join(problems))

    async def serve(self, request: web.Request, rec: Received, route: Route) -> Answer:
        req, rec.ignored = validate(route, rec.body)
        chat = route == "chat"
        cap = rules.effective_max_tokens(rec.body, chat)
        cap = 16 if cap is None else cap
        sampling_checks(req, cap)
        ids = prompt_ids_of(route, rec.body)
        if len(ids) >= self.max_model_len:
            raise Refused(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {len(ids)} input tokens."
            )
        rec.prompt_ids = ids
        ktp = req.kv_transfer_params or {}
        if self.role == "prefill":
            return self._prefill(rec, chat, ids, cap, ktp)
        if self.role == "decode" and ktp.get("do_remote_prefill"):
            return await self._decode(rec, ids, cap, ktp)
        if self.role == "decode" and ktp:
            self.protocol(rec, [f"a decode worker got kv_transfer_params={ktp!r}"[:200]])
        return Answer(expected_tokens(ids, cap, self.eos_at), self._finish_reason(ids, cap), len(ids))

    def _finish_reason(self, ids: list[int], cap: int) -> str:
        return "stop" if len(expected_tokens(ids, cap, self.eos_at)) < cap else "length"

    def _prefill(self, rec: Received, chat: bool, ids: list[int], cap: int, ktp: dict[str, Any]) -> Answer:
        self.protocol(rec, rules.check_vllm_prefill(rec.body, chat, self.connector))
        tokens = expected_tokens(ids, cap, self.eos_at)
        answer = Answer(tokens, self._finish_reason(ids, cap), len(ids))
        if not ktp.get("do_remote_decode"):
            return answer  # served whole, as vLLM serves it; the violation is recorded above
        xid = rec.headers.get("x-request-id")
        if self.connector == "mooncake":
            # request_finished returns no params: the decode comes with the router's transfer_id.
            key = str(ktp.get("transfer_id"))
            held = Held(self.engine_id, ids, xid, bootstrap_addr=self.bootstrap_addr)
            self.plane.hold(key, held, self.lease_s)
            answer.top["kv_transfer_params"] = None
            return answer
        # vLLM's internal request id: the route's prefix, X-Request-Id, and a random suffix.
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{xid or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"
        held = Held(self.engine_id, ids, xid)
        self.plane.hold(rid, held, self.lease_s)
        answer.top["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [held.block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": "127.0.0.1",
            "remote_port": NIXL_SIDE_CHANNEL_PORT,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(ids),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        return answer

    async def _decode(self, rec: Received, ids: list[int], cap: int, ktp: dict[str, Any]) -> Answer:
        problems = rules.check_vllm_decode(rec.body, self.connector)
        self.protocol(rec, problems)
        if problems:  # "will not utilize KVTransfer": the decode computes the prompt itself
            return Answer(expected_tokens(ids, cap, self.eos_at), self._finish_reason(ids, cap), len(ids))
        if self.connector == "mooncake":
            held = await self._mooncake_pull(rec, ktp)
        else:
            held = self._nixl_pull(rec, ktp)
        rec.kv_match = held is not None and held.prompt_ids == ids
        if held is not None and not rec.kv_match:
            self.protocol(rec, ["the decode's prompt is not the one its prefill computed"])
        if not rec.kv_match:
            return Answer(garbage_tokens(ids, cap), "length", len(ids))
        return Answer(expected_tokens(ids, cap, self.eos_at), self._finish_reason(ids, cap), len(ids))

    def _engine_or_fail(self, engine_id: Any, where: Any) -> None:
        """The handshake: a prefill engine that is not there fails the load, so the request (policy "fail")."""
        if self.plane.engines.get(engine_id) != where:
            raise Refused(
                f"KV transfer from engine {engine_id!r} at {where!r} failed (kv_load_failure_policy=fail)",
                500,
                "InternalServerError",
            )

    def _nixl_pull(self, rec: Received, ktp: dict[str, Any]) -> Held | None:
        self._engine_or_fail(ktp["remote_engine_id"], (ktp["remote_host"], ktp["remote_port"]))
        rid = ktp["remote_request_id"]
        held = self.plane.held.get(rid)
        if held is None or held.engine_id != ktp["remote_engine_id"]:
            why = self.plane.gone.get(rid, "unknown")
            self.protocol(rec, [f"decode read blocks of request {rid!r} that are not held ({why})"])
            return None
        if ktp["remote_block_ids"] != [held.block_ids]:
            self.protocol(rec, [f"decode remote_block_ids={ktp['remote_block_ids']!r} are not the prefill's"])
        self._same_request_id(rec, held)
        return self.plane.release(rid, "read")

    def _same_request_id(self, rec: Received, held: Held) -> None:
        """The reference proxies send both legs one X-Request-Id (vLLM's request id is built from it)."""
        xid = rec.headers.get("x-request-id")
        if held.x_request_id is not None and xid != held.x_request_id:
            self.protocol(rec, [f"decode X-Request-Id={xid!r}, the prefill's was {held.x_request_id!r}"])

    async def _mooncake_pull(self, rec: Received, ktp: dict[str, Any]) -> Held | None:
        key = str(ktp["transfer_id"])
        if key not in self.plane.held and key in self.plane.gone:
            why = self.plane.gone[key]
            raise Refused(f"transfer {key} is no longer held ({why})", 500, "InternalServerError")
        try:
            held = await asyncio.wait_for(self.plane.pushed(key), self.transfer_timeout_s)
        except TimeoutError:
            raise Refused(
                f"transfer {key} not received within {self.transfer_timeout_s}s (kv_load_failure_policy=fail)",
                500,
                "InternalServerError",
            ) from None
        self._engine_or_fail(ktp["remote_engine_id"], ktp["remote_bootstrap_addr"])
        if held.engine_id != ktp["remote_engine_id"]:
            self.protocol(
                rec, [f"decode remote_engine_id={ktp['remote_engine_id']!r}, pushed by {held.engine_id!r}"]
            )
        self._same_request_id(rec, held)
        return self.plane.release(key, "read")


async def start_vllm(role: Role = "both", **options: Any) -> VllmStandin:
    """A started vLLM stand-in on 127.0.0.1 (``.url``, ``.requests``, ``.plane``) in the running loop."""
    standin = VllmStandin(role, **options)
    await standin.start()
    return standin


__all__ = [
    "KV_LEASE_S",
    "NIXL_SIDE_CHANNEL_PORT",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Held",
    "KVPlane",
    "VllmStandin",
    "start_vllm",
    "validate",
]
