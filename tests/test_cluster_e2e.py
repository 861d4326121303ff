"""Discovery with whole processes: a real etcd, orchestrators and workers started as ``fastcore-serve``.

The chaos run is bench.load --cluster's (bench/cluster_chaos.py), short: 2
orchestrators x (2 context + 2 generation) synthetic workers, all registered
through etcd, a closed loop over both orchestrators while a generation worker
is SIGKILLed (and restarted), etcd is SIGKILLed (and restarted), a generation
worker is frozen (SIGSTOP, then SIGCONT). Then ``minimal_instances`` and a
wrong model, with processes.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import eventually_blocking, free_port, listening_pids, need_etcd

from bench import cluster_chaos
from server.cluster.local_etcd import LocalEtcd
from server.launcher import Child, stop_all

pytestmark = pytest.mark.slow
HEARTBEAT_S = 0.5
TTL_S = 2.0


async def test_chaos_with_discovery_fails_only_the_streams_on_the_killed_worker() -> None:
    need_etcd()
    concurrency = 12
    out = await cluster_chaos.run(
        duration_s=20.0, concurrency=concurrency, prompt_tokens=2048, max_tokens=16, token_latency_ms=5.0,
        interval_s=3.0, timeout_s=20.0, heartbeat_s=HEARTBEAT_S, inactive_timeout_s=TTL_S,
    )  # fmt: skip
    print(cluster_chaos.report(out))
    kinds = [e.kind for e in out.events]
    assert kinds[:3] == ["worker", "etcd", "freeze"], kinds
    assert out.timeouts == 0, "a request hung"
    assert out.failures_during_etcd_outage == 0, out.error_samples
    assert out.failures_unexplained == 0, out.error_samples
    for event in out.events:
        assert event.gone_s is not None, event
        if event.kind == "worker":  # its connections are refused at once
            assert event.gone_s < TTL_S, event
        if event.kind == "freeze":  # only a health-check timeout or the lease's expiry can tell
            assert event.gone_s < TTL_S + 2.0, event
        if event.kind != "etcd":
            assert event.back_s is not None, f"{event.target} never took traffic again"
            # only what was in flight on it (each orchestrator sends half the clients there at most)
            assert event.failures <= concurrency, event
    assert out.requests > 20 * concurrency
    assert all(n > 0 for n in out.served.values()), out.served  # the load reached every worker


# -- minimal_instances and a wrong model, with processes ------------------------------------------

WORKER = [sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--prompt-tokens", "256"]


def http(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def test_minimal_instances_gate_health_and_a_wrong_model_is_refused(
    etcd: LocalEtcd, tmp_path: object
) -> None:
    port = free_port()
    config = {
        "port": port,
        "model": "synthetic",
        "health_check_interval_s": 0.3,
        "context_servers": {"num_instances": 0},
        "generation_servers": {"num_instances": 0},
        "disagg_cluster": {
            "cluster_uri": etcd.uri,
            "cluster_name": "gate",
            "heartbeat_interval_sec": HEARTBEAT_S,
            "inactive_timeout_sec": TTL_S,
            "minimal_instances": {"context_servers": 1, "generation_servers": 2},
        },
    }
    path = f"{tmp_path}/cluster.json"  # YAML is a superset of JSON
    with open(path, "w") as f:
        json.dump(config, f)
    env = dict(__import__("os").environ, PYTHONUNBUFFERED="1")
    cluster = ["--cluster-uri", etcd.uri, "--cluster-name", "gate", "--heartbeat-interval-sec", str(HEARTBEAT_S),
               "--inactive-timeout-sec", str(TTL_S)]  # fmt: skip
    orch = Child("orchestrator", [sys.executable, "-m", "server.cli", "orchestrator", "-c", path], port)

    def worker(role: str, *extra: str) -> Child:
        p = free_port()
        return Child(f"{role} {p}", [*WORKER, "--role", role, "--port", str(p), *cluster, *extra], p)

    children = [orch]
    try:
        orch.start(env)
        assert eventually_blocking(lambda: http(f"http://127.0.0.1:{port}/health")[0] == 503, timeout=30.0)
        body = http(f"http://127.0.0.1:{port}/health")[1]
        assert b"context (0 of 1 healthy)" in body and b"generation (0 of 2 healthy)" in body
        for child in (
            worker("context"),
            worker("generation"),
            worker("generation", "--served-model-name", "other"),
        ):
            children.append(child)
            child.start(env)

        def metric(name: str) -> float | None:
            _, page = http(f"http://127.0.0.1:{port}/metrics")
            for line in page.decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
            return None

        assert eventually_blocking(lambda: metric("fastcore_orchestrator_cluster_refused_workers") == 1.0, timeout=30.0)
        assert eventually_blocking(lambda: b"generation (1 of 2 healthy)" in http(f"http://127.0.0.1:{port}/health")[1], timeout=30.0)
        assert http(f"http://127.0.0.1:{port}/health")[0] == 503
        late = worker("generation")
        children.append(late)
        late.start(env)
        assert eventually_blocking(lambda: http(f"http://127.0.0.1:{port}/health")[0] == 200, timeout=30.0)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"model": "synthetic", "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["choices"][0]["finish_reason"] == "length"
        # a clean stop deregisters at once: /health is 503 again well before the lease could expire
        assert late.proc is not None
        late.proc.terminate()
        late.proc.wait(10)
        start = time.monotonic()
        assert eventually_blocking(lambda: http(f"http://127.0.0.1:{port}/health")[0] == 503, timeout=TTL_S)
        assert time.monotonic() - start < TTL_S
    finally:
        stop_all([*children[1:], orch], grace_s=10.0)


def test_an_orchestrator_of_several_processes_discovers_in_each(etcd: LocalEtcd) -> None:
    """--workers 2: each process watches etcd itself; the scrape (summed over processes) says
    each discovered worker once, and every request (whichever process takes it) is served."""
    port = free_port()
    env = dict(__import__("os").environ, PYTHONUNBUFFERED="1")
    cluster = ["--cluster-uri", etcd.uri, "--cluster-name", "multi"]
    orch = Child("orchestrator", [sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port),
                                  "--workers", "2", "--model", "synthetic", *cluster], port)  # fmt: skip
    children = [orch]
    try:
        orch.start(env)
        for role in ("context", "generation"):
            p = free_port()
            child = Child(role, [*WORKER, "--role", role, "--port", str(p), *cluster], p)
            children.append(child)
            child.start(env)
        assert eventually_blocking(lambda: http(f"http://127.0.0.1:{port}/health")[0] == 200, timeout=60)
        # Both processes listening (each after its first read of etcd): until the second does, the
        # first answers alone, and the second's metrics (connected 0 while it starts) are not in yet.
        assert eventually_blocking(lambda: len(listening_pids(port)) == 2, timeout=60)
        body = json.dumps({"model": "synthetic", "prompt": "hi", "max_tokens": 2}).encode()
        for _ in range(12):  # new connections: the kernel spreads them over both processes
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", "Connection": "close"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
        # each process rewrites its callback gauges into its file every second: fresh within that
        assert eventually_blocking(lambda: b"fastcore_orchestrator_cluster_connected 1.0" in http(f"http://127.0.0.1:{port}/metrics")[1],
                   timeout=3.0)  # fmt: skip
        for _ in range(6):
            page = http(f"http://127.0.0.1:{port}/metrics")[1].decode()
            assert 'fastcore_orchestrator_cluster_workers{pool="context"} 1.0' in page
            assert 'fastcore_orchestrator_cluster_workers{pool="generation"} 1.0' in page
            assert "fastcore_orchestrator_cluster_connected 1.0" in page, "\n".join(
                ln for ln in page.splitlines() if "cluster" in ln
            )
    finally:
        stop_all([*children[1:], orch], grace_s=10.0)
