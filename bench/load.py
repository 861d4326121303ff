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
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench._timing import format_table
from bench.workload import chat_body

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_URL = "http://127.0.0.1:8000"
#: defaults of the flags whose default depends on the mode (``--abuse`` has its own: bench/abuse.py)
LOAD_DEFAULTS = {"concurrency": "16,64,256,1024", "prompt_tokens": 40_000, "max_tokens": 16,
                 "duration": 60.0, "timeout": 60.0}  # fmt: skip


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    timed_out: bool = False
    error: str | None = None


@dataclass
class LevelResult:
    label: str
    concurrency: int | None
    rate: float | None
    requests: int
    errors: int
    timeouts: int
    duration_s: float
    completions_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    error_samples: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float) -> RequestResult:
    t0 = time.perf_counter()
    ttft: float | None = None
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:300].decode(errors="replace")
                    return RequestResult(False, error=f"HTTP {resp.status}: {text}")
                done = False
                buffer = b""
                async for chunk in resp.content.iter_any():
                    if ttft is None and b"data:" in chunk:
                        ttft = time.perf_counter() - t0
                    buffer = (buffer + chunk)[-256:]
                    if b'"error"' in chunk:
                        return RequestResult(False, ttft=ttft, error=chunk[:300].decode(errors="replace"))
                    if b"data: [DONE]" in buffer:
                        done = True
                if not done:
                    return RequestResult(False, ttft=ttft, error="stream ended without [DONE]")
                return RequestResult(True, ttft=ttft, latency=time.perf_counter() - t0)
    except TimeoutError:
        return RequestResult(False, ttft=ttft, timed_out=True, error=f"timed out after {timeout}s")
    except (aiohttp.ClientError, ConnectionError) as exc:
        return RequestResult(False, ttft=ttft, error=f"{type(exc).__name__}: {exc}")


async def one_unary_request(
    session: aiohttp.ClientSession, url: str, body: bytes, timeout: float
) -> RequestResult:
    """A non-streaming request: TTFT and latency are both the time to the whole response."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                data = await resp.read()
                if resp.status != 200:
                    return RequestResult(
                        False, error=f"HTTP {resp.status}: {data[:300].decode(errors='replace')}"
                    )
                elapsed = time.perf_counter() - t0
                try:
                    choices = json.loads(data)["choices"]
                    ok = isinstance(choices, list) and len(choices) > 0
                except (ValueError, KeyError, TypeError):
                    ok = False
                if not ok:
                    return RequestResult(
                        False, ttft=elapsed, error=f"no choices in: {data[:300].decode(errors='replace')}"
                    )
                return RequestResult(True, ttft=elapsed, latency=elapsed)
    except TimeoutError:
        return RequestResult(False, timed_out=True, error=f"timed out after {timeout}s")
    except (aiohttp.ClientError, ConnectionError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")


class Progress:
    """A one-line progress bar on stderr (no dependency), quiet when not a tty."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.errors = label, total, 0, 0
        self.enabled = sys.stderr.isatty()
        self._last = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / max(1, self.total))
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(f"\r  {self.label:<28} [{bar}] {self.done}/{self.total} err={self.errors}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def summarize(
    label: str,
    results: list[RequestResult],
    duration: float,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
) -> LevelResult:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    lats = [r.latency for r in ok if r.latency is not None]
    return LevelResult(
        label=label,
        concurrency=concurrency,
        rate=rate,
        requests=len(results),
        errors=len(results) - len(ok),
        timeouts=sum(r.timed_out for r in results),
        duration_s=round(duration, 3),
        completions_per_s=round(len(ok) / duration, 2) if duration > 0 else 0.0,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p95_ms=_ms(percentile(ttfts, 95)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        latency_p50_ms=_ms(percentile(lats, 50)),
        latency_p95_ms=_ms(percentile(lats, 95)),
        latency_p99_ms=_ms(percentile(lats, 99)),
        error_samples=sorted({r.error or "" for r in results if not r.ok})[:5],
    )


def _session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, force_close=False, ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def run_concurrency(
    url: str,
    body: bytes,
    concurrency: int,
    *,
    max_requests: int,
    max_seconds: float,
    timeout: float,
    label: str = "",
    request: Callable[[aiohttp.ClientSession, str, bytes, float], Awaitable[RequestResult]] = one_request,
    session: aiohttp.ClientSession | None = None,
) -> LevelResult:
    """Closed loop: ``concurrency`` clients, each sending its next request when the last ends.

    ``request`` is :func:`one_request` (SSE) or :func:`one_unary_request`; ``session``, when given,
    is used (its keep-alive connections kept) instead of a new one closed at the end.
    """
    results: list[RequestResult] = []
    progress = Progress(label or f"c={concurrency}", max_requests)
    issued = 0
    deadline = time.perf_counter() + max_seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            r = await request(session, url, body, timeout)
            results.append(r)
            progress.update(r.ok)

    async def clients(session: aiohttp.ClientSession) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return time.perf_counter() - t0

    if session is None:
        async with _session() as own:
            duration = await clients(own)
    else:
        duration = await clients(session)
    progress.close()
    return summarize(label, results, duration, concurrency=concurrency)


async def run_rate(
    url: str,
    body: bytes,
    rate: float,
    *,
    max_requests: int,
    max_seconds: float,
    timeout: float,
    label: str = "",
    seed: int = 0,
) -> LevelResult:
    """Open loop: Poisson arrivals at ``rate`` requests/s, whatever the server keeps up with."""
    rng = random.Random(seed)
    results: list[RequestResult] = []
    progress = Progress(label or f"rate={rate}", max_requests)
    async with _session() as session:

        async def fire() -> None:
            r = await one_request(session, url, body, timeout)
            results.append(r)
            progress.update(r.ok)

        tasks: list[asyncio.Task[None]] = []
        t0 = time.perf_counter()
        next_at = t0
        while len(tasks) < max_requests and next_at - t0 < max_seconds:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire()))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    progress.close()
    return summarize(label, results, duration, rate=rate)


TABLE_HEADERS = [
    "label",
    "conc",
    "reqs",
    "errors",
    "timeouts",
    "compl/s",
    "TTFT p50 ms",
    "p95",
    "p99",
    "E2E p50 ms",
    "p95",
    "p99",
]


def table(levels: Sequence[LevelResult]) -> str:
    return format_table(
        TABLE_HEADERS,
        [
            [
                lv.label,
                lv.concurrency if lv.concurrency is not None else f"rate {lv.rate}",
                lv.requests,
                lv.errors,
                lv.timeouts,
                lv.completions_per_s,
                lv.ttft_p50_ms,
                lv.ttft_p95_ms,
                lv.ttft_p99_ms,
                lv.latency_p50_ms,
                lv.latency_p95_ms,
                lv.latency_p99_ms,
            ]
            for lv in levels
        ],
    )


def plot(levels: Sequence[LevelResult], path: Path, title: str) -> None:
    """TTFT p50 and completions/s against concurrency, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label: dict[str, list[LevelResult]] = {}
    for lv in levels:
        if lv.concurrency is not None:
            by_label.setdefault(lv.label.split(" c=")[0], []).append(lv)
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in by_label.items():
        rows.sort(key=lambda r: r.concurrency or 0)
        xs = [r.concurrency for r in rows]
        ax_ttft.plot(xs, [r.ttft_p50_ms for r in rows], marker="o", label=label)
        ax_tput.plot(xs, [r.completions_per_s for r in rows], marker="o", label=label)
    for ax, ylabel in ((ax_ttft, "TTFT p50 (ms, log)"), (ax_tput, "completions/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_ttft.set_yscale("log")
    ax_tput.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(levels: Sequence[LevelResult], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "levels": [asdict(lv) for lv in levels]}, indent=2))


def _parse_levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help=f"base URL of the server under load (default {DEFAULT_URL}; "
                   "with --abuse: the target instead of a deployment of its own)")  # fmt: skip
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
    p.add_argument("--cluster", action="store_true",
                   help="the chaos run with discovery: etcd, 2 orchestrators, 2+2 registered workers; "
                        "kills workers and etcd, reports failures and time to reroute")  # fmt: skip
    p.add_argument("--chaos-interval", type=float, default=3.0, help="seconds between worker kills")
    p.add_argument("--chaos-concurrency", type=int, default=64, help="concurrent streams during --chaos")
    p.add_argument("--abuse", action="store_true",
                   help="honest load, clean and beside hostile clients (bench/abuse.py)")  # fmt: skip
    p.add_argument("--context-metrics", default=None,
                   help="--abuse --url: the context worker's base URL, for its KV gauge")  # fmt: skip
    p.add_argument("--abandon-batch", type=int, default=None, help="--abuse: abandoned requests per round")
    p.add_argument("--slowloris", type=int, default=None, help="--abuse: slow-header connections")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="--abuse: the target's body limit (default the orchestrator's)")  # fmt: skip
    p.add_argument("--header-timeout-s", type=float, default=None,
                   help="--abuse: the target's header timeout (default the orchestrator's)")  # fmt: skip
    p.add_argument("--keepalive-timeout-s", type=float, default=None,
                   help="--abuse: the target's keep-alive timeout (default the orchestrator's)")  # fmt: skip
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
    for c in _parse_levels(args.concurrency):
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.abuse:
        from bench import abuse

        return abuse.main(args)
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
