"""The relay's references: what a straightforward orchestrator does with json (parse, modify, dump) for
leg (1), leg (3) and the answer a client gets; test_relay holds both twins' kernels to them, as
documents (key order and spacing aside)."""

from __future__ import annotations

import json
from typing import Any


def reference_context_request(client: bytes, disagg_request_id: int, return_b64: bool) -> Any:
    body = json.loads(client)
    body["stream"] = False
    body["stream_options"] = None
    params: dict[str, Any] = {"request_type": "context_only", "disagg_request_id": disagg_request_id}
    if return_b64:
        params["return_prompt_token_ids_b64"] = True
    body["disaggregated_params"] = params
    return body


def reference_generation_request(client: bytes, ctx: bytes, tokids_b64: bool, strip_history: bool) -> Any:
    body = json.loads(client)
    response = json.loads(ctx)
    params = dict(response["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    params["ctx_usage"] = response.get("usage")
    body["disaggregated_params"] = params
    chat = "messages" in body
    # Asked for base64, got only the list (null or absent b64): the list goes on (docs/protocol.md (2)).
    if tokids_b64 and response.get("prompt_token_ids_b64") is not None:
        body["prompt_token_ids_b64"] = response["prompt_token_ids_b64"]
    elif chat:
        body["prompt_token_ids"] = response["prompt_token_ids"]
    else:
        body["prompt"] = response["prompt_token_ids"]
    if strip_history and chat:
        body["messages"] = body["messages"][-1:]
    return body


def reference_strip(body: bytes) -> Any:
    doc = json.loads(body)
    doc.pop("prompt_token_ids", None)
    doc.pop("prompt_token_ids_b64", None)
    for choice in doc.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("disaggregated_params", None)
    return doc
