"""The torch engine's second KV tier (issue 40 item 1): TTFT of a re-visited long prefix.

A long prompt is served, other prompts push its blocks out of the device cache, and the prompt is
asked again with a new question at its end. Its time to first token, per configuration:

- ``device only``: no tier; the revisit prefills the whole prompt again;
- ``tier2 memory``: ``--kv-tier2-tokens``; the prefix is loaded back from host memory;
- ``tier2 files``: the same with ``--kv-tier2-path`` (a temporary directory);
- ``tier2 slower``: the memory tier with its load rate held below the measured prefill rate (a tier
  slower than recomputing): not taken, so no worse than ``device only``.

Every configuration's greedy tokens are compared with ``device only``'s (they must be the same).
The engine runs in process, one request at a time (TTFT is the prefix's alone). ``--quick``: a
shorter prompt and fewer rounds, for development::

    python -m bench.kv_tier2 [--prompt-tokens 1536] [--rounds 5] [--device auto] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.worker.cli import default_torch_threads, resolve_device
from server.worker.engine import EngineRequest, TorchEngine
from server.worker.kv_tier2 import Rates
from server.worker.output import OutputProcessor, SamplingParams
from server.worker.tiny import build_tiny

BLOCK = 16


async def first_token(engine: TorchEngine, ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the tokens, prompt tokens computed) of one request alone."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    tokens: list[int] = []
    first = 0.0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    computed = engine.prefill_computed_tokens
    began = time.perf_counter()

    def on_delta(delta: Any) -> None:
        nonlocal first
        if delta.token_ids and not first:
            first = time.perf_counter() - began
        tokens.extend(delta.token_ids)
        if delta.error and not done.done():
            done.set_exception(RuntimeError(delta.error))
        elif delta.finish_reason and not done.done():
            done.set_result(None)

    req = EngineRequest(
        request_id=f"r{began}",
        prompt_ids=np.asarray(ids, dtype=np.int32),
        params=params,
        processor=OutputProcessor(engine.tokenizer, params),
        on_delta=on_delta,
    )
    engine.submit(req)
    await asyncio.wait_for(done, 600)
    return first, tokens, engine.prefill_computed_tokens - computed


def _slower(tier: Any) -> None:
    """Hold the tier's load rate at a tenth of its measured prefill rate (measurements ignored)."""
    prefill = tier.rates.prefill_tokens_per_s or 1000.0
    held = Rates(tier.rates.bytes_per_token)
    held.observe_prefill(int(prefill), 1.0)
    held.observe_copy(max(1, int(prefill / 10)) * held.bytes_per_token, 1.0)
    held.observe_prefill = lambda tokens, seconds: None  # type: ignore[method-assign]
    held.observe_copy = lambda nbytes, seconds: None  # type: ignore[method-assign]
    tier.rates = held


async def run_config(name: str, args: argparse.Namespace, device: str, spill_dir: str) -> dict[str, Any]:
    config, model, tokenizer = build_tiny(device)
    kv = args.prompt_tokens + 4 * BLOCK + args.max_tokens  # room for the prompt, not for it and the others
    engine = TorchEngine(config, model, tokenizer, device=device, kv_tokens=kv, prefix_caching=True)
    if name != "device only":
        engine.cache.attach_tier2(4 * kv, spill_dir if name == "tier2 files" else None)
    engine.start(asyncio.get_running_loop())
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 250, size=args.prompt_tokens).tolist()
    others = [rng.integers(1, 250, size=args.prompt_tokens).tolist() for _ in range(2)]
    ttfts, computed, answers = [], [], []
    try:
        for round_ in range(args.rounds):
            await first_token(engine, [*prefix, round_ + 1], args.max_tokens)  # the first visit
            for other in others:  # its blocks pushed out of the device
                await first_token(engine, [*other, round_ + 1], args.max_tokens)
            if name == "tier2 slower":
                _slower(engine.cache.tier2)
            elif engine.cache.tier2 is not None and hasattr(engine.cache.tier2.store, "wait_idle"):
                engine.cache.tier2.store.wait_idle()  # the files written
            ttft, tokens, done = await first_token(engine, [*prefix, 200, round_ + 7], args.max_tokens)
            ttfts.append(ttft)
            computed.append(done)
            answers.append(tokens)
    finally:
        engine.stop()
        if engine.cache.tier2 is not None:
            engine.cache.tier2.close()
    tier = engine.cache.tier2
    return {
        "config": name,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "computed_p50": statistics.median(computed),
        "prompt_tokens": args.prompt_tokens + 2,
        "loaded_blocks": tier.loaded_blocks_total if tier is not None else 0,
        "load_tokens_per_s": round(tier.rates.load_tokens_per_s) if tier is not None else None,
        "prefill_tokens_per_s": round(tier.rates.prefill_tokens_per_s) if tier is not None else None,
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_tier2", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prompt-tokens", type=int, default=1536, help="the re-visited prefix (tiny: < 2048)"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--torch-threads", type=int, default=default_torch_threads())
    parser.add_argument("--quick", action="store_true", help="256-token prefix, 2 rounds")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.rounds = 256, 2
    torch.set_num_threads(args.torch_threads)
    device = resolve_device(args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-tier2-") as spill_dir:
        for name in ("device only", "tier2 memory", "tier2 files", "tier2 slower"):
            rows.append(asyncio.run(run_config(name, args, device, spill_dir)))
    base = rows[0]
    print(
        f"bench.kv_tier2: tiny model, {device}, {args.torch_threads} torch threads, "
        f"a {args.prompt_tokens}-token prefix re-visited after eviction, {args.rounds} rounds"
    )
    print(
        f"{'config':<14} {'TTFT p50 ms':>12} {'x device':>9} {'computed':>9} {'loaded':>7} "
        f"{'load tok/s':>11} {'prefill tok/s':>14} same"
    )
    for row in rows:
        row["same_tokens"] = row["answers"] == base["answers"]
        ratio = row["ttft_p50_ms"] / base["ttft_p50_ms"]
        print(
            f"{row['config']:<14} {row['ttft_p50_ms']:>12.2f} {ratio:>8.2f}x {row['computed_p50']:>9.0f} "
            f"{row['loaded_blocks']:>7} {row['load_tokens_per_s'] or '-':>11} "
            f"{row['prefill_tokens_per_s'] or '-':>14} {row['same_tokens']}"
        )
    if args.output is not None:
        rows = [{k: v for k, v in row.items() if k != "answers"} for row in rows]
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, "rows": rows}))
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
