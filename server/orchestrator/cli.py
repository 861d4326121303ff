"""``fastcore-serve orchestrator``: run the orchestrator from a YAML config, flags overriding it.

``--workers N`` runs N orchestrator processes on one port (SO_REUSEPORT; the
kernel spreads connections over them): one event loop per core is how the
orchestrator scales on a host. They share one ``max_inflight``, each tenant's
rate limits and the workers' breakers through a mapping made here (fleet.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, get_args

from pydantic import BaseModel

from server import logs
from server.cli import cannot_listen
from server.ports import listen_problem, port_problem
from server.tasks import run_event_loop

from .config import (
    CONTEXT_FALLBACKS,
    RELAY_MODES,
    ROUTER_TYPES,
    VLLM_TRANSFERS,
    WORKER_PROTOCOLS,
    ConfigError,
    OrchestratorConfig,
    build_config,
    config_default,
    load_config_file,
    merge_overrides,
)

if TYPE_CHECKING:
    from .fleet import Fleet, Mapping
    from .tenants import ApiKeys

log = logging.getLogger("fastcore.orchestrator")


def _urls(text: str) -> list[str]:
    return [u for u in text.split(",") if u.strip()]


#: the relay gates (docs/protocol.md#the-two-gates): config key -> what turning it on does
GATES = {
    "gen_tokids_ctxbytes": "relay prompt ids as the context response's base64 bytes",
    "gen_strip_message_history": "send only the last message to the generation worker",
}


def add_gate_arguments(parser: argparse.ArgumentParser, *, default: bool | None) -> None:
    """The gates as ``--gen-...`` / ``--no-gen-...`` flags, one pair per key of GATES.

    ``default`` None, the orchestrator's: a flag not given leaves the config file's key alone (off
    unless the file turns it on; with both off, leg (3) is what an orchestrator without the fast
    path sends). True, ``fastcore-serve up``'s: both gates on is the product's deployment profile,
    which up starts its orchestrator with (docs/protocol.md#the-two-gates: what each changes).
    """
    for key, what in GATES.items():
        shown = config_default(key) if default is None else default
        parser.add_argument(
            "--" + key.replace("_", "-"),
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{what} (default {'on' if shown else 'off'})",
        )


def gate_flags(values: argparse.Namespace) -> list[str]:
    """The flags that set each gate as ``values`` has it (for an orchestrator started as a child)."""
    return [("--" if getattr(values, key) else "--no-") + key.replace("_", "-") for key in GATES]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The orchestrator's flags, in --help's order: a group of them per part."""
    _add_workers_arguments(parser)
    add_gate_arguments(parser, default=None)
    _add_protocol_arguments(parser)
    _add_leg_arguments(parser)
    _add_cluster_arguments(parser)
    _add_access_arguments(parser)
    _add_admission_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    logs.add_arguments(parser)
    _show_defaults(parser)


def _add_workers_arguments(parser: argparse.ArgumentParser) -> None:
    """The config file, the address listened on, the workers and their routers."""
    parser.add_argument(
        "-c",
        "--config",
        metavar="YAML",
        help="config file (docs/configuration.md; trtllm-serve's disaggregated YAML loads too); flags override it",
    )
    parser.add_argument(
        "--host", dest="hostname", help=f"address to listen on (default {config_default('hostname')})"
    )
    parser.add_argument("--port", type=int, help=f"port to listen on (default {config_default('port')})")
    parser.add_argument(
        "--context-urls", type=_urls, metavar="HOST:PORT,...", help="context workers (comma-separated)"
    )
    parser.add_argument(
        "--generation-urls", type=_urls, metavar="HOST:PORT,...", help="generation workers (comma-separated)"
    )
    parser.add_argument("--context-router", choices=ROUTER_TYPES, help="router of the context pool")
    parser.add_argument("--generation-router", choices=ROUTER_TYPES, help="router of the generation pool")


def _add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """What the relay and the legs speak."""
    parser.add_argument(
        "--relay",
        choices=RELAY_MODES,
        help="fast: zero-parse splices; parsed: the pydantic baseline; parsed-msgpack: it with msgpack legs "
        "(as newer trtllm-serve orchestrators send them)",
    )
    parser.add_argument(
        "--worker-protocol",
        choices=WORKER_PROTOCOLS,
        help="what the legs speak to the workers: trtllm (trtllm-serve's disaggregated protocol), vllm "
        "(vLLM's NixlConnector: kv_transfer_params), sglang (SGLang's bootstrap: both legs at once) or auto (read "
        "from each worker at startup)",
    )
    parser.add_argument(
        "--vllm-transfer",
        choices=VLLM_TRANSFERS,
        help="worker_protocol vllm's KV connector: nixl (sequential legs) or mooncake (both legs at once)",
    )


def _add_leg_arguments(parser: argparse.ArgumentParser) -> None:
    """Retries, deadlines, the fallback, draining, health checks, the body limit, processes."""
    parser.add_argument("--max-retries", type=int, help="context/generation leg retries on another worker")
    parser.add_argument("--request-timeout-s", type=float, help="per-leg timeout in seconds")
    parser.add_argument(
        "--context-timeout-s",
        type=float,
        help="the context leg's own deadline in seconds (plus its per-1k-tokens allowance)",
    )
    parser.add_argument(
        "--context-fallback",
        choices=CONTEXT_FALLBACKS,
        help="no context worker takes a request: a generation worker prefills it, or fail",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        help="SIGTERM: seconds requests in flight may take before they are cancelled",
    )
    parser.add_argument("--health-check-interval-s", type=float, help="seconds between worker /health checks")
    parser.add_argument("--max-body-bytes", type=int, help="client body size limit (413 above it)")
    parser.add_argument("--workers", type=int, help="orchestrator processes sharing the port (SO_REUSEPORT)")


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Discovery: the model served, the store and the namespace."""
    parser.add_argument(
        "--model",
        help="the model served: discovered workers of another are refused "
        "(default: the first discovered worker's)",
    )
    parser.add_argument(
        "--cluster-uri",
        metavar="URI",
        help="discover workers: etcd://HOST:PORT, or http://HOST:PORT (this orchestrator "
        "keeps the registry when it is its own address)",
    )
    parser.add_argument("--cluster-name", help="the cluster's namespace in the store (default empty)")


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """The internal secret, the metrics token, client API keys."""
    parser.add_argument(
        "--shared-secret-file",
        metavar="PATH",
        help="file holding the secret that signs internal requests (else $FASTCORE_SHARED_SECRET)",
    )
    parser.add_argument(
        "--metrics-token-file",
        metavar="PATH",
        help="file holding the bearer token GET /metrics asks for (else $FASTCORE_METRICS_TOKEN; "
        "none: /metrics is served to loopback clients only)",
    )
    parser.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help="client API keys, lines '<key> <tenant> [weight]': every /v1/* request needs "
        "Authorization: Bearer <key> (else $FASTCORE_API_KEY: one key); re-read on SIGHUP",
    )
    parser.add_argument(
        "--metrics-requires-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GET /metrics to the metrics token or a client API key only, loopback alone not enough",
    )


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """Admission's bounds and the strictness of the config."""
    parser.add_argument(
        "--max-inflight", type=int, help="admission: completions in the workers at once, all processes"
    )
    parser.add_argument(
        "--max-queue", type=int, help="admission: completions waiting for a slot (429 beyond)"
    )
    parser.add_argument(
        "--max-queue-wait-s",
        type=float,
        help="admission: seconds a completion may wait for a slot (429 beyond)",
    )
    parser.add_argument(
        "--strict-config",
        action="store_true",
        help="refuse a config key the orchestrator does not use (a misspelling), instead of warning",
    )


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Each flag of a config key with a default says it in --help: the flags default to None (a
    flag not given leaves the file's value), so the formatter cannot, and the model has them."""
    for action in parser._actions:
        key = _OVERRIDES.get(action.dest)
        if key is None or action.help is None or "default" in action.help:
            continue
        value = _key_default(key)
        if value is None or value == []:
            continue  # no value of its own (its help says what stands in)
        if isinstance(value, bool):
            value = "on" if value else "off"
        elif isinstance(value, float):
            value = f"{value:g}"
        action.help += f" (default {value})"


def _key_default(key: str) -> Any:
    """The config model's default of a dotted key (``admission.max_queue``: its section's own)."""
    model: Any = OrchestratorConfig
    *sections, name = key.split(".")
    for section in sections:
        annotation = model.model_fields[section].annotation
        # the section's model, also where it is optional (``AdmissionConfig | None``)
        model = next(
            t for t in (annotation, *get_args(annotation)) if isinstance(t, type) and issubclass(t, BaseModel)
        )
    return model.model_fields[name].get_default(call_default_factory=True)


_OVERRIDES = {
    "hostname": "hostname",
    "port": "port",
    "context_urls": "context_servers.urls",
    "generation_urls": "generation_servers.urls",
    "context_router": "context_servers.router.type",
    "generation_router": "generation_servers.router.type",
    "gen_tokids_ctxbytes": "gen_tokids_ctxbytes",
    "gen_strip_message_history": "gen_strip_message_history",
    "relay": "relay",
    "worker_protocol": "worker_protocol",
    "vllm_transfer": "vllm_transfer",
    "max_retries": "max_retries",
    "request_timeout_s": "request_timeout_s",
    "context_timeout_s": "context_timeout_s",
    "context_fallback": "context_fallback",
    "drain_timeout_s": "drain_timeout_s",
    "health_check_interval_s": "health_check_interval_s",
    "max_body_bytes": "max_body_bytes",
    "workers": "workers",
    "shared_secret_file": "shared_secret_file",
    "metrics_token_file": "metrics_token_file",
    "api_keys_file": "api_keys_file",
    "metrics_requires_key": "metrics_requires_key",
    "max_inflight": "admission.max_inflight",
    "max_queue": "admission.max_queue",
    "max_queue_wait_s": "admission.max_queue_wait_s",
    "model": "model",
    "cluster_uri": "disagg_cluster.cluster_uri",
    "cluster_name": "disagg_cluster.cluster_name",
}


def config_from_args(args: argparse.Namespace) -> OrchestratorConfig:
    data = load_config_file(args.config) if args.config else {}
    overrides = {key: getattr(args, attr, None) for attr, key in _OVERRIDES.items()}
    config = build_config(merge_overrides(data, overrides), strict=getattr(args, "strict_config", False))
    config.check_runnable()
    return config


async def serve(config: OrchestratorConfig, *, reuse_port: bool, fleet: Fleet | None = None) -> None:
    """Serve until SIGINT/SIGTERM (``fleet``: this process's part of ``--workers N``)."""
    from server.http.memory import keep_heap_for_bodies

    from .app import start_server

    keep_heap_for_bodies()  # its bodies from a kept heap, trimmed when quiet (server/http/memory.py)

    stop = asyncio.Event()
    told: list[str] = []  # the signal that stopped it, for the stop line
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _told, stop, told, sig)
    try:
        runner, orchestrator = await start_server(config, reuse_port=reuse_port, fleet=fleet)
    except OSError as exc:  # the port was taken after run()'s check
        why = listen_problem(exc)
        if why is None:
            raise
        print(cannot_listen("orchestrator", config.hostname, config.port, why), file=sys.stderr)
        raise SystemExit(2) from None
    except ConfigError as exc:  # worker_protocol: auto: the workers speak several protocols, or none
        print(f"fastcore-serve orchestrator: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # SIGHUP: the key file re-read (a bad one keeps the old keys); without one, a logged no-op
    # (as nginx's reload) rather than the signal's default, which ends the process.
    loop.add_signal_handler(signal.SIGHUP, reload_keys, orchestrator.keys)
    # --workers N: this process's scrape-time values written where the others' scrapes read them.
    metrics_sync = asyncio.ensure_future(orchestrator.registry.keep_synced())
    log.info(
        "orchestrator listening on http://%s:%d (%s)",
        config.hostname,
        config.port,
        started_features(config, orchestrator),
    )
    try:
        await stop.wait()
        # SIGTERM: stop accepting, let requests in flight finish up to the deadline, cancel the rest.
        log.info("%s: stopping, draining requests in flight (up to %g s)", told[0], config.drain_timeout_s)
        await orchestrator.drain(config.drain_timeout_s)
        log.info("drained")
    finally:
        metrics_sync.cancel()
        if fleet is not None:
            await fleet.stop()
        await runner.cleanup()
        orchestrator.registry.sync()  # the last totals of a process that stops
        log.info("exited")


def _told(stop: asyncio.Event, told: list[str], sig: signal.Signals) -> None:
    told.append(sig.name)
    stop.set()


def started_features(config: OrchestratorConfig, orchestrator: Any) -> str:
    """The start line's account of what is on: a reader of the log knows what this process does."""
    cluster = config.disagg_cluster.cluster_uri if config.disagg_cluster is not None else None
    fleet = config.fleet_cluster.cluster_uri if config.fleet_cluster is not None else None
    return "features: " + logs.features(
        api_keys=orchestrator.keys is not None,
        admission=orchestrator.admission is not None,
        tracing=orchestrator.tracing is not None,
        cluster=cluster,
        fleet_cluster=fleet,
        processes=config.workers,
        worker_protocol=orchestrator.protocol.name,
        relay=orchestrator.relay.name,
        gen_tokids_ctxbytes=config.gen_tokids_ctxbytes,
        gen_strip_message_history=config.gen_strip_message_history,
    )


def reload_keys(keys: ApiKeys | None) -> None:
    """SIGHUP: the key table re-reads its file; with no file (none, or one key from the environment) a no-op."""
    if keys is None or keys.path is None:
        log.info("SIGHUP: no api_keys_file, nothing to reload")
        return
    keys.reload()


def _serve_process(
    config_data: dict[str, Any], log_level: str, log_format: str, fleet_path: str, index: int
) -> None:
    from .fleet import Fleet

    logs.configure(f"orchestrator-{index}", log_level, log_format)
    fleet = Fleet.attach(fleet_path, index)
    run_event_loop(serve(OrchestratorConfig.model_validate(config_data), reuse_port=True, fleet=fleet))


def give_back_slots(mapping: Mapping, index: int, name: str) -> int:
    """A child that exited: the admission slots it held go back to the fleet (fleet.py); how many."""
    held = mapping.clear(index)
    if held:
        log.warning("%s exited holding %d admission slots: given back to the other processes", name, held)
    return held


def _run_processes(config: OrchestratorConfig, log_level: str, log_format: str) -> int:
    """N processes on one port; one that dies takes the others down (and is reported).

    Their metrics go through one fresh directory (prometheus_client's multiprocess
    mode): a scrape, whichever process takes it, answers the sum over all of them.
    """
    from server.metrics import SharedMetricsDir

    from .fleet import Mapping

    ctx = multiprocessing.get_context("spawn")
    data = config.model_dump()
    # slots, rate limits and breakers shared by the processes (fleet.py): made before they start
    mapping = Mapping.create(config.workers)
    procs = [
        ctx.Process(
            target=_serve_process,
            args=(data, log_level, log_format, mapping.path, i),
            name=f"orchestrator-{i}",
        )
        for i in range(config.workers)
    ]
    stopping = ""

    def _stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = signal.Signals(signum).name

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)

    # Each process holds its own key table: each re-reads it (or says there is none to re-read).
    def _reload(signum: int, frame: Any) -> None:
        for proc in procs:
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGHUP)

    signal.signal(signal.SIGHUP, _reload)
    metrics_dir = SharedMetricsDir()
    with metrics_dir.exported():  # the spawned children import prometheus_client with it set
        for proc in procs:
            proc.start()
    exit_code = 0
    while not stopping:
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            for proc in dead:
                give_back_slots(mapping, procs.index(proc), proc.name)  # the others drain with them
                metrics_dir.process_dead(proc.pid)
                log.error("%s (pid %s) exited with code %s", proc.name, proc.pid, proc.exitcode)
            exit_code = 1
            break
        time.sleep(0.2)
    if stopping:
        log.info(
            "%s: stopping %d processes (each drains up to %g s)", stopping, len(procs), config.drain_timeout_s
        )
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        proc.join(config.drain_timeout_s + 10)  # each drains its requests first
        if proc.exitcode is None:
            log.warning("%s (pid %s) still running %g s past its drain: killed", proc.name, proc.pid, 10)
            proc.kill()
            proc.join()
        metrics_dir.process_dead(proc.pid)
    metrics_dir.remove()
    mapping.remove()
    log.info("exited (code %d)", exit_code)
    return exit_code


def run(args: argparse.Namespace) -> int:
    logs.configure("orchestrator", args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"fastcore-serve orchestrator: {exc}", file=sys.stderr)
        return 2
    why = port_problem(config.hostname, config.port)
    if why is not None:
        print(cannot_listen("orchestrator", config.hostname, config.port, why), file=sys.stderr)
        return 2
    if config.workers > 1:
        return _run_processes(config, args.log_level, args.log_format)
    run_event_loop(serve(config, reuse_port=False))
    return 0
