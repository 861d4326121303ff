"""The load generator's parts, shared by every benchmark that puts load on a URL.

Streamed (SSE) and unary requests with their TTFT and latency, closed-loop
(:func:`run_concurrency`) and open-loop (:func:`run_rate`) levels, their
summary (:class:`LevelResult`), table, plot and JSON. ``python -m bench.load``
(bench/load.py) is the command line over them; bench.abuse, bench.load_modes,
bench.cluster_chaos and the other benchmarks use them directly.
"""

from __future__ import annotations

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

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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

    @classmethod
    def empty(cls, label: str, concurrency: int | None) -> LevelResult:
        """No request yet: a phase's result, filled in as it runs."""
        return cls(label, concurrency, None, 0, 0, 0, 0.0, 0.0, None, None, None, None, None, None)


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


def new_session() -> aiohttp.ClientSession:
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
    rate: float = 0.0,
) -> LevelResult:
    """Closed loop: ``concurrency`` clients, each sending its next request when the last ends.

    ``request`` is :func:`one_request` (SSE) or :func:`one_unary_request`; ``session``, when given,
    is used (its keep-alive connections kept) instead of a new one closed at the end. ``rate``
    (requests/s; 0: as fast as the clients go) paces the loop: the n-th request starts no sooner
    than n / ``rate`` s after the first, so servers that keep up are measured at the same load (a
    faster one is not given more requests per wake-up); one that cannot is as in the closed loop.
    """
    results: list[RequestResult] = []
    progress = Progress(label or f"c={concurrency}", max_requests)
    issued = 0
    deadline = time.perf_counter() + max_seconds
    start = 0.0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() < deadline:
            slot = issued
            issued += 1
            if rate:
                wait = start + slot / rate - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
            r = await request(session, url, body, timeout)
            results.append(r)
            progress.update(r.ok)

    async def clients(session: aiohttp.ClientSession) -> float:
        nonlocal start
        t0 = start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return time.perf_counter() - t0

    if session is None:
        async with new_session() as own:
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
    async with new_session() as session:

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


def parse_levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def read_status(reader: asyncio.StreamReader) -> str:
    """The status of the server's answer ("413"), or "closed" / "reset" when it hung up instead."""
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError as exc:
        return "closed" if not exc.partial else "garbage"
    except (ConnectionError, asyncio.LimitOverrunError):
        return "reset"
    parts = line.split()
    return (
        parts[1].decode(errors="replace") if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else "garbage"
    )
