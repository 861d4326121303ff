"""What a client may claim of the admission queue, and what it is charged (server/orchestrator/admission.py):
``priority`` only as the operator grants it (``admission.client_priority``, a key's ``priority=`` range),
prompt tokens charged as the workers count them, a request that can never fit refused, and queued
requests that leave taken out of their tenant's heap.

In process, on the admission object itself, and on real sockets on 127.0.0.1 (synthetic workers);
each request is sent once the one before it is queued (arrival order known, never raced).
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any

import pytest
from helpers import eventually

from server.errors import HTTPError
from server.metrics import Registry
from server.orchestrator.admission import Admission
from server.orchestrator.config import AdmissionConfig
from server.orchestrator.tenants import KeyFileError, Tenant, parse_key_file

eventually_long = functools.partial(eventually, timeout=20.0)


def admission(**config: Any) -> Admission:
    return Admission(AdmissionConfig(**config), Registry(), retry_after_s=1)


# -- queued requests that leave (issue 36, 8) ---------------------------------------------------------


async def test_queued_requests_that_leave_do_not_pile_up_in_their_tenants_heap() -> None:
    """A tenant that keeps one request waiting while others join and leave: the heap holds the ones
    still waiting and at most as many left ones (compacted when those are over half of it), not one
    entry per request that ever waited."""
    queue = admission(max_inflight=1)
    tenant = Tenant("t")
    await queue.slot(tenant, b"{}").__aenter__()  # the one slot, held
    stayer = asyncio.create_task(queue.slot(tenant, b"{}").__aenter__())
    assert await eventually_long(lambda: queue.queued == 1)
    for _ in range(2000):
        leaver = asyncio.create_task(queue.slot(tenant, b"{}").__aenter__())
        await asyncio.sleep(0)  # queued
        assert queue.queued == 2
        leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        assert queue.queued == 1
    heap = queue._tenants["t"].heap
    assert len(heap) <= 4, len(heap)
    queue.release()  # the stayer gets the slot
    await stayer
    assert queue.queued == 0 and queue.inflight == 1
    queue.release()
    assert queue.inflight == 0 and not heap


# -- priority: what the operator grants (issue 36, 5) ----------------------------------------------------

INT64_MIN = -(1 << 63)


async def _served_order(queue: Admission, arrivals: list[tuple[Tenant, int]]) -> list[int]:
    """The order in which one slot serves ``arrivals`` (tenant, claimed priority), queued in that order."""
    await queue.slot(Tenant("holder"), b"{}").__aenter__()
    served: list[int] = []

    async def one(i: int, tenant: Tenant, priority: int) -> None:
        async with queue.slot(tenant, b'{"priority": %d, "messages": []}' % priority):
            served.append(i)

    tasks = []
    for i, (tenant, priority) in enumerate(arrivals):
        tasks.append(asyncio.create_task(one(i, tenant, priority)))
        await eventually_long(lambda n=i + 1: queue.queued == n)
    queue.release()
    await asyncio.gather(*tasks)
    return served


async def test_a_claimed_priority_is_ignored_unless_the_operator_grants_it() -> None:
    """Without keys every client is tenant ``default``: by default a claimed priority reads as 0
    (arrival order), so no client's requests go before everyone else's."""
    anyone = Tenant("default")
    arrivals = [(anyone, 0), (anyone, 0), (anyone, INT64_MIN), (anyone, -1)]
    assert await _served_order(admission(max_inflight=1), arrivals) == [0, 1, 2, 3]
    assert await _served_order(admission(max_inflight=1, client_priority=True), arrivals) == [2, 3, 0, 1]


async def test_a_granted_priority_is_clamped_into_the_range_of_the_config_or_of_the_key() -> None:
    anyone = Tenant("default")
    # [-1, 5]: INT64_MIN reads as -1, as urgent as an honest -1 (arrival order between them)
    arrivals = [(anyone, 0), (anyone, -1), (anyone, INT64_MIN), (anyone, 99)]
    assert await _served_order(admission(max_inflight=1, client_priority=[-1, 5]), arrivals) == [1, 2, 0, 3]
    # a key's range narrows it: this key may claim nothing below 0
    batch = Tenant("t", priority=(0, 10))
    arrivals = [(batch, 3), (batch, INT64_MIN), (batch, 0)]
    assert await _served_order(admission(max_inflight=1, client_priority=True), arrivals) == [1, 2, 0]
    # not granted: the key's range does not grant it
    assert await _served_order(admission(max_inflight=1), arrivals) == [0, 1, 2]


async def test_a_priority_never_pushes_another_tenants_request_out_of_a_full_queue() -> None:
    """A full queue: an urgent newcomer may take the place of its own tenant's last, never of
    another tenant's (which only fair share, not priority, decides)."""
    queue = admission(max_inflight=1, max_queue=2, client_priority=True)
    await queue.slot(Tenant("holder"), b"{}").__aenter__()
    outcome: dict[str, object] = {}

    async def one(name: str, tenant: str, priority: int) -> None:
        try:
            async with queue.slot(Tenant(tenant), b'{"priority": %d}' % priority):
                outcome[name] = "served"
        except HTTPError as exc:
            outcome[name] = exc.code

    tasks = []
    arrivals = [
        ("honest1", "a", 0),
        ("attacker1", "b", 0),
        ("attacker2", "b", INT64_MIN),
        ("attacker3", "b", INT64_MIN),
    ]
    for i, (name, tenant, priority) in enumerate(arrivals):
        tasks.append(asyncio.create_task(one(name, tenant, priority)))
        queued, refused = min(i + 1, 2), max(0, i - 1)
        assert await eventually_long(lambda q=queued, r=refused: queue.queued == q and len(outcome) == r)
    # attacker2 found a and b even (1 each): refused though it claimed the most urgent priority;
    # attacker3 the same: the honest request keeps its place
    assert outcome == {"attacker2": "queue_full", "attacker3": "queue_full"}
    queue.release()
    await asyncio.gather(*tasks)
    assert outcome["honest1"] == "served" and outcome["attacker1"] == "served"


# -- prompt tokens: charged as the workers count them (issue 36, 6) ------------------------------------


def _prompt(nbytes: int) -> bytes:
    """A chat body whose ``messages`` span is ``nbytes`` bytes, padded outside it with whitespace."""
    content = b"x" * (nbytes - len(b'[{"role": "user", "content": ""}]'))
    return (
        b'{"model": "m",' + b" " * 100_000 + b'"messages": [{"role": "user", "content": "' + content + b'"}]}'
    )


def test_a_prompt_larger_than_a_minutes_worth_is_refused_naming_the_limit() -> None:
    """20,000 prompt tokens a minute: a 100,006-token prompt was admitted (charged one minute's
    worth); now a 429 at once that names the limit, with no Retry-After (no wait lets it in)."""
    queue = admission(rate_limits={"*": {"prompt_tokens_per_minute": 20_000}})
    with pytest.raises(HTTPError) as info:
        queue.slot(Tenant("t"), _prompt(400_024))  # ~100,006 tokens at 4 bytes each
    error = info.value
    assert error.status == 429 and error.code == "prompt_tokens_per_minute"
    assert "admission.rate_limits.*.prompt_tokens_per_minute (20000)" in error.message
    assert "100006 tokens" in error.message and not error.headers
    assert queue._tenants["t"].rejected["prompt_tokens_per_minute"] == 1
    queue.slot(Tenant("t"), _prompt(80_000))  # 20,000: a whole minute's worth fits


def test_the_estimate_is_read_from_the_prompts_span_not_the_body() -> None:
    """100 KB of whitespace around a 4,000-byte prompt: 1,000 tokens charged, not 26,000."""
    queue = admission(rate_limits={"*": {"prompt_tokens_per_minute": 2_000}})
    queue.slot(Tenant("t"), _prompt(4_000))
    bucket = queue._tenants["t"].limits.tokens
    assert bucket is not None and 999 < bucket.level <= 1_001


async def test_a_charge_is_corrected_to_the_workers_count_when_the_usage_comes() -> None:
    queue = admission(max_inflight=1, max_queue=0, rate_limits={"*": {"prompt_tokens_per_minute": 10_000}})
    bucket_of = lambda: queue._tenants["t"].limits.tokens  # noqa: E731
    slot = queue.slot(Tenant("t"), _prompt(4_000))  # estimated 1,000
    assert 8_999 < bucket_of().level <= 9_001
    async with slot:
        Admission.settle(3_000)  # the workers counted 3,000
        assert 6_999 < bucket_of().level <= 7_001
        Admission.settle(10)  # once: a second answer's usage changes nothing
        assert 6_999 < bucket_of().level <= 7_001
        refused = queue.slot(Tenant("t"), _prompt(4_000))  # the slot is taken, no queue: 429 queue_full
        with pytest.raises(HTTPError) as info:
            await refused.__aenter__()
        assert info.value.code == "queue_full"
        assert 6_999 < bucket_of().level <= 7_001  # its estimate went back: it never reached a worker
    Admission.settle(1)  # outside any slot: nothing to correct
    assert 6_999 < bucket_of().level <= 7_001


def test_a_key_may_carry_a_priority_range_and_a_bad_one_names_the_line() -> None:
    keys = parse_key_file(b"k1 alpha 2 priority=-5..5\nk2 alpha 2\nk3 beta priority=0..0\n", "keys")
    assert keys == {
        b"k1": Tenant("alpha", 2.0, (-5, 5)),
        b"k2": Tenant("alpha", 2.0),
        b"k3": Tenant("beta", 1.0, (0, 0)),
    }
    for line, message in (
        (b"secret a priority=1..0", "line 1: priority=MIN..MAX takes two integers, MIN <= MAX"),
        (b"secret a priority=0..9223372036854775808", "within a signed 64-bit range"),
        (b"secret a priority=x", "priority=MIN..MAX takes two integers"),
        (b"secret a 2 3", "line 1: expected '<key> <tenant> [weight] [priority=MIN..MAX]'"),
        (b"secret a priority=0..1 2", "expected '<key> <tenant> [weight] [priority=MIN..MAX]'"),
        (b"secret a 1 priority=0..1 x", "got 5 fields"),
    ):
        with pytest.raises(KeyFileError, match=re.escape(message)) as info:
            parse_key_file(line, "keys")
        assert "secret" not in str(info.value)


async def test_the_workers_count_is_what_a_tenant_is_charged_on_real_sockets() -> None:
    """Workers that count every prompt as 5,000 tokens, prompts of ~10 estimated, 9,000 tokens a
    minute: charged the estimate, a tenant got ~900 requests a minute; charged the workers' count
    once each answer comes, the third is refused."""
    import aiohttp

    from server.orchestrator.app import start_server
    from server.orchestrator.config import build_config
    from server.worker.app import WorkerSettings, start_worker
    from server.worker.synthetic import SyntheticEngine

    started = [
        await start_worker(SyntheticEngine(5_000), WorkerSettings(role=role, model_name="synthetic"))
        for role in ("context", "generation")
    ]
    config = build_config(
        {
            "port": 0,
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [f"http://127.0.0.1:{started[0][1]}"]},
            "generation_servers": {"urls": [f"http://127.0.0.1:{started[1][1]}"]},
            "admission": {"rate_limits": {"*": {"prompt_tokens_per_minute": 9_000}}},
        },
        environ={},
    )
    server, orch = await start_server(config)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    try:
        assert await eventually_long(lambda: orch.context_pool.ready and orch.generation_pool.ready)
        async with aiohttp.ClientSession() as session:
            statuses = []
            for _ in range(3):
                async with session.post(url, json=body) as resp:
                    statuses.append((resp.status, (await resp.json()).get("error", {}).get("code")))
        assert statuses == [(200, None), (200, None), (429, "prompt_tokens_per_minute")]
    finally:
        await server.cleanup()
        for s, _ in started:
            await s.cleanup()
