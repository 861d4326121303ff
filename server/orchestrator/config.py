"""The orchestrator's one typed config object: docs/protocol.md's YAML plus CLI overrides.

Everything the request path needs is resolved here, once, at startup (the
shared secret from the environment included), so handlers never look at
``os.environ`` or argv.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.auth import read_secret
from server.cluster.records import (
    HEARTBEAT_INTERVAL_S,
    INACTIVE_TIMEOUT_S,
    LAYOUTS,
    ClusterSettings,
    RecordError,
)
from server.http import limits
from server.http.client import CONNECT_TIMEOUT_S
from server.metrics_access import METRICS_TOKEN_ENV
from server.tracing import TracingConfigError, check_endpoint, configured_endpoint

from .pools import BREAKER_FAILURES, BREAKER_OPEN_S, PANIC_THRESHOLD
from .protocols import refusal as protocol_refusal
from .routing import ROUTER_ARGS, ROUTERS, make_router
from .tenants import API_KEY_ENV, KeyFileError, read_key_file

log = logging.getLogger("fastcore.orchestrator")


#: the orchestrator's relay modes (server/orchestrator/relay_modes.py implements them)
RelayModeName = Literal["fast", "parsed", "parsed-msgpack"]
RELAY_MODES: tuple[str, ...] = get_args(RelayModeName)
#: the protocol the legs speak to the workers (server/orchestrator/protocols/ implements them)
WorkerProtocolName = Literal["trtllm", "vllm", "sglang", "auto"]
WORKER_PROTOCOLS: tuple[str, ...] = get_args(WorkerProtocolName)
#: vLLM's KV connector (worker_protocol: vllm): NIXL (sequential, the decode pulls) or Mooncake (concurrent)
VllmTransfer = Literal["nixl", "mooncake"]
VLLM_TRANSFERS: tuple[str, ...] = get_args(VllmTransfer)
#: what a request does when no context worker can take it (docs/configuration.md, Faults)
ContextFallback = Literal["local_prefill", "fail"]
CONTEXT_FALLBACKS: tuple[str, ...] = get_args(ContextFallback)


class ConfigError(ValueError):
    """A config file or flag the orchestrator cannot start with; says which key."""


#: trtllm-serve's router names -> ours (``load_balancing``: fewest requests in flight)
ROUTER_ALIASES = {"load_balancing": "least_loaded"}
#: the router types a pool runs (``router.type``, the CLI's --context-router/--generation-router):
#: the routers built (routing.ROUTERS, their one list) and trtllm-serve's names for them
ROUTER_TYPES: tuple[str, ...] = (*ROUTERS, *ROUTER_ALIASES)
#: trtllm-serve's router types that parse, so that check_runnable can say what they lack, but are not built
ROUTERS_NOT_BUILT: tuple[str, ...] = ("centralized_kv_cache_aware",)


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # one of ROUTER_TYPES, or of ROUTERS_NOT_BUILT (check_runnable refuses those, saying what they lack)
    type: str = "round_robin"
    # trtllm-serve's router arguments (load_balancing: use_tokens). trtllm-serve writes them
    # beside ``type`` (its extract_router_config); ``args:`` holds them too.
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, kind: str) -> str:
        if kind not in ROUTER_TYPES and kind not in ROUTERS_NOT_BUILT:
            raise ValueError(f"must be one of {', '.join((*ROUTER_TYPES, *ROUTERS_NOT_BUILT))}, got {kind!r}")
        return kind

    @model_validator(mode="before")
    @classmethod
    def _arguments_beside_type(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        beside = {k: v for k, v in data.items() if k not in ("type", "args")}
        if not beside:
            return data
        args = data.get("args")
        if args is not None and not isinstance(args, dict):
            return data  # the field's own validation words it
        both = sorted(set(beside) & set(args or {}))
        if both:
            raise ValueError(f"router argument {both[0]!r} given twice: beside 'type' and under 'args'")
        return {"type": data.get("type", "round_robin"), "args": {**(args or {}), **beside}}

    @property
    def kind(self) -> str:
        """The router this pool runs (trtllm-serve's aliases resolved)."""
        return ROUTER_ALIASES.get(self.type, self.type)


class PoolConfig(BaseModel):
    # trtllm-serve passes a server group's other keys to the workers it launches.
    model_config = ConfigDict(extra="allow")

    router: RouterConfig = Field(default_factory=RouterConfig)
    urls: list[str] = Field(default_factory=list)
    # trtllm-serve's count of workers to launch; here informational, as the urls are given.
    # default=: a positional default is no default to a type checker (PEP 681 reads the keyword)
    num_instances: int | None = Field(default=None, ge=0)

    @field_validator("urls")
    @classmethod
    def _normalise_urls(cls, urls: list[str]) -> list[str]:
        # docs/protocol.md writes workers as "host:port"; aiohttp needs a scheme.
        out = []
        for url in urls:
            url = url.strip().rstrip("/")
            if not url:
                raise ValueError("empty worker URL")
            out.append(url if "://" in url else "http://" + url)
        return out

    @model_validator(mode="after")
    def _block_size_from_the_workers(self) -> PoolConfig:
        # trtllm-serve's extract_router_config: a prefix router hashes in the workers' block size
        # (kv_cache_config.tokens_per_block) unless its own arguments name one
        cache = (self.model_extra or {}).get("kv_cache_config")
        args = self.router.args
        if (
            "tokens_per_block" in ROUTER_ARGS.get(self.router.kind, ())
            and isinstance(cache, dict)
            and "tokens_per_block" in cache
            and not {"tokens_per_block", "chunk_bytes"} & set(args)
        ):
            args["tokens_per_block"] = cache["tokens_per_block"]
        return self


class ConditionalDisaggConfig(BaseModel):
    """trtllm-serve's conditional disaggregation: short remainders prefilled on the generation worker."""

    model_config = ConfigDict(extra="allow")

    max_local_prefill_length: int = Field(0, ge=0)
    # trtllm-serve's rule: a request with no expected prefix hit always takes the context leg (ours,
    # false: a short new prompt is prefilled on the generation worker too)
    require_prefix_hit: bool = False


class DisaggClusterConfig(BaseModel):
    """trtllm-serve's worker discovery through a store (etcd) instead of urls (server/cluster)."""

    model_config = ConfigDict(extra="allow")

    # etcd://HOST:PORT[,HOST:PORT...], or http://HOST:PORT: the orchestrator there keeps the registry
    cluster_uri: str
    # namespace: the key prefix of this cluster's workers
    cluster_name: str = ""
    heartbeat_interval_sec: float = Field(HEARTBEAT_INTERVAL_S, gt=0)
    # a worker not heard from for this long is gone (its etcd lease's TTL)
    inactive_timeout_sec: float = Field(INACTIVE_TIMEOUT_S, gt=0)
    # /health is 503 until this many healthy workers per pool: {context_servers: 1, generation_servers: 1}
    minimal_instances: dict[str, int] = Field(default_factory=dict)
    # http:// registry without a shared secret: take unsigned registrations from loopback peers
    # (any local process may then register a worker and receive prompts); off: refused (403)
    allow_unsigned_loopback_registration: bool = False
    # the key prefixes read: ours (/fastcore/<name>/workers/) and trtllm-serve's
    # (/trtllm-disagg/<name>/workers/); records of either layout are read under either
    key_prefixes: list[Literal["fastcore", "trtllm"]] = Field(
        default_factory=lambda: list(LAYOUTS), min_length=1
    )
    # trtllm-serve's HTTP cluster storage bearer key (Authorization: Bearer); default: the shared secret
    api_key: str | None = Field(None, repr=False)

    @field_validator("cluster_uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in ("etcd", "http") or not rest.strip("/"):
            raise ValueError(f"must be etcd://HOST:PORT or http://HOST:PORT, got {uri!r}")
        return uri.rstrip("/")

    @field_validator("minimal_instances")
    @classmethod
    def _pool_counts(cls, counts: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(counts) - {"context_servers", "generation_servers"})
        if unknown:
            raise ValueError(f"keys are context_servers and generation_servers, not {', '.join(unknown)}")
        if any(type(n) is not int or n < 0 for n in counts.values()):
            raise ValueError("counts must be integers >= 0")
        return counts

    @model_validator(mode="after")
    def _heartbeat_below_timeout(self) -> DisaggClusterConfig:
        if self.heartbeat_interval_sec >= self.inactive_timeout_sec:
            raise ValueError(
                f"heartbeat_interval_sec ({self.heartbeat_interval_sec:g}) must be below inactive_timeout_sec "
                f"({self.inactive_timeout_sec:g}): a worker would expire between two heartbeats"
            )
        return self

    def minimal(self, pool: str) -> int:
        """The healthy workers ``pool`` ("context" or "generation") needs before /health is 200."""
        return self.minimal_instances.get(f"{pool}_servers", 1)


class FleetClusterConfig(BaseModel):
    """Orchestrators on several hosts sharing one etcd (server/orchestrator/fleet_cluster.py): each
    registers under a lease; rates and max_inflight are divided by the live count; breakers published."""

    model_config = ConfigDict(extra="forbid")

    # etcd://HOST:PORT[,HOST:PORT...]: where the orchestrators register
    cluster_uri: str
    # namespace: the key prefix of this fleet's orchestrators and breakers
    cluster_name: str = ""
    # seconds an orchestrator that stopped renewing still counts: shares re-divided within it
    lease_ttl_s: int = Field(10, ge=2)

    @model_validator(mode="after")
    def _etcd_and_name(self) -> FleetClusterConfig:
        if not self.cluster_uri.startswith("etcd://"):
            raise ValueError(f"cluster_uri must be etcd://HOST:PORT[,HOST:PORT...], got {self.cluster_uri!r}")
        try:
            ClusterSettings(self.cluster_uri, self.cluster_name, self.lease_ttl_s / 3, self.lease_ttl_s)
        except RecordError as exc:
            raise ValueError(str(exc)) from None
        return self


class OtlpConfig(BaseModel):
    """trtllm-serve's ``otlp_config``: where traces go (OTLP/HTTP; the ``OTEL_*`` variables set the rest)."""

    model_config = ConfigDict(extra="forbid")
    otlp_traces_endpoint: str | None = None
    # ours: false ignores a client's traceparent/tracestate (each request a new trace, sampled here)
    client_trace_context: bool = True


class RateLimitConfig(BaseModel):
    """One tenant's rate limits (server/orchestrator/admission.py): 429 beyond either."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: float | None = Field(None, gt=0)
    # estimated as the prompt's bytes over the learned bytes per token, then the workers' usage
    prompt_tokens_per_minute: float | None = Field(None, gt=0)


class AdmissionConfig(BaseModel):
    """Who goes first (server/orchestrator/admission.py): slots, the queue, fair share, 429s."""

    model_config = ConfigDict(extra="forbid")

    # completions of one orchestrator process in the workers at once (both legs: one slot)
    max_inflight: int = Field(default=256, ge=1)
    # completions waiting for a slot; one more gets 429 (0: no queue)
    max_queue: int = Field(default=1024, ge=0)
    # a completion not started within this gets 429
    max_queue_wait_s: float = Field(default=30.0, gt=0)
    # the body's priority: false (every request 0), true (any) or [min, max] (clamped into it);
    # a key's priority=MIN..MAX in api_keys_file narrows it for that key
    client_priority: bool | tuple[int, int] = False
    # tenant name (or "*": every tenant not named) -> its limits
    rate_limits: dict[str, RateLimitConfig] = Field(default_factory=dict)

    @field_validator("client_priority")
    @classmethod
    def _priority_range(cls, value: bool | tuple[int, int]) -> bool | tuple[int, int]:
        if isinstance(value, tuple) and not -(1 << 63) <= value[0] <= value[1] < 1 << 63:
            raise ValueError("a [min, max] range of signed 64-bit integers, min <= max")
        return value


class ResponsesStoreConfig(BaseModel):
    """Stored responses of POST /v1/responses (server/orchestrator/apis/responses_store.py), per tenant."""

    model_config = ConfigDict(extra="forbid")

    max_entries: int = Field(1024, ge=1)
    max_bytes: int = Field(64 << 20, ge=1)
    ttl_s: float = Field(3600.0, gt=0)


class OrchestratorConfig(BaseModel):
    # trtllm-serve's disaggregated YAML loads unchanged: keys not used here
    # (it hands them to the workers it launches) are warned about, not refused.
    model_config = ConfigDict(extra="allow")

    hostname: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # the model this deployment serves; discovered workers of another model are refused (with a
    # log line). None: the first discovered worker's model.
    model: str | None = None
    gen_tokids_ctxbytes: bool = False
    gen_strip_message_history: bool = False
    # "parsed" is the baseline a typical pydantic orchestrator implements
    # (json.loads -> models -> model_dump_json), kept so one deployment can
    # compare both; "parsed-msgpack" the same with msgpack leg bodies, as newer
    # trtllm-serve orchestrators send them; "fast" never parses bodies in Python.
    relay: RelayModeName = "fast"
    # What the legs speak: trtllm-serve's disaggregated protocol, vLLM's (NixlConnector:
    # kv_transfer_params from the prefill's answer spliced into the decode leg), or SGLang's
    # (bootstrap: both legs at once, pair.py); protocols/; auto: read from the workers at startup
    # (protocols/detect.py)
    worker_protocol: WorkerProtocolName = "trtllm"
    # worker_protocol: vllm's connector: nixl (prefill, then decode with the prefill's kv_transfer_params)
    # or mooncake (both legs at once on a router-minted transfer_id, pair.py), whose prefills serve
    # their bootstrap server on this port (vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT, 8998 by default)
    vllm_transfer: VllmTransfer = "nixl"
    vllm_mooncake_bootstrap_port: int = Field(8998, gt=0, lt=65536)
    max_retries: int = Field(1, ge=0)
    request_timeout_s: float = Field(180.0, gt=0)
    # Faults (docs/protocol.md#faults): the context leg's own deadline (never above
    # request_timeout_s), plus an allowance per 1,000 estimated prompt tokens (body bytes / 4).
    context_timeout_s: float = Field(30.0, gt=0)
    context_timeout_per_1k_tokens_s: float = Field(0.25, ge=0)
    # A stream's generation leg: the deadline of the worker's first byte (its headers: KV fetch,
    # queueing, a recomputed or local prefill), plus the same allowance; past it, another worker.
    generation_first_byte_timeout_s: float = Field(60.0, gt=0)
    # No context worker can take the request: a local_prefill generation worker serves it whole.
    context_fallback: ContextFallback = "local_prefill"
    # Per-worker circuit breakers: failed legs in a row that open one (a timed-out leg: at once),
    # and the seconds it stays open before a probe leg.
    circuit_breaker_failures: int = Field(BREAKER_FAILURES, ge=1)
    circuit_breaker_open_s: float = Field(BREAKER_OPEN_S, gt=0)
    # Below this share of a pool's healthy workers with a breaker that lets legs through, legs go to
    # every healthy worker (envoy's panic threshold; pools.py); 0: never
    circuit_breaker_panic_threshold: float = Field(PANIC_THRESHOLD, ge=0, le=1)
    # SIGTERM: requests in flight may finish for this long, then they are cancelled.
    drain_timeout_s: float = Field(30.0, ge=0)
    connect_timeout_s: float = Field(CONNECT_TIMEOUT_S, gt=0)
    health_check_interval_s: float = Field(2.0, gt=0)
    health_check_timeout_s: float = Field(2.0, gt=0)
    # What one client connection may hold (server/http/limits.py, Limits: the defaults' one home).
    max_body_bytes: int = Field(limits.MAX_BODY_BYTES, gt=0)
    # A worker's answer held whole (context, unary generation; a stream is relayed as it comes): past
    # it the leg fails at once (a 502, the worker's breaker counts it), not at the deadline.
    max_worker_body_bytes: int = Field(limits.MAX_WORKER_ANSWER_BYTES, ge=64 * 1024)
    max_header_bytes: int = Field(limits.MAX_HEADER_BYTES, ge=1024)
    client_header_timeout_s: float = Field(limits.HEADER_TIMEOUT_S, gt=0)
    client_body_timeout_s: float = Field(limits.BODY_TIMEOUT_S, gt=0)
    client_keepalive_timeout_s: float = Field(limits.KEEPALIVE_TIMEOUT_S, gt=0)
    max_client_connections: int = Field(limits.MAX_CONNECTIONS, ge=1)
    # Client request body bytes this process holds at once (503 + Retry-After beyond).
    max_inflight_body_bytes: int = Field(limits.MAX_INFLIGHT_BODY_BYTES, gt=0)
    # One client IP past this share of max_client_connections (or max_inflight_body_bytes) may not
    # take their last share (server/http Limits.peer_share); 1.0 behind a proxy that is every client.
    client_ip_share: float = Field(limits.PEER_SHARE, gt=0, le=1)
    retry_after_s: int = Field(limits.RETRY_AFTER_S, ge=1)
    shared_secret: str | None = Field(None, repr=False)  # never in logs
    # A file holding the secret (not in argv, not in the config file itself).
    shared_secret_file: str | None = None
    # trtllm-serve's key for x-trtllm-disagg-auth on generation legs; default: the shared secret.
    internal_request_auth_key: str | None = Field(None, repr=False)
    # GET /metrics (server/metrics_access.py): with a token, only to Authorization: Bearer <token>;
    # without, only to loopback peers. The file (or $FASTCORE_METRICS_TOKEN) rather than the value.
    metrics_token: str | None = Field(None, repr=False)
    metrics_token_file: str | None = None
    # Client API keys (server/orchestrator/tenants.py): lines "<key> <tenant> [weight]"; with them
    # (or api_key / $FASTCORE_API_KEY: one key, tenant "default") every /v1/* request needs
    # Authorization: Bearer <key>. Re-read on SIGHUP.
    api_keys_file: str | None = None
    api_key: str | None = Field(None, repr=False)  # never in logs
    # /metrics to the metrics token or any client API key only (loopback alone no longer enough)
    metrics_requires_key: bool = False
    # With client keys each tenant's prompts are cached apart (server/orchestrator/tenant_salt.py);
    # true: one prefix cache for all, each request's cache_salt as its client sent it
    share_prefix_cache_across_tenants: bool = False
    # The admission queue: max_inflight, max_queue, max_queue_wait_s, rate_limits (None: none)
    admission: AdmissionConfig | None = None
    workers: int = Field(1, ge=1)
    context_servers: PoolConfig = Field(default_factory=PoolConfig)
    generation_servers: PoolConfig = Field(default_factory=PoolConfig)
    conditional_disagg_config: ConditionalDisaggConfig | None = None
    disagg_cluster: DisaggClusterConfig | None = None
    # several hosts' orchestrators sharing rates, max_inflight and breakers through etcd (None: off)
    fleet_cluster: FleetClusterConfig | None = None
    # trtllm-serve's: which leg goes first; generation_first is refused (check_runnable says why)
    schedule_style: Literal["context_first", "generation_first"] = "context_first"
    # /v1/responses' store (store, previous_response_id, GET/DELETE by id); None: off, those refused
    responses_store: ResponsesStoreConfig | None = None
    # trtllm-serve's OpenTelemetry tracing ({otlp_traces_endpoint: URL}): server/tracing.py, docs/tracing.md
    otlp_config: OtlpConfig | None = None
    # trtllm-serve's per-request entries of GET /perf_metrics (0: none kept, its default); above 0 refused
    perf_metrics_max_requests: int = Field(0, ge=0)

    def unused_keys(self) -> list[str]:
        """Keys of the file this orchestrator does not use (dotted, in file order)."""
        keys = list(self.model_extra or ())
        for name in ("context_servers", "generation_servers"):
            keys += [f"{name}.{k}" for k in getattr(self, name).model_extra or ()]
        return keys

    @property
    def shared_secret_bytes(self) -> bytes | None:
        return self.shared_secret.encode("utf-8", "surrogateescape") if self.shared_secret else None

    @property
    def metrics_token_bytes(self) -> bytes | None:
        return self.metrics_token.encode("utf-8", "surrogateescape") if self.metrics_token else None

    @property
    def api_key_bytes(self) -> bytes | None:
        return self.api_key.encode("utf-8", "surrogateescape") if self.api_key else None

    @property
    def otlp_traces_endpoint(self) -> str | None:
        return self.otlp_config.otlp_traces_endpoint if self.otlp_config is not None else None

    @property
    def trtllm_auth_key(self) -> bytes | None:
        """The key of trtllm-serve's ``x-trtllm-disagg-auth``: its own config key, else the shared secret."""
        if self.internal_request_auth_key:
            return self.internal_request_auth_key.encode()
        return self.shared_secret_bytes

    def _check_trtllm_keys(self) -> None:
        """trtllm-serve keys that would change what happens but are not built here: refused, naming
        what is missing (a file that relies on them must not start and quietly do otherwise)."""
        if self.schedule_style == "generation_first":
            raise ConfigError(
                "schedule_style: generation_first (the generation leg sent before the context leg, its KV "
                "pulled by the generation worker as the context worker produces it) is not built: the "
                "generation leg starts from the context leg's answer here; use context_first"
            )
        endpoint = configured_endpoint(self.otlp_traces_endpoint)
        if endpoint is not None:
            try:  # tracing asked for (the key or OTEL_*): the SDK must be there, the URL OTLP/HTTP
                check_endpoint(endpoint)
            except TracingConfigError as exc:
                raise ConfigError(f"otlp_config.otlp_traces_endpoint: {exc}") from None
        if self.perf_metrics_max_requests:
            raise ConfigError(
                f"perf_metrics_max_requests ({self.perf_metrics_max_requests}): per-request entries of "
                "GET /perf_metrics (joined with the workers' own) are not collected here, so it answers [] as "
                "trtllm-serve does with 0; per-phase latencies: /metrics; set 0"
            )
        for name in ("context_servers", "generation_servers"):
            if getattr(self, name).router.type in ROUTERS_NOT_BUILT:
                raise ConfigError(
                    f"{name}.router.type: centralized_kv_cache_aware needs the workers' KV events pushed to "
                    "the router over ZMQ (router_port), not built here; kv_cache_aware routes by the "
                    "prefixes it sent each worker and takes tokens_per_block too"
                )

    def check_runnable(self) -> None:
        """Refuse to start without a worker in each pool (none needed with discovery), or on a
        section not built yet."""
        cluster = self.disagg_cluster
        self._check_trtllm_keys()
        refused = protocol_refusal(self)
        if refused is not None:
            raise ConfigError(f"worker_protocol: {self.worker_protocol}: {refused}")
        if cluster is not None and cluster.cluster_uri.startswith("http://") and self.workers > 1:
            raise ConfigError(
                "disagg_cluster.cluster_uri: an http:// registry is kept by one orchestrator process; "
                "with workers > 1 use etcd:// (or workers: 1)"
            )
        if (
            self.conditional_disagg_config is not None
            and self.generation_servers.router.kind != "kv_cache_aware"
        ):
            raise ConfigError(
                "conditional_disagg_config: prefilling short remainders on the generation worker needs "
                "generation_servers.router.type: kv_cache_aware (it estimates the uncached remainder); "
                f"got {self.generation_servers.router.type!r}"
            )
        for name in ("context_servers", "generation_servers"):
            pool: PoolConfig = getattr(self, name)
            if not pool.urls and cluster is None:
                launch = f" (num_instances: {pool.num_instances}: launching workers is trtllm-serve's job)"
                raise ConfigError(
                    f"{name}.urls: at least one worker URL is required"
                    + (launch if pool.num_instances else "")
                )
            router = pool.router
            known = ROUTER_ARGS[router.kind]
            unknown = sorted(set(router.args) - known)
            if unknown:
                # Named under "router", where trtllm-serve writes them (beside "type") or "args:" does.
                which = f"; it takes {', '.join(sorted(known))}" if known else ", which takes none"
                raise ConfigError(
                    f"{name}.router: {', '.join(_suggest(k, known) for k in unknown)}: "
                    f"not {'an argument' if len(unknown) == 1 else 'arguments'} of {router.type}{which}"
                )
            try:
                make_router(router.kind, router.args)
            except ValueError as exc:
                raise ConfigError(f"{name}.router.args.{exc}") from None


def _suggest(key: str, known: Any, prefix: str = "") -> str:
    """``key``, with the known key it most resembles (a misspelling's likely intent)."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"{prefix}{key} (did you mean {prefix}{close[0]}?)" if close else prefix + key


def unused_key_words(config: OrchestratorConfig) -> str:
    """The keys of the file the orchestrator does not use, each with its likely intent if any."""
    words = []
    for key in config.unused_keys():
        section, _, name = key.rpartition(".")
        fields = (PoolConfig if section else OrchestratorConfig).model_fields
        words.append(_suggest(name, fields, section + "." if section else ""))
    return ", ".join(words)


def config_default(key: str) -> Any:
    """The default of a top-level key: the CLIs' help texts and the launcher read it here."""
    return OrchestratorConfig.model_fields[key].default


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def build_config(
    data: dict[str, Any], *, environ: dict[str, str] | None = None, strict: bool = False
) -> OrchestratorConfig:
    """Validate a config mapping; the shared secret falls back to ``FASTCORE_SHARED_SECRET``.
    ``strict`` (--strict-config): a key not used is refused, not warned about."""
    environ = dict(os.environ) if environ is None else environ
    try:
        config = OrchestratorConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    if config.shared_secret_file is not None or config.shared_secret is None:
        try:
            secret = read_secret(config.shared_secret, config.shared_secret_file, environ)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"shared_secret_file: {exc}") from None
        if secret is not None:
            config = config.model_copy(update={"shared_secret": secret.decode("utf-8", "surrogateescape")})
    if config.metrics_token_file is not None or config.metrics_token is None:
        try:
            token = read_secret(
                config.metrics_token,
                config.metrics_token_file,
                environ,
                env_name=METRICS_TOKEN_ENV,
                what="metrics token",
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"metrics_token_file: {exc}") from None
        if token is not None:
            config = config.model_copy(update={"metrics_token": token.decode("utf-8", "surrogateescape")})
    if config.api_keys_file is None and config.api_key is None:
        key = environ.get(API_KEY_ENV)
        if key:
            config = config.model_copy(update={"api_key": key})
    if config.api_keys_file is not None:
        try:
            read_key_file(config.api_keys_file)  # refused at startup, naming the line; re-read per process
        except KeyFileError as exc:
            raise ConfigError(f"api_keys_file: {exc}") from None
    if config.metrics_requires_key and config.api_keys_file is None and not config.api_key:
        raise ConfigError(f"metrics_requires_key: needs api_keys_file or a key (api_key, ${API_KEY_ENV})")
    # Warnings here, once per start: check_runnable runs again in each orchestrator process.
    unused = unused_key_words(config)
    if unused and strict:
        raise ConfigError(f"--strict-config: keys not used by the fastcore orchestrator: {unused}")
    if unused:
        log.warning("config keys not used by the fastcore orchestrator (ignored): %s", unused)
    for name in ("context_servers", "generation_servers"):
        pool: PoolConfig = getattr(config, name)
        if pool.num_instances is not None and pool.urls and pool.num_instances != len(pool.urls):
            log.warning(
                "%s.num_instances is %d but %d urls are listed: the urls are used (num_instances "
                "tells trtllm-serve how many workers to launch; the fastcore orchestrator launches none)",
                name,
                pool.num_instances,
                len(pool.urls),
            )
    return config


def load_config_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping, not {type(data).__name__}")
    return data


def merge_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each non-None override applied; dotted keys reach into the pools."""
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in overrides.items():
        if value is None:
            continue
        target = merged
        *parents, leaf = key.split(".")
        for parent in parents:
            child = target.get(parent)
            target[parent] = child = dict(child) if isinstance(child, dict) else {}
            target = child
        target[leaf] = value
    return merged
