"""The per-worker prefix index: chunk hash -> recency, bounded, with a worker's second tier."""

from __future__ import annotations

from collections.abc import Collection


def held_prefix(hashes: list[int], held: Collection[int]) -> int:
    """How many leading ``hashes`` are in ``held``, given that ``hashes[0]`` is (binary search: a
    chain's holders are prefix-closed, so membership only ever turns off along it)."""
    lo, hi = 1, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """One worker's approximate cache: chunk hash -> recency, bounded to ``limit`` entries.

    Within a request the prefix's hashes get the higher recency, so eviction drops the tails of
    chains first and what stays of a chain is (nearly always) a prefix of it, as in a prefix cache.
    Eviction is amortized: past 5/4 of the bound, the oldest are dropped down to the bound.
    """

    __slots__ = ("entries", "limit", "tier2", "tier2_limit")

    def __init__(self, limit: int, tier2_limit: int = 0) -> None:
        self.limit = limit
        self.entries: dict[int, int] = {}
        #: the entries in the worker's second tier (the rest are on its device)
        self.tier2: set[int] = set()
        #: an approximate index's tier 2 (its eviction spills there, ``tier2_limit`` entries LRU)
        self.tier2_limit = tier2_limit

    def tier2_count(self, hashes: list[int], held: int) -> int:
        """How many of the first ``held`` hashes are in tier 2."""
        tier2 = self.tier2
        return sum(1 for h in hashes[:held] if h in tier2) if tier2 else 0

    def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading hashes this worker holds (binary search: chains are prefix-closed)."""
        entries = self.entries
        if not entries or not hashes or hashes[0] not in entries:
            return 0
        return held_prefix(hashes, entries)

    def add(self, hashes: list[int], clock: int) -> list[int]:
        """Hold ``hashes`` on the device (the prefix most recent); the hashes evicted to stay in
        bound. With a ``tier2_limit`` the least recent past ``limit`` are in tier 2 instead."""
        n = len(hashes)
        entries, tier2, limit = self.entries, self.tier2, self.limit
        entries.update(zip(hashes, range(clock + n, clock, -1)))
        if tier2:
            tier2.difference_update(hashes)
        total = limit + self.tier2_limit
        if len(entries) - len(tier2) <= limit + (limit >> 2) and len(entries) <= total + (total >> 2):
            return []
        ranked = sorted(entries.items(), key=lambda item: item[1], reverse=True)
        self.entries = dict(ranked[:total])
        if self.tier2_limit:
            self.tier2 = {h for h, _ in ranked[limit:total]}
        elif tier2:
            self.tier2 = {h for h in tier2 if h in self.entries}
        return [h for h, _ in ranked[total:]]
