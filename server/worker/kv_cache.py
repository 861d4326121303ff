"""Paged KV cache: a pool of fixed-size blocks per layer, and the attention backends over it.

Each sequence owns a list of blocks (its block table); token ``p`` of a
sequence lives in slot ``table[p // block_size] * block_size + p % block_size``
of the flat ``[num_blocks * block_size, kv_heads, head_dim]`` view. The pool's
size is the worker's KV token budget: requests reserve
``ceil((prompt + max_tokens) / block_size)`` blocks on admission, so a request
that was admitted never runs out of cache, and one that does not fit is
refused up front (503) instead of failing midway.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from .engine_api import KVCacheFull
from .model import ModelConfig


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_tokens: int,
        *,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = max(1, num_tokens // block_size)
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.kv_heads
        self.head_dim = config.dim_per_head
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (self.num_layers, self.num_blocks * block_size, self.kv_heads, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=dtype)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        # Taken by the event loop (admission, hand-off) and the engine thread (frees).
        self._lock = threading.Lock()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_tokens(self) -> int:
        return self.used_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int) -> list[int]:
        need = self.blocks_for(num_tokens)
        if need > self.num_blocks:
            raise KVCacheFull(
                f"needs {need * self.block_size} KV tokens; this worker's whole KV cache holds {self.capacity_tokens}",
                ever_fits=False,
            )
        with self._lock:
            if need > len(self._free):
                raise KVCacheFull(
                    f"needs {need * self.block_size} KV tokens, {len(self._free) * self.block_size} free "
                    f"of {self.capacity_tokens}"
                )
            blocks = [self._free.pop() for _ in range(need)]
        return blocks

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(blocks)

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions ``start..end-1`` of a sequence with these blocks."""
        table = torch.tensor(blocks, dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def read(self, blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first ``num_tokens`` positions: ``[layers, T, kv_heads, head_dim]``."""
        idx = self.slots(blocks, 0, num_tokens)
        return self.k.index_select(1, idx), self.v.index_select(1, idx)

    def write(self, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (``[layers, T, kv_heads, head_dim]``) at positions ``0..T-1``."""
        idx = self.slots(blocks, 0, k.shape[1])
        self.k.index_copy_(1, idx, k.to(self.device, self.dtype))
        self.v.index_copy_(1, idx, v.to(self.device, self.dtype))


class PrefillAttention:
    """One sequence, tokens at positions ``start..start+T-1``, attending to all earlier positions."""

    def __init__(self, cache: PagedKVCache, blocks: list[int], start: int, length: int) -> None:
        self.cache = cache
        self.start = start
        self.length = length
        self.new_slots = cache.slots(blocks, start, start + length)
        self.all_slots = cache.slots(blocks, 0, start + length) if start else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.k[layer].index_copy_(0, self.new_slots, k)
        self.cache.v[layer].index_copy_(0, self.new_slots, v)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
        if self.all_slots is None:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            kh = self.cache.k[layer].index_select(0, self.all_slots).transpose(0, 1).unsqueeze(0)
            vh = self.cache.v[layer].index_select(0, self.all_slots).transpose(0, 1).unsqueeze(0)
            total = self.start + self.length
            q_pos = torch.arange(self.start, total, device=q.device)[:, None]
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


class DecodeAttention:
    """One new token for each of B sequences; sequence ``b`` has ``lengths[b]`` tokens including it."""

    def __init__(self, cache: PagedKVCache, tables: list[list[int]], lengths: list[int]) -> None:
        bs = cache.block_size
        device = cache.device
        width = max(len(t) for t in tables)
        padded = torch.zeros((len(tables), width), dtype=torch.int64)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        # Only as many blocks as the longest sequence needs: the gather is the step's main cost.
        longest = max(lengths)
        span = -(-longest // bs) * bs
        offsets = torch.arange(span, dtype=torch.int64)
        # Built on the host in one go, then moved: one small copy per step instead of many tiny kernels.
        gather = padded[:, offsets // bs] * bs + offsets % bs  # [B, span]
        lens = torch.tensor(lengths, dtype=torch.int64)
        new_slots = gather[torch.arange(len(tables)), lens - 1]
        self.gather_slots = gather.to(device)
        self.mask = (offsets[None, :] < lens[:, None]).to(device)[:, None, None, :]  # [B, 1, 1, span]
        self.new_slots = new_slots.to(device)
        self.cache = cache

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.k[layer].index_copy_(0, self.new_slots, k)
        self.cache.v[layer].index_copy_(0, self.new_slots, v)
        kh = self.cache.k[layer][self.gather_slots].transpose(1, 2)  # [B, kv_heads, span, D]
        vh = self.cache.v[layer][self.gather_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kh, vh, attn_mask=self.mask, enable_gqa=True)
        return out.squeeze(2)


__all__ = ["DecodeAttention", "KVCacheFull", "PagedKVCache", "PrefillAttention"]
