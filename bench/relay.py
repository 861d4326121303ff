"""Relay benchmark: ``python -m bench.relay [--sizes 4000,40000,128000] [--python]``.

Per request, at each prompt length, in one run: the work an orchestrator does
between receiving the context response and sending the generation request.

(a) pydantic baseline: ``json.loads`` of the context response, validation into
    response models, ``model_dump_json`` of the generation request (id list
    and message history);
(a') (a) with the leg sent as msgpack (``relay: parsed-msgpack``), as newer
    trtllm-serve orchestrators send it: ``model_dump`` then a msgpack encode;
(b) (a) with the ids relayed as a base64 string field through the models;
(c) orjson parse + dump (dicts, id list);
(d) msgspec typed decode + encode (Structs, id list);
(e) ``fastcore.relay.build_generation_request``, b64 gate on (the fast path): the relay
    kernels the orchestrator runs, reading the context response and writing the leg;
(e+) (e) from the raw client body, no route given (no ``ClientScan`` kept: one more scan);
(e') (e) with the gate off (the id list spliced verbatim);
(e~) (e) as the orchestrator sends it: ``generation_request_pieces``, the leg as views of the client
    body and the context response around the new text (one vectored write), no joined copy;
(f) a memcpy of (e)'s output size: one allocation and copy, the floor.

(a)-(d) start from the client request they parsed for the context leg, and
(e) from the ``ClientScan`` that ``read_client_request`` made for it: the same
head start. The chat history holds about 4 bytes of text per prompt token.
Then the scanner's throughput on a token-heavy and a text-heavy body, beside
``json.loads`` / orjson / msgspec parses of the same bytes. Times are best-of
runs on a shared machine: read the ratios.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
from typing import Any

import msgspec
import numpy as np
import orjson

import fastcore
from bench._timing import format_table, time_call
from fastcore import _relay_py as relay_paths
from fastcore import relay
from server.orchestrator.relay_modes import ChatCompletionRequest as ChatRequest
from server.orchestrator.relay_modes import ChatCompletionResponse as ChatResponse

SIZES = (4_000, 40_000, 128_000)
TARGET_SIZE = 40_000
WORDS = "the of and to in is was for on that with as by at from it this be are an or which had not".split()


# -- bodies --------------------------------------------------------------------------------------------


def chat_history(prompt_ids: int, rng: random.Random) -> list[dict[str, str]]:
    """Alternating turns totalling about 4 bytes of text per prompt id, with the odd escape."""
    messages = [{"role": "system", "content": 'You are a helpful assistant.\nAnswer "briefly".'}]
    budget = 4 * prompt_ids
    while budget > 0:
        turn = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 400)))
        turn = turn.replace(" was ", ' "was"\n', 1)
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": turn})
        budget -= len(turn)
    return messages


def make_bodies(prompt_ids: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = np.random.default_rng(seed).integers(0, 128_000, prompt_ids, dtype=np.int32)
    id_list = ids.tolist()
    client = {
        "model": "llama-3-8b",
        "messages": chat_history(prompt_ids, rng),
        "max_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": True,
    }
    params = {
        "request_type": "context_only",
        "first_gen_tokens": [1734],
        "ctx_request_id": 48213,
        "disagg_request_id": 7205759403792793601,
        "encoded_opaque_state": None,
        "ctx_info_endpoint": "127.0.0.1:8101",
        "draft_tokens": None,
    }
    response: dict[str, Any] = {
        "id": "chatcmpl-5d1f",
        "object": "chat.completion",
        "created": 1764680000,
        "model": "llama-3-8b",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The"},
                "finish_reason": "length",
                "disaggregated_params": params,
            }
        ],
        "usage": {"prompt_tokens": prompt_ids, "completion_tokens": 1, "total_tokens": prompt_ids + 1},
    }
    ctx_list = json.dumps({**response, "prompt_token_ids": id_list}).encode()
    ctx_b64 = json.dumps(
        {
            **response,
            "prompt_token_ids": None,
            "prompt_token_ids_b64": base64.b64encode(ids.tobytes()).decode(),
        }
    ).encode()
    return {
        "client": client,
        "client_body": json.dumps(client).encode(),
        "ctx_list": ctx_list,
        "ctx_b64": ctx_b64,
    }


# -- (a)/(b): a pydantic orchestrator: the orchestrator's own `relay: parsed` models -----------------------------------------------------------


def pydantic_relay(request: ChatRequest, ctx: bytes, b64: bool, msgpack: bool = False) -> bytes:
    response = ChatResponse.model_validate(json.loads(ctx))
    params = response.choices[0].disaggregated_params
    assert params is not None
    params = params.model_copy(update={"request_type": "generation_only", "ctx_usage": response.usage})
    update: dict[str, Any] = {"disaggregated_params": params}
    if b64:
        update["prompt_token_ids_b64"] = response.prompt_token_ids_b64
    else:
        update["prompt_token_ids"] = response.prompt_token_ids
    leg = request.model_copy(update=update)
    if msgpack:  # as server/orchestrator/relay_parsed.py's ParsedMsgpackRelay sends it
        return _msgpack_encoder.encode(leg.model_dump(mode="json", exclude_none=True))
    return leg.model_dump_json(exclude_none=True).encode()


_msgpack_encoder = msgspec.msgpack.Encoder()


# -- (c): orjson -----------------------------------------------------------------------------------------


def orjson_relay(client: dict[str, Any], ctx: bytes) -> bytes:
    response = orjson.loads(ctx)
    params = dict(response["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    params["ctx_usage"] = response["usage"]
    return orjson.dumps(
        {**client, "disaggregated_params": params, "prompt_token_ids": response["prompt_token_ids"]}
    )


# -- (d): msgspec ----------------------------------------------------------------------------------------


class MUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class MParams(msgspec.Struct, omit_defaults=True):
    request_type: str
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    disagg_request_id: int | None = None
    encoded_opaque_state: str | None = None
    ctx_info_endpoint: str | None = None
    draft_tokens: list[int] | None = None
    ctx_usage: MUsage | None = None


class MMessage(msgspec.Struct):
    role: str
    content: str | None = None


class MChoice(msgspec.Struct):
    index: int
    message: MMessage
    finish_reason: str | None = None
    disaggregated_params: MParams | None = None


class MResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[MChoice]
    usage: MUsage
    prompt_token_ids: list[int] | None = None


class MRequest(msgspec.Struct, omit_defaults=True):
    model: str
    messages: list[MMessage]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    disaggregated_params: MParams | None = None
    prompt_token_ids: list[int] | None = None


_m_decoder = msgspec.json.Decoder(MResponse)
_m_encoder = msgspec.json.Encoder()


def msgspec_relay(request: MRequest, ctx: bytes) -> bytes:
    response = _m_decoder.decode(ctx)
    params = response.choices[0].disaggregated_params
    assert params is not None
    params = msgspec.structs.replace(params, request_type="generation_only", ctx_usage=response.usage)
    out = msgspec.structs.replace(
        request, disaggregated_params=params, prompt_token_ids=response.prompt_token_ids
    )
    return _m_encoder.encode(out)


# -- the run ---------------------------------------------------------------------------------------------


def _without_nulls(value: Any) -> Any:
    # The typed contenders leave out null fields (exclude_none / omit_defaults); a worker reads both alike.
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def check_equivalent(bodies: dict[str, Any]) -> None:
    """All contenders build the same request (as parsed JSON, nulls aside): the race is fair."""
    request = ChatRequest.model_validate(bodies["client"])
    fast = json.loads(
        relay.build_generation_request(
            bodies["client_body"], bodies["ctx_list"], tokids_b64=False, strip_history=False
        )
    )
    for other in (
        pydantic_relay(request, bodies["ctx_list"], False),
        orjson_relay(bodies["client"], bodies["ctx_list"]),
        msgspec_relay(msgspec.convert(bodies["client"], MRequest), bodies["ctx_list"]),
    ):
        assert _without_nulls(json.loads(other)) == _without_nulls(fast)
    as_msgpack = msgspec.msgpack.decode(pydantic_relay(request, bodies["ctx_list"], False, msgpack=True))
    assert _without_nulls(as_msgpack) == _without_nulls(fast)
    fast_b64 = json.loads(
        relay.build_generation_request(
            bodies["client_body"], bodies["ctx_b64"], tokids_b64=True, strip_history=False
        )
    )
    assert _without_nulls(json.loads(pydantic_relay(request, bodies["ctx_b64"], True))) == _without_nulls(
        fast_b64
    )


def time_contenders(size: int, min_time: float) -> tuple[dict[str, float], int]:
    """Seconds per request of each contender at ``size`` prompt ids, and (e)'s output size."""
    bodies = make_bodies(size)
    check_equivalent(bodies)
    client = bodies["client"]
    request = ChatRequest.model_validate(client)
    m_request = msgspec.convert(client, MRequest)
    client_body, ctx_list, ctx_b64 = bodies["client_body"], bodies["ctx_list"], bodies["ctx_b64"]
    read = relay.read_client_request(client_body, True)
    output = relay.build_generation_request(read, ctx_b64, tokids_b64=True, strip_history=False)
    source = bytearray(len(output))
    calls = {
        "a": lambda: pydantic_relay(request, ctx_list, False),
        "a'": lambda: pydantic_relay(request, ctx_list, False, msgpack=True),
        "b": lambda: pydantic_relay(request, ctx_b64, True),
        "c": lambda: orjson_relay(client, ctx_list),
        "d": lambda: msgspec_relay(m_request, ctx_list),
        "e": lambda: relay.build_generation_request(read, ctx_b64, tokids_b64=True, strip_history=False),
        "e+": lambda: relay.build_generation_request(
            client_body, ctx_b64, tokids_b64=True, strip_history=False
        ),
        "e'": lambda: relay.build_generation_request(read, ctx_list, tokids_b64=False, strip_history=False),
        "e~": lambda: relay.generation_request_pieces(
            read, relay.read_context_response(ctx_b64, read.max_tokens), True, False
        ),
        "f": lambda: bytes(source),
    }
    return {name: time_call(call, min_time=min_time) for name, call in calls.items()}, len(output)


def per_request(
    sizes: tuple[int, ...], min_time: float
) -> tuple[list[list[Any]], dict[int, dict[str, float]]]:
    rows = []
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        times, output_size = time_contenders(size, min_time)
        results[size] = times
        us = {k: f"{v * 1e6:,.1f}" for k, v in times.items()}
        rows.append(
            [
                f"{size:,}",
                f"{output_size / 1024:,.0f} KiB",
                us["a"],
                us["a'"],
                us["b"],
                us["c"],
                us["d"],
                us["e"],
                us["e+"],
                us["e'"],
                us["e~"],
                us["f"],
                f"{times['a'] / times['e']:,.0f}x",
                "{:,.0f}x".format(times["a'"] / times["e"]),
                f"{times['b'] / times['e']:,.1f}x",
                f"{times['e'] / times['f']:,.1f}x",
            ]
        )
    return rows, results


def rates(
    body: bytes, paths: tuple[tuple[str | int, ...], ...], scanner: Any, min_time: float
) -> list[float]:
    """GB/s of the scanner (validating, then not) and of three parsers on ``body``."""
    calls = [
        lambda: scanner.find_spans(body, paths),
        lambda: scanner.find_spans(body, paths, validate=False),
        lambda: json.loads(body),
        lambda: orjson.loads(body),
        lambda: msgspec.json.decode(body),
    ]
    return [len(body) / time_call(call, min_time=min_time) / 1e9 for call in calls]


def throughput(size: int, min_time: float, scanner: Any) -> list[list[Any]]:
    bodies = make_bodies(size)
    cases = {
        "token-heavy (b64 ctx response)": (bodies["ctx_b64"], relay_paths.CONTEXT_RESPONSE_PATHS),
        "token-heavy (id-list ctx response)": (bodies["ctx_list"], relay_paths.CONTEXT_RESPONSE_PATHS),
        "text-heavy (chat request)": (bodies["client_body"], relay_paths.CLIENT_REQUEST_PATHS),
    }
    return [
        [name, f"{len(body) / 1024:,.0f} KiB"] + [f"{v:.2f}" for v in rates(body, paths, scanner, min_time)]
        for name, (body, paths) in cases.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt lengths in ids")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--python", action="store_true", help="also time the pure-Python scanner twin")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))

    print(f"fastcore backend: {fastcore.backend}")
    print("\nPer request, µs (best of runs): context response in, generation request out\n")
    rows, results = per_request(sizes, args.min_time)
    print(
        format_table(
            [
                "prompt ids",
                "output",
                "(a) pydantic",
                "(a') pydantic msgpack",
                "(b) pydantic b64",
                "(c) orjson",
                "(d) msgspec",
                "(e) relay b64",
                "(e+) + client scan",
                "(e') relay list",
                "(e~) b64 pieces",
                "(f) memcpy",
                "a/e",
                "a'/e",
                "b/e",
                "e/f",
            ],
            rows,
        )
    )
    print("\nScanner throughput, GB/s (the relay's paths; parsers for reference)\n")
    size = max(sizes)
    headers = ["body", "size", "find_spans", "validate=False", "json.loads", "orjson.loads", "msgspec decode"]
    print(format_table(headers, throughput(size, args.min_time, fastcore._scan_impl)))
    if args.python:
        from fastcore import _scan_py

        print("\nPure-Python twin, GB/s\n")
        print(format_table(headers, throughput(min(sizes), args.min_time, _scan_py)))

    if TARGET_SIZE in results:
        t = results[TARGET_SIZE]
        checks = [
            ("(e) >= 100x faster than (a)", t["a"] / t["e"], t["a"] / t["e"] >= 100),
            ("(e) >= 100x faster than (a')", t["a'"] / t["e"], t["a'"] / t["e"] >= 100),
            ("(e) >= 10x faster than (b)", t["b"] / t["e"], t["b"] / t["e"] >= 10),
            # (e+) re-reads the raw client body that (a)-(d) do not re-parse: a stricter comparison.
            ("(e+) >= 100x faster than (a)", t["a"] / t["e+"], t["a"] / t["e+"] >= 100),
            ("(e+) >= 10x faster than (b)", t["b"] / t["e+"], t["b"] / t["e+"] >= 10),
            ("(e) within 5x of (f)", t["e"] / t["f"], t["e"] / t["f"] <= 5),
            ("(e+) within 5x of (f)", t["e+"] / t["f"], t["e+"] / t["f"] <= 5),
            ("(e~) faster than (e): no joined copy", t["e"] / t["e~"], t["e~"] < t["e"]),
        ]
        print(f"\nTargets at {TARGET_SIZE:,} ids:")
        for name, ratio, met in checks:
            print(f"  {'met ' if met else 'MISS'} {name}: {ratio:,.1f}x")
        if len(results) > 1:
            small, large = min(results), max(results)
            growth = results[large]["e"] / results[small]["e"]
            floor_growth = results[large]["f"] / results[small]["f"]
            print(
                f"  (e) grows {growth:.1f}x from {small:,} to {large:,} ids; the memcpy floor grows {floor_growth:.1f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
