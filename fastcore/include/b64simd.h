/* Base64 (RFC 4648 section 4, standard alphabet, '=' padded) kernels for the
 * token codec, with run-time dispatch between a portable scalar loop and
 * SSSE3 / AVX2 / AVX-512 VBMI kernels.
 *
 * Plain C, no Python: the Cython modules (_codec.pyx; _scan.pyx for the
 * alphabet check) own the Python objects, the buffer protocol and the
 * exceptions; everything here runs without the GIL.
 */
#ifndef FASTCORE_B64SIMD_H
#define FASTCORE_B64SIMD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Kernel identifiers, in order of preference. */
enum {
    FC_SIMD_SCALAR = 0,
    FC_SIMD_SSSE3 = 1,
    FC_SIMD_AVX2 = 2,
    FC_SIMD_AVX512VBMI = 3,
    FC_SIMD_COUNT = 4
};

/* Decode status codes; the Cython layer maps each to one exception message. */
enum {
    FC_B64_OK = 0,
    FC_B64_BAD_CHAR = 1,         /* byte outside the alphabet at *bad_offset */
    FC_B64_MISPLACED_PAD = 2,    /* '=' at *bad_offset that is not final padding */
    FC_B64_NONZERO_PAD_BITS = 3  /* last data character at *bad_offset has unused bits set */
};

/* Fills the tables and picks the best kernel this CPU (and OS) supports.
 * Idempotent; called once at module import. */
void fc_b64_init(void);

/* 1 if kernel `path` was compiled in and this CPU can run it. */
int fc_simd_available(int path);
/* Selects kernel `path`; returns 0, or -1 (selection unchanged) if unavailable. */
int fc_simd_select(int path);
int fc_simd_selected(void);
const char *fc_simd_name(int path);

/* Base64 length of `nbytes` input bytes: 4 * ceil(nbytes / 3). */
static inline size_t fc_b64_encoded_len(size_t nbytes) { return (nbytes + 2) / 3 * 4; }

/* Encodes src[0..nbytes) into dst (fc_b64_encoded_len(nbytes) bytes), padded. */
void fc_b64_encode(const uint8_t *src, size_t nbytes, char *dst);

/* Strict decode of src[0..len): len is a multiple of 4 and `pad` (0, 1 or 2)
 * is the number of trailing '=' the caller found in the last two bytes. Writes
 * exactly len / 4 * 3 - pad bytes to dst. On failure returns a FC_B64_* code
 * and the offset of the first offending byte in *bad_offset; dst then holds
 * garbage up to that point. */
int fc_b64_decode(const char *src, size_t len, int pad, uint8_t *dst, size_t *bad_offset);

/* First index in [i, n) outside the standard alphabet ('=' is outside): a validation pass with no
 * output, for relays that check base64 they pass on. `path`: the FC_SIMD_* kernel to use (the caller's
 * fc_simd_selected(), which this CPU runs): AVX-512 VBMI, AVX2, else SSE2 and scalar. Needs no
 * fc_b64_init(). */
size_t fc_b64_alphabet_run(const uint8_t *p, size_t i, size_t n, int path);

/* Narrows `count` integers, each `itemsize` (1, 2, 4 or 8) bytes, signed or
 * not, byte-swapped or not, found at base + i * stride, to int32 and encodes
 * their little-endian bytes into dst (fc_b64_encoded_len(4 * count) bytes).
 * Returns -1, or the index of the first value outside int32 (dst is then
 * incomplete). */
int64_t fc_encode_ints(const char *base, size_t count, ptrdiff_t stride, int itemsize, int is_signed,
                       int byteswap, char *dst);

/* Byte-swaps count int32 in place when the host is big-endian (the wire format
 * is little-endian); a no-op on little-endian hosts. */
void fc_le32_to_host(int32_t *values, size_t count);

#ifdef __cplusplus
}
#endif

#endif
