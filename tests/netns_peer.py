"""Run by test_app_hardening inside a fresh network namespace (``unshare -n``): a client whose
address is not loopback, with no way for traffic to leave the namespace.

The namespace has only ``lo``; this script brings it up and gives it 192.0.2.1 (TEST-NET-1, a
documentation address) beside 127.0.0.1. The workers listen on 0.0.0.0, so a client connecting
to 192.0.2.1 is a non-loopback peer to them. Prints one JSON object: what each caller got.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUTSIDE = "192.0.2.1"


async def exchange(host: str, port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            (int(ln.split(b":")[1]) for ln in lines if ln.lower().startswith(b"content-length:")), 0
        )
        return int(lines[0].split()[1]), await reader.readexactly(length)
    finally:
        writer.close()


def post(body: dict[str, Any], host: str) -> bytes:
    """A completions request; the context worker names its KV endpoint after ``Host``."""
    data = json.dumps(body).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % (host.encode(), len(data)) + data


async def main() -> dict[str, Any]:
    from server.worker.app import WorkerApp, WorkerSettings
    from server.worker.synthetic import SyntheticEngine

    ctx = WorkerApp(SyntheticEngine(0), WorkerSettings(role="context", model_name="synthetic"))
    gen = WorkerApp(SyntheticEngine(0), WorkerSettings(role="generation", model_name="synthetic"))
    ctx_server, ctx_port = await ctx.start("0.0.0.0", 0)
    gen_server, gen_port = await gen.start("0.0.0.0", 0)
    seen: dict[str, Any] = {}
    try:
        get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        seen["metrics_loopback"] = (await exchange("127.0.0.1", gen_port, get))[0]
        status, body = await exchange(OUTSIDE, gen_port, get)
        seen["metrics_outside"] = {"status": status, "body": body.decode()}
        for caller in ("127.0.0.1", OUTSIDE):
            leg = {"model": "synthetic", "prompt": f"a prompt for {caller} " * 8, "max_tokens": 2,
                   "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1}}  # fmt: skip
            answer = json.loads(
                (await exchange("127.0.0.1", ctx_port, post(leg, f"127.0.0.1:{ctx_port}")))[1]
            )
            params = answer["choices"][0]["disaggregated_params"]
            generation = {"model": "synthetic", "prompt": answer["prompt_token_ids"], "max_tokens": 2,
                          "disaggregated_params": {**params, "request_type": "generation_only"}}  # fmt: skip
            fetched = gen.metrics.handoff.get(event="fetched")
            status, _ = await exchange(caller, gen_port, post(generation, f"{caller}:{gen_port}"))
            seen[caller] = {
                "status": status,
                "endpoint": params["ctx_info_endpoint"],
                "fetched": gen.metrics.handoff.get(event="fetched") - fetched,
            }
        seen["not_allowed"] = gen.metrics.fetch_failures.get(reason="not_allowed")
    finally:
        await ctx_server.cleanup()
        await gen_server.cleanup()
    return seen


if __name__ == "__main__":
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{OUTSIDE}/32", "dev", "lo"], check=True)
    print(json.dumps(asyncio.run(main())))
