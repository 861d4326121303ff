"""The orchestrator's own work per request, fast relay vs the parsed baseline, by prompt length.

    python -m bench.orchestrator_work            # 4k, 40k, 128k prompt ids
    python -m bench.orchestrator_work --sizes 1000,40000

Each row is one request's synchronous work on the orchestrator's event loop,
exactly the calls its handler makes (server/orchestrator/relay_modes.py):
validate the client body, build the context request, read the context
response, build the generation request, and relay a (non-streaming)
generation response to the client. Network and workers are left out: this is
the CPU an orchestrator core spends per request, the thing that caps its
requests/s. Workload: an agentic chat request (~4 bytes of history per prompt
token, bench.workload) and its context response with the prompt ids as a JSON
list (gates off) or as base64 (gen_tokids_ctxbytes).

Ratios are against the parsed baseline with gates off (what a pydantic
orchestrator does today) and are measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from typing import Any

import fastcore
from bench._timing import format_table, time_call
from bench.workload import chat_body
from server.orchestrator.relay_modes import FastRelay, ParsedRelay

VARIANTS: list[tuple[str, type, bool, bool]] = [
    ("parsed, gates off (baseline)", ParsedRelay, False, False),
    ("parsed, b64 ids", ParsedRelay, True, False),
    ("parsed, b64 ids + strip history", ParsedRelay, True, True),
    ("fast, gates off", FastRelay, False, False),
    ("fast, b64 ids", FastRelay, True, False),
    ("fast, b64 ids + strip history", FastRelay, True, True),
]


def context_response(ids: list[int], *, b64: bool) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The"},
                "logprobs": None,
                "finish_reason": "not_finished",
                "disaggregated_params": {
                    "request_type": "context_only",
                    "first_gen_tokens": [450],
                    "ctx_request_id": 12345,
                    "disagg_request_id": 7205759403792793601,
                    "encoded_opaque_state": None,
                    "ctx_info_endpoint": "http://127.0.0.1:8001/kv/12345",
                    "draft_tokens": None,
                },
            }
        ],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
    }
    if b64:
        body["prompt_token_ids"] = None
        body["prompt_token_ids_b64"] = fastcore.encode_tokens(ids).decode()
    else:
        body["prompt_token_ids"] = ids
    return json.dumps(body).encode()


def generation_response(n_ids: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "The answer is short. " * 4},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": n_ids, "completion_tokens": 16, "total_tokens": n_ids + 16},
        }
    ).encode()


def one_request(mode: Any, body: bytes, ctx: bytes, gen: bytes) -> bytes:
    req = mode.read_client(body, True)
    mode.context_request(req, 7205759403792793601)
    result = mode.read_context(req, ctx)
    mode.generation_request(req, result)
    return bytes(mode.client_answer(req, gen))


def run(sizes: list[int]) -> str:
    rows = []
    rng = random.Random(0)
    for n in sizes:
        ids = [rng.randrange(32000) for _ in range(n)]
        body = chat_body(n, stream=False)
        contexts = {False: context_response(ids, b64=False), True: context_response(ids, b64=True)}
        gen = generation_response(n)
        baseline = None
        for name, cls, tokids, strip in VARIANTS:
            mode = cls(tokids_b64=tokids, strip_history=strip)
            call = functools.partial(one_request, mode, body, contexts[tokids], gen)
            seconds = time_call(call, min_time=0.3)
            baseline = baseline or seconds
            rows.append(
                [
                    f"{n:,}",
                    name,
                    f"{len(body) / 1e3:,.0f} KB + {len(contexts[tokids]) / 1e3:,.0f} KB",
                    f"{seconds * 1e6:,.1f}",
                    f"{baseline / seconds:,.1f}x",
                ]
            )
    headers = ["prompt ids", "orchestrator mode", "client body + ctx response", "µs / request", "vs baseline"]
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.orchestrator_work", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--sizes", default="4000,40000,128000", help="prompt lengths in ids (comma-separated)"
    )
    args = parser.parse_args(argv)
    print(f"fastcore backend: {fastcore.backend}")
    print(run([int(s) for s in args.sizes.split(",")]))


if __name__ == "__main__":
    main()
