"""``python -m bench.faults``: a matrix of faults x request phases under load (docs/protocol.md#faults).

A real deployment: 1 context and 2 generation synthetic worker processes, one
orchestrator process; the context worker sits behind a fault-injecting proxy
(``bench/fault_proxy.py``) on 127.0.0.1, through which its KV is fetched too.
A closed loop of streaming chat requests runs while each fault is injected,
then healed:

- context worker: 4xx (429: refusing, as a full or draining worker does), 5xx
  (500), refused (its port closed), reset mid-body, frozen (SIGSTOP), killed
  (SIGKILL, then restarted);
- KV fetch: refused, timeout (never answered), truncated;
- generation worker: killed (SIGKILL, restarted), frozen (SIGSTOP, SIGCONT);
- client: hang-up before the context answer, during the KV fetch, mid-stream
  (sequential requests, nothing else in flight, so the time until both workers
  hold no sequence and no KV is that request's abort time).

Per cell: requests, client-visible failures, hung requests (no answer within
the client's deadline), sequences and parked KV left on any worker 1 s after
the load stopped, time to recover (from the heal until the faulty worker
serves again), the slowest request that started during the fault, and for the
client cells the abort time (p50 / p99 / max). A frozen context worker should
cost a request at most ``context_timeout_s`` plus its local prefill, and only
until its breaker opens.

Writes bench/results/faults.json and bench/results/faults.png; ``--quick``:
short windows, fewer hang-ups; ``--cells context:5xx,client:mid_stream``: some.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import yaml

from bench import engine_faults
from bench.deploy import PYTHON, free_port, wait_healthy
from bench.fault_proxy import FaultProxy
from bench.loadgen import RESULTS_DIR, percentile
from server.launcher import Child, stop_all

#: the orchestrator's fault settings in this benchmark
CONTEXT_TIMEOUT_S = 1.0
FIRST_BYTE_TIMEOUT_S = 2.0  # above the workers' --kv-fetch-timeout (1 s) plus a recompute
BREAKER_OPEN_S = 1.0
REQUEST_TIMEOUT_S = 4.0
#: a request with no answer within this long is hung
CLIENT_DEADLINE_S = 12.0
PREFILL_MS = 100.0
TOKEN_MS = 10.0
MAX_TOKENS = 20
KV_DELAY_S = 0.3
#: the orchestrator's drain deadline (the shutdown cell cancels what runs past it)
DRAIN_TIMEOUT_S = 1.0

_SAMPLE = re.compile(rb"^(\w+)(\{[^}]*\})? (\S+)$", re.M)

CELLS = [
    ("context", "4xx"), ("context", "5xx"), ("context", "refused"), ("context", "reset"),
    ("context", "frozen"), ("context", "killed"),
    ("kv", "refused"), ("kv", "timeout"), ("kv", "truncated"),
    ("generation", "killed"), ("generation", "frozen"),
    ("client", "before_context"), ("client", "during_kv_fetch"), ("client", "mid_stream"),
    ("orchestrator", "shutdown"),
]  # fmt: skip
#: the cells that time aborts (no recovery: nothing was broken)
ABORT_CELLS = ("client", "orchestrator")
#: proxy modes of the faults a proxy injects
PROXY_FAULTS = {
    ("context", "4xx"): "status:429",
    ("context", "5xx"): "status:500",
    ("context", "refused"): "refuse",
    ("context", "reset"): "reset",
    ("kv", "refused"): "kv_refuse",
    ("kv", "timeout"): "kv_timeout",
    ("kv", "truncated"): "kv_truncate",
}


@dataclass
class Cell:
    target: str
    fault: str
    requests: int = 0
    failures: int = 0
    hung: int = 0
    kv_left: int = 0
    recover_s: float | None = None
    worst_in_fault_ms: float | None = None
    p50_ms: float | None = None
    abort_p50_ms: float | None = None
    abort_p99_ms: float | None = None
    abort_max_ms: float | None = None
    fallbacks: int = 0
    #: client cells: hang-ups whose sequences or KV were still held 5 s after
    unfreed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.target}: {self.fault}"


@dataclass
class Done:
    start: float
    end: float
    ok: bool
    hung: bool
    error: str = ""


def chat_body(max_tokens: int = MAX_TOKENS, seed: int = 0) -> bytes:
    text = f"request {seed}: tell me about kernels, caches and routers " * 8
    return json.dumps(
        {
            "model": "synthetic",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()


class Bench:
    def __init__(self, concurrency: int, fault_s: float, after_s: float, hangups: int) -> None:
        self.concurrency = concurrency
        self.fault_s = fault_s
        self.after_s = after_s
        self.hangups = hangups
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.children: list[Child] = []
        self.tmp = tempfile.TemporaryDirectory(prefix="fastcore-faults-")

    # -- the deployment ------------------------------------------------------------------

    def worker(self, role: str, index: int, *extra: str) -> Child:
        port = free_port()
        argv = [
            *PYTHON,
            "server.cli",
            "worker",
            "--model",
            "synthetic",
            "--prompt-tokens",
            "0",
            "--role",
            role,
            "--port",
            str(port),
            "--kv-fetch-timeout",
            "1",
            "--drain-timeout",
            "2",
            *extra,
        ]
        return Child(f"{role} worker {index}", argv, port)

    async def start(self) -> None:
        self.ctx = self.worker("context", 0, "--prefill-latency-ms", str(PREFILL_MS))
        self.gens = [self.worker("generation", i, "--token-latency-ms", str(TOKEN_MS)) for i in range(2)]
        workers = [self.ctx, *self.gens]
        for child in workers:
            child.start(self.env)
        self.children = list(workers)
        for child in workers:
            await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{child.port}/health", self.children)
        self.proxy = await FaultProxy(f"http://127.0.0.1:{self.ctx.port}", delay_s=KV_DELAY_S).start()
        port = free_port()
        config = {
            "port": port,
            "health_check_interval_s": 0.25,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "context_timeout_s": CONTEXT_TIMEOUT_S,
            "generation_first_byte_timeout_s": FIRST_BYTE_TIMEOUT_S,
            "context_timeout_per_1k_tokens_s": 0.0,
            "circuit_breaker_open_s": BREAKER_OPEN_S,
            "drain_timeout_s": DRAIN_TIMEOUT_S,
            "context_servers": {"urls": [self.proxy.address]},
            "generation_servers": {"urls": [f"127.0.0.1:{g.port}" for g in self.gens]},
        }
        path = Path(self.tmp.name) / "orchestrator.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [*PYTHON, "server.cli", "orchestrator", "-c", str(path), "--log-level", "ERROR"]
        self.orch = Child("orchestrator", argv, port)
        self.orch.start(self.env)
        self.children.append(self.orch)
        self.url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_healthy, self.url + "/health", self.children)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(self) -> None:
        for child in self.children:
            if child.proc is not None and child.exit_code is None:
                child.proc.send_signal(signal.SIGCONT)
        await self.session.close()
        await self.proxy.stop()
        await asyncio.to_thread(stop_all, self.children, 10.0)
        self.tmp.cleanup()

    # -- observation -----------------------------------------------------------------------

    async def scrape(self, url: str) -> dict[str, float]:
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                text = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return {}
        return {
            (m.group(1) + (m.group(2) or b"")).decode(): float(m.group(3)) for m in _SAMPLE.finditer(text)
        }

    async def kv_held(self) -> int:
        """Sequences running and KV entries parked, over every worker."""
        return sum((await self.held()).values())

    async def held(self) -> dict[str, int]:
        """Per worker: sequences running plus KV entries parked (nonzero ones only)."""
        out = {}
        for child in (self.ctx, *self.gens):
            page = await self.scrape(f"http://127.0.0.1:{child.port}")
            n = int(
                page.get("fastcore_worker_running_sequences", 0) + page.get("fastcore_worker_kv_parked", 0)
            )
            if n:
                out[child.name] = n
        return out

    async def orchestrator_value(self, name: str) -> float:
        return (await self.scrape(self.url)).get(name, 0.0)

    async def fallbacks(self) -> float:
        page = await self.scrape(self.url)
        return sum(
            v for k, v in page.items() if k.startswith("fastcore_orchestrator_context_fallbacks_total")
        )

    async def settled(self) -> None:
        """Every worker healthy in the orchestrator's view and every breaker closed."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            page = await self.scrape(self.url)
            healthy = [v for k, v in page.items() if k.startswith("fastcore_orchestrator_worker_healthy{")]
            states = [
                v for k, v in page.items() if k.startswith("fastcore_orchestrator_worker_circuit_state{")
            ]
            if len(healthy) == 3 and all(healthy) and not any(states):
                return
            # A closed breaker is only read as such once a probe went through: send one.
            await self.one(chat_body(2), deadline=CLIENT_DEADLINE_S)
            await asyncio.sleep(0.1)

    # -- requests ----------------------------------------------------------------------------

    async def one(self, body: bytes, deadline: float = CLIENT_DEADLINE_S) -> Done:
        start = time.monotonic()
        try:
            async with asyncio.timeout(deadline):
                async with self.session.post(
                    self.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    data = await resp.read()
            ok = resp.status == 200 and b"data: [DONE]" in data and b'"error"' not in data
            error = "" if ok else f"{resp.status}: {data[-200:].decode(errors='replace')}"
            return Done(start, time.monotonic(), ok, False, error)
        except TimeoutError:
            return Done(start, time.monotonic(), False, True, "hung")
        except (aiohttp.ClientError, ConnectionError) as exc:
            return Done(start, time.monotonic(), False, False, f"{type(exc).__name__}: {exc}")

    async def load(self, stop: asyncio.Event, out: list[Done]) -> None:
        async def loop(i: int) -> None:
            n = 0
            while not stop.is_set():
                out.append(await self.one(chat_body(seed=i * 100_000 + n)))
                n += 1

        await asyncio.gather(*(loop(i) for i in range(self.concurrency)))

    # -- fault cells --------------------------------------------------------------------------

    def inject(
        self, target: str, fault: str
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        """(inject, heal) of a fault."""
        mode = PROXY_FAULTS.get((target, fault))
        if mode is not None:
            return (lambda: self.proxy.set_mode(mode)), (lambda: self.proxy.set_mode("pass"))
        child = self.ctx if target == "context" else self.gens[0]

        async def signal_it(sig: int) -> None:
            assert child.proc is not None
            child.proc.send_signal(sig)

        async def restart() -> None:
            assert child.proc is not None
            child.proc.wait()
            child.start(self.env)
            await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{child.port}/health", [child])

        if fault == "frozen":
            return (lambda: signal_it(signal.SIGSTOP)), (lambda: signal_it(signal.SIGCONT))
        assert fault == "killed"
        return (lambda: signal_it(signal.SIGKILL)), restart

    async def recovered(self, target: str, healed_at: float) -> float | None:
        """Seconds from the heal until the faulty worker serves again (its path or its own count)."""
        if target == "generation":
            url = f"http://127.0.0.1:{self.gens[0].port}"
            name = 'fastcore_worker_requests_total{route="chat",status="200"}'
            before = (await self.scrape(url)).get(name, 0.0)

            async def served() -> bool:
                return (await self.scrape(url)).get(name, 0.0) > before
        else:
            name = 'fastcore_orchestrator_requests_by_path_total{path="disaggregated"}'
            before = await self.orchestrator_value(name)
            fetched_name = 'fastcore_worker_kv_handoff_total{event="fetched"}'
            gen_urls = [f"http://127.0.0.1:{g.port}" for g in self.gens]
            fetched = sum([(await self.scrape(u)).get(fetched_name, 0.0) for u in gen_urls])

            async def served() -> bool:
                if await self.orchestrator_value(name) <= before:
                    return False
                if target != "kv":
                    return True
                return sum([(await self.scrape(u)).get(fetched_name, 0.0) for u in gen_urls]) > fetched

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if await served():
                return time.monotonic() - healed_at
            await asyncio.sleep(0.02)
        return None

    async def fault_cell(self, target: str, fault: str) -> Cell:
        cell = Cell(target, fault)
        await self.settled()
        fallbacks_before = await self.fallbacks()
        inject, heal = self.inject(target, fault)
        stop = asyncio.Event()
        done: list[Done] = []
        loader = asyncio.ensure_future(self.load(stop, done))
        await asyncio.sleep(0.5)
        injected = time.monotonic()
        await inject()
        await asyncio.sleep(self.fault_s)
        await heal()
        healed = time.monotonic()
        recovery = asyncio.ensure_future(self.recovered(target, healed))
        await asyncio.sleep(self.after_s)
        cell.recover_s = await recovery
        stop.set()
        await loader
        await asyncio.sleep(1.0)
        cell.kv_left = await self.kv_held()
        cell.fallbacks = int(await self.fallbacks() - fallbacks_before)
        cell.requests = len(done)
        cell.hung = sum(d.hung for d in done)
        cell.failures = sum(not d.ok and not d.hung for d in done)
        cell.errors = sorted({d.error[:120] for d in done if not d.ok})[:3]
        in_fault = [d.end - d.start for d in done if injected <= d.start < healed]
        cell.worst_in_fault_ms = round(max(in_fault) * 1000, 1) if in_fault else None
        p50 = percentile([d.end - d.start for d in done if d.ok], 50)
        cell.p50_ms = round(p50 * 1000, 1) if p50 is not None else None
        return cell

    # -- client hang-ups: each alone, its abort timed ---------------------------------------------

    async def hang_up(self, phase: str, seed: int) -> tuple[bool, float | None]:
        """One request the client leaves in ``phase``; (it left in that phase, seconds until both
        workers hold nothing)."""
        body = chat_body(200, seed=seed)
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            url = self.url + "/v1/chat/completions"
            if phase == "mid_stream":
                resp = await session.post(url, data=body, headers={"Content-Type": "application/json"})
                for _ in range(5):
                    await resp.content.readline()
                left = not resp.content.at_eof()
                resp.close()
            else:
                wait = (
                    PREFILL_MS / 2000 if phase == "before_context" else (PREFILL_MS / 1000 + KV_DELAY_S / 2)
                )
                task = asyncio.ensure_future(
                    session.post(url, data=body, headers={"Content-Type": "application/json"})
                )
                await asyncio.sleep(wait)
                left = not task.done()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        hung_up = time.monotonic()
        deadline = hung_up + 5
        while time.monotonic() < deadline:
            if await self.kv_held() == 0:
                return left, time.monotonic() - hung_up
            await asyncio.sleep(0.002)
        return left, None

    async def shutdown_cell(self) -> Cell:
        """SIGTERM on the orchestrator with long streams in flight: they run until the drain deadline
        (``drain_timeout_s``), are cancelled then; the abort time is from that deadline until no
        worker holds a sequence or KV. The last cell: the orchestrator is gone after it."""
        cell = Cell("orchestrator", "shutdown")
        await self.settled()
        streams = [
            asyncio.ensure_future(self.one(chat_body(2000, seed=2_000_000 + i)))
            for i in range(self.concurrency)
        ]
        deadline = time.monotonic() + 10
        while await self.kv_held() < self.concurrency and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert self.orch.proc is not None
        self.orch.proc.send_signal(signal.SIGTERM)
        cancel_at = time.monotonic() + DRAIN_TIMEOUT_S
        await asyncio.sleep(max(0.0, cancel_at - time.monotonic() - 0.2))
        while time.monotonic() < cancel_at + 5:
            if await self.kv_held() == 0:
                took = max(0.0, time.monotonic() - cancel_at)
                cell.abort_p50_ms = cell.abort_p99_ms = cell.abort_max_ms = round(took * 1000, 1)
                break
            await asyncio.sleep(0.002)
        else:
            cell.unfreed = 1
        done = await asyncio.gather(*streams)
        cell.requests = len(done)
        cell.failures = sum(not d.ok and not d.hung for d in done)  # cut by the shutdown: expected
        cell.hung = sum(d.hung for d in done)
        await asyncio.sleep(1.0)
        cell.kv_left = await self.kv_held()
        cell.errors = sorted({d.error[:120] for d in done if not d.ok})[:3]
        await asyncio.to_thread(self.orch.proc.wait, 30)
        return cell

    async def client_cell(self, phase: str) -> Cell:
        cell = Cell("client", phase)
        await self.settled()
        if phase == "during_kv_fetch":
            await self.proxy.set_mode("kv_delay")
        times: list[float] = []
        try:
            for i in range(self.hangups):
                left, took = await self.hang_up(phase, 1_000_000 + i)
                cell.requests += 1
                if not left:
                    cell.errors.append("answered before the hang-up")
                if took is None:
                    cell.unfreed += 1
                    cell.errors.append(f"still held 5 s after: {await self.held()}")
                else:
                    times.append(took)
        finally:
            await self.proxy.set_mode("pass")
        await asyncio.sleep(1.0)
        cell.kv_left = await self.kv_held()
        for attr, q in (("abort_p50_ms", 50), ("abort_p99_ms", 99), ("abort_max_ms", 100)):
            value = percentile(times, q)
            setattr(cell, attr, round(value * 1000, 1) if value is not None else None)
        cell.errors = sorted(set(cell.errors))
        return cell


def table(cells: list[Cell]) -> str:
    head = (
        "| cell | requests | client-visible failures | hung | KV left 1 s after | time to recover | "
        "slowest started in fault | p50 ok | fallbacks | abort p50 / p99 / max |"
    )
    rows = [head, "|" + "---|" * 10]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    for c in cells:
        recover = (
            "-" if c.target in ABORT_CELLS else ("never" if c.recover_s is None else f"{c.recover_s:.2f} s")
        )
        aborts = (
            "-"
            if c.target not in ABORT_CELLS
            else f"{ms(c.abort_p50_ms)} / {ms(c.abort_p99_ms)} / {ms(c.abort_max_ms)}"
            + (f" ({c.unfreed} not freed in 5 s)" if c.unfreed else "")
        )
        rows.append(
            f"| {c.name} | {c.requests} | {c.failures} | {c.hung} | {c.kv_left} | {recover} | "
            f"{ms(c.worst_in_fault_ms)} | {ms(c.p50_ms)} | {c.fallbacks} | {aborts} |"
        )
    return "\n".join(rows)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [c for c in cells if c.target not in ABORT_CELLS]
    clients = [c for c in cells if c.target in ABORT_CELLS]
    fig, (ax_fail, ax_time, ax_abort) = plt.subplots(
        1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 3, 1.4]}
    )
    names = [c.name for c in faults]
    ys = range(len(faults))
    ax_fail.barh(
        [y - 0.2 for y in ys],
        [c.failures / max(1, c.requests) * 100 for c in faults],
        0.4,
        label="client-visible failures",
    )
    ax_fail.barh([y + 0.2 for y in ys], [c.hung for c in faults], 0.4, label="hung requests (count)")
    ax_fail.set_yticks(list(ys), names)
    ax_fail.invert_yaxis()
    ax_fail.set_xlabel("% of the cell's requests (hung: count)")
    ax_fail.legend(fontsize=8)
    ax_time.barh(
        [y - 0.2 for y in ys],
        [c.worst_in_fault_ms or 0 for c in faults],
        0.4,
        label="slowest request started during the fault (ms)",
    )
    ax_time.barh(
        [y + 0.2 for y in ys],
        [(c.recover_s or 0) * 1000 for c in faults],
        0.4,
        label="time to recover after the heal (ms)",
    )
    ax_time.axvline(CONTEXT_TIMEOUT_S * 1000, color="grey", linestyle=":", label="context_timeout_s")
    ax_time.set_yticks(list(ys), [""] * len(faults))
    ax_time.invert_yaxis()
    ax_time.set_xlabel("ms")
    ax_time.legend(fontsize=8)
    xs = range(len(clients))
    ax_abort.bar([x - 0.2 for x in xs], [c.abort_p50_ms or 0 for c in clients], 0.4, label="p50")
    ax_abort.bar([x + 0.2 for x in xs], [c.abort_p99_ms or 0 for c in clients], 0.4, label="p99")
    ax_abort.axhline(50, color="red", linestyle=":", label="target 50 ms")
    ax_abort.set_xticks(list(xs), [c.fault.replace("_", "\n") for c in clients], fontsize=8)
    ax_abort.set_ylabel("hang-up (shutdown: drain deadline) -> workers free (ms)")
    ax_abort.legend(fontsize=8)
    total_kv = sum(c.kv_left for c in cells)
    fig.suptitle(
        f"bench.faults: 1 context + 2 generation synthetic workers; KV left over all cells: {total_kv}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(args: argparse.Namespace) -> list[Cell]:
    wanted = CELLS
    if args.cells:
        names = {tuple(n.split(":", 1)) for n in args.cells.split(",")}
        unknown = names - set(CELLS)
        if unknown:
            raise SystemExit(f"unknown cells: {sorted(unknown)}; known: {[':'.join(c) for c in CELLS]}")
        wanted = [c for c in CELLS if c in names]
    quick = args.quick
    bench = Bench(
        concurrency=args.concurrency or (4 if quick else 16),
        fault_s=1.5 if quick else 5.0,
        after_s=2.5 if quick else 5.0,
        hangups=args.hangups or (10 if quick else 50),
    )
    await bench.start()
    cells = []
    try:
        for target, fault in wanted:
            if target == "client":
                cell = await bench.client_cell(fault)
            elif target == "orchestrator":
                cell = await bench.shutdown_cell()
            else:
                cell = await bench.fault_cell(target, fault)
            print(
                f"{cell.name}: {cell.requests} requests, {cell.failures} failed, {cell.hung} hung, "
                f"KV left {cell.kv_left}",
                flush=True,
            )
            cells.append(cell)
    finally:
        await bench.stop()
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows and fewer hang-ups")
    parser.add_argument("--cells", default="", help="comma-separated TARGET:FAULT cells (default: all)")
    parser.add_argument(
        "--concurrency", type=int, default=0, help="streams in flight (default 16, --quick 4)"
    )
    parser.add_argument(
        "--hangups", type=int, default=0, help="hang-ups per client cell (default 50, --quick 10)"
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--worker-protocol",
        choices=["trtllm", *engine_faults.PROTOCOLS, "all"],
        default="trtllm",
        help="trtllm: the synthetic workers (this module's matrix); vllm, sglang: bench.engine_faults' "
        "matrix on that engine's stand-ins; all: the three",
    )
    args = parser.parse_args()
    suffix = "_quick" if args.quick else ""
    engines: tuple[str, ...] = engine_faults.PROTOCOLS if args.worker_protocol == "all" else ()
    if args.worker_protocol in engine_faults.PROTOCOLS:
        engines = (args.worker_protocol,)
    if engines:
        engine_cells = [
            c
            for p in engines
            for c in asyncio.run(engine_faults.run_protocol(p, args.quick, args.concurrency, args.hangups))
        ]
        print(engine_faults.table(engine_cells))
        print("\n".join(engine_faults.verdicts(engine_cells)))
        out = RESULTS_DIR / f"faults_engines{suffix}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"quick": args.quick, "cells": engine_faults.to_json(engine_cells)}, indent=1)
        )
        if args.worker_protocol != "all":
            return
    cells = asyncio.run(run(args))
    print(table(cells))
    out = RESULTS_DIR / f"faults{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "context_timeout_s": CONTEXT_TIMEOUT_S,
        "generation_first_byte_timeout_s": FIRST_BYTE_TIMEOUT_S,
        "breaker_open_s": BREAKER_OPEN_S,
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "client_deadline_s": CLIENT_DEADLINE_S,
        "prefill_ms": PREFILL_MS,
        "token_ms": TOKEN_MS,
        "max_tokens": MAX_TOKENS,
        "quick": args.quick,
    }
    out.write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells]}, indent=1))
    if not args.no_plot and not args.cells:
        plot(cells, RESULTS_DIR / f"faults{suffix}.png")


if __name__ == "__main__":
    main()
