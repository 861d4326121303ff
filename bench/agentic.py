"""``python -m bench.agentic``: agentic conversations whose turns reuse their prefix, under each router.

M concurrent conversations x T turns. A conversation starts with a system
prompt (shared by all: agents share their tool definitions) and a first task,
about ``--first-tokens`` in all; each turn appends the previous answer and a
new user/tool message of ``--turn-tokens``, so the prompt grows to about
``first + T * turn`` tokens (40k by default). A conversation's next turn is
sent when its last answer has streamed in.

Workers: 2 context + 2 generation synthetic workers in text mode
(``--prompt-tokens 0``: ids from the text, 4 bytes each), each with the
modelled prefix cache (``--kv-tokens``) and a prefill cost per uncached id
(``--prefill-ms-per-1k-tokens``): TTFT follows what a worker must compute.

Compared, each on a fresh deployment:

- ``round_robin``: both pools round robin (the baseline);
- ``conversation``: a conversation sticks to one worker per pool (``conversation_id``);
- ``kv_cache_aware``: both pools route by the expected prefix hit, balanced against load;
- ``kv_cache_aware+conditional``: and ``conditional_disagg_config``: a turn whose expected
  uncached remainder on its generation worker is at most ``--max-local-prefill`` ids is
  prefilled there (no context leg, no KV transfer).

Reported per router: TTFT p50/p95, prompt ids computed by all workers, ids served
from their caches, completions/s, the orchestrator's CPU per request; then the
ratios the issue sets (>= 3x fewer prefill ids and >= 2x lower TTFT p50 than
round_robin; orchestrator CPU per request within 10% of round_robin's).

``--tiny``: a short run on the built-in torch model instead (1 context + 1
generation ``tiny`` worker, short conversations): real KV blocks reused end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.deploy import Deployment, cpu_seconds
from bench.loadgen import RESULTS_DIR, new_session, percentile

ROUTINGS: dict[str, dict[str, Any]] = {
    "round_robin": {"router": "round_robin"},
    "conversation": {"router": "conversation"},
    "kv_cache_aware": {"router": "kv_cache_aware"},
    "kv_cache_aware+conditional": {"router": "kv_cache_aware", "conditional": True},
}
_COUNTER = re.compile(rb"^(fastcore_worker_(?:prefill_computed|prefix_cache_hit)_tokens_total) (\S+)$", re.M)
_PATHS = re.compile(rb'^fastcore_orchestrator_requests_by_path_total\{path="([^"]+)"\} (\S+)$', re.M)
_WORDS = (
    "the agent reads the file then calls the tool with the path and the tool returns the lines "
    "of the module where the error was raised so the agent edits the function and runs the tests again"
).split()


def text(rng: random.Random, n_bytes: int) -> str:
    out, size = [], 0
    while size < n_bytes:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_bytes]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_bytes: int
    ttft_s: float | None
    latency_s: float
    ok: bool
    error: str = ""


@dataclass
class RoutingResult:
    routing: str
    turns: int
    errors: int
    duration_s: float
    completions_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    prefill_computed_tokens: int
    prefix_hit_tokens: int
    orchestrator_cpu_us_per_request: float
    paths: dict[str, float] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


async def _stream_turn(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float
) -> tuple[float | None, str]:
    """Send one streaming chat turn; (TTFT, the answer's text)."""
    t0 = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    async with asyncio.timeout(timeout):
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        return ttft, "".join(pieces)
                    message = json.loads(data)
                    if "error" in message:
                        raise RuntimeError(str(message["error"])[:200])
                    for choice in message.get("choices", ()):
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            pieces.append(content)
    raise RuntimeError("the stream ended without [DONE]")


async def run_conversations(
    url: str,
    *,
    conversations: int,
    turns: int,
    first_tokens: int,
    turn_tokens: int,
    max_tokens: int,
    model: str,
    timeout: float,
    seed: int = 0,
) -> tuple[list[Turn], float]:
    """Every conversation's turns, in order, the conversations concurrently; (turns, seconds)."""
    system = text(random.Random(seed), 4 * min(first_tokens // 4, 2000))
    results: list[Turn] = []

    async def conversation(i: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 1000 + i + 1)
        history = [
            {"role": "system", "content": system},
            {"role": "user", "content": text(rng, 4 * first_tokens - len(system))},
        ]
        for t in range(turns):
            body = {
                "model": model, "messages": history, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "conversation_id": f"conversation-{seed}-{i}",
            }  # fmt: skip
            size = len(json.dumps(history))
            start = time.perf_counter()
            try:
                ttft, answer = await _stream_turn(session, url + "/v1/chat/completions", body, timeout)
            except (RuntimeError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                results.append(Turn(i, t, size, None, time.perf_counter() - start, False, str(exc)[:200]))
                return  # a conversation whose turn failed cannot go on
            results.append(Turn(i, t, size, ttft, time.perf_counter() - start, True))
            # the next turn: the answer, then what the agent's tools returned (as a user message:
            # a "tool" message needs the tool call it answers)
            history = [
                *history,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": text(rng, 4 * turn_tokens)},
            ]

    t0 = time.perf_counter()
    async with new_session() as session:
        await asyncio.gather(*(conversation(i, session) for i in range(conversations)))
    return results, time.perf_counter() - t0


def _config(
    routing: dict[str, Any], max_local_prefill: int, load_factor: float | None = None
) -> dict[str, Any]:
    router: dict[str, Any] = {"type": routing["router"]}
    if load_factor is not None and routing["router"] == "conversation":
        router["load_factor"] = load_factor
    config: dict[str, Any] = {"context_servers": {"router": router}, "generation_servers": {"router": router}}
    if routing.get("conditional"):
        config["conditional_disagg_config"] = {"max_local_prefill_length": max_local_prefill}
    return config


async def _scrape(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url + "/metrics") as r:
        return await r.read()


async def _worker_counters(urls: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for page in await asyncio.gather(*(_scrape(session, u) for u in urls)):
            for name, value in _COUNTER.findall(page):
                totals[name.decode()] = totals.get(name.decode(), 0.0) + float(value)
    return totals


def run_routing(name: str, args: argparse.Namespace, tmp: Path) -> RoutingResult:
    path = tmp / f"{name.replace('+', '_')}.json"  # YAML is a superset of JSON
    path.write_text(
        json.dumps(_config(ROUTINGS[name], args.max_local_prefill, args.conversation_load_factor))
    )
    workers = [
        "--prompt-tokens",
        "0",
        "--prefill-ms-per-1k-tokens",
        str(args.prefill_ms_per_1k),
        "--kv-tokens",
        str(args.kv_tokens),
    ]
    dep = Deployment(
        "both-gates", 0, context_workers=2, generation_workers=2, token_latency_ms=args.token_latency_ms,
        worker_args=workers, orchestrator_args=["-c", str(path)],
    )  # fmt: skip
    with dep:
        worker_urls = [f"http://127.0.0.1:{w.port}" for w in dep.workers]
        cpu0 = cpu_seconds(dep.front.proc.pid)  # type: ignore[union-attr]
        turns, seconds = asyncio.run(
            run_conversations(
                dep.url,
                conversations=args.conversations,
                turns=args.turns,
                first_tokens=args.first_tokens,
                turn_tokens=args.turn_tokens,
                max_tokens=args.max_tokens,
                model="synthetic",
                timeout=args.timeout,
            )
        )
        cpu = cpu_seconds(dep.front.proc.pid) - cpu0  # type: ignore[union-attr]
        counters = asyncio.run(_worker_counters(worker_urls))

        async def front() -> bytes:
            async with aiohttp.ClientSession() as s:
                return await _scrape(s, dep.url)

        paths = {k.decode(): float(v) for k, v in _PATHS.findall(asyncio.run(front()))}
    ok = [t for t in turns if t.ok]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    p50, p95 = percentile(ttfts, 50), percentile(ttfts, 95)
    return RoutingResult(
        routing=name,
        turns=len(turns),
        errors=len(turns) - len(ok),
        duration_s=round(seconds, 2),
        completions_per_s=round(len(ok) / seconds, 2) if seconds else 0.0,
        ttft_p50_ms=None if p50 is None else round(p50 * 1000, 1),
        ttft_p95_ms=None if p95 is None else round(p95 * 1000, 1),
        prefill_computed_tokens=int(counters.get("fastcore_worker_prefill_computed_tokens_total", 0)),
        prefix_hit_tokens=int(counters.get("fastcore_worker_prefix_cache_hit_tokens_total", 0)),
        orchestrator_cpu_us_per_request=round(cpu / max(1, len(turns)) * 1e6, 1),
        paths=paths,
        error_samples=sorted({t.error for t in turns if not t.ok})[:3],
    )


def table(results: list[RoutingResult]) -> str:
    lines = [
        "| routing | turns | errors | TTFT p50 ms | TTFT p95 ms | prefill ids computed | ids from cache | "
        "compl/s | orchestrator CPU µs/req | paths |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        paths = ", ".join(f"{k} {int(v)}" for k, v in sorted(r.paths.items())) or "-"
        lines.append(
            f"| {r.routing} | {r.turns} | {r.errors} | {r.ttft_p50_ms} | {r.ttft_p95_ms} | "
            f"{r.prefill_computed_tokens:,} | {r.prefix_hit_tokens:,} | {r.completions_per_s} | "
            f"{r.orchestrator_cpu_us_per_request} | {paths} |"
        )
    return "\n".join(lines)


def ratios(results: list[RoutingResult]) -> tuple[str, bool]:
    """The issue's targets against round_robin, and whether the best cache-aware routing meets them."""
    by = {r.routing: r for r in results}
    base = by.get("round_robin")
    if base is None:
        return "", True
    lines, ok = (
        ["", "against round_robin (targets: >= 3x fewer prefill ids, >= 2x lower TTFT p50, CPU within 10%):"],
        True,
    )
    for r in results:
        if r is base:
            continue
        fewer = base.prefill_computed_tokens / max(1, r.prefill_computed_tokens)
        lower = (base.ttft_p50_ms or 0) / max(1e-9, r.ttft_p50_ms or 0) if r.ttft_p50_ms else 0.0
        cpu = r.orchestrator_cpu_us_per_request / max(1e-9, base.orchestrator_cpu_us_per_request)
        met = fewer >= 3 and lower >= 2 and cpu <= 1.10 and r.errors == 0
        lines.append(
            f"- {r.routing}: {fewer:.1f}x fewer prefill ids, TTFT p50 {lower:.1f}x lower, "
            f"orchestrator CPU/request {cpu:.2f}x {'(meets all three)' if met else ''}"
        )
        if r.routing.startswith("kv_cache_aware"):
            ok = ok and r.errors == 0
    return "\n".join(lines), ok


def tiny(args: argparse.Namespace) -> int:
    """A short real run: the tiny torch model, kv_cache_aware routing, a few turns."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny.json"
        path.write_text(json.dumps(_config(ROUTINGS["kv_cache_aware"], 0)))
        dep = Deployment("both-gates", 0, orchestrator_args=["-c", str(path)])
        dep.worker_child = _tiny_worker_child(dep)  # type: ignore[method-assign]
        with dep:
            worker_urls = [f"http://127.0.0.1:{w.port}" for w in dep.workers]
            turns, seconds = asyncio.run(
                run_conversations(
                    # the tiny model's byte tokenizer: 4 "tokens" of text here are 4 ids there (2,048 at most)
                    dep.url,
                    conversations=2,
                    turns=4,
                    first_tokens=100,
                    turn_tokens=25,
                    max_tokens=8,
                    model="tiny",
                    timeout=120.0,
                )
            )
            counters = asyncio.run(_worker_counters(worker_urls))
    hits = counters.get("fastcore_worker_prefix_cache_hit_tokens_total", 0)
    computed = counters.get("fastcore_worker_prefill_computed_tokens_total", 0)
    ok = all(t.ok for t in turns)
    for sample in sorted({t.error for t in turns if not t.ok})[:3]:
        print("  error:", sample)
    print(
        f"tiny model: {len(turns)} turns in {seconds:.1f} s, errors {sum(not t.ok for t in turns)}; "
        f"prompt ids computed {int(computed):,}, served from the workers' KV caches {int(hits):,}"
    )
    return 0 if ok and hits > 0 else 1


def _tiny_worker_child(dep: Deployment) -> Any:
    from bench.deploy import PYTHON, cores, pinned
    from server.launcher import Child

    def child(role: str, port: int, index: int) -> Child:
        _, other = cores()
        argv = [
            *PYTHON,
            "server.cli",
            "worker",
            "--model",
            "tiny",
            "--role",
            role,
            "--port",
            str(port),
            "--torch-threads",
            "1",
        ]
        return Child(f"{role} worker {index}", pinned(argv, other), port)

    return child


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--turns", type=int, default=20, help="turns per conversation (default 20)")
    p.add_argument(
        "--first-tokens", type=int, default=10_000, help="the first turn's prompt (default 10,000)"
    )
    p.add_argument("--turn-tokens", type=int, default=1_500, help="added per turn (default 1,500)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length (default 32)")
    p.add_argument(
        "--prefill-ms-per-1k-tokens",
        dest="prefill_ms_per_1k",
        type=float,
        default=4.0,
        help="workers' prefill cost per 1,000 uncached ids (default 4)",
    )
    p.add_argument("--token-latency-ms", type=float, default=2.0, help="workers' time per token (default 2)")
    p.add_argument("--kv-tokens", type=int, default=250_000, help="each worker's cache (default 250,000 ids)")
    p.add_argument(
        "--max-local-prefill",
        type=int,
        default=4096,
        help="conditional_disagg_config.max_local_prefill_length (default 4096)",
    )
    p.add_argument(
        "--conversation-load-factor",
        type=float,
        default=None,
        help="the conversation router's load_factor (default its own: 1.25; 0: a conversation never "
        "leaves its worker)",
    )
    p.add_argument("--routings", default=",".join(ROUTINGS), help="which to run (default all)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="4 conversations x 6 turns, smaller prompts")
    p.add_argument("--tiny", action="store_true", help="a short run on the tiny torch model instead")
    p.add_argument("--output", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        return tiny(args)
    if args.quick:
        args.conversations, args.turns, args.first_tokens, args.turn_tokens = 4, 6, 4000, 1000
    names = [n.strip() for n in args.routings.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROUTINGS))
    if unknown:
        print(
            f"python -m bench.agentic: unknown routing {', '.join(unknown)}; choose from {', '.join(ROUTINGS)}",
            file=sys.stderr,
        )
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results.append(run_routing(name, args, Path(tmp)))
            print(f"{name}: done ({results[-1].turns} turns, {results[-1].errors} errors)", file=sys.stderr)
    print(table(results))
    summary, ok = ratios(results)
    print(summary)
    for r in results:
        for sample in r.error_samples:
            print(f"  {r.routing} error: {sample}")
    out = args.output or RESULTS_DIR / "agentic.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": vars(args) | {"output": str(out)}, "results": [asdict(r) for r in results]},
            indent=2,
            default=str,
        )
    )
    print(f"\nresults: {out}")
    return 0 if ok and all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
