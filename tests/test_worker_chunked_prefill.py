"""Chunked and batched prefill in the torch engine (issue 38 items 2 and 3).

A long prompt's prefill is cut into chunks under a per-step token budget and interleaved with the
running streams' decode steps; several waiting prompts' chunks share one forward; the oldest
waiting prompt is served first. The output is what a whole, unbatched prefill gives.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import torch
from engines import make_request, run, step_by_hand

from server.worker.engine import EngineRequest, TorchEngine
from server.worker.output import Delta
from server.worker.tiny import build_tiny

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture
def tiny() -> Any:
    torch.set_num_threads(1)
    return build_tiny()


@pytest.fixture
def make_engine(tiny: Any) -> Any:
    made: list[TorchEngine] = []

    def make(**kw: Any) -> TorchEngine:
        config, model, tokenizer = tiny
        # unpaced unless asked: the step-count tests need chunks that do not follow the clock
        engine = TorchEngine(config, model, tokenizer, **{"kv_tokens": 8192, "prefill_step_ratio": 0.0, **kw})
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.stop()


def started(engine: TorchEngine) -> TorchEngine:
    engine.start(asyncio.get_running_loop())
    return engine


def text(i: int, n: int) -> str:
    """A prompt of about ``n`` byte tokens, different for each ``i``."""
    return (f"{i} lorem ipsum {i * 7} dolor sit amet, " * (n // 20 + 1))[:n]


async def test_the_same_greedy_text_chunked_or_not_with_prefix_hits(make_engine: Any) -> None:
    whole = started(make_engine(prefill_chunk_tokens=0))
    chunked = [started(make_engine(prefill_chunk_tokens=n)) for n in (16, 37, 512)]
    # second and third turns extend the first: prefix-cache hits, then chunks from the hit on
    turns = [
        PROMPT,
        PROMPT + "And then?",
        PROMPT + "And then? It ran off into the woods, far away.",
        text(1, 1500),
    ]
    for prompt in turns:
        want, _, _ = await run(whole, prompt, max_tokens=24, logprobs=2)
        for engine in chunked:
            got, _, _ = await run(engine, prompt, max_tokens=24, logprobs=2)
            assert got == want, (engine.prefill_chunk_tokens, prompt[:40])
    for engine in chunked:
        # the same prefix hits (blocks registered chunk by chunk), the same tokens computed
        assert engine.prefix_hit_tokens == whole.prefix_hit_tokens > 0
        assert engine.prefill_computed_tokens == whole.prefill_computed_tokens
        assert engine.kv_used_tokens == 0
    # a 1,500-token prompt in chunks of 16: that many forwards, none of them whole
    assert chunked[0].prefill_steps_total >= 1500 // 16
    # seeded sampling draws the same tokens too
    want, _, _ = await run(whole, turns[1], max_tokens=8, temperature=0.9, seed=5)
    assert (await run(chunked[1], turns[1], max_tokens=8, temperature=0.9, seed=5))[0] == want


async def test_a_recomputed_hand_off_replays_its_forced_tokens_chunked(make_engine: Any) -> None:
    """A generation leg without KV recomputes prompt + forced[:-1] in chunks; the forced tokens'
    logprobs come from rows that span chunk boundaries."""
    whole = started(make_engine(prefill_chunk_tokens=0))
    chunked = started(make_engine(prefill_chunk_tokens=8))
    want, _, _ = await run(whole, PROMPT, max_tokens=20)
    results = []
    for engine in (whole, chunked):
        req, queue = make_request(engine, PROMPT, max_tokens=20, logprobs=1)
        req.forced_tokens = want[:12]
        engine.submit(req)
        deltas = await collect(queue)
        results.append(deltas)
    tokens = [[t for d in ds for t in d.token_ids] for ds in results]
    assert tokens[0] == tokens[1] == want
    lps = [[lp.logprob for d in ds for lp in d.logprobs] for ds in results]
    assert np.allclose(lps[0], lps[1], atol=1e-4)


async def collect(queue: asyncio.Queue[Delta]) -> list[Delta]:
    deltas = []
    while True:
        d = await asyncio.wait_for(queue.get(), 60)
        deltas.append(d)
        if d.finish_reason:
            return deltas


@pytest.mark.parametrize("chunk", [0, 64])
async def test_running_streams_decode_while_a_whole_context_prompt_prefills(
    make_engine: Any, chunk: int
) -> None:
    """Deterministic: everything is queued before the engine starts (the streams first), and the
    deltas reach the loop in the order the engine made them, so the streams' tokens before the
    long prompt's first one count the steps it let them take."""
    engine = make_engine(prefill_chunk_tokens=chunk)
    order: list[str] = []
    done = asyncio.Event()

    def submit(name: str, prompt: str, max_tokens: int) -> EngineRequest:
        req, _ = make_request(engine, prompt, max_tokens=max_tokens)

        def on_delta(delta: Delta) -> None:
            if delta.token_ids:
                order.append(name)
            if name == "long" and delta.token_ids:
                done.set()

        req.on_delta = on_delta
        engine.submit(req)
        return req

    streams = [submit(f"s{i}", text(i, 20), 600) for i in range(4)]
    submit("long", text(9, engine.max_context - 8), 4)
    started(engine)
    await asyncio.wait_for(done.wait(), 60)
    for req in streams:
        engine.abort(req.request_id)
    steps = order.index("long") // len(streams)  # the streams' tokens before the long prompt's first
    if chunk:
        # each step's budget: 64 tokens less the 4 decodes, so ~34 steps of ~60 tokens
        assert steps >= (engine.max_context - 8) // 60 - 2, order
    else:
        # the streams' first tokens, then one decode step beside the whole prefill: they stopped for it
        assert steps == 2, order


async def test_the_context_roles_first_token_and_parked_kv_are_unchanged(make_engine: Any) -> None:
    parked = []
    prompt = text(3, 700)
    for engine in (
        started(make_engine(prefill_chunk_tokens=0)),
        started(make_engine(prefill_chunk_tokens=50)),
    ):
        req, queue = make_request(engine, prompt)
        req.park_as = 5
        engine.submit(req)
        deltas = await collect(queue)
        assert deltas[-1].finish_reason == "not_finished"
        entry = engine.take_parked(5)
        assert entry is not None and entry.num_tokens == req.prompt_ids.size
        parked.append((entry.first_token, *engine.read_parked(entry)))
        assert engine.kv_used_tokens == 0
    (t0, k0, v0), (t1, k1, v1) = parked
    assert t0 == t1
    torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-4)


async def test_waiting_prompts_share_one_forward_and_match_their_unbatched_text(make_engine: Any) -> None:
    lengths = [30, 75, 12, 140, 51, 300]
    alone = started(make_engine(prefill_chunk_tokens=0, prefill_tokens_per_step=1))  # one prompt a forward
    want = [(await run(alone, text(i, n), max_tokens=12))[0] for i, n in enumerate(lengths)]
    assert alone.prefill_steps_total == len(lengths)
    for chunk in (0, 256):
        engine = make_engine(prefill_chunk_tokens=chunk)
        queued = [make_request(engine, text(i, n), max_tokens=12) for i, n in enumerate(lengths)]
        for req, _ in queued:
            engine.submit(req)  # all waiting before the engine starts: one plan sees them all
        started(engine)
        got = [[t for d in await collect(q) for t in d.token_ids] for _, q in queued]
        assert got == want, chunk
        # whole: all six in one forward; chunks: 614 tokens at 250 to 256 a step, 3 forwards
        assert engine.prefill_steps_total == (1 if chunk == 0 else 3), chunk


def steps_to_first_tokens(engine: TorchEngine, prompts: list[tuple[str, int]]) -> tuple[list[int], list[str]]:
    """Drives ``engine``'s loop by hand, one step at a time (no thread, no clock): each prompt is
    submitted before the step its ``at`` names; the step each got its first token at, and its text.
    Every step a cut prompt waits in, the oldest prefilling prompt must have progressed."""
    firsts: dict[int, int] = {}
    texts = [""] * len(prompts)
    which: dict[str, int] = {}
    steps = 0
    with torch.inference_mode():
        while len(firsts) < len(prompts) or engine._running or engine._prefilling:
            for i, (prompt, at) in enumerate(prompts):
                if at == steps:
                    req, _ = make_request(engine, prompt, max_tokens=4)
                    which[req.request_id] = i
                    engine.submit(req)
            oldest = engine._prefilling[0] if engine._prefilling else None
            before = oldest.req.cached_len if oldest else 0
            outputs = step_by_hand(engine)
            if oldest is not None:  # fairness: the oldest prompt goes on at every step it waits in
                assert oldest.req.cached_len > before, steps
            for req, delta in outputs:
                texts[which[req.request_id]] += delta.text
                if delta.token_ids:
                    firsts.setdefault(which[req.request_id], steps)
            steps += 1
            assert steps < 500
    return [firsts[i] for i in range(len(prompts))], texts


async def test_a_short_prompt_gets_its_first_token_while_a_long_one_is_still_prefilling(
    make_engine: Any,
) -> None:
    """Head-of-line: a 50-token prompt arriving while a 2,040-token one is prefilled in 128-token
    steps runs beside it (whole, in the budget the oldest's guaranteed half leaves), not after its
    whole prefill (before: step 16, after the long prompt's 15); both texts are their solo runs'."""
    long, short = text(1, 2040), text(2, 50)
    solo = started(make_engine(prefill_chunk_tokens=64))
    want = [(await run(solo, p, max_tokens=4))[2] for p in (long, short)]
    engine = make_engine(prefill_chunk_tokens=128)
    firsts, texts = steps_to_first_tokens(engine, [(long, 0), (short, 1)])
    assert firsts[1] == 1 < firsts[0], firsts  # the short one's first token in the step it arrived
    assert texts == ["".join(d.text for d in w) for w in want]
    # a burst of short ones behind the long one all go early, in arrival order among themselves
    engine = make_engine(prefill_chunk_tokens=128)
    firsts, _ = steps_to_first_tokens(engine, [(long, 0), *((text(i, 20), i) for i in range(3, 8))])
    assert firsts[1:] == sorted(firsts[1:]) and firsts[-1] < firsts[0], firsts


def test_the_shared_plan_keeps_the_oldest_share_and_fits_later_whole_prompts() -> None:
    from types import SimpleNamespace

    from server.worker.prefill_pacer import shared_chunks

    def prompt(total: int, done: int = 0) -> Any:
        return SimpleNamespace(total=total, req=SimpleNamespace(cached_len=done, cached_prefix=0))

    def plan(*prompts: Any, budget: int = 128, paced: int = 128) -> list[tuple[int, int]]:
        return [(prompts.index(p), t) for p, t in shared_chunks(list(prompts), budget, paced, 16)]

    long = prompt(2040, 128)
    assert plan(long) == [(0, 128)]  # alone: the whole budget, as before
    assert plan(long, prompt(50)) == [(1, 50), (0, 78)]  # the short one whole, before the cut one
    # the oldest keeps half; a later prompt too big for the rest waits, a smaller one after it goes
    assert plan(long, prompt(70), prompt(30), prompt(40)) == [(2, 30), (0, 98)]
    assert plan(long, prompt(60), prompt(4)) == [(1, 60), (2, 4), (0, 64)]
    # beside decodes the pacer's tokens bound the cut one, its share at least a block
    assert plan(long, prompt(50), paced=16) == [(1, 50), (0, 16)]
    # a started prompt is never the whole-prompt kind, and the oldest's last chunk is not cut
    assert plan(long, prompt(60, 10)) == [(0, 128)]
    assert plan(prompt(300, 250), prompt(20), prompt(2000)) == [(0, 50), (1, 20), (2, 58)]
    assert plan(prompt(300, 250), prompt(20), prompt(2000), prompt(8)) == [(0, 50), (1, 20), (3, 8), (2, 50)]


async def test_a_bad_prompt_in_a_shared_forward_fails_alone(make_engine: Any) -> None:
    engine = make_engine(prefill_chunk_tokens=0)
    good, good_q = make_request(engine, PROMPT, max_tokens=8)
    bad, bad_q = make_request(engine, "x")
    bad.prompt_ids = np.asarray([1, 5000], dtype=np.int32)  # past the embedding table
    engine.submit(bad)
    engine.submit(good)
    started(engine)
    delta = (await collect(bad_q))[-1]
    assert delta.finish_reason == "error" and "prefill failed" in (delta.error or "")
    tokens = [t for d in await collect(good_q) for t in d.token_ids]
    assert tokens == (await run(engine, PROMPT, max_tokens=8))[0] and len(tokens) == 8
    assert engine.engine_errors_total == 1 and engine.kv_used_tokens == 0


async def test_a_prompt_cancelled_between_its_chunks_frees_its_blocks(make_engine: Any) -> None:
    import threading

    engine = make_engine(prefill_chunk_tokens=16)
    model = engine.model
    real = model.forward_step
    calls: list[int] = []
    gate = threading.Event()

    def gated(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the engine thread holds here in its second chunk until the abort
            gate.wait(30)
        return real(*args, **kwargs)

    model.forward_step = gated  # type: ignore[method-assign]
    started(engine)
    req, queue = make_request(engine, text(4, 1800), max_tokens=4)
    engine.submit(req)
    for _ in range(3000):
        if len(calls) >= 2:
            break
        await asyncio.sleep(0.01)
    assert req.cached_len == 16 and engine.kv_used_tokens > 0  # one chunk in, 111 to go
    engine.abort(req.request_id)
    gate.set()
    for _ in range(1000):
        if engine.kv_used_tokens == 0 and engine.queue_depth == 0:
            break
        await asyncio.sleep(0.01)
    del model.forward_step
    assert engine.kv_used_tokens == 0 and engine.queue_depth == 0 and engine.running == 0
    assert queue.empty() and len(calls) == 2  # no token, and no chunk after the abort
    assert (await run(engine, "still alive", max_tokens=3))[1] == "length"


def test_a_negative_chunk_is_refused(tiny: Any) -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be >= 0"):
        TorchEngine(*tiny, kv_tokens=256, prefill_chunk_tokens=-1)


def test_the_worker_flags_reach_the_engine_and_refuse_bad_values(capsys: Any) -> None:
    import argparse

    from server.worker import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--prefill-chunk-tokens", "96", "--prefill-step-ratio", "3", "--kv-tokens", "4096"]
    )
    engine, _, _ = cli.build_engine(args)
    assert engine.prefill_chunk_tokens == 96 and engine.pacer.ratio == 3.0 and engine.pacer.max_tokens == 96
    engine.stop()
    engine, _, _ = cli.build_engine(parser.parse_args(["--prefill-step-ratio", "0", "--kv-tokens", "4096"]))
    assert engine.pacer.ratio == 0.0
    engine.stop()
    for flag, value, message in (
        ("--prefill-chunk-tokens", "-5", "--prefill-chunk-tokens: must be >= 0, got -5"),
        ("--prefill-step-ratio", "1", "--prefill-step-ratio: must be > 1 (0: off), got 1"),
        ("--prefill-step-ratio", "nan", "--prefill-step-ratio: must be > 1 (0: off), got nan"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([flag, value])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


async def test_streams_and_a_prompt_sharing_forwards_give_their_text_alone(make_engine: Any) -> None:
    """Decode rows and prefill chunks in one forward: each sequence's text is what it gets alone."""
    alone = started(make_engine(prefill_chunk_tokens=0))
    stream_prompts = [text(i, 15 + 9 * i) for i in range(3)]
    want = [(await run(alone, p, max_tokens=60))[0] for p in stream_prompts]
    want_long = (await run(alone, text(7, 1200), max_tokens=6))[0]
    engine = make_engine(prefill_chunk_tokens=48)
    forwards = []
    model = engine.model
    real = model.forward_step
    model.forward_step = lambda *a, **kw: forwards.append(1) or real(*a, **kw)  # type: ignore[method-assign]
    # all queued before the engine starts: the streams' prompts first, so they decode (60 steps)
    # while the long prompt's ~26 chunks run
    queued = [make_request(engine, p, max_tokens=60) for p in stream_prompts]
    long, long_q = make_request(engine, text(7, 1200), max_tokens=6)
    for req, _ in [*queued, (long, long_q)]:
        engine.submit(req)
    started(engine)
    got_long = [t for d in await collect(long_q) for t in d.token_ids]
    got = [[t for d in await collect(q) for t in d.token_ids] for _, q in queued]
    assert got == want and got_long == want_long
    del model.forward_step  # the class's again
    # the long prompt's chunks rode on the streams' decode steps: fewer forwards than steps of each
    assert engine.prefill_steps_total >= 1200 // 48
    assert len(forwards) <= engine.decode_steps_total + engine.prefill_steps_total - 1200 // 48 + 1


async def test_a_bad_prompt_sharing_a_forward_with_running_streams_fails_alone(make_engine: Any) -> None:
    """Both queued before the engine starts: step 1 prefills the stream's prompt and the bad prompt's
    first (good) chunk; step 2 is the stream's decode beside the bad chunk, which fails."""
    engine = make_engine(prefill_chunk_tokens=64)
    req, queue = make_request(engine, "hi", max_tokens=30)
    bad, bad_q = make_request(engine, "x")
    bad.prompt_ids = np.asarray([1] * 100 + [5000], dtype=np.int32)  # past the embedding table at 100
    engine.submit(req)
    engine.submit(bad)
    started(engine)
    delta = (await collect(bad_q))[-1]
    assert delta.finish_reason == "error" and "prefill failed" in (delta.error or "")
    assert bad.cached_len == 61  # its first chunk ran (beside the stream's prompt), its second failed
    got = [t for d in await collect(queue) for t in d.token_ids]
    assert got == (await run(engine, "hi", max_tokens=30))[0]
    assert engine.engine_errors_total == 1 and engine.kv_used_tokens == 0


async def test_served_disaggregated_chunked_equals_a_whole_prefill_single_worker() -> None:
    """Through the HTTP workers: a context worker prefilling in chunks of 16 hands off KV (and its
    first token) from which a chunked generation worker continues the text a single worker with
    whole prefills gives; a second turn extending the first hits the context worker's prefix cache."""
    import aiohttp
    from tiny_workers import tiny_worker

    torch.set_num_threads(1)
    single = await tiny_worker("both")
    single.engine.prefill_chunk_tokens = 0
    ctx_worker = await tiny_worker("context", kv_ttl_s=30.0)
    gen_worker = await tiny_worker("generation", kv_fetch_timeout_s=5.0)
    for worker in (ctx_worker, gen_worker):
        worker.engine.prefill_chunk_tokens = 16
    try:
        async with aiohttp.ClientSession() as http:

            async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            first = text(5, 600)
            for prompt in (first, first + " and a second turn that extends the first one"):
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 20,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                want = (await post(single.url, body))["choices"][0]["text"]
                params = {"request_type": "context_only", "disagg_request_id": 7205759403792793601}
                ctx = await post(ctx_worker.url, {**body, "disaggregated_params": params})
                assert ctx["choices"][0]["finish_reason"] == "not_finished"
                gen_params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only",
                              "ctx_usage": ctx["usage"]}  # fmt: skip
                gen = await post(gen_worker.url, {**body, "prompt": ctx["prompt_token_ids"],
                                                  "disaggregated_params": gen_params})  # fmt: skip
                assert gen["choices"][0]["text"] == want
            assert ctx_worker.engine.prefix_hit_tokens >= 512
            assert ctx_worker.engine.prefill_steps_total >= 600 // 16
    finally:
        for worker in (single, ctx_worker, gen_worker):
            await worker.server.cleanup()


# -- pacing: a step with chunks within prefill_step_ratio x a decode-only step -------------------


def test_the_pacer_shrinks_at_once_grows_gradually_and_stays_in_bounds() -> None:
    from server.worker.prefill_pacer import PrefillPacer

    pacer = PrefillPacer(512, 16, 1.5)
    assert pacer.budget(decoding=True) == 16  # from min_tokens up
    pacer.mixed_step(0.100, [(0, 16)])  # no decode-only step known: nothing to compare with
    assert pacer.budget(decoding=True) == 16
    pacer.allowance = pacer.work(0, 512)
    pacer.decode_step(0.002)
    pacer.mixed_step(0.042, [(0, 512)])  # the chunk took 40 ms; it may take 1 ms
    assert pacer.allowance == pytest.approx(pacer.work(0, 512) / 40)
    assert pacer.budget(decoding=True) == 16  # 15.9 tokens fit: the floor, a block
    assert pacer.budget(True, 16_000) == 16  # a block deep in too
    assert pacer.budget(decoding=False) == 512  # nobody decoding: the whole budget
    pacer.mixed_step(0.0021, [(0, 16)])  # far within: grows, but at most 1.5x the step's work
    assert pacer.allowance == pytest.approx(1.5 * pacer.work(0, 16))
    assert pacer.budget(decoding=True) == 23  # 24 tokens' work is a little more (attention grows)
    for _ in range(30):
        pacer.mixed_step(0.0021, [(0, pacer.budget(decoding=True))])
    assert pacer.budget(decoding=True) == 512  # never past the token budget
    pacer.decode_step(0.004)  # a running average: 2 ms + 0.2 * 2 ms
    assert pacer.decode_s == pytest.approx(0.0024)
    off = PrefillPacer(512, 16, 0.0)
    off.decode_step(0.002)
    off.mixed_step(1.0, [(0, 512)])
    assert off.budget(decoding=True) == 512
    for bad in (1.0, 0.5, -2.0, float("nan")):
        with pytest.raises(ValueError, match="prefill step ratio must be > 1"):
            PrefillPacer(512, 16, bad)


def test_the_pacer_sizes_chunks_by_their_cost_not_their_tokens() -> None:
    """Chunk time as tokens x (1 + attended positions / 700) (a shape the pacer does not know
    exactly): an allowance measured at the start of one prompt, taken deep into another (a prefix
    hit 12k in) or along a 16k prompt, keeps each step within its time; with a token allowance the
    deep chunk took the shallow one's token count, ~13x its time."""
    from server.worker.prefill_pacer import PrefillPacer

    decode_s, unit_s = 0.001, 5e-6
    may_take = 0.5 * decode_s  # ratio 1.5

    def chunk_s(start: int, tokens: int) -> float:
        return unit_s * tokens * (1 + (start + tokens / 2) / 700)

    pacer = PrefillPacer(512, 1, 1.5)
    pacer.decode_step(decode_s)
    for _ in range(40):  # the start of a prompt: the allowance settles
        t = pacer.budget(True, 0)
        pacer.mixed_step(decode_s + chunk_s(0, t), [(0, t)])
    shallow = pacer.budget(True, 0)
    assert chunk_s(0, shallow) <= may_take * 1.05
    deep = pacer.budget(True, 12_000)
    # off by the shapes' difference only (1,024 assumed, 700 true), then measured
    assert deep < shallow / 8 and chunk_s(12_000, deep) <= may_take * 1.5
    assert chunk_s(12_000, shallow) > 10 * may_take  # what a token allowance would have run
    pos, over, sizes = 0, [], []
    while pos < 16_384:
        t = min(pacer.budget(True, pos), 16_384 - pos)
        took = chunk_s(pos, t)
        pacer.mixed_step(decode_s + took, [(pos, t)])
        over.append(took / may_take)
        sizes.append(t)
        pos += t
    assert max(over[5:]) <= 1.5  # within the growth bound at worst, at every depth
    assert min(sizes) >= 1 and sizes[-2] < 16  # deep in, fewer than a block a step (floor 1 here)


async def test_a_paced_engine_takes_smaller_chunks_beside_slow_decodes_and_the_same_text(
    make_engine: Any,
) -> None:
    """Each forward made to cost 0.1 ms per token on top of 2 ms on the pacer's clock (a fake one:
    deterministic): a 500-token chunk takes 26x a decode step of 4 streams, so the pacer cuts chunks
    to a block; the text is unchanged."""
    alone = started(make_engine(prefill_chunk_tokens=0))
    want = (await run(alone, text(8, 900), max_tokens=4))[0]
    engine = make_engine(prefill_chunk_tokens=512, prefill_step_ratio=1.5)
    model = engine.model
    real = model.forward_step
    sizes: list[int] = []
    now = [0.0]
    engine.pacer.clock = lambda: now[0]

    def slow(ids: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(int(ids.numel()))
        now[0] += 0.002 + 0.0001 * ids.numel()
        return real(ids, *args, **kwargs)

    model.forward_step = slow  # type: ignore[method-assign]
    streams = [make_request(engine, text(i, 10), max_tokens=1500) for i in range(4)]
    for req, _ in streams:
        engine.submit(req)
    started(engine)
    for _, queue in streams:
        await asyncio.wait_for(queue.get(), 30)  # decoding; decode-only steps measured
    while engine.pacer.decode_s is None:
        await asyncio.sleep(0.01)
    got = (await run(engine, text(8, 900), max_tokens=4))[0]
    for req, _ in streams:
        engine.abort(req.request_id)
    del model.forward_step
    assert got == want
    # small chunks from the first on: 900 tokens in many steps
    assert max(sizes) < 128 and engine.pacer.allowance < 128, sizes
    assert sum(1 for n in sizes if n > 8) >= 900 // 128, sizes


async def test_a_burst_of_short_prompts_goes_whole_and_only_a_cut_prompt_is_paced(make_engine: Any) -> None:
    """Six 60-token prompts and a 900-token one arrive together beside 4 decoding streams (queued
    while the engine thread is held in a forward, so one step sees them all): the six go whole in
    the next step, the long one then follows in paced chunks."""
    import threading

    engine = make_engine(prefill_chunk_tokens=512, prefill_step_ratio=1.5)
    model = engine.model
    real = model.forward_step
    sizes: list[int] = []
    now = [0.0]
    engine.pacer.clock = lambda: now[0]
    hold, held, release = threading.Event(), threading.Event(), threading.Event()

    def slow(ids: Any, *args: Any, **kwargs: Any) -> Any:
        if hold.is_set() and not release.is_set():
            held.set()
            release.wait(30)
        sizes.append(int(ids.numel()))
        now[0] += 0.002 + 0.0001 * ids.numel()
        return real(ids, *args, **kwargs)

    model.forward_step = slow  # type: ignore[method-assign]
    streams = [make_request(engine, text(i, 10), max_tokens=1500) for i in range(4)]
    for req, _ in streams:
        engine.submit(req)
    started(engine)
    for _, queue in streams:
        await asyncio.wait_for(queue.get(), 30)
    while engine.pacer.decode_s is None:
        await asyncio.sleep(0.01)
    hold.set()
    while not held.is_set():
        await asyncio.sleep(0.001)
    before = len(sizes)
    shorts = [make_request(engine, text(10 + i, 59), max_tokens=2) for i in range(6)]
    long, long_q = make_request(engine, text(20, 900), max_tokens=2)
    for req, _ in [*shorts, (long, long_q)]:
        engine.submit(req)
    release.set()
    await collect(long_q)
    for _, queue in shorts:
        await collect(queue)
    for req, _ in streams:
        engine.abort(req.request_id)
    del model.forward_step
    after = sizes[before + 1 :]  # the held forward was the streams' own decode step
    assert after[0] == 4 + sum(int(r.prompt_ids.size) for r, _ in shorts), sizes  # 6 x 60 whole
    assert len(after) > 900 // 128 and max(after[1:]) < 128, sizes  # then the long one, paced
