"""``fastcore-serve worker``: a torch worker (or a synthetic one) on one port."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from typing import Any
from urllib.parse import urlsplit

from server import logs
from server.auth import SECRET_ENV, read_secret
from server.cli import cannot_listen
from server.metrics_access import METRICS_TOKEN_ENV
from server.ports import listen_problem, port_problem
from server.tasks import run_event_loop

from .engine_api import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_STEP_RATIO,
    DEFAULT_PREFIX_CACHING,
)
from .settings import ROLES, WorkerSettings
from .synthetic import add_arguments as add_synthetic_arguments
from .tokenizer import Tokenizer
from .tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("fastcore.worker")

#: flag dest -> the WorkerSettings field it sets: the flag's default is the field's (one home for it)
_SETTINGS = {
    "role": "role",
    "kv_ttl": "kv_ttl_s",
    "kv_fetch_timeout": "kv_fetch_timeout_s",
    "max_parked_fraction": "max_parked_fraction",
    "admission_wait": "admission_wait_s",
    "max_waiting": "max_waiting",
    "stream_stall_timeout": "stream_stall_timeout_s",
    "public_url": "public_url",
    "accept_trtllm_orchestrator": "accept_trtllm_orchestrator",
    "otlp_traces_endpoint": "otlp_traces_endpoint",
    "cache_events_chunk_bytes": "cache_events_chunk_bytes",
    "max_body_bytes": "max_body_bytes",
    "header_timeout": "header_timeout_s",
    "body_timeout": "body_timeout_s",
    "keepalive_timeout": "keepalive_timeout_s",
    "max_connections": "max_connections",
    "max_inflight_body_bytes": "max_inflight_body_bytes",
    "client_ip_share": "client_ip_share",
    "tool_call_parser": "tool_call_parser",
}
#: SIGTERM: seconds the requests in flight and parked KV get before the worker stops
DRAIN_TIMEOUT_S = 30.0
#: --model's default (fastcore-serve up's too): the built-in model, no download
DEFAULT_MODEL = "tiny"


def served_name(model: str) -> str:
    """The model id a worker of ``--model model`` serves without --served-model-name."""
    if model in ("tiny", "synthetic"):
        return model
    return os.path.basename(os.path.normpath(model))


def _default(dest: str) -> Any:
    """The default of the flag whose value goes to WorkerSettings (its field's default)."""
    return WorkerSettings.__dataclass_fields__[_SETTINGS[dest]].default


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n % (1 << 30) == 0 else f"{n >> 20} MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    _add_cache_arguments(parser)
    _add_scheduling_arguments(parser)
    _add_serving_arguments(parser)
    _add_auth_arguments(parser)
    _add_limit_arguments(parser)
    _add_cluster_arguments(parser)
    add_synthetic_arguments(parser)


def _setting(parser: argparse._ActionsContainer, flag: str, help: str, **options: Any) -> None:
    """A flag whose value goes to WorkerSettings (:data:`_SETTINGS`): its default is the field's,
    which ``help`` states as ``{default}`` (``{size}``: in GiB or MiB), so it is written once."""
    default = _default(flag[2:].replace("-", "_"))
    size = _size(default) if "{size}" in help else None
    parser.add_argument(flag, default=default, help=help.format(default=default, size=size), **options)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What the worker serves, and where."""
    _setting(parser, "--role", "disaggregated role (default {default})", choices=ROLES)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'tiny' (built in, seeded random weights: random text, no download), 'synthetic' (no model: "
        f"canned tokens at a set speed), or a Hugging Face model directory (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: --model's name)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8001, help="port to listen on (default %(default)s; 0: any free)"
    )


def _add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The torch engine's device and KV cache."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when torch sees a GPU, else cpu (default %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="auto: float32 on CPU and for tiny, else the checkpoint's dtype",
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help=f"KV cache size in tokens (default: {DEFAULT_KV_TOKENS} for tiny, else from free memory)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"KV cache block size in tokens (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_PREFIX_CACHING,
        help="reuse the KV of full blocks a prompt shares with an earlier one "
        f"(default {'on' if DEFAULT_PREFIX_CACHING else 'off'})",
    )
    parser.add_argument(
        "--kv-tier2-path",
        default=None,
        metavar="DIR",
        help="with --kv-tier2-tokens: the torch engine's second tier is files under DIR (one a "
        "block, at most that many tokens; emptied at start) instead of host memory",
    )


def _add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    """How the torch engine fills its steps, and how an answer's text is read."""
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"most sequences in one decode batch (default {DEFAULT_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=_non_negative,
        default=DEFAULT_PREFILL_CHUNK_TOKENS,
        help="a step's token budget: one per running stream's decode, the rest for chunks of "
        "waiting prompts (a long one cut to fit, several short ones in one forward), so a "
        "long prefill does not stop the running streams; 0: each prompt prefilled whole "
        f"(default {DEFAULT_PREFILL_CHUNK_TOKENS})",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=_default("tool_call_parser"),
        help="how a chat answer's tool calls are read out of the generated text, as vLLM names "
        "it: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Hermes), llama3_json "
        "(Llama 3.1+'s JSON calls), none: no parsing (default %(default)s)",
    )
    parser.add_argument(
        "--prefill-step-ratio",
        type=_step_ratio,
        default=DEFAULT_PREFILL_STEP_RATIO,
        help="while streams decode, a step carrying prompt chunks may take this many times "
        "their decode-only step (measured): fewer chunk tokens where a chunk costs more "
        "than a decode step, e.g. on a CPU or late in a long prompt; 0: the token budget "
        f"alone (default {DEFAULT_PREFILL_STEP_RATIO:g})",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: half the CPUs, 1 to 4)",
    )


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    _setting(
        parser,
        "--kv-ttl",
        "seconds a context leg's KV waits for its generation worker (default {default:g})",
        type=float,
    )
    _setting(parser, "--kv-fetch-timeout", "seconds for one KV fetch (default {default:g})", type=float)
    logs.add_arguments(parser)
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="SIGTERM: seconds the requests in flight and parked KV get before the worker "
        "stops (it deregisters and refuses new requests first; "
        f"default {DRAIN_TIMEOUT_S:g})",
    )
    _setting(
        parser, "--public-url", "base URL put in ctx_info_endpoint (default: the Host the request came in on)"
    )
    _setting(
        parser,
        "--max-parked-fraction",
        "most of the KV cache that parked context KV may hold; the oldest go first (default {default:g})",
        type=float,
    )
    _setting(
        parser,
        "--admission-wait",
        "seconds a request that does not fit in the KV cache waits for room before its 503 "
        "(default {default:g})",
        type=float,
    )
    _setting(
        parser,
        "--max-waiting",
        "requests waiting for KV room at once; 503 at once beyond (default {default})",
        type=int,
    )
    _setting(
        parser,
        "--stream-stall-timeout",
        "seconds a stream's client may read nothing (its write buffer full) before the stream is "
        "dropped and its KV freed (default {default:g})",
        type=float,
    )
    _setting(
        parser,
        "--cache-events-chunk-bytes",
        "GET /cache_events' chunk size in prompt bytes: the orchestrators' kv_cache_aware chunk_bytes "
        "must be it (another is refused) (default {default})",
        type=int,
    )
    _setting(
        parser,
        "--otlp-traces-endpoint",
        "send OpenTelemetry traces to this OTLP/HTTP collector URL (needs the [otel] extra; else "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / $OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing). "
        "The other OTEL_* variables apply (docs/tracing.md)",
        metavar="URL",
    )


def _add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-allow",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="a host a generation worker may fetch KV from (repeatable; default: loopback "
        "only without a shared secret, any host with one)",
    )
    parser.add_argument(
        "--shared-secret-file",
        default=None,
        metavar="PATH",
        help="file holding the HMAC secret for internal requests",
    )
    parser.add_argument(
        "--shared-secret",
        default=None,
        help=f"the HMAC secret itself: visible to anyone who can run ps; prefer "
        f"--shared-secret-file (${SECRET_ENV}, the default, is readable in "
        f"/proc/<pid>/environ and inherited by child processes)",
    )
    parser.add_argument(
        "--internal-request-auth-key-file",
        default=None,
        metavar="PATH",
        help="file holding the key of trtllm-serve's x-trtllm-disagg-auth (its config's "
        "internal_request_auth_key; default: the shared secret)",
    )
    parser.add_argument(
        "--metrics-token-file",
        default=None,
        metavar="PATH",
        help="file holding the bearer token GET /metrics asks for (else "
        "$FASTCORE_METRICS_TOKEN; none: /metrics is served to loopback clients only)",
    )
    parser.add_argument(
        "--accept-trtllm-orchestrator",
        action="store_true",
        help="a trtllm-serve orchestrator fronts this worker: accept its unsigned legs "
        "(context legs, generation legs not naming the KV) despite a shared secret, "
        "and answer completions' prompt ids as a list (trtllm's response model)",
    )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's server.http Limits (defaults: server/http/limits.py, the WORKER_* ones where a
    worker's differ from the orchestrator's; docs/configuration.md#worker-http-limits)."""
    limits = parser.add_argument_group("HTTP limits (what one client may hold)")
    _setting(
        limits,
        "--header-timeout",
        "seconds to send a request's headers (408 after; default {default:g})",
        type=float,
    )
    _setting(
        limits,
        "--body-timeout",
        "seconds to send a request's body (408 after; default {default:g})",
        type=float,
    )
    _setting(
        limits,
        "--keepalive-timeout",
        "seconds an idle keep-alive connection stays open (default {default:g})",
        type=float,
    )
    _setting(limits, "--max-connections", "open client connections; 503 beyond (default {default})", type=int)
    _setting(limits, "--max-body-bytes", "request body size limit, 413 above it (default {size})", type=int)
    _setting(
        limits,
        "--max-inflight-body-bytes",
        "request body bytes held at once by the whole worker; 503 beyond (default {size})",
        type=int,
    )
    _setting(
        limits,
        "--client-ip-share",
        "one client IP past this share of the connections or body bytes may not take their last share, "
        "kept for the others; 1: no per-client bound (default {default})",
        type=_share,
    )


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    from server.cluster.records import HEARTBEAT_INTERVAL_S, INACTIVE_TIMEOUT_S, LAYOUTS, ClusterSettings

    defaults = ClusterSettings.__dataclass_fields__
    heartbeat, inactive = HEARTBEAT_INTERVAL_S, INACTIVE_TIMEOUT_S
    cluster = parser.add_argument_group(
        "cluster (register in a disagg_cluster: etcd, or an orchestrator's registry)"
    )
    cluster.add_argument(
        "--cluster-uri",
        default=None,
        metavar="URI",
        help="etcd://HOST:PORT[,HOST:PORT...] or http://ORCHESTRATOR:PORT (default: none, not registered)",
    )
    cluster.add_argument(
        "--cluster-name",
        default=defaults["cluster_name"].default,
        help="the cluster's namespace (default empty)",
    )
    cluster.add_argument(
        "--heartbeat-interval-sec",
        type=float,
        default=heartbeat,
        help=f"seconds between heartbeats (default {heartbeat:g})",
    )
    cluster.add_argument(
        "--inactive-timeout-sec",
        type=float,
        default=inactive,
        help="seconds without a heartbeat before the cluster forgets this worker "
        f"(its etcd lease's TTL; default {inactive:g})",
    )
    cluster.add_argument(
        "--cluster-record-format",
        choices=LAYOUTS,
        default=defaults["record_format"].default,
        help="register fastcore's record (default), or trtllm-serve's {worker_id, host, "
        "port, role} under /trtllm-disagg/ (its HTTP storage API on http://) so a "
        "trtllm-serve orchestrator discovers this worker",
    )


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _step_ratio(text: str) -> float:
    value = float(text)
    if value != 0.0 and not value > 1.0:  # a NaN is refused too
        raise argparse.ArgumentTypeError(f"must be > 1 (0: off), got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {text}")
    return value


def cluster_settings(args: argparse.Namespace, secret: bytes | None) -> Any:
    """The worker's ClusterSettings, or None without --cluster-uri (raises ValueError naming the flag)."""
    if not args.cluster_uri:
        return None
    from server.cluster import ClusterSettings

    return ClusterSettings(
        cluster_uri=args.cluster_uri.rstrip("/"),
        cluster_name=args.cluster_name,
        heartbeat_interval_s=args.heartbeat_interval_sec,
        inactive_timeout_s=args.inactive_timeout_sec,
        secret=secret,
        record_format=args.cluster_record_format,
    )


def advertised_url(settings: WorkerSettings, host: str, port: int) -> str:
    """Where others reach this worker: --public-url, else its address (a wildcard one: the host's name)."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def default_torch_threads() -> int:
    """Half the CPUs, 1 to 4: the event loop, the HTTP clients and other workers need cores too.

    An intra-op pool as wide as the machine makes every op wait at a barrier for
    a thread the OS has given to someone else (measured on 2 cores: batch-8
    decode at 0.5x of batch 1 with 2 threads, 1.8x with 1).
    """
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class DeviceError(ValueError):
    """``--device`` names a device torch cannot use here."""


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda: torch sees no CUDA device (without a GPU: --device cpu or auto)")
    return name


#: what a Hugging Face hub id looks like (``Qwen/Qwen2-0.5B``): one slash, no leading ``/`` or ``.``
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def not_downloaded(model: str) -> str | None:
    """Why ``--model`` cannot load when it names no directory but reads as a hub id (else None):
    nothing is downloaded here, so say what to fetch and what to pass instead."""
    if os.path.exists(model) or not _HUB_ID.fullmatch(model):
        return None
    local = model.rsplit("/", 1)[1]
    return (
        "no such directory, and a Hugging Face hub id is not downloaded here: download the checkpoint "
        f"first (huggingface-cli download {model} --local-dir {local}) and pass its directory (--model {local})"
    )


def build_engine(args: argparse.Namespace) -> tuple[Any, str, str]:
    """The engine for ``args``, its model name, and the device it runs on."""
    if args.model == "synthetic":  # no model: no torch on the request path
        from . import synthetic

        if args.role != "both":
            # A KV hand-off needs torch (kv_transfer): imported here, before the port opens,
            # not by the first hand-off, which would stall the loop (heartbeats included) ~2 s.
            from . import kv_transfer  # noqa: F401

        return synthetic.build_engine(args), args.served_model_name or served_name(args.model), "cpu"
    import torch

    from .engine import TorchEngine

    threads = args.torch_threads or default_torch_threads()
    torch.set_num_threads(threads)
    device = resolve_device(args.device)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    tokenizer: Tokenizer
    if args.model == "tiny":
        from .tiny import build_tiny

        dtype = dtypes.get(args.dtype, torch.float32)
        config, model, tokenizer = build_tiny(device, dtype)
        kv_tokens = args.kv_tokens or DEFAULT_KV_TOKENS
    else:
        from .hf import load_model_dir

        why = not_downloaded(args.model)
        if why is not None:
            raise ValueError(why)
        # auto: the loader picks (float32 on CPU, the checkpoint's dtype on CUDA).
        dtype_arg = None if args.dtype == "auto" else dtypes[args.dtype]
        config, model, tokenizer = load_model_dir(args.model, device, dtype_arg)
        kv_tokens = args.kv_tokens or default_kv_tokens(config, model, device)
    engine = TorchEngine(
        config,
        model,
        tokenizer,
        device=device,
        kv_tokens=kv_tokens,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        max_num_seqs=args.max_num_seqs,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefill_step_ratio=args.prefill_step_ratio,
    )
    if args.kv_tier2_tokens or args.kv_tier2_path:  # a second KV tier (server/worker/kv_tier2.py)
        engine.cache.attach_tier2(args.kv_tier2_tokens, args.kv_tier2_path)
    return engine, args.served_model_name or served_name(args.model), device


def default_kv_tokens(config: Any, model: Any, device: str) -> int:
    """Half the free GPU memory (or 2 GiB of host memory) as KV, capped at 64 full contexts."""
    import torch

    elem = next(model.parameters()).element_size()
    per_token = 2 * config.num_hidden_layers * config.kv_heads * config.dim_per_head * elem
    budget = 2 << 30
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        budget = free // 2
    return max(config.max_context, min(budget // per_token, 64 * config.max_context))


def run(args: argparse.Namespace) -> int:
    logs.configure(f"{args.role}-worker", logging.INFO, args.log_format)
    try:
        secret = read_secret(args.shared_secret, args.shared_secret_file)
    except (OSError, ValueError) as exc:
        print(f"fastcore-serve worker: cannot read the shared secret: {exc}", file=sys.stderr)
        return 2
    try:
        metrics_token = read_secret(
            None, args.metrics_token_file, env_name=METRICS_TOKEN_ENV, what="metrics token"
        )
    except (OSError, ValueError) as exc:
        print(f"fastcore-serve worker: cannot read the metrics token: {exc}", file=sys.stderr)
        return 2
    trtllm_key = None
    if args.internal_request_auth_key_file:
        try:
            # read_secret's file rules (trailing newline dropped, empty refused), never its fallbacks.
            trtllm_key = read_secret(None, args.internal_request_auth_key_file, environ={})
        except (OSError, ValueError) as exc:
            print(f"fastcore-serve worker: cannot read the internal request auth key: {exc}", file=sys.stderr)
            return 2
    try:
        cluster = cluster_settings(args, secret)
    except ValueError as exc:
        print(
            f"fastcore-serve worker: --cluster-uri/--cluster-name/--heartbeat-interval-sec/"
            f"--inactive-timeout-sec: {exc}",
            file=sys.stderr,
        )
        return 2
    why = port_problem(args.host, args.port)
    if why is not None:  # before loading a model, which may take minutes
        print(cannot_listen("worker", args.host, args.port, why), file=sys.stderr)
        return 2
    try:
        engine, model_name, device = build_engine(args)
    except DeviceError as exc:
        print(f"fastcore-serve worker: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # CheckpointError is a ValueError naming the file and field
        print(f"fastcore-serve worker: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    try:
        settings = WorkerSettings(
            model_name=model_name,
            shared_secret=secret,
            metrics_token=metrics_token,
            trtllm_auth_key=trtllm_key,
            kv_allow=tuple(args.kv_allow),
            device=device,
            **{field: getattr(args, dest) for dest, field in _SETTINGS.items()},
        )
    except ValueError as exc:
        print(f"fastcore-serve worker: {exc}", file=sys.stderr)
        return 2
    return run_event_loop(_serve(engine, settings, args.host, args.port, cluster, args.drain_timeout))


async def _serve(
    engine: Any,
    settings: WorkerSettings,
    host: str,
    port: int,
    cluster: Any = None,
    drain_timeout: float = DRAIN_TIMEOUT_S,
) -> int:
    from .app import WorkerApp

    stop = asyncio.Event()
    told: list[str] = []  # the signal that stopped it, for the stop line
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _told, stop, told, sig)
    app = WorkerApp(engine, settings)
    try:
        server, bound = await app.start(host, port)
    except OSError as exc:  # the port was taken after run()'s check
        why = listen_problem(exc)
        if why is None:
            raise
        print(cannot_listen("worker", host, port, why), file=sys.stderr)
        return 2
    log.info(
        "%s worker listening on http://%s:%d (model=%s device=%s; features: %s)",
        settings.role,
        host,
        bound,
        settings.model_name,
        settings.device,
        started_features(app, settings, cluster),
    )
    registration = None
    try:
        if cluster is not None:
            from server.cluster import RecordError, WorkerRecord, WorkerRegistration, new_worker_id

            url = advertised_url(settings, host, bound)
            if cluster.record_format == "trtllm":  # trtllm-serve reads exactly its four fields
                record = WorkerRecord(
                    worker_id=new_worker_id(settings.role, bound, "trtllm", urlsplit(url).hostname or host),
                    role=settings.role, model="", url=url, layout="trtllm",
                )  # fmt: skip
            else:
                record = WorkerRecord(
                    worker_id=new_worker_id(settings.role, bound),
                    role=settings.role,
                    model=settings.model_name,
                    url=url,
                    capabilities=app.info(),
                )
            try:  # what every orchestrator would refuse, said here once instead
                WorkerRecord.from_json(record.to_json())
                registration = WorkerRegistration(cluster, record)
            except RecordError as exc:
                print(
                    f"fastcore worker: cannot register: {exc} (--public-url, --host, --role)", file=sys.stderr
                )
                return 2
            await registration.start()
        await stop.wait()
        log.info(
            "%s: stopping, draining requests in flight and parked KV (up to %g s)", told[0], drain_timeout
        )
    finally:
        if registration is not None:  # first: no new traffic is sent here while the server stops
            await registration.stop()
        # Then refuse new requests (and fail /health: static orchestrators stop choosing it too),
        # finish what it has, let its parked KV be fetched; the server's close cancels what is left.
        if await app.drain(drain_timeout):
            log.info("drained")
        await server.cleanup()
        log.info("exited")
    return 0


def _told(stop: asyncio.Event, told: list[str], sig: signal.Signals) -> None:
    told.append(sig.name)
    stop.set()


def started_features(app: Any, settings: WorkerSettings, cluster: Any) -> str:
    """The start line's account of what is on: who may send it requests, where it registers."""
    return logs.features(
        shared_secret=settings.shared_secret is not None,
        trtllm_auth=settings.trtllm_auth_key is not None,
        metrics_token=settings.metrics_token is not None,
        kv_allow=",".join(settings.kv_allow) or None,
        tracing=app.tracing is not None,
        cluster=cluster.cluster_uri if cluster is not None else None,
    )


__all__ = ["add_arguments", "build_engine", "run"]
