"""The orchestrator's own work per request, fast relay vs the parsed baseline, by prompt length.

    python -m bench.orchestrator_work            # 4k, 40k, 128k prompt ids
    python -m bench.orchestrator_work --sizes 1000,40000

Each row is one request's synchronous work on the orchestrator's event loop,
exactly the calls its handler makes (server/orchestrator/relay_modes.py):
validate the client body, build the context request, read the context
response, build the generation request (both legs as the pieces the
orchestrator writes: ``context_pieces``, ``generation_pieces``), and relay a
(non-streaming) generation response to the client. Network and workers are left out: this is
the CPU an orchestrator core spends per request, the thing that caps its
requests/s. Workload: an agentic chat request (~4 bytes of history per prompt
token, bench.workload) and its context response with the prompt ids as a JSON
list (gates off) or as base64 (gen_tokids_ctxbytes).

Ratios are against the parsed baseline with gates off (what a pydantic
orchestrator does today) and are measured in the same run.

    python -m bench.orchestrator_work --instructions   # 250 and 40k ids, under valgrind

counts the CPU instructions of the fast relay's request instead (callgrind: a
deterministic count, unlike wall time on a shared machine): the same calls run
twice under ``valgrind --tool=callgrind``, ``--loops`` apart, and the difference
of the two totals is divided by the difference of the loop counts, so start-up
cancels out.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from typing import Any

import fastcore
from bench._timing import format_table, instructions_per_loop, time_call
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
    mode.context_pieces(req, 7205759403792793601)
    result = mode.read_context(req, ctx)
    mode.generation_pieces(req, result)
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


def _bodies(n: int, tokids: bool) -> tuple[bytes, bytes, bytes]:
    rng = random.Random(0)
    ids = [rng.randrange(32000) for _ in range(n)]
    return chat_body(n, stream=False), context_response(ids, b64=tokids), generation_response(n)


def _loop(size: int, tokids: bool, strip: bool, loops: int) -> None:
    """The measured process: warm up, then ``loops`` requests (``--_loop``)."""
    mode = FastRelay(tokids_b64=tokids, strip_history=strip)
    body, ctx, gen = _bodies(size, tokids)
    one_request(mode, body, ctx, gen)
    for _ in range(loops):
        one_request(mode, body, ctx, gen)


def count_instructions(size: int, tokids: bool, strip: bool, loops: tuple[int, int]) -> float:
    """CPU instructions per request of the fast relay (callgrind, difference of two runs)."""
    return instructions_per_loop(
        lambda count: [
            "-m",
            "bench.orchestrator_work",
            "--_loop",
            f"{size},{int(tokids)},{int(strip)},{count}",
        ],
        loops,
        "--instructions needs valgrind on PATH",
    )


def run_instructions(sizes: list[int], loops: tuple[int, int]) -> str:
    rows = []
    for n in sizes:
        body, _, _ = _bodies(n, False)
        for name, cls, tokids, strip in VARIANTS:
            if cls is not FastRelay:
                continue  # the parsed mode under valgrind takes minutes per size
            per_request = count_instructions(n, tokids, strip, loops)
            rows.append([f"{n:,}", name, f"{len(body) / 1e3:,.1f} KB", f"{per_request / 1e3:,.1f}k"])
    headers = ["prompt ids", "orchestrator mode", "client body", "instructions / request"]
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.orchestrator_work", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--sizes", default="4000,40000,128000", help="prompt lengths in ids (comma-separated)"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count CPU instructions per request of the fast modes under valgrind (default sizes 250,40000)",
    )
    parser.add_argument(
        "--loops", default="100,1100", help="--instructions: the two runs' request counts (comma-separated)"
    )
    parser.add_argument("--_loop", help=argparse.SUPPRESS)  # the process --instructions measures
    args = parser.parse_args(argv)
    if args._loop:
        size, tokids, strip, loops = (int(v) for v in args._loop.split(","))
        _loop(size, bool(tokids), bool(strip), loops)
        return
    print(f"fastcore backend: {fastcore.backend}")
    if args.instructions:
        sizes = "250,40000" if args.sizes == parser.get_default("sizes") else args.sizes
        low, high = (int(v) for v in args.loops.split(","))
        print(run_instructions([int(v) for v in sizes.split(",")], (low, high)))
        return
    print(run([int(s) for s in args.sizes.split(",")]))


if __name__ == "__main__":
    main()
