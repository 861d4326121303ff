"""How the orchestrator turns a client body into the two legs' bodies: the mode, picked by config.

- ``fast`` (the default): :class:`.relay_fast.FastRelay`, the zero-parse relay kernels.
- ``parsed``: :class:`.relay_parsed.ParsedRelay`, the pydantic baseline a typical orchestrator is.
- ``parsed-msgpack``: :class:`.relay_parsed.ParsedMsgpackRelay`, the baseline with msgpack legs.

Every mode has the same interface (``read_client``, ``context_request(req, disagg_request_id,
ask_b64_completions)``, ``read_context``, ``auth_fields``, ``generation_request``,
``finished_answer``, ``client_answer``, ``prompt_bytes``, ``leg_headers``; ``context_pieces`` and ``generation_pieces``,
the legs' bodies as the orchestrator sends them: bytes, or pieces for one vectored write) and raises
:class:`server.errors.HTTPError`: 400 for a client's bad body, 502 for a worker's unusable one.
"""

from __future__ import annotations

import json

from server.errors import HTTPError
from server.openai_shapes import answer_stream

from .relay_common import ClientRequest, ContextResult, malformed_json_error
from .relay_fast import FastRelay
from .relay_parsed import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ParsedMsgpackRelay,
    ParsedRelay,
)

RelayMode = FastRelay | ParsedRelay
#: config ``relay`` -> its adapter
MODES: dict[str, type[FastRelay] | type[ParsedRelay]] = {
    FastRelay.name: FastRelay,
    ParsedRelay.name: ParsedRelay,
    ParsedMsgpackRelay.name: ParsedMsgpackRelay,
}


def make_relay(mode: str, *, tokids_b64: bool, strip_history: bool) -> RelayMode:
    return MODES[mode](tokids_b64=tokids_b64, strip_history=strip_history)


def answer_as_sse(answer: bytes, *, chat: bool, include_usage: bool) -> bytes:
    """The SSE stream a streaming worker would have sent for the complete ``answer``
    (:func:`server.openai_shapes.answer_stream`; the answer is one token long, so a parse of it costs
    the same whatever the prompt length).

    ``answer`` is a context worker's finished response, stripped: the fast relay checked only what
    it acts on, so a shape this cannot stream (nesting past Python's recursion limit, an integer past
    its 4300 digits, a choice that is not an object) is the worker's 502 here, never an exception of
    another kind.
    """
    try:
        return answer_stream(json.loads(answer), chat=chat, include_usage=include_usage)
    except (ValueError, RecursionError, AttributeError, TypeError) as exc:
        raise HTTPError(502, f"context worker response cannot be streamed: {exc!r}"[:500]) from None


__all__ = [
    "MODES",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ClientRequest",
    "CompletionRequest",
    "CompletionResponse",
    "ContextResult",
    "FastRelay",
    "ParsedMsgpackRelay",
    "ParsedRelay",
    "RelayMode",
    "answer_as_sse",
    "make_relay",
    "malformed_json_error",
]
