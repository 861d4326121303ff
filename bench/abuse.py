"""``python -m bench.load --abuse``: honest load, alone and beside hostile clients, in one run.

    python -m bench.load --abuse             # its own deployment: `fastcore-serve up` on tiny (~1.5 min)
    python -m bench.load --abuse --quick     # a smoke run (seconds; short client timeouts)
    python -m bench.load --abuse --url http://127.0.0.1:8000 --context-metrics http://127.0.0.1:8001

Phase 1 (clean): a closed loop of honest streaming chat requests. Phase 2
(abuse): the same loop while, from the same process and event loop, all at
once:

- abandon flood: rounds of raw connections that send a real streaming chat
  request with a long prompt and hang up ``--abandon-after-ms`` later, in the
  middle of its context leg (FIN and RST on alternate rounds);
- slowloris: connections that send a request's headers one byte at a time and
  never finish them; idle connections that send nothing; keep-alive
  connections that send one ``GET /health`` and then nothing;
- oversized bodies: Content-Length above the body limit (413 expected before
  the body is read), chunked bodies that go past it (413 expected at the
  limit), and large bodies under it (valid JSON chat requests of several MB)
  that load the orchestrator's and the context worker's memory.

Every attacker is bounded (by count, by a hold cap, and by the phase's end)
and records what it got: statuses, resets, how long the server let a
connection live. The report is the honest requests' errors (target 0) and
TTFT/latency p50/p99 per phase with the abuse/clean ratios, an attacker
summary, the processes' RSS before and after, and the context worker's
``fastcore_worker_kv_used_tokens`` at the end. Exit status 1 when an honest
request failed.

Then, on a deployment of its own with API keys and admission (not with ``--url``;
``--tenants-only``, ``--no-tenants``), bench/abuse_tenants.py's phases: an honest tenant alone
and beside other tenants' breaker, priority and token-limit abuse (issue 36).

Without ``--url`` the run starts its own deployment: the processes
``fastcore-serve up`` starts (``server.launcher.plan``: a context and a
generation torch worker on ``tiny`` and an orchestrator with both gates) on
free ports of 127.0.0.1, stopped at the end whatever happens. The
orchestrator gets the config's default client limits, or short ones with
``--quick`` so that the time limits are seen within seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import struct
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import abuse_http
from bench._timing import format_table
from bench.deploy import free_port, process_tree, rss_bytes, wait_healthy
from bench.loadgen import RESULTS_DIR, LevelResult, percentile, read_status, run_concurrency, write_json
from bench.workload import agentic_messages
from server.auth import SECRET_ENV as SHARED_SECRET_ENV
from server.launcher import Child, plan, stop_all
from server.launcher import add_arguments as add_launcher_arguments
from server.orchestrator.config import OrchestratorConfig
from server.process import import_path_env

CHAT = "/v1/chat/completions"
#: the orchestrator's default client limits (``server/orchestrator/config.py``)
DEFAULTS = OrchestratorConfig.model_validate({})
#: client limits of the orchestrator a ``--quick`` run starts: time limits seen within seconds
QUICK_LIMITS: dict[str, float] = {"client_header_timeout_s": 1.5, "client_keepalive_timeout_s": 2.0}
#: the connection cap of a ``--quick`` run's orchestrator: its slowloris phase opens that many and more
QUICK_MAX_CONNECTIONS = 512
CHUNK = 1 << 20


# -- settings ---------------------------------------------------------------------------------


@dataclass
class AbuseSettings:
    """What one run sends; ``full()`` and ``quick()`` are the two presets, flags override them."""

    #: honest load (one token per byte of prompt on tiny's byte tokenizer)
    prompt_tokens: int
    max_tokens: int
    concurrency: int
    requests: int
    max_seconds: float
    timeout: float
    #: abandon flood
    abandon_batch: int
    abandon_interval_s: float
    abandon_after_s: float
    abandon_prompt_tokens: int
    abandon_max_tokens: int
    abandon_max_rounds: int
    #: slow and idle connections
    slowloris: int
    slowloris_interval_s: float
    idle: int
    keepalive: int
    #: oversized bodies, per round
    oversize_rounds: int
    oversize_interval_s: float
    oversize_content_length: int
    oversize_chunked: int
    large_allowed: int
    large_allowed_bytes: int
    #: the target's limits (what an attacker aims just past, how long to hold a connection)
    max_body_bytes: int
    header_timeout_s: float
    keepalive_timeout_s: float
    #: the abuse phase lasts at least this (long enough to see slow connections dropped)
    min_window_s: float
    #: at most this long waiting for the context worker's KV to drain after the abuse phase
    kv_settle_s: float

    @property
    def hold_cap_s(self) -> float:
        """The longest an attacker holds a connection the server does not close."""
        return 2 * max(self.header_timeout_s, self.keepalive_timeout_s) + 5

    @classmethod
    def full(cls) -> AbuseSettings:
        return cls(
            prompt_tokens=500, max_tokens=32, concurrency=8, requests=800, max_seconds=60.0, timeout=30.0,
            abandon_batch=40, abandon_interval_s=1.0, abandon_after_s=0.05, abandon_prompt_tokens=1700,
            abandon_max_tokens=300, abandon_max_rounds=120,
            slowloris=300, slowloris_interval_s=1.0, idle=100, keepalive=100,
            oversize_rounds=20, oversize_interval_s=2.0, oversize_content_length=4, oversize_chunked=2,
            large_allowed=2, large_allowed_bytes=8 << 20,
            max_body_bytes=DEFAULTS.max_body_bytes, header_timeout_s=DEFAULTS.client_header_timeout_s,
            keepalive_timeout_s=DEFAULTS.client_keepalive_timeout_s,
            min_window_s=DEFAULTS.client_header_timeout_s + 2, kv_settle_s=40.0,
        )  # fmt: skip

    @classmethod
    def quick(cls) -> AbuseSettings:
        return cls(
            prompt_tokens=200, max_tokens=8, concurrency=4, requests=150, max_seconds=20.0, timeout=15.0,
            abandon_batch=10, abandon_interval_s=0.5, abandon_after_s=0.05, abandon_prompt_tokens=1700,
            abandon_max_tokens=64, abandon_max_rounds=6,
            slowloris=40, slowloris_interval_s=0.3, idle=20, keepalive=20,
            oversize_rounds=2, oversize_interval_s=1.0, oversize_content_length=2, oversize_chunked=1,
            large_allowed=1, large_allowed_bytes=2 << 20,
            max_body_bytes=DEFAULTS.max_body_bytes, header_timeout_s=QUICK_LIMITS["client_header_timeout_s"],
            keepalive_timeout_s=QUICK_LIMITS["client_keepalive_timeout_s"],
            min_window_s=QUICK_LIMITS["client_keepalive_timeout_s"] + 1.5, kv_settle_s=3.0,
        )  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> AbuseSettings:
    """The preset (``--quick`` or full) with the flags given on the command line applied."""
    s = AbuseSettings.quick() if args.quick else AbuseSettings.full()
    if args.url:  # a target this run did not configure: the config's default limits unless told
        s.header_timeout_s = DEFAULTS.client_header_timeout_s
        s.keepalive_timeout_s = DEFAULTS.client_keepalive_timeout_s
    if args.concurrency:
        s.concurrency = int(args.concurrency.split(",")[0])
    for flag in (
        "requests",
        "prompt_tokens",
        "max_tokens",
        "abandon_batch",
        "slowloris",
        "max_body_bytes",
        "header_timeout_s",
        "keepalive_timeout_s",
    ):
        if getattr(args, flag, None):
            setattr(s, flag, getattr(args, flag))
    if args.duration is not None:
        s.max_seconds = args.duration
    if args.timeout is not None:
        s.timeout = args.timeout
    # Long enough to see slow connections dropped: the header timeout (and a short keep-alive one).
    waited = (
        max(s.header_timeout_s, s.keepalive_timeout_s) if args.quick and not args.url else s.header_timeout_s
    )
    s.min_window_s = waited + (1.5 if args.quick else 2.0)
    return s


# -- bodies -----------------------------------------------------------------------------------


def tiny_chat_body(prompt_tokens: int, *, max_tokens: int, model: str = "tiny", stream: bool = True) -> bytes:
    """A chat request tiny's template takes (system and user turns; about one token per byte).

    The text is :func:`bench.workload.agentic_messages`', folded into two turns
    (the tiny template has no tool role).
    """
    messages = agentic_messages(prompt_tokens, bytes_per_token=1)
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": messages[0]["content"]},
            {"role": "user", "content": " ".join(m["content"] for m in messages[1:])},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    return json.dumps(body).encode()


def large_body(n_bytes: int, *, model: str = "tiny") -> bytes:
    """A valid JSON chat request of about ``n_bytes`` (a prompt far past any context: 400 expected)."""
    head = json.dumps({"model": model, "max_tokens": 1, "stream": False})[:-1].encode()
    prefix = head + b', "messages": [{"role": "user", "content": "'
    suffix = b'"}]}'
    filler = b"lorem ipsum dolor sit amet " * (max(0, n_bytes - len(prefix) - len(suffix)) // 27 + 1)
    return prefix + filler[: max(0, n_bytes - len(prefix) - len(suffix))] + suffix


def http_request(host: str, port: int, path: str, body: bytes, headers: str = "") -> bytes:
    """A POST's bytes; ``headers``: more header lines, each ending in CRLF (an API key)."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def slow_header_bytes(host: str) -> Iterator[bytes]:
    """A request line and headers that never end, one byte at a time."""
    yield from (bytes([b]) for b in f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\n".encode())
    n = 0
    while True:
        n += 1
        yield from (bytes([b]) for b in f"X-Slow-{n}: {n}\r\n".encode())


# -- attacker bookkeeping ---------------------------------------------------------------------


def _bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


@dataclass
class ConnStats:
    """Slow or idle connections of one kind: what ended them and after how long."""

    opened: int = 0
    connect_errors: int = 0
    #: how each connection ended: a status the server sent ("408"), "closed" (EOF without an
    #: answer), "reset", "open at stop" (still open when the phase ended), "held to cap"
    outcomes: dict[str, int] = field(default_factory=dict)
    #: seconds each connection the server ended was held (from connect, or from the last answer)
    held_s: list[float] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return len(self.held_s)


@dataclass
class AttackStats:
    abandon_rounds: int = 0
    abandon_sent: int = 0
    #: what an abandoned request saw before it hung up ("none": nothing, as intended; a status otherwise)
    abandon_answers: dict[str, int] = field(default_factory=dict)
    abandon_connect_errors: int = 0
    slowloris: ConnStats = field(default_factory=ConnStats)
    idle: ConnStats = field(default_factory=ConnStats)
    keepalive: ConnStats = field(default_factory=ConnStats)
    #: per kind ("content-length", "chunked", "large-allowed"): outcome -> count
    oversized: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per kind: seconds from the request's start to the server's answer
    oversized_answer_s: dict[str, list[float]] = field(default_factory=dict)
    oversize_rounds: int = 0
    #: attacker tasks that raised (a bug here, not the server's answer)
    crashed: list[str] = field(default_factory=list)

    def oversized_outcome(self, kind: str, outcome: str, elapsed: float | None) -> None:
        _bump(self.oversized.setdefault(kind, {}), outcome)
        if elapsed is not None:
            self.oversized_answer_s.setdefault(kind, []).append(round(elapsed, 4))


async def _read_response(reader: asyncio.StreamReader) -> str:
    """A status and the rest of a small Content-Length response (keep-alive's ``GET /health``)."""
    status = await read_status(reader)
    if not status.isdigit():
        return status
    length = 0
    try:
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError):
        return "reset"
    return status


def _close(writer: asyncio.StreamWriter, *, reset: bool = False) -> None:
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


async def _open(
    host: str, port: int, source: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    local = (source, 0) if source else None
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 16, local_addr=local), 5.0
        )
    except (OSError, TimeoutError):
        return None


def _settle(task: asyncio.Future[Any]) -> None:
    """Cancel a helper future and mark its exception retrieved."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class Attack:
    """Every attacker of the abuse phase against one ``host:port``, bounded, stopped by :meth:`stop`."""

    def __init__(
        self, host: str, port: int, s: AbuseSettings, *, headers: str = "", source: str | None = None
    ) -> None:
        """``headers``: lines each request carries (an API key); ``source``: the address to connect from."""
        self.host, self.port, self.s = host, port, s
        self.headers, self.source = headers, source
        self.stats = AttackStats()
        self._stop = asyncio.Event()
        self._stopped: asyncio.Future[Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle

    def start(self) -> None:
        self._stopped = asyncio.ensure_future(self._stop.wait())
        s = self.s
        coros = [self._abandon_flood(), self._oversize_rounds()]
        coros += [self._slowloris_slot(i) for i in range(s.slowloris)]
        coros += [self._idle_slot(self.stats.idle, send_request=False) for _ in range(s.idle)]
        coros += [self._idle_slot(self.stats.keepalive, send_request=True) for _ in range(s.keepalive)]
        self._tasks = [asyncio.create_task(self._guard(c)) for c in coros]

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an attacker's own bug: counted, the run goes on
            self.stats.crashed.append(f"{type(exc).__name__}: {exc}")

    async def stop(self, grace_s: float = 15.0) -> None:
        """Stop every attacker: they close their connections within a slot's interval; stragglers are cancelled."""
        self._stop.set()
        _, pending = await asyncio.wait(self._tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
            self.stats.crashed.append(
                f"{len(pending)} attacker tasks cancelled after the {grace_s:.0f} s grace"
            )

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, or return early when the phase ends."""
        assert self._stopped is not None
        await asyncio.wait({self._stopped}, timeout=seconds)

    # -- abandon flood

    async def _abandon_flood(self) -> None:
        s = self.s
        request = http_request(
            self.host,
            self.port,
            CHAT,
            tiny_chat_body(s.abandon_prompt_tokens, max_tokens=s.abandon_max_tokens),
            self.headers,
        )
        while not self.stopping and self.stats.abandon_rounds < s.abandon_max_rounds:
            reset = self.stats.abandon_rounds % 2 == 1
            self.stats.abandon_rounds += 1
            await asyncio.gather(*(self._abandon_one(request, reset) for _ in range(s.abandon_batch)))
            await self._sleep(s.abandon_interval_s)

    async def _abandon_one(self, request: bytes, reset: bool) -> None:
        conn = await _open(self.host, self.port, self.source)
        if conn is None:
            self.stats.abandon_connect_errors += 1
            return
        reader, writer = conn
        self.stats.abandon_sent += 1
        answer = "none"
        try:
            writer.write(request)
            try:
                answer = await asyncio.wait_for(read_status(reader), self.s.abandon_after_s)
            except TimeoutError:
                pass
        finally:
            _bump(self.stats.abandon_answers, answer)
            _close(writer, reset=reset)

    # -- slow and idle connections

    async def _hold(
        self,
        reader: asyncio.StreamReader,
        stats: ConnStats,
        since: float,
        trickle: Iterator[bytes] | None,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Hold a connection (sending ``trickle`` a byte per interval) until the server ends it; True if it did."""
        assert self._stopped is not None
        interval = self.s.slowloris_interval_s
        answer = asyncio.ensure_future(read_status(reader))
        try:
            while True:
                if trickle is not None and not writer.transport.is_closing():
                    writer.write(next(trickle))
                held = time.perf_counter() - since
                if held >= self.s.hold_cap_s:
                    _bump(stats.outcomes, "held to cap")
                    return False
                wait = interval if trickle is not None else self.s.hold_cap_s - held
                await asyncio.wait({answer, self._stopped}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if answer.done():
                    _bump(stats.outcomes, answer.result())
                    stats.held_s.append(round(time.perf_counter() - since, 3))
                    return True
                if self.stopping:
                    _bump(stats.outcomes, "open at stop")
                    return False
        finally:
            if not answer.done():
                _settle(answer)
            _close(writer)

    async def _slowloris_slot(self, index: int) -> None:
        """One slot: a connection trickling headers; reopened when the server drops it (at most 50 times)."""
        stats = self.stats.slowloris
        await self._sleep(index * 0.002)  # spread the connects a little
        for _ in range(50):
            if self.stopping:
                return
            since = time.perf_counter()  # the server's header clock starts at its accept
            conn = await _open(self.host, self.port, self.source)
            if conn is None:
                stats.connect_errors += 1
                await self._sleep(self.s.slowloris_interval_s)
                continue
            stats.opened += 1
            if not await self._hold(conn[0], stats, since, slow_header_bytes(self.host), conn[1]):
                return

    async def _idle_slot(self, stats: ConnStats, *, send_request: bool) -> None:
        """One connection that sends nothing (or one ``GET /health``, then nothing); reopened when dropped."""
        for _ in range(50):
            if self.stopping:
                return
            # The server's header clock starts when it accepts, before the open
            # completes here (a busy loop may see it much later): time from the connect.
            since = time.perf_counter()
            conn = await _open(self.host, self.port, self.source)
            if conn is None:
                stats.connect_errors += 1
                await self._sleep(self.s.slowloris_interval_s)
                continue
            stats.opened += 1
            reader, writer = conn
            if send_request:
                writer.write(f"GET /health HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
                try:
                    status = await asyncio.wait_for(_read_response(reader), 10.0)
                except TimeoutError:
                    status = "no answer"
                if status != "200":
                    _bump(stats.outcomes, f"health {status}")
                    _close(writer)
                    continue
                since = time.perf_counter()  # the keep-alive clock starts with the answer
            if not await self._hold(reader, stats, since, None, writer):
                return

    # -- oversized bodies

    async def _oversize_rounds(self) -> None:
        s = self.s
        large = large_body(s.large_allowed_bytes) if s.large_allowed else b""
        while not self.stopping and self.stats.oversize_rounds < s.oversize_rounds:
            self.stats.oversize_rounds += 1
            await asyncio.gather(
                *(self._oversized_content_length() for _ in range(s.oversize_content_length)),
                *(self._oversized_chunked() for _ in range(s.oversize_chunked)),
                *(self._large_allowed(large) for _ in range(s.large_allowed)),
            )
            await self._sleep(s.oversize_interval_s)

    async def _oversized_content_length(self) -> None:
        """Content-Length one byte past the limit, then the first 64 KiB: 413 before the body is read."""
        kind = "content-length"
        t0 = time.perf_counter()
        conn = await _open(self.host, self.port, self.source)
        if conn is None:
            self.stats.oversized_outcome(kind, "connect error", None)
            return
        reader, writer = conn
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {self.s.max_body_bytes + 1}\r\n\r\n"
        ).encode()
        try:
            writer.write(head + b'{"messages": "' + b"a" * (64 << 10))
            try:
                status = await asyncio.wait_for(read_status(reader), 10.0)
            except TimeoutError:
                status = "no answer"
            self.stats.oversized_outcome(kind, status, time.perf_counter() - t0)
        finally:
            _close(writer)

    async def _oversized_chunked(self) -> None:
        """A chunked body sent 1 MiB a chunk up to the limit plus 2 MiB: 413 once it passes the limit."""
        kind = "chunked"
        t0 = time.perf_counter()
        conn = await _open(self.host, self.port, self.source)
        if conn is None:
            self.stats.oversized_outcome(kind, "connect error", None)
            return
        reader, writer = conn
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        chunk = b"%x\r\n" % CHUNK + b"a" * CHUNK + b"\r\n"
        answer = asyncio.ensure_future(read_status(reader))
        sent = 0
        try:
            writer.write(head)
            while sent <= self.s.max_body_bytes + 2 * CHUNK and not answer.done():
                writer.write(chunk)
                sent += CHUNK
                drain = asyncio.ensure_future(writer.drain())
                await asyncio.wait({drain, answer}, timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
                if not drain.done():
                    _settle(drain)
                    if not answer.done():
                        break  # the server stopped reading and said nothing
                elif drain.exception() is not None:
                    break  # reset while sending
            try:
                status = await asyncio.wait_for(asyncio.shield(answer), 10.0)
            except TimeoutError:
                status = "no answer"
            self.stats.oversized_outcome(kind, status, time.perf_counter() - t0)
        finally:
            if not answer.done():
                _settle(answer)
            _close(writer)

    async def _large_allowed(self, body: bytes) -> None:
        """A valid chat request of several MB, under the limit: the orchestrator relays it, the worker refuses it."""
        kind = "large-allowed"
        t0 = time.perf_counter()
        conn = await _open(self.host, self.port, self.source)
        if conn is None:
            self.stats.oversized_outcome(kind, "connect error", None)
            return
        reader, writer = conn
        try:
            writer.write(http_request(self.host, self.port, CHAT, body, self.headers))
            try:
                status = await asyncio.wait_for(read_status(reader), 60.0)
            except TimeoutError:
                status = "no answer"
            self.stats.oversized_outcome(kind, status, time.perf_counter() - t0)
        finally:
            _close(writer)


# -- the deployment ---------------------------------------------------------------------------


def _three_free_ports() -> tuple[int, int]:
    """(orchestrator port, first of two consecutive free worker ports)."""
    for _ in range(50):
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        port = free_port()
        if port not in (base, base + 1):
            return port, base
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@dataclass
class UpDeployment:
    """The processes ``fastcore-serve up`` starts (``server.launcher.plan``), on free ports of 127.0.0.1.

    ``bench.deploy.Deployment`` starts synthetic workers; this one runs the
    torch workers on ``tiny`` (the model whose context legs take time and hold
    KV), with the orchestrator's client limits from ``limits`` (YAML keys of
    ``OrchestratorConfig``) through a config file, flags as ``up`` sets them.
    """

    model: str = "tiny"
    limits: dict[str, Any] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    port: int = 0
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def child(self, prefix: str) -> Child:
        return next(c for c in self.children if c.name.startswith(prefix))

    def start(self) -> UpDeployment:
        self.port, base = _three_free_ports()
        parser = argparse.ArgumentParser()
        add_launcher_arguments(parser)
        args = parser.parse_args(
            ["--model", self.model, "--port", str(self.port), "--worker-base-port", str(base)]
        )
        self.children = plan(args)
        self._tmp = tempfile.TemporaryDirectory(prefix="fastcore-abuse-")
        config = Path(self._tmp.name) / "orchestrator.yaml"
        config.write_text(yaml.safe_dump(dict(self.limits)))
        self.child("orchestrator").argv += ["-c", str(config), "--log-level", "WARNING"]
        env = import_path_env(dict(os.environ))  # the children import this checkout, as up's do
        env.setdefault(SHARED_SECRET_ENV, secrets.token_hex(32))
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            for c in self.children:
                c.start(env)
            for c in self.children:
                wait_healthy(f"http://127.0.0.1:{c.port}/health", self.children)
        except BaseException:
            self.stop()
            raise
        return self

    def rss(self) -> dict[str, int]:
        """RSS in bytes per child (its process tree), 0 for one that is gone."""
        out = {}
        for c in self.children:
            total = 0
            if c.proc is not None and c.exit_code is None:
                for pid in process_tree(c.proc.pid):
                    try:
                        total += rss_bytes(pid)
                    except OSError:
                        pass
            out[c.name] = total
        return out

    def stop(self) -> None:
        stop_all(self.children, grace_s=10.0)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> UpDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: the counters whose per-phase increase the report shows (each process has the ones of its kind)
COUNTERS = (
    "fastcore_orchestrator_requests_total",
    "fastcore_worker_requests_total",
    "fastcore_worker_rejected_total",
    "fastcore_worker_kv_handoff_total",
    "fastcore_worker_kv_fetch_failures_total",
)


def scrape(url: str) -> dict[str, float] | None:
    """Every sample of a Prometheus /metrics page (``name{labels}`` -> value), None when unreadable."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                samples[key] = float(value)
            except ValueError:
                pass
    return samples


def metric(url: str, name: str) -> float | None:
    """One unlabelled sample from a /metrics page, None when it cannot be read."""
    return (scrape(url) or {}).get(name)


def counters(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per process, the samples of :data:`COUNTERS` (the ``_created`` samples left out)."""
    out = {}
    for name, url in urls.items():
        samples = scrape(url) or {}
        out[name] = {k: v for k, v in samples.items() if k.split("{")[0] in COUNTERS}
    return out


def counter_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per process, how much each counter grew (the ones that did)."""
    out: dict[str, dict[str, float]] = {}
    for name, samples in after.items():
        grew = {k: v - before.get(name, {}).get(k, 0.0) for k, v in samples.items()}
        out[name] = {k: d for k, d in grew.items() if d}
    return out


# -- the run ----------------------------------------------------------------------------------


@dataclass
class AbuseRun:
    clean: LevelResult
    abuse: LevelResult
    attack: AttackStats
    settings: AbuseSettings
    rss: dict[str, dict[str, int]] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)
    orchestrator_metrics: dict[str, float | None] = field(default_factory=dict)
    #: per phase, per process: how much each of :data:`COUNTERS` grew
    counters: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


async def _sample_kv(url: str | None, stop: asyncio.Event, samples: list[float]) -> None:
    while url and not stop.is_set():
        value = await asyncio.to_thread(metric, url, "fastcore_worker_kv_used_tokens")
        if value is not None:
            samples.append(value)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def run_abuse(
    base_url: str,
    s: AbuseSettings,
    *,
    worker_metrics: dict[str, str] | None = None,
    dep: UpDeployment | None = None,
    model: str = "tiny",
) -> AbuseRun:
    """Warm up, the clean phase, then the abuse phase; the KV left on the context worker at the end.

    ``worker_metrics``: the workers' /metrics URLs by name (``context worker ...`` is the KV gauge's).
    """
    metrics_urls = {"orchestrator": base_url.rstrip("/") + "/metrics", **(worker_metrics or {})}
    kv_url = next((u for n, u in metrics_urls.items() if n.startswith("context")), None)
    url = base_url.rstrip("/") + CHAT
    host_port = base_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    body = tiny_chat_body(s.prompt_tokens, max_tokens=s.max_tokens, model=model)
    rss: dict[str, dict[str, int]] = {}

    await run_concurrency(url, body, 2, max_requests=8, max_seconds=30, timeout=s.timeout, label="warm-up")
    if dep:
        rss["before"] = dep.rss()
    snapshots = [await asyncio.to_thread(counters, metrics_urls)]
    clean = await run_concurrency(
        url,
        body,
        s.concurrency,
        max_requests=s.requests,
        max_seconds=s.max_seconds,
        timeout=s.timeout,
        label="clean",
    )
    if dep:
        rss["after clean"] = dep.rss()
    snapshots.append(await asyncio.to_thread(counters, metrics_urls))

    attack = Attack(host, int(port), s)
    kv_stop, kv_samples = asyncio.Event(), list[float]()
    sampler = asyncio.create_task(_sample_kv(kv_url, kv_stop, kv_samples))
    attack.start()
    await asyncio.sleep(0.5)  # slow connections open, the first abandon round in flight
    t0 = time.perf_counter()
    abuse = await run_concurrency(
        url,
        body,
        s.concurrency,
        max_requests=s.requests,
        max_seconds=s.max_seconds,
        timeout=s.timeout,
        label="abuse",
    )
    left = s.min_window_s - (time.perf_counter() - t0)
    if left > 0:
        await asyncio.sleep(left)
    if dep:
        rss["end of abuse"] = dep.rss()
    await attack.stop()
    kv_stop.set()
    await sampler

    kv: dict[str, Any] = {"peak_during_abuse": max(kv_samples, default=None)}
    if kv_url:
        kv["after_abuse"] = metric(kv_url, "fastcore_worker_kv_used_tokens")
        t1 = time.perf_counter()
        value = kv["after_abuse"]
        while value and time.perf_counter() - t1 < s.kv_settle_s:
            await asyncio.sleep(0.5)
            value = metric(kv_url, "fastcore_worker_kv_used_tokens")
        kv["at_end"] = value
        kv["settle_s"] = round(time.perf_counter() - t1, 1)
        samples = scrape(kv_url) or {}
        # what is left in parked entries: context legs whose generation leg never came (KV TTL frees them)
        kv["parked_at_end"] = samples.get("fastcore_worker_kv_parked")
        kv["parked_tokens_at_end"] = samples.get("fastcore_worker_kv_parked_tokens")
        kv["capacity"] = samples.get("fastcore_worker_kv_capacity_tokens")
    if dep:
        rss["at end"] = dep.rss()
    snapshots.append(await asyncio.to_thread(counters, metrics_urls))
    phases = {
        "clean": counter_deltas(snapshots[0], snapshots[1]),
        "abuse": counter_deltas(snapshots[1], snapshots[2]),
    }
    orch_samples = scrape(metrics_urls["orchestrator"]) or {}
    orch = {
        name: orch_samples.get(name)
        for name in (
            "fastcore_orchestrator_client_connections",
            "fastcore_orchestrator_http_framing_errors_total",
            "fastcore_orchestrator_connections_refused_total",
        )
    }
    return AbuseRun(clean, abuse, attack.stats, s, rss, kv, orch, phases)


# -- the report -------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def phase_table(clean: LevelResult, abuse: LevelResult) -> str:
    """Per phase: honest requests, errors, timeouts, TTFT and latency p50/p99; then abuse/clean."""
    headers = [
        "phase",
        "honest reqs",
        "errors",
        "timeouts",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "E2E p50 ms",
        "E2E p99 ms",
    ]
    rows: list[list[Any]] = [
        [lv.label, lv.requests, lv.errors, lv.timeouts, lv.ttft_p50_ms, lv.ttft_p99_ms,
         lv.latency_p50_ms, lv.latency_p99_ms]
        for lv in (clean, abuse)
    ]  # fmt: skip
    rows.append(
        [
            "abuse/clean",
            "",
            "",
            "",
            _ratio(abuse.ttft_p50_ms, clean.ttft_p50_ms),
            _ratio(abuse.ttft_p99_ms, clean.ttft_p99_ms),
            _ratio(abuse.latency_p50_ms, clean.latency_p50_ms),
            _ratio(abuse.latency_p99_ms, clean.latency_p99_ms),
        ]
    )
    return format_table(headers, rows)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def _held(c: ConnStats) -> str:
    if not c.held_s:
        return "none dropped"
    return (
        f"{c.dropped} dropped after p50 {percentile(c.held_s, 50):.1f} s "
        f"(min {min(c.held_s):.1f}, max {max(c.held_s):.1f})"
    )


def attacker_summary(run: AbuseRun) -> str:
    a, s = run.attack, run.settings
    lines = [
        f"abandon flood: {a.abandon_rounds} rounds x {s.abandon_batch}, {a.abandon_sent} sent "
        f"({s.abandon_prompt_tokens}-token prompts, hung up after {s.abandon_after_s * 1000:.0f} ms); "
        f"seen before hanging up: {_counts(a.abandon_answers)}; connect errors {a.abandon_connect_errors}",
    ]
    for name, c, what in (
        ("slowloris", a.slowloris, f"headers 1 byte / {s.slowloris_interval_s} s"),
        ("idle", a.idle, "nothing sent"),
        ("keep-alive", a.keepalive, "one GET /health, then nothing"),
    ):
        lines.append(
            f"{name} ({what}): {c.opened} opened, {_held(c)}; ended by: {_counts(c.outcomes)}"
            + (f"; connect errors {c.connect_errors}" if c.connect_errors else "")
        )
    lines.append(
        f"  server limits assumed: header timeout {s.header_timeout_s:g} s, keep-alive "
        f"{s.keepalive_timeout_s:g} s, body {s.max_body_bytes:,} B"
    )
    for kind, what in (
        ("content-length", f"Content-Length {s.max_body_bytes + 1:,}"),
        ("chunked", "chunked past the limit"),
        ("large-allowed", f"{s.large_allowed_bytes / 2**20:.0f} MiB valid JSON"),
    ):
        times = a.oversized_answer_s.get(kind, [])
        p50 = percentile(times, 50)
        when = f", answered in p50 {p50 * 1000:.0f} ms / max {max(times) * 1000:.0f} ms" if p50 else ""
        lines.append(f"oversized {kind} ({what}): {_counts(a.oversized.get(kind, {}))}{when}")
    if run.rss:
        names = list(next(iter(run.rss.values())))
        lines.append(
            "RSS MiB: "
            + "; ".join(
                f"{n}: " + " -> ".join(f"{r.get(n, 0) / 2**20:.0f}" for r in run.rss.values()) for n in names
            )
            + f"  ({' -> '.join(run.rss)})"
        )
    if run.kv:
        lines.append(
            "context worker fastcore_worker_kv_used_tokens: "
            + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in run.kv.items())
        )
    if run.orchestrator_metrics:
        lines.append(
            "orchestrator at end: "
            + ", ".join(
                f"{k.removeprefix('fastcore_orchestrator_')} {v:g}"
                for k, v in run.orchestrator_metrics.items()
                if v is not None
            )
        )
    for proc, grew in run.counters.get("abuse", {}).items():
        if grew:
            lines.append(
                f"{proc} counters, abuse phase (+ warm-down): "
                + ", ".join(
                    f"{k.removeprefix('fastcore_').replace(chr(34), '')} +{v:g}"
                    for k, v in sorted(grew.items())
                )
            )
    if a.crashed:
        lines.append(f"attacker errors (bench bugs): {len(a.crashed)}: {a.crashed[:3]}")
    return "\n".join(lines)


def report(run: AbuseRun) -> str:
    lines = [phase_table(run.clean, run.abuse), "", attacker_summary(run)]
    for lv in (run.clean, run.abuse):
        for sample in lv.error_samples:
            lines.append(f"  {lv.label} error sample: {sample[:200]}")
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """The abandon/slowloris/oversize run and issue 19's HTTP phases: 1 if an honest request failed
    (``bench.load --abuse`` runs bench/abuse_tenants.py's phases after these)."""
    return _main_clients(args)


def _main_clients(args: argparse.Namespace) -> int:
    """The abandon/slowloris/oversize run and issue 19's HTTP phases: 1 if an honest request failed."""
    s = settings_from_args(args)
    from server.cli import raise_open_file_limit

    raise_open_file_limit()  # several hundred attacker sockets beside the honest clients
    dep: UpDeployment | None = None
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the deployment as Ctrl-C does
    max_connections = DEFAULTS.max_client_connections
    try:
        if args.url:
            ctx = args.context_metrics
            workers = {"context worker": ctx.rstrip("/") + "/metrics"} if ctx else {}
            run = asyncio.run(run_abuse(args.url, s, worker_metrics=workers, model=args.model))
            http = _http_phases(args, s, args.url, lambda: 0, max_connections)
        else:
            limits: dict[str, Any] = dict(QUICK_LIMITS) if args.quick else {}
            if args.quick:
                max_connections = limits["max_client_connections"] = QUICK_MAX_CONNECTIONS
            dep = UpDeployment(model=args.model, limits=limits).start()
            workers = {
                c.name: f"http://127.0.0.1:{c.port}/metrics" for c in dep.children if "worker" in c.name
            }
            run = asyncio.run(run_abuse(dep.url, s, worker_metrics=workers, dep=dep, model=args.model))
            http = _http_phases(args, s, dep.url, _rss_of(dep.child("orchestrator")), max_connections)
    finally:
        if dep is not None:
            dep.stop()
        signal.signal(signal.SIGTERM, previous)
    print(report(run))
    phases, checks, http_settings = http
    print("\nHTTP layer (issue 19): honest load from 127.0.0.1, each attack from 127.0.0.2\n")
    print(abuse_http.phase_table(phases))
    print(abuse_http.outcomes_text(phases, checks))
    out = args.output or RESULTS_DIR / ("abuse_quick.json" if args.quick else "abuse.json")
    write_json(
        [run.clean, run.abuse],
        out,
        {
            "url": args.url or "own deployment (fastcore-serve up, tiny)",
            "settings": asdict(s),
            "attack": asdict(run.attack),
            "rss": run.rss,
            "kv": run.kv,
            "orchestrator_metrics": run.orchestrator_metrics,
            "counters": run.counters,
            "http_phases": abuse_http.to_json(phases, checks, http_settings),
            "http_max_connections": max_connections,
        },
    )
    print(f"\nresults: {out}")
    honest_ok = all(p.success >= abuse_http.MIN_SUCCESS for p in phases)
    return 1 if run.clean.errors or run.abuse.errors or not honest_ok else 0


def _rss_of(child: Child) -> Any:
    """The RSS of ``child``'s process tree (its pids read once), for the HTTP phases' samples."""
    pids = process_tree(child.proc.pid) if child.proc is not None else []

    def rss() -> int:
        total = 0
        for pid in pids:
            try:
                total += rss_bytes(pid)
            except OSError:
                pass
        return total

    return rss


def _http_phases(
    args: argparse.Namespace, s: AbuseSettings, url: str, rss: Any, max_connections: int
) -> tuple[list[abuse_http.PhaseResult], dict[str, str], Any]:
    """Issue 19's phases (bench/abuse_http.py) against ``url``, after the abandon/slowloris/oversize run."""
    hs = (
        abuse_http.HTTPAbuseSettings.quick()
        if args.quick
        else abuse_http.HTTPAbuseSettings.full(s.max_body_bytes)
    )
    body = tiny_chat_body(s.prompt_tokens, max_tokens=s.max_tokens, model=args.model)

    async def both() -> tuple[list[abuse_http.PhaseResult], dict[str, str]]:
        phases = await abuse_http.run_phases(
            url,
            body,
            concurrency=s.concurrency,
            timeout=s.timeout,
            s=hs,
            rss=rss,
            max_body_bytes=s.max_body_bytes,
            max_connections=max_connections,
        )
        return phases, await abuse_http.framing_checks(url)

    phases, checks = asyncio.run(both())
    return phases, checks, hs


__all__ = ["AbuseRun", "AbuseSettings", "Attack", "AttackStats", "UpDeployment", "main", "run_abuse"]
