"""``python -m bench.trace``: a real traffic trace replayed through the orchestrator, per router.

The trace is Mooncake's format (FAST'25; ``bench/data/mooncake/``: 3,993 requests
built from public datasets, Poisson arrivals, multi-turn order kept), one JSON
object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, one id per 512-token block, equal ids the same block. A request
is sent open loop at its timestamp (divided by ``--speedup``) as one streaming
chat message: its blocks' texts (each id a fixed text of 512 tokens' bytes,
the same every time) cut to ``input_length`` tokens, ``max_tokens`` its
``output_length`` (at most ``--max-output-tokens``).

Workers: synthetic text-mode workers (``--prompt-tokens 0``: ids from the text,
``--bytes-per-token`` bytes each, the prefix cache modelled with ``--kv-tokens``
each), ``--context-workers`` + ``--generation-workers``. The KV per worker is
``--kv-fraction`` of the replayed requests' working set (their distinct blocks)
shared by the context workers. With ``--prefill-tokens-per-s`` (or
``--target-busy``, which derives it from round robin's computed tokens) each
worker's prefill compute is one queue (first come first served), so what a
router saves in prefill it saves in time-to-first-token.

Per router (round_robin, conversation, kv_cache_aware, kv_cache_aware with
conditional disaggregation) and per number of orchestrators (1, 2, 4: a client
that spreads requests over them in turn; several find the workers through a
local etcd), reported: the prompt tokens served from the workers' caches
(their /metrics), the oracle (the same cache model, one instance of the
context workers' total KV, over the same prompts in order, computed here
offline) and the ratio, prefill tokens computed, TTFT p50/p90, errors and
503s, the orchestrators' CPU per request, the context workers' busy fraction
(with a prefill rate). A markdown table, JSON and a PNG in ``bench/results``.

By default the trace's last 300 requests (``--start``, ``--n``): its first
ones mostly open conversations (5% of the first 400's tokens are reusable
among them, 66% of the last 300's).

``round_robin+tier2`` and ``kv_cache_aware+tier2``: the workers with a second KV tier of
``--tier2-factor`` x their KV, loading at ``--tier2-load-tokens-per-s`` (evicted blocks go there; a
hit there is loaded instead of prefilled); stderr also says the unbounded cache's hit fraction
and the pooled oracle of device + tier 2.

``--quick``: the last 60 requests, 1 and 2 orchestrators, round_robin and kv_cache_aware.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.agentic import _worker_counters
from bench.cluster_chaos import routed
from bench.deploy import Deployment, cpu_seconds, free_port
from bench.loadgen import RESULTS_DIR, new_session, percentile
from server.worker.synthetic import PrefixCacheModel, SyntheticTokenizer

TRACE = Path(__file__).resolve().parent / "data" / "mooncake" / "mooncake_synthetic_trace.jsonl"
#: tokens per hash id of a Mooncake trace
TRACE_BLOCK_TOKENS = 512
ROUTINGS: dict[str, dict[str, Any]] = {
    "round_robin": {"router": "round_robin"},
    "conversation": {"router": "conversation"},
    "kv_cache_aware": {"router": "kv_cache_aware"},
    "kv_cache_aware+conditional": {"router": "kv_cache_aware", "conditional": True},
    # a second KV tier in each worker (--tier2-factor x its KV; --tier2-load-tokens-per-s)
    "round_robin+tier2": {"router": "round_robin", "tier2": True},
    "kv_cache_aware+tier2": {"router": "kv_cache_aware", "tier2": True},
}
#: the synthetic worker's chat template around one user message (server/worker/synthetic.py)
TEMPLATE = "<|user|>\n{}\n<|assistant|>\n"
_TEMPLATE_BYTES = len(TEMPLATE.format(""))
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


@dataclass
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: Path, n: int | None = None, start: int = 0) -> list[TraceRequest]:
    """``n`` requests of a Mooncake-format trace from request ``start`` (negative: from the end),
    their timestamps from the first one's (ValueError naming the line and field)."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                req = TraceRequest(
                    int(doc["timestamp"]),
                    int(doc["input_length"]),
                    int(doc["output_length"]),
                    [int(h) for h in doc["hash_ids"]],
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace request ({exc!r})") from None
            if req.input_length < 1 or not req.hash_ids:
                raise ValueError(f"{path}:{number}: input_length must be >= 1 and hash_ids non-empty")
            out.append(req)
    out = out[start:]
    if n is not None:
        out = out[:n]
    if out:
        first = out[0].timestamp_ms
        for r in out:
            r.timestamp_ms -= first
    return out


class BlockTexts:
    """Each hash id's text: ``512 x bytes_per_token`` bytes of lowercase words, seeded by the id,
    so equal ids are equal text and a prompt's ids follow its blocks'."""

    def __init__(self, bytes_per_token: int) -> None:
        self.size = TRACE_BLOCK_TOKENS * bytes_per_token
        self._texts: dict[int, str] = {}

    def __getitem__(self, hash_id: int) -> str:
        text = self._texts.get(hash_id)
        if text is None:
            picks = np.random.default_rng(hash_id).integers(0, _ALPHABET.size, size=self.size)
            text = self._texts[hash_id] = _ALPHABET[picks].tobytes().decode("ascii")
        return text

    def prompt(self, req: TraceRequest, bytes_per_token: int) -> str:
        """The request's user message: its blocks, cut so that the templated prompt is
        ``input_length`` ids (at least one byte of content)."""
        size = max(1, req.input_length * bytes_per_token - _TEMPLATE_BYTES)
        blocks, total = [], 0
        for h in req.hash_ids:
            if total >= size:
                break
            blocks.append(self[h])
            total += self.size
        return "".join(blocks)[:size]


def working_set_tokens(requests: list[TraceRequest]) -> int:
    """Tokens of the distinct blocks the requests name."""
    return len({h for r in requests for h in r.hash_ids}) * TRACE_BLOCK_TOKENS


def oracle(prompts: list[str], bytes_per_token: int, capacity_tokens: int) -> tuple[int, int]:
    """(prompt ids served from the cache, prompt ids) for one pooled cache of ``capacity_tokens``
    (the workers' own cache model) that sees every prompt in order: what perfect routing over
    the fleet's KV could reach (without sharing a prompt between two workers' caches)."""
    tokenizer = SyntheticTokenizer(0, bytes_per_token=bytes_per_token)
    cache = PrefixCacheModel(capacity_tokens)
    hit = total = 0
    for content in prompts:
        ids = np.asarray(tokenizer.encode(TEMPLATE.format(content)))
        served, hashes = cache.lookup(ids)
        cache.remember(hashes)
        hit += served
        total += int(ids.size)
    return hit, total


def block_oracle(requests: list[TraceRequest], capacity_tokens: int) -> float:
    """The same at the trace's own granularity (512-token blocks, LRU): the fraction of prompt
    tokens in leading blocks held (a cross-check of :func:`oracle`)."""
    blocks: OrderedDict[int, None] = OrderedDict()
    limit = max(1, capacity_tokens // TRACE_BLOCK_TOKENS)
    hit = total = 0
    for r in requests:
        k = 0
        for h in r.hash_ids:
            if h not in blocks:
                break
            k += 1
        for h in r.hash_ids:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > limit:
            blocks.popitem(last=False)
        hit += min(k * TRACE_BLOCK_TOKENS, r.input_length - 1)
        total += r.input_length
    return hit / max(1, total)


@dataclass
class Sent:
    ok: bool
    status: int
    ttft_s: float | None
    cached_tokens: int | None
    error: str = ""


@dataclass
class RunResult:
    routing: str
    orchestrators: int
    bytes_per_token: int
    requests: int
    errors: int
    status_503: int
    duration_s: float
    prompt_tokens: int
    prefix_hit_tokens: int
    prefill_computed_tokens: int
    hit_fraction: float
    oracle_fraction: float
    vs_oracle: float
    usage_cached_tokens: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    orchestrator_cpu_us_per_request: float
    context_busy: float | None
    prefill_tokens_per_s: float
    error_samples: list[str] = field(default_factory=list)


async def _send(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float) -> Sent:
    t0 = time.perf_counter()
    ttft = None
    cached = None
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    return Sent(
                        False, resp.status, None, None, f"HTTP {resp.status}: {(await resp.read())[:160]!r}"
                    )
                buffer = b""
                async for chunk in resp.content.iter_any():
                    if ttft is None:
                        ttft = time.perf_counter() - t0  # the first bytes: the role chunk, after the prefill
                    buffer += chunk
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        message = json.loads(event[6:])
                        if "error" in message:
                            return Sent(False, 200, ttft, None, str(message["error"])[:160])
                        usage = message.get("usage")
                        if usage:
                            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                return Sent(True, 200, ttft, cached)
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
        return Sent(False, 0, ttft, None, f"{type(exc).__name__}: {exc}"[:160])


async def replay(
    fronts: list[str], requests: list[TraceRequest], bodies: list[bytes], speedup: float, timeout: float
) -> tuple[list[Sent], float]:
    """Every request at its (compressed) time, open loop, to orchestrator i mod len(fronts)."""
    results: list[Sent | None] = [None] * len(requests)

    async def one(i: int, session: aiohttp.ClientSession, start: float) -> None:
        delay = start + requests[i].timestamp_ms / 1000.0 / speedup - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        url = fronts[i % len(fronts)] + "/v1/chat/completions"
        results[i] = await _send(session, url, bodies[i], timeout)

    async with new_session() as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, session, start) for i in range(len(requests))))
        seconds = time.perf_counter() - start
    return [r for r in results if r is not None], seconds


def _config(routing: dict[str, Any], max_local_prefill: int) -> dict[str, Any]:
    router = {"type": routing["router"]}
    config: dict[str, Any] = {
        "context_servers": {"router": router},
        "generation_servers": {"router": router},
        "request_timeout_s": 600,
    }
    if routing.get("conditional"):
        config["conditional_disagg_config"] = {"max_local_prefill_length": max_local_prefill}
    return config


@contextlib.contextmanager
def deployment(
    args: argparse.Namespace, routing: str, orchestrators: int, kv_tokens: int, rate: float, tmp: Path
) -> Iterator[Deployment]:
    """The workers and ``orchestrators`` orchestrators (through a local etcd when several)."""
    path = tmp / f"{routing.replace('+', '_')}.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(_config(ROUTINGS[routing], args.max_local_prefill)))
    workers = ["--kv-tokens", str(kv_tokens), "--bytes-per-token", str(args.bytes_per_token)]
    if rate:
        workers += ["--prefill-tokens-per-s", str(rate)]
    if ROUTINGS[routing].get("tier2"):
        workers += [
            "--kv-tier2-tokens",
            str(int(kv_tokens * args.tier2_factor)),
            "--tier2-load-tokens-per-s",
            str(args.tier2_load_tokens_per_s),
        ]
    etcd = None
    if orchestrators > 1:
        from server.cluster.local_etcd import LocalEtcd

        etcd = LocalEtcd(free_port(), free_port()).start()
    dep = Deployment(
        "both-gates", 0, context_workers=args.context_workers, generation_workers=args.generation_workers,
        token_latency_ms=args.token_latency_ms, worker_args=workers, orchestrator_args=["-c", str(path)],
        cluster_uri=etcd.uri if etcd else None, orchestrators=orchestrators,
    )  # fmt: skip
    try:
        dep.start()
        if etcd is not None:
            asyncio.run(_every_front_routes_every_worker(dep))
        yield dep
    finally:
        dep.stop()
        if etcd is not None:
            etcd.stop()


async def _every_front_routes_every_worker(dep: Deployment, timeout: float = 60.0) -> None:
    want = {
        role: {f"http://127.0.0.1:{w.port}" for w in dep.workers if w.name.startswith(role)}
        for role in ("context", "generation")
    }
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as probe:
        while time.monotonic() < deadline:
            seen = [await routed(probe, dep.urls, role) for role in want]
            if all(want[role] <= s for role, per in zip(want, seen) for s in per):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the orchestrators did not find every worker within {timeout:.0f} s")


def run_one(
    args: argparse.Namespace,
    routing: str,
    orchestrators: int,
    requests: list[TraceRequest],
    bodies: list[bytes],
    kv_tokens: int,
    rate: float,
    oracle_fraction: float,
    tmp: Path,
) -> RunResult:
    with deployment(args, routing, orchestrators, kv_tokens, rate, tmp) as dep:
        pids = [f.proc.pid for f in dep.fronts if f.proc is not None]
        contexts = [f"http://127.0.0.1:{w.port}" for w in dep.workers if w.name.startswith("context")]
        everyone = [f"http://127.0.0.1:{w.port}" for w in dep.workers]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        sent, seconds = asyncio.run(replay(dep.urls, requests, bodies, args.speedup, args.timeout))
        cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        counters = asyncio.run(_worker_counters(everyone))
        context_counters = asyncio.run(_worker_counters(contexts))
    hit = int(counters.get("fastcore_worker_prefix_cache_hit_tokens_total", 0))
    computed = int(counters.get("fastcore_worker_prefill_computed_tokens_total", 0))
    ok = [s for s in sent if s.ok]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    p50, p90 = percentile(ttfts, 50), percentile(ttfts, 90)
    fraction = hit / max(1, hit + computed)
    busy = None
    if rate:
        ctx_computed = context_counters.get("fastcore_worker_prefill_computed_tokens_total", 0.0)
        busy = round(ctx_computed / (rate * seconds * args.context_workers), 3)
    return RunResult(
        routing=routing, orchestrators=orchestrators, bytes_per_token=args.bytes_per_token,
        requests=len(sent), errors=len(sent) - len(ok), status_503=sum(s.status == 503 for s in sent),
        duration_s=round(seconds, 1), prompt_tokens=hit + computed, prefix_hit_tokens=hit,
        prefill_computed_tokens=computed, hit_fraction=round(fraction, 4), oracle_fraction=round(oracle_fraction, 4),
        vs_oracle=round(fraction / oracle_fraction, 3) if oracle_fraction else 0.0,
        usage_cached_tokens=sum(s.cached_tokens or 0 for s in ok),
        ttft_p50_ms=None if p50 is None else round(p50 * 1000, 1),
        ttft_p90_ms=None if p90 is None else round(p90 * 1000, 1),
        orchestrator_cpu_us_per_request=round(cpu / max(1, len(sent)) * 1e6, 1), context_busy=busy,
        prefill_tokens_per_s=rate, error_samples=sorted({s.error for s in sent if not s.ok})[:3],
    )  # fmt: skip


def table(results: list[RunResult]) -> str:
    lines = [
        "| routing | orch | B/tok | requests | errors (503) | hit fraction | oracle | vs oracle | "
        "vs round_robin | prefill tokens computed | TTFT p50 ms | TTFT p90 ms | ctx busy | orch CPU µs/req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {
        (r.orchestrators, r.bytes_per_token, r.prefill_tokens_per_s): r
        for r in results
        if r.routing == "round_robin"
    }
    for r in results:
        rr = base.get((r.orchestrators, r.bytes_per_token, r.prefill_tokens_per_s))
        vs_rr = f"{r.prefix_hit_tokens / rr.prefix_hit_tokens:.2f}x" if rr and rr.prefix_hit_tokens else "-"
        busy = "-" if r.context_busy is None else f"{r.context_busy:.0%}"
        lines.append(
            f"| {r.routing} | {r.orchestrators} | {r.bytes_per_token} | {r.requests} | {r.errors} ({r.status_503}) | "
            f"{r.hit_fraction:.3f} | {r.oracle_fraction:.3f} | {r.vs_oracle:.2f}x | {vs_rr} | "
            f"{r.prefill_computed_tokens:,} | {r.ttft_p50_ms} | {r.ttft_p90_ms} | {busy} | "
            f"{r.orchestrator_cpu_us_per_request} |"
        )
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routings = list(dict.fromkeys(r.routing for r in results))
    counts = sorted({r.orchestrators for r in results})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(routings))
    for i, name in enumerate(routings):
        by = {r.orchestrators: r for r in results if r.routing == name}
        xs = [c + (i - (len(routings) - 1) / 2) * width for c in range(len(counts))]
        left.bar(xs, [by[c].hit_fraction if c in by else 0 for c in counts], width, label=name)
        right.bar(xs, [(by[c].ttft_p50_ms or 0) if c in by else 0 for c in counts], width, label=name)
    oracle_fraction = max((r.oracle_fraction for r in results), default=0.0)
    left.axhline(oracle_fraction, color="black", linestyle="--", linewidth=1, label="pooled oracle")
    for ax, title in ((left, "prompt tokens served from the workers' caches"), (right, "TTFT p50 (ms)")):
        ax.set_xticks(range(len(counts)), [f"{c} orchestrator{'s' if c > 1 else ''}" for c in counts])
        ax.set_title(title)
    left.set_ylim(0, 1)
    left.legend(fontsize=8)
    fig.suptitle(
        f"bench.trace: {results[0].requests} Mooncake requests, {results[0].bytes_per_token} bytes/token"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace", type=Path, default=TRACE, help="a Mooncake-format JSONL trace (default: the shipped one)"
    )
    p.add_argument("--n", type=int, default=300, help="replay N requests (default 300)")
    p.add_argument(
        "--start",
        type=int,
        default=-300,
        help="from request START, negative: from the end (default -300: the last 300; the trace's "
        "first requests open conversations, its last ones continue them)",
    )
    p.add_argument(
        "--speedup", type=float, default=4.0, help="divide the trace's timestamps by this (default 4)"
    )
    p.add_argument("--routings", default=",".join(ROUTINGS), help="which to run (default all)")
    p.add_argument("--orchestrators", default="1,2,4", help="orchestrator counts (default 1,2,4)")
    p.add_argument("--context-workers", type=int, default=4)
    p.add_argument("--generation-workers", type=int, default=2)
    p.add_argument(
        "--bytes-per-token", type=int, default=4, help="the workers' text bytes per id (default 4)"
    )
    p.add_argument(
        "--kv-fraction",
        type=float,
        default=0.25,
        help="the context workers' KV together, as a fraction of the working set (default 0.25)",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=0.0,
        help="each worker's prefill compute (default 0: prefill takes no time)",
    )
    p.add_argument(
        "--target-busy",
        type=float,
        default=0.0,
        help="derive --prefill-tokens-per-s so that round robin keeps the context workers this busy "
        "(a first round-robin run without a prefill cost measures what it computes)",
    )
    p.add_argument(
        "--tier2-factor",
        type=float,
        default=4.0,
        help="the +tier2 routings: each worker's second KV tier, x its KV (default 4)",
    )
    p.add_argument(
        "--tier2-load-tokens-per-s",
        type=float,
        default=0.0,
        help="the +tier2 routings: the tier's load rate (default 0: instant; below the prefill rate "
        "the workers do not take it)",
    )
    p.add_argument("--max-output-tokens", type=int, default=32, help="max_tokens at most this (default 32)")
    p.add_argument("--token-latency-ms", type=float, default=0.0, help="workers' time per further token")
    p.add_argument(
        "--max-local-prefill",
        type=int,
        default=4096,
        help="conditional_disagg_config.max_local_prefill_length (default 4096)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument(
        "--quick", action="store_true", help="the last 60 requests, 1 and 2 orchestrators, 2 routings"
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--output", type=Path, default=None, help="JSON (default bench/results/trace.json; PNG beside)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.n, args.start, args.speedup, args.orchestrators = 60, -60, max(args.speedup, 20.0), "1,2"
        if args.routings == ",".join(ROUTINGS):
            args.routings = "round_robin,kv_cache_aware"
    names = [n.strip() for n in args.routings.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROUTINGS))
    if unknown:
        print(
            f"python -m bench.trace: unknown routing {', '.join(unknown)}; choose from {', '.join(ROUTINGS)}",
            file=sys.stderr,
        )
        return 2
    try:
        counts = [int(c) for c in args.orchestrators.split(",") if c.strip()]
        requests = load_trace(args.trace, args.n, args.start)
    except (OSError, ValueError) as exc:
        print(f"python -m bench.trace: {exc}", file=sys.stderr)
        return 2
    if not requests or not counts or min(counts) < 1:
        print(
            "python -m bench.trace: no requests to replay, or an orchestrator count below 1", file=sys.stderr
        )
        return 2
    texts = BlockTexts(args.bytes_per_token)
    prompts = [texts.prompt(r, args.bytes_per_token) for r in requests]
    bodies = [
        json.dumps(
            {
                "model": "synthetic",
                "messages": [{"role": "user", "content": c}],
                "max_tokens": max(1, min(r.output_length, args.max_output_tokens)),
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for r, c in zip(requests, prompts)
    ]
    working = working_set_tokens(requests)
    fleet = max(1, int(working * args.kv_fraction))
    kv_tokens = max(TRACE_BLOCK_TOKENS, fleet // args.context_workers)
    hit, total = oracle(prompts, args.bytes_per_token, kv_tokens * args.context_workers)
    oracle_fraction = hit / max(1, total)
    unbounded = oracle(prompts, args.bytes_per_token, 1 << 40)[0] / max(1, total)
    tiered = oracle(
        prompts, args.bytes_per_token, int(kv_tokens * (1 + args.tier2_factor)) * args.context_workers
    )
    print(
        f"unbounded cache {unbounded:.3f}; pooled oracle of device + tier 2 ({1 + args.tier2_factor:g}x the KV) "
        f"{tiered[0] / max(1, total):.3f}",
        file=sys.stderr,
    )
    span = requests[-1].timestamp_ms / 1000 / args.speedup
    print(
        f"{len(requests)} requests over {span:.0f} s (x{args.speedup:g}), {total:,} prompt ids, working set "
        f"{working:,} tokens; KV {kv_tokens:,} tokens x {args.context_workers} context workers; pooled oracle "
        f"{oracle_fraction:.3f} (512-token blocks: {block_oracle(requests, kv_tokens * args.context_workers):.3f})",
        file=sys.stderr,
    )
    rate = args.prefill_tokens_per_s
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.target_busy and not rate:
            probe = run_one(
                args, "round_robin", 1, requests, bodies, kv_tokens, 0.0, oracle_fraction, Path(tmp)
            )
            rate = round(probe.prefill_computed_tokens / (span * args.context_workers * args.target_busy))
            print(
                f"round_robin computes {probe.prefill_computed_tokens:,} ids over {span:.0f} s: "
                f"--prefill-tokens-per-s {rate:,} for {args.target_busy:.0%} busy",
                file=sys.stderr,
            )
        for count in counts:
            for name in names:
                r = run_one(args, name, count, requests, bodies, kv_tokens, rate, oracle_fraction, Path(tmp))
                results.append(r)
                print(
                    f"{name} x{count}: hit {r.hit_fraction:.3f} (oracle {r.oracle_fraction:.3f}), errors "
                    f"{r.errors}, TTFT p50 {r.ttft_p50_ms} ms",
                    file=sys.stderr,
                )
    print(table(results))
    for r in results:
        for sample in r.error_samples:
            print(f"  {r.routing} x{r.orchestrators} error: {sample}")
    out = args.output or RESULTS_DIR / "trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"kv_tokens": kv_tokens, "prefill_tokens_per_s": rate},
                "results": [asdict(r) for r in results],
            },
            indent=2,
            default=str,
        )
    )
    print(f"\nresults: {out}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        plot(results, png)
        print(f"plot: {png}")
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
