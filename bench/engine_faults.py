"""The fault matrix on vLLM's and SGLang's own PD protocols (``python -m bench.faults --worker-protocol``).

``bench.faults`` runs the trtllm protocol against fastcore's synthetic workers;
this module runs the same kind of matrix against the tests' strict stand-ins of
each engine (``tests/vllm_standin.py``, NixlConnector; ``tests/sglang_standin.py``,
the bootstrap rooms): 2 prefill and 2 decode stand-ins in this process's loop
(so that what they hold can be read: vLLM's KV leases, SGLang's rooms still
waiting), one orchestrator process in front with ``worker_protocol`` set and
``context_fallback: local_prefill``. A closed loop of streaming chat requests
runs while a leg fault is on at the first prefill or decode worker, then off:

- ``prefill: 5xx`` / ``reset``, ``decode: 5xx`` / ``reset``: the leg fails (a 500 in
  the engine's shape, or an RST); on SGLang once its partner joined the room, as
  a failed transfer does; on vLLM the prefill at once, the decode's 500 before
  it pulled the prefill's blocks (the lease stays held) and its RST after;
- ``client: hang_up``: every leg stalls; sequential requests, each left by its
  client once its legs arrived: the time until each leg that arrived is cut.

Per cell: requests, the legs the fault failed, client-visible failures (where a
fallback exists, ``FALLBACK_CELLS``, the target is 0: vLLM's failed prefill falls
back to another or to the decode serving the whole request, and a decode that reset
after its pull goes on from a new prefill to another decode (the lease was read);
SGLang's failed pair is retried on another with a new room; a vLLM decode's 5xx is
the client's), hung
requests (no answer within the client's deadline), what the engines hold 1 s
after the load stopped (vLLM: leases held and decodes waiting for a push;
SGLang: rooms a side still waits on), and on SGLang the time from a leg's
failure to its partner's disconnect (p50 / max; target <= 100 ms).

The stand-ins are test modules (``tests/`` on ``sys.path``, under the names
pytest gives them, tests/test_layout.py); they are imported when a run starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.deploy import PYTHON, free_port, wait_healthy
from bench.loadgen import percentile
from server.launcher import Child, stop_all

ROOT = Path(__file__).resolve().parent.parent
PROTOCOLS = ("vllm", "sglang")
CELLS = [
    ("prefill", "5xx"),
    ("prefill", "reset"),
    ("decode", "5xx"),
    ("decode", "reset"),
    ("client", "hang_up"),
]
#: per protocol, the cells where a fallback exists, so a client-visible failure misses the target: vLLM's
#: failed prefill (another prefill, or the decode serving the whole request), its decode reset after the
#: pull (a new prefill, another decode: protocols' resends_generation); SGLang's failed pair, either leg
#: (retried on another pair with a new room); a vLLM decode's 5xx is the client's
FALLBACK_CELLS = {
    "vllm": (("prefill", "5xx"), ("prefill", "reset"), ("decode", "reset")),
    "sglang": (("prefill", "5xx"), ("prefill", "reset"), ("decode", "5xx"), ("decode", "reset")),
}
CLIENT_DEADLINE_S = 12.0
CUT_TARGET_MS = 100.0
MAX_TOKENS = 8


@dataclass
class EngineCell:
    protocol: str
    target: str
    fault: str
    requests: int = 0
    failures: int = 0
    hung: int = 0
    #: vLLM: leases held + decodes waiting for a push; SGLang: rooms a side still waits on (1 s after)
    left_waiting: int = 0
    fallback: bool = False
    #: legs failed by the fault, and of them those whose partner was cut (SGLang)
    failed_legs: int = 0
    cuts: int = 0
    cut_p50_ms: float | None = None
    cut_max_ms: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.protocol} {self.target}: {self.fault}"


def _standins() -> tuple[Any, Any, Any]:
    """(engine_standin, vllm_standin, sglang_standin), imported from tests/ under pytest's names."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import engine_standin
    import sglang_standin
    import vllm_standin

    return engine_standin, vllm_standin, sglang_standin


def leg_classes() -> tuple[type, type]:
    """The stand-ins with a switchable fault (``how``) that note, per leg key, when a leg failed by it
    and when a leg's connection was cut (``failed_at``, ``cut_at``: monotonic seconds)."""
    engine, vllm, sglang = _standins()
    Refused = engine.Refused

    class Faulty:
        how: str | None = None
        stall_all: bool = False

        def _init_marks(self) -> None:
            self.failed_at: dict[Any, float] = {}
            self.cut_at: dict[Any, float] = {}
            self.arrived: dict[Any, float] = {}

        def key(self, rec: Any) -> Any:
            raise NotImplementedError

        async def fail(self, request: Any, rec: Any) -> None:
            self.failed_at[self.key(rec)] = time.monotonic()
            if self.how == "5xx":
                raise Refused("stand-in fault: leg failed", 500, "InternalServerError")
            await self.reset(request)  # type: ignore[attr-defined]
            await self.wait_forever()  # type: ignore[attr-defined]

        async def marked(self, request: Any, rec: Any, route: Any, serve: Callable[..., Any]) -> Any:
            key = self.key(rec)
            self.arrived[key] = time.monotonic()
            try:
                if self.stall_all:
                    await self.wait_forever()  # type: ignore[attr-defined]
                return await serve(request, rec, route)
            except asyncio.CancelledError:
                self.cut_at.setdefault(key, time.monotonic())
                raise

    class SglangLeg(Faulty, sglang.SglangStandin):  # type: ignore[name-defined]
        def __init__(self, mode: str, *, plane: Any) -> None:
            sglang.SglangStandin.__init__(self, mode, plane=plane)
            self._init_marks()

        def key(self, rec: Any) -> Any:
            return rec.body.get("bootstrap_room") if isinstance(rec.body, dict) else None

        async def serve(self, request: Any, rec: Any, route: Any) -> Any:
            return await self.marked(request, rec, route, self._serve)

        async def _serve(self, request: Any, rec: Any, route: Any) -> Any:
            if self.how is None:
                return await sglang.SglangStandin.serve(self, request, rec, route)
            body = rec.body
            room = self.plane.room((body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]))
            # a failed transfer: once the partner joined the room (which stays until the partner's
            # leg ends: a partner never cut leaves it waiting, as SGLang's would)
            if self.mode == "prefill":
                await asyncio.wait_for(room.bootstrapped.wait(), CLIENT_DEADLINE_S)
            else:
                await asyncio.wait_for(asyncio.shield(room.prefilled), CLIENT_DEADLINE_S)
            await self.fail(request, rec)

    class VllmLeg(Faulty, vllm.VllmStandin):  # type: ignore[name-defined]
        def __init__(self, role: str, *, plane: Any) -> None:
            vllm.VllmStandin.__init__(self, role, plane=plane)
            self._init_marks()

        def key(self, rec: Any) -> Any:
            return rec.headers.get("x-request-id")

        async def serve(self, request: Any, rec: Any, route: Any) -> Any:
            return await self.marked(request, rec, route, self._serve)

        async def _serve(self, request: Any, rec: Any, route: Any) -> Any:
            if self.how is None:
                return await vllm.VllmStandin.serve(self, request, rec, route)
            if self.role == "decode" and self.how == "reset":  # after its pull: the lease is read
                await vllm.VllmStandin.serve(self, request, rec, route)
            # a decode's 5xx comes before its pull: the prefill's lease stays held unless released
            await self.fail(request, rec)

    return VllmLeg, SglangLeg


class EngineBench:
    """One protocol's deployment: stand-ins in this loop, the orchestrator a process."""

    def __init__(self, protocol: str, concurrency: int, fault_s: float, hangups: int) -> None:
        self.protocol = protocol
        self.concurrency = concurrency
        self.fault_s = fault_s
        self.hangups = hangups
        self.tmp = tempfile.TemporaryDirectory(prefix="fastcore-engine-faults-")
        self.children: list[Child] = []

    async def start(self) -> None:
        vllm_leg, sglang_leg = leg_classes()
        _, vllm, sglang = _standins()
        if self.protocol == "sglang":
            self.plane = sglang.BootstrapPlane()
            make = lambda role: sglang_leg(role, plane=self.plane)  # noqa: E731
        else:
            self.plane = vllm.KVPlane()
            make = lambda role: vllm_leg(role, plane=self.plane)  # noqa: E731
        self.prefills = [make("prefill") for _ in range(2)]
        self.decodes = [make("decode") for _ in range(2)]
        for w in (*self.prefills, *self.decodes):
            await w.start()
        port = free_port()
        config = {
            "port": port,
            "worker_protocol": self.protocol,
            # vLLM: a failed prefill falls back to the decode serving the whole request; SGLang: none
            # (its decode cannot), a failed pair is retried on the other prefill with a new room
            "context_fallback": "local_prefill" if self.protocol == "vllm" else "fail",
            "health_check_interval_s": 0.25,
            "request_timeout_s": 4.0,
            "context_timeout_s": 2.0,
            "circuit_breaker_open_s": 1.0,
            "context_servers": {"urls": [w.url for w in self.prefills]},
            "generation_servers": {"urls": [w.url for w in self.decodes]},
        }
        path = Path(self.tmp.name) / "orchestrator.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [*PYTHON, "server.cli", "orchestrator", "-c", str(path), "--log-level", "ERROR"]
        self.orch = Child(f"orchestrator ({self.protocol})", argv, port)
        self.orch.start({**os.environ, "PYTHONUNBUFFERED": "1"})
        self.children = [self.orch]
        self.url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_healthy, self.url + "/health", self.children)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.serving()

    async def stop(self) -> None:
        with contextlib.suppress(AttributeError):
            await self.session.close()
        await asyncio.to_thread(stop_all, self.children, 10.0)
        for w in (*getattr(self, "prefills", ()), *getattr(self, "decodes", ())):
            await w.stop()
        self.tmp.cleanup()

    def waiting(self) -> set[Any]:
        """What the engines hold for a partner now: SGLang's rooms a side waits on; vLLM's leases
        (freed when a decode reads them, else at ``kv_lease_duration``) and decodes waiting for a
        push. A lease left counts against the router: the prefill has no release endpoint, but any
        decode given its ``kv_transfer_params`` frees it (vLLM's decode notifies the prefill even for
        a request aborted before it ran; bench/README.md, "Per worker protocol")."""
        if self.protocol == "sglang":
            return set(self.plane.rooms)
        return set(self.plane.held) | set(self.plane.waiting)

    async def one(self, seed: int, deadline: float = CLIENT_DEADLINE_S) -> tuple[bool, bool, str]:
        """(ok, hung, error) of one streaming chat request."""
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"request {seed}: tell me"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
        try:
            async with asyncio.timeout(deadline):
                async with self.session.post(self.url + "/v1/chat/completions", json=body) as resp:
                    data = await resp.read()
            ok = resp.status == 200 and b"data: [DONE]" in data and b'"error"' not in data
            return ok, False, "" if ok else f"{resp.status}: {data[-160:].decode(errors='replace')}"
        except TimeoutError:
            return False, True, "hung"
        except (aiohttp.ClientError, ConnectionError) as exc:
            return False, False, f"{type(exc).__name__}: {exc}"

    async def serving(self) -> None:
        """Until a request goes through with every fault off (breakers closed again)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ok, _, _ = await self.one(-1, deadline=5)
            if ok:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.protocol}: the orchestrator never served a request")

    async def fault_cell(self, target: str, fault: str) -> EngineCell:
        cell = EngineCell(
            self.protocol, target, fault, fallback=(target, fault) in FALLBACK_CELLS[self.protocol]
        )
        faulty = (self.prefills if target == "prefill" else self.decodes)[0]
        faulty.failed_at.clear()
        before = self.waiting()  # an earlier cell's leases still held are not this cell's
        done: list[tuple[bool, bool, str]] = []
        stop = asyncio.Event()

        async def loop(i: int) -> None:
            n = 0
            while not stop.is_set():
                done.append(await self.one(i * 100_000 + n))
                n += 1

        loader = asyncio.gather(*(loop(i) for i in range(self.concurrency)))
        faulty.how = fault
        await asyncio.sleep(self.fault_s)
        faulty.how = None
        stop.set()
        await loader
        await asyncio.sleep(1.0)
        cell.left_waiting = len(self.waiting() - before)
        cell.requests = len(done)
        cell.hung = sum(h for _, h, _ in done)
        cell.failures = sum(not ok and not h for ok, h, _ in done)
        cell.errors = sorted({e[:120] for ok, _, e in done if not ok})[:3]
        cell.failed_legs = len(faulty.failed_at)
        if self.protocol == "sglang":
            partners = self.decodes if target == "prefill" else self.prefills
            cuts = []
            for key, failed in faulty.failed_at.items():
                cut = next((p.cut_at[key] for p in partners if key in p.cut_at), None)
                if cut is not None:
                    cuts.append(max(0.0, cut - failed))
            cell.cuts = len(cuts)
            self._cut_stats(cell, cuts)
        await self.serving()
        return cell

    @staticmethod
    def _cut_stats(cell: EngineCell, cuts: list[float]) -> None:
        p50, top = percentile(cuts, 50), percentile(cuts, 100)
        cell.cut_p50_ms = round(p50 * 1000, 1) if p50 is not None else None
        cell.cut_max_ms = round(top * 1000, 1) if top is not None else None

    async def client_cell(self) -> EngineCell:
        """Sequential requests, each left by its client once its legs arrived (every leg stalls): the
        time from the hang-up until every leg that arrived was cut."""
        cell = EngineCell(self.protocol, "client", "hang_up")
        workers = [*self.prefills, *self.decodes]
        times: list[float] = []
        held_before = self.waiting()
        for w in workers:
            w.stall_all = True
        try:
            for i in range(self.hangups):
                before = {id(w): set(w.arrived) for w in workers}
                task = asyncio.ensure_future(self.one(3_000_000 + i))
                legs = 2 if self.protocol == "sglang" else 1  # vLLM's decode leg comes after the prefill's
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    new = [(w, k) for w in workers for k in w.arrived if k not in before[id(w)]]
                    if len(new) >= legs:
                        break
                    await asyncio.sleep(0.002)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                hung_up = time.monotonic()
                cell.requests += 1
                while time.monotonic() < hung_up + 5 and not all(k in w.cut_at for w, k in new):
                    await asyncio.sleep(0.002)
                if all(k in w.cut_at for w, k in new):
                    times.append(max(0.0, max(w.cut_at[k] for w, k in new) - hung_up))
                else:
                    cell.hung += 1
                    cell.errors.append("a leg still held 5 s after the hang-up")
        finally:
            for w in workers:
                w.stall_all = False
        await asyncio.sleep(1.0)
        cell.left_waiting = len(self.waiting() - held_before)
        cell.cuts = len(times)
        self._cut_stats(cell, times)
        cell.errors = sorted(set(cell.errors))[:3]
        await self.serving()
        return cell


async def run_protocol(
    protocol: str, quick: bool, concurrency: int = 0, hangups: int = 0
) -> list[EngineCell]:
    bench = EngineBench(
        protocol,
        concurrency=concurrency or (4 if quick else 16),
        fault_s=1.0 if quick else 5.0,
        hangups=hangups or (5 if quick else 50),
    )
    cells = []
    try:
        await bench.start()
        for target, fault in CELLS:
            cell = await (bench.client_cell() if target == "client" else bench.fault_cell(target, fault))
            print(
                f"{cell.name}: {cell.requests} requests, {cell.failures} failed, {cell.hung} hung, "
                f"left waiting {cell.left_waiting}, cut p50/max {cell.cut_p50_ms}/{cell.cut_max_ms} ms",
                flush=True,
            )
            cells.append(cell)
    finally:
        await bench.stop()
    return cells


def table(cells: list[EngineCell]) -> str:
    head = (
        "| protocol, cell | requests | legs failed by the fault | client-visible failures | fallback exists | "
        "hung | left waiting 1 s after | partner cut (abort) p50 / max |"
    )
    rows = [head, "|" + "---|" * 8]
    for c in cells:
        cut = "-" if c.cut_p50_ms is None else f"{c.cut_p50_ms:.1f} / {c.cut_max_ms:.1f} ms ({c.cuts})"
        if c.target != "client" and c.protocol == "sglang" and c.cuts < c.failed_legs:
            cut += f", {c.failed_legs - c.cuts} of {c.failed_legs} partners never cut"
        failed = "-" if c.target == "client" else str(c.failed_legs)
        rows.append(
            f"| {c.name} | {c.requests} | {failed} | {c.failures} | {'yes' if c.fallback else 'no'} | {c.hung} | "
            f"{c.left_waiting} | {cut} |"
        )
    return "\n".join(rows)


def verdicts(cells: list[EngineCell]) -> list[str]:
    """Issue 37's fault-matrix targets, one line per protocol."""
    out = []
    for protocol in sorted({c.protocol for c in cells}):
        mine = [c for c in cells if c.protocol == protocol]
        misses = [f"{c.name}: {c.hung} hung" for c in mine if c.hung]
        misses += [f"{c.name}: {c.left_waiting} left waiting" for c in mine if c.left_waiting]
        misses += [f"{c.name}: {c.failures} failures" for c in mine if c.fallback and c.failures]
        if protocol == "sglang":
            misses += [
                f"{c.name}: cut max {c.cut_max_ms} ms"
                for c in mine
                if c.target != "client" and (c.cut_max_ms or 0) > CUT_TARGET_MS
            ]
            misses += [
                f"{c.name}: a partner never cut"
                for c in mine
                if c.target != "client" and c.cuts < c.failed_legs
            ]
        out.append(f"verdict {protocol}: {'MET' if not misses else 'NOT MET (' + '; '.join(misses) + ')'}")
    return out


def to_json(cells: list[EngineCell]) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(c.__dict__)) for c in cells]
