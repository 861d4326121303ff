"""``fastcore-serve up``: a whole local deployment in one command.

Starts, on 127.0.0.1, context and generation torch workers (one of each on the
built-in ``tiny`` model by default) and an orchestrator in front of them with
both relay gates on; waits until the orchestrator's ``/health`` is 200; prints
the URL and a curl line; then watches the children. SIGINT/SIGTERM stop every
child (terminate, wait, kill after a grace period). A child that dies is
reported by name, pid and exit code, the others are stopped, and the launcher
exits non-zero.

Each child is a ``python -m server.cli ...`` process, so what ``up`` runs is
exactly what a user would run by hand. A shared secret (random unless
``FASTCORE_SHARED_SECRET`` is set) is handed to all of them through the
environment, never the command line (which ``ps`` shows), so the workers take
internal requests only from this orchestrator; each generation worker fetches
KV only from this deployment's context workers (``--kv-allow``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from server.auth import SECRET_ENV as SHARED_SECRET_ENV
from server.cli import cannot_listen, missing_extra, port_problem
from server.orchestrator.config import RELAY_MODES

STOP_GRACE_S = 10.0
POLL_S = 0.2


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the launcher dies (even by SIGKILL), so
    no worker outlives its launcher holding a port (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Child:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="worker model: tiny (built in: seeded random weights, so random text), synthetic (no model), "
        "or a Hugging Face directory (default tiny)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of every process (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="orchestrator port (default 8000)")
    parser.add_argument(
        "--worker-base-port",
        type=int,
        default=None,
        help="first worker port; the rest follow (default port+1)",
    )
    parser.add_argument("--context-workers", type=int, default=1, help="context workers (default 1)")
    parser.add_argument("--generation-workers", type=int, default=1, help="generation workers (default 1)")
    parser.add_argument(
        "--orchestrator-workers", type=int, default=1, help="orchestrator processes (default 1)"
    )
    parser.add_argument("--device", default=None, help="worker device: auto, cpu or cuda (worker default)")
    parser.add_argument(
        "--gen-tokids-ctxbytes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="relay prompt ids as base64 bytes (default on)",
    )
    parser.add_argument(
        "--gen-strip-message-history",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send only the last message to generation workers (default on)",
    )
    parser.add_argument("--relay", choices=RELAY_MODES, default="fast",
                        help="orchestrator relay mode (default fast)")  # fmt: skip
    parser.add_argument(
        "--startup-timeout-s", type=float, default=300.0, help="give up if not healthy by then (default 300)"
    )


def plan(args: argparse.Namespace) -> list[Child]:
    """The children to start, workers first, the orchestrator last."""
    for flag in ("context_workers", "generation_workers", "orchestrator_workers"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    python = [sys.executable, "-m", "server.cli"]
    port = args.worker_base_port if args.worker_base_port is not None else args.port + 1
    children: list[Child] = []
    urls: dict[str, list[str]] = {"context": [], "generation": []}
    for role, count in (("context", args.context_workers), ("generation", args.generation_workers)):
        for i in range(count):
            # A generation worker fetches KV from this deployment's context workers only.
            allow = (
                [arg for url in urls["context"] for arg in ("--kv-allow", url)]
                if role == "generation"
                else []
            )
            argv = [
                *python,
                "worker",
                "--role",
                role,
                "--model",
                args.model,
                "--host",
                args.host,
                "--port",
                str(port),
            ]
            if args.device:
                argv += ["--device", args.device]
            argv += allow
            children.append(Child(f"{role} worker {i}", argv, port))
            urls[role].append(f"{args.host}:{port}")
            port += 1
    orchestrator = [
        *python,
        "orchestrator",
        "--host", args.host,
        "--port", str(args.port),
        "--context-urls", ",".join(urls["context"]),
        "--generation-urls", ",".join(urls["generation"]),
        "--relay", args.relay,
        "--workers", str(args.orchestrator_workers),
        "--gen-tokids-ctxbytes" if args.gen_tokids_ctxbytes else "--no-gen-tokids-ctxbytes",
        "--gen-strip-message-history" if args.gen_strip_message_history else "--no-gen-strip-message-history",
    ]  # fmt: skip
    children.append(Child("orchestrator", orchestrator, args.port))
    return children


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _report_dead(children: list[Child]) -> bool:
    dead = [c for c in children if c.exit_code is not None]
    for child in dead:
        assert child.proc is not None
        print(
            f"fastcore-serve: {child.name} (pid {child.proc.pid}, port {child.port}) exited with code "
            f"{child.exit_code}; stopping the others",
            file=sys.stderr,
            flush=True,
        )
    return bool(dead)


def stop_all(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    # The orchestrator first, so no request reaches a worker that is going away.
    for child in reversed(children):
        if child.exit_code is None and child.proc is not None:
            child.proc.terminate()
    deadline = time.monotonic() + grace_s
    for child in reversed(children):
        if child.proc is None:
            continue
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"fastcore-serve: {child.name} ignored SIGTERM for {grace_s:.0f} s; killing it",
                file=sys.stderr,
            )
            child.proc.kill()
            child.proc.wait()


def served_model(url: str, default: str) -> str:
    """The model id the workers serve (a directory's name is not always it)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return default


def banner(args: argparse.Namespace, model: str) -> str:
    url = f"http://{args.host}:{args.port}"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
    return (
        f"fastcore-serve is up: {url}  (Ctrl-C stops everything)\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
    )


def run(args: argparse.Namespace) -> int:
    try:
        children = plan(args)
    except ValueError as exc:
        print(f"fastcore-serve up: {exc}", file=sys.stderr)
        return 2
    if args.model != "synthetic" and importlib.util.find_spec("torch") is None:
        print(f"fastcore-serve up: {missing_extra(ModuleNotFoundError(name='torch'))}", file=sys.stderr)
        return 2
    # Every port before any child starts: one line instead of a child's traceback.
    for child in children:
        why = port_problem(args.host, child.port)
        if why is not None:
            flag = "--port" if child.name == "orchestrator" else "--worker-base-port"
            print(
                cannot_listen("up", args.host, child.port, f"{why} (the {child.name})", flag), file=sys.stderr
            )
            return 2
    stop_requested = False

    def _request_stop(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)
    env = dict(os.environ)
    env.setdefault(SHARED_SECRET_ENV, secrets.token_hex(32))
    try:
        for child in children:
            child.start(env)
        health = f"http://{args.host}:{args.port}/health"
        deadline = time.monotonic() + args.startup_timeout_s
        while not stop_requested and not _healthy(health):
            if _report_dead(children):
                return 1
            if time.monotonic() > deadline:
                print(
                    f"fastcore-serve: not healthy after {args.startup_timeout_s:.0f} s; stopping",
                    file=sys.stderr,
                )
                return 1
            time.sleep(POLL_S)
        if stop_requested:
            return 0
        model = served_model(f"http://{args.host}:{args.port}", args.model)
        print(banner(args, model), flush=True)
        while not stop_requested:
            if _report_dead(children):
                return 1
            time.sleep(POLL_S)
        print("fastcore-serve: stopping", flush=True)
        return 0
    finally:
        stop_all(children)
