"""The worker forward's CPU kernels: a decode step's elementwise and attention parts as one call each.

A small model's decode step on a CPU costs its ops' dispatch more than their arithmetic (the tiny
model's step at 32 streams was ~110 torch ops, ~0.75 ms, for ~1 MFLOP). :class:`.model.LlamaModel`
runs its forward through these where the compiled twin is built (``_cpu_kernels``, the C in
``cpu_decode.c``) and the forward is a float32 inference one on a CPU: each is then one C call
where the torch arithmetic below is 3-12 dispatched ops (:data:`COMPILED` says which runs).

This module is the pure twin and the reference: the same arithmetic in torch ops, the same
arguments and errors (``ValueError`` naming the argument). The C adds a reduction's terms in eight
lanes, torch in its own order: the two agree within float32 rounding (tests/test_cpu_kernels.py),
and every C build (generic, AVX2) gives the same bits on any CPU.

- :func:`rms_norm`: ``x * rsqrt(mean(x^2) + eps) * weight`` (Hugging Face's LlamaRMSNorm).
- :func:`add_rms_norm_`: ``residual += x`` then ``x = rms_norm(residual)``, both in place: a
  layer's residual add and the next norm (vLLM's ``fused_add_rms_norm``).
- :func:`silu_mul`: ``silu(gate) * up`` of a fused gate/up projection ``[rows, 2 * inner]``.
- :func:`rope_`: the rotary embedding in place on a q/k/v projection's first ``heads`` heads.
- :func:`paged_decode`: one decode token per sequence: its new K/V written to the paged pool,
  then its query heads' attention over its positions read through its block table (no dense copy
  of the batch's K/V, no mask).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fastcore import compiled_twin


def _check_float(t: torch.Tensor, name: str, contiguous: bool = True) -> None:
    if t.dtype is not torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a CPU torch.float32 tensor, got {t.dtype} on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _rows_of(x: torch.Tensor, weight: torch.Tensor) -> int:
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} does not end in weight's {tuple(weight.shape)}")
    return x.numel() // max(weight.shape[0], 1)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (x * torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A new tensor: each row of ``x`` normalised, times ``weight``."""
    if _rows_of(x, weight):
        _check_float(x, "x")
        _check_float(weight, "weight")
    return _norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``residual += x``, then ``x`` = :func:`rms_norm` of ``residual``; both in place."""
    rows = _rows_of(x, weight)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if not rows:
        return
    for t, name in ((x, "x"), (residual, "residual"), (weight, "weight")):
        _check_float(t, name)
    if x.data_ptr() == residual.data_ptr():
        raise ValueError("x and residual must not share memory")
    residual.add_(x)
    x.copy_(_norm(residual, weight, eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :inner]) * gate_up[:, inner:]``, a new ``[rows, inner]`` tensor."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * inner], got {tuple(gate_up.shape)}")
    if gate_up.numel():
        _check_float(gate_up, "gate_up")
    gate, up = gate_up.chunk(2, -1)
    return torch.nn.functional.silu(gate).mul_(up)


def rope_(
    x: torch.Tensor,
    heads: int,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> None:
    """:func:`.model.apply_rotary_tables` in place on ``x[:, :heads]`` (``x`` ``[rows, all heads,
    head_dim]``): ``cos``/``signed_sin`` hold ``[rows, head_dim]`` as the model's tables give them
    for a forward's positions, or, with ``positions`` (``[rows]``, int64), the whole tables
    ``[table rows, head_dim]`` that row ``r`` reads at ``positions[r]`` (one gather fewer)."""
    if x.dim() != 3 or heads < 0 or heads > x.shape[1] or x.shape[2] % 2:
        raise ValueError(f"x must be [rows, heads >= {heads}, even head_dim], got {tuple(x.shape)}")
    rows, dim = x.shape[0], x.shape[2]
    table_rows = rows if positions is None else cos.numel() // max(dim, 1)
    if (
        cos.numel() != table_rows * dim
        or signed_sin.numel() != table_rows * dim
        or cos.shape[-1] != dim
        or signed_sin.shape[-1] != dim
    ):
        raise ValueError(
            f"cos and signed_sin must hold [{'rows' if positions is None else 'positions'}, {dim}], "
            f"got {tuple(cos.shape)} and {tuple(signed_sin.shape)}"
        )
    if positions is not None and (positions.dim() != 1 or positions.shape[0] != rows):
        raise ValueError(f"positions must be [{rows}], got {tuple(positions.shape)}")
    if not rows or not heads:
        return
    for t, name in ((x, "x"), (cos, "cos"), (signed_sin, "signed_sin")):
        _check_float(t, name)
    cos, signed_sin = cos.reshape(table_rows, 1, dim), signed_sin.reshape(table_rows, 1, dim)
    if positions is not None:
        if positions.dtype is not torch.int64 or not positions.is_cpu or not positions.is_contiguous():
            raise ValueError("positions must be a contiguous CPU torch.int64 tensor")
        outside = ((positions < 0) | (positions >= table_rows)).nonzero()
        if outside.numel():
            r = int(outside[0, 0])
            raise ValueError(f"positions[{r}] = {int(positions[r])} outside the tables' {table_rows} rows")
        cos, signed_sin = cos.index_select(0, positions), signed_sin.index_select(0, positions)
    part = x[:, :heads]
    # .model.apply_rotary_tables' three ops (that module imports this one)
    part.copy_(part * cos + part.roll(dim // 2, -1) * signed_sin)


def grouped_decode_attention(
    q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[B, heads, D]`` over ``kh``/``vh`` ``[B, kv_heads, S, D]``
    with an additive ``mask`` ``[B, 1, 1, S]``; ``[B, heads, D]``.

    SDPA's attention as two batched matmuls, each KV head's query heads its rows (query head
    ``i`` reads KV head ``i // group``, as ``enable_gqa`` pairs them): on a CPU SDPA's kernel with a
    mask costs a third more for one query row (measured at 32 sequences of 128 positions, ~130 ->
    ~100 us a layer). The same attention to float32 rounding (the scores are scaled after the
    product rather than the query before it); softmax in float32 whatever the dtype."""
    b, heads, d = q.shape
    kv_heads = kh.shape[1]
    scores = torch.matmul(q.view(b, kv_heads, heads // kv_heads, d), kh.transpose(-1, -2))
    scores = scores.mul_(d**-0.5).add_(mask)
    if scores.dtype == torch.float32:  # no cast to make (a no-op cast is still a dispatched op)
        weights = torch.softmax(scores, -1)
    else:
        weights = torch.softmax(scores, -1, dtype=torch.float32).to(vh.dtype)
    return torch.matmul(weights, vh).view(b, heads, d)


def _head_rows(t: torch.Tensor, name: str, batch: int, dim: int) -> int:
    if t.dim() != 3 or t.shape[0] != batch or t.shape[2] != dim or t.stride(2) != 1 or t.stride(1) != dim:
        raise ValueError(
            f"{name} must be [{batch}, heads, {dim}] with rows of whole heads, got "
            f"{tuple(t.shape)} strides {t.stride()}"
        )
    return t.stride(0)


def _check_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    pool_k, pool_v = pools
    if q.dim() != 3 or k.dim() != 3 or pool_k.dim() != 3:
        raise ValueError(
            f"q, k and pool_k must be 3-d, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(pool_k.shape)}"
        )
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q's {heads} heads are not a multiple of k's {kv_heads}")
    _head_rows(q, "q", batch, dim)
    kv_stride = _head_rows(k, "k", batch, dim)
    if _head_rows(v, "v", batch, dim) != kv_stride or v.shape[1] != kv_heads:
        raise ValueError(f"v {tuple(v.shape)} must be laid out as k {tuple(k.shape)}")
    if tuple(pool_k.shape[1:]) != (kv_heads, dim):
        raise ValueError(f"pool_k must be [slots, {kv_heads}, {dim}], got {tuple(pool_k.shape)}")
    if pool_k.shape != pool_v.shape:
        raise ValueError(f"pool_k {tuple(pool_k.shape)} and pool_v {tuple(pool_v.shape)} differ")
    if table.dim() != 2 or table.shape[0] != batch or lengths.dim() != 1 or lengths.shape[0] != batch:
        raise ValueError(
            f"table must be [{batch}, width] and lengths [{batch}], got {tuple(table.shape)} "
            f"and {tuple(lengths.shape)}"
        )
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} and q {tuple(q.shape)} differ")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not batch:
        return
    for t, name, contiguous in ((q, "q", False), (k, "k", False), (v, "v", False), (out, "out", True)):
        _check_float(t, name, contiguous)
    for t, name in ((pool_k, "pool_k"), (pool_v, "pool_v")):
        _check_float(t, name)
    for t, name in ((table, "table"), (lengths, "lengths")):
        if t.dtype is not torch.int64 or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU torch.int64 tensor")
    width, blocks = table.shape[1], pool_k.shape[0] // block_size
    for b, length in enumerate(lengths.tolist()):
        used = table[b, : -(-length // block_size)] if length > 0 else table[b, :0]
        if not 0 < length <= width * block_size or bool(((used < 0) | (used >= blocks)).any()):
            raise ValueError(
                f"sequence {b}: length {length} or its blocks lie outside the table ({width} blocks "
                f"of {block_size}) or the pool ({pool_k.shape[0]} slots)"
            )


def paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """Writes each sequence's new ``k``/``v`` (``[B, kv_heads, D]``) to the slot of its position
    ``lengths[b] - 1`` in ``pool_k``/``pool_v`` (``[slots, kv_heads, D]``, through ``table``'s
    ``[B, width]`` block ids), then ``out`` (``[B, heads, D]``) = each query's attention over the
    sequence's ``lengths[b]`` positions: :func:`.model.grouped_decode_attention`'s arithmetic."""
    _check_decode(q, k, v, (pool_k, pool_v), table, lengths, block_size, out)
    if not q.shape[0]:
        return
    last = lengths - 1
    new = table.gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    pool_k.index_copy_(0, new, k)
    pool_v.index_copy_(0, new, v)
    span = int(lengths.max())
    offsets = torch.arange(span)
    slots = table[:, offsets // block_size] * block_size + offsets % block_size
    slots = torch.where(offsets[None, :] < lengths[:, None], slots, 0)  # blocks past a length: unread
    kh = pool_k.index_select(0, slots.reshape(-1)).unflatten(0, slots.shape).transpose(1, 2)
    vh = pool_v.index_select(0, slots.reshape(-1)).unflatten(0, slots.shape).transpose(1, 2)
    mask = torch.zeros(slots.shape).masked_fill_(offsets[None, :] >= lengths[:, None], -torch.inf)
    out.copy_(grouped_decode_attention(q, kh, vh, mask[:, None, None, :]))


class PagedDecode:
    """:func:`paged_decode` for one batch at every layer, what stays the same checked once: the
    pools (``[layers, slots, kv_heads, dim]``, the KV cache's), the block ``table`` and ``lengths``
    (kept: the caller moves lengths on in place). ``decode(layer, q, k, v, out)`` is
    ``paged_decode(q, k, v, pool_k[layer], pool_v[layer], table, lengths, block_size, out)``."""

    def __init__(
        self,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        table: torch.Tensor,
        lengths: torch.Tensor,
        block_size: int,
    ) -> None:
        if pool_k.dim() != 4 or pool_k.shape != pool_v.shape:
            raise ValueError(
                f"pool_k and pool_v must be one [layers, slots, kv_heads, dim] shape, got "
                f"{tuple(pool_k.shape)} and {tuple(pool_v.shape)}"
            )
        if table.dim() != 2 or lengths.dim() != 1 or lengths.shape[0] != table.shape[0]:
            raise ValueError(
                f"table must be [batch, width] and lengths [batch], got {tuple(table.shape)} "
                f"and {tuple(lengths.shape)}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if pool_k.shape[2] < 1 or pool_k.shape[3] < 1:
            raise ValueError(f"pool_k {tuple(pool_k.shape)} holds no heads")
        for t, name in ((pool_k, "pool_k"), (pool_v, "pool_v")):
            _check_float(t, name)
        self.pools = list(zip(pool_k.unbind(0), pool_v.unbind(0)))
        self.table, self.lengths, self.block_size = table, lengths, block_size

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> None:
        if not 0 <= layer < len(self.pools):
            raise ValueError(f"layer {layer} outside the pools' {len(self.pools)}")
        pool_k, pool_v = self.pools[layer]
        _head_rows(q, "q", self.table.shape[0], pool_k.shape[2])  # the batch's, as the C checks it
        if q.shape[1] % pool_k.shape[1]:
            raise ValueError(f"q's {q.shape[1]} heads are not a multiple of the pools' {pool_k.shape[1]}")
        PURE.paged_decode(q, k, v, pool_k, pool_v, self.table, self.lengths, self.block_size, out)


#: the pure functions (the reference the tests hold the C to), whichever twin the names below are
PURE = SimpleNamespace(
    rms_norm=rms_norm,
    add_rms_norm_=add_rms_norm_,
    silu_mul=silu_mul,
    rope_=rope_,
    paged_decode=paged_decode,
    PagedDecode=PagedDecode,
)
#: the compiled twin, None where it is not built or FASTCORE_NO_EXTENSIONS=1 is set
_compiled = compiled_twin("server.worker._cpu_kernels")
#: whether the functions here are the C ones (the model's fused forward runs only then)
COMPILED = _compiled is not None
if _compiled is not None:
    rms_norm = _compiled.rms_norm
    add_rms_norm_ = _compiled.add_rms_norm_
    silu_mul = _compiled.silu_mul
    rope_ = _compiled.rope_
    paged_decode = _compiled.paged_decode
    PagedDecode = _compiled.PagedDecode  # type: ignore[misc]

__all__ = [
    "COMPILED",
    "PURE",
    "add_rms_norm_",
    "grouped_decode_attention",
    "paged_decode",
    "rms_norm",
    "rope_",
    "silu_mul",
]
