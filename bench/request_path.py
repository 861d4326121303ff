"""The whole orchestrator request path in process: CPU instructions per request under callgrind.

    python -m bench.request_path                 # unary and streaming, both gates on, under valgrind
    python -m bench.request_path --gates-off     # ids as a JSON list, history kept
    python -m bench.request_path --secret        # a shared secret on the legs
    python -m bench.request_path --profile 2000  # cProfile of 2,000 requests: tottime and calls per request
    python -m bench.request_path --requests 50   # no valgrind: 50 requests, wall time per request
    python -m bench.request_path --bytecodes 200 # no valgrind: Python bytecodes per request, by file
    python -m bench.request_path --prompt-tokens 40000  # a 160 KB prompt (default 250: 1 KB)

Unlike ``bench.orchestrator_work`` (the relay's synchronous calls alone), this is
everything the orchestrator process runs for a request: the real Orchestrator
(``start_server``) behind one keep-alive client connection, its HTTP layer on
both sides, routing, pools, the leg runner, metrics and timers, against two
stand-in workers on 127.0.0.1 that answer canned bytes (a context response of
250 prompt ids or ``--prompt-tokens``, a generation response or a 16-event SSE stream). The client,
the stand-ins and the orchestrator share one event loop, so the count includes
their (small, constant) work too. Two runs of the process under
``valgrind --tool=callgrind``, ``--loops`` requests apart; the difference of the
two totals divided by the difference of the loop counts, so start-up and the
warm-up cancel out. The count is deterministic (PYTHONHASHSEED=0), so a cut of
1% shows where wall time on a shared machine would not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from bench._timing import instructions_per_loop

N_IDS = 250


def http(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body))
    return head + body


def sse_answer(n_events: int = 16) -> bytes:
    event = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    return http(b"200 OK", event * n_events + b"data: [DONE]\n\n", b"text/event-stream")


async def serve_canned(answers: Callable[[bytes], bytes]) -> tuple[asyncio.AbstractServer, int]:
    """A stand-in worker: reads each request (Content-Length bodies) and writes answers(path)."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                writer.write(answers(head.split(b" ", 2)[1]))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _worker_answers(answer: bytes) -> Callable[[bytes], bytes]:
    health = http(b"200 OK", b'{"status": "ok"}')
    info = http(b"200 OK", b"{}")

    def answers(path: bytes) -> bytes:
        if path.startswith(b"/health"):
            return health
        if path.startswith(b"/server_info"):
            return info
        return answer

    return answers


async def _read_response(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    match = re.search(rb"(?i)content-length: (\d+)", head)
    if match:
        await reader.readexactly(int(match.group(1)))
        return
    while True:  # chunked
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return


async def drive(
    loops: int, *, stream: bool, gates: bool, secret: bool, around: Any = None, n_ids: int = N_IDS
) -> float:
    """Start the stand-ins and the orchestrator, send 5 warm-up requests then ``loops`` measured ones;
    ``around`` (a context manager) wraps the measured ones. Returns their wall seconds."""
    from bench.orchestrator_work import context_response, generation_response
    from bench.workload import chat_body
    from server.orchestrator.app import start_server
    from server.orchestrator.config import build_config

    rng = random.Random(0)
    ids = [rng.randrange(32000) for _ in range(n_ids)]
    ctx = http(b"200 OK", context_response(ids, b64=gates))
    gen = sse_answer() if stream else http(b"200 OK", generation_response(n_ids))
    s1, p1 = await serve_canned(_worker_answers(ctx))
    s2, p2 = await serve_canned(_worker_answers(gen))
    cfg: dict[str, Any] = {
        "port": 0,
        "context_servers": {"urls": [f"127.0.0.1:{p1}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{p2}"]},
        "health_check_interval_s": 3600,
        "gen_tokids_ctxbytes": gates,
        "gen_strip_message_history": gates,
    }
    if secret:
        cfg["shared_secret"] = "s" * 32
    server, orch = await start_server(build_config(cfg, environ={}))
    while not (orch.context_pool.ready and orch.generation_pool.ready):
        await asyncio.sleep(0.01)
    assert server.server is not None
    port = server.server.sockets[0].getsockname()[1]
    body = chat_body(n_ids, stream=stream)
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(5):
        writer.write(request)
        await _read_response(reader)
    start = time.perf_counter()
    if around is not None:
        around.enable()
    for _ in range(loops):
        writer.write(request)
        await _read_response(reader)
    if around is not None:
        around.disable()
    elapsed = time.perf_counter() - start
    writer.close()
    await orch.stop()
    server.server.close()
    s1.close()
    s2.close()
    return elapsed


def _flags(stream: bool, gates: bool, secret: bool, n_ids: int) -> list[str]:
    return (
        (["--stream"] if stream else [])
        + ([] if gates else ["--gates-off"])
        + (["--secret"] if secret else [])
        + (["--prompt-tokens", str(n_ids)] if n_ids != N_IDS else [])
    )


def count_instructions(loops: tuple[int, int], stream: bool, gates: bool, secret: bool, n_ids: int) -> float:
    """Instructions per request: two callgrind runs ``loops`` apart, differenced."""
    return instructions_per_loop(
        lambda count: [
            "-m",
            "bench.request_path",
            "--_loop",
            str(count),
            *_flags(stream, gates, secret, n_ids),
        ],
        loops,
        "counting instructions needs valgrind on PATH (or run --requests N)",
    )


def profile(n: int, stream: bool, gates: bool, secret: bool, n_ids: int, top: int = 40) -> str:
    """cProfile of ``n`` measured requests: each function's calls and tottime per request."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    asyncio.run(drive(n, stream=stream, gates=gates, secret=secret, around=prof, n_ids=n_ids))
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    lines = [f"{'calls/req':>9} {'tottime us/req':>14} {'cumtime us/req':>14}  function"]
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in rows[:top]:
        where = f"{os.path.relpath(path) if path.startswith('/') else path}:{line}({name})"
        lines.append(f"{ncalls / n:9.2f} {tottime / n * 1e6:14.2f} {cumtime / n * 1e6:14.2f}  {where}")
    calls = sum(v[1] for v in stats.stats.values()) / n  # type: ignore[attr-defined]
    lines.append(f"Python function calls per request: {calls:.1f}")
    return "\n".join(lines)


def bytecodes(n: int, stream: bool, gates: bool, secret: bool, n_ids: int, top: int = 12) -> str:
    """Python bytecodes executed per request over ``n`` requests (sys.settrace opcode events), by file:
    deterministic like the instruction count, and blind to the wall clock (the deadline sweeper's
    ticks, which the instruction count includes, come with wall time, so a loaded machine adds a few k)."""
    counts: collections.Counter[str] = collections.Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[frame.f_code.co_filename] += 1
        return tracer

    class Tracing:
        def enable(self) -> None:
            sys.settrace(tracer)

        def disable(self) -> None:
            sys.settrace(None)

    asyncio.run(drive(n, stream=stream, gates=gates, secret=secret, around=Tracing(), n_ids=n_ids))
    root = os.getcwd() + os.sep
    lines = [f"bytecodes per request: {sum(counts.values()) / n:,.0f}"]
    for path, count in counts.most_common(top):
        lines.append(f"{count / n:9,.0f}  {path.removeprefix(root)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.request_path", description=__doc__.split("\n")[0])
    parser.add_argument("--stream", action="store_true", help="streaming only (default: unary and streaming)")
    parser.add_argument("--unary", action="store_true", help="unary only")
    parser.add_argument(
        "--gates-off", action="store_true", help="gen_tokids_ctxbytes and history stripping off"
    )
    parser.add_argument("--secret", action="store_true", help="a shared secret signs the legs")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=N_IDS,
        help=f"prompt ids in the context answer, ~4 body bytes each in the client's (default {N_IDS})",
    )
    parser.add_argument("--loops", default="100,400", help="the two callgrind runs' request counts")
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile N requests instead of valgrind")
    parser.add_argument(
        "--bytecodes", type=int, metavar="N", help="Python bytecodes per request over N requests"
    )
    parser.add_argument("--requests", type=int, metavar="N", help="N requests without valgrind, wall time")
    parser.add_argument("--_loop", type=int, help=argparse.SUPPRESS)  # the process callgrind measures
    args = parser.parse_args(argv)
    gates = not args.gates_off
    if args._loop is not None:
        asyncio.run(
            drive(args._loop, stream=args.stream, gates=gates, secret=args.secret, n_ids=args.prompt_tokens)
        )
        return
    streams = [True] if args.stream else [False] if args.unary else [False, True]
    for stream in streams:
        label = f"{'streaming' if stream else 'unary'}, gates {'on' if gates else 'off'}"
        label += ", secret" if args.secret else ""
        label += f", {args.prompt_tokens} prompt tokens" if args.prompt_tokens != N_IDS else ""
        if args.profile:
            print(f"# {label}\n{profile(args.profile, stream, gates, args.secret, args.prompt_tokens)}")
        elif args.bytecodes:
            print(f"# {label}\n{bytecodes(args.bytecodes, stream, gates, args.secret, args.prompt_tokens)}")
        elif args.requests:
            took = asyncio.run(
                drive(args.requests, stream=stream, gates=gates, secret=args.secret, n_ids=args.prompt_tokens)
            )
            print(f"{label}: {args.requests} requests, {took / args.requests * 1e6:.0f} us/request wall")
        else:
            low, high = (int(v) for v in args.loops.split(","))
            per_request = count_instructions((low, high), stream, gates, args.secret, args.prompt_tokens)
            print(f"{label}: {per_request / 1e3:.1f}k instructions/request")


if __name__ == "__main__":
    main()
