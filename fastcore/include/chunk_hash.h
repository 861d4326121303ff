/* Chained 64-bit hashes of fixed-size chunks: the orchestrator's prefix-cache
 * routing keys (fastcore/_hash.pyx). fastcore/_hash_py.py defines the hash and
 * holds the same constants (the compiled module checks them at import); this
 * is the same arithmetic, four independent lanes per step.
 */
#ifndef FASTCORE_CHUNK_HASH_H
#define FASTCORE_CHUNK_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FC_CH_SEED0 0x243F6A8885A308D3ULL
#define FC_CH_SEED1 0x13198A2E03707344ULL
#define FC_CH_SEED2 0xA4093822299F31D0ULL
#define FC_CH_SEED3 0x082EFA98EC4E6C89ULL
#define FC_CH_P0 0x9E3779B97F4A7C15ULL
#define FC_CH_P1 0xC2B2AE3D27D4EB4FULL
#define FC_CH_P2 0x165667B19E3779F9ULL
#define FC_CH_P3 0xD6E8FEB86659FD93ULL
#define FC_CH_CHAIN_SEED 0x452821E638D01377ULL
#define FC_CH_CHAIN_MUL 0x9FB21C651E98DF25ULL

static inline uint64_t fc_ch_load(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t fc_ch_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

#define FC_CH_STEP(a, w, prime) \
    do {                        \
        (a) = ((a) ^ (w)) * (prime); \
        (a) ^= (a) >> 29;       \
    } while (0)

/* out[i] = the chained hash of chunks 0..i of p (n full chunks of `chunk` bytes, a multiple of 32). */
static void fc_chunk_hashes(const uint8_t *p, Py_ssize_t n, Py_ssize_t chunk, uint64_t *out) {
    uint64_t h = FC_CH_CHAIN_SEED;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *q = p + i * chunk, *stop = q + chunk;
        uint64_t a0 = FC_CH_SEED0, a1 = FC_CH_SEED1, a2 = FC_CH_SEED2, a3 = FC_CH_SEED3;
        for (; q < stop; q += 32) {
            FC_CH_STEP(a0, fc_ch_load(q), FC_CH_P0);
            FC_CH_STEP(a1, fc_ch_load(q + 8), FC_CH_P1);
            FC_CH_STEP(a2, fc_ch_load(q + 16), FC_CH_P2);
            FC_CH_STEP(a3, fc_ch_load(q + 24), FC_CH_P3);
        }
        uint64_t x = (h * FC_CH_CHAIN_MUL) ^ (a0 ^ fc_ch_rotl(a1, 17) ^ fc_ch_rotl(a2, 31) ^ fc_ch_rotl(a3, 47));
        x ^= x >> 33;
        x *= 0xFF51AFD7ED558CCDULL;
        x ^= x >> 33;
        x *= 0xC4CEB9FE1A85EC53ULL;
        h = x ^ (x >> 33);
        out[i] = h;
    }
}

#endif
