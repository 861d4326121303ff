"""``python -m bench.load --abuse``, third part: what one tenant's clients cost another (issue 36).

Its own deployment (``bench.abuse.UpDeployment``: ``fastcore-serve up`` on tiny) with API keys
(an ``honest`` tenant and three attacker tenants, ``attacker``, ``attacker-2`` and ``attacker-3``,
the first two held to ``prompt_tokens_per_minute``; weight 1 each), admission on (``max_inflight``, a queue) and a
``request_timeout_s`` under tiny's longest decode (2,048 positions at about 1 ms a token), so that
a request's own length can outlast it. Three phases of the same honest closed loop (streaming
chats with the honest tenant's key):

- clean: the honest clients alone;
- mix 3/5/6: beside the attacks of issue 36's items 3, 5 and 6 alone (below);
- mix: beside an attacker process pinned to a core of its own (``os.sched_setaffinity``; the
  honest clients and the deployment on the other cores), which runs all at once, each attacker
  bounded in count and time, from 127.0.0.3 (items 3, 5, 6) and 127.0.0.2 (the existing
  attacks), other clients than the honest 127.0.0.1:

  - breaker (issue 36 item 3, tenant ``attacker``): every ``breaker_interval_s`` a unary request
    whose ``max_tokens`` decode outlasts ``request_timeout_s`` (a 504 that opened the generation
    worker's breaker, and every other client got ``503 no_healthy_worker``);
  - priority (item 5, ``attacker``): closed-loop streaming clients claiming ``priority: -2**63``;
  - token limits (item 6): bodies padded with JSON whitespace inside ``messages``
    (``attacker-3``: the learned bytes per token pushed up, so every tenant's prompts are
    estimated smaller) beside a flood of long prompts that only the limit holds back
    (``attacker``); a request larger than a minute of the limit, sent first, while
    ``attacker-2``'s bucket is full;
  - the existing attacks (``attacker-2``'s key where they send one): ``bench.abuse.Attack``'s
    (abandon flood, slowloris, idle and idle keep-alive connections, oversized bodies) and
    ``bench.abuse_http``'s trailers and body hold.

The report: per phase the honest requests' success, TTFT and E2E p50/p99 and the ratios to
clean, the verdict of each mix against issue 36's targets (success >= 95%, TTFT p99 <= 2x clean), what
each attacker got (statuses with their error codes), and the orchestrator's counters over the
mix (breaker openings, per-tenant admissions and refusals, the learned bytes per token) and the
admission slots still held once every client is gone (a slot lost for good shrinks
``max_inflight`` for everyone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import abuse_http
from bench._timing import format_table
from bench.loadgen import RESULTS_DIR, LevelResult, RequestResult, one_request, run_concurrency, write_json

CHAT = "/v1/chat/completions"
HONEST_KEY, ATTACKER_KEY = "honest-key-36", "attacker-key-36"
#: more attacker tenants, each with its own token bucket: the over-a-minute request first, then
#: the existing attacks (``attacker-2``); the whitespace padding (``attacker-3``). From one tenant
#: each would find the bucket emptied by the others and be refused for that, not for what it is.
BIG_KEY, PAD_KEY = "attacker-2-key-36", "attacker-3-key-36"
ATTACKER_TENANTS = ("attacker", "attacker-2", "attacker-3")
#: the tenants held to prompt_tokens_per_minute: not the padding's, whose own limit is not the
#: point (it moves the bytes per token every tenant's prompts are counted in; limited, it would
#: get a body or two through a minute, each weighed against ~100 honest answers); its prompts are
#: short (600 tokens), so that what it costs the workers is small beside what it moves
LIMITED_TENANTS = ATTACKER_TENANTS[:2]
#: the address the tenant attacks (items 3, 5, 6) come from; the existing attacks come from
#: abuse_http.ATTACKER_IP: from one address the existing attacks' hundreds of held connections
#: would have the HTTP layer's per-address share refuse these (429) before any tenant rule is met
TENANT_ATTACKER_IP = "127.0.0.3"
#: the lowest priority a client can claim (vLLM's field; the orchestrator bounds it to int64)
MIN_PRIORITY = -(1 << 63)
#: issue 36's targets for the honest tenant under the mix
MIN_SUCCESS = 0.95
MAX_TTFT_P99_RATIO = 2.0
#: tiny's context (server/worker/tiny.py: max_position_embeddings); a leg past it is refused 400
TINY_CONTEXT = 2048
#: the orchestrator's counters whose growth over the mix the report shows (and one gauge)
MIX_COUNTERS = (
    "fastcore_orchestrator_circuit_opened_total",
    "fastcore_orchestrator_tenant_admitted_total",
    "fastcore_orchestrator_tenant_rejected_total",
    "fastcore_orchestrator_requests_total",
)
BYTES_PER_TOKEN = "fastcore_orchestrator_bytes_per_token"
#: slots held with nothing left in flight: each is one lost for good (a slot granted to a request
#: that had left, never given back), and max_inflight is that much smaller for everyone
INFLIGHT = "fastcore_orchestrator_admission_inflight"
#: how long after the mix the slots may take to come back (the breaker's decode ends at request_timeout_s)
IDLE_SETTLE_S = 10.0


@dataclass
class TenantAbuseSettings:
    """One run's sizes; ``full()`` and ``quick()`` are the presets."""

    phase_s: float
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    timeout: float
    #: the deployment
    request_timeout_s: float
    max_inflight: int
    max_queue: int
    max_queue_wait_s: float
    attacker_prompt_tokens_per_minute: int
    #: item 3: a unary request that decodes past request_timeout_s, one per interval
    breaker_interval_s: float
    breaker_prompt_tokens: int
    #: item 5: closed-loop clients claiming MIN_PRIORITY
    priority_clients: int
    priority_prompt_tokens: int
    priority_max_tokens: int
    #: item 6: one request past a minute's prompt tokens per interval; padded bodies (whitespace
    #: making each body pad_bytes_per_token bytes per prompt token); a flood of long prompts
    over_minute_interval_s: float
    pad_interval_s: float
    pad_prompt_tokens: int
    pad_bytes_per_token: int
    flood_clients: int
    flood_prompt_tokens: int
    #: the existing attacks beside them (bench.abuse.Attack, bench.abuse_http's kinds)
    existing: bool = True
    http_kinds: tuple[str, ...] = ("trailers", "body hold")
    #: every attacker loop's bound in requests (besides the phase's end)
    max_requests_per_loop: int = 2000

    @classmethod
    def full(cls) -> TenantAbuseSettings:
        return cls(
            phase_s=15.0, concurrency=4, prompt_tokens=300, max_tokens=16, timeout=15.0,
            request_timeout_s=1.5, max_inflight=20, max_queue=64, max_queue_wait_s=5.0,
            attacker_prompt_tokens_per_minute=120_000,
            breaker_interval_s=3.0, breaker_prompt_tokens=40,
            priority_clients=3, priority_prompt_tokens=300, priority_max_tokens=16,
            over_minute_interval_s=5.0, pad_interval_s=0.25, pad_prompt_tokens=600, pad_bytes_per_token=60,
            flood_clients=4, flood_prompt_tokens=1800,
        )  # fmt: skip

    @classmethod
    def quick(cls) -> TenantAbuseSettings:
        return cls(
            phase_s=6.0, concurrency=4, prompt_tokens=200, max_tokens=8, timeout=10.0,
            request_timeout_s=1.5, max_inflight=20, max_queue=32, max_queue_wait_s=3.0,
            attacker_prompt_tokens_per_minute=120_000,
            breaker_interval_s=2.0, breaker_prompt_tokens=40,
            priority_clients=2, priority_prompt_tokens=200, priority_max_tokens=8,
            over_minute_interval_s=3.0, pad_interval_s=0.25, pad_prompt_tokens=600, pad_bytes_per_token=60,
            flood_clients=2, flood_prompt_tokens=1800,
        )  # fmt: skip

    @property
    def breaker_max_tokens(self) -> int:
        """As many as tiny's context leaves (a chat template's ~20 tokens and a margin aside)."""
        return TINY_CONTEXT - self.breaker_prompt_tokens - 64

    @property
    def over_minute_bytes(self) -> int:
        """A prompt past a minute's budget at any bytes per token up to 4 (the default), by 25%."""
        return int(self.attacker_prompt_tokens_per_minute * 4 * 1.25)


def deployment_config(s: TenantAbuseSettings, keys_file: str) -> dict[str, Any]:
    """The orchestrator's YAML keys of this part: keys, admission with the attacker's limit, the timeout."""
    return {
        "api_keys_file": keys_file,
        "request_timeout_s": s.request_timeout_s,
        "admission": {
            "max_inflight": s.max_inflight,
            "max_queue": s.max_queue,
            "max_queue_wait_s": s.max_queue_wait_s,
            "rate_limits": {
                name: {"prompt_tokens_per_minute": s.attacker_prompt_tokens_per_minute}
                for name in LIMITED_TENANTS
            },
        },
    }


def write_keys_file(directory: str) -> str:
    """``api_keys_file`` (server/orchestrator/tenants.py: ``<key> <tenant> [weight]``), all weight 1."""
    path = Path(directory) / "api_keys"
    keys = (HONEST_KEY, ATTACKER_KEY, BIG_KEY, PAD_KEY)
    path.write_text(
        "".join(f"{key} {tenant} 1\n" for key, tenant in zip(keys, ("honest", *ATTACKER_TENANTS)))
    )
    path.chmod(0o600)
    return str(path)


# -- bodies -----------------------------------------------------------------------------------


def chat_body(
    prompt_tokens: int,
    *,
    max_tokens: int,
    stream: bool,
    model: str = "tiny",
    priority: int | None = None,
    pad_bytes: int = 0,
) -> bytes:
    """bench.abuse's tiny chat, with a claimed ``priority`` and ``pad_bytes`` of JSON whitespace
    inside ``messages`` (valid JSON, the same prompt: only the body's bytes grow)."""
    from bench.abuse import tiny_chat_body

    body = json.loads(tiny_chat_body(prompt_tokens, max_tokens=max_tokens, model=model, stream=stream))
    if priority is not None:
        body["priority"] = priority
    text = json.dumps(body).encode()
    if pad_bytes:
        at = text.index(b'"messages": [') + len(b'"messages": [')
        text = text[:at] + b" \n\t\r" * (pad_bytes // 4) + text[at:]
    return text


def padded_body(s: TenantAbuseSettings, model: str = "tiny") -> bytes:
    plain = chat_body(s.pad_prompt_tokens, max_tokens=1, stream=False, model=model)
    return chat_body(
        s.pad_prompt_tokens,
        max_tokens=1,
        stream=False,
        model=model,
        pad_bytes=max(0, s.pad_bytes_per_token * s.pad_prompt_tokens - len(plain)),
    )


# -- what an answer was -------------------------------------------------------------------------

_CODE = re.compile(rb'"code": *"([A-Za-z0-9_.-]{1,64})"')
_HONEST_ERROR = re.compile(r"HTTP (\d{3}): .*?\"code\": *\"([A-Za-z0-9_.-]{1,64})\"")


def outcome(status: int, body: bytes) -> str:
    """``"503 no_healthy_worker"``: the status and the error's code (an error event in a 200 stream too)."""
    found = _CODE.search(body[:4096] if status != 200 else body[-4096:])
    if status == 200:
        return "200 stream error " + found.group(1).decode() if found and b'"error"' in body else "200"
    return f"{status} {found.group(1).decode()}" if found else str(status)


def honest_error_kind(r: RequestResult) -> str:
    """An honest request's failure as ``outcome`` names it (``"timeout"``, ``"503 no_healthy_worker"``)."""
    if r.timed_out:
        return "timeout"
    text = r.error or ""
    found = _HONEST_ERROR.match(text)
    if found:
        return f"{found.group(1)} {found.group(2)}"
    return text.split(":")[0][:40] or "error"


# -- the attacker process -------------------------------------------------------------------------
#
# The attackers run in a process of their own, pinned to a core the deployment and the honest
# clients do not use: what they cost is the server's work for them, not the bench's.


def _bump(outcomes: dict[str, dict[str, int]], kind: str, what: str) -> None:
    counts = outcomes.setdefault(kind, {})
    counts[what] = counts.get(what, 0) + 1


class TenantAttacks:
    """Items 3, 5 and 6's attackers with the attacker tenants' keys, each a bounded loop until :meth:`stop`."""

    def __init__(self, base_url: str, s: TenantAbuseSettings, model: str = "tiny") -> None:
        self.url = base_url.rstrip("/") + CHAT
        self.s, self.model = s, model
        self.outcomes: dict[str, dict[str, int]] = {}
        #: seconds each breaker request took to be answered
        self.breaker_s: list[float] = []
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        #: per API key, a session from the attacker's address carrying it
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def start(self) -> None:
        s, m = self.s, self.model
        self._sessions = {
            key: aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, local_addr=(TENANT_ATTACKER_IP, 0)),
                timeout=aiohttp.ClientTimeout(total=None),
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
            for key in (ATTACKER_KEY, BIG_KEY, PAD_KEY)
        }
        breaker = chat_body(s.breaker_prompt_tokens, max_tokens=s.breaker_max_tokens, stream=False, model=m)
        priority = chat_body(
            s.priority_prompt_tokens,
            max_tokens=s.priority_max_tokens,
            stream=True,
            model=m,
            priority=MIN_PRIORITY,
        )
        over = chat_body(s.over_minute_bytes, max_tokens=1, stream=False, model=m)
        flood = chat_body(s.flood_prompt_tokens, max_tokens=4, stream=False, model=m)
        loops = [
            self._every("breaker", breaker, s.breaker_interval_s),
            self._every("over a minute's tokens", over, s.over_minute_interval_s, key=BIG_KEY),
            self._every("whitespace-padded", padded_body(s, m), s.pad_interval_s, key=PAD_KEY),
            *(self._closed_loop("priority -2^63", priority) for _ in range(s.priority_clients)),
            *(self._closed_loop("long-prompt flood", flood) for _ in range(s.flood_clients)),
        ]
        self._tasks = [asyncio.ensure_future(loop) for loop in loops]

    async def stop(self) -> None:
        self.stopping.set()
        _, pending = await asyncio.wait(self._tasks, timeout=self.s.timeout + 5) if self._tasks else ((), ())
        for task in pending:
            task.cancel()
            _bump(self.outcomes, "attacker", "cancelled at stop")
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        for session in self._sessions.values():
            await session.close()

    async def _ask(self, kind: str, body: bytes, key: str = ATTACKER_KEY) -> float:
        """One request; its outcome counted; the Retry-After a refusal asked for (0 otherwise)."""
        session = self._sessions[key]
        t0 = time.perf_counter()
        retry = 0.0
        try:
            async with asyncio.timeout(self.s.timeout):
                async with session.post(self.url, data=body) as resp:
                    data = await resp.read()
                    what = outcome(resp.status, data)
                    with contextlib.suppress(ValueError):
                        retry = float(resp.headers.get("Retry-After", "0"))
        except TimeoutError:
            what = "no answer"
        except (aiohttp.ClientError, ConnectionError) as exc:
            what = type(exc).__name__
        _bump(self.outcomes, kind, what)
        if kind == "breaker":
            self.breaker_s.append(round(time.perf_counter() - t0, 3))
        return retry

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _every(self, kind: str, body: bytes, interval: float, key: str = ATTACKER_KEY) -> None:
        """One request every ``interval`` (not waiting for the last: a request may outlast it)."""
        inflight: set[asyncio.Task[float]] = set()
        for _ in range(self.s.max_requests_per_loop):
            if self.stopping.is_set():
                break
            task = asyncio.ensure_future(self._ask(kind, body, key))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            await self._pause(interval)
        if inflight:
            await asyncio.wait(inflight)

    async def _closed_loop(self, kind: str, body: bytes) -> None:
        """The next request as soon as the last is answered; a refusal's Retry-After kept, up to 1 s."""
        for _ in range(self.s.max_requests_per_loop):
            if self.stopping.is_set():
                break
            retry = await self._ask(kind, body)
            if retry:
                await self._pause(min(retry, 1.0))


def _pin(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


async def _attacker_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Every attacker of the mix until the parent closes our stdin or ``max_s`` passes."""
    from bench.abuse import AbuseSettings, Attack

    s = TenantAbuseSettings(**{**spec["settings"], "http_kinds": tuple(spec["settings"]["http_kinds"])})
    url, host, port = spec["url"], spec["host"], spec["port"]
    tenants = TenantAttacks(url, s, spec["model"])
    tenants.start()
    await asyncio.sleep(0.5)  # the over-a-minute request first, while its tenant's bucket is full
    existing: Attack | None = None
    http: abuse_http.Attacks | None = None
    if s.existing:
        existing = Attack(
            host,
            port,
            AbuseSettings(**spec["abuse_settings"]),
            headers=f"Authorization: Bearer {BIG_KEY}\r\n",
            source=abuse_http.ATTACKER_IP,
        )
        existing.start()
        if s.http_kinds:
            hs = abuse_http.HTTPAbuseSettings(**spec["http_settings"])
            http = abuse_http.Attacks(
                host, port, hs, max_body_bytes=spec["max_body_bytes"], max_connections=spec["max_connections"]
            )
            http.start(*s.http_kinds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.to_thread(sys.stdin.read), spec["max_s"])
    await tenants.stop()
    out: dict[str, Any] = {"tenants": tenants.outcomes, "breaker_s": tenants.breaker_s}
    if existing is not None:
        await existing.stop()
        out["existing"] = asdict(existing.stats)
    if http is not None:
        await http.stop()
        out["http"] = http.outcomes
    return out


async def _start_attacker(spec: dict[str, Any]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.abuse_tenants", json.dumps(spec),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _stop_attacker(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """Close its stdin (the stop signal); what it got, the JSON it prints as it ends."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        out = await asyncio.wait_for(proc.stdout.read(), 60)
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"tenants": {"attacker": {"killed: did not stop within 60 s": 1}}}
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"tenants": {"attacker": {f"exit {proc.returncode}, no outcomes": 1}}}


# -- cores ------------------------------------------------------------------------------------


def split_cores(allowed: set[int]) -> tuple[int | None, set[int]]:
    """(the attacker's core, the rest for the deployment and the honest clients); no split on one core."""
    cores = sorted(allowed)
    if len(cores) < 2:
        return None, set(cores)
    return cores[-1], set(cores[:-1])


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process (and the children it starts meanwhile: the deployment) on ``cores``."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# -- the run ----------------------------------------------------------------------------------


@dataclass
class MixPhase:
    """One phase beside the attacker process: the honest clients' result and what the attackers got."""

    honest: LevelResult
    #: whether the existing attacks (bench.abuse, bench.abuse_http) ran beside items 3, 5 and 6
    existing: bool
    #: honest failures by kind
    honest_errors: dict[str, int] = field(default_factory=dict)
    #: what the attacker process got: "tenants" (items 3, 5, 6), "existing", "http", "breaker_s"
    attack: dict[str, Any] = field(default_factory=dict)
    #: the orchestrator's counters' growth over the phase; bytes per token before and after it
    counters: dict[str, float] = field(default_factory=dict)
    bytes_per_token: dict[str, float | None] = field(default_factory=dict)
    #: admission slots still held after the phase with every client gone (lost slots)
    idle_inflight: float | None = None


@dataclass
class TenantRun:
    clean: LevelResult
    #: "mix 3/5/6" (items 3, 5 and 6 alone), then "mix" (with the existing attacks: the target's)
    mixes: list[MixPhase]
    settings: TenantAbuseSettings
    clean_errors: dict[str, int] = field(default_factory=dict)
    attacker_core: int | None = None
    other_cores: list[int] = field(default_factory=list)

    @property
    def mix(self) -> LevelResult:
        """The phase issue 36's target is about: every abuse at once."""
        return self.mixes[-1].honest

    @staticmethod
    def success(level: LevelResult) -> float:
        return (level.requests - level.errors) / level.requests if level.requests else 0.0

    def ttft_p99_ratio(self, level: LevelResult) -> float | None:
        a, b = level.ttft_p99_ms, self.clean.ttft_p99_ms
        return a / b if a is not None and b else None

    def meets(self, level: LevelResult) -> tuple[bool, bool]:
        """(success >= MIN_SUCCESS, TTFT p99 <= MAX_TTFT_P99_RATIO x clean) for one phase."""
        ratio = self.ttft_p99_ratio(level)
        return self.success(level) >= MIN_SUCCESS, ratio is not None and ratio <= MAX_TTFT_P99_RATIO

    @property
    def meets_targets(self) -> bool:
        return all(self.meets(self.mix))


def _scrape_mix(url: str) -> dict[str, float]:
    from bench.abuse import scrape

    samples = scrape(url) or {}
    return {k: v for k, v in samples.items() if k.split("{")[0] in (*MIX_COUNTERS, BYTES_PER_TOKEN)}


async def _honest(
    url: str, body: bytes, s: TenantAbuseSettings, label: str, errors: dict[str, int]
) -> LevelResult:
    async def request(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float) -> RequestResult:
        r = await one_request(session, url, body, timeout)
        if not r.ok:
            kind = honest_error_kind(r)
            errors[kind] = errors.get(kind, 0) + 1
        return r

    headers = {"Authorization": f"Bearer {HONEST_KEY}"}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), headers=headers, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        return await run_concurrency(
            url,
            body,
            s.concurrency,
            max_requests=1_000_000,
            max_seconds=s.phase_s,
            timeout=s.timeout,
            label=label,
            request=request,
            session=session,
        )


async def run_tenant_phases(
    base_url: str, s: TenantAbuseSettings, spec: dict[str, Any], *, model: str = "tiny"
) -> TenantRun:
    """Warm-up, the clean phase, then each mix beside the attacker process ``spec`` describes:
    items 3, 5 and 6 alone, then with the existing attacks (``s.existing``)."""
    url = base_url.rstrip("/") + CHAT
    body = chat_body(s.prompt_tokens, max_tokens=s.max_tokens, stream=True, model=model)
    await _honest(url, body, TenantAbuseSettings(**{**asdict(s), "phase_s": 1.0}), "warm-up", {})
    clean_errors: dict[str, int] = {}
    clean = await _honest(url, body, s, "clean", clean_errors)
    mixes = [await _mix_phase(url, body, s, spec, "mix 3/5/6", existing=False)]
    if s.existing:
        mixes.append(await _mix_phase(url, body, s, spec, "mix", existing=True))
    return TenantRun(clean, mixes, s, clean_errors)


async def _mix_phase(
    url: str, body: bytes, s: TenantAbuseSettings, spec: dict[str, Any], label: str, *, existing: bool
) -> MixPhase:
    metrics_url = url.removesuffix(CHAT) + "/metrics"
    before = await asyncio.to_thread(_scrape_mix, metrics_url)
    proc = await _start_attacker({**spec, "settings": {**spec["settings"], "existing": existing}})
    await asyncio.sleep(0.5)  # the attacks in place before the honest load
    phase = MixPhase(LevelResult.empty(label, s.concurrency), existing)
    phase.honest = await _honest(url, body, s, label, phase.honest_errors)
    phase.attack = await _stop_attacker(proc)
    after = await asyncio.to_thread(_scrape_mix, metrics_url)
    phase.idle_inflight = await _idle_inflight(metrics_url)
    grew = {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0] != BYTES_PER_TOKEN}
    phase.counters = {k: d for k, d in grew.items() if d}
    bpt_key = next((k for k in after if k.startswith(BYTES_PER_TOKEN) and '"context"' in k), None)
    phase.bytes_per_token = {
        "before": before.get(bpt_key) if bpt_key else None,
        "after": after.get(bpt_key) if bpt_key else None,
    }
    return phase


async def _idle_inflight(metrics_url: str) -> float | None:
    """The admission slots held once every client stopped (0 unless some were lost), waited for up
    to IDLE_SETTLE_S for the last legs to end."""
    from bench.abuse import metric

    deadline = time.perf_counter() + IDLE_SETTLE_S
    while True:
        value = await asyncio.to_thread(metric, metrics_url, INFLIGHT)
        if not value or time.perf_counter() > deadline:
            return value
        await asyncio.sleep(0.5)


def run(args: Any, quick: bool) -> TenantRun:
    """Its own keyed deployment on pinned cores, the two phases, the deployment stopped whatever happens."""
    from bench.abuse import DEFAULTS, QUICK_LIMITS, QUICK_MAX_CONNECTIONS, AbuseSettings, UpDeployment

    s = TenantAbuseSettings.quick() if quick else TenantAbuseSettings.full()
    if getattr(args, "duration", None):
        s.phase_s = args.duration
    attacker_core, others = split_cores(
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    )
    abuse_s = AbuseSettings.quick() if quick else AbuseSettings.full()
    http_s = (
        abuse_http.HTTPAbuseSettings.quick()
        if quick
        else abuse_http.HTTPAbuseSettings.full(abuse_s.max_body_bytes)
    )
    limits: dict[str, Any] = dict(QUICK_LIMITS) if quick else {}
    max_connections = QUICK_MAX_CONNECTIONS if quick else DEFAULTS.max_client_connections
    if quick:
        limits["max_client_connections"] = max_connections
    with tempfile.TemporaryDirectory(prefix="fastcore-tenants-") as tmp, pinned(others):
        limits.update(deployment_config(s, write_keys_file(tmp)))
        dep = UpDeployment(model=args.model, limits=limits).start()
        try:
            spec = {
                "url": dep.url,
                "host": "127.0.0.1",
                "port": dep.port,
                "model": args.model,
                "settings": asdict(s),
                "abuse_settings": asdict(abuse_s),
                "http_settings": asdict(http_s),
                "max_body_bytes": abuse_s.max_body_bytes,
                "max_connections": max_connections,
                "core": attacker_core,
                "max_s": s.phase_s + 30,
            }
            result = asyncio.run(run_tenant_phases(dep.url, s, spec, model=args.model))
        finally:
            dep.stop()
    result.attacker_core, result.other_cores = attacker_core, sorted(others)
    return result


# -- the report -------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def phase_table(r: TenantRun) -> str:
    headers = ["phase", "honest reqs", "success", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms", "E2E p99 ms"]
    levels = [r.clean, *(m.honest for m in r.mixes)]
    rows: list[list[Any]] = [
        [lv.label, lv.requests, f"{100 * r.success(lv):.1f}%", lv.ttft_p50_ms, lv.ttft_p99_ms,
         lv.latency_p50_ms, lv.latency_p99_ms]
        for lv in levels
    ]  # fmt: skip
    c = r.clean
    for lv in levels[1:]:
        rows.append(
            [
                f"{lv.label} / clean",
                "",
                "",
                _ratio(lv.ttft_p50_ms, c.ttft_p50_ms),
                _ratio(lv.ttft_p99_ms, c.ttft_p99_ms),
                _ratio(lv.latency_p50_ms, c.latency_p50_ms),
                _ratio(lv.latency_p99_ms, c.latency_p99_ms),
            ]
        )
    return format_table(headers, rows)


def verdict(r: TenantRun) -> str:
    """One line per mix against issue 36's targets (the last, every abuse at once, is the target's)."""
    lines = []
    for m in r.mixes:
        level = m.honest
        success, ratio = r.success(level), r.ttft_p99_ratio(level)
        ok_success, ok_ttft = r.meets(level)
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        lines.append(
            f"verdict (issue 36), {level.label}: honest success {100 * success:.1f}% "
            f"{'>=' if ok_success else '<'} {100 * MIN_SUCCESS:.0f}%: {'PASS' if ok_success else 'FAIL'}; "
            f"TTFT p99 {shown} clean {'<=' if ok_ttft else '>'} {MAX_TTFT_P99_RATIO:g}x: "
            f"{'PASS' if ok_ttft else 'FAIL'}"
        )
    return "\n".join(lines)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def attacker_text(r: TenantRun) -> str:
    s = r.settings
    what = {
        "breaker": f"unary, max_tokens {s.breaker_max_tokens}, every {s.breaker_interval_s:g} s "
                   f"(request_timeout_s {s.request_timeout_s:g})",
        "priority -2^63": f"{s.priority_clients} closed-loop streams",
        "over a minute's tokens": f"{s.over_minute_bytes:,}-byte prompt, limit "
                                  f"{s.attacker_prompt_tokens_per_minute:,} tokens/min, every "
                                  f"{s.over_minute_interval_s:g} s, tenant attacker-2",
        "whitespace-padded": f"{s.pad_prompt_tokens}-token prompt at {s.pad_bytes_per_token} bytes/token, "
                             f"every {s.pad_interval_s:g} s, tenant attacker-3",
        "long-prompt flood": f"{s.flood_clients} closed-loop clients, {s.flood_prompt_tokens}-token prompts",
    }  # fmt: skip
    cores = (
        f"attacker on core {r.attacker_core}, deployment and honest clients on {r.other_cores}"
        if r.attacker_core is not None
        else "one core: attackers not pinned apart"
    )
    lines = [cores]
    if r.clean_errors:
        lines.append(f"honest failures, clean: {_counts(r.clean_errors)}")
    for m in r.mixes:
        lines += [f"-- {m.honest.label}", *_mix_lines(m, what, s)]
    return "\n".join(lines)


def _mix_lines(m: MixPhase, what: dict[str, str], s: TenantAbuseSettings) -> list[str]:
    a, lines = m.attack, []
    for kind, counts in a.get("tenants", {}).items():
        lines.append(f"{kind} ({what.get(kind, '')}): {_counts(counts)}")
    if a.get("breaker_s"):
        times = sorted(a["breaker_s"])
        lines.append(f"  breaker requests answered after {times[0]:.1f} .. {times[-1]:.1f} s")
    existing = a.get("existing")
    if existing:
        lines.append(
            f"existing: abandon flood {existing['abandon_sent']} sent, seen: {_counts(existing['abandon_answers'])}; "
            + "; ".join(
                f"{k} {_counts(v['outcomes'])}"
                for k, v in existing.items()
                if isinstance(v, dict) and "outcomes" in v
            )
            + "; oversized: "
            + "; ".join(f"{k} {_counts(v)}" for k, v in existing["oversized"].items())
        )
    for kind, counts in a.get("http", {}).items():
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
        lines.append(f"existing {kind}: " + ", ".join(f"{k} {v}" for k, v in top))
    if m.honest_errors:
        lines.append(f"honest failures: {_counts(m.honest_errors)}")
    if m.counters:
        lines.append(
            "orchestrator over the phase: "
            + ", ".join(
                f"{k.removeprefix('fastcore_orchestrator_').replace(chr(34), '')} +{v:g}"
                for k, v in sorted(m.counters.items())
            )
        )
    if m.idle_inflight is not None:
        lines.append(
            f"admission slots held after the phase, every client gone: {m.idle_inflight:g} of "
            f"max_inflight {s.max_inflight}" + (" (lost for good)" if m.idle_inflight else "")
        )
    bpt = m.bytes_per_token
    if any(v is not None for v in bpt.values()):
        lines.append(
            "context pool's learned bytes per token: "
            + " -> ".join(f"{v:.2f} ({k})" if v is not None else f"- ({k})" for k, v in bpt.items())
        )
    return lines


def report(r: TenantRun) -> str:
    return "\n".join([phase_table(r), verdict(r), "", attacker_text(r)])


def to_json(r: TenantRun) -> dict[str, Any]:
    levels = [r.clean, *(m.honest for m in r.mixes)]
    return {
        **asdict(r),
        "success": {lv.label: r.success(lv) for lv in levels},
        "ttft_p99_ratio": {m.honest.label: r.ttft_p99_ratio(m.honest) for m in r.mixes},
        "meets_targets": r.meets_targets,
    }


def main(args: Any) -> int:
    """The tenant phases on their own deployment (not with ``--url``); 1 when the targets were missed."""
    if args.url:
        print("tenant phases: skipped with --url (they need their own deployment's keys and limits)")
        return 0
    r = run(args, args.quick)
    print(report(r))
    out = args.output or RESULTS_DIR / ("abuse_quick.json" if args.quick else "abuse.json")
    if not (args.tenants_only and args.output):  # beside the other phases' file, never over it
        out = out.with_name(out.stem + "_tenants.json")
    write_json(
        [r.clean, *(m.honest for m in r.mixes)],
        out,
        {"url": "own deployment (fastcore-serve up, tiny, API keys)", "tenant_phases": to_json(r)},
    )
    print(f"\nresults: {out}")
    return 0 if r.meets_targets else 1


__all__ = [
    "TenantAbuseSettings",
    "TenantAttacks",
    "TenantRun",
    "main",
    "report",
    "run",
    "run_tenant_phases",
    "to_json",
]


if __name__ == "__main__":
    from server.cli import raise_open_file_limit

    _spec = json.loads(sys.argv[1])
    _pin(_spec.get("core"))  # before anything runs: every attacker on its own core
    raise_open_file_limit()
    print(json.dumps(asyncio.run(_attacker_main(_spec))), flush=True)
