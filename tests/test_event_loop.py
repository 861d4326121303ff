"""server.tasks.run_event_loop: the orchestrator's and the torch worker's one event loop, uvloop
where it is installed, plain asyncio where not; the coroutine's result comes back."""

from __future__ import annotations

import asyncio
import sys

import pytest

from server.tasks import run_event_loop


async def _loop_module() -> tuple[str, int]:
    return type(asyncio.get_running_loop()).__module__, 7


def test_runs_on_uvloop_where_installed() -> None:
    pytest.importorskip("uvloop")
    module, result = run_event_loop(_loop_module())
    assert module.startswith("uvloop") and result == 7


def test_plain_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    module, result = run_event_loop(_loop_module())
    assert module.startswith("asyncio") and result == 7


def test_the_worker_and_the_orchestrator_run_on_it() -> None:
    from server.orchestrator import cli as orchestrator_cli

    assert orchestrator_cli.run_event_loop is run_event_loop
    worker_cli = pytest.importorskip("server.worker.cli", reason="the worker extra")
    assert worker_cli.run_event_loop is run_event_loop
