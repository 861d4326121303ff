"""One host's orchestrator processes as one fleet (server/orchestrator/fleet.py, _fleet.pyx): the
twins agree word for word; ``max_inflight`` holds across processes; a dead process's slots come
back; a tenant's rate limit holds for the fleet, not per process; a breaker opened in one process is
honoured by the others until their own probe.

Deterministic: "processes" are Cores or Admissions on one mapping with given indexes, times are
given (a fake clock), and the tests with real processes assert invariants, never durations.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import REQUIRE_EXTENSIONS

import fastcore
from server.errors import HTTPError
from server.metrics import Registry
from server.orchestrator import fleet as fleet_module
from server.orchestrator.admission import Admission
from server.orchestrator.cli import give_back_slots
from server.orchestrator.config import AdmissionConfig
from server.orchestrator.fleet import BREAKERS, BUCKETS, MINUTE_NS, Fleet, Mapping, PureCore
from server.orchestrator.pools import Pool
from server.orchestrator.tenants import Tenant

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}]}'
SECOND = 1_000_000_000


@pytest.fixture(params=["py", "c"])
def core_class(request: pytest.FixtureRequest) -> Any:
    """The fleet's Core twins: PureCore, and _fleet.Core where built."""
    if request.param == "py":
        return PureCore
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    if fleet_module.compiled is None:
        if REQUIRE_EXTENSIONS:
            pytest.fail("server.orchestrator._fleet required but not built")
        pytest.skip("server.orchestrator._fleet not built")
    return fleet_module.compiled.Core


@pytest.fixture
def mapping() -> Iterator[Mapping]:
    made = Mapping.create(2, buckets=64, breakers=16)
    yield made
    made.remove()


@pytest.fixture
def use_core(core_class: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Fleets a test makes use ``core_class`` (as a process uses the twin chosen at import)."""
    monkeypatch.setattr(fleet_module, "Core", core_class)
    return core_class


def test_the_compiled_layout_is_the_pure_one() -> None:
    if fleet_module.compiled is None:
        pytest.skip("server.orchestrator._fleet not built")
    assert fleet_module.compiled.LAYOUT == fleet_module.LAYOUT


def test_the_twins_agree_word_for_word() -> None:
    """The same random operations on one mapping per twin: the same answers, the same bytes."""
    if fleet_module.compiled is None:
        pytest.skip("server.orchestrator._fleet not built")
    maps = [Mapping.create(3, buckets=8, breakers=4) for _ in range(2)]
    try:
        cores = [
            [cls(m, i) for i in range(3)] for cls, m in zip((PureCore, fleet_module.compiled.Core), maps)
        ]
        rng = random.Random(42)
        for _ in range(3000):
            proc = rng.randrange(3)
            op = rng.choice(
                [
                    "acquire",
                    "release",
                    "clear",
                    "entry",
                    "take",
                    "correct",
                    "publish",
                    "withdraw",
                    "generation",
                ]
            )
            key = rng.choice([1, -1, 7, 9, 2**62, -(2**63), 15])
            table = rng.choice([BUCKETS, BREAKERS])
            now = rng.randrange(0, 200 * SECOND)
            args: tuple[Any, ...] = {
                "acquire": (rng.randrange(0, 5),),
                "release": (),
                "clear": (rng.randrange(3),),
                "entry": (table, key),
                "take": (rng.randrange(-1, 9), now, rng.randrange(0, 61 * SECOND), MINUTE_NS),
                "correct": (rng.randrange(8), now, rng.randrange(-70 * SECOND, 70 * SECOND)),
                "publish": (rng.randrange(4), now),
                "withdraw": (rng.randrange(4), rng.choice([0, now])),
                "generation": (),
            }[op]
            results = []
            for twin in cores:
                try:
                    results.append(("ok", getattr(twin[proc], op)(*args)))
                except ValueError as exc:
                    results.append(("ValueError", str(exc)))
            assert results[0] == results[1], (op, args)
        assert bytes(maps[0].buffer) == bytes(maps[1].buffer)
    finally:
        for m in maps:
            m.remove()


def test_slots_hold_the_limit_across_processes_and_a_cleared_process_gives_its_back(
    core_class: Any, mapping: Mapping
) -> None:
    a, b = core_class(mapping, 0), core_class(mapping, 1)
    assert [a.acquire(8) for _ in range(5)] == [True] * 5
    assert [b.acquire(8) for _ in range(5)] == [True, True, True, False, False]
    assert (a.total(), a.held(0), a.held(1)) == (8, 5, 3)
    assert give_back_slots(mapping, 0, "orchestrator-0") == 5  # what cli.py's parent does for a dead child
    assert (b.total(), b.acquire(8)) == (3, True)
    with pytest.raises(ValueError, match=r"process index 2 out of 0\.\.1"):
        core_class(mapping, 2)
    with pytest.raises(ValueError, match="key 0"):
        a.entry(BUCKETS, 0)
    with pytest.raises(ValueError, match="entry 64 out of"):
        a.take(64, 0, 1, MINUTE_NS)


def test_a_table_that_is_full_says_so(core_class: Any, mapping: Mapping) -> None:
    core = core_class(mapping, 0)
    entries = {core.entry(BREAKERS, key) for key in range(1, 17)}
    assert entries == set(range(16))
    assert core.entry(BREAKERS, 17) == -1
    assert core.entry(BREAKERS, 5) == (5 % 16)  # an existing key is found, a full table or not


def test_a_mapping_that_is_not_one_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a fastcore fleet mapping"):
        Mapping.attach(str(path))


def _hold(path: str, index: int, limit: int, ready: Any) -> None:
    core = fleet_module.Core(Mapping.attach(path), index)
    held = sum(core.acquire(limit) for _ in range(limit))
    ready.put(held)
    signal.pause()


def test_a_killed_process_s_slots_come_back() -> None:
    mapping = Mapping.create(2)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_hold, args=(mapping.path, 1, 8, ready), name="orchestrator-1")
    proc.start()
    try:
        assert ready.get(timeout=60) == 8
        core = fleet_module.Core(mapping, 0)
        assert not core.acquire(8)  # the other process holds all 8
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        assert give_back_slots(mapping, 1, proc.name) == 8
        assert core.acquire(8) and core.total() == 1
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        mapping.remove()


def _race(path: str, index: int, limit: int, rounds: int, holders: Any, worst: Any) -> None:
    core = fleet_module.Core(Mapping.attach(path), index)
    for _ in range(rounds):
        if core.acquire(limit):
            with holders.get_lock():
                holders.value += 1
                worst.value = max(worst.value, holders.value)
            with holders.get_lock():
                holders.value -= 1
            core.release()


def test_two_real_processes_racing_never_hold_more_than_the_limit() -> None:
    """Each takes and gives back a slot 20000 times against a limit of 2: the slots held at once
    (counted beside, under a lock) never pass 2, and none is left held."""
    mapping = Mapping.create(2)
    ctx = multiprocessing.get_context("spawn")
    holders, worst = ctx.Value("i", 0), ctx.Value("i", 0)
    procs = [ctx.Process(target=_race, args=(mapping.path, i, 2, 20000, holders, worst)) for i in range(2)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
            assert proc.exitcode == 0
        assert 1 <= worst.value <= 2
        assert fleet_module.Core(mapping, 0).total() == 0
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
        mapping.remove()


# -- admission on the fleet -----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000 * SECOND

    def __call__(self) -> int:
        return self.now


def fleet_admissions(mapping: Mapping, config: AdmissionConfig, clock: FakeClock) -> list[Admission]:
    admissions = []
    for index in range(2):
        fleet = Fleet(mapping, index)
        fleet.clock = clock
        admission = Admission(config, Registry(), retry_after_s=1)
        admission.share(fleet)
        admissions.append(admission)
    return admissions


def admitted_per_minute(admissions: list[Admission | Any], clock: FakeClock, minutes: int) -> list[int]:
    """A client at 480 requests a minute (4x the limit), its requests alternating between the
    processes: what each minute admitted."""
    tenant = Tenant("alpha")
    counts = []
    for _ in range(minutes):
        admitted = 0
        for i in range(480):
            clock.now += SECOND // 8
            try:
                admissions[i % 2].slot(tenant, BODY)
                admitted += 1
            except HTTPError as exc:
                assert exc.status == 429 and exc.code == "requests_per_minute"
        counts.append(admitted)
    return counts


def test_a_tenant_limit_holds_for_the_fleet_not_per_process(
    use_core: Any, mapping: Mapping, monkeypatch: pytest.MonkeyPatch
) -> None:
    """120 requests a minute, a client at 4x spread over both processes: the first minute admits
    the full bucket and its refill (240, as one process would), every later one 120 +- 10%, where
    each process's own bucket admits 240 a minute."""
    config = AdmissionConfig(rate_limits={"*": {"requests_per_minute": 120}})
    clock = FakeClock()
    counts = admitted_per_minute(fleet_admissions(mapping, config, clock), clock, 4)
    assert abs(counts[0] - 240) <= 2
    assert all(108 <= count <= 132 for count in counts[1:]), counts
    # the per-process path on the same clock: each process's bucket admits the limit
    monkeypatch.setattr("server.orchestrator.admission.time.monotonic", lambda: clock.now / 1e9)
    apart = [Admission(config, Registry(), retry_after_s=1) for _ in range(2)]
    assert all(230 <= count <= 250 for count in admitted_per_minute(apart, clock, 3)[1:])


def test_prompt_tokens_are_shared_and_corrected_to_the_usage(use_core: Any, mapping: Mapping) -> None:
    """600 prompt tokens a minute: a 400-token prompt in one process leaves 200 to the other; its
    usage (100 tokens) gives 300 back; a refused prompt gives back its request."""
    config = AdmissionConfig(rate_limits={"*": {"prompt_tokens_per_minute": 600, "requests_per_minute": 10}})
    clock = FakeClock()
    first, second = fleet_admissions(mapping, config, clock)
    tenant = Tenant("alpha")
    prompt = b'{"prompt":"' + b"x" * (400 * 4 - 2) + b'"}'  # 1600 bytes of span: 400 tokens at 4 bytes
    slot = first.slot(tenant, prompt)
    assert slot.charge is not None and slot.charge.tokens == 400
    with pytest.raises(HTTPError) as refused:
        second.slot(tenant, prompt)
    assert refused.value.code == "prompt_tokens_per_minute"
    slot.charge.settle(100)
    second.slot(tenant, prompt)  # 300 back: 500 there
    # the requests bucket: 10 a minute, 2 taken (the refused one gave its back)
    taken = 0
    for _ in range(10):
        try:
            second.slot(tenant, BODY)
            taken += 1
        except HTTPError as exc:
            assert exc.code == "requests_per_minute"
    assert taken == 8


async def test_max_inflight_8_holds_8_across_two_processes(use_core: Any, mapping: Mapping) -> None:
    """Two processes' admissions, 12 completions each: 8 run at once, not 16; each one that ends
    lets a waiter in, in the process that freed it or in the other (which looks every POLL_S)."""
    config = AdmissionConfig(max_inflight=8)
    admissions = fleet_admissions(mapping, config, FakeClock())
    tenant = Tenant("alpha")
    running, most = 0, 0
    gates: list[asyncio.Event] = []

    async def completion(admission: Admission) -> None:
        nonlocal running, most
        gate = asyncio.Event()
        async with admission.slot(tenant, BODY):
            running += 1
            most = max(most, running)
            gates.append(gate)
            await gate.wait()
            running -= 1

    tasks = [asyncio.ensure_future(completion(admissions[i % 2])) for i in range(24)]
    finished = 0
    while finished < 24:
        while len(gates) < min(24, finished + 8):
            await asyncio.sleep(0.001)
        assert running == min(8, 24 - finished) and most <= 8
        assert sum(a.inflight for a in admissions) == running == admissions[0].fleet.core.total()
        gates[finished].set()
        finished += 1
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert most == 8 and admissions[0].fleet.core.total() == 0


# -- breakers -------------------------------------------------------------------------------------


def test_a_breaker_opened_in_one_process_is_honoured_by_the_other_until_its_own_probe(
    use_core: Any, mapping: Mapping
) -> None:
    clock = FakeClock()
    fleets, pools = [], []
    for index in range(2):
        fleet = Fleet(mapping, index)
        fleet.clock = clock
        fleets.append(fleet)
        pools.append(Pool("context", ["http://127.0.0.1:9"], "round_robin", breaker_open_s=5.0))
    mine, theirs = (pool.workers[0].breaker for pool in pools)
    for fleet, pool in zip(fleets, pools):
        fleet.sync_breakers([pool])
    for _ in range(3):
        mine.failed()
    assert mine.state == mine.OPEN and theirs.state == theirs.CLOSED
    clock.now = round(mine.opened_at * 1e9)
    fleets[0].sync_breakers([pools[0]])  # published
    fleets[1].sync_breakers([pools[1]])  # honoured
    assert theirs.state == theirs.OPEN
    at = clock.now / 1e9
    assert not theirs.allows(at + 4.9)
    assert theirs.allows(at + 5.01)  # its own half-open probe, one
    theirs.chosen()
    assert not theirs.allows(at + 5.02)
    theirs.succeeded()  # its probe succeeded: closed, and the end it knew withdrawn
    clock.now += 5_100_000_000
    fleets[1].sync_breakers([pools[1]])
    assert theirs.state == theirs.CLOSED
    assert fleets[0].core.until(fleets[0]._breakers[("context", "http://127.0.0.1:9")][0]) == 0
    fleets[0].sync_breakers([pools[0]])
    fleets[1].sync_breakers([pools[1]])
    assert theirs.state == theirs.CLOSED  # a withdrawn end is not honoured again


def test_a_full_bucket_table_keeps_that_tenant_s_limit_per_process(
    use_core: Any, caplog: pytest.LogCaptureFixture
) -> None:
    mapping = Mapping.create(2, buckets=2, breakers=2)
    try:
        config = AdmissionConfig(rate_limits={"*": {"requests_per_minute": 1}})
        first, second = fleet_admissions(mapping, config, FakeClock())
        first.slot(Tenant("alpha"), BODY)  # alpha's bucket: one entry of two
        with pytest.raises(HTTPError):
            second.slot(Tenant("alpha"), BODY)  # shared: alpha had its one
        first.slot(Tenant("beta"), BODY)  # the second entry
        with caplog.at_level("WARNING", logger="fastcore.orchestrator"):
            first.slot(Tenant("gamma"), BODY)  # no entry left: per process
            second.slot(Tenant("gamma"), BODY)  # its own bucket in the other process
        assert (
            "the rate-limit table is full (2 buckets): tenant gamma's requests_per_minute is per process"
            in (caplog.text)
        )
    finally:
        mapping.remove()


def test_a_full_breaker_table_keeps_that_worker_s_breaker_per_process(
    use_core: Any, caplog: pytest.LogCaptureFixture
) -> None:
    mapping = Mapping.create(2, buckets=2, breakers=1)
    try:
        urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
        fleets = [Fleet(mapping, i) for i in range(2)]
        pools = [Pool("context", urls, "round_robin") for _ in range(2)]
        with caplog.at_level("WARNING", logger="fastcore.orchestrator"):
            for fleet, pool in zip(fleets, pools):
                fleet.sync_breakers([pool])
        assert (
            "the breaker table is full (1 workers): http://127.0.0.1:10's breaker is per process"
            in caplog.text
        )
        for _ in range(3):
            pools[0].workers[1].breaker.failed()
        for fleet, pool in zip(fleets, pools):
            fleet.sync_breakers([pool])
        assert pools[1].workers[1].breaker.state == pools[1].workers[1].breaker.CLOSED
        # a worker gone from the pools (which replace their member list) is forgotten at the next exchange
        pools[0].workers = pools[0].workers[:1]
        fleets[0].sync_breakers([pools[0]])
        assert list(fleets[0]._breakers) == [("context", urls[0])]
    finally:
        mapping.remove()


async def test_the_breaker_exchange_runs_on_its_own(use_core: Any, mapping: Mapping) -> None:
    """Fleet.start: the exchange as a task on the loop (every BREAKER_SYNC_S), stopped by stop()."""
    fleets = [Fleet(mapping, i) for i in range(2)]
    pools = [Pool("generation", ["http://127.0.0.1:9"], "round_robin") for _ in range(2)]
    for fleet, pool in zip(fleets, pools):
        fleet.start([pool])
    try:
        await asyncio.sleep(0.05)
        pools[0].workers[0].breaker.failed(at_once=True)
        theirs = pools[1].workers[0].breaker
        for _ in range(500):
            if theirs.state == theirs.OPEN:
                break
            await asyncio.sleep(0.01)
        assert theirs.state == theirs.OPEN
    finally:
        for fleet in fleets:
            await fleet.stop()
    assert all(fleet._sync is None for fleet in fleets)


def test_an_exchange_with_nothing_new_is_skipped_and_a_new_end_is_not(
    use_core: Any, mapping: Mapping
) -> None:
    """The exchange reads the published ends' generation and the pools' epoch first: a quiet one
    does nothing; an end published by another process (the generation bumped) is honoured."""
    clock = FakeClock()
    fleet = Fleet(mapping, 1)
    fleet.clock = clock
    pool = Pool("context", ["http://127.0.0.1:9"], "round_robin")
    fleet.sync_breakers([pool])
    seen = fleet._seen
    fleet.sync_breakers([pool])
    assert fleet._seen is seen  # skipped
    other = fleet_module.Core(mapping, 0)
    entry = other.entry(BREAKERS, fleet_module.key_of("breaker", "context", "http://127.0.0.1:9"))
    before = other.generation()
    other.publish(entry, clock.now + 3 * SECOND)
    assert other.generation() == before + 1
    fleet.sync_breakers([pool])
    breaker = pool.workers[0].breaker
    assert breaker.state == breaker.OPEN and abs(breaker.open_for - 3.0) < 1e-6
    assert other.withdraw(entry, clock.now + 3 * SECOND) and other.generation() == before + 2


@pytest.mark.parametrize("shared", [False, True], ids=["per-process", "fleet"])
async def test_a_waiter_cancelled_in_the_pass_its_slot_frees_is_passed_over(
    shared: bool, use_core: Any, mapping: Mapping
) -> None:
    """A queued client leaves (its task cancelled: its future is cancelled at once, its handler runs
    on the next pass) in the same pass as a slot is given back: the slot goes to the next in line,
    not to the cancelled future (which raised InvalidStateError in the releasing request and lost
    the slot)."""
    config = AdmissionConfig(max_inflight=1)
    admission = (
        fleet_admissions(mapping, config, FakeClock())[0]
        if shared
        else Admission(config, Registry(), retry_after_s=1)
    )
    tenant = Tenant("alpha")
    holder = admission.slot(tenant, BODY)
    await holder.__aenter__()
    entered: list[str] = []

    async def wait(name: str) -> None:
        async with admission.slot(tenant, BODY):
            entered.append(name)
            await asyncio.sleep(3600)

    leaving = asyncio.ensure_future(wait("leaving"))
    staying = asyncio.ensure_future(wait("staying"))
    while admission.queued < 2:
        await asyncio.sleep(0)
    leaving.cancel()
    await holder.__aexit__(None, None, None)  # in the same pass
    while not entered:
        await asyncio.sleep(0)
    assert entered == ["staying"] and admission.inflight == 1 and admission.queued == 0
    if shared:
        assert admission.fleet is not None and admission.fleet.core.total() == 1
    staying.cancel()
    await asyncio.gather(leaving, staying, return_exceptions=True)
    assert admission.inflight == 0
    if shared:
        assert admission.fleet is not None and admission.fleet.core.total() == 0


async def test_a_waiter_cancelled_in_the_pass_it_is_pushed_out_is_passed_over() -> None:
    """A full queue's newcomer takes the place of the heaviest tenant's last in line, whose client
    left in the same loop pass (its future already cancelled): the place is taken, no
    InvalidStateError in the newcomer's request."""
    admission = Admission(AdmissionConfig(max_inflight=1, max_queue=2), Registry(), retry_after_s=1)
    heavy, light = Tenant("heavy"), Tenant("light")
    holder = admission.slot(heavy, BODY)
    await holder.__aenter__()

    async def wait(tenant: Tenant) -> None:
        async with admission.slot(tenant, BODY):
            await asyncio.sleep(3600)

    first = asyncio.ensure_future(wait(heavy))
    while admission.queued < 1:
        await asyncio.sleep(0)
    leaving = asyncio.ensure_future(wait(heavy))
    while admission.queued < 2:
        await asyncio.sleep(0)

    async def newcomer() -> None:
        leaving.cancel()  # its handler runs on the next pass; the newcomer pushes in this one
        await wait(light)

    coming = asyncio.ensure_future(newcomer())
    while not leaving.done():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not coming.done() and admission.queued == 2
    for task in (first, coming):
        task.cancel()
    await asyncio.gather(first, leaving, coming, return_exceptions=True)
    await holder.__aexit__(None, None, None)
    assert admission.inflight == 0 and admission.queued == 0
