# cython: freethreading_compatible = False
"""Compiled twin of ``fastcore._jsonspan_py``: the JSON span scanner.

The same state machine, byte for byte, in C without the GIL: identical spans,
exceptions, messages and offsets on every input (the pure-Python twin's
docstring states the semantics; its ``_compile`` and ``make_error`` are
reused here so paths and errors cannot drift apart). The long runs that
dominate our bodies (string contents, base64 data) are consumed 16 bytes at
a time with SSE2, the x86-64 baseline; other targets take the scalar loop.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

from fastcore._jsonspan cimport Frame, Node, Scanner

from fastcore._jsonspan_py import _compile, make_error
from fastcore.errors import TokenDecodeError

cdef extern from *:
    """
    #if defined(__SSE2__) || defined(_M_X64)
    #include <emmintrin.h>
    #define FC_JS_SSE2 1
    #else
    #define FC_JS_SSE2 0
    #endif
    /* AVX2 kernels are compiled for any x86-64 GCC/Clang build and chosen at
     * run time (fc_js_init), so one wheel serves old and new CPUs. */
    #if defined(__GNUC__) && defined(__x86_64__)
    #include <immintrin.h>
    #define FC_JS_AVX2 1
    #define FC_JS_TARGET_AVX2 __attribute__((target("avx2")))
    #else
    #define FC_JS_AVX2 0
    #endif

    static int fc_js_avx2 = 0;

    static void fc_js_init(void) {
    #if FC_JS_AVX2
        __builtin_cpu_init();
        fc_js_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    #endif
    }

    static const char *fc_js_kernel(void) { return fc_js_avx2 ? "avx2" : (FC_JS_SSE2 ? "sse2" : "scalar"); }

    #define FC_JS_BACKSLASH 0x5C

    #if FC_JS_AVX2
    /* The string-content kernels below, 64 bytes per step: the two halves'
     * hits are OR-ed so the common no-hit case costs one test and branch. */
    FC_JS_TARGET_AVX2 static Py_ssize_t fc_js_plain_run_avx2(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
        const __m256i quote = _mm256_set1_epi8('"'), backslash = _mm256_set1_epi8(FC_JS_BACKSLASH);
        const __m256i space = _mm256_set1_epi8(0x20);
        while (i + 64 <= n) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(p + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(p + i + 32));
            __m256i ha = _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(a, quote), _mm256_cmpeq_epi8(a, backslash)),
                                         _mm256_cmpgt_epi8(space, a));
            __m256i hb = _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(b, quote), _mm256_cmpeq_epi8(b, backslash)),
                                         _mm256_cmpgt_epi8(space, b));
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

    FC_JS_TARGET_AVX2 static Py_ssize_t fc_js_quote_or_backslash_avx2(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
        const __m256i quote = _mm256_set1_epi8('"'), backslash = _mm256_set1_epi8(FC_JS_BACKSLASH);
        while (i + 64 <= n) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(p + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(p + i + 32));
            __m256i ha = _mm256_or_si256(_mm256_cmpeq_epi8(a, quote), _mm256_cmpeq_epi8(a, backslash));
            __m256i hb = _mm256_or_si256(_mm256_cmpeq_epi8(b, quote), _mm256_cmpeq_epi8(b, backslash));
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

    /* Base64 alphabet by nibble lookup (W. Mula and D. Lemire, "Faster Base64
     * Encoding and Decoding using AVX2 Instructions", 2018): a byte is in the
     * alphabet iff lut_lo[low nibble] & lut_hi[high nibble] == 0. Bytes >= 0x80
     * have lut_hi 0x10, which every lut_lo entry shares: rejected. */
    FC_JS_TARGET_AVX2 static inline __m256i fc_js_b64_bad_avx2(__m256i v) {
        const __m256i lut_lo = _mm256_setr_epi8(
            0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B, 0x1B, 0x1A,
            0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B, 0x1B, 0x1A);
        const __m256i lut_hi = _mm256_setr_epi8(
            0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
            0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10);
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), nibble);
        __m256i lo = _mm256_and_si256(v, nibble);
        return _mm256_and_si256(_mm256_shuffle_epi8(lut_lo, lo), _mm256_shuffle_epi8(lut_hi, hi));
    }

    FC_JS_TARGET_AVX2 static Py_ssize_t fc_js_b64_run_avx2(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
        const __m256i zero = _mm256_setzero_si256();
        while (i + 64 <= n) {
            __m256i bada = fc_js_b64_bad_avx2(_mm256_loadu_si256((const __m256i *)(p + i)));
            __m256i badb = fc_js_b64_bad_avx2(_mm256_loadu_si256((const __m256i *)(p + i + 32)));
            __m256i any = _mm256_or_si256(bada, badb);
            if (!_mm256_testz_si256(any, any)) {
                unsigned ma = ~(unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(bada, zero));
                if (ma) return i + __builtin_ctz(ma);
                return i + 32 + __builtin_ctz(~(unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(badb, zero)));
            }
            i += 64;
        }
        return i;
    }
    #endif

    /* First index in [i, n) holding '"', a backslash, a control byte or a
     * non-ASCII byte: everything else in a string needs no decision. The
     * signed compare with 0x20 catches controls and bytes >= 0x80 at once. */
    static inline Py_ssize_t fc_js_plain_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
    #if FC_JS_SSE2
        const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8(FC_JS_BACKSLASH);
        const __m128i space = _mm_set1_epi8(0x20);
        /* Keys, short values and the bytes after an escape mostly end within
         * 16 bytes: probe those inline before paying for the AVX2 call. */
        if (i + 16 <= n) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
            __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                                       _mm_cmplt_epi8(v, space));
            int mask = _mm_movemask_epi8(hit);
            if (mask) return i + __builtin_ctz((unsigned)mask);
            i += 16;
        }
    #endif
    #if FC_JS_AVX2
        if (fc_js_avx2 && n - i >= 64) i = fc_js_plain_run_avx2(p, i, n);
    #endif
    #if FC_JS_SSE2
        while (i + 16 <= n) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
            __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                                       _mm_cmplt_epi8(v, space));
            int mask = _mm_movemask_epi8(hit);
            if (mask) return i + __builtin_ctz((unsigned)mask);
            i += 16;
        }
    #endif
        while (i < n) {
            uint8_t c = p[i];
            if (c == '"' || c == FC_JS_BACKSLASH || c < 0x20 || c >= 0x80) return i;
            i++;
        }
        return n;
    }

    /* First index in [i, n) holding '"' or a backslash (strings, validate=False). */
    static inline Py_ssize_t fc_js_quote_or_backslash(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
    #if FC_JS_SSE2
        const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8(FC_JS_BACKSLASH);
        if (i + 16 <= n) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
            int mask = _mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)));
            if (mask) return i + __builtin_ctz((unsigned)mask);
            i += 16;
        }
    #endif
    #if FC_JS_AVX2
        if (fc_js_avx2 && n - i >= 64) i = fc_js_quote_or_backslash_avx2(p, i, n);
    #endif
    #if FC_JS_SSE2
        while (i + 16 <= n) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
            int mask = _mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)));
            if (mask) return i + __builtin_ctz((unsigned)mask);
            i += 16;
        }
    #endif
        while (i < n) {
            uint8_t c = p[i];
            if (c == '"' || c == FC_JS_BACKSLASH) return i;
            i++;
        }
        return n;
    }

    static inline int fc_js_is_b64(uint8_t c) {
        return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '/';
    }

    /* First index in [i, n) outside the standard base64 alphabet. Every
     * alphabet byte is below 0x80, so signed range compares are exact. */
    static inline Py_ssize_t fc_js_b64_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) {
    #if FC_JS_AVX2
        if (fc_js_avx2 && n - i >= 64) i = fc_js_b64_run_avx2(p, i, n);
    #endif
    #if FC_JS_SSE2
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
            if (mask) return i + __builtin_ctz((unsigned)mask);
            i += 16;
        }
    #endif
        while (i < n && fc_js_is_b64(p[i])) i++;
        return i;
    }
    """
    void fc_js_init() noexcept
    const char *fc_js_kernel() noexcept
    bint fc_js_avx2
    Py_ssize_t fc_js_plain_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    Py_ssize_t fc_js_quote_or_backslash(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    Py_ssize_t fc_js_b64_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    bint fc_js_is_b64(uint8_t c) noexcept nogil


fc_js_init()

#: The string kernel this CPU runs: ``"avx2"``, ``"sse2"`` or ``"scalar"``.
KERNEL = fc_js_kernel().decode()


def _set_kernel(name):
    """Tests only: force ``"avx2"`` (if supported) or the ``"sse2"`` fallback."""
    global KERNEL, fc_js_avx2
    fc_js_init()
    if name == "sse2":
        fc_js_avx2 = False
    elif name != "avx2" or not fc_js_avx2:
        raise ValueError(f"kernel {name!r} is not available here")
    KERNEL = fc_js_kernel().decode()


# Status codes: the same numbers as _jsonspan_py's E_* constants.
cdef enum:
    E_EOF = 1
    E_VALUE = 2
    E_OBJECT_SEPARATOR = 3
    E_ARRAY_SEPARATOR = 4
    E_KEY = 5
    E_COLON = 6
    E_TRAILING = 7
    E_CONTROL = 8
    E_ESCAPE = 9
    E_UNICODE_ESCAPE = 10
    E_UTF8 = 11
    E_DIGIT = 12
    E_LITERAL = 13
    E_DUPLICATE_KEY = 14
    E_NO_MEMORY = 100

cdef enum:
    INLINE_FRAMES = 64
    INLINE_NODES = 32
    # Below this size releasing the GIL costs more than it frees.
    NOGIL_MIN_BYTES = 65536
    PATH_CACHE_SIZE = 256


# -- small scanners ----------------------------------------------------------------------------------

cdef inline int fail(Scanner *s, int code, Py_ssize_t offset) noexcept nogil:
    s.error_offset = offset
    return code


cdef inline Py_ssize_t skip_ws(const uint8_t *buf, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    cdef uint8_t c
    while i < n:
        c = buf[i]
        if c != 0x20 and c != 0x0A and c != 0x0D and c != 0x09:
            break
        i += 1
    return i


cdef inline bint is_digit(uint8_t c) noexcept nogil:
    return 0x30 <= c <= 0x39


cdef inline int hex_value(uint8_t c) noexcept nogil:
    if 0x30 <= c <= 0x39:
        return c - 0x30
    if 0x61 <= c <= 0x66:
        return c - 0x61 + 10
    if 0x41 <= c <= 0x46:
        return c - 0x41 + 10
    return -1


cdef inline Py_ssize_t utf8_sequence(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Length of the well-formed UTF-8 sequence at ``i`` (lead >= 0x80), or 0.

    RFC 3629: no overlongs, no encoded surrogates, nothing above U+10FFFF;
    a sequence cut short by the end of data is ill-formed.
    """
    cdef uint8_t c = p[i], c1
    if c < 0xC2:
        return 0
    if c < 0xE0:
        return 2 if i + 1 < n and (p[i + 1] & 0xC0) == 0x80 else 0
    if c < 0xF0:
        if i + 2 >= n:
            return 0
        c1 = p[i + 1]
        if (c1 & 0xC0) != 0x80 or (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 >= 0xA0):
            return 0
        return 3 if (p[i + 2] & 0xC0) == 0x80 else 0
    if c < 0xF5:
        if i + 3 >= n:
            return 0
        c1 = p[i + 1]
        if (c1 & 0xC0) != 0x80 or (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 >= 0x90):
            return 0
        return 4 if (p[i + 2] & 0xC0) == 0x80 and (p[i + 3] & 0xC0) == 0x80 else 0
    return 0


cdef int scan_string(Scanner *s, Py_ssize_t pos, Py_ssize_t *end, bint *escaped) noexcept nogil:
    """The string opening at ``pos``: ``end`` past its closing quote; ``escaped`` if it has a backslash."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, i = pos + 1, k, length
    cdef uint8_t c, e
    escaped[0] = False
    if not s.validate:
        while True:
            i = fc_js_quote_or_backslash(buf, i, n)
            if i >= n:
                return fail(s, E_EOF, n)
            if buf[i] == 0x22:
                end[0] = i + 1
                return 0
            escaped[0] = True
            if i + 1 >= n:
                return fail(s, E_EOF, n)
            i += 2
    while True:
        i = fc_js_plain_run(buf, i, n)
        if i >= n:
            return fail(s, E_EOF, n)
        c = buf[i]
        if c == 0x22:
            end[0] = i + 1
            return 0
        if c >= 0x80:
            length = utf8_sequence(buf, i, n)
            if length == 0:
                return fail(s, E_UTF8, i)
            i += length
            continue
        if c != 0x5C:
            return fail(s, E_CONTROL, i)
        escaped[0] = True
        if i + 1 >= n:
            return fail(s, E_EOF, n)
        e = buf[i + 1]
        if e == 0x22 or e == 0x5C or e == 0x2F or e == 0x62 or e == 0x66 or e == 0x6E or e == 0x72 or e == 0x74:
            i += 2
        elif e == 0x75:  # 'u'
            for k in range(i + 2, i + 6):
                if k >= n:
                    return fail(s, E_EOF, n)
                if hex_value(buf[k]) < 0:
                    return fail(s, E_UNICODE_ESCAPE, i)
            i += 6
        else:
            return fail(s, E_ESCAPE, i)


cdef int scan_number(Scanner *s, Py_ssize_t i, Py_ssize_t *end) noexcept nogil:
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n
    cdef uint8_t c
    if buf[i] == 0x2D:  # '-'
        i += 1
    if i >= n:
        return fail(s, E_EOF, n)
    c = buf[i]
    if c == 0x30:
        i += 1
    elif is_digit(c):
        i += 1
        while i < n and is_digit(buf[i]):
            i += 1
    else:
        return fail(s, E_DIGIT, i)
    if i < n and buf[i] == 0x2E:  # '.'
        i += 1
        if i >= n:
            return fail(s, E_EOF, n)
        if not is_digit(buf[i]):
            return fail(s, E_DIGIT, i)
        while i < n and is_digit(buf[i]):
            i += 1
    if i < n and (buf[i] == 0x65 or buf[i] == 0x45):  # 'e' 'E'
        i += 1
        if i < n and (buf[i] == 0x2B or buf[i] == 0x2D):
            i += 1
        if i >= n:
            return fail(s, E_EOF, n)
        if not is_digit(buf[i]):
            return fail(s, E_DIGIT, i)
        while i < n and is_digit(buf[i]):
            i += 1
    end[0] = i
    return 0


cdef int scan_literal(Scanner *s, Py_ssize_t pos, const char *word, Py_ssize_t length, Py_ssize_t *end) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(length):
        if pos + k >= s.n:
            return fail(s, E_EOF, s.n)
        if s.buf[pos + k] != <uint8_t>word[k]:
            return fail(s, E_LITERAL, pos + k)
    end[0] = pos + length
    return 0


cdef int skip_container(Scanner *s, Py_ssize_t pos, Py_ssize_t *end) noexcept nogil:
    """Past the container opening at ``pos``, by bracket counting only (``validate=False``)."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, i = pos, depth = 0
    cdef uint8_t c = 0
    cdef bint escaped
    cdef int code
    while True:
        while i < n:
            c = buf[i]
            if c == 0x22 or c == 0x5B or c == 0x5D or c == 0x7B or c == 0x7D:
                break
            i += 1
        if i >= n:
            return fail(s, E_EOF, n)
        if c == 0x22:
            code = scan_string(s, i, &i, &escaped)
            if code:
                return code
            continue
        depth += 1 if (c == 0x5B or c == 0x7B) else -1
        i += 1
        if depth == 0:
            end[0] = i
            return 0


# -- keys ----------------------------------------------------------------------------------------------

cdef inline Py_ssize_t put_code_point(uint8_t *out, Py_ssize_t k, unsigned int cp) noexcept nogil:
    # UTF-8, surrogates included (Python's "surrogatepass"), as the path keys are encoded.
    if cp < 0x80:
        out[k] = cp
        return k + 1
    if cp < 0x800:
        out[k] = 0xC0 | (cp >> 6)
        out[k + 1] = 0x80 | (cp & 0x3F)
        return k + 2
    if cp < 0x10000:
        out[k] = 0xE0 | (cp >> 12)
        out[k + 1] = 0x80 | ((cp >> 6) & 0x3F)
        out[k + 2] = 0x80 | (cp & 0x3F)
        return k + 3
    out[k] = 0xF0 | (cp >> 18)
    out[k + 1] = 0x80 | ((cp >> 12) & 0x3F)
    out[k + 2] = 0x80 | ((cp >> 6) & 0x3F)
    out[k + 3] = 0x80 | (cp & 0x3F)
    return k + 4


cdef inline int hex4(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end) noexcept nogil:
    cdef int value = 0, digit
    cdef Py_ssize_t k
    if start + 4 > end:
        return -1
    for k in range(start, start + 4):
        digit = hex_value(buf[k])
        if digit < 0:
            return -1
        value = value * 16 + digit
    return value


cdef int decode_key(Scanner *s, Py_ssize_t start, Py_ssize_t end, Py_ssize_t *length) noexcept nogil:
    """Unescape the key ``buf[start:end]`` into ``s.scratch`` (never longer than the raw key)."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t i = start, k = 0
    cdef uint8_t *grown
    cdef uint8_t c, e
    cdef int unit, low
    if end - start > s.scratch_capacity:
        grown = <uint8_t *>realloc(s.scratch, end - start)
        if grown == NULL:
            return E_NO_MEMORY
        s.scratch = grown
        s.scratch_capacity = end - start
    cdef uint8_t *out = s.scratch
    while i < end:
        c = buf[i]
        if c != 0x5C:
            out[k] = c
            k += 1
            i += 1
            continue
        e = buf[i + 1]  # a string never ends in an unpaired backslash
        if e == 0x22 or e == 0x5C or e == 0x2F:
            out[k] = e
        elif e == 0x62:
            out[k] = 0x08
        elif e == 0x66:
            out[k] = 0x0C
        elif e == 0x6E:
            out[k] = 0x0A
        elif e == 0x72:
            out[k] = 0x0D
        elif e == 0x74:
            out[k] = 0x09
        elif e == 0x75:
            unit = hex4(buf, i + 2, end)
            if unit < 0:
                return fail(s, E_UNICODE_ESCAPE, i)
            i += 6
            if 0xD800 <= unit < 0xDC00 and i + 1 < end and buf[i] == 0x5C and buf[i + 1] == 0x75:
                low = hex4(buf, i + 2, end)
                if 0xDC00 <= low < 0xE000:
                    unit = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    i += 6
            k = put_code_point(out, k, unit)
            continue
        else:
            return fail(s, E_ESCAPE, i)
        k += 1
        i += 2
    length[0] = k
    return 0


cdef int match_key(Scanner *s, int parent, Py_ssize_t start, Py_ssize_t end, bint escaped, int *found) noexcept nogil:
    """The child of ``parent`` named by the key ``buf[start:end]`` (raw, no quotes), or -1."""
    cdef const uint8_t *key = s.buf + start
    cdef Py_ssize_t length = end - start
    cdef int code, child
    if escaped:
        code = decode_key(s, start, end, &length)
        if code:
            return code
        key = s.scratch
    child = s.nodes[parent].first_child
    while child >= 0:
        if s.nodes[child].is_key and s.nodes[child].key_len == length:
            if length == 0 or memcmp(s.nodes[child].key, key, length) == 0:
                found[0] = child
                return 0
        child = s.nodes[child].next_sibling
    found[0] = -1
    return 0


cdef inline int index_child(Scanner *s, int parent, Py_ssize_t index) noexcept nogil:
    if parent < 0:
        return -1
    cdef int child = s.nodes[parent].first_child
    while child >= 0:
        if not s.nodes[child].is_key and s.nodes[child].index == index:
            return child
        child = s.nodes[child].next_sibling
    return -1


# -- the walk ------------------------------------------------------------------------------------------

cdef int push_frame(Scanner *s) noexcept nogil:
    cdef Frame *grown
    cdef Py_ssize_t capacity
    if s.depth == s.capacity:
        capacity = s.capacity * 2
        if s.frames_on_heap:
            grown = <Frame *>realloc(s.frames, capacity * sizeof(Frame))
        else:
            grown = <Frame *>malloc(capacity * sizeof(Frame))
            if grown != NULL:
                memcpy(grown, s.frames, s.depth * sizeof(Frame))
        if grown == NULL:
            return E_NO_MEMORY
        s.frames = grown
        s.frames_on_heap = True
        s.capacity = capacity
    s.depth += 1
    return 0


cdef inline void close_frame(Scanner *s, Frame *frame, Py_ssize_t end) noexcept nogil:
    if frame.node < 0:
        return
    cdef Node *node = &s.nodes[frame.node]
    if node.last and not frame.is_object and frame.has_last:
        node.last_start = frame.last_start
        node.last_end = frame.last_end
    if node.terminal:
        node.start = frame.start
        node.end = end


cdef int run(Scanner *s) noexcept nogil:
    """Validate (as ``s.validate`` asks) and record the spans of the nodes; 0 or a status code."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, pos, start, key_start
    cdef int node = 0 if s.nodes != NULL else -1  # the path node of the value about to be parsed
    cdef int value_node, code
    cdef bint expecting_key = False, escaped, is_object, descend
    cdef Frame *frame
    cdef uint8_t c, closer
    pos = skip_ws(buf, 0, n)
    while True:
        if expecting_key:
            # At the first non-blank byte where a member of the innermost object starts.
            frame = &s.frames[s.depth - 1]
            if pos >= n:
                return fail(s, E_EOF, n)
            if buf[pos] != 0x22:
                return fail(s, E_KEY, pos)
            key_start = pos
            code = scan_string(s, pos, &pos, &escaped)
            if code:
                return code
            node = -1
            if frame.node >= 0 and s.nodes[frame.node].has_keys:
                code = match_key(s, frame.node, key_start + 1, pos - 1, escaped, &node)
                if code:
                    return code
                if node >= 0:
                    if s.nodes[node].seen:
                        s.error_node = node
                        return fail(s, E_DUPLICATE_KEY, key_start)
                    s.nodes[node].seen = True
                    s.nodes[node].key_start = key_start
            pos = skip_ws(buf, pos, n)
            if pos >= n:
                return fail(s, E_EOF, n)
            if buf[pos] != 0x3A:
                return fail(s, E_COLON, pos)
            pos = skip_ws(buf, pos + 1, n)
            expecting_key = False

        # Parse one value at pos (non-blank or end of data) for `node`.
        if pos >= n:
            return fail(s, E_EOF, n)
        start = pos
        c = buf[pos]
        value_node = node
        if c == 0x22:
            code = scan_string(s, pos, &pos, &escaped)
        elif c == 0x2D or is_digit(c):
            code = scan_number(s, pos, &pos)
        elif c == 0x74:
            code = scan_literal(s, pos, b"true", 4, &pos)
        elif c == 0x66:
            code = scan_literal(s, pos, b"false", 5, &pos)
        elif c == 0x6E:
            code = scan_literal(s, pos, b"null", 4, &pos)
        elif c == 0x7B or c == 0x5B:
            is_object = c == 0x7B
            if node < 0:
                descend = False
            elif is_object:
                descend = s.nodes[node].has_keys
            else:
                descend = s.nodes[node].has_items or s.nodes[node].last
            if not descend and not s.validate:
                code = skip_container(s, pos, &pos)
            else:
                code = push_frame(s)
                if code:
                    return code
                frame = &s.frames[s.depth - 1]
                frame.node = node
                frame.is_object = is_object
                frame.has_last = False
                frame.start = start
                frame.index = 0
                frame.elem_start = -1
                pos = skip_ws(buf, pos + 1, n)
                if pos >= n:
                    return fail(s, E_EOF, n)
                closer = 0x7D if is_object else 0x5D
                if buf[pos] != closer:
                    if is_object:
                        expecting_key = True
                        continue
                    node = index_child(s, frame.node, 0)
                    frame.elem_start = pos
                    continue
                pos += 1
                s.depth -= 1
                close_frame(s, frame, pos)
                value_node = -1  # close_frame recorded it
        else:
            return fail(s, E_VALUE, pos)
        if code:
            return code
        if value_node >= 0 and s.nodes[value_node].terminal:
            s.nodes[value_node].start = start
            s.nodes[value_node].end = pos

        # After a value: separators and closers, possibly several levels up.
        while True:
            if s.depth == 0:
                pos = skip_ws(buf, pos, n)
                if pos != n:
                    return fail(s, E_TRAILING, pos)
                return 0
            frame = &s.frames[s.depth - 1]
            if not frame.is_object and frame.node >= 0 and s.nodes[frame.node].last:
                frame.has_last = True
                frame.last_start = frame.elem_start
                frame.last_end = pos
            pos = skip_ws(buf, pos, n)
            if pos >= n:
                return fail(s, E_EOF, n)
            c = buf[pos]
            if c == 0x2C:
                pos = skip_ws(buf, pos + 1, n)
                if frame.is_object:
                    expecting_key = True
                else:
                    frame.index += 1
                    node = index_child(s, frame.node, frame.index)
                    frame.elem_start = pos
                break
            if frame.is_object:
                if c != 0x7D:
                    return fail(s, E_OBJECT_SEPARATOR, pos)
            elif c != 0x5D:
                return fail(s, E_ARRAY_SEPARATOR, pos)
            pos += 1
            s.depth -= 1
            close_frame(s, frame, pos)


# -- compiled path sets --------------------------------------------------------------------------------

cdef class _PathSet:
    """Paths compiled to a flat node array; cached, so a hot caller pays for it once."""

    cdef Node *nodes
    cdef int count
    cdef list keys  # owns the key bytes the nodes point into
    cdef list labels  # the str key of each node (for the duplicate-key message), or None
    cdef list ends  # (node index, path ends with -1, path ends with a key)

    def __dealloc__(self):
        free(self.nodes)


cdef _PathSet _build_path_set(object paths):
    root, ends = _compile(paths)
    cdef _PathSet compiled = _PathSet.__new__(_PathSet)
    order = [root]
    index_of = {id(root): 0}
    parents = [-1]
    cursor = 0
    while cursor < len(order):
        py_node = order[cursor]
        for child in list(py_node.keys.values()) + list(py_node.items.values()):
            index_of[id(child)] = len(order)
            order.append(child)
            parents.append(cursor)
        cursor += 1
    compiled.count = len(order)
    compiled.nodes = <Node *>malloc(compiled.count * sizeof(Node))
    if compiled.nodes == NULL:
        raise MemoryError()
    compiled.keys = []
    compiled.labels = []
    cdef Node *c_node
    cdef int i, parent
    for i in range(compiled.count):
        py_node = order[i]
        c_node = &compiled.nodes[i]
        c_node.first_child = -1
        c_node.next_sibling = -1
        c_node.is_key = isinstance(py_node.label, str)
        c_node.key = NULL
        c_node.key_len = 0
        c_node.index = 0
        if c_node.is_key:
            key = py_node.label.encode("utf-8", "surrogatepass")
            compiled.keys.append(key)
            c_node.key = PyBytes_AS_STRING(key)
            c_node.key_len = len(key)
        elif py_node.label is not None:
            c_node.index = py_node.label
        c_node.has_keys = bool(py_node.keys)
        c_node.has_items = bool(py_node.items)
        c_node.last = py_node.last
        c_node.terminal = py_node.terminal
        compiled.labels.append(py_node.label if c_node.is_key else None)
    # Children in the same order as the dicts of the pure twin (first-seen first).
    for i in range(compiled.count - 1, 0, -1):
        parent = parents[i]
        compiled.nodes[i].next_sibling = compiled.nodes[parent].first_child
        compiled.nodes[parent].first_child = i
    compiled.ends = [(index_of[id(node)], is_last, isinstance(node.label, str)) for node, is_last in ends]
    return compiled


cdef dict _path_cache = {}


cdef inline bint _plain_components(tuple paths):
    # bool hashes like int: (True,) must not hit the cache entry of (1,).
    for path in paths:
        if type(path) is not tuple:
            return False
        for component in <tuple>path:
            if type(component) is not str and type(component) is not int:
                return False
    return True


cdef _PathSet _path_set(object paths):
    cdef tuple key
    if type(paths) is tuple and _plain_components(<tuple>paths):
        key = <tuple>paths
        compiled = _path_cache.get(key)
        if compiled is None:
            compiled = _build_path_set(key)
            if len(_path_cache) >= PATH_CACHE_SIZE:
                _path_cache.clear()
            _path_cache[key] = compiled
        return <_PathSet>compiled
    return _build_path_set(paths)


# -- entry points --------------------------------------------------------------------------------------

cdef int _get_body(object body, Py_buffer *view) except -1:
    try:
        PyObject_GetBuffer(body, view, PyBUF_SIMPLE)
    except TypeError:
        raise TypeError(f"body must be bytes-like, not {type(body).__name__}") from None
    except BufferError:
        raise BufferError("body must be a contiguous buffer") from None
    return 0


cdef list _find(object body, object paths, bint validate, bint members):
    cdef Py_buffer view
    cdef Scanner s
    cdef Frame inline_frames[INLINE_FRAMES]
    cdef Node inline_nodes[INLINE_NODES]
    cdef int code, i
    cdef Node *node
    _get_body(body, &view)
    try:
        compiled = _path_set(paths)
        s.buf = <const uint8_t *>view.buf
        s.n = view.len
        s.validate = validate
        s.frames = inline_frames
        s.depth = 0
        s.capacity = INLINE_FRAMES
        s.frames_on_heap = False
        s.scratch = NULL
        s.scratch_capacity = 0
        s.error_offset = 0
        s.error_node = -1
        s.nodes = inline_nodes
        if compiled.count > INLINE_NODES:
            s.nodes = <Node *>malloc(compiled.count * sizeof(Node))
            if s.nodes == NULL:
                raise MemoryError()
        memcpy(s.nodes, compiled.nodes, compiled.count * sizeof(Node))
        for i in range(compiled.count):
            node = &s.nodes[i]
            node.seen = False
            node.start = -1
            node.end = -1
            node.key_start = -1
            node.last_start = -1
            node.last_end = -1
        try:
            if s.n >= NOGIL_MIN_BYTES:
                with nogil:
                    code = run(&s)
            else:
                code = run(&s)
            if code == E_NO_MEMORY:
                raise MemoryError()
            if code:
                raise make_error(code, s.error_offset, compiled.labels[s.error_node] if s.error_node >= 0 else None)
            spans = []
            for index, is_last, is_key in compiled.ends:
                node = &s.nodes[<int>index]
                if is_last:
                    spans.append((node.last_start, node.last_end) if node.last_start >= 0 else None)
                elif node.start < 0:
                    spans.append(None)
                elif members and is_key:
                    spans.append((node.key_start, node.end))
                else:
                    spans.append((node.start, node.end))
            return spans
        finally:
            if s.frames_on_heap:
                free(s.frames)
            free(s.scratch)
            if s.nodes != inline_nodes:
                free(s.nodes)
    finally:
        PyBuffer_Release(&view)


def find_spans(body, paths, *, validate=True):
    """Half-open byte spans of the values at ``paths`` (``None`` where absent), in one pass."""
    return _find(body, paths, validate, False)


def find_span(body, path, *, validate=True):
    """Half-open byte span of the value at ``path`` (a string's span includes its quotes), or ``None``."""
    return _find(body, (path,), validate, False)[0]


def find_member_spans(body, paths, *, validate=True):
    """Like :func:`find_spans`, but a path ending in a key spans the whole member, key to value."""
    return _find(body, paths, validate, True)


def splice(body, edits):
    """``body`` with each ``(start, end, replacement)`` applied; edits sorted, non-overlapping.

    Several edits may share a position (insertions land in the given order).
    One output allocation; pieces are copied straight into it.
    """
    cdef Py_buffer view
    cdef Py_buffer *pieces = NULL
    cdef Py_ssize_t *bounds = NULL
    cdef Py_ssize_t count = 0, acquired = 0, size, total, previous = 0, k, length
    cdef char *out
    _get_body(body, &view)
    try:
        size = view.len
        edit_list = edits if type(edits) is list else list(edits)
        count = len(edit_list)
        pieces = <Py_buffer *>malloc((count + 1) * sizeof(Py_buffer))
        bounds = <Py_ssize_t *>malloc((2 * count + 1) * sizeof(Py_ssize_t))
        if pieces == NULL or bounds == NULL:
            raise MemoryError()
        total = size
        for number in range(count):
            edit = edit_list[number]
            try:
                start, end, replacement = edit
            except (TypeError, ValueError):
                raise TypeError(f"edit {number} must be a (start, end, replacement) tuple") from None
            if isinstance(start, bool) or isinstance(end, bool) or not isinstance(start, int) or not isinstance(end, int):
                raise TypeError(f"edit {number}: start and end must be ints")
            if not 0 <= start <= end <= size:
                raise ValueError(f"edit {number}: need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})")
            if start < previous:
                raise ValueError(f"edit {number}: starts at {start}, before the previous edit ends ({previous})")
            try:
                PyObject_GetBuffer(replacement, &pieces[number], PyBUF_SIMPLE)
            except TypeError:
                raise TypeError(
                    f"edit {number}: replacement must be bytes-like, not {type(replacement).__name__}"
                ) from None
            except BufferError:
                raise BufferError(f"edit {number}: replacement must be a contiguous buffer") from None
            acquired += 1
            bounds[2 * number] = start
            bounds[2 * number + 1] = end
            previous = end
            total += pieces[number].len - (bounds[2 * number + 1] - bounds[2 * number])
        result = PyBytes_FromStringAndSize(NULL, total)
        out = PyBytes_AS_STRING(result)
        previous = 0
        with nogil:
            for k in range(count):
                length = bounds[2 * k] - previous
                memcpy(out, <const char *>view.buf + previous, length)
                out += length
                memcpy(out, pieces[k].buf, pieces[k].len)
                out += pieces[k].len
                previous = bounds[2 * k + 1]
            memcpy(out, <const char *>view.buf + previous, size - previous)
        return result
    finally:
        for k in range(acquired):
            PyBuffer_Release(&pieces[k])
        free(pieces)
        free(bounds)
        PyBuffer_Release(&view)


def check_token_b64(body, start=0, end=None):
    """Check that ``body[start:end]`` is ``prompt_token_ids_b64`` content; return the id count.

    Standard alphabet, ``=`` padding only at the end, length a multiple of 4,
    canonical (unused bits zero), decoding to a whole number of int32s; no
    escapes. Raises :class:`fastcore.TokenDecodeError` with the absolute offset.
    """
    cdef Py_buffer view
    cdef Py_ssize_t size, lo, hi, i, data_end, padding = 0, length, decoded
    cdef const uint8_t *buf
    cdef int last_value
    cdef uint8_t c
    _get_body(body, &view)
    try:
        size = view.len
        if end is None:
            end = size
        if not 0 <= start <= end <= size:
            raise ValueError(f"need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})")
        lo = start
        hi = end
        buf = <const uint8_t *>view.buf
        if hi - lo >= NOGIL_MIN_BYTES:
            with nogil:
                i = fc_js_b64_run(buf, lo, hi)
        else:
            i = fc_js_b64_run(buf, lo, hi)
        data_end = i
        while i < hi and buf[i] == 0x3D and padding < 2:
            padding += 1
            i += 1
        if i < hi:
            if padding:
                raise TokenDecodeError(f"base64 padding '=' before the end of the data (byte {data_end})", data_end)
            raise TokenDecodeError(f"invalid base64 character {chr(buf[i])!r} (byte {i})", i)
        length = hi - lo
        if length % 4:
            raise TokenDecodeError(f"base64 length {length} is not a multiple of 4", None)
        if padding:
            if data_end == lo:
                raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
            c = buf[data_end - 1]
            if c >= 0x61:
                last_value = c - 0x61 + 26
            elif c >= 0x41:
                last_value = c - 0x41
            elif c >= 0x30:
                last_value = c - 0x30 + 52
            elif c == 0x2B:
                last_value = 62
            else:
                last_value = 63
            if last_value & (0x0F if padding == 2 else 0x03):
                raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
        decoded = length // 4 * 3 - padding
        if decoded % 4:
            raise TokenDecodeError(f"base64 decodes to {decoded} bytes, not a whole number of int32 ids", None)
        return decoded // 4
    finally:
        PyBuffer_Release(&view)
