"""The engine without HTTP: sampling, cancellation, parking, error isolation; the KV wire format."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import torch
from engines import make_request, run

from server.worker.engine import EngineRequest, TorchEngine, prompt_checksum
from server.worker.kv_cache import KVCacheFull
from server.worker.kv_transfer import KVLayout, KVTransferError, decode_kv, encode_kv
from server.worker.output import TokenLogprob
from server.worker.tiny import build_tiny


@pytest.fixture
def engine() -> Any:
    torch.set_num_threads(1)
    config, model, tokenizer = build_tiny()
    eng = TorchEngine(config, model, tokenizer, kv_tokens=1024)
    yield eng
    eng.stop()


async def test_sampling_controls(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    greedy, reason, _ = await run(engine, "sampling")
    assert reason == "length" and len(greedy) == 16
    assert (await run(engine, "sampling", temperature=1.5, top_k=1))[0] == greedy
    assert (await run(engine, "sampling", temperature=1.5, top_p=1e-6))[0] == greedy
    seeded = (await run(engine, "sampling", temperature=1.5, seed=11))[0]
    assert seeded != greedy
    assert (await run(engine, "sampling", temperature=1.5, seed=11))[0] == seeded
    assert (await run(engine, "sampling", temperature=1.5, seed=12))[0] != seeded
    # top_k=3 only ever picks one of the three most likely tokens: check against the logprobs.
    tokens, _, deltas = await run(engine, "sampling", temperature=2.0, top_k=3, seed=5, logprobs=3)
    assert len(tokens) == 16 and tokens != greedy
    for d in deltas:
        for lp in d.logprobs:
            assert lp.token_id in [t for t, _ in lp.top]
            assert lp.logprob <= 0 and len(lp.top) == 3


async def test_abort_frees_blocks_before_the_next_step(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    req, queue = make_request(engine, "long", max_tokens=900)
    engine.submit(req)
    await asyncio.wait_for(queue.get(), 30)
    assert engine.kv_used_tokens > 0
    engine.abort(req.request_id)
    for _ in range(500):
        if engine.kv_used_tokens == 0 and engine.running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.kv_used_tokens == 0 and engine.running == 0
    assert engine.generated_tokens_total < 900


async def test_admission_refuses_what_does_not_fit(engine: TorchEngine) -> None:
    req, _ = make_request(engine, "big", max_tokens=1000)
    engine.submit(req)  # 1000 + prompt of 1024: fits, not yet started
    other, _ = make_request(engine, "more", max_tokens=100)
    with pytest.raises(KVCacheFull):
        engine.submit(other)
    engine.abort(req.request_id)


async def test_a_failing_request_does_not_stop_the_loop(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    bad, queue = make_request(engine, "x")
    bad.prompt_ids = np.asarray([1, 5000], dtype=np.int32)  # past the embedding table
    engine.submit(bad)
    delta = await asyncio.wait_for(queue.get(), 30)
    assert delta.finish_reason == "error" and "prefill failed" in (delta.error or "")
    assert engine.engine_errors_total == 1 and engine.kv_used_tokens == 0
    tokens, reason, _ = await run(engine, "still alive")
    assert reason == "length" and len(tokens) == 16


async def test_context_leg_parks_kv_that_expires(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    req, queue = make_request(engine, "park me")
    req.park_as = 42
    engine.submit(req)
    first = await asyncio.wait_for(queue.get(), 30)
    last = await asyncio.wait_for(queue.get(), 30)
    assert len(first.token_ids) == 1 and last.finish_reason == "not_finished"
    assert engine.parked_count == 1 and engine.kv_used_tokens > 0
    assert engine.expire_parked(now=0.0) == 0
    assert engine.expire_parked(now=float("inf")) == 1
    assert engine.parked_count == 0 and engine.kv_used_tokens == 0 and engine.take_parked(42) is None


async def park(engine: TorchEngine, prompt: str, ctx_id: int) -> EngineRequest:
    req, queue = make_request(engine, prompt)
    req.park_as = ctx_id
    engine.submit(req)
    while (await asyncio.wait_for(queue.get(), 30)).finish_reason is None:
        pass
    return req


async def test_an_aborted_context_leg_is_freed_whenever_it_parks(engine: TorchEngine) -> None:
    """abort then discard_parked frees the KV before the park, during it, or after it."""
    engine.start(asyncio.get_running_loop())
    # After: parked already (abort finds nothing running), discard frees it.
    req = await park(engine, "parked before the abort", 1)
    assert engine.parked_count == 1 and engine.parked_tokens == engine.kv_used_tokens > 0
    engine.abort(req.request_id)
    assert engine.discard_parked(1) and not engine.discard_parked(1)
    assert engine.parked_count == 0 and engine.parked_tokens == 0 and engine.kv_used_tokens == 0
    # Before: aborted as soon as it is queued, the leg is never parked, whichever
    # point of its prefill the engine thread had reached.
    for i in range(20):
        req, _ = make_request(engine, "aborted early " * (1 + i % 5))
        req.park_as = 100 + i
        engine.submit(req)
        await asyncio.sleep(0.001 * (i % 4))
        engine.abort(req.request_id)
        engine.discard_parked(100 + i)
        for _ in range(1000):
            if engine.kv_used_tokens == 0 and engine.queue_depth == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.kv_used_tokens == 0 and engine.parked_count == 0 and engine.parked_tokens == 0, i


async def test_evict_parked_takes_the_oldest_first(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    for ctx_id in (1, 2, 3):
        await park(engine, f"entry {ctx_id} " * 10, ctx_id)
    held = engine.parked_tokens
    assert held == engine.kv_used_tokens and engine.parked_count == 3
    assert engine.evict_parked(0) == 0
    assert engine.evict_parked(1) == 1  # one token to free: one entry, the oldest
    assert engine.take_parked(1) is None and engine.parked_count == 2
    assert engine.evict_parked(held) == 2  # more than is held: all that is left
    assert engine.parked_count == 0 and engine.parked_tokens == 0 and engine.kv_used_tokens == 0
    assert engine.evict_parked(16) == 0


async def test_evict_parked_spares_entries_parked_after_a_time(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    await park(engine, "old " * 10, 1)
    cut = time.monotonic()
    await park(engine, "new " * 10, 2)
    held = engine.parked_tokens
    assert engine.evict_parked(held, parked_before=cut) == 1  # the old one only, though more was asked
    assert engine.take_parked(1) is None and engine.parked_count == 1
    assert engine.evict_parked(held, parked_before=cut) == 0
    assert engine.evict_parked(held) == 1  # no bound: it goes too
    assert engine.kv_used_tokens == 0


async def test_parked_kv_round_trips_and_continues_like_one_engine(engine: TorchEngine) -> None:
    engine.start(asyncio.get_running_loop())
    whole, _, _ = await run(engine, "hand me off", max_tokens=12)
    req, queue = make_request(engine, "hand me off", max_tokens=12)
    req.park_as = 7
    engine.submit(req)
    await asyncio.wait_for(queue.get(), 30)
    await asyncio.wait_for(queue.get(), 30)
    parked = engine.take_parked(7)
    assert parked is not None and parked.first_token == whole[0]
    k, v = engine.read_parked(parked)
    assert engine.kv_used_tokens == 0
    body = b"".join(bytes(p) for p in encode_kv(k, v, prompt_crc32=parked.prompt_crc32,
                                                first_token=parked.first_token, first_logprob=None))  # fmt: skip
    payload = decode_kv(
        body, engine.kv_layout, num_tokens=parked.num_tokens, prompt_crc32=prompt_checksum(req.prompt_ids)
    )
    cont, queue = make_request(engine, "hand me off", max_tokens=12)
    cont.forced_tokens = [payload.first_token]
    cont.kv_import = (payload.k, payload.v)
    engine.submit(cont)
    tokens = []
    while True:
        d = await asyncio.wait_for(queue.get(), 30)
        tokens += d.token_ids
        if d.finish_reason:
            break
    assert tokens == whole


# ---------------------------------------------------------------- wire format

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def encoded(tokens: int = 3, dtype: torch.dtype = torch.float32, **kw: Any) -> bytes:
    k = torch.arange(2 * tokens * 2 * 4, dtype=torch.float32).view(2, tokens, 2, 4).to(dtype)
    args: dict[str, Any] = {"prompt_crc32": 99, "first_token": 5, "first_logprob": None, **kw}
    return b"".join(bytes(p) for p in encode_kv(k, -k, **args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_format_round_trip(dtype: torch.dtype) -> None:
    layout = KVLayout(2, 2, 4, dtype)
    lp = TokenLogprob(5, -0.25, [(5, -0.25), (9, -2.0)])
    payload = decode_kv(encoded(dtype=dtype, first_logprob=lp), layout, num_tokens=3, prompt_crc32=99)
    assert payload.k.dtype == dtype and payload.k.shape == (2, 3, 2, 4)
    assert torch.equal(payload.v, -payload.k) and float(payload.k[1, 2, 1, 3]) == 47.0
    assert payload.first_token == 5 and payload.first_logprob == lp


def _with_header(header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack("<4sHHI", b"FCKV", 1, 0, len(header)) + header + payload


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"FCKV", "shorter than its 12-byte prefix"),
        (b"PKL0" + encoded()[4:], "starts with b'PKL0'"),
        (encoded()[:4] + b"\x02\x00" + encoded()[6:], "version 2 is not supported"),
        (struct.pack("<4sHHI", b"FCKV", 1, 0, 1 << 20), "exceeds 65536"),
        (_with_header(b"{bad"), "not JSON"),
        (_with_header(b"[1]"), "not a JSON object"),
        (encoded()[:40], "ends inside its header"),
        (encoded(tokens=4), "num_tokens is 4, this worker expects 3"),
        (encoded(prompt_crc32=1), "prompt_crc32 is 1, this worker expects 99"),
        (encoded(dtype=torch.float16), "dtype is 'float16'"),
        (encoded()[:-4], "payload is 380 bytes, expected 384"),
        (encoded() + b"\0" * 4, "payload is 388 bytes, expected 384"),
    ],
    ids=lambda case: case if isinstance(case, str) else "",
)
def test_kv_format_rejects(body: bytes, message: str) -> None:
    with pytest.raises(KVTransferError, match=message.replace("[", r"\[").replace("(", r"\(")):
        decode_kv(body, LAYOUT, num_tokens=3, prompt_crc32=99)


def test_kv_format_rejects_a_bad_logprob_and_layout() -> None:
    good = encoded()
    header_len = struct.unpack_from("<I", good, 8)[0]
    header = good[12 : 12 + header_len].replace(b'"first_logprob":null', b'"first_logprob":[1]')
    with pytest.raises(KVTransferError, match="first_logprob is malformed"):
        decode_kv(_with_header(header, good[12 + header_len :]), LAYOUT, num_tokens=3, prompt_crc32=99)
    with pytest.raises(KVTransferError, match="num_layers is 2, this worker expects 3"):
        decode_kv(good, KVLayout(3, 2, 4, torch.float32), num_tokens=3, prompt_crc32=99)


def test_decode_rate_over_the_last_five_seconds(engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokens_per_second: the tokens of the steps of the last 5 s over the time they span (a
    running sum the steps that leave the window come off: it was summed anew each step)."""
    import server.worker.engine as engine_module

    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: clock[0])
    for at, n in ((0.0, 10), (1.0, 20), (2.0, 30), (3.0, 40)):
        clock[0] = at
        engine._count_tokens(n)
    assert engine.tokens_per_second == pytest.approx(100 / 3)
    clock[0] = 6.0
    engine._count_tokens(50)  # the step at 0 s leaves the window
    assert engine.tokens_per_second == pytest.approx(140 / 5)
    for i in range(1, 2001):  # 20 s of steps 10 ms apart, 32 tokens each
        clock[0] = 6.0 + i / 100
        engine._count_tokens(32)
    assert engine.tokens_per_second == pytest.approx(501 * 32 / 5)
    assert engine.generated_tokens_total == 150 + 2000 * 32


def test_greedy_sampling_picks_torchs_argmax_without_it(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU step's greedy rows: numpy's argmax (torch's CPU kernel cost ~10 us at 32 x 262 and
    ~870 at 32 x 32k), the index torch's gives (the first of tied maxima, of infinities, the first
    NaN); a batch found all greedy is remembered (a prompt's first token sampled alone does not
    replace it), and a row that asks for more (logprobs, sampling) in a later batch of the same
    size is served as one."""
    logits = torch.randn(6, engine.vocab_size)
    logits[1, 3] = logits[1, 7] = logits[1].max() + 1  # a tie
    logits[2, 5] = logits[2, 9] = float("inf")
    logits[3, 4] = logits[3, 8] = float("nan")
    logits[4] = float("-inf")
    expected = logits.argmax(-1).tolist()
    reqs = [make_request(engine, f"r{i}")[0] for i in range(6)]

    def no_torch_argmax(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch's argmax on CPU")

    monkeypatch.setattr(torch.Tensor, "argmax", no_torch_argmax)
    with torch.inference_mode():
        assert engine.sampler.sample(logits, reqs) == [(t, None) for t in expected]
        assert engine.sampler.sample(logits, reqs) == [(t, None) for t in expected]  # remembered
        assert engine.sampler.sample(logits[:1], reqs[:1]) == [(expected[0], None)]  # a first token
        remembered = engine.sampler._greedy_batch
        assert list(map(id, remembered)) == list(map(id, reqs))  # ... leaves them remembered
        other = make_request(engine, "lp", logprobs=2)[0]
        sampled = engine.sampler.sample(logits, [*reqs[:5], other])
    assert [t for t, _ in sampled] == expected
    assert [lp is None for _, lp in sampled] == [True] * 5 + [False]
    assert sampled[5][1] is not None and sampled[5][1].token_id == expected[5]
    monkeypatch.undo()
    graded = logits.clone().requires_grad_()  # outside inference mode (numpy refuses it): torch's
    assert engine.sampler.sample(graded, reqs) == [(t, None) for t in expected]


async def test_decode_keeps_its_attention_while_the_batch_stays_the_same(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams ending at different steps: each gives its text alone, and the decode attention
    (its K/V gathered from the pool) is built once: not at every step, nor again as streams end
    (the rest keep their rows)."""
    import server.worker.engine as engine_module

    built: list[int] = []

    class Counted(engine_module.DecodeAttention):  # type: ignore[name-defined,misc]
        def __init__(self, cache: Any, tables: list[list[int]], lengths: list[int]) -> None:
            built.append(len(tables))
            super().__init__(cache, tables, lengths)

    engine.start(asyncio.get_running_loop())
    lengths = (5, 12, 20, 30)
    alone = [(await run(engine, f"stream {i}", max_tokens=n))[0] for i, n in enumerate(lengths)]
    monkeypatch.setattr(engine_module, "DecodeAttention", Counted)
    steps = engine.decode_steps_total
    with engine._wake:  # all four admitted in one go: they prefill together and decode together
        together = [run(engine, f"stream {i}", max_tokens=n) for i, n in enumerate(lengths)]
        tasks = [asyncio.ensure_future(t) for t in together]
        await asyncio.sleep(0)
    results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == alone
    steps = engine.decode_steps_total - steps
    assert steps >= 29
    assert built == [4]


async def test_streams_joining_a_running_batch_keep_its_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts admitted together but prefilled over several steps (a 16-token step budget), so
    streams start decoding one or two at a time: the running batch's attention goes on as each
    joins (its row appended, only its K/V gathered: one build, not one per join), and every stream's
    greedy tokens are the ones it gives alone."""
    import server.worker.engine as engine_module

    config, model, tokenizer = build_tiny()
    engine = TorchEngine(config, model, tokenizer, kv_tokens=1024, prefill_chunk_tokens=16)
    engine.start(asyncio.get_running_loop())
    try:
        prompts = [f"join {i}" for i in range(4)]
        alone = [(await run(engine, p, max_tokens=12))[0] for p in prompts]
        built: list[int] = []

        class Counted(engine_module.DecodeAttention):  # type: ignore[name-defined,misc]
            def __init__(self, cache: Any, tables: list[list[int]], lengths: list[int]) -> None:
                built.append(len(tables))
                super().__init__(cache, tables, lengths)

        monkeypatch.setattr(engine_module, "DecodeAttention", Counted)
        with engine._wake:  # all four admitted in one go, their prefills spread over steps
            tasks = [asyncio.ensure_future(run(engine, p, max_tokens=12)) for p in prompts]
            await asyncio.sleep(0)
        results = await asyncio.gather(*tasks)
    finally:
        engine.stop()
    assert [r[0] for r in results] == alone
    assert len(built) == 1 and built[0] < 4  # built when the first started, the others joined it
