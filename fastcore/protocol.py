"""The wire protocol's names, defined once (``docs/protocol.md``).

Every process of a deployment (orchestrator relay modes, the relay kernels of
both scanner twins, the workers) reads the names of wire fields, internal
fields, request types and finish reasons from here, so a rule such as "which
fields a client may not send on which route" has one definition. The module
imports nothing but the standard library: the orchestrator and the wheel use
it without torch.

The compiled relay kernels (``fastcore/_relay.pyx``) cannot import Python
constants into their C code; they derive their module-level constants from this
module when imported, and ``tests/test_protocol_module.py`` checks that both
twins' paths and rules agree with the names here. Worker endpoints, the keys of
a worker's ``/server_info`` and the conversation fields live here too: the
worker writes them and the orchestrator reads them, from one definition.
"""

from __future__ import annotations

from typing import Final

# -- routes and object types -------------------------------------------------------------------------

CHAT_COMPLETIONS_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"

OBJECT_CHAT_COMPLETION: Final = "chat.completion"
OBJECT_CHAT_COMPLETION_CHUNK: Final = "chat.completion.chunk"
OBJECT_TEXT_COMPLETION: Final = "text_completion"

# -- request and response fields the protocol acts on ------------------------------------------------

MODEL: Final = "model"
MESSAGES: Final = "messages"
PROMPT: Final = "prompt"
STREAM: Final = "stream"
STREAM_OPTIONS: Final = "stream_options"
INCLUDE_USAGE: Final = "include_usage"
MAX_TOKENS: Final = "max_tokens"
MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
CHOICES: Final = "choices"
FINISH_REASON: Final = "finish_reason"
#: vLLM's member of a finished choice (and trtllm-serve's): the stop string that matched, or the stop
#: token id (an int); fastcore's workers send it only when one of them ended the answer
STOP_REASON: Final = "stop_reason"
USAGE: Final = "usage"
PROMPT_TOKENS: Final = "prompt_tokens"
COMPLETION_TOKENS: Final = "completion_tokens"
#: OpenAI's ``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache
PROMPT_TOKENS_DETAILS: Final = "prompt_tokens_details"
CACHED_TOKENS: Final = "cached_tokens"
#: vLLM's and trtllm-serve's per-tenant prefix-cache isolation: a non-empty string, passed to both legs
CACHE_SALT: Final = "cache_salt"

#: The prompt as token ids: a JSON list (chat requests, context responses).
PROMPT_TOKEN_IDS: Final = "prompt_token_ids"
#: The prompt as little-endian int32 ids in standard padded base64 (gate ``gen_tokids_ctxbytes``).
PROMPT_TOKEN_IDS_B64: Final = "prompt_token_ids_b64"
DISAGGREGATED_PARAMS: Final = "disaggregated_params"

# -- disaggregated_params members ---------------------------------------------------------------------

REQUEST_TYPE: Final = "request_type"
DISAGG_REQUEST_ID: Final = "disagg_request_id"
RETURN_PROMPT_TOKEN_IDS_B64: Final = "return_prompt_token_ids_b64"
FIRST_GEN_TOKENS: Final = "first_gen_tokens"
CTX_REQUEST_ID: Final = "ctx_request_id"
ENCODED_OPAQUE_STATE: Final = "encoded_opaque_state"
CTX_INFO_ENDPOINT: Final = "ctx_info_endpoint"
DRAFT_TOKENS: Final = "draft_tokens"
#: Added to leg (3)'s params: the context leg's ``usage``.
CTX_USAGE: Final = "ctx_usage"

#: Members of trtllm-serve's ``DisaggregatedParams`` this protocol does not name: relayed verbatim
#: from leg (2) to leg (3) (the fast relay copies the whole object; the parsed mode keeps them as
#: pydantic extras). ``conversation_id`` is no member of it: it travels in the request's
#: ``conversation_params`` (trtllm-serve's), relayed untouched like every field the protocol does not
#: name; a top-level ``conversation_id`` is moved there first (server/orchestrator/routing/conversation_params.py).
TRTLLM_EXTRA_DISAGG_FIELDS: Final = (
    "first_gen_log_probs",
    "first_gen_logits",
    "ctx_dp_rank",
    "schedule_style",
    "resolved_thinking",
)

# -- request types ------------------------------------------------------------------------------------

CONTEXT_ONLY: Final = "context_only"
GENERATION_ONLY: Final = "generation_only"
REQUEST_TYPES: Final = (CONTEXT_ONLY, GENERATION_ONLY)

#: ``disagg_request_id`` is drawn from [DISAGG_REQUEST_ID_MIN, DISAGG_REQUEST_ID_END): trtllm-serve
#: keeps [0, 2^40) for the ids it makes itself, and 2^63 is the end of a signed 64-bit id.
DISAGG_REQUEST_ID_MIN: Final = 1 << 40
DISAGG_REQUEST_ID_END: Final = 1 << 63


def is_disagg_request_id(value: object) -> bool:
    """Whether ``value`` is an int (not a bool) in the orchestrator's id range."""
    return type(value) is int and DISAGG_REQUEST_ID_MIN <= value < DISAGG_REQUEST_ID_END


# -- finish reasons -----------------------------------------------------------------------------------

FINISH_LENGTH: Final = "length"
FINISH_NOT_FINISHED: Final = "not_finished"
FINISH_STOP: Final = "stop"
FINISH_ABORT: Final = "abort"
FINISH_TOOL_CALLS: Final = "tool_calls"
#: Context-leg finish reasons after which a generation leg follows (docs/protocol.md (2)); any other
#: one means the context response is the answer.
GENERATION_FOLLOWS: Final = (FINISH_LENGTH, FINISH_NOT_FINISHED)
#: The finish reasons the relay kernels decode without a JSON decoder (others are decoded too).
COMMON_FINISH_REASONS: Final = (
    FINISH_LENGTH,
    FINISH_NOT_FINISHED,
    FINISH_STOP,
    FINISH_ABORT,
    FINISH_TOOL_CALLS,
)

# -- internal fields ("Rules that hold everywhere", docs/protocol.md (4)) ------------------------------------

#: Fields a client may never send, on either route.
INTERNAL_REQUEST_FIELDS: Final = (DISAGGREGATED_PARAMS, PROMPT_TOKEN_IDS_B64)
#: Fields a client may not send on chat requests only: on completions ``prompt_token_ids`` is no
#: input of this protocol, so the client's value is passed through untouched.
INTERNAL_CHAT_REQUEST_FIELDS: Final = (*INTERNAL_REQUEST_FIELDS, PROMPT_TOKEN_IDS)
#: Top-level response fields that never reach a client.
INTERNAL_RESPONSE_FIELDS: Final = (PROMPT_TOKEN_IDS, PROMPT_TOKEN_IDS_B64)
#: Members of every ``choices[i]`` that never reach a client.
INTERNAL_CHOICE_FIELDS: Final = (DISAGGREGATED_PARAMS,)
#: Every internal field name.
INTERNAL_FIELDS: Final = (DISAGGREGATED_PARAMS, PROMPT_TOKEN_IDS_B64, PROMPT_TOKEN_IDS)


def internal_request_fields(chat: bool) -> tuple[str, ...]:
    """The fields a client may not send on the chat (``chat``) or completions route."""
    return INTERNAL_CHAT_REQUEST_FIELDS if chat else INTERNAL_REQUEST_FIELDS


def internal_field_message(field: str) -> str:
    """The 400's message for a client that sent the internal ``field`` (one wording, every mode)."""
    return f"'{field}' is an internal field and may not be sent by clients"


# -- headers ------------------------------------------------------------------------------------------

#: A leg body sent as msgpack (Content-Type stays application/json), as newer trtllm-serve
#: orchestrators send them.
X_TRTLLM_MSGPACK: Final = "X-TRTLLM-Msgpack"
X_TRTLLM_MSGPACK_VALUE: Final = "1"
#: trtllm-serve's internal auth header of a generation leg (server/auth.py signs it).
X_TRTLLM_DISAGG_AUTH: Final = "x-trtllm-disagg-auth"


# -- worker endpoints ---------------------------------------------------------------------------------

HEALTH_PATH: Final = "/health"
SERVER_INFO_PATH: Final = "/server_info"
#: ``POST /tokenize`` (vLLM's endpoint and answer): a chat or completion body's prompt ids,
#: ``{"count": N, "max_model_len": M, "tokens": [...]}``; the orchestrator's count_tokens asks it
TOKENIZE_PATH: Final = "/tokenize"
TOKENIZE_COUNT: Final = "count"
TOKENIZE_MAX_MODEL_LEN: Final = "max_model_len"
TOKENIZE_TOKENS: Final = "tokens"
#: ``GET``/``DELETE /kv/<ctx_request_id>``: a parked context's KV (its ``ctx_info_endpoint``).
KV_PATH_PREFIX: Final = "/kv/"
KV_PATH: Final = KV_PATH_PREFIX + "{ctx_request_id}"
#: ``DELETE /kv/by-request/<disagg_request_id>``: release the KV of a context answer that was lost.
KV_BY_REQUEST_PREFIX: Final = KV_PATH_PREFIX + "by-request/"
#: A ctx_request_id / disagg_request_id in a KV path: at most 20 decimal digits.
KV_ID_PATTERN: Final = "[0-9]{1,20}"


def kv_path(ctx_request_id: int) -> str:
    """The path of the KV parked under ``ctx_request_id``."""
    return KV_PATH.format(ctx_request_id=ctx_request_id)


# -- /server_info keys (what a worker says it is and can do; a cluster record's capabilities) ---------

INFO_ROLE: Final = "role"
INFO_INSTANCE: Final = "instance"
INFO_MODEL: Final = "model"
INFO_MAX_CONTEXT_LENGTH: Final = "max_context_length"
INFO_VOCAB_SIZE: Final = "vocab_size"
INFO_KV_ENDPOINT: Final = "kv_endpoint"
#: the worker's KV cache size in tokens (bounds a kv_cache_aware router's index of it)
INFO_KV_CAPACITY_TOKENS: Final = "kv_capacity_tokens"
INFO_KV_TTL_S: Final = "kv_ttl_s"
INFO_MAX_PARKED_TOKENS: Final = "max_parked_tokens"
INFO_DEVICE: Final = "device"
#: return_prompt_token_ids_b64 honoured on chat context legs
INFO_B64_CHAT: Final = "prompt_token_ids_b64_chat"
#: ... and on completions context legs (trtllm-serve answers those with the list only)
INFO_B64_COMPLETIONS: Final = "prompt_token_ids_b64_completions"
#: bodies flagged X-TRTLLM-Msgpack: 1 are decoded as msgpack
INFO_MSGPACK_REQUESTS: Final = "msgpack_requests"
#: a plain request (no disaggregated_params) is served whole: conditional disaggregation may send one
INFO_LOCAL_PREFILL: Final = "local_prefill"
INFO_PREFIX_CACHING: Final = "prefix_caching"
#: the prompt text bytes per token a worker publishes (seeds the pool's learned estimate)
INFO_BYTES_PER_TOKEN: Final = "bytes_per_token"
#: a second KV tier's size in tokens, the rate a hit there loads at and the prefill rate it is
#: weighed against, tokens/s (only with a tier; a /cache_events resync's tier_rates, the last two)
INFO_KV_TIER2_CAPACITY_TOKENS: Final = "kv_tier2_capacity_tokens"
INFO_KV_TIER2_LOAD_TOKENS_PER_S: Final = "kv_tier2_load_tokens_per_s"
INFO_PREFILL_TOKENS_PER_S: Final = "prefill_tokens_per_s"
INFO_INTERNAL_AUTH: Final = "internal_auth"
INFO_AUTH_FASTCORE_SIGNATURE: Final = "fastcore_signature"
INFO_AUTH_TRTLLM_DISAGG_AUTH: Final = "trtllm_disagg_auth"
INFO_AUTH_ACCEPT_TRTLLM_ORCHESTRATOR: Final = "accept_trtllm_orchestrator"
#: a member only trtllm-serve's /server_info has (its get_server_info): such a worker says nothing of
#: local_prefill, yet its generation workers serve a plain request whole, so it counts as saying it
INFO_TRTLLM_MARKER: Final = DISAGGREGATED_PARAMS

# -- conversations (trtllm-serve's conversation_params) -------------------------------------------------

CONVERSATION_PARAMS: Final = "conversation_params"
CONVERSATION_ID: Final = "conversation_id"

__all__ = [
    name
    for name in dir()
    if name.isupper()
    or name
    in (
        "internal_field_message",
        "internal_request_fields",
        "is_disagg_request_id",
        "kv_path",
    )
]
