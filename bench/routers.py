"""PD routers' CPU per request, fastcore beside the Rust routers and two Python floors, in one run.

    python -m bench.routers --install          # venvs for sglang-router and vllm-router (PyPI)
    python -m bench.routers                    # every front, 1 KB and 160 KB prompts, c=16 and 64
    python -m bench.routers --quick            # a short smoke run
    python -m bench.routers --rounds 3 --requests 1000  # each level 3 times, interleaved: the median
    python -m bench.routers --fastcore-root /work/before --fastcore-label fastcore-before

Each front (router) runs alone on core 0 (``taskset -c 0``); its workers and
this closed-loop keep-alive client share the other cores. Requests are chat
completions with an agentic history (``bench/workload.py``, ~4 bytes per
prompt token), streaming and not, at each concurrency level; each level is
warmed up, then N requests (or ``--max-seconds``) are measured. A front's CPU
is the on-CPU time of its process tree over the measured requests (the
scheduler's ns, /proc/*/task/*/schedstat; utime+stime beside it, in 10 ms
ticks), divided by the completed ones; the ratios and verdicts read the
scheduler's figure. Every front of a prompt size is up at once and
their levels interleave (each level measured for every front in turn);
``--rounds R`` measures every level R times, the fronts' order rotated each
round, and reports each level's median round: on a shared machine a burst of
other load then moves one round of several fronts, not every level of one.

Every front forwards to instant mocks of its own PD protocol (``bench/pd_mocks.py``:
one process, raw asyncio Protocols and httptools, on the client's core), which
check each leg and count protocol violations: the router is what is measured.
Unpaced, each front is driven as fast as it and its mocks go, and a router's CPU
per request falls as its load rises (more requests per wake-up). ``--workers
synthetic`` puts the fastcore and floor fronts on fastcore's synthetic workers
instead (a whole deployment: those run 2-5x fewer requests/s on the client's
core than the mocks, so the front runs at that lower load and its CPU per request
is not comparable with the Rust routers' on their mocks). ``--rate R`` paces
every level at R requests/s, the same for every front that keeps up (a front's
compl/s says whether it did): CPU per request at equal load.

Fronts:

- ``fastcore:MODE``: the orchestrator (``bench.deploy.MODES``) on the fastcore
  mocks (one context, one generation port; they check legs (1) and (3) against
  docs/protocol.md with the MODE's gates); ``LABEL:MODE`` is the same from
  another checkout (``--fastcore-root``, e.g. a ``git worktree``);
- ``fastcore:vllm``: the orchestrator with ``worker_protocol: vllm`` (NixlConnector; the fast
  relay, no trtllm gates) on the same vLLM mocks as ``vllm-router``, checked by the same rules
  (``bench/engine_protocols.py``); the column ``this/rust same mocks`` and a verdict line compare
  it with vllm-router there (issue 37: CPU/req at most 0.5x, completions/s not lower);
- ``fastcore:sglang``: the same with ``worker_protocol: sglang`` (concurrent legs, the bootstrap
  triple) on the same SGLang mocks as ``sglang-router`` (whose prefill mock publishes its
  ``disaggregation_bootstrap_port`` in ``/server_info``, where the sglang protocol reads it),
  compared with sglang-router there;
- ``fastcore:mooncake``: ``worker_protocol: vllm`` with ``vllm_transfer: mooncake`` (both legs at once,
  a ``transfer_id`` per pair) on Mooncake mocks (the prefill mock's port its bootstrap server's
  ``GET /query``); no Rust router here speaks it, so it has no verdict line;
- ``floor``: ``bench/passthrough.py``, the bare aiohttp pass-through (on the
  ``plain`` mocks, as ``rawfloor``: answers, no PD protocol to check);
- ``rawfloor``: ``bench/rawfloor.py``, the callback-only pass-through (uvloop,
  httptools; both legs moved on from the parsers' callbacks, no task and no
  object per request): the lower bound for a Python router, and the floor of
  issue 25's "within 2x" target (``this/rawfloor``, the second verdict line);
- ``sglang-router``, ``vllm-router``: the Rust routers from PyPI, each in its
  own venv (``--install``), in PD mode with round-robin, logging at warn, on
  instant mocks of their PD protocols (``bench/pd_mocks.py``) that count
  protocol violations. A router that is not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench._timing import format_table
from bench.deploy import (
    FLOOR,
    MODES,
    PYTHON,
    RAWFLOOR,
    Deployment,
    cores,
    free_port,
    front_argv,
    pinned,
    process_tree,
    tree_cpu_seconds,
    wait_healthy,
)
from bench.loadgen import RESULTS_DIR, new_session, one_request, one_unary_request, run_concurrency
from bench.pd_mocks import BOOTSTRAP_PORT
from bench.workload import chat_body
from server.launcher import Child, stop_all
from server.process import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
VENVS = Path(os.environ.get("FASTCORE_BENCH_VENVS", Path.home() / ".cache" / "fastcore-bench"))
MODEL = "synthetic"


@dataclass(frozen=True)
class RustRouter:
    name: str  # front name and venv directory
    requirement: str  # pip requirement
    dist: str  # distribution name in site-packages (dist-info prefix)
    flavor: str  # bench.pd_mocks flavor

    def python(self, venvs: Path) -> Path:
        return venvs / self.name / "bin" / "python"

    def installed_version(self, venvs: Path) -> str | None:
        if not self.python(venvs).exists():
            return None
        found = glob.glob(
            str(venvs / self.name / "lib" / "python*" / "site-packages" / f"{self.dist}-*.dist-info")
        )
        return Path(found[0]).name.removesuffix(".dist-info").split("-", 1)[1] if found else None

    def argv(self, venvs: Path, port: int, prefill: str, decode: str, metrics_port: int) -> list[str]:
        py = str(self.python(venvs))
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(metrics_port),
            "--prometheus-host",
            "127.0.0.1",
            "--worker-startup-check-interval",
            "1",
        ]
        if self.flavor == "sglang":
            return [
                py,
                "-m",
                "sglang_router.launch_router",
                "--pd-disaggregation",
                "--prefill",
                prefill,
                str(BOOTSTRAP_PORT),
                "--decode",
                decode,
                *common,
                "--log-level",
                "warn",
            ]
        return [
            str(venvs / self.name / "bin" / "vllm-router"),
            "--vllm-pd-disaggregation",
            "--prefill",
            prefill,
            "--decode",
            decode,
            *common,
            "--log-level",
            "warning",
        ]


RUST_ROUTERS = {
    r.name: r
    for r in (
        RustRouter("sglang-router", "sglang-router==0.3.2", "sglang_router", "sglang"),
        RustRouter("vllm-router", "vllm-router==0.1.17", "vllm_router", "vllm"),
    )
}
#: what runs a front's argv instead of itself (``wrap(argv)``: valgrind's argv around it)
Wrap = Callable[[list[str]], list[str]]
#: seconds a wrapped front (under valgrind, ~50x slower) gets to start and serve its first request
WRAPPED_START_S = 300.0

#: fastcore on an engine's own PD protocol (``worker_protocol``): mode -> the orchestrator's flags; its
#: mocks are that engine's (``bench.pd_mocks --flavor MODE``), the Rust router's on that flavor beside it
PROTOCOL_MODES: dict[str, list[str]] = {
    "vllm": ["--worker-protocol", "vllm"],
    "sglang": ["--worker-protocol", "sglang"],
    # vLLM's MooncakeConnector: both legs at once (no Rust router here speaks it: no head-to-head)
    "mooncake": ["--worker-protocol", "vllm", "--vllm-transfer", "mooncake"],
}
#: the relay mode (bench.deploy.MODES) the protocol fronts run in: the fast relay, no trtllm gates
PROTOCOL_RELAY = "gates-off"

DEFAULT_FRONTS = [
    "fastcore:both-gates",
    "fastcore:parsed",
    "fastcore:vllm",
    "fastcore:sglang",
    FLOOR,
    RAWFLOOR,
    *RUST_ROUTERS,
]


def protocol_front_argv(mode: str, port: int, prefill: str, decode: str) -> list[str]:
    """The orchestrator's argv as ``fastcore:MODE`` (``PROTOCOL_MODES``) runs it on ``mode``'s mocks
    (``mooncake``: the prefill mock's port is its bootstrap server's, in a config file: no flag sets it)."""
    extra = PROTOCOL_MODES[mode]
    if mode == "mooncake":
        bootstrap = int(prefill.rpartition(":")[2])
        config = Path(tempfile.gettempdir()) / f"fastcore-bench-mooncake-{bootstrap}.yaml"
        config.write_text(f"vllm_mooncake_bootstrap_port: {bootstrap}\n")
        extra = [*extra, "--config", str(config)]
    return front_argv(PROTOCOL_RELAY, port, [prefill], [decode], extra)


def mocks_flavor(front: str) -> str:
    """The bench.pd_mocks flavor ``front`` runs on (with ``--workers mocks``)."""
    if front in RUST_ROUTERS:
        return RUST_ROUTERS[front].flavor
    if front in (FLOOR, RAWFLOOR):
        return "plain"
    mode = front.rpartition(":")[2]
    return mode if mode in PROTOCOL_MODES else "fastcore"


# -- running fronts -------------------------------------------------------------


@dataclass
class Running:
    """A started front: its URL, the pid whose tree is measured, a stop, and (mocks) a violation count."""

    url: str
    pid: int
    stop: Callable[[], None]
    stats_url: str | None = None
    log: Path | None = None

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def sched_seconds(self) -> float:
        return tree_sched_seconds(self.pid)

    def mock_stats(self) -> dict[str, Any] | None:
        if self.stats_url is None:
            return None
        with urllib.request.urlopen(self.stats_url, timeout=10) as resp:
            return json.loads(resp.read())


def tree_sched_seconds(pid: int) -> float:
    """On-CPU time of ``pid``'s tree, every thread, from /proc/*/task/*/schedstat (ns; a cross-check
    of utime+stime, whose clock ticks are 10 ms apart)."""
    total = 0
    for p in process_tree(pid):
        for stat in glob.glob(f"/proc/{p}/task/*/schedstat"):
            try:
                with open(stat) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9


def _fastcore_env(root: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if root is not None:
        # Another checkout's server/ and fastcore/ first on sys.path; PYTHONSAFEPATH keeps the
        # current directory (this checkout) off it for ``python -m``.
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONSAFEPATH"] = "1"
    return env


def start_deployment(mode: str, prompt_tokens: int, root: Path | None = None) -> Running:
    dep = Deployment(mode, prompt_tokens).start(_fastcore_env(root))
    assert dep.front is not None and dep.front.proc is not None
    return Running(dep.url, dep.front.proc.pid, dep.stop)


def mock_gates(mode: str) -> list[str]:
    """The fastcore mocks' ``--gates`` for an orchestrator mode (what its legs must carry)."""
    flags = MODES[mode]
    gates = [
        g
        for g, flag in (("b64", "--gen-tokids-ctxbytes"), ("strip", "--gen-strip-message-history"))
        if flag in flags
    ]
    return ["--gates", ",".join(gates)] if gates else []


def start_on_mocks(
    name: str,
    argv_for: Callable[[int, str, str], list[str]],
    flavor: str,
    workdir: Path,
    mock_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    wrap: Wrap | None = None,
) -> Running:
    """A front (``argv_for(port, prefill, decode)``) on instant mocks of ``flavor``'s PD protocol
    (``bench/pd_mocks.py`` with ``mock_args``, on the client's cores), its log in ``workdir``;
    ``wrap``: what runs the front's argv (bench.front_instructions: valgrind), given time to start."""
    front_cpus, other = cores()
    prefill_port, decode_port, port = free_port(), free_port(), free_port()
    mocks_argv = [*PYTHON, "bench.pd_mocks", "--flavor", flavor, *(mock_args or [])]
    mocks_argv += ["--prefill-port", str(prefill_port), "--decode-port", str(decode_port)]
    mocks = Child(f"{flavor} mocks", pinned(mocks_argv, other), prefill_port)
    argv = argv_for(port, f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}")
    log = workdir / f"{name}.log"
    front = _LoggedChild(name, pinned(argv if wrap is None else wrap(argv), front_cpus), port, log=log)
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    children = [mocks, front]
    try:
        mocks.start(dict(env, PYTHONPATH=str(ROOT), PYTHONSAFEPATH="1"))
        wait_healthy(f"http://127.0.0.1:{prefill_port}/health", [mocks], timeout=30)
        wait_healthy(f"http://127.0.0.1:{decode_port}/health", [mocks], timeout=30)
        front.start(env)
        wait_healthy(
            f"http://127.0.0.1:{port}/health", children, timeout=60 if wrap is None else WRAPPED_START_S
        )
    except BaseException:
        stop_all(children, grace_s=5.0)
        raise
    assert front.proc is not None
    return Running(
        f"http://127.0.0.1:{port}",
        front.proc.pid,
        lambda: stop_all(children, grace_s=5.0),
        stats_url=f"http://127.0.0.1:{prefill_port}/mock_stats",
        log=log,
    )


def start_rust(router: RustRouter, venvs: Path, workdir: Path, wrap: Wrap | None = None) -> Running:
    def argv(port: int, prefill: str, decode: str) -> list[str]:
        return router.argv(venvs, port, f"http://{prefill}", f"http://{decode}", free_port())

    env = dict(os.environ, RUST_LOG="warn", NO_COLOR="1")
    env.pop("PYTHONPATH", None)
    return start_on_mocks(router.name, argv, router.flavor, workdir, env=env, wrap=wrap)


@dataclass
class _LoggedChild(Child):
    """A child whose stdout and stderr go to a file (a router's own log, read when it fails)."""

    log: Path | None = None

    def start(self, env: dict[str, str]) -> None:
        assert self.log is not None
        with open(self.log, "ab") as out:
            # dies with this run, even a killed one (it kept its session: not start_child's)
            self.proc = subprocess.Popen(
                self.argv, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )


def wait_serving(url: str, timeout: float = 60.0) -> None:
    """Until a small chat request succeeds: /health can be 200 before a router has registered workers."""
    body = chat_body(8, model=MODEL, max_tokens=2, stream=False)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200 and b"choices" in resp.read():
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise RuntimeError(f"{url} serves no chat completion after {timeout:.0f} s: {last}")


# -- measuring ------------------------------------------------------------------


@dataclass
class Row:
    front: str
    prompt_tokens: int
    body_bytes: int
    stream: bool
    concurrency: int
    requests: int
    completed: int
    errors: int
    timeouts: int
    warmup_errors: int
    violations: int | None
    cpu_ms_per_request: float | None  # utime+stime (clock ticks) / completed
    sched_ms_per_request: float | None  # schedstat on-CPU ns / completed (finer grained)
    completions_per_s: float
    ttft_p50_ms: float | None
    duration_s: float
    time_bound: bool
    error_samples: list[str] = field(default_factory=list)
    #: the offered load the level was paced at (--rate; 0: unpaced, each front as fast as it goes)
    rate: float = 0.0
    #: with --rounds R: each round's CPU (and schedstat) ms per request, in round order; the row's own
    #: figures are the median round's (merge_rounds)
    cpu_ms_rounds: list[float | None] = field(default_factory=list)
    sched_ms_rounds: list[float | None] = field(default_factory=list)

    @property
    def cpu(self) -> float | None:
        """CPU ms per request as the comparisons read it: the scheduler's on-CPU ns where there are
        any (at 0.05 ms per request, 1,000 requests are 5 clock ticks of utime+stime), else the ticks'."""
        return self.sched_ms_per_request or self.cpu_ms_per_request

    @property
    def flagged(self) -> bool:
        return bool(self.errors or self.warmup_errors or self.violations or self.completed == 0)


def _violations(stats: dict[str, Any] | None) -> int:
    return 0 if stats is None else int(stats["violations"]) + int(stats.get("unpaired", 0))


async def _level(
    url: str,
    body: bytes,
    concurrency: int,
    stream: bool,
    args: argparse.Namespace,
    running: Running,
    label: str,
) -> tuple[Any, int, float, float, int | None]:
    request = one_request if stream else one_unary_request
    async with new_session() as session:  # one client session: warm-up connections are the measured ones
        warm = await run_concurrency(
            url,
            body,
            concurrency,
            max_requests=max(args.warmup, 2 * concurrency),
            max_seconds=args.max_seconds,
            timeout=args.timeout,
            request=request,
            session=session,
            label=f"{label} warm-up",
        )
        stats0 = running.mock_stats()
        cpu0, sched0 = running.cpu_seconds(), running.sched_seconds()
        level = await run_concurrency(
            url,
            body,
            concurrency,
            max_requests=args.requests,
            max_seconds=args.max_seconds,
            timeout=args.timeout,
            request=request,
            session=session,
            label=label,
            rate=args.rate,
        )
        cpu, sched = running.cpu_seconds() - cpu0, running.sched_seconds() - sched0
    violations = None
    if stats0 is not None:
        await asyncio.sleep(0.2)  # an SGLang prefill still in flight when its decode finished
        violations = _violations(running.mock_stats()) - _violations(stats0)
    if warm.errors:
        level.error_samples += [f"warm-up: {e}" for e in warm.error_samples]
    return level, warm.errors, cpu, sched, violations


def measure_level(
    front: str,
    running: Running,
    prompt_tokens: int,
    stream: bool,
    c: int,
    args: argparse.Namespace,
    tag: str = "",
) -> Row:
    """One level of one front: warm-up, then the measured requests (``tag``: the round, for the log)."""
    body = chat_body(prompt_tokens, model=MODEL, max_tokens=args.max_tokens, stream=stream)
    label = f"{front} {prompt_tokens} {'stream' if stream else 'unary'} c={c}{tag}"
    level, warmup_errors, cpu, sched, violations = asyncio.run(
        _level(running.url + "/v1/chat/completions", body, c, stream, args, running, label)
    )
    completed = level.requests - level.errors
    row = Row(
        front=front,
        prompt_tokens=prompt_tokens,
        body_bytes=len(body),
        stream=stream,
        concurrency=c,
        requests=level.requests,
        completed=completed,
        errors=level.errors,
        timeouts=level.timeouts,
        warmup_errors=warmup_errors,
        violations=violations,
        cpu_ms_per_request=round(1000 * cpu / completed, 4) if completed else None,
        sched_ms_per_request=round(1000 * sched / completed, 4) if completed else None,
        completions_per_s=level.completions_per_s,
        ttft_p50_ms=level.ttft_p50_ms,
        duration_s=level.duration_s,
        time_bound=level.requests < args.requests,
        error_samples=level.error_samples,
        rate=args.rate,
    )
    cpu_text = "-" if row.cpu_ms_per_request is None else f"{row.cpu_ms_per_request:.3f}"
    print(
        f"  {label}: {row.completed}/{row.requests} ok, {cpu_text} CPU ms/req "
        f"(schedstat {row.sched_ms_per_request}), "
        f"{row.completions_per_s:.0f}/s, TTFT p50 {row.ttft_p50_ms} ms"
        + (f", {violations} protocol violations" if violations else "")
        + (f"  errors: {row.error_samples[:2]}" if row.errors else ""),
        flush=True,
    )
    return row


def interleaved(
    fronts: list[str], rounds: int, levels: list[tuple[bool, int]]
) -> list[tuple[int, bool, int, str]]:
    """The order levels are measured in: each round walks every level, and at each level every front
    in turn, the fronts' order rotated by one each round (so no front always follows the same one or
    always comes first): ``(round, stream, concurrency, front)``. A burst of load from the machine's
    other tenants then lands on one round of several fronts, not on every level of one."""
    order: list[tuple[int, bool, int, str]] = []
    for r in range(rounds):
        turn = fronts[r % len(fronts) :] + fronts[: r % len(fronts)] if fronts else []
        for stream, c in levels:
            order.extend((r, stream, c, front) for front in turn)
    return order


def merge_rounds(rows: list[Row]) -> Row:
    """One level's rounds (the same front, size, streaming, concurrency) as one row: the round with the
    median CPU per request (the lower one of an even count; a round that completed nothing counts as
    the most), with every round's errors, warm-up errors, timeouts and protocol violations added up
    (so any of them flags the level) and each round's CPU per request in ``cpu_ms_rounds``."""
    ranked = sorted(rows, key=lambda r: (r.cpu is None, r.cpu or 0.0))
    merged = replace(ranked[(len(ranked) - 1) // 2])
    merged.errors = sum(r.errors for r in rows)
    merged.warmup_errors = sum(r.warmup_errors for r in rows)
    merged.timeouts = sum(r.timeouts for r in rows)
    seen = [r.violations for r in rows if r.violations is not None]
    merged.violations = sum(seen) if seen else None
    merged.error_samples = [e for r in rows for e in r.error_samples][:10]
    merged.cpu_ms_rounds = [r.cpu_ms_per_request for r in rows]
    merged.sched_ms_rounds = [r.sched_ms_per_request for r in rows]
    return merged


def start_front(
    front: str, prompt_tokens: int, args: argparse.Namespace, workdir: Path, wrap: Wrap | None = None
) -> Running:
    """``front`` started and serving; ``wrap`` (on the mocks only): what runs its argv."""
    if front in RUST_ROUTERS:
        running = start_rust(RUST_ROUTERS[front], args.venvs, workdir, wrap)
    elif args.workers == "mocks":
        label, _, mode = front.rpartition(":")  # a floor: no label, its name the mode
        flavor = mocks_flavor(front)
        running = start_on_mocks(
            front.replace(":", "-"),
            lambda port, prefill, decode: (
                protocol_front_argv(mode, port, prefill, decode)
                if mode in PROTOCOL_MODES
                else front_argv(mode, port, [prefill], [decode])
            ),
            flavor,
            workdir,
            mock_args=mock_gates(mode) if flavor == "fastcore" else None,
            env=_fastcore_env(args.fastcore_root if label not in ("", "fastcore") else None),
            wrap=wrap,
        )
    elif wrap is not None:
        raise ValueError("a wrapped front runs on the mocks only (--workers mocks)")
    elif front in (FLOOR, RAWFLOOR):
        running = start_deployment(front, prompt_tokens)
    else:
        label, mode = front.split(":", 1)
        running = start_deployment(mode, prompt_tokens, None if label == "fastcore" else args.fastcore_root)
    try:
        wait_serving(running.url, 60 if wrap is None else WRAPPED_START_S)
    except BaseException:
        running.stop()
        raise
    return running


def check_front(front: str, args: argparse.Namespace) -> str | None:
    """Why ``front`` cannot run here (None when it can)."""
    if front in RUST_ROUTERS:
        router = RUST_ROUTERS[front]
        if router.installed_version(args.venvs) is None:
            return f"not installed in {args.venvs / router.name} (python -m bench.routers --install)"
        return None
    if front in (FLOOR, RAWFLOOR):
        return None
    label, _, mode = front.partition(":")
    if mode not in MODES and mode not in PROTOCOL_MODES:
        return (
            f"unknown front (fastcore:MODE with MODE in {[*MODES, *PROTOCOL_MODES]}, {FLOOR}, {RAWFLOOR}, "
            f"{list(RUST_ROUTERS)})"
        )
    if mode in PROTOCOL_MODES and args.workers != "mocks":
        return f"worker_protocol {mode} runs on its engine's mocks only (--workers mocks)"
    if label == "fastcore":
        return None
    if label != args.fastcore_label:
        return f"unknown label {label!r} (fastcore, or --fastcore-label with --fastcore-root)"
    if args.fastcore_root is None:
        return "no --fastcore-root"
    if not glob.glob(str(args.fastcore_root / "fastcore" / "_scan*.so")):
        return f"extensions not built in {args.fastcore_root} (python setup.py build_ext --inplace there)"
    return None


# -- reporting ------------------------------------------------------------------


def _best_rust(rows: list[Row]) -> Row | None:
    rust = [r for r in rows if r.front in RUST_ROUTERS and not r.flagged and r.cpu]
    return min(rust, key=lambda r: r.cpu or 0.0, default=None)


def _same_mocks_rust(rows: list[Row], front: str) -> Row | None:
    """The Rust router's row on the mocks ``front`` runs on (vllm-router beside ``fastcore:vllm``),
    None for a front whose protocol no Rust router speaks, or a flagged one."""
    if front in RUST_ROUTERS:
        return None
    flavor = mocks_flavor(front)
    return next(
        (
            r
            for r in rows
            if r.front in RUST_ROUTERS and RUST_ROUTERS[r.front].flavor == flavor and r.cpu and not r.flagged
        ),
        None,
    )


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def groups(rows: list[Row]) -> list[tuple[int, bool]]:
    return sorted({(r.prompt_tokens, r.stream) for r in rows}, key=lambda k: (k[0], not k[1]))


def report(rows: list[Row], fronts: list[str]) -> str:
    out = []
    rounds = any(len(r.cpu_ms_rounds) > 1 for r in rows)  # then a column of every round's CPU ms/req
    for n, stream in groups(rows):
        sel = [r for r in rows if r.prompt_tokens == n and r.stream == stream]
        table = []
        for c in sorted({r.concurrency for r in sel}):
            at_c = [r for r in sel if r.concurrency == c]
            best = _best_rust(at_c)
            raw = _raw_floor(at_c)
            for front in fronts:
                r = next((x for x in at_c if x.front == front), None)
                if r is None:
                    continue
                flags = []
                if r.errors:
                    flags.append(f"{r.errors} errors")
                if r.warmup_errors:
                    flags.append(f"{r.warmup_errors} warm-up errors")
                if r.violations:
                    flags.append(f"{r.violations} protocol violations")
                if r.time_bound:
                    flags.append("time bound")
                cpu = "-" if r.cpu_ms_per_request is None else f"{r.cpu_ms_per_request:.3f}"
                each = "/".join(
                    "-" if v is None else f"{v:.4f}" for v in r.sched_ms_rounds or r.cpu_ms_rounds
                )
                sched = "-" if r.sched_ms_per_request is None else f"{r.sched_ms_per_request:.4f}"
                table.append(
                    [
                        front,
                        c,
                        r.requests,
                        r.errors,
                        cpu,
                        *([each or "-"] if rounds else []),
                        sched,
                        _ratio(r.cpu, best.cpu if best else None),
                        _ratio(r.cpu, own.cpu if (own := _same_mocks_rust(at_c, front)) else None),
                        _ratio(r.cpu, raw.cpu if raw else None),
                        f"{r.completions_per_s:.0f}",
                        r.ttft_p50_ms,
                        "; ".join(flags),
                    ]
                )
        body = sel[0].body_bytes
        paced = f", paced at {sel[0].rate:g} requests/s" if sel[0].rate else ""
        out.append(
            f"\n### {n:,} prompt tokens ({body / 1024:.0f} KB body), "
            f"{'streaming' if stream else 'non-streaming'}{paced}\n"
        )
        out.append(
            format_table(
                [
                    "front",
                    "conc",
                    "reqs",
                    "errors",
                    "CPU ms/req",
                    *(["sched each round"] if rounds else []),
                    # the scheduler's on-CPU ns (/proc/*/task/*/schedstat): finer than the 10 ms ticks
                    # of utime+stime, which at 1,000 requests of 0.1 ms read in 0.01 ms steps
                    "sched ms/req",
                    "this/best-rust",
                    # fastcore on an engine's own protocol against that engine's Rust router, same mocks
                    "this/rust same mocks",
                    "this/rawfloor",
                    "compl/s",
                    "TTFT p50 ms",
                    "flags",
                ],
                table,
            )
        )
    return "\n".join(out)


def _raw_floor(rows: list[Row]) -> Row | None:
    return next((r for r in rows if r.front == RAWFLOOR and not r.flagged and r.cpu), None)


#: issue 25's targets for fastcore, per size x streaming at every level: (what, the reference, the bar)
TARGETS: list[tuple[str, Callable[[list[Row]], Row | None], float]] = [
    ("0.5 x best Rust router", _best_rust, 0.5),
    (f"2 x the callback-only floor ({RAWFLOOR})", _raw_floor, 2.0),
]


def verdicts(rows: list[Row], front: str = "fastcore:both-gates") -> list[str]:
    """Per size x stream, one line per target: ``front``'s CPU/req against half the best Rust router's,
    then against twice the raw floor's, at every concurrency level."""
    lines = []
    for n, stream in groups([r for r in rows if r.front == front]):  # none: it did not run
        sel = [r for r in rows if r.prompt_tokens == n and r.stream == stream]
        for target, reference, bar in TARGETS:
            parts, met = [], True
            for c in sorted({r.concurrency for r in sel}):
                at_c = [r for r in sel if r.concurrency == c]
                ref, ours = reference(at_c), next((r for r in at_c if r.front == front), None)
                if ref is None or ours is None or ours.cpu is None or ours.flagged:
                    parts.append(f"c={c}: no comparison")
                    met = False
                    continue
                ratio = ours.cpu / (ref.cpu or 1.0)
                met &= ratio <= bar
                parts.append(f"c={c}: {ours.cpu:.4f} vs {ref.cpu:.4f} ms/req ({ref.front}) = {ratio:.2f}x")
            kind = "streaming" if stream else "non-streaming"
            verdict = "MET" if met else "NOT MET"
            lines.append(f"verdict {n:,} tok {kind}: {front} vs {target}: {verdict} ({'; '.join(parts)})")
    return lines


def protocol_verdicts(rows: list[Row]) -> list[str]:
    """Issue 37's head-to-head, per ``fastcore:MODE`` of ``PROTOCOL_MODES`` measured and size x streaming:
    its CPU/req at most half its engine's Rust router's on the same mocks, and its completions/s not
    lower, at every concurrency level."""
    lines = []
    for mode in PROTOCOL_MODES:
        front = f"fastcore:{mode}"
        if not any(r.flavor == mocks_flavor(front) for r in RUST_ROUTERS.values()):
            continue  # no Rust router speaks it (mooncake): nothing to compare with
        for n, stream in groups([r for r in rows if r.front == front]):
            sel = [r for r in rows if r.prompt_tokens == n and r.stream == stream]
            parts, met, rust = [], True, "its Rust router"
            for c in sorted({r.concurrency for r in sel}):
                at_c = [r for r in sel if r.concurrency == c]
                ref, ours = _same_mocks_rust(at_c, front), next((r for r in at_c if r.front == front), None)
                if ref is None or ours is None or ours.cpu is None or ours.flagged:
                    parts.append(f"c={c}: no comparison")
                    met = False
                    continue
                rust = ref.front
                ratio = ours.cpu / (ref.cpu or 1.0)
                met &= ratio <= 0.5 and ours.completions_per_s >= ref.completions_per_s
                parts.append(
                    f"c={c}: {ours.cpu:.4f} vs {ref.cpu:.4f} ms/req = {ratio:.2f}x, "
                    f"{ours.completions_per_s:.0f} vs {ref.completions_per_s:.0f} compl/s"
                )
            kind = "streaming" if stream else "non-streaming"
            verdict = "MET" if met else "NOT MET"
            lines.append(
                f"verdict {n:,} tok {kind}: {front} vs 0.5 x {rust} on the same mocks, compl/s not lower: "
                f"{verdict} ({'; '.join(parts)})"
            )
    return lines


def plot(rows: list[Row], fronts: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    keys = groups(rows)
    levels = sorted({r.concurrency for r in rows})
    present = [f for f in fronts if any(r.front == f for r in rows)]
    fig, axes = plt.subplots(1, len(levels), figsize=(6.5 * len(levels), 4.8), squeeze=False)
    width = 0.8 / max(1, len(present))
    drawn = False
    for ax, c in zip(axes[0], levels):
        for i, front in enumerate(present):
            ys = []
            for n, stream in keys:
                r = next(
                    (
                        x
                        for x in rows
                        if (x.front, x.prompt_tokens, x.stream, x.concurrency) == (front, n, stream, c)
                    ),
                    None,
                )
                value = r.cpu if r else None
                ys.append(value if value else float("nan"))
                drawn = drawn or bool(value)
            ax.bar([k + i * width - 0.4 + width / 2 for k in range(len(keys))], ys, width, label=front)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{n:,} tok\n{'stream' if s else 'unary'}" for n, s in keys])
        if drawn:  # a log axis needs one positive value
            ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))
        ax.set_ylabel("router CPU ms / request (log)")
        ax.set_title(f"{c} concurrent streams")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
    fig.suptitle("PD routers: CPU per request on one core (lower is better)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _git_rev(root: Path) -> str | None:
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None


# -- CLI ------------------------------------------------------------------------


def install(venvs: Path) -> int:
    """A venv per Rust router under ``venvs``, its pinned version pip-installed from the package index."""
    failures = 0
    for router in RUST_ROUTERS.values():
        target = venvs / router.name
        print(f"{router.name}: {router.requirement} -> {target}", flush=True)
        try:
            if not router.python(venvs).exists():
                subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
            subprocess.run(
                [str(router.python(venvs)), "-m", "pip", "install", "-q", router.requirement], check=True
            )
            print(f"  installed {router.dist} {router.installed_version(venvs)}")
        except (OSError, subprocess.CalledProcessError) as exc:
            failures += 1
            print(f"  failed: {exc}")
    return 1 if failures else 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.routers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--install", action="store_true", help="create the Rust routers' venvs and pip install them"
    )
    p.add_argument("--venvs", type=Path, default=VENVS, help=f"the Rust routers' venvs (default {VENVS})")
    p.add_argument(
        "--fronts",
        default=None,
        help=f"comma-separated fronts (default {','.join(DEFAULT_FRONTS)}, plus LABEL:both-gates "
        "with --fastcore-root)",
    )
    p.add_argument(
        "--fastcore-root",
        type=Path,
        default=None,
        help="another fastcore checkout (with built extensions) to measure as LABEL:MODE",
    )
    p.add_argument("--fastcore-label", default="fastcore-before", help="its label (default fastcore-before)")
    p.add_argument(
        "--prompt-tokens", default="250,40000", help="comma-separated (~4 bytes/token: 1 KB, 160 KB)"
    )
    p.add_argument("--concurrency", default="16,64", help="comma-separated closed-loop levels")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="pace every measured level at this many requests/s (0, the default: as fast as each front "
        "goes); every front that keeps up is then measured at the same load",
    )
    p.add_argument(
        "--workers",
        choices=("mocks", "synthetic"),
        default="mocks",
        help="what the fastcore and floor fronts forward to: instant mocks of their protocol (bench/pd_mocks.py, "
        "as the Rust routers get; the default), or fastcore's synthetic workers (server.cli worker --model "
        "synthetic: a whole deployment, whose workers run fewer requests/s on the client's core)",
    )
    p.add_argument("--stream", choices=("both", "stream", "unary"), default="both")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per level (default 2000)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every level this many times, the fronts interleaved level by level and their order "
        "rotated each round; each level reports its median round (default 1)",
    )
    p.add_argument(
        "--warmup", type=int, default=50, help="warm-up requests per level (at least 2x concurrency)"
    )
    p.add_argument(
        "--max-seconds", type=float, default=60.0, help="time bound of each level (and its warm-up)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a smoke run: 100 requests, 10 s per level")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "routers.json")
    p.add_argument("--plot", type=Path, default=RESULTS_DIR / "routers.png")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.install:
        return install(args.venvs)
    if args.quick:
        args.requests = min(args.requests, 100)
        args.warmup = min(args.warmup, 20)
        args.max_seconds = min(args.max_seconds, 10.0)
    args.streams = {"both": [True, False], "stream": [True], "unary": [False]}[args.stream]
    args.concurrency = _ints(args.concurrency)
    if args.fastcore_root is not None:
        args.fastcore_root = args.fastcore_root.resolve()
    fronts = (
        args.fronts.split(",")
        if args.fronts
        else [
            *DEFAULT_FRONTS[:2],
            *([f"{args.fastcore_label}:both-gates"] if args.fastcore_root else []),
            *DEFAULT_FRONTS[2:],
        ]
    )

    front_cpus, other = cores()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if other and affinity is not None:
        os.sched_setaffinity(0, other)  # this client beside the workers, off the front's core
    try:
        return _run(args, fronts, front_cpus, other)
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


def _start(
    front: str, n: int, args: argparse.Namespace, workdir: Path, skipped: dict[str, str]
) -> Running | None:
    """``front`` started for ``n``-token prompts, tried twice; one that cannot start is a note in
    ``skipped`` (and None), not the end of the run."""
    try:
        try:
            return start_front(front, n, args, workdir)
        except Exception as exc:  # once more: a port taken in between, a file mid-edit
            print(f"{front} at {n} tokens failed to start ({exc}); trying again", flush=True)
            time.sleep(2)
            return start_front(front, n, args, workdir)
    except Exception as exc:
        log = workdir / f"{front}.log"
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        skipped[f"{front} @ {n}"] = f"failed to start: {exc}"
        print(f"skipping {front} at {n} tokens: failed to start: {exc}\n{tail}", flush=True)
        return None


def _run(args: argparse.Namespace, fronts: list[str], front_cpus: list[int], other: list[int]) -> int:
    print(
        f"front pinned to CPU {front_cpus or 'none (one core)'}; workers, mocks and this client on "
        f"{other or 'the same'}",
        flush=True,
    )

    rev_at_start = _git_rev(ROOT)  # others may commit under a long run: the fastcore fronts start from disk
    skipped: dict[str, str] = {}
    for front in fronts:
        reason = check_front(front, args)
        if reason:
            skipped[front] = reason
            print(f"skipping {front}: {reason}", flush=True)
    rows: list[Row] = []
    levels = [(stream, c) for stream in args.streams for c in args.concurrency]
    with tempfile.TemporaryDirectory(prefix="bench-routers-") as tmp:
        for n in _ints(args.prompt_tokens):
            running: dict[str, Running] = {}
            try:
                for front in fronts:  # every front up at once: their levels interleave
                    if front not in skipped:
                        started = _start(front, n, args, Path(tmp), skipped)
                        if started is not None:
                            running[front] = started
                measured: dict[tuple[str, bool, int], list[Row]] = {}
                for r, stream, c, front in interleaved(list(running), args.rounds, levels):
                    tag = f" round {r + 1}/{args.rounds}" if args.rounds > 1 else ""
                    row = measure_level(front, running[front], n, stream, c, args, tag)
                    measured.setdefault((front, stream, c), []).append(row)
            finally:
                for started in running.values():
                    started.stop()
            rows.extend(
                merge_rounds(measured[(front, stream, c)]) for front in running for stream, c in levels
            )

    print(report(rows, fronts))
    print()
    for line in verdicts(rows) + protocol_verdicts(rows):
        print(line)
    for front, reason in skipped.items():
        print(f"note: {front} skipped: {reason}")
    flagged = [r for r in rows if r.flagged]
    if flagged:
        print(
            f"FLAGGED: {len(flagged)} level(s) with errors or protocol violations: "
            + ", ".join(
                f"{r.front} {r.prompt_tokens} {'stream' if r.stream else 'unary'} c={r.concurrency}"
                for r in flagged
            )
        )
    meta = {
        "workers": args.workers,
        "fronts": fronts,
        "skipped": skipped,
        "front_cpus": front_cpus,
        "other_cpus": other,
        "requests": args.requests,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "max_seconds": args.max_seconds,
        "max_tokens": args.max_tokens,
        "fastcore_rev": rev_at_start,
        "fastcore_rev_at_end": _git_rev(ROOT),
        "fastcore_root": str(args.fastcore_root) if args.fastcore_root else None,
        "fastcore_root_rev": _git_rev(args.fastcore_root) if args.fastcore_root else None,
        "rust_routers": {r.name: r.installed_version(args.venvs) for r in RUST_ROUTERS.values()},
        "verdicts": verdicts(rows) + protocol_verdicts(rows),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"\nresults: {args.output}")
    if rows:
        plot(rows, fronts, args.plot)
        print(f"plot: {args.plot}")
    return 1 if flagged or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
