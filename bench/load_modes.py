"""``python -m bench.load --compare`` and ``--chaos``: the load generator against deployments it starts.

--compare: for each orchestrator mode and the pass-through floor, a fresh
deployment of zero-latency synthetic workers (``bench/deploy.py``), the same
concurrency levels, one table and one plot with a line per mode.

--chaos: one deployment (both gates, two generation workers); while a
closed loop runs, a generation worker is killed (SIGKILL) every few seconds
and restarted a second later. Reports requests, failures (the streams that
were cut), requests that hung past the timeout (must be 0), and the
orchestrator's RSS over the run (must stay flat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time

from bench.deploy import FRONTS, Deployment
from bench.loadgen import RESULTS_DIR, LevelResult, parse_levels, plot, run_concurrency, table, write_json
from bench.workload import chat_body


def compare(args: argparse.Namespace) -> int:
    levels_c = [16, 64] if args.quick else parse_levels(args.concurrency)
    body = chat_body(args.prompt_tokens, model="synthetic", max_tokens=args.max_tokens)
    results: list[LevelResult] = []
    for front in FRONTS:
        with Deployment(front, args.prompt_tokens) as dep:
            url = dep.url + "/v1/chat/completions"
            asyncio.run(
                run_concurrency(
                    url,
                    body,
                    4,
                    max_requests=16,
                    max_seconds=30,
                    timeout=args.timeout,
                    label=f"{front} warm-up",
                )
            )
            for c in levels_c:
                n = args.requests or max(200, 2 * c)
                results.append(
                    asyncio.run(
                        run_concurrency(
                            url,
                            body,
                            c,
                            max_requests=n,
                            max_seconds=args.duration,
                            timeout=args.timeout,
                            label=f"{front} c={c}",
                        )
                    )
                )
    print(table(results))
    print(summary(results))
    out = args.output or RESULTS_DIR / "load_compare.json"
    write_json(
        results, out, {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "fronts": FRONTS}
    )
    png = args.plot or RESULTS_DIR / "load_compare.png"
    plot(
        results, png, f"orchestrator modes vs floor, {args.prompt_tokens:,}-token prompts, synthetic workers"
    )
    print(f"\nresults: {out}\nplot: {png}")
    return 1 if any(lv.errors for lv in results if lv.label.startswith("both-gates")) else 0


def summary(results: list[LevelResult]) -> str:
    """The issue's ratios: throughput and TTFT of both gates against the parsed baseline."""
    by = {lv.label: lv for lv in results}
    base = [lv for lv in results if lv.label.startswith("parsed ")]
    if not base:
        return ""
    best_base = max(base, key=lambda lv: lv.completions_per_s)
    best_fast = max(
        (lv for lv in results if lv.label.startswith("both-gates ")), key=lambda lv: lv.completions_per_s
    )
    # The baseline's saturating concurrency: the lowest level within 5% of its best throughput.
    saturating = min(
        (lv for lv in base if lv.completions_per_s >= 0.95 * best_base.completions_per_s),
        key=lambda lv: lv.concurrency or 0,
    )
    fast_there = by.get(f"both-gates c={saturating.concurrency}")
    lines = [
        "",
        f"max completions/s: both-gates {best_fast.completions_per_s} vs parsed {best_base.completions_per_s}"
        f" = {best_fast.completions_per_s / best_base.completions_per_s:.2f}x",
    ]
    if fast_there and fast_there.ttft_p50_ms and saturating.ttft_p50_ms:
        lines.append(
            f"TTFT p50 at the baseline's saturating concurrency ({saturating.concurrency}): "
            f"parsed {saturating.ttft_p50_ms} ms vs both-gates {fast_there.ttft_p50_ms} ms"
            f" = {saturating.ttft_p50_ms / fast_there.ttft_p50_ms:.2f}x lower"
        )
    return "\n".join(lines)


async def _chaos_run(args: argparse.Namespace, dep: Deployment) -> dict:
    body = chat_body(args.prompt_tokens, model="synthetic", max_tokens=args.max_tokens)
    url = dep.url + "/v1/chat/completions"
    duration = 15.0 if args.quick else args.duration
    gen_workers = [w for w in dep.workers if w.name.startswith("generation")]
    rng = random.Random(0)
    rss: list[tuple[float, int]] = []
    kills = 0
    stop = asyncio.Event()

    async def chaos() -> None:
        nonlocal kills
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), args.chaos_interval)
                return
            except TimeoutError:
                pass
            victim = rng.choice(gen_workers)
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            kills += 1
            await asyncio.sleep(1.0)
            dep.restart(victim)

    async def sample_rss() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            rss.append((round(time.monotonic() - t0, 1), dep.front_rss_bytes()))
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    tasks = [asyncio.create_task(chaos()), asyncio.create_task(sample_rss())]
    level = await run_concurrency(
        url,
        body,
        args.chaos_concurrency,
        max_requests=10**9,
        max_seconds=duration,
        timeout=args.timeout,
        label="chaos",
    )
    stop.set()
    await asyncio.gather(*tasks)
    return {"level": level, "kills": kills, "rss": rss}


def chaos(args: argparse.Namespace) -> int:
    with Deployment("both-gates", args.prompt_tokens, generation_workers=2) as dep:
        out = asyncio.run(_chaos_run(args, dep))
    level: LevelResult = out["level"]
    rss = out["rss"]
    # Flat memory: compare the second half's peak with the first half's (warm-up allocations excluded).
    half = len(rss) // 2
    first = max(r for _, r in rss[:half]) if half else 0
    second = max(r for _, r in rss[half:]) if rss else 0
    growth = (second - first) / first if first else 0.0
    print(table([level]))
    print(f"\ngeneration workers killed: {out['kills']}")
    print(
        f"requests: {level.requests}, failed: {level.errors} ({level.errors / max(1, level.requests):.1%}), "
        f"hung past the {args.timeout:.0f} s timeout: {level.timeouts}"
    )
    print(
        f"orchestrator RSS: first half peak {first / 2**20:.1f} MiB, second half peak {second / 2**20:.1f} MiB "
        f"({growth:+.1%})"
    )
    for sample in level.error_samples:
        print("  error sample:", sample[:160])
    path = args.output or RESULTS_DIR / "chaos.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kills": out["kills"], "rss": rss, "level": level.__dict__}, indent=2))
    ok = level.timeouts == 0 and growth < 0.25 and level.requests > level.errors
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    if args.chaos:
        return chaos(args)
    return compare(args)


__all__ = ["chaos", "compare", "main"]
