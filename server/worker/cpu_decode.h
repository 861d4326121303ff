/* CPU kernels of the torch worker's forward (float32, row-major, contiguous where not said).
 *
 * A small model's decode step on a CPU costs its ops' dispatch more than their arithmetic
 * (tiny: ~110 torch ops a step); these are the step's elementwise and attention parts as one C
 * call each, the matmuls staying torch's. server/worker/_cpu_kernels.pyx checks the tensors and
 * calls them; server/worker/cpu_kernels.py is the pure twin (torch ops, the same arithmetic).
 *
 * Reductions (a norm's sum of squares, attention's dot products, softmax's sum) add in eight
 * lanes, then the lanes in a fixed order: every path (generic, AVX2) adds the same numbers in
 * the same order, so their results are identical bit for bit on any CPU; no FMA contraction
 * (fp-contract=off below). Against torch's own reductions the order differs: within float32
 * rounding (tests/test_cpu_kernels.py states the bounds).
 */
#ifndef FASTCORE_CPU_DECODE_H
#define FASTCORE_CPU_DECODE_H

#include <stdint.h>

enum { FC_DECODE_GENERIC = 0, FC_DECODE_AVX2 = 1, FC_DECODE_PATHS = 2 };

/* Which path runs (FC_DECODE_*); fc_decode_use() picks one the CPU supports (returns 0, or -1
 * where it does not); fc_decode_supported() says whether it does. Initialised to the best. */
int fc_decode_path(void);
int fc_decode_use(int path);
int fc_decode_supported(int path);

/* out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, r < rows; out may be x. */
void fc_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps);

/* residual += x; x = rms_norm(residual): the residual stream and the next norm in one pass. */
void fc_add_rms_norm(float *x, float *residual, const float *w, int64_t rows, int64_t dim, float eps);

/* out[r, i] = silu(gu[r, i]) * gu[r, inner + i]: gu is [rows, 2 * inner] (gate then up). */
void fc_silu_mul(const float *gu, float *out, int64_t rows, int64_t inner);

/* Rotary embedding in place: heads [0, heads) of each row r (at x + r * row_stride, head h at
 * + h * dim) become x * cos[p] + roll(x, dim / 2) * signed_sin[p] (cos and signed_sin [table_rows,
 * dim]: the model's tables, sin's first half negated), p = positions[r], or r where positions is
 * NULL: the pure twin's arithmetic bit for bit. Returns 0, or 1 + r for the first row whose
 * position lies outside the table (checked before anything is written). */
int fc_rope(float *x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim, const float *cos,
            const float *signed_sin, const int64_t *positions, int64_t table_rows);

/* One decode token per sequence b < batch over the paged pool, its new K/V written first:
 *   q [b, heads, dim] at q + b * q_stride; k, v [b, kv_heads, dim] at k/v + b * kv_stride;
 *   pool_k, pool_v [slots, kv_heads, dim]; table [batch, width] block ids (block_size slots
 *   each); lengths[b] positions including the new token, which goes to the slot of position
 *   lengths[b] - 1. out [batch, heads, dim] contiguous. Query head h reads KV head h / (heads /
 *   kv_heads). Scores are (q . k) * scale, softmax in float32.
 * Returns 0; or 1 + b for the first sequence whose length or blocks fall outside the table or
 * the pool, or -1 where scratch memory ran out: both checked before anything is written. */
int fc_paged_decode(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                    float *pool_k, float *pool_v, int64_t slots, const int64_t *table, int64_t width,
                    int64_t block_size, const int64_t *lengths, int64_t batch, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale, float *out);

#endif
