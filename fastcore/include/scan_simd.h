/* The JSON span scanner's string kernels (fastcore/_scan.pyx): the long runs
 * that dominate our bodies (string contents) are consumed 16 bytes at a time
 * with SSE2, the x86-64 baseline, or 64 with AVX2 or AVX-512 where
 * fc_cpu_features() says so; other targets take the scalar loop.
 *
 * Header-only, static: one module includes it, and the short-run probes
 * must inline into the scanner's loop.
 */
#ifndef FASTCORE_SCAN_SIMD_H
#define FASTCORE_SCAN_SIMD_H

#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define FC_JS_SSE2 1
#else
#define FC_JS_SSE2 0
#endif
#if FC_X86 && defined(__x86_64__)
#include <immintrin.h>
#define FC_JS_AVX2 1
#define FC_JS_TARGET_AVX2 __attribute__((target("avx2")))
#define FC_JS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))
#else
#define FC_JS_AVX2 0
#endif

#define FC_JS_BACKSLASH 0x5C
#define FC_JS_LONG_RUN 4096 /* bytes of a string run before the AVX-512 kernel takes over */

/* 1 when the AVX2 (AVX-512) kernels run (fc_js_init; tests may turn them off). The AVX-512 one
 * runs where the codec's AVX-512 VBMI kernels do (Ice Lake and later, AMD Zen 4: no clock penalty
 * worth the name), not on every AVX-512 CPU. */
static int fc_js_avx2 = 0;
static int fc_js_avx512 = 0;

static inline void fc_js_init(void) {
    unsigned features = fc_cpu_features();
    fc_js_avx2 = FC_JS_AVX2 && (features & FC_CPU_AVX2) != 0;
    fc_js_avx512 = FC_JS_AVX2 && (features & FC_CPU_AVX512VBMI) != 0;
}

static inline const char *fc_js_kernel(void) {
    return fc_js_avx512 ? "avx512" : fc_js_avx2 ? "avx2" : (FC_JS_SSE2 ? "sse2" : "scalar");
}

#if FC_JS_AVX2
/* 64 bytes per step: the two halves' hits are OR-ed so the common no-hit case
 * costs one test and branch. `controls`: also stop at bytes below 0x20 and at
 * bytes >= 0x80 (the signed compare with 0x20 catches both). */
FC_JS_TARGET_AVX2 static inline Py_ssize_t fc_js_run_avx2(const uint8_t *p, Py_ssize_t i, Py_ssize_t n, int controls) {
    const __m256i quote = _mm256_set1_epi8('"'), backslash = _mm256_set1_epi8(FC_JS_BACKSLASH);
    const __m256i space = _mm256_set1_epi8(0x20);
    const __m256i none = _mm256_setzero_si256();
    while (i + 64 <= n) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + i + 32));
        __m256i ha = _mm256_or_si256(_mm256_cmpeq_epi8(a, quote), _mm256_cmpeq_epi8(a, backslash));
        __m256i hb = _mm256_or_si256(_mm256_cmpeq_epi8(b, quote), _mm256_cmpeq_epi8(b, backslash));
        ha = _mm256_or_si256(ha, controls ? _mm256_cmpgt_epi8(space, a) : none);
        hb = _mm256_or_si256(hb, controls ? _mm256_cmpgt_epi8(space, b) : none);
        __m256i any = _mm256_or_si256(ha, hb);
        if (!_mm256_testz_si256(any, any)) {
            unsigned ma = (unsigned)_mm256_movemask_epi8(ha);
            if (ma) return i + __builtin_ctz(ma);
            return i + 32 + __builtin_ctz((unsigned)_mm256_movemask_epi8(hb));
        }
        i += 64;
    }
    return i;
}

/* 64 bytes per step into one mask: two (three) compares, no movemask, no second half to look at. */
FC_JS_TARGET_AVX512 static Py_ssize_t fc_js_run_avx512(const uint8_t *p, Py_ssize_t i, Py_ssize_t n,
                                                       int controls) {
    const __m512i quote = _mm512_set1_epi8('"'), backslash = _mm512_set1_epi8(FC_JS_BACKSLASH);
    const __m512i space = _mm512_set1_epi8(0x20);
    while (i + 64 <= n) {
        __m512i v = _mm512_loadu_si512((const void *)(p + i));
        __mmask64 hit = _mm512_cmpeq_epi8_mask(v, quote) | _mm512_cmpeq_epi8_mask(v, backslash);
        if (controls) hit |= _mm512_cmplt_epi8_mask(v, space); /* signed: bytes >= 0x80 too */
        if (hit) return i + __builtin_ctzll(hit);
        i += 64;
    }
    return i;
}

/* AVX2 first: runs in JSON text end within a few KB (keys, text between escapes). A run still going
 * after FC_JS_LONG_RUN bytes (a base64 token string) goes on with AVX-512 where it runs: a fifth to
 * a quarter less time on a 213 KB token string. Switching after 256 bytes made a chat body's scan 3%
 * slower, and a test per string in the scanner's inlined probe, instead of here, 7-9%. */
FC_JS_TARGET_AVX2 static inline Py_ssize_t fc_js_long_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n, int controls) {
    Py_ssize_t first = n - i > FC_JS_LONG_RUN ? i + FC_JS_LONG_RUN : n;
    i = fc_js_run_avx2(p, i, first, controls);
    if (first == n || i + 64 <= first) return i; /* a stop, or the end of the body is near */
    return fc_js_avx512 ? fc_js_run_avx512(p, i, n, controls) : fc_js_run_avx2(p, i, n, controls);
}

FC_JS_TARGET_AVX2 static Py_ssize_t fc_js_plain_run_avx2(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
    return fc_js_long_run(p, i, n, 1);
}

FC_JS_TARGET_AVX2 static Py_ssize_t fc_js_quote_or_backslash_avx2(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
    return fc_js_long_run(p, i, n, 0);
}
#endif

#if FC_JS_SSE2
/* The first hit in the 16 bytes at p + i, or -1. */
static inline int fc_js_hit16(const uint8_t *p, Py_ssize_t i, int controls) {
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8(FC_JS_BACKSLASH);
    __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
    __m128i hit = _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash));
    if (controls) hit = _mm_or_si128(hit, _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));
    int mask = _mm_movemask_epi8(hit);
    return mask ? __builtin_ctz((unsigned)mask) : -1;
}
#endif

/* First index in [i, n) holding '"', a backslash and, with `controls`, a
 * control byte or a non-ASCII byte: everything else in a string needs no
 * decision. */
static inline Py_ssize_t fc_js_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n, int controls) {
#if FC_JS_SSE2
    int hit;
    /* Keys, short values and the bytes after an escape mostly end within
     * 16 bytes: probe those inline before paying for the AVX2 call. */
    if (i + 16 <= n) {
        hit = fc_js_hit16(p, i, controls);
        if (hit >= 0) return i + hit;
        i += 16;
    }
#endif
#if FC_JS_AVX2
    if (fc_js_avx2 && n - i >= 64) i = controls ? fc_js_plain_run_avx2(p, i, n) : fc_js_quote_or_backslash_avx2(p, i, n);
#endif
#if FC_JS_SSE2
    while (i + 16 <= n) {
        hit = fc_js_hit16(p, i, controls);
        if (hit >= 0) return i + hit;
        i += 16;
    }
#endif
    while (i < n) {
        uint8_t c = p[i];
        if (c == '"' || c == FC_JS_BACKSLASH || (controls && (c < 0x20 || c >= 0x80))) return i;
        i++;
    }
    return n;
}

/* Strings, validate=True: stop where a decision is due. */
static inline Py_ssize_t fc_js_plain_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) { return fc_js_run(p, i, n, 1); }

/* Strings, validate=False: stop at '"' or a backslash only. */
static inline Py_ssize_t fc_js_quote_or_backslash(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
    return fc_js_run(p, i, n, 0);
}

#endif
