/* y [M, N] = x [M, K] @ W.T for an int8 weight-only layer, W[n, k] = q[n, k] * s[n] (int8 codes,
 * one float32 scale per output row: fewbits' int8 preset, per channel or per tensor), for the few
 * rows of decoding: each output is the sum of q * x over its row in float32 (every code is exact
 * as a float32; the products and sums rounded as any GEMM's, in an order of its own: 16 lanes
 * with AVX-512, 8 with AVX2, 1 otherwise), multiplied by s[n] once. That equals x @ dequantize().T
 * up to float32 rounding (a product per output instead of one per weight), within the same
 * bound. The activations stay float32 (torch's _weight_int8pack_mm, used before, takes them in
 * bfloat16).
 *
 * The codes are read once per call for all M <= INT8W_MAX_M rows of x, 16 (8) at a time widened to
 * int32 and converted to float32 once for all of them; rows of W are shared out over torch's
 * OpenMP threads.
 *
 * Batches on CPUs with AMX (fb_int8w_tile_matmul): x in bfloat16, the codes as bfloat16 (exact)
 * 32 rows at a time on the tiles of tiles.h, each output's float32 sum times its row's scale. */
#include "tiles.h" /* first: it declares what it needs of the system headers */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "rowwalk.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define INT8W_MAX_M 8

/* out[m] = sum_k q[k] * x[m * ldx + k] for m < MR: MR a compile-time constant, each row's sum in
 * NACC accumulators (a multiply-add waits 4 cycles for the previous one into the same register:
 * one row of x needs four chains to keep the units busy, two rows two each, more rows one) */
#if defined(__AVX512F__)
#define VW 16
typedef __m512 V;
static inline V v_zero(void) { return _mm512_setzero_ps(); }
static inline V v_codes(const int8_t *q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))); }
static inline V v_fma(V a, const float *x, V c) { return _mm512_fmadd_ps(a, _mm512_loadu_ps(x), c); }
static inline V v_add(V a, V b) { return _mm512_add_ps(a, b); }
static inline float v_sum(V v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 V;
static inline V v_zero(void) { return _mm256_setzero_ps(); }
static inline V v_codes(const int8_t *q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))); }
static inline V v_fma(V a, const float *x, V c) { return _mm256_fmadd_ps(a, _mm256_loadu_ps(x), c); }
static inline V v_add(V a, V b) { return _mm256_add_ps(a, b); }
static inline float v_sum(V v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}
#endif
#ifdef VW
#define DEFINE_ROW_SUMS(MR, NACC)                                                                 \
    static void row_sums_##MR(const int8_t *q, const float *x, int64_t ldx, int64_t K, const int8_t *ahead, \
                              float *out) {                                                      \
        V acc[MR][NACC];                                                                         \
        for (int m = 0; m < MR; m++)                                                             \
            for (int a = 0; a < NACC; a++) acc[m][a] = v_zero();                                 \
        int64_t k = 0;                                                                           \
        for (; k + NACC * VW <= K; k += NACC * VW) {                                             \
            if (ahead && (k & 63) < NACC * VW) __builtin_prefetch(ahead + k); /* a line ROW_PREFETCH_WEIGHTS on */ \
            for (int a = 0; a < NACC; a++) {                                                     \
                const V w = v_codes(q + k + a * VW);                                             \
                for (int m = 0; m < MR; m++) acc[m][a] = v_fma(w, x + m * ldx + k + a * VW, acc[m][a]); \
            }                                                                                    \
        }                                                                                        \
        for (; k + VW <= K; k += VW) {                                                           \
            const V w = v_codes(q + k);                                                          \
            for (int m = 0; m < MR; m++) acc[m][0] = v_fma(w, x + m * ldx + k, acc[m][0]);        \
        }                                                                                        \
        for (int m = 0; m < MR; m++) {                                                           \
            V t = acc[m][0];                                                                     \
            for (int a = 1; a < NACC; a++) t = v_add(t, acc[m][a]);                              \
            out[m] = v_sum(t);                                                                   \
        }                                                                                        \
        for (; k < K; k++) /* the last K % VW columns */                                        \
            for (int m = 0; m < MR; m++) out[m] += (float)q[k] * x[m * ldx + k];                 \
    }
DEFINE_ROW_SUMS(1, 4)
DEFINE_ROW_SUMS(2, 2)
DEFINE_ROW_SUMS(3, 1)
DEFINE_ROW_SUMS(4, 1)
DEFINE_ROW_SUMS(5, 1)
DEFINE_ROW_SUMS(6, 1)
DEFINE_ROW_SUMS(7, 1)
DEFINE_ROW_SUMS(8, 1)
#endif

static void row_sums(const int8_t *q, const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *ahead,
                     float *out) {
#ifdef VW
    switch (M) {
    case 1: row_sums_1(q, x, ldx, K, ahead, out); return;
    case 2: row_sums_2(q, x, ldx, K, ahead, out); return;
    case 3: row_sums_3(q, x, ldx, K, ahead, out); return;
    case 4: row_sums_4(q, x, ldx, K, ahead, out); return;
    case 5: row_sums_5(q, x, ldx, K, ahead, out); return;
    case 6: row_sums_6(q, x, ldx, K, ahead, out); return;
    case 7: row_sums_7(q, x, ldx, K, ahead, out); return;
    default: row_sums_8(q, x, ldx, K, ahead, out); return;
    }
#else
    (void)ahead;
    for (int64_t m = 0; m < M; m++) out[m] = 0.0f;
    for (int64_t k = 0; k < K; k++)
        for (int64_t m = 0; m < M; m++) out[m] += (float)q[k] * x[m * ldx + k];
#endif
}

/* y [M, N] (row-major) for x [M, K] float32 with row stride ldx >= K, q [N, K] int8 row-major,
 * s [N] float32. Returns 0, or -1 for bad arguments (M outside 0..INT8W_MAX_M). */
int32_t fb_int8w_matmul(const float *x, int64_t ldx, int64_t M, const int8_t *q, const float *s, int64_t N,
                        int64_t K, float *y) {
    if (M < 0 || M > INT8W_MAX_M || N < 0 || K <= 0 || ldx < K) return -1;
    if (M == 0) return 0;
#pragma omp parallel if (N >= 64)
    {
        const RowWalk w = row_walk(N, THREAD_ID, TEAM_THREADS); /* rowwalk.h: four streams of rows */
        for (int64_t i = 0; i < w.visits; i++) {
            const int64_t n = row_walk_row(&w, i);
            if (n < 0) continue;
            float sums[INT8W_MAX_M];
            const int64_t ahead = row_walk_ahead(n, row_walk_end(&w, i), K, ROW_PREFETCH_BYTES(8));
            row_sums(q + n * K, x, ldx, M, K, ahead ? q + n * K + ahead : NULL, sums);
            for (int64_t m = 0; m < M; m++) y[m * N + n] = sums[m] * s[n];
        }
    }
    return 0;
}

/* A weight's fixed arguments of fb_int8w_matmul for one row of x: fb_int8w_row(r, x, y) (three
 * arguments: from Python each argument costs a conversion) */
typedef struct {
    const int8_t *q;
    const float *s;
    int64_t N, K;
} Int8WRow;
int32_t fb_int8w_row(const Int8WRow *r, const float *x, float *y) {
    return fb_int8w_matmul(x, r->K, 1, r->q, r->s, r->N, r->K, y);
}

int32_t fb_int8w_max_rows(void) { return INT8W_MAX_M; }

#if defined(FB_TILES)
/* an int8 weight for tiles_matmul: its codes as bfloat16 (exact) */
typedef struct {
    const int8_t *q;
    int64_t K;
} Int8Tiles;
static void int8_tile_rows(const void *ctx, int64_t n0, int64_t nv, int64_t kx, int64_t kp, uint16_t *wb, int64_t ldw,
                           int thread) {
    const Int8Tiles *c = (const Int8Tiles *)ctx;
    (void)thread;
    for (int64_t i = 0; i < nv; i++) {
        const int8_t *qr = c->q + (n0 + i) * c->K;
        uint16_t *o = wb + i * ldw;
        int64_t k = 0;
        for (; k + 16 <= kx; k += 16) { /* a code as float32 is exact, its high half its bfloat16 */
            const __m512i f = _mm512_castps_si512(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qr + k)))));
            _mm256_storeu_si256((__m256i *)(o + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(f, 16)));
        }
        for (; k < kx; k++) {
            const float f = (float)qr[k];
            uint32_t u;
            memcpy(&u, &f, 4);
            o[k] = (uint16_t)(u >> 16);
        }
        memset(o + kx, 0, sizeof(uint16_t) * (size_t)(kp - kx));
    }
}
#endif

/* y [M, N] float32 = (x [M, K] bfloat16 bit patterns, or float32 where x_f32 (rounded to bfloat16
 * in the call, see tiles.h's tiles_pack_x), row stride ldx >= K) @ q.T, each output's float32 sum
 * (the codes exact in bfloat16, their products with x exact, summed by TDPBF16PS or VDPBF16PS, see tiles.h)
 * times s[n]. Returns 0; -1 for bad arguments; -2 when its buffers cannot be allocated; -3 in a
 * build without AVX512-BF16. */
int32_t fb_int8w_tile_matmul(const void *x, int32_t x_f32, int64_t ldx, int64_t M, const int8_t *q, const float *s,
                             int64_t N, int64_t K, float *y) {
    if (M < 0 || N < 0 || K <= 0 || ldx < K) return -1;
#if !defined(FB_TILES)
    (void)x, (void)x_f32, (void)q, (void)s, (void)y;
    return -3;
#else
    if (M == 0 || N == 0) return 0;
    const Int8Tiles ctx = {q, K};
    return tiles_matmul(x, x_f32, ldx, K, M, N, (K + 31) / 32 * 32, int8_tile_rows, &ctx, s, y);
#endif
}

/* fb_int8w_tile_matmul for M contiguous float32 rows of x [M, r->K], with a weight's fixed
 * arguments (Int8WRow, as fb_int8w_row takes them) */
int32_t fb_int8w_tiles(const Int8WRow *r, const float *x, int64_t M, float *y) {
    return fb_int8w_tile_matmul(x, 1, r->K, M, r->q, r->s, r->N, r->K, y);
}
