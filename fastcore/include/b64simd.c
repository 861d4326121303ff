/* Base64 kernels for the token codec; see b64simd.h for the contract.
 *
 * The vector kernels follow W. Mula and D. Lemire, "Faster Base64 Encoding and
 * Decoding Using AVX2 Instructions", ACM Transactions on the Web 12(3), 2018
 * (SSSE3/AVX2: pshufb reshuffle + multiply-shift to split 6-bit fields, a
 * nibble-indexed bitmask lookup to validate, maddubs/madd to pack), and
 * "Base64 encoding and decoding at almost the speed of a memory copy",
 * Software: Practice and Experience 50(2), 2020 (AVX-512 VBMI: vpermb /
 * vpmultishiftqb lookups). Each function carries a target attribute, so this
 * file compiles without -mavx2 and the module still runs on any x86-64; the
 * choice is made once, at import, by fc_b64_init().
 *
 * Error reporting: a vector kernel only says "this block has a bad byte" and
 * stops before it; the scalar loop then re-decodes that block and names the
 * exact offset, so the offset never depends on which kernel ran.
 */
#include "b64simd.h"

#include <string.h>

#include "cpu.h"

#if FC_X86
#include <immintrin.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define FC_BIG_ENDIAN 1
#else
#define FC_BIG_ENDIAN 0
#endif

static const char ENCODE_ALPHABET[65] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* 6-bit value of each byte; DEC_PAD for '=', DEC_BAD for everything else. */
#define DEC_PAD 0x40
#define DEC_BAD 0x80
static uint8_t DECODE_TABLE[256];
/* The same for bytes 0..127, with '=' bad too: the AVX-512 lookup table. */
static uint8_t DECODE_TABLE_7BIT[128];

typedef size_t (*encode_kernel_fn)(const uint8_t *src, size_t nbytes, char *dst);
typedef size_t (*decode_kernel_fn)(const char *src, size_t len, uint8_t *dst);

static int selected_path = FC_SIMD_SCALAR;
static int cpu_supports[FC_SIMD_COUNT] = {1, 0, 0, 0};
static int initialised = 0;

/* ------------------------------------------------------------------ scalar */

static size_t encode_scalar_blocks(const uint8_t *src, size_t nbytes, char *dst) {
    size_t i = 0;
    for (; i + 3 <= nbytes; i += 3) {
        uint32_t v = (uint32_t)src[i] << 16 | (uint32_t)src[i + 1] << 8 | src[i + 2];
        dst[0] = ENCODE_ALPHABET[v >> 18];
        dst[1] = ENCODE_ALPHABET[(v >> 12) & 63];
        dst[2] = ENCODE_ALPHABET[(v >> 6) & 63];
        dst[3] = ENCODE_ALPHABET[v & 63];
        dst += 4;
    }
    return i;
}

static void encode_scalar_tail(const uint8_t *src, size_t rest, char *dst) {
    if (rest == 1) {
        dst[0] = ENCODE_ALPHABET[src[0] >> 2];
        dst[1] = ENCODE_ALPHABET[(src[0] & 3) << 4];
        dst[2] = '=';
        dst[3] = '=';
    } else if (rest == 2) {
        dst[0] = ENCODE_ALPHABET[src[0] >> 2];
        dst[1] = ENCODE_ALPHABET[(src[0] & 3) << 4 | src[1] >> 4];
        dst[2] = ENCODE_ALPHABET[(src[1] & 15) << 2];
        dst[3] = '=';
    }
}

/* Decodes whole quads of src[0..len); stops at the first quad holding a byte
 * that is not in the alphabet. Returns FC_B64_OK or the status, with the
 * offset (relative to src) of that byte. */
static int decode_scalar_quads(const char *src, size_t len, uint8_t *dst, size_t *bad_offset) {
    const uint8_t *s = (const uint8_t *)src;
    for (size_t i = 0; i + 4 <= len; i += 4) {
        uint8_t a = DECODE_TABLE[s[i]], b = DECODE_TABLE[s[i + 1]];
        uint8_t c = DECODE_TABLE[s[i + 2]], d = DECODE_TABLE[s[i + 3]];
        if ((a | b | c | d) & (DEC_BAD | DEC_PAD)) {
            for (size_t k = i; k < i + 4; k++) {
                uint8_t v = DECODE_TABLE[s[k]];
                if (v & (DEC_BAD | DEC_PAD)) {
                    *bad_offset = k;
                    return (v & DEC_PAD) ? FC_B64_MISPLACED_PAD : FC_B64_BAD_CHAR;
                }
            }
        }
        uint32_t v = (uint32_t)a << 18 | (uint32_t)b << 12 | (uint32_t)c << 6 | d;
        dst[0] = (uint8_t)(v >> 16);
        dst[1] = (uint8_t)(v >> 8);
        dst[2] = (uint8_t)v;
        dst += 3;
    }
    return FC_B64_OK;
}

static size_t decode_kernel_none(const char *src, size_t len, uint8_t *dst) {
    (void)src;
    (void)len;
    (void)dst;
    return 0;
}

/* -------------------------------------------------------------------- x86 */
#if FC_X86

/* Mula-Lemire split of 24 bits per 32-bit lane (bytes arranged b1 b0 b2 b1 by
 * the pshufb before) into four 6-bit indices, one per byte: the and/mulhi
 * pair moves fields a and c into place, the and/mullo pair fields b and d. */
__attribute__((target("ssse3"))) static inline __m128i split_6bit_128(__m128i in) {
    __m128i ac = _mm_mulhi_epu16(_mm_and_si128(in, _mm_set1_epi32(0x0fc0fc00)), _mm_set1_epi32(0x04000040));
    __m128i bd = _mm_mullo_epi16(_mm_and_si128(in, _mm_set1_epi32(0x003f03f0)), _mm_set1_epi32(0x01000010));
    return _mm_or_si128(ac, bd);
}

__attribute__((target("avx2"))) static inline __m256i split_6bit_256(__m256i in) {
    __m256i ac = _mm256_mulhi_epu16(_mm256_and_si256(in, _mm256_set1_epi32(0x0fc0fc00)),
                                    _mm256_set1_epi32(0x04000040));
    __m256i bd = _mm256_mullo_epi16(_mm256_and_si256(in, _mm256_set1_epi32(0x003f03f0)),
                                    _mm256_set1_epi32(0x01000010));
    return _mm256_or_si256(ac, bd);
}

__attribute__((target("ssse3"))) static inline __m128i encode_translate_128(__m128i indices) {
    /* Offset to add per range: [0,26) +65, [26,52) +71, [52,62) -4, 62 -19, 63 -16. */
    const __m128i offsets = _mm_setr_epi8(65, 71, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -19, -16, 0, 0);
    __m128i range = _mm_subs_epu8(indices, _mm_set1_epi8(51));
    range = _mm_sub_epi8(range, _mm_cmpgt_epi8(indices, _mm_set1_epi8(25)));
    return _mm_add_epi8(indices, _mm_shuffle_epi8(offsets, range));
}

__attribute__((target("ssse3"))) static size_t encode_ssse3(const uint8_t *src, size_t nbytes, char *dst) {
    const __m128i arrange = _mm_setr_epi8(1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10);
    size_t i = 0;
    /* Each step loads 16 bytes and consumes 12. */
    for (; i + 16 <= nbytes; i += 12) {
        __m128i in = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + i)), arrange);
        _mm_storeu_si128((__m128i *)dst, encode_translate_128(split_6bit_128(in)));
        dst += 16;
    }
    return i;
}

__attribute__((target("avx2"))) static inline __m256i encode_translate_256(__m256i indices) {
    const __m256i offsets = _mm256_setr_epi8(65, 71, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -19, -16, 0, 0,
                                             65, 71, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -19, -16, 0, 0);
    __m256i range = _mm256_subs_epu8(indices, _mm256_set1_epi8(51));
    range = _mm256_sub_epi8(range, _mm256_cmpgt_epi8(indices, _mm256_set1_epi8(25)));
    return _mm256_add_epi8(indices, _mm256_shuffle_epi8(offsets, range));
}

__attribute__((target("avx2"))) static inline __m256i encode_load_24(const uint8_t *p) {
    /* Two overlapping 16-byte loads put 12 input bytes in each 128-bit lane
     * (pshufb cannot cross lanes); this never reads before the buffer. */
    const __m256i arrange = _mm256_setr_epi8(1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10,
                                             1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10);
    __m256i in = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                         _mm_loadu_si128((const __m128i *)(p + 12)), 1);
    return _mm256_shuffle_epi8(in, arrange);
}

__attribute__((target("avx2"))) static inline __m256i encode_load_24_from_4_back(const uint8_t *p) {
    /* One 32-byte load from p - 4 (libbase64's AVX2 encoder does the same): the low lane holds
     * p[-4, 12), the high lane p[12, 28), so one in-lane pshufb finds p[0, 12) and p[12, 24) with no
     * lane insert, a port-5 uop the loop is short of, per 24 bytes. Needs 4 readable bytes before p. */
    const __m256i arrange = _mm256_setr_epi8(5, 4, 6, 5, 8, 7, 9, 8, 11, 10, 12, 11, 14, 13, 15, 14,
                                             1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10);
    return _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(p - 4)), arrange);
}

__attribute__((target("avx2"))) static size_t encode_avx2(const uint8_t *src, size_t nbytes, char *dst) {
    size_t i = 0;
    /* Each step reads up to 28 bytes past its start and consumes 24; the first, with nothing before
     * it, loads its two halves apart, the others from 4 bytes back. */
    if (nbytes >= 28) {
        _mm256_storeu_si256((__m256i *)dst, encode_translate_256(split_6bit_256(encode_load_24(src))));
        dst += 32;
        i = 24;
    }
    /* Eight steps a turn: the loop's own uops share ports with the eleven vector ones a step needs. */
    for (; i + 196 <= nbytes; i += 192) {
        for (int k = 0; k < 8; k++) {
            __m256i a = encode_load_24_from_4_back(src + i + 24 * k);
            _mm256_storeu_si256((__m256i *)(dst + 32 * k), encode_translate_256(split_6bit_256(a)));
        }
        dst += 256;
    }
    for (; i + 28 <= nbytes; i += 24) {
        __m256i a = encode_load_24_from_4_back(src + i);
        _mm256_storeu_si256((__m256i *)dst, encode_translate_256(split_6bit_256(a)));
        dst += 32;
    }
    return i;
}

#define FC_AVX512VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi")))

FC_AVX512VBMI_TARGET static size_t encode_avx512vbmi(const uint8_t *src, size_t nbytes, char *dst) {
    /* 48 input bytes -> 64 characters per step: vpermb spreads each 3-byte
     * group to b1 b0 b2 b1, vpmultishiftqb extracts the four 6-bit fields at
     * bit offsets 10, 4, 22, 16 (per 32 bits), and a second vpermb, which only
     * looks at the low 6 bits of each index, is the alphabet lookup. */
    const __m512i arrange = _mm512_setr_epi32(0x01020001, 0x04050304, 0x07080607, 0x0a0b090a, 0x0d0e0c0d,
                                              0x10110f10, 0x13141213, 0x16171516, 0x191a1819, 0x1c1d1b1c,
                                              0x1f201e1f, 0x22232122, 0x25262425, 0x28292728, 0x2b2c2a2b,
                                              0x2e2f2d2e);
    const __m512i shifts = _mm512_set1_epi64(0x3036242a1016040aLL);
    const __m512i alphabet = _mm512_loadu_si512((const void *)ENCODE_ALPHABET);
    size_t i = 0;
    for (; i + 64 <= nbytes; i += 48) {
        __m512i in = _mm512_permutexvar_epi8(arrange, _mm512_loadu_si512((const void *)(src + i)));
        __m512i indices = _mm512_multishift_epi64_epi8(shifts, in);
        _mm512_storeu_si512((void *)dst, _mm512_permutexvar_epi8(indices, alphabet));
        dst += 64;
    }
    /* The last full block: a masked load reads only the 48 bytes it needs. */
    if (i + 48 <= nbytes) {
        __m512i in = _mm512_permutexvar_epi8(arrange, _mm512_maskz_loadu_epi8(0x0000ffffffffffffULL, src + i));
        __m512i indices = _mm512_multishift_epi64_epi8(shifts, in);
        _mm512_storeu_si512((void *)dst, _mm512_permutexvar_epi8(indices, alphabet));
        i += 48;
    }
    return i;
}

/* Mula's validation: a byte is in the alphabet iff
 * (VALID_BY_LOW_NIBBLE[lo] & VALID_BY_HIGH_NIBBLE[hi]) == 0; the roll table,
 * indexed by the high nibble (minus one for '/'), maps the byte to its value. */
#define FC_VALID_LUTS(W, set)                                                                        \
    const __m##W##i lut_lo = set(0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, \
                                 0x1B, 0x1B, 0x1B, 0x1A);                                              \
    const __m##W##i lut_hi = set(0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, \
                                 0x10, 0x10, 0x10, 0x10)
#define FC_DECODE_LUTS(W, set) \
    FC_VALID_LUTS(W, set);     \
    const __m##W##i lut_roll = set(0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0, 0, 0, 0, 0)

#define FC_SET16_128(...) _mm_setr_epi8(__VA_ARGS__)
#define FC_SET16_256(...) _mm256_setr_epi8(__VA_ARGS__, __VA_ARGS__)

__attribute__((target("ssse3"))) static inline int decode_translate_128(__m128i *chars) {
    FC_DECODE_LUTS(128, FC_SET16_128);
    const __m128i mask_2f = _mm_set1_epi8(0x2f);
    __m128i str = *chars;
    __m128i hi_nibbles = _mm_and_si128(_mm_srli_epi32(str, 4), mask_2f);
    __m128i lo_nibbles = _mm_and_si128(str, mask_2f);
    __m128i hi = _mm_shuffle_epi8(lut_hi, hi_nibbles);
    __m128i lo = _mm_shuffle_epi8(lut_lo, lo_nibbles);
    if (_mm_movemask_epi8(_mm_cmpgt_epi8(_mm_and_si128(lo, hi), _mm_setzero_si128())) != 0)
        return 0;
    __m128i eq_2f = _mm_cmpeq_epi8(str, mask_2f);
    __m128i roll = _mm_shuffle_epi8(lut_roll, _mm_add_epi8(eq_2f, hi_nibbles));
    *chars = _mm_add_epi8(str, roll);
    return 1;
}

/* Packs four 6-bit values per 32-bit lane into 3 bytes (big-endian order
 * within the lane, hence the pshufb/vpermb that follows): maddubs joins
 * pairs into 12 bits, madd joins those into 24. */
__attribute__((target("ssse3"))) static inline __m128i pack_6bit_128(__m128i v) {
    return _mm_madd_epi16(_mm_maddubs_epi16(v, _mm_set1_epi32(0x01400140)), _mm_set1_epi32(0x00011000));
}

__attribute__((target("avx2"))) static inline __m256i pack_6bit_256(__m256i v) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_set1_epi32(0x01400140)),
                             _mm256_set1_epi32(0x00011000));
}

__attribute__((target("ssse3"))) static size_t decode_ssse3(const char *src, size_t len, uint8_t *dst) {
    const __m128i pack = _mm_setr_epi8(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
    size_t i = 0;
    /* A 16-byte store writes 4 bytes past the 12 decoded: stay 24 chars short of the end. */
    for (; i + 24 <= len; i += 16) {
        __m128i chars = _mm_loadu_si128((const __m128i *)(src + i));
        if (!decode_translate_128(&chars)) return i;
        _mm_storeu_si128((__m128i *)dst, _mm_shuffle_epi8(pack_6bit_128(chars), pack));
        dst += 12;
    }
    for (; i + 16 <= len; i += 16) {
        __m128i chars = _mm_loadu_si128((const __m128i *)(src + i));
        if (!decode_translate_128(&chars)) return i;
        __m128i out = _mm_shuffle_epi8(pack_6bit_128(chars), pack);
        _mm_storel_epi64((__m128i *)dst, out);
        uint32_t last = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(out, 8));
        memcpy(dst + 8, &last, 4);
        dst += 12;
    }
    return i;
}

__attribute__((target("avx2"))) static inline int decode_translate_256(__m256i *chars) {
    FC_DECODE_LUTS(256, FC_SET16_256);
    const __m256i mask_2f = _mm256_set1_epi8(0x2f);
    __m256i str = *chars;
    __m256i hi_nibbles = _mm256_and_si256(_mm256_srli_epi32(str, 4), mask_2f);
    __m256i lo_nibbles = _mm256_and_si256(str, mask_2f);
    __m256i hi = _mm256_shuffle_epi8(lut_hi, hi_nibbles);
    __m256i lo = _mm256_shuffle_epi8(lut_lo, lo_nibbles);
    if (!_mm256_testz_si256(lo, hi)) return 0;
    __m256i eq_2f = _mm256_cmpeq_epi8(str, mask_2f);
    __m256i roll = _mm256_shuffle_epi8(lut_roll, _mm256_add_epi8(eq_2f, hi_nibbles));
    *chars = _mm256_add_epi8(str, roll);
    return 1;
}

__attribute__((target("avx2"))) static inline __m256i decode_pack_256(__m256i values) {
    const __m256i pack = _mm256_setr_epi8(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1, 2, 1, 0, 6, 5,
                                          4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
    __m256i out = _mm256_shuffle_epi8(pack_6bit_256(values), pack);
    /* Close the 4-byte gap between the lanes' 12-byte halves. */
    return _mm256_permutevar8x32_epi32(out, _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7));
}

__attribute__((target("avx2"))) static size_t decode_avx2(const char *src, size_t len, uint8_t *dst) {
    size_t i = 0;
    /* A 32-byte store writes 8 bytes past the 24 decoded: stay 44 chars short of the end. */
    for (; i + 44 <= len; i += 32) {
        __m256i chars = _mm256_loadu_si256((const __m256i *)(src + i));
        if (!decode_translate_256(&chars)) return i;
        _mm256_storeu_si256((__m256i *)dst, decode_pack_256(chars));
        dst += 24;
    }
    for (; i + 32 <= len; i += 32) {
        __m256i chars = _mm256_loadu_si256((const __m256i *)(src + i));
        if (!decode_translate_256(&chars)) return i;
        __m256i out = decode_pack_256(chars);
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(out));
        _mm_storel_epi64((__m128i *)(dst + 16), _mm256_extracti128_si256(out, 1));
        dst += 24;
    }
    return i;
}

/* Nonzero bytes where v is outside the alphabet ('=' included): Mula's check alone. Bytes >= 0x80
 * have lut_hi 0x10, which every lut_lo entry shares: rejected. */
__attribute__((target("avx2"))) static inline __m256i alphabet_bad_256(__m256i v) {
    FC_VALID_LUTS(256, FC_SET16_256);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), nibble);
    return _mm256_and_si256(_mm256_shuffle_epi8(lut_lo, _mm256_and_si256(v, nibble)), _mm256_shuffle_epi8(lut_hi, hi));
}

/* 64 bytes per step: the two halves' hits are OR-ed so the common no-hit case costs one test. */
__attribute__((target("avx2"))) static size_t alphabet_run_avx2(const uint8_t *p, size_t i, size_t n) {
    const __m256i zero = _mm256_setzero_si256();
    while (i + 64 <= n) {
        __m256i bada = alphabet_bad_256(_mm256_loadu_si256((const __m256i *)(p + i)));
        __m256i badb = alphabet_bad_256(_mm256_loadu_si256((const __m256i *)(p + i + 32)));
        __m256i any = _mm256_or_si256(bada, badb);
        if (!_mm256_testz_si256(any, any)) {
            unsigned ma = ~(unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(bada, zero));
            if (ma) return i + (size_t)__builtin_ctz(ma);
            return i + 32 + (size_t)__builtin_ctz(~(unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(badb, zero)));
        }
        i += 64;
    }
    return i;
}

/* SSE2 (the x86-64 baseline): every alphabet byte is below 0x80, so signed range compares are exact. */
__attribute__((target("sse2"))) static size_t alphabet_run_sse2(const uint8_t *p, size_t i, size_t n) {
    const __m128i A = _mm_set1_epi8('A' - 1), Z = _mm_set1_epi8('Z' + 1);
    const __m128i a = _mm_set1_epi8('a' - 1), z = _mm_set1_epi8('z' + 1);
    const __m128i d0 = _mm_set1_epi8('0' - 1), d9 = _mm_set1_epi8('9' + 1);
    const __m128i plus = _mm_set1_epi8('+'), slash = _mm_set1_epi8('/');
    while (i + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
        __m128i ok = _mm_and_si128(_mm_cmpgt_epi8(v, A), _mm_cmplt_epi8(v, Z));
        ok = _mm_or_si128(ok, _mm_and_si128(_mm_cmpgt_epi8(v, a), _mm_cmplt_epi8(v, z)));
        ok = _mm_or_si128(ok, _mm_and_si128(_mm_cmpgt_epi8(v, d0), _mm_cmplt_epi8(v, d9)));
        ok = _mm_or_si128(ok, _mm_or_si128(_mm_cmpeq_epi8(v, plus), _mm_cmpeq_epi8(v, slash)));
        int mask = _mm_movemask_epi8(ok) ^ 0xFFFF;
        if (mask) return i + (size_t)__builtin_ctz((unsigned)mask);
        i += 16;
    }
    return i;
}

#define FC_NO 0x80 /* outside the alphabet */
/* 0x80 for the byte values below 0x80 outside the alphabet ('=' included), 0 for the 64 in it. */
static const uint8_t ALPHABET_BAD_7BIT[128] = {
    FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO,
    FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO,
    FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, 0,     FC_NO, FC_NO, FC_NO, 0,     /* + / */
    0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, /* 0-9 */
    FC_NO, 0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     /* A-O */
    0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, /* P-Z */
    FC_NO, 0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     /* a-o */
    0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     0,     FC_NO, FC_NO, FC_NO, FC_NO, FC_NO, /* p-z */
};
#undef FC_NO

/* 64 bytes per step: vpermi2b looks each byte's low 7 bits up in ALPHABET_BAD_7BIT and the byte
 * itself, OR-ed in, marks those >= 0x80: one lookup and a mask instead of the AVX2 kernel's nibble
 * tables (five vector operations a step, not fourteen). */
FC_AVX512VBMI_TARGET static size_t alphabet_run_avx512vbmi(const uint8_t *p, size_t i, size_t n) {
    const __m512i lut0 = _mm512_loadu_si512((const void *)ALPHABET_BAD_7BIT);
    const __m512i lut1 = _mm512_loadu_si512((const void *)(ALPHABET_BAD_7BIT + 64));
    while (i + 64 <= n) {
        __m512i v = _mm512_loadu_si512((const void *)(p + i));
        __mmask64 bad = _mm512_movepi8_mask(_mm512_or_si512(_mm512_permutex2var_epi8(lut0, v, lut1), v));
        if (bad) return i + (size_t)__builtin_ctzll(bad);
        i += 64;
    }
    return i;
}

FC_AVX512VBMI_TARGET static size_t decode_avx512vbmi(const char *src, size_t len, uint8_t *dst) {
    /* vpermi2b looks each byte's low 7 bits up in a 128-entry table (value or
     * 0x80); a byte is bad if the table or the byte itself has its top bit. */
    const __m512i lut0 = _mm512_loadu_si512((const void *)DECODE_TABLE_7BIT);
    const __m512i lut1 = _mm512_loadu_si512((const void *)(DECODE_TABLE_7BIT + 64));
    const __m512i pack = _mm512_setr_epi32(0x06000102, 0x090a0405, 0x0c0d0e08, 0x16101112, 0x191a1415,
                                           0x1c1d1e18, 0x26202122, 0x292a2425, 0x2c2d2e28, 0x36303132,
                                           0x393a3435, 0x3c3d3e38, 0, 0, 0, 0);
    size_t i = 0;
    for (; i + 64 <= len; i += 64) {
        __m512i chars = _mm512_loadu_si512((const void *)(src + i));
        __m512i values = _mm512_permutex2var_epi8(lut0, chars, lut1);
        if (_mm512_movepi8_mask(_mm512_or_si512(values, chars)) != 0) return i;
        __m512i out = _mm512_permutexvar_epi8(
            pack, _mm512_madd_epi16(_mm512_maddubs_epi16(values, _mm512_set1_epi32(0x01400140)),
                                    _mm512_set1_epi32(0x00011000)));
        if (i + 88 <= len)  /* room for the 16 spare bytes of a full store */
            _mm512_storeu_si512((void *)dst, out);
        else
            _mm512_mask_storeu_epi8(dst, 0x0000ffffffffffffULL, out);
        dst += 48;
    }
    return i;
}

#endif /* FC_X86 */

/* --------------------------------------------------------------- dispatch */

static encode_kernel_fn encode_kernels[FC_SIMD_COUNT];
static decode_kernel_fn decode_kernels[FC_SIMD_COUNT];
static encode_kernel_fn encode_kernel = encode_scalar_blocks;
static decode_kernel_fn decode_kernel = decode_kernel_none;

static const char *const SIMD_NAMES[FC_SIMD_COUNT] = {"scalar", "ssse3", "avx2", "avx512vbmi"};

void fc_b64_init(void) {
    if (initialised) return;
    memset(DECODE_TABLE, DEC_BAD, sizeof DECODE_TABLE);
    for (int k = 0; k < 64; k++) DECODE_TABLE[(uint8_t)ENCODE_ALPHABET[k]] = (uint8_t)k;
    DECODE_TABLE['='] = DEC_PAD;
    for (int c = 0; c < 128; c++) DECODE_TABLE_7BIT[c] = DECODE_TABLE[c] < 64 ? DECODE_TABLE[c] : 0x80;

    encode_kernels[FC_SIMD_SCALAR] = encode_scalar_blocks;
    decode_kernels[FC_SIMD_SCALAR] = decode_kernel_none;
#if FC_X86
    encode_kernels[FC_SIMD_SSSE3] = encode_ssse3;
    decode_kernels[FC_SIMD_SSSE3] = decode_ssse3;
    encode_kernels[FC_SIMD_AVX2] = encode_avx2;
    decode_kernels[FC_SIMD_AVX2] = decode_avx2;
    encode_kernels[FC_SIMD_AVX512VBMI] = encode_avx512vbmi;
    decode_kernels[FC_SIMD_AVX512VBMI] = decode_avx512vbmi;
    unsigned features = fc_cpu_features();
    cpu_supports[FC_SIMD_SSSE3] = (features & FC_CPU_SSSE3) != 0;
    cpu_supports[FC_SIMD_AVX2] = (features & FC_CPU_AVX2) != 0;
    cpu_supports[FC_SIMD_AVX512VBMI] = (features & FC_CPU_AVX512VBMI) != 0;
#endif
    for (int path = FC_SIMD_COUNT - 1; path >= 0; path--) {
        if (cpu_supports[path]) {
            fc_simd_select(path);
            break;
        }
    }
    initialised = 1;
}

int fc_simd_available(int path) { return path >= 0 && path < FC_SIMD_COUNT && cpu_supports[path]; }

int fc_simd_select(int path) {
    if (!fc_simd_available(path)) return -1;
    selected_path = path;
    encode_kernel = encode_kernels[path];
    decode_kernel = decode_kernels[path];
    return 0;
}

int fc_simd_selected(void) { return selected_path; }

const char *fc_simd_name(int path) {
    return (path >= 0 && path < FC_SIMD_COUNT) ? SIMD_NAMES[path] : "unknown";
}

/* ------------------------------------------------------------ entry points */

/* Below this many input bytes the alignment prologue is not worth its scalar groups. */
#define FC_ALIGN_MIN_BYTES 1024

void fc_b64_encode(const uint8_t *src, size_t nbytes, char *dst) {
    /* Kernels consume whole 3-byte groups; the scalar loop finishes them and
     * the tail (0, 1 or 2 bytes) gets the padding. The vector kernels store
     * 16, 32 or 64 characters at a time: scalar groups first bring dst to a
     * 64-byte boundary, so that no store splits two cache lines (the
     * AVX-512 kernel's 64-byte stores run 25% slower across lines, and a
     * bytes object's data sits 32 bytes into a 16-byte-aligned block). */
    size_t done = 0, lead = (64 - ((uintptr_t)dst & 63)) & 63;
    if (lead % 4 == 0 && nbytes >= FC_ALIGN_MIN_BYTES) done = encode_scalar_blocks(src, lead / 4 * 3, dst);
    done += encode_kernel(src + done, nbytes - done, dst + done / 3 * 4);
    done += encode_scalar_blocks(src + done, nbytes - done, dst + done / 3 * 4);
    encode_scalar_tail(src + done, nbytes - done, dst + done / 3 * 4);
}

int fc_b64_decode(const char *src, size_t len, int pad, uint8_t *dst, size_t *bad_offset) {
    const uint8_t *s = (const uint8_t *)src;
    /* The quad holding the padding is decoded apart, by hand. */
    size_t body = pad ? len - 4 : len;
    size_t done = decode_kernel(src, body, dst);
    int status = decode_scalar_quads(src + done, body - done, dst + done / 4 * 3, bad_offset);
    if (status != FC_B64_OK) {
        *bad_offset += done;
        return status;
    }
    if (!pad) return FC_B64_OK;

    uint8_t *out = dst + body / 4 * 3;
    int data_chars = 4 - pad;
    uint8_t v[3] = {0, 0, 0};
    for (int k = 0; k < data_chars; k++) {
        uint8_t x = DECODE_TABLE[s[body + k]];
        if (x & (DEC_BAD | DEC_PAD)) {
            *bad_offset = body + k;
            return (x & DEC_PAD) ? FC_B64_MISPLACED_PAD : FC_B64_BAD_CHAR;
        }
        v[k] = x;
    }
    /* RFC 4648 section 3.5: the bits under the padding must be zero for the
     * encoding to be canonical; we reject the others so that one id sequence
     * has exactly one encoding. */
    uint8_t unused = pad == 1 ? (v[2] & 3) : (v[1] & 15);
    if (unused) {
        *bad_offset = body + data_chars - 1;
        return FC_B64_NONZERO_PAD_BITS;
    }
    out[0] = (uint8_t)(v[0] << 2 | v[1] >> 4);
    if (pad == 1) out[1] = (uint8_t)(v[1] << 4 | v[2] >> 2);
    return FC_B64_OK;
}

static inline int is_alphabet(uint8_t c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '/';
}

size_t fc_b64_alphabet_run(const uint8_t *p, size_t i, size_t n, int path) {
#if FC_X86
    if (path >= FC_SIMD_AVX512VBMI && n - i >= 64)
        i = alphabet_run_avx512vbmi(p, i, n);
    else if (path >= FC_SIMD_AVX2 && n - i >= 64)
        i = alphabet_run_avx2(p, i, n);
    i = alphabet_run_sse2(p, i, n);
#else
    (void)path;
#endif
    while (i < n && is_alphabet(p[i])) i++;
    return i;
}

/* ------------------------------------------------------ integer narrowing */

/* 1536 ids = 6144 bytes, a multiple of 3, so chunks encode back to back
 * without padding between them; the chunk stays in L1. */
#define FC_CHUNK_IDS 1536

static inline uint64_t load_swapped(const char *p, int itemsize, int byteswap) {
    uint8_t b[8];
    memcpy(b, p, (size_t)itemsize);
    if (byteswap) {
        for (int k = 0; k < itemsize / 2; k++) {
            uint8_t t = b[k];
            b[k] = b[itemsize - 1 - k];
            b[itemsize - 1 - k] = t;
        }
    }
    switch (itemsize) {
    case 1: return b[0];
    case 2: { uint16_t x; memcpy(&x, b, 2); return x; }
    case 4: { uint32_t x; memcpy(&x, b, 4); return x; }
    default: { uint64_t x; memcpy(&x, b, 8); return x; }
    }
}

static inline int32_t to_le32(int32_t v) {
#if FC_BIG_ENDIAN
    return (int32_t)__builtin_bswap32((uint32_t)v);
#else
    return v;
#endif
}

/* Reads item i as a 64-bit value; *ok = 0 if it does not fit in int32. */
static inline int32_t narrow_item(const char *p, int itemsize, int is_signed, int byteswap, int *ok) {
    uint64_t raw = load_swapped(p, itemsize, byteswap);
    int64_t value;
    if (is_signed) {
        int shift = 64 - 8 * itemsize;
        value = shift ? (int64_t)(raw << shift) >> shift : (int64_t)raw;
    } else {
        if (raw > (uint64_t)INT32_MAX) {
            *ok = 0;
            return 0;
        }
        value = (int64_t)raw;
    }
    if (value < INT32_MIN || value > INT32_MAX) {
        *ok = 0;
        return 0;
    }
    return (int32_t)value;
}

int64_t fc_encode_ints(const char *base, size_t count, ptrdiff_t stride, int itemsize, int is_signed,
                       int byteswap, char *dst) {
    int32_t chunk[FC_CHUNK_IDS];
    for (size_t start = 0; start < count; start += FC_CHUNK_IDS) {
        size_t n = count - start < FC_CHUNK_IDS ? count - start : FC_CHUNK_IDS;
        const char *p = base + (ptrdiff_t)start * stride;
        int ok = 1;
        if (itemsize == 8 && is_signed && !byteswap && stride == 8) {
            /* The common case (numpy's and torch's default int64), as a loop
             * the compiler vectorises. */
            int64_t wide[FC_CHUNK_IDS];
            memcpy(wide, p, n * 8);
            int64_t lo = 0, hi = 0;
            for (size_t k = 0; k < n; k++) {
                lo = wide[k] < lo ? wide[k] : lo;
                hi = wide[k] > hi ? wide[k] : hi;
                chunk[k] = to_le32((int32_t)wide[k]);
            }
            if (lo < INT32_MIN || hi > INT32_MAX) ok = 0;
        } else {
            for (size_t k = 0; k < n && ok; k++) chunk[k] = to_le32(narrow_item(p + (ptrdiff_t)k * stride, itemsize, is_signed, byteswap, &ok));
        }
        if (!ok) {
            /* Find the first offender (the fast loop only knows there is one). */
            for (size_t k = 0; k < n; k++) {
                int item_ok = 1;
                narrow_item(p + (ptrdiff_t)k * stride, itemsize, is_signed, byteswap, &item_ok);
                if (!item_ok) return (int64_t)(start + k);
            }
        }
        fc_b64_encode((const uint8_t *)chunk, n * 4, dst);
        dst += n * 4 / 3 * 4;  /* exact for every chunk but the last */
    }
    return -1;
}

void fc_le32_to_host(int32_t *values, size_t count) {
#if FC_BIG_ENDIAN
    for (size_t k = 0; k < count; k++) values[k] = (int32_t)__builtin_bswap32((uint32_t)values[k]);
#else
    (void)values;
    (void)count;
#endif
}
