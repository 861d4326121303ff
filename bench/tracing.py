"""What OpenTelemetry tracing costs the orchestrator per request (server/tracing.py, docs/tracing.md).

    python -m bench.tracing                      # the hooks in process, then the live orchestrator
    python -m bench.tracing --hooks-only         # the in-process part only (seconds, less noise)

Settings: ``off`` (no endpoint: the SDK is never imported), ``1/100`` (on,
``parentbased_traceidratio`` 0.01: the other 99 carry only an unsampled
``traceparent``) and ``100%`` (every request's spans exported).

1. In process: one request's tracing hooks as the orchestrator runs them (the
   request span, the model attribute, two legs with their routing decision,
   first byte and end, the stream's first-token watch), N times; the process's
   CPU per request, which counts the BatchSpanProcessor's thread encoding and
   posting the spans to an OTLP/HTTP receiver in another process.
2. Live: synthetic workers and a ``gates-off`` orchestrator pinned to its own
   core (``bench/deploy.py``), streaming chat requests from a closed loop; the
   orchestrator's CPU per request (kernel accounting) per setting, with the
   workers tracing too (their spans go to the same receiver).

On a shared 2-core machine the live figures move by several percent between
runs: read the in-process part for the hooks' own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._timing import format_table
from bench.deploy import Deployment, free_port
from bench.loadgen import RESULTS_DIR, run_concurrency
from bench.workload import chat_body

SETTINGS: dict[str, dict[str, str]] = {
    "off": {},
    "1/100": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
    "100%": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
}

#: an OTLP/HTTP receiver in its own process: answers 200 to every export, counts them
RECEIVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def start_receiver() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}/v1/traces"


class _FakeRequest:
    def header(self, name: bytes) -> bytes | None:
        return None


class _FakePool:
    name = "context"

    class router:
        name = "round_robin"


class _FakeWorker:
    url = "http://127.0.0.1:1"


class _FakeResp:
    size = 1234


def hooks_cpu_us(setting: str, endpoint: str, n: int) -> float:
    """CPU µs per request of the orchestrator's tracing hooks (process CPU: the exporter thread too)."""
    from server import tracing as t

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(SETTINGS[setting])
    env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    env["OTEL_BSP_MAX_QUEUE_SIZE"] = str(8 * n)  # none dropped: every span is exported and counted
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        tracing = t.start_tracing("bench", endpoint if setting != "off" else None, env)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    request, pool, worker, resp = _FakeRequest(), _FakePool(), _FakeWorker(), _FakeResp()

    def one() -> None:
        trace = None
        if tracing is not None:
            trace = t.start_orchestrator_request(tracing, request, "/v1/chat/completions", None)
        if tracing is not None and (current := t.current_trace()) is not None:
            current.set("gen_ai.request.model", "synthetic")
        for leg_name in ("context", "generation"):
            current = t.current_trace()
            routed = current.now() if current is not None else 0
            leg = None
            headers = b"Content-Type: application/json\r\n"
            if current is not None:
                leg = current.start_leg(leg_name, pool, worker, None, routed, 0)
                headers += leg.header
            if leg is not None:
                leg.answered(200, resp)
            if leg_name == "generation" and current is not None:
                current.watch_stream(len)(b"data: x\n\n")
            if leg is not None:
                leg.end()
        if trace is not None:
            trace.end(200)

    for _ in range(min(n, 2000)):  # warm-up
        one()
    cpu0 = time.process_time()
    for _ in range(n):
        one()
    if tracing is not None:
        tracing.shutdown()  # the batched spans' export is part of the cost
    cpu = time.process_time() - cpu0
    return 1e6 * cpu / n


def live_cpu_ms(
    setting: str, endpoint: str, *, prompt_tokens: int, requests: int, concurrency: int
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if setting != "off":
        env.update(SETTINGS[setting])
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    body = chat_body(prompt_tokens, model="synthetic", max_tokens=16)
    dep = Deployment("gates-off", prompt_tokens).start(env)
    try:
        url = dep.url + "/v1/chat/completions"
        warm = asyncio.run(run_concurrency(url, body, 4, max_requests=40, max_seconds=30, timeout=60))
        if warm.errors:
            raise RuntimeError(f"{setting}: warm-up failed: {warm.error_samples}")
        cpu0 = dep.front_cpu_seconds()
        level = asyncio.run(
            run_concurrency(
                url, body, concurrency, max_requests=requests, max_seconds=120, timeout=60, label=setting
            )
        )
        cpu = dep.front_cpu_seconds() - cpu0
    finally:
        dep.stop()
    return {
        "setting": setting,
        "requests": level.requests,
        "errors": level.errors,
        "cpu_ms_per_request": round(1000 * cpu / max(1, level.requests), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__.split("\n\n")[0])
    p.add_argument("--hooks", type=int, default=20000, help="requests through the hooks in process")
    p.add_argument("--hooks-only", action="store_true", help="skip the live orchestrator")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--requests", type=int, default=600, help="measured live requests per setting")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="live rounds (settings interleaved)")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "tracing.json")
    args = p.parse_args(argv)
    receiver, endpoint = start_receiver()
    results: dict[str, Any] = {}
    try:
        hooks = {s: hooks_cpu_us(s, endpoint, args.hooks) for s in SETTINGS}
        results["hooks_cpu_us_per_request"] = {s: round(v, 2) for s, v in hooks.items()}
        print("\n### The orchestrator's tracing hooks, in process (CPU per request)\n")
        print(
            format_table(
                ["setting", "CPU µs/req", "vs off"],
                [[s, f"{v:.2f}", f"+{v - hooks['off']:.2f} µs"] for s, v in hooks.items()],
            )
        )
        if not args.hooks_only:
            runs: dict[str, list[float]] = {s: [] for s in SETTINGS}
            for _ in range(args.rounds):
                for setting in SETTINGS:
                    m = live_cpu_ms(
                        setting,
                        endpoint,
                        prompt_tokens=args.prompt_tokens,
                        requests=args.requests,
                        concurrency=args.concurrency,
                    )
                    if m["errors"]:
                        raise RuntimeError(f"{setting}: {m['errors']} errors")
                    runs[setting].append(m["cpu_ms_per_request"])
            best = {s: min(v) for s, v in runs.items()}
            results["live_cpu_ms_per_request"] = runs
            print(
                f"\n### Live orchestrator, {args.prompt_tokens:,} prompt tokens, streaming (CPU per request)\n"
            )
            print(
                format_table(
                    ["setting", "CPU ms/req (each round)", "best", "vs off"],
                    [
                        [
                            s,
                            " ".join(f"{x:.3f}" for x in runs[s]),
                            f"{best[s]:.3f}",
                            f"{best[s] / best['off']:.3f}x",
                        ]
                        for s in SETTINGS
                    ],
                )
            )
    finally:
        receiver.terminate()
        receiver.wait()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
