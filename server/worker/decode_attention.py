"""A decode step's attention over the paged KV cache: one new token for each running sequence.

:class:`DecodeAttention` is the engine's :class:`.model.AttentionBackend` for decode rows, kept from
step to step while the same streams decode, its inputs moved on in place: with the compiled CPU
kernels (float32 on a CPU) one C call a layer reads the pool through the block tables
(:class:`.cpu_kernels.PagedDecode`); else a dense copy of the streams' K/V is kept beside the pool
for torch's attention. :func:`kept_rows` says how a step's batch goes on from the last one's. Split out of
:mod:`.kv_cache` (the pool, prefix cache and prefill attention), which re-exports the class and
:data:`DENSE_DECODE_BYTES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu_kernels
from .model import grouped_decode_attention


class PagedKVCache(Protocol):
    """What a decode attention reads of :class:`.kv_cache.PagedKVCache` (which imports this
    module, so it is not imported here): the pool and its shape."""

    k: torch.Tensor
    v: torch.Tensor
    device: torch.device
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int


def kept_rows(kept: Sequence[object], batch: Sequence[object]) -> tuple[list[int], int] | None:
    """How ``batch`` goes on from the last step's ``kept``: the rows of ``kept`` its first streams
    are, in order (all of them, or fewer where streams ended), and how many streams joined after
    them; None where it does not (a stream joined between kept ones, or none was kept)."""
    if len(kept) == len(batch) and all(a is b for a, b in zip(kept, batch)):
        return list(range(len(batch))), 0
    where = {id(r): i for i, r in enumerate(kept)}
    rows = [where.get(id(r), -1) for r in batch]
    stay = len(rows)
    while stay and rows[stay - 1] == -1:
        stay -= 1
    rows = rows[:stay]
    if not rows or -1 in rows or rows != sorted(rows) or any(kept[i] is not r for i, r in zip(rows, batch)):
        return None
    return rows, len(batch) - stay


def _block_table(tables: list[list[int]], width: int) -> np.ndarray:
    """``[len(tables), width]`` int64: each sequence's block ids, zeros past its own."""
    table = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return table


#: the most bytes a decode batch's dense K/V (every layer, K and V) may take; a batch past it gathers
#: each layer's K/V from the pool at every step instead
DENSE_DECODE_BYTES = 256 << 20


class DecodeAttention:
    """One new token for each of B sequences; sequence ``b`` has ``lengths[b]`` tokens including it.

    Paged (:attr:`paged`: the compiled kernels, float32 on a CPU): each layer's attention is
    :class:`.cpu_kernels.PagedDecode` over the pool, the tables and lengths checked once a batch;
    a step moves only the lengths and positions on. Otherwise:
    kept from step to step while the batch stays the same (:meth:`advance`): each layer's K/V is
    gathered from the pool once, into a dense ``[B, kv_heads, capacity, D]`` buffer per layer, and
    each later step writes only its new token there (beside the pool). Gathering every sequence's
    whole K/V anew at every step was most of a decode step at 32 sequences. A batch whose dense
    copy would pass :data:`DENSE_DECODE_BYTES` gathers at every step (the same numbers: the
    attention reads the same values, and masked positions weigh exactly 0)."""

    def __init__(self, cache: PagedKVCache, tables: list[list[int]], lengths: list[int]) -> None:
        self.cache = cache
        bs = cache.block_size
        width = max(len(t) for t in tables)
        # A table holds the whole reservation, so the batch never grows past it.
        self.table = _block_table(tables, width)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        #: attention by cpu_kernels.paged_decode (C, float32 on a CPU): the pool read through the block
        #: table, so no dense copy, no mask and no gather are kept; only positions move on a step
        self.paged = cpu_kernels.COMPILED and cache.device.type == "cpu" and cache.k.dtype == torch.float32
        self._out = torch.empty(0)
        self._decode: cpu_kernels.PagedDecode  # set with the paged tables (_positions)
        capacity = 0 if self.paged else max(width * bs, -(-max(lengths) // bs) * bs)
        per_layer = len(tables) * capacity * cache.kv_heads * cache.head_dim * cache.k.element_size()
        self.capacity = capacity if 2 * cache.num_layers * per_layer <= DENSE_DECODE_BYTES else 0
        self.dense: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cache.num_layers
        # Views made once, not per layer a step (each a dispatched op, a decode step has ~130):
        # each layer's pool K and V; each dense copy flat ([B * kv_heads * capacity, D], written)
        # and its first span (read; again when the span grows).
        self._pools = list(zip(cache.k.unbind(0), cache.v.unbind(0)))
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(0), torch.empty(0))
        ] * cache.num_layers
        self._read: list[tuple[int, torch.Tensor, torch.Tensor]] = [
            (0, torch.empty(0), torch.empty(0))
        ] * cache.num_layers
        self.dense_slots = self._mask_flat = self._open = torch.empty(0)  # set with a dense copy
        self.positions = self._mask_full = self.mask = self.new_slots = torch.empty(0)  # set below
        self._gather: torch.Tensor | None = None
        self._positions()

    def advance(self, rows: list[int] | None = None) -> None:
        """The next step of the same batch, every sequence one token longer; ``rows``: only these
        of its sequences go on (the others ended), their dense K/V kept rather than gathered anew."""
        if rows is not None:
            idx = np.asarray(rows, dtype=np.int64)
            self.table, self.lengths = self.table[idx], self.lengths[idx]
            keep = torch.from_numpy(idx).to(self.cache.device)
            for layer, d in enumerate(self.dense):
                if d is not None:
                    self._keep_dense(layer, (d[0].index_select(0, keep), d[1].index_select(0, keep)))
        self.lengths += 1
        if self.paged and rows is None:
            self._last += 1  # numpy's in-place add (~1 us) where a torch op costs ~3: positions view it
            return
        if rows is not None or not self.capacity:
            self._positions()
            return
        # The same rows one on: what moved is written in place (one op each), not built anew (the
        # whole rebuild was ~50 us a step at 32 sequences, ~5% of a decode step): each row's
        # position and dense slot one on, its new position unmasked; the same values as a rebuild.
        bs = self.cache.block_size
        lens = self.lengths
        last = lens - 1
        self.span = -(-int(lens.max()) // bs) * bs
        new_slots = self.table[self._rows, last // bs] * bs + last % bs
        self.new_slots = torch.from_numpy(new_slots).to(self.cache.device)
        self.positions.add_(1)
        self.dense_slots.add_(1)
        self._open.add_(1)
        self._mask_flat.index_fill_(0, self._open, 0.0)
        self.mask = self._mask_full[:, None, None, : self.span]
        self._gather = None

    def join(self, tables: list[list[int]], lengths: list[int]) -> bool:
        """Sequences that joined the batch (after :meth:`advance` of the others): their rows appended,
        their K/V gathered from the pool into the dense copy beside the kept rows' (a stream that
        started gathered every running stream's K/V again, ~0.8 ms a join at 32 x 80 positions);
        the same values as a batch built anew. False where they do not fit its dense copy (a wider
        table, past DENSE_DECODE_BYTES, none kept): the caller builds one anew."""
        bs, width, n = self.cache.block_size, self.table.shape[1], len(tables)
        if self.paged:  # nothing dense to grow: the rows appended (the table widened if need be)
            wider = max(width, *map(len, tables))
            kept = np.zeros((self.lengths.size, wider), dtype=np.int64)
            kept[:, :width] = self.table
            self.table = np.concatenate([kept, _block_table(tables, wider)])
            self.lengths = np.concatenate([self.lengths, np.asarray(lengths, dtype=np.int64)])
            self._positions()
            return True
        rows = self.lengths.size + n
        per_row = self.capacity * self.cache.kv_heads * self.cache.head_dim * self.cache.k.element_size()
        too_big = 2 * self.cache.num_layers * rows * per_row > DENSE_DECODE_BYTES
        if not self.capacity or too_big or max(map(len, tables)) > width or max(lengths) > self.capacity:
            return False
        table = _block_table(tables, width)
        self.table = np.concatenate([self.table, table])
        self.lengths = np.concatenate([self.lengths, np.asarray(lengths, dtype=np.int64)])
        span = -(-max(lengths) // bs) * bs
        offsets = np.arange(span, dtype=np.int64)
        slots = torch.from_numpy(table[:, offsets // bs] * bs + offsets % bs).to(self.cache.device)
        for layer, dense in enumerate(self.dense):
            if dense is None:  # not gathered yet: attend gathers every row
                continue
            grown = []
            for pool, old in zip(self._pools[layer], dense):
                joined = pool.index_select(0, slots.reshape(-1)).unflatten(0, slots.shape).transpose(1, 2)
                both = old.new_zeros((rows, *old.shape[1:]))
                both[: old.shape[0]] = old
                both[old.shape[0] :, :, :span] = joined
                grown.append(both)
            self._keep_dense(layer, (grown[0], grown[1]))
        self._positions()
        return True

    def _positions(self) -> None:
        bs = self.cache.block_size
        device = self.cache.device
        lens = self.lengths
        last = lens - 1
        self._rows = np.arange(lens.size)
        if self.paged:
            self._last = last.copy()
            self.positions = torch.from_numpy(self._last)
            # the arrays' memory (advance moves lengths on in place), their checks made once
            table, lengths = torch.from_numpy(self.table), torch.from_numpy(self.lengths)
            self._decode = cpu_kernels.PagedDecode(self.cache.k, self.cache.v, table, lengths, bs)
            return
        # Built with numpy on the host in one go, then moved: one small copy per step instead of
        # a tensor per row. Only as many blocks as the longest sequence needs are read.
        self.span = -(-int(lens.max()) // bs) * bs
        new_slots = self.table[self._rows, last // bs] * bs + last % bs
        self.new_slots = torch.from_numpy(new_slots).to(device)
        #: each sequence's new token's position (the model's input), kept on by :meth:`advance`
        self.positions = torch.from_numpy(last.copy()).to(device)
        # An additive mask: a boolean one is turned into this by every layer's attention (the same
        # numbers: SDPA adds 0 or -inf either way). With a dense copy it is as wide as the copy and
        # advance unmasks one position a row in place; the attention reads the first span.
        width = self.capacity or self.span
        valid = np.arange(width, dtype=np.int64)[None, :] < lens[:, None]
        mask = torch.from_numpy(np.where(valid, np.float32(0.0), np.float32(-np.inf)))
        self._mask_full = mask.to(device, self.cache.k.dtype)  # [B, width]
        self.mask = self._mask_full[:, None, None, : self.span]  # [B, 1, 1, span]
        if self.capacity:
            # Where each sequence's new token goes in the flat [B * kv_heads * capacity, D] view of
            # a dense buffer: one index_copy_ a buffer (indexing [rows, :, last] cost twice that).
            heads = self.cache.kv_heads
            rows = self._rows[:, None] * heads + np.arange(heads, dtype=np.int64)
            self.dense_slots = torch.from_numpy((rows * self.capacity + last[:, None]).reshape(-1)).to(device)
            self._mask_flat = self._mask_full.view(-1)
            #: each row's new position in the flat mask (the one advance unmasks next)
            self._open = torch.from_numpy(self._rows * self.capacity + last).to(device)
        self._gather = None

    def gather_slots(self) -> torch.Tensor:
        """``[B, span]``: the pool slot of each sequence's positions ``0..span-1``."""
        if self._gather is None:
            bs = self.cache.block_size
            offsets = np.arange(self.span, dtype=np.int64)
            gather = self.table[:, offsets // bs] * bs + offsets % bs
            self._gather = torch.from_numpy(gather).to(self.cache.device)
        return self._gather

    def _keep_dense(self, layer: int, dense: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.dense[layer] = dense
        self._flat[layer] = (dense[0].view(-1, dense[0].shape[-1]), dense[1].view(-1, dense[1].shape[-1]))
        self._read[layer] = (0, dense[0], dense[1])  # no span read yet

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.paged:
            out = self._out  # one buffer a batch for every layer: each layer's o_proj reads it first
            if out.shape != q.shape:
                out = self._out = q.new_empty(q.shape)
            self._decode(layer, q, k, v, out)
            return out
        pool_k, pool_v = self._pools[layer]
        pool_k.index_copy_(0, self.new_slots, k)
        pool_v.index_copy_(0, self.new_slots, v)
        dense = self.dense[layer]
        if dense is None:
            # index_select of the flat slots, not pool[slots]: the same rows, ~10x faster on a CPU
            # (aten::index took ~155 us a layer's K at 32 x 80 positions, index_select ~15): a
            # batch that gathers at every step (past DENSE_DECODE_BYTES) or that streams joined
            slots = self.gather_slots()
            flat = slots.reshape(-1)
            # [B, kv_heads, span, D]
            kh = pool_k.index_select(0, flat).unflatten(0, slots.shape).transpose(1, 2)
            vh = pool_v.index_select(0, flat).unflatten(0, slots.shape).transpose(1, 2)
            if self.capacity:
                shape = (kh.shape[0], kh.shape[1], self.capacity, kh.shape[3])
                dense = (kh.new_zeros(shape), vh.new_zeros(shape))
                dense[0][:, :, : self.span] = kh
                dense[1][:, :, : self.span] = vh
                self._keep_dense(layer, dense)
        else:
            rows = k.shape[0] * k.shape[1]
            flat_k, flat_v = self._flat[layer]
            flat_k.index_copy_(0, self.dense_slots, k.reshape(rows, -1))
            flat_v.index_copy_(0, self.dense_slots, v.reshape(rows, -1))
        if dense is not None:
            span, kh, vh = self._read[layer]
            if span != self.span:
                kh, vh = dense[0][:, :, : self.span], dense[1][:, :, : self.span]
                self._read[layer] = (self.span, kh, vh)
        if self.cache.device.type == "cpu":
            return grouped_decode_attention(q, kh, vh, self.mask)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kh, vh, attn_mask=self.mask, enable_gqa=True)
        return out.squeeze(2)


__all__ = ["DENSE_DECODE_BYTES", "DecodeAttention", "kept_rows"]
