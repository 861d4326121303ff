/* CPU kernels of the torch worker's forward; see cpu_decode.h for the contract.
 *
 * Each kernel's body is written once (static inline, always inlined) and compiled twice: a
 * generic x86-64 / any-CPU version and, on x86, an AVX2 one (a GCC/Clang target attribute, so
 * this file needs no -mavx2); fc_decode_init picks one at import from fastcore/include/cpu.h's
 * features. The loops are written in eight lanes so the compiler vectorises them without
 * reassociating anything: both versions compute the same numbers.
 */
#include "cpu_decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

#if FC_X86
#include <immintrin.h>
#endif

#define LANES 8
#define FC_INLINE static inline __attribute__((always_inline))

/* e^x in float32 within ~2 ulp (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2]):
 * libm's expf is a call per element (~5 ns: it was most of a softmax or SiLU here). The input is
 * clamped to float's range as x86's minps/maxps do (a NaN becomes the bound), so this scalar form
 * and exp8_avx2 below compute the same bits. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f

FC_INLINE float exp_lanes(float x) {
    x = x < EXP_HI ? x : EXP_HI;
    x = x > EXP_LO ? x : EXP_LO;
    float t = x * EXP_LOG2E + 0.5f;
    int32_t n = (int32_t)t;
    n -= (float)n > t; /* floor */
    float fn = (float)n;
    x = (x - fn * EXP_C1) - fn * EXP_C2;
    float y = EXP_P0;
    y = y * x + EXP_P1;
    y = y * x + EXP_P2;
    y = y * x + EXP_P3;
    y = y * x + EXP_P4;
    y = y * x + EXP_P5;
    y = (y * (x * x) + x) + 1.0f;
    int32_t bits = (int32_t)((uint32_t)(n + 127) << 23);
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#if FC_X86
__attribute__((target("avx2"))) static inline __m256 exp8_avx2(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    __m256 t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _mm256_set1_ps(0.5f));
    __m256i n = _mm256_cvttps_epi32(t);
    __m256 above = _mm256_cmp_ps(_mm256_cvtepi32_ps(n), t, _CMP_GT_OQ);
    n = _mm256_add_epi32(n, _mm256_castps_si256(above)); /* -1 where above */
    __m256 fn = _mm256_cvtepi32_ps(n);
    x = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(fn, _mm256_set1_ps(EXP_C1))),
                      _mm256_mul_ps(fn, _mm256_set1_ps(EXP_C2)));
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(EXP_P1));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(EXP_P2));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(EXP_P3));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(EXP_P4));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(EXP_P5));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2"))) static void silu_mul_row_avx2(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 gate = _mm256_loadu_ps(g + i);
        __m256 e = exp8_avx2(_mm256_xor_ps(gate, sign));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) o[i] = (g[i] / (1.0f + exp_lanes(-g[i]))) * u[i];
}
#endif

/* a . b over n floats: eight running lanes, then the lanes in a fixed order, then the tail */
FC_INLINE float dot_lanes(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[LANES] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    /* the order the AVX2 scores' hadd tree adds them (keys_dot_avx2) */
    return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

/* s[0] + ... + s[n - 1] in dot_lanes' order */
FC_INLINE float sum_lanes(const float *s, int64_t n) {
    float acc[LANES] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += s[i + l];
    float tail = 0.0f;
    for (; i < n; i++) tail += s[i];
    return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

FC_INLINE void rms_norm_body(const float *x, const float *restrict w, float *out, int64_t rows, int64_t dim,
                             float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float inv = 1.0f / sqrtf(dot_lanes(xr, xr, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

FC_INLINE void add_rms_norm_body(float *restrict x, float *restrict residual, const float *restrict w,
                                 int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        float *res = residual + r * dim;
        for (int64_t i = 0; i < dim; i++) res[i] += xr[i];
        float inv = 1.0f / sqrtf(dot_lanes(res, res, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) xr[i] = (res[i] * inv) * w[i];
    }
}

FC_INLINE void silu_mul_body(const float *restrict gu, float *restrict out, int64_t rows, int64_t inner,
                             int avx2) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inner;
        const float *u = g + inner;
        float *o = out + r * inner;
#if FC_X86
        if (avx2) {
            silu_mul_row_avx2(g, u, o, inner);
            continue;
        }
#endif
        for (int64_t i = 0; i < inner; i++) o[i] = (g[i] / (1.0f + exp_lanes(-g[i]))) * u[i];
    }
}

FC_INLINE void rope_body(float *x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim,
                         const float *restrict cos, const float *restrict signed_sin, const int64_t *positions) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        int64_t p = positions ? positions[r] : r;
        const float *c = cos + p * dim;
        const float *s = signed_sin + p * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *p = x + r * row_stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                float a = p[i], b = p[i + half];
                p[i] = a * c[i] + b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* 0 when every sequence's length and blocks lie inside the table and the pool, else 1 + b */
static int64_t check_tables(const int64_t *table, int64_t width, int64_t block_size, int64_t slots,
                            const int64_t *lengths, int64_t batch, int64_t *longest) {
    *longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t len = lengths[b];
        if (len < 1 || len > width * block_size) return 1 + b;
        for (int64_t i = 0; i < (len + block_size - 1) / block_size; i++) {
            int64_t block = table[b * width + i];
            if (block < 0 || block >= slots / block_size) return 1 + b;
        }
        if (len > *longest) *longest = len;
    }
    return 0;
}

/* scores[h * stride + o] = (q_h . K[o, h / group]) * scale for o < n positions of one block (keys:
 * the block's first slot, a row of kv_heads * dim apart), h < heads: every head of a position read
 * while its row is in cache */
FC_INLINE void keys_dot_generic(const float *q, const float *keys, int64_t row, int64_t n, int64_t heads,
                                int64_t group, int64_t dim, float scale, float *scores, int64_t stride) {
    for (int64_t o = 0; o < n; o++)
        for (int64_t h = 0; h < heads; h++)
            scores[h * stride + o] = dot_lanes(q + h * dim, keys + o * row + h / group * dim, dim) * scale;
}

#if FC_X86
/* The same for dim % 8 == 0, eight positions at a time: each position's eight lane sums (over
 * the dim in steps of 8, in order; the dim outside, the positions inside: eight independent sums,
 * not one chain a position) reduced by a hadd tree to one vector of eight scores, the lanes added
 * as dot_lanes adds them: ((0+1)+(2+3))+((4+5)+(6+7)). */
__attribute__((target("avx2"))) static void keys_dot_avx2(const float *q, const float *keys, int64_t row, int64_t n,
                                                          int64_t heads, int64_t group, int64_t dim, float scale,
                                                          float *scores, int64_t stride) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t o0 = 0; o0 < n; o0 += 8) {
        int64_t m = n - o0 < 8 ? n - o0 : 8;
        for (int64_t h = 0; h < heads; h++) {
            const float *qh = q + h * dim, *kh = keys + o0 * row + h / group * dim;
            __m256 p[8];
            for (int l = 0; l < 8; l++) p[l] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                __m256 qd = _mm256_loadu_ps(qh + d);
                if (m == 8) {
                    for (int l = 0; l < 8; l++)
                        p[l] = _mm256_add_ps(p[l], _mm256_mul_ps(qd, _mm256_loadu_ps(kh + l * row + d)));
                } else {
                    for (int l = 0; l < m; l++)
                        p[l] = _mm256_add_ps(p[l], _mm256_mul_ps(qd, _mm256_loadu_ps(kh + l * row + d)));
                }
            }
            __m256 h01 = _mm256_hadd_ps(p[0], p[1]), h23 = _mm256_hadd_ps(p[2], p[3]);
            __m256 h45 = _mm256_hadd_ps(p[4], p[5]), h67 = _mm256_hadd_ps(p[6], p[7]);
            __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
            __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                        _mm256_permute2f128_ps(h0123, h4567, 0x31));
            sums = _mm256_mul_ps(sums, vscale);
            if (m == 8) {
                _mm256_storeu_ps(scores + h * stride + o0, sums);
            } else {
                float out[8];
                _mm256_storeu_ps(out, sums);
                memcpy(scores + h * stride + o0, out, (size_t)m * sizeof(float));
            }
        }
    }
}

/* max of s[0..n) (exact in any order) */
__attribute__((target("avx2"))) static float max_avx2(const float *s, int64_t n) {
    float top = s[0];
    int64_t j = 0;
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    }
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}

/* s[j] = e^(s[j] - top) and their sum, in one pass: the exps eight at a time summed in lanes, the
 * rest as exp_lanes; the sum added as sum_lanes adds it */
__attribute__((target("avx2"))) static float exp_sum_avx2(float *s, int64_t n, float top) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float tail = 0.0f;
    for (; j < n; j++) tail += (s[j] = exp_lanes(s[j] - top));
    acc = _mm256_hadd_ps(acc, acc);
    acc = _mm256_hadd_ps(acc, acc); /* ((0+1)+(2+3)) in the low half, ((4+5)+(6+7)) in the high */
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1))) + tail;
}

/* out[h] = inv[h] * sum over positions j of weights[h * len + j] * V[j, h / group], dim % 8 == 0:
 * eight of the dim in a register, up to eight such (head, dim chunk) sums at once over the
 * positions (independent chains), each adding its positions in order as the generic loop does */
#define WEIGH_TILE 8
__attribute__((target("avx2"))) static void weigh_values_avx2(const float *weights, const float *inv,
                                                              const float *pool_v, const int64_t *table,
                                                              int64_t block_size, int64_t row, int64_t len,
                                                              int64_t heads, int64_t group, int64_t dim, float *out) {
    int64_t chunks = dim / 8, sums = heads * chunks;
    for (int64_t t0 = 0; t0 < sums; t0 += WEIGH_TILE) {
        int64_t tile = sums - t0 < WEIGH_TILE ? sums - t0 : WEIGH_TILE;
        __m256 acc[WEIGH_TILE];
        const float *w[WEIGH_TILE];
        int64_t at[WEIGH_TILE];
        for (int64_t t = 0; t < tile; t++) {
            int64_t h = (t0 + t) / chunks, d = (t0 + t) % chunks * 8;
            acc[t] = _mm256_setzero_ps();
            w[t] = weights + h * len;
            at[t] = h / group * dim + d;
        }
        for (int64_t j0 = 0, i = 0; j0 < len; j0 += block_size, i++) {
            const float *values = pool_v + table[i] * block_size * row;
            int64_t n = len - j0 < block_size ? len - j0 : block_size;
            for (int64_t o = 0; o < n; o++) {
                const float *val = values + o * row;
                for (int64_t t = 0; t < tile; t++)
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(w[t][j0 + o]), _mm256_loadu_ps(val + at[t])));
            }
        }
        for (int64_t t = 0; t < tile; t++) {
            int64_t h = (t0 + t) / chunks, d = (t0 + t) % chunks * 8;
            _mm256_storeu_ps(out + h * dim + d, _mm256_mul_ps(acc[t], _mm256_set1_ps(inv[h])));
        }
    }
}
#endif

/* each head's score row (len long) -> its exps, and inv[h] = 1 / their sum (the weights are the
 * exps times inv: applied to the weighed values, one multiply a value instead of one a score) */
FC_INLINE void softmax_rows(float *scores, float *inv, int64_t heads, int64_t len, int avx2) {
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * len;
        float sum;
#if FC_X86
        if (avx2) {
            sum = exp_sum_avx2(s, len, max_avx2(s, len));
        } else
#endif
        {
            float top = s[0];
            for (int64_t j = 1; j < len; j++) top = s[j] > top ? s[j] : top;
            for (int64_t j = 0; j < len; j++) s[j] = exp_lanes(s[j] - top);
            sum = sum_lanes(s, len);
        }
        inv[h] = 1.0f / sum;
    }
}

/* one sequence: its new K/V written, then every head's scores, softmax and weighed values */
FC_INLINE void decode_one(const float *q, const float *k, const float *v, float *pool_k, float *pool_v,
                          const int64_t *table, int64_t block_size, int64_t len, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, float *scores, float *out, int avx2) {
    int64_t group = heads / kv_heads, row = kv_heads * dim;
    int64_t last = len - 1;
    int64_t slot = table[last / block_size] * block_size + last % block_size;
    memcpy(pool_k + slot * row, k, (size_t)row * sizeof(float));
    memcpy(pool_v + slot * row, v, (size_t)row * sizeof(float));
    float *inv = scores + heads * len;
    for (int64_t j0 = 0, i = 0; j0 < len; j0 += block_size, i++) {
        const float *keys = pool_k + table[i] * block_size * row;
        int64_t n = len - j0 < block_size ? len - j0 : block_size;
#if FC_X86
        if (avx2 && dim % 8 == 0) {
            keys_dot_avx2(q, keys, row, n, heads, group, dim, scale, scores + j0, len);
            continue;
        }
#endif
        keys_dot_generic(q, keys, row, n, heads, group, dim, scale, scores + j0, len);
    }
    softmax_rows(scores, inv, heads, len, avx2);
#if FC_X86
    if (avx2 && dim % 8 == 0) {
        weigh_values_avx2(scores, inv, pool_v, table, block_size, row, len, heads, group, dim, out);
        return;
    }
#endif
    memset(out, 0, (size_t)(heads * dim) * sizeof(float));
    for (int64_t j0 = 0, i = 0; j0 < len; j0 += block_size, i++) {
        const float *values = pool_v + table[i] * block_size * row;
        int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t o = 0; o < n; o++)
            for (int64_t h = 0; h < heads; h++) {
                float weight = scores[h * len + j0 + o];
                float *acc = out + h * dim;
                const float *val = values + o * row + h / group * dim;
                for (int64_t d = 0; d < dim; d++) acc[d] += weight * val[d];
            }
    }
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < dim; d++) out[h * dim + d] *= inv[h];
}

FC_INLINE int paged_decode_body(const float *q, int64_t q_stride, const float *k, const float *v,
                                int64_t kv_stride, float *pool_k, float *pool_v, int64_t slots,
                                const int64_t *table, int64_t width, int64_t block_size,
                                const int64_t *lengths, int64_t batch, int64_t heads, int64_t kv_heads,
                                int64_t dim, float scale, float *out, int avx2) {
    int64_t longest;
    int64_t bad = check_tables(table, width, block_size, slots, lengths, batch, &longest);
    if (bad) return (int)bad;
    float *scores = malloc((size_t)(heads * (longest + 1)) * sizeof(float)); /* and inv */
    if (!scores) return -1;
    for (int64_t b = 0; b < batch; b++)
        decode_one(q + b * q_stride, k + b * kv_stride, v + b * kv_stride, pool_k, pool_v, table + b * width,
                   block_size, lengths[b], heads, kv_heads, dim, scale, scores, out + b * heads * dim, avx2);
    free(scores);
    return 0;
}

/* ------------------------------------------------------------ the two builds, and the choice */

#define FC_KERNELS(SUFFIX, ATTR, AVX2)                                                                          \
    ATTR static void rms_norm_##SUFFIX(const float *x, const float *w, float *out, int64_t rows,          \
                                       int64_t dim, float eps) {                                           \
        rms_norm_body(x, w, out, rows, dim, eps);                                                         \
    }                                                                                                      \
    ATTR static void add_rms_norm_##SUFFIX(float *x, float *residual, const float *w, int64_t rows,       \
                                           int64_t dim, float eps) {                                       \
        add_rms_norm_body(x, residual, w, rows, dim, eps);                                                \
    }                                                                                                      \
    ATTR static void silu_mul_##SUFFIX(const float *gu, float *out, int64_t rows, int64_t inner) {        \
        silu_mul_body(gu, out, rows, inner, AVX2);                                                            \
    }                                                                                                      \
    ATTR static void rope_##SUFFIX(float *x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim, \
                                   const float *cos, const float *signed_sin, const int64_t *positions) {  \
        rope_body(x, rows, heads, row_stride, dim, cos, signed_sin, positions);                           \
    }                                                                                                      \
    ATTR static int paged_decode_##SUFFIX(const float *q, int64_t q_stride, const float *k, const float *v, \
                                          int64_t kv_stride, float *pool_k, float *pool_v, int64_t slots,   \
                                          const int64_t *table, int64_t width, int64_t block_size,          \
                                          const int64_t *lengths, int64_t batch, int64_t heads,             \
                                          int64_t kv_heads, int64_t dim, float scale, float *out) {         \
        return paged_decode_body(q, q_stride, k, v, kv_stride, pool_k, pool_v, slots, table, width,       \
                                 block_size, lengths, batch, heads, kv_heads, dim, scale, out, AVX2);      \
    }

FC_KERNELS(generic, , 0)
#if FC_X86
FC_KERNELS(avx2, __attribute__((target("avx2"))), 1)
#endif

typedef struct {
    void (*rms_norm)(const float *, const float *, float *, int64_t, int64_t, float);
    void (*add_rms_norm)(float *, float *, const float *, int64_t, int64_t, float);
    void (*silu_mul)(const float *, float *, int64_t, int64_t);
    void (*rope)(float *, int64_t, int64_t, int64_t, int64_t, const float *, const float *, const int64_t *);
    int (*paged_decode)(const float *, int64_t, const float *, const float *, int64_t, float *, float *,
                        int64_t, const int64_t *, int64_t, int64_t, const int64_t *, int64_t, int64_t,
                        int64_t, int64_t, float, float *);
} kernels_t;

static const kernels_t PATHS[FC_DECODE_PATHS] = {
    {rms_norm_generic, add_rms_norm_generic, silu_mul_generic, rope_generic, paged_decode_generic},
#if FC_X86
    {rms_norm_avx2, add_rms_norm_avx2, silu_mul_avx2, rope_avx2, paged_decode_avx2},
#else
    {rms_norm_generic, add_rms_norm_generic, silu_mul_generic, rope_generic, paged_decode_generic},
#endif
};

static int path = -1;

int fc_decode_supported(int which) {
    if (which == FC_DECODE_GENERIC) return 1;
    return which == FC_DECODE_AVX2 && FC_X86 && (fc_cpu_features() & FC_CPU_AVX2) != 0;
}

int fc_decode_use(int which) {
    if (which < 0 || which >= FC_DECODE_PATHS || !fc_decode_supported(which)) return -1;
    path = which;
    return 0;
}

int fc_decode_path(void) {
    if (path < 0) path = fc_decode_supported(FC_DECODE_AVX2) ? FC_DECODE_AVX2 : FC_DECODE_GENERIC;
    return path;
}

void fc_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    PATHS[fc_decode_path()].rms_norm(x, w, out, rows, dim, eps);
}

void fc_add_rms_norm(float *x, float *residual, const float *w, int64_t rows, int64_t dim, float eps) {
    PATHS[fc_decode_path()].add_rms_norm(x, residual, w, rows, dim, eps);
}

void fc_silu_mul(const float *gu, float *out, int64_t rows, int64_t inner) {
    PATHS[fc_decode_path()].silu_mul(gu, out, rows, inner);
}

int fc_rope(float *x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim, const float *cos,
            const float *signed_sin, const int64_t *positions, int64_t table_rows) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t p = positions ? positions[r] : r;
        if (p < 0 || p >= table_rows) return (int)(1 + r);
    }
    PATHS[fc_decode_path()].rope(x, rows, heads, row_stride, dim, cos, signed_sin, positions);
    return 0;
}

int fc_paged_decode(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                    float *pool_k, float *pool_v, int64_t slots, const int64_t *table, int64_t width,
                    int64_t block_size, const int64_t *lengths, int64_t batch, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale, float *out) {
    return PATHS[fc_decode_path()].paged_decode(q, q_stride, k, v, kv_stride, pool_k, pool_v, slots, table,
                                                width, block_size, lengths, batch, heads, kv_heads, dim, scale,
                                                out);
}
