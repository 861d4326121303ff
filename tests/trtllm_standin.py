"""A stand-in for a ``trtllm-serve`` worker (context, generation, or both), for tests without GPUs.

fastcore's orchestrator must front real ``trtllm-serve`` workers, which need
GPUs. This module is a small aiohttp worker whose request and response models,
error bodies, routes, auth check, msgpack decoding and SSE framing follow
trtllm-serve's, so an orchestrator that works against it sends what a real
trtllm-serve accepts. Its models are written here (not imported or copied) and
are pydantic with ``extra="forbid"``, as trtllm's ``OpenAIBaseModel`` is: a field
trtllm does not model is refused, as trtllm refuses it.

What it follows (NVIDIA/TensorRT-LLM, read through the project's code index):

- ``tensorrt_llm/serve/openai_protocol.py`` at commit
  ``0076e9390e1ed11515f149eec356f5a03f4a00d8`` (2026 main): every top-level
  field of ``CompletionRequest`` and ``ChatCompletionRequest`` (names, defaults,
  the before-validators that refuse), ``DisaggregatedParams`` (with
  ``return_prompt_token_ids_b64`` and ``resolved_thinking``; no
  ``conversation_id``, which some other revisions have), ``UsageInfo``,
  ``ErrorResponse``, and the response and stream-chunk models. Nested shapes
  that do not touch the disaggregated protocol (tools, response_format, LoRA,
  multimodal kwargs, ...) are typed loosely.
- ``openai_server.py`` of the same line: the revision with the
  ``X-TRTLLM-Msgpack`` route class (``TRTLLM_SERVE_ENABLE_MSGSPEC=1``) and the
  ``prompt_token_ids_b64`` encode/decode (the index did not name that file's
  commit; NVIDIA's stored default of the file is older and has neither):
  routes, ``create_error_response``, the ``RequestValidationError`` handler,
  ``/health``, ``/v1/models``, ``/server_info``, how chat and completions take
  their prompt.
- ``postprocess_handlers.py`` at ``01bf19231d29d8f0766e31c117d1cf39ed00d3d5``:
  serialisation (non-streaming answers are ``model_dump()``, so every null is
  present; chat chunks are ``exclude_none``; completion chunks are full; the
  usage chunk is full with ``choices: []``; ``data: [DONE]`` last).
- ``disagg_auth.py``: the ``x-trtllm-disagg-auth`` signature as at
  ``0cfda24b3c9d930f20d229d6af065d16dc436902`` (the same in later revisions);
  without a key, the later revisions' behaviour (warn, let the request
  through; the stand-in counts instead of warning: ``unauthenticated_protected``) unless ``require_key=True`` asks for the earlier one (refuse).

Where trtllm's behaviour could not be read (the engine), the stand-in picks the
plainest reading and says so in the code: ``ctx_request_id`` is the request's
``disagg_request_id``; a context answer's ``finish_reason`` is ``"length"``
(``"stop"`` when the first token is EOS); a generation answer repeats the
``first_gen_tokens`` and echoes the request's ``disaggregated_params``.

Tokens: no model. Text and chat are tokenized exactly as a fastcore worker
with the built-in ``tiny`` model does (:class:`server.worker.tokenizer.ByteTokenizer`:
completions ``encode(prompt)`` with BOS, chat ``encode(apply_chat_template(...),
add_special_tokens=False)``), so ``prompt_token_ids`` match a fastcore worker's.
Output token ``i`` is :func:`standin_token` ``(prompt_ids, i)``, printable ASCII,
never EOS unless ``eos_at`` says so, so a context stand-in's first token and a
generation stand-in's continuation agree and can be predicted by a test.

Use::

    standin = await start_standin("context", key=b"secret")   # in a running loop
    ... standin.url, standin.requests ...
    await standin.stop()

    with StandinThread("generation") as standin:               # for blocking clients
        ...

Limits, refused with a 400 that says "stand-in": ``n`` > 1, ``best_of`` > 1,
beam search, logprobs, echo, tools, prompt batches. Sampling fields are
accepted and ignored (the output is deterministic); ``stop`` strings and
``stop_token_ids`` are ignored.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import hmac
import itertools
import json
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.worker.tokenizer import ByteTokenizer

Role = Literal["context", "generation", "both"]

#: trtllm-serve's header (disagg_auth.INTERNAL_DISAGG_AUTH_HEADER)
AUTH_HEADER = "x-trtllm-disagg-auth"
#: the header that flags a msgpack body (openai_server._MsgspecRequest)
MSGPACK_HEADER = "x-trtllm-msgpack"
#: the request types trtllm's llmapi DisaggregatedParams knows
REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


# ---------------------------------------------------------------------------
# Models: trtllm-serve's, with the fields and defaults that matter here


class OpenAIBaseModel(BaseModel):
    """trtllm's base: unknown fields are refused; fields load by name or alias."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class DisaggScheduleStyle(enum.IntEnum):
    """trtllm's ``DisaggScheduleStyle``: an IntEnum, so it travels as 0 or 1, not a name."""

    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class DisaggregatedParams(OpenAIBaseModel):
    """Every field of trtllm's at 0076e939; ``ctx_info_endpoint`` is a string (a list is refused)."""

    request_type: str
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    first_gen_logits: list[Any] | None = None
    ctx_request_id: int | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: DisaggScheduleStyle | None = None
    ctx_usage: UsageInfo | None = None
    return_prompt_token_ids_b64: bool = False
    resolved_thinking: bool | None = None


class ConversationParams(OpenAIBaseModel):
    conversation_id: str
    # trtllm excludes it from dumps and forwards it as a header instead.
    subagent_affinity_id: str | None = Field(default=None, exclude=True)

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _non_empty(cls, value: Any) -> str:
        text = "" if value is None else str(value).strip()
        if not text:
            raise ValueError("conversation_id must be non-empty")
        return text


class ErrorResponse(OpenAIBaseModel):
    object: str = "error"
    message: str
    type: str
    param: str | None = None
    code: int


ReasoningEffort = Literal["low", "medium", "high", "max", "none", "Low", "Medium", "High"]
EarlyStopping = bool | Literal["never"]


class _SamplingFields(OpenAIBaseModel):
    """Fields both requests share, with trtllm's defaults (accepted; the stand-in ignores most)."""

    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    lora_request: dict[str, Any] | None = None
    prompt_ignore_length: int | None = 0
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int = 0
    top_p_min: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float | None = None
    early_stopping: EarlyStopping | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    thinking_token_budget: int | None = None
    response_format: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    priority: float | None = Field(default=None, ge=0.0, le=1.0)
    conversation_params: ConversationParams | None = None


class CompletionRequest(_SamplingFields):
    """trtllm's: no ``prompt_token_ids``, no ``prompt_token_ids_b64`` (both refused); ids go in ``prompt``."""

    model: str
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = None
    suffix: str | None = None
    return_context_logits: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("stream_options") and not data.get("stream"):
                raise ValueError("Stream options can only be defined when stream is true.")
            if data.get("suffix"):
                raise ValueError("suffix is not supported")
        return data


class ChatCompletionRequest(_SamplingFields):
    """trtllm's: ``prompt_token_ids`` and ``prompt_token_ids_b64`` are modelled here (chat only)."""

    messages: list[dict[str, Any]]
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None
    model: str
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    # trtllm's field is max_completion_tokens, loaded from "max_tokens" too.
    max_completion_tokens: int | None = Field(default=None, validation_alias="max_tokens")
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = "Low"
    thinking: dict[str, Any] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    injected_chat_template_kwargs: list[str] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    cache_salt: str | None = None
    agent_hierarchy: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Every message TypedDict trtllm accepts has a required "role".
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] needs a string 'role'")
        return messages

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("stream_options") is not None and not data.get("stream"):
            raise ValueError("stream_options can only be set if stream is true")
        has_dynamic_tools = any(
            isinstance(m, dict) and m.get("role") == "system" and m.get("tools")
            for m in data.get("messages") or []
        )
        if "tool_choice" not in data and (data.get("tools") or has_dynamic_tools):
            data = {**data, "tool_choice": "auto"}
        if "tool_choice" in data and data["tool_choice"] not in ("none", "auto"):
            if not (data.get("tools") or (data["tool_choice"] == "required" and has_dynamic_tools)):
                raise ValueError("When using `tool_choice`, `tools` must be set.")
        for m in data.get("messages") or []:
            if isinstance(m, dict) and m.get("tools") is not None and m.get("role") != "system":
                raise ValueError("Message-level `tools` are only allowed on system messages.")
        if data.get("top_logprobs") is not None and not data.get("logprobs"):
            raise ValueError("logprobs must be true when using top_logprobs")
        if data.get("suffix"):
            raise ValueError("suffix is not supported")
        return data


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    mm_embedding_handle: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    avg_decoded_tokens_per_iter: float | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    token_ids: list[int] | None = None
    logprobs: dict[str, Any] | None = None
    context_logits: list[float] | list[list[float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    disaggregated_params: DisaggregatedParams | None = None
    avg_decoded_tokens_per_iter: float | None = None


class CompletionResponse(OpenAIBaseModel):
    """No ``prompt_token_ids_b64`` here: trtllm's completions always answer with the list."""

    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[list[int]] | list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    """No ``disaggregated_params``: a stream chunk cannot carry a hand-off."""

    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    avg_decoded_tokens_per_iter: float | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    token_ids: list[int] | None = None
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    avg_decoded_tokens_per_iter: float | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------
# Tokens


TOKENIZER = ByteTokenizer()
EOS_ID = TOKENIZER.special_ids["<|eos|>"]


def standin_token(prompt_ids: Sequence[int], position: int) -> int:
    """Output token ``position`` (0 = the context's first token) for a prompt: printable ASCII.

    A function of the prompt and the position only, so a context stand-in and
    a generation stand-in (or a test) compute the same continuation.
    """
    h = 0
    for i, t in enumerate(prompt_ids):
        h = (h * 1_000_003 + (i + 1) * (int(t) + 7)) % 2_147_483_647
    return 32 + (h + 13 * position + 7 * position * position) % 95


def standin_completion(prompt_ids: Sequence[int], max_tokens: int, eos_at: int | None = None) -> list[int]:
    """All output tokens a stand-in gives for ``prompt_ids`` (what a ``both`` stand-in answers)."""
    out: list[int] = []
    for position in range(max_tokens):
        out.append(EOS_ID if position == eos_at else standin_token(prompt_ids, position))
        if out[-1] == EOS_ID:
            break
    return out


def encode_prompt_b64(ids: Sequence[int]) -> str:
    """The ids as trtllm encodes them: little-endian int32, standard base64 with padding."""
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode("ascii")


def decode_prompt_b64(text: str) -> list[int]:
    """As trtllm decodes: ``base64.b64decode`` (non-alphabet characters are dropped, not refused).

    Bad padding raises ``binascii.Error`` and a byte length not a multiple of 4
    raises ValueError (numpy's ``frombuffer`` in trtllm), both ValueErrors, so 400s.
    """
    raw = base64.b64decode(text)
    if len(raw) % 4:
        raise ValueError("buffer size must be a multiple of element size")
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def render_chat(
    messages: list[dict[str, Any]], add_generation_prompt: bool, add_special_tokens: bool
) -> list[int]:
    """A chat prompt's ids as a fastcore ``tiny`` worker computes them."""
    text = TOKENIZER.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return TOKENIZER.encode(text, add_special_tokens=add_special_tokens)


def detokenize(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    keep = [t for t in ids if t < 256] if skip_special_tokens else list(ids)
    return TOKENIZER.decode(keep)


# ---------------------------------------------------------------------------
# Auth (disagg_auth.py)


def trtllm_auth_value(key: bytes | str, ctx_info_endpoint: Any, encoded_opaque_state: Any) -> str:
    """``sha256=`` + HMAC-SHA256 under the key of trtllm's canonical JSON of the two fields."""
    if isinstance(ctx_info_endpoint, list):
        ctx_info_endpoint = ctx_info_endpoint[0] if ctx_info_endpoint else None
    payload = {"ctx_info_endpoint": ctx_info_endpoint, "encoded_opaque_state": encoded_opaque_state}
    message = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw_key = key.encode("utf-8") if isinstance(key, str) else key
    return "sha256=" + hmac.new(raw_key, message, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------
# Error bodies


def _dumps(content: Any) -> bytes:
    # starlette's JSONResponse rendering
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _json(content: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(content), status=status, content_type="application/json")


def error_response(message: str, err_type: str = "BadRequestError", status: int = 400) -> web.Response:
    """trtllm's ``create_error_response``: ``ErrorResponse.model_dump()``, status = code."""
    return _json(ErrorResponse(message=message, type=err_type, code=status).model_dump(), status)


def validation_error_response(exc: ValidationError) -> web.Response:
    """trtllm's ``RequestValidationError`` handler: 400 ``{"error": str(exc)}`` (not ErrorResponse).

    The text imitates FastAPI's (``N validation errors:`` then one error per
    line, with ``loc`` starting at ``"body"``); only its shape is a contract.
    """
    errors = [
        {"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"], "input": e.get("input")}
        for e in exc.errors(include_url=False)
    ]
    text = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n"
    text += "".join(f"  {e!r}\n" for e in errors)
    return _json({"error": text}, 400)


def _json_invalid(exc: json.JSONDecodeError) -> web.Response:
    err = {
        "type": "json_invalid",
        "loc": ("body", exc.pos),
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": exc.msg},
    }
    return _json({"error": f"1 validation error:\n  {err!r}\n"}, 400)


class _StandinLimit(ValueError):
    """Something trtllm serves that this stand-in does not: a 400 that says so."""

    def __init__(self, what: str) -> None:
        super().__init__(f"trtllm stand-in: {what} is not implemented")


# ---------------------------------------------------------------------------
# The server


@dataclass
class ReceivedRequest:
    """One request as the stand-in saw it, for tests to inspect."""

    method: str
    path: str
    #: lower-cased names
    headers: dict[str, str]
    raw: bytes
    #: the body was decoded as msgpack (the header was set and msgspec decoding is on)
    msgpack: bool = False
    #: the decoded body (JSON or msgpack), None when it did not decode
    body: Any = None
    #: the prompt ids the stand-in used, and where they came from: "ids", "b64" or "text"
    prompt_ids: list[int] | None = None
    prompt_source: str | None = None
    #: generation legs: whether the prompt matched the one the context leg saw (None: unknown ctx id)
    kv_match: bool | None = None
    status: int | None = None
    #: non-streaming JSON answer, or the SSE payloads of a streaming one
    response: Any = None
    sse: list[str] = field(default_factory=list)


class TrtllmStandin:
    """A trtllm-serve worker stand-in: ``role`` "context", "generation" or "both".

    Args:
        key: ``internal_request_auth_key``. With a key, any request whose
            ``disaggregated_params`` carries ``encoded_opaque_state`` or
            ``ctx_info_endpoint`` must carry ``x-trtllm-disagg-auth``, else 400.
        require_key: without a key, refuse such requests (earlier trtllm
            releases) instead of letting them through with a FutureWarning (later ones).
        msgspec_enabled: the worker runs with ``TRTLLM_SERVE_ENABLE_MSGSPEC=1``
            (decodes ``X-TRTLLM-Msgpack: 1`` bodies); off, the header is ignored
            and a msgpack body fails as JSON.
        context_finish_reason: override the context leg's ``finish_reason``
            (e.g. ``"not_finished"``, or ``"stop"`` to test the no-generation path).
        eos_at: output position that is EOS (0: the context's first token).
        ctx_info_endpoint / opaque_state: whether context answers carry them.
        kv_registry: shared ``ctx_request_id -> prompt ids`` between a context and
            a generation stand-in, to record in ``kv_match`` whether the
            generation leg's prompt is the context leg's (a real KV hand-off
            would otherwise silently be wrong).
        allow_request_chat_template: trtllm's server flag; off, a request's
            ``chat_template`` is refused.
        tool_calls: what trtllm-serve's ``--tool_parser`` finds in an answer (OpenAI ``tool_calls``
            entries: ``id``, ``type``, ``function`` with ``name`` and ``arguments``): a chat request
            with ``tools`` and a ``tool_choice`` other than "none" that generates (not a
            context_only leg) is answered with them and ``finish_reason`` "tool_calls", streamed as
            ``delta.tool_calls`` pieces after the role chunk. None: the answer has none.
    """

    def __init__(
        self,
        role: Role = "both",
        *,
        key: bytes | str | None = None,
        require_key: bool = False,
        model: str = "tiny",
        msgspec_enabled: bool = True,
        context_finish_reason: str | None = None,
        eos_at: int | None = None,
        default_max_tokens: int = 16,
        ctx_info_endpoint: bool = True,
        opaque_state: bool = True,
        kv_registry: dict[int, list[int]] | None = None,
        allow_request_chat_template: bool = False,
        max_context: int = 2048,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> None:
        if role not in ("context", "generation", "both"):
            raise ValueError(f"role must be context, generation or both, not {role!r}")
        self.role: Role = role
        self.key = key
        self.require_key = require_key
        #: requests with protected fields served without a key (trtllm: a FutureWarning each)
        self.unauthenticated_protected = 0
        self.model = model
        self.msgspec_enabled = msgspec_enabled
        self.context_finish_reason = context_finish_reason
        self.eos_at = eos_at
        self.default_max_tokens = default_max_tokens
        self.send_ctx_info_endpoint = ctx_info_endpoint
        self.send_opaque_state = opaque_state
        self.kv_registry: dict[int, list[int]] = {} if kv_registry is None else kv_registry
        self.allow_request_chat_template = allow_request_chat_template
        self.max_context = max_context
        self.tool_calls = tool_calls
        self.healthy = True
        self.requests: list[ReceivedRequest] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._ids = itertools.count(1)
        self.app = self._build_app()

    # -- lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """``host:port``, as trtllm's YAML and fastcore's config list servers."""
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> int:
        """Listen on 127.0.0.1 (port 0: a free one, no race); return the port."""
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def received(self, path: str | None = None) -> list[ReceivedRequest]:
        """The POSTs received (to ``path`` when given), oldest first."""
        return [r for r in self.requests if r.method == "POST" and (path is None or r.path == path)]

    # -- routes

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._fallback)
        return app

    async def _fallback(self, request: web.Request) -> web.Response:
        # FastAPI's answers for an unknown path and for a known path's wrong method.
        self._record(request, b"")
        known = {
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/health",
            "/server_info",
            "/version",
            "/metrics",
        }
        if request.path in known:
            return _json({"detail": "Method Not Allowed"}, 405)
        return _json({"detail": "Not Found"}, 404)

    async def _health(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        if self.healthy:
            return web.Response(status=200)
        return web.Response(
            status=503, text="LLM is unavailable. Please check the server logs for more details."
        )

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "tensorrt_llm"}
        return _json({"object": "list", "data": [card]})

    async def _server_info(self, request: web.Request) -> web.Response:
        # trtllm's get_server_info: the generator's disaggregated params and a few
        # engine limits. It says nothing of role, vocab, context length or base64.
        self._record(request, b"")
        return _json({"disaggregated_params": {}, "max_batch_size": 64, "tokens_per_block": 32})

    async def _version(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return _json({"version": "trtllm-standin"})

    async def _metrics(self, request: web.Request) -> web.Response:
        # trtllm's /metrics is a JSON list of iteration stats, not Prometheus text.
        self._record(request, b"")
        return _json([])

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    # -- request handling

    def _record(self, request: web.Request, raw: bytes) -> ReceivedRequest:
        headers = {k.lower(): v for k, v in request.headers.items()}
        rec = ReceivedRequest(method=request.method, path=request.path, headers=headers, raw=raw)
        self.requests.append(rec)
        return rec

    def _decode(self, rec: ReceivedRequest) -> web.Response | None:
        """The body as trtllm's Request.json() gets it; an error answer when it does not decode."""
        raw = rec.raw
        if not raw:
            rec.body = {}
            return None
        content_type = rec.headers.get("content-type")
        if content_type and not _is_json_type(content_type):
            rec.body = raw  # FastAPI hands the model the bytes, which then fail validation
            return None
        if self.msgspec_enabled and rec.headers.get(MSGPACK_HEADER) == "1":
            rec.msgpack = True
            try:
                rec.body = _msgpack_decode(raw)
            except Exception:
                # FastAPI: a body error that is not a JSONDecodeError.
                return _json({"detail": "There was an error parsing the body"}, 400)
            return None
        try:
            rec.body = json.loads(raw)
        except json.JSONDecodeError as exc:
            return _json_invalid(exc)
        except UnicodeDecodeError:
            return _json({"detail": "There was an error parsing the body"}, 400)
        return None

    async def _generate(
        self, request: web.Request, route: Literal["chat", "completions"]
    ) -> web.StreamResponse:
        raw = await request.read()
        rec = self._record(request, raw)
        failed = self._decode(rec)
        if failed is not None:
            rec.status = failed.status
            return failed
        model: type[ChatCompletionRequest] | type[CompletionRequest] = (
            ChatCompletionRequest if route == "chat" else CompletionRequest
        )
        try:
            req = model.model_validate(rec.body)
        except ValidationError as exc:
            answer: web.StreamResponse = validation_error_response(exc)
            rec.status = answer.status
            return answer
        try:
            answer = await self._serve(request, rec, route, req)
        except ValueError as exc:  # trtllm's handlers turn these into create_error_response (400)
            answer = error_response(str(exc))
        rec.status = answer.status
        if isinstance(answer, web.Response) and answer.body is not None:
            try:
                rec.response = json.loads(answer.body)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                pass
        return answer

    def _check_auth(self, req: ChatCompletionRequest | CompletionRequest, headers: dict[str, str]) -> None:
        """disagg_auth.validate_internal_disagg_request: a ValueError, so trtllm's 400."""
        dp = req.disaggregated_params
        if dp is None or (dp.encoded_opaque_state is None and dp.ctx_info_endpoint is None):
            return
        if not self.key:
            if self.require_key:
                raise ValueError(
                    "Protected disaggregated request fields require authenticated disaggregated request forwarding"
                )
            # trtllm warns (FutureWarning) and serves it; the stand-in counts it instead, so a test
            # can assert it happened without 32 warnings in every test run's summary.
            self.unauthenticated_protected += 1
            return
        expected = trtllm_auth_value(self.key, dp.ctx_info_endpoint, dp.encoded_opaque_state)
        provided = headers.get(AUTH_HEADER)
        try:
            ok = provided is not None and hmac.compare_digest(
                provided.encode("utf-8"), expected.encode("utf-8")
            )
        except UnicodeEncodeError:
            ok = False
        if not ok:
            raise ValueError("Invalid internal disaggregated request authentication")

    def _prompt(
        self, rec: ReceivedRequest, route: str, req: ChatCompletionRequest | CompletionRequest
    ) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            if req.chat_template is not None and not self.allow_request_chat_template:
                raise ValueError(
                    "chat_template cannot be supplied per request unless request-level chat templates "
                    "are enabled at server startup."
                )
            # openai_chat: the list wins; the b64 string is used only when the list is absent.
            if req.prompt_token_ids is None and req.prompt_token_ids_b64:
                ids, source = decode_prompt_b64(req.prompt_token_ids_b64), "b64"
            elif req.prompt_token_ids is not None:
                ids, source = list(req.prompt_token_ids), "ids"
            else:
                ids = render_chat(req.messages, req.add_generation_prompt, req.add_special_tokens)
                source = "text"
        else:
            prompt: Any = req.prompt
            while isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids, source = TOKENIZER.encode(prompt, add_special_tokens=req.add_special_tokens), "text"
            elif prompt and isinstance(prompt[0], int):
                ids, source = list(prompt), "ids"
            elif not prompt:
                raise ValueError("list index out of range")  # trtllm: request.prompt[0]
            else:
                raise _StandinLimit("a batch of prompts")
        if not ids:
            raise ValueError("The prompt is empty")
        bad = next((t for t in ids if not 0 <= t < TOKENIZER.vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token ID {bad} out of vocabulary range [0, {TOKENIZER.vocab_size})")
        if len(ids) >= self.max_context:
            raise ValueError(f"The prompt length ({len(ids)}) exceeds the max_seq_len ({self.max_context})")
        rec.prompt_ids, rec.prompt_source = ids, source
        return ids

    def _refuse_unimplemented(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.n != 1:
            raise _StandinLimit("n != 1")
        if req.best_of not in (None, 1):
            raise _StandinLimit("best_of")
        if req.use_beam_search:
            raise _StandinLimit("beam search")
        if req.logprobs:
            raise _StandinLimit("logprobs")
        if req.echo:
            raise _StandinLimit("echo")

    def _calls(
        self, req: ChatCompletionRequest | CompletionRequest, rtype: str | None
    ) -> list[dict[str, Any]]:
        if self.tool_calls is None or rtype == "context_only" or not isinstance(req, ChatCompletionRequest):
            return []
        return list(self.tool_calls) if req.tools and req.tool_choice != "none" else []

    async def _serve(
        self,
        request: web.Request,
        rec: ReceivedRequest,
        route: Literal["chat", "completions"],
        req: ChatCompletionRequest | CompletionRequest,
    ) -> web.StreamResponse:
        self._check_auth(req, rec.headers)
        dp = req.disaggregated_params
        rtype = None if dp is None else dp.request_type
        if rtype is not None and rtype not in REQUEST_TYPES:
            raise ValueError(f"Unknown request type: {rtype}")
        if rtype == "context_and_generation":
            rtype = None
        # Real trtllm workers do not check their role; the stand-in does, to catch misrouting.
        if (self.role, rtype) in (("context", "generation_only"), ("generation", "context_only")):
            raise ValueError(f"trtllm stand-in: a {self.role} server got a {rtype} request")
        self._refuse_unimplemented(req)
        ids = self._prompt(rec, route, req)
        max_tokens = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")

        out_dp: DisaggregatedParams | None = None
        if rtype == "context_only":
            assert dp is not None
            tokens = [self._token(ids, 0, req.ignore_eos)]
            ctx_id = dp.disagg_request_id if dp.disagg_request_id is not None else next(self._ids)
            self.kv_registry[ctx_id] = ids
            out_dp = DisaggregatedParams(
                request_type="context_only",
                first_gen_tokens=tokens,
                ctx_request_id=ctx_id,
                encoded_opaque_state=(
                    base64.b64encode(f"standin-kv:{ctx_id}".encode()).decode()
                    if self.send_opaque_state
                    else None
                ),
                draft_tokens=None,
                disagg_request_id=dp.disagg_request_id,
                ctx_info_endpoint=f"tcp://127.0.0.1:{self.port}" if self.send_ctx_info_endpoint else None,
                schedule_style=dp.schedule_style,
            )
            finish = self.context_finish_reason or ("stop" if tokens[0] == EOS_ID else "length")
        elif rtype == "generation_only":
            assert dp is not None
            if not dp.first_gen_tokens or dp.ctx_request_id is None:
                raise ValueError("a generation_only request needs first_gen_tokens and ctx_request_id")
            if dp.ctx_request_id in self.kv_registry:
                rec.kv_match = self.kv_registry.pop(dp.ctx_request_id) == ids
            tokens = list(dp.first_gen_tokens)
            finish = self._continue(ids, tokens, max_tokens, req.ignore_eos)
            out_dp = dp.model_copy(update={"return_prompt_token_ids_b64": False})
        else:
            tokens = []
            finish = self._continue(ids, tokens, max_tokens, req.ignore_eos)

        usage = UsageInfo(
            prompt_tokens=len(ids),
            completion_tokens=len(tokens),
            total_tokens=len(ids) + len(tokens),
            prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
        )
        if dp is not None and dp.ctx_usage is not None:  # rewrite_usage_*_from_ctx
            usage.prompt_tokens = dp.ctx_usage.prompt_tokens
            if dp.ctx_usage.prompt_tokens_details is not None:
                usage.prompt_tokens_details = dp.ctx_usage.prompt_tokens_details
            usage.total_tokens = usage.prompt_tokens + len(tokens)

        # trtllm-serve renders tools into the prompt and, with --tool_parser, reads calls out of the text
        calls = self._calls(req, rtype)
        if calls:
            finish = "tool_calls"
        if req.stream:
            return await self._stream(request, rec, route, req, tokens, finish, usage, calls)
        text = detokenize(tokens, req.skip_special_tokens)
        context = rtype == "context_only"
        body: BaseModel
        if isinstance(req, ChatCompletionRequest):
            role = "assistant" if req.add_generation_prompt else str(req.messages[-1]["role"])
            chat = ChatCompletionResponse(
                model=req.model,
                choices=[
                    ChatCompletionResponseChoice(
                        index=0,
                        message=ChatMessage(role=role, content=text, reasoning_content="", tool_calls=calls),
                        finish_reason=finish,
                        disaggregated_params=out_dp,
                    )
                ],
                usage=usage,
                prompt_token_ids=ids if context else None,
            )
            if context and dp is not None and dp.return_prompt_token_ids_b64:
                chat.prompt_token_ids_b64 = encode_prompt_b64(ids)
                chat.prompt_token_ids = None
            body = chat
        else:
            body = CompletionResponse(
                model=req.model,
                choices=[
                    CompletionResponseChoice(
                        index=0,
                        text=text if req.detokenize else "",
                        token_ids=None if req.detokenize else tokens,
                        finish_reason=finish,
                        disaggregated_params=out_dp,
                    )
                ],
                usage=usage,
                prompt_token_ids=ids if context else None,
            )
        return _json(body.model_dump(mode="json"))

    def _token(self, ids: list[int], position: int, ignore_eos: bool) -> int:
        if position == self.eos_at and not ignore_eos:
            return EOS_ID
        return standin_token(ids, position)

    def _continue(self, ids: list[int], tokens: list[int], max_tokens: int, ignore_eos: bool) -> str:
        """Extend ``tokens`` to ``max_tokens`` or EOS; the finish reason."""
        while True:
            if tokens and tokens[-1] == EOS_ID and not ignore_eos:
                return "stop"
            if len(tokens) >= max_tokens:
                return "length"
            tokens.append(self._token(ids, len(tokens), ignore_eos))

    async def _stream(
        self,
        request: web.Request,
        rec: ReceivedRequest,
        route: str,
        req: ChatCompletionRequest | CompletionRequest,
        tokens: list[int],
        finish: str,
        usage: UsageInfo,
        calls: list[dict[str, Any]],
    ) -> web.StreamResponse:
        """SSE as trtllm frames it: one chunk a token, the usage chunk when asked, ``[DONE]``."""
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        created = int(time.time())
        chat = isinstance(req, ChatCompletionRequest)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)

        async def send(payload: str, trailing_space: bool = False) -> None:
            rec.sse.append(payload)
            await out.write(f"data: {payload}{' ' if trailing_space else ''}\n\n".encode())

        def running_usage(n: int) -> UsageInfo:
            u = usage.model_copy()
            u.completion_tokens, u.total_tokens = n, usage.prompt_tokens + n
            return u

        if isinstance(req, ChatCompletionRequest):
            role = "assistant" if req.add_generation_prompt else str(req.messages[-1]["role"])
            first = ChatCompletionStreamResponse(
                id=rid,
                created=created,
                model=req.model,
                choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role=role))],
                usage=running_usage(0) if continuous else None,
            )
            # trtllm writes the role chunk as f"data: {...} \n\n", with a space.
            await send(first.model_dump_json(exclude_none=True), trailing_space=True)
            for index, call in enumerate(calls):  # trtllm's DeltaToolCall: index, id, type, function
                piece = ChatCompletionStreamResponse(
                    id=rid,
                    created=created,
                    model=req.model,
                    choices=[
                        ChatCompletionResponseStreamChoice(
                            index=0, delta=DeltaMessage(tool_calls=[{"index": index, **call}])
                        )
                    ],
                )
                await send(piece.model_dump_json(exclude_none=True))
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                chunk = ChatCompletionStreamResponse(
                    id=rid,
                    created=created,
                    model=req.model,
                    choices=[
                        ChatCompletionResponseStreamChoice(
                            index=0,
                            delta=DeltaMessage(
                                content=detokenize([token], req.skip_special_tokens), reasoning_content=""
                            ),
                            finish_reason=finish if last else None,
                        )
                    ],
                    usage=running_usage(i + 1) if continuous else None,
                )
                await send(chunk.model_dump_json(exclude_none=True))
                await asyncio.sleep(0)
            if include_usage:
                final = ChatCompletionStreamResponse(
                    id=rid, created=created, model=req.model, choices=[], usage=usage
                )
                await send(final.model_dump_json())
        else:
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                piece = CompletionStreamResponse(
                    id=rid,
                    created=created,
                    model=req.model,
                    choices=[
                        CompletionResponseStreamChoice(
                            index=0,
                            text=detokenize([token], req.skip_special_tokens) if req.detokenize else "",
                            token_ids=None if req.detokenize else [token],
                            finish_reason=finish if last else None,
                        )
                    ],
                    usage=running_usage(i + 1) if continuous else None,
                )
                await send(piece.model_dump_json())
                await asyncio.sleep(0)
            if include_usage:
                final_c = CompletionStreamResponse(
                    id=rid, created=created, model=req.model, choices=[], usage=usage
                )
                await send(final_c.model_dump_json())
        rec.sse.append("[DONE]")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _is_json_type(content_type: str) -> bool:
    """FastAPI parses a body as JSON for ``application/json`` and ``application/*+json``."""
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _msgpack_decode(raw: bytes) -> Any:
    """msgspec, as trtllm's worker uses; the ``msgpack`` package when msgspec is missing."""
    try:
        import msgspec
    except ImportError:  # pragma: no cover - msgspec is in the test extra
        import msgpack

        return msgpack.unpackb(raw, raw=False)
    return msgspec.msgpack.decode(raw)


def msgpack_encode(obj: Any) -> bytes:
    """A body as trtllm's orchestrator sends it with TRTLLM_SERVE_ENABLE_MSGSPEC=1."""
    try:
        import msgspec
    except ImportError:  # pragma: no cover
        import msgpack

        return bytes(msgpack.packb(obj))
    return msgspec.msgpack.encode(obj)


# ---------------------------------------------------------------------------
# Starting it


async def start_standin(
    role: Role = "both", *, key: bytes | str | None = None, port: int = 0, **options: Any
) -> TrtllmStandin:
    """A started stand-in on 127.0.0.1 in the running loop (``.runner``, ``.port``, ``.url``, ``.requests``)."""
    standin = TrtllmStandin(role, key=key, **options)
    await standin.start(port)
    return standin


class StandinThread:
    """A stand-in served from its own event-loop thread (or a given loop), for blocking code.

    ``with StandinThread("context") as s: ...`` or ``StandinThread(..., loop=loop)``
    to share a loop that already runs on a thread (tests' ``LoopThread.loop``).
    """

    def __init__(
        self, role: Role = "both", *, loop: asyncio.AbstractEventLoop | None = None, **options: Any
    ) -> None:
        self._own_thread: threading.Thread | None = None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._own_thread = threading.Thread(target=loop.run_forever, daemon=True, name="trtllm-standin")
            self._own_thread.start()
        self.loop = loop
        self.standin: TrtllmStandin = self._run(lambda: start_standin(role, **options))

    def _run(self, make: Callable[[], Any], timeout: float = 30) -> Any:
        async def call() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    @property
    def url(self) -> str:
        return self.standin.url

    @property
    def port(self) -> int:
        return self.standin.port

    @property
    def requests(self) -> list[ReceivedRequest]:
        return self.standin.requests

    def close(self) -> None:
        self._run(self.standin.stop)
        if self._own_thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._own_thread.join(10)
            self.loop.close()

    def __enter__(self) -> StandinThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_sse(body: bytes) -> Iterator[str]:
    """The ``data:`` payloads of an SSE body, stripped (``[DONE]`` included)."""
    for event in body.decode().split("\n\n"):
        event = event.strip()
        if event.startswith("data:"):
            yield event[len("data:") :].strip()


__all__ = [
    "AUTH_HEADER",
    "EOS_ID",
    "MSGPACK_HEADER",
    "TOKENIZER",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "DisaggScheduleStyle",
    "DisaggregatedParams",
    "ErrorResponse",
    "ReceivedRequest",
    "StandinThread",
    "TrtllmStandin",
    "UsageInfo",
    "decode_prompt_b64",
    "encode_prompt_b64",
    "iter_sse",
    "msgpack_encode",
    "render_chat",
    "standin_completion",
    "standin_token",
    "start_standin",
    "trtllm_auth_value",
]
