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
``FASTCORE_SHARED_SECRET`` is set) is handed to all of them in a file only
this user can read (``--shared-secret-file``, 0600 in a 0700 temporary
directory, removed once they are up), never the command line (which ``ps``
shows) nor their environment (``/proc/<pid>/environ``, inherited by whatever
they start), so the workers take internal requests only from this
orchestrator; each generation worker fetches KV only from this deployment's
context workers (``--kv-allow``).

``--cluster``: the same deployment found through cluster discovery instead of
urls: a local etcd (on free ports, or ``--etcd-port`` and the next one; data
in a temporary directory) that the workers register in (``--cluster-uri``,
``--cluster-name``) and the orchestrator watches (``--model`` and no urls).
``--cluster-uri etcd://...`` uses an etcd already running; ``--cluster-uri
http://HOST:<port>`` the orchestrator's embedded registry (no etcd). It is up
when every worker is discovered; it stops the workers first (they deregister),
then the orchestrator, then the etcd it started.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from server import logs
from server.auth import SECRET_ENV as SHARED_SECRET_ENV
from server.cli import cannot_listen, missing_extra
from server.metrics_access import METRICS_TOKEN_ENV
from server.orchestrator.cli import add_gate_arguments, gate_flags
from server.orchestrator.config import RELAY_MODES, config_default
from server.ports import port_problem, release_ports, reserve_ports
from server.process import import_path_env, python_module, start_child
from server.worker.cli import DEFAULT_MODEL, served_name
from server.worker.tool_calls import TOOL_CALL_PARSERS

STOP_GRACE_S = 10.0
#: how long past its drain deadline a child may take to exit before it is killed (a worker waits up
#: to 2 s more for parked KV to be fetched; an orchestrator with --workers N joins each process)
STOP_MARGIN_S = 15.0
POLL_S = 0.2
#: the cluster name of ``up --cluster`` unless --cluster-name says otherwise
DEFAULT_CLUSTER_NAME = "local"

log = logging.getLogger("fastcore.launcher")


@dataclass
class Child:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        # Its own session: a terminal's Ctrl-C (sent to the whole foreground group) reaches only
        # the launcher, which stops the children in its order (stop_all: with a cluster the
        # workers first, so they deregister while the orchestrator's registry still runs).
        # They still go down if the launcher dies (server.process.die_with_parent).
        self.proc = start_child(self.argv, env=env)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_deployment_arguments(parser)
    _add_worker_arguments(parser)
    _add_orchestrator_arguments(parser)
    _add_lifecycle_arguments(parser)
    _add_cluster_arguments(parser)


def _add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs, where: the model, the ports, how many of each process."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="worker model: tiny (built in: seeded random weights, so random text), synthetic (no model), "
        f"or a Hugging Face directory (default {DEFAULT_MODEL})",
    )
    host, port = config_default("hostname"), config_default("port")
    parser.add_argument("--host", default=host, help=f"address of every process (default {host})")
    parser.add_argument("--port", type=int, default=port, help=f"orchestrator port (default {port})")
    parser.add_argument(
        "--worker-base-port",
        type=int,
        default=None,
        help="first worker port; the rest follow (default port+1)",
    )
    parser.add_argument(
        "--context-workers", type=int, default=1, help="context workers (default %(default)s)"
    )
    parser.add_argument(
        "--generation-workers", type=int, default=1, help="generation workers (default %(default)s)"
    )
    parser.add_argument(
        "--orchestrator-workers", type=int, default=1, help="orchestrator processes (default %(default)s)"
    )


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Passed on to every worker (each unset one: the worker's default)."""
    parser.add_argument("--device", default=None, help="worker device: auto, cpu or cuda (worker default)")
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the workers' tool-call parser: hermes, llama3_json or none (worker default)",
    )
    parser.add_argument(
        "--script",
        default=None,
        metavar="FILE",
        help="--model synthetic: the workers' scripted answers (the worker's --script), e.g. "
        "tool calls for an agent client's tests",
    )


def _add_orchestrator_arguments(parser: argparse.ArgumentParser) -> None:
    add_gate_arguments(parser, default=True)  # up runs the product's profile: both gates on
    relay = config_default("relay")
    parser.add_argument(
        "--relay", choices=RELAY_MODES, default=relay, help=f"orchestrator relay mode (default {relay})"
    )


def _add_lifecycle_arguments(parser: argparse.ArgumentParser) -> None:
    """How long it waits for the children to come up and to go down, and how they log."""
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=10.0,
        help="on Ctrl-C/SIGTERM: seconds each child gives its requests in flight before cancelling them "
        f"(a child still there {STOP_MARGIN_S:g} s later is killed; default %(default)g)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="give up if not healthy by then (default %(default)g)",
    )
    logs.add_arguments(parser)  # the launcher's lines and every child's


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("cluster (workers found through discovery instead of urls)")
    cluster.add_argument(
        "--cluster",
        action="store_true",
        help="workers register in a cluster store that the orchestrator watches: a local "
        "etcd unless --cluster-uri names one",
    )
    cluster.add_argument(
        "--cluster-uri",
        default=None,
        metavar="URI",
        help="etcd://HOST:PORT[,...] (an etcd already running) or http://HOST:<--port> (the "
        "orchestrator's embedded registry, no etcd); implies --cluster (default: start "
        "a local etcd)",
    )
    cluster.add_argument(
        "--cluster-name",
        default=None,
        help=f"the cluster's namespace in the store (default {DEFAULT_CLUSTER_NAME})",
    )
    cluster.add_argument(
        "--etcd-port",
        type=int,
        default=None,
        help="client port of the local etcd, its peer port the next one (default: two free ports)",
    )


def clustered(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "cluster", False) or getattr(args, "cluster_uri", None))


def check_cluster_args(args: argparse.Namespace) -> None:
    """Refuse cluster flags that do not go together (ValueError naming them)."""
    if not clustered(args):
        for flag in ("cluster_name", "etcd_port"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --cluster")
        return
    uri = args.cluster_uri
    if uri is not None:
        from server.cluster.records import ClusterSettings, RecordError

        try:
            ClusterSettings(cluster_uri=uri.rstrip("/"), cluster_name=args.cluster_name or "")
        except RecordError as exc:
            raise ValueError(f"--cluster-uri/--cluster-name: {exc}") from None
        if args.etcd_port is not None:
            raise ValueError("--etcd-port starts a local etcd: not with --cluster-uri")
        if uri.startswith("http://") and args.orchestrator_workers > 1:
            raise ValueError(
                "--cluster-uri http://: the embedded registry is kept by one orchestrator process; "
                "use --orchestrator-workers 1 (or an etcd)"
            )
    elif args.cluster_name is not None:
        from server.cluster.records import ClusterSettings, RecordError

        try:
            ClusterSettings(cluster_uri="etcd://127.0.0.1:2379", cluster_name=args.cluster_name)
        except RecordError as exc:
            raise ValueError(f"--cluster-name: {exc}") from None


def plan(args: argparse.Namespace, cluster_uri: str | None = None) -> list[Child]:
    """The children to start, workers first, the orchestrator last.

    With ``cluster_uri`` the workers register there and the orchestrator
    discovers them (no urls); else the orchestrator is given the workers' urls.
    """
    for flag in ("context_workers", "generation_workers", "orchestrator_workers"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if not args.drain_timeout_s >= 0:
        raise ValueError("--drain-timeout-s must be 0 or more")
    if getattr(args, "script", None) and args.model != "synthetic":
        raise ValueError("--script scripts the synthetic workers' answers: it needs --model synthetic")
    cluster_name = getattr(args, "cluster_name", None) or DEFAULT_CLUSTER_NAME
    cluster_args = ["--cluster-uri", cluster_uri, "--cluster-name", cluster_name] if cluster_uri else []
    python = python_module("server.cli")  # never the working directory's server/ or fastcore/
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
            if args.tool_call_parser:
                argv += ["--tool-call-parser", args.tool_call_parser]
            if args.script:  # the children's working directory may differ
                argv += ["--script", os.path.abspath(args.script)]
            argv += [
                "--drain-timeout",
                f"{args.drain_timeout_s:g}",
                "--log-format",
                args.log_format,
                *allow,
                *cluster_args,
            ]
            children.append(Child(f"{role} worker {i}", argv, port))
            urls[role].append(f"{args.host}:{port}")
            port += 1
    if cluster_uri:
        pools = [*cluster_args, "--model", served_name(args.model)]
    else:
        pools = [
            "--context-urls",
            ",".join(urls["context"]),
            "--generation-urls",
            ",".join(urls["generation"]),
        ]
    orchestrator = [
        *python,
        "orchestrator",
        "--host", args.host,
        "--port", str(args.port),
        *pools,
        "--relay", args.relay,
        "--workers", str(args.orchestrator_workers),
        "--drain-timeout-s", f"{args.drain_timeout_s:g}",
        "--log-format", args.log_format,
        *gate_flags(args),
    ]  # fmt: skip
    children.append(Child("orchestrator", orchestrator, args.port))
    return children


def write_secret_file(secret: str) -> str:
    """A new file holding ``secret``, readable by this user only (0600, in a 0700 directory)."""
    directory = tempfile.mkdtemp(prefix="fastcore-up-")
    path = os.path.join(directory, "shared-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return path


def remove_secret_file(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


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
        log.error(
            "%s (pid %d, port %d) exited with code %s; stopping the others",
            child.name,
            child.proc.pid,
            child.port,
            child.exit_code,
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
            log.warning("%s ignored SIGTERM for %.0f s; killing it", child.name, grace_s)
            child.proc.kill()
            child.proc.wait()


def served_model(url: str, default: str) -> str:
    """The model id the workers serve (a directory's name is not always it)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return default


_CLUSTER_WORKERS = re.compile(
    r'^fastcore_orchestrator_cluster_workers\{[^}]*pool="(\w+)"[^}]*\} (\S+)$', re.M
)


def discovered(url: str, environ: dict[str, str] | None = None) -> dict[str, float]:
    """The orchestrator's discovered workers per pool (its /metrics), {} when it cannot say.

    With ``$FASTCORE_METRICS_TOKEN`` (which the children inherit) the page asks for it."""
    token = (os.environ if environ is None else environ).get(METRICS_TOKEN_ENV)
    request = urllib.request.Request(url + "/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=2) as resp:
            page = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return {}
    counts: dict[str, float] = {}
    for pool, value in _CLUSTER_WORKERS.findall(page):
        with contextlib.suppress(ValueError):
            counts[pool] = counts.get(pool, 0.0) + float(value)
    return counts


def registry_hint(args: argparse.Namespace) -> str:
    """The --cluster-uri of this deployment's embedded registry (the orchestrator's address)."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def no_etcd_message(args: argparse.Namespace) -> str:
    from server.cluster.local_etcd import INSTALL_HINT

    return (
        f"fastcore-serve up --cluster: no etcd binary: {INSTALL_HINT}; or pass --cluster-uri "
        f"{registry_hint(args)} to use the orchestrator's embedded registry"
    )


def banner(
    args: argparse.Namespace, model: str, cluster: str | None = None, children: list[Child] | None = None
) -> str:
    url = f"http://{args.host}:{args.port}"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
    lines = [f"fastcore-serve is up: {url}  (Ctrl-C stops everything)"]
    if cluster is not None:
        lines.append(f"  cluster: {cluster}")
        for child in children or []:
            pid = child.proc.pid if child.proc is not None else "-"
            lines.append(f"  {child.name}: http://{args.host}:{child.port} (pid {pid})")
    lines.append(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    return "\n".join(lines)


def _etcd_log_tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  etcd: {line}" for line in tail)


def _refusal(args: argparse.Namespace, children: list[Child]) -> str | None:
    """Why ``up`` cannot start as asked (what to print), checked before anything starts; None: it can."""
    if clustered(args) and not args.cluster_uri:
        from server.cluster.local_etcd import find_etcd

        if find_etcd() is None:
            return no_etcd_message(args)
    if args.model != "synthetic" and importlib.util.find_spec("torch") is None:
        return f"fastcore-serve up: {missing_extra(ModuleNotFoundError(name='torch'))}"
    # Every port before any child starts: a line per unusable port (all of them, so that what one
    # run says does not depend on which other ports happen to be taken) instead of a traceback.
    busy = []
    for child in children:
        why = port_problem(args.host, child.port)
        if why is not None:
            flag = "--port" if child.name == "orchestrator" else "--worker-base-port"
            busy.append(cannot_listen("up", args.host, child.port, f"{why} (the {child.name})", flag))
    return "\n".join(busy) or None


def _local_etcd_ports(args: argparse.Namespace, children: list[Child]) -> tuple[int, int] | str:
    """The local etcd's client and peer ports (--etcd-port and the next, else two free ones), or why not."""
    if args.etcd_port is None:
        # Held until etcd listens on them (it binds with SO_REUSEADDR: see server.ports).
        client, peer = reserve_ports(2, avoid={c.port for c in children})
        return client, peer
    ports = (args.etcd_port, args.etcd_port + 1)
    for port, what in zip(ports, ("client", "peer")):
        why = port_problem("127.0.0.1", port)
        if why is not None:
            return cannot_listen("up", "127.0.0.1", port, f"{why} (the etcd's {what} port)", "--etcd-port")
    return ports


def run(args: argparse.Namespace) -> int:
    logs.configure("launcher", logging.INFO, args.log_format)
    cluster = clustered(args)
    try:
        check_cluster_args(args)
        # A placeholder URI: the ports of the plan are known before the etcd's are chosen.
        children = plan(args, "etcd://127.0.0.1:0" if cluster else None)
    except ValueError as exc:
        print(f"fastcore-serve up: {exc}", file=sys.stderr)
        return 2
    why = _refusal(args, children)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    etcd_ports: tuple[int, int] | None = None
    if cluster and not args.cluster_uri:
        ports = _local_etcd_ports(args, children)
        if isinstance(ports, str):
            print(ports, file=sys.stderr)
            return 2
        etcd_ports = ports
    cluster_uri = args.cluster_uri.rstrip("/") if args.cluster_uri else None
    if etcd_ports is not None:
        cluster_uri = f"etcd://127.0.0.1:{etcd_ports[0]}"
    if cluster:
        children = plan(args, cluster_uri)
    return _deploy(args, children, cluster_uri, etcd_ports)


class _StopRequest:
    """A signal handler that notes SIGINT/SIGTERM; the launcher's loops look at it between polls."""

    def __init__(self) -> None:
        self.requested = False
        #: the signal's name, for the stop line
        self.signal = ""
        signal.signal(signal.SIGINT, self._note)
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.signal = signal.Signals(signum).name


def _deploy(
    args: argparse.Namespace,
    children: list[Child],
    cluster_uri: str | None,
    etcd_ports: tuple[int, int] | None,
) -> int:
    """Start the etcd (with ``etcd_ports``) and the children, say it is up, watch them; stop everything."""
    cluster = clustered(args)
    # Children drain their requests in flight first (--drain-timeout-s): killed only past that.
    grace = args.drain_timeout_s + STOP_MARGIN_S
    stop = _StopRequest()
    # The secret reaches the children in a 0600 file (--shared-secret-file), not their environment:
    # a process's environment is in /proc/<pid>/environ and passes to everything it starts.
    env = import_path_env(dict(os.environ))
    secret_file = write_secret_file(env.pop(SHARED_SECRET_ENV, "") or secrets.token_hex(32))
    for child in children:
        child.argv += ["--shared-secret-file", secret_file]
    etcd = None
    watched = list(children)
    try:
        if etcd_ports is not None:
            from server.cluster.local_etcd import LocalEtcd

            etcd = LocalEtcd(*etcd_ports)
            try:
                etcd.start()
            except (RuntimeError, TimeoutError, OSError) as exc:
                release_ports(etcd_ports)
                print(
                    f"fastcore-serve up --cluster: etcd did not start: {exc}{_etcd_log_tail(etcd.log_path)}",
                    file=sys.stderr,
                )
                return 1
            release_ports(etcd_ports)
            watched.append(Child("etcd", [etcd.binary], etcd.client_port, etcd.proc))
        for child in children:
            child.start(env)
        failed = _wait_until_up(args, watched, stop)
        # Every child read it at start (an orchestrator's processes get it from their parent).
        remove_secret_file(secret_file)
        if failed is not None or stop.requested:
            return failed or 0
        model = served_model(f"http://{args.host}:{args.port}", args.model)
        where = _cluster_line(args, cluster_uri, etcd) if cluster else None
        print(banner(args, model, where, children), flush=True)
        log.info("up: %s", ", ".join(f"{c.name} pid {c.proc.pid}" for c in watched if c.proc is not None))
        while not stop.requested:
            if _report_dead(watched):
                return 1
            time.sleep(POLL_S)
        return 0
    finally:
        remove_secret_file(secret_file)
        if stop.requested:
            log.info("%s: stopping every child (each drains up to %g s)", stop.signal, args.drain_timeout_s)
        if cluster:
            # The workers first (they deregister, from the orchestrator's registry too), then the
            # orchestrator, then the etcd they deregistered from.
            stop_all(children[:-1], grace)
            stop_all(children[-1:], grace)
        else:
            stop_all(children, grace)
        if etcd is not None:
            etcd.stop()
        log.info("exited")


def _wait_until_up(args: argparse.Namespace, watched: list[Child], stop: _StopRequest) -> int | None:
    """Poll until the orchestrator's /health is 200 (and, with a cluster, every worker is discovered),
    a stop is asked for (None), a child dies or --startup-timeout-s passes (the exit code, 1)."""
    base = f"http://{args.host}:{args.port}"
    expected = {"context": args.context_workers, "generation": args.generation_workers}

    def _up() -> bool:
        if not _healthy(base + "/health"):
            return False
        if not clustered(args):
            return True
        counts = discovered(base)
        return all(counts.get(pool, 0) >= n for pool, n in expected.items())

    deadline = time.monotonic() + args.startup_timeout_s
    while not stop.requested and not _up():
        if _report_dead(watched):
            return 1
        if time.monotonic() > deadline:
            log.error("not healthy after %.0f s; stopping", args.startup_timeout_s)
            return 1
        time.sleep(POLL_S)
    return None


def _cluster_line(args: argparse.Namespace, cluster_uri: str | None, etcd: Any) -> str:
    """The banner's line on where the workers registered."""
    if etcd is not None:
        kind = f"etcd {cluster_uri} (started here, data in {etcd.data_dir}; stopped last)"
    elif str(cluster_uri).startswith("etcd://"):
        kind = f"etcd {cluster_uri}"
    else:
        kind = f"the orchestrator's embedded registry at {cluster_uri}"
    name = args.cluster_name or DEFAULT_CLUSTER_NAME
    return (
        f"{kind}, name {name}: {args.context_workers} context + {args.generation_workers} "
        "generation workers registered"
    )
