"""Start and stop the processes a benchmark measures: synthetic workers, an orchestrator, the floor.

Process handling (start, die-with-parent, ordered stop) is the launcher's
(``server.launcher.Child`` / ``stop_all``); this module only plans the argv of
a benchmark deployment, pins the orchestrator to its own core, and reads a
process's CPU time from the kernel's accounting.

Pinning: on a machine with two or more cores the orchestrator (or the floor
proxy) runs alone on core 0 (``taskset -c 0``), and the workers and the load
generator share the other cores, so the orchestrator's core is what saturates
and its CPU time is not inflated by sharing.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.launcher import Child, stop_all
from server.ports import reserve_ports

PYTHON = [sys.executable, "-m"]
#: relay modes of the orchestrator benchmarks: name -> orchestrator flags
MODES: dict[str, list[str]] = {
    "parsed": ["--relay", "parsed", "--no-gen-tokids-ctxbytes", "--no-gen-strip-message-history"],
    "parsed-msgpack": [
        "--relay",
        "parsed-msgpack",
        "--no-gen-tokids-ctxbytes",
        "--no-gen-strip-message-history",
    ],
    "gates-off": ["--relay", "fast", "--no-gen-tokids-ctxbytes", "--no-gen-strip-message-history"],
    "tokids-b64": ["--relay", "fast", "--gen-tokids-ctxbytes", "--no-gen-strip-message-history"],
    "both-gates": ["--relay", "fast", "--gen-tokids-ctxbytes", "--gen-strip-message-history"],
}
FLOOR = "floor"
#: every front process a scale benchmark compares, the floor last
FRONTS = [*MODES, FLOOR]
#: the raw-protocol floor (asyncio Protocols + httptools, ``bench/rawfloor.py``), measured by ``bench.routers``
RAWFLOOR = "rawfloor"
#: pass-through fronts (workers run role ``both``): mode -> module
FLOOR_MODULES: dict[str, str] = {FLOOR: "bench.passthrough", RAWFLOOR: "bench.rawfloor"}


def free_port() -> int:
    """A port held for a process about to listen on it (server.ports: nothing else takes it meanwhile)."""
    return reserve_ports(1)[0]


def front_argv(
    mode: str,
    port: int,
    context: Sequence[str],
    generation: Sequence[str],
    orchestrator_args: Sequence[str] = (),
) -> list[str]:
    """The argv of a front on ``port`` forwarding to the workers at ``context`` and ``generation``
    (host:port each): an orchestrator in relay mode ``mode`` (``MODES``; ``orchestrator_args`` after
    its flags), or a pass-through floor (``FLOOR_MODULES``)."""
    if mode in FLOOR_MODULES:
        argv = [*PYTHON, FLOOR_MODULES[mode], "--port", str(port)]
        for u in context:
            argv += ["--context", u]
        for u in generation:
            argv += ["--generation", u]
        return argv
    return [
        *PYTHON,
        "server.cli",
        "orchestrator",
        "--port",
        str(port),
        "--context-urls",
        ",".join(context),
        "--generation-urls",
        ",".join(generation),
        "--log-level",
        "WARNING",
        *MODES[mode],
        *orchestrator_args,
    ]


def cores() -> tuple[list[int], list[int]]:
    """(orchestrator cores, everything else's cores)."""
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(available) < 2:
        return [], []
    return available[:1], available[1:]


def pinned(argv: list[str], cpus: list[int]) -> list[str]:
    if not cpus or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (a launcher and the process it spawned), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (a child that exits in between is not counted)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            total += cpu_seconds(p)
        except (OSError, ValueError, IndexError):
            pass
    return total


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_healthy(url: str, children: list[Child], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [c for c in children if c.exit_code is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exit_code} during startup")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                # Not "degraded": an orchestrator answers 200 before its context workers are up when it
                # can fall back to local prefill, and a run would start on the fallback path.
                if resp.status == 200 and b'"degraded"' not in resp.read(4096):
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


@dataclass
class Deployment:
    """Synthetic context and generation workers plus one front process (an orchestrator mode or the floor)."""

    mode: str
    prompt_tokens: int
    context_workers: int = 1
    generation_workers: int = 1
    prefill_latency_ms: float = 0.0
    token_latency_ms: float = 0.0
    #: discovery instead of urls: workers register here (etcd://... or an orchestrator's http://...)
    cluster_uri: str | None = None
    cluster_name: str = "bench"
    heartbeat_s: float = 0.5
    inactive_timeout_s: float = 2.0
    #: orchestrator processes, each on its own port (several only with discovery)
    orchestrators: int = 1
    #: more flags for every worker, and for the orchestrator(s) (e.g. ``-c FILE``: flags override it)
    worker_args: list[str] = field(default_factory=list)
    orchestrator_args: list[str] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    workers: list[Child] = field(default_factory=list)
    front: Child | None = None
    fronts: list[Child] = field(default_factory=list)
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def urls(self) -> list[str]:
        """Every orchestrator's base URL."""
        return [f"http://127.0.0.1:{f.port}" for f in self.fronts]

    def cluster_flags(self) -> list[str]:
        if self.cluster_uri is None:
            return []
        return ["--cluster-uri", self.cluster_uri, "--cluster-name", self.cluster_name]

    def worker_child(self, role: str, port: int, index: int) -> Child:
        _, other = cores()
        argv = [
            *PYTHON,
            "server.cli",
            "worker",
            "--model",
            "synthetic",
            "--role",
            "both" if self.mode in FLOOR_MODULES else role,
            "--prompt-tokens",
            str(self.prompt_tokens),
            "--port",
            str(port),
            "--prefill-latency-ms",
            str(self.prefill_latency_ms),
            "--token-latency-ms",
            str(self.token_latency_ms),
        ]
        argv += self.worker_args
        if self.cluster_uri is not None:
            argv += [
                *self.cluster_flags(),
                "--heartbeat-interval-sec",
                str(self.heartbeat_s),
                "--inactive-timeout-sec",
                str(self.inactive_timeout_s),
            ]
        return Child(f"{role} worker {index}", pinned(argv, other), port)

    def start(self, env: dict[str, str] | None = None) -> Deployment:
        env = self.env = dict(os.environ if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        urls: dict[str, list[str]] = {"context": [], "generation": []}
        for role, count in (("context", self.context_workers), ("generation", self.generation_workers)):
            for i in range(count):
                port = free_port()
                child = self.worker_child(role, port, i)
                self.workers.append(child)
                urls[role].append(f"127.0.0.1:{port}")
        self.port = free_port()
        front_cpus, _ = cores()
        if self.orchestrators > 1 and self.cluster_uri is None:
            raise ValueError("several orchestrators share their workers through discovery: set cluster_uri")
        if self.cluster_uri is not None:
            ports = [self.port] + [free_port() for _ in range(self.orchestrators - 1)]
            for i, port in enumerate(ports):
                argv = [
                    *PYTHON,
                    "server.cli",
                    "orchestrator",
                    "--port",
                    str(port),
                    "--model",
                    "synthetic",
                    *self.cluster_flags(),
                    "--health-check-interval-s",
                    "0.5",
                    "--log-level",
                    "WARNING",
                    *MODES[self.mode],
                    *self.orchestrator_args,
                ]
                self.fronts.append(Child(f"{self.mode} orchestrator {i}", pinned(argv, front_cpus), port))
        else:
            argv = front_argv(
                self.mode, self.port, urls["context"], urls["generation"], self.orchestrator_args
            )
        if not self.fronts:
            self.fronts = [Child(self.mode, pinned(argv, front_cpus), self.port)]
        self.front = self.fronts[0]
        # With discovery the orchestrators start first: the workers register with a running
        # registry (an embedded one lives in the first orchestrator).
        self.children = [*self.fronts, *self.workers] if self.cluster_uri else [*self.workers, *self.fronts]
        try:
            for child in self.children:
                child.start(env)
            for w in self.workers:
                wait_healthy(f"http://127.0.0.1:{w.port}/health", self.children)
            for url in self.urls:
                wait_healthy(url + "/health", self.children)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, child: Child) -> None:
        """Start ``child`` again, as it was first started (the chaos run's worker revivals)."""
        child.start(self.env)

    def front_cpu_seconds(self) -> float:
        assert self.front is not None and self.front.proc is not None
        return cpu_seconds(self.front.proc.pid)

    def front_rss_bytes(self) -> int:
        assert self.front is not None and self.front.proc is not None
        return rss_bytes(self.front.proc.pid)

    def stop(self) -> None:
        stop_all(self.children, grace_s=10.0)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
