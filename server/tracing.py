"""OpenTelemetry tracing shared by the orchestrator and the workers (docs/tracing.md).

Off unless an OTLP endpoint is configured (trtllm-serve's ``otlp_config.otlp_traces_endpoint``, a
worker's ``--otlp-traces-endpoint``, or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT``); when off, nothing here imports the SDK and the servers' hooks
are one ``None`` test per request (``current_trace()`` is a ContextVar read that returns ``None``).

When on, the real SDK (``fastcore-serve[otel]``: ``opentelemetry-sdk`` and the OTLP/HTTP protobuf
exporter) is configured by the standard ``OTEL_*`` variables: service name
(``OTEL_SERVICE_NAME``), resource attributes (``OTEL_RESOURCE_ATTRIBUTES``), sampler
(``OTEL_TRACES_SAMPLER`` / ``_ARG``; default ``parentbased_always_on``), batching
(``OTEL_BSP_*``), exporter headers and timeouts (``OTEL_EXPORTER_OTLP_*``).

Sampling is decided once per request, where its root span starts (the orchestrator, or a client's
``traceparent``): a request that is not sampled gets no :class:`RequestTrace` at all, so no span,
no header and no further work; one that is carries W3C ``traceparent`` (and the client's
``tracestate``) on each leg and the KV fetch, and a parent-based sampler at the workers follows it.

Per request, the active :class:`RequestTrace` lives in a ContextVar (each request is one asyncio
task): the hooks in the request paths read it instead of passing it through every signature.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

from fastcore import protocol as wire

log = logging.getLogger("fastcore.tracing")

#: what ``pip install`` brings the SDK with
INSTALL_HINT = "pip install 'fastcore-serve[otel]'"
#: the OTLP/HTTP path the exporter posts to; appended to an endpoint given without a path
TRACES_PATH = "/v1/traces"
TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"

_CURRENT: ContextVar[Any] = ContextVar("fastcore_request_trace", default=None)
#: the request's trace in this task, or None (tracing off, or the request not sampled)
current_trace = _CURRENT.get


def _preset_ids() -> Any:
    """The SDK's random ids, but the next trace id may be one already drawn (and sampled) by
    :meth:`Tracing.start_request`; the event loop is the only caller, one span at a time."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PresetIds(RandomIdGenerator):
        preset = 0

        def generate_trace_id(self) -> int:
            trace_id, self.preset = self.preset, 0
            return trace_id or super().generate_trace_id()

    return PresetIds()


class TracingConfigError(ValueError):
    """Tracing asked for but not possible: the SDK is missing, or a setting it cannot honour."""


def configured_endpoint(endpoint: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP traces URL to export to, or None when tracing is off.

    ``endpoint`` (config or flag) wins over the environment; ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none`` turn it off whatever is set, as the SDK's own rules do. A URL
    without a path gets ``/v1/traces`` (trtllm-serve's examples give the collector's base URL;
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL by the spec)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    url = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not url:
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not base:
            return None
        return base.rstrip("/") + TRACES_PATH
    url = url.strip()
    if "://" not in url:
        url = "http://" + url  # trtllm-serve (grpc's habit) accepts host:port
    if "/" not in url.partition("://")[2]:
        url = url.rstrip("/") + TRACES_PATH
    return url


def check_endpoint(endpoint: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`TracingConfigError` when traces could not be sent: the SDK is not installed,
    the URL is not http(s), or ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` asks for grpc."""
    env = os.environ if environ is None else environ
    if not endpoint.startswith(("http://", "https://")):
        raise TracingConfigError(
            f"OTLP traces endpoint {endpoint[:100]!r}: an http:// or https:// URL (OTLP/HTTP)"
        )
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    if protocol.strip() not in ("", "http/protobuf"):
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol.strip()[:40]}: only http/protobuf is built "
            "(point the endpoint at the collector's OTLP/HTTP port, 4318 by default)"
        )
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package missing
            found = False
        if not found:
            raise TracingConfigError(
                f"OpenTelemetry tracing to {endpoint[:100]} needs the SDK ({INSTALL_HINT}): no {module}"
            )


def start_tracing(
    service_name: str, endpoint: str | None, environ: Mapping[str, str] | None = None
) -> Tracing | None:
    """A :class:`Tracing` exporting to the configured endpoint, or None when tracing is off."""
    url = configured_endpoint(endpoint, environ)
    if url is None:
        return None
    check_endpoint(url, environ)
    return Tracing(service_name, url, environ)


class Tracing:
    """One process's tracer: the SDK's TracerProvider, a BatchSpanProcessor and the OTLP/HTTP
    exporter. :meth:`shutdown` flushes what is batched (called when the server stops)."""

    def __init__(self, service_name: str, endpoint: str, environ: Mapping[str, str] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        env = os.environ if environ is None else environ
        attributes: dict[str, Any] = {}
        # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES' service.name win over our default name
        # (Resource.create lets the given attributes win over the environment's).
        if not env.get("OTEL_SERVICE_NAME") and "service.name=" not in env.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attributes[SERVICE_NAME] = service_name
        self.endpoint = endpoint
        self.ids = _preset_ids()
        self.provider = TracerProvider(resource=Resource.create(attributes), id_generator=self.ids)
        #: the sampler the SDK chose from OTEL_TRACES_SAMPLER (parentbased_always_on by default)
        self.sampler = self.provider.sampler
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("fastcore")
        self.propagator = TraceContextTextMapPropagator()
        self.set_span_in_context = set_span_in_context
        self.SERVER, self.CLIENT, self.INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
        self.Status, self.ERROR = Status, StatusCode.ERROR
        self._stopped = False

    def start_request(
        self,
        name: str,
        traceparent: bytes | None,
        tracestate: bytes | None,
        attributes: Mapping[str, Any],
        propagate_unsampled: bool = False,
    ) -> RequestTrace | Unsampled | None:
        """Start a request's root span (the child of ``traceparent`` when there is a valid one) and
        make it this task's :func:`current_trace`; when the sampler drops it, None (no work
        follows), or with ``propagate_unsampled`` an :class:`Unsampled` whose only work is the
        legs' ``traceparent`` with the sampled flag off: the workers' parent-based samplers then
        drop the legs too, instead of starting traces of their own."""
        parent = None
        if traceparent is None:
            # A new trace: its id drawn and the sampler asked here, so that a dropped request
            # costs no span object at all; a sampled one's span takes that id (the sampler,
            # asked again by the SDK, decides the same on the same id).
            trace_id = self.ids.generate_trace_id()
            if not self.sampler.should_sample(
                None, trace_id, name, self.SERVER, attributes
            ).decision.is_sampled():
                if not propagate_unsampled:
                    return None
                header = b"traceparent: 00-%032x-%016x-00\r\n" % (
                    trace_id,
                    self.ids.generate_span_id(),
                )
                unsampled = Unsampled(header)
                _CURRENT.set(unsampled)
                return unsampled
            self.ids.preset = trace_id
        else:
            carrier = {"traceparent": traceparent.decode("latin-1")}
            if tracestate is not None:
                carrier["tracestate"] = tracestate.decode("latin-1")
            parent = self.propagator.extract(carrier)  # an invalid header: no parent, a new trace
        span = self.tracer.start_span(name, context=parent, kind=self.SERVER, attributes=attributes)
        if not span.is_recording():
            if not propagate_unsampled:
                return None
            unsampled = Unsampled(traceparent_line(span))
            _CURRENT.set(unsampled)
            return unsampled
        trace = RequestTrace(self, span)
        _CURRENT.set(trace)
        return trace

    def shutdown(self) -> None:
        """Export what is batched and stop the exporter's thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.provider.shutdown()
        except Exception as exc:  # a collector gone at shutdown must not fail the stop
            log.warning("flushing traces to %s failed: %s", self.endpoint, exc)


def traceparent_line(span: Any) -> bytes:
    """``span``'s W3C trace context as HTTP header lines (``traceparent``, and ``tracestate`` when the
    trace carries one), for a request written as raw header bytes."""
    sc = span.get_span_context()
    line = b"traceparent: 00-%032x-%016x-%02x\r\n" % (sc.trace_id, sc.span_id, sc.trace_flags)
    if sc.trace_state:
        line += b"tracestate: " + sc.trace_state.to_header().encode("latin-1") + b"\r\n"
    return line


def traceparent_headers(span: Any) -> dict[str, str]:
    """The same as a header mapping (aiohttp)."""
    lines = traceparent_line(span).decode("latin-1").split("\r\n")
    return dict(line.split(": ", 1) for line in lines if line)


class Unsampled:
    """An orchestrator's request the sampler dropped: every hook is a no-op but the legs' header,
    which carries the decision (``-00``) to the workers. It stands for both the request's
    :class:`RequestTrace` and its :class:`LegSpan` (``start_leg`` returns itself)."""

    __slots__ = ("header",)
    leg = None
    sampled = False

    def __init__(self, header: bytes) -> None:
        self.header = header

    @staticmethod
    def now() -> int:
        return 0

    def start_leg(self, *args: Any) -> Unsampled:
        return self

    def watch_stream(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        return write

    def set(self, key: str, value: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def answered(self, *args: Any) -> None:
        pass

    def fail(self, *args: Any) -> None:
        pass

    def leg_failed(self, *args: Any) -> None:
        pass

    def end(self, *args: Any, **kwargs: Any) -> None:
        pass


class RequestTrace:
    """One request's spans in this process: the root, and children started under it."""

    __slots__ = ("ctx", "leg", "mark", "root", "tracing")
    sampled = True

    def __init__(self, tracing: Tracing, root: Any) -> None:
        self.tracing = tracing
        self.root = root
        self.ctx = tracing.set_span_in_context(root)
        #: the leg span in flight (the generation leg's stream marks its first token on it)
        self.leg: LegSpan | None = None
        #: a worker: when the request was handed to the engine (its prefill span starts there)
        self.mark = 0

    @staticmethod
    def now() -> int:
        return time.time_ns()

    def span(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        start_time: int | None = None,
        kind: Any = None,
    ) -> Any:
        """A child span of the root (ended by the caller)."""
        return self.tracing.tracer.start_span(
            name, context=self.ctx, kind=kind or self.tracing.INTERNAL, attributes=attributes,
            start_time=start_time,
        )  # fmt: skip

    def record(
        self,
        name: str,
        start_time: int,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """A child span that started at ``start_time`` and ends now."""
        span = self.span(name, attributes, start_time)
        if error is not None:
            span.set_status(self.tracing.Status(self.tracing.ERROR, error))
        span.end()

    def set(self, key: str, value: Any) -> None:
        self.root.set_attribute(key, value)

    def start_leg(self, leg: str, pool: Any, worker: Any, key: Any, routed_at: int, attempt: int) -> LegSpan:
        """The routing decision (a span from ``routed_at``: router, chosen worker, predicted hit
        tokens) and the leg's CLIENT span, whose ``traceparent`` the leg's headers carry."""
        router = pool.router
        attributes: dict[str, Any] = {
            "fastcore.pool": pool.name,
            "fastcore.router": getattr(router, "name", type(router).__name__),
            "fastcore.worker": worker.url,
            "fastcore.attempt": attempt,
        }
        hit_chunks = getattr(key, "hit_chunks", 0) if key is not None else 0
        chunk_bytes = getattr(router, "chunk_bytes", 0)
        estimate = getattr(router, "estimate", None)
        if hit_chunks and chunk_bytes and estimate is not None:
            attributes["fastcore.predicted_hit_tokens"] = int(estimate.tokens(hit_chunks * chunk_bytes))
        self.record("fastcore.route", routed_at, attributes)
        span = self.span(
            f"fastcore.{leg}_leg",
            {"fastcore.worker": worker.url, "fastcore.attempt": attempt},
            kind=self.tracing.CLIENT,
        )
        self.leg = LegSpan(self, span)
        return self.leg

    def watch_stream(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """``write`` that marks the stream's first bytes (the first token) on the leg in flight."""
        leg = self.leg
        if leg is None:
            return write
        sink: Callable[[bytes], None] = write

        def first_write(data: bytes) -> None:
            nonlocal sink
            leg.span.add_event("first_token")
            sink = write
            write(data)

        sink = first_write
        return lambda data: sink(data)

    def leg_failed(self, why: str) -> None:
        """The leg in flight failed after its headers (a stream cut mid-way)."""
        if self.leg is not None:
            self.leg.fail(why)

    def end(self, status: int) -> None:
        """End the root span with the HTTP status the client got (5xx: an error)."""
        root = self.root
        root.set_attribute("http.response.status_code", status)
        if status >= 500:
            root.set_status(self.tracing.Status(self.tracing.ERROR, f"HTTP {status}"))
        root.end()
        _CURRENT.set(None)


class LegSpan:
    """A leg in flight: its span, its ``traceparent`` header line, when its first byte came."""

    __slots__ = ("error", "header", "resp", "span", "started", "status", "trace")

    def __init__(self, trace: RequestTrace, span: Any) -> None:
        self.trace = trace
        self.span = span
        self.started = time.perf_counter()
        self.header = traceparent_line(span)
        self.status = 0
        self.error: BaseException | str | None = None
        self.resp: Any = None

    def fail(self, error: BaseException | str) -> None:
        """Why the leg failed (recorded when it ends)."""
        self.error = error

    def answered(self, status: int, resp: Any = None) -> None:
        """The worker's response headers arrived: the status and the time to first byte (``resp``:
        its ``size`` is the bytes read when the leg ends)."""
        self.status = status
        self.resp = resp
        self.span.set_attribute("http.response.status_code", status)
        self.span.set_attribute("fastcore.ttfb_ms", round((time.perf_counter() - self.started) * 1000, 3))

    def end(self, error: BaseException | str | None = None) -> None:
        """The leg is over: the bytes its answer held, and why it failed if it did."""
        span = self.span
        error = error if error is not None else self.error
        if self.resp is not None:
            span.set_attribute("fastcore.response_bytes", self.resp.size)
        if error is not None:
            if isinstance(error, BaseException):
                span.record_exception(error)
                error = type(error).__name__
            span.set_status(self.trace.tracing.Status(self.trace.tracing.ERROR, error))
        elif self.status == 0 or self.status >= 400:
            why = "no answer" if self.status == 0 else f"HTTP {self.status}"
            span.set_status(self.trace.tracing.Status(self.trace.tracing.ERROR, why))
        span.end()
        if self.trace.leg is self:
            self.trace.leg = None


def start_orchestrator_request(
    tracing: Tracing, request: Any, route: str, tenant: str | None, client_context: bool = True
) -> RequestTrace | Unsampled | None:
    """The orchestrator's SERVER span for a completion: the child of the client's ``traceparent``
    (unless ``client_context`` is off: a client that sets the sampled flag can have each of its
    requests traced, at the full tracing cost)."""
    attributes: dict[str, Any] = {"http.request.method": "POST", "http.route": route}
    if tenant:
        attributes["fastcore.tenant"] = tenant
    if not client_context:
        return tracing.start_request("POST " + route, None, None, attributes, True)
    return tracing.start_request(
        "POST " + route, request.header(TRACEPARENT), request.header(TRACESTATE), attributes, True
    )


class traced_wait:
    """``async with traced_wait(trace, name, cm)``: ``cm`` (an admission slot), with the time its
    entry took (the queue wait) as a span; a refusal (429) ends it as an error."""

    __slots__ = ("cm", "name", "trace")

    def __init__(self, trace: RequestTrace | Unsampled | None, name: str, cm: Any) -> None:
        self.trace, self.name, self.cm = trace, name, cm

    async def __aenter__(self) -> Any:
        trace = self.trace
        if trace is None or not trace.sampled:
            return await self.cm.__aenter__()
        started = trace.now()
        try:
            entered = await self.cm.__aenter__()
        except BaseException as exc:
            trace.record(self.name, started, error=getattr(exc, "message", None) or type(exc).__name__)
            raise
        trace.record(self.name, started)
        return entered

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self.cm.__aexit__(*exc_info)


# -- the worker's spans ------------------------------------------------------------------------


def start_worker_request(tracing: Tracing, request: Any, route: str, role: str) -> RequestTrace | None:
    """A worker's SERVER span for a completion or leg: the child of the orchestrator's leg span
    (its ``traceparent``); a parent-based sampler follows the orchestrator's decision."""
    path = request.path.decode("latin-1")
    trace = tracing.start_request(
        "POST " + path,
        request.header(TRACEPARENT),
        request.header(TRACESTATE),
        {"http.request.method": "POST", "http.route": path, "fastcore.role": role, "fastcore.route": route},
    )
    assert not isinstance(trace, Unsampled)  # not asked to propagate a dropped request
    return trace


def request_parsed(trace: RequestTrace, req: Any) -> None:
    """What the worker read of the request: its kind (context_only, generation_only or plain),
    model and prompt tokens."""
    kind = (
        wire.CONTEXT_ONLY
        if req.is_context_only
        else wire.GENERATION_ONLY
        if req.is_generation_only
        else "plain"
    )
    root = trace.root
    root.set_attribute("fastcore.request_type", kind)
    root.set_attribute("gen_ai.request.model", req.model or "")
    root.set_attribute("gen_ai.usage.input_tokens", int(req.prompt_ids.size))


def watch_deltas(
    trace: RequestTrace, on_delta: Callable[[Any], None], engine_req: Any
) -> Callable[[Any], None]:
    """``on_delta`` (the engine's output, on the event loop) that records the prefill span (from
    :attr:`RequestTrace.mark`, the hand-off to the engine, to the first token: computed and
    cached tokens, whether the KV was imported) and the decode span (first token to the last)."""
    first_at = 0
    tokens = 0

    def traced(delta: Any) -> None:
        nonlocal first_at, tokens
        tokens += len(delta.token_ids)
        if first_at == 0:
            first_at = trace.now()
            prompt = int(engine_req.prompt_ids.size)
            cached = min(int(engine_req.cached_prefix), prompt)
            imported = bool(engine_req.kv_imported)
            trace.record(
                "fastcore.prefill",
                trace.mark or first_at,
                {
                    "fastcore.prompt_tokens": prompt,
                    "fastcore.cached_tokens": cached,
                    "fastcore.computed_tokens": 0 if imported else prompt - cached,
                    "fastcore.kv_imported": imported,
                },
                error=delta.error if delta.finish_reason is not None else None,
            )
            if delta.finish_reason is None:
                trace.root.add_event("first_token")
        elif delta.finish_reason is not None:
            trace.record(
                "fastcore.decode", first_at, {"gen_ai.usage.output_tokens": tokens}, error=delta.error
            )
        if delta.finish_reason is not None:
            trace.root.set_attribute("gen_ai.usage.output_tokens", tokens)
            if delta.finish_reason:
                trace.root.set_attribute("gen_ai.response.finish_reasons", (delta.finish_reason,))
        on_delta(delta)

    return traced


def start_kv_fetch(trace: RequestTrace, endpoint: str, tokens: int) -> tuple[Any, dict[str, str]]:
    """The generation worker's KV fetch: a CLIENT span and the headers that carry its context
    (the context worker's ``fastcore.kv.export`` span is its child)."""
    span = trace.span(
        "fastcore.kv.fetch",
        {"fastcore.kv.tokens": tokens, "server.address": endpoint[:200]},
        kind=trace.tracing.CLIENT,
    )
    return span, traceparent_headers(span)


def end_span(
    trace: RequestTrace, span: Any, attributes: Mapping[str, Any] | None = None, error: str | None = None
) -> None:
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(trace.tracing.Status(trace.tracing.ERROR, error))
    span.end()


def start_kv_export(tracing: Tracing, request: Any, tokens: int) -> RequestTrace | None:
    """The context worker's ``GET /kv/<id>``: a SERVER span, the child of the fetch's span (none
    for a fetch without one: an unsampled request's, or another server's)."""
    traceparent = request.header(TRACEPARENT)
    if traceparent is None:
        return None
    trace = tracing.start_request(
        "fastcore.kv.export",
        traceparent,
        request.header(TRACESTATE),
        {"http.request.method": "GET", "fastcore.kv.tokens": tokens},
    )
    assert not isinstance(trace, Unsampled)
    return trace
