"""``python -m bench.load --cluster``: the chaos run with discovery (etcd), several orchestrators in front.

A real etcd (server.cluster.local_etcd), 2 orchestrators that find their
workers through it, 2 context + 2 generation synthetic workers that register
under leases. A closed loop of streaming chat requests goes to both
orchestrators (client i to orchestrator i mod 2: what a load balancer does)
while, in turn:

- a generation worker is SIGKILLed: the time until no orchestrator routes to
  it any more (a refused connection, a health check or its lease's expiry,
  whichever is first: "time to reroute"), then it is restarted and the time
  until every orchestrator routes to it again ("time to rejoin");
- a generation worker is frozen (SIGSTOP: its sockets stay open, nothing
  answers), so only a health-check timeout or its lease's expiry takes it out;
  then SIGCONT (it registers again: its lease has expired);
- etcd is SIGKILLed and restarted 2 s later: no request may fail for it (the
  orchestrators keep their last known workers, then resync).

Reported: requests, failures by cause (a stream cut on the killed worker; any
other failure is a defect), requests hung past the timeout (must be 0), each
event's times, and the requests each worker served (the load spreads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench.deploy import Deployment, free_port
from bench.loadgen import RESULTS_DIR, RequestResult, new_session, one_request, summarize, table
from bench.workload import chat_body
from server.cluster.local_etcd import LocalEtcd

_HEALTHY = re.compile(rb'^fastcore_orchestrator_worker_healthy\{pool="(\w+)",url="([^"]+)"\} 1\.0$', re.M)
_CONNECTED = re.compile(rb"^fastcore_orchestrator_cluster_connected (\S+)$", re.M)
_SERVED = re.compile(rb'^fastcore_worker_requests_total\{route="[^"]*",status="200"\} (\S+)$', re.M)


@dataclass
class Timed:
    start: float
    end: float
    result: RequestResult
    orchestrator: int


@dataclass
class Event:
    kind: str  # "worker" (SIGKILL), "freeze" (SIGSTOP) or "etcd"
    target: str
    at: float
    #: worker: seconds until no orchestrator routes to it; etcd: seconds until both resynced
    gone_s: float | None = None
    #: worker: seconds from its restart until every orchestrator routes to it again
    back_s: float | None = None
    #: when this event's window closes (failures inside it are attributed to it)
    until: float = 0.0
    failures: int = 0


@dataclass
class ClusterRun:
    requests: int = 0
    failures: int = 0
    timeouts: int = 0
    failures_unexplained: int = 0
    failures_during_etcd_outage: int = 0
    events: list[Event] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    level: Any = None
    error_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.timeouts == 0
            and self.failures_unexplained == 0
            and self.failures_during_etcd_outage == 0
            and self.requests > self.failures
            and all(e.gone_s is not None and (e.kind == "etcd" or e.back_s is not None) for e in self.events)
        )


async def _metrics(session: aiohttp.ClientSession, url: str) -> bytes:
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return await r.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return b""


async def routed(session: aiohttp.ClientSession, fronts: list[str], pool: str) -> list[set[str]]:
    """Per orchestrator: the URLs of ``pool`` it routes to now (healthy)."""
    pages = await asyncio.gather(*(_metrics(session, u) for u in fronts))
    return [{m[2].decode() for m in _HEALTHY.finditer(p) if m[1].decode() == pool} for p in pages]


async def _wait(condition: Any, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await condition():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    return None


async def run(
    *,
    duration_s: float = 30.0,
    concurrency: int = 32,
    prompt_tokens: int = 4096,
    max_tokens: int = 16,
    token_latency_ms: float = 5.0,
    interval_s: float = 4.0,
    timeout_s: float = 30.0,
    heartbeat_s: float = 0.5,
    inactive_timeout_s: float = 2.0,
    seed: int = 0,
) -> ClusterRun:
    """One chaos run on a deployment it starts and stops (etcd included)."""
    etcd = LocalEtcd(free_port(), free_port()).start()
    dep = Deployment(
        "both-gates", prompt_tokens, context_workers=2, generation_workers=2, token_latency_ms=token_latency_ms,
        cluster_uri=etcd.uri, heartbeat_s=heartbeat_s, inactive_timeout_s=inactive_timeout_s, orchestrators=2,
    )  # fmt: skip
    try:
        dep.start()
        return await _run(
            dep,
            etcd,
            duration_s,
            concurrency,
            prompt_tokens,
            max_tokens,
            interval_s,
            timeout_s,
            inactive_timeout_s,
            seed,
        )
    finally:
        dep.stop()
        etcd.stop()


async def _run(
    dep: Deployment,
    etcd: LocalEtcd,
    duration_s: float,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    interval_s: float,
    timeout_s: float,
    inactive_timeout_s: float,
    seed: int,
) -> ClusterRun:
    body = chat_body(prompt_tokens, model="synthetic", max_tokens=max_tokens)
    fronts = dep.urls
    gens = [w for w in dep.workers if w.name.startswith("generation")]
    gen_urls = {f"http://127.0.0.1:{w.port}" for w in gens}
    rng = random.Random(seed)
    done: list[Timed] = []
    events: list[Event] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    async with new_session() as load, aiohttp.ClientSession() as probe:
        ready = await _wait(lambda: _all_route(probe, fronts, gen_urls), 30.0)
        if ready is None:
            raise RuntimeError("the orchestrators did not discover both generation workers within 30 s")

        async def client(i: int) -> None:
            url = fronts[i % len(fronts)] + "/v1/chat/completions"
            while not stop.is_set():
                start = time.monotonic()
                r = await one_request(load, url, body, timeout_s)
                done.append(Timed(start, time.monotonic(), r, i % len(fronts)))

        async def chaos() -> None:
            step = 0
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                    return
                except TimeoutError:
                    pass
                step += 1
                if step % 3 == 2:  # every third event, from the second: etcd goes down
                    events.append(await _etcd_outage(etcd, probe, fronts))
                else:  # a crash, then a freeze (its lease expires), in turn
                    victim = rng.choice(gens)
                    freeze = step % 3 == 0
                    events.append(
                        await _kill_worker(dep, victim, probe, fronts, inactive_timeout_s, freeze=freeze)
                    )

        tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
        chaos_task = asyncio.create_task(chaos())
        await asyncio.sleep(duration_s)
        stop.set()
        await chaos_task
        await asyncio.gather(*tasks)
        pages = await asyncio.gather(*(_metrics(probe, f"http://127.0.0.1:{w.port}") for w in dep.workers))
    elapsed = time.monotonic() - t0
    out = ClusterRun(events=events)
    out.served = {
        w.name: sum(int(float(m[1])) for m in _SERVED.finditer(p)) for w, p in zip(dep.workers, pages)
    }
    out.requests = len(done)
    for t in done:
        if t.result.ok:
            continue
        out.failures += 1
        out.timeouts += t.result.timed_out
        owner = next((e for e in events if e.at <= t.end <= e.until), None)
        if owner is None:
            out.failures_unexplained += 1
            out.error_samples.append(f"{t.end - t0:.2f}s: {t.result.error}")
        elif owner.kind == "etcd":
            out.failures_during_etcd_outage += 1
            out.error_samples.append(f"during etcd outage: {t.result.error}")
        else:
            owner.failures += 1
    out.level = summarize("cluster chaos", [t.result for t in done], elapsed, concurrency=concurrency)
    out.error_samples = out.error_samples[:10]
    return out


async def _all_route(probe: aiohttp.ClientSession, fronts: list[str], urls: set[str]) -> bool:
    return all(urls <= seen for seen in await routed(probe, fronts, "generation"))


async def _kill_worker(
    dep: Deployment,
    victim: Any,
    probe: aiohttp.ClientSession,
    fronts: list[str],
    inactive_timeout_s: float,
    *,
    freeze: bool = False,
) -> Event:
    """SIGKILL ``victim``, then restart it; or, with ``freeze``, SIGSTOP it (its sockets stay open,
    nothing answers: its lease expires, health checks time out), then SIGCONT it."""
    url = f"http://127.0.0.1:{victim.port}"
    assert victim.proc is not None
    at = time.monotonic()
    victim.proc.send_signal(signal.SIGSTOP if freeze else signal.SIGKILL)
    if not freeze:
        victim.proc.wait()
    event = Event("freeze" if freeze else "worker", victim.name, at)

    async def gone() -> bool:
        return all(url not in seen for seen in await routed(probe, fronts, "generation"))

    event.gone_s = await _wait(gone, inactive_timeout_s + 10.0)
    await asyncio.sleep(0.5)
    if freeze:
        victim.proc.send_signal(signal.SIGCONT)
    else:
        dep.restart(victim)

    async def back() -> bool:
        return all(url in seen for seen in await routed(probe, fronts, "generation"))

    event.back_s = await _wait(back, 60.0)
    # A stream cut by the kill ends (fails) at once; the window runs until the worker is
    # out of every pool (a request routed there meanwhile fails over or fails fast).
    event.until = at + (event.gone_s or 0.0) + 0.5
    return event


async def _etcd_outage(etcd: LocalEtcd, probe: aiohttp.ClientSession, fronts: list[str]) -> Event:
    at = time.monotonic()
    await asyncio.to_thread(etcd.kill)
    event = Event("etcd", "etcd", at)
    await asyncio.sleep(2.0)
    await asyncio.to_thread(etcd.start)

    async def resynced() -> bool:
        pages = await asyncio.gather(*(_metrics(probe, u) for u in fronts))
        return all((m := _CONNECTED.search(p)) is not None and float(m[1]) == 1.0 for p in pages)

    event.gone_s = await _wait(resynced, 30.0)
    if event.gone_s is not None:
        event.gone_s += 2.0
    event.until = time.monotonic() + 1.0
    return event


def report(out: ClusterRun) -> str:
    lines = [table([out.level]), ""]
    lines.append("| event | target | time to reroute (s) | time to rejoin (s) | failures it caused |")
    lines.append("|---|---|---:|---:|---:|")
    for e in out.events:
        gone = "-" if e.gone_s is None else f"{e.gone_s:.2f}"
        back = "-" if e.back_s is None else f"{e.back_s:.2f}"
        label = {
            "worker": "SIGKILL, then restart",
            "freeze": "SIGSTOP, then SIGCONT",
            "etcd": "etcd SIGKILL, restart after 2 s (resync time)",
        }[e.kind]
        lines.append(f"| {label} | {e.target} | {gone} | {back} | {e.failures} |")
    lines.append("")
    lines.append(
        f"requests {out.requests}, failed {out.failures} (streams cut on killed workers "
        f"{sum(e.failures for e in out.events if e.kind != 'etcd')}, during the etcd outage "
        f"{out.failures_during_etcd_outage}, unexplained {out.failures_unexplained}), "
        f"hung past the timeout {out.timeouts}"
    )
    lines.append(
        "requests served per worker (a restarted one counts since its restart): "
        + ", ".join(f"{k} {v}" for k, v in out.served.items())
    )
    for sample in out.error_samples:
        lines.append(f"  error sample: {sample[:200]}")
    lines.append("PASS" if out.ok else "FAIL")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    out = asyncio.run(
        run(
            duration_s=20.0 if args.quick else args.duration,
            concurrency=16 if args.quick else args.chaos_concurrency,
            prompt_tokens=min(args.prompt_tokens, 4096) if args.quick else args.prompt_tokens,
            max_tokens=args.max_tokens,
            interval_s=args.chaos_interval,
            timeout_s=args.timeout,
        )
    )
    print(report(out))
    path = args.output or RESULTS_DIR / "cluster_chaos.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in asdict(out).items() if k != "level"} | {"level": out.level.__dict__}
    path.write_text(json.dumps(data, indent=2))
    print(f"\nresults: {path}")
    return 0 if out.ok else 1


__all__ = ["ClusterRun", "main", "report", "run"]
