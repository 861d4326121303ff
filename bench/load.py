"""Async load generator for any OpenAI-compatible URL: TTFT, latency and throughput per level.

    python -m bench.load --url http://127.0.0.1:8000 --concurrency 16,64,256 --requests 400
    python -m bench.load --url http://127.0.0.1:8000 --rate 50 --duration 20
    python -m bench.load --compare            # every orchestrator mode + the floor, one plot
    python -m bench.load --chaos              # kill/restart a generation worker under load
    python -m bench.load --cluster            # the same with etcd discovery, 2 orchestrators, etcd killed too
    python -m bench.load --abuse              # honest load beside abandon floods, slowloris, huge bodies

Every level is bounded in requests and in time and stops by itself. Requests
stream (SSE); TTFT is the time to the first ``data:`` event, end-to-end latency
the time to ``[DONE]``. A request that fails, ends without ``[DONE]``, or runs
past ``--timeout`` is an error (timeouts are counted separately).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bench.loadgen import (
    RESULTS_DIR,
    LevelResult,
    parse_levels,
    plot,
    run_concurrency,
    run_rate,
    table,
    write_json,
)
from bench.workload import chat_body

DEFAULT_URL = "http://127.0.0.1:8000"
#: defaults of the flags whose default depends on the mode (``--abuse`` has its own: bench/abuse.py)
LOAD_DEFAULTS = {
    "concurrency": "16,64,256,1024",
    "prompt_tokens": 40_000,
    "max_tokens": 16,
    "duration": 60.0,
    "timeout": 60.0,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--url",
        default=None,
        help=f"base URL of the server under load (default {DEFAULT_URL}; "
        "with --abuse: the target instead of a deployment of its own)",
    )
    p.add_argument("--route", default="/v1/chat/completions")
    p.add_argument(
        "--concurrency", default=None, help="comma-separated closed-loop levels (default 16,64,256,1024)"
    )
    p.add_argument("--rate", type=float, default=None, help="open-loop requests/s instead of levels")
    p.add_argument(
        "--requests", type=int, default=0, help="requests per level (default 4x concurrency, >=200)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="time bound per level (and of --chaos), seconds (default 60)",
    )
    p.add_argument("--timeout", type=float, default=None, help="per-request timeout, seconds (default 60)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 40,000")
    p.add_argument("--max-tokens", type=int, default=None, help="default 16")
    p.add_argument("--model", default="tiny")
    p.add_argument("--output", type=Path, default=None, help="JSON results path (default bench/results/...)")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot path (default bench/results/...)")
    p.add_argument("--compare", action="store_true", help="run every orchestrator mode on synthetic workers")
    p.add_argument("--chaos", action="store_true", help="kill/restart a generation worker during load")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="the chaos run with discovery: etcd, 2 orchestrators, 2+2 registered workers; "
        "kills workers and etcd, reports failures and time to reroute",
    )
    p.add_argument("--chaos-interval", type=float, default=3.0, help="seconds between worker kills")
    p.add_argument("--chaos-concurrency", type=int, default=64, help="concurrent streams during --chaos")
    p.add_argument(
        "--abuse", action="store_true", help="honest load, clean and beside hostile clients (bench/abuse.py)"
    )
    p.add_argument(
        "--context-metrics",
        default=None,
        help="--abuse --url: the context worker's base URL, for its KV gauge",
    )
    p.add_argument("--abandon-batch", type=int, default=None, help="--abuse: abandoned requests per round")
    p.add_argument("--slowloris", type=int, default=None, help="--abuse: slow-header connections")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="--abuse: the target's body limit (default the orchestrator's)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=None,
        help="--abuse: the target's header timeout (default the orchestrator's)",
    )
    p.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=None,
        help="--abuse: the target's keep-alive timeout (default the orchestrator's)",
    )
    p.add_argument(
        "--tenants-only",
        action="store_true",
        help="--abuse: only the tenant phases (issue 36: breaker, priority, token-limit abuse)",
    )
    p.add_argument("--no-tenants", action="store_true", help="--abuse: without the tenant phases")
    p.add_argument("--quick", action="store_true", help="small levels, for a smoke run")
    return p


async def _run_levels(args: argparse.Namespace, url: str, label: str) -> list[LevelResult]:
    body = chat_body(args.prompt_tokens, model=args.model, max_tokens=args.max_tokens)
    levels: list[LevelResult] = []
    if args.rate:
        n = args.requests or max(200, int(args.rate * args.duration))
        levels.append(
            await run_rate(
                url,
                body,
                args.rate,
                max_requests=n,
                max_seconds=args.duration,
                timeout=args.timeout,
                label=f"{label} rate={args.rate}",
            )
        )
        return levels
    for c in parse_levels(args.concurrency):
        n = args.requests or max(200, 4 * c)
        levels.append(
            await run_concurrency(
                url,
                body,
                c,
                max_requests=n,
                max_seconds=args.duration,
                timeout=args.timeout,
                label=f"{label} c={c}",
            )
        )
    return levels


def _abuse(args: argparse.Namespace) -> int:
    """``--abuse``: bench/abuse.py's phases, then bench/abuse_tenants.py's on a keyed deployment of
    its own (not with ``--url``: its keys and limits are the run's own); 1 if either's targets were
    missed. Both are chosen here, so neither module imports the other's runner."""
    from bench import abuse, abuse_tenants

    if args.tenants_only:
        return abuse_tenants.main(args)
    rc = abuse.main(args)
    if args.url or args.no_tenants:
        return rc
    print("\nTenants (issue 36): an honest tenant beside three attacker tenants' clients\n")
    return max(rc, abuse_tenants.main(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.abuse:
        return _abuse(args)
    for name, default in LOAD_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.cluster:
        from bench import cluster_chaos

        return cluster_chaos.main(args)
    if args.compare or args.chaos:
        from bench import load_modes

        return load_modes.main(args)
    args.url = args.url or DEFAULT_URL
    url = args.url.rstrip("/") + args.route
    levels = asyncio.run(_run_levels(args, url, label=args.url))
    print(table(levels))
    output = args.output or RESULTS_DIR / "load.json"
    write_json(levels, output, {"url": url, "prompt_tokens": args.prompt_tokens})
    print(f"\nresults: {output}")
    if args.rate is None:  # a plot needs concurrency levels on its x axis
        png = args.plot or RESULTS_DIR / "load.png"
        plot(levels, png, f"{url}, {args.prompt_tokens:,} prompt tokens")
        print(f"plot: {png}")
    return 1 if any(lv.errors for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
