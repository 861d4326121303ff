"""Real workers started in the test's own event loop, for the worker and interop tests.

The app is ``server.worker.app.start_worker`` around a real engine: the
seeded tiny torch model (:func:`tiny_worker`) where tokens and KV matter, the
synthetic engine (:func:`synthetic_worker`) where only the HTTP layer does.
Both listen on 127.0.0.1 on a free port.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from server.worker.app import WorkerSettings, start_worker
from server.worker.synthetic import SyntheticEngine


class LiveWorker:
    """A running worker: ``server`` (its ``cleanup()`` stops it), ``port``, ``url``, ``engine``."""

    def __init__(self, server: Any, port: int, engine: Any) -> None:
        self.server = server
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.engine = engine


async def tiny_worker(
    role: str = "both", *, kv_tokens: int = 1 << 14, prefix_caching: bool = True, **settings: Any
) -> LiveWorker:
    """A worker on the built-in tiny model (a fresh engine each: its own KV cache of ``kv_tokens``).
    Skips the test where torch is not installed (the synthetic worker needs none)."""
    pytest.importorskip("torch")
    from server.worker.engine import TorchEngine
    from server.worker.tiny import build_tiny

    config, model, tokenizer = build_tiny()
    engine = TorchEngine(config, model, tokenizer, kv_tokens=kv_tokens, prefix_caching=prefix_caching)
    server, port = await start_worker(engine, WorkerSettings(role=role, **settings))
    return LiveWorker(server, port, engine)


async def synthetic_worker(role: str = "both", **settings: Any) -> LiveWorker:
    """A worker on the synthetic engine (model name ``synthetic``)."""
    engine = SyntheticEngine(64)
    server, port = await start_worker(engine, WorkerSettings(role=role, model_name="synthetic", **settings))
    return LiveWorker(server, port, engine)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Several engines share 2 cores in CI: one intra-op thread each avoids oversubscription.
    Autouse in every module that imports it; nothing to do without torch."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
