"""bench.routers' machinery, small and for real on 127.0.0.1; the PD mocks' protocol checks.

The harness run starts the raw floor and fastcore's orchestrator (both gates)
on instant mocks of their protocols (``bench/pd_mocks.py``, as the Rust
routers get) and, with ``--workers synthetic``, fastcore on its synthetic
workers, pinned as the benchmark pins them, drives a handful of streaming and
non-streaming requests through each and reads the JSON it writes. The fastcore
mocks check every leg against docs/protocol.md, and catch a real orchestrator
whose gates are not the ones they were told. The Rust routers run only where ``python -m bench.routers --install``
put them (CI has none). The raw floor (``bench/rawfloor.py``) also runs in
this process on stand-in workers: pipelined requests, keep-alive upstream
connections, and every way an upstream can fail answered with a 502 and a
close (or, mid-stream, the close).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port as held_port
from helpers import request

from bench import routers
from bench.deploy import free_port, front_argv, wait_healthy
from bench.pd_mocks import (
    ENGINE_ID,
    FIRST_TOKEN,
    MOONCAKE_ENGINES,
    Issued,
    check_fastcore_context,
    check_fastcore_generation,
    check_sglang,
    check_vllm_decode,
    check_vllm_prefill,
    prompt_ids,
)
from bench.rawfloor import Floor, ServerProtocol
from fastcore import decode_tokens

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--prompt-tokens",
    "250",
    "--concurrency",
    "2",
    "--requests",
    "12",
    "--warmup",
    "4",
    "--max-seconds",
    "20",
    "--timeout",
    "20",
    "--max-tokens",
    "4",
]


def _run(tmp_path: Path, fronts: str, *extra: str) -> dict:
    out = tmp_path / "routers.json"
    rc = routers.main(
        ["--fronts", fronts, *TINY, *extra, "--output", str(out), "--plot", str(tmp_path / "routers.png")]
    )
    data = json.loads(out.read_text())
    assert rc == 0, data
    assert (tmp_path / "routers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def _check_rows(data: dict, fronts: list[str]) -> None:
    rows = data["rows"]
    assert {(r["front"], r["stream"]) for r in rows} == {(f, s) for f in fronts for s in (True, False)}
    for r in rows:
        assert r["requests"] == 12 and r["completed"] == 12 and r["errors"] == 0, r
        # 12 requests can fall between two 10 ms clock ticks: utime+stime may read 0, schedstat's ns do not
        assert r["cpu_ms_per_request"] is not None and r["cpu_ms_per_request"] >= 0, r
        assert r["sched_ms_per_request"] > 0, r
        assert r["completions_per_s"] > 0 and r["ttft_p50_ms"] > 0, r


@pytest.mark.slow
def test_the_harness_measures_the_raw_floor_and_fastcore(tmp_path: Path) -> None:
    """Paced (--rate): every level of every front at the same offered load, 12 requests at 40/s; on
    the mocks (the default), whose protocol checks saw every fastcore leg right."""
    data = _run(tmp_path, "rawfloor,fastcore:both-gates", "--rate", "40", "--rounds", "2")
    _check_rows(data, ["rawfloor", "fastcore:both-gates"])
    assert data["meta"]["rounds"] == 2
    for r in data["rows"]:  # each level measured twice, the row the median (lower) round's
        assert len(r["cpu_ms_rounds"]) == 2 and len(r["sched_ms_rounds"]) == 2, r
        assert r["sched_ms_per_request"] == min(r["sched_ms_rounds"]), r
    assert data["meta"]["workers"] == "mocks"
    assert all(r["violations"] == 0 for r in data["rows"] if r["front"] == "fastcore:both-gates"), data[
        "rows"
    ]
    assert all(r["rate"] == 40 and r["duration_s"] >= 11 / 40 for r in data["rows"]), data["rows"]
    assert data["meta"]["skipped"] == {}
    floor = [r for r in data["rows"] if r["front"] == "rawfloor"]
    assert sorted(r["stream"] for r in floor) == [False, True]  # the floor streamed and answered whole
    assert all(
        r["completed"] == r["requests"] == 12 and not r["errors"] and not r["warmup_errors"] for r in floor
    )
    # issue 25's two verdicts per size x streaming, the floor's second (12 requests can read 0 clock
    # ticks, so either may say "no comparison" here)
    lines = data["meta"]["verdicts"]
    assert len(lines) == 4 and all("vs 0.5 x best Rust router" in line for line in lines[::2]), lines
    assert all("vs 2 x the callback-only floor (rawfloor)" in line for line in lines[1::2]), lines


@pytest.mark.slow
def test_the_harness_measures_fastcore_on_its_synthetic_workers(tmp_path: Path) -> None:
    """--workers synthetic: a whole deployment (server.cli worker --model synthetic), no mocks to ask."""
    data = _run(tmp_path, "fastcore:both-gates", "--workers", "synthetic")
    _check_rows(data, ["fastcore:both-gates"])
    assert data["meta"]["workers"] == "synthetic"
    assert all(r["violations"] is None for r in data["rows"]), data["rows"]


@pytest.mark.slow
def test_the_harness_measures_the_installed_rust_routers(tmp_path: Path) -> None:
    installed = [r.name for r in routers.RUST_ROUTERS.values() if r.installed_version(routers.VENVS)]
    if not installed:
        pytest.skip(f"no Rust router installed in {routers.VENVS} (python -m bench.routers --install)")
    data = _run(tmp_path, ",".join(installed))
    _check_rows(data, installed)
    assert all(r["violations"] == 0 for r in data["rows"])


def test_a_missing_router_is_skipped_with_a_note(tmp_path: Path) -> None:
    args = routers.build_parser().parse_args(["--venvs", str(tmp_path)])
    assert "not installed" in (routers.check_front("sglang-router", args) or "")
    assert "no --fastcore-root" in (routers.check_front("fastcore-before:both-gates", args) or "")
    assert "unknown" in (routers.check_front("fastcore:no-such-mode", args) or "")
    assert (
        routers.check_front("rawfloor", args) is None and routers.check_front("fastcore:parsed", args) is None
    )


# -- the raw floor in this process, on stand-in workers ---------------------------------

ANSWER = b'{"choices": [{"message": {"content": "ok"}}]}'
EVENTS = [b"data: {}\n\n", b"data: [DONE]\n\n"]
SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS)
    + b"0\r\n\r\n"
)
WHOLE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(ANSWER),
    ANSWER,
)


class StandIn:
    """A worker on 127.0.0.1 (port 0) that writes ``answer`` to each request and then, unless
    ``keep_open``, hangs up; it records the request bodies and counts its connections."""

    def __init__(self, answer: bytes, keep_open: bool = True) -> None:
        self.bodies: list[bytes] = []
        self.answer, self.keep_open, self.connections = answer, keep_open, 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.bodies.append(await reader.readexactly(length))
                writer.write(self.answer)
                await writer.drain()
                if not self.keep_open:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _floor(context: str, generation: str) -> tuple[int, asyncio.Server]:
    floor = Floor([context], [generation])
    server = await asyncio.get_running_loop().create_server(lambda: ServerProtocol(floor), "127.0.0.1", 0)
    return server.sockets[0].getsockname()[1], server


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """One response off the floor: status, head, body (a chunked one's pieces joined)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if b"chunked" not in head:
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        return int(head.split()[1]), head, await reader.readexactly(length)
    body = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    assert await reader.readexactly(2) == b"\r\n"
    return int(head.split()[1]), head, body


def _chat(n: int, port: int) -> bytes:
    return request("POST", "/v1/chat/completions", b'{"n": %d}' % n, port=port)


@pytest.mark.parametrize("generation", [SSE, WHOLE], ids=["streaming", "non-streaming"])
async def test_the_raw_floor_relays_pipelined_requests_in_order_on_kept_alive_connections(
    generation: bytes,
) -> None:
    ctx, gen = StandIn(WHOLE), StandIn(generation)
    port, server = await _floor(await ctx.start(), await gen.start())
    try:
        async with asyncio.timeout(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for first in (0, 3):  # two rounds of three pipelined requests and a health check, one connection
                writer.write(b"".join(_chat(n, port) for n in range(first, first + 3)))
                writer.write(request("GET", "/health", port=port))
                for _ in range(3):
                    status, head, body = await _response(reader)
                    assert status == 200 and body == (b"".join(EVENTS) if generation is SSE else ANSWER)
                    assert (b"text/event-stream" in head) == (generation is SSE)
                assert (await _response(reader))[::2] == (200, b"ok")
            writer.close()
        assert ctx.bodies == gen.bodies == [b'{"n": %d}' % n for n in range(6)]  # both legs, in order
        assert ctx.connections == gen.connections == 1  # kept alive upstream
    finally:
        server.close()


@pytest.mark.parametrize("streams", [16, 64])
async def test_the_raw_floor_serves_many_requests_in_flight(streams: int) -> None:
    ctx, gen = StandIn(WHOLE), StandIn(SSE)
    port, server = await _floor(await ctx.start(), await gen.start())

    async def client(n: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for k in range(3):
            writer.write(_chat(3 * n + k, port))
            status, _, body = await _response(reader)
            assert status == 200
            answers.append(body)
        writer.close()
        return b"".join(answers)

    try:
        async with asyncio.timeout(30):
            answers = await asyncio.gather(*(client(n) for n in range(streams)))
        assert answers == [b"".join(EVENTS) * 3] * streams
        assert (
            sorted(ctx.bodies) == sorted(gen.bodies) == sorted(b'{"n": %d}' % n for n in range(3 * streams))
        )
        assert ctx.connections <= streams and gen.connections <= streams
    finally:
        server.close()


@pytest.mark.parametrize(
    "case", ["context refuses", "context hangs up", "context answers garbage", "generation hangs up"]
)
async def test_an_upstream_that_fails_gets_the_raw_floors_client_a_502_and_a_close(case: str) -> None:
    ctx = StandIn(b"" if case == "context hangs up" else WHOLE, keep_open=case != "context hangs up")
    if case == "context answers garbage":
        ctx.answer = b"NOT HTTP AT ALL\r\n\r\n"
    gen = StandIn(b"" if case == "generation hangs up" else SSE, keep_open=case != "generation hangs up")
    context = f"127.0.0.1:{held_port()}" if case == "context refuses" else await ctx.start()
    port, server = await _floor(context, await gen.start())
    try:
        async with asyncio.timeout(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_chat(1, port))
            status, _, body = await _response(reader)
            assert (status, body) == (502, b"upstream failed")
            assert await reader.read() == b""  # closed, not left hanging
            writer.close()
    finally:
        server.close()


async def test_a_generation_leg_dropped_mid_stream_closes_the_raw_floors_client() -> None:
    ctx, gen = StandIn(WHOLE), StandIn(SSE[: SSE.index(b"data: [DONE]")], keep_open=False)
    port, server = await _floor(await ctx.start(), await gen.start())
    try:
        async with asyncio.timeout(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_chat(1, port))
            rest = await reader.read()  # until the floor closes
            writer.close()
        assert rest.startswith(b"HTTP/1.1 200") and EVENTS[0] in rest
        assert not rest.endswith(b"0\r\n\r\n")  # no last chunk: the client sees the stream cut
    finally:
        server.close()


async def test_a_context_leg_refused_with_a_status_is_a_502_on_a_kept_alive_connection() -> None:
    ctx, gen = StandIn(b"HTTP/1.1 503 X\r\nContent-Length: 4\r\n\r\nbusy"), StandIn(SSE)
    port, server = await _floor(await ctx.start(), await gen.start())
    try:
        async with asyncio.timeout(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for n in range(2):
                writer.write(_chat(n, port))
                assert (await _response(reader))[::2] == (502, b"context leg answered 503")
            writer.close()
        assert gen.bodies == []
    finally:
        server.close()


# -- the PD mocks' protocol checks --------------------------------------------------


def test_vllm_checks_want_the_prefill_and_decode_fields() -> None:
    good_prefill = {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert check_vllm_prefill(good_prefill) == []
    assert check_vllm_prefill({"max_tokens": 1, "stream": False})  # no kv_transfer_params
    assert check_vllm_prefill({**good_prefill, "max_tokens": 16})
    assert check_vllm_prefill({**good_prefill, "stream": True})
    ktp = {
        "do_remote_prefill": True,
        "remote_engine_id": ENGINE_ID,
        "remote_block_ids": [7],
        "remote_request_id": "p-7",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
    issued = {7}
    assert check_vllm_decode({"max_tokens": 16, "kv_transfer_params": ktp}, issued) == []
    assert check_vllm_decode({"max_tokens": 16, "kv_transfer_params": ktp}, issued)  # block 7 used twice
    assert check_vllm_decode({"max_tokens": 16}, {7})  # nothing copied from the prefill
    partial = {k: v for k, v in ktp.items() if k != "remote_request_id"}
    assert check_vllm_decode({"max_tokens": 16, "kv_transfer_params": partial}, {7})  # vLLM would not pull
    assert check_vllm_prefill({**good_prefill, "stream_options": {"include_usage": True}})  # vLLM refuses it


def test_sglang_checks_want_the_bootstrap_fields() -> None:
    good = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    assert check_sglang(good) == []
    for missing in good:
        assert check_sglang({k: v for k, v in good.items() if k != missing})


def _context_leg(b64: bool = True) -> dict:
    dp = {"request_type": "context_only", "disagg_request_id": (1 << 40) + 5}
    if b64:
        dp["return_prompt_token_ids_b64"] = True
    return {**CHAT, "stream": False, "stream_options": None, "disaggregated_params": dp}


def _generation_leg(ctx_id: int, ids_b64: str, messages: int = 1) -> dict:
    dp = {"request_type": "generation_only", "first_gen_tokens": [FIRST_TOKEN], "ctx_request_id": ctx_id,
          "disagg_request_id": (1 << 40) + 5, "ctx_usage": {"prompt_tokens": 5}}  # fmt: skip
    return {
        **CHAT,
        "messages": CHAT["messages"] * messages,
        "disaggregated_params": dp,
        "prompt_token_ids_b64": ids_b64,
    }


def test_fastcore_checks_want_the_context_legs_fields() -> None:
    assert check_fastcore_context(_context_leg(), b64=True) == []
    assert check_fastcore_context(_context_leg(b64=False), b64=False) == []
    assert check_fastcore_context(_context_leg(b64=False), b64=True)  # the b64 gate on, the list asked for
    assert check_fastcore_context(_context_leg(), b64=False)  # and the other way
    assert check_fastcore_context({**_context_leg(), "stream": True}, b64=True)
    assert check_fastcore_context({**CHAT, "stream": False, "stream_options": None}, b64=True)  # no params
    wrong_id = _context_leg()
    wrong_id["disaggregated_params"]["disagg_request_id"] = 7  # trtllm-serve's own range
    assert "disagg_request_id" in check_fastcore_context(wrong_id, b64=True)[0]


def test_fastcore_checks_want_the_context_answers_ids_and_params_on_the_generation_leg() -> None:
    ids_b64, ids_list = prompt_ids(8, 12345)
    assert decode_tokens(ids_b64).tolist() == json.loads(ids_list) and json.loads(ids_list)[0] == 12345
    assert prompt_ids(8, 6)[0] != ids_b64 and prompt_ids(8, 6)[0][16:] == ids_b64[16:]  # the head differs

    def issued() -> dict[int, Issued]:
        return {77: Issued((1 << 40) + 5, ids_b64, 12345, 8, messages=3)}

    good = _generation_leg(77, ids_b64)
    sent = issued()
    assert check_fastcore_generation(good, sent, strip=True) == []
    assert check_fastcore_generation(good, sent, strip=True)  # ctx_request_id 77 used twice
    assert check_fastcore_generation(_generation_leg(77, ids_b64, messages=3), issued(), strip=False) == []
    assert check_fastcore_generation(
        _generation_leg(77, ids_b64, messages=3), issued(), strip=True
    )  # not stripped
    assert check_fastcore_generation(good, issued(), strip=False)  # the history stripped without the gate
    assert check_fastcore_generation(
        {**good, "prompt_token_ids_b64": prompt_ids(8, 6)[0]}, issued(), strip=True
    )
    assert check_fastcore_generation(_generation_leg(78, ids_b64), issued(), strip=True)  # never issued
    for member in ("first_gen_tokens", "ctx_usage", "disagg_request_id"):
        leg = _generation_leg(77, ids_b64)
        del leg["disaggregated_params"][member]
        assert check_fastcore_generation(leg, issued(), strip=True), member
    as_list = {**good, "prompt_token_ids": json.loads(ids_list)}
    del as_list["prompt_token_ids_b64"]
    listed = {77: Issued((1 << 40) + 5, None, 12345, 8, messages=1)}
    assert check_fastcore_generation(as_list, listed, strip=True) == []
    listed[77] = Issued((1 << 40) + 5, None, 12345, 9, messages=1)
    assert check_fastcore_generation(as_list, listed, strip=True)  # one id short


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "gates", "violations"), [("both-gates", "b64,strip", 0), ("gates-off", "b64,strip", 4)]
)
def test_live_fastcore_mocks_check_a_real_orchestrators_legs(
    tmp_path: Path, mode: str, gates: str, violations: int
) -> None:
    """A real orchestrator between a client and the fastcore mocks: with its gates what the mocks were
    told, each request is right on both legs; with its gates off, each leg (1) and (3) is counted."""
    running = routers.start_on_mocks(
        "orchestrator", lambda port, p, d: front_argv(mode, port, [p], [d]), "fastcore", tmp_path,
        mock_args=["--gates", gates],
    )  # fmt: skip
    try:
        base = running.url
        long_chat = {**CHAT, "messages": CHAT["messages"] * 3, "stream": False}
        answer = json.loads(_post(f"{base}/v1/chat/completions", long_chat))
        assert answer["choices"][0]["message"]["content"] and "prompt_token_ids_b64" not in answer
        stream = _post(f"{base}/v1/chat/completions", {**long_chat, "stream": True})
        assert stream.rstrip().endswith(b"data: [DONE]")
        stats = running.mock_stats()
        assert stats is not None and (stats["prefill"], stats["decode"]) == (2, 2)
        # gates off: each request's leg (1) asks for the list, its leg (3) keeps the history
        assert stats["violations"] == violations, stats["samples"]
        assert stats["issued_unused"] == 0
    finally:
        running.stop()


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()


def _stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/mock_stats", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture
def mocks(request: pytest.FixtureRequest):
    def start(flavor: str) -> tuple[int, int]:
        prefill, decode = free_port(), free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.pd_mocks",
                "--flavor",
                flavor,
                "--prefill-port",
                str(prefill),
                "--decode-port",
                str(decode),
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        request.addfinalizer(lambda: (proc.terminate(), proc.wait(10)))
        wait_healthy(f"http://127.0.0.1:{decode}/health", [], timeout=30)
        return prefill, decode

    return start


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_live_vllm_mocks_count_a_decode_without_kv_transfer_params(mocks) -> None:
    prefill, decode = mocks("vllm")
    answer = json.loads(
        _post(
            f"http://127.0.0.1:{prefill}/v1/chat/completions",
            {**CHAT, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}},
        )
    )
    ktp = answer["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["remote_engine_id"] == ENGINE_ID
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", {**CHAT, "kv_transfer_params": ktp})
    assert _stats(prefill)["violations"] == 0
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", CHAT)  # the router forgot the prefill's params
    stats = _stats(decode)
    assert (stats["prefill"], stats["decode"], stats["violations"]) == (1, 2, 1)
    assert "kv_transfer_params" in stats["samples"][0]


def test_live_sglang_mocks_count_missing_bootstrap_fields_and_stream_sse(mocks) -> None:
    prefill, decode = mocks("sglang")
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 99}
    for port in (prefill, decode):
        _post(f"http://127.0.0.1:{port}/v1/chat/completions", {**CHAT, **boot})
    stream = _post(
        f"http://127.0.0.1:{decode}/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = [e for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("content")) for c in chunks) == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    time.sleep(0.05)
    stats = _stats(prefill)
    assert stats["violations"] == 1 and "bootstrap" in stats["samples"][0]  # the stream had none
    assert stats["unpaired"] == 0  # room 99 arrived on both sides


def test_live_mooncake_mocks_answer_query_and_pair_each_transfer_id(mocks) -> None:
    """The Mooncake mocks: the prefill port answers the bootstrap server's ``GET /query``; a pair's legs
    (vLLM's MooncakeConnector rules) pass, each ``transfer_id`` once on each side; a decode leg without
    the bootstrap address, and a transfer id sent twice to one side, are counted."""
    prefill, decode = mocks("mooncake")
    query = urllib.request.urlopen(f"http://127.0.0.1:{prefill}/query", timeout=10).read()
    assert query == MOONCAKE_ENGINES and ENGINE_ID in json.loads(query)
    pre = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t1"}
    answer = json.loads(
        _post(
            f"http://127.0.0.1:{prefill}/v1/chat/completions",
            {**CHAT, "max_tokens": 1, "stream": False, "kv_transfer_params": pre},
        )
    )
    assert "kv_transfer_params" not in answer  # a Mooncake prefill pushes: nothing to copy
    dec = {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "t1",
        "remote_bootstrap_addr": f"http://127.0.0.1:{prefill}", "remote_engine_id": ENGINE_ID,
    }  # fmt: skip
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", {**CHAT, "kv_transfer_params": dec})
    stats = _stats(prefill)
    assert (stats["violations"], stats["unpaired"]) == (0, 0), stats
    lacking = {k: v for k, v in dec.items() if k != "remote_bootstrap_addr"} | {"transfer_id": "t2"}
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", {**CHAT, "kv_transfer_params": lacking})
    assert _stats(decode)["unpaired"] == 1  # t2 seen on the decode side only
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", {**CHAT, "kv_transfer_params": lacking})
    stats = _stats(decode)
    assert stats["violations"] == 2 and "remote_bootstrap_addr" in stats["samples"][0], stats
    assert "sent twice to decode" in stats["samples"][1], stats


def test_the_mooncake_front_runs_vllm_with_the_mooncake_transfer_on_the_mooncake_mocks() -> None:
    """``fastcore:mooncake``: the fast relay with ``worker_protocol: vllm``, ``vllm_transfer: mooncake``,
    its bootstrap port the prefill mock's (a config file: no flag sets it), on the Mooncake mocks; no
    Rust router speaks it, so no verdict line."""
    argv = routers.protocol_front_argv("mooncake", 8500, "127.0.0.1:8501", "127.0.0.1:8502")
    flags = argv[argv.index("orchestrator") + 1 :]
    pairs = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
    assert pairs["--worker-protocol"] == "vllm" and pairs["--vllm-transfer"] == "mooncake"
    assert pairs["--relay"] == "fast"
    assert Path(pairs["--config"]).read_text() == "vllm_mooncake_bootstrap_port: 8501\n"
    assert routers.mocks_flavor("fastcore:mooncake") == "mooncake"
    assert routers.check_front("fastcore:mooncake", routers.build_parser().parse_args([])) is None
    assert routers.protocol_verdicts([_row("fastcore:mooncake", 0.05), _row("vllm-router", 0.2)]) == []


def test_a_run_without_the_trtllm_front_prints_no_trtllm_verdict() -> None:
    """issue 25's verdicts judge ``fastcore:both-gates``: a run of other fronts (the protocol pairs) has
    none, not a NOT MET for a front it never ran."""
    rows = [_row("fastcore:sglang", 0.05, completions_per_s=2000.0), _row("sglang-router", 0.2)]
    assert routers.verdicts(rows) == []
    assert len(routers.verdicts([*rows, _row("fastcore:both-gates", 0.05)])) == 2


@pytest.mark.slow
def test_a_quick_run_of_the_mooncake_front_on_the_mooncake_mocks_has_no_violation(tmp_path: Path) -> None:
    """``fastcore:mooncake`` end to end: both legs by bench.engine_protocols' Mooncake rules, the decode's
    engine id the one /query names, each transfer id once on each side: 0 violations, none unpaired."""
    data = _run(tmp_path, "fastcore:mooncake", "--quick")
    _check_rows(data, ["fastcore:mooncake"])
    assert all(r["violations"] == 0 for r in data["rows"]), data["rows"]


def _row(front: str, cpu: float | None, **kw: object) -> routers.Row:
    fields = dict(
        front=front, prompt_tokens=250, body_bytes=1024, stream=False, concurrency=16, requests=1000,
        completed=1000, errors=0, timeouts=0, warmup_errors=0, violations=0, cpu_ms_per_request=cpu,
        sched_ms_per_request=cpu, completions_per_s=1445.0, ttft_p50_ms=10.7, duration_s=0.7,
        time_bound=False,
    )  # fmt: skip
    fields.update(kw)
    return routers.Row(**fields)  # type: ignore[arg-type]


def test_rounds_interleave_the_fronts_level_by_level_in_a_rotated_order() -> None:
    levels = [(True, 16), (False, 16)]
    order = routers.interleaved(["a", "b", "c"], 3, levels)
    assert len(order) == 3 * 2 * 3 and len(set(order)) == len(order)  # every (round, level, front) once
    assert [f for r, s, c, f in order if (r, s, c) == (0, True, 16)] == ["a", "b", "c"]
    assert [f for r, s, c, f in order if (r, s, c) == (1, False, 16)] == ["b", "c", "a"]
    assert [f for r, s, c, f in order if (r, s, c) == (2, True, 16)] == ["c", "a", "b"]
    assert [(s, c) for r, s, c, f in order if f == "a" and r == 1] == levels  # each round walks every level
    assert routers.interleaved([], 2, levels) == []


def test_a_levels_rounds_merge_to_the_median_round_with_every_rounds_errors() -> None:
    rounds = [_row("x", 0.07), _row("x", None, completed=0, errors=5), _row("x", 0.05, violations=2)]
    merged = routers.merge_rounds(rounds)
    assert merged.cpu_ms_per_request == 0.07  # 0.05, 0.07, then the round that completed none
    assert merged.cpu_ms_rounds == [0.07, None, 0.05] and merged.sched_ms_rounds == [0.07, None, 0.05]
    assert merged.errors == 5 and merged.violations == 2 and merged.flagged  # one bad round flags the level
    assert routers.merge_rounds([_row("x", 0.04), _row("x", 0.06)]).cpu_ms_per_request == 0.04  # the lower
    assert routers.merge_rounds([_row("x", 0.04, violations=None)]).violations is None  # no mocks to ask
    assert rounds[0].cpu_ms_rounds == []  # the rounds' own rows are left as they were
    table = routers.report([merged], ["x"])
    assert "sched each round" in table and "0.0700/-/0.0500" in table


def test_rounds_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        routers.main(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_the_report_prints_the_schedulers_cpu_time_beside_the_clock_ticks() -> None:
    """utime+stime come in 10 ms ticks (1,000 requests of 0.1 ms read in 0.01 ms steps); the table
    also prints the scheduler's on-CPU ns per request, so a 5% change is readable in one run."""
    row = routers.Row(
        front="rawfloor", prompt_tokens=250, body_bytes=1024, stream=False, concurrency=16, requests=1000,
        completed=1000, errors=0, timeouts=0, warmup_errors=0, violations=0, cpu_ms_per_request=0.04,
        sched_ms_per_request=0.0524, completions_per_s=1445.0, ttft_p50_ms=10.7, duration_s=0.7,
        time_bound=False,
    )  # fmt: skip
    lines = [line for line in routers.report([row], ["rawfloor"]).splitlines() if line.startswith("|")]
    header, _, values = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    assert header[4:6] == ["CPU ms/req", "sched ms/req"], header
    assert values[4:6] == ["0.040", "0.0524"], values


def test_the_vllm_protocol_front_is_the_fast_relay_with_worker_protocol_vllm_on_the_vllm_mocks() -> None:
    """``fastcore:vllm``: the orchestrator in the fast relay, no trtllm gates, ``--worker-protocol vllm``,
    one prefill and one decode worker, on the vLLM mocks as vllm-router is (its same-mocks router)."""
    argv = routers.protocol_front_argv("vllm", 8500, "127.0.0.1:8501", "127.0.0.1:8502")
    flags = argv[argv.index("orchestrator") + 1 :]
    assert argv[:3] == [sys.executable, "-m", "server.cli"]
    pairs = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
    assert pairs["--port"] == "8500" and pairs["--worker-protocol"] == "vllm" and pairs["--relay"] == "fast"
    assert pairs["--context-urls"] == "127.0.0.1:8501" and pairs["--generation-urls"] == "127.0.0.1:8502"
    assert "--no-gen-tokids-ctxbytes" in flags and "--no-gen-strip-message-history" in flags
    assert "fastcore:vllm" in routers.DEFAULT_FRONTS
    flavors = {
        f: routers.mocks_flavor(f)
        for f in ["fastcore:vllm", "fastcore:both-gates", "rawfloor", "vllm-router"]
    }
    assert flavors == {
        "fastcore:vllm": "vllm",
        "fastcore:both-gates": "fastcore",
        "rawfloor": "plain",
        "vllm-router": "vllm",
    }
    args = routers.build_parser().parse_args([])
    assert routers.check_front("fastcore:vllm", args) is None
    args.workers = "synthetic"  # fastcore's synthetic workers speak trtllm's protocol, not vLLM's
    assert "--workers mocks" in (routers.check_front("fastcore:vllm", args) or "")


def test_the_vllm_front_is_compared_with_vllm_router_on_the_same_mocks() -> None:
    """The column ``this/rust same mocks`` and the verdict read vllm-router's row, not the best Rust
    router's (sglang-router, on other mocks); a trtllm front has no router on its mocks."""
    rows = [
        _row("fastcore:vllm", 0.05, completions_per_s=2000.0),
        _row("vllm-router", 0.2, completions_per_s=1500.0),
        _row("sglang-router", 0.08),
        _row("fastcore:both-gates", 0.04),
    ]
    lines = [
        line for line in routers.report(rows, [r.front for r in rows]).splitlines() if line.startswith("|")
    ]
    header, _, *values = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    col, best = header.index("this/rust same mocks"), header.index("this/best-rust")
    by_front = {v[0]: v for v in values}
    assert by_front["fastcore:vllm"][col] == "0.25x" and by_front["fastcore:vllm"][best] == "0.62x"
    assert by_front["fastcore:both-gates"][col] == "-" and by_front["vllm-router"][col] == "-"
    (line,) = routers.protocol_verdicts(rows)
    assert "fastcore:vllm vs 0.5 x vllm-router on the same mocks" in line and ": MET (" in line, line
    assert "c=16: 0.0500 vs 0.2000 ms/req = 0.25x, 2000 vs 1500 compl/s" in line, line
    slower = [_row("fastcore:vllm", 0.05, completions_per_s=1000.0), *rows[1:]]  # CPU met, compl/s lower
    assert "NOT MET" in routers.protocol_verdicts(slower)[0]
    flagged = [_row("fastcore:vllm", 0.05, violations=1), *rows[1:]]
    assert "NOT MET (c=16: no comparison)" in routers.protocol_verdicts(flagged)[0]
    assert routers.protocol_verdicts(rows[1:]) == []  # no fastcore:vllm row, no verdict


@pytest.mark.slow
def test_a_quick_run_of_the_vllm_front_on_the_vllm_mocks_has_no_violation(tmp_path: Path) -> None:
    """``fastcore:vllm`` end to end: every leg it sends is checked by bench.engine_protocols' vLLM rules
    in the mocks (the prefill's kv_transfer_params, max_tokens 1, stream false; the decode's params
    from that prefill's answer, each block id once): 0 violations, streaming and not."""
    data = _run(tmp_path, "fastcore:vllm", "--quick")
    _check_rows(data, ["fastcore:vllm"])
    assert all(r["violations"] == 0 for r in data["rows"]), data["rows"]
    assert data["meta"]["skipped"] == {}


def test_the_sglang_protocol_front_runs_worker_protocol_sglang_on_the_sglang_mocks() -> None:
    """``fastcore:sglang``: the orchestrator in the fast relay with ``--worker-protocol sglang`` on the
    SGLang mocks, as sglang-router is (its same-mocks router)."""
    argv = routers.protocol_front_argv("sglang", 8500, "127.0.0.1:8501", "127.0.0.1:8502")
    flags = argv[argv.index("orchestrator") + 1 :]
    pairs = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
    assert pairs["--worker-protocol"] == "sglang" and pairs["--relay"] == "fast"
    assert pairs["--context-urls"] == "127.0.0.1:8501" and pairs["--generation-urls"] == "127.0.0.1:8502"
    assert "fastcore:sglang" in routers.DEFAULT_FRONTS
    assert {f: routers.mocks_flavor(f) for f in ["fastcore:sglang", "sglang-router"]} == {
        "fastcore:sglang": "sglang",
        "sglang-router": "sglang",
    }
    args = routers.build_parser().parse_args([])
    assert routers.check_front("fastcore:sglang", args) is None
    args.workers = "synthetic"
    assert "--workers mocks" in (routers.check_front("fastcore:sglang", args) or "")
    rows = [_row("fastcore:sglang", 0.05, completions_per_s=2000.0), _row("sglang-router", 0.2)]
    (line,) = routers.protocol_verdicts(rows)
    assert "fastcore:sglang vs 0.5 x sglang-router on the same mocks" in line and ": MET (" in line, line


def test_the_sglang_prefill_mock_publishes_its_bootstrap_port_in_server_info(mocks) -> None:
    """fastcore's sglang protocol takes a prefill's bootstrap port from its /server_info
    (``disaggregation_bootstrap_port``, as SGLang publishes it): the prefill mock's is the port
    sglang-router is given on its argv; a decode worker has none."""
    prefill, decode = mocks("sglang")
    info = [
        json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10).read())
        for port in (prefill, decode)
    ]
    assert info[0]["disaggregation_bootstrap_port"] == routers.BOOTSTRAP_PORT
    assert info[0]["disaggregation_mode"] == "prefill" and "disaggregation_bootstrap_port" not in info[1]


@pytest.mark.slow
def test_a_quick_run_of_the_sglang_front_on_the_sglang_mocks_has_no_violation(tmp_path: Path) -> None:
    """``fastcore:sglang`` end to end: both legs carry the bootstrap triple by bench.engine_protocols'
    SGLang rules (the room in [0, 2^63)), each room once on each side: 0 violations, none unpaired,
    streaming and not."""
    data = _run(tmp_path, "fastcore:sglang", "--quick")
    _check_rows(data, ["fastcore:sglang"])
    assert all(r["violations"] == 0 for r in data["rows"]), data["rows"]
    assert data["meta"]["skipped"] == {}
