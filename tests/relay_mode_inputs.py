"""What the relay modes' tests share: a context worker's answer and the fast relay on one twin.

Moved out of tests/test_orchestrator_relay_modes.py, which test_tool_traffic shares (a test module
imports no other: tests/test_layout)."""

from __future__ import annotations

import functools
import json
from types import ModuleType
from typing import Any

import fastcore
from fastcore.relay import Relay
from server.orchestrator.relay_modes import FastRelay

PROMPT_IDS = [1, 9038, 2501, 29871, 13, 0, 255, 70000]
DISAGG_ID = 7205759403792793601


def context_response(
    chat: bool, *, b64: bool, finish: str = "not_finished", completion_tokens: int = 1
) -> bytes:
    params = {
        "request_type": "context_only",
        "first_gen_tokens": [42],
        "ctx_request_id": 17,
        "disagg_request_id": DISAGG_ID,
        "encoded_opaque_state": None,
        "ctx_info_endpoint": "http://127.0.0.1:8001/kv/17",
        "draft_tokens": None,
    }
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": finish,
        "disaggregated_params": params,
    }
    if chat:
        choice["message"] = {"role": "assistant", "content": "*"}
    else:
        choice["text"] = "*"
    body: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "completion_tokens": completion_tokens,
            "total_tokens": 9,
        },
    }
    if b64:
        body["prompt_token_ids"] = None
        body["prompt_token_ids_b64"] = fastcore.encode_tokens(PROMPT_IDS).decode()
    else:
        body["prompt_token_ids"] = PROMPT_IDS
    return json.dumps(body).encode()


@functools.cache
def fast_relay_class(relay_twin: ModuleType) -> type[FastRelay]:
    """FastRelay on one twin's kernels: the test chooses the class (FastRelay takes no twin)."""
    return type(f"FastRelay_{relay_twin.__name__}", (FastRelay,), {"relay": Relay(relay_twin)})
