"""``python -m bench.load --abuse``, second part: the HTTP layer's attacks of issue 19, one phase each.

Each phase runs the honest closed loop (streaming chats from 127.0.0.1) for
a fixed time beside one attack from another client address (127.0.0.2:
Linux routes all of 127/8 to lo, so the server sees another client, as in
production where an attacker is not the load balancer), then a phase with
all of them at once:

- ``trailers``: connections sending a chunked body whose trailer field never
  ends (up to 128 MiB each), reconnecting when answered; 431 expected after
  about ``max_header_bytes``, never the trailer read to its end;
- ``body hold``: 16 connections each declaring a body of ``max_body_bytes``,
  sending all of it but its last byte, and stalling: the attacker may hold
  at most 3/4 of ``max_inflight_body_bytes`` (``client_ip_share``), the rest
  is 429, and honest POSTs keep the last quarter;
- ``slowloris at the cap``: more slow-header connections than the
  orchestrator's connection cap, each reopened as soon as it is closed or
  refused: a quarter of the cap stays for others, and at the cap a newcomer
  closes one of the attacker's slow connections instead of being refused;
- ``large bodies``: a burst of concurrent large bodies (most refused by the
  body budget), then the time until the orchestrator's RSS is back within
  64 MiB of what it was before;
- ``mixed``: trailers, body hold and slowloris together.

Per phase: the honest requests' success rate, TTFT/latency p50/p99 and the
p99 ratio to the clean phase, the orchestrator's RSS before, at its peak
during and after, and what the attackers got. Afterwards one request each
checks the framing answers: no Host (400), two Hosts (400), a declared 4 GiB
chunk (413 at once), a half-closed request (answered, then closed).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench._timing import format_table
from bench.loadgen import LevelResult, read_status, run_concurrency

#: the address attackers connect from (another client than the honest load's 127.0.0.1)
ATTACKER_IP = "127.0.0.2"
#: what "back to baseline" means for RSS after a burst (issue 19's target)
RSS_MARGIN = 64 << 20
#: the honest success rate each phase must keep (issue 19's target)
MIN_SUCCESS = 0.95


@dataclass
class HTTPAbuseSettings:
    """Sizes of the HTTP-layer phases; ``full()`` is issue 19's numbers, ``quick()`` a smoke run."""

    phase_s: float
    trailer_connections: int
    trailer_max_bytes: int
    hold_connections: int
    #: body bytes a holding attacker sends before it stalls (max_body_bytes - 1 in the full run)
    hold_sent_bytes: int
    #: slow-header connections beyond the connection cap
    slowloris_over_cap: int
    burst_bodies: int
    burst_body_bytes: int
    #: how long to wait for RSS to come back after the burst
    settle_s: float

    @classmethod
    def full(cls, max_body_bytes: int) -> HTTPAbuseSettings:
        return cls(
            phase_s=15.0,
            trailer_connections=2,
            trailer_max_bytes=128 << 20,
            hold_connections=16,
            hold_sent_bytes=max_body_bytes - 1,
            slowloris_over_cap=108,
            burst_bodies=200,
            burst_body_bytes=30_000_000,
            settle_s=30.0,
        )

    @classmethod
    def quick(cls) -> HTTPAbuseSettings:
        return cls(
            phase_s=3.0,
            trailer_connections=2,
            trailer_max_bytes=8 << 20,
            hold_connections=16,
            hold_sent_bytes=1 << 20,
            slowloris_over_cap=64,
            burst_bodies=24,
            burst_body_bytes=8 << 20,
            settle_s=10.0,
        )


@dataclass
class PhaseResult:
    name: str
    honest: LevelResult
    #: the orchestrator's RSS (bytes): before the phase, its peak during, right after, and settled
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    #: seconds after the attack until RSS was within RSS_MARGIN of rss_before (None: not within settle_s)
    rss_settle_s: float | None = None
    #: per attacker kind: outcome -> count
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def success(self) -> float:
        h = self.honest
        return (h.requests - h.errors - h.timeouts) / h.requests if h.requests else 0.0


def _bump(outcomes: dict[str, dict[str, int]], kind: str, outcome: str) -> None:
    counts = outcomes.setdefault(kind, {})
    counts[outcome] = counts.get(outcome, 0) + 1


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(host, port, local_addr=(ATTACKER_IP, 0), limit=1 << 16), 5.0
        )
    except (OSError, TimeoutError):
        return None


async def _send_until_answered(
    writer: asyncio.StreamWriter, data: bytes, answer: asyncio.Future[str], stopping: asyncio.Event
) -> int:
    """``data`` in 1 MiB writes, each drained (never a whole body in the transport's buffer); the bytes
    sent when the server answered, the phase ended or the connection broke."""
    view, sent = memoryview(data), 0
    try:
        while sent < len(view) and not answer.done() and not stopping.is_set():
            writer.write(view[sent : sent + (1 << 20)])
            sent = min(len(view), sent + (1 << 20))
            drain = asyncio.ensure_future(writer.drain())
            either: set[asyncio.Future[Any]] = {drain, answer}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not drain.done():
                drain.cancel()
            else:
                drain.result()  # a broken connection raises here
    except ConnectionError:
        pass
    return sent


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (ConnectionError, RuntimeError):
        pass


class Attacks:
    """The HTTP-layer attackers against ``host:port``, each a loop until :meth:`stop`."""

    def __init__(
        self, host: str, port: int, s: HTTPAbuseSettings, *, max_body_bytes: int, max_connections: int
    ) -> None:
        self.host, self.port, self.s = host, port, s
        self.max_body_bytes, self.max_connections = max_body_bytes, max_connections
        self.outcomes: dict[str, dict[str, int]] = {}
        self.stopping = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, *kinds: str) -> None:
        loops: dict[str, Callable[[], list[Awaitable[None]]]] = {
            "trailers": lambda: [self._trailer_loop() for _ in range(self.s.trailer_connections)],
            "body hold": lambda: [self._hold_loop() for _ in range(self.s.hold_connections)],
            "slowloris": lambda: [self._slow_loop(i) for i in range(self.max_connections + self.s.slowloris_over_cap)],
        }  # fmt: skip
        for kind in kinds:
            self.tasks += [asyncio.ensure_future(c) for c in loops[kind]()]

    async def stop(self) -> None:
        self.stopping.set()
        _, pending = await asyncio.wait(self.tasks, timeout=10.0) if self.tasks else (set(), set())
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)

    async def _until_answer_or_stop(self, reader: asyncio.StreamReader, timeout: float | None = None) -> str:
        answer = asyncio.ensure_future(read_status(reader))
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({answer, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()
        return "open at stop" if self.stopping.is_set() else "no answer"

    async def _trailer_loop(self) -> None:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: "
        ).encode()
        piece = b"t" * (64 << 10)
        while not self.stopping.is_set():
            conn = await _connect(self.host, self.port)
            if conn is None:
                _bump(self.outcomes, "trailers", "connect error")
                await asyncio.sleep(0.1)
                continue
            reader, writer = conn
            answer = asyncio.ensure_future(read_status(reader))
            sent = 0
            try:
                writer.write(head)
                while sent < self.s.trailer_max_bytes and not answer.done() and not self.stopping.is_set():
                    writer.write(piece)
                    sent += len(piece)
                    await writer.drain()
                outcome = (
                    await asyncio.wait_for(answer, 10.0) if not self.stopping.is_set() else "open at stop"
                )
            except (ConnectionError, TimeoutError):
                outcome = answer.result() if answer.done() and not answer.cancelled() else "reset"
            finally:
                if not answer.done():
                    answer.cancel()
                _close(writer)
            _bump(self.outcomes, "trailers", f"{outcome} after {_size_band(sent)}")

    async def _hold_loop(self) -> None:
        """Declare max_body_bytes, send all but the last byte (or hold_sent_bytes), stall until closed."""
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {self.max_body_bytes}\r\n\r\n"
        ).encode()
        body = b"h" * min(self.s.hold_sent_bytes, self.max_body_bytes - 1)
        while not self.stopping.is_set():
            conn = await _connect(self.host, self.port)
            if conn is None:
                _bump(self.outcomes, "body hold", "connect error")
                await asyncio.sleep(0.1)
                continue
            reader, writer = conn
            answer = asyncio.ensure_future(read_status(reader))
            try:
                writer.write(head)
                await _send_until_answered(writer, body, answer, self.stopping)
                stop = asyncio.ensure_future(self.stopping.wait())
                await asyncio.wait({answer, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                outcome = answer.result() if answer.done() else "open at stop"
            finally:
                if not answer.done():
                    answer.cancel()
                _close(writer)
            _bump(self.outcomes, "body hold", outcome)
            if outcome != "open at stop":
                await asyncio.sleep(1.0)  # refused: back after the Retry-After

    async def _slow_loop(self, index: int) -> None:
        """A connection sending its headers a byte a second, reopened when closed (at once) or refused (after 1 s)."""
        await asyncio.sleep(index * 0.0005)
        trickle = f"GET /health HTTP/1.1\r\nHost: {self.host}\r\nX-Slow: ".encode() + b"s" * 100_000
        while not self.stopping.is_set():
            conn = await _connect(self.host, self.port)
            if conn is None:
                _bump(self.outcomes, "slowloris", "connect error")
                await asyncio.sleep(0.1)
                continue
            reader, writer = conn
            outcome = "no answer"
            try:
                for i in range(len(trickle)):
                    writer.write(trickle[i : i + 1])
                    outcome = await self._until_answer_or_stop(reader, timeout=1.0)
                    if outcome != "no answer":
                        break
            except ConnectionError:
                outcome = "reset"
            finally:
                _close(writer)
            _bump(self.outcomes, "slowloris", outcome)
            if outcome not in ("open at stop", "closed", "408"):
                await asyncio.sleep(
                    1.0
                )  # refused: back after the Retry-After (a 2-core box can take no faster storm)


def _size_band(n: int) -> str:
    return f"<{(n >> 20) + 1} MiB"


# -- phases ---------------------------------------------------------------------------------


async def _rss_sampler(rss: Callable[[], int], peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], await asyncio.to_thread(rss))
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            pass


async def _settle(rss: Callable[[], int], base: int, settle_s: float) -> tuple[int, float | None]:
    t0 = time.perf_counter()
    while True:
        now = await asyncio.to_thread(rss)
        elapsed = time.perf_counter() - t0
        if now < base + RSS_MARGIN:
            return now, round(elapsed, 1)
        if elapsed > settle_s:
            return now, None
        await asyncio.sleep(0.25)


async def _burst(host: str, port: int, s: HTTPAbuseSettings, outcomes: dict[str, dict[str, int]]) -> None:
    """Concurrent large bodies from the attacker's address (a 404 route: the HTTP layer holds them, no worker)."""
    body = b'{"x": "' + b"a" * max(0, s.burst_body_bytes - 9) + b'"}'
    head = (
        f"POST /v1/abuse-large-body HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def one() -> None:
        conn = await _connect(host, port)
        if conn is None:
            _bump(outcomes, "large bodies", "connect error")
            return
        reader, writer = conn
        answer = asyncio.ensure_future(read_status(reader))
        try:
            writer.write(head)
            await _send_until_answered(writer, body, answer, asyncio.Event())
            outcome = await asyncio.wait_for(answer, 60)
        except (ConnectionError, TimeoutError):
            outcome = "reset"
        finally:
            if not answer.done():
                answer.cancel()
            _close(writer)
        _bump(outcomes, "large bodies", outcome)

    await asyncio.gather(*(one() for _ in range(s.burst_bodies)))


async def run_phases(
    base_url: str,
    body: bytes,
    *,
    concurrency: int,
    timeout: float,
    s: HTTPAbuseSettings,
    rss: Callable[[], int],
    max_body_bytes: int,
    max_connections: int,
) -> list[PhaseResult]:
    """A clean phase, one per attack, the burst, the mixed phase; ``rss``: the orchestrator's RSS now."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    host_port = base_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port_text = host_port.rpartition(":")
    port = int(port_text)
    results: list[PhaseResult] = []

    async def phase(name: str, kinds: tuple[str, ...]) -> None:
        result = PhaseResult(name, LevelResult.empty(name, concurrency))
        result.rss_before = await asyncio.to_thread(rss)
        peak, stop = [result.rss_before], asyncio.Event()
        sampler = asyncio.ensure_future(_rss_sampler(rss, peak, stop))
        attacker = (
            await _start_attacker(host, port, s, kinds, max_body_bytes, max_connections) if kinds else None
        )
        await asyncio.sleep(0.5 if kinds else 0.0)  # the attack in place before the honest load
        result.honest = await run_concurrency(
            url, body, concurrency, max_requests=1_000_000, max_seconds=s.phase_s, timeout=timeout, label=name
        )
        if attacker is not None:
            result.outcomes = await _stop_attacker(attacker)
        stop.set()
        await sampler
        result.rss_peak = peak[0]
        result.rss_after, result.rss_settle_s = await _settle(rss, result.rss_before, s.settle_s)
        results.append(result)

    await phase("clean", ())
    await phase("trailers", ("trailers",))
    await phase("body hold", ("body hold",))
    await phase("slowloris at cap", ("slowloris",))
    await phase("large bodies", ("burst",))
    await phase("mixed", ("trailers", "body hold", "slowloris", "burst"))
    return results


# -- the attacker process -------------------------------------------------------------------------
#
# The attackers run in a process of their own: in the honest clients' event loop
# their work (thousands of sockets, MiB of writes) would delay the honest
# requests' own timing, and the report would show the bench's lag as the server's.


async def _start_attacker(
    host: str,
    port: int,
    s: HTTPAbuseSettings,
    kinds: tuple[str, ...],
    max_body_bytes: int,
    max_connections: int,
) -> asyncio.subprocess.Process:
    spec = {
        "host": host,
        "port": port,
        "settings": asdict(s),
        "kinds": list(kinds),
        "max_body_bytes": max_body_bytes,
        "max_connections": max_connections,
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.abuse_http",
        json.dumps(spec),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _stop_attacker(proc: asyncio.subprocess.Process) -> dict[str, dict[str, int]]:
    """Close its stdin (the stop signal); its outcomes, the JSON it prints as it ends."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        out = await asyncio.wait_for(proc.stdout.read(), 60)
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"attacker": {"killed: did not stop within 60 s": 1}}
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"attacker": {f"exit {proc.returncode}, no outcomes": 1}}


async def _attacker_main(spec: dict[str, Any]) -> dict[str, dict[str, int]]:
    s = HTTPAbuseSettings(**spec["settings"])
    host, port, kinds = spec["host"], spec["port"], spec["kinds"]
    attacks = Attacks(
        host, port, s, max_body_bytes=spec["max_body_bytes"], max_connections=spec["max_connections"]
    )
    attacks.start(*(k for k in kinds if k != "burst"))
    burst = asyncio.ensure_future(_burst(host, port, s, attacks.outcomes)) if "burst" in kinds else None
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    if burst is not None:
        await burst
    await attacks.stop()
    return attacks.outcomes


# -- framing checks ---------------------------------------------------------------------------


async def framing_checks(base_url: str) -> dict[str, str]:
    """One request each: what the server answers (the status, and for a half-close whether it then closed)."""
    host_port = base_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port_text = host_port.rpartition(":")
    port = int(port_text)

    async def ask(data: bytes, *, half_close: bool = False) -> str:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(data)
            if half_close:
                writer.write_eof()
            t0 = time.perf_counter()
            statuses = []
            while True:
                status = await asyncio.wait_for(read_status(reader), 10)
                if status != "100":
                    break
                statuses.append(status)
                await reader.readuntil(b"\r\n\r\n")
            statuses.append(status)
            rest = await asyncio.wait_for(reader.read(), 10) if half_close else b""
            ms = (time.perf_counter() - t0) * 1000
            closed = ", then closed" if half_close and rest is not None else ""
            return f"{' '.join(statuses)} in {ms:.0f} ms{closed}"
        except (ConnectionError, TimeoutError) as exc:
            return type(exc).__name__
        finally:
            _close(writer)

    return {
        "no Host": await ask(b"GET /health HTTP/1.1\r\n\r\n"),
        "two Hosts": await ask(b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
        "4 GiB chunk declared": await ask(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n100000000\r\n"
        ),
        "half-closed GET /health": await ask(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n", half_close=True),
    }


# -- report -----------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def phase_table(results: list[PhaseResult]) -> str:
    clean = results[0].honest
    headers = [
        "phase",
        "honest reqs",
        "success",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "E2E p50 ms",
        "E2E p99 ms",
        "E2E p99 / clean",
        "RSS MiB before/peak/after",
        "RSS back in",
    ]
    rows = []
    for r in results:
        h = r.honest
        ratio = (
            f"{h.latency_p99_ms / clean.latency_p99_ms:.2f}x"
            if h.latency_p99_ms and clean.latency_p99_ms
            else "-"
        )
        back = (
            "-" if r.name == "clean" else (f"{r.rss_settle_s:.1f} s" if r.rss_settle_s is not None else "not")
        )
        rows.append(
            [
                r.name,
                h.requests,
                f"{100 * r.success:.1f}%",
                h.ttft_p50_ms,
                h.ttft_p99_ms,
                h.latency_p50_ms,
                h.latency_p99_ms,
                ratio,
                f"{_mib(r.rss_before)} / {_mib(r.rss_peak)} / {_mib(r.rss_after)}",
                back,
            ]
        )
    return format_table(headers, rows)


def outcomes_text(results: list[PhaseResult], checks: dict[str, str]) -> str:
    lines = []
    for r in results:
        for kind, counts in r.outcomes.items():
            top = sorted(counts.items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{k} {v}" for k, v in top[:6]) + (", ..." if len(top) > 6 else "")
            lines.append(f"{r.name}: {kind}: {shown}")
    lines.append("framing: " + "; ".join(f"{k}: {v}" for k, v in checks.items()))
    return "\n".join(lines)


def to_json(results: list[PhaseResult], checks: dict[str, str], s: HTTPAbuseSettings) -> dict[str, Any]:
    return {
        "settings": asdict(s),
        "phases": [{**asdict(r), "success": r.success} for r in results],
        "framing": checks,
    }


__all__ = ["ATTACKER_IP", "HTTPAbuseSettings", "PhaseResult", "framing_checks", "phase_table", "run_phases"]


if __name__ == "__main__":
    from server.cli import raise_open_file_limit

    raise_open_file_limit()  # more connections than the server's cap
    print(json.dumps(asyncio.run(_attacker_main(json.loads(sys.argv[1])))), flush=True)
