"""OpenTelemetry tracing (server/tracing.py, docs/tracing.md): one trace per request across the
orchestrator, both workers and the KV hand-off, exported over real OTLP/HTTP to a receiver here.

The deployment is real processes (two synthetic workers, an orchestrator started from a trtllm-serve
style YAML whose ``otlp_config`` is the only tracing setting); the receiver decodes each export as
the collector would (``ExportTraceServiceRequest``)."""

from __future__ import annotations

import contextvars
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port

from server import tracing
from server.orchestrator.config import ConfigError, build_config, load_config_file

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

STARTUP_TIMEOUT_S = 60.0


CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
NO_OTEL = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "env", "expected"),
    [
        (None, {}, None),
        ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
        ("collector:4318", {}, "http://collector:4318/v1/traces"),
        ("http://collector:4318/custom/path", {}, "http://collector:4318/custom/path"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:1/v1/traces"}, "http://c:1/v1/traces"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:1/"}, "http://c:1/v1/traces"),
        ("http://flag:1/v1/traces", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:1"}, "http://flag:1/v1/traces"),
        ("http://collector:4318", {"OTEL_SDK_DISABLED": "true"}, None),
        ("http://collector:4318", {"OTEL_TRACES_EXPORTER": "none"}, None),
    ],
)
def test_configured_endpoint(endpoint: str | None, env: dict[str, str], expected: str | None) -> None:
    assert tracing.configured_endpoint(endpoint, env) == expected


def test_grpc_protocol_and_non_http_urls_are_refused() -> None:
    with pytest.raises(tracing.TracingConfigError, match="only http/protobuf"):
        tracing.check_endpoint("http://c:4317/v1/traces", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    with pytest.raises(tracing.TracingConfigError, match="http:// or https://"):
        tracing.check_endpoint("ftp://c/v1/traces", {})


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def _load(path: Path) -> Any:
    return build_config(load_config_file(path))


def test_trtllm_otlp_config_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    config = _load(_yaml(tmp_path, "otlp_config:\n  otlp_traces_endpoint: http://127.0.0.1:4318\n"
                                          "context_servers: {urls: ['127.0.0.1:1']}\n"
                                          "generation_servers: {urls: ['127.0.0.1:2']}\n"))  # fmt: skip
    config.check_runnable()
    assert config.otlp_traces_endpoint == "http://127.0.0.1:4318"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(ConfigError, match=r"otlp_config.otlp_traces_endpoint: .*only http/protobuf"):
        config.check_runnable()


def test_an_unknown_otlp_config_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="otlp_config"):
        _load(_yaml(tmp_path, "otlp_config:\n  otlp_trace_endpoint: http://127.0.0.1:4318\n"))


def test_tracing_off_imports_no_sdk() -> None:
    """No endpoint: the orchestrator and a worker are built and no opentelemetry module is loaded."""
    code = (
        "import sys\n"
        "from server.orchestrator.app import Orchestrator\n"
        "from server.orchestrator.config import OrchestratorConfig\n"
        "from server.worker.app import WorkerApp, WorkerSettings\n"
        "from server.worker.synthetic import SyntheticEngine\n"
        "o = Orchestrator(OrchestratorConfig(context_servers={'urls': ['127.0.0.1:1']},"
        " generation_servers={'urls': ['127.0.0.1:2']}))\n"
        "w = WorkerApp(SyntheticEngine(16), WorkerSettings(model_name='synthetic'))\n"
        "assert o.tracing is None and w.tracing is None\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=NO_OTEL, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- an OTLP/HTTP receiver ---------------------------------------------------------------------


class Receiver:
    """``POST /v1/traces`` on 127.0.0.1 (port 0), protobuf bodies decoded into span dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request, self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request: ExportTraceServiceRequest, path: str) -> None:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self.lock:
                        self.spans.append(
                            {
                                "path": path,
                                "service": attrs.get("service.name"),
                                "resource": attrs,
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                                "status": span.status.code,
                                "events": [e.name for e in span.events],
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                            }
                        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


# -- a deployment as processes ---------------------------------------------------------------


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy in {STARTUP_TIMEOUT_S} s")


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.status, resp.read()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _deploy(
    tmp_path: Path, receiver: Receiver, env: dict[str, str]
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A context and a generation synthetic worker tracing by their flag, and an orchestrator whose
    YAML's otlp_config is its only tracing setting."""
    procs: list[subprocess.Popen[bytes]] = []
    urls = {}
    for role in ("context", "generation"):
        port = free_port()
        argv = [sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--prompt-tokens", "48",
                "--role", role, "--port", str(port), "--otlp-traces-endpoint", receiver.url]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
        urls[role] = f"127.0.0.1:{port}"
    port = free_port()
    config = _yaml(
        tmp_path,
        f"hostname: 127.0.0.1\nport: {port}\n"
        f"otlp_config:\n  otlp_traces_endpoint: {receiver.url}\n"
        f"context_servers: {{num_instances: 1, urls: ['{urls['context']}']}}\n"
        f"generation_servers: {{num_instances: 1, urls: ['{urls['generation']}']}}\n",
    )
    argv = [sys.executable, "-m", "server.cli", "orchestrator", "-c", str(config)]
    procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
    try:
        for role in ("context", "generation"):
            _wait_healthy(f"http://{urls[role]}", procs)
        _wait_healthy(f"http://127.0.0.1:{port}", procs)
    except BaseException:
        _stop(procs)
        raise
    return f"http://127.0.0.1:{port}", procs


def _by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        traces.setdefault(span["trace_id"], []).append(span)
    return traces


def _ancestors(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    chain = []
    while span["parent"] in by_id:
        span = by_id[span["parent"]]
        chain.append(span)
    return chain


def test_one_trace_per_request_across_orchestrator_workers_and_kv(tmp_path: Path, receiver: Receiver) -> None:
    env = {
        **NO_OTEL,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
    }
    url, procs = _deploy(tmp_path, receiver, env)
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    try:
        chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _ = _post(url + "/v1/chat/completions", {**chat, "stream": True},
                          {"traceparent": traceparent, "tracestate": "vendor=abc"})  # fmt: skip
        assert status == 200
        status, _ = _post(url + "/v1/completions", {"model": "synthetic", "prompt": "x", "max_tokens": 3}, {})
        assert status == 200
    finally:
        _stop(procs)  # SIGTERM: each process flushes its batched spans as it stops
    for proc in procs:
        assert proc.returncode == 0, proc.args
    traces = _by_trace(receiver.spans)
    assert len(traces) == 2, {t: sorted(s["name"] for s in spans) for t, spans in traces.items()}
    assert {s["path"] for s in receiver.spans} == {"/v1/traces"}

    for spans in traces.values():
        by_id = {s["span_id"]: s for s in spans}
        services = {s["service"] for s in spans}
        assert services == {"fastcore-orchestrator", "fastcore-worker-context", "fastcore-worker-generation"}
        assert all(s["resource"]["deployment.environment"] == "test" for s in spans)
        (root,) = [s for s in spans if s["parent"] not in by_id]
        assert root["service"] == "fastcore-orchestrator"
        assert root["attributes"]["http.response.status_code"] == 200
        assert root["attributes"]["gen_ai.request.model"] == "synthetic"
        names = {s["name"] for s in spans if s["service"] == "fastcore-orchestrator"}
        assert {"fastcore.route", "fastcore.context_leg", "fastcore.generation_leg"} <= names
        legs = {s["span_id"] for s in spans if s["name"].endswith("_leg")}
        for leg in (s for s in spans if s["span_id"] in legs):
            assert leg["attributes"]["http.response.status_code"] == 200
            assert leg["attributes"]["fastcore.response_bytes"] > 0
            assert "fastcore.ttfb_ms" in leg["attributes"]
        # every worker span descends from one of the orchestrator's leg spans
        for span in spans:
            if span["service"] != "fastcore-orchestrator":
                assert legs & {a["span_id"] for a in _ancestors(span, by_id)}, span["name"]
        worker_roots = {s["service"]: s for s in spans if s["name"].startswith("POST ") and s is not root}
        assert (
            worker_roots["fastcore-worker-context"]["attributes"]["fastcore.request_type"] == "context_only"
        )
        assert (
            worker_roots["fastcore-worker-generation"]["attributes"]["fastcore.request_type"]
            == "generation_only"
        )
        # the KV hand-off: the generation worker's fetch, the context worker's export its child
        (fetch,) = [s for s in spans if s["name"] == "fastcore.kv.fetch"]
        (export,) = [s for s in spans if s["name"] == "fastcore.kv.export"]
        assert (
            fetch["service"] == "fastcore-worker-generation"
            and export["service"] == "fastcore-worker-context"
        )
        assert export["parent"] == fetch["span_id"]
        assert (
            fetch["attributes"]["fastcore.kv.tokens"] == 48 and fetch["attributes"]["fastcore.kv.bytes"] > 0
        )
        assert export["attributes"]["fastcore.kv.bytes"] > 0
        prefill = [s for s in spans if s["name"] == "fastcore.prefill"]
        assert {s["service"] for s in prefill} == {"fastcore-worker-context", "fastcore-worker-generation"}
        ctx_prefill = next(s for s in prefill if s["service"] == "fastcore-worker-context")
        assert ctx_prefill["attributes"]["fastcore.computed_tokens"] + ctx_prefill["attributes"][
            "fastcore.cached_tokens"] == 48  # fmt: skip
        assert any(
            s["name"] == "fastcore.decode" for s in spans if s["service"] == "fastcore-worker-generation"
        )
        assert all(s["status"] != 2 for s in spans), [s["name"] for s in spans if s["status"] == 2]

    # the client's traceparent: the trace is its trace, the root the child of its span
    client_trace = traces[CLIENT_TRACE_ID]
    by_id = {s["span_id"]: s for s in client_trace}
    (root,) = [s for s in client_trace if s["parent"] not in by_id]
    assert root["parent"] == CLIENT_SPAN_ID
    assert root["attributes"]["http.route"] == "/v1/chat/completions"
    (gen_leg,) = [s for s in client_trace if s["name"] == "fastcore.generation_leg"]
    assert "first_token" in gen_leg["events"]


def test_unsampled_client_trace_sends_no_spans(tmp_path: Path, receiver: Receiver) -> None:
    """A client's traceparent with the sampled flag off: the parent-based sampler drops the request
    at the orchestrator and nothing reaches the workers' traces either; a sampled one after it is
    exported (so the receiver was listening)."""
    env = {**NO_OTEL, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    url, procs = _deploy(tmp_path, receiver, env)
    body = {"model": "synthetic", "prompt": "x", "max_tokens": 2}
    try:
        assert (
            _post(
                url + "/v1/completions", body, {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"}
            )[0]
            == 200
        )
        assert (
            _post(url + "/v1/completions", body, {"traceparent": f"00-{'1' * 32}-{CLIENT_SPAN_ID}-01"})[0]
            == 200
        )
    finally:
        _stop(procs)
    assert set(_by_trace(receiver.spans)) == {"1" * 32}


class _Request:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers

    def header(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


def test_a_dropped_request_carries_its_decision_to_the_legs(monkeypatch: pytest.MonkeyPatch) -> None:
    # its own context: the request's trace (a ContextVar) must not outlive the test
    contextvars.copy_context().run(_dropped_request, monkeypatch)


def _dropped_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling at the orchestrator: a request the sampler drops is no span, but its legs carry
    ``traceparent`` with the sampled flag off (a worker's parent-based sampler drops it too); a
    client's unsampled traceparent keeps its trace id."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_off")
    t = tracing.Tracing("test", "http://127.0.0.1:9/v1/traces")
    try:
        dropped = tracing.start_orchestrator_request(t, _Request({}), "/v1/completions", None)
        assert isinstance(dropped, tracing.Unsampled) and tracing.current_trace() is dropped
        leg = dropped.start_leg("context", None, None, None, 0, 0)
        assert leg.header.startswith(b"traceparent: 00-") and leg.header.endswith(b"-00\r\n")
        client = _Request({b"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00".encode()})
        kept = tracing.start_orchestrator_request(t, client, "/v1/completions", None)
        assert isinstance(kept, tracing.Unsampled)
        assert kept.header.startswith(f"traceparent: 00-{CLIENT_TRACE_ID}-".encode())
        assert kept.header.endswith(b"-00\r\n")
    finally:
        t.shutdown()


def test_a_sampled_new_trace_keeps_the_id_it_was_sampled_on(monkeypatch: pytest.MonkeyPatch) -> None:
    contextvars.copy_context().run(_sampled_new_trace, monkeypatch)


def _sampled_new_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ratio sampler is asked once with a drawn id, and the root span takes that id: with ratio
    0.5, every request that gets a span has a trace id the ratio admits."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    t = tracing.Tracing("test", "http://127.0.0.1:9/v1/traces")
    try:
        bound = t.sampler.bound
        sampled = 0
        for _ in range(200):
            trace = tracing.start_orchestrator_request(t, _Request({}), "/v1/completions", None)
            if isinstance(trace, tracing.RequestTrace):
                sampled += 1
                assert trace.root.get_span_context().trace_id & ((1 << 64) - 1) < bound
        assert 0 < sampled < 200
    finally:
        t.shutdown()


def test_failures_are_recorded_on_their_spans(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> None:
    contextvars.copy_context().run(_failures_recorded, monkeypatch, receiver)


def _failures_recorded(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> None:
    """A leg that failed (an exception, then a retry that answered 503), an admission refusal (429)
    and the request's 502: each span's status says so, the exception recorded as an event."""
    import asyncio

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from server.errors import HTTPError
    from server.http import UpstreamError

    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    t = tracing.Tracing("test", receiver.url + "/v1/traces")
    memory = InMemorySpanExporter()
    t.provider.add_span_processor(SimpleSpanProcessor(memory))

    class Refusing:
        async def __aenter__(self) -> None:
            raise HTTPError(429, "the admission queue is full", code="queue_full")

        async def __aexit__(self, *exc: object) -> None:
            return None

    class Pool:
        name = "context"

        class router:
            name = "round_robin"

    class Worker:
        url = "http://127.0.0.1:1"

    class Resp:
        size = 10

    try:
        trace = tracing.start_orchestrator_request(t, _Request({}), "/v1/completions", "team-a")
        assert isinstance(trace, tracing.RequestTrace)

        async def admit() -> None:
            async with tracing.traced_wait(trace, "fastcore.admission", Refusing()):
                pass

        with pytest.raises(HTTPError):
            asyncio.run(admit())
        leg = trace.start_leg("context", Pool, Worker, None, trace.now(), 0)
        leg.fail(UpstreamError("connection reset"))
        leg.end()
        retry = trace.start_leg("context", Pool, Worker, None, trace.now(), 1)
        retry.answered(503, Resp())
        retry.end()
        trace.end(502)
        spans = {(s.name, s.attributes.get("fastcore.attempt")): s for s in memory.get_finished_spans()}
        admission = spans[("fastcore.admission", None)]
        assert admission.status.status_code == StatusCode.ERROR
        assert admission.status.description == "the admission queue is full"
        failed = spans[("fastcore.context_leg", 0)]
        assert failed.status.status_code == StatusCode.ERROR
        assert [e.name for e in failed.events] == ["exception"]
        refused = spans[("fastcore.context_leg", 1)]
        assert refused.status.status_code == StatusCode.ERROR and refused.status.description == "HTTP 503"
        assert refused.attributes["fastcore.response_bytes"] == 10
        root = spans[("POST /v1/completions", None)]
        assert root.status.status_code == StatusCode.ERROR
        assert root.attributes["fastcore.tenant"] == "team-a"
        assert root.attributes["http.response.status_code"] == 502
        assert spans[("fastcore.route", 1)].attributes["fastcore.worker"] == "http://127.0.0.1:1"
    finally:
        t.shutdown()
    assert len(receiver.spans) == len(memory.get_finished_spans())  # the flush on shutdown


def test_client_trace_context_off_ignores_the_clients_traceparent(monkeypatch: pytest.MonkeyPatch) -> None:
    contextvars.copy_context().run(_client_context_off, monkeypatch)


def _client_context_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``otlp_config.client_trace_context: false``: a client's sampled traceparent neither parents
    the request's span nor forces it sampled (always_off here: dropped)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_off")
    t = tracing.Tracing("test", "http://127.0.0.1:9/v1/traces")
    client = _Request({b"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01".encode()})
    try:
        honoured = tracing.start_orchestrator_request(t, client, "/v1/completions", None)
        assert isinstance(honoured, tracing.RequestTrace)
        assert honoured.root.parent.span_id == int(CLIENT_SPAN_ID, 16)
        ignored = tracing.start_orchestrator_request(t, client, "/v1/completions", None, client_context=False)
        assert isinstance(ignored, tracing.Unsampled)
        assert CLIENT_TRACE_ID.encode() not in ignored.header
    finally:
        t.provider.shutdown = lambda: None  # type: ignore[method-assign]  # no span was ended: nothing to send
    config = build_config({"otlp_config": {"client_trace_context": False}})
    assert config.otlp_config is not None and config.otlp_config.client_trace_context is False
