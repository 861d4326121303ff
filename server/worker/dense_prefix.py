"""A chunked prompt's K/V so far, kept dense between its chunk steps.

A chunk at position ``s`` attends over the ``s`` positions before it. Gathered from the paged pool
at every chunk step (an ``index_select`` of ``s`` slots, K and V, every layer), that gather was,
with the attention itself, what a chunk deep in a long prompt cost whatever its tokens: at a
16,384-token context on a CPU a 16-token chunk's step took 6-14 ms against a 0.7 ms decode step,
so no chunk size kept the running streams' pace. :class:`DensePrefix` keeps one prompt's K/V
contiguous (each layer's ``[capacity, kv_heads, head_dim]``), written beside the pool by each chunk,
so the next chunk attends over a view of it.

The pool stays the truth: a layer's dense copy is used only where it holds exactly the positions
before the chunk (``filled == start``); any other case (the prompt's first chunk past a cached
prefix, a failed step's chunk run again, a chunk that went through a batched attention) copies
the prefix from the pool once more. The cache keeps one (the prompt being cut, oldest first, is
one at a time) and drops it when that sequence's blocks are freed; a prompt whose copy would pass
:data:`DENSE_PREFILL_BYTES` gathers at every chunk as before.
"""

from __future__ import annotations

import torch

#: the most bytes one prompt's dense K/V (every layer, K and V) may take
DENSE_PREFILL_BYTES = 64 << 20


class DensePrefix:
    def __init__(self, blocks: list[int], capacity: int) -> None:
        #: the sequence's block list (the request's own object: identity says whose copy this is)
        self.blocks = blocks
        self.capacity = capacity
        #: per layer: dense K, dense V, how many positions from 0 they hold
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    @staticmethod
    def fits(capacity: int, layers: int, k: torch.Tensor) -> bool:
        """Whether a prompt of ``capacity`` positions may keep a dense copy of a pool like ``k``
        (one layer's ``[slots, kv_heads, head_dim]``)."""
        return 2 * layers * capacity * k[0].numel() * k.element_size() <= DENSE_PREFILL_BYTES

    def extend(
        self,
        layer: int,
        start: int,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk's ``k``/``v`` (``[T, kv_heads, head_dim]`` at ``start``) added; K and V of
        positions ``0..start+T-1``, ``[start+T, kv_heads, head_dim]`` views. ``slots``: the pool
        slots of those positions (read only where the dense copy does not hold the prefix)."""
        end = start + k.shape[0]
        held = self.layers.get(layer)
        if held is None or held[2] != start:
            dk = pool[0].new_empty((self.capacity, *pool[0].shape[1:]))
            dv = pool[1].new_empty((self.capacity, *pool[1].shape[1:]))
            if start:
                assert slots is not None
                dk[:start] = pool[0].index_select(0, slots[:start])
                dv[:start] = pool[1].index_select(0, slots[:start])
        else:
            dk, dv = held[0], held[1]
        dk[start:end] = k
        dv[start:end] = v
        self.layers[layer] = (dk, dv, end)
        return dk[:end], dv[:end]


__all__ = ["DENSE_PREFILL_BYTES", "DensePrefix"]
