"""Chunk hashes for routing, pure-Python twin of ``fastcore._hash``: the definition of the hash."""

from __future__ import annotations

import operator

import numpy as np

from ._scan_py import _body_view

# ``chunk_hashes(data, start, end, chunk)``: one 64-bit hash per FULL chunk of ``data[start:end]``,
# chained, so hash i covers chunks 0..i and two byte strings share their first k hashes exactly when
# they share their first k chunks (up to 64-bit collisions). The orchestrator's kv_cache_aware router
# keys its per-worker prefix index with them (server/orchestrator/routing/prefix_index.py). The function, both
# twins, bit for bit:
#
# - a chunk is ``chunk`` bytes, a multiple of 32 in [32, CHUNK_MAX]; its bytes are read as
#   little-endian uint64 words w[0..chunk/8), word k going to lane k % 4;
# - four lanes start at CHUNK_LANE_SEEDS; each word steps its lane: a = (a ^ w) * CHUNK_PRIMES[lane]
#   (mod 2**64), then a ^= a >> 29: 8 bytes per step, the four lanes independent (so the multiplies
#   of a step overlap in the CPU);
# - the chunk's digest is d = a0 ^ rotl(a1, 17) ^ rotl(a2, 31) ^ rotl(a3, 47);
# - the chain: h starts at CHUNK_CHAIN_SEED; for each chunk h = fmix64((h * CHUNK_CHAIN_MUL) ^ d)
#   (MurmurHash3's 64-bit finalizer), and that h is the chunk's hash.
#
# Not a cryptographic hash: a collision only routes one request to a worse worker.

CHUNK_MAX = 1 << 20
CHUNK_LANE_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89)
CHUNK_PRIMES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
CHUNK_CHAIN_SEED = 0x452821E638D01377
CHUNK_CHAIN_MUL = 0x9FB21C651E98DF25
_M64 = (1 << 64) - 1
_SEEDS = np.array(CHUNK_LANE_SEEDS, dtype=np.uint64)
_PRIMES = np.array(CHUNK_PRIMES, dtype=np.uint64)
_U64LE = np.dtype("<u8")


def _rotl(x: np.ndarray, k: int) -> np.ndarray:
    return (x << np.uint64(k)) | (x >> np.uint64(64 - k))


def check_chunk_args(size: int, start: object, end: object, chunk: object) -> tuple[int, int, int]:
    """``start``, ``end``, ``chunk`` as ints, or ``ValueError`` naming the bad one (both twins' words)."""
    start, end, chunk = operator.index(start), operator.index(end), operator.index(chunk)  # type: ignore[arg-type]
    if not 0 <= start <= size:
        raise ValueError(f"start must be in [0, len(data) = {size}], got {start}")
    if not start <= end <= size:
        raise ValueError(f"end must be in [start = {start}, len(data) = {size}], got {end}")
    if not 32 <= chunk <= CHUNK_MAX or chunk % 32:
        raise ValueError(f"chunk must be a multiple of 32 in [32, {CHUNK_MAX}], got {chunk}")
    return start, end, chunk


def chunk_hashes(data: bytes | bytearray | memoryview, start: int, end: int, chunk: int) -> list[int]:
    """The chained 64-bit hashes of the full ``chunk``-byte chunks of ``data[start:end]`` (see above).

    A tail shorter than ``chunk`` has no hash. Raises ``ValueError`` naming ``start``, ``end`` or
    ``chunk`` when one is out of range, ``TypeError`` for a ``data`` that is not bytes-like.
    """
    view = _body_view(data)
    start, end, chunk = check_chunk_args(len(view), start, end, chunk)
    n = (end - start) // chunk
    if not n:
        return []
    steps = chunk // 32
    words = np.frombuffer(view, dtype=_U64LE, count=n * chunk // 8, offset=start).reshape(n, steps, 4)
    lanes = np.tile(_SEEDS, (n, 1))
    shift = np.uint64(29)
    for step in range(steps):  # every chunk at once: chunks are independent until the chain
        lanes ^= words[:, step, :]
        lanes *= _PRIMES  # wraps mod 2**64
        lanes ^= lanes >> shift
    digests = lanes[:, 0] ^ _rotl(lanes[:, 1], 17) ^ _rotl(lanes[:, 2], 31) ^ _rotl(lanes[:, 3], 47)
    out = []
    h = CHUNK_CHAIN_SEED
    for d in digests.tolist():
        x = ((h * CHUNK_CHAIN_MUL) & _M64) ^ d
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & _M64
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & _M64
        h = x ^ (x >> 33)
        out.append(h)
    return out


__all__ = ["CHUNK_MAX", "check_chunk_args", "chunk_hashes"]
