"""Torch worker benchmark: ``python -m bench.worker [--batches 1,8,32] [--max-tokens 64] [--device auto]``.

1. Serving: a real ``both`` worker process on the tiny model (``fastcore-serve
   worker``), driven over HTTP with B concurrent streaming completions, for
   each B. It reports time to first token (median, p90), aggregate decode
   tokens/s, and the speed-up of batch B over batch 1 measured in the same
   run: the gain of continuous batching.
2. Prompt-id path: per request, what a worker spends on the prompt ids
   with the base64 fast path (context side: ``fastcore.encode_tokens`` straight
   from the int32 array into the response JSON; generation side: the body
   loaded by the worker's JSON loader, the ids decoded by ``fastcore.decode_tokens``
   from a view of its bytes, range-checked) beside the list path (``tolist`` +
   JSON list; the same loader, the list parsed by pysimdjson into int64), for
   several prompt lengths. These are the worker's own functions
   (``server.worker.request``, ``server.worker.responses``), not copies.
3. Generation request parse: the worker's request read (``RequestReader.read``:
   the body loaded once, the fields, the ids) on whole generation-leg bodies
   (docs/protocol.md (3)) as an orchestrator sends them, ids as base64 or as a list,
   ``messages`` cut to the last one (gate ``gen_strip_message_history``) or the
   whole agentic history (about 4 bytes of text per prompt id: 160 KB at 40k),
   as JSON and as msgpack (``X-TRTLLM-Msgpack: 1``), on each scanner twin, beside
   the stdlib reference (``json.loads`` of the whole JSON body, then the same
   field reader), in the same run. ``--parse`` runs only this table.

Absolute numbers depend on the machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, cast

import aiohttp
import msgspec
import numpy as np

import fastcore
from bench._timing import format_table, time_call
from bench.deploy import free_port
from bench.workload import agentic_messages
from server.http import Request
from server.worker import request as worker_request
from server.worker import responses
from server.worker.cli import default_torch_threads
from server.worker.internal_auth import InternalAuth
from server.worker.json_body import JSON_BODY, JSONBody, load_json_body
from server.worker.tokenizer import Tokenizer


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"worker exited with {proc.returncode} before it was healthy")
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"worker at {url} not healthy after {timeout:.0f} s")


async def _one_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, float, int]:
    """(time to first token, time to last token, completion tokens) of one streamed request."""
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"worker answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                tokens = chunk["usage"]["completion_tokens"]
                continue
            now = time.perf_counter() - t0
            if not first:
                first = now
            last = now
    return first, last, tokens


async def _serving_round(url: str, batch: int, max_tokens: int, prompt_len: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        body = {
            "model": "tiny",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        await _one_stream(session, url, {**body, "prompt": "warm up"})
        bodies = [{**body, "prompt": f"{i:04d} " + "x" * (prompt_len - 6)} for i in range(batch)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one_stream(session, url, b) for b in bodies))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    decode_tokens = sum(r[2] - 1 for r in results)
    decode_span = max(r[1] for r in results) - min(r[0] for r in results)
    return {
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "decode_tps": decode_tokens / decode_span if decode_span > 0 else float("nan"),
        "total_tps": sum(r[2] for r in results) / wall,
    }


def bench_serving(batches: list[int], max_tokens: int, prompt_len: int, device: str, threads: int) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "worker",
        "--model",
        "tiny",
        "--port",
        str(port),
        "--device",
        device,
        "--torch-threads",
        str(threads),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(_wait_healthy(url, proc))
        rows = []
        base: float | None = None
        for batch in batches:
            r = asyncio.run(_serving_round(url, batch, max_tokens, prompt_len))
            base = base or r["decode_tps"]
            rows.append(
                [
                    batch,
                    f"{r['ttft_p50'] * 1e3:.1f}",
                    f"{r['ttft_p90'] * 1e3:.1f}",
                    f"{r['decode_tps']:.0f}",
                    f"{r['total_tps']:.0f}",
                    f"{r['decode_tps'] / base:.2f}x",
                ]
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    headers = ["batch", "TTFT p50 ms", "TTFT p90 ms", "decode tok/s", "total tok/s", "decode vs batch 1"]
    return format_table(headers, rows)


def _time_prompt_id_paths(n: int, vocab: int) -> tuple[dict[str, float], int, int]:
    """Seconds per request of each side of each path, and the two generation body sizes."""
    ids = np.random.default_rng(n).integers(0, vocab, n, dtype=np.int32)
    body_b64 = json.dumps({"prompt_token_ids_b64": fastcore.encode_tokens(ids).decode("ascii")}).encode()
    body_list = json.dumps({"prompt_token_ids": ids.tolist()}).encode()

    head = {"id": "cmpl-bench", "object": "text_completion"}  # the rest of a context response

    def ctx_b64() -> bytes:
        return responses.dump_with_members(head, responses.prompt_ids_members(ids, b64=True))

    def ctx_list() -> bytes:
        return responses.dump_with_members(head, responses.prompt_ids_members(ids, b64=False))

    def gen_b64() -> np.ndarray:
        body = JSON_BODY.load(body_b64, "chat")
        return worker_request._ids_from_b64(body["prompt_token_ids_b64"], vocab, 1 << 20)

    def gen_list() -> np.ndarray:
        body = JSON_BODY.load(body_list, "chat")
        return worker_request._ids_from_list(body["prompt_token_ids"], "prompt_token_ids", vocab)

    assert np.array_equal(gen_b64(), gen_list())
    calls = {"ctx_b64": ctx_b64, "ctx_list": ctx_list, "gen_b64": gen_b64, "gen_list": gen_list}
    return {name: time_call(fn) for name, fn in calls.items()}, len(body_b64), len(body_list)


def bench_prompt_ids(lengths: list[int]) -> str:
    vocab = 128_256  # Llama 3's: ids spread over the whole range that JSON must spell out
    rows = []
    for n in lengths:
        t, size_b64, size_list = _time_prompt_id_paths(n, vocab)
        b64_total = t["ctx_b64"] + t["gen_b64"]
        list_total = t["ctx_list"] + t["gen_list"]
        rows.append(
            [
                n,
                f"{t['ctx_b64'] * 1e6:.1f}",
                f"{t['ctx_list'] * 1e6:.1f}",
                f"{t['gen_b64'] * 1e6:.1f}",
                f"{t['gen_list'] * 1e6:.1f}",
                f"{b64_total * 1e6:.1f}",
                f"{list_total * 1e6:.1f}",
                f"{list_total / b64_total:.1f}x",
                f"{size_b64 / 1024:.1f} / {size_list / 1024:.1f}",
            ]
        )
    headers = [
        "prompt ids",
        "ctx b64 µs",
        "ctx list µs",
        "gen b64 µs",
        "gen list µs",
        "b64 total µs",
        "list total µs",
        "list / b64",
        "body KiB b64 / list",
    ]
    return format_table(headers, rows)


class _VocabOnly:
    """All of a tokenizer that the request reader reads when the prompt comes as ids."""

    vocab_size = 128_256


def generation_body(n: int, *, route: str, b64: bool, history: bool) -> tuple[dict[str, Any], np.ndarray]:
    """A generation-leg body (docs/protocol.md (3)) with ``n`` prompt ids, and the ids."""
    ids = np.random.default_rng(n).integers(0, _VocabOnly.vocab_size, n, dtype=np.int32)
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":
        messages = agentic_messages(n)
        body["messages"] = messages if history else messages[-1:]
    body["disaggregated_params"] = {
        "request_type": "generation_only",
        "first_gen_tokens": [1734],
        "ctx_request_id": 48213,
        "disagg_request_id": 7205759403792793601,
        "encoded_opaque_state": None,
        "ctx_info_endpoint": "http://127.0.0.1:8101/kv/48213",
        "draft_tokens": None,
        "ctx_usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
    }
    if b64:
        body["prompt_token_ids_b64"] = fastcore.encode_tokens(ids).decode("ascii")
    else:
        body["prompt_token_ids" if route == "chat" else "prompt"] = ids.tolist()
    return body, ids


def _twin_readers() -> dict[str, type[worker_request.RequestReader]]:
    """The request reader on each scanner twin importable here (``c``: the compiled one)."""
    import importlib

    twins = {}
    for name, module in (("c", "fastcore._scan"), ("py", "fastcore._scan_py")):
        try:
            scanner = importlib.import_module(module)
        except ImportError:
            continue
        loader = type(f"JSONBody_{name}", (JSONBody,), {"scanner": scanner})()
        twins[name] = type(f"RequestReader_{name}", (worker_request.RequestReader,), {"json_body": loader})
    return twins


def _leg(raw: bytes, *, msgpack: bool) -> Request:
    request = Request()
    request.method, request.body = b"POST", raw
    request.headers = [(b"X-TRTLLM-Msgpack", b"1")] if msgpack else []
    return request


def bench_generation_parse(lengths: list[int], histories: tuple[bool, ...] = (False, True)) -> str:
    tokenizer = cast(Tokenizer, _VocabOnly())
    auth = InternalAuth(None, None, "bench", accept_trtllm_orchestrator=False)
    readers = _twin_readers()
    rows = []
    cases = [("chat", h) for h in histories] + [("completions", False)]
    for n in lengths:
        for b64 in (True, False):
            for route, history in cases:
                body, ids = generation_body(n, route=route, b64=b64, history=history)
                raw = json.dumps(body).encode()
                packed = msgspec.msgpack.encode(body)
                r: Any = route

                def reference(raw: bytes = raw, r: Any = r) -> Any:
                    return worker_request.read_request(
                        load_json_body(raw), r, tokenizer=tokenizer, model_name="tiny", max_context=1 << 18
                    )

                assert np.array_equal(reference().prompt_ids, ids)
                before = time_call(reference)
                messages = "-" if route == "completions" else "history" if history else "last"
                for twin, reader_class in readers.items():
                    reader = reader_class(tokenizer, "tiny", 1 << 18, "both")
                    for form, leg in (
                        ("json", _leg(raw, msgpack=False)),
                        ("msgpack", _leg(packed, msgpack=True)),
                    ):

                        def read(leg: Request = leg, reader: Any = reader, r: Any = r) -> Any:
                            return reader.read(leg, r, auth)

                        assert np.array_equal(read().prompt_ids, ids)
                        after = time_call(read)
                        rows.append(
                            [
                                n,
                                "b64" if b64 else "list",
                                route,
                                messages,
                                form,
                                twin,
                                f"{len(leg.body) / 1024:.0f}",
                                f"{before * 1e6:.1f}",
                                f"{after * 1e6:.1f}",
                                f"{before / after:.1f}x",
                            ]
                        )
    headers = [
        "prompt ids",
        "ids as",
        "route",
        "messages",
        "body",
        "scan twin",
        "body KiB",
        "json.loads µs",
        "reader µs",
        "speed-up",
    ]
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32", help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="prompt length in tokens (bytes) per request"
    )
    parser.add_argument(
        "--lengths", default="1000,8000,32000,128000", help="prompt lengths for the id-path table"
    )
    parser.add_argument(
        "--gen-lengths", default="4000,40000,128000", help="prompt lengths for the generation-parse table"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=default_torch_threads(),
        help="the worker's torch threads (default: the worker's own default)",
    )
    parser.add_argument("--skip-serving", action="store_true", help="only the prompt-id and parse tables")
    parser.add_argument(
        "--parse",
        action="store_true",
        help="only the generation request parse (40k ids, the agentic history: --gen-lengths 40000)",
    )
    args = parser.parse_args(argv)
    print(f"fastcore backend: {fastcore.backend}")
    if args.parse:
        print("\n## Generation request parse per request: the worker's reader vs json.loads of the body\n")
        print(bench_generation_parse([int(n) for n in args.gen_lengths.split(",")], histories=(True,)))
        return 0
    if not args.skip_serving:
        import torch

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        print(
            f"\n## Serving: tiny model, device {device}, {args.torch_threads} torch threads, "
            f"prompt {args.prompt_len} tokens, {args.max_tokens} completion tokens per request\n"
        )
        batches = [int(b) for b in args.batches.split(",")]
        print(bench_serving(batches, args.max_tokens, args.prompt_len, device, args.torch_threads))
    print("\n## Prompt-id path per request: base64 (fastcore) vs JSON list\n")
    print(bench_prompt_ids([int(n) for n in args.lengths.split(",")]))
    print("\n## Generation request parse per request: the worker's reader vs json.loads of the body\n")
    print(bench_generation_parse([int(n) for n in args.gen_lengths.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
