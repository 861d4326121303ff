"""The torch worker's CPU kernels (server.worker.cpu_kernels and its C twin, _cpu_kernels): each
against plain torch arithmetic on both twins, the C builds (generic, AVX2) against each other bit
for bit, every argument check on both twins, and the model's fused forward against its modules."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from server.worker import cpu_kernels  # noqa: E402
from server.worker.model import apply_rotary_tables, grouped_decode_attention  # noqa: E402

#: the C and torch add a reduction's terms in different orders (float32 rounding apart)
ATOL = 2e-5
RTOL = 1e-5


def _norm_reference(x: Any, w: Any, eps: float) -> Any:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


@pytest.mark.parametrize("rows,dim", [(1, 64), (32, 64), (5, 12), (3, 4096), (7, 9)])
def test_rms_norm_and_add_rms_norm(cpu_kernels_twin: Any, rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    x, res, w = (torch.randn(rows, dim, generator=gen) for _ in range(2)), None, None
    x, res = x
    w = torch.randn(dim, generator=gen)
    out = cpu_kernels_twin.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, _norm_reference(x, w, 1e-5), atol=ATOL, rtol=RTOL)
    assert out.data_ptr() != x.data_ptr()
    h, r = x.clone(), res.clone()
    assert cpu_kernels_twin.add_rms_norm_(h, r, w, 1e-6) is None
    torch.testing.assert_close(r, res + x, atol=0, rtol=0)  # the residual add is exact
    torch.testing.assert_close(h, _norm_reference(res + x, w, 1e-6), atol=ATOL, rtol=RTOL)


def test_silu_mul(cpu_kernels_twin: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(32, 2 * 176, generator=gen) * 4
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0, 1e-30])  # exp's clamps
    gate_up[1, :5] = torch.tensor([85.0, -86.0, 87.5, -87.5, 88.5])  # past e^x's float range at the edges
    want = (torch.nn.functional.silu(gate_up[:, :176].double()) * gate_up[:, 176:].double()).float()
    torch.testing.assert_close(cpu_kernels_twin.silu_mul(gate_up), want, atol=ATOL, rtol=RTOL)
    assert cpu_kernels_twin.silu_mul(torch.empty(0, 8)).shape == (0, 4)


def test_rope_is_the_models_rotation_bit_for_bit(cpu_kernels_twin: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, 4 + 2 + 2, 16, generator=gen)
    cos, signed_sin = torch.randn(9, 1, 16, generator=gen), torch.randn(9, 1, 16, generator=gen)
    got = qkv.clone()
    cpu_kernels_twin.rope_(got, 6, cos, signed_sin)
    assert torch.equal(got[:, :6], apply_rotary_tables(qkv[:, :6], cos, signed_sin))
    assert torch.equal(got[:, 6:], qkv[:, 6:])  # v untouched


def _paged_case(
    batch: int, heads: int, kv_heads: int, dim: int, block_size: int, seed: int, longest: int = 90
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    width = -(-longest // block_size) + 1
    blocks = batch * width + 3
    pool_k = torch.randn(blocks * block_size, kv_heads, dim, generator=gen)
    pool_v = torch.randn(blocks * block_size, kv_heads, dim, generator=gen)
    table = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width).contiguous()
    lengths = torch.randint(1, longest + 1, (batch,), generator=gen)
    lengths[0] = 1  # only its new token
    if batch > 1:
        lengths[1] = block_size  # a whole block
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv.split_with_sizes([heads, kv_heads, kv_heads], 1)
    return dict(
        q=q, k=k, v=v, pool_k=pool_k, pool_v=pool_v, table=table, lengths=lengths, block_size=block_size
    )


def _paged_reference(case: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Each sequence apart, in float64: its new K/V written, its positions gathered."""
    pool_k, pool_v = case["pool_k"].clone(), case["pool_v"].clone()
    bs, outs = case["block_size"], []
    for b, length in enumerate(case["lengths"].tolist()):
        slots = torch.tensor([int(case["table"][b, j // bs]) * bs + j % bs for j in range(length)])
        pool_k[slots[-1]], pool_v[slots[-1]] = case["k"][b], case["v"][b]
        q = case["q"][b : b + 1].double()
        kh = pool_k[slots].double().transpose(0, 1)[None]
        vh = pool_v[slots].double().transpose(0, 1)[None]
        outs.append(grouped_decode_attention(q, kh, vh, torch.zeros(1, 1, 1, length, dtype=torch.float64)))
    return torch.cat(outs).float(), pool_k, pool_v


def _run_paged(kernels: Any, case: dict[str, Any]) -> tuple[Any, Any, Any]:
    run = {**case, "pool_k": case["pool_k"].clone(), "pool_v": case["pool_v"].clone()}
    out = torch.empty(case["q"].shape)
    kernels.paged_decode(out=out, **run)
    return out, run["pool_k"], run["pool_v"]


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [(4, 2, 16, 16), (4, 4, 64, 16), (8, 1, 128, 16), (4, 2, 12, 4), (6, 3, 8, 5), (2, 2, 24, 16)],
)
def test_paged_decode_against_a_per_sequence_reference(
    cpu_kernels_twin: Any, heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    case = _paged_case(6, heads, kv_heads, dim, block_size, seed=heads * dim + block_size)
    out, pool_k, pool_v = _run_paged(cpu_kernels_twin, case)
    want, want_k, want_v = _paged_reference(case)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)  # only the new slots written


def test_the_c_builds_agree_bit_for_bit() -> None:
    compiled = pytest.importorskip("server.worker._cpu_kernels")
    if not compiled.supported("avx2"):
        pytest.skip("this CPU has no AVX2: only the generic build runs here")
    cases = [_paged_case(8, 4, 2, 16, 16, seed=7, longest=200), _paged_case(3, 8, 2, 64, 16, seed=8)]
    gen = torch.Generator().manual_seed(9)
    x, res, w = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen), torch.randn(64)
    gate_up = torch.randn(8, 2 * 51, generator=gen) * 8
    results: dict[str, list[Any]] = {}
    before = compiled.path()
    try:
        for name in ("generic", "avx2"):
            compiled.use(name)
            assert compiled.path() == name
            h, r = x.clone(), res.clone()
            compiled.add_rms_norm_(h, r, w, 1e-5)
            results[name] = [compiled.rms_norm(x, w, 1e-5), h, compiled.silu_mul(gate_up)]
            results[name] += [t for case in cases for t in _run_paged(compiled, case)]
    finally:
        compiled.use(before)
    assert all(torch.equal(a, b) for a, b in zip(results["generic"], results["avx2"]))


def test_an_unknown_or_unsupported_build_is_refused() -> None:
    compiled = pytest.importorskip("server.worker._cpu_kernels")
    with pytest.raises(KeyError):
        compiled.use("avx512")
    if not compiled.supported("avx2"):
        with pytest.raises(ValueError, match="cannot run the avx2"):
            compiled.use("avx2")


def _bad_paged_calls() -> list[tuple[str, dict[str, Any], str]]:
    case = _paged_case(3, 4, 2, 16, 16, seed=3)
    out = torch.empty(case["q"].shape)
    long_table = case["lengths"].clone()
    long_table[2] = case["table"].shape[1] * 16 + 1
    zero = case["lengths"].clone()
    zero[1] = 0
    outside = case["table"].clone()
    outside[2, 0] = case["pool_k"].shape[0] // 16  # one block past the pool
    negative = case["table"].clone()
    negative[1, 0] = -1
    return [
        ("dtype", {**case, "pool_k": case["pool_k"].double(), "out": out}, "pool_k must be a CPU"),
        ("heads", {**case, "k": case["q"][:, :3], "out": out}, "not a multiple"),
        ("strides", {**case, "q": torch.randn(3, 16, 4).transpose(1, 2), "out": out}, "q must be"),
        ("out", {**case, "out": torch.empty(3, 4, 8)}, r"out .* differ"),
        ("table dtype", {**case, "table": case["table"].int(), "out": out}, "table must be"),
        ("past the table", {**case, "lengths": long_table, "out": out}, "sequence 2: length"),
        ("empty sequence", {**case, "lengths": zero, "out": out}, "sequence 1: length 0"),
        ("block past the pool", {**case, "table": outside, "out": out}, "sequence 2: length"),
        ("negative block", {**case, "table": negative, "out": out}, "sequence 1: length"),
        ("block size", {**case, "block_size": 0, "out": out}, "block_size must be positive"),
    ]


@pytest.mark.parametrize("name,call,message", _bad_paged_calls(), ids=[c[0] for c in _bad_paged_calls()])
def test_paged_decode_refuses_what_it_would_read_out_of_bounds(
    cpu_kernels_twin: Any, name: str, call: dict[str, Any], message: str
) -> None:
    pools = (call["pool_k"].clone(), call["pool_v"].clone())
    with pytest.raises(ValueError, match=message):
        cpu_kernels_twin.paged_decode(**call)
    assert torch.equal(call["pool_k"], pools[0]) and torch.equal(call["pool_v"], pools[1])  # nothing written


def test_the_elementwise_kernels_refuse_bad_tensors(cpu_kernels_twin: Any) -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="does not end in weight"):
        cpu_kernels_twin.rms_norm(x, torch.randn(6), 1e-5)
    with pytest.raises(ValueError, match=r"x must be a CPU torch\.float32"):
        cpu_kernels_twin.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="x must be contiguous"):
        cpu_kernels_twin.rms_norm(torch.randn(8, 4).t(), w, 1e-5)
    with pytest.raises(ValueError, match=r"residual .* differ"):
        cpu_kernels_twin.add_rms_norm_(x, torch.randn(3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="must not share memory"):
        cpu_kernels_twin.add_rms_norm_(x, x, w, 1e-5)
    with pytest.raises(ValueError, match="gate_up must be"):
        cpu_kernels_twin.silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="gate_up must be a CPU"):
        cpu_kernels_twin.silu_mul(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="even head_dim"):
        cpu_kernels_twin.rope_(torch.randn(2, 3, 5), 2, torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError, match="heads >= 4"):
        cpu_kernels_twin.rope_(torch.randn(2, 3, 4), 4, torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="cos and signed_sin"):
        cpu_kernels_twin.rope_(torch.randn(2, 3, 4), 2, torch.randn(3, 4), torch.randn(2, 4))


def _forced(monkeypatch: pytest.MonkeyPatch, kernels: Any) -> None:
    """The model's fused forward on ``kernels`` (either twin), whichever is built here."""
    for name in ("rms_norm", "add_rms_norm_", "silu_mul", "rope_", "paged_decode", "PagedDecode"):
        monkeypatch.setattr(cpu_kernels, name, getattr(kernels, name))
    monkeypatch.setattr(cpu_kernels, "COMPILED", True)


def test_the_fused_forward_is_the_modules_arithmetic(
    cpu_kernels_twin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.worker.tiny import build_tiny

    _, model, _ = build_tiny("cpu")
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        monkeypatch.setattr(cpu_kernels, "COMPILED", False)
        plain = model(ids)
        _forced(monkeypatch, cpu_kernels_twin)
        assert model.model._kernels_apply(torch.zeros(1, 64))
        fused = model(ids)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)


def test_a_hooked_or_autograd_forward_runs_the_modules(
    cpu_kernels_twin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.worker.tiny import build_tiny

    _, model, _ = build_tiny("cpu")
    _forced(monkeypatch, cpu_kernels_twin)
    seen: list[Any] = []
    handle = model.model.layers[1].register_forward_hook(lambda m, a, out: seen.append(out))
    ids = torch.randint(0, 256, (1, 9))
    with torch.inference_mode():
        assert not model.model._kernels_apply(torch.zeros(1, 64))
        model(ids)
    handle.remove()
    assert len(seen) == 1 and seen[0].shape == (9, 64)
    with torch.inference_mode():
        assert model.model._kernels_apply(torch.zeros(1, 64))
        assert not model.model._kernels_apply(torch.zeros(1, 64, dtype=torch.float64))
    assert not model.model._kernels_apply(torch.zeros(1, 64))  # grad enabled: training runs the modules


def test_paged_decode_for_a_batch_is_the_function_at_each_layer(cpu_kernels_twin: Any) -> None:
    """PagedDecode checks the pools, table and lengths once and runs paged_decode on a layer's pools;
    lengths moved on in place are read at each call."""
    case = _paged_case(5, 4, 2, 16, 16, seed=11)
    pools_k = torch.stack([case["pool_k"], case["pool_k"] * 2])
    pools_v = torch.stack([case["pool_v"], -case["pool_v"]])
    lengths = case["lengths"].clone()
    decode = cpu_kernels_twin.PagedDecode(pools_k, pools_v, case["table"], lengths, 16)
    for _step in range(2):
        for layer in range(2):
            out = torch.empty(case["q"].shape)
            decode(layer, case["q"], case["k"], case["v"], out)
            want = torch.empty(case["q"].shape)
            layer_case = {
                **case,
                "lengths": lengths,
                "pool_k": pools_k[layer].clone(),
                "pool_v": pools_v[layer].clone(),
            }
            cpu_kernels_twin.paged_decode(out=want, **layer_case)
            assert torch.equal(out, want)
        lengths += 1


def test_paged_decode_for_a_batch_refuses_bad_calls(cpu_kernels_twin: Any) -> None:
    case = _paged_case(3, 4, 2, 16, 16, seed=12)
    pools = (case["pool_k"][None], case["pool_v"][None])
    make = cpu_kernels_twin.PagedDecode
    with pytest.raises(ValueError, match=r"one \[layers, slots, kv_heads, dim\] shape"):
        make(case["pool_k"], case["pool_v"], case["table"], case["lengths"], 16)
    with pytest.raises(ValueError, match="table must be"):
        make(*pools, case["table"], case["lengths"][:2], 16)
    with pytest.raises(ValueError, match="block_size must be positive"):
        make(*pools, case["table"], case["lengths"], 0)
    with pytest.raises(ValueError, match="pool_k must be a CPU"):
        make(pools[0].double(), pools[1].double(), case["table"], case["lengths"], 16)
    decode = make(*pools, case["table"], case["lengths"], 16)
    out = torch.empty(case["q"].shape)
    with pytest.raises(ValueError, match="layer 1 outside"):
        decode(1, case["q"], case["k"], case["v"], out)
    with pytest.raises(ValueError, match="q must be"):
        decode(0, case["q"][:2], case["k"], case["v"], out)
    with pytest.raises(ValueError, match="not a multiple"):
        decode(0, case["q"][:, :3], case["k"], case["v"], torch.empty(3, 3, 16))
    bad = case["lengths"].clone()
    bad[0] = 10_000
    with pytest.raises(ValueError, match="sequence 0: length 10000"):
        make(*pools, case["table"], bad, 16)(0, case["q"], case["k"], case["v"], out)


def test_rope_at_positions_reads_the_whole_tables(cpu_kernels_twin: Any) -> None:
    gen = torch.Generator().manual_seed(13)
    cos_t, sin_t = torch.randn(50, 1, 16, generator=gen), torch.randn(50, 1, 16, generator=gen)
    qkv = torch.randn(6, 8, 16, generator=gen)
    positions = torch.tensor([0, 49, 7, 7, 20, 3])
    got = qkv.clone()
    cpu_kernels_twin.rope_(got, 6, cos_t, sin_t, positions)
    want = qkv.clone()
    cpu_kernels_twin.rope_(want, 6, cos_t[positions], sin_t[positions])
    assert torch.equal(got, want)
    for bad, where in (
        (torch.tensor([0, 1, 50, 2, 3, 4]), "positions.2. = 50"),
        (-positions, "positions.1. = -49"),
    ):
        before = qkv.clone()
        with pytest.raises(ValueError, match=where):
            cpu_kernels_twin.rope_(before, 6, cos_t, sin_t, bad)
        assert torch.equal(before, qkv)  # nothing rotated
    with pytest.raises(ValueError, match=r"positions must be \[6\]"):
        cpu_kernels_twin.rope_(qkv.clone(), 6, cos_t, sin_t, positions[:5])
    with pytest.raises(ValueError, match="positions must be a"):
        cpu_kernels_twin.rope_(qkv.clone(), 6, cos_t, sin_t, positions.int())


def test_the_fused_forward_past_the_rotary_tables(
    cpu_kernels_twin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positions past the kept tables (the plain forward of an input longer than the model's
    context): the rotation falls back to angles computed for them, as the modules' path does."""
    from server.worker.tiny import build_tiny

    _, model, _ = build_tiny("cpu")
    model.model.rotary_emb.max_positions = 24  # tables of 24 positions, a 40-token input
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        monkeypatch.setattr(cpu_kernels, "COMPILED", False)
        plain = model(ids)
        _forced(monkeypatch, cpu_kernels_twin)
        fused = model(ids)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
