"""Who goes first: the orchestrator's admission queue, fair share by tenant, priorities, 429s.

``admission: {max_inflight, max_queue, max_queue_wait_s, client_priority, rate_limits}``
(docs/protocol.md, "Client authentication and admission"):

- At most ``max_inflight`` completions of this orchestrator (with ``--workers N``, of its N processes
  together: the slots are the fleet's, :mod:`.fleet`) are in the workers at once: a
  request holds its slot from its context leg to the last byte of its answer (both legs; one count,
  since a request is in one pool or the other, never queued between them). The rest wait here, in
  memory that holds only the request, instead of inside the workers until they time out.
- Slots go to the waiting tenants by deficit round robin (Shreedhar and Varghese, 1995) with the
  tenant's weight as its quantum and one request as the cost: each tenant's share of the slots is
  its weight over the waiting tenants' weights, however many streams it opens.
- Within a tenant, a lower ``priority`` (the body field as vLLM reads it: an integer, lower first,
  default 0) goes first, arrival order among equals, where the operator grants it:
  ``client_priority`` false (the default) reads every request as 0, since without keys every client
  is one tenant and a claimed priority would put one client's requests before everyone's; true or
  ``[min, max]`` takes it, clamped into the key's ``priority=MIN..MAX`` (api_keys_file) or else
  that range. It is read from the raw body by one non-validating scan (no JSON parse), with the
  prompt's span; a value that is not an integer is a 400 naming it, granted or not.
- A request that finds ``max_queue`` waiting, or is not started within ``max_queue_wait_s``, gets
  429 with ``Retry-After``; a full queue keeps its places fair too: a newcomer takes the place of
  the last in line of the tenant holding the most of it for its weight (who gets the 429), unless
  that is the newcomer's own tenant (then only a more urgent request of it takes the place of its own
  last: a priority never reaches into another tenant's requests); a client that leaves while
  queued is dropped at once (its task is cancelled by the HTTP layer, and its place with it).
- Optional per-tenant rate limits (``rate_limits: {<tenant> or "*": {requests_per_minute,
  prompt_tokens_per_minute}}``): token buckets that hold one minute's worth, refilled continuously;
  prompt tokens estimated at admission as the prompt's bytes (the ``messages`` or ``prompt`` span)
  over the context pool's learned bytes per token (server/orchestrator/estimates.py; 4 until a
  worker or an answer teaches it), then corrected to the workers' ``usage.prompt_tokens`` when its
  first answer with usage comes (:meth:`Admission.settle`). Beyond: 429 with the ``Retry-After``
  that the bucket needs; a prompt estimated above a whole minute's worth can never be admitted:
  429 at once, naming the limit, with no ``Retry-After``. With ``--workers N`` the buckets are the
  fleet's, one per (tenant, limit) for the N processes (:class:`_SharedLimits`).

The per-request cost when a slot is free is a priority read, two bucket checks when limits are
set, a counter and a coroutine call; counts are kept as ints and handed to the metrics registry at
scrape time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import re
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import fastcore
from fastcore import protocol as wire
from fastcore.errors import JSONSpanError
from server.errors import HTTPError
from server.metrics import Registry

from .fleet import POLL_S
from .routing import BYTES_PER_TOKEN
from .tenants import Tenant

if TYPE_CHECKING:
    from .config import AdmissionConfig, RateLimitConfig
    from .fleet import Fleet, SharedBucket

#: why a request was refused (``fastcore_orchestrator_tenant_rejected_total{reason}``)
REJECT_REASONS = ("queue_full", "queue_timeout", "requests_per_minute", "prompt_tokens_per_minute")
#: ``rate_limits``' entry for every tenant not named
ANY_TENANT = "*"
PRIORITY_FIELD = "priority"
#: what admission reads of a body, in one non-validating scan: the priority, the prompt's span
_ADMISSION_PATHS = ((PRIORITY_FIELD,), (wire.MESSAGES,), (wire.PROMPT,))
#: vLLM's field is a Python int; here it is bounded to a signed 64-bit integer
_INTEGER = re.compile(rb"-?(?:0|[1-9][0-9]{0,18})")
_INT64 = 1 << 63
#: ``client_priority: true``: any signed 64-bit priority
ANY_PRIORITY = (-_INT64, _INT64 - 1)
#: queue waits (seconds) of the requests that waited
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def read_priority(body: bytes) -> int:
    """The body's top-level ``priority`` (0 when absent); a 400 naming it when it is not an integer."""
    return read_admission(body)[0]


def read_admission(body: bytes) -> tuple[int, int]:
    """The body's top-level ``priority`` (0 when absent; a 400 naming it when it is not an integer)
    and its prompt's bytes (the ``messages`` or ``prompt`` value's span; 0 without one).

    A body that is not JSON reads as (0, 0) here: the relay's own check answers it, with the offset."""
    try:
        span, messages, prompt = fastcore.find_spans(body, _ADMISSION_PATHS, validate=False)
    except JSONSpanError:
        return 0, 0
    prompt = messages or prompt
    prompt_bytes = prompt[1] - prompt[0] if prompt is not None else 0
    if span is None:
        return 0, prompt_bytes
    raw = body[span[0] : span[1]]
    if _INTEGER.fullmatch(raw):
        value = int(raw)
        if -_INT64 <= value < _INT64:
            return value, prompt_bytes
    shown = raw[:40].decode("utf-8", "replace")
    raise HTTPError(
        400,
        f"priority must be an integer (lower is served first, default 0) within a signed 64-bit range, got {shown}",
        param=PRIORITY_FIELD,
    )


class TokenBucket:
    """``per_minute`` units a minute, up to one minute's worth at once; starts full."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, per_minute: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute
        self.stamp = time.monotonic()

    def wait(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units are there (0: now); refills first."""
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        short = min(cost, self.capacity) - self.level
        return 0.0 if short <= 0 else short / self.rate

    def take(self, cost: float) -> None:
        self.level -= min(cost, self.capacity)

    def resize(self, per_minute: float) -> None:
        """A new size (fleet_cluster.py's share): the level kept, up to it."""
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = min(self.level, per_minute)

    def correct(self, more: float) -> None:
        """``more`` units than were taken were used (fewer when negative): a debt the refill pays
        before the next request is let through, or a refund up to the bucket's size."""
        self.level = min(self.capacity, self.level - more)


class Charge:
    """A request's estimated prompt tokens taken from its tenant's bucket: :meth:`settle` corrects
    them to the workers' count once, when its first answer with ``usage`` comes."""

    __slots__ = ("bucket", "tokens")

    def __init__(self, bucket: TokenBucket | SharedBucket, tokens: float) -> None:
        self.bucket: TokenBucket | SharedBucket | None = bucket
        self.tokens = tokens

    def settle(self, prompt_tokens: int) -> None:
        bucket = self.bucket
        if bucket is not None:
            self.bucket = None
            bucket.correct(prompt_tokens - self.tokens)


#: the charge of the request this task serves (set while it holds its slot: the usage of its
#: answer is read deep in the legs, which need not know of admission)
_CHARGE: ContextVar[Charge | None] = ContextVar("fastcore_admission_charge", default=None)


class _Limits:
    """One tenant's rate limits."""

    __slots__ = ("requests", "tokens")

    def __init__(self, config: RateLimitConfig, fraction: float = 1.0) -> None:
        self.requests = (
            TokenBucket(config.requests_per_minute * fraction) if config.requests_per_minute else None
        )
        self.tokens = (
            TokenBucket(config.prompt_tokens_per_minute * fraction)
            if config.prompt_tokens_per_minute
            else None
        )

    def resize(self, config: RateLimitConfig, fraction: float) -> None:
        """``fraction`` of ``config``'s limits (fleet_cluster.py's share)."""
        if self.requests is not None and config.requests_per_minute:
            self.requests.resize(config.requests_per_minute * fraction)
        if self.tokens is not None and config.prompt_tokens_per_minute:
            self.tokens.resize(config.prompt_tokens_per_minute * fraction)

    def refusal(
        self, prompt_bytes: int | None, bytes_per_token: Callable[[], float]
    ) -> tuple[str, float | None] | Charge | None:
        """(reason, seconds to wait; None: never) when over a limit; else both buckets charged, and
        the prompt tokens' :class:`Charge` (None without a token limit). ``prompt_bytes`` None: no
        prompt (:meth:`Admission.slot`'s short request), the token bucket not read."""
        now = time.monotonic()
        bucket = self.tokens if prompt_bytes is not None else None
        tokens = (prompt_bytes or 0) / bytes_per_token() if bucket is not None else 0.0
        if bucket is not None and tokens > bucket.capacity:
            return "prompt_tokens_per_minute", None  # more than a minute's worth: no wait lets it in
        if self.requests is not None:
            wait = self.requests.wait(1, now)
            if wait:
                return "requests_per_minute", wait
        charge = None
        if bucket is not None:
            wait = bucket.wait(tokens, now)
            if wait:
                return "prompt_tokens_per_minute", wait
            bucket.take(tokens)
            charge = Charge(bucket, tokens)
        if self.requests is not None:
            self.requests.take(1)
        return charge


class _SharedLimits:
    """One tenant's rate limits in the fleet's buckets (fleet.py, ``--workers N``): each bucket is
    checked and taken in one step, the request's first and given back when the prompt's tokens are
    not there, so that processes admitting at once cannot take one unit twice."""

    __slots__ = ("requests", "tokens")

    def __init__(self, requests: SharedBucket | None, tokens: SharedBucket | None) -> None:
        self.requests = requests
        self.tokens = tokens

    def resize(self, config: RateLimitConfig, fraction: float) -> None:
        """As :meth:`_Limits.resize`."""
        _Limits.resize(self, config, fraction)  # type: ignore[arg-type]

    def refusal(
        self, prompt_bytes: int | None, bytes_per_token: Callable[[], float]
    ) -> tuple[str, float | None] | Charge | None:
        """As :meth:`_Limits.refusal`."""
        bucket = self.tokens if prompt_bytes is not None else None
        tokens = (prompt_bytes or 0) / bytes_per_token() if bucket is not None else 0.0
        if bucket is not None and tokens > bucket.capacity:
            return "prompt_tokens_per_minute", None
        if self.requests is not None:
            wait = self.requests.take(1)
            if wait:
                return "requests_per_minute", wait
        if bucket is None:
            return None
        wait = bucket.take(tokens)
        if wait:
            if self.requests is not None:
                self.requests.correct(-1)  # not admitted: its request goes back
            return "prompt_tokens_per_minute", wait
        return Charge(bucket, tokens)


def _shared_limits(
    fleet: Fleet, tenant: str, config: RateLimitConfig, fraction: float = 1.0
) -> _SharedLimits | _Limits:
    """``tenant``'s limits in the fleet's buckets (per process where its table is full), ``fraction``
    of them (several hosts' share, fleet_cluster.py)."""
    requests = tokens = None
    if config.requests_per_minute:
        requests = fleet.bucket(tenant, "requests_per_minute", config.requests_per_minute * fraction)
        if requests is None:
            return _Limits(config, fraction)
    if config.prompt_tokens_per_minute:
        tokens = fleet.bucket(tenant, "prompt_tokens_per_minute", config.prompt_tokens_per_minute * fraction)
        if tokens is None:
            return _Limits(config, fraction)
    return _SharedLimits(requests, tokens)


class _Waiter:
    __slots__ = ("future", "live", "queue", "since", "timer")

    def __init__(self, future: asyncio.Future[str | None], queue: _TenantQueue, since: float) -> None:
        self.future = future
        self.queue = queue
        self.since = since
        self.live = True
        self.timer: asyncio.TimerHandle | None = None


class _TenantQueue:
    """One tenant's state: its waiting requests (a heap by priority, then arrival), its deficit."""

    __slots__ = ("admitted", "deficit", "heap", "left", "limits", "name", "rejected", "waiting", "weight")

    def __init__(self, tenant: Tenant, limits: _Limits | _SharedLimits | None) -> None:
        self.name = tenant.name
        self.weight = tenant.weight
        self.heap: list[tuple[int, int, _Waiter]] = []
        self.waiting = 0
        #: entries of the heap whose request left (lazy deletion: dropped when popped, or all at
        #: once when they are over half of it, so joins and leaves cannot grow it)
        self.left = 0
        self.deficit = 0.0
        self.admitted = 0
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.limits = limits


class Admission:
    """The admission queue of one orchestrator process."""

    def __init__(
        self,
        config: AdmissionConfig,
        registry: Registry,
        retry_after_s: int,
        bytes_per_token: Callable[[], float] = lambda: float(BYTES_PER_TOKEN),
    ) -> None:
        #: prompt bytes per token for prompt_tokens_per_minute: the context pool's learned figure
        #: (server/orchestrator/estimates.py), else BYTES_PER_TOKEN
        self.bytes_per_token = bytes_per_token
        self.max_inflight = config.max_inflight
        self.max_queue = config.max_queue
        self.max_wait = config.max_queue_wait_s
        self.retry_after_s = retry_after_s
        self.rate_limits = config.rate_limits
        #: this orchestrator's part of each rate limit (several hosts: :meth:`divide`)
        self.fraction = 1.0
        #: the priorities a request may claim where its key names no range (None: none, all are 0)
        granted = config.client_priority
        self.client_priority: tuple[int, int] | None = (
            ANY_PRIORITY if granted is True else None if granted is False else tuple(granted)  # type: ignore[assignment]
        )
        self.inflight = 0
        self.queued = 0
        #: the host's other orchestrator processes' share of the slots and buckets (``--workers N``,
        #: :meth:`share`); None: this process's own
        self.fleet: Fleet | None = None
        self._poll: asyncio.TimerHandle | None = None
        self._tenants: dict[str, _TenantQueue] = {}
        #: tenants with requests waiting, in round-robin order; the head is being served
        self._active: deque[_TenantQueue] = deque()
        self._order = itertools.count()
        self._metrics(registry)

    def share(self, fleet: Fleet) -> None:
        """Take slots and rate limits from the fleet's mapping (fleet.py) from now on: called once,
        before the process serves (slots held before would be given back to the fleet)."""
        self.fleet = fleet
        self._tenants.clear()

    def divide(self, fraction: float, max_inflight: int) -> None:
        """This orchestrator's part of a fleet of several hosts (fleet_cluster.py, from its watch):
        ``fraction`` of each tenant's rate limits and ``max_inflight`` slots from now on. The request
        path reads the same attributes as without it; waiters take what a larger part frees."""
        self.fraction = fraction
        self.max_inflight = max_inflight
        for name, queue in self._tenants.items():
            limit = self._limit_of(name)
            if queue.limits is not None and limit is not None:
                queue.limits.resize(limit, fraction)
        self._serve_waiters()

    def _limit_of(self, tenant: str) -> RateLimitConfig | None:
        return self.rate_limits.get(tenant) or self.rate_limits.get(ANY_TENANT)

    # -- the request path ---------------------------------------------------------------------

    def slot(self, tenant: Tenant, body: bytes | None) -> _Slot:
        """The slot a completion holds while it runs (``async with``): entering it may wait in the
        queue or raise the 429; the 400 of a bad priority and a rate limit's 429 come at once.

        ``body`` None: a short request that asks a worker for no completion (count_tokens' tokenising,
        apis.WorkerAsk): a slot and a request of the tenant's ``requests_per_minute``, priority 0, no
        prompt tokens charged (no prompt runs through a model)."""
        claimed, prompt_bytes = read_admission(body) if body is not None else (0, None)
        priority = 0
        granted = self.client_priority
        if granted is not None:
            low, high = tenant.priority or granted
            priority = low if claimed < low else high if claimed > high else claimed
        queue = self._tenants.get(tenant.name)
        if queue is None:
            queue = self._new_tenant(tenant)
        elif queue.weight != tenant.weight:
            queue.weight = tenant.weight  # a reloaded key file changed it
        charge = None
        if queue.limits is not None:
            over = queue.limits.refusal(prompt_bytes, self.bytes_per_token)
            if isinstance(over, tuple):
                reason, wait = over
                if wait is None:
                    raise self._never_fits(queue, prompt_bytes or 0)
                raise self._reject(
                    queue,
                    reason,
                    math.ceil(wait),
                    f"tenant {queue.name} is over its {reason.replace('_', ' ')} limit",
                )
            charge = over
        return _Slot(self, queue, priority, charge)

    def _never_fits(self, queue: _TenantQueue, prompt_bytes: int) -> HTTPError:
        queue.rejected["prompt_tokens_per_minute"] += 1
        name = queue.name if queue.name in self.rate_limits else ANY_TENANT
        limit = self.rate_limits[name].prompt_tokens_per_minute
        tokens = prompt_bytes / self.bytes_per_token()
        part = f", this orchestrator's part {limit * self.fraction:g}" if self.fraction < 1 else ""  # type: ignore[operator]
        return HTTPError(
            429,
            f"the prompt's estimated {tokens:.0f} tokens are more than admission.rate_limits.{name}."
            f"prompt_tokens_per_minute ({limit:g}{part}) of tenant {queue.name}: it can never be admitted",
            code="prompt_tokens_per_minute",
        )

    @staticmethod
    def settle(prompt_tokens: int) -> None:
        """The workers' count of the prompt of the request this task serves (its first answer's
        ``usage.prompt_tokens``): its tenant's token bucket corrected from the estimate to it."""
        charge = _CHARGE.get()
        if charge is not None:
            charge.settle(prompt_tokens)

    def _new_tenant(self, tenant: Tenant) -> _TenantQueue:
        limit = self._limit_of(tenant.name)
        limits: _Limits | _SharedLimits | None = None
        if limit is not None and (limit.requests_per_minute or limit.prompt_tokens_per_minute):
            fraction = self.fraction
            limits = (
                _Limits(limit, fraction)
                if self.fleet is None
                else _shared_limits(self.fleet, tenant.name, limit, fraction)
            )
        queue = self._tenants[tenant.name] = _TenantQueue(tenant, limits)
        return queue

    def _reject(self, queue: _TenantQueue, reason: str, retry_after: int, message: str) -> HTTPError:
        queue.rejected[reason] += 1
        return HTTPError(429, message, code=reason, headers={"Retry-After": str(max(1, retry_after))})

    def _room(self) -> bool:
        """A slot for one more: this process's count below max_inflight, or the fleet's slot taken."""
        fleet = self.fleet
        if fleet is None:
            return self.inflight < self.max_inflight
        return fleet.core.acquire(self.max_inflight)

    async def acquire(self, queue: _TenantQueue, priority: int) -> None:
        if not self.queued and self._room():
            self.inflight += 1
            queue.admitted += 1
            return
        if self.queued >= self.max_queue and not self._push_out(queue, priority):
            raise self._reject(queue, "queue_full", self.retry_after_s, self._full_message)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), queue, time.monotonic())
        waiter.timer = loop.call_later(self.max_wait, self._expire, waiter)
        heapq.heappush(queue.heap, (priority, next(self._order), waiter))
        queue.waiting += 1
        self.queued += 1
        if queue.waiting == 1:
            self._active.append(queue)
        if self.fleet is not None and self._poll is None:
            self._poll = loop.call_later(POLL_S, self._look_for_slots)
        try:
            refused = await waiter.future
        except asyncio.CancelledError:
            # The client left (or a drain ran out): its place goes now; a slot granted in the same
            # instant goes back to the next in line.
            if waiter.live:
                self._remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.result() is None:
                self.release()
            raise
        if refused == "queue_timeout":
            raise self._reject(
                queue,
                refused,
                self.retry_after_s,
                f"not started within admission.max_queue_wait_s ({self.max_wait:g} s)",
            )
        if refused is not None:
            raise self._reject(
                queue,
                refused,
                self.retry_after_s,
                self._full_message + f"; tenant {queue.name} held the most of it for its weight",
            )
        self._observe_wait(queue.name, time.monotonic() - waiter.since)

    @property
    def _full_message(self) -> str:
        return f"the orchestrator's admission queue is full ({self.max_queue} waiting)"

    def _push_out(self, newcomer: _TenantQueue, priority: int) -> bool:
        """A full queue and one more request: its place is taken from the tenant holding the most of
        the queue for its weight (the newcomer's own tenant counted with it), that tenant's last in
        line (the highest priority value, then the latest) answered 429 ``queue_full``; True when
        so, False when the newcomer is the one to refuse. Without this the tenant with the most
        streams would keep the queue full and every other tenant's requests would find it so."""
        if not self._active:
            return False
        heaviest = max(self._active, key=lambda q: q.waiting / q.weight)
        if (
            heaviest is not newcomer
            and heaviest.waiting / heaviest.weight <= (newcomer.waiting + 1) / newcomer.weight
        ):
            return False  # shares even: first come keeps its place
        worst = max((entry for entry in heaviest.heap if entry[2].live), key=lambda entry: entry[:2])
        if heaviest is newcomer and worst[0] <= priority:
            return False  # the newcomer's own tenant holds the most: only a more urgent request gets in
        waiter = worst[2]
        self._remove(waiter)
        if not waiter.future.done():  # done: its client left in this loop pass, its place is free anyway
            waiter.future.set_result("queue_full")
        return True

    def release(self) -> None:
        self.inflight -= 1
        if self.fleet is not None:
            self.fleet.core.release()
        self._serve_waiters()

    def _serve_waiters(self) -> None:
        """Slots to the next in line while there is room (a fleet's slot taken as it is checked)."""
        while self.queued and self._room():
            if not self._grant(self._next()) and self.fleet is not None:
                self.fleet.core.release()  # not taken after all

    def _look_for_slots(self) -> None:
        """While requests wait here, slots other processes gave back (``--workers N``) are looked for
        every POLL_S: this process hears only of its own releases."""
        self._poll = None
        self._serve_waiters()
        if self.queued:
            self._poll = asyncio.get_running_loop().call_later(POLL_S, self._look_for_slots)

    # -- the queue ------------------------------------------------------------------------------

    def _next(self) -> _Waiter:
        """Deficit round robin over the tenants waiting, one request at a time: the head tenant is
        served while its deficit lasts, then goes to the back and the next one's turn adds its
        weight (a weight below 1 waits for turns to add up to one request)."""
        active = self._active
        while True:
            queue = active[0]
            if queue.deficit < 1:
                queue.deficit += queue.weight
                if queue.deficit < 1:
                    active.rotate(-1)
                    continue
            queue.deficit -= 1
            heap = queue.heap
            waiter = heapq.heappop(heap)[2]
            while not waiter.live:  # removed (left, timed out) after it was pushed
                queue.left -= 1
                waiter = heapq.heappop(heap)[2]
            if queue.waiting == 1:
                active.popleft()
                queue.deficit = 0.0
            elif queue.deficit < 1:
                active.rotate(-1)
            return waiter

    def _take_out(self, waiter: _Waiter) -> None:
        waiter.live = False
        if waiter.timer is not None:
            waiter.timer.cancel()
        queue = waiter.queue
        queue.waiting -= 1
        self.queued -= 1

    def _grant(self, waiter: _Waiter) -> bool:
        """The slot to ``waiter``; False when its client has just left: its task was cancelled (its
        future with it) in this loop pass, before its handler could take it out of the queue."""
        self._take_out(waiter)
        if not waiter.queue.waiting:
            waiter.queue.heap.clear()
            waiter.queue.left = 0
        if waiter.future.done():
            return False
        self.inflight += 1
        waiter.queue.admitted += 1
        waiter.future.set_result(None)
        return True

    def _remove(self, waiter: _Waiter) -> None:
        """A waiter that leaves the queue without a slot."""
        self._take_out(waiter)
        queue = waiter.queue
        if queue.waiting:
            queue.left += 1
            if queue.left * 2 > len(queue.heap):  # left ones over half: rebuilt from the live ones
                queue.heap = [entry for entry in queue.heap if entry[2].live]
                heapq.heapify(queue.heap)
                queue.left = 0
        else:
            queue.heap.clear()
            queue.left = 0
            queue.deficit = 0.0
            try:
                self._active.remove(queue)
            except ValueError:
                pass

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.live:
            self._remove(waiter)
            if not waiter.future.done():
                waiter.future.set_result("queue_timeout")

    # -- metrics --------------------------------------------------------------------------------

    def _metrics(self, registry: Registry) -> None:
        registry.gauge(
            "fastcore_orchestrator_admission_inflight",
            "Completions holding an admission slot (in the workers) now; at most admission.max_inflight.",
            callback=lambda: self.inflight,
        )
        admitted = registry.counter(
            "fastcore_orchestrator_tenant_admitted_total", "Completions admitted to the workers, per tenant.",
            ("tenant",),
        )  # fmt: skip
        queued = registry.gauge(
            "fastcore_orchestrator_tenant_queued", "Completions waiting in the admission queue now, per tenant.",
            ("tenant",),
        )  # fmt: skip
        rejected = registry.counter(
            "fastcore_orchestrator_tenant_rejected_total",
            "Completions refused with 429, per tenant and reason: queue_full (admission.max_queue waiting), "
            "queue_timeout (not started within max_queue_wait_s), requests_per_minute, prompt_tokens_per_minute.",
            ("tenant", "reason"),
        )
        self._wait = registry.histogram(
            "fastcore_orchestrator_tenant_queue_wait_seconds",
            "Time in the admission queue of the completions that waited for a slot and got one, per tenant.",
            ("tenant",),
            buckets=WAIT_BUCKETS,
        )
        self._wait_children: dict[str, Any] = {}
        reported: dict[tuple[str, str], int] = {}

        def collect() -> None:
            for name, queue in self._tenants.items():
                seen = reported.get((name, ""), 0)
                admitted.inc(queue.admitted - seen, tenant=name)
                reported[(name, "")] = queue.admitted
                queued.set(queue.waiting, tenant=name)
                for reason, count in queue.rejected.items():
                    seen = reported.get((name, reason), 0)
                    rejected.inc(count - seen, tenant=name, reason=reason)
                    reported[(name, reason)] = count

        registry.before_collect(collect)

    def _observe_wait(self, tenant: str, seconds: float) -> None:
        child = self._wait_children.get(tenant)
        if child is None:
            child = self._wait_children[tenant] = self._wait.labels(tenant=tenant)
        child.observe(seconds)


class _Slot:
    """``async with admission.slot(tenant, body):``: a slot held for the body of the block, the
    request's prompt-token :class:`Charge` the task's (:meth:`Admission.settle`) meanwhile."""

    __slots__ = ("admission", "charge", "priority", "queue")

    def __init__(
        self, admission: Admission, queue: _TenantQueue, priority: int, charge: Charge | None
    ) -> None:
        self.admission = admission
        self.queue = queue
        self.priority = priority
        self.charge = charge

    async def __aenter__(self) -> None:
        charge = self.charge
        try:
            await self.admission.acquire(self.queue, self.priority)
        except BaseException:
            if charge is not None:
                charge.settle(0)  # never in a worker: its tokens go back
            raise
        if charge is not None:
            _CHARGE.set(charge)

    async def __aexit__(self, *exc_info: object) -> None:
        if self.charge is not None:
            _CHARGE.set(None)
        self.admission.release()


__all__ = [
    "ANY_PRIORITY",
    "ANY_TENANT",
    "PRIORITY_FIELD",
    "REJECT_REASONS",
    "Admission",
    "Charge",
    "TokenBucket",
    "read_admission",
    "read_priority",
]
