"""The torch engine beside transformers: ``python -m bench.engine [--quick] [--device auto]``.

The same checkpoint (the tiny Llama: this bench writes it with transformers' ``save_pretrained``
from the weights ``--model tiny`` builds, loads it back with ``from_pretrained`` and checks the
weights are ours bit for bit) and the same torch threads for every contender:

1. Decode tokens/s and TTFT at 1, 8 and 32 concurrent requests of the same prompts: our engine
   in process (continuous batching, requests submitted at once), our worker over HTTP (a
   ``fastcore-serve worker`` process, streamed completions), and transformers' ``generate`` on
   a static batch of the same prompts (greedy, ``min_new_tokens`` = ``max_new_tokens`` as our
   ``ignore_eos``; its TTFT is a ``max_new_tokens=1`` call, its decode time the rest). Ratios are
   ours over transformers', measured in the same run; at 1 request the ratio of time per token.
   Every contender is warmed first on the same batch's 8-token heads (2 tokens; shorter than a
   cache block, so the measured prompts find nothing cached). Beside them, process CPU per
   generated token (prefill included, both sides; ours counts the engine thread and the event
   loop): on a shared machine other jobs' load moves the wall clock of two threads that hand
   tokens to each other more than one thread's CPU time.
2. Inter-token latency of 8 running streams while a prompt of the model's whole context is
   prefilled on the same engine, p50/p99 over every gap of every stream, beside the same
   streams' gaps with no prefill running (measured just before), in process and over HTTP,
   for prefill whole (``--prefill-chunk-tokens 0``), the default chunk and a small one unpaced
   (``--prefill-step-ratio 0``) and the default chunk paced (the worker's default). In process
   also the same streams alone just after the long prompt's first token: a paced prefill lasts
   thousands of steps, over which the streams' own decode step grows with their contexts (at
   8 x 1,800 positions about twice its cost at 8 x 200 on a CPU), so "alone before" alone
   overstates what the prefill adds; the streams outlive the prefill (``stream_tokens``).

On a CPU each side runs on one core (``--no-pin``: wherever the OS puts it): this process (our
engine in process, transformers, the HTTP clients) on the first CPU it may use, the worker process
on the next. transformers' ``generate`` is one thread, the same pinned or not (measured); our
engine is two (the engine thread and the event loop), which then hand the GIL over on one core
instead of across two: the in-process engine's CPU per token at 32 streams 20.7-21.9 us pinned
together, 22.7-27.4 on two cores, 23.7-35.9 unpinned (by process: the OS's placement).

Targets (issue 38): ITL p99 with the prefill <= 2x without; decode tokens/s at 32 >= 2x
transformers'; at 1 request no worse than 1.2x its time per token. Results: a table on stdout
and ``bench/results/engine.json`` (``engine_quick.json`` with ``--quick``). Absolute numbers
depend on the machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._timing import format_table
from bench.deploy import free_port
from bench.loadgen import RESULTS_DIR, percentile
from bench.worker import _one_stream, _wait_healthy
from server.worker.cli import default_torch_threads
from server.worker.engine import EngineRequest, TorchEngine
from server.worker.engine_api import (
    DEFAULT_KV_TOKENS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_STEP_RATIO,
)
from server.worker.model import LlamaForCausalLM, ModelConfig
from server.worker.output import Delta, OutputProcessor, SamplingParams
from server.worker.tiny import build_tiny, tiny_config

PROMPT_TOKENS = 64


def prompts(count: int, tokenizer: Any) -> list[list[int]]:
    """``count`` different prompts of exactly PROMPT_TOKENS ids (a static batch needs no padding)."""
    return [
        tokenizer.encode(f"{i:04d} " + "the cat sat on the mat. " * 4)[:PROMPT_TOKENS] for i in range(count)
    ]


def hf_model_from_checkpoint(ours: torch.nn.Module, directory: Path, device: str) -> Any:
    """Write the tiny model as a transformers checkpoint, load it back, check its weights are ours."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    c = tiny_config()
    # as keywords of a dict: transformers' stubs name only some of LlamaConfig's (rope_theta is read
    # from **kwargs there)
    fields: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=0, torch_dtype="float32",
    )  # fmt: skip
    config = LlamaConfig(**fields)
    writer = LlamaForCausalLM(config)
    writer.load_state_dict(ours.state_dict(), strict=False)  # rotary inv_freq is a buffer on both sides
    writer.save_pretrained(directory)
    model: Any = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model = model.to(device).eval()
    theirs = model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name].cpu(), tensor.cpu()), f"{name} differs after the round trip"
    return model


def hf_static(model: Any, batch: list[list[int]], max_tokens: int, device: str) -> dict[str, Any]:
    """transformers' generate on a static batch: TTFT (a one-token call) and decode tokens/s."""
    ids = torch.tensor(batch, device=device)
    mask = torch.ones_like(ids)
    common = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(
            ids[:, :8], max_new_tokens=2, min_new_tokens=2, attention_mask=mask[:, :8], pad_token_id=0
        )
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
        ttft = time.perf_counter() - t0
        gc.collect()  # earlier rounds' garbage collected now, not inside the timed call (both sides)
        t0, cpu0 = time.perf_counter(), time.process_time()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **common)
        total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    decode_tokens = len(batch) * (max_tokens - 1)
    return {
        "ttft_s": ttft,
        "total_s": total,
        "decode_tps": decode_tokens / max(total - ttft, 1e-9),
        "cpu_us_per_token": 1e6 * cpu / (len(batch) * max_tokens),
        "tokens": out[:, ids.shape[1] :].tolist(),
    }


def engine_request(engine: TorchEngine, ids: list[int], max_tokens: int, name: str) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(
        request_id=name,
        prompt_ids=np.asarray(ids, dtype=np.int32),
        params=params,
        processor=OutputProcessor(engine.tokenizer, params),
        on_delta=lambda d: None,
    )


async def ours_in_process(engine: TorchEngine, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Submit the batch at once; per request: first and last token times and the tokens."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    gc.collect()  # earlier rounds' garbage collected now, not inside the timed round (both sides)
    t0, cpu0 = time.perf_counter(), time.process_time()
    firsts: list[float] = [0.0] * len(batch)
    lasts: list[float] = [0.0] * len(batch)
    tokens: list[list[int]] = [[] for _ in batch]
    left = len(batch)

    def watch(i: int, delta: Delta) -> None:
        nonlocal left
        now = time.perf_counter() - t0
        if delta.token_ids:
            firsts[i] = firsts[i] or now
            lasts[i] = now
            tokens[i] += delta.token_ids
        if delta.error and not done.done():
            done.set_exception(RuntimeError(f"request {i} failed: {delta.error}"))
        if delta.finish_reason:
            left -= 1
            if not left and not done.done():
                done.set_result(None)

    for i, ids in enumerate(batch):
        req = engine_request(engine, ids, max_tokens, f"r{i}-{t0}")
        req.on_delta = functools.partial(watch, i)
        engine.submit(req)
    await asyncio.wait_for(done, 600)
    cpu = time.process_time() - cpu0
    decode_tokens = sum(len(t) - 1 for t in tokens)
    span = max(lasts) - min(firsts)
    return {
        "ttft_p50_s": statistics.median(firsts),
        "decode_tps": decode_tokens / span if span > 0 else float("nan"),
        "cpu_us_per_token": 1e6 * cpu / max(sum(len(t) for t in tokens), 1),
        "tokens": tokens,
    }


async def ours_over_http(url: str, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import aiohttp

    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = [_one_stream(session, url, {**body, "prompt": ids[:8], "max_tokens": 2}) for ids in batch]
        await asyncio.gather(*warm)  # as transformers and the in-process engine are warmed
        results = await asyncio.gather(*(_one_stream(session, url, {**body, "prompt": ids}) for ids in batch))
    span = max(r[1] for r in results) - min(r[0] for r in results)
    return {
        "ttft_p50_s": statistics.median(r[0] for r in results),
        "decode_tps": sum(r[2] - 1 for r in results) / span if span > 0 else float("nan"),
    }


def cpu_plan(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """With ``pin``: this process's CPU and the worker process's (the first two this process may
    use; the same one where it may use one); None, None: unpinned."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return {cpus[0]}, {cpus[1] if len(cpus) > 1 else cpus[0]}


class Worker:
    """A ``fastcore-serve worker --model tiny`` process on a free port (on :attr:`cpus` where set)."""

    #: the CPUs the worker process runs on (main's cpu_plan), None: wherever the OS puts it
    cpus: set[int] | None = None

    def __init__(self, threads: int, device: str, flags: tuple[str, ...] | list[str] = ()) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "server.cli",
            "worker",
            "--model",
            "tiny",
            "--port",
            str(port),
            "--device",
            device,
            "--torch-threads",
            str(threads),
            *flags,
        ]
        cpus = self.cpus
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )

    def __enter__(self) -> Worker:
        asyncio.run(_wait_healthy(self.url, self.proc))
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bench_decode(args: argparse.Namespace, device: str) -> tuple[str, list[dict[str, Any]], bool]:
    config, model, tokenizer = build_tiny(device)
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model_from_checkpoint(model, Path(tmp), device)
    rows, records = [], []
    same_text = True
    with Worker(args.torch_threads, device) as worker:
        for n in args.concurrency:
            batch = prompts(n, tokenizer)
            engine = TorchEngine(config, model, tokenizer, device=device)

            async def in_process(
                engine: TorchEngine = engine, batch: list[list[int]] = batch
            ) -> dict[str, Any]:
                engine.start(asyncio.get_running_loop())
                try:
                    # warmed as transformers is (hf_static): the same batch's 8-token heads, 2 tokens
                    # (shorter than a cache block: the measured prompts find nothing cached)
                    await ours_in_process(engine, [ids[:8] for ids in batch], 2)
                    return await ours_in_process(engine, batch, args.max_tokens)
                finally:
                    engine.stop()

            ours = asyncio.run(in_process())
            http = asyncio.run(ours_over_http(worker.url, batch, args.max_tokens))
            theirs = hf_static(hf, batch, args.max_tokens, device)
            same_text &= ours["tokens"] == theirs["tokens"]
            ratio = ours["decode_tps"] / theirs["decode_tps"]
            record = {
                "concurrency": n,
                "ours_in_process": {k: v for k, v in ours.items() if k != "tokens"},
                "ours_http": http,
                "transformers": {k: v for k, v in theirs.items() if k != "tokens"},
                "decode_ratio_in_process": ratio,
                "decode_ratio_http": http["decode_tps"] / theirs["decode_tps"],
                "cpu_ratio_in_process": theirs["cpu_us_per_token"] / ours["cpu_us_per_token"],
            }
            records.append(record)
            rows.append(
                [
                    n,
                    f"{ours['decode_tps']:.0f}",
                    f"{http['decode_tps']:.0f}",
                    f"{theirs['decode_tps']:.0f}",
                    f"{ratio:.2f}x",
                    f"{record['decode_ratio_http']:.2f}x",
                    f"{record['cpu_ratio_in_process']:.2f}x",
                    f"{ours['ttft_p50_s'] * 1e3:.1f}",
                    f"{http['ttft_p50_s'] * 1e3:.1f}",
                    f"{theirs['ttft_s'] * 1e3:.1f}",
                ]
            )
    headers = [
        "requests",
        "ours tok/s",
        "ours HTTP tok/s",
        "transformers tok/s",
        "ours / tf",
        "HTTP / tf",
        "ours / tf (CPU)",
        "ours TTFT p50 ms",
        "HTTP TTFT p50 ms",
        "tf TTFT ms",
    ]
    return format_table(headers, rows), records, same_text


async def itl_round(
    engine: TorchEngine, streams: int, base_steps: int, stream_tokens: int = 1800
) -> dict[str, float]:
    """Gaps between the tokens of ``streams`` running streams of ``stream_tokens`` tokens:
    ``base_steps`` steps with nothing else running, then while a prompt of the whole context
    prefills (until its first token), then ``base_steps`` more alone."""
    loop = asyncio.get_running_loop()
    stamps: list[list[float]] = [[] for _ in range(streams)]
    long_first = loop.create_future()
    base_done = loop.create_future()
    reqs = []
    for i in range(streams):
        req = engine_request(
            engine, engine.tokenizer.encode(f"stream {i} " * 3), stream_tokens, f"s{i}-{id(stamps)}"
        )

        def on_delta(d: Delta, i: int = i) -> None:
            if d.token_ids:
                stamps[i].append(time.perf_counter())
                if i == 0 and len(stamps[0]) == base_steps + 5 and not base_done.done():
                    base_done.set_result(None)

        req.on_delta = on_delta
        reqs.append(req)
        engine.submit(req)
    await asyncio.wait_for(base_done, 120)
    cut = len(stamps[0]), [len(s) for s in stamps]
    long_ids = whole_context_prompt(engine.tokenizer, engine.max_context)
    long = engine_request(engine, long_ids, 1, f"long-{id(stamps)}")

    def on_long(d: Delta) -> None:
        if d.error and not long_first.done():
            long_first.set_exception(RuntimeError(f"the long prompt failed: {d.error}"))
        elif d.token_ids and not long_first.done():
            long_first.set_result(time.perf_counter())

    long.on_delta = on_long
    started = time.perf_counter()
    engine.submit(long)
    ended = await asyncio.wait_for(long_first, 300)
    at = len(stamps[0])
    for _ in range(base_steps * 5):  # the streams alone again, at their contexts by now
        if len(stamps[0]) >= at + base_steps or all(len(req.generated) >= stream_tokens for req in reqs):
            break
        await asyncio.sleep(0.01)
    for req in reqs:
        engine.abort(req.request_id)
    stats = itl_stats(stamps, cut[1], started, ended)
    after = [b - a for s in stamps for a, b in itertools.pairwise(s) if a > ended]
    stats["after_p50_ms"] = 1e3 * (percentile(after, 50) or 0.0)
    stats["after_p99_ms"] = 1e3 * (percentile(after, 99) or 0.0)
    stats["streams_outlived"] = float(len(after) > 0)
    return stats


def itl_stats(stamps: list[list[float]], cut: list[int], started: float, ended: float) -> dict[str, float]:
    """p50/p99 of the streams' gaps alone (their steady steps before ``cut``, the first 5 being
    their start) and while the long prompt prefilled (every gap that ends after it came, at
    ``started``, and begins before its first token, at ``ended``)."""
    base = [b - a for s, n in zip(stamps, cut) for a, b in itertools.pairwise(s[5:n])]
    during = [b - a for s in stamps for a, b in itertools.pairwise(s) if b > started and a < ended]
    return {
        "base_p50_ms": 1e3 * (percentile(base, 50) or 0.0),
        "base_p99_ms": 1e3 * (percentile(base, 99) or 0.0),
        "during_p50_ms": 1e3 * (percentile(during, 50) or 0.0),
        "during_p99_ms": 1e3 * (percentile(during, 99) or 0.0),
        "prefill_s": ended - started,
        "gaps_during": len(during),
    }


def whole_context_prompt(tokenizer: Any, max_context: int) -> list[int]:
    """A prompt as long as the context allows with one token to generate."""
    return tokenizer.encode("a prompt as long as the whole context. " * (max_context // 30))[
        : max_context - 2
    ]


async def itl_round_http(url: str, streams: int, base_steps: int, long_ids: list[int]) -> dict[str, float]:
    """:func:`itl_round` against a worker process: the gaps between a stream's SSE events as its
    client reads them, the long prompt's first token as its own client reads it."""
    import aiohttp

    stamps: list[list[float]] = [[] for _ in range(streams)]
    base_done = asyncio.Event()
    body = {"model": "tiny", "max_tokens": 1800, "temperature": 0, "ignore_eos": True, "stream": True}

    async def stream(session: aiohttp.ClientSession, i: int) -> None:
        async with session.post(url + "/v1/completions", json={**body, "prompt": f"stream {i} " * 3}) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    stamps[i].append(time.perf_counter())
                    if i == 0 and len(stamps[0]) >= base_steps + 5:
                        base_done.set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(stream(session, i)) for i in range(streams)]
        try:
            await asyncio.wait_for(base_done.wait(), 120)
            cut = [len(s) for s in stamps]
            started = time.perf_counter()
            long = {**body, "prompt": long_ids, "max_tokens": 1}
            async with session.post(url + "/v1/completions", json=long) as resp:
                if resp.status != 200:
                    raise SystemExit(f"the long prompt got {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        break
            ended = time.perf_counter()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return itl_stats(stamps, cut, started, ended)


def tiny_at_context(device: str, context: int) -> tuple[ModelConfig, LlamaForCausalLM, Any]:
    """The tiny model's weights with ``max_position_embeddings`` = ``context`` (rotary positions
    have no bound of their own: a longer context is the same model asked for more positions)."""
    config, model, tokenizer = build_tiny(device)
    if context == config.max_position_embeddings:
        return config, model, tokenizer
    config = dataclasses.replace(config, max_position_embeddings=context)
    longer = LlamaForCausalLM(config).to(device)
    longer.load_state_dict(model.state_dict())
    return config, longer.eval(), tokenizer


def bench_itl(
    args: argparse.Namespace, device: str, context: int = 0, chunks: list[tuple[int, float]] | None = None
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The ITL rows of each chunking in ``chunks`` (default ``--chunks``) at the tiny model's own
    context, or in process only at a ``context`` of that many tokens (``--long-context``)."""
    config, model, tokenizer = tiny_at_context(device, context) if context else build_tiny(device)
    long_ids = whole_context_prompt(tokenizer, config.max_context)
    rows, records = [], []
    whole: dict[str, float] = {}
    # the streams outlive a long context's paced prefill (thousands of steps); room for the
    # whole-context prompt beside their tokens
    stream_tokens = max(1800, config.max_context)
    kv_tokens = max(DEFAULT_KV_TOKENS, config.max_context + args.streams * (stream_tokens + 248))
    for chunk, ratio in args.chunks if chunks is None else chunks:
        engine = TorchEngine(
            config,
            model,
            tokenizer,
            device=device,
            prefill_chunk_tokens=chunk,
            prefill_step_ratio=ratio,
            kv_tokens=kv_tokens,
        )

        async def measure(engine: TorchEngine = engine) -> dict[str, float]:
            engine.start(asyncio.get_running_loop())
            try:
                await ours_in_process(engine, prompts(2, tokenizer), 2)  # warm up
                return await itl_round(engine, args.streams, args.base_steps, stream_tokens)
            finally:
                engine.stop()

        where = f"in process, {config.max_context}-token context" if context else "in process"
        results = [(where, asyncio.run(measure()))]
        if not args.no_http_itl and not context:
            flags = ["--prefill-chunk-tokens", str(chunk), "--prefill-step-ratio", str(ratio)]
            with Worker(args.torch_threads, device, flags) as worker:
                results.append(
                    ("HTTP", asyncio.run(itl_round_http(worker.url, args.streams, args.base_steps, long_ids)))
                )
        for path, r in results:
            r["ratio_p99"] = r["during_p99_ms"] / r["base_p99_ms"]
            after = r.get("after_p99_ms")
            if after:
                r["ratio_p99_after"] = r["during_p99_ms"] / after
            whole.setdefault(path, r["during_p99_ms"])
            records.append(
                {
                    "prefill_chunk_tokens": chunk,
                    "prefill_step_ratio": ratio,
                    "path": path,
                    "context": config.max_context,
                    **r,
                }
            )
            rows.append(
                [
                    chunk_label(chunk, ratio),
                    path,
                    f"{r['base_p50_ms']:.1f}",
                    f"{r['base_p99_ms']:.1f}",
                    f"{r['during_p50_ms']:.1f}",
                    f"{r['during_p99_ms']:.1f}",
                    f"{r['ratio_p99']:.2f}x",
                    f"{after:.1f}" if after else "-",
                    f"{r['ratio_p99_after']:.2f}x" if after else "-",
                    f"{r['during_p99_ms'] / whole[path]:.2f}x",
                    f"{r['prefill_s'] * 1e3:.0f}",
                ]
            )
    return rows, records


ITL_HEADERS = [
    "prefill chunk",
    "path",
    "ITL p50 ms alone",
    "ITL p99 ms alone",
    "ITL p50 ms prefill",
    "ITL p99 ms prefill",
    "p99 prefill / alone",
    "ITL p99 ms alone after",
    "p99 prefill / alone after",
    "p99 vs whole",
    "TTFT of the long prompt ms",
]


def plot(decode: list[dict[str, Any]], itl: list[dict[str, Any]], path: Path) -> None:
    """Left: decode tokens/s against concurrent requests (ours in process and over HTTP,
    transformers' static batch); right: each ITL row's p99 while the long prompt prefills over
    its p99 alone, beside the 2x target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    ns = [r["concurrency"] for r in decode]
    for key, label in (
        ("ours_in_process", "ours, in process"),
        ("ours_http", "ours, HTTP"),
        ("transformers", "transformers generate (static batch)"),
    ):
        left.plot(ns, [r[key]["decode_tps"] for r in decode], marker="o", label=label)
    left.set_xscale("log", base=2)
    left.set_xticks(ns, [str(n) for n in ns])
    left.set_xlabel("concurrent requests")
    left.set_ylabel("decode tokens/s")
    left.set_title("decode throughput (higher is better)")
    left.legend()
    labels = [
        f"{chunk_label(r['prefill_chunk_tokens'], r.get('prefill_step_ratio', 0.0))}\n"
        + r["path"].replace(", ", "\n").replace("-token context", " tokens")
        for r in itl
    ]
    right.bar(range(len(itl)), [r["ratio_p99"] for r in itl])
    right.axhline(2.0, color="red", linestyle="--", label="target: 2x")
    right.set_yscale("log")
    right.set_xticks(range(len(itl)), labels, fontsize=7)
    right.set_ylabel("ITL p99 during the prefill / alone")
    right.set_title("streams' ITL while a whole-context prompt prefills (lower is better)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_chunk(item: str) -> tuple[int, float]:
    """``C`` or ``C:R``: --prefill-chunk-tokens C, --prefill-step-ratio R (default the worker's)."""
    chunk, _, ratio = item.partition(":")
    if int(chunk) == 0:
        return 0, 0.0  # whole prompts: nothing to pace
    return int(chunk), float(ratio) if ratio else DEFAULT_PREFILL_STEP_RATIO


def chunk_label(chunk: int, ratio: float) -> str:
    if chunk == 0:
        return "whole"
    return f"{chunk} paced {ratio:g}x" if ratio else str(chunk)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 1 and 8 requests, 16 tokens, 40 steps alone"
    )
    parser.add_argument("--concurrency", default=None, help="concurrent requests per round (default 1,8,32)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="completion tokens per request (default 64)"
    )
    parser.add_argument(
        "--chunks",
        default=f"0,{DEFAULT_PREFILL_CHUNK_TOKENS}:0,64:0,"
        f"{DEFAULT_PREFILL_CHUNK_TOKENS}:{DEFAULT_PREFILL_STEP_RATIO:g}",
        help="the ITL table's engines: --prefill-chunk-tokens values (0: whole prompts), each "
        "with :--prefill-step-ratio (0: unpaced; default "
        f"{DEFAULT_PREFILL_STEP_RATIO:g}) (default %(default)s)",
    )
    parser.add_argument("--no-http-itl", action="store_true", help="the ITL table in process only")
    parser.add_argument(
        "--long-context",
        type=int,
        default=None,
        help="also the ITL rows in process with the tiny model's weights at this context, its "
        "whole-context prompt prefilling (default 16384; --quick: 0, none)",
    )
    parser.add_argument(
        "--long-chunks",
        default=f"0,{DEFAULT_PREFILL_CHUNK_TOKENS}:{DEFAULT_PREFILL_STEP_RATIO:g}",
        help="the --long-context rows' engines, as --chunks (default %(default)s)",
    )
    parser.add_argument("--streams", type=int, default=8, help="running streams in the ITL table")
    parser.add_argument(
        "--base-steps", type=int, default=None, help="steps measured with no prefill (default 200)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=default_torch_threads(),
        help="torch threads for every contender (default: the worker's own default)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave both processes wherever the OS puts them (default on a CPU: one core each)",
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    quick = {"concurrency": "1,8", "max_tokens": 16, "base_steps": 40, "long_context": 0}
    full = {"concurrency": "1,8,32", "max_tokens": 64, "base_steps": 200, "long_context": 16384}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # empty: none of those rows (--concurrency '' --chunks '' --long-context N: the long rows alone)
    args.concurrency = [int(n) for n in args.concurrency.split(",") if n]
    args.chunks = [parse_chunk(item) for item in args.chunks.split(",") if item]
    args.long_chunks = [parse_chunk(item) for item in args.long_chunks.split(",") if item]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.torch_threads)
    here, Worker.cpus = cpu_plan(args.pin and device == "cpu")
    if here is not None:
        os.sched_setaffinity(0, here)  # before any thread starts: the engine's thread inherits it
    print(
        f"## tiny Llama ({tiny_config().max_position_embeddings}-token context), device {device}, "
        f"{args.torch_threads} torch threads, {PROMPT_TOKENS}-token prompts, {args.max_tokens} tokens each, "
        + (
            "unpinned"
            if here is None
            else f"this process on CPU {sorted(here)}, the worker on {sorted(Worker.cpus or ())}"
        )
        + "\n"
    )
    decode: list[dict[str, Any]] = []
    same_text = True
    if args.concurrency:
        decode_table, decode, same_text = bench_decode(args, device)
        print("### Decode tokens/s and TTFT: ours (continuous batching) vs transformers' static batch\n")
        print(decode_table)
        print(f"\ngreedy tokens identical to transformers' (in process): {'yes' if same_text else 'NO'}")
    itl_rows, itl = bench_itl(args, device)
    if args.long_context:
        long_rows, long_itl = bench_itl(args, device, args.long_context, args.long_chunks)
        itl_rows, itl = itl_rows + long_rows, itl + long_itl
    print(
        f"\n### ITL of {args.streams} running streams while a prompt of the whole context prefills "
        f"({tiny_config().max_position_embeddings - 2} tokens; the path names a longer one)\n"
    )
    print(format_table(ITL_HEADERS, itl_rows))
    verdicts = targets(decode, itl)
    print()
    for line in verdicts:
        print(line)
    out = args.output or RESULTS_DIR / ("engine_quick.json" if args.quick else "engine.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device,
        "torch_threads": args.torch_threads,
        "max_tokens": args.max_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "quick": args.quick,
        "torch": torch.__version__,
        "long_context": args.long_context,
        "cpus": None if here is None else {"bench": sorted(here), "worker": sorted(Worker.cpus or ())},
    }
    out.write_text(
        json.dumps(
            {"meta": meta, "decode": decode, "itl": itl, "same_text": same_text, "targets": verdicts},
            indent=2,
        )
    )
    if decode and itl:
        plot(decode, itl, out.with_suffix(".png"))
    print(f"\nwrote {out}" + (f" and {out.with_suffix('.png').name}" if decode and itl else ""))
    return 0


def targets(decode: list[dict[str, Any]], itl: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with its numbers and whether it is met."""
    lines = []
    for r in itl:
        if r["prefill_chunk_tokens"]:
            met = r["ratio_p99"] <= 2.0
            label = chunk_label(r["prefill_chunk_tokens"], r.get("prefill_step_ratio", 0.0))
            lines.append(
                f"ITL p99 with a whole-context prefill, chunks of {label} "
                f"({r.get('path', 'in process')}): "
                f"{r['ratio_p99']:.2f}x of alone (target <= 2x): {'met' if met else 'NOT met'}"
                + (f"; {r['ratio_p99_after']:.2f}x of alone after it" if r.get("ratio_p99_after") else "")
            )
    by_n = {r["concurrency"]: r for r in decode}
    if 32 in by_n:
        ratio = by_n[32]["decode_ratio_in_process"]
        lines.append(
            f"decode tok/s at 32: {ratio:.2f}x transformers' static batch (target >= 2x): "
            f"{'met' if ratio >= 2.0 else 'NOT met'}"
        )
    if 1 in by_n:
        tpt = 1 / by_n[1]["decode_ratio_in_process"]  # our time per token over theirs
        lines.append(
            f"time per token at 1 request: {tpt:.2f}x transformers' (target <= 1.2x): "
            f"{'met' if tpt <= 1.2 else 'NOT met'}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
