"""The torch engine and model without HTTP, for the engine, prefix-cache, model and trtllm tests.

Every module that imports this needs torch and skips at collection without it
(``pytest.importorskip("torch")`` before the import).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from server.worker.engine import EngineRequest, TorchEngine
from server.worker.model import ModelConfig
from server.worker.output import Delta, OutputProcessor, SamplingParams


def small_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=500.0,
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def make_request(
    engine: TorchEngine, prompt: str, **params: Any
) -> tuple[EngineRequest, asyncio.Queue[Delta]]:
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    sp = SamplingParams(**{"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, **params})
    req = EngineRequest(
        request_id=f"{prompt}-{id(queue)}",
        prompt_ids=np.asarray(engine.tokenizer.encode(prompt), dtype=np.int32),
        params=sp,
        processor=OutputProcessor(engine.tokenizer, sp),
        on_delta=queue.put_nowait,
    )
    return req, queue


async def run(engine: TorchEngine, prompt: str, **params: Any) -> tuple[list[int], str | None, list[Delta]]:
    req, queue = make_request(engine, prompt, **params)
    engine.submit(req)
    deltas = []
    while True:
        d = await asyncio.wait_for(queue.get(), 30)
        deltas.append(d)
        if d.finish_reason:
            return [t for x in deltas for t in x.token_ids], d.finish_reason, deltas


def step_by_hand(engine: TorchEngine) -> list[tuple[EngineRequest, Delta]]:
    """One pass of the engine loop on this thread, with no engine thread started (so a test
    counts steps, not seconds): submitted requests join, are admitted, one step runs; its outputs
    are returned, not delivered. Call under ``torch.inference_mode()``."""
    engine._waiting.extend(engine._inbox)
    engine._inbox.clear()
    outputs: list[tuple[EngineRequest, Delta]] = []
    engine._drop_cancelled()
    engine._admit(outputs)
    if engine._running or engine._prefilling:
        engine._step(outputs)
    return outputs
