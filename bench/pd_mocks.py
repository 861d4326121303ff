"""Instant prefill/decode workers speaking vLLM's or SGLang's PD protocol, for the Rust routers.

Benchmark code. One process serves a prefill port and a decode port (one
event loop, raw asyncio Protocols + httptools, see ``bench/rawfloor.py``) so
that the mocks cost little on the load generator's core. Every generation
request is checked for the fields its router must add; a missing or wrong one
is a protocol violation, counted and sampled at ``GET /mock_stats``.

vLLM (``vllm-router --vllm-pd-disaggregation``): the router sends the prefill
worker the client's request with ``max_tokens: 1``, ``stream: false`` and
``kv_transfer_params: {"do_remote_decode": true, ...}``; the prefill answer is
a chat completion carrying ``kv_transfer_params`` (``do_remote_prefill``,
``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``),
which the router copies into the decode request. Here the block id is unique
per prefill, so the decode side checks it was issued (and only once).

SGLang (``sglang_router.launch_router --pd-disaggregation``): the router sends
the same request to prefill and decode at once with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` added; the decode answer is the
client's, the prefill answer is discarded. Here each room must arrive once on
each side (``unpaired`` counts rooms seen on one side only).

    python -m bench.pd_mocks --flavor vllm --prefill-port 8001 --decode-port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
from collections.abc import Callable
from typing import Any

try:
    import orjson

    loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson is in the bench extra
    loads = json.loads

from bench.rawfloor import LISTEN_BACKLOG, ServerProtocol

FLAVORS = ("vllm", "sglang")
ENGINE_ID = "mock-engine-0"
MAX_MOCK_TOKENS = 256
PROBE_PATHS = {
    b"/health",
    b"/health_generate",
    b"/v1/models",
    b"/get_server_info",
    b"/server_info",
    b"/get_model_info",
    b"/model_info",
    b"/metrics",
    b"/version",
}
_WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "token", "cache", "batch"]


def check_vllm_prefill(req: dict[str, Any]) -> list[str]:
    problems = []
    if req.get("max_tokens") != 1 and req.get("max_completion_tokens") != 1:
        problems.append(f"prefill max_tokens={req.get('max_tokens')!r}, expected 1")
    if req.get("stream"):
        problems.append("prefill request is streaming")
    ktp = req.get("kv_transfer_params")
    if not isinstance(ktp, dict) or ktp.get("do_remote_decode") is not True:
        problems.append(f"prefill kv_transfer_params={ktp!r}, expected do_remote_decode=true")
    return problems


def check_vllm_decode(req: dict[str, Any], issued: set[int]) -> list[str]:
    ktp = req.get("kv_transfer_params")
    if not isinstance(ktp, dict):
        return [f"decode kv_transfer_params={ktp!r}, expected the prefill's"]
    problems = []
    if ktp.get("do_remote_prefill") is not True or ktp.get("remote_engine_id") != ENGINE_ID:
        problems.append(f"decode kv_transfer_params not copied from prefill: {ktp!r}"[:200])
    blocks = ktp.get("remote_block_ids")
    if not (isinstance(blocks, list) and blocks and blocks[0] in issued):
        problems.append(f"decode remote_block_ids={blocks!r} not issued by a prefill (or reused)"[:200])
    else:
        issued.discard(blocks[0])
    if req.get("max_tokens") == 1 and req.get("max_completion_tokens") is None:
        problems.append("decode max_tokens is the prefill's 1")
    return problems


def check_sglang(req: dict[str, Any]) -> list[str]:
    problems = []
    if not isinstance(req.get("bootstrap_host"), str):
        problems.append(f"bootstrap_host={req.get('bootstrap_host')!r}")
    if not isinstance(req.get("bootstrap_port"), int):
        problems.append(f"bootstrap_port={req.get('bootstrap_port')!r}")
    if not isinstance(req.get("bootstrap_room"), int):
        problems.append(f"bootstrap_room={req.get('bootstrap_room')!r}")
    return problems


class Mocks:
    """The two roles' state: protocol checks, counters, the answers."""

    def __init__(self, flavor: str) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor {flavor!r} not in {FLAVORS}")
        self.flavor = flavor
        self.block_ids = itertools.count(1)
        self.issued: set[int] = set()
        self.rooms: dict[int, str] = {}
        self.stats: dict[str, Any] = {
            "flavor": flavor,
            "prefill": 0,
            "decode": 0,
            "violations": 0,
            "samples": [],
            "unknown_paths": {},
        }

    def violation(self, problems: list[str]) -> None:
        self.stats["violations"] += 1
        if len(self.stats["samples"]) < 10:
            self.stats["samples"].append("; ".join(problems))

    def generate(self, role: str, path: bytes, body: bytes) -> tuple[int, bytes, list[bytes]]:
        """(status, content type, body parts) for one generation request on ``role``."""
        self.stats[role] += 1
        try:
            req = loads(body)
        except ValueError as exc:
            self.violation([f"{role}: body is not JSON: {exc}"])
            return 400, b"application/json", [b'{"error": "bad json"}']
        problems: list[str]
        extra = b""
        if self.flavor == "vllm" and role == "prefill":
            problems = check_vllm_prefill(req)
            block = next(self.block_ids)
            self.issued.add(block)
            extra = (
                b', "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, '
                b'"remote_engine_id": "%s", "remote_block_ids": [%d], "remote_host": "127.0.0.1", '
                b'"remote_port": 5600, "tp_size": 1}'
            ) % (ENGINE_ID.encode(), block)
        elif self.flavor == "vllm":
            problems = check_vllm_decode(req, self.issued)
        else:
            problems = check_sglang(req)
            room = req.get("bootstrap_room")
            if isinstance(room, int):
                seen = self.rooms.pop(room, None)
                if seen == role:
                    problems.append(f"bootstrap_room {room} sent twice to {role}")
                elif seen is None:
                    self.rooms[room] = role
        if problems:
            self.violation([f"{role}: {p}" for p in problems])
        n = max(1, min(int(req.get("max_tokens") or req.get("max_completion_tokens") or 16), MAX_MOCK_TOKENS))
        model = str(req.get("model", "mock")).encode()
        prompt_tokens = len(body) // 4
        chat = path.endswith(b"/chat/completions")
        if req.get("stream"):
            usage = isinstance(req.get("stream_options"), dict) and req["stream_options"].get("include_usage")
            return 200, b"text/event-stream", sse_events(model, n, chat, prompt_tokens if usage else None)
        return 200, b"application/json", [completion_json(model, n, chat, prompt_tokens, extra)]

    def snapshot(self) -> bytes:
        return json.dumps(
            {**self.stats, "unpaired": len(self.rooms), "issued_unused": len(self.issued)}
        ).encode()


def _text(n: int) -> str:
    return "".join(" " + _WORDS[i % len(_WORDS)] for i in range(n))


def completion_json(model: bytes, n: int, chat: bool, prompt_tokens: int, extra: bytes = b"") -> bytes:
    if chat:
        choice = '{"index": 0, "message": {"role": "assistant", "content": "%s"}, "logprobs": null, "finish_reason": "length"}'
    else:
        choice = '{"index": 0, "text": "%s", "logprobs": null, "finish_reason": "length"}'
    return (
        b'{"id": "cmpl-mock", "object": "%s", "created": 1700000000, "model": "%s", "choices": [%s], '
        b'"usage": {"prompt_tokens": %d, "completion_tokens": %d, "total_tokens": %d}%s}'
    ) % (
        b"chat.completion" if chat else b"text_completion",
        model,
        (choice % _text(n)).encode(),
        prompt_tokens,
        n,
        prompt_tokens + n,
        extra,
    )


def sse_events(model: bytes, n: int, chat: bool, usage_prompt_tokens: int | None) -> list[bytes]:
    """A role chunk (chat), ``n`` content chunks, a finish chunk, a usage chunk if asked, ``[DONE]``."""
    kind = b"chat.completion.chunk" if chat else b"text_completion"
    head = b'data: {"id": "cmpl-mock", "object": "%s", "created": 1700000000, "model": "%s", "choices": [' % (
        kind,
        model,
    )

    def event(choice: bytes, tail: bytes = b"") -> bytes:
        return head + choice + b"]" + tail + b"}\n\n"

    out = []
    if chat:
        out.append(
            event(b'{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}')
        )
    for i in range(n):
        word = b" " + _WORDS[i % len(_WORDS)].encode()
        if chat:
            out.append(event(b'{"index": 0, "delta": {"content": "%s"}, "finish_reason": null}' % word))
        else:
            out.append(event(b'{"index": 0, "text": "%s", "finish_reason": null}' % word))
    finish = (
        b'{"index": 0, "delta": {}, "finish_reason": "length"}'
        if chat
        else b'{"index": 0, "text": "", "finish_reason": "length"}'
    )
    out.append(event(finish))
    if usage_prompt_tokens is not None:
        p = usage_prompt_tokens
        out.append(
            head
            + b'], "usage": {"prompt_tokens": %d, "completion_tokens": %d, "total_tokens": %d}}\n\n'
            % (p, n, p + n)
        )
    out.append(b"data: [DONE]\n\n")
    return out


def make_handler(mocks: Mocks, role: str) -> Callable[[ServerProtocol, bytes, bytes, bytes, bool], None]:
    models = json.dumps(
        {"object": "list", "data": [{"id": "mock", "object": "model", "owned_by": "bench"}]}
    ).encode()
    info = json.dumps(
        {
            "model_path": "mock",
            "served_model_name": "mock",
            "is_generation": True,
            "disaggregation_mode": role,
            "tokenizer_path": "mock",
        }
    ).encode()

    def handler(conn: ServerProtocol, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            status, ctype, parts = mocks.generate(role, path, body)
            if conn.transport is None:
                return
            if ctype == b"text/event-stream":
                head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                framed = [head]
                for p in parts:
                    framed += [b"%x\r\n" % len(p), p, b"\r\n"]
                framed.append(b"0\r\n\r\n")
                conn.transport.writelines(framed)
                if not keep_alive:
                    conn.transport.close()
            else:
                conn.respond(status, ctype, b"".join(parts), keep_alive)
        elif path == b"/mock_stats":
            conn.respond(200, b"application/json", mocks.snapshot(), keep_alive)
        elif path == b"/v1/models":
            conn.respond(200, b"application/json", models, keep_alive)
        elif path in PROBE_PATHS:
            conn.respond(200, b"application/json", info if b"info" in path else b"{}", keep_alive)
        else:
            key = f"{method.decode()} {path.decode(errors='replace')}"
            unknown = mocks.stats["unknown_paths"]
            if len(unknown) < 50:
                unknown[key] = unknown.get(key, 0) + 1
            conn.respond(404, b"application/json", b'{"error": "not found"}', keep_alive)

    return handler


async def serve(flavor: str, host: str, prefill_port: int, decode_port: int) -> None:
    mocks = Mocks(flavor)
    loop = asyncio.get_running_loop()
    servers = []
    for role, port in (("prefill", prefill_port), ("decode", decode_port)):
        handler = make_handler(mocks, role)
        servers.append(
            await loop.create_server(
                functools.partial(ServerProtocol, handler), host, port, backlog=LISTEN_BACKLOG
            )
        )
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", choices=FLAVORS, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--decode-port", type=int, required=True)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.flavor, args.host, args.prefill_port, args.decode_port))


if __name__ == "__main__":
    main()
