"""The Llama-family model against a forward pass written independently here, and its paged paths."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import torch
from engines import small_config

from server.worker.kv_cache import DecodeAttention, KVCacheFull, PagedKVCache, PrefillAttention
from server.worker.model import LlamaForCausalLM, ModelConfig, rope_inverse_frequencies
from server.worker.tiny import build_tiny

torch.manual_seed(0)


def random_model(config: ModelConfig, seed: int = 1) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def reference_logits(w: dict[str, torch.Tensor], c: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Plain tensor ops from the weights dict: no code shared with the model."""
    b, t = ids.shape
    nh, nkv, hd = c.num_attention_heads, c.kv_heads, c.dim_per_head

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps))

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    pos = torch.arange(t, dtype=torch.float64)
    freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angle = torch.outer(pos, freq)  # [t, hd/2]
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [b, heads, t, hd]; pairs (i, i + hd/2)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    h = w["model.embed_tokens.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = linear(x, p + "self_attn.q_proj").view(b, t, nh, hd).transpose(1, 2)
        k = linear(x, p + "self_attn.k_proj").view(b, t, nkv, hd).transpose(1, 2)
        v = linear(x, p + "self_attn.v_proj").view(b, t, nkv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.softmax(scores, -1) @ v
        h = h + linear(attn.transpose(1, 2).reshape(b, t, nh * hd), p + "self_attn.o_proj")
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = linear(x, p + "mlp.gate_proj")
        h = h + linear(gate * torch.sigmoid(gate) * linear(x, p + "mlp.up_proj"), p + "mlp.down_proj")
    h = rms(h, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return h @ head.T


def hf_keys(c: ModelConfig) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not c.tie_word_embeddings:
        keys.add("lm_head.weight")
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        keys |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        keys |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if c.attention_bias:
            keys |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        if c.o_proj_bias:
            keys.add(p + "self_attn.o_proj.bias")
    return keys


VARIANTS = {
    "llama-gqa": {},
    "qwen2-bias": {"attention_bias": True},
    "llama-bias": {"attention_bias": True, "o_proj_bias": True},
    "tied-mha": {"tie_word_embeddings": True, "num_key_value_heads": 6},
    "head-dim": {"head_dim": 12},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_independent_forward(variant: str) -> None:
    config = small_config(**VARIANTS[variant])
    model = random_model(config)
    state = model.state_dict()
    assert set(state) == hf_keys(config)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids)
    want = reference_logits(state, config, ids)
    assert got.shape == (2, 11, config.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_state_dict_round_trips_through_load_state_dict() -> None:
    config = small_config(attention_bias=True)
    a, b = random_model(config, seed=1), random_model(config, seed=2)
    b.load_state_dict(a.state_dict(), strict=True)
    ids = torch.randint(0, config.vocab_size, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)


def test_forward_rejects_a_flat_input() -> None:
    config = small_config()
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        random_model(config)(torch.tensor([1, 2, 3]))


def test_paged_prefill_and_batched_decode_match_full_forward() -> None:
    config = small_config()
    model = random_model(config)
    cache = PagedKVCache(config, 256, block_size=4)
    prompts = [
        torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        for n in (3, 9, 6)
    ]
    full = [torch.cat([p, torch.randint(0, config.vocab_size, (5,))]) for p in prompts]
    tables, lengths = [], []
    with torch.no_grad():
        for p, f in zip(prompts, full):
            blocks = cache.allocate(len(f))
            n = len(p)
            logits = model.forward_step(
                p, torch.arange(n), PrefillAttention(cache, blocks, 0, n), torch.tensor([n - 1])
            )
            torch.testing.assert_close(logits[0], model(f[None, :n])[0, -1], atol=1e-5, rtol=1e-5)
            tables.append(blocks)
            lengths.append(n)
        for _ in range(5):
            ids = torch.stack([f[n] for f, n in zip(full, lengths)])
            positions = torch.tensor(lengths)
            lengths = [n + 1 for n in lengths]
            logits = model.forward_step(ids, positions, DecodeAttention(cache, tables, lengths))
            for row, (f, n) in enumerate(zip(full, lengths)):
                torch.testing.assert_close(logits[row], model(f[None, :n])[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["dense", "gathered", "paged"])
def test_decode_attention_kept_across_steps_equals_a_new_one_each_step(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's attention advanced step by step (its K/V gathered once into dense buffers, or
    gathered each step past DENSE_DECODE_BYTES) gives the logits a fresh one gives, bit for bit,
    also after a sequence left it (the others keep their rows) and after sequences joined it (their
    rows appended, only their K/V gathered; one with a wider block table builds anew); blocks of 4,
    lengths crossing block edges. Paged: through cpu_kernels' C (the pool read through the tables,
    nothing dense kept; a join never builds anew)."""
    import server.worker.decode_attention as decode_attention
    from server.worker import cpu_kernels

    dense_bytes = 0 if mode == "gathered" else 256 << 20
    monkeypatch.setattr(decode_attention, "DENSE_DECODE_BYTES", dense_bytes)
    if mode == "paged" and not cpu_kernels.COMPILED:
        pytest.skip("the paged decode attention is the compiled kernels'")
    if mode != "paged":
        monkeypatch.setattr(cpu_kernels, "COMPILED", False)
    config = small_config()
    model = random_model(config)
    g = torch.Generator().manual_seed(3)
    runs, joins = [], []
    for keep in (False, True):
        cache = PagedKVCache(config, 256, block_size=4)
        prefilled = []
        for n in (3, 9, 6, 5, 11):  # the last two join at steps 2 and 5 (the last one's table wider)
            blocks = cache.allocate(n + 7)
            ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            model.forward_step(ids, torch.arange(n), PrefillAttention(cache, blocks, 0, n))
            prefilled.append((blocks, n))
        tables, lengths = [list(t) for t, _ in prefilled[:3]], [n for _, n in prefilled[:3]]
        steps, attention = [], None
        g.manual_seed(3)
        with torch.no_grad():
            for step in range(8):
                if step == 4:  # the second sequence ends: the others go on
                    del tables[1], lengths[1]
                joining = {2: 3, 5: 4}.get(step)
                if joining is not None:
                    tables.append(prefilled[joining][0])
                    lengths.append(prefilled[joining][1])
                ids = torch.randint(0, config.vocab_size, (len(tables),), generator=g)
                positions = torch.tensor(lengths)
                lengths = [n + 1 for n in lengths]
                if keep and attention is not None:
                    attention.advance([0, 2, 3] if step == 4 else None)
                    if joining is not None:
                        joins.append(attention.join(tables[-1:], lengths[-1:]))
                        if not joins[-1]:
                            attention = DecodeAttention(cache, tables, lengths)
                else:
                    attention = DecodeAttention(cache, tables, lengths)
                assert bool(attention.capacity) == (mode == "dense") and attention.paged == (mode == "paged")
                steps.append(model.forward_step(ids, positions, attention))
        runs.append(torch.cat(steps))
    assert torch.equal(runs[0], runs[1])
    assert joins == {"dense": [True, False], "gathered": [False, False], "paged": [True, True]}[mode]


def test_kept_rows_says_how_a_batch_goes_on() -> None:
    """The kept streams' rows and how many joined after them; None where a stream joined between
    kept ones or none was kept."""
    from server.worker.decode_attention import kept_rows

    a, b, c, d, e = (object() for _ in range(5))
    assert kept_rows([a, b, c], [a, b, c]) == ([0, 1, 2], 0)
    assert kept_rows([a, b, c], [a, c]) == ([0, 2], 0)
    assert kept_rows([a, b, c], [a, c, d, e]) == ([0, 2], 2)
    assert kept_rows([a, b, c], [a, d, c]) is None
    assert kept_rows([a, b, c], [c, a]) is None
    assert kept_rows([a, b], [d, e]) is None
    assert kept_rows([a, b], []) is None


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_grouped_decode_attention_is_sdpas_with_gqa(heads: int, kv_heads: int) -> None:
    """The CPU decode attention (two batched matmuls, query head i on KV head i // group) against
    SDPA with enable_gqa over the same masked rows, float32 and bfloat16."""
    from server.worker.model import grouped_decode_attention

    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, d, span = 5, 16, 24
    lengths = torch.tensor([1, 7, 24, 13, 16])
    mask = torch.where(torch.arange(span)[None, :] < lengths[:, None], 0.0, float("-inf"))[:, None, None, :]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        q = torch.randn(b, heads, d, generator=g).to(dtype)
        k = torch.randn(b, kv_heads, span, d, generator=g).to(dtype)
        v = torch.randn(b, kv_heads, span, d, generator=g).to(dtype)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask.to(dtype), enable_gqa=True
        ).squeeze(2)
        got = grouped_decode_attention(q, k, v, mask.to(dtype))
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_rms_norm_in_float32_is_the_reference_formula_bit_for_bit() -> None:
    """RMSNorm in float32 gives Hugging Face's LlamaRMSNorm numbers exactly (weight times
    x * rsqrt(mean(x^2) + eps)); bfloat16 keeps the float32 normalisation then casts."""
    from server.worker.model import RMSNorm

    g = torch.Generator().manual_seed(5)
    for rows, hidden in ((1, 64), (32, 64), (300, 896)):
        norm = RMSNorm(hidden, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=g))
        x = torch.randn(rows, hidden, generator=g) * 3
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(norm(x), want)
        half = x.bfloat16()
        h = half.float()
        want_half = (
            norm.weight.bfloat16() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        )
        assert torch.equal(norm.to(torch.bfloat16)(half), want_half)


def test_rotary_tables_made_once_give_the_angles_computed_each_step() -> None:
    """A CPU model keeps cos/sin tables over its context: the same numbers, bit for bit, as
    computing them for the step's positions; a position past the table (the plain forward of a
    longer input) is computed; a context past ROPE_TABLE_POSITIONS keeps no table."""
    from server.worker.model import ROPE_TABLE_POSITIONS, RotaryEmbedding, rotary_tables

    config = small_config()
    rope = RotaryEmbedding(config)
    for dtype in (torch.float32, torch.bfloat16):
        for positions in (torch.tensor([0, 5, 127, 63, 5]), torch.arange(128), torch.tensor([3, 400])):
            got = rope.tables(positions, dtype)
            want = rotary_tables(*rope(positions, dtype))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(rope._tables) == {torch.float32, torch.bfloat16}
    config.max_position_embeddings = ROPE_TABLE_POSITIONS + 1
    long = RotaryEmbedding(config)
    long.tables(torch.arange(4), torch.float32)
    assert not long._tables


def test_a_batch_of_prefill_chunks_attends_as_each_alone() -> None:
    """Chunks at one position with one length attend as one batch (from position 0, and past
    equally long earlier positions), the rest alone, all written in one go: the logits and the
    pool's K/V are those of each chunk's forward of its own (to float32 rounding: a batched
    attention kernel may round a row differently)."""
    from server.worker.kv_cache import PrefillBatchAttention

    config = small_config()
    model = random_model(config)
    g = torch.Generator().manual_seed(11)
    lengths = [(0, 6), (0, 6), (0, 6), (0, 4), (8, 5), (8, 5), (8, 3), (0, 6)]
    prompts = [torch.randint(0, config.vocab_size, (start + n,), generator=g) for start, n in lengths]
    results = []
    for batched in (False, True):
        cache = PagedKVCache(config, 512, block_size=4)
        tables = [cache.allocate(start + n) for start, n in lengths]
        with torch.no_grad():
            for ids, blocks, (start, _) in zip(prompts, tables, lengths):
                if start:  # the earlier positions, alone
                    model.forward_step(
                        ids[:start], torch.arange(start), PrefillAttention(cache, blocks, 0, start)
                    )
            ids = torch.cat([p[start:] for p, (start, _) in zip(prompts, lengths)])
            positions = torch.cat([torch.arange(start, start + n) for start, n in lengths])
            if batched:
                attention = PrefillBatchAttention(cache, [(b, s, n) for b, (s, n) in zip(tables, lengths)])
                assert [count for _, count, _, _ in attention.runs] == [3, 1, 2, 1, 1]
                logits = model.forward_step(ids, positions, attention)
            else:
                logits = torch.cat([
                    model.forward_step(p[s:], torch.arange(s, s + n), PrefillAttention(cache, b, s, n))
                    for p, b, (s, n) in zip(prompts, tables, lengths)
                ])  # fmt: skip
        results.append((logits, cache.k.clone(), cache.v.clone()))
    for alone, together in zip(*results):
        torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_prefill_in_two_chunks_matches_one() -> None:
    config = small_config()
    model = random_model(config)
    cache = PagedKVCache(config, 64, block_size=4)
    ids = torch.randint(0, config.vocab_size, (10,))
    blocks = cache.allocate(10)
    with torch.no_grad():
        model.forward_step(ids[:6], torch.arange(6), PrefillAttention(cache, blocks, 0, 6))
        second = model.forward_step(ids[6:], torch.arange(6, 10), PrefillAttention(cache, blocks, 6, 4))
        torch.testing.assert_close(second, model(ids[None])[0, 6:], atol=1e-5, rtol=1e-5)


def test_cache_allocation_and_limits() -> None:
    cache = PagedKVCache(small_config(), 32, block_size=8)
    a = cache.allocate(9)  # two blocks
    assert len(a) == 2 and cache.used_tokens == 16
    with pytest.raises(KVCacheFull, match="16 free") as exc:
        cache.allocate(17)
    assert exc.value.ever_fits
    with pytest.raises(KVCacheFull, match="whole KV cache holds 32") as exc:
        cache.allocate(33)
    assert not exc.value.ever_fits
    cache.free(a)
    assert cache.used_tokens == 0 and len(cache.allocate(32)) == 4


def test_rope_scalings() -> None:
    base = small_config()
    plain = rope_inverse_frequencies(base)
    torch.testing.assert_close(
        rope_inverse_frequencies(small_config(rope_scaling={"type": "linear", "factor": 4.0})), plain / 4
    )
    llama3 = rope_inverse_frequencies(
        small_config(
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
    )  # fmt: skip
    unscaled = rope_inverse_frequencies(small_config(rope_theta=500000.0))
    wavelen = 2 * math.pi / unscaled
    # High frequencies (short wavelengths) untouched, low ones divided by the factor.
    assert torch.equal(llama3[wavelen < 64 / 4], unscaled[wavelen < 64 / 4])
    torch.testing.assert_close(llama3[wavelen > 64], unscaled[wavelen > 64] / 8)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        rope_inverse_frequencies(small_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_from_hf_configs() -> None:
    common = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": [1, 2]}  # fmt: skip
    qwen = ModelConfig.from_hf(
        {**common, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}
    )
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.sliding_window is None
    assert qwen.eos_token_ids == [1, 2] and qwen.dim_per_head == 16
    mistral = ModelConfig.from_hf({**common, "model_type": "mistral", "sliding_window": 1024,
                                   "max_position_embeddings": 32768})  # fmt: skip
    assert mistral.max_context == 1024 and not mistral.attention_bias
    llama = ModelConfig.from_hf(
        {**common, "model_type": "llama", "attention_bias": True, "head_dim": 32, "foo": 1}
    )
    assert llama.o_proj_bias and llama.head_dim == 32 and llama.extra == {"foo": 1}
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf({**common, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="lacks vocab_size"):
        ModelConfig.from_hf({k: v for k, v in common.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="not a multiple"):
        ModelConfig.from_hf({**common, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**common, "hidden_act": "gelu"})


def test_tiny_is_deterministic_and_not_degenerate() -> None:
    _, a, tok = build_tiny()
    _, b, _ = build_tiny()
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    outputs = set()
    for prompt in ("Hello", "The weather in Lisbon", "1, 2, 3"):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            for _ in range(24):
                ids = torch.cat([ids, a(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        generated = ids[0, -24:].tolist()
        assert len(set(generated)) >= 8, generated  # not one byte over and over
        outputs.add(tuple(generated))
    assert len(outputs) == 3  # the prompt matters


@pytest.mark.parametrize("bias", [{}, {"attention_bias": True}, {"attention_bias": True, "mlp_bias": True}])
def test_fused_projections_equal_the_linears_apart(bias: dict[str, bool]) -> None:
    config = small_config(**bias)
    model = random_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    apart = model(ids)  # autograd on: each linear on its own (a fused copy carries no gradient)
    apart.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.inference_mode():
        fused = model(ids)
    layer = model.model.layers[0]
    assert (layer.self_attn.qkv.fusions, layer.mlp.gate_up.fusions) == (1, 1)
    torch.testing.assert_close(fused, apart.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.argmax(-1), apart.argmax(-1))
    # The fused weights are copies in no state_dict: a checkpoint's keys stay Hugging Face's.
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        x = torch.randn(3, config.hidden_size)
        attn = layer.self_attn
        want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        torch.testing.assert_close(attn.qkv(x), want, rtol=1e-6, atol=1e-6)
        assert attn.qkv.fusions == 1  # made once, reused


def test_a_weight_reload_fuses_again() -> None:
    config = small_config(attention_bias=True)
    a, b = random_model(config, seed=1), random_model(config, seed=2)
    ids = torch.randint(0, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    fused = b.model.layers[1].self_attn.qkv
    with torch.no_grad():
        before = b(ids)
        assert fused.fusions == 1
        b(ids)
        assert fused.fusions == 1
        b.load_state_dict(a.state_dict())  # copied in place, as hf.load_weights does
        torch.testing.assert_close(b(ids), a(ids), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(b(ids), before)
        assert fused.fusions == 2
        b.model.layers[1].mlp.up_proj.weight.mul_(2.0)  # one tensor changed in place
        assert not torch.allclose(b(ids), a(ids))
        assert b.model.layers[1].mlp.gate_up.fusions == 3
        # A replaced parameter and a cast model fuse again too.
        attn = b.model.layers[1].self_attn
        attn.v_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.v_proj.weight))
        x = torch.randn(2, config.hidden_size)
        assert torch.equal(attn.qkv(x)[:, -attn.v_proj.out_features :], attn.v_proj(x))
        b.to(torch.float64)
        assert b(ids).dtype == torch.float64
        assert attn.qkv.weight is not None and attn.qkv.weight.dtype == torch.float64


def test_a_cut_prompt_keeps_its_kv_dense_between_chunks_with_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of one prompt (a chunk run twice, as after a failed step, among them): attending over
    the dense copy gives the logits and pool K/V of gathering the prefix from the pool, bit for bit;
    the copy goes when the blocks are freed; a prompt past DENSE_PREFILL_BYTES keeps none."""
    from server.worker import dense_prefix

    config = small_config(max_position_embeddings=256)
    model = random_model(config)
    ids = torch.randint(0, config.vocab_size, (100,), generator=torch.Generator().manual_seed(6))
    chunks = [(0, 30), (30, 7), (37, 40), (37, 40), (77, 23)]
    results = {}
    for keep in (False, True):
        cache = PagedKVCache(config, 512, block_size=8)
        blocks = cache.allocate(100)
        outs = []
        with torch.inference_mode():
            for start, n in chunks:
                attention = PrefillAttention(cache, blocks, start, n, keep and start + n < 100)
                outs.append(
                    model.forward_step(ids[start : start + n], torch.arange(start, start + n), attention)
                )
        results[keep] = (outs, cache)
    (plain, gathered), (kept, dense) = results[False], results[True]
    assert gathered.dense_prefix is None
    held = dense.dense_prefix
    assert held is not None and held.blocks is not None
    assert {layer: end for layer, (_, _, end) in held.layers.items()} == {0: 100, 1: 100}
    for a, b in zip(plain, kept):
        assert torch.equal(a, b)
    assert torch.equal(gathered.k, dense.k) and torch.equal(gathered.v, dense.v)
    dense.free(held.blocks)
    assert dense.dense_prefix is None
    monkeypatch.setattr(dense_prefix, "DENSE_PREFILL_BYTES", 1024)
    small = PagedKVCache(config, 512, block_size=8)
    assert PrefillAttention(small, small.allocate(100), 0, 30, True).dense is None
    assert small.dense_prefix is None
