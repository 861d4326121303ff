"""Instant prefill/decode workers speaking vLLM's, SGLang's or fastcore's PD protocol, for every router.

Benchmark code. One process serves a prefill port and a decode port (one
event loop, raw asyncio Protocols + httptools, see ``bench/rawfloor.py``) so
that the mocks cost little on the load generator's core. Every generation
request is checked for the fields its router must add; a missing or wrong one
is a protocol violation, counted and sampled at ``GET /mock_stats``.

vLLM (``vllm-router --vllm-pd-disaggregation``): the router sends the prefill
worker the client's request with ``max_tokens: 1``, ``stream: false`` and
``kv_transfer_params: {"do_remote_decode": true, ...}``; the prefill answer is
a chat completion carrying ``kv_transfer_params`` (``do_remote_prefill``,
``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``,
``remote_port``), which the router copies into the decode request. The rules on
both legs are ``bench/engine_protocols.py``'s, which the tests' strict vLLM and
SGLang stand-ins check too. Here the block id is unique
per prefill, so the decode side checks it was issued (and only once).

SGLang (``sglang_router.launch_router --pd-disaggregation``): the router sends
the same request to prefill and decode at once with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` added; the decode answer is the
client's, the prefill answer is discarded. Here each room must arrive once on
each side (``unpaired`` counts rooms seen on one side only).

fastcore (``docs/protocol.md``, legs (1) to (4)): the orchestrator sends the
context worker the client's request with ``stream: false`` and
``disaggregated_params`` (``context_only``, a ``disagg_request_id``, and
``return_prompt_token_ids_b64`` iff the ``b64`` gate is on); the context answer
carries the first token, a ``ctx_request_id`` unique per answer, the prompt's
ids (one per 4 body bytes, the first one the ``ctx_request_id``'s low bits: no
two answers carry the same ids) as base64 when asked, else as a list, and
``usage``. The generation side checks that the request carries that answer's
``disaggregated_params`` as ``generation_only`` with ``ctx_usage``, the ids
byte for byte (the base64 string) or as the same list, and the messages the
``strip`` gate leaves (the last one) or all of them; each ``ctx_request_id``
is good once. ``--gates`` names the gates the orchestrator runs with.

vLLM's MooncakeConnector (``mooncake``; fastcore's ``worker_protocol: vllm``,
``vllm_transfer: mooncake``): both legs at once, the prefill's with
``kv_transfer_params`` ``do_remote_decode`` and a router-minted ``transfer_id``
(its answer carries no params), the decode's with ``do_remote_prefill``, that
``transfer_id``, ``remote_bootstrap_addr`` and ``remote_engine_id``; each
``transfer_id`` must arrive once on each side (``unpaired``, as SGLang's rooms).
The prefill port also answers the Mooncake bootstrap server's ``GET /query``
(``{engine_id: {"0": ...}}``): the router is given that port as its bootstrap port.

plain: every request answered as a worker serving it whole would (no PD
fields, no checks): the pass-through floors' workers.

    python -m bench.pd_mocks --flavor vllm --prefill-port 8001 --decode-port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import itertools
import json
import struct
from collections.abc import Callable
from typing import Any

try:
    import orjson

    loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson is in the bench extra
    loads = json.loads

from bench import engine_protocols as rules
from bench.rawfloor import LISTEN_BACKLOG, ServerProtocol
from fastcore import protocol as wire

FLAVORS = ("vllm", "sglang", "mooncake", "fastcore", "plain")
#: fastcore's orchestrator gates a fastcore mock checks for (docs/protocol.md, "The two gates")
GATES = ("b64", "strip")
FIRST_TOKEN = 450
ENGINE_ID = "mock-engine-0"
MAX_MOCK_TOKENS = 256
#: the SGLang prefill mock's bootstrap port (published in /server_info, given to sglang-router)
BOOTSTRAP_PORT = 8998
#: the Mooncake prefill mock's bootstrap server's answer at GET /query (vLLM's MooncakeBootstrapServer)
MOONCAKE_ENGINES = json.dumps({ENGINE_ID: {"0": {"host": "127.0.0.1", "port": 5600}}}).encode()
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


def check_vllm_prefill(req: dict[str, Any], chat: bool = False) -> list[str]:
    """A NIXL prefill leg (bench/engine_protocols.py's rules, shared with the tests' vLLM stand-in)."""
    return rules.check_vllm_prefill(req, chat)


def check_vllm_decode(req: dict[str, Any], issued: set[int]) -> list[str]:
    """A NIXL decode leg: the shared rules, then the block this mock's prefill issued, good once."""
    problems = rules.check_vllm_decode(req)
    ktp = req.get("kv_transfer_params")
    if not isinstance(ktp, dict):
        return problems
    if ktp.get("remote_engine_id") != ENGINE_ID:
        problems.append(f"decode kv_transfer_params not copied from prefill: {ktp!r}"[:200])
    blocks = ktp.get("remote_block_ids")
    if not (isinstance(blocks, list) and blocks and blocks[0] in issued):
        problems.append(f"decode remote_block_ids={blocks!r} not issued by a prefill (or reused)"[:200])
    else:
        issued.discard(blocks[0])
    if req.get("max_tokens") == 1 and req.get("max_completion_tokens") is None:
        problems.append("decode max_tokens is the prefill's 1")
    return problems


check_sglang = rules.check_sglang


def check_mooncake(req: dict[str, Any], role: str, chat: bool) -> list[str]:
    """A MooncakeConnector leg (the shared rules); the decode's ``remote_engine_id`` is the one /query names."""
    if role == "prefill":
        return rules.check_vllm_prefill(req, chat, "mooncake")
    problems = rules.check_vllm_decode(req, "mooncake")
    ktp = req.get("kv_transfer_params")
    if isinstance(ktp, dict) and ktp.get("remote_engine_id") not in (None, ENGINE_ID):
        problems.append(
            f"decode remote_engine_id={ktp.get('remote_engine_id')!r}, /query named {ENGINE_ID!r}"
        )
    return problems


def check_fastcore_context(req: dict[str, Any], b64: bool) -> list[str]:
    """Leg (1): the client's request made a context-only one (docs/protocol.md)."""
    problems = []
    if req.get(wire.STREAM) is not False or req.get(wire.STREAM_OPTIONS) is not None:
        problems.append(
            f"context stream={req.get(wire.STREAM)!r}, stream_options={req.get(wire.STREAM_OPTIONS)!r}"
        )
    dp = req.get(wire.DISAGGREGATED_PARAMS)
    if not isinstance(dp, dict) or dp.get(wire.REQUEST_TYPE) != wire.CONTEXT_ONLY:
        return [*problems, f"context disaggregated_params={dp!r}"[:200]]
    if not wire.is_disagg_request_id(dp.get(wire.DISAGG_REQUEST_ID)):
        problems.append(f"context disagg_request_id={dp.get(wire.DISAGG_REQUEST_ID)!r}")
    if (dp.get(wire.RETURN_PROMPT_TOKEN_IDS_B64) is True) != b64:
        problems.append(
            f"context return_prompt_token_ids_b64={dp.get(wire.RETURN_PROMPT_TOKEN_IDS_B64)!r} with b64={b64}"
        )
    return problems


class Issued:
    """What a fastcore context answer told the orchestrator to carry to leg (3)."""

    __slots__ = ("disagg_request_id", "first_id", "ids_b64", "messages", "n_ids")

    def __init__(
        self, disagg_request_id: Any, ids_b64: str | None, first_id: int, n_ids: int, messages: int
    ) -> None:
        self.disagg_request_id = disagg_request_id
        self.ids_b64 = ids_b64
        self.first_id = first_id
        self.n_ids = n_ids
        self.messages = messages


def check_fastcore_generation(req: dict[str, Any], issued: dict[int, Issued], strip: bool) -> list[str]:
    """Leg (3): the context answer's ``disaggregated_params`` and ids, the messages the gates leave."""
    dp = req.get(wire.DISAGGREGATED_PARAMS)
    if not isinstance(dp, dict) or dp.get(wire.REQUEST_TYPE) != wire.GENERATION_ONLY:
        return [f"generation disaggregated_params={dp!r}"[:200]]
    ctx_id = dp.get(wire.CTX_REQUEST_ID)
    sent = issued.pop(ctx_id, None) if isinstance(ctx_id, int) else None
    if sent is None:
        return [f"generation ctx_request_id={ctx_id!r} not issued by a context answer (or reused)"]
    problems = []
    if dp.get(wire.DISAGG_REQUEST_ID) != sent.disagg_request_id or dp.get(wire.FIRST_GEN_TOKENS) != [
        FIRST_TOKEN
    ]:
        problems.append(f"generation disaggregated_params not the context answer's: {dp!r}"[:200])
    if not isinstance(dp.get(wire.CTX_USAGE), dict):
        problems.append(f"generation ctx_usage={dp.get(wire.CTX_USAGE)!r}")
    if sent.ids_b64 is not None:
        if req.get(wire.PROMPT_TOKEN_IDS_B64) != sent.ids_b64:
            problems.append("generation prompt_token_ids_b64 is not the context answer's, byte for byte")
    else:
        ids = req.get(wire.PROMPT_TOKEN_IDS)
        if not (isinstance(ids, list) and len(ids) == sent.n_ids and ids[0] == sent.first_id):
            problems.append("generation prompt_token_ids is not the context answer's list")
    messages = req.get(wire.MESSAGES)
    want = 1 if strip else sent.messages
    if not isinstance(messages, list) or len(messages) != want:
        problems.append(
            f"generation messages: {len(messages) if isinstance(messages, list) else messages!r}, expected {want}"
        )
    return problems


_TAIL_IDS: dict[int, tuple[str, str]] = {}


def prompt_ids(n: int, first: int) -> tuple[str, str]:
    """(base64, JSON list) of ``n`` >= 3 ids whose first is ``first``: the rest is the same for every
    answer of that length (kept per length), so an answer costs a 16-character head, not an encode."""
    tail = _TAIL_IDS.get(n)
    if tail is None:
        rest = [(7 * i) % 32000 for i in range(1, n)]
        tail = _TAIL_IDS[n] = (
            base64.b64encode(struct.pack(f"<{n - 3}i", *rest[2:])).decode(),
            "," + ",".join(map(str, rest)) + "]",
        )
    head = base64.b64encode(struct.pack("<3i", first, 7, 14)).decode()
    return head + tail[0], f"[{first}" + tail[1]


class Mocks:
    """The two roles' state: protocol checks, counters, the answers."""

    def __init__(self, flavor: str, gates: tuple[str, ...] = ()) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor {flavor!r} not in {FLAVORS}")
        unknown = set(gates) - set(GATES)
        if unknown:
            raise ValueError(f"gates {sorted(unknown)} not in {GATES}")
        self.flavor = flavor
        self.b64, self.strip = "b64" in gates, "strip" in gates
        self.ctx_ids = itertools.count(1 << 40)
        self.ctx_issued: dict[int, Issued] = {}
        self.block_ids = itertools.count(1)
        self.issued: set[int] = set()
        self.rooms: dict[int | str, str] = {}
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
        problems: list[str] = []
        extra = b""
        chat = path.endswith(b"/chat/completions")
        if self.flavor == "fastcore":
            if role == "prefill":
                return self.context_answer(req, body, chat)
            problems = check_fastcore_generation(req, self.ctx_issued, self.strip and chat)
        elif self.flavor == "plain":
            pass
        elif self.flavor == "vllm" and role == "prefill":
            problems = check_vllm_prefill(req, chat)
            block = next(self.block_ids)
            self.issued.add(block)
            extra = (
                b', "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, '
                b'"remote_engine_id": "%s", "remote_block_ids": [%d], "remote_request_id": "mock-%d", '
                b'"remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}'
            ) % (ENGINE_ID.encode(), block, block)
        elif self.flavor == "vllm":
            problems = check_vllm_decode(req, self.issued)
        elif self.flavor == "mooncake":
            problems = check_mooncake(req, role, chat)
            ktp = req.get("kv_transfer_params")
            self.pair(ktp.get("transfer_id") if isinstance(ktp, dict) else None, role, problems)
        else:
            problems = check_sglang(req)
            self.pair(req.get("bootstrap_room"), role, problems)
        if problems:
            self.violation([f"{role}: {p}" for p in problems])
        n = max(1, min(int(req.get("max_tokens") or req.get("max_completion_tokens") or 16), MAX_MOCK_TOKENS))
        model = str(req.get("model", "mock")).encode()
        prompt_tokens = len(body) // 4
        if req.get("stream"):
            usage = isinstance(req.get("stream_options"), dict) and req["stream_options"].get("include_usage")
            return 200, b"text/event-stream", sse_events(model, n, chat, prompt_tokens if usage else None)
        return 200, b"application/json", [completion_json(model, n, chat, prompt_tokens, extra)]

    def pair(self, key: Any, role: str, problems: list[str]) -> None:
        """A concurrent pair's key (SGLang's room, Mooncake's transfer id) seen on ``role``: once each side."""
        if not isinstance(key, int | str):
            return
        seen = self.rooms.pop(key, None)
        if seen == role:
            problems.append(f"pair key {key!r} sent twice to {role}")
        elif seen is None:
            self.rooms[key] = role

    def context_answer(self, req: dict[str, Any], body: bytes, chat: bool) -> tuple[int, bytes, list[bytes]]:
        """Leg (2): the first token, a fresh ``ctx_request_id``, the prompt's ids as leg (1) asked."""
        problems = check_fastcore_context(req, self.b64)
        if problems:
            self.violation([f"prefill: {p}" for p in problems])
        dp = req.get(wire.DISAGGREGATED_PARAMS)
        disagg_id = dp.get(wire.DISAGG_REQUEST_ID) if isinstance(dp, dict) else None
        ctx_id = next(self.ctx_ids)
        n = max(3, len(body) // 4)
        first = ctx_id & 0x7FFFFFFF
        ids_b64, ids_list = prompt_ids(n, first)
        asked_b64 = isinstance(dp, dict) and dp.get(wire.RETURN_PROMPT_TOKEN_IDS_B64) is True
        messages = req.get(wire.MESSAGES)
        self.ctx_issued[ctx_id] = Issued(
            disagg_id,
            ids_b64 if asked_b64 else None,
            first,
            n,
            len(messages) if isinstance(messages, list) else 0,
        )
        model = str(req.get(wire.MODEL, "mock"))
        message = '"message": {"role": "assistant", "content": " alpha"}' if chat else '"text": " alpha"'
        ids = (
            f'"prompt_token_ids": null, "prompt_token_ids_b64": "{ids_b64}"'
            if asked_b64
            else f'"prompt_token_ids": {ids_list}'
        )
        answer = (
            f'{{"id": "cmpl-mock", "object": "{wire.OBJECT_CHAT_COMPLETION if chat else wire.OBJECT_TEXT_COMPLETION}", '
            f'"created": 1700000000, "model": {json.dumps(model)}, "choices": [{{"index": 0, {message}, '
            f'"logprobs": null, "finish_reason": "{wire.FINISH_NOT_FINISHED}", "disaggregated_params": '
            f'{{"request_type": "{wire.CONTEXT_ONLY}", "first_gen_tokens": [{FIRST_TOKEN}], "ctx_request_id": {ctx_id}, '
            f'"disagg_request_id": {json.dumps(disagg_id)}, "encoded_opaque_state": null, '
            f'"ctx_info_endpoint": "http://127.0.0.1:1/kv/{ctx_id}", "draft_tokens": null}}}}], '
            f'"usage": {{"prompt_tokens": {n}, "completion_tokens": 1, "total_tokens": {n + 1}, '
            f'"prompt_tokens_details": {{"cached_tokens": 0}}}}, {ids}}}'
        )
        return 200, b"application/json", [answer.encode()]

    def snapshot(self) -> bytes:
        return json.dumps(
            {
                **self.stats,
                "unpaired": len(self.rooms),
                "issued_unused": len(self.issued) + len(self.ctx_issued),
            }
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
    server_info: dict[str, Any] = {
        "model_path": "mock",
        "served_model_name": "mock",
        "is_generation": True,
        "disaggregation_mode": role,
        "tokenizer_path": "mock",
    }
    if mocks.flavor == "sglang" and role == "prefill":
        # a prefill's --disaggregation-bootstrap-port, as SGLang's /server_info publishes it (fastcore's
        # sglang protocol reads it there; sglang-router takes it on its argv); nothing listens on it
        server_info["disaggregation_bootstrap_port"] = BOOTSTRAP_PORT
    if mocks.flavor == "fastcore":  # docs/protocol.md, "/server_info"
        server_info.update(
            role="context" if role == "prefill" else "generation",
            model="mock",
            prompt_token_ids_b64_chat=True,
            prompt_token_ids_b64_completions=True,
        )
    info = json.dumps(server_info).encode()

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
        elif path == b"/query" and mocks.flavor == "mooncake" and role == "prefill":
            conn.respond(200, b"application/json", MOONCAKE_ENGINES, keep_alive)
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


async def serve(
    flavor: str, host: str, prefill_port: int, decode_port: int, gates: tuple[str, ...] = ()
) -> None:
    mocks = Mocks(flavor, gates)
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
    parser.add_argument(
        "--gates",
        default="",
        help=f"fastcore flavor: the orchestrator's gates, comma-separated from {GATES} (b64: gen_tokids_ctxbytes, "
        "strip: gen_strip_message_history)",
    )
    args = parser.parse_args()
    import uvloop

    gates = tuple(g for g in args.gates.split(",") if g)
    uvloop.run(serve(args.flavor, args.host, args.prefill_port, args.decode_port, gates))


if __name__ == "__main__":
    main()
