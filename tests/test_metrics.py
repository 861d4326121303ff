"""server.metrics through prometheus_client: the same page as the hand-written registry had, one
registry per server, scrape-time values, and ``orchestrator --workers N`` answering the sum.

The hand-written registry lives on in ``bench/metrics_cost.py`` (:class:`OldRegistry`): the pages are
compared series by series (names, labels, values). What changed, on purpose, is how numbers are
written: prometheus_client writes floats as Go does (``1.0``, ``2.686976e+08``), bucket bounds
included (``le="1.0"`` where it was ``le="1"``), so ``le`` is compared as a number.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import prometheus_client
import pytest
from helpers import eventually_blocking, free_port, listening_pids
from prometheus_client.multiprocess import MultiProcessCollector

from bench.metrics_cost import OldRegistry
from server import metrics
from server.metrics import CONTENT_TYPE, MULTIPROC_ENV, Registry, SharedMetricsDir, scraped_families
from server.orchestrator.app import Orchestrator
from server.orchestrator.config import build_config
from server.orchestrator.metrics import (
    BoundHistogram,
    CountOne,
    OrchestratorMetrics,
    TallyHistogram,
    TallyOne,
    bind_counter,
    bind_histogram,
)
from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SyntheticEngine

ROOT = Path(__file__).resolve().parent.parent
SECRET = "metrics-test-secret-0123456789abcdef"

# -- the page, parsed -----------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}

Series = tuple[str, frozenset[tuple[str, str]]]


def parse(text: str) -> tuple[dict[str, tuple[str, str]], dict[Series, float]]:
    """(family -> (type, help), series -> value) of a Prometheus text page; ``le`` as a number."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: dict[Series, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            types[name] = kind
        elif line:
            match = _SAMPLE.match(line)
            assert match, line
            name, labels, value = match.groups()
            pairs = []
            for key, raw in _LABEL.findall(labels or ""):
                text_value = re.sub(r'\\[\\n"]', lambda m: _UNESCAPE[m.group(0)], raw)
                pairs.append((key, repr(float(text_value)) if key == "le" else text_value))
            series = (name, frozenset(pairs))
            assert series not in samples, line
            samples[series] = float(value)
    assert helps.keys() == types.keys()
    return {n: (types[n], helps[n]) for n in types}, samples


def value(text: str, name: str, **labels: str) -> float | None:
    return parse(text)[1].get((name, frozenset(labels.items())))


# -- one process ----------------------------------------------------------------------------


def populate(r: Any, state: dict[str, float]) -> None:
    """Each kind of metric, labelled and not, bound and not, with a callback or not."""
    requests = r.counter("t_requests_total", "Requests by route and status.", ("route", "status"))
    requests.labels(route="chat", status="200").inc()
    requests.labels(route="chat", status="200").inc(2)
    requests.inc(route="completions", status="499")
    requests.inc(route='we"ird\\ro\nute', status="200")  # escaped in the page
    r.counter("t_plain_total", "Unlabelled.").labels().inc(3)
    r.counter("t_empty_total", "Labelled, no series yet.", ("reason",))
    r.counter("t_refused_total", "A total kept elsewhere.", callback=lambda: state["refused"])
    level = r.gauge("t_level", "A labelled gauge.", ("pool",))
    level.set(4, pool="a")
    level.dec(pool="a")
    level.inc(pool="b")
    level.inc(2.5, pool="b")
    r.gauge("t_unset", "An unlabelled gauge never set.")
    r.gauge("t_kv_used_tokens", "A level read at scrape time.", callback=lambda: state["kv"])
    latency = r.histogram("t_seconds", "A labelled histogram.", ("route",))
    for seconds in (0.00004, 5e-5, 0.003, 1.0, 119.0, 500.0):  # below, on, between bounds, beyond the last
        latency.observe(seconds, route="chat")
    latency.labels(route="completions")
    r.histogram("t_leg_seconds", "An unlabelled histogram.").labels().observe(0.02)
    r.histogram("t_custom_seconds", "Own buckets.", buckets=(0.5, 0.1, 1)).labels().observe(0.3)


def test_the_page_has_the_series_the_hand_written_registry_had():
    state = {"refused": 7, "kv": 268_697_600}
    old, new = OldRegistry(), Registry()
    populate(old, state)
    populate(new, state)
    old_families, old_samples = parse(old.render().decode())
    text = new.render().decode()
    new_families, new_samples = parse(text)
    assert new_families == old_families
    assert new_samples == old_samples
    assert "_created" not in text
    assert value(text, "t_kv_used_tokens") == 268_697_600
    assert value(text, "t_seconds_bucket", route="chat", le=repr(0.0001)) == 2
    assert value(text, "t_seconds_bucket", route="chat", le="inf") == 6
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_a_bound_histogram_observes_what_the_prometheus_child_does():
    """BoundHistogram (the orchestrator's per-request histograms) puts each value in the bucket and
    sum prometheus_client's own observe does: below, on and between bounds, beyond the last, zero,
    negative, +Inf and NaN (the sum alone); the two pages are the same but for the name."""
    r = Registry()
    own = r.histogram("t_own_seconds", "prometheus_client's observe.").labels()
    bound = BoundHistogram(r.histogram("t_bound_seconds", "BoundHistogram's.").labels())
    custom = r.histogram("t_own_custom_seconds", "Own buckets.", buckets=(0.5, 0.1, 1)).labels()
    bound_custom = BoundHistogram(
        r.histogram("t_bound_custom_seconds", "Own buckets.", buckets=(0.5, 0.1, 1)).labels()
    )
    amounts = (
        0.0,
        -1.0,
        0.00004,
        5e-5,
        5.1e-5,
        0.003,
        0.1,
        0.3,
        1.0,
        119.0,
        120.0,
        500.0,
        float("inf"),
        float("nan"),
    )
    for amount in amounts:
        own.observe(amount)
        bound.observe(amount)
        custom.observe(amount)
        bound_custom.observe(amount)
    lines = r.render().decode().splitlines()
    for a, b in (("t_own_seconds", "t_bound_seconds"), ("t_own_custom_seconds", "t_bound_custom_seconds")):
        mine = [line.replace(b, a) for line in lines if line.startswith(b)]
        assert mine == [line for line in lines if line.startswith(a)] and len(mine) > 3
    assert bound.native is not None


def test_a_count_one_child_counts_on_the_prometheus_childs_value():
    """CountOne (the orchestrator's per-request counters) adds one to the child's own value per call:
    the page reads its count, beside the child's own inc; another registry's child is left as it is."""
    r = Registry()
    family = r.counter("t_counted_total", "Counted.", ("path",))
    child = family.labels(path="a")
    counted = bind_counter(child)
    assert isinstance(counted, CountOne) and counted.native is child
    for _ in range(3):
        counted.inc()
    child.inc(2)
    assert value(r.render().decode(), "t_counted_total", path="a") == 5
    old_child = OldRegistry().counter("t_old_total", "Old.", ("path",)).labels(path="a")
    assert bind_counter(old_child) is old_child


def test_tallies_reach_the_page_at_each_sync_and_each_read():
    """TallyOne and TallyHistogram (the orchestrator's hot-path counts) keep their counts in plain
    numbers: prometheus_client's values stay as they were until the registry syncs (a scrape, a
    read of a value), then read what an immediate child would."""
    r = Registry()
    counter = r.counter("t_tally_total", "Tallied.", ("path",))
    tally = bind_counter(counter.labels(path="a"), r)
    hist = r.histogram("t_tally_seconds", "Tallied.", ("phase",))
    observed = bind_histogram(hist.labels(phase="x"), r)
    assert isinstance(tally, TallyOne) and isinstance(observed, TallyHistogram)
    for _ in range(3):
        tally.inc()
    for amount in (0.0, 0.004, 0.3, 500.0, float("inf")):
        observed.observe(amount)
    assert tally.native._value.get() == 0.0  # not yet: no lock taken per count
    assert counter.get(path="a") == 3  # a read syncs
    assert hist.count(phase="x") == 5
    tally.inc()
    assert value(r.render().decode(), "t_tally_total", path="a") == 4  # so does a scrape
    assert tally.n == 0 and not observed.pending


def exercise(m: OrchestratorMetrics, orchestrator: Orchestrator) -> None:
    orchestrator.in_flight = 3
    m.count_request("chat", 200)
    m.count_request("completions", 502)
    m.retries_leg["context"].inc()
    m.kv_released.labels(status="404").inc()
    m.worker_healthy.set(1.0, pool="context", url="http://127.0.0.1:1")
    m.context_leg.observe(0.004)
    m.handoff.observe(0.0001)
    m.generation_ttfb.observe(0.02)
    m.finished_by_context.inc()
    for phase, clock in m.cpu_phase.items():
        clock.observe(0.0002 if phase == "total" else 0.00003)


def orchestrator_config() -> Any:
    return build_config(
        {
            "port": free_port(),
            "shared_secret": SECRET,
            "context_servers": {"urls": ["127.0.0.1:1"]},
            "generation_servers": {"urls": ["127.0.0.1:2"]},
        },
        environ={},
    )


def test_the_orchestrators_page_is_the_one_it_had():
    orchestrator = Orchestrator(orchestrator_config())
    orchestrator.context_pool.workers[0].in_flight = 2  # set from the pools at each scrape
    old_registry = OldRegistry()
    old = OrchestratorMetrics(old_registry, orchestrator)
    exercise(old, orchestrator)
    exercise(orchestrator.metrics, orchestrator)
    old_page = parse(old_registry.render().decode())
    text = orchestrator.registry.render().decode()
    assert parse(text) == old_page
    assert value(text, "fastcore_orchestrator_requests_in_flight") == 3
    assert (
        value(text, "fastcore_orchestrator_worker_in_flight", pool="context", url="http://127.0.0.1:1") == 2
    )
    # the test helper's reading (tests/test_orchestrator_functional.py's RunningOrchestrator.metric)
    by_name = {m.name: m for m in orchestrator.registry.metrics}
    assert by_name["fastcore_orchestrator_requests_total"].get(route="completions", status="502") == 1
    assert by_name["fastcore_orchestrator_requests_in_flight"].get() == 3
    assert by_name["fastcore_orchestrator_retries_total"].get(leg="generation") == 0
    assert by_name["fastcore_orchestrator_cpu_seconds"].count(phase="total") == 1
    assert by_name["fastcore_orchestrator_context_leg_seconds"].count() == 1


WORKER_FAMILIES = {
    "fastcore_worker_requests_total": "counter",
    "fastcore_worker_queue_depth": "gauge",
    "fastcore_worker_running_sequences": "gauge",
    "fastcore_worker_kv_used_tokens": "gauge",
    "fastcore_worker_kv_capacity_tokens": "gauge",
    "fastcore_worker_kv_usage_ratio": "gauge",
    "fastcore_worker_kv_parked": "gauge",
    "fastcore_worker_kv_parked_tokens": "gauge",
    "fastcore_worker_decode_tokens_per_second": "gauge",
    "fastcore_worker_prompt_tokens_total": "counter",
    "fastcore_worker_prefix_cache_hit_tokens_total": "counter",
    "fastcore_worker_prefill_computed_tokens_total": "counter",
    "fastcore_worker_prefix_cache_tokens": "gauge",
    "fastcore_worker_prefix_cache_evicted_blocks_total": "counter",
    "fastcore_worker_generated_tokens_total": "counter",
    "fastcore_worker_kv_handoff_total": "counter",
    "fastcore_worker_kv_fetch_failures_total": "counter",
    "fastcore_worker_rejected_total": "counter",
    "fastcore_worker_admission_waits_total": "counter",
    "fastcore_worker_waiting_for_kv": "gauge",
    "fastcore_worker_time_to_first_token_seconds": "histogram",
    "fastcore_worker_request_seconds": "histogram",
    "fastcore_worker_client_connections": "gauge",
    "fastcore_worker_connections_refused_total": "counter",
    "fastcore_worker_http_framing_errors_total": "counter",
}  # the hand-written registry's page of a synthetic worker before the switch, and the prefix cache's


async def test_two_workers_in_one_process_keep_their_own_metrics():
    started = []
    try:
        for _ in range(2):
            engine = SyntheticEngine(16)
            server, port = await start_worker(engine, WorkerSettings(role="both", model_name="synthetic"))
            started.append((server, port, engine))
        body = {"model": "synthetic", "prompt": "hi", "max_tokens": 3}
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(f"http://127.0.0.1:{started[0][1]}/v1/completions", json=body) as resp:
                    assert resp.status == 200
            pages = []
            for _server, port, _engine in started:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert resp.headers["Content-Type"] == CONTENT_TYPE
                    pages.append(await resp.text())
    finally:
        for server, _port, _engine in started:
            await server.cleanup()
    families = [{n: kind for n, (kind, _help) in parse(page)[0].items()} for page in pages]
    assert families == [WORKER_FAMILIES, WORKER_FAMILIES]
    ok = {"route": "completions", "status": "200"}
    assert value(pages[0], "fastcore_worker_requests_total", **ok) == 2
    assert value(pages[1], "fastcore_worker_requests_total", **ok) is None
    assert value(pages[0], "fastcore_worker_generated_tokens_total") == 6
    assert value(pages[0], "fastcore_worker_kv_capacity_tokens") == started[0][2].kv_capacity_tokens
    # nothing went to the global registry of prometheus_client
    assert not [n for n in prometheus_client.REGISTRY._names_to_collectors if n.startswith("fastcore")]


def test_callbacks_are_read_at_each_scrape():
    state = {"level": 1.0, "total": 10.0}
    r = Registry()
    r.gauge("t_level", "Level.", callback=lambda: state["level"])
    r.counter("t_done_total", "Done.", callback=lambda: state["total"])
    assert value(r.render().decode(), "t_level") == 1
    state["level"], state["total"] = 0.25, 12
    text = r.render().decode()
    assert value(text, "t_level") == 0.25 and value(text, "t_done_total") == 12
    hooked = []
    r.before_collect(lambda: hooked.append(1))
    r.render()
    assert hooked == [1]


def test_scraped_families_read_their_object_at_each_scrape():
    """server.metrics.scraped_families (the worker's engine and HTTP server, the orchestrator's): an
    attribute, a dotted one, a function of the object; 0 while there is none (a server not listening)."""
    state = SimpleNamespace(level=2, total=5, rates=SimpleNamespace(per_s=1.5))
    source: list[Any] = [None]
    r = Registry()
    scraped_families(
        r,
        lambda: source[0],
        [
            ("gauge", "t_level", "Level.", "level"),
            ("counter", "t_seen_total", "Seen.", "total"),
            ("gauge", "t_rate", "Rate.", "rates.per_s"),
            ("gauge", "t_double", "Twice the level.", lambda s: s.level * 2),
        ],
    )
    families, samples = parse(r.render().decode())
    assert {name: kind for name, (kind, _help) in families.items()} == {
        "t_level": "gauge", "t_seen_total": "counter", "t_rate": "gauge", "t_double": "gauge",
    }  # fmt: skip
    assert set(samples.values()) == {0.0}
    source[0] = state
    text = r.render().decode()
    assert [value(text, n) for n in ("t_level", "t_seen_total", "t_rate", "t_double")] == [2, 5, 1.5, 4]
    state.level = 3
    assert value(r.render().decode(), "t_double") == 6
    with pytest.raises(ValueError, match="a counter or a gauge, not 'histogram'"):
        scraped_families(r, lambda: state, [("histogram", "t_odd_seconds", "Odd.", "level")])


def test_names_and_labels_that_would_change_are_refused():
    r = Registry()
    with pytest.raises(ValueError, match="_total"):
        r.counter("t_requests", "Not ending in _total: prometheus_client would render t_requests_total.")
    with pytest.raises(ValueError, match="gauge t_level: a callback gauge has no labels"):
        r.gauge("t_level", "A callback has one value.", ("pool",), callback=lambda: 1)
    with pytest.raises(ValueError, match="counter t_seen_total: a callback counter has no labels"):
        r.counter("t_seen_total", "A callback has one value.", ("pool",), callback=lambda: 1)
    r.counter("t_once_total", "Once.")
    with pytest.raises(ValueError, match="twice"):
        r.gauge("t_once_total", "Twice.")


# -- multiprocess mode ----------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from server.metrics import MULTIPROCESS, Registry

    assert MULTIPROCESS
    what, refused, conns, healthy, done = sys.argv[1], *map(int, sys.argv[2:])
    r = Registry()
    state = {"refused": refused, "conns": conns}
    if what == "serve":
        r.counter("t_refused_total", "Refused.", callback=lambda: state["refused"])
        r.gauge("t_conns", "Open.", callback=lambda: state["conns"])
        r.gauge("t_healthy", "Healthy.", ("url",), multiprocess_mode="livemin").set(healthy, url="a")
        r.counter("t_requests_total", "Requests.", ("route",)).inc(done, route="chat")
        r.histogram("t_seconds", "Seconds.").labels().observe(0.003)
        r.sync()
        state["refused"] += 1  # written as what it grew by
        state["conns"] += 1

        async def timer():  # keep_synced writes without a scrape
            task = asyncio.ensure_future(r.keep_synced(0.02))
            await asyncio.sleep(0.3)
            task.cancel()

        asyncio.run(timer())
        files = CollectorRegistry()
        MultiProcessCollector(files)
        page = generate_latest(files).decode()  # the files as another process reads them
    else:
        page = r.render().decode()
    print(json.dumps({"pid": os.getpid(), "page": page}))
    """
)


def child(what: str, *numbers: int) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, what, *map(str, numbers or (0, 0, 0, 0))],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    answer = json.loads(out.stdout)
    return answer["pid"], answer["page"]


def test_multiprocess_sums_processes_and_forgets_dead_ones_gauges():
    before = os.environ.get(MULTIPROC_ENV)
    shared = SharedMetricsDir()
    try:
        with shared.exported() as path:
            assert os.environ[MULTIPROC_ENV] == path
            pid_a, page_a = child("serve", 3, 2, 1, 5)
            pid_b, page = child("serve", 10, 4, 0, 7)
            _, both = child("render")
        assert os.environ.get(MULTIPROC_ENV) == before  # the parent's own environment as it was
        assert value(page_a, "t_refused_total") == 4 and value(page_a, "t_conns") == 3  # timer-synced
        assert value(page, "t_refused_total") == 4 + 11
        for text in (page, both):
            assert value(text, "t_requests_total", route="chat") == 12
            assert value(text, "t_conns") == 3 + 5  # livesum
            assert value(text, "t_healthy", url="a") == 0  # livemin
            assert value(text, "t_seconds_count") == 2
            assert value(text, "t_seconds_bucket", le=repr(0.005)) == 2
            assert "pid=" not in text
        shared.process_dead(pid_a)
        with shared.exported():
            _, after_a = child("render")
        assert value(after_a, "t_conns") == 5 and value(after_a, "t_healthy", url="a") == 0
        assert value(after_a, "t_requests_total", route="chat") == 12  # counters stay counted
        assert value(after_a, "t_refused_total") == 15
        shared.process_dead(pid_b)
        with shared.exported():
            _, after_b = child("render")
        assert value(after_b, "t_conns") is None and value(after_b, "t_healthy", url="a") is None
        assert value(after_b, "t_requests_total", route="chat") == 12
    finally:
        shared.remove()
    assert not os.path.exists(shared.path)
    assert not metrics.MULTIPROCESS  # this process never was


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # one connection each
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _serving(url: str, procs: list[subprocess.Popen[bytes]], times: int, timeout: float = 120.0) -> None:
    """``times`` answers 200 in a row on fresh connections (with N processes: every one ready)."""
    deadline = time.monotonic() + timeout
    row = 0
    while row < times:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout} s")
        try:
            row = row + 1 if _get(url, timeout=2)[0] == 200 else 0
        except OSError:
            row = 0
        if row == 0:
            time.sleep(0.1)


def test_orchestrator_processes_answer_the_sum_on_every_scrape(tmp_path):
    requests, scrapes = 40, 12
    env = {k: v for k, v in os.environ.items() if k.upper() != MULTIPROC_ENV}
    env["FASTCORE_SHARED_SECRET"] = SECRET
    env["TMPDIR"] = str(tmp_path)  # where the parent makes its metrics directory
    worker_port, port = free_port(), free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--role", "both",
         "--prompt-tokens", "16", "--port", str(worker_port)],
        cwd=ROOT, env=env,
    )  # fmt: skip
    orchestrator = None
    try:
        _serving(f"http://127.0.0.1:{worker_port}/health", [worker], 1)
        orchestrator = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port), "--workers", "2",
             "--context-urls", f"127.0.0.1:{worker_port}", "--generation-urls", f"127.0.0.1:{worker_port}",
             "--health-check-interval-s", "0.2", "--log-level", "WARNING"],
            cwd=ROOT, env=env,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _serving(url + "/health", [worker, orchestrator], 20)
        # Both processes listening, each after its first health round: until the second does, the
        # first takes every connection (and a share of 0 would be the second's).
        assert eventually_blocking(lambda: len(listening_pids(port)) == 2, timeout=60)
        (metrics_dir,) = glob.glob(str(tmp_path / "fastcore-metrics-*"))
        body = {"model": "synthetic", "prompt": "hi", "max_tokens": 2}
        statuses = [_post(url + "/v1/completions", body) for _ in range(requests)]
        assert statuses == [200] * requests
        # Each process counted its own share: the kernel spread the connections over both.
        # A request is counted just after its response is written: the last may lag the client.
        deadline = time.monotonic() + 5.0
        while True:
            shares = []
            for path in sorted(glob.glob(os.path.join(metrics_dir, "counter_*.db"))):
                (family,) = [m for m in MultiProcessCollector.merge([path]) if m.name.endswith("requests")]
                shares.append(sum(s.value for s in family.samples))
            if sum(shares) == requests or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(shares) == 2 and all(shares) and sum(shares) == requests, shares
        # The other process's in-flight levels are at most one sync old (SYNC_INTERVAL_S).
        deadline = time.monotonic() + 10 * metrics.SYNC_INTERVAL_S
        while value(_get(url + "/metrics")[1].decode(), "fastcore_orchestrator_requests_in_flight") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(metrics.SYNC_INTERVAL_S * 1.5)  # and the per-worker ones, written in the same sync
        ok = {"route": "completions", "status": "200"}
        for _ in range(scrapes):
            status, page = _get(url + "/metrics")
            assert status == 200
            text = page.decode()
            assert value(text, "fastcore_orchestrator_requests_total", **ok) == requests
            assert value(text, "fastcore_orchestrator_context_leg_seconds_count") == requests
            assert value(text, "fastcore_orchestrator_generation_ttfb_seconds_count") == requests
            for pool in ("context", "generation"):
                where = {"pool": pool, "url": f"http://127.0.0.1:{worker_port}"}
                assert value(text, "fastcore_orchestrator_worker_healthy", **where) == 1
                assert value(text, "fastcore_orchestrator_worker_in_flight", **where) == 0
            assert value(text, "fastcore_orchestrator_requests_in_flight") == 0
            assert value(text, "fastcore_orchestrator_connections_refused_total") == 0
            assert "pid=" not in text and "_created" not in text
        orchestrator.send_signal(signal.SIGTERM)
        assert orchestrator.wait(30) == 0
        assert not os.path.exists(metrics_dir)
    finally:
        for proc in (orchestrator, worker):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
