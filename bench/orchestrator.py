"""The orchestrator's own cost per request, per relay mode, against the pass-through floor.

    python -m bench.orchestrator                  # 4k, 40k, 128k prompt tokens
    python -m bench.orchestrator --prompt-tokens 40000 --requests 400

For each prompt length and each front process (the four orchestrator modes
and the floor, a bare aiohttp proxy that carries no ids, see
``bench/passthrough.py``), starts synthetic workers with zero latency and the
front pinned to its own core (``bench/deploy.py``), sends streaming chat
requests with an agentic history (~4 bytes of text per prompt token) from a
closed loop, and reports, in one run:

- the front process's CPU time per request, from the kernel's accounting
  (utime + stime over the measured requests);
- completions/s sustained: with the workers instant, the front's core is what
  saturates (the workers and this load generator share the other core).

Modes: ``parsed`` (json.loads -> pydantic -> model_dump_json, gates off: what a
typical pydantic orchestrator does), ``gates-off`` (fast relay, ids as a JSON
list), ``tokids-b64`` (gen_tokids_ctxbytes), ``both-gates`` (plus
gen_strip_message_history).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._timing import format_table
from bench.deploy import FLOOR, FRONTS, Deployment, cores
from bench.loadgen import RESULTS_DIR, run_concurrency
from bench.workload import chat_body


@dataclass
class Measurement:
    front: str
    prompt_tokens: int
    requests: int
    errors: int
    cpu_ms_per_request: float
    completions_per_s: float
    ttft_p50_ms: float | None


def measure(
    front: str, prompt_tokens: int, *, requests: int, concurrency: int, max_tokens: int, max_seconds: float
) -> Measurement:
    body = chat_body(prompt_tokens, model="synthetic", max_tokens=max_tokens)
    with Deployment(front, prompt_tokens) as dep:
        url = dep.url + "/v1/chat/completions"
        warm = asyncio.run(
            run_concurrency(
                url, body, 4, max_requests=20, max_seconds=30, timeout=60, label=f"{front} warm-up"
            )
        )
        if warm.errors:
            raise RuntimeError(f"{front}: warm-up failed: {warm.error_samples}")
        cpu0 = dep.front_cpu_seconds()
        level = asyncio.run(
            run_concurrency(
                url,
                body,
                concurrency,
                max_requests=requests,
                max_seconds=max_seconds,
                timeout=60,
                label=f"{front} {prompt_tokens // 1000}k",
            )
        )
        cpu = dep.front_cpu_seconds() - cpu0
    return Measurement(
        front=front,
        prompt_tokens=prompt_tokens,
        requests=level.requests,
        errors=level.errors,
        cpu_ms_per_request=round(1000 * cpu / max(1, level.requests), 3),
        completions_per_s=level.completions_per_s,
        ttft_p50_ms=level.ttft_p50_ms,
    )


def report(results: list[Measurement]) -> str:
    out = []
    for n in sorted({m.prompt_tokens for m in results}):
        rows = {m.front: m for m in results if m.prompt_tokens == n}
        base, floor = rows.get("parsed"), rows.get(FLOOR)
        table = []
        for front in FRONTS:
            m = rows.get(front)
            if m is None:
                continue
            vs_base = f"{base.cpu_ms_per_request / m.cpu_ms_per_request:.2f}x" if base else "-"
            vs_floor = f"{m.cpu_ms_per_request / floor.cpu_ms_per_request:.2f}x" if floor else "-"
            tput = f"{m.completions_per_s / base.completions_per_s:.2f}x" if base else "-"
            table.append(
                [
                    front,
                    m.requests,
                    m.errors,
                    f"{m.cpu_ms_per_request:.3f}",
                    vs_base,
                    vs_floor,
                    f"{m.completions_per_s:.1f}",
                    tput,
                    m.ttft_p50_ms,
                ]
            )
        out.append(f"\n### {n:,} prompt tokens\n")
        out.append(
            format_table(
                [
                    "front",
                    "reqs",
                    "errors",
                    "CPU ms/req",
                    "CPU: parsed/this",
                    "CPU: this/floor",
                    "compl/s",
                    "compl/s vs parsed",
                    "TTFT p50 ms",
                ],
                table,
            )
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.orchestrator", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", default="4000,40000,128000", help="comma-separated prompt lengths")
    p.add_argument("--fronts", default=",".join(FRONTS), help=f"comma-separated, from {FRONTS}")
    p.add_argument("--requests", type=int, default=300, help="measured requests per front and length")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=60.0, help="time bound per measurement")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "orchestrator.json")
    args = p.parse_args(argv)

    front_cpus, other = cores()
    print(
        f"front pinned to CPU {front_cpus or 'none (one core)'}; workers + load generator on {other or 'the same'}"
    )
    results = []
    for n in (int(x) for x in args.prompt_tokens.split(",")):
        for front in args.fronts.split(","):
            results.append(
                measure(
                    front,
                    n,
                    requests=args.requests,
                    concurrency=args.concurrency,
                    max_tokens=args.max_tokens,
                    max_seconds=args.max_seconds,
                )
            )
    print(report(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps([asdict(m) for m in results], indent=2))
    print(f"\nresults: {args.output}")
    return 1 if any(m.errors for m in results) else 0


if __name__ == "__main__":
    sys.exit(main())
