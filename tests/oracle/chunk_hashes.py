"""``chunk_hashes``' reference: the hash as ``fastcore._hash_py``'s comment defines it, word by word in
Python ints (no numpy), which test_chunk_hashes holds both twins to."""

from __future__ import annotations

from fastcore import _hash_py as py

M64 = (1 << 64) - 1


def reference(data: bytes, chunk: int) -> list[int]:
    """The hash as _hash_py's comment defines it, word by word in Python ints (no numpy)."""

    def rotl(x: int, k: int) -> int:
        return ((x << k) | (x >> (64 - k))) & M64

    out, h = [], py.CHUNK_CHAIN_SEED
    for i in range(len(data) // chunk):
        lanes = list(py.CHUNK_LANE_SEEDS)
        part = data[i * chunk : (i + 1) * chunk]
        for k in range(chunk // 8):
            w = int.from_bytes(part[8 * k : 8 * k + 8], "little")
            a = ((lanes[k % 4] ^ w) * py.CHUNK_PRIMES[k % 4]) & M64
            lanes[k % 4] = a ^ (a >> 29)
        d = lanes[0] ^ rotl(lanes[1], 17) ^ rotl(lanes[2], 31) ^ rotl(lanes[3], 47)
        x = ((h * py.CHUNK_CHAIN_MUL) & M64) ^ d
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & M64
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & M64
        h = x ^ (x >> 33)
        out.append(h)
    return out
