"""Who goes first under overload: tenants, fair share, priorities and 429s (issue 23).

    python -m bench.admission            # 20 s a phase, plus the live CPU comparison
    python -m bench.admission --quick    # 3 s a phase, no live CPU run (the smoke test's)

Synthetic workers (``--model synthetic``, 20 ms a token) behind one orchestrator with client API
keys and ``admission: {max_inflight: 8}``: tenant ``big`` runs 24 closed-loop streams (2 of them
sending ``priority: -10``), tenant ``small`` 6, equal weights: 30 streams on 8 slots. Fairness
shows only while both tenants are backlogged: with 12 or more slots the small tenant's fair share
is at least its 6 streams, and any fair scheduler gives it what it asks, less the time its clients
take between requests (34% measured at 12 slots, 38% at 10, on this shared 2-core machine where the
load generator's own latency is that time); at 8 it always has requests waiting.

- ``fair`` phase (``max_queue`` 1024, ``max_queue_wait_s`` 30): completions per tenant and their
  share, TTFT p50/p99 by tenant and priority;
- ``overload`` phase (``max_queue`` 8, ``max_queue_wait_s`` 0.3, clients retrying 50 ms after a
  429): answers by status, whether every 429 carried ``Retry-After``, the longest answer of each
  status against ``max_queue_wait_s`` plus an unqueued request;
- the cost of the auth + admission path per request: in process (best of N, the key lookup, the
  priority read and a slot's enter/exit), and (full run) live, the orchestrator's CPU per request
  from the kernel with neither, and with both configured (no request waits), as bench.orchestrator
  measures it.

Results: a table on stdout, ``bench/results/admission.json`` and ``admission.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench._timing import format_table
from bench.deploy import Deployment
from bench.loadgen import RESULTS_DIR, percentile
from bench.workload import chat_body

PROMPT_TOKENS = 500
MAX_TOKENS = 10
TOKEN_LATENCY_MS = 20.0
MAX_INFLIGHT = 8
KEYS = {"big": "bench-key-big-0001", "small": "bench-key-small-0001"}
#: (tenant, priority, streams)
STREAMS = [("big", 0, 22), ("big", -10, 2), ("small", 0, 6)]
RETRY_PAUSE_S = 0.05


@dataclass
class Answer:
    tenant: str
    priority: int
    status: int
    ttft: float | None
    latency: float
    retry_after: str | None


@dataclass
class Phase:
    name: str
    max_queue: int
    max_queue_wait_s: float
    seconds: float
    answers: list[Answer] = field(default_factory=list)


async def one(session: aiohttp.ClientSession, url: str, tenant: str, priority: int, body: bytes) -> Answer:
    t0 = time.perf_counter()
    ttft = None
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            return Answer(
                tenant, priority, resp.status, None, time.perf_counter() - t0, resp.headers.get("Retry-After")
            )
        async for chunk in resp.content.iter_any():
            if ttft is None and b"data:" in chunk:
                ttft = time.perf_counter() - t0
        return Answer(tenant, priority, 200, ttft, time.perf_counter() - t0, None)


async def drive(url: str, phase: Phase, warmup_s: float) -> None:
    url += "/v1/chat/completions"
    bodies = {
        p: chat_body(PROMPT_TOKENS, model="synthetic", max_tokens=MAX_TOKENS)[:-1] + b', "priority": %d}' % p
        for p in {p for _, p, _ in STREAMS}
    }
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + phase.seconds

    async def loop(session: aiohttp.ClientSession, tenant: str, priority: int) -> None:
        while time.perf_counter() < stop_at:
            sent = time.perf_counter()
            try:
                answer = await one(session, url, tenant, priority, bodies[priority])
            except (aiohttp.ClientError, ConnectionError) as exc:
                answer = Answer(tenant, priority, 0, None, time.perf_counter() - sent, str(exc)[:80])
            if sent >= measure_from and time.perf_counter() <= stop_at:
                phase.answers.append(answer)
            if answer.status != 200:
                await asyncio.sleep(RETRY_PAUSE_S)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        await asyncio.gather(*(loop(session, t, p) for t, p, n in STREAMS for _ in range(n)))


def config_file(directory: Path, phase: Phase | None, max_inflight: int) -> list[str]:
    keys = directory / "keys"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    # client_priority: the operator grants the body's priority (else every request counts as 0)
    config = {
        "api_keys_file": str(keys),
        "admission": {"max_inflight": max_inflight, "client_priority": True},
    }
    if phase is not None:
        config["admission"].update(max_queue=phase.max_queue, max_queue_wait_s=phase.max_queue_wait_s)  # type: ignore[attr-defined]
    path = directory / "orchestrator.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return ["-c", str(path)]


def run_phase(phase: Phase, warmup_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        args = config_file(Path(tmp), phase, MAX_INFLIGHT)
        dep = Deployment(
            "gates-off", PROMPT_TOKENS, token_latency_ms=TOKEN_LATENCY_MS, orchestrator_args=args
        )
        with dep:
            asyncio.run(drive(dep.url, phase, warmup_s))


def _ms(values: list[float], q: float) -> str:
    v = percentile(values, q)
    return "-" if v is None else f"{v * 1000:.0f}"


def summarize(phase: Phase) -> dict[str, Any]:
    rows = []
    ok = [a for a in phase.answers if a.status == 200]
    total_ok = max(1, len(ok))
    groups: dict[tuple[str, int], list[Answer]] = defaultdict(list)
    for a in phase.answers:
        groups[(a.tenant, a.priority)].append(a)
    by_tenant = {t: sum(1 for a in ok if a.tenant == t) for t in KEYS}
    for (tenant, priority), answers in sorted(groups.items()):
        ttft = [a.ttft for a in answers if a.status == 200 and a.ttft is not None]
        rows.append(
            {
                "tenant": tenant,
                "priority": priority,
                "streams": next(n for t, p, n in STREAMS if t == tenant and p == priority),
                "completions": sum(1 for a in answers if a.status == 200),
                "share_of_tenant_pct": round(100 * by_tenant[tenant] / total_ok, 1),
                "ttft_p50_ms": _ms(ttft, 50),
                "ttft_p99_ms": _ms(ttft, 99),
                "429": sum(1 for a in answers if a.status == 429),
                "other": sum(1 for a in answers if a.status not in (200, 429)),
            }
        )
    statuses: dict[str, int] = defaultdict(int)
    for a in phase.answers:
        statuses[str(a.status)] += 1
    rejected = [a for a in phase.answers if a.status == 429]
    big_normal = [a.ttft for a in ok if a.tenant == "big" and a.priority == 0 and a.ttft]
    big_high = [a.ttft for a in ok if a.tenant == "big" and a.priority < 0 and a.ttft]
    high_p50, normal_p50 = percentile(big_high, 50), percentile(big_normal, 50)
    return {
        "phase": phase.name,
        "max_queue": phase.max_queue,
        "max_queue_wait_s": phase.max_queue_wait_s,
        "seconds": phase.seconds,
        "rows": rows,
        "statuses": dict(statuses),
        "small_share_pct": round(100 * by_tenant["small"] / total_ok, 1),
        "high_over_normal_ttft_p50": round(high_p50 / normal_p50, 3) if high_p50 and normal_p50 else None,
        "every_429_has_retry_after": all(a.retry_after for a in rejected),
        "longest_429_ms": round(max((a.latency for a in rejected), default=0) * 1000, 1),
        "longest_200_ms": round(max((a.latency for a in ok), default=0) * 1000, 1),
    }


# -- the path's cost ---------------------------------------------------------------------------------


def micro() -> dict[str, float]:
    """Per-request cost in process of the key lookup, the priority read, and a slot taken and given
    back when one is free; best of 7 runs of 20,000."""
    from server.metrics import Registry
    from server.orchestrator.admission import Admission, read_priority
    from server.orchestrator.config import AdmissionConfig
    from server.orchestrator.tenants import ApiKeys

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys"
        path.write_text("".join(f"key-{i:04d}-abcdefghijklmnop tenant{i % 8}\n" for i in range(1000)))
        keys = ApiKeys(str(path), None)
    admission = Admission(AdmissionConfig(max_inflight=1 << 30), Registry(), 1)
    body = chat_body(PROMPT_TOKENS, model="synthetic", max_tokens=MAX_TOKENS)
    auth = b"Bearer key-0500-abcdefghijklmnop"
    n = 20_000

    async def empty() -> None:
        for _ in range(n):
            pass

    async def lookup() -> None:
        for _ in range(n):
            keys.tenant(auth)

    async def priority() -> None:
        for _ in range(n):
            read_priority(body)

    async def whole() -> None:
        for _ in range(n):
            tenant = keys.tenant(auth)
            assert tenant is not None
            async with admission.slot(tenant, body):
                pass

    def best(fn: Any) -> float:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            asyncio.run(fn())
            times.append(time.perf_counter() - t0)
        return min(times) / n

    base = best(empty)
    return {
        "key_lookup_us": round((best(lookup) - base) * 1e6, 3),
        "priority_read_us": round((best(priority) - base) * 1e6, 3),
        "auth_and_admission_us": round((best(whole) - base) * 1e6, 3),
        "body_bytes": len(body),
    }


def live_cpu(requests: int) -> dict[str, float]:
    """The orchestrator's CPU per request (kernel accounting), neither vs keys + admission (no waits)."""

    out = {}
    body = chat_body(PROMPT_TOKENS, model="synthetic", max_tokens=MAX_TOKENS)
    for label in ("neither", "both", "neither again", "both again"):
        with tempfile.TemporaryDirectory() as tmp:
            # both: the key file and an admission section whose slots never run out (no request waits)
            args = config_file(Path(tmp), None, 1 << 20) if label.startswith("both") else []
            dep = Deployment("gates-off", PROMPT_TOKENS, orchestrator_args=args)
            with dep:
                url = dep.url + "/v1/chat/completions"
                cpu0 = dep.front_cpu_seconds()
                done = asyncio.run(_closed_loop(url, body, requests, 16, auth=bool(args)))
                out[label] = round(1e3 * (dep.front_cpu_seconds() - cpu0) / max(1, done), 4)
    return out


async def _closed_loop(url: str, body: bytes, requests: int, concurrency: int, *, auth: bool) -> int:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {KEYS['small']}"
    left = requests
    done = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left, done
        while left > 0:
            left -= 1
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return done


# -- report ------------------------------------------------------------------------------------------


def report(results: list[dict[str, Any]]) -> str:
    out = []
    for r in results:
        out.append(
            f"\n### {r['phase']}: max_inflight {MAX_INFLIGHT}, max_queue {r['max_queue']}, "
            f"max_queue_wait_s {r['max_queue_wait_s']:g}, {r['seconds']:g} s\n"
        )
        out.append(
            format_table(
                [
                    "tenant",
                    "priority",
                    "streams",
                    "completions",
                    "tenant share %",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "429",
                    "other",
                ],
                [
                    [
                        row["tenant"],
                        row["priority"],
                        row["streams"],
                        row["completions"],
                        row["share_of_tenant_pct"],
                        row["ttft_p50_ms"],
                        row["ttft_p99_ms"],
                        row["429"],
                        row["other"],
                    ]
                    for row in r["rows"]
                ],
            )
        )
        out.append(
            f"\nsmall's share of completions: {r['small_share_pct']}% (target >= 45%); high-priority TTFT p50 / "
            f"normal (big): {r['high_over_normal_ttft_p50']} (target <= 0.25); answers by status: {r['statuses']}; "
            f"every 429 with Retry-After: {r['every_429_has_retry_after']}; longest 429 {r['longest_429_ms']} ms, "
            f"longest 200 {r['longest_200_ms']} ms"
        )
    return "\n".join(out)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        labels = [f"{row['tenant']}\nprio {row['priority']}\n{row['streams']} streams" for row in r["rows"]]
        ok = [row["completions"] for row in r["rows"]]
        rejected = [row["429"] for row in r["rows"]]
        xs = range(len(labels))
        ax.bar(xs, ok, label="200")
        ax.bar(xs, rejected, bottom=ok, label="429")
        for x, row in zip(xs, r["rows"]):
            ax.annotate(f"TTFT p50 {row['ttft_p50_ms']} ms", (x, ok[x]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_title(f"{r['phase']}: small's share {r['small_share_pct']}%")
        ax.set_ylabel("answers")
        ax.legend()
    fig.suptitle(f"admission: {MAX_INFLIGHT} slots, 30 closed-loop streams, equal weights")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 s a phase, no live CPU run")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds a phase")
    p.add_argument(
        "--cpu-requests", type=int, default=2000, help="requests per live CPU measurement (0: none)"
    )
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "admission.json")
    args = p.parse_args(argv)
    seconds = 3.0 if args.quick else args.seconds
    warmup = 0.5 if args.quick else 2.0
    phases = [Phase("fair", 1024, 30.0, seconds), Phase("overload", 8, 0.3, seconds)]
    results = []
    for phase in phases:
        run_phase(phase, warmup)
        results.append(summarize(phase))
    costs = micro()
    cpu = live_cpu(args.cpu_requests) if args.cpu_requests and not args.quick else {}
    print(report(results))
    print("\n### the auth + admission path, in process (best of 7 x 20,000)\n")
    print(
        format_table(
            ["key lookup us", "priority read us", "key + priority + slot us", "body bytes"],
            [
                [
                    costs["key_lookup_us"],
                    costs["priority_read_us"],
                    costs["auth_and_admission_us"],
                    costs["body_bytes"],
                ]
            ],
        )
    )
    if cpu:
        print("\n### the orchestrator's CPU ms per request, live (kernel accounting)\n")
        print(format_table(list(cpu), [list(cpu.values())]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "phases": results,
                "micro": costs,
                "live_cpu_ms": cpu,
                "streams": STREAMS,
                "max_inflight": MAX_INFLIGHT,
            },
            indent=1,
        )
    )
    plot(results, args.output.with_suffix(".png"))
    print(f"\nwrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
